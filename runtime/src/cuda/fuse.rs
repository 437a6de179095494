//! Launch-time fusion of sibling linears: a run of consecutive `Linear` nodes reading the same input (a GDN layer's
//! qkv, z, b and a projections; an attention layer's q, k, v and indexer qk) becomes one `linear_multi` launch
//! (`kernels/linear.cu`; `linear_multi_mxfp8` in `kernels/mxfp8.cu` for MXFP8 weights) instead of one `linear`
//! launch each. The small projections (n = 48) are pure launch latency; fused they ride along with the large one.
//! Each output element keeps the arithmetic of its own `linear` launch (same row tile, split of K, slices and sums),
//! so fused and unfused results are bit-identical.
//!
//! Grouping (`launch_groups`): starting at a node, a run grows over the following nodes while each is a `Linear`
//! node
//! - whose weight is held in the same form as the first node's (BF16 tiles, or MXFP8 tiles: the drafter's re-coded
//!   linears, `FLASHPLAN_MTP_WEIGHTS`),
//! - reading the same x buffer with the same k and sub (hence the same gathered-ness and row tile) and the same split
//!   of K (`launch::tc_split`, which also looks at n),
//! - whose output overlaps neither x nor the output of any earlier node of the run (checked on the plan's buffer
//!   spaces and element ranges, so arena reuse cannot alias them; an accumulating node reads its own output, which
//!   no other node of the run touches then),
//!
//! and while the run has fewer than `MAX_LINEARS` nodes. The first node's output must not overlap x either. Runs
//! are taken greedily from the left (five siblings: a run of four, then one).

use std::ops::Range;

use flashplan_plan::{BufId, Op, Variant, WeightId};

/// Most linears one `linear_multi` launch takes (`FP_MAX_LINEARS` in `kernels/params.h`).
pub(crate) const MAX_LINEARS: usize = super::params::FP_MAX_LINEARS;

/// Whether a `Linear` node's x holds one row per stream (gathered) rather than every row of the variant: its
/// buffer is smaller than all rows' sub-rows of k values.
pub(crate) fn linear_gathered(v: &Variant, x: BufId, k: u32, sub: u32) -> bool {
    let (streams, window) = v.kind.shape();
    v.buf(x).elems < streams as u64 * window as u64 * sub as u64 * k as u64
}

/// Whether two buffers of a variant share any element (same space, intersecting element ranges).
pub(crate) fn overlap(v: &Variant, a: BufId, b: BufId) -> bool {
    let (da, db) = (v.buf(a), v.buf(b));
    da.space == db.space && da.offset < db.offset + db.elems && db.offset < da.offset + da.elems
}

/// The fields of a `Linear` node that decide grouping.
#[derive(Clone, Copy)]
struct Lin {
    x: BufId,
    out: BufId,
    k: u32,
    sub: u32,
    gathered: bool,
    /// Slices of K (`launch::tc_split`, from the weight's shape).
    split: u32,
    /// Whether the weight is held as MXFP8 on the device.
    mxfp8: bool,
}

fn linear_fields(v: &Variant, op: &Op, mxfp8: &impl Fn(WeightId) -> bool) -> Option<Lin> {
    match op {
        Op::Linear {
            x,
            w,
            out,
            k,
            n,
            sub,
            ..
        } => Some(Lin {
            x: *x,
            out: *out,
            k: *k,
            sub: *sub,
            gathered: linear_gathered(v, *x, *k, *sub),
            split: super::launch::tc_split(*k, *n),
            mxfp8: mxfp8(*w),
        }),
        _ => None,
    }
}

