//! `inspect`: a plan set for people (a compact text report) and for CI (a JSON report). Pure functions of the
//! [`PlanSet`]; [`inspect_path`] also loads the file (a plan file, or a directory holding `plans.fplan`).
//!
//! Node counts per layer are shown for every variant because they decide launch overhead: inside a CUDA graph a
//! kernel node costs on the order of a microsecond, so `nodes x 1 us` is the floor a round pays before any work.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use flashplan_plan::{
    IoBuf, LayerKind, Op, PlanBody, PlanSet, StateKind, StorageForm, Variant, VariantKind,
    WeightGroup,
};
use serde_json::{json, Value};

/// The file name `flashplan compile` (and `flashplan-compile`) writes inside its output directory.
pub const PLAN_FILE: &str = "plans.fplan";

const GROUPS: [WeightGroup; 4] = [
    WeightGroup::Main,
    WeightGroup::Mtp,
    WeightGroup::MtpMxfp8,
    WeightGroup::HeadMxfp8,
];
const FORMS: [StorageForm; 4] = [
    StorageForm::F32,
    StorageForm::Bf16,
    StorageForm::Fp8Block,
    StorageForm::Mxfp8,
];
const IOS: [IoBuf; 6] = [
    IoBuf::MainStreams,
    IoBuf::MtpStreams,
    IoBuf::Logits,
    IoBuf::Sampled,
    IoBuf::Probs,
    IoBuf::Keep,
];
const STATE_KINDS: [StateKind; 8] = [
    StateKind::GdnRecurrent,
    StateKind::GdnConv,
    StateKind::KCache,
    StateKind::VCache,
    StateKind::IndexerRawKeys,
    StateKind::IndexerPooled,
    StateKind::PleHistory,
    StateKind::PleTail,
];

/// Resolves `path` to a plan file: a file is taken as is, a directory must hold [`PLAN_FILE`].
pub fn plan_file(path: &Path) -> anyhow::Result<PathBuf> {
    if path.is_dir() {
        let f = path.join(PLAN_FILE);
        anyhow::ensure!(
            f.is_file(),
            "{}: directory holds no {PLAN_FILE} (compile it with `flashplan compile --model MODEL_DIR --out {}`, or \
             `--config CONFIG_JSON` in place of --model)",
            path.display(),
            path.display()
        );
        Ok(f)
    } else if path.is_file() {
        Ok(path.to_path_buf())
    } else {
        anyhow::bail!("{}: no such plan file or directory", path.display())
    }
}

/// Loads and checks a plan set from a plan file or a directory holding [`PLAN_FILE`].
pub fn load_path(path: &Path) -> anyhow::Result<(PathBuf, PlanSet)> {
    let file = plan_file(path)?;
    let set = PlanSet::read(&file).with_context(|| format!("loading plans {}", file.display()))?;
    Ok((file, set))
}

/// What [`inspect_path`] prints.
#[derive(Debug, Clone, Copy, Default)]
pub struct InspectOptions {
    /// The JSON report instead of the text one.
    pub json: bool,
    /// In the text report, one line per variant instead of one per group.
    pub all: bool,
}

/// Loads a plan (file, or directory holding [`PLAN_FILE`]) and renders its report (`flashplan plans inspect`).
pub fn inspect_path(path: &Path, opts: InspectOptions) -> anyhow::Result<String> {
    let (file, set) = load_path(path)?;
    if opts.json {
        let mut v = report_json(&set);
        v["file"] = json!(file.display().to_string());
        Ok(serde_json::to_string_pretty(&v)? + "\n")
    } else {
        Ok(format!(
            "plan file: {}\n{}",
            file.display(),
            report_human(&set, opts.all)
        ))
    }
}

