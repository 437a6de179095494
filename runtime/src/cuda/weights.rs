//! Weight forms in device memory (issue 8): BF16 for every weight, except the MXFP8 weights that only `Linear`
//! nodes read ([`crate::mxfp8::device_mxfp8_weights`]), which stay MXFP8 (`linear_mxfp8`, `kernels/mxfp8.cu`).
//!
//! Layout of one weight in the weight allocation (each weight starts 256-byte aligned):
//! - BF16 `[n, k]` read only by `Linear` nodes ([`flashplan_plan::WeightUse::Linear`]): MMA tiles ([`tile_linear`]),
//!   so that every lane of `linear`'s warps loads its MMA A fragments with two 16-byte loads and no register moves;
//! - BF16 `up` of a hyper-connection read ([`flashplan_plan::WeightUse::HcUp`]): feature-major MMA tiles
//!   ([`tile_hc_up`]) for `hc_mix_tc`;
//! - any other BF16 `[rows, cols]`: `rows * cols` 16-bit patterns, row-major;
//! - MXFP8 `[n, k]`: MMA tiles of E4M3 codes, each with its E8M0 scales ([`tile_mxfp8`]), so that every lane of
//!   `linear_mxfp8`'s warps loads the codes of its two A fragments with one 16-byte load, and a warp reads each step's
//!   weights as one contiguous run.

use crate::backend::BackendError;
use crate::mxfp8::{mxfp8_flags, pack_exact, Mxfp8, KERNEL_MAX_SCALE};
use flashplan_plan::{Op, PlanBody, WeightUse};

/// Alignment of every piece in the weight allocation, bytes.
pub(crate) const ALIGN: usize = 256;

/// One weight as the GPU thread uploads it.
pub(crate) enum DevWeight {
    /// BF16 bit patterns in the weight's device layout ([`bf16_layout`]: MMA tiles or row-major).
    Bf16(Vec<u16>),
    /// MXFP8 codes and scales in MMA tiles ([`tile_mxfp8`]).
    Mxfp8(Vec<u8>),
}

/// Where a weight lies: byte offsets in the weight allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    /// The weight (BF16 values or MXFP8 tiles).
    pub data: usize,
    /// Whether it is MXFP8 ([`tile_mxfp8`]) rather than BF16.
    pub mxfp8: bool,
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
            DevWeight::Mxfp8(t) => vec![(0, &t[..])],
        }
    }
    /// Bytes the weight takes, padded to [`ALIGN`].
    pub(crate) fn bytes(&self) -> usize {
        match self {
            DevWeight::Bf16(v) => up(v.len() * 2),
            DevWeight::Mxfp8(t) => up(t.len()),
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
                mxfp8: matches!(w, DevWeight::Mxfp8(_)),
            };
            total += w.bytes();
            p
        }));
    }
    (out, total)
}

/// Output features (rows) of one MMA tile of a linear weight: the m16 of `mma.sync.m16n8k16` (kernels/linear.cuh).
pub(crate) const TILE_ROWS: usize = 16;
/// Input features (columns) of one MMA tile: one step of `linear_tc_rows` (two k16 MMAs).
pub(crate) const TILE_COLS: usize = 32;

/// Position in [`tile_linear`]'s layout of element `(row, col)` of a weight with `k` columns.
///
/// Tile `(m, s)` (rows `16 m ..`, columns `32 s ..`) is 1 KB at element `(m * ceil(k / 32) + s) * 512`. Lane
/// `l = 4 g + q` of a warp reads, for half `h` (0, 1: the step's two MMAs), the 16 bytes at element
/// `256 h + 8 l`: its four A-fragment registers `j = 0 .. 3` for `mma.sync.m16n8k16` (PTX ISA, "Matrix Fragments
/// for mma.m16n8k16": a0a1 row g, a2a3 row g + 8, a4a5 row g, a6a7 row g + 8), register `j` holding the pair of
/// columns `8 q + 4 h + 2 (j / 2) + {0, 1}` of row `g + 8 (j % 2)` of the tile (lower column in the low half).
/// This is the K permutation `linear_tc_rows` applies to the activations within a step (kernels/linear.cuh).
pub(crate) fn tile_index(row: usize, col: usize, k: usize) -> usize {
    let steps = k.div_ceil(TILE_COLS);
    let (m, r) = (row / TILE_ROWS, row % TILE_ROWS);
    let (s, c) = (col / TILE_COLS, col % TILE_COLS);
    let (g, hi) = (r % 8, r / 8);
    let (q, h, pair, e) = (c / 8, (c % 8) / 4, (c % 4) / 2, c % 2);
    let lane = 4 * g + q;
    let j = hi + 2 * pair;
    (m * steps + s) * TILE_ROWS * TILE_COLS + h * 256 + lane * 8 + j * 2 + e
}

