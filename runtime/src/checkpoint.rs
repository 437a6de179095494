//! Checkpoint loading for the CPU backend (`flash-next.md` section 10, issue 3 item 1).
//!
//! Reads a Flash Next safetensors checkpoint into host memory as f32, one buffer per entry of a plan's weight
//! manifest ([`PlanBody::weights`]), checking every tensor against it.
//!
//! Layouts accepted:
//! - a single `model.safetensors`, or shards named by `model.safetensors.index.json` (its `weight_map` is
//!   authoritative: every file it names must exist, a file it does not name is ignored, and so is a tensor of a named
//!   file that the map does not list, but a second copy in a named file of a tensor the map puts in another is
//!   refused: which copy is meant would be a guess). When both are present the index wins.
//! - prefixes `model.language_model.` (wrapper checkpoints, whose `model.visual.*` is ignored), `model.`
//!   (text-only) and `language_model.model.`; `lm_head.weight` at top level; the MTP drafter as top-level `mtp.*`
//!   or MLX-style `language_model.mtp.*`.
//! - routed experts either per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`: gate and up `[I, D]`, down
//!   `[D, I]`, as transformers saves them), assembled into the manifest's stacked `mlp.experts.gate_up_proj`
//!   `[E, 2I, D]` (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` `[E, D, I]`; or already
//!   stacked.
//! - the PLE table (section 8) as shards `ple.ple_embedding.ngram_embedding.shard_{k}.weight` (normally
//!   `split_ngram_parts` of them, but any count whose rows sum to the manifest's rows is accepted), concatenated
//!   along rows in shard order into `ple.ple_embedding.ngram_embedding.weight`; or unsharded. The derived buffers
//!   `layer_multipliers`, `ngram_heads_vocab_sizes` and `ngram_heads_offsets`, when present, must equal
//!   [`flashplan_plan::ple::layer_multipliers`] and [`flashplan_plan::ple::head_sizes`]; they are not stored.
//! - dtypes BF16, F16 and F32 (converted to f32), and MXFP8 linears (issue 8 item 4): `F8_E4M3` codes `[.., K]`
//!   with a sibling `U8` (E8M0) `<name>_scale` `[.., ceil(K / 32)]`, dequantized exactly by
//!   [`crate::mxfp8::dequantize_stored`]; accepted where the plan's manifest says [`StorageForm::Mxfp8`] (the
//!   compiler reads forms from the checkpoint's headers), refused otherwise like any form mismatch; and FP8
//!   block-scaled tensors (the FP8 release's experts and PLE table): `F8_E4M3` codes `[.., R, C]` with a sibling F32
//!   or BF16 `<name>_scale_inv` `[.., ceil(R / 128), ceil(C / 128)]`, converted by [`crate::fp8::dequantize_block`]
//!   where the manifest says [`StorageForm::Fp8Block`]. MXFP8 or FP8 block with other codes or scales are refused
//!   by name.
//!
//! `config.json` is not read here: the caller has validated it and compiled (or matched) the plan from it.
//!
//! Checks: a missing tensor, a wrong shape or dtype, an unexpected tensor under `layers.*`, `mtp.*` or at top level,
//! two on-disk tensors claiming the same canonical tensor, and an unreadable or truncated file are refused, naming the
//! tensor (canonical and on-disk names) or the file. A checkpoint without any `mtp.*` tensor is served with copy
//! drafts only ([`HostWeights::has_mtp`] false); one with only some of them is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use flashplan_plan::{ple, ModelConfig, PlanBody, StorageForm, WeightEntry, WeightGroup};
use indicatif::{ProgressBar, ProgressStyle};
use memmap2::Mmap;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

/// Name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The weights of a plan's manifest in host memory, as f32 (the CPU backend's form).
#[derive(Debug, Clone, Default)]
pub struct HostWeights {
    /// One slot per entry of [`PlanBody::weights`] (same index). `Some` holds the tensor's values in row-major order
    /// of the entry's logical `shape` (`numel` values); `None` for entries of groups that were not requested, for
    /// the derived groups [`WeightGroup::MtpMxfp8`] and [`WeightGroup::HeadMxfp8`] (made from their source entries
    /// by the backend, never read from disk), and for the [`WeightGroup::Mtp`] entries when the checkpoint has no
    /// drafter.
    pub tensors: Vec<Option<Vec<f32>>>,
    /// True when the [`WeightGroup::Mtp`] group was requested and loaded; false when it was not requested, when the
    /// plan has no drafter, or when the checkpoint has no `mtp.*` tensors (serve with copy drafts only).
    pub has_mtp: bool,
}

impl HostWeights {
    /// The values of the weight with canonical name `name` (see [`WeightEntry::name`]), if loaded.
    pub fn get<'a>(&'a self, body: &PlanBody, name: &str) -> Option<&'a [f32]> {
        let i = body.weight_index(name)?;
        self.tensors.get(i)?.as_deref()
    }
}

/// What [`load_checkpoint`] loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// The weight groups to load (default: [`WeightGroup::Main`] and [`WeightGroup::Mtp`]). The derived groups
    /// [`WeightGroup::MtpMxfp8`] and [`WeightGroup::HeadMxfp8`] are never read from disk: naming them has no
    /// effect.
    pub groups: Vec<WeightGroup>,
    /// Show a progress bar over the bytes read (hidden when false).
    pub progress: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            groups: vec![WeightGroup::Main, WeightGroup::Mtp],
            progress: false,
        }
    }
}

