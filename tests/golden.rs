//! The CPU backend equals transformers 5.23.0 (run in f32 by `scripts/fixtures/make_fixtures.py`) on the fixtures:
//! prefill logits, 32 greedy steps one token at a time, and the MTP drafter against the reference module written
//! from `flash-next.md` section 9. Tolerance: max |diff| <= 1e-4 x max |logit| per row (issue 3).

mod common;

use common::*;
use flashplan_plan::{IoBuf, RoundDesc, VariantKind};
use flashplan_runtime::backend::Backend;

const TOL: f32 = 1e-4;

fn desc1(pos: u32, rows: u32, window: u32, tokens: &[u32]) -> RoundDesc {
    RoundDesc::single(pos, rows, tokens, window)
}

fn check_rows(what: &str, got: &[f32], want: &[f32], v: usize) {
    for (r, (g, w)) in got.chunks(v).zip(want.chunks(v)).enumerate() {
        let (d, m) = row_diff(g, w);
        assert!(
            d <= TOL * m,
            "{what} row {r}: max |diff| {d} > {TOL} x max |logit| {m}"
        );
    }
}

fn golden(name: &str, dir: &std::path::Path, expected: &std::path::Path) {
    let chunk = 16;
    let body = plan_for(dir, &[1], 3, chunk, 512);
    let vocab = body.config.vocab_size as usize;
    let mut be = backend(dir, body);
    let exp = Expected::open(expected);
    let prompt = exp.ids("prompt_ids");
    let (shape, prefill) = exp.f32("prefill_logits");
    let n = prompt.len();
    // The expectation may keep only the last rows (the demo model's file, to keep the repository small).
    let first = n - shape[0];
    // Prefill in chunks, comparing the logits of every row the expectation holds.
    let mut pos = 0;
    while pos < n {
        let rows = (n - pos).min(chunk as usize);
        be.run(
            VariantKind::Prefill { chunk },
            &desc1(pos as u32, rows as u32, chunk, &prompt[pos..pos + rows]),
        )
        .unwrap();
        for r in (pos..pos + rows).filter(|&r| r >= first) {
            check_rows(
                &format!("{name} prefill row {r}"),
                &be.io(IoBuf::Logits)[(r - pos) * vocab..(r - pos + 1) * vocab],
                &prefill[(r - first) * vocab..(r - first + 1) * vocab],
                vocab,
            );
        }
        pos += rows;
    }
    // Greedy one token at a time.
    let want_ids = exp.ids("greedy_ids");
    let (_, want_logits) = exp.f32("greedy_logits");
    let mut tok = argmax(&prefill[(n - 1 - first) * vocab..(n - first) * vocab]);
    assert_eq!(tok, want_ids[0], "{name}: first greedy token");
    for t in 1..want_ids.len() {
        let p = (n + t - 1) as u32;
        be.run(
            VariantKind::Verify {
                streams: 1,
                window: 1,
            },
            &desc1(p, 1, 1, &[tok]),
        )
        .unwrap();
        let logits = &be.io(IoBuf::Logits)[..vocab];
        check_rows(
            &format!("{name} greedy step {t}"),
            logits,
            &want_logits[t * vocab..(t + 1) * vocab],
            vocab,
        );
        tok = be.io(IoBuf::Sampled)[0].to_bits();
        assert_eq!(tok, want_ids[t], "{name}: greedy token {t}");
    }
}

fn golden_mtp(name: &str, dir: &std::path::Path, expected: &std::path::Path) {
    let body = plan_for(dir, &[1], 3, 16, 512);
    let vocab = body.config.vocab_size as usize;
    let hcw = body.config.hc_width() as usize;
    let mut be = backend(dir, body);
    let exp = Expected::open(expected);
    let (_, streams) = exp.f32("mtp_streams");
    let tokens = exp.ids("mtp_tokens");
    let (shape, logits) = exp.f32("mtp_logits");
    let (_, out_streams) = exp.f32("mtp_out_streams");
    // Entries before `first` are absorbed (their caches matter) but have no expectation stored.
    let first = tokens.len() - shape[0];
    for i in 0..tokens.len() {
        be.write_io(IoBuf::MainStreams, 0, &streams[i * hcw..(i + 1) * hcw]);
        be.run(
            VariantKind::MtpAbsorb {
                streams: 1,
                window: 1,
                form: flashplan_plan::DrafterForm::Checkpoint,
            },
            &desc1(i as u32, 1, 1, &[tokens[i]]),
        )
        .unwrap();
        if i < first {
            continue;
        }
        let j = i - first;
        check_rows(
            &format!("{name} mtp entry {i}"),
            &be.io(IoBuf::Logits)[..vocab],
            &logits[j * vocab..(j + 1) * vocab],
            vocab,
        );
        let (d, m) = row_diff(
            &be.io(IoBuf::MtpStreams)[..hcw],
            &out_streams[j * hcw..(j + 1) * hcw],
        );
        assert!(d <= TOL * m.max(1.0), "{name} mtp streams {i}: {d} vs {m}");
    }
}

#[test]
fn tiny_text_matches_transformers() {
    golden(
        "tiny-text",
        &fixture("tiny-text"),
        &fixture("tiny-text").join("expected.safetensors"),
    );
}

#[test]
fn tiny_wrapper_matches_transformers() {
    golden(
        "tiny-wrapper",
        &fixture("tiny-wrapper"),
        &fixture("tiny-wrapper").join("expected.safetensors"),
    );
}

#[test]
fn tiny_text_mtp_matches_reference() {
    golden_mtp(
        "tiny-text",
        &fixture("tiny-text"),
        &fixture("tiny-text").join("expected.safetensors"),
    );
}

#[test]
fn tiny_wrapper_mtp_matches_reference() {
    golden_mtp(
        "tiny-wrapper",
        &fixture("tiny-wrapper"),
        &fixture("tiny-wrapper").join("expected.safetensors"),
    );
}

#[test]
fn flashnext_tiny_matches_transformers() {
    let dir = root().join("models/flashnext-tiny");
    golden(
        "flashnext-tiny",
        &dir,
        &root().join("fixtures/flashnext-tiny-expected.safetensors"),
    );
    golden_mtp(
        "flashnext-tiny",
        &dir,
        &root().join("fixtures/flashnext-tiny-expected.safetensors"),
    );
}
