//! Storage forms from safetensors headers: canonical names and forms (the demo checkpoint, and synthetic headers
//! with FP8 block and MXFP8 tensors).

use std::io::Write;
use std::path::{Path, PathBuf};

use flashplan_compiler::checkpoint::{canonical_name, forms_from_model_dir};
use flashplan_compiler::manifest::build_manifest;
use flashplan_plan::{ModelConfig, StorageForm, WeightGroup};

/// The demo checkpoint: in the repository, or beside the clone in `../shared/`.
fn tiny_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let repo = root.join("models/flashnext-tiny");
    if repo.join("config.json").exists() {
        repo
    } else {
        root.join("../shared/models/flashnext-tiny")
    }
}

#[test]
fn canonical_names() {
    assert_eq!(
        canonical_name("model.language_model.layers.0.mlp.experts.7.gate_proj.weight"),
        "layers.0.mlp.experts.gate_up_proj"
    );
    assert_eq!(
        canonical_name("model.layers.3.mlp.experts.12.up_proj.weight"),
        "layers.3.mlp.experts.gate_up_proj"
    );
    assert_eq!(
        canonical_name("language_model.layers.3.mlp.experts.0.down_proj.weight"),
        "layers.3.mlp.experts.down_proj"
    );
    assert_eq!(
        canonical_name("model.layers.3.mlp.experts.0.down_proj.weight_scale_inv"),
        "layers.3.mlp.experts.down_proj_scale_inv"
    );
    assert_eq!(
        canonical_name("model.layers.1.ple.ple_embedding.ngram_embedding.shard_17.weight"),
        "layers.1.ple.ple_embedding.ngram_embedding.weight"
    );
    assert_eq!(
        canonical_name("mtp.layers.0.mlp.experts.gate_up_proj"),
        "mtp.layers.0.mlp.experts.gate_up_proj"
    );
    assert_eq!(canonical_name("lm_head.weight"), "lm_head.weight");
    assert_eq!(
        canonical_name("model.layers.0.mlp.shared_expert.gate_proj.weight"),
        "layers.0.mlp.shared_expert.gate_proj.weight"
    );
}

/// Every tensor of the demo checkpoint maps onto a manifest entry and every Main/Mtp manifest entry is found in
/// the checkpoint: the canonical names of the compiler and of the checkpoint agree.
#[test]
fn demo_checkpoint_covers_the_manifest() {
    let dir = tiny_dir();
    if !dir.exists() {
        eprintln!("skipped: {} not present", dir.display());
        return;
    }
    let forms = forms_from_model_dir(&dir).unwrap();
    let cfg =
        ModelConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
            .unwrap();
    let manifest = build_manifest(&cfg, &forms);
    for w in manifest
        .iter()
        .filter(|w| matches!(w.group, WeightGroup::Main | WeightGroup::Mtp))
    {
        assert_eq!(
            forms.by_name.get(&w.name),
            Some(&StorageForm::Bf16),
            "manifest tensor {} not in the checkpoint (or not BF16)",
            w.name
        );
    }
    for name in forms.by_name.keys() {
        assert!(
            manifest.iter().any(|w| &w.name == name),
            "checkpoint tensor {name} has no manifest entry"
        );
    }
}

fn write_st(path: &Path, tensors: &[(&str, &str, &[u64])]) {
    let mut obj = serde_json::Map::new();
    obj.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    for (name, dtype, shape) in tensors {
        // data_offsets are never read by the compiler; no data follows the header.
        obj.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}),
        );
    }
    let header = serde_json::to_vec(&obj).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&header).unwrap();
}

#[test]
fn forms_from_synthetic_headers() {
    let dir = tempfile::tempdir().unwrap();
    write_st(
        &dir.path().join("a.safetensors"),
        &[
            (
                "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                "F8_E4M3",
                &[512, 256],
            ),
            (
                "model.language_model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv",
                "F32",
                &[4, 2],
            ),
            (
                "model.language_model.layers.0.mlp.experts.0.gate_proj.weight",
                "F8_E4M3",
                &[128, 256],
            ),
            (
                "model.language_model.layers.0.mlp.experts.1.gate_proj.weight",
                "F8_E4M3",
                &[128, 256],
            ),
            (
                "model.language_model.layers.0.linear_attn.A_log",
                "F32",
                &[4],
            ),
            (
                "model.language_model.layers.0.ple.ple_embedding.layer_multipliers",
                "I64",
                &[3],
            ),
        ],
    );
    // Scales may sit in another shard than their tensor.
    write_st(
        &dir.path().join("b.safetensors"),
        &[
            (
                "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_scale",
                "U8",
                &[128, 8],
            ),
            (
                "model.language_model.layers.0.mlp.experts.1.gate_proj.weight_scale",
                "U8",
                &[128, 8],
            ),
            (
                "model.language_model.layers.0.mlp.shared_expert.up_proj.weight",
                "BF16",
                &[256, 256],
            ),
        ],
    );
    let forms = forms_from_model_dir(dir.path()).unwrap();
    let f = |n: &str| forms.by_name.get(n).copied();
    assert_eq!(
        f("layers.0.linear_attn.in_proj_qkv.weight"),
        Some(StorageForm::Fp8Block)
    );
    assert_eq!(
        f("layers.0.mlp.experts.gate_up_proj"),
        Some(StorageForm::Mxfp8)
    );
    assert_eq!(f("layers.0.linear_attn.A_log"), Some(StorageForm::F32));
    assert_eq!(
        f("layers.0.mlp.shared_expert.up_proj.weight"),
        Some(StorageForm::Bf16)
    );
    assert_eq!(forms.by_name.len(), 4, "{:?}", forms.by_name);

    // An FP8 tensor without a scale is refused, naming the file and the tensor.
    let bad = tempfile::tempdir().unwrap();
    write_st(
        &bad.path().join("x.safetensors"),
        &[("model.layers.0.self_attn.q_proj.weight", "F8_E4M3", &[8, 8])],
    );
    let err = format!("{:#}", forms_from_model_dir(bad.path()).unwrap_err());
    assert!(
        err.contains("x.safetensors") && err.contains("q_proj.weight"),
        "{err}"
    );

    // Pieces of one stacked tensor in different forms are refused.
    let mixed = tempfile::tempdir().unwrap();
    write_st(
        &mixed.path().join("m.safetensors"),
        &[
            (
                "model.layers.0.mlp.experts.0.down_proj.weight",
                "BF16",
                &[8, 8],
            ),
            (
                "model.layers.0.mlp.experts.1.down_proj.weight",
                "F32",
                &[8, 8],
            ),
        ],
    );
    let err = format!("{:#}", forms_from_model_dir(mixed.path()).unwrap_err());
    assert!(err.contains("layers.0.mlp.experts.down_proj"), "{err}");

    // F16 plans as BF16, since the loader reads it as it reads BF16 (converted at load): `compile --model` and
    // `run --plans` agree on such a checkpoint.
    let half = tempfile::tempdir().unwrap();
    write_st(
        &half.path().join("h.safetensors"),
        &[("model.layers.0.self_attn.q_proj.weight", "F16", &[8, 8])],
    );
    let forms = forms_from_model_dir(half.path()).unwrap();
    assert_eq!(
        forms
            .by_name
            .get("layers.0.self_attn.q_proj.weight")
            .copied(),
        Some(StorageForm::Bf16)
    );
}
