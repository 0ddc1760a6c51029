#!/usr/bin/env bash
# Issue 18's collective benchmark: all-reduce over 4 global ranks as 1 process x 4 simulated devices
# (in-process Communicator and the ring), 2 processes x 2 (flat and hierarchical) and 4 x 1, under
# mpirun; bus bandwidth and bytes that crossed processes per call. Usage: bench/process_ring.sh [BUILD_DIR]
set -euo pipefail
build="${1:-build/cpu}"
bin="$build/bench/bench_process_ring"
[[ -x "$bin" ]] || { echo "bench/process_ring.sh: $bin not built (needs MPI; cmake --build --preset cpu --target bench_process_ring)" >&2; exit 1; }
for shape in "1 4" "2 2" "4 1"; do
  set -- $shape
  echo "=== $1 process(es) x $2 device(s) ==="
  mpirun -np "$1" --allow-run-as-root --oversubscribe "$bin" --local-devices "$2" --benchmark_counters_tabular=true --benchmark_color=false 2>&1 |
    grep -E "^BM_|^Benchmark|^-" || true
done
