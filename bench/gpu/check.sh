#!/usr/bin/env bash
# bench/gpu/check.sh — the GPU check, in one call on a machine with an NVIDIA GPU, or
# end to end on the emulated CUDA runtime (FERRY_CHECK_EMULATED=1 or --emulated; CI runs
# it so). Phases, in order of what a first GPU run most needs:
#   machine    nvidia-smi: the GPU, its power limit and memory, its dense bf16 peak
#   build      ferry and the CUDA tests (sm_90 only; emulated: -Dcuda=emulated, and the
#              emulated cuBLASLt and NCCL, which nothing links)
#   tests      test_cuda (kernels against the cpu backend, tiny models, the offload
#              invariance) and test_cuda_job (whole runs against cpu) where the build has it
#   bench      GPT-2 124M, B=8, T=1024, all-resident, bf16 storage (fp32 storage if bf16
#              fails): median step, tokens/s, MFU; the losses finite and falling
#   llama      llama-tiny (GQA, RoPE) on cuda and on the cpu backend, the same 10 steps:
#              every loss within 1e-4 relative in fp32 (exact fp32 GEMMs), 2e-2 in bf16
#              (test_cuda_job.c gives the reasons for both tolerances)
#   offload    GPT-2 124M with the optimizer on the CPU and half the parameters streamed,
#              traced: of the copy lanes' busy time, the fraction that overlaps compute
#   memcheck   compute-sanitizer memcheck over test_cuda's kernel suites (emulated: the
#              emulator checks every device access already; skipped with that reason)
#   racecheck  compute-sanitizer racecheck over them (emulated: FERRY_EMU_RACECHECK=1,
#              each kernel in three thread orders)
#   torch      PyTorch's GPT-2 of the same size, batch and dtype (torch_ref.py): the
#              ratio of ferry's tokens/s to it; skipped with the reason when no torch
#   probe      `ferry probe`: a measured profile of this GPU for the tuner
# Emulated, every phase runs on shapes the CPU trains in a minute (gpt2-tiny, llama-tiny,
# few steps) and nothing is judged on time: the point is that the script itself ran.
#
# One deadline for the whole check (FERRY_CHECK_DEADLINE seconds: 480 on a GPU, which
# fits one H200 lease with room to rerun; 600 emulated, twice what it takes on 2 cores,
# build included): each phase gets at most its own cap and never more than what is left,
# cut by `timeout`. $OUT/check.json is rewritten
# at the start and end of every phase (a phase cut off reads "running"), so a run killed
# from outside still returns what it found; $OUT/logs.tar.gz (every log, metrics file and
# trace) is refreshed with it. The device tool brings back at most 8 files: $OUT holds
# check.json, logs.tar.gz and profile.json, nothing else.
#
# Environment: OUT (default /tmp/ferry-check); FERRY_COMMIT (recorded; default git's
# HEAD where there is a .git); FERRY_CHECK_BUILD (a configured build directory to use as
# it is; default a fresh build-gpu, or build-emu reused when emulated);
# FERRY_CHECK_DEVICE=cpu runs the ferry phases on the cpu backend, a test of the script
# itself where there is neither a GPU nor an emulated build. Where the machine lacks
# ferry's libraries (OpenBLAS, cJSON, jemalloc, libnuma, Criterion), carry the .debs that
# bench/gpu/fetch-deps.sh downloads (.gpu-deps/): they are unpacked into a private root,
# nothing is installed.
#
# Usage: [FERRY_CHECK_EMULATED=1] bash bench/gpu/check.sh [--emulated]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
SRC=$PWD
EMU=${FERRY_CHECK_EMULATED:-0}
[ "${1:-}" = --emulated ] && EMU=1
[ "$EMU" = 1 ] || EMU=0
OUT=${OUT:-/tmp/ferry-check}
mkdir -p "$OUT"
rm -f "$OUT/check.json" "$OUT/logs.tar.gz" "$OUT/profile.json"
WORK=$(mktemp -d /tmp/ferry-check-work.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
FIG=$WORK/figures.tsv
DEV=${FERRY_CHECK_DEVICE:-cuda}
if [ "$EMU" = 1 ]; then DEADLINE=${FERRY_CHECK_DEADLINE:-600}; BUILD=${FERRY_CHECK_BUILD:-build-emu}
else DEADLINE=${FERRY_CHECK_DEADLINE:-480}; BUILD=${FERRY_CHECK_BUILD:-build-gpu}; fi
case $BUILD in /*) ;; *) BUILD=$SRC/$BUILD ;; esac
# python3 writes check.json: without it nothing would come back
command -v python3 >/dev/null || { echo "check: python3 is needed (it writes check.json)"; exit 1; }
UTIL="python3 $SRC/bench/gpu/check_util.py"
T0=$(date +%s)
RESERVE=8 # seconds kept for the last check.json and the logs' archive
COMMIT=${FERRY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

elapsed() { echo $(( $(date +%s) - T0 )); }
log() { echo "check: [$(elapsed)s] $*"; }

# ---- figures and check.json -----------------------------------------------------------
# fig PHASE KEY VALUE (a JSON literal, or a string); PHASE - is the top level
fig() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$FIG"; }
# figs PHASE: each `key value` line of stdin becomes a figure
figs() { local k v; while read -r k v; do [ -n "$k" ] && fig "$1" "$k" "$v"; done; }
# the figure KEY of PHASE, last recorded, a string's quotes dropped ("" if none)
get() {
    awk -F'\t' -v p="$1" -v k="$2" '$1 == p && $2 == k { v = $3 } END { gsub(/^"|"$/, "", v); print v }' "$FIG"
}
save() {
    fig - seconds "$(elapsed)"
    $UTIL json "$FIG" "$OUT/check.json" || log "cannot write check.json"
    tar -C "$WORK" -czf "$OUT/logs.tar.gz.tmp" --exclude=figures.tsv . 2>/dev/null \
        && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

# ---- phases ---------------------------------------------------------------------------
# phase NAME CAP FUNCTION: runs FUNCTION with the phase's deadline (CAP seconds from now,
# never past the check's), its output in $WORK/NAME.log; records the status (ok, failed,
# timeout, or not-run when no time is left) and the seconds taken. FUNCTION may set
# PHASE_STATUS itself (skipped, failed with a reason) and record figures.
PHASE_END=0 CUT=0 PHASE_STATUS="" FAILED=""
phase() {
    local name=$1 cap=$2 fn=$3 started=$SECONDS
    PHASE_END=$(( $(date +%s) + cap ))
    [ $PHASE_END -le $(( T0 + DEADLINE - RESERVE )) ] || PHASE_END=$(( T0 + DEADLINE - RESERVE ))
    if [ $(( PHASE_END - $(date +%s) )) -lt 5 ]; then
        fig "$name" status '"not-run"'
        fig "$name" reason '"the check deadline left no time"'
        FAILED="$FAILED $name"
        save
        return 1
    fi
    log "$name (at most $(( PHASE_END - $(date +%s) )) s)"
    fig "$name" status '"running"'
    save
    CUT=0 PHASE_STATUS=""
    "$fn" > "$WORK/$name.log" 2>&1
    local rc=$?
    if [ -z "$PHASE_STATUS" ]; then
        if [ $CUT = 1 ]; then PHASE_STATUS=timeout
        elif [ $rc = 0 ]; then PHASE_STATUS=ok
        else PHASE_STATUS=failed; fi
    fi
    fig "$name" status "\"$PHASE_STATUS\""
    fig "$name" seconds $(( SECONDS - started ))
    case $PHASE_STATUS in ok|skipped) ;; *) FAILED="$FAILED $name"; tail -15 "$WORK/$name.log" ;; esac
    save
    [ "$PHASE_STATUS" = ok ]
}
# cut CMD...: CMD under `timeout` to the phase's deadline; 124 when cut
cut() {
    local left=$(( PHASE_END - $(date +%s) ))
    if [ $left -lt 1 ]; then CUT=1; return 124; fi
    timeout --kill-after=5 "$left" "$@"
    local rc=$?
    [ $rc = 124 ] || [ $rc = 137 ] && CUT=1
    return $rc
}
skip() { PHASE_STATUS=skipped; fig "$PHASE" reason "\"$1\""; echo "skipped: $1"; }
on_signal() {
    fig - status '"killed"'
    save
    exit 1
}
trap on_signal TERM INT

fig - date "\"$(date -u +%Y-%m-%dT%H:%M:%SZ)\""
fig - commit "\"$COMMIT\""
fig - mode "\"$([ "$EMU" = 1 ] && echo emulated || echo gpu)\""
fig - device "\"$DEV\""
fig - deadline_s "$DEADLINE"
fig - status '"running"'
export PATH=/usr/local/cuda/bin:$PATH

# ---- machine ----------------------------------------------------------------------------
# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity: half the datasheets' "with
# sparsity" figures). NVIDIA's H200 page lists the SXM at 1,979 with sparsity, up to 700 W,
# and the H200 NVL (PCIe card) at 1,671 with sparsity, up to 600 W: 989 and 835 dense. The
# same die, so only the name ('NVIDIA H200 NVL') or the power limit tells them apart: a
# limit of at most 650 W is the NVL. H100: SXM 989, NVL 835, PCIe 756 (1,513 sparse);
# A100 312; RTX 4090 165 (Ada datasheet, fp32 accumulate).
GPU=unknown PEAK=0
machine() {
    if [ "$EMU" = 1 ]; then skip "emulated: no nvidia-smi, no timing"; GPU=emulated; return 0; fi
    nvidia-smi > "$WORK/nvidia-smi.txt" 2>&1
    local q
    q=$(nvidia-smi --query-gpu=name,memory.total,power.max_limit,power.default_limit,driver_version \
        --format=csv,noheader,nounits 2>/dev/null | head -1)
    [ -n "$q" ] || { echo "no GPU visible to nvidia-smi"; return 1; }
    local name mem pmax pdef drv
    IFS=, read -r name mem pmax pdef drv <<< "$q"
    name=$(echo "$name" | sed 's/^ *//; s/ *$//')
    pmax=${pmax// /} pdef=${pdef// /}
    local watts=${pmax%.*}
    [[ $watts =~ ^[0-9]+$ ]] || watts=0
    case "$name" in
        *H200*NVL*) PEAK=835 ;;
        *H200*) if [ "$watts" -gt 0 ] && [ "$watts" -le 650 ]; then PEAK=835; else PEAK=989; fi ;;
        *H100*NVL*) PEAK=835 ;;
        *H100*PCIe*) PEAK=756 ;;
        *H100*) PEAK=989 ;;
        *A100*) PEAK=312 ;;
        *4090*) PEAK=165 ;;
        *) PEAK=0 ;;
    esac
    GPU=$name
    fig machine gpu "\"$name\""
    fig machine memory_mib "${mem// /}"
    fig machine power_max_limit_w "\"$pmax\""
    fig machine power_default_limit_w "\"$pdef\""
    fig machine driver "\"${drv// /}\""
    fig machine peak_bf16_tflops "$PEAK"
    local cs
    cs=$(sanitizer)
    fig machine compute_sanitizer "\"${cs:-none}\""
}
sanitizer() {
    command -v compute-sanitizer 2>/dev/null && return
    local f
    for f in /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer \
             /opt/nvidia/*/compute-sanitizer; do
        [ -x "$f" ] && { echo "$f"; return; }
    done
}

# ---- build -----------------------------------------------------------------------------
RUN_ENV=()
deps() { # the carried libraries, when the machine lacks them
    pkg-config --exists libcjson criterion zlib 2>/dev/null && return 0
    [ -d .gpu-deps ] || { echo "missing cJSON, Criterion or zlib and no .gpu-deps carried (run bench/gpu/fetch-deps.sh here)"; return 1; }
    local root=/tmp/ferry-root lib
    rm -rf "$root" && mkdir -p "$root"
    for f in .gpu-deps/*.deb; do dpkg -x "$f" "$root"; done
    lib=$root/usr/lib/x86_64-linux-gnu
    # meson.build looks for the OpenMP OpenBLAS at Debian's path
    for d in /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/include/x86_64-linux-gnu/openblas-openmp; do
        [ -e "$d" ] || { mkdir -p "$(dirname "$d")"; ln -s "$root$d" "$d"; }
    done
    export PKG_CONFIG_SYSROOT_DIR=$root PKG_CONFIG_PATH=$lib/pkgconfig:$root/usr/share/pkgconfig
    if ! command -v pkg-config >/dev/null; then # the carried pkgconf, with its library
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$lib" "$root/usr/bin/pkgconf" > "$root/pkg-config"
        chmod +x "$root/pkg-config"
        export PKG_CONFIG="$root/pkg-config"
    fi
    export CPATH=$root/usr/include LIBRARY_PATH=$lib
    RUN_ENV=(env "LD_LIBRARY_PATH=$lib:$lib/openblas-openmp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    echo "using the carried libraries in $root"
}
FERRY="" TARGETS=()
build() {
    deps || return 1
    # meson and ninja installed by pip (the device image's Python has both) may sit in
    # its scripts folder, off the PATH
    local scripts
    scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)
    [ -n "$scripts" ] && PATH=$PATH:$scripts
    command -v meson >/dev/null || { echo "meson not found"; return 1; }
    command -v ninja >/dev/null || { echo "ninja not found"; return 1; }
    if [ -n "${FERRY_CHECK_BUILD:-}" ]; then
        [ -f "$BUILD/build.ninja" ] || { echo "FERRY_CHECK_BUILD=$BUILD is not a configured build"; return 1; }
    elif [ "$EMU" = 1 ]; then
        if [ ! -f "$BUILD/build.ninja" ]; then # reused when configured; a failed setup's remains go
            rm -rf "$BUILD"
            cut meson setup "$BUILD" -Dcuda=emulated || return 1
        fi
    else
        rm -rf "$BUILD"
        cut meson setup "$BUILD" -Dcuda=enabled -Dgpu_arch=90 || return 1
    fi
    TARGETS=(ferry)
    local t
    for t in test_cuda test_cuda_job; do
        grep -q "^build tests/$t:" "$BUILD/build.ninja" && TARGETS+=("$t")
    done
    # an emulated build's cuBLASLt and NCCL: nothing links them (the backend loads them
    # with dlopen), so building ferry alone leaves them out and dlopen finds the toolkit's
    # real ones, which fail without a GPU
    grep -q "^build tests/cuda_emu/runtime/libcublasLt.so" "$BUILD/build.ninja" && TARGETS+=(cublasLt nccl)
    cut meson compile -C "$BUILD" "${TARGETS[@]}" || return 1
    FERRY=$BUILD/ferry
    "${RUN_ENV[@]}" "$FERRY" info | tee "$WORK/info.txt"
    fig build dir "\"${BUILD#"$SRC"/}\""
    fig build targets "\"${TARGETS[*]}\""
}
ferry_run() { cut "${RUN_ENV[@]}" "$FERRY" "$@"; }

# ---- tests -----------------------------------------------------------------------------
# the Criterion synthesis lines of a log, summed, as figures of PHASE
synthesis() {
    grep -h "Synthesis:" "$2" | awk -v p="$1" '{
        for (i = 1; i <= NF; i++) if ($i ~ /^(Tested|Passing|Failing|Crashing):$/) n[$i] += $(i + 1) }
        END { printf "%s\ttested\t%d\n%s\tpassing\t%d\n%s\tfailing\t%d\n%s\tcrashing\t%d\n",
              p, n["Tested:"], p, n["Passing:"], p, n["Failing:"], p, n["Crashing:"] }' >> "$FIG"
}
# whether the Criterion runs of PHASE ran any test and none failed or crashed
ran_clean() {
    [ $CUT = 0 ] || return 1 # cut short: the phase reads timeout
    [ "$(get "$1" tested)" -gt 0 ] 2>/dev/null && [ "$(get "$1" failing)" = 0 ] && [ "$(get "$1" crashing)" = 0 ] \
        && return 0
    PHASE_STATUS=failed
    fig "$1" reason '"no test ran, or one failed"'
    return 1
}
tests() {
    local suites=() t
    # (test_cuda is four meson tests, by suite: tests/meson.build)
    for t in "${TARGETS[@]}"; do
        case $t in
        test_cuda) suites+=(cuda_kernels cuda_training cuda_offload cuda_device) ;;
        test_*) suites+=("${t#test_}") ;;
        esac
    done
    [ ${#suites[@]} -gt 0 ] || { echo "the build has no CUDA tests"; return 1; }
    cut "${RUN_ENV[@]}" meson test -C "$BUILD" --no-rebuild --print-errorlogs "${suites[@]}"
    local rc=$?
    cp "$BUILD/meson-logs/testlog.txt" "$WORK/testlog.txt" 2>/dev/null
    synthesis tests "$WORK/testlog.txt"
    fig tests suites "\"${suites[*]}\""
    ran_clean tests || return 1
    return $rc
}

# ---- the benchmark ---------------------------------------------------------------------
if [ "$EMU" = 1 ] || [ "$DEV" = cpu ]; then
    BMODEL=gpt2-tiny B=2 T=64 BSTEPS=8 BSKIP=2 N=0
else # N: gpt2-124m's parameters (6 N FLOPs a token) for the MFU
    BMODEL=gpt2-124m B=8 T=1024 BSTEPS=30 BSKIP=5 N=124439808
fi
DTYPE=bf16 TOKS=0
bench_one() {
    rm -f "$WORK/bench.jsonl"
    ferry_run train --device "$DEV" --model $BMODEL --batch $B --seq $T --dtype "$1" \
        --steps $BSTEPS --warmup 5 --lr 6e-4 --metrics "$WORK/bench.jsonl" --log-every 10 \
        > "$WORK/bench-$1.log" 2>&1
}
bench() {
    fig bench model "\"$BMODEL\""; fig bench batch $B; fig bench seq $T; fig bench plan '"all-resident"'
    if ! bench_one bf16; then
        echo "bf16 storage failed:"; tail -20 "$WORK/bench-bf16.log"
        fig bench bf16 '"failed"'
        DTYPE=fp32
        bench_one fp32 || { tail -20 "$WORK/bench-fp32.log"; return 1; }
    fi
    fig bench dtype "\"$DTYPE\""
    $UTIL steps "$WORK/bench.jsonl" $BSKIP | figs bench
    fig bench device_peak "\"$(grep -o 'device peak [^|(]*' "$WORK/bench-$DTYPE.log" | head -1 | sed 's/device peak //; s/ *$//')\""
    local ms
    ms=$(get bench median_step_ms)
    [ -n "$ms" ] || { echo "no measured steps"; return 1; }
    TOKS=$(python3 -c "print(round($B * $T / $ms * 1e3))")
    fig bench tokens_per_s "$TOKS"
    if [ "$PEAK" != 0 ] && [ "$N" != 0 ]; then # 6 N + 12 L C T FLOPs a token (L 12, C 768)
        fig bench mfu "$(python3 -c "print(round($TOKS * (6 * $N + 12 * 12 * 768 * $T) / ($PEAK * 1e12), 4))")"
    fi
    if [ "$(get bench finite)" != true ] || [ "$(get bench falling)" != true ]; then
        PHASE_STATUS=failed
        fig bench reason '"the losses are not finite and falling"'
    fi
}

# ---- llama on cuda against the cpu backend ---------------------------------------------
llama_pair() { # dtype tolerance
    local math=auto
    [ "$1" = fp32 ] && math=fp32 # exact fp32 GEMMs (cuda's default is bf16 tensor cores)
    local common=(train --model llama-tiny --batch "$LB" --seq "$LT" --steps 10 --lr 2e-3
                  --dtype "$1" --log-every 1)
    ferry_run "${common[@]}" --device "$DEV" --matmul $math --metrics "$WORK/llama-$1-cuda.jsonl" \
        > "$WORK/llama-$1-cuda.log" 2>&1 || return 1
    ferry_run "${common[@]}" --device cpu --metrics "$WORK/llama-$1-cpu.jsonl" \
        > "$WORK/llama-$1-cpu.log" 2>&1 || return 1
    $UTIL compare "$WORK/llama-$1-cuda.jsonl" "$WORK/llama-$1-cpu.jsonl" "$2" \
        | sed "s/^/$1_/" | figs llama
    [ "$(get llama "$1_within")" = true ]
}
llama() {
    if [ "$EMU" = 1 ]; then LB=2 LT=32; else LB=4 LT=64; fi
    fig llama model '"llama-tiny"'; fig llama batch $LB; fig llama seq $LT; fig llama steps 10
    fig llama fp32_tolerance 1e-4; fig llama bf16_tolerance 2e-2
    local rc=0
    llama_pair fp32 1e-4 || rc=1
    llama_pair bf16 2e-2 || rc=1
    return $rc
}

# ---- offload, traced ------------------------------------------------------------------
offload() {
    local steps=8 skip=3
    [ "$BMODEL" = gpt2-124m ] || { steps=4; skip=1; }
    fig offload plan '"--offload-optim 1 --offload-params 0.5"'
    fig offload model "\"$BMODEL\""
    rm -f "$WORK/offload.jsonl" "$WORK/offload-trace.json"
    ferry_run train --device "$DEV" --model $BMODEL --batch $B --seq $T --steps $steps \
        --offload-optim 1 --offload-params 0.5 --metrics "$WORK/offload.jsonl" \
        --trace "$WORK/offload-trace.json" > "$WORK/offload-run.log" 2>&1 \
        || { tail -20 "$WORK/offload-run.log"; return 1; }
    $UTIL steps "$WORK/offload.jsonl" $skip | figs offload
    $UTIL overlap "$WORK/offload-trace.json" | figs offload
    [ "$(get offload finite)" = true ] || return 1
    # half the parameters streamed: the copy lanes must have worked
    awk -v ms="$(get offload copy_busy_ms)" 'BEGIN { exit !(ms + 0 > 0) }' && return 0
    PHASE_STATUS=failed
    fig offload reason '"the trace shows no copies: nothing was streamed"'
    return 1
}

# ---- compute-sanitizer, or the emulator's thread orders ----------------------------------
kernel_suites() { # [wrapper...]: test_cuda's kernel suites, one test process at a time
    cut "${RUN_ENV[@]}" env FERRY_BIN="$FERRY" FERRY_FIXTURES="$SRC/tests/fixtures" \
        FERRY_SHARED="$SRC/../shared" OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive \
        "$@" "$BUILD/tests/test_cuda" --jobs 1 --filter 'kernels_*/*'
}
sanitize() { # tool
    local cs
    cs=$(sanitizer)
    [ -n "$cs" ] || { skip "no compute-sanitizer on this machine"; return 0; }
    kernel_suites "$cs" --tool "$1" --target-processes all --error-exitcode 86 --print-limit 20
    local rc=$?
    # a machine whose GPU runtime the sanitizer does not support (gVisor's: "Device not
    # supported", then error 999 at the first allocation) has nothing to say about ferry
    local refused
    refused=$(grep -m1 "Device not supported" "$WORK/$1.log" | tr -d '"\\')
    if [ -n "$refused" ]; then skip "compute-sanitizer refuses this machine's GPU: ${refused#*= }"; return 0; fi
    synthesis "$1" "$WORK/$1.log"
    # every process the sanitizer saw prints a summary: its errors (racecheck: hazards)
    local n errors
    n=$(grep -c -E "(ERROR|RACECHECK) SUMMARY" "$WORK/$1.log")
    errors=$(grep -o -E "ERROR SUMMARY: [0-9]+|\([0-9]+ errors" "$WORK/$1.log" | grep -o -E "[0-9]+" \
             | awk '{ s += $1 } END { print s + 0 }')
    fig "$1" summaries "$n"
    fig "$1" errors "$errors"
    ran_clean "$1" || return 1
    if [ "$n" = 0 ]; then
        PHASE_STATUS=failed
        fig "$1" reason '"the sanitizer printed no summary: it saw no CUDA process"'
    fi
    [ $rc = 0 ] && [ "$errors" = 0 ]
}
memcheck() {
    if [ "$EMU" = 1 ]; then skip "emulated: the emulator checks every device access (the tests phase)"; return 0; fi
    sanitize memcheck
}
racecheck() {
    if [ "$EMU" = 1 ]; then
        fig racecheck tool '"FERRY_EMU_RACECHECK=1: each kernel in three thread orders"'
        kernel_suites env FERRY_EMU_RACECHECK=1
        local rc=$?
        synthesis racecheck "$WORK/racecheck.log"
        ran_clean racecheck || return 1
        return $rc
    fi
    sanitize racecheck
}

