#!/usr/bin/env bash
# Issue 18's training benchmark: the default GPT job (gpt-tiny, ZeRO stage 2, fp32) on 4 global ranks
# as 1 process x cpu:4 and as 2 processes x cpu:2 under mpirun, flat and --comm-topology
# hierarchical: tokens/s (ratio to one process) and bytes per step inside and out of each process
# (the summary's measured `traffic`). Usage: bench/processes.sh [zerotrain binary] [steps] [stage]
set -euo pipefail
BIN=${1:-build/cpu/apps/zerotrain}
STEPS=${2:-40}
STAGE=${3:-2}
[[ -x "$BIN" ]] || { echo "bench/processes.sh: $BIN not built (cmake --build --preset cpu --target zerotrain)" >&2; exit 1; }
command -v mpirun > /dev/null || { echo "bench/processes.sh: mpirun not found (scripts/setup installs openmpi-bin)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model gpt-tiny --zero-stage "$STAGE" --steps "$STEPS" --eval-every 0 --eval-batches 1 --sample-tokens 0
        --log-format json)
"$BIN" train --devices cpu:4 "${common[@]}" > "$out/one.jsonl"
# --allow-run-as-root: this machine builds as root; --oversubscribe: 2 processes x 2 comm workers on 2 cores.
mpi=(mpirun -np 2 --allow-run-as-root --oversubscribe "$BIN" train --devices cpu:2 "${common[@]}")
"${mpi[@]}" --comm-topology flat > "$out/flat.jsonl"
"${mpi[@]}" --comm-topology hierarchical > "$out/hier.jsonl"
python3 - "$out" "$STEPS" "$STAGE" <<'PY'
import json, sys
out, steps, stage = sys.argv[1:]

def summary(name):
    for line in open(f"{out}/{name}.jsonl"):
        if line.startswith("{"):
            j = json.loads(line)
            if j.get("event") == "summary":
                return j
    sys.exit(f"bench/processes.sh: no summary in {name}")

runs = [("1 process x cpu:4", summary("one")), ("2 processes x cpu:2, flat", summary("flat")),
        ("2 processes x cpu:2, hierarchical", summary("hier"))]
base = runs[0][1]["tokens_per_s"]
flat_across = runs[1][1]["traffic"]["across_bytes_per_step"]
print(f"gpt-tiny, ZeRO stage {stage}, fp32, {steps} steps, final loss per run to show they trained the same")
print(f"| run | tokens/s | ratio | inside/step (MiB, per process) | across/step (MiB, per process) | across vs flat | final loss |")
print("|---|---|---|---|---|---|---|")
for name, s in runs:
    t = s["traffic"]
    across = t["across_bytes_per_step"]
    vs = f"{across / flat_across:.3f}" if across else "-"
    print(f"| {name} | {s['tokens_per_s']:.0f} | {s['tokens_per_s'] / base:.2f} | {t['inside_bytes_per_step'] / 2**20:.3f} "
          f"| {across / 2**20:.3f} | {vs} | {s['final_loss']:.6f} |")
PY
