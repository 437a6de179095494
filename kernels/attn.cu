// Attention with QSA sparse selection: attn_prep, indexer_prep, indexer_select, sparse_attn, indexer_commit.
#include "common.cuh"

#define ATTN_MAX_HD 512
#define ATTN_WARPS 8
#define SA_WARPS 16

// One block per row, one warp per head: q = RoPE(q_norm(q part)), gate copied; k = RoPE(k_norm(k)) and v written
// to the slot's caches at pos + j.
extern "C" __global__ void attn_prep(const FpAttnPrep p) {
    __shared__ float buf[ATTN_WARPS][ATTN_MAX_HD];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 hd = p.hd;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const FpStream& st = stream_of(c, s);
        const u32 pos = st.pos + j;
        float* b = buf[warp];
        for (u32 hh = warp; hh < p.heads + p.kv_heads; hh += nw) {
            if (hh < p.heads) {
                const float* src = fptr(p.q_raw) + (u64)r * p.heads * 2 * hd + (u64)hh * 2 * hd;
                rms_warp(src, p.q_norm, b, hd, p.eps, lane);
                rope_warp(b, fptr(p.rope), p.rot_half, pos, p.attn_factor, lane);
                for (u32 i = lane; i < hd; i += 32) {
                    fptr(p.q)[(u64)r * p.heads * hd + hh * hd + i] = b[i];
                    fptr(p.gate)[(u64)r * p.heads * hd + hh * hd + i] = src[hd + i];
                }
            } else {
                const u32 kh = hh - p.heads;
                const u64 w = (u64)p.kv_heads * hd;
                const float* src = fptr(p.k_raw) + (u64)r * w + kh * hd;
                rms_warp(src, p.k_norm, b, hd, p.eps, lane);
                rope_warp(b, fptr(p.rope), p.rot_half, pos, p.attn_factor, lane);
                float* kc = state_of(c, st.slot, p.k_cache) + (u64)pos * w + kh * hd;
                float* vc = state_of(c, st.slot, p.v_cache) + (u64)pos * w + kh * hd;
                for (u32 i = lane; i < hd; i += 32) {
                    kc[i] = b[i];
                    vc[i] = fptr(p.v_raw)[(u64)r * w + kh * hd + i];
                }
            }
            __syncwarp();
        }
    }
}

// One block per row: ih query heads of id = RoPE(q_layernorm(.)) -> q_out; the raw key -> raw_keys[pos + j].
extern "C" __global__ void indexer_prep(const FpIndexerPrep p) {
    __shared__ float buf[ATTN_WARPS][ATTN_MAX_HD];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 id = p.id, W = (p.ih + 1) * id;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const FpStream& st = stream_of(c, s);
        const u32 pos = st.pos + j;
        const float* src = fptr(p.qk) + (u64)r * W;
        float* b = buf[warp];
        for (u32 hh = warp; hh < p.ih; hh += nw) {
            rms_warp(src + hh * id, p.q_norm, b, id, p.eps, lane);
            rope_warp(b, fptr(p.rope), p.rot_half, pos, p.attn_factor, lane);
            for (u32 i = lane; i < id; i += 32) fptr(p.q_out)[(u64)r * p.ih * id + hh * id + i] = b[i];
            __syncwarp();
        }
        if (warp == nw - 1) {
            float* rk = state_of(c, st.slot, p.raw_keys) + (u64)pos * id;
            for (u32 i = lane; i < id; i += 32) rk[i] = src[p.ih * id + i];
        }
    }
}

