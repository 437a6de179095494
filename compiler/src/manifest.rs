//! The weight manifest: every tensor the model needs, with its canonical name, shape, storage form, group and
//! device offset (`architecture.md`, "Plans"; names follow transformers' `Qwen4ExpTextModel` parameters).

use flashplan_plan::{LayerKind, ModelConfig, StorageForm, WeightEntry, WeightGroup};

/// Device offsets are aligned to this many bytes.
pub const WEIGHT_ALIGN: u64 = 256;

/// Where the storage form of each tensor comes from.
#[derive(Debug, Clone, Default)]
pub struct FormSource {
    /// Forms read from a checkpoint's safetensors headers, by canonical name (absent: use the config's declaration).
    pub by_name: std::collections::BTreeMap<String, StorageForm>,
}

struct Acc {
    entries: Vec<WeightEntry>,
}

impl Acc {
    fn push(
        &mut self,
        name: String,
        shape: &[u64],
        form: StorageForm,
        group: WeightGroup,
        source: Option<u32>,
    ) {
        let (rows, cols) = match shape {
            [] => (1, 1),
            [n] => (1, *n),
            [first, rest @ ..] => (
                *first * rest[..rest.len() - 1].iter().product::<u64>(),
                *rest.last().unwrap_or(&1),
            ),
        };
        let bytes = form.bytes(rows, cols);
        self.entries.push(WeightEntry {
            name,
            shape: shape.to_vec(),
            form,
            group,
            offset: 0,
            bytes,
            source,
        });
    }
}

/// Is this tensor a linear (matrix) whose storage form follows the checkpoint's quantization? Norms, biases,
/// routers, conv kernels, `A_log`, `dt_bias` and embeddings stay as stored (BF16/F32).
fn quantizable(name: &str) -> bool {
    let linear = name.ends_with("_proj.weight")
        || name.ends_with("gate_up_proj")
        || name.ends_with("down_proj")
        || name.ends_with("ngram_embedding.weight")
        || name.ends_with("fc_embedding.weight")
        || name.ends_with("fc_hidden.weight");
    linear && !name.contains("hyper_connection")
}

