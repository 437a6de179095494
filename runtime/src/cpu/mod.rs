//! The CPU reference backend: interprets a variant's node list with the reference kernels in f32, over the plan's
//! arena, io buffers and per-slot state, exactly as the GPU replays it (`architecture.md`, "Backends").
//!
//! Each family of ops runs in its own module, much as the CUDA backend's launches do (`runtime/src/cuda/launch/`):
//! `rows` (embeddings, gathers, norms, and the linears, which the CUDA side keeps in a module of their own), `hc`
//! (hyper-connections), `gdn` (Gated DeltaNet), `attn` (sparse attention), `moe` (router and experts), `ple` (per-layer
//! embeddings), `sample` (sampling, keep counts); the scalar reference kernels they share are in [`kernels`].

mod attn;
mod gdn;
mod hc;
pub mod kernels;
mod moe;
mod ple;
mod rows;
mod sample;

use std::collections::BTreeMap;
use std::sync::Arc;

use flashplan_plan::{
    BufId, IoBuf, KeepSrc, Op, PlanBody, RoundDesc, Space, StateId, StateKind, Variant,
    VariantKind, WeightId,
};

use crate::backend::{Backend, BackendError};
use crate::sampler;
use kernels::*;

/// A borrowed-by-refcount f32 weight.
struct WeightRef {
    all: Arc<Vec<Option<Vec<f32>>>>,
    id: usize,
}

impl std::ops::Deref for WeightRef {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        self.all[self.id].as_deref().unwrap_or(&[])
    }
}

/// The CPU backend: plan, f32 weights, arena, io buffers and slot state.
pub struct CpuBackend {
    body: Arc<PlanBody>,
    weights: Arc<Vec<Option<Vec<f32>>>>,
    arena: Vec<f32>,
    io: BTreeMap<IoBuf, Vec<f32>>,
    slots: Vec<Vec<f32>>,
    rope: Rope,
    index: BTreeMap<VariantKind, usize>,
}

impl CpuBackend {
    /// A backend for a plan and its weights (indexed like `body.weights`; `None` for groups not loaded).
    pub fn new(body: Arc<PlanBody>, weights: Arc<Vec<Option<Vec<f32>>>>) -> CpuBackend {
        let io = [
            IoBuf::MainStreams,
            IoBuf::MtpStreams,
            IoBuf::Logits,
            IoBuf::Sampled,
            IoBuf::Probs,
            IoBuf::Keep,
        ]
        .into_iter()
        .map(|b| (b, vec![0f32; body.io.elems(b, &body.config) as usize]))
        .collect();
        let slots = (0..body.state.slots)
            .map(|_| vec![0f32; body.state.slot_elems as usize])
            .collect();
        let index = body
            .variants
            .iter()
            .enumerate()
            .map(|(i, v)| (v.kind, i))
            .collect();
        let mut b = CpuBackend {
            rope: Rope::new(&body.config),
            arena: vec![0f32; body.arena_elems as usize],
            io,
            slots,
            weights,
            index,
            body,
        };
        for s in 0..b.body.state.slots {
            b.reset_slot_state(s);
        }
        b
    }

    fn reset_slot_state(&mut self, slot: u32) {
        let eos = f32::from_bits(self.body.config.eos());
        let st = &mut self.slots[slot as usize];
        st.iter_mut().for_each(|x| *x = 0.0);
        for p in &self.body.state.pieces {
            if p.kind == StateKind::PleHistory {
                st[p.offset as usize..(p.offset + p.elems()) as usize]
                    .iter_mut()
                    .for_each(|x| *x = eos);
            }
        }
    }

    fn w(&self, id: WeightId) -> Result<WeightRef, BackendError> {
        match self.weights.get(id.0 as usize) {
            Some(Some(_)) => Ok(WeightRef {
                all: Arc::clone(&self.weights),
                id: id.0 as usize,
            }),
            _ => Err(BackendError::MissingWeight(
                self.body.weights[id.0 as usize].name.clone(),
            )),
        }
    }

    fn state_ref(&self, slot: u32, s: StateId) -> &[f32] {
        let (off, len) = self.state_range(s);
        &self.slots[slot as usize][off..off + len]
    }

    fn range(&self, v: &Variant, id: BufId) -> (Space, usize, usize) {
        let d = v.buf(id);
        (d.space, d.offset as usize, d.elems as usize)
    }

    fn read(&self, v: &Variant, id: BufId) -> Vec<f32> {
        let (space, off, len) = self.range(v, id);
        match space {
            Space::Arena => self.arena[off..off + len].to_vec(),
            Space::Io(io) => self.io[&io][off..off + len].to_vec(),
        }
    }

