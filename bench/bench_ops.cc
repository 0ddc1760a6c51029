// Throughput of the ops through kernels/ops.h on every backend: each benchmark is registered
// twice, BM_<op>/cpu/... (one simulated CPU device) and BM_<op>/cuda/... (GPU 0; skipped with "no
// usable GPU" where there is none). GEMM and attention in FLOP/s, memory-bound ops (layernorm,
// GELU, AdamW, the fused bf16 multi-tensor AdamW and unscale_check of optimizers/) in bytes/s,
// with plain stream copies of the same byte counts beside them as the bandwidth ceiling. Timing:
// enqueue + synchronize per iteration on the CPU; on the GPU kCudaBatch ops are queued per
// synchronize, so the figure is the kernels', not the host round trip's.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "optimizers/optimizers.h"
#include "runtime/device.h"
#include "runtime/runtime.h"

namespace {

using zt::Backend;
using zt::DType;
using zt::Shape;

// Ops queued per synchronize on the GPU (one on the CPU, whose streams run one op at a time).
constexpr int kCudaBatch = 4;

// One runtime per backend, created on first use and kept for the process (GPU contexts are slow to
// create); the CUDA one is null when no usable GPU exists.
zt::Runtime* runtime(Backend backend) {
  if (backend == Backend::kCpu) {
    static std::unique_ptr<zt::Runtime> cpu = zt::Runtime::create_cpu(1);
    return cpu.get();
  }
  static std::unique_ptr<zt::Runtime> cuda = []() -> std::unique_ptr<zt::Runtime> {
    if (!zt::cuda_availability().usable) return nullptr;
    return zt::Runtime::create(zt::parse_device_spec("cuda:0"));
  }();
  return cuda.get();
}

// The device a benchmark runs on, its compute stream, and how many ops to queue per synchronize.
struct Target {
  zt::Device* device = nullptr;
  zt::Stream* stream = nullptr;
  int batch = 1;
  zt::Stream& s() const { return *stream; }
  // Ops run per timed iteration (for the counters).
  int64_t ops(const benchmark::State& state) const {
    return static_cast<int64_t>(state.iterations()) * batch;
  }
};

// False (after SkipWithError) when the backend has no usable device.
bool target(benchmark::State& state, Backend backend, Target* t) {
  zt::Runtime* rt = runtime(backend);
  if (rt == nullptr) {
    state.SkipWithError("no usable GPU");
    return false;
  }
  t->device = &rt->device(0);
  t->stream = &t->device->compute();
  t->batch = backend == Backend::kCuda ? kCudaBatch : 1;
  state.SetLabel(t->device->name());
  return true;
}

// A device buffer viewed as one tensor; filled with N(0, 1) (Philox) so that exp-based paths see
// realistic values.
struct Tensor {
  zt::DeviceBuffer buf;
  zt::TensorView view;
  Tensor(const Target& t, Shape shape, DType dtype = DType::kF32, uint64_t seed = 1)
      : buf(t.device->memory(), static_cast<size_t>(shape.numel()) * zt::dtype_size(dtype),
            t.s(), "bench"),
        view{buf.data(), dtype, shape, t.device->index()} {
    const int64_t n = shape.numel();
    if (dtype == DType::kF32) {
      std::vector<float> host(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) host[i] = zt::philox_normal(seed, 0, i);
      t.s().copy(buf.data(), host.data(), host.size() * sizeof(float));
      t.s().synchronize();  // before `host` goes away
    } else if (dtype == DType::kBF16 || dtype == DType::kF16) {
      std::vector<uint16_t> host(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const float x = zt::philox_normal(seed, 0, i);
        host[i] = dtype == DType::kBF16 ? zt::float_to_bf16_bits(x) : zt::float_to_half_bits(x);
      }
      t.s().copy(buf.data(), host.data(), host.size() * sizeof(uint16_t));
      t.s().synchronize();
    } else {
      t.s().memset(buf.data(), 0, buf.size());
    }
    t.s().synchronize();
  }
  operator zt::TensorView() const { return view; }       // NOLINT
  operator zt::ConstTensorView() const { return view; }  // NOLINT
};

// Runs `op` t.batch times, then synchronizes, once per timed iteration.
template <typename Op>
void run(benchmark::State& state, const Target& t, Op&& op) {
  for (auto _ : state) {
    for (int i = 0; i < t.batch; ++i) op();
    t.s().synchronize();
  }
}

// Registers fn as name/cpu and name/cuda, each configured by `config`.
using BackendBenchmark = void (*)(benchmark::State&, Backend);
using Config = void (*)(benchmark::internal::Benchmark*);
int register_on_backends(const char* name, BackendBenchmark fn, Config config) {
  for (Backend backend : {Backend::kCpu, Backend::kCuda}) {
    const std::string full = std::string(name) + "/" + zt::backend_name(backend);
    config(benchmark::RegisterBenchmark(full.c_str(), fn, backend));
  }
  return 0;
}

void flops(benchmark::State& state, const Target& t, double per_op) {
  state.counters["FLOP/s"] = benchmark::Counter(per_op * static_cast<double>(t.ops(state)),
                                                benchmark::Counter::kIsRate);
}

void bytes(benchmark::State& state, const Target& t, int64_t per_op) {
  state.SetBytesProcessed(t.ops(state) * per_op);
}

// ---- GEMM: out[N,OC] = in[N,C] @ w[OC,C]^T + b (GPT-2 small shapes at B*T = N) ----------------

void gemm_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"N", "C", "OC"});
  b->Args({1024, 768, 768});
  b->Args({1024, 768, 2304});
  b->Args({1024, 768, 3072});
  b->Args({1024, 3072, 768});
  b->Args({4096, 768, 2304});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

