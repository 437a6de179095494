#!/usr/bin/env bash
# Medium checkpoint against transformers (issue 4, item 4) in two steps, like scripts/gpu_check.sh: the H200 machine
# has no Rust toolchain, no network and transformers 5.17, so the Rust binary, the cubins and a slimmed copy of the
# pinned transformers 5.23.0 travel from here.
#
#   1. Here:            bash scripts/medium_check.sh build
#      medium-bin/ (ignored through .git/info/exclude): medium-check.xz (the release example medium_check, stripped
#      and xz-compressed), kernels/*.cubin.xz (the sm_90a cubin cache; needs NVRTC: scripts/setup_nvrtc.sh) and
#      transformers.tar.xz (`pip install --no-deps --target` of the wheel, less every transformers/models/* but
#      auto and qwen4_exp and less the training, pipeline, export and CLI code; checked here to import
#      Qwen4ExpForCausalLM as 5.23.0 from the slim copy alone, where transformers' dependencies are installed, else
#      on the H200 by the run). Wheel: $TRANSFORMERS_WHEEL or
#      /work/wheels/transformers-5.23.0-py3-none-any.whl.
#   2. On the H200, through the device `run` tool, with carry ["medium-bin"]:
#                       bash scripts/medium_check.sh run [all|python|rust] [-- medium_check.py args]
#      all (default): python then rust. python: unpack transformers, build the checkpoint and transformers' f32
#      logits into medium-ckpt/ (scripts/medium_check.py, on the GPU). rust: the comparison (examples/medium_check.rs,
#      CUDA backend) on medium-ckpt/, printing the table (also $OUT/medium-check.md and $OUT/medium-check.log).
#
# The working tree plus the carried files must stay under the device copy limit (64 MiB); `build` prints the size.
# When medium-bin/ does not fit in one call, split it: `bash scripts/medium_check.sh split` moves the transformers
# bundle into medium-tf/; carry ["medium-tf"] with `run python`, then (the machine still warm, so medium-tf/ and
# medium-ckpt/ are still there) carry ["medium-bin"] with `run rust`. `run` finds each piece in medium-bin/ or
# medium-tf/.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-build}"
shift || true
exclude() { [ -d .git ] || return 0; grep -qxF "$1" .git/info/exclude 2>/dev/null || echo "$1" >>.git/info/exclude; }
unxz_to() { # xz-decompress $1 into $2 (Python's lzma: no xz binary needed there)
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
}
piece() { # the first of medium-bin/$1, medium-tf/$1 that exists
    for d in medium-bin medium-tf; do
        if [ -e "$d/$1" ]; then
            echo "$d/$1"
            return
        fi
    done
    echo "missing: $1 (in medium-bin/ or medium-tf/)" >&2
    return 1
}
case "$mode" in
build)
    exclude '/medium-bin/'
    exclude '/medium-tf/'
    exclude '/medium-ckpt/'
    if ! ldconfig -p 2>/dev/null | grep -q libnvrtc.so.13 && [[ "${LD_LIBRARY_PATH:-}" != *cu13* ]]; then
        eval "$(bash scripts/setup_nvrtc.sh)"
    fi
    rm -rf medium-bin medium-tf && mkdir -p medium-bin/kernels
    cargo build --release --example medium_check
    cp "${CARGO_TARGET_DIR:-target}/release/examples/medium_check" medium-bin/medium-check
    strip medium-bin/medium-check
    xz -9e -T1 medium-bin/medium-check
    FLASHPLAN_KERNEL_CACHE="$PWD/medium-bin/kernels" cargo test --release -q -p flashplan-compiler --lib \
        nvrtc::tests::kernels_compile_for_sm_90a >/dev/null
    ls medium-bin/kernels/*.cubin >/dev/null
    xz -9e -T1 medium-bin/kernels/*.cubin
    # The pinned transformers, slimmed.
    wheel="${TRANSFORMERS_WHEEL:-/work/wheels/transformers-5.23.0-py3-none-any.whl}"
    tmp=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-compile --target "$tmp/tf" "$wheel" 2>&1 | grep -v 'as the .root. user' || true
    (
        cd "$tmp/tf"
        rm -rf bin ./*.dist-info/RECORD
        find transformers/models -mindepth 1 -maxdepth 1 -type d ! -name auto ! -name qwen4_exp -exec rm -rf {} +
        rm -f transformers/models/qwen4_exp/modular_qwen4_exp.py
        rm -rf transformers/pipelines transformers/exporters transformers/cli transformers/commands \
            transformers/data transformers/sagemaker transformers/trainer.py transformers/trainer_*.py \
            transformers/testing_utils.py transformers/training_args*.py
        find . -name __pycache__ -prune -exec rm -rf {} +
    )
    # Import check from the slim copy alone (site-packages' own transformers must not be the one found). A module that
    # is not transformers' own (torch, numpy, ...: its dependencies) missing here skips it with a message, and the
    # H200's run, which imports the same slim copy first (scripts/medium_check.py), checks it there; a module of
    # transformers missing from the slim copy fails the build.
    rc=0
    python3 - "$tmp/tf" <<'EOF' || rc=$?
import os, sys
sys.path.insert(0, sys.argv[1])
try:
    import transformers
    assert transformers.__version__ == "5.23.0", transformers.__version__
    assert transformers.__file__.startswith(sys.argv[1]), transformers.__file__
    from transformers import DynamicCache, Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: F401
    from transformers.models.qwen4_exp import modeling_qwen4_exp  # noqa: F401
except ModuleNotFoundError as e:
    if e.name and not e.name.startswith("transformers"):
        print(f"slim transformers: import check skipped here ({e.name} is not installed for {sys.executable}); "
              "the H200 run imports it", file=sys.stderr)
        sys.exit(3)
    raise
print("slim transformers imports:", transformers.__version__, os.path.dirname(transformers.__file__))
EOF
    [ "$rc" = 0 ] || [ "$rc" = 3 ] || exit "$rc"
    tar -C "$tmp/tf" -cf - . | xz -9e -T1 >medium-bin/transformers.tar.xz
    rm -rf "$tmp"
    du -ab medium-bin | sort -n | tail -4
    tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    carried=$(du -sb medium-bin | cut -f1)
    echo "tracked tree $((tracked / 1024)) KiB + medium-bin $((carried / 1024)) KiB = $(((tracked + carried) / 1048576)) MiB of the 64 MiB copy limit (untracked files not ignored count too)"
    echo "now: run(command='bash scripts/medium_check.sh run', carry=['medium-bin'])"
    ;;
split)
    mkdir -p medium-tf
    mv medium-bin/transformers.tar.xz medium-tf/
    du -sh medium-bin medium-tf
    echo "now: run(command='bash scripts/medium_check.sh run python', carry=['medium-tf']),"
    echo "then run(command='bash scripts/medium_check.sh run rust', carry=['medium-bin'])"
    ;;
run)
    which="${1:-all}"
    shift || true
    [ "${1:-}" = "--" ] && shift
    ckpt="${MEDIUM_DIR:-$PWD/medium-ckpt}"
    log=/tmp/medium-check.log
    : >>"$log"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$log" || true
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)" | tee -a "$log"
    rc=0
    if [ "$which" = all ] || [ "$which" = python ]; then
        tf=/tmp/medium-transformers
        rm -rf "$tf" && mkdir -p "$tf"
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
            "$(piece transformers.tar.xz)" "$tf"
        rm -rf "$ckpt"
        set +e
        python3 scripts/medium_check.py --out "$ckpt" --transformers "$tf" "$@" 2>&1 |
            grep -v 'falling back to its reference PyTorch' | tee -a "$log"
        rc=${PIPESTATUS[0]}
        set -e
        [ "$rc" -ne 0 ] && { [ -n "${OUT:-}" ] && cp "$log" "$OUT/"; exit "$rc"; }
    fi
    if [ "$which" = all ] || [ "$which" = rust ]; then
        kc=/tmp/flashplan-kernels
        rm -rf "$kc" && mkdir -p "$kc"
        kdir=$(piece kernels)
        for f in "$kdir"/*; do
            case "$f" in
            *.xz) unxz_to "$f" "$kc/$(basename "${f%.xz}")" ;;
            *) cp "$f" "$kc/" ;;
            esac
        done
        unxz_to "$(piece medium-check.xz)" /tmp/medium-check && chmod +x /tmp/medium-check
        set +e
        FLASHPLAN_KERNEL_CACHE="$kc" /tmp/medium-check "$ckpt" --backend "${MEDIUM_BACKEND:-cuda}" --out /tmp/medium-check.md 2>&1 |
            tee -a "$log"
        rc=${PIPESTATUS[0]}
        set -e
        if [ -n "${OUT:-}" ]; then
            cp "$log" "$OUT/"
            [ -f /tmp/medium-check.md ] && cp /tmp/medium-check.md "$OUT/"
            cp "$ckpt/expected.json" "$OUT/medium-expected.json" 2>/dev/null || true
        fi
    fi
    exit "$rc"
    ;;
*)
    echo "usage: $0 build|split|run [all|python|rust] [-- medium_check.py args]" >&2
    exit 2
    ;;
esac
