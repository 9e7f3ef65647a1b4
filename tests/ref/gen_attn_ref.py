#!/usr/bin/python3
"""Independent float64 PyTorch reference for ferry's masked attention.

Writes tests/fixtures/attn_<case>.bin: for each case of CASES (grouped-query attention
of up to T = 4096 positions, causal, with a sliding window, over packed documents, or
both; fp32 or bf16 inputs; with Gemma 2's logit soft cap or without), the expected outputs of ferry's fy_k_attention_fwd/bwd:
out, lse (the log-sum-exp of each query row's scaled scores) and the gradients dq, dk,
dv of sum(out * dout), at a fixed subset of rows. tests/test_attention.c compares the
cpu backend with them.

The inputs are not stored: qkv and dout come from splitmix64 (counter form, the C
tests' generator) turned into values that are exact in the storage type, so the C test
regenerates the same bits:
    fp32: u = z >> 40 (24 bits), x = a * (2u + 1 - 2^24) / 2^24
    bf16: u = z >> 56 (8 bits),  x = a * (2u + 1 - 2^8) / 2^8
(odd integers of at most 24 or 8 bits times a power of two: no rounding anywhere).
qkv's values have a = 2 and seed `seed`, dout's a = 1 and seed `seed + 1`, in row-major
order of qkv (B, T, (NH + 2 NKV) hd) and dout (B, T, NH hd).

The attention is written out: scores = (q k^T) * scale in float64, with a soft cap c
(Hugging Face's Gemma 2 eager attention) c * tanh(scores / c), then masked with -inf
where key j is hidden from query t (j > t, j < the start of t's document, or with a
window w > 0, t - j >= w), torch.softmax in float64, out = P v, lse = logsumexp of the
masked scores; the gradients come from autograd of sum(out * dout). No fused kernels.
scale is 1/sqrt(hd) rounded to fp32 times the case's scale_mul (a power of two: exact),
the value the C test passes; a larger one makes scores of ~100, where a cap of 50 bends
them strongly.

Rows stored (identical rule in the C test): for each sequence b, positions t with
t % 61 == 0, or t >= T - 64 (the last query tile of the cpu kernel), or t the first or
the last position of a document. The file (little-endian):
    int32 header[16]: magic 0x54415946 ("FYAT"), version 1, B, T, NH, NKV, hd, window,
        dtype (0 fp32, 1 bf16), seed, nrows, scale's fp32 bits, FNV-1a 64 of the docs
        array (B*T int32 little-endian; 0 without documents) low and high words, the soft
        cap's fp32 bits (0: none), 0
    int32 rows[nrows]: b * T + t
    float32 out[nrows][NH*hd], lse[nrows][NH], dq[nrows][NH*hd], dk[nrows][NKV*hd],
        dv[nrows][NKV*hd]   (the float64 results rounded to float32)

Before writing, the script checks itself on small shapes: the masked softmax attention
against a scalar loop in float64, and autograd's gradients with torch.autograd.gradcheck,
with and without a soft cap.

Usage: /usr/bin/python3 tests/ref/gen_attn_ref.py [--out DIR] [--skip-checks] [--cases A,B]
"""

import argparse
import math
import os
import struct
import sys

import numpy as np
import torch

DT = torch.float64

# name: B, T, NH, NKV, hd, window, documents (per sequence, their lengths; None: one
# document a sequence), dtype, seed; optional scale_mul (1) and softcap (0: none).
# Mirrored by attn_cases in tests/test_attention.c.
CASES = {
    "causal_4096": dict(B=1, T=4096, NH=4, NKV=2, hd=32, window=0, docs=None,
                        dtype="fp32", seed=4096),
    "window": dict(B=2, T=1000, NH=8, NKV=2, hd=32, window=300, docs=None,
                   dtype="fp32", seed=300),
    "docs": dict(B=2, T=1024, NH=4, NKV=2, hd=64, window=0,
                 docs=[[1, 200, 64, 128, 77, 300, 254], [500, 1, 1, 130, 392]],
                 dtype="fp32", seed=1024),
    "window_docs_4096": dict(B=2, T=4096, NH=4, NKV=2, hd=32, window=512,
                             docs=[[700, 1, 1500, 63, 129, 1703], [128, 3000, 968]],
                             dtype="fp32", seed=512),
    "window_docs_4096_bf16": dict(B=2, T=4096, NH=4, NKV=2, hd=32, window=512,
                                  docs=[[700, 1, 1500, 63, 129, 1703], [128, 3000, 968]],
                                  dtype="bf16", seed=513),
    "causal_mqa_bf16": dict(B=2, T=777, NH=4, NKV=1, hd=32, window=0, docs=None,
                            dtype="bf16", seed=777),
    "softcap": dict(B=2, T=1000, NH=8, NKV=2, hd=32, window=300, docs=None,
                    dtype="fp32", seed=50, scale_mul=16.0, softcap=50.0),
}

