#!/usr/bin/env bash
# One-call verification on a GPU machine, ordered for a first short visit (about 9 minutes): the
# driver/runtime check, a build of only the targets the GPU steps use, the newest CUDA tests, GPT-2
# 124M throughput and MFU, compute-sanitizer, then the rest (NCCL, the built tests, training against
# the CPU backend, checkpoints, profiles, benchmarks). $OUT/results.md is rewritten after every step,
# so a run cut short still returns what it did. Usage: OUT=/some/dir scripts/gpu-check.sh
# Env: ZT_GPU_CHECK_SECONDS (default 510: the deadline every step is capped by), ZT_JOBS (build
# jobs), ZT_GPU_BUILD (build tree, default build/gpu), ZT_REUSE_BUILD=1 (no configure/build: use the
# tree as it is, e.g. a pre-built one), ZT_SETUP=1 (run scripts/setup first; else only when
# configure fails). Exits non-zero when configure, build, a test, a comparison, the NCCL checks or
# the --cuda-graphs check ($OUT/graphs.txt) failed, after writing the results.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT="${OUT:-out/gpu-check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUILD="${ZT_GPU_BUILD:-build/gpu}"
JOBS="${ZT_JOBS:-16}"
DEADLINE=$((SECONDS + ${ZT_GPU_CHECK_SECONDS:-510}))  # headroom under a 9-10 minute visit for the last kill
RESULTS="$OUT/results.md"
rows=()
notes=()
failed=0

write_results() {
  {
    echo "# gpu-check results"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- gpu: ${gpu_line:-none found}"
    echo "- driver: ${driver_note:-not checked yet}"
    echo "- total time: ${SECONDS}s"
    [[ -n "${ctest_summary:-}" ]] && echo "- ctest: ${ctest_summary}"
    [[ -f "$OUT/configure.log" ]] && echo "- cuDNN attention: $(grep -o 'cuDNN found\|cuDNN attention not built' "$OUT/configure.log" | head -1 || true)"
    local n
    for n in "${notes[@]}"; do echo "- note: $n"; done
    echo
    echo "| step | status | time (s) | log |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    if [[ -s "$OUT/gpt2.md" ]]; then
      echo
      cat "$OUT/gpt2.md"
    fi
  } >"$RESULTS"
}

# run_step NAME MAX_SECONDS LOG CMD...: runs CMD under `timeout` (capped by the deadline), output
# to $OUT/LOG, records a results row and rewrites results.md. Returns CMD's status (124 = timed
# out, 125 = skipped).
run_step() {
  local name=$1 max=$2 log=$3
  shift 3
  local remaining=$((DEADLINE - SECONDS))
  if ((remaining < 15)); then
    rows+=("| $name | skipped (out of time) | 0 | |")
    echo "=== $name: skipped, out of time"
    write_results
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
  write_results
  return $rc
}

skip_step() {
  rows+=("| $1 | skipped ($2) | 0 | |")
  echo "=== $1: skipped ($2)"
  write_results
}

# The targets of NAMES... that this build tree defines (bench_nccl only where NCCL was found).
existing_targets() {
  local all t
  all="$(cmake --build "$BUILD" --target help 2>/dev/null)"
  for t in "$@"; do
    grep -qE "(^|[ .])$t(:|$| )" <<<"$all" && echo "$t"
  done
}

# ---- 1. driver and runtime, first: CUDA 13 needs driver >= 580 --------------------------------
# gpu_ok=1 only when nvidia-smi lists a GPU and its driver can run what CUDA 13 builds; every GPU
# step below skips with this note otherwise.
gpu_ok=0
{
  echo "nvidia-smi: $(command -v nvidia-smi || echo 'not found')"
  nvidia-smi 2>&1 | head -n 20
  echo
  echo "toolkit: $( (command -v nvcc >/dev/null && nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | grep -i release || echo 'nvcc not found')"
} >"$OUT/driver.txt" 2>&1
gpu_line="$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null | head -1 || true)"
driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ' || true)"
if [[ -z "$gpu_line" || -z "$driver" ]]; then
  driver_note="no GPU: nvidia-smi is missing or lists none; every GPU step is skipped"
