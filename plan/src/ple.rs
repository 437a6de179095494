//! PLE n-gram hashing constants (`flash-next.md` section 8; transformers `_build_layer_multipliers`,
//! `_find_nth_prime_after`, `Qwen4ExpTextNGramEmbedding.__init__`). Derived from the config; checkpoints that store
//! the buffers `layer_multipliers`, `ngram_heads_vocab_sizes`, `ngram_heads_offsets` must equal these.

use crate::ModelConfig;

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 step: `z = x + gamma; z = (z ^ z>>30) * M1; z = (z ^ z>>27) * M2; z ^ z>>31` (wrapping).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash multipliers of the PLE layer with index `ple_index` (its position in `ple_layer_ids`), one per n-gram slot
/// (`ngram_size` of them): `2 * (splitmix64(seed + 10007 idx + gamma (s+1)) mod h) + 1`,
/// `h = max(1, ((2^63 - 1) div vocab) div 2)`.
pub fn layer_multipliers(cfg: &ModelConfig, ple_index: u32) -> Vec<u64> {
    let max_long = (1u64 << 63) - 1;
    let half = ((max_long / (cfg.vocab_size.max(1) as u64)) / 2).max(1);
    let base = cfg
        .seed
        .wrapping_add(10007u64.wrapping_mul(ple_index as u64));
    (0..cfg.ngram_size as u64)
        .map(|s| 2 * (splitmix64(base.wrapping_add(GAMMA.wrapping_mul(s + 1))) % half) + 1)
        .collect()
}

fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    if n % 2 == 0 {
        return n == 2;
    }
    let mut d = 3;
    while d * d <= n {
        if n % d == 0 {
            return false;
        }
        d += 2;
    }
    true
}

/// Head vocab sizes and row offsets of one PLE layer: head `j` of the model (`ple_index * heads + local`) has the
/// `(j+1)`-th prime after `ngram_vocab_size_base - 1`; offsets are the running sum within the layer.
pub fn head_sizes(cfg: &ModelConfig, ple_index: u32) -> (Vec<u64>, Vec<u64>) {
    let heads = cfg.ple_heads() as u64;
    let first = ple_index as u64 * heads;
    let mut prime = cfg.ngram_vocab_size_base.saturating_sub(1);
    let (mut sizes, mut offsets, mut total) = (Vec::new(), Vec::new(), 0);
    for global in 0..first + heads {
        prime += 1;
        while !is_prime(prime) {
            prime += 1;
        }
        if global >= first {
            sizes.push(prime);
            offsets.push(total);
            total += prime;
        }
    }
    (sizes, offsets)
}

/// Rows of a PLE layer's table: the summed head vocab padded to `make_ngram_vocab_size_divisible_by`.
pub fn table_rows(cfg: &ModelConfig, ple_index: u32) -> u64 {
    let total: u64 = head_sizes(cfg, ple_index).0.iter().sum();
    let div = cfg.make_ngram_vocab_size_divisible_by.max(1);
    total.div_ceil(div) * div
}
