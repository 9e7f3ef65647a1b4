#!/usr/bin/python3
"""Independent float64 PyTorch reference for ferry's Llama family.

Writes the tests/fixtures/llama_tiny_* (GQA, llama3 RoPE scaling, untied head) and
tests/fixtures/llama_tied_* (no GQA, plain RoPE, head tied to the embedding) files:
an F32 init in Hugging Face LlamaForCausalLM safetensors layout, the first-step
gradients, the weights after 10 unclipped AdamW steps, and a JSON file with the
per-step losses, gradient norms and learning rates of two runs (no clipping,
clipping).

The model is written here from the LlamaForCausalLM semantics (no `transformers`,
no `safetensors` package). Everything runs in float64 on one CPU thread, so the
output is bit-for-bit reproducible on the same torch build. The token data is the
existing GPT-2 shard tests/fixtures/gpt2_tiny_tokens.bin (read, never rewritten).

When /tmp/tfenv/bin/python (a virtualenv with transformers) exists, the checks also
load each init into transformers' LlamaForCausalLM through check_hf_load.py and
compare the first-step loss; without it that cross-check is skipped.

Usage: /usr/bin/python3 tests/ref/gen_llama_ref.py [--out DIR] [--skip-checks]
"""

import argparse
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

# the file and batch helpers are GPT-2's reference's (same directory)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_gpt2_ref import batch, global_norm, read_safetensors, write_safetensors  # noqa: E402

DT = torch.float64

# ---------------------------------------------------------------- configuration

# rope_scaling exactly as a Hugging Face config.json spells it. With theta 500000 and
# head_dim 16 the RoPE wavelengths 2*pi/inv_freq are 6.28, 32.5, 168, ... ; the bands
# of the llama3 rule are [0, orig/high) = [0, 8) kept, (orig/low, inf) = (64, inf)
# divided by factor and [8, 64] smoothed, so all three branches occur (asserted).
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.125,
                  "high_freq_factor": 1.0, "original_max_position_embeddings": 8}

CONFIGS = {
    "llama_tiny": {"vocab": 256, "channels": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                   "head_dim": 16, "ffn": 96, "max_seq": 64, "rope_theta": 500000.0,
                   "rope_scaling": LLAMA3_SCALING, "rms_eps": 1e-5, "tied": False},
    "llama_tied": {"vocab": 256, "channels": 64, "layers": 2, "heads": 4, "kv_heads": 4,
                   "head_dim": 16, "ffn": 96, "max_seq": 64, "rope_theta": 10000.0,
                   "rope_scaling": None, "rms_eps": 1e-5, "tied": True},
}
INIT_SEEDS = {"llama_tiny": 4242, "llama_tied": 4343}

BATCH, SEQ, STEPS = 4, 32, 10
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.1
SHARD_MAGIC, SHARD_VERSION = 20240520, 1
TOKENS_FILE = "gpt2_tiny_tokens.bin"
TFENV_PYTHON = "/tmp/tfenv/bin/python"


# ---------------------------------------------------------------- parameters

def param_shapes(cfg):
    """(name, shape, kind) in Hugging Face order; kind picks the init and weight decay.

    Names are LlamaForCausalLM's; matrices are torch.nn.Linear (out, in)."""
    V, C, L, F_ = cfg["vocab"], cfg["channels"], cfg["layers"], cfg["ffn"]
    hd = cfg["head_dim"]
    qd, kvd = cfg["heads"] * hd, cfg["kv_heads"] * hd
    out = [("model.embed_tokens.weight", (V, C), "matrix")]
    for i in range(L):
        p = "model.layers.%d." % i
        out += [
            (p + "input_layernorm.weight", (C,), "norm"),
            (p + "self_attn.q_proj.weight", (qd, C), "matrix"),
            (p + "self_attn.k_proj.weight", (kvd, C), "matrix"),
            (p + "self_attn.v_proj.weight", (kvd, C), "matrix"),
            (p + "self_attn.o_proj.weight", (C, qd), "matrix"),
            (p + "post_attention_layernorm.weight", (C,), "norm"),
            (p + "mlp.gate_proj.weight", (F_, C), "matrix"),
            (p + "mlp.up_proj.weight", (F_, C), "matrix"),
            (p + "mlp.down_proj.weight", (C, F_), "matrix"),
        ]
    out.append(("model.norm.weight", (C,), "norm"))
    if not cfg["tied"]:
        out.append(("lm_head.weight", (V, C), "matrix"))
    return out


