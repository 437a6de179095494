//! Loading a model for `run`, `serve`, `bench` and `demo`: plans (given, or compiled on first use into the cache),
//! the checkpoint, the tokenizer, the backend and the engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use flashplan_compiler::default_context;
use flashplan_compiler::inspect::PLAN_FILE;
use flashplan_plan::{CompileOptions, ModelConfig, PlanBody, PlanSet};
use flashplan_runtime::backend::Backend;
use flashplan_runtime::checkpoint::{load_checkpoint, LoadOptions};
use flashplan_runtime::cpu::CpuBackend;
use flashplan_runtime::cuda::{probe_gpu, CudaBackend};
use flashplan_runtime::engine::{Engine, EngineOptions, EnvError};
use flashplan_runtime::tokenizer::Tokenizer;
use sha2::{Digest, Sha256};

/// Options shared by the commands that load a model.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model directory: config.json, safetensors, tokenizer.json, tokenizer_config.json.
    #[arg(long)]
    pub model: PathBuf,
    /// Plans (a plans.fplan file or a directory holding one). Default: compiled on first use into the cache
    /// ($FLASHPLAN_CACHE, else ~/.cache/flashplan/plans).
    #[arg(long)]
    pub plans: Option<PathBuf>,
    /// Most streams decoding at once (at least 1).
    #[arg(long, allow_negative_numbers = true, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub parallel: u32,
    /// Most drafts per verify window (at most the plans' max depth).
    #[arg(long, allow_negative_numbers = true, default_value_t = 15)]
    pub max_depth: u32,
    /// Context per stream (tokens) when compiling plans into the cache [default: 32768, or the positions the
    /// model was trained for when fewer]. With --plans the plans'
    /// context holds, and a --context other than it is refused.
    #[arg(long, allow_negative_numbers = true)]
    pub context: Option<u64>,
    /// MTP confidence threshold: a chained draft whose probability (temperature 1) is below it ends the chain;
    /// the first draft is always kept.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.3)]
    pub confidence: f32,
}

/// A model ready to serve.
pub struct Loaded {
    /// The engine over its backend (CUDA when a GPU is present and the plans could be built for it, else CPU).
    pub engine: Engine<Box<dyn Backend>>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's name (its directory's name).
    pub name: String,
}

/// A folder named by the environment variable `name`: `None` when unset.
///
/// # Errors
/// Set but empty (it would mean the current directory): refused, naming the variable.
pub fn folder_var(name: &str) -> anyhow::Result<Option<PathBuf>> {
    flashplan_plan::env::folder(name).map_err(|e| anyhow::anyhow!("{e} (unset it for the default)"))
}

