//! Weight forms in device memory (issue 8): BF16 for every weight, except the MXFP8 weights that only `Linear`
//! nodes read ([`crate::mxfp8::device_mxfp8_weights`]), which stay MXFP8 (`linear_mxfp8`, `kernels/mxfp8.cu`).
//!
//! Layout of one weight in the weight allocation (each weight starts 256-byte aligned):
//! - BF16 `[rows, cols]`: `rows * cols` 16-bit patterns, row-major;
//! - MXFP8 `[n, k]`: the E4M3 codes `[n, k]` (one byte each, row-major), then, at the next 256-byte boundary, the
//!   E8M0 scales `[n, ceil(k / 32)]` (one byte per 32 consecutive inputs of a row, row-major). The weight's address
//!   is the codes'; the scales' address is kept beside it ([`Placed::scales`]).

use crate::mxfp8::{device_mxfp8_weights, pack_exact, Mxfp8};
use flashplan_plan::PlanBody;

/// Alignment of every piece in the weight allocation, bytes.
pub(crate) const ALIGN: usize = 256;

/// One weight as the GPU thread uploads it.
pub(crate) enum DevWeight {
    /// BF16 bit patterns, row-major.
    Bf16(Vec<u16>),
    /// MXFP8 codes and scales ([`crate::mxfp8`] layout).
    Mxfp8(Mxfp8),
}

/// Where a weight lies: byte offsets in the weight allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    /// The weight (BF16 values or MXFP8 codes).
    pub data: usize,
    /// MXFP8 scales; `None` for BF16.
    pub scales: Option<usize>,
}

fn up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

impl DevWeight {
    /// The pieces to copy: (byte offset from the weight's start, bytes).
    pub(crate) fn pieces(&self) -> Vec<(usize, &[u8])> {
        match self {
            DevWeight::Bf16(v) => {
                // SAFETY: u16 has no padding; the byte view covers exactly the vector's initialized elements.
                let b = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 2) };
                vec![(0, b)]
            }
            DevWeight::Mxfp8(m) => vec![(0, &m.codes[..]), (up(m.codes.len()), &m.scales[..])],
        }
    }
    /// Bytes the weight takes, padded to [`ALIGN`].
    pub(crate) fn bytes(&self) -> usize {
        match self {
            DevWeight::Bf16(v) => up(v.len() * 2),
            DevWeight::Mxfp8(m) => up(m.codes.len()) + up(m.scales.len()),
        }
    }
}

/// Places the weights one after another (`None` entries take no room); returns each one's place and the total.
pub(crate) fn place(weights: &[Option<DevWeight>]) -> (Vec<Option<Placed>>, usize) {
    let mut total = 0usize;
    let mut out = Vec::with_capacity(weights.len());
    for w in weights {
        out.push(w.as_ref().map(|w| {
            let p = Placed {
                data: total,
                scales: match w {
                    DevWeight::Bf16(_) => None,
                    DevWeight::Mxfp8(m) => Some(total + up(m.codes.len())),
                },
            };
            total += w.bytes();
            p
        }));
    }
    (out, total)
}

/// The device forms of the host weights (f32, indexed like `body.weights`; `None` is not loaded): MXFP8 codes and
/// scales for [`device_mxfp8_weights`], packed losslessly ([`pack_exact`]), BF16 (round to nearest) for the rest.
/// An MXFP8 weight whose values cannot be packed without changing them (not expected: re-coded and stored MXFP8
/// values always can, unless a stored group overflows f32) is uploaded as BF16, with a warning, and runs `linear`.
pub(crate) fn device_forms(
    body: &PlanBody,
    weights: &[Option<Vec<f32>>],
) -> Vec<Option<DevWeight>> {
    let mx = device_mxfp8_weights(body);
    let mut out = Vec::with_capacity(weights.len());
    for (i, w) in weights.iter().enumerate() {
        let Some(w) = w else {
            out.push(None);
            continue;
        };
        let packed = match body.weights.get(i) {
            Some(e) if mx.get(i).copied().unwrap_or(false) => {
                let cols = e.shape.last().copied().unwrap_or(1) as usize;
                let rows = w.len().checked_div(cols).unwrap_or(0);
                pack_exact(w, rows, cols)
                    .map_err(|err| {
                        tracing::warn!("MXFP8 weight {} stays BF16 on the device: {err}", e.name)
                    })
                    .ok()
            }
            _ => None,
        };
        let dev = match packed {
            Some(m) => DevWeight::Mxfp8(m),
            None => DevWeight::Bf16(
                w.iter()
                    .map(|x| half::bf16::from_f32(*x).to_bits())
                    .collect(),
            ),
        };
        out.push(Some(dev));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mxfp8::{dequantize_stored, e4m3_decode, e8m0_decode, quantize};

    #[test]
    fn mxfp8_pieces_hold_codes_then_aligned_scales() {
        let w: Vec<f32> = (0..3 * 40).map(|i| (i as f32 - 50.0) * 0.37).collect();
        let m = quantize(&w, 3, 40);
        let dev = [
            Some(DevWeight::Bf16(vec![0; 5])),
            None,
            Some(DevWeight::Mxfp8(m.clone())),
        ];
        let (placed, total) = place(&dev);
        assert_eq!(
            placed[0],
            Some(Placed {
                data: 0,
                scales: None
            })
        );
        assert_eq!(placed[1], None);
        assert_eq!(
            placed[2],
            Some(Placed {
                data: 256,
                scales: Some(512)
            })
        );
        assert_eq!(total, 768);
        // The bytes at those places, read back as the kernel reads them, give the values.
        let mut mem = vec![0u8; total];
        for (w, p) in dev.iter().zip(&placed) {
            if let (Some(w), Some(p)) = (w, p) {
                for (off, b) in w.pieces() {
                    mem[p.data + off..p.data + off + b.len()].copy_from_slice(b);
                }
            }
        }
        let (n, k) = (3usize, 40usize);
        let g = k.div_ceil(32);
        for r in 0..n {
            for c in 0..k {
                let code = mem[256 + r * k + c];
                let s = mem[512 + r * g + c / 32];
                assert_eq!(
                    e4m3_decode(code) * e8m0_decode(s),
                    dequantize_stored(&m.codes, &m.scales, n, k)[r * k + c]
                );
            }
        }
    }
}
