#!/usr/bin/env bash
# A/B timing of kernel changes on the H200, in two steps like scripts/gpu_bench.sh (and a profile of one kernel, step 3
# below). Each build of the tree is packed
# under a name; the H200 then runs `gpu_bench --iters 100 --nodes` for every named build, twice, interleaved (A B A B),
# and prints each run's replay times; the full outputs (per-node times in plan order) go to $OUT/NAME.PASS.txt.
#
#   1. Here, once per version of the kernels:   bash scripts/gpu_ab.sh pack NAME
#      runs the launch specs' unit tests, then builds the release example gpu_bench and compiles the kernels into
#      their own cubin cache, the binary and the cubins into
#      gpu-ab/NAME.tar.xz (gpu-ab/ is ignored by git through info/exclude; about 1.6 MB per build). In a worktree of
#      another commit (git worktree add), copy its gpu-ab/NAME.tar.xz into this tree's gpu-ab/ to run both.
#   2. On the H200, through the device `run` tool, with carry ["gpu-ab"]:
#                                                bash scripts/gpu_ab.sh run NAME[:MODE] [NAME[:MODE] ...]
#      (the tree, about 61 MiB, plus what travels must stay under the device copy limit of 64 MiB: one build of 2.1 MB
#      fits a call. For two, carry the first alone with `bash scripts/gpu_ab.sh stage NAME`, which unpacks it under
#      /tmp there, then the second with the run, on the same warm machine: `run` unpacks only builds not there yet,
#      so a build staged earlier must not be repacked under its name in between.) NAME:MODE runs
#      build NAME with FLASHPLAN_AB=MODE, for a temporary switch in the code that picks between variants of one
#      build (read it with std::env::var("FLASHPLAN_AB") and remove it before the commit); its outputs go to
#      $OUT/NAME-MODE.PASS.txt. GPU_AB_ARGS adds gpu_bench arguments to every run (e.g. "--streams" for the
#      stream-count table, "--windows" for the 12-row window, "--in-context" for every node's cost in its own graph at
#      1 and 16 rows, in the output files); the lines printed are every variant row of the tables and lone-w1's
#      kernel node count.
#   3. On the H200, what one kernel does (Nsight Compute, which the H200 machine has at /usr/local/cuda/bin/ncu):
#                                                bash scripts/gpu_ab.sh ncu NAME[:MODE] KERNEL_REGEX
#      profiles one launch, the first of the entry points matching KERNEL_REGEX after NCU_SKIP of them (the variants
#      run in plan order, lone-w1 first), in `gpu_bench --iters 3` (GPU_AB_ARGS is not used): speed of light, memory
#      workload, warp states, occupancy and launch statistics into $OUT/NAME[-MODE].ncu.txt; printed: the metric rows
#      and the stall reasons ncu names. Under ncu the SM clock is locked to its base (1.46 GHz on the H200) and the
#      caches are flushed before the launch: durations are longer than in a replay.
#      NCU_GRID=BLOCKS picks the launch by its grid instead: a first pass records the grid size (blocks) of the first
#      NCU_SCAN (default 600) launches of the matching entry points, and the profile is of the first with BLOCKS
#      blocks after NCU_SKIP of those (e.g. the routed gate/up of 16 rows, not of 8). NCU_SOURCE=1 adds the
#      per-instruction counters (SourceCounters, InstructionStats) and writes the SASS source page as CSV to
#      $OUT/NAME[-MODE].sass.csv (columns include "Instructions Executed" and "Warp Stall Sampling").
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-ab-out}"

# build ARG: from NAME[:MODE], sets name, mode (empty without one) and tag (NAME or NAME-MODE), and unpacks build NAME
# under /tmp once.
build() {
    name="${1%%:*}"
    mode=""
    [ "$1" != "$name" ] && mode="${1#*:}"
    tag="$name${mode:+-$mode}"
    [ -d "/tmp/$name" ] || tar xJf "gpu-ab/$name.tar.xz" -C /tmp
}

mode="${1:-}"
shift || true
case "$mode" in
pack)
    name="${1:?usage: $0 pack NAME}"
    eval "$(bash scripts/setup_nvrtc.sh)"
    # The launch specs' unit tests first (a second or two once built): a launch limit that no longer matches its
    # kernel's defines makes a change silently not apply, which the device time would only show as no difference.
    cargo test --release -q -p flashplan-runtime --lib cuda::launch
    cargo build --release -q --example gpu_bench
    tmp=$(mktemp -d)
    mkdir -p "$tmp/$name/kernels"
    FLASHPLAN_KERNEL_CACHE="$tmp/$name/kernels" cargo test --release -q -p flashplan-compiler --lib \
        nvrtc::tests::kernels_compile_for_sm_90a >/dev/null
    cp "${CARGO_TARGET_DIR:-target}/release/examples/gpu_bench" "$tmp/$name/gpu-bench"
    strip "$tmp/$name/gpu-bench"
    exclude="$(git rev-parse --git-path info/exclude)" # .git is a file in a worktree
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/gpu-ab/" "$exclude" 2>/dev/null || echo "/gpu-ab/" >>"$exclude"
    mkdir -p gpu-ab
    tar cf - -C "$tmp" "$name" | xz -9 >"gpu-ab/$name.tar.xz"
    rm -rf "$tmp"
    du -sh "gpu-ab/$name.tar.xz"
    echo "now: run(command='bash scripts/gpu_ab.sh run A B', carry=['gpu-ab'])"
    ;;
