#!/usr/bin/env python3
"""Per-op device time per training step from a `zerotrain train --trace` JSON (src/train/trace.h).

Prints a Markdown table: for each op name on one device's stream tracks, milliseconds and calls per
step averaged over the chosen steps, its share of the op time, and the budget of issue 28 where the
op has one (lm_head_forward <= 2.5 ms, lm_head_backward <= 5 ms, encoder_backward <= 0.5 ms,
layernorm_backward over all its calls <= 1.0 ms), and the device's idle time per step (no op on any
of its streams: kernel-boundary latency, and waits for the host where the host fell behind). With
--estimate bf16 a column holds bench/README.md's read-through estimate of each op (no GPU) and a last
line the step against it, so one visit confirms or refutes it op by op. The estimate is an H200's:
a trace from another GPU (the trace names each device) gets one line saying so, with the ratio of
memory bandwidths where HBM_TBPS knows the GPU. Standard library only (the GPU machine has no
packages). Usage: op_table.py TRACE.json [--device 0] [--steps FIRST:LAST]
[--top N] [--marker OP] [--estimate bf16]
Steps are the device's (each ends with the optimizer's launch), not the host's ranges: the host runs
a step ahead. Exit status: 0 when the table was printed (budgets missed or not), 2 for an unreadable
trace or bad arguments, 3 when the trace has no steps or no stream slices to attribute (e.g. a
--cuda-graphs run, whose replays record no per-op slices).
"""
import argparse
import json
import sys

# Issue 28's budgets, device milliseconds per step (all calls of the op in a step together).
BUDGETS_MS = {
    "lm_head_forward": 2.5,
    "lm_head_backward": 5.0,
    "encoder_backward": 0.5,
    "layernorm_backward": 1.0,
}

# bench/README.md's read-through estimates (no GPU) of the GPT-2 124M step at B 16, T 1024 on one
# H200, eager: op -> (ms/step, low, high). Unchanged ops keep 2026-12-04's figure within 10%.
ESTIMATES = {
    "bf16": {
        "title": "read-through estimate 2026-12-05 (no GPU)",
        "gpu": "H200",
        "step": (31.0, 29.0, 35.0),
        "ops": {
            "matmul_backward": (7.8, 7.0, 8.6),
            "lm_head_backward": (3.9, 3.4, 5.0),
            "fused_attention_backward": (3.7, 3.35, 4.1),
            "matmul_forward": (2.7, 2.45, 3.0),
            "matmul_backward_dgelu": (2.2, 1.9, 2.8),
            "lm_head_forward": (2.0, 1.8, 2.6),
            "matmul_gelu_forward": (1.84, 1.65, 2.05),
            "adamw_multi": (1.1, 0.9, 1.27),
            "classifier_forward_backward": (1.1, 0.8, 1.5),
            "fused_attention_forward": (1.04, 0.93, 1.15),
            "layernorm_backward": (0.9, 0.7, 1.2),
            "residual_layernorm_forward": (0.6, 0.4, 0.82),
            "layernorm_forward": (0.4, 0.25, 0.6),
            "fill": (0.25, 0.22, 0.28),
            "add": (0.25, 0.22, 0.28),
            "cast": (0.22, 0.2, 0.25),
            "encoder_backward": (0.15, 0.08, 0.5),
            "unscale_check": (0.09, 0.08, 0.1),
            "encoder_forward": (0.06, 0.05, 0.07),
            "sum": (0.01, 0.0, 0.05),
            "copy": (0.03, 0.0, 0.05),
            "clip_factor": (0.006, 0.0, 0.01),
        },
    },
}