void BM_MatmulForward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1), OC = state.range(2);
  Tensor in(t, {N, C}), w(t, {OC, C}), b(t, {OC}), out(t, {N, OC});
  run(state, t, [&] { zt::ops::matmul_forward(t.s(), out, in, w, b); });
  flops(state, t, 2.0 * N * C * OC);
}

void BM_MatmulBackward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1), OC = state.range(2);
  Tensor in(t, {N, C}), w(t, {OC, C}), dout(t, {N, OC}), din(t, {N, C}), dw(t, {OC, C}),
      db(t, {OC});
  run(state, t, [&] { zt::ops::matmul_backward(t.s(), din, dw, db, dout, in, w); });
  flops(state, t, 4.0 * N * C * OC);
}

// ---- GPT-2 small's GEMMs, each product apart (`bench_ops --gemm`): the layers' weights [OC, C] at
// 768x2304 (c_attn), 768x768 (attn c_proj), 768x3072 (c_fc), 3072x768 (mlp c_proj) and the LM head
// over the padded vocabulary (768x50304), forward (out = in W^T), input gradient (dX = dout W) and
// weight gradient (dW += dout^T in), 2 N C OC FLOPs each. bf16 in, fp32 accumulation on CUDA at
// N = 16,384 tokens (B 16 x T 1024); fp32 at N = 128 on the CPU backend, a smoke check of the same
// calls. TFLOP/s is a user counter; items processed are the FLOPs.
struct GemmShape {
  const char* name;
  int64_t C, OC;
  bool lm_head;
};
constexpr GemmShape kGpt2Gemms[] = {{"c_attn_768x2304", 768, 2304, false},
                                    {"attn_proj_768x768", 768, 768, false},
                                    {"c_fc_768x3072", 768, 3072, false},
                                    {"mlp_proj_3072x768", 3072, 768, false},
                                    {"lm_head_768x50304", 768, 50304, true}};
enum class GemmProduct { kForward, kDx, kDw };
constexpr int64_t kGemmTokensCuda = 16384, kGemmTokensCpu = 128;

void BM_Gemm(benchmark::State& state, Backend backend, GemmShape shape, GemmProduct product) {
  Target t;
  if (!target(state, backend, &t)) return;
  const bool cuda = backend == Backend::kCuda;
  const DType d = cuda ? DType::kBF16 : DType::kF32;
  const int64_t N = cuda ? kGemmTokensCuda : kGemmTokensCpu, C = shape.C, OC = shape.OC;
  Tensor in(t, {N, C}, d), w(t, {OC, C}, d, 2), out(t, {N, OC}, d, 3), din(t, {N, C}, d, 4), dw(t, {OC, C});
  const zt::TensorView none{};
  switch (product) {
    case GemmProduct::kForward:
      run(state, t, [&] {
        if (shape.lm_head)
          zt::ops::lm_head_forward(t.s(), out, in, w);
        else
          zt::ops::matmul_forward(t.s(), out, in, w, zt::ConstTensorView{});
      });
      break;
    case GemmProduct::kDx:
      run(state, t, [&] {
        if (shape.lm_head)
          zt::ops::lm_head_backward(t.s(), din, none, out, in, w);
        else
          zt::ops::matmul_backward(t.s(), din, none, none, out, in, w, /*overwrite_din=*/true);
      });
      break;
    case GemmProduct::kDw:
      run(state, t, [&] {
        if (shape.lm_head)
          zt::ops::lm_head_backward(t.s(), none, dw, out, in, w);
        else
          zt::ops::matmul_backward(t.s(), none, dw, none, out, in, w);
      });
      break;
  }
  const double per_op = 2.0 * static_cast<double>(N) * static_cast<double>(C) * static_cast<double>(OC);
  state.counters["TFLOP/s"] =
      benchmark::Counter(per_op * static_cast<double>(t.ops(state)) / 1e12, benchmark::Counter::kIsRate);
  state.SetItemsProcessed(static_cast<int64_t>(per_op) * t.ops(state));
  state.SetLabel(t.device->name() + " " + zt::dtype_name(d) + " N=" + std::to_string(N));
}

