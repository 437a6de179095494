//! `flashplan serve`: the OpenAI-compatible server.

use std::net::TcpListener;

use anyhow::Context;
use flashplan_runtime::server::{
    serve_bound, AppState, DEFAULT_BODY_DEADLINE, DEFAULT_HEAD_DEADLINE,
};
use flashplan_runtime::service::Service;

use crate::model::{load, ModelArgs};

/// Arguments of `flashplan serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address or host name to bind (127.0.0.1: this machine only; 0.0.0.0: every interface; a name such as
    /// localhost binds the first of its addresses that can be bound).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: one the system picks, printed on start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name answered by /v1/models (non-empty; default: the model directory's name).
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub served_model_name: Option<String>,
}

/// Loads the model and starts the engine thread.
pub fn start(a: &ModelArgs, name: Option<String>) -> anyhow::Result<AppState> {
    let m = load(a, false)?;
    let service = Service::start(m.engine, m.tokenizer);
    Ok(AppState {
        service,
        model_name: name.unwrap_or(m.name),
        body_deadline: DEFAULT_BODY_DEADLINE,
        head_deadline: DEFAULT_HEAD_DEADLINE,
    })
}

/// `flashplan serve`: binds first (a port in use fails before the model loads), then loads and announces the
/// address it is bound to.
pub fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("binding --host {} --port {}", a.host, a.port))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let state = start(&a.model, a.served_model_name.clone())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    eprintln!(
        "serving {} on http://{addr} (context {}, max_model_len {}, {} streams at once); {} stops",
        state.model_name,
        state.service.info.context,
        state.service.info.max_model_len(),
        state.service.info.parallel,
        if cfg!(unix) {
            "Ctrl-C or SIGTERM"
        } else {
            "Ctrl-C"
        }
    );
    rt.block_on(serve_bound(listener, state.clone()))
        .with_context(|| format!("serving on {addr}"))?;
    state.service.shutdown();
    eprintln!("stopped");
    Ok(())
}