/// Why a checkpoint was refused.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be opened or mapped.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause (in the message, not a separate source, so that it prints once).
        cause: std::io::Error,
    },
    /// The directory has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{dir}: no {SINGLE_FILE} or {INDEX_FILE} (flash-next.md section 10)")]
    NoCheckpoint {
        /// The directory.
        dir: PathBuf,
    },
    /// The shard index is not valid JSON or has no usable `weight_map`.
    #[error("{path}: not a valid safetensors index ({why})")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What was wrong.
        why: String,
    },
    /// A tensor is stored in two shards (the index names one of them): which copy is meant would be a guess.
    #[error(
        "{tensor} is stored in two shards: {index} names {named}, and {copy} holds it too (expected each tensor in \
         one shard)"
    )]
    TensorInTwoShards {
        /// The index file.
        index: PathBuf,
        /// The on-disk tensor name.
        tensor: String,
        /// The shard file the index names for it.
        named: PathBuf,
        /// The other shard file holding a tensor of that name.
        copy: PathBuf,
    },
    /// The shard index names a file that does not exist.
    #[error("{index} names shard {file} (for tensor {tensor}), which does not exist")]
    ShardMissing {
        /// The index file.
        index: PathBuf,
        /// The missing shard's file name.
        file: String,
        /// One tensor the index places there.
        tensor: String,
    },
    /// A safetensors file could not be parsed (bad header, or a header that claims more bytes than the file has).
    #[error(
        "{file}: not a valid safetensors file, truncated or corrupt ({cause}){}",
        .detail.as_ref().map_or(String::new(), |d| format!(": {d}"))
    )]
    Safetensors {
        /// The file.
        file: PathBuf,
        /// The safetensors crate's error (in the message, as `Io`'s).
        cause: SafeTensorError,
        /// What is at fault (`safetensors_check::explain`), when found: a tensor and what its dtype and shape need,
        /// or the file's length against its header.
        detail: Option<String>,
    },
    /// The shard index places a tensor in a file that does not contain it.
    #[error("{index} places tensor {tensor} in {file}, which has no such tensor")]
    IndexMismatch {
        /// The index file.
        index: PathBuf,
        /// The on-disk tensor name.
        tensor: String,
        /// The shard.
        file: PathBuf,
    },
    /// A tensor of the manifest is not in the checkpoint.
    #[error("missing tensor {canonical}: tried {}", tried.join(", "))]
    Missing {
        /// The canonical (manifest) name.
        canonical: String,
        /// The on-disk names looked for.
        tried: Vec<String>,
    },
    /// Some but not all of the drafter's `mtp.*` tensors are present.
    #[error(
        "incomplete MTP drafter: the checkpoint has {present} of the {expected} mtp.* tensors; \
         missing {canonical} (tried {}) (flash-next.md section 9)",
        tried.join(", ")
    )]
    MtpIncomplete {
        /// The first missing canonical name.
        canonical: String,
        /// The on-disk names looked for.
        tried: Vec<String>,
        /// How many `mtp.*` manifest tensors were found.
        present: usize,
        /// How many the manifest has.
        expected: usize,
    },
    /// A tensor has the wrong shape.
    #[error("tensor {tensor} (for {canonical}) has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The on-disk name.
        tensor: String,
        /// The canonical name of the manifest entry it is (part of).
        canonical: String,
        /// The shape in the file.
        found: Vec<usize>,
        /// The shape required.
        expected: Vec<u64>,
    },
    /// The PLE table shards do not add up to the manifest's table.
    #[error(
        "PLE table {canonical}: shards {} have {found} rows in all, expected {expected} \
         (flash-next.md section 8)",
        shards.join(", ")
    )]
    PleRows {
        /// The canonical table name.
        canonical: String,
        /// The shards found, in order.
        shards: Vec<String>,
        /// Their summed rows.
        found: u64,
        /// The manifest's rows.
        expected: u64,
    },
    /// A tensor is stored in a dtype this loader does not accept for it.
    #[error("tensor {tensor} is stored as {found}, expected {expected}")]
    Dtype {
        /// The on-disk name.
        tensor: String,
        /// The dtype in the file.
        found: String,
        /// What is accepted.
        expected: String,
    },
    /// An FP8 block-scaled tensor in a form this loader does not read (codes other than `F8_E4M3`, scales other
    /// than F32 or BF16 `[.., ceil(R / 128), ceil(C / 128)]`).
    #[error(
        "tensor {tensor} is stored as FP8 block with {why}, which this loader does not read (it reads F8_E4M3 codes \
         [.., R, C] with F32 or BF16 scales [.., ceil(R/128), ceil(C/128)] in {tensor}_scale_inv)"
    )]
    Fp8Block {
        /// The on-disk name.
        tensor: String,
        /// What differs from the form read.
        why: String,
    },
    /// An MXFP8 tensor in a form this loader does not read (codes other than `F8_E4M3`, scales other than `U8`
    /// `[.., ceil(K / 32)]`).
    #[error(
        "tensor {tensor} is stored as MXFP8 with {why}, which this loader does not read yet \
         (it reads F8_E4M3 codes [.., K] with U8 scales [.., ceil(K/32)] in {tensor}_scale)"
    )]
    Mxfp8 {
        /// The on-disk name.
        tensor: String,
        /// What differs from the form read.
        why: String,
    },
    /// A tensor the plan's manifest does not know.
    #[error("unexpected tensor {tensor} (canonical {canonical}): the plan's weight manifest has no such tensor")]
    Unexpected {
        /// The on-disk name.
        tensor: String,
        /// Its canonical name.
        canonical: String,
    },
    /// Two on-disk tensors claim the same canonical tensor (or the same piece of it).
    #[error("tensors {first} and {second} both provide {canonical}")]
    Duplicate {
        /// The canonical name (of the piece).
        canonical: String,
        /// The first on-disk name.
        first: String,
        /// The second on-disk name.
        second: String,
    },
    /// A stored PLE buffer disagrees with the values derived from the config.
    #[error(
        "PLE buffer {tensor} is {found}, but the config gives {expected} (flash-next.md section 8): \
         checkpoint and config disagree"
    )]
    PleBuffer {
        /// The on-disk name.
        tensor: String,
        /// The stored values (or shape/dtype).
        found: String,
        /// The derived values.
        expected: String,
    },
}

