#!/tmp/tfenv/bin/python
"""Independent float64 PyTorch reference for ferry's Llama-like families.

One model with switches covers qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm,
free head_dim), mistral (sliding window on every layer), gemma2 (Gemma norms
x*rstd*(1+w), four norms a layer, GeGLU with tanh GELU, embedding times sqrt(C),
query_pre_attn_scalar, attention and final logit soft-caps, alternating sliding
layers), gemma3_text (q/k Gemma norms, config layer_types, a local RoPE with
rope_local_base_freq and a global one with rope_theta and linear scaling) and phi3
(fused qkv_proj and gate_up_proj, partial_rotary_factor, longrope).

For each family it writes tests/fixtures/fam_<family>/ (config.json written by
transformers' own config class, model.safetensors: the F32 init under the Hugging
Face names), fam_<family>_grads.safetensors (first-step gradients),
fam_<family>_final_noclip.safetensors (weights after 10 unclipped AdamW steps) and
fam_<family>_ref.json (the layout of llama_tiny_ref.json plus "family").

The math is written here from the published modeling code's semantics, in plain
torch; transformers is imported only to write config.json (its config classes), and
the cross-check runs transformers in a separate process (hf_family_check.py). The
model reads its shape and switches back from the config.json transformers wrote
(model_cfg), so the fixture's config is what this reference computed with.

Usage: /tmp/tfenv/bin/python tests/ref/gen_family_ref.py [--out DIR] [--skip-checks]
           [--only FAMILY ...]
       /tmp/tfenv/bin/python tests/ref/gen_family_ref.py --check-dir DIR [--steps N]
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_gpt2_ref import batch, read_safetensors, write_safetensors  # noqa: E402
from gen_llama_ref import (BATCH, BETA1, BETA2, EPS, LR, SEQ, STEPS, WD,  # noqa: E402
                           adamw_run, read_shard)

DT = torch.float64
TOKENS_FILE = "gpt2_tiny_tokens.bin"
TFENV_PYTHON = "/tmp/tfenv/bin/python"

# ---------------------------------------------------------------- the fixtures

# Keyword arguments of each family's transformers config class. Shapes are tiny (V=256,
# C=64, L=3) and chosen so each feature changes the numbers: windows shorter than T=32,
# head_dim != C/NH where the family allows it, GQA in all but one, soft-caps that bind.
COMMON = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3,
          "max_position_embeddings": 64, "torch_dtype": "float32", "use_cache": False,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}


def phi3_factors(n):
    """longrope factors, distinct per pair and between the two lists."""
    short = [round(1.0 + 0.1 * i, 6) for i in range(n)]
    long = [round(1.0 + 0.75 * i + 0.125 * (i % 3), 6) for i in range(n)]
    return short, long


FAMILIES = {
    # Qwen2.5-like: q/k/v biases, tied head (as the small Qwen2.5 models), no window
    "qwen2": dict(COMMON, model_type="qwen2", intermediate_size=36, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_sliding_window=False),
    # Qwen3: q_norm/k_norm per head before RoPE, head_dim 24 != 64/2, tied (as Qwen3 0.6B-4B)
    "qwen3": dict(COMMON, model_type="qwen3", intermediate_size=48, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=24, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, attention_bias=False, use_sliding_window=False),
    # Mistral: sliding window 12 on every layer, head_dim 16 != 64/2, untied
    "mistral": dict(COMMON, model_type="mistral", intermediate_size=40, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, sliding_window=12),
    # Gemma2: even layers slide (window 8), query_pre_attn_scalar 64 != head_dim 16,
    # attention soft-cap 3, final soft-cap 3, tied
    "gemma2": dict(COMMON, model_type="gemma2", intermediate_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=64,
                   sliding_window=8, attn_logit_softcapping=3.0, final_logit_softcapping=3.0,
                   rope_theta=10000.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=True),
    # Gemma3 (text): layer_types given (sliding, sliding, full), window 10, q/k norms,
    # local RoPE base 10000 (default rope), global rope_theta 1000 with linear factor 4,
    # query_pre_attn_scalar 40 != head_dim 32, no soft-caps (as the released models), tied
    "gemma3_text": dict(COMMON, model_type="gemma3_text", intermediate_size=36,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        query_pre_attn_scalar=40, sliding_window=10,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_theta=1000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 4.0},
                        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                        final_logit_softcapping=None, attn_logit_softcapping=None,
                        tie_word_embeddings=True),
    # Phi-4-mini style: fused projections, head_dim 32, partial_rotary_factor 0.75 (24
    # rotated channels, 12 pairs), longrope with original_max_position_embeddings 16 <
    # T=32 (so the long factors are used), sliding window 8, tied
    "phi3": dict(COMMON, model_type="phi3", intermediate_size=32, num_attention_heads=2,
                 num_key_value_heads=1, partial_rotary_factor=0.75, rope_theta=10000.0,
                 original_max_position_embeddings=16, sliding_window=8,
                 rope_scaling={"type": "longrope", "short_factor": phi3_factors(12)[0],
                               "long_factor": phi3_factors(12)[1]},
                 rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True),
}
INIT_SEEDS = {"qwen2": 5101, "qwen3": 5102, "mistral": 5103, "gemma2": 5104,
              "gemma3_text": 5105, "phi3": 5106}
# init standard deviations of the matrices: q/k large enough for position-dependent
# attention (and, in gemma2, scores past the soft-cap); gemma2's embedding large enough
# for logits past the final soft-cap; qwen3's q/k large so that its q/k norms matter,
# phi3's so that its longrope factors do (check_features_matter asserts each), and no
# larger: at 0.3 its 10-step trajectory amplifies fp32 rounding (a float32 run of this
# reference drifts 4e-4 from the float64 one by step 8), past the C tests' 1e-4
INIT_STD = {"embed": 0.1, "qk": 0.15, "other": 0.1}
INIT_STD_FAMILY = {"gemma2": {"embed": 0.3, "qk": 0.25, "other": 0.1},
                   "qwen3": {"embed": 0.1, "qk": 0.4, "other": 0.1},
                   "phi3": {"embed": 0.1, "qk": 0.2, "other": 0.1}}


def write_hf_config(family, path):
    """config.json written by transformers' own config class (the only transformers use)."""
    import transformers
    kw = dict(FAMILIES[family])
    model_type = kw.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg.architectures = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
                          "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}[family]]
    cfg.to_json_file(path, use_diff=False)


