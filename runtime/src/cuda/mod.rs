//! The CUDA backend (`architecture.md`, "Backends"): one GPU thread owns the context, the streams, the device
//! memory and the graphs (`CudaGraph` is not `Send`); the [`CudaBackend`] handle talks to it through channels, so
//! it is `Send` like every [`Backend`].
//!
//! - Weights: the f32 host weights are converted to BF16 at upload (each weight 256-byte aligned in one
//!   allocation; the manifest's group offsets are not used yet), except MXFP8 weights read only by `Linear` nodes,
//!   kept as MXFP8 tiles of codes and scales for `linear_mxfp8` (`weights.rs`).
//! - Activations (arena, io buffers) are f32 with the plan's layout; per-slot state is f32 for every piece
//!   (`slot_elems * 4` bytes per slot at the pieces' element offsets; BF16 caches are a later step).
//! - All memory (weights, arena, io, slots, round descriptor, scratch, side scratch and side arena, RoPE table,
//!   pinned staging) is allocated before any capture. Each variant is captured on first use on a non-default stream
//!   in thread-local capture mode and instantiated; the round descriptor is copied into its fixed device buffer
//!   before every replay.
//! - Side branch: launches that do not depend on the main chain's recent work (a MoE layer's shared expert, the PLE
//!   embedding and projections) are captured on a second stream, forked from the main stream with an event and
//!   joined with another before the first launch that reads their results (`launch::LaunchSpec::side`), so the
//!   graph runs them beside the main chain.
//! - Io buffers are read back through pinned host memory allocated with flags 0 (not write-combined), on demand.
//! - A missing GPU or driver, or a plan for another arch or other kernel sources, is an error, never a panic.
//!
//! Modules: this one holds the handle and its checks; `worker` the GPU thread (capture, replay, buffers, benchmark
//! timing); `launch` every node's kernel parameters and launch shape; `fuse` which sibling linears launch as one;
//! `weights` the upload (BF16, MXFP8); `driver` the owned driver objects (allocations, pinned memory, graphs,
//! events); `settings` the environment switches; `gdn_layout` the GDN recurrent state's device layout.

mod driver;
mod fuse;
mod gdn_layout;
mod launch;
mod settings;
mod weights;
mod worker;
#[allow(missing_docs, dead_code)]
pub mod params {
    //! Rust mirrors of `kernels/params.h` (generated at build time).
    include!(concat!(env!("OUT_DIR"), "/kernel_params.rs"));
}
mod bundled {
    include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
}

use std::cell::OnceCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use flashplan_plan::{IoBuf, Op, PlanBody, RoundDesc, StateKind, VariantKind};

use crate::backend::{Backend, BackendError};
use crate::cpu::kernels::Rope;
use driver::{dev_err, DevBuf, Event, Graph, Pinned};
use params::{FpCommon, FpStream};
pub use settings::check_env;
use settings::{fuse_linear_setting, fuse_small_setting, pdl_setting};
use worker::Worker;
pub use worker::READ_FLOOR_SPAN;

const IO_BUFS: [IoBuf; 6] = [
    IoBuf::MainStreams,
    IoBuf::MtpStreams,
    IoBuf::Logits,
    IoBuf::Sampled,
    IoBuf::Probs,
    IoBuf::Keep,
];

/// The kernel sources bundled into this binary: (file name, text), sorted by name.
pub fn kernel_sources() -> &'static [(&'static str, &'static str)] {
    bundled::KERNEL_SOURCES
}

/// SHA-256 (hex) of the bundled kernel sources, as the compiler writes it into GPU plan headers
/// (`PlanSet::check_matches(cfg, arch, Some(&kernel_source_hash()))`).
pub fn kernel_source_hash() -> String {
    flashplan_plan::format::kernel_source_hash(kernel_sources())
}

