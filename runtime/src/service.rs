//! The engine thread: one thread owns the [`Engine`] (and so the backend, which need not be shareable), takes
//! requests through a channel, streams each reply's text and tokens back through the request's own channel, ends a
//! reply at a stop string (through the engine's per-token callback), cancels a stream whose receiver was dropped
//! (the client went away) at the next round, and keeps aggregate metrics for `/metrics`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::backend::Backend;
use crate::engine::{Control, Engine, EngineError, Event, FinishReason, ReplyStats, Request};
use crate::tokenizer::{TextStream, Tokenizer};

/// SHA-256 hex of the comma-joined token ids (`"1,2,3"`): a reply's `token_sha`.
pub fn token_sha(ids: &[u32]) -> String {
    let joined = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let d = Sha256::digest(joined.as_bytes());
    d.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A generation request for the service: the engine request plus stop strings.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The engine request (prompt ids, sampling, limits).
    pub request: Request,
    /// Stop strings: the reply ends at the token that completes one; the text ends just before it.
    pub stop: Vec<String>,
}

/// Why a request was refused at submission.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The engine refused it (too long, empty, bad token id, queue full).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The engine thread has stopped.
    #[error("the engine is not running")]
    Stopped,
}

/// A finished reply's summary.
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Reply tokens (the token that completed a stop string included).
    pub completion_tokens: u32,
    /// The reply's token ids.
    pub token_ids: Vec<u32>,
    /// SHA-256 of the comma-joined reply token ids.
    pub token_sha: String,
    /// Engine statistics.
    pub stats: ReplyStats,
}

/// What a request's channel receives.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    /// Reply text (complete UTF-8, never part of a stop string) and the number of tokens it came from.
    Text {
        /// The text piece (may be empty when a token completes no character yet).
        text: String,
        /// Tokens since the previous event.
        tokens: u32,
    },
    /// The reply is complete (any remaining text came in a `Text` event before).
    Done(Completion),
    /// The request failed.
    Error(String),
}

/// Fixed-bucket histogram for Prometheus.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation (seconds or any unit the buckets use).
    pub fn observe(&self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if v <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((v * 1e6).max(0.0) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const TPR_BUCKETS: &[f64] = &[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0];

/// Aggregate counters for `/metrics`.
#[derive(Debug)]
pub struct Metrics {
    /// Requests accepted.
    pub requests: AtomicU64,
    /// Requests the engine refused at submission or that failed while decoding (a request the API's validation
    /// rejects, HTTP 400 before it reaches the engine, is not counted).
    pub failed: AtomicU64,
    /// Requests cancelled (client went away).
    pub cancelled: AtomicU64,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens: AtomicU64,
    /// Reply tokens.
    pub completion_tokens: AtomicU64,
    /// Verify rounds.
    pub rounds: AtomicU64,
    /// Copy drafts proposed.
    pub drafted_copy: AtomicU64,
    /// Copy drafts accepted.
    pub accepted_copy: AtomicU64,
    /// MTP drafts proposed.
    pub drafted_mtp: AtomicU64,
    /// MTP drafts accepted.
    pub accepted_mtp: AtomicU64,
    /// Streams waiting or decoding now.
    pub busy: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Request latency (submission to last token).
    pub latency: Histogram,
    /// Tokens per round of each reply.
    pub tokens_per_round: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            drafted_copy: AtomicU64::new(0),
            accepted_copy: AtomicU64::new(0),
            drafted_mtp: AtomicU64::new(0),
            accepted_mtp: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BUCKETS),
            latency: Histogram::new(LATENCY_BUCKETS),
            tokens_per_round: Histogram::new(TPR_BUCKETS),
        }
    }
}

