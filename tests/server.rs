//! The OpenAI server in-process on an ephemeral port with the bundled tiny model: streamed and non-streamed
//! replies agree (text and token_sha), `"draft": false` gives the same token_sha, bad requests get a 400 naming
//! the problem, and the server keeps serving while a long request is in flight.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use flashplan_runtime::engine::{Engine, EngineOptions};
use flashplan_runtime::server::{client, serve, AppState, DEFAULT_HEAD_DEADLINE};
use flashplan_runtime::service::Service;
use flashplan_runtime::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// The shared server's body deadline (`AppState::body_deadline`; `flashplan serve` takes 60 s): long enough for the
/// 64 MB body of the 413 test on a slow machine.
const BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// The bundled tiny model's engine service on the CPU backend.
fn tiny_service() -> Service {
    let dir = root().join("models/flashnext-tiny");
    let body = plan_for(&dir, &[1, 2, 4], 8, 32, 512);
    let be = backend(&dir, body);
    let opts = EngineOptions {
        max_depth: 8,
        parallel: 4,
        ..Default::default()
    };
    let engine = Engine::new(be, opts, true);
    let tok = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    Service::start(engine, tok)
}

/// One server for every test of this file (address `127.0.0.1:PORT`).
fn server() -> &'static str {
    static SERVER: OnceLock<(tokio::runtime::Runtime, String)> = OnceLock::new();
    &SERVER
        .get_or_init(|| {
            serve_on_a_free_port(AppState {
                service: tiny_service(),
                model_name: "flashnext-tiny".into(),
                body_deadline: BODY_DEADLINE,
                head_deadline: DEFAULT_HEAD_DEADLINE,
            })
        })
        .1
}

/// A server of `state` on a free local port, run by its own runtime (returned: the server stops when it drops), and
/// its address.
fn serve_on_a_free_port(state: AppState) -> (tokio::runtime::Runtime, String) {
    let (rt, addr, _) = serve_on_a_free_port_until(state, std::future::pending());
    (rt, addr)
}

/// [`serve_on_a_free_port`] until `shutdown` resolves: also the server's task, which ends when `serve` returns.
fn serve_on_a_free_port_until(
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> (
    tokio::runtime::Runtime,
    String,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let l = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let server = rt.spawn(serve(l, state, shutdown));
    (rt, addr, server)
}

fn post(path: &str, body: &str) -> client::Response {
    client::request(server(), "POST", path, Some(body)).expect("request")
}

/// The streamed text, the final flashplan block and usage of a streamed request. Checks the chunks' shape: the
/// `flashplan` block comes once, in the usage chunk (`choices` empty) with `stream_options.include_usage`, where
/// every other chunk has `"usage": null` (OpenAI's rule), else in the chunk with the finish reason, no chunk then
/// having a `usage` key.
fn post_stream(path: &str, body: &Value) -> (String, Value, Value) {
    let include_usage = body["stream_options"]["include_usage"] == json!(true);
    let mut text = String::new();
    let mut fp = Value::Null;
    let mut usage = Value::Null;
    let mut done = false;
    let mut blocks = 0;
    // Whether the event before [DONE] was the usage chunk, and how many chunks had usage.
    let mut usage_last = false;
    let mut usages = 0;
    let r = client::stream_sse(server(), path, &body.to_string(), |d| {
        if d == "[DONE]" {
            done = true;
            assert_eq!(
                usage_last, include_usage,
                "the usage chunk is the last before [DONE]"
            );
            return;
        }
        assert!(!done, "an event after [DONE]: {d}");
        let v: Value = serde_json::from_str(d).expect("chunk is JSON");
        usage_last = !v["usage"].is_null();
        if include_usage {
            assert_eq!(
                !v["usage"].is_null(),
                v["choices"] == json!([]),
                "usage exactly in the chunk without choices: {v}"
            );
        }
        let c = &v["choices"][0];
        if let Some(t) = c["text"].as_str().or(c["delta"]["content"].as_str()) {
            text.push_str(t);
        }
        // Every chunk has the same shape: with include_usage each has `usage` (null but in the usage chunk),
        // without it none has the key (the chunk with the finish reason had `"usage": null`).
        assert_eq!(
            v.get("usage").is_some(),
            include_usage,
            "`usage` in a chunk with include_usage {include_usage}: {v}"
        );
        if !v["flashplan"].is_null() {
            blocks += 1;
            fp = v["flashplan"].clone();
            if include_usage {
                assert_eq!(
                    v["choices"],
                    json!([]),
                    "the flashplan block outside the usage chunk: {v}"
                );
            } else {
                assert!(
                    !c["finish_reason"].is_null(),
                    "the flashplan block before the end: {v}"
                );
            }
        }
        if !v["usage"].is_null() {
            assert!(include_usage, "usage without include_usage: {v}");
            usages += 1;
            usage = v["usage"].clone();
        }
    })
    .expect("stream");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(done, "no [DONE]");
    assert_eq!(blocks, 1, "flashplan blocks in the stream");
    assert_eq!(
        usages,
        usize::from(include_usage),
        "usage chunks in the stream"
    );
    (text, fp, usage)
}

const PROMPT: &str = "def load_file(path, mode=\"rb\"):\n    with open(path, mode) as handle:\n";

#[test]
fn completion_streamed_equals_whole_and_draft_false() {
    let body = json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0});
    let r = post("/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let text = v["choices"][0]["text"].as_str().expect("text").to_string();
    let sha = v["flashplan"]["token_sha"]
        .as_str()
        .expect("token_sha")
        .to_string();
    assert_eq!(sha.len(), 64);
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert!(v["flashplan"]["rounds"].as_u64().is_some());

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let (stext, fp, _) = post_stream("/v1/completions", &sb);
    assert_eq!(stext, text);
    assert_eq!(fp["token_sha"].as_str(), Some(sha.as_str()));
    sb["stream_options"] = json!({"include_usage": true});
    let (stext, fp, usage) = post_stream("/v1/completions", &sb);
    assert_eq!(stext, text);
    assert_eq!(fp["token_sha"].as_str(), Some(sha.as_str()));
    assert_eq!(usage["completion_tokens"], v["usage"]["completion_tokens"]);

    let mut pb = body.clone();
    pb["draft"] = json!(false);
    let p = post("/v1/completions", &pb.to_string()).json();
    assert_eq!(p["flashplan"]["token_sha"].as_str(), Some(sha.as_str()));
    assert_eq!(p["flashplan"]["drafted"], 0);

    // Token-id prompts give the same reply as the text they encode.
    let ids = post("/tokenize", &json!({"prompt": PROMPT}).to_string()).json()["tokens"].clone();
    let t = post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 24, "temperature": 0}).to_string(),
    )
    .json();
    assert_eq!(t["flashplan"]["token_sha"].as_str(), Some(sha.as_str()));
}

