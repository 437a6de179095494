//! The MXFP8 drafter (issue 8): re-coding is exact to its definition (checked against an independent slow
//! reference on random and adversarial groups and on the real drafter's tensors), and replies with
//! `FLASHPLAN_MTP_WEIGHTS=mxfp8` and `mxfp8-head` equal replies with `checkpoint` and with `"draft": false`
//! (greedy and seeded sampled) on `models/flashnext-tiny`, on the CPU backend.

mod common;

use std::sync::Arc;

use common::*;
use flashplan_plan::{DrafterForm, PlanBody, SamplingParams, WeightGroup};
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::engine::{Engine, EngineOptions, Event, ReplyStats, Request};
use flashplan_runtime::mxfp8::{self, derive_drafter_weights};

// ---------------------------------------------------------------------------------------------------------------
// The independent reference.

/// Every finite E4M3 (OCP FN: bias 7, no infinities, 0x7F/0xFF NaN) value with its code, decoded here from the bit
/// fields (not with the crate's decoder).
fn e4m3_table() -> Vec<(u8, f64)> {
    let mut out = Vec::new();
    for c in 0..=255u8 {
        let (s, e, m) = (c >> 7, (c >> 3) & 15, c & 7);
        if e == 15 && m == 7 {
            continue;
        }
        let mag = if e == 0 {
            m as f64 / 8.0 * 2f64.powi(-6)
        } else {
            (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
        };
        out.push((c, if s == 1 { -mag } else { mag }));
    }
    out
}

/// The nearest E4M3 value to `x` by search over all codes, ties to the even mantissa (code bit 0 clear).
fn rne(table: &[(u8, f64)], x: f64) -> f64 {
    let mut best = table[0];
    for &(c, v) in table {
        let (d, bd) = ((v - x).abs(), (best.1 - x).abs());
        if d < bd || (d == bd && c & 1 == 0 && best.0 & 1 == 1) {
            best = (c, v);
        }
    }
    best.1
}

/// The reference re-coding of one group: e = the smallest integer in [-127, 127] with max|w| <= 448 * 2^e (linear
/// search), values = RNE E4M3 of w / 2^e, times 2^e; an all-zero group stays zero.
fn reference_group(table: &[(u8, f64)], w: &[f32]) -> (i32, Vec<f64>) {
    let a = w.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    if a == 0.0 {
        return (0, vec![0.0; w.len()]);
    }
    let e = (-127..=127)
        .find(|&e| a <= 448.0 * 2f64.powi(e))
        .unwrap_or(127);
    let p = 2f64.powi(e);
    (e, w.iter().map(|&x| rne(table, x as f64 / p) * p).collect())
}

/// Re-codes `[rows, cols]` with the crate and checks every value and every scale against the reference.
fn check_matrix(table: &[(u8, f64)], w: &[f32], rows: usize, cols: usize, what: &str) {
    let m = mxfp8::quantize(w, rows, cols);
    let got = mxfp8::dequantize(&m);
    let gpr = cols.div_ceil(32);
    assert_eq!(m.scales.len(), rows * gpr, "{what}: scales");
    for r in 0..rows {
        for g in 0..gpr {
            let lo = r * cols + g * 32;
            let hi = r * cols + ((g + 1) * 32).min(cols);
            let (e, want) = reference_group(table, &w[lo..hi]);
            assert_eq!(
                m.scales[r * gpr + g] as i32,
                e + 127,
                "{what}: scale of row {r} group {g}"
            );
            for (k, (&y, &x)) in got[lo..hi].iter().zip(&want).enumerate() {
                assert!(
                    y as f64 == x,
                    "{what}: row {r} group {g} index {k}: w = {:e} gave {y:e}, reference {x:e}",
                    w[lo + k]
                );
            }
            if w[lo..hi].iter().all(|&x| x == 0.0) {
                assert!(
                    m.codes[lo..hi].iter().all(|&c| c == 0),
                    "{what}: zero codes"
                );
            }
        }
    }
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

#[test]
fn recoding_is_exact_on_random_groups() {
    let table = e4m3_table();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for (i, exp) in [-130, -100, -20, -8, -3, 0, 5, 40, 100, 125]
        .into_iter()
        .enumerate()
    {
        let scale = 2f32.powi(exp.max(-126));
        let (rows, cols) = (3, [32, 64, 40, 7, 96][i % 5]);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.unit() * scale).collect();
        check_matrix(&table, &w, rows, cols, &format!("random 2^{exp}"));
    }
    // Random bit patterns: every binade, both signs, f32 subnormals.
    let w: Vec<f32> = (0..64 * 32)
        .map(|_| {
            let x = f32::from_bits(rng.next() as u32 & 0xFF7F_FFFF);
            if x.is_finite() {
                x
            } else {
                0.0
            }
        })
        .collect();
    check_matrix(&table, &w, 64, 32, "random bit patterns");
}

#[test]
fn recoding_is_exact_on_adversarial_groups() {
    let table = e4m3_table();
    // All zeros (and a zero group beside a non-zero one).
    check_matrix(&table, &[0.0; 64], 1, 64, "all zeros");
    let mut w = vec![0f32; 64];
    w[40] = -3.0;
    check_matrix(&table, &w, 1, 64, "zero group then non-zero group");
    // One large outlier with tiny neighbours: the neighbours fall into E4M3 subnormals or round to zero.
    for outlier in [448.0f32, 1000.0, 3.5e4, 1e30] {
        let mut w: Vec<f32> = (0..32).map(|i| outlier * 2f32.powi(-i - 5)).collect();
        w[7] = -outlier;
        // Exactly between the first two subnormal quanta of the group's scale: a tie that goes to 2 quanta.
        let (e, _) = reference_group(&table, &w);
        w[9] = (1.5 * 2f64.powi(-9 + e)) as f32;
        w[10] = -(2.5 * 2f64.powi(-9 + e)) as f32; // a tie that goes down to 2 quanta
        check_matrix(&table, &w, 1, 32, &format!("outlier {outlier}"));
        let m = mxfp8::quantize(&w, 1, 32);
        let d = mxfp8::dequantize(&m);
        let q = 2f64.powi(-9 + e);
        assert_eq!(
            (d[9] as f64, d[10] as f64),
            (2.0 * q, -2.0 * q),
            "outlier {outlier}: ties"
        );
        assert!(
            m.codes.iter().any(|&c| c & 0x78 == 0 && c & 7 != 0),
            "outlier {outlier}: no subnormal code was exercised"
        );
    }
    // Values exactly at E4M3 rounding boundaries (midpoints of adjacent representable values, both tie
    // directions), and just beside them, at several scales; the group's max pins e.
    let mut pos: Vec<f64> = table
        .iter()
        .map(|&(_, v)| v)
        .filter(|&v| v >= 0.0)
        .collect();
    pos.sort_by(f64::total_cmp);
    pos.dedup();
    let mids: Vec<f32> = pos
        .windows(2)
        .map(|p| ((p[0] + p[1]) / 2.0) as f32)
        .collect();
    for e in [-127, -10, 0, 3, 100] {
        let p = 2f32.powi(e);
        for chunk in mids.chunks(31) {
            for (sign, nudge) in [(1.0f32, 0i32), (-1.0, 0), (1.0, 1), (-1.0, -1)] {
                let mut w = vec![448.0 * p];
                w.extend(chunk.iter().map(|&m| {
                    let m = f32::from_bits((m.to_bits() as i32 + nudge) as u32);
                    sign * m * p
                }));
                check_matrix(&table, &w, 1, w.len(), &format!("midpoints at 2^{e}"));
            }
        }
    }
    // Ties go both ways: 1.0625 -> 1 (even), 1.1875 -> 1.25 (even), with e = 0 pinned by 448.
    let m = mxfp8::quantize(&[448.0, 1.0625, 1.1875, -1.0625, -1.1875], 1, 5);
    assert_eq!(mxfp8::dequantize(&m), vec![448.0, 1.0, 1.25, -1.0, -1.25]);
    // A group whose max is exactly a power of two times 448 (e is that power; 448 codes as 0x7E), and just above.
    for k in [-127, -60, -1, 0, 1, 60, 119] {
        let a = (448.0 * 2f64.powi(k)) as f32;
        let w = [a, -a / 3.0, a / 448.0, a * 2f32.powi(-12)];
        let m = mxfp8::quantize(&w, 1, 4);
        assert_eq!(m.scales[0] as i32 - 127, k, "max 448 * 2^{k}");
        assert_eq!(m.codes[0], 0x7E);
        check_matrix(&table, &w, 1, 4, &format!("max 448 * 2^{k}"));
        let above = f32::from_bits(a.to_bits() + 1);
        let m = mxfp8::quantize(&[above, -a], 1, 2);
        assert_eq!(
            m.scales[0] as i32 - 127,
            k + 1,
            "max just above 448 * 2^{k}"
        );
        check_matrix(
            &table,
            &[above, -a],
            1,
            2,
            &format!("just above 448 * 2^{k}"),
        );
    }
    // Negative values only.
    let w: Vec<f32> = (0..64).map(|i| -(i as f32 + 1.0) * 0.37).collect();
    check_matrix(&table, &w, 2, 32, "negative values");
    // Very small groups: e clamps at -127 (no overflow of w / 2^e).
    let w = [f32::MIN_POSITIVE * 1e-3, -f32::MIN_POSITIVE * 5e-4, 1e-45];
    check_matrix(&table, &w, 1, 3, "tiny values, e clamped at -127");
    assert_eq!(mxfp8::quantize(&w, 1, 3).scales[0], 0);
}

// ---------------------------------------------------------------------------------------------------------------
// The drafter of flashnext-tiny.

fn tiny_dir() -> std::path::PathBuf {
    root().join("models/flashnext-tiny")
}

fn tiny_plan(max_depth: u32) -> PlanBody {
    plan_for(&tiny_dir(), &[1], max_depth, 32, 1024)
}

#[test]
fn derived_drafter_weights_follow_the_form() {
    let table = e4m3_table();
    let body = tiny_plan(8);
    let loaded = load_checkpoint(&tiny_dir(), &body, &LoadOptions::default()).expect("loads");
    assert!(loaded.has_mtp);
    for form in DrafterForm::ALL {
        let mut t = loaded.tensors.clone();
        derive_drafter_weights(&body, &mut t, form);
        let mut derived = 0;
        for (i, e) in body.weights.iter().enumerate() {
            let wanted = match e.group {
                WeightGroup::MtpMxfp8 => form != DrafterForm::Checkpoint,
                WeightGroup::HeadMxfp8 => form == DrafterForm::Mxfp8Head,
                _ => {
                    assert_eq!(
                        t[i], loaded.tensors[i],
                        "{}: loaded tensors untouched",
                        e.name
                    );
                    continue;
                }
            };
            assert_eq!(t[i].is_some(), wanted, "{} under {}", e.name, form.name());
            if !wanted {
                continue;
            }
            derived += 1;
            if form != DrafterForm::Mxfp8Head {
                continue; // checked once, under mxfp8-head (the values do not depend on the form)
            }
            let src = loaded.tensors[e.source.expect("source") as usize]
                .as_deref()
                .expect("source loaded");
            let cols = *e.shape.last().unwrap() as usize;
            let rows = src.len() / cols;
            let got = t[i].as_deref().unwrap();
            // Every group of every row (stacked experts: each [R, C] matrix row by row) against the reference.
            for r in 0..rows {
                for lo in (0..cols).step_by(32) {
                    let hi = (lo + 32).min(cols);
                    let (_, want) = reference_group(&table, &src[r * cols + lo..r * cols + hi]);
                    let g = &got[r * cols + lo..r * cols + hi];
                    assert!(
                        g.iter().zip(&want).all(|(&y, &x)| y as f64 == x),
                        "{}: row {r} cols {lo}..{hi}",
                        e.name
                    );
                }
            }
            // Re-coding changed something (the test would prove nothing otherwise).
            assert!(got != src, "{}: re-coding changed nothing", e.name);
        }
        let expected = match form {
            DrafterForm::Checkpoint => 0,
            _ => {
                body.weights
                    .iter()
                    .filter(|e| e.group == WeightGroup::MtpMxfp8)
                    .count()
                    + usize::from(form == DrafterForm::Mxfp8Head)
            }
        };
        assert_eq!(derived, expected, "{}", form.name());
    }
    // The router stays as stored; every other drafter linear has a re-coded copy.
    assert!(body
        .weight_index("mtp.layers.0.mlp.gate.weight#mxfp8")
        .is_none());
    for n in [
        "mtp.fc_hidden.weight",
        "mtp.layers.0.self_attn.indexer.index_qk_proj.weight",
        "mtp.layers.0.mlp.experts.gate_up_proj",
        "mtp.layers.0.mlp_hyper_connection.block_inject_weight.weight",
        "mtp.hyper_connection_mixer.input_mix_weight_up.weight",
        "lm_head.weight",
    ] {
        assert!(body.weight_index(&format!("{n}#mxfp8")).is_some(), "{n}");
    }
}

/// The weights a GPU backend keeps as MXFP8 (`linear_mxfp8`): the re-coded drafter linears and the drafting
/// `lm_head` copy that only `Linear` nodes read; the experts, shared expert, hc_read and router weights stay BF16.
/// Every one of them packs into codes and scales that decode to the derived values bit for bit.
#[test]
fn device_mxfp8_weights_are_the_linear_ones_and_pack_exactly() {
    let body = tiny_plan(4);
    let flags = mxfp8::device_mxfp8_weights(&body);
    let flagged: Vec<&str> = body
        .weights
        .iter()
        .zip(&flags)
        .filter(|(_, f)| **f)
        .map(|(e, _)| e.name.as_str())
        .collect();
    for n in [
        "lm_head.weight#mxfp8",
        "mtp.fc_hidden.weight#mxfp8",
        "mtp.fc_embedding.weight#mxfp8",
        "mtp.layers.0.self_attn.q_proj.weight#mxfp8",
        "mtp.layers.0.self_attn.o_proj.weight#mxfp8",
    ] {
        assert!(flagged.contains(&n), "{n} not held as MXFP8: {flagged:?}");
    }
    for n in [
        "lm_head.weight",
        "mtp.layers.0.mlp.experts.gate_up_proj#mxfp8",
        "mtp.layers.0.mlp.experts.down_proj#mxfp8",
        "mtp.hyper_connection_mixer.input_mix_weight_down.weight#mxfp8",
    ] {
        assert!(!flagged.contains(&n), "{n} held as MXFP8");
    }
    for (e, f) in body.weights.iter().zip(&flags) {
        assert!(!*f || e.group != WeightGroup::Main, "{}", e.name);
    }
    let mut t = load_checkpoint(&tiny_dir(), &body, &LoadOptions::default())
        .expect("loads")
        .tensors;
    derive_drafter_weights(&body, &mut t, DrafterForm::Mxfp8Head);
    for ((e, f), v) in body.weights.iter().zip(&flags).zip(&t) {
        if !*f {
            continue;
        }
        let v = v.as_deref().expect("derived");
        let (rows, cols) = (e.shape[0] as usize, e.shape[1] as usize);
        let m = mxfp8::pack_exact(v, rows, cols).unwrap_or_else(|err| panic!("{}: {err}", e.name));
        let back = mxfp8::dequantize(&m);
        assert!(
            back.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}: packing changed a value",
            e.name
        );
    }
}

