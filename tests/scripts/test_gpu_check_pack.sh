#!/usr/bin/env bash
# CI test of `scripts/gpu-check.sh --pack` without a GPU: a tiny fake pack (a real ELF "zerotrain"
# that needs libcudart.so.13 and a carried library) and a fake toolkit + wheel tree. Checks the
# unpacking (ctest's files rewritten to the unpack folder), the library discovery (the exact
# LD_LIBRARY_PATH: toolkit first, then <site>/nvidia/*/lib, carried libraries only where the system
# lacks them), ldd's "not found" check, the missing-GPU and old-driver sentences and exit codes, and
# the per-op, GPT-2 and benchmark tables, the sanitizer summary and compare_generate.py on synthetic
# inputs, and the PyTorch peer on a tiny CPU model where PyTorch is installed, and (given zerotrain)
# that every zerotrain call gpu-check makes parses and passes its checks. Usage: test_gpu_check_pack.sh [ZEROTRAIN]
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CHECK="$ROOT/scripts/gpu-check.sh"
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT
fails=0
ok() { echo "ok: $1"; }
bad() { echo "FAIL: $1"; fails=$((fails + 1)); }
expect() {  # expect NAME WANT GOT
  if [[ "$3" == "$2" ]]; then ok "$1"; else bad "$1: want '$2', got '$3'"; fi
}
contains() {  # contains NAME NEEDLE FILE
  if grep -qF -- "$2" "$3"; then ok "$1"; else bad "$1: '$2' not in $3:"; sed 's/^/    /' "$3"; fi
}
CC="${CC:-cc}"
command -v "$CC" >/dev/null || CC=gcc

# ---- the fake pack ---------------------------------------------------------------------------------
S="$T/stage"
FAKE_ROOT="/nonexistent-zt-build-root-$$/zt"
mkdir -p "$S/.pack/lib" "$S/build/release/apps" "$S/build/release/tests" "$T/so"
echo 'int zt_fake_cudart(void) { return 13; }' >"$T/so/cudart.c"
echo 'int zt_fake_carried(void) { return 7; }' >"$T/so/carried.c"
printf 'int zt_fake_cudart(void); int zt_fake_carried(void);\nint main(void) { return zt_fake_cudart() + zt_fake_carried() == 20 ? 0 : 1; }\n' >"$T/so/main.c"
"$CC" -shared -fPIC -o "$T/so/libcudart.so.13" -Wl,-soname,libcudart.so.13 "$T/so/cudart.c" &&
  "$CC" -shared -fPIC -o "$S/.pack/lib/libzt_fake_carried.so.7" -Wl,-soname,libzt_fake_carried.so.7 "$T/so/carried.c" &&
  "$CC" -o "$S/build/release/apps/zerotrain" "$T/so/main.c" "$T/so/libcudart.so.13" \
    "$S/.pack/lib/libzt_fake_carried.so.7" || { echo "FAIL: cannot compile the fake binaries with $CC"; exit 1; }
# A library every Linux has: carried, but not put on the path (the system's copy serves).
libc_name="$(ldd "$S/build/release/apps/zerotrain" | awk '/libc\.so/ { print $1 }')"
echo "not a real library" >"$S/.pack/lib/$libc_name"
cat >"$S/.pack/manifest" <<M
root=$FAKE_ROOT
build=build/release
commit=abc1234
created=2026-12-04 00:00:00 UTC
cuda_archs=80;90
M
# ctest's files as gtest_discover_tests (PRE_TEST) writes them: the include file rediscovers (with
# a CMake module only the build machine has) unless the list is no older than it and the binary.
B="$FAKE_ROOT/build/release"
printf 'subdirs("tests")\n' >"$S/build/release/CTestTestfile.cmake"
cp "$S/build/release/apps/zerotrain" "$S/build/release/tests/test_x"
cat >"$S/build/release/tests/test_x[1]_include.cmake" <<C
if(EXISTS "$B/tests/test_x")
  if(NOT EXISTS "$B/tests/test_x[1]_tests.cmake" OR
     NOT "$B/tests/test_x[1]_tests.cmake" IS_NEWER_THAN "$B/tests/test_x" OR
     NOT "$B/tests/test_x[1]_tests.cmake" IS_NEWER_THAN "\${CMAKE_CURRENT_LIST_FILE}")
    include("/nonexistent-build-machine-cmake/GoogleTestAddTests.cmake")
  endif()
  include("$B/tests/test_x[1]_tests.cmake")
else()
  add_test(test_x_NOT_BUILT test_x_NOT_BUILT)
endif()
C
printf 'include("%s")\n' "$B/tests/test_x[1]_include.cmake" >"$S/build/release/tests/CTestTestfile.cmake"
sleep 1  # the list newer than the binary and the include file, as after `ctest -N`
echo "add_test(t \"$B/tests/test_x\" WORKING_DIRECTORY \"$B/tests\")" >"$S/build/release/tests/test_x[1]_tests.cmake"
tar -cJf "$T/pack.tar.xz" -C "$S" .

