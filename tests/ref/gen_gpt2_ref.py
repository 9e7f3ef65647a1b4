#!/usr/bin/python3
"""Independent float64 PyTorch reference for ferry's GPT-2 (issue 2).

Writes the tests/fixtures/gpt2_tiny_* files: an F32 init in Hugging Face GPT-2
safetensors layout, an llm.c token shard, the first-step gradients, the weights
after 10 unclipped AdamW steps, and a JSON file with the per-step losses, gradient
norms and learning rates of three runs (no clipping, clipping, warmup + cosine
with clipping).

The model is written here from the GPT2LMHeadModel semantics (no `transformers`,
no `safetensors` package). Everything runs in float64 on one CPU thread, so the
output is bit-for-bit reproducible on the same torch build.

Usage: /usr/bin/python3 tests/ref/gen_gpt2_ref.py [--out DIR] [--skip-checks]
"""

import argparse
import json
import math
import os
import random
import struct
import sys

import torch
import torch.nn.functional as F

DT = torch.float64

# ---------------------------------------------------------------- configuration

CONFIG = {"vocab": 256, "max_seq": 64, "channels": 64, "layers": 2, "heads": 4}
BATCH, SEQ, STEPS = 4, 32, 10
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.1
WARMUP_COSINE = 3
MIN_LR = 0.1 * LR
INIT_SEED = 42
DATA_SEED = 1337
N_TOKENS = 16 * BATCH * SEQ + 1  # 2049: ten steps use 1281, the rest is slack

SHARD_MAGIC, SHARD_VERSION = 20240520, 1
LN_EPS = 1e-5


# ---------------------------------------------------------------- parameters

def param_shapes(cfg):
    """(name, shape, kind) in a fixed order; kind picks the init and weight decay.

    Names are Hugging Face GPT-2 names without the "transformer." prefix; matmul
    weights are Conv1D (in, out)."""
    V, T, C, L = cfg["vocab"], cfg["max_seq"], cfg["channels"], cfg["layers"]
    out = [("wte.weight", (V, C), "matrix"), ("wpe.weight", (T, C), "matrix")]
    for i in range(L):
        p = "h.%d." % i
        out += [
            (p + "ln_1.weight", (C,), "ln_w"),
            (p + "ln_1.bias", (C,), "bias"),
            (p + "attn.c_attn.weight", (C, 3 * C), "matrix"),
            (p + "attn.c_attn.bias", (3 * C,), "bias"),
            (p + "attn.c_proj.weight", (C, C), "matrix"),
            (p + "attn.c_proj.bias", (C,), "bias"),
            (p + "ln_2.weight", (C,), "ln_w"),
            (p + "ln_2.bias", (C,), "bias"),
            (p + "mlp.c_fc.weight", (C, 4 * C), "matrix"),
            (p + "mlp.c_fc.bias", (4 * C,), "bias"),
            (p + "mlp.c_proj.weight", (4 * C, C), "matrix"),
            (p + "mlp.c_proj.bias", (C,), "bias"),
        ]
    out += [("ln_f.weight", (C,), "ln_w"), ("ln_f.bias", (C,), "bias")]
    return out


def make_init(cfg, seed):
    """Deterministic init, rounded to float32 (what the file stores), returned as
    float64 tensors holding exactly those float32 values."""
    g = torch.Generator()
    g.manual_seed(seed)
    params = {}
    for name, shape, kind in param_shapes(cfg):
        t = torch.empty(shape, dtype=DT)
        if kind == "ln_w":
            t.normal_(0.0, 0.1, generator=g)
            t += 1.0
        else:  # matrix, embedding, bias
            t.normal_(0.0, 0.02, generator=g)
        params[name] = t.to(torch.float32).to(DT)
    return params


# ---------------------------------------------------------------- the model