fn layer_tensors(
    cfg: &ModelConfig,
    prefix: &str,
    kind: LayerKind,
    ple_index: Option<u32>,
) -> Vec<(String, Vec<u64>)> {
    let d = cfg.hidden_size as u64;
    let hc = cfg.hc_width() as u64;
    let c = cfg.hc_count as u64;
    let rank = cfg.hc_lowrank as u64;
    let mut t: Vec<(String, Vec<u64>)> = Vec::new();
    let mut add = |n: &str, s: &[u64]| t.push((format!("{prefix}{n}"), s.to_vec()));
    if ple_index.is_some() {
        let pd = cfg.ple_embed_dim as u64;
        let heads = cfg.ple_heads() as u64;
        add(
            "ple.ple_embedding.ngram_embedding.weight",
            &[
                flashplan_plan::ple::table_rows(cfg, ple_index.unwrap_or(0)),
                pd / heads,
            ],
        );
        add("ple.key_proj.weight", &[hc, pd]);
        add("ple.value_proj.weight", &[d, pd]);
        add("ple.norm_key.weight", &[hc]);
        add("ple.norm_query.weight", &[hc]);
        add("ple.norm_conv.weight", &[hc]);
        add(
            "ple.conv1d.weight",
            &[hc, 1, cfg.ple_conv_kernel_size as u64],
        );
    }
    for hcname in ["attn_hyper_connection", "mlp_hyper_connection"] {
        add(&format!("{hcname}.hc_norm.weight"), &[hc]);
        add(
            &format!("{hcname}.input_mix_weight_down.weight"),
            &[rank, hc],
        );
        add(&format!("{hcname}.input_mix_weight_up.weight"), &[hc, rank]);
        add(&format!("{hcname}.block_inject_weight.weight"), &[c, hc]);
    }
    match kind {
        LayerKind::Gdn => {
            let hv = cfg.linear_num_value_heads as u64;
            let dv = cfg.linear_value_head_dim as u64;
            add(
                "linear_attn.in_proj_qkv.weight",
                &[cfg.gdn_conv_dim() as u64, d],
            );
            add("linear_attn.in_proj_z.weight", &[hv * dv, d]);
            add("linear_attn.in_proj_b.weight", &[hv, d]);
            add("linear_attn.in_proj_a.weight", &[hv, d]);
            add(
                "linear_attn.conv1d.weight",
                &[
                    cfg.gdn_conv_dim() as u64,
                    1,
                    cfg.linear_conv_kernel_dim as u64,
                ],
            );
            add("linear_attn.dt_bias", &[hv]);
            add("linear_attn.A_log", &[hv]);
            add("linear_attn.norm.weight", &[dv]);
            add("linear_attn.out_proj.weight", &[d, hv * dv]);
        }
        LayerKind::Attention => {
            let h = cfg.num_attention_heads as u64;
            let kvh = cfg.num_key_value_heads as u64;
            let hd = cfg.head_dim as u64;
            let ih = cfg.indexer_n_heads as u64;
            let id = cfg.indexer_head_dim as u64;
            add("self_attn.q_proj.weight", &[h * hd * 2, d]);
            add("self_attn.k_proj.weight", &[kvh * hd, d]);
            add("self_attn.v_proj.weight", &[kvh * hd, d]);
            add("self_attn.o_proj.weight", &[d, h * hd]);
            add("self_attn.q_norm.weight", &[hd]);
            add("self_attn.k_norm.weight", &[hd]);
            add(
                "self_attn.indexer.index_qk_proj.weight",
                &[(ih + 1) * id, d],
            );
            add("self_attn.indexer.q_layernorm.weight", &[id]);
            add("self_attn.indexer.k_layernorm.weight", &[id]);
        }
    }
    let e = cfg.num_experts as u64;
    let i = cfg.moe_intermediate_size as u64;
    let is = cfg.shared_expert_intermediate_size as u64;
    add("mlp.gate.weight", &[e, d]);
    add("mlp.experts.gate_up_proj", &[e, 2 * i, d]);
    add("mlp.experts.down_proj", &[e, d, i]);
    add("mlp.shared_expert.gate_proj.weight", &[is, d]);
    add("mlp.shared_expert.up_proj.weight", &[is, d]);
    add("mlp.shared_expert.down_proj.weight", &[d, is]);
    add("mlp.shared_expert_gate.weight", &[1, d]);
    t
}

