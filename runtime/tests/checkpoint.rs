//! Checkpoint loader tests (`flash-next.md` section 10) against the trained `flashnext-tiny` checkpoint and
//! synthetic variants of it written into temporary directories: refusals (missing tensor, wrong shape, wrong dtype,
//! truncated shard, unexpected tensors, partial MTP, FP8/MXFP8, PLE buffers) and the other layouts (wrapper prefix,
//! single file, stacked experts, differently sharded PLE table, MLX-style MTP names, `model.visual.*`).
//!
//! The manifest comes from the committed plan `plans/flashnext-tiny/plans.fplan` (the runtime never depends on the
//! compiler crate). The checkpoint is `../shared/models/flashnext-tiny` (or the repository's `models/flashnext-tiny`);
//! every test is skipped, saying so, when neither exists.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use flashplan_plan::{PlanBody, PlanSet, WeightGroup};
use flashplan_runtime::checkpoint::{load_checkpoint, CheckpointError, HostWeights, LoadOptions};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// The shared checkpoint named by the brief, then the copy committed in this repository.
const TINY: [&str; 2] = [
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/models/flashnext-tiny"
    ),
    concat!(env!("CARGO_MANIFEST_DIR"), "/../models/flashnext-tiny"),
];
/// The committed plan of flashnext-tiny (`plans/flashnext-tiny/plans.fplan`).
const PLAN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../plans/flashnext-tiny/plans.fplan"
);
const INDEX: &str = "model.safetensors.index.json";

/// The checkpoint directory, or `None` (with the reason printed) when it is absent.
fn tiny() -> Option<PathBuf> {
    let found = TINY
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join(INDEX).is_file());
    if found.is_none() {
        eprintln!("SKIP: flashnext-tiny not present (looked in {TINY:?})");
    }
    found
}

fn plan() -> PlanBody {
    PlanSet::read(Path::new(PLAN)).expect("read test plan").body
}

/// One owned tensor of a safetensors file.
#[derive(Clone)]
struct T {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read_st(path: &Path) -> Vec<T> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<T> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| T {
            name,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data: t.data().to_vec(),
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

fn write_st(path: &Path, tensors: &[T]) {
    let _ = std::fs::remove_file(path);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
}

/// A copy of the checkpoint whose files are symlinks (rewritten ones become real files).
fn copy_of(src: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if name.to_string_lossy() == INDEX {
            std::fs::copy(e.path(), dir.path().join(&name)).unwrap();
        } else {
            std::os::unix::fs::symlink(e.path(), dir.path().join(&name)).unwrap();
        }
    }
    dir
}

fn read_index(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX)).unwrap()).unwrap()
}

