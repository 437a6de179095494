// The body of the linear kernels (linear.cu's linear and linear_multi; norm.cu's hc_mix_tc with its own epilogue;
// mxfp8.cu's linear_mxfp8 with its own weight source): out[i, n] (+)= sum_k x[i, k] * w[n, k] over the sub-rows i of
// every real row, on tensor cores (`linear_tc_rows_w` below).
#pragma once
#include "common.cuh"

// Rows to compute in a launch of this shape: every sub-row of every row (or of every stream's row when gathered).
DEV u32 linear_total(const FpCommon& c, u32 sub, u32 gathered) {
    return (gathered ? c.nstreams : c.nstreams * c.window) * sub;
}

// The part of a `linear_multi` launch (linear.cu, mxfp8.cu) that this block runs: block b belongs to matrix m where b
// falls in m's range of the prefix sums of blocks[] (blocks[m] = m's own `linear` grid, or at one or two rows its
// share of one wave, with the same row tile and split of K: the runtime only joins linears with the same split).
// Sets q to m's parameters as one `linear` launch, b to the block's index within m's blocks and nblocks to
// blocks[m]; false for a block past the blocks' sum (not launched so).
DEV bool linear_multi_part(const FpLinearMulti& p, FpLinear& q, u32& b, u32& nblocks) {
    b = blockIdx.x;
    q.c = p.c;
    q.x = p.x;
    q.k = p.k;
    q.sub = p.sub;
    q.gathered = p.gathered;
    q.split = p.split;
    q.w = 0;
    q.out = 0;
    q.n = 0;
    q.accumulate = 0;
    nblocks = 0;
    bool found = false;
    // Unrolled with constant indices (no dynamic indexing of the parameter arrays).
#pragma unroll
    for (int i = 0; i < FP_MAX_LINEARS; i++) {
        if (!found && (u32)i < p.count) {
            if (b < p.blocks[i]) {
                found = true;
                q.w = p.w[i];
                q.out = p.out[i];
                q.n = p.n[i];
                q.accumulate = p.accumulate[i];
                nblocks = p.blocks[i];
            } else {
                b -= p.blocks[i];
            }
        }
    }
    return found;
}

// ---- Tensor-core body of the linears (linear.cu's linear and linear_multi, mxfp8.cu's linear_mxfp8) ----
// out[i, n] (+)= sum_k x[i, k] * w[n, k] with mma.sync m16n8k16 (BF16 x BF16 -> f32). The f32 activation is split
// exactly into three BF16 terms x = hi + mid + lo (`split3`: truncations of the f32 bits; every remainder is exact
// in f32), so every product w * term is exact and the sum is f32 accumulation in the tensor core's fixed order.
// A warp owns one m-tile of 16 output features (or MT of them, each with its own MMAs) and one slice of K (S slices
// from the weight's shape [n, k] alone,
// steps of 32 values); the 8 rows of an n-tile are the 8 columns of the MMA, so a row's arithmetic is the same in
// every column, every tile (a lone row runs in column 0; the other columns are discarded) and every launch: row
// invariance. Per step lane (g = lane / 4, q = lane % 4) loads its A fragments of feature rows g and g + 8 at
// k = 32 step + 8 q .. + 7 (two 16-byte loads from the tiled weights, TC_TILE_U4) and the same 8 activations of
// row g of each n-tile; MMA h (0, 1) takes k 8 q + 4 h .. + 3 (as logical k 2q, 2q + 1, 2q + 8, 2q + 9), so the K
// permutation inside a step is the same for weights and activations. The six MMAs of a step (MMA 0 with hi, mid,
// lo, then MMA 1 with them) go into one accumulator (`tc_step_split`), step after step; per (feature, row) the value
// is that sum, then the S slices in slice order.

