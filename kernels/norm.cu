// Normalisations: rms_norm (block per row), gated_norm, and the hyper-connection read (hc_norm, hc_read, hc_mix_tc:
// launch shapes below) with hc_write_norm.
#include "common.cuh"
#include "linear.cuh"

// Where rms_norm_t reads a row's values: x [R, dim] f32 (rms_norm); the BF16 row of the row's token in the
// embedding table at x (rms_norm_embed: `embed` and the norm of its output in one launch); the f32 row src_row(s) + j
// of the io buffer at x (rms_norm_gather: `gather_rows` and the norm of its output). The values are those embed or
// gather_rows would have written, so the result is the same bits as the copy then rms_norm
// (runtime/src/cuda/launch/rows.rs `fuse_row_norms`).
#define RMS_ROWS 0
#define RMS_EMBED 1
#define RMS_GATHER 2

// Zero-centred RMSNorm in groups of `group`: y = x * (1 / sqrt(mean(x^2) + eps)) * (1 + w). out may alias x.
template <int SRC>
DEV void rms_norm_t(const FpRmsNorm& p) {
    __shared__ float sh[32];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float* x = fptr(p.x) + (SRC == RMS_GATHER ? (u64)stream_of(c, s).src_row + j : (u64)r) * p.dim;
        const u64 tok = SRC == RMS_EMBED ? token_of(c, r) : 0;
        const auto xi = [&](u32 i) { return SRC == RMS_EMBED ? bfw(p.x, tok * p.dim + i) : x[i]; };
        float* y = fptr(p.out) + (u64)r * p.dim;
        for (u32 g0 = 0; g0 < p.dim; g0 += p.group) {
            float ss = 0.0f;
            for (u32 i0 = threadIdx.x; i0 < p.group; i0 += blockDim.x * ROW_U) {
                // ROW_U loads in flight, then the squares added in the same order as one element at a time.
                float v[ROW_U];
                load_strided(v, i0, blockDim.x, p.group, 0.0f, [&](u32 i) { return xi(g0 + i); });
#pragma unroll
                for (int u = 0; u < ROW_U; u++)
                    if (i0 + blockDim.x * u < p.group) ss += v[u] * v[u];
            }
            ss = block_sum(ss, sh);
            const float inv = 1.0f / sqrtf(ss / (float)p.group + p.eps);
            // ROW_U values a thread loaded before it stores any (out may alias x: a plain loop would wait for
            // each load after the previous store); the same product per element.
            block_store_row(y + g0, p.group, 1, 0,
                            [&](u32 i) { return xi(g0 + i) * inv * (p.w ? 1.0f + bfw(p.w, g0 + i) : 1.0f); });
            __syncthreads();
        }
    }
}
extern "C" __global__ void rms_norm(const FpRmsNorm p) { pdl_start(); rms_norm_t<RMS_ROWS>(p); }
extern "C" __global__ void rms_norm_embed(const FpRmsNorm p) { pdl_start(); rms_norm_t<RMS_EMBED>(p); }
extern "C" __global__ void rms_norm_gather(const FpRmsNorm p) { pdl_start(); rms_norm_t<RMS_GATHER>(p); }

