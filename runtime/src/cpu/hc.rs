//! Hyper-connections: the read (norm, down and inject dots, gates and mix) and the write.

use super::*;

impl CpuBackend {
    /// Runs a hyper-connection node (`HcRead`, `HcWrite`) of variant `v` for the round `desc`.
    pub(super) fn exec_hc(
        &mut self,
        v: &Variant,
        op: &Op,
        desc: &RoundDesc,
    ) -> Result<(), BackendError> {
        let (nstreams, window, real) = round_rows(v, desc);
        let rows_total = nstreams * window;
        match op {
            Op::HcRead {
                h,
                norm,
                down,
                up,
                inject,
                out,
                dim,
                hc,
                rank,
                eps,
            } => {
                let (dim, hc, rank) = (*dim as usize, *hc as usize, *rank as usize);
                let width = dim * hc;
                let hv = self.read(v, *h);
                let nw = self.w(*norm)?;
                let dw = self.w(*down)?;
                let uw = self.w(*up)?;
                let iw = match inject {
                    Some((w, _)) => Some(self.w(*w)?),
                    None => None,
                };
                let weights = HcWeights {
                    norm: &nw,
                    down: &dw,
                    up: &uw,
                    inject: iw.as_deref(),
                };
                // Rows: window rows, or one per stream when the input is gathered.
                let rows: Vec<usize> = if hv.len() < rows_total * width {
                    (0..nstreams)
                        .filter(|&s| desc.streams[s].rows > 0)
                        .collect()
                } else {
                    real.iter().map(|r| r.2).collect()
                };
                let mut a_rows = Vec::new();
                for &r in &rows {
                    let mut a = vec![0f32; dim];
                    let mut inj = vec![0f32; hc];
                    hc_read(
                        &hv[r * width..(r + 1) * width],
                        &weights,
                        dim,
                        hc,
                        rank,
                        *eps,
                        &mut a,
                        Some(&mut inj),
                    );
                    a_rows.push((r, a, inj));
                }
                let o = self.write(v, *out);
                for (r, a, _) in &a_rows {
                    o[r * dim..(r + 1) * dim].copy_from_slice(a);
                }
                if let Some((_, ib)) = inject {
                    let o = self.write(v, *ib);
                    for (r, _, inj) in &a_rows {
                        o[r * hc..(r + 1) * hc].copy_from_slice(inj);
                    }
                }
            }
            Op::HcWrite { h, y, inj, dim, hc } => {
                let (dim, hc) = (*dim as usize, *hc as usize);
                let yv = self.read(v, *y);
                let iv = self.read(v, *inj);
                let o = self.write(v, *h);
                for &(_, _, r) in &real {
                    for c in 0..hc {
                        let wgt = iv[r * hc + c];
                        for d in 0..dim {
                            o[(r * hc + c) * dim + d] += wgt * yv[r * dim + d];
                        }
                    }
                }
            }
            _ => return Err(wrong_op("hyper-connection", op)),
        }
        Ok(())
    }
}