def make_init(cfg, seed):
    """Deterministic init, rounded to float32 (what the file stores), returned as
    float64 tensors holding exactly those float32 values."""
    g = torch.Generator()
    g.manual_seed(seed)
    params = {}
    for name, shape, kind in param_shapes(cfg):
        t = torch.empty(shape, dtype=DT)
        if kind == "norm":
            t.normal_(0.0, 0.1, generator=g)
            t += 1.0
        else:
            t.normal_(0.0, 0.02, generator=g)
        params[name] = t.to(torch.float32).to(DT)
    return params


# ---------------------------------------------------------------- the model

def rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def inv_freq(cfg):
    """HF inverse frequencies (hd/2,), with the llama3 adjustment when configured."""
    hd, theta = cfg["head_dim"], cfg["rope_theta"]
    f = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=DT) / hd))
    rs = cfg["rope_scaling"]
    if rs is None:
        return f
    assert rs["rope_type"] == "llama3"
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / f
    out = torch.where(wavelen > orig / low, f / factor, f)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < orig / high) & ~(wavelen > orig / low)
    return torch.where(medium, smoothed, out)


def rope_tables(cfg, T):
    """cos, sin (T, hd) for positions 0..T-1, as HF's LlamaRotaryEmbedding."""
    freqs = torch.arange(T, dtype=DT).unsqueeze(1) * inv_freq(cfg).unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x (..., T, hd); cos, sin (T, hd)."""
    return x * cos + rotate_half(x) * sin


def attention(x, wq, wk, wv, wo, nh, nkv, cos, sin):
    """Causal grouped-query attention. Query head h reads kv head h // (nh / nkv):
    the queries are viewed as (B, nkv, group, T, hd) so each kv head serves its group."""
    B, T, C = x.shape
    hd = wq.shape[0] // nh
    grp = nh // nkv
    q = (x @ wq.t()).reshape(B, T, nh, hd).transpose(1, 2)     # (B, nh, T, hd)
    k = (x @ wk.t()).reshape(B, T, nkv, hd).transpose(1, 2)    # (B, nkv, T, hd)
    v = (x @ wv.t()).reshape(B, T, nkv, hd).transpose(1, 2)
    q = apply_rope(q, cos, sin).reshape(B, nkv, grp, T, hd)
    k = apply_rope(k, cos, sin).unsqueeze(2)                   # (B, nkv, 1, T, hd)
    v = v.unsqueeze(2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))    # (B, nkv, grp, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    att = att.masked_fill(~causal, float("-inf"))
    att = torch.softmax(att, dim=-1)
    y = (att @ v).reshape(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)
    return y @ wo.t()


def silu(x):
    return x * torch.sigmoid(x)


def mlp(x, wg, wu, wd):
    return (silu(x @ wg.t()) * (x @ wu.t())) @ wd.t()


def forward(P, idx, cfg):
    """Logits (B, T, V) for token ids idx (B, T); P maps HF names to tensors."""
    B, T = idx.shape
    eps = cfg["rms_eps"]
    cos, sin = rope_tables(cfg, T)
    x = P["model.embed_tokens.weight"][idx]
    for i in range(cfg["layers"]):
        p = "model.layers.%d." % i
        h = rms_norm(x, P[p + "input_layernorm.weight"], eps)
        x = x + attention(h, P[p + "self_attn.q_proj.weight"], P[p + "self_attn.k_proj.weight"],
                          P[p + "self_attn.v_proj.weight"], P[p + "self_attn.o_proj.weight"],
                          cfg["heads"], cfg["kv_heads"], cos, sin)
        h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
        x = x + mlp(h, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                    P[p + "mlp.down_proj.weight"])
    x = rms_norm(x, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if cfg["tied"] else P["lm_head.weight"]
    return x @ head.t()


def loss_fn(P, idx, tgt, cfg):
    logits = forward(P, idx, cfg)
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="mean")


# ---------------------------------------------------------------- data

def read_shard(path):
    """llm.c token shard: 256 int32 header (magic, version, count), then uint16 tokens."""
    with open(path, "rb") as f:
        raw = f.read()
    header = struct.unpack("<256i", raw[:1024])
    assert header[0] == SHARD_MAGIC and header[1] == SHARD_VERSION, header[:3]
    n = header[2]
    assert len(raw) == 1024 + 2 * n, (len(raw), n)
    return list(struct.unpack("<%dH" % n, raw[1024:]))


# ---------------------------------------------------------------- safetensors

def hf_tensors(P, cfg):
    return [(name, P[name]) for name, _, _ in param_shapes(cfg)]


def hf_config_json(cfg):
    """A transformers LlamaConfig for cfg (used by the optional cross-check only)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg["vocab"], "hidden_size": cfg["channels"],
        "intermediate_size": cfg["ffn"], "num_hidden_layers": cfg["layers"],
        "num_attention_heads": cfg["heads"], "num_key_value_heads": cfg["kv_heads"],
        "max_position_embeddings": cfg["max_seq"], "rope_theta": cfg["rope_theta"],
        "rope_scaling": cfg["rope_scaling"], "rms_norm_eps": cfg["rms_eps"],
        "tie_word_embeddings": cfg["tied"], "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
        "initializer_range": 0.02, "torch_dtype": "float32", "use_cache": False,
    }


