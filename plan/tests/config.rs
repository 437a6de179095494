//! Config parsing: transformers 5.23.0 defaults, wrapper vs bare form, the real config, and every refusal naming
//! its field.

use flashplan_plan::config::{ConfigError, GateAct, LayerKind, ModelConfig};
use flashplan_plan::StorageForm;
use serde_json::{json, Value};

fn real_text() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/flash-next.json");
    let root: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    root["text_config"].clone()
}

fn qsa_only() -> Value {
    json!({
        "model_type": "qwen4_exp_text",
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 256,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4
    })
}

/// Defaults of `Qwen4ExpTextConfig` in transformers 5.23.0 (`configuration_qwen4_exp.py`; `default_theta` of
/// `modeling_rope_utils.py`), for a bare config that gives only the QSA fields.
#[test]
fn defaults_match_transformers_5_23() {
    let c = ModelConfig::from_json(&qsa_only()).unwrap();
    assert_eq!(c.vocab_size, 248320);
    assert_eq!(c.hidden_size, 2048);
    assert_eq!(c.num_hidden_layers, 40);
    assert_eq!(c.num_attention_heads, 16);
    assert_eq!(c.num_key_value_heads, 2);
    assert_eq!(c.head_dim, 256);
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert_eq!(c.max_position_embeddings, 32768);
    assert_eq!(c.linear_conv_kernel_dim, 4);
    assert_eq!(c.linear_key_head_dim, 128);
    assert_eq!(c.linear_value_head_dim, 128);
    assert_eq!(c.linear_num_key_heads, 16);
    assert_eq!(c.linear_num_value_heads, 32);
    assert_eq!(c.moe_intermediate_size, 512);
    assert_eq!(c.shared_expert_intermediate_size, 512);
    assert_eq!(c.num_experts, 512);
    assert_eq!(c.num_experts_per_tok, 10);
    assert!(c.norm_topk_prob);
    assert_eq!(c.hc_count, 4);
    assert_eq!(c.hc_lowrank, 320);
    assert!(c.ple_layer_ids.is_empty());
    assert_eq!(
        c.ple_embed_dim, 2048,
        "ple_embed_dim defaults to hidden_size"
    );
    assert_eq!(c.ple_conv_kernel_size, 4);
    assert_eq!(c.ngram_size, 3);
    assert_eq!(c.heads_per_ngram, 8);
    assert_eq!(c.ngram_vocab_size_base, 20_000_000);
    assert_eq!(c.make_ngram_vocab_size_divisible_by, 128);
    assert_eq!(c.seed, 1234);
    assert_eq!(c.split_ngram_parts, 512);
    assert_eq!(
        c.output_gate,
        GateAct::Silu,
        "output_gate_type unset falls back to hidden_act = silu"
    );
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.bos_token_id, None);
    assert!(c.eos_token_ids.is_empty());
    assert_eq!(c.rope.rope_type, "default");
    assert_eq!(c.rope.theta, 10_000.0);
    assert_eq!(c.rope.partial_rotary_factor, 1.0);
    assert_eq!(c.rope.factor, 1.0);
    assert_eq!(c.mtp, None);
    assert_eq!(c.declared_form, StorageForm::Bf16);
    assert!(c.extra_keys.is_empty());
    // Every 4th layer (one-indexed) is indexed attention, the rest linear attention.
    assert_eq!(c.layer_types.len(), 40);
    for (i, k) in c.layer_types.iter().enumerate() {
        let want = if (i + 1) % 4 == 0 {
            LayerKind::Attention
        } else {
            LayerKind::Gdn
        };
        assert_eq!(*k, want, "layer {i}");
    }
}

#[test]
fn wrapper_and_bare_forms_parse_equal() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/flash-next.json");
    let text = std::fs::read_to_string(path).unwrap();
    let wrapper = ModelConfig::from_json_str(&text).unwrap();
    let bare = ModelConfig::from_json(&real_text()).unwrap();
    assert_eq!(wrapper, bare);
    // The tiny demo config is bare; wrapping it gives the same config.
    let tiny_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/flashnext-tiny.json"
    );
    let tiny: Value = serde_json::from_str(&std::fs::read_to_string(tiny_path).unwrap()).unwrap();
    let wrapped = json!({"model_type": "qwen4_exp", "text_config": tiny.clone()});
    assert_eq!(
        ModelConfig::from_json(&tiny).unwrap(),
        ModelConfig::from_json(&wrapped).unwrap()
    );
}

