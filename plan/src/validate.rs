//! Structural rules every plan obeys, checked when written and when loaded (`architecture.md`, "Plans"): every
//! buffer read was written earlier in the variant (or is an io input, a weight or state), no two simultaneously
//! live arena buffers overlap, every offset is in bounds and aligned, every reference exists, and the MTP step's
//! sampling keeps its probabilities.

use crate::ops::{BufId, Op, SampleRows};
use crate::plan::{IoBuf, PlanBody, Space, StateLayout, Variant, STATE_ALIGN};

/// Arena offsets are multiples of this many 4-byte elements (256 bytes).
pub const ARENA_ALIGN_ELEMS: u64 = 64;

/// A broken rule, naming the variant, node and buffer.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ValidationError {
    /// A node reads a buffer nothing wrote before it.
    #[error("variant {variant}: node {node} ({kernel}) reads buffer `{buffer}` before any node writes it")]
    ReadBeforeWrite {
        /// Variant name.
        variant: String,
        /// Node index.
        node: usize,
        /// Kernel entry point.
        kernel: String,
        /// Buffer name.
        buffer: String,
    },
    /// Two arena buffers live at the same time share memory.
    #[error(
        "variant {variant}: arena buffers `{a}` and `{b}` are live at the same time and overlap"
    )]
    Overlap {
        /// Variant name.
        variant: String,
        /// First buffer.
        a: String,
        /// Second buffer.
        b: String,
    },
    /// An offset or a length is out of bounds or misaligned.
    #[error("variant {variant}: buffer `{buffer}`: {why}")]
    Bounds {
        /// Variant name.
        variant: String,
        /// Buffer name.
        buffer: String,
        /// What is wrong.
        why: String,
    },
    /// A state piece outside its slot or not aligned.
    #[error("state piece `{piece}`: {why}")]
    State {
        /// Piece name.
        piece: String,
        /// What is wrong.
        why: String,
    },
    /// A reference to something that does not exist.
    #[error("variant {variant}: node {node}: {why}")]
    Reference {
        /// Variant name.
        variant: String,
        /// Node index.
        node: usize,
        /// What is wrong.
        why: String,
    },
}

/// Io buffers a variant may read without writing them (outputs of the variant before it).
fn is_io_input(io: IoBuf) -> bool {
    matches!(io, IoBuf::MainStreams | IoBuf::MtpStreams)
}

/// Checks the state layout and every variant of a body.
pub fn validate_body(body: &PlanBody) -> Result<(), ValidationError> {
    validate_state(&body.state)?;
    for v in &body.variants {
        validate_variant(body, v)?;
    }
    Ok(())
}

/// Checks that every state piece lies inside the slot and starts at a multiple of [`STATE_ALIGN`] elements.
pub fn validate_state(state: &StateLayout) -> Result<(), ValidationError> {
    for p in &state.pieces {
        let bad = |why: String| ValidationError::State {
            piece: p.name.clone(),
            why,
        };
        if p.offset % STATE_ALIGN != 0 {
            return Err(bad(format!(
                "element offset {} is not a multiple of {STATE_ALIGN}",
                p.offset
            )));
        }
        if p.offset + p.elems() > state.slot_elems {
            return Err(bad(format!(
                "elements {}..{} exceed the slot's {}",
                p.offset,
                p.offset + p.elems(),
                state.slot_elems
            )));
        }
    }
    if state.slot_elems % STATE_ALIGN != 0 {
        return Err(ValidationError::State {
            piece: "(slot)".into(),
            why: format!(
                "{} elements a slot is not a multiple of {STATE_ALIGN}",
                state.slot_elems
            ),
        });
    }
    Ok(())
}

/// First and last node touching each buffer (`None` when never touched).
pub fn lifetimes(v: &Variant) -> Vec<Option<(usize, usize)>> {
    let mut life: Vec<Option<(usize, usize)>> = vec![None; v.buffers.len()];
    for (i, node) in v.nodes.iter().enumerate() {
        for b in node.op.reads().into_iter().chain(node.op.writes()) {
            if let Some(slot) = life.get_mut(b.0 as usize) {
                *slot = Some(match *slot {
                    None => (i, i),
                    Some((s, _)) => (s, i),
                });
            }
        }
    }
    life
}

