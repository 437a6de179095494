//! Speculative rounds keep every reply equal to plain one-token decoding (`rounds.md` sections 5 and 6), on the CPU
//! backend: drafted == `"draft": false` (greedy and seeded sampled), the cases that broke other engines, and the
//! committed state at equal positions.

mod common;

use common::*;
use flashplan_plan::{SamplingParams, StateKind};
use flashplan_runtime::backend::Backend;
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::engine::{Engine, EngineOptions, Event, FinishReason, ReplyStats, Request};

fn tiny_engine(streams: &[u32], max_depth: u32) -> Engine<CpuBackend> {
    let dir = root().join("models/flashnext-tiny");
    let body = plan_for(&dir, streams, max_depth, 32, 1024);
    let be = backend(&dir, body);
    let opts = EngineOptions {
        max_depth,
        parallel: *streams.iter().max().unwrap_or(&1),
        ..Default::default()
    };
    Engine::new(be, opts, true)
}

fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(root().join("models/flashnext-tiny/tokenizer.json"))
        .expect("tokenizer")
}

fn encode(text: &str) -> Vec<u32> {
    tokenizer()
        .encode(text, false)
        .expect("encode")
        .get_ids()
        .to_vec()
}

/// Runs one request alone; returns its tokens, finish reason and stats.
fn solo(e: &mut Engine<CpuBackend>, r: Request) -> (Vec<u32>, FinishReason, ReplyStats) {
    let id = e.submit(r).expect("submit");
    collect(e.run_to_completion(), id)
}

fn collect(events: Vec<Event>, id: u64) -> (Vec<u32>, FinishReason, ReplyStats) {
    let mut toks = Vec::new();
    for ev in events {
        match ev {
            Event::Token { stream, id: t } if stream == id => toks.push(t),
            Event::Finished {
                stream,
                reason,
                stats,
            } if stream == id => {
                check_accounting(&stats, toks.len());
                return (toks, reason, stats);
            }
            Event::Failed { stream, error } if stream == id => panic!("stream failed: {error}"),
            _ => {}
        }
    }
    panic!("stream {id} did not finish");
}

/// A reply's statistics count only what is in the reply: the prefill gives the first token and each round the
/// tokens it kept up to the reply's end, so the drafted rounds' tokens and their accepted drafts never exceed the
/// reply, and accepted drafts plus rounds are the tokens after the first, plus one where the last round's bonus
/// token fell after the end.
fn check_accounting(s: &ReplyStats, tokens: usize) {
    let tokens = tokens as u32;
    assert_eq!(s.tokens, tokens, "{s:?}");
    let after_first = tokens.saturating_sub(1);
    assert!(
        s.copy_round_tokens + s.mtp_round_tokens <= after_first,
        "{s:?}"
    );
    assert!(s.accepted_copy <= s.copy_round_tokens, "{s:?}");
    assert!(s.accepted_mtp <= s.mtp_round_tokens, "{s:?}");
    assert!(
        s.accepted_copy <= s.drafted_copy && s.accepted_mtp <= s.drafted_mtp,
        "{s:?}"
    );
    let counted = s.accepted_copy + s.accepted_mtp + s.rounds;
    assert!(
        counted == after_first || counted == tokens,
        "accepted drafts + rounds = {counted} for {tokens} tokens: {s:?}"
    );
}

const SNIPPETS: &[&str] = &[
    "def moving_average(values, window):\n    \"\"\"Return the moving average of values.\"\"\"\n    result = []\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "for i in range(10):\n    print(i)\n",
];

fn copy_prompt() -> Vec<u32> {
    let passage = encode(
        "def load_file(path, mode=\"rb\"):\n    with open(path, mode) as handle:\n        data = handle.read()\n    \
         if not data:\n        raise ValueError(\"empty file: \" + path)\n    return data\n",
    );
    let mut p = passage.clone();
    p.extend(encode("\n\n# The same again:\n"));
    p.extend(&passage[..20.min(passage.len())]);
    p
}