impl Metrics {
    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        counter(
            &mut out,
            "flashplan_requests_total",
            "Requests accepted.",
            &self.requests,
        );
        counter(
            &mut out,
            "flashplan_requests_failed_total",
            "Requests the engine refused at submission or that failed while decoding (HTTP 400s from validation are not counted).",
            &self.failed,
        );
        counter(
            &mut out,
            "flashplan_requests_cancelled_total",
            "Requests whose client went away.",
            &self.cancelled,
        );
        counter(
            &mut out,
            "flashplan_prompt_tokens_total",
            "Prompt tokens.",
            &self.prompt_tokens,
        );
        counter(
            &mut out,
            "flashplan_completion_tokens_total",
            "Reply tokens.",
            &self.completion_tokens,
        );
        counter(
            &mut out,
            "flashplan_rounds_total",
            "Verify rounds (per stream).",
            &self.rounds,
        );
        let _ = writeln!(
            out,
            "# HELP flashplan_drafted_tokens_total Drafts proposed, by drafter.\n# TYPE flashplan_drafted_tokens_total counter"
        );
        let _ = writeln!(
            out,
            "flashplan_drafted_tokens_total{{drafter=\"copy\"}} {}\nflashplan_drafted_tokens_total{{drafter=\"mtp\"}} {}",
            self.drafted_copy.load(Ordering::Relaxed),
            self.drafted_mtp.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP flashplan_accepted_tokens_total Drafts accepted, by drafter.\n# TYPE flashplan_accepted_tokens_total counter"
        );
        let _ = writeln!(
            out,
            "flashplan_accepted_tokens_total{{drafter=\"copy\"}} {}\nflashplan_accepted_tokens_total{{drafter=\"mtp\"}} {}",
            self.accepted_copy.load(Ordering::Relaxed),
            self.accepted_mtp.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP flashplan_streams Streams waiting or decoding.\n# TYPE flashplan_streams gauge\nflashplan_streams {}",
            self.busy.load(Ordering::Relaxed)
        );
        self.ttft.render(
            &mut out,
            "flashplan_time_to_first_token_seconds",
            "Time from submission to the first reply token.",
        );
        self.latency.render(
            &mut out,
            "flashplan_request_latency_seconds",
            "Time from submission to the last reply token.",
        );
        self.tokens_per_round.render(
            &mut out,
            "flashplan_tokens_per_round",
            "Reply tokens per verify round, per reply.",
        );
        out
    }
}

/// What the service knows about the model it serves.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Context tokens per stream (prompt + reply + one verify window).
    pub context: u64,
    /// Most drafts per window in force.
    pub max_depth: u32,
    /// Vocabulary size of the model.
    pub vocab_size: u32,
    /// Most streams decoding at once.
    pub parallel: u32,
}

impl ModelInfo {
    /// The most tokens a request may use, its prompt and `max_tokens` together: the context less one verify window
    /// ([`crate::engine::request_limit`]). Answered as `max_model_len`; a request past it is refused.
    pub fn max_model_len(&self) -> u64 {
        crate::engine::request_limit(self.context, self.max_depth)
    }
}

enum Cmd {
    Submit {
        req: Box<GenRequest>,
        events: tmpsc::UnboundedSender<StreamEvent>,
        reply: oneshot::Sender<Result<(), SubmitError>>,
    },
    Shutdown,
}

struct Live {
    text: TextStream,
    /// The request's `stop_token_ids`: the token that ends the reply so adds no text.
    stop_ids: Vec<u32>,
    events: tmpsc::UnboundedSender<StreamEvent>,
    prompt_tokens: u32,
    submitted: Instant,
    first_token: bool,
    gone: bool,
    error: Option<String>,
}

type Streams = Arc<Mutex<HashMap<u64, Live>>>;

/// A handle to the engine thread (cheap to clone).
#[derive(Clone)]
pub struct Service {
    tx: mpsc::Sender<Cmd>,
    /// The aggregate metrics.
    pub metrics: Arc<Metrics>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Model facts for validation and `/v1/models`.
    pub info: ModelInfo,
    alive: Arc<AtomicBool>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").field("info", &self.info).finish()
    }
}