#[test]
fn chat_streamed_equals_whole_and_seeded_sampling() {
    let body = json!({"messages": [{"role": "user", "content": "write a function"}], "max_tokens": 16,
                      "temperature": 0.8, "seed": 7});
    let v = post("/v1/chat/completions", &body.to_string()).json();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let (stext, fp, _) = post_stream("/v1/chat/completions", &sb);
    assert_eq!(stext, text);
    assert_eq!(fp["token_sha"], v["flashplan"]["token_sha"]);
    sb["stream_options"] = json!({"include_usage": true});
    let (stext, fp, usage) = post_stream("/v1/chat/completions", &sb);
    assert_eq!(stext, text);
    assert_eq!(fp["token_sha"], v["flashplan"]["token_sha"]);
    assert_eq!(usage, v["usage"]);
    let mut pb = body.clone();
    pb["draft"] = json!(false);
    let p = post("/v1/chat/completions", &pb.to_string()).json();
    assert_eq!(p["flashplan"]["token_sha"], v["flashplan"]["token_sha"]);
}

#[test]
fn stop_string_ends_the_text_before_it() {
    let body = json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0});
    let full = post("/v1/completions", &body.to_string()).json();
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string from the middle of the reply.
    let cut = text
        .char_indices()
        .nth(text.chars().count() / 2)
        .map(|(i, _)| i)
        .unwrap_or(0);
    let stop: String = text[cut..].chars().take(3).collect();
    if stop.trim().is_empty() {
        return;
    }
    let first = text.find(&stop).unwrap();
    let mut b = body.clone();
    b["stop"] = json!([stop]);
    let v = post("/v1/completions", &b.to_string()).json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(&text[..first]));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(
        v["usage"]["completion_tokens"].as_u64() <= full["usage"]["completion_tokens"].as_u64()
    );
}

#[test]
fn a_stop_token_id_ends_the_reply_without_its_text() {
    // As a stop string: the token counts (ids, so usage and token_sha) and its text is left out.
    use flashplan_runtime::service::{GenRequest, StreamEvent};
    let service = tiny_service();
    let tok = service.tokenizer.clone();
    let run = |stop_token_ids: Vec<u32>| -> (String, Vec<u32>) {
        let request = flashplan_runtime::engine::Request {
            prompt: tok.encode(PROMPT, true).expect("encodes"),
            max_tokens: 24,
            sampling: flashplan_plan::SamplingParams::greedy(),
            stop_token_ids,
            ignore_eos: true,
            draft: true,
        };
        let mut rx = service
            .submit_blocking(GenRequest {
                request,
                stop: vec![],
            })
            .expect("submit");
        let (mut text, mut ids) = (String::new(), vec![]);
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                StreamEvent::Text { text: t, .. } => text.push_str(&t),
                StreamEvent::Done(c) => ids = c.token_ids,
                StreamEvent::Error(e) => panic!("{e}"),
            }
        }
        (text, ids)
    };
    let (_, full) = run(vec![]);
    // A token from the reply's second half that does not occur before it, with text of its own.
    let k = (full.len() / 2..full.len())
        .find(|&k| {
            !full[..k].contains(&full[k]) && !tok.decode(&full[k..=k], true).unwrap().is_empty()
        })
        .expect("a fresh token in the reply's second half");
    let (text, ids) = run(vec![full[k]]);
    assert_eq!(ids, full[..=k].to_vec());
    assert_eq!(text, tok.decode(&full[..k], true).unwrap());
}

