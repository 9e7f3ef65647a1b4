#!/usr/bin/env python3
"""tokenize.py: text files to llm.c token shards, with a Hugging Face model's tokenizer.

Each FILE is one document, decoded as UTF-8 and encoded whole with the tokenizer in
DIR/tokenizer.json (`Tokenizer.encode(text).ids`, so the special tokens the tokenizer's
post-processor adds, such as a BOS, are kept). The token stream of all files, in the order
given, is cut into shards of --shard-tokens tokens: PREFIX_train_000000.bin, ... With
--val-fraction F, the last F of each file's tokens go to PREFIX_val_000000.bin, ... instead.

Shards are llm.c's: an int32 header[256] (header[0] magic, header[1] version, header[2] the
shard's token count) then the tokens, little-endian; magic 20240520 version 1 with uint16
tokens when the vocabulary has at most 65536 entries, else magic 20240801 version 7 with
uint32. Each shard is written to <shard>.tmp and renamed, so no half-written shard is
ever left under a shard's name; shards of an earlier run with the same PREFIX and split
beyond the ones written are removed, so a glob over PREFIX_train_*.bin reads this run only.
An input that is one of those shards (by name, through a link, or as a hard link of one) is
refused before anything is written.

Errors are one line, `tokenize: error: ...`, on stderr, and exit status 1.
Needs the `tokenizers` package: python3 -m pip install tokenizers
"""
import os
import sys

# This file's own name shadows the standard library's tokenize module (which linecache
# and traceback import): keep its directory off the import path.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import argparse  # noqa: E402 (after the path fix)
import array  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402

MAGIC_V1, MAGIC_V7 = 20240520, 20240801
HEADER_INTS = 256
MAX_SHARD_TOKENS = 2**31 - 1  # header[2] is an int32
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class Failure(Exception):
    """A problem with the input: reported as one line, exit status 1."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors read like ours
        raise Failure(message)


def count_arg(text):
    """A positive token count; accepts the suffixes k, M and G (powers of 1000)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad token count {text!r} (e.g. 1000000 or 100M)")
    n = int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]
    if not 1 <= n <= MAX_SHARD_TOKENS:
        raise argparse.ArgumentTypeError(f"token count {text} is not in 1..{MAX_SHARD_TOKENS}")
    return n


def fraction_arg(text):
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad fraction {text!r}") from None
    if not 0 <= f < 1:
        raise argparse.ArgumentTypeError(f"fraction {text} is not in [0, 1)")
    return f


def parse_args(argv):
    p = Parser(prog="tokenize", description=__doc__.split("\n\n")[0],
               epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="a Hugging Face model directory holding tokenizer.json (or the file)")
    p.add_argument("--out", required=True, metavar="PREFIX",
                   help="shards are written to PREFIX_train_NNNNNN.bin (and PREFIX_val_...)")
    p.add_argument("--shard-tokens", type=count_arg, default=100_000_000, metavar="N",
                   help="tokens per shard (default 100M); the last shard holds the rest")
    p.add_argument("--val-fraction", type=fraction_arg, default=0.0, metavar="F",
                   help="the last F of each file's tokens go to the validation shards")
    p.add_argument("--append-eos", action="store_true",
                   help="append the end-of-text token after each file's tokens")
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files")
    return p.parse_args(argv)


def load_tokenizer(where):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise Failure("the Python package 'tokenizers' is missing; install it with: "
                      "python3 -m pip install tokenizers") from None
    path = where if os.path.isfile(where) else os.path.join(where, "tokenizer.json")
    if not os.path.isfile(path):
        raise Failure(f"{where}: no tokenizer.json there")
    try:
        return Tokenizer.from_file(path), path
    except Exception as e:  # the package raises plain Exceptions for bad files
        raise Failure(f"{path}: not a tokenizer: {str(e).splitlines()[0] if str(e) else e!r}")


def eos_id(tok, tok_path):
    """The end-of-text id: tokenizer_config.json's eos_token, else a well-known name."""
    names = list(EOS_NAMES)
    try:
        with open(os.path.join(os.path.dirname(tok_path), "tokenizer_config.json")) as f:
            eos = json.load(f).get("eos_token")
        names.insert(0, eos.get("content") if isinstance(eos, dict) else eos)
    except (OSError, ValueError, AttributeError):
        pass
    for name in names:
        if isinstance(name, str) and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise Failure(f"{tok_path}: --append-eos: no end-of-text token (tried {', '.join(EOS_NAMES)})")


