//! Sparse attention layers (kernels/attn.cu): q/k/v preparation with RoPE into the caches, the indexer's scores and
//! block selection, the attention over the selected blocks, and the commit of the pooled keys.

use super::*;

/// Tokens per chunk of `sparse_attn` (`SA_CHUNK` in `kernels/attn.cu`).
pub(super) const SA_CHUNK: u32 = 32;

/// The `sparse_attn` entry point for `g` query heads per kv head (1..=16) in a round of `streams` streams: the one
/// whose head loops run to the smallest bound of 4, 8, 12 or 16 that holds them (kernels/attn.cu `sparse_attn_g`;
/// the same arithmetic at any bound, fewer instructions at the tightest), and for several streams up to 12 heads
/// the form that stages the chunk's values in shared memory (`sparse_attn_g4v` .. `_g12v`: the same bits). H200,
/// sparse attention's node: 16 streams 102.4 -> 96.9 us staged; one row 17.1 -> 17.7 us and a window of 16 rows of
/// one stream 94.5 -> 95.2 us, so a lone stream keeps the unstaged form. Exactly 12 heads (the real config) take
/// `sparse_attn_g12e` at every stream count: its head loops' bounds are constants and its whole batches of P.V run
/// without bounds checks (the same bits). H200 (2026-12-03), the node: one row 15.5 -> 12.4 us, a window of 16 rows
/// 94.8 -> 76.1 us, 16 streams 97.3-97.6 -> 81.6-81.7 us (87.2-87.5 with the values staged).
pub(super) fn sparse_attn_entry(g: u32, streams: u32) -> &'static str {
    let staged = streams > 1;
    match g {
        12 => "sparse_attn_g12e",
        0..=4 if staged => "sparse_attn_g4v",
        0..=4 => "sparse_attn_g4",
        5..=8 if staged => "sparse_attn_g8v",
        5..=8 => "sparse_attn_g8",
        9..=12 if staged => "sparse_attn_g12v",
        9..=12 => "sparse_attn_g12",
        _ => "sparse_attn_g16",
    }
}

/// The `sparse_attn_combine` entry point for `blocks` blocks (rows x heads) on `sms` SMs (0: unknown):
/// `sparse_attn_combine_pre`, which keeps every load in flight at once at one block an SM (255 registers), when the
/// blocks fit one wave of it, else `sparse_attn_combine` (42 registers, many blocks an SM). The same bits either way.
/// H200, sparse attention's node: one row 17.1 -> 15.5 us with `_pre`; 16 streams 102.4 -> 103.9 us.
pub(super) fn sparse_attn_combine_entry(blocks: u32, sms: u32) -> &'static str {
    if sms > 0 && blocks <= sms {
        "sparse_attn_combine_pre"
    } else {
        "sparse_attn_combine"
    }
}

/// Parameters and launches of a sparse-attention node (`AttnPrep`, `IndexerPrep`, `IndexerSelect`, `SparseAttn`,
/// `IndexerCommit`).
pub(super) fn spec(a: &Addrs, v: &Variant, op: &Op) -> Result<LaunchSpec, BackendError> {
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let c = a.common;
    let half = a.rope_cfg.inv_freq.len() as u32;
    let af = a.rope_cfg.attention_factor;
    Ok(match op {
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
            if *id > 512 {
                return Err(BackendError::Device(format!(
                    "indexer_prep: head dim {id} (at most 512) is not supported"
                )));
            }
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
            LaunchSpec::new(
                sparse_attn_entry(g, streams),
                bytes(&p),
                (rows, *kv_heads, nsplit),
                256,
            )
            .then(
                sparse_attn_combine_entry(rows * heads, a.sms),
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
        _ => return Err(wrong_op("attn", op)),
    })
}

// The fused prep's parameters are the two launches' own, one after the other (no padding between them).
const _: () = assert!(
    std::mem::size_of::<FpAttnIndexPrep>()
        == std::mem::size_of::<FpAttnPrep>() + std::mem::size_of::<FpIndexerPrep>()
);

/// With `FLASHPLAN_FUSE_SMALL`: an `AttnPrep` node directly followed by an `IndexerPrep` node launches both as one
/// `attn_index_prep` (kernels/attn.cu): the attention prep's grid with one more grid row of y, which takes the
/// indexer's rows; the `IndexerPrep` node has no launch of its own. Only where neither writes what the other reads
/// or writes (the plan's buffers by their element ranges, the state pieces by id) and neither spec forks or joins a
/// branch. The same work per block, so the same values; one launch fewer an attention layer.
pub(super) fn fuse_preps(v: &Variant, out: &mut [Option<LaunchSpec>]) {
    for i in 0..v.nodes.len().saturating_sub(1) {
        let (
            Op::AttnPrep {
                q_raw,
                k_raw,
                v_raw,
                q,
                gate,
                k_cache,
                v_cache,
                ..
            },
            Op::IndexerPrep {
                qk,
                q_out,
                raw_keys,
                ..
            },
        ) = (&v.nodes[i].op, &v.nodes[i + 1].op)
        else {
            continue;
        };
        let (Some(ap), Some(ip)) = (&out[i], &out[i + 1]) else {
            continue;
        };
        let ov = |a: &[BufId], b: &[BufId]| {
            a.iter()
                .any(|&x| b.iter().any(|&y| crate::cuda::fuse::overlap(v, x, y)))
        };
        let disjoint = !ov(&[*q, *gate], &[*qk, *q_out])
            && !ov(&[*q_out], &[*q_raw, *k_raw, *v_raw])
            && raw_keys != k_cache
            && raw_keys != v_cache;
        let plain = |s: &LaunchSpec| {
            s.then.is_empty()
                && s.side.is_empty()
                && s.prefetch.is_empty()
                && s.join_before.is_none()
        };
        if !disjoint || !plain(ap) || !plain(ip) || ap.grid.0 != ip.grid.0 || ap.block != ip.block {
            continue;
        }
        let mut params = ap.params.clone();
        params.extend_from_slice(&ip.params);
        let grid = (ap.grid.0, ap.grid.1 + 1, 1);
        out[i] = Some(LaunchSpec::new("attn_index_prep", params, grid, ap.block.0));
        out[i + 1] = None;
    }
}