// Per head of dim: y = w * (x * (1 / sqrt(mean(x^2) + eps))) * act(z); one warp per (row, head), grid-stride.
// Head widths up to 32 * GN_PER take gated_norm's register path. There the gate z, the weights and the row's
// descriptor are loaded before the wait on the previous kernel (z and the descriptor through L2, `ld_early_*`): z
// comes from the layer's input projection, at least three launches back (the conv and the recurrence between), so
// only x, the previous kernel's output, waits.
#define GN_PER 8
extern "C" __global__ void gated_norm(const FpGatedNorm p) {
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nwarps = (gridDim.x * blockDim.x) >> 5;
    bool waited = false;
    for (u32 it = gw; it < R * p.heads; it += nwarps) {
        const u32 r = it / p.heads, h = it % p.heads;
        if (!real_row_early(c, r)) continue;
        const u64 base = ((u64)r * p.heads + h) * p.dim;
        const float* x = fptr(p.x) + base;
        const float* z = fptr(p.z) + base;
        if (p.dim <= 32 * GN_PER) {
            // Every load (x, z, w) before the first store to out (which the compiler could not move them above: out
            // might alias x or z); the same sums as the loops below (zeros past dim add +0 to a sum of squares).
            float xv[GN_PER], zv[GN_PER], wv[GN_PER];
#pragma unroll
            for (int u = 0; u < GN_PER; u++) {
                const u32 i = lane + 32 * u;
                zv[u] = i < p.dim ? ld_early_f32(z + i) : 0.0f;
                wv[u] = i < p.dim ? bfw(p.w, i) : 0.0f;
            }
            pdl_start_once(waited);
#pragma unroll
            for (int u = 0; u < GN_PER; u++) {
                const u32 i = lane + 32 * u;
                xv[u] = i < p.dim ? x[i] : 0.0f;
            }
            float ss = 0.0f;
#pragma unroll
            for (int u = 0; u < GN_PER; u++) ss += xv[u] * xv[u];
            ss = warp_sum(ss);
            const float inv = 1.0f / sqrtf(ss / (float)p.dim + p.eps);
#pragma unroll
            for (int u = 0; u < GN_PER; u++) {
                const u32 i = lane + 32 * u;
                if (i >= p.dim) break;
                const float g = p.act == 0 ? sigmoidf_(zv[u]) : siluf_(zv[u]);
                fptr(p.out)[base + i] = wv[u] * (xv[u] * inv) * g;
            }
            continue;
        }
        pdl_start_once(waited);
        float ss = 0.0f;
        for (u32 i = lane; i < p.dim; i += 32) ss += x[i] * x[i];
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)p.dim + p.eps);
        for (u32 i = lane; i < p.dim; i += 32) {
            const float g = p.act == 0 ? sigmoidf_(z[i]) : siluf_(z[i]);
            fptr(p.out)[base + i] = bfw(p.w, i) * (x[i] * inv) * g;
        }
    }
    pdl_start_once(waited);
}

// Hyper-connection read in three or four launches (one node), or with `FLASHPLAN_FUSE_SMALL` up to 4 rows in one or
// two (hc_norm if no hc_write_norm came before, then hc_read_one_t*, at the end of this file) and beyond 4 rows in
// two or three (hc_read_t4_wide_terms leaves the split's terms).
// Hn = grouped RMSNorm(H, hc_norm) (groups of dim);
// lo = silu(W_down Hn / C), inj[c] = 2 sigmoid(W_inj[c] . Hn / C), a[d] = mean_c sigmoid(W_up lo)[c*D+d] * Hn[c*D+d].
// - hc_norm: block per (row, hyper-connection): Hn into scratch [rows, C*D];
// - hc_read: split-K block dots (common.cuh `slice_dots`) of NPW outputs of [W_down; W_inj] per block over Hn,
//   every row; lo into scratch [rows, rank] after Hn. NPW is 2 up to 4 rows (hc_read_t1, _t2, _t4) and 4 beyond
//   (hc_read_t4_wide, tiles of 4 rows over blockIdx.y), where each block's re-read of its rows of Hn (40 KB per row
//   at the real width) costs more than the blocks lost; an output's arithmetic does not depend on NPW;
// - from two rows on, hc_mix_split: lo's rows into their BF16 terms (the linears' `linear_split_rows`); beyond 4
//   rows with `FLASHPLAN_FUSE_SMALL` hc_read_t4_wide_terms leaves them itself (`hc_store_lo_terms`, the same bits);
// - hc_mix_tc: the gates W_up lo on tensor cores (`linear_tc_rows`, up tiled feature-major) and the mix over c in
//   order as its epilogue (HcMixStore below).

DEV u32 hc_rows(const FpHcRead& p) { return p.gathered ? p.c.nstreams : p.c.nstreams * p.c.window; }

