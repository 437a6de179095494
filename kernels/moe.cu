// Mixture of experts, each op in two launches (the runtime launches both for one node), the router in one:
// - router (logits of every row into scratch [rows, experts], warp per expert; from 3 rows router_s4's tiles of 4
//   rows over blockIdx.y, each staged in shared memory, or where they do not fit beyond 8 rows tiles of at most 4
//   rows); the last block of each grid row to finish (integer count in the node's `done` counters, one
//   per grid row) does the top-k of that grid row's rows, warp per row (softmax, repeated argmax with the lowest index
//   on ties, renormalised in rank order). With done == 0 a second launch does the same: beyond 16 rows
//   router_topk_w (the same warp per row, 8 rows a block), with FLASHPLAN_FUSE_SMALL=0 router_topk (block per row,
//   radix select): the same values bit for bit;
// - experts (warp per (two pairs of intermediate features, row, rank), feature-major: silu(gate x) * up x into
//   scratch) then experts_down or experts_down_f4 (warp per (one or four output features, row): four groups of 8
//   lanes take the ranks, summed in rank order); feature-major, so rows routed to one expert read its rows side by
//   side (the repeats from L2); at one row (FLASHPLAN_FUSE_SMALL) experts_one then experts_combine instead, the same
//   sums with a barrier per rank between its gate/up and its down (below);
// - shared_expert (warp per intermediate feature, tiles of at most 4 rows over blockIdx.y; the sigmoid gate by one
//   more warp) then shared_expert_down (warp per 2 output features; out = fmaf(gate, down, out)). On the graph's side
//   branch (runtime/src/cuda/launch/moe.rs `branch_shared_experts`) both run beside the router and the experts' gate/up,
//   and experts_down (experts_combine) adds the shared expert's dots with the same fmaf.
// The routed experts are chosen on the device, so one graph serves any routing. Every value's reduction order is
// fixed by the kernel (lane order, fixed trees, ranks in order): row invariant.
#include "common.cuh"

#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_TOPK 32

// Whether each row of the tile at i0 is real (ok[t]; false past R).
template <int T>
DEV void tile_ok(const FpCommon& c, u32 i0, u32 R, bool (&ok)[T]) {
#pragma unroll
    for (int t = 0; t < T; t++) ok[t] = i0 + t < R && row_ok(c, i0 + t, false);
}

// The two loop shapes of the warp-per-item kernels over row tiles of T (tile blockIdx.y first, gridDim.y tiles apart):
// item(q, i0, Xt, ok) for the warp's items q = first, first + step, ... while more(q), and every tile i0 < R, where
// Xt is the tile's rows (row stride width) and ok its real rows (tile_ok). STAGED: the tiles outside the items, each
// staged in shared memory once a block (stage_tile), so a tile crosses L2 once a block instead of once a warp;
// otherwise the items outside the tiles, Xt in place at X. The same values either way, so the same sums.
template <int T, bool STAGED, class More, class Item>
DEV void over_row_tiles(const FpCommon& c, const float* X, u32 width, u32 R, u32 first, u32 step, More more,
                        Item item) {
    bool ok[T];
    if constexpr (STAGED) {
        __shared__ __align__(16) float xsh[STAGE_TILE_MAX];
        for (u32 i0 = blockIdx.y * T; i0 < R; i0 += gridDim.y * T) {
            stage_tile(xsh, X + (u64)i0 * width, (R - i0 < T ? R - i0 : T) * width);
            tile_ok(c, i0, R, ok);
            for (u32 q = first; more(q); q += step) item(q, i0, (const float*)xsh, ok);
        }
    } else {
        for (u32 q = first; more(q); q += step)
            for (u32 i0 = blockIdx.y * T; i0 < R; i0 += gridDim.y * T) {
                tile_ok(c, i0, R, ok);
                item(q, i0, X + (u64)i0 * width, ok);
            }
    }
}

// Warp e's logits of the row tile at i0 (its activations at X, row stride dim) into scratch [rows, experts].
template <int T, int U, bool PRE>
DEV void router_e(const FpRouter& p, u32 e, u32 i0, const float* X, const bool (&ok)[T], bool wvec, u32 lane) {
    const bf16_t* w[1] = {(const bf16_t*)p.gate + (u64)e * p.dim};
    float res[1][T];
    warp_dots<T, 1, U, PRE>(w, 1, X, p.dim, ok, p.dim, wvec, lane, res);
    if (lane == 0)
#pragma unroll
        for (int t = 0; t < T; t++)
            if (ok[t]) fptr(p.c.scratch)[(u64)(i0 + t) * p.experts + e] = res[0][t];
}

// The logits of every row and expert: a warp per expert (router_e; 8 a block: runtime/src/cuda/launch/moe.rs
// `ROUTER_EXPERTS_PER_BLOCK`), the rows in tiles of T, tile blockIdx.y first (over_row_tiles; STAGED: each tile
// staged in shared memory once a block); every logit the same warp_dots sum.
template <int T, int U, bool PRE, bool STAGED = false>
DEV void router_t(const FpRouter& p, u32 R) {
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const bool wvec = (p.dim & 7) == 0 && (p.gate & 15) == 0;
    over_row_tiles<T, STAGED>(
        p.c, fptr(p.x), p.dim, R, gw, nwarps, [&](u32 e) { return e < p.experts; },
        [&](u32 e, u32 i0, const float* X, const bool(&ok)[T]) { router_e<T, U, PRE>(p, e, i0, X, ok, wvec, lane); });
}

// Router block size of router_topk (the softmax's block trees): router_topk_warp reproduces its sums over it.
#define ROUTER_TOPK_THREADS 1024

// (key, id) ranks before (bk, bi): key descending, id ascending.
DEV bool topk_before(u32 key, u32 id, u32 bk, u32 bi) { return key > bk || (key == bk && id < bi); }

