//! The copy index: a per-stream drafter that finds the stream's last 8 tokens earlier in its context and
//! proposes the tokens that followed them (rounds.md section 2).
//!
//! # Layout
//!
//! The index keeps the stream's context (prompt + kept tokens) and, for every 8-token window of it, a
//! hash chain in the style of zlib / LZ77 match finders:
//!
//! - `heads`: hash of an 8-token window -> the newest start position with that hash;
//! - `prev[s]`: the previous (older) start position whose window has the same hash as the one at `s`.
//!
//! Walking `heads[h], prev[heads[h]], ...` visits the occurrences newest first, which is exactly the order
//! the proposal rule needs. Every visited position is checked against the actual tokens, so hash
//! collisions can cost time but never give a wrong proposal.
//!
//! # Complexity
//!
//! - [`CopyIndex::extend`]: O(new tokens) amortised (one hash and one map insert per new window); no
//!   per-key allocation.
//! - [`CopyIndex::propose`]: O(`want` + c) where c is the number of colliding (different-token) windows
//!   on the chain before the answer (in practice 0 with a 64-bit hash). Only occurrences starting in the
//!   last `want + 8` positions can have a continuation shorter than `want`, so at most `want` of them are
//!   passed before the walk stops at one with a full continuation.
//! - Memory: about 4 B (token) + 4 B (`prev`) + ~16 B (map entry) per distinct window, ~6 MB for a
//!   250k-token context.
//!
//! Positions are stored as `u32`: windows starting at or beyond `u32::MAX - 1` are kept in the context
//! but not indexed.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

/// The length of the lookup key in tokens (rounds.md section 2: shorter keys misfire on indentation and
/// boilerplate). Also the shortest continuation that is ever proposed.
pub const KEY_LEN: usize = 8;

/// The shortest proposal, in tokens (rounds.md section 2): a continuation shorter than this is dropped.
pub const MIN_PROPOSAL: usize = 8;

/// End of a hash chain.
const NONE: u32 = u32::MAX;

/// A `Hasher` that passes an already mixed `u64` through unchanged.
#[derive(Default, Clone, Copy)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by the index; fold anything else in for completeness.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = i;
    }
}

type Heads = HashMap<u64, u32, BuildHasherDefault<PassThrough>>;

/// The splitmix64 finaliser.
#[inline]
fn mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 64-bit hash of one 8-token window (`w.len() == KEY_LEN`).
#[inline]
fn window_hash(w: &[u32]) -> u64 {
    let pair = |i: usize| u64::from(w[i]) | (u64::from(w[i + 1]) << 32);
    let h = mix(pair(6) ^ 0x9E37_79B9_7F4A_7C15);
    let h = mix(h ^ pair(4));
    let h = mix(h ^ pair(2));
    mix(h ^ pair(0))
}

/// The copy index of one stream (rounds.md section 2): its context and a map from each 8-token window of
/// it to the positions where that window starts.
///
/// Extend it with the prompt, then with the kept tokens after every round ([`CopyIndex::extend`]);
/// rejected drafts never enter it, so nothing rolls back. Ask for drafts with [`CopyIndex::propose`].
#[derive(Clone)]
pub struct CopyIndex {
    /// The context: prompt + kept tokens, in order.
    tokens: Vec<u32>,
    /// Window hash (masked) -> newest start position.
    heads: Heads,
    /// `prev[s]`: the next older start position on `s`'s chain, or `NONE`. One entry per indexed window.
    prev: Vec<u32>,
    /// Applied to every window hash; `u64::MAX` normally. Tests narrow it to force collisions.
    mask: u64,
}

impl Default for CopyIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for CopyIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyIndex")
            .field("len", &self.tokens.len())
            .field("windows", &self.prev.len())
            .field("distinct_keys", &self.heads.len())
            .finish()
    }
}

impl CopyIndex {
    /// An empty index (empty context).
    pub fn new() -> Self {
        Self::with_mask(u64::MAX)
    }

