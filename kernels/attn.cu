// Attention with QSA sparse selection: attn_prep, indexer_prep (or both as attn_index_prep), indexer_select,
// sparse_attn, indexer_commit.
#include "common.cuh"

#define ATTN_MAX_HD 512
#define ATTN_WARPS 8
// A lane's values of a head of at most ATTN_MAX_HD: lane, lane + 32, ...
#define ATTN_HD_U (ATTN_MAX_HD / 32)

// One head of attn_prep by a warp: out = RoPE(norm(x)) at position pos, and copy_out = copy (the gate of a query
// head, v of a kv head), both hd long. Every load (x, its norm weights, copy) is issued before the first store (the
// stores might alias the loads for all the compiler knows); rms_warp_reg gives rms_warp's bits. `b`: the warp's
// shared buffer of ATTN_MAX_HD.
DEV void attn_head_prep(const float* x, const float* copy, const FpAttnPrep& p, u64 norm, u32 pos, float* out,
                        float* copy_out, float* b, u32 lane) {
    float xv[ATTN_HD_U], cv[ATTN_HD_U];
    load_strided(xv, lane, 32, p.hd, 0.0f, [&](u32 i) { return x[i]; });
    load_strided(cv, lane, 32, p.hd, 0.0f, [&](u32 i) { return copy[i]; });
    rms_warp_reg(xv, norm, b, p.hd, p.eps, lane);
    rope_warp(b, fptr(p.rope), p.rot_half, pos, p.attn_factor, lane);
#pragma unroll
    for (int u = 0; u < ATTN_HD_U; u++) {
        const u32 i = lane + 32 * u;
        if (i < p.hd) {
            out[i] = b[i];
            copy_out[i] = cv[u];
        }
    }
}

// Block (row, group of 8 heads: y of ny), one warp per head: q = RoPE(q_norm(q part)), gate copied; k =
// RoPE(k_norm(k)) and v written to the slot's caches at pos + j. A head's values never depend on the grid. `buf`: the
// block's shared buffer, ATTN_MAX_HD floats a warp.
DEV void attn_prep_heads(const FpAttnPrep& p, u32 y, u32 ny, float (*buf)[ATTN_MAX_HD]) {
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
        for (u32 hh = y * nw + warp; hh < p.heads + p.kv_heads; hh += ny * nw) {
            if (hh < p.heads) {
                const u64 o = (u64)r * p.heads * hd + hh * hd;
                const float* src = fptr(p.q_raw) + (u64)r * p.heads * 2 * hd + (u64)hh * 2 * hd;
                attn_head_prep(src, src + hd, p, p.q_norm, pos, fptr(p.q) + o, fptr(p.gate) + o, b, lane);
            } else {
                const u32 kh = hh - p.heads;
                const u64 w = (u64)p.kv_heads * hd, o = (u64)pos * w + kh * hd;
                const u64 in = (u64)r * w + kh * hd;
                attn_head_prep(fptr(p.k_raw) + in, fptr(p.v_raw) + in, p, p.k_norm, pos,
                               state_of(c, st.slot, p.k_cache) + o, state_of(c, st.slot, p.v_cache) + o, b, lane);
            }
            __syncwarp();
        }
    }
}
extern "C" __global__ void attn_prep(const FpAttnPrep p) {
    pdl_start();
    __shared__ float buf[ATTN_WARPS][ATTN_MAX_HD];
    attn_prep_heads(p, blockIdx.y, gridDim.y, buf);
}

// Block per row: ih query heads of id = RoPE(q_layernorm(.)) -> q_out; the raw key -> raw_keys[pos + j]. `buf` as
// attn_prep_heads'.
DEV void indexer_prep_rows(const FpIndexerPrep& p, float (*buf)[ATTN_MAX_HD]) {
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
        // As attn_prep: a head's loads (and the raw key's) issued before its first store.
        for (u32 hh = warp; hh < p.ih; hh += nw) {
            float xv[ATTN_HD_U];
            load_strided(xv, lane, 32, id, 0.0f, [&](u32 i) { return src[hh * id + i]; });
            rms_warp_reg(xv, p.q_norm, b, id, p.eps, lane);
            rope_warp(b, fptr(p.rope), p.rot_half, pos, p.attn_factor, lane);
            for (u32 i = lane; i < id; i += 32) fptr(p.q_out)[(u64)r * p.ih * id + hh * id + i] = b[i];
            __syncwarp();
        }
        if (warp == nw - 1) {
            float* rk = state_of(c, st.slot, p.raw_keys) + (u64)pos * id;
            float kv[ATTN_HD_U];
            load_strided(kv, lane, 32, id, 0.0f, [&](u32 i) { return src[p.ih * id + i]; });
#pragma unroll
            for (int u = 0; u < ATTN_HD_U; u++)
                if (lane + 32 * u < id) rk[lane + 32 * u] = kv[u];
        }
    }
}
extern "C" __global__ void indexer_prep(const FpIndexerPrep p) {
    pdl_start();
    __shared__ float buf[ATTN_WARPS][ATTN_MAX_HD];
    indexer_prep_rows(p, buf);
}

