//! The OpenAI-compatible HTTP server (axum + tokio): `POST /v1/chat/completions`, `POST /v1/completions`
//! (streamed as server-sent events or not), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text),
//! `POST /tokenize`, `POST /detokenize`. Every reply carries `usage` and a `flashplan` block (decode seconds,
//! rounds, drafted and accepted per drafter, `token_sha`).

pub mod api;
pub mod client;
pub mod error;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::Request;
use crate::service::{Completion, GenRequest, Service, StreamEvent};
use crate::tokenizer::TokenizerError;
use api::{parse_gen, parse_object, GenParams, Prompt};
pub use error::ApiError;

/// Shared state of the handlers.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The engine service.
    pub service: Service,
    /// The model name answered in `/v1/models` and responses.
    pub model_name: String,
    /// How long a request's body may take to arrive once its head has ([`DEFAULT_BODY_DEADLINE`] in `serve`): past
    /// it the request gets a 408 and its connection is closed, so a client that never finishes its body cannot hold
    /// the server (or its graceful stop) for ever. (The head's deadline is [`AppState::head_deadline`].)
    pub body_deadline: Duration,
    /// How long a connection may take to deliver a request's head, its request line and headers
    /// ([`DEFAULT_HEAD_DEADLINE`] in `flashplan serve`; hyper's HTTP/1 `header_read_timeout`, applied by [`serve`]).
    ///
    /// The clock starts when the connection is first served after it is accepted and, on a keep-alive connection,
    /// again each time the previous reply has been written out in full; it stops once the whole head is in. So it bounds
    /// the head as a whole, not the pause between two of its bytes (a head trickled in a byte at a time is cut off
    /// too), and it is also how long an idle keep-alive connection is kept waiting for its next request. It never
    /// runs while a body is read (that is [`AppState::body_deadline`]) or while a reply is written: a reply that
    /// streams for minutes is not cut.
    ///
    /// At the deadline nothing is written (no 408, no status line at all: hyper has no request to answer yet) and
    /// the connection is closed: the client reads end of file (or a reset, if it sent more afterwards). During a
    /// graceful stop a new connection whose first head is only partly in is kept until that head is complete and
    /// its request answered, or until this deadline: so it bounds the stop too.
    pub head_deadline: Duration,
}

/// The default [`AppState::body_deadline`]: 60 s, enough for the largest body ([`MAX_BODY_BYTES`]) at 1.2 MB/s.
pub const DEFAULT_BODY_DEADLINE: Duration = Duration::from_secs(60);

/// The default [`AppState::head_deadline`]: 30 s. A head is small (hyper takes at most about 400 KB of it, its read
/// buffer of 8 KB + 100 × 4 KB; a usual one is under 1 KB) and arrives within a second on any working link, so 30 s
/// leaves room for a slow or lossy one while a client that trickles its head (or sends none) holds a connection
/// and its task for 30 s at most. It is also how long an idle keep-alive connection is kept: longer than HTTP
/// client pools keep theirs by default (the `openai` Python client's pool drops an idle one after 5 s), so a
/// pooled client does not race the server closing it. 30 s is hyper's own default for this timeout too.
pub const DEFAULT_HEAD_DEADLINE: Duration = Duration::from_secs(30);

/// The router with every endpoint.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "no such endpoint".into(),
                kind: "invalid_request_error",
                param: None,
                code: Some("not_found"),
            }
        })
        .method_not_allowed_fallback(|| async {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                message: "this endpoint does not take that method (the generation, tokenize and detokenize \
                          endpoints take POST; /v1/models, /health and /metrics GET)"
                    .into(),
                kind: "invalid_request_error",
                param: None,
                code: Some("method_not_allowed"),
            }
        })
        .layer(from_fn_with_state(state.body_deadline, body_by_deadline))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The largest request body accepted (a prompt of a million tokens as JSON token ids takes about 8 MB).
const MAX_BODY_BYTES: usize = 64 << 20;

/// A request's body, or the OpenAI-style error for one that could not be read (over [`MAX_BODY_BYTES`]: 413).
fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            too_large()
        } else {
            unreadable_body(r.status(), r.body_text())
        }
    })
}