def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def layer_norm(x, w, b):
    mean = x.mean(dim=-1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(dim=-1, keepdim=True)  # biased variance, as nn.LayerNorm
    return xc / torch.sqrt(var + LN_EPS) * w + b


def attention(x, w_attn, b_attn, w_proj, b_proj, nh):
    B, T, C = x.shape
    hs = C // nh
    qkv = x @ w_attn + b_attn                      # (B, T, 3C): q | k | v
    q, k, v = qkv.split(C, dim=-1)
    q = q.reshape(B, T, nh, hs).transpose(1, 2)    # (B, nh, T, hs)
    k = k.reshape(B, T, nh, hs).transpose(1, 2)
    v = v.reshape(B, T, nh, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    att = att.masked_fill(~causal, float("-inf"))
    att = torch.softmax(att, dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    return y @ w_proj + b_proj


def forward(P, idx, cfg):
    """Logits (B, T, V) for token ids idx (B, T); P maps HF names to tensors."""
    B, T = idx.shape
    x = P["wte.weight"][idx] + P["wpe.weight"][:T].unsqueeze(0)
    for i in range(cfg["layers"]):
        p = "h.%d." % i
        h = layer_norm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"])
        x = x + attention(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"],
                          P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"], cfg["heads"])
        h = layer_norm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"])
        h = gelu_tanh(h @ P[p + "mlp.c_fc.weight"] + P[p + "mlp.c_fc.bias"])
        x = x + (h @ P[p + "mlp.c_proj.weight"] + P[p + "mlp.c_proj.bias"])
    x = layer_norm(x, P["ln_f.weight"], P["ln_f.bias"])
    return x @ P["wte.weight"].t()                 # tied LM head


def loss_fn(P, idx, tgt, cfg):
    logits = forward(P, idx, cfg)
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="mean")


# ---------------------------------------------------------------- data

def make_text(n_bytes, seed):
    """A small deterministic grammar: sentences over a fixed vocabulary, with a few
    UTF-8 words so that byte values above 127 occur too."""
    rng = random.Random(seed)
    subj = ["the cat", "a dog", "the old ferry", "my friend", "the river", "a small bird",
            "the engineer", "the café owner", "every child", "the naïve student"]
    verb = ["sees", "likes", "carries", "follows", "paints", "hears", "builds", "crosses",
            "finds", "remembers"]
    obj = ["the boat", "a red apple", "the bridge", "some bread", "the morning light",
           "a long letter", "the garden", "the crème brûlée", "an open door", "the sea"]
    adv = ["slowly", "again", "today", "at night", "without a word", "with great care"]
    out = bytearray()
    while len(out) < n_bytes:
        s = rng.choice(subj) + " " + rng.choice(verb) + " " + rng.choice(obj)
        if rng.random() < 0.4:
            s += " " + rng.choice(adv)
        s = s[0].upper() + s[1:]
        s += rng.choice([".", ".", ".", "!", "?"])
        s += "\n" if rng.random() < 0.2 else " "
        out += s.encode("utf-8")
    return bytes(out[:n_bytes])


def write_shard(path, tokens):
    header = [0] * 256
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    assert all(0 <= t < 65536 for t in tokens)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def batch(tokens, step, B, T):
    """llm.c-style sequential batch (no wrap needed for these step counts)."""
    start = step * B * T
    buf = tokens[start:start + B * T + 1]
    assert buf.numel() == B * T + 1
    return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)


# ---------------------------------------------------------------- safetensors

def write_safetensors(path, tensors):
    """tensors: list of (name, tensor); stored F32 little-endian in the given order."""
    header = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for name, t in tensors:
        data = t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """Minimal reader, used only to check what was written."""
    import numpy as np
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype="<f4").reshape(e["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return header, out


def hf_tensors(P, cfg, with_mask):
    out = []
    for name, _, _ in param_shapes(cfg):
        out.append(("transformer." + name, P[name]))
        if with_mask and name.endswith("ln_1.bias"):
            # legacy HF buffer h.{i}.attn.bias: causal mask (1, 1, maxT, maxT)
            T = cfg["max_seq"]
            mask = torch.ones(T, T, dtype=torch.float32).tril().reshape(1, 1, T, T)
            out.append(("transformer." + name.replace("ln_1.bias", "attn.bias"), mask))
    return out


# ---------------------------------------------------------------- training

def lr_at(step, schedule, warmup, steps):
    if schedule == "const":
        return LR
    if step < warmup:
        return LR * (step + 1) / warmup
    r = (step - warmup) / max(1, steps - warmup)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * r)) * (LR - MIN_LR)


def global_norm(params):
    return torch.norm(torch.stack([p.grad.detach().norm(2) for p in params]), 2).item()


def train(init, tokens, cfg, schedule, warmup, clip, want_grads=False):
    P = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    names = [n for n, _, _ in param_shapes(cfg)]
    kinds = {n: k for n, _, k in param_shapes(cfg)}
    decay = [P[n] for n in names if kinds[n] == "matrix"]
    no_decay = [P[n] for n in names if kinds[n] != "matrix"]
    assert all(p.dim() == 2 for p in decay) and all(p.dim() == 1 for p in no_decay)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(BETA1, BETA2), eps=EPS)
    plist = [P[n] for n in names]
    losses, norms, lrs, first_grads = [], [], [], None
    for s in range(STEPS):
        x, y = batch(tokens, s, BATCH, SEQ)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(P, x, y, cfg)
        loss.backward()
        if want_grads and s == 0:
            first_grads = {n: P[n].grad.detach().clone() for n in names}
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(plist, clip).item()
            assert norm > clip, "clip %g not active at step %d (norm %r)" % (clip, s, norm)
        else:
            norm = global_norm(plist)
        lr = lr_at(s, schedule, warmup, STEPS)
        for gr in opt.param_groups:
            gr["lr"] = lr
        opt.step()
        losses.append(loss.item())
        norms.append(norm)
        lrs.append(lr)
    final = {n: P[n].detach().clone() for n in names}
    return {"losses": losses, "grad_norms": norms, "lrs": lrs}, final, first_grads


