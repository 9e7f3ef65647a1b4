#!/usr/bin/env bash
# hf_transformers_test.sh — directories ferry writes load into transformers strictly (no
# key missing, unexpected or mismatched: tests/ref/check_hf_load.py) and give transformers
# the loss ferry computes on them:
#   - the random Llama transformers saved (tests/fixtures/llama_hf_tiny), trained one step
#     by ferry and saved as shards (fp32) and as bf16;
#   - a tied Llama (tests/fixtures/llama_tied_init.safetensors with a config.json written
#     here from its reference), trained a step and saved;
#   - GPT-2 trained from scratch and saved (GPT2LMHeadModel, names under transformer.).
# Losses agree within 1e-5 relative (fp32 on both sides; bf16 weights are read as the
# same fp32 values by both).
#
# Needs a Python with torch and transformers: $FERRY_HF_PYTHON, else python3; exit 77
# (skipped) without one. CI has none (torch is large); run it where one is.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FERRY_BIN=${FERRY_BIN:-$ROOT/build/ferry}
FIX=$ROOT/tests/fixtures
PY=${FERRY_HF_PYTHON:-python3}
if ! "$PY" -c 'import torch, transformers' 2>/dev/null; then
    echo "skipped: $PY cannot import torch and transformers (set FERRY_HF_PYTHON)"
    exit 77
fi
DIR=$(mktemp -d /tmp/ferry-hf-XXXXXX)
trap 'rm -rf "$DIR"' EXIT
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
TOK=$FIX/gpt2_tiny_tokens.bin
COMMON=(--device cpu --threads 2 --batch 4 --seq 32 --data "$TOK" --quiet)

# ferry's loss on the first batch of the tokens
ferry_loss() {
    "$FERRY_BIN" eval --init "$1" --data "$TOK" --batch 4 --seq 32 --batches 1 --device cpu \
        | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["loss"])'
}

# transformers' loss, loading strictly; fails the test on any key problem
check() { # name dir
    local out
    if ! out=$("$PY" "$ROOT/tests/ref/check_hf_load.py" "$2" --tokens "$TOK" --batch 4 --seq 32); then
        fail "$1: transformers does not load $2 strictly"
        return
    fi
    local theirs ours
    theirs=$(echo "$out" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["loss"])')
    ours=$(ferry_loss "$2") || { fail "$1: ferry cannot evaluate $2"; return; }
    if "$PY" -c "import sys; a, b = $ours, $theirs; sys.exit(0 if abs(a - b) <= 1e-5 * abs(b) else 1)"; then
        echo "ok: $1: ferry $ours, transformers $theirs"
    else
        fail "$1: ferry $ours, transformers $theirs"
    fi
}

"$FERRY_BIN" train --init "$FIX/llama_hf_tiny" "${COMMON[@]}" --steps 1 --save "$DIR/llama" \
    --save-shard-size 100KB || fail "training from the transformers directory"
check "llama, sharded fp32" "$DIR/llama"
"$FERRY_BIN" train --init "$DIR/llama" "${COMMON[@]}" --steps 1 --save "$DIR/llama-bf16" \
    --save-dtype bf16 || fail "training from ferry's directory"
check "llama, bf16" "$DIR/llama-bf16"

mkdir -p "$DIR/tied-src"
cp "$FIX/llama_tied_init.safetensors" "$DIR/tied-src/model.safetensors"
"$PY" - "$FIX/llama_tied_ref.json" "$DIR/tied-src/config.json" <<'EOF' || fail "tied config"
import json, sys
c = json.load(open(sys.argv[1]))["config"]
json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
           "vocab_size": c["vocab"], "hidden_size": c["channels"], "intermediate_size": c["ffn"],
           "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
           "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"],
           "max_position_embeddings": c["max_seq"], "rms_norm_eps": c["rms_eps"],
           "rope_theta": c["rope_theta"], "rope_scaling": c["rope_scaling"],
           "tie_word_embeddings": True, "hidden_act": "silu"}, open(sys.argv[2], "w"))
EOF
"$FERRY_BIN" train --init "$DIR/tied-src" "${COMMON[@]}" --steps 2 --save "$DIR/tied" \
    || fail "training the tied Llama"
check "llama, tied" "$DIR/tied"

"$FERRY_BIN" train --model gpt2-tiny "${COMMON[@]}" --steps 3 --save "$DIR/gpt2" \
    --save-shard-size 100KB || fail "training GPT-2"
check "gpt2" "$DIR/gpt2"

exit $FAILED
