#!/usr/bin/env python3
"""A Google Benchmark JSON (bench_ops --benchmark_out=FILE) as a Markdown table for results.md.

One row per benchmark: its name (without the /real_time suffix), milliseconds per iteration (real
time), TFLOP/s (the TFLOP/s counter, or FLOP/s / 1e12), the label, and the target of issue 28 where
one applies: each of GPT-2's GEMMs on CUDA (BM_Gemm/cuda/...) >= 550 TFLOP/s. A benchmark that
skipped or failed shows its message. Standard library only (the GPU machine has no packages).
Usage: bench_table.py FILE.json [--title TEXT] [--filter SUBSTRING]. Exit 0 when printed, 2 when
the file cannot be read.
"""
import argparse
import json
import sys

GEMM_TARGET_TFLOPS = 550.0  # issue 28 item 5, each GEMM of GPT-2 at N = 16,384 on an H200
TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def tflops(b):
    if "TFLOP/s" in b:
        return b["TFLOP/s"]
    if "FLOP/s" in b:
        return b["FLOP/s"] / 1e12
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--title", default="")
    ap.add_argument("--filter", default="", help="only benchmarks whose name contains this")
    args = ap.parse_args()
    try:
        with open(args.json) as f:
            runs = json.load(f).get("benchmarks", [])
    except (OSError, ValueError) as e:
        print(f"bench_table.py: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    if args.title:
        print(f"{args.title}\n")
    print("| benchmark | ms | TFLOP/s | label | target (issue 28) |")
    print("|---|---|---|---|---|")
    for b in runs:
        name = b.get("name", "?")
        if args.filter not in name or b.get("run_type", "iteration") != "iteration":
            continue
        name = name.removesuffix("/real_time")
        if b.get("error_occurred"):
            print(f"| {name} | - | - | {b.get('error_message', 'failed')} | |")
            continue
        ms = b.get("real_time", 0.0) * TO_MS.get(b.get("time_unit", "ns"), 1e-6)
        tf = tflops(b)
        target = ""
        if name.startswith("BM_Gemm/cuda/") and tf is not None:
            target = f">= {GEMM_TARGET_TFLOPS:g}: {'ok' if tf >= GEMM_TARGET_TFLOPS else 'MISSED'}"
        tf_text = "-" if tf is None else f"{tf:.1f}" if tf >= 10 else f"{tf:.3g}"
        print(f"| {name} | {ms:.3f} | {tf_text} | {b.get('label', '')} | {target} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
