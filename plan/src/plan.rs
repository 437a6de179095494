//! The plan set: everything needed to rebuild, on the target machine, one graph per shape of work
//! (`architecture.md`, "Plans").

use serde::{Deserialize, Serialize};

use crate::config::{ModelConfig, StorageForm};
use crate::ops::{BufId, Op};

/// Which weights a [`WeightEntry`] belongs to; the runtime allocates only the groups its settings use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WeightGroup {
    /// The main model (embeddings, layers, final mixer, `lm_head`).
    Main,
    /// The MTP drafter as stored in the checkpoint.
    Mtp,
    /// The MTP drafter's linears re-coded to MXFP8 at load (`FLASHPLAN_MTP_WEIGHTS=mxfp8`).
    MtpMxfp8,
    /// An MXFP8 drafting copy of `lm_head` (`FLASHPLAN_MTP_WEIGHTS=mxfp8-head`).
    HeadMxfp8,
}

/// The MTP drafter's weight form (`FLASHPLAN_MTP_WEIGHTS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DrafterForm {
    /// The drafter's tensors as stored (`checkpoint`).
    Checkpoint,
    /// Linears re-coded to MXFP8 (`mxfp8`).
    Mxfp8,
    /// Linears re-coded to MXFP8 and an MXFP8 drafting copy of `lm_head` (`mxfp8-head`).
    Mxfp8Head,
}

impl DrafterForm {
    /// The setting's name as `FLASHPLAN_MTP_WEIGHTS` spells it.
    pub fn name(self) -> &'static str {
        match self {
            DrafterForm::Checkpoint => "checkpoint",
            DrafterForm::Mxfp8 => "mxfp8",
            DrafterForm::Mxfp8Head => "mxfp8-head",
        }
    }
    /// All forms, in order.
    pub const ALL: [DrafterForm; 3] = [
        DrafterForm::Checkpoint,
        DrafterForm::Mxfp8,
        DrafterForm::Mxfp8Head,
    ];
}

/// One tensor the model needs (`architecture.md`: the weight manifest).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightEntry {
    /// Canonical name, relative to the language model: `embed_tokens.weight`, `layers.3.self_attn.q_proj.weight`,
    /// `layers.0.mlp.experts.gate_up_proj` (experts always stacked), `layers.1.ple.ple_embedding.ngram_embedding.weight`
    /// (PLE shards concatenated), `hyper_connection_mixer.hc_norm.weight`, `lm_head.weight`, `mtp.*`.
    /// Re-coded copies carry a suffix: `#mxfp8`.
    pub name: String,
    /// Logical shape (the dequantized tensor's shape).
    pub shape: Vec<u64>,
    /// Storage form in device memory.
    pub form: StorageForm,
    /// The group this weight is allocated with.
    pub group: WeightGroup,
    /// Byte offset inside its group's allocation (256-byte aligned).
    pub offset: u64,
    /// Bytes in device memory (codes and scales).
    pub bytes: u64,
    /// For re-coded copies, the entry they are made from.
    pub source: Option<u32>,
}

impl WeightEntry {
    /// Number of logical elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Element type of a state piece in device memory (the CPU backend keeps every element as f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ElemType {
    /// 4-byte float.
    F32,
    /// bfloat16.
    Bf16,
    /// 4-byte token id.
    U32,
}

impl ElemType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            ElemType::F32 | ElemType::U32 => 4,
            ElemType::Bf16 => 2,
        }
    }
}

/// What a state piece holds (`rounds.md` section 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateKind {
    /// GDN recurrent state S, `[hv, dk, dv]` f32.
    GdnRecurrent,
    /// GDN conv window, `[kernel-1, channels]` (raw pre-conv inputs).
    GdnConv,
    /// Attention keys, `[ctx, kv_heads, hd]` (roped).
    KCache,
    /// Attention values, `[ctx, kv_heads, hd]`.
    VCache,
    /// QSA raw token keys, `[ctx, id]`.
    IndexerRawKeys,
    /// QSA pooled block keys, `[ctx / ratio, id]` (normed, roped).
    IndexerPooled,
    /// PLE n-gram history: the last `ngram_size - 1` token ids.
    PleHistory,
    /// PLE conv tail, `[(kernel-1)*dilation, C*D]`.
    PleTail,
}

