#!/usr/bin/env bash
# Issue #17's packing figure: 8 one-device trials in one `zerotrain sweep` on 8 devices vs the same
# 8 runs as sequential `zerotrain train` processes; prints both wall times and their ratio. On the
# CPU backend the 8 "devices" share the machine's cores, so the ratio there says how much the
# trials overlap on those cores (report the core count with it); on a GPU machine pass
# DEVICES=cuda:0,1,...,7 (or cuda:0x8 on one GPU) and TRAIN_DEVICE=cuda:0.
#   ZT=build/cpu/apps/zerotrain STEPS=100 bench/sweep_pack.sh
set -euo pipefail
ZT=${ZT:-build/cpu/apps/zerotrain}
STEPS=${STEPS:-100}
MODEL_FLAGS=${MODEL_FLAGS:-}
DEVICES=${DEVICES:-cpu:8}
TRAIN_DEVICE=${TRAIN_DEVICE:-cpu:1}
OUT=${OUT:-$(mktemp -d /tmp/sweep_pack.XXXXXX)}
mkdir -p "$OUT"
LRS=(1e-4 2e-4 5e-4 1e-3 2e-3 3e-3 5e-3 1e-2)
# shellcheck disable=SC2206
model=($MODEL_FLAGS)
list=$(IFS=,; echo "${LRS[*]}")
t0=$(date +%s.%N)
"$ZT" sweep "${model[@]}" --devices "$DEVICES" --devices-per-trial 1 --space "lr=$list" --max-steps "$STEPS" \
  --quiet --sweep-dir "$OUT/sweep" > "$OUT/sweep.txt"
t1=$(date +%s.%N)
for lr in "${LRS[@]}"; do
  "$ZT" train "${model[@]}" --devices "$TRAIN_DEVICE" --lr "$lr" --steps "$STEPS" --quiet --metrics "$OUT/train-$lr.jsonl"
done
t2=$(date +%s.%N)
python3 -c "
import os, sys
s, q = $t1 - $t0, $t2 - $t1
print(f'one sweep process, 8 trials on $DEVICES: {s:.1f} s')
print(f'8 sequential train processes on $TRAIN_DEVICE: {q:.1f} s')
print(f'ratio sequential / sweep: {q / s:.2f}x ({os.cpu_count()} cores, {$STEPS} steps per trial)')
"
echo "files: $OUT"
