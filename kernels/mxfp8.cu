// linear_mxfp8: out[i, n] (+)= sum_k x[i, k] * w[n, k] with MXFP8 weights (issue 8): E4M3 codes [n, k] (one byte
// each) and one E8M0 scale byte per 32 consecutive inputs of each output row ([n, ceil(k / 32)]); a weight's value
// is e4m3(code) * 2^(s - 127). Activations and results f32.
//
// Its own body (not linear.cuh's): the decode is integer bit arithmetic and the scale is applied once per 16 codes,
// so the result is not bit-identical to `linear` on the same values (it matches the CPU twin within the GPU-check
// tolerance, like every kernel). Row invariant: a row's arithmetic depends only on the weight's shape [n, k] (the
// launch's split S comes from it: runtime/src/cuda/launch/linear.rs `mx_split`), never on the other rows or their count.
//
// Launch (linear's parameters, its own shape): block of 8 warps = 8 / S groups of MX_NPW = 4 output
// features x S slices of K; grid ceil(n / (4 * 8 / S)). Slice s of K is [s * per, (s + 1) * per) with
// per = ceil(K / 32 / S) * 32 (cut at K): slices start on scale groups.
//
// Per (output n, row i), by one warp over its slice: lane l takes the chunks of 16 codes at l * 16 + 512 j
// (j = 0, 1, ... in order; a chunk lies in one scale group). For each chunk the lane computes the chunk's partial
//   p = d_0 x_0, then p = fma(d_e, x_e, p) for e = 1 .. 15 (ascending k),
// with d_e = e4m3(code_e) * 2^-120 decoded exactly by integer bit arithmetic (mx_top), and adds it to its sum:
//   acc = fma(p, 2^(s - 7), acc)            for s <= 134,
//   acc = fma(p * 2^120, 2^(s - 127), acc)   for s > 134 (2^(s - 7) is above the f32 range there);
// both factors are exact powers of two, so the group's weights enter as their exact values e4m3 * 2^(s - 127).
// Then the warp tree (warp_sum) and the S slices added in slice order. Chunks in flight per lane and row (U), the
// row tile T and the loop order of the tile's entry point never change that arithmetic.
//
// Range (d_e * x_e in units of 2^-120): |d_e| <= 448 * 2^-120, so the partial products are tiny and often f32
// subnormals (a product below 2^-126 in magnitude: e.g. any code below 2^-6 times |x| < 1). Subnormals are kept:
// the fma/mul are inline PTX `fma.rn.f32` / `mul.rn.f32` without `.ftz`, and the modules are compiled without
// -ftz / fast math (compiler/src/nvrtc.rs). A result in the subnormal range is rounded to a multiple of 2^-149: an
// absolute error of at most 2^-150 per fma in units of 2^-120, i.e. 2^(s - 157) in the output. A group's largest
// weight is at least 224 * 2^(s - 127) (the re-coder's smallest scale; s = 0 only for groups below 448 * 2^-127), so
// that is at most 2^-37.8 of the group's largest weight, or 2^-37.8 / |x| of its largest product with x: below f32's
// own rounding (2^-24) while |x| > 2^-14 (6e-5), and at the 1e-3 tolerance only if every activation were below
// about 2^-28 (4e-9). The activations of these linears are of order 1 (normed states, attention outputs);
// runtime/src/mxfp8.rs `kernel_mirror` checks the bound with x down to 1e-9. The normal f32 range is not a limit:
// |p| <= 16 * 448 * 2^-120 * max|x| and p * 2^120 stays finite for |x| < 2^114. Subnormal codes (exponent field 0)
// decode to f32 subnormals exactly (no special case). NaN codes (0x7F, 0xFF) and the NaN scale 0xFF never occur in
// packed weights (runtime/src/mxfp8.rs `pack_exact`: scales <= 247); they decode to finite or infinite garbage.
#include "common.cuh"

typedef unsigned char u8_t;

// Output features per warp (the launch's grid assumes it: runtime/src/cuda/launch/linear.rs `MX_NPW`).
#define MX_NPW 4