// attn_prep and indexer_prep of one layer in one launch (FLASHPLAN_FUSE_SMALL; runtime/src/cuda/launch/attn.rs
// `fuse_preps`): the grid rows y below the last take attn_prep's heads as its own grid would (gridDim.y - 1 groups),
// the last takes indexer_prep's row blockIdx.x. The two read and write disjoint buffers (the launch checks it), so
// one wait on the projections serves both: the same values, one launch fewer a layer.
extern "C" __global__ void attn_index_prep(const FpAttnIndexPrep p) {
    pdl_start();
    __shared__ float buf[ATTN_WARPS][ATTN_MAX_HD];
    if (blockIdx.y + 1 < gridDim.y)
        attn_prep_heads(p.attn, blockIdx.y, gridDim.y - 1, buf);
    else
        indexer_prep_rows(p.index, buf);
}

// QSA selection in two launches (one node). Scores live in scratch [rows, 2 nb_max].
// - indexer_score: block (row, SC_CHUNK visible blocks), a warp per block: sum over indexer heads (in order) of
//   relu(q_h . k_b) / sqrt(id), with k_b the pooled key when committed, else computed from the raw keys. The
//   lane takes 4 consecutive dims at a time, then a fixed warp tree: a block's score never depends on the grid.
// - indexer_select: block per row (1024 threads): radix select of the topk-th largest score, then the blocks above
//   it and the lowest-index blocks equal to it: the same set as repeated argmax with lowest-index ties; the kept
//   ids are written in ascending order (block prefix sums).
#define SC_CHUNK 16
#define IDX_MAX_Q 4096
extern "C" __global__ void indexer_score(const FpIndexerSelect p) {
    pdl_start();
    __shared__ float qs[IDX_MAX_Q];
    __shared__ __align__(16) float key[ATTN_WARPS][ATTN_MAX_HD];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 id = p.id;
    const float sq = sqrtf((float)id);
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const FpStream& st = stream_of(c, s);
        const u32 pos = st.pos + j;
        const u32 nb = (pos + 1) / p.ratio;
        const u32 b0 = blockIdx.y * SC_CHUNK;
        if (nb <= p.topk || b0 >= nb) continue;
        const float* raw = state_of(c, st.slot, p.raw_keys);
        const float* pooled = state_of(c, st.slot, p.pooled);
        // The arithmetic depends on id only; the alignment of the slot's pooled keys picks vector or scalar loads
        // of the same 4 values.
        const bool vec = (id & 3) == 0;
        const bool aligned = (((u64)pooled) & 15) == 0;
        const float* q = fptr(p.q) + (u64)r * p.ih * id;
        for (u32 i = threadIdx.x; i < p.ih * id; i += blockDim.x) qs[i] = q[i];
        __syncthreads();
        float* sc = fptr(c.scratch) + (u64)r * 2 * p.nb_max;
        const u32 b1 = b0 + SC_CHUNK < nb ? b0 + SC_CHUNK : nb;
        for (u32 b = b0 + warp; b < b1; b += nw) {
            const float* k;
            if ((b + 1) * p.ratio <= st.committed) {
                k = pooled + (u64)b * id;
            } else {
                block_key_warp(raw, b, id, p.ratio, p.k_norm, p.eps, fptr(p.rope), p.rot_half, p.attn_factor,
                               key[warp], lane);
                k = key[warp];
            }
            float tot = 0.0f;
            if (vec) {
                float kv[4][4];
                const u32 nch = (id / 4 + 31) / 32;
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const u32 d = (lane + 32 * u) * 4;
                    if ((u32)u < nch && d < id) {
                        if (aligned || k == key[warp]) {
                            const float4 v4 = *(const float4*)(k + d);
                            kv[u][0] = v4.x; kv[u][1] = v4.y; kv[u][2] = v4.z; kv[u][3] = v4.w;
                        } else {
                            kv[u][0] = k[d]; kv[u][1] = k[d + 1]; kv[u][2] = k[d + 2]; kv[u][3] = k[d + 3];
                        }
                    } else {
                        kv[u][0] = kv[u][1] = kv[u][2] = kv[u][3] = 0.0f;
                    }
                }
                for (u32 hh = 0; hh < p.ih; hh++) {
                    const float* qh = qs + hh * id;
                    float a = 0.0f;
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        const u32 d = (lane + 32 * u) * 4;
                        if ((u32)u >= nch || d >= id) continue;
                        float t = qh[d] * kv[u][0];
                        t = fmaf(qh[d + 1], kv[u][1], t);
                        t = fmaf(qh[d + 2], kv[u][2], t);
                        t = fmaf(qh[d + 3], kv[u][3], t);
                        a += t;
                    }
                    // ids beyond 512 (4 chunks of 128): the rest, scalar, in order.
                    for (u32 d = 512 + lane; d < id; d += 32) a = fmaf(qh[d], k[d], a);
                    tot += fmaxf(warp_sum(a), 0.0f);
                }
            } else {
                for (u32 hh = 0; hh < p.ih; hh++) tot += fmaxf(warp_dot_f(qs + hh * id, k, id, lane), 0.0f);
            }
            if (lane == 0) sc[b] = tot / sq;
            __syncwarp();
        }
        __syncthreads();
    }
}

