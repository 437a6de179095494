// Normalisations: rms_norm, gated_norm and the fused hyper-connection read hc_read. One block per row.
#include "common.cuh"

#define HC_MAX 16

// Zero-centred RMSNorm in groups of `group`: y = x * (1 / sqrt(mean(x^2) + eps)) * (1 + w). out may alias x.
extern "C" __global__ void rms_norm(const FpRmsNorm p) {
    pdl_start();
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

// Per head of dim: y = w * (x * (1 / sqrt(mean(x^2) + eps))) * act(z); one warp per (row, head), grid-stride.
extern "C" __global__ void gated_norm(const FpGatedNorm p) {
    pdl_start();
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nwarps = (gridDim.x * blockDim.x) >> 5;
    for (u32 it = gw; it < R * p.heads; it += nwarps) {
        const u32 r = it / p.heads, h = it % p.heads;
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
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

// Hyper-connection read in three launches (one node). Hn = grouped RMSNorm(H, hc_norm) (groups of dim);
// lo = silu(W_down Hn / C), inj[c] = 2 sigmoid(W_inj[c] . Hn / C), a[d] = mean_c sigmoid(W_up lo)[c*D+d] * Hn[c*D+d].
// - hc_norm: block per (row, hyper-connection): Hn into scratch [rows, C*D];
// - hc_read: split-K block dots (common.cuh `slice_dots`) of HC_NPW outputs of [W_down; W_inj] per block over Hn,
//   every row; lo into scratch [rows, rank] after Hn;
// - hc_read_mix: warp per output d, lane group g (8 lanes) per hyper-connection c = g, g + 4, ...: sigmoid(up . lo)
//   times Hn, summed over c in order; each lane has all its up chunks in flight at once.
#define HC_NPW 2

DEV u32 hc_rows(const FpHcRead& p) { return p.gathered ? p.c.nstreams : p.c.nstreams * p.c.window; }

#define HCN_PER 16
// One group (hyper-connection) of one row normalised by a block: xv[u] holds element threadIdx.x + blockDim.x u
// (zeros past dim; dim <= HCN_PER blockDim.x). y = x / sqrt(mean(x^2) + eps) * (1 + w[cc dim ..]). Shared by hc_norm
// and hc_write_norm, so both give the same bits.
DEV void hc_norm_group(const float (&xv)[HCN_PER], u64 norm, u32 cc, u32 dim, float eps, float* sh, float* y) {
    float nv[HCN_PER];
#pragma unroll
    for (int u = 0; u < HCN_PER; u++) {
        const u32 i = threadIdx.x + blockDim.x * u;
        nv[u] = i < dim ? bfw(norm, cc * dim + i) : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < HCN_PER; u++) ss += xv[u] * xv[u];
    ss = block_sum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int u = 0; u < HCN_PER; u++) {
        const u32 i = threadIdx.x + blockDim.x * u;
        if (i < dim) y[i] = xv[u] * inv * (1.0f + nv[u]);
    }
}

// hc_write (rows.cu) fused with the hc_norm of the hc_read that follows it on the same h (`FLASHPLAN_FUSE_SMALL`,
// runtime/src/cuda/launch.rs `fuse_hc_norm`): block per (row, hyper-connection) of 256 threads, dim <= HCN_PER * 256.
// h[r, c*D + d] = h + inj[r, c] * y[r, d] (hc_write_value), then Hn of the new h into scratch exactly as hc_norm
// writes it (hc_norm_group on the same values): the same bits as hc_write followed by hc_norm.
extern "C" __global__ void hc_write_norm(const FpHcWrite p) {
    pdl_start();
    __shared__ float sh[32];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window, W = p.dim * p.hc;
    float* hn = fptr(c.scratch);
    for (u32 b = blockIdx.x; b < R * p.hc; b += gridDim.x) {
        const u32 r = b / p.hc, cc = b % p.hc;
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        float* h = fptr(p.h) + (u64)r * W + (u64)cc * p.dim;
        const float* y = fptr(p.y) + (u64)r * p.dim;
        const float g = fptr(p.inj)[(u64)r * p.hc + cc];
        float xv[HCN_PER];
#pragma unroll
        for (int u = 0; u < HCN_PER; u++) {
            const u32 i = threadIdx.x + blockDim.x * u;
            xv[u] = 0.0f;
            if (i < p.dim) {
                xv[u] = hc_write_value(h[i], g, y[i]);
                h[i] = xv[u];
            }
        }
        hc_norm_group(xv, p.norm, cc, p.dim, p.eps, sh, hn + (u64)r * W + (u64)cc * p.dim);
        __syncthreads();
    }
}

extern "C" __global__ void hc_norm(const FpHcRead p) {
    pdl_start();
    __shared__ float sh[32];
    const FpCommon& c = p.c;
    const u32 nrows = hc_rows(p), W = p.dim * p.hc;
    float* hn = fptr(c.scratch);
    for (u32 b = blockIdx.x; b < nrows * p.hc; b += gridDim.x) {
        const u32 r = b / p.hc, cc = b % p.hc;
        if (!row_ok(c, r, p.gathered)) continue;
        const float* x = fptr(p.h) + (u64)r * W + (u64)cc * p.dim;
        float* y = hn + (u64)r * W + (u64)cc * p.dim;
        if (p.dim <= HCN_PER * blockDim.x) {
            // Every load in flight at once: element i = threadIdx.x + blockDim.x * u.
            float xv[HCN_PER];
#pragma unroll
            for (int u = 0; u < HCN_PER; u++) {
                const u32 i = threadIdx.x + blockDim.x * u;
                xv[u] = i < p.dim ? x[i] : 0.0f;
            }
            hc_norm_group(xv, p.norm, cc, p.dim, p.eps, sh, y);
        } else {
            float ss = 0.0f;
            for (u32 i = threadIdx.x; i < p.dim; i += blockDim.x) ss += x[i] * x[i];
            ss = block_sum(ss, sh);
            const float inv = 1.0f / sqrtf(ss / (float)p.dim + p.eps);
            for (u32 i = threadIdx.x; i < p.dim; i += blockDim.x)
                y[i] = x[i] * inv * (1.0f + bfw(p.norm, cc * p.dim + i));
        }
        __syncthreads();
    }
}

template <int T, int U>
DEV void hc_read_t(const FpHcRead& p, u32 nrows) {
    __shared__ float part[SPLIT_WARPS][HC_NPW][T];
    const FpCommon& c = p.c;
    const u32 W = p.dim * p.hc;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 nout = p.rank + (p.inject ? p.hc : 0);
    const u32 S = SPLIT_WARPS;  // one output group per block, K = C*D split over all 8 warps
    const bool wvec = (W & 7) == 0 && (p.down & 15) == 0 && (p.inject & 15) == 0;
    const float* hn = fptr(c.scratch);
    float* lo = fptr(c.scratch) + (u64)nrows * W;
    for (u32 q0 = blockIdx.x * HC_NPW; q0 < nout; q0 += gridDim.x * HC_NPW) {
        const u32 nm = nout - q0 < HC_NPW ? nout - q0 : HC_NPW;
        const bf16_t* w[HC_NPW];
#pragma unroll
        for (int m = 0; m < HC_NPW; m++) {
            const u32 q = (u32)m < nm ? q0 + m : q0;
            w[m] = q < p.rank ? (const bf16_t*)p.down + (u64)q * W : (const bf16_t*)p.inject + (u64)(q - p.rank) * W;
        }
        for (u32 i0 = blockIdx.y * T; i0 < nrows; i0 += gridDim.y * T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < nrows && row_ok(c, i0 + t, p.gathered);
            slice_dots<T, HC_NPW, U>(w, nm, hn + (u64)i0 * W, W, ok, W, S, wvec, lane, warp, part);
            __syncthreads();
            for (u32 k = threadIdx.x; k < HC_NPW * T; k += blockDim.x) {
                const u32 m = k / T, t = k % T, q = q0 + m, r = i0 + t;
                if (q >= nout || r >= nrows || !row_ok(c, r, p.gathered)) continue;
                const float v = slice_sum<T, HC_NPW>(part, 0, S, m, t);
                if (q < p.rank)
                    lo[(u64)r * p.rank + q] = siluf_(v / (float)p.hc);
                else
                    fptr(p.inj)[(u64)r * p.hc + (q - p.rank)] = 2.0f * sigmoidf_(v / (float)p.hc);
            }
            __syncthreads();
        }
    }
}

// Entry points per row tile (hc_read_t1, _t2, _t4; beyond 4 rows the launch adds tiles over blockIdx.y).
template <int T>
DEV void hc_read_entry(const FpHcRead& p) {
    hc_read_t<T, 8>(p, hc_rows(p));
}
extern "C" __global__ void hc_read_t1(const FpHcRead p) { pdl_start(); hc_read_entry<1>(p); }
extern "C" __global__ void hc_read_t2(const FpHcRead p) { pdl_start(); hc_read_entry<2>(p); }
extern "C" __global__ void hc_read_t4(const FpHcRead p) { pdl_start(); hc_read_entry<4>(p); }

#define HC_UP_CHUNKS 8
template <int T>
DEV void hc_mix_t(const FpHcRead& p, u32 nrows) {
    const FpCommon& c = p.c;
    const u32 W = p.dim * p.hc;
    const u32 lane = threadIdx.x & 31, g = lane >> 3, l8 = lane & 7;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const float* hn = fptr(c.scratch);
    const float* lo = hn + (u64)nrows * W;
    const bool vec = (p.rank & 7) == 0 && (p.up & 15) == 0;
    const bool lvec = (p.rank & 3) == 0 && (((u64)lo) & 15) == 0;
    for (u32 d = gw; d < p.dim; d += nwarps) {
        for (u32 i0 = blockIdx.y * T; i0 < nrows; i0 += gridDim.y * T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < nrows && row_ok(c, i0 + t, p.gathered);
            float val[HC_MAX / 4][T];
#pragma unroll
            for (int j = 0; j < HC_MAX / 4; j++)
#pragma unroll
                for (int t = 0; t < T; t++) val[j][t] = 0.0f;
#pragma unroll
            for (int j = 0; j < HC_MAX / 4; j++) {
                // Rounds j whose groups hold no hyper-connection are skipped (the same j for the whole warp).
                if (4u * j >= p.hc) break;
                const u32 cc = g + 4 * j;
                float acc[T];
#pragma unroll
                for (int t = 0; t < T; t++) acc[t] = 0.0f;
                if (cc < p.hc) {
                    const bf16_t* ur = (const bf16_t*)p.up + (u64)(cc * p.dim + d) * p.rank;
                    if (vec) {
                        // Lane l8 takes chunks l8*8 + 64 u: all (up to HC_UP_CHUNKS) loads issued first.
                        for (u32 kb = l8 * 8; kb < p.rank; kb += 64 * HC_UP_CHUNKS) {
                            uint4 wv[HC_UP_CHUNKS];
#pragma unroll
                            for (int u = 0; u < HC_UP_CHUNKS; u++) {
                                const u32 kk = kb + 64 * u;
                                wv[u] = kk < p.rank ? ldg_stream16(ur + kk) : zero4();
                            }
#pragma unroll
                            for (int u = 0; u < HC_UP_CHUNKS; u++) {
                                const u32 kk = kb + 64 * u;
                                if (kk >= p.rank) continue;
                                float f[8];
                                unpack8(wv[u], f);
#pragma unroll
                                for (int t = 0; t < T; t++) {
                                    if (!ok[t]) continue;
                                    float x[8];
                                    load_x8(lo + (u64)(i0 + t) * p.rank + kk, lvec, x);
                                    acc[t] += dot8(f, x);
                                }
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
                    if (cc < p.hc && ok[t]) v = sigmoidf_(gs) * hn[(u64)(i0 + t) * W + cc * p.dim + d];
                    val[j][t] = v;
                }
            }
#pragma unroll
            for (int t = 0; t < T; t++) {
                float a = 0.0f;
#pragma unroll
                for (int j = 0; j < HC_MAX / 4; j++) {
                    if (4u * j >= p.hc) break;
#pragma unroll
                    for (int gg = 0; gg < 4; gg++) {
                        const float v = __shfl_sync(FULL_MASK, val[j][t], gg * 8);
                        if ((u32)(gg + 4 * j) < p.hc) a += v;
                    }
                }
                if (lane == 0 && ok[t]) fptr(p.out)[(u64)(i0 + t) * p.dim + d] = a / (float)p.hc;
            }
        }
    }
}

template <int T>
DEV void hc_mix_entry(const FpHcRead& p) {
    hc_mix_t<T>(p, hc_rows(p));
}
extern "C" __global__ void hc_read_mix_t1(const FpHcRead p) { pdl_start(); hc_mix_entry<1>(p); }
extern "C" __global__ void hc_read_mix_t2(const FpHcRead p) { pdl_start(); hc_mix_entry<2>(p); }
extern "C" __global__ void hc_read_mix_t4(const FpHcRead p) { pdl_start(); hc_mix_entry<4>(p); }