/// One opened safetensors file.
struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// How an on-disk tensor maps onto the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Piece {
    /// The whole manifest tensor.
    Whole,
    /// One routed expert's gate, up or down projection.
    Expert { e: u32, part: ExpertPart },
    /// One PLE table shard.
    PleShard { k: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum ExpertPart {
    Gate,
    Up,
    Down,
}

impl ExpertPart {
    fn file_name(self) -> &'static str {
        match self {
            ExpertPart::Gate => "gate_proj",
            ExpertPart::Up => "up_proj",
            ExpertPart::Down => "down_proj",
        }
    }
}

/// The PLE buffers a checkpoint may store.
#[derive(Debug, Clone, Copy)]
enum PleBuf {
    Multipliers,
    VocabSizes,
    Offsets,
}

enum Class {
    Ignored,
    Piece { target: String, piece: Piece },
    PleBuffer { layer: u32, buf: PleBuf },
}

const PLE_TABLE: &str = "ple.ple_embedding.ngram_embedding.weight";
const PLE_SHARD: &str = "ple.ple_embedding.ngram_embedding.shard_";

/// Strips the checkpoint layout's prefix: `model.language_model.`, `language_model.model.`, `model.`,
/// `language_model.` (in that order). `lm_head.weight` and `mtp.*` have none.
fn canonical_name(disk: &str) -> &str {
    for p in [
        "model.language_model.",
        "language_model.model.",
        "model.",
        "language_model.",
    ] {
        if let Some(rest) = disk.strip_prefix(p) {
            return rest;
        }
    }
    disk
}

/// On-disk names a canonical name may have.
fn disk_candidates(canonical: &str) -> Vec<String> {
    if canonical == "lm_head.weight" {
        vec![canonical.to_string()]
    } else if canonical.starts_with("mtp.") {
        vec![canonical.to_string(), format!("language_model.{canonical}")]
    } else {
        vec![
            format!("model.language_model.{canonical}"),
            format!("model.{canonical}"),
        ]
    }
}

