#!/usr/bin/env bash
# One-call verification on a GPU machine: build with the CUDA backend (sm_90), run every test (the
# CUDA ones are active when a GPU is usable), show the devices, run the copy/memory benchmarks,
# and write $OUT/results.md (step, status, time). Usage: OUT=/some/dir scripts/gpu-check.sh
# Finishes within ~7.5 minutes (a deadline caps every step); exits non-zero when configure, build,
# ctest or the NCCL checks (step 4b, PASS/FAIL lines in $OUT/nccl.txt) failed, after writing the results.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT="${OUT:-out/gpu-check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUILD=build/gpu
JOBS="${ZT_JOBS:-16}"
DEADLINE=$((SECONDS + 450))  # leaves headroom under the 8-minute limit for the last step's kill
RESULTS="$OUT/results.md"
rows=()
failed=0

# run_step NAME MAX_SECONDS LOG CMD...: runs CMD under `timeout` (capped by the deadline), output
# to $OUT/LOG, and records a results row. Returns CMD's status (124 = timed out, 125 = skipped).
run_step() {
  local name=$1 max=$2 log=$3
  shift 3
  local remaining=$((DEADLINE - SECONDS))
  if ((remaining < 15)); then
    rows+=("| $name | skipped (out of time) | 0 | |")
    echo "=== $name: skipped, out of time"
    return 125
  fi
  local limit=$((max < remaining ? max : remaining))
  echo "=== $name (limit ${limit}s) -> $log"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local status="ok"
  if ((rc == 124 || rc == 137)); then
    status="TIMEOUT after ${limit}s"
  elif ((rc != 0)); then
    status="FAILED (exit $rc)"
  fi
  rows+=("| $name | $status | $took | $log |")
  echo "    $status in ${took}s"
  return $rc
}

skip_step() {
  rows+=("| $1 | skipped ($2) | 0 | |")
  echo "=== $1: skipped ($2)"
}

write_results() {
  {
    echo "# gpu-check results"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || true)"
    echo "- total time: ${SECONDS}s"
    [[ -n "${ctest_summary:-}" ]] && echo "- ctest: ${ctest_summary}"
    [[ -n "${cuda_note:-}" ]] && echo "- note: ${cuda_note}"
    echo
    echo "| step | status | time (s) | log |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
  } >"$RESULTS"
}

# ---- 1. the GPU as the driver sees it --------------------------------------------------------
run_step nvidia-smi 30 nvidia-smi.txt nvidia-smi
cat "$OUT/nvidia-smi.txt"

# ---- 2. dependencies (apt may be unreachable; packages may already be there) ------------------
if ! run_step setup 120 setup.log scripts/setup; then
  echo "    scripts/setup failed; continuing with what is installed (see $OUT/setup.log)"
  tail -n 5 "$OUT/setup.log"
fi

# ---- 3. configure + build --------------------------------------------------------------------
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
built=0
if run_step configure 120 configure.log cmake -S . -B "$BUILD" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DZT_CUDA=ON -DZT_CUDA_ARCHS=90; then
  if run_step build 300 build.log cmake --build "$BUILD" -j "$JOBS"; then
    built=1
  else
    failed=1
    tail -n 40 "$OUT/build.log"
  fi
else
  failed=1
  tail -n 40 "$OUT/configure.log"
fi

# ---- 4. tests ---------------------------------------------------------------------------------
if ((built)); then
  # The newest CUDA paths first, so a short visit still checks them: the tensor-parallel ops, the
  # tiled attention (both GPT models train on it), TF32 GEMMs and the device sum on the GPU against
  # the CPU backend's ops and the float64 references, the classifier's CUB row reductions, and the
  # timing events the step uses, the cuBLAS workspace from the pool and pinned copy buffers, and the
  # ring's direct path (accumulate_peer's kernel against the CPU bits, the collectives on cuda:0x4),
  # and the fused classifier's online-softmax kernel (padded vocabulary; f32, bf16 and f16 logits,
  # 128-bit loads) and the LM head's GEMMs over padded rows against float64 (ClassifierTest).
  run_step new-cuda-ops 60 new-cuda-ops.log ctest --test-dir "$BUILD" --output-on-failure -j 8 --timeout 60 \
    -R '^(Backends/(TpOpsTest\..*|FlashAttention[A-Za-z]*\..*|ClassifierTest\..*|OpsTest\.(MatmulTf32RoundsInputs|Sum|Classifier[A-Za-z]*))/cuda|CudaRuntime\..*|AccumulatePeerOnGpu\..*|CommOnGpu\..*)'
  (($? != 0)) && failed=1