impl Service {
    /// Starts the engine thread, moving `engine` into it.
    pub fn start<B: Backend + 'static>(mut engine: Engine<B>, tokenizer: Arc<Tokenizer>) -> Self {
        let body = engine.backend().body();
        let info = ModelInfo {
            context: body.state.context,
            max_depth: engine.options().max_depth,
            vocab_size: body.config.vocab_size,
            parallel: engine.options().parallel,
        };
        let metrics = Arc::new(Metrics::default());
        let alive = Arc::new(AtomicBool::new(true));
        let (tx, rx) = mpsc::channel();
        let streams: Streams = Arc::new(Mutex::new(HashMap::new()));
        {
            let streams = streams.clone();
            let tok = tokenizer.clone();
            let m = metrics.clone();
            engine.on_token = Box::new(move |id, t| on_token(&streams, &tok, &m, id, t));
        }
        let m = metrics.clone();
        let tok = tokenizer.clone();
        let alive2 = alive.clone();
        std::thread::Builder::new()
            .name("flashplan-engine".into())
            .spawn(move || {
                // Clears `alive` however the loop ends, a panic included (/health then says so).
                struct Dead(Arc<AtomicBool>);
                impl Drop for Dead {
                    fn drop(&mut self) {
                        self.0.store(false, Ordering::SeqCst);
                    }
                }
                let _dead = Dead(alive2);
                engine_loop(engine, rx, streams, tok, m);
            })
            .expect("spawning the engine thread");
        Service {
            tx,
            metrics,
            tokenizer,
            info,
            alive,
        }
    }

    /// True while the engine thread runs.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Submits a request; returns its event channel once the engine accepted it. Dropping the receiver cancels
    /// the stream at the next round.
    ///
    /// # Errors
    /// [`SubmitError`] when the engine refuses the request or has stopped.
    pub async fn submit(
        &self,
        req: GenRequest,
    ) -> Result<tmpsc::UnboundedReceiver<StreamEvent>, SubmitError> {
        let (erx, rrx) = self.send_submit(req)?;
        rrx.await.map_err(|_| SubmitError::Stopped)??;
        Ok(erx)
    }

    /// [`Service::submit`] for callers outside an async runtime.
    ///
    /// # Errors
    /// [`SubmitError`] when the engine refuses the request or has stopped.
    pub fn submit_blocking(
        &self,
        req: GenRequest,
    ) -> Result<tmpsc::UnboundedReceiver<StreamEvent>, SubmitError> {
        let (erx, rrx) = self.send_submit(req)?;
        rrx.blocking_recv().map_err(|_| SubmitError::Stopped)??;
        Ok(erx)
    }

    /// Sends a request to the engine thread: its event channel and the channel of the engine's verdict.
    #[allow(clippy::type_complexity)]
    fn send_submit(
        &self,
        req: GenRequest,
    ) -> Result<
        (
            tmpsc::UnboundedReceiver<StreamEvent>,
            oneshot::Receiver<Result<(), SubmitError>>,
        ),
        SubmitError,
    > {
        let (etx, erx) = tmpsc::unbounded_channel();
        let (rtx, rrx) = oneshot::channel();
        self.tx
            .send(Cmd::Submit {
                req: Box::new(req),
                events: etx,
                reply: rtx,
            })
            .map_err(|_| SubmitError::Stopped)?;
        Ok((erx, rrx))
    }

    /// Asks the engine thread to stop after the current step (live streams are dropped).
    pub fn shutdown(&self) {
        let _ = self.tx.send(Cmd::Shutdown);
    }
}

fn on_token(streams: &Streams, tok: &Tokenizer, m: &Metrics, id: u64, t: u32) -> Control {
    let mut map = streams.lock().unwrap_or_else(|e| e.into_inner());
    let Some(s) = map.get_mut(&id) else {
        return Control::Stop;
    };
    if !s.first_token {
        s.first_token = true;
        m.ttft.observe(s.submitted.elapsed().as_secs_f64());
    }
    let pushed = if s.stop_ids.contains(&t) {
        s.text.push_stop_token(tok, t)
    } else {
        s.text.push(tok, t)
    };
    let delta = match pushed {
        Ok(d) => d,
        Err(e) => {
            s.error = Some(e.to_string());
            return Control::Stop;
        }
    };
    if s.events
        .send(StreamEvent::Text {
            text: delta.text,
            tokens: 1,
        })
        .is_err()
    {
        s.gone = true;
        return Control::Stop;
    }
    if delta.stopped {
        Control::Stop
    } else {
        Control::Continue
    }
}

