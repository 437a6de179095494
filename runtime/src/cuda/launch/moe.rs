//! Mixture of experts (kernels/moe.cu): the router with its top-k, the routed experts (gate/up, then down) and the
//! shared expert, which runs on the graph's side branch beside the router.

use super::linear::one_wave;
use super::*;

/// The router's logits entry points per row tile (kernels/moe.cu), where [`router_logits`] does not take
/// `router_s4`: up to 8 rows in one grid row with `FLASHPLAN_FUSE_SMALL`; beyond 8 rows, or without it, tiles of at
/// most 4 rows over the grid's y, whose last blocks do the top-k up to [`ROUTER_TILES_TOPK_ROWS`] rows with the
/// switch, else a top-k launch follows ([`topk_launch`]).
const ROUTER: ByRows = &["router_t1", "router_t2", "router_t4", "router_t8"];

/// The router's logits launch for `rows` rows: (entry point, tiles of rows over the grid's y, whether it is the
/// one-launch form whose single grid row does every row's top-k). `staged`: whether the activations' tile of 4 rows can
/// be staged ([`stage_fits`]). From 3 rows, where it can, `router_s4` in tiles of 4 (router_t4 with each tile staged in
/// shared memory once a block, the same logits); else [`ROUTER`]'s entry: one grid row up to [`ROUTER_ONE_LAUNCH_ROWS`]
/// with `FLASHPLAN_FUSE_SMALL`, tiles of at most 4 beyond. H200 (thirty-eighth session, A/B passes against router_t4 /
/// router_t8 from 3 rows, the same routing digests): lone-w4 1191.7 / 1191.7 -> 1186.7 / 1181.0 us, lone-w8 1565.9 /
/// 1566.2 -> 1535.2 / 1527.2 us, verify-s8-w1 1674.3 / 1677.5 -> 1647.3 / 1638.9 us; at 16 rows the routers 63.1 ->
/// 59.6 us a replay.
pub(super) fn router_logits(
    rows: u32,
    staged: bool,
    fuse_small: bool,
) -> (&'static str, u32, bool) {
    if rows >= 3 && staged {
        ("router_s4", rows.div_ceil(4), false)
    } else if fuse_small && rows <= ROUTER_ONE_LAUNCH_ROWS {
        (by_rows(ROUTER, rows), 1, true)
    } else {
        let (name, tiles) = by_row_tiles(ROUTER, rows);
        (name, tiles, false)
    }
}

/// The shared expert's gate/up entry points per row tile (kernels/moe.cu).
const SHARED_EXPERT: ByRows = &["shared_expert_t1", "shared_expert_t2", "shared_expert_t4"];

/// The shared expert's down entry points per row tile (kernels/moe.cu).
const SHARED_EXPERT_DOWN: ByRows = &[
    "shared_expert_down_t1",
    "shared_expert_down_t2",
    "shared_expert_down_t4",
];

/// Block size of `router_topk` (`ROUTER_TOPK_THREADS` in `kernels/moe.cu`: the softmax's block trees, which the
/// fused router's warp per row reproduces).
const ROUTER_TOPK_THREADS: u32 = 1024;

/// Most rows for which the router runs as one launch (`FLASHPLAN_FUSE_SMALL`, where [`router_logits`] does not take
/// `router_s4`: at 1-2 rows, or at any row count when 4 rows do not fit the staged tile): its last block's 8 warps do
/// the top-k of every row, one row per warp up to 8 rows. Measured on the H200: faster at one row (46 against 58 us
/// for the replay's four routers), slower at 16 rows (238 against 218 us, against `router_topk`'s block per row),
/// where a second top-k launch follows instead ([`topk_launch`]).
const ROUTER_ONE_LAUNCH_ROWS: u32 = 8;

/// Most rows for which the router in tiles of rows over the grid's y (`router_s4`, or beyond [`ROUTER_ONE_LAUNCH_ROWS`]
/// rows, with `FLASHPLAN_FUSE_SMALL`) does the top-k in each tile's last block to finish (a counter per tile, warp per
/// row), with no top-k launch after it; beyond, [`topk_launch`] follows (the same bits). H200 (thirty-second session,
/// A/B passes against `router_topk_w` after the logits): verify-s16-w1 2397.8 / 2395.5 -> 2388.8 / 2391.9 us, lone-w12
/// 1971.5 / 1970.4 -> 1954.5 / 1957.2 us, lone-w16 2246.0 / 2245.9 -> 2239.4 / 2245.0 us, the same routing digests; 16
/// rows in 2 tiles of 8 (`router_t8`) were slower (2412.4 / 2406.2 us at 16 streams). Not measured beyond 16 rows.
const ROUTER_TILES_TOPK_ROWS: u32 = 16;
const _: () = assert!(ROUTER_TILES_TOPK_ROWS.div_ceil(ROW_TILE_MAX) <= NODE_COUNTERS);
const _: () = assert!(ROUTER_ONE_LAUNCH_ROWS <= ROUTER_TILES_TOPK_ROWS);

