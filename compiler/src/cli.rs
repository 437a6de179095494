//! The command-line front of the compiler, shared by `flashplan-compile`, `flashplan-plans` and the `flashplan`
//! binary's `compile` and `plans inspect` subcommands.

use std::path::PathBuf;

use anyhow::Context;

use crate::inspect::{human_bytes, PLAN_FILE};

/// Options of `flashplan-compile` / `flashplan compile`: one of `--model` and `--config` (clap's group `source`
/// names both when neither or both is given).
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).multiple(false)))]
pub struct CompileArgs {
    /// A model directory: its config.json, and the storage form of every tensor from the safetensors headers.
    #[arg(long, group = "source")]
    pub model: Option<PathBuf>,
    /// A bare config.json (storage forms as its quantization_config declares, BF16 if none).
    #[arg(long, group = "source")]
    pub config: Option<PathBuf>,
    /// Output directory (receives plans.fplan).
    #[arg(long)]
    pub out: PathBuf,
    /// Target arch: cpu or sm_90a (Hopper) [default: sm_90a when a Hopper GPU is present, else cpu].
    #[arg(long)]
    pub arch: Option<String>,
    /// Most drafts per window (verify windows have 1..=N+1 rows).
    #[arg(long, allow_negative_numbers = true, default_value_t = 15)]
    pub max_depth: u32,
    /// Stream counts with verify and MTP variants (comma-separated, each 1 to 256; one stream is always planned
    /// besides, for prefill and the lone-stream slot).
    #[arg(
        long,
        allow_negative_numbers = true,
        value_delimiter = ',',
        default_value = "1,2,4,8,16"
    )]
    pub streams: Vec<u32>,
    /// Context length per slot (tokens) [default: 32768, or the positions the model was trained for when fewer,
    /// as `run` and `serve` compile].
    #[arg(long, allow_negative_numbers = true)]
    pub context: Option<u64>,
    /// Prefill chunk rows.
    #[arg(long, allow_negative_numbers = true, default_value_t = 64)]
    pub prefill_chunk: u32,
}

/// Compiles plans as the options say, with a progress bar, and prints the per-slot state and the file written.
///
/// # Errors
/// A config that does not parse or validate, unreadable checkpoint headers, or a plan that cannot be written.
pub fn compile(a: CompileArgs) -> anyhow::Result<()> {
    let (cfg_path, forms) = match (&a.model, &a.config) {
        (Some(m), _) => (
            m.join("config.json"),
            crate::checkpoint::forms_from_model_dir(m)
                .with_context(|| format!("reading the safetensors headers of {}", m.display()))?,
        ),
        (None, Some(c)) => (c.clone(), Default::default()),
        (None, None) => anyhow::bail!("give --model DIR or --config FILE"),
    };
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let cfg = flashplan_plan::ModelConfig::from_json_str(&text)
        .with_context(|| format!("config {}", cfg_path.display()))?;
    let opts = flashplan_plan::CompileOptions {
        arch: a.arch.unwrap_or_else(crate::detect_arch),
        max_depth: a.max_depth,
        streams: a.streams,
        context: a
            .context
            .unwrap_or_else(|| crate::default_context(&cfg, a.max_depth)),
        prefill_chunk: a.prefill_chunk,
    };
    // Bad options and an --out that is, or lies under, a file are refused before any work; write_atomic makes the
    // folders --out lacks.
    crate::check_options(&opts)?;
    if let Some(file) = a
        .out
        .ancestors()
        .find(|p| p.exists())
        .filter(|p| !p.is_dir())
    {
        anyhow::bail!(
            "--out {}: {} is a file, not a directory (expected the directory to receive {PLAN_FILE})",
            a.out.display(),
            file.display()
        );
    }
    for note in [
        crate::defaulted_note(&text, &cfg),
        crate::context_note(&cfg, opts.context),
    ]
    .into_iter()
    .flatten()
    {
        eprintln!("{note}");
    }
    let t = std::time::Instant::now();
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "compiling {bar:40} {pos}/{len} variants {elapsed_precise}",
        )
        .context("progress bar template")?,
    );
    let set = crate::compile(&cfg, &opts, &forms, "none", |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("compiling {}", cfg_path.display()))?;
    bar.finish_and_clear();
    let path = a.out.join(PLAN_FILE);
    // The error names the file.
    set.write_atomic(&path).context("writing the plans")?;
    let b = &set.body;
    println!(
        "state per slot at context {}: {} ({} bytes), {} slots: {}",
        b.state.context,
        human_bytes(b.state.slot_bytes),
        b.state.slot_bytes,
        b.state.slots,
        human_bytes(b.state.slot_bytes * b.state.slots as u64)
    );
    println!(
        "wrote {} ({} variants, arch {}, {}) in {:.2}s",
        path.display(),
        b.variants.len(),
        b.options.arch,
        human_bytes(std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0)),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `plans` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum PlansCmd {
    /// Show a plan set: header, config, memory, variants with node counts, kernels.
    Inspect {
        /// A plan file, or a directory holding plans.fplan.
        path: PathBuf,
        /// Print the JSON report.
        #[arg(long)]
        json: bool,
        /// List every variant instead of one line per group.
        #[arg(long)]
        all: bool,
    },
}

/// Runs a `plans` subcommand, printing its report.
///
/// # Errors
/// An unreadable, corrupt or mismatched plan file.
pub fn plans(cmd: PlansCmd) -> anyhow::Result<()> {
    match cmd {
        PlansCmd::Inspect { path, json, all } => {
            let out = crate::inspect_path(&path, crate::InspectOptions { json, all })?;
            print!("{out}");
        }
    }
    Ok(())
}
