#!/usr/bin/env python3
"""gen_masked_data.py: the packed, loss-masked token fixture of the CLI and data-parallel
tests (tests/fixtures/masked/), as scripts/tokenize.py --chat lays it out (the spec:
issue 32; engine/io/tokens.h): documents of random lengths packed first-fit, in order, into
bins of S = 32 tokens, each bin's unused room a padding document (pad token, loss 0), one
trailing pad token after the last bin, the stream cut into two shards of a multiple of S
tokens (the trailing token in the last), each with its companion .mask (loss and start bits).

Tokens are below 256 (a model with --vocab 256 trains on them); the loss bits are random
(about 40% of a document's tokens), never on a document's first token. Also written:
expected.json, the targets counted (loss bit 1, start bit 0) by each batch of B*T = 64
tokens that ferry's loader reads over the whole stream (batch k's targets are tokens
64k+1 .. 64k+64), computed here from the bits, independently of ferry.

Deterministic (a fixed seed, the standard library only): rerunning it rewrites the same
bytes. Usage: python3 tests/ref/gen_masked_data.py [OUT_DIR]
"""
import json
import os
import random
import struct
import sys
import zlib

SEED = 20261203
S = 32                 # the packing length
NBINS = 64             # 2048 tokens and the trailing pad: 32 batches of 2 x 32
SHARD0_BINS = 27       # the first shard's bins: a batch of 64 straddles the boundary
PAD = 0                # the pad token (its own document, loss 0)
MAGIC_V1, MASK_MAGIC = 20240520, 20261203
BT = 64                # expected.json's batch: --batch 2 --seq 32


def pack(rng):
    """Documents (token list, loss flags) packed first-fit into NBINS bins of S tokens."""
    bins = []  # each: list of (tokens, loss flags)
    while True:
        n = rng.choice([1, 2] + list(range(3, 21)) * 3)
        toks = [rng.randrange(1, 256) for _ in range(n)]
        loss = [0] + [1 if rng.random() < 0.4 else 0 for _ in range(n - 1)]
        for b in bins:
            if sum(len(t) for t, _ in b) + n <= S:
                b.append((toks, loss))
                break
        else:
            if len(bins) == NBINS:
                return bins
            bins.append([(toks, loss)])


def stream(bins):
    """The packed tokens, loss bits and start bits, the trailing pad token included."""
    toks, loss, start = [], [], []
    for b in bins:
        for t, l in b:
            toks += t
            loss += l
            start += [1] + [0] * (len(t) - 1)
        room = S - sum(len(t) for t, _ in b)
        if room:
            toks += [PAD] * room
            loss += [0] * room
            start += [1] + [0] * (room - 1)
    toks.append(PAD)
    loss.append(0)
    start.append(1)
    assert len(toks) == NBINS * S + 1
    return toks, loss, start


def bits(flags):
    """A .mask bit plane: bit i in byte i >> 3 at bit i & 7, least significant first (also
    gen_chat_ref.py's)."""
    out = bytearray((len(flags) + 7) // 8)
    for i, f in enumerate(flags):
        if f:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def write(path, data):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def write_shard(prefix, toks, loss, start):
    n = len(toks)
    data = struct.pack("<%dH" % n, *toks)
    crc = zlib.crc32(data)  # the mask's record of its shard's token bytes
    mask_hdr = [MASK_MAGIC, 1, n, S, crc - (1 << 32) if crc >= 1 << 31 else crc] + [0] * 251
    write(prefix + ".mask", struct.pack("<256i", *mask_hdr) + bits(loss) + bits(start))
    shard_hdr = [MAGIC_V1, 1, n] + [0] * 253
    write(prefix + ".bin", struct.pack("<256i", *shard_hdr) + data)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "masked")
    os.makedirs(out, exist_ok=True)
    toks, loss, start = stream(pack(random.Random(SEED)))
    cut = SHARD0_BINS * S
    write_shard(os.path.join(out, "chat_train_000000"), toks[:cut], loss[:cut], start[:cut])
    write_shard(os.path.join(out, "chat_train_000001"), toks[cut:], loss[cut:], start[cut:])
    counts = lambda a, b: sum(1 for i in range(a, b) if loss[i] and not start[i])
    nb = (len(toks) - 1) // BT
    expected = {
        "seq": S,
        "tokens": len(toks),
        "shard_tokens": [cut, len(toks) - cut],
        "batch_tokens": BT,
        # batch k of B*T = 64 (the loader's order from token 0): its counted targets
        "batch_targets": [counts(BT * k + 1, BT * k + BT + 1) for k in range(nb)],
        "targets": counts(1, len(toks)),
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