/// Rows of `router_topk_w` per block of 256 threads (kernels/moe.cu: a warp per row).
const ROUTER_TOPK_W_ROWS: u32 = 8;

/// The top-k launch after the router's logits in tiles (beyond [`ROUTER_TILES_TOPK_ROWS`] rows, or without
/// `FLASHPLAN_FUSE_SMALL`): with the switch `router_topk_w`, a warp per row (the fused router's `router_topk_warp`,
/// [`ROUTER_TOPK_W_ROWS`] rows a block), else `router_topk`, a block of [`ROUTER_TOPK_THREADS`] per row; the same
/// bits. H200 (twenty-third session), 16 rows: the router's node 19.4-19.6 -> 16.0-16.2 us, lone-w12 2005.5 /
/// 2007.7 -> 1998.6 / 1996.4 us, verify-s16-w1 within the runs' spread (2446.0-2449.7 us both ways).
/// Returns (entry point, grid, block).
fn topk_launch(rows: u32, fuse_small: bool) -> (&'static str, u32, u32) {
    if fuse_small {
        ("router_topk_w", rows.div_ceil(ROUTER_TOPK_W_ROWS), 256)
    } else {
        ("router_topk", rows, ROUTER_TOPK_THREADS)
    }
}

/// Most routed experts per row (`MOE_MAX_TOPK` in `kernels/moe.cu`).
const MOE_MAX_TOPK: u32 = 32;

/// Router experts per block of 8 warps (kernels/moe.cu `router_t1` .. `router_t8`: a warp per expert).
const ROUTER_EXPERTS_PER_BLOCK: u32 = 8;

/// Blocks of `experts` (the gate/up) resident on one SM: 256 threads of 128 registers (what ptxas gives it; it has no
/// launch bound, and `__launch_bounds__(256, 2)` changed its code, unmeasured) fill half the register file. Were the
/// compiler to give it more, the grid would take two waves: slower, the same results.
pub(super) const EXPERTS_BLOCKS_PER_SM: u32 = 2;

/// The experts' down entry point for a launch of `rows` rows and the output features a warp of it takes
/// (kernels/moe.cu): four (`experts_down_f4`, each chunk of hid read once for four down rows) at 2 rows and from 16
/// rows on, else one (`experts_down`). Four cut the L2 traffic of hid but take 118 registers (two blocks an SM): at
/// one row its 640 warps leave SMs idle, at 4 and 8 rows its grid ends in a part-filled second or third wave.
/// H200, the build with `experts` at two pairs a warp, against one feature a warp everywhere: lone-w2 1089 -> 1065
/// us, lone-w16 2646 -> 2602 us; four features at 4 and 8 rows: lone-w4 1321 -> 1349 us, lone-w8 1747 -> 1756 us;
/// two features at 4 to 8 rows were slower still (1351, 1796 us); two features at one row: lone-w1 902 -> 920 us.
pub(super) fn down_features(rows: u32) -> (&'static str, u32) {
    if rows == 2 || rows >= 16 {
        ("experts_down_f4", 4)
    } else {
        ("experts_down", 1)
    }
}

/// The routed gate/up's entry point for a launch of `rows` rows (kernels/moe.cu; both a warp per two pairs of
/// features of a (row, rank), the same sums): `experts` (two chunks of each weight row in flight, two blocks an SM)
/// up to 4 rows, `experts_wide` (one chunk, three blocks an SM) from 5 on, where more warps in flight paid (H200,
/// A/B passes of 2026-12-03 against `experts`: lone-w5 1320 -> 1306 us, w6 1418 -> 1409, w7 1503 -> 1490, w8 1590
/// -> 1575, 8 streams 1698 -> 1685; twenty-eighth session: lone-w16 2256 -> 2242 us, 16 streams 2407 -> 2396 us).
/// At 4 rows and fewer `experts` stayed faster (lone-w4 1192 against 1196-1200 us, lone-w2 968 against 978).
/// `experts_wide` takes the round's slots in expert order, sorted by `experts_order` just before it (16 streams 2380
/// -> 2356 us, 8 streams 1676 -> 1668, lone-w16 2226 -> 2218: docs/benchmarks.md, thirty-fourth session).
pub(super) fn gate_up_entry(rows: u32) -> &'static str {
    if rows >= 5 {
        "experts_wide"
    } else {
        "experts"
    }
}