#[test]
fn real_config_parses() {
    let c = ModelConfig::from_json(&real_text()).unwrap();
    assert_eq!(c.num_hidden_layers, 48);
    let gdn = c
        .layer_types
        .iter()
        .filter(|k| **k == LayerKind::Gdn)
        .count();
    assert_eq!(gdn, 36);
    assert_eq!(c.layer_types.len() - gdn, 12);
    assert_eq!(c.ple_layer_ids, vec![2]);
    assert!(c.mtp.is_some());
    assert_eq!(
        c.extra_keys.get("mamba_ssm_dtype").map(String::as_str),
        Some("\"float32\"")
    );
    assert_eq!(c.rope.rope_type, "yarn");
    assert_eq!(c.rope.factor, 2.0);
    assert_eq!(c.rope.original_max_position_embeddings, Some(262144));
    assert_eq!(c.rotary_dim(), 64);
    assert_eq!(c.output_gate, GateAct::Sigmoid);
    assert_eq!(c.eos_token_ids, vec![248044]);
    assert_eq!(c.split_ngram_parts, 128);
}

/// Parses the real text config with `edit` applied and expects a refusal naming `field`.
fn refused(edit: impl FnOnce(&mut serde_json::Map<String, Value>), field: &str) {
    let mut v = real_text();
    edit(v.as_object_mut().unwrap());
    match ModelConfig::from_json(&v) {
        Ok(_) => panic!("accepted a config that breaks the `{field}` rule"),
        Err(e @ ConfigError::Field { .. }) => {
            let msg = e.to_string();
            let ConfigError::Field {
                field: f,
                value,
                expected,
            } = e
            else {
                unreachable!()
            };
            assert_eq!(f, field, "error names the wrong field: {msg}");
            assert!(msg.contains(field), "message does not name {field}: {msg}");
            assert!(
                !value.is_empty() && !expected.is_empty(),
                "message lacks value or expectation: {msg}"
            );
        }
        Err(e) => panic!("expected a field error naming `{field}`, got {e}"),
    }
}

fn set(key: &'static str, v: Value) -> impl FnOnce(&mut serde_json::Map<String, Value>) {
    move |o| {
        o.insert(key.into(), v);
    }
}

fn remove(key: &'static str) -> impl FnOnce(&mut serde_json::Map<String, Value>) {
    move |o| {
        o.remove(key);
    }
}

#[test]
fn refuses_unsupported_layer_type() {
    refused(
        |o| o["layer_types"][3] = json!("sliding_attention"),
        "layer_types[3]",
    );
}

#[test]
fn refuses_unsupported_output_gate() {
    refused(set("output_gate_type", json!("relu")), "output_gate_type");
}

#[test]
fn refuses_hc_count_one() {
    refused(set("hc_count", json!(1)), "hc_count");
}

#[test]
fn refuses_zero_experts() {
    refused(set("num_experts", json!(0)), "num_experts");
}

#[test]
fn refuses_experts_per_tok_out_of_range() {
    refused(set("num_experts_per_tok", json!(0)), "num_experts_per_tok");
    refused(
        set("num_experts_per_tok", json!(513)),
        "num_experts_per_tok",
    );
}

#[test]
fn refuses_zero_moe_sizes() {
    refused(
        set("moe_intermediate_size", json!(0)),
        "moe_intermediate_size",
    );
    refused(
        set("shared_expert_intermediate_size", json!(0)),
        "shared_expert_intermediate_size",
    );
}

#[test]
fn refuses_missing_qsa_field() {
    refused(remove("indexer_budget"), "indexer_budget");
    refused(set("indexer_n_heads", Value::Null), "indexer_n_heads");
}

#[test]
fn refuses_zero_qsa_field() {
    refused(set("indexer_n_heads", json!(0)), "indexer_n_heads");
}

#[test]
fn refuses_indexer_kv_heads_not_one() {
    refused(set("indexer_kv_heads", json!(2)), "indexer_kv_heads");
}

#[test]
fn refuses_budget_not_divisible() {
    refused(set("indexer_budget", json!(2050)), "indexer_budget");
}

#[test]
fn refuses_rotary_dim_above_indexer_head_dim() {
    // rotary dim = 256 * 0.25 = 64 > 32.
    refused(set("indexer_head_dim", json!(32)), "indexer_head_dim");
}

#[test]
fn refuses_ple_embed_dim_not_divisible() {
    // 16 n-gram heads ((3 - 1) x 8).
    refused(set("ple_embed_dim", json!(2568)), "ple_embed_dim");
}

#[test]
fn refuses_ple_layer_id_out_of_range() {
    refused(set("ple_layer_ids", json!([49])), "ple_layer_ids");
    refused(set("ple_layer_ids", json!([0])), "ple_layer_ids");
    refused(
        set("ple_layer_ids", json!([4294967298u64])),
        "ple_layer_ids",
    );
}

