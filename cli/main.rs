//! `flashplan`: compile plans, inspect them, run a prompt, serve the OpenAI API, benchmark a server, and a demo.

mod bench;
mod demo;
mod model;
mod run;
mod serve;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use flashplan_compiler::inspect::{human_bytes, PLAN_FILE};

#[derive(Parser)]
#[command(
    name = "flashplan",
    version,
    about = "Serve Flash Next with compiled graph plans and exact speculative rounds"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compile a config (or model directory) into a plan file, DIR/plans.fplan.
    Compile(CompileArgs),
    /// Work with plan files.
    Plans {
        #[command(subcommand)]
        cmd: PlansCmd,
    },
    /// Generate a reply to one prompt, printed as it streams, then a statistics line.
    Run(run::RunArgs),
    /// Serve the OpenAI-compatible API.
    Serve(serve::ServeArgs),
    /// Benchmark a server: decode tokens/s, time to first token, aggregate tokens/s, exactness checks.
    Bench(bench::BenchArgs),
    /// The bundled tiny model: copy-heavy and fresh prompts, with and without drafts.
    Demo(demo::DemoArgs),
}

#[derive(Subcommand)]
enum PlansCmd {
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

/// The same options as `flashplan-compile`.
#[derive(Debug, clap::Args)]
struct CompileArgs {
    /// A model directory: its config.json, and the storage form of every tensor from the safetensors headers.
    #[arg(long, conflicts_with = "config", required_unless_present = "config")]
    model: Option<PathBuf>,
    /// A bare config.json (storage forms as its quantization_config declares, BF16 if none).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Output directory (receives plans.fplan).
    #[arg(long)]
    out: PathBuf,
    /// Target arch: cpu or an NVIDIA arch such as sm_90a (default: cpu).
    #[arg(long)]
    arch: Option<String>,
    /// Most drafts per window (verify windows have 1..=N+1 rows).
    #[arg(long, default_value_t = 15)]
    max_depth: u32,
    /// Stream counts with verify and MTP variants (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    streams: Vec<u32>,
    /// Context length per slot (tokens).
    #[arg(long, default_value_t = 32768)]
    context: u64,
    /// Prefill chunk rows.
    #[arg(long, default_value_t = 64)]
    prefill_chunk: u32,
}

fn compile(a: CompileArgs) -> anyhow::Result<()> {
    let (cfg_path, forms) = match (&a.model, &a.config) {
        (Some(m), _) => (
            m.join("config.json"),
            flashplan_compiler::checkpoint::forms_from_model_dir(m)
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
        arch: a
            .arch
            .unwrap_or_else(|| flashplan_compiler::default_arch().to_string()),
        max_depth: a.max_depth,
        streams: a.streams,
        context: a.context,
        prefill_chunk: a.prefill_chunk,
    };
    let t = std::time::Instant::now();
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "compiling {bar:40} {pos}/{len} variants {elapsed_precise}",
        )
        .context("progress bar template")?,
    );
    let set = flashplan_compiler::compile(&cfg, &opts, &forms, "none", |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("compiling {}", cfg_path.display()))?;
    bar.finish_and_clear();
    let path = a.out.join(PLAN_FILE);
    set.write_atomic(&path)
        .with_context(|| format!("writing {}", path.display()))?;
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

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Refuse unknown values of FLASHPLAN_* variables before anything slow happens.
    if matches!(
        cli.cmd,
        Cmd::Run(_) | Cmd::Serve(_) | Cmd::Demo(_) | Cmd::Bench(_)
    ) {
        model::check_env()?;
    }
    match cli.cmd {
        Cmd::Compile(a) => compile(a),
        Cmd::Plans {
            cmd: PlansCmd::Inspect { path, json, all },
        } => {
            let out = flashplan_compiler::inspect_path(
                &path,
                flashplan_compiler::InspectOptions { json, all },
            )?;
            print!("{out}");
            Ok(())
        }
        Cmd::Run(a) => run::run(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Demo(a) => demo::demo(a),
    }
}
