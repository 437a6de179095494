//! Storage forms from a checkpoint directory: the JSON header of every `*.safetensors` file (8-byte little-endian
//! length, then the JSON), never the weights. Tensor names are mapped to the manifest's canonical names
//! ([`canonical_name`]) and each tensor's form decided from its dtype and the scale tensors beside it:
//! `BF16` and `F16` -> [`StorageForm::Bf16`], `F32` -> [`StorageForm::F32`], `F8_E4M3` with a `*_scale_inv` tensor ->
//! [`StorageForm::Fp8Block`], `F8_E4M3` with a `U8` `*_scale` tensor -> [`StorageForm::Mxfp8`].

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use flashplan_plan::StorageForm;
use serde_json::Value;

use crate::manifest::FormSource;

/// Largest header accepted (safetensors itself caps headers at 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Safetensors dtype (`BF16`, `F32`, `F8_E4M3`, `U8`, `I64`...).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
}

/// Reads the JSON header of one safetensors file (name -> dtype and shape; `__metadata__` dropped).
pub fn read_header(path: &Path) -> anyhow::Result<BTreeMap<String, TensorInfo>> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .with_context(|| format!("{}: reading the header length", path.display()))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        bail!(
            "{}: safetensors header of {n} bytes exceeds {MAX_HEADER} (not a safetensors file?)",
            path.display()
        );
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .with_context(|| format!("{}: truncated safetensors header", path.display()))?;
    let json: Value = serde_json::from_slice(&buf)
        .with_context(|| format!("{}: safetensors header is not JSON", path.display()))?;
    let obj = json
        .as_object()
        .with_context(|| format!("{}: safetensors header is not an object", path.display()))?;
    let mut out = BTreeMap::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v
            .get("dtype")
            .and_then(Value::as_str)
            .with_context(|| format!("{}: tensor {name} has no dtype", path.display()))?;
        let shape = v
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .with_context(|| format!("{}: tensor {name} has no valid shape", path.display()))?;
        out.insert(
            name.clone(),
            TensorInfo {
                dtype: dtype.to_string(),
                shape,
            },
        );
    }
    Ok(out)
}

/// The manifest's canonical name of a checkpoint tensor, or `None` for tensors the manifest does not hold
/// (scales, integer buffers such as the PLE hash constants, vision tensors).
///
/// Strips `model.language_model.`, `model.` and `language_model.`; per-expert tensors
/// (`mlp.experts.7.gate_proj.weight`, `up_proj`, `down_proj`) map to the stacked `mlp.experts.gate_up_proj` /
/// `mlp.experts.down_proj`; PLE shards (`ngram_embedding.shard_3.weight`) map to `ngram_embedding.weight`.
pub fn canonical_name(name: &str) -> String {
    let mut n = name;
    for p in ["model.language_model.", "language_model.", "model."] {
        if let Some(rest) = n.strip_prefix(p) {
            n = rest;
            break;
        }
    }
    let mut n = n.to_string();
    if let Some(pos) = n.find("mlp.experts.") {
        let (head, tail) = n.split_at(pos + "mlp.experts.".len());
        let mut parts = tail.splitn(2, '.');
        let first = parts.next().unwrap_or("");
        if first.chars().all(|c| c.is_ascii_digit()) && !first.is_empty() {
            let rest = parts.next().unwrap_or("");
            let proj = rest.split('.').next().unwrap_or("");
            let suffix = &rest[proj.len()..];
            let stacked = match proj {
                "gate_proj" | "up_proj" => "gate_up_proj",
                "down_proj" => "down_proj",
                other => other,
            };
            // `.weight` -> stacked name; `.weight_scale_inv` -> `_scale_inv` on the stacked name.
            let suffix = suffix.strip_prefix(".weight").unwrap_or(suffix);
            n = format!("{head}{stacked}{suffix}");
        }
    }
    if let Some(pos) = n.find("ngram_embedding.shard_") {
        let head = &n[..pos + "ngram_embedding.".len()];
        let tail = &n[pos + "ngram_embedding.shard_".len()..];
        let after = tail.trim_start_matches(|c: char| c.is_ascii_digit());
        n = format!("{head}{}", after.trim_start_matches('.'));
    }
    n
}

/// Splits a scale tensor's name into (the tensor it scales, the scale kind): `x.weight_scale_inv` ->
/// (`x.weight`, inv), `experts.gate_up_proj_scale` -> (`experts.gate_up_proj`, mx).
fn scale_of(name: &str) -> Option<(&str, bool)> {
    if let Some(base) = name.strip_suffix("_scale_inv") {
        Some((base, true))
    } else {
        name.strip_suffix("_scale").map(|base| (base, false))
    }
}

/// The storage forms of every tensor of a model directory, from its safetensors headers.
///
/// # Errors
/// A header that cannot be read, an FP8 tensor without a scale tensor, a dtype the engine does not store, or the
/// pieces of one canonical tensor (experts, PLE shards) stored in different forms; each names the file and tensor.
pub fn forms_from_model_dir(dir: &Path) -> anyhow::Result<FormSource> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{}: no *.safetensors files", dir.display());
    }
    // Gather every tensor first: a scale may live in another shard than its tensor.
    let mut all: BTreeMap<String, (TensorInfo, PathBuf)> = BTreeMap::new();
    for f in &files {
        for (name, info) in read_header(f)? {
            all.insert(name, (info, f.clone()));
        }
    }
    let mut scales: BTreeMap<&str, (bool, &str)> = BTreeMap::new();
    for (name, (info, _)) in &all {
        if let Some((base, inv)) = scale_of(name) {
            if all.contains_key(base) {
                scales.insert(base, (inv, info.dtype.as_str()));
            }
        }
    }
    let mut by_name: BTreeMap<String, StorageForm> = BTreeMap::new();
    for (name, (info, file)) in &all {
        if scale_of(name).is_some_and(|(base, _)| all.contains_key(base)) {
            continue;
        }
        let form = match info.dtype.as_str() {
            // F16 loads as the runtime reads every 16-bit float: converted at load (runtime/src/checkpoint.rs),
            // so its plan is a BF16 checkpoint's.
            "BF16" | "F16" => StorageForm::Bf16,
            "F32" => StorageForm::F32,
            "F8_E4M3" => match scales.get(name.as_str()) {
                Some((true, _)) => StorageForm::Fp8Block,
                Some((false, "U8")) => StorageForm::Mxfp8,
                Some((false, other)) => bail!(
                    "{}: tensor {name} is F8_E4M3 with a {other} `_scale` tensor; MXFP8 scales are U8 (E8M0)",
                    file.display()
                ),
                None => bail!(
                    "{}: tensor {name} is F8_E4M3 without a `{name}_scale_inv` (FP8 block) or `{name}_scale` (MXFP8) tensor",
                    file.display()
                ),
            },
            // Integer buffers (PLE hash constants) are recomputed from the config; not weights of the manifest.
            "I64" | "I32" | "U8" | "BOOL" => continue,
            other => bail!(
                "{}: tensor {name} has dtype {other}; the engine reads BF16, F16, F32, FP8 block or MXFP8 tensors",
                file.display()
            ),
        };
        let canon = canonical_name(name);
        if let Some(prev) = by_name.insert(canon.clone(), form) {
            if prev != form {
                bail!(
                    "{}: tensor {name} is stored as {form:?} but other pieces of {canon} are {prev:?}",
                    file.display()
                );
            }
        }
    }
    Ok(FormSource { by_name })
}
