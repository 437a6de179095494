//! `flashplan-compile`: compiles a Flash Next config (or model directory) into a plan file, `DIR/plans.fplan`.
use clap::Parser;

#[derive(Parser)]
#[command(about = "Compile a Flash Next config.json into serialized graph plans")]
struct Args {
    #[command(flatten)]
    compile: flashplan_compiler::cli::CompileArgs,
}

fn main() -> anyhow::Result<()> {
    flashplan_compiler::cli::compile(Args::parse().compile)
}