# HBM bandwidth in TB/s (datasheets), to say how far an estimate made for one GPU carries to another:
# the memory-bound ops (layernorm, AdamW, casts, fills, the classifier, the embedding) scale with it;
# the GEMMs and attention with the tensor-core peak, which the H100 SXM and the H200 share (the PCIe
# and NVL parts' are lower). More specific names first, as in src/train/report.cc's peak table.
HBM_TBPS = (("H200 NVL", 4.8), ("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35))


def hbm_tbps(name):
    """The memory bandwidth of the first HBM_TBPS key that occurs in name, or None."""
    return next((tbps for key, tbps in HBM_TBPS if key in name), None)


def device_name(events, pid):
    """The trace's name of device pid (its process_name metadata), or None."""
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name" and e.get("pid") == pid:
            return str(e.get("args", {}).get("name", "")) or None
    return None


def other_gpu_note(estimate_gpu, name):
    """One line when the trace ran on another GPU than the estimate's, else None."""
    if not name or estimate_gpu in name:
        return None
    mine, theirs = hbm_tbps(estimate_gpu), hbm_tbps(name)
    scale = (f" ({theirs:g} against {mine:g} TB/s of memory bandwidth: memory-bound ops up to "
             f"{mine / theirs:.2f}x the estimate)"
             if mine and theirs and theirs != mine else "")
    return (f"Note: the estimate is for an {estimate_gpu}; this trace ran on {name}{scale}. Compare op "
            f"shares and the step against PyTorch on the same GPU, not these milliseconds.")


def against(ms, estimate):
    """'3.9 (3.4-5): above' for a measured ms against an estimate (ms, low, high)."""
    mid, lo, hi = estimate
    verdict = "above" if ms > hi else "below" if ms < lo else "within"
    return f"{mid:g} ({lo:g}-{hi:g}): {verdict}"


def training_steps(events):
    """The number of training steps the trace holds: its distinct "step N" host ranges."""
    names = {e.get("name") for e in events if e.get("ph") == "X" and e.get("cat") == "step"}
    return len([n for n in names if str(n).startswith("step ")])


def device_steps(slices, steps, marker):
    """[(start_us, end_us)] of each step's work on the device, in order.

    The host runs a step ahead of the device (it reads a step's loss late), so the host's "step N"
    ranges do not bound that step's device work. The device's own order does: every step ends with
    the optimizer's one launch (adamw_multi, sgd_multi), so step k is what ran after the (k-1)-th
    marker ended up to the end of the k-th. Without a named optimizer op the marker is the op with
    exactly one call per step whose first call comes last. Work after the last marker (eval) counts
    for no step.
    """
    counts, first = {}, {}
    for e in slices:
        counts[e["name"]] = counts.get(e["name"], 0) + 1
        first[e["name"]] = min(first.get(e["name"], e["ts"]), e["ts"])
    if marker is None:
        named = [m for m in ("adamw_multi", "sgd_multi") if m in counts]
        once = sorted((n for n, c in counts.items() if c == steps), key=lambda n: first[n])
        marker = named[0] if named else (once[-1] if once else None)
    if marker is None:
        return None, []
    ends = sorted(e["ts"] + e.get("dur", 0.0) for e in slices if e["name"] == marker)
    bounds, lo = [], float("-inf")
    for end in ends:
        bounds.append((lo, end))
        lo = end
    return marker, bounds


def idle_gaps(slices, lo, hi, marker):
    """The device's idle time in (lo, hi]: no op on any of its stream tracks.

    Returns (idle_us, gaps), gaps being [(us, op before, op after)] for each stretch with nothing
    running, in time order. On one GPU these are kernel-boundary latencies (about 1-2 us each when
    the host runs ahead, plus the trace's own event pair per op) and waits for the host: a stretch
    much longer than that means the host, not the GPU, set the pace there.
    """
    spans = sorted((max(e["ts"], lo), min(e["ts"] + e.get("dur", 0.0), hi), e["name"]) for e in slices
                   if e["ts"] + e.get("dur", 0.0) > lo and e["ts"] < hi)
    gaps, idle = [], 0.0
    covered, before = lo, marker  # lo: the end of the marker of the step before the window
    for start, end, name in spans:
        if start > covered:
            gaps.append((start - covered, before, name))
            idle += start - covered
        if end >= covered:
            covered, before = end, name
    return idle, gaps


def parse_steps(text):
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps '{text}' must be FIRST:LAST, two step numbers such as 3:8")
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"--steps {text} must satisfy 1 <= FIRST <= LAST")
    return a, b


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0, help="device index (the trace's pid), default 0")
    ap.add_argument("--steps", type=parse_steps, default=None,
                    help="FIRST:LAST steps to average (default: all but the first two, warm-up)")
    ap.add_argument("--marker", default=None,
                    help="the op whose one launch per step ends a step (default: adamw_multi or sgd_multi)")
    ap.add_argument("--top", type=int, default=0, help="list only the N costliest ops (0: all)")
    ap.add_argument("--title", default="", help="a heading line above the table")
    ap.add_argument("--estimate", choices=sorted(ESTIMATES), default=None,
                    help="add bench/README.md's read-through estimate of each op and of the step")
    args = ap.parse_args(argv)
    try:
        with open(args.trace) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"op_table: cannot read a trace-event JSON from {args.trace}: {e}", file=sys.stderr)
        return 2

    slices = [e for e in events if e.get("ph") == "X" and e.get("cat") == "stream" and e.get("pid") == args.device]
    steps = training_steps(events)
    if not slices or not steps:
        print(f"op_table: {args.trace} has no stream slices on device {args.device} or no 'step N' ranges "
              "(a --cuda-graphs replay records no per-op slices)", file=sys.stderr)
        return 3
    marker, bounds = device_steps(slices, steps, args.marker)
    if not bounds:
        print(f"op_table: no op of {args.trace} marks the end of a step (none runs once per step)", file=sys.stderr)
        return 3
    numbered = list(range(1, len(bounds) + 1))
    if args.steps:
        chosen = [n for n in numbered if args.steps[0] <= n <= args.steps[1]]
    else:
        chosen = numbered[2:] if len(numbered) > 2 else numbered
    if not chosen:
        print(f"op_table: the trace has device steps 1..{numbered[-1]}, none in the requested range", file=sys.stderr)
        return 2

    per_op = {}  # name -> [total us, calls]
    lo, hi = bounds[chosen[0] - 1][0], bounds[chosen[-1] - 1][1]
    for e in slices:
        end = e["ts"] + e.get("dur", 0.0)
        if lo < end <= hi:
            acc = per_op.setdefault(e["name"], [0.0, 0])
            acc[0] += e.get("dur", 0.0)
            acc[1] += 1

    k = len(chosen)
    total_ms = sum(v[0] for v in per_op.values()) / 1e3 / k
    # Wall time per step on the device: from the marker before the first chosen step to the last's.
    wall_ms = (hi - lo) / 1e3 / k if lo != float("-inf") else None
    rows = sorted(per_op.items(), key=lambda kv: -kv[1][0])
    if args.top > 0:
        shown = rows[:args.top]
        # Budgeted ops are always listed.
        shown += [r for r in rows[args.top:] if r[0] in BUDGETS_MS]
    else:
        shown = rows
    if args.title:
        print(args.title)
        print()
    span = f"steps {chosen[0]}-{chosen[-1]}" if k > 1 else f"step {chosen[0]}"
    wall = f", {wall_ms:.1f} ms/step on the device's clock" if wall_ms else ""
    print(f"Device {args.device}, {span} of {steps} ({k} averaged; a step ends with {marker}): "
          f"{total_ms:.2f} ms/step of op time{wall}.")
    if wall_ms:
        idle_us, gaps = idle_gaps(slices, lo, hi, marker)
        by_pair = {}
        for us, a, b in gaps:
            acc = by_pair.setdefault((a, b), [0.0, 0])
            acc[0] += us
            acc[1] += 1
        worst = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:3]
        where = "; ".join(f"{a} -> {b} ({v[1] / k:.0f} gaps, {v[0] / k:.1f} us)" for (a, b), v in worst)
        longest = max(gaps, default=None)
        print()
        print(f"Idle (no op on any of the device's streams): {idle_us / 1e3 / k:.3f} ms/step, "
              f"{100 * idle_us / (hi - lo):.1f}% of the step, in {len(gaps) / k:.0f} gaps/step"
              f"{'; most between ' + where if where else ''}"
              f"{f'; the longest {longest[0]:.1f} us ({longest[1]} -> {longest[2]})' if longest else ''}.")
    print()
    est = ESTIMATES[args.estimate] if args.estimate else None
    note = other_gpu_note(est["gpu"], device_name(events, args.device)) if est else None
    if note:
        print(note)
        print()
    if est:
        print(f"| op | ms/step | calls/step | share | budget (issue 28) | {est['title']}, ms |")
        print("|---|---|---|---|---|---|")
    else:
        print("| op | ms/step | calls/step | share | budget (issue 28) |")
        print("|---|---|---|---|---|")
    extra = lambda name, ms: (f" {against(ms, est['ops'][name])} |" if name in est["ops"] else " |") if est else ""
    missed = []
    for name, (us, calls) in shown:
        ms = us / 1e3 / k
        budget = BUDGETS_MS.get(name)
        verdict = ""
        if budget is not None:
            ok = ms <= budget
            verdict = f"<= {budget:g} ms: {'ok' if ok else 'MISSED'}"
            if not ok:
                missed.append(name)
        print(f"| {name} | {ms:.3f} | {calls / k:g} | {100 * ms / total_ms:.1f}% | {verdict} |{extra(name, ms)}")
    for name, budget in BUDGETS_MS.items():
        if name not in per_op:
            print(f"| {name} | - | 0 | - | <= {budget:g} ms: not in the trace |{' |' if est else ''}")
    if args.top > 0 and len(rows) > len(shown):
        rest = sum(v[0] for n, v in rows if n not in dict(shown)) / 1e3 / k
        print(f"| (the other {len(rows) - len(shown)} ops) | {rest:.3f} | | {100 * rest / total_ms:.1f}% | |"
              f"{' |' if est else ''}")
    print()
    print(f"Budgets missed: {', '.join(missed) if missed else 'none'}.")
    if est:
        step_ms = wall_ms if wall_ms else total_ms
        clock = "the device's clock" if wall_ms else "op time"
        print(f"Step against the {est['title']}: {step_ms:.1f} ms/step on {clock}, estimated "
              f"{against(step_ms, est['step'])}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
