//! Launch specs of the tiny plan: grids, fused launches, side branches and row splits. Some items of the family
//! modules are `pub(super)` only for these tests (the one-wave constants and shares, `linear_entry`, the PLE preps).

use super::hc::*;
use super::linear::*;
use super::moe::*;
use super::ple::*;
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
fn tiny_specs_side(fuse_small: bool, side_scratch: u64) -> Vec<(Variant, Vec<Option<LaunchSpec>>)> {
    specs_of(
        &crate::cuda::fuse::tests::tiny_plan(),
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
    specs_of_fused(body, fuse_small, side_scratch, sms, true)
}

/// [`specs_of`] with the sibling linears fused (`FLASHPLAN_FUSE_LINEAR`) or not.
fn specs_of_fused(
    body: &PlanBody,
    fuse_small: bool,
    side_scratch: u64,
    sms: u32,
    fuse_linears: bool,
) -> Vec<(Variant, Vec<Option<LaunchSpec>>)> {
    specs_with(body, fuse_small, side_scratch, sms, fuse_linears, false)
}

/// [`specs_of_fused`], with every weight held as MXFP8 when `mxfp8`.
fn specs_with(
    body: &PlanBody,
    fuse_small: bool,
    side_scratch: u64,
    sms: u32,
    fuse_linears: bool,
    mxfp8: bool,
) -> Vec<(Variant, Vec<Option<LaunchSpec>>)> {
    let weights: Vec<u64> = (0..body.weights.len() as u64)
        .map(|i| 0x1000_0000 + (i << 20))
        .collect();
    let held_mxfp8 = vec![mxfp8; weights.len()];
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
                mxfp8: &held_mxfp8,
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
                barrier_blocks: 3 * sms,
                experts_one_blocks: 4 * sms,
                side_scratch,
                side_arena: if side_scratch != 0 { SIDE_ARENA } else { 0 },
                prefetch_budget: prefetch_budget(v.kind),
                moved: &[],
            };
            (v.clone(), specs(&a, v, fuse_linears).expect("specs"))
        })
        .collect()
}

