#!/usr/bin/env bash
# Pipeline parallelism through the trainer (issue #15's benchmark): gpt2-124m on 4 simulated
# devices, pipeline 4 under each schedule (m micro-batches of one sequence per step), next to
# ZeRO-3 over the same 4 devices and the same global batch: tokens/s, pool peak per device (min and
# max over the devices: the stages differ), and the measured bubble beside the closed form.
# Usage: bench/pipeline_schedules.sh [zerotrain binary] [steps] [micro-batches] [sequence length]
set -euo pipefail
BIN=${1:-build/cpu/apps/zerotrain}
STEPS=${2:-2}
M=${3:-8}
SEQ=${4:-64}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model gpt2-124m --devices cpu:4 --train-seq-len "$SEQ" --steps "$STEPS" --eval-every 0 --eval-batches 1
        --sample-tokens 0 --log-format json)
"$BIN" train "${common[@]}" --zero-stage 3 --batch-size "$M" --micro-batch-size 1 > "$out/zero3.jsonl"
for s in gpipe 1f1b interleaved zb-h1; do
  v=()  # --virtual-stages counts only for the interleaved schedule (elsewhere it is refused)
  [[ $s == interleaved ]] && v=(--virtual-stages 2)
  "$BIN" train "${common[@]}" --zero-stage 1 --pipeline-parallel 4 --pp-schedule "$s" "${v[@]}" \
    --batch-size "$M" --micro-batch-size 1 > "$out/$s.jsonl"
done
python3 - "$out" "$STEPS" "$M" "$SEQ" <<'PY'
import json, sys
out, steps, m, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print(f"gpt2-124m, cpu:4, {steps} steps of {m} sequences x {seq} tokens (pipeline: m = {m} micro-batches of 1)")
print("| run | tokens/s | pool peak per device (min - max) | bubble measured / theory |")
print("| --- | --- | --- | --- |")
base = None
for name in ("zero3", "gpipe", "1f1b", "interleaved", "zb-h1"):
    s = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if '"summary"' in l][-1]
    tps = s["tokens_per_s"]
    base = base or tps
    peaks = [p / 2**20 for p in s["peak_bytes_per_device"]]
    label = "ZeRO-3, data 4" if name == "zero3" else f"pipeline 4, {name}" + (" (V = 2)" if name == "interleaved" else "")
    bub = s.get("pipeline")
    b = f"{bub['measured_bubble']:.3f} / {bub['theoretical_bubble']:.3f}" if bub else "-"
    print(f"| {label} | {tps:.0f} ({tps / base:.2f}x) | {min(peaks):.0f} - {max(peaks):.0f} MiB | {b} |")
PY
