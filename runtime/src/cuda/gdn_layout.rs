//! The GDN recurrent state's device layout, and its conversion from and to the plan's slot layout.
//!
//! The plan (and the CPU backend) hold a value head's state row-major, `[dk, dv]` f32 (`StateKind::GdnRecurrent`,
//! `[hv, dk, dv]`). On the device each head is split into tiles of 32 columns (the last one `w = dv - 32 z` wide),
//! tile `z` at `z * dk * 32`. In a tile, with `nq = dk / 32` quarters of 32 rows (1 when `dk < 32`), element (row,
//! col) of quarter `q = row / 32`, `i = row % 32` is float `i % 4` of float4 `((i / 4) * w + col % 32) * nq + q`.
//! A block of `gdn_recur`, `gdn_recur_one` or `gdn_commit` (kernels/gdn.cu, `gdn_state_at`; a lane per quarter of a
//! column) then reads its tile as one run of memory, and a warp's float4 loads read 512 consecutive bytes each.
//! Only the host's whole-slot reads and writes ([`super::CudaBackend::set_slot_state`], `Backend::slot_state`)
//! convert; no kernel sees the row-major form. Needs `dk % 4 == 0` and `dk <= 32` or `dk % 32 == 0`
//! (`launch::gdn::check_state_dims`).

use flashplan_plan::{StateKind, StateLayout};

/// Columns per tile (one block of the state kernels).
const TILE: u64 = 32;

/// Rows of a quarter (the rows one lane holds, kernels/gdn.cu `GDN_QD`).
const QUARTER: u64 = 32;

/// Offset of state element (`row`, `col`) of one value head in the device layout (module doc), for a head of `dk`
/// rows and `dv` columns. Elements, from the head's first one.
pub fn device_offset(dk: u64, dv: u64, row: u64, col: u64) -> u64 {
    let z = col / TILE;
    let w = (dv - TILE * z).min(TILE);
    let nq = if dk >= QUARTER { dk / QUARTER } else { 1 };
    let (q, i) = (row / QUARTER, row % QUARTER);
    z * dk * TILE + (((i / 4) * w + col % TILE) * nq + q) * 4 + i % 4
}

/// Direction of [`convert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The plan's row-major layout to the device's.
    ToDevice,
    /// The device's layout to the plan's row-major one.
    ToHost,
}

/// Rewrites every `GdnRecurrent` piece of one slot's state (`slot`: `layout.slot_elems` f32, the plan's element
/// offsets) from one layout to the other; every other piece is the same in both and is left as it is.
pub fn convert(layout: &StateLayout, slot: &mut [f32], dir: Direction) {
    for p in layout
        .pieces
        .iter()
        .filter(|p| p.kind == StateKind::GdnRecurrent)
    {
        let (hv, dk, dv) = (p.shape[0], p.shape[1], p.shape[2]);
        let head = (dk * dv) as usize;
        let base = p.offset as usize;
        for h in 0..hv as usize {
            let at = base + h * head;
            let src = slot[at..at + head].to_vec();
            for row in 0..dk {
                for col in 0..dv {
                    let plain = (row * dv + col) as usize;
                    let dev = device_offset(dk, dv, row, col) as usize;
                    match dir {
                        Direction::ToDevice => slot[at + dev] = src[plain],
                        Direction::ToHost => slot[at + plain] = src[dev],
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device layout is a permutation of each head's elements, for full and partial column tiles.
    #[test]
    fn device_offsets_are_a_permutation_of_the_head() {
        for (dk, dv) in [
            (128, 128),
            (16, 16),
            (8, 40),
            (4, 33),
            (128, 96),
            (64, 48),
            (32, 70),
        ] {
            let mut seen = vec![false; (dk * dv) as usize];
            for row in 0..dk {
                for col in 0..dv {
                    let o = device_offset(dk, dv, row, col) as usize;
                    assert!(o < seen.len(), "dk {dk} dv {dv}: ({row}, {col}) -> {o}");
                    assert!(!seen[o], "dk {dk} dv {dv}: ({row}, {col}) -> {o} twice");
                    seen[o] = true;
                }
            }
        }
    }

    /// What the kernels' lanes read: four consecutive rows of a column are one float4 (16 bytes, aligned), a
    /// warp's lanes (8 columns x 4 quarters) read 128 consecutive elements with each load, and a tile of 32 columns
    /// is one run of `dk * 32` elements.
    #[test]
    fn a_lanes_four_rows_are_one_float4_a_warps_load_one_run_and_a_tile_one_run() {
        let (dk, dv) = (128, 128);
        for col in 0..dv {
            for row in (0..dk).step_by(4) {
                let o = device_offset(dk, dv, row, col);
                assert_eq!(o % 4, 0);
                for r in 1..4 {
                    assert_eq!(device_offset(dk, dv, row + r, col), o + r);
                }
                let z = col / 32;
                assert!((z * dk * 32..(z + 1) * dk * 32).contains(&o));
            }
        }
        for warp in 0..16 {
            for j in 0..8 {
                let (c0, z) = (8 * (warp % 4), warp / 4);
                let mut got: Vec<u64> = (0..32)
                    .map(|lane| {
                        device_offset(dk, dv, 32 * (lane % 4) + 4 * j, 32 * z + c0 + lane / 4)
                    })
                    .collect();
                got.sort_unstable();
                let first = got[0];
                assert!(got
                    .iter()
                    .enumerate()
                    .all(|(k, &o)| o == first + 4 * k as u64));
            }
        }
        // (row, col) = (5, 3) of a 128 x 128 head: float4 (1 * 32 + 3) * 4 + 0 of tile 0, float 1.
        assert_eq!(device_offset(128, 128, 5, 3), 561);
        // (row, col) = (37, 40): quarter 1, i 5 of column 8 of tile 1 (at 128 * 32): float4 (1 * 32 + 8) * 4 + 1.
        assert_eq!(device_offset(128, 128, 37, 40), 4096 + 161 * 4 + 1);
        // dk 16 (one quarter): float4 (i / 4) * w + col.
        assert_eq!(device_offset(16, 16, 6, 5), (16 + 5) * 4 + 2);
    }

    /// Converting a slot to the device layout and back gives it back, and moves only the GDN pieces.
    #[test]
    fn convert_round_trips_and_leaves_other_pieces() {
        let layout = crate::cuda::fuse::tests::tiny_plan().state;
        let n = layout.slot_elems as usize;
        let orig: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut slot = orig.clone();
        convert(&layout, &mut slot, Direction::ToDevice);
        assert_ne!(slot, orig, "the fixture has GDN state pieces");
        for p in &layout.pieces {
            let r = p.offset as usize..(p.offset + p.elems()) as usize;
            if p.kind != StateKind::GdnRecurrent {
                assert_eq!(slot[r.clone()], orig[r], "{}", p.name);
            }
        }
        convert(&layout, &mut slot, Direction::ToHost);
        assert_eq!(slot, orig);
    }
}