// D += A B for one m16n8k16 BF16 MMA (A: 4 registers of 2 BF16, B: 2 registers; f32 accumulators).
DEV void mma_bf16_16816(float (&d)[4], const u32 a0, const u32 a1, const u32 a2, const u32 a3, const u32 b0,
                        const u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x = h + m + l exactly, each BF16-exact: h = x with its low 16 bits cleared, m likewise of r = x - h (exact), and
// l = r - m (exact, at most 8 significant bits); x = +-Inf gives h = x, m = l = 0.
DEV void split3(const float x, float& h, float& m, float& l) {
    h = __uint_as_float(__float_as_uint(x) & 0xffff0000u);
    const float r = isinf(x) ? 0.0f : x - h;  // an infinite x is its own hi term (as the CPU twin keeps it)
    m = __uint_as_float(__float_as_uint(r) & 0xffff0000u);
    l = r - m;
}
// Two BF16-exact f32 values as one BF16x2 register (a in the low half: the lower k).
DEV u32 pack_bf16x2(const float a, const float b) { return __byte_perm(__float_as_uint(a), __float_as_uint(b), 0x7632); }

// Eight f32 activations at kk .. kk + 7 of a row of K (zeros past K).
DEV void load_x8_k(const float* row, u32 kk, u32 K, bool xvec, float* x) {
    if (xvec && kk + 8 <= K) {
        load_x8(row + kk, true, x);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) x[e] = kk + e < K ? row[kk + e] : 0.0f;
}

// The weights in MMA tiles (runtime/src/cuda/weights.rs `tile_linear`): tile (m, step) of 16 features x 32 inputs
// is 1 KB = 64 uint4 at uint4 (m * steps + step) * 64; lane l reads uint4 l (MMA 0's A fragment: features g, g + 8 at
// k 8 q + 0 .. 3) and uint4 32 + l (MMA 1's: k 8 q + 4 .. 7), each register one BF16 pair, in the order a0a1, a2a3,
// a4a5, a6a7 of the m16n8k16 A fragment. Zero-padded to whole tiles.
#define TC_TILE_U4 64
// The lane's A fragments of U consecutive weight tiles from wp (its uint4 of the tile): w0 MMA 0's, w1 MMA 1's.
template <int U>
DEV void tc_load_tiles(uint4 (&w0)[U], uint4 (&w1)[U], const uint4* wp) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        w0[u] = ldg_stream16_l2pf(wp + u * TC_TILE_U4);
        w1[u] = ldg_stream16_l2pf(wp + u * TC_TILE_U4 + 32);
    }
}

// ---- Weight sources of linear_tc_rows_w: where a lane's A fragments of each step come from ----
// A source is pointed at m-tile m, step s of lane `lane` (`seek(a, steps, lane, m, s)`: steps = ceil(k / 32)), loads
// a batch of N steps from there (`load<N, ALL>(b, first, end)`: all N, or with ALL false only the steps u with
// first + u < end, zeros for the rest), gives step u's two A fragments (`frag(b, u, w0, w1)`: MMA 0's, k 8 q + 0 .. 3,
// and MMA 1's, k 8 q + 4 .. 7, each register one BF16 pair in the order a0a1, a2a3, a4a5, a6a7) and moves on
// (`advance(steps)`). Every source gives the MMAs BF16 values, so the arithmetic after the fragments is the same for
// all of them.

// BF16 weights in MMA tiles (TC_TILE_U4): a step's fragments are its two 16-byte loads.
struct TcBf16Tiles {
    const uint4* wp;
    template <int N>
    struct Batch {
        uint4 w0[N], w1[N];
    };
    DEV void seek(const FpLinear& a, u32 steps, u32 lane, u32 m, u32 s) {
        wp = (const uint4*)a.w + ((u64)m * steps + s) * TC_TILE_U4 + lane;
    }
    template <int N, bool ALL>
    DEV void load(Batch<N>& b, u32 first, u32 end) const {
        if constexpr (ALL) {
            tc_load_tiles<N>(b.w0, b.w1, wp);
        } else {
#pragma unroll
            for (int u = 0; u < N; u++) {
                const bool in = first + u < end;
                b.w0[u] = in ? ldg_stream16_l2pf(wp + u * TC_TILE_U4) : zero4();
                b.w1[u] = in ? ldg_stream16_l2pf(wp + u * TC_TILE_U4 + 32) : zero4();
            }
        }
    }
    template <int N>
    DEV void frag(const Batch<N>& b, int u, uint4& w0, uint4& w1) const {
        w0 = b.w0[u];
        w1 = b.w1[u];
    }
    DEV void advance(u32 s) { wp += s * TC_TILE_U4; }
};