// One block per row: score every complete visible block (pooled key when committed, else computed from the raw
// keys), keep the top `topk` (score desc, id asc) sorted by block id. Scores live in scratch [rows, 2 nb_max];
// chosen blocks are marked -1 (scores are >= 0).
#define SEL_SH 4096
extern "C" __global__ void indexer_select(const FpIndexerSelect p) {
    __shared__ float key[ATTN_WARPS][ATTN_MAX_HD];
    __shared__ float scs[SEL_SH];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 id = p.id;
    const float inv_sqrt = sqrtf((float)id);
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const FpStream& st = stream_of(c, s);
        const u32 pos = st.pos + j;
        const u32 nb = (pos + 1) / p.ratio;
        const float* raw = state_of(c, st.slot, p.raw_keys);
        const float* pooled = state_of(c, st.slot, p.pooled);
        const float* q = fptr(p.q) + (u64)r * p.ih * id;
        float* sc = fptr(c.scratch) + (u64)r * 2 * p.nb_max;
        u32* sel = uptr(p.sel) + (u64)r * p.topk;
        const u32 take = nb < p.topk ? nb : p.topk;
        if (nb <= p.topk) {
            for (u32 i = threadIdx.x; i < p.topk; i += blockDim.x) sel[i] = i < nb ? i : 0xffffffffu;
            continue;
        }
        // Pooled (committed) blocks: 4 per warp at a time, their dots interleaved (same arithmetic per block: per
        // head lane-order sum and warp tree, heads summed in order).
        const u32 ncom = st.committed / p.ratio < nb ? st.committed / p.ratio : nb;
        for (u32 b0 = warp * 4; b0 < ncom; b0 += nw * 4) {
            const float* kb[4];
            float tot[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                kb[u] = pooled + (u64)(b0 + u < ncom ? b0 + u : b0) * id;
                tot[u] = 0.0f;
            }
            for (u32 hh = 0; hh < p.ih; hh++) {
                const float* qh = q + hh * id;
                float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (u32 i = lane; i < id; i += 32) {
                    const float qi = qh[i];
#pragma unroll
                    for (int u = 0; u < 4; u++) a[u] += qi * kb[u][i];
                }
#pragma unroll
                for (int u = 0; u < 4; u++) tot[u] += fmaxf(warp_sum(a[u]), 0.0f);
            }
            if (lane == 0)
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (b0 + u < ncom) sc[b0 + u] = tot[u] / inv_sqrt;
        }
        for (u32 b = ncom + warp; b < nb; b += nw) {
            const float* k;
            if ((b + 1) * p.ratio <= st.committed) {
                k = pooled + (u64)b * id;
            } else {
                block_key_warp(raw, b, id, p.ratio, p.k_norm, p.eps, fptr(p.rope), p.rot_half, p.attn_factor,
                               key[warp], lane);
                k = key[warp];
            }
            float acc = 0.0f;
            for (u32 hh = 0; hh < p.ih; hh++) acc += fmaxf(warp_dot_f(q + hh * id, k, id, lane), 0.0f);
            if (lane == 0) sc[b] = acc / inv_sqrt;
            __syncwarp();
        }
        __syncthreads();
        // Top-take by rank: block b is selected when fewer than `take` blocks beat it (higher score, or equal score
        // and lower index) -- the same set as repeated argmax with lowest-index ties, in O(nb^2 / threads) with
        // no serial rounds. Ranks go to the second half of the row's scratch, then the marks into sc.
        float* rk = sc + p.nb_max;
        const bool in_sh = nb <= SEL_SH;
        if (in_sh)
            for (u32 b = threadIdx.x; b < nb; b += blockDim.x) scs[b] = sc[b];
        __syncthreads();
        const float* sv = in_sh ? scs : sc;
        for (u32 b = threadIdx.x; b < nb; b += blockDim.x) {
            const float v = sv[b];
            u32 beat = 0;
            for (u32 q = 0; q < nb; q++) {
                const float u = sv[q];
                beat += (u > v || (u == v && q < b)) ? 1u : 0u;
            }
            rk[b] = beat < take ? 1.0f : 0.0f;
        }
        __syncthreads();
        for (u32 b = threadIdx.x; b < nb; b += blockDim.x)
            if (rk[b] > 0.5f) sc[b] = -1.0f;
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 n = 0;
            for (u32 b = 0; b < nb && n < take; b++)
                if (sc[b] < 0.0f) sel[n++] = b;
            for (; n < p.topk; n++) sel[n] = 0xffffffffu;
        }
        __syncthreads();
    }
}

