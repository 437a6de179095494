// linear_mxfp8: out[i, n] (+)= sum_k x[i, k] * w[n, k] with MXFP8 weights (issue 8): E4M3 codes [n, k] (one byte
// each) and one E8M0 scale byte per 32 consecutive inputs of each output row ([n, ceil(k / 32)]); a weight's value
// is e4m3(code) * 2^(s - 127). Activations and results f32.
//
// Same parameters, launch shape and arithmetic as `linear` (linear.cu): each weight is decoded exactly to f32, then
// every (feature, row) sum takes linear's order: K cut into the launch's S slices (common.cuh's slice_bounds),
// in each slice `warp_dots`' per-lane order (vector path, k % 8 == 0: chunks of 8 at
// lane*8 + 256 j from the slice start in ascending j, dot8 each, added to the lane's accumulator; scalar path
// lane + 32 j, fused multiply-adds) and warp tree, then the S partials added in slice order (as slice_sum). So a
// row's result never depends on the other rows or on how many there are, and it is bit-identical to `linear` run on
// the dequantized values held as BF16 (every MXFP8 value with a scale byte >= 3 is a BF16 value). A change to
// linear's reduction order must be mirrored here (tests/gpu.rs compares the two bit for bit).
//
// Loads: 8 codes per lane per chunk (8-byte streaming loads, up to 4 chunks of each of the warp's 4 rows in flight
// per lane: with linear's S that is a whole slice up to k = 8192) and the chunk's scale byte (one per 32 codes,
// shared by 4 lanes). Decoding: the hardware E4M3x2 -> f16x2 conversion, f16 -> f32 and one multiply by the
// scale per weight, shared by the tile's rows.
#include "common.cuh"

typedef unsigned char u8_t;

