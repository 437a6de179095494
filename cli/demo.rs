//! `flashplan demo`: the bundled `models/flashnext-tiny`, one copy-heavy prompt and one fresh prompt, each with
//! and without drafts (greedy), showing that the replies are identical and how many tokens each round kept.

use std::path::PathBuf;

use anyhow::Context;
use flashplan_plan::SamplingParams;
use flashplan_runtime::engine::{Engine, Request};

use crate::model::{engine_options, load_backend};
use crate::run::{generate, Generated};

/// Arguments of `flashplan demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The demo model directory (default: models/flashnext-tiny of the repository).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Reply tokens per run (at least 1).
    #[arg(long, allow_negative_numbers = true, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
}

const PASSAGE: &str = "def serialize_tensors(tensors, metadata=None):
    \"\"\"Serialize a dict of tensors into bytes.\"\"\"
    header = {}
    offset = 0
    for name, tensor in sorted(tensors.items()):
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            \"dtype\": str(tensor.dtype),
            \"shape\": list(tensor.shape),
            \"data_offsets\": [offset, offset + size],
        }
        offset += size
    if metadata is not None:
        header[\"__metadata__\"] = metadata
    return header
";

const FRESH: &str = "def merge_sorted_lists(left, right):\n";

fn model_dir(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(d) = given {
        return Ok(d);
    }
    let mut candidates = vec![PathBuf::from("models/flashnext-tiny")];
    candidates.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/flashnext-tiny"));
    if let Ok(exe) = std::env::current_exe() {
        for a in exe.ancestors().skip(1).take(4) {
            candidates.push(a.join("models/flashnext-tiny"));
        }
    }
    candidates
        .into_iter()
        .find(|d| d.join("config.json").exists())
        .context(
            "models/flashnext-tiny not found: run from the repository root or pass --model DIR",
        )
}

fn show(label: &str, g: &Generated) {
    let tps = if g.stats.decode_s > 0.0 {
        g.stats.tokens.saturating_sub(1) as f64 / g.stats.decode_s
    } else {
        0.0
    };
    let kept: Vec<String> = g.per_step.iter().map(|n| n.to_string()).collect();
    println!(
        "  {label:<10} {} tokens, {} rounds, {:.2} tokens/round, {:.1} tok/s decode; copy {}/{} MTP {}/{} accepted/drafted",
        g.stats.tokens,
        g.stats.rounds,
        g.stats.tokens_per_round(),
        tps,
        g.stats.accepted_copy,
        g.stats.drafted_copy,
        g.stats.accepted_mtp,
        g.stats.drafted_mtp
    );
    if g.stats.drafted_copy + g.stats.drafted_mtp == 0 {
        println!("  {label:<10} kept per round: 1 every round (no drafts)");
    } else {
        println!(
            "  {label:<10} kept per round (prefill first): {}",
            kept.join(" ")
        );
    }
}

/// `flashplan demo`.
pub fn demo(a: DemoArgs) -> anyhow::Result<()> {
    let dir = model_dir(a.model)?;
    let mut copts = flashplan_compiler::default_options(flashplan_compiler::default_arch());
    copts.context = 4096;
    let t0 = std::time::Instant::now();
    let tok = flashplan_runtime::tokenizer::Tokenizer::from_dir(&dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let eopts = engine_options(1, copts.max_depth)?;
    let (backend, has_mtp, label) = load_backend(&dir, None, None, &copts, eopts.drafter_form)?;
    let mut engine = Engine::new(backend, eopts, has_mtp);
    println!(
        "flashplan demo: {} on {label} (plans and weights ready in {:.1}s), greedy, {} tokens per reply",
        dir.display(),
        t0.elapsed().as_secs_f64(),
        a.max_tokens
    );
    let passage = tok.encode(PASSAGE, false)?;
    let mut copy_prompt = passage.clone();
    copy_prompt.extend(tok.encode("\n\n# The same again:\n", false)?);
    copy_prompt.extend(&passage[..20.min(passage.len())]);
    let fresh = tok.encode(FRESH, false)?;
    let mut all_same = true;
    for (name, prompt) in [("copy-heavy prompt", copy_prompt), ("fresh prompt", fresh)] {
        println!();
        println!(
            "== {name} ({} tokens), ending: {:?}",
            prompt.len(),
            tail_text(&tok, &prompt)?
        );
        let req = |draft| Request {
            prompt: prompt.clone(),
            max_tokens: a.max_tokens,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: false,
            draft,
        };
        let plain = generate(&mut engine, req(false), |_| {})?;
        let drafted = generate(&mut engine, req(true), |_| {})?;
        println!("reply (drafted):");
        for line in tok.decode(&drafted.tokens, true)?.lines() {
            println!("  | {line}");
        }
        show("plain", &plain);
        show("drafted", &drafted);
        let same = plain.tokens == drafted.tokens;
        all_same &= same;
        println!(
            "  drafted == plain: {} (token ids); wall {:.2}s plain, {:.2}s drafted (on the CPU backend a \
             round costs in proportion to its rows, so fewer rounds save little time; on a GPU a round costs \
             about the same at any width)",
            if same {
                "identical replies"
            } else {
                "DIFFERENT"
            },
            plain.wall_s,
            drafted.wall_s
        );
    }
    println!();
    println!("done in {:.1}s on {label}", t0.elapsed().as_secs_f64());
    anyhow::ensure!(all_same, "a drafted reply differs from its plain run");
    Ok(())
}

fn tail_text(tok: &flashplan_runtime::tokenizer::Tokenizer, ids: &[u32]) -> anyhow::Result<String> {
    Ok(tok.decode(&ids[ids.len().saturating_sub(12)..], true)?)
}
