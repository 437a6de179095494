// GatedDeltaNet: gdn_conv (causal depthwise conv + SiLU), gdn_recur (recurrence over a window of more than one row
// from the slot's state, the state untouched), gdn_commit (replays the kept rows into the state with the same update,
// and shifts the conv state). All share gdn_update_q, so a committed state is bit-identical to plain decoding's.
// Windows of one row always keep their row: there gdn_conv shifts the conv state and gdn_recur_one runs the row's
// update and writes the state itself, and gdn_commit is not launched (one launch and one read of the state fewer per
// GDN layer).
#include "common.cuh"

#define GDN_MAX_DK 128

// out[j][ch] = silu(sum_t w[ch, t] * seq[j + t][ch]), seq = conv state (kernel-1 rows) then the window's rows.
// Windows of one row with a kernel of at most GDN_CONV_ONE taps take gdn_conv_one, wider windows gdn_conv_rows: the
// same sums in the same order.
#define GDN_CONV_ONE 8
// One row of stream s (window of one row): every tap's value and weight loaded first, then the output and the
// shifted conv state stored from registers (the loop below reloads the state after its stores: a memory latency
// per tap). The same products summed in the same tap order as the loop, so the same bits.
DEV void gdn_conv_one(const FpGdnConv& p, u32 s, u32 ch, float* state) {
    const u32 K1 = p.kernel - 1;
    float xs[GDN_CONV_ONE], ws[GDN_CONV_ONE];
#pragma unroll
    for (u32 t = 0; t < GDN_CONV_ONE; t++) {
        if (t >= p.kernel) break;
        xs[t] = t < K1 ? state[(u64)t * p.channels + ch] : fptr(p.x)[(u64)s * p.channels + ch];
        ws[t] = bfw(p.w, (u64)ch * p.kernel + t);
    }
    float acc = 0.0f;
#pragma unroll
    for (u32 t = 0; t < GDN_CONV_ONE; t++) {
        if (t >= p.kernel) break;
        acc += ws[t] * xs[t];
    }
    fptr(p.out)[(u64)s * p.channels + ch] = siluf_(acc);
#pragma unroll
    for (u32 i = 0; i + 1 < GDN_CONV_ONE; i++) {
        if (i >= K1) break;
        state[(u64)i * p.channels + ch] = xs[i + 1];
    }
}

// Rows of a window per batch of gdn_conv_rows: the batch's taps (kernel - 1 + GDN_CONV_ROWS values of the sequence)
// are all loaded before its first sum (loads interleaved with the stores to out paid a memory latency per row).
#define GDN_CONV_ROWS 8
// The rows of stream s in a window of more than one row, with a kernel of at most GDN_CONV_ONE taps: the same
// products summed in the same tap order as the loop of gdn_conv (w * x from 0.0f, t ascending), so the same bits.
DEV void gdn_conv_rows(const FpGdnConv& p, const FpCommon& c, u32 s, u32 rows, u32 ch, const float* state) {
    const u32 K1 = p.kernel - 1;
    float ws[GDN_CONV_ONE];
#pragma unroll
    for (u32 t = 0; t < GDN_CONV_ONE; t++) ws[t] = t < p.kernel ? bfw(p.w, (u64)ch * p.kernel + t) : 0.0f;
    for (u32 j0 = 0; j0 < rows; j0 += GDN_CONV_ROWS) {
        const u32 n = rows - j0 < GDN_CONV_ROWS ? rows - j0 : GDN_CONV_ROWS;
        float xs[GDN_CONV_ONE - 1 + GDN_CONV_ROWS];
#pragma unroll
        for (u32 i = 0; i < GDN_CONV_ONE - 1 + GDN_CONV_ROWS; i++) {
            const u32 idx = j0 + i;
            xs[i] = i >= K1 + n ? 0.0f
                    : idx < K1 ? state[(u64)idx * p.channels + ch]
                               : fptr(p.x)[((u64)s * c.window + idx - K1) * p.channels + ch];
        }
#pragma unroll
        for (u32 jj = 0; jj < GDN_CONV_ROWS; jj++) {
            if (jj >= n) break;
            float acc = 0.0f;
#pragma unroll
            for (u32 t = 0; t < GDN_CONV_ONE; t++) {
                if (t >= p.kernel) break;
                acc += ws[t] * xs[jj + t];
            }
            fptr(p.out)[((u64)s * c.window + j0 + jj) * p.channels + ch] = siluf_(acc);
        }
    }
}