// 8-byte streaming load (read once per replay: no L1 allocation).
DEV uint2 ldg_stream8(const void* p) {
    uint2 r;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
// One byte through the read-only path (scales: 4 lanes read each).
DEV u32 ldg_u8(const void* p) {
    u32 r;
    asm("ld.global.nc.u8 %0, [%1];" : "=r"(r) : "l"(p));
    return r & 0xffu;
}

// The value of an E4M3 (OCP FN) code (low 8 bits of c), exact. The sign and the 7 exponent/mantissa bits are placed
// in an f32 so that its exponent field is the code's (mantissa bits on top): that f32 is the code's value times
// 2^-120 for normal codes (exponent field e: 2^(e-127) vs 2^(e-7)) and for subnormal ones (m * 2^-129 vs m * 2^-9),
// and the product with 2^120 is exact. 0x7F and 0xFF are NaN (the re-coder never writes them).
DEV float e4m3_f32(u32 c) {
    const u32 bits = ((c & 0x80u) << 24) | ((c & 0x7fu) << 20);
    const float v = __uint_as_float(bits) * __uint_as_float(0x7b800000u);  // 2^120
    return (c & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : v;
}
// The value of an E8M0 scale byte: 2^(s - 127) (s = 0: the f32 subnormal 2^-127), 0xFF is NaN.
DEV float e8m0_f32(u32 s) {
    if (s == 0xffu) return __uint_as_float(0x7fc00000u);
    return __uint_as_float(s == 0u ? 0x00400000u : s << 23);
}
// One weight: e4m3(code) * 2^(s - 127), a single correctly rounded f32 product (exact: both factors are powers of
// two times at most 4 significant bits; the f32 range holds every value a finite re-coded weight can have), the
// same product runtime/src/mxfp8.rs's `dequantize_stored` computes.
DEV float mx_value(u32 code, float scale) { return e4m3_f32(code) * scale; }
// Two codes (bytes 0 and 1 of `two`) to f32 through the hardware conversion E4M3x2 -> f16x2 (sm_89+; exact: every
// E4M3 value, subnormals and NaN included, is an f16 value) and f16 -> f32 (exact): the same values as e4m3_f32.
DEV void e4m3x2_f32(u32 two, float& lo, float& hi) {
    u32 h2;
    asm("{\n .reg .b16 a;\n cvt.u16.u32 a, %1;\n cvt.rn.f16x2.e4m3x2 %0, a;\n}" : "=r"(h2) : "r"(two));
    asm("{\n .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
}
// Eight weights of an 8-byte load (code k + e in byte e, little-endian), in order, with their group's scale: each
// the exact product e4m3(code) * scale (mx_value's value; the hardware conversion replaces the bit arithmetic).
DEV void mx_unpack8(const uint2 v, float scale, float* f) {
    const u32 w[2] = {v.x, v.y};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float a, b, c, d;
        e4m3x2_f32(w[h] & 0xffffu, a, b);
        e4m3x2_f32(w[h] >> 16, c, d);
        f[4 * h] = a * scale;
        f[4 * h + 1] = b * scale;
        f[4 * h + 2] = c * scale;
        f[4 * h + 3] = d * scale;
    }
}

// res[m][t] = dot(w[m][k0..k0+K), X[t * xs ..][0..K)) for NPW MXFP8 weight rows (codes w[m], scales s[m], both from
// the row's start; m < nm) and T activation rows (ok[t]), by one warp: `warp_dots` with MXFP8 loads. Vector path
// (K % 8 == 0, k0 % 8 == 0, codes 8-byte aligned): lane l takes the chunks of 8 at k0 + l*8 + 256 j (a chunk lies in
// one scale group: 32 % 8 == 0), U chunks of every weight row in flight; per (m, t) the lane sums its chunks in
// ascending k (dot8 each), then the warp tree.
template <int T, int NPW, int U>
DEV void mx_warp_dots(const u8_t* const* w, const u8_t* const* s, u32 k0, u32 nm, const float* X, u64 xs,
                      const bool* ok, u32 K, bool wvec, u32 lane, float (&res)[NPW][T]) {
    float acc[NPW][T];
#pragma unroll
    for (int m = 0; m < NPW; m++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[m][t] = 0.0f;
    if (wvec) {
        const bool xvec = ((((u64)X) | (xs * 4)) & 15) == 0;
        for (u32 kb = lane * 8; kb < K; kb += 256 * U) {
            uint2 wv[U][NPW];
            uint2 z;
            z.x = z.y = 0u;
            u32 sv[U][NPW];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int m = 0; m < NPW; m++) {
                    const u32 kk = kb + u * 256;
                    const bool in = (u32)m < nm && kk < K;
                    wv[u][m] = in ? ldg_stream8(w[m] + k0 + kk) : z;
                    sv[u][m] = in ? ldg_u8(s[m] + (k0 + kk) / 32) : 127u;
                }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const u32 kk = kb + u * 256;
                if (kk < K) {
                    float f[NPW][8];
#pragma unroll
                    for (int m = 0; m < NPW; m++) mx_unpack8(wv[u][m], e8m0_f32(sv[u][m]), f[m]);
#pragma unroll
                    for (int t = 0; t < T; t++) {
                        if (!ok[t]) continue;
                        float x[8];
                        load_x8(X + (u64)t * xs + kk, xvec, x);
#pragma unroll
                        for (int m = 0; m < NPW; m++) acc[m][t] += dot8(f[m], x);
                    }
                }
            }
        }
    } else {
        for (u32 kk = lane; kk < K; kk += 32) {
#pragma unroll
            for (int m = 0; m < NPW; m++) {
                if ((u32)m >= nm) continue;
                const float wv = mx_value(w[m][k0 + kk], e8m0_f32(s[m][(k0 + kk) / 32]));
#pragma unroll
                for (int t = 0; t < T; t++)
                    if (ok[t]) acc[m][t] = fmaf(wv, X[(u64)t * xs + kk], acc[m][t]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NPW; m++)
#pragma unroll
        for (int t = 0; t < T; t++) res[m][t] = warp_sum(acc[m][t]);
}

// Split-K exactly as linear: common.cuh's slice_bounds / slice_sum.
#define MX_WARPS SPLIT_WARPS
#define MX_NPW 4

// As linear_t (linear.cu): a block of 8 warps = 8 / S groups of 4 features x S slices of K, tiles of T sub-rows;
// the partials go through shared memory and are summed per (feature, sub-row) in slice order.
template <int T, int U>
DEV void linear_mxfp8_t(const FpLinearMxfp8& p, u32 total) {
    __shared__ float part[MX_WARPS][MX_NPW][T];
    const FpCommon& c = p.c;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 S = p.split == 0 ? 1 : p.split;
    const u32 G = MX_WARPS / S, g = warp / S;
    const u32 per_block = G * MX_NPW;
    const float* X = fptr(p.x);
    float* O = fptr(p.out);
    const u32 groups = (p.k + 31) / 32;
    const bool wvec = (p.k & 7) == 0 && (p.codes & 7) == 0;
    u32 ka, kb;
    slice_bounds(p.k, S, warp % S, ka, kb);
    for (u32 nb0 = blockIdx.x * per_block; nb0 < p.n; nb0 += gridDim.x * per_block) {
        const u32 n0 = nb0 + g * MX_NPW;
        const u32 nm = n0 >= p.n ? 0 : (p.n - n0 < MX_NPW ? p.n - n0 : MX_NPW);
        const u8_t* w[MX_NPW];
        const u8_t* s[MX_NPW];
#pragma unroll
        for (int m = 0; m < MX_NPW; m++) {
            const u64 row = nm == 0 ? 0 : n0 + ((u32)m < nm ? m : 0);
            w[m] = (const u8_t*)p.codes + row * p.k;
            s[m] = (const u8_t*)p.scales + row * groups;
        }
        for (u32 i0 = 0; i0 < total; i0 += T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < total && row_ok(c, (i0 + t) / p.sub, p.gathered);
            float res[MX_NPW][T];
            mx_warp_dots<T, MX_NPW, U>(w, s, ka, nm, X + (u64)i0 * p.k + ka, p.k, ok, kb - ka, wvec, lane, res);
            if (lane == 0)
#pragma unroll
                for (int m = 0; m < MX_NPW; m++)
#pragma unroll
                    for (int t = 0; t < T; t++) part[warp][m][t] = res[m][t];
            __syncthreads();
            for (u32 q = threadIdx.x; q < G * MX_NPW * T; q += blockDim.x) {
                const u32 gg = q / (MX_NPW * T), m = (q / T) % MX_NPW, t = q % T;
                const u32 n = nb0 + gg * MX_NPW + m;
                if (n >= p.n || i0 + t >= total || !row_ok(c, (i0 + t) / p.sub, p.gathered)) continue;
                const float v = slice_sum<T, MX_NPW>(part, gg, S, m, t);
                float* o = O + (u64)(i0 + t) * p.n + n;
                *o = p.accumulate ? *o + v : v;
            }
            __syncthreads();
        }
    }
}

// One entry point per row tile T (linear_mxfp8_t1 .. _t16, picked by the launch from the row count, as linear's):
// each gets the registers its tile needs. Block of 256 threads (8 warps); grid ceil(n / (4 * 8 / split)).
template <int T>
DEV void linear_mxfp8_entry(const FpLinearMxfp8& p) {
    const u32 total = (p.gathered ? p.c.nstreams : p.c.nstreams * p.c.window) * p.sub;
    linear_mxfp8_t<T, 4>(p, total);
}
extern "C" __global__ void linear_mxfp8_t1(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<1>(p); }
extern "C" __global__ void linear_mxfp8_t2(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<2>(p); }
extern "C" __global__ void linear_mxfp8_t4(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<4>(p); }
extern "C" __global__ void linear_mxfp8_t8(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<8>(p); }
extern "C" __global__ void linear_mxfp8_t16(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<16>(p); }
