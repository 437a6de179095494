//! `flashplan-compile`: compiles a Flash Next config (or model directory) into a plan file.
use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
#[command(about = "Compile a Flash Next config.json into serialized graph plans")]
struct Args {
    /// A model directory (config.json and safetensors headers are read, never the weights).
    #[arg(long, conflicts_with = "config")]
    model: Option<std::path::PathBuf>,
    /// A bare config.json.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Output directory.
    #[arg(long)]
    out: std::path::PathBuf,
    /// Target arch: cpu or sm_90a.
    #[arg(long, default_value = "cpu")]
    arch: String,
    /// Most drafts per window.
    #[arg(long, default_value_t = 15)]
    max_depth: u32,
    /// Stream counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    streams: Vec<u32>,
    /// Context length per slot.
    #[arg(long, default_value_t = 32768)]
    context: u64,
    /// Prefill chunk rows.
    #[arg(long, default_value_t = 64)]
    prefill_chunk: u32,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let cfg_path = match (&a.model, &a.config) {
        (Some(m), _) => m.join("config.json"),
        (None, Some(c)) => c.clone(),
        (None, None) => anyhow::bail!("give --model DIR or --config FILE"),
    };
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let cfg = flashplan_plan::ModelConfig::from_json_str(&text)
        .with_context(|| format!("{}", cfg_path.display()))?;
    let opts = flashplan_plan::CompileOptions {
        arch: a.arch,
        max_depth: a.max_depth,
        streams: a.streams,
        context: a.context,
        prefill_chunk: a.prefill_chunk,
    };
    let t = std::time::Instant::now();
    let set = flashplan_compiler::compile(&cfg, &opts, &Default::default(), "none", |_, _| {})?;
    let path = a.out.join("plans.fplan");
    set.write_atomic(&path)?;
    println!(
        "wrote {} ({} variants) in {:.2}s",
        path.display(),
        set.body.variants.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
