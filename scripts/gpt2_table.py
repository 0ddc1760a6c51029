#!/usr/bin/env python3
"""GPT-2 124M throughput of gpu-check's step 4 as Markdown, against issue 28's targets.

Reads LOGS/gpt2-PRECISION-MODE.jsonl (`zerotrain train --metrics`) for each PRECISION:MODE run and,
with --peer FILE, bench/peer_gpt2_torch.py's JSON lines from the same visit. Prints the runs'
table (tokens/s = median of the steps after the first two, MFU from the summary's flops_per_token
and peak_flops), the peer's table, and one row per target of issue 28 that these numbers decide:
bf16 >= 480,000 tokens/s and >= 1.0x torch.compile (its fastest run on cuda:0 without offload:
eager, graphs or auto), graphs >= eager and its losses bitwise equal to eager's (the same seed and
data: a replay must launch the same work), --tf32 >= 130,000 and >= 0.8x PyTorch tf32 (its fastest
run), each --offload mode within 20% of the fastest bf16 run without offload, and ZeRO-3 on two
logical devices of the GPU (mode zero3-x2, eager) within 2% of bf16 eager on cuda:0. A target
whose numbers are missing says so. Then each run's memory plan against its measured pool peak (the
summary's planned_peak_bytes_per_device and peak_bytes_per_device, device by device; issue 28 item
1: within 5%). Standard library only (the GPU machine has no packages).
Usage: gpt2_table.py LOGS PRECISION:MODE... [--peer FILE]. Exit status 0 whenever it printed.
"""
import argparse
import json
import os
import statistics

WARMUP = 2  # steps left out of the median (the summary's rule)
# The modes on cuda:0 without offload, with the default deterministic attention: the candidates for
# "best" (nondet, --deterministic-attention off, is listed beside them as the like-for-like figure
# against PyTorch, whose flash attention backward is not deterministic).
ONE_DEVICE = ("eager", "graphs", "auto")
MEMORY_TOLERANCE = 0.05  # the memory plan's pool peak against the measured one (tests/train/test_plan.cc)


def zerotrain_run(logs, precision, mode):
    """(tokens/s, steps, summary, losses) of one run, or (None, 0, {}, []) with why in summary['error']."""
    path = os.path.join(logs, f"gpt2-{precision}-{mode}.jsonl")
    try:
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        return None, 0, {"error": f"no metrics ({type(e).__name__})"}, []
    steps = [r for r in recs if "event" not in r and "tokens_per_s" in r]
    summary = next((r for r in recs if r.get("event") == "summary"), {})
    tps = [r["tokens_per_s"] for r in steps[WARMUP:]] or [r["tokens_per_s"] for r in steps]
    return (statistics.median(tps) if tps else None), len(steps), summary, [r.get("loss") for r in steps]


def peer_runs(path):
    """{(precision, mode): record} of the peer's JSON lines (the last line of a mode wins)."""
    runs = {}
    if path:
        try:
            with open(path) as f:
                for line in f:
                    if line.strip().startswith("{"):
                        r = json.loads(line)
                        runs[(r.get("precision"), r.get("mode"))] = r
        except (OSError, ValueError):
            pass
    return runs


def fmt_tps(x):
    return f"{x:,.0f}" if x else "-"


def bitwise_row(eager, graphs):
    """(measured, verdict) of graphs' losses against eager's: each (losses, summary) or None."""
    if not eager or not graphs or not eager[0] or not graphs[0]:
        return "not measured", "-"
    (le, _), (lg, sg) = eager, graphs
    same = sum(a == b and a is not None for a, b in zip(le, lg))
    used = sg.get("cuda_graphs")
    ok = same == len(le) == len(lg) and used is True
    return (f"{same} of {len(le)} steps' losses equal ({len(lg)} with graphs), graphs used: {used}",
            "ok" if ok else "MISSED")


def targets(zt, peer, losses=None):
    """Rows (target, measured, verdict) of issue 28's throughput targets; losses: {(p, mode): (losses, summary)}."""
    tps = zt.get
    losses = losses or {}

    def best_of(precision):  # the fastest run of a precision on cuda:0 without offload
        return max((v for (p, m), v in zt.items() if p == precision and m in ONE_DEVICE and v), default=None)

    def ptps(key):
        r = peer.get(key, {})
        return r.get("tokens_per_s") if r.get("status") == "ok" else None

    rows = []

    def check(name, value, goal, measured):
        if value is None:
            rows.append((name, "not measured", "-"))
        else:
            rows.append((name, measured, "ok" if value >= goal else "MISSED"))

    eager, graphs, best = tps(("bf16", "eager")), tps(("bf16", "graphs")), best_of("bf16")
    check("bf16 >= 480,000 tokens/s (its fastest run without offload)", best, 480000, fmt_tps(best))
    compiled = ptps(("bf16", "compile"))
    ratio = best / compiled if best and compiled else None
    check("bf16 >= 1.0x torch.compile on this GPU", ratio, 1.0,
          f"{ratio:.2f}x ({fmt_tps(best)} / {fmt_tps(compiled)})" if ratio else "")
    ratio = graphs / eager if graphs and eager else None
    check("--cuda-graphs on >= eager", ratio, 1.0, f"{ratio:.3f}x" if ratio else "")
    rows.append(("--cuda-graphs on bitwise equal to eager (bf16, per-step losses)",
                 *bitwise_row(losses.get(("bf16", "eager")), losses.get(("bf16", "graphs")))))
    tf32 = best_of("tf32")
    check("--tf32 >= 130,000 tokens/s", tf32, 130000, fmt_tps(tf32))
    ptf32 = ptps(("tf32", "eager"))
    ratio = tf32 / ptf32 if tf32 and ptf32 else None
    check("--tf32 >= 0.8x PyTorch tf32 eager on this GPU", ratio, 0.8,
          f"{ratio:.2f}x ({fmt_tps(tf32)} / {fmt_tps(ptf32)})" if ratio else "")
    for mode in ("offload", "offload-delay"):
        off = tps(("bf16", mode))
        ratio = off / best if off and best else None
        check(f"bf16 {mode} within 20% of bf16 without offload", ratio, 0.8,
              f"{ratio:.2f}x ({100 * (1 - ratio):.0f}% slower)" if ratio else "")
    z3 = tps(("bf16", "zero3-x2"))
    ratio = z3 / eager if z3 and eager else None
    check("bf16 ZeRO-3 on cuda:0x2 within 2% of cuda:0 (both eager)", ratio, 0.98,
          f"{ratio:.3f}x ({fmt_tps(z3)} / {fmt_tps(eager)})" if ratio else "")
    return rows


