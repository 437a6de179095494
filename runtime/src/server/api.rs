//! Request parsing and validation for the OpenAI endpoints. Bodies are read as JSON values and each field is
//! checked by hand, so that a wrong type or value gets a 400 naming the field (not a generic deserializer error).

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::sampler::{prompt_seed, SamplingParams};
use crate::tokenizer::ChatMessage;

/// The prompt of a request.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Text (completions).
    Text(String),
    /// Token ids (completions).
    Ids(Vec<u32>),
    /// Chat messages (chat completions).
    Chat(Vec<ChatMessage>),
}

/// A parsed generation request (chat or completion).
#[derive(Debug, Clone)]
pub struct GenParams {
    /// The model name given (informational).
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// `max_tokens` / `max_completion_tokens`; `None`: all that `max_model_len` leaves after the prompt.
    pub max_tokens: Option<u32>,
    /// Which of the two fields gave `max_tokens` (for errors).
    pub max_tokens_field: &'static str,
    /// Sampling, with the seed not yet resolved when `seed` is `None`.
    pub sampling: SamplingParams,
    /// The request's seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Extra stop token ids (`stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Ignore eos.
    pub ignore_eos: bool,
    /// Stream the reply as server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Drafting on (default true).
    pub draft: bool,
}

impl GenParams {
    /// The seed to use: the request's, else `prompt_seed(prompt)`.
    pub fn resolved_sampling(&self, prompt: &[u32]) -> flashplan_plan::SamplingParams {
        let mut s = self.sampling;
        s.seed = self.seed.unwrap_or_else(|| prompt_seed(prompt));
        s
    }
}

/// Parses a body as a JSON object.
///
/// # Errors
/// 400 for malformed JSON or a non-object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(None, format!("the request body is not valid JSON: {e}"))
            .code("invalid_json")
    })?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::invalid(
            None,
            format!(
                "the request body must be a JSON object, got {}",
                type_name(&other)
            ),
        )),
    }
}

/// The JSON type name of a value, for messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn present<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

fn wrong(k: &str, want: &str, v: &Value) -> ApiError {
    ApiError::invalid(
        Some(k),
        format!("`{k}` must be {want}, got {}: {v}", type_name(v)),
    )
}

/// A number for a message, as the request wrote it: to 15 significant digits (the most an `f64` keeps of any
/// decimal; serde_json reads `1e-50` as `9.999999999999999e-51`), in plain notation from 1e-4 to 1e15 and in
/// exponent notation outside (`1e-50`, not fifty zeros).
fn shown(x: f64) -> String {
    let r = format!("{x:.14e}").parse::<f64>().unwrap_or(x);
    if r == 0.0 || (1e-4..1e15).contains(&r.abs()) {
        format!("{r}")
    } else {
        format!("{r:e}")
    }
}

/// An optional number field (`default` when absent) for which `ok` holds; `want` says which values those are
/// (`in [0, 1]`). Another value is a 400 showing it as the request wrote it (`1e-50`), not as the `f32` the sampler
/// takes (`0`).
fn num_in(
    m: &Map<String, Value>,
    k: &str,
    default: f64,
    want: &str,
    ok: impl Fn(f64) -> bool,
) -> Result<f64, ApiError> {
    let Some(v) = present(m, k) else {
        return Ok(default);
    };
    let x = v.as_f64().ok_or_else(|| wrong(k, "a number", v))?;
    if ok(x) {
        Ok(x)
    } else {
        Err(ApiError::invalid(
            Some(k),
            format!("`{k}` must be {want}, got {}", shown(x)),
        ))
    }
}

/// A JSON number as an integer checked against `range`: `Ok` with an integer in it (any `i64` or `u64` is read
/// exactly, so that no value wraps), `Err` with the value as a message shows it for a whole number outside it, `None`
/// for any other value (not a number, or one with a fraction).
///
/// A whole number past 64 bits (`99999999999999999999999`) is an `f64` to serde_json, as is one written with an
/// exponent or a fraction part (`1e30`, `5.0`): outside `range` it is shown as [`shown`] writes it (`1e23`), so
/// that it gets the range's message as `-1` does; inside `range` it is left to the caller as not an integer.
fn whole(v: &Value, range: &std::ops::RangeInclusive<i128>) -> Option<Result<i128, String>> {
    if let Some(n) = v
        .as_i64()
        .map(i128::from)
        .or_else(|| v.as_u64().map(i128::from))
    {
        return Some(if range.contains(&n) {
            Ok(n)
        } else {
            Err(n.to_string())
        });
    }
    // A whole f64 converts exactly (one past i128 saturates, outside every range here). Past 2^53 an f64 holds only
    // some whole numbers, and `-9223372036854775809` reads as i64::MIN: one on a bound of `range` there may have
    // been written past it, so only one strictly inside counts as in it.
    let x = v.as_f64().filter(|x| x.fract() == 0.0)?;
    let n = x as i128;
    let inside = if x.abs() < 2f64.powi(53) {
        range.contains(&n)
    } else {
        *range.start() < n && n < *range.end()
    };
    (!inside).then(|| Err(shown(x)))
}