#[test]
fn refuses_ple_on_attention_layer() {
    // Layer id 4 (one-indexed) is full attention.
    refused(set("ple_layer_ids", json!([2, 4])), "ple_layer_ids");
}

#[test]
fn refuses_ple_without_eos() {
    refused(remove("eos_token_id"), "eos_token_id");
    refused(set("eos_token_id", json!([])), "eos_token_id");
}

#[test]
fn refuses_dedicated_mtp_embeddings() {
    refused(
        set("mtp_use_dedicated_embeddings", json!(true)),
        "mtp_use_dedicated_embeddings",
    );
}

#[test]
fn refuses_two_mtp_layers_top_level() {
    refused(
        set("mtp_num_hidden_layers", json!(2)),
        "mtp_num_hidden_layers",
    );
}

#[test]
fn refuses_two_mtp_layers_in_block() {
    refused(
        |o| o["mtp"]["num_hidden_layers"] = json!(2),
        "mtp.num_hidden_layers",
    );
}

#[test]
fn refuses_mtp_layer_types_other_than_one_attention_layer() {
    // One drafter layer: its layer_types holds one entry, an attention layer.
    refused(
        |o| o["mtp"]["layer_types"] = json!(["full_attention", "full_attention"]),
        "mtp.layer_types",
    );
    refused(|o| o["mtp"]["layer_types"] = json!([]), "mtp.layer_types");
    refused(
        |o| o["mtp"]["layer_types"] = json!(["linear_attention"]),
        "mtp.layer_types",
    );
    refused(
        |o| o["mtp"]["layer_types"] = json!("full_attention"),
        "mtp.layer_types",
    );
}

#[test]
fn refuses_mtp_hidden_state_from_layer() {
    refused(
        set("mtp_use_hidden_state_from_layer", json!(40)),
        "mtp_use_hidden_state_from_layer",
    );
    refused(
        |o| o["mtp"]["mtp_use_hidden_state_from_layer"] = json!(40),
        "mtp.mtp_use_hidden_state_from_layer",
    );
}

#[test]
fn refuses_layer_types_length_mismatch() {
    refused(set("num_hidden_layers", json!(47)), "layer_types");
}

#[test]
fn refuses_wrong_model_type() {
    refused(set("model_type", json!("qwen3_next")), "model_type");
    let err = ModelConfig::from_json(&json!({"model_type": "qwen3_next", "text_config": {}}))
        .unwrap_err();
    assert!(err.to_string().contains("model_type"), "{err}");
}

#[test]
fn refuses_string_for_int() {
    refused(set("hidden_size", json!("2560")), "hidden_size");
}

#[test]
fn refuses_malformed_json() {
    let err = ModelConfig::from_json_str("{\"model_type\": \"qwen4_exp_text\",").unwrap_err();
    assert!(matches!(err, ConfigError::Json(_)), "{err:?}");
    assert!(err.to_string().contains("not valid JSON"), "{err}");
}

#[test]
fn extra_keys_are_kept_not_refused() {
    let mut v = real_text();
    v["some_future_knob"] = json!({"a": 1});
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(
        c.extra_keys.get("some_future_knob").map(String::as_str),
        Some("{\"a\":1}")
    );
    assert!(c.extra_keys.contains_key("mamba_ssm_dtype"));
}

#[test]
fn refuses_token_ids_outside_the_vocabulary() {
    // 248320 is the real vocab_size: an eos or bos at or past it would never be sampled or embedded.
    refused(set("eos_token_id", json!(248320)), "eos_token_id");
    refused(set("eos_token_id", json!([248044, 300000])), "eos_token_id");
    refused(set("bos_token_id", json!(248320)), "bos_token_id");
    // Past u32: refused, not cut to its low bits (2^32 + 5 would have become 5).
    refused(set("eos_token_id", json!(4294967301u64)), "eos_token_id");
    refused(set("bos_token_id", json!(4294967301u64)), "bos_token_id");
}

#[test]
fn refuses_an_eps_f32_cannot_hold_a_zero_length_and_yarn_without_its_factor() {
    // The norms add eps in f32: 1e39 would be infinity there, 1e-50 zero.
    for eps in [json!(1e39), json!(1e300), json!(1e-50)] {
        refused(set("rms_norm_eps", eps), "rms_norm_eps");
    }
    refused(
        set("max_position_embeddings", json!(0)),
        "max_position_embeddings",
    );
    refused(
        |o| {
            o["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("factor");
        },
        "rope_parameters.factor",
    );
    refused(
        |o| o["rope_parameters"]["original_max_position_embeddings"] = json!(0),
        "rope_parameters.original_max_position_embeddings",
    );
    // The value as JSON writes it.
    let mut v = real_text();
    v["rms_norm_eps"] = json!(1e300);
    let e = ModelConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("`rms_norm_eps` = 1e+300: expected"), "{e}");
    // The real config's own values stay accepted, and so does a small eps f32 holds.
    let mut v = real_text();
    v["rms_norm_eps"] = json!(1e-30);
    assert!(ModelConfig::from_json(&v).is_ok());
}