// Block (row, head): softmax(q.k / sqrt(hd)) v over the selected blocks' tokens and the tail, times sigmoid(gate).
// Scores in scratch [rows * heads, max_tokens].
extern "C" __global__ void sparse_attn(const FpSparseAttn p) {
    __shared__ float sh[32];
    __shared__ float part[SA_WARPS][ATTN_MAX_HD];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 hd = p.hd;
    const u32 hh = blockIdx.y;
    if (hh >= p.heads) return;
    const u32 kv = hh / (p.heads / p.kv_heads);
    const u64 w = (u64)p.kv_heads * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const FpStream& st = stream_of(c, s);
        const u32 pos = st.pos + j;
        const u32 nb = (pos + 1) / p.ratio;
        const u32* sel = uptr(p.sel) + (u64)r * p.topk;
        u32 nsel = 0;
        while (nsel < p.topk && sel[nsel] != 0xffffffffu) nsel++;
        const u32 nt = nsel * p.ratio + (pos + 1 - nb * p.ratio);
        const float* kc = state_of(c, st.slot, p.k_cache);
        const float* vc = state_of(c, st.slot, p.v_cache);
        const float* q = fptr(p.q) + (u64)r * p.heads * hd + hh * hd;
        float* sc = fptr(c.scratch) + ((u64)r * p.heads + hh) * p.max_tokens;
#define TOK(m) ((m) < nsel * p.ratio ? sel[(m) / p.ratio] * p.ratio + (m) % p.ratio : nb * p.ratio + (m) - nsel * p.ratio)
        // Scores: warp w takes tokens 4w.., 4 at a time (independent dots in flight); each dot is the same lane
        // order and warp tree whatever the grouping.
        for (u32 m0 = warp * 4; m0 < nt; m0 += nw * 4) {
            const float* kr[4];
            float acc[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                kr[u] = kc + (u64)TOK(m0 + u < nt ? m0 + u : m0) * w + kv * hd;
                acc[u] = 0.0f;
            }
            for (u32 i = lane; i < hd; i += 32) {
                const float qi = q[i];
#pragma unroll
                for (int u = 0; u < 4; u++) acc[u] = fmaf(qi, kr[u][i], acc[u]);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const float d = warp_sum(acc[u]);
                if (lane == 0 && m0 + u < nt) sc[m0 + u] = d * scale;
            }
        }
        __syncthreads();
        float mx = -INFINITY;
        for (u32 m = threadIdx.x; m < nt; m += blockDim.x) mx = fmaxf(mx, sc[m]);
        mx = block_max(mx, sh);
        float z = 0.0f;
        for (u32 m = threadIdx.x; m < nt; m += blockDim.x) {
            const float e = expf(sc[m] - mx);
            sc[m] = e;
            z += e;
        }
        z = block_sum(z, sh);
        // P.V: warp w takes tokens m = w, w + nw, ... (lane per value column), partials summed over warps in order.
        {
            float o[ATTN_MAX_HD / 32];
#pragma unroll
            for (int kd = 0; kd < ATTN_MAX_HD / 32; kd++) o[kd] = 0.0f;
            for (u32 m = warp; m < nt; m += nw) {
                const float pm = sc[m] / z;
                const float* vr = vc + (u64)TOK(m) * w + kv * hd;
#pragma unroll
                for (int kd = 0; kd < ATTN_MAX_HD / 32; kd++) {
                    const u32 d = lane + 32 * kd;
                    if (d < hd) o[kd] += pm * vr[d];
                }
            }
#pragma unroll
            for (int kd = 0; kd < ATTN_MAX_HD / 32; kd++) {
                const u32 d = lane + 32 * kd;
                if (d < hd) part[warp][d] = o[kd];
            }
        }
        __syncthreads();
        for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
            float o = 0.0f;
            for (u32 ww = 0; ww < nw; ww++) o += part[ww][d];
            const u64 oi = (u64)r * p.heads * hd + hh * hd + d;
            fptr(p.out)[oi] = o * sigmoidf_(fptr(p.gate)[oi]);
        }
#undef TOK
        __syncthreads();
    }
}

// One block per stream: pools the blocks completed by the kept rows into the pooled cache (one warp per block).
extern "C" __global__ void indexer_commit(const FpIndexerCommit p) {
    __shared__ float key[ATTN_WARPS][ATTN_MAX_HD];
    const FpCommon& c = p.c;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 s = blockIdx.x; s < c.nstreams; s += gridDim.x) {
        const FpStream& st = stream_of(c, s);
        const u32 k = keep_of(c, p.keep, s);
        const u32 end = st.pos + k;
        const float* raw = state_of(c, st.slot, p.raw_keys);
        float* pooled = state_of(c, st.slot, p.pooled);
        for (u32 b = st.committed / p.ratio + warp; b < end / p.ratio; b += nw) {
            block_key_warp(raw, b, p.id, p.ratio, p.k_norm, p.eps, fptr(p.rope), p.rot_half, p.attn_factor,
                           key[warp], lane);
            for (u32 i = lane; i < p.id; i += 32) pooled[(u64)b * p.id + i] = key[warp][i];
            __syncwarp();
        }
    }
}