#[test]
fn bad_requests_get_400_naming_the_problem() {
    let long: Vec<u32> = vec![5; 600];
    for (body, param, words) in [
        (
            "{\"prompt\": \"a\", ".to_string(),
            Value::Null,
            "not valid JSON",
        ),
        (
            json!({"prompt": "a", "temperature": -1}).to_string(),
            json!("temperature"),
            "temperature",
        ),
        (
            json!({"prompt": "a", "stop": {"x": 1}}).to_string(),
            json!("stop"),
            "stop",
        ),
        (
            json!({"prompt": "a", "max_tokens": "ten"}).to_string(),
            json!("max_tokens"),
            "max_tokens",
        ),
        (
            json!({"prompt": long}).to_string(),
            json!("prompt"),
            "too long",
        ),
        (
            json!({"prompt": [1, 2, 999999]}).to_string(),
            json!("prompt"),
            "outside the vocabulary",
        ),
        (
            json!({"prompt": [1, 2, 3], "max_tokens": 100000}).to_string(),
            json!("max_tokens"),
            "at most 500 reply tokens",
        ),
        (
            json!({"prompt": "a", "max_tokens": u64::MAX}).to_string(),
            json!("max_tokens"),
            "from 1 to",
        ),
        (
            json!({"prompt": "a", "max_token": 5}).to_string(),
            json!("max_token"),
            "unrecognized request argument",
        ),
        (
            json!({"prompt": "a", "logit_bias": {"11": -100}}).to_string(),
            json!("logit_bias"),
            "not supported",
        ),
        (
            json!({"prompt": "a", "temperature": 5}).to_string(),
            json!("temperature"),
            "from 0 to 2",
        ),
        (
            // Shown as given, not as the f32 it rounds to ("got 0").
            "{\"prompt\": \"a\", \"top_p\": 1e-50}".to_string(),
            json!("top_p"),
            "got 1e-50",
        ),
        (
            // Past 64 bits: the range, as for -1 (it said "must be an integer, got a number: 1.8446744073709552e19").
            "{\"prompt\": \"a\", \"seed\": 18446744073709551616}".to_string(),
            json!("seed"),
            "`seed` must be a 64-bit integer, from -9223372036854775808 to 18446744073709551615, got \
             1.84467440737096e19",
        ),
        (
            "{\"prompt\": \"a\", \"max_tokens\": 99999999999999999999999}".to_string(),
            json!("max_tokens"),
            "`max_tokens` must be from 1 to 4294967295, got 1e23",
        ),
        (
            json!({"prompt": "a", "stream": false, "stream_options": {"include_usage": true}})
                .to_string(),
            json!("stream_options"),
            "`stream_options` is only allowed when `stream` is true",
        ),
        (
            json!({"prompt": "a", "stop_token_ids": [99_999_999]}).to_string(),
            json!("stop_token_ids"),
            "outside the vocabulary",
        ),
    ] {
        let r = post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["type"], "invalid_request_error", "{body}");
        assert_eq!(e["param"], param, "{body}: {}", r.body);
        let msg = e["message"].as_str().unwrap_or("");
        assert!(
            msg.contains(words),
            "{body}: message {msg:?} does not say {words:?}"
        );
    }
    let r = post(
        "/v1/chat/completions",
        &json!({"messages": "hello"}).to_string(),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "messages");
    let r = post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string(),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "messages[0].role");
    // An unknown model is a 404 (OpenAI's answer), naming the model this server serves.
    let r = post(
        "/v1/completions",
        &json!({"prompt": "a", "model": "gpt-4"}).to_string(),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"]
        .as_str()
        .unwrap_or("")
        .contains("flashnext-tiny"));
    // Unimplemented fields at the value that changes nothing are accepted (client libraries send them).
    let r = post(
        "/v1/completions",
        &json!({"prompt": "a", "model": "flashnext-tiny", "max_tokens": 1, "presence_penalty": 0,
                "frequency_penalty": 0.0, "logit_bias": {}, "user": "u", "n": 1})
        .to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn max_model_len_is_the_most_a_request_may_use() {
    // The test server's context of 512 keeps 9 positions for one verify window (max depth 8 + 1): a request may use
    // 503 tokens, prompt and max_tokens together. Before, /v1/models answered 512.
    let m = client::request(server(), "GET", "/v1/models", None).unwrap();
    assert_eq!(m.json()["data"][0]["max_model_len"], 503, "{}", m.body);
    let one = client::request(server(), "GET", "/v1/models/flashnext-tiny", None).unwrap();
    assert_eq!(one.json()["max_model_len"], 503, "{}", one.body);
    let t = post("/tokenize", &json!({"prompt": "x"}).to_string());
    assert_eq!(t.json()["max_model_len"], 503, "{}", t.body);
    let ids = |n: usize| vec![5u32; n];
    // Exactly at the limit.
    let r = post(
        "/v1/completions",
        &json!({"prompt": ids(502), "max_tokens": 1, "temperature": 0}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["total_tokens"], 503, "{}", r.body);
    // One past it, by max_tokens or by the prompt: refused, saying the limit.
    let why = "max_model_len: the context of 512 less 9 kept for one verify window";
    for (body, param, message) in [
        (
            json!({"prompt": ids(502), "max_tokens": 2}),
            "max_tokens",
            format!(
                "`max_tokens` 2 does not fit: a request may use at most 503 tokens, the prompt and `max_tokens` \
                 together ({why}): after the prompt's 502 at most 1 reply token"
            ),
        ),
        (
            json!({"prompt": ids(503)}),
            "prompt",
            format!(
                "the prompt is too long: 503 tokens, and a request may use at most 503, the prompt and at least one \
                 reply token ({why})"
            ),
        ),
    ] {
        let r = post("/v1/completions", &body.to_string());
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(
            r.json()["error"],
            json!({"message": message, "type": "invalid_request_error", "param": param,
                   "code": "context_length_exceeded"}),
        );
    }
}

#[test]
fn keeps_serving_while_a_long_request_runs() {
    let addr = server().to_string();
    let long = std::thread::spawn(move || {
        let body = json!({"prompt": "import os\n", "max_tokens": 300, "temperature": 0, "ignore_eos": true});
        client::request(&addr, "POST", "/v1/completions", Some(&body.to_string()))
            .expect("long request")
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let t0 = std::time::Instant::now();
    let r = post(
        "/v1/completions",
        &json!({"prompt": "x = 1\n", "max_tokens": 4, "temperature": 0}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let bad = post(
        "/v1/completions",
        &json!({"prompt": "a", "top_p": 2}).to_string(),
    );
    assert_eq!(bad.status, 400);
    let short_s = t0.elapsed();
    assert!(
        !long.is_finished(),
        "the long request finished before the short one: the test proves nothing"
    );
    let l = long.join().expect("long thread");
    assert_eq!(l.status, 200, "{}", l.body);
    assert_eq!(l.json()["usage"]["completion_tokens"], 300);
    eprintln!("short request served in {short_s:?} beside the long one");
}

#[test]
fn models_health_metrics_tokenize() {
    let m = client::request(server(), "GET", "/v1/models", None).unwrap();
    assert_eq!(m.json()["data"][0]["id"], "flashnext-tiny");
    let h = client::request(server(), "GET", "/health", None).unwrap();
    assert_eq!(h.status, 200);
    let t = post("/tokenize", &json!({"prompt": "def f(x):"}).to_string()).json();
    let d = post("/detokenize", &json!({"tokens": t["tokens"]}).to_string()).json();
    assert_eq!(d["prompt"], "def f(x):");
    post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}).to_string(),
    );
    let mt = client::request(server(), "GET", "/metrics", None).unwrap();
    assert!(mt.body.contains("flashplan_requests_total"), "{}", mt.body);
    assert!(mt
        .body
        .contains("flashplan_accepted_tokens_total{drafter=\"copy\"}"));
    assert!(mt
        .body
        .contains("flashplan_time_to_first_token_seconds_bucket"));
    // Chat messages to tokens, with the tokenize endpoint's own option.
    let c = post(
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false})
            .to_string(),
    );
    assert_eq!(c.status, 200, "{}", c.body);
    assert!(c.json()["count"].as_u64().unwrap_or(0) > 0);
    // The served model's name is accepted, another one is a 404 as on the generation endpoints; an id outside
    // the vocabulary is an invalid_token_id as there.
    let ok = post(
        "/tokenize",
        &json!({"prompt": "x", "model": "flashnext-tiny"}).to_string(),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    for (path, body) in [
        ("/tokenize", json!({"prompt": "x", "model": "other"})),
        ("/detokenize", json!({"tokens": [1], "model": "other"})),
    ] {
        let r = post(path, &body.to_string());
        assert_eq!(r.status, 404, "{path}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "model_not_found", "{path}");
    }
    let bad = post("/detokenize", &json!({"tokens": [1 << 30]}).to_string());
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(bad.json()["error"]["code"], "invalid_token_id");
    // One of `prompt` and `messages`: both, or neither (a null field is an absent one), is a 400 naming `prompt`.
    // Before, both silently tokenized the messages.
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (body, says) in [
        (
            json!({"prompt": "x", "messages": hi}),
            "give `prompt` (a string) or `messages`, not both",
        ),
        (json!({}), "give `prompt` (a string) or `messages`"),
        (
            json!({"prompt": null, "messages": null}),
            "give `prompt` (a string) or `messages`",
        ),
    ] {
        let r = post("/tokenize", &body.to_string());
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(
            r.json()["error"],
            json!({"message": says, "type": "invalid_request_error", "param": "prompt", "code": null}),
            "{body}"
        );
    }
    // A null beside the other field is absent: the other is tokenized.
    let one = post(
        "/tokenize",
        &json!({"prompt": null, "messages": hi, "add_generation_prompt": false}).to_string(),
    );
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json()["tokens"], c.json()["tokens"]);
    // Unknown fields are refused by name, as on the generation endpoints.
    for (path, body) in [
        ("/tokenize", json!({"prompt": "x", "foo": 1})),
        ("/detokenize", json!({"tokens": [1], "foo": 1})),
    ] {
        let r = post(path, &body.to_string());
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], "foo", "{path}");
    }
    // A text certainly longer than the context is refused without being encoded whole.
    let long = "word ".repeat(400_000);
    let r = post("/tokenize", &json!({ "prompt": long }).to_string());
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        msg.starts_with(
            "the prompt is too long: 2000000 bytes of text, more than the 503 tokens a request may use \
             (max_model_len:"
        ),
        "{msg}"
    );
    // The `openai` client's models.retrieve: the served model, else a 404.
    let one = client::request(server(), "GET", "/v1/models/flashnext-tiny", None).unwrap();
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json()["id"], "flashnext-tiny");
    let none = client::request(server(), "GET", "/v1/models/other", None).unwrap();
    assert_eq!(none.status, 404, "{}", none.body);
    assert_eq!(none.json()["error"]["code"], "model_not_found");
}

