//! GPU checks (issue 4): the CUDA backend against the CPU backend on the fixtures. Skipped, with the reason
//! printed, unless `FLASHPLAN_GPU=1` and a CUDA GPU is present. `scripts/gpu_check.sh` builds these here and runs
//! them on the H200 machine.
//!
//! Oracle: the CPU backend with the same BF16-rounded weights the GPU holds, so the only differences left are f32
//! summation order (warp trees instead of the CPU's 8-lane sums, fused multiply-adds) and the ulps of expf/sinf/cosf.
//! Tolerance: max |diff| <= 1e-3 x max |logit| per row (those reorderings give ~1e-6 relative per op; 1e-3 leaves
//! room for their growth over a few layers while catching any indexing or formula error, which gives O(1)).
//! The distance to transformers' f32 logits (f32 weights) is printed too: it is the BF16 weight rounding itself.
//! Row invariance is checked bit for bit: the same row across windows 1..16 and across stream counts.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use flashplan_plan::{
    CompileOptions, DrafterForm, IoBuf, ModelConfig, PlanBody, RoundDesc, StreamDesc, VariantKind,
    WeightGroup,
};
use flashplan_runtime::backend::{Backend, BackendError};
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::cuda::CudaBackend;
use flashplan_runtime::mxfp8::{self, derive_drafter_weights};

const TOL: f32 = 1e-3;
const CHUNK: u32 = 16;

fn plans(dir: &Path) -> (PlanBody, PlanBody) {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let cfg = ModelConfig::from_json_str(&text).expect("config parses");
    plans_of(&cfg, vec![1, 2, 4, 8, 16], 512)
}

/// The CPU and the GPU (`sm_90a`) plans of `cfg` for these stream counts and context, depth 15, prefill chunks of
/// [`CHUNK`].
fn plans_of(cfg: &ModelConfig, streams: Vec<u32>, context: u64) -> (PlanBody, PlanBody) {
    let mut opts = CompileOptions {
        arch: "sm_90a".into(),
        max_depth: 15,
        streams,
        context,
        prefill_chunk: CHUNK,
    };
    let gpu = flashplan_compiler::compile(cfg, &opts, &Default::default(), "test", |_, _| {})
        .unwrap_or_else(|e| panic!("compiling GPU plans: {e}"))
        .body;
    opts.arch = "cpu".into();
    let cpu = flashplan_compiler::compile(cfg, &opts, &Default::default(), "test", |_, _| {})
        .expect("cpu plans")
        .body;
    (cpu, gpu)
}

fn desc(streams: &[(u32, u32, u32, &[u32])], window: u32) -> RoundDesc {
    let mut tokens = Vec::new();
    let mut sd = Vec::new();
    for &(slot, pos, rows, toks) in streams {
        let mut t = toks.to_vec();
        t.resize(window as usize, 0);
        tokens.extend(t);
        sd.push(StreamDesc::greedy_at(slot, pos, rows));
    }
    RoundDesc {
        streams: sd,
        tokens,
    }
}

/// Max over rows of max|a-b| / max|b|.
fn rel(a: &[f32], b: &[f32], width: usize) -> f32 {
    a.chunks(width)
        .zip(b.chunks(width))
        .map(|(x, y)| {
            let (d, m) = row_diff(x, y);
            d / m.max(1e-30)
        })
        .fold(0f32, f32::max)
}

struct Report {
    rows: Vec<(String, String, bool, String)>,
}

impl Report {
    /// An empty report, its table header printed.
    fn new() -> Report {
        println!("| fixture | check | result | detail |\n|---|---|---|---|");
        Report { rows: Vec::new() }
    }

    /// Panics, listing them, if any of the `what` checks added failed.
    fn assert_passed(&self, what: &str) {
        let failed: Vec<_> = self.rows.iter().filter(|r| !r.2).collect();
        assert!(
            failed.is_empty(),
            "{} {what} failed: {failed:?}",
            failed.len()
        );
    }

    fn add(&mut self, fixture: &str, check: &str, ok: bool, detail: String) {
        println!(
            "| {fixture} | {check} | {} | {detail} |",
            if ok { "pass" } else { "FAIL" }
        );
        self.rows
            .push((fixture.into(), check.into(), ok, detail.clone()));
    }
}

fn run_both(
    cpu: &mut CpuBackend,
    gpu: &mut CudaBackend,
    kind: VariantKind,
    d: &RoundDesc,
) -> Result<(), String> {
    cpu.run(kind, d).map_err(|e| format!("cpu: {e}"))?;
    gpu.run(kind, d).map_err(|e| format!("gpu: {e}"))
}