# ---------------------------------------------------------------- config.json -> model

def model_cfg(d):
    """The reference's switches, read from a config.json dict (transformers' rules,
    restated): per-layer window and RoPE, norms, caps, head_dim."""
    mt = d["model_type"]
    C, NH, L = d["hidden_size"], d["num_attention_heads"], d["num_hidden_layers"]
    hd = d.get("head_dim") or C // NH
    if mt == "phi3":
        hd = C // NH                       # Phi3Config has no head_dim
    gemma = mt in ("gemma2", "gemma3_text")
    c = {"family": mt, "vocab": d["vocab_size"], "channels": C, "layers": L, "heads": NH,
         "kv_heads": d.get("num_key_value_heads") or NH, "head_dim": hd,
         "ffn": d["intermediate_size"], "rms_eps": d["rms_norm_eps"],
         "tied": d.get("tie_word_embeddings", True), "qkv_bias": mt == "qwen2",
         "qk_norm": mt in ("qwen3", "gemma3_text"), "gemma": gemma, "fused": mt == "phi3",
         "attn_softcap": d.get("attn_logit_softcapping") if gemma else None,
         "final_softcap": d.get("final_logit_softcapping") if gemma else None,
         "attn_scale": (d["query_pre_attn_scalar"] if gemma else hd) ** -0.5,
         "embed_scale": math.sqrt(C) if gemma else 1.0}
    # sliding windows: a key k is visible to query q when q - w < k <= q
    if mt in ("gemma2", "gemma3_text", "qwen2", "qwen3"):
        types = d["layer_types"]
        win = [d["sliding_window"] if t == "sliding_attention" else 0 for t in types]
    else:  # mistral, phi3: every layer when sliding_window is set
        win = [d.get("sliding_window") or 0] * L
    c["windows"] = win
    # RoPE per layer: (theta, rotary dim, scaling)
    prf = d.get("partial_rotary_factor", 1.0) if mt == "phi3" else 1.0
    rdim = int(hd * prf)
    glob = {"theta": d["rope_theta"], "dim": rdim, "scaling": d.get("rope_scaling")}
    if mt == "phi3":
        glob["orig_max"] = d["original_max_position_embeddings"]
        glob["max_pos"] = d["max_position_embeddings"]
    if mt == "gemma3_text":
        local = {"theta": d["rope_local_base_freq"], "dim": rdim, "scaling": None}
        c["ropes"] = [local if t == "sliding_attention" else glob for t in d["layer_types"]]
    else:
        c["ropes"] = [glob] * L
    return c


