//! MXFP8 drafter acceptance (issue 8): runs `models/flashnext-tiny` on held-out Python files under
//! `FLASHPLAN_MTP_WEIGHTS=checkpoint`, `mxfp8` and `mxfp8-head` (copy drafts off, so every drafted round is an MTP
//! round) and prints tokens per round, the first-draft kept rate, and the share of draft steps where each MXFP8
//! form proposes the same token as `checkpoint` at the same position.
//!
//! ```text
//! cargo run --release --example mxfp8_acceptance -- [--site-packages DIR] [--model DIR] [--files N]
//! ```
//!
//! Held-out files: the model was trained on the standard library, `transformers` and `torch`, so the files come from
//! other packages' site-packages directories (`flask`, `jinja2`, `click`, `werkzeug`, `requests`, `urllib3`, in
//! that order, missing ones skipped): each package's `.py` files of 2-20 KB in sorted path order, the first four of
//! each, at least 20 in all. The prompt is the first 300 tokens of a file; replies are 64 greedy tokens (eos
//! ignored). `--site-packages` defaults to the `purelib` path of `python3`.
//!
//! Same-token share: for every round that both forms draft from the same position (the replies are identical, so
//! the context is too), draft step `j` is compared when both chains have a step `j` and agree on steps `0..j`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashplan_plan::{CompileOptions, DrafterForm, ModelConfig, SamplingParams};
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::engine::{Engine, EngineOptions, Event, ReplyStats, Request};
use flashplan_runtime::mxfp8::derive_drafter_weights;

const PACKAGES: &[&str] = &[
    "flask", "jinja2", "click", "werkzeug", "requests", "urllib3",
];
const PER_PACKAGE: usize = 4;
const PROMPT_TOKENS: usize = 300;
const REPLY_TOKENS: u32 = 64;
const MAX_DEPTH: u32 = 15;

/// One reply under one form: its tokens, stats and MTP chains `(position, chain)`.
struct Run {
    tokens: Vec<u32>,
    stats: ReplyStats,
    chains: Vec<(u32, Vec<u32>)>,
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn site_packages() -> anyhow::Result<PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "python3 could not name its site-packages; pass --site-packages DIR"
    );
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

fn py_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            py_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "py") {
            out.push(p);
        }
    }
}

/// The held-out files, deterministically (module documentation).
fn held_out(site: &Path, want: usize) -> anyhow::Result<Vec<PathBuf>> {
    let per = PER_PACKAGE.max(want.div_ceil(PACKAGES.len()));
    let mut files = Vec::new();
    for pkg in PACKAGES {
        let mut all = Vec::new();
        py_files(&site.join(pkg), &mut all);
        all.sort();
        files.extend(
            all.into_iter()
                .filter(|p| std::fs::metadata(p).is_ok_and(|m| (2048..=20480).contains(&m.len())))
                .take(per),
        );
    }
    anyhow::ensure!(
        files.len() >= want,
        "only {} held-out files under {} (need {want})",
        files.len(),
        site.display()
    );
    files.truncate(want.max(20));
    Ok(files)
}

fn run_form(model: &Path, form: DrafterForm, prompts: &[Vec<u32>]) -> anyhow::Result<Vec<Run>> {
    let text = std::fs::read_to_string(model.join("config.json"))?;
    let cfg = ModelConfig::from_json_str(&text)?;
    let opts = CompileOptions {
        arch: "cpu".into(),
        max_depth: MAX_DEPTH,
        streams: vec![1],
        context: 1024,
        prefill_chunk: 64,
    };
    let body =
        flashplan_compiler::compile(&cfg, &opts, &Default::default(), "example", |_, _| {})?.body;
    let mut w = load_checkpoint(model, &body, &LoadOptions::default())?;
    anyhow::ensure!(w.has_mtp, "{} has no MTP drafter", model.display());
    derive_drafter_weights(&body, &mut w.tensors, form);
    let be = CpuBackend::new(Arc::new(body), Arc::new(w.tensors));
    let mut e = Engine::new(
        be,
        EngineOptions {
            max_depth: MAX_DEPTH,
            copy_drafts: false,
            drafter_form: form,
            parallel: 1,
            ..Default::default()
        },
        true,
    );
    e.mtp_chains = Some(Vec::new());
    let mut runs = Vec::new();
    for p in prompts {
        let id = e.submit(Request {
            prompt: p.clone(),
            max_tokens: REPLY_TOKENS,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: true,
            draft: true,
        })?;
        let mut tokens = Vec::new();
        let mut stats = None;
        for ev in e.run_to_completion() {
            match ev {
                Event::Token { stream, id: t } if stream == id => tokens.push(t),
                Event::Finished {
                    stream, stats: s, ..
                } if stream == id => stats = Some(s),
                Event::Failed { error, .. } => anyhow::bail!("{}: {error}", form.name()),
                _ => {}
            }
        }
        let log = e
            .mtp_chains
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        let chains = log
            .into_iter()
            .filter(|(s, _, _)| *s == id)
            .map(|(_, pos, c)| (pos, c))
            .collect();
        runs.push(Run {
            tokens,
            stats: stats.ok_or_else(|| anyhow::anyhow!("stream did not finish"))?,
            chains,
        });
    }
    Ok(runs)
}

