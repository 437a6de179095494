//! `flashplan bench`: a client against a running server (or one started in-process with `--model`): decode
//! tokens/s, time to first token and aggregate tokens/s at given concurrency levels, with the `--alone` (each
//! concurrent reply equals its solo run) and `--serial` (each solo run equals its `"draft": false` run) checks by
//! `token_sha`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use flashplan_runtime::server::client;
use serde_json::{json, Value};

use crate::model::ModelArgs;

/// Arguments of `flashplan bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The server (http://HOST:PORT). Without it, `--model` starts one in-process on a free port; with neither,
    /// the server at http://127.0.0.1:8000 (`flashplan serve`'s default).
    #[arg(long, conflicts_with = "model")]
    pub url: Option<String>,
    /// Serve this model in-process (with --plans, --parallel, --max-depth, --context).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Plans for --model.
    #[arg(long, requires = "model")]
    pub plans: Option<PathBuf>,
    /// Streams at once for --model.
    #[arg(long, allow_negative_numbers = true, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub parallel: u32,
    /// Most drafts per window for --model.
    #[arg(long, allow_negative_numbers = true, default_value_t = 15)]
    pub max_depth: u32,
    /// Context per stream (tokens) when compiling plans for --model [default: 4096]; with --plans theirs holds,
    /// and a --context other than it is refused.
    #[arg(long, allow_negative_numbers = true)]
    pub context: Option<u64>,
    /// Concurrency levels (comma-separated).
    #[arg(
        long,
        allow_negative_numbers = true,
        value_delimiter = ',',
        default_value = "1,2,4"
    )]
    pub concurrency: Vec<usize>,
    /// Prompts: a JSON array of strings, or a text file whose prompts are separated by lines holding `---`.
    /// Default: a few built-in Python prompts.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Reply tokens per request, at least 1 (ignore_eos is set so every reply has this many).
    #[arg(long, allow_negative_numbers = true, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
    /// Sampling temperature, 0 to 2 (0: greedy); sampled runs use seed 1234.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Check that each concurrent reply equals its solo run (same token_sha).
    #[arg(long)]
    pub alone: bool,
    /// Check that each solo run equals its `"draft": false` run (same token_sha).
    #[arg(long)]
    pub serial: bool,
}

const BUILTIN: &[&str] = &[
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\nimport os\n\n\ndef load_config(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=\"Process files\")\n",
];

/// One measured request.
#[derive(Debug, Clone)]
struct Sample {
    ttft_s: f64,
    total_s: f64,
    tokens: u64,
    sha: String,
}

fn one(addr: &str, prompt: &str, a: &BenchArgs, draft: bool) -> anyhow::Result<Sample> {
    let body = json!({
        "prompt": prompt, "max_tokens": a.max_tokens, "temperature": a.temperature, "seed": 1234,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}, "draft": draft,
    })
    .to_string();
    let t0 = Instant::now();
    let mut first = None;
    let mut tokens = 0;
    let mut sha = String::new();
    let r = client::stream_sse(addr, "/v1/completions", &body, |d| {
        if d == "[DONE]" {
            return;
        }
        let v: Value = serde_json::from_str(d).unwrap_or(Value::Null);
        if first.is_none()
            && v["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        {
            first = Some(t0.elapsed().as_secs_f64());
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
        if let Some(s) = v["flashplan"]["token_sha"].as_str() {
            sha = s.to_string();
        }
    })
    .with_context(|| format!("POST http://{addr}/v1/completions"))?;
    if r.status != 200 {
        anyhow::bail!(
            "POST http://{addr}/v1/completions: the server answered {}: {}",
            r.status,
            r.body
        );
    }
    let total_s = t0.elapsed().as_secs_f64();
    Ok(Sample {
        ttft_s: first.unwrap_or(total_s),
        total_s,
        tokens,
        sha,
    })
}

fn load_prompts(p: Option<&PathBuf>) -> anyhow::Result<Vec<String>> {
    let Some(p) = p else {
        return Ok(BUILTIN.iter().map(|s| s.to_string()).collect());
    };
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    let list: Vec<String> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text)
            .with_context(|| format!("{}: expected a JSON array of strings", p.display()))?
    } else {
        text.split("\n---\n")
            .map(str::to_string)
            .filter(|s| !s.trim().is_empty())
            .collect()
    };
    anyhow::ensure!(!list.is_empty(), "{} holds no prompts", p.display());
    Ok(list)
}