    /// An empty index whose window hashes are cut to `mask` (tests: force collisions).
    fn with_mask(mask: u64) -> Self {
        CopyIndex {
            tokens: Vec::new(),
            heads: Heads::default(),
            prev: Vec::new(),
            mask,
        }
    }

    /// The context length in tokens (prompt + kept tokens so far).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the context is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The context: prompt + kept tokens, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends `tokens` to the context (the prompt once, then each round's kept tokens) and indexes every
    /// 8-token window that is now complete. O(`tokens.len()`) amortised.
    pub fn extend(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        let n = self.tokens.len();
        // Windows start at s with s + KEY_LEN <= n; those below `prev.len()` are already indexed.
        let end = (n + 1).saturating_sub(KEY_LEN).min(NONE as usize);
        let start = self.prev.len();
        if end <= start {
            return;
        }
        self.heads.reserve(end - start);
        self.prev.reserve(end - start);
        for s in start..end {
            let h = window_hash(&self.tokens[s..s + KEY_LEN]) & self.mask;
            let older = self.heads.insert(h, s as u32);
            self.prev.push(older.unwrap_or(NONE));
        }
    }

    /// Proposes up to `want` draft tokens (rounds.md section 2), or `None`.
    ///
    /// Looks up the last 8 tokens of the context, walks their earlier occurrences newest first (skipping
    /// the query itself, the occurrence that *is* the last 8 tokens) and keeps the longest continuation:
    /// the tokens following the occurrence, up to `want`, stopping at the end of the context. Ties go to
    /// the newest occurrence; the walk stops at the first one that reaches `want`. Proposes only when the
    /// continuation is at least 8 tokens long, so `want < 8` never proposes.
    ///
    /// `want` is min(depth, tokens the reply may still emit). The result has `8..=want` tokens.
    /// O(`want` + hash collisions on the chain).
    pub fn propose(&self, want: usize) -> Option<Vec<u32>> {
        let n = self.tokens.len();
        if want < MIN_PROPOSAL || n < KEY_LEN + MIN_PROPOSAL {
            return None;
        }
        let query_start = n - KEY_LEN;
        let query = &self.tokens[query_start..];
        let h = window_hash(query) & self.mask;
        let mut cur = *self.heads.get(&h)?;
        let mut best: Option<(usize, usize)> = None; // (start of continuation, length)
        while cur != NONE {
            let s = cur as usize;
            cur = self.prev.get(s).copied().unwrap_or(NONE);
            if s >= query_start || self.tokens[s..s + KEY_LEN] != *query {
                continue;
            }
            let from = s + KEY_LEN;
            let len = (n - from).min(want);
            if best.is_none_or(|(_, l)| len > l) {
                best = Some((from, len));
                if len == want {
                    break;
                }
            }
        }
        match best {
            Some((from, len)) if len >= MIN_PROPOSAL => {
                Some(self.tokens[from..from + len].to_vec())
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rule of rounds.md section 2, written out in O(n^2).
    fn naive(ctx: &[u32], want: usize) -> Option<Vec<u32>> {
        let n = ctx.len();
        if want < 8 || n < 8 {
            return None;
        }
        let q = n - 8;
        let mut best: Option<(usize, usize)> = None;
        for s in (0..q).rev() {
            if ctx[s..s + 8] == ctx[q..] {
                let len = (n - s - 8).min(want);
                if best.is_none_or(|(_, l)| len > l) {
                    best = Some((s + 8, len));
                }
                if len == want {
                    break;
                }
            }
        }
        match best {
            Some((f, l)) if l >= 8 => Some(ctx[f..f + l].to_vec()),
            _ => None,
        }
    }

    fn index_of(ctx: &[u32]) -> CopyIndex {
        let mut ix = CopyIndex::new();
        ix.extend(ctx);
        ix
    }

    #[test]
    fn empty_and_short_contexts() {
        let ix = CopyIndex::new();
        assert!(ix.is_empty());
        assert_eq!(ix.propose(16), None);
        let ix = index_of(&[1, 2, 3]);
        assert_eq!(ix.len(), 3);
        assert_eq!(ix.tokens(), &[1, 2, 3]);
        assert_eq!(ix.propose(16), None);
    }

    #[test]
    fn repeated_word_prompt_proposes_every_round() {
        // rounds.md section 6: one word repeated 48 times, 32 tokens, the copy index fires every round.
        let word = [301u32, 302, 303];
        let prompt: Vec<u32> = word.iter().copied().cycle().take(48 * 3).collect();
        let mut ix = index_of(&prompt);
        let mut remaining = 32usize;
        let depth = 15usize;
        let mut rounds = 0;
        while remaining > 0 {
            let want = depth.min(remaining);
            let n = ix.len();
            let drafts = ix.propose(want);
            let mut kept = Vec::new();
            if want >= 8 {
                let d = drafts.expect("the copy index fires every round with want >= 8");
                assert_eq!(d.len(), want);
                for (i, &t) in d.iter().enumerate() {
                    assert_eq!(t, word[(n + i) % 3]);
                }
                kept.extend_from_slice(&d);
            } else {
                assert_eq!(drafts, None);
            }
            // The bonus token (or the plain-decoded token), cut to the remaining budget.
            kept.push(word[(n + kept.len()) % 3]);
            kept.truncate(remaining);
            remaining -= kept.len();
            ix.extend(&kept);
            rounds += 1;
        }
        assert_eq!(ix.len(), 48 * 3 + 32);
        assert!(rounds <= 3, "rounds {rounds}");
    }

    #[test]
    fn no_proposal_below_eight() {
        let key: Vec<u32> = (1..=8).collect();
        // key, 7 unique tokens, key: the only earlier occurrence is followed by 7 + 8 tokens.
        let mut ctx = key.clone();
        ctx.extend(100..107);
        ctx.extend(&key);
        let ix = index_of(&ctx);
        assert_eq!(ix.propose(7), None);
        assert_eq!(ix.propose(0), None);
        let p = ix.propose(8).expect("8 tokens of continuation");
        assert_eq!(p, [100, 101, 102, 103, 104, 105, 106, 1]);
        // Continuation of exactly 7 tokens: key, 0 tokens... build one where the earlier occurrence ends
        // 7 tokens before the query's end: overlapping windows of a 15-token context.
        let ctx2: Vec<u32> = [1, 2, 3, 4, 5, 6, 7]
            .iter()
            .copied()
            .cycle()
            .take(15)
            .collect();
        // Query = ctx2[7..15] = 1..7,1; occurrence at 0 = 1..7,1, continuation ctx2[8..15]: 7 tokens.
        let ix = index_of(&ctx2);
        assert_eq!(ix.propose(16), None);
        assert_eq!(naive(&ctx2, 16), None);
        // Period 8: the occurrence one period back has exactly 8 tokens after it.
        let ctx3: Vec<u32> = (1..=8).cycle().take(24).collect();
        assert_eq!(index_of(&ctx3).propose(16).map(|p| p.len()), Some(16));
        assert_eq!(index_of(&ctx3[..16]).propose(16), Some((1..=8).collect()));
    }

    #[test]
    fn newest_first_tie_rule() {
        let key: Vec<u32> = (1..=8).collect();
        let mut ctx = key.clone();
        ctx.extend(200..210); // older continuation
        ctx.extend(&key);
        ctx.extend(300..310); // newer continuation
        ctx.extend(&key);
        let ix = index_of(&ctx);
        // Both earlier occurrences have >= 10 tokens after them: the newest wins.
        assert_eq!(ix.propose(10), Some((300..310).collect::<Vec<_>>()));
        assert_eq!(ix.propose(10), naive(&ctx, 10));
    }

    #[test]
    fn longest_continuation_wins() {
        let key: Vec<u32> = (1..=8).collect();
        let mut ctx = key.clone();
        ctx.extend(200..210); // older: 10 + 8 + 9 + 8 tokens follow
        ctx.extend(&key);
        ctx.extend(300..309); // newer: 9 + 8 tokens follow
        ctx.extend(&key);
        let ix = index_of(&ctx);
        // want 40: neither reaches it (35 and 17 tokens); the older one has the longer continuation.
        let p = ix.propose(40).expect("proposal");
        assert_eq!(p.len(), ctx.len() - 8);
        assert_eq!(&p[..10], &(200..210).collect::<Vec<_>>()[..]);
        assert_eq!(Some(p), naive(&ctx, 40));
        // want 17: the newer one has exactly 17 and stops the walk.
        let p = ix.propose(17).expect("proposal");
        assert_eq!(&p[..9], &(300..309).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn self_occurrence_skipped() {
        // The key occurs only as the query itself.
        let mut ctx: Vec<u32> = (500..540).collect();
        ctx.extend(1..=8);
        let ix = index_of(&ctx);
        assert_eq!(ix.propose(16), None);
        // A constant run: the query overlaps its own earlier occurrences; the proposal comes from an
        // earlier start, never from the query itself.
        let ix = index_of(&[7u32; 30]);
        assert_eq!(ix.propose(16), Some(vec![7; 16]));
        let ix = index_of(&[7u32; 23]);
        // Occurrences 0..=14 are earlier than the query at 15; the oldest has 15 tokens after it.
        assert_eq!(ix.propose(16), Some(vec![7; 15]));
    }

    #[test]
    fn hash_collisions_are_verified() {
        // mask 0: every window lands on one chain, so every lookup must check the tokens.
        let key: Vec<u32> = (1..=8).collect();
        let mut ctx = key.clone();
        ctx.extend(200..230);
        // A different window with a long continuation, newer than the true occurrence.
        ctx.extend(900..908);
        ctx.extend(400..430);
        ctx.extend(&key);
        let mut collide = CopyIndex::with_mask(0);
        collide.extend(&ctx);
        assert_eq!(collide.heads.len(), 1);
        let normal = index_of(&ctx);
        let want = 16;
        let p = collide.propose(want).expect("proposal");
        assert_eq!(p, (200..216).collect::<Vec<_>>());
        assert_eq!(Some(p), normal.propose(want));
        // No true occurrence at all: collisions never propose.
        let mut c2 = CopyIndex::with_mask(0);
        c2.extend(&(0..100).collect::<Vec<u32>>());
        assert_eq!(c2.propose(16), None);
    }

    #[test]
    fn debug_is_short() {
        let ix = index_of(&[1; 20]);
        let s = format!("{ix:?}");
        assert!(s.contains("len: 20"), "{s}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn matches_naive_reference(
            seq in proptest::collection::vec(0u32..4, 0..300),
            alphabet3 in any::<bool>(),
            chunks in proptest::collection::vec(1usize..40, 1..20),
            wants in proptest::collection::vec(0usize..40, 1..4),
            mask in prop_oneof![Just(u64::MAX), Just(0u64), Just(3u64)],
        ) {
            let seq: Vec<u32> = if alphabet3 { seq.iter().map(|t| t % 3).collect() } else { seq };
            let mut ix = CopyIndex::with_mask(mask);
            let mut at = 0usize;
            let mut ci = 0usize;
            loop {
                for &want in &wants {
                    prop_assert_eq!(ix.propose(want), naive(&seq[..at], want));
                }
                if at == seq.len() {
                    break;
                }
                let step = chunks[ci % chunks.len()].min(seq.len() - at);
                ci += 1;
                ix.extend(&seq[at..at + step]);
                at += step;
                prop_assert_eq!(ix.tokens(), &seq[..at]);
            }
        }
    }
}
