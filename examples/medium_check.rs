//! Medium checkpoint check against transformers (issue 4, item 4).
//!
//! `scripts/medium_check.py` builds, with transformers 5.23.0, a checkpoint with the real config's widths and head
//! counts (4 layers: 3 GDN + 1 attention, PLE on layer index 1, 64 experts, a small PLE table, the MTP head), every
//! tensor random and BF16, and records transformers' f32 logits on those BF16 values: prefill (no cache), greedy
//! decoding (cache) and the MTP drafter over the prompt. This example loads that checkpoint with our loader,
//! compiles plans for its config, runs the same inputs on a backend and compares, printing a markdown table:
//!
//! - prefill in full chunks, and in irregular chunks (partial chunks, starts off the QSA block grid): every row;
//! - teacher-forced decode, one token a round (verify-s1-w1), fed transformers' greedy tokens so positions line up;
//! - teacher-forced windows of 16 rows (verify-s1-w16) and 4 rows (lone-w4) over the same tokens;
//! - the MTP drafter: one absorb step per prompt entry (mtp-absorb-s1-w1) from transformers' main streams.
//!
//! Tolerance, per row: max |ours - transformers| <= TOL x max |transformers' logit|, TOL = 1e-3. Both sides compute
//! in f32 from the same BF16 weights (our kernels keep activations, state and caches in f32), so what differs is
//! f32 summation order (and FMA contraction, expf/sinf ulps): ~1e-7 relative per operation, growing to ~1e-5 over
//! the four layers' ~30 chained operations at these widths (K up to 6144) with the norms' and gates' gains. 1e-3 is
//! 100x that, yet 4x below BF16's unit roundoff (2^-8 = 3.9e-3): a formula, indexing or precision error (an
//! activation stored in BF16, a wrong weight) shows at 1e-3 or above. Greedy tokens: at every compared row whose
//! transformers top-1/top-2 margin exceeds the row's absolute tolerance (TOL x max |logit|), our argmax must equal
//! transformers'; rows inside that margin are reported, not judged.
//!
//! Usage: `medium_check DIR [--backend cuda|cpu] [--chunk N] [--out FILE]` (default backend cuda, which compiles
//! sm_90a plans: NVRTC or cubins from `FLASHPLAN_KERNEL_CACHE`; `scripts/medium_check.sh` drives it on the H200).
//! Exits non-zero when a check fails. An example, not a test: it needs a multi-GB checkpoint made elsewhere by
//! Python, takes arguments, and is shipped as one stripped binary to the GPU machine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use flashplan_plan::{CompileOptions, DrafterForm, IoBuf, ModelConfig, RoundDesc, VariantKind};
use flashplan_runtime::backend::Backend;
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::cuda::{probe_gpu, CudaBackend};

/// Relative tolerance per row (see the module documentation).
const TOL: f32 = 1e-3;

/// Command line.
struct Args {
    dir: PathBuf,
    cuda: bool,
    chunk: u32,
    out: Option<PathBuf>,
}

fn args() -> anyhow::Result<Args> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        dir: PathBuf::new(),
        cuda: true,
        chunk: 32,
        out: None,
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--backend" => match it.next().as_deref() {
                Some("cuda") => a.cuda = true,
                Some("cpu") => a.cuda = false,
                other => bail!("--backend: expected cuda or cpu, got {other:?}"),
            },
            "--chunk" => a.chunk = it.next().context("--chunk N")?.parse()?,
            "--out" => a.out = Some(it.next().context("--out FILE")?.into()),
            d if !d.starts_with('-') && a.dir.as_os_str().is_empty() => a.dir = d.into(),
            other => bail!(
                "unknown argument {other:?}; usage: medium_check DIR [--backend cuda|cpu] [--chunk N] [--out FILE]"
            ),
        }
    }
    if a.dir.as_os_str().is_empty() {
        bail!("usage: medium_check DIR [--backend cuda|cpu] [--chunk N] [--out FILE]");
    }
    Ok(a)
}

/// The tensors `scripts/medium_check.py` wrote (`expected.safetensors`).
struct Expected {
    bytes: Vec<u8>,
}

