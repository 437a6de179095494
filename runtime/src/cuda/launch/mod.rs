//! Kernel parameters and launch shapes of every op, from a variant's node and the device addresses of the
//! backend's allocations. The parameter structs are the generated mirrors of `kernels/params.h`.
//!
//! One module per family of ops, each beside its kernels: [`rows`] (embeddings, gathers, norms), [`linear`] (BF16
//! and MXFP8 linears, one-wave grids), [`hc`] (hyper-connections), [`gdn`] (Gated DeltaNet), [`attn`] (sparse
//! attention), [`moe`] (router and experts), [`ple`] (per-layer embeddings), [`sample`] (sampling, keep counts).
//! This module holds what they share, the per-variant passes ([`specs`]: fused linears, the hyper-connection
//! norm's move into the write, the side branches) and the dispatch of a node to its family ([`node_spec`]).

mod attn;
mod gdn;
mod hc;
mod linear;
mod moe;
mod ple;
mod prefetch;
pub(crate) use prefetch::prefetch_budget;
mod rows;
mod sample;
#[cfg(test)]
mod tests;

use flashplan_plan::{BufId, KeepSrc, Op, PlanBody, Space, StateId, Variant, WeightId};

use super::fuse;
use crate::backend::BackendError;
use crate::cpu::kernels::Rope;
use crate::cuda::params::*;
use attn::SA_CHUNK;
use gdn::commit_in_window_one;
use hc::{fuse_hc_norm, hc_read_spec, hc_write_spec};
pub(crate) use linear::tc_split;
use linear::{linear_multi, split_items, SPLIT_ITEM_ELEMS};
use moe::{branch_shared_experts, experts_spec, router_spec, shared_expert_spec};
use ple::branch_ple_prep;
pub(crate) use ple::{side_arena_buffers, side_arena_elems};
pub(crate) use rows::read_floor_spec;
use sample::SAMPLE_PARTS;

/// The kernels with a grid barrier (common.cuh `grid_barrier`), whose whole grid must be on the GPU at once.
pub(crate) const BARRIER_KERNELS: &[&str] = hc::HC_READ_ONE;
/// Threads a block of every [`BARRIER_KERNELS`] kernel, and of `experts_one`.
pub(crate) const BARRIER_BLOCK: u32 = 256;
/// u32 counters of each node ([`Addrs::counters`]): `experts_one` takes one per rank of its row (top-k at most
/// `MOE_MAX_TOPK` = 32); the other kernels one.
pub(crate) const NODE_COUNTERS: u32 = 32;

/// The first of node `node`'s [`NODE_COUNTERS`] counters.
pub(crate) fn node_counters(a: &Addrs, node: usize) -> u64 {
    a.counters + 4 * NODE_COUNTERS as u64 * node as u64
}

