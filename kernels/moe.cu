// Mixture of experts: router (f32 logits, softmax, top-k, renormalised), experts (routed SwiGLU experts summed in
// rank order), shared_expert (sigmoid-gated SwiGLU added to out). One block per row; the routed experts are
// chosen on the device, so one graph serves any routing.
#include "common.cuh"

#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_TOPK 32

extern "C" __global__ void router(const FpRouter p) {
    __shared__ float prob[MOE_MAX_EXPERTS];
    __shared__ u32 top[MOE_MAX_TOPK];
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float* x = fptr(p.x) + (u64)r * p.dim;
        for (u32 e = warp; e < p.experts; e += nw) {
            const float l = warp_dot((const bf16_t*)p.gate + (u64)e * p.dim, x, p.dim, lane);
            if (lane == 0) prob[e] = l;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float m = -INFINITY;
            for (u32 e = 0; e < p.experts; e++) m = fmaxf(m, prob[e]);
            float z = 0.0f;
            for (u32 e = 0; e < p.experts; e++) {
                prob[e] = expf(prob[e] - m);
                z += prob[e];
            }
            for (u32 e = 0; e < p.experts; e++) prob[e] = prob[e] / z;
            float sum = 0.0f;
            for (u32 t = 0; t < p.topk; t++) {
                u32 best = 0xffffffffu;
                for (u32 e = 0; e < p.experts; e++) {
                    bool taken = false;
                    for (u32 u = 0; u < t; u++) taken |= top[u] == e;
                    if (taken) continue;
                    if (best == 0xffffffffu || prob[e] > prob[best]) best = e;
                }
                top[t] = best;
                sum += prob[best];
            }
            for (u32 t = 0; t < p.topk; t++) {
                uptr(p.ids)[(u64)r * p.topk + t] = top[t];
                fptr(p.weights)[(u64)r * p.topk + t] = p.norm ? prob[top[t]] / sum : prob[top[t]];
            }
        }
        __syncthreads();
    }
}

// out[r] = sum over rank i (in order) of weights[r, i] * down_e(silu(gate_e x) * up_e x); hidden in scratch.
extern "C" __global__ void experts(const FpExperts p) {
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 D = p.dim, I = p.inter;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float* x = fptr(p.x) + (u64)r * D;
        float* hid = fptr(c.scratch) + (u64)r * p.topk * I;
        const u32* ids = uptr(p.ids) + (u64)r * p.topk;
        for (u32 w = warp; w < p.topk * I; w += nw) {
            const u32 i = w / I, q = w % I;
            const bf16_t* gu = (const bf16_t*)p.gate_up + (u64)ids[i] * 2 * I * D;
            const float g = warp_dot(gu + (u64)q * D, x, D, lane);
            const float u = warp_dot(gu + (u64)(I + q) * D, x, D, lane);
            if (lane == 0) hid[w] = siluf_(g) * u;
        }
        __syncthreads();
        for (u32 d = warp; d < D; d += nw) {
            float acc = 0.0f;
            for (u32 i = 0; i < p.topk; i++) {
                const bf16_t* dn = (const bf16_t*)p.down + (u64)ids[i] * D * I + (u64)d * I;
                const float t = warp_dot(dn, hid + (u64)i * I, I, lane);
                acc += fptr(p.weights)[(u64)r * p.topk + i] * t;
            }
            if (lane == 0) fptr(p.out)[(u64)r * D + d] = acc;
        }
        __syncthreads();
    }
}

// out[r] += sigmoid(scale . x) * down(silu(gate x) * up x); hidden in scratch [rows, inter].
extern "C" __global__ void shared_expert(const FpSharedExpert p) {
    __shared__ float sg;
    const FpCommon& c = p.c;
    const u32 R = c.nstreams * c.window;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 D = p.dim, I = p.inter;
    for (u32 r = blockIdx.x; r < R; r += gridDim.x) {
        u32 s, j;
        if (!real_row(c, r, s, j)) continue;
        const float* x = fptr(p.x) + (u64)r * D;
        float* hid = fptr(c.scratch) + (u64)r * I;
        for (u32 q = warp; q < I; q += nw) {
            const float g = warp_dot((const bf16_t*)p.gate + (u64)q * D, x, D, lane);
            const float u = warp_dot((const bf16_t*)p.up + (u64)q * D, x, D, lane);
            if (lane == 0) hid[q] = siluf_(g) * u;
        }
        if (warp == 0) {
            const float t = warp_dot((const bf16_t*)p.scale, x, D, lane);
            if (lane == 0) sg = sigmoidf_(t);
        }
        __syncthreads();
        for (u32 d = warp; d < D; d += nw) {
            const float t = warp_dot((const bf16_t*)p.down + (u64)d * I, hid, I, lane);
            if (lane == 0) fptr(p.out)[(u64)r * D + d] += sg * t;
        }
        __syncthreads();
    }
}
