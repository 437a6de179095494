//! MXFP8 weights (issue 8): the re-coded MTP drafter (`FLASHPLAN_MTP_WEIGHTS=mxfp8|mxfp8-head`) and checkpoints
//! that store MXFP8 linears.
//!
//! # Format
//!
//! A `[N, K]` matrix is stored as E4M3 codes `[N, K]` (one byte per value) and one E8M0 scale byte `s` per 32
//! consecutive inputs of each output row (`[N, ceil(K / 32)]`). A value is `code * 2^(s - 127)`. When `K` is not a
//! multiple of 32, the last group of each row is shorter (`K % 32` values); groups never span two rows.
//!
//! Re-coding one group `w` with `a = max |w|`:
//! - `e = ceil(log2(a / 448))` clamped to `[-127, 127]`, `s = e + 127`; `e` is computed exactly (the smallest
//!   integer with `a <= 448 * 2^e`, checked in f64, where `448 * 2^e` and `a` are exact), so `|w / 2^e| <= 448`
//!   always holds and no code saturates;
//! - codes: round-to-nearest-even E4M3 of `w / 2^e` (computed exactly in f64);
//! - an all-zero group has `s = 127` and zero codes.
//!
//! E4M3 is the OCP "FN" variant: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest
//! finite magnitude 448 (`0x7E`), `0x7F`/`0xFF` are NaN, subnormals `m * 2^-9` (exponent field 0). E8M0 is an
//! unsigned biased exponent: `2^(s - 127)`, `0xFF` is NaN.
//!
//! Every MXFP8 value (`|code| <= 448`, `2^-127 <= 2^e <= 2^127`) is exactly representable in f32, so the f32
//! values [`dequantize`] returns are exactly the values the format represents; the CPU backend computes on them.
//!
//! Non-finite weights (not expected in a checkpoint): `±inf` saturates to `±448 * 2^127` and NaN stays NaN (code
//! `0x7F`); neither occurs for finite input.

use flashplan_plan::{DrafterForm, PlanBody, StorageForm, WeightGroup, WeightUse};

/// Inputs per scale group.
pub const GROUP: usize = 32;
/// The largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The E8M0 bias.
pub const E8M0_BIAS: i32 = 127;
/// The canonical NaN code of E4M3 (positive sign).
pub const E4M3_NAN: u8 = 0x7F;

/// An MXFP8 `[rows, cols]` matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mxfp8 {
    /// E4M3 codes, row-major `[rows, cols]`.
    pub codes: Vec<u8>,
    /// E8M0 scales, row-major `[rows, ceil(cols / 32)]`.
    pub scales: Vec<u8>,
    /// Output rows (N).
    pub rows: usize,
    /// Inputs per row (K).
    pub cols: usize,
}

/// Scale groups per row: `ceil(cols / 32)`.
pub fn groups_per_row(cols: usize) -> usize {
    cols.div_ceil(GROUP)
}

/// `2^e` as f64, exact for `-1022 <= e <= 1023`.
fn pow2(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// The value of an E4M3 (OCP FN) code.
pub fn e4m3_decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((code >> 3) & 0x0F) as i32;
    let man = (code & 0x07) as i32;
    if exp == 0x0F && man == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        man as f64 * pow2(-9)
    } else {
        (8 + man) as f64 * pow2(exp - 10)
    };
    (sign * mag) as f32
}

/// Round-to-nearest-even E4M3 of an f64 (exact: `x` is not rounded to f32 first). Magnitudes above 448 saturate to
/// 448 (never needed by [`quantize`]); NaN gives [`E4M3_NAN`].
fn encode_f64(x: f64) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX as f64 {
        return sign | 0x7E;
    }
    // The quantum of E4M3 at a's binade: 2^(k-3) for a normal binade [2^k, 2^(k+1)), k >= -6; 2^-9 below 2^-6.
    let k = if a == 0.0 {
        -6
    } else {
        // a < 448 is a normal f64 here or a subnormal f64; floor(log2 a) from the bits, clamped below at -6.
        let bits = a.to_bits();
        let biased = ((bits >> 52) & 0x7FF) as i32;
        (biased - 1023).max(-6)
    };
    let q = pow2(k - 3);
    // a / q is exact (power-of-two scaling inside f64's range); round to an integer, ties to even.
    let n = (a / q).round_ties_even();
    let r = n * q; // exact: n <= 16 and q a power of two
    if r >= E4M3_MAX as f64 {
        // Rounding up past 448 cannot happen for a < 448 (448 is on the grid, the next is 480), kept for safety.
        return sign | 0x7E;
    }
    let mag: u8 = if r < pow2(-6) {
        // Subnormal: r = m * 2^-9, m in 0..=7.
        (r / pow2(-9)) as u8
    } else {
        // Normal: r = (8 + m) * 2^(E - 10), E in 1..=15.
        let e = ((r.to_bits() >> 52) & 0x7FF) as i32 - 1023; // floor(log2 r), r normal in f64
        let m = (r / pow2(e - 3)) as i32 - 8;
        debug_assert!((0..8).contains(&m));
        (((e + 7) as u8) << 3) | m as u8
    };
    sign | mag
}

