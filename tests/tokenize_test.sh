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
# --chat runs on the published chat templates of tests/fixtures/chat_templates (Llama 3,
# Llama 3.1, Qwen 2.5, Gemma 2, each with a small BPE of its own): every shard token and
# .mask bit must equal what the spec makes of transformers' apply_chat_template ids and
# masks (expected.json, from tests/ref/gen_chat_templates.py), for the three --loss-on
# modes, packed first-fit as the spec says (checked by a packer of the test's own); then
# --overlong, --skip-bad counts, stale shards and masks, each bad line (one error naming
# FILE:LINE, nothing written), a template that is not prefix-stable, a missing jinja2.
# Those checks are skipped, with a line saying so, when python3 lacks `jinja2`.
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
bad "unwritable output" --tokenizer "$DIR/bpe" --out "$DIR/text.txt/sub/x" "$DIR/text.txt"  # a file where its directory would be
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
# ---- conversations (--chat): the published templates of tests/fixtures/chat_templates ----
# The expected tokens and loss masks there come from transformers (tests/ref/gen_chat_templates.py);
# check_chat.py packs them by the spec on its own and compares every shard token and .mask bit.
CHAT=$ROOT/tests/fixtures/chat_templates
cat > "$DIR/check_chat.py" <<'EOF'
import argparse, glob, json, os, re, struct, zlib
from tokenizers import Tokenizer
p = argparse.ArgumentParser()
p.add_argument("template"); p.add_argument("mode"); p.add_argument("seq", type=int)
p.add_argument("prefix"); p.add_argument("summary")
p.add_argument("--val", type=float, default=0); p.add_argument("--shard", type=int, default=10**8)
p.add_argument("--overlong", default="truncate")
a = p.parse_args()
chat, S = os.environ["CHAT"], a.seq
cfg = json.load(open(f"{chat}/{a.template}/tokenizer_config.json"))
tok = Tokenizer.from_file(f"{chat}/{a.template}/tokenizer.json")
pad = tok.token_to_id(cfg.get("pad_token") or cfg["eos_token"])
kept, why, truncated = [], {"too long": 0, "bad line": 0, "no loss token": 0}, 0
for ex in json.load(open(f"{chat}/expected.json"))[a.template][a.mode]:
    if "error" in ex:
        why["bad line"] += 1
        continue
    ids, loss = ex["ids"], list(ex["loss"])
    if len(ids) > S:
        if a.overlong == "drop":
            why["too long"] += 1
            continue
        ids, loss = ids[:S], loss[:S]
        cut = True
    else:
        cut = False
    loss[0] = 0
    if not any(loss):
        why["no loss token"] += 1
        continue
    kept.append((ids, loss))
    truncated += cut
nval = round(len(kept) * a.val)
splits = {"train": kept[:len(kept) - nval]}
if a.val:
    splits["val"] = kept[len(kept) - nval:]
backfill = False
for split, examples in splits.items():
    bins = []  # first fit, in the spec's words: the first bin in creation order with room
    for ids, loss in examples:
        b = next((k for k, bn in enumerate(bins) if len(bn[0]) + len(ids) <= S), None)
        if b is None:
            bins.append(([], [], []))
            b = len(bins) - 1
        backfill |= b < len(bins) - 1
        bins[b][0].extend(ids); bins[b][1].extend(loss); bins[b][2].extend([1] + [0] * (len(ids) - 1))
    toks, loss, start = [], [], []
    for t, l, s in bins:
        room = S - len(t)
        toks += t + [pad] * room; loss += l + [0] * room; start += s + ([1] + [0] * (room - 1) if room else [])
    toks.append(pad); loss.append(0); start.append(1)
    K = min(a.shard, 2**31 - 2) // S * S
    paths = sorted(glob.glob(f"{a.prefix}_{split}_*.bin"))
    assert paths == [f"{a.prefix}_{split}_{i:06d}.bin" for i in range(len(paths))], paths
    masks = sorted(glob.glob(f"{a.prefix}_{split}_*.mask"))
    assert masks == [q[:-4] + ".mask" for q in paths], (paths, masks)
    at = 0
    for k, path in enumerate(paths):
        b = open(path, "rb").read()
        hdr = struct.unpack("<256i", b[:1024])
        n = hdr[2]
        assert hdr[:2] == (20240520, 1) and len(b) == 1024 + 2 * n, (path, hdr[:3], len(b))
        last = k == len(paths) - 1
        assert (n == K) if not last else (n % S == 1 and n <= K + 1), (path, n, K)
        assert list(struct.unpack(f"<{n}H", b[1024:])) == toks[at:at + n], (path, "tokens")
        m = open(path[:-4] + ".mask", "rb").read()
        mh = struct.unpack("<256i", m[:1024])
        nb = (n + 7) // 8
        crc = zlib.crc32(b[1024:])  # the mask's record of its shard's token bytes
        assert mh[:4] == (20261203, 1, n, S) and mh[4] % (1 << 32) == crc and not any(mh[5:]), (path, mh[:5])
        assert len(m) == 1024 + 2 * nb, (path, len(m))
        for field, want in ((m[1024:1024 + nb], loss[at:at + n]), (m[1024 + nb:], start[at:at + n])):
            got = [(field[i >> 3] >> (i & 7)) & 1 for i in range(8 * nb)]
            assert got == want + [0] * (8 * nb - n), (path, "bits", [i for i in range(n) if got[i] != want[i]][:10])
        at += n
    assert at == len(toks), (split, at, len(toks))
