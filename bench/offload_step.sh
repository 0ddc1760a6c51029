#!/usr/bin/env bash
# The host optimizer's exposed time as a share of the step (target <= 20%): gpt2-124m on 4
# simulated devices, ZeRO stage 2, --offload optimizer, against the same run with the device
# optimizer. Reads the JSON summaries' time_split (host_optimizer_s: the time the devices waited
# for the host update; optimizer_s: the whole optimizer phase).
# Usage: bench/offload_step.sh [zerotrain binary] [steps] [batch size] [sequence length]
set -euo pipefail
BIN=${1:-build/cpu/apps/zerotrain}
STEPS=${2:-3}
BATCH=${3:-4}
SEQ=${4:-64}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for mode in device offload; do
  extra=()
  [[ $mode == offload ]] && extra=(--offload optimizer)
  "$BIN" train --model gpt2-124m --devices cpu:4 --zero-stage 2 --batch-size "$BATCH" --train-seq-len "$SEQ" \
    --steps "$STEPS" --eval-every 0 --sample-tokens 0 --log-format json "${extra[@]}" > "$out/$mode.jsonl"
done
python3 - "$out" "$STEPS" "$BATCH" "$SEQ" <<'EOF'
import json, sys
out, steps, batch, seq = sys.argv[1], *sys.argv[2:]
print(f"gpt2-124m, cpu:4, stage 2, {steps} steps of batch {batch} x {seq} tokens")
for mode in ("device", "offload"):
    s = [json.loads(l) for l in open(f"{out}/{mode}.jsonl") if '"summary"' in l][-1]
    t = s["time_split"]
    total = t["compute_s"] + t["comm_s"] + t["optimizer_s"] + t["other_s"]
    host = t.get("host_optimizer_s", 0.0)
    print(f"  {mode:8} step {total / int(steps):7.2f} s | optimizer phase {t['optimizer_s'] / total:5.1%} | "
          f"host optimizer exposed {host / total:5.1%} | pool peak/device {max(s['peak_bytes_per_device']) / 2**20:7.1f} MiB"
          + (f" | host/device {max(s['host_peak_bytes_per_device']) / 2**20:7.1f} MiB" if mode == "offload" else ""))
EOF