extern "C" __global__ void indexer_select(const FpIndexerSelect p) {
    pdl_start();
    __shared__ u32 hist[256];
    __shared__ u32 scan[33];
    __shared__ u32 res[2];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const FpStream& st = stream_of(c, s);
        const u32 pos = st.pos + j;
        const u32 nb = (pos + 1) / p.ratio;
        u32* sel = uptr(p.sel) + (u64)r * p.topk;
        if (nb <= p.topk) {
            for (u32 i = threadIdx.x; i < p.topk; i += blockDim.x) sel[i] = i < nb ? i : 0xffffffffu;
            continue;
        }
        const u32* sc = (const u32*)(fptr(c.scratch) + (u64)r * 2 * p.nb_max);
        // Radix select of the topk-th largest score (scores are >= +0, so their bit patterns order as u32).
        u32 prefix, need;
        block_kth_largest([=](u32 b) { return sc[b]; }, nb, p.topk, hist, res, prefix, need);
        // prefix is now the threshold score: keep every block above it and the `need` lowest-index blocks equal to it
        // (score desc, id asc). Thread t owns the contiguous blocks [t * per, (t + 1) * per); ids in ascending order.
        const u32 per = (nb + blockDim.x - 1) / blockDim.x;
        const u32 lo = threadIdx.x * per < nb ? threadIdx.x * per : nb;
        const u32 hi = lo + per < nb ? lo + per : nb;
        u32 eq = 0;
        for (u32 b = lo; b < hi; b++) eq += sc[b] == prefix ? 1u : 0u;
        u32 total;
        const u32 eq_before = block_scan_u32(eq, scan, total);
        u32 mine = 0, e = eq_before;
        for (u32 b = lo; b < hi; b++) {
            const u32 x = sc[b];
            const bool keep = x > prefix || (x == prefix && e < need);
            e += x == prefix ? 1u : 0u;
            mine += keep ? 1u : 0u;
        }
        u32 off = block_scan_u32(mine, scan, total);
        e = eq_before;
        for (u32 b = lo; b < hi; b++) {
            const u32 x = sc[b];
            const bool keep = x > prefix || (x == prefix && e < need);
            e += x == prefix ? 1u : 0u;
            if (keep) sel[off++] = b;
        }
        for (u32 i = total + threadIdx.x; i < p.topk; i += blockDim.x) sel[i] = 0xffffffffu;
        __syncthreads();
    }
}