#[test]
fn on_one_sm_the_one_and_two_row_launches_take_one_wave_and_every_matrix_keeps_blocks() {
    let (mut seen, mut cut) = (0, 0);
    let plan = crate::cuda::fuse::tests::tiny_plan();
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
                side.kernel.starts_with("shared_expert_t") || side.kernel == "shared_expert_s4",
                "{}",
                side.kernel
            );
            assert!(side.side.is_empty() && side.join_before.is_none());
            let sh: FpSharedExpert = params_of(side);
            assert_eq!((sh.keep_dots, sh.c.scratch), (1, SIDE_SCRATCH));
            let experts = sp[i - 1].as_ref().expect("experts launched");
            assert_eq!(experts.join_before, Some(experts.then.len()));
            // The join comes before the launch that adds the shared expert: the down, or experts_combine at one row.
            let last = if rows == 1 {
                "experts_combine"
            } else {
                down_features(rows as u32).0
            };
            assert_eq!(experts.then.last().map(|t| t.0), Some(last));
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
    let body = crate::cuda::fuse::tests::tiny_plan_with(|json| {
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
fn an_attention_layers_two_preps_launch_as_one_with_both_parameters() {
    let mut fused = 0;
    for ((v, sp), (_, unfused)) in tiny_specs(true).into_iter().zip(tiny_specs(false)) {
        for (i, n) in v.nodes.iter().enumerate() {
            let Op::AttnPrep {
                heads, kv_heads, ..
            } = n.op
            else {
                continue;
            };
            assert!(
                matches!(v.nodes[i + 1].op, Op::IndexerPrep { .. }),
                "the indexer's prep follows"
            );
            let what = format!("{} node {i}", v.kind.name());
            // Without FLASHPLAN_FUSE_SMALL each has its own launch.
            let (ap, ip) = (
                unfused[i].as_ref().expect("attn_prep"),
                unfused[i + 1].as_ref().expect("indexer_prep"),
            );
            assert_eq!(
                (ap.kernel, ip.kernel),
                ("attn_prep", "indexer_prep"),
                "{what}"
            );
            fused += 1;
            let s = sp[i].as_ref().expect("a launch");
            assert_eq!(s.kernel, "attn_index_prep", "{what}");
            assert!(sp[i + 1].is_none(), "{what}: no indexer_prep launch");
            let rows = ap.grid.0;
            assert_eq!(
                s.grid,
                (rows, (heads + kv_heads).div_ceil(8) + 1, 1),
                "{what}: one more grid row"
            );
            assert_eq!((ip.grid.0, s.block), (rows, (256, 1, 1)), "{what}");
            assert_eq!(
                s.params,
                [ap.params.clone(), ip.params.clone()].concat(),
                "{what}: both parameters"
            );
        }
    }
    assert!(fused > 0, "attention layers in the tiny plan");
}

#[test]
fn preps_that_share_a_buffer_or_a_state_piece_keep_their_own_launches() {
    // The indexer's queries written over the attention's q, or its raw keys into the key cache: no fusion.
    let aliases: [fn(&mut Op, &Op); 2] = [
        |ip, ap| {
            if let (Op::IndexerPrep { q_out, .. }, Op::AttnPrep { q, .. }) = (ip, ap) {
                *q_out = *q;
            }
        },
        |ip, ap| {
            if let (Op::IndexerPrep { raw_keys, .. }, Op::AttnPrep { k_cache, .. }) = (ip, ap) {
                *raw_keys = *k_cache;
            }
        },
    ];
    for alias in aliases {
        let mut body = crate::cuda::fuse::tests::tiny_plan();
        let mut edited = 0;
        for v in &mut body.variants {
            for i in 0..v.nodes.len() - 1 {
                if matches!(v.nodes[i].op, Op::AttnPrep { .. }) {
                    let ap = v.nodes[i].op.clone();
                    alias(&mut v.nodes[i + 1].op, &ap);
                    edited += 1;
                }
            }
        }
        assert!(edited > 0);
        for (v, sp) in specs_of(&body, true, SIDE_SCRATCH, 132) {
            for (i, n) in v.nodes.iter().enumerate() {
                if matches!(n.op, Op::AttnPrep { .. }) {
                    let what = format!("{} node {i}", v.kind.name());
                    assert_eq!(
                        sp[i].as_ref().map(|s| s.kernel),
                        Some("attn_prep"),
                        "{what}"
                    );
                    assert_eq!(
                        sp[i + 1].as_ref().map(|s| s.kernel),
                        Some("indexer_prep"),
                        "{what}"
                    );
                }
            }
        }
    }
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
        let (mut fused, mut plain, mut added) = (0, 0, 0);
        for (v, sp) in tiny_specs(fuse_small) {
            for (i, n) in v.nodes.iter().enumerate() {
                let Op::HcRead { h, .. } = n.op else { continue };
                let read = sp[i].as_ref().expect("hc_read launched");
                // From two rows on, hc_mix_split comes before hc_mix_tc, but for the fused forms below.
                let (streams, window) = v.kind.shape();
                let nrows = if hc_read_gathered(&v, &n.op) {
                    streams
                } else {
                    streams * window
                };
                // With the switch, up to 4 rows: the read, the split and the mix are one launch, hc_read_one_t*;
                // beyond, the read's down (hc_read_t4_wide_terms) leaves the split terms itself.
                let one = fuse_small && nrows <= 4;
                let split_in_read = fuse_small && nrows > 4;
                let split = usize::from(nrows >= 2 && !one && !split_in_read);
                let down = if nrows > 4 {
                    if split_in_read {
                        "hc_read_t4_wide_terms"
                    } else {
                        "hc_read_t4_wide"
                    }
                } else {
                    "hc_read_t"
                };
                let down_launch = if read.kernel == "hc_norm" {
                    read.then.first().map_or("", |t| t.0)
                } else {
                    read.kernel
                };
                assert!(
                    one || down_launch == down || (nrows <= 4 && down_launch.starts_with(down)),
                    "{}: {down_launch}",
                    v.kind.name()
                );
                let last = read.then.last().map_or(read.kernel, |t| t.0);
                if one {
                    let want = match nrows {
                        1 => "hc_read_one_t1",
                        2 => "hc_read_one_t2",
                        _ => "hc_read_one_t4",
                    };
                    assert_eq!(last, want, "{}", v.kind.name());
                    let p: FpHcRead = params_of(read);
                    assert_eq!(
                        p.barrier,
                        0x5000_0000 + 4 * NODE_COUNTERS as u64 * i as u64,
                        "node {i}'s counters"
                    );
                } else {
                    assert!(last.starts_with("hc_mix_tc_t"), "{last}");
                    let p: FpHcRead = params_of(read);
                    assert_eq!(p.barrier, 0);
                }
                assert_eq!(
                    read.then.len() >= 2 && read.then[read.then.len() - 2].0 == "hc_mix_split",
                    split == 1
                );
                let mix = if one { 0 } else { 1 };
                // The writer before the read: an HcWrite, or an AddBroadcast (the MTP step's streams), of its h.
                let writer = match v.nodes[i.saturating_sub(1)].op {
                    _ if i == 0 || hc_read_gathered(&v, &n.op) => None,
                    Op::HcWrite { h: hw, .. } if hw == h => Some("hc_write_norm"),
                    Op::AddBroadcast { out, .. } if out == h => Some("add_broadcast_norm"),
                    _ => None,
                };
                if let (true, Some(want)) = (fuse_small, writer) {
                    fused += 1;
                    added += usize::from(want == "add_broadcast_norm");
                    let write = sp[i - 1].as_ref().expect("the writer launched");
                    assert_eq!(write.kernel, want, "{} node {}", v.kind.name(), i - 1);
                    // Block per (row, group) of 256 threads: hc_norm_group's tree, as hc_norm's.
                    let Op::HcRead { hc, .. } = n.op else {
                        unreachable!()
                    };
                    let (streams, window) = v.kind.shape();
                    assert_eq!(
                        write.grid,
                        (streams * window * hc, 1, 1),
                        "{}",
                        v.kind.name()
                    );
                    assert_eq!(write.block, (256, 1, 1), "{}", v.kind.name());
                    assert!(
                        read.kernel.starts_with("hc_read_t") || one,
                        "{}: {}",
                        v.kind.name(),
                        read.kernel
                    );
                    assert_eq!(read.launches(), 1 + mix + split);
                    // The fused writer carries the read's norm weight and eps.
                    let Op::HcRead { norm, eps, .. } = n.op else {
                        unreachable!()
                    };
                    let (p_norm, p_eps) = if want == "hc_write_norm" {
                        let p: FpHcWrite = params_of(write);
                        (p.norm, p.eps)
                    } else {
                        let p: FpAddBroadcast = params_of(write);
                        (p.norm, p.eps)
                    };
                    assert_eq!(p_norm, 0x1000_0000 + ((norm.0 as u64) << 20));
                    assert_eq!(p_eps, eps);
                } else {
                    assert_eq!(read.kernel, "hc_norm", "{} node {i}", v.kind.name());
                    assert_eq!(read.launches(), 2 + mix + split);
                }
            }
            // A write not followed by a read of its h (the last layer's, before the head's gathered read; a
            // layer followed by PLE) stays a plain hc_write, with or without the switch.
            // So does an AddBroadcast (add_broadcast).
            for (i, n) in v.nodes.iter().enumerate() {
                let (h, names) = match n.op {
                    Op::HcWrite { h, .. } => (h, ["hc_write_norm", "hc_write"]),
                    Op::AddBroadcast { out, .. } => (out, ["add_broadcast_norm", "add_broadcast"]),
                    _ => continue,
                };
                let read_next = v.nodes.get(i + 1).is_some_and(|r| {
                    matches!(r.op, Op::HcRead { h: hr, .. } if hr == h)
                        && !hc_read_gathered(&v, &r.op)
                });
                let kernel = sp[i].as_ref().expect("the writer launched").kernel;
                let want = names[usize::from(!(fuse_small && read_next))];
                assert_eq!(kernel, want, "{} node {i}", v.kind.name());
                plain += usize::from(kernel == "hc_write");
            }
        }
        assert_eq!(fused > 0, fuse_small);
        assert_eq!(added > 0, fuse_small, "MTP steps' add_broadcast_norm");
        assert!(
            plain > 0,
            "some writes are not followed by a read of their h"
        );
    }
}

#[test]
fn mtp_embedding_and_input_gather_run_inside_their_norms() {
    // With FLASHPLAN_FUSE_SMALL, the MTP step's Embed and GatherRows have no launch of their own: the RmsNorm after
    // each reads the table row or the gathered io row itself (`rms_norm_embed`, `rms_norm_gather`), with the norm's
    // own parameters but x; without the switch each runs as before.
    let (fused, plain) = (tiny_specs(true), tiny_specs(false));
    let mut seen = 0;
    for ((v, f), (_, p)) in fused.iter().zip(&plain) {
        for i in 0..v.nodes.len() - 1 {
            let (want, from) = match v.nodes[i].op {
                Op::Embed { .. } => ("rms_norm_embed", "embed"),
                Op::GatherRows { .. } => ("rms_norm_gather", "gather_rows"),
                _ => continue,
            };
            let what = format!("{} node {i}", v.kind.name());
            assert!(matches!(v.nodes[i + 1].op, Op::RmsNorm { .. }), "{what}");
            seen += 1;
            let (copy, norm) = (
                p[i].as_ref().expect("copy"),
                p[i + 1].as_ref().expect("norm"),
            );
            assert_eq!((copy.kernel, norm.kernel), (from, "rms_norm"), "{what}");
            assert!(f[i].is_none(), "{what}: the copy still launches");
            let fnorm = f[i + 1].as_ref().expect("fused norm");
            assert_eq!(
                (fnorm.kernel, fnorm.grid, fnorm.block),
                (want, norm.grid, norm.block),
                "{what}"
            );
            let (a, b): (FpRmsNorm, FpRmsNorm) = (params_of(fnorm), params_of(norm));
            // x: the copy's source instead of its output.
            let src = if want == "rms_norm_embed" {
                params_of::<FpEmbed>(copy).table
            } else {
                params_of::<FpGatherRows>(copy).src
            };
            assert_eq!(a.x, src, "{what}");
            assert_eq!(
                (a.w, a.out, a.dim, a.group, a.eps),
                (b.w, b.out, b.dim, b.group, b.eps),
                "{what}"
            );
        }
    }
    assert!(seen > 0, "no MTP variants");
}

#[test]
fn rms_norm_blocks_hold_a_group_in_one_batch_of_loads() {
    // At most 16 values a thread (ROW_U), 256 to 1024 threads: the MTP step's 10240 input-stream values take 1024
    // threads, a 2560-wide row 256.
    assert_eq!(super::rows::rms_norm_threads(10_240), 1024);
    assert_eq!(super::rows::rms_norm_threads(2560), 256);
    assert_eq!(super::rows::rms_norm_threads(4097), 512);
    assert_eq!(super::rows::rms_norm_threads(8), 256);
    assert_eq!(super::rows::rms_norm_threads(1 << 20), 1024);
    for group in [1, 100, 2560, 4096, 4097, 10_240, 16_384] {
        let t = super::rows::rms_norm_threads(group);
        assert!(
            t.is_multiple_of(32) && (256..=1024).contains(&t),
            "{group}: {t}"
        );
        assert!(group.div_ceil(t) <= 16 || t == 1024, "{group}: {t}");
    }
    // The launches take it from the node's group, fused or not: the tiny plan widened to a hidden size of 2048, whose
    // MTP input norm (4 streams: a group of 8192) takes 512 threads, its other norms 256.
    let body = wide_tiny_plan();
    let (plain, fused) = (
        specs_of(&body, false, SIDE_SCRATCH, 132),
        specs_of(&body, true, SIDE_SCRATCH, 132),
    );
    let mut seen = std::collections::BTreeSet::new();
    for ((v, plain), (_, fused)) in plain.iter().zip(&fused) {
        for (i, n) in v.nodes.iter().enumerate() {
            let Op::RmsNorm { group, .. } = n.op else {
                continue;
            };
            for s in [&plain[i], &fused[i]].into_iter().flatten() {
                assert_eq!(
                    s.block,
                    (super::rows::rms_norm_threads(group), 1, 1),
                    "{}",
                    s.kernel
                );
                seen.insert((s.kernel, group, s.block.0));
            }
        }
    }
    assert!(
        seen.contains(&("rms_norm", 8192, 512)) && seen.contains(&("rms_norm_gather", 8192, 512)),
        "the MTP input norm at 512 threads, fused and not: {seen:?}"
    );
    assert!(
        seen.iter().any(|&(_, g, t)| g == 2048 && t == 256),
        "{seen:?}"
    );
}

/// The tiny plan at a hidden size of 2048 with 64 experts: wide enough that launch shapes depend on the sizes.
fn wide_tiny_plan() -> PlanBody {
    wide_tiny_plan_for(vec![2])
}

/// [`wide_tiny_plan`] for the stream counts `streams`.
fn wide_tiny_plan_for(streams: Vec<u32>) -> PlanBody {
    crate::cuda::fuse::tests::tiny_plan_for(streams, |j| {
        j["num_experts"] = 64.into();
        j["hidden_size"] = 2048.into();
    })
}

#[test]
fn router_blocks_take_8_experts_at_every_row_count() {
    // A warp per expert in every router entry point: 8 experts a block of 8 warps; from 3 rows router_s4 (the tile of
    // 4 rows of 2048 fits the staged tile) in tiles of 4 rows over the grid's y; below, one grid row with
    // FLASHPLAN_FUSE_SMALL, else the row tile's entry; no top-k launch up to 16 rows with the switch (the one grid
    // row's or each tile's last block does it), else the top-k launch (router_topk_w with the switch, router_topk
    // without).
    // Rounds of 2 and 12 streams: windows of 1 to 36 rows.
    let body = wide_tiny_plan_for(vec![2, 12]);
    let mut seen = std::collections::BTreeSet::new();
    for fuse_small in [false, true] {
        for (v, specs) in specs_of(&body, fuse_small, SIDE_SCRATCH, 132) {
            let (streams, window) = v.kind.shape();
            let rows = streams * window;
            for (n, sp) in v.nodes.iter().zip(&specs) {
                let Op::Router { experts, .. } = n.op else {
                    continue;
                };
                let sp = sp.as_ref().expect("router launched");
                let what = format!("{} ({rows} rows, fuse_small {fuse_small})", v.kind.name());
                assert_eq!(sp.block, (256, 1, 1), "{what}");
                assert_eq!(experts, 64, "{what}");
                assert_eq!(sp.grid.0, 8, "{what}");
                let tile = match rows {
                    0..=1 => 1,
                    2 => 2,
                    3..=4 => 4,
                    5..=8 => 8,
                    _ => 16,
                };
                if rows >= 3 {
                    assert_eq!(sp.kernel, "router_s4", "{what}");
                    assert_eq!(sp.grid.1, rows.div_ceil(4), "{what}");
                } else if fuse_small {
                    assert_eq!(sp.kernel, format!("router_t{tile}"), "{what}");
                    assert_eq!(sp.grid.1, 1, "{what}");
                } else {
                    let tile = tile.min(4);
                    assert_eq!(sp.kernel, format!("router_t{tile}"), "{what}");
                    assert_eq!(sp.grid.1, rows.div_ceil(tile), "{what}");
                }
                if fuse_small && rows <= 16 {
                    assert!(sp.then.is_empty(), "{what}");
                } else {
                    assert_eq!(sp.then.len(), 1, "{what}");
                    // The top-k: with the switch a warp per row, 8 rows a block; without it a block per row.
                    let want = if fuse_small {
                        ("router_topk_w", (rows.div_ceil(8), 1, 1), 256)
                    } else {
                        ("router_topk", (rows, 1, 1), 1024)
                    };
                    let t = &sp.then[0];
                    assert_eq!((t.0, t.1, t.2), want, "{what}");
                }
                seen.insert(rows);
            }
        }
    }
    for rows in [1, 8, 12, 24, 36] {
        assert!(seen.contains(&rows), "{rows} rows not seen: {seen:?}");
    }
}

#[test]
fn a_copy_read_again_later_keeps_its_own_launch() {
    // The guard of `fuse_row_norms`: an MTP step's gathered input streams read by a node after their norm (here a
    // second norm of them into a buffer of its own) must stay written, so gather_rows keeps its launch and the norm
    // reads them; the embedding, which nothing else reads, still runs inside its norm.
    let mut plan = crate::cuda::fuse::tests::tiny_plan();
    let vi = plan
        .variants
        .iter()
        .position(|v| matches!(v.kind, flashplan_plan::VariantKind::MtpChain { .. }))
        .expect("an MTP chain variant");
    let v = &mut plan.variants[vi];
    let g = v
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::GatherRows { .. }))
        .expect("the input gather");
    let mut again = v.nodes[g + 1].clone();
    let Op::RmsNorm { out, .. } = &mut again.op else {
        panic!("the gather's norm");
    };
    let d = v.buf(*out).clone();
    v.buffers.push(flashplan_plan::BufferDecl {
        name: "test.again".into(),
        space: d.space,
        elems: d.elems,
        offset: v.arena_elems,
    });
    v.arena_elems += d.elems;
    *out = flashplan_plan::BufId((v.buffers.len() - 1) as u32);
    v.nodes.insert(g + 2, again);
    let specs = specs_of(&plan, true, SIDE_SCRATCH, 132);
    let (v, sp) = &specs[vi];
    let kernel = |i: usize| sp[i].as_ref().map(|s| s.kernel);
    assert_eq!(kernel(g), Some("gather_rows"), "{}", v.kind.name());
    assert_eq!(kernel(g + 1), Some("rms_norm"));
    assert_eq!(kernel(g + 2), Some("rms_norm"));
    let e = v
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Embed { .. }))
        .expect("the embedding");
    assert_eq!((kernel(e), kernel(e + 1)), (None, Some("rms_norm_embed")));
}