fn write_index(dir: &Path, v: &Value) {
    let p = dir.join(INDEX);
    let _ = std::fs::remove_file(&p);
    std::fs::write(p, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// The shard holding an on-disk tensor.
fn file_of(dir: &Path, tensor: &str) -> String {
    read_index(dir)["weight_map"][tensor]
        .as_str()
        .unwrap_or_else(|| panic!("{tensor} not in index"))
        .to_string()
}

/// Rewrites the shard holding `tensor` with `f` applied to its tensors, then fixes the index to match.
fn edit_shard(dir: &Path, tensor: &str, f: impl FnOnce(&mut Vec<T>)) {
    let file = file_of(dir, tensor);
    let mut ts = read_st(&dir.join(&file));
    let before: Vec<String> = ts.iter().map(|t| t.name.clone()).collect();
    f(&mut ts);
    write_st(&dir.join(&file), &ts);
    let mut idx = read_index(dir);
    let map = idx["weight_map"].as_object_mut().unwrap();
    for n in before {
        map.remove(&n);
    }
    for t in &ts {
        map.insert(t.name.clone(), Value::String(file.clone()));
    }
    write_index(dir, &idx);
}

fn load(dir: &Path, body: &PlanBody) -> Result<HostWeights, CheckpointError> {
    load_checkpoint(dir, body, &LoadOptions::default())
}

fn refusal(dir: &Path, body: &PlanBody) -> String {
    match load(dir, body) {
        Ok(_) => panic!("checkpoint in {} was accepted", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("refused: {msg}");
            msg
        }
    }
}

fn bf16_row(t: &T, row: usize, cols: usize) -> Vec<f32> {
    assert_eq!(t.dtype, Dtype::BF16);
    t.data[row * cols * 2..(row + 1) * cols * 2]
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

fn tensor_in(dir: &Path, name: &str) -> T {
    let file = file_of(dir, name);
    read_st(&dir.join(file))
        .into_iter()
        .find(|t| t.name == name)
        .unwrap()
}

fn get<'a>(w: &'a HostWeights, body: &PlanBody, name: &str) -> &'a [f32] {
    w.get(body, name)
        .unwrap_or_else(|| panic!("{name} not loaded"))
}

#[test]
fn tiny_loads_fully_and_matches_the_files() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let w = load(&src, &body).unwrap();
    assert!(w.has_mtp);
    assert_eq!(w.tensors.len(), body.weights.len());
    for (e, t) in body.weights.iter().zip(&w.tensors) {
        match e.group {
            WeightGroup::Main | WeightGroup::Mtp => {
                let t = t
                    .as_ref()
                    .unwrap_or_else(|| panic!("{} not loaded", e.name));
                assert_eq!(t.len() as u64, e.numel(), "{}", e.name);
            }
            WeightGroup::MtpMxfp8 | WeightGroup::HeadMxfp8 => assert!(t.is_none(), "{}", e.name),
        }
    }
    let cfg = &body.config;
    let (d, i, n_exp) = (
        cfg.hidden_size as usize,
        cfg.moe_intermediate_size as usize,
        cfg.num_experts as usize,
    );

    // lm_head row 0 and the last row.
    let head = tensor_in(&src, "lm_head.weight");
    let got = get(&w, &body, "lm_head.weight");
    assert_eq!(&got[..d], bf16_row(&head, 0, d).as_slice());
    let v = cfg.vocab_size as usize;
    assert_eq!(&got[(v - 1) * d..], bf16_row(&head, v - 1, d).as_slice());

    // Expert 3 of layer 2: gate rows, then up rows, inside the stacked gate_up_proj; expert 5's down_proj.
    let gate = tensor_in(&src, "model.layers.2.mlp.experts.3.gate_proj.weight");
    let up = tensor_in(&src, "model.layers.2.mlp.experts.3.up_proj.weight");
    let gu = get(&w, &body, "layers.2.mlp.experts.gate_up_proj");
    assert_eq!(gu.len(), n_exp * 2 * i * d);
    let base = 3 * 2 * i * d;
    for r in [0, 1, i - 1] {
        assert_eq!(
            &gu[base + r * d..base + (r + 1) * d],
            bf16_row(&gate, r, d).as_slice()
        );
        assert_eq!(
            &gu[base + (i + r) * d..base + (i + r + 1) * d],
            bf16_row(&up, r, d).as_slice()
        );
    }
    let down = tensor_in(&src, "model.layers.2.mlp.experts.5.down_proj.weight");
    let dn = get(&w, &body, "layers.2.mlp.experts.down_proj");
    let base = 5 * d * i;
    for r in [0, d - 1] {
        assert_eq!(
            &dn[base + r * i..base + (r + 1) * i],
            bf16_row(&down, r, i).as_slice()
        );
    }

    // PLE shard 1 row 0 sits right after shard 0 in the concatenated table.
    let s0 = tensor_in(
        &src,
        "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight",
    );
    let s1 = tensor_in(
        &src,
        "model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight",
    );
    let cols = s0.shape[1];
    let table = get(
        &w,
        &body,
        "layers.1.ple.ple_embedding.ngram_embedding.weight",
    );
    let r0 = s0.shape[0];
    assert_eq!(&table[..cols], bf16_row(&s0, 0, cols).as_slice());
    assert_eq!(
        &table[r0 * cols..(r0 + 1) * cols],
        bf16_row(&s1, 0, cols).as_slice()
    );
    assert_eq!(table.len(), (s0.shape[0] + s1.shape[0]) * cols);

    // MTP stacked experts as stored.
    let mg = tensor_in(&src, "mtp.layers.0.mlp.experts.gate_up_proj");
    let got = get(&w, &body, "mtp.layers.0.mlp.experts.gate_up_proj");
    assert_eq!(
        &got[7 * 2 * i * d..7 * 2 * i * d + d],
        bf16_row(&mg, 7 * 2 * i, d).as_slice()
    );
}

#[test]
fn main_group_only_leaves_mtp_unloaded() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let opts = LoadOptions {
        groups: vec![WeightGroup::Main],
        progress: false,
    };
    let w = load_checkpoint(&src, &body, &opts).unwrap();
    assert!(!w.has_mtp);
    for (e, t) in body.weights.iter().zip(&w.tensors) {
        assert_eq!(t.is_some(), e.group == WeightGroup::Main, "{}", e.name);
    }
}