# ---------------------------------------------------------------- training


def adamw_run(init, tokens, shapes, loss, decayed, clip, steps=STEPS, want_grads=False):
    """AdamW over `steps` batches: init's tensors (named by shapes, (name, shape, kind)
    triples), loss(P, x, y) the model's, weight decay WD on the tensors whose kind
    decayed() accepts (2-D ones), none on the rest; clip > 0 clips the global norm (and
    asserts it is active). Returns the run's per-step losses, norms before clipping and
    lrs, the final tensors, and (want_grads) the first step's gradients."""
    P = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    names = [n for n, _, _ in shapes]
    decay = [P[n] for n, _, k in shapes if decayed(k)]
    no_decay = [P[n] for n, _, k in shapes if not decayed(k)]
    assert all(p.dim() == 2 for p in decay) and all(p.dim() == 1 for p in no_decay)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(BETA1, BETA2), eps=EPS)
    plist = [P[n] for n in names]
    losses, norms, lrs, first_grads = [], [], [], None
    for s in range(steps):
        x, y = batch(tokens, s, BATCH, SEQ)
        opt.zero_grad(set_to_none=True)
        lv = loss(P, x, y)
        lv.backward()
        if want_grads and s == 0:
            first_grads = {n: P[n].grad.detach().clone() for n in names}
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(plist, clip).item()
            assert norm > clip, "clip %g not active at step %d (norm %r)" % (clip, s, norm)
        else:
            norm = global_norm(plist)
        opt.step()
        losses.append(lv.item())
        norms.append(norm)
        lrs.append(LR)
    final = {n: P[n].detach().clone() for n in names}
    return {"losses": losses, "grad_norms": norms, "lrs": lrs}, final, first_grads


def train(init, tokens, cfg, clip, steps=STEPS, want_grads=False):
    return adamw_run(init, tokens, param_shapes(cfg), lambda P, x, y: loss_fn(P, x, y, cfg),
                     lambda kind: kind == "matrix", clip, steps, want_grads)


# ---------------------------------------------------------------- self-checks

