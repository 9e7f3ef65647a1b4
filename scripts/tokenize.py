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

Conversations (--chat): each FILE is JSONL, one example a line: {"messages": [{"role":
"system"|"user"|"assistant", "content": "..."}, ...]}, {"prompt": "...", "completion": "..."}
(a user and an assistant message) or {"text": "..."} (a plain document, all of it learnt);
blank lines are skipped. A conversation is rendered with the model's chat template
(DIR/chat_template.jinja, else tokenizer_config.json's chat_template; its "default" when it
has several) exactly as transformers' apply_chat_template renders and tokenizes it.
--loss-on assistant (the default) learns each assistant message's content and its
end-of-turn token, `last` only the last assistant message, `all` every token; the template
must be prefix-stable for the first two. Examples are packed first-fit, in input order, into
bins of --seq tokens (an example longer than that keeps its first --seq tokens, or is
dropped with --overlong drop; one left with no token to learn is dropped), the rest of a
bin filled with the pad token (pad_token, else eos_token) as a document of its own; each
split's stream ends with one more pad token, and shards hold a multiple of --seq tokens
(the last one the extra token too). With --val-fraction F the last round(F * examples)
kept examples go to the val split. Beside each shard NAME.bin a companion NAME.mask
(written first, the same way) says which tokens the loss counts and where documents start:
int32 header[256] (magic 20261203, version 1, token count, --seq, the CRC-32 (zlib's) of
its shard's token bytes), then one bit per token of LOSS, then one of START, least
significant bit first. A plain run removes the .mask companions of the shards it writes or
removes; a run without --val-fraction removes an earlier run's val split. Nothing is written before all the input
has been read: a bad line (not JSON, not an object, a message without a role or content,
an unknown role, content not a string, no messages, no assistant message unless --loss-on
all, a template that raises) is one error naming FILE:LINE, or with --skip-bad is skipped
and counted. The input is held in memory (about 12 bytes a token). A summary ends the run.

Errors are one line, `tokenize: error: ...`, on stderr, and exit status 1.
Needs the `tokenizers` package (python3 -m pip install tokenizers), and for --chat `jinja2`.
"""
import os
import sys

# This file's own name shadows the standard library's tokenize module (which linecache
# and traceback import): keep its directory off the import path.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import argparse  # noqa: E402 (after the path fix)
import array  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

# chat_data.py, beside this file, at the end of the path: the standard library comes first
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import chat_data  # noqa: E402

MAGIC_V1, MAGIC_V7 = 20240520, 20240801
MASK_MAGIC, MASK_VERSION = 20261203, 1
HEADER_INTS = 256
MAX_SHARD_TOKENS = 2**31 - 1  # header[2] is an int32
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
CHAT_ONLY = ("loss_on", "overlong", "seq")  # options that mean nothing without --chat
BITS = bytes.maketrans(b"\x00\x01", b"01")


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


def seq_arg(text):
    n = count_arg(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"--seq {text}: a bin needs at least 2 tokens")
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
                   help="shards are written to PREFIX_train_NNNNNN.bin (and PREFIX_val_...); "
                        "PREFIX's directory is created when missing")
    p.add_argument("--shard-tokens", type=count_arg, default=100_000_000, metavar="N",
                   help="tokens per shard (default 100M); the last shard holds the rest")
    p.add_argument("--val-fraction", type=fraction_arg, default=0.0, metavar="F",
                   help="the last F of each file's tokens (--chat: of the examples) go to val")
    p.add_argument("--append-eos", action="store_true",
                   help="append the end-of-text token after each file's tokens")
    p.add_argument("--chat", action="store_true",
                   help="FILEs are JSONL conversations: packed bins and .mask companions")
    p.add_argument("--seq", type=seq_arg, metavar="T", help="--chat: the bin length (required)")
    p.add_argument("--loss-on", choices=("assistant", "last", "all"),
                   help="--chat: the tokens the loss counts (default assistant)")
    p.add_argument("--overlong", choices=("truncate", "drop"),
                   help="--chat: an example over --seq tokens is cut to them (default) or dropped")
    p.add_argument("--skip-bad", action="store_true",
                   help="--chat: skip and count bad lines instead of stopping at the first")
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files (--chat: JSONL)")
    args = p.parse_args(argv)
    if args.chat:
        if args.seq is None:
            raise Failure("--chat needs --seq T, the length of the bins examples are packed into")
        if args.append_eos:
            raise Failure("--append-eos is for text files; a chat template ends its own turns")
        args.loss_on = args.loss_on or "assistant"
        args.overlong = args.overlong or "truncate"
    else:
        given = [name for name in CHAT_ONLY if getattr(args, name) is not None]
        given += ["skip_bad"] if args.skip_bad else []
        if given:
            raise Failure(f"--{given[0].replace('_', '-')} needs --chat")
    return args


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


def config_token(tok_path, key):
    """tokenizer_config.json's key (a string, or an AddedToken dict's content), else None."""
    try:
        with open(os.path.join(os.path.dirname(tok_path), "tokenizer_config.json"), encoding="utf-8") as f:
            value = json.load(f).get(key)
        return value.get("content") if isinstance(value, dict) else value
    except (OSError, ValueError, AttributeError):
        return None


def eos_id(tok, tok_path):
    """The end-of-text id: tokenizer_config.json's eos_token, else a well-known name."""
    names = [config_token(tok_path, "eos_token")] + list(EOS_NAMES)
    for name in names:
        if isinstance(name, str) and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise Failure(f"{tok_path}: --append-eos: no end-of-text token (tried {', '.join(EOS_NAMES)})")


def pad_id(tok, tok_path):
    """The packing pad: tokenizer_config.json's pad_token, else its eos_token."""
    for key in ("pad_token", "eos_token"):
        name = config_token(tok_path, key)
        if isinstance(name, str) and name:
            if tok.token_to_id(name) is None:
                raise Failure(f"{tok_path}: the {key} {name!r} of tokenizer_config.json is not in the vocabulary")
            return tok.token_to_id(name)
    raise Failure(f"{os.path.join(os.path.dirname(tok_path), 'tokenizer_config.json')}: "
                  "neither a pad_token nor an eos_token to pad the bins with")


def write_atomic(path, chunks):
    """Writes the byte strings to <path>.tmp then renames it to path, so no half-written file
    is ever left under the name; a link planted at the temporary name is replaced."""
    tmp = path + ".tmp"
    try:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        with open(tmp, "xb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise Failure(f"cannot write {path}: {e.strerror or e}") from None


def write_shard(path, toks, wide):
    """An llm.c shard of the tokens (an array of typecode I or H) at path."""
    toks = array.array("I" if wide else "H", toks)
    header = [MAGIC_V7, 7] if wide else [MAGIC_V1, 1]
    header += [len(toks)] + [0] * (HEADER_INTS - 3)
    if sys.byteorder != "little":
        toks.byteswap()
    write_atomic(path, [struct.pack(f"<{HEADER_INTS}i", *header), toks.tobytes()])


def pack_bits(flags):
    """A bytearray of 0/1 as bits, flag i at byte i >> 3, bit i & 7 (least significant first)."""
    if not flags:
        return b""
    return int(flags.translate(BITS)[::-1], 2).to_bytes((len(flags) + 7) // 8, "little")


def shard_crc(toks, wide):
    """The CRC-32 (zlib's) of the token bytes a shard of toks stores, as an int32."""
    data = array.array("I" if wide else "H", toks)
    if sys.byteorder != "little":
        data.byteswap()
    crc = zlib.crc32(data.tobytes())
    return crc - (1 << 32) if crc >= 1 << 31 else crc


def write_mask(path, loss, start, size, crc):
    """The .mask companion of a shard: header (with its shard's token CRC), LOSS bits, START
    bits (one flag a token each)."""
    header = [MASK_MAGIC, MASK_VERSION, len(loss), size, crc] + [0] * (HEADER_INTS - 5)
    write_atomic(path, [struct.pack(f"<{HEADER_INTS}i", *header), pack_bits(loss), pack_bits(start)])


def remove_from(prefix, split, first):
    """Removes the shards and .mask companions of the split numbered first or more: an earlier
    run's, which would join a glob of this run's shards, or attach to them."""
    for ext in ("bin", "mask"):
        pattern = f"{glob.escape(prefix)}_{split}_[0-9][0-9][0-9][0-9][0-9][0-9].{ext}"
        for old in glob.glob(pattern):
            if int(old[-len(ext) - 7: -len(ext) - 1]) >= first:
                os.remove(old)


def remove_file(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise Failure(f"cannot remove {path}: {e.strerror or e}") from None


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
        remove_from(self.prefix, self.split, self.written)

    def _write(self, toks):
        path = f"{self.prefix}_{self.split}_{self.written:06d}.bin"
        remove_file(path[:-4] + ".mask")  # an earlier --chat run's mask must not attach to these
        write_shard(path, toks, self.wide)
        print(f"{path}: {len(toks)} tokens ({'uint32' if self.wide else 'uint16'})")
        self.written += 1


def write_chat_split(prefix, split, bins, size, pad, shard_tokens, wide):
    """The split's bins, in order, and one trailing pad token, as shards of a multiple of size
    tokens (the last one also holding the trailing token), each after its .mask companion."""
    per = min(shard_tokens, MAX_SHARD_TOKENS - 1) // size  # bins a shard
    written = 0
    for first in range(0, len(bins), per):
        group = bins[first: first + per]
        toks, loss, start = array.array("I"), bytearray(), bytearray()
        for ids, bin_loss, bin_start in group:
            toks.extend(ids)
            loss += bin_loss
            start += bin_start
        if first + per >= len(bins):  # the stream's last token: k*size+1 read whole by ferry
            toks.append(pad)
            loss.append(0)
            start.append(1)
        path = f"{prefix}_{split}_{written:06d}"
        write_mask(path + ".mask", loss, start, size, shard_crc(toks, wide))
        write_shard(path + ".bin", toks, wide)
        print(f"{path}.bin: {len(toks)} tokens ({'uint32' if wide else 'uint16'}), "
              f"{sum(loss)} in the loss; {os.path.basename(path)}.mask")
        written += 1
    remove_from(prefix, split, written)


def shard_name_re(prefix):
    """The names of the files a run with --out PREFIX writes or removes: its shards, their
    .mask companions and their temporaries, in the prefix's directory."""
    return re.compile(re.escape(os.path.basename(prefix)) + r"_(train|val)_[0-9]{6}\.(bin|mask)(\.tmp)?")


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


def make_out_dir(prefix):
    """The directory of --out PREFIX, created (with its parents) when it is missing."""
    d = os.path.dirname(prefix)
    if d and not os.path.isdir(d):
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise Failure(f"cannot create the directory of --out {prefix}: {e.strerror or e}") from None


def run_plain(args, tok, tok_path, wide):
    eos = eos_id(tok, tok_path) if args.append_eos else None
    make_out_dir(args.out)
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
    else:  # an earlier run's val split would hold text this run trains on
        remove_from(args.out, "val", 0)


class Progress:
    """Examples done of the total, on stderr when it is a terminal, at most 5 times a second."""

    def __init__(self, total):
        self.total, self.done, self.shown = total, 0, 0.0
        self.on = sys.stderr.isatty()

    def tick(self):
        self.done += 1
        now = time.monotonic()
        if self.on and (now - self.shown > 0.2 or self.done == self.total):
            self.shown = now
            sys.stderr.write(f"\rtokenize: {self.done}/{self.total} examples")
            sys.stderr.flush()

    def close(self):
        if self.on and self.shown:
            sys.stderr.write("\r" + " " * 60 + "\r")
            sys.stderr.flush()


def read_examples(args, tok, tok_path):
    """The kept examples of all FILEs, in order, and the counts of those not kept by reason
    (Counters: dropped, bad); a bad line stops the run unless --skip-bad."""
    encoder = chat_data.Encoder(tok, os.path.dirname(tok_path), args.loss_on)
    data = []
    for path in args.files:
        try:
            with open(path, "rb") as f:
                data.append((path, f.read().split(b"\n")))
        except OSError as e:
            raise Failure(f"cannot read {path}: {e.strerror or e}") from None
    progress = Progress(sum(1 for _, lines in data for line in lines if line.strip()))
    kept, dropped, bad, truncated = [], collections.Counter(), collections.Counter(), 0
    for path, lines in data:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    raise chat_data.BadLine("not UTF-8") from None
                except ValueError as e:
                    raise chat_data.BadLine("not JSON", f"not JSON ({e})") from None
                example, reason = chat_data.trim(encoder.encode(obj), args.seq, args.overlong)
            except chat_data.BadLine as e:
                if not args.skip_bad:
                    progress.close()
                    raise Failure(f"{path}:{n}: {e}") from None
                bad[e.reason] += 1
                example, reason = None, "bad line"
            except chat_data.Fatal as e:
                progress.close()
                raise Failure(f"{path}:{n}: {e}") from None
            if example:
                kept.append(example)
                truncated += reason == "truncated"
            else:
                dropped[reason] += 1
            progress.tick()
    progress.close()
    return kept, dropped, bad, truncated, progress.total


def run_chat(args, tok, tok_path, wide):
    size = args.seq
    if min(args.shard_tokens, MAX_SHARD_TOKENS - 1) < size:
        raise Failure(f"--shard-tokens {args.shard_tokens} is less than --seq {size}: "
                      "a shard holds whole bins")
    pad = pad_id(tok, tok_path)
    kept, dropped, bad, truncated, total = read_examples(args, tok, tok_path)
    nval = round(len(kept) * args.val_fraction)
    splits = [("train", kept[: len(kept) - nval])] + ([("val", kept[len(kept) - nval:])] if args.val_fraction else [])
    for split, examples in splits:
        if not examples:
            raise Failure(f"no {split} examples: {len(kept)} of {total} kept, too few for the split")
    make_out_dir(args.out)  # after the input is read: a bad line leaves nothing behind
    nbins = {}
    for split, examples in splits:
        bins = chat_data.pack(examples, size, pad)
        nbins[split] = len(bins)
        write_chat_split(args.out, split, bins, size, pad, args.shard_tokens, wide)
    if not args.val_fraction:  # an earlier run's val split would hold these training examples
        remove_from(args.out, "val", 0)
    ntok = sum(len(e.ids) for e in kept)
    nloss = sum(sum(e.loss) for e in kept)
    slots = size * sum(nbins.values())
    reasons = ", ".join(f"{r} {dropped[r]}" for r in ("too long", "bad line", "no loss token"))
    print(f"examples: {total} read, {len(kept)} kept ({truncated} truncated to --seq {size}), "
          f"{total - len(kept)} dropped ({reasons})")
    if bad:
        print("bad lines skipped: " + ", ".join(f"{r} {c}" for r, c in sorted(bad.items())))
    print(f"tokens: {ntok} in the kept examples, {nloss} in the loss "
          f"({100 * nloss / ntok:.1f}%; masked out {100 - 100 * nloss / ntok:.1f}%)")
    print(f"bins: {sum(nbins.values())} of {size} tokens ("
          + ", ".join(f"{s} {c}" for s, c in nbins.items())
          + f"), padding {100 * (slots - ntok) / slots:.1f}% of their tokens")


def main(argv):
    args = parse_args(argv)
    tok, tok_path = load_tokenizer(args.tokenizer)
    check_inputs(args, tok_path)
    # ids of added tokens may lie past get_vocab_size() in odd tokenizers: bound by both
    vocab = max(tok.get_vocab_size(), 1 + max(tok.get_vocab().values(), default=-1))
    wide = vocab > 65536
    if args.chat:
        run_chat(args, tok, tok_path, wide)
    else:
        run_plain(args, tok, tok_path, wide)
    print(f"vocabulary: {vocab} tokens (train with --vocab {vocab} or more)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Failure as e:
        print(f"tokenize: error: {e}", file=sys.stderr)
        sys.exit(1)