/// Per-slot state bytes (device layout) by piece kind, in `STATE_KINDS` order, for the kinds present.
pub fn state_bytes_by_kind(body: &PlanBody) -> Vec<(StateKind, u64)> {
    STATE_KINDS
        .iter()
        .filter_map(|&k| {
            let pieces: Vec<_> = body.state.pieces.iter().filter(|p| p.kind == k).collect();
            (!pieces.is_empty()).then(|| {
                (
                    k,
                    pieces
                        .iter()
                        .map(|p| p.elems() * p.elem.size())
                        .sum::<u64>(),
                )
            })
        })
        .collect()
}

/// Weight bytes of one group by storage form (forms present only).
pub fn weight_bytes_by_form(body: &PlanBody, group: WeightGroup) -> Vec<(StorageForm, u64)> {
    FORMS
        .iter()
        .filter_map(|&f| {
            let b: u64 = body
                .weights
                .iter()
                .filter(|w| w.group == group && w.form == f)
                .map(|w| w.bytes)
                .sum();
            (b > 0).then_some((f, b))
        })
        .collect()
}

/// The decoder layer a node belongs to. Commit nodes are appended after the last layer with `layer: None`; they
/// are attributed to the layer of the state they update, since they are that layer's launches all the same.
pub fn node_layer(body: &PlanBody, op: &Op, layer: Option<u32>) -> Option<u32> {
    if layer.is_some() {
        return layer;
    }
    match op {
        Op::GdnCommit { .. } | Op::IndexerCommit { .. } | Op::PleCommit { .. } => op
            .states()
            .first()
            .and_then(|s| body.state.pieces.get(s.0 as usize))
            .and_then(|p| p.layer),
        _ => None,
    }
}

/// Node-count figures of one variant.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantStats {
    /// Stable name (`verify-s4-w3`).
    pub name: String,
    /// Rows (streams x window).
    pub rows: u32,
    /// All nodes.
    pub nodes: usize,
    /// Nodes per decoder layer, by layer index (commits included).
    pub per_layer: Vec<usize>,
    /// Nodes outside the decoder layers (embedding, head, sampling, MTP).
    pub outside_layers: usize,
    /// (min, max) nodes of a GDN layer (`None` when the variant runs no decoder layer).
    pub per_gdn_layer: Option<(usize, usize)>,
    /// (min, max) nodes of an attention layer.
    pub per_attention_layer: Option<(usize, usize)>,
    /// Nodes per kernel entry point.
    pub per_kernel: BTreeMap<&'static str, usize>,
    /// Arena bytes with liveness-based reuse.
    pub arena_bytes: u64,
    /// Arena bytes without reuse.
    pub arena_bytes_no_reuse: u64,
}

fn min_max(it: impl Iterator<Item = usize>) -> Option<(usize, usize)> {
    it.fold(None, |acc, x| match acc {
        None => Some((x, x)),
        Some((a, b)) => Some((a.min(x), b.max(x))),
    })
}

/// Computes the figures of one variant.
pub fn variant_stats(body: &PlanBody, v: &Variant) -> VariantStats {
    let cfg = &body.config;
    let mut per_layer = vec![0usize; cfg.layer_types.len()];
    let mut outside = 0;
    let mut per_kernel = BTreeMap::new();
    for n in &v.nodes {
        *per_kernel.entry(n.op.kernel()).or_insert(0) += 1;
        match node_layer(body, &n.op, n.layer) {
            Some(l) if (l as usize) < per_layer.len() => per_layer[l as usize] += 1,
            _ => outside += 1,
        }
    }
    let of_kind = |k: LayerKind| {
        min_max(
            cfg.layer_types
                .iter()
                .enumerate()
                .filter(|(i, t)| **t == k && per_layer[*i] > 0)
                .map(|(i, _)| per_layer[i]),
        )
    };
    let (s, w) = v.kind.shape();
    VariantStats {
        name: v.kind.name(),
        rows: s * w,
        nodes: v.nodes.len(),
        per_gdn_layer: of_kind(LayerKind::Gdn),
        per_attention_layer: of_kind(LayerKind::Attention),
        per_layer,
        outside_layers: outside,
        per_kernel,
        arena_bytes: v.arena_elems * 4,
        arena_bytes_no_reuse: v.arena_elems_no_reuse * 4,
    }
}