# ---- the PyTorch reference -------------------------------------------------------------
torch_ref() {
    if ! python3 -c 'import torch' 2>/dev/null; then skip "torch is not installed"; return 0; fi
    # bf16 autocast either way: bf16 GEMMs over fp32 weights, as ferry's benchmark has in
    # both its storage types (bf16 storage, or the fp32 fallback's bf16 tensor cores)
    local args=(--dtype bf16 --batch "$B" --seq "$T" --steps "$BSTEPS" --warmup "$BSKIP")
    if [ "$EMU" = 1 ] || [ "$DEV" = cpu ] || ! python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
        # the script runs end to end on the CPU, on gpt2-tiny's shape: no ratio worth keeping
        args+=(--device cpu --vocab 256 --channels 64 --layers 2 --heads 4)
        fig torch note '"cpu, gpt2-tiny shape: a run of the script, not a reference"'
    fi
    cut python3 "$SRC/bench/gpu/torch_ref.py" "${args[@]}" > "$WORK/torch.json" || return 1
    cat "$WORK/torch.json"
    python3 - "$WORK/torch.json" "$TOKS" <<'PY' | figs torch
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print("device", json.dumps(r["device"]))
print("median_step_ms", r["median_step_ms"])
print("tokens_per_s", r["tokens_per_s"])
print("ferry_over_torch", round(float(sys.argv[2]) / r["tokens_per_s"], 3) if r["tokens_per_s"] else 0)
PY
}

