#!/usr/bin/env bash
# Plain-decode benchmark (issue 4) together with the GPU checks, in two steps like scripts/gpu_check.sh.
#
#   1. Here:            bash scripts/gpu_bench.sh build
#      gpu_check.sh build (test binary and cubin cache in gpu-bin/), plus the release example gpu_bench.
#   2. On the H200, through the device `run` tool, with carry ["gpu-pack"]:
#                       tar xJf gpu-pack/gpu-bin.tar.xz && bash scripts/gpu_bench.sh run [--no-checks] [gpu_bench args]
#      runs the GPU checks of tests/gpu.rs (table) where their binary is in gpu-bin/ (the pack leaves it out, to stay
#      under the device copy limit: unpack gpu-pack-gpu/gpu.tar.xz, from the same build, in an earlier call on the
#      same warm machine, or run scripts/gpu_check.sh there), then the benchmark (tables also written to
#      $OUT/bench.md when $OUT is set).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-build}"
shift || true
case "$mode" in
build)
    bash scripts/gpu_check.sh build
    cargo build --release --example gpu_bench
    cp target/release/examples/gpu_bench gpu-bin/gpu-bench
    strip gpu-bin/gpu-bench
    gzip -9f gpu-bin/gpu-bench
    # What travels: gpu-pack/gpu-bin.tar.xz (the bench and the cubins; the working tree plus the carried files must
    # stay under the device copy limit, so the checks' binary travels in gpu-pack-gpu). The run command unpacks it.
    bash scripts/gpu_check.sh pack gpu-pack gpu-bin.tar.xz gpu-bench
    du -sh gpu-pack
    echo "now: run(command='tar xJf gpu-pack/gpu-bin.tar.xz && bash scripts/gpu_bench.sh run', carry=['gpu-pack'])"
    ;;
run)
    rc=0
    if [ "${1:-}" = "--no-checks" ]; then
        shift
    elif [ ! -e gpu-bin/gpu-test ] && [ ! -e gpu-bin/gpu-test.gz ]; then
        echo "gpu checks: not run (gpu-bin/ has no gpu-test: unpack gpu-pack-gpu/gpu.tar.xz of this build first)"
    else
        bash scripts/gpu_check.sh run gpu >/tmp/checks.out 2>&1 || rc=$?
        grep -E '^\||^GPU:|^test result|panicked|FAIL' /tmp/checks.out || tail -30 /tmp/checks.out
        echo "gpu checks exit status: $rc"
    fi
    kc=$(bash scripts/gpu_check.sh unpack-kernels)
    if [ -f gpu-bin/gpu-bench.gz ]; then
        gunzip -c gpu-bin/gpu-bench.gz >/tmp/gpu-bench
    else
        cp gpu-bin/gpu-bench /tmp/gpu-bench
    fi
    chmod +x /tmp/gpu-bench
    export FLASHPLAN_KERNEL_CACHE="$kc"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
    set -o pipefail
    /tmp/gpu-bench "$@" 2>&1 | tee /tmp/bench.md
    if [ -n "${OUT:-}" ]; then cp /tmp/bench.md "$OUT/"; fi
    exit "$rc"
    ;;
*)
    echo "usage: $0 build|run [--no-checks] [gpu_bench args]" >&2
    exit 2
    ;;
esac