#[test]
fn mxfp8_linears_take_the_bf16_linear_launches() {
    // Every weight held as MXFP8 against none, linears unfused and fused: the same launches with `linear_mxfp8_*`
    // for `linear_*` and `linear_multi_mxfp8_*` for `linear_multi_*` (a run of siblings all held as MXFP8 is fused as
    // a BF16 run is), the same grids, row splits and parameters, but at the tiles of 8 and 16 rows, where a BF16 warp
    // takes LINEAR_MTILES m-tiles and an MXFP8 one one (`tc_mtiles`): there each BF16 matrix has that many times
    // fewer blocks.
    let plan = crate::cuda::fuse::tests::tiny_plan();
    let name = |k: &str| {
        k.replacen("linear_multi_", "linear_multi_mxfp8_", 1)
            .replacen("linear_t", "linear_mxfp8_t", 1)
    };
    // Seen: one-row launches, launches after a row split, fused runs, the tiles of 8 or 16 rows.
    let mut seen = [false; 4];
    for fuse_linears in [false, true] {
        let bf = specs_with(&plan, true, SIDE_SCRATCH, 132, fuse_linears, false);
        let mx = specs_with(&plan, true, SIDE_SCRATCH, 132, fuse_linears, true);
        for ((v, b), (_, m)) in bf.iter().zip(&mx) {
            assert_eq!(b.len(), m.len());
            for ((node, b), m) in v.nodes.iter().zip(b).zip(m) {
                let Op::Linear { .. } = &node.op else {
                    continue;
                };
                let what = format!("{} {:?}", v.kind.name(), node.op);
                let (Some(b), Some(m)) = (b, m) else {
                    // The later nodes of a fused run: fused in both forms.
                    assert_eq!(b.is_none(), m.is_none(), "{what}");
                    continue;
                };
                assert_eq!(m.grid, b.grid, "{what}");
                assert_eq!(m.block, b.block, "{what}");
                let (bk, mk) = if b.then.is_empty() {
                    seen[0] = true;
                    (b.kernel, m.kernel)
                } else {
                    seen[1] = true;
                    assert!(
                        matches!(b.kernel, "linear_split" | "linear_multi_split"),
                        "{what}: {}",
                        b.kernel
                    );
                    assert_eq!(m.kernel, b.kernel, "{what}");
                    assert_eq!((m.then.len(), b.then.len()), (1, 1), "{what}");
                    (b.then[0].0, m.then[0].0)
                };
                assert!(
                    bk.starts_with("linear_t") || bk.starts_with("linear_multi_t"),
                    "{what}: {bk}"
                );
                seen[2] |= bk.starts_with("linear_multi_t");
                assert_eq!(mk, name(bk), "{what}");
                let mt = if bk.ends_with("_t16") || bk.ends_with("_t8") {
                    seen[3] = true;
                    LINEAR_MTILES as u32
                } else {
                    1
                };
                let (mut bp, mut mp) = (b.params.clone(), m.params.clone());
                if bk.starts_with("linear_multi_t") {
                    // The blocks of each matrix are in the parameters: compare them, then the rest.
                    let (pb, mut pm): (FpLinearMulti, FpLinearMulti) = (params_of(b), params_of(m));
                    for i in 0..pm.count as usize {
                        assert_eq!(pb.blocks[i], pm.blocks[i].div_ceil(mt), "{what}");
                    }
                    pm.blocks = pb.blocks;
                    (bp, mp) = (bytes(&pb), bytes(&pm));
                }
                if !b.then.is_empty() {
                    let (bg, mg) = (b.then[0].1, m.then[0].1);
                    let blocks = if bk.starts_with("linear_multi_t") {
                        // Each form's grid is the sum of its matrices' blocks.
                        let (pb, pm): (FpLinearMulti, FpLinearMulti) = (params_of(b), params_of(m));
                        let count = pm.count as usize;
                        assert_eq!(mg.0, pm.blocks[..count].iter().sum::<u32>(), "{what}");
                        pb.blocks[..count].iter().sum()
                    } else {
                        mg.0.div_ceil(mt)
                    };
                    assert_eq!(bg, (blocks, mg.1, mg.2), "{what}");
                }
                assert_eq!(mp, bp, "{what}");
            }
        }
    }
    assert_eq!(
        seen, [true; 4],
        "one-row, split, fused and 8- or 16-row launches"
    );
}

