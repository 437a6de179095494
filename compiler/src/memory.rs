//! The activation arena: offsets assigned by liveness, so buffers that are never live together share memory.

use flashplan_plan::{validate::lifetimes, validate::ARENA_ALIGN_ELEMS, Space, Variant};

/// Assigns arena offsets (first fit over the buffers live at the same time, in order of first use) and records
/// the arena size with and without reuse.
pub fn assign_arena(v: &mut Variant) {
    let life = lifetimes(v);
    let align = |x: u64| x.div_ceil(ARENA_ALIGN_ELEMS) * ARENA_ALIGN_ELEMS;
    let mut order: Vec<usize> = (0..v.buffers.len())
        .filter(|&i| v.buffers[i].space == Space::Arena && life[i].is_some())
        .collect();
    order.sort_by_key(|&i| (life[i].map(|l| l.0), i));
    // Placed buffers: (offset, end, first, last).
    let mut placed: Vec<(u64, u64, usize, usize)> = Vec::new();
    let mut total = 0;
    let mut no_reuse = 0;
    for i in order {
        let (first, last) = life[i].unwrap_or((0, 0));
        let size = align(v.buffers[i].elems.max(1));
        no_reuse += size;
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&(_, _, f, l)| f <= last && first <= l)
            .map(|&(o, e, _, _)| (o, e))
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (o, e) in busy {
            if o >= offset + size {
                break;
            }
            offset = offset.max(e);
        }
        v.buffers[i].offset = offset;
        placed.push((offset, offset + size, first, last));
        total = total.max(offset + size);
    }
    v.arena_elems = total;
    v.arena_elems_no_reuse = no_reuse;
}
