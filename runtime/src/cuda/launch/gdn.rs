//! Gated DeltaNet layers (kernels/gdn.cu, kernels/norm.cu): the causal conv, the recurrence, the commit of the kept
//! rows' state, and the gated norm.

use flashplan_plan::GateAct;

use super::*;

/// Whether node `op` of variant `v` is a `GdnCommit` whose work its layer's `gdn_conv` and `gdn_recur` already did:
/// in a window of one row the row is always kept (`keep_count`: keep = rows, 0 or 1), so those kernels commit it
/// themselves (kernels/gdn.cu) and the commit launch is left out of the graph. The state is the same bits:
/// `gdn_recur` writes the state its own update produced, the update `gdn_commit` would have replayed.
pub(super) fn commit_in_window_one(v: &Variant, op: &Op) -> bool {
    matches!(op, Op::GdnCommit { .. }) && v.kind.shape().1 == 1
}

/// Parameters and launch of a Gated DeltaNet node (`GdnConv`, `GdnRecur`, `GdnCommit`, `GatedNorm`).
pub(super) fn spec(a: &Addrs, v: &Variant, op: &Op) -> Result<LaunchSpec, BackendError> {
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let c = a.common;
    Ok(match op {
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
            // Thread per (stream, channel): channels over x, streams over y.
            LaunchSpec::new(
                "gdn_conv",
                bytes(&p),
                (channels.div_ceil(128), streams, 1),
                128,
            )
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
        _ => return Err(wrong_op("gdn", op)),
    })
}