// One byte through the read-only path (scales: the two lanes of a group read the same byte).
DEV u32 ldg_u8(const void* p) {
    u32 r;
    asm("ld.global.nc.u8 %0, [%1];" : "=r"(r) : "l"(p));
    return r & 0xffu;
}

// f32 arithmetic that keeps subnormal operands and results whatever the compiler flags (no .ftz), and that the
// compiler never contracts or reorders.
DEV float mx_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
DEV float mx_fma(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

// e4m3(code) * 2^-120 for the E4M3 code in the top byte of w (bits 24..31), exactly: the arithmetic shift moves the
// 7 exponent/mantissa bits to f32 bits 20..26 (f32 exponent field = the code's 4-bit exponent field, mantissa = its
// 3 bits on top) and copies the sign into bits 27..31; the mask keeps bit 31 (sign) and bits 20..26 (zeros in
// 27..30 and 0..19). Normal codes (field e >= 1): 2^(e - 127) * (1 + m/8) = e4m3 * 2^-120; subnormal codes (e = 0):
// the f32 subnormal m * 2^20 * 2^-149 = (m * 2^-9) * 2^-120; zero codes: +-0. runtime/src/mxfp8.rs mirrors it
// (`kernel_decode`) and checks all 256 codes against e4m3_decode.
DEV float mx_top(u32 w) { return __uint_as_float((u32)((int)w >> 4) & 0x87f00000u); }

// The 16 codes of a 16-byte load (code k + e in byte e, little-endian), in order: d[e] = e4m3(code) * 2^-120.
DEV void mx_decode16(const uint4 c, float* d) {
    const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        d[4 * i] = mx_top(w[i] << 24);
        d[4 * i + 1] = mx_top(w[i] << 16);
        d[4 * i + 2] = mx_top(w[i] << 8);
        d[4 * i + 3] = mx_top(w[i]);
    }
}

// A chunk's partial in units of 2^-120: d[0] x[0], then fused multiply-adds in ascending k.
DEV float mx_dot16(const float* d, const float* x) {
    float s = mx_mul(d[0], x[0]);
#pragma unroll
    for (int e = 1; e < 16; e++) s = mx_fma(d[e], x[e], s);
    return s;
}

// Sixteen f32 activations from a 16-byte aligned address, in order.
DEV void mx_load_x16(const float* p, float* x) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 v = ((const float4*)p)[i];
        x[4 * i] = v.x;
        x[4 * i + 1] = v.y;
        x[4 * i + 2] = v.z;
        x[4 * i + 3] = v.w;
    }
}

// A scale byte s as applied to a partial in units of 2^-120: f = 2^(s - 7) (f32 exponent field s + 120 <= 254) for
// s <= 134; above, big and f = 2^(s - 127) (the partial first times 2^120, exact). s = 0 gives 2^-7.
struct MxScale {
    float f;
    bool big;
};
DEV MxScale mx_scale(u32 s) {
    MxScale r;
    r.big = s > 134u;
    r.f = __uint_as_float((r.big ? s : s + 120u) << 23);
    return r;
}
// acc + p * 2^(s - 7), one rounding (the product of p and a power of two is exact in range).
DEV float mx_add_group(float p, const MxScale& sc, float acc) {
    if (sc.big) p = mx_mul(p, __uint_as_float(0x7b800000u));  // 2^120
    return mx_fma(p, sc.f, acc);
}

// Slice sl of S over K (codes): [ka, kb), per = ceil(K / 32 / S) * 32, cut at K.
DEV void mx_slice_bounds(u32 K, u32 S, u32 sl, u32& ka, u32& kb) {
    const u32 per = ((K + 31) / 32 + S - 1) / S * 32;
    ka = sl * per < K ? sl * per : K;
    kb = ka + per < K ? ka + per : K;
}

