#!/usr/bin/env bash
# bench/sched.sh — the scheduler's gain, all modes in one run, on the cpu backend with
# emulated PCIe: serial, fifo and priority schedules of the same offloaded plan (same
# graph, bit-identical results), median step time over the steps after the first, the
# busiest lane's busy time per step (priority run's trace: the lower bound), and the
# simulator's prediction of the priority step time from the serial run's task times.
#
# usage: bench/sched.sh [build dir] [extra ferry train flags...]
# Compute gets one core (--threads 1) and the CPU optimizer the other (--adam-threads 1).
set -euo pipefail
build=${1:-build}; shift || true
ferry="$build/ferry"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
steps=${STEPS:-60}
common=(--model gpt2-mini --channels 768 --layers 4 --heads 12 --batch 1 --seq 24
        --steps "$steps" --offload-params 0.5 --offload-optim 1 --sim-pcie-gbps 3
        --threads 1 --adam-threads 1 --log-every 1000 --quiet "$@")
for mode in serial fifo priority; do
    extra=()
    [ "$mode" = serial ] && extra=(--predict)
    [ "$mode" = priority ] && extra=(--trace "$out/priority.json")
    "$ferry" train "${common[@]}" --schedule "$mode" --metrics "$out/$mode.jsonl" "${extra[@]}" \
        > "$out/$mode.out"
done
/usr/bin/env python3 - "$out" "$steps" <<'PY'
import json, statistics, sys, collections, re
out, steps = sys.argv[1], int(sys.argv[2])
med = {}
for mode in ("serial", "fifo", "priority"):
    ms = [json.loads(l)["step_ms"] for l in open(f"{out}/{mode}.jsonl")]
    med[mode] = statistics.median(ms[1:])
ev = [e for e in json.load(open(f"{out}/priority.json"))["traceEvents"] if e.get("ph") == "X"]
busy = collections.defaultdict(float)
for e in ev: busy[e["cat"] if False else e["tid"]] += e["dur"] / 1e3
lanes = {0: "compute", 1: "h2d", 2: "d2h", 3: "cpu"}
per_step = {lanes[k]: v / steps for k, v in busy.items()}
bound_lane = max(per_step, key=per_step.get)
bound = per_step[bound_lane]
pred_line = [l for l in open(f"{out}/serial.out") if l.startswith("predict")][0]
pred = float(re.search(r"priority ([0-9.]+) ms/step", pred_line).group(1))
res = {
    "serial_ms": med["serial"], "fifo_ms": med["fifo"], "priority_ms": med["priority"],
    "priority_vs_serial": med["serial"] / med["priority"],
    "priority_vs_fifo": med["fifo"] / med["priority"],
    "lane_busy_ms_per_step": per_step, "busiest_lane": bound_lane,
    "priority_vs_lower_bound": med["priority"] / bound,
    "simulated_priority_ms": pred,
    "simulator_error": abs(pred - med["priority"]) / med["priority"],
}
print(f"{'mode':10s} {'median step ms':>15s}")
for m in ("serial", "fifo", "priority"): print(f"{m:10s} {med[m]:15.1f}")
print("lane busy ms/step (priority):", {k: round(v, 1) for k, v in per_step.items()})
print(f"priority vs serial {res['priority_vs_serial']:.2f}x (target >= 1.5), vs fifo "
      f"{res['priority_vs_fifo']:.2f}x (target >= 1.15), vs lower bound "
      f"{res['priority_vs_lower_bound']:.2f}x (target <= 1.15), simulator error "
      f"{100 * res['simulator_error']:.1f}% (target <= 10%)")
print(json.dumps(res))
PY