/// Round-to-nearest-even E4M3 (OCP FN) code of `x`: the representable value nearest to `x`, ties to the even
/// mantissa (subnormals included). `|x| > 448` saturates to `±448` ([`quantize`] never needs it); NaN gives
/// [`E4M3_NAN`]; `-0.0` and negative values that round to zero give `0x80`.
pub fn e4m3_encode_rne(x: f32) -> u8 {
    encode_f64(x as f64)
}

/// The shared scale exponent of a group with `a = max |w|`: the smallest integer `e` with `a <= 448 * 2^e`, clamped
/// to `[-127, 127]` (that is `ceil(log2(a / 448))`, computed exactly). `a == 0` gives 0 (`s = 127`).
pub fn scale_exponent(a: f32) -> i32 {
    if a == 0.0 || a.is_nan() {
        return 0;
    }
    if a.is_infinite() {
        return 127;
    }
    let a = a as f64;
    let max = E4M3_MAX as f64;
    // Start near the answer, then settle it with exact comparisons (448 * 2^e is exact in f64).
    let mut e = (a / max).log2().ceil() as i32;
    e = e.clamp(-200, 200);
    while a > max * pow2(e) {
        e += 1;
    }
    while a <= max * pow2(e - 1) {
        e -= 1;
    }
    e.clamp(-E8M0_BIAS, E8M0_BIAS)
}

/// The value of an E8M0 scale byte: `2^(s - 127)`; `0xFF` is NaN.
pub fn e8m0_decode(s: u8) -> f32 {
    if s == 0xFF {
        f32::NAN
    } else {
        pow2(s as i32 - E8M0_BIAS) as f32
    }
}

/// Re-codes one group (`w.len() <= 32`) into `codes`; returns its scale byte.
fn quantize_group(w: &[f32], codes: &mut [u8]) -> u8 {
    let a = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    if a == 0.0 {
        codes.fill(0);
        return E8M0_BIAS as u8;
    }
    let e = scale_exponent(a);
    let inv = pow2(-e);
    for (c, &x) in codes.iter_mut().zip(w) {
        *c = encode_f64(x as f64 * inv);
    }
    (e + E8M0_BIAS) as u8
}

/// Re-codes a row-major `[rows, cols]` f32 matrix into MXFP8 (module documentation: groups of 32 consecutive
/// inputs of each row, the last group of a row shorter when `cols % 32 != 0`).
///
/// # Panics
/// When `w.len() != rows * cols`.
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Mxfp8 {
    assert_eq!(w.len(), rows * cols, "quantize: {rows} x {cols} matrix");
    let gpr = groups_per_row(cols);
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0u8; rows * gpr];
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        let crow = &mut codes[r * cols..(r + 1) * cols];
        for g in 0..gpr {
            let lo = g * GROUP;
            let hi = (lo + GROUP).min(cols);
            scales[r * gpr + g] = quantize_group(&row[lo..hi], &mut crow[lo..hi]);
        }
    }
    Mxfp8 {
        codes,
        scales,
        rows,
        cols,
    }
}

/// The f32 values of MXFP8 codes and scales (`codes` `[rows, cols]`, `scales` `[rows, ceil(cols / 32)]`):
/// `e4m3(code) * 2^(s - 127)`, exact.
///
/// This is also the loader's path for checkpoints that store MXFP8 linears (`weight` F8_E4M3 `[N, K]` plus
/// `weight_scale` U8 `[N, K/32]`; stacked experts `[E, R, C]` pass `rows = E * R`).
///
/// # Panics
/// When the lengths do not match `rows` and `cols`.
pub fn dequantize_stored(codes: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let gpr = groups_per_row(cols);
    assert_eq!(codes.len(), rows * cols, "MXFP8 codes: {rows} x {cols}");
    assert_eq!(scales.len(), rows * gpr, "MXFP8 scales: {rows} x {gpr}");
    let table: Vec<f32> = (0..=255u8).map(e4m3_decode).collect();
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for g in 0..gpr {
            let lo = r * cols + g * GROUP;
            let hi = r * cols + ((g + 1) * GROUP).min(cols);
            let s = e8m0_decode(scales[r * gpr + g]);
            for (o, &c) in out[lo..hi].iter_mut().zip(&codes[lo..hi]) {
                // Exact: both factors are powers of two times at most 4 significant bits, within f32's range.
                *o = table[c as usize] * s;
            }
        }
    }
    out
}