def llama3_scalar(f, rs):
    """The llama3 rule for one frequency, in plain Python floats: returns the new
    frequency and which band it fell in."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    wl = 2 * math.pi / f
    if wl < orig / high:
        return f, "keep"
    if wl > orig / low:
        return f / factor, "divide"
    s = (orig / wl - low) / (high - low)
    # interpolation of the scale between 1/factor and 1, written the other way round
    return f * (1.0 / factor + s * (1.0 - 1.0 / factor)), "smooth"


def check_pieces():
    g = torch.Generator()
    g.manual_seed(5)

    # RMSNorm against an explicit per-row loop
    x = torch.randn(3, 7, 16, dtype=DT, generator=g)
    w = torch.randn(16, dtype=DT, generator=g)
    want = torch.empty_like(x)
    for a in range(3):
        for b in range(7):
            r = x[a, b]
            want[a, b] = r / math.sqrt(sum(float(v) ** 2 for v in r) / 16 + 1e-5) * w
    assert torch.allclose(rms_norm(x, w, 1e-5), want, rtol=0, atol=1e-13)

    # SiLU and cross-entropy
    z = torch.linspace(-30, 30, 1001, dtype=DT)
    assert torch.allclose(silu(z), F.silu(z), rtol=0, atol=1e-14)
    lg = torch.randn(6, 11, dtype=DT, generator=g)
    tg = torch.tensor([0, 3, 10, 5, 5, 1])
    ce = -(lg - lg.logsumexp(-1, keepdim=True))[torch.arange(6), tg].mean()
    assert torch.allclose(F.cross_entropy(lg, tg), ce, rtol=0, atol=1e-14)

    # llama3 inv_freq against the scalar piecewise rule, for both configurations'
    # frequencies; the tiny configuration must hit every band
    for name, cfg in CONFIGS.items():
        hd, theta = cfg["head_dim"], cfg["rope_theta"]
        base = [theta ** (-(2.0 * i) / hd) for i in range(hd // 2)]
        got = inv_freq(cfg)
        rs = cfg["rope_scaling"]
        if rs is None:
            want = torch.tensor(base, dtype=DT)
            assert torch.allclose(got, want, rtol=1e-15, atol=0)
            continue
        pairs = [llama3_scalar(f, rs) for f in base]
        want = torch.tensor([p[0] for p in pairs], dtype=DT)
        assert torch.allclose(got, want, rtol=1e-14, atol=0), (got, want)
        bands = [p[1] for p in pairs]
        assert set(bands) == {"keep", "smooth", "divide"}, bands
        print("check: %s llama3 bands per frequency: %s" % (name, " ".join(bands)))

    # RoPE against a complex-number formulation: the pair (j, j + hd/2) is the complex
    # number x_j + i x_{j+hd/2}, multiplied by exp(i t inv_freq_j)
    for cfg in CONFIGS.values():
        hd, T = cfg["head_dim"], 9
        q = torch.randn(2, 3, T, hd, dtype=DT, generator=g)
        cos, sin = rope_tables(cfg, T)
        got = apply_rope(q, cos, sin)
        zc = torch.complex(q[..., :hd // 2], q[..., hd // 2:])
        ang = torch.arange(T, dtype=DT).unsqueeze(1) * inv_freq(cfg).unsqueeze(0)
        zr = zc * torch.polar(torch.ones_like(ang), ang)
        want = torch.cat((zr.real, zr.imag), dim=-1)
        assert torch.allclose(got, want, rtol=0, atol=1e-13), (got - want).abs().max()

    # GQA attention against HF-style repeat_kv + plain attention, and an explicit loop
    B, T, C, nh, nkv = 2, 5, 16, 4, 2
    hd = C // nh
    cfg = dict(CONFIGS["llama_tiny"], head_dim=hd)
    cos, sin = rope_tables(cfg, T)
    xa = torch.randn(B, T, C, dtype=DT, generator=g)
    wq = torch.randn(nh * hd, C, dtype=DT, generator=g)
    wk = torch.randn(nkv * hd, C, dtype=DT, generator=g)
    wv = torch.randn(nkv * hd, C, dtype=DT, generator=g)
    wo = torch.randn(C, nh * hd, dtype=DT, generator=g)
    got = attention(xa, wq, wk, wv, wo, nh, nkv, cos, sin)

    def repeat_kv(t, n):  # transformers' repeat_kv
        b, kvh, s, d = t.shape
        return t[:, :, None, :, :].expand(b, kvh, n, s, d).reshape(b, kvh * n, s, d)

    q = apply_rope((xa @ wq.t()).view(B, T, nh, hd).transpose(1, 2), cos, sin)
    k = apply_rope((xa @ wk.t()).view(B, T, nkv, hd).transpose(1, 2), cos, sin)
    v = (xa @ wv.t()).view(B, T, nkv, hd).transpose(1, 2)
    kr, vr = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
    sc = q @ kr.transpose(2, 3) / math.sqrt(hd)
    sc = sc + torch.full((T, T), float("-inf"), dtype=DT).triu(1)
    want = (torch.softmax(sc, -1) @ vr).transpose(1, 2).reshape(B, T, C) @ wo.t()
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    loop = torch.zeros(B, T, nh * hd, dtype=DT)
    for bi in range(B):
        for h in range(nh):
            kh = h // (nh // nkv)
            for t in range(T):
                s = torch.stack([(q[bi, h, t] * k[bi, kh, u]).sum() / math.sqrt(hd)
                                 for u in range(t + 1)])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                loop[bi, t, h * hd:(h + 1) * hd] = (p.unsqueeze(1) * v[bi, kh, :t + 1]).sum(0)
    assert torch.allclose(got, loop @ wo.t(), rtol=0, atol=1e-12)
    print("check: rmsnorm, silu, cross-entropy, llama3 inv_freq, rope (complex), "
          "GQA attention (repeat_kv, loop) agree")


def check_gradcheck():
    """torch.autograd.gradcheck of the whole model on small shapes, in float64."""
    for tied, nkv, rs in ((False, 2, LLAMA3_SCALING), (True, 4, None)):
        cfg = {"vocab": 11, "channels": 8, "layers": 2, "heads": 4, "kv_heads": nkv,
               "head_dim": 2, "ffn": 12, "max_seq": 6, "rope_theta": 10.0,
               "rope_scaling": rs, "rms_eps": 1e-5, "tied": tied}
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
        print("check: gradcheck passes on V=11 C=8 L=2 NH=4 NKV=%d F=12 %s, B=2 T=5 (%d params)"
              % (nkv, "tied" if tied else "untied", sum(t.numel() for t in inputs)))


def check_fd(init, grads, tokens, cfg):
    """Central differences of the real first-step loss at a few coordinates of every
    tensor, against the autograd gradients that go into the fixture."""
    x, y = batch(tokens, 0, BATCH, SEQ)
    rng = random.Random(99)
    h = 1e-5
    worst = 0.0
    for name, shape, _ in param_shapes(cfg):
        picks = rng.sample(range(init[name].numel()), 3)
        if name == "model.embed_tokens.weight":  # a row that occurs in the batch
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


def check_hf(name, init, cfg, tokens_path, loss0):
    """Optional: transformers' LlamaForCausalLM on the same weights (float64, with
    transformers' float32 upcasts removed) must give the same first-step loss."""
    if not os.path.exists(TFENV_PYTHON):
        return
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_hf_load.py")
    tmp = tempfile.mkdtemp(prefix="ferry_llama_hf_")
    try:
        write_safetensors(os.path.join(tmp, "model.safetensors"), hf_tensors(init, cfg))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config_json(cfg), f, indent=1)
        res = {}
        for mode in (["--dtype", "float64", "--exact"], ["--dtype", "float64"],
                     ["--dtype", "float32"]):
            r = subprocess.run([TFENV_PYTHON, tool, tmp, "--tokens", tokens_path] + mode,
                               capture_output=True, text=True)
            assert r.returncode == 0, "check_hf_load failed: %s" % r.stderr.strip()[-2000:]
            out = json.loads(r.stdout)
            assert out["missing"] == [] and out["unexpected"] == [], out
            res[" ".join(mode)] = out["loss"]
    finally:
        shutil.rmtree(tmp)
    exact = res["--dtype float64 --exact"]
    rel = abs(exact - loss0) / abs(loss0)
    assert rel <= 1e-10, (name, exact, loss0, rel)
    rel64 = abs(res["--dtype float64"] - loss0) / abs(loss0)
    rel32 = abs(res["--dtype float32"] - loss0) / abs(loss0)
    assert rel64 <= 1e-5 and rel32 <= 1e-5, (rel64, rel32)
    print("check: %s transformers LlamaForCausalLM loss rel. diff: float64 exact %.1e, "
          "float64 stock %.1e, float32 %.1e" % (name, rel, rel64, rel32))