int register_gemms() {
  const std::pair<GemmProduct, const char*> products[] = {
      {GemmProduct::kForward, "forward"}, {GemmProduct::kDx, "dX"}, {GemmProduct::kDw, "dW"}};
  for (Backend backend : {Backend::kCpu, Backend::kCuda})
    for (const GemmShape& shape : kGpt2Gemms)
      for (const auto& [product, pname] : products) {
        const std::string name =
            std::string("BM_Gemm/") + zt::backend_name(backend) + "/" + shape.name + "/" + pname;
        auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Gemm, backend, shape, product);
        b->Unit(benchmark::kMillisecond)->UseRealTime();
        if (backend == Backend::kCpu) b->Iterations(1);  // a smoke check: the calls, not the CPU's speed
      }
  return 0;
}

// ---- the MLP's fused GEMMs (cuBLASLt epilogues on CUDA) in fp32 (dtype 0) and bf16 (dtype 1:
// bf16 in, weight and outputs, fp32 accumulation): c_fc + GELU forward, c_proj's input gradient
// through the GELU with c_fc's bias gradient. GPT-2 small at B*T = N.
void mlp_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"N", "C", "dtype"});
  for (int dtype : {0, 1}) b->Args({1024, 768, dtype})->Args({8192, 768, dtype});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

DType mlp_dtype(const benchmark::State& state) { return state.range(2) ? DType::kBF16 : DType::kF32; }

void BM_MatmulGeluForward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1), H = 4 * C;
  const DType d = mlp_dtype(state);
  Tensor in(t, {N, C}, d), w(t, {H, C}, d), b(t, {H}), pre(t, {N, H}, d), out(t, {N, H}, d);
  run(state, t, [&] { zt::ops::matmul_gelu_forward(t.s(), out, pre, in, w, b); });
  flops(state, t, 2.0 * N * C * H);
}

void BM_MatmulBackwardDgelu(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1), H = 4 * C;
  const DType d = mlp_dtype(state);
  // c_proj: [N, H] -> [N, C], weight [C, H]; dpre and pre [N, H].
  Tensor dout(t, {N, C}, d), w(t, {C, H}, d), pre(t, {N, H}, d), dpre(t, {N, H}, d), db(t, {H});
  run(state, t, [&] { zt::ops::matmul_backward_dgelu(t.s(), dpre, db, dout, w, pre); });
  flops(state, t, 2.0 * N * C * H);
}

// ---- layernorm: bytes = in + out (+ mean/rstd), forward; dout + in + din (read+write) backward
// ----

void layernorm_shapes(benchmark::internal::Benchmark* b) {
  b->Args({4096, 768})->Args({16384, 768})->Unit(benchmark::kMicrosecond)->UseRealTime();
}

void BM_LayernormForward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1);
  Tensor in(t, {N, C}), w(t, {C}), b(t, {C}), out(t, {N, C}), mean(t, {N}), rstd(t, {N});
  run(state, t, [&] { zt::ops::layernorm_forward(t.s(), out, mean, rstd, in, w, b, 1e-5f); });
  bytes(state, t, (2 * N * C + 2 * N) * 4);
}

void BM_LayernormBackward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1);
  Tensor in(t, {N, C}), w(t, {C}), b(t, {C}), out(t, {N, C}), mean(t, {N}), rstd(t, {N});
  zt::ops::layernorm_forward(t.s(), out, mean, rstd, in, w, b, 1e-5f);
  Tensor dout(t, {N, C}), din(t, {N, C}), dw(t, {C}), db(t, {C});
  run(state, t,
      [&] { zt::ops::layernorm_backward(t.s(), din, dw, db, dout, in, w, mean, rstd); });
  bytes(state, t, 4 * N * C * 4);  // dout, in, din read + write
}