#[test]
fn wrong_method_and_oversized_body_get_openai_errors() {
    let r = client::request(server(), "GET", "/v1/completions", None).unwrap();
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "method_not_allowed");
    // Over the 64 MB limit in a chunked body (no Content-Length to refuse it by: the body is read up to the limit):
    // a 413 with an OpenAI-style body, not axum's plain text. A few KB over, so that the server has read nearly all
    // of it when it answers (no reset while the client writes).
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(server()).expect("connects");
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .expect("sends the head");
    let chunk = vec![b'a'; 1 << 20];
    let mut chunked = Vec::new();
    for _ in 0..64 {
        chunked.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        chunked.extend_from_slice(&chunk);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"1000\r\n");
    chunked.extend_from_slice(&chunk[..4096]);
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    s.write_all(&chunked).expect("sends the body");
    closing_error_reply(
        &mut s,
        std::time::Duration::from_secs(60),
        413,
        "request_too_large",
    );
}

#[test]
fn a_body_that_never_arrives_gets_a_408_and_the_others_are_served() {
    use std::io::Write;
    // A server of its own, with a short deadline.
    let deadline = std::time::Duration::from_secs(2);
    let (_rt, addr) = serve_on_a_free_port(AppState {
        service: tiny_service(),
        model_name: "flashnext-tiny".into(),
        body_deadline: deadline,
        head_deadline: DEFAULT_HEAD_DEADLINE,
    });
    let t0 = std::time::Instant::now();
    let mut held = std::net::TcpStream::connect(&addr).expect("connects");
    held.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\"",
    )
    .expect("sends the head");
    // Served while that body is awaited.
    a_short_completion_is_served(&addr);
    let reply = closing_error_reply(&mut held, deadline * 10, 408, "request_timeout");
    let waited = t0.elapsed();
    assert!(waited >= deadline, "answered after {waited:?}: {reply}");
}

