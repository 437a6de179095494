//! Compiled plans: determinism, corrupt and mismatched files refused, the validator catching planted faults, arena
//! reuse, and the inspect report.

use std::path::Path;

use flashplan_compiler::{
    compile, default_options, deps::fill_deps, FormSource, MAX_CONTEXT, MIN_CONTEXT,
};
use flashplan_plan::validate::{lifetimes, validate_state, validate_variant};
use flashplan_plan::{
    BufId, BufferDecl, FormatError, ModelConfig, Op, PlanSet, Space, ValidationError, VariantKind,
    STATE_ALIGN,
};

fn cfg(name: &str) -> ModelConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs")
        .join(name);
    ModelConfig::from_json_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn real() -> ModelConfig {
    cfg("flash-next.json")
}

fn tiny() -> ModelConfig {
    cfg("flashnext-tiny.json")
}

fn build(c: &ModelConfig, context: u64) -> PlanSet {
    let mut o = default_options("cpu");
    o.context = context;
    compile(c, &o, &FormSource::default(), "none", |_, _| {}).unwrap()
}

#[test]
fn compiling_twice_gives_identical_files() {
    for (c, ctx) in [(real(), 32768), (tiny(), 4096)] {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.fplan"), dir.path().join("b.fplan"));
        build(&c, ctx).write_atomic(&a).unwrap();
        build(&c, ctx).write_atomic(&b).unwrap();
        let (a, b) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        assert!(a.len() > 1000);
        assert!(a == b, "two compiles of the same config differ");
        // And the file reads back to the same plan.
        let back = PlanSet::from_bytes(&a, Path::new("a.fplan")).unwrap();
        assert_eq!(back.to_bytes().unwrap(), a);
    }
}

#[test]
fn variant_set_is_complete() {
    let set = build(&real(), 32768);
    let b = &set.body;
    // 5 stream counts x 16 windows of verify, 16 lone, 1 prefill, and per drafter form 5 x 16 absorbs, 5 chains
    // and the prefill-chunk absorb.
    assert_eq!(b.variants.len(), 80 + 16 + 1 + 3 * (80 + 5 + 1));
    for s in [1, 2, 4, 8, 16] {
        for w in 1..=16 {
            assert!(b
                .variant(VariantKind::Verify {
                    streams: s,
                    window: w
                })
                .is_some());
        }
    }
    assert!(b.variant(VariantKind::Prefill { chunk: 64 }).is_some());
}

fn corrupt_file() -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plans.fplan");
    build(&tiny(), 4096).write_atomic(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (dir, path, bytes)
}

#[test]
fn flipped_byte_is_refused_as_corrupt() {
    let (_d, path, mut bytes) = corrupt_file();
    let i = bytes.len() - 1000;
    bytes[i] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    match PlanSet::read(&path) {
        Err(e @ FormatError::Checksum { .. }) => {
            assert!(e.to_string().contains("checksum mismatch"), "{e}")
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
}

#[test]
fn truncated_file_is_refused() {
    let (_d, path, bytes) = corrupt_file();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        PlanSet::read(&path),
        Err(FormatError::Checksum { .. })
    ));
    std::fs::write(&path, &bytes[..20]).unwrap();
    match PlanSet::read(&path) {
        Err(e @ FormatError::NotAPlan { .. }) => {
            assert!(e.to_string().contains("not a flashplan plan file"), "{e}")
        }
        other => panic!("expected not-a-plan, got {other:?}"),
    }
    std::fs::write(&path, b"{\"model_type\": 1}").unwrap();
    assert!(matches!(
        PlanSet::read(&path),
        Err(FormatError::NotAPlan { .. })
    ));
}

