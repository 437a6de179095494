//! Per-layer embeddings: the n-gram embedding, the mix into the residual streams, the commit of the n-gram
//! history and conv tail.

use super::*;

impl CpuBackend {
    /// Runs a PLE node (`PleEmbed`, `PleMix`, `PleCommit`) of variant `v` for the round `desc`.
    pub(super) fn exec_ple(
        &mut self,
        v: &Variant,
        op: &Op,
        desc: &RoundDesc,
    ) -> Result<(), BackendError> {
        let (nstreams, window, real) = round_rows(v, desc);
        match op {
            Op::PleEmbed {
                history,
                table,
                out,
                ple_index,
                heads,
                head_dim,
                ..
            } => {
                self.ple_embed(
                    v,
                    desc,
                    &real,
                    *history,
                    *table,
                    *out,
                    *ple_index,
                    *heads as usize,
                    *head_dim as usize,
                )?;
            }
            Op::PleMix {
                h,
                key,
                value,
                norm_key,
                norm_query,
                norm_conv,
                conv_w,
                tail,
                stash,
                dim,
                hc,
                kernel,
                dilation,
                eps,
            } => {
                let (dim, hc, kernel, dil) = (
                    *dim as usize,
                    *hc as usize,
                    *kernel as usize,
                    *dilation as usize,
                );
                let width = dim * hc;
                let tail_len = (kernel - 1) * dil;
                let hv = self.read(v, *h);
                let kv = self.read(v, *key);
                let vv = self.read(v, *value);
                let (nk, nq, nc, cw) = (
                    self.w(*norm_key)?,
                    self.w(*norm_query)?,
                    self.w(*norm_conv)?,
                    self.w(*conv_w)?,
                );
                let mut new_h = hv.clone();
                let mut stash_rows: Vec<(usize, Vec<f32>)> = Vec::new();
                for s in 0..nstreams {
                    let rows = desc.streams[s].rows as usize;
                    let slot = desc.streams[s].slot;
                    let mut seq: Vec<f32> = self.state(slot, *tail).to_vec(); // tail_len rows of width
                    for j in 0..rows {
                        let r = s * window + j;
                        let mut kn = vec![0f32; width];
                        rms_norm(
                            &kv[r * width..(r + 1) * width],
                            Some(&nk),
                            &mut kn,
                            dim,
                            *eps,
                        );
                        let mut qn = vec![0f32; width];
                        rms_norm(
                            &hv[r * width..(r + 1) * width],
                            Some(&nq),
                            &mut qn,
                            dim,
                            *eps,
                        );
                        let mut g = vec![0f32; width];
                        for c in 0..hc {
                            let sc = dot(&kn[c * dim..(c + 1) * dim], &qn[c * dim..(c + 1) * dim])
                                / (dim as f32).sqrt();
                            let sign = if sc > 0.0 {
                                1.0
                            } else if sc < 0.0 {
                                -1.0
                            } else {
                                0.0
                            };
                            let gate = sc.abs().max(1e-6).sqrt() * sign;
                            let sg = sigmoid(gate);
                            for d in 0..dim {
                                g[c * dim + d] = sg * vv[r * dim + d];
                            }
                        }
                        let mut gn = vec![0f32; width];
                        rms_norm(&g, Some(&nc), &mut gn, dim, *eps);
                        seq.extend_from_slice(&gn);
                        // Row j's conv reads seq rows j, j+dil, ..., j+tail_len (the last is this row).
                        for ch in 0..width {
                            let mut acc = 0f32;
                            for t in 0..kernel {
                                acc += cw[ch * kernel + t] * seq[(j + t * dil) * width + ch];
                            }
                            new_h[r * width + ch] += g[ch] + silu(acc);
                        }
                        stash_rows.push((r, gn));
                    }
                    let _ = tail_len;
                }
                let o = self.write(v, *h);
                for &(_, _, r) in &real {
                    o[r * width..(r + 1) * width]
                        .copy_from_slice(&new_h[r * width..(r + 1) * width]);
                }
                let o = self.write(v, *stash);
                for (r, gn) in stash_rows {
                    o[r * width..(r + 1) * width].copy_from_slice(&gn);
                }
            }
            Op::PleCommit {
                history,
                tail,
                stash,
                keep,
                width,
                ..
            } => {
                let width = *width as usize;
                let st = self.read(v, *stash);
                for s in 0..nstreams {
                    let k = self.keep_of(v, *keep, s, desc);
                    // A stream that keeps nothing (padding) writes nothing: its slot may be a live one.
                    if k == 0 {
                        continue;
                    }
                    let slot = desc.streams[s].slot;
                    let hist_len = self.state_range(*history).1;
                    let mut ids: Vec<f32> = self.state(slot, *history).to_vec();
                    ids.extend((0..k).map(|j| f32::from_bits(desc.tokens[s * window + j])));
                    let n = ids.len();
                    self.state(slot, *history)
                        .copy_from_slice(&ids[n - hist_len..]);
                    let tail_elems = self.state_range(*tail).1;
                    let mut seq: Vec<f32> = self.state(slot, *tail).to_vec();
                    for j in 0..k {
                        let r = s * window + j;
                        seq.extend_from_slice(&st[r * width..(r + 1) * width]);
                    }
                    let n = seq.len();
                    self.state(slot, *tail)
                        .copy_from_slice(&seq[n - tail_elems..]);
                }
            }
            _ => return Err(wrong_op("PLE", op)),
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn ple_embed(
        &mut self,
        v: &Variant,
        desc: &RoundDesc,
        real: &[(usize, usize, usize)],
        history: StateId,
        table: WeightId,
        out: BufId,
        ple_index: u32,
        heads: usize,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        let cfg = &self.body.config;
        let n = cfg.ngram_size as usize;
        let hpn = cfg.heads_per_ngram as usize;
        let eos = cfg.eos();
        let mult = flashplan_plan::ple::layer_multipliers(cfg, ple_index);
        let (sizes, offsets) = flashplan_plan::ple::head_sizes(cfg, ple_index);
        let (window, _) = (v.kind.shape().1 as usize, 0);
        let t = self.w(table)?;
        let mut rows = Vec::new();
        for &(s, j, r) in real {
            let slot = desc.streams[s].slot;
            let mut hist: Vec<u32> = self
                .state(slot, history)
                .iter()
                .map(|x| x.to_bits())
                .collect();
            hist.extend((0..=j).map(|i| desc.tokens[s * window + i]));
            let cur = hist.len() - 1;
            // shifted[k] = the token k positions back, or eos when an eos lies in between (or before the start).
            let mut shifted = vec![eos as u64; n];
            shifted[0] = hist[cur] as u64;
            for k in 1..n {
                if k > cur {
                    break;
                }
                if hist[cur - k..cur].contains(&eos) {
                    break;
                }
                shifted[k] = hist[cur - k] as u64;
            }
            let mut row = vec![0f32; heads * head_dim];
            for order in 2..=n {
                let mut mixed = shifted[0].wrapping_mul(mult[0]);
                for k in 1..order {
                    mixed ^= shifted[k].wrapping_mul(mult[k]);
                }
                for local in 0..hpn {
                    let head = (order - 2) * hpn + local;
                    let id = (mixed % sizes[head] + offsets[head]) as usize;
                    row[head * head_dim..(head + 1) * head_dim]
                        .copy_from_slice(&t[id * head_dim..(id + 1) * head_dim]);
                }
            }
            rows.push((r, row));
        }
        let o = self.write(v, out);
        let w = heads * head_dim;
        for (r, row) in rows {
            o[r * w..(r + 1) * w].copy_from_slice(&row);
        }
        Ok(())
    }
}
