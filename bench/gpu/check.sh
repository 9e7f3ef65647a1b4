#!/usr/bin/env bash
# bench/gpu/check.sh — the GPU check, in one call on a machine with an NVIDIA GPU:
#   1. builds ferry with the cuda backend for sm_90 only (-Dgpu_arch=90),
#   2. runs the CUDA tests (tests/test_cuda.c: kernels against the cpu backend, the tiny
#      model on cuda against cpu, the offload invariance on cuda),
#   3. benchmarks GPT-2 124M, B=8, T=1024, all-resident, bf16 storage (fp32 storage
#      with bf16 tensor-core GEMMs if the bf16 run fails): median step time over the
#      steps after warm-up, tokens/s, and MFU against the GPU's dense bf16 peak,
#   4. runs an offload smoke run and `ferry probe` (a measured profile of this GPU for the
#      tuner) when time allows,
#   5. prints a table and writes, under $OUT (the device tool brings back at most 8
#      files): check.json, profile.json and logs.tar.gz (every log and metrics file).
# It must finish within 8 minutes on one H200, build included; each phase has its own
# time limit. Where the machine lacks ferry's libraries (OpenBLAS, cJSON, jemalloc,
# libnuma, Criterion), carry the .debs that bench/gpu/fetch-deps.sh downloads
# (.gpu-deps/): they are unpacked into a private root, nothing is installed.
#
# Usage: FERRY_COMMIT=<hash> bash bench/gpu/check.sh   (the commit is only recorded)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ferry-check}
mkdir -p "$OUT"
BUILD=build-gpu
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
log() { echo "check: [$(elapsed)s] $*"; }
fail() { log "FAILED: $*"; write_json "failed: $*"; exit 1; }
bad() { if [ "$STATUS" = ok ]; then STATUS=$1; else STATUS="$STATUS; $1"; fi; }

STATUS=ok TESTS=not-run STEP_MS=0 TOKS=0 MFU=0 GPU=unknown PEAK_TFLOPS=0 PEAK_MEM=unknown OFF_MS=0
DTYPE=bf16

write_json() {
    cat > "$OUT/check.json" <<JSON
{"date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "commit": "${FERRY_COMMIT:-unknown}",
 "gpu": "$GPU", "status": "${1:-$STATUS}", "tests": "$TESTS",
 "bench": {"model": "gpt2-124m", "batch": 8, "seq": 1024, "plan": "all-resident",
           "dtype": "$DTYPE", "matmul": "bf16", "median_step_ms": $STEP_MS, "tokens_per_s": $TOKS,
           "mfu": $MFU, "peak_bf16_tflops": $PEAK_TFLOPS, "device_peak": "$PEAK_MEM"},
 "offload_smoke": {"plan": "--offload-optim 1 --offload-params 0.5", "median_step_ms": $OFF_MS},
 "seconds": $(elapsed)}
JSON
}

# ---- 0. the machine ----------------------------------------------------------------
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
[ -n "$GPU" ] || fail "no GPU visible to nvidia-smi"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# dense bf16 tensor-core peaks by the vendors' datasheets (TFLOP/s, without sparsity)
case "$GPU" in
    *H200*|*H100*SXM*|*"H100 80GB HBM3"*) PEAK_TFLOPS=989 ;;
    *H100*PCIe*|*"H100 PCIe"*) PEAK_TFLOPS=756 ;;
    *A100*) PEAK_TFLOPS=312 ;;
    *4090*) PEAK_TFLOPS=165 ;;
    *) PEAK_TFLOPS=0 ;;
esac
export PATH=/usr/local/cuda/bin:$PATH