// Row r's top-k from one warp, lane t holding rank t's id and probability: ids, and weights renormalised over the
// top-k (sum in rank order) when p.norm.
DEV void topk_store(const FpRouter& p, u32 r, u32 lane, u32 my_id, float my_p) {
    float sum = 0.0f;
    for (u32 t = 0; t < p.topk; t++) sum += __shfl_sync(FULL_MASK, my_p, t);
    if (lane < p.topk) {
        uptr(p.ids)[(u64)r * p.topk + lane] = my_id;
        fptr(p.weights)[(u64)r * p.topk + lane] = p.norm ? my_p / sum : my_p;
    }
}

// The top-k of row r by one warp, bit for bit the values of router_topk (block of ROUTER_TOPK_THREADS threads,
// thread e = expert e): lane l holds experts e = 32 j + l (j < NE, NE * 32 >= experts), so register j of the warp is
// router_topk's warp j. max: the largest logit, the value router_topk's block_max finds (a maximum does not depend
// on the order it is taken in; only when every logit is NaN may the two differ, and then every p is NaN in both).
// z: warp_sum of each j (router_topk's warp trees), summed in j order from 0.0f (block_sum; its warps past NE add
// exact zeros, omitted). p = expf(v - m) / z as there. Selection: topk rounds of the lane-local best (key = bits of
// p, as router_topk's radix keys: p >= +0 orders as u32) then the warp's argmax of (key, id), key descending, id
// ascending (a max of the keys, then a min of the ids holding it): the repeated argmax that router_topk's radix
// select and ranks give. Rank t is kept by lane t; weights p / (0.0f + p_0 + p_1 + ...) in rank order.
template <int NE>
DEV void router_topk_warp(const FpRouter& p, u32 r, u32 lane) {
    const u32 E = p.experts;
    const float* L = fptr(p.c.scratch) + (u64)r * E;
    float v[NE];
#pragma unroll
    for (int j = 0; j < NE; j++) {
        const u32 e = 32u * j + lane;
        v[j] = e < E ? ld_cg(L + e) : -INFINITY;
    }
    // The maximum is the same value in any order: the lane's own first, then one warp tree.
    float m = v[0];
#pragma unroll
    for (int j = 1; j < NE; j++) m = fmaxf(m, v[j]);
    m = warp_max(m);
    float ev[NE];
#pragma unroll
    for (int j = 0; j < NE; j++) ev[j] = 32u * j + lane < E ? expf(v[j] - m) : 0.0f;
    float z = 0.0f;
#pragma unroll
    for (int j = 0; j < NE; j++) z += warp_sum(ev[j]);
    u32 key[NE];
#pragma unroll
    for (int j = 0; j < NE; j++) key[j] = __float_as_uint(ev[j] / z);
    u32 taken = 0, my_id = 0;
    float my_p = 0.0f;
    for (u32 t = 0; t < p.topk; t++) {
        // No candidate left in this lane: (0, ~0) ranks after every real expert.
        u32 bk = 0, bi = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < NE; j++) {
            const u32 e = 32u * j + lane;
            if (e < E && !((taken >> j) & 1u) && topk_before(key[j], e, bk, bi)) {
                bk = key[j];
                bi = e;
            }
        }
        // The warp's best: the largest key, then the lowest id among the lanes holding it (each lane's candidate
        // is its lowest id of its largest key), in two warp reductions (redux.sync) instead of a shuffle tree.
        const u32 wk = __reduce_max_sync(FULL_MASK, bk);
        bi = __reduce_min_sync(FULL_MASK, bk == wk ? bi : 0xffffffffu);
        bk = wk;
        if (bi < E && (bi & 31u) == lane) taken |= 1u << (bi >> 5);
        if (t == lane) {
            my_id = bi;
            my_p = __uint_as_float(bk);
        }
    }
    topk_store(p, r, lane, my_id, my_p);
}

// A candidate of router_topk_block: its key above its id's complement (the larger the earlier; 0 for none).
DEV u64 topk_pack(u32 key, u32 id) { return ((u64)key << 32) | (u64)(~id); }

// Rank t of the candidates c[0..N) of every lane (all lanes hold N), round by round: the lane's best, then the warp's
// (the largest key, then the lowest id holding it), which leaves its lane; on_rank(t, key, id) in every lane.
template <int N, class F>
DEV void topk_rounds(u64 (&c)[N], u32 topk, F on_rank) {
    static_assert(N >= 1 && (N & (N - 1)) == 0, "a tree over a power of two");
    for (u32 t = 0; t < topk; t++) {
        u64 b[N];
#pragma unroll
        for (int q = 0; q < N; q++) b[q] = c[q];
#pragma unroll
        for (int w = N / 2; w >= 1; w /= 2)
#pragma unroll
            for (int q = 0; q < w; q++) b[q] = b[q] > b[q + w] ? b[q] : b[q + w];
        const u32 bk = (u32)(b[0] >> 32), bi = ~(u32)b[0];
        const u32 wk = __reduce_max_sync(FULL_MASK, bk);
        const u32 wi = __reduce_min_sync(FULL_MASK, bk == wk ? bi : 0xffffffffu);
#pragma unroll
        for (int q = 0; q < N; q++)
            if (c[q] != 0 && ~(u32)c[q] == wi) c[q] = 0;
        on_rank(t, wk, wi);
    }
}

