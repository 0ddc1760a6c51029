// Measured pipeline bubble of every schedule on simulated devices whose stages only take time
// (equal F = B = W, pipeline/timed_stage.h), beside the closed form (pipeline/simulate.h):
// counters measured_bubble, theoretical_bubble and their ratio. Arguments: P, m, and the time of
// one F (= B = W) in milliseconds. The wall time per iteration is
// the step's makespan plus start-up.
#include <benchmark/benchmark.h>

#include "pipeline/simulate.h"
#include "pipeline/timed_stage.h"

namespace {

void BM_Bubble(benchmark::State& state, zt::PipeSchedule kind) {
  const int P = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  const auto unit = std::chrono::milliseconds(state.range(2));  // of F, B and W each
  const int V = kind == zt::PipeSchedule::kInterleaved ? 2 : 1;
  double measured = 0;
  const zt::Schedule sched = zt::make_schedule(kind, P, m, V);
  for (auto _ : state) measured = zt::measure_bubble(zt::timed_step(sched, unit), P).fraction;
  const double theory = zt::theoretical_bubble(kind, P, m, V);
  state.counters["measured_bubble"] = measured;
  state.counters["theoretical_bubble"] = theory;
  state.counters["ratio"] = theory > 0 ? measured / theory : 0;
}

void Shapes(benchmark::internal::Benchmark* b) {
  for (int P : {2, 4})
    for (int m : {4, 8, 16}) b->Args({P, m, 4});
  // The shape with longer actions: the runtime's fixed costs (thread wake-ups of the
  // transfers) weigh less against them.
  b->Args({4, 8, 16});
  b->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK_CAPTURE(BM_Bubble, gpipe, zt::PipeSchedule::kGpipe)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Bubble, 1f1b, zt::PipeSchedule::k1F1B)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Bubble, interleaved, zt::PipeSchedule::kInterleaved)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Bubble, zb_h1, zt::PipeSchedule::kZbH1)->Apply(Shapes);

}  // namespace
