//! Hyper-connections (kernels/norm.cu, kernels/rows.cu): the read (`hc_norm`, the down and inject dots, the
//! gates on tensor cores and the mix), the write, and `FLASHPLAN_FUSE_SMALL`'s write that also normalizes for the
//! next read.

use super::linear::{split_grid, tc_features_per_block};
use super::*;

/// `hc_read`'s down/inject entry points per row tile, up to 4 rows (kernels/norm.cu).
const HC_READ: ByRows = &["hc_read_t1", "hc_read_t2", "hc_read_t4"];

/// `hc_read`'s down/inject launch (kernels/norm.cu): its entry point, outputs per block, tiles of rows over
/// `blockIdx.y`, and whether it leaves lo's BF16 terms itself (then no `hc_mix_split` follows). Up to 4 rows 2 outputs
/// per block ([`HC_READ`]); beyond, `hc_read_t4_wide` with 4 outputs per block in tiles of 4 rows, so each block reads
/// its rows of Hn for twice the outputs (H200, lone-w8 1977 -> 1931 us, lone-w16 2933 -> 2899 us; at 4 rows, one tile,
/// the halved grid was slower: 1496 -> 1507 us), or with `terms` (`FLASHPLAN_FUSE_SMALL`) `hc_read_t4_wide_terms`,
/// which also writes lo's terms where hc_mix_split would (kernels/norm.cu `hc_store_lo_terms`): one launch fewer. An
/// output's arithmetic is the same in every entry point (row invariance).
fn hc_read_launch(nrows: u32, terms: bool) -> (&'static str, u32, u32, bool) {
    if nrows > 4 {
        let read = if terms {
            "hc_read_t4_wide_terms"
        } else {
            "hc_read_t4_wide"
        };
        (read, 4, nrows.div_ceil(4), terms)
    } else {
        let (read, tiles) = by_row_tiles(HC_READ, nrows);
        (read, 2, tiles, false)
    }
}

/// `hc_mix_tc` entry points per row tile: the gates on tensor cores and the mix (kernels/norm.cu).
const HC_MIX_TC: ByRows = &[
    "hc_mix_tc_t1",
    "hc_mix_tc_t2",
    "hc_mix_tc_t4",
    "hc_mix_tc_t8",
    "hc_mix_tc_t16",
];

/// Slices of K (the rank) of `hc_mix_tc` (kernels/norm.cu), from the number of gates alone (so every row count
/// sums in the same order): the fewest of 1, 2, 4, 8 that give the launch at least 264 blocks (2 per SM of the
/// H200; a block is 8 / S m-tiles of 16 gates), else 8. Measured on the H200 with the real shape (10240 gates of
/// rank 320; lone-w1 / lone-w16 replay): 4 slices 1052 / 3142 us, 2 slices 1052 / 3143, 1 slice 1057 / 3178,
/// 8 slices 1092 / 3168.
pub(super) fn hc_mix_slices(gates: u32) -> u32 {
    const LEAST_BLOCKS: u32 = 264;
    [1, 2, 4, 8]
        .into_iter()
        .find(|&s| gates.div_ceil(16 * 8 / s) >= LEAST_BLOCKS)
        .unwrap_or(8)
}

/// Chunks of 8 down weights a lane of `hc_read_one_t*` holds (`HC_ONE_U`, kernels/norm.cu): the one batch of a
/// warp's slice of K = C*D (8 slices), up to 1280 values (the real width: 4 x 2560 = 10240).
pub(super) const HC_ONE_CHUNKS: u32 = 5;
/// `hc_read_one` entry points per row tile (kernels/norm.cu).
pub(super) const HC_READ_ONE: ByRows = &["hc_read_one_t1", "hc_read_one_t2", "hc_read_one_t4"];

/// Steps of 32 of the rank whose BF16 terms `hc_read_one_t*` keep in shared memory a row (`HC_ONE_STEPS`,
/// kernels/norm.cu).
pub(super) const HC_ONE_STEPS: u32 = 16;