assert not glob.glob(f"{a.prefix}*.tmp"), "a temporary file is left"
out = open(a.summary).read()
m = re.search(r"examples: (\d+) read, (\d+) kept \((\d+) truncated to --seq \d+\), (\d+) dropped "
              r"\(too long (\d+), bad line (\d+), no loss token (\d+)\)", out)
total = len(kept) + sum(why.values())
want = (total, len(kept), truncated, total - len(kept), why["too long"], why["bad line"], why["no loss token"])
assert m and tuple(map(int, m.groups())) == want, (out, want)
print(" ".join(f"{k.replace(' ', '_')}={v}" for k, v in why.items()) + (" backfill" if backfill else ""))
EOF
# chat_ok NAME TEMPLATE MODE SEQ [OPTIONS... [-- CHECK_OPTIONS...]]: tokenize.py --chat
# --skip-bad on conv.jsonl with the options, then check_chat.py with its own; GOT = its counts
chat_ok() {
    local name=$1 t=$2 mode=$3 seq=$4 opts=()
    shift 4
    while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    rm -f "$DIR"/c_*
    python3 "$SCRIPT" --tokenizer "$CHAT/$t" --chat --loss-on "$mode" --seq "$seq" --skip-bad \
        --out "$DIR/c" "${opts[@]}" "$DIR/conv.jsonl" > "$DIR/out" 2> "$DIR/err" ||
        { fail "$name: exit $? ($(cat "$DIR/err"))"; return 1; }
    GOT=$(CHAT=$CHAT python3 "$DIR/check_chat.py" "$t" "$mode" "$seq" "$DIR/c" "$DIR/out" "$@" 2>&1) ||
        { fail "$name: $GOT"; return 1; }
}
# chat_bad NAME LINE WANT [TEMPLATE [OPTIONS...]]: LINE as the input's third line (after a
# blank one) fails the run with one error naming in.jsonl:3 and saying WANT, nothing written;
# the input is kept in allbad.jsonl for the --skip-bad count
chat_bad() {
    local name=$1 line=$2 want=$3 t=${4:-llama3}
    shift 3; [ $# -gt 0 ] && shift
    { head -n 1 "$CHAT/conversations.jsonl"; echo; printf '%s\n' "$line"; tail -n 1 "$CHAT/conversations.jsonl"; } > "$DIR/in.jsonl"
    rm -f "$DIR"/x_*
    python3 "$SCRIPT" --tokenizer "$CHAT/$t" --chat --seq 128 --out "$DIR/x" "$@" "$DIR/in.jsonl" > /dev/null 2> "$DIR/err"
    local rc=$?
    [ "$rc" = 1 ] && [ "$(wc -l < "$DIR/err")" = 1 ] && grep -qF "tokenize: error: $DIR/in.jsonl:3: " "$DIR/err" &&
        grep -qF -- "$want" "$DIR/err" ||
        fail "$name: exit $rc, want 1 and one error at in.jsonl:3 saying '$want': $(cat "$DIR/err")"
    ! ls "$DIR"/x_* > /dev/null 2>&1 || fail "$name: left $(ls "$DIR"/x_*)"
    [ "$t" = llama3 ] && cat "$DIR/in.jsonl" >> "$DIR/allbad.jsonl"
}
if python3 -c 'import jinja2' 2>/dev/null; then
    # the conversations with CRLF line ends and blank lines (skipped) between them
    awk '{ printf "%s\r\n\n", $0 } NR == 2 { print "   " }' "$CHAT/conversations.jsonl" > "$DIR/conv.jsonl"
    BACKFILL=0
    for t in llama3 llama3.1 qwen2.5 gemma2; do
        chat_ok "$t assistant" "$t" assistant 128 --val-fraction 0.3 --shard-tokens 300 -- --val 0.3 --shard 300 &&
            case $GOT in *backfill*) BACKFILL=1 ;; esac
        chat_ok "$t last" "$t" last 128
        chat_ok "$t all, drop" "$t" all 128 --overlong drop -- --overlong drop
    done
    [ "$BACKFILL" = 1 ] || fail "chat: no run put an example back into an earlier bin (first fit untested)"
    grep -q '^bad lines skipped: template error 2$' "$DIR/out" ||
        fail "gemma2: the two system prompts are not counted as skipped: $(cat "$DIR/out")"
    grep -q '^vocabulary: ' "$DIR/out" || fail "chat: no vocabulary line: $(cat "$DIR/out")"
    chat_ok "too long" llama3.1 all 100 --overlong drop -- --overlong drop &&
        case $GOT in *too_long=0*) fail "too long: nothing was ($GOT)" ;; esac
    chat_ok "no loss token" qwen2.5 assistant 60 &&
        case $GOT in *no_loss_token=0*) fail "no loss token: none dropped ($GOT)" ;; esac

    # a rerun with one shard removes the earlier run's further shards and masks; a plain run
    # over them removes every mask
    chat_ok "many shards" llama3 assistant 64 --shard-tokens 64 -- --shard 64
    [ -e "$DIR/c_train_000003.mask" ] || fail "many shards: fewer than 4 shards"
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 64 --skip-bad --out "$DIR/c" "$DIR/conv.jsonl" > "$DIR/out" 2>&1 &&
        CHAT=$CHAT python3 "$DIR/check_chat.py" llama3 assistant 64 "$DIR/c" "$DIR/out" > "$DIR/err" 2>&1 ||
        fail "chat rerun: $(cat "$DIR/out" "$DIR/err")"
    [ ! -e "$DIR/c_train_000001.bin" ] && [ ! -e "$DIR/c_train_000001.mask" ] || fail "chat rerun: stale shards left"
    touch "$DIR/c_train_000009.mask"
    python3 "$SCRIPT" --tokenizer "$DIR/bpe" --out "$DIR/c" --shard-tokens 37 "$DIR/text.txt" > /dev/null 2>&1 &&
        check "plain over chat" "$DIR/bpe/tokenizer.json" "$DIR/c" "$DIR/text.txt" --shard 37 &&
        ! ls "$DIR"/c_*.mask > /dev/null 2>&1 || fail "plain over chat: masks left: $(ls "$DIR"/c_*.mask)"

    # the template from chat_template.jinja over the config's, or the config's "default" of
    # several: the same files as the llama3 directory gives
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 128 --out "$DIR/ref" "$DIR/conv.jsonl" > /dev/null 2>&1 ||
        fail "llama3 reference run: exit $?"
    mkdir -p "$DIR/jinja" "$DIR/named"
    cp "$CHAT/llama3/tokenizer.json" "$DIR/jinja/" && cp "$CHAT/llama3/tokenizer.json" "$DIR/named/"
    python3 - "$CHAT/llama3/tokenizer_config.json" "$DIR" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
