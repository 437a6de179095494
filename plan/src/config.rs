//! Flash Next configuration: parsing `config.json` (wrapper `qwen4_exp` or bare `qwen4_exp_text`), defaults equal to
//! transformers 5.23.0's `Qwen4ExpTextConfig`, and the validity rules of its `validate_architecture`, plus the MTP
//! block (`flash-next.md` section 9).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// A config that cannot be served, naming the field, the value and what was expected.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ConfigError {
    /// The file is not JSON or not an object.
    #[error("config is not valid JSON: {0}")]
    Json(String),
    /// A field has a value of the wrong kind or out of range.
    #[error("config field `{field}` = {value}: expected {expected}")]
    Field {
        /// Field name (dotted for nested fields, e.g. `rope_parameters.factor`).
        field: String,
        /// The value found, as JSON text.
        value: String,
        /// What the engine accepts.
        expected: String,
    },
}

/// A token id: a non-negative integer that fits `u32` (vocabularies are far smaller; the range against
/// `vocab_size` is checked by [`ModelConfig::validate`]).
fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

fn field_err(
    field: &str,
    value: impl std::fmt::Display,
    expected: impl Into<String>,
) -> ConfigError {
    ConfigError::Field {
        field: field.to_string(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// The kind of one decoder layer (`layer_types`; `full_attention` is read as `indexed_attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerKind {
    /// GatedDeltaNet (`linear_attention`), `flash-next.md` section 5.
    Gdn,
    /// Attention with the QSA indexer (`indexed_attention`), section 6.
    Attention,
}

/// Output gate activation of the GDN gated norm (`output_gate_type`, falling back to `hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GateAct {
    /// `sigmoid(z)`.
    Sigmoid,
    /// `silu(z)`.
    Silu,
}

/// RoPE parameters after resolving `rope_parameters` (transformers `_compute_*_parameters`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeConfig {
    /// `"default"` or `"yarn"`.
    pub rope_type: String,
    /// Base theta.
    pub theta: f64,
    /// Fraction of each head that rotates.
    pub partial_rotary_factor: f64,
    /// YaRN scaling factor (1.0 for default RoPE).
    pub factor: f64,
    /// YaRN original context.
    pub original_max_position_embeddings: Option<u64>,
    /// YaRN beta_fast (default 32).
    pub beta_fast: f64,
    /// YaRN beta_slow (default 1).
    pub beta_slow: f64,
    /// YaRN explicit attention factor, if given.
    pub attention_factor: Option<f64>,
    /// YaRN `truncate` (default true).
    pub truncate: bool,
}

/// The MTP drafter block (`mtp`, `mtp_num_hidden_layers`), `flash-next.md` section 9.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MtpConfig {
    /// Always 1 (anything else is refused).
    pub num_hidden_layers: u32,
}

/// Storage form of a tensor in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum StorageForm {
    /// f32 values.
    F32,
    /// bfloat16 values.
    Bf16,
    /// E4M3 codes with 128x128 block scales (`weight_scale_inv`, f32).
    Fp8Block,
    /// E4M3 codes with one E8M0 scale per 32 inputs (`weight_scale`, u8).
    Mxfp8,
}

impl StorageForm {
    /// Bytes of a `[rows, cols]` tensor in this form, scales included.
    pub fn bytes(self, rows: u64, cols: u64) -> u64 {
        match self {
            StorageForm::F32 => rows * cols * 4,
            StorageForm::Bf16 => rows * cols * 2,
            StorageForm::Fp8Block => rows * cols + rows.div_ceil(128) * cols.div_ceil(128) * 4,
            StorageForm::Mxfp8 => rows * cols + rows * cols.div_ceil(32),
        }
    }
}