/// The variant's launches as node ranges, in node order, covering every node exactly once: a range of two or more
/// nodes is a run of sibling linears launched as one `linear_multi` or `linear_multi_mxfp8` (see the module
/// documentation for the rule), a range of one node is that node's own launch. `mxfp8(w)`: whether weight `w` is
/// held as MXFP8 on the device.
pub(crate) fn launch_groups(v: &Variant, mxfp8: impl Fn(WeightId) -> bool) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let mut i = 0;
    while i < v.nodes.len() {
        let mut j = i + 1;
        if let Some(first) = linear_fields(v, &v.nodes[i].op, &mxfp8) {
            if !overlap(v, first.out, first.x) {
                let mut outs = vec![first.out];
                while j < v.nodes.len() && j - i < MAX_LINEARS {
                    let Some(l) = linear_fields(v, &v.nodes[j].op, &mxfp8) else {
                        break;
                    };
                    let joins = l.x == first.x
                        && l.k == first.k
                        && l.sub == first.sub
                        && l.gathered == first.gathered
                        && l.split == first.split
                        && l.mxfp8 == first.mxfp8
                        && !overlap(v, l.out, first.x)
                        && outs.iter().all(|&o| !overlap(v, l.out, o));
                    if !joins {
                        break;
                    }
                    outs.push(l.out);
                    j += 1;
                }
            }
        }
        groups.push(i..j);
        i = j;
    }
    groups
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use flashplan_plan::{BufferDecl, CompileOptions, ModelConfig, Node, PlanBody, Space};

    /// CPU plans of the tiny fixture (layers 0-2 GDN, layer 3 attention); also used by `launch`'s tests.
    pub(in crate::cuda) fn tiny_plan() -> PlanBody {
        tiny_plan_with(|_| {})
    }

    /// [`tiny_plan`] of the fixture's config after `edit` (its JSON).
    pub(in crate::cuda) fn tiny_plan_with(edit: impl FnOnce(&mut serde_json::Value)) -> PlanBody {
        tiny_plan_for(vec![2], edit)
    }

    /// [`tiny_plan_with`] for the stream counts `streams`.
    pub(in crate::cuda) fn tiny_plan_for(
        streams: Vec<u32>,
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> PlanBody {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-text");
        let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
        let mut json: serde_json::Value = serde_json::from_str(&text).expect("json");
        edit(&mut json);
        let cfg = ModelConfig::from_json_str(&json.to_string()).expect("config parses");
        let opts = CompileOptions {
            arch: "cpu".into(),
            max_depth: 2,
            streams,
            context: 64,
            prefill_chunk: 8,
        };
        flashplan_compiler::compile(&cfg, &opts, &Default::default(), "test", |_, _| {})
            .expect("compiles")
            .body
    }

    fn no_mxfp8(_: WeightId) -> bool {
        false
    }

    /// Index of the first `Linear` node of `layer`.
    fn first_linear(v: &Variant, layer: u32) -> usize {
        v.nodes
            .iter()
            .position(|n| n.layer == Some(layer) && matches!(n.op, Op::Linear { .. }))
            .expect("a linear in the layer")
    }

    fn lens_from(groups: &[Range<usize>], at: usize, count: usize) -> Vec<usize> {
        let i = groups
            .iter()
            .position(|g| g.start == at)
            .expect("a group starts there");
        groups[i..i + count].iter().map(|g| g.len()).collect()
    }

    fn linear_mut(n: &mut Node) -> (&mut BufId, &mut BufId) {
        match &mut n.op {
            Op::Linear { x, out, .. } => (x, out),
            _ => panic!("not a linear"),
        }
    }

    fn new_buf(v: &mut Variant, elems: u64) -> BufId {
        let offset = v.arena_elems.max(
            v.buffers
                .iter()
                .filter(|b| b.space == Space::Arena)
                .map(|b| b.offset + b.elems)
                .max()
                .unwrap_or(0),
        );
        v.buffers.push(BufferDecl {
            name: format!("test.extra{}", v.buffers.len()),
            space: Space::Arena,
            elems,
            offset,
        });
        v.arena_elems = offset + elems;
        BufId((v.buffers.len() - 1) as u32)
    }

    #[test]
    fn gdn_and_attention_projections_group() {
        let body = tiny_plan();
        let mut checked = 0;
        for v in &body.variants {
            let groups = launch_groups(v, no_mxfp8);
            // Every node exactly once, in order.
            let mut next = 0;
            for g in &groups {
                assert_eq!(g.start, next, "{}", v.kind.name());
                assert!(!g.is_empty() && g.len() <= MAX_LINEARS);
                next = g.end;
            }
            assert_eq!(next, v.nodes.len());
            // Fused runs: linears reading one x.
            for g in groups.iter().filter(|g| g.len() > 1) {
                let xs: Vec<BufId> = v.nodes[g.clone()]
                    .iter()
                    .map(|n| match n.op {
                        Op::Linear { x, .. } => x,
                        _ => panic!("{}: a fused non-linear", v.kind.name()),
                    })
                    .collect();
                assert!(xs.iter().all(|&x| x == xs[0]));
            }
            // Main-model variants (MTP variants run no numbered layer): GDN layer 0's qkv, z, b, a in one
            // launch; attention layer 3's q, k, v and indexer qk.
            if !v.nodes.iter().any(|n| n.layer == Some(0)) {
                continue;
            }
            checked += 1;
            // The output sizes of the 4 linears fused from the layer's first, which must be one launch.
            let fused_ns = |layer: u32| -> Vec<u32> {
                let g = first_linear(v, layer);
                assert!(groups.contains(&(g..g + 4)), "{}", v.kind.name());
                v.nodes[g..g + 4]
                    .iter()
                    .map(|n| match n.op {
                        Op::Linear { n, .. } => n,
                        _ => 0,
                    })
                    .collect()
            };
            let ns = fused_ns(0);
            let c = &body.config;
            let hv = c.linear_num_value_heads;
            assert_eq!(
                ns,
                vec![c.gdn_conv_dim(), hv * c.linear_value_head_dim, hv, hv]
            );
            // Attention layer 3: q, k, v and the indexer's qk projection (compiler/src/graph.rs emits it right
            // after v).
            let ns = fused_ns(3);
            let kv = c.num_key_value_heads * c.head_dim;
            assert_eq!(
                ns,
                vec![
                    2 * c.num_attention_heads * c.head_dim,
                    kv,
                    kv,
                    (c.indexer_n_heads + 1) * c.indexer_head_dim
                ]
            );
        }
        assert!(checked > 0, "no main-model variant");
    }

    #[test]
    fn runs_break_where_fusion_is_unsafe() {
        let body = tiny_plan();
        let v0 = body
            .variants
            .iter()
            .find(|v| v.kind.shape() == (1, 1))
            .expect("a one-row variant");
        let g0 = first_linear(v0, 0);
        let w_of = |v: &Variant, i: usize| match v.nodes[i].op {
            Op::Linear { w, .. } => w,
            _ => panic!("not a linear"),
        };
        assert_eq!(lens_from(&launch_groups(v0, no_mxfp8), g0, 1), vec![4]);

        // A weight held in the other form breaks the run: z alone as MXFP8 gets its own launch.
        let wz = w_of(v0, g0 + 1);
        let g = launch_groups(v0, |w| w == wz);
        assert_eq!(lens_from(&g, g0, 3), vec![1, 1, 2]);
        // Siblings all held as MXFP8 are one run (`linear_multi_mxfp8`), as all BF16 are.
        let mx: Vec<WeightId> = (g0..g0 + 4).map(|i| w_of(v0, i)).collect();
        let g = launch_groups(v0, |w| mx.contains(&w));
        assert_eq!(lens_from(&g, g0, 1), vec![4]);
        // qkv and z as MXFP8, b and a as BF16: two runs of two.
        let g = launch_groups(v0, |w| mx[..2].contains(&w));
        assert_eq!(lens_from(&g, g0, 2), vec![2, 2]);

        // A different x (z reads another buffer).
        let mut v = v0.clone();
        let x = *linear_mut(&mut v.nodes[g0]).0;
        let elems = v.buf(x).elems;
        let other = new_buf(&mut v, elems);
        *linear_mut(&mut v.nodes[g0 + 1]).0 = other;
        assert_eq!(
            lens_from(&launch_groups(&v, no_mxfp8), g0, 3),
            vec![1, 1, 2]
        );

        // b writes x, which the run reads: the run stops before b, and b (writing its own input) runs alone.
        let mut v = v0.clone();
        *linear_mut(&mut v.nodes[g0 + 2]).1 = x;
        assert_eq!(
            lens_from(&launch_groups(&v, no_mxfp8), g0, 3),
            vec![2, 1, 1]
        );

        // a writes qkv's output: a runs on its own.
        let mut v = v0.clone();
        let qkv = *linear_mut(&mut v.nodes[g0]).1;
        *linear_mut(&mut v.nodes[g0 + 3]).1 = qkv;
        assert_eq!(lens_from(&launch_groups(&v, no_mxfp8), g0, 2), vec![3, 1]);

        // An output overlapping another one in part (same space, intersecting element ranges) also breaks the run.
        let mut v = v0.clone();
        let b_out = *linear_mut(&mut v.nodes[g0 + 2]).1;
        let d = v.buf(b_out).clone();
        v.buffers.push(BufferDecl {
            name: "test.overlap".into(),
            space: d.space,
            elems: d.elems,
            offset: d.offset + d.elems / 2,
        });
        *linear_mut(&mut v.nodes[g0 + 3]).1 = BufId((v.buffers.len() - 1) as u32);
        assert_eq!(lens_from(&launch_groups(&v, no_mxfp8), g0, 2), vec![3, 1]);

        // Five siblings (a fifth linear on x with its own output): a run of four, then one.
        let mut v = v0.clone();
        let mut fifth = v.nodes[g0 + 3].clone();
        let a_out = *linear_mut(&mut fifth).1;
        let elems = v.buf(a_out).elems;
        *linear_mut(&mut fifth).1 = new_buf(&mut v, elems);
        v.nodes.insert(g0 + 4, fifth);
        assert_eq!(lens_from(&launch_groups(&v, no_mxfp8), g0, 2), vec![4, 1]);
    }
}