fi

# ---- 4b. --comm nccl, before the whole ctest so a short visit checks it: the NCCL communicator
# against the ring (test_nccl: one rank bit for bit, every GPU as a rank on exact sums), then a few
# ZeRO-3 training steps on cuda:0 with --comm nccl and --comm ring, whose per-step losses must be
# equal (one rank: NCCL's collectives move nothing). One PASS/FAIL line per check in $OUT/nccl.txt.
if ((built)); then
  nccl_test="$BUILD/tests/test_nccl"
  app="$BUILD/apps/zerotrain"
  if [[ -x "$nccl_test" ]]; then
    run_step "nccl vs ring (test_nccl)" 120 nccl-test.log "$nccl_test"
    rc=$?
    ((rc != 0)) && failed=1
    if grep -q 'built without NCCL' "$OUT/nccl-test.log"; then
      echo "SKIP test_nccl: this build has no NCCL" >"$OUT/nccl.txt"
    elif ((rc == 0)); then echo "PASS test_nccl" >"$OUT/nccl.txt"; else echo "FAIL test_nccl (exit $rc)" >"$OUT/nccl.txt"; fi
    grep -E '^\[ +(OK|FAILED|SKIPPED) +\]' "$OUT/nccl-test.log" | tail -n 8
  else
    skip_step "nccl vs ring (test_nccl)" "no binary"
  fi
  if [[ -x "$app" ]] && ! grep -q 'built without NCCL' "$OUT/nccl-test.log" 2>/dev/null; then
    nc=(train --steps 8 --batch-size 8 --layers 2 --embd 64 --heads 2 --eval-every 0 --eval-batches 1
        --sample-tokens 0 --quiet --devices cuda:0 --zero-stage 3 --precision fp32)
    for engine in ring nccl; do
      run_step "train cuda:0 --comm $engine" 90 "train-comm-$engine.txt" "$app" "${nc[@]}" --comm "$engine" \
        --log-format json --metrics "$OUT/train-comm-$engine.jsonl"
    done
    if command -v python3 >/dev/null 2>&1; then
      run_step "compare --comm nccl vs ring" 30 compare-comm.txt python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def losses(name):
    with open(os.path.join(out, name)) as f:
        return [json.loads(l)["loss"] for l in f if '"loss"' in l and '"event"' not in l]
try:
    ring, nccl = losses("train-comm-ring.jsonl"), losses("train-comm-nccl.jsonl")
except OSError as e:
    print(f"FAIL --comm nccl vs ring on cuda:0: {e}"); sys.exit(1)
same = len(ring) == len(nccl) > 0 and all(a == b for a, b in zip(ring, nccl))
print(f"{'PASS' if same else 'FAIL'} --comm nccl vs ring on cuda:0: {len(nccl)} and {len(ring)} steps, losses "
      f"{'bitwise equal' if same else 'differ: ' + str(list(zip(nccl, ring))[:4])}")
sys.exit(0 if same else 1)
PY
      (($? != 0)) && failed=1
      cat "$OUT/compare-comm.txt" | tee -a "$OUT/nccl.txt"
    fi
  fi
  cat "$OUT/nccl.txt" 2>/dev/null
fi

if ((built)); then
  run_step ctest 240 ctest.log ctest --test-dir "$BUILD" --output-on-failure -j 8 --timeout 180 \
    --output-junit "$OUT/ctest-junit.xml"
  rc=$?
  ((rc != 0)) && failed=1
  ctest_summary="$(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
  skipped_cuda="$(grep -cE 'Test +#[0-9]+: (Cuda(Runtime|Cast)\.|.*/cuda ).*Skipped' "$OUT/ctest.log" || true)"
  if ((skipped_cuda > 0)); then
    cuda_note="${skipped_cuda} CUDA tests were skipped: no usable GPU in this run (see ctest.log)"
  fi
  grep -E 'tests passed|tests failed|\(Failed\)|\(Timeout\)|\*\*\*' "$OUT/ctest.log" |
    grep -v 'Skipped' | tail -n 30
else
  skip_step ctest "build failed"
fi