/// The hash keying one module (its source and every header), as the compiler's NVRTC pipeline computes it.
fn module_hash(name: &str, src: &str) -> String {
    flashplan_plan::format::kernel_module_hash(name, src, kernel_sources())
}

/// Whether a CUDA GPU can be used here: `Ok(name and compute capability)` or the reason it cannot.
pub fn probe_gpu() -> Result<String, String> {
    // SAFETY: only tries to load the driver library.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda) on this machine".into());
    }
    result::init().map_err(|e| format!("cuInit failed: {e}"))?;
    let n = result::device::get_count().map_err(|e| format!("no CUDA device: {e}"))?;
    if n < 1 {
        return Err("no CUDA device".into());
    }
    let ctx = CudaContext::new(0).map_err(|e| format!("CUDA context: {e}"))?;
    let (maj, min) = ctx
        .compute_capability()
        .map_err(|e| format!("compute capability: {e}"))?;
    Ok(format!(
        "{} (sm_{maj}{min})",
        ctx.name().unwrap_or_else(|_| "GPU".into())
    ))
}

/// Checks that a plan can run on this machine's GPU: a CUDA arch, kernel modules built from this runtime's kernel
/// sources, and a usable GPU. Returns the arch as (major, minor).
fn check_plan(body: &PlanBody) -> Result<(i32, i32), BackendError> {
    let arch = body.options.arch.clone();
    let want = parse_arch(&arch).ok_or_else(|| {
        BackendError::Device(format!(
            "the plan is for arch `{arch}`, not a CUDA arch: compile the plans with --arch sm_90a"
        ))
    })?;
    if body.kernels.is_empty() {
        return Err(BackendError::Device(
            "the plan carries no kernel modules: recompile it for a CUDA arch".into(),
        ));
    }
    for m in &body.kernels {
        let file = format!("{}.cu", m.name);
        let src = kernel_sources()
            .iter()
            .find(|(n, _)| *n == file)
            .map(|(_, s)| *s);
        match src {
            Some(s) if module_hash(&file, s) == m.source_hash => {}
            _ => {
                return Err(BackendError::Device(format!(
                "plan mismatch: kernel module `{}` was built from other kernel sources than this \
                     runtime's; recompile the plans",
                m.name
            )))
            }
        }
    }
    probe_gpu().map_err(BackendError::Device)?;
    Ok(want)
}

/// Capture statistics of one variant.
#[derive(Debug, Clone)]
pub struct CaptureInfo {
    /// Variant name.
    pub variant: String,
    /// Kernel nodes.
    pub nodes: usize,
    /// Capture and instantiation time, milliseconds.
    pub ms: f64,
}

/// Timing of repeated replays ([`CudaBackend::bench`]).
#[derive(Debug, Clone)]
pub struct BenchResult {
    /// Median replay time (CUDA events), microseconds.
    pub median_us: f64,
    /// Per-kernel time summed over the nodes of one replay, microseconds, by kernel name (`LaunchSpec::name`: the
    /// first launch's, `linear_tN+split` for a linear of several rows, `experts_wide+order` for the routed experts
    /// from 5 rows); a node's time is measured inside a graph of 20 back-to-back copies of it (so it includes the
    /// in-graph launch gap).
    pub kernels_us: Vec<(String, f64)>,
    /// Each node's in-graph time (best of three graph replays, per copy), microseconds, in node order. A run of
    /// sibling linears launched as one `linear_multi` (`FLASHPLAN_FUSE_LINEAR`) has the fused launch's time at its
    /// first node and 0 at the others; an embed or gather run inside the norm after it (`FLASHPLAN_FUSE_SMALL`) has
    /// 0, the norm the fused launch's time. A node whose launches fork a side branch (`launch::LaunchSpec::side`) is
    /// timed with the side launches in line (in `kernels_us` they count under their own kernel), and the nodes whose
    /// work moved onto the branch have 0: the sum of the nodes then exceeds what the graph, which overlaps the
    /// branch with the main chain, takes.
    pub nodes_us: Vec<f64>,
}

