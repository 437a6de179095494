//! The op set: every kernel entry point a plan node may name, with its bound arguments.
//!
//! Row model: a variant runs `streams` windows of `window` rows each; row `r = s * window + j` is row `j` of stream
//! `s`. The round descriptor ([`crate::RoundDesc`]) gives each stream its slot, the absolute position of its row 0
//! and how many of its rows are real (`rows`); rows `j >= rows` are padding and every op skips them (writes nothing
//! for them), so padding can never change a real row. All arithmetic is row-invariant (`rounds.md` section 5): a
//! row's result never depends on the other rows of the variant, except through the causal state of its own stream
//! (attention caches and the GDN recurrence run over the stream's earlier rows in order).
//!
//! Activations are f32 (4-byte elements); index buffers (token ids, expert ids) hold `u32` values in the same 4-byte
//! elements. Matrices are row-major: a weight `[n, k]` maps `k` inputs to `n` outputs (`torch.nn.Linear` layout).

use serde::{Deserialize, Serialize};

use crate::config::GateAct;

/// A buffer of the variant: index into [`crate::Variant::buffers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BufId(pub u32);

/// A weight: index into [`crate::PlanBody::weights`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WeightId(pub u32);

/// A piece of per-slot state: index into [`crate::StateLayout::pieces`]; addressed at the stream's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StateId(pub u32);

/// Where the token ids an op reads come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TokenSrc {
    /// The descriptor's `tokens[r]` (the window: pending token then drafts; for MTP steps the next token x_{i+1}).
    Desc,
}

/// How many rows of each stream a commit op keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeepSrc {
    /// `keep[s]` as counted on the device by [`Op::KeepCount`] (verify rounds).
    Counted(BufId),
    /// All real rows of the stream (`rows` of its descriptor): prefill chunks and MTP absorbs.
    AllRows,
}

/// Which rows [`Op::Sample`] samples and at which position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SampleRows {
    /// Every real row `j` of every stream (logits `[R, V]`); the token sampled at row `j` takes position
    /// `pos + j + 1`. Outputs one token per row (`u32::MAX` for padding rows).
    All,
    /// Each stream's last real row of `[R, V]` logits; the token takes position `pos + rows` (prefill: the first
    /// reply token). Outputs one token per stream.
    Last,
    /// Logits already gathered to one row per stream (`[S, V]`, MTP steps): an entry at position `pos + rows - 1`
    /// predicts the token at position `pos + rows + 1`. Outputs one token per stream.
    MtpGathered,
}