/// Blocks of `experts_one` a rank takes (`EO_BLOCKS` in kernels/moe.cu).
pub(super) const EXPERTS_ONE_BLOCKS: u32 = 40;
/// Largest intermediate size `experts_one` takes (`EO_MAX_INTER`: its shared memory).
pub(super) const EXPERTS_ONE_MAX_INTER: u32 = 2048;
// experts_one's barriers take one node counter per rank.
const _: () = assert!(MOE_MAX_TOPK <= NODE_COUNTERS);

/// The grid of `experts_one` for the experts of `p` over `rows` rows, when they run as `experts_one` +
/// `experts_combine`: with `fuse_small` (`FLASHPLAN_FUSE_SMALL`), one row, at least one rank, the vector paths of
/// `experts` and `experts_down` (dim and inter multiples of 8, 16-byte aligned weights), inter at most
/// [`EXPERTS_ONE_MAX_INTER`], and a grid ([`EXPERTS_ONE_BLOCKS`] blocks a rank) up to `resident`, the blocks the GPU
/// holds at once ([`Addrs::experts_one_blocks`]: its barriers wait for every block of a rank). `None`: `experts` +
/// `experts_down` run.
pub(super) fn experts_one_grid(
    p: &FpExperts,
    rows: u32,
    fuse_small: bool,
    resident: u32,
) -> Option<u32> {
    let blocks = p.topk * EXPERTS_ONE_BLOCKS;
    (fuse_small
        && rows == 1
        && p.topk > 0
        && p.dim.is_multiple_of(8)
        && p.inter.is_multiple_of(8)
        && p.inter <= EXPERTS_ONE_MAX_INTER
        && p.gate_up.is_multiple_of(16)
        && p.down.is_multiple_of(16)
        && blocks <= resident)
        .then_some(blocks)
}

