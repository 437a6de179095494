//! L2 prefetches on a branch of the graph (`kernels/rows.cu` `l2_prefetch`). After a launch that streams many
//! weight bytes from DRAM come launches bound by latency (a one-row GDN layer: the conv, the recurrence and the
//! gated norm between `in_proj` and `out_proj`; the write and the read between `out_proj` and the router), and the
//! DRAM bus idles under them. A prefetch forked when the heavy launch completes brings the weights of the launches
//! that follow, up to the next heavy one, into L2, so those read them from L2. It reads nothing into registers and
//! writes nothing: no value can change, only where a weight's bytes come from. Only rounds of 8 to 16 rows get them
//! ([`prefetch_budget`]): at one and two rows the prefetch's bytes delayed the small launches more than L2 gave back.

use flashplan_plan::{Op, Variant, VariantKind};

use super::{bytes, Addrs, LaunchSpec};
use crate::backend::BackendError;
use crate::cuda::params::{FpL2Prefetch, L2_PREFETCH_CHUNK, L2_PREFETCH_RANGES};
use crate::cuda::weights::mxfp8_tile_bytes;

/// Fewest rows a verify round must have for its graph to get prefetches. On the H200 (docs/benchmarks.md, fourteenth
/// and fifteenth sessions) a 32 MB budget gained 0.8-1.1% in the lone windows of 8 and 16 rows and 0.9% in the round
/// of 16 one-row streams (8 streams: -0.4%, within the noise). At 4 rows it was mixed (lone-w4 -0.5% in the
/// fourteenth session, within the noise in the fifteenth; verify-s4-w1 +0.4%), and at one and two rows it cost 13-39
/// us: the launches between two heavy ones are latency bound there, and their own loads waited behind the prefetch's.
pub(crate) const PREFETCH_MIN_ROWS: u32 = 8;
/// Most rows of a verify round that gets prefetches: the widest measured.
pub(crate) const PREFETCH_MAX_ROWS: u32 = 16;
/// Bytes of weights one run of prefetches brings into L2 (of the 8, 16, 32 and 48 MB measured, 32 MB gained most at
/// 8 and 16 rows).
pub(crate) const PREFETCH_BUDGET: u64 = 32 << 20;

/// The prefetch budget of the graph of `kind` (`Addrs::prefetch_budget`): [`PREFETCH_BUDGET`] for the verify rounds
/// (lone or shared) of [`PREFETCH_MIN_ROWS`] to [`PREFETCH_MAX_ROWS`] rows, the shapes measured; else 0 (no prefetch
/// branch: prefill chunks and MTP steps were not measured with it).
pub(crate) fn prefetch_budget(kind: VariantKind) -> u64 {
    let (streams, window) = kind.shape();
    let round = matches!(kind, VariantKind::Lone { .. } | VariantKind::Verify { .. });
    if round && (PREFETCH_MIN_ROWS..=PREFETCH_MAX_ROWS).contains(&(streams * window)) {
        PREFETCH_BUDGET
    } else {
        0
    }
}

/// A launch reading at least this many weight bytes (or the routed experts, whose bytes depend on the routing) is
/// bound by DRAM bandwidth: the launches after it, up to the next such one, are prefetched when it completes.
const HEAVY_BYTES: u64 = 16 << 20;
/// Ranges under this many bytes are left out (a norm's weight: one block's loads, not worth a launch's chunk).
const MIN_RANGE_BYTES: u64 = 16 << 10;
/// Threads a block of `l2_prefetch`.
const PREFETCH_BLOCK: u32 = 64;