#[test]
fn drafted_equals_plain_greedy() {
    let mut e = tiny_engine(&[1], 15);
    let mut drafted_any = 0;
    let mut prompts: Vec<Vec<u32>> = SNIPPETS.iter().map(|s| encode(s)).collect();
    prompts.push(copy_prompt());
    for p in &prompts {
        let (plain, _, _) = solo(&mut e, req(p, 40, false, SamplingParams::greedy()));
        let (drafted, _, stats) = solo(&mut e, req(p, 40, true, SamplingParams::greedy()));
        assert_eq!(
            drafted, plain,
            "drafted reply differs from plain for prompt {p:?}"
        );
        drafted_any += stats.drafted_copy + stats.drafted_mtp;
    }
    assert!(
        drafted_any > 0,
        "no drafts were made: the test would prove nothing"
    );
}

#[test]
fn drafted_equals_plain_at_every_depth() {
    let p = copy_prompt();
    let mut plain_e = tiny_engine(&[1], 0);
    let (plain, _, _) = solo(&mut plain_e, req(&p, 32, false, SamplingParams::greedy()));
    for depth in [1, 2, 3, 5, 8] {
        let mut e = tiny_engine(&[1], depth);
        let (drafted, _, stats) = solo(&mut e, req(&p, 32, true, SamplingParams::greedy()));
        assert_eq!(drafted, plain, "depth {depth}");
        assert!(
            stats.drafted_copy + stats.drafted_mtp > 0,
            "depth {depth}: nothing drafted"
        );
    }
}

#[test]
fn seeded_sampling_equals_plain_and_repeats() {
    let mut e = tiny_engine(&[1], 15);
    let p = encode(SNIPPETS[0]);
    for (t, top_p) in [(2.0, 1.0), (0.8, 0.9)] {
        let s = SamplingParams {
            temperature: t,
            top_k: 0,
            top_p,
            min_p: 0.0,
            seed: 42,
        };
        let (a, _, _) = solo(&mut e, req(&p, 24, false, s));
        let (b, _, _) = solo(&mut e, req(&p, 24, true, s));
        let (c, _, _) = solo(&mut e, req(&p, 24, true, s));
        assert_eq!(a, b, "T={t}: drafted differs from plain");
        assert_eq!(b, c, "T={t}: not repeatable");
    }
}

#[test]
fn repeated_word_prompt_copies_every_round() {
    let mut e = tiny_engine(&[1], 15);
    let word = encode(" hello");
    let p: Vec<u32> = (0..48).flat_map(|_| word.clone()).collect();
    let (plain, _, _) = solo(&mut e, req(&p, 32, false, SamplingParams::greedy()));
    let (drafted, _, stats) = solo(&mut e, req(&p, 32, true, SamplingParams::greedy()));
    assert_eq!(drafted, plain);
    assert!(
        stats.copy_rounds > 0,
        "the copy index never fired: {stats:?}"
    );
}

#[test]
fn max_tokens_is_never_exceeded() {
    let p = copy_prompt();
    let mut e = tiny_engine(&[1], 4);
    let (full, _, _) = solo(&mut e, req(&p, 16, false, SamplingParams::greedy()));
    for m in 1..=6 {
        let (toks, reason, _) = solo(&mut e, req(&p, m, true, SamplingParams::greedy()));
        assert_eq!(toks.len(), (m as usize).min(full.len()), "max_tokens {m}");
        assert_eq!(&toks[..], &full[..toks.len()]);
        if toks.len() == m as usize && !full[..toks.len()].contains(&0) {
            assert_eq!(reason, FinishReason::Length);
        }
    }
}

#[test]
fn eos_drafted_at_each_position_stops_there() {
    // Run greedy once, then declare each produced token in turn to be a stop token: nothing after it is emitted.
    let p = copy_prompt();
    let mut e = tiny_engine(&[1], 8);
    let (full, _, _) = solo(&mut e, req(&p, 24, false, SamplingParams::greedy()));
    for cut in 0..full.len().min(10) {
        let stop = full[cut];
        let first = full.iter().position(|&t| t == stop).unwrap_or(cut);
        let mut r = req(&p, 24, true, SamplingParams::greedy());
        r.stop_token_ids = vec![stop];
        let (toks, reason, _) = solo(&mut e, r);
        assert_eq!(toks, full[..=first].to_vec(), "stop token at {cut}");
        assert_eq!(reason, FinishReason::Stop);
    }
}