#[test]
fn plan_for_another_config_or_arch_is_refused() {
    let set = build(&tiny(), 4096);
    set.check_matches(&tiny(), "cpu", None).unwrap();
    match set.check_matches(&real(), "cpu", None) {
        Err(FormatError::Mismatch {
            what: "config",
            found,
            expected,
        }) => {
            // The fields that size the model come first, whatever their names' order.
            let (t, r) = (tiny(), real());
            assert!(
                found.starts_with(&format!(
                    "num_hidden_layers = {}, hidden_size = {}, vocab_size = {}, num_experts = {} (and ",
                    t.num_hidden_layers, t.hidden_size, t.vocab_size, t.num_experts
                )),
                "{found}"
            );
            assert!(
                expected.starts_with(&format!(
                    "num_hidden_layers = {}, hidden_size = {}, vocab_size = {}, num_experts = {} (and ",
                    r.num_hidden_layers, r.hidden_size, r.vocab_size, r.num_experts
                )),
                "{expected}"
            );
        }
        other => panic!("expected a config mismatch, got {other:?}"),
    }
    // A long value (the 48 layer types) is cut short.
    let mut c = tiny();
    c.layer_types = real().layer_types;
    match set.check_matches(&c, "cpu", None) {
        Err(FormatError::Mismatch { expected, .. }) => {
            let v = expected
                .strip_prefix("layer_types = ")
                .expect("layer_types named");
            assert!(v.ends_with("...") && v.chars().count() == 63, "{expected}");
        }
        other => panic!("expected a config mismatch, got {other:?}"),
    }
    // A one-field change of the config is another config, and the error names the field with both values.
    let mut c = tiny();
    let eps = c.rms_norm_eps;
    c.rms_norm_eps = 1e-5;
    match set.check_matches(&c, "cpu", None) {
        Err(FormatError::Mismatch {
            what: "config",
            found,
            expected,
        }) => {
            assert_eq!(found, format!("rms_norm_eps = {}", serde_json::json!(eps)));
            assert_eq!(
                expected,
                format!("rms_norm_eps = {}", serde_json::json!(1e-5))
            );
        }
        other => panic!("expected a config mismatch, got {other:?}"),
    }
    match set.check_matches(&tiny(), "sm_90a", None) {
        Err(e @ FormatError::Mismatch { what: "arch", .. }) => {
            assert!(e.to_string().contains("arch"), "{e}")
        }
        other => panic!("expected an arch mismatch, got {other:?}"),
    }
    assert!(matches!(
        set.check_matches(&tiny(), "cpu", Some("abc")),
        Err(FormatError::Mismatch {
            what: "kernel sources",
            ..
        })
    ));
}

/// Two arena buffers live at the same time, the second no larger than the first (so moving it onto the first stays
/// in bounds).
fn overlapping_pair(v: &flashplan_plan::Variant) -> (usize, usize) {
    let life = lifetimes(v);
    for a in 0..v.buffers.len() {
        for b in 0..v.buffers.len() {
            let (da, db) = (&v.buffers[a], &v.buffers[b]);
            if a == b || da.space != Space::Arena || db.space != Space::Arena {
                continue;
            }
            let (Some((s1, e1)), Some((s2, e2))) = (life[a], life[b]) else {
                continue;
            };
            if s1 <= e2 && s2 <= e1 && db.elems <= da.elems && da.offset != db.offset {
                return (a, b);
            }
        }
    }
    panic!("no two simultaneously live arena buffers")
}

#[test]
fn validator_catches_planted_overlap() {
    let set = build(&tiny(), 4096);
    let mut body = set.body.clone();
    let vi = body
        .variants
        .iter()
        .position(|v| {
            v.kind
                == VariantKind::Verify {
                    streams: 2,
                    window: 4,
                }
        })
        .unwrap();
    validate_variant(&body, &body.variants[vi]).unwrap();
    let (a, b) = overlapping_pair(&body.variants[vi]);
    let off = body.variants[vi].buffers[a].offset;
    body.variants[vi].buffers[b].offset = off;
    let (na, nb) = (
        body.variants[vi].buffers[a].name.clone(),
        body.variants[vi].buffers[b].name.clone(),
    );
    match validate_variant(&body, &body.variants[vi]) {
        Err(ValidationError::Overlap { a, b, variant }) => {
            assert_eq!(variant, "verify-s2-w4");
            assert!(
                (a == na && b == nb) || (a == nb && b == na),
                "names {a}, {b}, planted {na}, {nb}"
            );
        }
        other => panic!("expected an overlap, got {other:?}"),
    }
    // Sealing (what writing does) refuses it too.
    assert!(matches!(
        PlanSet::seal(body, "none", "test"),
        Err(FormatError::Invalid(ValidationError::Overlap { .. }))
    ));
}

#[test]
fn validator_catches_read_of_never_written_buffer() {
    let set = build(&tiny(), 4096);
    let mut body = set.body.clone();
    let v = &mut body.variants[0];
    v.buffers.push(BufferDecl {
        name: "planted.never_written".into(),
        space: Space::Arena,
        elems: 64,
        offset: 0,
    });
    let planted = BufId(v.buffers.len() as u32 - 1);
    let ni = v
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Linear { .. }))
        .unwrap();
    if let Op::Linear { x, .. } = &mut v.nodes[ni].op {
        *x = planted;
    }
    match validate_variant(&body, &body.variants[0]) {
        Err(ValidationError::ReadBeforeWrite {
            node,
            buffer,
            kernel,
            ..
        }) => {
            assert_eq!(node, ni);
            assert_eq!(buffer, "planted.never_written");
            assert_eq!(kernel, "linear");
        }
        other => panic!("expected a read-before-write, got {other:?}"),
    }
}