/// The error of a body that broke off or could not be decoded (`status`: 400 unless the rejection says otherwise).
fn unreadable_body(status: StatusCode, why: impl std::fmt::Display) -> ApiError {
    ApiError {
        status,
        message: format!("the request body could not be read: {why}"),
        kind: "invalid_request_error",
        param: None,
        code: Some("unreadable_body"),
    }
}

/// The 413 of a body over [`MAX_BODY_BYTES`].
fn too_large() -> ApiError {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!("the request body is over {} MB", MAX_BODY_BYTES >> 20),
        kind: "invalid_request_error",
        param: None,
        code: Some("request_too_large"),
    }
}

/// `r` with `Connection: close`: the answer of a request whose body was not read to its end, after which the
/// connection cannot carry another request.
fn closing(mut r: Response) -> Response {
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

/// Middleware: reads the whole body (at most [`MAX_BODY_BYTES`]) within `deadline`, then hands the request on with
/// it. A body still arriving at the deadline gets a 408 (`request_timeout`) with `Connection: close`; one over the
/// limit the 413 the handlers give, with `Connection: close` (at once when its `Content-Length` says so: nothing of
/// it is read); one that breaks off the 400 `unreadable_body`.
async fn body_by_deadline(
    State(deadline): State<Duration>,
    req: HttpRequest,
    next: Next,
) -> Response {
    use axum::body::HttpBody as _;
    use http_body_util::{BodyExt, LengthLimitError, Limited};
    // The body's least size is its `Content-Length` (as hyper parsed it): one over the limit is refused before a
    // byte of it is read.
    if req.body().size_hint().lower() > MAX_BODY_BYTES as u64 {
        return closing(too_large().into_response());
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(deadline, Limited::new(body, MAX_BODY_BYTES).collect()).await;
    let bytes = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return closing(too_large().into_response())
        }
        Ok(Err(e)) => return unreadable_body(StatusCode::BAD_REQUEST, e).into_response(),
        Err(_) => {
            return closing(
                ApiError {
                    status: StatusCode::REQUEST_TIMEOUT,
                    message: format!(
                        "the request body did not arrive within {} s of its head",
                        deadline.as_secs_f64()
                    ),
                    kind: "invalid_request_error",
                    param: None,
                    code: Some("request_timeout"),
                }
                .into_response(),
            );
        }
    };
    next.run(HttpRequest::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// Serves the router on a bound listener (HTTP/1.1) until `shutdown` resolves; then no new connection is taken (the
/// listener is closed) and it returns once the replies in flight are done, streamed ones included. Connections idle
/// at that moment are closed at once (a kept-alive one even with its next head partly in); a new one whose first
/// head is only partly in is kept until that request is answered or [`AppState::head_deadline`] passes, one whose
/// body is still arriving until its request is answered (at the latest [`AppState::body_deadline`] later, with a
/// 408).
///
/// Each connection is served by hyper's HTTP/1 connection in a task of its own, with [`AppState::head_deadline`] as
/// its header read timeout (a connection whose head does not arrive in time is closed without a reply). Every
/// accepted connection gets `TCP_NODELAY` (in `accept`): a streamed reply is one small write per event, which
/// Nagle's algorithm would otherwise hold back until the client acknowledges the previous one (a delayed ACK: 40 ms
/// or more on Linux, per event). An error accepting a connection never ends the server: one of
/// that connection alone (refused, aborted, reset) is skipped at once, any other (such as `EMFILE`, out of file
/// descriptors) is logged and the next accept waits 1 s, so that the loop does not spin while the process is out of
/// resources. Errors of a connection (the client went away, a head past its deadline) are logged at debug level and
/// end that connection alone.
///
/// # Errors
/// None at present: accept errors are retried as said above. The `io::Result` is kept for callers (and for
/// [`serve_bound`], whose signal handlers can fail).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::server::graceful::GracefulShutdown;
    use hyper_util::service::TowerToHyperService;

    // HTTP/1 only, as `axum::serve` spoke with axum's default features (no `http2`): hyper's own HTTP/1 builder.
    // (hyper-util's auto builder, unless told `http1_only`, first reads a connection's opening bytes to tell HTTP/1
    // from HTTP/2 with no deadline, so a connection that sent nothing would never reach the header read timeout.)
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(state.head_deadline);
    let head_deadline = state.head_deadline;
    let app = router(state);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = accept(&listener) => accepted,
            () = &mut shutdown => break,
        };
        // The router takes hyper's request body as it is (axum wraps it in its own `Body`).
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        // Resolves when the connection ends; on the shutdown below, hyper is told to finish the request in flight
        // and take no other.
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                if e.is_timeout() {
                    tracing::debug!(
                        "connection from {peer} closed: no whole request head within {} s",
                        head_deadline.as_secs_f64()
                    );
                } else {
                    tracing::debug!("connection from {peer}: {e}");
                }
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Turns Nagle's algorithm off on an accepted connection (`TCP_NODELAY`), so each server-sent event leaves when it
/// is written. A failure (the peer already gone) is logged at debug level; the connection is served as it is.
fn no_delay(stream: &tokio::net::TcpStream, peer: SocketAddr) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!("connection from {peer}: TCP_NODELAY not set: {e}");
    }
}