# ---- the fake toolkit (cudart only) and wheels (the rest; cudart too, which the toolkit wins) --------
mkdir -p "$T/cuda/lib64" "$T/site/nvidia/cu13/lib" "$T/site/nvidia/cudnn/lib" "$T/site/nvidia/nccl/lib" \
  "$T/site/nvidia/unrelated/lib"
cp "$T/so/libcudart.so.13" "$T/cuda/lib64/"
cp "$T/so/libcudart.so.13" "$T/site/nvidia/cu13/lib/"
for f in libcublas.so.13 libcublasLt.so.13 libnvrtc.so.13; do touch "$T/site/nvidia/cu13/lib/$f"; done
touch "$T/site/nvidia/cudnn/lib/libcudnn.so.9" "$T/site/nvidia/cudnn/lib/libcudnn_graph.so.9" \
  "$T/site/nvidia/nccl/lib/libnccl.so.2" "$T/site/nvidia/unrelated/lib/libother.so.1"

run() {  # run NAME ARGS...: gpu-check with the fakes; output in $T/NAME.out, status in $T/NAME.rc
  local name=$1
  shift
  env -u LD_LIBRARY_PATH OUT="$T/out-$name" ZT_GPU_LOGS="$T/logs-$name" ZT_CUDA_HOME="$T/cuda" \
    ZT_SITE_PACKAGES="$T/site" ZT_NVIDIA_SMI="$T/no-nvidia-smi" "$@" >"$T/$name.out" 2>&1
  echo $? >"$T/$name.rc"
}

# 1. --discover-only: unpack, discovery, ldd.
U="$T/unpacked dir"
run discover "$CHECK" --pack "$T/pack.tar.xz" --pack-dir "$U" --discover-only
expect "discover-only exits 0" 0 "$(cat "$T/discover.rc")"
contains "the LD_LIBRARY_PATH: carried, toolkit, then one folder per wheel" \
  "LD_LIBRARY_PATH=$U/.pack/ld:$T/cuda/lib64:$T/site/nvidia/cu13/lib:$T/site/nvidia/cudnn/lib:$T/site/nvidia/nccl/lib" \
  "$T/discover.out"
contains "every family named with its folder" "libcudart: $T/cuda/lib64, libcublas: $T/site/nvidia/cu13/lib" "$T/discover.out"
contains "ldd check passes" "ldd zerotrain: every library found" "$T/discover.out"
[[ -L "$U/.pack/ld/libzt_fake_carried.so.7" ]] && ok "a carried library the system lacks is on the path" ||
  bad "libzt_fake_carried.so.7 not linked into .pack/ld"
[[ ! -e "$U/.pack/ld/$libc_name" ]] && ok "a carried library the system has ($libc_name) is not" ||
  bad "$libc_name shadows the system's"
contains "ctest's files name the unpack folder" "include(\"$U/build/release/tests/test_x[1]_include.cmake\")" \
  "$U/build/release/tests/CTestTestfile.cmake"
contains "discovery files too" "WORKING_DIRECTORY \"$U/build/release/tests\"" "$U/build/release/tests/test_x[1]_tests.cmake"
if command -v ctest >/dev/null; then
  (cd "$T" && ctest --test-dir "$U/build/release" -N >"$T/ctest-n.out" 2>&1)
  expect "ctest lists the unpacked tests without rediscovering" 0 "$?"
  contains "the listed test" "Test #1: t" "$T/ctest-n.out"
fi
LD_LIBRARY_PATH="$(sed -n 's/^LD_LIBRARY_PATH=//p' "$T/discover.out")" "$U/build/release/apps/zerotrain" &&
  ok "the fake zerotrain runs under that path" || bad "the fake zerotrain does not run under that path"

# 2. A library found nowhere (a pack without its carried library): the sentence and exit 4.
rm "$S/.pack/lib/libzt_fake_carried.so.7" "$T/cuda/lib64/libcudart.so.13"
tar -cJf "$T/pack2.tar.xz" -C "$S" .
run missing "$CHECK" --pack "$T/pack2.tar.xz" --pack-dir "$U" --discover-only
expect "a missing library exits 4" 4 "$(cat "$T/missing.rc")"
contains "its sentence" "zerotrain cannot load: libzt_fake_carried.so.7 not found" "$T/missing.out"
contains "cudart from the wheels once the toolkit lacks it" "libcudart: $T/site/nvidia/cu13/lib," "$T/missing.out"
rm "$T/site/nvidia/nccl/lib/libnccl.so.2"
run missing2 "$CHECK" --pack "$T/pack2.tar.xz" --pack-dir "$U" --discover-only
contains "a family found nowhere is named" "libnccl: NOT FOUND" "$T/missing2.out"

# 3. No GPU driver: the sentence and exit 3, before unpacking.
run nogpu "$CHECK" --pack "$T/pack.tar.xz" --pack-dir "$T/never"
expect "no nvidia-smi exits 3" 3 "$(cat "$T/nogpu.rc")"
contains "its sentence" "gpu-check.sh: no usable GPU: nvidia-smi is missing or lists no GPU (no NVIDIA driver on this machine)" \
  "$T/nogpu.out"
