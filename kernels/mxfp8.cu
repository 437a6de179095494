// linear_mxfp8: out[i, n] (+)= sum_k x[i, k] * w[n, k] with MXFP8 weights (issue 8): an E4M3 code per weight and
// one E8M0 scale byte s per 32 consecutive inputs of each output row, held in MMA tiles (runtime/src/cuda/weights.rs
// `tile_mxfp8`); a weight's value is e4m3(code) * 2^(s - 127). Activations and results f32.
//
// The BF16 linear's body (linear.cuh `linear_tc_rows_w`) with another weight source (`TcMxfp8Tiles` below): each
// step's A fragments are decoded from the codes and scales to the weights' BF16 values, exactly, just before the
// step's MMAs. An MXFP8 value has 4 significant bits and, packed from finite f32 values (runtime/src/mxfp8.rs
// `pack_exact`), an exponent BF16 holds: its BF16 value is the value itself wherever that is at least 2^-126 (and
// below, where BF16 keeps fewer bits, it is rounded to nearest even exactly as the BF16 upload of the same value is).
// Everything after the fragments (the
// activation's three BF16 terms, the MMAs, the slices of K from `tc_split`, the epilogue, the launch shapes but at the
// tiles of 8 and 16 rows) is the BF16 linear's, so the results are bit-identical to `linear` on the same values (the
// GPU checks compare them bit for bit) and row invariant as `linear` is. At 8 and 16 rows the MXFP8 linears keep one
// m-tile a warp and 4 steps in flight, where `linear_t8` and `linear_t16` take two m-tiles and 4 steps of each
// (linear.cu `LINEAR_T8`, `LINEAR_T16`): each m-tile's MMAs are the same either way.
//
// Decode of a pair of codes (`mx_pair`): prmt spreads the two bytes into the two 16-bit halves with each byte's
// sign copied into the byte above it; shifted left by 4 and masked with 0x87f0 per half, a half is the BF16 with the
// code's sign in bit 15, its 4 exponent bits in bits 7 .. 10 and its 3 mantissa bits in bits 4 .. 6: e4m3(code) *
// 2^-120 (a normal code's
// exponent field e gives 2^(e - 127) (1 + m / 8); a subnormal code's m * 2^-9 gives the BF16 subnormal
// (16 m / 128) * 2^-126 = m * 2^-129). One BF16x2 multiply (`mul.rn.bf16x2`, subnormals kept) by 2^(s - 7) then
// gives e4m3(code) * 2^(s - 127): a product by a power of two, exact wherever the value is a BF16 value. The factor
// needs s <= 134 (2^127 is BF16's largest power of two): the runtime keeps a weight with a larger scale (a group
// with a value above 448 x 2^7 = 57344) as BF16 (runtime/src/mxfp8.rs `KERNEL_MAX_SCALE`). runtime/src/mxfp8.rs
// `kernel_mirror` checks the decode on every code in both halves and the scaling at every scale up to 134.
#include "linear.cuh"

typedef unsigned char u8_t;

// Two bytes (2-byte aligned) through the read-only path (a lane's two scales: the four lanes of a row group read the
// same pair).
DEV u32 ldg_u16(const void* p) {
    u32 r;
    asm("ld.global.nc.u16 %0, [%1];" : "=r"(r) : "l"(p));
    return r & 0xffffu;
}
// BF16x2 a * b, round to nearest even, subnormal operands and results kept (no .ftz for BF16).
DEV u32 mul_bf16x2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// The codes in bytes j and j + 1 of w as BF16x2 (byte j in the low half): e4m3(code) * 2^-120 each, exactly (the
// file's top comment). sel: 0x9180 for bytes 0, 1; 0xb3a2 for bytes 2, 3 (prmt's nibble bit 3 copies the byte's
// sign bit).
DEV u32 mx_pair(u32 w, u32 sel) {
    u32 v;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(v) : "r"(w), "r"(sel));
    return (v << 4) & 0x87f087f0u;
}
// The BF16x2 factor 2^(s - 7) of scale byte s (exponent field s + 120 in both halves), for s <= 134.
DEV u32 mx_factor(u32 s) { return (s + 120u) * 0x00800080u; }
// Four codes of a row (bytes of w, ascending k) scaled by f: lo = the pair of bytes 0, 1, hi = bytes 2, 3.
DEV void mx_quad(u32 w, u32 f, u32& lo, u32& hi) {
    lo = mul_bf16x2(mx_pair(w, 0x9180u), f);
    hi = mul_bf16x2(mx_pair(w, 0xb3a2u), f);
}

