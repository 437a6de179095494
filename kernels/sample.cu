// Keyed sampling (rounds.md section 4), one block per sampled row: greedy (lowest-id maximum, NaN as -inf) or
// Gumbel-max over every id with u = uniform(seed, position, id) in f64 at temperature T. The top-k / top-p /
// min-p filters are not implemented on the device yet (the backend refuses such descriptors). probs: the sampled
// token's probability at temperature 1.
#include "common.cuh"

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

extern "C" __global__ void sample(const FpSample p) {
    __shared__ double shv[32];
    __shared__ u32 shi[32];
    const FpCommon& c = p.c;
    const u32 items = p.mode == 0 ? c.nstreams * c.window : c.nstreams;
    for (u32 it = blockIdx.x; it < items; it += gridDim.x) {
        u32 s, j, row;
        u64 position;
        if (p.mode == 0) {
            row = it;
            if (!real_row(c, it, s, j)) {
                if (threadIdx.x == 0) {
                    uptr(p.tokens)[it] = 0xffffffffu;
                    fptr(p.probs)[it] = 0.0f;
                }
                continue;
            }
            position = (u64)stream_of(c, s).pos + j + 1;
        } else {
            s = it;
            const FpStream& st = stream_of(c, s);
            if (st.rows == 0) {
                if (threadIdx.x == 0) {
                    uptr(p.tokens)[it] = 0xffffffffu;
                    fptr(p.probs)[it] = 0.0f;
                }
                continue;
            }
            if (p.mode == 1) {
                row = s * c.window + st.rows - 1;
                position = (u64)st.pos + st.rows;
            } else {
                row = s;
                position = (u64)st.pos + st.rows + 1;
            }
        }
        const FpStream& st = stream_of(c, s);
        const float* lg = fptr(p.logits) + (u64)row * p.vocab;
        // Greedy arg-max (also the fallback when the maximum is not finite).
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
        if (!(st.temperature == 0.0f || st.temperature != st.temperature || st.temperature < 0.0f) &&
            maxl < INFINITY && maxl > -INFINITY) {
            const double t = (double)st.temperature;
            double gb = -INFINITY;
            u32 gi = 0xffffffffu;
            for (u32 i = threadIdx.x; i < p.vocab; i += blockDim.x) {
                const float l = lg[i];
                if (l != l || l == -INFINITY) continue;
                const double u = uniform01(st.seed, position, i);
                const double sc = (double)l / t - log(-log(u));
                if (gi == 0xffffffffu || sc > gb) {
                    gb = sc;
                    gi = i;
                }
            }
            block_argmax(gb, gi, shv, shi);
            if (gi != 0xffffffffu) tok = gi;
        }
        // Probability of tok at temperature 1 (f64).
        double z = 0.0;
        if (maxl > -INFINITY && maxl < INFINITY)
            for (u32 i = threadIdx.x; i < p.vocab; i += blockDim.x) z += exp((double)keyf(lg[i]) - (double)maxl);
        z = block_sum_d(z, shv);
        if (threadIdx.x == 0) {
            uptr(p.tokens)[it] = tok;
            float pr = 0.0f;
            if (maxl > -INFINITY && maxl < INFINITY && tok < p.vocab)
                pr = (float)(exp((double)keyf(lg[tok]) - (double)maxl) / z);
            fptr(p.probs)[it] = pr;
        }
        __syncthreads();
    }
}