/// One piece of per-slot state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatePiece {
    /// Human name, e.g. `layers.0.gdn.recurrent`, `mtp.k_cache`.
    pub name: String,
    /// What it holds.
    pub kind: StateKind,
    /// Decoder layer index (`None` for the MTP layer).
    pub layer: Option<u32>,
    /// Logical shape per slot.
    pub shape: Vec<u64>,
    /// Element type on the device.
    pub elem: ElemType,
    /// Element offset of this piece inside one slot (the CPU backend's f32 slot array).
    pub offset: u64,
    /// Byte offset of this piece inside one slot on the device (256-byte aligned).
    pub byte_offset: u64,
}

impl StatePiece {
    /// Elements per slot.
    pub fn elems(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Every state piece starts at a multiple of this many elements (16 bytes), and a slot is a multiple of it: the CUDA
/// backend reads the GDN recurrent state as float4 (kernels/gdn.cu).
pub const STATE_ALIGN: u64 = 4;

/// The per-slot state layout, sized for `context` tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateLayout {
    /// Context length every slot holds (tokens).
    pub context: u64,
    /// Number of slots (the largest stream count).
    pub slots: u32,
    /// Elements of one slot (CPU layout), a multiple of [`STATE_ALIGN`].
    pub slot_elems: u64,
    /// Bytes of one slot on the device.
    pub slot_bytes: u64,
    /// The pieces.
    pub pieces: Vec<StatePiece>,
}

/// Where a variant's buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Space {
    /// The shared activation arena; offsets assigned by liveness.
    Arena,
    /// A fixed input/output buffer shared by all variants (read back by the host or by the next variant).
    Io(IoBuf),
}

/// Fixed buffers shared across variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum IoBuf {
    /// Main model residual streams after the last layer, `[max_rows, C*D]` (the MTP absorb reads them).
    MainStreams,
    /// MTP output streams (before its mixer), `[max_rows, C*D]` (the next chain step reads them).
    MtpStreams,
    /// Logits of the last forward, `[max_rows, V]`.
    Logits,
    /// Sampled tokens, `[max_rows]` u32.
    Sampled,
    /// Probability of each sampled token at temperature 1, `[max_rows]`: written by the MTP step's sampling only (the
    /// drafts' confidence); the main model's rounds leave it as it was.
    Probs,
    /// Keep count per stream, `[max_streams]` u32.
    Keep,
}

/// One buffer of a variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferDecl {
    /// Human name, e.g. `l3.attn.q`.
    pub name: String,
    /// Where it lives.
    pub space: Space,
    /// Elements (4 bytes each).
    pub elems: u64,
    /// Element offset in its space (arena: assigned by the memory planner; io: 0, the io buffer's start).
    pub offset: u64,
}

/// Launch shape of a node (grid, block, dynamic shared memory) for the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub smem: u32,
}

/// One kernel launch of a variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The op with its bound arguments; `op.kernel()` names the entry point.
    pub op: Op,
    /// Launch shape.
    pub launch: Launch,
    /// Layer this node belongs to (`None`: embedding, head, sampling, MTP).
    pub layer: Option<u32>,
    /// Indices of earlier nodes this one depends on (data dependencies through buffers and state).
    pub deps: Vec<u32>,
}

/// The kind of graph a variant is captured into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum VariantKind {
    /// A verify round: `streams` windows of `window` rows (window = depth + 1), sampling, keep count, commit.
    Verify {
        /// Streams sharing the round.
        streams: u32,
        /// Rows per stream.
        window: u32,
    },
    /// The lone-stream slot: one stream, `window` rows, launch shapes for one stream.
    Lone {
        /// Rows.
        window: u32,
    },
    /// A prefill chunk of up to `chunk` rows of one stream; commits every real row, samples at the last one.
    Prefill {
        /// Rows per chunk.
        chunk: u32,
    },
    /// MTP absorb: `streams` streams, up to `window` entries each, read from the main streams; samples a draft at
    /// each stream's last entry.
    MtpAbsorb {
        /// Streams.
        streams: u32,
        /// Entries per stream.
        window: u32,
        /// Drafter weight form.
        form: DrafterForm,
    },
    /// One chained MTP step per stream, reading the previous step's output streams.
    MtpChain {
        /// Streams.
        streams: u32,
        /// Drafter weight form.
        form: DrafterForm,
    },
}