// One row's top-k by a block of 8 warps, bit for bit router_topk_warp's: warp w takes registers j = J w .. J w + J - 1
// of router_topk_warp's lane layout (J = NE / 8; lane l, expert 32 j + l). max: each warp's, then the warps' (the
// same value in any order, as there). z: the same warp_sum of each j, summed in j order from 0.0f; p and the keys as
// there. Selection: each warp takes the top-k of its 32 J experts (topk rounds over a lane's J candidates, each
// packed as key << 32 | ~id: the larger the earlier, 0 for none), then warp 0 takes the top-k of the 8 lists: a
// strict total order (ids differ), so the k best of the lists are the k best of all, in the same order. The rounds
// are router_topk_warp's but over J and 8 candidates a lane instead of NE, in 8 warps at once: a shorter chain.
template <int NE>
DEV void router_topk_block(const FpRouter& p, u32 r) {
    constexpr int J = NE / 8;
    __shared__ float wmax[8], zs[NE];
    __shared__ u64 lists[8 * MOE_MAX_TOPK];
    const u32 E = p.experts, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const float* L = fptr(p.c.scratch) + (u64)r * E;
    float v[J];
#pragma unroll
    for (int q = 0; q < J; q++) {
        const u32 e = 32u * (J * w + q) + lane;
        v[q] = e < E ? ld_cg(L + e) : -INFINITY;
    }
    float m = v[0];
#pragma unroll
    for (int q = 1; q < J; q++) m = fmaxf(m, v[q]);
    m = warp_max(m);
    if (lane == 0) wmax[w] = m;
    __syncthreads();
    m = wmax[0];
    for (int i = 1; i < 8; i++) m = fmaxf(m, wmax[i]);
    float ev[J];
#pragma unroll
    for (int q = 0; q < J; q++) {
        ev[q] = 32u * (J * w + q) + lane < E ? expf(v[q] - m) : 0.0f;
        const float s = warp_sum(ev[q]);
        if (lane == 0) zs[J * w + q] = s;
    }
    __syncthreads();
    float z = 0.0f;
#pragma unroll
    for (int j = 0; j < NE; j++) z += zs[j];
    u64 c[J];
#pragma unroll
    for (int q = 0; q < J; q++) {
        const u32 e = 32u * (J * w + q) + lane;
        c[q] = e < E ? topk_pack(__float_as_uint(ev[q] / z), e) : 0;
    }
    topk_rounds<J>(c, p.topk, [&](u32 t, u32 k, u32 id) {
        if (lane == 0) lists[w * p.topk + t] = id < E ? topk_pack(k, id) : 0;
    });
    __syncthreads();
    if (w != 0) return;
    u64 d[8];
#pragma unroll
    for (int q = 0; q < 8; q++) {
        const u32 i = 32u * q + lane;
        d[q] = i < 8 * p.topk ? lists[i] : 0;
    }
    u32 my_id = 0;
    float my_p = 0.0f;
    topk_rounds<8>(d, p.topk, [&](u32 t, u32 k, u32 id) {
        if (t == lane) {
            my_id = id;
            my_p = __uint_as_float(k);
        }
    });
    topk_store(p, r, lane, my_id, my_p);
}

// Row r's top-k by one warp (router_topk_warp at the lane layout that holds the experts).
DEV void router_topk_row(const FpRouter& p, u32 r, u32 lane) {
    if (p.experts <= 16 * 32)
        router_topk_warp<16>(p, r, lane);
    else
        router_topk_warp<32>(p, r, lane);
}

// After the logits (p.done != 0): the last block of each grid row to finish does the top-k of that grid row's rows
// (warp per row); the count wraps to 0 for the next launch (graph replay). The pattern of cooperative groups' grid
// sync (and of common.cuh group_barrier): a barrier (the block's logits, written by lane 0 of each warp, happen
// before thread 0's fence), thread 0 alone `__threadfence()` (sm_90: MEMBAR.SC.GPU) then the count, and in the last
// block thread 0 `__threadfence()` again after it, then a barrier (every other block's logits happen before the
// block's reads). H200 (thirty-eighth session, A/B passes against a fence in every thread before the count and in
// every thread of the last block after it; the same routing digests): the routers at 16 rows 71.7 -> 59.5 us a
// replay, verify-s16-w1 2289.8 / 2293.5 -> 2281.0 / 2283.2 us, lone-w8 1541.2 / 1538.8 -> 1527.9 / 1528.6 us,
// lone-w16 2170.0 / 2167.1 -> 2156.4 / 2156.9 us; one row unchanged. Integer count only; every logit is written by
// one warp before its block's count, so the top-k reads each final value.
template <int T, bool BLK = false>
DEV void router_last_block(const FpRouter& p, u32 R) {
    __shared__ u32 last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // the block's logits, device-wide, before its count
        // Grid row y's own counter (p.done + y): its blocks wrote the logits of its rows (router_t's tiles), all of
        // them and no others'. atomicInc wraps to 0 at the last block's count: the counter is 0 again for the next
        // launch.
        last = atomicInc(uptr(p.done) + blockIdx.y, gridDim.x - 1) == gridDim.x - 1 ? 1u : 0u;
        if (last) __threadfence();  // every other block counted after its fence: their logits are visible from here
    }
    __syncthreads();
    if (!last) return;
    if (BLK && R == 1 && blockDim.x == 256) {
        // One row: the block's 8 warps take its top-k together (router_topk_block).
        if (!row_ok(p.c, 0, false)) return;
        if (p.experts <= 16 * 32)
            router_topk_block<16>(p, 0);
        else
            router_topk_block<32>(p, 0);
        return;
    }
    // Grid row y's rows, in order: its tiles y, y + gridDim.y, .. of T rows (r grows with m).
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 m = warp;; m += nw) {
        const u32 r = (blockIdx.y + m / T * gridDim.y) * T + m % T;
        if (r >= R) break;
        if (row_ok(p.c, r, false)) router_topk_row(p, r, lane);
    }
}