/// The plans cache directory: `$FLASHPLAN_CACHE`, else `~/.cache/flashplan/plans`.
///
/// # Errors
/// As [`folder_var`].
pub fn cache_dir() -> anyhow::Result<PathBuf> {
    if let Some(d) = folder_var("FLASHPLAN_CACHE")? {
        return Ok(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    Ok(home.join(".cache/flashplan/plans"))
}

/// Which backend to use: `FLASHPLAN_BACKEND` = `auto` (default: CUDA when a usable GPU is present, else CPU),
/// `cpu` or `cuda` (an error when the CUDA backend cannot start). Any other value refuses to start, naming the
/// variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when possible, else CPU (saying why).
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend or an error.
    Cuda,
}

/// The backend choice from `FLASHPLAN_BACKEND`.
pub fn backend_choice() -> anyhow::Result<BackendChoice> {
    let Some(v) = std::env::var_os("FLASHPLAN_BACKEND") else {
        return Ok(BackendChoice::Auto);
    };
    match v.to_str() {
        Some("auto") => Ok(BackendChoice::Auto),
        Some("cpu") => Ok(BackendChoice::Cpu),
        Some("cuda") => Ok(BackendChoice::Cuda),
        _ => Err(EnvError {
            name: "FLASHPLAN_BACKEND",
            value: v.to_string_lossy().into_owned(),
            expected: "auto, cpu, cuda",
        }
        .into()),
    }
}

/// The CUDA arch the plans are compiled for on this machine's GPU, or why there is none: the kernels are built
/// for Hopper (`sm_90a`), so only a compute capability 9.0 device qualifies.
pub fn gpu_arch() -> Result<(String, String), String> {
    let gpu = probe_gpu()?;
    if gpu.ends_with("(sm_90)") {
        Ok(("sm_90a".to_string(), gpu))
    } else {
        Err(format!(
            "{gpu}: the CUDA kernels are built for sm_90a (Hopper) only"
        ))
    }
}

/// The text of `model`'s config.json (the plan cache key hashes it) and the config it gives.
fn read_config(model: &Path) -> anyhow::Result<(String, ModelConfig)> {
    let path = model.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let cfg =
        ModelConfig::from_json_str(&text).with_context(|| format!("config {}", path.display()))?;
    Ok((text, cfg))
}

/// Plans for `model`: `plans` when given, else the cache entry keyed by config, arch, options and compiler
/// version, compiled (with a progress bar) when missing. Given plans are refused first when `context` (the
/// `--context` asked for) differs from theirs, before their arch is checked, so that a CUDA attempt's fallback to
/// the CPU meets the same refusal and says it.
pub fn plans_for(
    model: &Path,
    plans: Option<&Path>,
    context: Option<u64>,
    opts: &CompileOptions,
) -> anyhow::Result<PlanSet> {
    let (text, cfg) = read_config(model)?;
    if let Some(p) = plans {
        let file = flashplan_compiler::inspect::plan_file(p)?;
        let set = PlanSet::read(&file).with_context(|| format!("reading {}", file.display()))?;
        let theirs = set.body.options.context;
        if let Some(c) = context.filter(|&c| c != theirs) {
            anyhow::bail!(
                "--context {c}: the plans {} were compiled for a context of {theirs} tokens (compile plans for {c} \
                 with `flashplan compile --context {c}`, or leave --plans out to compile them into the cache)",
                file.display()
            );
        }
        set.check_matches(&cfg, &opts.arch, None)
            .with_context(|| format!("{} does not fit {}", file.display(), model.display()))?;
        return Ok(set);
    }
    let forms = flashplan_compiler::checkpoint::forms_from_model_dir(model)
        .with_context(|| format!("reading the safetensors headers of {}", model.display()))?;
    let mut h = Sha256::new();
    h.update(text.as_bytes());
    h.update(format!("{forms:?}").as_bytes());
    h.update(format!("{opts:?}").as_bytes());
    h.update(flashplan_compiler::COMPILER_VERSION.as_bytes());
    h.update(flashplan_plan::FORMAT_VERSION.to_string().as_bytes());
    if opts.arch != "cpu" {
        // GPU plans carry the cubins: new kernel sources need new plans.
        h.update(flashplan_compiler::nvrtc::source_hash().as_bytes());
    }
    let key: String = h
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let file = cache_dir()?.join(key).join(PLAN_FILE);
    if file.exists() {
        if let Ok(set) = PlanSet::read(&file) {
            return Ok(set);
        }
        eprintln!("{}: unreadable, compiling again", file.display());
    }
    eprintln!(
        "compiling plans for {} into {}",
        model.display(),
        file.display()
    );
    if let Some(note) = flashplan_compiler::context_note(&cfg, opts.context) {
        eprintln!("{note}");
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "compiling {bar:40} {pos}/{len} variants {elapsed_precise}",
        )
        .context("progress bar template")?,
    );
    let set = flashplan_compiler::compile(&cfg, opts, &forms, "none", |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("compiling plans for {}", model.display()))?;
    bar.finish_and_clear();
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    set.write_atomic(&file)
        .with_context(|| format!("writing {}", file.display()))?;
    Ok(set)
}