/// An optional integer field in `range`; `want` says which values those are (`from 1 to 4294967295`). A whole
/// number outside it, however large, is a 400 saying `want`; any other value a 400 asking for an integer.
fn int_in(
    m: &Map<String, Value>,
    k: &str,
    range: std::ops::RangeInclusive<i128>,
    want: &str,
) -> Result<Option<i128>, ApiError> {
    let Some(v) = present(m, k) else {
        return Ok(None);
    };
    match whole(v, &range) {
        Some(Ok(n)) => Ok(Some(n)),
        Some(Err(got)) => Err(ApiError::invalid(
            Some(k),
            format!("`{k}` must be {want}, got {got}"),
        )),
        None => Err(wrong(k, "an integer", v)),
    }
}

/// The fields a generation request may carry besides its prompt (`prompt` or `messages`); those of [`IGNORED`] are
/// accepted and not used.
const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "ignore_eos",
    "draft",
    "logprobs",
    "echo",
];

/// OpenAI fields about the account, storage or caching, which never change a reply: accepted at any value, not used.
const IGNORED: &[&str] = &[
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "prediction",
];

/// OpenAI fields this server does not implement, accepted only at the value that changes nothing (a client library
/// may send them so); any other value is a 400 naming the field.
fn neutral(k: &str, v: &Value) -> Option<bool> {
    let zero = |v: &Value| v.as_f64() == Some(0.0);
    let empty = |v: &Value| match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    };
    Some(match k {
        "presence_penalty" | "frequency_penalty" | "top_logprobs" => zero(v),
        "repetition_penalty" | "best_of" => v.as_f64() == Some(1.0),
        "logit_bias" | "tools" | "functions" | "suffix" => empty(v),
        // Without tools (any tools are refused above), "auto" chooses none.
        "tool_choice" | "function_call" => matches!(v.as_str(), Some("none" | "auto")),
        "modalities" => *v == serde_json::json!(["text"]),
        "reasoning_effort" | "verbosity" | "web_search_options" | "audio" => false,
        "parallel_tool_calls" => v.is_boolean(),
        "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
        _ => return None,
    })
}

/// Names as a message lists them: `a`, `b`, `c`.
fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Refuses a field this server does not know (a misspelt `max_tokens` would otherwise mean "the rest of the
/// context"), or an unimplemented one at a value that would change the reply.
fn check_fields(m: &Map<String, Value>, chat: bool) -> Result<(), ApiError> {
    let prompt = if chat { "messages" } else { "prompt" };
    for (k, v) in m {
        // `user` is read by no one here, but OpenAI takes only a string.
        if k == "user" && !(v.is_string() || v.is_null()) {
            return Err(wrong(k, "a string", v));
        }
        if k == prompt
            || FIELDS.contains(&k.as_str())
            || IGNORED.contains(&k.as_str())
            || v.is_null()
        {
            continue;
        }
        match neutral(k, v) {
            Some(true) => {}
            Some(false) => {
                return Err(ApiError::invalid(
                    Some(k),
                    format!("`{k}` is not supported by this server (got {v})"),
                )
                .code("unsupported_parameter"))
            }
            None => {
                return Err(ApiError::invalid(
                    Some(k),
                    format!(
                        "unrecognized request argument `{k}` (a {} request takes `{prompt}`, {}; it accepts and \
                         ignores {})",
                        if chat {
                            "chat completion"
                        } else {
                            "completion"
                        },
                        quoted(FIELDS),
                        quoted(IGNORED)
                    ),
                )
                .code("unrecognized_argument"))
            }
        }
    }
    Ok(())
}

/// The most stop strings a request may carry.
pub const MAX_STOPS: usize = 16;
/// The longest stop string a request may carry, bytes.
pub const MAX_STOP_BYTES: usize = 1024;

/// The highest `temperature` accepted (OpenAI's range is [0, 2]; `flashplan run` takes the same).
pub const MAX_TEMPERATURE: f64 = 2.0;

/// Roles a chat message may have: those the chat templates know, and OpenAI's `developer`, which they take as
/// `system`.
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// An optional boolean field.
pub fn boolean(m: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match present(m, k) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| wrong(k, "a boolean", v)),
    }
}

