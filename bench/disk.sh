#!/usr/bin/env bash
# disk.sh — the disk tier on this machine: a fully offloaded bf16 gpt2-124m with every
# fp32 master and moment on disk (--disk-optim 1), its step time against its disk lane's
# busy time (from the run's own trace: the lanes' work in the steady steps), beside the
# disk's sequential rates measured through ferry's own I/O path (ferry probe --disk-dir)
# in the same run; and the same run's ms/step against the plan with the state in host
# memory (the disk tier's cost). ROUNDS alternated rounds, medians.
# Usage: bench/disk.sh [BUILD_DIR] [DISK_DIR]  (DISK_DIR: on the disk to measure; default
# a new directory under /var/tmp). Prints a summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/build}/ferry
base_dir=${2:-/var/tmp}
rounds=${ROUNDS:-3}
tmp=$(mktemp -d "$base_dir/ferry-disk-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/scratch" "$tmp/probe"

median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}'; }
ms_of() { grep '^done' | sed -E 's/.* ([0-9.]+) ms\/step.*/\1/'; }

run=(train --model gpt2-124m --device cpu --dtype "${DTYPE:-fp32}" --seq "${SEQ:-64}" --batch 1 --steps 8
     --val-batches 1 --offload-params 1 --offload-optim 1)
"$bin" probe --disk-dir "$tmp/probe" --out "$tmp/profile.json" >"$tmp/probe.log" 2>&1 || { cat "$tmp/probe.log"; exit 1; }
grep -i disk "$tmp/probe.log" | sed 's/^/probe: /'
: >"$tmp/disk"; : >"$tmp/host"; : >"$tmp/ratio"
for ((i = 0; i < rounds; i++)); do
    "$bin" "${run[@]}" --disk-optim 1 --disk-dir "$tmp/scratch" --trace "$tmp/trace.json" 2>&1 | ms_of >>"$tmp/disk"
    "$bin" "${run[@]}" 2>&1 | ms_of >>"$tmp/host"
    python3 - "$tmp/trace.json" "$(tail -1 "$tmp/disk")" >>"$tmp/ratio" <<'PY'
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
x = [e for e in ev if e.get("ph") == "X"]
# the steady steps: from the end of the first step's last task on ("it 0" is the first)
first = max(e["ts"] + e["dur"] for e in x if " it 0" in e["name"])
busy = {}
for e in x:
    if e["ts"] >= first:
        busy[names[e["tid"]]] = busy.get(names[e["tid"]], 0) + e["dur"]
end = max(e["ts"] + e["dur"] for e in x)
steps = len({e["name"].split(" it ")[1] for e in x if e["ts"] >= first and e["name"].startswith("norm")})
span = (end - first) / 1e3 / steps
lanes = " ".join(f"{k} {v / 1e3 / steps:.0f}" for k, v in sorted(busy.items()))
print(f"{span / (busy['disk'] / 1e3 / steps):.3f} {span:.1f} {busy['disk'] / 1e3 / steps:.1f} {lanes}")
PY
done
d=$(median <"$tmp/disk"); h=$(median <"$tmp/host")
echo "gpt2-124m ${DTYPE:-fp32}, fully offloaded, seq ${SEQ:-64} x batch 1: state on disk $d ms/step, in host memory $h ms/step, disk/host $(awk -v a="$d" -v b="$h" 'BEGIN {printf "%.3f", a / b}')"
echo "traced (steady steps of each disk run: step ms over disk-lane busy ms, step ms, disk busy ms, every lane's busy ms a step):"
sed 's/^/  /' "$tmp/ratio"
echo "median step / disk-lane busy: $(cut -d' ' -f1 "$tmp/ratio" | median)"
