#!/usr/bin/env bash
# GPU checks in two steps (the H200 machine has no Rust toolchain and no network).
#
#   1. Here:            bash scripts/gpu_check.sh build
#      builds the release GPU test binary, strips it into gpu-bin/ (ignored by git through the repository's
#      info/exclude, also from a worktree) and compiles the kernels into the cubin cache gpu-bin/kernels (needs NVRTC:
#      scripts/setup_nvrtc.sh).
#   2. On the H200, through the device `run` tool, one test binary per call, in this order on the same warm machine
#      (the tree, about 61 MiB, plus what travels must stay under the device copy limit of 64 MiB; build makes one xz
#      archive per binary, and only the first carries the cubins, which stay in the ignored gpu-bin/ there):
#        carry ["gpu-pack-gpu"]:         tar xJf gpu-pack-gpu/gpu.tar.xz && bash scripts/gpu_check.sh run gpu
#        carry ["gpu-pack-gpu_rounds"]:  tar xJf gpu-pack-gpu_rounds/gpu_rounds.tar.xz && bash scripts/gpu_check.sh run rounds
#      (run all: tests/gpu.rs then tests/gpu_rounds.rs, when both binaries are in gpu-bin/)
#      runs the checks and prints the table (also written to $OUT/gpu-checks.md when $OUT is set). A run whose cubins
#      are not all there (a machine that went cold after the first call, or another build's) stops and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-build}"

# ignore PATTERN: PATTERN added once to the repository's info/exclude (asked of git: .git is a file in a worktree).
# Only the steps run here call it; the device's copy of the tree need not be a git repository.
ignore() {
    local exclude
    exclude="$(git rev-parse --git-path info/exclude)"
    grep -qxF "$1" "$exclude" 2>/dev/null || echo "$1" >>"$exclude"
}