/// Token ids from a JSON array: integers from 0 to `u32::MAX` (a whole number outside them, however large, is
/// refused with that range, as the integer fields are).
///
/// # Errors
/// 400 naming `k`.
pub fn token_ids(k: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    let range = 0..=i128::from(u32::MAX);
    items
        .iter()
        .map(|v| match whole(v, &range) {
            Some(Ok(n)) => Ok(n as u32),
            Some(Err(got)) => Err(ApiError::invalid(
                Some(k),
                format!("`{k}` token ids must be from 0 to {}, got {got}", u32::MAX),
            )),
            None => Err(ApiError::invalid(
                Some(k),
                format!("`{k}` token ids must be non-negative integers, got {v}"),
            )),
        })
        .collect()
}

fn parse_prompt(m: &Map<String, Value>) -> Result<Prompt, ApiError> {
    let v = present(m, "prompt")
        .ok_or_else(|| ApiError::invalid(Some("prompt"), "`prompt` is required"))?;
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(ApiError::invalid(
            Some("prompt"),
            "`prompt` is an empty array",
        )),
        Value::Array(a) if a.iter().all(|x| x.is_number()) => {
            Ok(Prompt::Ids(token_ids("prompt", a)?))
        }
        Value::Array(a) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(ids) => Ok(Prompt::Ids(token_ids("prompt", ids)?)),
            other => Err(wrong("prompt", "a string or an array of token ids", other)),
        },
        Value::Array(_) => Err(ApiError::invalid(
            Some("prompt"),
            "`prompt` must be one string or one array of token ids (batches are not supported: send one request per prompt)",
        )),
        other => Err(wrong("prompt", "a string or an array of token ids", other)),
    }
}

/// The chat messages of a body's `messages` (text content only; roles from `ROLES`).
///
/// # Errors
/// 400 naming the message or field at fault.
pub fn parse_messages(m: &Map<String, Value>) -> Result<Prompt, ApiError> {
    let v = present(m, "messages")
        .ok_or_else(|| ApiError::invalid(Some("messages"), "`messages` is required"))?;
    let arr = v
        .as_array()
        .ok_or_else(|| wrong("messages", "an array of messages", v))?;
    if arr.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "`messages` is empty"));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, msg) in arr.iter().enumerate() {
        let p = format!("messages[{i}]");
        let o = msg
            .as_object()
            .ok_or_else(|| wrong(&p, "an object with `role` and `content`", msg))?;
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(other) => return Err(wrong(&format!("{p}.role"), "a string", other)),
            None => {
                return Err(ApiError::invalid(
                    Some(&format!("{p}.role")),
                    format!("`{p}.role` is missing (one of {})", ROLES.join(", ")),
                ))
            }
        };
        if !ROLES.contains(&role) {
            return Err(ApiError::invalid(
                Some(&format!("{p}.role")),
                format!(
                    "`{p}.role` must be one of {}, got {role:?}",
                    ROLES.join(", ")
                ),
            ));
        }
        check_message_fields(&p, role, o)?;
        let content = match o.get("content") {
            // OpenAI lets an assistant message (one that called tools) go without content; the others need it.
            None | Some(Value::Null) if role != "assistant" => {
                return Err(ApiError::invalid(
                    Some(&format!("{p}.content")),
                    format!(
                        "`{p}.content` is missing (a {role} message needs a string or text parts)"
                    ),
                ))
            }
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for part in parts {
                    match (
                        part.get("type").and_then(|t| t.as_str()),
                        part.get("text").and_then(|t| t.as_str()),
                    ) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                Some(&format!("{p}.content")),
                                format!("`{p}.content` parts must be {{\"type\": \"text\", \"text\": ...}} (only text is supported), got {part}"),
                            ))
                        }
                    }
                }
                s
            }
            Some(other) => return Err(wrong(&format!("{p}.content"), "a string", other)),
        };
        out.push(ChatMessage {
            role: if role == "developer" { "system" } else { role }.to_string(),
            content,
        });
    }
    Ok(Prompt::Chat(out))
}