/// Device addresses a node's parameters are bound to.
#[derive(Clone, Copy)]
pub(crate) struct Addrs<'a> {
    pub body: &'a PlanBody,
    pub arena: u64,
    pub io: &'a dyn Fn(flashplan_plan::IoBuf) -> u64,
    pub weights: &'a [u64],
    /// Per weight: whether it is held as MXFP8 tiles (weights.rs `tile_mxfp8`, at `weights`) rather than BF16.
    pub mxfp8: &'a [bool],
    pub common: FpCommon,
    pub rope: u64,
    pub rope_cfg: &'a Rope,
    /// This variant's node counters: [`NODE_COUNTERS`] u32 per node of the variant (node i's from
    /// [`node_counters`]), zeroed at allocation; a kernel that uses its node's counters leaves them ready for the next
    /// launch (graph replays): the router's count back at 0; the barriers of `hc_read_one_t*` and `experts_one` with
    /// their low 31 bits at 0 (bit 31 flips at every launch, common.cuh `group_barrier`).
    pub counters: u64,
    /// Fewer launches for the small ops (`FLASHPLAN_FUSE_SMALL`): the router in one launch up to
    /// `ROUTER_TILES_TOPK_ROWS` rows (its last blocks do the top-k), `hc_norm` in the write before it, the rest of a
    /// hyper-connection read in one launch up to 4 rows (`hc_read_one_t*`), one row's experts in one launch, an embed
    /// or gather inside the norm after it (`rows::fuse_row_norms`), an attention layer's two preps in one launch
    /// (`attn::fuse_preps`). Same bits either way.
    pub fuse_small: bool,
    /// Streaming multiprocessors of the GPU (132 on the H200), for the one-wave grids ([`linear::one_wave`]).
    pub sms: u32,
    /// Blocks of a grid-barrier kernel ([`BARRIER_KERNELS`]) the GPU holds at once (its occupancy times the GPU's own
    /// SMs, whatever `sms` a test set): a grid-barrier launch runs only with a grid up to this, else the launches it
    /// replaces run (0: never).
    pub barrier_blocks: u32,
    /// Blocks of `experts_one` the GPU holds at once (its occupancy times the SMs, as `barrier_blocks`): it runs only
    /// with a grid up to this, else `experts` and `experts_down` run (0: never).
    pub experts_one_blocks: u32,
    /// The side branch's scratch ([`side_scratch_elems`] elements), or 0 to run every launch on the main stream.
    pub side_scratch: u64,
    /// The side arena ([`side_arena_elems`] elements) for the buffers of the PLE branch ([`branch_ple_prep`]), or 0.
    pub side_arena: u64,
    /// Bytes of weights an `l2_prefetch` side launch brings into L2 ahead of the launches that read them
    /// ([`prefetch::branch_prefetch`]); 0: none.
    pub prefetch_budget: u64,
    /// Buffers whose address is not the plan's: (buffer, device address); empty but inside [`branch_ple_prep`].
    pub moved: &'a [(BufId, u64)],
}

/// One node's launch: kernel name, parameter bytes, grid, block; `then`: more kernels launched right after, in
/// order, with the same parameters (ops done in phases: hc_read, experts, shared_expert, indexer_select, sparse_attn,
/// sample; the router with `FLASHPLAN_FUSE_SMALL=0`), each with its own grid and (1-D) block.
///
/// `side`: specs launched in order on the worker's side stream, forked from the main stream just before this spec's
/// first launch (they depend on every earlier launch, and nothing on the main stream waits for them until a
/// `join_before`; the side stream runs its branches in capture order).
/// `join_before`: the main stream waits for everything captured on the side stream so far before this spec's launch
/// number `join_before` (0: the kernel, `k`: `then[k - 1]`). A variant's graph is captured with the branches
/// ([`branch_shared_experts`], [`branch_ple_prep`]); the per-node benchmark graphs run the side launches in line,
/// before the spec's own. One side stream and one side scratch serve every branch: the side stream runs its
/// launches in capture order, so a later branch (layer 0's shared expert) queues behind an earlier one (the PLE
/// prep), and a join waits for both.
pub(crate) struct LaunchSpec {
    pub kernel: &'static str,
    pub params: Vec<u8>,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub then: Vec<(&'static str, (u32, u32, u32), u32)>,
    pub side: Vec<LaunchSpec>,
    pub join_before: Option<usize>,
    /// `l2_prefetch` launches ([`prefetch::branch_prefetch`]) on the worker's prefetch stream, forked from the main
    /// stream just before this spec's first launch and joined only at the end of the graph: they bring the weights
    /// of the launches that follow into L2 while those before them wait on latency. The main stream waits for them
    /// only at the end (each run follows the previous one on the prefetch stream). Graphs without branches (the
    /// per-node timing of `CudaBackend::bench`) leave them out.
    pub prefetch: Vec<LaunchSpec>,
}

impl LaunchSpec {
    /// A launch of `kernel` over `grid` blocks of `block` threads (1-D blocks), with no follow-ups yet.
    fn new(kernel: &'static str, params: Vec<u8>, grid: (u32, u32, u32), block: u32) -> LaunchSpec {
        LaunchSpec {
            kernel,
            params,
            grid,
            block: (block, 1, 1),
            then: Vec::new(),
            side: Vec::new(),
            join_before: None,
            prefetch: Vec::new(),
        }
    }
    fn then(self, kernel: &'static str, grid: u32, block: u32) -> LaunchSpec {
        self.then_grid(kernel, (grid, 1, 1), block)
    }
    fn then_grid(mut self, kernel: &'static str, grid: (u32, u32, u32), block: u32) -> LaunchSpec {
        self.then
            .push((kernel, (grid.0.max(1), grid.1.max(1), grid.2.max(1)), block));
        self
    }
    /// The node's kernel for reports: the first launch's, or `<entry>+split` / `<entry>+order` when the first
    /// launch only prepares the one that follows: splits the rows for a linear ([`linear::with_split`]) or sorts the
    /// routed slots by expert for `experts_wide` (`experts_order`).
    pub fn name(&self) -> String {
        match self.then.first() {
            Some((k, ..)) if self.kernel.ends_with("_split") => format!("{k}+split"),
            Some((k, ..)) if self.kernel == "experts_order" => format!("{k}+order"),
            _ => self.kernel.to_string(),
        }
    }
    /// Kernel launches of this node (1 + follow-ups).
    pub fn launches(&self) -> usize {
        1 + self.then.len()
    }
}

fn bytes<T: Copy>(p: &T) -> Vec<u8> {
    // SAFETY: the mirrors are plain-old-data `#[repr(C)]` structs without padding holes that matter.
    unsafe {
        std::slice::from_raw_parts(p as *const T as *const u8, std::mem::size_of::<T>()).to_vec()
    }
}

impl Addrs<'_> {
    fn buf(&self, v: &Variant, id: BufId) -> u64 {
        if let Some(&(_, p)) = self.moved.iter().find(|(b, _)| *b == id) {
            return p;
        }
        let d = v.buf(id);
        let base = match d.space {
            Space::Arena => self.arena,
            Space::Io(io) => (self.io)(io),
        };
        base + d.offset * 4
    }
    /// Whether weight `id` is held as MXFP8 tiles (its address at [`Addrs::w`]).
    fn is_mxfp8(&self, id: WeightId) -> bool {
        self.mxfp8.get(id.0 as usize).copied().unwrap_or(false)
    }
    fn w(&self, id: WeightId) -> Result<u64, BackendError> {
        match self.weights.get(id.0 as usize) {
            Some(&p) if p != 0 => Ok(p),
            _ => Err(BackendError::MissingWeight(
                self.body.weights[id.0 as usize].name.clone(),
            )),
        }
    }
    fn st(&self, id: StateId) -> u64 {
        self.body.state.pieces[id.0 as usize].offset
    }
    fn st_elems(&self, id: StateId) -> u64 {
        self.body.state.pieces[id.0 as usize].elems()
    }
    fn keep(&self, v: &Variant, k: &KeepSrc) -> u64 {
        match k {
            KeepSrc::AllRows => 0,
            KeepSrc::Counted(b) => self.buf(v, *b),
        }
    }
}