/// The next connection of `listener` and its peer's address, with `TCP_NODELAY` set (`no_delay`), retrying every
/// accept error as [`serve`] says: at once after one of that connection alone, after 1 s (logged) after any other.
async fn accept(listener: &tokio::net::TcpListener) -> (tokio::net::TcpStream, SocketAddr) {
    use std::io::ErrorKind;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                no_delay(&stream, peer);
                return (stream, peer);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::ConnectionReset
                ) => {}
            Err(e) => {
                tracing::error!("accepting a connection: {e} (retrying in 1 s)");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Serves on `listener`, bound by the caller (so that a port in use is an error before the model loads, and port 0
/// can be told its port), until Ctrl-C or, on Unix, SIGTERM (what systemd and docker send): then no new connection
/// is taken and it returns once the replies in flight are done. A second Ctrl-C or SIGTERM while they finish ends
/// the process at once, with status 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as shells report a
/// process killed by it; the replies in flight are cut off.
///
/// # Errors
/// Installing the signal handlers, handing the listener to tokio or serving failed.
pub async fn serve_bound(listener: std::net::TcpListener, state: AppState) -> std::io::Result<()> {
    let mut stops = StopSignals::new()?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    serve(listener, state, async move {
        let (name, _) = stops.next().await;
        eprintln!(
            "{name}: no new connections; stopping once the replies in flight are done (again to stop at once)"
        );
        tokio::spawn(async move {
            let (name, number) = stops.next().await;
            eprintln!("{name} again: stopping at once; the replies in flight are cut off");
            std::process::exit(128 + number);
        });
    })
    .await
}

/// The signals that stop the server: Ctrl-C (SIGINT) and, on Unix, SIGTERM; each [`StopSignals::next`] waits for
/// the next one. On Unix both handlers are in place once [`StopSignals::new`] returns; elsewhere Ctrl-C's is
/// installed when `next` is first awaited.
struct StopSignals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers.
    ///
    /// # Errors
    /// The operating system refused a handler.
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                int: signal(SignalKind::interrupt())?,
                term: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves at the next Ctrl-C or SIGTERM, with its name and number (SIGINT 2, SIGTERM 15).
    async fn next(&mut self) -> (&'static str, i32) {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.int.recv() => ("Ctrl-C", 2),
                _ = self.term.recv() => ("SIGTERM", 15),
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            ("Ctrl-C", 2)
        }
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{:x}{:06x}",
        now(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The `flashplan` block of a reply.
pub fn flashplan_block(c: &Completion) -> Value {
    let s = &c.stats;
    json!({
        "decode_s": s.decode_s,
        "prefill_s": s.prefill_s,
        "rounds": s.rounds,
        "tokens_per_round": s.tokens_per_round(),
        "drafted": s.drafted_copy + s.drafted_mtp,
        "accepted": s.accepted_copy + s.accepted_mtp,
        "copy": {"drafted": s.drafted_copy, "accepted": s.accepted_copy, "rounds": s.copy_rounds},
        "mtp": {"drafted": s.drafted_mtp, "accepted": s.accepted_mtp, "rounds": s.mtp_rounds},
        "token_sha": c.token_sha,
    })
}

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    })
}