/// Reads a raw connection's reply until the server closes it (waiting at most `wait`) and checks that it is an
/// OpenAI-style error of `status` and `code` with `Connection: close`; returns the reply.
fn closing_error_reply(
    s: &mut std::net::TcpStream,
    wait: std::time::Duration,
    status: u16,
    code: &str,
) -> String {
    use std::io::Read;
    s.set_read_timeout(Some(wait)).expect("read timeout");
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert!(reply.starts_with(&format!("HTTP/1.1 {status}")), "{reply}");
    let body = &reply[reply.find("\r\n\r\n").map_or(0, |i| i + 4)..];
    let e: Value =
        serde_json::from_str(body).unwrap_or_else(|_| panic!("an OpenAI-style body: {reply}"));
    assert_eq!(e["error"]["code"], code, "{reply}");
    assert_eq!(e["error"]["type"], "invalid_request_error", "{reply}");
    assert!(
        reply.to_ascii_lowercase().contains("connection: close"),
        "{reply}"
    );
    reply
}

#[test]
fn a_body_announced_over_the_limit_gets_a_413_before_it_is_sent() {
    use std::io::Write;
    // A server of its own, whose body deadline is far beyond the test's wait: only the head decides the reply.
    let (_rt, addr) = serve_on_a_free_port(AppState {
        service: tiny_service(),
        model_name: "flashnext-tiny".into(),
        body_deadline: std::time::Duration::from_secs(600),
        head_deadline: DEFAULT_HEAD_DEADLINE,
    });
    let mut s = std::net::TcpStream::connect(&addr).expect("connects");
    // A head announcing 100 MB, then none of the body.
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 104857600\r\n\r\n",
    )
    .expect("sends the head");
    closing_error_reply(
        &mut s,
        std::time::Duration::from_secs(30),
        413,
        "request_too_large",
    );
}

/// A server of its own whose head deadline is `head_deadline` (its body deadline is the shared server's, far
/// longer: only the head's can end what these tests wait for).
fn serve_with_head_deadline(
    head_deadline: std::time::Duration,
) -> (tokio::runtime::Runtime, String) {
    serve_on_a_free_port(AppState {
        service: tiny_service(),
        model_name: "flashnext-tiny".into(),
        body_deadline: BODY_DEADLINE,
        head_deadline,
    })
}

/// A server of its own with head deadline `deadline`, and a connection to it that has sent `head` (a part of a
/// request head): the runtime, the server's address, the connection and when it was opened.
fn partial_head(
    deadline: std::time::Duration,
    head: &[u8],
) -> (
    tokio::runtime::Runtime,
    String,
    std::net::TcpStream,
    std::time::Instant,
) {
    use std::io::Write;
    let (rt, addr) = serve_with_head_deadline(deadline);
    let t0 = std::time::Instant::now();
    let mut s = std::net::TcpStream::connect(&addr).expect("connects");
    s.write_all(head).expect("sends part of the head");
    (rt, addr, s, t0)
}

/// A two-token completion on a fresh connection to `addr` gets its 200.
fn a_short_completion_is_served(addr: &str) {
    let r = client::request(
        addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": [1, 2, 3], "max_tokens": 2}"#),
    )
    .expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Reads `s` to its end, waiting at most `wait` for each read: asserts that the server closed it having written
/// nothing (`what` names the connection in failures).
fn closed_with_nothing_written(s: &mut std::net::TcpStream, wait: std::time::Duration, what: &str) {
    use std::io::Read;
    s.set_read_timeout(Some(wait)).expect("read timeout");
    let mut got = Vec::new();
    let read = s.read_to_end(&mut got);
    assert!(
        read.is_ok(),
        "{what}: not closed within {wait:?}: {read:?}, got {:?}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        got.is_empty(),
        "{what}: the server answered a head it never got whole: {:?}",
        String::from_utf8_lossy(&got)
    );
}

/// Whether a read or write error says that the peer closed the connection (a write after its FIN draws a reset).
fn closed_by_peer(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
    )
}

