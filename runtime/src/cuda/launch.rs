//! Kernel parameters and launch shapes of every op, from a variant's node and the device addresses of the
//! backend's allocations. The parameter structs are the generated mirrors of `kernels/params.h`.

use flashplan_plan::{
    BufId, GateAct, KeepSrc, Op, PlanBody, SampleRows, Space, StateId, Variant, WeightId,
};

use super::fuse;
use super::params::*;
use crate::backend::BackendError;
use crate::cpu::kernels::Rope;

/// Device addresses a node's parameters are bound to.
#[derive(Clone, Copy)]
pub(crate) struct Addrs<'a> {
    pub body: &'a PlanBody,
    pub arena: u64,
    pub io: &'a dyn Fn(flashplan_plan::IoBuf) -> u64,
    pub weights: &'a [u64],
    /// Per weight: the address of its MXFP8 scales when it is held as MXFP8 (codes at `weights`), else 0.
    pub mxfp8_scales: &'a [u64],
    pub common: FpCommon,
    pub rope: u64,
    pub rope_cfg: &'a Rope,
    /// This variant's node counters: one u32 per node of the variant (node i at `counters + 4 i`), zeroed at
    /// allocation; a kernel that uses its node's counter leaves it 0 at the end of every launch (graph replays).
    pub counters: u64,
    /// Fewer launches for the small ops (`FLASHPLAN_FUSE_SMALL`): the router in one launch up to
    /// `ROUTER_ONE_LAUNCH_ROWS` rows (its last block does the top-k). Same bits either way.
    pub fuse_small: bool,
    /// Streaming multiprocessors of the GPU (132 on the H200), for the one-wave grids ([`one_wave`]).
    pub sms: u32,
    /// The side branch's scratch ([`side_scratch_elems`] elements), or 0 to run every launch on the main stream.
    pub side_scratch: u64,
    /// The side arena ([`side_arena_elems`] elements) for the buffers of the PLE branch ([`branch_ple_prep`]), or 0.
    pub side_arena: u64,
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
    /// The node's kernel for reports: the first launch's, or `<linear entry>+split` when the first launch only
    /// splits the rows for the linear that follows ([`with_split`]).
    pub fn name(&self) -> String {
        match self.then.first() {
            Some((k, ..)) if self.kernel.ends_with("_split") => format!("{k}+split"),
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

/// Entry points of one kernel per row tile T = 1, 2, 4, 8, 16 (`name_tT` in `kernels/`): each is compiled with the
/// registers its tile needs.
/// Entry points of a kernel per row tile, for tiles 1, 2, 4, 8, 16 in order (a prefix: kernels whose launches never
/// take the larger tiles do not compile them).
type ByRows = &'static [&'static str];
const LINEAR: ByRows = &[
    "linear_t1",
    "linear_t2",
    "linear_t4",
    "linear_t8",
    "linear_t16",
];
const HC_READ: ByRows = &["hc_read_t1", "hc_read_t2", "hc_read_t4"];
/// `hc_read`'s down/inject launch (kernels/norm.cu): its entry point, outputs per block and tiles of rows over
/// `blockIdx.y`. Up to 4 rows 2 outputs per block ([`HC_READ`]); beyond, `hc_read_t4_wide` with 4 outputs per
/// block in tiles of 4 rows, so each block reads its rows of Hn for twice the outputs (H200, lone-w8 1977 -> 1931 us,
/// lone-w16 2933 -> 2899 us; at 4 rows, one tile, the halved grid was slower: 1496 -> 1507 us). An output's
/// arithmetic is the same in every entry point (row invariance).
fn hc_read_launch(nrows: u32) -> (&'static str, u32, u32) {
    if nrows > 4 {
        ("hc_read_t4_wide", 4, nrows.div_ceil(4))
    } else {
        let (read, tiles) = by_row_tiles(HC_READ, nrows);
        (read, 2, tiles)
    }
}
const HC_MIX_TC: ByRows = &[
    "hc_mix_tc_t1",
    "hc_mix_tc_t2",
    "hc_mix_tc_t4",
    "hc_mix_tc_t8",
    "hc_mix_tc_t16",
];
const ROUTER: ByRows = &["router_t1", "router_t2", "router_t4", "router_t8"];
const SHARED_EXPERT: ByRows = &["shared_expert_t1", "shared_expert_t2", "shared_expert_t4"];
const SHARED_EXPERT_DOWN: ByRows = &[
    "shared_expert_down_t1",
    "shared_expert_down_t2",
    "shared_expert_down_t4",
];

/// Most rows per block for the kernels that also spread row tiles over blocks (`blockIdx.y`: hc_read,
/// shared_expert, shared_expert_down, and the router's logits when router_topk follows): beyond it
/// they take tiles of this many rows (their entry points stop at t4), one grid row of blocks per tile, instead of
/// one block walking every tile (each lane's activation loads for all the rows of a tile wait in turn; the
/// weights, at most 13 MB, are read again per tile mostly from L2). The tile never changes a row's arithmetic.
const ROW_TILE_MAX: u32 = 4;

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

/// Block size of `router_topk` (`ROUTER_TOPK_THREADS` in `kernels/moe.cu`: the softmax's block trees, which the
/// fused router's warp per row reproduces).
const ROUTER_TOPK_THREADS: u32 = 1024;

/// Most rows for which the router runs as one launch (`FLASHPLAN_FUSE_SMALL`): its last block's 8 warps do the
/// top-k of every row, one row per warp up to 8 rows. Measured on the H200: faster at one row (46 against 58 us
/// for the replay's four routers), slower at 16 rows (238 against 218 us), where `router_topk`'s block per row
/// follows instead.
const ROUTER_ONE_LAUNCH_ROWS: u32 = 8;

/// Most routed experts per row (`MOE_MAX_TOPK` in `kernels/moe.cu`).
const MOE_MAX_TOPK: u32 = 32;

/// Vocabulary slices of `sample_part` (`SAMPLE_PARTS` in `kernels/sample.cu`).
const SAMPLE_PARTS: u32 = 64;

/// Tokens per chunk of `sparse_attn` (`SA_CHUNK` in `kernels/attn.cu`).
const SA_CHUNK: u32 = 32;

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
        Op::Experts { topk, inter, .. } => rows * *topk as u64 * *inter as u64,
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

/// Work items of `linear_split_rows` (kernels/linear.cuh) over `rows` rows of `k` inputs: one per (row, step of 32,
/// quarter of a step), each leaving 3 x 16 bytes ([`SPLIT_ITEM_ELEMS`] scratch elements).
fn split_items(rows: u64, k: u32) -> u64 {
    rows * k.div_ceil(32) as u64 * 4
}
/// Scratch elements (4 bytes) one [`split_items`] item writes: three BF16x2 uint4 fragments.
const SPLIT_ITEM_ELEMS: u64 = 12;
/// Blocks of 256 threads for `linear_split_rows` over `rows` rows of `k` inputs (a thread per item).
fn split_grid(rows: u32, k: u32) -> u32 {
    (split_items(rows as u64, k).div_ceil(256) as u32).max(1)
}
/// Output features per block of `linear_tc_rows` with `split` slices of K: 8 / split m-tiles of 16.
fn tc_features_per_block(split: u32) -> u32 {
    16 * (8 / split)
}

/// Slices of K for the tensor-core linear (`linear_tc_rows` in `kernels/linear.cuh`), from the weight's shape
/// `[n, k]` alone (so every row count sums in the same order: row invariance). K runs in steps of 32 values; the
/// fewest of 1, 2, 4, 8 slices that leave each warp at most 40 steps and give the launch at least 528 blocks (4 per
/// SM of the H200; a block is 8 / S m-tiles of 16 features), else 8. Measured on the H200 (lone-w1): the 248k-row
/// lm_head is fastest with 2 slices (315 us against 347 with 8), the 10k-16k-row projections with 8 (156 us for a
/// replay's four fused runs against 163 with 2 and 189 with 4).
pub(crate) fn tc_split(k: u32, n: u32) -> u32 {
    const MOST_STEPS: u32 = 40;
    const LEAST_BLOCKS: u64 = 528;
    let steps = k.div_ceil(32);
    [1, 2, 4, 8]
        .into_iter()
        .find(|&s| {
            steps.div_ceil(s) <= MOST_STEPS
                && (n as u64).div_ceil(16 * 8 / s as u64) >= LEAST_BLOCKS
        })
        .unwrap_or(8)
}

/// Slices of K (the rank) of `hc_mix_tc` (kernels/norm.cu), from the number of gates alone (so every row count
/// sums in the same order): the fewest of 1, 2, 4, 8 that give the launch at least 264 blocks (2 per SM of the
/// H200; a block is 8 / S m-tiles of 16 gates), else 8. Measured on the H200 with the real shape (10240 gates of
/// rank 320; lone-w1 / lone-w16 replay): 4 slices 1052 / 3142 us, 2 slices 1052 / 3143, 1 slice 1057 / 3178,
/// 8 slices 1092 / 3168.
pub(crate) fn hc_mix_slices(gates: u32) -> u32 {
    const LEAST_BLOCKS: u32 = 264;
    [1, 2, 4, 8]
        .into_iter()
        .find(|&s| gates.div_ceil(16 * 8 / s) >= LEAST_BLOCKS)
        .unwrap_or(8)
}

/// Router experts per block of 8 warps for the logits entry point `logits` (kernels/moe.cu): a warp takes one
/// expert in `router_t1`, `MOE_NPW` = 2 in the others.
fn router_experts_per_block(logits: &str) -> u32 {
    if logits == "router_t1" {
        8
    } else {
        16
    }
}

/// The error of a parameter builder handed another op's node: `kernel`'s parameters asked of `op`.
fn wrong_op(kernel: &str, op: &Op) -> BackendError {
    BackendError::Device(format!("{kernel} parameters for a `{}` node", op.kernel()))
}

/// `linear_mxfp8` entry points per row tile (kernels/mxfp8.cu).
const LINEAR_MXFP8: ByRows = &[
    "linear_mxfp8_t1",
    "linear_mxfp8_t2",
    "linear_mxfp8_t4",
    "linear_mxfp8_t8",
    "linear_mxfp8_t16",
];

/// Output features per warp group of `linear_mxfp8` (`MX_NPW` in kernels/mxfp8.cu), at every row tile.
const MX_NPW: u32 = 4;

/// Slices of K for `linear_mxfp8` (kernels/mxfp8.cu: slices of whole scale groups, each lane reading 16 codes at a
/// time, a warp 512 per pass): the fewest of 1, 2, 4, 8 that leave each lane at most 8 chunks of 16 codes per
/// weight row and give the launch at least 256 blocks (a weight with few rows splits K rather than leave SMs idle),
/// else 8. A function of the weight's shape `[n, k]` alone, so every row count gets the same slices (row
/// invariance).
pub(crate) fn mx_split(k: u32, n: u32) -> u32 {
    let passes = k.div_ceil(512);
    [1, 2, 4, 8]
        .into_iter()
        .find(|&s| passes.div_ceil(s) <= 8 && n.div_ceil(MX_NPW * (8 / s)) >= 256)
        .unwrap_or(8)
}

/// A `Linear` node whose weight is held as MXFP8 (issue 8): `linear_mxfp8` (kernels/mxfp8.cu) with `linear`'s
/// parameters (`p.w` is the codes' address) and row tile, its own split of K ([`mx_split`]) and grid (blocks of
/// 8 / split groups of [`MX_NPW`] features; the kernel strides over its grid).
fn linear_mxfp8(p: &FpLinear, scales: u64, total: u32) -> LaunchSpec {
    let split = mx_split(p.k, p.n);
    let grid = p.n.div_ceil(MX_NPW * (8 / split));
    let m = FpLinearMxfp8 {
        c: p.c,
        x: p.x,
        codes: p.w,
        scales,
        out: p.out,
        k: p.k,
        n: p.n,
        sub: p.sub,
        accumulate: p.accumulate,
        gathered: p.gathered,
        split,
    };
    LaunchSpec::new(
        by_rows(LINEAR_MXFP8, total),
        bytes(&m),
        (grid.max(1), 1, 1),
        256,
    )
}

/// A `Linear` node's parameters, its launch's row count (sub-rows: `total`) and output features per block of
/// `linear` (kernels/linear.cuh `linear_tc_rows`: a block of 8 warps = 8 / split m-tiles of 16 features, each over
/// `split` = [`tc_split`] slices of K).
fn linear_params(a: &Addrs, v: &Variant, op: &Op) -> Result<(FpLinear, u32, u32), BackendError> {
    let Op::Linear {
        x,
        w,
        out,
        k,
        n,
        sub,
        accumulate,
    } = op
    else {
        return Err(wrong_op("linear", op));
    };
    let (streams, window) = v.kind.shape();
    let gathered = fuse::linear_gathered(v, *x, *k, *sub);
    let p = FpLinear {
        c: a.common,
        x: a.buf(v, *x),
        w: a.w(*w)?,
        out: a.buf(v, *out),
        k: *k,
        n: *n,
        sub: *sub,
        accumulate: *accumulate as u32,
        gathered: gathered as u32,
        split: tc_split(*k, *n),
    };
    let total = if gathered { streams } else { streams * window } * *sub;
    let per_block = tc_features_per_block(p.split);
    Ok((p, total, per_block))
}

/// Blocks of `linear_t1`, `linear_t2`, `linear_multi_t1` and `linear_multi_t2` resident on one SM (their
/// `__launch_bounds__(256, 3)`).
const LINEAR_T1_BLOCKS_PER_SM: u32 = 3;
/// Blocks of `experts` (the gate/up) resident on one SM: 256 threads of 128 registers (what ptxas gives it; it has no
/// launch bound, and `__launch_bounds__(256, 2)` changed its code, unmeasured) fill half the register file. Were the
/// compiler to give it more, the grid would take two waves: slower, the same results.
const EXPERTS_BLOCKS_PER_SM: u32 = 2;

/// A grid of `blocks` cut to the blocks that fit on the GPU at once (`per_sm` on each of `sms` SMs), for kernels
/// whose blocks loop over their work (grid-stride), so the launch runs in one wave: no block waits for a slot and
/// no block repeats its set-up (a lone row's split into shared memory, the top of the first loads). Which block does
/// a piece of work never changes its arithmetic. `sms` = 0 (unknown) keeps the grid.
fn one_wave(blocks: u32, per_sm: u32, sms: u32) -> u32 {
    if sms == 0 {
        blocks
    } else {
        blocks.min(per_sm * sms).max(1)
    }
}

/// Cuts the blocks of several matrices' shares of one grid to about `cap` in all, each share in proportion; returns
/// the new grid. Every share keeps at least one block, so shares of a block or two may take the sum a few blocks past
/// `cap` (a second wave of those few, never a wrong result). Unchanged when they fit.
fn one_wave_shares(blocks: &mut [u32], cap: u32) -> u32 {
    let whole: u64 = blocks.iter().map(|&b| b as u64).sum();
    if whole > cap as u64 {
        for b in blocks.iter_mut() {
            *b = (*b as u64 * cap as u64 / whole).max(1) as u32;
        }
    }
    blocks.iter().sum()
}

/// Steps of 32 inputs per warp from which a one-row `linear` keeps 8 steps of loads in flight
/// (`linear_t1_deep`, two blocks an SM) instead of 4: the lm_head (2560 inputs in 2 slices: 40 steps). H200, the
/// lm_head at one row: 304.5 -> 300.7 us, lone-w1 954 -> 949 us; the GDN projections (10 steps a warp) and the
/// output projections (24) were slower with it (27.4 -> 29.3 us, 11.2 -> 11.7 us).
const DEEP_STEPS: u32 = 32;

/// The entry point of a `Linear` launch of `total` rows over `k` inputs in `split` slices: by row tile
/// ([`LINEAR`]), and for one row with at least [`DEEP_STEPS`] steps a warp, `linear_t1_deep`. The same
/// arithmetic either way (the steps in flight never change a value).
fn linear_entry(total: u32, k: u32, split: u32) -> &'static str {
    if total == 1 && k.div_ceil(32).div_ceil(split.max(1)) >= DEEP_STEPS {
        "linear_t1_deep"
    } else {
        by_rows(LINEAR, total)
    }
}

