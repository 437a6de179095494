//! `flashplan-plans inspect DIR|FILE [--json] [--all]`: shows a plan set (the main CLI's `flashplan plans inspect`
//! calls the same [`flashplan_compiler::inspect_path`]).
use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Work with compiled flashplan plan files")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
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

fn main() -> anyhow::Result<()> {
    match Args::parse().cmd {
        Cmd::Inspect { path, json, all } => {
            let out = flashplan_compiler::inspect_path(
                &path,
                flashplan_compiler::InspectOptions { json, all },
            )?;
            print!("{out}");
        }
    }
    Ok(())
}