# ---- a measured profile -----------------------------------------------------------------
probe() {
    local pb=4 pt=1024
    [ "$BMODEL" = gpt2-124m ] || { pb=$B; pt=$T; }
    ferry_run probe --device "$DEV" --model $BMODEL --batch $pb --seq $pt --out "$WORK/profile.json" \
        || return 1
    cp "$WORK/profile.json" "$OUT/profile.json"
}

# ---- the run -----------------------------------------------------------------------------
PHASE=""
run() { PHASE=$1; phase "$@"; }
run machine 30 machine
if run build 300 build; then
    run tests "$([ "$EMU" = 1 ] && echo 300 || echo 120)" tests
    run bench 120 bench
    run llama 90 llama
    run offload 90 offload
    run memcheck 90 memcheck
    run racecheck 120 racecheck
    run torch 90 torch_ref
    run probe 90 probe
else
    for p in tests bench llama offload memcheck racecheck torch probe; do
        fig $p status '"not-run"'; fig $p reason '"no build"'
    done
    FAILED="$FAILED tests bench llama offload memcheck racecheck torch probe"
fi
if [ -z "$FAILED" ]; then fig - status '"ok"'; else fig - status "\"failed:$FAILED\""; fi
save

printf '\n%-30s %s\n' "gpu" "$GPU"
printf '%-30s %s\n' "commit" "$COMMIT"
for p in machine build tests bench llama offload memcheck racecheck torch probe; do
    printf '%-30s %s\n' "$p" "$(get $p status)"
done
printf '%-30s %s ms/step, %s tok/s, MFU %s (%s)\n' "$BMODEL B=$B T=$T" "$(get bench median_step_ms)" \
    "$(get bench tokens_per_s)" "$(get bench mfu)" "$(get bench dtype)"
printf '%-30s first %s, last %s\n' "bench losses" "$(get bench first_loss)" "$(get bench last_loss)"
printf '%-30s fp32 %s, bf16 %s\n' "llama vs cpu (max rel diff)" "$(get llama fp32_max_rel_diff)" \
    "$(get llama bf16_max_rel_diff)"
printf '%-30s %s ms/step, copies overlap compute %s\n' "offload" "$(get offload median_step_ms)" \
    "$(get offload copy_overlap)"
printf '%-30s %s\n' "ferry / torch tok/s" "$(get torch ferry_over_torch)"
printf '%-30s %s s\n' "total" "$(elapsed)"
[ -z "$FAILED" ] || { log "failed:$FAILED"; exit 1; }
