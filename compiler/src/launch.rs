//! Launch shapes (grid, block, shared memory) of each kernel entry point for the CUDA backend. Decode-shaped
//! windows are memory-bound: a block owns a tile of output features for every row of the variant, so each weight
//! is read once per round.

use flashplan_plan::{Launch, Op};

const WARPS: u32 = 8;

fn l(grid: u32, block: u32) -> Launch {
    Launch {
        grid: [grid.max(1), 1, 1],
        block: [block, 1, 1],
        smem: 0,
    }
}

/// The launch shape of an op in a variant of `rows` rows and `streams` streams.
pub fn launch_for(op: &Op, rows: u32, streams: u32) -> Launch {
    match op {
        // One warp per output feature, all rows at once (weights read once).
        Op::Linear { n, .. } => l(n.div_ceil(WARPS), 32 * WARPS),
        Op::HcRead { rank, .. } => Launch {
            grid: [rows, 1, 1],
            block: [32 * WARPS, 1, 1],
            smem: rank * 4,
        },
        Op::GdnRecur { hv, .. } | Op::GdnCommit { hv, .. } => Launch {
            grid: [*hv, streams, 1],
            block: [128, 1, 1],
            smem: 0,
        },
        Op::GdnConv { channels, .. } => l(channels.div_ceil(256), 256),
        Op::Router { .. } | Op::Sample { .. } => l(rows, 1024),
        Op::Experts { topk, .. } => Launch {
            grid: [rows, *topk, 1],
            block: [32 * WARPS, 1, 1],
            smem: 0,
        },
        Op::SparseAttn { heads, .. } => Launch {
            grid: [rows, *heads, 1],
            block: [128, 1, 1],
            smem: 0,
        },
        Op::IndexerSelect { .. } => l(rows, 256),
        Op::KeepCount { .. } => l(1, 32),
        _ => l(rows, 256),
    }
}
