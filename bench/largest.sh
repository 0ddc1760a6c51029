#!/usr/bin/env bash
# Issue 16's "largest model" target: `zerotrain plan --largest` on 4 simulated 2 GiB devices (batch 8,
# 512 tokens), then a few training steps of the largest stage 3 + full recompute + optimizer offload
# model it reports, in the same memory. For humans (each step takes minutes on 2 cores), not CI.
# Usage: bench/largest.sh [STEPS] [BUILD_DIR]   (STEPS default 3, BUILD_DIR default build/release)
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-3}"
build="${2:-build/release}"
bin="$build/apps/zerotrain"
if [[ ! -x "$bin" ]]; then
  cmake --build "$build" --target zerotrain
fi
run=(--devices cpu:4 --device-memory 2GiB --batch-size 8 --train-seq-len 512)
echo "\$ zerotrain plan --largest ${run[*]}"
table=$("$bin" plan --largest "${run[@]}")
echo "$table"
# The row "3  full  optimizer  LAYERS x WIDTH ..." names the model.
read -r layers width < <(awk '$1 == 3 && $2 == "full" && $3 == "optimizer" && $5 == "x" {print $4, $6}' <<<"$table") || true
if [[ -z "${layers:-}" ]]; then
  echo "no GPT-2 shape fits with stage 3, --recompute full and --offload optimizer"
  exit 1
fi
# The same run as planned (its evaluation and end-of-run sample included), kept short; a step of
# these sizes on 2 cores takes longer than the default hang timeout.
train=(train "${run[@]}" --layers "$layers" --embd "$width" --heads $((width / 64)) --vocab 50257 --seq-len 512
       --zero-stage 3 --recompute full --offload optimizer --steps "$steps" --eval-every 0 --eval-batches 1
       --sample-tokens 8 --hang-timeout 86400)
echo "\$ zerotrain ${train[*]}"
"$bin" "${train[@]}"
