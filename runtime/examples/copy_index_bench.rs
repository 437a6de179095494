//! Benchmark of the copy index (rounds.md section 2) and the keyed sampler (section 4).
//!
//! Run: `cargo run --release -p flashplan-runtime --example copy_index_bench`
//!
//! Context: 250k tokens from a small LCG over a 50k vocabulary, with about 20% of the tokens in spans
//! copied from earlier in the context (so lookups hit). Figures go to docs/copy-index.md.

use flashplan_runtime::copy_index::CopyIndex;
use flashplan_runtime::sampler::{sample, SamplingParams};
use std::hint::black_box;
use std::time::{Duration, Instant};

const CONTEXT: usize = 250_000;
const VOCAB: u64 = 50_000;
const LOOKUPS: usize = 10_000;
const WANT: usize = 16;

/// A 64-bit LCG (Knuth MMIX constants); the high bits are used.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `len` tokens: fresh LCG tokens, with spans of 16..80 tokens copied from earlier positions making up
/// about 20% of the total.
fn context(len: usize, seed: u64) -> (Vec<u32>, usize) {
    let mut rng = Lcg(seed);
    let mut out: Vec<u32> = Vec::with_capacity(len);
    let mut copied = 0usize;
    while out.len() < len {
        // A copy starts with probability 1/190 per fresh token; mean span 48 -> ~20% copied.
        if out.len() > 1000 && rng.below(190) == 0 {
            let span = 16 + rng.below(65) as usize;
            let from = rng.below((out.len() - span) as u64) as usize;
            for i in 0..span {
                if out.len() == len {
                    break;
                }
                let t = out[from + i];
                out.push(t);
                copied += 1;
            }
        } else {
            out.push(rng.below(VOCAB) as u32);
        }
    }
    (out, copied)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn pct(v: &[Duration], p: f64) -> Duration {
    // `v` sorted.
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    let (ctx, copied) = context(CONTEXT, 0x5EED);
    println!(
        "context: {} tokens, vocab {}, {:.1}% in copied spans",
        ctx.len(),
        VOCAB,
        100.0 * copied as f64 / ctx.len() as f64
    );
    println!();
    println!("| measurement | figure |");
    println!("|---|---|");

    // 1. Index the whole context in one extend (a prompt), 5 runs.
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let mut ix = CopyIndex::new();
        ix.extend(black_box(&ctx));
        runs.push(t.elapsed());
        black_box(&ix);
    }
    let mut sorted = runs.clone();
    let med = median(&mut sorted);
    println!(
        "| extend 250k tokens in one call (median of 5) | {:.2} ms ({:.1} ns/token) |",
        med.as_secs_f64() * 1e3,
        med.as_secs_f64() * 1e9 / ctx.len() as f64
    );
    println!(
        "| extend 250k tokens in one call (best of 5) | {:.2} ms |",
        sorted[0].as_secs_f64() * 1e3
    );

    // 2. Extend in rounds of 4 tokens (decode-like).
    let t = Instant::now();
    let mut ix = CopyIndex::new();
    for chunk in ctx.chunks(4) {
        ix.extend(black_box(chunk));
    }
    let el = t.elapsed();
    black_box(&ix);
    println!(
        "| extend 250k tokens 4 at a time | {:.2} ms ({:.1} ns/token) |",
        el.as_secs_f64() * 1e3,
        el.as_secs_f64() * 1e9 / ctx.len() as f64
    );

    // 3. Lookups: index the first 240k tokens, then 10k times extend by one token and propose(16).
    let base = CONTEXT - LOOKUPS;
    let mut ix = CopyIndex::new();
    ix.extend(&ctx[..base]);
    let mut times = Vec::with_capacity(LOOKUPS);
    let mut hits = 0usize;
    for &t in &ctx[base..] {
        ix.extend(&[t]);
        let start = Instant::now();
        let p = ix.propose(black_box(WANT));
        times.push(start.elapsed());
        if p.is_some() {
            hits += 1;
        }
        black_box(p);
    }
    times.sort_unstable();
    println!(
        "| propose({WANT}) on a 240k-250k context, median of {LOOKUPS} | {:.3} us |",
        us(pct(&times, 0.5))
    );
    println!(
        "| propose({WANT}) p99 / max | {:.3} us / {:.3} us |",
        us(pct(&times, 0.99)),
        us(times[times.len() - 1])
    );
    println!(
        "| propose({WANT}) hit rate | {:.1}% ({hits}/{LOOKUPS}) |",
        100.0 * hits as f64 / LOOKUPS as f64
    );

    // 4. Worst case for the chain walk: a constant 250k-token context (every window the same key).
    let same = vec![7u32; CONTEXT];
    let t = Instant::now();
    let mut ix = CopyIndex::new();
    ix.extend(&same);
    let el = t.elapsed();
    let mut times = Vec::with_capacity(1000);
    for _ in 0..1000 {
        let start = Instant::now();
        black_box(ix.propose(black_box(WANT)));
        times.push(start.elapsed());
    }
    times.sort_unstable();
    println!(
        "| constant 250k context: extend / propose({WANT}) median | {:.2} ms / {:.3} us |",
        el.as_secs_f64() * 1e3,
        us(pct(&times, 0.5))
    );

    // 5. The keyed sampler over a full-size vocabulary.
    let v = 248_320usize;
    let logits: Vec<f32> = (0..v)
        .map(|i| {
            let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (x as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
        })
        .collect();
    let cases = [
        ("greedy", SamplingParams::greedy()),
        (
            "T=1, no filters",
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 1,
            },
        ),
        (
            "T=0.7, top_k=40",
            SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 1.0,
                min_p: 0.0,
                seed: 1,
            },
        ),
        (
            "T=0.7, top_p=0.9",
            SamplingParams {
                temperature: 0.7,
                top_k: 0,
                top_p: 0.9,
                min_p: 0.0,
                seed: 1,
            },
        ),
        (
            "T=0.7, top_k=40, top_p=0.9, min_p=0.05",
            SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                seed: 1,
            },
        ),
    ];
    for (name, p) in cases {
        let mut times = Vec::with_capacity(50);
        for pos in 0..50u64 {
            let start = Instant::now();
            black_box(sample(black_box(&logits), &p, pos));
            times.push(start.elapsed());
        }
        let m = median(&mut times);
        println!(
            "| sample, V = {v}, {name} (median of 50) | {:.1} us |",
            us(m)
        );
    }
}