/// `linear_multi` entry points per row tile (kernels/linear.cu).
const LINEAR_MULTI: ByRows = &[
    "linear_multi_t1",
    "linear_multi_t2",
    "linear_multi_t4",
    "linear_multi_t8",
    "linear_multi_t16",
];

/// One `linear_multi` launch for a run of sibling BF16 `Linear` nodes (`fuse::launch_groups`: same x, k and sub,
/// outputs apart from x and from each other, at most `FP_MAX_LINEARS`). Matrix m gets `blocks[m]` = the grid of its
/// own `linear` launch (at one or two rows a proportional share of one wave: [`one_wave_shares`]); its blocks loop
/// over its m-tiles, and the row tile and split of K are those of every node of the run, so each output is
/// bit-identical to the unfused launch.
fn linear_multi(a: &Addrs, v: &Variant, ops: &[&Op]) -> Result<LaunchSpec, BackendError> {
    if ops.is_empty() || ops.len() > FP_MAX_LINEARS {
        return Err(BackendError::Device(format!(
            "linear_multi: {} linears (1 ..= {FP_MAX_LINEARS})",
            ops.len()
        )));
    }
    let mut m = FpLinearMulti {
        count: ops.len() as u32,
        ..Default::default()
    };
    let (mut total, mut grid) = (0, 0);
    for (i, op) in ops.iter().enumerate() {
        let (p, t, per_block) = linear_params(a, v, op)?;
        if i > 0 && (p.x != m.x || p.k != m.k || p.sub != m.sub || p.split != m.split || t != total)
        {
            return Err(BackendError::Device(
                "linear_multi: the linears of a run differ in x, k, split of K or rows".into(),
            ));
        }
        (m.c, m.x, m.k, m.sub, m.gathered, m.split) = (p.c, p.x, p.k, p.sub, p.gathered, p.split);
        m.w[i] = p.w;
        m.out[i] = p.out;
        m.n[i] = p.n;
        m.accumulate[i] = p.accumulate;
        m.blocks[i] = p.n.div_ceil(per_block).max(1);
        grid += m.blocks[i];
        total = t;
    }
    // One or two rows: the grid in one wave (`one_wave`), each matrix keeping its share of the blocks (its blocks
    // loop over its m-tiles). H200, lone-w1: the GDN projections' launch (1030 blocks, 396 resident) 27.9 -> 25.8
    // us, `linear_multi_t1` 131.8 -> 121.9 us a replay; lone-w2 1100 -> 1092-1094 us.
    if total <= 2 {
        grid = one_wave_shares(
            &mut m.blocks[..ops.len()],
            one_wave(grid, LINEAR_T1_BLOCKS_PER_SM, a.sms),
        );
    }
    Ok(with_split(
        "linear_multi_split",
        by_rows(LINEAR_MULTI, total),
        bytes(&m),
        total,
        m.k,
        grid,
    ))
}

/// The launch of a BF16 linear (`kernel`, grid of `grid` blocks) over `total` rows of x with `k` inputs: from two
/// rows on, `split` (`linear_split` or `linear_multi_split`, same parameters) first leaves the rows' BF16 terms in
/// the scratch ([`scratch_elems`]) for `linear_tc_rows` to read instead of splitting them at every step and m-tile.
fn with_split(
    split: &'static str,
    kernel: &'static str,
    params: Vec<u8>,
    total: u32,
    k: u32,
    grid: u32,
) -> LaunchSpec {
    if total < 2 {
        return LaunchSpec::new(kernel, params, (grid.max(1), 1, 1), 256);
    }
    LaunchSpec::new(split, params, (split_grid(total, k), 1, 1), 256).then(kernel, grid, 256)
}