/// Entry points of a kernel per row tile T = 1, 2, 4, 8, 16 in order (`name_tT` in `kernels/`, each compiled with the
/// registers its tile needs; a prefix: kernels whose launches never take the larger tiles do not compile them).
type ByRows = &'static [&'static str];

/// Most rows per block for the kernels that also spread row tiles over blocks (`blockIdx.y`: hc_read,
/// shared_expert, shared_expert_down, and the router's logits in tiles: `router_s4`, or when not one launch): beyond it
/// they take tiles of this many rows (their entry points stop at t4), one grid row of blocks per tile, instead of
/// one block walking every tile (each lane's activation loads for all the rows of a tile wait in turn; the
/// weights, at most 13 MB, are read again per tile mostly from L2). The tile never changes a row's arithmetic.
const ROW_TILE_MAX: u32 = 4;

/// Capacity of a block's staged row tile, floats (kernels/common.cuh `STAGE_TILE_MAX`, 40 KB of static shared
/// memory): 4 rows of 2560, the real width.
const STAGE_TILE_MAX: u32 = 10240;

/// Whether a tile of 4 rows of `width` floats at device address `at` (its first row; the tiles start at rows 4k) can
/// be staged in shared memory (kernels/common.cuh `stage_tile`): at most [`STAGE_TILE_MAX`] floats, and every row
/// start and the source 16-byte aligned for its 16-byte copies, the last tile's too (`width % 4 == 0`).
fn stage_fits(width: u32, at: u64) -> bool {
    4 * width <= STAGE_TILE_MAX && width.is_multiple_of(4) && at.is_multiple_of(16)
}

