//! The GDN recurrent state's device layout, and its conversion from and to the plan's slot layout.
//!
//! The plan (and the CPU backend) hold a value head's state row-major, `[dk, dv]` f32 (`StateKind::GdnRecurrent`,
//! `[hv, dk, dv]`). On the device each head is split into tiles of 32 columns (the last one `dv - 32 z` wide), tile
//! `z` at `z * dk * 32`, each `[dk / 4, w, 4]`: element (row, col) at `((row / 4) * w + col % 32) * 4 + row % 4`.
//! A block of `gdn_recur`, `gdn_recur_one` or `gdn_commit` (kernels/gdn.cu, `gdn_state_at`) then reads its tile as
//! one run of memory, each lane its rows as float4 loads. Only the host's whole-slot reads and writes
//! ([`super::CudaBackend::set_slot_state`], `Backend::slot_state`) convert; no kernel sees the row-major form.

use flashplan_plan::{StateKind, StateLayout};

/// Columns per tile (one block of the state kernels).
const TILE: u64 = 32;

/// Offset of state element (`row`, `col`) of one value head in the device layout (module doc), for a head of `dk`
/// rows (a multiple of 4) and `dv` columns. Elements, from the head's first one.
pub fn device_offset(dk: u64, dv: u64, row: u64, col: u64) -> u64 {
    let z = col / TILE;
    let w = (dv - TILE * z).min(TILE);
    z * dk * TILE + ((row / 4) * w + col % TILE) * 4 + row % 4
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
        for (dk, dv) in [(128, 128), (16, 16), (8, 40), (4, 33), (128, 96)] {
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

    /// What the kernels' lanes read: four consecutive rows of a column are one float4 (16 bytes, aligned), and a
    /// tile of 32 columns is one run of `dk * 32` elements.
    #[test]
    fn a_lanes_four_rows_are_one_aligned_float4_and_a_tile_one_run() {
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
        // (row, col) = (5, 3) of a 128 x 128 head: group 1 of column 3 in tile 0: (1 * 32 + 3) * 4 + 1.
        assert_eq!(device_offset(128, 128, 5, 3), 141);
        // Column 40 is column 8 of tile 1, which starts at 128 * 32.
        assert_eq!(device_offset(128, 128, 0, 40), 4096 + 32);
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