#[test]
fn missing_tensor_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.3.self_attn.q_proj.weight";
    edit_shard(dir.path(), name, |ts| ts.retain(|t| t.name != name));
    let msg = refusal(dir.path(), &body);
    assert!(
        msg.contains("missing tensor layers.3.self_attn.q_proj.weight"),
        "{msg}"
    );
    assert!(msg.contains(name), "{msg}");
}

#[test]
fn missing_expert_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.0.mlp.experts.5.up_proj.weight";
    edit_shard(dir.path(), name, |ts| ts.retain(|t| t.name != name));
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains("layers.0.mlp.experts.gate_up_proj"), "{msg}");
    assert!(msg.contains(name), "{msg}");
}

#[test]
fn a_tensor_in_two_shards_is_refused() {
    // A second copy of a tensor in a shard the index does not name for it: which one is meant is a guess.
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.0.linear_attn.out_proj.weight";
    let home = file_of(dir.path(), name);
    let other = "model-00003-of-00004.safetensors";
    assert_ne!(home, other);
    let copy = read_st(&dir.path().join(&home))
        .into_iter()
        .find(|t| t.name == name)
        .expect("the tensor");
    let mut ts = read_st(&dir.path().join(other));
    ts.push(copy);
    write_st(&dir.path().join(other), &ts);
    let msg = refusal(dir.path(), &body);
    let named = format!("names {}", dir.path().join(&home).display());
    let copy = format!("{} holds it too", dir.path().join(other).display());
    assert!(
        msg.contains(name) && msg.contains(&named) && msg.contains(&copy),
        "{msg}"
    );
}

#[test]
fn missing_shard_file_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    std::fs::remove_file(dir.path().join("model-00003-of-00004.safetensors")).unwrap();
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains("model-00003-of-00004.safetensors"), "{msg}");
}

#[test]
fn wrong_shape_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.0.linear_attn.out_proj.weight";
    edit_shard(dir.path(), name, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        assert_eq!(t.shape, vec![256, 256]);
        t.shape = vec![128, 512];
    });
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains(name), "{msg}");
    assert!(
        msg.contains("[128, 512]") && msg.contains("[256, 256]"),
        "{msg}"
    );
}

#[test]
fn wrong_expert_shape_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.4.mlp.experts.2.down_proj.weight";
    edit_shard(dir.path(), name, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        t.shape = vec![t.shape[1], t.shape[0]];
    });
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains(name) && msg.contains("[128, 256]"), "{msg}");
}

#[test]
fn wrong_dtype_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.3.self_attn.q_norm.weight";
    edit_shard(dir.path(), name, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        t.dtype = Dtype::I16;
    });
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains(name) && msg.contains("I16"), "{msg}");
}

#[test]
fn fp8_and_mxfp8_are_refused_by_name() {
    let Some(src) = tiny() else { return };
    let body = plan();
    // FP8 block with U8 scales is refused by name (it reads F32 or BF16 scales); MXFP8 is read, but only where the
    // plan's manifest says MXFP8 (the committed plan says BF16), so here it is refused as a form mismatch, naming
    // the form.
    for (suffix, words, why) in [
        ("_scale_inv", "FP8 block", "with U8 scales"),
        ("_scale", "MXFP8", "the plan's manifest says"),
    ] {
        let dir = copy_of(&src);
        let name = "model.layers.5.mlp.shared_expert.up_proj.weight";
        edit_shard(dir.path(), name, |ts| {
            let t = ts.iter_mut().find(|t| t.name == name).unwrap();
            t.dtype = Dtype::F8_E4M3;
            t.shape = vec![t.shape[0], t.shape[1] * 2];
            let scale = T {
                name: format!("{name}{suffix}"),
                dtype: Dtype::U8,
                shape: vec![t.shape[0], t.shape[1] / 32],
                data: vec![127; t.shape[0] * t.shape[1] / 32],
            };
            ts.push(scale);
        });
        let msg = refusal(dir.path(), &body);
        assert!(
            msg.contains(&format!("tensor {name} is stored as {words}")),
            "{msg}"
        );
        assert!(msg.contains(why), "{msg}");
    }
}