fn engine_loop<B: Backend>(
    mut engine: Engine<B>,
    rx: mpsc::Receiver<Cmd>,
    streams: Streams,
    tok: Arc<Tokenizer>,
    m: Arc<Metrics>,
) {
    loop {
        // Take commands: block when idle, else only what is queued.
        let mut cmds = Vec::new();
        if engine.busy() == 0 {
            match rx.recv() {
                Ok(c) => cmds.push(c),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => cmds.push(c),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if engine.busy() == 0 && cmds.is_empty() {
                        return;
                    }
                    break;
                }
            }
        }
        for c in cmds {
            match c {
                Cmd::Shutdown => return,
                Cmd::Submit { req, events, reply } => {
                    let GenRequest { request, stop } = *req;
                    let prompt_tokens = request.prompt.len() as u32;
                    let stop_ids = request.stop_token_ids.clone();
                    match engine.submit(request) {
                        Ok(id) => {
                            m.requests.fetch_add(1, Ordering::Relaxed);
                            m.prompt_tokens
                                .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
                            streams.lock().unwrap_or_else(|e| e.into_inner()).insert(
                                id,
                                Live {
                                    text: TextStream::new(stop),
                                    stop_ids,
                                    events,
                                    prompt_tokens,
                                    submitted: Instant::now(),
                                    first_token: false,
                                    gone: false,
                                    error: None,
                                },
                            );
                            let _ = reply.send(Ok(()));
                        }
                        Err(e) => {
                            m.failed.fetch_add(1, Ordering::Relaxed);
                            let _ = reply.send(Err(e.into()));
                        }
                    }
                }
            }
        }
        // Cancel streams whose client went away.
        let gone: Vec<u64> = streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, s)| s.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            engine.cancel(id);
            streams
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            m.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        if engine.busy() == 0 {
            m.busy.store(0, Ordering::Relaxed);
            continue;
        }
        let events = engine.step();
        m.busy.store(engine.busy() as u64, Ordering::Relaxed);
        for ev in events {
            match ev {
                Event::Token { .. } => {}
                Event::Finished {
                    stream,
                    reason,
                    stats,
                } => {
                    let Some(mut s) = streams
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&stream)
                    else {
                        continue;
                    };
                    if s.gone {
                        m.cancelled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    if let Some(err) = s.error.take() {
                        m.failed.fetch_add(1, Ordering::Relaxed);
                        let _ = s.events.send(StreamEvent::Error(err));
                        continue;
                    }
                    match s.text.finish(&tok) {
                        Ok(rest) if !rest.is_empty() => {
                            let _ = s.events.send(StreamEvent::Text {
                                text: rest,
                                tokens: 0,
                            });
                        }
                        Ok(_) => {}
                        Err(e) => {
                            let _ = s.events.send(StreamEvent::Error(e.to_string()));
                            continue;
                        }
                    }
                    let ids = s.text.ids().to_vec();
                    m.completion_tokens
                        .fetch_add(ids.len() as u64, Ordering::Relaxed);
                    m.rounds.fetch_add(stats.rounds as u64, Ordering::Relaxed);
                    m.drafted_copy
                        .fetch_add(stats.drafted_copy as u64, Ordering::Relaxed);
                    m.accepted_copy
                        .fetch_add(stats.accepted_copy as u64, Ordering::Relaxed);
                    m.drafted_mtp
                        .fetch_add(stats.drafted_mtp as u64, Ordering::Relaxed);
                    m.accepted_mtp
                        .fetch_add(stats.accepted_mtp as u64, Ordering::Relaxed);
                    m.latency.observe(s.submitted.elapsed().as_secs_f64());
                    if stats.rounds > 0 {
                        m.tokens_per_round.observe(stats.tokens_per_round());
                    }
                    let _ = s.events.send(StreamEvent::Done(Completion {
                        finish_reason: reason,
                        prompt_tokens: s.prompt_tokens,
                        completion_tokens: ids.len() as u32,
                        token_sha: token_sha(&ids),
                        token_ids: ids,
                        stats,
                    }));
                }
                Event::Failed { stream, error } => {
                    m.failed.fetch_add(1, Ordering::Relaxed);
                    if let Some(s) = streams
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&stream)
                    {
                        let _ = s.events.send(StreamEvent::Error(error));
                    }
                }
            }
        }
        // Keep a busy loop from spinning when every stream waits on nothing (should not happen).
        if engine.busy() > 0 && streams.lock().map(|s| s.is_empty()).unwrap_or(false) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_sha_is_sha256_of_comma_joined_ids() {
        assert_eq!(
            token_sha(&[1, 2, 3]),
            "8a6ae15122001229edb8866f56e342af12ae8187203c3e3b33931743e7c0c48d"
        );
        assert_eq!(token_sha(&[]).len(), 64);
    }
}
