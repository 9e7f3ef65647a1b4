#!/usr/bin/env bash
# tsan.sh — the scheduler tests under ThreadSanitizer; fails on any report.
#
# Builds ferry in its own build directory with -Dtsan=true (which adds -fsanitize=thread
# to every C file and link) and runs, with halt_on_error so the first report stops a
# test:
#   1. tests/test_scheduler (every test; the executor's lane threads, pools, the trace);
#   2. test_offload's invariance test on irregular plans (--filter 'offload/irregular*'),
#      where the trainer's step graph runs on the scheduler: it must still give
#      bit-identical results with no report; and its failure tests (--filter
#      'failure/*'), where a failing task cancels steps while the other lanes run on.
#      Skipped with FERRY_TSAN_SCHED_ONLY=1;
#   3. test_llama_model's gathered embedding, chunked head and tied table (--filter
#      'llama_model/a_gathered*', 'a_chunked*', 'a_tied_table*'): the load, fetch and
#      gradient-copy lanes share the gathered rows; the chunk tasks share the head's slots;
#      and test_offload's speculative updates ('speculate/exact_in_fp32'): a commit swaps
#      a block's buffers on the cpu lane while the other lanes run; test_io's outfile
#      ('outfile/*': the ring between the caller and the writer thread) and model saves
#      ('model_save/*': blocks fetched on the caller's thread while the save's thread
#      writes, failures on either side);
#   4. the ferry binary training with checkpoints written in the background (a writer
#      thread beside the lanes, stream workers and the Adam pool), stopped by SIGTERM
#      and resumed (also skipped with FERRY_TSAN_SCHED_ONLY=1).
#   5. a data-parallel job of two ranks under mpirun (where it is), Open MPI's own
#      libraries' reports suppressed (they are not built with ThreadSanitizer).
# Reports are also written to files (log_path) and the run fails if any exists, so a
# report from a forked Criterion worker cannot be lost in its output.
#
# Usage: scripts/tsan.sh [BUILD_DIR]   (default /tmp/build-tsan; reused when present)
# Non-interactive, for CI; on 2 cores about a minute to build from scratch and well
# under a minute for the tests. Never point it at the project's normal build directory.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-/tmp/build-tsan}
jobs=${FERRY_TSAN_JOBS:-2}

case "$(cd "$(dirname "$build")" 2>/dev/null && pwd)/$(basename "$build")" in
    "$root/build") echo "tsan.sh: refusing to use $root/build (give another directory)" >&2; exit 2 ;;
esac

mkdir -p "$build"
if [ -f "$build/build.ninja" ]; then
    setup=(meson configure "$build" -Dtsan=true -Dbuildtype=debugoptimized)
else
    setup=(meson setup "$build" "$root" -Dtsan=true -Dbuildtype=debugoptimized)
fi
if ! "${setup[@]}" >"$build/tsan-setup.log" 2>&1; then
    tail -n 40 "$build/tsan-setup.log" >&2
    echo "tsan.sh: meson setup failed" >&2
    exit 1
fi
targets=(test_scheduler)
[ "${FERRY_TSAN_SCHED_ONLY:-0}" = 1 ] || targets+=(test_offload test_llama_model test_io ferry)
if ! meson compile -C "$build" -j "$jobs" "${targets[@]}" >"$build/tsan-build.log" 2>&1; then
    tail -n 40 "$build/tsan-build.log" >&2
    echo "tsan.sh: build failed (full log: $build/tsan-build.log)" >&2
    exit 1
fi

# Criterion cannot start under ThreadSanitizer as it is (Criterion issue #274, "Could
# not initialize inheritable arena"): BoxFort maps its arena with MAP_FIXED at a random
# address in [0x200000000000, 0x600000000000), nearly all of which ThreadSanitizer keeps
# for its shadow memory. rand_r() is the only randomness that choice uses (BoxFort:
# base = 0x200000000000 + ((r & 0x3fffff) << 24)), so a preloaded rand_r() whose draws
# land in ThreadSanitizer's middle application range, 0x550000000000-0x568000000000,
# lets it start. Nothing else these tests run calls rand_r().
shim="$build/tsan-criterion-rand.so"
cat >"$build/tsan-criterion-rand.c" <<'SHIM'
int rand_r(unsigned *seed) {
    *seed = *seed * 1103515245u + 12345u;
    return 0x350000 + (int)((*seed >> 8) % 0x18000u);
}
SHIM
cc -shared -fPIC -O1 -o "$shim" "$build/tsan-criterion-rand.c"

logdir=$(mktemp -d /tmp/ferry-tsan-logs.XXXXXX)
trap 'rm -rf "$logdir"' EXIT
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 exitcode=66 log_path=$logdir/report"
# libgomp is not built with ThreadSanitizer: it cannot see OpenMP's barriers and would
# report false races between the threads of every parallel region. A thread limit of 1
# runs each region on the thread that enters it, so all else (lane threads, stream
# workers, the Adam pool, and the kernels themselves) is checked without false reports.
export OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1
export FERRY_FIXTURES="$root/tests/fixtures" FERRY_SHARED="$root/../shared"

