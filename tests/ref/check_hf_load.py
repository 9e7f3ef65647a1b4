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
the RoPE tables, the attention softmax and the logits through float32 (upcasts meant
for half precision); --exact (Llama only) removes those casts so the whole forward is
float64. gen_llama_ref.py and gen_llama_hf.py use it for their cross-checks.

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
    """Turn the float64 precision patches on or off (installs them on first use).
    They change nothing for float32 / bfloat16 tensors."""
    install_exact_patches()
    _EXACT["on"] = bool(on)


def install_exact_patches():
    if _EXACT["installed"]:
        return
    from transformers import modeling_rope_utils as mru
    from transformers.models.llama import modeling_llama as ml

    orig_default = mru._compute_default_rope_parameters

    def default64(config=None, device=None, seq_len=None, **kw):
        inv, att = orig_default(config, device, seq_len, **kw)
        if not _EXACT["on"]:
            return inv, att
        if kw:
            base, dim = kw["base"], kw["dim"]
        else:
            base = config.rope_theta
            prf = getattr(config, "partial_rotary_factor", 1.0)
            dim = int(getattr(config, "head_dim", config.hidden_size // config.num_attention_heads) * prf)
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return inv, att

    # _compute_llama3_parameters looks the default function up as a module global
    mru._compute_default_rope_parameters = default64

    orig_rot_fwd = ml.LlamaRotaryEmbedding.forward

    @torch.no_grad()
    def rot_fwd(self, x, position_ids):
        if not (_EXACT["on"] and x.dtype == torch.float64):
            return orig_rot_fwd(self, x, position_ids)
        if self.rope_type == "default":
            inv, _ = mru._compute_default_rope_parameters(self.config, x.device, **self.rope_kwargs)
        elif self.rope_type == "llama3":
            inv, _ = mru._compute_llama3_parameters(self.config, x.device, **self.rope_kwargs)
        else:
            raise SystemExit("--exact: rope type %r not supported" % self.rope_type)
        assert inv.dtype == torch.float64
        freqs = position_ids[:, :, None].to(torch.float64) * inv[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    ml.LlamaRotaryEmbedding.forward = rot_fwd

    orig_norm_fwd = ml.LlamaRMSNorm.forward

    def norm_fwd(self, h):
        if not (_EXACT["on"] and h.dtype == torch.float64):
            return orig_norm_fwd(self, h)
        var = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + self.variance_epsilon))

    ml.LlamaRMSNorm.forward = norm_fwd

    # the eager attention calls nn.functional.softmax(..., dtype=torch.float32)
    orig_softmax = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if _EXACT["on"] and input.dtype == torch.float64:
            dtype = None
        return orig_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

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
    """Mean cross-entropy over all positions. The logits come from the base model and
    the output embedding directly (LlamaForCausalLM.forward would round them to float32
    and drop the last position)."""
    hidden = model.base_model(input_ids=x)[0]
    logits = model.get_output_embeddings()(hidden)
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
                    help="with --dtype float64: remove transformers' float32 upcasts (Llama)")
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
        if args.exact and model.config.model_type != "llama":
            raise ValueError("--exact supports model_type llama only")
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