// Sparse attention in two launches (one node), flash-decoding style over a fixed token partition.
// - sparse_attn: block (row, kv head, chunk of SA_CHUNK tokens) for all the kv head's query heads: scores
//   q.k / sqrt(hd) (warp per token, lane per 8 dims: `sa_dims`, fixed tree), the chunk's max m and sum l of
//   exp(s - m), and o = sum exp(s - m) v (thread per value column, tokens in order) into scratch
//   [rows, heads, nchunks, 2 + hd].
// - sparse_attn_combine: block per (row, head): M = max m_z, out = sum_z exp(m_z - M) o_z / sum_z exp(m_z - M) l_z
//   (chunks in order), times sigmoid(gate).
// The token partition depends only on the position (never on the grid or the other rows): row invariant.
#define SA_CHUNK 32
#define SA_MAX_G 16
#define SA_MAX_Q 8192
#define SA_MAX_SPLIT 256
// Value loads of P.V in flight per thread (a batch of tokens, summed in token order after).
#define SA_PV_U 16
// Tokens of a warp whose scores share each head's load of q (SA_CHUNK / ATTN_WARPS = 4 tokens a warp): 2 keep the
// kernel at 80 registers, three blocks an SM; 4 spilled (14 stores) and were slower at 16 rows (99.1-99.4 against
// 94.3-94.6 us a replay).
#define SA_QT 2
DEV u32 sa_nt(const FpSparseAttn& p, u32 pos, u32& nsel, u32& nb) {
    nb = (pos + 1) / p.ratio;
    nsel = nb < p.topk ? nb : p.topk;
    return nsel * p.ratio + (pos + 1 - nb * p.ratio);
}
DEV u32 sa_nsplit(const FpSparseAttn& p) { return (p.max_tokens + SA_CHUNK - 1) / SA_CHUNK; }

// The warp sums of 16 values per lane at once (a reduce-scatter): the xor butterfly of warp_sum (offsets 16, 8, 4,
// 2, 1), but at each of the first four levels a lane keeps half of its values and sends the other half, so 16 + 1
// shuffles replace 16 x 5. Lanes 2h and 2h + 1 end with value h summed over the warp, the same pairs added at the
// same levels as warp_sum (a + b == b + a exactly): bit for bit warp_sum(v[h]).
DEV float warp_sum_scatter16(const float (&v)[16], u32 lane) {
    float a[8];
    const bool b16 = lane & 16;
#pragma unroll
    for (int k = 0; k < 8; k++) a[k] = (b16 ? v[k + 8] : v[k]) + __shfl_xor_sync(FULL_MASK, b16 ? v[k] : v[k + 8], 16);
    const bool b8 = lane & 8;
    float b[4];
#pragma unroll
    for (int k = 0; k < 4; k++) b[k] = (b8 ? a[k + 4] : a[k]) + __shfl_xor_sync(FULL_MASK, b8 ? a[k] : a[k + 4], 8);
    const bool b4 = lane & 4;
    float c2[2];
#pragma unroll
    for (int k = 0; k < 2; k++) c2[k] = (b4 ? b[k + 2] : b[k]) + __shfl_xor_sync(FULL_MASK, b4 ? b[k] : b[k + 2], 4);
    const bool b2 = lane & 2;
    float d = (b2 ? c2[1] : c2[0]) + __shfl_xor_sync(FULL_MASK, b2 ? c2[0] : c2[1], 2);
    return d + __shfl_xor_sync(FULL_MASK, d, 1);
}

// The 8 values of a row of hd (<= 256, a multiple of 8) that lane `lane` holds in sparse_attn's scores: dims
// 4 lane .. 4 lane + 3, then 128 + 4 lane .. + 3; zeros past hd. vec: the row is 16-byte aligned.
DEV void sa_dims(const float* row, u32 hd, u32 lane, bool vec, float (&x)[8]) {
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const u32 d = 128 * hf + 4 * lane;
        if (d < hd && vec) {
            const float4 v = *(const float4*)(row + d);
            x[4 * hf] = v.x;
            x[4 * hf + 1] = v.y;
            x[4 * hf + 2] = v.z;
            x[4 * hf + 3] = v.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) x[4 * hf + e] = d < hd ? row[d + e] : 0.0f;
        }
    }
}