# ---------------------------------------------------------------- parameters

def param_shapes(c):
    """(name, shape, kind) in Hugging Face names; kind: embed, qk, matrix (2-D, decay),
    bias, norm (weight w, used as w) or gnorm (Gemma: used as 1 + w)."""
    V, C, L, Fn = c["vocab"], c["channels"], c["layers"], c["ffn"]
    hd = c["head_dim"]
    qd, kvd = c["heads"] * hd, c["kv_heads"] * hd
    nk = "gnorm" if c["gemma"] else "norm"
    out = [("model.embed_tokens.weight", (V, C), "embed")]
    for i in range(L):
        p = "model.layers.%d." % i
        out.append((p + "input_layernorm.weight", (C,), nk))
        if c["fused"]:
            out.append((p + "self_attn.qkv_proj.weight", (qd + 2 * kvd, C), "qk"))
        else:
            out.append((p + "self_attn.q_proj.weight", (qd, C), "qk"))
            if c["qkv_bias"]:
                out.append((p + "self_attn.q_proj.bias", (qd,), "bias"))
            out.append((p + "self_attn.k_proj.weight", (kvd, C), "qk"))
            if c["qkv_bias"]:
                out.append((p + "self_attn.k_proj.bias", (kvd,), "bias"))
            out.append((p + "self_attn.v_proj.weight", (kvd, C), "matrix"))
            if c["qkv_bias"]:
                out.append((p + "self_attn.v_proj.bias", (kvd,), "bias"))
        out.append((p + "self_attn.o_proj.weight", (C, qd), "matrix"))
        if c["qk_norm"]:
            out.append((p + "self_attn.q_norm.weight", (hd,), nk))
            out.append((p + "self_attn.k_norm.weight", (hd,), nk))
        out.append((p + "post_attention_layernorm.weight", (C,), nk))
        if c["gemma"]:
            out.append((p + "pre_feedforward_layernorm.weight", (C,), nk))
        if c["fused"]:
            out.append((p + "mlp.gate_up_proj.weight", (2 * Fn, C), "matrix"))
        else:
            out.append((p + "mlp.gate_proj.weight", (Fn, C), "matrix"))
            out.append((p + "mlp.up_proj.weight", (Fn, C), "matrix"))
        out.append((p + "mlp.down_proj.weight", (C, Fn), "matrix"))
        if c["gemma"]:
            out.append((p + "post_feedforward_layernorm.weight", (C,), nk))
    out.append(("model.norm.weight", (C,), nk))
    if not c["tied"]:
        out.append(("lm_head.weight", (V, C), "matrix"))
    return out


def make_init(c, seed, std):
    """Deterministic init rounded to float32, held as float64. Norm weights are not the
    identity: w = 1 + N(0, 0.1) (norm), w = N(0, 0.2) (gnorm, used as 1 + w); biases
    N(0, 0.1); the fused qkv rows get the q/k std for q and k and the other for v."""
    g = torch.Generator()
    g.manual_seed(seed)
    P = {}
    for name, shape, kind in param_shapes(c):
        t = torch.empty(shape, dtype=DT)
        if kind == "norm":
            t.normal_(0.0, 0.1, generator=g)
            t += 1.0
        elif kind == "gnorm":
            t.normal_(0.0, 0.2, generator=g)
        elif kind == "bias":
            t.normal_(0.0, 0.1, generator=g)
        elif kind == "embed":
            t.normal_(0.0, std["embed"], generator=g)
        elif kind == "qk":
            t.normal_(0.0, std["qk"], generator=g)
            if c["fused"]:  # v rows of qkv_proj
                vrows = c["kv_heads"] * c["head_dim"]
                t[-vrows:] *= std["other"] / std["qk"]
        else:
            t.normal_(0.0, std["other"], generator=g)
        P[name] = t.to(torch.float32).to(DT)
    return P


def decays(kind):
    return kind in ("embed", "qk", "matrix")


# ---------------------------------------------------------------- the model

