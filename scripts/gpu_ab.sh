#!/usr/bin/env bash
# A/B timing of kernel changes on the H200, in two steps like scripts/gpu_bench.sh. Each build of the tree is packed
# under a name; the H200 then runs `gpu_bench --iters 100 --nodes` for every named build, twice, interleaved (A B A B),
# and prints each run's replay times; the full outputs (per-node times in plan order) go to $OUT/NAME.PASS.txt.
#
#   1. Here, once per version of the kernels:   bash scripts/gpu_ab.sh pack NAME
#      builds the release example gpu_bench and compiles the kernels into their own cubin cache, both into
#      gpu-ab/NAME.tar.xz (gpu-ab/ is ignored by git through .git/info/exclude; about 1.6 MB per build).
#   2. On the H200, through the device `run` tool, with carry ["gpu-ab"]:
#                                                bash scripts/gpu_ab.sh run NAME [NAME ...]
#      (the tree plus what travels must stay under the device copy limit: two builds at a time fit.)
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
shift || true
case "$mode" in
pack)
    name="${1:?usage: $0 pack NAME}"
    eval "$(bash scripts/setup_nvrtc.sh)"
    cargo build --release -q --example gpu_bench
    tmp=$(mktemp -d)
    mkdir -p "$tmp/$name/kernels"
    FLASHPLAN_KERNEL_CACHE="$tmp/$name/kernels" cargo test --release -q -p flashplan-compiler --lib \
        nvrtc::tests::kernels_compile_for_sm_90a >/dev/null
    cp "${CARGO_TARGET_DIR:-target}/release/examples/gpu_bench" "$tmp/$name/gpu-bench"
    strip "$tmp/$name/gpu-bench"
    grep -qxF "/gpu-ab/" .git/info/exclude 2>/dev/null || echo "/gpu-ab/" >>.git/info/exclude
    mkdir -p gpu-ab
    tar cf - -C "$tmp" "$name" | xz -9 >"gpu-ab/$name.tar.xz"
    rm -rf "$tmp"
    du -sh "gpu-ab/$name.tar.xz"
    echo "now: run(command='bash scripts/gpu_ab.sh run A B', carry=['gpu-ab'])"
    ;;
run)
    [ "$#" -ge 1 ] || { echo "usage: $0 run NAME [NAME ...]" >&2; exit 2; }
    out="${OUT:-/tmp/gpu-ab-out}"
    mkdir -p "$out"
    for name in "$@"; do tar xJf "gpu-ab/$name.tar.xz" -C /tmp; done
    for pass in 1 2; do
        for name in "$@"; do
            if ! FLASHPLAN_KERNEL_CACHE="/tmp/$name/kernels" "/tmp/$name/gpu-bench" --iters 100 --nodes \
                >"$out/$name.$pass.txt" 2>&1; then
                echo "$name failed:" >&2
                tail -5 "$out/$name.$pass.txt" >&2
                exit 1
            fi
            echo "== $name, pass $pass (variant | rows | time/replay us | sum of nodes us)"
            grep -E '^\| lone-w' "$out/$name.$pass.txt" | cut -d'|' -f2-5
        done
    done
    ;;
*)
    echo "usage: $0 pack NAME | run NAME [NAME ...]" >&2
    exit 2
    ;;
esac
