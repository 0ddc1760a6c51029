#!/usr/bin/env bash
# Tensor parallelism on 4 simulated devices (issue 14's benchmark): gpt2-124m at T = 1, 2, 4
# (data 4, 2, 1), ZeRO stage 2, the same global batch: step time, pool peak and activation
# workspace per device, bytes sent per step per device by axis, and the share of comm-stream busy
# time that overlaps compute-stream work (from each run's --trace; at T = 4 the comm stream
# carries only the tensor group's collectives and the overflow flag, at T = 2 ZeRO's too).
# Usage: bench/tensor_parallel.sh [zerotrain binary] [steps] [batch size] [sequence length]
set -euo pipefail
BIN=${1:-build/cpu/apps/zerotrain}
STEPS=${2:-2}
BATCH=${3:-4}
SEQ=${4:-128}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for t in 1 2 4; do
  "$BIN" train --model gpt2-124m --devices cpu:4 --tensor-parallel "$t" --zero-stage 2 --batch-size "$BATCH" \
    --train-seq-len "$SEQ" --steps "$STEPS" --eval-every 0 --eval-batches 1 --sample-tokens 0 --log-format json \
    --trace "$out/t$t.json" > "$out/t$t.jsonl"
done
python3 - "$out" "$STEPS" "$BATCH" "$SEQ" <<'PY'
import json, sys
out, steps, batch, seq = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]

def busy(spans):
    spans = sorted(spans)
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged

def overlap(xs, ys):
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total

print(f"gpt2-124m, cpu:4, ZeRO stage 2, {steps} steps of batch {batch} x {seq} tokens")
base = None
for t in (1, 2, 4):
    s = [json.loads(l) for l in open(f"{out}/t{t}.jsonl") if '"summary"' in l][-1]
    tsplit = s["time_split"]
    step = (tsplit["compute_s"] + tsplit["comm_s"] + tsplit["optimizer_s"] + tsplit["other_s"]) / steps
    base = base or step
    ev = json.load(open(f"{out}/t{t}.json"))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    fr = []
    for pid in range(4):
        comp = busy([(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e["pid"] == pid and e["tid"] == 0])
        comm = busy([(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e["pid"] == pid and e["tid"] == 1])
        total = sum(b - a for a, b in comm)
        fr.append(overlap(comm, comp) / total if total else 0.0)
    mem = s["memory_per_device"] if "memory_per_device" in s else None
    sent = s["comm_bytes_per_step_per_device"]
    tensor = [d.get("tensor_sent_per_step", 0) for d in (mem or [])]
    act = max(d["activations"] for d in mem) if mem else 0
    print(f"  T={t}: step {step:6.2f} s ({step / base:4.2f}x T=1) | pool peak/device {max(s['peak_bytes_per_device']) / 2**20:7.1f} MiB"
          f" | activations/device {act / 2**20:6.1f} MiB | sent/step/device {max(sent) / 2**20:6.1f} MiB"
          f" (tensor axis {max(tensor or [0]) / 2**20:6.1f} MiB) | comm overlapping compute {sum(fr) / len(fr):5.1%}")
PY
