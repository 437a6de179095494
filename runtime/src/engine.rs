//! The scheduler and rounds (`rounds.md`): streams share verify rounds (one replay for all their windows), a lone
//! stream uses the lone-stream variants, prompts are admitted in prefill chunks between rounds, and each stream's
//! next chain comes from the copy index or the MTP head. Every reply equals plain one-token decoding because every
//! variant is row-invariant and the state commit keeps exactly `keep` rows.

use std::collections::VecDeque;
use std::time::Instant;

use flashplan_plan::{DrafterForm, IoBuf, RoundDesc, SamplingParams, StreamDesc, VariantKind};
use serde::Serialize;

use crate::backend::{Backend, BackendError};
use crate::copy_index::CopyIndex;

/// Engine settings (`rounds.md` section 2; environment `FLASHPLAN_COPY_DRAFTS`, `FLASHPLAN_MTP_WEIGHTS`).
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Most drafts per window (at most the plan's `max_depth`).
    pub max_depth: u32,
    /// Copy drafts on (`FLASHPLAN_COPY_DRAFTS`, default on).
    pub copy_drafts: bool,
    /// MTP drafts on (when the checkpoint has a drafter).
    pub mtp_drafts: bool,
    /// MTP confidence threshold: a later draft whose probability at temperature 1 is below it ends the chain.
    pub confidence: f32,
    /// The MTP drafter weight form.
    pub drafter_form: DrafterForm,
    /// Most streams decoding at once (`--parallel`).
    pub parallel: u32,
    /// Most requests waiting for a slot; more are refused.
    pub queue: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_depth: 15,
            copy_drafts: true,
            mtp_drafts: true,
            confidence: 0.3,
            drafter_form: DrafterForm::Checkpoint,
            parallel: 16,
            queue: 256,
        }
    }
}

/// An environment variable with a value the engine does not accept.
#[derive(Debug, thiserror::Error)]
#[error("environment variable {name}={value:?} is not accepted: expected one of {expected}")]
pub struct EnvError {
    /// Variable name.
    pub name: &'static str,
    /// Its value.
    pub value: String,
    /// The accepted values.
    pub expected: &'static str,
}

impl EngineOptions {
    /// Applies `FLASHPLAN_COPY_DRAFTS` (`1`/`0`) and `FLASHPLAN_MTP_WEIGHTS` (`checkpoint`/`mxfp8`/`mxfp8-head`).
    ///
    /// # Errors
    /// [`EnvError`] naming the variable when its value is not one of those.
    pub fn from_env(mut self) -> Result<Self, EnvError> {
        let copy = flashplan_plan::env::switch("FLASHPLAN_COPY_DRAFTS").map_err(|e| EnvError {
            name: "FLASHPLAN_COPY_DRAFTS",
            value: e.value,
            expected: "1, 0",
        })?;
        if let Some(on) = copy {
            self.copy_drafts = on;
        }
        // A value that is not UTF-8 is refused like any other unknown one (not taken as unset).
        if let Some(v) = std::env::var_os("FLASHPLAN_MTP_WEIGHTS") {
            self.drafter_form = match v.to_str() {
                Some("checkpoint") => DrafterForm::Checkpoint,
                Some("mxfp8") => DrafterForm::Mxfp8,
                Some("mxfp8-head") => DrafterForm::Mxfp8Head,
                _ => {
                    return Err(EnvError {
                        name: "FLASHPLAN_MTP_WEIGHTS",
                        value: v.to_string_lossy().into_owned(),
                        expected: "checkpoint, mxfp8, mxfp8-head",
                    })
                }
            };
        }
        Ok(self)
    }
}

/// One generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most reply tokens.
    pub max_tokens: u32,
    /// Sampling parameters; the seed is already resolved (the request's, or `prompt_seed`).
    pub sampling: SamplingParams,
    /// Extra stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at eos.
    pub ignore_eos: bool,
    /// Drafting on for this request (`"draft": false` gives k = 0 every round).
    pub draft: bool,
}