// ---- the fixed-order backward kernels of issue #28 at GPT-2 124M's shapes, bf16 activations ------
// layernorm_backward: bytes = dout + in + din (read + write), 16 bits each. encoder_backward
// (B = 16, T = 1024, C = 768, the padded vocabulary of 50,304 rows): ids log-uniform over the
// vocabulary (id = floor(V^u) - 1, so id 0 takes ~6% of the positions, as the commonest tokens of
// text do: long buckets); bytes = dout read + the dwpe and touched dwte rows read and written,
// counted as dout + 2 dwpe.
void BM_LayernormBackwardBF16(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1);
  Tensor in(t, {N, C}, DType::kBF16), w(t, {C}), b(t, {C}), out(t, {N, C}, DType::kBF16), mean(t, {N}),
      rstd(t, {N});
  zt::ops::layernorm_forward(t.s(), out, mean, rstd, in, w, b, 1e-5f);
  Tensor dout(t, {N, C}, DType::kBF16, 2), din(t, {N, C}, DType::kBF16, 3), dw(t, {C}), db(t, {C});
  run(state, t, [&] { zt::ops::layernorm_backward(t.s(), din, dw, db, dout, in, w, mean, rstd); });
  bytes(state, t, 4 * N * C * 2);
}

void encoder_backward_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "T", "C", "V"});
  b->Args({16, 1024, 768, 50304})->Unit(benchmark::kMicrosecond)->UseRealTime();
}

void BM_EncoderBackwardBF16(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t B = state.range(0), T = state.range(1), C = state.range(2), V = state.range(3);
  Tensor dout(t, {B, T, C}, DType::kBF16), dwte(t, {V, C}), dwpe(t, {T, C});
  std::vector<int32_t> ids(static_cast<size_t>(B * T));
  for (size_t i = 0; i < ids.size(); ++i) {
    const double u = zt::philox_uniform(7, 0, i);
    ids[i] = static_cast<int32_t>(std::min<double>(static_cast<double>(V) - 1, std::floor(std::pow(double(V), u)) - 1));
  }
  zt::DeviceBuffer tok_buf(t.device->memory(), ids.size() * sizeof(int32_t), t.s(), "bench");
  t.s().copy(tok_buf.data(), ids.data(), ids.size() * sizeof(int32_t));
  t.s().synchronize();
  const zt::TensorView tokens{tok_buf.data(), DType::kI32, Shape{B, T}, t.device->index()};
  run(state, t, [&] { zt::ops::encoder_backward(t.s(), dwte, dwpe, dout, tokens); });
  bytes(state, t, B * T * C * 2 + 2 * T * C * 4);
}

// ---- residual add + layernorm: fused, and the add followed by the layernorm it replaces. Bytes
// = the fused op's traffic (a, b read; residual, ln written; mean/rstd) for both, so the bytes/s
// compare directly.
void BM_ResidualLayernormFused(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1);
  Tensor a(t, {N, C}), b(t, {N, C}, DType::kF32, 2), w(t, {C}), bias(t, {C}), res(t, {N, C}), ln(t, {N, C}),
      mean(t, {N}), rstd(t, {N});
  run(state, t, [&] { zt::ops::residual_layernorm_forward(t.s(), res, ln, mean, rstd, a, b, w, bias, 1e-5f); });
  bytes(state, t, (4 * N * C + 2 * N) * 4);
}

void BM_ResidualLayernormUnfused(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), C = state.range(1);
  Tensor a(t, {N, C}), b(t, {N, C}, DType::kF32, 2), w(t, {C}), bias(t, {C}), res(t, {N, C}), ln(t, {N, C}),
      mean(t, {N}), rstd(t, {N});
  run(state, t, [&] {
    zt::ops::add(t.s(), res, a, b);
    zt::ops::layernorm_forward(t.s(), ln, mean, rstd, res, w, bias, 1e-5f);
  });
  bytes(state, t, (4 * N * C + 2 * N) * 4);
}

// ---- attention forward + backward: useful (causal) FLOPs = 6 B T^2 C
// -------------------------------

void BM_AttentionForwardBackward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t B = state.range(0), T = state.range(1), C = state.range(2), NH = state.range(3);
  Tensor qkv(t, {B, T, 3 * C}), out(t, {B, T, C}), pre(t, {B, NH, T, T}), att(t, {B, NH, T, T});
  Tensor dout(t, {B, T, C}), dqkv(t, {B, T, 3 * C}), dpre(t, {B, NH, T, T}),
      datt(t, {B, NH, T, T});
  run(state, t, [&] {
    zt::ops::attention_forward(t.s(), out, pre, att, qkv, static_cast<int>(NH));
    zt::ops::attention_backward(t.s(), dqkv, dpre, datt, dout, qkv, att, static_cast<int>(NH));
  });
  // Scores and att@V forward (T^2/2 * hs multiply-adds each per head), four products backward.
  flops(state, t, 6.0 * B * T * T * C);
}