elif (( ${driver%%.*} < 580 )); then
  driver_note="driver $driver is older than CUDA 13 needs (>= 580): CUDA 13 programs cannot run on it (cudaErrorInsufficientDriver); update the driver to 580 or newer; every GPU step is skipped"
else
  driver_note="driver $driver (CUDA 13 needs >= 580: ok)"
  gpu_ok=1
fi
echo "driver check: $driver_note" | tee -a "$OUT/driver.txt"
rows+=("| driver/runtime | $( ((gpu_ok)) && echo ok || echo 'no usable GPU') | 0 | driver.txt |")
write_results
no_gpu="$( ((gpu_ok)) && echo "" || echo "no usable GPU: see driver.txt")"

# ---- 2. configure + build only what the GPU steps need ----------------------------------------
# First the targets of steps 3-5 (zerotrain, the binaries of the new CUDA tests), then, after
# them, those of the rest (NCCL test, benchmarks, the CPU-backend tests that compare with the GPU).
gpu_targets=(zerotrain test_cuda test_kernels test_gemm test_fused_ops test_classifier test_flash_attention test_tp_ops test_comm test_runtime
             test_optimizers)
rest_targets=(test_nccl test_zero test_mixed_precision test_checkpoint test_resume
              bench_cuda_copy bench_ops bench_comm bench_nccl bench_peer_copy bench_memory)
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
configure() {
  run_step "$1" 120 "$2" cmake -S . -B "$BUILD" "${generator[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DZT_CUDA=ON -DZT_CUDA_ARCHS=90
}
built=0
if [[ "${ZT_REUSE_BUILD:-0}" == 1 && -d "$BUILD" ]]; then
  skip_step "configure + build" "ZT_REUSE_BUILD=1: using $BUILD as it is"
  built=1
else
  [[ "${ZT_SETUP:-0}" == 1 ]] && run_step setup 120 setup.log scripts/setup
  configured=0
  if configure configure configure.log; then
    configured=1
  elif [[ "${ZT_SETUP:-0}" != 1 ]]; then
    # Missing packages are the usual cause on a fresh machine (apt may be unreachable).
    run_step setup 120 setup.log scripts/setup
    configure "configure (after setup)" configure2.log && configured=1
  fi
  if ((configured)); then
    mapfile -t want < <(existing_targets "${gpu_targets[@]}")
    if run_step "build (GPU steps: ${want[*]})" 300 build.log cmake --build "$BUILD" -j "$JOBS" --target "${want[@]}"; then
      built=1
    else
      failed=1
      tail -n 40 "$OUT/build.log"
    fi
  else
    failed=1
    tail -n 40 "$OUT/configure.log"
  fi
fi
app="$BUILD/apps/zerotrain"

