#!/tmp/tfenv/bin/python
"""A tiny random LlamaForCausalLM saved by transformers itself, for ferry's HF loader.

Writes, under tests/fixtures/ (or --out):
  llama_hf_tiny/            save_pretrained(max_shard_size="40KB", safe_serialization=True):
                            config.json, generation_config.json,
                            model.safetensors.index.json, model-0000k-of-0000n.safetensors
  llama_hf_tiny_bf16/       the same weights rounded to bfloat16, one model.safetensors
  llama_hf_tiny_expected.json  losses transformers gives on the gpt2_tiny_tokens.bin batches

The model has the hyperparameters of gen_llama_ref.py's llama_tiny (GQA, llama3 RoPE
scaling, untied head), transformers' own init (normal, std 0.02) and, so that the
norm weights matter to a loader test, norm weights 1 + N(0, 0.1). Every loss is the
mean cross-entropy over all B*T positions (x = tokens[s*B*T : s*B*T + B*T] as (B, T),
y shifted by one). Run with the transformers virtualenv:

    /tmp/tfenv/bin/python tests/ref/gen_llama_hf.py [--out DIR]
"""

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import check_hf_load as chk  # noqa: E402
import gen_llama_ref as ref  # noqa: E402

SEED = 20240
NAME = "llama_hf_tiny"
CFG = ref.CONFIGS["llama_tiny"]          # same hyperparameters as the llama_tiny reference
B, T = 4, 32
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.1


def hf_config():
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=CFG["vocab"], hidden_size=CFG["channels"], intermediate_size=CFG["ffn"],
        num_hidden_layers=CFG["layers"], num_attention_heads=CFG["heads"],
        num_key_value_heads=CFG["kv_heads"], max_position_embeddings=CFG["max_seq"],
        rope_theta=CFG["rope_theta"], rope_scaling=dict(CFG["rope_scaling"]),
        rms_norm_eps=CFG["rms_eps"], tie_word_embeddings=CFG["tied"], hidden_act="silu",
        attention_bias=False, mlp_bias=False, initializer_range=0.02, torch_dtype="float32")


def ref_params(model):
    """HF state dict -> the float64 dict gen_llama_ref.py's model takes."""
    sd = {k: v.detach().to(torch.float64).clone() for k, v in model.state_dict().items()}
    assert sorted(sd) == sorted(n for n, _, _ in ref.param_shapes(CFG)), sorted(sd)
    return sd


def rel(a, b):
    return abs(a - b) / abs(b)


