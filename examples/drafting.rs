//! Drafting measurements on the demo model (`models/flashnext-tiny`) with held-out Python (issue 5):
//! copy rounds on passage prompts and MTP rounds on file prompts, each checked against its `"draft": false` reply.
//!
//! Usage: `cargo run --release --example drafting -- FILE.py...` (at least 10 Python files the model was not trained
//! on: anything but the standard library, `transformers` and `torch`). Prints a markdown table.

use std::sync::Arc;
use std::time::Instant;

use flashplan_plan::{CompileOptions, ModelConfig, SamplingParams};
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::engine::{Engine, EngineOptions, Event, ReplyStats, Request};

fn engine(copy: bool, mtp: bool) -> anyhow::Result<Engine<CpuBackend>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/flashnext-tiny");
    let cfg = ModelConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let opts = CompileOptions {
        arch: "cpu".into(),
        max_depth: 15,
        streams: vec![1],
        context: 4096,
        prefill_chunk: 64,
    };
    let body =
        flashplan_compiler::compile(&cfg, &opts, &Default::default(), "none", |_, _| {})?.body;
    let w = load_checkpoint(&dir, &body, &LoadOptions::default())?;
    let has_mtp = w.has_mtp;
    let be = CpuBackend::new(Arc::new(body), Arc::new(w.tensors));
    Ok(Engine::new(
        be,
        EngineOptions {
            copy_drafts: copy,
            mtp_drafts: mtp,
            ..Default::default()
        },
        has_mtp,
    ))
}

fn run(
    e: &mut Engine<CpuBackend>,
    prompt: &[u32],
    draft: bool,
) -> anyhow::Result<(Vec<u32>, ReplyStats, f64)> {
    let req = Request {
        prompt: prompt.to_vec(),
        max_tokens: 64,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: true,
        draft,
    };
    let id = e.submit(req)?;
    let t = Instant::now();
    let mut toks = Vec::new();
    for ev in e.run_to_completion() {
        match ev {
            Event::Token { stream, id: tok } if stream == id => toks.push(tok),
            Event::Finished { stream, stats, .. } if stream == id => {
                return Ok((toks, stats, t.elapsed().as_secs_f64()));
            }
            Event::Failed { error, .. } => anyhow::bail!(error),
            _ => {}
        }
    }
    anyhow::bail!("no reply")
}

fn main() -> anyhow::Result<()> {
    let files: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(files.len() >= 10, "give at least 10 held-out Python files");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/flashnext-tiny");
    let tok =
        tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let sep = tok
        .encode("\n\n# The same again:\n", false)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    let mut texts = Vec::new();
    for f in &files {
        let ids = tok
            .encode(std::fs::read_to_string(f)?, false)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec();
        texts.push((f.clone(), ids));
    }
    println!("| test | file | tokens | rounds | tokens/round | drafter rounds | kept per drafter round | first draft kept | equal to draft:false | tok/s drafted | tok/s plain |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut copy_e = engine(true, false)?;
    let (mut copy_rounds, mut copy_kept) = (0u32, 0u32);
    for (f, ids) in texts.iter().take(10) {
        let start = (ids.len() / 3).min(ids.len().saturating_sub(160));
        let passage = &ids[start..(start + 160).min(ids.len())];
        let mut prompt = passage.to_vec();
        prompt.extend(&sep);
        prompt.extend(&passage[..20]);
        let (plain, _, tp) = run(&mut copy_e, &prompt, false)?;
        let (drafted, st, td) = run(&mut copy_e, &prompt, true)?;
        copy_rounds += st.copy_rounds;
        copy_kept += st.copy_round_tokens;
        println!(
            "| copy | {} | {} | {} | {:.2} | {} | {:.2} | - | {} | {:.1} | {:.1} |",
            short(f),
            st.tokens,
            st.rounds,
            st.tokens_per_round(),
            st.copy_rounds,
            st.copy_round_tokens as f64 / st.copy_rounds.max(1) as f64,
            plain == drafted,
            st.tokens as f64 / td,
            plain.len() as f64 / tp
        );
    }
    let mut mtp_e = engine(false, true)?;
    let (mut mtp_rounds, mut first_kept, mut mtp_kept) = (0u32, 0u32, 0u32);
    for (f, ids) in texts.iter().skip(10).chain(texts.iter()).take(10) {
        let prompt = &ids[..ids.len().min(300)];
        let (plain, _, tp) = run(&mut mtp_e, prompt, false)?;
        let (drafted, st, td) = run(&mut mtp_e, prompt, true)?;
        mtp_rounds += st.mtp_rounds;
        first_kept += st.mtp_first_kept;
        mtp_kept += st.mtp_round_tokens;
        println!(
            "| mtp | {} | {} | {} | {:.2} | {} | {:.2} | {:.2} | {} | {:.1} | {:.1} |",
            short(f),
            st.tokens,
            st.rounds,
            st.tokens_per_round(),
            st.mtp_rounds,
            st.mtp_round_tokens as f64 / st.mtp_rounds.max(1) as f64,
            st.mtp_first_kept as f64 / st.mtp_rounds.max(1) as f64,
            plain == drafted,
            st.tokens as f64 / td,
            plain.len() as f64 / tp
        );
    }
    println!();
    println!(
        "copy rounds: {copy_rounds}, tokens kept per copy round: {:.2}",
        copy_kept as f64 / copy_rounds.max(1) as f64
    );
    println!(
        "mtp rounds: {mtp_rounds}, tokens kept per mtp round: {:.2}, first draft kept in {:.1}% of MTP rounds",
        mtp_kept as f64 / mtp_rounds.max(1) as f64,
        100.0 * first_kept as f64 / mtp_rounds.max(1) as f64
    );
    Ok(())
}

fn short(f: &str) -> String {
    let p = std::path::Path::new(f);
    let parent = p
        .parent()
        .and_then(|x| x.file_name())
        .map(|x| x.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(
        "{parent}/{}",
        p.file_name()
            .map(|x| x.to_string_lossy().into_owned())
            .unwrap_or_default()
    )
}
