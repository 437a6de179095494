//! `flashplan run`: one prompt, the reply printed as it streams, then a statistics line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use flashplan_plan::SamplingParams;
use flashplan_runtime::backend::Backend;
use flashplan_runtime::engine::{Engine, Event, FinishReason, ReplyStats, Request};
use flashplan_runtime::sampler::prompt_seed;
use flashplan_runtime::tokenizer::{ChatMessage, TextStream, Tokenizer};

use crate::model::{load, ModelArgs};

/// Arguments of `flashplan run`: one of `--prompt` and `--prompt-file` (clap's group `input` names both when
/// neither or both is given).
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).multiple(false)))]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, group = "input")]
    pub prompt: Option<String>,
    /// A file holding the prompt text.
    #[arg(long, group = "input")]
    pub prompt_file: Option<PathBuf>,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most reply tokens (at least 1).
    #[arg(long, allow_negative_numbers = true, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
    /// Sampling temperature, 0 to 2 (0: greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sampling seed: any 64-bit integer, a negative one taken as its two's complement, as the API takes `seed`
    /// (default: derived from the prompt).
    #[arg(long, allow_negative_numbers = true, value_parser = seed_arg)]
    pub seed: Option<u64>,
    /// Decode plainly, one token per round (no copy or MTP drafts).
    #[arg(long)]
    pub no_draft: bool,
    /// Stop strings (repeatable; each non-empty).
    #[arg(long, value_parser = stop_arg)]
    pub stop: Vec<String>,
}

/// Parses `--stop`: a non-empty string (an empty one would end every reply before its first token).
fn stop_arg(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("expected a non-empty stop string".into())
    } else {
        Ok(s.to_string())
    }
}

/// Parses `--seed`: an integer from -2^63 to 2^64 - 1, negative ones as their 64-bit two's complement (the API's
/// `seed` rule, so a seed gives the same reply from the command line and from the server).
fn seed_arg(s: &str) -> Result<u64, String> {
    match s.trim().parse::<i128>() {
        Ok(v) if (i64::MIN as i128..=u64::MAX as i128).contains(&v) => Ok(v as u64),
        _ => Err(format!(
            "expected an integer from {} to {}",
            i64::MIN,
            u64::MAX
        )),
    }
}

/// Checks `--temperature` against the API's range, 0 to `MAX_TEMPERATURE` (0: greedy).
///
/// # Errors
/// A value outside it (NaN included), naming the option, the value and the range.
pub fn check_temperature(t: f32) -> anyhow::Result<()> {
    let max_t = flashplan_runtime::server::api::MAX_TEMPERATURE;
    anyhow::ensure!(
        (0.0..=max_t).contains(&(t as f64)),
        "--temperature {t}: expected 0 to {max_t} (0: greedy), as the API takes"
    );
    Ok(())
}

/// A reply generated directly on an engine.
pub struct Generated {
    /// Reply token ids.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub reason: FinishReason,
    /// Engine statistics.
    pub stats: ReplyStats,
    /// Tokens kept by each round, after the prefill's first token (listed first, as 1).
    pub per_step: Vec<u32>,
    /// Wall seconds of the whole request.
    pub wall_s: f64,
}

/// Runs one request alone on `engine`, calling `on_token` with each reply token.
pub fn generate<B: Backend>(
    engine: &mut Engine<B>,
    req: Request,
    mut on_token: impl FnMut(u32),
) -> anyhow::Result<Generated> {
    let t0 = std::time::Instant::now();
    let id = engine
        .submit(req)
        .context("the engine refused the request")?;
    let mut tokens = Vec::new();
    let mut per_step = Vec::new();
    loop {
        let events = engine.step();
        let mut n = 0;
        for ev in events {
            match ev {
                Event::Token { stream, id: t } if stream == id => {
                    n += 1;
                    tokens.push(t);
                    on_token(t);
                }
                Event::Finished {
                    stream,
                    reason,
                    stats,
                } if stream == id => {
                    push_step(&mut per_step, n, tokens.len());
                    return Ok(Generated {
                        tokens,
                        reason,
                        stats,
                        per_step,
                        wall_s: t0.elapsed().as_secs_f64(),
                    });
                }
                Event::Failed { stream, error } if stream == id => {
                    anyhow::bail!("generation failed: {error}")
                }
                _ => {}
            }
        }
        push_step(&mut per_step, n, tokens.len());
        if engine.busy() == 0 {
            anyhow::bail!("the engine dropped the request");
        }
    }
}

