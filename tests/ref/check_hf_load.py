#!/tmp/tfenv/bin/python
"""Load a Hugging Face model directory strictly with transformers and print its loss.

A development tool for checking that directories ferry writes load back into
transformers: the directory is loaded with LlamaForCausalLM.from_pretrained (or
AutoModelForCausalLM for other model types, e.g. gpt2) with output_loading_info=True;
any missing, unexpected or mismatched key (or a load error) prints one line on
stderr and exits 1. Otherwise it prints, as JSON on stdout,

    {"loss": L, "missing": [], "unexpected": [], "model_type": ..., "dtype": ...}

where L is the mean cross-entropy over all B*T positions of the first batch of an
llm.c token shard (x = tokens[0:B*T] as (B, T), y = tokens[1:B*T+1]).

--dtype float64 runs transformers in float64. Stock transformers still rounds RMSNorm,
the RoPE tables and the attention softmax through float32 (upcasts meant for half
precision); --exact turns every float32 request into float64 while the model loads and
runs (set_exact), so the whole forward is float64, for any family. gen_llama_ref.py,
gen_llama_hf.py, gen_family_ref.py and hf_family_check.py use it for their cross-checks.

Usage: /tmp/tfenv/bin/python tests/ref/check_hf_load.py DIR [--tokens FILE]
           [--batch 4] [--seq 32] [--dtype float32|float64|bfloat16] [--exact]
"""

import argparse
import json
import os
import struct
import sys

import torch
import torch.nn.functional as F

SHARD_MAGIC, SHARD_VERSION = 20240520, 1
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

# ---------------------------------------------------------------- exact float64 mode

_EXACT = {"on": False, "installed": False}


def set_exact(on):
    """Turn the float64 promotion on or off (installs it on first use). While on, every
    request for float32 that transformers' code makes (the RMSNorm and RoPE upcasts, the
    RoPE inverse frequencies and longrope factors, the eager attention's softmax) gets
    float64 instead, so a float64 model computes in float64 throughout, whatever its
    family. Only for runs where everything is float64: it would promote a float32
    model's upcasts too, so the caller turns it on only with --dtype float64."""
    install_exact_patches()
    _EXACT["on"] = bool(on)


def _f64(dt):
    return torch.float64 if (_EXACT["on"] and dt is torch.float32) else dt


def install_exact_patches():
    if _EXACT["installed"]:
        return
    T = torch.Tensor
    orig_float, orig_to, orig_tensor = T.float, T.to, torch.tensor
    orig_softmax = torch.nn.functional.softmax

    def float_(self, *a, **k):
        return orig_to(self, torch.float64) if _EXACT["on"] else orig_float(self, *a, **k)

    def to_(self, *a, **k):
        if _EXACT["on"]:
            a = tuple(_f64(x) if isinstance(x, torch.dtype) else x for x in a)
            if "dtype" in k:
                k["dtype"] = _f64(k["dtype"])
        return orig_to(self, *a, **k)

    def tensor_(*a, **k):
        if "dtype" in k:
            k["dtype"] = _f64(k["dtype"])
        return orig_tensor(*a, **k)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        return orig_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=_f64(dtype))

    T.float, T.to, torch.tensor = float_, to_, tensor_
    torch.nn.functional.softmax = softmax
    _EXACT["installed"] = True


# ---------------------------------------------------------------- helpers

def read_shard(path):
    with open(path, "rb") as f:
        raw = f.read()
    header = struct.unpack("<256i", raw[:1024])
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ValueError("%s: not an llm.c v1 token shard" % path)
    n = header[2]
    return torch.tensor(struct.unpack("<%dH" % n, raw[1024:1024 + 2 * n]), dtype=torch.long)


def get_batch(tokens, step, B, T):
    buf = tokens[step * B * T: step * B * T + B * T + 1]
    if buf.numel() != B * T + 1:
        raise ValueError("token file too short for batch %d" % step)
    return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)


def causal_lm_loss(model, x, y):
    """Mean cross-entropy over all positions: the model's own logits (with, e.g.,
    Gemma's final soft-cap) for every position, no labels passed (transformers would
    shift them and drop the last position)."""
    logits = model(input_ids=x, use_cache=False).logits
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def load_strict(path, dtype=torch.float32):
    """from_pretrained with output_loading_info; raises ValueError on any key problem."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(path)
    cls = LlamaForCausalLM if config.model_type == "llama" else AutoModelForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True, torch_dtype=dtype,
                                      attn_implementation="eager")
    bad = {k: sorted(info.get(k) or []) for k in
           ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    if any(bad.values()):
        raise ValueError("; ".join("%s: %s" % (k, v) for k, v in bad.items() if v))
    model.eval()
    return model, info


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("dir")
    ap.add_argument("--tokens", default=os.path.join(here, "..", "fixtures", "gpt2_tiny_tokens.bin"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--exact", action="store_true",
                    help="with --dtype float64: remove transformers' float32 upcasts")
    args = ap.parse_args()

    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    if args.exact:
        if args.dtype != "float64":
            print("check_hf_load: --exact needs --dtype float64", file=sys.stderr)
            return 1
        set_exact(True)
    try:
        model, info = load_strict(args.dir, DTYPES[args.dtype])
        x, y = get_batch(read_shard(args.tokens), 0, args.batch, args.seq)
        with torch.no_grad():
            loss = causal_lm_loss(model, x, y).item()
    except Exception as e:  # one line, whatever went wrong
        msg = " ".join(str(e).split())
        print("check_hf_load: %s: %s: %s" % (args.dir, type(e).__name__, msg), file=sys.stderr)
        return 1
    print(json.dumps({"loss": loss, "missing": list(info["missing_keys"]),
                      "unexpected": list(info["unexpected_keys"]),
                      "model_type": model.config.model_type, "dtype": args.dtype}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
