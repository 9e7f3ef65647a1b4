#!/usr/bin/env bash
# fuzz.sh — builds the libFuzzer targets in fuzz/ (clang, with AddressSanitizer and
# UBSan) and runs each for a bounded number of executions from its seed corpus
# (fuzz/corpus/<target>; what the run adds goes to a scratch copy, never the repository).
# Fails if any target finds a crash, a leak, a sanitizer report or a timeout; the input
# is left in the scratch directory, whose path is printed.
#
# Usage: scripts/fuzz.sh [BUILD_DIR] [TARGET...]   (default /tmp/build-fuzz; every target)
# RUNS (default 1000000) executions per target; MAX_LEN (default 4096) bytes per input.
# Needs clang and its libFuzzer runtime (Debian: clang, libclang-rt-dev or clang's own).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-/tmp/build-fuzz}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors plan profile tokens ckpt_state paths)
runs=${RUNS:-1000000}
max_len=${MAX_LEN:-4096}
case "$(cd "$(dirname "$build")" 2>/dev/null && pwd)/$(basename "$build")" in
    "$root/build") echo "fuzz.sh: refusing to use $root/build (give another directory)" >&2; exit 2 ;;
esac
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# a build directory without the fuzz targets (or none yet) is set up for them
if [ ! -f "$build/build.ninja" ] || ! grep -q 'fuzz_safetensors' "$build/build.ninja"; then
    rm -rf "$build"
    if ! CC=clang meson setup "$build" "$root" -Dfuzz=true -Dcuda=disabled \
        -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized >"$log" 2>&1; then
        cat "$log" >&2; echo "fuzz.sh: meson setup failed" >&2; exit 1
    fi
fi
if ! ninja -C "$build" $(printf 'fuzz/fuzz_%s ' "${targets[@]}") >"$log" 2>&1; then
    cat "$log" >&2; echo "fuzz.sh: the build failed" >&2; exit 1
fi
scratch=$(mktemp -d /tmp/ferry-fuzz.XXXXXX)
status=0
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t"
    cp "$root/fuzz/corpus/$t/"* "$scratch/$t/"
    start=$(date +%s)
    if UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 "$build/fuzz/fuzz_$t" -runs="$runs" \
        -max_len="$max_len" -timeout=10 -artifact_prefix="$scratch/$t-" "$scratch/$t" \
        > "$scratch/$t.log" 2>&1; then
        execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$scratch/$t.log" | grep -o '[0-9]*$' || true)
        [ -n "$execs" ] || execs=$(grep -Eo '#[0-9]+' "$scratch/$t.log" | tail -1 | tr -d '#')
        echo "fuzz.sh: $t: ${execs:-?} executions, $(( $(date +%s) - start )) s, clean ($(ls "$scratch/$t" | wc -l) inputs in the corpus)"
    else
        echo "fuzz.sh: $t: FAILED after $(( $(date +%s) - start )) s; log and input in $scratch" >&2
        tail -30 "$scratch/$t.log" >&2
        status=1
    fi
done
[ $status -eq 0 ] && rm -rf "$scratch"
exit $status
