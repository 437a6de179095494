//! The keyed sampler (rounds.md section 4).
//!
//! A sampled token must not depend on how many rows or streams shared its forward, or on whether drafts
//! existed. So the random number for a candidate token is a pure function of `(seed, position, id)`, where
//! `position` is the absolute index the sampled token will occupy in the stream (prompt tokens are
//! `0..n-1`, the first reply token is `n`). Sampling is Gumbel-max over the candidates that survive the
//! top-k, top-p and min-p filters, so drafting (MTP chains) and verifying draw the very same token for the
//! same row.
//!
//! Everything here is pure host code: no state, no allocation on the unfiltered path.

use sha2::{Digest, Sha256};
use std::cmp::Ordering;

/// The splitmix64 finaliser (rounds.md section 4), in wrapping 64-bit arithmetic:
/// `z = (z ^ z>>30) * 0xBF58476D1CE4E5B9; z = (z ^ z>>27) * 0x94D049BB133111EB; z ^ z>>31`.
#[inline]
pub fn mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform random number in the open interval (0, 1) for token `id` sampled at absolute `position`
/// of a stream with `seed` (rounds.md section 4):
///
/// ```text
/// x = mix(seed + 0x9E3779B97F4A7C15)
/// x = mix(x ^ (position * 0xD1B54A32D192ED03))
/// x = mix(x ^ id)
/// u = (x >> 11) * 2^-53 + 2^-54
/// ```
///
/// `position` is the absolute index the sampled token will occupy (prompt tokens are `0..n-1`, the
/// first reply token is `n`). The result is never 0 nor 1, so `ln(-ln u)` is always finite.
#[inline]
pub fn uniform(seed: u64, position: u64, id: u32) -> f64 {
    let x = mix(seed.wrapping_add(0x9E37_79B9_7F4A_7C15));
    let x = mix(x ^ position.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let x = mix(x ^ u64::from(id));
    const TWO_M53: f64 = 1.0 / 9_007_199_254_740_992.0; // 2^-53
    const TWO_M54: f64 = TWO_M53 * 0.5; // 2^-54
    (x >> 11) as f64 * TWO_M53 + TWO_M54
}

/// The Gumbel noise `-ln(-ln u)` for `(seed, position, id)` (rounds.md section 4).
#[inline]
fn gumbel(seed: u64, position: u64, id: u32) -> f64 {
    -(-uniform(seed, position, id).ln()).ln()
}

/// The default seed of a request without one (rounds.md section 4): the first 8 bytes, little-endian,
/// of SHA-256 over the prompt token ids written in decimal and joined by commas (`"1,2,3"`), with the
/// top bit cleared (so the seed fits an `i64` / JSON integer). `[1, 2, 3]` gives
/// `2959428052538452618`; an empty prompt hashes the empty string.
pub fn prompt_seed(prompt: &[u32]) -> u64 {
    let mut hasher = Sha256::new();
    let mut buf = String::with_capacity(prompt.len() * 7);
    for (i, id) in prompt.iter().enumerate() {
        if i > 0 {
            buf.push(',');
        }
        buf.push_str(&id.to_string());
        if buf.len() >= 1 << 16 {
            hasher.update(buf.as_bytes());
            buf.clear();
        }
    }
    hasher.update(buf.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first) & (u64::MAX >> 1)
}

pub use flashplan_plan::desc::{SamplingError, SamplingParams};

/// A logit as used for ordering: NaN counts as negative infinity (never chosen over a number), and
/// -0.0 as 0.0 (so `total_cmp` ranks them equal, like `==`).
#[inline]
fn key(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else {
        l + 0.0
    }
}

/// Candidate order: logit descending, then id ascending.
#[inline]
fn by_rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The largest logit, NaN ignored (`-inf` when there is none). Lane-wise so that it vectorises.
fn max_logit(logits: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &l in acc.iter().chain(rest) {
        if l > m {
            m = l;
        }
    }
    m
}

/// The lowest-id maximum of `logits`; NaN counts as `-inf`, so with no number at all the answer is 0.
/// One lane-wise pass (value and first index per lane) so that it vectorises.
fn argmax_lowest(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut idx = [u32::MAX; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest_at = logits.len() - chunks.remainder().len();
    for (ci, c) in chunks.enumerate() {
        let base = (ci * LANES) as u32;
        for j in 0..LANES {
            let better = c[j] > acc[j];
            acc[j] = if better { c[j] } else { acc[j] };
            idx[j] = if better { base + j as u32 } else { idx[j] };
        }
    }
    let mut best = f32::NEG_INFINITY;
    let mut best_i = u32::MAX;
    let tail = logits[rest_at..]
        .iter()
        .enumerate()
        .map(|(i, &l)| (l, (rest_at + i) as u32));
    for (l, i) in acc.iter().copied().zip(idx).chain(tail) {
        if l > best || (l == best && l > f32::NEG_INFINITY && i < best_i) {
            best = l;
            best_i = i;
        }
    }
    if best_i == u32::MAX {
        0
    } else {
        best_i
    }
}

/// The top `k` candidates `(logit, id)` by (logit descending, id ascending), in no particular order
/// (`0 < k < logits.len()`). Scans once with a growing threshold: a logit at or below the current k-th
/// best is skipped with one comparison (ids only grow, so an equal logit ranks below it).
fn top_k_candidates(logits: &[f32], k: usize) -> Vec<(f32, u32)> {
    let cap = (4 * k).max(4096);
    let mut buf: Vec<(f32, u32)> = Vec::with_capacity(cap);
    let mut thr = f32::NEG_INFINITY;
    let mut have_thr = false;
    for (i, &l) in logits.iter().enumerate() {
        let l = key(l);
        if have_thr && l <= thr {
            continue;
        }
        buf.push((l, i as u32));
        if buf.len() == cap {
            buf.select_nth_unstable_by(k - 1, by_rank);
            buf.truncate(k);
            thr = buf[k - 1].0;
            have_thr = true;
        }
    }
    if buf.len() > k {
        buf.select_nth_unstable_by(k - 1, by_rank);
        buf.truncate(k);
    }
    buf
}

/// The Gumbel-max score of one candidate: `logit / T - ln(-ln u)` in f64 (rounds.md section 4).
#[inline]
fn score(l: f32, t: f64, seed: u64, position: u64, id: u32) -> f64 {
    f64::from(key(l)) / t + gumbel(seed, position, id)
}

/// Gumbel-max over `(logit, id)` candidates given in any order: argmax of `logit/T - ln(-ln u)`,
/// ties to the lower id; 0 when there is no candidate.
fn gumbel_max<I: Iterator<Item = (f32, u32)>>(cands: I, t: f64, seed: u64, position: u64) -> u32 {
    let mut best_id = u32::MAX;
    let mut best = f64::NEG_INFINITY;
    let mut found = false;
    for (l, id) in cands {
        let s = score(l, t, seed, position, id);
        if !found || s > best || (s == best && id < best_id) {
            best = s;
            best_id = id;
            found = true;
        }
    }
    if found {
        best_id
    } else {
        0
    }
}

/// An upper bound of the Gumbel noise over every `u` [`uniform`] can return: `u <= 1 - 2^-54`, so
/// `-ln(-ln u) <= -ln(1 - u) <= 54 ln 2 < 37.5`.
const GUMBEL_MAX: f64 = 37.5;

/// Gumbel-max over every id of `logits`, equal to [`gumbel_max`] over all of them but pruned: a
/// candidate is skipped, without its logarithms, when an upper bound of its score is below the best
/// score so far. Bounds: `-ln(-ln u) <= -ln(1 - u) <= -e ln 2` where `2^e <= 1 - u` (from the exponent
/// bits), and `GUMBEL_MAX` before `u` is even computed. Skips are strict (with a margin far above the
/// rounding error), so ties are still resolved exactly.
fn gumbel_max_all(logits: &[f32], t: f64, seed: u64, position: u64) -> u32 {
    let m = max_logit(logits);
    if !m.is_finite() {
        // No number, or an infinite logit: the first id holding the extreme value wins.
        return argmax_lowest(logits);
    }
    let inv_t = 1.0 / t;
    let first = argmax_lowest(logits);
    let mut best_id = first;
    let mut best = score(m, t, seed, position, first);
    let mut cut = best - 1e-6 * (1.0 + best.abs());
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() || l == f32::NEG_INFINITY {
            continue; // score -inf, never above a finite best
        }
        let lt = f64::from(l) * inv_t;
        if lt + GUMBEL_MAX < cut {
            continue;
        }
        let id = i as u32;
        let u = uniform(seed, position, id);
        let e = (((1.0 - u).to_bits() >> 52) & 0x7ff) as i64 - 1023;
        if lt + (-e) as f64 * std::f64::consts::LN_2 < cut {
            continue;
        }
        let s = f64::from(l) / t - (-u.ln()).ln();
        if s > best || (s == best && id < best_id) {
            best = s;
            best_id = id;
            cut = best - 1e-6 * (1.0 + best.abs());
        }
    }
    best_id
}

/// Samples the token for one row (rounds.md section 4).
///
/// - `logits`: the row's `V` logits (f32, one per token id; `V = 248320` at full size).
/// - `position`: the absolute index the sampled token will occupy in the stream (prompt tokens are
///   `0..n-1`, the first reply token is `n`; row `r` of a window starting at `p` samples for `p + r + 1`).
///
/// Greedy (`temperature == 0`) returns the lowest-id maximum. Otherwise the candidates are ordered by
/// (logit descending, id ascending) and cut to the first `top_k`; with `p_i = softmax(logit_i / T)` over
/// those candidates (computed in f64 with max subtraction, the sum in id order), top-p keeps the
/// shortest prefix whose cumulative mass reaches `top_p` and min-p keeps those with
/// `p_i >= min_p * max p`. The sample is the argmax over the kept candidates of
/// `logit / T - ln(-ln u(seed, position, id))`, ties to the lower id.
///
/// NaN logits count as negative infinity. An empty `logits` gives 0. Cost: O(V) in every case; without
/// filters no sort and (by pruning) few logarithms; with top-k a selection plus O(k log k); with top-p /
/// min-p one `exp` per candidate plus a sort of only the candidates near the cut (found from a histogram
/// of probability exponents). Parameters are assumed validated ([`SamplingParams::validate`]);
/// out-of-range values do not panic.
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    if logits.is_empty() {
        return 0;
    }
    // Greedy also covers a negative or NaN temperature (rejected by `validate`).
    if params.is_greedy() || params.temperature.is_nan() || params.temperature < 0.0 {
        return argmax_lowest(logits);
    }
    let v = logits.len();
    let t = f64::from(params.temperature);
    let seed = params.seed;
    let k = params.top_k as usize;
    let use_k = k > 0 && k < v;
    let use_p = params.top_p < 1.0;
    let use_min = params.min_p > 0.0;

    if !use_k && !use_p && !use_min {
        // Plain Gumbel-max over every id: no sort, no allocation.
        return gumbel_max_all(logits, t, seed, position);
    }

    // Candidates (logit, id) in id order, NaN mapped to -inf.
    let cands: Vec<(f32, u32)> = if use_k {
        let mut c = top_k_candidates(logits, k);
        c.sort_unstable_by_key(|c| c.1);
        c
    } else {
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (key(l), i as u32))
            .collect()
    };
    if !use_p && !use_min {
        return gumbel_max(cands.iter().copied(), t, seed, position);
    }

    // Softmax weights over the candidates, in f64 with max subtraction; the sum runs in id order.
    let max_l = cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.0));
    if !max_l.is_finite() {
        // All -inf (or an +inf logit): the distribution is degenerate; take the best candidate.
        return cands.iter().copied().min_by(by_rank).map_or(0, |c| c.1);
    }
    let max_f = f64::from(max_l);
    let weight = |l: f32| ((f64::from(l) - max_f) / t).exp();
    let w: Vec<f64> = cands.iter().map(|c| weight(c.0)).collect();
    let z: f64 = w.iter().sum();
    let min_keep = f64::from(params.min_p) * (weight(max_l) / z);
    let top_p = f64::from(params.top_p);

    // Both filters keep a prefix of the ranked candidates (p is monotone in the logit), so only a
    // prefix needs ranking. A histogram of the weights by binary exponent finds a logit bound whose
    // candidates hold at least `top_p` of the mass; min-p drops everything below `min_keep` outright.
    let mut floor = f32::NEG_INFINITY;
    if use_p {
        const BUCKETS: usize = 1100;
        let bucket =
            |x: f64| ((1023 - ((x.to_bits() >> 52) & 0x7ff) as i64).clamp(0, 1099)) as usize;
        let mut mass = [0.0f64; BUCKETS];
        for &x in &w {
            mass[bucket(x)] += x;
        }
        let target = top_p * z * (1.0 + 1e-9);
        let mut cum = 0.0;
        let mut last = BUCKETS - 1;
        for (b, &m) in mass.iter().enumerate() {
            cum += m;
            if cum >= target {
                last = b;
                break;
            }
        }
        if last < BUCKETS - 1 {
            floor = cands
                .iter()
                .zip(&w)
                .filter(|(_, &x)| bucket(x) <= last)
                .fold(f32::INFINITY, |f, (c, _)| f.min(c.0));
        }
    }
    let rank_and_cut = |floor: f32| -> Option<Vec<(f32, u32)>> {
        let mut head: Vec<(f32, u32, f64)> = cands
            .iter()
            .zip(&w)
            .filter(|(c, &x)| c.0 >= floor && x / z >= min_keep)
            .map(|(c, &x)| (c.0, c.1, x / z))
            .collect();
        head.sort_unstable_by(|a, b| by_rank(&(a.0, a.1), &(b.0, b.1)));
        let mut kept = head.len();
        if use_p {
            let mut cum = 0.0f64;
            let mut reached = false;
            for (i, c) in head.iter().enumerate() {
                cum += c.2;
                if cum >= top_p {
                    kept = i + 1;
                    reached = true;
                    break;
                }
            }
            if !reached && floor > f32::NEG_INFINITY {
                return None; // the bound cut too much (rounding): rank everything
            }
        }
        if use_min {
            kept = head[..kept].iter().take_while(|c| c.2 >= min_keep).count();
        }
        kept = kept.max(1).min(head.len());
        Some(head[..kept].iter().map(|c| (c.0, c.1)).collect())
    };
    let kept = match rank_and_cut(floor) {
        Some(kept) => kept,
        None => rank_and_cut(f32::NEG_INFINITY).unwrap_or_default(),
    };
    if kept.is_empty() {
        return cands.iter().copied().min_by(by_rank).map_or(0, |c| c.1);
    }
    gumbel_max(kept.into_iter(), t, seed, position)
}