// The body, with GM >= G query heads per kv head as the bound of its head loops: heads past G are predicated off as
// at any GM, so the arithmetic is the same for every GM; the smallest GM (4, 8, 12 or 16) saves the instructions of
// the heads that are not there (the kernel is issue-bound: at one row a block per SM). Entry points below.
// STAGE_V: on the fast path the chunk's values are copied into shared memory (`cp_async16`, no registers) while the
// keys load, in vs after q's G * hd <= GM * 256 values, and P.V reads them there (the same values in the same order:
// the same bits); the buffer holds q alone on the other paths. 45.6 KB of static shared memory in all at GM = 12
// (the buffer 44 KB, the probabilities and token ids 1.6 KB); GM = 16 would pass the 48 KB limit.
// EXACT: the kv head has exactly GM query heads (the launch checks it), so the head loops' bounds are constants and
// their checks fold away, and P.V runs each whole batch of SA_PV_U tokens without its per-token bounds checks: the
// same loads and the same fmaf chains in the same order, so the same bits as the loops with the checks. (An Nsight
// Compute profile at 16 streams showed the kernel issue-bound, 71% of cycles issuing, FFMA a fifth of the
// instructions and the checks much of the rest.)
template <int GM, bool STAGE_V, bool EXACT = false>
DEV void sparse_attn_g(const FpSparseAttn& p) {
    constexpr u32 SMEM = STAGE_V ? GM * 256 + SA_CHUNK * 256 : SA_MAX_Q;
    constexpr u32 SM_FLOATS = SMEM > SA_MAX_Q ? SMEM : SA_MAX_Q;
    static_assert(4 * (SM_FLOATS + GM * SA_CHUNK + SA_CHUNK) <= 48 * 1024,
                  "q, the staged values, the probabilities and the token ids within 48 KB of static shared memory");
    __shared__ __align__(16) float sm[SM_FLOATS];
    float* const qs = sm;
    float* const vs = sm + GM * 256;
    __shared__ __align__(16) float ps[GM][SA_CHUNK];
    __shared__ u32 toks[SA_CHUNK];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 hd = p.hd, G = EXACT ? (u32)GM : p.heads / p.kv_heads, kv = blockIdx.y, z = blockIdx.z;
    if (kv >= p.kv_heads) {
        pdl_start();  // no early exit before the wait (common.cuh, ld_early_*)
        return;
    }
    const u64 w = (u64)p.kv_heads * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    const u32 nsplit = sa_nsplit(p);
    bool waited = false;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        // The row's descriptor, read before the wait (`ld_early_u32`; real_row and stream_of's fields).
        const FpStream* sd = (const FpStream*)c.streams + r / c.window;
        const u32 j = r % c.window;
        if (j >= ld_early_u32(&sd->rows)) continue;
        const u32 pos = ld_early_u32(&sd->pos) + j;
        const u32 slot = ld_early_u32(&sd->slot);
        u32 nsel, nb;
        const u32 nt = sa_nt(p, pos, nsel, nb);
        const u32 m0 = z * SA_CHUNK;
        if (m0 >= nt) continue;
        const u32 cnt = nt - m0 < SA_CHUNK ? nt - m0 : SA_CHUNK;
        const u32* sel = uptr(p.sel) + (u64)r * p.topk;
        const float* kc = state_of(c, slot, p.k_cache);
        const float* vc = state_of(c, slot, p.v_cache);
        // The arithmetic depends on hd only; the alignment of the slot's cache picks vector or scalar loads of the
        // same 8 values.
        const bool aligned = ((((u64)kc) | (w * 4)) & 15) == 0;
        const bool fast = (hd & 7) == 0 && hd <= 256 && nw == ATTN_WARPS;
        const bool stage_v = STAGE_V && fast && ((((u64)vc) | (w * 4)) & 15) == 0;
        const float* q = fptr(p.q) + (u64)r * p.heads * hd + (u64)kv * G * hd;
        // Every thread's values of q loaded before any is stored (a load-then-store loop paid one latency a value),
        // and before the wait on the previous kernel (through L2, `ld_early_f32` in common.cuh, which gives the rule):
        // q comes from attn_prep, further back (the indexer's prep, score and select between). The selection is the
        // previous kernel's.
        block_store_row(qs, G * hd, 1, 0, [&](u32 i) { return ld_early_f32(q + i); });
        pdl_start_once(waited);
        for (u32 i = threadIdx.x; i < cnt; i += blockDim.x) {
            const u32 m = m0 + i;
            toks[i] = m < nsel * p.ratio ? sel[m / p.ratio] * p.ratio + m % p.ratio : nb * p.ratio + m - nsel * p.ratio;
        }
        __syncthreads();
        // Scores: warp per token. Fast path (hd <= 256, a multiple of 8): each warp loads all its tokens' keys first;
        // lane l holds dims 4 l .. 4 l + 3 and 128 + 4 l .. + 3 (`sa_dims`), so each 16-byte load of the warp, from
        // the cache or from the staged q, is 512 contiguous bytes (no excess sectors, no bank conflicts).
        if (fast) {
            float kreg[SA_CHUNK / ATTN_WARPS][8];
#pragma unroll
            for (int u = 0; u < SA_CHUNK / ATTN_WARPS; u++) {
                const u32 i = warp + nw * u;
                sa_dims(kc + (u64)toks[i < cnt ? i : 0] * w + (u64)kv * hd, i < cnt ? hd : 0, lane, aligned, kreg[u]);
            }
            // The values' copies in flight with the keys' loads (waited for before P.V).
            if (stage_v) {
                const u32 q4 = hd / 4;
                for (u32 e = threadIdx.x; e < cnt * q4; e += blockDim.x) {
                    const u32 i = e / q4, c4 = e - i * q4;
                    cp_async16(vs + i * hd + 4 * c4, vc + (u64)toks[i] * w + (u64)kv * hd + 4 * c4);
                }
                cp_async_commit();
            }
            // SA_QT tokens at a time: each head's q is read from shared memory once for them, where a token at a
            // time read it once a token (H200, lone-w16: 108.3-108.9 -> 94.3-94.6 us a replay; one row 19.2-19.4 ->
            // 17.1-17.2 us). The same products and warp sums: the same bits.
            static_assert((SA_CHUNK / ATTN_WARPS) % SA_QT == 0, "SA_QT divides a warp's tokens");
#pragma unroll
            for (int u0 = 0; u0 < SA_CHUNK / ATTN_WARPS; u0 += SA_QT) {
                float a[SA_QT][SA_MAX_G];
#pragma unroll
                for (int u = 0; u < SA_QT; u++)
#pragma unroll
                    for (int g = 0; g < SA_MAX_G; g++) a[u][g] = 0.0f;
#pragma unroll
                for (int g = 0; g < GM; g++) {
                    if ((u32)g >= G) continue;
                    float qv[8];
                    sa_dims(qs + g * hd, hd, lane, true, qv);
#pragma unroll
                    for (int u = 0; u < SA_QT; u++) a[u][g] = dot8(qv, kreg[u0 + u]);
                }
#pragma unroll
                for (int u = 0; u < SA_QT; u++) {
                    const u32 i = warp + nw * (u0 + u);
                    if (i >= cnt) break;
                    // Head h's sum ends in lanes 2h, 2h + 1 (`warp_sum_scatter16`), the same bits as warp_sum(a[h]).
                    const float d = warp_sum_scatter16(a[u], lane);
                    const u32 h = lane >> 1;
                    if ((lane & 1) == 0 && h < G) ps[h][i] = d * scale;
                }
            }
        } else {
            for (u32 i = warp; i < cnt; i += nw) {
                const float* kr = kc + (u64)toks[i] * w + (u64)kv * hd;
                float acc[GM];
#pragma unroll
                for (int g = 0; g < GM; g++) acc[g] = 0.0f;
                for (u32 d = lane; d < hd; d += 32) {
                    const float kd = kr[d];
#pragma unroll
                    for (int g = 0; g < GM; g++)
                        if ((u32)g < G) acc[g] = fmaf(qs[g * hd + d], kd, acc[g]);
                }
#pragma unroll
                for (int g = 0; g < GM; g++) {
                    if ((u32)g >= G) break;
                    const float d = warp_sum(acc[g]);
                    if (lane == 0) ps[g][i] = d * scale;
                }
            }
        }
        __syncthreads();
        // Chunk max and exp-sum per head: warp per head.
        for (u32 g = warp; g < G; g += nw) {
            float mx = -INFINITY;
            for (u32 i = lane; i < cnt; i += 32) mx = fmaxf(mx, ps[g][i]);
            mx = warp_max(mx);
            float l = 0.0f;
            for (u32 i = lane; i < cnt; i += 32) {
                const float e = expf(ps[g][i] - mx);
                ps[g][i] = e;
                l += e;
            }
            l = warp_sum(l);
            if (lane == 0) {
                float* part = fptr(c.scratch) + (((u64)r * p.heads + kv * G + g) * nsplit + z) * (2 + hd);
                part[0] = mx;
                part[1] = l;
            }
        }
        if (stage_v) cp_async_wait_all();
        __syncthreads();
        // P.V: thread per value column, tokens in order; the chunk's values of the column all loaded first.
        for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
            float o[GM];
#pragma unroll
            for (int g = 0; g < GM; g++) o[g] = 0.0f;
            for (u32 i0 = 0; i0 < cnt; i0 += SA_PV_U) {
                if (EXACT && i0 + SA_PV_U <= cnt) {
                    // A whole batch (both of a full chunk's): the loads and fmaf chains below, every token in range.
                    float vv[SA_PV_U];
#pragma unroll
                    for (int u = 0; u < SA_PV_U; u++)
                        vv[u] = stage_v ? vs[(i0 + u) * hd + d] : vc[(u64)toks[i0 + u] * w + (u64)kv * hd + d];
#pragma unroll
                    for (int u4 = 0; u4 < SA_PV_U; u4 += 4) {
#pragma unroll
                        for (int g = 0; g < GM; g++) {
                            const float4 p4 = *(const float4*)&ps[g][i0 + u4];
                            o[g] = fmaf(p4.x, vv[u4], o[g]);
                            o[g] = fmaf(p4.y, vv[u4 + 1], o[g]);
                            o[g] = fmaf(p4.z, vv[u4 + 2], o[g]);
                            o[g] = fmaf(p4.w, vv[u4 + 3], o[g]);
                        }
                    }
                    continue;
                }
                float vv[SA_PV_U];
#pragma unroll
                for (int u = 0; u < SA_PV_U; u++)
                    vv[u] = i0 + u < cnt ? (stage_v ? vs[(i0 + u) * hd + d] : vc[(u64)toks[i0 + u] * w + (u64)kv * hd + d])
                                         : 0.0f;
                // A head's probabilities of 4 tokens in one 16-byte shared load; each o[g] still adds its tokens in
                // ascending order.
#pragma unroll
                for (int u4 = 0; u4 < SA_PV_U; u4 += 4) {
                    if (i0 + u4 >= cnt) break;
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if ((u32)g >= G) continue;
                        const float4 p4 = *(const float4*)&ps[g][i0 + u4];
                        const float pe[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            if (i0 + u4 + e < cnt) o[g] = fmaf(pe[e], vv[u4 + e], o[g]);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if ((u32)g >= G) break;
                fptr(c.scratch)[(((u64)r * p.heads + kv * G + g) * nsplit + z) * (2 + hd) + 2 + d] = o[g];
            }
        }
        __syncthreads();
    }
    pdl_start_once(waited);
}

