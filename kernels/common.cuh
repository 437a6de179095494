// Device helpers shared by every kernel module. No libc or CUDA headers: NVRTC compiles these with no include
// path (bf16 is handled as raw 16-bit patterns: a bf16 value is the high half of an f32).
//
// Row invariance (rounds.md section 5): every value a row produces is computed by one thread, warp or block whose
// reduction order depends only on the launch's block size (fixed per kernel), never on how many rows the launch
// has; no atomics. Padding rows (j >= rows of their stream) are skipped: nothing is written for them. Padding
// streams (rows 0) write nothing either, not even their slot's state unchanged: the engine pads with slot 0, which
// may be a live stream's slot committed by other blocks of the same launch.
#pragma once
#include "params.h"

#define DEV __device__ __forceinline__
#define FULL_MASK 0xffffffffu

typedef unsigned short bf16_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Programmatic dependent launch (sm_90): every kernel starts with pdl_start(). It waits until the previous kernel
// has completed and its memory is visible, then lets the next kernel of the graph be scheduled (its blocks take free
// slots and wait in their own pdl_start). Waiting first keeps at most one kernel ahead: letting dependents launch
// before the wait let every later kernel's blocks fill the SMs while they waited (measured slower on the H200).
// Launched without the PDL attribute both are no-ops.
DEV void pdl_start() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// pdl_start() the first time a kernel that loads early (ld_early_* below) reaches its wait: `waited` is the
// kernel's flag, false at its start; every such kernel also calls this once at its end, for a block that had no
// row to wait for.
DEV void pdl_start_once(bool& waited) {
    if (!waited) {
        pdl_start();
        waited = true;
    }
}

// A load from L2, not L1 (ld.global.cg): values other blocks or earlier kernels wrote where this SM's L1 might
// still hold an older line (router_topk_block after the fences of the last-block count, and the early loads below).
DEV float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
DEV float4 ld_cg_f32x4(const float4* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
DEV u32 ld_cg_u32(const u32* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Loads for the code before griddepcontrol.wait (pdl_start) of data that changes between replays or rounds (round
// descriptors, recurrent state, the residual stream, earlier kernels' outputs) go through L2 only (ld_cg). The wait
// is what makes the earlier kernels' and the host's writes visible to this grid, so before it an SM's L1 might
// still hold a line from before them. (On the H200 the L1 form of these loads was not shown to read stale data:
// the one-row digest that changed with it changed from run to run with the L2 form too, from the benchmark's
// graphs of back-to-back copies of one node; L2 is the conservative choice.) Such a load needs the writer to have
// completed: every kernel of the graph's main stream lets its dependents launch only after its own wait, so every
// main-stream launch before the previous one has completed when this grid starts (side-branch launches forked and
// not yet joined may still run; they write only the side arena and side scratch). The launch test
// `what_a_kernel_reads_before_its_wait_is_not_written_by_the_kernel_before_it` checks that the previous launch does
// not write what a kernel reads early. A block that returns before its wait waits first (pdl_start): a block's exit
// counts as its trigger, so a grid whose blocks all returned early would let its dependents start before the
// previous kernel ends.
DEV float ld_early_f32(const float* p) { return ld_cg(p); }
DEV u32 ld_early_u32(const u32* p) { return ld_cg_u32(p); }
DEV float4 ld_early_f32x4(const float4* p) { return ld_cg_f32x4(p); }

// 16 bytes from global to shared memory without a register (sm_80 cp.async, through L2 only: `.cg`); both addresses
// 16-byte aligned. cp_async_commit closes the thread's group of copies; cp_async_wait_all waits for all of the
// thread's copies (a barrier after it makes them visible to the block).
DEV void cp_async16(float* smem, const float* g) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
DEV void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Capacity of stage_tile's shared copy, floats (40 KB): 4 rows of 2560 (the real width). runtime/src/cuda/launch
// `STAGE_TILE_MAX`.
#define STAGE_TILE_MAX 10240
// The block's copy of the n floats at X (a tile of activation rows) in shared memory xsh, which warp_dots then reads
// instead of X: the same values, so the same sums, while the tile crosses L2 once a block instead of once a warp.
// 16-byte copies through L2 (cp.async); a barrier before (the block's earlier readers of xsh are done) and after.
// X 16-byte aligned, n % 4 == 0 and n <= STAGE_TILE_MAX (runtime/src/cuda/launch `stage_fits` checks the first
// tile's address, the row width and the tile's size).
DEV void stage_tile(float* xsh, const float* X, u32 n) {
    __syncthreads();
    for (u32 q = threadIdx.x * 4; q < n; q += blockDim.x * 4) cp_async16(xsh + q, X + q);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
}

// Grid barrier of a launch whose blocks are all on the GPU at once (the launch checks that its grid fits; a block
// waiting here for one that cannot start would wait forever), on a u32 counter in device memory: every block adds
// 1 but block 0, which adds 2^31 - (blocks - 1), so the adds sum to 2^31 and bit 31 of the counter flips exactly when
// the last block arrives; each block waits for the flip from the value its own add saw. The counter needs no reset
// (its low bits are 0 again after every launch) and serves any grid size. Thread 0 orders the block's writes before
// its add and the other blocks' writes before the block's reads with `__threadfence()` on both sides (the pattern of
// cooperative groups' grid sync).
DEV u32 ld_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// The same barrier over a group of `blocks` blocks counting on one counter (`first`: one block of the group).
DEV void group_barrier(u32* counter, u32 blocks, bool first) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const u32 old = atomicAdd(counter, first ? 0x80000000u - (blocks - 1) : 1u);
        while (((old ^ ld_acquire_gpu(counter)) & 0x80000000u) == 0) {
        }
        __threadfence();
    }
    __syncthreads();
}
DEV void grid_barrier(u32* counter) {
    group_barrier(counter, gridDim.x * gridDim.y * gridDim.z, blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0);
}

DEV float bf2f(bf16_t h) { return __uint_as_float(((u32)h) << 16); }
DEV float bfw(const u64 w, u64 i) { return bf2f(((const bf16_t*)w)[i]); }

// v[u] = f(i0 + stride * u) for the indices below n, else pad: all U loads issued before any value is used (one
// memory latency for the batch, not one a value).
template <int U, class F>
DEV void load_strided(float (&v)[U], u32 i0, u32 stride, u32 n, float pad, F f) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const u32 i = i0 + stride * u;
        v[u] = i < n ? f(i) : pad;
    }
}