/// Entry point and grid rows for a kernel over `rows` rows in tiles of at most [`ROW_TILE_MAX`] rows.
fn by_row_tiles(names: ByRows, rows: u32) -> (&'static str, u32) {
    let (name, tile) = by_rows_tile(names, rows.min(ROW_TILE_MAX));
    (name, rows.div_ceil(tile).max(1))
}

/// The entry point for a launch over `rows` rows: the smallest tile of 1, 2, 4, 8, 16 covering them, or the
/// largest the kernel has (the kernel loops over tiles). Row invariance does not depend on the choice: a row's
/// arithmetic is the same in every tile.
fn by_rows(names: ByRows, rows: u32) -> &'static str {
    by_rows_tile(names, rows).0
}

/// [`by_rows`]'s entry point and its row tile (1, 2, 4, 8 or 16).
fn by_rows_tile(names: ByRows, rows: u32) -> (&'static str, u32) {
    let i = match rows {
        0..=1 => 0,
        2 => 1,
        3..=4 => 2,
        5..=8 => 3,
        _ => 4,
    }
    .min(names.len() - 1);
    (names[i], 1 << i)
}

/// The error of a parameter builder handed another op's node: the parameters of `what` (a kernel, or a module's
/// family of ops) asked of `op`.
fn wrong_op(what: &str, op: &Op) -> BackendError {
    BackendError::Device(format!("{what} parameters for a `{}` node", op.kernel()))
}

/// A launch of `kernel` over `grid` blocks (at least one) of `block` threads.
fn one(kernel: &'static str, params: Vec<u8>, grid: u32, block: u32) -> LaunchSpec {
    LaunchSpec::new(kernel, params, (grid.max(1), 1, 1), block)
}

/// Scratch elements (f32) a node needs for `rows` rows.
pub(crate) fn scratch_elems(body: &PlanBody, op: &Op, rows: u64) -> u64 {
    match op {
        Op::IndexerSelect { ratio, .. } => rows * 2 * (body.state.context / *ratio as u64 + 1),
        Op::SparseAttn {
            heads,
            ratio,
            topk,
            hd,
            ..
        } => {
            let nsplit = ((*topk as u64 + 1) * *ratio as u64).div_ceil(SA_CHUNK as u64);
            rows * *heads as u64 * nsplit * (*hd as u64 + 2)
        }
        // hid [rows, topk, inter], then experts_order's permutation of the rows x topk slots (u32, from 5 rows on);
        // one row: experts_one's sums [topk, dim] besides.
        Op::Experts {
            topk, inter, dim, ..
        } => rows * *topk as u64 * (*inter as u64 + 1 + if rows == 1 { *dim as u64 } else { 0 }),
        Op::SharedExpert { inter, .. } => rows * (*inter as u64 + 1),
        Op::Router { experts, .. } => rows * *experts as u64,
        // SamplePart (32 bytes) per (item, part); items <= rows.
        Op::Sample { .. } => rows * SAMPLE_PARTS as u64 * 8,
        // Hn, lo, then (from two rows on, 16-byte aligned) lo's BF16 terms for hc_mix_tc (`hc_mix_xsplit`).
        Op::HcRead { hc, rank, dim, .. } => {
            let hn_lo = rows * (*rank as u64 + *hc as u64 * *dim as u64);
            if rows >= 2 {
                hn_lo.div_ceil(4) * 4 + split_items(rows, *rank) * SPLIT_ITEM_ELEMS
            } else {
                hn_lo
            }
        }
        // linear_split's BF16 terms: 3 x 16 bytes per (sub-row, step of 32, quarter) from two sub-rows on.
        Op::Linear { k, sub, .. } if rows * *sub as u64 >= 2 => {
            split_items(rows * *sub as u64, *k) * SPLIT_ITEM_ELEMS
        }
        // The gate of each (row, hyper-connection group), from ple_mix to ple_mix_conv.
        Op::PleMix { hc, .. } => rows * *hc as u64,
        _ => 0,
    }
}

