// Normalisations: rms_norm, gated_norm and the fused hyper-connection read hc_read. One block per row.
#include "common.cuh"

#define HC_MAX 16
#define HC_RANK_MAX 1024

// Zero-centred RMSNorm in groups of `group`: y = x * (1 / sqrt(mean(x^2) + eps)) * (1 + w). out may alias x.
extern "C" __global__ void rms_norm(const FpRmsNorm p) {
    __shared__ float sh[32];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float* x = fptr(p.x) + (u64)r * p.dim;
        float* y = fptr(p.out) + (u64)r * p.dim;
        for (u32 g0 = 0; g0 < p.dim; g0 += p.group) {
            float ss = 0.0f;
            for (u32 i = threadIdx.x; i < p.group; i += blockDim.x) ss += x[g0 + i] * x[g0 + i];
            ss = block_sum(ss, sh);
            const float inv = 1.0f / sqrtf(ss / (float)p.group + p.eps);
            for (u32 i = threadIdx.x; i < p.group; i += blockDim.x)
                y[g0 + i] = x[g0 + i] * inv * (p.w ? 1.0f + bfw(p.w, g0 + i) : 1.0f);
            __syncthreads();
        }
    }
}

// Per head of dim: y = w * (x * (1 / sqrt(mean(x^2) + eps))) * act(z); one warp per head.
extern "C" __global__ void gated_norm(const FpGatedNorm p) {
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        for (u32 h = warp; h < p.heads; h += nw) {
            const u64 base = ((u64)r * p.heads + h) * p.dim;
            const float* x = fptr(p.x) + base;
            const float* z = fptr(p.z) + base;
            float ss = 0.0f;
            for (u32 i = lane; i < p.dim; i += 32) ss += x[i] * x[i];
            ss = warp_sum(ss);
            const float inv = 1.0f / sqrtf(ss / (float)p.dim + p.eps);
            for (u32 i = lane; i < p.dim; i += 32) {
                const float g = p.act == 0 ? sigmoidf_(z[i]) : siluf_(z[i]);
                fptr(p.out)[base + i] = bfw(p.w, i) * (x[i] * inv) * g;
            }
        }
    }
}

// Hyper-connection read of one row: Hn = grouped RMSNorm(H, hc_norm) (recomputed from H where needed),
// lo = silu(W_down Hn / C), a[d] = mean_c sigmoid(W_up lo)[c*D+d] * Hn[c*D+d], inj[c] = 2 sigmoid(W_inj[c].Hn / C).
extern "C" __global__ void hc_read(const FpHcRead p) {
    __shared__ float sh[32];
    __shared__ float inv[HC_MAX];
    __shared__ float lo[HC_RANK_MAX];
    const FpCommon& c = p.c;
    const u32 nrows = p.gathered ? c.nstreams : c.nstreams * c.window;
    const u32 W = p.dim * p.hc;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 r = blockIdx.x; r < nrows; r += gridDim.x) {
        u32 s, j;
        if (p.gathered) {
            if (stream_of(c, r).rows == 0) continue;
        } else if (!real_row(c, r, s, j)) {
            continue;
        }
        const float* H = fptr(p.h) + (u64)r * W;
        for (u32 cc = 0; cc < p.hc; cc++) {
            float ss = 0.0f;
            for (u32 d = threadIdx.x; d < p.dim; d += blockDim.x) ss += H[cc * p.dim + d] * H[cc * p.dim + d];
            ss = block_sum(ss, sh);
            if (threadIdx.x == 0) inv[cc] = 1.0f / sqrtf(ss / (float)p.dim + p.eps);
        }
        __syncthreads();
        // lo: one warp per rank output, over Hn computed on the fly.
        for (u32 q = warp; q < p.rank; q += nw) {
            const bf16_t* wr = (const bf16_t*)p.down + (u64)q * W;
            float acc = 0.0f;
            for (u32 i = lane; i < W; i += 32) {
                const float hn = H[i] * inv[i / p.dim] * (1.0f + bfw(p.norm, i));
                acc += bf2f(wr[i]) * hn;
            }
            acc = warp_sum(acc);
            if (lane == 0) lo[q] = siluf_(acc / (float)p.hc);
        }
        __syncthreads();
        for (u32 d = threadIdx.x; d < p.dim; d += blockDim.x) {
            float a = 0.0f;
            for (u32 cc = 0; cc < p.hc; cc++) {
                const u32 i = cc * p.dim + d;
                const bf16_t* ur = (const bf16_t*)p.up + (u64)i * p.rank;
                float g = 0.0f;
                for (u32 q = 0; q < p.rank; q++) g += bf2f(ur[q]) * lo[q];
                const float hn = H[i] * inv[cc] * (1.0f + bfw(p.norm, i));
                a += sigmoidf_(g) * hn;
            }
            fptr(p.out)[(u64)r * p.dim + d] = a / (float)p.hc;
        }
        if (p.inject) {
            for (u32 cc = warp; cc < p.hc; cc += nw) {
                const bf16_t* wr = (const bf16_t*)p.inject + (u64)cc * W;
                float acc = 0.0f;
                for (u32 i = lane; i < W; i += 32) {
                    const float hn = H[i] * inv[i / p.dim] * (1.0f + bfw(p.norm, i));
                    acc += bf2f(wr[i]) * hn;
                }
                acc = warp_sum(acc);
                if (lane == 0) fptr(p.inj)[(u64)r * p.hc + cc] = 2.0f * sigmoidf_(acc / (float)p.hc);
            }
        }
        __syncthreads();
    }
}