# ---- 3. the newest CUDA paths first ---------------------------------------------------------------
if ((built && gpu_ok)); then
  # The newest CUDA paths first, so a short visit still checks them: the tensor-parallel ops, the
  # tiled attention (both GPT models train on it), TF32 GEMMs and the device sum on the GPU against
  # the CPU backend's ops and the float64 references, the classifier's CUB row reductions, and the
  # timing events the step uses, the cuBLAS workspace from the pool and pinned copy buffers, the
  # ring's direct path (accumulate_peer's kernel against the CPU bits, the collectives on cuda:0x4),
  # the cuBLASLt GEMMs (GemmTest: fp32/bf16/fp16 inputs, the BIAS, GELU_AUX_BIAS, DGELU_BGRAD and
  # BGRADB epilogues against float64, ops.cc's fallbacks against the fused ops, and the plain cuBLAS
  # path, ZT_CUBLASLT=off, against cuBLASLt), the pinned, double-buffered snapshot/checkpoint copies
  # (HostStagingTest: every byte both ways at sizes around the chunk, ordered with the stream's
  # work), and the fused/vectorised memory-bound kernels (FusedOpsTest): residual add + layernorm
  # against the CUDA add + layernorm (bits), float64 and bf16/fp16; the two-stage column sums (bias,
  # layernorm dweight/dbias) at C = 768 against float64; matmul_backward's overwrite_din; the
  # 128-bit elementwise/cast paths at odd sizes and unaligned pointers against the scalar bits; and
  # the OpsTest cases whose kernels those paths replaced (layernorm, fill/scale/add, cast, accumulate);
  # and stream capture (GraphOpsTest: a captured GEMM/GELU/backward chain replayed bitwise equal to
  # the same ops run eagerly, a capture broken by a synchronize fails with its reason). Attention:
  # the tiled CUDA kernel on fp32, f16 and bf16 against float64 (FlashAttention*/cuda), and cuDNN's
  # fused SDPA forward/backward against that tiled kernel and the CPU backend at head sizes 64 and
  # 128, T in {1, 7, 64, 257, 1024} (FlashAttentionCuda; it fails if cuDNN is built but declines
  # those shapes; "cuDNN attention:" in results.md says whether it was built). The fused classifier's
  # online-softmax kernel (padded vocabulary; f32, bf16 and f16 logits, 128-bit loads) and the LM
  # head's GEMMs over padded rows against float64 (ClassifierTest). The 16-bit layernorm, LM head, fill, add,
  # GELU and encoder kernels (FusedOpsTest), the tensor-parallel GPT's 16-bit position, bias, ReLU and
  # vocabulary-parallel cross-entropy kernels (TpOpsTest.SixteenBit*), and the optimizer kernels with the clip factor read
  # from device memory plus optim::clip_factor against the host's sum bit for bit (OptimTest).
  run_step new-cuda-ops 60 new-cuda-ops.log ctest --test-dir "$BUILD" --output-on-failure -j 8 --timeout 60 \
    -R '^(Backends/(TpOpsTest\..*|FlashAttention[A-Za-z]*\..*|OpsTest\.(MatmulTf32RoundsInputs|Sum|Classifier[A-Za-z]*|Layernorm|FillScaleAdd|CastMatchesHostConversions|AccumulateMatchesHostRounding)|GemmTest\..*|OptimTest\..*|HostStagingTest\..*|FusedOpsTest\..*|GraphOpsTest\..*|ClassifierTest\..*)/cuda|FlashAttentionCuda\..*|CudaRuntime\..*|AccumulatePeerOnGpu\..*|CommOnGpu\..*)'
  (($? != 0)) && failed=1
else
  skip_step new-cuda-ops "${no_gpu:-build failed}"
fi

# ---- 4. GPT-2 124M at T = 1024 on cuda:0: tokens/s and MFU per precision ---------------------------
# B = 16 sequences of 1024 tokens per step, a few steps each; tokens/s is the median of the steps
# after the first two (warm-up: allocation, cuBLAS heuristics), MFU = flops_per_token x that /
# peak_flops of the summary, whose peak_kind names the peak (fp32, tf32 or bf16 tensor cores).
# Runs: fp32, tf32 and bf16 eager, and bf16 with --cuda-graphs on (the 16-bit GPT captured once per
# micro-batch and replayed; the "graphs" row), each a "precision:mode" entry of gpt2_runs.
gpt2_runs=(fp32:eager tf32:eager bf16:eager bf16:graphs)
if ((built && gpu_ok)) && [[ -x "$app" ]]; then
  gpt2=(train --model gpt2-124m --train-seq-len 1024 --batch-size 16 --micro-batch-size 16 --steps 8
        --eval-every 0 --eval-batches 1 --sample-tokens 0 --quiet --devices cuda:0)
  for run in "${gpt2_runs[@]}"; do
    p="${run%%:*}" mode="${run##*:}"
    flags=(--precision "$p")
    [[ $p == tf32 ]] && flags=(--precision fp32 --tf32)
    [[ $mode == graphs ]] && flags+=(--cuda-graphs on)
    run_step "gpt2-124m T=1024 $p $mode" 90 "gpt2-$p-$mode.txt" "$app" "${gpt2[@]}" "${flags[@]}" \
      --metrics "$OUT/gpt2-$p-$mode.jsonl"
    (($? != 0)) && failed=1
  done
  if command -v python3 >/dev/null 2>&1; then
    python3 - "$OUT" "${gpt2_runs[@]}" >"$OUT/gpt2.md" <<'PY'