// The three BF16 terms of 8 activations as MMA B fragments: xt[e] (e = 0 hi, 1 mid, 2 lo) holds the pairs
// (0, 1), (2, 3) (MMA 0's b0, b1) and (4, 5), (6, 7) (MMA 1's).
DEV void tc_split_x(const float (&x)[8], uint4 (&xt)[3]) {
    float h[8], m[8], l[8];
#pragma unroll
    for (int e = 0; e < 8; e++) split3(x[e], h[e], m[e], l[e]);
    xt[0] = make_uint4(pack_bf16x2(h[0], h[1]), pack_bf16x2(h[2], h[3]), pack_bf16x2(h[4], h[5]), pack_bf16x2(h[6], h[7]));
    xt[1] = make_uint4(pack_bf16x2(m[0], m[1]), pack_bf16x2(m[2], m[3]), pack_bf16x2(m[4], m[5]), pack_bf16x2(m[6], m[7]));
    xt[2] = make_uint4(pack_bf16x2(l[0], l[1]), pack_bf16x2(l[2], l[3]), pack_bf16x2(l[4], l[5]), pack_bf16x2(l[6], l[7]));
}
// One step of 32 values: the lane's two A fragments of the weight tile (w0: MMA 0, k 8 q + 0 .. 3; w1: MMA 1,
// k 8 q + 4 .. 7) against the three terms of its 8 activations (`tc_split_x`), all six MMAs into the one accumulator
// in a fixed order: MMA 0 with the hi, mid and lo terms, then MMA 1 with them. One accumulator instead of one a term
// leaves the registers for more steps of loads in flight (the tile of 16 rows: 4 instead of 2). H200, 2026-12-04:
// the 16-row lm_head 355 -> 335 us, the 6144 -> 2560 output projection 21.3 -> 18.4 us, 16 streams 2335 -> 2296 us
// (docs/benchmarks.md, thirty-fifth session).
DEV void tc_step_split(float (&acc)[4], const uint4& w0, const uint4& w1, const uint4 (&xt)[3]) {
#pragma unroll
    for (int e = 0; e < 3; e++) mma_bf16_16816(acc, w0.x, w0.y, w0.z, w0.w, xt[e].x, xt[e].y);
#pragma unroll
    for (int e = 0; e < 3; e++) mma_bf16_16816(acc, w1.x, w1.y, w1.z, w1.w, xt[e].z, xt[e].w);
}
// tc_step_split on 8 activations split here.
DEV void tc_step(float (&acc)[4], const uint4& w0, const uint4& w1, const float (&x)[8]) {
    uint4 xt[3];
    tc_split_x(x, xt);
    tc_step_split(acc, w0, w1, xt);
}

// The chunk of 8 at kk of a row of K (zeros where the row is not real: `real` false) into its three BF16 terms
// (tc_split_x) at dst[0..3): the form linear_split_rows leaves and hc_read_one keeps in shared memory.
DEV void split_chunk(const float* row, u32 kk, u32 K, bool xvec, bool real, uint4* dst) {
    float x[8];
    if (real) {
        load_x8_k(row, kk, K, xvec, x);
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = 0.0f;
    }
    uint4 xt[3];
    tc_split_x(x, xt);
#pragma unroll
    for (int e = 0; e < 3; e++) dst[e] = xt[e];
}

// The three BF16 terms of every row of x [total, k] in MMA B-fragment form, for the linears of two rows or more
// (T >= 2), into `out` (in the node's own scratch; runtime/src/cuda/launch/mod.rs `scratch_elems`): uint4 entry
// ((i * steps + step) * 4 + q) * 3 + e is term e of `tc_split_x` of x[i, 32 step + 8 q .. + 7] (zeros past k, and
// for rows that are not real: the zeros linear_tc_rows would load). Done once per launch instead of once per step
// and m-tile; the MMAs then take the same registers, so the results are the same bits.
DEV void linear_split_rows(const FpCommon& c, u64 x, u32 k, u32 total, u32 sub, u32 gathered, uint4* out) {
    const u32 steps = (k + 31) / 32, per_row = steps * 4;
    const float* X = fptr(x);
    const bool xvec = ((u64)X & 15) == 0 && (k & 3) == 0;
    for (u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < total * per_row; j += gridDim.x * blockDim.x) {
        const u32 i = j / per_row, sq = j % per_row;
        split_chunk(X + (u64)i * k, sq * 8, k, xvec, row_ok(c, i / sub, gathered), out + (u64)j * 3);
    }
}

