//! The op graph of one variant: the whole forward of Flash Next (`flash-next.md` sections 2-9) for a window of
//! rows, as an ordered node list over named buffers, weights and state pieces.

use std::collections::HashMap;

use flashplan_plan::{
    BufId, BufferDecl, DrafterForm, IoBuf, KeepSrc, LayerKind, ModelConfig, Node, Op, SampleRows,
    Space, StateId, StateLayout, TokenSrc, VariantKind, WeightEntry, WeightId,
};

/// Errors building a graph (a manifest or state layout that lacks what the config needs: a compiler bug).
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// A weight the graph needs is not in the manifest.
    #[error("weight `{0}` missing from the manifest")]
    MissingWeight(String),
    /// A state piece the graph needs is not in the layout.
    #[error("state piece `{0}` missing from the layout")]
    MissingState(String),
}

/// Builds one variant's node list.
pub struct Builder<'a> {
    cfg: &'a ModelConfig,
    weights: HashMap<&'a str, WeightId>,
    state: HashMap<&'a str, StateId>,
    /// Buffers declared so far (arena offsets are assigned later by the memory planner).
    pub buffers: Vec<BufferDecl>,
    /// Nodes so far.
    pub nodes: Vec<Node>,
    rows: u64,
    streams: u64,
    layer: Option<u32>,
    io_bufs: HashMap<IoBuf, BufId>,
}

type R<T> = Result<T, GraphError>;

impl<'a> Builder<'a> {
    /// A builder for `streams` windows of `window` rows.
    pub fn new(
        cfg: &'a ModelConfig,
        weights: &'a [WeightEntry],
        state: &'a StateLayout,
        streams: u32,
        window: u32,
    ) -> Self {
        Builder {
            cfg,
            weights: weights
                .iter()
                .enumerate()
                .map(|(i, w)| (w.name.as_str(), WeightId(i as u32)))
                .collect(),
            state: state
                .pieces
                .iter()
                .enumerate()
                .map(|(i, p)| (p.name.as_str(), StateId(i as u32)))
                .collect(),
            buffers: Vec::new(),
            nodes: Vec::new(),
            rows: streams as u64 * window as u64,
            streams: streams as u64,
            layer: None,
            io_bufs: HashMap::new(),
        }
    }

    fn arena(&mut self, name: String, per_row: u64) -> BufId {
        self.arena_exact(name, per_row * self.rows)
    }
    fn arena_exact(&mut self, name: String, elems: u64) -> BufId {
        self.buffers.push(BufferDecl {
            name,
            space: Space::Arena,
            elems,
            offset: 0,
        });
        BufId(self.buffers.len() as u32 - 1)
    }
    fn io(&mut self, io: IoBuf, elems: u64) -> BufId {
        if let Some(b) = self.io_bufs.get(&io) {
            let b = *b;
            let decl = &mut self.buffers[b.0 as usize];
            decl.elems = decl.elems.max(elems);
            return b;
        }
        self.buffers.push(BufferDecl {
            name: format!("io.{io:?}"),
            space: Space::Io(io),
            elems,
            offset: 0,
        });
        let b = BufId(self.buffers.len() as u32 - 1);
        self.io_bufs.insert(io, b);
        b
    }
    fn w(&self, name: &str) -> R<WeightId> {
        self.weights
            .get(name)
            .copied()
            .ok_or_else(|| GraphError::MissingWeight(name.to_string()))
    }
    fn s(&self, name: &str) -> R<StateId> {
        self.state
            .get(name)
            .copied()
            .ok_or_else(|| GraphError::MissingState(name.to_string()))
    }
    fn push(&mut self, op: Op) {
        let launch = crate::launch::launch_for(&op, self.rows as u32, self.streams as u32);
        self.nodes.push(Node {
            op,
            launch,
            layer: self.layer,
            deps: Vec::new(),
        });
    }

    /// Weight name with the drafter form's suffix when a re-coded copy exists.
    fn wf(&self, name: &str, form: DrafterForm) -> R<WeightId> {
        if form != DrafterForm::Checkpoint {
            if let Some(id) = self.weights.get(format!("{name}#mxfp8").as_str()) {
                return Ok(*id);
            }
        }
        self.w(name)
    }