status=0
run() { # name, command...
    local name=$1; shift
    local t0=$SECONDS
    if LD_PRELOAD="$shim${LD_PRELOAD:+:$LD_PRELOAD}" "$@" >"$logdir/$name.out" 2>&1; then
        # a filter that matches nothing must not pass
        if ! grep -Eq 'Synthesis: Tested: [1-9]' "$logdir/$name.out"; then
            echo "tsan.sh: $name ran no test" >&2
            tail -n 5 "$logdir/$name.out" >&2
            status=1
            return
        fi
        echo "tsan.sh: $name passed ($((SECONDS - t0)) s)"
    else
        echo "tsan.sh: $name FAILED ($((SECONDS - t0)) s)" >&2
        tail -n 40 "$logdir/$name.out" >&2
        status=1
    fi
}

# A timeout turns a hang into a failure; Criterion's own per-test timeouts are
# generous, so this one bounds the whole run.
run scheduler timeout 600 "$build/tests/test_scheduler" --jobs 1
if [ "${FERRY_TSAN_SCHED_ONLY:-0}" != 1 ]; then
    run offload-irregular timeout 600 "$build/tests/test_offload" --jobs 1 \
        --filter 'offload/irregular*'
    run offload-failure timeout 600 "$build/tests/test_offload" --jobs 1 --filter 'failure/*'
    run llama-gathered timeout 600 "$build/tests/test_llama_model" --jobs 1 \
        --filter 'llama_model/a_gathered*'
    run llama-chunked timeout 600 "$build/tests/test_llama_model" --jobs 1 \
        --filter 'llama_model/a_chunked*'
    run speculate timeout 600 "$build/tests/test_offload" --jobs 1 --filter 'speculate/exact_in_fp32'
    run llama-tied timeout 600 "$build/tests/test_llama_model" --jobs 1 \
        --filter 'llama_model/a_tied_table*'
    run outfile timeout 600 "$build/tests/test_io" --jobs 1 --filter 'outfile/*'
    run model-save timeout 600 "$build/tests/test_io" --jobs 1 --filter 'model_save/*'
fi

# a command that is not a Criterion suite: its exit status alone
run_cmd() { # name, command...
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$logdir/$name.out" 2>&1; then
        echo "tsan.sh: $name passed ($((SECONDS - t0)) s)"
    else
        echo "tsan.sh: $name FAILED ($((SECONDS - t0)) s)" >&2
        tail -n 40 "$logdir/$name.out" >&2
        status=1
    fi
}

if [ "${FERRY_TSAN_SCHED_ONLY:-0}" != 1 ]; then
    ck="$logdir/ckpt"
    small=(--model gpt2-tiny --batch 2 --seq 16 --device cpu --threads 1 --grad-accum 2
           --offload-optim 0.5 --checkpoint-dir "$ck" --checkpoint-every 2 --quiet)
    run_cmd checkpoints-background timeout 600 "$build/ferry" train "${small[@]}" --steps 9
    # stopped by SIGTERM while it trains (exit 143), then resumed to the end
    timeout 600 "$build/ferry" train "${small[@]}" --steps 400 --resume >"$logdir/term.out" 2>&1 &
    pid=$!
    sleep 3
    kill -TERM "$pid" 2>/dev/null || true
    if wait "$pid"; then code=0; else code=$?; fi
    if [ "$code" = 143 ] || [ "$code" = 0 ]; then
        echo "tsan.sh: checkpoints-sigterm passed (status $code)"
    else
        echo "tsan.sh: checkpoints-sigterm FAILED (status $code)" >&2
        tail -n 40 "$logdir/term.out" >&2
        status=1
    fi
    run_cmd checkpoints-resume timeout 600 "$build/ferry" train "${small[@]}" --steps 402 --resume
fi

# 5. a data-parallel job of two ranks (where mpirun is): the comm lane's reduce-scatters
#    and all-gathers beside the other lanes, the norm's collective on the cpu lane,
#    validation split over the ranks and checkpoints served by rank 1. Open MPI's own
#    libraries are not built with ThreadSanitizer: reports from inside them are
#    suppressed, ferry's are not.
if [ "${FERRY_TSAN_SCHED_ONLY:-0}" != 1 ] && command -v mpirun >/dev/null; then
    supp="$build/tsan-openmpi.supp"
    cat >"$supp" <<'SUPP'
called_from_lib:libmpi.so
called_from_lib:libopen-pal.so
called_from_lib:libopen-rte.so
race:libmpi.so
race:libopen-pal.so
race:libopen-rte.so
race:mca_
deadlock:mca_
deadlock:libopen-pal.so
mutex:mca_
mutex:libopen-pal.so
mutex:libmpi.so
SUPP
    run_cmd dp-job env TSAN_OPTIONS="$TSAN_OPTIONS suppressions=$supp" OMPI_ALLOW_RUN_AS_ROOT=1 \
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
        OMPI_MCA_btl_vader_single_copy_mechanism=none \
        timeout 600 mpirun -np 2 --oversubscribe -x TSAN_OPTIONS -x OMP_THREAD_LIMIT -x OMP_NUM_THREADS "$build/ferry" train \
        --model gpt2-tiny --batch 2 --seq 32 --device cpu --threads 1 --steps 4 --dtype bf16 \
        --offload-params 0.5 --offload-optim 1 --val-batches 2 --checkpoint-dir "$logdir/dpck" \
        --checkpoint-every 2 --save "$logdir/dp.safetensors" --quiet
fi

if compgen -G "$logdir/report*" >/dev/null; then
    echo "tsan.sh: ThreadSanitizer reports:" >&2
    for f in "$logdir"/report*; do cat "$f" >&2; done
    status=1
fi
[ "$status" = 0 ] && echo "tsan.sh: clean"
exit "$status"
