#!/usr/bin/env bash
# tokenize_test.sh — scripts/tokenize.py against tokenizers built here (no download).
#
# Two tokenizers are trained or built in a temporary directory with the `tokenizers`
# package: a byte-level BPE of a few hundred entries (uint16 shards) and a WordLevel one
# of 70001 entries (over 65536: uint32 shards). For each, the shards' headers and tokens
# must equal tokenizer.encode(text).ids, split by --shard-tokens and --val-fraction as
# documented, and ferry must train a step on them. Bad input must fail with exit 1, one
# `tokenize: error:` line and no file left behind.
#
# Exit 0 passes, 1 fails, 77 skips (meson's code) when python3 lacks `tokenizers`.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SCRIPT=$ROOT/scripts/tokenize.py
FERRY_BIN=${FERRY_BIN:-$ROOT/build/ferry}
if ! python3 -c 'import tokenizers' 2>/dev/null; then
    echo "skipped: python3 cannot import tokenizers (python3 -m pip install tokenizers)"
    exit 77
fi
DIR=$(mktemp -d /tmp/ferry-tokenize-XXXXXX)
trap 'rm -rf "$DIR"' EXIT
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }

# ---- the tokenizers and the text ----
cat > "$DIR/text.txt" <<'EOF'
First Citizen: Before we proceed any further, hear me speak.
All: Speak, speak. Café, naïve, 東京 and a snowman ☃ are text too.