def adamw_step(model, x, y):
    """One torch.optim.AdamW step (weight decay on 2-D tensors only, no clipping)."""
    params = [p for _, p in model.named_parameters()]
    decay = [p for p in params if p.dim() == 2]
    no_decay = [p for p in params if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(BETA1, BETA2), eps=EPS)
    opt.zero_grad(set_to_none=True)
    loss = chk.causal_lm_loss(model, x, y)
    loss.backward()
    norm = torch.norm(torch.stack([p.grad.detach().norm(2) for p in params]), 2).item()
    opt.step()
    return loss.item(), norm


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fixtures = os.path.normpath(os.path.join(HERE, "..", "fixtures"))
    ap.add_argument("--out", default=fixtures)
    ap.add_argument("--tokens", default=os.path.join(fixtures, ref.TOKENS_FILE))
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)

    import transformers
    from transformers import LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    tokens = torch.tensor(ref.read_shard(args.tokens), dtype=torch.long)
    x1, y1 = ref.batch(tokens, 0, B, T)
    x2, y2 = ref.batch(tokens, 1, B, T)

    # ---- the model, made and saved by transformers
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(hf_config())
    g = torch.Generator()
    g.manual_seed(SEED + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                assert n.endswith("norm.weight"), n
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))

    d32 = os.path.join(out, NAME)
    d16 = os.path.join(out, NAME + "_bf16")
    for d in (d32, d16):
        if os.path.isdir(d):
            shutil.rmtree(d)
    model.save_pretrained(d32, max_shard_size="40KB", safe_serialization=True)
    files = sorted(os.listdir(d32))
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files, files

    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m16.save_pretrained(d16, safe_serialization=True)
    assert "model.safetensors" in os.listdir(d16), os.listdir(d16)
    with open(os.path.join(d16, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"

    # ---- losses, always from what was written (strict loads)
    chk.set_exact(False)
    m, _ = chk.load_strict(d32, torch.float32)
    for (n, a), (_, b) in zip(model.state_dict().items(), m.state_dict().items()):
        assert torch.equal(a, b), n
    with torch.no_grad():
        loss_f32 = chk.causal_lm_loss(m, x1, y1).item()
    m, _ = chk.load_strict(d32, torch.float64)
    with torch.no_grad():
        loss_f64_stock = chk.causal_lm_loss(m, x1, y1).item()

    chk.set_exact(True)
    m, _ = chk.load_strict(d32, torch.float64)
    P0 = ref_params(m)
    with torch.no_grad():
        loss_f64 = chk.causal_lm_loss(m, x1, y1).item()
        loss2_init = chk.causal_lm_loss(m, x2, y2).item()
    step_loss, step_norm = adamw_step(m, x1, y1)
    with torch.no_grad():
        loss2_after = chk.causal_lm_loss(m, x2, y2).item()
    assert step_loss == loss_f64

    m, _ = chk.load_strict(d16, torch.float32)
    chk.set_exact(False)
    with torch.no_grad():
        bf_f32 = chk.causal_lm_loss(m, x1, y1).item()
    for n, p in model.state_dict().items():
        assert torch.equal(m.state_dict()[n], p.to(torch.bfloat16).to(torch.float32)), n
    chk.set_exact(True)
    m, _ = chk.load_strict(d16, torch.float64)
    P16 = ref_params(m)
    with torch.no_grad():
        bf_f64 = chk.causal_lm_loss(m, x1, y1).item()
    chk.set_exact(False)

    # ---- cross-check against the from-scratch float64 reference
    with torch.no_grad():
        r1 = ref.loss_fn(P0, x1, y1, CFG).item()
        r16 = ref.loss_fn(P16, x1, y1, CFG).item()
    run, P1, _ = ref.train(P0, tokens, CFG, 0.0, steps=1)
    with torch.no_grad():
        r2 = ref.loss_fn(P1, x2, y2, CFG).item()
    assert rel(loss_f64, r1) <= 1e-12, (loss_f64, r1)
    assert rel(bf_f64, r16) <= 1e-12, (bf_f64, r16)
    assert rel(step_norm, run["grad_norms"][0]) <= 1e-10, (step_norm, run["grad_norms"])
    assert rel(loss2_after, r2) <= 1e-10, (loss2_after, r2)
    assert rel(loss_f32, r1) <= 1e-5 and rel(loss_f64_stock, r1) <= 1e-5
    assert rel(bf_f32, r16) <= 1e-5
    assert loss2_after < loss2_init
    print("check: transformers agrees with gen_llama_ref.py: loss %.1e, bf16 loss %.1e, "
          "grad norm %.1e, loss after one AdamW step %.1e (relative)"
          % (rel(loss_f64, r1), rel(bf_f64, r16), rel(step_norm, run["grad_norms"][0]),
             rel(loss2_after, r2)))

    expected = {
        "dir": NAME,
        "files": files,
        "transformers_version": transformers.__version__,
        "seed": SEED,
        "config": CFG,
        "tokens": ref.TOKENS_FILE,
        "batch": B,
        "seq": T,
        "loss_f32": loss_f32,
        "loss_f64": loss_f64,
        "loss_f64_stock": loss_f64_stock,
        "adamw": {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD},
        "step1": {"grad_norm": step_norm, "loss_batch2_before": loss2_init,
                  "loss_batch2": loss2_after},
        "bf16": {"dir": NAME + "_bf16", "files": sorted(os.listdir(d16)),
                 "loss_f32": bf_f32, "loss_f64": bf_f64},
    }
    with open(os.path.join(out, NAME + "_expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")

    total = 0
    for d in (d32, d16):
        for fn in sorted(os.listdir(d)):
            sz = os.path.getsize(os.path.join(d, fn))
            total += sz
            with open(os.path.join(d, fn), "rb") as f:
                md5 = hashlib.md5(f.read()).hexdigest()
            print("%-28s %-40s %7d %s" % (os.path.basename(d), fn, sz, md5))
    assert total < 1 << 20, total
    print("loss f32 %r  f64 %r  f64 stock %r" % (loss_f32, loss_f64, loss_f64_stock))
    print("step 1: grad norm %r, batch-2 loss %r -> %r" % (step_norm, loss2_init, loss2_after))
    print("bf16: loss f32 %r  f64 %r" % (bf_f32, bf_f64))
    print("wrote", out, "(%d bytes in the two directories)" % total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