// dst[cp * stride + i] = f(i) for i < n and cp < copies, by the block: ROW_U values per thread are loaded before
// any is stored. The compiler cannot move a load above a store that might alias it, so a plain loop of load-then-
// store pays one memory latency per value; here it is one per ROW_U values (and the copies share the loads).
#define ROW_U 16
template <class F>
DEV void block_store_row(float* dst, u32 n, u32 copies, u64 stride, F f) {
    for (u32 i0 = threadIdx.x; i0 < n; i0 += blockDim.x * ROW_U) {
        float v[ROW_U];
        load_strided(v, i0, blockDim.x, n, 0.0f, f);
        for (u32 cp = 0; cp < copies; cp++)
#pragma unroll
            for (int u = 0; u < ROW_U; u++) {
                const u32 i = i0 + blockDim.x * u;
                if (i < n) dst[cp * stride + i] = v[u];
            }
    }
}

DEV const FpStream& stream_of(const FpCommon& c, u32 s) { return ((const FpStream*)c.streams)[s]; }
// Stream s's slot and row count, or row count alone, read before the wait (ld_early_u32).
DEV u32 stream_rows_early(const FpCommon& c, u32 s) { return ld_early_u32(&((const FpStream*)c.streams + s)->rows); }
// real_row's test of row r, from the descriptor read before the wait.
DEV bool real_row_early(const FpCommon& c, u32 r) { return r % c.window < stream_rows_early(c, r / c.window); }
DEV void stream_early(const FpCommon& c, u32 s, u32& slot, u32& rows) {
    slot = ld_early_u32(&((const FpStream*)c.streams + s)->slot);
    rows = stream_rows_early(c, s);
}
DEV u32 token_of(const FpCommon& c, u32 r) { return ((const u32*)c.tokens)[r]; }
DEV float* state_of(const FpCommon& c, u32 slot, u64 off) {
    return (float*)c.slots + (u64)slot * c.slot_elems + off;
}
DEV float* fptr(u64 p) { return (float*)p; }
DEV u32* uptr(u64 p) { return (u32*)p; }

// Row r of the variant (r = s * window + j) is real when j < rows(s).
DEV bool real_row(const FpCommon& c, u32 r, u32& s, u32& j) {
    s = r / c.window;
    j = r % c.window;
    return j < stream_of(c, s).rows;
}