#[test]
fn fixtures_greedy_with_drafts_equals_transformers() {
    for name in ["tiny-text", "tiny-wrapper"] {
        let dir = fixture(name);
        let exp = Expected::open(&dir.join("expected.safetensors"));
        let prompt = exp.ids("prompt_ids");
        let want = exp.ids("greedy_ids");
        for depth in [0, 3, 15] {
            let body = plan_for(&dir, &[1], depth.max(1), 16, 256);
            let mut e = Engine::new(
                backend(&dir, body),
                EngineOptions {
                    max_depth: depth,
                    ..Default::default()
                },
                true,
            );
            let mut r = req(
                &prompt,
                want.len() as u32,
                depth > 0,
                SamplingParams::greedy(),
            );
            r.ignore_eos = true;
            let (toks, _, _) = solo(&mut e, r);
            assert_eq!(
                toks, want,
                "{name} depth {depth}: tokens differ from transformers' greedy decode"
            );
        }
    }
}

/// Slot state pieces that must match plain decoding at equal committed positions: the GDN state bit for bit, conv
/// windows, PLE history and tail, and every cache up to the committed length.
fn state_at(e: &Engine<CpuBackend>, slot: u32, pos: u32) -> PieceBits {
    let body = e.backend().body();
    let st = e.backend().slot_state(slot);
    body.state
        .pieces
        .iter()
        .filter(|p| !p.name.starts_with("mtp."))
        .map(|p| {
            let per_pos = match p.kind {
                StateKind::KCache | StateKind::VCache | StateKind::IndexerRawKeys => {
                    Some(p.elems() / p.shape[0])
                }
                StateKind::IndexerPooled => None,
                _ => None,
            };
            let len = match (p.kind, per_pos) {
                (_, Some(w)) => w * pos as u64,
                (StateKind::IndexerPooled, _) => {
                    (pos / body.config.indexer_compress_ratio) as u64
                        * body.config.indexer_head_dim as u64
                }
                _ => p.elems(),
            };
            let data = st[p.offset as usize..(p.offset + len) as usize]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            (p.name.clone(), data)
        })
        .collect()
}

/// Slot state pieces by name, as bits.
type PieceBits = Vec<(String, Vec<u32>)>;

fn states_by_position(
    mut e: Engine<CpuBackend>,
    r: Request,
) -> (Vec<(u32, PieceBits)>, ReplyStats) {
    let id = e.submit(r).expect("submit");
    let mut out = Vec::new();
    let mut stats = None;
    while e.busy() > 0 {
        for ev in e.step() {
            if let Event::Finished {
                stream, stats: s, ..
            } = ev
            {
                if stream == id {
                    stats = Some(s);
                }
            }
        }
        for (sid, slot, pos) in e.positions() {
            if sid == id {
                out.push((pos, state_at(&e, slot, pos)));
            }
        }
    }
    (out, stats.expect("finished"))
}

#[test]
fn committed_state_equals_plain_decoding() {
    let p = copy_prompt();
    let plain = states_by_position(
        tiny_engine(&[1], 8),
        req(&p, 40, false, SamplingParams::greedy()),
    )
    .0;
    for (copy, mtp) in [(true, false), (false, true)] {
        let opts = EngineOptions {
            copy_drafts: copy,
            mtp_drafts: mtp,
            max_depth: 8,
            ..Default::default()
        };
        let dir = root().join("models/flashnext-tiny");
        let e = Engine::new(backend(&dir, plan_for(&dir, &[1], 8, 32, 1024)), opts, true);
        let (drafted, stats) = states_by_position(e, req(&p, 40, true, SamplingParams::greedy()));
        let drafts = if copy {
            stats.drafted_copy
        } else {
            stats.drafted_mtp
        };
        assert!(drafts > 0, "copy={copy} mtp={mtp}: nothing drafted");
        let mut compared = 0;
        for (pos, st) in &drafted {
            if let Some((_, want)) = plain.iter().find(|(pp, _)| pp == pos) {
                for ((name, got), (_, w)) in st.iter().zip(want) {
                    assert!(
                        got == w,
                        "copy={copy} mtp={mtp}: state {name} differs at position {pos}"
                    );
                }
                compared += 1;
            }
        }
        assert!(compared >= 3, "too few common positions ({compared})");
    }
}

