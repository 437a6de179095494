//! The plan compiler: config -> weight manifest and state layout -> op graph per variant -> arena by liveness ->
//! validated, serialized plan set (`architecture.md`).
#![warn(missing_docs)]

pub mod checkpoint;
pub mod cli;
pub mod deps;
pub mod graph;
pub mod inspect;
pub mod launch;
pub mod manifest;
pub mod memory;
pub mod nvrtc;
pub mod state;

use flashplan_plan::{
    CompileOptions, DrafterForm, FormatError, IoLayout, ModelConfig, PlanBody, PlanSet, Variant,
    VariantKind,
};

pub use inspect::{inspect_path, report_human, report_json, InspectOptions};
pub use manifest::FormSource;

/// The arch of the CPU reference backend, the base every caller starts from before choosing a backend.
pub fn default_arch() -> &'static str {
    "cpu"
}

/// The arch `flashplan compile` targets when `--arch` is not given: `sm_90a` when this machine has a Hopper GPU
/// (compute capability 9.0, the only arch the kernels are built for), else `cpu`. Only the driver library is
/// probed (loaded at run time); a machine without CUDA answers `cpu`.
pub fn detect_arch() -> String {
    use cudarc::driver::{result, sys};
    let probe = || -> Option<String> {
        // SAFETY: only tries to load the driver library.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        result::init().ok()?;
        if result::device::get_count().ok()? < 1 {
            return None;
        }
        let dev = result::device::get(0).ok()?;
        let attr = |a| unsafe { result::device::get_attribute(dev, a) }.ok();
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        (major == 9 && minor == 0).then(|| "sm_90a".to_string())
    };
    probe().unwrap_or_else(|| default_arch().to_string())
}