/// The group a variant is listed under in the compact report: `verify-s4`, `lone`, `prefill`,
/// `mtp-absorb-checkpoint`, `mtp-chain-mxfp8`...
pub fn variant_group(kind: &VariantKind) -> String {
    match *kind {
        VariantKind::Verify { streams, .. } => format!("verify-s{streams}"),
        VariantKind::Lone { .. } => "lone".into(),
        VariantKind::Prefill { .. } => "prefill".into(),
        VariantKind::MtpAbsorb { form, .. } => format!("mtp-absorb-{}", form.name()),
        VariantKind::MtpChain { form, .. } => format!("mtp-chain-{}", form.name()),
    }
}

fn kind_json(kind: &VariantKind) -> Value {
    match *kind {
        VariantKind::Verify { streams, window } => {
            json!({"type": "verify", "streams": streams, "window": window})
        }
        VariantKind::Lone { window } => json!({"type": "lone", "streams": 1, "window": window}),
        VariantKind::Prefill { chunk } => json!({"type": "prefill", "streams": 1, "chunk": chunk}),
        VariantKind::MtpAbsorb {
            streams,
            window,
            form,
        } => {
            json!({"type": "mtp-absorb", "streams": streams, "window": window, "form": form.name()})
        }
        VariantKind::MtpChain { streams, form } => {
            json!({"type": "mtp-chain", "streams": streams, "form": form.name()})
        }
    }
}

fn mm_json(x: Option<(usize, usize)>) -> Value {
    match x {
        Some((a, b)) => json!({"min": a, "max": b}),
        None => Value::Null,
    }
}