/// Refuses a message field other than `role` and `content` unless it changes nothing here: a null field (as the
/// `openai` client's `model_dump()` of a reply writes its unset ones), `name` (a string; the chat templates do not
/// read it, so it is accepted and not used), `tool_call_id` on a `tool` message (not read either), and
/// `tool_calls`, `function_call`, `refusal`, `audio` and `annotations` when empty (this server calls no tools).
///
/// # Errors
/// 400 naming `messages[i].field`.
fn check_message_fields(p: &str, role: &str, o: &Map<String, Value>) -> Result<(), ApiError> {
    for (k, v) in o {
        let empty = match v {
            Value::Null => true,
            Value::String(s) => s.is_empty(),
            Value::Array(a) => a.is_empty(),
            Value::Object(m) => m.is_empty(),
            _ => false,
        };
        let ok = v.is_null()
            || match k.as_str() {
                "role" | "content" => true,
                "name" => v.is_string(),
                "tool_call_id" => role == "tool" && v.is_string(),
                "tool_calls" | "function_call" | "refusal" | "audio" | "annotations" => empty,
                _ => false,
            };
        if !ok {
            return Err(ApiError::invalid(
                Some(&format!("{p}.{k}")),
                format!(
                    "`{p}.{k}` is not supported by this server (got {v}): a message has `role` and `content`, \
                     and may have `name` (a string, not used) and `tool_call_id` on a tool message; `tool_calls`, \
                     `function_call`, `refusal`, `audio` and `annotations` only when empty, any other field only \
                     when null"
                ),
            )
            .code("unsupported_parameter"));
        }
    }
    Ok(())
}

/// The request's `model` field: `None` when absent or null.
///
/// # Errors
/// 400 when it is not a string.
pub fn model_field(m: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match present(m, "model") {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(wrong("model", "a string", v)),
    }
}