def memory_rows(summaries):
    """Rows (precision, mode, planned, measured, ratio, verdict) of the plan against the measured pool
    peak; summaries: {(p, mode): summary}. The worst device decides (ratio planned / measured)."""
    rows = []
    for (p, mode), summ in summaries.items():
        planned, measured = summ.get("planned_peak_bytes_per_device"), summ.get("peak_bytes_per_device")
        if not planned or not measured or len(planned) != len(measured) or not all(measured):
            rows.append((p, mode, "-", "-", "-", "not in the summary"))
            continue
        d = max(range(len(planned)), key=lambda i: abs(planned[i] / measured[i] - 1))
        worst = planned[d] / measured[d]
        rows.append((p, mode, f"{planned[d] / 2**30:.2f}", f"{measured[d] / 2**30:.2f}", f"{worst:.3f}",
                     "ok" if abs(worst - 1) <= MEMORY_TOLERANCE else "MISSED"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs")
    ap.add_argument("runs", nargs="+", help="PRECISION:MODE of each zerotrain run")
    ap.add_argument("--peer", help="bench/peer_gpt2_torch.py's JSON lines from the same GPU")
    args = ap.parse_args()

    zt, losses, summaries = {}, {}, {}
    print("## GPT-2 124M, T=1024, B=16, cuda:0\n")
    print("| precision | mode | steps | tokens/s (median after 2) | MFU | peak_kind | peak TFLOP/s | run MFU (summary) |")
    print("|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        p, _, mode = run.partition(":")
        tps, n, summ, run_losses = zerotrain_run(args.logs, p, mode)
        if "error" in summ:
            print(f"| {p} | {mode} | - | {summ['error']} | | | | |")
            continue
        zt[(p, mode)] = tps
        losses[(p, mode)] = (run_losses, summ)
        summaries[(p, mode)] = summ
        peak, fpt = summ.get("peak_flops"), summ.get("flops_per_token")
        mfu = f"{100 * fpt * tps / peak:.1f}%" if peak and fpt and tps else "n/a"
        run_mfu = f"{100 * summ['mfu']:.1f}%" if summ.get("mfu") is not None else "n/a"
        print(f"| {p} | {mode} | {n} | {fmt_tps(tps)} | {mfu} | {summ.get('peak_kind', '?')} | "
              f"{peak / 1e12 if peak else float('nan'):.0f} | {run_mfu} |")

    if summaries:
        print(f"\n## Memory plan against the measured pool peak (within {MEMORY_TOLERANCE:.0%}; the worst device)\n")
        print("| precision | mode | planned GiB | measured GiB | planned / measured | verdict |")
        print("|---|---|---|---|---|---|")
        for row in memory_rows(summaries):
            print("| " + " | ".join(row) + " |")

    peer = peer_runs(args.peer)
    if peer:
        any_rec = next(iter(peer.values()))
        print(f"\n## PyTorch {any_rec.get('torch', '?')} on the same GPU (bench/peer_gpt2_torch.py)\n")
        print("| precision | mode | tokens/s (median after 2) | step ms | first step s | peak GiB | status |")
        print("|---|---|---|---|---|---|---|")
        for (p, mode), r in peer.items():
            if r.get("status") == "ok":
                print(f"| {p} | {mode} | {fmt_tps(r['tokens_per_s'])} | {r['step_ms']:.1f} | {r['first_step_s']:.1f} | "
                      f"{r.get('peak_memory_gib', float('nan')):.1f} | ok |")
            else:
                print(f"| {p} | {mode} | - | - | - | - | {r.get('status', '?')}: {r.get('why', '')} |")
    elif args.peer:
        print(f"\n(no PyTorch numbers: {args.peer} is missing or empty)")

    print("\n## Issue 28's throughput targets, from this run\n")
    print("| target | measured | verdict |")
    print("|---|---|---|")
    for name, measured, verdict in targets(zt, peer, losses):
        print(f"| {name} | {measured} | {verdict} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