/// The text config of Flash Next, resolved (defaults applied, `layer_types` expanded), validated.
///
/// Field names follow transformers' `Qwen4ExpTextConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct ModelConfig {
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_hidden_layers: u32,
    pub num_attention_heads: u32,
    pub num_key_value_heads: u32,
    pub head_dim: u32,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: u64,
    pub linear_conv_kernel_dim: u32,
    pub linear_key_head_dim: u32,
    pub linear_value_head_dim: u32,
    pub linear_num_key_heads: u32,
    pub linear_num_value_heads: u32,
    pub moe_intermediate_size: u32,
    pub shared_expert_intermediate_size: u32,
    pub num_experts: u32,
    pub num_experts_per_tok: u32,
    pub norm_topk_prob: bool,
    pub hc_count: u32,
    pub hc_lowrank: u32,
    /// One-indexed decoder layer ids with PLE, sorted and deduplicated.
    pub ple_layer_ids: Vec<u32>,
    pub ple_embed_dim: u32,
    pub ple_conv_kernel_size: u32,
    pub ngram_size: u32,
    pub heads_per_ngram: u32,
    pub ngram_vocab_size_base: u64,
    pub make_ngram_vocab_size_divisible_by: u64,
    pub seed: u64,
    pub split_ngram_parts: u32,
    pub indexer_n_heads: u32,
    pub indexer_kv_heads: u32,
    pub indexer_head_dim: u32,
    pub indexer_budget: u32,
    pub indexer_compress_ratio: u32,
    pub output_gate: GateAct,
    pub layer_types: Vec<LayerKind>,
    pub rope: RopeConfig,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub tie_word_embeddings: bool,
    /// The MTP drafter, when the config declares one.
    pub mtp: Option<MtpConfig>,
    /// Storage form of the linears and of the routed experts as declared by `quantization_config` (BF16 if absent).
    pub declared_form: StorageForm,
    /// Keys present in the file that the engine does not use, with their JSON values (listed by `inspect`).
    pub extra_keys: BTreeMap<String, String>,
}

/// Keys the engine reads (or knowingly accepts as irrelevant to serving); everything else lands in `extra_keys`.
const KNOWN_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "head_dim",
    "attention_bias",
    "attention_dropout",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts_per_tok",
    "num_experts",
    "norm_topk_prob",
    "output_router_logits",
    "router_aux_loss_coef",
    "hc_count",
    "hc_lowrank",
    "ple_layer_ids",
    "ple_embed_dim",
    "ple_conv_kernel_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
    "split_ngram_parts",
    "seed",
    "output_gate_type",
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
    "rope_parameters",
    "dtype",
    "torch_dtype",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "mtp",
    "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings",
    "mtp_use_hidden_state_from_layer",
    "model_type",
    "layer_types",
    "architectures",
    "transformers_version",
    "quantization_config",
    "number_of_conv_states",
];

struct Reader<'a> {
    obj: &'a Map<String, Value>,
}

impl Reader<'_> {
    fn uint(&self, key: &str, default: Option<u64>) -> Result<u64, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => {
                default.ok_or_else(|| field_err(key, "missing", "a non-negative integer"))
            }
            Some(v) => v
                .as_u64()
                .ok_or_else(|| field_err(key, v, "a non-negative integer")),
        }
    }
    fn opt_uint(&self, key: &str) -> Result<Option<u64>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| field_err(key, v, "a non-negative integer or null")),
        }
    }
    fn u32(&self, key: &str, default: Option<u64>) -> Result<u32, ConfigError> {
        let v = self.uint(key, default)?;
        u32::try_from(v).map_err(|_| field_err(key, v, "an integer below 2^32"))
    }
    fn float(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| field_err(key, v, "a number")),
        }
    }
    fn boolean(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| field_err(key, v, "true or false")),
        }
    }
    fn string(&self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(field_err(key, v, "a string")),
        }
    }
}

/// The fields that size the model, in the order a reader compares two models: [`defaulted_size_fields`] reports
/// those a config leaves out, and a plan's config mismatch names those that differ first (`format.rs`).
pub const SIZE_FIELDS: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "hc_count",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "shared_expert_intermediate_size",
    "hc_lowrank",
];

/// The fields that size the per-layer n-gram embedding (PLE), which [`defaulted_size_fields`] reports for a config
/// with PLE layers (`ngram_vocab_size_base` left out gives tables of 20 million rows).
pub const PLE_SIZE_FIELDS: &[&str] = &[
    "ple_embed_dim",
    "ple_conv_kernel_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
];