// The weight source of linear_tc_rows_w for MXFP8 weights in MMA tiles (runtime/src/cuda/weights.rs `tile_mxfp8`):
// tile (m, step) at byte (m * steps + step) * MX_TILE_BYTES (params.h); lane l's 16 bytes at 16 l are the 8 codes of
// feature rows g and g + 8 at k = 32 step + 8 q .. + 7 (one 16-byte load: a warp reads each step's 512 code bytes as
// one run), and the rows' scale bytes of the step are at 512 + 2 g and 512 + 2 g + 1 (a step of 32 codes is one scale
// group). Tiles are zero-padded past n and k (zero codes), as the BF16 tiles are.
struct TcMxfp8Tiles {
    const u8_t* tp;  // the current step's tile
    u32 g, lane;
    template <int N>
    struct Batch {
        uint4 c[N];
        u32 s[N];  // the scale bytes of rows g (bits 0 .. 7) and g + 8 (bits 8 .. 15)
    };
    DEV void seek(const FpLinear& a, u32 steps, u32 lane_, u32 m, u32 s) {
        lane = lane_;
        g = lane_ >> 2;
        tp = (const u8_t*)a.w + ((u64)m * steps + s) * MX_TILE_BYTES;
    }
    template <int N, bool ALL>
    DEV void load(Batch<N>& b, u32 first, u32 end) const {
#pragma unroll
        for (int u = 0; u < N; u++) {
            const bool in = ALL || first + u < end;
            const u8_t* t = tp + u * MX_TILE_BYTES;
            b.c[u] = in ? ldg_stream16_l2pf(t + lane * 16) : zero4();
            b.s[u] = in ? ldg_u16(t + 512 + 2 * g) : 0u;
        }
    }
    // The BF16 tile fragments (linear.cuh TC_TILE_U4's order): w0 = (g, k 0 1), (g + 8, k 0 1), (g, k 2 3),
    // (g + 8, k 2 3) of the lane's 8 k; w1 the same for k 4 .. 7.
    template <int N>
    DEV void frag(const Batch<N>& b, int u, uint4& w0, uint4& w1) const {
        const u32 fg = mx_factor(b.s[u] & 0xffu), fh = mx_factor(b.s[u] >> 8);
        mx_quad(b.c[u].x, fg, w0.x, w0.z);
        mx_quad(b.c[u].z, fh, w0.y, w0.w);
        mx_quad(b.c[u].y, fg, w1.x, w1.z);
        mx_quad(b.c[u].w, fh, w1.y, w1.w);
    }
    DEV void advance(u32 s) { tp += s * MX_TILE_BYTES; }
};

// linear.cu's linear_entry with the MXFP8 source: the same rows, slices and epilogue; MT m-tiles a warp.
template <int T, int U = 4, int MT = 1>
DEV void linear_mxfp8_entry(const FpLinear& p, u32 block, u32 nblocks) {
    linear_tc_rows_w<T, U, LinearStore, TcMxfp8Tiles, MT>(p, linear_total(p.c, p.sub, p.gathered), block, nblocks,
                                                         (const uint4*)p.c.scratch, LinearStore{}, TcMxfp8Tiles{});
}
// One entry point per row tile, with linear.cu's launch bounds and steps in flight, but one m-tile a warp at 8 and 16
// rows (4 steps in flight, no bounds); t1_deep where linear_t1_deep would run (runtime/src/cuda/launch/linear.rs
// `linear_entry`), with its LINEAR_MTILES m-tiles and 4 steps of each in flight (128 registers; H200, 2026-12-04:
// the mxfp8-head draft step 375.6 us with one m-tile and 8 steps, 355.8-358.3 us with two, on other machines).
extern "C" __global__ void __launch_bounds__(256, 3) linear_mxfp8_t1(const FpLinear p) { pdl_start(); linear_mxfp8_entry<1>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void __launch_bounds__(256, 2) linear_mxfp8_t1_deep(const FpLinear p) { pdl_start(); linear_mxfp8_entry<1, 4, LINEAR_MTILES>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void __launch_bounds__(256, 3) linear_mxfp8_t2(const FpLinear p) { pdl_start(); linear_mxfp8_entry<2>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_mxfp8_t4(const FpLinear p) { pdl_start(); linear_mxfp8_entry<4>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_mxfp8_t8(const FpLinear p) { pdl_start(); linear_mxfp8_entry<8>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_mxfp8_t16(const FpLinear p) { pdl_start(); linear_mxfp8_entry<16>(p, blockIdx.x, gridDim.x); }

// linear_multi_mxfp8: linear.cu's linear_multi over MXFP8 weights (a run of sibling linears all held as MXFP8:
// runtime/src/cuda/fuse.rs), each block running linear_mxfp8's body on its matrix (linear.cuh `linear_multi_part`):
// bit-identical to the unfused linear_mxfp8 launches, and so to `linear` on the same values.
template <int T, int U = 4>
DEV void linear_multi_mxfp8_entry(const FpLinearMulti& p) {
    FpLinear q;
    u32 b, nblocks;
    if (linear_multi_part(p, q, b, nblocks)) linear_mxfp8_entry<T, U>(q, b, nblocks);
}
extern "C" __global__ void __launch_bounds__(256, 3) linear_multi_mxfp8_t1(const FpLinearMulti p) { pdl_start(); linear_multi_mxfp8_entry<1>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) linear_multi_mxfp8_t2(const FpLinearMulti p) { pdl_start(); linear_multi_mxfp8_entry<2>(p); }
extern "C" __global__ void linear_multi_mxfp8_t4(const FpLinearMulti p) { pdl_start(); linear_multi_mxfp8_entry<4>(p); }
extern "C" __global__ void linear_multi_mxfp8_t8(const FpLinearMulti p) { pdl_start(); linear_multi_mxfp8_entry<8>(p); }
extern "C" __global__ void linear_multi_mxfp8_t16(const FpLinearMulti p) { pdl_start(); linear_multi_mxfp8_entry<16>(p); }
