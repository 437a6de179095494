// linear: out[i, n] (+)= sum_k x[i, k] * w[n, k] over the sub-rows i of every real row. One warp per output feature
// n reads the weight row once per tile of 8 sub-rows (16-byte bf16 loads) and keeps one accumulator per sub-row;
// each lane's partial sum runs over the same k in the same order for every row, then a fixed warp tree: a row's
// result never depends on the other rows.
#include "common.cuh"

#define TILE 8

extern "C" __global__ void linear(const FpLinear p) {
    const FpCommon& c = p.c;
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const u32 nrows = p.gathered ? c.nstreams : c.nstreams * c.window;
    const u32 total = nrows * p.sub;
    const float* X = fptr(p.x);
    float* O = fptr(p.out);
    const bool vec = (p.k & 7) == 0 && (p.w & 15) == 0;
    for (u32 n = gw; n < p.n; n += nwarps) {
        const bf16_t* wr = (const bf16_t*)p.w + (u64)n * p.k;
        for (u32 i0 = 0; i0 < total; i0 += TILE) {
            bool ok[TILE];
            float acc[TILE];
#pragma unroll
            for (int t = 0; t < TILE; t++) {
                const u32 i = i0 + t;
                acc[t] = 0.0f;
                ok[t] = false;
                if (i < total) {
                    const u32 r = i / p.sub;
                    if (p.gathered) {
                        ok[t] = stream_of(c, r).rows > 0;
                    } else {
                        u32 s, j;
                        ok[t] = real_row(c, r, s, j);
                    }
                }
            }
            if (vec) {
                for (u32 kk = lane * 8; kk < p.k; kk += 256) {
                    float f[8];
                    unpack8(*(const uint4*)(wr + kk), f);
#pragma unroll
                    for (int t = 0; t < TILE; t++) {
                        if (!ok[t]) continue;
                        const float* xr = X + (u64)(i0 + t) * p.k + kk;
                        float s = f[0] * xr[0];
#pragma unroll
                        for (int e = 1; e < 8; e++) s += f[e] * xr[e];
                        acc[t] += s;
                    }
                }
            } else {
                for (u32 kk = lane; kk < p.k; kk += 32) {
                    const float wv = bf2f(wr[kk]);
#pragma unroll
                    for (int t = 0; t < TILE; t++)
                        if (ok[t]) acc[t] += wv * X[(u64)(i0 + t) * p.k + kk];
                }
            }
#pragma unroll
            for (int t = 0; t < TILE; t++) {
                const float v = warp_sum(acc[t]);
                if (ok[t] && lane == 0) {
                    float* o = O + (u64)(i0 + t) * p.n + n;
                    *o = p.accumulate ? *o + v : v;
                }
            }
        }
    }
}