/// Refuses a token id of the request field `param` that is outside a vocabulary of `vocab` ids, naming the first.
fn in_vocab(param: &str, ids: &[u32], vocab: u32) -> Result<(), ApiError> {
    match ids.iter().find(|&&t| t >= vocab) {
        Some(bad) => Err(ApiError::invalid(
            Some(param),
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// Runs `f` (parsing a body, a chat template, tokenizing: time in the body's size) on tokio's blocking pool, so
/// the async threads keep serving other requests; a panic in it is an internal error of this request alone.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::internal(format!(
            "preparing the request failed: {e}"
        )))
    })
}

/// A request's `model`, if it names one, must be the served one.
///
/// # Errors
/// 404 `model_not_found` naming both.
fn served_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model.filter(|&m| m != state.model_name) {
        None => Ok(()),
        Some(m) => Err(ApiError::not_found(
            Some("model"),
            format!(
                "the model `{m}` does not exist: this server serves `{}` (GET /v1/models)",
                state.model_name
            ),
        )
        .code("model_not_found")),
    }
}

/// The answer to a chat template that failed on a request's messages. Its `raise_exception` (the template refuses
/// these messages: a role order it does not take, say) and a model without a chat template are 400s naming
/// `messages`. Any other failure is the template's own fault, not the client's: a 500 `server_error`, logged, or
/// for a template that does not parse (warned about at start-up) a 500 naming its file and the syntax error.
fn template_error(e: TokenizerError) -> ApiError {
    match e {
        TokenizerError::TemplateRaised(_) | TokenizerError::NoChatTemplate => {
            ApiError::invalid(Some("messages"), e.to_string())
        }
        // The message without the template's path on the server (the start-up warning names it); minijinja's
        // gives the template's name and line.
        TokenizerError::TemplateSyntax { message, .. } => ApiError::internal(format!(
            "the model's chat template cannot be used: it does not parse: {message}"
        )),
        e => {
            tracing::error!("the chat template failed to render: {e}");
            ApiError::internal(format!(
                "the model's chat template failed to render these messages: {e}"
            ))
        }
    }
}

/// Where [`crate::service::ModelInfo::max_model_len`] comes from, for the `context_length_exceeded` messages.
fn limit_note(info: &crate::service::ModelInfo) -> String {
    format!(
        "max_model_len: the context of {} less {} kept for one verify window",
        info.context,
        info.max_depth + 1
    )
}

/// Encodes a prompt's text, first refusing one that certainly has more tokens than a request may use
/// ([`crate::service::ModelInfo::max_model_len`], found by [`Tokenizer::exceeds`]): such a text, up to the 64 MB a
/// body may carry, would otherwise be encoded whole, taking gigabytes, only to be refused.
///
/// # Errors
/// 400 `context_length_exceeded` naming `param`; 400 when the tokenizer fails.
fn encode_within(
    tok: &crate::tokenizer::Tokenizer,
    text: &str,
    add_special: bool,
    param: &str,
    info: &crate::service::ModelInfo,
) -> Result<Vec<u32>, ApiError> {
    let codec = |e: TokenizerError| ApiError::invalid(Some(param), e.to_string());
    let limit = info.max_model_len();
    if tok.exceeds(text, limit as usize).map_err(codec)? {
        return Err(ApiError::invalid(
            Some(param),
            format!(
                "the prompt is too long: {} bytes of text, more than the {limit} tokens a request may use ({})",
                text.len(),
                limit_note(info)
            ),
        )
        .code("context_length_exceeded"));
    }
    tok.encode(text, add_special).map_err(codec)
}

