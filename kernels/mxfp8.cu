// linear_mxfp8: out[i, n] (+)= sum_k x[i, k] * w[n, k] with MXFP8 weights (issue 8): E4M3 codes [n, k] (one byte
// each) and one E8M0 scale byte per 32 consecutive inputs of each output row ([n, ceil(k / 32)]); a weight's value
// is e4m3(code) * 2^(s - 127). Activations and results f32.
//
// Same parameters, launch shape and arithmetic as `linear`: the same body (linear.cuh's `linear_rows`) over MXFP8
// rows (`Mx8Row`: 8-byte streaming loads of 8 codes and the chunk's scale byte, one per 32 codes). Each weight is
// decoded exactly to f32 (the hardware E4M3x2 -> f16x2 conversion, f16 -> f32, one multiply by the scale), so the
// result is bit-identical to `linear` run on the dequantized values held as BF16 (every MXFP8 value with a scale
// byte >= 3 is a BF16 value; tests/gpu.rs compares the two bit for bit) and row-invariant as linear's.
#include "linear.cuh"

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

// A row of MXFP8 weights for common.cuh's warp_dots_rows (the members of Bf16Row): codes from `codes + k0`, the
// scale of weight k at scales[(k0 + k) / 32]. A chunk of 8 (k0 + kk a multiple of 8) lies in one scale group.
struct Mx8Row {
    const u8_t* codes;
    const u8_t* scales;
    u32 k0;
    struct raw_t {
        uint2 c;
        u32 s;
    };
    DEV raw_t load(u32 kk) const {
        raw_t r;
        r.c = ldg_stream8(codes + k0 + kk);
        r.s = ldg_u8(scales + (k0 + kk) / 32);
        return r;
    }
    DEV static raw_t zero() {
        raw_t r;
        r.c.x = r.c.y = 0u;
        r.s = 127u;
        return r;
    }
    DEV static void unpack(const raw_t& v, float* f) { mx_unpack8(v.c, e8m0_f32(v.s), f); }
    DEV float at(u32 kk) const { return mx_value(codes[k0 + kk], e8m0_f32(scales[(k0 + kk) / 32])); }
    DEV Mx8Row from(u32 k) const {
        Mx8Row r = *this;
        r.k0 = k0 + k;
        return r;
    }
};
// An MXFP8 matrix: codes [n, k], scales [n, ceil(k / 32)].
struct Mx8Mat {
    const u8_t* codes;
    const u8_t* scales;
    u32 k;
    typedef Mx8Row row_t;
    DEV row_t row(u64 n) const {
        Mx8Row r;
        r.codes = codes + n * k;
        r.scales = scales + n * ((k + 31) / 32);
        r.k0 = 0;
        return r;
    }
};

// One entry point per row tile T (linear_mxfp8_t1 .. _t16, picked by the launch from the row count, as linear's):
// each gets the registers its tile needs. Block of 256 threads (8 warps); grid ceil(n / (4 * 8 / split)).
template <int T>
DEV void linear_mxfp8_entry(const FpLinearMxfp8& p) {
    Mx8Mat mat;
    mat.codes = (const u8_t*)p.codes;
    mat.scales = (const u8_t*)p.scales;
    mat.k = p.k;
    const LinearArgs a = linear_args(p);
    // 4 features per group at every tile (the launch's grid assumes it); chunks in flight as linear's.
    const bool wvec = (p.k & 7) == 0 && (p.codes & 7) == 0;
    const u32 total = linear_total(p.c, p.sub, p.gathered);
    if (T <= 4)
        linear_rows<T, 4, 4>(p.c, mat, wvec, a, total, blockIdx.x, gridDim.x);
    else
        linear_rows<T, 4, 2>(p.c, mat, wvec, a, total, blockIdx.x, gridDim.x);
}
extern "C" __global__ void linear_mxfp8_t1(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<1>(p); }
extern "C" __global__ void linear_mxfp8_t2(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<2>(p); }
extern "C" __global__ void linear_mxfp8_t4(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<4>(p); }
extern "C" __global__ void linear_mxfp8_t8(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<8>(p); }
extern "C" __global__ void linear_mxfp8_t16(const FpLinearMxfp8 p) { pdl_start(); linear_mxfp8_entry<16>(p); }