// Channel ch of stream s (gdn_conv's thread).
DEV void gdn_conv_channel(const FpGdnConv& p, u32 s, u32 ch) {
    const FpCommon& c = p.c;
    const u32 K1 = p.kernel - 1;
    const FpStream& st = stream_of(c, s);
    const float* state = state_of(c, st.slot, p.state);
    if (p.kernel <= GDN_CONV_ONE) {
        // Padding streams (rows 0) write nothing.
        if (c.window == 1) {
            if (st.rows == 1) gdn_conv_one(p, s, ch, state_of(c, st.slot, p.state));
        } else {
            gdn_conv_rows(p, c, s, st.rows, ch, state);
        }
        return;
    }
    for (u32 j = 0; j < st.rows; j++) {
        float acc = 0.0f;
        for (u32 t = 0; t < p.kernel; t++) {
            const u32 i = j + t;
            const float x = i < K1 ? state[(u64)i * p.channels + ch]
                                   : fptr(p.x)[((u64)s * c.window + i - K1) * p.channels + ch];
            acc += bfw(p.w, (u64)ch * p.kernel + t) * x;
        }
        fptr(p.out)[((u64)s * c.window + j) * p.channels + ch] = siluf_(acc);
    }
    // Window of one row (kernels of more than GDN_CONV_ONE taps; gdn_conv_one above does the same): its row
    // is always kept (keep_count: keep = rows), so this thread shifts its channel's conv state here, exactly
    // as gdn_commit would with keep = 1 (gdn_commit is not launched for such variants:
    // `commit_in_window_one`, runtime/src/cuda/launch/gdn.rs). Padding streams (rows 0) write nothing.
    if (c.window == 1 && st.rows == 1) {
        float* cs = state_of(c, st.slot, p.state);
        for (u32 i = 0; i < K1; i++)
            cs[(u64)i * p.channels + ch] = i + 1 < K1 ? cs[(u64)(i + 1) * p.channels + ch]
                                                       : fptr(p.x)[(u64)s * c.window * p.channels + ch];
    }
}

// Thread per (stream, channel): channels over blockIdx.x, streams over blockIdx.y, so the streams' chains of loads
// and stores run side by side (a thread looping over the streams paid a memory latency per stream).
extern "C" __global__ void gdn_conv(const FpGdnConv p) {
    pdl_start();
    for (u32 s = blockIdx.y; s < p.c.nstreams; s += gridDim.y)
        for (u32 ch = blockIdx.x * blockDim.x + threadIdx.x; ch < p.channels; ch += gridDim.x * blockDim.x)
            gdn_conv_channel(p, s, ch);
}

// The recurrent state of a value head is [dk, dv]. Column e is held by 4 adjacent lanes, lane quarter q owning
// rows [q * GDN_QD, (q + 1) * GDN_QD) in registers. Sums over i: each lane's quarter in ascending i, then
// (q0 + q1) + (q2 + q3) by two xor shuffles (every lane of the four gets the same bits). Blocks: (32 columns, value
// head, stream) of 128 threads, a head's column tiles next to each other in launch order.
#define GDN_QD (GDN_MAX_DK / 4)

