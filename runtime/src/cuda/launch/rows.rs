//! Row-wise ops (kernels/rows.cu, kernels/norm.cu): embeddings, row gathers, RMS norm and broadcast adds; and the
//! benchmarks' `read_floor`.

use super::*;

/// The `AddBroadcast` node's launch: `add_broadcast` (block of 1024 threads per row), or with `norm` = (the next
/// hc_read's `hc_norm` weight address, its eps) `add_broadcast_norm` (kernels/norm.cu: block of 256 threads per (row,
/// group of `b_width`)), which also writes that read's Hn into the scratch (`hc::fuse_hc_norm`).
pub(super) fn add_broadcast_spec(
    a: &Addrs,
    v: &Variant,
    op: &Op,
    norm: Option<(u64, f32)>,
) -> Result<LaunchSpec, BackendError> {
    let Op::AddBroadcast {
        a: x,
        b,
        out,
        width,
        b_width,
    } = op
    else {
        return Err(wrong_op("add_broadcast", op));
    };
    let rows = out_rows(v);
    let p = FpAddBroadcast {
        c: a.common,
        a: a.buf(v, *x),
        b: a.buf(v, *b),
        out: a.buf(v, *out),
        width: *width,
        b_width: *b_width,
        norm: norm.map_or(0, |n| n.0),
        eps: norm.map_or(0.0, |n| n.1),
        pad: 0,
    };
    Ok(match norm {
        Some(_) => one(
            "add_broadcast_norm",
            bytes(&p),
            rows * (*width / (*b_width).max(1)),
            256,
        ),
        // A block of 1024 threads: a row of the MTP's 4 x 2560 streams is 10 values a thread, one batch of loads
        // (`block_store_row`) instead of three; elementwise, so the block size never changes a value.
        None => one("add_broadcast", bytes(&p), rows, 1024),
    })
}

/// `FLASHPLAN_FUSE_SMALL`: an `Embed` or `GatherRows` followed by the `RmsNorm` of its output (the MTP step's token
/// embedding and input streams), where no later node reads the copy (or the norm writes over it), becomes one launch
/// at the norm's node: `rms_norm_embed` reading the rows from the embedding table, `rms_norm_gather` from the
/// gathered io buffer (kernels/norm.cu `rms_norm_t`). The copy's own node then has no launch. The norm sees the
/// values the copy would have written, so the results are the same bits.
pub(super) fn fuse_row_norms(
    a: &Addrs,
    v: &Variant,
    out: &mut [Option<LaunchSpec>],
) -> Result<(), BackendError> {
    for i in 0..v.nodes.len().saturating_sub(1) {
        let (copy, norm) = (&v.nodes[i].op, &v.nodes[i + 1].op);
        let Op::RmsNorm { x, dim, out: y, .. } = norm else {
            continue;
        };
        let (kernel, copied, src) = match copy {
            Op::Embed {
                table, out, dim: d, ..
            } if d == dim => ("rms_norm_embed", *out, a.w(*table)?),
            Op::GatherRows { src, out, width } if width == dim => {
                ("rms_norm_gather", *out, gather_src(a, v, *src))
            }
            _ => continue,
        };
        // The copy must be the norm's input, in the arena (an io buffer outlives the variant), and read by no later
        // node, unless the norm wrote over it (in place: they read the norm's rows); a gather's norm must not write
        // where the gather reads.
        let read_later = *y != copied
            && v.nodes[i + 2..]
                .iter()
                .any(|n| n.op.reads().contains(&copied));
        let gather_src_hit = match copy {
            Op::GatherRows { src, .. } => fuse::overlap(v, *y, *src),
            _ => false,
        };
        if copied != *x
            || v.buf(copied).space != Space::Arena
            || read_later
            || gather_src_hit
            || out[i].is_none()
            || out[i + 1].is_none()
        {
            continue;
        }
        let mut p = rms_norm_params(a, v, norm)?;
        p.x = src;
        out[i] = None;
        out[i + 1] = Some(one(
            kernel,
            bytes(&p),
            out_rows(v),
            rms_norm_threads(p.group),
        ));
    }
    Ok(())
}

/// Rows of a row-wise launch: every row of the variant.
fn out_rows(v: &Variant) -> u32 {
    let (streams, window) = v.kind.shape();
    streams * window
}

/// The address `gather_rows` reads its source at: the whole io buffer (the previous variant's output), or an arena
/// buffer.
fn gather_src(a: &Addrs, v: &Variant, src: flashplan_plan::BufId) -> u64 {
    match v.buf(src).space {
        Space::Io(io) => (a.io)(io),
        Space::Arena => a.buf(v, src),
    }
}

/// Threads of an `rms_norm` block (one block a row) for groups of `group` values: enough that a thread holds at
/// most `ROW_U` (16, kernels/common.cuh) of a group, so its loads are one batch, from 256 to 1024. It depends on the
/// node's shape alone, so every row count, and the fused `rms_norm_embed` / `rms_norm_gather`, sum in the same order.
/// H200: the MTP step's norm of its 10240 input-stream values (`rms_norm_gather`) took 5.8 us at 256 threads,
/// 4.9-5.0 us at 1024.
pub(super) fn rms_norm_threads(group: u32) -> u32 {
    group.div_ceil(16).next_power_of_two().clamp(256, 1024)
}

/// An `RmsNorm` node's parameters (kernels/norm.cu `rms_norm_t`).
fn rms_norm_params(a: &Addrs, v: &Variant, op: &Op) -> Result<FpRmsNorm, BackendError> {
    let Op::RmsNorm {
        x,
        w,
        out,
        dim,
        group,
        eps,
    } = op
    else {
        return Err(wrong_op("rms_norm", op));
    };
    Ok(FpRmsNorm {
        c: a.common,
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
    })
}

/// Parameters and launch of a row-wise node (`EmbedStreams`, `Embed`, `GatherRows`, `LastRows`, `RmsNorm`,
/// `AddBroadcast`).
pub(super) fn spec(a: &Addrs, v: &Variant, op: &Op) -> Result<LaunchSpec, BackendError> {
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let c = a.common;
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
            let p = FpGatherRows {
                c,
                src: gather_src(a, v, *src),
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
        Op::RmsNorm { .. } => {
            let p = rms_norm_params(a, v, op)?;
            one("rms_norm", bytes(&p), rows, rms_norm_threads(p.group))
        }
        Op::AddBroadcast { .. } => add_broadcast_spec(a, v, op, None)?,
        _ => return Err(wrong_op("rows", op)),
    })
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
