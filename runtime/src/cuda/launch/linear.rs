//! Linear layers: the BF16 tensor-core `linear` (kernels/linear.cuh) by row tile, its fused run of sibling
//! matrices (`linear_multi`), the row split that feeds them from two rows on, the MXFP8 `linear_mxfp8`
//! (kernels/mxfp8.cu), the one-wave grids.

use super::*;

/// The BF16 `linear` entry points per row tile (kernels/linear.cu).
const LINEAR: ByRows = &[
    "linear_t1",
    "linear_t2",
    "linear_t4",
    "linear_t8",
    "linear_t16",
];

/// Work items of `linear_split_rows` (kernels/linear.cuh) over `rows` rows of `k` inputs: one per (row, step of 32,
/// quarter of a step), each leaving 3 x 16 bytes ([`SPLIT_ITEM_ELEMS`] scratch elements).
pub(super) fn split_items(rows: u64, k: u32) -> u64 {
    rows * k.div_ceil(32) as u64 * 4
}

/// Scratch elements (4 bytes) one [`split_items`] item writes: three BF16x2 uint4 fragments.
pub(super) const SPLIT_ITEM_ELEMS: u64 = 12;

/// Blocks of 256 threads for `linear_split_rows` over `rows` rows of `k` inputs (a thread per item).
pub(super) fn split_grid(rows: u32, k: u32) -> u32 {
    (split_items(rows as u64, k).div_ceil(256) as u32).max(1)
}

/// Output features per block of `linear_tc_rows` with `split` slices of K and one m-tile a warp: 8 / split m-tiles of
/// 16.
pub(super) fn tc_features_per_block(split: u32) -> u32 {
    16 * (8 / split)
}

/// M-tiles of 16 features each warp of a linear launch takes (its block then holds as many times
/// [`tc_features_per_block`]), from the BF16 entry point `entry` ([`linear_entry`]) and whether the weight is held as
/// MXFP8: `LINEAR_MTILES` (kernels/params.h) for the one-row deep linear (`linear_t1_deep`, `linear_mxfp8_t1_deep`) and
/// for the BF16 tiles of 8 and 16 rows (`linear_t8`, `linear_t16` and their `linear_multi` twins through the same row
/// tile), else one (the other MXFP8 entry points keep one m-tile a warp). H200, lone-w16 (twentieth session): the
/// lm_head 389.8 -> 356.3 us, the 16-row linears 672 -> 601-603 us a replay; with the six MMAs of a step into one
/// accumulator (thirty-sixth session, A/B on one machine) also the 8-row tile (lone-w8 1565.4 / 1567.6 -> 1559.9 /
/// 1559.9 us) and the deep one-row lm_head (317.5 -> 307.1-307.4 us).
pub(super) fn tc_mtiles(entry: &str, mxfp8: bool) -> u32 {
    match entry {
        "linear_t1_deep" => LINEAR_MTILES as u32,
        "linear_t8" | "linear_t16" if !mxfp8 => LINEAR_MTILES as u32,
        _ => 1,
    }
}

/// Slices of K for the tensor-core linear (`linear_tc_rows` in `kernels/linear.cuh`), from the weight's shape
/// `[n, k]` alone (so every row count sums in the same order: row invariance). K runs in steps of 32 values; the
/// fewest of 1, 2, 4, 8 slices that leave each warp at most 40 steps and give the launch at least 528 blocks (4 per
/// SM of the H200; a block is 8 / S m-tiles of 16 features), else 8. Measured on the H200 (lone-w1): the 248k-row
/// lm_head is fastest with 2 slices (315 us against 347 with 8), the 10k-16k-row projections with 8 (156 us for a
/// replay's four fused runs against 163 with 2 and 189 with 4).
pub(crate) fn tc_split(k: u32, n: u32) -> u32 {
    const MOST_STEPS: u32 = 40;
    const LEAST_BLOCKS: u64 = 528;
    let steps = k.div_ceil(32);
    [1, 2, 4, 8]
        .into_iter()
        .find(|&s| {
            steps.div_ceil(s) <= MOST_STEPS
                && (n as u64).div_ceil(16 * 8 / s as u64) >= LEAST_BLOCKS
        })
        .unwrap_or(8)
}