impl Expected {
    fn open(path: &Path) -> anyhow::Result<Expected> {
        Ok(Expected {
            bytes: std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        })
    }
    /// An f32 tensor: (shape, values).
    fn f32(&self, name: &str) -> anyhow::Result<(Vec<usize>, Vec<f32>)> {
        let st = safetensors::SafeTensors::deserialize(&self.bytes)?;
        let t = st.tensor(name).with_context(|| format!("tensor {name}"))?;
        if t.dtype() != safetensors::Dtype::F32 {
            bail!("{name}: expected F32, got {:?}", t.dtype());
        }
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok((t.shape().to_vec(), v))
    }
    /// An i64 tensor of token ids.
    fn ids(&self, name: &str) -> anyhow::Result<Vec<u32>> {
        let st = safetensors::SafeTensors::deserialize(&self.bytes)?;
        let t = st.tensor(name).with_context(|| format!("tensor {name}"))?;
        if t.dtype() != safetensors::Dtype::I64 {
            bail!("{name}: expected I64, got {:?}", t.dtype());
        }
        Ok(t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as u32)
            .collect())
    }
    fn has(&self, name: &str) -> bool {
        safetensors::SafeTensors::deserialize(&self.bytes)
            .map(|st| st.tensor(name).is_ok())
            .unwrap_or(false)
    }
}

/// The lowest-id maximum (transformers' `argmax` on ties).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

/// Top-1 minus top-2 of a row.
fn margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Accumulated comparison of rows against transformers.
#[derive(Default)]
struct Cmp {
    rows: usize,
    worst: f32,
    worst_row: usize,
    decisive: usize,
    decisive_equal: usize,
    close: usize,
    close_equal: usize,
}

impl Cmp {
    /// Compares one row of ours with transformers' (row index `r` for the report).
    fn row(&mut self, r: usize, ours: &[f32], tf: &[f32]) {
        let m = tf.iter().fold(0f32, |a, x| a.max(x.abs()));
        let d = ours
            .iter()
            .zip(tf)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        let rel = d / m.max(1e-30);
        if rel > self.worst || rel.is_nan() {
            self.worst = if rel.is_nan() { f32::INFINITY } else { rel };
            self.worst_row = r;
        }
        self.rows += 1;
        let equal = argmax(ours) == argmax(tf);
        if margin(tf) > TOL * m {
            self.decisive += 1;
            self.decisive_equal += equal as usize;
        } else {
            self.close += 1;
            self.close_equal += equal as usize;
        }
    }
    fn ok(&self) -> bool {
        self.rows > 0 && self.worst <= TOL && self.decisive_equal == self.decisive
    }
    fn detail(&self) -> String {
        format!(
            "{} rows, max rel diff {:.2e} (row {}), argmax equal {}/{} rows with margin > tol{}",
            self.rows,
            self.worst,
            self.worst_row,
            self.decisive_equal,
            self.decisive,
            if self.close > 0 {
                format!(
                    "; {} rows within tol of a tie ({} equal, not judged)",
                    self.close, self.close_equal
                )
            } else {
                String::new()
            }
        )
    }
}

fn desc(pos: u32, rows: u32, toks: &[u32], window: u32) -> RoundDesc {
    RoundDesc::single(pos, rows, toks, window)
}

/// The report: markdown rows, and whether every check passed.
struct Report {
    lines: Vec<String>,
    failed: usize,
}

impl Report {
    fn add(&mut self, check: &str, ok: bool, detail: String) {
        let line = format!(
            "| medium | {check} | {} | {detail} |",
            if ok { "pass" } else { "FAIL" }
        );
        println!("{line}");
        self.lines.push(line);
        self.failed += (!ok) as usize;
    }
    fn info(&mut self, check: &str, detail: String) {
        let line = format!("| medium | {check} | info | {detail} |");
        println!("{line}");
        self.lines.push(line);
    }
}

/// Prefills the prompt into slot 0 (reset first) in chunks of the given sizes (cycled), comparing every row's
/// logits with transformers' prefill logits.
fn prefill(
    be: &mut dyn Backend,
    chunk: u32,
    prompt: &[u32],
    sizes: &[usize],
    tf: &[f32],
    vocab: usize,
) -> anyhow::Result<Cmp> {
    be.reset_slot(0);
    let mut c = Cmp::default();
    let (mut pos, mut i) = (0usize, 0usize);
    while pos < prompt.len() {
        let rows = sizes[i % sizes.len()]
            .min(chunk as usize)
            .min(prompt.len() - pos);
        i += 1;
        be.run(
            VariantKind::Prefill { chunk },
            &desc(pos as u32, rows as u32, &prompt[pos..pos + rows], chunk),
        )?;
        let lg = be.io(IoBuf::Logits);
        for r in 0..rows {
            let p = pos + r;
            c.row(
                p,
                &lg[r * vocab..(r + 1) * vocab],
                &tf[p * vocab..(p + 1) * vocab],
            );
        }
        pos += rows;
    }
    Ok(c)
}