// Entry points by the bound of the head loops (runtime/src/cuda/launch/attn.rs: the smallest GM >= G), each
// compiled on its own (one kernel holding all four took 150 registers), three blocks an SM: 80 registers, no
// spills but in sparse_attn_g12e below (H200, 16 rows: 124.6 -> 112.4 us a replay with the 16-byte P.V reads above,
// against two blocks an SM).
// The `v` forms stage the values (STAGE_V), which the launch picks for rounds of several streams, whose rows select
// different tokens (H200, 16 streams: the node 102.4 -> 96.9 us; one row 17.1 -> 17.7, a window of 16 rows of one
// stream 94.5 -> 95.2, so not there).
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g4(const FpSparseAttn p) { sparse_attn_g<4, false>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g8(const FpSparseAttn p) { sparse_attn_g<8, false>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g12(const FpSparseAttn p) { sparse_attn_g<12, false>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g16(const FpSparseAttn p) { sparse_attn_g<16, false>(p); }
// Exactly 12 query heads per kv head (the real config: 24 over 2), every stream count, the values not staged
// (EXACT above; 10 spill stores of loop-invariant scalars). H200, sparse attention's node (us a replay): one row
// 15.5 -> 12.4, a window of 16 rows 94.8 -> 76.1, 16 streams 97.3-97.6 (`sparse_attn_g12v`) -> 81.6-81.7; staged
// it took 87.2-87.5 at 16 streams.
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g12e(const FpSparseAttn p) { sparse_attn_g<12, false, true>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g4v(const FpSparseAttn p) { sparse_attn_g<4, true>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g8v(const FpSparseAttn p) { sparse_attn_g<8, true>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) sparse_attn_g12v(const FpSparseAttn p) { sparse_attn_g<12, true>(p); }

// sparse_attn_combine's body. With PRE every load is in flight at once, issued before the block's barrier: warp 0's
// chunk maxima and sums (up to SA_MAX_SPLIT chunks, 8 a lane) and each thread's first SA_CB_PRE partial outputs of
// its first column (255 registers: one block an SM); without it, 32 chunks' partials at a time after the barrier
// (42 registers). The same maxima, exp terms, lane sums, warp tree and fmaf chain in chunk order either way: the
// same bits.
#define SA_CB_PRE 96
template <bool PRE>
DEV void sparse_attn_combine_t(const FpSparseAttn& p) {
    pdl_start();
    __shared__ float f[SA_MAX_SPLIT];
    __shared__ float lsum;
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 hd = p.hd, nsplit = sa_nsplit(p);
    for (u32 b = blockIdx.x; b < R * p.heads; b += gridDim.x) {
        const u32 r = b / p.heads, hh = b % p.heads;
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const FpStream& st = stream_of(c, s);
        u32 nsel, nb;
        const u32 nt = sa_nt(p, st.pos + j, nsel, nb);
        const u32 nz = (nt + SA_CHUNK - 1) / SA_CHUNK;
        const float* part = fptr(c.scratch) + ((u64)r * p.heads + hh) * nsplit * (2 + hd);
        const u32 d0 = threadIdx.x;
        float pv[PRE ? SA_CB_PRE : 1];
        if constexpr (PRE) {
#pragma unroll
            for (int u = 0; u < SA_CB_PRE; u++) pv[u] = d0 < hd && u < nz ? part[(u64)u * (2 + hd) + 2 + d0] : 0.0f;
        }
        if (threadIdx.x < 32) {
            const u32 lane = threadIdx.x;
            float M = -INFINITY, L = 0.0f;
            if constexpr (PRE) {
                float mz[SA_MAX_SPLIT / 32], lz[SA_MAX_SPLIT / 32];
#pragma unroll
                for (int k = 0; k < SA_MAX_SPLIT / 32; k++) {
                    const u32 z = lane + 32 * k;
                    mz[k] = z < nz ? part[(u64)z * (2 + hd)] : -INFINITY;
                    lz[k] = z < nz ? part[(u64)z * (2 + hd) + 1] : 0.0f;
                }
#pragma unroll
                for (int k = 0; k < SA_MAX_SPLIT / 32; k++)
                    if (lane + 32 * k < nz) M = fmaxf(M, mz[k]);
                M = warp_max(M);
#pragma unroll
                for (int k = 0; k < SA_MAX_SPLIT / 32; k++) {
                    const u32 z = lane + 32 * k;
                    if (z < nz) {
                        const float e = expf(mz[k] - M);
                        f[z] = e;
                        L += e * lz[k];
                    }
                }
            } else {
                for (u32 z = lane; z < nz; z += 32) M = fmaxf(M, part[(u64)z * (2 + hd)]);
                M = warp_max(M);
                for (u32 z = lane; z < nz; z += 32) {
                    const float e = expf(part[(u64)z * (2 + hd)] - M);
                    f[z] = e;
                    L += e * part[(u64)z * (2 + hd) + 1];
                }
            }
            L = warp_sum(L);
            if (lane == 0) lsum = L;
        }
        __syncthreads();
        for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
            float o = 0.0f;
            u32 z0 = 0;
            if (PRE && d == d0) {
#pragma unroll
                for (int u = 0; u < (PRE ? SA_CB_PRE : 1); u++)
                    if ((u32)u < nz) o = fmaf(f[u], pv[u], o);
                z0 = SA_CB_PRE;
            }
            // Chunks in order, 32 partial outputs in flight at a time.
            for (; z0 < nz; z0 += 32) {
                float pw[32];
#pragma unroll
                for (int u = 0; u < 32; u++) pw[u] = z0 + u < nz ? part[(u64)(z0 + u) * (2 + hd) + 2 + d] : 0.0f;
#pragma unroll
                for (int u = 0; u < 32; u++)
                    if (z0 + u < nz) o = fmaf(f[z0 + u], pw[u], o);
            }
            const u64 oi = (u64)r * p.heads * hd + hh * hd + d;
            fptr(p.out)[oi] = o / lsum * sigmoidf_(fptr(p.gate)[oi]);
        }
        __syncthreads();
    }
}
// Many rows take the light form (several blocks an SM); rows x heads within one wave of one block an SM take the
// form with every load in flight (runtime/src/cuda/launch/attn.rs `sparse_attn_combine_entry`; H200, one row:
// sparse attention's node 17.1 -> 15.5 us; 16 streams 102.4 -> 103.9 us with it, so not there).
extern "C" __global__ void sparse_attn_combine(const FpSparseAttn p) { sparse_attn_combine_t<false>(p); }
extern "C" __global__ void sparse_attn_combine_pre(const FpSparseAttn p) { sparse_attn_combine_t<true>(p); }

// One block per stream: pools the blocks completed by the kept rows into the pooled cache (one warp per block).
extern "C" __global__ void indexer_commit(const FpIndexerCommit p) {
    pdl_start();
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