/// Stores `name` (a BF16 tensor `[.., K]`) as MXFP8: F8_E4M3 codes plus U8 `<name>_scale` `[.., K/32]`; returns the
/// values the stored form represents.
fn store_as_mxfp8(dir: &Path, name: &str) -> Vec<f32> {
    use flashplan_runtime::mxfp8;
    let mut values = Vec::new();
    edit_shard(dir, name, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        let cols = *t.shape.last().unwrap();
        let rows = t.shape.iter().product::<usize>() / cols;
        let w: Vec<f32> = (0..rows).flat_map(|r| bf16_row(t, r, cols)).collect();
        let m = mxfp8::quantize(&w, rows, cols);
        values = mxfp8::dequantize(&m);
        t.dtype = Dtype::F8_E4M3;
        t.data = m.codes;
        let mut sshape = t.shape.clone();
        *sshape.last_mut().unwrap() = cols / 32;
        ts.push(T {
            name: format!("{name}_scale"),
            dtype: Dtype::U8,
            shape: sshape,
            data: m.scales,
        });
    });
    values
}

#[test]
fn mxfp8_stored_drafter_loads_as_stored() {
    use flashplan_plan::{DrafterForm, StorageForm};
    let Some(src) = tiny() else { return };
    let mut body = plan();
    let dir = copy_of(&src);
    let names = [
        "mtp.layers.0.mlp.shared_expert.up_proj.weight",
        "mtp.layers.0.mlp.experts.gate_up_proj",
        "model.layers.3.self_attn.o_proj.weight",
    ];
    let mut want = Vec::new();
    for n in names {
        want.push(store_as_mxfp8(dir.path(), n));
        let canonical = n.strip_prefix("model.").unwrap_or(n);
        let i = body.weight_index(canonical).unwrap();
        body.weights[i].form = StorageForm::Mxfp8;
    }
    let w = load(dir.path(), &body).expect("MXFP8 tensors load");
    assert!(w.has_mtp);
    for (n, v) in names.iter().zip(&want) {
        let canonical = n.strip_prefix("model.").unwrap_or(n);
        assert!(get(&w, &body, canonical) == v.as_slice(), "{n}");
    }
    // Everything else loads as before.
    let plain = load(&src, &plan()).unwrap();
    let other = "mtp.layers.0.mlp.shared_expert.down_proj.weight";
    assert_eq!(get(&w, &body, other), get(&plain, &body, other));
    // The re-coded drafter takes a stored MXFP8 tensor as stored.
    let mut tensors = w.tensors.clone();
    flashplan_runtime::mxfp8::derive_drafter_weights(&body, &mut tensors, DrafterForm::Mxfp8);
    let i = body.weight_index(&format!("{}#mxfp8", names[0])).unwrap();
    assert!(tensors[i].as_deref() == Some(want[0].as_slice()));
}

#[test]
fn mxfp8_with_bad_scales_is_refused_by_name() {
    use flashplan_plan::StorageForm;
    let Some(src) = tiny() else { return };
    let mut body = plan();
    let name = "mtp.layers.0.self_attn.o_proj.weight";
    let i = body.weight_index(name).unwrap();
    body.weights[i].form = StorageForm::Mxfp8;
    for (edit, why) in [
        (0, "scales of shape"),
        (1, "U16 scales"),
        (2, "F8_E5M2 codes"),
    ] {
        let dir = copy_of(&src);
        store_as_mxfp8(dir.path(), name);
        edit_shard(dir.path(), name, |ts| match edit {
            0 => {
                let s = ts.iter_mut().find(|t| t.name.ends_with("_scale")).unwrap();
                s.shape = vec![s.shape[0] / 2, s.shape[1] * 2];
            }
            1 => {
                let s = ts.iter_mut().find(|t| t.name.ends_with("_scale")).unwrap();
                s.dtype = Dtype::U16;
                s.shape[1] /= 2;
            }
            _ => ts.iter_mut().find(|t| t.name == name).unwrap().dtype = Dtype::F8_E5M2,
        });
        let msg = refusal(dir.path(), &body);
        assert!(
            msg.contains(&format!("tensor {name} is stored as MXFP8 with")) && msg.contains(why),
            "{msg}"
        );
    }
}