/// `linear_mxfp8` entry points per row tile (kernels/mxfp8.cu: the BF16 linear's body decoding MXFP8 weights, with
/// `linear`'s launch shapes but one m-tile a warp at 8 and 16 rows: [`tc_mtiles`]).
const LINEAR_MXFP8: ByRows = &[
    "linear_mxfp8_t1",
    "linear_mxfp8_t2",
    "linear_mxfp8_t4",
    "linear_mxfp8_t8",
    "linear_mxfp8_t16",
];

/// The `linear_mxfp8` entry point standing for the BF16 `entry` of a launch of `total` rows: `linear_mxfp8_t1_deep`
/// for `linear_t1_deep`, else the same row tile.
pub(super) fn mxfp8_entry(entry: &str, total: u32) -> &'static str {
    if entry == "linear_t1_deep" {
        "linear_mxfp8_t1_deep"
    } else {
        by_rows(LINEAR_MXFP8, total)
    }
}

/// `linear_multi_mxfp8` entry points per row tile (kernels/mxfp8.cu: `linear_multi` over MXFP8 weights).
const LINEAR_MULTI_MXFP8: ByRows = &[
    "linear_multi_mxfp8_t1",
    "linear_multi_mxfp8_t2",
    "linear_multi_mxfp8_t4",
    "linear_multi_mxfp8_t8",
    "linear_multi_mxfp8_t16",
];

/// A `Linear` node's parameters and its launch's row count (sub-rows: `total`). Its output features per block are
/// [`tc_features_per_block`] times [`tc_mtiles`] of the entry point it runs in (kernels/linear.cuh `linear_tc_rows`:
/// a block of 8 warps = 8 / split groups of that many m-tiles of 16 features, each over `split` = [`tc_split`] slices
/// of K).
fn linear_params(a: &Addrs, v: &Variant, op: &Op) -> Result<(FpLinear, u32), BackendError> {
    let Op::Linear {
        x,
        w,
        out,
        k,
        n,
        sub,
        accumulate,
    } = op
    else {
        return Err(wrong_op("linear", op));
    };
    let (streams, window) = v.kind.shape();
    let gathered = fuse::linear_gathered(v, *x, *k, *sub);
    let p = FpLinear {
        c: a.common,
        x: a.buf(v, *x),
        w: a.w(*w)?,
        out: a.buf(v, *out),
        k: *k,
        n: *n,
        sub: *sub,
        accumulate: *accumulate as u32,
        gathered: gathered as u32,
        split: tc_split(*k, *n),
    };
    let total = if gathered { streams } else { streams * window } * *sub;
    Ok((p, total))
}

/// Blocks of `linear_t1`, `linear_t2`, `linear_multi_t1` and `linear_multi_t2` resident on one SM (their
/// `__launch_bounds__(256, 3)`), and of their MXFP8 twins (`linear_mxfp8_t1`, `_t2`, `linear_multi_mxfp8_t1`, `_t2`:
/// the same bounds).
pub(super) const LINEAR_T1_BLOCKS_PER_SM: u32 = 3;

/// Blocks of `linear_t1_deep` and `linear_mxfp8_t1_deep` resident on one SM (their `__launch_bounds__(256, 2)`).
pub(super) const LINEAR_T1_DEEP_BLOCKS_PER_SM: u32 = 2;

/// A grid of `blocks` cut to the blocks that fit on the GPU at once (`per_sm` on each of `sms` SMs), for kernels
/// whose blocks loop over their work (grid-stride), so the launch runs in one wave: no block waits for a slot and
/// no block repeats its set-up (a lone row's split into shared memory, the top of the first loads). Which block does
/// a piece of work never changes its arithmetic. `sms` = 0 (unknown) keeps the grid.
pub(super) fn one_wave(blocks: u32, per_sm: u32, sms: u32) -> u32 {
    if sms == 0 {
        blocks
    } else {
        blocks.min(per_sm * sms).max(1)
    }
}

/// Cuts the blocks of several matrices' shares of one grid to about `cap` in all, each share in proportion; returns
/// the new grid. Every share keeps at least one block, so shares of a block or two may take the sum a few blocks past
/// `cap` (a second wave of those few, never a wrong result). Unchanged when they fit.
pub(super) fn one_wave_shares(blocks: &mut [u32], cap: u32) -> u32 {
    let whole: u64 = blocks.iter().map(|&b| b as u64).sum();
    if whole > cap as u64 {
        for b in blocks.iter_mut() {
            *b = (*b as u64 * cap as u64 / whole).max(1) as u32;
        }
    }
    blocks.iter().sum()
}