[[ ! -e "$T/never" ]] && ok "nothing unpacked without a GPU" || bad "unpacked without a GPU"
contains "results.md says so" "| driver/runtime | no usable GPU |" "$T/out-nogpu/results.md"
printf '#!/bin/sh\ncase "$*" in *name,driver*) echo "NVIDIA H200, 570.10, 143771 MiB, 9.0";; *driver_version*) echo 570.10;; esac\n' \
  >"$T/old-smi"
chmod +x "$T/old-smi"
run oldgpu env ZT_NVIDIA_SMI="$T/old-smi" "$CHECK" --pack "$T/pack.tar.xz" --pack-dir "$T/never"
expect "an old driver exits 3" 3 "$(cat "$T/oldgpu.rc")"
contains "its sentence" "no usable GPU: driver 570.10 is older than CUDA 13 needs (>= 580)" "$T/oldgpu.out"

# 4. Bad input.
run nofile "$CHECK" --pack "$T/no-such.tar.xz"
expect "a missing pack exits 2" 2 "$(cat "$T/nofile.rc")"
contains "its sentence" "--pack $T/no-such.tar.xz: no such file" "$T/nofile.out"
run badarg "$CHECK" --bogus
expect "an unknown argument exits 2" 2 "$(cat "$T/badarg.rc")"
mkdir -p "$T/precious" && touch "$T/precious/keep"
run precious "$CHECK" --pack "$T/pack.tar.xz" --pack-dir "$T/precious" --discover-only
expect "a non-empty --pack-dir that is no earlier unpack exits 2" 2 "$(cat "$T/precious.rc")"
[[ -e "$T/precious/keep" ]] && ok "and is left alone" || bad "a foreign --pack-dir was emptied"

# 5. The per-op table: 4 device steps, each ending with adamw_multi; the host runs one step ahead.
python3 - "$T/trace.json" <<'PY'
import json, sys
ev, t = [], 0.0
for step in range(1, 5):
    ev.append({"ph": "X", "cat": "step", "name": f"step {step}", "pid": 1000, "tid": 100, "ts": t, "dur": 10})
    for name, dur, calls in (("lm_head_forward", 2000 + 1000 * step, 1), ("layernorm_backward", 50, 25),
                             ("adamw_multi", 100, 1)):
        for _ in range(calls):
            ev.append({"ph": "X", "cat": "stream", "name": name, "pid": 0, "tid": 0, "ts": t + 500, "dur": dur})
            t += dur
    t += 10
