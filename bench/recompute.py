#!/usr/bin/env python3
"""--recompute overhead: step time of none, selective and full in one invocation (each mode its own
process, modes interleaved over rounds so that a noisy neighbour hits all of them), as ratios to
none, with the activation bytes the plan predicts. On a shared machine the wall-clock ratio moves
with the neighbours' load, so two steadier figures stand beside it: the processes' CPU seconds, and
the overhead from each run's own recompute time (the summary's recompute_s, timed on the stream):
recompute / (step time - recompute), i.e. against the same run's step without its re-run ops.
Targets (issue #16): selective <= 10%, full <= 40% of step time on gpt2-124m.

    python3 bench/recompute.py [--zerotrain build/cpu/apps/zerotrain] [--model gpt2-124m]
                               [--batch-size 1] [--seq-len 256] [--steps 3] [--rounds 1]
"""
import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import tempfile

MODES = ("none", "selective", "full")


def run(args, mode):
    """Median step ms (after one warm-up step), the summary record, and the child's CPU seconds."""
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        cmd = [args.zerotrain, "train", "--model", args.model, "--devices", args.devices, "--zero-stage", "0",
               "--batch-size", str(args.batch_size), "--train-seq-len", str(args.seq_len),
               "--steps", str(args.steps + 1), "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
               "--quiet", "--metrics", metrics, "--recompute", mode]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(metrics) as f:
            rows = [json.loads(line) for line in f]
    ms = [r["step_ms"] for r in rows if "step_ms" in r][1:]
    summary = [r for r in rows if r.get("event") == "summary"][0]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return statistics.median(ms), summary, cpu


def planned_activations(args, mode):
    out = subprocess.run([args.zerotrain, "plan", "--model", args.model, "--devices", args.devices, "--zero-stage", "0",
                          "--batch-size", str(args.batch_size), "--train-seq-len", str(args.seq_len),
                          "--sample-tokens", "0", "--recompute", mode],
                         check=True, capture_output=True, text=True).stdout
    # The first device row: name, params, grads, optimizer, activations, ...
    row = [l for l in out.splitlines() if re.match(r"^0\s", l)][0]
    cells = re.findall(r"[\d.]+ [KMGT]?i?B", row)
    return cells[3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zerotrain", default="build/cpu/apps/zerotrain")
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--devices", default="cpu:1")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    results = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for m in MODES:
            results[m].append(run(args, m))
    best = {m: min(results[m], key=lambda r: r[0]) for m in MODES}
    base_ms, _, base_cpu = best["none"]
    print(f"{args.model}, {args.devices}, batch {args.batch_size} x {args.seq_len} tokens, median of {args.steps} "
          f"steps after a warm-up, best of {args.rounds} round(s); ratio = step time / none's")
    print("| recompute | ms/step | wall ratio | process CPU s (ratio) | recompute ms/step | in-run overhead | activations (plan) |")
    print("|---|---|---|---|---|---|---|")
    for m in MODES:
        ms, s, cpu = best[m]
        ts = s["time_split"]
        steps = s["steps"]
        step_total = sum(ts[k] for k in ("compute_s", "comm_s", "optimizer_s", "other_s")) / steps
        rc = ts.get("recompute_s", 0) / steps
        print(f"| {m} | {ms:.0f} | {ms / base_ms:.2f} | {cpu:.0f} ({cpu / base_cpu:.2f}) | {1e3 * rc:.0f} | "
              f"{100 * rc / (step_total - rc):.1f}% | {planned_activations(args, m)} |")


if __name__ == "__main__":
    main()