/// Stores `name` (a tensor `[.., R, C]`) as FP8 block: F8_E4M3 codes (every finite code, spread by a hash) plus
/// `<name>_scale_inv` `[.., ceil(R/128), ceil(C/128)]` of `scale_dtype` (F32 or BF16; scales that are not powers of
/// two, so each product rounds, each block's its own);
/// returns the values the stored form represents, by `fp8::dequantize_block` (whose values its unit test checks
/// against E4M3's definition; here the loader's reading of shapes, stacks and scales is under test).
fn store_as_fp8_block(dir: &Path, name: &str, scale_dtype: Dtype) -> Vec<f32> {
    let mut values = Vec::new();
    edit_shard(dir, name, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        let n = t.shape.len();
        let (rows, cols) = (t.shape[n - 2], t.shape[n - 1]);
        let batch = t.shape[..n - 2].iter().product::<usize>();
        let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
        let finite: Vec<u8> = (0..=255u8).filter(|q| q & 0x7F != 0x7F).collect();
        let codes: Vec<u8> = (0..batch * rows * cols)
            .map(|i| finite[(i * 2654435761) % finite.len()])
            .collect();
        let bf16 = scale_dtype == Dtype::BF16;
        let scales: Vec<f32> = (0..batch * br * bc)
            .map(|i| 1e-3 * (1.0 + 0.37 * i as f32))
            .map(|s| {
                if bf16 {
                    half::bf16::from_f32(s).to_f32()
                } else {
                    s
                }
            })
            .collect();
        values = flashplan_runtime::fp8::dequantize_block(&codes, &scales, rows, cols);
        t.dtype = Dtype::F8_E4M3;
        t.data = codes;
        let mut sshape = t.shape.clone();
        sshape[n - 2] = br;
        sshape[n - 1] = bc;
        ts.push(T {
            name: format!("{name}_scale_inv"),
            dtype: scale_dtype,
            shape: sshape,
            data: if bf16 {
                scales
                    .iter()
                    .flat_map(|&s| half::bf16::from_f32(s).to_le_bytes())
                    .collect()
            } else {
                scales.iter().flat_map(|s| s.to_le_bytes()).collect()
            },
        });
    });
    values
}

/// Asserts that a loaded tensor holds exactly the values its stored form represents (bit for bit).
fn same_bits(got: &[f32], want: &[f32], name: &str) {
    assert_eq!(got.len(), want.len(), "{name}");
    assert!(
        got.iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{name}: a value differs from code x scale"
    );
}

#[test]
fn fp8_block_tensors_load_as_code_times_scale() {
    use flashplan_plan::StorageForm;
    let Some(src) = tiny() else { return };
    let mut body = plan();
    let dir = copy_of(&src);
    // Stacked experts (8 matrices of 256 x 256, 2 x 2 blocks each) and a plain linear.
    let names = [
        "mtp.layers.0.mlp.experts.gate_up_proj",
        "model.layers.3.self_attn.o_proj.weight",
    ];
    let mut want = Vec::new();
    for n in names {
        want.push(store_as_fp8_block(dir.path(), n, Dtype::F32));
        let canonical = n.strip_prefix("model.").unwrap_or(n);
        let i = body.weight_index(canonical).unwrap();
        body.weights[i].form = StorageForm::Fp8Block;
    }
    let w = load(dir.path(), &body).expect("FP8 block tensors load");
    for (n, v) in names.iter().zip(&want) {
        let canonical = n.strip_prefix("model.").unwrap_or(n);
        same_bits(get(&w, &body, canonical), v, n);
    }
    // Everything else loads as before.
    let plain = load(&src, &plan()).unwrap();
    let other = "mtp.layers.0.mlp.experts.down_proj";
    assert_eq!(get(&w, &body, other), get(&plain, &body, other));
    // Where the manifest says BF16 (a plan compiled for another checkpoint), the stored form is refused by name.
    let msg = refusal(dir.path(), &plan());
    assert!(
        msg.contains("is stored as FP8 block (F8_E4M3 with weight_scale_inv)")
            && msg.contains("was the plan compiled for another checkpoint?"),
        "{msg}"
    );
}