    fn write(&mut self, v: &Variant, id: BufId) -> &mut [f32] {
        let (space, off, len) = self.range(v, id);
        match space {
            Space::Arena => &mut self.arena[off..off + len],
            Space::Io(io) => match self.io.get_mut(&io) {
                Some(b) => &mut b[off..off + len],
                None => &mut [],
            },
        }
    }

    fn state_range(&self, s: StateId) -> (usize, usize) {
        let p = &self.body.state.pieces[s.0 as usize];
        (p.offset as usize, p.elems() as usize)
    }

    fn state(&mut self, slot: u32, s: StateId) -> &mut [f32] {
        let (off, len) = self.state_range(s);
        &mut self.slots[slot as usize][off..off + len]
    }

    fn keep_of(&self, v: &Variant, keep: KeepSrc, s: usize, desc: &RoundDesc) -> usize {
        match keep {
            KeepSrc::AllRows => desc.streams[s].rows as usize,
            KeepSrc::Counted(b) => {
                let (space, off, _) = self.range(v, b);
                let val = match space {
                    Space::Io(io) => self.io[&io][off + s],
                    Space::Arena => self.arena[off + s],
                };
                (val.to_bits() as usize).min(desc.streams[s].rows as usize)
            }
        }
    }

    /// Runs one op of a variant: the method of its family's module.
    fn exec(&mut self, v: &Variant, op: &Op, desc: &RoundDesc) -> Result<(), BackendError> {
        match op {
            Op::EmbedStreams { .. }
            | Op::Embed { .. }
            | Op::GatherRows { .. }
            | Op::LastRows { .. }
            | Op::RmsNorm { .. }
            | Op::AddBroadcast { .. }
            | Op::Linear { .. } => self.exec_rows(v, op, desc),
            Op::HcRead { .. } | Op::HcWrite { .. } => self.exec_hc(v, op, desc),
            Op::PleEmbed { .. } | Op::PleMix { .. } | Op::PleCommit { .. } => {
                self.exec_ple(v, op, desc)
            }
            Op::GdnConv { .. }
            | Op::GdnRecur { .. }
            | Op::GdnCommit { .. }
            | Op::GatedNorm { .. } => self.exec_gdn(v, op, desc),
            Op::AttnPrep { .. }
            | Op::IndexerPrep { .. }
            | Op::IndexerSelect { .. }
            | Op::SparseAttn { .. }
            | Op::IndexerCommit { .. } => self.exec_attn(v, op, desc),
            Op::Router { .. } | Op::Experts { .. } | Op::SharedExpert { .. } => {
                self.exec_moe(v, op, desc)
            }
            Op::Sample { .. } | Op::KeepCount { .. } => self.exec_sample(v, op, desc),
        }
    }
}

/// A round's rows in variant `v`: its streams, its window (rows per stream) and the real rows, those `desc` fills
/// (stream, row in the window, row of the variant), in stream order.
fn round_rows(v: &Variant, desc: &RoundDesc) -> (usize, usize, Vec<(usize, usize, usize)>) {
    let (nstreams, window) = v.kind.shape();
    let (nstreams, window) = (nstreams as usize, window as usize);
    let real = (0..nstreams)
        .flat_map(|s| (0..desc.streams[s].rows as usize).map(move |j| (s, j, s * window + j)))
        .collect();
    (nstreams, window, real)
}

/// The error of a family's method handed another family's node (the dispatch in [`CpuBackend::exec`] never does).
fn wrong_op(family: &str, op: &Op) -> BackendError {
    BackendError::Device(format!(
        "the CPU backend's {family} ops were handed a `{}` node",
        op.kernel()
    ))
}

impl Backend for CpuBackend {
    fn body(&self) -> &PlanBody {
        &self.body
    }

    fn run(&mut self, kind: VariantKind, desc: &RoundDesc) -> Result<(), BackendError> {
        let idx = *self
            .index
            .get(&kind)
            .ok_or_else(|| BackendError::NoVariant(kind.name()))?;
        let body = Arc::clone(&self.body);
        let v = &body.variants[idx];
        crate::backend::check_desc(body.as_ref(), kind, desc)?;
        for node in &v.nodes {
            self.exec(v, &node.op, desc)?;
        }
        Ok(())
    }

    fn io(&self, buf: IoBuf) -> &[f32] {
        &self.io[&buf]
    }

    fn write_io(&mut self, buf: IoBuf, offset: usize, data: &[f32]) {
        if let Some(b) = self.io.get_mut(&buf) {
            b[offset..offset + data.len()].copy_from_slice(data);
        }
    }

    fn reset_slot(&mut self, slot: u32) {
        self.reset_slot_state(slot);
    }

    fn slot_state(&self, slot: u32) -> Vec<f32> {
        self.slots[slot as usize].clone()
    }
}