# ---- 1. dependencies and build -------------------------------------------------------
RUN_ENV=()
if ! pkg-config --exists libcjson criterion 2>/dev/null; then
    [ -d .gpu-deps ] || fail "missing cJSON/Criterion and no .gpu-deps carried (run bench/gpu/fetch-deps.sh here)"
    ROOT=/tmp/ferry-root
    rm -rf "$ROOT" && mkdir -p "$ROOT"
    for f in .gpu-deps/*.deb; do dpkg -x "$f" "$ROOT"; done
    LIB=$ROOT/usr/lib/x86_64-linux-gnu
    # meson.build looks for the OpenMP OpenBLAS at Debian's path
    for d in /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/include/x86_64-linux-gnu/openblas-openmp; do
        [ -e "$d" ] || { mkdir -p "$(dirname "$d")"; ln -s "$ROOT$d" "$d"; }
    done
    export PKG_CONFIG_SYSROOT_DIR=$ROOT PKG_CONFIG_PATH=$LIB/pkgconfig:$ROOT/usr/share/pkgconfig
    if ! command -v pkg-config >/dev/null; then # the carried pkgconf, with its library
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$LIB" "$ROOT/usr/bin/pkgconf" > "$ROOT/pkg-config"
        chmod +x "$ROOT/pkg-config"
        export PKG_CONFIG="$ROOT/pkg-config"
    fi
    export CPATH=$ROOT/usr/include LIBRARY_PATH=$LIB
    RUN_ENV=(env "LD_LIBRARY_PATH=$LIB:$LIB/openblas-openmp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    log "using the carried libraries in $ROOT"
fi
command -v meson >/dev/null || python3 -m pip install -q --no-index meson 2>/dev/null
command -v meson >/dev/null || fail "meson not found"
rm -rf "$BUILD"
log "building (sm_90)"
timeout 240 meson setup "$BUILD" -Dcuda=enabled -Dgpu_arch=90 > "$OUT/build.log" 2>&1 \
    && timeout 240 meson compile -C "$BUILD" >> "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; fail "build"; }
"${RUN_ENV[@]}" "$BUILD/ferry" info | tee "$OUT/info.txt"

# ---- 2. the CUDA tests -----------------------------------------------------------------
log "CUDA tests"
if "${RUN_ENV[@]}" timeout 200 meson test -C "$BUILD" cuda --print-errorlogs --timeout-multiplier 1 \
        > "$OUT/tests.log" 2>&1; then
    TESTS=passed
else
    TESTS=failed; bad "tests failed"
    tail -40 "$OUT/tests.log"
fi
cp "$BUILD/meson-logs/testlog.txt" "$OUT/testlog.txt" 2>/dev/null
grep -E "Synthesis|Tested|Passing|Failing|Crashing|Skipped" "$OUT/testlog.txt" | tail -3

# ---- 3. the benchmark ------------------------------------------------------------------
bench() { # $1 = storage type
    log "benchmark: gpt2-124m, B=8, T=1024, all-resident, $1 storage"
    rm -f "$OUT/bench.jsonl"
    "${RUN_ENV[@]}" timeout 150 "$BUILD/ferry" train --device cuda --model gpt2-124m --batch 8 \
        --seq 1024 --dtype "$1" --steps 30 --warmup 5 --lr 6e-4 --metrics "$OUT/bench.jsonl" \
        --log-every 10 > "$OUT/bench-$1.log" 2>&1
}
if bench bf16 || { bad "bf16 benchmark failed"; tail -20 "$OUT/bench-bf16.log"; DTYPE=fp32; bench fp32; }; then
    cp "$OUT/bench-$DTYPE.log" "$OUT/bench.log"
    read -r STEP_MS TOKS < <(python3 - "$OUT/bench.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = statistics.median(r["step_ms"] for r in rows[5:])  # steps 6.. (after warm-up)
print(f"{ms:.3f} {8 * 1024 / ms * 1e3:.0f}")
PY
)
    PEAK_MEM=$(grep -o "device peak [^|(]*" "$OUT/bench.log" | head -1 | sed 's/device peak //; s/ *$//')
    # flops per token: 6 N (forward and backward of every weight) + 12 L C T (attention)
    N=124439808
    MFU=$(python3 -c "print(round($TOKS * (6 * $N + 12 * 12 * 768 * 1024) / ($PEAK_TFLOPS * 1e12), 4) if $PEAK_TFLOPS else 0)")
else
    bad "benchmark failed"
    tail -20 "$OUT/bench-fp32.log"
fi

# ---- 4. offload on the GPU (a smoke run, when time allows) ------------------------------
OFF_MS=0
if [ "$(elapsed)" -lt 330 ]; then
    log "offload smoke: gpt2-124m, every optimizer step on the CPU, half the parameters streamed"
    rm -f "$OUT/offload.jsonl"
    if "${RUN_ENV[@]}" timeout 120 "$BUILD/ferry" train --device cuda --model gpt2-124m --batch 8 \
            --seq 1024 --steps 8 --offload-optim 1 --offload-params 0.5 \
            --metrics "$OUT/offload.jsonl" > "$OUT/offload.log" 2>&1; then
        OFF_MS=$(python3 -c "import json,statistics,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(f'{statistics.median(x[\"step_ms\"] for x in r[3:]):.3f}')" "$OUT/offload.jsonl")
    else
        bad "offload smoke failed"
        tail -20 "$OUT/offload.log"
    fi
fi

# ---- 5. a measured profile of this GPU, for the tuner (when time allows) ---------------
PROFILE=no
if [ "$(elapsed)" -lt 360 ]; then
    log "probe: transfers, CPU AdamW, gpt2-124m block costs (B=4, T=1024)"
    if "${RUN_ENV[@]}" timeout 100 "$BUILD/ferry" probe --device cuda --model gpt2-124m --batch 4 \
            --seq 1024 --out "$OUT/profile.json" > "$OUT/probe.log" 2>&1; then
        PROFILE=yes
    else
        bad "probe failed"
        tail -10 "$OUT/probe.log"
    fi
fi

# ---- 6. the table ----------------------------------------------------------------------
write_json
( cd "$OUT" && tar czf logs.tar.gz --remove-files $(ls | grep -v -e '^check.json$' -e '^profile.json$' -e '^logs.tar.gz$') ) 2>/dev/null
printf '\n%-28s %s\n' "gpu" "$GPU"
printf '%-28s %s\n' "commit" "${FERRY_COMMIT:-unknown}"
printf '%-28s %s\n' "cuda tests" "$TESTS"
printf '%-28s %s\n' "gpt2-124m B=8 T=1024 $DTYPE" "median $STEP_MS ms/step, $TOKS tok/s"
printf '%-28s %s\n' "MFU (bf16 dense peak $PEAK_TFLOPS)" "$MFU"
printf '%-28s %s\n' "device peak" "$PEAK_MEM"
printf '%-28s %s\n' "offload smoke (optim cpu)" "median $OFF_MS ms/step"
printf '%-28s %s\n' "measured profile" "$PROFILE"
printf '%-28s %s s\n' "total" "$(elapsed)"
[ "$STATUS" = ok ] || { log "$STATUS"; exit 1; }
