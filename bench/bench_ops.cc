// Throughput of the ops on the CPU backend, through kernels/ops.h (enqueue + synchronize per
// iteration): GEMM and attention in FLOP/s, memory-bound ops (layernorm, GELU, AdamW) in bytes/s,
// with a plain stream copy of AdamW's byte count beside them as the bandwidth ceiling.
#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

#include "core/philox.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace {

using zt::DType;
using zt::Shape;

zt::Runtime& runtime() {
  static std::unique_ptr<zt::Runtime> rt = zt::Runtime::create_cpu(1);
  return *rt;
}
zt::Device& device() { return runtime().device(0); }
zt::Stream& stream() { return device().compute(); }

// A device buffer viewed as one tensor; filled with N(0, 1) (Philox) so that exp-based paths see
// realistic values.
struct Tensor {
  zt::DeviceBuffer buf;
  zt::TensorView view;
  Tensor(Shape shape, DType dtype = DType::kF32, uint64_t seed = 1)
      : buf(device().memory(), static_cast<size_t>(shape.numel()) * zt::dtype_size(dtype), stream(),
            "bench"),
        view{buf.data(), dtype, shape, device().index()} {
    const int64_t n = shape.numel();
    if (dtype == DType::kF32) {
      std::vector<float> host(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) host[i] = zt::philox_normal(seed, 0, i);
      stream().copy(buf.data(), host.data(), host.size() * sizeof(float));
      stream().synchronize();  // before `host` goes away
    } else {
      stream().memset(buf.data(), 0, buf.size());
    }
    stream().synchronize();
  }
  operator zt::TensorView() const { return view; }       // NOLINT
  operator zt::ConstTensorView() const { return view; }  // NOLINT
};

void flops(benchmark::State& state, double per_iteration) {
  state.counters["FLOP/s"] = benchmark::Counter(
      per_iteration * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
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

void BM_MatmulForward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1), OC = state.range(2);
  Tensor in({N, C}), w({OC, C}), b({OC}), out({N, OC});
  for (auto _ : state) {
    zt::ops::matmul_forward(stream(), out, in, w, b);
    stream().synchronize();
  }
  flops(state, 2.0 * N * C * OC);
}
BENCHMARK(BM_MatmulForward)->Apply(gemm_shapes);

void BM_MatmulBackward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1), OC = state.range(2);
  Tensor in({N, C}), w({OC, C}), dout({N, OC}), din({N, C}), dw({OC, C}), db({OC});
  for (auto _ : state) {
    zt::ops::matmul_backward(stream(), din, dw, db, dout, in, w);
    stream().synchronize();
  }
  flops(state, 4.0 * N * C * OC);
}
BENCHMARK(BM_MatmulBackward)->Apply(gemm_shapes);

// ---- layernorm: bytes = in + out (+ mean/rstd), forward; dout + in + din (read+write) backward
// ----

void BM_LayernormForward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1);
  Tensor in({N, C}), w({C}), b({C}), out({N, C}), mean({N}), rstd({N});
  for (auto _ : state) {
    zt::ops::layernorm_forward(stream(), out, mean, rstd, in, w, b, 1e-5f);
    stream().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * (2 * N * C + 2 * N) * 4);
}
BENCHMARK(BM_LayernormForward)
    ->Args({4096, 768})
    ->Args({16384, 768})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_LayernormBackward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1);
  Tensor in({N, C}), w({C}), b({C}), out({N, C}), mean({N}), rstd({N});
  zt::ops::layernorm_forward(stream(), out, mean, rstd, in, w, b, 1e-5f);
  Tensor dout({N, C}), din({N, C}), dw({C}), db({C});
  for (auto _ : state) {
    zt::ops::layernorm_backward(stream(), din, dw, db, dout, in, w, mean, rstd);
    stream().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * 4 * N * C * 4);  // dout, in, din read + write
}
BENCHMARK(BM_LayernormBackward)
    ->Args({4096, 768})
    ->Args({16384, 768})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// ---- attention forward + backward: useful (causal) FLOPs = 6 B T^2 C
// -------------------------------

void BM_AttentionForwardBackward(benchmark::State& state) {
  const int64_t B = state.range(0), T = state.range(1), C = state.range(2), NH = state.range(3);
  Tensor qkv({B, T, 3 * C}), out({B, T, C}), pre({B, NH, T, T}), att({B, NH, T, T});
  Tensor dout({B, T, C}), dqkv({B, T, 3 * C}), dpre({B, NH, T, T}), datt({B, NH, T, T});
  for (auto _ : state) {
    zt::ops::attention_forward(stream(), out, pre, att, qkv, static_cast<int>(NH));
    zt::ops::attention_backward(stream(), dqkv, dpre, datt, dout, qkv, att, static_cast<int>(NH));
    stream().synchronize();
  }
  // Scores and att@V forward (T^2/2 * hs multiply-adds each per head), four products backward.
  flops(state, 6.0 * B * T * T * C);
}
BENCHMARK(BM_AttentionForwardBackward)
    ->ArgNames({"B", "T", "C", "NH"})
    ->Args({4, 256, 768, 12})
    ->Args({4, 1024, 768, 12})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// ---- GELU forward: 4 B read + 4 B write per element
// -----------------------------------------------

void BM_GeluForward(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor in({n}), out({n});
  for (auto _ : state) {
    zt::ops::gelu_forward(stream(), out, in);
    stream().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * n * 8);
}
BENCHMARK(BM_GeluForward)->Arg(1 << 20)->Arg(1 << 24)->Unit(benchmark::kMicrosecond)->UseRealTime();

// ---- classifier: logits read, dlogits written in place
// ----------------------------------------------

void BM_Classifier(benchmark::State& state) {
  const int64_t N = state.range(0), V = state.range(1);
  Tensor logits({N, V}), losses({N}), targets({N}, DType::kI32);
  for (auto _ : state) {
    zt::ops::classifier_forward_backward(stream(), logits, losses, targets, 1.0f / N, true);
    stream().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * N * V * 8);
}
BENCHMARK(BM_Classifier)->Args({256, 50257})->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- AdamW over a flat shard: 28 B/param (read g, p, m, v; write p, m, v)
// -------------------------

void BM_AdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor p({n}), g({n}), m({n}), v({n});
  zt::ops::fill(stream(), v, 0.0f);
  const zt::ops::AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  for (auto _ : state) {
    zt::ops::adamw_update(stream(), p, g, m, v, hp);
    stream().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * n * 28);
}
BENCHMARK(BM_AdamW)->Arg(1 << 20)->Arg(1 << 24)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The same 28 B/param of traffic as a plain copy (14 B/param read + 14 B/param written).
void BM_MemcpySameBytes(benchmark::State& state) {
  const int64_t n = state.range(0);
  const size_t bytes = static_cast<size_t>(n) * 14;
  zt::DeviceBuffer src(device().memory(), bytes, stream(), "bench"),
      dst(device().memory(), bytes, stream(), "bench");
  stream().memset(src.data(), 1, bytes);
  stream().memset(dst.data(), 0, bytes);
  for (auto _ : state) {
    stream().copy(dst.data(), src.data(), bytes);
    stream().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * n * 28);
}
BENCHMARK(BM_MemcpySameBytes)
    ->Arg(1 << 20)
    ->Arg(1 << 24)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
