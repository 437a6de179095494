//! The CPU reference backend: interprets a variant's node list with the reference kernels in f32, over the plan's
//! arena, io buffers and per-slot state, exactly as the GPU replays it (`architecture.md`, "Backends").

pub mod kernels;

use std::collections::BTreeMap;
use std::sync::Arc;

use flashplan_plan::{
    BufId, IoBuf, KeepSrc, Op, PlanBody, RoundDesc, SampleRows, Space, StateId, StateKind, Variant,
    VariantKind, WeightId,
};

use crate::backend::{Backend, BackendError};
use crate::sampler;
use kernels::*;

/// A borrowed-by-refcount f32 weight.
struct WeightRef {
    all: Arc<Vec<Option<Vec<f32>>>>,
    id: usize,
}

impl std::ops::Deref for WeightRef {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        self.all[self.id].as_deref().unwrap_or(&[])
    }
}

/// The CPU backend: plan, f32 weights, arena, io buffers and slot state.
pub struct CpuBackend {
    body: Arc<PlanBody>,
    weights: Arc<Vec<Option<Vec<f32>>>>,
    arena: Vec<f32>,
    io: BTreeMap<IoBuf, Vec<f32>>,
    slots: Vec<Vec<f32>>,
    rope: Rope,
    index: BTreeMap<VariantKind, usize>,
}

impl CpuBackend {
    /// A backend for a plan and its weights (indexed like `body.weights`; `None` for groups not loaded).
    pub fn new(body: Arc<PlanBody>, weights: Arc<Vec<Option<Vec<f32>>>>) -> CpuBackend {
        let io = [
            IoBuf::MainStreams,
            IoBuf::MtpStreams,
            IoBuf::Logits,
            IoBuf::Sampled,
            IoBuf::Probs,
            IoBuf::Keep,
        ]
        .into_iter()
        .map(|b| (b, vec![0f32; body.io.elems(b, &body.config) as usize]))
        .collect();
        let slots = (0..body.state.slots)
            .map(|_| vec![0f32; body.state.slot_elems as usize])
            .collect();
        let index = body
            .variants
            .iter()
            .enumerate()
            .map(|(i, v)| (v.kind, i))
            .collect();
        let mut b = CpuBackend {
            rope: Rope::new(&body.config),
            arena: vec![0f32; body.arena_elems as usize],
            io,
            slots,
            weights,
            index,
            body,
        };
        for s in 0..b.body.state.slots {
            b.reset_slot_state(s);
        }
        b
    }

    fn reset_slot_state(&mut self, slot: u32) {
        let eos = f32::from_bits(self.body.config.eos());
        let st = &mut self.slots[slot as usize];
        st.iter_mut().for_each(|x| *x = 0.0);
        for p in &self.body.state.pieces {
            if p.kind == StateKind::PleHistory {
                st[p.offset as usize..(p.offset + p.elems()) as usize]
                    .iter_mut()
                    .for_each(|x| *x = eos);
            }
        }
    }

    fn w(&self, id: WeightId) -> Result<WeightRef, BackendError> {
        match self.weights.get(id.0 as usize) {
            Some(Some(_)) => Ok(WeightRef {
                all: Arc::clone(&self.weights),
                id: id.0 as usize,
            }),
            _ => Err(BackendError::MissingWeight(
                self.body.weights[id.0 as usize].name.clone(),
            )),
        }
    }

    fn state_ref(&self, slot: u32, s: StateId) -> &[f32] {
        let (off, len) = self.state_range(s);
        &self.slots[slot as usize][off..off + len]
    }

    fn range(&self, v: &Variant, id: BufId) -> (Space, usize, usize) {
        let d = v.buf(id);
        (d.space, d.offset as usize, d.elems as usize)
    }

    fn read(&self, v: &Variant, id: BufId) -> Vec<f32> {
        let (space, off, len) = self.range(v, id);
        match space {
            Space::Arena => self.arena[off..off + len].to_vec(),
            Space::Io(io) => self.io[&io][off..off + len].to_vec(),
        }
    }

    fn write(&mut self, v: &Variant, id: BufId) -> &mut [f32] {
        let (space, off, len) = self.range(v, id);
        match space {
            Space::Arena => &mut self.arena[off..off + len],
            Space::Io(io) => match self.io.get_mut(&io) {
                Some(b) => &mut b[off..off + len],
                None => &mut [],
            },
        }
    }