/// Tokenizes the prompt and builds the engine request.
fn build(state: &AppState, p: &GenParams, chat: bool) -> Result<GenRequest, ApiError> {
    served_model(state, p.model.as_deref())?;
    let tok = &state.service.tokenizer;
    let info = &state.service.info;
    let ids = match &p.prompt {
        Prompt::Ids(ids) => ids.clone(),
        Prompt::Text(t) => encode_within(tok, t, true, "prompt", info)?,
        Prompt::Chat(msgs) => {
            let text = tok
                .apply_chat_template(msgs, true)
                .map_err(template_error)?;
            encode_within(tok, &text, false, "messages", info)?
        }
    };
    let param = if chat { "messages" } else { "prompt" };
    if ids.is_empty() {
        return Err(ApiError::invalid(Some(param), "the prompt is empty").code("empty_prompt"));
    }
    in_vocab(param, &ids, info.vocab_size).map_err(|e| e.code("invalid_token_id"))?;
    let room = crate::engine::reply_room(info.context, ids.len(), info.max_depth);
    // The most a request may use, prompt and reply together (what /v1/models answers as `max_model_len`).
    let limit = info.max_model_len();
    let why = limit_note(info);
    if room == 0 {
        return Err(ApiError::invalid(
            Some(param),
            format!(
                "the prompt is too long: {} tokens, and a request may use at most {limit}, the prompt and at least \
                 one reply token ({why})",
                ids.len()
            ),
        )
        .code("context_length_exceeded"));
    }
    if let Some(n) = p.max_tokens.filter(|&n| n as u64 > room) {
        let k = p.max_tokens_field;
        return Err(ApiError::invalid(
            Some(k),
            format!(
                "`{k}` {n} does not fit: a request may use at most {limit} tokens, the prompt and `{k}` together \
                 ({why}): after the prompt's {} at most {room} reply {}",
                ids.len(),
                if room == 1 { "token" } else { "tokens" }
            ),
        )
        .code("context_length_exceeded"));
    }
    in_vocab("stop_token_ids", &p.stop_token_ids, info.vocab_size)
        .map_err(|e| e.code("invalid_token_id"))?;
    let max_tokens = p.max_tokens.unwrap_or(room.min(u32::MAX as u64) as u32);
    let mut stop_token_ids = p.stop_token_ids.clone();
    if chat {
        // Chat replies end at the end-of-turn token too.
        if let Some(id) = tok.token_id("<|im_end|>") {
            stop_token_ids.push(id);
        }
    }
    Ok(GenRequest {
        request: Request {
            sampling: p.resolved_sampling(&ids),
            prompt: ids,
            max_tokens,
            stop_token_ids,
            ignore_eos: p.ignore_eos,
            draft: p.draft,
        },
        stop: p.stop.clone(),
    })
}

async fn chat_completions(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, body, true).await
}

async fn completions(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, body, false).await
}

async fn generate(state: AppState, body: Result<Bytes, BytesRejection>, chat: bool) -> Response {
    // Parsing, the chat template and tokenizing take time in the body's size (a prompt of megabytes: seconds).
    let st = state.clone();
    let prepared = blocking(move || {
        let p = read_body(body).and_then(|b| parse_object(&b).and_then(|m| parse_gen(&m, chat)))?;
        let req = build(&st, &p, chat)?;
        Ok((p, req))
    })
    .await;
    let (p, req) = match prepared {
        Ok(pr) => pr,
        Err(e) => return e.into_response(),
    };
    let rx = match state.service.submit(req).await {
        Ok(rx) => rx,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let model = p.model.clone().unwrap_or_else(|| state.model_name.clone());
    let id = request_id(if chat { "chatcmpl" } else { "cmpl" });
    if p.stream {
        sse_response(rx, id, model, chat, p.include_usage).into_response()
    } else {
        whole_response(rx, id, model, chat).await
    }
}

async fn whole_response(
    mut rx: UnboundedReceiver<StreamEvent>,
    id: String,
    model: String,
    chat: bool,
) -> Response {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            StreamEvent::Text { text: t, .. } => text.push_str(&t),
            StreamEvent::Error(e) => return ApiError::internal(e).into_response(),
            StreamEvent::Done(c) => {
                let choice = if chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text},
                           "logprobs": null, "finish_reason": c.finish_reason})
                } else {
                    json!({"index": 0, "text": text, "logprobs": null, "finish_reason": c.finish_reason})
                };
                return Json(json!({
                    "id": id,
                    "object": if chat { "chat.completion" } else { "text_completion" },
                    "created": now(),
                    "model": model,
                    "choices": [choice],
                    "usage": usage(&c),
                    "flashplan": flashplan_block(&c),
                }))
                .into_response();
            }
        }
    }
    ApiError::internal("the engine dropped the request").into_response()
}

