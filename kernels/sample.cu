// Keyed sampling (rounds.md section 4) in two launches: sample_part (block per (row, slice of the vocabulary)) and
// sample (block of 1024 threads per sampled row), equal to the CPU sampler
// (runtime/src/sampler.rs `sample`):
// - greedy (T = 0): the lowest-id maximum, NaN as -inf; also the answer when the maximum is not finite;
// - plain temperature: Gumbel-max over every id with u = uniform(seed, position, id), scores in f64;
// - top-k / top-p / min-p: candidates ranked by (logit descending, id ascending). The rank-k element is found by
//   radix select (8-bit digits of the ordered key bits, then of the id among equal keys); p_i = softmax(logit/T)
//   over the top-k candidates in f64 with max subtraction; top-p walks the ranking in chunks of 1024 (each chunk
//   selected by rank, sorted by a bitonic sort in shared memory, and summed by one thread in rank order, as the
//   CPU does), min-p keeps p_i >= min_p * max p; Gumbel-max over the kept candidates.
// The one difference from the host: z (the softmax denominator) is a block tree sum rather than a left-to-right
// sum, and exp/log are CUDA's (within 1 ulp); a cut can only move when a cumulative mass lands within ~1e-15
// (relative) of top_p or a probability within that of the min-p bar.
// probs: the sampled token's probability at temperature 1; none when p.probs is 0 (the plan's `Sample` has no
// probabilities: the main model's rounds), and then neither phase takes the exp-sums that only they need.
#include "common.cuh"

#define SAMPLE_CHUNK 1024u

DEV u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
DEV double uniform01(u64 seed, u64 position, u32 id) {
    u64 x = mix64(seed + 0x9E3779B97F4A7C15ull);
    x = mix64(x ^ (position * 0xD1B54A32D192ED03ull));
    x = mix64(x ^ (u64)id);
    return (double)(x >> 11) * (1.0 / 9007199254740992.0) + (0.5 / 9007199254740992.0);
}
DEV float keyf(float l) { return l != l ? -INFINITY : l + 0.0f; }
// Key bits ordered as unsigned integers (a larger key gives a larger value); keys are never NaN or -0.
DEV u32 ord_of(float k) {
    const u32 b = __float_as_uint(k);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
DEV float key_of_ord(u32 o) { return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o); }
// (oa, ia) ranks before (ob, ib): key descending, then id ascending.
DEV bool ranks_before(u32 oa, u32 ia, u32 ob, u32 ib) { return oa > ob || (oa == ob && ia < ib); }
DEV bool at_or_before(u32 oa, u32 ia, u32 ob, u32 ib) { return oa > ob || (oa == ob && ia <= ib); }

// Block arg-max of (value, id) with ties to the lower id; `valid` false entries never win.
DEV void block_argmax(double& best, u32& bi, double* shv, u32* shi) {
    for (int o = 16; o > 0; o >>= 1) {
        const double ov = __shfl_xor_sync(FULL_MASK, best, o);
        const u32 oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (oi != 0xffffffffu && (bi == 0xffffffffu || ov > best || (ov == best && oi < bi))) {
            best = ov;
            bi = oi;
        }
    }
    const u32 w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        shv[w] = best;
        shi[w] = bi;
    }
    __syncthreads();
    best = shv[0];
    bi = shi[0];
    for (u32 i = 1; i < nw; i++)
        if (shi[i] != 0xffffffffu && (bi == 0xffffffffu || shv[i] > best || (shv[i] == best && shi[i] < bi))) {
            best = shv[i];
            bi = shi[i];
        }
}

struct SampleShared {
    u32 hist[256];
    u32 bc[4];
    u32 sk[SAMPLE_CHUNK];
    u32 si[SAMPLE_CHUNK];
    double sw[SAMPLE_CHUNK];
    double cum;
};