/// A BF16 linear weight `[n, k]` (row-major bit patterns) in MMA tiles ([`tile_index`]), zero-padded to whole
/// tiles: `ceil(n / 16) * ceil(k / 32) * 512` elements. The padding is zero, so `linear` reads whole tiles with no
/// bounds checks (padded rows are never written out; padded columns meet zero activations).
///
/// # Panics
/// If `w.len() != n * k` (the caller checked the shape against the manifest).
pub(crate) fn tile_linear(w: &[u16], n: usize, k: usize) -> Vec<u16> {
    assert_eq!(
        w.len(),
        n * k,
        "tile_linear: {} values for [{n}, {k}]",
        w.len()
    );
    let mut out = vec![0u16; n.div_ceil(TILE_ROWS) * k.div_ceil(TILE_COLS) * TILE_ROWS * TILE_COLS];
    for (row, vals) in w.chunks_exact(k.max(1)).enumerate() {
        for (col, &v) in vals.iter().enumerate() {
            out[tile_index(row, col, k)] = v;
        }
    }
    out
}

/// Bytes of one MXFP8 tile ([`tile_mxfp8`]): 16 features x 32 codes, then their 16 scale bytes (kernels/params.h
/// `MX_TILE_BYTES`, which kernels/mxfp8.cu reads).
pub(crate) const MX_TILE_BYTES: usize = crate::cuda::params::MX_TILE_BYTES;

/// Bytes of an MXFP8 `[n, k]` weight in tiles ([`tile_mxfp8`]): ceil(n / 16) x ceil(k / 32) tiles.
pub(crate) fn mxfp8_tile_bytes(n: u64, k: u64) -> u64 {
    n.div_ceil(16) * k.div_ceil(32) * MX_TILE_BYTES as u64
}

/// MXFP8 `[n, k]` in MMA tiles for `linear_mxfp8` (kernels/mxfp8.cu `TcMxfp8Tiles`): tile (m, step) of features
/// 16 m .. 16 m + 15 and inputs 32 step .. 32 step + 31 is [`MX_TILE_BYTES`] at byte
/// `(m * ceil(k / 32) + step) * MX_TILE_BYTES`. Its bytes `16 l .. 16 l + 15` are lane l's (g = l / 4, q = l % 4):
/// the 8 codes of feature 16 m + g at inputs 32 step + 8 q .. + 7, then those of feature 16 m + g + 8; its bytes
/// `512 + 2 g + h` (g < 8, h < 2) are the scales of feature 16 m + 8 h + g for the step (a step of 32 inputs is one
/// scale group: a lane loads its two rows' scales as one 16-bit word). Past n and k: zero codes with scale 127
/// (weights 0).
pub(crate) fn tile_mxfp8(m: &Mxfp8) -> Vec<u8> {
    let (n, k) = (m.rows, m.cols);
    // A step of 32 inputs is one scale group: steps = groups per row.
    let steps = crate::mxfp8::groups_per_row(k);
    let mut out = vec![0u8; mxfp8_tile_bytes(n as u64, k as u64) as usize];
    for (tile, t) in out.chunks_exact_mut(MX_TILE_BYTES).enumerate() {
        let (mt, step) = (tile / steps, tile % steps);
        for r in 0..16 {
            let row = mt * 16 + r;
            // The lane (g, q) bytes of this row: g = r % 8, the first or second half of each lane's 16 bytes.
            let (g, half) = (r % 8, r / 8);
            if row >= n {
                t[512 + 2 * g + half] = 127;
                continue;
            }
            t[512 + 2 * g + half] = m.scales[row * steps + step];
            for q in 0..4 {
                for e in 0..8 {
                    let col = step * 32 + q * 8 + e;
                    if col < k {
                        t[(g * 4 + q) * 16 + half * 8 + e] = m.codes[row * k + col];
                    }
                }
            }
        }
    }
    out
}

