// PLE: ple_embed (n-gram hashing and gather), ple_mix (mixing, dilated conv, injection), ple_commit.
#include "common.cuh"


// Values per thread loaded together before they are used or stored (ple_mix; ple_mix_conv has PLE_CU below;
// ple_embed uses common.cuh's block_store_row).
#define PLE_U 16

// One block per row: thread 0 hashes the row's n-gram ids, then the block gathers the head rows.
extern "C" __global__ void ple_embed(const FpPleEmbed p) {
    pdl_start();
    __shared__ u64 ids[FP_MAX_PLE_HEADS];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 hl = p.ngram - 1;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        if (threadIdx.x == 0) {
            const float* hist = state_of(c, stream_of(c, s).slot, p.history);
            // seq = history (hl ids) then the window's tokens 0..=j; cur = its last index.
            const u32 cur = hl + j;
#define SEQ(i) ((i) < hl ? __float_as_uint(hist[(i)]) : token_of(c, s * c.window + (i) - hl))
            u64 shifted[FP_MAX_NGRAM];
            for (u32 k = 0; k < p.ngram; k++) shifted[k] = p.eos;
            shifted[0] = SEQ(cur);
            for (u32 k = 1; k < p.ngram; k++) {
                if (k > cur) break;
                bool eos = false;
                for (u32 i = cur - k; i < cur; i++) eos |= SEQ(i) == p.eos;
                if (eos) break;
                shifted[k] = SEQ(cur - k);
            }
#undef SEQ
            for (u32 order = 2; order <= p.ngram; order++) {
                u64 mixed = shifted[0] * p.mult[0];
                for (u32 k = 1; k < order; k++) mixed ^= shifted[k] * p.mult[k];
                for (u32 local = 0; local < p.heads_per_ngram; local++) {
                    const u32 head = (order - 2) * p.heads_per_ngram + local;
                    ids[head] = mixed % p.sizes[head] + p.offsets[head];
                }
            }
        }
        __syncthreads();
        const u32 W = p.heads * p.head_dim;
        block_store_row(fptr(p.out) + (u64)r * W, W, 1, 0,
                        [&](u32 i) { return bfw(p.table, ids[i / p.head_dim] * p.head_dim + i % p.head_dim); });
        __syncthreads();
    }
}

// Two launches, each a block per (stream, hyper-connection group c, window row j): the group's channels only mix
// with themselves (the norms, the gate and the causal conv are all per group) and each row's gate depends on that
// row alone, so the (group, row) pairs run in parallel.
// - ple_mix: one pass sums |K_c|^2, |H_c|^2, |V|^2 and K_c (1 + nk) . H_c (1 + nq); then score = ik iq dot / sqrt(D),
//   sg = sigmoid(sign(s) sqrt(max(|s|, 1e-6))), ig = 1 / sqrt(sg^2 |V|^2 / D + eps), Gn = (sg v) ig (1 + nc)
//   -> stash, sg -> scratch [rows, C];
// - ple_mix_conv, once every row's Gn is stashed (the first launch reads h, this one updates it, so no block reads
//   a row another has changed): conv over (tail, stashed Gn rows), h += sg v + silu(conv).
DEV void block_sum4(float (&v)[4], float (*sh)[32]) {
#pragma unroll
    for (int k = 0; k < 4; k++) v[k] = warp_sum(v[k]);
    const u32 w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0)
#pragma unroll
        for (int k = 0; k < 4; k++) sh[k][w] = v[k];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float t = 0.0f;
        for (u32 i = 0; i < nw; i++) t += sh[k][i];
        v[k] = t;
    }
}