// Device layout of a value head's state (the CPU's is row-major [dk, dv]; runtime/src/cuda/gdn_layout.rs converts):
// tiles of 32 columns (the last one w = dv - 32 z wide), tile z at z * dk * 32. In a tile, with nq = dk / 32 quarters
// of 32 rows (nq = 1 when dk < 32), element (row, col) of quarter q = row / 32, i = row % 32 is float
// i % 4 of float4 ((i / 4) * w + col % 32) * nq + q: the lanes of a warp (8 columns x 4 quarters) read 512
// consecutive bytes with each float4 load, a lane's quarter is GDN_QD / 4 such loads, and a block's tile is one run of
// memory. Needs dk % 4 == 0 and dk <= 32 or dk % 32 == 0 (checked at launch) and 16-byte aligned heads (the plan's
// state pieces start at multiples of 4 elements). Returns the first float4 of the lane holding rows [i0, i0 + n) of
// column e; the next ones are `stride` apart.
DEV float4* gdn_state_at(float* head, u32 dk, u32 dv, u32 e, u32 i0, u32& stride) {
    const u32 z = e / 32, w = dv - 32 * z < 32 ? dv - 32 * z : 32, nq = dk >= 32 ? dk / 32 : 1;
    stride = w * nq;
    return (float4*)(head + (u64)z * dk * 32) + (e % 32) * nq + i0 / GDN_QD;
}
// Loads the lane's n rows (n % 4 == 0) from `at` (gdn_state_at), zeros past them; EARLY: before the wait on the
// previous kernel (ld_early_*, common.cuh).
template <bool EARLY> DEV void gdn_load_state(float (&S)[GDN_QD], const float4* at, u32 stride, u32 n) {
#pragma unroll
    for (u32 j = 0; j < GDN_QD / 4; j++) {
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (4 * j < n) x = EARLY ? ld_early_f32x4(at + (u64)j * stride) : at[(u64)j * stride];
        S[4 * j] = x.x;
        S[4 * j + 1] = x.y;
        S[4 * j + 2] = x.z;
        S[4 * j + 3] = x.w;
    }
}
DEV void gdn_store_state(float4* at, u32 stride, u32 n, const float (&S)[GDN_QD]) {
#pragma unroll
    for (u32 j = 0; j < GDN_QD / 4; j++)
        if (4 * j < n) at[(u64)j * stride] = make_float4(S[4 * j], S[4 * j + 1], S[4 * j + 2], S[4 * j + 3]);
}
DEV float quarter_sum(float a) {
    a += __shfl_xor_sync(FULL_MASK, a, 1);
    a += __shfl_xor_sync(FULL_MASK, a, 2);
    return a;
}
// S *= exp(g); kv = S^T k; S += k (beta (v - kv))^T -- for this lane's quarter of column e (k: the quarter's rows).
// Every lane of the warp must call it (shuffles); lanes without a column pass zeros.
DEV void gdn_update_q(float* S, const float* k, float v, float g, float beta, u32 n) {
    const float decay = expf(g);
#pragma unroll
    for (u32 i = 0; i < GDN_QD; i++)
        if (i < n) S[i] *= decay;
    float kv = 0.0f;
#pragma unroll
    for (u32 i = 0; i < GDN_QD; i++)
        if (i < n) kv += S[i] * k[i];
    kv = quarter_sum(kv);
    const float delta = (v - kv) * beta;
#pragma unroll
    for (u32 i = 0; i < GDN_QD; i++)
        if (i < n) S[i] += k[i] * delta;
}

// Rows per chunk of gdn_recur: the chunk's normalised q and k, v, g and beta are staged in shared memory first (every
// load of the chunk in flight at once), then the recurrence runs over them with no barrier and no global load.
#define GDN_CHUNK 16
// Staged rows per warp (the block's 4 warps share a chunk).
#define GDN_RPW (GDN_CHUNK / 4)
// Shared-memory index of element i of a staged q or k row: four floats of skew per 32, so a quarter's 32 values
// start 16-byte aligned (read as 8 float4) and the four quarters of a column read different banks.
DEV u32 gdn_sk(u32 i) { return i + 4 * (i >> 5); }
// The quarter of a staged row at `src` (gdn_sk(i0) of its row) into registers.
DEV void gdn_quarter(const float* src, float (&dst)[GDN_QD]) {
#pragma unroll
    for (u32 i = 0; i < GDN_QD / 4; i++) {
        const float4 v = ((const float4*)src)[i];
        dst[4 * i] = v.x;
        dst[4 * i + 1] = v.y;
        dst[4 * i + 2] = v.z;
        dst[4 * i + 3] = v.w;
    }
}