// res[m][t] = dot(w[m], x[t]) over K codes for NPW weight rows (codes[m] and scales[m] at the slice start, which
// lies on a scale group; rows past the matrix point at row 0 and their results are dropped) and T activation rows
// (ok[t]; x row t at X + t * xs), by one warp, in the order of the file's top comment. Vector path (vec: K % 16 ==
// 0, the weight rows and x 16-byte aligned): U chunks of every row in flight per lane. Scalar path (any K, the last
// chunk may be shorter): byte by byte, the same arithmetic.
template <int T, int NPW, int U>
DEV void mx_warp_dots(const u8_t* const* codes, const u8_t* const* scales, const float* X, u64 xs, const bool* ok,
                      u32 K, bool vec, u32 lane, float (&res)[NPW][T]) {
    float acc[NPW][T];
#pragma unroll
    for (int m = 0; m < NPW; m++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[m][t] = 0.0f;
    if (vec) {
        const u8_t* cp[NPW];
        const u8_t* sp[NPW];
#pragma unroll
        for (int m = 0; m < NPW; m++) {
            cp[m] = codes[m] + lane * 16;
            sp[m] = scales[m] + lane / 2;
        }
        const float* xp = X + lane * 16;
        for (u32 kb = lane * 16; kb < K; kb += 512 * U) {
            uint4 cv[U][NPW];
            u32 sv[U][NPW];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const bool in = kb + u * 512 < K;
#pragma unroll
                for (int m = 0; m < NPW; m++) {
                    cv[u][m] = in ? ldg_stream16(cp[m] + u * 512) : zero4();
                    sv[u][m] = in ? ldg_u8(sp[m] + u * 16) : 127u;
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (kb + u * 512 >= K) break;
                MxScale sc[NPW];
#pragma unroll
                for (int m = 0; m < NPW; m++) sc[m] = mx_scale(sv[u][m]);
                if constexpr (T <= 2) {
                    // Few rows: hold the tile's x chunk, decode one weight row at a time.
                    float x[T][16];
#pragma unroll
                    for (int t = 0; t < T; t++)
                        if (ok[t]) mx_load_x16(xp + u * 512 + (u64)t * xs, x[t]);
#pragma unroll
                    for (int m = 0; m < NPW; m++) {
                        float d[16];
                        mx_decode16(cv[u][m], d);
#pragma unroll
                        for (int t = 0; t < T; t++)
                            if (ok[t]) acc[m][t] = mx_add_group(mx_dot16(d, x[t]), sc[m], acc[m][t]);
                    }
                } else {
                    // More rows: hold the decoded weights, stream x row by row.
                    float d[NPW][16];
#pragma unroll
                    for (int m = 0; m < NPW; m++) mx_decode16(cv[u][m], d[m]);
#pragma unroll
                    for (int t = 0; t < T; t++) {
                        if (!ok[t]) continue;
                        float x[16];
                        mx_load_x16(xp + u * 512 + (u64)t * xs, x);
#pragma unroll
                        for (int m = 0; m < NPW; m++)
                            acc[m][t] = mx_add_group(mx_dot16(d[m], x), sc[m], acc[m][t]);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < NPW; m++) {
                cp[m] += 512 * U;
                sp[m] += 16 * U;
            }
            xp += 512 * U;
        }
    } else {
        for (u32 kk = lane * 16; kk < K; kk += 512) {
            const u32 len = K - kk < 16 ? K - kk : 16;
#pragma unroll
            for (int m = 0; m < NPW; m++) {
                const MxScale sc = mx_scale(scales[m][kk / 32]);
#pragma unroll
                for (int t = 0; t < T; t++) {
                    if (!ok[t]) continue;
                    const float* x = X + (u64)t * xs + kk;
                    float p = mx_mul(mx_top((u32)codes[m][kk] << 24), x[0]);
                    for (u32 e = 1; e < len; e++) p = mx_fma(mx_top((u32)codes[m][kk + e] << 24), x[e], p);
                    acc[m][t] = mx_add_group(p, sc, acc[m][t]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NPW; m++)
#pragma unroll
        for (int t = 0; t < T; t++) res[m][t] = warp_sum(acc[m][t]);
}

// Rows of a launch of this shape: every sub-row of every row (or of every stream's row when gathered).
DEV u32 mx_total(const FpCommon& c, u32 sub, u32 gathered) {
    return (gathered ? c.nstreams : c.nstreams * c.window) * sub;
}

// One entry point per row tile T (linear_mxfp8_t1 .. _t16, picked by the launch from the row count, as linear's):
// each gets the registers its tile needs. Blocks b, b + gridDim.x, ... take 8 / S * MX_NPW output features each.
template <int T, int U>
DEV void linear_mxfp8_body(const FpLinearMxfp8& p) {
    constexpr int NPW = MX_NPW;
    __shared__ float part[SPLIT_WARPS][NPW][T];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 S = p.split == 0 ? 1 : p.split;
    const u32 G = SPLIT_WARPS / S, g = warp / S;
    const u32 per_block = G * NPW;
    const u32 K = p.k, gpr = (K + 31) / 32;
    u32 ka, kb;
    mx_slice_bounds(K, S, warp % S, ka, kb);
    const bool vec = (K & 15) == 0 && ((p.codes | p.x) & 15) == 0;
    const u32 total = mx_total(p.c, p.sub, p.gathered);
    const u8_t* C = (const u8_t*)p.codes;
    const u8_t* SC = (const u8_t*)p.scales;
    const float* X = fptr(p.x);
    float* O = fptr(p.out);
    for (u32 nb0 = blockIdx.x * per_block; nb0 < p.n; nb0 += gridDim.x * per_block) {
        const u32 n0 = nb0 + g * NPW;
        const u32 nm = n0 >= p.n ? 0 : (p.n - n0 < NPW ? p.n - n0 : NPW);
        const u8_t* codes[NPW];
        const u8_t* scales[NPW];
#pragma unroll
        for (int m = 0; m < NPW; m++) {
            const u64 row = (u32)m < nm ? n0 + m : 0;
            codes[m] = C + row * K + ka;
            scales[m] = SC + row * gpr + ka / 32;
        }
        for (u32 i0 = 0; i0 < total; i0 += T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < total && row_ok(p.c, (i0 + t) / p.sub, p.gathered);
            float res[NPW][T];
            if (nm > 0)
                mx_warp_dots<T, NPW, U>(codes, scales, X + (u64)i0 * K + ka, K, ok, kb - ka, vec, lane, res);
            if (lane == 0 && nm > 0)
#pragma unroll
                for (int m = 0; m < NPW; m++)
#pragma unroll
                    for (int t = 0; t < T; t++) part[warp][m][t] = res[m][t];
            __syncthreads();
            for (u32 q = threadIdx.x; q < G * NPW * T; q += blockDim.x) {
                const u32 gg = q / (NPW * T), m = (q / T) % NPW, t = q % T;
                const u32 n = nb0 + gg * NPW + m;
                if (n >= p.n || i0 + t >= total || !row_ok(p.c, (i0 + t) / p.sub, p.gathered)) continue;
                // The group's S slice partials in slice order.
                float v = 0.0f;
                for (u32 s = 0; s < S; s++) v += part[gg * S + s][m][t];
                float* o = O + (u64)(i0 + t) * p.n + n;
                *o = p.accumulate ? *o + v : v;
            }
            __syncthreads();
        }
    }
}
// t1 and t2 (the drafter's steps) are held to 128 registers: two blocks per SM, 16 warps, so one block's loads are
// in flight while the other computes. t1 keeps 3 chunks of each row in flight per lane (H200, the MXFP8 lm_head
// copy and drafter linears of an mxfp8-head step: 474 -> 462 us; 4 chunks spill at 128 registers and were slower,
// 482 us, or 566 us without the bound). Larger tiles are more compute-bound and keep the registers they need (t4 at
// 128 would spill).
extern "C" __global__ void __launch_bounds__(256, 2) linear_mxfp8_t1(const FpLinearMxfp8 p) {
    pdl_start();
    linear_mxfp8_body<1, 3>(p);
}
extern "C" __global__ void __launch_bounds__(256, 2) linear_mxfp8_t2(const FpLinearMxfp8 p) {
    pdl_start();
    linear_mxfp8_body<2, 2>(p);
}
extern "C" __global__ void linear_mxfp8_t4(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_body<4, 2>(p); }
extern "C" __global__ void linear_mxfp8_t8(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_body<8, 1>(p); }
extern "C" __global__ void linear_mxfp8_t16(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_body<16, 1>(p); }
