//! Many streams share rounds without changing anyone's tokens (`rounds.md` section 5, contract 2; issue 6):
//! concurrent == solo with 1, 2, 4, 8 and 16 streams, streams joining and leaving mid-reply, greedy and seeded.

mod common;

use std::collections::HashMap;

use common::*;
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::engine::{Engine, EngineOptions, Event};

fn engine(parallel: u32) -> Engine<CpuBackend> {
    let dir = root().join("models/flashnext-tiny");
    let body = plan_for(&dir, &[1, 2, 4, 8, 16], 6, 32, 1024);
    Engine::new(
        backend(&dir, body),
        EngineOptions {
            max_depth: 6,
            parallel,
            ..Default::default()
        },
        true,
    )
}

/// Prompts of different lengths and kinds (some copy-friendly, some fresh), from the demo model's vocabulary.
fn prompts(n: usize) -> Vec<Vec<u32>> {
    let tok = tokenizers::Tokenizer::from_file(root().join("models/flashnext-tiny/tokenizer.json"))
        .expect("tokenizer");
    (0..n)
        .map(|i| {
            tok.encode(STREAM_TEXTS[i % STREAM_TEXTS.len()], false)
                .expect("encode")
                .get_ids()
                .to_vec()
        })
        .collect()
}

fn replies(events: Vec<Event>) -> HashMap<u64, Vec<u32>> {
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    for ev in events {
        match ev {
            Event::Token { stream, id } => out.entry(stream).or_default().push(id),
            Event::Failed { error, .. } => panic!("a stream failed: {error}"),
            _ => {}
        }
    }
    out
}

fn solo_replies(ps: &[Vec<u32>], sampled: bool) -> Vec<Vec<u32>> {
    let mut e = engine(1);
    ps.iter()
        .enumerate()
        .map(|(i, p)| {
            let id = e.submit(stream_request(p, i, sampled)).expect("submit");
            replies(e.run_to_completion())
                .remove(&id)
                .unwrap_or_default()
        })
        .collect()
}

#[test]
fn concurrent_equals_solo() {
    for sampled in [false, true] {
        let ps = prompts(16);
        let solo = solo_replies(&ps, sampled);
        for n in [2usize, 4, 8, 16] {
            let mut e = engine(n as u32);
            let ids: Vec<u64> = (0..n)
                .map(|i| {
                    e.submit(stream_request(&ps[i], i, sampled))
                        .expect("submit")
                })
                .collect();
            let got = replies(e.run_to_completion());
            for (i, id) in ids.iter().enumerate() {
                assert_eq!(
                    got.get(id),
                    Some(&solo[i]),
                    "sampled={sampled}: stream {i} of {n} differs from its solo run"
                );
            }
        }
    }
}

#[test]
fn streams_joining_and_leaving_mid_reply() {
    let ps = prompts(12);
    let solo = solo_replies(&ps, false);
    let mut e = engine(4);
    let mut ids = Vec::new();
    let mut events = Vec::new();
    let mut next = 0;
    // Submit a new request every few steps while others decode: fewer slots than requests, so streams also
    // wait in the queue and join as others leave.
    for step in 0.. {
        if next < ps.len() && step % 3 == 0 {
            ids.push(
                e.submit(stream_request(&ps[next], next, false))
                    .expect("submit"),
            );
            next += 1;
        }
        events.extend(e.step());
        if next == ps.len() && e.busy() == 0 {
            break;
        }
    }
    let got = replies(events);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            got.get(id),
            Some(&solo[i]),
            "stream {i} differs from its solo run"
        );
    }
}

#[test]
fn cancelled_stream_frees_its_slot_without_disturbing_others() {
    let ps = prompts(3);
    let solo = solo_replies(&ps, false);
    let mut e = engine(2);
    let a = e.submit(stream_request(&ps[0], 0, false)).expect("submit");
    let b = e.submit(stream_request(&ps[1], 1, false)).expect("submit");
    let mut events = e.step();
    events.extend(e.step());
    e.cancel(b);
    let c = e.submit(stream_request(&ps[2], 2, false)).expect("submit");
    events.extend(e.run_to_completion());
    let got = replies(events);
    assert_eq!(got.get(&a), Some(&solo[0]));
    assert_eq!(got.get(&c), Some(&solo[2]));
}
