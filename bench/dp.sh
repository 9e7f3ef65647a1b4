#!/usr/bin/env bash
# dp.sh — data parallel on the cpu backend, measured as ratios within one run:
#   1. unlike ranks: --sim-slowdown 1,2 with --batch-shares equal against auto
#      (the same 4 micro-batches a step), alternated ROUNDS times, median ms/step;
#   2. weak scaling: 1 process against 2 (the same micro-batch per process, 1 thread
#      each, emulated PCIe, a mixed offload plan), alternated, median ms/step; and the
#      2-process run's trace: how much of the comm lane's busy time lies inside the
#      compute lane's (the reduces overlapping backward, the allgathers the next forward);
#   3. ZeRO: the host bytes of 2 processes' --dry-run memory models against one
#      process's, a fully offloaded gpt2-124m in bf16 and fp32.
# Usage: bench/dp.sh [BUILD_DIR]  (default build; needs mpirun). Prints a summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/build}/ferry
rounds=${ROUNDS:-5}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
tmp=$(mktemp -d /tmp/ferry-dp-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

ms_of() { grep '^done' | sed -E 's/.* ([0-9.]+) ms\/step.*/\1/'; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
mpi() { mpirun -np 2 --oversubscribe "$bin" "$@"; }

base=(train --model gpt2-tiny --device cpu --threads 1 --batch 4 --seq 64 --steps 30 --val-batches 1)
: >"$tmp/equal"; : >"$tmp/auto"
for ((i = 0; i < rounds; i++)); do
    mpi "${base[@]}" --grad-accum 2 --sim-slowdown 1,2 --batch-shares equal 2>&1 | ms_of >>"$tmp/equal"
    mpi "${base[@]}" --grad-accum 2 --sim-slowdown 1,2 --batch-shares auto 2>&1 | ms_of >>"$tmp/auto"
done
eq=$(median <"$tmp/equal"); au=$(median <"$tmp/auto")
echo "unlike ranks (--sim-slowdown 1,2, 4 micro-batches of 4 x 64 a step): equal $eq ms/step, auto $au ms/step, auto/equal $(awk -v a="$au" -v e="$eq" 'BEGIN {printf "%.3f", a / e}')"

weak=(train --model gpt2-mini --device cpu --threads 1 --batch 4 --seq 64 --steps 30 --val-batches 1
      --sim-pcie-gbps 2 --offload-params 0.5 --offload-optim 0.5)
: >"$tmp/one"; : >"$tmp/two"
for ((i = 0; i < rounds; i++)); do
    "$bin" "${weak[@]}" 2>&1 | ms_of >>"$tmp/one"
    mpi "${weak[@]}" 2>&1 | ms_of >>"$tmp/two"
done
one=$(median <"$tmp/one"); two=$(median <"$tmp/two")
echo "weak scaling (gpt2-mini, 4 x 64 per process, half offloaded, 2 GB/s emulated PCIe): 1 process $one ms/step, 2 processes $two ms/step, 2/1 $(awk -v a="$two" -v e="$one" 'BEGIN {printf "%.3f", a / e}')"

mpi "${weak[@]}" --steps 6 --trace "$tmp/trace.json" >/dev/null 2>&1
python3 - "$tmp/trace.json" <<'PY'
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
lane = {v: k for k, v in names.items()}
iv = lambda tid, pre="": sorted((e["ts"], e["ts"] + e["dur"]) for e in ev
                                if e.get("ph") == "X" and e["tid"] == tid and e["name"].startswith(pre))
comp = iv(lane["compute"])
for kind in ("reduce", "allgather"):
    comm = iv(lane["comm"], kind)
    busy = sum(b - a for a, b in comm)
    inside = sum(max(0, min(b, d) - max(a, c)) for a, b in comm for c, d in comp)
    print(f"trace (rank 0, 6 steps): {len(comm)} {kind}s, {busy / 1e3:.1f} ms on the comm lane, "
          f"{inside / busy * 100 if busy else 0:.0f}% of it while the compute lane ran")
PY

host_bytes() { grep -o '"host_bytes":[0-9]*' | cut -d: -f2 | paste -sd+ | bc; }
for dt in bf16 fp32; do
    dry=(train --model gpt2-124m --device cpu --dry-run --offload-params 1 --offload-optim 1 --dtype "$dt")
    h1=$("$bin" "${dry[@]}" 2>&1 | host_bytes); h2=$(mpi "${dry[@]}" 2>&1 | host_bytes)
    echo "ZeRO host bytes (gpt2-124m fully offloaded, $dt): 1 process $h1, 2 processes $h2 together, 2/1 $(awk -v a="$h2" -v e="$h1" 'BEGIN {printf "%.3f", a / e}')"
done