// Keep count of stream s: the counted keep (capped at rows) or every real row.
DEV u32 keep_of(const FpCommon& c, u64 keep, u32 s) {
    u32 rows = stream_of(c, s).rows;
    if (keep == 0) return rows;
    u32 k = uptr(keep)[s];
    return k < rows ? k : rows;
}

DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
DEV float siluf_(float x) { return x / (1.0f + expf(-x)); }
DEV float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

DEV float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
DEV float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block in a fixed order (warp trees, then warps in order); every thread gets the result.
// `sh` holds at least 32 floats. The block size must be a multiple of 32.
DEV float block_sum(float v, float* sh) {
    v = warp_sum(v);
    const u32 w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (u32 i = 0; i < nw; i++) t += sh[i];
    return t;
}
DEV float block_max(float v, float* sh) {
    v = warp_max(v);
    const u32 w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    float t = sh[0];
    for (u32 i = 1; i < nw; i++) t = fmaxf(t, sh[i]);
    return t;
}
DEV double block_sum_d(double v, double* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    const u32 w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    double t = 0.0;
    for (u32 i = 0; i < nw; i++) t += sh[i];
    return t;
}

// Eight bf16 of a 16-byte load, in order.
DEV void unpack8(const uint4 v, float* f) {
    const u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(a[i] << 16);
        f[2 * i + 1] = __uint_as_float(a[i] & 0xffff0000u);
    }
}

// f32 dot by a warp (both operands f32).
DEV float warp_dot_f(const float* a, const float* b, u32 k, u32 lane) {
    float acc = 0.0f;
    for (u32 i = lane; i < k; i += 32) acc += a[i] * b[i];
    return warp_sum(acc);
}

// Rotate-half RoPE at `pos` over the first 2*half values of x (in place, by one warp; x in shared or global memory
// owned by this warp). cos/sin scaled by the attention factor.
DEV void rope_warp(float* x, const float* inv_freq, u32 half, u32 pos, float af, u32 lane) {
    for (u32 i = lane; i < half; i += 32) {
        const float f = (float)pos * inv_freq[i];
        const float cs = cosf(f) * af, sn = sinf(f) * af;
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cs - x2 * sn;
        x[i + half] = x2 * cs + x1 * sn;
    }
    __syncwarp();
}

// Zero-centred RMSNorm of one vector of n values by a warp: y = x * (1 / sqrt(mean(x^2) + eps)) * (1 + w).
DEV void rms_warp(const float* x, const u64 w, float* y, u32 n, float eps, u32 lane) {
    float ss = 0.0f;
    for (u32 i = lane; i < n; i += 32) ss += x[i] * x[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (u32 i = lane; i < n; i += 32) y[i] = x[i] * inv * (w ? 1.0f + bfw(w, i) : 1.0f);
    __syncwarp();
}

// rms_warp on values already in registers: xv[u] = x[lane + 32 u] for lane + 32 u < n (n <= 32 U). The same
// products, sums and order as rms_warp, so the same bits; every load (x by the caller, the norm weights here) is
// issued before the first store to y, where rms_warp's loop paid a memory latency a value.
template <int U>
DEV void rms_warp_reg(const float (&xv)[U], const u64 w, float* y, u32 n, float eps, u32 lane) {
    float wv[U];
    load_strided(wv, lane, 32, w ? n : 0, 0.0f, [&](u32 i) { return bfw(w, i); });
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (lane + 32 * u < n) ss += xv[u] * xv[u];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int u = 0; u < U; u++) {
        const u32 i = lane + 32 * u;
        if (i < n) y[i] = xv[u] * inv * (w ? 1.0f + wv[u] : 1.0f);
    }
    __syncwarp();
}

// QSA block key by one warp: RoPE(k_layernorm(mean of the block's `ratio` raw keys), b * ratio) into `key` (id).
DEV void block_key_warp(const float* raw, u32 b, u32 id, u32 ratio, u64 kn, float eps, const float* inv_freq,
                        u32 half, float af, float* key, u32 lane) {
    for (u32 i = lane; i < id; i += 32) {
        float m = 0.0f;
        for (u32 t = b * ratio; t < (b + 1) * ratio; t++) m += raw[(u64)t * id + i];
        key[i] = m / (float)ratio;
    }
    __syncwarp();
    rms_warp(key, kn, key, id, eps, lane);
    rope_warp(key, inv_freq, half, b * ratio, af, lane);
}