#[test]
fn refuses_a_rotary_base_that_is_not_positive() {
    for theta in [json!(0), json!(-1.0)] {
        refused(
            |o| o["rope_parameters"]["rope_theta"] = theta,
            "rope_parameters.rope_theta",
        );
    }
}

#[test]
fn names_the_ple_field_at_fault() {
    // Each rule names its own field, not a neighbour computed from it.
    refused(set("ngram_size", json!(1)), "ngram_size");
    refused(set("heads_per_ngram", json!(0)), "heads_per_ngram");
    refused(
        set("make_ngram_vocab_size_divisible_by", json!(0)),
        "make_ngram_vocab_size_divisible_by",
    );
    refused(
        set("ngram_vocab_size_base", json!(1)),
        "ngram_vocab_size_base",
    );
}

#[test]
fn a_missing_model_type_is_said_so() {
    let e = ModelConfig::from_json(&json!({"hidden_size": 8})).unwrap_err();
    assert!(
        e.to_string().contains("model_type") && e.to_string().contains("missing"),
        "{e}"
    );
}

#[test]
fn the_size_fields_a_config_leaves_out_are_named_with_the_defaults_taken() {
    use flashplan_plan::config::defaulted_size_fields;
    // The published wrapper config has them all.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/flash-next.json");
    let text = std::fs::read_to_string(path).unwrap();
    let cfg = ModelConfig::from_json_str(&text).unwrap();
    assert!(defaulted_size_fields(&text, &cfg).is_empty());
    // Left out of the wrapper's text_config, or null in a bare config: named in SIZE_FIELDS order, with
    // transformers' defaults (hidden_size 2048, num_experts 512).
    let mut root: Value = serde_json::from_str(&text).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    t.remove("num_experts");
    t.remove("hidden_size");
    let edited = root.to_string();
    let cfg = ModelConfig::from_json_str(&edited).unwrap();
    assert_eq!(
        defaulted_size_fields(&edited, &cfg),
        [
            ("hidden_size", "2048".to_string()),
            ("num_experts", "512".to_string())
        ]
    );
    let mut bare = real_text();
    bare["num_experts"] = Value::Null;
    let edited = bare.to_string();
    let cfg = ModelConfig::from_json_str(&edited).unwrap();
    assert_eq!(
        defaulted_size_fields(&edited, &cfg),
        [("num_experts", "512".to_string())]
    );
}

#[test]
fn every_size_field_left_out_reports_the_value_taken() {
    // Each field of the lists, left out of the bare real config (which has PLE layers): reported with a number,
    // the value the parsed config holds under that name (a renamed field would show null).
    use flashplan_plan::config::{defaulted_size_fields, PLE_SIZE_FIELDS, SIZE_FIELDS};
    let mut checked = Vec::new();
    for key in SIZE_FIELDS.iter().chain(PLE_SIZE_FIELDS) {
        let mut v = real_text();
        v.as_object_mut().unwrap().remove(*key);
        let text = v.to_string();
        let Ok(cfg) = ModelConfig::from_json_str(&text) else {
            // A default the rest of the real config refuses (a head count that no longer divides): named there.
            continue;
        };
        let got = defaulted_size_fields(&text, &cfg);
        assert_eq!(got.len(), 1, "{key}: {got:?}");
        assert_eq!(got[0].0, *key);
        assert_eq!(
            got[0].1,
            serde_json::to_value(&cfg).unwrap()[*key].to_string(),
            "{key}"
        );
        assert!(got[0].1.parse::<u64>().is_ok(), "{key}: {}", got[0].1);
        checked.push(*key);
    }
    // Only num_hidden_layers is refused on its own: its default 40 disagrees with the 48 layer_types.
    let all: Vec<&str> = SIZE_FIELDS.iter().chain(PLE_SIZE_FIELDS).copied().collect();
    let skipped: Vec<&&str> = all.iter().filter(|k| !checked.contains(*k)).collect();
    assert_eq!(skipped, [&"num_hidden_layers"]);
    // Without PLE layers the PLE fields size nothing and are not named.
    let mut v = real_text();
    v["ple_layer_ids"] = json!([]);
    v.as_object_mut().unwrap().remove("ngram_vocab_size_base");
    let text = v.to_string();
    let cfg = ModelConfig::from_json_str(&text).unwrap();
    assert!(defaulted_size_fields(&text, &cfg).is_empty());
}
