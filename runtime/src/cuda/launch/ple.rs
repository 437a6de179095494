//! Per-layer embeddings (kernels/ple.cu): the n-gram embedding, the mix into the residual streams and the commit of
//! the n-gram history and conv tail; the embedding and its projections on the graph's side branch.

use super::*;

/// The PLE prep of a variant: a `PleEmbed` at `i`, the `Linear` nodes right after it that read its output (the
/// key and value projections) up to `j`, and the `PleMix` at `m` that reads their outputs.
pub(super) struct PlePrep {
    pub i: usize,
    pub j: usize,
    pub m: usize,
    /// The embedding, then the projections' outputs, with their offsets (f32 elements) in the side arena.
    bufs: Vec<(BufId, u64)>,
    /// Side arena elements they take.
    elems: u64,
}

/// The variant's PLE preps ([`PlePrep`]), where the projections come before their `PleMix` with other nodes in
/// between (the compiler emits them before layer 0: compiler/src/graph.rs `ple_prep`).
pub(super) fn ple_preps(v: &Variant) -> Vec<PlePrep> {
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
pub(super) fn branch_ple_prep(
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
        let mut launches = vec![node_spec(&side, v, i, &v.nodes[i].op)?];
        let mut k = i + 1;
        while k < j {
            let end = (k + 1..j).find(|&e| out[e].is_some()).unwrap_or(j);
            launches.push(if end - k > 1 {
                let ops: Vec<&Op> = v.nodes[k..end].iter().map(|n| &n.op).collect();
                linear_multi(&side, v, &ops)?
            } else {
                node_spec(&side, v, k, &v.nodes[k].op)?
            });
            k = end;
        }
        let mut mix = node_spec(
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

/// Parameters and launches of a PLE node (`PleEmbed`, `PleMix`, `PleCommit`).
pub(super) fn spec(a: &Addrs, v: &Variant, op: &Op) -> Result<LaunchSpec, BackendError> {
    let (streams, window) = v.kind.shape();
    let rows = streams * window;
    let c = a.common;
    Ok(match op {
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
        _ => return Err(wrong_op("ple", op)),
    })
}