ev.append({"ph": "X", "cat": "step", "name": "eval", "pid": 1000, "tid": 100, "ts": t, "dur": 10})
ev.append({"ph": "X", "cat": "stream", "name": "lm_head_forward", "pid": 0, "tid": 0, "ts": t + 1, "dur": 99999})
json.dump({"traceEvents": ev}, open(sys.argv[1], "w"))
PY
python3 "$ROOT/scripts/op_table.py" "$T/trace.json" >"$T/ops.md" 2>&1
expect "op_table exits 0" 0 "$?"
# Steps 3-4: lm_head_forward (5000 + 6000) / 2 us = 5.5 ms (missed), layernorm_backward 25 x 50 us = 1.25 ms.
contains "lm_head_forward per step, eval left out" "| lm_head_forward | 5.500 | 1 |" "$T/ops.md"
contains "its budget" "<= 2.5 ms: MISSED" "$T/ops.md"
contains "all calls of layernorm_backward" "| layernorm_backward | 1.250 | 25 |" "$T/ops.md"
contains "unmeasured budgets named" "| encoder_backward | - | 0 | - | <= 0.5 ms: not in the trace |" "$T/ops.md"
# The device idles 10 us after each step's adamw_multi (the host enqueued the next step late).
contains "idle time per step" "Idle (no op on any of the device's streams): 0.010 ms/step, 0.1% of the step, in 1 gaps/step; most between adamw_multi -> lm_head_forward (1 gaps, 10.0 us); the longest 10.0 us (adamw_multi -> lm_head_forward)." "$T/ops.md"
python3 "$ROOT/scripts/op_table.py" "$T/trace.json" --steps 1:1 >"$T/ops1.md" 2>&1
contains "--steps 1:1" "| lm_head_forward | 3.000 | 1 |" "$T/ops1.md"
python3 "$ROOT/scripts/op_table.py" "$T/trace.json" --estimate bf16 >"$T/ops-est.md" 2>&1
expect "op_table --estimate exits 0" 0 "$?"
contains "an op above its estimate" "| lm_head_forward | 5.500 | 1 | 80.3% | <= 2.5 ms: MISSED | 2 (1.8-2.6): above |" "$T/ops-est.md"
contains "an op below its estimate" "| adamw_multi | 0.100 | 1 | 1.5% |  | 1.1 (0.9-1.27): below |" "$T/ops-est.md"
contains "the step against the estimate" "estimated 31 (29-35): below." "$T/ops-est.md"
python3 "$ROOT/scripts/op_table.py" "$T/trace.json" --estimate fp64 >/dev/null 2>&1
expect "an unknown --estimate exits 2" 2 "$?"
# The estimate is an H200's: a trace from another GPU (its process_name) gets one line saying so.
python3 - "$T/trace.json" "$T/trace-h100.json" "$T/trace-h200.json" <<'PY'
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
for path, gpu in ((sys.argv[2], "NVIDIA H100 80GB HBM3"), (sys.argv[3], "NVIDIA H200")):
    meta = {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": f"cuda:0 ({gpu}, compute capability 9.0, 132 SMs)"}}
    json.dump({"traceEvents": [meta] + ev}, open(path, "w"))
PY
python3 "$ROOT/scripts/op_table.py" "$T/trace-h100.json" --estimate bf16 >"$T/ops-h100.md" 2>&1
expect "op_table --estimate on an H100's trace exits 0" 0 "$?"
contains "another GPU than the estimate's named, with the bandwidth ratio" \
  "Note: the estimate is for an H200; this trace ran on cuda:0 (NVIDIA H100 80GB HBM3, compute capability 9.0, 132 SMs) (3.35 against 4.8 TB/s of memory bandwidth: memory-bound ops up to 1.43x the estimate" \
  "$T/ops-h100.md"
python3 "$ROOT/scripts/op_table.py" "$T/trace-h200.json" --estimate bf16 >"$T/ops-h200.md" 2>&1
if grep -q "^Note: the estimate" "$T/ops-h200.md"; then bad "an H200's trace got the other-GPU note"; else ok "an H200's trace gets no other-GPU note"; fi

# 6. The sanitizer summary: one hazard in a ZeroTrain kernel, one in cuDNN's, apart.
cat >"$T/race.txt" <<'LOG'
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at cudnn_generated_fort_native_sdpa_sm90_flash_bprop_kernel0_0+0x1a30 in unknown and Read access at cudnn_generated_fort_native_sdpa_sm90_flash_bprop_kernel0_0+0x1b00 [1024 hazards]
=========
========= Error: Race reported between Write access at void zt::cuda_ops::(anonymous namespace)::ln_kernel<float>(float *)+0x220 in /w/norm_loss_ops.cu:312
=========     and Read access at void zt::cuda_ops::(anonymous namespace)::ln_kernel<float>(float *)+0x300 in /w/norm_loss_ops.cu:330 [4 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
LOG
python3 "$ROOT/scripts/sanitizer_summary.py" "$T/race.txt" --tool racecheck >"$T/race.out" 2>&1
expect "a finding in ours exits 1" 1 "$?"
contains "counted apart" "racecheck: 1 finding(s) in ZeroTrain's kernels, 1 in library kernels (cudnn_generated_fort_native_sdpa_sm90_flash_bprop_kernel0_0 x1), 0 API error(s)" "$T/race.out"
sed -i '/zt::/d' "$T/race.txt"
python3 "$ROOT/scripts/sanitizer_summary.py" "$T/race.txt" --tool racecheck >"$T/race2.out" 2>&1
expect "library findings alone exit 0" 0 "$?"
# initcheck: a library kernel's read (counted apart); ours named by a CUB template or only by a
# source file of our tree (-lineinfo, no kernel name); a cudaMemcpy of bytes nothing wrote (a host
# API access: ZeroTrain's call, so it fails the step like an API error).
cat >"$T/init.txt" <<'LOG'
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64+0x7f0
=========     by thread (3,0,0) in block (0,0,0)
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: zt::cuda_ops::lt_matmul_forward(void*) [0x4c56c7] in zerotrain
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x88 in /w/kernels/cuda/flash_attention.cu:133
=========     by thread (0,0,0) in block (0,0,0)
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void cub::CUB_300000_SM_900_NS::DeviceRadixSortOnesweepKernel<int>(int *)+0x3640
=========
========= Host API uninitialized memory access
=========     Uninitialized access at 0x7f3c7ec00000 on access by cudaMemcpy source.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: zt::cuda::CudaStream::copy(void*, void const*, unsigned long) [0x2fc5d0] in zerotrain
=========
========= ERROR SUMMARY: 4 errors
LOG
python3 "$ROOT/scripts/sanitizer_summary.py" "$T/init.txt" --tool initcheck >"$T/init.out" 2>&1
expect "findings of ours exit 1" 1 "$?"
contains "ours by name or source file, a host copy as an API error" "initcheck: 2 finding(s) in ZeroTrain's kernels, 1 in library kernels (sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64 x1), 1 API error(s); ERROR SUMMARY: 4 errors" "$T/init.out"
contains "the host copy listed" "  api: Host API uninitialized memory access / Uninitialized access at 0x7f3c7ec00000 on access by cudaMemcpy source." "$T/init.out"

# 7. The GPT-2 table against issue 28's targets: synthetic metrics of five runs (steps 1-2 are
# warm-up and left out of the median; ZeRO-3 on cuda:0x2 is the fastest but not a cuda:0 run, so not
# the "best") and a peer file with torch.compile and tf32.
python3 - "$T/gpt2" <<'PY'
import json, os, sys
d = sys.argv[1]
os.makedirs(d)
runs = {("bf16", "eager"): [1e3, 2e3, 5e5, 5.2e5, 5.1e5], ("bf16", "graphs"): [1e3, 1e3, 4.9e5, 4.9e5, 4.9e5],
        ("tf32", "auto"): [1e3, 1e3, 1.2e5, 1.2e5, 1.2e5], ("bf16", "offload"): [1e3, 1e3, 4e5, 4e5, 4e5],
        ("bf16", "zero3-x2"): [1e3, 1e3, 6e5, 6e5, 6e5]}
for (p, m), tps in runs.items():
    with open(os.path.join(d, f"gpt2-{p}-{m}.jsonl"), "w") as f:
        for i, x in enumerate(tps):
            f.write(json.dumps({"step": i + 1, "loss": 11.0 - 0.5 * i, "tokens_per_s": x}) + "\n")
        # The plan within 5% of the pool peak, except offload's second device (6% under); tf32 without the fields.
        mem = {} if p == "tf32" else {"peak_bytes_per_device": [9 * 2**30, 10 * 2**30],
                                       "planned_peak_bytes_per_device": [int(9.2 * 2**30), (94 if m == "offload" else 100) * 2**30 // 10]}
        f.write(json.dumps({"event": "summary", "flops_per_token": 1e9, "peak_flops": 1e15, "peak_kind": "bf16",
                            "cuda_graphs": m == "graphs", **mem}) + "\n")
with open(os.path.join(d, "peer.jsonl"), "w") as f:
    f.write(json.dumps({"peer": "pytorch", "precision": "bf16", "mode": "compile", "status": "ok", "tokens_per_s": 4.8e5,
                        "step_ms": 34.1, "first_step_s": 60.0, "torch": "2.11"}) + "\n")
    f.write(json.dumps({"peer": "pytorch", "precision": "tf32", "mode": "eager", "status": "ok", "tokens_per_s": 1.6e5,
                        "step_ms": 102.0, "first_step_s": 2.0, "torch": "2.11"}) + "\n")
    f.write(json.dumps({"peer": "pytorch", "precision": "bf16", "mode": "eager", "status": "failed",
                        "why": "exit 1: out of memory", "torch": "2.11"}) + "\n")
PY
python3 "$ROOT/scripts/gpt2_table.py" "$T/gpt2" bf16:eager bf16:graphs tf32:auto bf16:offload bf16:offload-delay bf16:zero3-x2 \
  --peer "$T/gpt2/peer.jsonl" >"$T/gpt2.md" 2>&1
expect "gpt2_table exits 0" 0 "$?"
contains "median after the warm-up" "| bf16 | eager | 5 | 510,000 | 51.0% | bf16 | 1000 |" "$T/gpt2.md"
contains "a run without metrics" "| bf16 | offload-delay | - | no metrics (FileNotFoundError) |" "$T/gpt2.md"
contains "the peer's failed mode" "| bf16 | eager | - | - | - | - | failed: exit 1: out of memory |" "$T/gpt2.md"
contains "the fastest bf16 run" "| bf16 >= 480,000 tokens/s (its fastest run without offload) | 510,000 | ok |" "$T/gpt2.md"
contains "ratio to torch.compile" "| bf16 >= 1.0x torch.compile on this GPU | 1.06x (510,000 / 480,000) | ok |" "$T/gpt2.md"
contains "graphs slower than eager" "| --cuda-graphs on >= eager | 0.961x | MISSED |" "$T/gpt2.md"
contains "tf32 against PyTorch" "| --tf32 >= 0.8x PyTorch tf32 eager on this GPU | 0.75x (120,000 / 160,000) | MISSED |" "$T/gpt2.md"
contains "offload's cost" "| bf16 offload within 20% of bf16 without offload | 0.78x (22% slower) | MISSED |" "$T/gpt2.md"
contains "a target without numbers" "| bf16 offload-delay within 20% of bf16 without offload | not measured | - |" "$T/gpt2.md"
contains "graphs' losses bitwise equal to eager's" \
  "| --cuda-graphs on bitwise equal to eager (bf16, per-step losses) | 5 of 5 steps' losses equal (5 with graphs), graphs used: True | ok |" \
  "$T/gpt2.md"
contains "ZeRO-3 on cuda:0x2 against cuda:0 eager" \
  "| bf16 ZeRO-3 on cuda:0x2 within 2% of cuda:0 (both eager) | 1.176x (600,000 / 510,000) | ok |" "$T/gpt2.md"
contains "the plan against the pool peak" "| bf16 | eager | 9.20 | 9.00 | 1.022 | ok |" "$T/gpt2.md"
contains "a plan 6% under" "| bf16 | offload | 9.40 | 10.00 | 0.940 | MISSED |" "$T/gpt2.md"
contains "a summary without the plan" "| tf32 | auto | - | - | - | not in the summary |" "$T/gpt2.md"
sed -i '4s/"loss": [0-9.]*/"loss": 9.25/' "$T/gpt2/gpt2-bf16-graphs.jsonl"
python3 "$ROOT/scripts/gpt2_table.py" "$T/gpt2" bf16:eager bf16:graphs >"$T/gpt2-differ.md" 2>&1
contains "one step's loss differs" \
  "| --cuda-graphs on bitwise equal to eager (bf16, per-step losses) | 4 of 5 steps' losses equal (5 with graphs), graphs used: True | MISSED |" \
  "$T/gpt2-differ.md"

# 8. bench/peer_gpt2_torch.py on the CPU, tiny, where a Python here has PyTorch (Debian's
# python3-torch: scripts/setup --peer); skipped otherwise.
torch_py=""
for py in python3 /usr/bin/python3; do
  if "$py" -c 'import torch' >/dev/null 2>&1; then torch_py=$py; break; fi
done
if [[ -n $torch_py ]]; then
  "$torch_py" "$ROOT/bench/peer_gpt2_torch.py" --device cpu --tiny --modes fp32:eager,bf16:eager,tf32:eager --steps 3 \
    --out "$T/peer.jsonl" >"$T/peer.out" 2>&1
  expect "the peer exits 0 on the CPU" 0 "$?"
  python3 - "$T/peer.jsonl" >"$T/peer.check" 2>&1 <<'PY'
import json, math, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
by = {(r["precision"], r["mode"]): r for r in recs}
fp32 = by[("fp32", "eager")]
# A fresh tiny GPT's first loss is about ln(vocab): the step trains the model it claims to.
assert fp32["status"] == "ok" and abs(fp32["losses"][0] - math.log(fp32["vocab"])) < 0.1, fp32
assert fp32["losses"][-1] < fp32["losses"][0], fp32
assert by[("bf16", "eager")]["status"] == "ok" and by[("bf16", "eager")]["tokens_per_s"] > 0
assert by[("tf32", "eager")]["status"] == "unavailable"
print("peer records ok")
PY
  contains "the peer's records" "peer records ok" "$T/peer.check"
  "$torch_py" "$ROOT/bench/peer_gpt2_torch.py" --device cpu --tiny --modes bf16:lazy >"$T/peer-bad.out" 2>&1
  expect "a bad mode exits 2" 2 "$?"
  contains "with one sentence" "mode 'bf16:lazy' is not PRECISION:MODE" "$T/peer-bad.out"
else
  echo "skip: no Python here imports torch (scripts/setup --peer): bench/peer_gpt2_torch.py not run"
fi

# 9. The benchmark table: a GEMM over and one under issue 28's 550 TFLOP/s, an attention layer
# (FLOP/s, microseconds), a benchmark that skipped without a GPU, an aggregate row left out.
cat >"$T/bench.json" <<'JSON'
{"benchmarks": [
 {"name": "BM_Gemm/cuda/lm_head_768x50304/forward/real_time", "run_type": "iteration", "real_time": 2.3,
  "time_unit": "ms", "TFLOP/s": 551.2, "label": "cuda:0 bf16 N=16384"},
 {"name": "BM_Gemm/cuda/c_fc_768x3072/dW/real_time", "run_type": "iteration", "real_time": 0.31,
  "time_unit": "ms", "TFLOP/s": 250.0, "label": "cuda:0 bf16 N=16384"},
 {"name": "BM_Gpt2Attention/cuda/bf16/real_time", "run_type": "iteration", "real_time": 1500.0,
  "time_unit": "us", "FLOP/s": 2.5e14, "label": "cuda:0 B=16 T=1024"},
 {"name": "BM_Gpt2Attention/cuda/tf32/real_time", "run_type": "iteration", "error_occurred": true,
  "error_message": "no CUDA device", "real_time": 0, "time_unit": "ms"},
 {"name": "BM_Gpt2Attention/cuda/bf16/real_time_mean", "run_type": "aggregate", "real_time": 9, "time_unit": "ms"}
]}
JSON
python3 "$ROOT/scripts/bench_table.py" "$T/bench.json" --title "## t" >"$T/bench.md" 2>&1
expect "bench_table exits 0" 0 "$?"
contains "a GEMM at target" "| BM_Gemm/cuda/lm_head_768x50304/forward | 2.300 | 551.2 | cuda:0 bf16 N=16384 | >= 550: ok |" "$T/bench.md"
contains "a GEMM under it" "| BM_Gemm/cuda/c_fc_768x3072/dW | 0.310 | 250.0 | cuda:0 bf16 N=16384 | >= 550: MISSED |" "$T/bench.md"
contains "FLOP/s and microseconds" "| BM_Gpt2Attention/cuda/bf16 | 1.500 | 250.0 | cuda:0 B=16 T=1024 |  |" "$T/bench.md"
contains "a skipped benchmark" "| BM_Gpt2Attention/cuda/tf32 | - | - | no CUDA device | |" "$T/bench.md"
if grep -q "real_time_mean" "$T/bench.md"; then bad "an aggregate row was shown"; else ok "aggregates left out"; fi
python3 "$ROOT/scripts/bench_table.py" "$T/missing.json" >/dev/null 2>&1
expect "an unreadable file exits 2" 2 "$?"

# 9b. scripts/compare_generate.py (gpu-check's generate cuda:0 vs cpu:1) on synthetic runs of a
# 2-layer, 16-wide, 8-token model (bound 4 (10 L + 3) (gamma_64(2^-23) + 2^-23) = 7.1e-4 of max
# |logit|): equal runs pass; a row moved by 1e-3 of its max fails; tokens that part at a step whose
# logits agree pass with a note; a token that is not its row's argmax fails; a missing file exits 2.
G="$T/gen"
mkdir -p "$G/ck"
python3 - "$G" <<'PY'
import array, json, os, sys
d = sys.argv[1]
json.dump({"meta": {"model": {"layers": 2, "embd": 16, "vocab": 8}}}, open(os.path.join(d, "ck", "manifest.json"), "w"))
def write(name, tokens, rows):
    open(os.path.join(d, name + ".json"), "w").write("note on stderr\n" + json.dumps({"tokens": tokens}) + "\n")
    array.array("f", [x for r in rows for x in r]).tofile(open(os.path.join(d, name + ".f32"), "wb"))
rows = [[0.5, 3.0, -1.0, 0.25, 2.0, 0.0, 1.0, -2.0], [2.9, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
write("a", [1, 1], rows)
write("moved", [1, 1], [rows[0], [2.9, 3.0 + 3e-3, 0, 0, 0, 0, 0, 0]])
write("tie", [1, 0], [rows[0], [2.9 + 5e-4, 2.9 + 4e-4, 0, 0, 0, 0, 0, 0]])
write("tie2", [1, 1], [rows[0], [2.9 + 4e-4, 2.9 + 5e-4, 0, 0, 0, 0, 0, 0]])
write("notmax", [1, 2], rows)
PY
cg() { python3 "$ROOT/scripts/compare_generate.py" "$G/ck" "$G/$1.json" "$G/$1.f32" "$G/$2.json" "$G/$2.f32" >"$G/out" 2>&1; }
cg a a; expect "compare_generate: equal runs pass" 0 "$?"
contains "and say so" "2 greedy tokens, identical tokens; 2 steps' logits" "$G/out"
cg moved a; expect "compare_generate: a row moved by 1e-3 of its max fails" 1 "$?"
contains "naming the step" "FAIL: step 1: max |difference|" "$G/out"
cg tie tie2; expect "compare_generate: tokens parting at a near-tie pass" 0 "$?"
contains "with a note" "tokens part at step 1 (a near-tie the bound allows" "$G/out"
cg notmax a; expect "compare_generate: a token that is not its row's argmax fails" 1 "$?"
contains "naming it" "FAIL: run A token 1 is 2, not the argmax 1 of its logits" "$G/out"
rm "$G/a.f32"; cg a a; expect "compare_generate: a missing file exits 2" 2 "$?"

# 10. Every zerotrain call of gpu-check parses and passes its checks, so a renamed flag or a shape
# that no longer splits fails here and not on a GPU visit: gpu-check against a fake nvidia-smi (an
# H200 on driver 580) and a build tree whose zerotrain is a wrapper that maps the GPU device specs
# to simulated devices and adds --print-config to `train` (every flag, the run's shape and paths
# checked, nothing trained), the other commands run for real. A call may fail only for an input an
# earlier, validated-only call would have written (a checkpoint), or for NCCL on simulated devices.
ZT="${1:-}"
if [[ -n $ZT && -x $ZT ]]; then
  FB="$T/fakebuild"
  mkdir -p "$FB/apps" "$T/fakebin"
  printf '%s\n' '#!/usr/bin/env bash' 'case "$*" in' \
    '  *name,driver_version*) echo "NVIDIA H200, 580.65.06, 143771 MiB, 9.0" ;;' \
    '  *driver_version*) echo "580.65.06" ;;' '  *) echo "NVIDIA H200 (fake), driver 580.65.06" ;;' 'esac' \
    >"$T/fakebin/nvidia-smi"
  cat >"$FB/apps/zerotrain" <<WRAP
#!/usr/bin/env bash
args=()
for a in "\$@"; do
  case "\$a" in cuda) a=cpu:2 ;; cuda:0) a=cpu:1 ;; cuda:0x*) a="cpu:\${a#cuda:0x}" ;; esac
  args+=("\$a")
done
[[ \${args[0]} == train ]] && args+=(--print-config)
out="\$("$ZT" "\${args[@]}" 2>&1)"
rc=\$?
printf '%s\t%s\t%s\n' "\$rc" "\$*" "\$(grep -m1 -v '^\$' <<<"\$out")" >>"$T/calls.tsv"
printf '%s\n' "\$out"
exit \$rc
WRAP
  # A compute-sanitizer that records its options, runs the program and reports nothing.
  cat >"$T/fakebin/compute-sanitizer" <<FAKE
#!/usr/bin/env bash
opts=()
while ((\$#)) && [[ \$1 != */zerotrain && \$1 != */test_* ]]; do opts+=("\$1"); shift; done
printf '%s\n' "\${opts[*]}" >>"$T/sanitizer-calls.txt"
"\$@"
rc=\$?
echo "========= ERROR SUMMARY: 0 errors"
exit \$rc
FAKE
  # The attention test binary the sanitizer step runs: records its arguments.
  mkdir -p "$FB/tests"
  printf '%s\n' '#!/usr/bin/env bash' "printf '%s\\n' \"\$*\" >>'$T/attention-args.txt'" >"$FB/tests/test_flash_attention"
  chmod +x "$T/fakebin/nvidia-smi" "$FB/apps/zerotrain" "$T/fakebin/compute-sanitizer" "$FB/tests/test_flash_attention"
  OUT="$T/dry" ZT_NVIDIA_SMI="$T/fakebin/nvidia-smi" ZT_REUSE_BUILD=1 ZT_GPU_BUILD="$FB" ZT_GPU_CHECK_SECONDS=120 ZT_GPU_LARGER=1 \
    ZT_COMPUTE_SANITIZER="$T/fakebin/compute-sanitizer" ZT_PYTHON="$T/no-python" "$CHECK" --peer >"$T/dry.log" 2>&1
  # The sanitizer runs: memcheck on every kernel, the others without the libraries' kernels (the
  # tiny model's five runs, then racecheck and synccheck on the attention test's cases).
  if [[ $(grep -c -- '--tool' "$T/sanitizer-calls.txt" 2>/dev/null) == 7 ]] &&
    ! grep -- '--tool memcheck' "$T/sanitizer-calls.txt" | grep -q -- '--kernel-name-exclude' &&
    [[ $(grep -E -- '--tool (racecheck|initcheck|synccheck) --kernel-name-exclude regex=.*cudnn' "$T/sanitizer-calls.txt" | wc -l) == 5 ]]; then
    ok "memcheck checks every kernel, racecheck/initcheck/synccheck only ours"
  else
    bad "compute-sanitizer's options:"; cat "$T/sanitizer-calls.txt" 2>/dev/null
  fi
  # The attention cases it names exist in this build's test binary (a rename fails here).
  filter="$(sed -n 's/.*--gtest_filter=\([^ ]*\).*/\1/p' "$T/attention-args.txt" 2>/dev/null | head -1)"
  real_attention="$(dirname "$ZT")/../tests/test_flash_attention"
  if [[ -x $real_attention ]]; then
    listed="$("$real_attention" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep -c '^  ')"
    expect "the sanitized attention cases exist ($filter)" 2 "$listed"
  else
    echo "skip: no test_flash_attention beside zerotrain: the sanitized attention cases not checked"
  fi
  contains "initcheck's line in results.md" "- initcheck: 0 finding(s) in ZeroTrain's kernels, 0 in library kernels, 0 API error(s); ERROR SUMMARY: 0 errors (library kernels not checked)" "$T/dry/results.md"
  calls=$(wc -l <"$T/calls.tsv" 2>/dev/null || echo 0)
  ((calls >= 20)) && ok "gpu-check made $calls zerotrain calls" || bad "gpu-check made $calls zerotrain calls"
  if grep -q "model gpt2-124m.*--cuda-graphs off" "$T/calls.tsv" && grep -q "model gpt2-124m.*--trace" "$T/calls.tsv"; then
    ok "the GPT-2 runs, eager and traced, were among them"
  else
    bad "no eager or traced GPT-2 run among gpu-check's calls"
  fi
  if grep -q "model gpt2-350m.*--seq-len 4096" "$T/calls.tsv" && grep -q "model gpt2-1558m" "$T/calls.tsv" &&
    grep -q "model gpt2-774m.*--tensor-parallel 2" "$T/calls.tsv"; then
    ok "the larger GPT-2 shapes (ZT_GPU_LARGER=1) were among them"
  else
    bad "no GPT-2 350M/1.5B/774M-TP run among gpu-check's calls under ZT_GPU_LARGER=1"
  fi
  awk -F'\t' '$1 != 0 && $3 !~ /does not exist|is neither a checkpoint directory/ && $3 !~ /--comm nccl needs CUDA devices/' "$T/calls.tsv" >"$T/calls-bad.tsv"
  if [[ -s $T/calls-bad.tsv ]]; then bad "gpu-check's zerotrain calls that fail their checks:"; cat "$T/calls-bad.tsv"
  else ok "every one parses and passes its checks"; fi
  contains "--peer without a PyTorch that sees a GPU: skipped" \
    "| PyTorch peer | skipped ($T/no-python cannot import torch with CUDA) | 0 | |" "$T/dry/results.md"
else
  echo "skip: no zerotrain binary given: gpu-check's calls not checked"
fi

if ((fails)); then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all checks passed"
