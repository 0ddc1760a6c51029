#!/usr/bin/env python3
"""Side-by-side: one GPT training step (4 layers, 4 heads, 128 wide, 64 tokens, batch 8, vocab 256,
fp32, AdamW) in ZeroTrain's CPU backend and in PyTorch on the CPU, with 1 and 2 threads.
Prints ms/step for each and the ratio ZeroTrain / PyTorch (target: <= 0.8).

Needs Debian's python3-torch (scripts/setup --peer) and a built zerotrain:
    python3 bench/peer_gpt_cpu.py [--zerotrain build/release/apps/zerotrain] [--steps 60]
Run it with the system Python 3 that python3-torch installs into (/usr/bin/python3).
"""
import os

# Debian's PyTorch uses OpenMP on top of a threaded OpenBLAS; with OpenMP's default active
# spin-waiting the two thread pools starve each other on a 2-core machine (measured: 2 threads
# 17x slower than 1). Passive waiting is PyTorch's best configuration here, so compare with it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time

L, H, C, T, B, V = 4, 4, 128, 64, 8, 256


def torch_ms_per_step(threads, steps, warmup):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C)
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C)
            self.c_fc = nn.Linear(C, 4 * C)
            self.mlp_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q = q.view(B, T, H, C // H).transpose(1, 2)
            k = k.view(B, T, H, C // H).transpose(1, 2)
            v = v.view(B, T, H, C // H).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(T))
            for blk in self.h:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    times = []
    for i in range(warmup + steps):
        idx = torch.randint(0, V, (B, T), generator=g)
        tgt = torch.randint(0, V, (B, T), generator=g)
        t0 = time.perf_counter()
        loss = model(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def zerotrain_ms_per_step(binary, threads, steps, warmup):
    env = dict(os.environ, ZT_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        cmd = [binary, "train", "--model", "gpt-tiny", "--devices", "cpu:1", "--batch-size", str(B),
               "--steps", str(warmup + steps), "--eval-every", "0", "--eval-batches", "1",
               "--sample-tokens", "0", "--quiet", "--metrics", metrics]
        subprocess.run(cmd, env=env, check=True)
        with open(metrics) as f:
            rows = [json.loads(line) for line in f]
    times = [r["step_ms"] for r in rows if "step_ms" in r][warmup:]
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zerotrain", default="build/release/apps/zerotrain")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("PyTorch is not installed: run scripts/setup --peer (Debian's python3-torch) and use /usr/bin/python3")
    print(f"GPT {L} layers, {H} heads, {C} wide, {T} tokens, batch {B}, vocab {V}, fp32, AdamW; median ms/step")
    print("| threads | ZeroTrain ms/step | PyTorch ms/step | ratio (ZeroTrain / PyTorch) |")
    print("|---|---|---|---|")
    for th in [int(t) for t in args.threads.split(",")]:
        zt = zerotrain_ms_per_step(args.zerotrain, th, args.steps, args.warmup)
        pt = torch_ms_per_step(th, args.steps, args.warmup)
        print(f"| {th} | {zt:.2f} | {pt:.2f} | {zt / pt:.2f} |")


if __name__ == "__main__":
    main()
