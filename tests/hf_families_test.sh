#!/usr/bin/env bash
# hf_families_test.sh — the acceptance test of each Llama-like family ferry reads from a
# Hugging Face directory (qwen2, qwen3, mistral, gemma2, gemma3_text, phi3; llama as the
# plumbing's control). For each family (tests/ref/hf_family_check.py does transformers' part):
#   (a) transformers builds a random model from its own config class (fixed seed, norms,
#       biases and projections perturbed so none is trivial; gen_family_ref.py's shapes)
#       and saves it as float32 safetensors shards;
#   (b) ferry eval of that directory on batch 1 is within 1e-4 relative of transformers'
#       float64 loss (ferry computes in fp32; 1e-4 leaves room for fp32 rounding over a
#       few layers, while every feature of the fixtures moves the loss by > 1e-3);
#   (c) ferry train --steps 3 (AdamW lr 1e-3, betas 0.9/0.95, eps 1e-8, decay 0.1 on 2-D
#       tensors, constant lr, no warmup, no clipping) against transformers + torch AdamW in
#       float64 on the same batches: each step's loss within 1e-4 relative;
#   (d) ferry's --save directory loads into transformers strictly
#       (tests/ref/check_hf_load.py: no missing, unexpected or mismatched key) and gives
#       the loss ferry's eval of it gives (1e-5 relative, fp32 on both sides).
# One ok:/FAIL: line per family and check; exit 1 on any failure. FAMILIES="qwen2 phi3"
# runs a subset.
#
# Needs a Python with torch and transformers: $FERRY_HF_PYTHON, else python3; exit 77
# (skipped) without one. CI has none (torch is large); run it where one is.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FERRY_BIN=${FERRY_BIN:-$ROOT/build/ferry}
PY=${FERRY_HF_PYTHON:-python3}
if ! "$PY" -c 'import torch, transformers' 2>/dev/null; then
    echo "skipped: $PY cannot import torch and transformers (set FERRY_HF_PYTHON)"
    exit 77
fi
FAMILIES=${FAMILIES:-"llama qwen2 qwen3 mistral gemma2 gemma3_text phi3"}
TOOL=$ROOT/tests/ref/hf_family_check.py
TOK=$ROOT/tests/fixtures/gpt2_tiny_tokens.bin
DIR=$(mktemp -d /tmp/ferry-hf-fam-XXXXXX)
trap 'rm -rf "$DIR"' EXIT
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
STEPS=3
OPT=(--lr 1e-3 --lr-schedule const --warmup 0 --beta1 0.9 --beta2 0.95 --eps 1e-8
     --weight-decay 0.1 --clip 0)

json_get() { # key: reads one JSON object (the last line) on stdin
    "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])[sys.argv[1]])' "$1"
}
within() { # a b rel: |a - b| <= rel * |b|
    "$PY" -c 'import sys; a, b, r = map(float, sys.argv[1:]); sys.exit(0 if abs(a - b) <= r * abs(b) else 1)' "$@"
}
ferry_loss() { # dir; ferry's error goes to stderr, the status to the caller
    local out
    out=$("$FERRY_BIN" eval --init "$1" --data "$TOK" --batch 4 --seq 32 --batches 1 \
        --device cpu --quiet) || return 1
    echo "$out" | json_get loss
}

for fam in $FAMILIES; do
    d=$DIR/$fam
    mkdir -p "$d"
    # (a)
    if ! "$PY" "$TOOL" make "$fam" "$d/src" > "$d/make.json"; then
        fail "$fam: transformers cannot build the model"; continue
    fi
    # (b)
    theirs=$("$PY" "$TOOL" loss "$d/src" --tokens "$TOK" | json_get loss) \
        || { fail "$fam: transformers cannot evaluate its own directory"; continue; }
    if ! ours=$(ferry_loss "$d/src"); then
        fail "$fam: ferry cannot evaluate the transformers directory"; continue
    fi
    if within "$ours" "$theirs" 1e-4; then
        echo "ok: $fam eval: ferry $ours, transformers (float64) $theirs"
    else
        fail "$fam eval: ferry $ours, transformers (float64) $theirs"
    fi
    # (c)
    tl=$("$PY" "$TOOL" train "$d/src" --tokens "$TOK" --steps $STEPS --lr 1e-3 --beta1 0.9 \
        --beta2 0.95 --eps 1e-8 --weight-decay 0.1 | json_get losses) \
        || { fail "$fam: transformers cannot train"; continue; }
    if ! "$FERRY_BIN" train --init "$d/src" --device cpu --threads 2 --batch 4 --seq 32 \
        --data "$TOK" --steps $STEPS "${OPT[@]}" --metrics "$d/metrics.jsonl" \
        --save "$d/out" --save-shard-size 100KB --quiet > "$d/train.log" 2>&1; then
        fail "$fam: ferry train: $(tail -n 1 "$d/train.log")"; continue
    fi
    if "$PY" - "$d/metrics.jsonl" "$tl" <<'EOF'
import json, sys
ours = [json.loads(l)["loss"] for l in open(sys.argv[1]) if l.strip()]
theirs = json.loads(sys.argv[2])
bad = len(ours) != len(theirs) or any(abs(a - b) > 1e-4 * abs(b) for a, b in zip(ours, theirs))
print(" ".join("%.7f/%.7f" % p for p in zip(ours, theirs)))
sys.exit(1 if bad else 0)
EOF
    then echo "ok: $fam train: $STEPS steps' losses (ferry/transformers) agree within 1e-4"
    else fail "$fam train: per-step losses (ferry/transformers) differ by more than 1e-4"
    fi
    # (d)
    if ! out=$("$PY" "$ROOT/tests/ref/check_hf_load.py" "$d/out" --tokens "$TOK" --batch 4 --seq 32); then
        fail "$fam: transformers does not load ferry's saved directory strictly"; continue
    fi
    theirs=$(echo "$out" | json_get loss)
    ours=$(ferry_loss "$d/out") || { fail "$fam: ferry cannot evaluate its saved directory"; continue; }
    if within "$ours" "$theirs" 1e-5; then
        echo "ok: $fam save: loads strictly; ferry $ours, transformers $theirs"
    else
        fail "$fam save: ferry $ours, transformers $theirs"
    fi
done
exit $FAILED