// One layer's flash_attention_forward + flash_attention_backward per op on t, in dtype d; returns the
// bytes of lse and the backward's scratch.
size_t run_flash_attention(benchmark::State& state, const Target& t, int64_t B, int64_t T, int64_t C, int64_t NH,
                           DType d, zt::ops::GradWrite write) {
  const int64_t scratch_floats =
      static_cast<int64_t>(zt::ops::flash_attention_scratch_bytes(B, T, C, NH) / sizeof(float));
  Tensor qkv(t, {B, T, 3 * C}, d), out(t, {B, T, C}, d), lse(t, {B, NH, T});
  Tensor dout(t, {B, T, C}, d, 2), dqkv(t, {B, T, 3 * C}, d, 3), scratch(t, {scratch_floats});
  run(state, t, [&] {
    zt::ops::flash_attention_forward(t.s(), out, lse, qkv, static_cast<int>(NH));
    zt::ops::flash_attention_backward(t.s(), dqkv, dout, qkv, out, lse, static_cast<int>(NH), scratch, write);
  });
  return lse.buf.size() + scratch.buf.size();
}

// Tiled (flash-style) attention on the same shapes. Counters: attn_bytes = what the op needs
// beyond its inputs and outputs (lse + backward scratch, plus on the CPU two 64x64 fp32 tiles on
// the stack of each worker thread; on CUDA the library path's block, the fp32 GEMM attention's
// score buffers), vs_today = attn_bytes over today's
// preatt + att + dpreatt + datt (4 B NH T^2 fp32), the issue's <= 1/8 target at T = 1024.
void BM_FlashAttentionForwardBackward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t B = state.range(0), T = state.range(1), C = state.range(2), NH = state.range(3);
  const size_t buffers = run_flash_attention(state, t, B, T, C, NH, DType::kF32, zt::ops::GradWrite::kAccumulate);
  flops(state, t, 6.0 * B * T * T * C);
  const double stack_tiles =
      backend == Backend::kCpu ? 2.0 * 64 * 64 * sizeof(float) * zt::parallel_threads() : 0.0;
  const std::optional<zt::ops::AttentionWorkspace> ws =
      zt::ops::fused_attention_workspace(t.s(), B, T, C, NH, DType::kF32, true);
  const size_t library = ws ? zt::ops::flash_attention_library_bytes(B, T, C, DType::kF32, *ws) : 0;
  const double mine = static_cast<double>(buffers + library) + stack_tiles;
  const double today = 4.0 * B * NH * T * T * sizeof(float);
  state.counters["attn_bytes"] = mine;
  state.counters["today_bytes"] = today;
  state.counters["vs_today"] = mine / today;
}

void attention_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "T", "C", "NH"});
  b->Args({4, 64, 128, 4});  // the default job's micro-batch (gpt-tiny)
  b->Args({4, 256, 768, 12});
  b->Args({4, 1024, 768, 12});
  // Process CPU time beside wall time: on a shared machine the CPU column compares the two
  // attention kernels more steadily than the wall clock.
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MeasureProcessCPUTime();
}

// ---- GPT-2 124M's attention, one layer forward + backward (`bench_ops --attention`) ----------------
// B 16, T 1024, 12 heads of 64 on CUDA in each precision a run can pick: fp32 (the cuBLAS GEMM
// attention, true fp32), tf32 (the same on TF32 tensor cores, --tf32), bf16 (cuDNN's SDPA,
// deterministic backward) and bf16-nondet (--deterministic-attention off); B 1, T 128 on the CPU backend, one iteration, a smoke check of the same
// calls. The time is per layer (one forward and one backward); FLOP/s counts the causal half's
// useful 6 B T^2 C FLOPs, as BM_FlashAttentionForwardBackward does (the GEMM attention computes
// twice that). On CUDA, tf32-chunkNMiB[-splitS] runs the GEMM attention with N MiB of scores per
// chunk (ops::set_gemm_attention_chunk_bytes; at T 1024 a head's scores are 4 MiB, so 4, 8, 16 and
// 32 MiB are groups of 1, 2, 4 and 8 heads; plain tf32 is the default, all 12) and S causal row
// blocks (ops::set_gemm_attention_row_splits; default 1, the full square): fewer heads keep a
// chunk's scores in L2 between the GEMM and the row kernel, splits skip the blocks above the
// diagonal, both at more cuBLAS calls.
enum class AttnPrecision { kFp32, kTf32, kBf16, kBf16Fast };