/// Checks one variant.
pub fn validate_variant(body: &PlanBody, v: &Variant) -> Result<(), ValidationError> {
    let name = v.kind.name();
    let nbuf = v.buffers.len();
    let mut written = vec![false; nbuf];
    for (i, node) in v.nodes.iter().enumerate() {
        let reference = |why: String| ValidationError::Reference {
            variant: name.clone(),
            node: i,
            why,
        };
        for b in node.op.reads().into_iter().chain(node.op.writes()) {
            if b.0 as usize >= nbuf {
                return Err(reference(format!(
                    "buffer id {} out of range ({nbuf} buffers)",
                    b.0
                )));
            }
        }
        for w in node.op.weights() {
            if w.0 as usize >= body.weights.len() {
                return Err(reference(format!("weight id {} out of range", w.0)));
            }
        }
        for s in node.op.states() {
            if s.0 as usize >= body.state.pieces.len() {
                return Err(reference(format!("state id {} out of range", s.0)));
            }
        }
        // The MTP step's sampled probabilities are its drafts' confidences (`rounds.md` section 2), which the engine
        // reads after every chain step.
        if let Op::Sample {
            rows: SampleRows::MtpGathered,
            probs: None,
            ..
        } = node.op
        {
            return Err(reference(
                "the MTP step's sample has no probabilities buffer (the drafts' confidence)".into(),
            ));
        }
        for d in &node.deps {
            if *d as usize >= i {
                return Err(reference(format!(
                    "dependency on node {d}, which is not earlier"
                )));
            }
        }
        for b in node.op.reads() {
            let decl = &v.buffers[b.0 as usize];
            let input = matches!(decl.space, Space::Io(io) if is_io_input(io));
            if !written[b.0 as usize] && !input {
                return Err(ValidationError::ReadBeforeWrite {
                    variant: name.clone(),
                    node: i,
                    kernel: node.op.kernel().to_string(),
                    buffer: decl.name.clone(),
                });
            }
        }
        for b in node.op.writes() {
            written[b.0 as usize] = true;
        }
    }
    // Bounds and alignment.
    for decl in &v.buffers {
        let bounds = |why: String| ValidationError::Bounds {
            variant: name.clone(),
            buffer: decl.name.clone(),
            why,
        };
        match decl.space {
            Space::Arena => {
                if decl.offset % ARENA_ALIGN_ELEMS != 0 {
                    return Err(bounds(format!(
                        "arena offset {} not aligned to {ARENA_ALIGN_ELEMS}",
                        decl.offset
                    )));
                }
                if decl.offset + decl.elems > v.arena_elems || v.arena_elems > body.arena_elems {
                    return Err(bounds(format!(
                        "[{}, {}) exceeds the arena of {} elements",
                        decl.offset,
                        decl.offset + decl.elems,
                        v.arena_elems.min(body.arena_elems)
                    )));
                }
            }
            Space::Io(io) => {
                let cap = body.io.elems(io, &body.config);
                if decl.offset + decl.elems > cap {
                    return Err(bounds(format!(
                        "{} elements exceed io buffer {io:?} of {cap}",
                        decl.offset + decl.elems
                    )));
                }
            }
        }
    }
    // No two simultaneously live arena buffers overlap: sweep by offset.
    let life = lifetimes(v);
    let mut arena: Vec<(u64, u64, usize)> = v
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, d)| d.space == Space::Arena && life[*i].is_some() && d.elems > 0)
        .map(|(i, d)| (d.offset, d.offset + d.elems, i))
        .collect();
    arena.sort_unstable();
    for (a_idx, &(a_start, a_end, a)) in arena.iter().enumerate() {
        let _ = a_start;
        for &(b_start, _, b) in &arena[a_idx + 1..] {
            if b_start >= a_end {
                break;
            }
            let (Some((s1, e1)), Some((s2, e2))) = (life[a], life[b]) else {
                continue;
            };
            if s1 <= e2 && s2 <= e1 {
                return Err(ValidationError::Overlap {
                    variant: name.clone(),
                    a: v.buffers[a].name.clone(),
                    b: v.buffers[b].name.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Convenience for tests: the buffer id of a buffer by name.
pub fn buffer_by_name(v: &Variant, name: &str) -> Option<BufId> {
    v.buffers
        .iter()
        .position(|b| b.name == name)
        .map(|i| BufId(i as u32))
}