/// Why a reply ended (OpenAI `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// eos, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// OpenAI's name for it: `stop` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Statistics of one reply (issue 5, item 8).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplyStats {
    /// Verify rounds.
    pub rounds: u32,
    /// Drafts proposed by the copy index.
    pub drafted_copy: u32,
    /// Copy drafts accepted and in the reply: a draft the verify forward kept after the reply's end (a stop string
    /// or token inside the round's kept tokens) is not counted, so `accepted_copy + accepted_mtp + rounds` equals
    /// `tokens - 1`, or `tokens` where the last round's bonus token fell after the end. (`drafted_*` count every
    /// proposal, those after the end included.)
    pub accepted_copy: u32,
    /// Drafts proposed by the MTP head.
    pub drafted_mtp: u32,
    /// MTP drafts accepted and in the reply (as `accepted_copy`).
    pub accepted_mtp: u32,
    /// Rounds whose drafts came from the copy index.
    pub copy_rounds: u32,
    /// Reply tokens given by copy rounds (kept tokens past the reply's end not counted).
    pub copy_round_tokens: u32,
    /// Rounds whose drafts came from the MTP head.
    pub mtp_rounds: u32,
    /// Reply tokens given by MTP rounds (as `copy_round_tokens`).
    pub mtp_round_tokens: u32,
    /// MTP rounds whose first draft was kept (by the verify forward; the first kept token is always in the reply).
    pub mtp_first_kept: u32,
    /// Seconds spent prefilling the prompt.
    pub prefill_s: f64,
    /// Seconds from the first token to the end.
    pub decode_s: f64,
    /// Reply tokens.
    pub tokens: u32,
}

impl ReplyStats {
    /// Takes out of a round's counts what fell after the reply's end: the round kept `keep` tokens (`keep - 1`
    /// accepted drafts, then the bonus token) and the reply ended at its `used`-th (`1..=keep`).
    fn trim_round(&mut self, drafter: Drafter, keep: u32, used: u32) {
        let unused_tokens = keep - used;
        let unused_drafts = (keep - 1) - (keep - 1).min(used);
        let (accepted, tokens) = match drafter {
            Drafter::Copy => (&mut self.accepted_copy, &mut self.copy_round_tokens),
            Drafter::Mtp => (&mut self.accepted_mtp, &mut self.mtp_round_tokens),
            Drafter::None => return,
        };
        *accepted -= unused_drafts;
        *tokens -= unused_tokens;
    }

    /// Tokens per round (reply tokens after the first, per verify round).
    pub fn tokens_per_round(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.tokens.saturating_sub(1)) as f64 / self.rounds as f64
        }
    }
}

/// The most tokens a request may use, its prompt and reply together, in a context of `context`, which also keeps
/// one verify window (`max_depth + 1` rows) past the reply: the server's `max_model_len`.
pub fn request_limit(context: u64, max_depth: u32) -> u64 {
    context.saturating_sub(max_depth as u64 + 1)
}

/// The most reply tokens that fit after a prompt of `prompt` tokens in a context of `context`, which also keeps
/// one verify window (`max_depth + 1` rows) past the reply ([`request_limit`] less the prompt); 0 when the prompt
/// alone does not fit.
pub fn reply_room(context: u64, prompt: usize, max_depth: u32) -> u64 {
    request_limit(context, max_depth).saturating_sub(prompt as u64)
}

/// Identifies a stream inside the engine.
pub type StreamId = u64;

/// What the caller decides after each emitted token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Keep going.
    Continue,
    /// Stop after this token (a stop string completed, or the client went away).
    Stop,
}

/// Things that happened during a step, in order.
#[derive(Debug, Clone)]
pub enum Event {
    /// A reply token.
    Token {
        /// The stream.
        stream: StreamId,
        /// The token id.
        id: u32,
    },
    /// The reply is complete.
    Finished {
        /// The stream.
        stream: StreamId,
        /// Why.
        reason: FinishReason,
        /// Its statistics.
        stats: ReplyStats,
    },
    /// The request failed (the others go on).
    Failed {
        /// The stream.
        stream: StreamId,
        /// What went wrong.
        error: String,
    },
}