// Entry points per row tile (router_t1 .. router_t8: up to 8 rows in one grid row, beyond that router_t4 in tiles
// of 4 rows over blockIdx.y, each tile's last block doing its top-k up to 16 rows, beyond 16 with router_topk_w
// following; with FLASHPLAN_FUSE_SMALL=0 router_topk follows; router_s4 below takes the place of all but router_t1
// and router_t2 where its staged tile fits). A warp takes one
// expert, 8 experts a block (runtime/src/cuda/launch/moe.rs `ROUTER_EXPERTS_PER_BLOCK`), and loads each batch's activation chunks with its
// weights (`PRE`): router_t1 a lane's 10 chunks of the row (K = 2560 at the real width) at once, router_t2 4, router_t4
// 2 and router_t8 1 chunk of every row (so the batch's activations stay in 128 registers a thread: two blocks an SM).
// An expert's logit is the same warp_dots sum in every form. H200, 2026-12-01, the replay of lone-wR against the
// earlier warp per 2 experts with each chunk's activations loaded just before its dots (A/B ranges): w2 995-1003 ->
// 986 us, w4 1246-1252 -> 1225, w8 1692-1701 -> 1644-1648, w16 2522-2530 -> 2496-2501 (the router's node at 16 rows
// 54.2-55.4 -> 49.6-50.4 us).
template <int T, int U, bool PRE, bool BLK = false, bool STAGED = false>
DEV void router_entry(const FpRouter& p) {
    const u32 R = p.c.nstreams * p.c.window;
    router_t<T, U, PRE, STAGED>(p, R);
    if (p.done) router_last_block<T, BLK>(p, R);
}
extern "C" __global__ void router_t1(const FpRouter p) { pdl_start(); router_entry<1, 10, true, true>(p); }
extern "C" __global__ void router_t2(const FpRouter p) { pdl_start(); router_entry<2, 4, true>(p); }
extern "C" __global__ void router_t4(const FpRouter p) { pdl_start(); router_entry<4, 2, true>(p); }
extern "C" __global__ void router_t8(const FpRouter p) { pdl_start(); router_entry<8, 1, true>(p); }
// router_s4: router_t4 with each row tile staged in shared memory (runtime/src/cuda/launch/moe.rs `router_logits`:
// from 3 rows where 4 rows fit STAGE_TILE_MAX).
extern "C" __global__ void router_s4(const FpRouter p) { pdl_start(); router_entry<4, 2, true, false, true>(p); }

// Beyond 16 rows with FLASHPLAN_FUSE_SMALL, after the logits in tiles over blockIdx.y: a warp per row, 8 rows a block
// (router_topk_warp, the fused router's per-row top-k: bit for bit router_topk's values).
extern "C" __global__ void router_topk_w(const FpRouter p) {
    pdl_start();
    const u32 lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r < p.c.nstreams * p.c.window && row_ok(p.c, r, false)) router_topk_row(p, r, lane);
}

// Block per row (ROUTER_TOPK_THREADS threads) over the logits in scratch, thread per expert: p = softmax (block max and block sum, fixed trees);
// the top-k by (p descending, id ascending), as repeated argmax with lowest-id ties: radix select of the k-th
// largest p (p >= +0, so its bits order as u32), the experts above it and the lowest-id ones equal to it, then
// each chosen expert's rank among the chosen. Weights p / (sum of the top-k p in rank order) when normalised.
extern "C" __global__ void router_topk(const FpRouter p) {
    pdl_start();
    __shared__ float sh[32];
    __shared__ u32 pv[MOE_MAX_EXPERTS];
    __shared__ u32 hist[256];
    __shared__ u32 res[2];
    __shared__ u32 cand[MOE_MAX_TOPK];
    __shared__ u32 ncand;
    __shared__ float tp[MOE_MAX_TOPK];
    __shared__ u32 ti[MOE_MAX_TOPK];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 E = p.experts, e = threadIdx.x;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        if (!row_ok(c, r, false)) continue;
        const float* L = fptr(c.scratch) + (u64)r * E;
        const float v = e < E ? L[e] : -INFINITY;
        const float m = block_max(v, sh);
        const float ev = e < E ? expf(v - m) : 0.0f;
        const float z = block_sum(ev, sh);
        const float pe = ev / z;
        const u32 key = __float_as_uint(pe);
        if (e < E) pv[e] = key;
        if (threadIdx.x == 0) ncand = 0;
        __syncthreads();
        u32 thr, need;
        block_kth_largest([=](u32 i) { return pv[i]; }, E, p.topk, hist, res, thr, need);
        if (e < E) {
            bool chosen = key > thr;
            if (key == thr) {
                u32 before = 0;
                for (u32 q = 0; q < e; q++) before += pv[q] == thr ? 1u : 0u;
                chosen = before < need;
            }
            if (chosen) cand[atomicAdd(&ncand, 1u)] = e;
        }
        __syncthreads();
        if (e < E && threadIdx.x < E) {
            // Rank among the chosen (their order in cand is arbitrary; the rank is not).
            for (u32 t = 0; t < p.topk; t++) {
                if (cand[t] != e) continue;
                u32 rank = 0;
                for (u32 q = 0; q < p.topk; q++) {
                    const u32 o = cand[q], ko = pv[o];
                    rank += (ko > key || (ko == key && o < e)) ? 1u : 0u;
                }
                tp[rank] = pe;
                ti[rank] = e;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float sum = 0.0f;
            for (u32 t = 0; t < p.topk; t++) sum += tp[t];
            for (u32 t = 0; t < p.topk; t++) {
                uptr(p.ids)[(u64)r * p.topk + t] = ti[t];
                fptr(p.weights)[(u64)r * p.topk + t] = p.norm ? tp[t] / sum : tp[t];
            }
        }
        __syncthreads();
    }
}

// hid[r, i, q] = silu(gate_e x_r) * (up_e x_r), e = ids[r, i]; warp per (P pairs of q, r, i): 4 P weight rows
// against one read of x_r, U chunks of each in flight, and with PRE x_r's chunks of the batch loaded with them
// (warp_dots_rows). A feature's dots are warp_dots' sums whatever P, U and PRE.
// experts_order's permutation of the round's R x topk (row, rank) slots, u32, in the scratch after hid [R, topk, inter]
// (launch/mod.rs `scratch_elems`).
DEV u32* experts_slot_order(const FpExperts& p) {
    return uptr(p.c.scratch + (u64)p.c.nstreams * p.c.window * p.topk * p.inter * 4);
}