def rms_norm(x, w, eps, gemma):
    r = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return r * (1.0 + w) if gemma else r * w


def rope_tables(rope, T):
    """cos, sin (T, dim) of one RoPE for positions 0..T-1 of a sequence of length T.

    Pairs are (j, j + dim/2), j < dim/2, with frequency theta^(-2j/dim) (dim = the rotated
    channels, head_dim * partial_rotary_factor). linear: frequencies / factor. longrope:
    frequencies / ext_j where ext is long_factor when T > original_max_position_embeddings,
    else short_factor; cos and sin times attention_factor =
    sqrt(1 + ln(max_pos / orig) / ln(orig)) (1 when max_pos <= orig)."""
    dim = rope["dim"]
    inv = rope["theta"] ** (-torch.arange(0, dim, 2, dtype=DT) / dim)
    att = 1.0
    rs = rope["scaling"]
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            inv = inv / rs["factor"]
        elif kind == "longrope":
            orig, mx = rope["orig_max"], rope["max_pos"]
            ext = rs["long_factor"] if T > orig else rs["short_factor"]
            inv = inv / torch.tensor(ext, dtype=DT)
            factor = mx / orig
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        elif kind != "default":
            raise ValueError("rope type %r" % kind)
    ang = torch.arange(T, dtype=DT).unsqueeze(1) * inv.unsqueeze(0)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos() * att, emb.sin() * att


def apply_rope(x, cos, sin):
    """x (..., T, hd): the first dim channels rotate as pairs (j, j + dim/2), the rest pass."""
    d = cos.shape[-1]
    xr, xp = x[..., :d], x[..., d:]
    h = d // 2
    rot = torch.cat((-xr[..., h:], xr[..., :h]), dim=-1)
    return torch.cat((xr * cos + rot * sin, xp), dim=-1)


def visible(T, window):
    """(T, T) bool: key k visible to query q when k <= q and (window == 0 or k > q - window)."""
    q = torch.arange(T).unsqueeze(1)
    k = torch.arange(T).unsqueeze(0)
    m = k <= q
    if window:
        m = m & (k > q - window)
    return m


def softcap(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def attention(h, P, p, c, i, stats=None):
    B, T, C = h.shape
    nh, nkv, hd = c["heads"], c["kv_heads"], c["head_dim"]
    grp = nh // nkv
    if c["fused"]:
        qkv = h @ P[p + "self_attn.qkv_proj.weight"].t()
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    else:
        q = h @ P[p + "self_attn.q_proj.weight"].t()
        k = h @ P[p + "self_attn.k_proj.weight"].t()
        v = h @ P[p + "self_attn.v_proj.weight"].t()
        if c["qkv_bias"]:
            q = q + P[p + "self_attn.q_proj.bias"]
            k = k + P[p + "self_attn.k_proj.bias"]
            v = v + P[p + "self_attn.v_proj.bias"]
    q = q.reshape(B, T, nh, hd)
    k = k.reshape(B, T, nkv, hd)
    v = v.reshape(B, T, nkv, hd).transpose(1, 2).unsqueeze(2)     # (B, nkv, 1, T, hd)
    if c["qk_norm"]:
        q = rms_norm(q, P[p + "self_attn.q_norm.weight"], c["rms_eps"], c["gemma"])
        k = rms_norm(k, P[p + "self_attn.k_norm.weight"], c["rms_eps"], c["gemma"])
    cos, sin = rope_tables(c["ropes"][i], T)
    q = apply_rope(q.transpose(1, 2), cos, sin).reshape(B, nkv, grp, T, hd)
    k = apply_rope(k.transpose(1, 2), cos, sin).unsqueeze(2)
    s = (q @ k.transpose(-2, -1)) * c["attn_scale"]                # (B, nkv, grp, T, T)
    if stats is not None and c["attn_softcap"]:
        stats.append(float(s.detach().abs().max()) / c["attn_softcap"])
    s = softcap(s, c["attn_softcap"])
    s = s.masked_fill(~visible(T, c["windows"][i]), float("-inf"))
    y = (torch.softmax(s, dim=-1) @ v).reshape(B, nh, T, hd).transpose(1, 2)
    return y.reshape(B, T, nh * hd) @ P[p + "self_attn.o_proj.weight"].t()


def mlp(h, P, p, c):
    if c["fused"]:
        gate, up = (h @ P[p + "mlp.gate_up_proj.weight"].t()).chunk(2, dim=-1)
    else:
        gate = h @ P[p + "mlp.gate_proj.weight"].t()
        up = h @ P[p + "mlp.up_proj.weight"].t()
    if c["gemma"]:  # GELU, tanh form
        act = 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)))
    else:
        act = gate * torch.sigmoid(gate)
    return (act * up) @ P[p + "mlp.down_proj.weight"].t()


