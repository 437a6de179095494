// PLE: ple_embed (n-gram hashing and gather), ple_mix (mixing, dilated conv, injection), ple_commit.
#include "common.cuh"

#define PLE_MAX_WINDOW 256
#define PLE_MAX_HC 16

// One block per row: thread 0 hashes the row's n-gram ids, then the block gathers the head rows.
extern "C" __global__ void ple_embed(const FpPleEmbed p) {
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
        for (u32 i = threadIdx.x; i < W; i += blockDim.x) {
            const u32 head = i / p.head_dim, d = i % p.head_dim;
            fptr(p.out)[(u64)r * W + i] = bfw(p.table, ids[head] * p.head_dim + d);
        }
        __syncthreads();
    }
}

// One block per stream (its rows are causal through the conv). Phase 1 per row: kn = norm_key(key),
// qn = norm_query(h), score_c = kn[c].qn[c] / sqrt(D), sg_c = sigmoid(sign(s) sqrt(max(|s|, 1e-6))),
// G = sg_c v, Gn = norm_conv(G) -> stash. Phase 2 per row: conv over (tail, stashed Gn rows), h += G + silu(conv).
extern "C" __global__ void ple_mix(const FpPleMix p) {
    __shared__ float sh[32];
    __shared__ float sg[PLE_MAX_WINDOW * PLE_MAX_HC];
    const FpCommon& c = p.c;
    const u32 D = p.dim, W = p.dim * p.hc;
    const u32 tail_len = (p.kernel - 1) * p.dilation;
    for (u32 s = blockIdx.x; s < c.nstreams; s += gridDim.x) {
        const FpStream& st = stream_of(c, s);
        const float* tail = state_of(c, st.slot, p.tail);
        for (u32 j = 0; j < st.rows; j++) {
            const u64 r = (u64)s * c.window + j;
            const float* K = fptr(p.key) + r * W;
            const float* H = fptr(p.h) + r * W;
            const float* V = fptr(p.value) + r * D;
            float* Gn = fptr(p.stash) + r * W;
            for (u32 cc = 0; cc < p.hc; cc++) {
                float a = 0.0f, b = 0.0f;
                for (u32 d = threadIdx.x; d < D; d += blockDim.x) {
                    a += K[cc * D + d] * K[cc * D + d];
                    b += H[cc * D + d] * H[cc * D + d];
                }
                const float ik = 1.0f / sqrtf(block_sum(a, sh) / (float)D + p.eps);
                const float iq = 1.0f / sqrtf(block_sum(b, sh) / (float)D + p.eps);
                float dp = 0.0f;
                for (u32 d = threadIdx.x; d < D; d += blockDim.x) {
                    const u32 i = cc * D + d;
                    dp += (K[i] * ik * (1.0f + bfw(p.norm_key, i))) * (H[i] * iq * (1.0f + bfw(p.norm_query, i)));
                }
                const float sc = block_sum(dp, sh) / sqrtf((float)D);
                const float sign = sc > 0.0f ? 1.0f : (sc < 0.0f ? -1.0f : 0.0f);
                const float g = sigmoidf_(sqrtf(fmaxf(fabsf(sc), 1e-6f)) * sign);
                float gg = 0.0f;
                for (u32 d = threadIdx.x; d < D; d += blockDim.x) gg += (g * V[d]) * (g * V[d]);
                const float ig = 1.0f / sqrtf(block_sum(gg, sh) / (float)D + p.eps);
                for (u32 d = threadIdx.x; d < D; d += blockDim.x) {
                    const u32 i = cc * D + d;
                    Gn[i] = (g * V[d]) * ig * (1.0f + bfw(p.norm_conv, i));
                }
                if (threadIdx.x == 0) sg[j * PLE_MAX_HC + cc] = g;
            }
        }
        __syncthreads();
        for (u32 j = 0; j < st.rows; j++) {
            const u64 r = (u64)s * c.window + j;
            for (u32 ch = threadIdx.x; ch < W; ch += blockDim.x) {
                float acc = 0.0f;
                for (u32 t = 0; t < p.kernel; t++) {
                    const u32 i = j + t * p.dilation;
                    const float x = i < tail_len ? tail[(u64)i * W + ch]
                                                 : fptr(p.stash)[((u64)s * c.window + i - tail_len) * W + ch];
                    acc += bfw(p.conv_w, (u64)ch * p.kernel + t) * x;
                }
                const float G = sg[j * PLE_MAX_HC + ch / D] * fptr(p.value)[r * D + ch % D];
                fptr(p.h)[r * W + ch] += G + siluf_(acc);
            }
        }
        __syncthreads();
    }
}

// Commit `keep` rows: history = last hl ids of (history, tokens[0..keep]); tail = last tail_len rows of
// (tail, stash[0..keep]). In place, ascending: entry i reads index keep + i >= i, not yet overwritten.
extern "C" __global__ void ple_commit(const FpPleCommit p) {
    const FpCommon& c = p.c;
    for (u32 s = blockIdx.x; s < c.nstreams; s += gridDim.x) {
        const FpStream& st = stream_of(c, s);
        const u32 k = keep_of(c, p.keep, s);
        // Nothing kept (a padding stream, rows 0): write nothing. Its slot may be a live stream's (the engine pads
        // with slot 0) committed by another block of this launch; rewriting the old values in place would race.
        if (k == 0) continue;
        if (threadIdx.x == 0) {
            float* hist = state_of(c, st.slot, p.history);
            for (u32 i = 0; i < p.hist_len; i++) {
                const u32 idx = k + i;
                hist[i] = idx < p.hist_len ? hist[idx] : __uint_as_float(token_of(c, s * c.window + idx - p.hist_len));
            }
        }
        float* tail = state_of(c, st.slot, p.tail);
        for (u32 ch = threadIdx.x; ch < p.width; ch += blockDim.x) {
            for (u32 i = 0; i < p.tail_len; i++) {
                const u32 idx = k + i;
                tail[(u64)i * p.width + ch] = idx < p.tail_len
                    ? tail[(u64)idx * p.width + ch]
                    : fptr(p.stash)[((u64)s * c.window + idx - p.tail_len) * p.width + ch];
            }
        }
        __syncthreads();
    }
}