template <int P, int U, bool PRE, bool SORTED = false>
DEV void experts_gate_up(const FpExperts& p) {
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const u32 D = p.dim, I = p.inter;
    const u32 groups = (I + 2 * P - 1) / (2 * P);
    const u64 items = (u64)R * p.topk * groups;
    const bool wvec = (D & 7) == 0 && (p.gate_up & 15) == 0;
    for (u64 it = gw; it < items; it += nwarps) {
        // Feature-major: the warps of one group of features over every (row, rank) run side by side, so rows routed
        // to the same expert read its weight rows together (one DRAM read, the others from L2).
        const u32 q0 = (u32)(it / ((u64)R * p.topk)) * 2 * P;
        u32 rest = (u32)(it % ((u64)R * p.topk));
        // SORTED: the slot experts_order put at this place.
        if (SORTED) rest = experts_slot_order(p)[rest];
        const u32 r = rest / p.topk, i = rest % p.topk;
        if (!row_ok(c, r, false)) continue;
        const u32 e = uptr(p.ids)[(u64)r * p.topk + i];
        const bf16_t* gu = (const bf16_t*)p.gate_up + (u64)e * 2 * I * D;
        const bf16_t* w[4 * P];
#pragma unroll
        for (int f = 0; f < 2 * P; f++) {
            // Features past I read feature q0 again (every pointer valid) and write nothing.
            const u32 q = q0 + f < I ? q0 + f : q0;
            w[2 * f] = gu + (u64)q * D;
            w[2 * f + 1] = gu + (u64)(I + q) * D;
        }
        const bool ok[1] = {true};
        float res[4 * P][1];
        warp_dots<1, 4 * P, U, PRE>(w, 4 * P, fptr(p.x) + (u64)r * D, D, ok, D, wvec, lane, res);
        float* hid = fptr(c.scratch) + ((u64)r * p.topk + i) * I;
        if (lane == 0)
#pragma unroll
            for (int f = 0; f < 2 * P; f++)
                if (q0 + f < I) hid[q0 + f] = siluf_(res[2 * f][0]) * res[2 * f + 1][0];
    }
}
// Two pairs a warp (8 weight rows against one read of x_r), 2 chunks of each in flight. H200, against one pair a warp
// with 4 chunks in flight: lone-w1 902 -> 894 us, lone-w16 2706 -> 2602 us (with experts_down_f4); four pairs a
// warp with one chunk in flight: lone-w16 3471 us. x_r's two chunks are loaded with the weights (PRE, the same 128
// registers): H200, in two pairs of A/B runs (the 16-row linears with two m-tiles a warp in both), lone-w8 1633.7 /
// 1630.4 -> 1624.2 / 1620.5 us, 16 streams 2601.8 / 2598.3 -> 2595.1 / 2590.2 us (docs/benchmarks.md, twentieth
// session).
extern "C" __global__ void experts(const FpExperts p) { pdl_start(); experts_gate_up<2, 2, true>(p); }
// From 5 rows on (runtime/src/cuda/launch/moe.rs `gate_up_entry`): one chunk of each weight row in flight, in 80
// registers, so three blocks fit an SM instead of two: more warps with their loads in flight over the many (row,
// rank) items. The same sums. H200, 2026-12-02, two A/B passes: lone-w16 2254.6 / 2257.3 -> 2241.0 / 2243.9 us,
// 16 streams 2402.6 / 2410.4 -> 2396.4 / 2396.5 us (docs/benchmarks.md, twenty-eighth session); 2026-12-03, from
// 5 rows: lone-w5 1320 -> 1306 us, lone-w8 1590 -> 1575 us (thirtieth session).
// From 5 rows on: the slots taken in expert order (experts_order's permutation), so that the warps of the rows routed
// to one expert run side by side (H200, 16 streams: 2380 -> 2356 us a round; docs/benchmarks.md, thirty-fourth
// session). The same dots per slot.
extern "C" __global__ void __launch_bounds__(256, 3) experts_wide(const FpExperts p) {
    pdl_start();
    experts_gate_up<2, 1, true, true>(p);
}
// The round's (row, rank) slots in expert order for experts_wide, after hid in the scratch: a counting sort by id in
// one block of exactly 1024 threads (MOE_MAX_EXPERTS bins), the slots of rows that are not real last.
extern "C" __global__ void __launch_bounds__(1024) experts_order(const FpExperts p) {
    pdl_start();
    __shared__ u32 cnt[MOE_MAX_EXPERTS + 1];
    __shared__ u32 sh[33];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window, n = R * p.topk;
    u32* perm = experts_slot_order(p);
    const u32 t = threadIdx.x;
    for (u32 b = t; b <= MOE_MAX_EXPERTS; b += blockDim.x) cnt[b] = 0;
    __syncthreads();
    auto key = [&](u32 s) -> u32 {
        if (!row_ok(c, s / p.topk, false)) return MOE_MAX_EXPERTS;
        const u32 e = uptr(p.ids)[s];
        return e < MOE_MAX_EXPERTS ? e : MOE_MAX_EXPERTS - 1;
    };
    for (u32 s = t; s < n; s += blockDim.x) atomicAdd(&cnt[key(s)], 1u);
    __syncthreads();
    // Exclusive scan of bins 0..1023 (thread t bin t), bin 1024 after them all.
    u32 total;
    const u32 off = block_scan_u32(cnt[t], sh, total);
    cnt[t] = off;
    if (t == 0) cnt[MOE_MAX_EXPERTS] = total;
    __syncthreads();
    for (u32 s = t; s < n; s += blockDim.x) perm[atomicAdd(&cnt[key(s)], 1u)] = s;
}

