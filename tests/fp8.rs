//! An FP8 block-scaled checkpoint end to end on the CPU backend (`flash-next.md` section 10; the loader's form is
//! `runtime/src/fp8.rs`): the `tiny-text` fixture with its routed experts (main and MTP) stored as E4M3 codes with
//! `weight_scale_inv` scales plans from its headers as FP8 block, loads as code times scale, and decodes the same
//! tokens as the same checkpoint with those values stored as F32, the form the golden tests check against
//! transformers.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use flashplan_plan::{CompileOptions, ModelConfig, PlanBody, SamplingParams, StorageForm};
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::engine::{Engine, EngineOptions, Event};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// One tensor to write: name, dtype, shape, little-endian bytes.
type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

/// E4M3 (OCP FN) by its definition: bias 7, subnormals at exponent 0.
fn e4m3(q: u8) -> f32 {
    let (e, m) = (((q >> 3) & 15) as i32, (q & 7) as f32);
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if q & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// Writes two copies of `tiny-text` into `fp8` and `f32`: every routed-expert tensor (`[E, R, C]`, one 128 x 128
/// block per matrix here) as codes near the original values' scale plus F32 `_scale_inv` in `fp8`, and as the values
/// those represent (code times scale, computed here) in `f32`. Returns how many tensors were re-stored.
fn write_pair(fp8: &Path, f32_dir: &Path) -> usize {
    let src = fixture("tiny-text");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("tiny-text");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let finite: Vec<u8> = (0..=255u8).filter(|q| q & 0x7F != 0x7F).collect();
    let (mut a, mut b): (Vec<Owned>, Vec<Owned>) = (vec![], vec![]);
    let mut restored = 0;
    for (k, (name, t)) in st.tensors().into_iter().enumerate() {
        let shape = t.shape().to_vec();
        if !name.contains(".mlp.experts.") {
            a.push((name.clone(), t.dtype(), shape.clone(), t.data().to_vec()));
            b.push((name, t.dtype(), shape, t.data().to_vec()));
            continue;
        }
        restored += 1;
        let n = shape.len();
        let (rows, cols) = (shape[n - 2], shape[n - 1]);
        let batch: usize = shape[..n - 2].iter().product();
        let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
        let codes: Vec<u8> = (0..batch * rows * cols)
            .map(|i| finite[(i * 2654435761 + k) % finite.len()])
            .collect();
        // Weights of about 0.02: codes up to 448 times scales near 5e-5.
        let scales: Vec<f32> = (0..batch * br * bc)
            .map(|i| 4e-5 * (1.0 + 0.1 * i as f32))
            .collect();
        let values: Vec<u8> = codes
            .iter()
            .enumerate()
            .flat_map(|(i, &q)| {
                let blk =
                    ((i / (rows * cols)) * br + (i / cols % rows) / 128) * bc + (i % cols) / 128;
                (e4m3(q) * scales[blk]).to_le_bytes()
            })
            .collect();
        let mut sshape = shape.clone();
        sshape[n - 2] = br;
        sshape[n - 1] = bc;
        a.push((name.clone(), Dtype::F8_E4M3, shape.clone(), codes));
        a.push((
            format!("{name}_scale_inv"),
            Dtype::F32,
            sshape,
            scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        ));
        b.push((name, Dtype::F32, shape, values));
    }
    for (dir, ts) in [(fp8, a), (f32_dir, b)] {
        std::fs::copy(src.join("config.json"), dir.join("config.json")).expect("config");
        let views: Vec<(String, TensorView<'_>)> = ts
            .iter()
            .map(|(n, d, s, data)| {
                (
                    n.clone(),
                    TensorView::new(*d, s.clone(), data).expect("view"),
                )
            })
            .collect();
        std::fs::write(
            dir.join("model.safetensors"),
            safetensors::serialize(views, None).expect("serialize"),
        )
        .expect("write");
    }
    restored
}

/// CPU plans for `dir` with the storage forms its safetensors headers give.
fn plans_from_headers(dir: &Path) -> PlanBody {
    let cfg =
        ModelConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
            .expect("config");
    let forms = flashplan_compiler::checkpoint::forms_from_model_dir(dir).expect("headers");
    let opts = CompileOptions {
        arch: "cpu".into(),
        max_depth: 4,
        streams: vec![1],
        context: 256,
        prefill_chunk: 16,
    };
    flashplan_compiler::compile(&cfg, &opts, &forms, "test", |_, _| {})
        .expect("compiles")
        .body
}

/// Greedy reply ids of `prompt` (drafts on).
fn greedy(body: PlanBody, dir: &Path, prompt: &[u32]) -> Vec<u32> {
    let w = load_checkpoint(dir, &body, &LoadOptions::default()).expect("loads");
    let has_mtp = w.has_mtp;
    let be = CpuBackend::new(Arc::new(body), Arc::new(w.tensors));
    let mut e = Engine::new(be, EngineOptions::default(), has_mtp);
    let id = e
        .submit(req(prompt, 12, true, SamplingParams::greedy()))
        .expect("submit");
    e.run_to_completion()
        .into_iter()
        .filter_map(|ev| match ev {
            Event::Token { stream, id: t } if stream == id => Some(t),
            _ => None,
        })
        .collect()
}

#[test]
fn an_fp8_block_checkpoint_plans_loads_and_decodes_as_its_values() {
    let (fp8, f32_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let restored = write_pair(fp8.path(), f32_dir.path());
    let (a, b) = (
        plans_from_headers(fp8.path()),
        plans_from_headers(f32_dir.path()),
    );
    // The experts (main and MTP, each gate_up and down) plan as FP8 block, nothing else does.
    let fp8_entries = a.weights.iter().filter(|w| w.form == StorageForm::Fp8Block);
    assert!(fp8_entries
        .clone()
        .all(|w| w.name.contains(".mlp.experts.")));
    assert_eq!(fp8_entries.count(), restored);
    assert!(restored >= 4, "{restored} expert tensors");
    assert!(a
        .weights
        .iter()
        .any(|w| w.name.starts_with("mtp.") && w.form == StorageForm::Fp8Block));
    let wa = load_checkpoint(fp8.path(), &a, &LoadOptions::default()).expect("FP8 loads");
    let wb = load_checkpoint(f32_dir.path(), &b, &LoadOptions::default()).expect("F32 loads");
    for (i, e) in a.weights.iter().enumerate() {
        let j = b.weight_index(&e.name).expect("same manifest names");
        assert!(wa.tensors[i] == wb.tensors[j], "{} differs", e.name);
    }
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 500).collect();
    let (ta, tb) = (
        greedy(a, fp8.path(), &prompt),
        greedy(b, f32_dir.path(), &prompt),
    );
    assert_eq!(ta.len(), 12);
    assert_eq!(ta, tb);
}