#[test]
fn fp8_block_expert_pieces_with_bf16_scales_stack_as_their_values() {
    // The real release's layout: per-expert gate and up pieces (128 x 256 here: a 1 x 2 grid, not square, so rows
    // and columns cannot be swapped unseen), each with its own BF16 scales, stacked expert by expert, gate rows then
    // up rows; and a stacked down `[E, 256, 128]` (2 x 1 grids) with F32 scales.
    use flashplan_plan::StorageForm;
    let Some(src) = tiny() else { return };
    let mut body = plan();
    let dir = copy_of(&src);
    let gate_up = "layers.0.mlp.experts.gate_up_proj";
    let i = body.weight_index(gate_up).unwrap();
    body.weights[i].form = StorageForm::Fp8Block;
    let experts = body.weights[i].shape[0] as usize;
    let mut want = Vec::new();
    for e in 0..experts {
        for part in ["gate", "up"] {
            let name = format!("model.layers.0.mlp.experts.{e}.{part}_proj.weight");
            want.extend(store_as_fp8_block(dir.path(), &name, Dtype::BF16));
        }
    }
    let down = "mtp.layers.0.mlp.experts.down_proj";
    let want_down = store_as_fp8_block(dir.path(), down, Dtype::F32);
    let j = body.weight_index(down).unwrap();
    body.weights[j].form = StorageForm::Fp8Block;
    let w = load(dir.path(), &body).expect("FP8 block pieces load");
    for (name, v) in [(gate_up, &want), (down, &want_down)] {
        same_bits(get(&w, &body, name), v, name);
    }
}

#[test]
fn fp8_block_with_bad_scales_is_refused_by_name() {
    use flashplan_plan::StorageForm;
    let Some(src) = tiny() else { return };
    let mut body = plan();
    let name = "mtp.layers.0.self_attn.o_proj.weight";
    let i = body.weight_index(name).unwrap();
    body.weights[i].form = StorageForm::Fp8Block;
    for (edit, why) in [
        (0, "scales of shape"),
        (1, "U16 scales"),
        (2, "F8_E5M2 codes"),
        (
            3,
            "and mtp.layers.0.self_attn.o_proj.weight_scale (MXFP8) beside it",
        ),
    ] {
        let dir = copy_of(&src);
        store_as_fp8_block(dir.path(), name, Dtype::F32);
        edit_shard(dir.path(), name, |ts| match edit {
            0 => {
                let s = ts
                    .iter_mut()
                    .find(|t| t.name.ends_with("_scale_inv"))
                    .unwrap();
                s.shape = vec![s.shape[0] * s.shape[1], 1];
            }
            1 => {
                let s = ts
                    .iter_mut()
                    .find(|t| t.name.ends_with("_scale_inv"))
                    .unwrap();
                s.dtype = Dtype::U16;
                s.shape[1] *= 2;
            }
            2 => ts.iter_mut().find(|t| t.name == name).unwrap().dtype = Dtype::F8_E5M2,
            _ => {
                // MXFP8 scales too: which form it is would be a guess.
                let t = ts.iter().find(|t| t.name == name).unwrap();
                let (rows, cols) = (t.shape[0], t.shape[1]);
                ts.push(T {
                    name: format!("{name}_scale"),
                    dtype: Dtype::U8,
                    shape: vec![rows, cols / 32],
                    data: vec![127; rows * cols / 32],
                });
            }
        });
        let msg = refusal(dir.path(), &body);
        assert!(
            msg.contains(&format!("tensor {name} is stored as FP8 block with"))
                && msg.contains(why),
            "{msg}"
        );
    }
}

#[test]
fn truncated_shard_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let file = "model-00002-of-00004.safetensors";
    let bytes = std::fs::read(src.join(file)).unwrap();
    std::fs::remove_file(dir.path().join(file)).unwrap();
    std::fs::write(dir.path().join(file), &bytes[..bytes.len() - 1000]).unwrap();
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains(file) && msg.contains("truncated"), "{msg}");
    // The tensor the data now ends inside is named: the last one in the data (a cut of 1000 bytes, less than it).
    let bytes_n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + bytes_n]).unwrap();
    let last = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .max_by_key(|(_, v)| v["data_offsets"][1].as_u64().unwrap())
        .map(|(k, _)| k.clone())
        .unwrap();
    assert!(
        msg.contains(&format!(": tensor {last}: its data_offsets end at byte"))
            && msg.ends_with("(truncated? 1 tensor lies past that point)"),
        "{msg}"
    );
}

