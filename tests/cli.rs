//! `flashplan demo` runs the bundled model and shows identical drafted and plain replies.

use std::process::Command;

#[test]
fn demo_exits_zero_with_identical_replies() {
    let cache = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .arg("demo")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_CACHE", cache.path())
        .output()
        .expect("runs flashplan demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert_eq!(
        stdout
            .matches("drafted == plain: identical replies")
            .count(),
        2,
        "{stdout}"
    );
    assert!(stdout.contains("kept per round"), "{stdout}");
    assert!(stderr.contains("running on the CPU backend"), "{stderr}");
}

#[test]
fn unknown_env_value_refuses_to_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .arg("demo")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_COPY_DRAFTS", "maybe")
        .output()
        .expect("runs flashplan demo");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("FLASHPLAN_COPY_DRAFTS"));
}

#[test]
fn unknown_cuda_switch_value_refuses_to_start_on_any_backend() {
    for var in [
        "FLASHPLAN_PDL",
        "FLASHPLAN_FUSE_LINEAR",
        "FLASHPLAN_FUSE_SMALL",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
            .arg("demo")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("FLASHPLAN_BACKEND", "cpu")
            .env(var, "yes")
            .output()
            .expect("runs flashplan demo");
        assert!(!out.status.success(), "{var}=yes was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(var) && stderr.contains("expected 1"),
            "{stderr}"
        );
    }
}