fn config_summary(body: &PlanBody) -> Value {
    let c = &body.config;
    let gdn = c
        .layer_types
        .iter()
        .filter(|k| **k == LayerKind::Gdn)
        .count();
    json!({
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "gdn_layers": gdn,
        "attention_layers": c.layer_types.len() - gdn,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rotary_dim": c.rotary_dim(),
        "rope_type": c.rope.rope_type,
        "linear_heads": format!("{}k/{}v x {}/{}", c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
        "hc_count": c.hc_count,
        "hc_lowrank": c.hc_lowrank,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
        "ple_layer_ids": c.ple_layer_ids,
        "ple_embed_dim": c.ple_embed_dim,
        "indexer": format!("{} heads x {}, budget {}, ratio {}", c.indexer_n_heads, c.indexer_head_dim, c.indexer_budget, c.indexer_compress_ratio),
        "mtp": c.mtp.is_some(),
        "declared_form": format!("{:?}", c.declared_form),
        "eos_token_ids": c.eos_token_ids,
    })
}

/// The JSON report (everything the text report shows, every variant included).
pub fn report_json(set: &PlanSet) -> Value {
    let b = &set.body;
    let h = &set.header;
    let weights: Value = GROUPS
        .iter()
        .map(|&g| {
            let forms: serde_json::Map<String, Value> = weight_bytes_by_form(b, g)
                .into_iter()
                .map(|(f, n)| (format!("{f:?}"), json!(n)))
                .collect();
            (
                format!("{g:?}"),
                json!({"bytes": b.group_bytes(g), "tensors": b.weights.iter().filter(|w| w.group == g).count(), "by_form": forms}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into();
    let state_kinds: serde_json::Map<String, Value> = state_bytes_by_kind(b)
        .into_iter()
        .map(|(k, n)| (format!("{k:?}"), json!(n)))
        .collect();
    let io: serde_json::Map<String, Value> = IOS
        .iter()
        .map(|&io| (format!("{io:?}"), json!(b.io.elems(io, &b.config) * 4)))
        .collect();
    let variants: Vec<Value> = b
        .variants
        .iter()
        .map(|v| {
            let s = variant_stats(b, v);
            json!({
                "name": s.name,
                "kind": kind_json(&v.kind),
                "group": variant_group(&v.kind),
                "rows": s.rows,
                "nodes": s.nodes,
                "nodes_per_layer": s.per_layer,
                "nodes_outside_layers": s.outside_layers,
                "nodes_per_gdn_layer": mm_json(s.per_gdn_layer),
                "nodes_per_attention_layer": mm_json(s.per_attention_layer),
                "nodes_per_kernel": s.per_kernel,
                "arena_bytes": s.arena_bytes,
                "arena_bytes_no_reuse": s.arena_bytes_no_reuse,
            })
        })
        .collect();
    json!({
        "header": {
            "format_version": h.format_version,
            "config_hash": h.config_hash,
            "kernel_source_hash": h.kernel_source_hash,
            "arch": h.arch,
            "compiler_version": h.compiler_version,
            "body_checksum": h.body_checksum,
        },
        "config": config_summary(b),
        "extra_keys": b.config.extra_keys,
        "options": {
            "arch": b.options.arch,
            "max_depth": b.options.max_depth,
            "streams": b.options.streams,
            "context": b.options.context,
            "prefill_chunk": b.options.prefill_chunk,
        },
        "weights": weights,
        "state": {
            "context": b.state.context,
            "slots": b.state.slots,
            "pieces": b.state.pieces.len(),
            "slot_bytes": b.state.slot_bytes,
            "slot_bytes_by_kind": state_kinds,
            "all_slots_bytes": b.state.slot_bytes * b.state.slots as u64,
        },
        "io": {
            "max_rows": b.io.max_rows,
            "max_streams": b.io.max_streams,
            "bytes": io,
        },
        "arena_bytes": b.arena_elems * 4,
        "kernel_modules": b.kernels.iter().map(|k| json!({"name": k.name, "source_hash": k.source_hash, "cubin_bytes": k.cubin.len(), "entry_points": k.entry_points})).collect::<Vec<_>>(),
        "variant_count": b.variants.len(),
        "variants": variants,
    })
}

/// Bytes in a short human unit (binary prefixes).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

fn range<T: PartialEq + std::fmt::Display>(a: T, b: T) -> String {
    if a == b {
        format!("{a}")
    } else {
        format!("{a}-{b}")
    }
}

fn mm_str(x: Option<(usize, usize)>) -> String {
    x.map(|(a, b)| range(a, b)).unwrap_or_else(|| "-".into())
}

fn bytes_range(a: u64, b: u64) -> String {
    if a == b {
        human_bytes(a)
    } else {
        format!("{} - {}", human_bytes(a), human_bytes(b))
    }
}

/// The text report: header, config, options, memory, then variants grouped (every variant with `all`), then the
/// kernel entry points with their node counts per group.
pub fn report_human(set: &PlanSet, all: bool) -> String {
    let b = &set.body;
    let h = &set.header;
    let c = &b.config;
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(
        w,
        "format v{}  arch {}  compiler {}  kernels {}",
        h.format_version,
        h.arch,
        h.compiler_version,
        short(&h.kernel_source_hash)
    );
    let _ = writeln!(
        w,
        "config hash {}  body checksum {}",
        short(&h.config_hash),
        short(&h.body_checksum)
    );
    let gdn = c
        .layer_types
        .iter()
        .filter(|k| **k == LayerKind::Gdn)
        .count();
    let _ = writeln!(
        w,
        "config: {} layers ({} GDN + {} attention), hidden {}, hc {}x rank {}, vocab {}, experts {} top-{} (width {}, shared {}), heads {}/{}x{} rot {}, QSA {}x{} budget {} ratio {}, PLE layers {:?} dim {}, MTP {}, declared form {:?}",
        c.num_hidden_layers, gdn, c.layer_types.len() - gdn, c.hidden_size, c.hc_count, c.hc_lowrank, c.vocab_size,
        c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size,
        c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim(), c.indexer_n_heads, c.indexer_head_dim,
        c.indexer_budget, c.indexer_compress_ratio, c.ple_layer_ids, c.ple_embed_dim,
        if c.mtp.is_some() { "yes" } else { "no" }, c.declared_form
    );
    if c.extra_keys.is_empty() {
        let _ = writeln!(w, "unused config keys: none");
    } else {
        let keys: Vec<String> = c
            .extra_keys
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let _ = writeln!(w, "unused config keys: {}", keys.join(", "));
    }
    let op = &b.options;
    let _ = writeln!(
        w,
        "options: arch {}, max depth {}, streams {:?}, context {}, prefill chunk {}",
        op.arch, op.max_depth, op.streams, op.context, op.prefill_chunk
    );
    let _ = writeln!(w, "weights:");
    for g in GROUPS {
        let n = b.weights.iter().filter(|x| x.group == g).count();
        if n == 0 {
            continue;
        }
        let forms: Vec<String> = weight_bytes_by_form(b, g)
            .into_iter()
            .map(|(f, n)| format!("{f:?} {}", human_bytes(n)))
            .collect();
        let _ = writeln!(
            w,
            "  {:<10} {:>12}  {:>5} tensors  ({})",
            format!("{g:?}"),
            human_bytes(b.group_bytes(g)),
            n,
            forms.join(", ")
        );
    }
    let kinds: Vec<String> = state_bytes_by_kind(b)
        .into_iter()
        .map(|(k, n)| format!("{k:?} {}", human_bytes(n)))
        .collect();
    let _ = writeln!(
        w,
        "state per slot at context {}: {} ({} bytes; {})",
        b.state.context,
        human_bytes(b.state.slot_bytes),
        b.state.slot_bytes,
        kinds.join(", ")
    );
    let _ = writeln!(
        w,
        "state for all {} slots: {}",
        b.state.slots,
        human_bytes(b.state.slot_bytes * b.state.slots as u64)
    );
    let ios: Vec<String> = IOS
        .iter()
        .map(|&io| format!("{io:?} {}", human_bytes(b.io.elems(io, c) * 4)))
        .collect();
    let _ = writeln!(
        w,
        "io buffers (max rows {}, max streams {}): {}",
        b.io.max_rows,
        b.io.max_streams,
        ios.join(", ")
    );
    let _ = writeln!(
        w,
        "arena (largest variant): {}",
        human_bytes(b.arena_elems * 4)
    );
    if b.kernels.is_empty() {
        let _ = writeln!(w, "kernel modules: none (arch {})", h.arch);
    } else {
        for k in &b.kernels {
            let _ = writeln!(
                w,
                "kernel module {} ({}, cubin {}, {} entry points)",
                k.name,
                short(&k.source_hash),
                human_bytes(k.cubin.len() as u64),
                k.entry_points.len()
            );
        }
    }
    let stats: Vec<VariantStats> = b.variants.iter().map(|v| variant_stats(b, v)).collect();
    let _ = writeln!(
        w,
        "variants: {} (nodes/GDN and nodes/attn count every launch of one decoder layer, its commit included)",
        b.variants.len()
    );
    if all {
        let _ = writeln!(
            w,
            "  {:<34} {:>5} {:>6} {:>8} {:>9} {:>6} {:>12} {:>12}",
            "variant", "rows", "nodes", "nodes/GDN", "nodes/attn", "other", "arena", "no reuse"
        );
        for s in &stats {
            let _ = writeln!(
                w,
                "  {:<34} {:>5} {:>6} {:>8} {:>9} {:>6} {:>12} {:>12}",
                s.name,
                s.rows,
                s.nodes,
                mm_str(s.per_gdn_layer),
                mm_str(s.per_attention_layer),
                s.outside_layers,
                human_bytes(s.arena_bytes),
                human_bytes(s.arena_bytes_no_reuse)
            );
        }
    } else {
        let _ = writeln!(
            w,
            "  {:<24} {:>5} {:>9} {:>8} {:>9} {:>10} {:>6} {:>24} {:>24}",
            "group",
            "count",
            "rows",
            "nodes",
            "nodes/GDN",
            "nodes/attn",
            "other",
            "arena",
            "no reuse"
        );
        for (g, idx) in groups(b) {
            let ss: Vec<&VariantStats> = idx.iter().map(|&i| &stats[i]).collect();
            let rmin = ss.iter().map(|s| s.rows).min().unwrap_or(0);
            let rmax = ss.iter().map(|s| s.rows).max().unwrap_or(0);
            let nmin = ss.iter().map(|s| s.nodes).min().unwrap_or(0);
            let nmax = ss.iter().map(|s| s.nodes).max().unwrap_or(0);
            let gdn = min_max(
                ss.iter()
                    .filter_map(|s| s.per_gdn_layer)
                    .flat_map(|(a, b)| [a, b]),
            );
            let att = min_max(
                ss.iter()
                    .filter_map(|s| s.per_attention_layer)
                    .flat_map(|(a, b)| [a, b]),
            );
            let omin = ss.iter().map(|s| s.outside_layers).min().unwrap_or(0);
            let omax = ss.iter().map(|s| s.outside_layers).max().unwrap_or(0);
            let amin = ss.iter().map(|s| s.arena_bytes).min().unwrap_or(0);
            let amax = ss.iter().map(|s| s.arena_bytes).max().unwrap_or(0);
            let umin = ss.iter().map(|s| s.arena_bytes_no_reuse).min().unwrap_or(0);
            let umax = ss.iter().map(|s| s.arena_bytes_no_reuse).max().unwrap_or(0);
            let _ = writeln!(
                w,
                "  {:<24} {:>5} {:>9} {:>8} {:>9} {:>10} {:>6} {:>24} {:>24}",
                g,
                ss.len(),
                range(rmin, rmax),
                range(nmin, nmax),
                mm_str(gdn),
                mm_str(att),
                range(omin, omax),
                bytes_range(amin, amax),
                bytes_range(umin, umax)
            );
        }
        let _ = writeln!(w, "  (--all lists every variant)");
    }
    // Kernel entry points: node counts of the first variant of each group (every variant of a group has the same
    // node list structure; only launch shapes and buffer sizes change with the window).
    let reps: Vec<(String, usize)> = groups(b)
        .into_iter()
        .filter(|(g, _)| {
            !g.starts_with("verify-s") || g == "verify-s1" || !has_group(b, "verify-s1")
        })
        .map(|(g, idx)| (g, idx[0]))
        .collect();
    let mut kernels: Vec<&'static str> = stats
        .iter()
        .flat_map(|s| s.per_kernel.keys().copied())
        .collect();
    kernels.sort_unstable();
    kernels.dedup();
    let _ = writeln!(
        w,
        "nodes per kernel entry point (first variant of each group):"
    );
    let _ = write!(w, "  {:<16}", "kernel");
    for (g, _) in &reps {
        let _ = write!(
            w,
            " {:>width$}",
            short_group(g),
            width = short_group(g).len().max(6)
        );
    }
    let _ = writeln!(w);
    for k in kernels {
        let _ = write!(w, "  {k:<16}");
        for (g, i) in &reps {
            let n = stats[*i].per_kernel.get(k).copied().unwrap_or(0);
            let _ = write!(w, " {:>width$}", n, width = short_group(g).len().max(6));
        }
        let _ = writeln!(w);
    }
    o
}

fn short_group(g: &str) -> String {
    g.replace("checkpoint", "ckpt").replace("mtp-", "")
}

fn has_group(b: &PlanBody, g: &str) -> bool {
    b.variants.iter().any(|v| variant_group(&v.kind) == g)
}

/// Variant indices by group, in first-appearance order.
fn groups(b: &PlanBody) -> Vec<(String, Vec<usize>)> {
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, v) in b.variants.iter().enumerate() {
        let g = variant_group(&v.kind);
        match out.iter_mut().find(|(n, _)| *n == g) {
            Some((_, idx)) => idx.push(i),
            None => out.push((g, vec![i])),
        }
    }
    out
}

fn short(hash: &str) -> &str {
    &hash[..hash.len().min(16)]
}