/// The [`SIZE_FIELDS`] (and with PLE layers the [`PLE_SIZE_FIELDS`]) that the config.json `text` leaves out or sets
/// to null (in its `text_config` for a `qwen4_exp` wrapper), each with the value `cfg`, parsed from it, took instead:
/// transformers' config defaults, which are not all the real model's sizes (`hidden_size` 2048). A config missing
/// `num_experts` otherwise fails later, on a plan or tensor shape that does not say the field was absent. Empty for
/// text that is not a JSON object.
pub fn defaulted_size_fields(text: &str, cfg: &ModelConfig) -> Vec<(&'static str, String)> {
    let Ok(Value::Object(root)) = serde_json::from_str::<Value>(text) else {
        return Vec::new();
    };
    let obj = match root.get("text_config") {
        Some(Value::Object(t))
            if root.get("model_type").and_then(Value::as_str) == Some("qwen4_exp") =>
        {
            t
        }
        _ => &root,
    };
    let taken = serde_json::to_value(cfg).unwrap_or_default();
    let ple: &[&str] = if cfg.ple_layer_ids.is_empty() {
        &[]
    } else {
        PLE_SIZE_FIELDS
    };
    SIZE_FIELDS
        .iter()
        .chain(ple)
        .filter(|k| obj.get(**k).is_none_or(Value::is_null))
        .map(|k| (*k, taken[*k].to_string()))
        .collect()
}

