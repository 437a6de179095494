//! `flashplan`: compile plans, inspect them, run a prompt, serve the OpenAI API, benchmark a server, and a demo.

mod bench;
mod demo;
mod model;
mod run;
mod serve;

use clap::{Parser, Subcommand};

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
    Compile(flashplan_compiler::cli::CompileArgs),
    /// Work with plan files.
    Plans {
        #[command(subcommand)]
        cmd: flashplan_compiler::cli::PlansCmd,
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

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Refuse unknown values of FLASHPLAN_* variables before anything slow happens.
    model::warn_unknown_vars();
    model::check_folders()?;
    if matches!(
        cli.cmd,
        Cmd::Run(_) | Cmd::Serve(_) | Cmd::Demo(_) | Cmd::Bench(_)
    ) {
        model::check_env()?;
    }
    match cli.cmd {
        Cmd::Compile(a) => flashplan_compiler::cli::compile(a),
        Cmd::Plans { cmd } => flashplan_compiler::cli::plans(cmd),
        Cmd::Run(a) => run::run(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Demo(a) => demo::demo(a),
    }
}
