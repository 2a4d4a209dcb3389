#!/usr/bin/env bash
# Builds and runs every example at its default (tiny) size: one per tutorial chapter in
# examples/, and the example of switchyard-schedule. Examples whose name contains "mpi"
# need mpirun and are skipped. Each example checks what it demonstrates and exits
# non-zero if something is wrong; this script stops at the first failure.
#
#   scripts/run-examples.sh              # release build
#   scripts/run-examples.sh --debug      # the dev profile
#   scripts/run-examples.sh --no-build   # the release examples already built (what CI
#                                        # runs, after its one release build)
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
flag=--release
build=1
case "${1:-}" in
--debug)
    profile=debug
    flag=
    ;;
--no-build) build=0 ;;
"") ;;
*)
    echo "usage: scripts/run-examples.sh [--debug | --no-build]" >&2
    exit 2
    ;;
esac

if [[ $build == 1 ]]; then
    echo "== build (${profile})"
    # shellcheck disable=SC2086
    cargo build $flag --examples
    # shellcheck disable=SC2086
    cargo build $flag -p switchyard-schedule --example schedule
fi

target="${CARGO_TARGET_DIR:-target}/${profile}/examples"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

run() {
    local name="$1"
    shift
    local start ms
    start=$(date +%s%N)
    if ! "$target/$name" "$@" >"$out/$name.log" 2>&1; then
        cat "$out/$name.log"
        echo "FAILED: example $name" >&2
        exit 1
    fi
    ms=$((($(date +%s%N) - start) / 1000000))
    printf '%-18s ok  %3d.%02d s\n' "$name" $((ms / 1000)) $((ms % 1000 / 10))
}

echo "== run"
for src in examples/*.rs; do
    name="$(basename "$src" .rs)"
    if [[ "$name" == *mpi* ]]; then
        echo "$name: skipped (needs mpirun)"
        continue
    fi
    run "$name"
done
run schedule --kind zb-h1 --stages 4 --microbatches 8
echo "== all examples passed"