impl ModelConfig {
    /// Parses a `config.json` text (wrapper `qwen4_exp` with `text_config`, or bare `qwen4_exp_text`).
    ///
    /// # Errors
    /// [`ConfigError`] naming the first field that is malformed or breaks a rule of `validate_architecture`.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let root: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        Self::from_json(&root)
    }

    /// Parses an already-decoded JSON config; see [`ModelConfig::from_json_str`].
    pub fn from_json(root: &Value) -> Result<Self, ConfigError> {
        let root = root
            .as_object()
            .ok_or_else(|| ConfigError::Json("the top level is not an object".into()))?;
        let model_type = match root.get("model_type") {
            None | Some(Value::Null) => {
                return Err(field_err(
                    "model_type",
                    "missing",
                    "\"qwen4_exp\" or \"qwen4_exp_text\"",
                ))
            }
            Some(Value::String(t)) => t.as_str(),
            Some(v) => {
                return Err(field_err(
                    "model_type",
                    v,
                    "\"qwen4_exp\" or \"qwen4_exp_text\"",
                ))
            }
        };
        let text = match model_type {
            "qwen4_exp" => match root.get("text_config") {
                Some(Value::Object(t)) => t,
                Some(v) => return Err(field_err("text_config", v, "an object")),
                None => {
                    return Err(field_err(
                        "text_config",
                        "missing",
                        "the text config of a qwen4_exp wrapper",
                    ))
                }
            },
            "qwen4_exp_text" => root,
            other => {
                return Err(field_err(
                    "model_type",
                    format!("{other:?}"),
                    "\"qwen4_exp\" or \"qwen4_exp_text\"",
                ))
            }
        };
        if let Some(t) = text.get("model_type").and_then(Value::as_str) {
            if t != "qwen4_exp_text" {
                return Err(field_err(
                    "text_config.model_type",
                    format!("{t:?}"),
                    "\"qwen4_exp_text\"",
                ));
            }
        }
        let r = Reader { obj: text };
        let hidden_size = r.u32("hidden_size", Some(2048))?;
        let num_hidden_layers = r.u32("num_hidden_layers", Some(40))?;

        let layer_types = match text.get("layer_types") {
            None | Some(Value::Null) => (0..num_hidden_layers)
                .map(|i| {
                    if (i + 1) % 4 == 0 {
                        LayerKind::Attention
                    } else {
                        LayerKind::Gdn
                    }
                })
                .collect(),
            Some(Value::Array(items)) => {
                let mut kinds = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    kinds.push(match item.as_str() {
                        Some("linear_attention") => LayerKind::Gdn,
                        Some("full_attention") | Some("indexed_attention") => LayerKind::Attention,
                        _ => {
                            return Err(field_err(
                                &format!("layer_types[{i}]"),
                                item,
                                "\"linear_attention\", \"full_attention\" or \"indexed_attention\"",
                            ))
                        }
                    });
                }
                kinds
            }
            Some(v) => return Err(field_err("layer_types", v, "a list of layer type strings")),
        };
        if layer_types.len() != num_hidden_layers as usize {
            return Err(field_err(
                "layer_types",
                format!("{} entries", layer_types.len()),
                format!("num_hidden_layers = {num_hidden_layers} entries"),
            ));
        }

        let hidden_act = r.string("hidden_act")?.unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(field_err(
                "hidden_act",
                format!("{hidden_act:?}"),
                "\"silu\"",
            ));
        }
        let gate_name = r.string("output_gate_type")?.unwrap_or(hidden_act);
        let output_gate = match gate_name.as_str() {
            "sigmoid" => GateAct::Sigmoid,
            "silu" => GateAct::Silu,
            other => {
                return Err(field_err(
                    "output_gate_type",
                    format!("{other:?}"),
                    "\"sigmoid\" or \"silu\"",
                ))
            }
        };

        let rope = parse_rope(text.get("rope_parameters"), &r)?;

        let ple_layer_ids = match text.get("ple_layer_ids") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(items)) => {
                let mut ids = Vec::new();
                for item in items {
                    let id = item
                        .as_u64()
                        .and_then(|v| u32::try_from(v).ok())
                        .ok_or_else(|| {
                            field_err("ple_layer_ids", item, "one-indexed layer ids (integers)")
                        })?;
                    ids.push(id);
                }
                ids.sort_unstable();
                ids.dedup();
                ids
            }
            Some(v) => {
                return Err(field_err(
                    "ple_layer_ids",
                    v,
                    "a list of one-indexed layer ids",
                ))
            }
        };

        let eos_token_ids = match text.get("eos_token_id") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    token_id(v).ok_or_else(|| field_err("eos_token_id", v, "token ids (integers)"))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => vec![token_id(v).ok_or_else(|| {
                field_err(
                    "eos_token_id",
                    v,
                    "a token id (an integer) or a list of them",
                )
            })?],
        };

        let mtp = parse_mtp(text, &r)?;
        let declared_form = parse_quantization(
            root.get("quantization_config")
                .or(text.get("quantization_config")),
        )?;

        let indexer = |k: &str| r.opt_uint(k);
        let qsa = [
            ("indexer_n_heads", indexer("indexer_n_heads")?),
            ("indexer_kv_heads", indexer("indexer_kv_heads")?),
            ("indexer_head_dim", indexer("indexer_head_dim")?),
            ("indexer_budget", indexer("indexer_budget")?),
            ("indexer_compress_ratio", indexer("indexer_compress_ratio")?),
        ];
        let missing: Vec<&str> = qsa
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| *k)
            .collect();
        if !missing.is_empty() {
            return Err(field_err(
                missing[0],
                "missing",
                "a positive integer: flashplan serves attention only with the QSA indexer (all five indexer_* fields)",
            ));
        }
        let q = |i: usize| qsa[i].1.unwrap_or(0) as u32;

        let mut extra_keys = BTreeMap::new();
        for (k, v) in text {
            if !KNOWN_KEYS.contains(&k.as_str()) {
                extra_keys.insert(k.clone(), v.to_string());
            }
        }

        let cfg = ModelConfig {
            vocab_size: r.u32("vocab_size", Some(248320))?,
            hidden_size,
            num_hidden_layers,
            num_attention_heads: r.u32("num_attention_heads", Some(16))?,
            num_key_value_heads: r.u32("num_key_value_heads", Some(2))?,
            head_dim: r.u32("head_dim", Some(256))?,
            rms_norm_eps: r.float("rms_norm_eps", 1e-6)?,
            max_position_embeddings: r.uint("max_position_embeddings", Some(32768))?,
            linear_conv_kernel_dim: r.u32("linear_conv_kernel_dim", Some(4))?,
            linear_key_head_dim: r.u32("linear_key_head_dim", Some(128))?,
            linear_value_head_dim: r.u32("linear_value_head_dim", Some(128))?,
            linear_num_key_heads: r.u32("linear_num_key_heads", Some(16))?,
            linear_num_value_heads: r.u32("linear_num_value_heads", Some(32))?,
            moe_intermediate_size: r.u32("moe_intermediate_size", Some(512))?,
            shared_expert_intermediate_size: r.u32("shared_expert_intermediate_size", Some(512))?,
            num_experts: r.u32("num_experts", Some(512))?,
            num_experts_per_tok: r.u32("num_experts_per_tok", Some(10))?,
            norm_topk_prob: r.boolean("norm_topk_prob", true)?,
            hc_count: r.u32("hc_count", Some(4))?,
            hc_lowrank: r.u32("hc_lowrank", Some(320))?,
            ple_layer_ids,
            ple_embed_dim: r.u32("ple_embed_dim", Some(hidden_size as u64))?,
            ple_conv_kernel_size: r.u32("ple_conv_kernel_size", Some(4))?,
            ngram_size: r.u32("ngram_size", Some(3))?,
            heads_per_ngram: r.u32("heads_per_ngram", Some(8))?,
            ngram_vocab_size_base: r.uint("ngram_vocab_size_base", Some(20_000_000))?,
            make_ngram_vocab_size_divisible_by: r
                .uint("make_ngram_vocab_size_divisible_by", Some(128))?,
            seed: r.uint("seed", Some(1234))?,
            split_ngram_parts: r.u32("split_ngram_parts", Some(512))?,
            indexer_n_heads: q(0),
            indexer_kv_heads: q(1),
            indexer_head_dim: q(2),
            indexer_budget: q(3),
            indexer_compress_ratio: q(4),
            output_gate,
            layer_types,
            rope,
            eos_token_ids,
            bos_token_id: match text.get("bos_token_id") {
                None | Some(Value::Null) => None,
                Some(v) => Some(
                    token_id(v)
                        .ok_or_else(|| field_err("bos_token_id", v, "a token id (an integer)"))?,
                ),
            },
            tie_word_embeddings: r.boolean("tie_word_embeddings", false)?,
            mtp,
            declared_form,
            extra_keys,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The rules of transformers' `validate_architecture`, plus the ones the engine needs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("vocab_size", self.vocab_size as u64),
            ("hidden_size", self.hidden_size as u64),
            ("num_hidden_layers", self.num_hidden_layers as u64),
            ("num_attention_heads", self.num_attention_heads as u64),
            ("num_key_value_heads", self.num_key_value_heads as u64),
            ("head_dim", self.head_dim as u64),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim as u64),
            ("linear_key_head_dim", self.linear_key_head_dim as u64),
            ("linear_value_head_dim", self.linear_value_head_dim as u64),
            ("linear_num_key_heads", self.linear_num_key_heads as u64),
            ("linear_num_value_heads", self.linear_num_value_heads as u64),
            ("hc_lowrank", self.hc_lowrank as u64),
        ];
        for (k, v) in positive {
            if v == 0 {
                return Err(field_err(k, v, "a positive integer"));
            }
        }
        let in_vocab = format!("a token id below vocab_size {}", self.vocab_size);
        for &id in &self.eos_token_ids {
            if id >= self.vocab_size {
                return Err(field_err("eos_token_id", id, in_vocab));
            }
        }
        if let Some(id) = self.bos_token_id.filter(|&id| id >= self.vocab_size) {
            return Err(field_err("bos_token_id", id, in_vocab));
        }
        if self.hc_count <= 1 {
            return Err(field_err(
                "hc_count",
                self.hc_count,
                "an integer > 1 (Qwen4-Exp requires hc_count > 1)",
            ));
        }
        if self.num_experts == 0 {
            return Err(field_err("num_experts", self.num_experts, "an integer > 0"));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(field_err(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                format!("an integer in [1, num_experts = {}]", self.num_experts),
            ));
        }
        if self.moe_intermediate_size == 0 {
            return Err(field_err("moe_intermediate_size", 0, "an integer > 0"));
        }
        if self.shared_expert_intermediate_size == 0 {
            return Err(field_err(
                "shared_expert_intermediate_size",
                0,
                "an integer > 0",
            ));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(field_err(
                "num_key_value_heads",
                self.num_key_value_heads,
                format!(
                    "a divisor of num_attention_heads = {}",
                    self.num_attention_heads
                ),
            ));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return Err(field_err(
                "linear_num_key_heads",
                self.linear_num_key_heads,
                format!(
                    "a divisor of linear_num_value_heads = {}",
                    self.linear_num_value_heads
                ),
            ));
        }
        for (k, v) in [
            ("indexer_n_heads", self.indexer_n_heads),
            ("indexer_kv_heads", self.indexer_kv_heads),
            ("indexer_head_dim", self.indexer_head_dim),
            ("indexer_budget", self.indexer_budget),
            ("indexer_compress_ratio", self.indexer_compress_ratio),
        ] {
            if v == 0 {
                return Err(field_err(
                    k,
                    v,
                    "a positive integer (QSA config values must be positive)",
                ));
            }
        }
        if self.indexer_kv_heads != 1 {
            return Err(field_err(
                "indexer_kv_heads",
                self.indexer_kv_heads,
                "1 (Qwen4-Exp QSA requires one key head)",
            ));
        }
        if self.indexer_budget % self.indexer_compress_ratio != 0 {
            return Err(field_err(
                "indexer_budget",
                self.indexer_budget,
                format!(
                    "a multiple of indexer_compress_ratio = {}",
                    self.indexer_compress_ratio
                ),
            ));
        }
        let rot = self.rotary_dim();
        if rot > self.indexer_head_dim {
            return Err(field_err(
                "indexer_head_dim",
                self.indexer_head_dim,
                format!(
                    "at least the attention rotary dim {rot} (head_dim x partial_rotary_factor)"
                ),
            ));
        }
        if rot % 2 != 0 {
            return Err(field_err(
                "rope_parameters.partial_rotary_factor",
                self.rope.partial_rotary_factor,
                "a factor giving an even rotary dim",
            ));
        }
        if !self.ple_layer_ids.is_empty() {
            if self.ngram_size < 2 {
                return Err(field_err(
                    "ngram_size",
                    self.ngram_size,
                    "an integer >= 2 (n-grams of the previous ngram_size - 1 tokens and the current one)",
                ));
            }
            if self.heads_per_ngram == 0 {
                return Err(field_err("heads_per_ngram", 0, "a positive integer"));
            }
            let heads = (self.ngram_size - 1) * self.heads_per_ngram;
            if self.ple_embed_dim == 0 || self.ple_embed_dim % heads != 0 {
                return Err(field_err(
                    "ple_embed_dim",
                    self.ple_embed_dim,
                    format!("a positive multiple of the {heads} n-gram heads ((ngram_size - 1) x heads_per_ngram)"),
                ));
            }
            for &id in &self.ple_layer_ids {
                if id < 1 || id > self.num_hidden_layers {
                    return Err(field_err(
                        "ple_layer_ids",
                        id,
                        format!("one-indexed ids in [1, {}]", self.num_hidden_layers),
                    ));
                }
                if self.layer_types[id as usize - 1] != LayerKind::Gdn {
                    return Err(field_err(
                        "ple_layer_ids",
                        id,
                        "ids of linear_attention layers (PLE is only supported there)",
                    ));
                }
            }
            if self.eos_token_ids.is_empty() {
                return Err(field_err(
                    "eos_token_id",
                    "null",
                    "an id: it must be set when PLE layers are enabled",
                ));
            }
            if self.ple_conv_kernel_size == 0 {
                return Err(field_err("ple_conv_kernel_size", 0, "a positive integer"));
            }
            if self.ngram_vocab_size_base < 2 {
                return Err(field_err(
                    "ngram_vocab_size_base",
                    self.ngram_vocab_size_base,
                    "an integer >= 2",
                ));
            }
            if self.make_ngram_vocab_size_divisible_by == 0 {
                return Err(field_err(
                    "make_ngram_vocab_size_divisible_by",
                    0,
                    "a positive integer",
                ));
            }
        }
        if self.tie_word_embeddings {
            return Err(field_err(
                "tie_word_embeddings",
                true,
                "false (Flash Next has an untied lm_head)",
            ));
        }
        // The kernels and the CPU reference add it in f32: a value f32 rounds to 0 or infinity would not be this
        // config's norm.
        let eps32 = self.rms_norm_eps as f32;
        if !(self.rms_norm_eps > 0.0 && eps32 > 0.0 && eps32.is_finite()) {
            return Err(field_err(
                "rms_norm_eps",
                // As JSON writes it (1e300, not 301 digits).
                serde_json::json!(self.rms_norm_eps),
                "a positive number that f32 holds (about 1e-45 to 3e38; the norms run in f32)",
            ));
        }
        // (transformers takes 0 with plain RoPE; no position could be served with it, and the default context is
        // taken from it.)
        if self.max_position_embeddings == 0 {
            return Err(field_err(
                "max_position_embeddings",
                self.max_position_embeddings,
                "a positive number of positions",
            ));
        }
        Ok(())
    }

    /// Rotary dims of an attention head: `int(head_dim * partial_rotary_factor)`.
    pub fn rotary_dim(&self) -> u32 {
        (self.head_dim as f64 * self.rope.partial_rotary_factor) as u32
    }
    /// The 4D width of the residual: `hc_count * hidden_size`.
    pub fn hc_width(&self) -> u32 {
        self.hc_count * self.hidden_size
    }
    /// GDN conv channels: `2 * key heads * key dim + value heads * value dim`.
    pub fn gdn_conv_dim(&self) -> u32 {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Number of n-gram heads of one PLE layer: `(ngram_size - 1) * heads_per_ngram`.
    pub fn ple_heads(&self) -> u32 {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
    /// The PLE conv tail length: `(ple_conv_kernel_size - 1) * ngram_size`.
    pub fn ple_tail(&self) -> u32 {
        (self.ple_conv_kernel_size - 1) * self.ngram_size
    }
    /// The first eos id (PLE pads with it).
    pub fn eos(&self) -> u32 {
        self.eos_token_ids.first().copied().unwrap_or(0)
    }
    /// Number of blocks a query may select: `indexer_budget / indexer_compress_ratio`.
    pub fn block_topk(&self) -> u32 {
        self.indexer_budget / self.indexer_compress_ratio
    }
}

fn parse_rope(v: Option<&Value>, r: &Reader) -> Result<RopeConfig, ConfigError> {
    let empty = Map::new();
    let obj = match v {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(o)) => o,
        Some(v) => return Err(field_err("rope_parameters", v, "an object")),
    };
    let rr = Reader { obj };
    let rope_type = rr
        .string("rope_type")?
        .or(rr.string("type")?)
        .unwrap_or_else(|| "default".into());
    if rope_type != "default" && rope_type != "yarn" {
        return Err(field_err(
            "rope_parameters.rope_type",
            format!("{rope_type:?}"),
            "\"default\" or \"yarn\"",
        ));
    }
    let theta = match obj.get("rope_theta") {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| field_err("rope_parameters.rope_theta", v, "a number"))?,
        None => r.float("rope_theta", 10000.0)?,
    };
    let partial = rr.float("partial_rotary_factor", 1.0)?;
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(field_err(
            "rope_parameters.partial_rotary_factor",
            partial,
            "a number in (0, 1]",
        ));
    }
    // transformers' rope validation requires the key `factor` for yarn (a KeyError without it; a null value it only
    // warns about, and is read here as before).
    if rope_type == "yarn" && !rr.obj.contains_key("factor") {
        return Err(field_err(
            "rope_parameters.factor",
            "absent",
            "the YaRN scaling factor, which rope_type yarn requires (transformers refuses yarn without it too)",
        ));
    }
    let original = rr.opt_uint("original_max_position_embeddings")?;
    if rope_type == "yarn" && original == Some(0) {
        return Err(field_err(
            "rope_parameters.original_max_position_embeddings",
            0,
            "a positive number of positions (YaRN divides by it, as does transformers)",
        ));
    }
    let factor = rr.float("factor", 1.0)?;
    if rope_type == "yarn" && factor < 1.0 {
        return Err(field_err(
            "rope_parameters.factor",
            factor,
            "a number >= 1 for yarn",
        ));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(field_err(
            "rope_parameters.rope_theta",
            theta,
            "a positive number (the rotary base, 10000 by default)",
        ));
    }
    Ok(RopeConfig {
        rope_type,
        theta,
        partial_rotary_factor: partial,
        factor,
        original_max_position_embeddings: original,
        beta_fast: rr.float("beta_fast", 32.0)?,
        beta_slow: rr.float("beta_slow", 1.0)?,
        attention_factor: match obj.get("attention_factor") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_f64()
                    .ok_or_else(|| field_err("rope_parameters.attention_factor", v, "a number"))?,
            ),
        },
        truncate: rr.boolean("truncate", true)?,
    })
}

