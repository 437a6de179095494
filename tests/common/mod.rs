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

/// Prompt texts of different lengths and kinds (some copy-friendly, some fresh) for the streams checks.
pub const STREAM_TEXTS: [&str; 8] = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "import json\n\n\ndef load(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2",
    "# Utilities for parsing command line options\nimport argparse\n",
    "for key, value in sorted(mapping.items()):\n",
    "def fib(n):\n    if n < 2:\n        return n\n",
    "try:\n    import numpy as np\nexcept ImportError:\n",
];

/// Request `i` of the streams checks: greedy, or sampled (T 0.9, top-k 50, top-p 0.95, seed 1000 + i), with a
/// reply length that differs per stream so streams leave at different rounds.
pub fn stream_request(
    prompt: &[u32],
    i: usize,
    sampled: bool,
) -> flashplan_runtime::engine::Request {
    let sampling = if sampled {
        flashplan_plan::SamplingParams {
            temperature: 0.9,
            top_k: 50,
            top_p: 0.95,
            min_p: 0.0,
            seed: 1000 + i as u64,
        }
    } else {
        flashplan_plan::SamplingParams::greedy()
    };
    req(prompt, 20 + (i as u32 * 7) % 17, true, sampling)
}

/// A request with no stop tokens that stops at eos.
pub fn req(
    prompt: &[u32],
    max_tokens: u32,
    draft: bool,
    sampling: flashplan_plan::SamplingParams,
) -> flashplan_runtime::engine::Request {
    flashplan_runtime::engine::Request {
        prompt: prompt.to_vec(),
        max_tokens,
        sampling,
        stop_token_ids: vec![],
        ignore_eos: false,
        draft,
    }
}

/// A test switch from the environment: `1` on, `0` or unset off; any other value fails the test, naming the
/// variable (a misspelt `FLASHPLAN_GPU=true` would otherwise skip the GPU checks and pass).
pub fn switch(name: &str) -> bool {
    flashplan_plan::env::switch(name)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or(false)
}

/// The GPU's name when the GPU checks run (`FLASHPLAN_GPU=1` and a usable GPU); otherwise prints why they skip.
pub fn gpu_ready() -> Option<String> {
    if !switch("FLASHPLAN_GPU") {
        eprintln!("skipped: set FLASHPLAN_GPU=1 to run the GPU checks (scripts/gpu_check.sh)");
        return None;
    }
    match flashplan_runtime::cuda::probe_gpu() {
        Ok(name) => Some(name),
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}