/// The softmax probability of `token` at temperature 1 (used by the MTP confidence rule, rounds.md
/// section 2), computed in f64 with max subtraction. Returns 0 for an out-of-range token or a row
/// without a finite logit; NaN logits count as negative infinity.
pub fn token_prob(logits: &[f32], token: u32) -> f32 {
    let Some(&lt) = logits.get(token as usize) else {
        return 0.0;
    };
    let max_l = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(key(l)));
    if !max_l.is_finite() {
        return 0.0;
    }
    let max_l = f64::from(max_l);
    let z: f64 = logits
        .iter()
        .map(|&l| (f64::from(key(l)) - max_l).exp())
        .sum();
    ((f64::from(key(lt)) - max_l).exp() / z) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, top_k: u32, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k,
            top_p,
            min_p,
            seed,
        }
    }

    #[test]
    fn uniform_test_vectors() {
        assert_eq!(uniform(42, 10, 7), 0.0659435142291927);
        assert_eq!(uniform(42, 10, 8), 0.9209607595807419);
        assert_eq!(uniform(0, 0, 0), 0.20310281705476102);
        assert_eq!(uniform(1234, 248044, 248043), 0.941275353104843);
    }

    #[test]
    fn mix_is_splitmix64_finaliser() {
        assert_eq!(mix(0), 0);
        // splitmix64 first output for state 0: mix(0x9E3779B97F4A7C15).
        assert_eq!(mix(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn prompt_seed_vector() {
        assert_eq!(prompt_seed(&[1, 2, 3]), 2959428052538452618);
        assert!(prompt_seed(&[]) < 1 << 63);
        // Long prompts (the buffer flushes) hash the same text as one piece.
        let long: Vec<u32> = (0..20_000).collect();
        let text = long
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let d = Sha256::digest(text.as_bytes());
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        assert_eq!(prompt_seed(&long), u64::from_le_bytes(b) & (u64::MAX >> 1));
    }

    #[test]
    fn validate_ranges() {
        assert!(SamplingParams::greedy().validate().is_ok());
        assert!(SamplingParams::greedy().is_greedy());
        assert!(params(0.7, 40, 0.9, 0.05, 1).validate().is_ok());
        assert_eq!(
            params(-1.0, 0, 1.0, 0.0, 0).validate(),
            Err(SamplingError::Temperature(-1.0))
        );
        assert!(matches!(
            params(f32::NAN, 0, 1.0, 0.0, 0).validate(),
            Err(SamplingError::Temperature(_))
        ));
        assert_eq!(
            params(f32::INFINITY, 0, 1.0, 0.0, 0).validate(),
            Err(SamplingError::Temperature(f32::INFINITY))
        );
        assert_eq!(
            params(1.0, 0, 0.0, 0.0, 0).validate(),
            Err(SamplingError::TopP(0.0))
        );
        assert_eq!(
            params(1.0, 0, 1.5, 0.0, 0).validate(),
            Err(SamplingError::TopP(1.5))
        );
        assert_eq!(
            params(1.0, 0, 1.0, -0.1, 0).validate(),
            Err(SamplingError::MinP(-0.1))
        );
        assert_eq!(
            params(1.0, 0, 1.0, 1.1, 0).validate(),
            Err(SamplingError::MinP(1.1))
        );
        let msg = params(1.0, 0, 2.0, 0.0, 0)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(msg.contains("top_p") && msg.contains('2'), "{msg}");
    }

    #[test]
    fn serde_round_trip() {
        let p = params(0.7, 40, 0.9, 0.05, 99);
        let s = serde_json::to_string(&p).unwrap();
        let q: SamplingParams = serde_json::from_str(&s).unwrap();
        assert_eq!(p, q);
    }

    #[test]
    fn greedy_ties_to_lowest_id() {
        let logits = [1.0, 3.0, 2.0, 3.0, f32::NAN];
        assert_eq!(sample(&logits, &SamplingParams::greedy(), 5), 1);
        assert_eq!(sample(&[f32::NAN, 0.5], &SamplingParams::greedy(), 0), 1);
        assert_eq!(sample(&[], &SamplingParams::greedy(), 0), 0);
    }

    fn pseudo_logits(v: usize, salt: u64) -> Vec<f32> {
        (0..v)
            .map(|i| (uniform(salt, 0, i as u32) * 12.0 - 6.0) as f32)
            .collect()
    }

    #[test]
    fn top_k_one_equals_greedy() {
        for salt in 0..20u64 {
            let mut logits = pseudo_logits(1000, salt);
            logits[(salt * 37 % 1000) as usize] = 9.0;
            logits[(salt * 91 % 1000) as usize] = 9.0;
            let g = sample(&logits, &SamplingParams::greedy(), 3);
            for pos in 0..10 {
                let p = params(1.5, 1, 1.0, 0.0, salt);
                assert_eq!(sample(&logits, &p, pos), g);
                let p = params(1.5, 1, 0.5, 0.3, salt);
                assert_eq!(sample(&logits, &p, pos), g);
            }
        }
    }

    #[test]
    fn determinism_and_key_dependence() {
        let logits = pseudo_logits(248_320, 7);
        let p = params(2.0, 0, 1.0, 0.0, 42);
        let a: Vec<u32> = (100..110).map(|pos| sample(&logits, &p, pos)).collect();
        let b: Vec<u32> = (100..110).map(|pos| sample(&logits, &p, pos)).collect();
        assert_eq!(a, b);
        let q = params(2.0, 0, 1.0, 0.0, 43);
        let c: Vec<u32> = (100..110).map(|pos| sample(&logits, &q, pos)).collect();
        assert_ne!(a, c);
        // With filters too.
        let p = params(0.8, 50, 0.9, 0.01, 42);
        let a: Vec<u32> = (0..10).map(|pos| sample(&logits, &p, pos)).collect();
        let b: Vec<u32> = (0..10).map(|pos| sample(&logits, &p, pos)).collect();
        assert_eq!(a, b);
    }

    #[test]
    fn matches_reference_gumbel_max() {
        // The fast unfiltered path equals the literal rule.
        let logits = pseudo_logits(5000, 3);
        let p = params(0.9, 0, 1.0, 0.0, 11);
        for pos in 0..50u64 {
            let mut best = (f64::NEG_INFINITY, 0u32);
            for (i, &l) in logits.iter().enumerate() {
                let s = f64::from(l) / 0.9f64 - (-uniform(11, pos, i as u32).ln()).ln();
                if s > best.0 {
                    best = (s, i as u32);
                }
            }
            assert_eq!(sample(&logits, &p, pos), best.1);
        }
    }

    #[test]
    fn top_k_scan_matches_full_sort() {
        let mut logits = pseudo_logits(100_000, 13);
        // Many equal logits around the cut, NaN and signed zeros.
        for i in (0..logits.len()).step_by(7) {
            logits[i] = 5.0;
        }
        logits[3] = f32::NAN;
        logits[4] = -0.0;
        for &k in &[1usize, 2, 40, 1000, 20_000, 99_999] {
            let mut got = top_k_candidates(&logits, k);
            got.sort_by(by_rank);
            let mut all: Vec<(f32, u32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (key(l), i as u32))
                .collect();
            all.sort_by(by_rank);
            all.truncate(k);
            assert_eq!(got, all, "k {k}");
        }
        let tiny = [0.0f32, -0.0, 0.0, f32::NAN];
        assert_eq!(argmax_lowest(&tiny), 0);
        assert_eq!(argmax_lowest(&[f32::NAN, -0.0, 0.0]), 1);
        let mut long = vec![1.0f32; 37];
        long[35] = 2.0;
        long[20] = 2.0;
        assert_eq!(argmax_lowest(&long), 20);
        long[2] = f32::INFINITY;
        assert_eq!(argmax_lowest(&long), 2);
        assert_eq!(argmax_lowest(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn pruned_gumbel_matches_literal_rule() {
        // Full vocabulary, several temperatures, duplicated logits and NaN / -inf entries.
        let mut logits = pseudo_logits(248_320, 21);
        for i in (0..logits.len()).step_by(1000) {
            logits[i] = logits[i + 1];
        }
        logits[5] = f32::NAN;
        logits[6] = f32::NEG_INFINITY;
        for &t in &[0.01f32, 0.3, 1.0, 2.0, 100.0] {
            let p = params(t, 0, 1.0, 0.0, 42);
            for pos in 0..8u64 {
                let want = gumbel_max(
                    logits.iter().enumerate().map(|(i, &l)| (l, i as u32)),
                    f64::from(t),
                    42,
                    pos,
                );
                assert_eq!(sample(&logits, &p, pos), want, "T {t} pos {pos}");
            }
        }
    }

    #[test]
    fn statistical_frequencies_match_softmax() {
        let logits = [1.0f32, 2.0, 0.5];
        let p = params(1.0, 0, 1.0, 0.0, 2024);
        let mut counts = [0usize; 3];
        let n = 20_000;
        for pos in 0..n as u64 {
            counts[sample(&logits, &p, pos) as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for i in 0..3 {
            let want = f64::from(logits[i]).exp() / z;
            let got = counts[i] as f64 / n as f64;
            assert!((want - got).abs() < 0.02, "id {i}: {got} vs {want}");
            assert!((f64::from(token_prob(&logits, i as u32)) - want).abs() < 1e-6);
        }
    }

    #[test]
    fn top_p_filters() {
        // p ~ [0.665, 0.245, 0.090] at T = 1.
        let logits = [3.0f32, 2.0, 1.0];
        // top_p 0.5: only id 0 survives.
        let p = params(1.0, 0, 0.5, 0.0, 5);
        assert!((0..500).all(|pos| sample(&logits, &p, pos) == 0));
        // top_p 0.8: ids 0 and 1 survive, both are seen, id 2 never.
        let p = params(1.0, 0, 0.8, 0.0, 5);
        let s: Vec<u32> = (0..2000).map(|pos| sample(&logits, &p, pos)).collect();
        assert!(s.contains(&0) && s.contains(&1) && !s.contains(&2));
        // top_p 0.95: all three.
        let p = params(1.0, 0, 0.95, 0.0, 5);
        let s: Vec<u32> = (0..2000).map(|pos| sample(&logits, &p, pos)).collect();
        assert!(s.contains(&2));
    }

    #[test]
    fn top_p_on_large_vocab_matches_full_sort() {
        let logits = pseudo_logits(50_000, 9);
        for &(tp, mp) in &[
            (0.9f32, 0.0f32),
            (0.5, 0.0),
            (0.999, 0.0),
            (1.0, 0.2),
            (0.9, 0.01),
        ] {
            let p = params(0.7, 0, tp, mp, 77);
            for pos in 0..20u64 {
                assert_eq!(
                    sample(&logits, &p, pos),
                    reference_sample(&logits, &p, pos),
                    "top_p {tp} min_p {mp} pos {pos}"
                );
            }
        }
    }

    /// The literal rule with a full sort, for comparison.
    fn reference_sample(logits: &[f32], p: &SamplingParams, pos: u64) -> u32 {
        let t = f64::from(p.temperature);
        let mut c: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        c.sort_by(by_rank);
        if p.top_k > 0 {
            c.truncate(p.top_k as usize);
        }
        let m = f64::from(c[0].0);
        let mut by_id = c.clone();
        by_id.sort_by_key(|x| x.1);
        let z: f64 = by_id.iter().map(|x| ((f64::from(x.0) - m) / t).exp()).sum();
        let pr: Vec<f64> = c
            .iter()
            .map(|x| ((f64::from(x.0) - m) / t).exp() / z)
            .collect();
        let mut kept = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, q) in pr.iter().enumerate() {
                cum += q;
                if cum >= f64::from(p.top_p) {
                    kept = i + 1;
                    break;
                }
            }
        }
        let thr = f64::from(p.min_p) * pr[0];
        let kept = pr[..kept].iter().take_while(|&&q| q >= thr).count().max(1);
        let mut best = (f64::NEG_INFINITY, 0u32);
        for &(l, id) in &c[..kept] {
            let s = f64::from(l) / t - (-uniform(p.seed, pos, id).ln()).ln();
            if s > best.0 || (s == best.0 && id < best.1) {
                best = (s, id);
            }
        }
        best.1
    }

    #[test]
    fn min_p_filters() {
        // p ~ [0.665, 0.245, 0.090]; max p * 0.3 = 0.1995 keeps ids 0 and 1.
        let logits = [3.0f32, 2.0, 1.0];
        let p = params(1.0, 0, 1.0, 0.3, 8);
        let s: Vec<u32> = (0..2000).map(|pos| sample(&logits, &p, pos)).collect();
        assert!(s.contains(&0) && s.contains(&1) && !s.contains(&2));
        // min_p 1: only the maximum.
        let p = params(1.0, 0, 1.0, 1.0, 8);
        assert!((0..500).all(|pos| sample(&logits, &p, pos) == 0));
        // Ties at the top survive min_p = 1 and are both drawn.
        let p = params(1.0, 0, 1.0, 1.0, 8);
        let s: Vec<u32> = (0..500)
            .map(|pos| sample(&[0.0, 4.0, 4.0], &p, pos))
            .collect();
        assert!(s.contains(&1) && s.contains(&2) && !s.contains(&0));
    }

    #[test]
    fn top_k_with_filters_matches_reference() {
        let logits = pseudo_logits(10_000, 4);
        for &(k, tp, mp) in &[
            (40u32, 0.9f32, 0.0f32),
            (5, 1.0, 0.5),
            (100, 0.7, 0.05),
            (1, 0.2, 0.9),
        ] {
            let p = params(1.3, k, tp, mp, 123);
            for pos in 0..30u64 {
                assert_eq!(sample(&logits, &p, pos), reference_sample(&logits, &p, pos));
            }
        }
    }

    #[test]
    fn token_prob_edge_cases() {
        assert_eq!(token_prob(&[1.0, 2.0], 5), 0.0);
        assert!((token_prob(&[0.0, 0.0], 1) - 0.5).abs() < 1e-7);
        assert!((token_prob(&[1000.0, 1000.0, f32::NAN], 0) - 0.5).abs() < 1e-7);
        assert_eq!(token_prob(&[f32::NEG_INFINITY; 3], 0), 0.0);
    }
}
