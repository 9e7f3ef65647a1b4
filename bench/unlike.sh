#!/usr/bin/env bash
# unlike.sh — a job of unlike ranks, each with its own plan and share (issue 34):
#   1. predicted, on named profiles: `ferry tune` of llama3-8b (bf16, 8 x 4096 a rank)
#      for an A100 80GB beside an RTX 4090, and two H100s beside two A100 40GB: each
#      rank's own plan with balanced shares against equal shares and against one plan for
#      every rank (the best within the least budget);
#   2. measured, on the cpu backend: gpt2-mini under mpirun -np 2 with budgets 4x apart
#      (--gpu-mem 24MiB,6MiB), rank 1's kernels twice as slow (--sim-slowdown 1,2) and
#      copies at an emulated 2 GB/s: --plan auto --batch-shares auto against one plan for
#      every rank (the job's search at 6 MiB each, saved, run by both) with equal shares,
#      and the two halves (own plans with equal shares; one plan with auto shares);
#      alternated ROUNDS times, median ms/step; and the job's predicted step against the
#      measured one.
# Usage: bench/unlike.sh [BUILD_DIR]  (default build; needs mpirun). Prints a summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/build}/ferry
rounds=${ROUNDS:-5}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
tmp=$(mktemp -d /tmp/ferry-unlike-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export XDG_CACHE_HOME=$tmp/cache # the job's probe, made by the first run here

ms_of() { grep '^done' | sed -E 's/.* ([0-9.]+) ms\/step.*/\1/'; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }
mpi() { mpirun -np 2 --oversubscribe "$bin" "$@"; }

# 1. predicted
for job in a100-80gb-pcie4,rtx4090-pcie4 h100-80gb-pcie5,h100-80gb-pcie5,a100-40gb-pcie4,a100-40gb-pcie4; do
    "$bin" tune --model llama3-8b --dtype bf16 --batch 8 --seq 4096 --profile "$job" >"$tmp/tune.txt"
    echo "predicted, llama3-8b bf16, 8 x 4096 a rank, $job:"
    grep -E '^(each|one) ' "$tmp/tune.txt" | sed 's/^/  /'
    awk '/^(each|one) /{show = /\(the pick\):/} show && /^[0-9]+ /{print "    the pick: " $0}' "$tmp/tune.txt"
done

# 2. measured
base=(train --model gpt2-mini --device cpu --threads 1 --seq 64 --steps 20 --val-batches 1
      --sim-pcie-gbps 2 --sim-slowdown 1,2)
mpi "${base[@]}" --batch 4 --grad-accum 2 --plan auto --gpu-mem 6MiB --save-plan "$tmp/one.json" \
    --dry-run >"$tmp/one.out" 2>&1
grep -m1 '^plan ' "$tmp/one.out" >"$tmp/one.txt"
own=(--batch 4 --grad-accum 2 --plan auto --gpu-mem 24MiB,6MiB)
declare -A runs=(
    [pick]="${own[*]} --batch-shares auto"
    [own_equal]="${own[*]}"
    [one_equal]="--plan $tmp/one.json"
    [one_auto]="--plan $tmp/one.json --batch-shares auto"
)
for k in "${!runs[@]}"; do : >"$tmp/$k"; done
for ((i = 0; i < rounds; i++)); do
    for k in pick one_equal own_equal one_auto; do
        # shellcheck disable=SC2086
        mpi "${base[@]}" ${runs[$k]} >"$tmp/out" 2>&1
        ms_of <"$tmp/out" >>"$tmp/$k"
        [ "$k" = pick ] && grep -E '^(job|shares|[01] )' "$tmp/out" >"$tmp/pick.txt"
    done
done
pick=$(median <"$tmp/pick"); one=$(median <"$tmp/one_equal")
oe=$(median <"$tmp/own_equal"); oa=$(median <"$tmp/one_auto")
predicted=$(sed -nE 's/.*predicted ([0-9.]+) ms a step.*/\1/p' "$tmp/pick.txt")
echo "measured, cpu backend, gpt2-mini 16 x 64 a step, --gpu-mem 24MiB,6MiB --sim-slowdown 1,2, 2 GB/s copies, $rounds rounds:"
sed 's/^/  /' "$tmp/pick.txt"
echo "  own plans, auto shares (the pick):  $pick ms/step (predicted $predicted: measured/predicted $(ratio "$pick" "$predicted"))"
echo "  one plan, equal shares:             $one ms/step; pick/this $(ratio "$pick" "$one")"
echo "  own plans, equal shares:            $oe ms/step; pick/this $(ratio "$pick" "$oe")"
echo "  one plan, auto shares:              $oa ms/step; pick/this $(ratio "$pick" "$oa")"
echo "  the one plan (the job's search at 6 MiB a rank, rank 0's): $(sed 's/^plan *//' "$tmp/one.txt")"