/// One kernel launch. Each variant's node list is an ordered list of these (see [`crate::Node`]).
///
/// Every op documents its source; shapes use `R` = rows of the variant, `S` = streams, `D` = hidden size,
/// `C` = `hc_count`, `V` = vocab size.
/// Field meanings are given in each variant's description.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// `out[r, c*D + d] = embed_tokens[tok[r], d]` for every stream `c` (the embedding repeated into the
    /// hyper-connection streams, `Qwen4ExpTextModel.forward`). `out`: `[R, C*D]`.
    EmbedStreams {
        tokens: TokenSrc,
        table: WeightId,
        out: BufId,
        dim: u32,
        copies: u32,
    },
    /// `out[r, :] = embed_tokens[tok[r], :]` (`[R, D]`).
    Embed {
        tokens: TokenSrc,
        table: WeightId,
        out: BufId,
        dim: u32,
    },
    /// Gathers rows of another buffer: `out[s*w + j] = src[src_row(s) + j]` where `src_row` is the descriptor's
    /// `src_row` of stream `s` (MTP steps read the main model's residual streams or their own previous output).
    /// `width` elements per row, `w` = the variant's window.
    GatherRows { src: BufId, out: BufId, width: u32 },
    /// `out[s] = x[s*window + rows(s) - 1]`: each stream's last real row (`width` elements), `out`: `[S, width]`.
    LastRows { x: BufId, out: BufId, width: u32 },
    /// Zero-centred RMSNorm, `Qwen4ExpTextRMSNorm`: for each group of `group` values,
    /// `y = x * rsqrt(mean(x^2) + eps) * (1 + w)`, `w` of length `dim` (`dim` a multiple of `group`); with
    /// `w = None`, `y = x * rsqrt(..)`. Rows of `dim` values; `out` may alias `x`.
    RmsNorm {
        x: BufId,
        w: Option<WeightId>,
        out: BufId,
        dim: u32,
        group: u32,
        eps: f32,
    },
    /// `out[r, n] (+)= sum_k x[r, k] * w[n, k]` with a fixed reduction order per output (`nn.Linear`, no bias).
    /// `x`: `[R * sub, k]` (sub-rows: e.g. the C hyper-connection streams of a row), `w`: `[n, k]`, `out`:
    /// `[R * sub, n]`. With `accumulate`, adds to `out`.
    Linear {
        x: BufId,
        w: WeightId,
        out: BufId,
        k: u32,
        n: u32,
        sub: u32,
        accumulate: bool,
    },
    /// `out[r, i] = a[r, i] + b[r, i % b_width]` broadcast add (MTP: `X[c] = fc_hidden(hn[c]) + e`).
    AddBroadcast {
        a: BufId,
        b: BufId,
        out: BufId,
        width: u32,
        b_width: u32,
    },
    /// Hyper-connection read, `Qwen4ExpTextGatedResidual.forward` (`flash-next.md` section 4), fused:
    /// `Hn = grouped RMSNorm(H, hc_norm)`, `lo = silu(W_down Hn / C)`, `g = sigmoid(W_up lo)`,
    /// `a = mean_c(g[c] * Hn[c])` -> `out` `[R, D]`; with `inject`, `inj = 2 sigmoid(W_inject Hn / C)` -> `inj`
    /// `[R, C]`. `h`: `[R, C*D]` (unchanged).
    HcRead {
        h: BufId,
        norm: WeightId,
        down: WeightId,
        up: WeightId,
        inject: Option<(WeightId, BufId)>,
        out: BufId,
        dim: u32,
        hc: u32,
        rank: u32,
        eps: f32,
    },
    /// Hyper-connection write: `h[r, c*D + d] += inj[r, c] * y[r, d]`.
    HcWrite {
        h: BufId,
        y: BufId,
        inj: BufId,
        dim: u32,
        hc: u32,
    },
    /// PLE n-gram embedding (`Qwen4ExpTextNGramEmbedding.forward`, `flash-next.md` section 8): for each row, the
    /// token history (the slot's last `ngram_size - 1` ids from `history`, then the window's tokens up to the row)
    /// with eos resets, hashed into `heads` ids, gathered from `table` (`[rows_padded, head_dim]`) and concatenated:
    /// `out` `[R, heads * head_dim]`. Also writes the row's n-gram ids to `ids_out` (`[R, heads]`, u32) for tests.
    PleEmbed {
        tokens: TokenSrc,
        history: StateId,
        table: WeightId,
        out: BufId,
        ple_index: u32,
        heads: u32,
        head_dim: u32,
    },
    /// PLE mixing and injection (`Qwen4ExpTextPLELayer.forward`): with `kn = norm_key(key)` and
    /// `qn = norm_query(h)` (grouped by D), per stream `s = (kn[c] . qn[c]) / sqrt(D)`,
    /// `gate = sign(s) sqrt(max(|s|, 1e-6))`, `G[c] = sigmoid(gate) v`; `Gn = norm_conv(G)`; the dilated depthwise
    /// conv (kernel `kernel`, dilation `dilation`) runs over the slot's `tail` (last `(kernel-1)*dilation` values
    /// of `Gn`) followed by the window's `Gn` rows; `h += G + silu(conv)`. `stash` receives each row's `Gn`
    /// (`[R, C*D]`) for the commit. `key`: `[R, C*D]`, `value`: `[R, D]`, `conv_w`: `[C*D, 1, kernel]`.
    PleMix {
        h: BufId,
        key: BufId,
        value: BufId,
        norm_key: WeightId,
        norm_query: WeightId,
        norm_conv: WeightId,
        conv_w: WeightId,
        tail: StateId,
        stash: BufId,
        dim: u32,
        hc: u32,
        kernel: u32,
        dilation: u32,
        eps: f32,
    },
    /// PLE commit for `keep` rows: the history becomes the last `ngram_size - 1` ids ending at the last kept row
    /// (raw ids; eos handling happens when hashing) and the conv tail the last `(kernel-1)*dilation` `Gn` rows.
    PleCommit {
        tokens: TokenSrc,
        history: StateId,
        tail: StateId,
        stash: BufId,
        keep: KeepSrc,
        width: u32,
    },
    /// GDN causal depthwise conv1d with SiLU (`causal_conv1d_update`): `out[j] = silu(sum_t w[:, t] *
    /// seq[j + t])` over the sequence (slot `state` = last `kernel-1` raw inputs, then the window's raw rows `x`).
    /// `x`, `out`: `[R, channels]`, `w`: `[channels, 1, kernel]`.
    GdnConv {
        x: BufId,
        w: WeightId,
        state: StateId,
        out: BufId,
        channels: u32,
        kernel: u32,
    },
    /// GDN recurrence (`torch_recurrent_gated_delta_rule`, `flash-next.md` section 5) over the window rows in order
    /// from the slot's state (the slot state is NOT modified: [`Op::GdnCommit`] replays the kept rows). Per row:
    /// `q, k = l2norm(q), l2norm(k)` (eps 1e-6), `q /= sqrt(dk)`, `beta = sigmoid(b)`,
    /// `g = -exp(A_log) softplus(a + dt_bias)`; per value head `S = S exp(g); S += k (beta (v - S^T k))^T;
    /// o = S^T q`. `qkv`: `[R, 2*hk*dk + hv*dv]` (post-conv), `b`, `a`: `[R, hv]`, `out`: `[R, hv*dv]`;
    /// `stash`: `[R, hk*dk + hv*dv + 2*hv]` (normalised k, v, g, beta of each row).
    GdnRecur {
        qkv: BufId,
        b: BufId,
        a: BufId,
        a_log: WeightId,
        dt_bias: WeightId,
        state: StateId,
        out: BufId,
        stash: BufId,
        hk: u32,
        hv: u32,
        dk: u32,
        dv: u32,
    },
    /// GDN commit: replays the first `keep` rows' stashed (k, v, g, beta) into the slot state with the same update
    /// routine as [`Op::GdnRecur`] (bit-identical to plain decoding), and sets the conv state to the last
    /// `kernel-1` raw inputs ending at the last kept row (`raw`: the window's pre-conv rows).
    GdnCommit {
        stash: BufId,
        raw: BufId,
        state: StateId,
        conv: StateId,
        keep: KeepSrc,
        hk: u32,
        hv: u32,
        dk: u32,
        dv: u32,
        channels: u32,
        kernel: u32,
    },
    /// Gated RMSNorm (`Qwen3NextRMSNormGated`): per head of `dim`, `y = w * (x * rsqrt(mean(x^2) + eps)) * act(z)`.
    /// `x`, `z`, `out`: `[R, heads*dim]`, `w`: `[dim]`.
    GatedNorm {
        x: BufId,
        z: BufId,
        w: WeightId,
        out: BufId,
        heads: u32,
        dim: u32,
        act: GateAct,
        eps: f32,
    },
    /// Attention projections' epilogue (`Qwen3_5Attention.forward` with `Qwen4ExpTextAttention`): splits `q_raw`
    /// (`[R, heads*2*hd]`, per head `hd` query values then `hd` gate values) into `q` (`[R, heads*hd]`) and `gate`
    /// (`[R, heads*hd]`); applies `q_norm`/`k_norm` (zero-centred RMSNorm over `hd`) and RoPE (first `rot` dims,
    /// rotate-half, cos/sin scaled by the attention factor) at the row's position; writes the roped key and the
    /// value of every real row into the slot's `k_cache`, `v_cache` (`[ctx, kv_heads, hd]`) at `pos + j`.
    AttnPrep {
        q_raw: BufId,
        k_raw: BufId,
        v_raw: BufId,
        q_norm: WeightId,
        k_norm: WeightId,
        q: BufId,
        gate: BufId,
        k_cache: StateId,
        v_cache: StateId,
        heads: u32,
        kv_heads: u32,
        hd: u32,
        rot: u32,
        eps: f32,
    },
    /// QSA indexer queries and keys (`Qwen4ExpTextQSAIndexer.forward`): `qk` `[R, (ih+1)*id]` splits into queries
    /// (q_layernorm, then RoPE at the row's position on the first `rot` dims) -> `q_out` `[R, ih*id]`, and the raw
    /// token key (no norm, no RoPE) written to the slot's `raw_keys` `[ctx, id]` at `pos + j`.
    IndexerPrep {
        qk: BufId,
        q_norm: WeightId,
        q_out: BufId,
        raw_keys: StateId,
        ih: u32,
        id: u32,
        rot: u32,
        eps: f32,
    },
    /// QSA block selection: for the row at position `p`, visible tokens `0..=p` form `nb = (p+1)/ratio` complete
    /// blocks and a tail. Block key = RoPE(k_layernorm(mean of its `ratio` raw keys), block start) — read from the
    /// slot's `pooled` cache for blocks that end at or before the stream's `committed` length, computed from
    /// `raw_keys` otherwise. Score = `sum_h relu(q_h . k_b) / sqrt(id)` in f32; keeps the top `topk` blocks (ties to the lower
    /// block id), sorted by block id. `sel` `[R, topk]` (u32 block ids, `u32::MAX` past the count).
    IndexerSelect {
        q: BufId,
        k_norm: WeightId,
        raw_keys: StateId,
        pooled: StateId,
        sel: BufId,
        ih: u32,
        id: u32,
        rot: u32,
        ratio: u32,
        topk: u32,
        eps: f32,
    },
    /// Sparse attention over the selected blocks' tokens plus the tail (all visible tokens when `nb <= topk`),
    /// softmax(q.k / sqrt(hd)) v per head (GQA: head `h` reads kv head `h / (heads / kv_heads)`), then
    /// `out = attn * sigmoid(gate)` (`[R, heads*hd]`).
    SparseAttn {
        q: BufId,
        gate: BufId,
        sel: BufId,
        k_cache: StateId,
        v_cache: StateId,
        out: BufId,
        heads: u32,
        kv_heads: u32,
        hd: u32,
        ratio: u32,
        topk: u32,
    },
    /// Pools the blocks completed by the kept rows (blocks from `committed / ratio` up to those ending at or before
    /// `pos + keep`) into the slot's `pooled` cache: RoPE(k_layernorm(mean of raw keys), block start).
    IndexerCommit {
        raw_keys: StateId,
        pooled: StateId,
        k_norm: WeightId,
        keep: KeepSrc,
        id: u32,
        rot: u32,
        ratio: u32,
        eps: f32,
    },
    /// MoE router (`Qwen3NextTopKRouter`, f32 logits kept in f32 — `flash-next.md` section 7): `logits = gate x`,
    /// softmax, top-`topk` (ties to the lower expert), renormalised when `norm`. `ids`: `[R, topk]` u32 (by rank),
    /// `weights`: `[R, topk]`.
    Router {
        x: BufId,
        gate: WeightId,
        ids: BufId,
        weights: BufId,
        experts: u32,
        topk: u32,
        dim: u32,
        norm: bool,
    },
    /// Routed experts (SwiGLU, `Qwen3NextExperts`): `out[r] = sum over rank i (in rank order) of
    /// weights[r, i] * down_e (silu(gate_e x) * up_e x)` with `gate_up` `[E, 2I, D]` (gate rows then up rows),
    /// `down` `[E, D, I]`.
    Experts {
        x: BufId,
        ids: BufId,
        weights: BufId,
        gate_up: WeightId,
        down: WeightId,
        out: BufId,
        topk: u32,
        dim: u32,
        inter: u32,
    },
    /// Shared expert (`Qwen3NextSparseMoeBlock`): `out += sigmoid(shared_expert_gate x) * down(silu(gate x) * up x)`.
    SharedExpert {
        x: BufId,
        gate: WeightId,
        up: WeightId,
        down: WeightId,
        scale: WeightId,
        out: BufId,
        dim: u32,
        inter: u32,
    },
    /// Keyed sampling (`rounds.md` section 4) with the stream's sampling parameters from the descriptor.
    /// `logits`: `[rows, V]`; `tokens`: one u32 per sampled row; `probs`: the sampled token's probability under
    /// softmax at temperature 1, one f32 per sampled row: the MTP confidence (`rounds.md` section 2), so only the
    /// MTP step's sampling has one; `None` (the main model's rounds, whose probabilities nothing reads: logprobs are
    /// not served) computes none.
    Sample {
        logits: BufId,
        tokens: BufId,
        probs: Option<BufId>,
        rows: SampleRows,
        vocab: u32,
    },
    /// Keep counting (`rounds.md` section 1): `keep[s] = 1 + #leading j with tokens[s*w + j + 1] == sampled[s*w + j]`
    /// over the stream's real rows. `keep`: `[S]` u32.
    KeepCount { sampled: BufId, keep: BufId },
}