/// The `Experts` node's launches (`node`: its index, for its counters): `experts` or `experts_wide` (the gate/up, warp
/// per two pairs of features of a (row, rank): [`gate_up_entry`]), then `experts_down` or `experts_down_f4` (warp per
/// (one or four output features, row): [`down_features`]); or at one row `experts_one` then `experts_combine`
/// ([`experts_one_grid`]). `shared`: 0, or the side branch's shared-expert gates, its down dots following, for the last
/// launch to add ([`branch_shared_experts`]).
pub(super) fn experts_spec(
    a: &Addrs,
    v: &Variant,
    node: usize,
    op: &Op,
    shared: u64,
) -> Result<LaunchSpec, BackendError> {
    let Op::Experts {
        x,
        ids,
        weights,
        gate_up,
        down,
        out,
        topk,
        dim,
        inter,
    } = op
    else {
        return Err(wrong_op("experts", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let p = FpExperts {
        c: a.common,
        x: a.buf(v, *x),
        ids: a.buf(v, *ids),
        weights: a.buf(v, *weights),
        gate_up: a.w(*gate_up)?,
        down: a.w(*down)?,
        out: a.buf(v, *out),
        topk: *topk,
        dim: *dim,
        inter: *inter,
        pad: 0,
        shared,
        barrier: node_counters(a, node),
    };
    if *topk > MOE_MAX_TOPK {
        return Err(BackendError::Device(format!(
            "experts: top-{topk} is not supported (at most {MOE_MAX_TOPK})"
        )));
    }
    if let Some(one_blocks) = experts_one_grid(&p, rows, a.fuse_small, a.experts_one_blocks) {
        // One row: the gate/up and down of every rank in one launch, then the sums.
        return Ok(
            LaunchSpec::new("experts_one", bytes(&p), (one_blocks, 1, 1), BARRIER_BLOCK).then(
                "experts_combine",
                dim.div_ceil(256),
                256,
            ),
        );
    }
    // A warp of `experts` takes two pairs of features of one (row, rank).
    let items = rows as u64 * *topk as u64 * inter.div_ceil(4) as u64;
    let mut grid = items.div_ceil(8) as u32;
    if rows == 1 {
        // One row: the gate/up in one wave (`one_wave`: at the real width 1600 warps, already one wave of the
        // 2112 resident on the H200; with one pair a warp 3200 were cut to one wave: lone-w1 `experts` 135.5 ->
        // 131.4 us a replay). From 2 rows on the full grid was faster (lone-w16 2796 -> 2817 us with one wave, one
        // pair a warp): rows routed to one expert then read its rows side by side.
        grid = one_wave(grid, EXPERTS_BLOCKS_PER_SM, a.sms);
    }
    let (down, feats) = down_features(rows);
    let down_grid = (rows * dim.div_ceil(feats)).div_ceil(8);
    let gate_up = gate_up_entry(rows);
    if gate_up == "experts_wide" {
        // experts_wide takes the slots in expert order: experts_order (one block of 1024 threads) sorts them first.
        return Ok(LaunchSpec::new("experts_order", bytes(&p), (1, 1, 1), 1024)
            .then(gate_up, grid, 256)
            .then(down, down_grid, 256));
    }
    Ok(LaunchSpec::new(gate_up, bytes(&p), (grid, 1, 1), 256).then(down, down_grid, 256))
}

/// The shared expert's gate/up and down entry points for `rows` rows and their tiles of rows over `blockIdx.y`: up to 4
/// rows tiles of at most 2 (`shared_expert_t1`, `_t2`: the `_t2` pair loads its activation chunks with its weights),
/// beyond, tiles of 4 (`_t4`). H200 (twentieth session), 4 rows in two tiles of 2 against one of 4 (3 rows take the
/// same tiles, not measured apart): lone-w4 1226.3 / 1230.2 -> 1214.2 / 1215.8 us, verify-s4-w1 1309.2 / 1314.7 ->
/// 1300.4 / 1300.4 us; at 2 rows `PRE` changed nothing measurable. From 5 rows on tiles of 2 were slower (lone-w16
/// 2358-2362 -> 2388 us: on the side branch, more blocks crowd the main chain's). The tiles of 4 are staged in shared
/// memory once a block (`shared_expert_s4`, `shared_expert_down_s4`) where `staged` (the caller's [`stage_fits`] of
/// x's and hid's tiles): H200 (thirty-eighth session, A/B passes), the shared experts at 16 rows 127.5 -> 100.1 us a
/// replay, verify-s16-w1 2314.7 / 2319.6 -> 2306.4 / 2315.6 us (with `router_s4`: 2302.0 / 2304.3 us). A row's sums
/// are `warp_dots`' whatever the tile.
pub(super) fn shared_expert_tiles(rows: u32, staged: bool) -> (&'static str, &'static str, u32) {
    let n = if rows <= 4 { 2 } else { SHARED_EXPERT.len() };
    let (gate_up, tiles) = by_row_tiles(&SHARED_EXPERT[..n], rows);
    let (down, _) = by_row_tiles(&SHARED_EXPERT_DOWN[..n], rows);
    if gate_up == "shared_expert_t4" && staged {
        return ("shared_expert_s4", "shared_expert_down_s4", tiles);
    }
    (gate_up, down, tiles)
}

/// The `SharedExpert` node's launches: the gate/up (warp per intermediate feature, row tiles over `blockIdx.y`),
/// then the down. `side`: the side branch's scratch, where the launches keep their down dots for `experts_down` or
/// `experts_combine` ([`branch_shared_experts`]); `None`: the node's own launches on the main stream, adding to `out`.
pub(super) fn shared_expert_spec(
    a: &Addrs,
    v: &Variant,
    op: &Op,
    side: Option<u64>,
) -> Result<LaunchSpec, BackendError> {
    let Op::SharedExpert {
        x,
        gate,
        up,
        down,
        scale,
        out,
        dim,
        inter,
    } = op
    else {
        return Err(wrong_op("shared_expert", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let mut c = a.common;
    if let Some(scratch) = side {
        c.scratch = scratch;
    }
    let p = FpSharedExpert {
        c,
        x: a.buf(v, *x),
        gate: a.w(*gate)?,
        up: a.w(*up)?,
        down: a.w(*down)?,
        scale: a.w(*scale)?,
        out: a.buf(v, *out),
        dim: *dim,
        inter: *inter,
        keep_dots: side.is_some() as u32,
        pad: 0,
    };
    // hid sits at the start of the scratch (kernels/moe.cu shared_t), rows of inter floats.
    let staged = stage_fits(*dim, p.x) && stage_fits(*inter, p.c.scratch);
    let (gate_up, down, tiles) = shared_expert_tiles(rows, staged);
    Ok(LaunchSpec::new(
        gate_up,
        bytes(&p),
        ((*inter + 1).div_ceil(8), tiles, 1),
        256,
    )
    .then_grid(down, (dim.div_ceil(16), tiles, 1), 256))
}

/// The shared expert on a side branch of the graph: wherever a `Router`, its `Experts` and a `SharedExpert` of the
/// same input and output follow each other, the shared expert's two launches fork onto the side stream at the
/// router's node (after the launch that wrote x), with their scratch in the side scratch, and leave their down dots
/// there (`keep_dots`); `experts_down` (or `experts_combine`) waits for them and adds them (`FpExperts::shared`:
/// `fmaf(sg, dot, routed)`, the fmaf `shared_expert_down` does in place otherwise, so the bits are the same). The
/// shared expert (latency bound at one row: 9.8 MB of weights at the real width) then runs while the router picks
/// the experts. The `SharedExpert` node gets no launch of its own.
pub(super) fn branch_shared_experts(
    a: &Addrs,
    v: &Variant,
    out: &mut [Option<LaunchSpec>],
) -> Result<(), BackendError> {
    for i in 0..v.nodes.len().saturating_sub(2) {
        let (
            Op::Router { x, ids, .. },
            experts @ Op::Experts {
                x: ex,
                ids: eids,
                out: eout,
                ..
            },
            shared @ Op::SharedExpert {
                x: sx, out: sout, ..
            },
        ) = (&v.nodes[i].op, &v.nodes[i + 1].op, &v.nodes[i + 2].op)
        else {
            continue;
        };
        if x != ex
            || x != sx
            || ids != eids
            || eout != sout
            || out[i..i + 3].iter().any(|s| s.is_none())
        {
            continue;
        }
        let side = shared_expert_spec(a, v, shared, Some(a.side_scratch))?;
        let (streams, window) = v.kind.shape();
        let Op::SharedExpert { inter, .. } = shared else {
            unreachable!("matched above")
        };
        let sg = a.side_scratch + 4 * streams as u64 * window as u64 * *inter as u64;
        let mut ex_spec = experts_spec(a, v, i + 1, experts, sg)?;
        ex_spec.join_before = Some(ex_spec.then.len());
        if let Some(r) = out[i].as_mut() {
            r.side.push(side);
        }
        out[i + 1] = Some(ex_spec);
        out[i + 2] = None;
    }
    Ok(())
}

/// Parameters and launches of a `Router` node (`node`: its index, for its counters): its logits ([`router_logits`]),
/// and the top-k in the one-launch form's last block (`FLASHPLAN_FUSE_SMALL`), in each row tile's last block up to
/// [`ROUTER_TILES_TOPK_ROWS`] rows, else in a second launch ([`topk_launch`]: `router_topk_w`, or
/// `router_topk` without the switch).
pub(super) fn router_spec(
    a: &Addrs,
    v: &Variant,
    node: usize,
    op: &Op,
) -> Result<LaunchSpec, BackendError> {
    let Op::Router {
        x,
        gate,
        ids,
        weights,
        experts,
        topk,
        dim,
        norm,
    } = op
    else {
        return Err(wrong_op("router", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    if *experts > 1024 || *topk > 32 || *topk == 0 || topk > experts {
        return Err(BackendError::Device(format!(
            "router: {experts} experts with top-{topk} is not supported (1 <= top-k <= 32, top-k <= experts <= \
             1024)"
        )));
    }
    // The top-k in the logits launch's last blocks (no top-k launch after it).
    let last_blocks_topk = a.fuse_small && rows <= ROUTER_TILES_TOPK_ROWS;
    let p = FpRouter {
        c: a.common,
        x: a.buf(v, *x),
        gate: a.w(*gate)?,
        ids: a.buf(v, *ids),
        weights: a.buf(v, *weights),
        done: if last_blocks_topk {
            node_counters(a, node)
        } else {
            0
        },
        experts: *experts,
        topk: *topk,
        dim: *dim,
        norm: *norm as u32,
    };
    let (logits, tiles, one_launch) = router_logits(rows, stage_fits(*dim, p.x), a.fuse_small);
    if one_launch {
        // The logits launch's last block does the top-k (warp per row; at one row all its warps), counting in the
        // node's counter (one grid row: the count is over gridDim.x blocks).
        return Ok(one(
            logits,
            bytes(&p),
            experts.div_ceil(ROUTER_EXPERTS_PER_BLOCK),
            256,
        ));
    }
    // Beyond, tiles of rows over the grid's y: up to ROUTER_TILES_TOPK_ROWS rows each tile's last block does its
    // rows' top-k (a counter per tile), else a top-k launch follows.
    let spec = LaunchSpec::new(
        logits,
        bytes(&p),
        (experts.div_ceil(ROUTER_EXPERTS_PER_BLOCK), tiles, 1),
        256,
    );
    if last_blocks_topk {
        return Ok(spec);
    }
    let (name, grid, block) = topk_launch(rows, a.fuse_small);
    Ok(spec.then(name, grid, block))
}
