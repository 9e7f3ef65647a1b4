#!/usr/bin/env python3
"""check_util.py — the figures of bench/gpu/check.sh, read from ferry's own outputs.

Subcommands (each prints what check.sh records, as `key value` lines, or writes a file):
  json FIGURES OUT        check.json from the figures file (lines `phase<TAB>key<TAB>value`,
                          value a JSON literal or else a string; the last of a key wins),
                          written to OUT.tmp and renamed, so a reader never sees half a file
  steps METRICS SKIP      a run's step times and losses from its --metrics file (JSON
                          Lines): the median step_ms after the first SKIP steps, the loss
                          of the first and last of those steps, whether every loss is
                          finite and whether the last is below the first
  compare A B TOL         two runs' losses step by step: the largest relative difference
                          |a - b| / |b| and whether every step is within TOL (and finite)
  overlap TRACE           a Chrome trace from `ferry train --trace`: of the copy lanes'
                          busy time (h2d, d2h), the fraction that overlaps compute, the
                          first step's tasks left out (they wait on nothing before them)
Only the standard library: the device machine and CI both have python3.
"""
import json
import math
import os
import statistics
import sys


def metrics(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return [r for r in rows if "loss" in r]


def cmd_json(figures, out):
    doc, phases = {}, {}
    with open(figures) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t", 2)
            if len(parts) != 3:
                continue
            phase, key, raw = parts
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            if phase == "-":
                doc[key] = value
            else:
                phases.setdefault(phase, {})[key] = value
    doc["phases"] = phases
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, out)


def cmd_steps(path, skip):
    rows = metrics(path)
    skip = min(int(skip), max(len(rows) - 2, 0))
    measured = rows[skip:]
    if not measured:
        print("steps 0")
        return
    losses = [r["loss"] for r in measured]
    finite = all(math.isfinite(x) for x in losses)
    print(f"steps {len(rows)}")
    print(f"median_step_ms {statistics.median(r['step_ms'] for r in measured):.3f}")
    print(f"first_loss {losses[0]:.6f}")
    print(f"last_loss {losses[-1]:.6f}")
    print(f"finite {str(finite).lower()}")
    print(f"falling {str(finite and losses[-1] < losses[0]).lower()}")


def cmd_compare(a_path, b_path, tol):
    a, b = metrics(a_path), metrics(b_path)
    n = min(len(a), len(b))
    worst, ok = 0.0, n > 0 and len(a) == len(b)
    for x, y in zip(a[:n], b[:n]):
        la, lb = x["loss"], y["loss"]
        rel = abs(la - lb) / abs(lb) if lb else math.inf
        if not (math.isfinite(la) and math.isfinite(lb)):
            rel = math.inf
        worst = max(worst, rel)
        ok = ok and rel <= float(tol)
    print(f"steps {n}")
    print(f"max_rel_diff {worst:.3e}")
    print(f"within {str(ok).lower()}")


def union(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def covered(s, e, merged):
    """Length of [s, e) inside the merged (sorted, disjoint) intervals."""
    total = 0.0
    for a, b in merged:
        if b <= s:
            continue
        if a >= e:
            break
        total += min(b, e) - max(a, s)
    return total


def cmd_overlap(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    lanes = {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            lanes[ev["tid"]] = ev["args"]["name"]
    spans = {"compute": [], "copy": []}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("args", {}).get("iter", 0) == 0:
            continue
        lane = lanes.get(ev["tid"])
        kind = "compute" if lane == "compute" else "copy" if lane in ("h2d", "d2h") else None
        if kind:
            spans[kind].append((ev["ts"], ev["ts"] + ev["dur"]))
    compute = union(spans["compute"])
    copy_us = sum(e - s for s, e in spans["copy"])
    both_us = sum(covered(s, e, compute) for s, e in spans["copy"])
    print(f"copy_busy_ms {copy_us / 1e3:.3f}")
    print(f"compute_busy_ms {sum(e - s for s, e in compute) / 1e3:.3f}")
    print(f"copy_overlap {both_us / copy_us if copy_us else 0.0:.4f}")


def main(argv):
    cmds = {"json": (cmd_json, 2), "steps": (cmd_steps, 2), "compare": (cmd_compare, 3),
            "overlap": (cmd_overlap, 1)}
    if len(argv) < 2 or argv[1] not in cmds or len(argv) - 2 != cmds[argv[1]][1]:
        sys.exit(f"usage: {argv[0]} json FIGURES OUT | steps METRICS SKIP | compare A B TOL | "
                 "overlap TRACE")
    cmds[argv[1]][0](*argv[2:])


if __name__ == "__main__":
    main(sys.argv)
