//! Backend-level exactness (`rounds.md` sections 3, 5 and 6) on the CPU backend with the tiny-wrapper fixture
//! (QSA budget 16, so block selection selects; PLE with an eos in the prompt; YaRN):
//! row invariance across window widths, the state commit after a rejection at every draft position (GDN state bit
//! for bit, conv windows, PLE history and tail, caches and pooled blocks), windows crossing a QSA block boundary,
//! and chunked prefill against one-piece prefill around the chunk size.

mod common;

use common::*;
use flashplan_plan::{IoBuf, PlanBody, RoundDesc, StateKind, StreamDesc, VariantKind};
use flashplan_runtime::backend::Backend;
use flashplan_runtime::cpu::CpuBackend;

const DEPTH: u32 = 15;

fn setup(chunk: u32) -> (CpuBackend, Vec<u32>) {
    let dir = fixture("tiny-wrapper");
    let body = plan_for(&dir, &[1, 2], DEPTH, chunk, 256);
    let exp = Expected::open(&dir.join("expected.safetensors"));
    (backend(&dir, body), exp.ids("prompt_ids"))
}

fn sd(pos: u32, rows: u32) -> StreamDesc {
    StreamDesc::greedy_at(0, pos, rows)
}

/// Prefills `prompt` in chunks of the plan's chunk size; returns the first sampled token.
fn prefill(be: &mut CpuBackend, prompt: &[u32]) -> u32 {
    be.reset_slot(0);
    let chunk = be.body().options.prefill_chunk;
    let mut pos = 0;
    while pos < prompt.len() {
        let rows = (prompt.len() - pos).min(chunk as usize);
        let mut t = prompt[pos..pos + rows].to_vec();
        t.resize(chunk as usize, 0);
        be.run(
            VariantKind::Prefill { chunk },
            &RoundDesc {
                streams: vec![sd(pos as u32, rows as u32)],
                tokens: t,
            },
        )
        .unwrap();
        pos += rows;
    }
    be.io(IoBuf::Sampled)[0].to_bits()
}

/// Runs a lone window; returns (sampled tokens, keep, logits of every row).
fn window(be: &mut CpuBackend, pos: u32, tokens: &[u32]) -> (Vec<u32>, u32, Vec<f32>) {
    let w = tokens.len() as u32;
    let vocab = be.body().config.vocab_size as usize;
    be.run(
        VariantKind::Lone { window: w },
        &RoundDesc {
            streams: vec![sd(pos, w)],
            tokens: tokens.to_vec(),
        },
    )
    .unwrap();
    let sampled = be.io(IoBuf::Sampled)[..w as usize]
        .iter()
        .map(|x| x.to_bits())
        .collect();
    (
        sampled,
        be.io(IoBuf::Keep)[0].to_bits(),
        be.io(IoBuf::Logits)[..w as usize * vocab].to_vec(),
    )
}

/// The committed part of slot 0's state at `pos` committed positions, piece by piece (bits).
fn committed(be: &CpuBackend, pos: u32) -> Vec<(String, Vec<u32>)> {
    let body: &PlanBody = be.body();
    let st = be.slot_state(0);
    let ratio = body.config.indexer_compress_ratio as u64;
    body.state
        .pieces
        .iter()
        .filter(|p| !p.name.starts_with("mtp."))
        .map(|p| {
            let len = match p.kind {
                StateKind::KCache | StateKind::VCache | StateKind::IndexerRawKeys => {
                    p.elems() / p.shape[0] * pos as u64
                }
                StateKind::IndexerPooled => p.elems() / p.shape[0] * (pos as u64 / ratio),
                _ => p.elems(),
            };
            (
                p.name.clone(),
                st[p.offset as usize..(p.offset + len) as usize]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            )
        })
        .collect()
}

/// Plain decoding: the greedy tokens after the prompt, the state at every committed position and each step's
/// logits.
struct Plain {
    tokens: Vec<u32>,
    states: Vec<Vec<(String, Vec<u32>)>>,
    logits: Vec<Vec<f32>>,
}

fn plain(be: &mut CpuBackend, prompt: &[u32], steps: usize) -> Plain {
    let mut tok = prefill(be, prompt);
    let n = prompt.len() as u32;
    let mut out = Plain {
        tokens: vec![tok],
        states: vec![committed(be, n)],
        logits: vec![],
    };
    for i in 0..steps {
        let (s, keep, logits) = window(be, n + i as u32, &[tok]);
        assert_eq!(keep, 1);
        tok = s[0];
        out.tokens.push(tok);
        out.states.push(committed(be, n + i as u32 + 1));
        out.logits.push(logits);
    }
    out
}

fn assert_same_state(got: &[(String, Vec<u32>)], want: &[(String, Vec<u32>)], what: &str) {
    for ((name, g), (_, w)) in got.iter().zip(want) {
        assert!(g == w, "{what}: state {name} differs from plain decoding");
    }
}