# ---- 5. devices as zerotrain sees them -------------------------------------------------------
app="$BUILD/apps/zerotrain"
if ((built)) && [[ -x "$app" ]]; then
  run_step "zerotrain info --devices all" 60 info-all.txt "$app" info --devices all
  cat "$OUT/info-all.txt"
  run_step "zerotrain info --devices cuda:0x4" 60 info-cuda0x4.txt "$app" info --devices cuda:0x4
  cat "$OUT/info-cuda0x4.txt"
else
  skip_step "zerotrain info" "no binary"
fi

# ---- 6. training on the GPU vs the CPU backend, step by step ---------------------------------
# The same gpt-tiny run (one device, then 4 logical devices at ZeRO stage 3 on GPU 0) on CUDA and
# on the simulated CPU devices; the losses must agree to fp32 rounding (cuBLAS vs OpenBLAS
# summation order), and the ZeRO-3 run must match the 1-device run.
if ((built)) && [[ -x "$app" ]]; then
  common=(train --steps 30 --batch-size 8 --eval-every 0 --eval-batches 1 --sample-tokens 0 --quiet --precision fp32)
  run_step "train cuda:0" 120 train-cuda.txt "$app" "${common[@]}" --devices cuda:0 --metrics "$OUT/train-cuda.jsonl"
  run_step "train cpu:1" 120 train-cpu.txt "$app" "${common[@]}" --devices cpu:1 --metrics "$OUT/train-cpu.jsonl"
  run_step "train cuda:0x4 zero-3" 120 train-cuda-z3.txt "$app" "${common[@]}" --devices cuda:0x4 --zero-stage 3 \
    --metrics "$OUT/train-cuda-z3.jsonl"
  if command -v python3 >/dev/null 2>&1; then
    run_step "compare losses" 30 compare-losses.txt python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def losses(name):
    with open(os.path.join(out, name)) as f:
        return [json.loads(l)["loss"] for l in f if '"loss"' in l and '"event"' not in l]
ref = losses("train-cpu.jsonl")
bad = 0
for name in ("train-cuda.jsonl", "train-cuda-z3.jsonl"):
    try:
        got = losses(name)
    except OSError:
        print(f"{name}: missing"); bad = 1; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if got else float("inf")
    print(f"{name} vs train-cpu.jsonl: {len(got)} steps, max relative loss difference {worst:.2e}")
    bad |= not (len(got) == len(ref) and worst < 1e-3)
sys.exit(bad)
PY
    (($? != 0)) && failed=1
    cat "$OUT/compare-losses.txt"
  fi
else
  skip_step "train on GPU" "no binary"
fi

# ---- 6b. mixed precision on the GPU vs the CPU backend's emulation, step by step ------------
# bf16 and fp16 (dynamic loss scale) runs of gpt-tiny on cuda:0 and cpu:1: 16-bit storage and
# rounding are bit-identical, the GEMMs are not, so the losses agree to bf16/fp16 tolerances.
if ((built)) && [[ -x "$app" ]]; then
  mp=(train --steps 30 --batch-size 8 --eval-every 0 --eval-batches 1 --sample-tokens 0 --quiet)
  for p in bf16 fp16; do
    run_step "train cuda:0 $p" 120 "train-cuda-$p.txt" "$app" "${mp[@]}" --precision $p --devices cuda:0 \
      --metrics "$OUT/train-cuda-$p.jsonl"
    run_step "train cpu:1 $p" 120 "train-cpu-$p.txt" "$app" "${mp[@]}" --precision $p --devices cpu:1 \
      --metrics "$OUT/train-cpu-$p.jsonl"
  done
  if command -v python3 >/dev/null 2>&1; then
    run_step "compare mixed-precision losses" 30 compare-mp.txt python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def losses(name):
    with open(os.path.join(out, name)) as f:
        return [json.loads(l).get("loss") for l in f if '"loss"' in l and '"event"' not in l]
bad = 0
for p, tol in (("bf16", 3e-2), ("fp16", 5e-3)):
    try:
        g, c = losses(f"train-cuda-{p}.jsonl"), losses(f"train-cpu-{p}.jsonl")
    except OSError as e:
        print(f"{p}: {e}"); bad = 1; continue
    pairs = [(a, b) for a, b in zip(g, c) if a is not None and b is not None]
    worst = max(abs(a - b) / abs(b) for a, b in pairs) if pairs else float("inf")
    print(f"{p}: cuda:0 vs cpu:1, {len(pairs)} steps, max relative loss difference {worst:.2e} (tolerance {tol})")
    bad |= not (len(g) == len(c) and worst < tol)
