//! Mixture of experts: the router's top-k, the routed experts and the shared expert.

use super::*;

impl CpuBackend {
    /// Runs a mixture-of-experts node (`Router`, `Experts`, `SharedExpert`) of variant `v` for the round `desc`.
    pub(super) fn exec_moe(
        &mut self,
        v: &Variant,
        op: &Op,
        desc: &RoundDesc,
    ) -> Result<(), BackendError> {
        let (_, _, real) = round_rows(v, desc);
        match op {
            Op::Router {
                x,
                gate,
                ids,
                weights,
                experts,
                topk,
                dim,
                norm,
            } => {
                let (e, k, dim) = (*experts as usize, *topk as usize, *dim as usize);
                let xs = self.read(v, *x);
                let gw = self.w(*gate)?;
                let mut rows = Vec::new();
                for &(_, _, r) in &real {
                    let mut logits = vec![0f32; e];
                    matvec(&gw, &xs[r * dim..(r + 1) * dim], &mut logits, dim);
                    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let ex: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
                    let z: f32 = ex.iter().sum();
                    let probs: Vec<f32> = ex.iter().map(|v| v / z).collect();
                    let top = top_k(&probs, k);
                    let mut wts: Vec<f32> = top.iter().map(|&i| probs[i]).collect();
                    if *norm {
                        let s: f32 = wts.iter().sum();
                        wts.iter_mut().for_each(|w| *w /= s);
                    }
                    rows.push((r, top, wts));
                }
                let o = self.write(v, *ids);
                for (r, top, _) in &rows {
                    for (i, t) in top.iter().enumerate() {
                        o[r * k + i] = f32::from_bits(*t as u32);
                    }
                }
                let o = self.write(v, *weights);
                for (r, _, wts) in &rows {
                    o[r * k..(r + 1) * k].copy_from_slice(wts);
                }
            }
            Op::Experts {
                x,
                ids,
                weights,
                gate_up,
                down,
                out,
                topk,
                dim,
                inter,
            } => {
                let (k, d, inter) = (*topk as usize, *dim as usize, *inter as usize);
                let xs = self.read(v, *x);
                let idv = self.read(v, *ids);
                let wv = self.read(v, *weights);
                let gu = self.w(*gate_up)?;
                let dn = self.w(*down)?;
                let mut rows = Vec::new();
                let mut tmp = vec![0f32; d];
                for &(_, _, r) in &real {
                    let mut acc = vec![0f32; d];
                    for i in 0..k {
                        let e = idv[r * k + i].to_bits() as usize;
                        swiglu(
                            &xs[r * d..(r + 1) * d],
                            &gu[e * 2 * inter * d..(e + 1) * 2 * inter * d],
                            &dn[e * d * inter..(e + 1) * d * inter],
                            inter,
                            &mut tmp,
                        );
                        let wgt = wv[r * k + i];
                        acc.iter_mut().zip(&tmp).for_each(|(a, t)| *a += wgt * t);
                    }
                    rows.push((r, acc));
                }
                let o = self.write(v, *out);
                for (r, row) in rows {
                    o[r * d..(r + 1) * d].copy_from_slice(&row);
                }
            }
            Op::SharedExpert {
                x,
                gate,
                up,
                down,
                scale,
                out,
                dim,
                inter,
            } => {
                let (d, inter) = (*dim as usize, *inter as usize);
                let xs = self.read(v, *x);
                let gw = self.w(*gate)?;
                let uw = self.w(*up)?;
                let dw = self.w(*down)?;
                let sw = self.w(*scale)?;
                let mut gu = gw.to_vec();
                gu.extend_from_slice(&uw);
                let mut rows = Vec::new();
                let mut tmp = vec![0f32; d];
                for &(_, _, r) in &real {
                    let xr = &xs[r * d..(r + 1) * d];
                    swiglu(xr, &gu, &dw, inter, &mut tmp);
                    let sg = sigmoid(dot(&sw, xr));
                    rows.push((r, tmp.iter().map(|t| sg * t).collect::<Vec<f32>>()));
                }
                let o = self.write(v, *out);
                for (r, row) in rows {
                    o[r * d..(r + 1) * d]
                        .iter_mut()
                        .zip(&row)
                        .for_each(|(a, b)| *a += b);
                }
            }
            _ => return Err(wrong_op("mixture-of-experts", op)),
        }
        Ok(())
    }
}