/// The compiler's version, recorded in every plan header.
pub const COMPILER_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Errors compiling plans.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// An option is out of range.
    #[error("option {name} = {value}: expected {expected}")]
    Option {
        /// Option name.
        name: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// Building a graph failed (an internal inconsistency).
    #[error(transparent)]
    Graph(#[from] graph::GraphError),
    /// Compiling the kernels with NVRTC failed (GPU archs only).
    #[error(transparent)]
    Nvrtc(#[from] nvrtc::NvrtcError),
    /// Sealing the plan failed validation.
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// Default options: max depth 15, streams 1, 2, 4, 8, 16, context 32768, prefill chunks of 64 rows.
pub fn default_options(arch: &str) -> CompileOptions {
    CompileOptions {
        arch: arch.to_string(),
        max_depth: 15,
        streams: vec![1, 2, 4, 8, 16],
        context: DEFAULT_CONTEXT,
        prefill_chunk: 64,
    }
}

/// Every variant kind the runtime may replay for these options.
pub fn variant_kinds(cfg: &ModelConfig, o: &CompileOptions) -> Vec<VariantKind> {
    let mut kinds = Vec::new();
    let windows = 1..=o.max_depth + 1;
    for &s in &o.streams {
        for w in windows.clone() {
            kinds.push(VariantKind::Verify {
                streams: s,
                window: w,
            });
        }
    }
    for w in windows.clone() {
        kinds.push(VariantKind::Lone { window: w });
    }
    kinds.push(VariantKind::Prefill {
        chunk: o.prefill_chunk,
    });
    if cfg.mtp.is_some() {
        for form in DrafterForm::ALL {
            for &s in &o.streams {
                for w in windows.clone() {
                    kinds.push(VariantKind::MtpAbsorb {
                        streams: s,
                        window: w,
                        form,
                    });
                }
                kinds.push(VariantKind::MtpChain { streams: s, form });
            }
            if o.prefill_chunk > o.max_depth + 1 {
                kinds.push(VariantKind::MtpAbsorb {
                    streams: 1,
                    window: o.prefill_chunk,
                    form,
                });
            }
        }
    }
    kinds
}

/// The archs plans are compiled for: the CPU reference backend and Hopper (`sm_90a`: the kernels use its
/// programmatic dependent launch and are emitted as cubin for it).
pub const SUPPORTED_ARCHS: &[&str] = &["cpu", "sm_90a"];

/// Checks compile options as given (before [`compile`] adds the lone stream): the arch, depth, stream counts, context
/// and prefill chunk in their ranges.
///
/// # Errors
/// [`CompileError::Option`] naming the first option out of range, its value and what is expected.
pub fn check_options(o: &CompileOptions) -> Result<(), CompileError> {
    let bad = |name, value: String, expected| {
        Err(CompileError::Option {
            name,
            value,
            expected,
        })
    };
    if !SUPPORTED_ARCHS.contains(&o.arch.as_str()) {
        return bad(
            "--arch",
            o.arch.clone(),
            "cpu or sm_90a (Hopper: H100, H200); the kernels are built for no other NVIDIA arch",
        );
    }
    if o.max_depth > 63 {
        return bad(
            "--max-depth",
            o.max_depth.to_string(),
            "an integer in 0..=63",
        );
    }
    // An empty list plans the lone stream alone (compile adds it to every list).
    if o.streams.iter().any(|&s| s == 0 || s > 256) {
        return bad(
            "--streams",
            format!("{:?}", o.streams),
            "a list of stream counts in 1..=256",
        );
    }
    if o.context < MIN_CONTEXT || o.context > MAX_CONTEXT {
        return bad(
            "--context",
            o.context.to_string(),
            "a context length in 16..=16777216 tokens",
        );
    }
    // A request needs a prompt token and a reply token besides the verify window every stream keeps past its reply
    // (max depth + 1 rows): a shorter context would serve no request.
    if o.context < o.max_depth as u64 + 3 {
        return bad(
            "--context",
            format!(
                "{} (needs {} at --max-depth {})",
                o.context,
                o.max_depth as u64 + 3,
                o.max_depth
            ),
            "at least max depth + 3 tokens: one verify window of max depth + 1 rows past a prompt token and a reply \
             token",
        );
    }
    if o.prefill_chunk == 0 || o.prefill_chunk > 4096 {
        return bad(
            "--prefill-chunk",
            o.prefill_chunk.to_string(),
            "rows in 1..=4096",
        );
    }
    Ok(())
}

/// The smallest context per stream a plan set takes (tokens; `--context`).
pub const MIN_CONTEXT: u64 = 16;
/// The largest context per stream a plan set takes (tokens; `--context`).
pub const MAX_CONTEXT: u64 = 1 << 24;

/// The context per stream when none is asked for (`compile`, `run` and `serve` without `--context`), for a model
/// trained for at least as many positions ([`default_context`]).
pub const DEFAULT_CONTEXT: u64 = 32768;

/// The context compiled when `--context` is not given: [`DEFAULT_CONTEXT`], or the positions the model was trained
/// for when fewer ([`trained_positions`]; vLLM's default `max_model_len` is likewise the model's length), but at
/// least [`MIN_CONTEXT`] and the smallest context [`check_options`] takes at `max_depth` (max depth + 3).
pub fn default_context(cfg: &ModelConfig, max_depth: u32) -> u64 {
    DEFAULT_CONTEXT
        .min(trained_positions(cfg))
        .max(MIN_CONTEXT)
        .max(max_depth as u64 + 3)
}

/// The positions the model was trained for: `max_position_embeddings`, or with YaRN RoPE (`rope_type` `yarn`) the
/// original length times its `factor` when that is more. The original length is `original_max_position_embeddings`,
/// or `max_position_embeddings` when the config has none (as transformers' `_compute_yarn_parameters` reads it).
/// Configs differ in which length they store as `max_position_embeddings`: the published Flash Next config stores
/// the scaled 524288 = 262144 x 2.
pub fn trained_positions(cfg: &ModelConfig) -> u64 {
    let scaled = if cfg.rope.rope_type == "yarn" {
        let original = cfg
            .rope
            .original_max_position_embeddings
            .unwrap_or(cfg.max_position_embeddings);
        (original as f64 * cfg.rope.factor) as u64
    } else {
        0
    };
    cfg.max_position_embeddings.max(scaled)
}

/// A note for a plan context past the positions the model was trained for ([`trained_positions`]), or `None`.
/// Such plans still compile and run, as transformers runs any position; the note says what the user asked for.
pub fn context_note(cfg: &ModelConfig, context: u64) -> Option<String> {
    let trained = trained_positions(cfg);
    (context > trained).then(|| {
        format!(
            "note: the context, {context} tokens, is past the {trained} positions the model was trained for \
             (max_position_embeddings and RoPE scaling of its config): positions beyond them are untested ground"
        )
    })
}

/// A note naming the fields that size the model which the config.json `text` leaves out, with the values taken
/// ([`flashplan_plan::config::defaulted_size_fields`]), or `None` when it has them all.
pub fn defaulted_note(text: &str, cfg: &ModelConfig) -> Option<String> {
    let fields = flashplan_plan::config::defaulted_size_fields(text, cfg);
    (!fields.is_empty()).then(|| {
        let list: Vec<String> = fields.iter().map(|(k, v)| format!("{k} = {v}")).collect();
        format!(
            "note: the config leaves out {}: transformers' defaults are taken",
            list.join(", ")
        )
    })
}

/// Compiles the plan set for a config. `progress` is called after each variant with (done, total).
///
/// # Errors
/// [`CompileError`] for out-of-range options or a plan that fails validation.
pub fn compile(
    cfg: &ModelConfig,
    options: &CompileOptions,
    forms: &FormSource,
    kernel_source_hash: &str,
    mut progress: impl FnMut(usize, usize),
) -> Result<PlanSet, CompileError> {
    // The options as given are checked first, so that an error quotes what the user wrote.
    check_options(options)?;
    let mut options = options.clone();
    // One stream is always planned: prefill absorbs and lone MTP steps use it.
    options.streams.push(1);
    options.streams.sort_unstable();
    options.streams.dedup();
    let weights = manifest::build_manifest(cfg, forms);
    let max_streams = *options.streams.iter().max().unwrap_or(&1);
    let state = state::build_state(cfg, options.context, max_streams);
    let kinds = variant_kinds(cfg, &options);
    let mut variants = Vec::with_capacity(kinds.len());
    let mut max_rows = 1;
    for (i, kind) in kinds.iter().enumerate() {
        let (s, w) = kind.shape();
        max_rows = max_rows.max(s * w);
        let b = graph::Builder::new(cfg, &weights, &state, s, w);
        let (buffers, nodes) = b.build(*kind)?;
        let mut v = Variant {
            kind: *kind,
            buffers,
            nodes,
            arena_elems: 0,
            arena_elems_no_reuse: 0,
        };
        memory::assign_arena(&mut v);
        variants.push(v);
        progress(i + 1, kinds.len());
    }
    let arena_elems = variants.iter().map(|v| v.arena_elems).max().unwrap_or(0);
    // GPU archs carry their cubins, and the header names the kernel sources they were built from.
    let (kernels, kernel_source_hash) = if options.arch == "cpu" {
        (Vec::new(), kernel_source_hash.to_string())
    } else {
        (nvrtc::compile_kernels(&options.arch)?, nvrtc::source_hash())
    };
    let body = PlanBody {
        config: cfg.clone(),
        options,
        weights,
        state,
        io: IoLayout {
            max_rows,
            max_streams,
        },
        arena_elems,
        kernels,
        variants,
    };
    Ok(PlanSet::seal(body, &kernel_source_hash, COMPILER_VERSION)?)
}