/// Parses a `/v1/completions` (`chat == false`) or `/v1/chat/completions` body.
///
/// # Errors
/// 400 naming the field that is missing, of the wrong type or out of range.
pub fn parse_gen(m: &Map<String, Value>, chat: bool) -> Result<GenParams, ApiError> {
    check_fields(m, chat)?;
    let model = model_field(m)?;
    let prompt = if chat {
        parse_messages(m)?
    } else {
        parse_prompt(m)?
    };
    let (mut max_tokens, mut max_tokens_field) = (None, "max_tokens");
    for k in ["max_tokens", "max_completion_tokens"] {
        let want = format!("from 1 to {}", u32::MAX);
        if let Some(n) = int_in(m, k, 1..=i128::from(u32::MAX), &want)? {
            if let Some(prev) = max_tokens.filter(|&prev| prev != n as u32) {
                return Err(ApiError::invalid(
                    Some(k),
                    format!(
                        "`max_tokens` {prev} and `max_completion_tokens` {n} disagree: give one of them (OpenAI's \
                         `max_completion_tokens` replaces `max_tokens`)"
                    ),
                ));
            }
            (max_tokens, max_tokens_field) = (Some(n as u32), k);
        }
    }
    int_in(m, "n", 1..=1, "1 (one choice per request)")?;
    // The ranges are checked on the numbers as given: the sampler's `f32` would turn `-1e-50` into an accepted
    // `-0`, `1e-50` into a refused `0` and `1e300` into `inf`.
    let temperature = num_in(
        m,
        "temperature",
        1.0,
        &format!("from 0 to {MAX_TEMPERATURE}"),
        |t| (0.0..=MAX_TEMPERATURE).contains(&t),
    )?;
    // A positive `top_p` below the smallest positive `f32` would reach the sampler as 0.
    let top_p = num_in(
        m,
        "top_p",
        1.0,
        &format!(
            "in (0, 1] and at least {:e} (the smallest 32-bit float above 0)",
            f32::from_bits(1)
        ),
        |p| p > 0.0 && p <= 1.0 && p as f32 > 0.0,
    )?;
    let min_p = num_in(m, "min_p", 0.0, "in [0, 1]", |p| (0.0..=1.0).contains(&p))?;
    let top_k = match int_in(
        m,
        "top_k",
        -1..=i128::from(u32::MAX),
        &format!("a count in [1, {}], or 0 or -1 for off", u32::MAX),
    )? {
        None | Some(-1) => 0,
        Some(k) => k as u32,
    };
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        seed: 0,
    };
    // Passes after the checks above; kept so that a rule added to `validate` holds here too.
    if let Err(e) = sampling.validate() {
        let param = match e {
            crate::sampler::SamplingError::Temperature(_) => "temperature",
            crate::sampler::SamplingError::TopP(_) => "top_p",
            crate::sampler::SamplingError::MinP(_) => "min_p",
        };
        return Err(ApiError::invalid(Some(param), e.to_string()));
    }
    // Any 64-bit seed, as OpenAI takes: a negative one keys the sampler by its two's-complement bits, which is what
    // the cast keeps.
    let seed = int_in(
        m,
        "seed",
        i128::from(i64::MIN)..=i128::from(u64::MAX),
        &format!("a 64-bit integer, from {} to {}", i64::MIN, u64::MAX),
    )?
    .map(|s| s as u64);
    let stop = match present(m, "stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| wrong("stop", "a string or an array of strings", x))
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(wrong("stop", "a string or an array of strings", v)),
    };
    // Every reply token is checked against every stop string on the engine thread all streams share, so their
    // size is bounded (OpenAI takes 4 strings).
    if stop.len() > MAX_STOPS || stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            Some("stop"),
            format!(
                "`stop` takes at most {MAX_STOPS} strings of at most {MAX_STOP_BYTES} bytes each, got {} (the \
                 longest {} bytes)",
                stop.len(),
                stop.iter().map(String::len).max().unwrap_or(0)
            ),
        ));
    }
    let stop_token_ids = match present(m, "stop_token_ids") {
        None => vec![],
        Some(Value::Array(a)) => token_ids("stop_token_ids", a)?,
        Some(v) => return Err(wrong("stop_token_ids", "an array of token ids", v)),
    };
    let include_usage = match present(m, "stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            // `include_obfuscation` only pads OpenAI's chunks (this server sends no padding): any boolean.
            for (k, v) in o {
                let ok = match k.as_str() {
                    "include_usage" => true,
                    "include_obfuscation" => v.is_boolean() || v.is_null(),
                    _ => false,
                };
                if !ok {
                    return Err(ApiError::invalid(
                        Some(&format!("stream_options.{k}")),
                        format!(
                            "`stream_options.{k}` is not supported by this server (got {v}): expected \
                             `include_usage` (a boolean) or `include_obfuscation` (a boolean, not used)"
                        ),
                    )
                    .code("unsupported_parameter"));
                }
            }
            boolean(o, "include_usage")
                .map_err(|mut e| {
                    e.param = Some("stream_options.include_usage".into());
                    e
                })?
                .unwrap_or(false)
        }
        Some(v) => return Err(wrong("stream_options", "an object", v)),
    };
    let stream = boolean(m, "stream")?.unwrap_or(false);
    // OpenAI's rule: the options of a stream come only with one (a null `stream_options` is an absent one).
    if !stream && present(m, "stream_options").is_some() {
        return Err(ApiError::invalid(
            Some("stream_options"),
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    // `logprobs` (a boolean in chat, a count in completions) and `echo` only when off. A count of 0 is not off: the
    // completions API then returns the sampled tokens' log probabilities.
    for k in ["logprobs", "echo"] {
        match present(m, k) {
            None | Some(Value::Bool(false)) => {}
            Some(v @ (Value::Bool(true) | Value::Number(_))) => {
                return Err(ApiError::invalid(
                    Some(k),
                    format!("`{k}` is not supported by this server (got {v})"),
                )
                .code("unsupported_parameter"))
            }
            Some(v) => {
                // OpenAI's completions take a count of log probabilities, chat a boolean.
                let want = if k == "logprobs" && !chat {
                    "an integer (a count)"
                } else {
                    "a boolean"
                };
                return Err(wrong(k, want, v));
            }
        }
    }
    Ok(GenParams {
        model,
        prompt,
        max_tokens,
        max_tokens_field,
        sampling,
        seed,
        stop,
        stop_token_ids,
        ignore_eos: boolean(m, "ignore_eos")?.unwrap_or(false),
        stream,
        include_usage,
        draft: boolean(m, "draft")?.unwrap_or(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str, chat: bool) -> Result<GenParams, ApiError> {
        parse_gen(&parse_object(s.as_bytes())?, chat)
    }

    #[test]
    fn good_and_bad_requests() {
        let g = p(
            r#"{"prompt": [1,2,3], "max_tokens": 4, "temperature": 0, "stop": ["x"], "draft": false}"#,
            false,
        )
        .unwrap();
        assert!(matches!(g.prompt, Prompt::Ids(ref v) if v == &[1, 2, 3]));
        assert!(!g.draft);
        assert_eq!(g.max_tokens, Some(4));
        // Stop strings up to their bounds, and one past each.
        let stops = |n: usize, len: usize| {
            serde_json::json!({"prompt": "a", "stop": vec!["s".repeat(len); n]}).to_string()
        };
        assert!(p(&stops(MAX_STOPS, MAX_STOP_BYTES), false).is_ok());
        for body in [stops(MAX_STOPS + 1, 1), stops(1, MAX_STOP_BYTES + 1)] {
            let e = p(&body, false).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("stop"), "{}", e.message);
            assert!(
                e.message
                    .contains("at most 16 strings of at most 1024 bytes"),
                "{}",
                e.message
            );
        }
        for (body, param) in [
            (r#"{"prompt": "a", "temperature": -1}"#, Some("temperature")),
            (r#"{"prompt": "a", "stop": 3}"#, Some("stop")),
            (r#"{"prompt": "a", "top_p": 0}"#, Some("top_p")),
            (r#"{"prompt": "a", "max_tokens": "x"}"#, Some("max_tokens")),
            (r#"{"prompt": [1, -2]}"#, Some("prompt")),
            (r#"{"prompt": "a""#, None),
            (r#"{"temperature": 0}"#, Some("prompt")),
            (
                r#"{"prompt": "a", "temperature": 2.5}"#,
                Some("temperature"),
            ),
            (
                r#"{"prompt": "a", "max_tokens": 18446744073709551615}"#,
                Some("max_tokens"),
            ),
            (r#"{"prompt": "a", "seed": 1.5}"#, Some("seed")),
            (r#"{"prompt": "a", "echo": "yes"}"#, Some("echo")),
            (r#"{"prompt": "a", "logprobs": 2}"#, Some("logprobs")),
            (r#"{"prompt": "a", "logprobs": 0}"#, Some("logprobs")),
            (r#"{"prompt": "a", "user": 5}"#, Some("user")),
            (
                r#"{"prompt": "a", "reasoning_effort": "low"}"#,
                Some("reasoning_effort"),
            ),
            (r#"{"prompt": "a", "maxtokens": 3}"#, Some("maxtokens")),
            (r#"{"prompt": "a", "messages": []}"#, Some("messages")),
            (
                r#"{"prompt": "a", "frequency_penalty": 0.5}"#,
                Some("frequency_penalty"),
            ),
            (
                r#"{"prompt": "a", "response_format": {"type": "json_object"}}"#,
                Some("response_format"),
            ),
            (
                r#"{"prompt": "a", "top_logprobs": 2}"#,
                Some("top_logprobs"),
            ),
        ] {
            let e = p(body, false).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), param, "{body}: {}", e.message);
        }
        // A wrong type names what each API takes there: a count in completions, a boolean in chat.
        for (chat, body, want) in [
            (
                false,
                r#"{"prompt": "a", "logprobs": "x"}"#,
                "an integer (a count)",
            ),
            (
                true,
                r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": "x"}"#,
                "a boolean",
            ),
        ] {
            let e = p(body, chat).unwrap_err();
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
        // A count of 0 asks for the sampled tokens' log probabilities: unsupported, not a wrong value.
        let e = p(r#"{"prompt": "a", "logprobs": 0}"#, false).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (
                Some("unsupported_parameter"),
                "`logprobs` is not supported by this server (got 0)"
            )
        );
        assert!(p(r#"{"messages": "hi"}"#, true).is_err());
        assert!(p(r#"{"messages": [{"role": "user", "content": "hi"}]}"#, true).is_ok());
        assert!(p(r#"{"messages": [{"role": "bot", "content": "hi"}]}"#, true).is_err());
        // Every message error names the field at fault, as its message does.
        for (body, param, says) in [
            (
                r#"{"messages": [{"content": "hi"}]}"#,
                "messages[0].role",
                "is missing",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "a"}, {"role": 3, "content": "hi"}]}"#,
                "messages[1].role",
                "must be a string, got a number: 3",
            ),
            (
                r#"{"messages": [{"role": "bot", "content": "hi"}]}"#,
                "messages[0].role",
                "got \"bot\"",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
                "messages[0].content",
                "only text is supported",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "messages[0].content",
                "must be a string",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "hi", "foo": 1}]}"#,
                "messages[0].foo",
                "is not supported",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "hi", "name": 7}]}"#,
                "messages[0].name",
                "a string, not used",
            ),
            (
                r#"{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]}"#,
                "messages[0].tool_calls",
                "only when empty",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}"#,
                "messages[0].tool_call_id",
                "on a tool message",
            ),
            (
                r#"{"messages": [{"role": "user"}]}"#,
                "messages[0].content",
                "is missing",
            ),
            (
                r#"{"messages": [{"role": "system", "content": null}]}"#,
                "messages[0].content",
                "is missing",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"foo": true}}"#,
                "stream_options.foo",
                "is not supported",
            ),
        ] {
            let e = p(body, true).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
        // What changes nothing is taken: a name, an assistant turn without content and with the null fields of the
        // openai client's `model_dump()`, empty tool fields, a tool message's call id, OpenAI's obfuscation switch.
        assert!(p(
            r#"{"messages": [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": null, "tool_calls": [], "annotations": null,
                 "refusal": null, "audio": null, "function_call": null, "future_field": null},
                {"role": "tool", "content": "4", "tool_call_id": "c1"}],
                "stream": true, "stream_options": {"include_usage": true, "include_obfuscation": false}}"#,
            true
        )
        .is_ok());
        // OpenAI's developer role is the templates' system role.
        let g = p(
            r#"{"messages": [{"role": "developer", "content": "be brief"}]}"#,
            true,
        )
        .unwrap();
        assert!(matches!(g.prompt, Prompt::Chat(ref m) if m[0].role == "system"));
        // A negative seed keys by its two's-complement bits; storage and caching fields are accepted and unused.
        let g = p(
            r#"{"prompt": "a", "seed": -1, "store": true, "metadata": {"k": "v"}, "tool_choice": "auto",
                "modalities": ["text"], "logprobs": false, "echo": false, "max_completion_tokens": 3}"#,
            false,
        )
        .unwrap();
        assert_eq!(g.seed, Some(u64::MAX));
        assert_eq!(
            (g.max_tokens, g.max_tokens_field),
            (Some(3), "max_completion_tokens")
        );
        // Both limits may be given when they agree; two different limits are refused, naming the second.
        let g = p(
            r#"{"prompt": "a", "max_tokens": 3, "max_completion_tokens": 3}"#,
            false,
        )
        .unwrap();
        assert_eq!(g.max_tokens, Some(3));
        let e = p(
            r#"{"prompt": "a", "max_tokens": 8, "max_completion_tokens": 4}"#,
            false,
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("max_completion_tokens"),
            "{}",
            e.message
        );
        assert!(e.message.contains("disagree"), "{}", e.message);
        // The neutral values of unimplemented fields pass; the largest seed does not wrap.
        let g = p(
            r#"{"prompt": "a", "presence_penalty": 0, "logit_bias": {}, "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "best_of": 1, "seed": 18446744073709551615, "user": "x"}"#,
            false,
        )
        .unwrap();
        assert_eq!(g.seed, Some(u64::MAX));
    }

    #[test]
    fn stream_options_only_with_a_stream() {
        // Before: accepted (and unused) without `stream`, where OpenAI answers 400.
        for body in [
            r#"{"prompt": "a", "stream": false, "stream_options": {"include_usage": true}}"#,
            r#"{"prompt": "a", "stream_options": {"include_usage": false}}"#,
            r#"{"prompt": "a", "stream": null, "stream_options": {}}"#,
        ] {
            let e = match p(body, false) {
                Ok(_) => panic!("{body} was accepted"),
                Err(e) => e,
            };
            assert_eq!(
                (
                    e.status.as_u16(),
                    e.kind,
                    e.param.as_deref(),
                    e.message.as_str()
                ),
                (
                    400,
                    "invalid_request_error",
                    Some("stream_options"),
                    "`stream_options` is only allowed when `stream` is true"
                ),
                "{body}"
            );
        }
        // With a stream, or a null `stream_options` (an absent one) without, it is taken.
        let g = p(
            r#"{"prompt": "a", "stream": true, "stream_options": {"include_usage": true}}"#,
            false,
        )
        .unwrap();
        assert!(g.stream && g.include_usage);
        let g = p(r#"{"prompt": "a", "stream_options": null}"#, false).unwrap();
        assert!(!g.stream && !g.include_usage);
    }

    #[test]
    fn whole_numbers_past_64_bits_get_their_fields_range() {
        // Before: "`max_tokens` must be an integer, got a number: 1e+23" (serde_json reads an integer past 64 bits
        // as an f64); now the message of any other value outside the range, as -1 gets.
        let seed = "a 64-bit integer, from -9223372036854775808 to 18446744073709551615";
        let top_k = "a count in [1, 4294967295], or 0 or -1 for off";
        for (field, value, want, got) in [
            ("max_tokens", "-1", "from 1 to 4294967295", "-1"),
            (
                "max_tokens",
                "99999999999999999999999",
                "from 1 to 4294967295",
                "1e23",
            ),
            (
                "max_completion_tokens",
                "-99999999999999999999999",
                "from 1 to 4294967295",
                "-1e23",
            ),
            ("max_tokens", "1e30", "from 1 to 4294967295", "1e30"),
            (
                "max_tokens",
                "4294967296.0",
                "from 1 to 4294967295",
                "4294967296",
            ),
            ("seed", "18446744073709551616", seed, "1.84467440737096e19"),
            ("seed", "-9223372036854775809", seed, "-9.22337203685478e18"),
            ("seed", "1e300", seed, "1e300"),
            ("top_k", "99999999999999999999999", top_k, "1e23"),
            (
                "n",
                "99999999999999999999999",
                "1 (one choice per request)",
                "1e23",
            ),
            ("n", "2", "1 (one choice per request)", "2"),
        ] {
            let body = format!(r#"{{"prompt": "a", "{field}": {value}}}"#);
            let e = match p(&body, false) {
                Ok(_) => panic!("{body} was accepted"),
                Err(e) => e,
            };
            assert_eq!(
                (e.param.as_deref(), e.message.as_str()),
                (
                    Some(field),
                    format!("`{field}` must be {want}, got {got}").as_str()
                ),
                "{body}"
            );
        }
        // Token ids likewise, in the prompt and stop_token_ids.
        for (body, param, got) in [
            (
                r#"{"prompt": [1, 99999999999999999999999]}"#,
                "prompt",
                "1e23",
            ),
            (r#"{"prompt": [4294967296]}"#, "prompt", "4294967296"),
            (r#"{"prompt": [-1]}"#, "prompt", "-1"),
            (
                r#"{"prompt": "a", "stop_token_ids": [18446744073709551616]}"#,
                "stop_token_ids",
                "1.84467440737096e19",
            ),
        ] {
            let e = match p(body, false) {
                Ok(_) => panic!("{body} was accepted"),
                Err(e) => e,
            };
            assert_eq!(
                (e.param.as_deref(), e.message.as_str()),
                (
                    Some(param),
                    format!("`{param}` token ids must be from 0 to 4294967295, got {got}").as_str()
                ),
                "{body}"
            );
        }
        // A number with a fraction, or a whole one written as a float inside the range, is still not an integer.
        for (field, value) in [
            ("max_tokens", "2.5"),
            ("max_tokens", "5.0"),
            ("seed", "1e3"),
        ] {
            let body = format!(r#"{{"prompt": "a", "{field}": {value}}}"#);
            let e = match p(&body, false) {
                Ok(_) => panic!("{body} was accepted"),
                Err(e) => e,
            };
            assert!(
                e.message
                    .starts_with(&format!("`{field}` must be an integer, got a number")),
                "{body}: {}",
                e.message
            );
        }
        let e = match p(r#"{"prompt": [1, 2.5]}"#, false) {
            Ok(_) => panic!("a fractional token id was accepted"),
            Err(e) => e,
        };
        assert_eq!(
            e.message,
            "`prompt` token ids must be non-negative integers, got 2.5"
        );
        // The bounds themselves are taken.
        let g = p(
            r#"{"prompt": [4294967295], "max_tokens": 4294967295, "seed": -9223372036854775808, "top_k": 4294967295}"#,
            false,
        )
        .unwrap();
        assert_eq!(
            (g.max_tokens, g.seed, g.sampling.top_k),
            (Some(u32::MAX), Some(i64::MIN as u64), u32::MAX)
        );
    }

    #[test]
    fn sampling_values_out_of_range_are_shown_as_given() {
        // Before: `1e-50` rounded to an f32 `0` ("got 0"), `-1e-50` to an accepted `-0`, `1e300` to `inf`.
        for (field, value, range) in [
            ("top_p", "1e-50", "in (0, 1] and at least 1e-45"),
            ("top_p", "-1e-50", "in (0, 1]"),
            ("top_p", "-1e-9", "in (0, 1]"),
            ("top_p", "0", "in (0, 1]"),
            ("top_p", "1.0000000001", "in (0, 1]"),
            ("top_p", "1e300", "in (0, 1]"),
            ("temperature", "-1e-50", "from 0 to 2"),
            ("temperature", "-1e300", "from 0 to 2"),
            ("temperature", "1e300", "from 0 to 2"),
            ("temperature", "2.5", "from 0 to 2"),
            ("min_p", "-1e-50", "in [0, 1]"),
            ("min_p", "1.5", "in [0, 1]"),
            // Before: "`top_k` must be >= 0" for a value that is >= 0 but past the sampler's u32.
            (
                "top_k",
                "4294967296",
                "a count in [1, 4294967295], or 0 or -1 for off",
            ),
            (
                "top_k",
                "-2",
                "a count in [1, 4294967295], or 0 or -1 for off",
            ),
        ] {
            let body = format!(r#"{{"prompt": "a", "{field}": {value}}}"#);
            let e = p(&body, false).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
            assert!(
                e.message.starts_with(&format!("`{field}` must be {range}"))
                    && e.message.ends_with(&format!(", got {value}")),
                "{body}: {}",
                e.message
            );
        }
        // Tiny values the sampler's f32 holds are taken as given.
        let g = p(r#"{"prompt": "a", "top_p": 1e-9, "min_p": 1e-9}"#, false).unwrap();
        assert_eq!((g.sampling.top_p, g.sampling.min_p), (1e-9, 1e-9));
        let g = p(
            r#"{"prompt": "a", "top_p": 1e-45, "temperature": 2}"#,
            false,
        )
        .unwrap();
        assert!(g.sampling.top_p > 0.0 && g.sampling.temperature == 2.0);
    }
}