extern "C" __global__ void ple_mix(const FpPleMix p) {
    pdl_start();
    __shared__ float sh[4][32];
    const FpCommon& c = p.c;
    const u32 D = p.dim, W = p.dim * p.hc;
    const u32 cc = blockIdx.y, j = blockIdx.z;
    if (cc >= p.hc) return;
    for (u32 s = blockIdx.x; s < c.nstreams; s += gridDim.x) {
        if (j >= stream_of(c, s).rows) continue;
        const u64 r = (u64)s * c.window + j;
        const float* K = fptr(p.key) + r * W + (u64)cc * D;
        const float* H = fptr(p.h) + r * W + (u64)cc * D;
        const float* V = fptr(p.value) + r * D;
        float* Gn = fptr(p.stash) + r * W + (u64)cc * D;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        // PLE_U elements' loads in flight before their sums, which run in element order (as one element a
        // step did): every load of a batch is in flight at once.
        for (u32 d0 = threadIdx.x; d0 < D; d0 += blockDim.x * PLE_U) {
            float kv[PLE_U], hv[PLE_U], xv[PLE_U], nk[PLE_U], nq[PLE_U];
#pragma unroll
            for (int u = 0; u < PLE_U; u++) {
                const u32 d = d0 + blockDim.x * u;
                const bool in = d < D;
                kv[u] = in ? K[d] : 0.0f;
                hv[u] = in ? H[d] : 0.0f;
                xv[u] = in ? V[d] : 0.0f;
                nk[u] = in ? bfw(p.norm_key, cc * D + d) : 0.0f;
                nq[u] = in ? bfw(p.norm_query, cc * D + d) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < PLE_U; u++) {
                if (d0 + blockDim.x * u >= D) break;
                const float k = kv[u], h = hv[u], x = xv[u];
                v[0] += k * k;
                v[1] += h * h;
                v[2] += x * x;
                v[3] += (k * (1.0f + nk[u])) * (h * (1.0f + nq[u]));
            }
        }
        block_sum4(v, sh);
        const float ik = 1.0f / sqrtf(v[0] / (float)D + p.eps);
        const float iq = 1.0f / sqrtf(v[1] / (float)D + p.eps);
        const float sc = ik * iq * v[3] / sqrtf((float)D);
        const float sign = sc > 0.0f ? 1.0f : (sc < 0.0f ? -1.0f : 0.0f);
        const float g = sigmoidf_(sqrtf(fmaxf(fabsf(sc), 1e-6f)) * sign);
        const float ig = 1.0f / sqrtf(g * g * v[2] / (float)D + p.eps);
        for (u32 d0 = threadIdx.x; d0 < D; d0 += blockDim.x * PLE_U) {
            // Loads first, then the stores (Gn might alias V for the compiler).
            float xv[PLE_U], nc[PLE_U];
#pragma unroll
            for (int u = 0; u < PLE_U; u++) {
                const u32 d = d0 + blockDim.x * u;
                xv[u] = d < D ? V[d] : 0.0f;
                nc[u] = d < D ? bfw(p.norm_conv, cc * D + d) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < PLE_U; u++) {
                const u32 d = d0 + blockDim.x * u;
                if (d < D) Gn[d] = (g * xv[u]) * ig * (1.0f + nc[u]);
            }
        }
        if (threadIdx.x == 0) fptr(c.scratch)[r * p.hc + cc] = g;
        __syncthreads();
    }
}