    fn state_range(&self, s: StateId) -> (usize, usize) {
        let p = &self.body.state.pieces[s.0 as usize];
        (p.offset as usize, p.elems() as usize)
    }

    fn state(&mut self, slot: u32, s: StateId) -> &mut [f32] {
        let (off, len) = self.state_range(s);
        &mut self.slots[slot as usize][off..off + len]
    }

    fn keep_of(&self, v: &Variant, keep: KeepSrc, s: usize, desc: &RoundDesc) -> usize {
        match keep {
            KeepSrc::AllRows => desc.streams[s].rows as usize,
            KeepSrc::Counted(b) => {
                let (space, off, _) = self.range(v, b);
                let val = match space {
                    Space::Io(io) => self.io[&io][off + s],
                    Space::Arena => self.arena[off + s],
                };
                (val.to_bits() as usize).min(desc.streams[s].rows as usize)
            }
        }
    }

    /// Runs one op of a variant.
    fn exec(&mut self, v: &Variant, op: &Op, desc: &RoundDesc) -> Result<(), BackendError> {
        let (nstreams, window) = v.kind.shape();
        let (nstreams, window) = (nstreams as usize, window as usize);
        let rows_total = nstreams * window;
        // Real rows: (stream, row-in-window, global row).
        let real: Vec<(usize, usize, usize)> = (0..nstreams)
            .flat_map(|s| (0..desc.streams[s].rows as usize).map(move |j| (s, j, s * window + j)))
            .collect();
        let pos_of = |s: usize, j: usize| desc.streams[s].pos as u64 + j as u64;
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
            Op::AttnPrep {
                q_raw,
                k_raw,
                v_raw,
                q_norm,
                k_norm,
                q,
                gate,
                k_cache,
                v_cache,
                heads,
                kv_heads,
                hd,
                eps,
                ..
            } => {
                let (h, kvh, hd) = (*heads as usize, *kv_heads as usize, *hd as usize);
                let qr = self.read(v, *q_raw);
                let kr = self.read(v, *k_raw);
                let vr = self.read(v, *v_raw);
                let qn = self.w(*q_norm)?;
                let kn = self.w(*k_norm)?;
                let mut q_rows = Vec::new();
                for &(s, j, r) in &real {
                    let pos = pos_of(s, j);
                    let mut qo = vec![0f32; h * hd];
                    let mut go = vec![0f32; h * hd];
                    for hh in 0..h {
                        let src = &qr[r * h * 2 * hd + hh * 2 * hd..];
                        rms_norm(
                            &src[..hd],
                            Some(&qn),
                            &mut qo[hh * hd..(hh + 1) * hd],
                            hd,
                            *eps,
                        );
                        self.rope.apply(&mut qo[hh * hd..(hh + 1) * hd], pos);
                        go[hh * hd..(hh + 1) * hd].copy_from_slice(&src[hd..2 * hd]);
                    }
                    let mut ko = vec![0f32; kvh * hd];
                    for hh in 0..kvh {
                        rms_norm(
                            &kr[r * kvh * hd + hh * hd..r * kvh * hd + (hh + 1) * hd],
                            Some(&kn),
                            &mut ko[hh * hd..(hh + 1) * hd],
                            hd,
                            *eps,
                        );
                        self.rope.apply(&mut ko[hh * hd..(hh + 1) * hd], pos);
                    }
                    let slot = desc.streams[s].slot;
                    let w = kvh * hd;
                    let p = pos as usize;
                    self.state(slot, *k_cache)[p * w..(p + 1) * w].copy_from_slice(&ko);
                    self.state(slot, *v_cache)[p * w..(p + 1) * w]
                        .copy_from_slice(&vr[r * w..(r + 1) * w]);
                    q_rows.push((r, qo, go));
                }
                let o = self.write(v, *q);
                for (r, qo, _) in &q_rows {
                    o[r * h * hd..(r + 1) * h * hd].copy_from_slice(qo);
                }
                let o = self.write(v, *gate);
                for (r, _, go) in &q_rows {
                    o[r * h * hd..(r + 1) * h * hd].copy_from_slice(go);
                }
            }
            Op::IndexerPrep {
                qk,
                q_norm,
                q_out,
                raw_keys,
                ih,
                id,
                eps,
                ..
            } => {
                let (ih, id) = (*ih as usize, *id as usize);
                let qkv = self.read(v, *qk);
                let qn = self.w(*q_norm)?;
                let w = (ih + 1) * id;
                let mut rows = Vec::new();
                for &(s, j, r) in &real {
                    let pos = pos_of(s, j);
                    let src = &qkv[r * w..(r + 1) * w];
                    let mut qo = vec![0f32; ih * id];
                    for hh in 0..ih {
                        rms_norm(
                            &src[hh * id..(hh + 1) * id],
                            Some(&qn),
                            &mut qo[hh * id..(hh + 1) * id],
                            id,
                            *eps,
                        );
                        self.rope.apply(&mut qo[hh * id..(hh + 1) * id], pos);
                    }
                    let slot = desc.streams[s].slot;
                    let p = pos as usize;
                    self.state(slot, *raw_keys)[p * id..(p + 1) * id]
                        .copy_from_slice(&src[ih * id..]);
                    rows.push((r, qo));
                }
                let o = self.write(v, *q_out);
                for (r, qo) in rows {
                    o[r * ih * id..(r + 1) * ih * id].copy_from_slice(&qo);
                }
            }
            Op::IndexerSelect {
                q,
                k_norm,
                raw_keys,
                pooled,
                sel,
                ih,
                id,
                ratio,
                topk,
                eps,
                ..
            } => {
                let (ih, id, ratio, topk) =
                    (*ih as usize, *id as usize, *ratio as usize, *topk as usize);
                let qs = self.read(v, *q);
                let kn = self.w(*k_norm)?;
                let mut rows = Vec::new();
                for &(s, j, r) in &real {
                    let p = pos_of(s, j) as usize;
                    let committed = desc.streams[s].committed as usize;
                    let slot = desc.streams[s].slot;
                    let nb = (p + 1) / ratio;
                    let mut scores = vec![0f32; nb];
                    let raw = self.state_ref(slot, *raw_keys);
                    let pooled_s = self.state_ref(slot, *pooled);
                    for (b, score) in scores.iter_mut().enumerate() {
                        let key = if (b + 1) * ratio <= committed {
                            pooled_s[b * id..(b + 1) * id].to_vec()
                        } else {
                            self.block_key(raw, b, id, ratio, &kn, *eps)
                        };
                        let mut acc = 0f32;
                        for hh in 0..ih {
                            acc += dot(
                                &qs[r * ih * id + hh * id..r * ih * id + (hh + 1) * id],
                                &key,
                            )
                            .max(0.0);
                        }
                        *score = acc / (id as f32).sqrt();
                    }
                    let mut chosen = top_k(&scores, topk.min(nb));
                    chosen.sort_unstable();
                    let mut row = vec![f32::from_bits(u32::MAX); topk];
                    for (i, b) in chosen.iter().enumerate() {
                        row[i] = f32::from_bits(*b as u32);
                    }
                    rows.push((r, row));
                }
                let o = self.write(v, *sel);
                for (r, row) in rows {
                    o[r * topk..(r + 1) * topk].copy_from_slice(&row);
                }
            }
            Op::SparseAttn {
                q,
                gate,
                sel,
                k_cache,
                v_cache,
                out,
                heads,
                kv_heads,
                hd,
                ratio,
                topk,
            } => {
                let (h, kvh, hd, ratio, topk) = (
                    *heads as usize,
                    *kv_heads as usize,
                    *hd as usize,
                    *ratio as usize,
                    *topk as usize,
                );
                let qs = self.read(v, *q);
                let gs = self.read(v, *gate);
                let ss = self.read(v, *sel);
                let mut rows = Vec::new();
                let scale = 1.0 / (hd as f32).sqrt();
                for &(s, j, r) in &real {
                    let p = pos_of(s, j) as usize;
                    let slot = desc.streams[s].slot;
                    let nb = (p + 1) / ratio;
                    let mut tokens: Vec<usize> = Vec::new();
                    for i in 0..topk {
                        let b = ss[r * topk + i].to_bits();
                        if b == u32::MAX {
                            break;
                        }
                        tokens.extend(b as usize * ratio..(b as usize + 1) * ratio);
                    }
                    tokens.extend(nb * ratio..=p);
                    let kc = self.state_ref(slot, *k_cache);
                    let vc = self.state_ref(slot, *v_cache);
                    let mut o = vec![0f32; h * hd];
                    let w = kvh * hd;
                    for hh in 0..h {
                        let kv = hh / (h / kvh);
                        let qh = &qs[r * h * hd + hh * hd..r * h * hd + (hh + 1) * hd];
                        let sc: Vec<f32> = tokens
                            .iter()
                            .map(|&t| dot(qh, &kc[t * w + kv * hd..t * w + (kv + 1) * hd]) * scale)
                            .collect();
                        let m = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        let e: Vec<f32> = sc.iter().map(|x| (x - m).exp()).collect();
                        let z: f32 = e.iter().sum();
                        let oh = &mut o[hh * hd..(hh + 1) * hd];
                        for (&t, ev) in tokens.iter().zip(&e) {
                            let pw = ev / z;
                            let vrow = &vc[t * w + kv * hd..t * w + (kv + 1) * hd];
                            for d in 0..hd {
                                oh[d] += pw * vrow[d];
                            }
                        }
                        for d in 0..hd {
                            oh[d] *= sigmoid(gs[r * h * hd + hh * hd + d]);
                        }
                    }
                    rows.push((r, o));
                }
                let o = self.write(v, *out);
                for (r, row) in rows {
                    o[r * h * hd..(r + 1) * h * hd].copy_from_slice(&row);
                }
            }
            Op::IndexerCommit {
                raw_keys,
                pooled,
                k_norm,
                keep,
                id,
                ratio,
                eps,
                ..
            } => {
                let (id, ratio) = (*id as usize, *ratio as usize);
                let kn = self.w(*k_norm)?;
                for s in 0..nstreams {
                    let k = self.keep_of(v, *keep, s, desc);
                    // A stream that keeps nothing (padding) writes nothing: its slot may be a live one.
                    if k == 0 {
                        continue;
                    }
                    let d = desc.streams[s];
                    let end = d.pos as usize + k;
                    let slot = d.slot;
                    for b in d.committed as usize / ratio..end / ratio {
                        let key = self.block_key(
                            self.state_ref(slot, *raw_keys),
                            b,
                            id,
                            ratio,
                            &kn,
                            *eps,
                        );
                        self.state(slot, *pooled)[b * id..(b + 1) * id].copy_from_slice(&key);
                    }
                }
            }
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
            Op::Sample {
                logits,
                tokens,
                probs,
                rows,
                vocab,
            } => {
                let vocab = *vocab as usize;
                let lg = self.read(v, *logits);
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
                            res[r] = (r, t, sampler::token_prob(row, t));
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
                            res.push((s, t, sampler::token_prob(row, t)));
                        }
                    }
                }
                let o = self.write(v, *tokens);
                for &(i, t, _) in &res {
                    o[i] = f32::from_bits(t);
                }
                let o = self.write(v, *probs);
                for &(i, _, p) in &res {
                    o[i] = p;
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
        }
        Ok(())
    }

    /// Block key `b` from raw keys: `RoPE(k_layernorm(mean of its ratio raw keys), b * ratio)`.
    fn block_key(
        &self,
        raw: &[f32],
        b: usize,
        id: usize,
        ratio: usize,
        kn: &[f32],
        eps: f32,
    ) -> Vec<f32> {
        let mut mean = vec![0f32; id];
        for t in b * ratio..(b + 1) * ratio {
            for (m, x) in mean.iter_mut().zip(&raw[t * id..(t + 1) * id]) {
                *m += x;
            }
        }
        mean.iter_mut().for_each(|m| *m /= ratio as f32);
        let mut key = vec![0f32; id];
        rms_norm(&mean, Some(kn), &mut key, id, eps);
        self.rope.apply(&mut key, (b * ratio) as u64);
        key
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

impl Backend for CpuBackend {
    fn body(&self) -> &PlanBody {
        &self.body
    }

    fn run(&mut self, kind: VariantKind, desc: &RoundDesc) -> Result<(), BackendError> {
        let idx = *self
            .index
            .get(&kind)
            .ok_or_else(|| BackendError::NoVariant(kind.name()))?;
        let body = Arc::clone(&self.body);
        let v = &body.variants[idx];
        crate::backend::check_desc(body.as_ref(), kind, desc)?;
        for node in &v.nodes {
            self.exec(v, &node.op, desc)?;
        }
        Ok(())
    }

    fn io(&self, buf: IoBuf) -> &[f32] {
        &self.io[&buf]
    }

    fn write_io(&mut self, buf: IoBuf, offset: usize, data: &[f32]) {
        if let Some(b) = self.io.get_mut(&buf) {
            b[offset..offset + data.len()].copy_from_slice(data);
        }
    }

    fn reset_slot(&mut self, slot: u32) {
        self.reset_slot_state(slot);
    }

    fn slot_state(&self, slot: u32) -> Vec<f32> {
        self.slots[slot as usize].clone()
    }
}