fn fixture_checks(name: &str, dir: &Path, expected: &Path, rep: &mut Report) {
    let t0 = std::time::Instant::now();
    let (cpu_body, gpu_body) = plans(dir);
    let vocab = cpu_body.config.vocab_size as usize;
    let hcw = cpu_body.config.hc_width() as usize;
    let mut w = load_checkpoint(dir, &cpu_body, &LoadOptions::default())
        .expect("checkpoint")
        .tensors;
    for t in w.iter_mut().flatten() {
        t.iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
    }
    let cpu_body = Arc::new(cpu_body);
    let w_arc = Arc::new(w.clone());
    let mut cpu = CpuBackend::new(Arc::clone(&cpu_body), Arc::clone(&w_arc));
    let mut gpu = match CudaBackend::new(Arc::new(gpu_body), &w) {
        Ok(g) => g,
        Err(e) => {
            rep.add(name, "start", false, e.to_string());
            return;
        }
    };
    let exp = Expected::open(expected);
    let prompt = exp.ids("prompt_ids");
    let (tf_shape, tf_prefill) = exp.f32("prefill_logits");
    let n = prompt.len();
    // The demo model's expectation keeps only the last rows (repository size).
    let tf_first = n - tf_shape[0];

    // Prefill in chunks: logits of every row against the CPU (BF16 weights) and transformers (f32 weights).
    let (mut worst, mut worst_tf, mut ok) = (0f32, 0f32, true);
    let mut pos = 0;
    while pos < n {
        let rows = (n - pos).min(CHUNK as usize);
        let d = desc(
            &[(0, pos as u32, rows as u32, &prompt[pos..pos + rows])],
            CHUNK,
        );
        if let Err(e) = run_both(
            &mut cpu,
            &mut gpu,
            VariantKind::Prefill { chunk: CHUNK },
            &d,
        ) {
            rep.add(name, "prefill", false, e);
            return;
        }
        let g = &gpu.io(IoBuf::Logits)[..rows * vocab];
        worst = worst.max(rel(g, &cpu.io(IoBuf::Logits)[..rows * vocab], vocab));
        for r in (pos..pos + rows).filter(|&r| r >= tf_first) {
            worst_tf = worst_tf.max(rel(
                &g[(r - pos) * vocab..(r - pos + 1) * vocab],
                &tf_prefill[(r - tf_first) * vocab..(r - tf_first + 1) * vocab],
                vocab,
            ));
        }
        ok &= gpu.io(IoBuf::Sampled)[0].to_bits() == cpu.io(IoBuf::Sampled)[0].to_bits();
        pos += rows;
    }
    rep.add(
        name,
        "prefill-c16 logits vs CPU",
        ok && worst <= TOL,
        format!("{n} rows, max rel diff {worst:.2e} (vs transformers f32: {worst_tf:.2e}), sampled equal: {ok}"),
    );
    let state_after_prefill = cpu.slot_state(0);
    // A CPU backend in the post-prefill state (the CPU backend has no state setter: prefill again).
    let cpu_after_prefill = || {
        let mut c = CpuBackend::new(Arc::clone(&cpu_body), Arc::clone(&w_arc));
        let mut pos = 0;
        while pos < n {
            let rows = (n - pos).min(CHUNK as usize);
            let d = desc(
                &[(0, pos as u32, rows as u32, &prompt[pos..pos + rows])],
                CHUNK,
            );
            c.run(VariantKind::Prefill { chunk: CHUNK }, &d).unwrap();
            pos += rows;
        }
        c
    };
    let gstate = gpu.slot_state(0);
    let sd = rel(&gstate, &state_after_prefill, gstate.len().max(1));
    rep.add(
        name,
        "slot state after prefill",
        sd <= TOL,
        format!("max rel diff {sd:.2e}"),
    );
    let gpu_snapshot = gstate;
    let first = cpu.io(IoBuf::Sampled)[0].to_bits();

    // Greedy decode, one token a round (verify-s1-w1), each backend following its own tokens.
    let steps = 24;
    let (mut tc, mut tg) = (first, gpu.io(IoBuf::Sampled)[0].to_bits());
    let (mut ct, mut gt) = (vec![tc], vec![tg]);
    let mut worst = 0f32;
    for t in 0..steps {
        let p = (n + t) as u32;
        cpu.run(
            VariantKind::Verify {
                streams: 1,
                window: 1,
            },
            &desc(&[(0, p, 1, &[tc])], 1),
        )
        .unwrap();
        gpu.run(
            VariantKind::Verify {
                streams: 1,
                window: 1,
            },
            &desc(&[(0, p, 1, &[tg])], 1),
        )
        .unwrap();
        if tc == tg {
            worst = worst.max(rel(
                &gpu.io(IoBuf::Logits)[..vocab],
                &cpu.io(IoBuf::Logits)[..vocab],
                vocab,
            ));
        }
        tc = cpu.io(IoBuf::Sampled)[0].to_bits();
        tg = gpu.io(IoBuf::Sampled)[0].to_bits();
        ct.push(tc);
        gt.push(tg);
    }
    let tf_ids = exp.ids("greedy_ids");
    let agree_tf = gt.iter().zip(&tf_ids).take_while(|(a, b)| a == b).count();
    rep.add(
        name,
        "greedy verify-s1-w1 tokens == CPU",
        ct == gt && worst <= TOL,
        format!(
            "{} tokens, max rel diff {worst:.2e}; first {agree_tf} equal transformers' f32 greedy",
            gt.len()
        ),
    );

    // Drafted windows: restore the post-prefill state; verify windows with the CPU's greedy continuation as
    // drafts (all accepted) and with a wrong draft in the middle; also the lone-stream slot.
    let cont = &ct; // cont[0] is the pending token at position n
    for (label, kind) in [
        (
            "verify-s1-w4",
            VariantKind::Verify {
                streams: 1,
                window: 4,
            },
        ),
        ("lone-w4", VariantKind::Lone { window: 4 }),
        (
            "verify-s1-w16",
            VariantKind::Verify {
                streams: 1,
                window: 16,
            },
        ),
    ] {
        let win = kind.shape().1 as usize;
        for wrong in [false, true] {
            let mut cpu = cpu_after_prefill();
            gpu.set_slot_state(0, &gpu_snapshot).unwrap();
            let mut toks: Vec<u32> = cont[..win].to_vec();
            if wrong {
                toks[win / 2] = (toks[win / 2] + 1) % vocab as u32;
            }
            let d = desc(&[(0, n as u32, win as u32, &toks)], win as u32);
            if let Err(e) = run_both(&mut cpu, &mut gpu, kind, &d) {
                rep.add(name, label, false, e);
                continue;
            }
            let r = rel(
                &gpu.io(IoBuf::Logits)[..win * vocab],
                &cpu.io(IoBuf::Logits)[..win * vocab],
                vocab,
            );
            let same_tok = gpu.io(IoBuf::Sampled)[..win] == cpu.io(IoBuf::Sampled)[..win]
                || gpu.io(IoBuf::Sampled)[..win]
                    .iter()
                    .zip(&cpu.io(IoBuf::Sampled)[..win])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            let keep = (
                gpu.io(IoBuf::Keep)[0].to_bits(),
                cpu.io(IoBuf::Keep)[0].to_bits(),
            );
            let s = rel(
                &gpu.slot_state(0),
                &cpu.slot_state(0),
                cpu.slot_state(0).len().max(1),
            );
            rep.add(
                name,
                &format!("{label} drafts {}", if wrong { "with a wrong one" } else { "all right" }),
                r <= TOL && same_tok && keep.0 == keep.1 && s <= TOL,
                format!("logits {r:.2e}, tokens equal {same_tok}, keep {} vs {}, committed state {s:.2e}", keep.0, keep.1),
            );
        }
    }

    // Row invariance across windows: row j's logits bit-identical for every window 1..=16 (same state, same tokens).
    let mut rows_ref: Vec<Option<Vec<f32>>> = vec![None; 16];
    let mut identical = true;
    for win in 1..=16usize {
        gpu.set_slot_state(0, &gpu_snapshot).unwrap();
        let d = desc(&[(0, n as u32, win as u32, &cont[..win])], win as u32);
        gpu.run(
            VariantKind::Verify {
                streams: 1,
                window: win as u32,
            },
            &d,
        )
        .unwrap();
        let lg = gpu.io(IoBuf::Logits);
        for (j, slot) in rows_ref.iter_mut().enumerate().take(win) {
            identical &= same_bits_as(slot, &lg[j * vocab..(j + 1) * vocab]);
        }
    }
    rep.add(
        name,
        "row invariance, windows 1..16",
        identical,
        "bit-identical rows".into(),
    );

    // Row invariance across stream counts: stream 0 as above (a full window of 16 rows), other streams on other
    // slots with other tokens and other window fills, up to 16 streams x 16 rows = 256 rows in one replay.
    let mut base: Option<Vec<f32>> = None;
    let mut identical = true;
    let w = 16usize;
    for s in [1u32, 2, 4, 8, 16] {
        for slot in 0..s {
            gpu.set_slot_state(slot, &gpu_snapshot).unwrap();
        }
        let other: Vec<u32> = cont[..w].iter().map(|t| (t + 7) % vocab as u32).collect();
        let mut ss: Vec<(u32, u32, u32, &[u32])> = vec![(0, n as u32, w as u32, &cont[..w])];
        for slot in 1..s {
            ss.push((slot, n as u32, w as u32 - (slot % 5), &other));
        }
        gpu.run(
            VariantKind::Verify {
                streams: s,
                window: w as u32,
            },
            &desc(&ss, w as u32),
        )
        .unwrap();
        identical &= same_bits_as(&mut base, &gpu.io(IoBuf::Logits)[..w * vocab]);
    }
    rep.add(
        name,
        "row invariance, streams 1/2/4/8/16 x 16 rows",
        identical,
        "bit-identical stream-0 rows".into(),
    );

    // Row invariance across slots: the same stream in slots 0..3, whose state pieces sit at other alignments (a
    // kernel must never pick its arithmetic from an address).
    let mut base: Option<Vec<f32>> = None;
    let mut identical = true;
    for slot in 0..4u32 {
        gpu.set_slot_state(slot, &gpu_snapshot).unwrap();
        gpu.run(
            VariantKind::Verify {
                streams: 1,
                window: w as u32,
            },
            &desc(&[(slot, n as u32, w as u32, &cont[..w])], w as u32),
        )
        .unwrap();
        identical &= same_bits_as(&mut base, &gpu.io(IoBuf::Logits)[..w * vocab]);
    }
    rep.add(
        name,
        "row invariance, slots 0..3 x 16 rows",
        identical,
        "bit-identical rows".into(),
    );

    // Grids in one wave (runtime/src/cuda/launch/linear.rs `one_wave`: the one- and two-row linears, the one-row experts'
    // gate/up) sized as for a GPU of one SM: every block then loops over many m-tiles and experts' items. Which block
    // does a piece of work must never change a bit.
    let mut identical = true;
    let mut compared = 0;
    for win in [1u32, 2] {
        for kind in [
            VariantKind::Verify {
                streams: 1,
                window: win,
            },
            VariantKind::Lone { window: win },
        ] {
            let d = desc(&[(0, n as u32, win, &cont[..win as usize])], win);
            let mut base: Option<Vec<f32>> = None;
            for sms in [0u32, 1] {
                gpu.set_grid_sms(sms).unwrap();
                gpu.set_slot_state(0, &gpu_snapshot).unwrap();
                gpu.run(kind, &d).unwrap();
                identical &=
                    same_bits_as(&mut base, &gpu.io(IoBuf::Logits)[..win as usize * vocab]);
            }
            compared += 1;
        }
    }
    gpu.set_grid_sms(0).unwrap();
    rep.add(
        name,
        "one-wave grids: 1 SM == this GPU's, windows 1 and 2",
        identical,
        format!("bit-identical rows ({compared} variants)"),
    );

    // MTP: absorb one entry at a time from the given main streams, then a chained step.
    let (_, streams) = exp.f32("mtp_streams");
    let toks = exp.ids("mtp_tokens");
    let (tf_mtp_shape, tf_mtp) = exp.f32("mtp_logits");
    let tf_mtp_first = toks.len() - tf_mtp_shape[0];
    for s in 0..4 {
        cpu.reset_slot(s);
        gpu.reset_slot(s);
    }
    let (mut worst, mut worst_tf, mut worst_st, mut ok) = (0f32, 0f32, 0f32, true);
    let form = DrafterForm::Checkpoint;
    for i in 0..toks.len() {
        cpu.write_io(IoBuf::MainStreams, 0, &streams[i * hcw..(i + 1) * hcw]);
        gpu.write_io(IoBuf::MainStreams, 0, &streams[i * hcw..(i + 1) * hcw]);
        let d = desc(&[(0, i as u32, 1, &[toks[i]])], 1);
        if let Err(e) = run_both(
            &mut cpu,
            &mut gpu,
            VariantKind::MtpAbsorb {
                streams: 1,
                window: 1,
                form,
            },
            &d,
        ) {
            rep.add(name, "mtp-absorb-s1-w1", false, e);
            ok = false;
            break;
        }
        worst = worst.max(rel(
            &gpu.io(IoBuf::Logits)[..vocab],
            &cpu.io(IoBuf::Logits)[..vocab],
            vocab,
        ));
        if i >= tf_mtp_first {
            let j = i - tf_mtp_first;
            worst_tf = worst_tf.max(rel(
                &gpu.io(IoBuf::Logits)[..vocab],
                &tf_mtp[j * vocab..(j + 1) * vocab],
                vocab,
            ));
        }
        worst_st = worst_st.max(rel(
            &gpu.io(IoBuf::MtpStreams)[..hcw],
            &cpu.io(IoBuf::MtpStreams)[..hcw],
            hcw,
        ));
        ok &= gpu.io(IoBuf::Sampled)[0].to_bits() == cpu.io(IoBuf::Sampled)[0].to_bits();
    }
    rep.add(
        name,
        "mtp-absorb-s1-w1 logits and streams",
        ok && worst <= TOL && worst_st <= TOL,
        format!("{} entries, logits {worst:.2e} (vs reference f32: {worst_tf:.2e}), streams {worst_st:.2e}, drafts equal {ok}", toks.len()),
    );
    // A 4-entry absorb window and a chain step after it.
    let m = toks.len().min(4);
    for s in 0..1 {
        cpu.reset_slot(s);
        gpu.reset_slot(s);
    }
    cpu.write_io(IoBuf::MainStreams, 0, &streams[..m * hcw]);
    gpu.write_io(IoBuf::MainStreams, 0, &streams[..m * hcw]);
    let d = desc(&[(0, 0, m as u32, &toks[..m])], 4);
    let mut ok = run_both(
        &mut cpu,
        &mut gpu,
        VariantKind::MtpAbsorb {
            streams: 1,
            window: 4,
            form,
        },
        &d,
    )
    .is_ok();
    let r1 = rel(
        &gpu.io(IoBuf::Logits)[..vocab],
        &cpu.io(IoBuf::Logits)[..vocab],
        vocab,
    );
    ok &= gpu.io(IoBuf::Sampled)[0].to_bits() == cpu.io(IoBuf::Sampled)[0].to_bits();
    let draft = cpu.io(IoBuf::Sampled)[0].to_bits();
    let mut dc = desc(&[(0, m as u32, 1, &[draft])], 1);
    dc.streams[0].committed = m as u32;
    dc.streams[0].src_row = 0;
    ok &= run_both(
        &mut cpu,
        &mut gpu,
        VariantKind::MtpChain { streams: 1, form },
        &dc,
    )
    .is_ok();
    let r2 = rel(
        &gpu.io(IoBuf::Logits)[..vocab],
        &cpu.io(IoBuf::Logits)[..vocab],
        vocab,
    );
    ok &= gpu.io(IoBuf::Sampled)[0].to_bits() == cpu.io(IoBuf::Sampled)[0].to_bits();
    rep.add(
        name,
        "mtp-absorb-s1-w4 + mtp-chain-s1",
        ok && r1 <= TOL && r2 <= TOL,
        format!("absorb {r1:.2e}, chain {r2:.2e}, drafts equal {ok}"),
    );

    // The launch switches give the same bits both ways: FLASHPLAN_FUSE_SMALL's fusions (hc_write_norm,
    // add_broadcast_norm, rms_norm_embed / _gather, hc_read_one, experts_one, the router's top-k in its last block),
    // FLASHPLAN_FUSE_LINEAR's sibling runs (linear_multi) and FLASHPLAN_PDL's programmatic launches. Each runs
    // main-model windows from the snapshot, then MTP absorbs and a chained step, with the switch off and on (the
    // backend recaptures), and every logit, MTP stream value and the draft with its probability are compared bit for
    // bit; the switch then goes back to its setting from the environment.
    type Switch = fn(&mut CudaBackend, bool) -> Result<bool, BackendError>;
    let switches: [(&str, Switch); 3] = [
        ("FLASHPLAN_FUSE_SMALL", CudaBackend::set_fuse_small),
        ("FLASHPLAN_FUSE_LINEAR", CudaBackend::set_fuse_linear),
        ("FLASHPLAN_PDL", CudaBackend::set_pdl),
    ];
    for (var, set) in switches {
        let mut runs: Vec<Vec<Vec<u32>>> = Vec::new();
        let original = set(&mut gpu, false);
        let mut ran = original.is_ok();
        for on in [false, true] {
            let mut out: Vec<Vec<u32>> = Vec::new();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            ran &= set(&mut gpu, on).is_ok();
            for kind in [
                VariantKind::Lone { window: 1 },
                VariantKind::Verify {
                    streams: 1,
                    window: 1,
                },
                VariantKind::Verify {
                    streams: 1,
                    window: 4,
                },
            ] {
                let (_, win) = kind.shape();
                gpu.set_slot_state(0, &gpu_snapshot).unwrap();
                ran &= gpu
                    .run(
                        kind,
                        &desc(&[(0, n as u32, win, &cont[..win as usize])], win),
                    )
                    .is_ok();
                out.push(bits(&gpu.io(IoBuf::Logits)[..win as usize * vocab]));
            }
            gpu.reset_slot(0);
            for i in 0..m {
                gpu.write_io(IoBuf::MainStreams, 0, &streams[i * hcw..(i + 1) * hcw]);
                let kind = VariantKind::MtpAbsorb {
                    streams: 1,
                    window: 1,
                    form,
                };
                ran &= gpu
                    .run(kind, &desc(&[(0, i as u32, 1, &[toks[i]])], 1))
                    .is_ok();
                out.push(bits(&gpu.io(IoBuf::Logits)[..vocab]));
                out.push(bits(&gpu.io(IoBuf::MtpStreams)[..hcw]));
            }
            gpu.reset_slot(0);
            gpu.write_io(IoBuf::MainStreams, 0, &streams[..m * hcw]);
            let kind = VariantKind::MtpAbsorb {
                streams: 1,
                window: 4,
                form,
            };
            ran &= gpu
                .run(kind, &desc(&[(0, 0, m as u32, &toks[..m])], 4))
                .is_ok();
            out.push(bits(&gpu.io(IoBuf::Logits)[..vocab]));
            ran &= gpu
                .run(VariantKind::MtpChain { streams: 1, form }, &dc)
                .is_ok();
            out.push(bits(&gpu.io(IoBuf::Logits)[..vocab]));
            out.push(bits(&gpu.io(IoBuf::MtpStreams)[..hcw]));
            out.push(vec![
                gpu.io(IoBuf::Sampled)[0].to_bits(),
                gpu.io(IoBuf::Probs)[0].to_bits(),
            ]);
            runs.push(out);
        }
        ran &= set(&mut gpu, original.unwrap_or(true)).is_ok();
        let same = ran && runs[0] == runs[1];
        rep.add(
            name,
            &format!("{var} off == on: lone-w1, verify-s1-w1/w4, mtp absorbs and chain"),
            same,
            format!(
                "bit-identical logits, MTP streams and draft: {same} ({} arrays)",
                runs[0].len()
            ),
        );
    }

    let caps = gpu.captures();
    let cap_ms: f64 = caps.iter().map(|c| c.ms).sum();
    let nodes: usize = caps.iter().map(|c| c.nodes).max().unwrap_or(0);
    println!(
        "| {name} | graphs | info | {} variants captured lazily in {cap_ms:.0} ms in all (largest {nodes} nodes); fixture total {:.1} s |",
        caps.len(),
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn gpu_matches_cpu_on_the_fixtures() {
    let Some(name) = gpu_ready() else { return };
    println!("GPU: {name}; tolerance max|diff| <= {TOL} x max|logit| per row against the CPU backend with the same BF16 weights");
    let mut rep = Report::new();
    fixture_checks(
        "tiny-text",
        &fixture("tiny-text"),
        &fixture("tiny-text").join("expected.safetensors"),
        &mut rep,
    );
    fixture_checks(
        "tiny-wrapper",
        &fixture("tiny-wrapper"),
        &fixture("tiny-wrapper").join("expected.safetensors"),
        &mut rep,
    );
    fixture_checks(
        "flashnext-tiny",
        &root().join("models/flashnext-tiny"),
        &root().join("fixtures/flashnext-tiny-expected.safetensors"),
        &mut rep,
    );
    rep.assert_passed("GPU checks");
}

/// The tiny-text fixture's config with the real model's attention shape (24 query heads over 2 kv heads of 256: 12
/// a group, as `flash-next.json`) and indexer (budget 2048 at ratio 4: 513 pooled blocks, 2052 tokens, 65 chunks of
/// 32), for a context of `context` tokens.
fn real_attention_config(context: u64) -> ModelConfig {
    tiny_text_config_with(context, |j| {
        j["num_attention_heads"] = 24.into();
        j["num_key_value_heads"] = 2.into();
        j["head_dim"] = 256.into();
        j["indexer_head_dim"] = 128.into();
        j["indexer_budget"] = 2048.into();
        j["indexer_compress_ratio"] = 4.into();
        // The rotary dims (256 x 0.25 = 64) in the real config's sections.
        j["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
    })
}

/// The tiny-text fixture's config for a context of `context` tokens, with `edit` applied to its JSON.
fn tiny_text_config_with(context: u64, edit: impl FnOnce(&mut serde_json::Value)) -> ModelConfig {
    let text =
        std::fs::read_to_string(fixture("tiny-text").join("config.json")).expect("config.json");
    let mut j: serde_json::Value = serde_json::from_str(&text).expect("json");
    j["max_position_embeddings"] = context.into();
    edit(&mut j);
    ModelConfig::from_json_str(&j.to_string()).expect("config parses")
}

/// `n` token ids below `vocab` from a seeded linear congruential generator (Knuth's MMIX constants).
fn seeded_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Seeded weights for every main and drafter entry of `body`, BF16-exact: norms' weights 1 + 0.1 u, the rest 0.05 u,
/// u uniform in [-1, 1) (splitmix64), so that every tensor is nonzero and no code path is dead.
fn seeded_weights(body: &PlanBody, seed: u64) -> Vec<Option<Vec<f32>>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    body.weights
        .iter()
        .map(|e| {
            if !matches!(e.group, WeightGroup::Main | WeightGroup::Mtp) || e.source.is_some() {
                return None;
            }
            let n: u64 = e.shape.iter().product();
            let norm = e.name.contains("norm");
            Some(
                (0..n)
                    .map(|_| {
                        let u = next();
                        let v = if norm { 1.0 + 0.1 * u } else { 0.05 * u };
                        half::bf16::from_f32(v).to_f32()
                    })
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn gpu_sparse_attention_at_the_real_shape() {
    // The fixtures' 4 heads and 20 selected tokens run only sparse_attn_g4v of the staged kernels and a one-chunk
    // combine. Here 12 query heads a kv head of 256 over 2052 selected tokens (65 chunks): sparse_attn_g12e (every
    // stream count: the exact form of 12 heads), sparse_attn_combine_pre (rows x 24 heads <= the SMs) and
    // sparse_attn_combine (more), against the CPU backend and against each other, bit for bit across stream counts
    // and windows.
    let Some(name) = gpu_ready() else { return };
    const CONTEXT: u64 = 2304;
    const PROMPT: usize = 2112;
    println!("GPU: {name}; real attention shape (24 heads over 2 kv heads of 256, 65 chunks of 32 selected tokens)");
    let mut rep = Report::new();
    let fx = "real-attention";
    let (cpu_body, gpu_body) =
        plans_of(&real_attention_config(CONTEXT), vec![1, 2, 4, 16], CONTEXT);
    let vocab = cpu_body.config.vocab_size as usize;
    let w = Arc::new(seeded_weights(&cpu_body, 2026));
    let cpu_body = Arc::new(cpu_body);
    let mut cpu = CpuBackend::new(Arc::clone(&cpu_body), Arc::clone(&w));
    let mut gpu = CudaBackend::new(Arc::new(gpu_body), &w).expect("CUDA backend");

    // A seeded prompt past the indexer's budget, prefilled in chunks on both backends.
    let prompt = seeded_tokens(PROMPT, vocab, 7);
    let mut pos = 0;
    let mut worst = 0f32;
    while pos < PROMPT {
        let rows = (PROMPT - pos).min(CHUNK as usize);
        let d = desc(
            &[(0, pos as u32, rows as u32, &prompt[pos..pos + rows])],
            CHUNK,
        );
        run_both(
            &mut cpu,
            &mut gpu,
            VariantKind::Prefill { chunk: CHUNK },
            &d,
        )
        .expect("prefill");
        if pos + rows + 4 * CHUNK as usize > PROMPT {
            worst = worst.max(rel(
                &gpu.io(IoBuf::Logits)[..rows * vocab],
                &cpu.io(IoBuf::Logits)[..rows * vocab],
                vocab,
            ));
        }
        pos += rows;
    }
    rep.add(
        fx,
        "prefill-c16 logits vs CPU, the last 4 chunks",
        worst <= TOL,
        format!("{PROMPT} tokens, max rel diff {worst:.2e}"),
    );
    let snapshot = gpu.slot_state(0);
    let n = PROMPT as u32;
    let cont: Vec<u32> = (0..16).map(|i| prompt[(i * 131) % PROMPT]).collect();
    let other: Vec<u32> = cont.iter().map(|t| (t + 7) % vocab as u32).collect();

    // One row against the CPU backend (its state is the post-prefill one).
    let d1 = desc(&[(0, n, 1, &cont[..1])], 1);
    let kind1 = VariantKind::Verify {
        streams: 1,
        window: 1,
    };
    run_both(&mut cpu, &mut gpu, kind1, &d1).expect("verify-s1-w1");
    let r = rel(
        &gpu.io(IoBuf::Logits)[..vocab],
        &cpu.io(IoBuf::Logits)[..vocab],
        vocab,
    );
    // Finite and spread (a NaN would pass rel's maximum and the bit comparisons alike).
    let lg = &gpu.io(IoBuf::Logits)[..vocab];
    let finite = lg.iter().all(|v| v.is_finite());
    let spread =
        lg.iter().fold(f32::MIN, |a, &b| a.max(b)) - lg.iter().fold(f32::MAX, |a, &b| a.min(b));
    rep.add(
        fx,
        "verify-s1-w1 logits vs CPU",
        r <= TOL && finite && spread > 0.0,
        format!("max rel diff {r:.2e}, finite {finite}, max - min {spread:.3e}"),
    );

    // Stream 0's row across stream counts (other streams on other slots with other tokens), sparse_attn_g12e at
    // every count; the one-wave combine up to 5 rows (x 24 heads <= 132 SMs), the looping one at 16 streams. And the
    // lone-stream slot.
    let mut base: Option<Vec<f32>> = None;
    let mut identical = true;
    for s in [1u32, 2, 4, 16] {
        for slot in 0..s {
            gpu.set_slot_state(slot, &snapshot).unwrap();
        }
        let mut ss: Vec<(u32, u32, u32, &[u32])> = vec![(0, n, 1, &cont[..1])];
        for slot in 1..s {
            ss.push((slot, n, 1, &other[..1]));
        }
        gpu.run(
            VariantKind::Verify {
                streams: s,
                window: 1,
            },
            &desc(&ss, 1),
        )
        .unwrap();
        identical &= same_bits_as(&mut base, &gpu.io(IoBuf::Logits)[..vocab]);
    }
    gpu.set_slot_state(0, &snapshot).unwrap();
    gpu.run(VariantKind::Lone { window: 1 }, &d1).unwrap();
    identical &= same_bits_as(&mut base, &gpu.io(IoBuf::Logits)[..vocab]);
    rep.add(
        fx,
        "row invariance, streams 1/2/4/16 x 1 row and lone-w1",
        identical,
        "bit-identical stream-0 rows".into(),
    );

    // Rows across windows of one stream (the one-wave combine up to 5 rows, the looping one beyond) and a window of
    // 16 rows of stream 0 beside a second stream.
    let mut rows_ref: Vec<Option<Vec<f32>>> = vec![None; 16];
    let mut identical = true;
    for (streams, win) in [(1u32, 1usize), (1, 4), (1, 8), (1, 16), (2, 16)] {
        for slot in 0..streams {
            gpu.set_slot_state(slot, &snapshot).unwrap();
        }
        let mut ss: Vec<(u32, u32, u32, &[u32])> = vec![(0, n, win as u32, &cont[..win])];
        if streams == 2 {
            ss.push((1, n, win as u32 - 3, &other[..win]));
        }
        gpu.run(
            VariantKind::Verify {
                streams,
                window: win as u32,
            },
            &desc(&ss, win as u32),
        )
        .unwrap();
        let lg = gpu.io(IoBuf::Logits);
        for (j, slot) in rows_ref.iter_mut().enumerate().take(win) {
            identical &= same_bits_as(slot, &lg[j * vocab..(j + 1) * vocab]);
        }
    }
    rep.add(
        fx,
        "row invariance, windows 1/4/8/16 and s2-w16",
        identical,
        "bit-identical rows".into(),
    );
    rep.assert_passed("GPU checks");
}

/// Bit-for-bit equality of two f32 slices.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Runs one variant on the CPU oracle and both GPU backends (MXFP8 weights as MXFP8, and as BF16).
fn run_three(
    cpu: &mut CpuBackend,
    mx: &mut CudaBackend,
    bf: &mut CudaBackend,
    kind: VariantKind,
    d: &RoundDesc,
) -> Result<(), String> {
    cpu.run(kind, d).map_err(|e| format!("cpu: {e}"))?;
    mx.run(kind, d).map_err(|e| format!("gpu mxfp8: {e}"))?;
    bf.run(kind, d).map_err(|e| format!("gpu bf16: {e}"))
}

/// The MXFP8 drafter checks of one fixture with an MTP head (issue 8): the `mxfp8` and `mxfp8-head` MTP variants on
/// a GPU backend holding the re-coded linears (and the drafting lm_head) as MXFP8 (`linear_mxfp8`), against the CPU
/// backend on the same values (within the usual tolerance, with the same drafts) and against a GPU backend holding
/// the same values as BF16 (`linear`): bit for bit, since `linear_mxfp8` is `linear`'s body on the decoded BF16
/// values; and row invariance of a chained step across stream counts (bit for bit).
fn mxfp8_checks(name: &str, dir: &Path, expected: &Path, rep: &mut Report) {
    let (cpu_body, gpu_body) = plans(dir);
    let vocab = cpu_body.config.vocab_size as usize;
    let hcw = cpu_body.config.hc_width() as usize;
    let loaded = load_checkpoint(dir, &cpu_body, &LoadOptions::default()).expect("checkpoint");
    if !loaded.has_mtp {
        println!("| {name} | mxfp8 drafter | info | no MTP head: nothing to check |");
        return;
    }
    // The oracle's weights: BF16-rounded as in fixture_checks, then the drafter re-coded from those (MXFP8 values
    // are BF16 values, so the BF16 backend holds them exactly too).
    let mut w = loaded.tensors;
    for t in w.iter_mut().flatten() {
        t.iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
    }
    derive_drafter_weights(&cpu_body, &mut w, DrafterForm::Mxfp8Head);
    let cpu_body = Arc::new(cpu_body);
    let gpu_body = Arc::new(gpu_body);
    let mut cpu = CpuBackend::new(Arc::clone(&cpu_body), Arc::new(w.clone()));
    let bf_w: Vec<Option<Vec<u16>>> = w
        .iter()
        .map(|t| {
            t.as_ref().map(|t| {
                t.iter()
                    .map(|x| half::bf16::from_f32(*x).to_bits())
                    .collect()
            })
        })
        .collect();
    let (mut mx, mut bf) = match (
        CudaBackend::new(Arc::clone(&gpu_body), &w),
        CudaBackend::new_bf16(Arc::clone(&gpu_body), bf_w),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            rep.add(name, "mxfp8 start", false, e.to_string());
            return;
        }
    };
    let want = mxfp8::device_mxfp8_weights(&gpu_body)
        .iter()
        .zip(&w)
        .filter(|(f, t)| **f && t.is_some())
        .count();
    rep.add(
        name,
        "MXFP8 weights held as codes + scales",
        mx.mxfp8_weights() == want && want > 0 && bf.mxfp8_weights() == 0,
        format!(
            "{} weights (expected {want}; the BF16 backend {})",
            mx.mxfp8_weights(),
            bf.mxfp8_weights()
        ),
    );
    let exp = Expected::open(expected);
    let (_, streams) = exp.f32("mtp_streams");
    let toks = exp.ids("mtp_tokens");
    for form in [DrafterForm::Mxfp8, DrafterForm::Mxfp8Head] {
        let f = form.name();
        // Absorb one entry at a time.
        for s in 0..4 {
            cpu.reset_slot(s);
            mx.reset_slot(s);
            bf.reset_slot(s);
        }
        let (mut worst, mut worst_st, mut worst_bf, mut drafts) = (0f32, 0f32, 0f32, true);
        let mut same_bf = true;
        for i in 0..toks.len() {
            let row = &streams[i * hcw..(i + 1) * hcw];
            cpu.write_io(IoBuf::MainStreams, 0, row);
            mx.write_io(IoBuf::MainStreams, 0, row);
            bf.write_io(IoBuf::MainStreams, 0, row);
            let d = desc(&[(0, i as u32, 1, &[toks[i]])], 1);
            let kind = VariantKind::MtpAbsorb {
                streams: 1,
                window: 1,
                form,
            };
            if let Err(e) = run_three(&mut cpu, &mut mx, &mut bf, kind, &d) {
                rep.add(name, &format!("mtp-absorb-s1-w1-{f}"), false, e);
                return;
            }
            let (ml, cl, bl) = (
                &mx.io(IoBuf::Logits)[..vocab],
                &cpu.io(IoBuf::Logits)[..vocab],
                &bf.io(IoBuf::Logits)[..vocab],
            );
            worst = worst.max(rel(ml, cl, vocab));
            let (ms, cs, bs) = (
                &mx.io(IoBuf::MtpStreams)[..hcw],
                &cpu.io(IoBuf::MtpStreams)[..hcw],
                &bf.io(IoBuf::MtpStreams)[..hcw],
            );
            worst_st = worst_st.max(rel(ms, cs, hcw));
            worst_bf = worst_bf.max(rel(ml, bl, vocab)).max(rel(ms, bs, hcw));
            same_bf &= same_bits(ml, bl) && same_bits(ms, bs);
            drafts &= mx.io(IoBuf::Sampled)[0].to_bits() == cpu.io(IoBuf::Sampled)[0].to_bits();
        }
        rep.add(
            name,
            &format!("mtp-absorb-s1-w1-{f}: MXFP8 vs CPU, vs BF16 linear"),
            worst <= TOL && worst_st <= TOL && same_bf && drafts,
            format!(
                "{} entries, logits {worst:.2e}, streams {worst_st:.2e}, drafts equal {drafts}, vs BF16 linear: bit-identical {same_bf} ({worst_bf:.2e})",
                toks.len()
            ),
        );

        // A 4-entry absorb window, then a chained step; the chained step again with 4 streams (stream 0 the same).
        let m = toks.len().min(4);
        for s in 0..4 {
            cpu.reset_slot(s);
            mx.reset_slot(s);
            bf.reset_slot(s);
        }
        for b in [&mut cpu as &mut dyn Backend, &mut mx, &mut bf] {
            b.write_io(IoBuf::MainStreams, 0, &streams[..m * hcw]);
        }
        let d = desc(&[(0, 0, m as u32, &toks[..m])], 4);
        let kind = VariantKind::MtpAbsorb {
            streams: 1,
            window: 4,
            form,
        };
        if let Err(e) = run_three(&mut cpu, &mut mx, &mut bf, kind, &d) {
            rep.add(name, &format!("mtp-absorb-s1-w4-{f}"), false, e);
            return;
        }
        let r1 = rel(
            &mx.io(IoBuf::Logits)[..vocab],
            &cpu.io(IoBuf::Logits)[..vocab],
            vocab,
        );
        let mut vs_bf = rel(
            &mx.io(IoBuf::Logits)[..vocab],
            &bf.io(IoBuf::Logits)[..vocab],
            vocab,
        );
        let mut same_bf = same_bits(
            &mx.io(IoBuf::Logits)[..vocab],
            &bf.io(IoBuf::Logits)[..vocab],
        );
        let mut drafts = mx.io(IoBuf::Sampled)[0].to_bits() == cpu.io(IoBuf::Sampled)[0].to_bits();
        let draft = cpu.io(IoBuf::Sampled)[0].to_bits();
        let state = mx.slot_state(0);
        let src: Vec<f32> = mx.io(IoBuf::MtpStreams)[..hcw].to_vec();
        let mut dc = desc(&[(0, m as u32, 1, &[draft])], 1);
        dc.streams[0].committed = m as u32;
        let kind = VariantKind::MtpChain { streams: 1, form };
        if let Err(e) = run_three(&mut cpu, &mut mx, &mut bf, kind, &dc) {
            rep.add(name, &format!("mtp-chain-s1-{f}"), false, e);
            return;
        }
        let chain1 = mx.io(IoBuf::Logits)[..vocab].to_vec();
        let r2 = rel(&chain1, &cpu.io(IoBuf::Logits)[..vocab], vocab);
        vs_bf = vs_bf.max(rel(&chain1, &bf.io(IoBuf::Logits)[..vocab], vocab));
        same_bf &= same_bits(&chain1, &bf.io(IoBuf::Logits)[..vocab]);
        drafts &= mx.io(IoBuf::Sampled)[0].to_bits() == cpu.io(IoBuf::Sampled)[0].to_bits();
        rep.add(
            name,
            &format!("mtp-absorb-s1-w4-{f} + mtp-chain-s1-{f}"),
            r1 <= TOL && r2 <= TOL && same_bf && drafts,
            format!("absorb {r1:.2e}, chain {r2:.2e}, drafts equal {drafts}, vs BF16 linear: bit-identical {same_bf} ({vs_bf:.2e})"),
        );
        // Row invariance: the same chained step as stream 0 of 4 (other slots, tokens and source rows alongside).
        let others: Vec<[u32; 1]> = (0..4u32)
            .map(|s| {
                [if s == 0 {
                    draft
                } else {
                    (draft + 1 + s) % vocab as u32
                }]
            })
            .collect();
        for s in 0..4u32 {
            mx.set_slot_state(s, &state).expect("slot state");
            let row: Vec<f32> = src.iter().map(|x| x * (1.0 + s as f32 * 0.25)).collect();
            mx.write_io(IoBuf::MtpStreams, s as usize * hcw, &row);
        }
        let ss: Vec<(u32, u32, u32, &[u32])> = (0..4u32)
            .map(|s| (s, m as u32, 1u32, &others[s as usize][..]))
            .collect();
        let mut d4 = desc(&ss, 1);
        for (i, sd) in d4.streams.iter_mut().enumerate() {
            sd.committed = m as u32;
            sd.src_row = i as u32;
        }
        let kind = VariantKind::MtpChain { streams: 4, form };
        let same = match mx.run(kind, &d4) {
            Ok(()) => same_bits(&mx.io(IoBuf::Logits)[..vocab], &chain1),
            Err(e) => {
                rep.add(name, &format!("mtp-chain-s4-{f}"), false, e.to_string());
                return;
            }
        };
        rep.add(
            name,
            &format!("row invariance, mtp-chain-s1-{f} vs stream 0 of mtp-chain-s4-{f}"),
            same,
            "bit-identical stream-0 logits".into(),
        );
    }
}

/// Issue 8: the MXFP8 drafter on the GPU (`linear_mxfp8`) on every fixture with an MTP head.
#[test]
fn gpu_mxfp8_drafter_matches_cpu_and_the_bf16_linear() {
    let Some(name) = gpu_ready() else { return };
    println!("GPU: {name}; MXFP8 drafter: linear_mxfp8 against the CPU backend (max|diff| <= {TOL} x max|logit| per row) and against BF16 `linear` on the same values (bit for bit)");
    let mut rep = Report::new();
    for (fx, dir, expected) in [
        (
            "tiny-text",
            fixture("tiny-text"),
            fixture("tiny-text").join("expected.safetensors"),
        ),
        (
            "tiny-wrapper",
            fixture("tiny-wrapper"),
            fixture("tiny-wrapper").join("expected.safetensors"),
        ),
        (
            "flashnext-tiny",
            root().join("models/flashnext-tiny"),
            root().join("fixtures/flashnext-tiny-expected.safetensors"),
        ),
    ] {
        mxfp8_checks(fx, &dir, &expected, &mut rep);
    }
    rep.assert_passed("MXFP8 GPU checks");
}

/// The kernel parameter mirrors match the C layout of kernels/params.h: the host C compiler (`cc`; CUDA lays out
/// structs as the host compiler does) checks `_Static_assert`s generated from the Rust sizes and offsets. Skipped,
/// with a reason, when no `cc` is installed.
#[test]
fn kernel_abi_matches_params_h() {
    let mut src = String::from("#include <stddef.h>\n#include \"params.h\"\n");
    for (name, size, fields) in flashplan_runtime::cuda::params::layouts() {
        src.push_str(&format!(
            "_Static_assert(sizeof({name}) == {size}, \"size of {name}\");\n"
        ));
        for (f, off) in fields {
            src.push_str(&format!(
                "_Static_assert(offsetof({name}, {f}) == {off}, \"{name}.{f}\");\n"
            ));
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("abi_check.c");
    std::fs::write(&file, src).expect("write");
    let out = std::process::Command::new("cc")
        .arg("-fsyntax-only")
        .arg("-I")
        .arg(root().join("kernels"))
        .arg(&file)
        .output();
    match out {
        Err(e) => eprintln!("skipped: no C compiler (cc): {e}"),
        Ok(o) => assert!(
            o.status.success(),
            "kernel ABI mismatch between kernels/params.h and the Rust mirrors:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
    }
}

#[test]
fn runtime_and_compiler_bundle_the_same_kernels() {
    assert_eq!(
        flashplan_runtime::cuda::kernel_source_hash(),
        flashplan_compiler::nvrtc::source_hash()
    );
}

/// Row invariance bookkeeping: the first call keeps `values` as the reference; later calls compare with it bit for
/// bit.
fn same_bits_as(reference: &mut Option<Vec<f32>>, values: &[f32]) -> bool {
    match reference {
        None => {
            *reference = Some(values.to_vec());
            true
        }
        Some(r) => same_bits(r, values),
    }
}

/// The tiny-text fixture's config with the real model's 512 experts and top-10 routing (`flash-next.json`): 16
/// candidates a lane in the routers' warp top-k and 64 a warp in the one-row block top-k (kernels/moe.cu
/// `router_topk_warp`, `router_topk_block`), where the fixtures' 8 experts give one candidate to each of lanes 0-7,
/// all in the block's warp 0.
fn real_routing_config(context: u64) -> ModelConfig {
    tiny_text_config_with(context, |j| {
        j["num_experts"] = 512.into();
        j["num_experts_per_tok"] = 10.into();
    })
}

/// Router rows of one MoE layer ([experts, hidden], row e at e * hidden) rewritten from row 0, rounded to BF16, to
/// reach the corners of the routers' top-k (kernels/moe.cu `router_topk_warp`, `router_topk_block`: lane l holds
/// experts l, l + 32, .., and the one-row block's warp w the registers 2w and 2w + 1 of that layout):
/// - `tied`: row e is row e mod 5, so every logit is one of 5 values and each top-k is decided by the lowest ids;
/// - `bunched`: row e (e > 0; row 0 keeps c = 1) is c_e times row 0, with the c_e of lanes 0-8 in [2, 3), of lanes
///   9-17 in (-3, -2] and of the others in [-1, 1), growing with the register index: whatever the sign of row 0's
///   dot, nine lanes hold the 144 largest logits, the top-10 lie in the last registers (the one-row block's last
///   warp gives all ten) and one lane gives two of them;
/// - `three-lanes`: the same with lanes 0-2 and 9-11 apart: three lanes hold the 48 largest logits, so one lane
///   gives four of the top-10.
///
/// The lane term of c_e (1/256) is below BF16's rounding of c_e times a weight, so the order within a register, and
/// with it these counts, hold for most rows, not all: in a Python model of 3000 rows, all ten in the last warp for 94%
/// of `bunched` rows and one lane giving four for 98% of `three-lanes` rows (fewer where row 0's dot is near zero).
fn rewrite_router(w: &mut [f32], hidden: usize, set: &str) {
    let experts = w.len() / hidden;
    for e in 1..experts {
        let (head, tail) = w.split_at_mut(e * hidden);
        let row = &mut tail[..hidden];
        match set {
            "tied" if e >= 5 => {
                let src = (e % 5) * hidden;
                row.copy_from_slice(&head[src..src + hidden]);
            }
            "bunched" | "three-lanes" => {
                let apart = if set == "bunched" { 9 } else { 3 };
                let (l, j) = (e % 32, (e / 32) as f32);
                let lane = l as f32;
                let c = if l < apart {
                    2.0 + j / 16.0 + lane / 256.0
                } else if (9..9 + apart).contains(&l) {
                    -(2.0 + j / 16.0 + lane / 256.0)
                } else {
                    (j - 8.0) / 8.0 + lane / 512.0
                };
                for (x, &r) in row.iter_mut().zip(&head[..hidden]) {
                    *x = half::bf16::from_f32(c * r).to_f32();
                }
            }
            _ => {}
        }
    }
}

#[test]
fn gpu_router_top_k_of_512_experts() {
    // The fixtures' 8 experts and top-3 give one candidate a lane, so no lane gives two of a top-k and the one-row
    // block's warps 1-7 give none. Here the real 512 experts and top-10: the one-row router's block top-k (router_t1's
    // last block), the warp top-k of 2-16 rows (router_t2 .. router_s4's last blocks) and router_topk's radix select
    // (FLASHPLAN_FUSE_SMALL=0), on four sets of router rows (seeded; tied; bunched by nine lanes and by three:
    // `rewrite_router`). Each set: the 16-row window against the CPU backend (its lowest-id maximum), row j bit for
    // bit across lone windows of 1-16 rows, and every window's logits with FLASHPLAN_FUSE_SMALL off == on
    // (router_topk's radix select: a wrong set or order of the experts changes the bits).
    let Some(name) = gpu_ready() else { return };
    const CONTEXT: u64 = 64;
    const PROMPT: usize = 16;
    println!("GPU: {name}; 512 experts, top-10, four sets of router rows");
    let mut rep = Report::new();
    let (cpu_body, gpu_body) = plans_of(&real_routing_config(CONTEXT), vec![1], CONTEXT);
    let vocab = cpu_body.config.vocab_size as usize;
    let hidden = cpu_body.config.hidden_size as usize;
    let cpu_body = Arc::new(cpu_body);
    let gpu_body = Arc::new(gpu_body);
    let seeded = seeded_weights(&cpu_body, 2027);
    for set in ["seeded", "tied", "bunched", "three-lanes"] {
        let fx = format!("512-experts-{set}");
        let mut w = seeded.clone();
        for (e, t) in cpu_body.weights.iter().zip(w.iter_mut()) {
            if let Some(t) = t.as_mut().filter(|_| e.name.ends_with("mlp.gate.weight")) {
                rewrite_router(t, hidden, set);
            }
        }
        let w = Arc::new(w);
        let mut cpu = CpuBackend::new(Arc::clone(&cpu_body), Arc::clone(&w));
        let mut gpu = CudaBackend::new(Arc::clone(&gpu_body), &w).expect("CUDA backend");
        let toks = seeded_tokens(PROMPT + 16, vocab, 11);
        let d = desc(&[(0, 0, PROMPT as u32, &toks[..PROMPT])], CHUNK);
        run_both(
            &mut cpu,
            &mut gpu,
            VariantKind::Prefill { chunk: CHUNK },
            &d,
        )
        .expect("prefill");
        let snapshot = gpu.slot_state(0);
        let cont = &toks[PROMPT..];
        let window = |win: u32| desc(&[(0, PROMPT as u32, win, &cont[..win as usize])], win);

        run_both(
            &mut cpu,
            &mut gpu,
            VariantKind::Lone { window: 16 },
            &window(16),
        )
        .expect("lone-w16");
        let r = rel(
            &gpu.io(IoBuf::Logits)[..16 * vocab],
            &cpu.io(IoBuf::Logits)[..16 * vocab],
            vocab,
        );
        let finite = gpu.io(IoBuf::Logits)[..16 * vocab]
            .iter()
            .all(|v| v.is_finite());
        rep.add(
            &fx,
            "lone-w16 logits vs CPU",
            r <= TOL && finite,
            format!("max rel diff {r:.2e}, finite {finite}"),
        );

        let mut runs: Vec<Vec<Vec<u32>>> = Vec::new();
        let mut identical = true;
        let original = gpu.set_fuse_small(true);
        let mut ran = original.is_ok();
        for on in [true, false] {
            ran &= gpu.set_fuse_small(on).is_ok();
            let mut rows_ref: Vec<Option<Vec<f32>>> = vec![None; 16];
            let mut out = Vec::new();
            for win in 1..=16u32 {
                gpu.set_slot_state(0, &snapshot).unwrap();
                ran &= gpu
                    .run(VariantKind::Lone { window: win }, &window(win))
                    .is_ok();
                let lg = &gpu.io(IoBuf::Logits)[..win as usize * vocab];
                for (j, slot) in rows_ref.iter_mut().enumerate().take(win as usize) {
                    identical &= same_bits_as(slot, &lg[j * vocab..(j + 1) * vocab]);
                }
                out.push(lg.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
            }
            runs.push(out);
        }
        ran &= gpu.set_fuse_small(original.unwrap_or(true)).is_ok();
        rep.add(
            &fx,
            "row invariance, lone windows 1-16 (fused and unfused)",
            ran && identical,
            "bit-identical rows".into(),
        );
        let same = ran && runs[0] == runs[1];
        rep.add(
            &fx,
            "FLASHPLAN_FUSE_SMALL off == on: lone windows 1-16",
            same,
            format!("bit-identical logits: {same}"),
        );
    }
    rep.assert_passed("GPU checks");
}