// out[r, d] = sum over ranks i in order of weights[r, i] * down_e[d] . hid[r, i]; warp per (F features d, r), lane
// group g (8 lanes) takes ranks g, g + 4, ...: each chunk of hid read once for the F down rows, U chunks of each in
// flight, and with PRE the batch's U chunks of hid loaded with them; a lane sums its chunks in ascending k whatever F,
// U and PRE.
template <int F, int U, bool PRE = false>
DEV void experts_down_t(const FpExperts& p) {
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, g = lane >> 3, l8 = lane & 7;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const u32 D = p.dim, I = p.inter;
    const u64 items = (u64)R * ((D + F - 1) / F);
    const bool vec = (I & 7) == 0 && (p.down & 15) == 0;
    for (u64 it = gw; it < items; it += nwarps) {
        // Feature-major: the warps of one group of output features over every row run side by side, so rows routed
        // to the same expert read its down rows together (one DRAM read, the others from L2).
        const u32 d0 = (u32)(it / R) * F, r = (u32)(it % R);
        if (!row_ok(c, r, false)) continue;
        const u32* ids = uptr(p.ids) + (u64)r * p.topk;
        float part[MOE_MAX_TOPK / 4][F];
#pragma unroll
        for (int j = 0; j < MOE_MAX_TOPK / 4; j++)
#pragma unroll
            for (int f = 0; f < F; f++) part[j][f] = 0.0f;
#pragma unroll
        for (int j = 0; j < MOE_MAX_TOPK / 4; j++) {
            // Rounds whose lane groups hold no rank are skipped (the same j for the whole warp).
            if (4u * j >= p.topk) break;
            const u32 i = g + 4 * j;
            float acc[F];
#pragma unroll
            for (int f = 0; f < F; f++) acc[f] = 0.0f;
            if (i < p.topk) {
                const bf16_t* dn[F];
#pragma unroll
                for (int f = 0; f < F; f++) {
                    // Features past D read feature d0 again and write nothing.
                    const u32 d = d0 + f < D ? d0 + f : d0;
                    dn[f] = (const bf16_t*)p.down + (u64)ids[i] * D * I + (u64)d * I;
                }
                const float* h = fptr(c.scratch) + ((u64)r * p.topk + i) * I;
                if (vec) {
                    for (u32 kb = l8 * 8; kb < I; kb += 64 * U) {
                        uint4 wv[U][F];
#pragma unroll
                        for (int u = 0; u < U; u++)
#pragma unroll
                            for (int f = 0; f < F; f++)
                                wv[u][f] = kb + 64 * u < I ? ldg_stream16(dn[f] + kb + 64 * u) : zero4();
                        float xr[PRE ? U : 1][8];
                        if constexpr (PRE) {
#pragma unroll
                            for (int u = 0; u < U; u++) {
                                const u32 kk = kb + 64 * u;
                                if (kk < I) {
                                    load_x8(h + kk, (I & 3) == 0, xr[u]);
                                } else {
#pragma unroll
                                    for (int e = 0; e < 8; e++) xr[u][e] = 0.0f;
                                }
                            }
                        }
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const u32 kk = kb + 64 * u;
                            if (kk >= I) continue;
                            float x[8];
                            if constexpr (PRE) {
#pragma unroll
                                for (int e = 0; e < 8; e++) x[e] = xr[u][e];
                            } else {
                                load_x8(h + kk, (I & 3) == 0, x);
                            }
#pragma unroll
                            for (int f = 0; f < F; f++) {
                                float w8[8];
                                unpack8(wv[u][f], w8);
                                acc[f] += dot8(w8, x);
                            }
                        }
                    }
                } else {
                    for (u32 kk = l8; kk < I; kk += 8)
#pragma unroll
                        for (int f = 0; f < F; f++) acc[f] = fmaf(bf2f(dn[f][kk]), h[kk], acc[f]);
                }
            }
#pragma unroll
            for (int f = 0; f < F; f++) part[j][f] = group8_sum(acc[f]);
        }
#pragma unroll
        for (int f = 0; f < F; f++) {
            float out = 0.0f;
#pragma unroll
            for (int j = 0; j < MOE_MAX_TOPK / 4; j++) {
                if (4u * j >= p.topk) break;
#pragma unroll
                for (int gg = 0; gg < 4; gg++) {
                    const float t = __shfl_sync(FULL_MASK, part[j][f], gg * 8);
                    const u32 i = gg + 4 * j;
                    if (i < p.topk) out = fmaf(fptr(p.weights)[(u64)r * p.topk + i], t, out);
                }
            }
            const u32 d = d0 + f;
            if (lane == 0 && d < D) {
                // The shared expert of the side branch: the fmaf shared_expert_down does in place otherwise.
                if (p.shared) out = fmaf(fptr(p.shared)[r], fptr(p.shared)[R + (u64)r * D + d], out);
                fptr(p.out)[(u64)r * D + d] = out;
            }
        }
    }
}
// One feature a warp (4 chunks in flight), or four (2 chunks of each in flight: hid read once for four down rows,
// a quarter of the L2 traffic of hid; runtime/src/cuda/launch/moe.rs `down_features` picks one by the row count).
// experts_down_f4 loads hid with the weights (PRE; 118 registers, 121 before): H200, one A/B call, lone-w16
// 2369.9 / 2358.8 -> 2339.2 us, 16 streams 2596.2 / 2597.4 -> 2582.4 us, lone-w2 992.0 / 989.5 -> 987.7 us
// (docs/benchmarks.md, twentieth session). experts_down with PRE was slower (lone-w8 1617.6-1621.7 -> 1648.9 us).
extern "C" __global__ void experts_down(const FpExperts p) { pdl_start(); experts_down_t<1, 4>(p); }
extern "C" __global__ void experts_down_f4(const FpExperts p) { pdl_start(); experts_down_t<4, 2, true>(p); }