/// The grid of `hc_read_one_t*` (kernels/norm.cu: the down and inject dots and the gates and mix of up to 4 rows in
/// one launch, joined by a grid barrier), or None where it does not apply: more than 4 rows (or none), a warp's
/// slice of the down longer than its one batch of [`HC_ONE_CHUNKS`] chunks a lane, a rank over [`HC_ONE_STEPS`]
/// steps of 32 or a slice of the gates over 3 of them, or a grid over `barrier_blocks`, the blocks the GPU holds at
/// once ([`Addrs::barrier_blocks`]). The grid covers both phases: an output pair a block for the down and inject,
/// `hc_mix_tc`'s blocks for the gates.
pub(super) fn hc_read_one_grid(
    nrows: u32,
    gates: u32,
    outs: u32,
    rank: u32,
    split: u32,
    barrier_blocks: u32,
) -> Option<u32> {
    let slice = gates.div_ceil(8 * 8) * 8;
    let steps = rank.div_ceil(32);
    let grid = outs
        .div_ceil(2)
        .max(gates.div_ceil(tc_features_per_block(split)));
    ((1..=4).contains(&nrows)
        && slice <= 256 * HC_ONE_CHUNKS
        && steps <= HC_ONE_STEPS
        && steps.div_ceil(split) <= 3
        && grid > 0
        && grid <= barrier_blocks)
        .then_some(grid)
}

/// Elements of one hyper-connection group that `hc_write_norm` holds per block of 256 threads (`HCN_PER` x 256,
/// kernels/norm.cu).
const HC_NORM_MOST_DIM: u32 = 16 * 256;