    /// Hyper-connection read (section 4); returns the block input `[R, D]` and, with inject, the weights `[R, C]`.
    fn hc_read(
        &mut self,
        h: BufId,
        prefix: &str,
        tag: &str,
        inject: bool,
        form: DrafterForm,
    ) -> R<(BufId, Option<BufId>)> {
        let cfg = self.cfg;
        let out = self.arena(format!("{tag}.in"), cfg.hidden_size as u64);
        let inj = if inject {
            let b = self.arena(format!("{tag}.inject"), cfg.hc_count as u64);
            Some((
                self.wf(&format!("{prefix}.block_inject_weight.weight"), form)?,
                b,
            ))
        } else {
            None
        };
        let op = Op::HcRead {
            h,
            norm: self.w(&format!("{prefix}.hc_norm.weight"))?,
            down: self.wf(&format!("{prefix}.input_mix_weight_down.weight"), form)?,
            up: self.wf(&format!("{prefix}.input_mix_weight_up.weight"), form)?,
            inject: inj,
            out,
            dim: cfg.hidden_size,
            hc: cfg.hc_count,
            rank: cfg.hc_lowrank,
            eps: cfg.rms_norm_eps as f32,
        };
        self.push(op);
        Ok((out, inj.map(|(_, b)| b)))
    }

    fn linear(&mut self, x: BufId, w: WeightId, out: BufId, k: u32, n: u32) {
        self.push(Op::Linear {
            x,
            w,
            out,
            k,
            n,
            sub: 1,
            accumulate: false,
        });
    }

    fn gdn(&mut self, a: BufId, i: usize, keep: KeepSrc, commits: &mut Vec<Op>) -> R<BufId> {
        let cfg = self.cfg;
        let p = format!("layers.{i}.linear_attn");
        let t = format!("l{i}.gdn");
        let d = cfg.hidden_size;
        let (hk, hv, dk, dv) = (
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        );
        let ch = cfg.gdn_conv_dim();
        let raw = self.arena(format!("{t}.qkv_raw"), ch as u64);
        let w = self.w(&format!("{p}.in_proj_qkv.weight"))?;
        self.linear(a, w, raw, d, ch);
        let z = self.arena(format!("{t}.z"), (hv * dv) as u64);
        let w = self.w(&format!("{p}.in_proj_z.weight"))?;
        self.linear(a, w, z, d, hv * dv);
        let b = self.arena(format!("{t}.b"), hv as u64);
        let w = self.w(&format!("{p}.in_proj_b.weight"))?;
        self.linear(a, w, b, d, hv);
        let al = self.arena(format!("{t}.a"), hv as u64);
        let w = self.w(&format!("{p}.in_proj_a.weight"))?;
        self.linear(a, w, al, d, hv);
        let qkv = self.arena(format!("{t}.qkv"), ch as u64);
        let conv_state = self.s(&format!("layers.{i}.gdn.conv"))?;
        let op = Op::GdnConv {
            x: raw,
            w: self.w(&format!("{p}.conv1d.weight"))?,
            state: conv_state,
            out: qkv,
            channels: ch,
            kernel: cfg.linear_conv_kernel_dim,
        };
        self.push(op);
        let o = self.arena(format!("{t}.o"), (hv * dv) as u64);
        let stash = self.arena(format!("{t}.stash"), (hk * dk + hv * dv + 2 * hv) as u64);
        let rec = self.s(&format!("layers.{i}.gdn.recurrent"))?;
        let op = Op::GdnRecur {
            qkv,
            b,
            a: al,
            a_log: self.w(&format!("{p}.A_log"))?,
            dt_bias: self.w(&format!("{p}.dt_bias"))?,
            state: rec,
            out: o,
            stash,
            hk,
            hv,
            dk,
            dv,
        };
        self.push(op);
        let on = self.arena(format!("{t}.o_norm"), (hv * dv) as u64);
        let op = Op::GatedNorm {
            x: o,
            z,
            w: self.w(&format!("{p}.norm.weight"))?,
            out: on,
            heads: hv,
            dim: dv,
            act: cfg.output_gate,
            eps: cfg.rms_norm_eps as f32,
        };
        self.push(op);
        let y = self.arena(format!("{t}.out"), d as u64);
        let w = self.w(&format!("{p}.out_proj.weight"))?;
        self.linear(on, w, y, hv * dv, d);
        commits.push(Op::GdnCommit {
            stash,
            raw,
            state: rec,
            conv: conv_state,
            keep,
            hk,
            hv,
            dk,
            dv,
            channels: ch,
            kernel: cfg.linear_conv_kernel_dim,
        });
        Ok(y)
    }