// ---- One row's routed experts in one launch (experts_one, then experts_combine) ----
// EO_BLOCKS blocks take one rank i of the row. Each computes its share of hid (the gate/up warp_dots of
// experts_gate_up: the same sums) into the scratch; the rank's blocks meet at its barrier (a counter of the node),
// then each block does experts_down's lane-group sums (lane l8 of a group of 8: the chunks at k = 8 l8 + 64 n, n
// ascending, then group8_sum) for its share of the down rows into part[i * D + d]; experts_combine does
// experts_down's fmaf chain over the ranks. The same bits as experts + experts_down, without the wait for every
// rank's gate/up before any down: a rank's down starts when its own gate/up is done. Every block must be on the GPU
// at once (the launch checks the grid against the kernel's occupancy). Needs the vector paths (D % 8 == 0,
// I % 8 == 0, 16-byte aligned weights) and I <= EO_MAX_INTER.
#define EO_BLOCKS 40
#define EO_THREADS 256  // = the launch bound
#define EO_MAX_INTER 2048

extern "C" __global__ void __launch_bounds__(256, 4) experts_one(const FpExperts p) {
    __shared__ __align__(16) float hid[EO_MAX_INTER];  // read 16 bytes at a time (load_x8)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const FpCommon& c = p.c;
    const u32 D = p.dim, I = p.inter, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 i = blockIdx.x / EO_BLOCKS, b = blockIdx.x % EO_BLOCKS;
    const bool real = row_ok(c, 0, false);
    const u32 e = real ? uptr(p.ids)[i] : 0;
    const u32 dper = (D + EO_BLOCKS - 1) / EO_BLOCKS, d0 = b * dper, d1 = d0 + dper < D ? d0 + dper : D;
    const bf16_t* dn = (const bf16_t*)p.down + (u64)e * D * I;
    const u32 per = (I + EO_BLOCKS - 1) / EO_BLOCKS, f0 = b * per, f1 = f0 + per < I ? f0 + per : I;
    const bf16_t* gu = (const bf16_t*)p.gate_up + (u64)e * 2 * I * D;
    float* part = fptr(c.scratch);
    float* hg = part + (u64)p.topk * D + (u64)i * I;  // hid of rank i
    // Warp w takes features f0 + 2 w and f0 + 2 w + 1 (the gate and up rows of each), then 2 EO_THREADS / 32 on.
    for (u32 q = f0 + 2 * warp; real && q < f1; q += EO_THREADS / 16) {
        const u32 q1 = q + 1 < f1 ? q + 1 : q;
        const bf16_t* w[4] = {gu + (u64)q * D, gu + (u64)(I + q) * D, gu + (u64)q1 * D, gu + (u64)(I + q1) * D};
        const bool ok[1] = {true};
        float res[4][1];
        warp_dots<1, 4, 2>(w, 4, fptr(p.x), D, ok, D, true, lane, res);
        if (lane == 0) {
            hg[q] = siluf_(res[0][0]) * res[1][0];
            if (q + 1 < f1) hg[q + 1] = siluf_(res[2][0]) * res[3][0];
        }
    }
    group_barrier(uptr(p.barrier) + i, EO_BLOCKS, b == 0);
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (!real) return;
    for (u32 f = threadIdx.x; f < I; f += EO_THREADS) hid[f] = __ldcg(hg + f);
    __syncthreads();
    // Down: a lane group of 8 per row d (experts_down's), 4 rows a warp.
    const u32 g = lane >> 3, l8 = lane & 7;
    for (u32 dd = d0 + 4 * warp; dd < d1; dd += EO_THREADS / 8) {
        const u32 d = dd + g < d1 ? dd + g : dd;
        const bf16_t* row = dn + (u64)d * I;
        float acc = 0.0f;
        for (u32 kb = l8 * 8; kb < I; kb += 64 * 5) {
            uint4 wv[5];
#pragma unroll
            for (int u = 0; u < 5; u++) wv[u] = kb + 64 * u < I ? ldg_stream16(row + kb + 64 * u) : zero4();
#pragma unroll
            for (int u = 0; u < 5; u++) {
                const u32 kk = kb + 64 * u;
                if (kk >= I) continue;
                float w8[8], x[8];
                unpack8(wv[u], w8);
                load_x8(hid + kk, true, x);
                acc += dot8(w8, x);
            }
        }
        const float t = group8_sum(acc);
        if (l8 == 0 && dd + g < d1) part[(u64)i * D + d] = t;
    }
}

// out[d] = experts_down's fmaf chain over the ranks of one row (from experts_one's sums) and the side branch's shared
// expert, as there.
extern "C" __global__ void experts_combine(const FpExperts p) {
    pdl_start();
    const FpCommon& c = p.c;
    const u32 D = p.dim, d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D || !row_ok(c, 0, false)) return;
    const float* part = fptr(c.scratch);
    float out = 0.0f;
    for (u32 i = 0; i < p.topk; i++) out = fmaf(fptr(p.weights)[i], part[(u64)i * D + d], out);
    if (p.shared) out = fmaf(fptr(p.shared)[0], fptr(p.shared)[1 + (u64)d], out);
    fptr(p.out)[d] = out;
}

// Warp q of the shared expert's gate/up over the row tile at i0 (its activations at X, row stride dim):
// hid[r, q] = silu(gate_q . x_r) * (up_q . x_r); q == inter: sg[r] = sigmoid(scale . x_r) at scratch[R * inter + r].
template <int T, int U, bool PRE>
DEV void shared_q(const FpSharedExpert& p, u32 R, u32 q, u32 i0, const float* X, const bool (&ok)[T], bool wvec,
                  u32 lane) {
    const u32 D = p.dim, I = p.inter;
    float* S = fptr(p.c.scratch);
    const bf16_t* w[2];
    u32 nm = 2;
    if (q < I) {
        w[0] = (const bf16_t*)p.gate + (u64)q * D;
        w[1] = (const bf16_t*)p.up + (u64)q * D;
    } else {
        w[0] = w[1] = (const bf16_t*)p.scale;
        nm = 1;
    }
    float res[2][T];
    warp_dots<T, 2, U, PRE>(w, nm, X, D, ok, D, wvec, lane, res);
    if (lane == 0)
#pragma unroll
        for (int t = 0; t < T; t++) {
            if (!ok[t]) continue;
            if (q < I)
                S[(u64)(i0 + t) * I + q] = siluf_(res[0][t]) * res[1][t];
            else
                S[(u64)R * I + i0 + t] = sigmoidf_(res[0][t]);
        }
}

