//! Row-wise ops and linears: embeddings, row gathers, RMS norm, broadcast adds, and `x W^T` (`matvec` in kernels.rs).

use super::*;

impl CpuBackend {
    /// Runs an embedding, row gather, RMS norm, broadcast add or linear node (`EmbedStreams`, `Embed`, `GatherRows`,
    /// `LastRows`, `RmsNorm`, `AddBroadcast`, `Linear`) of variant `v` for the round `desc`.
    pub(super) fn exec_rows(
        &mut self,
        v: &Variant,
        op: &Op,
        desc: &RoundDesc,
    ) -> Result<(), BackendError> {
        let (nstreams, window, real) = round_rows(v, desc);
        let rows_total = nstreams * window;
        match op {
            Op::EmbedStreams {
                table,
                out,
                dim,
                copies,
                ..
            } => {
                let (dim, copies) = (*dim as usize, *copies as usize);
                let t = self.w(*table)?;
                let o = self.write(v, *out);
                for &(_, _, r) in &real {
                    let tok = desc.tokens[r] as usize;
                    for c in 0..copies {
                        o[(r * copies + c) * dim..(r * copies + c + 1) * dim]
                            .copy_from_slice(&t[tok * dim..(tok + 1) * dim]);
                    }
                }
            }
            Op::Embed {
                table, out, dim, ..
            } => {
                let dim = *dim as usize;
                let t = self.w(*table)?;
                let o = self.write(v, *out);
                for &(_, _, r) in &real {
                    let tok = desc.tokens[r] as usize;
                    o[r * dim..(r + 1) * dim].copy_from_slice(&t[tok * dim..(tok + 1) * dim]);
                }
            }
            Op::GatherRows { src, out, width } => {
                let w = *width as usize;
                // The source is the previous variant's output: read the whole io buffer, whatever its shape here.
                let s_buf = match v.buf(*src).space {
                    Space::Io(io) => self.io[&io].clone(),
                    Space::Arena => self.read(v, *src),
                };
                let o = self.write(v, *out);
                for &(s, j, r) in &real {
                    let from = desc.streams[s].src_row as usize + j;
                    o[r * w..(r + 1) * w].copy_from_slice(&s_buf[from * w..(from + 1) * w]);
                }
            }
            Op::LastRows { x, out, width } => {
                let w = *width as usize;
                let xs = self.read(v, *x);
                let o = self.write(v, *out);
                for s in 0..nstreams {
                    let rows = desc.streams[s].rows as usize;
                    if rows == 0 {
                        continue;
                    }
                    let r = s * window + rows - 1;
                    o[s * w..(s + 1) * w].copy_from_slice(&xs[r * w..(r + 1) * w]);
                }
            }
            Op::RmsNorm {
                x,
                w,
                out,
                dim,
                group,
                eps,
            } => {
                let dim = *dim as usize;
                let xs = self.read(v, *x);
                let wv = match w {
                    Some(w) => Some(self.w(*w)?),
                    None => None,
                };
                let o = self.write(v, *out);
                for &(_, _, r) in &real {
                    rms_norm(
                        &xs[r * dim..(r + 1) * dim],
                        wv.as_deref(),
                        &mut o[r * dim..(r + 1) * dim],
                        *group as usize,
                        *eps,
                    );
                }
            }
            Op::AddBroadcast {
                a,
                b,
                out,
                width,
                b_width,
            } => {
                let (w, bw) = (*width as usize, *b_width as usize);
                let av = self.read(v, *a);
                let bv = self.read(v, *b);
                let o = self.write(v, *out);
                for &(_, _, r) in &real {
                    for i in 0..w {
                        o[r * w + i] = av[r * w + i] + bv[r * bw + i % bw];
                    }
                }
            }
            Op::Linear {
                x,
                w,
                out,
                k,
                n,
                sub,
                accumulate,
            } => {
                let (k, n, sub) = (*k as usize, *n as usize, *sub as usize);
                let xs = self.read(v, *x);
                let wv = self.w(*w)?;
                let gathered = xs.len() < rows_total * sub * k;
                let o = self.write(v, *out);
                let mut tmp = vec![0f32; n];
                // A gathered input (one row per stream) covers streams, not window rows.
                let row_ids: Vec<usize> = if gathered {
                    (0..nstreams)
                        .filter(|&s| desc.streams[s].rows > 0)
                        .collect()
                } else {
                    real.iter().map(|r| r.2).collect()
                };
                for r in row_ids {
                    for q in 0..sub {
                        let i = r * sub + q;
                        matvec(&wv, &xs[i * k..(i + 1) * k], &mut tmp, k);
                        let dst = &mut o[i * n..(i + 1) * n];
                        if *accumulate {
                            dst.iter_mut().zip(&tmp).for_each(|(d, t)| *d += t);
                        } else {
                            dst.copy_from_slice(&tmp);
                        }
                    }
                }
            }
            _ => {
                return Err(wrong_op(
                    "embedding, row gather, RMS norm, broadcast add or linear",
                    op,
                ))
            }
        }
        Ok(())
    }
}