// Exclusive prefix sum over the block (fixed order); `sh` holds 33 u32. Every thread gets its offset and the total.
// indexer_select (attn.cu) and experts_order (moe.cu).
DEV u32 block_scan_u32(u32 v, u32* sh, u32& total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= (u32)o) x += y;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (u32 i = 0; i < nw; i++) {
            const u32 t = sh[i];
            sh[i] = acc;
            acc += t;
        }
        sh[32] = acc;
    }
    __syncthreads();
    total = sh[32];
    return sh[warp] + x - v;
}

// ---- Bandwidth helpers for decode-shaped matrix-vector work (linear, moe, hc_read) ----
// 16-byte streaming load of weights (read once per replay: no L1 allocation).
DEV uint4 ldg_stream16(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}
// The same with an L2 prefetch of the surrounding 256 bytes (rows read 64 bytes per warp load, the rest next).
DEV uint4 ldg_stream16_l2pf(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}
// 16-byte streaming loads issued where they stand in the program: volatile asm, and without .nc (ptxas moved the
// non-coherent loads of ldg_stream16 past griddepcontrol.wait to their first use, even as volatile asm), so they
// stay before a later wait (griddepcontrol.wait, a grid barrier). The same bytes as ldg_stream16 / _l2pf.
DEV uint4 ldg_stream16_now(const void* p) {
    uint4 r;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
DEV uint4 ldg_stream16_l2pf_now(const void* p) {
    uint4 r;
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
DEV uint4 zero4() {
    uint4 z;
    z.x = z.y = z.z = z.w = 0u;
    return z;
}
// Eight f32 activations (vector loads when `vec`: 16-byte aligned).
DEV void load_x8(const float* p, bool vec, float* x) {
    if (vec) {
        const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
        x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = p[e];
    }
}
// Fixed-order dot of 8: w0 x0, then fused multiply-adds in order (explicit fmaf: no contraction choices).
DEV float dot8(const float* w, const float* x) {
    float s = w[0] * x[0];
#pragma unroll
    for (int e = 1; e < 8; e++) s = fmaf(w[e], x[e], s);
    return s;
}
// The hyper-connection write of one element, h + inj * y as one fused multiply-add (hc_write, hc_write_norm).
DEV float hc_write_value(float h, float inj, float y) { return fmaf(inj, y, h); }
// Whether row r (or stream r when gathered) is real.
DEV bool row_ok(const FpCommon& c, u32 r, bool gathered) {
    if (gathered) return stream_of(c, r).rows > 0;
    u32 s, j;
    return real_row(c, r, s, j);
}

// Weight rows for warp_dots_rows: a row of BF16 weights. load(kk): the 8 weights at kk .. kk+7 as one raw chunk
// (a 16-byte streaming load); unpack: their f32 values in order; at(kk): one weight (scalar path); from(k): the
// row starting k weights later.
struct Bf16Row {
    const bf16_t* p;
    typedef uint4 raw_t;
    DEV raw_t load(u32 kk) const { return ldg_stream16(p + kk); }
    DEV static raw_t zero() { return zero4(); }
    DEV static void unpack(const raw_t& v, float* f) { unpack8(v, f); }
    DEV float at(u32 kk) const { return bf2f(p[kk]); }
    DEV Bf16Row from(u32 k) const {
        Bf16Row r;
        r.p = p + k;
        return r;
    }
};

// One batch of warp_dots_rows' vector path: chunk u at kk = kb + 256 u (those below K, u ascending) of NPW weight
// rows (wv, loaded by the caller), unpacked, then per real row t acc[m][t] += dot8 of them and the row's 8
// activations: xr[(u T + t) 2 ..] when given (loaded with the weights, PRE), else loaded here. Also hc_read_one's
// phase 1, with the weights it loaded before waiting on the previous kernel.
template <int T, int NPW, int U, class Row>
DEV void batch_dots(const typename Row::raw_t (&wv)[U][NPW], const float4* xr, const float* X, u64 xs, const bool* ok,
                    u32 K, u32 kb, bool xvec, float (&acc)[NPW][T]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const u32 kk = kb + u * 256;
        if (kk < K) {
            float f[NPW][8];
#pragma unroll
            for (int m = 0; m < NPW; m++) Row::unpack(wv[u][m], f[m]);
#pragma unroll
            for (int t = 0; t < T; t++) {
                if (!ok[t]) continue;
                float x[8];
                if (xr) {
                    const float4 a = xr[(u * T + t) * 2], b = xr[(u * T + t) * 2 + 1];
                    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
                    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
                } else {
                    load_x8(X + (u64)t * xs + kk, xvec, x);
                }
#pragma unroll
                for (int m = 0; m < NPW; m++) acc[m][t] += dot8(f[m], x);
            }
        }
    }
}

// res[m][t] = dot(w[m][0..K), X[t * xs ..][0..K)) for NPW weight rows (m < nm) and T activation rows (ok[t]), by
// one warp. Vector path (K % 8 == 0, rows aligned for their loads: `wvec`): lane l takes the chunks of 8 at
// l*8 + 256 j, U chunks of every weight row in flight at a time; per (m, t) the lane sums its chunks in ascending k
// (dot8 each), then a fixed warp tree. The arithmetic of one (m, t) never depends on T, NPW, U, nm or the other
// rows (row invariance), nor on the weight format beyond the values it decodes.
//
// PRE: also load the batch's activation chunks (U x T x 8 floats in registers) before any dot, as predicated loads
// after the weights', instead of each chunk's just before its dots (the compiler keeps those under the chunk's
// branch: one L1/L2 latency after another). Where the registers are free: launches of one block an SM, or few
// chunks in flight for many rows (moe.cu's routers keep U x T at most 10; norm.cu's hc_read_t4_wide has U = 1). The
// arithmetic is the same.
template <int T, int NPW, int U, class Row, bool PRE = false>
DEV void warp_dots_rows(const Row* w, u32 nm, const float* X, u64 xs, const bool* ok, u32 K, bool wvec, u32 lane,
                        float (&res)[NPW][T]) {
    float acc[NPW][T];
#pragma unroll
    for (int m = 0; m < NPW; m++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[m][t] = 0.0f;
    if (wvec) {
        const bool xvec = ((((u64)X) | (xs * 4)) & 15) == 0;
        for (u32 kb = lane * 8; kb < K; kb += 256 * U) {
            typename Row::raw_t wv[U][NPW];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int m = 0; m < NPW; m++) {
                    const u32 kk = kb + u * 256;
                    wv[u][m] = ((u32)m < nm && kk < K) ? w[m].load(kk) : Row::zero();
                }
            if constexpr (PRE) {
                if (xvec) {
                    float4 xr[U][T][2];
#pragma unroll
                    for (int u = 0; u < U; u++)
#pragma unroll
                        for (int t = 0; t < T; t++) {
                            const u32 kk = kb + u * 256;
                            const bool in = kk < K && ok[t];
                            const float4* xp = (const float4*)(X + (u64)t * xs + kk);
                            xr[u][t][0] = in ? xp[0] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                            xr[u][t][1] = in ? xp[1] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        }
                    batch_dots<T, NPW, U, Row>(wv, &xr[0][0][0], X, xs, ok, K, kb, xvec, acc);
                    continue;
                }
            }
            batch_dots<T, NPW, U, Row>(wv, nullptr, X, xs, ok, K, kb, xvec, acc);
        }
    } else {
        for (u32 kk = lane; kk < K; kk += 32) {
#pragma unroll
            for (int m = 0; m < NPW; m++) {
                if ((u32)m >= nm) continue;
                const float wv = w[m].at(kk);
#pragma unroll
                for (int t = 0; t < T; t++)
                    if (ok[t]) acc[m][t] = fmaf(wv, X[(u64)t * xs + kk], acc[m][t]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NPW; m++)
#pragma unroll
        for (int t = 0; t < T; t++) res[m][t] = warp_sum(acc[m][t]);
}
// warp_dots_rows over BF16 rows given by their first weights.
template <int T, int NPW, int U, bool PRE = false>
DEV void warp_dots(const bf16_t* const* w, u32 nm, const float* X, u64 xs, const bool* ok, u32 K, bool wvec,
                   u32 lane, float (&res)[NPW][T]) {
    Bf16Row r[NPW];
#pragma unroll
    for (int m = 0; m < NPW; m++) r[m].p = w[m];
    warp_dots_rows<T, NPW, U, Bf16Row, PRE>(r, nm, X, xs, ok, K, wvec, lane, res);
}

// Sum over the 8 lanes of a lane group (lanes 8g..8g+7), fixed tree; every lane of the group gets it.
DEV float group8_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 4);
    v += __shfl_xor_sync(FULL_MASK, v, 2);
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v;
}

// ---- Split-K over a block (linear, hc_read) ----
// A block of SPLIT_WARPS warps = G output groups x S slices of K (G = SPLIT_WARPS / S, S in 1, 2, 4, 8, chosen by
// the launch from K alone). Warp w takes group w / S and slice w % S: slice s covers [s * per, (s + 1) * per) with
// per = ceil(K / 8 / S) * 8 (cut at K), so the slices depend only on K and S. `slice_dots` leaves the warp's partial
// sums in part[w][m][t] (shared memory); `slice_sum` adds a group's S partials in slice order. With warp_dots'
// fixed per-(output, row) order this keeps a row's result independent of the other rows: row invariance.
#define SPLIT_WARPS 8
DEV void slice_bounds(u32 K, u32 S, u32 sl, u32& ka, u32& kb) {
    const u32 per = ((K + 7) / 8 + S - 1) / S * 8;
    ka = sl * per < K ? sl * per : K;
    kb = ka + per < K ? ka + per : K;
}
template <int T, int NPW, int U, class Row, bool PRE = false>
DEV void slice_dots_rows(const Row* w, u32 nm, const float* X, u64 xs, const bool* ok, u32 K, u32 S, bool wvec,
                         u32 lane, u32 warp, float (*part)[NPW][T]) {
    u32 ka, kb;
    slice_bounds(K, S, warp % S, ka, kb);
    Row ws[NPW];
#pragma unroll
    for (int m = 0; m < NPW; m++) ws[m] = w[m].from(ka);
    float res[NPW][T];
    warp_dots_rows<T, NPW, U, Row, PRE>(ws, nm, X + ka, xs, ok, kb - ka, wvec, lane, res);
    if (lane == 0)
#pragma unroll
        for (int m = 0; m < NPW; m++)
#pragma unroll
            for (int t = 0; t < T; t++) part[warp][m][t] = res[m][t];
}
// slice_dots_rows over BF16 rows given by their first weights.
template <int T, int NPW, int U, bool PRE = false>
DEV void slice_dots(const bf16_t* const* w, u32 nm, const float* X, u64 xs, const bool* ok, u32 K, u32 S, bool wvec,
                    u32 lane, u32 warp, float (*part)[NPW][T]) {
    Bf16Row r[NPW];
#pragma unroll
    for (int m = 0; m < NPW; m++) r[m].p = w[m];
    slice_dots_rows<T, NPW, U, Bf16Row, PRE>(r, nm, X, xs, ok, K, S, wvec, lane, warp, part);
}
template <int T, int NPW>
DEV float slice_sum(float (*part)[NPW][T], u32 g, u32 S, u32 m, u32 t) {
    float v = 0.0f;
    for (u32 s = 0; s < S; s++) v += part[g * S + s][m][t];
    return v;
}

// Block radix select: the k-th largest (1-based, k <= n) of n u32 keys read through key(i) (a larger key ranks
// first), four 8-bit digits from the top, each a shared-memory histogram of the keys sharing the digits chosen so
// far (integer counts: the result does not depend on the order of the atomics). thr: that key; need: how many keys
// equal to thr are within the top k. hist: 256 u32, res: 2 u32, both in shared memory. Every thread gets both.
template <class KeyF>
DEV void block_kth_largest(KeyF key, u32 n, u32 k, u32* hist, u32* res, u32& thr, u32& need) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 prefix = 0, mask = 0;
    need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (u32 b = threadIdx.x; b < n; b += blockDim.x) {
            const u32 x = key(b);
            if ((x & mask) == prefix) atomicAdd(&hist[(x >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l holds digits 255 - 8l .. 248 - 8l (descending); counts from the top, scanned over the lanes.
            u32 cnt[8], sum = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                cnt[i] = hist[255 - (lane * 8 + i)];
                sum += cnt[i];
            }
            u32 incl = sum;
            for (int o = 1; o < 32; o <<= 1) {
                const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= (u32)o) incl += y;
            }
            u32 acc = incl - sum;
            if (acc < need && need <= incl) {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if (acc + cnt[i] >= need) {
                        res[0] = prefix | ((255u - (lane * 8 + i)) << shift);
                        res[1] = need - acc;
                        break;
                    }
                    acc += cnt[i];
                }
            }
        }
        __syncthreads();
        prefix = res[0];
        need = res[1];
        mask |= 255u << shift;
        __syncthreads();
    }
    thr = prefix;
}
