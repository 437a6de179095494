//! The CUDA backend's environment switches (`FLASHPLAN_PDL`, `FLASHPLAN_FUSE_LINEAR`, `FLASHPLAN_FUSE_SMALL`):
//! `1` or `0`, anything else refused by name.

use crate::backend::BackendError;

/// A `1`/`0` switch of the CUDA backend read from the environment (`default` when unset;
/// [`flashplan_plan::env::switch`]).
///
/// # Errors
/// Any other value: [`BackendError::Setting`] naming the variable, what `1` does and the accepted values.
fn switch_setting(name: &str, what: &str, default: bool) -> Result<bool, BackendError> {
    let on = flashplan_plan::env::switch(name).map_err(|e| {
        let (on, off) = if default {
            (", the default", "")
        } else {
            ("", ", the default")
        };
        BackendError::Setting(format!(
            "environment variable {name}={:?} is not accepted: expected 1 ({what}{on}) or 0 (off{off})",
            e.value
        ))
    })?;
    Ok(on.unwrap_or(default))
}

/// `FLASHPLAN_PDL`: `1` (default) launches every kernel as a programmatic dependent launch, `0` as a plain launch (the
/// results are the same). Each kernel waits for the previous one before it lets the next be scheduled
/// (kernels/common.cuh `pdl_start`), so the next kernel's blocks take the SM slots the current one leaves free and
/// start the moment it completes. On the H200 it was neutral while the large launches ran in several waves (fourth
/// session: 1125 against 1133 us); with the one- and two-row grids in one wave (`launch::linear::one_wave`) it pays in
/// one A/B run: lone-w1 927 -> 901 us, lone-w2 1101 -> 1084 us, lone-w4 unchanged, but lone-w8 1769 -> 1795-1801 us
/// (docs/benchmarks.md, tenth session).
pub(super) fn pdl_setting() -> Result<bool, BackendError> {
    switch_setting("FLASHPLAN_PDL", "programmatic dependent launches", true)
}

/// `FLASHPLAN_FUSE_LINEAR`: `1` (default) launches each run of consecutive sibling BF16 linears (same input) as one
/// `linear_multi` (`fuse.rs`), `0` launches every node on its own (for comparison; the results are the same bits).
pub(super) fn fuse_linear_setting() -> Result<bool, BackendError> {
    switch_setting("FLASHPLAN_FUSE_LINEAR", "fuse sibling linears", true)
}

/// `FLASHPLAN_FUSE_SMALL`: `1` (default) launches the router as one kernel up to 8 rows (the logits launch's last
/// block does the top-k), a hyper-connection read's `hc_norm` inside the `hc_write` or `add_broadcast` before it
/// (`launch::hc::fuse_hc_norm`), the rest of the read up to 4 rows as one grid-barrier kernel (`hc_read_one_t*`) and
/// beyond 4 rows lo's BF16 terms inside the down's launch (`hc_read_t4_wide_terms`, no `hc_mix_split`), one
/// row's routed experts as one kernel with a barrier per rank (`experts_one`, then `experts_combine`), an `embed`
/// or `gather_rows` inside the `rms_norm` after it (`launch::rows::fuse_row_norms`), and an attention layer's
/// `attn_prep` and `indexer_prep` as one `attn_index_prep` (`launch::attn::fuse_preps`); `0` launches router_topk,
/// hc_norm, hc_read, hc_mix_split, hc_mix_tc, experts, experts_down, embed, gather_rows, attn_prep, indexer_prep and
/// the plain hc_write, add_broadcast and rms_norm on their own (for comparison; the results are the same bits, which
/// `tests/gpu.rs` checks).
pub(super) fn fuse_small_setting() -> Result<bool, BackendError> {
    switch_setting("FLASHPLAN_FUSE_SMALL", "fewer launches for small ops", true)
}

/// Checks the CUDA backend's environment switches (`FLASHPLAN_PDL`, `FLASHPLAN_FUSE_LINEAR`,
/// `FLASHPLAN_FUSE_SMALL`) without a GPU, so a misspelt value refuses to start whichever backend runs.
///
/// # Errors
/// [`BackendError::Setting`] naming the first variable with a value other than `1` or `0`.
pub fn check_env() -> Result<(), BackendError> {
    pdl_setting()?;
    fuse_linear_setting()?;
    fuse_small_setting().map(|_| ())
}
