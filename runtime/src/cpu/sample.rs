//! Sampling (the keyed sampler, `crate::sampler`) and the count of kept drafts.

use super::*;
use flashplan_plan::SampleRows;

impl CpuBackend {
    /// Runs a sampling node (`Sample`, `KeepCount`) of variant `v` for the round `desc`.
    pub(super) fn exec_sample(
        &mut self,
        v: &Variant,
        op: &Op,
        desc: &RoundDesc,
    ) -> Result<(), BackendError> {
        let (nstreams, window, real) = round_rows(v, desc);
        let rows_total = nstreams * window;
        let pos_of = |s: usize, j: usize| desc.streams[s].pos as u64 + j as u64;
        match op {
            Op::Sample {
                logits,
                tokens,
                probs,
                rows,
                vocab,
            } => {
                let vocab = *vocab as usize;
                let lg = self.read(v, *logits);
                // The sampled token's probability only where the op has a buffer for it (the MTP step).
                let prob = |row: &[f32], t: u32| probs.map_or(0.0, |_| sampler::token_prob(row, t));
                let mut res: Vec<(usize, u32, f32)> = Vec::new();
                match rows {
                    SampleRows::All => {
                        for r in 0..rows_total {
                            res.push((r, u32::MAX, 0.0));
                        }
                        for &(s, j, r) in &real {
                            let row = &lg[r * vocab..(r + 1) * vocab];
                            let t =
                                sampler::sample(row, &desc.streams[s].sampling, pos_of(s, j) + 1);
                            res[r] = (r, t, prob(row, t));
                        }
                    }
                    SampleRows::Last | SampleRows::MtpGathered => {
                        for s in 0..nstreams {
                            let d = desc.streams[s];
                            if d.rows == 0 {
                                res.push((s, u32::MAX, 0.0));
                                continue;
                            }
                            let (r, position) = match rows {
                                SampleRows::Last => (
                                    s * window + d.rows as usize - 1,
                                    d.pos as u64 + d.rows as u64,
                                ),
                                _ => (s, d.pos as u64 + d.rows as u64 + 1),
                            };
                            let row = &lg[r * vocab..(r + 1) * vocab];
                            let t = sampler::sample(row, &d.sampling, position);
                            res.push((s, t, prob(row, t)));
                        }
                    }
                }
                let o = self.write(v, *tokens);
                for &(i, t, _) in &res {
                    o[i] = f32::from_bits(t);
                }
                if let Some(probs) = probs {
                    let o = self.write(v, *probs);
                    for &(i, _, p) in &res {
                        o[i] = p;
                    }
                }
            }
            Op::KeepCount { sampled, keep } => {
                let sv = self.read(v, *sampled);
                let mut keeps = Vec::new();
                for s in 0..nstreams {
                    let rows = desc.streams[s].rows as usize;
                    let mut k = 1;
                    while k < rows
                        && desc.tokens[s * window + k] == sv[s * window + k - 1].to_bits()
                    {
                        k += 1;
                    }
                    keeps.push(if rows == 0 { 0 } else { k as u32 });
                }
                let o = self.write(v, *keep);
                for (s, k) in keeps.into_iter().enumerate() {
                    o[s] = f32::from_bits(k);
                }
            }
            _ => return Err(wrong_op("sampling", op)),
        }
        Ok(())
    }
}
