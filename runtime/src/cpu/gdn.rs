//! Gated DeltaNet layers: the causal conv, the recurrence, the commit of the kept rows' state, the gated norm.

use super::*;

impl CpuBackend {
    /// Runs a Gated DeltaNet node (`GdnConv`, `GdnRecur`, `GdnCommit`, `GatedNorm`) of variant `v` for the round
    /// `desc`.
    pub(super) fn exec_gdn(
        &mut self,
        v: &Variant,
        op: &Op,
        desc: &RoundDesc,
    ) -> Result<(), BackendError> {
        let (nstreams, window, real) = round_rows(v, desc);
        match op {
            Op::GdnConv {
                x,
                w,
                state,
                out,
                channels,
                kernel,
            } => {
                let (ch, kernel) = (*channels as usize, *kernel as usize);
                let xs = self.read(v, *x);
                let wv = self.w(*w)?;
                let mut res = Vec::new();
                for s in 0..nstreams {
                    let rows = desc.streams[s].rows as usize;
                    let mut seq = self.state(desc.streams[s].slot, *state).to_vec();
                    for j in 0..rows {
                        let r = s * window + j;
                        seq.extend_from_slice(&xs[r * ch..(r + 1) * ch]);
                        let mut o = vec![0f32; ch];
                        for (c, ov) in o.iter_mut().enumerate() {
                            let mut acc = 0f32;
                            for t in 0..kernel {
                                acc += wv[c * kernel + t] * seq[(j + t) * ch + c];
                            }
                            *ov = silu(acc);
                        }
                        res.push((r, o));
                    }
                }
                let o = self.write(v, *out);
                for (r, row) in res {
                    o[r * ch..(r + 1) * ch].copy_from_slice(&row);
                }
            }
            Op::GdnRecur {
                qkv,
                b,
                a,
                a_log,
                dt_bias,
                state,
                out,
                stash,
                hk,
                hv,
                dk,
                dv,
            } => {
                let (hk, hv, dk, dv) = (*hk as usize, *hv as usize, *dk as usize, *dv as usize);
                let ch = 2 * hk * dk + hv * dv;
                let sw = hk * dk + hv * dv + 2 * hv;
                let q_all = self.read(v, *qkv);
                let bv = self.read(v, *b);
                let av = self.read(v, *a);
                let alog = self.w(*a_log)?;
                let dtb = self.w(*dt_bias)?;
                let mut outs = Vec::new();
                for s in 0..nstreams {
                    let rows = desc.streams[s].rows as usize;
                    let mut st = self.state(desc.streams[s].slot, *state).to_vec();
                    for j in 0..rows {
                        let r = s * window + j;
                        let row = &q_all[r * ch..(r + 1) * ch];
                        let mut q = row[..hk * dk].to_vec();
                        let mut k = row[hk * dk..2 * hk * dk].to_vec();
                        let vals = &row[2 * hk * dk..];
                        for hh in 0..hk {
                            l2norm(&mut q[hh * dk..(hh + 1) * dk], 1e-6);
                            l2norm(&mut k[hh * dk..(hh + 1) * dk], 1e-6);
                        }
                        let scale = 1.0 / (dk as f32).sqrt();
                        q.iter_mut().for_each(|x| *x *= scale);
                        let mut o = vec![0f32; hv * dv];
                        let mut srow = vec![0f32; sw];
                        srow[..hk * dk].copy_from_slice(&k);
                        srow[hk * dk..hk * dk + hv * dv].copy_from_slice(vals);
                        for h in 0..hv {
                            let kh = h / (hv / hk);
                            let beta = sigmoid(bv[r * hv + h]);
                            let g = -alog[h].exp() * softplus(av[r * hv + h] + dtb[h]);
                            srow[hk * dk + hv * dv + h] = g;
                            srow[hk * dk + hv * dv + hv + h] = beta;
                            let sh = &mut st[h * dk * dv..(h + 1) * dk * dv];
                            gdn_update(
                                sh,
                                &k[kh * dk..(kh + 1) * dk],
                                &vals[h * dv..(h + 1) * dv],
                                g,
                                beta,
                                dv,
                            );
                            gdn_output(
                                sh,
                                &q[kh * dk..(kh + 1) * dk],
                                &mut o[h * dv..(h + 1) * dv],
                                dv,
                            );
                        }
                        outs.push((r, o, srow));
                    }
                }
                let o = self.write(v, *out);
                for (r, row, _) in &outs {
                    o[r * hv * dv..(r + 1) * hv * dv].copy_from_slice(row);
                }
                let o = self.write(v, *stash);
                for (r, _, srow) in &outs {
                    o[r * sw..(r + 1) * sw].copy_from_slice(srow);
                }
            }
            Op::GdnCommit {
                stash,
                raw,
                state,
                conv,
                keep,
                hk,
                hv,
                dk,
                dv,
                channels,
                kernel,
            } => {
                let (hk, hv, dk, dv, ch, kernel) = (
                    *hk as usize,
                    *hv as usize,
                    *dk as usize,
                    *dv as usize,
                    *channels as usize,
                    *kernel as usize,
                );
                let sw = hk * dk + hv * dv + 2 * hv;
                let st = self.read(v, *stash);
                let rw = self.read(v, *raw);
                for s in 0..nstreams {
                    let k = self.keep_of(v, *keep, s, desc);
                    // A stream that keeps nothing (padding) writes nothing: its slot may be a live one.
                    if k == 0 {
                        continue;
                    }
                    let slot = desc.streams[s].slot;
                    let state_s = self.state(slot, *state);
                    for j in 0..k {
                        let r = s * window + j;
                        let row = &st[r * sw..(r + 1) * sw];
                        let kk = &row[..hk * dk];
                        let vals = &row[hk * dk..hk * dk + hv * dv];
                        for h in 0..hv {
                            let kh = h / (hv / hk);
                            let g = row[hk * dk + hv * dv + h];
                            let beta = row[hk * dk + hv * dv + hv + h];
                            let sh = &mut state_s[h * dk * dv..(h + 1) * dk * dv];
                            gdn_update(
                                sh,
                                &kk[kh * dk..(kh + 1) * dk],
                                &vals[h * dv..(h + 1) * dv],
                                g,
                                beta,
                                dv,
                            );
                        }
                    }
                    let mut seq = self.state(slot, *conv).to_vec();
                    for j in 0..k {
                        let r = s * window + j;
                        seq.extend_from_slice(&rw[r * ch..(r + 1) * ch]);
                    }
                    let n = seq.len();
                    self.state(slot, *conv)
                        .copy_from_slice(&seq[n - (kernel - 1) * ch..]);
                }
            }
            Op::GatedNorm {
                x,
                z,
                w,
                out,
                heads,
                dim,
                act,
                eps,
            } => {
                let (heads, dim) = (*heads as usize, *dim as usize);
                let xs = self.read(v, *x);
                let zs = self.read(v, *z);
                let wv = self.w(*w)?;
                let o = self.write(v, *out);
                for &(_, _, r) in &real {
                    for h in 0..heads {
                        let base = r * heads * dim + h * dim;
                        let xh = &xs[base..base + dim];
                        let inv = 1.0 / (dot(xh, xh) / dim as f32 + eps).sqrt();
                        for i in 0..dim {
                            let zv = zs[base + i];
                            let gate = match act {
                                flashplan_plan::GateAct::Sigmoid => sigmoid(zv),
                                flashplan_plan::GateAct::Silu => silu(zv),
                            };
                            o[base + i] = wv[i] * (xh[i] * inv) * gate;
                        }
                    }
                }
            }
            _ => return Err(wrong_op("Gated DeltaNet", op)),
        }
        Ok(())
    }
}