#[test]
fn validator_catches_swapped_nodes() {
    let set = build(&tiny(), 4096);
    let mut body = set.body.clone();
    let v = &mut body.variants[0];
    // The GDN output projection reads what the gated norm just wrote; swap the two.
    let ni = v
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::GatedNorm { .. }))
        .unwrap();
    assert!(matches!(v.nodes[ni + 1].op, Op::Linear { .. }));
    v.nodes.swap(ni, ni + 1);
    fill_deps(&mut v.nodes);
    match validate_variant(&body, &body.variants[0]) {
        Err(ValidationError::ReadBeforeWrite {
            node,
            kernel,
            buffer,
            ..
        }) => {
            assert_eq!(node, ni);
            assert_eq!(kernel, "linear");
            assert!(buffer.ends_with("gdn.o_norm"), "{buffer}");
        }
        other => panic!("expected a read-before-write, got {other:?}"),
    }
}

#[test]
fn validator_catches_out_of_bounds_and_misaligned_offsets() {
    let set = build(&tiny(), 4096);
    let mut body = set.body.clone();
    body.variants[0]
        .buffers
        .iter_mut()
        .find(|b| b.space == Space::Arena)
        .unwrap()
        .offset += 1;
    assert!(matches!(
        validate_variant(&body, &body.variants[0]),
        Err(ValidationError::Bounds { .. })
    ));
    let mut body = set.body.clone();
    let arena = body.variants[0].arena_elems;
    body.variants[0]
        .buffers
        .iter_mut()
        .find(|b| b.space == Space::Arena)
        .unwrap()
        .offset = arena;
    assert!(matches!(
        validate_variant(&body, &body.variants[0]),
        Err(ValidationError::Bounds { .. })
    ));
}

#[test]
fn state_pieces_start_aligned_and_the_validator_refuses_others() {
    // The CUDA backend reads the GDN recurrent state as float4: every piece at a multiple of STATE_ALIGN elements.
    for cfg in [tiny(), real()] {
        let st = build(&cfg, 4096).body.state;
        assert_eq!(st.slot_elems % STATE_ALIGN, 0);
        for p in &st.pieces {
            assert_eq!(p.offset % STATE_ALIGN, 0, "{}", p.name);
        }
        // The PLE history (2 token ids) sits before a layer's GDN state in both configs: the padding is needed.
        assert!(st.pieces.iter().any(|p| p.elems() % STATE_ALIGN != 0));
        validate_state(&st).expect("aligned");
        let mut bad = st.clone();
        bad.pieces[1].offset += 2;
        let err = validate_state(&bad).expect_err("misaligned");
        assert!(matches!(err, ValidationError::State { .. }), "{err}");
        assert!(err.to_string().contains(&bad.pieces[1].name), "{err}");
        let mut bad = st.clone();
        bad.slot_elems -= STATE_ALIGN;
        assert!(validate_state(&bad).is_err());
    }
}

#[test]
fn arena_reuse_saves_memory() {
    let set = build(&real(), 32768);
    let b = &set.body;
    let mut worst: f64 = f64::MAX;
    for v in &b.variants {
        assert!(v.arena_elems <= v.arena_elems_no_reuse, "{}", v.kind.name());
        let r = v.arena_elems_no_reuse as f64 / v.arena_elems as f64;
        worst = worst.min(r);
    }
    let largest = b.variants.iter().max_by_key(|v| v.arena_elems).unwrap();
    let ratio = largest.arena_elems_no_reuse as f64 / largest.arena_elems as f64;
    let total_no_reuse: u64 = b
        .variants
        .iter()
        .map(|v| v.arena_elems_no_reuse)
        .max()
        .unwrap();
    println!(
        "largest variant {}: arena {} elems with reuse, {} without: {ratio:.2}x; least saving over all variants {worst:.2}x; arena {} vs {} MiB",
        largest.kind.name(),
        largest.arena_elems,
        largest.arena_elems_no_reuse,
        (b.arena_elems * 4) >> 20,
        (total_no_reuse * 4) >> 20
    );
    assert!(
        ratio > 3.0,
        "reuse saves only {ratio:.2}x on the largest variant"
    );
    assert!(worst > 2.5, "reuse saves only {worst:.2}x on some variant");
}