// What gdn_recur and gdn_recur_one set up alike: block (32 columns, value head h, stream s), the stream's slot and
// rows, the thread's column e (4 lanes a column) and quarter q of its rows (i0 .. i0 + n), the key head kh, the row
// widths of qkv (ch) and of the stash (sw), where the lane's state lies (gdn_state_at), and the head's constants.
struct GdnLane {
    u32 h, s, slot, rows, q, lane, warp, e, kh, ch, sw, i0, n, stride;
    bool own;  // e < dv
    float4* at;
    float scale, alog, dtb;
};
// Sets L and loads the lane's quarter of the state into S, before the wait on the previous kernel (the state and
// the descriptor through L2: ld_early_*, common.cuh); false, after the wait, for a block past the heads or streams
// (it returns: no early exit before the wait).
DEV bool gdn_lane(const FpGdnRecur& p, GdnLane& L, float (&S)[GDN_QD]) {
    const FpCommon& c = p.c;
    L.h = blockIdx.y;
    L.s = blockIdx.z;
    if (L.h >= p.hv || L.s >= c.nstreams) {
        pdl_start();
        return false;
    }
    stream_early(c, L.s, L.slot, L.rows);
    L.q = threadIdx.x & 3;
    L.lane = threadIdx.x & 31;
    L.warp = threadIdx.x >> 5;
    L.e = blockIdx.x * (blockDim.x / 4) + threadIdx.x / 4;
    L.own = L.e < p.dv;
    L.kh = L.h / (p.hv / p.hk);
    L.ch = 2 * p.hk * p.dk + p.hv * p.dv;
    L.sw = p.hk * p.dk + p.hv * p.dv + 2 * p.hv;
    L.i0 = L.q * GDN_QD;
    L.n = p.dk > L.i0 ? (p.dk - L.i0 < GDN_QD ? p.dk - L.i0 : GDN_QD) : 0;
    const u64 dkdv = (u64)p.dk * p.dv;
    L.at = gdn_state_at(state_of(c, L.slot, p.state) + L.h * dkdv, p.dk, p.dv, L.e, L.i0, L.stride);
    gdn_load_state<true>(S, L.at, L.stride, L.own ? L.n : 0);
    L.scale = 1.0f / sqrtf((float)p.dk);
    L.alog = -expf(bfw(p.a_log, L.h));
    L.dtb = bfw(p.dt_bias, L.h);
    return true;
}

