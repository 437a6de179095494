// The body of the decode-shaped linear kernels (linear.cu's linear and linear_multi, mxfp8.cu's linear_mxfp8):
// out[i, n] (+)= sum_k x[i, k] * w[n, k] over the sub-rows i of every real row, for any weight format whose rows
// provide the members of common.cuh's Bf16Row (load, zero, unpack, at, from). A block of 8 warps takes 8 / S groups
// of NPW output features and splits K into S slices (S from the launch, chosen from K alone); each warp reads its
// slice of its weight rows once per tile of up to T sub-rows and the S partial sums are added in slice order
// (`slice_dots_rows`, `slice_sum`): a row's result never depends on the other rows or on how many there are, nor on
// NPW, U or the format (beyond the values it decodes).
#pragma once
#include "common.cuh"

// A BF16 weight matrix [n, k], row-major.
struct Bf16Mat {
    const bf16_t* w;
    u32 k;
    typedef Bf16Row row_t;
    DEV row_t row(u64 n) const {
        Bf16Row r;
        r.p = w + n * k;
        return r;
    }
};

// What a linear launch computes besides its weights (FpLinear's other fields).
struct LinearArgs {
    u64 x, out;
    u32 k, n, sub, accumulate, gathered, split;
};

// LinearArgs from a parameter struct with those fields (FpLinear, FpLinearMxfp8).
template <class P>
DEV LinearArgs linear_args(const P& p) {
    LinearArgs a;
    a.x = p.x;
    a.out = p.out;
    a.k = p.k;
    a.n = p.n;
    a.sub = p.sub;
    a.accumulate = p.accumulate;
    a.gathered = p.gathered;
    a.split = p.split;
    return a;
}

// Blocks block, block + nblocks, ... of a launch of nblocks blocks (each 8 / S * NPW output features in turn): a
// linear's grid-stride loop over its own grid, or linear_multi's over one matrix's share of its grid. The values of
// an output do not depend on which block computes it. wvec: K % 8 == 0 and the rows aligned for their loads.
template <int T, int NPW, int U, class Mat>
DEV void linear_rows(const FpCommon& c, const Mat& mat, bool wvec, const LinearArgs& a, u32 total, u32 block,
                     u32 nblocks) {
    __shared__ float part[SPLIT_WARPS][NPW][T];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 S = a.split == 0 ? 1 : a.split;
    const u32 G = SPLIT_WARPS / S, g = warp / S;
    const u32 per_block = G * NPW;
    const float* X = fptr(a.x);
    float* O = fptr(a.out);
    for (u32 nb0 = block * per_block; nb0 < a.n; nb0 += nblocks * per_block) {
        const u32 n0 = nb0 + g * NPW;
        const u32 nm = n0 >= a.n ? 0 : (a.n - n0 < NPW ? a.n - n0 : NPW);
        typename Mat::row_t w[NPW];
#pragma unroll
        for (int m = 0; m < NPW; m++) w[m] = mat.row(nm == 0 ? 0 : n0 + ((u32)m < nm ? m : 0));
        for (u32 i0 = 0; i0 < total; i0 += T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < total && row_ok(c, (i0 + t) / a.sub, a.gathered);
            slice_dots_rows<T, NPW, U>(w, nm, X + (u64)i0 * a.k, a.k, ok, a.k, S, wvec, lane, warp, part);
            __syncthreads();
            for (u32 q = threadIdx.x; q < G * NPW * T; q += blockDim.x) {
                const u32 gg = q / (NPW * T), m = (q / T) % NPW, t = q % T;
                const u32 n = nb0 + gg * NPW + m;
                if (n >= a.n || i0 + t >= total || !row_ok(c, (i0 + t) / a.sub, a.gathered)) continue;
                const float v = slice_sum<T, NPW>(part, gg, S, m, t);
                float* o = O + (u64)(i0 + t) * a.n + n;
                *o = a.accumulate ? *o + v : v;
            }
            __syncthreads();
        }
    }
}

// Rows to compute in a launch of this shape: every sub-row of every row (or of every stream's row when gathered).
DEV u32 linear_total(const FpCommon& c, u32 sub, u32 gathered) {
    return (gathered ? c.nstreams : c.nstreams * c.window) * sub;
}