/// Whether an `HcRead` of `hc` hyper-connections computes its gates on tensor cores (`hc_mix_tc` in
/// kernels/norm.cu, its `up` weight tiled by [`tile_hc_up`]): a tile of 16 gate rows then holds the `hc` gates of
/// 16 / hc whole features, so `hc` divides 16.
pub(crate) fn hc_mix_on_tensor_cores(hc: u32) -> bool {
    hc > 0 && 16 % hc == 0
}

/// An `HcRead`'s `up` weight `[hc * dim, rank]` (row `c * dim + d`: the gate of hyper-connection c for feature d)
/// with its rows feature-major (row `d * hc + c` holds row `c * dim + d`), in MMA tiles ([`tile_linear`]): a tile
/// of 16 rows holds every gate of 16 / hc features.
///
/// # Panics
/// If `w.len() != hc * dim * rank`.
pub(crate) fn tile_hc_up(w: &[u16], hc: usize, dim: usize, rank: usize) -> Vec<u16> {
    assert_eq!(w.len(), hc * dim * rank, "tile_hc_up: {} values", w.len());
    let mut fm = vec![0u16; w.len()];
    for c in 0..hc {
        for d in 0..dim {
            let (from, to) = ((c * dim + d) * rank, (d * hc + c) * rank);
            fm[to..to + rank].copy_from_slice(&w[from..from + rank]);
        }
    }
    tile_linear(&fm, hc * dim, rank)
}

