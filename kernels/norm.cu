// Normalisations: rms_norm, gated_norm and the fused hyper-connection read hc_read. One block per row.
#include "common.cuh"

#define HC_MAX 16
#define HC_RANK_MAX 1024

// Zero-centred RMSNorm in groups of `group`: y = x * (1 / sqrt(mean(x^2) + eps)) * (1 + w). out may alias x.
extern "C" __global__ void rms_norm(const FpRmsNorm p) {
    __shared__ float sh[32];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float* x = fptr(p.x) + (u64)r * p.dim;
        float* y = fptr(p.out) + (u64)r * p.dim;
        for (u32 g0 = 0; g0 < p.dim; g0 += p.group) {
            float ss = 0.0f;
            for (u32 i = threadIdx.x; i < p.group; i += blockDim.x) ss += x[g0 + i] * x[g0 + i];
            ss = block_sum(ss, sh);
            const float inv = 1.0f / sqrtf(ss / (float)p.group + p.eps);
            for (u32 i = threadIdx.x; i < p.group; i += blockDim.x)
                y[g0 + i] = x[g0 + i] * inv * (p.w ? 1.0f + bfw(p.w, g0 + i) : 1.0f);
            __syncthreads();
        }
    }
}

// Per head of dim: y = w * (x * (1 / sqrt(mean(x^2) + eps))) * act(z); one warp per head.
extern "C" __global__ void gated_norm(const FpGatedNorm p) {
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        for (u32 h = warp; h < p.heads; h += nw) {
            const u64 base = ((u64)r * p.heads + h) * p.dim;
            const float* x = fptr(p.x) + base;
            const float* z = fptr(p.z) + base;
            float ss = 0.0f;
            for (u32 i = lane; i < p.dim; i += 32) ss += x[i] * x[i];
            ss = warp_sum(ss);
            const float inv = 1.0f / sqrtf(ss / (float)p.dim + p.eps);
            for (u32 i = lane; i < p.dim; i += 32) {
                const float g = p.act == 0 ? sigmoidf_(z[i]) : siluf_(z[i]);
                fptr(p.out)[base + i] = bfw(p.w, i) * (x[i] * inv) * g;
            }
        }
    }
}

// Hyper-connection read in two launches. Hn = grouped RMSNorm(H, hc_norm); lo = silu(W_down Hn / C),
// a[d] = mean_c sigmoid(W_up lo)[c*D+d] * Hn[c*D+d], inj[c] = 2 sigmoid(W_inj[c].Hn / C).
// hc_read: block per HC_QB outputs of [W_down; W_inj] for every row. The inverse norms factor out of the dot:
// W.Hn = sum_c inv[c] * P[c] with P[c] = sum_{i in group c} W[i] H[i] (1 + w_norm[i]); the block's warps take fixed
// slices of the groups (spg slices per group), accumulate P and sum(H^2) per slice for every row, and the slices
// are combined in order. lo goes to scratch [rows, rank], inv to scratch [rows, hc] after it (block 0).
// hc_read_mix: warp per output d, lane group g (8 lanes) per hyper-connection c = g, g + 4, ...: sigmoid(up . lo)
// times Hn, summed over c in order.
#define HC_QB 2
#define HC_NW 8