enum Cmd {
    Run(
        usize,
        Vec<u8>,
        Sender<Result<Option<CaptureInfo>, BackendError>>,
    ),
    Fetch(IoBuf, Sender<Result<Vec<f32>, BackendError>>),
    Write(IoBuf, usize, Vec<f32>, Sender<Result<(), BackendError>>),
    SetSlot(u32, Vec<f32>, Sender<Result<(), BackendError>>),
    GetSlot(u32, Sender<Result<Vec<f32>, BackendError>>),
    ReadBuf(
        usize,
        flashplan_plan::BufId,
        Sender<Result<Vec<f32>, BackendError>>,
    ),
    Bench(
        usize,
        Vec<u8>,
        u32,
        Sender<Result<BenchResult, BackendError>>,
    ),
    Replays(usize, Vec<u8>, u32, Sender<Result<f64, BackendError>>),
    Prefixes(usize, Vec<u8>, u32, Sender<Result<Vec<f64>, BackendError>>),
    ReadFloor(Vec<u64>, Sender<Result<Vec<f64>, BackendError>>),
    GridSms(u32, Sender<Result<(), BackendError>>),
    /// Sets a launch switch; replies with the setting it replaced.
    Switch(Switch, bool, Sender<Result<bool, BackendError>>),
}

/// The launch switches a test or benchmark may flip after start (the worker then recaptures every graph).
#[derive(Debug, Clone, Copy)]
enum Switch {
    /// `FLASHPLAN_PDL`.
    Pdl,
    /// `FLASHPLAN_FUSE_LINEAR`.
    FuseLinear,
    /// `FLASHPLAN_FUSE_SMALL`.
    FuseSmall,
}

/// The CUDA backend handle.
pub struct CudaBackend {
    body: Arc<PlanBody>,
    tx: Option<Sender<Cmd>>,
    worker: Option<std::thread::JoinHandle<()>>,
    index: BTreeMap<VariantKind, usize>,
    cache: BTreeMap<IoBuf, OnceCell<Vec<f32>>>,
    captures: Vec<CaptureInfo>,
    mxfp8_weights: usize,
}

impl CudaBackend {
    /// Starts the GPU thread: checks the device against the plan's arch and the plan's kernels against the bundled
    /// sources, loads the cubins, uploads the weights (BF16, or MXFP8 for MXFP8 weights only `Linear` nodes read;
    /// `None` entries are not loaded) and allocates everything. Graphs are captured on first use.
    ///
    /// # Errors
    /// [`BackendError::Device`] for a missing GPU, a plan for another arch or other kernel sources, or a CUDA error.
    pub fn new(
        body: Arc<PlanBody>,
        weights: &[Option<Vec<f32>>],
    ) -> Result<CudaBackend, BackendError> {
        let want = check_plan(&body)?;
        let uses = body.weight_uses();
        weights::check_linear_weights(&body, &uses)?;
        // Device forms (BF16, or MXFP8 tiles: weights.rs) converted here (the GPU thread only copies).
        let dev = weights::device_forms(&body, &uses, weights)?;
        Self::start(body, dev, want)
    }

    /// As [`CudaBackend::new`] with the weights given directly as BF16 bit patterns, row-major (`None` entries are
    /// not loaded; linear weights and hyper-connection `up` weights are tiled here: `weights::bf16_layout`): for
    /// synthetic full-width models (the benchmark), where f32 host copies would not fit.
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn new_bf16(
        body: Arc<PlanBody>,
        weights: Vec<Option<Vec<u16>>>,
    ) -> Result<CudaBackend, BackendError> {
        let want = check_plan(&body)?;
        let uses = body.weight_uses();
        weights::check_linear_weights(&body, &uses)?;
        let dev = weights
            .into_iter()
            .zip(uses)
            .map(|(w, u)| w.map(|w| weights::bf16_layout(w, u)).transpose())
            .collect::<Result<_, _>>()?;
        Self::start(body, dev, want)
    }