/// The backend for a plan, chosen by the plan's arch: the CUDA backend for a CUDA arch (weights uploaded as BF16),
/// the CPU reference backend for `cpu`. Returns the backend, whether the checkpoint has the MTP drafter, and the
/// backend in words.
pub fn make_backend(
    model: &Path,
    body: PlanBody,
    form: flashplan_plan::DrafterForm,
) -> anyhow::Result<(Box<dyn Backend>, bool, String)> {
    let mut w = load_checkpoint(
        model,
        &body,
        &LoadOptions {
            progress: true,
            ..Default::default()
        },
    )
    .with_context(|| format!("loading the checkpoint {}", model.display()))?;
    let has_mtp = w.has_mtp;
    // FLASHPLAN_MTP_WEIGHTS=mxfp8|mxfp8-head: re-code the drafter (and its head) once, at load.
    flashplan_runtime::mxfp8::derive_drafter_weights(&body, &mut w.tensors, form);
    if body.options.arch == "cpu" {
        return Ok((
            Box::new(CpuBackend::new(Arc::new(body), Arc::new(w.tensors))),
            has_mtp,
            "the CPU backend".to_string(),
        ));
    }
    let arch = body.options.arch.clone();
    let gpu = probe_gpu().unwrap_or_else(|_| "GPU".into());
    let be = CudaBackend::new(Arc::new(body), &w.tensors)
        .with_context(|| format!("starting the CUDA backend ({arch} plans)"))?;
    Ok((
        Box::new(be),
        has_mtp,
        format!("the CUDA backend on {gpu}, {arch} plans"),
    ))
}

/// Plans and backend together: with `FLASHPLAN_BACKEND` unset or `auto`, the CUDA backend when a Hopper GPU is
/// present and the plans can be built for it (NVRTC, or the kernel cache `$FLASHPLAN_KERNEL_CACHE`, by default
/// `<cache>/../kernels`, filled on a machine with NVRTC), else the CPU backend; the choice and any reason for
/// falling back are printed on stderr. `copts.arch` is ignored (the backend decides it). `context`, the
/// `--context` asked for, is checked against given plans ([`plans_for`]).
pub fn load_backend(
    model: &Path,
    plans: Option<&Path>,
    context: Option<u64>,
    copts: &CompileOptions,
    form: flashplan_plan::DrafterForm,
) -> anyhow::Result<(Box<dyn Backend>, bool, String)> {
    let choice = backend_choice()?;
    let mut why_cpu = String::from("FLASHPLAN_BACKEND=cpu");
    if choice != BackendChoice::Cpu {
        match gpu_arch() {
            Ok((arch, _)) => {
                if folder_var("FLASHPLAN_KERNEL_CACHE")?.is_none() {
                    let plans = cache_dir()?;
                    let dir = plans
                        .parent()
                        .map(|p| p.join("kernels"))
                        .unwrap_or_else(|| plans.join("kernels"));
                    std::env::set_var("FLASHPLAN_KERNEL_CACHE", dir);
                }
                let mut o = copts.clone();
                o.arch = arch;
                let got = plans_for(model, plans, context, &o)
                    .and_then(|set| make_backend(model, set.body, form));
                match got {
                    Ok(b) => {
                        eprintln!("backend: {}", b.2);
                        return Ok(b);
                    }
                    Err(e) if choice == BackendChoice::Auto => why_cpu = format!("{e:#}"),
                    Err(e) => return Err(e.context("FLASHPLAN_BACKEND=cuda")),
                }
            }
            Err(why) if choice == BackendChoice::Auto => why_cpu = why,
            Err(why) => anyhow::bail!("FLASHPLAN_BACKEND=cuda: {why}"),
        }
    }
    eprintln!("backend: running on the CPU backend ({why_cpu})");
    let mut o = copts.clone();
    o.arch = flashplan_compiler::default_arch().to_string();
    let set = plans_for(model, plans, context, &o)?;
    make_backend(model, set.body, form)
}

/// Engine options from the command line and the environment (`FLASHPLAN_COPY_DRAFTS`, `FLASHPLAN_MTP_WEIGHTS`;
/// an unknown value refuses to start, naming the variable).
pub fn engine_options(parallel: u32, max_depth: u32) -> anyhow::Result<EngineOptions> {
    Ok(EngineOptions {
        parallel,
        max_depth,
        ..Default::default()
    }
    .from_env()?)
}

/// Checks every product variable's value (README.md, "Configuration"), for every command, before anything slow
/// happens, so that a wrong value is refused whichever command meets it first (the folder variables:
/// [`check_folders`]).
pub fn check_env() -> anyhow::Result<()> {
    backend_choice()?;
    // Read by the GPU checks alone, but a wrong value is refused here too, as for every product variable.
    flashplan_plan::env::switch("FLASHPLAN_GPU")?;
    flashplan_runtime::cuda::check_env()?;
    engine_options(1, 1).map(|_| ())
}

