// linear: out[i, n] (+)= sum_k x[i, k] * w[n, k] over the sub-rows i of every real row. A block of 8 warps takes
// 8 / S groups of 2 or 4 output features and splits K into S slices (S from the launch, chosen from K alone: enough
// weight bytes in flight per warp without long serial chains); each warp reads its slice of its weight rows once
// per tile of up to 16 sub-rows (16-byte streaming loads, up to 4 chunks per row in flight per lane) and the S
// partial sums are added in slice order (`slice_dots`, `slice_sum`): a row's result never depends on the other
// rows or on how many there are.
#include "common.cuh"

// Blocks block, block + nblocks, ... of a launch of nblocks blocks (each per_block = 8 / S * LIN_NPW output features
// in turn): `linear`'s grid-stride loop over its own grid, and `linear_multi`'s over one matrix's share of its grid.
// The values of an output do not depend on which block computes it.
template <int T, int LIN_NPW, int U>
DEV void linear_t(const FpLinear& p, u32 total, u32 block, u32 nblocks) {
    __shared__ float part[SPLIT_WARPS][LIN_NPW][T];
    const FpCommon& c = p.c;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 S = p.split == 0 ? 1 : p.split;
    const u32 G = SPLIT_WARPS / S, g = warp / S;
    const u32 per_block = G * LIN_NPW;
    const float* X = fptr(p.x);
    float* O = fptr(p.out);
    const bool wvec = (p.k & 7) == 0 && (p.w & 15) == 0;
    for (u32 nb0 = block * per_block; nb0 < p.n; nb0 += nblocks * per_block) {
        const u32 n0 = nb0 + g * LIN_NPW;
        const u32 nm = n0 >= p.n ? 0 : (p.n - n0 < LIN_NPW ? p.n - n0 : LIN_NPW);
        const bf16_t* w[LIN_NPW];
#pragma unroll
        for (int m = 0; m < LIN_NPW; m++)
            w[m] = (const bf16_t*)p.w + (u64)(nm == 0 ? 0 : n0 + ((u32)m < nm ? m : 0)) * p.k;
        for (u32 i0 = 0; i0 < total; i0 += T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < total && row_ok(c, (i0 + t) / p.sub, p.gathered);
            slice_dots<T, LIN_NPW, U>(w, nm, X + (u64)i0 * p.k, p.k, ok, p.k, S, wvec, lane, warp, part);
            __syncthreads();
            for (u32 q = threadIdx.x; q < G * LIN_NPW * T; q += blockDim.x) {
                const u32 gg = q / (LIN_NPW * T), m = (q / T) % LIN_NPW, t = q % T;
                const u32 n = nb0 + gg * LIN_NPW + m;
                if (n >= p.n || i0 + t >= total || !row_ok(c, (i0 + t) / p.sub, p.gathered)) continue;
                const float v = slice_sum<T, LIN_NPW>(part, gg, S, m, t);
                float* o = O + (u64)(i0 + t) * p.n + n;
                *o = p.accumulate ? *o + v : v;
            }
            __syncthreads();
        }
    }
}

// One entry point per row tile T (linear_t1 .. linear_t16, picked by the launch from the row count): each gets the
// registers its tile needs, so small tiles keep their occupancy.
template <int T>
DEV void linear_entry(const FpLinear& p, u32 block, u32 nblocks) {
    const u32 total = (p.gathered ? p.c.nstreams : p.c.nstreams * p.c.window) * p.sub;
    // Features per warp and chunks in flight per tile (neither changes a row's arithmetic): 2 features for one or
    // two rows (fewer registers, more warps resident), 4 beyond (x reused over more weight rows).
    if (T <= 2)
        linear_t<T, 2, 4>(p, total, block, nblocks);
    else if (T <= 4)
        linear_t<T, 4, 4>(p, total, block, nblocks);
    else
        linear_t<T, 4, 2>(p, total, block, nblocks);
}
extern "C" __global__ void linear_t1(const FpLinear p) { pdl_start(); linear_entry<1>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_t2(const FpLinear p) { pdl_start(); linear_entry<2>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_t4(const FpLinear p) { pdl_start(); linear_entry<4>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_t8(const FpLinear p) { pdl_start(); linear_entry<8>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_t16(const FpLinear p) { pdl_start(); linear_entry<16>(p, blockIdx.x, gridDim.x); }

// linear_multi: up to FP_MAX_LINEARS sibling `linear`s reading the same x, one launch (the runtime fuses consecutive
// Linear nodes, runtime/src/cuda/fuse.rs). Block b belongs to matrix m where b falls in m's range of the prefix sums
// of blocks[] (blocks[m] = m's own `linear` grid, same row tile T and split S); it runs `linear_t` on m's
// parameters as block b - start(m) of blocks[m]. So every output element is computed with exactly the arithmetic
// of the unfused `linear` launch (same S from K, same slices, per-lane k order, warp tree and slice sum):
// bit-identical results, and row invariance as `linear`'s.
template <int T>
DEV void linear_multi_entry(const FpLinearMulti& p) {
    u32 b = blockIdx.x;
    FpLinear q;
    q.c = p.c;
    q.x = p.x;
    q.k = p.k;
    q.sub = p.sub;
    q.gathered = p.gathered;
    q.split = p.split;
    q.w = 0;
    q.out = 0;
    q.n = 0;
    q.accumulate = 0;
    u32 nblocks = 0;
    bool found = false;
    // Unrolled with constant indices (no dynamic indexing of the parameter arrays).
#pragma unroll
    for (int i = 0; i < FP_MAX_LINEARS; i++) {
        if (!found && (u32)i < p.count) {
            if (b < p.blocks[i]) {
                found = true;
                q.w = p.w[i];
                q.out = p.out[i];
                q.n = p.n[i];
                q.accumulate = p.accumulate[i];
                nblocks = p.blocks[i];
            } else {
                b -= p.blocks[i];
            }
        }
    }
    if (!found) return;  // a grid larger than the blocks' sum (not launched so)
    linear_entry<T>(q, b, nblocks);
}
extern "C" __global__ void linear_multi_t1(const FpLinearMulti p) { pdl_start(); linear_multi_entry<1>(p); }
extern "C" __global__ void linear_multi_t2(const FpLinearMulti p) { pdl_start(); linear_multi_entry<2>(p); }
extern "C" __global__ void linear_multi_t4(const FpLinearMulti p) { pdl_start(); linear_multi_entry<4>(p); }
extern "C" __global__ void linear_multi_t8(const FpLinearMulti p) { pdl_start(); linear_multi_entry<8>(p); }
extern "C" __global__ void linear_multi_t16(const FpLinearMulti p) { pdl_start(); linear_multi_entry<16>(p); }