template = cfg["chat_template"]
open(f"{sys.argv[2]}/jinja/chat_template.jinja", "w").write(template)
cfg["chat_template"] = "{{ raise_exception('the config template is not the one to use') }}"
json.dump(cfg, open(f"{sys.argv[2]}/jinja/tokenizer_config.json", "w"))
cfg["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                        {"name": "default", "template": template}]
json.dump(cfg, open(f"{sys.argv[2]}/named/tokenizer_config.json", "w"))
EOF
    for d in jinja named; do
        python3 "$SCRIPT" --tokenizer "$DIR/$d" --chat --seq 128 --out "$DIR/$d" "$DIR/conv.jsonl" > /dev/null 2> "$DIR/err" &&
            cmp -s "$DIR/${d}_train_000000.bin" "$DIR/ref_train_000000.bin" &&
            cmp -s "$DIR/${d}_train_000000.mask" "$DIR/ref_train_000000.mask" ||
            fail "template from $d: not the llama3 directory's output: $(cat "$DIR/err")"
    done

    # bad lines
    : > "$DIR/allbad.jsonl"
    chat_bad "not json" '{"messages": [' "not JSON"
    chat_bad "not an object" '[1, 2]' "not a JSON object"
    chat_bad "no role" '{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}' "message 1 has no 'role'"
    chat_bad "no content" '{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}' "message 1 has no 'content'"
    chat_bad "unknown role" '{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}]}' "unknown role 'tool'"
    chat_bad "content not a string" '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}]}' \
        "message 2: 'content' is not a string"
    chat_bad "null content" '{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "x"}]}' \
        "message 1: 'content' is not a string"
    chat_bad "messages not a list" '{"messages": "hi"}' "'messages' is not a list"
    chat_bad "empty conversation" '{"messages": []}' "'messages' is empty"
    chat_bad "no assistant" '{"messages": [{"role": "user", "content": "a"}]}' "no assistant message"
    chat_bad "no assistant, last" '{"messages": [{"role": "user", "content": "a"}]}' "no assistant message" llama3 --loss-on last
    chat_bad "nothing to learn from" '{"input": "a", "output": "b"}' "neither 'messages'"
    chat_bad "prompt alone" '{"prompt": "a"}' "'prompt' without 'completion'"
    chat_bad "two kinds" '{"prompt": "a", "completion": "b", "text": "c"}' "more than one of"
    chat_bad "not utf-8" "$(printf '{"text": "\xff"}')" "not UTF-8"
    chat_bad "template raises" '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}]}' \
        "the chat template raised: System role not supported" gemma2
    # the same lines together, skipped and counted by reason (two no-assistant lines)
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 128 --skip-bad --out "$DIR/x" "$DIR/allbad.jsonl" > "$DIR/out" 2> "$DIR/err" &&
        grep -qx 'examples: 45 read, 30 kept (0 truncated to --seq 128), 15 dropped (too long 0, bad line 15, no loss token 0)' "$DIR/out" &&
        grep -qx "bad lines skipped: content not a string 2, empty conversation 1, messages not a list 1, missing content 1, missing role 1, more than one kind 1, no assistant turn 2, no messages, prompt/completion or text 1, not JSON 1, not UTF-8 1, not an object 1, prompt without completion 1, unknown role 1" "$DIR/out" ||
        fail "--skip-bad: $(cat "$DIR/out" "$DIR/err")"
    rm -f "$DIR"/x_*
    # {% generation %} blocks (transformers' assistant-mask templates) render as their body:
    # the same shards as the template without them
    mkdir -p "$DIR/gen" && cp "$CHAT/llama3/tokenizer.json" "$DIR/gen/" &&
    python3 - "$CHAT/llama3/tokenizer_config.json" "$DIR/gen/tokenizer_config.json" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))