#define HCN_PER 16
// The norm weights of group cc for hc_norm_group: nv[u] = w[cc dim + threadIdx.x + blockDim.x u] (zeros past dim).
DEV void hc_norm_weights(u64 norm, u32 cc, u32 dim, float (&nv)[HCN_PER]) {
#pragma unroll
    for (int u = 0; u < HCN_PER; u++) {
        const u32 i = threadIdx.x + blockDim.x * u;
        nv[u] = i < dim ? bfw(norm, cc * dim + i) : 0.0f;
    }
}
// One group (hyper-connection) of one row normalised by a block: xv[u] holds element threadIdx.x + blockDim.x u
// (zeros past dim; dim <= HCN_PER blockDim.x), nv the group's norm weights (hc_norm_weights). y = x / sqrt(mean(x^2)
// + eps) * (1 + w[cc dim ..]). Shared by hc_norm and hc_write_norm, so both give the same bits.
DEV void hc_norm_group(const float (&xv)[HCN_PER], const float (&nv)[HCN_PER], u32 dim, float eps, float* sh,
                       float* y) {
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
// runtime/src/cuda/launch/hc.rs `fuse_hc_norm`): block per (row, hyper-connection) of 256 threads, dim <= HCN_PER * 256.
// h[r, c*D + d] = h + inj[r, c] * y[r, d] (hc_write_value), then Hn of the new h into scratch exactly as hc_norm
// writes it (hc_norm_group on the same values): the same bits as hc_write followed by hc_norm. Every load (h, y and
// the norm weights) is issued before the first store to h, which the compiler could not otherwise move them above
// (h and y might alias): one memory latency instead of one per element (H200, one row: 4.9 -> 2.9 us a launch).
//
// The block's first group of h, its norm weights and the row's descriptor are loaded before the wait on the previous
// kernel (programmatic dependent launch; h and the descriptor through L2, `ld_early_*` in common.cuh, which gives
// the rule): h was last written by an HcWrite or PleMix at least two kernels back (the layer's read, then its mixer
// or MoE, come between); y (the previous kernel's output) and inj are read after the wait, and nothing is stored
// before it.
extern "C" __global__ void hc_write_norm(const FpHcWrite p) {
    __shared__ float sh[32];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window, W = p.dim * p.hc;
    float* hn = fptr(c.scratch);
    bool waited = false;
    for (u32 b = blockIdx.x; b < R * p.hc; b += gridDim.x) {
        const u32 r = b / p.hc, cc = b % p.hc;
        if (!real_row_early(c, r)) continue;
        float* h = fptr(p.h) + (u64)r * W + (u64)cc * p.dim;
        const float* y = fptr(p.y) + (u64)r * p.dim;
        float hv[HCN_PER], yv[HCN_PER], nv[HCN_PER], xv[HCN_PER];
#pragma unroll
        for (int u = 0; u < HCN_PER; u++) {
            const u32 i = threadIdx.x + blockDim.x * u;
            hv[u] = i < p.dim ? ld_early_f32(h + i) : 0.0f;
        }
        hc_norm_weights(p.norm, cc, p.dim, nv);
        pdl_start_once(waited);
        const float g = fptr(p.inj)[(u64)r * p.hc + cc];
#pragma unroll
        for (int u = 0; u < HCN_PER; u++) {
            const u32 i = threadIdx.x + blockDim.x * u;
            yv[u] = i < p.dim ? y[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < HCN_PER; u++) {
            const u32 i = threadIdx.x + blockDim.x * u;
            xv[u] = 0.0f;
            if (i < p.dim) {
                xv[u] = hc_write_value(hv[u], g, yv[u]);
                h[i] = xv[u];
            }
        }
        hc_norm_group(xv, nv, p.dim, p.eps, sh, hn + (u64)r * W + (u64)cc * p.dim);
        __syncthreads();
    }
    pdl_start_once(waited);
}

// add_broadcast (rows.cu) fused with the hc_norm of the hc_read that follows it on `out` (`FLASHPLAN_FUSE_SMALL`,
// runtime/src/cuda/launch/hc.rs `fuse_hc_norm`: the MTP step's streams before its attention read): block per (row,
// hyper-connection group) of 256 threads, groups of b_width <= HCN_PER * 256. out[r, cc*D + d] = a[r, cc*D + d] +
// b[r, d], then Hn of the group into scratch (hc_norm_group on the same values): the same bits as add_broadcast
// followed by hc_norm. Every load (a, b and the norm weights) is issued before the first store to out.
extern "C" __global__ void add_broadcast_norm(const FpAddBroadcast p) {
    pdl_start();
    __shared__ float sh[32];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window, D = p.b_width, hc = p.width / p.b_width;
    float* hn = fptr(c.scratch);
    for (u32 blk = blockIdx.x; blk < R * hc; blk += gridDim.x) {
        const u32 r = blk / hc, cc = blk % hc;
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const u64 at = (u64)r * p.width + (u64)cc * D;
        const float *a = fptr(p.a) + at, *b = fptr(p.b) + (u64)r * D;
        float av[HCN_PER], bv[HCN_PER], nv[HCN_PER], xv[HCN_PER];
#pragma unroll
        for (int u = 0; u < HCN_PER; u++) {
            const u32 i = threadIdx.x + blockDim.x * u;
            av[u] = i < D ? a[i] : 0.0f;
            bv[u] = i < D ? b[i] : 0.0f;
        }
        hc_norm_weights(p.norm, cc, D, nv);
        float* out = fptr(p.out) + at;
#pragma unroll
        for (int u = 0; u < HCN_PER; u++) {
            const u32 i = threadIdx.x + blockDim.x * u;
            xv[u] = 0.0f;
            if (i < D) {
                xv[u] = av[u] + bv[u];
                out[i] = xv[u];
            }
        }
        hc_norm_group(xv, nv, D, p.eps, sh, hn + at);
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
            float xv[HCN_PER], nv[HCN_PER];
#pragma unroll
            for (int u = 0; u < HCN_PER; u++) {
                const u32 i = threadIdx.x + blockDim.x * u;
                xv[u] = i < p.dim ? x[i] : 0.0f;
            }
            hc_norm_weights(p.norm, cc, p.dim, nv);
            hc_norm_group(xv, nv, p.dim, p.eps, sh, y);
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

DEV uint4* hc_mix_xsplit(const FpHcRead& p, u32 nrows);

// lo[r, q]'s three BF16 terms (`split3`: hi, mid, lo) where hc_mix_split leaves them (linear.cuh
// `linear_split_rows`: uint4 ((r * steps + q / 32) * 4 + q % 32 / 8) * 3 + e holds term e of lo[r, 32 step + 8 (q % 32
// / 8) .. + 7], value j in BF16 j), one 16-bit store each: the same bits as the split of the whole row. The thread of
// the last output also zeroes the terms past rank up to a whole step, as the split does.
DEV void hc_store_lo_terms(const FpHcRead& p, u32 nrows, u32 r, u32 q, float v) {
    const u32 steps = (p.rank + 31) / 32;
    bf16_t* row = (bf16_t*)(hc_mix_xsplit(p, nrows) + (u64)r * steps * 12);
    const u32 last = q + 1 == p.rank ? steps * 32 : q + 1;
    for (u32 k = q; k < last; k++) {
        float t[3];
        split3(k == q ? v : 0.0f, t[0], t[1], t[2]);
        bf16_t* dst = row + ((k / 32) * 4 + (k % 32) / 8) * 24 + k % 8;
#pragma unroll
        for (int e = 0; e < 3; e++) dst[8 * e] = (bf16_t)(__float_as_uint(t[e]) >> 16);
    }
}

// SPLIT: also leave lo's BF16 terms for hc_mix_tc (hc_store_lo_terms; zeros for a row that is not real, as
// hc_mix_split writes), so hc_mix_split does not run.
template <int T, int NPW, int U, bool PRE = false, bool SPLIT = false>
DEV void hc_read_t(const FpHcRead& p, u32 nrows) {
    __shared__ float part[SPLIT_WARPS][NPW][T];
    const FpCommon& c = p.c;
    const u32 W = p.dim * p.hc;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 nout = p.rank + (p.inject ? p.hc : 0);
    const u32 S = SPLIT_WARPS;  // one output group per block, K = C*D split over all 8 warps
    const bool wvec = (W & 7) == 0 && (p.down & 15) == 0 && (p.inject & 15) == 0;
    const float* hn = fptr(c.scratch);
    float* lo = fptr(c.scratch) + (u64)nrows * W;
    for (u32 q0 = blockIdx.x * NPW; q0 < nout; q0 += gridDim.x * NPW) {
        const u32 nm = nout - q0 < NPW ? nout - q0 : NPW;
        const bf16_t* w[NPW];
#pragma unroll
        for (int m = 0; m < NPW; m++) {
            const u32 q = (u32)m < nm ? q0 + m : q0;
            w[m] = q < p.rank ? (const bf16_t*)p.down + (u64)q * W : (const bf16_t*)p.inject + (u64)(q - p.rank) * W;
        }
        for (u32 i0 = blockIdx.y * T; i0 < nrows; i0 += gridDim.y * T) {
            bool ok[T];
#pragma unroll
            for (int t = 0; t < T; t++) ok[t] = i0 + t < nrows && row_ok(c, i0 + t, p.gathered);
            slice_dots<T, NPW, U, PRE>(w, nm, hn + (u64)i0 * W, W, ok, W, S, wvec, lane, warp, part);
            __syncthreads();
            for (u32 k = threadIdx.x; k < NPW * T; k += blockDim.x) {
                const u32 m = k / T, t = k % T, q = q0 + m, r = i0 + t;
                if (q >= nout || r >= nrows) continue;
                const bool real = row_ok(c, r, p.gathered);
                // A row that is not real gets zero terms, as hc_mix_split gives it.
                if (!real && !(SPLIT && q < p.rank)) continue;
                const float v = real ? slice_sum<T, NPW>(part, 0, S, m, t) : 0.0f;
                if (q < p.rank) {
                    const float l = siluf_(v / (float)p.hc);
                    if (real) lo[(u64)r * p.rank + q] = l;
                    if (SPLIT) hc_store_lo_terms(p, nrows, r, q, real ? l : 0.0f);
                } else {
                    fptr(p.inj)[(u64)r * p.hc + (q - p.rank)] = 2.0f * sigmoidf_(v / (float)p.hc);
                }
            }
            __syncthreads();
        }
    }
}

// Entry points per row tile (hc_read_t1, _t2, _t4 with 2 outputs per block, 16 weight chunks per lane in flight;
// beyond 4 rows hc_read_t4_wide with 4, the launch adding tiles over blockIdx.y: one chunk of each weight row and of
// each activation row in flight at a time, all loaded together (`PRE`; 80 registers, three blocks an SM, where the
// 4 chunks of the weights with each activation chunk loaded just before its dots took 128).
extern "C" __global__ void hc_read_t1(const FpHcRead p) { pdl_start(); hc_read_t<1, 2, 8>(p, hc_rows(p)); }
extern "C" __global__ void hc_read_t2(const FpHcRead p) { pdl_start(); hc_read_t<2, 2, 8>(p, hc_rows(p)); }
extern "C" __global__ void hc_read_t4(const FpHcRead p) { pdl_start(); hc_read_t<4, 2, 8>(p, hc_rows(p)); }
extern "C" __global__ void hc_read_t4_wide(const FpHcRead p) { pdl_start(); hc_read_t<4, 4, 1, true>(p, hc_rows(p)); }
extern "C" __global__ void hc_read_t4_wide_terms(const FpHcRead p) {
    pdl_start();
    hc_read_t<4, 4, 1, true, true>(p, hc_rows(p));
}

// The mix on tensor cores: the gates G = lo up^T [rows, C*D] are a linear of K = rank (linear.cuh
// `linear_tc_rows`) over `up` tiled feature-major (runtime/src/cuda/weights.rs `tile_hc_up`: gate row d*C + c), so
// an m-tile of 16 gate rows holds all C gates of 16 / C features (C divides 16) and this epilogue finishes them:
// a[r, d] = (sum over c in order of sigmoid(G[r, d*C + c]) * Hn[r, c*D + d]) / C.
struct HcMixStore {
    const float* hn;
    u32 W, dim, hc;
    template <int T>
    DEV void operator()(const FpLinear& a, float (&part)[SPLIT_WARPS][16][T], u32 nb0, u32 i0, u32 G, u32 S,
                        u32 total) const {
        const u32 per = 16 / hc;
        float* O = fptr(a.out);
        for (u32 idx = threadIdx.x; idx < G * per * T; idx += blockDim.x) {
            const u32 gg = idx / (per * T), dl = (idx / T) % per, t = idx % T;
            const u32 d = (nb0 + gg * 16) / hc + dl, i = i0 + t;
            if (d >= dim || i >= total || !row_ok(a.c, i, a.gathered)) continue;
            // The row's Hn values first, all loads in flight at once; then the sum over c in order.
            float hv[16];
#pragma unroll
            for (int cc = 0; cc < 16; cc++) hv[cc] = (u32)cc < hc ? hn[(u64)i * W + cc * dim + d] : 0.0f;
            float acc = 0.0f;
#pragma unroll
            for (int cc = 0; cc < 16; cc++) {
                if ((u32)cc >= hc) break;
                float v = 0.0f;
                for (u32 s = 0; s < S; s++) v += part[gg * S + s][dl * hc + cc][t];
                acc += sigmoidf_(v) * hv[cc];
            }
            O[(u64)i * dim + d] = acc / (float)hc;
        }
    }
};

// Where hc_mix_split leaves lo's BF16 terms: after Hn [rows, C*D] and lo [rows, rank] in the scratch, 16-byte
// aligned (runtime/src/cuda/launch/mod.rs `scratch_elems`).
DEV uint4* hc_mix_xsplit(const FpHcRead& p, u32 nrows) {
    const u64 at = ((u64)nrows * (p.dim * p.hc + p.rank) + 3) / 4 * 4;
    return (uint4*)(fptr(p.c.scratch) + at);
}

// hc_mix_split: lo's rows into their BF16 terms (linear.cuh `linear_split_rows`), from two rows on.
extern "C" __global__ void hc_mix_split(const FpHcRead p) {
    pdl_start();
    const u32 nrows = hc_rows(p);
    const u64 lo = p.c.scratch + (u64)nrows * p.dim * p.hc * 4;
    linear_split_rows(p.c, lo, p.rank, nrows, 1, p.gathered, hc_mix_xsplit(p, nrows));
}

// hc_mix_tc_t1 .. _t16: the gates and the mix, S = p.split slices of K (runtime/src/cuda/launch/hc.rs
// `hc_mix_slices`).
// The gates' linear (K = rank, N = C*D gates, x = lo in the scratch after Hn) as hc_mix_tc and hc_read_one see it.
DEV FpLinear hc_mix_linear(const FpHcRead& p, u32 nrows) {
    const u32 W = p.dim * p.hc;
    FpLinear a;
    a.c = p.c;
    a.x = p.c.scratch + (u64)nrows * W * 4;
    a.w = p.up;
    a.out = p.out;
    a.k = p.rank;
    a.n = W;
    a.sub = 1;
    a.accumulate = 0;
    a.gathered = p.gathered;
    a.split = p.split;
    return a;
}
template <int T>
DEV void hc_mix_tc_entry(const FpHcRead& p) {
    const u32 nrows = hc_rows(p);
    const HcMixStore store{fptr(p.c.scratch), p.dim * p.hc, p.dim, p.hc};
    linear_tc_rows<T, 4>(hc_mix_linear(p, nrows), nrows, blockIdx.x, gridDim.x, hc_mix_xsplit(p, nrows), store);
}
extern "C" __global__ void __launch_bounds__(256, 3) hc_mix_tc_t1(const FpHcRead p) {
    pdl_start();
    hc_mix_tc_entry<1>(p);
}
extern "C" __global__ void __launch_bounds__(256, 3) hc_mix_tc_t2(const FpHcRead p) {
    pdl_start();
    hc_mix_tc_entry<2>(p);
}
extern "C" __global__ void hc_mix_tc_t4(const FpHcRead p) { pdl_start(); hc_mix_tc_entry<4>(p); }
extern "C" __global__ void hc_mix_tc_t8(const FpHcRead p) { pdl_start(); hc_mix_tc_entry<8>(p); }
extern "C" __global__ void hc_mix_tc_t16(const FpHcRead p) { pdl_start(); hc_mix_tc_entry<16>(p); }

// ---- hc_read_one_t1 / _t2 / _t4: the read of up to 4 rows after their norm in one launch (FLASHPLAN_FUSE_SMALL) ----
// hc_read_t*'s blocks (the down and inject dots, 2 outputs a block, K over 8 slices) and hc_mix_tc_t*'s blocks (the
// gates on tensor cores and the mix) as the two phases of one grid, joined by a grid barrier (common.cuh
// `grid_barrier`): one launch instead of two (three from two rows on, with hc_mix_split), and the weights loaded
// early: the down's before the wait on the previous kernel (they do not depend on it; not in the scalar fallback),
// the gates' before the barrier. The arithmetic is that of the launches it replaces: the same chunks summed in the
// same order (warp_dots_rows' vector path, its one batch of HC_ONE_U chunks), lo split into the same BF16 terms
// (tc_split_x, which linear_split_rows also uses) into shared memory, the same MMAs on the same registers
// (tc_batch_mmas of the one partial batch, as tc_steps_split runs it when a slice has fewer than 4 steps), the same
// epilogue. Three rows run as _t4 with its last row left out, as hc_read_t4 and hc_mix_tc_t4 do. The launch
// (runtime/src/cuda/launch/hc.rs `hc_read_one_grid`) is used only where that holds and the whole grid is on the GPU
// at once (the kernel's occupancy, queried at start, times the SMs), as the barrier needs; dependents may launch
// only after the barrier, so none of their blocks can hold a slot that one of this grid's blocks still waits for.
// Beyond 4 rows the separate launches stay: a 16-row version (2 outputs a block, rows in tiles of 4) re-read Hn so
// often that it was slower (H200: lone-w16 2585 -> 2674 us).
#define HC_ONE_U 5
// Steps of 32 of the rank whose terms a row keeps in shared memory.
#define HC_ONE_STEPS 16
template <int T>
DEV void hc_read_one(const FpHcRead& p) {
    const FpCommon& c = p.c;
    const u32 nrows = hc_rows(p), W = p.dim * p.hc;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 nout = p.rank + (p.inject ? p.hc : 0);
    // Phase 1's weights: outputs q0, q0 + 1, the warp's slice of K, the one batch of warp_dots_rows' vector path
    // (W % 8 == 0 and every address 16-byte aligned; else phase 1 runs slice_dots, as hc_read_t does, with no
    // weights loaded before the wait).
    const bool wvec = (W & 7) == 0 && (p.down & 15) == 0 && (p.inject & 15) == 0;  // as hc_read_t's
    const bool vec = wvec && (c.scratch & 15) == 0;
    const u32 q0 = blockIdx.x * 2;
    const u32 nm = q0 < nout ? (nout - q0 < 2 ? nout - q0 : 2) : 0;
    const bf16_t* w[2];
#pragma unroll
    for (int m = 0; m < 2; m++) {
        const u32 q = (u32)m < nm ? q0 + m : q0;
        w[m] = q < p.rank ? (const bf16_t*)p.down + (u64)q * W : (const bf16_t*)p.inject + (u64)(q - p.rank) * W;
    }
    u32 ka, kb;
    slice_bounds(W, SPLIT_WARPS, warp, ka, kb);
    const u32 K = kb - ka;
    uint4 wv[HC_ONE_U][2];
#pragma unroll
    for (int u = 0; u < HC_ONE_U; u++)
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const u32 kk = lane * 8 + u * 256;
            wv[u][m] = (vec && (u32)m < nm && kk < K) ? ldg_stream16_now(w[m] + ka + kk) : zero4();
        }
    asm volatile("griddepcontrol.wait;" ::: "memory");

    // Phase 1 (hc_read_t): lo = silu(down Hn / C), inj = 2 sigmoid(inject Hn / C).
    // The real rows, found once: ok[] for the unrolled loops, the bit mask `real` where the row is a computed index.
    bool ok[T];
    u32 real = 0;
#pragma unroll
    for (int t = 0; t < T; t++) {
        ok[t] = (u32)t < nrows && row_ok(c, t, p.gathered);
        real |= (u32)ok[t] << t;
    }
    const float* hn = fptr(c.scratch);
    float* lo = fptr(c.scratch) + (u64)nrows * W;
    __shared__ float part1[SPLIT_WARPS][2][T];
    if (nm > 0) {
        if (vec) {
            float acc[2][T];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int t = 0; t < T; t++) acc[m][t] = 0.0f;
            batch_dots<T, 2, HC_ONE_U, Bf16Row>(wv, nullptr, hn + ka, W, ok, K, lane * 8, true, acc);
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int t = 0; t < T; t++) {
                    const float r = warp_sum(acc[m][t]);
                    if (lane == 0) part1[warp][m][t] = r;
                }
        } else {
            // One chunk in flight (U = 1): the same sums for any U, and no registers taken from the fast path.
            slice_dots<T, 2, 1>(w, nm, hn, W, ok, W, SPLIT_WARPS, wvec, lane, warp, part1);
        }
        __syncthreads();
        if (threadIdx.x < 2 * T) {
            const u32 m = threadIdx.x / T, t = threadIdx.x % T, q = q0 + m;
            if (m < nm && ((real >> t) & 1)) {
                const float v = slice_sum<T, 2>(part1, 0, SPLIT_WARPS, m, t);
                if (q < p.rank)
                    lo[(u64)t * p.rank + q] = siluf_(v / (float)p.hc);
                else
                    fptr(p.inj)[(u64)t * p.hc + (q - p.rank)] = 2.0f * sigmoidf_(v / (float)p.hc);
            }
        }
    }

    // Phase 2's weights (hc_mix_tc's block blockIdx.x: m-tile group grp, slice sl of at most 3 steps), in flight
    // across the barrier.
    const FpLinear a = hc_mix_linear(p, nrows);
    const u32 g = lane >> 2, q = lane & 3;
    const u32 S = a.split == 0 ? 1 : a.split;
    const u32 G = SPLIT_WARPS / S, grp = warp / S, sl = warp % S;
    const u32 steps = (a.k + 31) / 32, per = (steps + S - 1) / S, tiles = (a.n + 15) / 16;
    const u32 s0 = sl * per < steps ? sl * per : steps;
    const u32 s1 = s0 + per < steps ? s0 + per : steps;
    const u32 nb0 = blockIdx.x * G * 16;
    const bool gates = nb0 < a.n && real != 0;
    const u32 mt = (nb0 + grp * 16) / 16 < tiles ? (nb0 + grp * 16) / 16 : 0;
    const uint4* wt = (const uint4*)a.w + ((u64)mt * steps + s0) * TC_TILE_U4 + lane;
    const u32 left = s1 - s0;
    uint4 w0[3], w1[3];
#pragma unroll
    for (int u = 0; u < 3; u++) {
        const bool in = gates && (u32)u < left;
        w0[u] = in ? ldg_stream16_l2pf_now(wt + u * TC_TILE_U4) : zero4();
        w1[u] = in ? ldg_stream16_l2pf_now(wt + u * TC_TILE_U4 + 32) : zero4();
    }
    grid_barrier((u32*)p.barrier);
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

    // Phase 2 (hc_mix_tc): lo's rows split into shared memory (a row that is not real, or past nrows: zeros;
    // linear_split_rows leaves zeros for the former, and columns past nrows are never written), the slice's MMAs
    // (column g takes row g, columns from T on row 0: never written either), the slices summed and the mix
    // (HcMixStore).
    if (!gates) return;
    __shared__ uint4 xs[T * HC_ONE_STEPS * 12];
    __shared__ float part[SPLIT_WARPS][16][T];
    const float* Xl = fptr(a.x);
    const bool xvec = ((u64)Xl & 15) == 0 && (a.k & 3) == 0;
    for (u32 j = threadIdx.x; j < T * steps * 4; j += blockDim.x) {
        const u32 t = j / (steps * 4), js = j % (steps * 4);
        split_chunk(Xl + (u64)t * a.k, (js / 4) * 32 + (js % 4) * 8, a.k, xvec, (real >> t) & 1, xs + j * 3);
    }
    __syncthreads();
    float acc[1][4];
#pragma unroll
    for (int i = 0; i < 4; i++) acc[0][i] = 0.0f;
    const uint4* const xb[1] = {xs + (((g < (u32)T ? g : 0) * steps + s0) * 4 + q) * 3};
    tc_batch_mmas<3, 1, true>(acc, w0, w1, xb, left);
    tc_acc_to_part<T, 1>(acc, part[warp], g, q);
    __syncthreads();
    const HcMixStore store{hn, W, p.dim, p.hc};
    store(a, part, nb0, 0, G, S, nrows);
}
extern "C" __global__ void __launch_bounds__(256, 3) hc_read_one_t1(const FpHcRead p) { hc_read_one<1>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) hc_read_one_t2(const FpHcRead p) { hc_read_one<2>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) hc_read_one_t4(const FpHcRead p) { hc_read_one<4>(p); }
