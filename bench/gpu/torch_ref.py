#!/usr/bin/env python3
"""torch_ref.py — the PyTorch reference for bench/gpu/check.sh's benchmark: the same GPT-2
(learned positions, pre-LayerNorm, tanh GELU, tied embeddings; 124M by default) trained
on the same batch x sequence with AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on 2-D
tensors, gradient norm clipped to 1), timed per step the way ferry's benchmark is: the
median step over the steps after the warm-up.

bf16 is mixed precision as PyTorch users run it: fp32 weights and optimizer state, matrix
products and attention in bf16 under autocast (flash attention through
scaled_dot_product_attention), the loss in fp32. That is ferry's bf16 storage in spirit
(bf16 activations, fp32 masters and moments), not bit for bit: ferry also stores the
weights and gradients it computes with in bf16. fp32 runs everything in fp32 (TF32 off).
Eager mode, fused AdamW where the device has it; no torch.compile (its minutes of
compilation do not fit the check's budget).

The tokens are random (the step time does not depend on them). Prints one JSON object:
{"device", "dtype", "batch", "seq", "params", "median_step_ms", "tokens_per_s", "losses"}.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)   # (3C, C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.fc_proj = nn.Linear(4 * C, C)

    def forward(self, x):  # x (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, V, maxT, C, L, NH):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(maxT, C)
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):  # idx, targets (B, T)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head, (B, T, V)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(a.device)
    model = GPT2(a.vocab, max(a.seq, 1024), a.channels, a.layers, a.heads).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(dev)
    y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, losses = [], []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times[min(a.warmup, len(times) - 1):])
    print(json.dumps({"device": a.device, "dtype": a.dtype, "batch": a.batch, "seq": a.seq,
                      "params": sum(p.numel() for p in model.parameters()),
                      "median_step_ms": round(ms, 3),
                      "tokens_per_s": round(a.batch * a.seq / ms * 1e3),
                      "losses": [round(v, 5) if math.isfinite(v) else None for v in losses]}))


if __name__ == "__main__":
    main()