/// An engine on flashnext-tiny with the drafter in `form` (copy drafts as given).
fn engine(form: DrafterForm, copy_drafts: bool) -> Engine<CpuBackend> {
    let body = tiny_plan(15);
    let mut w = load_checkpoint(&tiny_dir(), &body, &LoadOptions::default()).expect("loads");
    derive_drafter_weights(&body, &mut w.tensors, form);
    let be = CpuBackend::new(Arc::new(body), Arc::new(w.tensors));
    let opts = EngineOptions {
        max_depth: 15,
        parallel: 1,
        copy_drafts,
        drafter_form: form,
        ..Default::default()
    };
    Engine::new(be, opts, w.has_mtp)
}

fn encode(text: &str) -> Vec<u32> {
    tokenizers::Tokenizer::from_file(tiny_dir().join("tokenizer.json"))
        .expect("tokenizer")
        .encode(text, false)
        .expect("encode")
        .get_ids()
        .to_vec()
}

fn solo(e: &mut Engine<CpuBackend>, r: Request) -> (Vec<u32>, ReplyStats) {
    let id = e.submit(r).expect("submit");
    let mut toks = Vec::new();
    for ev in e.run_to_completion() {
        match ev {
            Event::Token { stream, id: t } if stream == id => toks.push(t),
            Event::Finished { stream, stats, .. } if stream == id => return (toks, stats),
            Event::Failed { stream, error } if stream == id => panic!("stream failed: {error}"),
            _ => {}
        }
    }
    panic!("stream {id} did not finish");
}