stage)
    [ "$#" -ge 1 ] || { echo "usage: $0 stage NAME [NAME ...]" >&2; exit 2; }
    for arg in "$@"; do
        rm -rf "/tmp/${arg%%:*}"
        build "$arg"
        echo "staged /tmp/$name"
    done
    ;;
run)
    [ "$#" -ge 1 ] || { echo "usage: $0 run NAME[:MODE] [NAME[:MODE] ...]" >&2; exit 2; }
    mkdir -p "$out"
    for arg in "$@"; do build "$arg"; done
    for pass in 1 2; do
        for arg in "$@"; do
            build "$arg"
            if ! env ${mode:+"FLASHPLAN_AB=$mode"} FLASHPLAN_KERNEL_CACHE="/tmp/$name/kernels" "/tmp/$name/gpu-bench" \
                --iters 100 --nodes ${GPU_AB_ARGS:-} >"$out/$tag.$pass.txt" 2>&1; then
                echo "$tag failed:" >&2
                tail -5 "$out/$tag.$pass.txt" >&2
                exit 1
            fi
            echo "== $tag, pass $pass (variant | rows | time/replay us | sum of nodes us)"
            grep -E '^\| (lone-w|[0-9]+ \| (lone|verify)-)' "$out/$tag.$pass.txt" | cut -d'|' -f2-5
            # The one-row graph's kernel nodes: a launch change that did not apply shows here as the same count.
            grep -E '^graph lone-w1:' "$out/$tag.$pass.txt" || true
        done
    done
    ;;
ncu)
    [ "$#" -eq 2 ] || { echo "usage: $0 ncu NAME[:MODE] KERNEL_REGEX" >&2; exit 2; }
    mkdir -p "$out"
    build "$1"
    ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
    run_ncu() { env ${mode:+"FLASHPLAN_AB=$mode"} FLASHPLAN_KERNEL_CACHE="/tmp/$name/kernels" "$ncu" "$@"; }
    skip="${NCU_SKIP:-0}"
    if [ -n "${NCU_GRID:-}" ]; then
        run_ncu --kernel-name "regex:$2" --launch-count "${NCU_SCAN:-600}" --metrics launch__grid_size --csv \
            "/tmp/$name/gpu-bench" --iters 3 >"$out/$tag.scan.csv" 2>"$out/$tag.scan.err" || {
            tail -20 "$out/$tag.scan.err" >&2
            exit 1
        }
        # The launch index among the matching launches (ncu's ID counts only those it profiled).
        skip=$(python3 - "$out/$tag.scan.csv" "$NCU_GRID" "$skip" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
        if r.get("Metric Name") == "launch__grid_size"]
hits = [i for i, r in enumerate(rows) if r["Metric Value"].replace(",", "") == sys.argv[2]]
k = int(sys.argv[3])
if len(hits) <= k:
    sys.exit(f"{len(hits)} of the {len(rows)} launches scanned have {sys.argv[2]} blocks; NCU_SKIP is {k}")
print(hits[k])
PY
) || exit 1
        echo "NCU_GRID=$NCU_GRID: launch $skip of the matching entry points"
    fi
    sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
        --section LaunchStats)
    [ -n "${NCU_SOURCE:-}" ] && sections+=(--section SourceCounters --section InstructionStats -o "$out/$tag" -f)
    run_ncu --kernel-name "regex:$2" --launch-skip "$skip" --launch-count 1 "${sections[@]}" \
        "/tmp/$name/gpu-bench" --iters 3 >"$out/$tag.ncu.txt" 2>&1 || {
        tail -20 "$out/$tag.ncu.txt" >&2
        exit 1
    }
    if [ -n "${NCU_SOURCE:-}" ]; then
        "$ncu" -i "$out/$tag.ncu-rep" --page details >"$out/$tag.ncu.txt" 2>&1
        "$ncu" -i "$out/$tag.ncu-rep" --page source --print-source sass --csv >"$out/$tag.sass.csv" 2>&1
        rm -f "$out/$tag.ncu-rep"
    fi
    rows='^  [A-Za-z]|^    [A-Z][A-Za-z0-9 ./()#-]+ {2,}|stalled'
    grep -E "$rows" "$out/$tag.ncu.txt" | grep -vE '^    (OPT|INF|WRN) ' || {
        echo "no metric rows in $out/$tag.ncu.txt (no launch of a kernel matching $2?)" >&2
        exit 1
    }
    ;;
*)
    echo "usage: $0 pack NAME | stage NAME [NAME ...] | run NAME[:MODE] [NAME[:MODE] ...] | ncu NAME[:MODE] KERNEL_REGEX" >&2
    exit 2
    ;;
esac