    /// Attention with the QSA indexer (section 6). `p`: weight prefix (`layers.3.self_attn`), `sp`: state prefix.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        a: BufId,
        p: &str,
        sp: &str,
        t: &str,
        keep: KeepSrc,
        commits: &mut Vec<Op>,
        form: DrafterForm,
    ) -> R<BufId> {
        let cfg = self.cfg;
        let d = cfg.hidden_size;
        let (h, kvh, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (ih, id) = (cfg.indexer_n_heads, cfg.indexer_head_dim);
        let rot = cfg.rotary_dim();
        let eps = cfg.rms_norm_eps as f32;
        let q_raw = self.arena(format!("{t}.q_raw"), (h * hd * 2) as u64);
        let w = self.wf(&format!("{p}.q_proj.weight"), form)?;
        self.linear(a, w, q_raw, d, h * hd * 2);
        let k_raw = self.arena(format!("{t}.k_raw"), (kvh * hd) as u64);
        let w = self.wf(&format!("{p}.k_proj.weight"), form)?;
        self.linear(a, w, k_raw, d, kvh * hd);
        let v_raw = self.arena(format!("{t}.v_raw"), (kvh * hd) as u64);
        let w = self.wf(&format!("{p}.v_proj.weight"), form)?;
        self.linear(a, w, v_raw, d, kvh * hd);
        // The indexer's projection of the same input right after q, k and v (before attn_prep, which it does not
        // touch), so the CUDA backend launches the four as one linear_multi (runtime/src/cuda/fuse.rs).
        let iqk = self.arena(format!("{t}.index_qk"), ((ih + 1) * id) as u64);
        let w = self.wf(&format!("{p}.indexer.index_qk_proj.weight"), form)?;
        self.linear(a, w, iqk, d, (ih + 1) * id);
        let q = self.arena(format!("{t}.q"), (h * hd) as u64);
        let gate = self.arena(format!("{t}.gate"), (h * hd) as u64);
        let k_cache = self.s(&format!("{sp}.k_cache"))?;
        let v_cache = self.s(&format!("{sp}.v_cache"))?;
        let op = Op::AttnPrep {
            q_raw,
            k_raw,
            v_raw,
            q_norm: self.w(&format!("{p}.q_norm.weight"))?,
            k_norm: self.w(&format!("{p}.k_norm.weight"))?,
            q,
            gate,
            k_cache,
            v_cache,
            heads: h,
            kv_heads: kvh,
            hd,
            rot,
            eps,
        };
        self.push(op);
        let iq = self.arena(format!("{t}.index_q"), (ih * id) as u64);
        let raw_keys = self.s(&format!("{sp}.indexer_raw_keys"))?;
        let pooled = self.s(&format!("{sp}.indexer_pooled"))?;
        let op = Op::IndexerPrep {
            qk: iqk,
            q_norm: self.w(&format!("{p}.indexer.q_layernorm.weight"))?,
            q_out: iq,
            raw_keys,
            ih,
            id,
            rot,
            eps,
        };
        self.push(op);
        let topk = cfg.block_topk();
        let sel = self.arena(format!("{t}.selected_blocks"), topk as u64);
        let k_norm = self.w(&format!("{p}.indexer.k_layernorm.weight"))?;
        self.push(Op::IndexerSelect {
            q: iq,
            k_norm,
            raw_keys,
            pooled,
            sel,
            ih,
            id,
            rot,
            ratio: cfg.indexer_compress_ratio,
            topk,
            eps,
        });
        let att = self.arena(format!("{t}.attn"), (h * hd) as u64);
        self.push(Op::SparseAttn {
            q,
            gate,
            sel,
            k_cache,
            v_cache,
            out: att,
            heads: h,
            kv_heads: kvh,
            hd,
            ratio: cfg.indexer_compress_ratio,
            topk,
        });
        let y = self.arena(format!("{t}.out"), d as u64);
        let w = self.wf(&format!("{p}.o_proj.weight"), form)?;
        self.linear(att, w, y, h * hd, d);
        commits.push(Op::IndexerCommit {
            raw_keys,
            pooled,
            k_norm,
            keep,
            id,
            rot,
            ratio: cfg.indexer_compress_ratio,
            eps,
        });
        Ok(y)
    }

    /// MoE block (section 7): router, routed experts, shared expert.
    fn moe(&mut self, m: BufId, p: &str, t: &str, form: DrafterForm) -> R<BufId> {
        let cfg = self.cfg;
        let d = cfg.hidden_size;
        let k = cfg.num_experts_per_tok;
        let ids = self.arena(format!("{t}.expert_ids"), k as u64);
        let weights = self.arena(format!("{t}.expert_weights"), k as u64);
        let op = Op::Router {
            x: m,
            gate: self.w(&format!("{p}.gate.weight"))?,
            ids,
            weights,
            experts: cfg.num_experts,
            topk: k,
            dim: d,
            norm: cfg.norm_topk_prob,
        };
        self.push(op);
        let y = self.arena(format!("{t}.out"), d as u64);
        let op = Op::Experts {
            x: m,
            ids,
            weights,
            gate_up: self.wf(&format!("{p}.experts.gate_up_proj"), form)?,
            down: self.wf(&format!("{p}.experts.down_proj"), form)?,
            out: y,
            topk: k,
            dim: d,
            inter: cfg.moe_intermediate_size,
        };
        self.push(op);
        let op = Op::SharedExpert {
            x: m,
            gate: self.wf(&format!("{p}.shared_expert.gate_proj.weight"), form)?,
            up: self.wf(&format!("{p}.shared_expert.up_proj.weight"), form)?,
            down: self.wf(&format!("{p}.shared_expert.down_proj.weight"), form)?,
            scale: self.wf(&format!("{p}.shared_expert_gate.weight"), form)?,
            out: y,
            dim: d,
            inter: cfg.shared_expert_intermediate_size,
        };
        self.push(op);
        Ok(y)
    }

    /// The PLE layer `i`'s n-gram embedding and its key and value projections (section 8): they read only the
    /// window's tokens and the n-gram history, so `main_forward` emits them before layer 0 (the CUDA backend runs
    /// them beside layer 0 on its side stream: runtime/src/cuda/launch/ple.rs `branch_ple_prep`). Returns (key, value).
    fn ple_prep(&mut self, i: usize, ple_index: u32) -> R<(BufId, BufId)> {
        let cfg = self.cfg;
        let p = format!("layers.{i}.ple");
        let t = format!("l{i}.ple");
        let heads = cfg.ple_heads();
        let hdim = cfg.ple_embed_dim / heads;
        let pd = cfg.ple_embed_dim;
        let hc = cfg.hc_width();
        let u = self.arena(format!("{t}.embedding"), pd as u64);
        let history = self.s(&format!("layers.{i}.ple.history"))?;
        let op = Op::PleEmbed {
            tokens: TokenSrc::Desc,
            history,
            table: self.w(&format!("{p}.ple_embedding.ngram_embedding.weight"))?,
            out: u,
            ple_index,
            heads,
            head_dim: hdim,
        };
        self.push(op);
        let key = self.arena(format!("{t}.key"), hc as u64);
        let w = self.w(&format!("{p}.key_proj.weight"))?;
        self.linear(u, w, key, pd, hc);
        let value = self.arena(format!("{t}.value"), cfg.hidden_size as u64);
        let w = self.w(&format!("{p}.value_proj.weight"))?;
        self.linear(u, w, value, pd, cfg.hidden_size);
        Ok((key, value))
    }

    /// The PLE layer `i`'s injection into h (section 8) from its key and value ([`Self::ple_prep`]), and its commit.
    fn ple_mix(
        &mut self,
        h: BufId,
        i: usize,
        (key, value): (BufId, BufId),
        keep: KeepSrc,
        commits: &mut Vec<Op>,
    ) -> R<()> {
        let cfg = self.cfg;
        let p = format!("layers.{i}.ple");
        let t = format!("l{i}.ple");
        let hc = cfg.hc_width();
        let history = self.s(&format!("layers.{i}.ple.history"))?;
        let tail = self.s(&format!("layers.{i}.ple.tail"))?;
        let stash = self.arena(format!("{t}.conv_inputs"), hc as u64);
        let op = Op::PleMix {
            h,
            key,
            value,
            norm_key: self.w(&format!("{p}.norm_key.weight"))?,
            norm_query: self.w(&format!("{p}.norm_query.weight"))?,
            norm_conv: self.w(&format!("{p}.norm_conv.weight"))?,
            conv_w: self.w(&format!("{p}.conv1d.weight"))?,
            tail,
            stash,
            dim: cfg.hidden_size,
            hc: cfg.hc_count,
            kernel: cfg.ple_conv_kernel_size,
            dilation: cfg.ngram_size,
            eps: cfg.rms_norm_eps as f32,
        };
        self.push(op);
        commits.push(Op::PleCommit {
            tokens: TokenSrc::Desc,
            history,
            tail,
            stash,
            keep,
            width: hc,
        });
        Ok(())
    }

    /// The main model over the window's rows: embedding, every layer, the final mixer and `lm_head` into the
    /// logits io buffer. The residual lives in the `MainStreams` io buffer (the MTP absorb reads it). Returns the
    /// logits buffer and the commit ops to append once `keep` is known.
    pub fn main_forward(&mut self, keep: KeepSrc) -> R<(BufId, Vec<Op>)> {
        let cfg = self.cfg;
        let d = cfg.hidden_size as u64;
        let hcw = cfg.hc_width() as u64;
        let rows = self.rows;
        let h = self.io(IoBuf::MainStreams, rows * hcw);
        self.push(Op::EmbedStreams {
            tokens: TokenSrc::Desc,
            table: self.w("embed_tokens.weight")?,
            out: h,
            dim: cfg.hidden_size,
            copies: cfg.hc_count,
        });
        let mut commits = Vec::new();
        // Every PLE layer's embedding and projections first (layer order), each attributed to its layer.
        let ple_layer = |i: usize| {
            cfg.ple_layer_ids
                .iter()
                .position(|&id| id as usize == i + 1)
        };
        let mut ple_parts = Vec::new();
        for i in 0..cfg.layer_types.len() {
            if let Some(ple_index) = ple_layer(i) {
                self.layer = Some(i as u32);
                ple_parts.push((i, self.ple_prep(i, ple_index as u32)?));
            }
        }
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            self.layer = Some(i as u32);
            if let Some(&(_, parts)) = ple_parts.iter().find(|(l, _)| *l == i) {
                self.ple_mix(h, i, parts, keep, &mut commits)?;
            }
            let (a, inj) = self.hc_read(
                h,
                &format!("layers.{i}.attn_hyper_connection"),
                &format!("l{i}.attn_hc"),
                true,
                DrafterForm::Checkpoint,
            )?;
            let y = match kind {
                LayerKind::Gdn => self.gdn(a, i, keep, &mut commits)?,
                LayerKind::Attention => self.attention(
                    a,
                    &format!("layers.{i}.self_attn"),
                    &format!("layers.{i}.attn"),
                    &format!("l{i}.attn"),
                    keep,
                    &mut commits,
                    DrafterForm::Checkpoint,
                )?,
            };
            let inj = inj.ok_or_else(|| GraphError::MissingWeight("block_inject_weight".into()))?;
            self.push(Op::HcWrite {
                h,
                y,
                inj,
                dim: cfg.hidden_size,
                hc: cfg.hc_count,
            });
            let (m, inj) = self.hc_read(
                h,
                &format!("layers.{i}.mlp_hyper_connection"),
                &format!("l{i}.mlp_hc"),
                true,
                DrafterForm::Checkpoint,
            )?;
            let y = self.moe(
                m,
                &format!("layers.{i}.mlp"),
                &format!("l{i}.moe"),
                DrafterForm::Checkpoint,
            )?;
            let inj = inj.ok_or_else(|| GraphError::MissingWeight("block_inject_weight".into()))?;
            self.push(Op::HcWrite {
                h,
                y,
                inj,
                dim: cfg.hidden_size,
                hc: cfg.hc_count,
            });
        }
        self.layer = None;
        let (f, _) = self.hc_read(
            h,
            "hyper_connection_mixer",
            "final_mixer",
            false,
            DrafterForm::Checkpoint,
        )?;
        let logits = self.io(IoBuf::Logits, rows * cfg.vocab_size as u64);
        let w = self.w("lm_head.weight")?;
        self.linear(f, w, logits, d as u32, cfg.vocab_size);
        Ok((logits, commits))
    }

    /// One MTP step over `rows` entries (section 9): reads the input streams from `src` (main streams for an
    /// absorb, the MTP's own previous output for a chain step), writes its output streams to `MtpStreams`, the
    /// gathered logits of each stream's last entry, and samples a draft per stream.
    pub fn mtp_step(&mut self, src: IoBuf, form: DrafterForm, commit: bool) -> R<()> {
        let cfg = self.cfg;
        let d = cfg.hidden_size;
        let hcw = cfg.hc_width();
        let rows = self.rows;
        let src_buf = self.io(src, rows * hcw as u64);
        let e = self.arena("mtp.embedding".into(), d as u64);
        self.push(Op::Embed {
            tokens: TokenSrc::Desc,
            table: self.w("embed_tokens.weight")?,
            out: e,
            dim: d,
        });
        let eps = cfg.rms_norm_eps as f32;
        self.push(Op::RmsNorm {
            x: e,
            w: Some(self.w("mtp.pre_fc_norm_embedding.weight")?),
            out: e,
            dim: d,
            group: d,
            eps,
        });
        let e2 = self.arena("mtp.fc_embedding".into(), d as u64);
        let w = self.wf("mtp.fc_embedding.weight", form)?;
        self.linear(e, w, e2, d, d);
        // The input streams gathered just before their norm (the CUDA backend runs the pair as one launch).
        let r_in = self.arena("mtp.input_streams".into(), hcw as u64);
        self.push(Op::GatherRows {
            src: src_buf,
            out: r_in,
            width: hcw,
        });
        let hn = self.arena("mtp.hidden_normed".into(), hcw as u64);
        self.push(Op::RmsNorm {
            x: r_in,
            w: Some(self.w("mtp.pre_fc_norm_hidden.weight")?),
            out: hn,
            dim: hcw,
            group: hcw,
            eps,
        });
        let xh = self.arena("mtp.fc_hidden".into(), hcw as u64);
        let w = self.wf("mtp.fc_hidden.weight", form)?;
        self.push(Op::Linear {
            x: hn,
            w,
            out: xh,
            k: d,
            n: d,
            sub: cfg.hc_count,
            accumulate: false,
        });
        let x = self.io(IoBuf::MtpStreams, rows * hcw as u64);
        self.push(Op::AddBroadcast {
            a: xh,
            b: e2,
            out: x,
            width: hcw,
            b_width: d,
        });
        let keep = KeepSrc::AllRows;
        let mut commits = Vec::new();
        let (a, inj) = self.hc_read(
            x,
            "mtp.layers.0.attn_hyper_connection",
            "mtp.attn_hc",
            true,
            form,
        )?;
        let y = self.attention(
            a,
            "mtp.layers.0.self_attn",
            "mtp.attn",
            "mtp.attn",
            keep,
            &mut commits,
            form,
        )?;
        let inj = inj.ok_or_else(|| GraphError::MissingWeight("block_inject_weight".into()))?;
        self.push(Op::HcWrite {
            h: x,
            y,
            inj,
            dim: d,
            hc: cfg.hc_count,
        });
        let (m, inj) = self.hc_read(
            x,
            "mtp.layers.0.mlp_hyper_connection",
            "mtp.mlp_hc",
            true,
            form,
        )?;
        let y = self.moe(m, "mtp.layers.0.mlp", "mtp.moe", form)?;
        let inj = inj.ok_or_else(|| GraphError::MissingWeight("block_inject_weight".into()))?;
        self.push(Op::HcWrite {
            h: x,
            y,
            inj,
            dim: d,
            hc: cfg.hc_count,
        });
        let streams = self.streams;
        // Each stream's last row for the final mixer; with one row per stream (a chain step, a window of one) that
        // row is x itself, so the mixer reads x and no copy runs (and the runtime may then fuse the norm of that
        // read into the write before it).
        let last = if rows == streams {
            x
        } else {
            let last = self.arena_exact("mtp.last_streams".into(), streams * hcw as u64);
            self.push(Op::LastRows {
                x,
                out: last,
                width: hcw,
            });
            last
        };
        // The final mixer and the head run on one row per stream.
        let saved = self.rows;
        self.rows = streams;
        let (f, _) = self.hc_read(last, "mtp.hyper_connection_mixer", "mtp.mixer", false, form)?;
        let logits = self.io(IoBuf::Logits, streams * cfg.vocab_size as u64);
        let head = if form == DrafterForm::Mxfp8Head {
            self.w("lm_head.weight#mxfp8")?
        } else {
            self.w("lm_head.weight")?
        };
        self.linear(f, head, logits, d, cfg.vocab_size);
        let tokens = self.io(IoBuf::Sampled, streams);
        let probs = self.io(IoBuf::Probs, streams);
        self.push(Op::Sample {
            logits,
            tokens,
            probs: Some(probs),
            rows: SampleRows::MtpGathered,
            vocab: cfg.vocab_size,
        });
        self.rows = saved;
        if commit {
            for op in commits {
                self.push(op);
            }
        }
        Ok(())
    }

    /// The full node list of a variant kind.
    pub fn build(mut self, kind: VariantKind) -> R<(Vec<BufferDecl>, Vec<Node>)> {
        let cfg = self.cfg;
        match kind {
            VariantKind::Verify { .. } | VariantKind::Lone { .. } => {
                let keep_buf = self.io(IoBuf::Keep, self.streams);
                let (logits, commits) = self.main_forward(KeepSrc::Counted(keep_buf))?;
                let rows = self.rows;
                let sampled = self.io(IoBuf::Sampled, rows);
                self.push(Op::Sample {
                    logits,
                    tokens: sampled,
                    probs: None,
                    rows: SampleRows::All,
                    vocab: cfg.vocab_size,
                });
                self.push(Op::KeepCount {
                    sampled,
                    keep: keep_buf,
                });
                self.push_commits(commits);
            }
            VariantKind::Prefill { .. } => {
                let (logits, commits) = self.main_forward(KeepSrc::AllRows)?;
                let sampled = self.io(IoBuf::Sampled, self.streams);
                self.push(Op::Sample {
                    logits,
                    tokens: sampled,
                    probs: None,
                    rows: SampleRows::Last,
                    vocab: cfg.vocab_size,
                });
                self.push_commits(commits);
            }
            VariantKind::MtpAbsorb { form, .. } => self.mtp_step(IoBuf::MainStreams, form, true)?,
            VariantKind::MtpChain { form, .. } => self.mtp_step(IoBuf::MtpStreams, form, false)?,
        }
        crate::deps::fill_deps(&mut self.nodes);
        Ok((self.buffers, self.nodes))
    }

    fn push_commits(&mut self, commits: Vec<Op>) {
        for op in commits {
            self.layer = None;
            self.push(op);
        }
    }
}
