/* Kernel parameter structs, shared by the CUDA kernels (the .cu files of kernels/) and the Rust runtime.
 *
 * The Rust mirrors (`#[repr(C)]`) are generated from this file by kernels/build_bundle.rs (run by the build scripts
 * of the runtime and compiler crates), so this header is the single source of the ABI. It is written in a
 * restricted style that the generator parses: one `typedef struct Name {` ... `} Name;` per struct, one field per
 * line, field types `u64`, `u32`, `float` or an earlier struct, optionally a fixed array `[N]`. Pointers are device
 * addresses carried as `u64`; every u64 field comes before the 4-byte ones so no struct has inner padding.
 *
 * Conventions: activations are f32 (arena and io buffers), weights bf16, per-slot state f32 at
 * `slots + slot * slot_elems + offset` (element offsets of the plan's StatePiece.offset). Token and expert ids are
 * u32 bit patterns in 4-byte elements.
 */
#ifndef FLASHPLAN_PARAMS_H
#define FLASHPLAN_PARAMS_H

typedef unsigned long long u64;
typedef unsigned int u32;

#define FP_MAX_NGRAM 8
#define FP_MAX_PLE_HEADS 32
#define FP_MAX_LINEARS 4

/* One stream of the device round descriptor (mirror of RoundDesc's StreamDesc). 48 bytes. */
typedef struct FpStream {
    u64 seed;
    u32 slot;
    u32 pos;
    u32 rows;
    u32 committed;
    u32 src_row;
    float temperature;
    u32 top_k;
    float top_p;
    float min_p;
    u32 pad;
} FpStream;

/* What every kernel gets: the descriptor (streams, then tokens), the slot state base and a scratch area. */
typedef struct FpCommon {
    u64 streams;
    u64 tokens;
    u64 slots;
    u64 scratch;
    u64 slot_elems;
    u32 nstreams;
    u32 window;
} FpCommon;

/* embed_streams, embed: out[(r*copies + c)*dim + d] = table[tok[r]*dim + d]. */
typedef struct FpEmbed {
    FpCommon c;
    u64 table;
    u64 out;
    u32 dim;
    u32 copies;
} FpEmbed;

typedef struct FpGatherRows {
    FpCommon c;
    u64 src;
    u64 out;
    u32 width;
    u32 pad;
} FpGatherRows;

typedef struct FpLastRows {
    FpCommon c;
    u64 x;
    u64 out;
    u32 width;
    u32 pad;
} FpLastRows;

/* w = 0: no weight. */
typedef struct FpRmsNorm {
    FpCommon c;
    u64 x;
    u64 w;
    u64 out;
    u32 dim;
    u32 group;
    float eps;
    u32 pad;
} FpRmsNorm;

/* Bytes of one MXFP8 weight tile of linear_mxfp8 (runtime/src/cuda/weights.rs `tile_mxfp8`): 16 features x 32 codes,
 * then their 16 scale bytes. */
#define MX_TILE_BYTES 528

/* M-tiles of 16 features a warp takes in the BF16 linear's tiles of 8 and 16 rows and in the one-row deep linears
 * (linear.cu `linear_t8`, `linear_t16`, `linear_t1_deep`, their `linear_multi` twins, and mxfp8.cu
 * `linear_mxfp8_t1_deep`; the launch's blocks hold as many times the features: runtime/src/cuda/launch/linear.rs
 * `tc_mtiles`). The other tiles, and the other MXFP8 linears, take one. */
#define LINEAR_MTILES 2

/* gathered != 0: x holds one row per stream (rows with streams[s].rows > 0). split: slices of K per output group
 * (1, 2, 4 or 8; 0 means 1), see `slice_dots` in common.cuh. linear_mxfp8 (mxfp8.cu) takes the same parameters, w
 * then being the weight's MXFP8 tiles (runtime/src/cuda/weights.rs `tile_mxfp8`). */
typedef struct FpLinear {
    FpCommon c;
    u64 x;
    u64 w;
    u64 out;
    u32 k;
    u32 n;
    u32 sub;
    u32 accumulate;
    u32 gathered;
    u32 split;
} FpLinear;

/* linear_multi (linear.cu): up to FP_MAX_LINEARS `linear`s of one launch that read the same x (same k, sub,
 * gathered and split), matrix m with weight w[m], output out[m], n[m] features and accumulate[m]. Its blocks come
 * first in m's order: blocks[m] of them (m's own `linear` grid), then m + 1's. count: matrices used (1 ..
 * FP_MAX_LINEARS). Every output element gets the arithmetic of its own `linear` launch: bit-identical. */
