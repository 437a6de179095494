//! Round descriptors: everything that changes from round to round, read by the kernels, so one variant serves every
//! round of its shape (`architecture.md`, "Plans").

use serde::{Deserialize, Serialize};

/// Sampling parameters of one stream (`rounds.md` section 4).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Temperature; 0 means greedy (the lowest-id maximum).
    pub temperature: f32,
    /// Keep the `top_k` best candidates; 0 turns it off.
    pub top_k: u32,
    /// Nucleus mass in (0, 1]; 1 turns it off.
    pub top_p: f32,
    /// Minimum probability relative to the best candidate, in [0, 1]; 0 turns it off.
    pub min_p: f32,
    /// The sampling key's seed.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
    /// Whether this is greedy decoding (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks the ranges: `temperature` finite and >= 0, `top_p` in (0, 1], `min_p` in [0, 1]. NaN fails every
    /// check.
    ///
    /// # Errors
    /// [`SamplingError`] naming the field and its value.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplingError::MinP(self.min_p));
        }
        Ok(())
    }
}

impl Default for SamplingParams {
    /// The same as [`SamplingParams::greedy`].
    fn default() -> Self {
        Self::greedy()
    }
}

/// Why a [`SamplingParams`] was rejected by [`SamplingParams::validate`]; each variant names the field and carries
/// the offending value.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// `temperature` must be finite and >= 0 (0 means greedy).
    #[error("temperature must be finite and >= 0, got {0}")]
    Temperature(f32),
    /// `top_p` must lie in (0, 1] (1 turns the filter off).
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    /// `min_p` must lie in [0, 1] (0 turns the filter off).
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
}

/// One stream's part of a round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StreamDesc {
    /// The slot holding the stream's state.
    pub slot: u32,
    /// Absolute position of the stream's row 0 (tokens before it are committed in the slot).
    pub pos: u32,
    /// Real rows (the rest of the stream's window is padding).
    pub rows: u32,
    /// Positions of the stream's attention caches that are committed (pooled indexer blocks exist for every
    /// complete block below it). Equal to `pos` except in MTP chain steps, where it is the absorbed length.
    pub committed: u32,
    /// For MTP steps: the row of the source buffer (main streams or MTP streams) where this stream's input rows
    /// start.
    pub src_row: u32,
    /// Sampling parameters.
    pub sampling: SamplingParams,
}

/// The descriptor of one replay.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RoundDesc {
    /// One entry per stream of the variant.
    pub streams: Vec<StreamDesc>,
    /// `streams * window` token ids: each stream's window (pending token, then drafts; for MTP steps the next
    /// token of each entry), padding rows set to 0.
    pub tokens: Vec<u32>,
}

impl StreamDesc {
    /// A greedy stream in `slot` whose context before `pos` is all committed (`committed = pos`), reading input row 0
    /// of an MTP source: the usual stream of a single replay in tests, benchmarks and tools.
    pub fn greedy_at(slot: u32, pos: u32, rows: u32) -> StreamDesc {
        StreamDesc {
            slot,
            pos,
            rows,
            committed: pos,
            src_row: 0,
            sampling: SamplingParams::greedy(),
        }
    }
}

impl RoundDesc {
    /// One greedy stream in slot 0 ([`StreamDesc::greedy_at`]) with `rows` real rows: `tokens` padded with 0 to the
    /// variant's `window` rows.
    pub fn single(pos: u32, rows: u32, tokens: &[u32], window: u32) -> RoundDesc {
        let mut t = tokens.to_vec();
        t.resize(window as usize, 0);
        RoundDesc {
            streams: vec![StreamDesc::greedy_at(0, pos, rows)],
            tokens: t,
        }
    }
}