#[test]
fn hc_read_one_takes_up_to_4_rows_whose_slices_and_grid_fit() {
    // The real read: 10240 gates of rank 320 (4 slices: 320 blocks of the gates), 320 + 4 outputs (162 blocks).
    assert_eq!(hc_read_one_grid(1, 10_240, 324, 320, 4, 396), Some(320));
    // The whole grid must fit on the GPU at once.
    assert_eq!(hc_read_one_grid(1, 10_240, 324, 320, 4, 319), None);
    assert_eq!(hc_read_one_grid(1, 10_240, 324, 320, 4, 0), None);
    // Up to 4 rows, every row count in between.
    for rows in 1..=4 {
        assert_eq!(
            hc_read_one_grid(rows, 10_240, 324, 320, 4, 396),
            Some(320),
            "{rows} rows"
        );
    }
    assert_eq!(hc_read_one_grid(0, 10_240, 324, 320, 4, 396), None);
    assert_eq!(hc_read_one_grid(5, 10_240, 324, 320, 4, 396), None);
    // The down's slice is one batch of 5 chunks a lane (up to 1280 values: W up to 10240)...
    assert_eq!(hc_read_one_grid(1, 10_248, 324, 320, 4, 396), None);
    // ... a slice of the gates at most 3 steps of 32 ...
    assert_eq!(hc_read_one_grid(1, 10_240, 324, 416, 4, 396), None);
    assert_eq!(hc_read_one_grid(1, 10_240, 324, 384, 4, 396), Some(320));
    // ... and a rank of at most 16 steps (lo's terms in shared memory).
    assert_eq!(hc_read_one_grid(4, 10_240, 324, 512, 8, 640), Some(640));
    assert_eq!(hc_read_one_grid(4, 10_240, 324, 544, 8, 640), None);
    // The tiny fixtures: the outputs' blocks can outnumber the gates', and they must fit too.
    assert_eq!(hc_read_one_grid(1, 256, 12, 8, 8, 396), Some(16));
    assert_eq!(hc_read_one_grid(1, 16, 40, 8, 8, 396), Some(20));
    assert_eq!(hc_read_one_grid(1, 16, 40, 8, 8, 19), None);
}