import json, os, statistics, sys
out, runs = sys.argv[1], [r.split(":") for r in sys.argv[2:]]
print("## GPT-2 124M, T=1024, B=16, cuda:0\n")
print("| precision | mode | steps | tokens/s (median after 2) | MFU | peak_kind | peak TFLOP/s | run MFU (summary) |")
print("|---|---|---|---|---|---|---|---|")
for p, mode in runs:
    path = os.path.join(out, f"gpt2-{p}-{mode}.jsonl")
    try:
        recs = [json.loads(l) for l in open(path) if l.strip()]
    except (OSError, ValueError) as e:
        print(f"| {p} | {mode} | - | no metrics ({type(e).__name__}) | | | | |"); continue
    steps = [r for r in recs if "event" not in r and "tokens_per_s" in r]
    summ = next((r for r in recs if r.get("event") == "summary"), {})
    tps = statistics.median([r["tokens_per_s"] for r in steps[2:]] or [r["tokens_per_s"] for r in steps] or [0])
    peak, fpt = summ.get("peak_flops"), summ.get("flops_per_token")
    mfu = f"{100 * fpt * tps / peak:.1f}%" if peak and fpt and tps else "n/a"
    run = f"{100 * summ['mfu']:.1f}%" if summ.get("mfu") is not None else "n/a"
    print(f"| {p} | {mode} | {len(steps)} | {tps:,.0f} | {mfu} | {summ.get('peak_kind', '?')} | "
          f"{peak / 1e12 if peak else float('nan'):.0f} | {run} |")
PY
    cat "$OUT/gpt2.md"
    write_results
  fi
else
  skip_step "gpt2-124m T=1024 fp32/tf32/bf16" "${no_gpu:-no binary}"
fi

# ---- 5. compute-sanitizer on a few training steps of a tiny model on cuda:0 -------------------------
# memcheck (out-of-bounds and misaligned accesses, leaks of device memory) and racecheck (shared
# memory hazards inside our kernels); both exit non-zero on the first error report.
sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
if ((built && gpu_ok)) && [[ -x "$app" && -n "$sanitizer" ]]; then
  tiny=(train --steps 3 --batch-size 4 --layers 2 --embd 32 --heads 2 --seq-len 32 --eval-every 0
        --eval-batches 1 --sample-tokens 0 --quiet --devices cuda:0)
  for tool in memcheck racecheck; do
    run_step "compute-sanitizer $tool" 90 "sanitizer-$tool.txt" "$sanitizer" --tool "$tool" --error-exitcode 99 \
      "$app" "${tiny[@]}"
    (($? != 0)) && failed=1
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.txt" | tail -n 2
  done
elif ((built && gpu_ok)); then
  skip_step "compute-sanitizer" "compute-sanitizer not found (not in PATH or /usr/local/cuda/bin)"
else
  skip_step "compute-sanitizer" "${no_gpu:-no binary}"
fi