/// The message of [`EngineError::TooLong`]: a prompt that leaves no room for one reply token is called too long;
/// otherwise the message says how many reply tokens fit after it.
fn too_long_text(
    prompt: usize,
    max_tokens: u32,
    context: u64,
    window: u64,
    limit: u64,
    room: u64,
) -> String {
    let why = format!(
        "the context of {context} tokens less {window} kept for one verify window, max depth + 1"
    );
    if room == 0 {
        format!(
            "the prompt is too long: {prompt} tokens, where a request may use at most {limit} ({why}), prompt and \
             at least one reply token together"
        )
    } else {
        let fit = if room == 1 {
            "token fits"
        } else {
            "tokens fit"
        };
        format!(
            "prompt of {prompt} tokens plus max_tokens {max_tokens} is over the {limit} tokens a request may use \
             ({why}): at most {room} reply {fit} after this prompt"
        )
    }
}

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The prompt and the reply do not fit the context, which also holds one verify window past the reply.
    #[error("{}", too_long_text(*.prompt, *.max_tokens, *.context, *.window, *.limit, *.room))]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested reply tokens.
        max_tokens: u32,
        /// Context per slot.
        context: u64,
        /// Positions kept for one verify window past the reply (the engine's max depth + 1).
        window: u64,
        /// The most tokens a request may use, prompt and reply together ([`request_limit`]).
        limit: u64,
        /// The most reply tokens that fit after this prompt (0 when the prompt alone does not fit).
        room: u64,
    },
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is 0: a reply has at least one token.
    #[error("max_tokens is 0: expected at least 1 (a reply has at least one token)")]
    NoReplyTokens,
    /// The queue is full.
    #[error("the server is busy: {0} requests are already waiting")]
    QueueFull(usize),
    /// A token id is outside the vocabulary.
    #[error("token id {0} is outside the vocabulary of {1}")]
    BadToken(u32, u32),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drafter {
    None,
    Copy,
    Mtp,
}

struct Stream {
    id: StreamId,
    req: Request,
    slot: u32,
    /// Prompt rows prefilled so far.
    prefilled: usize,
    /// Committed positions (the pending token sits at `pos`).
    pos: u32,
    pending: u32,
    drafts: Vec<u32>,
    drafter: Drafter,
    emitted: u32,
    index: CopyIndex,
    stats: ReplyStats,
    started: Instant,
    decode_started: Option<Instant>,
    done: bool,
}

/// The engine: owns a backend and every live stream.
pub struct Engine<B: Backend> {
    backend: B,
    opts: EngineOptions,
    waiting: VecDeque<Stream>,
    live: Vec<Stream>,
    free_slots: Vec<u32>,
    next_id: StreamId,
    has_mtp: bool,
    eos: Vec<u32>,
    verify_streams: Vec<u32>,
    /// Per-token callback deciding whether a stream stops (stop strings, disconnects).
    pub on_token: Box<dyn FnMut(StreamId, u32) -> Control + Send>,
    /// When `Some`, every verified MTP chain is appended as `(stream, position of the round's first row, drafted
    /// tokens)` (measurements compare drafter forms at equal positions; `None` by default: nothing is recorded).
    pub mtp_chains: Option<Vec<(StreamId, u32, Vec<u32>)>>,
}

impl<B: Backend> Engine<B> {
    /// An engine over a backend. `has_mtp`: the checkpoint has a drafter.
    pub fn new(backend: B, mut opts: EngineOptions, has_mtp: bool) -> Self {
        let body = backend.body();
        opts.max_depth = opts.max_depth.min(body.options.max_depth);
        let slots = body.state.slots;
        opts.parallel = opts.parallel.clamp(1, slots);
        let eos = body.config.eos_token_ids.clone();
        let verify_streams = body.options.streams.clone();
        Engine {
            backend,
            free_slots: (0..opts.parallel).rev().collect(),
            opts,
            waiting: VecDeque::new(),
            live: Vec::new(),
            next_id: 1,
            has_mtp,
            eos,
            verify_streams,
            on_token: Box::new(|_, _| Control::Continue),
            mtp_chains: None,
        }
    }

    /// The backend (tests read slot state through it).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The options in force.
    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// `(stream, slot, committed positions)` of every decoding stream (tests compare slot state at equal positions).
    pub fn positions(&self) -> Vec<(StreamId, u32, u32)> {
        self.live
            .iter()
            .filter(|s| s.decode_started.is_some() && !s.done)
            .map(|s| (s.id, s.slot, s.pos))
            .collect()
    }

