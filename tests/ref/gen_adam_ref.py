#!/usr/bin/python3
"""Reference vectors for optim_cpu's AdamW from PyTorch's torch.optim.AdamW.

Run with Debian's Python and torch (1.13):  /usr/bin/python3 tests/ref/gen_adam_ref.py
It writes tests/fixtures/adam_torch_<name>.bin, read by tests/test_optim.c.

Layout (little-endian):
    char[8]  magic "FYADAMT1"
    int32    n, steps
    float32  lr, beta1, beta2, eps, weight_decay, grad_scale
    float32  param0[n]
    per step s = 1..steps:
        float32 grad[n]          raw gradient; PyTorch sees grad * grad_scale (in fp32)
        float32 param[n], m[n], v[n]   after step s (exp_avg, exp_avg_sq)

Gradients are exactly representable in bf16 and fp16 (magnitudes 1e-2..10 with 8
significant bits), so the same vectors test every gradient dtype. Hyperparameters are
float32 values, so PyTorch (which takes Python floats) and ferry (which takes floats)
start from the same numbers. Initial weights have |w| >= 0.5 so that relative errors
in w stay meaningful after 10 steps.
"""
import os
import struct

import torch

N = 133          # 128 + 5: leaves a tail for 8-, 16-, 32- and 64-element loops
STEPS = 10

CONFIGS = [
    # name,         lr,   beta1, beta2, eps,  weight_decay, grad_scale
    ("wd",          1e-3, 0.9,   0.999, 1e-8, 0.01,         1.0),
    ("nowd_scaled", 1e-3, 0.9,   0.999, 1e-8, 0.0,          1.0 / 1024),  # loss scale
    ("wd_clip",     1e-2, 0.8,   0.99,  1e-3, 0.1,          0.37),        # clip coefficient
]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def grads(gen, n):
    mag = torch.pow(10.0, torch.empty(n).uniform_(-2.0, 1.0, generator=gen))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    g = (mag * sign).to(torch.float32).to(torch.bfloat16).to(torch.float32)
    assert torch.equal(g.to(torch.float16).to(torch.float32), g), "grad not fp16-exact"
    return g


def main():
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")
    for idx, (name, lr, b1, b2, eps, wd, scale) in enumerate(CONFIGS):
        lr, b1, b2, eps, wd, scale = (f32(x) for x in (lr, b1, b2, eps, wd, scale))
        gen = torch.Generator().manual_seed(1234 + idx)
        mag = torch.empty(N).uniform_(0.5, 1.5, generator=gen)
        sign = torch.where(torch.rand(N, generator=gen) < 0.5, -1.0, 1.0)
        p0 = (mag * sign).to(torch.float32)
        p = p0.clone().requires_grad_(True)
        opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                foreach=False)
        blob = bytearray(b"FYADAMT1")
        blob += struct.pack("<ii", N, STEPS)
        blob += struct.pack("<6f", lr, b1, b2, eps, wd, scale)
        blob += p0.numpy().astype("<f4").tobytes()
        for _ in range(STEPS):
            g = grads(gen, N)
            p.grad = g * torch.tensor(scale, dtype=torch.float32)
            opt.step()
            st = opt.state[p]
            blob += g.numpy().astype("<f4").tobytes()
            for t in (p.detach(), st["exp_avg"], st["exp_avg_sq"]):
                blob += t.numpy().astype("<f4").tobytes()
        path = os.path.join(out_dir, "adam_torch_%s.bin" % name)
        with open(path, "wb") as f:
            f.write(bytes(blob))
        print("wrote %s (%d bytes, torch %s)" % (os.path.normpath(path), len(blob),
                                                 torch.__version__))


if __name__ == "__main__":
    main()