/// `flashplan bench`.
pub fn bench(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.concurrency.iter().all(|&c| c > 0),
        "--concurrency levels must be at least 1"
    );
    crate::run::check_temperature(a.temperature)?;
    let prompts = load_prompts(a.prompts.as_ref())?;
    let mut _server = None;
    let addr = match (&a.url, &a.model) {
        (Some(u), _) => client::host_port(u)?,
        (None, Some(m)) => {
            let margs = ModelArgs {
                model: m.clone(),
                plans: a.plans.clone(),
                parallel: a.parallel,
                max_depth: a.max_depth,
                // The bench's own default (a short context compiles and loads fast); given plans keep theirs.
                context: a.context.or(a.plans.is_none().then_some(4096)),
                confidence: 0.3,
            };
            let state = crate::serve::start(&margs, None)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the tokio runtime")?;
            let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
            let addr = listener.local_addr()?.to_string();
            rt.spawn(flashplan_runtime::server::serve(
                listener,
                state,
                std::future::pending(),
            ));
            _server = Some(rt);
            addr
        }
        (None, None) => client::host_port("http://127.0.0.1:8000")?,
    };
    println!(
        "bench against http://{addr}: {} prompts, {} tokens each, temperature {}",
        prompts.len(),
        a.max_tokens,
        a.temperature
    );
    let mut failures = 0;
    // Solo runs: the reference for --alone, and checked against draft:false for --serial.
    let mut solo = Vec::new();
    if a.alone || a.serial {
        for p in &prompts {
            solo.push(one(&addr, p, &a, true)?);
        }
    }
    if a.serial {
        for (i, p) in prompts.iter().enumerate() {
            let plain = one(&addr, p, &a, false)?;
            let ok = plain.sha == solo[i].sha;
            failures += usize::from(!ok);
            println!(
                "serial: prompt {i}: drafted {} draft:false {} -> {}",
                &solo[i].sha[..12.min(solo[i].sha.len())],
                &plain.sha[..12.min(plain.sha.len())],
                if ok { "same" } else { "DIFFERENT" }
            );
        }
    }
    println!(
        "{:>11} {:>10} {:>12} {:>12} {:>14}",
        "concurrency", "requests", "ttft_s p50", "decode tok/s", "aggregate tok/s"
    );
    for &c in &a.concurrency {
        let t0 = Instant::now();
        let results: Vec<(usize, anyhow::Result<Sample>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..c)
                .map(|k| {
                    let i = k % prompts.len();
                    let (addr, p, a) = (&addr, &prompts[i], &a);
                    (i, s.spawn(move || one(addr, p, a, true)))
                })
                .collect();
            hs.into_iter()
                .map(|(i, h)| {
                    (
                        i,
                        h.join()
                            .unwrap_or_else(|_| Err(anyhow::anyhow!("client thread panicked"))),
                    )
                })
                .collect()
        });
        let wall = t0.elapsed().as_secs_f64();
        let mut ttft = Vec::new();
        let mut decode = Vec::new();
        let mut total = 0;
        for (i, r) in results {
            let s = r?;
            total += s.tokens;
            ttft.push(s.ttft_s);
            if s.total_s > s.ttft_s && s.tokens > 1 {
                decode.push((s.tokens - 1) as f64 / (s.total_s - s.ttft_s));
            }
            if a.alone && s.sha != solo[i].sha {
                failures += 1;
                println!("alone: concurrency {c}: prompt {i} differs from its solo run");
            }
        }
        ttft.sort_by(f64::total_cmp);
        let p50 = ttft.get(ttft.len() / 2).copied().unwrap_or(0.0);
        let dec = if decode.is_empty() {
            0.0
        } else {
            decode.iter().sum::<f64>() / decode.len() as f64
        };
        println!(
            "{c:>11} {c:>10} {p50:>12.3} {dec:>12.1} {:>14.1}",
            total as f64 / wall
        );
    }
    if a.alone {
        println!(
            "alone: {}",
            if failures == 0 {
                "every concurrent reply equals its solo run"
            } else {
                "FAILED"
            }
        );
    }
    anyhow::ensure!(failures == 0, "{failures} exactness checks failed");
    Ok(())
}