    /// Number of streams decoding or waiting.
    pub fn busy(&self) -> usize {
        self.live.len() + self.waiting.len()
    }

    /// Queues a request; it is admitted when a slot frees.
    ///
    /// # Errors
    /// [`EngineError`] for an empty or too long prompt, a token outside the vocabulary, or a full queue.
    pub fn submit(&mut self, req: Request) -> Result<StreamId, EngineError> {
        let body = self.backend.body();
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab = body.config.vocab_size;
        if let Some(&t) = req.prompt.iter().find(|&&t| t >= vocab) {
            return Err(EngineError::BadToken(t, vocab));
        }
        if req.max_tokens == 0 {
            return Err(EngineError::NoReplyTokens);
        }
        let context = body.state.context;
        // Room for the prompt, the reply and one verify window past it.
        let window = self.opts.max_depth as u64 + 1;
        let room = reply_room(context, req.prompt.len(), self.opts.max_depth);
        if req.max_tokens as u64 > room {
            return Err(EngineError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                context,
                window,
                limit: request_limit(context, self.opts.max_depth),
                room,
            });
        }
        if self.waiting.len() >= self.opts.queue {
            return Err(EngineError::QueueFull(self.waiting.len()));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Stream {
            id,
            req,
            slot: 0,
            prefilled: 0,
            pos: 0,
            pending: 0,
            drafts: Vec::new(),
            drafter: Drafter::None,
            emitted: 0,
            index: CopyIndex::new(),
            stats: ReplyStats::default(),
            started: Instant::now(),
            decode_started: None,
            done: false,
        });
        Ok(id)
    }

    /// Cancels a stream; its slot frees at the next round boundary.
    pub fn cancel(&mut self, id: StreamId) {
        self.waiting.retain(|s| s.id != id);
        for s in &mut self.live {
            if s.id == id {
                s.done = true;
            }
        }
    }

    /// Runs one step: admits waiting requests into free slots, runs one prefill chunk of the oldest stream still
    /// prefilling, then one verify round for every decoding stream. Returns what happened.
    pub fn step(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        self.reap();
        while !self.free_slots.is_empty() && !self.waiting.is_empty() {
            if let (Some(mut s), Some(slot)) = (self.waiting.pop_front(), self.free_slots.pop()) {
                s.slot = slot;
                self.backend.reset_slot(slot);
                self.live.push(s);
            }
        }
        if let Some(i) = self
            .live
            .iter()
            .position(|s| !s.done && s.prefilled < s.req.prompt.len())
        {
            if let Err(e) = self.prefill_chunk(i, &mut events) {
                let s = &mut self.live[i];
                s.done = true;
                events.push(Event::Failed {
                    stream: s.id,
                    error: e.to_string(),
                });
            }
        }
        let decoding: Vec<usize> = (0..self.live.len())
            .filter(|&i| !self.live[i].done && self.live[i].decode_started.is_some())
            .collect();
        if !decoding.is_empty() {
            if let Err(e) = self.round(&decoding, &mut events) {
                for &i in &decoding {
                    let s = &mut self.live[i];
                    s.done = true;
                    events.push(Event::Failed {
                        stream: s.id,
                        error: e.to_string(),
                    });
                }
            }
        }
        self.reap();
        events
    }

    /// Runs until every submitted request has finished, returning all events.
    pub fn run_to_completion(&mut self) -> Vec<Event> {
        let mut all = Vec::new();
        while self.busy() > 0 {
            all.extend(self.step());
        }
        all
    }

    fn reap(&mut self) {
        let mut i = 0;
        while i < self.live.len() {
            if self.live[i].done {
                let s = self.live.swap_remove(i);
                self.free_slots.push(s.slot);
            } else {
                i += 1;
            }
        }
    }

    fn stream_desc(
        &self,
        s: &Stream,
        pos: u32,
        rows: u32,
        src_row: u32,
        committed: u32,
    ) -> StreamDesc {
        StreamDesc {
            slot: s.slot,
            pos,
            rows,
            committed,
            src_row,
            sampling: s.req.sampling,
        }
    }

    fn empty_desc(&self) -> StreamDesc {
        StreamDesc {
            slot: 0,
            pos: 0,
            rows: 0,
            committed: 0,
            src_row: 0,
            sampling: SamplingParams::greedy(),
        }
    }

    /// The stream count of the shared variant for `n` streams: the smallest compiled count >= n.
    fn group_size(&self, n: usize) -> u32 {
        self.verify_streams
            .iter()
            .copied()
            .find(|&c| c as usize >= n)
            .unwrap_or(n as u32)
    }

    fn prefill_chunk(&mut self, i: usize, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let chunk = self.backend.body().options.prefill_chunk;
        let t0 = Instant::now();
        let s = &self.live[i];
        let n = s.req.prompt.len();
        let start = s.prefilled;
        let rows = (n - start).min(chunk as usize);
        let mut tokens = s.req.prompt[start..start + rows].to_vec();
        tokens.resize(chunk as usize, 0);
        let desc = RoundDesc {
            streams: vec![self.stream_desc(s, start as u32, rows as u32, 0, start as u32)],
            tokens,
        };
        self.backend.run(VariantKind::Prefill { chunk }, &desc)?;
        let last = start + rows == n;
        let first = self.backend.io(IoBuf::Sampled)[0].to_bits();
        let use_mtp = self.mtp_on(&self.live[i]);
        if use_mtp {
            // Absorb the chunk: entry j pairs row j's streams with the next token (the first reply token last).
            let s = &self.live[i];
            let mut next: Vec<u32> = s.req.prompt[start + 1..(start + rows).min(n)].to_vec();
            if last {
                next.push(first);
            }
            let w = self.absorb_window(rows as u32);
            next.resize(w as usize, 0);
            let desc = RoundDesc {
                streams: vec![self.stream_desc(s, start as u32, rows as u32, 0, start as u32)],
                tokens: next,
            };
            self.backend.run(
                VariantKind::MtpAbsorb {
                    streams: 1,
                    window: w,
                    form: self.opts.drafter_form,
                },
                &desc,
            )?;
        }
        let s = &mut self.live[i];
        s.prefilled = start + rows;
        s.stats.prefill_s += t0.elapsed().as_secs_f64();
        if last {
            s.pos = n as u32;
            s.pending = first;
            s.index.extend(&s.req.prompt);
            s.decode_started = Some(Instant::now());
            let first_draft = self.backend.io(IoBuf::Sampled)[0].to_bits();
            if self.emit(i, &[first], None, events) {
                return Ok(());
            }
            let s = &mut self.live[i];
            s.index.extend(&[first]);
            self.plan_drafts(
                &[i],
                &[if use_mtp { Some(first_draft) } else { None }],
                &[rows as u32 - 1],
            )?;
        }
        Ok(())
    }

    fn absorb_window(&self, rows: u32) -> u32 {
        let body = self.backend.body();
        let max_w = body.options.max_depth + 1;
        if rows <= max_w {
            rows.max(1)
        } else {
            body.options.prefill_chunk
        }
    }

    fn mtp_on(&self, s: &Stream) -> bool {
        self.has_mtp && self.opts.mtp_drafts && s.req.draft
    }

    /// Emits kept tokens of stream `i` in order, applying the stop conditions; returns true when it finished.
    fn emit(
        &mut self,
        i: usize,
        tokens: &[u32],
        round: Option<Drafter>,
        events: &mut Vec<Event>,
    ) -> bool {
        for (n, &t) in tokens.iter().enumerate() {
            let s = &mut self.live[i];
            s.emitted += 1;
            s.stats.tokens += 1;
            events.push(Event::Token {
                stream: s.id,
                id: t,
            });
            let stop_tok =
                (!s.req.ignore_eos && self.eos.contains(&t)) || s.req.stop_token_ids.contains(&t);
            let ctl = (self.on_token)(s.id, t);
            let reason = if stop_tok || ctl == Control::Stop {
                Some(FinishReason::Stop)
            } else if s.emitted >= s.req.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                s.done = true;
                if let Some(d) = round {
                    s.stats.trim_round(d, tokens.len() as u32, n as u32 + 1);
                }
                if let Some(d) = s.decode_started {
                    s.stats.decode_s = d.elapsed().as_secs_f64();
                }
                let _ = s.started;
                events.push(Event::Finished {
                    stream: s.id,
                    reason,
                    stats: s.stats.clone(),
                });
                return true;
            }
        }
        false
    }

    /// One verify round for the decoding streams `idx` (indices into `live`).
    fn round(&mut self, idx: &[usize], events: &mut Vec<Event>) -> Result<(), EngineError> {
        let window = idx
            .iter()
            .map(|&i| 1 + self.live[i].drafts.len() as u32)
            .max()
            .unwrap_or(1);
        let (kind, nstreams) = if idx.len() == 1 {
            (VariantKind::Lone { window }, 1)
        } else {
            let g = self.group_size(idx.len());
            (VariantKind::Verify { streams: g, window }, g as usize)
        };
        let mut desc = RoundDesc {
            streams: Vec::with_capacity(nstreams),
            tokens: vec![0; nstreams * window as usize],
        };
        for (k, &i) in idx.iter().enumerate() {
            let s = &self.live[i];
            let rows = 1 + s.drafts.len() as u32;
            desc.streams
                .push(self.stream_desc(s, s.pos, rows, 0, s.pos));
            let base = k * window as usize;
            desc.tokens[base] = s.pending;
            desc.tokens[base + 1..base + rows as usize].copy_from_slice(&s.drafts);
        }
        while desc.streams.len() < nstreams {
            desc.streams.push(self.empty_desc());
        }
        self.backend.run(kind, &desc)?;
        let sampled: Vec<u32> = self.backend.io(IoBuf::Sampled)[..nstreams * window as usize]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let keeps: Vec<u32> = self.backend.io(IoBuf::Keep)[..nstreams]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let mut survivors = Vec::new();
        let mut keep_of = Vec::new();
        for (k, &i) in idx.iter().enumerate() {
            let keep = keeps[k] as usize;
            let base = k * window as usize;
            let kept: Vec<u32> = sampled[base..base + keep].to_vec();
            {
                let s = &mut self.live[i];
                s.stats.rounds += 1;
                let accepted = keep as u32 - 1;
                match s.drafter {
                    Drafter::Copy => {
                        s.stats.drafted_copy += s.drafts.len() as u32;
                        s.stats.accepted_copy += accepted;
                        s.stats.copy_rounds += 1;
                        s.stats.copy_round_tokens += keep as u32;
                    }
                    Drafter::Mtp => {
                        if let Some(log) = &mut self.mtp_chains {
                            log.push((s.id, s.pos, s.drafts.clone()));
                        }
                        s.stats.drafted_mtp += s.drafts.len() as u32;
                        s.stats.accepted_mtp += accepted;
                        s.stats.mtp_rounds += 1;
                        s.stats.mtp_round_tokens += keep as u32;
                        if accepted > 0 {
                            s.stats.mtp_first_kept += 1;
                        }
                    }
                    Drafter::None => {}
                }
                s.drafts.clear();
            }
            let drafter = self.live[i].drafter;
            if self.emit(i, &kept, Some(drafter), events) {
                continue;
            }
            let s = &mut self.live[i];
            s.pos += keep as u32;
            s.pending = kept[keep - 1];
            s.index.extend(&kept);
            survivors.push((k, i));
            keep_of.push(keep as u32);
        }
        if survivors.is_empty() {
            return Ok(());
        }
        // MTP absorb of the kept rows (streams that draft with the MTP head), one replay for all.
        let mtp_streams: Vec<(usize, usize, u32)> = survivors
            .iter()
            .zip(&keep_of)
            .filter(|((_, i), _)| self.mtp_on(&self.live[*i]))
            .map(|(&(k, i), &keep)| (k, i, keep))
            .collect();
        let mut first_drafts = vec![None; survivors.len()];
        let mut src_rows = vec![0u32; survivors.len()];
        if !mtp_streams.is_empty() {
            let w = mtp_streams.iter().map(|m| m.2).max().unwrap_or(1);
            let g = if mtp_streams.len() == 1 {
                1
            } else {
                self.group_size(mtp_streams.len())
            };
            let mut d = RoundDesc {
                streams: Vec::new(),
                tokens: vec![0; g as usize * w as usize],
            };
            for (slot_k, &(k, i, keep)) in mtp_streams.iter().enumerate() {
                let s = &self.live[i];
                let old_pos = s.pos - keep;
                d.streams.push(self.stream_desc(
                    s,
                    old_pos,
                    keep,
                    (k * window as usize) as u32,
                    old_pos,
                ));
                let base = slot_k * w as usize;
                d.tokens[base..base + keep as usize].copy_from_slice(
                    &sampled[k * window as usize..k * window as usize + keep as usize],
                );
            }
            while d.streams.len() < g as usize {
                d.streams.push(self.empty_desc());
            }
            self.backend.run(
                VariantKind::MtpAbsorb {
                    streams: g,
                    window: w,
                    form: self.opts.drafter_form,
                },
                &d,
            )?;
            let out = self.backend.io(IoBuf::Sampled);
            for (slot_k, &(_, i, keep)) in mtp_streams.iter().enumerate() {
                if let Some(p) = survivors.iter().position(|&(_, ii)| ii == i) {
                    first_drafts[p] = Some(out[slot_k].to_bits());
                    src_rows[p] = slot_k as u32 * w + keep - 1;
                }
            }
        }
        let live_idx: Vec<usize> = survivors.iter().map(|&(_, i)| i).collect();
        self.plan_drafts(&live_idx, &first_drafts, &src_rows)
    }

    /// Chooses each stream's next chain: a copy if the index has one, else the MTP chain (first draft from the
    /// absorb, then chained steps while confident).
    fn plan_drafts(
        &mut self,
        idx: &[usize],
        first: &[Option<u32>],
        src_rows: &[u32],
    ) -> Result<(), EngineError> {
        let mut chaining: Vec<(usize, u32)> = Vec::new(); // (live index, src row of its last MTP output)
        for (p, &i) in idx.iter().enumerate() {
            let max_depth = self.opts.max_depth as usize;
            let copy_on = self.opts.copy_drafts;
            let s = &mut self.live[i];
            s.drafts.clear();
            s.drafter = Drafter::None;
            if !s.req.draft || max_depth == 0 {
                continue;
            }
            let want = max_depth.min((s.req.max_tokens - s.emitted) as usize);
            if want == 0 {
                continue;
            }
            if copy_on {
                if let Some(chain) = s.index.propose(want) {
                    s.drafts = chain;
                    s.drafter = Drafter::Copy;
                    continue;
                }
            }
            if let Some(d1) = first[p] {
                s.drafts.push(d1);
                s.drafter = Drafter::Mtp;
                if want > 1 {
                    chaining.push((i, src_rows[p]));
                }
            }
        }
        // Chained MTP steps, one replay per step for all chaining streams.
        let mut src_buf_rows: Vec<(usize, u32)> = chaining;
        while !src_buf_rows.is_empty() {
            let g = if src_buf_rows.len() == 1 {
                1
            } else {
                self.group_size(src_buf_rows.len())
            };
            let mut d = RoundDesc {
                streams: Vec::new(),
                tokens: vec![0; g as usize],
            };
            for (k, &(i, src)) in src_buf_rows.iter().enumerate() {
                let s = &self.live[i];
                // The entry pairs the previous output with the last draft, at the position before that draft's.
                let pos = s.pos + s.drafts.len() as u32 - 1;
                d.streams.push(self.stream_desc(s, pos, 1, src, s.pos));
                d.tokens[k] = *s.drafts.last().unwrap_or(&0);
            }
            while d.streams.len() < g as usize {
                d.streams.push(self.empty_desc());
            }
            self.backend.run(
                VariantKind::MtpChain {
                    streams: g,
                    form: self.opts.drafter_form,
                },
                &d,
            )?;
            let toks: Vec<u32> = self.backend.io(IoBuf::Sampled)[..g as usize]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let probs: Vec<f32> = self.backend.io(IoBuf::Probs)[..g as usize].to_vec();
            let mut next = Vec::new();
            for (k, &(i, _)) in src_buf_rows.iter().enumerate() {
                let max_depth = self.opts.max_depth as usize;
                let conf = self.opts.confidence;
                let s = &mut self.live[i];
                if probs[k] < conf {
                    continue;
                }
                s.drafts.push(toks[k]);
                let want = max_depth.min((s.req.max_tokens - s.emitted) as usize);
                if s.drafts.len() < want {
                    next.push((i, k as u32));
                }
            }
            src_buf_rows = next;
        }
        Ok(())
    }
}