# ---------------------------------------------------------------- self-checks

def check_pieces():
    g = torch.Generator()
    g.manual_seed(5)
    x = torch.randn(3, 7, 16, dtype=DT, generator=g)
    w = torch.randn(16, dtype=DT, generator=g)
    b = torch.randn(16, dtype=DT, generator=g)
    ref = F.layer_norm(x, (16,), w, b, eps=LN_EPS)
    assert torch.allclose(layer_norm(x, w, b), ref, rtol=0, atol=1e-13)
    z = torch.linspace(-8, 8, 1001, dtype=DT)
    assert torch.allclose(gelu_tanh(z), F.gelu(z, approximate="tanh"), rtol=0, atol=1e-14)

    # attention against an explicit per-head, per-position loop
    B, T, C, nh = 2, 5, 8, 2
    hs = C // nh
    xa = torch.randn(B, T, C, dtype=DT, generator=g)
    wa = torch.randn(C, 3 * C, dtype=DT, generator=g)
    ba = torch.randn(3 * C, dtype=DT, generator=g)
    wp = torch.randn(C, C, dtype=DT, generator=g)
    bp = torch.randn(C, dtype=DT, generator=g)
    got = attention(xa, wa, ba, wp, bp, nh)
    want = torch.zeros(B, T, C, dtype=DT)
    for bi in range(B):
        qkv = xa[bi] @ wa + ba
        yb = torch.zeros(T, C, dtype=DT)
        for h in range(nh):
            q = qkv[:, h * hs:(h + 1) * hs]
            k = qkv[:, C + h * hs:C + (h + 1) * hs]
            v = qkv[:, 2 * C + h * hs:2 * C + (h + 1) * hs]
            for t in range(T):
                sc = torch.stack([(q[t] * k[u]).sum() / math.sqrt(hs) for u in range(t + 1)])
                p = torch.exp(sc - sc.max())
                p = p / p.sum()
                yb[t, h * hs:(h + 1) * hs] = (p.unsqueeze(1) * v[:t + 1]).sum(0)
        want[bi] = yb @ wp + bp
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()

    # cross-entropy = mean of -log softmax at the targets
    lg = torch.randn(6, 11, dtype=DT, generator=g)
    tg = torch.tensor([0, 3, 10, 5, 5, 1])
    ce = -(lg - lg.logsumexp(-1, keepdim=True))[torch.arange(6), tg].mean()
    assert torch.allclose(F.cross_entropy(lg, tg), ce, rtol=0, atol=1e-14)
    print("check: layernorm, gelu, attention loop, cross-entropy agree")