# ---------------------------------------------------------------- main

def generate(name, cfg, tokens, tokens_path, out, checks):
    init = make_init(cfg, INIT_SEEDS[name])
    write_safetensors(os.path.join(out, name + "_init.safetensors"), hf_tensors(init, cfg))

    with torch.no_grad():
        x0, _ = batch(tokens, 0, BATCH, SEQ)
        logits0 = forward(init, x0, cfg)[0, 0:4, :]

    noclip, final_noclip, grads = train(init, tokens, cfg, 0.0, want_grads=True)
    if checks:
        check_fd(init, grads, tokens, cfg)
        check_hf(name, init, cfg, tokens_path, noclip["losses"][0])

    # clip: half the smallest unclipped norm, rounded down to 1 significant digit,
    # then checked to be active at every step (asserted in train)
    half = 0.5 * min(noclip["grad_norms"])
    e = math.floor(math.log10(half))
    clip = float("%.1g" % (math.floor(half / 10 ** e) * 10 ** e))
    clipped, _, _ = train(init, tokens, cfg, clip)

    write_safetensors(os.path.join(out, name + "_grads.safetensors"), hf_tensors(grads, cfg))
    write_safetensors(os.path.join(out, name + "_final_noclip.safetensors"),
                      hf_tensors(final_noclip, cfg))

    def run(r, c):
        d = {"clip": c, "schedule": "const", "warmup": 0, "min_lr": LR}
        d.update(r)
        return d

    ref = {
        "config": cfg,
        "batch": BATCH,
        "seq": SEQ,
        "steps": STEPS,
        "adamw": {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD},
        "runs": {"noclip": run(noclip, 0), "clip": run(clipped, clip)},
        "first_batch_logits_sample": logits0.tolist(),
    }
    # json writes floats with repr: the shortest string that reads back to the same double
    with open(os.path.join(out, name + "_ref.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")

    # read back what was written
    for suffix, want in (("_init", init), ("_grads", grads), ("_final_noclip", final_noclip)):
        hdr, st = read_safetensors(os.path.join(out, name + suffix + ".safetensors"))
        assert hdr["__metadata__"] == {"format": "pt"}
        assert list(st) == [n for n, _, _ in param_shapes(cfg)]
        for n, t in want.items():
            assert torch.equal(st[n].to(DT), t.to(torch.float32).to(DT)), n
        assert ("lm_head.weight" in st) == (not cfg["tied"])
    with open(os.path.join(out, name + "_ref.json")) as f:
        assert json.load(f) == json.loads(json.dumps(ref))

    for rn, r in ref["runs"].items():
        print("%s %-7s clip=%-6g losses=%s" % (name, rn, r["clip"],
                                               " ".join("%.6f" % v for v in r["losses"])))
        print("%s %-7s %-11s norms=%s" % (name, "", "", " ".join("%.4f" % v for v in r["grad_norms"])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.normpath(os.path.join(here, "..", "fixtures"))
    ap.add_argument("--out", default=fixtures)
    ap.add_argument("--tokens", default=os.path.join(fixtures, TOKENS_FILE))
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    if not args.skip_checks:
        check_pieces()
        check_gradcheck()

    tok_list = read_shard(args.tokens)
    assert len(tok_list) >= (STEPS - 1) * BATCH * SEQ + BATCH * SEQ + 1
    assert max(tok_list) < 256
    tokens = torch.tensor(tok_list, dtype=torch.long)

    for name, cfg in CONFIGS.items():
        assert cfg["channels"] == cfg["heads"] * cfg["head_dim"]
        assert cfg["heads"] % cfg["kv_heads"] == 0 and cfg["head_dim"] % 2 == 0
        generate(name, cfg, tokens, args.tokens, out, not args.skip_checks)
    print("wrote", out)


if __name__ == "__main__":
    sys.exit(main())