#[test]
fn a_header_whose_dtype_disagrees_with_its_offsets_names_the_tensor() {
    // The safetensors crate says only "invalid shape, data type, or offset for tensor"; the refusal names the
    // tensor and the bytes its dtype and shape need.
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.7.attn_hyper_connection.hc_norm.weight";
    let file = file_of(dir.path(), name);
    let path = dir.path().join(&file);
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header[name]["dtype"] = "F32".into();
    let shape: Vec<u64> = header[name]["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap())
        .collect();
    let offsets = header[name]["data_offsets"].clone();
    let h = header.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, out).unwrap();
    let numel: u64 = shape.iter().product();
    let (b, e) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
    let msg = refusal(dir.path(), &body);
    assert!(
        msg.contains(&file)
            && msg.ends_with(&format!(
                ": tensor {name}: dtype F32 x shape {shape:?} needs {} bytes, its data_offsets [{b}, {e}] give {}",
                numel * 4,
                e - b
            )),
        "{msg}"
    );
}

#[test]
fn unexpected_layer_tensor_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let anchor = "model.layers.7.mlp.gate.weight";
    let extra = "model.layers.99.foo.weight";
    edit_shard(dir.path(), anchor, |ts| {
        ts.push(T {
            name: extra.into(),
            dtype: Dtype::BF16,
            shape: vec![4],
            data: vec![0; 8],
        })
    });
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains(&format!("unexpected tensor {extra}")), "{msg}");
}

#[test]
fn unexpected_mtp_and_expert_tensors_are_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    for extra in [
        "mtp.extra",
        "model.layers.0.mlp.experts.8.gate_proj.weight",
        "model.norm.weight",
    ] {
        let dir = copy_of(&src);
        edit_shard(dir.path(), "mtp.fc_hidden.weight", |ts| {
            ts.push(T {
                name: extra.into(),
                dtype: Dtype::BF16,
                shape: vec![128, 256],
                data: vec![0; 128 * 256 * 2],
            })
        });
        let msg = refusal(dir.path(), &body);
        assert!(msg.contains(&format!("unexpected tensor {extra}")), "{msg}");
    }
}

#[test]
fn partial_mtp_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    edit_shard(dir.path(), "mtp.fc_hidden.weight", |ts| {
        ts.retain(|t| !t.name.contains("self_attn"))
    });
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains("incomplete MTP drafter"), "{msg}");
    assert!(msg.contains("mtp.layers.0.self_attn."), "{msg}");
}

#[test]
fn no_mtp_loads_with_copy_drafts_only() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    std::fs::remove_file(dir.path().join("model-mtp.safetensors")).unwrap();
    let mut idx = read_index(dir.path());
    idx["weight_map"]
        .as_object_mut()
        .unwrap()
        .retain(|k, _| !k.starts_with("mtp."));
    write_index(dir.path(), &idx);
    let w = load(dir.path(), &body).unwrap();
    assert!(!w.has_mtp);
    for (e, t) in body.weights.iter().zip(&w.tensors) {
        assert_eq!(t.is_some(), e.group == WeightGroup::Main, "{}", e.name);
    }
}

#[test]
fn ple_buffer_mismatch_is_refused() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let dir = copy_of(&src);
    let name = "model.layers.1.ple.ple_embedding.layer_multipliers";
    edit_shard(dir.path(), name, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        assert_eq!(t.dtype, Dtype::I64);
        t.data[0] ^= 2;
    });
    let msg = refusal(dir.path(), &body);
    assert!(msg.contains(name) && msg.contains("config gives"), "{msg}");
}

