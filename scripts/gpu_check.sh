#!/usr/bin/env bash
# GPU checks in two steps (the H200 machine has no Rust toolchain and no network).
#
#   1. Here:            bash scripts/gpu_check.sh build
#      builds the release GPU test binary, strips it into gpu-bin/ (ignored by git through .git/info/exclude) and
#      compiles the kernels into the cubin cache gpu-bin/kernels (needs NVRTC: scripts/setup_nvrtc.sh).
#   2. On the H200, through the device `run` tool, with carry ["gpu-bin"]:
#                       bash scripts/gpu_check.sh run
#      runs the checks and prints the table (also written to $OUT/gpu-checks.md when $OUT is set).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-build}"
case "$mode" in
build)
    grep -qxF '/gpu-bin/' .git/info/exclude 2>/dev/null || echo '/gpu-bin/' >>.git/info/exclude
    if ! ldconfig -p 2>/dev/null | grep -q libnvrtc.so.13 && [[ "${LD_LIBRARY_PATH:-}" != *cu13* ]]; then
        eval "$(bash scripts/setup_nvrtc.sh)"
    fi
    rm -rf gpu-bin && mkdir -p gpu-bin/kernels
    exe=$(cargo test --release --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
    cp "$exe" gpu-bin/gpu-test
    strip gpu-bin/gpu-test
    FLASHPLAN_KERNEL_CACHE="$PWD/gpu-bin/kernels" cargo test --release -q -p flashplan-compiler --lib \
        nvrtc::tests::kernels_compile_for_sm_90a >/dev/null
    ls gpu-bin/kernels/*.cubin >/dev/null
    pwd >gpu-bin/build-root
    du -sh gpu-bin
    echo "now: run(command='bash scripts/gpu_check.sh run', carry=['gpu-bin'])"
    ;;
run)
    # The test binary finds the fixtures at the path it was built in.
    built=$(cat gpu-bin/build-root 2>/dev/null || true)
    if [ -n "$built" ] && [ ! -e "$built/fixtures" ]; then
        mkdir -p "$(dirname "$built")"
        ln -s "$PWD" "$built"
    fi
    export FLASHPLAN_GPU=1 FLASHPLAN_KERNEL_CACHE="$PWD/gpu-bin/kernels"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    set +e
    ./gpu-bin/gpu-test --nocapture --test-threads=1 2>&1 | tee /tmp/gpu-test.log
    rc=${PIPESTATUS[0]}
    set -e
    { echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"; grep -E '^\||^GPU:' /tmp/gpu-test.log; } >/tmp/gpu-checks.md
    if [ -n "${OUT:-}" ]; then cp /tmp/gpu-checks.md /tmp/gpu-test.log "$OUT/"; fi
    exit "$rc"
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