void BM_Gpt2Attention(benchmark::State& state, Backend backend, AttnPrecision precision, size_t chunk_bytes,
                      int64_t splits) {
  Target t;
  if (!target(state, backend, &t)) return;
  const bool cuda = backend == Backend::kCuda;
  const int64_t B = cuda ? 16 : 1, T = cuda ? 1024 : 128, C = 768, NH = 12;
  const bool bf16 = precision == AttnPrecision::kBf16 || precision == AttnPrecision::kBf16Fast;
  const DType d = bf16 ? DType::kBF16 : DType::kF32;
  const zt::MathMode before = t.device->math_mode();
  zt::MathMode mode = before;
  mode.tf32 = precision == AttnPrecision::kTf32;
  mode.deterministic_attention = precision != AttnPrecision::kBf16Fast;
  t.device->set_math_mode(mode);
  zt::ops::set_gemm_attention_chunk_bytes(chunk_bytes);
  zt::ops::set_gemm_attention_row_splits(splits);
  const int64_t heads = zt::ops::gemm_attention_heads_per_chunk(T, NH);
  run_flash_attention(state, t, B, T, C, NH, d, zt::ops::GradWrite::kOverwrite);
  zt::ops::set_gemm_attention_chunk_bytes(0);
  zt::ops::set_gemm_attention_row_splits(0);
  t.device->set_math_mode(before);
  flops(state, t, 6.0 * B * T * T * C);
  state.SetLabel(t.device->name() + " B=" + std::to_string(B) + " T=" + std::to_string(T) +
                 (cuda && !bf16 ? " heads/chunk=" + std::to_string(heads) + " splits=" + std::to_string(splits)
                                : ""));
}

int register_gpt2_attention() {
  const std::pair<AttnPrecision, const char*> precisions[] = {
      {AttnPrecision::kFp32, "fp32"},
      {AttnPrecision::kTf32, "tf32"},
      {AttnPrecision::kBf16, "bf16"},
      {AttnPrecision::kBf16Fast, "bf16-nondet"}};
  for (Backend backend : {Backend::kCpu, Backend::kCuda})
    for (const auto& [precision, pname] : precisions) {
      const std::string name = std::string("BM_Gpt2Attention/") + zt::backend_name(backend) + "/" + pname;
      auto* b =
          benchmark::RegisterBenchmark(name.c_str(), BM_Gpt2Attention, backend, precision, size_t{0}, int64_t{1});
      b->Unit(benchmark::kMillisecond)->UseRealTime();
      if (backend == Backend::kCpu) b->Iterations(1);  // a smoke check: the calls, not the CPU's speed
    }
  const std::pair<size_t, int64_t> tunings[] = {{4, 1}, {8, 1}, {16, 1}, {32, 1}, {64, 2}, {64, 4}, {16, 2}, {16, 4}};
  for (const auto& [mib, splits] : tunings) {
    const std::string name = "BM_Gpt2Attention/cuda/tf32-chunk" + std::to_string(mib) + "MiB" +
                             (splits > 1 ? "-split" + std::to_string(splits) : "");
    benchmark::RegisterBenchmark(name.c_str(), BM_Gpt2Attention, Backend::kCuda, AttnPrecision::kTf32, mib << 20,
                                 splits)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  return 0;
}

// ---- GELU forward: 4 B read + 4 B write per element
// -----------------------------------------------

void elementwise_sizes(benchmark::internal::Benchmark* b) {
  b->Arg(1 << 20)->Arg(1 << 24)->Unit(benchmark::kMicrosecond)->UseRealTime();
}

void BM_GeluForward(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t n = state.range(0);
  Tensor in(t, {n}), out(t, {n});
  run(state, t, [&] { zt::ops::gelu_forward(t.s(), out, in); });
  bytes(state, t, n * 8);
}

// ---- classifier: logits read, dlogits written in place
// ----------------------------------------------

void BM_Classifier(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), V = state.range(1);
  Tensor logits(t, {N, V}), losses(t, {N}), targets(t, {N}, DType::kI32);
  run(state, t, [&] {
    zt::ops::classifier_forward_backward(t.s(), logits, losses, targets, 1.0f / N, true);
  });
  bytes(state, t, N * V * 8);
}

void classifier_shapes(benchmark::internal::Benchmark* b) {
  b->Args({256, 50257})->Unit(benchmark::kMillisecond)->UseRealTime();
}

// The GPT head's classifier: V real columns in rows of padded_vocab(V), fp32 (range(2) = 0) or
// bf16 (1) logits: read for the statistics, read again and written in place as dlogits.
void BM_ClassifierPadded(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t N = state.range(0), V = state.range(1), Vp = zt::ops::padded_vocab(V);
  const DType dtype = state.range(2) ? DType::kBF16 : DType::kF32;
  Tensor logits(t, {N, Vp}, dtype), losses(t, {N}), targets(t, {N}, DType::kI32);
  run(state, t, [&] {
    zt::ops::classifier_forward_backward(t.s(), logits, losses, targets, 1.0f / N, true, nullptr, {0, V});
  });
  bytes(state, t, N * Vp * 2 * static_cast<int64_t>(zt::dtype_size(dtype)));
}