# ---- 5b. --cuda-graphs: a few bf16 ZeRO-2 steps of a small GPT on cuda:0 (16-bit activations; the
# stage-2 gradient buckets are the engine buffers a replay checks the addresses of) (4 micro-batches per step:
# warm-up, capture, replays) with --cuda-graphs on and off; the per-step losses must be bitwise equal
# (a replay launches the same kernels with the same arguments). One PASS/FAIL line in
# $OUT/graphs.txt, with both runs' tokens/s.
if ((built && gpu_ok)) && [[ -x "$app" ]]; then
  gc=(train --steps 6 --batch-size 8 --micro-batch-size 2 --layers 2 --embd 64 --heads 2 --eval-every 0
      --eval-batches 1 --sample-tokens 0 --quiet --devices cuda:0 --zero-stage 2 --precision bf16)
  for g in off on; do
    run_step "train cuda:0 --cuda-graphs $g" 90 "train-graphs-$g.txt" "$app" "${gc[@]}" \
      --cuda-graphs "$g" --log-format json --metrics "$OUT/train-graphs-$g.jsonl"
  done
  if command -v python3 >/dev/null 2>&1; then
    run_step "compare --cuda-graphs on vs off" 30 graphs.txt python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def records(name):
    with open(os.path.join(out, name)) as f:
        rows = [json.loads(l) for l in f if l.startswith("{")]
    return [r["loss"] for r in rows if "event" not in r], next((r for r in rows if r.get("event") == "summary"), {})
try:
    (off, soff), (on, son) = records("train-graphs-off.jsonl"), records("train-graphs-on.jsonl")
except OSError as e:
    print(f"FAIL --cuda-graphs on vs off on cuda:0: {e}"); sys.exit(1)
same = len(on) == len(off) > 0 and all(a == b for a, b in zip(on, off)) and son.get("cuda_graphs") is True
print(f"{'PASS' if same else 'FAIL'} --cuda-graphs on vs off on cuda:0: {len(on)} and {len(off)} steps, losses "
      f"{'bitwise equal' if all(a == b for a, b in zip(on, off)) else 'differ: ' + str(list(zip(on, off))[:4])}, "
      f"graphs used {son.get('cuda_graphs')}, tokens/s on {son.get('tokens_per_s', 0):.0f} off {soff.get('tokens_per_s', 0):.0f}")
sys.exit(0 if same else 1)
PY
    (($? != 0)) && failed=1
    cat "$OUT/graphs.txt"
  fi
else
  skip_step "--cuda-graphs on vs off" "${no_gpu:-no binary}"
fi

# ---- 6. the rest: build its targets, then NCCL, the built tests, training vs CPU, benchmarks ------
if ((built)) && [[ "${ZT_REUSE_BUILD:-0}" != 1 ]]; then
  mapfile -t want < <(existing_targets "${rest_targets[@]}")
  run_step "build (the rest: ${want[*]})" 240 build-rest.log cmake --build "$BUILD" -j "$JOBS" --target "${want[@]}" ||
    failed=1
fi
# Not a GPU: the remaining steps run only what needs no GPU (the built tests, whose CUDA cases skip).
if ((!gpu_ok)); then built_gpu=0; else built_gpu=$built; fi

# ---- 6a. --comm nccl, before the built tests: the NCCL communicator
# against the ring (test_nccl: one rank bit for bit, every GPU as a rank on exact sums), then a few
# ZeRO-3 training steps on cuda:0 with --comm nccl and --comm ring, whose per-step losses must be
# equal (one rank: NCCL's collectives move nothing). One PASS/FAIL line per check in $OUT/nccl.txt.
if ((built_gpu)); then
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
else
  skip_step "nccl vs ring" "${no_gpu:-no binary}"
fi

# ---- 6b. devices as zerotrain sees them -------------------------------------------------------
if ((built_gpu)) && [[ -x "$app" ]]; then
  run_step "zerotrain info --devices all" 60 info-all.txt "$app" info --devices all
  cat "$OUT/info-all.txt"
  run_step "zerotrain info --devices cuda:0x4" 60 info-cuda0x4.txt "$app" info --devices cuda:0x4
  cat "$OUT/info-cuda0x4.txt"
else
  skip_step "zerotrain info" "${no_gpu:-no binary}"
fi