sys.exit(bad)
PY
    (($? != 0)) && failed=1
    cat "$OUT/compare-mp.txt"
  fi
fi

# ---- 6c. checkpoints across backends: save on the GPU, load on the CPU backend (another device
# count and stage) and save again, load back on the GPU and save again; every array bitwise equal.
if ((built)) && [[ -x "$app" ]]; then
  ck=(train --steps 10 --batch-size 12 --eval-every 0 --eval-batches 1 --sample-tokens 0 --quiet --precision bf16)
  rm -rf "$OUT/ck-gpu" "$OUT/ck-cpu" "$OUT/ck-back"
  run_step "checkpoint save cuda:0x2 stage 2" 120 ck-gpu.txt "$app" "${ck[@]}" --devices cuda:0x2 --zero-stage 2 \
    --checkpoint-dir "$OUT/ck-gpu"
  run_step "checkpoint load cpu:3 stage 3" 120 ck-cpu.txt "$app" "${ck[@]}" --devices cpu:3 --zero-stage 3 \
    --resume "$OUT/ck-gpu/step-00000010" --checkpoint-dir "$OUT/ck-cpu"
  run_step "checkpoint load cuda:0 stage 1" 120 ck-back.txt "$app" "${ck[@]}" --devices cuda:0 --zero-stage 1 \
    --resume "$OUT/ck-cpu/step-00000010" --checkpoint-dir "$OUT/ck-back"
  if command -v python3 >/dev/null 2>&1; then
    run_step "compare checkpoints" 60 compare-ck.txt bash -c "python3 scripts/compare_checkpoints.py \
      '$OUT/ck-gpu/step-00000010' '$OUT/ck-cpu/step-00000010' && python3 scripts/compare_checkpoints.py \
      '$OUT/ck-gpu/step-00000010' '$OUT/ck-back/step-00000010'"
    (($? != 0)) && failed=1
    cat "$OUT/compare-ck.txt"
  fi
  rm -rf "$OUT/ck-gpu" "$OUT/ck-cpu" "$OUT/ck-back"
fi

# ---- 7. profiling artefacts: a Chrome trace from the CUDA backend, an nsys capture ----------
if ((built)) && [[ -x "$app" ]]; then
  prof=(train --steps 12 --batch-size 8 --eval-every 0 --eval-batches 1 --sample-tokens 0 --quiet --devices cuda:0x2)
  run_step "trace cuda:0x2" 120 trace-cuda.txt "$app" "${prof[@]}" --trace "$OUT/trace-cuda.json"
  if command -v nsys >/dev/null 2>&1; then
    run_step "nsys profile" 180 nsys.txt nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop \
      -t cuda,nvtx -o "$OUT/zt-profile" --force-overwrite true "$app" "${prof[@]}" --profile-steps 5:7
  else
    skip_step "nsys profile" "nsys not installed"
  fi
else
  skip_step "profiling" "no binary"
fi

# ---- 8. benchmarks (JSON to $OUT) ------------------------------------------------------------
# Google Benchmark >= 1.8 takes --benchmark_min_time=0.05s; 1.7 (Debian 12) only the bare number.
# bench_nccl (our collectives vs NCCL on every GPU) exists only where NCCL was found at configure
# time, and skips itself with fewer than 2 GPUs; a missing binary is skipped like the others.
for b in bench_cuda_copy bench_ops bench_comm bench_nccl bench_peer_copy bench_memory; do
  exe="$BUILD/bench/$b"
  if ((!built)) || [[ ! -x "$exe" ]]; then
    skip_step "$b" "no binary"
    continue
  fi
  min_time=0.05s
  if ! "$exe" --benchmark_list_tests=true --benchmark_min_time=0.05s >/dev/null 2>&1; then
    min_time=0.05
  fi
  run_step "$b" 90 "$b.txt" "$exe" --benchmark_min_time="$min_time" \
    --benchmark_out="$OUT/$b.json" --benchmark_out_format=json
  tail -n 25 "$OUT/$b.txt"
done

write_results
echo
cat "$RESULTS"
exit "$failed"