    fn start(
        body: Arc<PlanBody>,
        bf: Vec<Option<weights::DevWeight>>,
        want: (i32, i32),
    ) -> Result<CudaBackend, BackendError> {
        let (tx, rx) = channel::<Cmd>();
        let (ready_tx, ready_rx) = channel::<Result<(), BackendError>>();
        let mxfp8_weights = bf
            .iter()
            .flatten()
            .filter(|w| matches!(w, weights::DevWeight::Mxfp8(_)))
            .count();
        let b2 = Arc::clone(&body);
        let worker = std::thread::Builder::new()
            .name("flashplan-gpu".into())
            .spawn(move || match Worker::new(b2, bf, want) {
                Ok(mut w) => {
                    let _ = ready_tx.send(Ok(()));
                    w.serve(rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| BackendError::Device(format!("GPU thread: {e}")))?;
        ready_rx
            .recv()
            .map_err(|_| BackendError::Device("the GPU thread died during start-up".into()))??;
        let index = body
            .variants
            .iter()
            .enumerate()
            .map(|(i, v)| (v.kind, i))
            .collect();
        let cache = IO_BUFS.iter().map(|b| (*b, OnceCell::new())).collect();
        let mut be = CudaBackend {
            body,
            tx: Some(tx),
            worker: Some(worker),
            index,
            cache,
            captures: Vec::new(),
            mxfp8_weights,
        };
        for s in 0..be.body.state.slots {
            be.try_reset_slot(s)?;
        }
        Ok(be)
    }

    fn call<T>(
        &self,
        make: impl FnOnce(Sender<Result<T, BackendError>>) -> Cmd,
    ) -> Result<T, BackendError> {
        let (tx, rx) = channel();
        self.tx
            .as_ref()
            .ok_or_else(|| BackendError::Device("the GPU thread is gone".into()))?
            .send(make(tx))
            .map_err(|_| BackendError::Device("the GPU thread is gone".into()))?;
        rx.recv()
            .map_err(|_| BackendError::Device("the GPU thread is gone".into()))?
    }

    /// Before a replay of variant `kind`: checks the descriptor against the plan, encodes its device image
    /// ([`Self::desc_bytes`]) and drops the cached io reads, which the replay makes stale. Returns the variant's
    /// index and the image.
    fn prepare_replay(
        &mut self,
        kind: VariantKind,
        desc: &RoundDesc,
    ) -> Result<(usize, Vec<u8>), BackendError> {
        let idx = *self
            .index
            .get(&kind)
            .ok_or_else(|| BackendError::NoVariant(kind.name()))?;
        crate::backend::check_desc(self.body.as_ref(), kind, desc)?;
        let bytes = self.desc_bytes(desc);
        self.invalidate();
        Ok((idx, bytes))
    }

    /// The descriptor's device image: `FpStream[max_streams]` then `u32 tokens[max_rows]`.
    fn desc_bytes(&self, desc: &RoundDesc) -> Vec<u8> {
        let ms = self.body.io.max_streams as usize;
        let mr = self.body.io.max_rows as usize;
        let mut out = vec![0u8; ms * std::mem::size_of::<FpStream>() + mr * 4];
        for (i, s) in desc.streams.iter().enumerate() {
            let f = FpStream {
                seed: s.sampling.seed,
                slot: s.slot,
                pos: s.pos,
                rows: s.rows,
                committed: s.committed,
                src_row: s.src_row,
                temperature: s.sampling.temperature,
                top_k: s.sampling.top_k,
                top_p: s.sampling.top_p,
                min_p: s.sampling.min_p,
                pad: 0,
            };
            let at = i * std::mem::size_of::<FpStream>();
            // SAFETY: FpStream is a plain #[repr(C)] struct without padding.
            let b = unsafe {
                std::slice::from_raw_parts(
                    &f as *const FpStream as *const u8,
                    std::mem::size_of::<FpStream>(),
                )
            };
            out[at..at + b.len()].copy_from_slice(b);
        }
        let base = ms * std::mem::size_of::<FpStream>();
        for (i, t) in desc.tokens.iter().enumerate() {
            out[base + i * 4..base + i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        out
    }

    /// Graph captures so far (variant, nodes, capture + instantiate time).
    pub fn captures(&self) -> &[CaptureInfo] {
        &self.captures
    }

    /// How many weights device memory holds as MXFP8 tiles of codes and scales (their `Linear` nodes run
    /// `linear_mxfp8`).
    pub fn mxfp8_weights(&self) -> usize {
        self.mxfp8_weights
    }

    /// Replays a variant `iters` times after warm-up and times it; also times each node inside a graph of 20
    /// back-to-back copies of it. Benchmark only: the replays and the node copies repeat their side effects
    /// (commits, accumulations), so the slot state and buffers are left as garbage afterwards.
    ///
    /// # Errors
    /// As [`Backend::run`].
    pub fn bench(
        &mut self,
        kind: VariantKind,
        desc: &RoundDesc,
        iters: u32,
    ) -> Result<BenchResult, BackendError> {
        let (idx, bytes) = self.prepare_replay(kind, desc)?;
        self.call(|tx| Cmd::Bench(idx, bytes, iters, tx))
    }

    /// The median time of `iters` replays of a variant after warm-up (CUDA events), microseconds; no per-node
    /// timing (see [`Self::bench`]), so two variants can be timed in alternation. Benchmark only: the replays repeat
    /// their side effects.
    ///
    /// # Errors
    /// As [`Backend::run`].
    pub fn replay_median(
        &mut self,
        kind: VariantKind,
        desc: &RoundDesc,
        iters: u32,
    ) -> Result<f64, BackendError> {
        let (idx, bytes) = self.prepare_replay(kind, desc)?;
        self.call(|tx| Cmd::Replays(idx, bytes, iters, tx))
    }

    /// Each node's cost in the variant's own graph: for every node k, the median time of `iters` replays (after
    /// warm-up, CUDA events) of a graph holding the variant's launches up to and including node k's, as the
    /// variant's graph captures them (side branches forked and joined where it does; one still open at the prefix's
    /// end is joined there), microseconds, in node order. Node k's in-context cost is its entry minus the one before
    /// (the first node's includes the graph launch): what it adds to the replay, its overlap with the launches around
    /// it and the gaps between them included, where [`Self::bench`]'s node times take each node alone. A node
    /// without a launch of its own (fused into another's) repeats the entry before it. The last entry is a full
    /// replay. A branch still running where a prefix ends (the side branch, or the L2 prefetch branch of 8 to 16
    /// rows) is waited for there, so the node before such an end takes on the branch's remaining time and the nodes
    /// after it may cost less (their weights already in L2): only sums over a span that ends where the variant's
    /// graph joins its branches are free of that (at one row a layer, whose side branches join inside it; with the
    /// prefetch branch, which joins at the graph's end, only the whole replay). Benchmark only: the replays repeat
    /// their side effects.
    ///
    /// # Errors
    /// As [`Backend::run`].
    pub fn prefix_times(
        &mut self,
        kind: VariantKind,
        desc: &RoundDesc,
        iters: u32,
    ) -> Result<Vec<f64>, BackendError> {
        let (idx, bytes) = self.prepare_replay(kind, desc)?;
        self.call(|tx| Cmd::Prefixes(idx, bytes, iters, tx))
    }

    /// What a plain read of each of `sizes` bytes costs as one graph node, microseconds: the yardstick for a node
    /// that streams as many weight bytes (`kernels/rows.cu` `read_floor`: 16-byte streaming loads, 4 in flight per
    /// thread, a full grid). Each size is timed in a graph of back-to-back reads of distinct regions of the weights
    /// (at least [`READ_FLOOR_SPAN`] bytes in all, so that no read finds its bytes in L2; the regions wrap around
    /// the weights, so this holds while the weights are several times the L2, as at the real widths), best of three
    /// replays, per read; a size of 0 gives the cost of an empty launch. Sizes are rounded down to 256 bytes.
    /// Benchmark only.
    ///
    /// # Errors
    /// A size larger than the weights' allocation, no weights, or a device error.
    pub fn read_floor(&self, sizes: &[u64]) -> Result<Vec<f64>, BackendError> {
        self.call(|tx| Cmd::ReadFloor(sizes.to_vec(), tx))
    }

    /// Sizes the one-wave grids (`launch::linear::one_wave`) as for a GPU of `sms` SMs, or of this GPU's own count with
    /// 0, and drops the captured graphs so that the next runs capture with it. For tests: with a small count every
    /// block loops over many m-tiles and experts' items, which must give the same bits as this GPU's own grids. The
    /// grid-barrier kernels' grids are checked against what this GPU holds at once, whatever the count.
    ///
    /// # Errors
    /// A device error.
    pub fn set_grid_sms(&mut self, sms: u32) -> Result<(), BackendError> {
        self.call(|tx| Cmd::GridSms(sms, tx))
    }

    /// Launches every kernel as a programmatic dependent launch (`on`) or as a plain one, as `FLASHPLAN_PDL` does at
    /// start, and drops the captured graphs so that the next runs capture with it. For benchmarks: one process times
    /// each variant both ways in alternation (`gpu_bench --pdl-ab`); the results are the same bits either way
    /// (`tests/gpu.rs` checks it). Returns the setting it replaces.
    ///
    /// # Errors
    /// A device error.
    pub fn set_pdl(&mut self, on: bool) -> Result<bool, BackendError> {
        self.call(|tx| Cmd::Switch(Switch::Pdl, on, tx))
    }

    /// Launches runs of sibling linears as one `linear_multi` (`on`) or each on its own, as `FLASHPLAN_FUSE_LINEAR`
    /// does at start, and drops the captured graphs so that the next runs capture with it. For tests: the fused
    /// launch must give the same bits as the unfused ones (`tests/gpu.rs`). Returns the setting it replaces.
    ///
    /// # Errors
    /// A device error.
    pub fn set_fuse_linear(&mut self, on: bool) -> Result<bool, BackendError> {
        self.call(|tx| Cmd::Switch(Switch::FuseLinear, on, tx))
    }

    /// Turns `FLASHPLAN_FUSE_SMALL`'s launch fusions on or off, as that variable does at start, and drops the
    /// captured graphs so that the next runs capture with it. For tests: the fused launches must give the same bits
    /// as the unfused ones (`tests/gpu.rs`). Returns the setting it replaces.
    ///
    /// # Errors
    /// A device error.
    pub fn set_fuse_small(&mut self, on: bool) -> Result<bool, BackendError> {
        self.call(|tx| Cmd::Switch(Switch::FuseSmall, on, tx))
    }

    /// Reads one of a variant's buffers (arena or io) as the last replay left it (f32 elements; u32 buffers such
    /// as routed expert ids come back as their bit patterns).
    ///
    /// # Errors
    /// [`BackendError::NoVariant`] or a device error.
    pub fn read_buffer(
        &self,
        kind: VariantKind,
        buf: flashplan_plan::BufId,
    ) -> Result<Vec<f32>, BackendError> {
        let idx = *self
            .index
            .get(&kind)
            .ok_or_else(|| BackendError::NoVariant(kind.name()))?;
        self.call(|tx| Cmd::ReadBuf(idx, buf, tx))
    }

    fn invalidate(&mut self) {
        for c in self.cache.values_mut() {
            c.take();
        }
    }

    /// Overwrites a slot's whole state (tests restore a snapshot taken with [`Backend::slot_state`]), given in the
    /// plan's layout (`layout.slot_elems` f32; the GDN recurrent state is converted to its device layout,
    /// `gdn_layout`).
    ///
    /// # Errors
    /// [`BackendError`] for a bad slot or size, or a device error.
    pub fn set_slot_state(&mut self, slot: u32, data: &[f32]) -> Result<(), BackendError> {
        if data.len() != self.body.state.slot_elems as usize {
            return Err(BackendError::BadDescriptor(format!(
                "slot state of {} elements, {} expected",
                data.len(),
                self.body.state.slot_elems
            )));
        }
        let mut st = data.to_vec();
        gdn_layout::convert(&self.body.state, &mut st, gdn_layout::Direction::ToDevice);
        self.call(|tx| Cmd::SetSlot(slot, st, tx))
    }

    fn try_reset_slot(&mut self, slot: u32) -> Result<(), BackendError> {
        let eos = f32::from_bits(self.body.config.eos());
        // Zeros but the PLE history: the same in the plan's layout and the device's (gdn_layout).
        let mut st = vec![0f32; self.body.state.slot_elems as usize];
        for p in &self.body.state.pieces {
            if p.kind == StateKind::PleHistory {
                st[p.offset as usize..(p.offset + p.elems()) as usize]
                    .iter_mut()
                    .for_each(|x| *x = eos);
            }
        }
        self.call(|tx| Cmd::SetSlot(slot, st, tx))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Backend for CudaBackend {
    fn body(&self) -> &PlanBody {
        &self.body
    }

    fn run(&mut self, kind: VariantKind, desc: &RoundDesc) -> Result<(), BackendError> {
        let (idx, bytes) = self.prepare_replay(kind, desc)?;
        if let Some(info) = self.call(|tx| Cmd::Run(idx, bytes, tx))? {
            tracing::info!(
                "captured {} ({} nodes) in {:.1} ms",
                info.variant,
                info.nodes,
                info.ms
            );
            self.captures.push(info);
        }
        Ok(())
    }

    fn io(&self, buf: IoBuf) -> &[f32] {
        match self.cache.get(&buf) {
            Some(c) => c.get_or_init(|| match self.call(|tx| Cmd::Fetch(buf, tx)) {
                Ok(v) => v,
                Err(e) => {
                    tracing::error!("reading io buffer {buf:?}: {e}");
                    vec![f32::NAN; self.body.io.elems(buf, &self.body.config) as usize]
                }
            }),
            None => &[],
        }
    }

    fn write_io(&mut self, buf: IoBuf, offset: usize, data: &[f32]) {
        self.invalidate();
        if let Err(e) = self.call(|tx| Cmd::Write(buf, offset, data.to_vec(), tx)) {
            tracing::error!("writing io buffer {buf:?}: {e}");
        }
    }

    fn reset_slot(&mut self, slot: u32) {
        if let Err(e) = self.try_reset_slot(slot) {
            tracing::error!("resetting slot {slot}: {e}");
        }
    }

    fn slot_state(&self, slot: u32) -> Vec<f32> {
        let mut st = self.call(|tx| Cmd::GetSlot(slot, tx)).unwrap_or_default();
        if st.len() == self.body.state.slot_elems as usize {
            gdn_layout::convert(&self.body.state, &mut st, gdn_layout::Direction::ToHost);
        }
        st
    }
}

/// `sm_90a` -> (9, 0).
fn parse_arch(arch: &str) -> Option<(i32, i32)> {
    let d: String = arch
        .strip_prefix("sm_")?
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    if d.len() < 2 {
        return None;
    }
    let (maj, min) = d.split_at(d.len() - 1);
    Some((maj.parse().ok()?, min.parse().ok()?))
}

/// The op of a node, re-exported for tools that list nodes per kernel.
pub fn kernel_of(op: &Op) -> &'static str {
    op.kernel()
}