/// Wrapper prefix, one `model.safetensors` (no index), stacked experts everywhere, the PLE table in 3 shards of
/// unequal rows, MLX-style `language_model.mtp.*`, and `model.visual.*` tensors: loads equal to the original layout.
#[test]
fn wrapper_single_file_stacked_layout_loads_the_same() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let reference = load(&src, &body).unwrap();
    let cfg = &body.config;
    let n_exp = cfg.num_experts as usize;

    let mut all: Vec<T> = Vec::new();
    let files: std::collections::BTreeSet<String> = read_index(&src)["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    for f in files {
        all.extend(read_st(&src.join(f)));
    }
    let by_name: HashMap<String, T> = all.iter().map(|t| (t.name.clone(), t.clone())).collect();
    let mut out: Vec<T> = Vec::new();
    let mut stacked_done = std::collections::HashSet::new();
    for t in &all {
        let n = &t.name;
        if let Some(pos) = n.find("mlp.experts.") {
            let head = &n[..pos + "mlp.experts.".len()];
            let rest = &n[head.len()..];
            if rest.split('.').next().unwrap().parse::<usize>().is_ok() {
                if stacked_done.insert(head.to_string()) {
                    let mut gu = T {
                        name: format!("{head}gate_up_proj"),
                        dtype: Dtype::BF16,
                        shape: vec![],
                        data: vec![],
                    };
                    let mut dn = T {
                        name: format!("{head}down_proj"),
                        ..gu.clone()
                    };
                    for e in 0..n_exp {
                        let g = &by_name[&format!("{head}{e}.gate_proj.weight")];
                        let u = &by_name[&format!("{head}{e}.up_proj.weight")];
                        let dw = &by_name[&format!("{head}{e}.down_proj.weight")];
                        gu.data.extend(&g.data);
                        gu.data.extend(&u.data);
                        dn.data.extend(&dw.data);
                        gu.shape = vec![n_exp, 2 * g.shape[0], g.shape[1]];
                        dn.shape = vec![n_exp, dw.shape[0], dw.shape[1]];
                    }
                    for mut s in [gu, dn] {
                        s.name = s.name.replacen("model.", "model.language_model.", 1);
                        out.push(s);
                    }
                }
                continue;
            }
        }
        if n.contains("ngram_embedding.shard_") {
            if n.ends_with("shard_0.weight") {
                let s0 = t;
                let s1 = &by_name[&n.replace("shard_0", "shard_1")];
                let cols = s0.shape[1];
                let mut rows = s0.data.clone();
                rows.extend(&s1.data);
                let total = s0.shape[0] + s1.shape[0];
                let cuts = [0, 1000, total - 7, total];
                for k in 0..3 {
                    out.push(T {
                        name: format!(
                            "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_{k}.weight"
                        ),
                        dtype: Dtype::BF16,
                        shape: vec![cuts[k + 1] - cuts[k], cols],
                        data: rows[cuts[k] * cols * 2..cuts[k + 1] * cols * 2].to_vec(),
                    });
                }
            }
            continue;
        }
        let mut t = t.clone();
        if let Some(rest) = n.strip_prefix("model.") {
            t.name = format!("model.language_model.{rest}");
        } else if n.starts_with("mtp.") {
            t.name = format!("language_model.{n}");
        }
        out.push(t);
    }
    out.push(T {
        name: "model.visual.patch_embed.proj.weight".into(),
        dtype: Dtype::F32,
        shape: vec![2, 3],
        data: vec![0; 24],
    });
    let dir = tempfile::tempdir().unwrap();
    write_st(&dir.path().join("model.safetensors"), &out);
    let w = load(dir.path(), &body).unwrap();
    assert!(w.has_mtp);
    assert_eq!(w.tensors.len(), reference.tensors.len());
    for ((e, a), b) in body.weights.iter().zip(&w.tensors).zip(&reference.tensors) {
        assert!(a == b, "{} differs", e.name);
    }
}

/// F32 and F16 storage convert to the same values as BF16 when they hold BF16-representable numbers.
#[test]
fn f32_and_f16_tensors_convert() {
    let Some(src) = tiny() else { return };
    let body = plan();
    let reference = load(&src, &body).unwrap();
    let dir = copy_of(&src);
    let n32 = "model.layers.0.linear_attn.out_proj.weight";
    let n16 = "model.layers.0.linear_attn.norm.weight";
    edit_shard(dir.path(), n32, |ts| {
        let t = ts.iter_mut().find(|t| t.name == n32).unwrap();
        t.dtype = Dtype::F32;
        t.data = t
            .data
            .chunks_exact(2)
            .flat_map(|b| {
                half::bf16::from_le_bytes([b[0], b[1]])
                    .to_f32()
                    .to_le_bytes()
            })
            .collect();
        let t = ts.iter_mut().find(|t| t.name == n16).unwrap();
        t.dtype = Dtype::F16;
        t.data = t
            .data
            .chunks_exact(2)
            .flat_map(|b| {
                half::f16::from_f32(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).to_le_bytes()
            })
            .collect();
    });
    let w = load(dir.path(), &body).unwrap();
    let a = get(&w, &body, "layers.0.linear_attn.out_proj.weight");
    assert_eq!(
        a,
        get(&reference, &body, "layers.0.linear_attn.out_proj.weight")
    );
    let b = get(&w, &body, "layers.0.linear_attn.norm.weight");
    let r = get(&reference, &body, "layers.0.linear_attn.norm.weight");
    for (x, y) in b.iter().zip(r) {
        assert!((x - y).abs() <= 1e-3 * y.abs().max(1e-3), "{x} vs {y}");
    }
}