# pack DIR ARCHIVE NAME...: DIR/ARCHIVE, one xz archive of gpu-bin/build-root, gpu-bin/kernels.list (the build's
# cubin names), the named gzipped binaries of gpu-bin/ (uncompressed, executable) and, unless PACK_KERNELS=0, the
# cubins (xz of the raw files is about half the gzipped size); DIR is ignored by git through the repository's
# info/exclude. Used here and by scripts/gpu_bench.sh.
pack() {
    local dir="$1" archive="$2" tmp
    shift 2
    ignore "/$dir/"
    tmp=$(mktemp -d)
    mkdir -p "$tmp/gpu-bin/kernels"
    cp gpu-bin/build-root gpu-bin/kernels.list "$tmp/gpu-bin/"
    for f in "$@"; do
        gunzip -c "gpu-bin/$f.gz" >"$tmp/gpu-bin/$f"
        chmod +x "$tmp/gpu-bin/$f"
    done
    if [ "${PACK_KERNELS:-1}" != 0 ]; then
        for f in gpu-bin/kernels/*.gz; do gunzip -c "$f" >"$tmp/gpu-bin/kernels/$(basename "${f%.gz}")"; done
    fi
    rm -rf "$dir" && mkdir -p "$dir"
    tar cf - -C "$tmp" gpu-bin | xz -9e >"$dir/$archive"
    rm -rf "$tmp"
}

# unpack_kernels: the cubin cache of gpu-bin/kernels (gzipped or not) in /tmp/flashplan-kernels, its path printed;
# fails, naming what is missing, unless every cubin of gpu-bin/kernels.list (the build's) is there.
unpack_kernels() {
    local kc=/tmp/flashplan-kernels f missing=()
    if [ -f gpu-bin/kernels.list ]; then
        while read -r f; do
            [ -e "gpu-bin/kernels/$f" ] || [ -e "gpu-bin/kernels/$f.gz" ] || missing+=("$f")
        done <gpu-bin/kernels.list
    fi
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "gpu-bin/kernels lacks this build's cubins (${missing[*]}): unpack the build's archive that carries them" \
            "(gpu-pack-gpu/gpu.tar.xz, or gpu-pack/gpu-bin.tar.xz) on this machine first" >&2
        return 1
    fi
    rm -rf "$kc" && mkdir -p "$kc"
    for f in gpu-bin/kernels/*; do
        case "$f" in
        *.gz) gunzip -c "$f" >"$kc/$(basename "${f%.gz}")" ;;
        *) cp "$f" "$kc/" ;;
        esac
    done
    echo "$kc"
}

case "$mode" in
pack)
    shift
    pack "$@"
    ;;
unpack-kernels)
    unpack_kernels
    ;;
build)
    ignore '/gpu-bin/'
    if ! ldconfig -p 2>/dev/null | grep -q libnvrtc.so.13 && [[ "${LD_LIBRARY_PATH:-}" != *cu13* ]]; then
        eval "$(bash scripts/setup_nvrtc.sh)"
    fi
    rm -rf gpu-bin && mkdir -p gpu-bin/kernels
    # Test binaries: gpu (backend vs CPU, issue 4) and gpu_rounds (rounds and streams on the tiny model, issues 5
    # and 6), stripped and gzipped (the working tree plus gpu-bin must stay under the device copy limit).
    for t in gpu gpu_rounds; do
        exe=$(cargo test --release --test "$t" --no-run --message-format=json 2>/dev/null |
            T="$t" python3 -c 'import os, sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == os.environ["T"]:
        print(m["executable"])')
        cp "$exe" "gpu-bin/$t-test"
        strip "gpu-bin/$t-test"
        gzip -9 "gpu-bin/$t-test"
    done
    FLASHPLAN_KERNEL_CACHE="$PWD/gpu-bin/kernels" cargo test --release -q -p flashplan-compiler --lib \
        nvrtc::tests::kernels_compile_for_sm_90a >/dev/null
    ls gpu-bin/kernels/*.cubin >/dev/null
    (cd gpu-bin/kernels && ls -- *.cubin) >gpu-bin/kernels.list
    gzip -9 gpu-bin/kernels/*.cubin
    pwd >gpu-bin/build-root
    du -sh gpu-bin
    # gpu-bin/ with both binaries is larger than the device copy limit allows beside the tree: one xz archive per
    # test binary travels instead, gpu-pack-<test>/<test>.tar.xz, the cubins only with the first (gpu).
    pack gpu-pack-gpu gpu.tar.xz gpu-test
    PACK_KERNELS=0 pack gpu-pack-gpu_rounds gpu_rounds.tar.xz gpu_rounds-test
    du -sh gpu-pack-gpu gpu-pack-gpu_rounds
    echo "now: run(command='tar xJf gpu-pack-gpu/gpu.tar.xz && bash scripts/gpu_check.sh run gpu', carry=['gpu-pack-gpu'])"
    echo "and: run(command='tar xJf gpu-pack-gpu_rounds/gpu_rounds.tar.xz && bash scripts/gpu_check.sh run rounds', carry=['gpu-pack-gpu_rounds'])"
    ;;
run)
    # The test binary finds the fixtures at the path it was built in.
    built=$(cat gpu-bin/build-root 2>/dev/null || true)
    if [ -n "$built" ] && [ ! -e "$built/fixtures" ]; then
        mkdir -p "$(dirname "$built")"
        ln -s "$PWD" "$built"
    fi
    # The cubin cache travels compressed: unpack it where the tests read it.
    kc=$(unpack_kernels) || exit 1
    export FLASHPLAN_GPU=1 FLASHPLAN_KERNEL_CACHE="$kc"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    # Which checks: all (default), gpu (issue 4) or rounds (issues 5 and 6).
    which="${2:-all}"
    tests=()
    case "$which" in
    all) tests=(gpu gpu_rounds) ;;
    gpu) tests=(gpu) ;;
    rounds) tests=(gpu_rounds) ;;
    *) echo "usage: $0 run [all|gpu|rounds]" >&2; exit 2 ;;
    esac
    set +e
    rc=0
    : >/tmp/gpu-test.log
    for t in "${tests[@]}"; do
        if [ -f "gpu-bin/$t-test.gz" ]; then
            gunzip -c "gpu-bin/$t-test.gz" >"/tmp/$t-test" && chmod +x "/tmp/$t-test"
        else
            cp "gpu-bin/$t-test" "/tmp/$t-test" && chmod +x "/tmp/$t-test"
        fi
        echo "== $t" | tee -a /tmp/gpu-test.log
        "/tmp/$t-test" --nocapture --test-threads=1 2>&1 | tee -a /tmp/gpu-test.log
        r=${PIPESTATUS[0]}
        [ "$r" -ne 0 ] && rc=$r
    done
    set -e
    { echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"; grep -E '^\||^GPU:|^copy prompt|^== ' /tmp/gpu-test.log; } >/tmp/gpu-checks.md
    if [ -n "${OUT:-}" ]; then cp /tmp/gpu-checks.md /tmp/gpu-test.log "$OUT/"; fi
    exit "$rc"
    ;;
*)
    echo "usage: $0 build|run [all|gpu|rounds]|pack DIR ARCHIVE NAME...|unpack-kernels" >&2
    exit 2
    ;;
esac
