#!/usr/bin/env bash
# Rebuilds the committed plans with the release compiler and checks they are byte-identical to plans/, then
# inspects them. `--update` rewrites plans/ instead of checking.
#   scripts/check_plans.sh            # CI: fail if plans/ is stale
#   scripts/check_plans.sh --update   # after a change to the compiler or the plan format
set -euo pipefail
cd "$(dirname "$0")/.."

update=0
case "${1:-}" in
  --update) update=1 ;;
  "") ;;
  *) echo "usage: $0 [--update]" >&2; exit 2 ;;
esac

cargo build --release --quiet -p flashplan-compiler --bin flashplan-compile --bin flashplan-plans
target_dir="${CARGO_TARGET_DIR:-target}"
compile="$target_dir/release/flashplan-compile"
plans="$target_dir/release/flashplan-plans"

# name | config | extra options (keep in sync with docs/plans.md)
targets=(
  "flash-next|configs/flash-next.json|"
  "flashnext-tiny|configs/flashnext-tiny.json|--context 4096"
)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stale=0
for t in "${targets[@]}"; do
  IFS='|' read -r name config opts <<<"$t"
  # shellcheck disable=SC2086
  "$compile" --config "$config" --arch cpu --out "$tmp/$name" $opts
  if [[ $update == 1 ]]; then
    mkdir -p "plans/$name"
    cp "$tmp/$name/plans.fplan" "plans/$name/plans.fplan"
    echo "updated plans/$name/plans.fplan"
  elif ! cmp "$tmp/$name/plans.fplan" "plans/$name/plans.fplan"; then
    echo "plans/$name/plans.fplan differs from a fresh compile of $config" >&2
    stale=1
  fi
done
if [[ $stale == 1 ]]; then
  echo "plans/ is stale: rerun scripts/check_plans.sh --update" >&2
  exit 1
fi

for t in "${targets[@]}"; do
  IFS='|' read -r name _ _ <<<"$t"
  echo
  echo "== plans/$name"
  "$plans" inspect "plans/$name"
done