// The element of rank r (1-based, r <= vocab) in the order (key descending, id ascending): (ordered key, id).
DEV void rank_select(const float* lg, u32 vocab, u32 r, SampleShared& sh, u32& o_out, u32& id_out) {
    u32 prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) sh.hist[i] = 0;
        __syncthreads();
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const u32 o = ord_of(keyf(lg[i]));
            if ((o & mask) == prefix) atomicAdd(&sh.hist[(o >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 cum = 0, b = 255;
            for (; b > 0; b--) {
                if (cum + sh.hist[b] >= r) break;
                cum += sh.hist[b];
            }
            sh.bc[0] = b;
            sh.bc[1] = r - cum;
        }
        __syncthreads();
        prefix |= sh.bc[0] << shift;
        mask |= 255u << shift;
        r = sh.bc[1];
        __syncthreads();
    }
    // The r-th smallest id among the keys equal to `prefix`.
    int top = 24;
    while (top > 0 && ((vocab - 1) >> top) == 0) top -= 8;
    u32 idp = 0, idm = 0;
    for (int shift = top; shift >= 0; shift -= 8) {
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) sh.hist[i] = 0;
        __syncthreads();
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x)
            if ((i & idm) == idp && ord_of(keyf(lg[i])) == prefix) atomicAdd(&sh.hist[(i >> shift) & 255u], 1u);
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 cum = 0, b = 0;
            for (; b < 255; b++) {
                if (cum + sh.hist[b] >= r) break;
                cum += sh.hist[b];
            }
            sh.bc[0] = b;
            sh.bc[1] = r - cum;
        }
        __syncthreads();
        idp |= sh.bc[0] << shift;
        idm |= 255u << shift;
        r = sh.bc[1];
        __syncthreads();
    }
    o_out = prefix;
    id_out = idp;
}

// Sorts sh.sk/sh.si (SAMPLE_CHUNK entries) by rank.
DEV void rank_sort(SampleShared& sh) {
    for (u32 k = 2; k <= SAMPLE_CHUNK; k <<= 1)
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < SAMPLE_CHUNK; i += blockDim.x) {
                const u32 x = i ^ j;
                if (x > i) {
                    const bool first = (i & k) == 0;
                    const u32 ao = sh.sk[i], ai = sh.si[i], bo = sh.sk[x], bi = sh.si[x];
                    if (first ? ranks_before(bo, bi, ao, ai) : ranks_before(ao, ai, bo, bi)) {
                        sh.sk[i] = bo;
                        sh.si[i] = bi;
                        sh.sk[x] = ao;
                        sh.si[x] = ai;
                    }
                }
            }
            __syncthreads();
        }
}

