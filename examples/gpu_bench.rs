//! Plain-decode benchmark on the GPU (issue 4, item 5): the real config's widths (`configs/flash-next.json`) with
//! fewer layers (default 4: 3 GDN + 1 attention, PLE on layer index 1, a small PLE table), synthetic BF16 weights
//! generated on the host (random signs and mantissas, magnitude ~1/sqrt(fan-in); router rows random, so routing
//! spreads over the experts as a trained router's would), context 4096, one stream.
//!
//! For the lone windows of 1, 2, 4, 8 and 16 rows (and verify-s1 with `--verify`): median replay time with CUDA
//! events (after warm-up), bytes a replay must move (dense weights read by its nodes + the distinct routed experts
//! its router picked, read back from the device + GDN state read and written once), achieved bandwidth against
//! 4.25 TB/s, and the graph overhead: replay time minus the sum of the nodes' times, each node launched alone
//! outside the graph (best of three, CUDA events around each launch).
//!
//! Usage (the H200 has no NVRTC: the cubins come from `FLASHPLAN_KERNEL_CACHE`, see `scripts/gpu_bench.sh`):
//! `gpu_bench [--layers N] [--iters N] [--verify] [--list]`. `--list` prints the node list and bytes without a GPU.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flashplan_plan::{
    CompileOptions, LayerKind, ModelConfig, Op, PlanBody, RoundDesc, SamplingParams, StreamDesc,
    VariantKind,
};
use flashplan_runtime::cuda::CudaBackend;

const BW: f64 = 4.25e12;

fn config(layers: usize) -> anyhow::Result<ModelConfig> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/flash-next.json");
    let mut j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let t = &mut j["text_config"];
    let full = t["layer_types"].as_array().cloned().unwrap_or_default();
    t["num_hidden_layers"] = layers.into();
    t["layer_types"] = serde_json::Value::Array(full.into_iter().take(layers).collect());
    t["ple_layer_ids"] = serde_json::json!([1]);
    t["ngram_vocab_size_base"] = 100000.into();
    Ok(ModelConfig::from_json_str(&j.to_string())?)
}

/// Fast counter-based generator (splitmix64).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Random BF16 values: random sign and mantissa, exponent chosen so |w| lies in [2^e, 2^(e+1)).
fn random_bf16(n: usize, seed: u64, e: i32) -> Vec<u16> {
    let mut out = vec![0u16; n];
    let exp = ((127 + e).clamp(1, 254) as u16) << 7;
    let threads = std::thread::available_parallelism().map_or(8, |n| n.get());
    let chunk = n.div_ceil(threads).max(1 << 16).div_ceil(4) * 4;
    std::thread::scope(|s| {
        for (ci, part) in out.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                let base = seed ^ ((ci as u64) << 40);
                for (i, q) in part.chunks_mut(4).enumerate() {
                    let r = mix(base.wrapping_add(i as u64));
                    for (k, x) in q.iter_mut().enumerate() {
                        let b = (r >> (16 * k)) as u16;
                        *x = (b & 0x8000) | exp | (b & 0x7f);
                    }
                }
            });
        }
    });
    out
}

fn synthetic_weights(body: &PlanBody) -> Vec<Option<Vec<u16>>> {
    body.weights
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if w.name.starts_with("mtp.") || w.name.contains('#') {
                return None;
            }
            let fan_in = if w.shape.len() >= 2 {
                *w.shape.last().unwrap() as f64
            } else {
                1024.0
            };
            // |w| ~ 1/sqrt(fan-in) (norm weights, biases: small).
            let e = (-(fan_in.sqrt()).log2()).floor() as i32;
            Some(random_bf16(
                w.numel() as usize,
                mix(i as u64 + 17) ^ 0x5eed,
                e,
            ))
        })
        .collect()
}

fn desc(rows: u32, window: u32, pos: u32, seed: u64) -> RoundDesc {
    let tokens = (0..window)
        .map(|i| (mix(seed + i as u64) % 200_000) as u32)
        .collect();
    RoundDesc {
        streams: vec![StreamDesc {
            slot: 0,
            pos,
            rows,
            committed: pos,
            src_row: 0,
            sampling: SamplingParams::greedy(),
        }],
        tokens,
    }
}

/// Bytes of dense weights the variant's nodes read (every weight but the routed experts and the gathered tables:
/// embeddings read one row per token, the PLE table 16 rows of 160 per token), and the routers' nodes.
fn dense_bytes(body: &PlanBody, kind: VariantKind, rows: u64) -> (u64, u64) {
    let v = body.variant(kind).expect("variant");
    let mut dense = BTreeSet::new();
    let mut gathered = 0u64;
    for n in &v.nodes {
        match &n.op {
            Op::Experts { .. } => {}
            Op::EmbedStreams { dim, .. } | Op::Embed { dim, .. } => {
                gathered += rows * *dim as u64 * 2
            }
            Op::PleEmbed {
                heads, head_dim, ..
            } => gathered += rows * (*heads as u64) * (*head_dim as u64) * 2,
            op => dense.extend(op.weights().into_iter().map(|w| w.0)),
        }
    }
    let d: u64 = dense
        .iter()
        .map(|&w| body.weights[w as usize].numel() * 2)
        .sum();
    (d, gathered)
}