struct SseState {
    rx: Option<UnboundedReceiver<StreamEvent>>,
    id: String,
    model: String,
    chat: bool,
    include_usage: bool,
    created: u64,
    sent_role: bool,
}

impl SseState {
    fn chunk(&self, delta: Option<&str>, finish: Option<Value>, extra: Option<Value>) -> Value {
        let choice = if self.chat {
            let mut d = serde_json::Map::new();
            if !self.sent_role {
                d.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = delta {
                d.insert("content".into(), json!(t));
            }
            json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": delta.unwrap_or(""), "logprobs": null, "finish_reason": finish})
        };
        let mut v = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Value::Object(o) = &mut v {
            if self.include_usage {
                // OpenAI's rule: with `include_usage`, every chunk but the usage chunk has `"usage": null`.
                o.insert("usage".into(), Value::Null);
            }
            if let Some(Value::Object(e)) = extra {
                o.extend(e);
            }
        }
        v
    }
}

fn data(v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

fn sse_response(
    rx: UnboundedReceiver<StreamEvent>,
    id: String,
    model: String,
    chat: bool,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let st = SseState {
        rx: Some(rx),
        id,
        model,
        chat,
        include_usage,
        created: now(),
        sent_role: false,
    };
    // Each step yields the events for one message from the engine; dropping the stream (client gone) drops the
    // receiver, and the engine cancels the stream at the next round.
    let s = stream::unfold(st, |mut st| async move {
        let rx = st.rx.as_mut()?;
        let ev = rx.recv().await;
        let mut out = Vec::new();
        match ev {
            Some(StreamEvent::Text { text, .. }) => {
                if !text.is_empty() || (st.chat && !st.sent_role) {
                    out.push(data(&st.chunk(Some(&text), None, None)));
                    st.sent_role = true;
                }
            }
            Some(StreamEvent::Done(c)) => {
                // The reply's `flashplan` statistics come once: in the usage chunk when there is one, else in the
                // chunk that ends the choice (which, as every chunk of a stream without `include_usage`, has no
                // `usage` key).
                let extra = (!st.include_usage).then(|| json!({"flashplan": flashplan_block(&c)}));
                let fin = st.chunk(
                    if st.chat { None } else { Some("") },
                    Some(json!(c.finish_reason)),
                    extra,
                );
                out.push(data(&fin));
                st.sent_role = true;
                if st.include_usage {
                    out.push(data(&json!({
                        "id": st.id, "object": if st.chat { "chat.completion.chunk" } else { "text_completion" },
                        "created": st.created, "model": st.model, "choices": [],
                        "usage": usage(&c), "flashplan": flashplan_block(&c),
                    })));
                }
                out.push(Ok(SseEvent::default().data("[DONE]")));
                st.rx = None;
            }
            Some(StreamEvent::Error(e)) => {
                out.push(data(&ApiError::internal(e).body()));
                out.push(Ok(SseEvent::default().data("[DONE]")));
                st.rx = None;
            }
            None => {
                out.push(data(
                    &ApiError::internal("the engine dropped the request").body(),
                ));
                // As after an engine error: clients wait for the end marker.
                out.push(Ok(SseEvent::default().data("[DONE]")));
                st.rx = None;
            }
        }
        Some((stream::iter(out), st))
    })
    .flatten();
    Sse::new(s)
}

/// Refuses a field of a `/tokenize` or `/detokenize` body other than `known`, naming it, as the generation
/// endpoints refuse theirs.
///
/// # Errors
/// 400 `unsupported_parameter` naming the field.
fn only_fields(m: &serde_json::Map<String, Value>, known: &[&str]) -> Result<(), ApiError> {
    match m.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(ApiError::invalid(
            Some(k),
            format!(
                "`{k}` is not a field of this endpoint (it takes {})",
                known.join(", ")
            ),
        )
        .code("unsupported_parameter")),
    }
}

/// The served model as OpenAI's model object.
fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.model_name,
        "object": "model",
        "created": now(),
        "owned_by": "flashplan",
        "max_model_len": state.service.info.max_model_len(),
    })
}