/// Blocks of 256 threads of `read_floor` per SM: a full SM (its `__launch_bounds__(256, 8)`).
const READ_FLOOR_BLOCKS_PER_SM: u32 = 8;

/// A `read_floor` launch (kernels/rows.cu, benchmarks only) on a GPU of `sms` SMs, one full wave: reads `len` bytes
/// from `src`; `out` takes the one store that never happens in practice.
pub(crate) fn read_floor_spec(src: u64, len: u64, out: u64, sms: u32) -> LaunchSpec {
    let p = FpReadFloor {
        src,
        bytes: len,
        out,
        never: 0x9e37_79b9,
        pad: 0,
    };
    let grid = READ_FLOOR_BLOCKS_PER_SM * sms.max(1);
    LaunchSpec::new("read_floor", bytes(&p), (grid, 1, 1), 256)
}

/// Launch specs of a variant, one entry per node in node order. With `fuse_linears`, each run of sibling linears
/// (`fuse::launch_groups`) is one `linear_multi` launch standing at its first node's entry; the run's other
/// nodes get `None` (no launch of their own). Otherwise every node has its own launch.
pub(crate) fn specs(
    a: &Addrs,
    v: &Variant,
    fuse_linears: bool,
) -> Result<Vec<Option<LaunchSpec>>, BackendError> {
    let mut out = Vec::with_capacity(v.nodes.len());
    if !fuse_linears {
        for (i, n) in v.nodes.iter().enumerate() {
            out.push(Some(spec(a, v, i, &n.op)?));
        }
    } else {
        let mxfp8 = |w: WeightId| a.mxfp8_scales.get(w.0 as usize).is_some_and(|&s| s != 0);
        for g in fuse::launch_groups(v, mxfp8) {
            if g.len() == 1 {
                out.push(Some(spec(a, v, g.start, &v.nodes[g.start].op)?));
            } else {
                let ops: Vec<&Op> = v.nodes[g.clone()].iter().map(|n| &n.op).collect();
                out.push(Some(linear_multi(a, v, &ops)?));
                out.extend((1..g.len()).map(|_| None));
            }
        }
    }
    if a.fuse_small {
        fuse_hc_norm(a, v, &mut out)?;
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
    Ok(out)
}

/// Elements of one hyper-connection group that `hc_write_norm` holds per block of 256 threads (`HCN_PER` x 256,
/// kernels/norm.cu).
const HC_NORM_MOST_DIM: u32 = 16 * 256;

/// The `HcRead` node's launches: `hc_norm` (with `norm`; without it the previous `hc_write_norm` has written Hn),
/// then hc_read (down and inject dots, row tiles over `blockIdx.y` beyond 4 rows), then from two rows on
/// hc_mix_split (lo's BF16 terms) and hc_mix_tc (the gates on tensor cores and the mix: kernels/norm.cu).
fn hc_read_spec(a: &Addrs, v: &Variant, op: &Op, norm: bool) -> Result<LaunchSpec, BackendError> {
    let Op::HcRead {
        h,
        norm: norm_w,
        down,
        up,
        inject,
        out,
        dim,
        hc,
        rank,
        eps,
    } = op
    else {
        return Err(wrong_op("hc_read", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    if !super::weights::hc_mix_on_tensor_cores(*hc) {
        return Err(BackendError::Device(format!(
            "hc_read: {hc} hyper-connections is not supported (1, 2, 4, 8 or 16: the gates' tiles of 16 rows hold \
             whole features)"
        )));
    }
    let gates = hc
        .checked_mul(*dim)
        .ok_or_else(|| BackendError::Device(format!("hc_read: {hc} x {dim} gates overflow u32")))?;
    let gathered = hc_read_gathered(v, op);
    let (inject, inj) = match inject {
        Some((w, b)) => (a.w(*w)?, a.buf(v, *b)),
        None => (0, 0),
    };
    let p = FpHcRead {
        c: a.common,
        h: a.buf(v, *h),
        norm: a.w(*norm_w)?,
        down: a.w(*down)?,
        up: a.w(*up)?,
        inject,
        inj,
        out: a.buf(v, *out),
        dim: *dim,
        hc: *hc,
        rank: *rank,
        gathered: gathered as u32,
        eps: *eps,
        split: hc_mix_slices(gates),
    };
    let outs = *rank + if p.inject != 0 { *hc } else { 0 };
    let nrows = if gathered { streams } else { rows };
    let (read, npw, tiles) = hc_read_launch(nrows);
    let params = bytes(&p);
    let spec = if norm {
        LaunchSpec::new("hc_norm", params, (nrows * *hc, 1, 1), 256).then_grid(
            read,
            (outs.div_ceil(npw), tiles, 1),
            256,
        )
    } else {
        LaunchSpec::new(read, params, (outs.div_ceil(npw), tiles, 1), 256)
    };
    let spec = if nrows >= 2 {
        spec.then("hc_mix_split", split_grid(nrows, *rank), 256)
    } else {
        spec
    };
    Ok(spec.then(
        by_rows(HC_MIX_TC, nrows),
        gates.div_ceil(tc_features_per_block(p.split)),
        256,
    ))
}

/// The `Experts` node's launches: `experts` (the gate/up, thread per pair of features of a (row, rank)), then
/// `experts_down` (warp per (output feature, row)); `shared`: 0, or the side branch's shared-expert gates, its down
/// dots following, for `experts_down` to add ([`branch_shared_experts`]).
fn experts_spec(a: &Addrs, v: &Variant, op: &Op, shared: u64) -> Result<LaunchSpec, BackendError> {
    let Op::Experts {
        x,
        ids,
        weights,
        gate_up,
        down,
        out,
        topk,
        dim,
        inter,
    } = op
    else {
        return Err(wrong_op("experts", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let p = FpExperts {
        c: a.common,
        x: a.buf(v, *x),
        ids: a.buf(v, *ids),
        weights: a.buf(v, *weights),
        gate_up: a.w(*gate_up)?,
        down: a.w(*down)?,
        out: a.buf(v, *out),
        topk: *topk,
        dim: *dim,
        inter: *inter,
        pad: 0,
        shared,
    };
    if *topk > MOE_MAX_TOPK {
        return Err(BackendError::Device(format!(
            "experts: top-{topk} is not supported (at most {MOE_MAX_TOPK})"
        )));
    }
    let items = rows as u64 * *topk as u64 * inter.div_ceil(2) as u64;
    let mut grid = items.div_ceil(8) as u32;
    if rows == 1 {
        // One row: the gate/up in one wave (`one_wave`: 3200 warps at the real width, 2112 resident). H200,
        // lone-w1: `experts` 135.5 -> 131.4 us a replay. From 2 rows on the full grid was faster (lone-w16 2796 ->
        // 2817 us with one wave): rows routed to one expert then read its rows side by side.
        grid = one_wave(grid, EXPERTS_BLOCKS_PER_SM, a.sms);
    }
    Ok(
        LaunchSpec::new("experts", bytes(&p), (grid, 1, 1), 256).then(
            "experts_down",
            (rows * *dim).div_ceil(8),
            256,
        ),
    )
}

/// The `SharedExpert` node's launches: the gate/up (warp per intermediate feature, row tiles over `blockIdx.y`),
/// then the down. `side`: the side branch's scratch, where the launches keep their down dots for `experts_down`
/// ([`branch_shared_experts`]); `None`: the node's own launches on the main stream, adding to `out`.
fn shared_expert_spec(
    a: &Addrs,
    v: &Variant,
    op: &Op,
    side: Option<u64>,
) -> Result<LaunchSpec, BackendError> {
    let Op::SharedExpert {
        x,
        gate,
        up,
        down,
        scale,
        out,
        dim,
        inter,
    } = op
    else {
        return Err(wrong_op("shared_expert", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let mut c = a.common;
    if let Some(scratch) = side {
        c.scratch = scratch;
    }
    let p = FpSharedExpert {
        c,
        x: a.buf(v, *x),
        gate: a.w(*gate)?,
        up: a.w(*up)?,
        down: a.w(*down)?,
        scale: a.w(*scale)?,
        out: a.buf(v, *out),
        dim: *dim,
        inter: *inter,
        keep_dots: side.is_some() as u32,
        pad: 0,
    };
    let (gate_up, tiles) = by_row_tiles(SHARED_EXPERT, rows);
    let (down, _) = by_row_tiles(SHARED_EXPERT_DOWN, rows);
    Ok(LaunchSpec::new(
        gate_up,
        bytes(&p),
        ((*inter + 1).div_ceil(8), tiles, 1),
        256,
    )
    .then_grid(down, (dim.div_ceil(16), tiles, 1), 256))
}

/// Whether an `HcRead` reads only each stream's last row (its `h` holds one row per stream).
fn hc_read_gathered(v: &Variant, op: &Op) -> bool {
    let (streams, window) = v.kind.shape();
    match op {
        Op::HcRead { h, dim, hc, .. } => {
            v.buf(*h).elems < (streams * window) as u64 * (*dim as u64 * *hc as u64)
        }
        _ => false,
    }
}

/// The `HcWrite` node's launch: `hc_write` (thread per element), or with `norm` = (the next hc_read's `hc_norm`
/// weight address, its eps) `hc_write_norm` (block per (row, hyper-connection)), which also writes that read's Hn.
fn hc_write_spec(
    a: &Addrs,
    v: &Variant,
    op: &Op,
    norm: Option<(u64, f32)>,
) -> Result<LaunchSpec, BackendError> {
    let Op::HcWrite { h, y, inj, dim, hc } = op else {
        return Err(wrong_op("hc_write", op));
    };
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let p = FpHcWrite {
        c: a.common,
        h: a.buf(v, *h),
        y: a.buf(v, *y),
        inj: a.buf(v, *inj),
        dim: *dim,
        hc: *hc,
        norm: norm.map_or(0, |n| n.0),
        eps: norm.map_or(0.0, |n| n.1),
        pad: 0,
    };
    Ok(match norm {
        Some(_) => LaunchSpec::new("hc_write_norm", bytes(&p), ((rows * *hc).max(1), 1, 1), 256),
        None => {
            let elems = rows as u64 * *dim as u64 * *hc as u64;
            LaunchSpec::new(
                "hc_write",
                bytes(&p),
                (elems.div_ceil(1024).clamp(1, 4096) as u32, 1, 1),
                256,
            )
        }
    })
}

/// `FLASHPLAN_FUSE_SMALL`: an `HcWrite` followed by the `HcRead` of the same `h` (same width, every row, groups of
/// at most `HC_NORM_MOST_DIM`) becomes `hc_write_norm` + the read without its `hc_norm` launch: one launch fewer,
/// the same bits (kernels/norm.cu `hc_norm_group` in both). Every layer's MoE read and the next layer's mixer read
/// follow a write; the first layer's and the PLE layer's do not.
fn fuse_hc_norm(
    a: &Addrs,
    v: &Variant,
    out: &mut [Option<LaunchSpec>],
) -> Result<(), BackendError> {
    for i in 0..v.nodes.len().saturating_sub(1) {
        let (w, r) = (&v.nodes[i].op, &v.nodes[i + 1].op);
        let (
            Op::HcWrite { h, dim, hc, .. },
            Op::HcRead {
                h: h2,
                dim: d2,
                hc: c2,
                norm,
                eps,
                ..
            },
        ) = (w, r)
        else {
            continue;
        };
        if h != h2
            || dim != d2
            || hc != c2
            || *dim > HC_NORM_MOST_DIM
            || hc_read_gathered(v, r)
            || out[i].is_none()
            || out[i + 1].is_none()
        {
            continue;
        }
        out[i] = Some(hc_write_spec(a, v, w, Some((a.w(*norm)?, *eps)))?);
        out[i + 1] = Some(hc_read_spec(a, v, r, false)?);
    }
    Ok(())
}

/// The shared expert on a side branch of the graph: wherever a `Router`, its `Experts` and a `SharedExpert` of the
/// same input and output follow each other, the shared expert's two launches fork onto the side stream at the
/// router's node (after the launch that wrote x), with their scratch in the side scratch, and leave their down dots
/// there (`keep_dots`); `experts_down` waits for them and adds them (`FpExperts::shared`: `fmaf(sg, dot, routed)`,
/// the fmaf `shared_expert_down` does in place otherwise, so the bits are the same). The shared expert (latency
/// bound at one row: 9.8 MB of weights at the real width) then runs while the router picks the experts. The
/// `SharedExpert` node gets no launch of its own.
fn branch_shared_experts(
    a: &Addrs,
    v: &Variant,
    out: &mut [Option<LaunchSpec>],
) -> Result<(), BackendError> {
    for i in 0..v.nodes.len().saturating_sub(2) {
        let (
            Op::Router { x, ids, .. },
            experts @ Op::Experts {
                x: ex,
                ids: eids,
                out: eout,
                ..
            },
            shared @ Op::SharedExpert {
                x: sx, out: sout, ..
            },
        ) = (&v.nodes[i].op, &v.nodes[i + 1].op, &v.nodes[i + 2].op)
        else {
            continue;
        };
        if x != ex
            || x != sx
            || ids != eids
            || eout != sout
            || out[i..i + 3].iter().any(|s| s.is_none())
        {
            continue;
        }
        let side = shared_expert_spec(a, v, shared, Some(a.side_scratch))?;
        let (streams, window) = v.kind.shape();
        let Op::SharedExpert { inter, .. } = shared else {
            unreachable!("matched above")
        };
        let sg = a.side_scratch + 4 * streams as u64 * window as u64 * *inter as u64;
        let mut ex_spec = experts_spec(a, v, experts, sg)?;
        ex_spec.join_before = Some(ex_spec.then.len());
        if let Some(r) = out[i].as_mut() {
            r.side.push(side);
        }
        out[i + 1] = Some(ex_spec);
        out[i + 2] = None;
    }
    Ok(())
}

/// The PLE prep of a variant: a `PleEmbed` at `i`, the `Linear` nodes right after it that read its output (the
/// key and value projections) up to `j`, and the `PleMix` at `m` that reads their outputs.
struct PlePrep {
    i: usize,
    j: usize,
    m: usize,
    /// The embedding, then the projections' outputs, with their offsets (f32 elements) in the side arena.
    bufs: Vec<(BufId, u64)>,
    /// Side arena elements they take.
    elems: u64,
}

/// The variant's PLE preps ([`PlePrep`]), where the projections come before their `PleMix` with other nodes in
/// between (the compiler emits them before layer 0: compiler/src/graph.rs `ple_prep`).
fn ple_preps(v: &Variant) -> Vec<PlePrep> {
    let mut preps = Vec::new();
    for i in 0..v.nodes.len() {
        let Op::PleEmbed { out: u, .. } = v.nodes[i].op else {
            continue;
        };
        let j = (i + 1..v.nodes.len())
            .find(|&k| !matches!(v.nodes[k].op, Op::Linear { x, .. } if x == u))
            .unwrap_or(v.nodes.len());
        let proj: Vec<BufId> = v.nodes[i + 1..j]
            .iter()
            .flat_map(|n| n.op.writes())
            .collect();
        let Some(m) = (j..v.nodes.len()).find(|&k| {
            matches!(v.nodes[k].op, Op::PleMix { .. })
                && v.nodes[k].op.reads().iter().any(|b| proj.contains(b))
        }) else {
            continue;
        };
        if j == i + 1 || j == m {
            continue;
        }
        let mut bufs = Vec::new();
        let mut elems = 0;
        for b in std::iter::once(u).chain(proj) {
            bufs.push((b, elems));
            elems += v.buf(b).elems.div_ceil(64) * 64;
        }
        preps.push(PlePrep {
            i,
            j,
            m,
            bufs,
            elems,
        });
    }
    preps
}

/// The buffers [`branch_ple_prep`] may move to the side arena (a variant's PLE embeddings and projections).
pub(crate) fn side_arena_buffers(v: &Variant) -> Vec<BufId> {
    ple_preps(v)
        .iter()
        .flat_map(|p| p.bufs.iter().map(|&(b, _)| b))
        .collect()
}

/// Side arena elements a variant needs ([`branch_ple_prep`]).
pub(crate) fn side_arena_elems(v: &Variant) -> u64 {
    ple_preps(v).iter().map(|p| p.elems).sum()
}

/// The PLE layers' n-gram embedding and projections on the side branch: they read only the window's tokens, the
/// n-gram history and weights (the compiler emits them before layer 0), so their launches fork onto the side
/// stream at the next node (after the last of several consecutive PLE preps) and run beside layer 0 (its shared
/// expert queues behind them on the side stream, so its `experts_down` also waits for them); the `PleMix` that
/// reads their outputs waits for them. Their buffers move from the arena (where the nodes in between may reuse the
/// embedding's place) to the side arena (`Addrs::side_arena`, only these launches and the `PleMix` see the new
/// addresses; a prep whose buffers another node touches stays on the main stream), and the linears' row splits to
/// the side scratch, so nothing on the main stream touches what they read or write.
fn branch_ple_prep(
    a: &Addrs,
    v: &Variant,
    out: &mut [Option<LaunchSpec>],
) -> Result<(), BackendError> {
    let mut base = a.side_arena;
    let preps = ple_preps(v);
    // Which preps branch, from the last back: a prep's buffers must be touched only by its nodes and its ple_mix,
    // its nodes must not already fork or join, and its launches fork at the next node, or with the next prep's when
    // that one follows right after it and branches too (several PLE layers: one fork after the last).
    let mut take = vec![false; preps.len()];
    let mut chained = vec![false; preps.len()];
    // The node each prep's launches fork at (the last of a chain's next node): its ple_mix must come after it.
    let mut fork_at = vec![0; preps.len()];
    for q in (0..preps.len()).rev() {
        let p = &preps[q];
        let (i, j, m) = (p.i, p.j, p.m);
        let elsewhere = v.nodes.iter().enumerate().any(|(k, n)| {
            !(i..j).contains(&k)
                && k != m
                && n.op
                    .reads()
                    .into_iter()
                    .chain(n.op.writes())
                    .any(|b| p.bufs.iter().any(|&(mb, _)| mb == b))
        });
        chained[q] = preps.get(q + 1).is_some_and(|n| n.i == j) && take.get(q + 1) == Some(&true);
        fork_at[q] = if chained[q] { fork_at[q + 1] } else { j };
        take[q] = !elsewhere
            && m > fork_at[q]
            && out[m].is_some()
            && (chained[q] || out[j].is_some())
            && !out[i..j]
                .iter()
                .flatten()
                .any(|s| !s.side.is_empty() || s.join_before.is_some());
    }
    let mut pending: Vec<LaunchSpec> = Vec::new();
    for (q, p) in preps.iter().enumerate() {
        let (i, j, m) = (p.i, p.j, p.m);
        if !take[q] {
            continue;
        }
        let chained = chained[q];
        let moved: Vec<(BufId, u64)> = p.bufs.iter().map(|&(b, o)| (b, base + 4 * o)).collect();
        base += 4 * p.elems;
        let side = Addrs {
            common: FpCommon {
                scratch: a.side_scratch,
                ..a.common
            },
            moved: &moved,
            ..*a
        };
        // The branch's launches as `specs` makes them (a fused run of linears stands at its first node).
        let mut launches = vec![spec(&side, v, i, &v.nodes[i].op)?];
        let mut k = i + 1;
        while k < j {
            let end = (k + 1..j).find(|&e| out[e].is_some()).unwrap_or(j);
            launches.push(if end - k > 1 {
                let ops: Vec<&Op> = v.nodes[k..end].iter().map(|n| &n.op).collect();
                linear_multi(&side, v, &ops)?
            } else {
                spec(&side, v, k, &v.nodes[k].op)?
            });
            k = end;
        }
        let mut mix = spec(
            &Addrs {
                moved: &moved,
                ..*a
            },
            v,
            m,
            &v.nodes[m].op,
        )?;
        mix.join_before = Some(0);
        for s in &mut out[i..j] {
            *s = None;
        }
        pending.append(&mut launches);
        if !chained {
            if let Some(s) = out[j].as_mut() {
                s.side.append(&mut pending);
            }
        }
        out[m] = Some(mix);
    }
    Ok(())
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

/// Whether node `op` of variant `v` is a `GdnCommit` whose work its layer's `gdn_conv` and `gdn_recur` already did:
/// in a window of one row the row is always kept (`keep_count`: keep = rows, 0 or 1), so those kernels commit it
/// themselves (kernels/gdn.cu) and the commit launch is left out of the graph. The state is the same bits:
/// `gdn_recur` writes the state its own update produced, the update `gdn_commit` would have replayed.
pub(crate) fn commit_in_window_one(v: &Variant, op: &Op) -> bool {
    matches!(op, Op::GdnCommit { .. }) && v.kind.shape().1 == 1
}

/// Parameters and launch shape of node `node` (index in the variant; its counter is at `a.counters + 4 node`).
pub(crate) fn spec(
    a: &Addrs,
    v: &Variant,
    node: usize,
    op: &Op,
) -> Result<LaunchSpec, BackendError> {
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let c = a.common;
    let one = |kernel, params, grid: u32, block: u32| {
        LaunchSpec::new(kernel, params, (grid.max(1), 1, 1), block)
    };
    let half = a.rope_cfg.inv_freq.len() as u32;
    let af = a.rope_cfg.attention_factor;
    Ok(match op {
        Op::EmbedStreams {
            table,
            out,
            dim,
            copies,
            ..
        } => {
            let p = FpEmbed {
                c,
                table: a.w(*table)?,
                out: a.buf(v, *out),
                dim: *dim,
                copies: *copies,
            };
            one("embed_streams", bytes(&p), rows, 256)
        }
        Op::Embed {
            table, out, dim, ..
        } => {
            let p = FpEmbed {
                c,
                table: a.w(*table)?,
                out: a.buf(v, *out),
                dim: *dim,
                copies: 1,
            };
            one("embed", bytes(&p), rows, 256)
        }
        Op::GatherRows { src, out, width } => {
            // The source is read as a whole io buffer (the previous variant's output).
            let d = v.buf(*src);
            let src = match d.space {
                Space::Io(io) => (a.io)(io),
                Space::Arena => a.buf(v, *src),
            };
            let p = FpGatherRows {
                c,
                src,
                out: a.buf(v, *out),
                width: *width,
                pad: 0,
            };
            one("gather_rows", bytes(&p), rows, 256)
        }
        Op::LastRows { x, out, width } => {
            let p = FpLastRows {
                c,
                x: a.buf(v, *x),
                out: a.buf(v, *out),
                width: *width,
                pad: 0,
            };
            one("last_rows", bytes(&p), streams, 256)
        }
        Op::RmsNorm {
            x,
            w,
            out,
            dim,
            group,
            eps,
        } => {
            let p = FpRmsNorm {
                c,
                x: a.buf(v, *x),
                w: match w {
                    Some(w) => a.w(*w)?,
                    None => 0,
                },
                out: a.buf(v, *out),
                dim: *dim,
                group: *group,
                eps: *eps,
                pad: 0,
            };
            one("rms_norm", bytes(&p), rows, 256)
        }
        Op::Linear { w, n, .. } => {
            let (p, total, per_block) = linear_params(a, v, op)?;
            match a.mxfp8_scales.get(w.0 as usize) {
                Some(&scales) if scales != 0 => linear_mxfp8(&p, scales, total),
                _ => {
                    let entry = linear_entry(total, p.k, p.split);
                    let mut grid = n.div_ceil(per_block);
                    if total <= 2 && entry != "linear_t1_deep" {
                        // As `linear_multi` at one or two rows: one wave (the lm_head's `linear_t1_deep` in one
                        // wave of 264 blocks was slower: 300.8 -> 302.8 us).
                        grid = one_wave(grid, LINEAR_T1_BLOCKS_PER_SM, a.sms);
                    }
                    with_split("linear_split", entry, bytes(&p), total, p.k, grid)
                }
            }
        }
        Op::AddBroadcast {
            a: x,
            b,
            out,
            width,
            b_width,
        } => {
            let p = FpAddBroadcast {
                c,
                a: a.buf(v, *x),
                b: a.buf(v, *b),
                out: a.buf(v, *out),
                width: *width,
                b_width: *b_width,
            };
            // A block of 1024 threads: a row of the MTP's 4 x 2560 streams is 10 values a thread, one batch of
            // loads (`block_store_row`) instead of three; elementwise, so the block size never changes a value.
            one("add_broadcast", bytes(&p), rows, 1024)
        }
        Op::HcRead { .. } => hc_read_spec(a, v, op, true)?,
        Op::HcWrite { .. } => hc_write_spec(a, v, op, None)?,
        Op::PleEmbed {
            history,
            table,
            out,
            ple_index,
            heads,
            head_dim,
            ..
        } => {
            let cfg = &a.body.config;
            let mult = flashplan_plan::ple::layer_multipliers(cfg, *ple_index);
            let (sizes, offsets) = flashplan_plan::ple::head_sizes(cfg, *ple_index);
            if mult.len() > FP_MAX_NGRAM || sizes.len() > FP_MAX_PLE_HEADS {
                return Err(BackendError::Device(
                    "ple_embed: n-gram size or head count above the kernel's limits".into(),
                ));
            }
            let mut p = FpPleEmbed {
                c,
                table: a.w(*table)?,
                out: a.buf(v, *out),
                history: a.st(*history),
                mult: [0; FP_MAX_NGRAM],
                sizes: [1; FP_MAX_PLE_HEADS],
                offsets: [0; FP_MAX_PLE_HEADS],
                heads: *heads,
                head_dim: *head_dim,
                ngram: cfg.ngram_size,
                heads_per_ngram: cfg.heads_per_ngram,
                eos: cfg.eos(),
                pad: 0,
            };
            p.mult[..mult.len()].copy_from_slice(&mult);
            p.sizes[..sizes.len()].copy_from_slice(&sizes);
            p.offsets[..offsets.len()].copy_from_slice(&offsets);
            one("ple_embed", bytes(&p), rows, 256)
        }
        Op::PleMix {
            h,
            key,
            value,
            norm_key,
            norm_query,
            norm_conv,
            conv_w,
            tail,
            stash,
            dim,
            hc,
            kernel,
            dilation,
            eps,
        } => {
            if window > 65_535 || *hc > 65_535 {
                return Err(BackendError::Device(format!(
                    "ple_mix: {window} rows per stream or {hc} hyper-connections is over the launch grid's 65535"
                )));
            }
            let p = FpPleMix {
                c,
                h: a.buf(v, *h),
                key: a.buf(v, *key),
                value: a.buf(v, *value),
                norm_key: a.w(*norm_key)?,
                norm_query: a.w(*norm_query)?,
                norm_conv: a.w(*norm_conv)?,
                conv_w: a.w(*conv_w)?,
                stash: a.buf(v, *stash),
                tail: a.st(*tail),
                dim: *dim,
                hc: *hc,
                kernel: *kernel,
                dilation: *dilation,
                eps: *eps,
                pad: 0,
            };
            // Gates and Gn per (stream, group, row), then the conv and the update of h (kernels/ple.cu).
            LaunchSpec::new("ple_mix", bytes(&p), (streams, p.hc, window), 256).then_grid(
                "ple_mix_conv",
                (streams, p.hc, window),
                256,
            )
        }
        Op::PleCommit {
            history,
            tail,
            stash,
            keep,
            width,
            ..
        } => {
            let p = FpPleCommit {
                c,
                stash: a.buf(v, *stash),
                keep: a.keep(v, keep),
                history: a.st(*history),
                tail: a.st(*tail),
                width: *width,
                hist_len: a.st_elems(*history) as u32,
                tail_len: (a.st_elems(*tail) / *width as u64) as u32,
                pad: 0,
            };
            LaunchSpec::new(
                "ple_commit",
                bytes(&p),
                (streams, p.width.div_ceil(256), 1),
                256,
            )
        }
        Op::GdnConv {
            x,
            w,
            state,
            out,
            channels,
            kernel,
        } => {
            let p = FpGdnConv {
                c,
                x: a.buf(v, *x),
                w: a.w(*w)?,
                out: a.buf(v, *out),
                state: a.st(*state),
                channels: *channels,
                kernel: *kernel,
            };
            one("gdn_conv", bytes(&p), channels.div_ceil(128), 128)
        }
        Op::GdnRecur {
            qkv,
            b,
            a: av,
            a_log,
            dt_bias,
            state,
            out,
            stash,
            hk,
            hv,
            dk,
            dv,
        } => {
            if *dk > 128 || *dv > 1024 {
                return Err(BackendError::Device(format!(
                    "gdn_recur: dk {dk} > 128 or dv {dv} > 1024 is not supported"
                )));
            }
            let p = FpGdnRecur {
                c,
                qkv: a.buf(v, *qkv),
                b: a.buf(v, *b),
                a: a.buf(v, *av),
                a_log: a.w(*a_log)?,
                dt_bias: a.w(*dt_bias)?,
                out: a.buf(v, *out),
                stash: a.buf(v, *stash),
                state: a.st(*state),
                hk: *hk,
                hv: *hv,
                dk: *dk,
                dv: *dv,
            };
            LaunchSpec::new("gdn_recur", bytes(&p), (*hv, streams, dv.div_ceil(32)), 128)
        }
        Op::GdnCommit {
            stash,
            raw,
            state,
            conv,
            keep,
            hk,
            hv,
            dk,
            dv,
            channels,
            kernel,
        } => {
            let p = FpGdnCommit {
                c,
                stash: a.buf(v, *stash),
                raw: a.buf(v, *raw),
                keep: a.keep(v, keep),
                state: a.st(*state),
                conv: a.st(*conv),
                hk: *hk,
                hv: *hv,
                dk: *dk,
                dv: *dv,
                channels: *channels,
                kernel: *kernel,
            };
            LaunchSpec::new(
                "gdn_commit",
                bytes(&p),
                (*hv, streams, dv.div_ceil(32)),
                128,
            )
        }
        Op::GatedNorm {
            x,
            z,
            w,
            out,
            heads,
            dim,
            act,
            eps,
        } => {
            let p = FpGatedNorm {
                c,
                x: a.buf(v, *x),
                z: a.buf(v, *z),
                w: a.w(*w)?,
                out: a.buf(v, *out),
                heads: *heads,
                dim: *dim,
                act: match act {
                    GateAct::Sigmoid => 0,
                    GateAct::Silu => 1,
                },
                eps: *eps,
            };
            // A warp per (row, head).
            one("gated_norm", bytes(&p), (rows * *heads).div_ceil(8), 256)
        }
        Op::AttnPrep {
            q_raw,
            k_raw,
            v_raw,
            q_norm,
            k_norm,
            q,
            gate,
            k_cache,
            v_cache,
            heads,
            kv_heads,
            hd,
            eps,
            ..
        } => {
            if *hd > 512 {
                return Err(BackendError::Device("attn_prep: hd > 512".into()));
            }
            let p = FpAttnPrep {
                c,
                q_raw: a.buf(v, *q_raw),
                k_raw: a.buf(v, *k_raw),
                v_raw: a.buf(v, *v_raw),
                q_norm: a.w(*q_norm)?,
                k_norm: a.w(*k_norm)?,
                q: a.buf(v, *q),
                gate: a.buf(v, *gate),
                rope: a.rope,
                k_cache: a.st(*k_cache),
                v_cache: a.st(*v_cache),
                heads: *heads,
                kv_heads: *kv_heads,
                hd: *hd,
                rot_half: half,
                attn_factor: af,
                eps: *eps,
            };
            // A warp per head: the heads of a row spread over blockIdx.y (one block per 8 heads).
            LaunchSpec::new(
                "attn_prep",
                bytes(&p),
                (rows.max(1), (*heads + *kv_heads).div_ceil(8), 1),
                256,
            )
        }
        Op::IndexerPrep {
            qk,
            q_norm,
            q_out,
            raw_keys,
            ih,
            id,
            eps,
            ..
        } => {
            let p = FpIndexerPrep {
                c,
                qk: a.buf(v, *qk),
                q_norm: a.w(*q_norm)?,
                q_out: a.buf(v, *q_out),
                rope: a.rope,
                raw_keys: a.st(*raw_keys),
                ih: *ih,
                id: *id,
                rot_half: half,
                attn_factor: af,
                eps: *eps,
                pad: 0,
            };
            one("indexer_prep", bytes(&p), rows, 256)
        }
        Op::IndexerSelect {
            q,
            k_norm,
            raw_keys,
            pooled,
            sel,
            ih,
            id,
            ratio,
            topk,
            eps,
            ..
        } => {
            let p = FpIndexerSelect {
                c,
                q: a.buf(v, *q),
                k_norm: a.w(*k_norm)?,
                sel: a.buf(v, *sel),
                rope: a.rope,
                raw_keys: a.st(*raw_keys),
                pooled: a.st(*pooled),
                ih: *ih,
                id: *id,
                rot_half: half,
                ratio: *ratio,
                topk: *topk,
                nb_max: (a.body.state.context / *ratio as u64 + 1) as u32,
                attn_factor: af,
                eps: *eps,
            };
            if *ih * *id > 4096 || *id > 512 {
                return Err(BackendError::Device(format!(
                    "indexer_select: {ih} heads of {id} (at most 4096 values, id <= 512) is not supported"
                )));
            }
            let chunks = p.nb_max.div_ceil(16);
            LaunchSpec::new("indexer_score", bytes(&p), (rows, chunks, 1), 256).then(
                "indexer_select",
                rows,
                1024,
            )
        }
        Op::SparseAttn {
            q,
            gate,
            sel,
            k_cache,
            v_cache,
            out,
            heads,
            kv_heads,
            hd,
            ratio,
            topk,
        } => {
            let p = FpSparseAttn {
                c,
                q: a.buf(v, *q),
                gate: a.buf(v, *gate),
                sel: a.buf(v, *sel),
                out: a.buf(v, *out),
                k_cache: a.st(*k_cache),
                v_cache: a.st(*v_cache),
                heads: *heads,
                kv_heads: *kv_heads,
                hd: *hd,
                ratio: *ratio,
                topk: *topk,
                max_tokens: (*topk + 1) * *ratio,
            };
            let g = heads / kv_heads.max(&1);
            let nsplit = p.max_tokens.div_ceil(SA_CHUNK);
            if g > 16 || g * hd > 8192 || nsplit > 256 || heads % kv_heads.max(&1) != 0 {
                return Err(BackendError::Device(format!(
                    "sparse_attn: {heads} heads over {kv_heads} kv heads of {hd} with {} tokens is not supported \
                     (at most 16 heads per kv head, 8192 query values per kv head, 256 chunks)",
                    p.max_tokens
                )));
            }
            LaunchSpec::new("sparse_attn", bytes(&p), (rows, *kv_heads, nsplit), 256).then(
                "sparse_attn_combine",
                rows * heads,
                256,
            )
        }
        Op::IndexerCommit {
            raw_keys,
            pooled,
            k_norm,
            keep,
            id,
            ratio,
            eps,
            ..
        } => {
            let p = FpIndexerCommit {
                c,
                k_norm: a.w(*k_norm)?,
                keep: a.keep(v, keep),
                rope: a.rope,
                raw_keys: a.st(*raw_keys),
                pooled: a.st(*pooled),
                id: *id,
                rot_half: half,
                ratio: *ratio,
                attn_factor: af,
                eps: *eps,
                pad: 0,
            };
            one("indexer_commit", bytes(&p), streams, 256)
        }
        Op::Router {
            x,
            gate,
            ids,
            weights,
            experts,
            topk,
            dim,
            norm,
        } => {
            if *experts > 1024 || *topk > 32 || *topk == 0 || topk > experts {
                return Err(BackendError::Device(format!(
                    "router: {experts} experts with top-{topk} is not supported (1 <= top-k <= 32, top-k <= experts \
                     <= 1024)"
                )));
            }
            // One launch up to ROUTER_ONE_LAUNCH_ROWS rows (the last block's 8 warps do every row's top-k); beyond,
            // router_topk's block per row (the same bits).
            let one_launch = a.fuse_small && rows <= ROUTER_ONE_LAUNCH_ROWS;
            let p = FpRouter {
                c,
                x: a.buf(v, *x),
                gate: a.w(*gate)?,
                ids: a.buf(v, *ids),
                weights: a.buf(v, *weights),
                done: if one_launch {
                    a.counters + 4 * node as u64
                } else {
                    0
                },
                experts: *experts,
                topk: *topk,
                dim: *dim,
                norm: *norm as u32,
            };
            if one_launch {
                // The logits launch's last block does the top-k (warp per row), counting in the node's counter
                // (one grid row: the count is over gridDim.x blocks).
                let logits = by_rows(ROUTER, rows);
                one(
                    logits,
                    bytes(&p),
                    experts.div_ceil(router_experts_per_block(logits)),
                    256,
                )
            } else {
                let (logits, tiles) = by_row_tiles(ROUTER, rows);
                LaunchSpec::new(
                    logits,
                    bytes(&p),
                    (experts.div_ceil(router_experts_per_block(logits)), tiles, 1),
                    256,
                )
                .then("router_topk", rows, ROUTER_TOPK_THREADS)
            }
        }
        Op::Experts { .. } => experts_spec(a, v, op, 0)?,
        Op::SharedExpert { .. } => shared_expert_spec(a, v, op, None)?,
        Op::Sample {
            logits,
            tokens,
            probs,
            rows: which,
            vocab,
        } => {
            let (mode, items) = match which {
                SampleRows::All => (0, rows),
                SampleRows::Last => (1, streams),
                SampleRows::MtpGathered => (2, streams),
            };
            let p = FpSample {
                c,
                logits: a.buf(v, *logits),
                tokens: a.buf(v, *tokens),
                probs: a.buf(v, *probs),
                mode,
                vocab: *vocab,
            };
            LaunchSpec::new("sample_part", bytes(&p), (items, SAMPLE_PARTS, 1), 256)
                .then("sample", items, 1024)
        }
        Op::KeepCount { sampled, keep } => {
            let p = FpKeepCount {
                c,
                sampled: a.buf(v, *sampled),
                keep: a.buf(v, *keep),
            };
            one("keep_count", bytes(&p), 1, 32)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launch specs of every variant of the tiny plan, with made-up device addresses (no GPU: specs only
    /// compute parameters and shapes), with and without `FLASHPLAN_FUSE_SMALL`, with the side branch.
    fn tiny_specs(fuse_small: bool) -> Vec<(Variant, Vec<Option<LaunchSpec>>)> {
        tiny_specs_side(fuse_small, SIDE_SCRATCH)
    }

    /// Made-up side scratch and side arena addresses.
    const SIDE_SCRATCH: u64 = 0x6000_0000;
    const SIDE_ARENA: u64 = 0x7000_0000;

    /// [`tiny_specs`] with the side scratch at `side_scratch` (0: no side branch).
    fn tiny_specs_side(
        fuse_small: bool,
        side_scratch: u64,
    ) -> Vec<(Variant, Vec<Option<LaunchSpec>>)> {
        specs_of(
            &super::fuse::tests::tiny_plan(),
            fuse_small,
            side_scratch,
            132,
        )
    }

    /// The launch specs of every variant of `body`, with made-up device addresses; the side arena is there with
    /// the side scratch.
    fn specs_of(
        body: &PlanBody,
        fuse_small: bool,
        side_scratch: u64,
        sms: u32,
    ) -> Vec<(Variant, Vec<Option<LaunchSpec>>)> {
        let weights: Vec<u64> = (0..body.weights.len() as u64)
            .map(|i| 0x1000_0000 + (i << 20))
            .collect();
        let scales = vec![0u64; weights.len()];
        let rope = Rope::new(&body.config);
        let io = |_: flashplan_plan::IoBuf| 0x2000_0000u64;
        body.variants
            .iter()
            .map(|v| {
                let (nstreams, window) = v.kind.shape();
                let a = Addrs {
                    body,
                    arena: 0x3000_0000,
                    io: &io,
                    weights: &weights,
                    mxfp8_scales: &scales,
                    common: FpCommon {
                        nstreams,
                        window,
                        ..Default::default()
                    },
                    rope: 0x4000_0000,
                    rope_cfg: &rope,
                    counters: 0x5000_0000,
                    fuse_small,
                    sms,
                    side_scratch,
                    side_arena: if side_scratch != 0 { SIDE_ARENA } else { 0 },
                    moved: &[],
                };
                (v.clone(), specs(&a, v, true).expect("specs"))
            })
            .collect()
    }

    #[test]
    fn on_one_sm_the_one_and_two_row_launches_take_one_wave_and_every_matrix_keeps_blocks() {
        let (mut seen, mut cut) = (0, 0);
        let plan = super::fuse::tests::tiny_plan();
        let full = specs_of(&plan, true, SIDE_SCRATCH, 132);
        let one = specs_of(&plan, true, SIDE_SCRATCH, 1);
        for ((v, sp), (_, sp_full)) in one.into_iter().zip(&full) {
            let rows = v.kind.shape().0 * v.kind.shape().1;
            let pairs = sp
                .iter()
                .zip(sp_full)
                .filter_map(|(s, f)| Some((s.as_ref()?, f.as_ref()?)));
            for (s, f) in pairs {
                let last = |s: &LaunchSpec| s.then.last().map_or(s.grid.0, |t| t.1 .0);
                if last(s) < last(f) {
                    cut += 1;
                }
                let (kernel, grid) = match s.then.last() {
                    Some(&(k, g, _)) if s.kernel.ends_with("split") => (k, g.0),
                    _ => (s.kernel, s.grid.0),
                };
                if kernel.starts_with("linear_multi_t") {
                    let m: FpLinearMulti = params_of(s);
                    let blocks = &m.blocks[..m.count as usize];
                    assert_eq!(
                        blocks.iter().sum::<u32>(),
                        grid,
                        "{}: {kernel}",
                        v.kind.name()
                    );
                    assert!(blocks.iter().all(|&b| b >= 1));
                    if rows <= 2 {
                        // 3 blocks on the one SM, give or take a block per matrix.
                        assert!(
                            grid <= LINEAR_T1_BLOCKS_PER_SM + m.count,
                            "{}: {grid}",
                            v.kind.name()
                        );
                        seen += 1;
                    }
                } else if rows <= 2 && (kernel == "linear_t1" || kernel == "linear_t2") {
                    assert!(
                        grid <= LINEAR_T1_BLOCKS_PER_SM,
                        "{}: {kernel} {grid}",
                        v.kind.name()
                    );
                    seen += 1;
                } else if rows == 1 && kernel == "experts" {
                    assert!(
                        grid <= EXPERTS_BLOCKS_PER_SM,
                        "{}: experts {grid}",
                        v.kind.name()
                    );
                    seen += 1;
                }
            }
        }
        // The tiny plan's launches are cut to one SM's wave (not only small to begin with).
        assert!(seen > 0 && cut > 0, "{seen} launches checked, {cut} cut");
    }

    #[test]
    fn one_row_grids_run_in_one_wave_and_keep_each_matrix_share() {
        assert_eq!(one_wave(1030, LINEAR_T1_BLOCKS_PER_SM, 132), 396);
        assert_eq!(one_wave(160, LINEAR_T1_BLOCKS_PER_SM, 132), 160);
        assert_eq!(one_wave(1030, LINEAR_T1_BLOCKS_PER_SM, 0), 1030);
        // The GDN projections at the real width: qkv, z, b, a in 640 + 384 + 3 + 3 blocks.
        let mut b = [640, 384, 3, 3];
        let grid = one_wave_shares(&mut b, 396);
        assert_eq!(b, [246, 147, 1, 1]);
        assert_eq!(grid, 395);
        let mut small = [100, 50];
        assert_eq!(one_wave_shares(&mut small, 396), 150);
        assert_eq!(small, [100, 50]);
    }

    /// A spec's parameter struct, read back from its bytes.
    fn params_of<T: Copy>(sp: &LaunchSpec) -> T {
        assert_eq!(sp.params.len(), std::mem::size_of::<T>());
        // SAFETY: the bytes are a T's (`bytes`), the read is unaligned-safe.
        unsafe { std::ptr::read_unaligned(sp.params.as_ptr() as *const T) }
    }

    #[test]
    fn the_shared_expert_runs_on_the_side_branch_and_experts_down_joins_it() {
        let mut seen = 0;
        for (v, sp) in tiny_specs(true) {
            let rows = (v.kind.shape().0 * v.kind.shape().1) as u64;
            for (i, n) in v.nodes.iter().enumerate() {
                let Op::SharedExpert { inter, .. } = n.op else {
                    continue;
                };
                seen += 1;
                assert!(
                    sp[i].is_none(),
                    "{}: the shared expert has no launch of its own",
                    v.kind.name()
                );
                assert!(matches!(v.nodes[i - 2].op, Op::Router { .. }));
                let router = sp[i - 2].as_ref().expect("router launched");
                let side = router
                    .side
                    .first()
                    .expect("the shared expert forks at the router");
                assert!(
                    side.kernel.starts_with("shared_expert_t"),
                    "{}",
                    side.kernel
                );
                assert!(side.side.is_empty() && side.join_before.is_none());
                let sh: FpSharedExpert = params_of(side);
                assert_eq!((sh.keep_dots, sh.c.scratch), (1, SIDE_SCRATCH));
                let experts = sp[i - 1].as_ref().expect("experts launched");
                assert_eq!(experts.join_before, Some(experts.then.len()));
                assert_eq!(experts.then.last().map(|t| t.0), Some("experts_down"));
                let ex: FpExperts = params_of(experts);
                assert_eq!(
                    ex.shared,
                    SIDE_SCRATCH + 4 * rows * inter as u64,
                    "sg after hid [rows, inter]"
                );
            }
        }
        assert!(seen > 0, "the tiny plan has shared experts");
        // Without a side scratch every launch stays on the main stream and the shared expert adds in place.
        for (v, sp) in tiny_specs_side(true, 0) {
            for (n, s) in v.nodes.iter().zip(&sp) {
                let Some(s) = s else { continue };
                assert!(s.side.is_empty() && s.join_before.is_none());
                if matches!(n.op, Op::SharedExpert { .. }) {
                    assert_eq!(params_of::<FpSharedExpert>(s).keep_dots, 0);
                }
                if matches!(n.op, Op::Experts { .. }) {
                    assert_eq!(params_of::<FpExperts>(s).shared, 0);
                }
            }
        }
    }

    #[test]
    fn the_ple_embedding_and_projections_run_on_the_side_branch_until_ple_mix() {
        let mut seen = 0;
        for (v, sp) in tiny_specs(true) {
            let Some(i) = v
                .nodes
                .iter()
                .position(|n| matches!(n.op, Op::PleEmbed { .. }))
            else {
                continue;
            };
            seen += 1;
            let name = v.kind.name();
            // The compiler emits them before layer 0; they have no launches of their own.
            assert!(v.nodes[..i].iter().all(|n| n.layer.is_none()), "{name}");
            let j = i + 3;
            assert!(sp[i..j].iter().all(|s| s.is_none()), "{name}");
            let fork = sp[j].as_ref().expect("the next node launches");
            assert_eq!(
                fork.side.len(),
                2,
                "{name}: ple_embed and the fused key/value projections"
            );
            assert_eq!(fork.side[0].kernel, "ple_embed");
            // The embedding, key and value live in the side arena, which ple_mix reads.
            let e: FpPleEmbed = params_of(&fork.side[0]);
            assert_eq!(e.out, SIDE_ARENA, "{name}");
            let lin = &fork.side[1];
            let (rows, first) = (v.kind.shape().0 * v.kind.shape().1, lin.kernel);
            assert!(first.starts_with("linear_multi"), "{name}: {first}");
            if rows >= 2 {
                let p: FpLinearMulti = params_of(lin);
                assert_eq!(
                    p.c.scratch, SIDE_SCRATCH,
                    "{name}: the rows split into the side scratch"
                );
            }
            let m = (j..v.nodes.len())
                .find(|&k| matches!(v.nodes[k].op, Op::PleMix { .. }))
                .expect("ple_mix");
            let mix = sp[m].as_ref().expect("ple_mix launched");
            assert_eq!(mix.join_before, Some(0), "{name}");
            let x: FpPleMix = params_of(mix);
            let arena = SIDE_ARENA..SIDE_ARENA + 4 * side_arena_elems(&v);
            assert!(
                arena.contains(&x.key) && arena.contains(&x.value) && x.key != x.value,
                "{name}"
            );
        }
        assert!(seen > 0, "the tiny plan has a PLE layer");
    }

    #[test]
    fn two_ple_layers_share_one_fork_and_each_ple_mix_joins() {
        let body = super::fuse::tests::tiny_plan_with(|json| {
            json["ple_layer_ids"] = serde_json::json!([2, 3]);
        });
        let mut seen = 0;
        for (v, sp) in &specs_of(&body, true, SIDE_SCRATCH, 132) {
            let preps = ple_preps(v);
            if preps.is_empty() {
                continue;
            }
            seen += 1;
            assert_eq!(preps.len(), 2, "{}", v.kind.name());
            assert_eq!(preps[1].i, preps[0].j, "the two preps follow each other");
            let fork = sp[preps[1].j].as_ref().expect("the node after both preps");
            let kernels: Vec<&str> = fork.side.iter().map(|s| s.kernel).collect();
            assert_eq!(kernels.len(), 4, "{}: {kernels:?}", v.kind.name());
            assert_eq!((kernels[0], kernels[2]), ("ple_embed", "ple_embed"));
            assert!(sp[preps[0].i..preps[1].j].iter().all(|s| s.is_none()));
            let mut outs = Vec::new();
            for p in &preps {
                let mix = sp[p.m].as_ref().expect("ple_mix");
                assert_eq!(mix.join_before, Some(0));
                let x: FpPleMix = params_of(mix);
                outs.extend([x.key, x.value]);
            }
            outs.sort_unstable();
            outs.dedup();
            assert_eq!(
                outs.len(),
                4,
                "{}: distinct side-arena places",
                v.kind.name()
            );
            assert!(outs
                .iter()
                .all(|&o| o >= SIDE_ARENA && o < SIDE_ARENA + 4 * side_arena_elems(v)));
        }
        assert!(seen > 0);
    }

    #[test]
    fn gdn_commit_is_left_out_exactly_in_windows_of_one_row() {
        let mut seen = [false; 2];
        for (v, sp) in tiny_specs(true) {
            let one_row = v.kind.shape().1 == 1;
            for (n, s) in v.nodes.iter().zip(&sp) {
                if matches!(n.op, Op::GdnCommit { .. }) {
                    seen[one_row as usize] = true;
                    match s {
                        None => assert!(one_row, "{}: gdn_commit left out", v.kind.name()),
                        Some(s) => {
                            assert!(!one_row, "{}: gdn_commit launched", v.kind.name());
                            assert_eq!(s.kernel, "gdn_commit");
                        }
                    }
                }
            }
        }
        assert_eq!(
            seen,
            [true, true],
            "variants of both kinds with a GDN commit"
        );
    }

    #[test]
    fn linears_of_two_rows_or_more_split_their_rows_first() {
        let mut seen = [false; 2];
        for (v, sp) in tiny_specs(true) {
            for (n, s) in v.nodes.iter().zip(&sp) {
                let (Op::Linear { x, k, sub, .. }, Some(s)) = (&n.op, s) else {
                    continue;
                };
                if s.kernel.starts_with("linear_mxfp8") {
                    continue;
                }
                let (streams, window) = v.kind.shape();
                let gathered = fuse::linear_gathered(&v, *x, *k, *sub);
                let total = if gathered { streams } else { streams * window } * sub;
                let tile = |k: &str| k.rsplit('t').next().and_then(|t| t.parse::<u32>().ok());
                if total >= 2 {
                    seen[1] = true;
                    assert!(
                        s.kernel == "linear_split" || s.kernel == "linear_multi_split",
                        "{}: {}",
                        v.kind.name(),
                        s.kernel
                    );
                    assert_eq!(s.then.len(), 1);
                    assert!(tile(s.then[0].0).is_some_and(|t| t >= 2), "{}", s.then[0].0);
                } else {
                    seen[0] = true;
                    assert_eq!(tile(s.kernel), Some(1), "{}: {}", v.kind.name(), s.kernel);
                    assert!(s.then.is_empty());
                }
            }
        }
        assert_eq!(seen, [true, true], "linears of one row and of several");
    }

    #[test]
    fn hc_norm_moves_into_the_write_before_a_read_of_the_same_h() {
        for fuse_small in [true, false] {
            let (mut fused, mut plain) = (0, 0);
            for (v, sp) in tiny_specs(fuse_small) {
                for (i, n) in v.nodes.iter().enumerate() {
                    let Op::HcRead { h, .. } = n.op else { continue };
                    let read = sp[i].as_ref().expect("hc_read launched");
                    // From two rows on, hc_mix_split comes before hc_mix_tc.
                    let (streams, window) = v.kind.shape();
                    let nrows = if hc_read_gathered(&v, &n.op) {
                        streams
                    } else {
                        streams * window
                    };
                    let split = usize::from(nrows >= 2);
                    let last = read.then.last().expect("the mix").0;
                    assert!(last.starts_with("hc_mix_tc_t"), "{last}");
                    assert_eq!(
                        read.then.len() >= 2 && read.then[read.then.len() - 2].0 == "hc_mix_split",
                        nrows >= 2
                    );
                    let after_write = i > 0
                        && matches!(v.nodes[i - 1].op, Op::HcWrite { h: hw, .. } if hw == h)
                        && !hc_read_gathered(&v, &n.op);
                    if fuse_small && after_write {
                        fused += 1;
                        let write = sp[i - 1].as_ref().expect("hc_write launched");
                        assert_eq!(
                            write.kernel,
                            "hc_write_norm",
                            "{} node {}",
                            v.kind.name(),
                            i - 1
                        );
                        assert!(
                            read.kernel.starts_with("hc_read_t"),
                            "{}: {}",
                            v.kind.name(),
                            read.kernel
                        );
                        assert_eq!(read.launches(), 2 + split);
                        // The fused write carries the read's norm weight and eps.
                        assert_eq!(write.params.len(), std::mem::size_of::<FpHcWrite>());
                        // SAFETY: `params` holds the bytes of one FpHcWrite (`bytes(&p)`), length checked above.
                        let p: FpHcWrite =
                            unsafe { std::ptr::read_unaligned(write.params.as_ptr().cast()) };
                        let Op::HcRead { norm, eps, .. } = n.op else {
                            unreachable!()
                        };
                        assert_eq!(p.norm, 0x1000_0000 + ((norm.0 as u64) << 20));
                        assert_eq!(p.eps, eps);
                    } else {
                        assert_eq!(read.kernel, "hc_norm", "{} node {i}", v.kind.name());
                        assert_eq!(read.launches(), 3 + split);
                    }
                }
                // A write not followed by a read of its h (the last layer's, before the head's gathered read; a
                // layer followed by PLE) stays a plain hc_write, with or without the switch.
                for (i, n) in v.nodes.iter().enumerate() {
                    let Op::HcWrite { h, .. } = n.op else {
                        continue;
                    };
                    let read_next = v.nodes.get(i + 1).is_some_and(|r| {
                        matches!(r.op, Op::HcRead { h: hr, .. } if hr == h)
                            && !hc_read_gathered(&v, &r.op)
                    });
                    let kernel = sp[i].as_ref().expect("hc_write launched").kernel;
                    let want = if fuse_small && read_next {
                        "hc_write_norm"
                    } else {
                        "hc_write"
                    };
                    assert_eq!(kernel, want, "{} node {i}", v.kind.name());
                    plain += usize::from(kernel == "hc_write");
                }
            }
            assert_eq!(fused > 0, fuse_small);
            assert!(
                plain > 0,
                "some writes are not followed by a read of their h"
            );
        }
    }

    #[test]
    fn mx_split_depends_on_the_weight_shape_only() {
        // The drafting lm_head (k 2560, n 248320): no split, 7760 blocks of 32 features.
        assert_eq!(mx_split(2560, 248_320), 1);
        // Few rows: split K for more blocks (k/v projections, n 512), up to 8.
        assert_eq!(mx_split(2560, 512), 8);
        assert_eq!(mx_split(2560, 2560), 4);
        // Long rows: at most 8 chunks of 16 codes per lane and row.
        assert_eq!(mx_split(8192, 1 << 20), 2);
        assert_eq!(mx_split(1 << 20, 1 << 20), 8);
        for (k, n) in [(64, 512), (2560, 12_288), (6144, 2560), (40, 3)] {
            let s = mx_split(k, n);
            assert!([1, 2, 4, 8].contains(&s), "{k} x {n}: {s}");
        }
    }

    #[test]
    fn hc_mix_slices_follow_the_gate_count() {
        // The real shape: 4 x 2560 gates -> 4 slices (320 blocks); tiny models -> 8; huge -> 1.
        assert_eq!(hc_mix_slices(10_240), 4);
        assert_eq!(hc_mix_slices(256), 8);
        assert_eq!(hc_mix_slices(1 << 20), 1);
    }

    #[test]
    fn tc_split_depends_on_the_weight_shape_only() {
        // lm_head (k 2560, n 248320): 2 slices of 40 steps, 3880 blocks.
        assert_eq!(tc_split(2560, 248_320), 2);
        // The GDN qkv and z, the attention q (k 2560, n 6144 .. 16384): 8 slices, the most blocks.
        assert_eq!(tc_split(2560, 10_240), 8);
        assert_eq!(tc_split(2560, 6144), 8);
        // o_proj (k 6144, n 2560) and tiny projections: at most 8.
        assert_eq!(tc_split(6144, 2560), 8);
        assert_eq!(tc_split(2560, 48), 8);
        // A short K with many rows needs no split.
        assert_eq!(tc_split(64, 1 << 20), 1);
        // Long K: at most 40 steps per slice while there are blocks enough.
        assert_eq!(tc_split(8192, 1 << 20), 8);
        assert_eq!(tc_split(2560, 1 << 20), 2);
    }

    #[test]
    fn only_a_one_row_linear_of_many_steps_a_warp_runs_deep() {
        let entry = |rows, k, n| linear_entry(rows, k, tc_split(k, n));
        // The lm_head at one row: 40 steps a warp.
        assert_eq!(entry(1, 2560, 248_320), "linear_t1_deep");
        // Its wider windows keep their row tiles.
        assert_eq!(entry(2, 2560, 248_320), "linear_t2");
        assert_eq!(entry(16, 2560, 248_320), "linear_t16");
        // The GDN projections (10 steps a warp) and the output projections (24) stay at linear_t1.
        assert_eq!(entry(1, 2560, 10_240), "linear_t1");
        assert_eq!(entry(1, 6144, 2560), "linear_t1");
    }
}