/// After a prefill: teacher-forced windows of `window` rows over transformers' greedy tokens (pending token, then
/// the next ones as drafts), comparing row j of a window at offset t with transformers' greedy row t + j + 1.
/// Returns the comparison and the number of rounds whose keep count fell short (the window after such a round is
/// not run: the slot did not commit the rows).
fn windows(
    be: &mut dyn Backend,
    kind: VariantKind,
    n: usize,
    greedy: &[u32],
    tf: &[f32],
    vocab: usize,
) -> anyhow::Result<(Cmp, usize)> {
    let window = kind.shape().1 as usize;
    let steps = greedy.len();
    let mut c = Cmp::default();
    let mut t = 0usize;
    let mut short = 0;
    // Rows t..t+rows feed greedy[t..]; their logits are greedy rows t+1.. (there are `steps` of them, 0..steps).
    while t + 1 < steps {
        let rows = window.min(steps - 1 - t);
        be.run(
            kind,
            &desc(
                (n + t) as u32,
                rows as u32,
                &greedy[t..t + rows],
                window as u32,
            ),
        )?;
        let lg = be.io(IoBuf::Logits);
        for j in 0..rows {
            let g = t + j + 1;
            c.row(
                g,
                &lg[j * vocab..(j + 1) * vocab],
                &tf[g * vocab..(g + 1) * vocab],
            );
        }
        let keep = be.io(IoBuf::Keep)[0].to_bits() as usize;
        if keep < rows {
            short += 1;
            break;
        }
        t += rows;
    }
    Ok((c, short))
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    let t0 = std::time::Instant::now();
    let text = std::fs::read_to_string(a.dir.join("config.json")).context("config.json")?;
    let cfg = ModelConfig::from_json_str(&text)?;
    let exp = Expected::open(&a.dir.join("expected.safetensors"))?;
    let info: serde_json::Value = std::fs::read_to_string(a.dir.join("expected.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    let prompt = exp.ids("prompt_ids")?;
    let greedy = exp.ids("greedy_ids")?;
    let (pshape, tf_prefill) = exp.f32("prefill_logits")?;
    let (_, tf_greedy) = exp.f32("greedy_logits")?;
    let vocab = cfg.vocab_size as usize;
    if pshape != [prompt.len(), vocab] {
        bail!(
            "prefill_logits shape {pshape:?}, expected [{}, {vocab}]",
            prompt.len()
        );
    }
    let n = prompt.len();
    let context = ((n + greedy.len() + 64).next_power_of_two()) as u64;
    let opts = CompileOptions {
        arch: if a.cuda {
            "sm_90a".into()
        } else {
            "cpu".into()
        },
        max_depth: 15,
        streams: vec![1],
        context,
        prefill_chunk: a.chunk,
    };
    let body = flashplan_compiler::compile(&cfg, &opts, &Default::default(), "medium", |_, _| {})
        .context("compiling plans")?
        .body;
    let t_compile = t0.elapsed().as_secs_f64();
    let w = load_checkpoint(&a.dir, &body, &LoadOptions::default())
        .context("loading the checkpoint")?;
    let has_mtp = w.has_mtp;
    let loaded_gb = w.tensors.iter().flatten().map(|t| t.len()).sum::<usize>() as f64 * 2.0 / 1e9;
    let t_load = t0.elapsed().as_secs_f64();
    let body = Arc::new(body);
    let (mut be, backend): (Box<dyn Backend>, String) = if a.cuda {
        let gpu = probe_gpu().map_err(|e| anyhow::anyhow!("no usable GPU: {e}"))?;
        let b = CudaBackend::new(Arc::clone(&body), &w.tensors)?;
        drop(w);
        (Box::new(b), format!("CUDA backend, {gpu}"))
    } else {
        (
            Box::new(CpuBackend::new(Arc::clone(&body), Arc::new(w.tensors))),
            "CPU backend".into(),
        )
    };
    let t_start = t0.elapsed().as_secs_f64();
    println!(
        "medium checkpoint {}: hidden {}, {} layers {:?}, {} experts top-{}, vocab {vocab}, PLE layers {:?}; {backend}",
        a.dir.display(),
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.layer_types,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.ple_layer_ids,
    );
    println!(
        "reference: transformers {} ({}), {}; prompt {n} tokens, {} greedy steps; tolerance max|diff| <= {TOL} x max|logit| per row",
        info["transformers"].as_str().unwrap_or("?"),
        info["device"].as_str().unwrap_or("?"),
        info["compute"].as_str().unwrap_or("?"),
        greedy.len()
    );
    println!("| model | check | result | detail |\n|---|---|---|---|");
    let mut rep = Report {
        lines: Vec::new(),
        failed: 0,
    };
    let c = &info["checks"];
    rep.info(
        "checkpoint",
        format!(
            "{loaded_gb:.2} GB of BF16 weights ({} parameters), MTP head {}; plans compiled in {t_compile:.1} s, \
             loaded by {t_load:.1} s, backend up by {t_start:.1} s; reference margins: router min top-k logit gap \
             {:.2e}, greedy min top-1/top-2 gap {:.2e}, max |logit| {:.2}",
            info["parameters"].as_u64().unwrap_or(0),
            if has_mtp { "loaded" } else { "absent" },
            c["router_min_topk_logit_gap"].as_f64().unwrap_or(f64::NAN),
            c["greedy_min_top1_top2_gap"].as_f64().unwrap_or(f64::NAN),
            info["max_abs_logit"].as_f64().unwrap_or(f64::NAN),
        ),
    );

    // Prefill: full chunks, then irregular ones.
    let chunk = a.chunk;
    for (label, sizes) in [
        (
            format!("prefill-c{chunk}, full chunks"),
            vec![chunk as usize],
        ),
        (
            format!("prefill-c{chunk}, chunks of 1, 7, {}, 3, ...", chunk - 1),
            vec![1, 7, chunk as usize - 1, 3],
        ),
    ] {
        match prefill(be.as_mut(), chunk, &prompt, &sizes, &tf_prefill, vocab) {
            Ok(cmp) => {
                let first = be.io(IoBuf::Sampled)[0].to_bits();
                let ok = cmp.ok() && (first == greedy[0] || margin(&tf_greedy[..vocab]) <= TOL);
                rep.add(
                    &label,
                    ok,
                    format!(
                        "{}; sampled {first} vs transformers {}",
                        cmp.detail(),
                        greedy[0]
                    ),
                );
            }
            Err(e) => rep.add(&label, false, format!("{e:#}")),
        }
    }

    // Teacher-forced decode windows after a full-chunk prefill.
    for kind in [
        VariantKind::Verify {
            streams: 1,
            window: 1,
        },
        VariantKind::Verify {
            streams: 1,
            window: 16,
        },
        VariantKind::Lone { window: 4 },
    ] {
        let label = format!("{} teacher-forced decode", kind.name());
        let r = prefill(
            be.as_mut(),
            chunk,
            &prompt,
            &[chunk as usize],
            &tf_prefill,
            vocab,
        )
        .and_then(|_| windows(be.as_mut(), kind, n, &greedy, &tf_greedy, vocab));
        match r {
            Ok((cmp, short)) => rep.add(
                &label,
                cmp.ok() && short == 0,
                format!(
                    "{}{}",
                    cmp.detail(),
                    if short > 0 {
                        "; a window kept fewer rows than fed (stopped there)"
                    } else {
                        ""
                    }
                ),
            ),
            Err(e) => rep.add(&label, false, format!("{e:#}")),
        }
    }

    // The MTP drafter: one absorb step per prompt entry, from transformers' main streams.
    if has_mtp && exp.has("mtp_logits") {
        let hcw = cfg.hc_width() as usize;
        let (_, streams) = exp.f32("mtp_streams")?;
        let toks = exp.ids("mtp_tokens")?;
        let (_, tf_mtp) = exp.f32("mtp_logits")?;
        be.reset_slot(0);
        let mut cmp = Cmp::default();
        let kind = VariantKind::MtpAbsorb {
            streams: 1,
            window: 1,
            form: DrafterForm::Checkpoint,
        };
        let mut err = None;
        for i in 0..toks.len() {
            be.write_io(IoBuf::MainStreams, 0, &streams[i * hcw..(i + 1) * hcw]);
            if let Err(e) = be.run(kind, &desc(i as u32, 1, &[toks[i]], 1)) {
                err = Some(e);
                break;
            }
            cmp.row(
                i,
                &be.io(IoBuf::Logits)[..vocab],
                &tf_mtp[i * vocab..(i + 1) * vocab],
            );
        }
        match err {
            None => rep.add("mtp-absorb-s1-w1 vs reference MTP", cmp.ok(), cmp.detail()),
            Some(e) => rep.add("mtp-absorb-s1-w1 vs reference MTP", false, e.to_string()),
        }
    } else {
        rep.info(
            "mtp",
            "no MTP head in the checkpoint or no reference: skipped".into(),
        );
    }
    rep.info(
        "total",
        format!(
            "{:.1} s; {} checks failed",
            t0.elapsed().as_secs_f64(),
            rep.failed
        ),
    );
    if let Some(out) = &a.out {
        let mut s = String::from("| model | check | result | detail |\n|---|---|---|---|\n");
        for l in &rep.lines {
            s.push_str(l);
            s.push('\n');
        }
        std::fs::write(out, s).with_context(|| format!("writing {}", out.display()))?;
    }
    if rep.failed > 0 {
        bail!("{} medium checks failed", rep.failed);
    }
    Ok(())
}
