#!/usr/bin/env bash
# Long crash-safety run of the checkpoint writer: a child process saving checkpoints is SIGKILLed at
# random instants TRIALS times (default 1000; the ctest run does 50), and after each kill resume
# must find the newest complete checkpoint with exactly the data written for its step.
# Usage: bench/crash_trials.sh [TRIALS] [SEED] [BUILD_DIR]   (BUILD_DIR default build/release)
set -euo pipefail
cd "$(dirname "$0")/.."
trials="${1:-1000}"
seed="${2:-$RANDOM}"
build="${3:-build/release}"
bin="$build/tests/test_checkpoint"
if [[ ! -x "$bin" ]]; then
  cmake --build "$build" --target test_checkpoint
fi
echo "crash trials: $trials, seed $seed ($bin)"
ZT_CRASH_TRIALS="$trials" ZT_CRASH_SEED="$seed" "$bin" \
  --gtest_filter='CheckpointCrash.*' --gtest_brief=0
