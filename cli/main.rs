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

/// The subcommands. Their numeric options take negative numbers as values (`allow_negative_numbers`), so that
/// `--max-depth -1` is an out-of-range value of `--max-depth`, said so, not an unknown argument `-1`.
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

/// Runs the command; an error prints as one line, its causes after colons (`{:#}`), with no backtrace even where
/// `RUST_BACKTRACE` is set: the errors here are about the user's input and say what was expected.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Serve(_) | Cmd::Bench(_)) {
        quiet_on_closed_pipe();
    }
    // Refuse unknown values of FLASHPLAN_* variables before anything slow happens.
    model::warn_unknown_vars();
    model::check_folders()?;
    model::check_env()?;
    match cli.cmd {
        Cmd::Compile(a) => flashplan_compiler::cli::compile(a),
        Cmd::Plans { cmd } => flashplan_compiler::cli::plans(cmd),
        Cmd::Run(a) => run::run(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Demo(a) => demo::demo(a),
    }
}

/// The commands that print to standard output end quietly when its reader goes away (`flashplan demo | head`), as
/// other command-line tools do, instead of panicking in `println!`: SIGPIPE back to its default action (the Rust
/// runtime ignores it). Not for `serve` and `bench` (which may serve in-process), whose writes to closed sockets
/// must stay errors of one request.
fn quiet_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default; no handler runs in this process.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