void classifier_padded_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"N", "V", "bf16"});
  b->Args({256, 50257, 0})->Args({256, 50257, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
}

// ---- AdamW over a flat shard: 28 B/param (read g, p, m, v; write p, m, v)
// -------------------------

void BM_AdamW(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t n = state.range(0);
  Tensor p(t, {n}), g(t, {n}), m(t, {n}), v(t, {n});
  zt::ops::fill(t.s(), v, 0.0f);
  const zt::ops::AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  run(state, t, [&] { zt::ops::adamw_update(t.s(), p, g, m, v, hp); });
  bytes(state, t, n * 28);
}

// The same 28 B/param of traffic as a plain copy (14 B/param read + 14 B/param written).
void BM_MemcpySameBytes(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t n = state.range(0);
  const size_t size = static_cast<size_t>(n) * 14;
  zt::DeviceBuffer src(t.device->memory(), size, t.s(), "bench"),
      dst(t.device->memory(), size, t.s(), "bench");
  t.s().memset(src.data(), 1, size);
  t.s().memset(dst.data(), 0, size);
  run(state, t, [&] { t.s().copy(dst.data(), src.data(), size); });
  bytes(state, t, n * 28);
}

// ---- mixed precision: fused multi-tensor AdamW with bf16 param and grad over a shard of several
// segments: 28 B/param (read bf16 grad + fp32 master, m, v; write fp32 master, m, v + bf16 param)
// -----------------------------------------------------------------------------------------------

// n parameters as kBenchSegments segments of a flat shard (sizes differ, as tensors do), with the
// list in host memory and a device copy.
constexpr int kBenchSegments = 8;

struct MultiTensorShard {
  Tensor master, m, v, param, grad;
  std::vector<zt::optim::OptimizerSegment> list;
  zt::DeviceBuffer device_list;
  MultiTensorShard(const Target& t, int64_t n)
      : master(t, {n}), m(t, {n}), v(t, {n}), param(t, {n}, DType::kBF16),
        grad(t, {n}, DType::kBF16) {
    zt::ops::fill(t.s(), v, 0.0f);
    int64_t begin = 0;
    for (int i = 0; i < kBenchSegments; ++i) {
      // Segment i holds a share proportional to i + 1 (the last takes the remainder).
      const int64_t len = i + 1 == kBenchSegments
                              ? n - begin
                              : n * (i + 1) / (kBenchSegments * (kBenchSegments + 1) / 2);
      zt::optim::OptimizerSegment seg;
      seg.param = static_cast<uint16_t*>(param.view.data) + begin;
      seg.grad = static_cast<const uint16_t*>(grad.view.data) + begin;
      seg.master = static_cast<float*>(master.view.data) + begin;
      seg.m = static_cast<float*>(m.view.data) + begin;
      seg.v = static_cast<float*>(v.view.data) + begin;
      seg.n = len;
      seg.weight_decay = i % 2 ? 0.1f : 0.0f;
      seg.rng_offset = static_cast<uint64_t>(begin);
      list.push_back(seg);
      begin += len;
    }
    device_list =
        zt::DeviceBuffer(t.device->memory(), list.size() * sizeof(list[0]), t.s(), "bench");
    t.s().copy(device_list.data(), list.data(), list.size() * sizeof(list[0]));
    t.s().synchronize();
  }
  zt::optim::SegmentList<zt::optim::OptimizerSegment> segs() const {
    return {list, static_cast<const zt::optim::OptimizerSegment*>(device_list.data())};
  }
};

void BM_AdamWMultiBF16(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t n = state.range(0);
  MultiTensorShard shard(t, n);
  Tensor inv(t, {1}), found_inf(t, {1});
  zt::ops::fill(t.s(), inv, 1.0f / 1024);
  zt::ops::fill(t.s(), found_inf, 0.0f);
  zt::optim::StepScalars sc;
  sc.inv_loss_scale = static_cast<const float*>(inv.view.data);
  sc.found_inf = static_cast<const float*>(found_inf.view.data);
  const zt::optim::AdamWConfig hp{1e-4f};
  run(state, t, [&] {
    zt::optim::adamw_multi(t.s(), shard.segs(), DType::kBF16, DType::kBF16, hp, sc);
  });
  bytes(state, t, n * 28);
}

// unscale_check over bf16 gradients: 2 B/param read (two norms, the overflow flag).
void BM_UnscaleCheckBF16(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t n = state.range(0);
  MultiTensorShard shard(t, n);
  std::vector<zt::optim::GradSegment> list;
  for (size_t i = 0; i < shard.list.size(); ++i)
    list.push_back({shard.list[i].grad, shard.list[i].n, static_cast<int>(i % 2)});
  zt::DeviceBuffer device_list(t.device->memory(), list.size() * sizeof(list[0]), t.s(), "bench");
  t.s().copy(device_list.data(), list.data(), list.size() * sizeof(list[0]));
  Tensor inv(t, {1}), norms(t, {2}), found_inf(t, {1});
  zt::ops::fill(t.s(), inv, 1.0f / 1024);
  t.s().synchronize();
  const zt::optim::SegmentList<zt::optim::GradSegment> segs{
      list, static_cast<const zt::optim::GradSegment*>(device_list.data())};
  run(state, t, [&] {
    zt::optim::unscale_check(t.s(), segs, DType::kBF16, static_cast<const float*>(inv.view.data),
                             static_cast<float*>(norms.view.data), 2,
                             static_cast<float*>(found_inf.view.data));
  });
  bytes(state, t, n * 2);
}

// A plain stream copy of n bytes (read n + write n), counted as 2n: unscale_check's byte count.
void BM_MemcpySameBytesAsUnscale(benchmark::State& state, Backend backend) {
  Target t;
  if (!target(state, backend, &t)) return;
  const int64_t n = state.range(0);
  const size_t size = static_cast<size_t>(n);
  zt::DeviceBuffer src(t.device->memory(), size, t.s(), "bench"),
      dst(t.device->memory(), size, t.s(), "bench");
  t.s().memset(src.data(), 1, size);
  t.s().memset(dst.data(), 0, size);
  run(state, t, [&] { t.s().copy(dst.data(), src.data(), size); });
  bytes(state, t, n * 2);
}

const int kRegistered = [] {
  register_gemms();
  register_gpt2_attention();
  register_on_backends("BM_MatmulForward", BM_MatmulForward, gemm_shapes);
  register_on_backends("BM_MatmulBackward", BM_MatmulBackward, gemm_shapes);
  register_on_backends("BM_MatmulGeluForward", BM_MatmulGeluForward, mlp_shapes);
  register_on_backends("BM_MatmulBackwardDgelu", BM_MatmulBackwardDgelu, mlp_shapes);
  register_on_backends("BM_LayernormForward", BM_LayernormForward, layernorm_shapes);
  register_on_backends("BM_LayernormBackward", BM_LayernormBackward, layernorm_shapes);
  register_on_backends("BM_LayernormBackwardBF16", BM_LayernormBackwardBF16, layernorm_shapes);
  register_on_backends("BM_EncoderBackwardBF16", BM_EncoderBackwardBF16, encoder_backward_shapes);
  register_on_backends("BM_ResidualLayernormFused", BM_ResidualLayernormFused, layernorm_shapes);
  register_on_backends("BM_ResidualLayernormUnfused", BM_ResidualLayernormUnfused, layernorm_shapes);
  register_on_backends("BM_AttentionForwardBackward", BM_AttentionForwardBackward,
                       attention_shapes);
  register_on_backends("BM_FlashAttentionForwardBackward", BM_FlashAttentionForwardBackward,
                       attention_shapes);
  register_on_backends("BM_GeluForward", BM_GeluForward, elementwise_sizes);
  register_on_backends("BM_Classifier", BM_Classifier, classifier_shapes);
  register_on_backends("BM_ClassifierPadded", BM_ClassifierPadded, classifier_padded_shapes);
  register_on_backends("BM_AdamW", BM_AdamW, elementwise_sizes);
  register_on_backends("BM_MemcpySameBytes", BM_MemcpySameBytes, elementwise_sizes);
  register_on_backends("BM_AdamWMultiBF16", BM_AdamWMultiBF16, elementwise_sizes);
  register_on_backends("BM_UnscaleCheckBF16", BM_UnscaleCheckBF16, elementwise_sizes);
  register_on_backends("BM_MemcpySameBytesAsUnscale", BM_MemcpySameBytesAsUnscale,
                       elementwise_sizes);
  return 0;
}();

}  // namespace

// `bench_ops --gemm`: only the BM_Gemm/* products; `--attention`: only BM_Gpt2Attention/* (a
// --benchmark_filter given after either wins); every other argument is Google Benchmark's.
int main(int argc, char** argv) {
  std::vector<char*> args;
  std::string filter;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (i > 0 && (a == "--gemm" || a == "--attention")) {
      filter = a == "--gemm" ? "--benchmark_filter=^BM_Gemm/" : "--benchmark_filter=^BM_Gpt2Attention/";
      continue;
    }
    args.push_back(argv[i]);
  }
  if (!filter.empty()) args.insert(args.begin() + 1, filter.data());
  int n = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