Second Citizen: We are accounted poor citizens, the patricians good.
What authority surfeits on would relieve us: if they would yield us but the superfluity.
EOF
mkdir -p "$DIR/bpe" "$DIR/wide" "$DIR/empty"
python3 - "$DIR" <<'EOF' || { echo "FAIL: cannot build the tokenizers"; exit 1; }
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
d = sys.argv[1]
lines = open(f"{d}/text.txt", encoding="utf-8").read().splitlines()
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.train_from_iterator(lines, trainers.BpeTrainer(
    vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
bpe.save(f"{d}/bpe/tokenizer.json")
vocab = {f"w{i}": i for i in range(70000)}
vocab["[UNK]"] = 70000
wide = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
wide.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
wide.save(f"{d}/wide/tokenizer.json")
EOF
python3 -c 'import random; r = random.Random(7)
print(" ".join("w%d" % r.choice([0, 1, 65535, 65536, 69999, r.randrange(70000)]) for _ in range(300)), "oov")' \
    > "$DIR/words.txt"

# check.py TOKENIZER PREFIX SPLIT... TEXT... -- asserts the shards of the splits, read in
# order and concatenated, are the text files' ids (EOS-terminated with --eos, the last
# fraction F of each file in the val split with --val F), each shard full but the last.
cat > "$DIR/check.py" <<'EOF'
import argparse, glob, struct, sys
from tokenizers import Tokenizer
p = argparse.ArgumentParser()
p.add_argument("tok"); p.add_argument("prefix"); p.add_argument("texts", nargs="+")
p.add_argument("--shard", type=int, default=10**8); p.add_argument("--val", type=float, default=0)
p.add_argument("--eos", action="store_true"); p.add_argument("--wide", action="store_true")
a = p.parse_args()
tok = Tokenizer.from_file(a.tok)
want = {"train": [], "val": []}
for path in a.texts:
    ids = tok.encode(open(path, encoding="utf-8").read()).ids
    ids += [tok.token_to_id("<|endoftext|>")] if a.eos else []
    nval = round(len(ids) * a.val)
    want["train"] += ids[:len(ids) - nval]
    want["val"] += ids[len(ids) - nval:]
magic, version, fmt = (20240801, 7, "I") if a.wide else (20240520, 1, "H")
for split in ("train", "val") if a.val else ("train",):
    got, paths = [], sorted(glob.glob(f"{a.prefix}_{split}_*.bin"))
    assert paths == [f"{a.prefix}_{split}_{i:06d}.bin" for i in range(len(paths))], paths
    for k, path in enumerate(paths):
        b = open(path, "rb").read()
        hdr = struct.unpack("<256i", b[:1024])
        assert hdr[:2] == (magic, version), (path, hdr[:3])
        assert len(b) == 1024 + hdr[2] * struct.calcsize(fmt), (path, hdr[2], len(b))
        assert hdr[2] == a.shard or (k == len(paths) - 1 and 0 < hdr[2] <= a.shard), (path, hdr[2])
        got += struct.unpack(f"<{hdr[2]}{fmt}", b[1024:])
    assert got == want[split], (split, len(got), len(want[split]), got[:20], want[split][:20])
    assert not glob.glob(f"{a.prefix}*.tmp"), "a temporary file is left"
print(tok.get_vocab_size())
EOF

# run_ok NAME ARGS...: the script succeeds
run_ok() {
    local name=$1; shift
    python3 "$SCRIPT" "$@" > "$DIR/out" 2> "$DIR/err" || { fail "$name: exit $? ($(cat "$DIR/err"))"; return 1; }
}
# check NAME ARGS...: check.py passes; sets V to the vocabulary size
check() {
    local name=$1; shift
    V=$(python3 "$DIR/check.py" "$@" 2>&1) || { fail "$name: $V"; return 1; }
}
# train NAME DATA: ferry trains one step on DATA with the vocabulary V
train() {
    "$FERRY_BIN" train --data "$2" --model gpt2-tiny --vocab "$V" --steps 1 --batch 1 --seq 8 \
        --device cpu --quiet > "$DIR/ferry.log" 2>&1 || fail "$1: ferry exit $?: $(tail -3 "$DIR/ferry.log")"
}

# ---- uint16: one shard, then small shards and a validation split, then EOS ----
run_ok "bpe" --tokenizer "$DIR/bpe" --out "$DIR/b" "$DIR/text.txt" &&
    check "bpe" "$DIR/bpe/tokenizer.json" "$DIR/b" "$DIR/text.txt" &&
    train "bpe" "$DIR/b_train_000000.bin"
run_ok "bpe shards" --tokenizer "$DIR/bpe" --out "$DIR/s" --shard-tokens 37 --val-fraction 0.2 \
        "$DIR/text.txt" "$DIR/text.txt" &&
    check "bpe shards" "$DIR/bpe/tokenizer.json" "$DIR/s" "$DIR/text.txt" "$DIR/text.txt" \
        --shard 37 --val 0.2 &&
    train "bpe shards" "$DIR/s_train_*.bin"
# a second run with larger shards leaves no shard of the first behind
run_ok "bpe rerun" --tokenizer "$DIR/bpe" --out "$DIR/s" --shard-tokens 1k --val-fraction 0.2 \
        "$DIR/text.txt" "$DIR/text.txt" &&
    check "bpe rerun" "$DIR/bpe/tokenizer.json" "$DIR/s" "$DIR/text.txt" "$DIR/text.txt" \
        --shard 1000 --val 0.2
run_ok "bpe eos" --tokenizer "$DIR/bpe/tokenizer.json" --out "$DIR/e" --append-eos \
        "$DIR/text.txt" "$DIR/text.txt" &&
    check "bpe eos" "$DIR/bpe/tokenizer.json" "$DIR/e" "$DIR/text.txt" "$DIR/text.txt" --eos

# ---- uint32: a vocabulary of 70001 ----
run_ok "wide" --tokenizer "$DIR/wide" --out "$DIR/w" --shard-tokens 100 "$DIR/words.txt" &&
    check "wide" "$DIR/wide/tokenizer.json" "$DIR/w" "$DIR/words.txt" --shard 100 --wide &&
    { [ "$V" = 70001 ] || fail "wide: vocabulary $V, want 70001"; } &&
    train "wide" "$DIR/w_train_*.bin"

# ---- bad input: exit 1, one error line, nothing written ----
printf '\xff\xfe not utf-8\n' > "$DIR/latin.txt"
bad() {
    local name=$1; shift
    rm -f "$DIR"/x_*
    python3 "$SCRIPT" "$@" > /dev/null 2> "$DIR/err"
    local rc=$?
    [ "$rc" = 1 ] || fail "$name: exit $rc, want 1"
    [ "$(wc -l < "$DIR/err")" = 1 ] && grep -q '^tokenize: error: ' "$DIR/err" ||
        fail "$name: want one 'tokenize: error:' line, got: $(cat "$DIR/err")"
    ! ls "$DIR"/x_* > /dev/null 2>&1 || fail "$name: left $(ls "$DIR"/x_*)"
}
bad "no tokenizer.json" --tokenizer "$DIR/empty" --out "$DIR/x" "$DIR/text.txt"
bad "not a tokenizer" --tokenizer "$DIR/text.txt" --out "$DIR/x" "$DIR/text.txt"
bad "missing input" --tokenizer "$DIR/bpe" --out "$DIR/x" "$DIR/text.txt" "$DIR/absent.txt"
bad "not utf-8" --tokenizer "$DIR/bpe" --out "$DIR/x" "$DIR/latin.txt"
bad "input is a directory" --tokenizer "$DIR/bpe" --out "$DIR/x" "$DIR/empty"
bad "bad count" --tokenizer "$DIR/bpe" --out "$DIR/x" --shard-tokens 12x "$DIR/text.txt"
bad "zero count" --tokenizer "$DIR/bpe" --out "$DIR/x" --shard-tokens 0 "$DIR/text.txt"
bad "bad fraction" --tokenizer "$DIR/bpe" --out "$DIR/x" --val-fraction 1.5 "$DIR/text.txt"
bad "no files" --tokenizer "$DIR/bpe" --out "$DIR/x"
bad "unwritable output" --tokenizer "$DIR/bpe" --out "$DIR/no/such/dir/x" "$DIR/text.txt"
: > "$DIR/blank.txt"
bad "no tokens" --tokenizer "$DIR/bpe" --out "$DIR/x" "$DIR/blank.txt"
bad "no eos" --tokenizer "$DIR/wide" --out "$DIR/x" --append-eos "$DIR/words.txt"
# an input that is one of the shards the run writes or removes: named so, through a
# symbolic link, or a hard link of one; refused with one line, the input byte for byte
# as it was
refused() { # NAME WANT INPUT: the run with --out $DIR/y (shard-tokens 37) on INPUT
    local sum; sum=$(cksum < "$3")
    python3 "$SCRIPT" --tokenizer "$DIR/bpe" --out "$DIR/y" --shard-tokens 37 "$3" > /dev/null 2> "$DIR/err"
    local rc=$?
    [ "$rc" = 1 ] && [ "$(wc -l < "$DIR/err")" = 1 ] && grep -q "^tokenize: error: .*$2" "$DIR/err" ||
        fail "$1: exit $rc: $(cat "$DIR/err")"
    [ "$(cksum < "$3")" = "$sum" ] || fail "$1: the input changed"
}
cp "$DIR/text.txt" "$DIR/y_train_000002.bin"
refused "input is an output" "one of the shards" "$DIR/y_train_000002.bin"
ln -s "$DIR/y_train_000002.bin" "$DIR/link.txt"
refused "input links to an output" "one of the shards" "$DIR/link.txt"
rm -f "$DIR"/y_* "$DIR/link.txt"
run_ok "before the hard link" --tokenizer "$DIR/bpe" --out "$DIR/y" --shard-tokens 37 "$DIR/text.txt"
ln "$DIR/y_train_000001.bin" "$DIR/hard.txt"
refused "hard link of an output" "hard link" "$DIR/hard.txt"
# a link planted at a shard's temporary name is replaced, not written through
rm -f "$DIR"/y_*
cp "$DIR/text.txt" "$DIR/in3.txt"
ln -s "$DIR/in3.txt" "$DIR/y_train_000000.bin.tmp"
sum=$(cksum < "$DIR/in3.txt")
run_ok "a link at a temporary name" --tokenizer "$DIR/bpe" --out "$DIR/y" "$DIR/in3.txt" &&
    check "a link at a temporary name" "$DIR/bpe/tokenizer.json" "$DIR/y" "$DIR/text.txt"
[ "$(cksum < "$DIR/in3.txt")" = "$sum" ] || fail "a link at a temporary name: the input changed"
python3 "$SCRIPT" --help > "$DIR/help" 2>&1 && grep -q -- '--shard-tokens' "$DIR/help" ||
    fail "--help: $(cat "$DIR/help")"

[ "$FAILED" = 0 ] && echo "tokenize_test: all checks passed"
exit "$FAILED"