# ---- 6c. training on the GPU vs the CPU backend, step by step --------------------------------
# The same gpt-tiny run (one device, then 4 logical devices at ZeRO stage 3 on GPU 0) on CUDA and
# on the simulated CPU devices; the losses must agree to fp32 rounding (cuBLAS vs OpenBLAS
# summation order), and the ZeRO-3 run must match the 1-device run.
if ((built_gpu)) && [[ -x "$app" ]]; then
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
  skip_step "train on GPU" "${no_gpu:-no binary}"
fi

# ---- 6d. mixed precision on the GPU vs the CPU backend's emulation, step by step ------------
# bf16 and fp16 (dynamic loss scale) runs of gpt-tiny on cuda:0 and cpu:1: 16-bit storage and
# rounding are bit-identical, the GEMMs are not, so the losses agree to bf16/fp16 tolerances.
if ((built_gpu)) && [[ -x "$app" ]]; then
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
# fp16: the bound tests/README.md derives ("End-to-end"): (1 + r) * D16 with r = 2 vendor roundings
# and D16 the CPU backend's bf16-vs-fp32 sensitivity (4.54e-2, the step-12 batch) scaled to fp16's
# unit roundoff (x 1/8): 1.7e-2. The first GPU run measured 5.5e-3 (the old 5e-3 was a guess).
for p, tol in (("bf16", 3e-2), ("fp16", 1.7e-2)):
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

# ---- 6e. checkpoints across backends: save on the GPU, load on the CPU backend (another device
# count and stage) and save again, load back on the GPU and save again; every array bitwise equal.
if ((built_gpu)) && [[ -x "$app" ]]; then
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

# ---- 6f. the tests of the binaries built above (the CUDA cases skip without a GPU) ---------------
# Labels are the binaries' names: tests of binaries this visit did not build are not run.
mapfile -t built_tests < <(for t in "${gpu_targets[@]}" "${rest_targets[@]}"; do
  [[ $t == test_* && -x "$BUILD/tests/$t" ]] && echo "$t"; done)
if ((built)) && ((${#built_tests[@]} > 0)); then
  labels="^($(IFS='|'; echo "${built_tests[*]}"))\$"
  run_step "ctest (${built_tests[*]})" 240 ctest.log ctest --test-dir "$BUILD" --output-on-failure -j 8 --timeout 180 \
    -L "$labels" --output-junit "$OUT/ctest-junit.xml"
  rc=$?
  ((rc != 0)) && failed=1
  ctest_summary="$(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
  skipped_cuda="$(grep -cE 'Test +#[0-9]+: (Cuda(Runtime|Cast)\.|.*/cuda ).*Skipped' "$OUT/ctest.log" || true)"
  if ((skipped_cuda > 0)); then
    notes+=("${skipped_cuda} CUDA tests were skipped: no usable GPU in this run (see ctest.log)")
  fi
  write_results
  grep -E 'tests passed|tests failed|\(Failed\)|\(Timeout\)|\*\*\*' "$OUT/ctest.log" |
    grep -v 'Skipped' | tail -n 30
else
  skip_step ctest "no test binary built"
fi

# ---- 7. profiling artefacts: a Chrome trace from the CUDA backend, an nsys capture ----------
if ((built_gpu)) && [[ -x "$app" ]]; then
  prof=(train --steps 12 --batch-size 8 --eval-every 0 --eval-batches 1 --sample-tokens 0 --quiet --devices cuda:0x2)
  run_step "trace cuda:0x2" 120 trace-cuda.txt "$app" "${prof[@]}" --trace "$OUT/trace-cuda.json"
  if command -v nsys >/dev/null 2>&1; then
    run_step "nsys profile" 180 nsys.txt nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop \
      -t cuda,nvtx -o "$OUT/zt-profile" --force-overwrite true "$app" "${prof[@]}" --profile-steps 5:7
  else
    skip_step "nsys profile" "nsys not installed"
  fi
else
  skip_step "profiling" "${no_gpu:-no binary}"
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
  if ((!gpu_ok)) && [[ $b == bench_cuda_copy || $b == bench_nccl ]]; then
    skip_step "$b" "$no_gpu"
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