// Windows of more than one row (one row: gdn_recur_one below, the same bits).
// Per row: l2-normalised q (scaled by 1/sqrt(dk)) and k of key head h / (hv/hk), beta = sigmoid(b),
// g = -exp(A_log) softplus(a + dt_bias), update, o = S^T q. Stash: k, v, g, beta. In chunks of GDN_CHUNK rows:
// first warp w stages rows w, w + 4, ... of the chunk, all their loads issued before any sum (each norm is the sum
// of 4 warp trees over elements 32 m + lane, added in m order from 0: block_sum's bits over the 128 threads of the
// block, thread i holding element i), then every thread runs the chunk's rows from shared memory.
extern "C" __global__ void gdn_recur(const FpGdnRecur p) {
    __shared__ __align__(16) float qs[GDN_CHUNK][GDN_MAX_DK + GDN_MAX_DK / 8];
    __shared__ __align__(16) float ks[GDN_CHUNK][GDN_MAX_DK + GDN_MAX_DK / 8];
    __shared__ float vs[GDN_CHUNK][32];
    __shared__ float gs[GDN_CHUNK];
    __shared__ float bs[GDN_CHUNK];
    GdnLane L;
    float S[GDN_QD];
    if (!gdn_lane(p, L, S)) return;
    const FpCommon& c = p.c;
    const u32 h = L.h, s = L.s, rows = L.rows, q = L.q, lane = L.lane, warp = L.warp, e = L.e, kh = L.kh;
    const u32 sw = L.sw, i0 = L.i0, n = L.n;
    const bool own = L.own, lead = blockIdx.x == 0;
    const float scale = L.scale, alog = L.alog, dtb = L.dtb;
    const u32 e0 = blockIdx.x * (blockDim.x / 4), ch = L.ch;
    // The state, the stream's slot and rows, and the weights above are loaded before the wait on the previous kernel
    // (programmatic dependent launch; the state and the descriptor through L2, `ld_early_*` in common.cuh, which
    // gives the rule): no kernel of the round writes them before this one (the state is written by gdn_commit at the
    // end of the round, or by gdn_recur_one in windows of one row, and the round descriptor by the host between
    // replays),
    // so their memory latency overlaps the previous kernel. The rows of the window (qkv, a, b) are read after the
    // wait.
    pdl_start();
    const u32 el = e0 + lane;
    for (u32 j0 = 0; j0 < rows; j0 += GDN_CHUNK) {
        const u32 nr = rows - j0 < GDN_CHUNK ? rows - j0 : GDN_CHUNK;
        float qv[GDN_RPW][GDN_MAX_DK / 32], kv[GDN_RPW][GDN_MAX_DK / 32], vv[GDN_RPW], bv[GDN_RPW], av[GDN_RPW];
#pragma unroll
        for (u32 t = 0; t < GDN_RPW; t++) {
            const u32 jj = warp + 4 * t;
            const u64 r = (u64)s * c.window + j0 + (jj < nr ? jj : 0);
            const float* row = fptr(p.qkv) + r * ch;
#pragma unroll
            for (u32 m = 0; m < GDN_MAX_DK / 32; m++) {
                const u32 i = 32 * m + lane;
                qv[t][m] = jj < nr && i < p.dk ? row[kh * p.dk + i] : 0.0f;
                kv[t][m] = jj < nr && i < p.dk ? row[p.hk * p.dk + kh * p.dk + i] : 0.0f;
            }
            vv[t] = jj < nr && el < p.dv ? row[2 * p.hk * p.dk + h * p.dv + el] : 0.0f;
            bv[t] = jj < nr ? fptr(p.b)[r * p.hv + h] : 0.0f;
            av[t] = jj < nr ? fptr(p.a)[r * p.hv + h] : 0.0f;
        }
#pragma unroll
        for (u32 t = 0; t < GDN_RPW; t++) {
            const u32 jj = warp + 4 * t;
            if (jj >= nr) break;
            const u64 r = (u64)s * c.window + j0 + jj;
            float* srow = fptr(p.stash) + r * sw;
            float tq = 0.0f, tk = 0.0f;
#pragma unroll
            for (u32 m = 0; m < GDN_MAX_DK / 32; m++) {
                tq += warp_sum(qv[t][m] * qv[t][m]);
                tk += warp_sum(kv[t][m] * kv[t][m]);
            }
            const float iq = 1.0f / sqrtf(tq + 1e-6f);
            const float ik = 1.0f / sqrtf(tk + 1e-6f);
#pragma unroll
            for (u32 m = 0; m < GDN_MAX_DK / 32; m++) {
                const u32 i = 32 * m + lane;
                if (i >= p.dk) continue;
                qs[jj][gdn_sk(i)] = qv[t][m] * iq * scale;
                ks[jj][gdn_sk(i)] = kv[t][m] * ik;
                if (lead && h % (p.hv / p.hk) == 0) srow[kh * p.dk + i] = kv[t][m] * ik;
            }
            vs[jj][lane] = vv[t];
            if (el < p.dv) srow[p.hk * p.dk + h * p.dv + el] = vv[t];
            const float beta = sigmoidf_(bv[t]);
            const float g = alog * softplusf_(av[t] + dtb);
            if (lane == 0) {
                gs[jj] = g;
                bs[jj] = beta;
                if (lead) {
                    srow[p.hk * p.dk + p.hv * p.dv + h] = g;
                    srow[p.hk * p.dk + p.hv * p.dv + p.hv + h] = beta;
                }
            }
        }
        __syncthreads();
        for (u32 jj = 0; jj < nr; jj++) {
            const u64 r = (u64)s * c.window + j0 + jj;
            const float v = own ? vs[jj][threadIdx.x / 4] : 0.0f;
            float kr[GDN_QD], qr[GDN_QD];
            gdn_quarter(&ks[jj][gdn_sk(i0)], kr);
            gdn_quarter(&qs[jj][gdn_sk(i0)], qr);
            gdn_update_q(S, kr, v, gs[jj], bs[jj], own ? n : 0);
            float o = 0.0f;
#pragma unroll
            for (u32 i = 0; i < GDN_QD; i++)
                if (own && i < n) o += S[i] * qr[i];
            o = quarter_sum(o);
            if (own && q == 0) fptr(p.out)[r * p.hv * p.dv + h * p.dv + e] = o;
        }
        __syncthreads();  // the next chunk overwrites the staged rows
    }
}