async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

/// `GET /v1/models/{id}` (the `openai` client's `models.retrieve`): the served model, or 404 `model_not_found`.
async fn model(
    State(state): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match served_model(&state, Some(&id)) {
        Ok(()) => Json(model_object(&state)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn health(State(state): State<AppState>) -> Response {
    if state.service.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the engine thread has stopped".into(),
            kind: "server_error",
            param: None,
            code: Some("engine_unavailable"),
        }
        .into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.service.metrics.render(),
    )
        .into_response()
}

async fn tokenize(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = move || -> Result<Value, ApiError> {
        let m = parse_object(&read_body(body)?)?;
        only_fields(
            &m,
            &[
                "model",
                "prompt",
                "messages",
                "add_special_tokens",
                "add_generation_prompt",
            ],
        )?;
        served_model(&state, api::model_field(&m)?.as_deref())?;
        let tok = &state.service.tokenizer;
        let info = &state.service.info;
        // A null field is an absent one, as on the generation endpoints.
        let given = |k: &str| m.get(k).is_some_and(|v| !v.is_null());
        if given("prompt") && given("messages") {
            return Err(ApiError::invalid(
                Some("prompt"),
                "give `prompt` (a string) or `messages`, not both",
            ));
        }
        let ids = if given("messages") {
            let Prompt::Chat(msgs) = api::parse_messages(&m)? else {
                return Err(ApiError::internal("unreachable"));
            };
            let add = api::boolean(&m, "add_generation_prompt")?.unwrap_or(true);
            let text = tok
                .apply_chat_template(&msgs, add)
                .map_err(template_error)?;
            encode_within(tok, &text, false, "messages", info)?
        } else {
            match m.get("prompt").filter(|v| !v.is_null()) {
                Some(Value::String(s)) => {
                    let add = api::boolean(&m, "add_special_tokens")?.unwrap_or(true);
                    encode_within(tok, s, add, "prompt", info)?
                }
                Some(v) => {
                    return Err(ApiError::invalid(
                        Some("prompt"),
                        format!("`prompt` must be a string, got {}", api::type_name(v)),
                    ))
                }
                None => {
                    return Err(ApiError::invalid(
                        Some("prompt"),
                        "give `prompt` (a string) or `messages`",
                    ))
                }
            }
        };
        Ok(json!({"count": ids.len(), "max_model_len": info.max_model_len(), "tokens": ids}))
    };
    match blocking(run).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = move || -> Result<Value, ApiError> {
        let m = parse_object(&read_body(body)?)?;
        only_fields(&m, &["model", "tokens"])?;
        served_model(&state, api::model_field(&m)?.as_deref())?;
        let ids = match m.get("tokens") {
            Some(Value::Array(a)) => api::token_ids("tokens", a)?,
            Some(v) => {
                return Err(ApiError::invalid(
                    Some("tokens"),
                    format!(
                        "`tokens` must be an array of token ids, got {}",
                        api::type_name(v)
                    ),
                ))
            }
            None => return Err(ApiError::invalid(Some("tokens"), "`tokens` is required")),
        };
        in_vocab("tokens", &ids, state.service.tokenizer.vocab_size())
            .map_err(|e| e.code("invalid_token_id"))?;
        let text = state
            .service
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::invalid(Some("tokens"), e.to_string()))?;
        Ok(json!({"prompt": text}))
    };
    match blocking(run).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::accept;

    /// The server's accept hands out connections with Nagle's algorithm off (a socket accepted as it is has it on).
    #[tokio::test]
    async fn accepted_connections_get_tcp_nodelay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _plain_client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (plain, _) = listener.accept().await.unwrap();
        assert!(
            !plain.nodelay().unwrap(),
            "a fresh socket starts with Nagle on"
        );
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (stream, _) = accept(&listener).await;
        assert!(stream.nodelay().unwrap());
    }
}