/// The f32 values an [`Mxfp8`] matrix represents (row-major `[rows, cols]`), exact.
pub fn dequantize(m: &Mxfp8) -> Vec<f32> {
    dequantize_stored(&m.codes, &m.scales, m.rows, m.cols)
}

/// Why values could not be packed into MXFP8 codes and scales without changing them ([`pack_exact`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PackError {
    /// The number of values is not `rows * cols`.
    #[error("{got} values for a {rows} x {cols} matrix")]
    Length {
        /// Values given.
        got: usize,
        /// Output rows (N).
        rows: usize,
        /// Inputs per row (K).
        cols: usize,
    },
    /// A value is not an MXFP8 value of its group: packing would change it.
    #[error("value {value} at index {index} is not exactly representable in MXFP8 with its group's scale")]
    NotExact {
        /// Row-major index of the value.
        index: usize,
        /// The value.
        value: f32,
    },
}

/// Packs f32 values that are exactly MXFP8 values (re-coded drafter weights, dequantized stored MXFP8: what
/// [`derive_drafter_weights`] and the loader hand the backends) into codes `[rows, cols]` and scales
/// `[rows, ceil(cols / 32)]` that represent them bit for bit, for backends that keep MXFP8 in device memory.
///
/// Re-coding MXFP8 values gives back the same values (the group's scale may come out smaller, never the values);
/// a `-0.0` in an all-zero group keeps its sign (code `0x80`). Every packed value is checked against
/// [`dequantize`]'s: anything else (values that were never MXFP8, NaN, a stored group whose large values overflowed
/// f32 to infinity) is a [`PackError::NotExact`].
///
/// # Errors
/// [`PackError`] when `values.len() != rows * cols` or a value would change.
pub fn pack_exact(values: &[f32], rows: usize, cols: usize) -> Result<Mxfp8, PackError> {
    if rows.checked_mul(cols) != Some(values.len()) {
        return Err(PackError::Length {
            got: values.len(),
            rows,
            cols,
        });
    }
    let mut m = quantize(values, rows, cols);
    let table: Vec<f32> = (0..=255u8).map(e4m3_decode).collect();
    let gpr = groups_per_row(cols);
    for (index, &value) in values.iter().enumerate() {
        let (r, c) = (index / cols, index % cols);
        let scale = e8m0_decode(m.scales[r * gpr + c / GROUP]);
        if value.to_bits() == (-0.0f32).to_bits() && m.codes[index] == 0 {
            m.codes[index] = 0x80;
        }
        let got = table[m.codes[index] as usize] * scale;
        if got.to_bits() != value.to_bits() {
            return Err(PackError::NotExact { index, value });
        }
    }
    Ok(m)
}

/// The largest scale byte `linear_mxfp8` takes (kernels/mxfp8.cu `mx_factor`: it scales a group by the BF16 2^(s - 7),
/// and 2^127 is BF16's largest power of two). A weight with a larger scale (a group with a value above
/// 448 x 2^7 = 57344) stays BF16 on the device, which holds MXFP8 values exactly and gives the same results.
pub const KERNEL_MAX_SCALE: u8 = 134;

/// Which weights a device backend keeps as MXFP8 codes and scales (the candidates: the CUDA backend's `device_forms`
/// still uploads one as BF16 when its values cannot be packed or a scale is above [`KERNEL_MAX_SCALE`]): the 2-D [`StorageForm::Mxfp8`] entries
/// (`#mxfp8` re-coded drafter linears, the `lm_head.weight#mxfp8` drafting copy, stored MXFP8 linears) that only
/// [`flashplan_plan::Op::Linear`] nodes read, each with a shape `[n, k]` matching every such node
/// ([`flashplan_plan::WeightUse::Linear`]). One flag per manifest entry.
/// Mxfp8 weights read by other ops (experts, shared expert, hc_read, router) are not flagged: their kernels take
/// BF16.
pub fn device_mxfp8_weights(body: &PlanBody) -> Vec<bool> {
    mxfp8_flags(body, &body.weight_uses())
}