#[test]
fn a_grid_that_does_not_fit_keeps_the_separate_hc_read_launches() {
    let plan = crate::cuda::fuse::tests::tiny_plan();
    // The tiny reads need 16 blocks: a GPU holding 3 a time (one SM) keeps hc_read_t* + hc_mix_tc_t*.
    let mut seen = 0;
    for (v, sp) in specs_of(&plan, true, SIDE_SCRATCH, 1) {
        for (i, n) in v.nodes.iter().enumerate() {
            if !matches!(n.op, Op::HcRead { .. }) {
                continue;
            }
            let read = sp[i].as_ref().expect("hc_read launched");
            let kernels: Vec<&str> = std::iter::once(read.kernel)
                .chain(read.then.iter().map(|t| t.0))
                .collect();
            assert!(
                kernels.iter().all(|k| !k.starts_with("hc_read_one")),
                "{}: {kernels:?}",
                v.kind.name()
            );
            assert!(kernels.last().is_some_and(|k| k.starts_with("hc_mix_tc_t")));
            let p: FpHcRead = params_of(read);
            assert_eq!(p.barrier, 0);
            seen += 1;
        }
    }
    assert!(seen > 0);
    // On 132 SMs every read of up to 4 rows is one launch whose grid fits.
    for (v, sp) in specs_of(&plan, true, SIDE_SCRATCH, 132) {
        for (i, n) in v.nodes.iter().enumerate() {
            let (streams, window) = v.kind.shape();
            let nrows = if hc_read_gathered(&v, &n.op) {
                streams
            } else {
                streams * window
            };
            if let (Op::HcRead { .. }, true) = (&n.op, nrows <= 4) {
                let read = sp[i].as_ref().expect("hc_read launched");
                let (k, grid) = read
                    .then
                    .last()
                    .map_or((read.kernel, read.grid), |t| (t.0, t.1));
                assert!(k.starts_with("hc_read_one_t"), "{}: {k}", v.kind.name());
                assert!(grid.0 <= 3 * 132 && grid.1 == 1 && grid.2 == 1);
            }
        }
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
    // An MXFP8 weight takes the same entry's MXFP8 twin, at every row count: the drafting lm_head copy runs deep.
    assert_eq!(
        mxfp8_entry(entry(1, 2560, 248_320), 1),
        "linear_mxfp8_t1_deep"
    );
    for rows in 1..=16 {
        for (k, n) in [(2560, 248_320), (2560, 10_240), (6144, 2560), (40, 3)] {
            let bf16 = entry(rows, k, n);
            assert_eq!(
                mxfp8_entry(bf16, rows),
                bf16.replacen("linear_", "linear_mxfp8_", 1),
                "{rows} rows, [{n}, {k}]"
            );
        }
    }
}

#[test]
fn only_the_mxfp8_deep_linear_runs_in_one_wave_of_its_two_blocks_an_sm() {
    // The lm_head at one row: 2 slices of K, LINEAR_MTILES m-tiles a warp in either form: 128 features a block, 1940
    // blocks.
    let split = tc_split(2560, 248_320);
    let entry = linear_entry(1, 2560, split);
    assert_eq!(entry, "linear_t1_deep");
    for mxfp8 in [false, true] {
        assert_eq!(tc_mtiles(entry, mxfp8), LINEAR_MTILES as u32);
    }
    let blocks = 248_320u32.div_ceil(tc_features_per_block(split) * tc_mtiles(entry, false));
    assert_eq!(blocks, 1940);
    // BF16: every block launched; the drafting MXFP8 copy: one wave of 2 blocks on each of 132 SMs.
    assert_eq!(linear_grid(blocks, 1, entry, false, 132), 1940);
    assert_eq!(linear_grid(blocks, 1, entry, true, 132), 264);
    // An unknown SM count keeps the grid.
    assert_eq!(linear_grid(blocks, 1, entry, true, 0), 1940);
    // Other one- and two-row linears, either form: one wave of 3 blocks an SM; wider windows keep their grids.
    let (k, n) = (2560, 10_240);
    let split = tc_split(k, n);
    let blocks = n.div_ceil(tc_features_per_block(split));
    for mxfp8 in [false, true] {
        for rows in [1, 2] {
            let entry = linear_entry(rows, k, split);
            assert_eq!(
                linear_grid(blocks, rows, entry, mxfp8, 132),
                blocks.min(396)
            );
        }
        let entry = linear_entry(16, k, split);
        assert_eq!(linear_grid(blocks, 16, entry, mxfp8, 132), blocks);
    }
}

#[test]
fn bf16_tiles_of_8_and_16_rows_and_the_deep_linear_take_two_m_tiles_a_warp() {
    assert_eq!(LINEAR_MTILES, 2);
    for (entry, bf16, mxfp8) in [
        ("linear_t1", 1, 1),
        ("linear_t1_deep", 2, 2),
        ("linear_t2", 1, 1),
        ("linear_t4", 1, 1),
        ("linear_t8", 2, 1),
        ("linear_t16", 2, 1),
    ] {
        assert_eq!(
            (tc_mtiles(entry, false), tc_mtiles(entry, true)),
            (bf16, mxfp8),
            "{entry}"
        );
    }
}

#[test]
fn the_mxfp8_lm_head_of_one_row_launches_one_wave_and_the_bf16_one_every_block() {
    // The tiny plan at the real hidden size and vocabulary: its one-row lm_head (2560 x 248320) runs deep, BF16 in
    // 1940 blocks (two m-tiles a warp), held as MXFP8 in one wave of 2 blocks on each of 132 SMs (`linear_grid` through
    // `spec`).
    let body = crate::cuda::fuse::tests::tiny_plan_with(|j| {
        j["vocab_size"] = 248_320.into();
        j["hidden_size"] = 2560.into();
    });
    let bf = specs_with(&body, true, SIDE_SCRATCH, 132, true, false);
    let mx = specs_with(&body, true, SIDE_SCRATCH, 132, true, true);
    let mut seen = 0;
    for ((v, b), (_, m)) in bf.iter().zip(&mx) {
        for (i, n) in v.nodes.iter().enumerate() {
            let Op::Linear { n: 248_320, .. } = n.op else {
                continue;
            };
            let (Some(b), Some(m)) = (&b[i], &m[i]) else {
                continue;
            };
            if b.kernel != "linear_t1_deep" {
                continue;
            }
            let what = format!("{} node {i}", v.kind.name());
            assert_eq!(
                (b.grid, m.kernel),
                ((1940, 1, 1), "linear_mxfp8_t1_deep"),
                "{what}"
            );
            assert_eq!(m.grid, (264, 1, 1), "{what}");
            assert_eq!(m.params, b.params, "{what}");
            seen += 1;
        }
    }
    assert!(seen > 0, "no one-row lm_head");
}

#[test]
fn sixteen_row_bf16_linears_launch_blocks_of_two_m_tiles_a_warp() {
    // Plans for 16 streams at the real hidden size and vocabulary: every linear of 16 rows (the lm_head and the
    // projections, fused into `linear_multi` or not) launches, after its row split, a grid whose blocks hold
    // LINEAR_MTILES times 8 / split m-tiles of 16 features; held as MXFP8 they keep one m-tile a warp.
    assert_eq!(LINEAR_MTILES, 2);
    let body = crate::cuda::fuse::tests::tiny_plan_for(vec![16], |j| {
        j["vocab_size"] = 248_320.into();
        j["hidden_size"] = 2560.into();
    });
    let (mut bf16, mut mx, mut lm_head, mut multi) = (0, 0, 0, [0, 0]);
    for fuse_linears in [false, true] {
        for mxfp8 in [false, true] {
            for (v, sp) in specs_with(&body, true, SIDE_SCRATCH, 132, fuse_linears, mxfp8) {
                for s in sp.iter().flatten() {
                    let Some(&(kernel, grid, _)) = s.then.first() else {
                        continue;
                    };
                    let mt = if mxfp8 { 1 } else { 2 };
                    let what = format!("{} {kernel}", v.kind.name());
                    match kernel {
                        "linear_t16" | "linear_mxfp8_t16" => {
                            let p: FpLinear = params_of(s);
                            let blocks = p.n.div_ceil(tc_features_per_block(p.split) * mt);
                            assert_eq!(grid, (blocks, 1, 1), "{what}");
                            lm_head += (p.n == 248_320) as u32;
                        }
                        "linear_multi_t16" | "linear_multi_mxfp8_t16" => {
                            let p: FpLinearMulti = params_of(s);
                            let per_block = tc_features_per_block(p.split) * mt;
                            let count = p.count as usize;
                            for (b, n) in p.blocks[..count].iter().zip(&p.n[..count]) {
                                assert_eq!(*b, n.div_ceil(per_block), "{what}");
                            }
                            assert_eq!(grid.0, p.blocks[..count].iter().sum::<u32>(), "{what}");
                            multi[mxfp8 as usize] += 1;
                        }
                        _ => continue,
                    }
                    if mxfp8 {
                        mx += 1;
                    } else {
                        bf16 += 1;
                    }
                }
            }
        }
    }
    assert!(
        bf16 > 0 && mx > 0 && lm_head > 0 && multi[0] > 0 && multi[1] > 0,
        "{bf16} BF16, {mx} MXFP8, {lm_head} lm_head, {multi:?} linear_multi (BF16, MXFP8) launches"
    );
}

#[test]
fn the_shared_expert_takes_tiles_of_2_rows_up_to_4_rows_and_of_4_beyond() {
    // Where the tiles of 4 can be staged (`stage_fits`), they are from 5 rows on.
    let t = |rows| shared_expert_tiles(rows, true);
    assert_eq!(t(1), ("shared_expert_t1", "shared_expert_down_t1", 1));
    assert_eq!(t(2), ("shared_expert_t2", "shared_expert_down_t2", 1));
    for rows in 3..=4 {
        assert_eq!(t(rows), ("shared_expert_t2", "shared_expert_down_t2", 2));
    }
    for rows in 5..=16u32 {
        let tiles = rows.div_ceil(4);
        assert_eq!(
            t(rows),
            ("shared_expert_s4", "shared_expert_down_s4", tiles)
        );
        // Not stageable: the same tiles read from global memory.
        assert_eq!(
            shared_expert_tiles(rows, false),
            ("shared_expert_t4", "shared_expert_down_t4", tiles)
        );
    }
    // Through the launches (the tiny plan's rounds of up to 8 rows), on the router's side branch: the gate/up and the
    // down take the same tiles.
    let mut seen = std::collections::BTreeSet::new();
    for (v, sp) in tiny_specs(true).into_iter().chain(tiny_specs(false)) {
        let rows = v.kind.shape().0 * v.kind.shape().1;
        for (n, s) in v.nodes.iter().zip(&sp) {
            let (Op::Router { .. }, Some(router)) = (&n.op, s) else {
                continue;
            };
            let Some(s) = router.side.first() else {
                continue;
            };
            let (dim, inter) = v
                .nodes
                .iter()
                .find_map(|n| match n.op {
                    Op::SharedExpert { dim, inter, .. } => Some((dim, inter)),
                    _ => None,
                })
                .expect("a shared expert");
            // The tiny plan's tiles of 4 rows fit the staged tile (and its buffers are aligned for it).
            assert!(
                stage_fits(dim, 0) && stage_fits(inter, 0),
                "{dim} / {inter}"
            );
            let (gate_up, down, tiles) = shared_expert_tiles(rows, true);
            assert_eq!(
                gate_up == "shared_expert_s4",
                rows >= 5,
                "{}",
                v.kind.name()
            );
            assert_eq!((s.kernel, s.grid.1), (gate_up, tiles), "{}", v.kind.name());
            assert_eq!(
                (s.then[0].0, s.then[0].1 .1),
                (down, tiles),
                "{}",
                v.kind.name()
            );
            seen.insert(rows);
        }
    }
    assert!(
        seen.contains(&3) && seen.contains(&4) && seen.contains(&6),
        "rows seen: {seen:?}"
    );
}

/// `gdn_conv` takes a thread per (stream, channel): a round of S streams launches S rows of blocks (`blockIdx.y`), so
/// no thread walks the streams one after another (kernels/gdn.cu); the tiny plan has rounds of 1 and 2 streams.
#[test]
fn gdn_conv_takes_a_thread_per_stream_and_channel() {
    let mut streams_seen = std::collections::BTreeSet::new();
    for (v, sp) in tiny_specs(true).into_iter().chain(tiny_specs(false)) {
        let streams = v.kind.shape().0;
        for (n, s) in v.nodes.iter().zip(&sp) {
            let (Op::GdnConv { channels, .. }, Some(s)) = (&n.op, s) else {
                continue;
            };
            assert_eq!(s.kernel, "gdn_conv");
            assert_eq!(
                (s.grid, s.block),
                ((channels.div_ceil(128), streams, 1), (128, 1, 1)),
                "{}",
                v.kind.name()
            );
            streams_seen.insert(streams);
        }
    }
    assert!(
        streams_seen.contains(&2),
        "stream counts seen: {streams_seen:?}"
    );
}

#[test]
fn the_state_kernels_put_a_heads_column_tiles_side_by_side_and_one_row_takes_gdn_recur_one() {
    // kernels/gdn.cu: blocks of 32 columns over x, value heads over y, streams over z (a head's tiles next to each
    // other in launch order); windows of one row take gdn_recur_one, wider ones gdn_recur, then gdn_commit.
    let mut seen = std::collections::BTreeSet::new();
    for (v, sp) in tiny_specs(true).into_iter().chain(tiny_specs(false)) {
        let (streams, window) = v.kind.shape();
        for (n, s) in v.nodes.iter().zip(&sp) {
            let (hv, dv, want) = match (&n.op, window) {
                (Op::GdnRecur { hv, dv, .. }, 1) => (hv, dv, "gdn_recur_one"),
                (Op::GdnRecur { hv, dv, .. }, _) => (hv, dv, "gdn_recur"),
                (Op::GdnCommit { hv, dv, .. }, _) => (hv, dv, "gdn_commit"),
                _ => continue,
            };
            // Window-one commits are left out of the graph (commit_in_window_one).
            let Some(s) = s else {
                assert!(window == 1 && want == "gdn_commit", "{}", v.kind.name());
                continue;
            };
            assert_eq!(s.kernel, want, "{}", v.kind.name());
            assert_eq!(
                (s.grid, s.block),
                ((dv.div_ceil(32), *hv, streams), (128, 1, 1)),
                "{}",
                v.kind.name()
            );
            seen.insert((want, streams > 1));
        }
    }
    for k in ["gdn_recur_one", "gdn_recur", "gdn_commit"] {
        assert!(seen.contains(&(k, true)), "{k} at 2 streams: {seen:?}");
    }
}

#[test]
fn the_state_kernels_refuse_head_dims_they_cannot_hold() {
    // A lane holds a quarter of a column as float4 runs (kernels/gdn.cu): dk at most 128, a multiple of 4, and at
    // most 32 or a multiple of 32.
    for (dk, dv) in [(128, 128), (16, 16), (4, 1024), (64, 8), (32, 32)] {
        super::gdn::check_state_dims("gdn_recur", dk, dv).expect("supported");
    }
    for (dk, dv, named) in [
        (160, 128, "linear_key_head_dim 160"),
        (6, 16, "linear_key_head_dim 6"),
        (48, 16, "linear_key_head_dim 48"),
        (128, 1056, "linear_value_head_dim 1056"),
    ] {
        let err = super::gdn::check_state_dims("gdn_commit", dk, dv).expect_err("refused");
        let msg = err.to_string();
        assert!(msg.contains("gdn_commit") && msg.contains(named), "{msg}");
    }
}

#[test]
fn experts_grids_have_one_block_per_8_warps_of_items_and_both_down_kernels_run() {
    let mut seen = 0;
    let mut downs = std::collections::BTreeSet::new();
    let (mut ones, mut one_row_old) = (0, 0);
    let body = crate::cuda::fuse::tests::tiny_plan();
    for (v, sp) in tiny_specs(true).into_iter().chain(tiny_specs(false)) {
        let rows = v.kind.shape().0 * v.kind.shape().1;
        for (i, (n, s)) in v.nodes.iter().zip(&sp).enumerate() {
            let (
                Op::Experts {
                    topk, dim, inter, ..
                },
                Some(s),
            ) = (&n.op, s)
            else {
                continue;
            };
            seen += 1;
            let p: FpExperts = params_of(s);
            assert_eq!(p.barrier, 0x5000_0000 + 4 * NODE_COUNTERS as u64 * i as u64);
            if s.kernel == "experts_one" {
                // One row (FLASHPLAN_FUSE_SMALL): experts_one, EXPERTS_ONE_BLOCKS blocks a rank, then
                // experts_combine, a thread per output feature; the scratch holds its rank sums and hid.
                assert_eq!(rows, 1, "{}", v.kind.name());
                assert_eq!(
                    (s.kernel, s.grid, s.block),
                    ("experts_one", (*topk * 40, 1, 1), (256, 1, 1)),
                    "{}",
                    v.kind.name()
                );
                assert_eq!(
                    s.then,
                    [("experts_combine", (dim.div_ceil(256), 1, 1), 256)]
                );
                assert!(scratch_elems(&body, &n.op, 1) >= (*topk * (dim + inter)) as u64);
                ones += 1;
                continue;
            }
            // The gate/up: the entry point `gate_up_entry` picks (its threshold pinned by the test below); from 5
            // rows on after experts_order, one block of 1024 threads, whose permutation of the rows x topk slots
            // the scratch holds after hid.
            let gate_up_grid = if rows >= 5 {
                assert_eq!(
                    (s.kernel, s.grid, s.block),
                    ("experts_order", (1, 1, 1), (1024, 1, 1)),
                    "{}",
                    v.kind.name()
                );
                let (k, grid, block) = s.then[0];
                assert_eq!((k, block), (gate_up_entry(rows), 256), "{}", v.kind.name());
                // Reports name the node by the gate/up it prepares, not by the sort.
                assert_eq!(s.name(), "experts_wide+order", "{}", v.kind.name());
                assert!(
                    scratch_elems(&body, &n.op, rows as u64) >= (rows * topk * (inter + 1)) as u64
                );
                grid.0
            } else {
                assert_eq!(s.kernel, gate_up_entry(rows), "{}", v.kind.name());
                s.grid.0
            };
            if rows == 1 {
                one_row_old += 1;
            }
            // The gate/up: a warp per two pairs of features of a (row, rank), 8 warps a block; at one row cut to
            // one wave, the blocks looping.
            let warps = rows * topk * inter.div_ceil(4);
            assert!(
                gate_up_grid >= 1 && gate_up_grid <= warps.div_ceil(8),
                "{}",
                v.kind.name()
            );
            if rows > 1 {
                assert_eq!(gate_up_grid, warps.div_ceil(8), "{}", v.kind.name());
            }
            // The down: one or four output features a warp, by the row count (four at 2 rows and from 16 on).
            let &(down, grid, block) = s.then.last().expect("experts_down follows");
            let (want, feats) = down_features(rows);
            assert_eq!(
                (want, feats),
                if rows == 2 || rows >= 16 {
                    ("experts_down_f4", 4)
                } else {
                    ("experts_down", 1)
                }
            );
            assert_eq!((down, block), (want, 256), "{}", v.kind.name());
            assert_eq!(
                grid.0,
                (rows * dim.div_ceil(feats)).div_ceil(8),
                "{}",
                v.kind.name()
            );
            downs.insert(down);
        }
    }
    assert!(seen > 0, "the tiny plan has routed experts");
    assert!(ones > 0, "experts_one launched");
    assert!(
        one_row_old > 0,
        "experts at one row with FLASHPLAN_FUSE_SMALL=0"
    );
    assert_eq!(downs.len(), 2, "both down entry points launched: {downs:?}");
}

/// The value of `#define NAME VALUE` in a kernel source (a number, then at most a comment).
fn kernel_define(src: &str, name: &str) -> u32 {
    let line = src
        .lines()
        .find(|l| l.starts_with(&format!("#define {name} ")))
        .unwrap_or_else(|| panic!("#define {name} in the kernel source"));
    line[format!("#define {name} ").len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}: not a number"))
}

/// Whether a kernel source declares entry point `name` with `__launch_bounds__(BARRIER_BLOCK, ..)` on its line.
fn bounded_to_barrier_block(src: &str, name: &str) -> bool {
    src.lines().any(|l| {
        l.contains(&format!(" {name}("))
            && l.contains(&format!("__launch_bounds__({BARRIER_BLOCK},"))
    })
}

#[test]
fn the_staged_tile_matches_the_kernel_define_and_checks_width_alignment_and_size() {
    let src = include_str!("../../../../kernels/common.cuh");
    assert_eq!(kernel_define(src, "STAGE_TILE_MAX"), STAGE_TILE_MAX);
    // 4 rows of the real width fill it; one more float a row, a width that is no whole 16-byte copies, or a
    // misaligned first row do not fit.
    assert!(stage_fits(2560, 256) && stage_fits(640, 0) && stage_fits(4, 16));
    assert!(!stage_fits(2564, 256));
    assert!(!stage_fits(2558, 256));
    assert!(!stage_fits(2560, 8));
}

#[test]
fn the_router_takes_router_s4_from_3_rows_only_where_its_tile_is_staged() {
    for fuse_small in [false, true] {
        for rows in 1..=36u32 {
            let what = format!("{rows} rows, fuse_small {fuse_small}");
            let staged = router_logits(rows, true, fuse_small);
            let unstaged = router_logits(rows, false, fuse_small);
            if rows >= 3 {
                assert_eq!(staged, ("router_s4", rows.div_ceil(4), false), "{what}");
            } else {
                assert_eq!(staged, unstaged, "{what}");
            }
            // Unstaged: one grid row up to 8 rows with the switch, else the row tile's entry in tiles of at most 4.
            let tile = match rows {
                1 => 1,
                2 => 2,
                3..=4 => 4,
                _ => 8,
            };
            let want = if fuse_small && rows <= 8 {
                (format!("router_t{tile}"), 1, true)
            } else {
                let tile = tile.min(4);
                (format!("router_t{tile}"), rows.div_ceil(tile), false)
            };
            assert_eq!(
                (unstaged.0.to_string(), unstaged.1, unstaged.2),
                want,
                "{what}"
            );
        }
    }
}

#[test]
fn hc_read_one_limits_match_the_kernel_defines() {
    // The launch's limits mirror kernels/norm.cu's array sizes: a drift would let the kernel run past them.
    let src = include_str!("../../../../kernels/norm.cu");
    let define = |name: &str| kernel_define(src, name);
    assert_eq!(define("HC_ONE_U"), HC_ONE_CHUNKS);
    assert_eq!(define("HC_ONE_STEPS"), HC_ONE_STEPS);
    // Every entry point the launch names is in the kernel file, under the barrier kernels' block size.
    for name in HC_READ_ONE {
        assert!(bounded_to_barrier_block(src, name), "{name}");
    }
}

#[test]
fn experts_one_runs_only_for_one_row_on_the_vector_paths_with_its_grid_resident() {
    let p = FpExperts {
        gate_up: 0x1000,
        down: 0x2000,
        topk: 10,
        dim: 2560,
        inter: 640,
        ..Default::default()
    };
    // The real widths at one row: 40 blocks a rank, when the GPU holds them (4 an SM on 132 SMs).
    assert_eq!(experts_one_grid(&p, 1, true, 4 * 132), Some(400));
    assert_eq!(
        experts_one_grid(&p, 1, true, 399),
        None,
        "a grid past residency"
    );
    assert_eq!(
        experts_one_grid(&p, 1, false, 4 * 132),
        None,
        "FLASHPLAN_FUSE_SMALL=0"
    );
    assert_eq!(experts_one_grid(&p, 2, true, 4 * 132), None, "two rows");
    for q in [
        FpExperts { topk: 0, ..p },
        FpExperts { dim: 2564, ..p },
        FpExperts { inter: 644, ..p },
        FpExperts { inter: 2056, ..p },
        FpExperts {
            gate_up: 0x1008,
            ..p
        },
        FpExperts { down: 0x2008, ..p },
    ] {
        assert_eq!(experts_one_grid(&q, 1, true, 4 * 132), None);
    }
}

#[test]
fn experts_one_limits_match_the_kernel_defines() {
    // The launch's limits mirror kernels/moe.cu's: a drift would give the kernel a grid it does not cover, or hid
    // past its shared memory.
    let src = include_str!("../../../../kernels/moe.cu");
    let define = |name: &str| kernel_define(src, name);
    assert_eq!(define("EO_BLOCKS"), EXPERTS_ONE_BLOCKS);
    assert_eq!(define("EO_MAX_INTER"), EXPERTS_ONE_MAX_INTER);
    assert_eq!(define("EO_THREADS"), BARRIER_BLOCK);
    assert!(bounded_to_barrier_block(src, "experts_one"));
}

#[test]
fn prefetch_budget_is_for_verify_rounds_of_8_to_16_rows() {
    use flashplan_plan::{DrafterForm, VariantKind::*};
    for window in [1, 2, 4, 7, 17] {
        assert_eq!(prefetch_budget(Lone { window }), 0, "lone-w{window}");
    }
    for window in [8, 12, 16] {
        assert_eq!(prefetch_budget(Lone { window }), 32 << 20, "lone-w{window}");
    }
    for (streams, window, on) in [
        (4, 1, false),
        (8, 1, true),
        (16, 1, true),
        (2, 4, true),
        (16, 2, false),
    ] {
        let want = if on { 32 << 20 } else { 0 };
        assert_eq!(
            prefetch_budget(Verify { streams, window }),
            want,
            "verify-s{streams}-w{window}"
        );
    }
    // Prefill chunks and MTP steps were not measured with it.
    assert_eq!(prefetch_budget(Prefill { chunk: 16 }), 0);
    let form = DrafterForm::Checkpoint;
    assert_eq!(
        prefetch_budget(MtpAbsorb {
            streams: 1,
            window: 16,
            form
        }),
        0
    );
    assert_eq!(prefetch_budget(MtpChain { streams: 16, form }), 0);
}

#[test]
fn prefetches_follow_heavy_launches_within_the_budget_and_fetch_the_next_run_of_weights() {
    // The real widths, 4 layers, windows up to 16 rows. A variant with a budget gets prefetch runs, each forked at
    // the launch right after a heavy one (the routed experts, or 16 MB of weights or more, counting the nodes
    // without a launch of their own up to the next launch), within the budget, and fetching only weights of the
    // launches from there up to the next heavy one (the one that closes the run included), in launch order.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/flash-next.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir).expect("config")).expect("json");
    let t = &mut json["text_config"];
    t["num_hidden_layers"] = 4.into();
    let types: Vec<serde_json::Value> =
        t["layer_types"].as_array().expect("layer_types")[..4].to_vec();
    t["layer_types"] = types.into();
    let cfg = flashplan_plan::ModelConfig::from_json_str(&json.to_string()).expect("config parses");
    let opts = flashplan_plan::CompileOptions {
        arch: "cpu".into(),
        max_depth: 15,
        streams: vec![1],
        context: 256,
        prefill_chunk: 32,
    };
    let body = flashplan_compiler::compile(&cfg, &opts, &Default::default(), "test", |_, _| {})
        .expect("compiles")
        .body;
    // specs_of's made-up weight addresses.
    let weight_at = |ptr: u64| ((ptr - 0x1000_0000) >> 20) as usize;
    let bytes = |id: flashplan_plan::WeightId| body.weights[id.0 as usize].numel() * 2;
    let mut runs = 0;
    for (v, sp) in specs_of(&body, true, SIDE_SCRATCH, 132) {
        let at: Vec<usize> = (0..sp.len()).filter(|&i| sp[i].is_some()).collect();
        let forks: Vec<usize> = (0..at.len())
            .filter(|&k| !sp[at[k]].as_ref().expect("spec").prefetch.is_empty())
            .collect();
        if prefetch_budget(v.kind) == 0 {
            assert!(forks.is_empty(), "{}: no prefetch", v.kind.name());
            continue;
        }
        assert!(!forks.is_empty(), "{}: prefetches", v.kind.name());
        // Each launch's nodes (its own and the ones without a launch up to the next), and whether it is heavy.
        let nodes = |k: usize| at[k]..at.get(k + 1).copied().unwrap_or(v.nodes.len());
        let heavy = |k: usize| {
            v.nodes[nodes(k)]
                .iter()
                .any(|n| matches!(n.op, Op::Experts { .. }))
                || v.nodes[nodes(k)]
                    .iter()
                    .flat_map(|n| n.op.weights())
                    .filter(|&id| {
                        !matches!(
                            v.nodes[nodes(k)]
                                .iter()
                                .find(|n| n.op.weights().contains(&id))
                                .map(|n| &n.op),
                            Some(Op::Embed { .. } | Op::EmbedStreams { .. } | Op::PleEmbed { .. })
                        )
                    })
                    .map(bytes)
                    .sum::<u64>()
                    >= 16 << 20
        };
        // The run forked at launch k: from k up to the next heavy launch, included.
        let run = |k: usize| -> Vec<usize> {
            let end = (k..at.len()).find(|&j| heavy(j)).unwrap_or(at.len() - 1);
            (k..=end)
                .flat_map(|j| v.nodes[nodes(j)].iter().flat_map(|n| n.op.weights()))
                .map(|id| id.0 as usize)
                .collect()
        };
        for k in 1..at.len() {
            let forked = forks.contains(&k);
            if forked {
                assert!(
                    heavy(k - 1),
                    "{}: launch {k} forks after a light launch",
                    v.kind.name()
                );
            }
            // After a heavy launch, a run with a weight of 16 KB or more is fetched.
            let fetchable = run(k).iter().any(|&w| {
                body.weights[w].numel() * 2 >= 16 << 10 && !body.weights[w].name.contains("embed")
            });
            if heavy(k - 1) && fetchable {
                assert!(
                    forked,
                    "{}: launch {k} after a heavy launch forks",
                    v.kind.name()
                );
            }
        }
        for &k in &forks {
            runs += 1;
            let allowed = run(k);
            let mut total = 0;
            let mut last = None;
            for p in &sp[at[k]].as_ref().expect("spec").prefetch {
                assert_eq!((p.kernel, p.block), ("l2_prefetch", (64, 1, 1)));
                let f: FpL2Prefetch = params_of(p);
                for r in 0..f.n as usize {
                    let w = weight_at(f.ptr[r]);
                    assert!(
                        allowed.contains(&w),
                        "{}: weight {w} outside the run at {k}",
                        v.kind.name()
                    );
                    // In launch order: a weight's position in the run never goes back.
                    let pos = allowed.iter().position(|&x| x == w).expect("in the run");
                    assert!(
                        last.is_none_or(|l| pos >= l),
                        "{}: out of order",
                        v.kind.name()
                    );
                    last = Some(pos);
                    total += f.bytes[r];
                }
            }
            assert!(
                total > 0 && total <= 32 << 20,
                "{}: {total} bytes",
                v.kind.name()
            );
        }
    }
    assert!(runs > 0);
}

#[test]
fn sparse_attn_takes_the_tightest_head_bound_that_holds_its_heads() {
    // kernels/attn.cu: entry point sparse_attn_gGM runs head loops up to GM; G heads per kv head need GM >= G, and
    // the smallest such GM of 4, 8, 12, 16 is the one with the fewest idle heads. Exactly 12 heads take the exact
    // form (suffix e: bounds fixed at 12, never staged) at every stream count.
    let src = include_str!("../../../../kernels/attn.cu");
    assert_eq!(kernel_define(src, "SA_CHUNK"), attn::SA_CHUNK);
    for g in 1..=16u32 {
        for streams in [1, 2, 16] {
            let name = attn::sparse_attn_entry(g, streams);
            let staged = name.ends_with('v');
            let exact = name.ends_with('e');
            let bound: u32 = name["sparse_attn_g".len()..]
                .trim_end_matches(['v', 'e'])
                .parse()
                .expect("a bound");
            assert!(bound >= g && bound - g < 4, "{g} heads -> {name}");
            assert_eq!(exact, g == 12, "{g} heads -> {name}");
            // Several streams stage the values wherever the kernel can (up to 12 heads, but for the exact form); a
            // lone stream never does.
            assert_eq!(
                staged,
                streams > 1 && bound <= 12 && !exact,
                "{g} heads, {streams} streams -> {name}"
            );
            let entry = format!(" {name}(const FpSparseAttn p)");
            let body = if exact {
                format!("sparse_attn_g<{bound}, false, true>(p)")
            } else {
                format!("sparse_attn_g<{bound}, {staged}>(p)")
            };
            assert!(
                src.lines()
                    .any(|l| l.starts_with("extern \"C\" __global__ void ")
                        && l.contains(&entry)
                        && l.contains(&body)),
                "{name} is an entry point of kernels/attn.cu running {body}"
            );
        }
    }
    assert_eq!(kernel_define(src, "SA_MAX_G"), 16);
}

#[test]
fn sparse_attn_combine_keeps_every_load_in_flight_only_within_one_wave() {
    // kernels/attn.cu: sparse_attn_combine_pre runs at one block an SM (its registers), so it pays only while the
    // launch's blocks (rows x heads) fit one wave; both forms are the same sums.
    let src = include_str!("../../../../kernels/attn.cu");
    for (blocks, sms, want) in [
        (24, 132, "sparse_attn_combine_pre"),
        (132, 132, "sparse_attn_combine_pre"),
        (133, 132, "sparse_attn_combine"),
        (384, 132, "sparse_attn_combine"),
        (24, 0, "sparse_attn_combine"),
        (0, 0, "sparse_attn_combine"),
    ] {
        assert_eq!(
            attn::sparse_attn_combine_entry(blocks, sms),
            want,
            "{blocks} blocks on {sms} SMs"
        );
    }
    for (name, pre) in [
        ("sparse_attn_combine", false),
        ("sparse_attn_combine_pre", true),
    ] {
        assert!(
            src.lines()
                .any(|l| l.starts_with("extern \"C\" __global__ void ")
                    && l.contains(&format!(" {name}(const FpSparseAttn p)"))
                    && l.contains(&format!("sparse_attn_combine_t<{pre}>(p)"))),
            "{name} is an entry point of kernels/attn.cu running sparse_attn_combine_t<{pre}>"
        );
    }
}

#[test]
fn sparse_attention_nodes_pass_their_streams_and_rows_times_heads_to_the_entry_choices() {
    // Attention of 256-dim heads over 2 kv heads in plans for 1 and 16 streams. With 16 query heads (8 a group) every
    // sparse-attention launch stages its values exactly when its variant has several streams; with the real 24 (12
    // a group) every launch takes the exact form, unstaged. The combine keeps every load in flight exactly when rows
    // x heads fit the 132 SMs (24 heads: 16 streams of one row are 384 blocks, the looping combine; one stream of 3
    // rows 72, the one-wave one).
    for heads in [16u32, 24] {
        let body = crate::cuda::fuse::tests::tiny_plan_for(vec![1, 16], |j| {
            j["num_attention_heads"] = heads.into();
            j["num_key_value_heads"] = 2.into();
            j["head_dim"] = 256.into();
            j["indexer_head_dim"] = 128.into();
        });
        let mut seen = [0u32; 4];
        for (v, sp) in specs_with(&body, true, SIDE_SCRATCH, 132, true, false) {
            let (streams, window) = v.kind.shape();
            let rows = streams * window;
            for (n, s) in v.nodes.iter().zip(&sp) {
                let (Op::SparseAttn { heads: h, .. }, Some(s)) = (&n.op, s) else {
                    continue;
                };
                assert_eq!(*h, heads);
                let staged = streams > 1;
                let pre = rows * heads <= 132;
                let what = v.kind.name();
                let kernel = match (heads, staged) {
                    (24, _) => "sparse_attn_g12e",
                    (_, true) => "sparse_attn_g8v",
                    _ => "sparse_attn_g8",
                };
                assert_eq!(s.kernel, kernel, "{heads} heads, {what}");
                assert_eq!(
                    s.then.first().map(|t| t.0),
                    Some(if pre {
                        "sparse_attn_combine_pre"
                    } else {
                        "sparse_attn_combine"
                    }),
                    "{heads} heads, {what}"
                );
                seen[2 * staged as usize + pre as usize] += 1;
            }
        }
        // Lone streams with the one-wave combine, and 16 streams with the looping one, were both planned.
        assert!(seen[1] > 0 && seen[2] > 0, "{heads} heads: {seen:?}");
    }
}

/// The launches of a variant in graph order, each with the ops it covers: its own node and the nodes after it that
/// have no launch of their own (fused into it, as a run of sibling linears; moved to a side branch, as the shared
/// expert; or done by another launch, as a window-1 gdn_commit), all counted as the launch's for safety.
fn launches_with_ops<'a>(
    v: &'a Variant,
    sp: &'a [Option<LaunchSpec>],
) -> Vec<(&'a LaunchSpec, &'a Op, Vec<&'a Op>)> {
    let mut out: Vec<(&LaunchSpec, &Op, Vec<&Op>)> = Vec::new();
    for (n, s) in v.nodes.iter().zip(sp) {
        match s {
            Some(s) => out.push((s, &n.op, vec![&n.op])),
            None => {
                if let Some(last) = out.last_mut() {
                    last.2.push(&n.op);
                }
            }
        }
    }
    out
}