impl VariantKind {
    /// `(streams, rows per stream)` of this variant.
    pub fn shape(&self) -> (u32, u32) {
        match *self {
            VariantKind::Verify { streams, window } => (streams, window),
            VariantKind::Lone { window } => (1, window),
            VariantKind::Prefill { chunk } => (1, chunk),
            VariantKind::MtpAbsorb {
                streams, window, ..
            } => (streams, window),
            VariantKind::MtpChain { streams, .. } => (streams, 1),
        }
    }
    /// A short stable name, e.g. `verify-s4-w3`, `lone-w16`, `prefill-c64`, `mtp-absorb-s1-w5-mxfp8`.
    pub fn name(&self) -> String {
        match *self {
            VariantKind::Verify { streams, window } => format!("verify-s{streams}-w{window}"),
            VariantKind::Lone { window } => format!("lone-w{window}"),
            VariantKind::Prefill { chunk } => format!("prefill-c{chunk}"),
            VariantKind::MtpAbsorb {
                streams,
                window,
                form,
            } => {
                format!("mtp-absorb-s{streams}-w{window}-{}", form.name())
            }
            VariantKind::MtpChain { streams, form } => {
                format!("mtp-chain-s{streams}-{}", form.name())
            }
        }
    }
}

/// One graph recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Variant {
    /// What it runs.
    pub kind: VariantKind,
    /// Its buffers (arena and io).
    pub buffers: Vec<BufferDecl>,
    /// Its nodes, in launch order.
    pub nodes: Vec<Node>,
    /// Arena elements this variant uses (the largest offset + length).
    pub arena_elems: u64,
    /// Arena elements it would use without liveness-based reuse (every buffer its own place).
    pub arena_elems_no_reuse: u64,
}

impl Variant {
    /// The declaration of a buffer.
    pub fn buf(&self, id: BufId) -> &BufferDecl {
        &self.buffers[id.0 as usize]
    }
}

/// A compiled kernel module (CUDA cubin), keyed by the hash of its source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelModule {
    /// Module name (the `.cu` file stem).
    pub name: String,
    /// SHA-256 (hex) of the source text.
    pub source_hash: String,
    /// The cubin bytes.
    pub cubin: Vec<u8>,
    /// Entry points it exports.
    pub entry_points: Vec<String>,
}

/// Options the plans were compiled with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompileOptions {
    /// Target: `cpu` or an NVIDIA arch such as `sm_90a`.
    pub arch: String,
    /// Most drafts per window (verify windows have 1..=max_depth+1 rows).
    pub max_depth: u32,
    /// Stream counts that get verify variants (sorted, deduplicated).
    pub streams: Vec<u32>,
    /// Context length each slot holds.
    pub context: u64,
    /// Prefill chunk rows.
    pub prefill_chunk: u32,
}

/// Sizes of the io buffers (elements).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IoLayout {
    /// Largest row count of any variant.
    pub max_rows: u32,
    /// Largest stream count of any variant.
    pub max_streams: u32,
}

impl IoLayout {
    /// Elements of an io buffer for this config.
    pub fn elems(&self, io: IoBuf, cfg: &ModelConfig) -> u64 {
        let rows = self.max_rows as u64;
        match io {
            IoBuf::MainStreams | IoBuf::MtpStreams => rows * cfg.hc_width() as u64,
            IoBuf::Logits => rows * cfg.vocab_size as u64,
            IoBuf::Sampled | IoBuf::Probs => rows,
            IoBuf::Keep => self.max_streams as u64,
        }
    }
}