MAGIC = 0x54415946
ROW_STRIDE, LAST_TILE = 61, 64

# ---------------------------------------------------------------- inputs


def splitmix64(seed, n):
    """The first n outputs of splitmix64 from state seed (uint64 array)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9e3779b97f4a7c15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
        return z ^ (z >> np.uint64(31))


def uniform_exact(seed, n, a, dtype):
    """n values in (-a, a), exact in the storage type (the module's rule), as float64."""
    bits = 24 if dtype == "fp32" else 8
    u = (splitmix64(seed, n) >> np.uint64(64 - bits)).astype(np.int64)
    x = (2 * u + 1 - (1 << bits)).astype(np.float64) * (a / (1 << bits))
    return torch.from_numpy(x)


def doc_starts(c):
    """docs (B, T) int64: each position's document start (zeros without documents)."""
    B, T = c["B"], c["T"]
    d = torch.zeros(B, T, dtype=torch.int64)
    if c["docs"] is None:
        return d
    for b, lens in enumerate(c["docs"]):
        assert sum(lens) == T and min(lens) >= 1
        s = 0
        for n in lens:
            d[b, s:s + n] = s
            s += n
    return d


def docs_hash(c):
    if c["docs"] is None:
        return 0
    h = 0xcbf29ce484222325
    for x in doc_starts(c).flatten().tolist():
        for byte in struct.pack("<i", x):
            h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def scale_of(c):
    return f32(1.0 / math.sqrt(c["hd"])) * c.get("scale_mul", 1.0)


def rows_of(c):
    """The stored rows b * T + t, in order (the module's rule)."""
    T, d = c["T"], doc_starts(c)
    rows = []
    for b in range(c["B"]):
        for t in range(T):
            first = c["docs"] is not None and d[b, t] == t
            last = c["docs"] is not None and (t == T - 1 or d[b, t + 1] == t + 1)
            if t % ROW_STRIDE == 0 or t >= T - LAST_TILE or first or last:
                rows.append(b * T + t)
    return rows

# ---------------------------------------------------------------- the attention


def visible(T, window, starts):
    """(T, T) bool: query t sees key j (starts: (T,) document starts of one sequence)."""
    t = torch.arange(T).unsqueeze(1)
    j = torch.arange(T).unsqueeze(0)
    m = (j <= t) & (j >= starts.unsqueeze(1))
    if window > 0:
        m &= t - j < window
    return m


def attend(q, k, v, scale, mask, softcap=0.0):
    """q (G, T, hd), k, v (T, hd), mask (T, T): out (G, T, hd), lse (G, T)."""
    s = torch.matmul(q, k.transpose(0, 1)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v), torch.logsumexp(s, dim=-1)


def reference(c):
    """out, lse, dq, dk, dv of the whole case, float64, in the kernel's layouts:
    out, dq (B, T, NH, hd), lse (B, NH, T), dk, dv (B, T, NKV, hd)."""
    B, T, NH, NKV, hd, w = c["B"], c["T"], c["NH"], c["NKV"], c["hd"], c["window"]
    G, W = NH // NKV, (NH + 2 * NKV) * hd
    qkv = uniform_exact(c["seed"], B * T * W, 2.0, c["dtype"]).view(B, T, W)
    dout = uniform_exact(c["seed"] + 1, B * T * NH * hd, 1.0, c["dtype"]).view(B, T, NH, hd)
    scale, starts, cap = scale_of(c), doc_starts(c), f32(c.get("softcap", 0.0))
    out = torch.empty(B, T, NH, hd, dtype=DT)
    lse = torch.empty(B, NH, T, dtype=DT)
    dq = torch.empty_like(out)
    dk, dv = torch.empty(B, T, NKV, hd, dtype=DT), torch.empty(B, T, NKV, hd, dtype=DT)
    for b in range(B):
        mask = visible(T, w, starts[b])
        for kh in range(NKV):
            heads = range(kh * G, kh * G + G)
            q = torch.stack([qkv[b, :, h * hd:(h + 1) * hd] for h in heads]).requires_grad_()
            k = qkv[b, :, (NH + kh) * hd:(NH + kh + 1) * hd].clone().requires_grad_()
            v = qkv[b, :, (NH + NKV + kh) * hd:(NH + NKV + kh + 1) * hd].clone().requires_grad_()
            for g, h in enumerate(heads):  # one query head at a time: T x T scores each
                o, l = attend(q[g:g + 1], k, v, scale, mask, cap)
                (o[0] * dout[b, :, h, :]).sum().backward()
                out[b, :, h, :] = o[0].detach()
                lse[b, h, :] = l[0].detach()
            for g, h in enumerate(heads):
                dq[b, :, h, :] = q.grad[g]
            dk[b, :, kh, :] = k.grad
            dv[b, :, kh, :] = v.grad
    return out, lse, dq, dk, dv


def write_case(path, name, c):
    out, lse, dq, dk, dv = reference(c)
    rows = rows_of(c)
    B, T, NH, NKV, hd = c["B"], c["T"], c["NH"], c["NKV"], c["hd"]
    bi = torch.tensor([r // T for r in rows])
    ti = torch.tensor([r % T for r in rows])
    h = docs_hash(c)
    header = [MAGIC, 1, B, T, NH, NKV, hd, c["window"], 0 if c["dtype"] == "fp32" else 1,
              c["seed"], len(rows), struct.unpack("<I", struct.pack("<f", scale_of(c)))[0],
              h & 0xFFFFFFFF, h >> 32,
              struct.unpack("<I", struct.pack("<f", c.get("softcap", 0.0)))[0], 0]
    parts = [out[bi, ti].reshape(len(rows), NH * hd), lse[bi, :, ti].reshape(len(rows), NH),
             dq[bi, ti].reshape(len(rows), NH * hd), dk[bi, ti].reshape(len(rows), NKV * hd),
             dv[bi, ti].reshape(len(rows), NKV * hd)]
    with open(path, "wb") as f:
        f.write(struct.pack("<16I", *header))
        f.write(struct.pack("<%di" % len(rows), *rows))
        for p in parts:
            f.write(p.to(torch.float32).numpy().astype("<f4").tobytes())
    norms = " ".join("%s %.3g" % (n, p.norm().item()) for n, p in
                     zip(("out", "lse", "dq", "dk", "dv"), parts))
    print("%-24s %d rows, %7d bytes; norms of the rows: %s"
          % (name, len(rows), os.path.getsize(path), norms))

# ---------------------------------------------------------------- self-checks


def check_against_loop(cap):
    """attend and visible against scalar loops in float64 (softmax written out), with the
    soft cap cap (0: none)."""
    T, hd, w = 11, 4, 4
    starts = torch.tensor([0, 0, 0, 3, 3, 3, 3, 3, 8, 8, 10])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, hd, dtype=DT, generator=g) for _ in range(3))
    o, l = attend(q, k[0], v[0], 0.5, visible(T, w, starts), cap)
    for t in range(T):
        js = [j for j in range(T) if starts[t] <= j <= t and t - j < w]
        s = [0.5 * sum(q[0, t, d].item() * k[0, j, d].item() for d in range(hd)) for j in js]
        if cap > 0:
            s = [cap * math.tanh(x / cap) for x in s]
        mx = max(s)
        e = [math.exp(x - mx) for x in s]
        lse = mx + math.log(sum(e))
        assert abs(l[0, t].item() - lse) < 1e-13, (t, l[0, t].item(), lse)
        for d in range(hd):
            y = sum(e[i] / sum(e) * v[0, j, d].item() for i, j in enumerate(js))
            assert abs(o[0, t, d].item() - y) < 1e-13, (t, d)


def check_gradcheck(cap, scale):
    """autograd's gradients against finite differences; scale large enough with a cap
    that the scores reach the tanh's bend."""
    T, hd = 9, 3
    starts = torch.tensor([0, 0, 0, 0, 4, 4, 4, 7, 7])
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(2, T, hd, dtype=DT, generator=g).requires_grad_(),
          torch.randn(T, hd, dtype=DT, generator=g).requires_grad_(),
          torch.randn(T, hd, dtype=DT, generator=g).requires_grad_()]
    mask = visible(T, 3, starts)
    assert torch.autograd.gradcheck(lambda q, k, v: attend(q, k, v, scale, mask, cap), ts)


def check_inputs():
    """The generator's values are exact in their storage type, inside (-a, a)."""
    for dt in ("fp32", "bf16"):
        x = uniform_exact(7, 10000, 2.0, dt)
        y = x.to(torch.float32 if dt == "fp32" else torch.bfloat16).to(DT)
        assert torch.equal(x, y) and x.abs().max() < 2.0
    # splitmix64 from state 0: the reference sequence's first output
    assert int(splitmix64(0, 1)[0]) == 0xe220a8397b1dcdaf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "fixtures"))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--cases", help="comma-separated names of CASES to write [all]")
    args = ap.parse_args()
    names = args.cases.split(",") if args.cases else list(CASES)
    for name in names:
        if name not in CASES:
            ap.error("no case %r (CASES: %s)" % (name, ", ".join(CASES)))
    torch.set_num_threads(1)
    if not args.skip_checks:
        check_inputs()
        check_against_loop(0.0)
        check_against_loop(1.5)
        check_gradcheck(0.0, 0.7)
        check_gradcheck(2.0, 3.0)
        print("self-checks passed")
    for name in names:
        write_case(os.path.join(args.out, "attn_%s.bin" % name), name, CASES[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