// Top-k / top-p / min-p then Gumbel-max (maxl finite). Returns the token (valid in every thread).
DEV u32 sample_filtered(const float* lg, u32 vocab, const FpStream& st, u64 position, float maxl, u32 greedy,
                        SampleShared& sh, double* shv, u32* shi) {
    const double t = (double)st.temperature, mx = (double)maxl;
    const u32 kk = (st.top_k > 0 && st.top_k < vocab) ? st.top_k : vocab;
    const bool use_p = st.top_p < 1.0f, use_min = st.min_p > 0.0f;
    // Top-k: candidates rank at or before (ko, kid).
    u32 ko = 0, kid = 0xffffffffu;
    if (kk < vocab) rank_select(lg, vocab, kk, sh, ko, kid);
    double z = 0.0;
    if (use_p || use_min) {
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = keyf(lg[i]);
            if (at_or_before(ord_of(l), i, ko, kid)) z += exp(((double)l - mx) / t);
        }
        z = block_sum_d(z, shv);
    }
    const double min_keep = (double)st.min_p * (1.0 / z);
    const double top_p = (double)st.top_p;
    // Top-p: the shortest ranked prefix whose mass reaches top_p, walked in chunks of SAMPLE_CHUNK ranks.
    bool cut_p = false;
    u32 co = ko, cid = kid;
    if (use_p) {
        u32 done = 0, po = 0, pid = 0;
        if (threadIdx.x == 0) sh.cum = 0.0;
        while (done < kk) {
            const u32 n = min(done + SAMPLE_CHUNK, kk);
            u32 no, nid;
            rank_select(lg, vocab, n, sh, no, nid);
            if (threadIdx.x == 0) sh.bc[2] = 0;
            __syncthreads();
            for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
                const u32 o = ord_of(keyf(lg[i]));
                if (at_or_before(o, i, no, nid) && !(done > 0 && at_or_before(o, i, po, pid))) {
                    const u32 at = atomicAdd(&sh.bc[2], 1u);
                    if (at < SAMPLE_CHUNK) {
                        sh.sk[at] = o;
                        sh.si[at] = i;
                    }
                }
            }
            __syncthreads();
            const u32 m = n - done;
            for (u32 j = threadIdx.x; j < SAMPLE_CHUNK; j += blockDim.x)
                if (j >= m) {
                    sh.sk[j] = 0;
                    sh.si[j] = 0xffffffffu;
                }
            __syncthreads();
            rank_sort(sh);
            for (u32 j = threadIdx.x; j < m; j += blockDim.x)
                sh.sw[j] = exp(((double)key_of_ord(sh.sk[j]) - mx) / t) / z;
            __syncthreads();
            if (threadIdx.x == 0) {
                u32 found = 0, at = 0;
                double cum = sh.cum;
                for (u32 j = 0; j < m; j++) {
                    cum += sh.sw[j];
                    if (cum >= top_p) {
                        found = 1;
                        at = j;
                        break;
                    }
                }
                sh.cum = cum;
                sh.bc[0] = found;
                sh.bc[1] = at;
                // Past the min-p bar: min-p cuts first, no need to walk on.
                sh.bc[3] = (!found && use_min && sh.sw[m - 1] < min_keep) ? 1u : 0u;
            }
            __syncthreads();
            const u32 found = sh.bc[0], at = sh.bc[1], stop = sh.bc[3];
            if (found) {
                cut_p = true;
                co = sh.sk[at];
                cid = sh.si[at];
            }
            __syncthreads();
            if (found || stop) break;
            done = n;
            po = no;
            pid = nid;
        }
    }
    // Gumbel-max over the kept candidates.
    double gb = -INFINITY;
    u32 gi = 0xffffffffu;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = keyf(lg[i]);
        const u32 o = ord_of(l);
        if (!at_or_before(o, i, ko, kid)) continue;
        if (cut_p && !at_or_before(o, i, co, cid)) continue;
        if (use_min && !(exp(((double)l - mx) / t) / z >= min_keep)) continue;
        const double sc = (double)l / t - log(-log(uniform01(st.seed, position, i)));
        if (gi == 0xffffffffu || sc > gb || (sc == gb && i < gi)) {
            gb = sc;
            gi = i;
        }
    }
    block_argmax(gb, gi, shv, shi);
    return gi == 0xffffffffu ? greedy : gi;
}

// Item `it` of the launch: its stream s, logits row and the position its token will take; false for a padding
// item (nothing to sample).
DEV bool sample_item(const FpSample& p, u32 it, u32& s, u32& row, u64& position) {
    const FpCommon& c = p.c;
    if (p.mode == 0) {
        u32 j;
        row = it;
        if (!real_row(c, it, s, j)) return false;
        position = (u64)stream_of(c, s).pos + j + 1;
        return true;
    }
    s = it;
    const FpStream& st = stream_of(c, s);
    if (st.rows == 0) return false;
    if (p.mode == 1) {
        row = s * c.window + st.rows - 1;
        position = (u64)st.pos + st.rows;
    } else {
        row = s;
        position = (u64)st.pos + st.rows + 1;
    }
    return true;
}
DEV bool plain_temperature(const FpStream& st) { return !(st.temperature == 0.0f || st.temperature != st.temperature || st.temperature < 0.0f); }
DEV bool filtered_sampling(const FpStream& st, u32 vocab) {
    return plain_temperature(st) && ((st.top_k > 0 && st.top_k < vocab) || st.top_p < 1.0f || st.min_p > 0.0f);
}

