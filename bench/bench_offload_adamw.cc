// The host AdamW of --offload optimizer (optim::adamw_host: the CPU loops over parallel_for, the
// per-element function the devices use) on fp32 parameters, as torch.optim.AdamW updates them:
// one step over N parameters split into GPT-2-like tensors. Reports parameters/s and bytes/s;
// bench/offload_adamw.py runs it beside PyTorch's CPU AdamW with the same parameter count.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "core/philox.h"
#include "optimizers/optimizers.h"

namespace {

// Tensors of a GPT-2 small block (768 wide): the update is per tensor segment, as the engine's lists.
const int64_t kTensorSizes[] = {768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072, 3072 * 768, 768};

void BM_adamw_host(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> p(static_cast<size_t>(n)), g(p.size()), m(p.size()), v(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = zt::philox_uniform(1, 0, i) - 0.5f;
    g[i] = zt::philox_uniform(2, 0, i) - 0.5f;
  }
  std::vector<zt::optim::OptimizerSegment> segs;
  for (int64_t at = 0, t = 0; at < n; ++t) {
    const int64_t len = std::min<int64_t>(kTensorSizes[t % std::size(kTensorSizes)], n - at);
    segs.push_back({p.data() + at, g.data() + at, p.data() + at, m.data() + at, v.data() + at, len, 0.1f, 0});
    at += len;
  }
  int step = 0;
  for (auto _ : state) {
    const zt::optim::AdamWConfig hp{1e-4f, 0.9f, 0.95f, 1e-8f, ++step};
    zt::optim::adamw_host(segs, zt::DType::kF32, zt::DType::kF32, hp, zt::optim::StepScalars{});
    benchmark::DoNotOptimize(p.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  // Reads p, g, m, v; writes p, m, v.
  state.SetBytesProcessed(state.iterations() * n * 7 * 4);
}

}  // namespace

BENCHMARK(BM_adamw_host)->Arg(int64_t{1} << 20)->Arg(31'000'000)->Unit(benchmark::kMillisecond)->UseRealTime();