/// Builds the manifest: main weights, the MTP drafter as stored (when the config has one), its MXFP8 re-coded
/// linears and the MXFP8 drafting copy of `lm_head`. Offsets are assigned per group, aligned to [`WEIGHT_ALIGN`].
pub fn build_manifest(cfg: &ModelConfig, forms: &FormSource) -> Vec<WeightEntry> {
    let d = cfg.hidden_size as u64;
    let v = cfg.vocab_size as u64;
    let hc = cfg.hc_width() as u64;
    let rank = cfg.hc_lowrank as u64;
    let mut acc = Acc {
        entries: Vec::new(),
    };
    let form_of = |name: &str| -> StorageForm {
        if let Some(f) = forms.by_name.get(name) {
            return *f;
        }
        if quantizable(name) && !name.starts_with("lm_head") {
            match cfg.declared_form {
                StorageForm::Fp8Block
                    if name.contains("experts") || name.contains("ngram_embedding") =>
                {
                    StorageForm::Fp8Block
                }
                StorageForm::Mxfp8 => StorageForm::Mxfp8,
                _ => StorageForm::Bf16,
            }
        } else {
            StorageForm::Bf16
        }
    };
    let mut main: Vec<(String, Vec<u64>)> = vec![("embed_tokens.weight".into(), vec![v, d])];
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        let ple_index = cfg
            .ple_layer_ids
            .iter()
            .position(|&id| id as usize == i + 1)
            .map(|p| p as u32);
        main.extend(layer_tensors(
            cfg,
            &format!("layers.{i}."),
            *kind,
            ple_index,
        ));
    }
    main.push(("hyper_connection_mixer.hc_norm.weight".into(), vec![hc]));
    main.push((
        "hyper_connection_mixer.input_mix_weight_down.weight".into(),
        vec![rank, hc],
    ));
    main.push((
        "hyper_connection_mixer.input_mix_weight_up.weight".into(),
        vec![hc, rank],
    ));
    main.push(("lm_head.weight".into(), vec![v, d]));
    for (name, shape) in main {
        let f = form_of(&name);
        acc.push(name, &shape, f, WeightGroup::Main, None);
    }
    if cfg.mtp.is_some() {
        let mut mtp: Vec<(String, Vec<u64>)> = vec![
            ("mtp.pre_fc_norm_embedding.weight".into(), vec![d]),
            ("mtp.pre_fc_norm_hidden.weight".into(), vec![hc]),
            ("mtp.fc_embedding.weight".into(), vec![d, d]),
            ("mtp.fc_hidden.weight".into(), vec![d, d]),
        ];
        mtp.extend(layer_tensors(
            cfg,
            "mtp.layers.0.",
            LayerKind::Attention,
            None,
        ));
        mtp.push(("mtp.hyper_connection_mixer.hc_norm.weight".into(), vec![hc]));
        mtp.push((
            "mtp.hyper_connection_mixer.input_mix_weight_down.weight".into(),
            vec![rank, hc],
        ));
        mtp.push((
            "mtp.hyper_connection_mixer.input_mix_weight_up.weight".into(),
            vec![hc, rank],
        ));
        let first_mtp = acc.entries.len();
        for (name, shape) in &mtp {
            let f = form_of(name);
            acc.push(name.clone(), shape, f, WeightGroup::Mtp, None);
        }
        // MXFP8 re-coded copies of the drafter's linears (the router stays as stored).
        for idx in first_mtp..acc.entries.len() {
            let e = acc.entries[idx].clone();
            if is_drafter_linear(&e.name) {
                acc.push(
                    format!("{}#mxfp8", e.name),
                    &e.shape,
                    StorageForm::Mxfp8,
                    WeightGroup::MtpMxfp8,
                    Some(idx as u32),
                );
            }
        }
        let head = acc
            .entries
            .iter()
            .position(|e| e.name == "lm_head.weight")
            .map(|p| p as u32);
        acc.push(
            "lm_head.weight#mxfp8".into(),
            &[v, d],
            StorageForm::Mxfp8,
            WeightGroup::HeadMxfp8,
            head,
        );
    }
    // Offsets per group.
    let mut next: std::collections::BTreeMap<WeightGroup, u64> = Default::default();
    for e in &mut acc.entries {
        let off = next.entry(e.group).or_insert(0);
        e.offset = *off;
        *off = (*off + e.bytes).div_ceil(WEIGHT_ALIGN) * WEIGHT_ALIGN;
    }
    acc.entries
}

/// The drafter tensors `FLASHPLAN_MTP_WEIGHTS=mxfp8` re-codes: every 2-D (or stacked 3-D) linear except the router.
pub fn is_drafter_linear(name: &str) -> bool {
    name.starts_with("mtp.")
        && !name.ends_with("mlp.gate.weight")
        && !name.contains("norm")
        && (name.ends_with("_proj.weight")
            || name.ends_with("gate_up_proj")
            || name.ends_with("down_proj")
            || name.ends_with("fc_embedding.weight")
            || name.ends_with("fc_hidden.weight")
            || name.ends_with("input_mix_weight_down.weight")
            || name.ends_with("input_mix_weight_up.weight")
            || name.ends_with("block_inject_weight.weight")
            || name.ends_with("shared_expert_gate.weight"))
}