#[test]
fn a_fused_run_of_linears_is_one_launch_covering_every_linear_of_the_run() {
    // What launches_with_ops gives the early-load test below: with FLASHPLAN_FUSE_LINEAR, a GDN layer's input
    // projections (qkv, z, b, a) are one launch, and that launch covers all four linears' outputs.
    let body = crate::cuda::fuse::tests::tiny_plan();
    let mut seen = 0;
    for (v, sp) in specs_of_fused(&body, true, SIDE_SCRATCH, 132, true) {
        for (s, _, ops) in launches_with_ops(&v, &sp) {
            let linears = ops
                .iter()
                .filter(|o| matches!(o, Op::Linear { .. }))
                .count();
            if s.kernel.starts_with("linear_multi") {
                assert!(
                    linears >= 2,
                    "{}: {} covers {linears} linears",
                    v.kind.name(),
                    s.kernel
                );
                seen += 1;
            }
        }
    }
    assert!(seen > 0, "no fused linear launch in the tiny plan");
}

#[test]
fn what_a_kernel_reads_before_its_wait_is_not_written_by_the_kernel_before_it() {
    // Before griddepcontrol.wait, hc_write_norm reads h, gdn_recur its recurrent state, gated_norm its gate z and
    // sparse_attn its q (kernels/norm.cu, gdn.cu, attn.cu; the rule at common.cuh `ld_early_*`): sound only while
    // the launch just before them in the graph (the one they overlap) writes none of it, in any of the ops it
    // covers (launches_with_ops).
    let body = crate::cuda::fuse::tests::tiny_plan();
    for (fuse_small, fuse_linears) in [(true, true), (false, true), (true, false)] {
        let mut checked: std::collections::BTreeMap<&str, usize> = Default::default();
        for (v, sp) in specs_of_fused(&body, fuse_small, SIDE_SCRATCH, 132, fuse_linears) {
            let launches = launches_with_ops(&v, &sp);
            for pair in launches.windows(2) {
                let ((_, _, prev), (s, op, _)) = (&pair[0], &pair[1]);
                // What the launch reads before its wait: a buffer, or (gdn_recur) a state piece.
                let (buf, state) = match op {
                    Op::HcWrite { h, .. } if s.kernel == "hc_write_norm" => (Some(h), None),
                    Op::GatedNorm { z, .. } => (Some(z), None),
                    Op::SparseAttn { q, .. } => (Some(q), None),
                    Op::GdnRecur { state, .. } => (None, Some(state)),
                    _ => continue,
                };
                for p in prev {
                    let clash = buf.is_some_and(|b| p.writes().contains(b))
                        || state.is_some_and(|st| p.states().contains(st));
                    assert!(
                        !clash,
                        "{}: {} before {}",
                        v.kind.name(),
                        p.kernel(),
                        s.kernel
                    );
                }
                *checked.entry(op.kernel()).or_default() += 1;
            }
        }
        let mut want = vec!["gated_norm", "gdn_recur", "sparse_attn"];
        if fuse_small {
            want.push("hc_write");
        }
        for k in want {
            assert!(
                checked.get(k).is_some_and(|&c| c > 0),
                "no {k} launch checked: {checked:?}"
            );
        }
    }
}

#[test]
fn the_routed_gate_up_takes_experts_wide_from_five_rows_on() {
    // Two chunks in flight up to 4 rows, one (three blocks an SM) from 5 on, over every window of 1-16 rows: the
    // fixtures' plans stop at 8 rows, so the launch-shape test above never reaches 9-16.
    for rows in 1..=16 {
        let want = if rows >= 5 { "experts_wide" } else { "experts" };
        assert_eq!(gate_up_entry(rows), want, "{rows} rows");
    }
}