def forward(P, idx, c, stats=None):
    """Logits (B, T, V) for token ids idx (B, T)."""
    eps, gm = c["rms_eps"], c["gemma"]
    x = P["model.embed_tokens.weight"][idx] * c["embed_scale"]
    for i in range(c["layers"]):
        p = "model.layers.%d." % i
        h = rms_norm(x, P[p + "input_layernorm.weight"], eps, gm)
        a = attention(h, P, p, c, i, stats)
        if gm:
            x = x + rms_norm(a, P[p + "post_attention_layernorm.weight"], eps, gm)
            h = rms_norm(x, P[p + "pre_feedforward_layernorm.weight"], eps, gm)
            x = x + rms_norm(mlp(h, P, p, c), P[p + "post_feedforward_layernorm.weight"], eps, gm)
        else:
            x = x + a
            h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps, gm)
            x = x + mlp(h, P, p, c)
    x = rms_norm(x, P["model.norm.weight"], eps, gm)
    head = P["model.embed_tokens.weight"] if c["tied"] else P["lm_head.weight"]
    logits = x @ head.t()
    if stats is not None and c["final_softcap"]:
        stats.append(float(logits.detach().abs().max()) / c["final_softcap"])
    return softcap(logits, c["final_softcap"])


def loss_fn(P, idx, tgt, c):
    logits = forward(P, idx, c)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


# ---------------------------------------------------------------- training

def train(init, tokens, c, clip, steps=STEPS, want_grads=False):
    """AdamW as gen_llama_ref.py: decay 0.1 on the 2-D tensors, none on biases and norms."""
    return adamw_run(init, tokens, param_shapes(c), lambda P, x, y: loss_fn(P, x, y, c), decays,
                     clip, steps, want_grads)


# ---------------------------------------------------------------- self-checks

def check_pieces():
    g = torch.Generator()
    g.manual_seed(11)
    # window mask against the rule written as a loop
    for w in (0, 1, 3, 8):
        m = visible(9, w)
        for q in range(9):
            for k in range(9):
                assert bool(m[q, k]) == (k <= q and (w == 0 or q - k < w)), (w, q, k)
    # partial RoPE against a complex-number form on the rotated channels
    rope = {"theta": 100.0, "dim": 6, "scaling": {"type": "longrope", "short_factor": [1, 2, 3],
            "long_factor": [4, 5, 6]}, "orig_max": 4, "max_pos": 16}
    for T in (4, 7):
        x = torch.randn(2, T, 8, dtype=DT, generator=g)
        cos, sin = rope_tables(rope, T)
        got = apply_rope(x, cos, sin)
        ext = torch.tensor([4.0, 5, 6] if T > 4 else [1.0, 2, 3], dtype=DT)
        inv = torch.tensor([100.0 ** (-2.0 * j / 6) for j in range(3)], dtype=DT) / ext
        att = math.sqrt(1 + math.log(4.0) / math.log(4))
        ang = torch.arange(T, dtype=DT).unsqueeze(1) * inv
        z = torch.complex(x[..., :3], x[..., 3:6]) * torch.polar(torch.full_like(ang, att), ang)
        want = torch.cat((z.real, z.imag, x[..., 6:]), dim=-1)
        assert torch.allclose(got, want, rtol=0, atol=1e-13)
    # tanh GELU against torch's
    z = torch.linspace(-8, 8, 401, dtype=DT)
    c = {"fused": False, "gemma": True}
    P = {"l.mlp.gate_proj.weight": torch.ones(1, 1, dtype=DT),
         "l.mlp.up_proj.weight": torch.ones(1, 1, dtype=DT),
         "l.mlp.down_proj.weight": torch.ones(1, 1, dtype=DT)}
    got = mlp(z.reshape(-1, 1), P, "l.", c).reshape(-1)
    assert torch.allclose(got, F.gelu(z, approximate="tanh") * z, rtol=0, atol=1e-13)
    print("check: window mask (loop), partial longrope RoPE (complex form), tanh GELU agree")