#[test]
fn a_head_that_never_ends_is_closed_at_the_head_deadline_and_the_others_are_served() {
    let deadline = std::time::Duration::from_secs(1);
    // A request line and one header, and then nothing: the head never ends.
    let (_rt, addr, mut held, t0) =
        partial_head(deadline, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
    // A whole request on a fresh connection is served meanwhile, under the same short deadline.
    a_short_completion_is_served(&addr);
    // hyper writes nothing at the deadline and closes the connection: end of file. (Without the deadline the
    // connection stays open and this read runs into its timeout, 10 deadlines, far below the body deadline.)
    closed_with_nothing_written(&mut held, deadline * 10, "a head that never ends");
    let waited = t0.elapsed();
    assert!(
        waited >= deadline,
        "closed after {waited:?}, before the deadline"
    );
    eprintln!("a head that never ends: closed {waited:?} after connecting");
}

#[test]
fn a_head_trickled_in_is_cut_off_at_the_deadline_its_bytes_do_not_extend_it() {
    use std::io::{Read, Write};
    let deadline = std::time::Duration::from_secs(1);
    let (_rt, _addr, mut s, t0) = partial_head(
        deadline,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    );
    s.set_read_timeout(Some(std::time::Duration::from_millis(100)))
        .expect("read timeout");
    // One more byte of a header value every 100 ms (a slowloris client): the connection is never idle for long,
    // yet it is closed once the head has taken the deadline.
    let mut buf = [0u8; 256];
    loop {
        let waited = t0.elapsed();
        assert!(
            waited < deadline * 10,
            "a head still trickling in after {waited:?} is not cut off"
        );
        if let Err(e) = s.write_all(b"a") {
            assert!(closed_by_peer(&e), "{e}");
            break;
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => panic!(
                "the server answered a head it never got whole: {:?}",
                String::from_utf8_lossy(&buf[..n])
            ),
            Err(e) if closed_by_peer(&e) => break,
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "{e}"
            ),
        }
    }
    let waited = t0.elapsed();
    // Seen closed through a write: whatever the server sent before closing is still to be read, and must be
    // nothing (end of file, or the reset the write drew).
    s.set_read_timeout(Some(deadline * 10))
        .expect("read timeout");
    match s.read(&mut buf) {
        Ok(0) => {}
        Ok(n) => panic!(
            "the server answered a head it never got whole: {:?}",
            String::from_utf8_lossy(&buf[..n])
        ),
        Err(e) => assert!(closed_by_peer(&e), "{e}"),
    }
    assert!(
        waited >= deadline,
        "closed after {waited:?}, before the deadline"
    );
    eprintln!("a trickled head: closed {waited:?} after connecting");
}

/// Reads one reply with a `Content-Length` body from a kept-alive connection: its status and body.
fn read_one_reply(s: &mut std::net::TcpStream) -> (u16, String) {
    use std::io::Read;
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = s.read(&mut byte).expect("reads the reply's head");
        assert_eq!(
            n,
            1,
            "the connection closed mid-reply: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&got).to_ascii_lowercase();
    let status = head
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("a status line: {head}"));
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("a content-length: {head}"));
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("reads the reply's body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[test]
fn a_kept_alive_connection_gets_the_deadline_per_head_and_is_closed_when_idle_past_it() {
    use std::io::Write;
    use std::time::{Duration, Instant};
    let deadline = Duration::from_secs(4);
    let (_rt, addr) = serve_with_head_deadline(deadline);
    let mut s = std::net::TcpStream::connect(&addr).expect("connects");
    s.set_read_timeout(Some(deadline * 10))
        .expect("read timeout");
    // Five requests on one connection, each 1 s after the previous reply: the connection outlives the deadline,
    // each head arrives well within it (3 s to spare, for a loaded machine).
    let t0 = Instant::now();
    for i in 0..5 {
        if i > 0 {
            std::thread::sleep(Duration::from_secs(1));
        }
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("sends a request");
        let (status, body) = read_one_reply(&mut s);
        assert_eq!(status, 200, "request {i}: {body}");
    }
    assert!(
        t0.elapsed() > deadline,
        "the connection did not outlive one deadline"
    );
    // Then idle: closed, with nothing written, about one deadline after the last reply.
    let idle = Instant::now();
    closed_with_nothing_written(&mut s, deadline * 10, "an idle kept-alive connection");
    let waited = idle.elapsed();
    // The clock starts as the server sends the last reply, a little before it is read here.
    assert!(
        waited >= deadline / 4,
        "closed {waited:?} after the last reply"
    );
    eprintln!("an idle kept-alive connection: closed {waited:?} after the last reply");
}

#[test]
fn a_graceful_stop_finishes_the_stream_in_flight_and_takes_no_new_connection() {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let state = AppState {
        service: tiny_service(),
        model_name: "flashnext-tiny".into(),
        body_deadline: BODY_DEADLINE,
        head_deadline: DEFAULT_HEAD_DEADLINE,
    };
    let (rt, addr, server) = serve_on_a_free_port_until(state, async move {
        let _ = stopped.await;
    });
    // A long streamed reply, under way when the stop comes.
    let events = Arc::new(Mutex::new(Vec::<String>::new()));
    let (first_tx, first_rx) = std::sync::mpsc::channel::<()>();
    let stream = {
        let (addr, events) = (addr.clone(), Arc::clone(&events));
        std::thread::spawn(move || {
            let body = json!({"prompt": "import os\n", "max_tokens": 400, "temperature": 0, "ignore_eos": true,
                              "stream": true, "stream_options": {"include_usage": true}});
            client::stream_sse(&addr, "/v1/completions", &body.to_string(), |d| {
                let mut ev = events.lock().expect("events");
                ev.push(d.to_string());
                if ev.len() == 1 {
                    let _ = first_tx.send(());
                }
            })
        })
    };
    first_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the stream's first event");
    stop.send(()).expect("the server awaits the stop");
    let at_stop = events.lock().expect("events").len();
    // No new connection once the stop has begun (the listener is closed).
    let t0 = Instant::now();
    while std::net::TcpStream::connect(&addr).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "still taking connections {:?} after the stop",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // `serve` returns once the stream is done; then the runtime is dropped at once, which ends every task left (as
    // the process's exit does after `serve_addr` returns): a stream still under way then would be cut short.
    let served =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(120), server).await });
    rt.shutdown_background();
    assert!(
        matches!(served, Ok(Ok(Ok(())))),
        "serve did not return Ok after the stop: {served:?}"
    );
    let r = stream.join().expect("stream thread").expect("the stream");
    assert_eq!(r.status, 200, "{}", r.body);
    let events = events.lock().expect("events").clone();
    assert!(
        at_stop < events.len() && !events[..at_stop].iter().any(|e| e == "[DONE]"),
        "the stream had ended ({at_stop} of {} events) before the stop: the test proves nothing",
        events.len()
    );
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "the stream was cut: {} events",
        events.len()
    );
    let usage = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|v| !v["usage"].is_null())
        .expect("a usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 400, "{usage}");
}

