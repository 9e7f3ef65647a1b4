#!/tmp/tfenv/bin/python
"""transformers' side of the family acceptance test (tests/hf_families_test.sh).

Subcommands, each usable on its own:

  make FAMILY DIR [--seed N] [--shard-size 40KB]
      a random model of FAMILY (qwen2, qwen3, mistral, gemma2, gemma3_text, phi3; also
      llama) built by transformers from its own config class, with the shapes of
      gen_family_ref.py's fixture (llama: llama_tiny's); transformers' init under the
      seed, then perturbed so nothing is trivial (norm weights off the identity, biases
      nonzero, q/k projections large enough for position-dependent attention, gemma2's
      soft-caps binding); save_pretrained as float32 safetensors shards.
  loss DIR [--step S] [--stock]
      loads DIR strictly (check_hf_load.load_strict: no missing, unexpected or
      mismatched key) in float64, eager attention, and prints {"loss": L} for batch S.
  train DIR --steps N [--lr --beta1 --beta2 --eps --weight-decay]
            [--grads-out F] [--final-out F] [--stock]
      N steps of torch.optim.AdamW in float64 on batches 0..N-1 (batch s = tokens
      [s*B*T, s*B*T + B*T + 1)), decay on 2-D tensors only, constant lr, no clipping;
      prints {"losses": [...], "grad_norms": [...]}; optionally writes the first-step
      gradients and the final weights (F64 safetensors, transformers' parameter names;
      a tied head is the embedding, as named_parameters lists it).

float64 is exact by default: transformers' float32 upcasts are turned into float64
(check_hf_load.set_exact); --stock keeps them. All batches are B=4, T=32 of
tests/fixtures/gpt2_tiny_tokens.bin unless --tokens/--batch/--seq say otherwise.

Usage: /tmp/tfenv/bin/python tests/ref/hf_family_check.py SUBCOMMAND ...
"""

import argparse
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_hf_load as chk  # noqa: E402

LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False, torch_dtype="float32", use_cache=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.125,
                           "high_freq_factor": 1.0, "original_max_position_embeddings": 8})


def family_kwargs(family):
    if family == "llama":
        return copy.deepcopy(LLAMA)
    from gen_family_ref import FAMILIES
    if family not in FAMILIES:
        raise SystemExit("hf_family_check: unknown family %r" % family)
    return copy.deepcopy(FAMILIES[family])


def cmd_make(a):
    import transformers
    transformers.logging.set_verbosity_error()
    kw = family_kwargs(a.family)
    mt = kw.pop("model_type")
    config = transformers.AutoConfig.for_model(mt, **kw)
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    gemma = mt.startswith("gemma")
    g = torch.Generator().manual_seed(a.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                noise = torch.randn(p.shape, generator=g)
                p.copy_(noise * 0.2 if gemma else 1.0 + noise * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "embed_tokens" in name:
                p.mul_(15.0 if mt == "gemma2" else 5.0)
            elif any(s in name for s in ("q_proj", "k_proj", "qkv_proj")):
                p.mul_(12.0 if mt == "gemma2" else 8.0)
            else:
                p.mul_(5.0)
    model.save_pretrained(a.dir, max_shard_size=a.shard_size, safe_serialization=True)
    print(json.dumps({"dir": a.dir, "family": mt,
                      "files": sorted(os.listdir(a.dir))}))
    return 0


def load(a):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    chk.set_exact(not a.stock)
    model, _ = chk.load_strict(a.dir, torch.float64)
    tokens = chk.read_shard(a.tokens)
    return model, tokens


def cmd_loss(a):
    model, tokens = load(a)
    x, y = chk.get_batch(tokens, a.step, a.batch, a.seq)
    with torch.no_grad():
        loss = chk.causal_lm_loss(model, x, y).item()
    print(json.dumps({"loss": loss, "model_type": model.config.model_type}))
    return 0


def write_f64(path, named):
    """safetensors, F64, in the given order (own writer; no safetensors package)."""
    import struct
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for n, t in named:
        data = t.detach().to(torch.float64).contiguous().numpy().astype("<f8").tobytes()
        header[n] = {"dtype": "F64", "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))


def cmd_train(a):
    model, tokens = load(a)
    named = list(model.named_parameters())
    decay = [p for _, p in named if p.dim() == 2]
    rest = [p for _, p in named if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    losses, norms = [], []
    for s in range(a.steps):
        x, y = chk.get_batch(tokens, s, a.batch, a.seq)
        opt.zero_grad(set_to_none=True)
        loss = chk.causal_lm_loss(model, x, y)
        loss.backward()
        if s == 0 and a.grads_out:
            write_f64(a.grads_out, [(n, p.grad) for n, p in named])
        norms.append(torch.norm(torch.stack([p.grad.norm(2) for _, p in named]), 2).item())
        opt.step()
        losses.append(loss.item())
    if a.final_out:
        write_f64(a.final_out, named)
    print(json.dumps({"losses": losses, "grad_norms": norms,
                      "model_type": model.config.model_type}))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("family")
    m.add_argument("dir")
    m.add_argument("--seed", type=int, default=20250)
    m.add_argument("--shard-size", default="40KB")
    for name in ("loss", "train"):
        s = sub.add_parser(name)
        s.add_argument("dir")
        s.add_argument("--tokens", default=os.path.join(HERE, "..", "fixtures", "gpt2_tiny_tokens.bin"))
        s.add_argument("--batch", type=int, default=4)
        s.add_argument("--seq", type=int, default=32)
        s.add_argument("--stock", action="store_true", help="keep transformers' float32 upcasts")
        if name == "loss":
            s.add_argument("--step", type=int, default=0)
        else:
            s.add_argument("--steps", type=int, required=True)
            s.add_argument("--lr", type=float, default=1e-3)
            s.add_argument("--beta1", type=float, default=0.9)
            s.add_argument("--beta2", type=float, default=0.95)
            s.add_argument("--eps", type=float, default=1e-8)
            s.add_argument("--weight-decay", type=float, default=0.1)
            s.add_argument("--grads-out")
            s.add_argument("--final-out")
    a = ap.parse_args()
    try:
        return {"make": cmd_make, "loss": cmd_loss, "train": cmd_train}[a.cmd](a)
    except Exception as e:  # one line, whatever went wrong
        print("hf_family_check %s: %s: %s" % (a.cmd, type(e).__name__, " ".join(str(e).split())),
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
