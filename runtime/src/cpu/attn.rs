//! Sparse attention layers: q/k/v preparation with RoPE into the caches, the indexer's block selection, the
//! attention over the selected blocks, the commit of the pooled keys.

use super::*;

impl CpuBackend {
    /// Runs a sparse-attention node (`AttnPrep`, `IndexerPrep`, `IndexerSelect`, `SparseAttn`, `IndexerCommit`) of
    /// variant `v` for the round `desc`.
    pub(super) fn exec_attn(
        &mut self,
        v: &Variant,
        op: &Op,
        desc: &RoundDesc,
    ) -> Result<(), BackendError> {
        let (nstreams, _, real) = round_rows(v, desc);
        let pos_of = |s: usize, j: usize| desc.streams[s].pos as u64 + j as u64;
        match op {
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
            _ => return Err(wrong_op("sparse-attention", op)),
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
}