def small_cfg(family):
    """The family's config at gradcheck size (V=11, C=8, T=6 with windows of 3)."""
    d = json.loads(json.dumps(FAMILIES[family]))
    d.update(vocab_size=11, hidden_size=8, intermediate_size=6, num_hidden_layers=3)
    d["head_dim"] = 4 if "head_dim" in d else None
    if family == "phi3":  # head_dim 8, 6 rotated channels, long factors at T=6 > 4
        d.update(num_attention_heads=1, num_key_value_heads=1, original_max_position_embeddings=4,
                 max_position_embeddings=16, sliding_window=3)
        d["rope_scaling"] = {"type": "longrope", "short_factor": [1.0, 1.5, 2.0],
                             "long_factor": [2.5, 3.0, 4.0]}
    if d.get("sliding_window"):
        d["sliding_window"] = 3
    if family == "gemma2":
        d["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
        d["query_pre_attn_scalar"] = 5
    if family in ("qwen2", "qwen3"):
        d["layer_types"] = ["full_attention"] * 3
    return model_cfg(d)


def check_gradcheck(family):
    c = small_cfg(family)
    init = make_init(c, 7, {"embed": 0.5, "qk": 0.5, "other": 0.5})
    names = [n for n, _, _ in param_shapes(c)]
    g = torch.Generator()
    g.manual_seed(3)
    idx = torch.randint(0, 11, (2, 6), generator=g)
    tgt = torch.randint(0, 11, (2, 6), generator=g)

    def f(*ts):
        return loss_fn(dict(zip(names, ts)), idx, tgt, c)

    inputs = tuple(init[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
    print("check: %s gradcheck passes (V=11 C=8 L=3, B=2 T=6, %d params)"
          % (family, sum(t.numel() for t in inputs)))


def read_f64(path):
    """hf_family_check.py's F64 safetensors (float64 results, not rounded to F32)."""
    import struct
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    out = {}
    for name, e in hdr.items():
        if name != "__metadata__":
            assert e["dtype"] == "F64", e
            a, b = e["data_offsets"]
            cnt = (b - a) // 8
            out[name] = torch.tensor(struct.unpack("<%dd" % cnt, raw[8 + n + a:8 + n + b]),
                                     dtype=DT).reshape(e["shape"])
    return out


def check_hf(family, fdir, tokens_path, noclip, grads, final):
    """transformers (float64, eager, float32 upcasts removed) on the written directory:
    first-step loss 1e-10 relative, every gradient 1e-9 (max abs diff / max abs), the
    10 losses 1e-10, the final weights 1e-7 relative to their max."""
    if not os.path.exists(TFENV_PYTHON):
        print("check: %s transformers cross-check skipped (no %s)" % (family, TFENV_PYTHON))
        return None
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_family_check.py")
    with tempfile.TemporaryDirectory(prefix="ferry_fam_hf_") as tmp:
        gpath, fpath = os.path.join(tmp, "g.safetensors"), os.path.join(tmp, "f.safetensors")
        r = subprocess.run([TFENV_PYTHON, tool, "train", fdir, "--tokens", tokens_path,
                            "--steps", str(STEPS), "--lr", repr(LR), "--grads-out", gpath,
                            "--final-out", fpath], capture_output=True, text=True)
        assert r.returncode == 0, "hf_family_check failed: %s" % r.stderr.strip()[-3000:]
        hf = json.loads(r.stdout.strip().splitlines()[-1])
        hg, hfin = read_f64(gpath), read_f64(fpath)
    rel0 = abs(hf["losses"][0] - noclip["losses"][0]) / abs(noclip["losses"][0])
    assert rel0 <= 1e-10, (family, hf["losses"][0], noclip["losses"][0])
    relL = max(abs(a - b) / abs(b) for a, b in zip(hf["losses"], noclip["losses"]))
    assert relL <= 1e-10, (family, hf["losses"], noclip["losses"])
    assert sorted(hg) == sorted(grads), (sorted(hg), sorted(grads))
    worst_g = 0.0
    for n, t in grads.items():
        d = (hg[n].to(DT) - t).abs().max().item() / t.abs().max().item()
        assert d <= 1e-9, (family, n, d)
        worst_g = max(worst_g, d)
    worst_w = max((hfin[n].to(DT) - t).abs().max().item() / t.abs().max().item()
                  for n, t in final.items())
    assert worst_w <= 1e-7, (family, worst_w)
    print("check: %s transformers agrees: loss rel %.1e, 10 losses max rel %.1e, grads max "
          "rel %.1e, final weights max rel %.1e" % (family, rel0, relL, worst_g, worst_w))
    return {"loss0_rel": rel0, "losses_max_rel": relL, "grads_max_rel": worst_g,
            "final_max_rel": worst_w}


def check_features_matter(family, init, tokens, c):
    """Each feature of the fixture moves the first-step loss by more than 1e-3 relative
    (ten times ferry's acceptance tolerance): a reader that ignored it would fail."""
    x, y = batch(tokens, 0, BATCH, SEQ)
    base = loss_fn(init, x, y, c).item()
    alts = {}
    if any(c["windows"]):
        alts["no sliding window"] = dict(c, windows=[0] * c["layers"])
    if c["attn_softcap"]:
        alts["no attention soft-cap"] = dict(c, attn_softcap=None)
    if c["final_softcap"]:
        alts["no final soft-cap"] = dict(c, final_softcap=None)
    if c["gemma"]:
        alts["scale head_dim^-0.5"] = dict(c, attn_scale=c["head_dim"] ** -0.5)
        alts["no embedding scale"] = dict(c, embed_scale=1.0)
    if len({r["theta"] for r in c["ropes"]}) > 1:
        alts["one RoPE for all layers"] = dict(c, ropes=[c["ropes"][-1]] * c["layers"])
    for i, r in enumerate(c["ropes"][:1] + c["ropes"][-1:]):
        rs = r["scaling"]
        if rs and rs.get("rope_type", rs.get("type")) == "longrope":
            short = dict(r, scaling=dict(rs, long_factor=rs["short_factor"]))
            alts["longrope short factors"] = dict(c, ropes=[short] * c["layers"])
            alts["longrope no attention_factor"] = dict(c, ropes=[dict(r, max_pos=r["orig_max"])] * c["layers"])
            alts["rotary dim = head_dim"] = dict(c, ropes=[dict(r, dim=c["head_dim"], scaling=None)] * c["layers"])
        elif rs:
            alts["no %s scaling" % rs.get("rope_type")] = dict(
                c, ropes=[dict(q, scaling=None) for q in c["ropes"]])
    P = init
    if c["qkv_bias"]:
        P = {n: (torch.zeros_like(t) if n.endswith(".bias") else t) for n, t in init.items()}
        alts["no q/k/v biases"] = (c, P)
    if c["qk_norm"]:
        alts["no q/k norm"] = dict(c, qk_norm=False)
    worst = None
    for what, alt in alts.items():
        ac, AP = alt if isinstance(alt, tuple) else (alt, init)
        rel = abs(loss_fn(AP, x, y, ac).item() - base) / base
        assert rel > 1e-3, (family, what, rel)
        worst = rel if worst is None else min(worst, rel)
        print("check: %s, %s instead: loss moves %.1e relative" % (family, what, rel))


# ---------------------------------------------------------------- main

def generate(family, tokens, tokens_path, out, checks):
    fdir = os.path.join(out, "fam_" + family)
    os.makedirs(fdir, exist_ok=True)
    write_hf_config(family, os.path.join(fdir, "config.json"))
    with open(os.path.join(fdir, "config.json")) as f:
        hfcfg = json.load(f)
    c = model_cfg(hfcfg)
    std = INIT_STD_FAMILY.get(family, INIT_STD)
    init = make_init(c, INIT_SEEDS[family], std)
    tensors = lambda P: [(n, P[n]) for n, _, _ in param_shapes(c)]  # noqa: E731
    write_safetensors(os.path.join(fdir, "model.safetensors"), tensors(init))

    stats = []
    with torch.no_grad():
        x0, _ = batch(tokens, 0, BATCH, SEQ)
        logits0 = forward(init, x0, c, stats)[0, 0:4, :]
    if c["attn_softcap"] or c["final_softcap"]:
        # the caps bind: the largest pre-cap value is past the cap (tanh far from linear)
        assert min(stats) > 1.0, stats
        print("%s soft-caps: max |pre-cap| / cap per layer and final: %s"
              % (family, " ".join("%.2f" % s for s in stats)))

    noclip, final_noclip, grads = train(init, tokens, c, 0.0, want_grads=True)
    agree = None
    if checks:
        check_features_matter(family, init, tokens, c)
        agree = check_hf(family, fdir, tokens_path, noclip, grads, final_noclip)
    half = 0.5 * min(noclip["grad_norms"])
    e = math.floor(math.log10(half))
    clip = float("%.1g" % (math.floor(half / 10 ** e) * 10 ** e))
    clipped, _, _ = train(init, tokens, c, clip)

    write_safetensors(os.path.join(out, "fam_%s_grads.safetensors" % family), tensors(grads))
    write_safetensors(os.path.join(out, "fam_%s_final_noclip.safetensors" % family),
                      tensors(final_noclip))

    def run(r, cl):
        d = {"clip": cl, "schedule": "const", "warmup": 0, "min_lr": LR}
        d.update(r)
        return d

    cfg_out = dict(c, ropes=None)
    cfg_out["ropes"] = c["ropes"]
    ref = {
        "family": family,
        "config": cfg_out,
        "hf_config": "fam_%s/config.json" % family,
        "batch": BATCH, "seq": SEQ, "steps": STEPS,
        "adamw": {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD},
        "runs": {"noclip": run(noclip, 0), "clip": run(clipped, clip)},
        "first_batch_logits_sample": logits0.tolist(),
    }
    with open(os.path.join(out, "fam_%s_ref.json" % family), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")

    names = [n for n, _, _ in param_shapes(c)]
    for path, want in ((os.path.join(fdir, "model.safetensors"), init),
                       (os.path.join(out, "fam_%s_grads.safetensors" % family), grads),
                       (os.path.join(out, "fam_%s_final_noclip.safetensors" % family), final_noclip)):
        hdr, st = read_safetensors(path)
        assert list(st) == names and hdr["__metadata__"] == {"format": "pt"}
        for n, t in want.items():
            assert torch.equal(st[n].to(DT), t.to(torch.float32).to(DT)), n
        assert os.path.getsize(path) < 300 * 1024, (path, os.path.getsize(path))
    for rn, r in ref["runs"].items():
        print("%s %-7s clip=%-6g losses=%s" % (family, rn, r["clip"],
                                               " ".join("%.6f" % v for v in r["losses"])))
    return agree


def eval_dir(path, tokens, steps):
    """--check-dir: this reference on any Hugging Face directory of a family (sharded or
    not, F32): per-step losses of `steps` unclipped AdamW steps (step 0 = batch 1's loss),
    to compare with hf_family_check.py's loss and train on the same directory."""
    import glob
    with open(os.path.join(path, "config.json")) as f:
        c = model_cfg(json.load(f))
    init = {}
    for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        init.update({n: t.to(DT) for n, t in read_safetensors(fn)[1].items()})
    names = [n for n, _, _ in param_shapes(c)]
    assert sorted(init) == sorted(names), (sorted(set(init) ^ set(names)))
    run, _, _ = train(init, tokens, c, 0.0, steps=steps)
    print(json.dumps({"losses": run["losses"], "grad_norms": run["grad_norms"]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.normpath(os.path.join(here, "..", "fixtures"))
    ap.add_argument("--out", default=fixtures)
    ap.add_argument("--tokens", default=os.path.join(fixtures, TOKENS_FILE))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--only", nargs="*", choices=sorted(FAMILIES))
    ap.add_argument("--check-dir", help="print this reference's losses on a HF directory")
    ap.add_argument("--steps", type=int, default=3, help="with --check-dir")
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    if args.check_dir:
        eval_dir(args.check_dir, torch.tensor(read_shard(args.tokens), dtype=torch.long), args.steps)
        return 0
    fams = args.only or list(FAMILIES)
    if not args.skip_checks:
        check_pieces()
        for fam in fams:
            check_gradcheck(fam)
    tok = read_shard(args.tokens)
    assert len(tok) >= STEPS * BATCH * SEQ + 1 and max(tok) < 256
    tokens = torch.tensor(tok, dtype=torch.long)
    for fam in fams:
        generate(fam, tokens, args.tokens, out, not args.skip_checks)
    print("wrote", out)


if __name__ == "__main__":
    sys.exit(main())