/// The bundled model's CPU backend, panicking in its replay after `runs` replays (an engine thread's crash).
struct PanicsAfter {
    inner: flashplan_runtime::cpu::CpuBackend,
    runs: usize,
}

impl flashplan_runtime::backend::Backend for PanicsAfter {
    fn body(&self) -> &flashplan_plan::PlanBody {
        self.inner.body()
    }
    fn run(
        &mut self,
        kind: flashplan_plan::VariantKind,
        desc: &flashplan_plan::RoundDesc,
    ) -> Result<(), flashplan_runtime::backend::BackendError> {
        assert!(self.runs > 0, "injected crash of the engine thread");
        self.runs -= 1;
        self.inner.run(kind, desc)
    }
    fn io(&self, buf: flashplan_plan::IoBuf) -> &[f32] {
        self.inner.io(buf)
    }
    fn write_io(&mut self, buf: flashplan_plan::IoBuf, offset: usize, data: &[f32]) {
        self.inner.write_io(buf, offset, data)
    }
    fn reset_slot(&mut self, slot: u32) {
        self.inner.reset_slot(slot)
    }
    fn slot_state(&self, slot: u32) -> Vec<f32> {
        self.inner.slot_state(slot)
    }
}

/// A service on the bundled model whose engine thread panics at its fourth replay.
fn panicking_service() -> Service {
    let dir = root().join("models/flashnext-tiny");
    let body = plan_for(&dir, &[1], 4, 32, 512);
    let be = PanicsAfter {
        inner: backend(&dir, body),
        runs: 3,
    };
    let opts = EngineOptions {
        max_depth: 4,
        parallel: 1,
        ..Default::default()
    };
    let tok = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    Service::start(Engine::new(be, opts, true), tok)
}

#[test]
fn a_crashed_engine_thread_is_not_alive() {
    // /health reads `is_alive`: after the engine thread panics it must say so, and new requests are refused.
    let service = panicking_service();
    assert!(service.is_alive());
    let req = || flashplan_runtime::service::GenRequest {
        request: flashplan_runtime::engine::Request {
            prompt: vec![1, 2, 3, 4],
            max_tokens: 32,
            sampling: flashplan_plan::SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: true,
            draft: true,
        },
        stop: vec![],
    };
    // The reply's channel closes when the thread dies.
    if let Ok(mut rx) = service.submit_blocking(req()) {
        while rx.blocking_recv().is_some() {}
    }
    let t0 = std::time::Instant::now();
    while service.is_alive() && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        !service.is_alive(),
        "the engine thread panicked but is_alive() is still true"
    );
    assert!(service.submit_blocking(req()).is_err());
}

#[test]
fn a_stream_the_engine_drops_still_ends_with_done() {
    // The engine thread dies mid-reply: the streamed reply carries an error event, then the end marker.
    let state = AppState {
        service: panicking_service(),
        model_name: "flashnext-tiny".into(),
        body_deadline: BODY_DEADLINE,
        head_deadline: DEFAULT_HEAD_DEADLINE,
    };
    let (_rt, addr) = serve_on_a_free_port(state);
    let mut events = Vec::new();
    let r = client::stream_sse(
        &addr,
        "/v1/completions",
        r#"{"prompt": [1, 2, 3, 4], "max_tokens": 32, "ignore_eos": true, "stream": true}"#,
        |d| events.push(d.to_string()),
    )
    .expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        events
            .iter()
            .any(|e| e.contains("the engine dropped the request")),
        "{events:?}"
    );
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
}

