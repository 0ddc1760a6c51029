#!/usr/bin/env bash
# Kill-anywhere run of `zerotrain sweep` (issue #31): a small ASHA sweep (6 trials, rungs at 2 and 4
# of 8 steps, one device so its order is fixed) is SIGKILLed KILLS times (default 200) at random
# instants, each kill followed by the same command; whenever a run completes, its leaderboard and
# results.jsonl must equal the uninterrupted sweep's, and a fresh directory starts the next cycle.
# The last directory is run to completion and checked the same way. Exits 1 on any difference.
# Usage: bench/crash_sweeps.sh [KILLS] [SEED] [ZEROTRAIN]   (ZEROTRAIN default build/cpu/apps/zerotrain)
set -euo pipefail
cd "$(dirname "$0")/.."
kills="${1:-200}"
seed="${2:-$RANDOM}"
zt="${3:-build/cpu/apps/zerotrain}"
[[ -x "$zt" ]] || cmake --build build/cpu --target zerotrain
RANDOM=$seed
out=$(mktemp -d /tmp/crash_sweeps.XXXXXX)
args=(sweep --layers 1 --embd 32 --heads 2 --seq-len 16 --eval-batches 1 --sample-tokens 0 --devices cpu:1
      --space lr=1e-3,2e-3,3e-3,4e-3,5e-3,6e-3 --max-steps 8 --scheduler asha --eta 2 --min-steps 2 --quiet)
leaderboard() { sed -n '/^leaderboard/,$p' "$1"; }

t0=$(date +%s%N)
"$zt" "${args[@]}" --sweep-dir "$out/ref" > "$out/ref.out"
ref_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
leaderboard "$out/ref.out" > "$out/ref.lb"
echo "crash sweeps: $kills kills, seed $seed, uninterrupted sweep ${ref_ms} ms ($zt, files in $out)"

check() {  # $1: the run's stdout, $2: its sweep directory
  if ! diff -q "$out/ref.lb" <(leaderboard "$1") > /dev/null ||
     ! cmp -s "$out/ref/results.jsonl" "$2/results.jsonl"; then
    echo "FAIL: $2 ended differently from the uninterrupted sweep:"
    diff "$out/ref.lb" <(leaderboard "$1") || true
    exit 1
  fi
}

n=0 cycles=0 dir="$out/run0"
while (( n < kills )); do
  "$zt" "${args[@]}" --sweep-dir "$dir" > "$out/last.out" 2> "$out/last.err" &
  pid=$!
  # A random instant: uniform over [0, 3/4 of the uninterrupted sweep's time], so that most cycles
  # take several kills (a rerun has less left to do) and the last one completes.
  delay_ms=$(( (RANDOM * 32768 + RANDOM) % (ref_ms * 3 / 4 + 1) ))
  sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
  kill -9 "$pid" 2> /dev/null || true
  rc=0
  { wait "$pid"; } 2> /dev/null || rc=$?
  if (( rc == 137 )); then
    n=$((n + 1))
  elif (( rc == 0 )); then  # it finished before the kill
    check "$out/last.out" "$dir"
    cycles=$((cycles + 1))
    rm -rf "$dir"
    dir="$out/run$cycles"
  else
    echo "FAIL: exit $rc after $n kills:"; cat "$out/last.err"; exit 1
  fi
done
"$zt" "${args[@]}" --sweep-dir "$dir" > "$out/last.out"
check "$out/last.out" "$dir"
cycles=$((cycles + 1))
echo "crash sweeps: $kills kills over $cycles completed sweeps, every one with the uninterrupted leaderboard"
rm -rf "$out"