class ShardWriter:
    """Cuts one split's token stream into shards of n tokens, each written atomically."""

    def __init__(self, prefix, split, n, wide):
        self.prefix, self.split, self.n, self.wide = prefix, split, n, wide
        self.buf, self.written = array.array("I" if wide else "H"), 0

    def add(self, ids):
        self.buf.extend(ids)
        while len(self.buf) >= self.n:
            self._write(self.buf[: self.n])
            del self.buf[: self.n]

    def close(self):
        if self.buf:
            self._write(self.buf)
            self.buf = self.buf[:0]
        # an earlier run's shards past the last one written would join a glob of this run
        pattern = f"{glob.escape(self.prefix)}_{self.split}_[0-9][0-9][0-9][0-9][0-9][0-9].bin"
        for old in glob.glob(pattern):
            if int(old[-10:-4]) >= self.written:
                os.remove(old)

    def _write(self, toks):
        path = f"{self.prefix}_{self.split}_{self.written:06d}.bin"
        header = [MAGIC_V7, 7] if self.wide else [MAGIC_V1, 1]
        header += [len(toks)] + [0] * (HEADER_INTS - 3)
        if sys.byteorder != "little":
            toks = array.array(toks.typecode, toks)
            toks.byteswap()
        tmp = path + ".tmp"
        try:
            try:  # whatever is at the name (a link planted there too) goes, never written through
                os.remove(tmp)
            except FileNotFoundError:
                pass
            with open(tmp, "xb") as f:
                f.write(struct.pack(f"<{HEADER_INTS}i", *header))
                f.write(toks.tobytes())
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise Failure(f"cannot write {path}: {e.strerror or e}") from None
        print(f"{path}: {len(toks)} tokens ({'uint32' if self.wide else 'uint16'})")
        self.written += 1


def shard_name_re(prefix):
    """The names of the files a run with --out PREFIX writes or removes: its shards and their
    temporaries, in the prefix's directory."""
    return re.compile(re.escape(os.path.basename(prefix)) + r"_(train|val)_[0-9]{6}\.bin(\.tmp)?")


def check_inputs(args, tok_path):
    """No input is a file this run writes or removes (a shard of --out PREFIX), whether
    named so, through a symbolic link, or as a hard link of one: checked before any write."""
    out_dir = os.path.realpath(os.path.dirname(os.path.abspath(args.out)))
    names = shard_name_re(args.out)
    outputs = set()  # the outputs there now, by device and inode
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else ():
        if names.fullmatch(name):
            st = os.stat(os.path.join(out_dir, name), follow_symlinks=False)
            outputs.add((st.st_dev, st.st_ino))
    for flag, path in [("--tokenizer", tok_path)] + [("FILE", f) for f in args.files]:
        for p in {os.path.abspath(path), os.path.realpath(path)}:  # as named, and where it leads
            if os.path.realpath(os.path.dirname(p)) == out_dir and names.fullmatch(os.path.basename(p)):
                raise Failure(f"{flag} {path} is one of the shards --out {args.out} writes or removes: "
                              "give --out another prefix")
        try:
            st = os.stat(path)
        except OSError:
            continue  # reading it says why
        if (st.st_dev, st.st_ino) in outputs:
            raise Failure(f"{flag} {path} is a hard link of a shard --out {args.out} writes or removes: "
                          "give --out another prefix")


def main(argv):
    args = parse_args(argv)
    tok, tok_path = load_tokenizer(args.tokenizer)
    check_inputs(args, tok_path)
    # ids of added tokens may lie past get_vocab_size() in odd tokenizers: bound by both
    vocab = max(tok.get_vocab_size(), 1 + max(tok.get_vocab().values(), default=-1))
    eos = eos_id(tok, tok_path) if args.append_eos else None
    wide = vocab > 65536
    train = ShardWriter(args.out, "train", args.shard_tokens, wide)
    val = ShardWriter(args.out, "val", args.shard_tokens, wide) if args.val_fraction else None
    for path in args.files:
        try:
            with open(path, encoding="utf-8", newline="") as f:  # the bytes' line ends
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise Failure(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        ids = tok.encode(text).ids
        if eos is not None:
            ids.append(eos)
        nval = round(len(ids) * args.val_fraction)
        train.add(ids[: len(ids) - nval])
        if val:
            val.add(ids[len(ids) - nval:])
    for w in (train, val):
        if w and w.written == 0 and not w.buf:
            raise Failure(f"no {w.split} tokens: the input is empty or too short for the split")
    train.close()
    if val:
        val.close()
    print(f"vocabulary: {vocab} tokens (train with --vocab {vocab} or more)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Failure as e:
        print(f"tokenize: error: {e}", file=sys.stderr)
        sys.exit(1)