/// The device byte ranges (address, bytes) of the weights `op` reads in full: BF16 `numel * 2` bytes; MXFP8 its tiles
/// ([`mxfp8_tile_bytes`]). Embedding tables (a few rows of them are read) and the routed
/// experts (the routing picks which) have none.
fn weight_ranges(a: &Addrs, op: &Op) -> Result<Vec<(u64, u64)>, BackendError> {
    if matches!(
        op,
        Op::Embed { .. } | Op::EmbedStreams { .. } | Op::PleEmbed { .. } | Op::Experts { .. }
    ) {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for id in op.weights() {
        let e = &a.body.weights[id.0 as usize];
        let ptr = a.w(id)?;
        if a.is_mxfp8(id) {
            let (n, k) = (
                e.shape.first().copied().unwrap_or(1),
                e.shape.last().copied().unwrap_or(1),
            );
            out.push((ptr, mxfp8_tile_bytes(n, k)));
        } else {
            out.push((ptr, e.numel() * 2));
        }
    }
    Ok(out)
}

/// Adds `l2_prefetch` launches (`LaunchSpec::prefetch`) to the specs that follow a heavy launch ([`HEAVY_BYTES`]):
/// each brings the weights of the launches from there on, in launch order, into L2 until `a.prefetch_budget` bytes
/// (the heavy launch that closes the run is prefetched from its start as far as the budget goes). A spec's weights
/// are those of its node and of the nodes without a launch of their own up to the next spec (fused linears, and
/// the nodes that run on the side branch: the shared expert, counted with the experts; the PLE projections, counted
/// with the embedding, which they make heavy). This is the rule that was measured; it also fetches the forking
/// spec's own weights, which that launch is already reading (not measured without them).
pub(super) fn branch_prefetch(
    a: &Addrs,
    v: &Variant,
    out: &mut [Option<LaunchSpec>],
) -> Result<(), BackendError> {
    let at: Vec<usize> = (0..out.len()).filter(|&i| out[i].is_some()).collect();
    let mut per = Vec::with_capacity(at.len());
    for (k, &i) in at.iter().enumerate() {
        let end = at.get(k + 1).copied().unwrap_or(v.nodes.len());
        let mut ranges = Vec::new();
        let mut routed = false;
        for n in &v.nodes[i..end] {
            routed |= matches!(n.op, Op::Experts { .. });
            ranges.extend(weight_ranges(a, &n.op)?);
        }
        let heavy = routed || ranges.iter().map(|r| r.1).sum::<u64>() >= HEAVY_BYTES;
        per.push((ranges, heavy));
    }
    for k in 0..at.len().saturating_sub(1) {
        if !per[k].1 {
            continue;
        }
        let mut left = a.prefetch_budget;
        let mut list = Vec::new();
        for (ranges, heavy) in &per[k + 1..] {
            for &(p, b) in ranges {
                let take = b.min(left);
                if take >= MIN_RANGE_BYTES {
                    list.push((p, take));
                    left -= take;
                }
            }
            if *heavy || left < MIN_RANGE_BYTES {
                break;
            }
        }
        let Some(sp) = out[at[k + 1]].as_mut() else {
            continue;
        };
        for c in list.chunks(L2_PREFETCH_RANGES) {
            sp.prefetch.push(prefetch_spec(c));
        }
    }
    Ok(())
}

/// One `l2_prefetch` launch over up to [`L2_PREFETCH_RANGES`] ranges: a thread a chunk of
/// [`L2_PREFETCH_CHUNK`] bytes (blocks of [`PREFETCH_BLOCK`] threads).
fn prefetch_spec(ranges: &[(u64, u64)]) -> LaunchSpec {
    let mut p = FpL2Prefetch {
        n: ranges.len() as u32,
        ..Default::default()
    };
    for (i, &(ptr, b)) in ranges.iter().enumerate() {
        p.ptr[i] = ptr;
        p.bytes[i] = b;
    }
    let chunks: u64 = ranges
        .iter()
        .map(|r| r.1.div_ceil(L2_PREFETCH_CHUNK as u64))
        .sum();
    let grid = chunks.div_ceil(PREFETCH_BLOCK as u64).max(1) as u32;
    LaunchSpec::new("l2_prefetch", bytes(&p), (grid, 1, 1), PREFETCH_BLOCK)
}