#[test]
fn inspect_reports_every_variant() {
    let set = build(&real(), 32768);
    let j = flashplan_compiler::report_json(&set);
    assert_eq!(j["variant_count"], 355);
    assert_eq!(j["variants"].as_array().unwrap().len(), 355);
    assert_eq!(j["state"]["context"], 32768);
    assert_eq!(j["state"]["slot_bytes"], set.body.state.slot_bytes);
    assert_eq!(j["extra_keys"]["mamba_ssm_dtype"], "\"float32\"");
    assert_eq!(j["header"]["arch"], "cpu");
    assert!(j["kernel_modules"].as_array().unwrap().is_empty());
    let v = &j["variants"][0];
    assert_eq!(v["name"], "verify-s1-w1");
    // Every node is counted once: per layer plus outside the layers, and per kernel.
    let per_layer: u64 = v["nodes_per_layer"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .sum();
    let per_kernel: u64 = v["nodes_per_kernel"]
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_u64().unwrap())
        .sum();
    let nodes = v["nodes"].as_u64().unwrap();
    assert_eq!(
        per_layer + v["nodes_outside_layers"].as_u64().unwrap(),
        nodes
    );
    assert_eq!(per_kernel, nodes);
    assert_eq!(v["nodes_per_layer"].as_array().unwrap().len(), 48);
    for w in ["Main", "Mtp", "MtpMxfp8", "HeadMxfp8"] {
        assert!(j["weights"][w]["bytes"].as_u64().unwrap() > 0, "{w}");
    }
    let text = flashplan_compiler::report_human(&set, false);
    assert!(
        text.contains("verify-s16") && text.contains("mtp-chain-mxfp8-head"),
        "{text}"
    );
    assert!(text.contains("mamba_ssm_dtype"));
    assert!(
        text.lines().count() < 80,
        "compact report has {} lines",
        text.lines().count()
    );
    let all = flashplan_compiler::report_human(&set, true);
    assert!(all.contains("mtp-absorb-s16-w16-mxfp8-head"));
    assert!(all.lines().count() > 355);
}

#[test]
fn inspect_path_accepts_dir_and_file() {
    let dir = tempfile::tempdir().unwrap();
    build(&tiny(), 4096)
        .write_atomic(&dir.path().join("plans.fplan"))
        .unwrap();
    let opts = flashplan_compiler::InspectOptions {
        json: true,
        all: false,
    };
    let a = flashplan_compiler::inspect_path(dir.path(), opts).unwrap();
    let b = flashplan_compiler::inspect_path(&dir.path().join("plans.fplan"), opts).unwrap();
    assert_eq!(a, b);
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!(v["variant_count"], 355);
    let empty = tempfile::tempdir().unwrap();
    let err = flashplan_compiler::inspect_path(empty.path(), opts).unwrap_err();
    assert!(err.to_string().contains("plans.fplan"), "{err}");
}

#[test]
fn bad_options_are_refused() {
    let c = tiny();
    for (o, name) in [
        (
            {
                let mut o = default_options("cuda");
                o.context = 4096;
                o
            },
            "--arch",
        ),
        (
            {
                let mut o = default_options("cpu");
                o.streams = vec![0];
                o
            },
            "--streams",
        ),
        (
            {
                let mut o = default_options("cpu");
                o.context = 1;
                o
            },
            "--context",
        ),
        (
            {
                let mut o = default_options("cpu");
                o.prefill_chunk = 0;
                o
            },
            "--prefill-chunk",
        ),
    ] {
        let Err(err) = compile(&c, &o, &FormSource::default(), "none", |_, _| {}) else {
            panic!("option {name} out of range was accepted");
        };
        assert!(err.to_string().contains(name), "{err}");
    }
    // The context's bounds are the published constants, each end taken and one past it refused with them named.
    let range = format!("{MIN_CONTEXT}..={MAX_CONTEXT}");
    for (context, ok) in [
        (MIN_CONTEXT - 1, false),
        (MIN_CONTEXT, true),
        (MAX_CONTEXT, true),
        (MAX_CONTEXT + 1, false),
    ] {
        let mut o = default_options("cpu");
        o.context = context;
        o.streams = vec![1];
        o.max_depth = 1;
        match compile(&c, &o, &FormSource::default(), "none", |_, _| {}) {
            Ok(_) => assert!(ok, "context {context} was accepted"),
            Err(e) => assert!(
                !ok && e.to_string().contains(&range),
                "context {context}: {e}"
            ),
        }
    }
    // A context must hold one verify window (max depth + 1 rows) past a prompt token and a reply token: else the
    // plans would serve no request (their max_model_len below 2). The default context of a model trained for fewer
    // positions is raised to it.
    let mut short = c.clone();
    short.max_position_embeddings = 8;
    assert_eq!(flashplan_compiler::default_context(&short, 1), 16);
    assert_eq!(flashplan_compiler::default_context(&short, 15), 18);
    assert_eq!(flashplan_compiler::default_context(&short, 61), 64);
    for (context, max_depth, ok) in [
        (17, 15, false),
        (18, 15, true),
        (63, 61, false),
        (64, 61, true),
    ] {
        let mut o = default_options("cpu");
        o.context = context;
        o.streams = vec![1];
        o.max_depth = max_depth;
        match compile(&c, &o, &FormSource::default(), "none", |_, _| {}) {
            Ok(_) => assert!(ok, "context {context} at depth {max_depth} was accepted"),
            Err(e) => {
                assert!(
                    !ok,
                    "context {context} at depth {max_depth} was refused: {e}"
                );
                assert_eq!(
                    e.to_string(),
                    format!(
                        "option --context = {context} (needs {} at --max-depth {max_depth}): expected at least max \
                         depth + 3 tokens: one verify window of max depth + 1 rows past a prompt token and a reply \
                         token",
                        max_depth + 3
                    )
                );
            }
        }
    }
}

