//! `flashplan-plans inspect DIR|FILE [--json] [--all]`: shows a plan set (the same as `flashplan plans inspect`).
use clap::Parser;

#[derive(Parser)]
#[command(about = "Work with compiled flashplan plan files")]
struct Args {
    #[command(subcommand)]
    cmd: flashplan_compiler::cli::PlansCmd,
}

fn main() -> anyhow::Result<()> {
    flashplan_compiler::cli::plans(Args::parse().cmd)
}