template <int T>
DEV void hc_read_t(const FpHcRead& p, u32 nrows) {
    __shared__ float sp[HC_MAX][HC_QB][T];
    __shared__ float ss[HC_MAX][T];
    const FpCommon& c = p.c;
    const u32 W = p.dim * p.hc;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 nout = p.rank + (p.inject ? p.hc : 0);
    const u32 spg = HC_NW / p.hc > 0 ? HC_NW / p.hc : 1;
    const u32 slice = ((p.dim + spg - 1) / spg + 7) / 8 * 8;
    const bool vec = (p.dim & 7) == 0 && (p.down & 15) == 0 && (p.inject & 15) == 0 && (p.norm & 15) == 0;
    float* lo = fptr(c.scratch);
    float* invs = lo + (u64)nrows * p.rank;
    for (u32 q0 = blockIdx.x * HC_QB; q0 < nout; q0 += gridDim.x * HC_QB) {
        const bf16_t* w[HC_QB];
#pragma unroll
        for (int m = 0; m < HC_QB; m++) {
            const u32 q = q0 + m < nout ? q0 + m : q0;
            w[m] = q < p.rank ? (const bf16_t*)p.down + (u64)q * W : (const bf16_t*)p.inject + (u64)(q - p.rank) * W;
        }
        for (u32 i0 = 0; i0 < nrows; i0 += T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < nrows && row_ok(c, i0 + t, p.gathered);
            for (u32 pr = warp; pr < p.hc * spg; pr += HC_NW) {
                const u32 cc = pr / spg, si = pr % spg;
                const u32 a = cc * p.dim + si * slice;
                const u32 b0 = (si + 1) * slice < p.dim ? cc * p.dim + (si + 1) * slice : (cc + 1) * p.dim;
                float acc[HC_QB][T], sq[T];
#pragma unroll
                for (int t = 0; t < T; t++) {
                    sq[t] = 0.0f;
#pragma unroll
                    for (int m = 0; m < HC_QB; m++) acc[m][t] = 0.0f;
                }
                if (vec) {
                    for (u32 kk = a + lane * 8; kk < b0; kk += 256) {
                        float f[HC_QB][8], nw[8];
#pragma unroll
                        for (int m = 0; m < HC_QB; m++) unpack8(ldg_stream16(w[m] + kk), f[m]);
                        unpack8(*(const uint4*)((const bf16_t*)p.norm + kk), nw);
#pragma unroll
                        for (int t = 0; t < T; t++) {
                            if (!ok[t]) continue;
                            float h[8], hn[8];
                            load_x8(fptr(p.h) + (u64)(i0 + t) * W + kk, (W & 3) == 0 && (p.h & 15) == 0, h);
#pragma unroll
                            for (int e = 0; e < 8; e++) hn[e] = h[e] * (1.0f + nw[e]);
                            sq[t] += dot8(h, h);
#pragma unroll
                            for (int m = 0; m < HC_QB; m++) acc[m][t] += dot8(f[m], hn);
                        }
                    }
                } else {
                    for (u32 kk = a + lane; kk < b0; kk += 32) {
                        const float nv = 1.0f + bfw(p.norm, kk);
#pragma unroll
                        for (int t = 0; t < T; t++) {
                            if (!ok[t]) continue;
                            const float h = fptr(p.h)[(u64)(i0 + t) * W + kk];
                            sq[t] = fmaf(h, h, sq[t]);
#pragma unroll
                            for (int m = 0; m < HC_QB; m++) acc[m][t] = fmaf(bf2f(w[m][kk]), h * nv, acc[m][t]);
                        }
                    }
                }
#pragma unroll
                for (int t = 0; t < T; t++) {
                    const float s2 = warp_sum(sq[t]);
                    float v[HC_QB];
#pragma unroll
                    for (int m = 0; m < HC_QB; m++) v[m] = warp_sum(acc[m][t]);
                    if (lane == 0) {
                        ss[pr][t] = s2;
#pragma unroll
                        for (int m = 0; m < HC_QB; m++) sp[pr][m][t] = v[m];
                    }
                }
            }
            __syncthreads();
            if (threadIdx.x < T && ok[threadIdx.x % T]) {
                const u32 t = threadIdx.x;
                const u32 r = i0 + t;
                float inv[HC_MAX];
                for (u32 cc = 0; cc < p.hc; cc++) {
                    float s2 = 0.0f;
                    for (u32 si = 0; si < spg; si++) s2 += ss[cc * spg + si][t];
                    inv[cc] = 1.0f / sqrtf(s2 / (float)p.dim + p.eps);
                    if (blockIdx.x == 0) invs[(u64)r * p.hc + cc] = inv[cc];
                }
                for (u32 m = 0; m < HC_QB; m++) {
                    const u32 q = q0 + m;
                    if (q >= nout) break;
                    float v = 0.0f;
                    for (u32 cc = 0; cc < p.hc; cc++) {
                        float pc = 0.0f;
                        for (u32 si = 0; si < spg; si++) pc += sp[cc * spg + si][m][t];
                        v += inv[cc] * pc;
                    }
                    if (q < p.rank)
                        lo[(u64)r * p.rank + q] = siluf_(v / (float)p.hc);
                    else
                        fptr(p.inj)[(u64)r * p.hc + (q - p.rank)] = 2.0f * sigmoidf_(v / (float)p.hc);
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void hc_read(const FpHcRead p) {
    const u32 nrows = p.gathered ? p.c.nstreams : p.c.nstreams * p.c.window;
#define HC_CALL(T) hc_read_t<T>(p, nrows)
    DISPATCH_T(nrows, HC_CALL);
#undef HC_CALL
}

template <int T>
DEV void hc_mix_t(const FpHcRead& p, u32 nrows) {
    const FpCommon& c = p.c;
    const u32 W = p.dim * p.hc;
    const u32 lane = threadIdx.x & 31, g = lane >> 3, l8 = lane & 7;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const float* lo = fptr(c.scratch);
    const float* invs = lo + (u64)nrows * p.rank;
    const bool vec = (p.rank & 7) == 0 && (p.up & 15) == 0;
    const bool lvec = (p.rank & 3) == 0;
    for (u32 d = gw; d < p.dim; d += nwarps) {
        for (u32 i0 = 0; i0 < nrows; i0 += T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < nrows && row_ok(c, i0 + t, p.gathered);
            float val[HC_MAX / 4][T];
#pragma unroll
            for (int j = 0; j < HC_MAX / 4; j++) {
                const u32 cc = g + 4 * j;
                float acc[T];
#pragma unroll
                for (int t = 0; t < T; t++) acc[t] = 0.0f;
                if (cc < p.hc) {
                    const bf16_t* ur = (const bf16_t*)p.up + (u64)(cc * p.dim + d) * p.rank;
                    if (vec) {
                        for (u32 kk = l8 * 8; kk < p.rank; kk += 64) {
                            float f[8];
                            unpack8(ldg_stream16(ur + kk), f);
#pragma unroll
                            for (int t = 0; t < T; t++) {
                                if (!ok[t]) continue;
                                float x[8];
                                load_x8(lo + (u64)(i0 + t) * p.rank + kk, lvec, x);
                                acc[t] += dot8(f, x);
                            }
                        }
                    } else {
                        for (u32 kk = l8; kk < p.rank; kk += 8) {
                            const float f = bf2f(ur[kk]);
#pragma unroll
                            for (int t = 0; t < T; t++)
                                if (ok[t]) acc[t] = fmaf(f, lo[(u64)(i0 + t) * p.rank + kk], acc[t]);
                        }
                    }
                }
#pragma unroll
                for (int t = 0; t < T; t++) {
                    const float gs = group8_sum(acc[t]);
                    float v = 0.0f;
                    if (cc < p.hc && ok[t]) {
                        const u32 i = cc * p.dim + d;
                        const u32 r = i0 + t;
                        const float hn = fptr(p.h)[(u64)r * W + i] * invs[(u64)r * p.hc + cc] * (1.0f + bfw(p.norm, i));
                        v = sigmoidf_(gs) * hn;
                    }
                    val[j][t] = v;
                }
            }
#pragma unroll
            for (int t = 0; t < T; t++) {
                float a = 0.0f;
#pragma unroll
                for (int j = 0; j < HC_MAX / 4; j++)
#pragma unroll
                    for (int gg = 0; gg < 4; gg++) {
                        const float v = __shfl_sync(FULL_MASK, val[j][t], gg * 8);
                        if ((u32)(gg + 4 * j) < p.hc) a += v;
                    }
                if (lane == 0 && ok[t]) fptr(p.out)[(u64)(i0 + t) * p.dim + d] = a / (float)p.hc;
            }
        }
    }
}

extern "C" __global__ void hc_read_mix(const FpHcRead p) {
    const u32 nrows = p.gathered ? p.c.nstreams : p.c.nstreams * p.c.window;
#define HCM_CALL(T) hc_mix_t<T>(p, nrows)
    DISPATCH_T(nrows, HCM_CALL);
#undef HCM_CALL
}
