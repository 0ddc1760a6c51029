#!/usr/bin/env bash
# Issue #17's ASHA target, one run: a 16-point learning-rate grid on gpt-tiny (synthetic data) run
# in full (--scheduler none) and with ASHA (eta 3); prints the steps each spent and the final
# validation loss of each one's pick. Target: ASHA's pick within 2% of the grid's best at <= 35%
# of the grid's steps. Scripts for humans, not a test.
#   ZT=build/cpu/apps/zerotrain STEPS=600 bench/sweep_asha.sh
#   Reduced (a 2-core machine): STEPS=200 MODEL_FLAGS="--layers 2 --embd 32 --heads 2 --seq-len 64" bench/sweep_asha.sh
set -euo pipefail
ZT=${ZT:-build/cpu/apps/zerotrain}
STEPS=${STEPS:-600}
ETA=${ETA:-3}
MODEL_FLAGS=${MODEL_FLAGS:-}
DEVICES=${DEVICES:-all}
OUT=${OUT:-$(mktemp -d /tmp/sweep_asha.XXXXXX)}
mkdir -p "$OUT"
# 16 learning rates, log-spaced from 1e-4 to 3e-2.
LRS=$(python3 -c "print(','.join('%.3g' % (1e-4 * (3e-2 / 1e-4) ** (i / 15)) for i in range(16)))")
common=(--devices "$DEVICES" --space "lr=$LRS" --max-steps "$STEPS" --eval-every $((STEPS / 6)) --quiet)
# shellcheck disable=SC2206
common+=($MODEL_FLAGS)
t0=$(date +%s.%N)
"$ZT" sweep "${common[@]}" --scheduler none --sweep-dir "$OUT/grid" > "$OUT/grid.txt"
t1=$(date +%s.%N)
"$ZT" sweep "${common[@]}" --scheduler asha --eta "$ETA" --sweep-dir "$OUT/asha" --plot "$OUT/asha.svg" > "$OUT/asha.txt"
t2=$(date +%s.%N)
python3 - "$OUT" "$t0" "$t1" "$t2" <<'PY'
import json, sys
out, t0, t1, t2 = sys.argv[1], *map(float, sys.argv[2:])
def load(name):  # the last line of each trial (a trial promoted at the end has two)
    rows = {}
    for l in open(f"{out}/{name}/results.jsonl"):
        if l.strip():
            r = json.loads(l)
            rows[r["trial"]] = r
    return list(rows.values())
grid, asha = load("grid"), load("asha")
def pick(rows):  # the best final validation loss among trials that ran to the end
    done = [r for r in rows if r["status"] == "finished" and r["last_val_loss"] is not None]
    return min(done, key=lambda r: r["last_val_loss"])
g, a = pick(grid), pick(asha)
gs, as_ = sum(r["steps"] for r in grid), sum(r["steps"] for r in asha)
print(f"grid : {len(grid)} trials, {gs} steps, {t1 - t0:.1f} s, best lr={g['values'][0][1]} val {g['last_val_loss']:.4f}")
print(f"asha : {len(asha)} trials, {as_} steps, {t2 - t1:.1f} s, pick lr={a['values'][0][1]} val {a['last_val_loss']:.4f}")
print(f"asha spent {100 * as_ / gs:.1f}% of the grid's steps (target <= 35%); its pick is "
      f"{100 * (a['last_val_loss'] / g['last_val_loss'] - 1):+.2f}% from the grid's best (target within 2%)")
print(f"files: {out}")
PY