/// Nodes outside the layers (embedding, final norm, lm_head, sampling); commits belong to their layers' work.
fn is_head(n: &flashplan_plan::Node) -> bool {
    n.layer.is_none()
        && !matches!(
            n.op,
            Op::GdnCommit { .. } | Op::IndexerCommit { .. } | Op::PleCommit { .. }
        )
}

fn layer_label(body: &PlanBody, n: &flashplan_plan::Node) -> String {
    if !is_head(n) && n.layer.is_none() {
        return "commit".into();
    }
    match n.layer {
        None => "head".into(),
        Some(l) => format!(
            "L{l} {}",
            if body.config.layer_types[l as usize] != LayerKind::Gdn {
                "attn"
            } else {
                "gdn"
            }
        ),
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u32>().ok())
    };
    let layers = arg("--layers").unwrap_or(4) as usize;
    let iters = arg("--iters").unwrap_or(200);
    let list = args.iter().any(|a| a == "--list");
    let verify = args.iter().any(|a| a == "--verify");
    let cfg = config(layers)?;
    let opts = CompileOptions {
        arch: if list { "cpu".into() } else { "sm_90a".into() },
        max_depth: 15,
        streams: vec![1],
        context: 4096,
        prefill_chunk: 16,
    };
    let body = Arc::new(
        flashplan_compiler::compile(&cfg, &opts, &Default::default(), "bench", |_, _| {})?.body,
    );
    let windows = [1u32, 2, 4, 8, 16];
    let kinds: Vec<VariantKind> = windows
        .iter()
        .map(|&w| VariantKind::Lone { window: w })
        .chain(
            windows
                .iter()
                .filter(|_| verify)
                .map(|&w| VariantKind::Verify {
                    streams: 1,
                    window: w,
                }),
        )
        .collect();
    let expert_bytes = |kind: VariantKind| -> u64 {
        let v = body.variant(kind).unwrap();
        v.nodes
            .iter()
            .find_map(|n| match &n.op {
                Op::Experts { dim, inter, .. } => Some(3 * *dim as u64 * *inter as u64 * 2),
                _ => None,
            })
            .unwrap_or(0)
    };
    let gdn_layers = (0..layers)
        .filter(|&l| cfg.layer_types[l] == LayerKind::Gdn)
        .count() as u64;
    let gdn_state = gdn_layers
        * cfg.linear_num_value_heads as u64
        * cfg.linear_key_head_dim as u64
        * cfg.linear_value_head_dim as u64
        * 4
        * 2;
    {
        let k = VariantKind::Lone { window: 1 };
        let v = body.variant(k).unwrap();
        let (d, g) = dense_bytes(&body, k, 1);
        let mut per_layer: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for n in &v.nodes {
            per_layer
                .entry(layer_label(&body, n))
                .or_default()
                .push(n.op.kernel());
        }
        println!(
            "config: hidden {}, {} layers, {} experts top-{}, context {}; lone-w1: {} nodes",
            cfg.hidden_size,
            layers,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            opts.context,
            v.nodes.len()
        );
        for (l, ks) in &per_layer {
            println!("  {l}: {} nodes: {}", ks.len(), ks.join(" "));
        }
        println!(
            "dense weights read per replay: {:.3} GB (+{} B gathered rows), one routed expert {:.2} MB, GDN state r+w {:.1} MiB",
            d as f64 / 1e9,
            g,
            expert_bytes(k) as f64 / 1e6,
            gdn_state as f64 / (1 << 20) as f64
        );
    }
    if list {
        return Ok(());
    }
    let t0 = std::time::Instant::now();
    let w = synthetic_weights(&body);
    let total: usize = w.iter().flatten().map(|v| v.len() * 2).sum();
    println!(
        "synthetic weights: {:.2} GB generated in {:.1} s",
        total as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    let mut be = CudaBackend::new_bf16(Arc::clone(&body), w)?;
    println!("uploaded in {:.1} s", t0.elapsed().as_secs_f64());
    let pos = opts.context as u32 - 17;
    println!();
    println!("| variant | rows | time/replay us | sum of nodes us | overhead us | nodes | distinct experts | bytes MB | GB/s | % of 4.25 TB/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut profiles = Vec::new();
    for &kind in &kinds {
        let (_, rows) = kind.shape();
        let d = desc(rows, rows, pos, 1000 + rows as u64);
        use flashplan_runtime::backend::Backend;
        be.run(kind, &d)?;
        let r = be.bench(kind, &d, iters)?;
        let v = body.variant(kind).unwrap();
        // Distinct experts per MoE layer, from the router ids the replay left.
        let mut experts = 0u64;
        for n in &v.nodes {
            if let Op::Router { ids, topk, .. } = &n.op {
                let ids = be.read_buffer(kind, *ids)?;
                let set: BTreeSet<u32> = ids[..(rows * *topk) as usize]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                experts += set.len() as u64;
            }
        }
        let (dense, gathered) = dense_bytes(&body, kind, rows as u64);
        let bytes = dense + gathered + experts * expert_bytes(kind) + gdn_state;
        let sum: f64 = r.nodes_us.iter().sum();
        let gbs = bytes as f64 / (r.median_us * 1e-6) / 1e9;
        println!(
            "| {} | {rows} | {:.1} | {:.1} | {:.1} | {} | {experts} | {:.1} | {:.0} | {:.1}% |",
            kind.name(),
            r.median_us,
            sum,
            r.median_us - sum,
            v.nodes.len(),
            bytes as f64 / 1e6,
            gbs,
            100.0 * gbs * 1e9 / BW
        );
        profiles.push((kind, r, bytes, experts));
    }
    for ci in be.captures() {
        println!(
            "graph {}: {} kernel nodes (captured in {:.1} ms)",
            ci.variant, ci.nodes, ci.ms
        );
    }
    // Per layer and 48-layer extrapolation, from the node times (launched alone) scaled to the replay time.
    for (kind, r, bytes, experts) in &profiles {
        let v = body.variant(*kind).unwrap();
        let (_, rows) = kind.shape();
        let sum: f64 = r.nodes_us.iter().sum();
        let head: f64 = v
            .nodes
            .iter()
            .zip(&r.nodes_us)
            .filter(|(n, _)| is_head(n))
            .map(|(_, t)| t)
            .sum();
        let overhead = r.median_us - sum;
        let per_node = overhead / v.nodes.len() as f64;
        let head_nodes = v.nodes.iter().filter(|n| is_head(n)).count() as f64;
        let head_t = head + per_node * head_nodes;
        let layers_t = r.median_us - head_t;
        let per_layer = layers_t / layers as f64;
        let (dense, gathered) = dense_bytes(&body, *kind, rows as u64);
        let head_bytes: u64 = {
            let mut set = BTreeSet::new();
            for n in v.nodes.iter().filter(|n| is_head(n)) {
                if !matches!(n.op, Op::EmbedStreams { .. } | Op::Embed { .. }) {
                    set.extend(n.op.weights().into_iter().map(|w| w.0));
                }
            }
            set.iter()
                .map(|&w| body.weights[w as usize].numel() * 2)
                .sum()
        };
        let layer_bytes = (bytes - head_bytes) as f64 / layers as f64;
        let t48 = head_t + 12.0 * layers_t;
        let b48 = head_bytes as f64 + 12.0 * (bytes - head_bytes) as f64;
        let _ = (dense, gathered, experts);
        println!(
            "{}: per layer {:.1} us for {:.1} MB = {:.0} GB/s ({:.1}% of 4.25 TB/s); head (embed, lm_head, sample) {:.1} us; \
             48 layers: {:.3} ms for {:.2} GB = {:.1}% of the floor ({:.3} ms)",
            kind.name(),
            per_layer,
            layer_bytes / 1e6,
            layer_bytes / (per_layer * 1e-6) / 1e9,
            100.0 * layer_bytes / (per_layer * 1e-6) / BW,
            head_t,
            t48 / 1e3,
            b48 / 1e9,
            100.0 * (b48 / BW * 1e3) / (t48 / 1e3),
            b48 / BW * 1e3
        );
    }
    // Largest kernels (launched alone) of lone-w1 and lone-w16.
    for (kind, r, _, _) in profiles
        .iter()
        .filter(|(k, ..)| matches!(k, VariantKind::Lone { window: 1 | 16 }))
    {
        let sum: f64 = r.nodes_us.iter().sum();
        println!(
            "\n{}: kernels by time (launched alone, summed over nodes; replay {:.1} us)",
            kind.name(),
            r.median_us
        );
        println!("| kernel | us | share of node time |");
        println!("|---|---|---|");
        for (k, t) in &r.kernels_us {
            println!("| {k} | {t:.1} | {:.1}% |", 100.0 * t / sum);
        }
        let v = body.variant(*kind).unwrap();
        let mut top: Vec<(usize, f64)> = r.nodes_us.iter().copied().enumerate().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        println!("largest nodes:");
        for (i, t) in top.iter().take(12) {
            let n = &v.nodes[*i];
            let what = match &n.op {
                Op::Linear { k, n: nn, .. } => format!(" {k}x{nn}"),
                _ => String::new(),
            };
            println!(
                "  {:>3} {:<10} {}{} {:.1} us",
                i,
                layer_label(&body, n),
                n.op.kernel(),
                what,
                t
            );
        }
    }
    Ok(())
}