#[test]
fn an_empty_folder_or_backend_variable_refuses_to_start() {
    // An empty folder would mean the current directory; an empty backend is not one of its values.
    for (var, args) in [
        ("FLASHPLAN_CACHE", &["demo"][..]),
        ("FLASHPLAN_KERNEL_CACHE", &["demo"][..]),
        ("FLASHPLAN_BACKEND", &["demo"][..]),
        (
            "FLASHPLAN_KERNEL_CACHE",
            &[
                "compile",
                "--config",
                "configs/flashnext-tiny.json",
                "--out",
                "/nonexistent/plans",
            ][..],
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env(var, "")
            .output()
            .expect("runs flashplan");
        assert!(!out.status.success(), "{var}= was accepted by {args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(var), "{args:?}: {stderr}");
    }
}

/// Runs `flashplan args` from the repository (CPU backend, `env` set) and expects it to fail: its stderr.
fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_BACKEND", "cpu")
        .envs(env.iter().copied())
        .output()
        .expect("runs flashplan");
    assert!(!out.status.success(), "{args:?} with {env:?} was accepted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `run` on the bundled model and its committed plans, prompt `x`, with `extra` options.
fn run_bundled(extra: &[&str]) -> Vec<String> {
    let mut a = [
        "run",
        "--model",
        "models/flashnext-tiny",
        "--plans",
        "plans/flashnext-tiny",
    ]
    .map(String::from)
    .to_vec();
    a.extend(["--prompt", "x"].map(String::from));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn every_command_refuses_a_wrong_value_of_any_product_variable() {
    // The commands that load no model check the same variables as those that do: a wrong value is refused by
    // name whichever command meets it first, with the one wording of every variable.
    let compile = [
        "compile",
        "--config",
        "configs/flashnext-tiny.json",
        "--out",
        "/nonexistent/plans",
    ];
    for (var, value) in [
        ("FLASHPLAN_COPY_DRAFTS", "7"),
        ("FLASHPLAN_GPU", "2"),
        ("FLASHPLAN_PDL", "yes"),
        ("FLASHPLAN_MTP_WEIGHTS", "fp4"),
    ] {
        for args in [
            &["plans", "inspect", "plans/flashnext-tiny"][..],
            &compile[..],
        ] {
            let e = refused(args, &[(var, value)]);
            let says = format!("environment variable {var}=\"{value}\" is not accepted: expected");
            assert!(e.contains(&says), "{args:?}: {e}");
        }
    }
}

#[test]
fn a_context_other_than_the_given_plans_is_refused() {
    // --context compiles plans into the cache; with --plans, whose context is fixed, another value would be
    // silently ignored, so it is refused, naming both.
    let args = run_bundled(&["--context", "8192"]);
    let e = refused(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(
        e.contains("--context 8192") && e.contains("a context of 4096 tokens"),
        "{e}"
    );
}

#[test]
fn run_refuses_a_reply_of_no_tokens_and_takes_negative_numbers_as_values() {
    for (extra, says) in [
        (&["--max-tokens", "0"][..], "'0' for '--max-tokens"),
        (&["--max-depth", "-1"][..], "'-1' for '--max-depth"),
        (
            &["--temperature", "-1"][..],
            "--temperature -1: expected 0 to 2",
        ),
        (
            &["--temperature", "NaN"][..],
            "--temperature NaN: expected 0 to 2",
        ),
        (
            &["--temperature", "3"][..],
            "--temperature 3: expected 0 to 2",
        ),
    ] {
        let args = run_bundled(extra);
        let e = refused(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
        assert!(e.contains(says), "{extra:?}: {e}");
    }
}

#[test]
fn compile_names_its_two_sources_and_its_archs() {
    let e = refused(&["compile", "--out", "/nonexistent/plans"], &[]);
    assert!(e.contains("--model <MODEL>|--config <CONFIG>"), "{e}");
    let e = refused(
        &[
            "compile",
            "--config",
            "configs/flashnext-tiny.json",
            "--out",
            "/nonexistent/plans",
            "--arch",
            "sm_80",
        ],
        &[],
    );
    assert!(e.contains("--arch = sm_80: expected cpu or sm_90a"), "{e}");
}

#[test]
fn compile_quotes_the_options_as_given_and_checks_out_before_compiling() {
    let out = tempfile::tempdir().expect("tempdir");
    let dir = out.path().join("plans").to_string_lossy().into_owned();
    let compile = |extra: &[&str], out: &str| {
        let mut a = vec![
            "compile",
            "--config",
            "configs/flashnext-tiny.json",
            "--out",
            out,
        ];
        a.extend_from_slice(extra);
        refused(&a, &[])
    };
    // The lone stream the compiler adds is not in the quoted list.
    let e = compile(&["--streams", "0"], &dir);
    assert!(e.contains("--streams = [0]: expected"), "{e}");
    // An --out that is, or lies under, a file is named as such, before any compiling (whose failure to make the
    // folder would say "writing the plans").
    for out in ["README.md", "README.md/plans"] {
        let e = compile(&[], out);
        assert!(
            e.contains(&format!(
                "--out {out}: README.md is a file, not a directory"
            )),
            "{e}"
        );
    }
}

#[test]
fn compile_defaults_to_the_context_run_compiles() {
    // The bundled model's config says 8192 positions: compile takes them, as run and serve do, with no note.
    let out = tempfile::tempdir().expect("tempdir");
    let r = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args([
            "compile",
            "--config",
            "configs/flashnext-tiny.json",
            "--out",
        ])
        .arg(out.path())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("runs flashplan compile");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr),
    );
    assert!(r.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("at context 8192:"), "{stdout}");
    assert!(!stderr.contains("note:"), "{stderr}");
}

#[test]
fn a_config_leaving_out_a_size_is_named_with_the_default_taken() {
    // The bundled model's config without num_experts: transformers' 512 is taken, and the note says so before the
    // plans (for 512 experts) compile.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/flashnext-tiny.json"),
        )
        .expect("config"),
    )
    .expect("config parses");
    cfg.as_object_mut()
        .expect("an object")
        .remove("num_experts");
    let path = dir.path().join("config.json");
    std::fs::write(&path, cfg.to_string()).expect("write config");
    let r = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(["compile", "--config"])
        .arg(&path)
        .arg("--out")
        .arg(dir.path().join("plans"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("runs flashplan compile");
    let stderr = String::from_utf8_lossy(&r.stderr);
    let note = "note: the config leaves out num_experts = 512: transformers' defaults are taken";
    assert!(r.status.success() && stderr.contains(note), "{stderr}");
    // run names it too, before its plans (for 8 experts) are refused.
    let model = tokenizer_copy();
    std::fs::write(model.path().join("config.json"), cfg.to_string()).expect("write config");
    let e = refused(
        &[
            "run",
            "--model",
            &model.path().to_string_lossy(),
            "--plans",
            "plans/flashnext-tiny",
            "--prompt",
            "x",
        ],
        &[],
    );
    assert!(e.contains(note) && e.contains("plan mismatch"), "{e}");
}

#[test]
fn a_folder_without_plans_names_the_command_that_makes_them() {
    let empty = tempfile::tempdir().expect("tempdir");
    let e = refused(&["plans", "inspect", &empty.path().to_string_lossy()], &[]);
    assert!(
        e.contains("directory holds no plans.fplan (compile it with `flashplan compile --model MODEL_DIR --out"),
        "{e}"
    );
}

#[test]
fn run_and_bench_name_what_they_expect() {
    let e = refused(&["run", "--model", "models/flashnext-tiny"], &[]);
    assert!(
        e.contains("--prompt <PROMPT>|--prompt-file <PROMPT_FILE>"),
        "{e}"
    );
    let args = run_bundled(&["--stop", ""]);
    let e = refused(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(e.contains("expected a non-empty stop string"), "{e}");
    // bench checks its own arguments before it connects anywhere.
    let e = refused(&["bench", "--temperature", "5"], &[]);
    assert!(e.contains("--temperature 5: expected 0 to 2"), "{e}");
    let e = refused(&["bench", "--max-tokens", "0"], &[]);
    assert!(e.contains("'0' for '--max-tokens"), "{e}");
}

#[test]
fn a_seed_without_a_temperature_gets_a_note() {
    let args = run_bundled(&["--seed", "5", "--max-tokens", "1"]);
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(&args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_BACKEND", "cpu")
        .output()
        .expect("runs flashplan run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("note: --seed has no effect on greedy decoding"),
        "{stderr}"
    );
}

#[test]
fn a_port_in_use_fails_before_the_model_loads() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = held.local_addr().expect("its address").port().to_string();
    let e = refused(
        &[
            "serve",
            "--model",
            "models/flashnext-tiny",
            "--plans",
            "plans/flashnext-tiny",
            "--port",
            &port,
        ],
        &[],
    );
    assert!(
        e.contains(&format!("binding --host 127.0.0.1 --port {port}")),
        "{e}"
    );
    // Nothing loaded, nothing announced.
    assert!(!e.contains("backend:") && !e.contains("serving"), "{e}");
}

#[test]
fn a_misspelt_variable_is_named_in_a_warning() {
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(["plans", "inspect", "plans/flashnext-tiny"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_BACKNED", "cpu")
        .output()
        .expect("runs flashplan");
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("FLASHPLAN_BACKNED is not a flashplan variable"),
        "{stderr}"
    );
}

/// Every `FLASHPLAN_*` name the repository's code, tests and scripts read.
fn variables_read() -> std::collections::BTreeSet<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut names = std::collections::BTreeSet::new();
    let mut dirs: Vec<std::path::PathBuf> = [
        "cli", "runtime", "compiler", "plan", "tests", "examples", "scripts", ".ci",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let path = e.path();
            if path.is_dir() {
                dirs.push(path);
            } else if let Ok(text) = std::fs::read_to_string(&path) {
                for (i, _) in text.match_indices("FLASHPLAN_") {
                    let name: String = text[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    if name.len() > "FLASHPLAN_".len() && !name.ends_with('_') {
                        names.insert(name);
                    }
                }
            }
        }
    }
    names
}

#[test]
fn every_variable_the_repository_reads_is_known_to_the_warning() {
    // But the misspelling the warning's own test and doc use.
    let names: Vec<String> = variables_read()
        .into_iter()
        .filter(|n| n != "FLASHPLAN_BACKNED")
        .collect();
    assert!(
        names.iter().any(|n| n == "FLASHPLAN_PDL") && names.iter().any(|n| n == "FLASHPLAN_GPU")
    );
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flashplan"));
    cmd.args(["plans", "inspect", "plans/flashnext-tiny"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    for n in &names {
        cmd.env(n, "1");
    }
    let out = cmd.output().expect("runs flashplan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("is not a flashplan variable"), "{stderr}");
}

#[test]
fn a_missing_model_directory_is_named() {
    let missing = tempfile::tempdir()
        .expect("tempdir")
        .path()
        .join("no-such-model");
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(["run", "--prompt", "hi", "--model"])
        .arg(&missing)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_BACKEND", "cpu")
        .output()
        .expect("runs flashplan run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no such model directory") && stderr.contains("no-such-model"),
        "{stderr}"
    );
}

#[test]
fn an_error_prints_on_one_line_without_a_backtrace() {
    // The errors are about the user's input: the message and its causes, not the backtrace `RUST_BACKTRACE` asks
    // anyhow for.
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(["run", "--prompt", "hi", "--model", "models/flashnext-tiny"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_BACKEND", "gpu")
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("runs flashplan run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "Error: environment variable FLASHPLAN_BACKEND=\"gpu\" is not accepted: expected one of auto, cpu, cuda"
        ),
        "{stderr}"
    );
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

#[cfg(unix)]
#[test]
fn a_closed_standard_output_ends_the_command_quietly() {
    // `flashplan plans inspect ... | head -0`: the reader is gone before the first line, so every write fails.
    use std::os::fd::FromRawFd;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds has room for the two descriptors pipe(2) writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
    // SAFETY: both descriptors were just opened by pipe(2) and are owned here alone.
    let (reader, writer) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(["plans", "inspect", "plans/flashnext-tiny"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(writer)
        .output()
        .expect("runs flashplan plans inspect");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A `flashplan serve` of the bundled model on the CPU backend, up once /health answers (its signal handlers are
/// then in place): the child, the thread collecting its standard error, and its address.
#[cfg(unix)]
fn serve_bundled() -> (std::process::Child, std::thread::JoinHandle<String>, String) {
    use std::io::Read;
    use std::time::{Duration, Instant};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_flashplan"))
        .args(["serve", "--model", "models/flashnext-tiny", "--plans"])
        .arg("plans/flashnext-tiny")
        .args(["--parallel", "1", "--port", &port.to_string()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("FLASHPLAN_BACKEND", "cpu")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("runs flashplan serve");
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    loop {
        let health = flashplan_runtime::server::client::request(&addr, "GET", "/health", None);
        if health.is_ok_and(|r| r.status == 200) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) || child.try_wait().ok().flatten().is_some() {
            give_up(&mut child, reader, "the server did not come up");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (child, reader, addr)
}

/// Sends `signal` to `child` (spawned by this test and not reaped).
#[cfg(unix)]
fn send_signal(child: &std::process::Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) with the id of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill");
}

/// Waits up to 30 s for `child` to exit (else fails with `what`), then returns its status and standard error.
#[cfg(unix)]
fn wait_exit(
    mut child: std::process::Child,
    reader: std::thread::JoinHandle<String>,
    what: &str,
) -> (std::process::ExitStatus, String) {
    use std::time::{Duration, Instant};
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            give_up(&mut child, reader, what);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, reader.join().expect("stderr reader"))
}

/// Serves the bundled model, sends `signal` once it is up, and returns the exit status and standard error.
#[cfg(unix)]
fn serve_then_signal(signal: libc::c_int) -> (std::process::ExitStatus, String) {
    let (child, reader, _) = serve_bundled();
    send_signal(&child, signal);
    wait_exit(
        child,
        reader,
        &format!("signal {signal} did not stop the server"),
    )
}

/// Kills and reaps `child`, then fails the test with `what` and the standard error `reader` collected.
#[cfg(unix)]
fn give_up(
    child: &mut std::process::Child,
    reader: std::thread::JoinHandle<String>,
    what: &str,
) -> ! {
    let _ = child.kill();
    let _ = child.wait();
    panic!("{what}: {}", reader.join().unwrap_or_default());
}

#[cfg(unix)]
#[test]
fn a_second_signal_stops_the_server_at_once() {
    // A request whose body never arrives keeps the graceful stop waiting; the second signal ends the process at
    // once, with 128 + the signal's number as a shell reports it.
    use std::io::{Read, Write};
    use std::time::Duration;
    for (signal, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "Ctrl-C")] {
        let (mut child, reader, addr) = serve_bundled();
        let mut held = std::net::TcpStream::connect(&addr).expect("connects");
        held.write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: 100\r\n\r\n",
        )
        .expect("sends the head");
        // The server answers `100 Continue` once it starts reading the body: the request is then in flight.
        held.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("read timeout");
        let mut got = [0u8; 25];
        if held.read_exact(&mut got).is_err() || !got.starts_with(b"HTTP/1.1 100 Continue") {
            give_up(
                &mut child,
                reader,
                &format!("no 100 Continue: {:?}", String::from_utf8_lossy(&got)),
            );
        }
        send_signal(&child, signal);
        std::thread::sleep(Duration::from_millis(500));
        if child.try_wait().expect("try_wait").is_some() {
            let (status, stderr) = wait_exit(child, reader, "");
            panic!("{name}: the first signal did not wait for the request in flight: {status}: {stderr}");
        }
        send_signal(&child, signal);
        let (status, stderr) = wait_exit(
            child,
            reader,
            &format!("a second {name} did not stop the server"),
        );
        assert_eq!(
            status.code(),
            Some(128 + signal),
            "{name}: {status}: {stderr}"
        );
        assert!(
            stderr.contains(&format!(
                "{name} again: stopping at once; the replies in flight are cut off"
            )),
            "{stderr}"
        );
        drop(held);
    }
}

#[cfg(unix)]
#[test]
fn sigterm_stops_the_server_as_ctrl_c_does() {
    // SIGTERM is what systemd and docker send: the same graceful way out as Ctrl-C, naming the signal, exit 0.
    for (signal, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "Ctrl-C")] {
        let (status, stderr) = serve_then_signal(signal);
        assert!(status.success(), "{name}: {status}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "{name}: no new connections; stopping once the replies in flight are done"
            )),
            "{stderr}"
        );
        assert_eq!(
            stderr.trim_end().lines().last(),
            Some("stopped"),
            "{stderr}"
        );
    }
}

/// The bundled model's config.json, tokenizer.json and tokenizer_config.json (no weights) in a folder of its own:
/// enough for a command that is refused while the tokenizer loads.
fn tokenizer_copy() -> tempfile::TempDir {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/flashnext-tiny");
    let dir = tempfile::tempdir().expect("tempdir");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).expect("copy the tokenizer");
    }
    dir
}

#[test]
fn a_tokenizer_with_ids_past_the_vocabulary_is_refused() {
    // The bundled tokenizer (8192 ids) beside a config whose vocab_size is 4096: refused before anything loads,
    // naming both sizes.
    let dir = tokenizer_copy();
    let path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config"))
            .expect("config parses");
    // The bundled config is a bare text config (model_type qwen4_exp_text).
    cfg["vocab_size"] = 4096.into();
    std::fs::write(&path, cfg.to_string()).expect("write config");
    let model = dir.path().to_string_lossy().into_owned();
    let e = refused(&["run", "--model", &model, "--prompt", "x"], &[]);
    assert!(
        e.contains("vocab_size is 4096") && e.contains("token id 8"),
        "{e}"
    );
}

#[test]
fn a_chat_template_that_does_not_parse_is_a_warning_and_refuses_chat_alone() {
    // Before: the model loaded with no word, and every chat request failed with a 400 blaming the client's
    // messages. Now a warning names the file at start; completions run; a chat prompt fails with that error.
    let dir = tokenizer_copy();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/flashnext-tiny");
    for e in std::fs::read_dir(&src).expect("the bundled model") {
        let name = e.expect("an entry").file_name();
        if name.to_string_lossy().contains("safetensors") {
            std::os::unix::fs::symlink(src.join(&name), dir.path().join(&name))
                .expect("link the weights");
        }
    }
    let jinja = dir.path().join("chat_template.jinja");
    std::fs::write(&jinja, "BROKEN {{ \n").expect("write the template");
    let model = dir.path().to_string_lossy().into_owned();
    let says = format!(
        "{}: the chat template does not parse: syntax error: unexpected end of input",
        jinja.display()
    );
    let run = |chat: bool| {
        let mut args = vec![
            "run",
            "--model",
            &model,
            "--plans",
            "plans/flashnext-tiny",
            "--prompt",
            "x",
            "--max-tokens",
            "1",
        ];
        if chat {
            args.push("--chat");
        }
        Command::new(env!("CARGO_BIN_EXE_flashplan"))
            .args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("FLASHPLAN_BACKEND", "cpu")
            .output()
            .expect("runs flashplan run")
    };
    let plain = run(false);
    let stderr = String::from_utf8_lossy(&plain.stderr);
    assert!(plain.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("warning: {says}")) && stderr.contains("completions are served"),
        "{stderr}"
    );
    let chat = run(true);
    let stderr = String::from_utf8_lossy(&chat.stderr);
    assert!(!chat.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("Error: {says}")) && stderr.contains("(in chat_template.jinja:1)"),
        "{stderr}"
    );
}