/// The body of a plan set: everything except the header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanBody {
    /// The resolved model config.
    pub config: ModelConfig,
    /// Compile options.
    pub options: CompileOptions,
    /// Weight manifest.
    pub weights: Vec<WeightEntry>,
    /// Per-slot state layout.
    pub state: StateLayout,
    /// Io buffer sizes.
    pub io: IoLayout,
    /// Arena elements (the largest variant's).
    pub arena_elems: u64,
    /// Kernel modules (empty for `cpu`).
    pub kernels: Vec<KernelModule>,
    /// Every variant.
    pub variants: Vec<Variant>,
}

impl PlanBody {
    /// Finds a variant by kind.
    pub fn variant(&self, kind: VariantKind) -> Option<&Variant> {
        self.variants.iter().find(|v| v.kind == kind)
    }
    /// Index of a weight by canonical name.
    pub fn weight_index(&self, name: &str) -> Option<usize> {
        self.weights.iter().position(|w| w.name == name)
    }
    /// How the nodes of all variants read each weight (indexed like [`PlanBody::weights`]): backends lay out the
    /// weights that only `Linear` nodes read in their own form (the CUDA backend's MMA tiles, MXFP8).
    pub fn weight_uses(&self) -> Vec<WeightUse> {
        let mut uses = vec![WeightUse::Unread; self.weights.len()];
        for v in &self.variants {
            for node in &v.nodes {
                let ws = node.op.weights();
                for &w in &ws {
                    // A weight in two roles of one node (say `up` and `down`) is not read as one matrix.
                    let once = ws.iter().filter(|&&x| x == w).count() == 1;
                    let Some(slot) = uses.get_mut(w.0 as usize) else {
                        continue;
                    };
                    let shape = &self.weights[w.0 as usize].shape;
                    let this = match &node.op {
                        Op::Linear { k, n, .. } if *shape == [*n as u64, *k as u64] => {
                            WeightUse::Linear { n: *n, k: *k }
                        }
                        Op::HcRead {
                            up, hc, dim, rank, ..
                        } if *up == w
                            && once
                            && *shape == [*hc as u64 * *dim as u64, *rank as u64] =>
                        {
                            WeightUse::HcUp {
                                hc: *hc,
                                dim: *dim,
                                rank: *rank,
                            }
                        }
                        _ => WeightUse::Other,
                    };
                    *slot = match (*slot, this) {
                        (WeightUse::Unread, t) => t,
                        (a, b) if a == b => a,
                        _ => WeightUse::Other,
                    };
                }
            }
        }
        uses
    }
    /// Bytes of the weights of one group.
    pub fn group_bytes(&self, group: WeightGroup) -> u64 {
        self.weights
            .iter()
            .filter(|w| w.group == group)
            .map(|w| w.offset + w.bytes)
            .max()
            .unwrap_or(0)
    }
}

/// How the nodes of a plan read one weight ([`PlanBody::weight_uses`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightUse {
    /// No node reads it.
    Unread,
    /// Only `Linear` nodes read it, all as the matrix `[n, k]` (out features, in features) that is its shape.
    Linear {
        /// Output features (rows of the weight).
        n: u32,
        /// Input features (columns).
        k: u32,
    },
    /// Only `HcRead` nodes read it, as their `up` weight `[hc * dim, rank]` (the hyper-connection read's gates).
    HcUp {
        /// Hyper-connections (C).
        hc: u32,
        /// Hidden size (D).
        dim: u32,
        /// Low rank (the gates' inputs).
        rank: u32,
    },
    /// Some other node reads it, or a `Linear` or `HcRead` reads it in another shape or role.
    Other,
}

/// The plan file header (checked before the body is trusted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanHeader {
    /// Format version ([`crate::FORMAT_VERSION`]).
    pub format_version: u32,
    /// SHA-256 (hex) of the canonical JSON of the resolved config.
    pub config_hash: String,
    /// SHA-256 (hex) of the kernel sources the plans were built from.
    pub kernel_source_hash: String,
    /// Target arch (`cpu`, `sm_90a`).
    pub arch: String,
    /// The compiler's version (crate version).
    pub compiler_version: String,
    /// SHA-256 (hex) of the encoded body.
    pub body_checksum: String,
}

/// A complete plan set.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanSet {
    /// The header.
    pub header: PlanHeader,
    /// The body.
    pub body: PlanBody,
}