/// Launch specs of a variant, one entry per node in node order. With `fuse_linears`, each run of sibling linears
/// (`fuse::launch_groups`) is one `linear_multi` launch standing at its first node's entry; the run's other
/// nodes get `None` (no launch of their own). With `a.fuse_small`, an embed or gather run inside the norm after it
/// gets `None` too (`rows::fuse_row_norms`), as does an `IndexerPrep` launched with the `AttnPrep` before it
/// (`attn::fuse_preps`), and so does a window-1 `GdnCommit` in every case (its work done by gdn_conv and
/// gdn_recur_one). Every other node has its own launch.
pub(crate) fn specs(
    a: &Addrs,
    v: &Variant,
    fuse_linears: bool,
) -> Result<Vec<Option<LaunchSpec>>, BackendError> {
    let mut out = Vec::with_capacity(v.nodes.len());
    if !fuse_linears {
        for (i, n) in v.nodes.iter().enumerate() {
            out.push(Some(node_spec(a, v, i, &n.op)?));
        }
    } else {
        let mxfp8 = |w: WeightId| a.is_mxfp8(w);
        for g in fuse::launch_groups(v, mxfp8) {
            if g.len() == 1 {
                out.push(Some(node_spec(a, v, g.start, &v.nodes[g.start].op)?));
            } else {
                let ops: Vec<&Op> = v.nodes[g.clone()].iter().map(|n| &n.op).collect();
                out.push(Some(linear_multi(a, v, &ops)?));
                out.extend((1..g.len()).map(|_| None));
            }
        }
    }
    if a.fuse_small {
        fuse_hc_norm(a, v, &mut out)?;
        rows::fuse_row_norms(a, v, &mut out)?;
        attn::fuse_preps(v, &mut out);
    }
    for (sp, n) in out.iter_mut().zip(&v.nodes) {
        if commit_in_window_one(v, &n.op) {
            *sp = None;
        }
    }
    // Last, so no later pass drops a spec that forks or joins a branch.
    if a.side_scratch != 0 {
        if a.side_arena != 0 {
            branch_ple_prep(a, v, &mut out)?;
        }
        branch_shared_experts(a, v, &mut out)?;
    }
    if a.prefetch_budget != 0 {
        prefetch::branch_prefetch(a, v, &mut out)?;
    }
    Ok(out)
}

/// Elements of the side branch's scratch for a node over `rows` rows: a `SharedExpert`'s own scratch (hid, sg),
/// then its down dots `[rows, dim]` (`keep_dots`); a `Linear` or `PleEmbed` its own scratch (the PLE branch).
pub(crate) fn side_scratch_elems(body: &PlanBody, op: &Op, rows: u64) -> u64 {
    match op {
        Op::SharedExpert { inter, dim, .. } => rows * (*inter as u64 + 1 + *dim as u64),
        Op::Linear { .. } | Op::PleEmbed { .. } => scratch_elems(body, op, rows),
        _ => 0,
    }
}

/// Parameters and launch shape of node `node` (index in the variant; its counters from [`node_counters`]), from the
/// module of its op's family.
fn node_spec(a: &Addrs, v: &Variant, node: usize, op: &Op) -> Result<LaunchSpec, BackendError> {
    match op {
        Op::EmbedStreams { .. }
        | Op::Embed { .. }
        | Op::GatherRows { .. }
        | Op::LastRows { .. }
        | Op::RmsNorm { .. }
        | Op::AddBroadcast { .. } => rows::spec(a, v, op),
        Op::Linear { .. } => linear::spec(a, v, op),
        Op::HcRead { .. } => hc_read_spec(a, v, node, op, true),
        Op::HcWrite { .. } => hc_write_spec(a, v, op, None),
        Op::PleEmbed { .. } | Op::PleMix { .. } | Op::PleCommit { .. } => ple::spec(a, v, op),
        Op::GdnConv { .. } | Op::GdnRecur { .. } | Op::GdnCommit { .. } | Op::GatedNorm { .. } => {
            gdn::spec(a, v, op)
        }
        Op::AttnPrep { .. }
        | Op::IndexerPrep { .. }
        | Op::IndexerSelect { .. }
        | Op::SparseAttn { .. }
        | Op::IndexerCommit { .. } => attn::spec(a, v, op),
        Op::Router { .. } => router_spec(a, v, node, op),
        Op::Experts { .. } => experts_spec(a, v, node, op, 0),
        Op::SharedExpert { .. } => shared_expert_spec(a, v, op, None),
        Op::Sample { .. } | Op::KeepCount { .. } => sample::spec(a, v, op),
    }
}