// Phase 1 (sample_part): block (item, part z of SAMPLE_PARTS) over its contiguous slice of the vocabulary: the
// lowest-id maximum, sum exp(l - m_z) (f64) and, for plain temperature, the Gumbel-max; into scratch
// [items, SAMPLE_PARTS, 8 floats]: {max (f64), gumbel (f64), z (f64), argmax id, gumbel id}.
#define SAMPLE_PARTS 64
// `sample` runs in blocks of 1024 threads (runtime/src/cuda/launch/sample.rs) and gives each part one thread.
static_assert(SAMPLE_PARTS <= 1024, "sample reads one part a thread");
// Logits a thread of sample_part holds at once (in registers).
#define SAMPLE_HELD 16
struct SamplePart {
    double best, gb, z;
    u32 bi, gi;
};
DEV SamplePart* parts_of(const FpSample& p, u32 it) {
    return (SamplePart*)(fptr(p.c.scratch)) + (u64)it * SAMPLE_PARTS;
}
extern "C" __global__ void sample_part(const FpSample p) {
    pdl_start();
    __shared__ double shv[32];
    __shared__ u32 shi[32];
    const FpCommon& c = p.c;
    const u32 items = p.mode == 0 ? c.nstreams * c.window : c.nstreams;
    const u32 z = blockIdx.y;
    const u32 per = (p.vocab + SAMPLE_PARTS - 1) / SAMPLE_PARTS;
    const u32 lo = z * per < p.vocab ? z * per : p.vocab, hi = lo + per < p.vocab ? lo + per : p.vocab;
    for (u32 it = blockIdx.x; it < items; it += gridDim.x) {
        u32 s, row;
        u64 position;
        if (!sample_item(p, it, s, row, position)) continue;
        const FpStream& st = stream_of(c, s);
        if (filtered_sampling(st, p.vocab)) continue;  // phase 2 takes the whole row itself
        const float* lg = fptr(p.logits) + (u64)row * p.vocab;
        // The thread's logits lo + threadIdx.x + j * blockDim.x in ascending j, SAMPLE_HELD of them loaded at once
        // (one memory latency for the batch, not one a logit), then taken in that order.
        double best = -INFINITY;
        u32 bi = 0xffffffffu;
        for (u32 b = lo + threadIdx.x; b < hi; b += SAMPLE_HELD * blockDim.x) {
            float v[SAMPLE_HELD];
            load_strided(v, b, blockDim.x, hi, -INFINITY, [&](u32 i) { return keyf(lg[i]); });
#pragma unroll
            for (int j = 0; j < SAMPLE_HELD; j++) {
                const float l = v[j];
                if (l > -INFINITY && (bi == 0xffffffffu || (double)l > best)) {
                    best = l;
                    bi = b + j * blockDim.x;
                }
            }
        }
        block_argmax(best, bi, shv, shi);
        const double m = bi == 0xffffffffu ? -INFINITY : best;
        double zz = 0.0;
        // The exp-sum only feeds the sampled token's probability: skipped when the launch writes none (p.probs 0).
        if (p.probs != 0 && m > -INFINITY && m < INFINITY)
            for (u32 b = lo + threadIdx.x; b < hi; b += SAMPLE_HELD * blockDim.x) {
                float v[SAMPLE_HELD];
                load_strided(v, b, blockDim.x, hi, 0.0f, [&](u32 i) { return keyf(lg[i]); });
#pragma unroll
                for (int j = 0; j < SAMPLE_HELD; j++)
                    if (b + j * blockDim.x < hi) zz += exp((double)v[j] - m);
            }
        if (p.probs != 0) zz = block_sum_d(zz, shv);
        double gb = -INFINITY;
        u32 gi = 0xffffffffu;
        if (plain_temperature(st)) {
            const double t = (double)st.temperature;
            for (u32 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
                const float l = lg[i];
                if (l != l || l == -INFINITY) continue;
                const double sc = (double)l / t - log(-log(uniform01(st.seed, position, i)));
                if (gi == 0xffffffffu || sc > gb) {
                    gb = sc;
                    gi = i;
                }
            }
            block_argmax(gb, gi, shv, shi);
        }
        if (threadIdx.x == 0) {
            SamplePart& o = parts_of(p, it)[z];
            o.best = best;
            o.bi = bi;
            o.z = zz;
            o.gb = gb;
            o.gi = gi;
        }
        __syncthreads();
    }
}