fn parse_mtp(text: &Map<String, Value>, r: &Reader) -> Result<Option<MtpConfig>, ConfigError> {
    if r.boolean("mtp_use_dedicated_embeddings", false)? {
        return Err(field_err(
            "mtp_use_dedicated_embeddings",
            true,
            "false (an MTP drafter with its own embeddings is not supported)",
        ));
    }
    if let Some(v) = text.get("mtp_use_hidden_state_from_layer") {
        if !v.is_null() {
            return Err(field_err(
                "mtp_use_hidden_state_from_layer",
                v,
                "null (the drafter reads the last layer)",
            ));
        }
    }
    let top = r.opt_uint("mtp_num_hidden_layers")?;
    let block = match text.get("mtp") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => Some(o),
        Some(v) => return Err(field_err("mtp", v, "an object")),
    };
    if top.is_none() && block.is_none() {
        return Ok(None);
    }
    if let Some(n) = top {
        if n == 0 {
            return Ok(None);
        }
        if n != 1 {
            return Err(field_err("mtp_num_hidden_layers", n, "1"));
        }
    }
    if let Some(b) = block {
        let br = Reader { obj: b };
        let n = br.uint("num_hidden_layers", Some(1))?;
        if n != 1 {
            return Err(field_err("mtp.num_hidden_layers", n, "1"));
        }
        if let Some(v) = b.get("mtp_use_hidden_state_from_layer") {
            if !v.is_null() {
                return Err(field_err("mtp.mtp_use_hidden_state_from_layer", v, "null"));
            }
        }
        match b.get("layer_types") {
            None | Some(Value::Null) | Some(Value::Array(_)) => {}
            Some(v) => {
                return Err(field_err(
                    "mtp.layer_types",
                    v,
                    "a list of layer type strings",
                ))
            }
        }
        if let Some(Value::Array(types)) = b.get("layer_types") {
            if types.len() != 1 {
                return Err(field_err(
                    "mtp.layer_types",
                    format!("{} entries", types.len()),
                    "one entry, as mtp.num_hidden_layers (1)",
                ));
            }
            for t in types {
                if t.as_str() != Some("full_attention") && t.as_str() != Some("indexed_attention") {
                    return Err(field_err(
                        "mtp.layer_types",
                        t,
                        "\"full_attention\" (the drafter is an attention layer)",
                    ));
                }
            }
        }
        if let Some(theta) = b.get("rope_theta") {
            let main = match text
                .get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
            {
                Some(t) => t.as_f64(),
                None => Some(r.float("rope_theta", 10000.0)?),
            };
            if theta.as_f64() != main {
                return Err(field_err(
                    "mtp.rope_theta",
                    theta,
                    format!(
                        "the main rope_theta {}",
                        main.map(|m| m.to_string()).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(Some(MtpConfig {
        num_hidden_layers: 1,
    }))
}

fn parse_quantization(q: Option<&Value>) -> Result<StorageForm, ConfigError> {
    let Some(q) = q else {
        return Ok(StorageForm::Bf16);
    };
    if q.is_null() {
        return Ok(StorageForm::Bf16);
    }
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    match method {
        "fp8" => {
            let fmt = q.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
            let block = q.get("weight_block_size");
            if fmt == "e4m3" && block.is_some_and(|b| b == &serde_json::json!([128, 128])) {
                Ok(StorageForm::Fp8Block)
            } else {
                Err(field_err(
                    "quantization_config",
                    q,
                    "fp8 e4m3 with weight_block_size [128, 128], or mxfp8",
                ))
            }
        }
        "mxfp8" => Ok(StorageForm::Mxfp8),
        _ => Err(field_err(
            "quantization_config.quant_method",
            format!("{method:?}"),
            "\"fp8\" or \"mxfp8\"",
        )),
    }
}