const PROMPTS: &[&str] = &[
    "def moving_average(values, window):\n    \"\"\"Return the moving average of values.\"\"\"\n    result = []\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=\"Copy files\")\n",
];

#[test]
fn mxfp8_replies_equal_checkpoint_and_plain() {
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 7,
    };
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| encode(p)).collect();
    let mut engines: Vec<(DrafterForm, Engine<CpuBackend>)> = DrafterForm::ALL
        .into_iter()
        .map(|f| (f, engine(f, false)))
        .collect();
    for (name, sampling) in [("greedy", SamplingParams::greedy()), ("T=0.8", sampled)] {
        for p in &prompts {
            let (plain, _) = solo(&mut engines[0].1, req(p, 40, false, sampling));
            assert!(!plain.is_empty());
            for (form, e) in &mut engines {
                let (drafted, stats) = solo(e, req(p, 40, true, sampling));
                assert_eq!(
                    drafted,
                    plain,
                    "{name}, {}: reply differs from \"draft\": false",
                    form.name()
                );
                assert!(
                    stats.drafted_mtp > 0 && stats.mtp_rounds > 0,
                    "{name}, {}: no MTP drafts were made: {stats:?}",
                    form.name()
                );
            }
        }
    }
}

#[test]
fn mxfp8_with_copy_drafts_equals_plain() {
    // Copy drafts on (the default): rounds mix copy and MTP drafts; replies are still plain decoding's.
    let p = encode(
        "def load_file(path, mode=\"rb\"):\n    with open(path, mode) as handle:\n        data = handle.read()\n    \
         return data\n\n\n# The same again:\ndef load_file(path,",
    );
    let mut plain_e = engine(DrafterForm::Checkpoint, true);
    let (plain, _) = solo(&mut plain_e, req(&p, 48, false, SamplingParams::greedy()));
    for form in [DrafterForm::Mxfp8, DrafterForm::Mxfp8Head] {
        let mut e = engine(form, true);
        let (drafted, stats) = solo(&mut e, req(&p, 48, true, SamplingParams::greedy()));
        assert_eq!(drafted, plain, "{}", form.name());
        assert!(
            stats.drafted_copy + stats.drafted_mtp > 0,
            "{}: nothing drafted",
            form.name()
        );
    }
}