/// The product's `FLASHPLAN_*` variables (README.md, "Settings").
const PRODUCT_VARS: &[&str] = &[
    "FLASHPLAN_BACKEND",
    "FLASHPLAN_CACHE",
    "FLASHPLAN_COPY_DRAFTS",
    "FLASHPLAN_FUSE_LINEAR",
    "FLASHPLAN_FUSE_SMALL",
    "FLASHPLAN_GPU",
    "FLASHPLAN_KERNEL_CACHE",
    "FLASHPLAN_MTP_WEIGHTS",
    "FLASHPLAN_PDL",
];

/// The other `FLASHPLAN_*` variables something in this repository reads: the build's, the tests' and the scripts'
/// (`FLASHPLAN_AB`: the temporary A/B switch of scripts/gpu_ab.sh, read only while a change is measured).
const DEV_VARS: &[&str] = &[
    "FLASHPLAN_AB",
    "FLASHPLAN_CUDA_INCLUDE",
    "FLASHPLAN_GPU_ROUNDS_DRY",
    "FLASHPLAN_REQUIRE_NVRTC",
    "FLASHPLAN_TRANSFORMERS",
];

/// Warns about a `FLASHPLAN_*` variable nothing reads (a misspelt `FLASHPLAN_BACKNED=cpu` would otherwise be ignored
/// without a word), listing the product's variables. A warning, not a refusal: an unknown name changes nothing.
pub fn warn_unknown_vars() {
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("FLASHPLAN_")
            && !PRODUCT_VARS.contains(&k.as_ref())
            && !DEV_VARS.contains(&k.as_ref())
        {
            eprintln!(
                "warning: {k} is not a flashplan variable; it is ignored (the variables: {})",
                PRODUCT_VARS.join(", ")
            );
        }
    }
}

/// Checks the folder variables (`FLASHPLAN_CACHE`, `FLASHPLAN_KERNEL_CACHE`): every command reads one.
///
/// # Errors
/// As [`folder_var`].
pub fn check_folders() -> anyhow::Result<()> {
    folder_var("FLASHPLAN_CACHE")?;
    folder_var("FLASHPLAN_KERNEL_CACHE").map(|_| ())
}

/// Refuses a tokenizer that can produce ids the model cannot embed (an id at or past the config's `vocab_size`):
/// likely a tokenizer made for another model. One with fewer ids than the model's vocabulary is usual (padding).
fn check_tokenizer_fits(
    model: &Path,
    cfg: &ModelConfig,
    tokenizer: &Tokenizer,
) -> anyhow::Result<()> {
    if let Some(max) = tokenizer.max_token_id() {
        anyhow::ensure!(
            max < cfg.vocab_size,
            "{}: the tokenizer has token id {max}, but the model's vocab_size is {} (expected every tokenizer id \
             below it: is tokenizer.json from another model?)",
            model.join("tokenizer.json").display(),
            cfg.vocab_size
        );
    }
    Ok(())
}