#[test]
fn mtp_steps_of_one_row_a_stream_read_the_mixer_from_the_streams() {
    // The final mixer reads each stream's last row. With one row a stream (every chain step, and absorbs of a window
    // of one) that row is the MTP streams themselves: no LastRows copy, and the mixer's read follows the MLP's write
    // on the same buffer (which the CUDA backend then fuses, `hc_write_norm`). Wider absorbs keep the copy.
    let set = build(&tiny(), 4096);
    let (mut narrow, mut wide) = (0, 0);
    for v in &set.body.variants {
        let (VariantKind::MtpChain { .. } | VariantKind::MtpAbsorb { .. }) = v.kind else {
            continue;
        };
        let copies = v
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::LastRows { .. }))
            .count();
        let reads: Vec<usize> = (0..v.nodes.len())
            .filter(|&i| matches!(v.nodes[i].op, Op::HcRead { .. }))
            .collect();
        let mixer = *reads.last().expect("the final mixer's read");
        let Op::HcRead { h, .. } = v.nodes[mixer].op else {
            unreachable!()
        };
        let (streams, window) = v.kind.shape();
        if window == 1 {
            narrow += 1;
            assert_eq!(copies, 0, "{:?}", v.kind);
            let Op::HcWrite { h: written, .. } = v.nodes[mixer - 1].op else {
                panic!("{:?}: the mixer's read does not follow a write", v.kind);
            };
            assert_eq!(h, written, "{:?}", v.kind);
        } else {
            wide += 1;
            assert_eq!(copies, 1, "{:?}", v.kind);
            assert_eq!(
                v.buf(h).elems,
                streams as u64 * set.body.config.hc_width() as u64,
                "{:?}: the mixer reads one row a stream",
                v.kind
            );
        }
    }
    assert!(
        narrow > 0 && wide > 0,
        "{narrow} narrow, {wide} wide MTP steps"
    );
}

#[test]
fn validator_refuses_an_mtp_sample_without_probabilities() {
    let set = build(&tiny(), 4096);
    let mut body = set.body.clone();
    let vi = body
        .variants
        .iter()
        .position(|v| matches!(v.kind, VariantKind::MtpChain { .. }))
        .expect("an MTP chain variant");
    validate_variant(&body, &body.variants[vi]).unwrap();
    let ni = body.variants[vi]
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Sample { .. }))
        .expect("the step's sampling");
    if let Op::Sample { probs, .. } = &mut body.variants[vi].nodes[ni].op {
        assert!(probs.is_some(), "the MTP step samples with probabilities");
        *probs = None;
    }
    match validate_variant(&body, &body.variants[vi]) {
        Err(ValidationError::Reference { node, why, .. }) => {
            assert_eq!(node, ni);
            assert!(why.contains("probabilities"), "{why}");
        }
        other => panic!("expected a reference error, got {other:?}"),
    }
    // The main model's rounds sample without them.
    let verify = body
        .variants
        .iter()
        .find(|v| matches!(v.kind, VariantKind::Verify { .. }))
        .expect("a verify variant");
    assert!(verify
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::Sample { probs: None, .. })));
}