/// Records the tokens of one step: the step that finishes the prefill emits the prefill's token and the first
/// round's kept tokens, listed apart.
fn push_step(per_step: &mut Vec<u32>, n: u32, total: usize) {
    if n == 0 {
        return;
    }
    if total == n as usize {
        per_step.push(1);
        if n > 1 {
            per_step.push(n - 1);
        }
    } else {
        per_step.push(n);
    }
}

/// The statistics line.
pub fn stats_line(g: &Generated) -> String {
    let s = &g.stats;
    let decode_tps = if s.decode_s > 0.0 {
        s.tokens.saturating_sub(1) as f64 / s.decode_s
    } else {
        0.0
    };
    let plural = |n: u32, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    format!(
        "{} (finish: {}), {}, {:.2} tokens/round, copy drafted {} accepted {}, MTP drafted {} accepted {}, \
         prefill {:.2}s, decode {:.1} tokens/s",
        plural(s.tokens, "token", "tokens"),
        g.reason.as_str(),
        plural(s.rounds, "round", "rounds"),
        s.tokens_per_round(),
        s.drafted_copy,
        s.accepted_copy,
        s.drafted_mtp,
        s.accepted_mtp,
        s.prefill_s,
        decode_tps
    )
}

/// Prompt ids for text, as the server makes them (chat: one user message in the chat template).
pub fn prompt_ids(tok: &Tokenizer, text: &str, chat: bool) -> anyhow::Result<Vec<u32>> {
    if chat {
        let t = tok.apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: text.to_string(),
            }],
            true,
        )?;
        Ok(tok.encode(&t, false)?)
    } else {
        Ok(tok.encode(text, true)?)
    }
}

/// `flashplan run`.
pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        (None, None) => anyhow::bail!("give --prompt TEXT or --prompt-file FILE"),
    };
    check_temperature(a.temperature)?;
    if a.seed.is_some() && a.temperature == 0.0 {
        eprintln!("note: --seed has no effect on greedy decoding (--temperature 0)");
    }
    let mut m = load(&a.model, a.chat)?;
    let prompt = prompt_ids(&m.tokenizer, &text, a.chat)?;
    let mut stop_token_ids = Vec::new();
    if a.chat {
        stop_token_ids.extend(m.tokenizer.token_id("<|im_end|>"));
    }
    let req = Request {
        sampling: SamplingParams {
            temperature: a.temperature,
            seed: a.seed.unwrap_or_else(|| prompt_seed(&prompt)),
            ..SamplingParams::greedy()
        },
        prompt,
        max_tokens: a.max_tokens,
        stop_token_ids,
        ignore_eos: false,
        draft: !a.no_draft,
    };
    let tok = m.tokenizer.clone();
    let mut ts = TextStream::new(a.stop.clone());
    let stopped = std::rc::Rc::new(std::cell::Cell::new(false));
    {
        let tok = tok.clone();
        let stops = a.stop.clone();
        let mut probe = TextStream::new(stops);
        // Stop strings end the reply at the completing token (the engine asks after every token).
        m.engine.on_token = Box::new(move |_, t| match probe.push(&tok, t) {
            Ok(d) if d.stopped => flashplan_runtime::engine::Control::Stop,
            _ => flashplan_runtime::engine::Control::Continue,
        });
    }
    let out = std::io::stdout();
    let g = generate(&mut m.engine, req, |t| {
        if stopped.get() {
            return;
        }
        if let Ok(d) = ts.push(&tok, t) {
            let mut o = out.lock();
            let _ = o.write_all(d.text.as_bytes());
            let _ = o.flush();
            if d.stopped {
                stopped.set(true);
            }
        }
    })?;
    let rest = ts.finish(&tok)?;
    println!("{rest}");
    eprintln!("{}", stats_line(&g));
    Ok(())
}