/// Loads plans, checkpoint and tokenizer, and builds the engine. `chat`: the command renders the chat template
/// (`run --chat`), so a template that does not parse is an error here, before the backend loads; otherwise it is a
/// warning (completions are served).
pub fn load(a: &ModelArgs, chat: bool) -> anyhow::Result<Loaded> {
    anyhow::ensure!(
        (0.0..=1.0).contains(&a.confidence),
        "--confidence {}: expected a probability in [0, 1]",
        a.confidence
    );
    let eopts = EngineOptions {
        confidence: a.confidence,
        ..engine_options(a.parallel, a.max_depth)?
    };
    anyhow::ensure!(
        a.model.is_dir(),
        "--model {}: {} (expected a Hugging Face model directory: config.json, the safetensors, tokenizer.json)",
        a.model.display(),
        if a.model.exists() {
            "a file, not a directory"
        } else {
            "no such model directory"
        }
    );
    let (text, cfg) = read_config(&a.model)?;
    if let Some(note) = flashplan_compiler::defaulted_note(&text, &cfg) {
        eprintln!("{note}");
    }
    let mut copts = flashplan_compiler::default_options(flashplan_compiler::default_arch());
    copts.max_depth = a.max_depth.max(1);
    copts.context = a
        .context
        .unwrap_or_else(|| default_context(&cfg, copts.max_depth));
    let tokenizer = Tokenizer::from_dir(&a.model)
        .with_context(|| format!("loading the tokenizer of {}", a.model.display()))?;
    check_tokenizer_fits(&a.model, &cfg, &tokenizer)?;
    if let Some(e) = tokenizer.chat_template_error() {
        if chat {
            return Err(e.into());
        }
        eprintln!(
            "warning: {e}; chat requests will fail (a 500 from the server, an error from `run --chat`), completions \
             are served"
        );
    }
    let (backend, has_mtp, _) = load_backend(
        &a.model,
        a.plans.as_deref(),
        a.context,
        &copts,
        eopts.drafter_form,
    )?;
    let name = a
        .model
        .canonicalize()
        .unwrap_or_else(|_| a.model.clone())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    if !has_mtp {
        eprintln!(
            "note: {} has no MTP drafter (no mtp.* tensors): rounds draft from the copy index alone",
            a.model.display()
        );
    }
    Ok(Loaded {
        engine: Engine::new(backend, eopts, has_mtp),
        tokenizer: Arc::new(tokenizer),
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashplan_compiler::DEFAULT_CONTEXT;

    fn config(path: &str) -> ModelConfig {
        let text = std::fs::read_to_string(path).expect("bundled config");
        ModelConfig::from_json_str(&text).expect("config parses")
    }

    #[test]
    fn the_default_context_is_at_most_the_models_positions() {
        // The real config's 524288 positions: the default; the bundled demo model's 8192: its own.
        let real = config("configs/flash-next.json");
        assert!(real.max_position_embeddings > DEFAULT_CONTEXT);
        assert_eq!(default_context(&real, 15), DEFAULT_CONTEXT);
        let tiny = config("models/flashnext-tiny/config.json");
        assert!(tiny.max_position_embeddings < DEFAULT_CONTEXT);
        assert_eq!(default_context(&tiny, 15), tiny.max_position_embeddings);
        assert!(flashplan_compiler::context_note(&tiny, default_context(&tiny, 15)).is_none());
        let note = flashplan_compiler::context_note(&tiny, tiny.max_position_embeddings + 1)
            .expect("a note");
        assert!(note.contains("past the 8192 positions"), "{note}");
    }

    #[test]
    fn yarn_scaling_counts_in_the_trained_positions() {
        // The published config stores the scaled length (262144 x 2); a config storing the unscaled one is read
        // the same.
        let text = std::fs::read_to_string("configs/flash-next.json").expect("bundled config");
        let mut v: serde_json::Value = serde_json::from_str(&text).expect("json");
        let real = ModelConfig::from_json(&v).expect("config");
        assert_eq!(real.rope.rope_type, "yarn");
        let scaled = (real
            .rope
            .original_max_position_embeddings
            .expect("original") as f64
            * real.rope.factor) as u64;
        assert_eq!(flashplan_compiler::trained_positions(&real), scaled);
        v["text_config"]["max_position_embeddings"] = serde_json::json!(262144);
        let unscaled = ModelConfig::from_json(&v).expect("config");
        assert_eq!(flashplan_compiler::trained_positions(&unscaled), scaled);
        assert!(flashplan_compiler::context_note(&unscaled, scaled).is_none());
        assert!(flashplan_compiler::context_note(&unscaled, scaled + 1).is_some());
        // Without original_max_position_embeddings, max_position_embeddings is the original length.
        v["text_config"]["rope_parameters"]
            .as_object_mut()
            .expect("rope_parameters")
            .remove("original_max_position_embeddings");
        let no_original = ModelConfig::from_json(&v).expect("config");
        assert_eq!(no_original.rope.original_max_position_embeddings, None);
        assert_eq!(
            flashplan_compiler::trained_positions(&no_original),
            (262144.0 * real.rope.factor) as u64
        );
    }
}
