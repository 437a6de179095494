//! Sampling and keep counting (kernels/sample.cu, kernels/rows.cu): the keyed sampler over vocabulary slices, then
//! per row; the count of kept drafts.

use flashplan_plan::SampleRows;

use super::*;

/// Vocabulary slices of `sample_part` (`SAMPLE_PARTS` in `kernels/sample.cu`).
pub(super) const SAMPLE_PARTS: u32 = 64;

/// Threads of a `sample_part` block (`SAMPLE_PART_THREADS`), and of `sample` and `sample_one` blocks.
const PART_THREADS: u32 = 256;
const ROW_THREADS: u32 = 1024;

/// Parameters and launches of a `Sample` or `KeepCount` node (`node`: its index, for its counters). A `Sample` of
/// up to [`NODE_COUNTERS`] items is one `sample_one` launch with `FLASHPLAN_FUSE_SMALL` (each item's last part block
/// runs `sample`'s phase 2, counting in the node's counter of the item), else `sample_part` then `sample`: the same
/// bits.
pub(super) fn spec(
    a: &Addrs,
    v: &Variant,
    node: usize,
    op: &Op,
) -> Result<LaunchSpec, BackendError> {
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let c = a.common;
    Ok(match op {
        Op::Sample {
            logits,
            tokens,
            probs,
            rows: which,
            vocab,
        } => {
            let (mode, items) = match which {
                SampleRows::All => (0, rows),
                SampleRows::Last => (1, streams),
                SampleRows::MtpGathered => (2, streams),
            };
            let one_launch = a.fuse_small && items <= NODE_COUNTERS;
            let p = FpSample {
                c,
                logits: a.buf(v, *logits),
                tokens: a.buf(v, *tokens),
                probs: a.buf(v, *probs),
                done: if one_launch {
                    node_counters(a, node)
                } else {
                    0
                },
                mode,
                vocab: *vocab,
            };
            if one_launch {
                LaunchSpec::new(
                    "sample_one",
                    bytes(&p),
                    (items, SAMPLE_PARTS, 1),
                    ROW_THREADS,
                )
            } else {
                LaunchSpec::new(
                    "sample_part",
                    bytes(&p),
                    (items, SAMPLE_PARTS, 1),
                    PART_THREADS,
                )
                .then("sample", items, ROW_THREADS)
            }
        }
        Op::KeepCount { sampled, keep } => {
            let p = FpKeepCount {
                c,
                sampled: a.buf(v, *sampled),
                keep: a.buf(v, *keep),
            };
            one("keep_count", bytes(&p), 1, 32)
        }
        _ => return Err(wrong_op("sample", op)),
    })
}
