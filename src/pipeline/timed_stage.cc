// The timed synthetic stage's one-step bubble measurement (see timed_stage.h).
#include "pipeline/timed_stage.h"

#include <exception>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "runtime/runtime.h"

namespace zt {

std::vector<StageSpan> timed_step(const Schedule& sched, std::chrono::microseconds unit) {
  const int P = sched.stages, m = sched.micro_batches, V = sched.virtual_stages;
  auto rt = Runtime::create_cpu(P);
  std::vector<Device*> devs;
  std::vector<int> ranks;
  for (int r = 0; r < P; ++r) devs.push_back(&rt->device(r)), ranks.push_back(r);
  Communicator comm(devs);
  std::vector<std::unique_ptr<TimedStage>> work;
  for (int s = 0; s < P; ++s) work.push_back(std::make_unique<TimedStage>(rt->device(s), V, m, unit));
  std::vector<std::vector<StageSpan>> spans(static_cast<size_t>(P));
  std::vector<SpanTimer> timers(static_cast<size_t>(P));
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(P));
  for (int s = 0; s < P; ++s)
    threads.emplace_back([&, s] {
      StageRunOptions opt;
      opt.spans = &spans[static_cast<size_t>(s)];
      opt.timer = &timers[static_cast<size_t>(s)];
      try {
        run_pipeline_stage(sched, s, comm, ranks, *work[static_cast<size_t>(s)], opt);
      } catch (...) {
        errors[static_cast<size_t>(s)] = std::current_exception();
        comm.abort("pipeline stage " + std::to_string(s) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  rt->synchronize();
  for (int s = 0; s < P; ++s)
    timers[static_cast<size_t>(s)].resolve(work[static_cast<size_t>(s)]->stream(), spans[static_cast<size_t>(s)]);
  std::vector<StageSpan> all;
  for (const auto& v : spans) all.insert(all.end(), v.begin(), v.end());
  return all;
}

}  // namespace zt
