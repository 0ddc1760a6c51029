#!/usr/bin/env python3
"""ZeRO on simulated devices: step time and tokens/s of gpt-tiny for 1, 2 and 4 devices at each
stage with the same global batch, as ratios to the 1-device run (all in one invocation, so the
ratios share the machine's state). Target: 4 devices at stage 2 within 1.2x the 1-device step
time on the same cores (sharding must not add much host overhead).

    python3 bench/zero_scaling.py [--zerotrain build/release/apps/zerotrain] [--steps 40]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile


def median_step_ms(binary, devices, stage, steps, batch, warmup):
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        cmd = [binary, "train", "--devices", f"cpu:{devices}", "--zero-stage", str(stage), "--batch-size",
               str(batch), "--steps", str(steps + warmup), "--eval-every", "0", "--eval-batches", "1",
               "--sample-tokens", "0", "--quiet", "--metrics", metrics]
        subprocess.run(cmd, check=True)
        with open(metrics) as f:
            rows = [json.loads(line) for line in f]
    ms = [r["step_ms"] for r in rows if "step_ms" in r][warmup:]
    summary = [r for r in rows if r.get("event") == "summary"][0]
    return statistics.median(ms), summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zerotrain", default="build/release/apps/zerotrain")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    base, _ = median_step_ms(args.zerotrain, 1, 0, args.steps, args.batch_size, args.warmup)
    tokens = args.batch_size * 64
    print(f"gpt-tiny, global batch {args.batch_size} x 64 tokens, median of {args.steps} steps; ratio = step time / 1-device step time")
    print("| devices | stage | ms/step | tokens/s | ratio | model states/device (MiB) | sent/step/device (MiB) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 1 | - | {base:.1f} | {tokens / base * 1e3:.0f} | 1.00 | | |")
    for n in (2, 4):
        for stage in range(4):
            ms, s = median_step_ms(args.zerotrain, n, stage, args.steps, args.batch_size, args.warmup)
            states = s["model_state_bytes_per_device"][0] / 2**20
            sent = s["comm_bytes_per_step_per_device"][0] / 2**20
            print(f"| {n} | {stage} | {ms:.1f} | {tokens / ms * 1e3:.0f} | {ms / base:.2f} | {states:.2f} | {sent:.2f} |")


if __name__ == "__main__":
    main()