/// Checks (with `uses` = [`PlanBody::weight_uses`]) that every weight a `Linear` node reads is read only by
/// `Linear` nodes, as the matrix `[n, k]` of its shape, and every `HcRead`'s `up` weight only as such, with 1, 2,
/// 4, 8 or 16 hyper-connections: the CUDA backend holds these weights in MMA tiles (or MXFP8), which no other
/// kernel reads.
///
/// # Errors
/// [`BackendError::Device`] naming the first weight that a `Linear` node and another node (or a `Linear` of
/// another shape) both read, or the first `up` weight read otherwise or with another number of hyper-connections.
/// The compiler never plans the former (`tie_word_embeddings` is refused by the config).
pub(crate) fn check_linear_weights(
    body: &PlanBody,
    uses: &[WeightUse],
) -> Result<(), BackendError> {
    for v in &body.variants {
        for node in &v.nodes {
            if let Op::HcRead {
                up, hc, dim, rank, ..
            } = &node.op
            {
                let i = up.0 as usize;
                let want = WeightUse::HcUp {
                    hc: *hc,
                    dim: *dim,
                    rank: *rank,
                };
                if !hc_mix_on_tensor_cores(*hc) || uses.get(i) != Some(&want) {
                    let name = body.weights.get(i).map_or("?", |e| e.name.as_str());
                    return Err(BackendError::Device(format!(
                        "hyper-connection up weight {name} ({}: {hc} x {dim} gates of rank {rank}): the CUDA \
                         backend needs 1, 2, 4, 8 or 16 hyper-connections and the weight read only as this \
                         node's `up` [{hc} * {dim}, {rank}] (it holds it in feature-major MMA tiles)",
                        v.kind.name()
                    )));
                }
            }
            if let Op::Linear { w, n, k, .. } = &node.op {
                let i = w.0 as usize;
                if !matches!(uses.get(i), Some(WeightUse::Linear { .. })) {
                    let name = body.weights.get(i).map_or("?", |e| e.name.as_str());
                    return Err(BackendError::Device(format!(
                        "weight {name} is read by a `linear` node ({}: [{n}, {k}]) and by another node or in \
                         another shape; the CUDA backend holds linear weights in MMA tiles only `linear` reads",
                        v.kind.name()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// A BF16 weight (row-major bit patterns) in its device layout: MMA tiles for a weight only `Linear` nodes read,
/// feature-major MMA tiles for an `HcRead`'s `up` weight when [`hc_mix_on_tensor_cores`], else as given.
///
/// # Errors
/// [`BackendError::Device`] when a linear or `up` weight does not hold the values its shape says.
pub(crate) fn bf16_layout(w: Vec<u16>, u: WeightUse) -> Result<DevWeight, BackendError> {
    match u {
        WeightUse::HcUp { hc, dim, rank } if hc_mix_on_tensor_cores(hc) => {
            let (hc, dim, rank) = (hc as usize, dim as usize, rank as usize);
            if w.len() != hc * dim * rank {
                return Err(BackendError::Device(format!(
                    "a hyper-connection up weight [{}, {rank}] holds {} values",
                    hc * dim,
                    w.len()
                )));
            }
            Ok(DevWeight::Bf16(tile_hc_up(&w, hc, dim, rank)))
        }
        WeightUse::Linear { n, k } => {
            let (n, k) = (n as usize, k as usize);
            if w.len() != n * k {
                return Err(BackendError::Device(format!(
                    "a linear weight [{n}, {k}] holds {} values, expected {}",
                    w.len(),
                    n * k
                )));
            }
            Ok(DevWeight::Bf16(tile_linear(&w, n, k)))
        }
        _ => Ok(DevWeight::Bf16(w)),
    }
}

/// The device forms of the host weights (f32, indexed like `body.weights`; `None` is not loaded; `uses` =
/// [`PlanBody::weight_uses`]): MXFP8 codes and scales for [`crate::mxfp8::device_mxfp8_weights`], packed
/// losslessly ([`pack_exact`]), BF16 (round to nearest) for the rest ([`bf16_layout`]: MMA tiles for linear
/// weights).
/// An MXFP8 weight whose values cannot be packed without changing them (not expected: re-coded and stored MXFP8
/// values always can, unless a stored group overflows f32), or with a scale above
/// [`KERNEL_MAX_SCALE`](crate::mxfp8::KERNEL_MAX_SCALE), is uploaded as BF16, with a warning, and runs `linear`.
///
/// # Errors
/// As [`bf16_layout`].
pub(crate) fn device_forms(
    body: &PlanBody,
    uses: &[WeightUse],
    weights: &[Option<Vec<f32>>],
) -> Result<Vec<Option<DevWeight>>, BackendError> {
    let mx = mxfp8_flags(body, uses);
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
                match pack_exact(w, rows, cols) {
                    Ok(m) if m.scales.iter().all(|&s| s <= KERNEL_MAX_SCALE) => Some(m),
                    Ok(_) => {
                        tracing::warn!(
                            "MXFP8 weight {} stays BF16 on the device: a scale above {KERNEL_MAX_SCALE} (a group \
                             with a value above 57344)",
                            e.name
                        );
                        None
                    }
                    Err(err) => {
                        tracing::warn!("MXFP8 weight {} stays BF16 on the device: {err}", e.name);
                        None
                    }
                }
            }
            _ => None,
        };
        let dev = match packed {
            Some(m) => DevWeight::Mxfp8(tile_mxfp8(&m)),
            None => bf16_layout(
                w.iter()
                    .map(|x| half::bf16::from_f32(*x).to_bits())
                    .collect(),
                uses.get(i).copied().unwrap_or(WeightUse::Other),
            )?,
        };
        out.push(Some(dev));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mxfp8::{dequantize_stored, e4m3_decode, e8m0_decode, quantize};

    /// The m16n8k16 A fragment as the PTX ISA gives it ("Matrix Fragments for mma.m16n8k16 with floating point
    /// type"): register pair i = 0 .. 7 of lane (g, q) is row g + 8 ((i / 2) % 2), column 2 q + i % 2 + 8 (i / 4).
    fn a_fragment(lane: usize, i: usize) -> (usize, usize) {
        let (g, q) = (lane / 4, lane % 4);
        (g + 8 * ((i / 2) % 2), 2 * q + i % 2 + 8 * (i / 4))
    }

    #[test]
    fn tiles_hold_each_lanes_a_fragments_in_the_activations_k_order() {
        // Shape with padding in both dimensions; values distinct and non-zero.
        let (n, k) = (37usize, 70usize);
        let w: Vec<u16> = (0..n * k).map(|i| 1 + i as u16).collect();
        let t = tile_linear(&w, n, k);
        let steps = k.div_ceil(32);
        assert_eq!(t.len(), n.div_ceil(16) * steps * 512);
        for m in 0..n.div_ceil(16) {
            for s in 0..steps {
                for lane in 0..32 {
                    for h in 0..2 {
                        // The 16 bytes lane reads for MMA h: A registers a0a1, a2a3, a4a5, a6a7.
                        let at = (m * steps + s) * 512 + h * 256 + lane * 8;
                        for i in 0..8 {
                            let (row, logical) = a_fragment(lane, i);
                            // linear_tc_rows' activation order within a step: MMA h's logical k 2q + e and
                            // 2q + 8 + e are inputs 8q + 4h + e and 8q + 4h + 2 + e (tc_split_x's pairs).
                            let q = lane % 4;
                            let col = 8 * q + 4 * h + 2 * (logical / 8) + logical % 2;
                            let (r, c) = (16 * m + row, 32 * s + col);
                            let want = if r < n && c < k { w[r * k + c] } else { 0 };
                            assert_eq!(t[at + i], want, "m {m} s {s} lane {lane} h {h} a{i}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn hc_up_tiles_hold_each_features_gates_together() {
        // up [C * D, rank]: row c * D + d is gate c of feature d; tile row d * C + c must hold it.
        let (hc, dim, rank) = (4usize, 6usize, 40usize);
        let w: Vec<u16> = (0..hc * dim * rank).map(|i| 1 + i as u16).collect();
        let t = tile_hc_up(&w, hc, dim, rank);
        assert_eq!(t.len(), (hc * dim).div_ceil(16) * rank.div_ceil(32) * 512);
        for c in 0..hc {
            for d in 0..dim {
                for j in 0..rank {
                    assert_eq!(
                        t[tile_index(d * hc + c, j, rank)],
                        w[(c * dim + d) * rank + j]
                    );
                }
            }
        }
        assert!(
            hc_mix_on_tensor_cores(4) && hc_mix_on_tensor_cores(16) && !hc_mix_on_tensor_cores(3)
        );
        let u = WeightUse::HcUp {
            hc: 4,
            dim: 6,
            rank: 40,
        };
        assert!(matches!(bf16_layout(w.clone(), u), Ok(DevWeight::Bf16(v)) if v == t));
        assert!(bf16_layout(w[1..].to_vec(), u).is_err());
    }

    #[test]
    fn every_linear_weight_of_the_plans_is_read_only_by_linears() {
        let body = super::super::fuse::tests::tiny_plan();
        let uses = body.weight_uses();
        check_linear_weights(&body, &uses).expect("tiny plan");
        let lm = body.weight_index("lm_head.weight").expect("lm_head");
        // Every hyper-connection read's up weight is read as such only.
        let ups: Vec<usize> = body
            .variants
            .iter()
            .flat_map(|v| &v.nodes)
            .filter_map(|n| match n.op {
                Op::HcRead { up, .. } => Some(up.0 as usize),
                _ => None,
            })
            .collect();
        assert!(!ups.is_empty());
        for u in ups {
            assert!(
                matches!(uses[u], WeightUse::HcUp { hc: 4, .. }),
                "{:?}",
                uses[u]
            );
        }
        assert_eq!(
            uses[lm],
            WeightUse::Linear {
                n: body.config.vocab_size,
                k: body.config.hidden_size
            }
        );
        // A linear weight that another node also reads is refused by name.
        let mut shared = body.clone();
        let embed = shared.weight_index("embed_tokens.weight").expect("embed");
        for v in &mut shared.variants {
            for node in &mut v.nodes {
                if let Op::Linear { w, .. } = &mut node.op {
                    if w.0 as usize == lm {
                        w.0 = embed as u32;
                    }
                }
            }
        }
        let err = check_linear_weights(&shared, &shared.weight_uses())
            .expect_err("shared with the embedding");
        assert!(err.to_string().contains("embed_tokens.weight"), "{err}");
        // An up weight read in another role (here: as its node's down weight too) is refused by name.
        let mut reused = body.clone();
        let mut name = String::new();
        'outer: for v in &mut reused.variants {
            for node in &mut v.nodes {
                if let Op::HcRead { up, down, .. } = &mut node.op {
                    *down = *up;
                    name = reused_name(&body, up.0 as usize);
                    break 'outer;
                }
            }
        }
        let err =
            check_linear_weights(&reused, &reused.weight_uses()).expect_err("up read as down");
        assert!(err.to_string().contains(&name), "{err}");
    }

    fn reused_name(body: &PlanBody, i: usize) -> String {
        body.weights[i].name.clone()
    }

    #[test]
    fn only_linear_weights_are_tiled() {
        let w = vec![7u16; 6];
        assert!(
            matches!(bf16_layout(w.clone(), WeightUse::Other), Ok(DevWeight::Bf16(v)) if v == w)
        );
        let Ok(DevWeight::Bf16(t)) = bf16_layout(w.clone(), WeightUse::Linear { n: 2, k: 3 })
        else {
            panic!("tiled");
        };
        assert_eq!(t.len(), 512);
        assert!(bf16_layout(w, WeightUse::Linear { n: 4, k: 3 }).is_err());
    }

    #[test]
    fn mxfp8_tiles_hold_each_lanes_codes_and_the_steps_scales() {
        // 20 features (a part tile) x 40 inputs (a part step).
        let (n, k) = (20usize, 40usize);
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 - 350.0) * 0.37).collect();
        let m = quantize(&w, n, k);
        let dev = [
            Some(DevWeight::Bf16(vec![0; 5])),
            None,
            Some(DevWeight::Mxfp8(tile_mxfp8(&m))),
        ];
        let (placed, total) = place(&dev);
        let p = |data, mxfp8| Some(Placed { data, mxfp8 });
        assert_eq!(placed, vec![p(0, false), None, p(256, true)]);
        let steps = k.div_ceil(32);
        let tiles = n.div_ceil(16) * steps;
        assert_eq!(total, 256 + (tiles * MX_TILE_BYTES).div_ceil(ALIGN) * ALIGN);
        let mut mem = vec![0u8; total];
        for (w, p) in dev.iter().zip(&placed) {
            if let (Some(w), Some(p)) = (w, p) {
                for (off, b) in w.pieces() {
                    mem[p.data + off..p.data + off + b.len()].copy_from_slice(b);
                }
            }
        }
        // Read back as the kernel reads them (TcMxfp8Tiles): lane (g, q) of tile (m, step), half h for feature
        // 16 m + 8 h + g; its scale byte 512 + 2 g + h.
        let want = dequantize_stored(&m.codes, &m.scales, n, k);
        for row in 0..n.div_ceil(16) * 16 {
            for col in 0..steps * 32 {
                let tile = 256 + ((row / 16) * steps + col / 32) * MX_TILE_BYTES;
                let (g, h, q) = (row % 8, (row % 16) / 8, (col % 32) / 8);
                let code = mem[tile + (g * 4 + q) * 16 + h * 8 + col % 8];
                let s = mem[tile + 512 + 2 * g + h];
                let v = e4m3_decode(code) * e8m0_decode(s);
                if row < n && col < k {
                    assert_eq!(v, want[row * k + col], "[{row}, {col}]");
                } else {
                    assert_eq!((code, v), (0, 0.0), "padding at [{row}, {col}]");
                }
            }
        }
    }
}
