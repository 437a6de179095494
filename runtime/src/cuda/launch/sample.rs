//! Sampling and keep counting (kernels/sample.cu, kernels/rows.cu): the keyed sampler over vocabulary slices, then
//! per row; the count of kept drafts.

use flashplan_plan::SampleRows;

use super::*;

/// Vocabulary slices of `sample_part` (`SAMPLE_PARTS` in `kernels/sample.cu`).
pub(super) const SAMPLE_PARTS: u32 = 64;

/// Parameters and launches of a `Sample` or `KeepCount` node.
pub(super) fn spec(a: &Addrs, v: &Variant, op: &Op) -> Result<LaunchSpec, BackendError> {
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
            let p = FpSample {
                c,
                logits: a.buf(v, *logits),
                tokens: a.buf(v, *tokens),
                // 0: no probabilities (kernels/sample.cu skips their exp-sums). H200 (2026-12-01, A/B in one call,
                // two passes): lone-w1 837.3 / 838.5 -> 831.1 / 831.1 us, verify-s16-w1 2440.1 / 2442.8 -> 2429.0
                // / 2427.5 us.
                probs: probs.map_or(0, |b| a.buf(v, b)),
                mode,
                vocab: *vocab,
            };
            LaunchSpec::new("sample_part", bytes(&p), (items, SAMPLE_PARTS, 1), 256)
                .then("sample", items, 1024)
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
