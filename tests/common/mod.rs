//! Helpers shared by the integration tests: compile a plan for a fixture, load it on the CPU backend, read the
//! expected outputs the fixture script wrote with transformers 5.23.0.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashplan_plan::{CompileOptions, ModelConfig, PlanBody};
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fixture checkpoint directory.
pub fn fixture(name: &str) -> PathBuf {
    root().join("fixtures").join(name)
}

/// Compiles CPU plans for a model directory with small test options.
pub fn plan_for(dir: &Path, streams: &[u32], max_depth: u32, chunk: u32, context: u64) -> PlanBody {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let cfg = ModelConfig::from_json_str(&text).expect("config parses");
    let opts = CompileOptions {
        arch: "cpu".into(),
        max_depth,
        streams: streams.to_vec(),
        context,
        prefill_chunk: chunk,
    };
    flashplan_compiler::compile(&cfg, &opts, &Default::default(), "test", |_, _| {})
        .expect("compiles")
        .body
}

/// A CPU backend with the checkpoint's weights.
pub fn backend(dir: &Path, body: PlanBody) -> CpuBackend {
    let w = load_checkpoint(dir, &body, &LoadOptions::default()).expect("checkpoint loads");
    CpuBackend::new(Arc::new(body), Arc::new(w.tensors))
}

/// Expected tensors from an `expected.safetensors` file, as f32 (or i64 for ids).
pub struct Expected {
    bytes: Vec<u8>,
}

impl Expected {
    pub fn open(path: &Path) -> Expected {
        Expected {
            bytes: std::fs::read(path).expect("expected.safetensors"),
        }
    }
    pub fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).expect("safetensors");
        let t = st.tensor(name).expect(name);
        let data = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), data)
    }
    pub fn ids(&self, name: &str) -> Vec<u32> {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).expect("safetensors");
        let t = st.tensor(name).expect(name);
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
}

/// Max |a - b| over a row, and max |b|.
pub fn row_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let m = b.iter().map(|x| x.abs()).fold(0f32, f32::max);
    (d, m)
}

/// Greedy: the lowest-id maximum.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}
