//! Row-wise ops (kernels/rows.cu, kernels/norm.cu): embeddings, row gathers, RMS norm and broadcast adds; and the
//! benchmarks' `read_floor`.

use super::*;

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