def check_gradcheck():
    """torch.autograd.gradcheck of the whole model on a small shape, in float64."""
    cfg = {"vocab": 11, "max_seq": 6, "channels": 8, "layers": 2, "heads": 2}
    init = make_init(cfg, 7)
    names = [n for n, _, _ in param_shapes(cfg)]
    g = torch.Generator()
    g.manual_seed(3)
    idx = torch.randint(0, 11, (2, 5), generator=g)
    tgt = torch.randint(0, 11, (2, 5), generator=g)

    def f(*ts):
        return loss_fn(dict(zip(names, ts)), idx, tgt, cfg)

    inputs = tuple(init[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
    print("check: gradcheck passes on V=11 T=6 C=8 L=2 NH=2, B=2 T=5 (%d params)"
          % sum(t.numel() for t in inputs))


def check_fd(init, grads, tokens, cfg):
    """Central differences of the real first-step loss at a few coordinates of every
    tensor, against the autograd gradients that go into the fixture."""
    x, y = batch(tokens, 0, BATCH, SEQ)
    rng = random.Random(99)
    h = 1e-5
    worst = 0.0
    for name, shape, _ in param_shapes(cfg):
        flat_n = init[name].numel()
        picks = rng.sample(range(flat_n), 3)
        if name == "wte.weight":  # a row that occurs in the batch (embedding + head)
            picks.append(int(x[0, 0]) * cfg["channels"] + 5)
        for j in picks:
            P = {k: v.clone() for k, v in init.items()}
            P[name].view(-1)[j] += h
            lp = loss_fn(P, x, y, cfg).item()
            P[name].view(-1)[j] -= 2 * h
            lm = loss_fn(P, x, y, cfg).item()
            fd = (lp - lm) / (2 * h)
            ad = grads[name].reshape(-1)[j].item()
            err = abs(fd - ad)
            assert err <= 1e-9 + 1e-6 * abs(ad), (name, j, fd, ad)
            worst = max(worst, err / (abs(ad) + 1e-9))
    print("check: finite differences agree at %d tensors x 3-4 coordinates (worst rel %.2e)"
          % (len(param_shapes(cfg)), worst))


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "fixtures"))
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = CONFIG

    if not args.skip_checks:
        check_pieces()
        check_gradcheck()

    text = make_text(N_TOKENS, DATA_SEED)
    tok_list = list(text)
    assert max(tok_list) < cfg["vocab"] and max(tok_list) > 127
    tokens = torch.tensor(tok_list, dtype=torch.long)
    write_shard(os.path.join(out, "gpt2_tiny_tokens.bin"), tok_list)

    init = make_init(cfg, INIT_SEED)
    write_safetensors(os.path.join(out, "gpt2_tiny_init.safetensors"),
                      hf_tensors(init, cfg, with_mask=True))

    with torch.no_grad():
        x0, _ = batch(tokens, 0, BATCH, SEQ)
        logits0 = forward(init, x0, cfg)[0, 0:4, :]

    noclip, final_noclip, grads = train(init, tokens, cfg, "const", 0, 0.0, want_grads=True)
    if not args.skip_checks:
        check_fd(init, grads, tokens, cfg)

    # clip: half the smallest unclipped norm, rounded down to 1 significant digit,
    # then checked to be active at every step of both clipped runs (asserted in train)
    half = 0.5 * min(noclip["grad_norms"])
    e = math.floor(math.log10(half))
    clip = math.floor(half / 10 ** e) * 10 ** e
    clip = float("%.1g" % clip)
    clipped, _, _ = train(init, tokens, cfg, "const", 0, clip)
    cosine, _, _ = train(init, tokens, cfg, "cosine", WARMUP_COSINE, clip)

    write_safetensors(os.path.join(out, "gpt2_tiny_grads.safetensors"),
                      hf_tensors(grads, cfg, with_mask=False))
    write_safetensors(os.path.join(out, "gpt2_tiny_final_noclip.safetensors"),
                      hf_tensors(final_noclip, cfg, with_mask=False))

    def run(r, c, sched, warm):
        d = {"clip": c, "schedule": sched, "warmup": warm, "min_lr": MIN_LR}
        d.update(r)
        return d

    ref = {
        "config": cfg,
        "batch": BATCH,
        "seq": SEQ,
        "steps": STEPS,
        "adamw": {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD},
        "runs": {
            "noclip": run(noclip, 0, "const", 0),
            "clip": run(clipped, clip, "const", 0),
            "cosine": run(cosine, clip, "cosine", WARMUP_COSINE),
        },
        "first_batch_logits_sample": logits0.tolist(),
    }
    # json writes floats with repr: the shortest string that reads back to the same double
    with open(os.path.join(out, "gpt2_tiny_ref.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")

    # read back what was written
    hdr, st = read_safetensors(os.path.join(out, "gpt2_tiny_init.safetensors"))
    assert hdr["__metadata__"] == {"format": "pt"}
    for n, t in init.items():
        assert torch.equal(st["transformer." + n].to(DT), t), n
    assert "lm_head.weight" not in st

    for name, r in ref["runs"].items():
        print("%-7s clip=%-6g losses=%s" % (name, r["clip"], " ".join("%.6f" % v for v in r["losses"])))
        print("%-7s %-11s norms=%s" % ("", "", " ".join("%.4f" % v for v in r["grad_norms"])))
    print("wrote", out)


if __name__ == "__main__":
    sys.exit(main())
