// linear: out[i, n] (+)= sum_k x[i, k] * w[n, k] over the sub-rows i of every real row. One warp per 1 or 4 output
// features reads their weight rows once per tile of up to 16 sub-rows (16-byte streaming loads, two chunks of each
// row in flight per lane) and keeps one accumulator per (feature, sub-row); each lane's partial sum runs over the
// same k in the same order for every row (`warp_dots`), then a fixed warp tree: a row's result never depends on
// the other rows or on how many there are.
#include "common.cuh"

// Features per warp: 4 (x reused over 4 weight rows) when the grid has fewer warps than features, else 1 (more
// warps in flight for narrow outputs; the launch picks the grid).
template <int T, int LIN_NPW>
DEV void linear_t(const FpLinear& p, u32 total) {
    const FpCommon& c = p.c;
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const float* X = fptr(p.x);
    float* O = fptr(p.out);
    const bool wvec = (p.k & 7) == 0 && (p.w & 15) == 0;
    for (u32 n0 = gw * LIN_NPW; n0 < p.n; n0 += nwarps * LIN_NPW) {
        const u32 nm = p.n - n0 < LIN_NPW ? p.n - n0 : LIN_NPW;
        const bf16_t* w[LIN_NPW];
#pragma unroll
        for (int m = 0; m < LIN_NPW; m++)
            w[m] = (const bf16_t*)p.w + (u64)(n0 + ((u32)m < nm ? m : 0)) * p.k;
        for (u32 i0 = 0; i0 < total; i0 += T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < total && row_ok(c, (i0 + t) / p.sub, p.gathered);
            float res[LIN_NPW][T];
            warp_dots<T, LIN_NPW, 2>(w, nm, X + (u64)i0 * p.k, p.k, ok, p.k, wvec, lane, res);
            if (lane == 0) {
#pragma unroll
                for (int m = 0; m < LIN_NPW; m++)
#pragma unroll
                    for (int t = 0; t < T; t++) {
                        if ((u32)m >= nm || !ok[t]) continue;
                        float* o = O + (u64)(i0 + t) * p.n + n0 + m;
                        *o = p.accumulate ? *o + res[m][t] : res[m][t];
                    }
            }
        }
    }
}

extern "C" __global__ void linear(const FpLinear p) {
    const u32 total = (p.gathered ? p.c.nstreams : p.c.nstreams * p.c.window) * p.sub;
    if ((gridDim.x * blockDim.x) >> 5 >= p.n) {
#define LIN_CALL1(T) linear_t<T, 1>(p, total)
        DISPATCH_T(total, LIN_CALL1);
#undef LIN_CALL1
    } else {
#define LIN_CALL4(T) linear_t<T, 4>(p, total)
        DISPATCH_T(total, LIN_CALL4);
#undef LIN_CALL4
    }
}