// Windows of one row, at every stream count: gdn_recur's update of its one row without the chunk staging, so the
// state's 32 registers are the only large array and 7 blocks fit an SM where gdn_recur fits 3 (more state loads in
// flight). Every warp loads the row's q and k and normalises them itself (the same warp trees as gdn_recur's staging
// warp) into its own shared copy, so a warp barrier stands where gdn_recur has two block barriers. The same sums in
// the same order as gdn_recur and gdn_commit: the same bits. Blocks and threads as gdn_recur's. The row is always
// kept, so the updated state is the committed one (gdn_commit's replay of the same update from the same state gives
// the same bits): written here, and gdn_commit is not launched. A padding stream (rows 0, on a live stream's slot)
// may read that slot's state while the live stream's block writes it; it uses nothing it read (no output, no stash,
// no write), so the race is harmless.
extern "C" __global__ void __launch_bounds__(128, 7) gdn_recur_one(const FpGdnRecur p) {
    __shared__ __align__(16) float qs[4][GDN_MAX_DK + GDN_MAX_DK / 8];
    __shared__ __align__(16) float ks[4][GDN_MAX_DK + GDN_MAX_DK / 8];
    GdnLane L;
    float S[GDN_QD];
    if (!gdn_lane(p, L, S)) return;
    const u32 h = L.h, s = L.s, rows = L.rows, q = L.q, lane = L.lane, warp = L.warp, e = L.e, kh = L.kh;
    const u32 ch = L.ch, sw = L.sw, i0 = L.i0, n = L.n;
    const bool own = L.own;
    const float scale = L.scale, alog = L.alog, dtb = L.dtb;
    // Loaded before the wait as in gdn_recur (its comment gives why that is sound); the row after it.
    pdl_start();
    if (rows == 0) return;
    const float* row = fptr(p.qkv) + (u64)s * ch;
    float qv[GDN_MAX_DK / 32], kv[GDN_MAX_DK / 32];
#pragma unroll
    for (u32 m = 0; m < GDN_MAX_DK / 32; m++) {
        const u32 i = 32 * m + lane;
        qv[m] = i < p.dk ? row[kh * p.dk + i] : 0.0f;
        kv[m] = i < p.dk ? row[p.hk * p.dk + kh * p.dk + i] : 0.0f;
    }
    const float v = own ? row[2 * p.hk * p.dk + h * p.dv + e] : 0.0f;
    const float bv = fptr(p.b)[(u64)s * p.hv + h];
    const float av = fptr(p.a)[(u64)s * p.hv + h];
    float tq = 0.0f, tk = 0.0f;
#pragma unroll
    for (u32 m = 0; m < GDN_MAX_DK / 32; m++) {
        tq += warp_sum(qv[m] * qv[m]);
        tk += warp_sum(kv[m] * kv[m]);
    }
    const float iq = 1.0f / sqrtf(tq + 1e-6f);
    const float ik = 1.0f / sqrtf(tk + 1e-6f);
    const bool lead = blockIdx.x == 0;
    float* srow = fptr(p.stash) + (u64)s * sw;
#pragma unroll
    for (u32 m = 0; m < GDN_MAX_DK / 32; m++) {
        const u32 i = 32 * m + lane;
        if (i >= p.dk) continue;
        qs[warp][gdn_sk(i)] = qv[m] * iq * scale;
        ks[warp][gdn_sk(i)] = kv[m] * ik;
        if (warp == 0 && lead && h % (p.hv / p.hk) == 0) srow[kh * p.dk + i] = kv[m] * ik;
    }
    const float beta = sigmoidf_(bv);
    const float g = alog * softplusf_(av + dtb);
    if (own && q == 0) srow[p.hk * p.dk + h * p.dv + e] = v;
    if (lead && threadIdx.x == 0) {
        srow[p.hk * p.dk + p.hv * p.dv + h] = g;
        srow[p.hk * p.dk + p.hv * p.dv + p.hv + h] = beta;
    }
    __syncwarp();
    gdn_update_q(S, &ks[warp][gdn_sk(i0)], v, g, beta, own ? n : 0);
    const float* qr = &qs[warp][gdn_sk(i0)];
    float o = 0.0f;
#pragma unroll
    for (u32 i = 0; i < GDN_QD; i++)
        if (own && i < n) o += S[i] * qr[i];
    o = quarter_sum(o);
    if (own && q == 0) fptr(p.out)[(u64)s * p.hv * p.dv + h * p.dv + e] = o;
    gdn_store_state(L.at, L.stride, own ? n : 0, S);
}