t = c["chat_template"]
old = "{{ content }}"
assert old in t
c["chat_template"] = t.replace(old, "{% if message['role'] == 'assistant' %}{% generation %}{{ content }}"
                                    "{% endgeneration %}{% else %}{{ content }}{% endif %}")
json.dump(c, open(sys.argv[2], "w"))
PYEOF
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 128 --out "$DIR/x" "$CHAT/conversations.jsonl" > /dev/null 2>&1 &&
    python3 "$SCRIPT" --tokenizer "$DIR/gen" --chat --seq 128 --out "$DIR/g" "$CHAT/conversations.jsonl" > /dev/null 2> "$DIR/err" &&
        cmp -s "$DIR/x_train_000000.bin" "$DIR/g_train_000000.bin" && cmp -s "$DIR/x_train_000000.mask" "$DIR/g_train_000000.mask" ||
        fail "{% generation %} template: $(cat "$DIR/err")"
    rm -rf "$DIR"/x_* "$DIR"/g_* "$DIR/gen"
    # a run without --val-fraction removes an earlier run's val split (those examples are
    # training ones now), in --chat mode and plain mode alike
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 128 --val-fraction 0.3 --out "$DIR/x" "$CHAT/conversations.jsonl" > /dev/null 2>&1 &&
        [ -e "$DIR/x_val_000000.mask" ] &&
        python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 128 --out "$DIR/x" "$CHAT/conversations.jsonl" > /dev/null 2>&1 &&
        ! ls "$DIR"/x_val_* > /dev/null 2>&1 || fail "--chat: an earlier run's val split is left"
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --val-fraction 0.3 --out "$DIR/x" "$DIR/text.txt" > /dev/null 2>&1 &&
        [ -e "$DIR/x_val_000000.bin" ] &&
        python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --out "$DIR/x" "$DIR/text.txt" > /dev/null 2>&1 &&
        ! ls "$DIR"/x_val_* > /dev/null 2>&1 || fail "plain: an earlier run's val split is left"
    rm -f "$DIR"/x_*
    # --out's directory is created when missing (after the input is read: a bad line leaves none)
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 128 --out "$DIR/new/sub/x" "$CHAT/conversations.jsonl" > /dev/null 2>&1 &&
        [ -e "$DIR/new/sub/x_train_000000.mask" ] || fail "--chat: --out's directory not created"
    printf 'not json\n' > "$DIR/bad1.jsonl"
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 128 --out "$DIR/none/x" "$DIR/bad1.jsonl" > /dev/null 2>&1
    [ ! -e "$DIR/none" ] || fail "--chat: a bad input created --out's directory"
    rm -rf "$DIR/new" "$DIR/bad1.jsonl"
    # a user-only conversation is learnt whole with --loss-on all
    printf '{"messages": [{"role": "user", "content": "only a question"}]}\n' > "$DIR/user.jsonl"
    python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --chat --seq 64 --loss-on all --out "$DIR/x" "$DIR/user.jsonl" > /dev/null 2> "$DIR/err" ||
        fail "user only, --loss-on all: $(cat "$DIR/err")"
    rm -f "$DIR"/x_*

    # a template that is not prefix-stable (it counts the messages first): refused, unless --loss-on all
    mkdir -p "$DIR/unstable"
    cp "$CHAT/llama3/tokenizer.json" "$DIR/unstable/"
    printf '%s\n' '{"eos_token": "<|eot_id|>", "chat_template": "{{ messages|length }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"}' \
        > "$DIR/unstable/tokenizer_config.json"
    python3 "$SCRIPT" --tokenizer "$DIR/unstable" --chat --seq 64 --out "$DIR/x" "$CHAT/conversations.jsonl" > /dev/null 2> "$DIR/err"
    rc=$?
    [ "$rc" = 1 ] && [ "$(wc -l < "$DIR/err")" = 1 ] &&
        grep -qF "conversations.jsonl:1: the chat template of $DIR/unstable/tokenizer_config.json is not prefix-stable" "$DIR/err" &&
        grep -qF -- "--loss-on all" "$DIR/err" || fail "unstable template: exit $rc: $(cat "$DIR/err")"
    ! ls "$DIR"/x_* > /dev/null 2>&1 || fail "unstable template: left $(ls "$DIR"/x_*)"
    python3 "$SCRIPT" --tokenizer "$DIR/unstable" --chat --seq 64 --loss-on all --out "$DIR/x" "$CHAT/conversations.jsonl" > /dev/null 2> "$DIR/err" ||
        fail "unstable template, --loss-on all: $(cat "$DIR/err")"

    # options
    bad "chat without seq" --tokenizer "$CHAT/llama3" --out "$DIR/x" --chat "$DIR/conv.jsonl"
    bad "seq 1" --tokenizer "$CHAT/llama3" --out "$DIR/x" --chat --seq 1 "$DIR/conv.jsonl"
    bad "loss-on without chat" --tokenizer "$DIR/bpe" --out "$DIR/x" --loss-on all "$DIR/text.txt"
    bad "overlong without chat" --tokenizer "$DIR/bpe" --out "$DIR/x" --overlong drop "$DIR/text.txt"
    bad "skip-bad without chat" --tokenizer "$DIR/bpe" --out "$DIR/x" --skip-bad "$DIR/text.txt"
    bad "shards smaller than a bin" --tokenizer "$CHAT/llama3" --out "$DIR/x" --chat --seq 64 --shard-tokens 63 "$DIR/conv.jsonl"
    bad "no chat template" --tokenizer "$DIR/bpe" --out "$DIR/x" --chat --seq 64 "$DIR/conv.jsonl"
    bad "chat, val too small" --tokenizer "$CHAT/llama3" --out "$DIR/x" --chat --seq 128 --val-fraction 0.01 "$DIR/conv.jsonl"
    # without jinja2: one line saying how to install it
    mkdir -p "$DIR/nojinja/jinja2"
    echo 'raise ImportError("hidden by the test")' > "$DIR/nojinja/jinja2/__init__.py"
    PYTHONPATH=$DIR/nojinja python3 "$SCRIPT" --tokenizer "$CHAT/llama3" --out "$DIR/x" --chat --seq 64 "$DIR/conv.jsonl" > /dev/null 2> "$DIR/err"
    rc=$?
    [ "$rc" = 1 ] && [ "$(wc -l < "$DIR/err")" = 1 ] && grep -qF 'python3 -m pip install jinja2' "$DIR/err" ||
        fail "no jinja2: exit $rc: $(cat "$DIR/err")"
else
    echo "skipped the --chat checks: python3 cannot import jinja2 (python3 -m pip install jinja2)"
fi
python3 "$SCRIPT" --help > "$DIR/help" 2>&1 && grep -q -- '--shard-tokens' "$DIR/help" ||
    fail "--help: $(cat "$DIR/help")"

[ "$FAILED" = 0 ] && echo "tokenize_test: all checks passed"
exit "$FAILED"