typedef struct FpLinearMulti {
    FpCommon c;
    u64 x;
    u64 w[FP_MAX_LINEARS];
    u64 out[FP_MAX_LINEARS];
    u32 n[FP_MAX_LINEARS];
    u32 accumulate[FP_MAX_LINEARS];
    u32 blocks[FP_MAX_LINEARS];
    u32 k;
    u32 sub;
    u32 gathered;
    u32 split;
    u32 count;
    u32 pad;
} FpLinearMulti;

/* add_broadcast: out = a + b broadcast over the width / b_width groups of a row. add_broadcast_norm also writes the
   hc_norm of each group (the hc_read that follows, norm weights at `norm` and its eps) into the scratch. */
typedef struct FpAddBroadcast {
    FpCommon c;
    u64 a;
    u64 b;
    u64 out;
    u32 width;
    u32 b_width;
    u64 norm;
    float eps;
    u32 pad;
} FpAddBroadcast;

/* inject = 0: no inject weights (inj is then unused). */
typedef struct FpHcRead {
    FpCommon c;
    u64 h;
    u64 norm;
    u64 down;
    u64 up;
    u64 inject;
    u64 inj;
    u64 out;
    u32 dim;
    u32 hc;
    u32 rank;
    u32 gathered;
    float eps;
    u32 split; /* slices of K (rank) of hc_mix_tc: runtime/src/cuda/launch/hc.rs `hc_mix_slices(hc * dim)` */
    u64 barrier; /* hc_read_one only: the node's u32 counter in device memory (its grid barrier); else 0 */
} FpHcRead;

typedef struct FpHcWrite {
    FpCommon c;
    u64 h;
    u64 y;
    u64 inj;
    u32 dim;
    u32 hc;
    u64 norm;
    float eps;
    u32 pad;
} FpHcWrite;

typedef struct FpPleEmbed {
    FpCommon c;
    u64 table;
    u64 out;
    u64 history;
    u64 mult[FP_MAX_NGRAM];
    u64 sizes[FP_MAX_PLE_HEADS];
    u64 offsets[FP_MAX_PLE_HEADS];
    u32 heads;
    u32 head_dim;
    u32 ngram;
    u32 heads_per_ngram;
    u32 eos;
    u32 pad;
} FpPleEmbed;

typedef struct FpPleMix {
    FpCommon c;
    u64 h;
    u64 key;
    u64 value;
    u64 norm_key;
    u64 norm_query;
    u64 norm_conv;
    u64 conv_w;
    u64 stash;
    u64 tail;
    u32 dim;
    u32 hc;
    u32 kernel;
    u32 dilation;
    float eps;
    u32 pad;
} FpPleMix;

/* keep = 0: all real rows; else keep[s] (u32) counted on the device. history, tail: state element offsets. */
typedef struct FpPleCommit {
    FpCommon c;
    u64 stash;
    u64 keep;
    u64 history;
    u64 tail;
    u32 width;
    u32 hist_len;
    u32 tail_len;
    u32 pad;
} FpPleCommit;

typedef struct FpGdnConv {
    FpCommon c;
    u64 x;
    u64 w;
    u64 out;
    u64 state;
    u32 channels;
    u32 kernel;
} FpGdnConv;

typedef struct FpGdnRecur {
    FpCommon c;
    u64 qkv;
    u64 b;
    u64 a;
    u64 a_log;
    u64 dt_bias;
    u64 out;
    u64 stash;
    u64 state;
    u32 hk;
    u32 hv;
    u32 dk;
    u32 dv;
} FpGdnRecur;

typedef struct FpGdnCommit {
    FpCommon c;
    u64 stash;
    u64 raw;
    u64 keep;
    u64 state;
    u64 conv;
    u32 hk;
    u32 hv;
    u32 dk;
    u32 dv;
    u32 channels;
    u32 kernel;
} FpGdnCommit;

/* act: 0 sigmoid, 1 silu. */
typedef struct FpGatedNorm {
    FpCommon c;
    u64 x;
    u64 z;
    u64 w;
    u64 out;
    u32 heads;
    u32 dim;
    u32 act;
    float eps;
} FpGatedNorm;

/* rope: f32 inv_freq table of rot_half values; k_cache, v_cache: state element offsets. */
typedef struct FpAttnPrep {
    FpCommon c;
    u64 q_raw;
    u64 k_raw;
    u64 v_raw;
    u64 q_norm;
    u64 k_norm;
    u64 q;
    u64 gate;
    u64 rope;
    u64 k_cache;
    u64 v_cache;
    u32 heads;
    u32 kv_heads;
    u32 hd;
    u32 rot_half;
    float attn_factor;
    float eps;
} FpAttnPrep;

typedef struct FpIndexerPrep {
    FpCommon c;
    u64 qk;
    u64 q_norm;
    u64 q_out;
    u64 rope;
    u64 raw_keys;
    u32 ih;
    u32 id;
    u32 rot_half;
    float attn_factor;
    float eps;
    u32 pad;
} FpIndexerPrep;