#[test]
fn a_request_for_no_tokens_or_past_the_context_is_refused_with_the_room_left() {
    use flashplan_runtime::engine::EngineError;
    // Context 1024, max depth 15: a prompt of p tokens leaves 1024 - p - 16 reply tokens.
    let p = copy_prompt();
    let mut e = tiny_engine(&[1], 15);
    assert!(matches!(
        e.submit(req(&p, 0, true, SamplingParams::greedy())),
        Err(EngineError::NoReplyTokens)
    ));
    let room = 1024 - p.len() as u32 - 16;
    let err = e
        .submit(req(&p, room + 1, true, SamplingParams::greedy()))
        .expect_err("one token past the room");
    assert!(
        err.to_string()
            .contains(&format!("at most {room} reply tokens fit")),
        "{err}"
    );
    // And the most a request may use, prompt and reply together (the server's max_model_len).
    assert!(
        err.to_string()
            .contains("is over the 1008 tokens a request may use"),
        "{err}"
    );
    assert!(e
        .submit(req(&p, room, true, SamplingParams::greedy()))
        .is_ok());
    // One reply token of room: the singular.
    let long: Vec<u32> = p.iter().copied().cycle().take(1007).collect();
    let err = e
        .submit(req(&long, 2, true, SamplingParams::greedy()))
        .expect_err("two tokens past a room of one");
    assert!(
        err.to_string()
            .ends_with("at most 1 reply token fits after this prompt"),
        "{err}"
    );
    // A prompt that leaves no room for one reply token is called too long.
    let err = e
        .submit(req(
            &[long.as_slice(), &p[..1]].concat(),
            1,
            true,
            SamplingParams::greedy(),
        ))
        .expect_err("a prompt of the whole limit");
    assert!(
        err.to_string().starts_with(
            "the prompt is too long: 1008 tokens, where a request may use at most 1008 (the context of 1024 tokens"
        ),
        "{err}"
    );
}

#[test]
fn stop_inside_a_long_accepted_run_cuts_there() {
    // A stop string completed by an early token of a round that accepts many copied drafts: the reply, its token
    // list and its token count end at that token (the service turns stop strings into this callback).
    let p = copy_prompt();
    let mut e = tiny_engine(&[1], 15);
    let (full, _, _) = solo(&mut e, req(&p, 40, false, SamplingParams::greedy()));
    for cut in [1usize, 2, 3, 6] {
        let mut e = tiny_engine(&[1], 15);
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c2 = count.clone();
        e.on_token = Box::new(move |_, _| {
            let n = c2.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if n == cut {
                flashplan_runtime::engine::Control::Stop
            } else {
                flashplan_runtime::engine::Control::Continue
            }
        });
        let (toks, reason, stats) = solo(&mut e, req(&p, 40, true, SamplingParams::greedy()));
        assert_eq!(toks, full[..cut].to_vec(), "cut at {cut}");
        assert_eq!(stats.tokens as usize, cut);
        assert_eq!(reason, FinishReason::Stop);
        if cut >= 2 {
            // One copy round kept past the cut; only the tokens up to it count.
            assert_eq!(
                stats.rounds, 1,
                "the cut fell inside a drafted round: {stats:?}"
            );
            assert_eq!(stats.copy_round_tokens as usize, cut - 1, "{stats:?}");
        }
    }
}