fn parse_layer(canonical: &str) -> Option<u32> {
    canonical
        .strip_prefix("layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

fn classify(canonical: &str) -> Class {
    if canonical.starts_with("visual.") {
        return Class::Ignored;
    }
    // Per-expert projections.
    if let Some(pos) = canonical.find("mlp.experts.") {
        let head = &canonical[..pos + "mlp.experts.".len()];
        let rest = &canonical[head.len()..];
        if let Some((num, tail)) = rest.split_once('.') {
            if let Ok(e) = num.parse::<u32>() {
                let part = match tail {
                    "gate_proj.weight" => Some(ExpertPart::Gate),
                    "up_proj.weight" => Some(ExpertPart::Up),
                    "down_proj.weight" => Some(ExpertPart::Down),
                    _ => None,
                };
                if let Some(part) = part {
                    let stacked = if part == ExpertPart::Down {
                        "down_proj"
                    } else {
                        "gate_up_proj"
                    };
                    return Class::Piece {
                        target: format!("{head}{stacked}"),
                        piece: Piece::Expert { e, part },
                    };
                }
            }
        }
    }
    // PLE table shards.
    if let Some(pos) = canonical.find(PLE_SHARD) {
        let rest = &canonical[pos + PLE_SHARD.len()..];
        if let Some(k) = rest
            .strip_suffix(".weight")
            .and_then(|k| k.parse::<u32>().ok())
        {
            return Class::Piece {
                target: format!("{}{PLE_TABLE}", &canonical[..pos]),
                piece: Piece::PleShard { k },
            };
        }
    }
    // PLE derived buffers (main layers only).
    for (suffix, buf) in [
        ("ple.ple_embedding.layer_multipliers", PleBuf::Multipliers),
        (
            "ple.ple_embedding.ngram_heads_vocab_sizes",
            PleBuf::VocabSizes,
        ),
        ("ple.ple_embedding.ngram_heads_offsets", PleBuf::Offsets),
    ] {
        if let Some(head) = canonical.strip_suffix(suffix) {
            if let Some(layer) = head.strip_suffix('.').and_then(parse_layer) {
                if head == format!("layers.{layer}.") {
                    return Class::PleBuffer { layer, buf };
                }
            }
        }
    }
    Class::Piece {
        target: canonical.to_string(),
        piece: Piece::Whole,
    }
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

fn form_name(f: StorageForm) -> &'static str {
    match f {
        StorageForm::F32 => "F32",
        StorageForm::Bf16 => "BF16",
        StorageForm::Fp8Block => "FP8 block",
        StorageForm::Mxfp8 => "MXFP8",
    }
}

/// A tensor stored in another form than the plan's manifest says: likely a plan compiled for another checkpoint.
fn form_mismatch(disk: &str, found: impl Into<String>, entry: &WeightEntry) -> CheckpointError {
    CheckpointError::Dtype {
        tensor: disk.to_string(),
        found: found.into(),
        expected: format!(
            "{} (the plan's manifest says {} is stored so: was the plan compiled for another checkpoint?)",
            form_name(entry.form),
            entry.name
        ),
    }
}

/// An FP8 form stored as `F8_E4M3` codes with a scale tensor beside them.
struct ScaledForm {
    /// The manifest's form for it.
    form: StorageForm,
    /// How a form mismatch names it.
    label: &'static str,
    /// The scale dtypes read.
    scale_dtypes: &'static [Dtype],
    /// The scales' shape for codes of a shape (`None`: too few dims).
    scale_shape: fn(&[usize]) -> Option<Vec<usize>>,
    /// The refusal naming the tensor and what differs.
    refuse: fn(String, String) -> CheckpointError,
}

/// FP8 block: `<name>_scale_inv`, F32 or BF16, one per 128 x 128 block ([`crate::fp8`]).
const FP8_BLOCK: ScaledForm = ScaledForm {
    form: StorageForm::Fp8Block,
    label: "FP8 block (F8_E4M3 with weight_scale_inv)",
    scale_dtypes: &[Dtype::F32, Dtype::BF16],
    scale_shape: crate::fp8::scale_shape,
    refuse: |tensor, why| CheckpointError::Fp8Block { tensor, why },
};

/// MXFP8: `<name>_scale`, U8 (E8M0), one per 32 inputs ([`crate::mxfp8`]).
const MXFP8: ScaledForm = ScaledForm {
    form: StorageForm::Mxfp8,
    label: "MXFP8 (F8_E4M3 with weight_scale)",
    scale_dtypes: &[Dtype::U8],
    scale_shape: |codes| {
        let (k, lead) = codes.split_last()?;
        let mut want = lead.to_vec();
        want.push(crate::mxfp8::groups_per_row(*k));
        Some(want)
    },
    refuse: |tensor, why| CheckpointError::Mxfp8 { tensor, why },
};

/// Checks an FP8 tensor and its scales against `f`, and that the manifest says `f.form` for it.
fn check_scaled(
    disk: &str,
    view: &TensorView<'_>,
    scale: &TensorView<'_>,
    entry: &WeightEntry,
    f: &ScaledForm,
) -> Result<(), CheckpointError> {
    let refuse = |why: String| Err((f.refuse)(disk.to_string(), why));
    if view.dtype() != Dtype::F8_E4M3 {
        return refuse(format!("{:?} codes", view.dtype()));
    }
    if !f.scale_dtypes.contains(&scale.dtype()) {
        return refuse(format!("{:?} scales", scale.dtype()));
    }
    let codes = view.shape();
    match (f.scale_shape)(codes) {
        Some(want) if scale.shape() == want.as_slice() && !codes.contains(&0) => {}
        want => {
            return refuse(format!(
                "scales of shape {:?} for codes of shape {codes:?} (expected {})",
                scale.shape(),
                want.map(|w| format!("{w:?}"))
                    .unwrap_or_else(|| "codes of more dims".into())
            ))
        }
    }
    if entry.form != f.form {
        return Err(form_mismatch(disk, f.label, entry));
    }
    Ok(())
}

/// Checks a float tensor's dtype: BF16, F16 or F32 are read; FP8 is refused by name.
fn check_dtype(
    disk: &str,
    view: &TensorView<'_>,
    entry: &WeightEntry,
    names: &BTreeMap<String, (usize, TensorView<'_>)>,
) -> Result<(), CheckpointError> {
    match view.dtype() {
        Dtype::BF16 | Dtype::F16 | Dtype::F32 => {
            if matches!(entry.form, StorageForm::Fp8Block | StorageForm::Mxfp8) {
                return Err(form_mismatch(disk, dtype_name(view.dtype()), entry));
            }
            Ok(())
        }
        Dtype::F8_E4M3 | Dtype::F8_E5M2 => {
            let scale = |suffix: &str| names.get(&format!("{disk}{suffix}")).map(|(_, v)| v);
            match (scale("_scale_inv"), scale("_scale")) {
                (Some(_), Some(_)) => Err(CheckpointError::Fp8Block {
                    tensor: disk.to_string(),
                    why: format!(
                        "both {disk}_scale_inv (FP8 block) and {disk}_scale (MXFP8) beside it"
                    ),
                }),
                (Some(s), None) => check_scaled(disk, view, s, entry, &FP8_BLOCK),
                (None, Some(s)) => check_scaled(disk, view, s, entry, &MXFP8),
                (None, None) => Err(wrong_dtype(
                    disk,
                    format!("{:?} without scales", view.dtype()),
                )),
            }
        }
        other => Err(wrong_dtype(disk, dtype_name(other))),
    }
}

/// A float tensor of a dtype the loader does not read (`found`).
fn wrong_dtype(disk: &str, found: String) -> CheckpointError {
    CheckpointError::Dtype {
        tensor: disk.to_string(),
        found,
        expected: "BF16, F16 or F32".into(),
    }
}

/// The scale tensor beside `F8_E4M3` codes: `<name>_scale_inv` for FP8 block, `<name>_scale` for MXFP8 (`suffix`),
/// if `view` is such codes and has one.
fn fp8_scale<'a, 'b>(
    disk_name: &str,
    view: &TensorView<'_>,
    disk: &'a BTreeMap<String, (usize, TensorView<'b>)>,
    suffix: &str,
) -> Option<&'a (usize, TensorView<'b>)> {
    if view.dtype() != Dtype::F8_E4M3 {
        return None;
    }
    disk.get(&format!("{disk_name}{suffix}"))
}

/// Converts a BF16, F16 or F32 tensor's little-endian bytes to f32.
fn convert(data: &[u8], dtype: Dtype, out: &mut [f32]) {
    match dtype {
        Dtype::BF16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        Dtype::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        _ => unreachable!("dtype checked before conversion"),
    }
}

/// Reads an integer tensor (a PLE buffer) as i128 values; `None` for non-integer dtypes.
fn read_ints(view: &TensorView<'_>) -> Option<Vec<i128>> {
    let d = view.data();
    macro_rules! ints {
        ($t:ty, $n:expr) => {
            d.chunks_exact($n)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")) as i128)
                .collect()
        };
    }
    Some(match view.dtype() {
        Dtype::I64 => ints!(i64, 8),
        Dtype::U64 => ints!(u64, 8),
        Dtype::I32 => ints!(i32, 4),
        Dtype::U32 => ints!(u32, 4),
        Dtype::I16 => ints!(i16, 2),
        Dtype::U16 => ints!(u16, 2),
        Dtype::I8 => ints!(i8, 1),
        Dtype::U8 => ints!(u8, 1),
        _ => return None,
    })
}

fn check_ple_buffer(
    cfg: &ModelConfig,
    disk: &str,
    canonical: &str,
    layer: u32,
    buf: PleBuf,
    view: &TensorView<'_>,
) -> Result<(), CheckpointError> {
    let Some(ple_index) = cfg.ple_layer_ids.iter().position(|&id| id == layer + 1) else {
        return Err(CheckpointError::Unexpected {
            tensor: disk.to_string(),
            canonical: canonical.to_string(),
        });
    };
    let ple_index = ple_index as u32;
    let expected: Vec<u64> = match buf {
        PleBuf::Multipliers => ple::layer_multipliers(cfg, ple_index),
        PleBuf::VocabSizes => ple::head_sizes(cfg, ple_index).0,
        PleBuf::Offsets => ple::head_sizes(cfg, ple_index).1,
    };
    let Some(found) = read_ints(view) else {
        return Err(CheckpointError::PleBuffer {
            tensor: disk.to_string(),
            found: format!("of dtype {:?} (not an integer tensor)", view.dtype()),
            expected: format!("{expected:?}"),
        });
    };
    if view.shape() != [expected.len()]
        || found.iter().zip(&expected).any(|(&f, &e)| f != e as i128)
    {
        return Err(CheckpointError::PleBuffer {
            tensor: disk.to_string(),
            found: format!("{found:?} (shape {:?})", view.shape()),
            expected: format!("{expected:?} (shape [{}])", expected.len()),
        });
    }
    Ok(())
}

/// The opened files of a checkpoint.
struct Opened {
    /// The files, mapped.
    shards: Vec<Shard>,
    /// On-disk tensor name -> index into `shards`.
    names: Vec<(String, usize)>,
    /// The shard index, when sharded.
    index: Option<PathBuf>,
}

/// Opens the checkpoint's files and returns them with the on-disk tensor name -> file index map.
fn open_files(dir: &Path) -> Result<Opened, CheckpointError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |cause| CheckpointError::Io { path, cause }
    };
    let map_file = |path: PathBuf| -> Result<Shard, CheckpointError> {
        let f = File::open(&path).map_err(io(&path))?;
        // SAFETY: the mapping is read-only and lives only while loading; checkpoint files are not expected to be
        // modified while a server loads them (the same assumption every safetensors loader makes).
        let map = unsafe { Mmap::map(&f) }.map_err(io(&path))?;
        Ok(Shard { path, map })
    };
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        let text = std::fs::read_to_string(&index_path).map_err(io(&index_path))?;
        let bad = |why: String| CheckpointError::Index {
            path: index_path.clone(),
            why,
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
        let mut files: BTreeMap<String, usize> = BTreeMap::new();
        let mut shards = Vec::new();
        let mut names = Vec::with_capacity(map.len());
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map[{tensor:?}] is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(bad(format!(
                    "weight_map[{tensor:?}] = {file:?} is not a file of this directory"
                )));
            }
            let idx = match files.get(file) {
                Some(&i) => i,
                None => {
                    let path = dir.join(file);
                    if !path.is_file() {
                        return Err(CheckpointError::ShardMissing {
                            index: index_path.clone(),
                            file: file.to_string(),
                            tensor: tensor.clone(),
                        });
                    }
                    shards.push(map_file(path)?);
                    files.insert(file.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            names.push((tensor.clone(), idx));
        }
        return Ok(Opened {
            shards,
            names,
            index: Some(index_path),
        });
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        let shard = map_file(single)?;
        let st =
            SafeTensors::deserialize(&shard.map).map_err(|cause| not_safetensors(&shard, cause))?;
        let names = st.names().into_iter().map(|n| (n.to_string(), 0)).collect();
        return Ok(Opened {
            shards: vec![shard],
            names,
            index: None,
        });
    }
    Err(CheckpointError::NoCheckpoint {
        dir: dir.to_path_buf(),
    })
}

