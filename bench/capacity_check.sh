#!/usr/bin/env bash
# bench/capacity_check.sh — `ferry tune --capacity` on a machine this one can stand in
# for, and each row that fits run for real on the cpu backend: the tuner's plan for the
# model, one training step under it, and the device peak the run measured against the
# memory model the capacity table used (and the second step's time).
#
# usage: bench/capacity_check.sh [build dir]
# The budgets (PROFILE, GPU_MEM, HOST_MEM, BATCH, SEQ in the environment) default to an
# RTX 4090 profile cut to 3 GiB of device and 6 GiB of host memory at 1 x 256, so every
# row that fits also fits this 24 GiB machine (the cpu backend's device memory is RAM).
set -euo pipefail
build=${1:-build}
ferry="$build/ferry"
profile=${PROFILE:-rtx4090-pcie4}
gpu=${GPU_MEM:-3GiB}
host=${HOST_MEM:-6GiB}
batch=${BATCH:-1}
seq=${SEQ:-256}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(--profile "$profile" --gpu-mem "$gpu" --host-mem "$host" --batch "$batch" --seq "$seq"
       --dtype fp32)
"$ferry" tune --capacity "${flags[@]}" | tee "$out/capacity.txt"
echo
printf '%-16s %14s %14s %s\n' model "memory model" "device peak" "ms/step (cpu backend)"
# the named models the table says fit (rows of the named table with "yes")
for m in $(awk '/^free shapes/ {exit} $3 == "yes" {print $1}' "$out/capacity.txt"); do
    if ! "$ferry" tune --model "$m" "${flags[@]}" --quiet --out "$out/$m.json" > "$out/$m.tune" 2>&1; then
        echo "$m: tune failed:"; tail -3 "$out/$m.tune"; continue
    fi
    if ! "$ferry" train --model "$m" --plan "$out/$m.json" --device cpu --steps 2 --seq "$seq" \
        --gpu-mem "$gpu" --host-mem "$host" --val-batches 1 > "$out/$m.out" 2>&1; then
        echo "$m: the run failed:"; tail -3 "$out/$m.out"; continue
    fi
    line=$(grep '^done' "$out/$m.out" || true)
    [ -n "$line" ] || { echo "$m: no summary line"; continue; }
    peak=$(sed -E 's/.*device peak ([0-9.]+ [KMGT]?i?B) \(model ([0-9.]+ [KMGT]?i?B)\).*/\1|\2/' <<<"$line")
    ms=$(sed -E 's/.*\| ([0-9.]+) ms\/step.*/\1/' <<<"$line")
    printf '%-16s %14s %14s %s\n' "$m" "${peak#*|}" "${peak%|*}" "$ms"
done