/// The `HcRead` node's launches: `hc_norm` (with `norm`; without it the previous `hc_write_norm` has written Hn),
/// then hc_read (down and inject dots, row tiles over `blockIdx.y` beyond 4 rows), then from two rows on
/// hc_mix_split (lo's BF16 terms) and hc_mix_tc (the gates on tensor cores and the mix: kernels/norm.cu). With
/// `FLASHPLAN_FUSE_SMALL`, up to 4 rows' hc_read, hc_mix_split and hc_mix_tc are one launch, `hc_read_one_t*`
/// ([`hc_read_one_grid`]), whose grid barrier counts in node `node`'s counter, and beyond 4 rows the down's launch
/// (`hc_read_t4_wide_terms`) leaves lo's BF16 terms in place of hc_mix_split: the same bits. H200 (2026-12-01, A/B
/// in one call, two passes): verify-s16-w1 2440.1 / 2442.8 -> 2427.0 / 2426.7 us, lone-w16 2285.9 / 2286.8 ->
/// 2267.8 / 2269.3 us.
pub(super) fn hc_read_spec(
    a: &Addrs,
    v: &Variant,
    node: usize,
    op: &Op,
    norm: bool,
) -> Result<LaunchSpec, BackendError> {
    let Op::HcRead {
        h,
        norm: norm_w,
        down,
        up,
        inject,
        out,
        dim,
        hc,
        rank,
        eps,
    } = op
    else {
        return Err(wrong_op("hc_read", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    if !crate::cuda::weights::hc_mix_on_tensor_cores(*hc) {
        return Err(BackendError::Device(format!(
            "hc_read: {hc} hyper-connections is not supported (1, 2, 4, 8 or 16: the gates' tiles of 16 rows hold \
             whole features)"
        )));
    }
    let gates = hc
        .checked_mul(*dim)
        .ok_or_else(|| BackendError::Device(format!("hc_read: {hc} x {dim} gates overflow u32")))?;
    let gathered = hc_read_gathered(v, op);
    let (inject, inj) = match inject {
        Some((w, b)) => (a.w(*w)?, a.buf(v, *b)),
        None => (0, 0),
    };
    let mut p = FpHcRead {
        c: a.common,
        h: a.buf(v, *h),
        norm: a.w(*norm_w)?,
        down: a.w(*down)?,
        up: a.w(*up)?,
        inject,
        inj,
        out: a.buf(v, *out),
        dim: *dim,
        hc: *hc,
        rank: *rank,
        gathered: gathered as u32,
        eps: *eps,
        split: hc_mix_slices(gates),
        barrier: 0,
    };
    let outs = *rank + if p.inject != 0 { *hc } else { 0 };
    let nrows = if gathered { streams } else { rows };
    let one = hc_read_one_grid(nrows, gates, outs, *rank, p.split, a.barrier_blocks)
        .filter(|_| a.fuse_small);
    if one.is_some() {
        p.barrier = node_counters(a, node);
    }
    let params = bytes(&p);
    // The read's first launch, after hc_norm when the read normalizes H itself.
    let first = |kernel, grid, block| {
        if norm {
            LaunchSpec::new("hc_norm", params, (nrows * *hc, 1, 1), 256)
                .then_grid(kernel, grid, block)
        } else {
            LaunchSpec::new(kernel, params, grid, block)
        }
    };
    if let Some(grid) = one {
        return Ok(first(
            by_rows(HC_READ_ONE, nrows),
            (grid, 1, 1),
            BARRIER_BLOCK,
        ));
    }
    let (read, npw, tiles, terms) = hc_read_launch(nrows, a.fuse_small);
    let spec = first(read, (outs.div_ceil(npw), tiles, 1), 256);
    let spec = if nrows >= 2 && !terms {
        spec.then("hc_mix_split", split_grid(nrows, *rank), 256)
    } else {
        spec
    };
    Ok(spec.then(
        by_rows(HC_MIX_TC, nrows),
        gates.div_ceil(tc_features_per_block(p.split)),
        256,
    ))
}

/// Whether an `HcRead` reads only each stream's last row (its `h` holds one row per stream).
pub(super) fn hc_read_gathered(v: &Variant, op: &Op) -> bool {
    let (streams, window) = v.kind.shape();
    match op {
        Op::HcRead { h, dim, hc, .. } => {
            v.buf(*h).elems < (streams * window) as u64 * (*dim as u64 * *hc as u64)
        }
        _ => false,
    }
}

/// The `HcWrite` node's launch: `hc_write` (thread per element), or with `norm` = (the next hc_read's `hc_norm`
/// weight address, its eps) `hc_write_norm` (block per (row, hyper-connection)), which also writes that read's Hn.
pub(super) fn hc_write_spec(
    a: &Addrs,
    v: &Variant,
    op: &Op,
    norm: Option<(u64, f32)>,
) -> Result<LaunchSpec, BackendError> {
    let Op::HcWrite { h, y, inj, dim, hc } = op else {
        return Err(wrong_op("hc_write", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let p = FpHcWrite {
        c: a.common,
        h: a.buf(v, *h),
        y: a.buf(v, *y),
        inj: a.buf(v, *inj),
        dim: *dim,
        hc: *hc,
        norm: norm.map_or(0, |n| n.0),
        eps: norm.map_or(0.0, |n| n.1),
        pad: 0,
    };
    Ok(match norm {
        Some(_) => LaunchSpec::new("hc_write_norm", bytes(&p), ((rows * *hc).max(1), 1, 1), 256),
        None => {
            let elems = rows as u64 * *dim as u64 * *hc as u64;
            LaunchSpec::new(
                "hc_write",
                bytes(&p),
                (elems.div_ceil(1024).clamp(1, 4096) as u32, 1, 1),
                256,
            )
        }
    })
}

/// `FLASHPLAN_FUSE_SMALL`: an `HcWrite` followed by the `HcRead` of the same `h` (same width, every row, groups of
/// at most `HC_NORM_MOST_DIM`) becomes `hc_write_norm` + the read without its `hc_norm` launch: one launch fewer,
/// the same bits (kernels/norm.cu `hc_norm_group` in both). Every layer's MoE read and the next layer's mixer read
/// follow a write; the first layer's and the PLE layer's do not. Likewise an `AddBroadcast` whose output the read
/// takes (groups of its `b_width`) becomes `add_broadcast_norm` (the MTP step's streams before its attention read).
pub(super) fn fuse_hc_norm(
    a: &Addrs,
    v: &Variant,
    out: &mut [Option<LaunchSpec>],
) -> Result<(), BackendError> {
    for i in 0..v.nodes.len().saturating_sub(1) {
        let (w, r) = (&v.nodes[i].op, &v.nodes[i + 1].op);
        let Op::HcRead {
            h: h2,
            dim: d2,
            hc: c2,
            norm,
            eps,
            ..
        } = r
        else {
            continue;
        };
        if *d2 > HC_NORM_MOST_DIM
            || hc_read_gathered(v, r)
            || out[i].is_none()
            || out[i + 1].is_none()
        {
            continue;
        }
        let norm = Some((a.w(*norm)?, *eps));
        let fused = match w {
            Op::HcWrite { h, dim, hc, .. } if h == h2 && dim == d2 && hc == c2 => {
                hc_write_spec(a, v, w, norm)?
            }
            Op::AddBroadcast {
                out: o,
                width,
                b_width,
                ..
            } if o == h2 && b_width == d2 && d2.checked_mul(*c2) == Some(*width) => {
                super::rows::add_broadcast_spec(a, v, w, norm)?
            }
            _ => continue,
        };
        out[i] = Some(fused);
        out[i + 1] = Some(hc_read_spec(a, v, i + 1, r, false)?);
    }
    Ok(())
}
