//! Gated DeltaNet layers (kernels/gdn.cu, kernels/norm.cu): the causal conv, the recurrence, the commit of the kept
//! rows' state, and the gated norm.

use flashplan_plan::GateAct;

use super::*;

/// Whether node `op` of variant `v` is a `GdnCommit` whose work its layer's `gdn_conv` and `gdn_recur_one` already did:
/// in a window of one row the row is always kept (`keep_count`: keep = rows, 0 or 1), so those kernels commit it
/// themselves (kernels/gdn.cu) and the commit launch is left out of the graph. The state is the same bits:
/// `gdn_recur_one` writes the state its own update produced, the update `gdn_commit` would have replayed.
pub(super) fn commit_in_window_one(v: &Variant, op: &Op) -> bool {
    matches!(op, Op::GdnCommit { .. }) && v.kind.shape().1 == 1
}

/// The recurrent state's kernels (`gdn_recur`, `gdn_recur_one`, `gdn_commit`) hold a lane's quarter of a column in
/// registers (at most 128 / 4 rows) and read it as float4 runs of the device layout (kernels/gdn.cu,
/// [`crate::cuda::gdn_layout`]): dk at most 128, a multiple of 4, and at most 32 or a multiple of 32; dv at most 1024.
///
/// # Errors
/// [`BackendError::Device`] naming the kernel and the dimension for any other dk or dv.
pub(super) fn check_state_dims(kernel: &str, dk: u32, dv: u32) -> Result<(), BackendError> {
    let dk_ok = dk <= 128 && dk.is_multiple_of(4) && (dk <= 32 || dk.is_multiple_of(32));
    if !dk_ok || dv > 1024 {
        return Err(BackendError::Device(format!(
            "{kernel}: linear_key_head_dim {dk} and linear_value_head_dim {dv} are not supported \
             (expected a key head dim that is a multiple of 4 and at most 32, or 64, 96 or 128, \
             and a value head dim of at most 1024)"
        )));
    }
    Ok(())
}

/// Grid of the recurrent state's kernels: blocks of 32 columns over x, value heads over y, streams over z, so a
/// head's column tiles are next to each other in launch order.
fn state_grid(hv: u32, streams: u32, dv: u32) -> (u32, u32, u32) {
    (dv.div_ceil(32), hv, streams)
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
            check_state_dims("gdn_recur", *dk, *dv)?;
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
            // Windows of one row run the one-row update without the chunk staging (the same bits).
            let kernel = if window == 1 {
                "gdn_recur_one"
            } else {
                "gdn_recur"
            };
            LaunchSpec::new(kernel, bytes(&p), state_grid(*hv, streams, *dv), 128)
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
            check_state_dims("gdn_commit", *dk, *dv)?;
            LaunchSpec::new("gdn_commit", bytes(&p), state_grid(*hv, streams, *dv), 128)
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