/// Steps of 32 inputs per warp from which a one-row `linear` keeps 8 steps of loads in flight
/// (`linear_t1_deep`: two m-tiles a warp, 4 steps of each; two blocks an SM) instead of 4: the lm_head (2560 inputs
/// in 2 slices: 40 steps). H200 (one m-tile a warp, 8 steps, before the one accumulator): the lm_head at one row
/// 304.5 -> 300.7 us, lone-w1 954 -> 949 us; the GDN projections (10 steps a warp) and the output projections (24)
/// were slower with it (27.4 -> 29.3 us, 11.2 -> 11.7 us).
const DEEP_STEPS: u32 = 32;

/// The entry point of a `Linear` launch of `total` rows over `k` inputs in `split` slices: by row tile
/// ([`LINEAR`]), and for one row with at least [`DEEP_STEPS`] steps a warp, `linear_t1_deep`. The same
/// arithmetic either way (the steps in flight never change a value).
pub(super) fn linear_entry(total: u32, k: u32, split: u32) -> &'static str {
    if total == 1 && k.div_ceil(32).div_ceil(split.max(1)) >= DEEP_STEPS {
        "linear_t1_deep"
    } else {
        by_rows(LINEAR, total)
    }
}

/// `linear_multi` entry points per row tile (kernels/linear.cu).
const LINEAR_MULTI: ByRows = &[
    "linear_multi_t1",
    "linear_multi_t2",
    "linear_multi_t4",
    "linear_multi_t8",
    "linear_multi_t16",
];

/// One `linear_multi` launch for a run of sibling `Linear` nodes (`fuse::launch_groups`: same x, k and sub, weights
/// in the same form, outputs apart from x and from each other, at most `FP_MAX_LINEARS`), or `linear_multi_mxfp8`
/// where the weights are held as MXFP8. Matrix m gets `blocks[m]` = the grid of its own `linear` launch (at one or
/// two rows a proportional share of one wave: [`one_wave_shares`]); its blocks loop over its m-tiles, and the row
/// tile and split of K are those of every node of the run, so each output is bit-identical to the unfused launch.
/// Errors: no linears or more than `FP_MAX_LINEARS`, or linears that differ in x, k, split, rows or weight form.
pub(super) fn linear_multi(
    a: &Addrs,
    v: &Variant,
    ops: &[&Op],
) -> Result<LaunchSpec, BackendError> {
    if ops.is_empty() || ops.len() > FP_MAX_LINEARS {
        return Err(BackendError::Device(format!(
            "linear_multi: {} linears (1 ..= {FP_MAX_LINEARS})",
            ops.len()
        )));
    }
    let mut m = FpLinearMulti {
        count: ops.len() as u32,
        ..Default::default()
    };
    let (mut total, mut grid, mut mxfp8) = (0, 0, false);
    for (i, op) in ops.iter().enumerate() {
        let (p, t) = linear_params(a, v, op)?;
        let Op::Linear { w, .. } = op else {
            return Err(wrong_op("linear", op));
        };
        let mx = a.is_mxfp8(*w);
        // A run goes by row tile alone (never the deep one-row entry point).
        let per_block = tc_features_per_block(p.split) * tc_mtiles(by_rows(LINEAR, t), mx);
        if i > 0
            && (p.x != m.x
                || p.k != m.k
                || p.sub != m.sub
                || p.split != m.split
                || t != total
                || mx != mxfp8)
        {
            return Err(BackendError::Device(
                "linear_multi: the linears of a run differ in x, k, split of K, rows or weight form (BF16 or MXFP8)"
                    .into(),
            ));
        }
        mxfp8 = mx;
        (m.c, m.x, m.k, m.sub, m.gathered, m.split) = (p.c, p.x, p.k, p.sub, p.gathered, p.split);
        m.w[i] = p.w;
        m.out[i] = p.out;
        m.n[i] = p.n;
        m.accumulate[i] = p.accumulate;
        m.blocks[i] = p.n.div_ceil(per_block).max(1);
        grid += m.blocks[i];
        total = t;
    }
    // One or two rows: the grid in one wave (`one_wave`), each matrix keeping its share of the blocks (its blocks
    // loop over its m-tiles). H200, lone-w1: the GDN projections' launch (1030 blocks, 396 resident) 27.9 -> 25.8
    // us, `linear_multi_t1` 131.8 -> 121.9 us a replay; lone-w2 1100 -> 1092-1094 us.
    if total <= 2 {
        grid = one_wave_shares(
            &mut m.blocks[..ops.len()],
            one_wave(grid, LINEAR_T1_BLOCKS_PER_SM, a.sms),
        );
    }
    let entry = by_rows(
        if mxfp8 {
            LINEAR_MULTI_MXFP8
        } else {
            LINEAR_MULTI
        },
        total,
    );
    Ok(with_split(
        "linear_multi_split",
        entry,
        bytes(&m),
        total,
        m.k,
        grid,
    ))
}