// The shared expert's gate/up: warp per q <= inter (shared_q), all rows in tiles of T over blockIdx.y
// (over_row_tiles; STAGED: each tile staged in shared memory once a block); the same sums.
template <int T, int U = 4, bool PRE = false, bool STAGED = false>
DEV void shared_t(const FpSharedExpert& p, u32 R) {
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const u32 D = p.dim, I = p.inter;
    const bool wvec = (D & 7) == 0 && (p.gate & 15) == 0 && (p.up & 15) == 0 && (p.scale & 15) == 0;
    over_row_tiles<T, STAGED>(
        p.c, fptr(p.x), D, R, gw, nwarps, [&](u32 q) { return q <= I; },
        [&](u32 q, u32 i0, const float* X, const bool(&ok)[T]) { shared_q<T, U, PRE>(p, R, q, i0, X, ok, wvec, lane); });
}

// shared_expert_t1: a lane's 10 chunks of each row (K = 2560 at the real width) in flight at once (H200: 8.3 -> 8.1 us
// a node).
template <int T, int U = 4, bool PRE = false, bool STAGED = false>
DEV void shared_entry(const FpSharedExpert& p) {
    shared_t<T, U, PRE, STAGED>(p, p.c.nstreams * p.c.window);
}
extern "C" __global__ void shared_expert_t1(const FpSharedExpert p) { pdl_start(); shared_entry<1, 10, true>(p); }
// shared_expert_t2 (tiles of 2 rows, up to 4 rows: runtime/src/cuda/launch/moe.rs `shared_expert_tiles`): 2 chunks
// of each row in flight, loaded with the weights (PRE; 79 registers).
extern "C" __global__ void shared_expert_t2(const FpSharedExpert p) { pdl_start(); shared_entry<2, 2, true>(p); }
extern "C" __global__ void shared_expert_t4(const FpSharedExpert p) { pdl_start(); shared_entry<4>(p); }
// shared_expert_s4 / shared_expert_down_s4: the tiles of 4 rows staged in shared memory (runtime/src/cuda/launch/moe.rs
// `shared_expert_tiles`: from 5 rows where 4 rows fit STAGE_TILE_MAX).
extern "C" __global__ void shared_expert_s4(const FpSharedExpert p) { pdl_start(); shared_entry<4, 4, false, true>(p); }

// Warp d0 of the shared expert's down over the row tile at i0 (hid at X, row stride inter): features d0, d0 + 1 (those
// below dim); out[r, d] = fmaf(sg[r], down_d . hid[r], out[r, d]), or with keep_dots (the side branch) the dots stay
// in the scratch after sg for experts_down, which does the same fmaf.
template <int T, int U, bool PRE>
DEV void shared_down_d(const FpSharedExpert& p, u32 R, u32 d0, u32 i0, const float* X, const bool (&ok)[T], bool wvec,
                       u32 lane) {
    const u32 D = p.dim, I = p.inter;
    const float* S = fptr(p.c.scratch);
    const u32 nm = D - d0 < 2 ? D - d0 : 2;
    const bf16_t* w[2] = {(const bf16_t*)p.down + (u64)d0 * I,
                          (const bf16_t*)p.down + (u64)(d0 + (nm > 1 ? 1 : 0)) * I};
    float res[2][T];
    warp_dots<T, 2, U, PRE>(w, nm, X, I, ok, I, wvec, lane, res);
    if (lane == 0)
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int t = 0; t < T; t++) {
                if ((u32)m >= nm || !ok[t]) continue;
                const u64 at = (u64)(i0 + t) * D + d0 + m;
                if (p.keep_dots) {
                    fptr(p.c.scratch)[(u64)R * I + R + at] = res[m][t];
                } else {
                    float* o = fptr(p.out) + at;
                    *o = fmaf(S[(u64)R * I + i0 + t], res[m][t], *o);
                }
            }
}

// The shared expert's down: warp per 2 features (shared_down_d), all rows in tiles of T over blockIdx.y
// (over_row_tiles over hid; STAGED: each tile of hid staged in shared memory once a block); the same sums.
template <int T, int U = 4, bool PRE = false, bool STAGED = false>
DEV void shared_down_t(const FpSharedExpert& p, u32 R) {
    const u32 lane = threadIdx.x & 31;
    const u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 nwarps = (gridDim.x * blockDim.x) >> 5;
    const u32 D = p.dim, I = p.inter;
    const bool wvec = (I & 7) == 0 && (p.down & 15) == 0;
    over_row_tiles<T, STAGED>(
        p.c, fptr(p.c.scratch), I, R, gw * 2, nwarps * 2, [&](u32 d0) { return d0 < D; },
        [&](u32 d0, u32 i0, const float* X, const bool(&ok)[T]) {
            shared_down_d<T, U, PRE>(p, R, d0, i0, X, ok, wvec, lane);
        });
}

template <int T, int U = 4, bool PRE = false, bool STAGED = false>
DEV void shared_down_entry(const FpSharedExpert& p) {
    shared_down_t<T, U, PRE, STAGED>(p, p.c.nstreams * p.c.window);
}
extern "C" __global__ void shared_expert_down_t1(const FpSharedExpert p) { pdl_start(); shared_down_entry<1>(p); }
// shared_expert_down_t2: a lane's 3 chunks of hid (I = 640 at the real width) loaded with the weights (PRE; 108
// registers).
extern "C" __global__ void shared_expert_down_t2(const FpSharedExpert p) { pdl_start(); shared_down_entry<2, 3, true>(p); }
extern "C" __global__ void shared_expert_down_t4(const FpSharedExpert p) { pdl_start(); shared_down_entry<4>(p); }
extern "C" __global__ void shared_expert_down_s4(const FpSharedExpert p) {
    pdl_start();
    shared_down_entry<4, 4, false, true>(p);
}