/// `(comparable draft steps, same token, comparable first steps, same first token, common rounds)`.
fn agreement(base: &[Run], other: &[Run]) -> (u64, u64, u64, u64, u64) {
    let (mut n, mut same, mut n1, mut same1, mut rounds) = (0, 0, 0, 0, 0);
    for (b, o) in base.iter().zip(other) {
        for (pos, chain) in &o.chains {
            let Some((_, bc)) = b.chains.iter().find(|(p, _)| p == pos) else {
                continue;
            };
            rounds += 1;
            for j in 0..chain.len().min(bc.len()) {
                n += 1;
                let eq = chain[j] == bc[j];
                same += eq as u64;
                if j == 0 {
                    n1 += 1;
                    same1 += eq as u64;
                }
                if !eq {
                    break;
                }
            }
        }
    }
    (n, same, n1, same1, rounds)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let model = arg(&args, "--model")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("models/flashnext-tiny"));
    let site = match arg(&args, "--site-packages") {
        Some(s) => PathBuf::from(s),
        None => site_packages()?,
    };
    let want: usize = arg(&args, "--files")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(24);
    let files = held_out(&site, want)?;
    let tok = tokenizers::Tokenizer::from_file(model.join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let mut prompts = Vec::new();
    println!(
        "held-out files ({}), under {}:",
        files.len(),
        site.display()
    );
    for f in &files {
        let text = std::fs::read_to_string(f)?;
        let ids = tok
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("encode: {e}"))?
            .get_ids()
            .to_vec();
        let n = ids.len().min(PROMPT_TOKENS);
        println!(
            "  {} ({} tokens, prompt {n})",
            f.strip_prefix(&site).unwrap_or(f).display(),
            ids.len()
        );
        prompts.push(ids[..n].to_vec());
    }
    let mut results = Vec::new();
    for form in DrafterForm::ALL {
        let t0 = std::time::Instant::now();
        let runs = run_form(&model, form, &prompts)?;
        eprintln!("{}: {:.1} s", form.name(), t0.elapsed().as_secs_f64());
        results.push((form, runs));
    }
    // Replies must be identical across forms (drafts are only proposals).
    let base = &results[0].1;
    for (form, runs) in &results[1..] {
        for (k, (a, b)) in base.iter().zip(runs).enumerate() {
            anyhow::ensure!(
                a.tokens == b.tokens,
                "{}: reply {k} differs from checkpoint's",
                form.name()
            );
        }
    }
    println!();
    println!(
        "| setting | tokens/round | vs checkpoint | first-draft kept | MTP drafts accepted | drafts/round | \
         same token as checkpoint (steps) | same first draft |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut base_tpr = 0.0;
    for (form, runs) in &results {
        let sum = |f: fn(&ReplyStats) -> u32| runs.iter().map(|r| f(&r.stats) as u64).sum::<u64>();
        let tokens = sum(|s| s.tokens.saturating_sub(1));
        let rounds = sum(|s| s.rounds);
        let tpr = tokens as f64 / rounds as f64;
        if *form == DrafterForm::Checkpoint {
            base_tpr = tpr;
        }
        let first = sum(|s| s.mtp_first_kept) as f64 / sum(|s| s.mtp_rounds) as f64;
        let acc = sum(|s| s.accepted_mtp) as f64 / sum(|s| s.drafted_mtp) as f64;
        let dpr = sum(|s| s.drafted_mtp) as f64 / sum(|s| s.mtp_rounds) as f64;
        let (same_s, same_1) = if *form == DrafterForm::Checkpoint {
            ("-".to_string(), "-".to_string())
        } else {
            let (n, same, n1, same1, common) = agreement(base, runs);
            (
                format!(
                    "{:.1}% ({same}/{n}, {common} common rounds)",
                    100.0 * same as f64 / n as f64
                ),
                format!("{:.1}% ({same1}/{n1})", 100.0 * same1 as f64 / n1 as f64),
            )
        };
        println!(
            "| {} | {tpr:.3} ({tokens}/{rounds}) | {:+.1}% | {:.1}% | {:.1}% | {dpr:.2} | {same_s} | {same_1} |",
            form.name(),
            100.0 * (tpr / base_tpr - 1.0),
            100.0 * first,
            100.0 * acc,
        );
    }
    Ok(())
}