/// [`device_mxfp8_weights`] from the plan's weight uses ([`PlanBody::weight_uses`]), computed once by the caller.
pub(crate) fn mxfp8_flags(body: &PlanBody, uses: &[WeightUse]) -> Vec<bool> {
    body.weights
        .iter()
        .zip(uses)
        .map(|(e, u)| e.form == StorageForm::Mxfp8 && matches!(u, WeightUse::Linear { .. }))
        .collect()
}

/// `(rows, cols)` of a logical shape for re-coding: the last dimension is the input dimension; every other
/// dimension is folded into rows (stacked experts `[E, R, C]` re-code each `[R, C]` matrix row by row).
fn matrix_dims(shape: &[u64]) -> (usize, usize) {
    match shape {
        [] => (1, 1),
        [n] => (1, *n as usize),
        [rest @ .., last] => (rest.iter().product::<u64>() as usize, *last as usize),
    }
}

/// Fills the re-coded `#mxfp8` entries of the manifest that drafter form `form` reads, with the f32 values their
/// MXFP8 re-coding represents (the CPU backend computes in f32 on exactly those values):
/// - [`DrafterForm::Checkpoint`]: nothing (no new code runs);
/// - [`DrafterForm::Mxfp8`]: every [`WeightGroup::MtpMxfp8`] entry, from its `source` entry;
/// - [`DrafterForm::Mxfp8Head`]: those and the [`WeightGroup::HeadMxfp8`] copy of `lm_head`.
///
/// A source already stored as MXFP8 ([`StorageForm::Mxfp8`], dequantized by the loader) is used as stored (re-coding
/// MXFP8 values would give them back unchanged anyway). Entries whose source is not loaded (no drafter in the
/// checkpoint, or its group not requested) stay `None`. `tensors` is indexed like `body.weights`
/// ([`crate::checkpoint::HostWeights::tensors`]); call this before handing the tensors to the backend.
///
/// # Panics
/// When `tensors.len() != body.weights.len()`, or a loaded source has the wrong number of values.
pub fn derive_drafter_weights(
    body: &PlanBody,
    tensors: &mut [Option<Vec<f32>>],
    form: DrafterForm,
) {
    assert_eq!(
        tensors.len(),
        body.weights.len(),
        "one slot per manifest entry"
    );
    let groups: &[WeightGroup] = match form {
        DrafterForm::Checkpoint => return,
        DrafterForm::Mxfp8 => &[WeightGroup::MtpMxfp8],
        DrafterForm::Mxfp8Head => &[WeightGroup::MtpMxfp8, WeightGroup::HeadMxfp8],
    };
    for (i, entry) in body.weights.iter().enumerate() {
        if !groups.contains(&entry.group) || tensors[i].is_some() {
            continue;
        }
        let Some(src) = entry.source.map(|s| s as usize) else {
            continue;
        };
        let Some(values) = tensors[src].as_deref() else {
            continue;
        };
        let (rows, cols) = matrix_dims(&entry.shape);
        assert_eq!(values.len(), rows * cols, "{}: values", entry.name);
        let out = if body.weights[src].form == StorageForm::Mxfp8 {
            values.to_vec()
        } else {
            dequantize(&quantize(values, rows, cols))
        };
        tensors[i] = Some(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every finite E4M3 value with its code, by brute force over the 256 codes.
    fn finite_codes() -> Vec<(u8, f64)> {
        (0..=255u8)
            .map(|c| (c, e4m3_decode(c) as f64))
            .filter(|(_, v)| !v.is_nan())
            .collect()
    }

    /// Independent slow reference: the nearest representable value (ties: the even mantissa), by search.
    fn reference_rne(x: f64) -> f64 {
        let mut best: Option<(u8, f64)> = None;
        for (c, v) in finite_codes() {
            let better = match best {
                None => true,
                Some((bc, bv)) => {
                    let (d, bd) = ((v - x).abs(), (bv - x).abs());
                    d < bd || (d == bd && c & 1 == 0 && bc & 1 == 1)
                }
            };
            if better {
                best = Some((c, v));
            }
        }
        best.map(|(_, v)| v).unwrap_or(f64::NAN)
    }

    #[test]
    fn decode_table_is_the_ocp_fn_variant() {
        assert_eq!(e4m3_decode(0x00), 0.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_decode(0x38), 1.0);
        assert_eq!(e4m3_decode(0x7E), 448.0);
        assert_eq!(e4m3_decode(0xFE), -448.0);
        assert!(e4m3_decode(0x7F).is_nan() && e4m3_decode(0xFF).is_nan());
        assert_eq!(e4m3_decode(0x78), 256.0); // no infinities: exponent 15 is a normal binade
        let mut pos: Vec<f64> = finite_codes()
            .into_iter()
            .filter(|(c, _)| c & 0x80 == 0)
            .map(|(_, v)| v)
            .collect();
        let n = pos.len();
        pos.dedup();
        assert_eq!(
            (n, pos.len()),
            (127, 127),
            "127 distinct non-negative values"
        );
        assert!(pos.windows(2).all(|w| w[0] < w[1]), "codes are monotonic");
    }

    #[test]
    fn encode_roundtrips_every_code() {
        for (c, v) in finite_codes() {
            let got = e4m3_encode_rne(v as f32);
            if v == 0.0 {
                assert_eq!(got & 0x7F, 0);
            } else {
                assert_eq!(got, c, "code {c:#04x} value {v}");
            }
        }
    }

    #[test]
    fn encode_ties_go_to_the_even_mantissa_both_ways() {
        let mut pos: Vec<f64> = finite_codes()
            .into_iter()
            .filter(|(c, _)| c & 0x80 == 0)
            .map(|(_, v)| v)
            .collect();
        pos.sort_by(f64::total_cmp);
        for w in pos.windows(2) {
            let mid = (w[0] + w[1]) / 2.0; // exact in f64 and in f32 (few significant bits)
            assert_eq!(mid as f32 as f64, mid);
            for sign in [1.0, -1.0] {
                let got = e4m3_decode(e4m3_encode_rne((sign * mid) as f32)) as f64;
                assert_eq!(got, sign * reference_rne(mid), "midpoint {mid}");
                // Just below and above the midpoint round down and up.
                let below = f32::from_bits((mid as f32).to_bits() - 1) as f64;
                let above = f32::from_bits((mid as f32).to_bits() + 1) as f64;
                assert_eq!(
                    e4m3_decode(e4m3_encode_rne((sign * below) as f32)) as f64,
                    sign * w[0]
                );
                assert_eq!(
                    e4m3_decode(e4m3_encode_rne((sign * above) as f32)) as f64,
                    sign * w[1]
                );
            }
            // Which way the tie went: to the neighbour whose code is even.
            let up = e4m3_encode_rne(w[1] as f32);
            let want = if up & 1 == 0 { w[1] } else { w[0] };
            assert_eq!(e4m3_decode(e4m3_encode_rne(mid as f32)) as f64, want);
        }
        // Both directions occur: 1.0625 (between 1 and 1.125) goes down, 1.1875 goes up.
        assert_eq!(e4m3_decode(e4m3_encode_rne(1.0625)), 1.0);
        assert_eq!(e4m3_decode(e4m3_encode_rne(1.1875)), 1.25);
        // Subnormal ties: 0.5 * 2^-9 -> 0, 1.5 * 2^-9 -> 2 * 2^-9.
        assert_eq!(e4m3_decode(e4m3_encode_rne(0.5 * 2f32.powi(-9))), 0.0);
        assert_eq!(
            e4m3_decode(e4m3_encode_rne(1.5 * 2f32.powi(-9))),
            2.0 * 2f32.powi(-9)
        );
    }

    #[test]
    fn scale_exponent_is_exact_at_powers_of_two_times_448() {
        for e in -127..=119 {
            let a = (448.0 * pow2(e)) as f32;
            assert_eq!(scale_exponent(a), e, "a = 448 * 2^{e}");
            let above = f32::from_bits(a.to_bits() + 1);
            assert_eq!(
                scale_exponent(above),
                (e + 1).min(127),
                "just above 448 * 2^{e}"
            );
            let below = f32::from_bits(a.to_bits() - 1);
            assert_eq!(scale_exponent(below), e.max(-127), "just below 448 * 2^{e}");
        }
        assert_eq!(scale_exponent(f32::MIN_POSITIVE / 1024.0), -127);
        assert_eq!(scale_exponent(f32::MAX), 120); // 448 * 2^119 < MAX <= 448 * 2^120
        assert_eq!(scale_exponent(1.0), -8);
    }

    #[test]
    fn all_zero_group_has_scale_127_and_zero_codes() {
        let m = quantize(&[0.0; 64], 1, 64);
        assert_eq!(m.scales, vec![127, 127]);
        assert!(m.codes.iter().all(|&c| c == 0));
        assert_eq!(dequantize(&m), vec![0.0; 64]);
    }

    #[test]
    fn short_last_group_and_shapes() {
        let w: Vec<f32> = (0..2 * 40).map(|i| i as f32 - 40.0).collect();
        let m = quantize(&w, 2, 40);
        assert_eq!(m.scales.len(), 4);
        assert_eq!(m.codes.len(), 80);
        // Row 0: group 0 = -40..-9 (a = 40, e = -3), group 1 = -8..-1 (a = 8, e = -5).
        assert_eq!(m.scales[0] as i32 - 127, -3);
        assert_eq!(m.scales[1] as i32 - 127, -5);
        // Each value is the RNE E4M3 rounding of w / 2^e, times 2^e (3 mantissa bits: 39 -> 40, 17 -> 16).
        let got = dequantize(&m);
        for (i, (&x, &y)) in w.iter().zip(&got).enumerate() {
            let e = m.scales[(i / 40) * 2 + (i % 40) / 32] as i32 - 127;
            assert_eq!(
                y as f64,
                reference_rne(x as f64 * pow2(-e)) * pow2(e),
                "index {i}"
            );
        }
        assert_eq!((got[1], got[57], got[77]), (-40.0, 16.0, 36.0));
    }

    #[test]
    fn stored_scale_255_is_nan() {
        assert!(dequantize_stored(&[0x38], &[255], 1, 1)[0].is_nan());
        assert_eq!(dequantize_stored(&[0x38], &[0], 1, 1)[0], 2f32.powi(-127));
    }

    /// Independent slow reference of a group's re-coding: the smallest `e` in [-127, 127] with `a <= 448 * 2^e`
    /// by linear search, then the brute-force RNE E4M3 value of `w / 2^e`, times `2^e`.
    fn reference_group(w: &[f32]) -> Vec<f64> {
        let a = w.iter().fold(0f64, |m, x| m.max((*x as f64).abs()));
        if a == 0.0 {
            return vec![0.0; w.len()];
        }
        let e = (-127..=127)
            .find(|&e| a <= 448.0 * 2f64.powi(e))
            .unwrap_or(127);
        w.iter()
            .map(|&x| reference_rne(x as f64 / 2f64.powi(e)) * 2f64.powi(e))
            .collect()
    }

    /// The device packing: values given by [`dequantize_stored`] (any finite codes and scales) pack into codes and
    /// scales that decode to the same bits.
    fn assert_pack_roundtrip(values: &[f32], rows: usize, cols: usize) {
        let m = pack_exact(values, rows, cols).expect("MXFP8 values pack");
        assert_eq!(m.codes.len(), rows * cols);
        assert_eq!(m.scales.len(), rows * groups_per_row(cols));
        let back = dequantize(&m);
        for (i, (a, b)) in values.iter().zip(&back).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "index {i}: {a} packed as {b}");
        }
    }

    #[test]
    fn pack_exact_roundtrips_recoded_weights() {
        let (rows, cols) = (5, 77);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3 * (1 + i % 9) as f32)
            .collect();
        assert_pack_roundtrip(&dequantize(&quantize(&w, rows, cols)), rows, cols);
        // All-zero groups, -0.0 in an all-zero group and in a non-zero one.
        let mut z = vec![0.0f32; 64];
        z[3] = -0.0;
        z[40] = -0.0;
        z[41] = 1.5;
        assert_pack_roundtrip(&z, 1, 64);
        assert_eq!(pack_exact(&z, 1, 64).unwrap().codes[3], 0x80);
    }

    #[test]
    fn pack_exact_roundtrips_stored_codes_at_every_scale() {
        // Every finite code (0x7F / 0xFF are NaN) with every scale byte whose values stay finite in f32
        // (448 * 2^(s - 127) < 2^128 for s <= 246), groups of 32 codes.
        let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7F != 0x7F).collect();
        for s in 0..=246u8 {
            let mut cs = codes.clone();
            cs.truncate(224); // 7 groups of 32
            let scales = vec![s; 7];
            let values = dequantize_stored(&cs, &scales, 1, 224);
            assert_pack_roundtrip(&values, 1, 224);
            let v = dequantize_stored(&cs, &scales, 7, 32);
            assert_pack_roundtrip(&v, 7, 32);
        }
    }

    #[test]
    fn pack_exact_refuses_values_that_would_change() {
        assert_eq!(
            pack_exact(&[1.0, 2.0, 3.0], 2, 2),
            Err(PackError::Length {
                got: 3,
                rows: 2,
                cols: 2
            })
        );
        // 1.0625 has 5 significant bits: not an E4M3 value at any scale next to 1.
        assert_eq!(
            pack_exact(&[1.0, 1.0625], 1, 2),
            Err(PackError::NotExact {
                index: 1,
                value: 1.0625
            })
        );
        assert!(matches!(
            pack_exact(&[f32::NAN], 1, 1),
            Err(PackError::NotExact { index: 0, .. })
        ));
    }

    proptest! {
        #[test]
        fn groups_match_reference(
            mant in proptest::collection::vec(-1.0f32..1.0, 1..70),
            exp in -140i32..120,
            outlier in proptest::option::of(0usize..70),
        ) {
            let scale = 2f32.powi(exp.clamp(-126, 127));
            let mut w: Vec<f32> = mant.iter().map(|m| m * scale).collect();
            if let Some(o) = outlier {
                let n = w.len();
                w[o % n] *= 1e6f32.min(f32::MAX / scale.max(1.0) / 2.0);
            }
            let cols = w.len();
            let m = quantize(&w, 1, cols);
            let got = dequantize(&m);
            for g in 0..groups_per_row(cols) {
                let lo = g * GROUP;
                let hi = (lo + GROUP).min(cols);
                let want = reference_group(&w[lo..hi]);
                for (k, (&y, &r)) in got[lo..hi].iter().zip(&want).enumerate() {
                    prop_assert_eq!(y as f64, r, "group {} index {}", g, k);
                }
            }
        }

        #[test]
        fn pack_exact_roundtrips_random_stored(
            codes in proptest::collection::vec(any::<u8>(), 1..100),
            scales in proptest::collection::vec(0u8..=246, 4),
            rows in 1usize..4,
        ) {
            let cols = codes.len();
            let codes: Vec<u8> = codes.iter().map(|&c| if c & 0x7F == 0x7F { c & 0xFE } else { c }).collect();
            let mut all = Vec::new();
            let mut sc = Vec::new();
            for r in 0..rows {
                all.extend(codes.iter().map(|&c| {
                    let c = c.rotate_left(r as u32);
                    if c & 0x7F == 0x7F { c & 0xFE } else { c }
                }));
                sc.extend((0..groups_per_row(cols)).map(|g| scales[(g + r) % 4]));
            }
            let values = dequantize_stored(&all, &sc, rows, cols);
            let m = pack_exact(&values, rows, cols).expect("packs");
            let back = dequantize(&m);
            for (a, b) in values.iter().zip(&back) {
                prop_assert_eq!(a.to_bits(), b.to_bits());
            }
        }

        #[test]
        fn encode_matches_reference(x in -500.0f32..500.0) {
            let want = reference_rne(x.clamp(-448.0, 448.0) as f64);
            prop_assert_eq!(e4m3_decode(e4m3_encode_rne(x)) as f64, want);
        }

        #[test]
        fn encode_matches_reference_small(bits in 0u32..0x3D00_0000, neg in any::<bool>()) {
            // Magnitudes from 0 up to about 2^-5: the subnormal and lowest normal binades.
            let x = f32::from_bits(bits | if neg { 0x8000_0000 } else { 0 });
            prop_assert_eq!(e4m3_decode(e4m3_encode_rne(x)) as f64, reference_rne(x as f64));
        }
    }
}