#[test]
fn rows_are_bit_identical_across_window_widths() {
    let (mut be, prompt) = setup(16);
    let steps = DEPTH as usize + 1;
    let p = plain(&mut be, &prompt, steps);
    let vocab = be.body().config.vocab_size as usize;
    let n = prompt.len() as u32;
    for w in [2usize, 5, 16] {
        prefill(&mut be, &prompt);
        let (_, keep, logits) = window(&mut be, n, &p.tokens[..w]);
        assert_eq!(
            keep as usize, w,
            "window {w}: every draft is the greedy token, so all are kept"
        );
        for r in 0..w {
            let row: Vec<u32> = logits[r * vocab..(r + 1) * vocab]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let want: Vec<u32> = p.logits[r].iter().map(|x| x.to_bits()).collect();
            assert!(
                row == want,
                "window {w} row {r}: logits not bit-identical to the one-row run"
            );
        }
    }
}

#[test]
fn rows_are_bit_identical_across_stream_counts() {
    let (mut be, prompt) = setup(16);
    let p = plain(&mut be, &prompt, 4);
    let vocab = be.body().config.vocab_size as usize;
    let n = prompt.len() as u32;
    prefill(&mut be, &prompt);
    // The same window as stream 0 of a two-stream variant, stream 1 padding.
    let w = 4u32;
    let mut tokens = p.tokens[..w as usize].to_vec();
    tokens.resize(2 * w as usize, 0);
    let desc = RoundDesc {
        streams: vec![
            sd(n, w),
            StreamDesc {
                rows: 0,
                ..sd(0, 0)
            },
        ],
        tokens,
    };
    be.run(
        VariantKind::Verify {
            streams: 2,
            window: w,
        },
        &desc,
    )
    .unwrap();
    for r in 0..w as usize {
        let got: Vec<u32> = be.io(IoBuf::Logits)[r * vocab..(r + 1) * vocab]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let want: Vec<u32> = p.logits[r].iter().map(|x| x.to_bits()).collect();
        assert!(
            got == want,
            "row {r} differs between the lone and the two-stream variant"
        );
    }
}

#[test]
fn rejection_at_every_draft_position_commits_exactly_keep_rows() {
    let (mut be, prompt) = setup(16);
    let k = 6usize;
    let p = plain(&mut be, &prompt, k + 2);
    let n = prompt.len() as u32;
    let vocab = be.body().config.vocab_size;
    for reject in 0..=k {
        prefill(&mut be, &prompt);
        // Drafts d1..dk: the first `reject` are the greedy tokens, the next one is wrong.
        let mut tokens = vec![p.tokens[0]];
        for i in 1..=k {
            let good = p.tokens[i];
            tokens.push(if i <= reject {
                good
            } else {
                (good + 1) % vocab
            });
        }
        let (sampled, keep, _) = window(&mut be, n, &tokens);
        assert_eq!(keep as usize, reject + 1, "reject at {reject}");
        assert_eq!(&sampled[..keep as usize], &p.tokens[1..=keep as usize]);
        assert_same_state(
            &committed(&be, n + keep),
            &p.states[keep as usize],
            &format!("reject at {reject}"),
        );
        // A round with no drafts right after: still plain decoding's state.
        let (s2, keep2, _) = window(&mut be, n + keep, &[sampled[keep as usize - 1]]);
        assert_eq!(keep2, 1);
        assert_eq!(s2[0], p.tokens[keep as usize + 1]);
        assert_same_state(
            &committed(&be, n + keep + 1),
            &p.states[keep as usize + 1],
            &format!("plain round after {reject}"),
        );
    }
}

#[test]
fn window_crossing_a_qsa_block_boundary_matches_plain() {
    let (mut be, prompt) = setup(16);
    let ratio = be.body().config.indexer_compress_ratio as usize;
    // Cut the prompt so the window starts one token before a block boundary and spans two more blocks.
    for cut in [prompt.len() - 3, prompt.len() - 2] {
        let pr = &prompt[..cut];
        let n = cut as u32;
        let k = 2 * ratio + 1;
        let p = plain(&mut be, pr, k + 1);
        prefill(&mut be, pr);
        let (_, keep, _) = window(&mut be, n, &p.tokens[..k + 1]);
        assert_eq!(keep as usize, k + 1);
        assert_same_state(
            &committed(&be, n + keep),
            &p.states[keep as usize],
            &format!("cut {cut}"),
        );
    }
}

#[test]
fn chunked_prefill_matches_one_piece_around_the_chunk_size() {
    let c = 16usize;
    let (mut chunked, prompt) = setup(c as u32);
    let (mut whole, _) = setup(64);
    let vocab = chunked.body().config.vocab_size as usize;
    for len in [c - 1, c, c + 1, 2 * c + 1] {
        let pr = &prompt[..len];
        let a = prefill(&mut chunked, pr);
        let la = chunked.io(IoBuf::Logits)[((len - 1) % c) * vocab..((len - 1) % c + 1) * vocab]
            .to_vec();
        let b = prefill(&mut whole, pr);
        let lb = whole.io(IoBuf::Logits)[(len - 1) * vocab..len * vocab].to_vec();
        let (d, m) = row_diff(&la, &lb);
        assert!(
            d <= 1e-4 * m,
            "length {len}: chunked vs one-piece last-row logits differ by {d} (max {m})"
        );
        assert_eq!(a, b, "length {len}: first greedy token differs");
        // And the same greedy continuation.
        let pa = plain(&mut chunked, pr, 8).tokens;
        let pb = plain(&mut whole, pr, 8).tokens;
        assert_eq!(pa, pb, "length {len}: greedy tokens differ");
    }
}