/// The launch of a BF16 linear (`kernel`, grid of `grid` blocks) over `total` rows of x with `k` inputs: from two
/// rows on, `split` (`linear_split` or `linear_multi_split`, same parameters) first leaves the rows' BF16 terms in
/// the scratch ([`scratch_elems`]) for `linear_tc_rows` to read instead of splitting them at every step and m-tile.
pub(super) fn with_split(
    split: &'static str,
    kernel: &'static str,
    params: Vec<u8>,
    total: u32,
    k: u32,
    grid: u32,
) -> LaunchSpec {
    if total < 2 {
        return LaunchSpec::new(kernel, params, (grid.max(1), 1, 1), 256);
    }
    LaunchSpec::new(split, params, (split_grid(total, k), 1, 1), 256).then(kernel, grid, 256)
}

/// The grid of a `Linear` launch of `blocks` blocks (one per block of output features) over `total` rows, its BF16
/// entry point `entry` ([`linear_entry`]) and its weight held as MXFP8 or not, on `sms` SMs (0: unknown, the grid
/// kept). Which block computes a feature never changes its arithmetic.
pub(super) fn linear_grid(blocks: u32, total: u32, entry: &str, mxfp8: bool, sms: u32) -> u32 {
    let deep = entry == "linear_t1_deep";
    if total <= 2 && !deep {
        // As `linear_multi` at one or two rows: one wave.
        one_wave(blocks, LINEAR_T1_BLOCKS_PER_SM, sms)
    } else if deep && mxfp8 {
        // The drafting lm_head copy (`linear_mxfp8_t1_deep`) in one wave of 264 blocks, each looping over about 7
        // of the 1940 blocks' features (15 of 3880 with one m-tile a warp): a block's MXFP8 features are half the
        // bytes of BF16 ones, so its set-up (the row split into shared memory, the first loads) weighs twice as much.
        // H200, the `mxfp8-head` draft step (one m-tile a warp): 373.1 / 374.5 -> 358.0 / 357.3 us (two runs each).
        // The BF16 `linear_t1_deep` (the main model's lm_head) keeps every block (1940): in one wave it was slower
        // (300.8 -> 302.8 us, one m-tile a warp).
        one_wave(blocks, LINEAR_T1_DEEP_BLOCKS_PER_SM, sms)
    } else {
        blocks
    }
}

/// Parameters and launch of a `Linear` node: the BF16 `linear` entry point of its rows, or `linear_mxfp8`'s when its
/// weight is held as MXFP8 tiles (the same body, parameters, split of K and row split: bit-identical results on the
/// same values), its grid from [`linear_grid`] (one wave at one or two rows, and for `linear_mxfp8_t1_deep`), after
/// the row split from two rows on.
pub(super) fn spec(a: &Addrs, v: &Variant, op: &Op) -> Result<LaunchSpec, BackendError> {
    let Op::Linear { w, n, .. } = op else {
        return Err(wrong_op("linear", op));
    };
    let (p, total) = linear_params(a, v, op)?;
    let entry = linear_entry(total, p.k, p.split);
    let mxfp8 = a.is_mxfp8(*w);
    let per_block = tc_features_per_block(p.split) * tc_mtiles(entry, mxfp8);
    let grid = linear_grid(n.div_ceil(per_block), total, entry, mxfp8, a.sms);
    let entry = if mxfp8 {
        mxfp8_entry(entry, total)
    } else {
        entry
    };
    Ok(with_split(
        "linear_split",
        entry,
        bytes(&p),
        total,
        p.k,
        grid,
    ))
}