/// Mirrors of `linear_mxfp8`'s decode (kernels/mxfp8.cu `mx_pair`, `mx_factor`, `mx_quad`): every code in both halves
/// of a pair, then the group scaling at every scale byte, must give the BF16 bits of the weight's value, which is what
/// the BF16 `linear` multiplies on the same values (the GPU checks then compare the two kernels bit for bit).
#[cfg(test)]
mod kernel_mirror {
    use super::*;
    use half::bf16;

    /// PTX `prmt.b32 d, a, b, sel` (default mode): result byte i from nibble i of `sel`, whose low 3 bits pick a byte
    /// of `b:a` (a's bytes 0-3, b's 4-7) and whose bit 3 replaces the byte by its sign bit copied 8 times.
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let bytes = (u64::from(b) << 32) | u64::from(a);
        (0..4).fold(0u32, |d, i| {
            let n = (sel >> (4 * i)) & 0xf;
            let byte = ((bytes >> (8 * (n & 7))) & 0xff) as u32;
            let byte = match (n & 8 != 0, byte & 0x80 != 0) {
                (false, _) => byte,
                (true, true) => 0xff,
                (true, false) => 0,
            };
            d | (byte << (8 * i))
        })
    }

    /// `mx_pair` with the kernel's selectors: 0x9180 for bytes 0 and 1 (j = 0), 0xb3a2 for bytes 2 and 3 (j = 2).
    fn mx_pair(w: u32, j: u32) -> [bf16; 2] {
        let r = (prmt(w, 0, if j == 0 { 0x9180 } else { 0xb3a2 }) << 4) & 0x87f0_87f0;
        [bf16::from_bits(r as u16), bf16::from_bits((r >> 16) as u16)]
    }

    /// `mx_factor`: 2^(s - 7) as BF16 in both halves.
    fn mx_factor(s: u32) -> [bf16; 2] {
        let f = (s + 120) * 0x0080_0080;
        [bf16::from_bits(f as u16), bf16::from_bits((f >> 16) as u16)]
    }

    /// `mul.rn.bf16x2` on one half: the exact product (of at most 8 significant bits each: exact in f32, also as an
    /// f32 subnormal from 2^-149 up) rounded to the nearest BF16, ties to even, subnormals kept.
    fn mul(a: bf16, b: bf16) -> bf16 {
        bf16::from_f32(a.to_f32() * b.to_f32())
    }

    /// `mx_quad` on one decoded half (`half` 0 low, 1 high): times its half of `mx_factor(s)`.
    fn scaled(d: bf16, s: u32, half: usize) -> bf16 {
        mul(d, mx_factor(s)[half])
    }

    #[test]
    fn pair_decode_is_exact_for_every_code_in_both_halves() {
        for c in 0..=255u32 {
            let want = e4m3_decode(c as u8);
            if want.is_nan() {
                continue; // 0x7F / 0xFF: never packed
            }
            for j in [0u32, 2] {
                for half in 0..2 {
                    for fill in [0u32, 0xFFFF_FFFF, 0xA5A5_A5A5, 0x5A5A_5A5A, 0x7F80_FF01] {
                        let w = (fill & !(0xFF << (8 * (j + half)))) | (c << (8 * (j + half)));
                        let d = mx_pair(w, j)[half as usize];
                        // d * 2^120 is exact: a power-of-two scaling of at most 4 significant bits.
                        assert_eq!(
                            (d.to_f32() as f64 * 2f64.powi(120)).to_bits(),
                            (want as f64).to_bits(),
                            "code {c:#04x} in byte {} among {fill:#010x}",
                            j + half
                        );
                    }
                }
            }
        }
        // Subnormal codes decode to BF16 subnormals, the smallest normal code to the smallest normal BF16.
        assert!(mx_pair(0x01, 0)[0].to_f32().is_subnormal());
        assert_eq!(mx_pair(0x08, 0)[0].to_f32(), f32::MIN_POSITIVE);
    }

    #[test]
    fn group_scaling_gives_every_weight_its_bf16_bits() {
        // The factor of the largest scale the kernel takes is BF16's largest power of two, the next one past the range.
        let top = KERNEL_MAX_SCALE as u32;
        assert_eq!(mx_factor(top), [bf16::from_f32(2f32.powi(127)); 2]);
        assert!(!bf16::from_bits(((top + 1 + 120) << 7) as u16).is_finite());
        for s in 0..=top {
            for c in 0..=255u32 {
                let v = e4m3_decode(c as u8);
                if v.is_nan() {
                    continue;
                }
                // What the CPU twin computes on: the f32 value (exact while finite); the BF16 backend holds its BF16.
                let cpu = v * e8m0_decode(s as u8);
                if !cpu.is_finite() {
                    continue; // never packed (`pack_exact` rejects it)
                }
                // The code in each byte, scaled by the factor's half of the same position.
                let (gpu, want) = (
                    scaled(mx_pair(c, 0)[0], s, 0),
                    bf16::from_f32(cpu).to_bits(),
                );
                assert_eq!(gpu.to_bits(), want, "code {c:#04x} scale {s}");
                for (j, half) in [(0u32, 1usize), (2, 0), (2, 1)] {
                    let w = c << (8 * (j + half as u32));
                    let other = scaled(mx_pair(w, j)[half], s, half);
                    assert_eq!(
                        other.to_bits(),
                        want,
                        "code {c:#04x} in byte {} scale {s}",
                        j + half as u32
                    );
                }
                // Wherever the value is a BF16 value (every weight re-coded from BF16), it is that value.
                if bf16::from_f32(cpu).to_f32() == cpu {
                    assert_eq!(
                        gpu.to_f32().to_bits(),
                        cpu.to_bits(),
                        "code {c:#04x} scale {s}"
                    );
                }
            }
        }
    }
}