/// The error for a shard the safetensors crate refuses, with what [`crate::safetensors_check::explain`] finds.
fn not_safetensors(shard: &Shard, cause: SafeTensorError) -> CheckpointError {
    CheckpointError::Safetensors {
        file: shard.path.clone(),
        cause,
        detail: crate::safetensors_check::explain(&shard.map),
    }
}

/// Refuses a tensor stored in a shard the index does not name for it as well as in the named one (`disk`: on-disk
/// name -> the named shard's index into `shards`; `parsed`: every shard's header, in `shards`' order).
fn check_one_shard_each(
    parsed: &[SafeTensors<'_>],
    disk: &BTreeMap<String, (usize, TensorView<'_>)>,
    shards: &[Shard],
    index: Option<&Path>,
) -> Result<(), CheckpointError> {
    if parsed.len() < 2 {
        return Ok(());
    }
    for (file, st) in parsed.iter().enumerate() {
        for name in st.names() {
            if let Some(&(named, _)) = disk.get(name) {
                if named != file {
                    return Err(CheckpointError::TensorInTwoShards {
                        index: index.map(Path::to_path_buf).unwrap_or_default(),
                        tensor: name.to_string(),
                        named: shards[named].path.clone(),
                        copy: shards[file].path.clone(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// The pieces found for one manifest tensor: (piece, on-disk name).
type Pieces = Vec<(Piece, String)>;

/// Loads the weights of `body`'s manifest (the groups in `opts.groups`) from the checkpoint in `dir`, as f32.
///
/// See the module documentation for the layouts accepted and the checks made (`flash-next.md` section 10). Every
/// check is made before any tensor is converted, so a refused checkpoint costs only its headers.
///
/// # Errors
/// [`CheckpointError`], naming the file or the tensor (canonical and on-disk names) and what was expected.
pub fn load_checkpoint(
    dir: &Path,
    body: &PlanBody,
    opts: &LoadOptions,
) -> Result<HostWeights, CheckpointError> {
    let cfg = &body.config;
    let Opened {
        shards,
        names,
        index: index_path,
    } = open_files(dir)?;
    let mut parsed: Vec<SafeTensors<'_>> = Vec::with_capacity(shards.len());
    for s in &shards {
        parsed.push(SafeTensors::deserialize(&s.map).map_err(|cause| not_safetensors(s, cause))?);
    }
    // On-disk name -> (file, view).
    let mut disk: BTreeMap<String, (usize, TensorView<'_>)> = BTreeMap::new();
    for (name, file) in names {
        let view = parsed[file]
            .tensor(&name)
            .map_err(|_| CheckpointError::IndexMismatch {
                index: index_path.clone().unwrap_or_default(),
                tensor: name.clone(),
                file: shards[file].path.clone(),
            })?;
        disk.insert(name, (file, view));
    }
    check_one_shard_each(&parsed, &disk, &shards, index_path.as_deref())?;

    // Scale companions of FP8 tensors (`X_scale_inv`, `X_scale`): skipped here, their base is refused by name.
    let is_fp8 = |n: &str| {
        disk.get(n)
            .is_some_and(|(_, v)| matches!(v.dtype(), Dtype::F8_E4M3 | Dtype::F8_E5M2))
    };
    let scale_of = |n: &str| -> bool {
        n.strip_suffix("_scale_inv")
            .or_else(|| n.strip_suffix("_scale"))
            .is_some_and(is_fp8)
    };

    // Names a checkpoint may hold: the stored groups' (the re-coded `#mxfp8` copies are derived, never on disk).
    let known: BTreeSet<&str> = body
        .weights
        .iter()
        .filter(|w| matches!(w.group, WeightGroup::Main | WeightGroup::Mtp))
        .map(|w| w.name.as_str())
        .collect();
    let mut pieces: BTreeMap<String, Pieces> = BTreeMap::new();
    let mut any_mtp = false;
    for (name, (_, view)) in &disk {
        if scale_of(name) {
            continue;
        }
        let canonical = canonical_name(name);
        match classify(canonical) {
            Class::Ignored => {}
            Class::PleBuffer { layer, buf } => {
                check_ple_buffer(cfg, name, canonical, layer, buf, view)?
            }
            Class::Piece { target, piece } => {
                let unexpected = || CheckpointError::Unexpected {
                    tensor: name.clone(),
                    canonical: canonical.to_string(),
                };
                if !known.contains(target.as_str()) {
                    return Err(unexpected());
                }
                if let Piece::Expert { e, .. } = piece {
                    if e >= cfg.num_experts {
                        return Err(unexpected());
                    }
                }
                any_mtp |= target.starts_with("mtp.");
                let list = pieces.entry(target).or_default();
                if let Some((_, first)) = list.iter().find(|(p, _)| *p == piece) {
                    return Err(CheckpointError::Duplicate {
                        canonical: canonical.to_string(),
                        first: first.clone(),
                        second: name.clone(),
                    });
                }
                list.push((piece, name.clone()));
            }
        }
    }

    // The entries to load.
    let wanted: Vec<usize> = body
        .weights
        .iter()
        .enumerate()
        .filter(|(_, w)| {
            matches!(w.group, WeightGroup::Main | WeightGroup::Mtp)
                && opts.groups.contains(&w.group)
        })
        .map(|(i, _)| i)
        .collect();
    let mtp_wanted: Vec<usize> = wanted
        .iter()
        .copied()
        .filter(|&i| body.weights[i].group == WeightGroup::Mtp)
        .collect();
    let has_mtp = !mtp_wanted.is_empty() && any_mtp;
    if !mtp_wanted.is_empty() && !any_mtp {
        tracing::warn!(
            dir = %dir.display(),
            "no mtp.* tensors: serving with copy drafts only"
        );
    }
    let mtp_present = mtp_wanted
        .iter()
        .filter(|&&i| pieces.contains_key(&body.weights[i].name))
        .count();

    // Check every wanted entry; collect (entry, ordered pieces) to load.
    let mut plan: Vec<(usize, Vec<String>)> = Vec::with_capacity(wanted.len());
    let mut total_bytes = 0u64;
    for &i in &wanted {
        let entry = &body.weights[i];
        if entry.group == WeightGroup::Mtp && !has_mtp {
            continue;
        }
        let missing = |canonical: String, tried: Vec<String>| {
            if entry.group == WeightGroup::Mtp {
                CheckpointError::MtpIncomplete {
                    canonical,
                    tried,
                    present: mtp_present,
                    expected: mtp_wanted.len(),
                }
            } else {
                CheckpointError::Missing { canonical, tried }
            }
        };
        let found = pieces.get(&entry.name).map(Vec::as_slice).unwrap_or(&[]);
        let ordered = order_pieces(cfg, entry, found, &missing)?;
        for disk_name in &ordered {
            let (_, view) = &disk[disk_name];
            check_dtype(disk_name, view, entry, &disk)?;
            total_bytes += view.data().len() as u64;
            if let Some((_, scale)) = fp8_scale(disk_name, view, &disk, "_scale")
                .or_else(|| fp8_scale(disk_name, view, &disk, "_scale_inv"))
            {
                total_bytes += scale.data().len() as u64;
            }
        }
        check_shapes(entry, &ordered, &disk)?;
        plan.push((i, ordered));
    }

    let bar = if opts.progress {
        let bar = ProgressBar::new(total_bytes);
        if let Ok(style) = ProgressStyle::with_template(
            "loading weights {bar:40} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta})",
        ) {
            bar.set_style(style);
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut tensors: Vec<Option<Vec<f32>>> = vec![None; body.weights.len()];
    for (i, ordered) in plan {
        let entry = &body.weights[i];
        let mut out = vec![0f32; entry.numel() as usize];
        fill(&ordered, &disk, &mut out, &bar);
        tensors[i] = Some(out);
    }
    bar.finish_and_clear();
    Ok(HostWeights { tensors, has_mtp })
}

/// Puts the pieces of one manifest entry in load order (checking that every piece is there), as on-disk names.
fn order_pieces(
    cfg: &ModelConfig,
    entry: &WeightEntry,
    found: &[(Piece, String)],
    missing: &dyn Fn(String, Vec<String>) -> CheckpointError,
) -> Result<Vec<String>, CheckpointError> {
    let name = &entry.name;
    let mut tried = disk_candidates(name);
    if found.is_empty() {
        if let Some(head) = name.strip_suffix("gate_up_proj") {
            tried.extend(disk_candidates(&format!("{head}{{e}}.gate_proj.weight")));
            tried.extend(disk_candidates(&format!("{head}{{e}}.up_proj.weight")));
        } else if let Some(head) = name
            .strip_suffix("down_proj")
            .filter(|h| h.ends_with("experts."))
        {
            tried.extend(disk_candidates(&format!("{head}{{e}}.down_proj.weight")));
        } else if let Some(head) = name.strip_suffix(PLE_TABLE) {
            tried.extend(disk_candidates(&format!("{head}{PLE_SHARD}{{k}}.weight")));
        }
        return Err(missing(name.clone(), tried));
    }
    let whole: Vec<&String> = found
        .iter()
        .filter(|(p, _)| *p == Piece::Whole)
        .map(|(_, n)| n)
        .collect();
    if let Some(w) = whole.first() {
        if let Some((_, other)) = found.iter().find(|(p, _)| *p != Piece::Whole) {
            return Err(CheckpointError::Duplicate {
                canonical: name.clone(),
                first: (*w).clone(),
                second: other.clone(),
            });
        }
        return Ok(vec![(*w).clone()]);
    }
    let mut sorted: Vec<(Piece, String)> = found.to_vec();
    sorted.sort();
    if matches!(sorted[0].0, Piece::Expert { .. }) {
        let parts: &[ExpertPart] = if name.ends_with("gate_up_proj") {
            &[ExpertPart::Gate, ExpertPart::Up]
        } else {
            &[ExpertPart::Down]
        };
        let mut out = Vec::new();
        for e in 0..cfg.num_experts {
            for &part in parts {
                match sorted.iter().find(|(p, _)| *p == Piece::Expert { e, part }) {
                    Some((_, n)) => out.push(n.clone()),
                    None => {
                        let head = name.rsplit_once("experts.").map(|(h, _)| h).unwrap_or("");
                        return Err(missing(
                            format!("{name} (expert {e}'s {})", part.file_name()),
                            disk_candidates(&format!(
                                "{head}experts.{e}.{}.weight",
                                part.file_name()
                            )),
                        ));
                    }
                }
            }
        }
        // A gate/up piece under a down target (or the reverse) cannot occur: classify picks the target by part.
        return Ok(out);
    }
    // PLE shards: 0..n contiguous.
    let mut out = Vec::new();
    for (expect_k, (p, n)) in sorted.iter().enumerate() {
        match *p {
            Piece::PleShard { k } if k as usize == expect_k => out.push(n.clone()),
            _ => {
                let head = name.strip_suffix(PLE_TABLE).unwrap_or("");
                return Err(missing(
                    format!("{name} (shard {expect_k})"),
                    disk_candidates(&format!("{head}{PLE_SHARD}{expect_k}.weight")),
                ));
            }
        }
    }
    Ok(out)
}

/// Checks the shapes of an entry's ordered pieces against its manifest shape.
fn check_shapes(
    entry: &WeightEntry,
    ordered: &[String],
    disk: &BTreeMap<String, (usize, TensorView<'_>)>,
) -> Result<(), CheckpointError> {
    let shape_err = |n: &str, found: &[usize], expected: Vec<u64>| CheckpointError::Shape {
        tensor: n.to_string(),
        canonical: entry.name.clone(),
        found: found.to_vec(),
        expected,
    };
    let same = |found: &[usize], expected: &[u64]| {
        found.len() == expected.len() && found.iter().zip(expected).all(|(&f, &e)| f as u64 == e)
    };
    let first = &ordered[0];
    let first_canonical = canonical_name(first);
    if ordered.len() == 1 && canonical_name(first) == entry.name {
        let s = disk[first].1.shape();
        if !same(s, &entry.shape) {
            return Err(shape_err(first, s, entry.shape.clone()));
        }
        return Ok(());
    }
    if first_canonical.contains(PLE_SHARD) {
        let cols = entry.shape.last().copied().unwrap_or(1);
        let mut rows = 0u64;
        for n in ordered {
            let s = disk[n].1.shape();
            if s.len() != 2 || s[1] as u64 != cols {
                return Err(shape_err(n, s, vec![entry.shape[0], cols]));
            }
            rows += s[0] as u64;
        }
        if rows != entry.shape[0] {
            return Err(CheckpointError::PleRows {
                canonical: entry.name.clone(),
                shards: ordered.to_vec(),
                found: rows,
                expected: entry.shape[0],
            });
        }
        return Ok(());
    }
    // Per-expert pieces: stacked [E, 2I, D] from gate/up [I, D]; [E, D, I] from down [D, I].
    let per: Vec<u64> = if entry.name.ends_with("gate_up_proj") {
        vec![entry.shape[1] / 2, entry.shape[2]]
    } else {
        vec![entry.shape[1], entry.shape[2]]
    };
    for n in ordered {
        let s = disk[n].1.shape();
        if !same(s, &per) {
            return Err(shape_err(n, s, per));
        }
    }
    Ok(())
}

/// Converts an entry's pieces, in order, into `out` (the pieces' row-major values are concatenated: stacked experts
/// interleave gate and up per expert because `ordered` lists them so).
fn fill(
    ordered: &[String],
    disk: &BTreeMap<String, (usize, TensorView<'_>)>,
    out: &mut [f32],
    bar: &ProgressBar,
) {
    let mut at = 0usize;
    for n in ordered {
        let view = &disk[n].1;
        let numel: usize = view.shape().iter().product();
        if let Some((_, scale)) = fp8_scale(n, view, disk, "_scale") {
            let cols = view.shape().last().copied().unwrap_or(1);
            let values = crate::mxfp8::dequantize_stored(
                view.data(),
                scale.data(),
                numel / cols.max(1),
                cols,
            );
            out[at..at + numel].copy_from_slice(&values);
            bar.inc(scale.data().len() as u64);
        } else if let Some((_, scale)) = fp8_scale(n, view, disk, "_scale_inv") {
            let shape = view.shape();
            let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let mut scales = vec![0f32; scale.shape().iter().product()];
            convert(scale.data(), scale.dtype(), &mut scales);
            let values = crate::fp8::dequantize_block(view.data(), &scales, rows, cols);
            out[at..at + numel].copy_from_slice(&values);
            bar.inc(scale.data().len() as u64);
        } else {
            convert(view.data(), view.dtype(), &mut out[at..at + numel]);
        }
        at += numel;
        bar.inc(view.data().len() as u64);
    }
    debug_assert_eq!(at, out.len());
}
