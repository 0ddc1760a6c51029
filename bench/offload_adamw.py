#!/usr/bin/env python3
"""Side-by-side: one AdamW step over the same parameter count (default 31M fp32 parameters, one
rank's quarter of gpt2-124m, in GPT-2-block-shaped tensors) by ZeroTrain's host AdamW (the update
of --offload optimizer: bench_offload_adamw) and by PyTorch's torch.optim.AdamW on the CPU, with
foreach=False and with the default, at the same thread count. Prints ms/step, parameters/s and
the speed-up of ZeroTrain over each (target: >= 5x).

Needs Debian's python3-torch (scripts/setup --peer) and a built bench_offload_adamw:
    python3 bench/offload_adamw.py [--bench build/cpu/bench/bench_offload_adamw] [--threads 2]
"""
import os

# As bench/peer_gpt_cpu.py: OpenMP's active spin-waiting starves a threaded OpenBLAS on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import subprocess
import time

# The tensors of one GPT-2 small block (bench_offload_adamw.cc uses the same list).
SIZES = [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072, 3072 * 768, 768]


def tensor_sizes(n):
    out, at, t = [], 0, 0
    while at < n:
        s = min(SIZES[t % len(SIZES)], n - at)
        out.append(s)
        at += s
        t += 1
    return out


def torch_ms_per_step(n, threads, foreach, steps, warmup):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.rand(s) - 0.5) for s in tensor_sizes(n)]
    for p in params:
        p.grad = torch.rand_like(p) - 0.5
    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if foreach is not None:
        kwargs["foreach"] = foreach
    opt = torch.optim.AdamW(params, **kwargs)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def zerotrain_ms_per_step(bench, n, threads):
    env = dict(os.environ, ZT_NUM_THREADS=str(threads))
    out = subprocess.run(
        [bench, f"--benchmark_filter=BM_adamw_host/{n}/", "--benchmark_format=json",
         "--benchmark_repetitions=5", "--benchmark_report_aggregates_only=true"],
        env=env, check=True, capture_output=True, text=True).stdout
    runs = json.loads(out)["benchmarks"]
    med = [b for b in runs if b.get("aggregate_name") == "median"]
    b = (med or runs)[0]
    scale = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}[b.get("time_unit", "ms")]
    return b["real_time"] * scale


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/cpu/bench/bench_offload_adamw")
    ap.add_argument("--params", type=int, default=31_000_000, help="1048576 or 31000000 (the binary's sizes)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    n, th = args.params, args.threads
    import torch

    zt = zerotrain_ms_per_step(args.bench, n, th)
    rows = [("ZeroTrain host AdamW (adamw_host)", zt)]
    rows.append(("torch.optim.AdamW foreach=False", torch_ms_per_step(n, th, False, args.steps, 1)))
    rows.append(("torch.optim.AdamW default", torch_ms_per_step(n, th, None, args.steps, 1)))
    print(f"AdamW step over {n / 1e6:.1f}M fp32 parameters, {th} thread(s), PyTorch {torch.__version__}")
    for name, ms in rows:
        print(f"  {name:<36} {ms:9.1f} ms/step  {n / ms / 1e6:7.2f} G params/s  "
              f"speed-up of ZeroTrain {ms / zt:5.2f}x")


if __name__ == "__main__":
    main()