// Taps of a channel loaded together in ple_mix_conv (the real config's kernel is 4: one group; a longer kernel runs
// its taps in groups of PLE_MAXK, in tap order).
#define PLE_MAXK 4
// Channels a thread of ple_mix_conv loads at once (D = 2560 at 256 threads: one batch).
#define PLE_CU 10
extern "C" __global__ void ple_mix_conv(const FpPleMix p) {
    pdl_start();
    const FpCommon& c = p.c;
    const u32 D = p.dim, W = p.dim * p.hc;
    const u32 tail_len = (p.kernel - 1) * p.dilation;
    const u32 cc = blockIdx.y, j = blockIdx.z;
    if (cc >= p.hc) return;
    for (u32 s = blockIdx.x; s < c.nstreams; s += gridDim.x) {
        const FpStream& st = stream_of(c, s);
        if (j >= st.rows) continue;
        const float* tail = state_of(c, st.slot, p.tail);
        const u64 r = (u64)s * c.window + j;
        const float g = fptr(c.scratch)[r * p.hc + cc];
        for (u32 d0 = threadIdx.x; d0 < D; d0 += blockDim.x * PLE_CU) {
            // PLE_CU channels' value and h, then a group of taps and weights each, all loaded before their sums
            // and before the stores to h, which the compiler could not move them above (h might alias them). The
            // conv sums in tap order; h += g v + silu(conv) with g v fused into the add (fmaf, as the compiler
            // contracted the one-channel loop before: the same bits).
            float acc[PLE_CU], vv[PLE_CU], hv[PLE_CU];
#pragma unroll
            for (int u = 0; u < PLE_CU; u++) {
                const u32 d = d0 + blockDim.x * u;
                const bool in = d < D;
                acc[u] = 0.0f;
                vv[u] = in ? fptr(p.value)[r * D + d] : 0.0f;
                hv[u] = in ? fptr(p.h)[r * W + cc * D + d] : 0.0f;
            }
            for (u32 t0 = 0; t0 < p.kernel; t0 += PLE_MAXK) {
                float xs[PLE_CU][PLE_MAXK], ws[PLE_CU][PLE_MAXK];
#pragma unroll
                for (int u = 0; u < PLE_CU; u++) {
                    const u32 d = d0 + blockDim.x * u;
                    const u32 ch = cc * D + d;
#pragma unroll
                    for (u32 k = 0; k < PLE_MAXK; k++) {
                        const u32 t = t0 + k, i = j + t * p.dilation;
                        const bool tap = d < D && t < p.kernel;
                        xs[u][k] = !tap ? 0.0f
                                   : i < tail_len ? tail[(u64)i * W + ch]
                                                  : fptr(p.stash)[((u64)s * c.window + i - tail_len) * W + ch];
                        ws[u][k] = tap ? bfw(p.conv_w, (u64)ch * p.kernel + t) : 0.0f;
                    }
                }
#pragma unroll
                for (int u = 0; u < PLE_CU; u++) {
#pragma unroll
                    for (u32 k = 0; k < PLE_MAXK; k++)
                        if (t0 + k < p.kernel) acc[u] += ws[u][k] * xs[u][k];
                }
            }
#pragma unroll
            for (int u = 0; u < PLE_CU; u++) {
                const u32 d = d0 + blockDim.x * u;
                if (d < D) fptr(p.h)[r * W + cc * D + d] = hv[u] + fmaf(g, vv[u], siluf_(acc[u]));
            }
        }
    }
}

// Commit `keep` rows: history = last hl ids of (history, tokens[0..keep]); tail = last tail_len rows of
// (tail, stash[0..keep]). Block (stream, 256 channels), thread per channel. In place, ascending, 16 rows at a time
// (all loads of a group before its stores): entry i reads index keep + i >= i + 1, never a row already rewritten.
#define PLE_COMMIT_U 16
extern "C" __global__ void ple_commit(const FpPleCommit p) {
    pdl_start();
    const FpCommon& c = p.c;
    for (u32 s = blockIdx.x; s < c.nstreams; s += gridDim.x) {
        const FpStream& st = stream_of(c, s);
        const u32 k = keep_of(c, p.keep, s);
        // Nothing kept (a padding stream, rows 0): write nothing. Its slot may be a live stream's (the engine pads
        // with slot 0) committed by another block of this launch; rewriting the old values in place would race.
        if (k == 0) continue;
        if (blockIdx.y == 0 && threadIdx.x == 0) {
            float* hist = state_of(c, st.slot, p.history);
            for (u32 i = 0; i < p.hist_len; i++) {
                const u32 idx = k + i;
                hist[i] = idx < p.hist_len ? hist[idx] : __uint_as_float(token_of(c, s * c.window + idx - p.hist_len));
            }
        }
        float* tail = state_of(c, st.slot, p.tail);
        const u32 ch = blockIdx.y * blockDim.x + threadIdx.x;
        if (ch >= p.width) continue;
        for (u32 i0 = 0; i0 < p.tail_len; i0 += PLE_COMMIT_U) {
            float v[PLE_COMMIT_U];
#pragma unroll
            for (int u = 0; u < PLE_COMMIT_U; u++) {
                const u32 i = i0 + u, idx = k + i;
                v[u] = i >= p.tail_len ? 0.0f
                     : idx < p.tail_len ? tail[(u64)idx * p.width + ch]
                                        : fptr(p.stash)[((u64)s * c.window + idx - p.tail_len) * p.width + ch];
            }
#pragma unroll
            for (int u = 0; u < PLE_COMMIT_U; u++)
                if (i0 + u < p.tail_len) tail[(u64)(i0 + u) * p.width + ch] = v[u];
        }
    }
}
