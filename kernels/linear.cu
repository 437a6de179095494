// linear: out[i, n] (+)= sum_k x[i, k] * w[n, k] with BF16 weights on tensor cores; the body is linear.cuh's
// `linear_tc_rows`. One entry point per row tile T (linear_t1 .. linear_t16, picked by the launch from the row
// count): each gets the registers its tile needs.
#include "linear.cuh"

// The tensor-core body (linear.cuh `linear_tc_rows`): K in S = `tc_split(k, n)` slices (from the weight's shape) (runtime/src/cuda/launch/linear.rs),
// MT m-tiles of 16 features per warp, U steps of 32 weights of each in flight per lane: one m-tile and 4 steps, and
// LINEAR_MTILES (params.h: 2) m-tiles and 4 steps of each in linear_t1_deep and the tiles of 8 and 16 rows.
template <int T, int U = 4, int MT = 1>
DEV void linear_entry(const FpLinear& p, u32 block, u32 nblocks) {
    const u32 total = linear_total(p.c, p.sub, p.gathered);
    linear_tc_rows<T, U, MT>(p, total, block, nblocks, (const uint4*)p.c.scratch, LinearStore{});
}
extern "C" __global__ void __launch_bounds__(256, 3) linear_t1(const FpLinear p) { pdl_start(); linear_entry<1>(p, blockIdx.x, gridDim.x); }
// One row with many steps a warp (the lm_head: runtime/src/cuda/launch/linear.rs `linear_entry`): LINEAR_MTILES
// m-tiles a warp, 4 steps of each in flight (8 steps of loads, as many independent MMA chains as m-tiles: each m-tile's
// step is six dependent MMAs into one accumulator), two blocks an SM (102 registers); the same arithmetic as
// linear_t1. H200, 2026-12-04 (A/B, one machine), one m-tile and 8 steps against two and 4: the one-row lm_head
// 317.5 -> 307.1-307.4 us.
extern "C" __global__ void __launch_bounds__(256, 2) linear_t1_deep(const FpLinear p) { pdl_start(); linear_entry<1, 4, LINEAR_MTILES>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void __launch_bounds__(256, 3) linear_t2(const FpLinear p) { pdl_start(); linear_entry<2>(p, blockIdx.x, gridDim.x); }
extern "C" __global__ void linear_t4(const FpLinear p) { pdl_start(); linear_entry<4>(p, blockIdx.x, gridDim.x); }
// 8 and 16 rows: LINEAR_MTILES (params.h) m-tiles a warp (each step's split terms, 96 bytes a lane for 32 bytes of
// weights with one m-tile, read once for both), 4 steps of each in flight; at 16 rows two blocks an SM (both entry
// points in 128 registers under their launch bounds; at 8 rows 100 and 78 unbounded). With 2 steps in flight (before
// the terms shared one accumulator: tc_step_split) the 16-row lm_head took 355 us against 335 now (H200, 2026-12-04);
// the 8-row tile with one m-tile against two, the deep one-row linear with two in both: lone-w8 1565.4 / 1567.6 ->
// 1559.9 / 1559.9 us (H200, 2026-12-04, A/B on one machine).
#define LINEAR_T8 8, 4, LINEAR_MTILES
extern "C" __global__ void linear_t8(const FpLinear p) { pdl_start(); linear_entry<LINEAR_T8>(p, blockIdx.x, gridDim.x); }
#define LINEAR_T16 16, 4, LINEAR_MTILES
extern "C" __global__ void __launch_bounds__(256, 2) linear_t16(const FpLinear p) { pdl_start(); linear_entry<LINEAR_T16>(p, blockIdx.x, gridDim.x); }

// linear_split, linear_multi_split: the rows' BF16 terms into the scratch (linear.cuh `linear_split_rows`), the
// first launch of a linear node of two rows or more (runtime/src/cuda/launch/linear.rs).
extern "C" __global__ void linear_split(const FpLinear p) {
    pdl_start();
    linear_split_rows(p.c, p.x, p.k, linear_total(p.c, p.sub, p.gathered), p.sub, p.gathered, (uint4*)p.c.scratch);
}
extern "C" __global__ void linear_multi_split(const FpLinearMulti p) {
    pdl_start();
    linear_split_rows(p.c, p.x, p.k, linear_total(p.c, p.sub, p.gathered), p.sub, p.gathered, (uint4*)p.c.scratch);
}

// linear_multi: up to FP_MAX_LINEARS sibling `linear`s reading the same x, one launch (the runtime fuses consecutive
// Linear nodes, runtime/src/cuda/fuse.rs): block b runs `linear_entry` on its matrix's parameters (linear.cuh
// `linear_multi_part`), so every output element is computed with exactly the arithmetic of the unfused `linear`
// launch: bit-identical results, and row invariance as `linear`'s.
template <int T, int U = 4, int MT = 1>
DEV void linear_multi_entry(const FpLinearMulti& p) {
    FpLinear q;
    u32 b, nblocks;
    if (linear_multi_part(p, q, b, nblocks)) linear_entry<T, U, MT>(q, b, nblocks);
}
extern "C" __global__ void __launch_bounds__(256, 3) linear_multi_t1(const FpLinearMulti p) { pdl_start(); linear_multi_entry<1>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) linear_multi_t2(const FpLinearMulti p) { pdl_start(); linear_multi_entry<2>(p); }
extern "C" __global__ void linear_multi_t4(const FpLinearMulti p) { pdl_start(); linear_multi_entry<4>(p); }
extern "C" __global__ void linear_multi_t8(const FpLinearMulti p) { pdl_start(); linear_multi_entry<LINEAR_T8>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) linear_multi_t16(const FpLinearMulti p) { pdl_start(); linear_multi_entry<LINEAR_T16>(p); }
