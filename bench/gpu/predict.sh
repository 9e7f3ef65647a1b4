#!/usr/bin/env bash
# bench/gpu/predict.sh — what the GPU should show, predicted: the simulator's step time
# for Llama 3 8B, Llama 2 13B and Llama 3 70B on the named profiles h200-141gb,
# h100-80gb-pcie5 and rtx4090-pcie4, under each schedule (priority, fifo, serial), as a
# markdown table for bench/RESULTS.md. Needs no GPU: it runs `ferry tune` and
# `ferry sweep --simulate` on the profiles' figures (never changed here).
#
# Two plans a model and profile, each with the device and host budgets the profile names:
#   full   every block streamed, every optimizer step on the CPU, every layer recomputed,
#          the whole batch one micro-batch (sweep --grid
#          offload_params=1,offload_optim=1,ckpt=L,micro=B): one plan under the three
#          schedules;
#   tuned  the tuner's pick under each schedule (tune --schedule S): what
#          `train --plan auto --schedule S` would run; the plan is the priority pick's,
#          and another schedule's pick is named where it differs.
# Batch 8 x sequence 2048, bf16 storage (fp32 masters and moments). Then bench/gpu/check.sh's
# own two runs on h200-141gb (GPT-2 124M, batch 8 x 1024: all-resident, and its offload run,
# half the parameters streamed and every optimizer step on the CPU), to hold a GPU run
# against. The busiest lane is the priority schedule's, per step.
#
# Usage: bash bench/gpu/predict.sh [FERRY] > table.md   (FERRY: default build/ferry)
set -euo pipefail
FERRY=$(realpath "${1:-build/ferry}")
B=8 T=2048
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cd "$W"
MODES="priority fifo serial"
# profile, its device memory and its host memory (tuner/profile.c), the budgets bound here
PROFILES="h200-141gb:139.1GiB:128GiB h100-80gb-pcie5:78.4GiB:1024GiB rtx4090-pcie4:22.7GiB:128GiB"

# The pick from tune's first row as "ckpt/stream/cpu-opt/spec micro x accumulation"
# (layers recomputed, streamed, updated on the CPU, of those speculated; the prefetch
# depth where not 1), then the predicted ms and the busiest lane; or the error line.
tune_row() { # model profile device host schedule
    local out
    if out=$("$FERRY" tune --model "$1" --profile "$2" --gpu-mem "$3" --host-mem "$4" \
            --dtype bf16 --batch $B --seq $T --schedule "$5" --out "$W/plan.json" 2>&1); then
        echo "$out" | awk '$1 == "1" && NF >= 16 {
            tiers = index($0, " | ") ? substr($0, index($0, " | ") + 3) : ""
            gsub(/ \| /, ", ", tiers)
            printf "ok %s/%s/%s/%s %s%s%s|%s|%s %s ms\n", $2, $3, $4, $5, $6,
                $7 == 1 ? "" : " prefetch " $7, tiers ? ", " tiers : "", $8, $14, $15 }'
    else
        echo "no $(echo "$out" | grep -m1 'ferry: error:' | sed 's/ferry: error: //')"
    fi
}

# One grid point simulated: fits, the predicted ms, the busiest of the csv's four lanes,
# device and host memory
sweep_row() { # model profile device host schedule grid batch seq
    rm -rf "$W/sw"
    "$FERRY" sweep --simulate --quiet --model "$1" --profile "$2" --gpu-mem "$3" --host-mem "$4" \
        --dtype bf16 --batch "$7" --seq "$8" --schedule "$5" --grid "$6" --out "$W/sw" \
        >/dev/null 2>&1 || true
    awk -F, 'NR == 2 {
        n = split("compute h2d d2h cpu", lane, " "); best = 1
        for (i = 2; i <= n; i++) if ($(12 + i) > $(12 + best)) best = i
        printf "%s|%.1f|%s %.1f ms|%.1f GiB|%.1f GiB\n", $6, $7, lane[best], $(12 + best),
            $10 / 2^30, $12 / 2^30 }' "$W/sw/sweep.csv"
}

# A row of one plan (sweep's grid) under the three schedules, or why it does not fit.
plan_row() { # model profile device host grid batch seq label
    local s f t l d h fits=1 lane="" mem=""
    declare -A ms=()
    for s in $MODES; do
        IFS='|' read -r f t l d h <<< "$(sweep_row "$1" "$2" "$3" "$4" "$s" "$5" "$6" "$7")"
        [ "$f" = 1 ] || fits=0
        ms[$s]=$t
        if [ "$s" = priority ]; then lane=$l mem="device $d, host $h"; fi
    done
    if [ $fits = 1 ]; then
        echo "| $1 | $2 | $8 ($mem) | ${ms[priority]} | ${ms[fifo]} | ${ms[serial]} | $lane |"
    else
        echo "| $1 | $2 | $8: does not fit ($mem; budgets $3, $4) | | | | |"
    fi
}

echo "| model | profile | plan | priority ms | fifo ms | serial ms | busiest lane (priority) |"
echo "| --- | --- | --- | ---: | ---: | ---: | --- |"
for m in llama3-8b llama2-13b llama3-70b; do
    for p in $PROFILES; do
        IFS=: read -r prof dev host <<< "$p"
        plan_row "$m" "$prof" "$dev" "$host" "offload_params=1,offload_optim=1,ckpt=L,micro=$B" $B $T full
        # the tuner's pick per schedule
        declare -A plan=() ms=()
        status="" why="" lane=""
        for s in $MODES; do
            r=$(tune_row "$m" "$prof" "$dev" "$host" "$s")
            if [ "${r%% *}" = no ]; then status=no why=${r#no }; break; fi
            IFS='|' read -r pl t l <<< "${r#ok }"
            plan[$s]=$pl ms[$s]=$t
            [ "$s" = priority ] && lane=$l
        done
        if [ "$status" = no ]; then
            echo "| $m | $prof | tuned: no plan fits ($why) | | | | |"
            continue
        fi
        other=""
        for s in fifo serial; do
            [ "${plan[$s]}" = "${plan[priority]}" ] || other="$other; $s picks ${plan[$s]}"
        done
        echo "| $m | $prof | tuned: ${plan[priority]}$other | ${ms[priority]} | ${ms[fifo]} | ${ms[serial]} | $lane |"
    done
done
# bench/gpu/check.sh's runs, on the H200's profile
for g in "offload_params=0,offload_optim=0,micro=8:all-resident" \
         "offload_params=0.5,offload_optim=1,micro=8:check.sh offload"; do
    plan_row gpt2-124m h200-141gb 139.1GiB 128GiB "${g%%:*}" 8 1024 "${g#*:}"
done