impl Op {
    /// The kernel entry point that runs this op (CUDA function name; the CPU backend's twin has the same name).
    pub fn kernel(&self) -> &'static str {
        match self {
            Op::EmbedStreams { .. } => "embed_streams",
            Op::Embed { .. } => "embed",
            Op::GatherRows { .. } => "gather_rows",
            Op::LastRows { .. } => "last_rows",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Linear { .. } => "linear",
            Op::AddBroadcast { .. } => "add_broadcast",
            Op::HcRead { .. } => "hc_read",
            Op::HcWrite { .. } => "hc_write",
            Op::PleEmbed { .. } => "ple_embed",
            Op::PleMix { .. } => "ple_mix",
            Op::PleCommit { .. } => "ple_commit",
            Op::GdnConv { .. } => "gdn_conv",
            Op::GdnRecur { .. } => "gdn_recur",
            Op::GdnCommit { .. } => "gdn_commit",
            Op::GatedNorm { .. } => "gated_norm",
            Op::AttnPrep { .. } => "attn_prep",
            Op::IndexerPrep { .. } => "indexer_prep",
            Op::IndexerSelect { .. } => "indexer_select",
            Op::SparseAttn { .. } => "sparse_attn",
            Op::IndexerCommit { .. } => "indexer_commit",
            Op::Router { .. } => "router",
            Op::Experts { .. } => "experts",
            Op::SharedExpert { .. } => "shared_expert",
            Op::Sample { .. } => "sample",
            Op::KeepCount { .. } => "keep_count",
        }
    }

    /// Buffers this op reads (for validation and liveness).
    pub fn reads(&self) -> Vec<BufId> {
        use Op::*;
        let keep = |k: &KeepSrc| match k {
            KeepSrc::Counted(b) => vec![*b],
            KeepSrc::AllRows => vec![],
        };
        match self {
            EmbedStreams { .. } | Embed { .. } | PleEmbed { .. } => vec![],
            GatherRows { src, .. } => vec![*src],
            LastRows { x, .. } => vec![*x],
            RmsNorm { x, .. } => vec![*x],
            Linear {
                x, out, accumulate, ..
            } => {
                if *accumulate {
                    vec![*x, *out]
                } else {
                    vec![*x]
                }
            }
            AddBroadcast { a, b, .. } => vec![*a, *b],
            HcRead { h, .. } => vec![*h],
            HcWrite { h, y, inj, .. } => vec![*h, *y, *inj],
            PleMix { h, key, value, .. } => vec![*h, *key, *value],
            PleCommit { stash, keep: k, .. } => [vec![*stash], keep(k)].concat(),
            GdnConv { x, .. } => vec![*x],
            GdnRecur { qkv, b, a, .. } => vec![*qkv, *b, *a],
            GdnCommit {
                stash,
                raw,
                keep: k,
                ..
            } => [vec![*stash, *raw], keep(k)].concat(),
            GatedNorm { x, z, .. } => vec![*x, *z],
            AttnPrep {
                q_raw,
                k_raw,
                v_raw,
                ..
            } => vec![*q_raw, *k_raw, *v_raw],
            IndexerPrep { qk, .. } => vec![*qk],
            IndexerSelect { q, .. } => vec![*q],
            SparseAttn { q, gate, sel, .. } => vec![*q, *gate, *sel],
            IndexerCommit { keep: k, .. } => keep(k),
            Router { x, .. } => vec![*x],
            Experts {
                x, ids, weights, ..
            } => vec![*x, *ids, *weights],
            SharedExpert { x, out, .. } => vec![*x, *out],
            Sample { logits, .. } => vec![*logits],
            KeepCount { sampled, .. } => vec![*sampled],
        }
    }

    /// Buffers this op writes (for validation and liveness).
    pub fn writes(&self) -> Vec<BufId> {
        use Op::*;
        match self {
            EmbedStreams { out, .. }
            | Embed { out, .. }
            | GatherRows { out, .. }
            | LastRows { out, .. } => vec![*out],
            RmsNorm { out, .. } | Linear { out, .. } | AddBroadcast { out, .. } => vec![*out],
            HcRead { out, inject, .. } => match inject {
                Some((_, inj)) => vec![*out, *inj],
                None => vec![*out],
            },
            HcWrite { h, .. } => vec![*h],
            PleEmbed { out, .. } => vec![*out],
            PleMix { h, stash, .. } => vec![*h, *stash],
            PleCommit { .. } | GdnCommit { .. } | IndexerCommit { .. } => vec![],
            GdnConv { out, .. } => vec![*out],
            GdnRecur { out, stash, .. } => vec![*out, *stash],
            GatedNorm { out, .. } => vec![*out],
            AttnPrep { q, gate, .. } => vec![*q, *gate],
            IndexerPrep { q_out, .. } => vec![*q_out],
            IndexerSelect { sel, .. } => vec![*sel],
            SparseAttn { out, .. } => vec![*out],
            Router { ids, weights, .. } => vec![*ids, *weights],
            Experts { out, .. } | SharedExpert { out, .. } => vec![*out],
            Sample { tokens, probs, .. } => std::iter::once(*tokens).chain(*probs).collect(),
            KeepCount { keep, .. } => vec![*keep],
        }
    }

    /// Weights this op reads.
    pub fn weights(&self) -> Vec<WeightId> {
        use Op::*;
        match self {
            EmbedStreams { table, .. } | Embed { table, .. } | PleEmbed { table, .. } => {
                vec![*table]
            }
            RmsNorm { w, .. } => w.iter().copied().collect(),
            Linear { w, .. } => vec![*w],
            HcRead {
                norm,
                down,
                up,
                inject,
                ..
            } => {
                let mut v = vec![*norm, *down, *up];
                if let Some((w, _)) = inject {
                    v.push(*w);
                }
                v
            }
            PleMix {
                norm_key,
                norm_query,
                norm_conv,
                conv_w,
                ..
            } => vec![*norm_key, *norm_query, *norm_conv, *conv_w],
            GdnConv { w, .. } => vec![*w],
            GdnRecur { a_log, dt_bias, .. } => vec![*a_log, *dt_bias],
            GatedNorm { w, .. } => vec![*w],
            AttnPrep { q_norm, k_norm, .. } => vec![*q_norm, *k_norm],
            IndexerPrep { q_norm, .. } => vec![*q_norm],
            IndexerSelect { k_norm, .. } | IndexerCommit { k_norm, .. } => vec![*k_norm],
            Router { gate, .. } => vec![*gate],
            Experts { gate_up, down, .. } => vec![*gate_up, *down],
            SharedExpert {
                gate,
                up,
                down,
                scale,
                ..
            } => vec![*gate, *up, *down, *scale],
            _ => vec![],
        }
    }

    /// State pieces this op reads or writes.
    pub fn states(&self) -> Vec<StateId> {
        use Op::*;
        match self {
            PleEmbed { history, .. } => vec![*history],
            PleMix { tail, .. } => vec![*tail],
            PleCommit { history, tail, .. } => vec![*history, *tail],
            GdnConv { state, .. } | GdnRecur { state, .. } => vec![*state],
            GdnCommit { state, conv, .. } => vec![*state, *conv],
            AttnPrep {
                k_cache, v_cache, ..
            }
            | SparseAttn {
                k_cache, v_cache, ..
            } => vec![*k_cache, *v_cache],
            IndexerPrep { raw_keys, .. } => vec![*raw_keys],
            IndexerSelect {
                raw_keys, pooled, ..
            }
            | IndexerCommit {
                raw_keys, pooled, ..
            } => vec![*raw_keys, *pooled],
            _ => vec![],
        }
    }
}
