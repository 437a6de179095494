//! FP8 block-scaled weights, as the FP8 release stores its routed experts and PLE table (`flash-next.md` section
//! 10; the DeepSeek-V3 form that transformers' `FineGrainedFP8Config` reads): E4M3 (OCP FN) codes `[.., R, C]` and
//! a sibling `<name>_scale_inv` of f32 scales `[.., ceil(R / 128), ceil(C / 128)]`, one per 128 x 128 block (the
//! last block of a row or column of blocks may be partial), the leading dims (stacked experts) one matrix each.
//!
//! The value of code `q` in block `(i, j)` is `e4m3(q) * scale[i][j]`, one f32 product, as transformers'
//! `Fp8Dequantize._dequantize_one` computes it before casting to the model's dtype (`integrations/finegrained_fp8.py`
//! in 5.23.0). The loader keeps that f32 product (the CPU backend computes in f32, as the golden tests' transformers
//! runs do); the CUDA backend holds it as BF16, as it holds every weight that is not MXFP8, until FP8 kernels exist.

use crate::mxfp8::e4m3_decode;

/// Rows and columns of one scale block (the `weight_block_size` `[128, 128]` the config declares).
pub const BLOCK: usize = 128;

/// The shape of the scales for codes of shape `codes`: the last two dims divided by [`BLOCK`], rounded up, the
/// leading dims kept; `None` for fewer than two dims.
pub fn scale_shape(codes: &[usize]) -> Option<Vec<usize>> {
    let n = codes.len();
    if n < 2 {
        return None;
    }
    let mut s = codes.to_vec();
    s[n - 2] = codes[n - 2].div_ceil(BLOCK);
    s[n - 1] = codes[n - 1].div_ceil(BLOCK);
    Some(s)
}

/// The f32 values of FP8 block-scaled codes: `codes` row-major `[batch, rows, cols]` (`batch = codes.len() / (rows *
/// cols)`), `scales` row-major `[batch, ceil(rows / 128), ceil(cols / 128)]`.
///
/// # Panics
/// When the lengths do not match `rows` and `cols` (the loader checked the shapes first).
pub fn dequantize_block(codes: &[u8], scales: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let per = rows * cols;
    let (br, bc) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
    assert!(
        per > 0 && codes.len().is_multiple_of(per),
        "FP8 block codes: {} for matrices of {rows} x {cols}",
        codes.len()
    );
    let batch = codes.len() / per;
    assert_eq!(
        scales.len(),
        batch * br * bc,
        "FP8 block scales for {batch} x {rows} x {cols}"
    );
    let table: Vec<f32> = (0..=255u8).map(e4m3_decode).collect();
    let mut out = vec![0f32; codes.len()];
    for b in 0..batch {
        for r in 0..rows {
            let row = b * per + r * cols;
            let srow = (b * br + r / BLOCK) * bc;
            for (c, (o, &q)) in out[row..row + cols]
                .iter_mut()
                .zip(&codes[row..row + cols])
                .enumerate()
            {
                *o = table[q as usize] * scales[srow + c / BLOCK];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E4M3 by its definition (OCP 8-bit floating point, E4M3 FN: bias 7, no infinities, `S.1111.111` NaN), written
    /// apart from `mxfp8::e4m3_decode`.
    fn e4m3(q: u8) -> f32 {
        let (s, e, m) = ((q >> 7) as i32, ((q >> 3) & 15) as i32, (q & 7) as f32);
        let mag = if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        };
        if s == 1 {
            -mag
        } else {
            mag
        }
    }

    #[test]
    fn each_value_is_its_code_times_its_blocks_scale() {
        // 130 x 260: a partial last block both ways (2 x 3 blocks), two stacked matrices, every finite code, scales
        // that are not powers of two (so the product rounds) and a zero scale.
        let (rows, cols, batch) = (130usize, 260usize, 2usize);
        let finite: Vec<u8> = (0..=255u8).filter(|q| q & 0x7F != 0x7F).collect();
        let codes: Vec<u8> = (0..batch * rows * cols)
            .map(|i| finite[(i * 7919) % finite.len()])
            .collect();
        let scales: Vec<f32> = (0..batch * 2 * 3)
            .map(|i| {
                if i == 4 {
                    0.0
                } else {
                    0.37 * (i as f32 + 1.0).powi(3) / 1000.0
                }
            })
            .collect();
        let got = dequantize_block(&codes, &scales, rows, cols);
        for b in 0..batch {
            for r in 0..rows {
                for c in 0..cols {
                    let i = (b * rows + r) * cols + c;
                    let s = scales[(b * 2 + r / 128) * 3 + c / 128];
                    assert_eq!(
                        got[i].to_bits(),
                        (e4m3(codes[i]) * s).to_bits(),
                        "[{b}, {r}, {c}]"
                    );
                }
            }
        }
        // Extremes: the largest code, the smallest subnormal, signed zero.
        let one = |q: u8, s: f32| dequantize_block(&[q], &[s], 1, 1)[0];
        assert_eq!(one(0x7E, 0.5), 224.0);
        assert_eq!(one(0xFE, 2.0), -896.0);
        assert_eq!(one(0x01, 1.0), 2f32.powi(-9));
        assert_eq!(one(0x80, 3.0).to_bits(), (-0.0f32).to_bits());
        assert!(one(0x7F, 1.0).is_nan());
    }

    #[test]
    fn the_scale_grid_rounds_up_and_keeps_leading_dims() {
        assert_eq!(scale_shape(&[640, 2560]), Some(vec![5, 20]));
        assert_eq!(scale_shape(&[512, 1280, 2560]), Some(vec![512, 10, 20]));
        assert_eq!(scale_shape(&[100, 160]), Some(vec![1, 2]));
        assert_eq!(scale_shape(&[160]), None);
    }
}