/* attn_prep and indexer_prep of one layer in one launch (attn_index_prep). */
typedef struct FpAttnIndexPrep {
    FpAttnPrep attn;
    FpIndexerPrep index;
} FpAttnIndexPrep;

/* Scratch: scores [rows, 2 * nb_max] f32 (indexer_score writes the first nb_max of each row). */
typedef struct FpIndexerSelect {
    FpCommon c;
    u64 q;
    u64 k_norm;
    u64 sel;
    u64 rope;
    u64 raw_keys;
    u64 pooled;
    u32 ih;
    u32 id;
    u32 rot_half;
    u32 ratio;
    u32 topk;
    u32 nb_max;
    float attn_factor;
    float eps;
} FpIndexerSelect;

/* Scratch: per-chunk partials [rows, heads, ceil(max_tokens / 32), 2 + hd] f32 (max, exp-sum, weighted values). */
typedef struct FpSparseAttn {
    FpCommon c;
    u64 q;
    u64 gate;
    u64 sel;
    u64 out;
    u64 k_cache;
    u64 v_cache;
    u32 heads;
    u32 kv_heads;
    u32 hd;
    u32 ratio;
    u32 topk;
    u32 max_tokens;
} FpSparseAttn;

typedef struct FpIndexerCommit {
    FpCommon c;
    u64 k_norm;
    u64 keep;
    u64 rope;
    u64 raw_keys;
    u64 pooled;
    u32 id;
    u32 rot_half;
    u32 ratio;
    float attn_factor;
    float eps;
    u32 pad;
} FpIndexerCommit;

/* Router. done: 0 when router_topk follows as its own launch; else the node's own u32 counter in device memory
 * (zero between launches): the logits launch's last block does the top-k of every row and resets it. */
typedef struct FpRouter {
    FpCommon c;
    u64 x;
    u64 gate;
    u64 ids;
    u64 weights;
    u64 done;
    u32 experts;
    u32 topk;
    u32 dim;
    u32 norm;
} FpRouter;

/* Scratch: hidden activations [rows, topk * inter] f32 (experts_one: its rank sums [topk, dim], then hid
   [topk, inter]). shared: 0, or the shared expert of the same rows run on the side branch
   (FpSharedExpert.keep_dots): its gates sg[rows] then its down dots [rows, dim] f32, which experts_down (or
   experts_combine) adds: out = fmaf(sg, dot, routed), as shared_expert_down does in place otherwise. */
typedef struct FpExperts {
    FpCommon c;
    u64 x;
    u64 ids;
    u64 weights;
    u64 gate_up;
    u64 down;
    u64 out;
    u32 topk;
    u32 dim;
    u32 inter;
    u32 pad;
    u64 shared;
    u64 barrier; /* experts_one: the node's counters, one u32 per rank */
} FpExperts;

/* Scratch: hidden activations [rows, inter] f32, then sg [rows]. keep_dots: 0, shared_expert_down adds to out; 1,
   it leaves its down dots [rows, dim] in the scratch after sg (the side branch: experts_down adds them,
   FpExperts.shared). */
typedef struct FpSharedExpert {
    FpCommon c;
    u64 x;
    u64 gate;
    u64 up;
    u64 down;
    u64 scale;
    u64 out;
    u32 dim;
    u32 inter;
    u32 keep_dots;
    u32 pad;
} FpSharedExpert;

/* mode: 0 every real row, 1 each stream's last real row, 2 gathered MTP rows (one per stream). probs: 0 for none (the
   main model's rounds: the plan's Sample has no probabilities buffer). */
typedef struct FpSample {
    FpCommon c;
    u64 logits;
    u64 tokens;
    u64 probs;
    u32 mode;
    u32 vocab;
} FpSample;

typedef struct FpKeepCount {
    FpCommon c;
    u64 sampled;
    u64 keep;
} FpKeepCount;

/* read_floor (benchmarks only): reads bytes from src once; stores to out only if the fold of what it read equals never. */
typedef struct FpReadFloor {
    u64 src;
    u64 bytes;
    u64 out;
    u32 never;
    u32 pad;
} FpReadFloor;

/* l2_prefetch: brings up to L2_PREFETCH_RANGES byte ranges (16-byte aligned starts; each length rounded down to a
   multiple of 16) into L2 with bulk prefetches of at most L2_PREFETCH_CHUNK bytes; reads nothing into registers,
   writes nothing. */
#define L2_PREFETCH_RANGES 12
#define L2_PREFETCH_CHUNK 65536
typedef struct FpL2Prefetch {
    u64 ptr[L2_PREFETCH_RANGES];
    u64 bytes[L2_PREFETCH_RANGES];
    u32 n;
    u32 pad;
} FpL2Prefetch;

#endif