// A lone activation row (T = 1, one row in the launch) split once per block instead of once per step and m-tile:
// its three terms in MMA fragment form, [step][q][term] (`tc_split_x` of x[32 step + 8 q ..]), for K of at most
// TC_LONE_STEPS steps of 32 (the static shared memory: 192 bytes per step). The MMAs take the same registers as
// from `tc_step`, so the results are the same bits.
#define TC_LONE_STEPS 224

// The linear's own epilogue: out[i, n] (+)= the sum of the S slices of (feature n, row i), in slice order. part:
// the block's partial sums [warp][feature in the m-tile][row in the tile]; nb0: the first feature of the G m-tiles
// (the block's first, or with MT m-tiles a warp that of the block's j-th group of G); i0: the tile's first row; G
// m-tiles of S slices.
struct LinearStore {
    template <int T>
    DEV void operator()(const FpLinear& a, float (&part)[SPLIT_WARPS][16][T], u32 nb0, u32 i0, u32 G, u32 S,
                        u32 total) const {
        float* O = fptr(a.out);
        for (u32 idx = threadIdx.x; idx < G * 16 * T; idx += blockDim.x) {
            const u32 gg = idx / (16 * T), f = (idx / T) % 16, t = idx % T;
            const u32 n = nb0 + gg * 16 + f, i = i0 + t;
            if (n >= a.n || i >= total || !row_ok(a.c, i / a.sub, a.gathered)) continue;
            float v = 0.0f;
            for (u32 s = 0; s < S; s++) v += part[gg * S + s][f][t];
            float* o = O + (u64)i * a.n + n;
            *o = a.accumulate ? *o + v : v;
        }
    }
};

// A step's three terms of a row at xp (SHARED: in shared memory, else read through __ldg).
template <bool SHARED>
DEV void tc_load_terms(const uint4* xp, uint4 (&xt)[3]) {
#pragma unroll
    for (int e = 0; e < 3; e++) xt[e] = SHARED ? xp[e] : __ldg(xp + e);
}
// One step's MMAs against NT n-tiles: xb[nt] + 12 u is the step's three terms (`tc_load_terms`).
template <int NT, bool SHARED>
DEV void tc_step_tiles(float (&acc)[NT][4], const uint4& w0, const uint4& w1, const uint4* const (&xb)[NT],
                       int u) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        uint4 xt[3];
        tc_load_terms<SHARED>(xb[nt] + u * 12, xt);
        tc_step_split(acc[nt], w0, w1, xt);
    }
}
// The MMAs of the first n (<= N) steps of a batch: w0, w1 the steps' weight fragments, xb[nt] the rows' terms at the
// batch's first step (12 uint4 per step; SHARED: in shared memory, else read through __ldg).
template <int N, int NT, bool SHARED>
DEV void tc_batch_mmas(float (&acc)[NT][4], const uint4 (&w0)[N], const uint4 (&w1)[N], const uint4* const (&xb)[NT],
                       u32 n) {
#pragma unroll
    for (int u = 0; u < N; u++) {
        if ((u32)u >= n) break;
        tc_step_tiles<NT, SHARED>(acc, w0[u], w1[u], xb, u);
    }
}
// The same from the weight sources' batches of MT m-tiles: each step's fragments of every m-tile (`frag`) first, then
// per n-tile its three terms, read once for the MT m-tiles' MMAs. Per accumulator the MMAs run in step order, as
// with one m-tile.
template <int N, int NT, int MT, bool SHARED, class W>
DEV void tc_batch_mmas_w(float (&acc)[MT][NT][4], const W (&w)[MT], const typename W::template Batch<N> (&b)[MT],
                         const uint4* const (&xb)[NT], u32 n) {
#pragma unroll
    for (int u = 0; u < N; u++) {
        if ((u32)u >= n) break;
        uint4 w0[MT], w1[MT];
#pragma unroll
        for (int j = 0; j < MT; j++) w[j].frag(b[j], u, w0[j], w1[j]);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            uint4 xt[3];
            tc_load_terms<SHARED>(xb[nt] + u * 12, xt);
#pragma unroll
            for (int j = 0; j < MT; j++) tc_step_split(acc[j][nt], w0[j], w1[j], xt);
        }
    }
}
// Steps s0 .. s1 of MT m-tiles (ws[j]: m-tile j's weight source at step s0, left there) against NT n-tiles of rows
// already split into their BF16 terms: xb[nt] is the lane's three terms at step s0 (12 uint4 per step), in shared
// memory (SHARED: the lone row's `xs`) or in global memory (linear_split_rows' scratch, read through __ldg). Batches
// of U steps: the batch's weight loads of every m-tile all in flight, then its MMAs; a last batch of fewer than U
// steps also issues its loads at once (one memory latency, not one a step) and runs only its own steps' MMAs, in the
// same order. On return xb is advanced past the full batches only (the callers set it afresh for every call).
template <int U, int NT, int MT, bool SHARED, class W>
DEV void tc_steps_split(float (&acc)[MT][NT][4], const W (&ws)[MT], u32 s0, u32 s1, const uint4* (&xb)[NT]) {
    static_assert(U >= 2, "the last partial batch holds U - 1 steps");
    W w[MT];
#pragma unroll
    for (int j = 0; j < MT; j++) w[j] = ws[j];
    u32 st = s0;
    for (; st + U <= s1; st += U) {
        typename W::template Batch<U> b[MT];
#pragma unroll
        for (int j = 0; j < MT; j++) w[j].template load<U, true>(b[j], 0, U);
        tc_batch_mmas_w<U, NT, MT, SHARED>(acc, w, b, xb, U);
#pragma unroll
        for (int j = 0; j < MT; j++) w[j].advance(U);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) xb[nt] += U * 12;
    }
    if (st < s1) {
        // The last batch of fewer than U steps: every load in flight at once, then its steps' MMAs.
        const u32 left = s1 - st;
        typename W::template Batch<U - 1> b[MT];
#pragma unroll
        for (int j = 0; j < MT; j++) w[j].template load<U - 1, false>(b[j], 0, left);
        tc_batch_mmas_w<U - 1, NT, MT, SHARED>(acc, w, b, xb, left);
    }
}