// Block (32 columns, h, s): replays the first keep rows' stashed (k, v, g, beta) into the slot state; the blocks of
// stream s also shift its conv state to the last kernel-1 raw rows ending at the last kept row.
extern "C" __global__ void gdn_commit(const FpGdnCommit p) {
    pdl_start();
    const FpCommon& c = p.c;
    const u32 h = blockIdx.y, s = blockIdx.z;
    if (h >= p.hv || s >= c.nstreams) return;
    const FpStream& st = stream_of(c, s);
    const u32 k = keep_of(c, p.keep, s);
    const u32 q = threadIdx.x & 3;
    const u32 e = blockIdx.x * (blockDim.x / 4) + threadIdx.x / 4;
    const bool own = e < p.dv;
    const u32 kh = h / (p.hv / p.hk);
    const u32 sw = p.hk * p.dk + p.hv * p.dv + 2 * p.hv;
    const u64 dkdv = (u64)p.dk * p.dv;
    const u32 i0 = q * GDN_QD, n = p.dk > i0 ? (p.dk - i0 < GDN_QD ? p.dk - i0 : GDN_QD) : 0;
    if (k > 0) {
        u32 stride;
        float4* at = gdn_state_at(state_of(c, st.slot, p.state) + h * dkdv, p.dk, p.dv, e, i0, stride);
        float S[GDN_QD];
        gdn_load_state<false>(S, at, stride, own ? n : 0);
        for (u32 j = 0; j < k; j++) {
            const float* srow = fptr(p.stash) + ((u64)s * c.window + j) * sw;
            const float g = srow[p.hk * p.dk + p.hv * p.dv + h];
            const float beta = srow[p.hk * p.dk + p.hv * p.dv + p.hv + h];
            const float v = own ? srow[p.hk * p.dk + h * p.dv + e] : 0.0f;
            gdn_update_q(S, srow + kh * p.dk + i0, v, g, beta, own ? n : 0);
        }
        gdn_store_state(at, stride, own ? n : 0, S);
    }
    // Nothing kept (a padding stream, rows 0): write nothing. Its slot may be a live stream's (the engine pads with
    // slot 0), whose blocks in this same launch shift that conv state; even a rewrite of the old values would race.
    if (blockIdx.x != 0 || k == 0) return;
    float* conv = state_of(c, st.slot, p.conv);
    const u32 K1 = p.kernel - 1;
    for (u32 chn = h * blockDim.x + threadIdx.x; chn < p.channels; chn += p.hv * blockDim.x) {
        for (u32 i = 0; i < K1; i++) {
            const u32 idx = k + i;
            conv[(u64)i * p.channels + chn] = idx < K1
                ? conv[(u64)idx * p.channels + chn]
                : fptr(p.raw)[((u64)s * c.window + idx - K1) * p.channels + chn];
        }
    }
}