// Phase 2 (sample): block per item. Greedy and plain temperature combine the parts in order (ties to the lower id,
// so the result is the whole row's lowest-id maximum / Gumbel-max); the probability's denominator is
// sum_z z_z exp(m_z - M) in part order. Filtered sampling runs on the whole row in this block.
extern "C" __global__ void sample(const FpSample p) {
    pdl_start();
    __shared__ double shv[32];
    __shared__ u32 shi[32];
    __shared__ SampleShared sh;
    __shared__ u32 tok_sh;
    __shared__ double maxl_sh, z_sh;
    __shared__ SamplePart parts_sh[SAMPLE_PARTS];
    __shared__ double ez_sh[SAMPLE_PARTS];
    const FpCommon& c = p.c;
    const u32 items = p.mode == 0 ? c.nstreams * c.window : c.nstreams;
    for (u32 it = blockIdx.x; it < items; it += gridDim.x) {
        u32 s, row;
        u64 position;
        if (!sample_item(p, it, s, row, position)) {
            if (threadIdx.x == 0) {
                uptr(p.tokens)[it] = 0xffffffffu;
                if (p.probs != 0) fptr(p.probs)[it] = 0.0f;
            }
            continue;
        }
        const FpStream& st = stream_of(c, s);
        const float* lg = fptr(p.logits) + (u64)row * p.vocab;
        if (filtered_sampling(st, p.vocab)) {
            // Greedy arg-max (the fallback when the maximum is not finite), then the filtered sampler.
            double best = -INFINITY;
            u32 bi = 0xffffffffu;
            for (u32 i = threadIdx.x; i < p.vocab; i += blockDim.x) {
                const float l = keyf(lg[i]);
                if (l > -INFINITY && (bi == 0xffffffffu || (double)l > best)) {
                    best = l;
                    bi = i;
                }
            }
            block_argmax(best, bi, shv, shi);
            const float maxl = bi == 0xffffffffu ? -INFINITY : (float)best;
            u32 tok = bi == 0xffffffffu ? 0 : bi;
            if (maxl < INFINITY && maxl > -INFINITY)
                tok = sample_filtered(lg, p.vocab, st, position, maxl, tok, sh, shv, shi);
            double z = 0.0;
            if (p.probs != 0 && maxl > -INFINITY && maxl < INFINITY)
                for (u32 i = threadIdx.x; i < p.vocab; i += blockDim.x) z += exp((double)keyf(lg[i]) - (double)maxl);
            if (p.probs != 0) z = block_sum_d(z, shv);
            if (threadIdx.x == 0) {
                tok_sh = tok;
                maxl_sh = maxl;
                z_sh = z;
            }
        } else {
            // The parts into shared memory at once (one memory latency), their exp(m_z - M) by one thread each; then
            // one thread combines them in part order, as before.
            if (threadIdx.x < SAMPLE_PARTS) parts_sh[threadIdx.x] = parts_of(p, it)[threadIdx.x];
            __syncthreads();
            if (threadIdx.x == 0) {
                const SamplePart* pt = parts_sh;
                double best = -INFINITY, gb = -INFINITY;
                u32 bi = 0xffffffffu, gi = 0xffffffffu;
                for (u32 zi = 0; zi < SAMPLE_PARTS; zi++) {
                    const SamplePart q = pt[zi];
                    if (q.bi != 0xffffffffu && (bi == 0xffffffffu || q.best > best)) {
                        best = q.best;
                        bi = q.bi;
                    }
                    if (q.gi != 0xffffffffu && (gi == 0xffffffffu || q.gb > gb)) {
                        gb = q.gb;
                        gi = q.gi;
                    }
                }
                const float maxl = bi == 0xffffffffu ? -INFINITY : (float)best;
                u32 tok = bi == 0xffffffffu ? 0 : bi;
                if (plain_temperature(st) && maxl < INFINITY && maxl > -INFINITY && gi != 0xffffffffu) tok = gi;
                tok_sh = tok;
                maxl_sh = maxl;
            }
            __syncthreads();
            const double maxl = maxl_sh;
            const bool finite = maxl > -INFINITY && maxl < INFINITY;
            if (p.probs != 0 && finite && threadIdx.x < SAMPLE_PARTS) ez_sh[threadIdx.x] = exp(parts_sh[threadIdx.x].best - maxl);
            __syncthreads();
            if (threadIdx.x == 0) {
                double z = 0.0;
                if (p.probs != 0 && finite)
                    for (u32 zi = 0; zi < SAMPLE_PARTS; zi++) {
                        const SamplePart& q = parts_sh[zi];
                        if (q.bi != 0xffffffffu) z += q.z * ez_sh[zi];
                    }
                z_sh = z;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const u32 tok = tok_sh;
            const double maxl = maxl_sh, z = z_sh;
            uptr(p.tokens)[it] = tok;
            if (p.probs != 0) {
                float pr = 0.0f;
                if (maxl > -INFINITY && maxl < INFINITY && tok < p.vocab)
                    pr = (float)(exp((double)keyf(lg[tok]) - maxl) / z);
                fptr(p.probs)[it] = pr;
            }
        }
        __syncthreads();
    }
}