// The MMA accumulators into a warp's partials pw[feature][row]: lane (g, q) holds features g and g + 8 of rows 2q and
// 2q + 1 of each n-tile (rows from T on are not kept). linear_tc_rows and hc_read_one.
template <int T, int NT>
DEV void tc_acc_to_part(const float (&acc)[NT][4], float (&pw)[16][T], u32 g, u32 q) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const u32 f = g + (r >= 2 ? 8 : 0), t = nt * 8 + 2 * q + (r & 1);
            if (t < (u32)T) pw[f][t] = acc[nt][r];
        }
}

// Blocks block, block + nblocks, ... of a launch of nblocks blocks, each (8 / S) MT m-tiles of 16 output features;
// T is the row tile (1, 2, 4, 8 or 16: one or two n-tiles), U the steps of loads in flight. w: the weight source
// (TcBf16Tiles: the BF16 tiles, a step's loads two unconditional 16-byte loads per lane that are its A fragments;
// mxfp8.cu's TcMxfp8Tiles: MXFP8 tiles decoded to BF16 fragments). xsplit: the rows' terms from
// linear_split_rows (read from two rows on); store: the epilogue (LinearStore, or norm.cu's hyper-connection mix).
// MT: m-tiles a warp (two in linear_t1_deep and the BF16 tiles of 8 and 16 rows): warp (grp, slice) of a block
// takes m-tiles grp, grp + G, ... + (MT - 1) G of the block's G MT, each step's terms read once for all of them;
// each m-tile's MMAs are those of MT = 1.
template <int T, int U, class Store, class W, int MT = 1>
DEV void linear_tc_rows_w(const FpLinear& a, u32 total, u32 block, u32 nblocks, const uint4* xsplit,
                          const Store& store, W w) {
    constexpr int NT = (T + 7) / 8;
    const FpCommon& c = a.c;
    __shared__ float part[SPLIT_WARPS][16][T];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, q = lane & 3;
    const u32 S = a.split == 0 ? 1 : a.split;
    const u32 G = SPLIT_WARPS / S, grp = warp / S, sl = warp % S;
    const u32 per_block = G * 16 * MT;
    const u32 steps = (a.k + 31) / 32, per = (steps + S - 1) / S;
    const u32 tiles = (a.n + 15) / 16;
    const u32 s0 = sl * per < steps ? sl * per : steps;
    const u32 s1 = s0 + per < steps ? s0 + per : steps;
    const float* X = fptr(a.x);
    const bool xvec = ((u64)X & 15) == 0 && (a.k & 3) == 0;
    __shared__ uint4 xs[T == 1 ? TC_LONE_STEPS * 12 : 1];
    const bool lone = T == 1 && total == 1 && steps <= TC_LONE_STEPS && row_ok(c, 0, a.gathered);
    if (lone) {
        // T = 1 with one row: the block splits the row into shared memory once (tc_split_x).
        for (u32 j = threadIdx.x; j < steps * 4; j += blockDim.x) {
            float x[8];
            load_x8_k(X, (j / 4) * 32 + (j % 4) * 8, a.k, xvec, x);
            uint4 xt[3];
            tc_split_x(x, xt);
#pragma unroll
            for (int e = 0; e < 3; e++) xs[j * 3 + e] = xt[e];
        }
        __syncthreads();
    }
    for (u32 nb0 = block * per_block; nb0 < a.n; nb0 += nblocks * per_block) {
        // The m-tiles' weights from step s0 (an m-tile past n reads tile 0 and is never written).
        W wm[MT];
#pragma unroll
        for (int j = 0; j < MT; j++) {
            const u32 n0 = nb0 + (j * G + grp) * 16, m = n0 / 16 < tiles ? n0 / 16 : 0;
            wm[j] = w;
            wm[j].seek(a, steps, lane, m, s0);
        }
        for (u32 i0 = 0; i0 < total; i0 += T) {
            float acc[MT][NT][4];
            bool okc[NT];
            const float* xr[NT];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const u32 t = nt * 8 + g, i = i0 + t;
                okc[nt] = t < (u32)T && i < total && row_ok(c, i / a.sub, a.gathered);
                xr[nt] = X + (u64)(okc[nt] ? i : 0) * a.k;
#pragma unroll
                for (int j = 0; j < MT; j++)
#pragma unroll
                    for (int r = 0; r < 4; r++) acc[j][nt][r] = 0.0f;
            }
            if (lone) {
                // Column g of the MMA is lane group g's activations: every group reads the row's (shared memory
                // broadcast), and only column 0 is kept; a column's sums never mix with another column's.
                const uint4* xb[NT] = {xs + (s0 * 4 + q) * 3};
                tc_steps_split<U, NT, MT, true>(acc, wm, s0, s1, xb);
            } else if (T >= 2) {
                // The rows' terms as linear_split_rows left them (xsplit): n-tile nt's lane (g, q) takes row
                // i0 + 8 nt + g (a row past the launch's rows reads row 0; columns from T on are never written).
                const uint4* xb[NT];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const u32 r = i0 + nt * 8 + g;
                    xb[nt] = xsplit + ((u64)(r < total ? r : 0) * steps + s0) * 12 + q * 3;
                }
                tc_steps_split<U, NT, MT, false>(acc, wm, s0, s1, xb);
            } else {
                // One row past TC_LONE_STEPS steps, or one of several rows in a tile of one:
                // batches of U steps, the batch's weight loads all in flight, then its MMAs; m-tile by m-tile.
#pragma unroll
                for (int j = 0; j < MT; j++) {
                    W ws = wm[j];
                    for (u32 st = s0; st < s1; st += U) {
                        typename W::template Batch<U> b;
                        ws.template load<U, false>(b, st, s1);
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            if (st + u >= s1) break;
                            uint4 w0, w1;
                            ws.frag(b, u, w0, w1);
                            const u32 kk = (st + u) * 32 + q * 8;
#pragma unroll
                            for (int nt = 0; nt < NT; nt++) {
                                float x[8];
                                if (okc[nt]) {
                                    load_x8_k(xr[nt], kk, a.k, xvec, x);
                                } else {
#pragma unroll
                                    for (int e = 0; e < 8; e++) x[e] = 0.0f;
                                }
                                tc_step(acc[j][nt], w0, w1, x);
                            }
                        }
                        ws.advance(U);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < MT; j++) {
                tc_acc_to_part<T, NT>(acc[j], part[warp], g, q);
                __syncthreads();
                store(a, part, nb0 + j * G * 16, i0, G, S, total);
                __syncthreads();
            }
        }
    }
}
// linear_tc_rows_w on the BF16 tiles at a.w.
template <int T, int U, int MT = 1, class Store>
DEV void linear_tc_rows(const FpLinear& a, u32 total, u32 block, u32 nblocks, const uint4* xsplit,
                        const Store& store) {
    linear_tc_rows_w<T, U, Store, TcBf16Tiles, MT>(a, total, block, nblocks, xsplit, store, TcBf16Tiles{});
}