#[test]
fn a_full_queue_gets_429_with_retry_after() {
    // A queue of 0 waiting requests: every request finds it full.
    let dir = root().join("models/flashnext-tiny");
    let opts = EngineOptions {
        max_depth: 4,
        parallel: 1,
        queue: 0,
        ..Default::default()
    };
    let engine = Engine::new(backend(&dir, plan_for(&dir, &[1], 4, 32, 512)), opts, true);
    let tok = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    let state = AppState {
        service: Service::start(engine, tok),
        model_name: "flashnext-tiny".into(),
        body_deadline: BODY_DEADLINE,
        head_deadline: DEFAULT_HEAD_DEADLINE,
    };
    let (_rt, addr) = serve_on_a_free_port(state);
    for stream in [false, true] {
        let body = json!({"prompt": "a", "max_tokens": 2, "stream": stream}).to_string();
        let r = client::request(&addr, "POST", "/v1/completions", Some(&body)).expect("request");
        assert_eq!(r.status, 429, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "queue_full", "{}", r.body);
        let retry: Vec<_> = r
            .headers
            .iter()
            .filter(|(k, _)| k == "retry-after")
            .collect();
        assert_eq!(
            retry,
            [&("retry-after".to_string(), "1".to_string())],
            "{:?}",
            r.headers
        );
    }
}

/// The bundled model served (CPU, max depth 4, one stream, context 512) with its tokenizer beside `template` as
/// its chat_template.jinja: the template's path, and the server (keep the folder while it runs).
fn serve_with_template(
    template: &str,
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    tokio::runtime::Runtime,
    String,
) {
    let dir = root().join("models/flashnext-tiny");
    let tmp = tempfile::tempdir().expect("tempdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(dir.join(f), tmp.path().join(f)).expect("copy the tokenizer");
    }
    let jinja = tmp.path().join("chat_template.jinja");
    std::fs::write(&jinja, template).expect("write the template");
    let opts = EngineOptions {
        max_depth: 4,
        parallel: 1,
        ..Default::default()
    };
    let engine = Engine::new(backend(&dir, plan_for(&dir, &[1], 4, 32, 512)), opts, true);
    let tok = Arc::new(Tokenizer::from_dir(tmp.path()).expect("the tokenizer loads"));
    let (rt, addr) = serve_on_a_free_port(AppState {
        service: Service::start(engine, tok),
        model_name: "flashnext-tiny".into(),
        body_deadline: BODY_DEADLINE,
        head_deadline: DEFAULT_HEAD_DEADLINE,
    });
    (tmp, jinja, rt, addr)
}

/// The message of a 500 `server_error` answer to `path` (its type, and no param or code, checked).
fn server_error(r: &client::Response, path: &str) -> String {
    assert_eq!(r.status, 500, "{path}: {}", r.body);
    let e = &r.json()["error"];
    assert_eq!(
        (&e["type"], &e["param"], &e["code"]),
        (&json!("server_error"), &Value::Null, &Value::Null),
        "{path}: {}",
        r.body
    );
    e["message"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_chat_template_that_does_not_parse_fails_chat_requests_alone() {
    // The model serves completions; chat requests (and /tokenize of messages) get a 500 naming the template's
    // file and the syntax error, the model's fault, not the client's.
    let (_tmp, jinja, _rt, addr) = serve_with_template("BROKEN {{ \n");
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    let r = client::request(&addr, "POST", "/v1/completions", Some(&body)).expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
    for path in ["/v1/chat/completions", "/tokenize"] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
        let r = client::request(&addr, "POST", path, Some(&body)).expect("request");
        let msg = server_error(&r, path);
        // The template's name and line, not its path on the server.
        assert!(
            msg.starts_with(
                "the model's chat template cannot be used: it does not parse: syntax error: unexpected end of input"
            ) && msg.ends_with("(in chat_template.jinja:1)")
                && !msg.contains(&*jinja.to_string_lossy()),
            "{path}: {msg}"
        );
    }
}

#[test]
fn a_chat_template_failing_at_render_is_a_500_unless_it_raises() {
    // The template's `raise_exception` refuses the client's messages (400); any other failure is the template's
    // own fault (500). Before, both were a 400 naming `messages`.
    // A string plus a number fails at render, here only for a message "boom".
    let (_tmp, _, _rt, addr) = serve_with_template(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}\
         {% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n\
         {{ m.content + 1 if m.content == 'boom' else m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    );
    let send = |path: &str, role: &str, content: &str| {
        let mut body = json!({"messages": [{"role": role, "content": content}]});
        if path != "/tokenize" {
            body["max_tokens"] = json!(1);
        }
        client::request(&addr, "POST", path, Some(&body.to_string())).expect("request")
    };
    let ok = send("/v1/chat/completions", "user", "hi");
    assert_eq!(ok.status, 200, "{}", ok.body);
    for path in ["/v1/chat/completions", "/tokenize"] {
        let r = send(path, "assistant", "hi");
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        assert_eq!(
            r.json()["error"],
            json!({"message": "the chat template refuses these messages: Conversations must start with a user turn",
                   "type": "invalid_request_error", "param": "messages", "code": null}),
            "{path}"
        );
        let msg = server_error(&send(path, "user", "boom"), path);
        assert!(
            msg.starts_with(
                "the model's chat template failed to render these messages: chat template: invalid operation"
            ) && msg.contains("(in chat_template.jinja:"),
            "{path}: {msg}"
        );
    }
}
