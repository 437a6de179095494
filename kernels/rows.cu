// Row movement and elementwise kernels: embed_streams, embed, gather_rows, last_rows, add_broadcast, hc_write,
// keep_count. One block per row (grid-stride; hc_write: one thread per element), so any grid size gives the same
// result.
#include "common.cuh"

// out[(r*copies + c)*dim + d] = table[tok[r]*dim + d] for real rows (embed: copies = 1).
DEV void embed_impl(const FpEmbed& p) {
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const u64 tok = token_of(c, r);
        block_store_row(fptr(p.out) + (u64)r * p.copies * p.dim, p.dim, p.copies, p.dim,
                        [&](u32 d) { return bfw(p.table, tok * p.dim + d); });
    }
}
extern "C" __global__ void embed_streams(const FpEmbed p) { pdl_start(); embed_impl(p); }
extern "C" __global__ void embed(const FpEmbed p) { pdl_start(); embed_impl(p); }

// out[s*w + j] = src[src_row(s) + j] (whole io buffer as the source).
extern "C" __global__ void gather_rows(const FpGatherRows p) {
    pdl_start();
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float* src = fptr(p.src) + ((u64)stream_of(c, s).src_row + j) * p.width;
        block_store_row(fptr(p.out) + (u64)r * p.width, p.width, 1, 0, [&](u32 i) { return src[i]; });
    }
}

// out[s] = x[s*window + rows(s) - 1].
extern "C" __global__ void last_rows(const FpLastRows p) {
    pdl_start();
    const FpCommon& c = p.c;
    for (u32 s = blockIdx.x; s < c.nstreams; s += gridDim.x) {
        const u32 rows = stream_of(c, s).rows;
        if (rows == 0) continue;
        const float* x = fptr(p.x) + ((u64)s * c.window + rows - 1) * p.width;
        block_store_row(fptr(p.out) + (u64)s * p.width, p.width, 1, 0, [&](u32 i) { return x[i]; });
    }
}

extern "C" __global__ void __launch_bounds__(1024) add_broadcast(const FpAddBroadcast p) {
    pdl_start();
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float *a = fptr(p.a) + (u64)r * p.width, *b = fptr(p.b) + (u64)r * p.b_width;
        block_store_row(fptr(p.out) + (u64)r * p.width, p.width, 1, 0, [&](u32 i) { return a[i] + b[i % p.b_width]; });
    }
}

// h[r, c*D + d] += inj[r, c] * y[r, d].
extern "C" __global__ void hc_write(const FpHcWrite p) {
    pdl_start();
    const FpCommon& c = p.c;
    const u64 W = (u64)p.dim * p.hc;
    const u64 n = (u64)c.nstreams * c.window * W;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const u32 r = (u32)(e / W), i = (u32)(e % W);
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const u32 cc = i / p.dim, d = i % p.dim;
        fptr(p.h)[e] = hc_write_value(fptr(p.h)[e], fptr(p.inj)[(u64)r * p.hc + cc], fptr(p.y)[(u64)r * p.dim + d]);
    }
}

// keep[s] = 1 + #leading j with tokens[s*w + j + 1] == sampled[s*w + j] over the real rows (0 without rows).
extern "C" __global__ void keep_count(const FpKeepCount p) {
    pdl_start();
    const FpCommon& c = p.c;
    for (u32 s = blockIdx.x * blockDim.x + threadIdx.x; s < c.nstreams; s += gridDim.x * blockDim.x) {
        const u32 rows = stream_of(c, s).rows;
        u32 k = 1;
        while (k < rows && token_of(c, s * c.window + k) == uptr(p.sampled)[s * c.window + k - 1]) k++;
        uptr(p.keep)[s] = rows == 0 ? 0 : k;
    }
}

// Benchmarks only (CudaBackend::read_floor): what a plain read of `bytes` from `src` costs as one graph node, the
// yardstick for a node that streams as many weight bytes. Every thread keeps 4 of its grid-stride 16-byte streaming
// loads (the weights' own load, ldg_stream16_l2pf) in flight and folds them by XOR; the one store depends on the
// fold, so no load can be dropped, and happens only when the fold equals `never`.
extern "C" __global__ void __launch_bounds__(256, 8) read_floor(const FpReadFloor p) {
    pdl_start();
    const uint4* s = (const uint4*)p.src;
    const u64 n = p.bytes / 16, stride = (u64)gridDim.x * blockDim.x;
    u32 fold = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = i + u * stride < n ? ldg_stream16_l2pf(s + i + u * stride) : zero4();
#pragma unroll
        for (int u = 0; u < 4; u++) fold ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (fold == p.never) uptr(p.out)[0] = fold;
}

// Brings the weights a later launch reads into L2 while the launches before it are bound by latency, not DRAM (the
// side launches of `launch::branch_prefetch`). Bulk prefetches (sm_90 `cp.async.bulk.prefetch.L2`) of up to
// L2_PREFETCH_CHUNK bytes, the chunks of all ranges spread over the grid's threads; nothing is read into registers
// or written, so it never changes a value: at worst the lines are evicted before their use.
extern "C" __global__ void l2_prefetch(const FpL2Prefetch p) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x, threads = (u64)gridDim.x * blockDim.x;
    u64 first = 0;  // the first chunk index of range r over all ranges
    for (u32 r = 0; r < p.n && r < L2_PREFETCH_RANGES; r++) {
        const u64 bytes = p.bytes[r] & ~(u64)15, chunks = (bytes + L2_PREFETCH_CHUNK - 1) / L2_PREFETCH_CHUNK;
        // This thread's chunks of range r: global indices t, t + threads, ... that fall in [first, first + chunks).
        u64 g = t >= first ? t : t + (first - t + threads - 1) / threads * threads;
        for (; g < first + chunks; g += threads) {
            const u64 off = (g - first) * L2_PREFETCH_CHUNK;
            const u64 len = bytes - off < L2_PREFETCH_CHUNK ? bytes - off : L2_PREFETCH_CHUNK;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p.ptr[r] + off), "r"((u32)len) : "memory");
        }
        first += chunks;
    }
}
