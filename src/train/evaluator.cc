// Validation loss (and accuracy for classifiers) over the validation split (see evaluator.h).
#include "train/evaluator.h"

#include <algorithm>
#include <mutex>

#include "core/heartbeat.h"
#include "core/nvtx.h"
#include "train/processes.h"
#include "train/signals.h"

namespace zt {

// How many batches every rank runs when a stop signal arrives mid-evaluation: each rank asks before
// each batch; the first to see the signal fixes the count at one past the furthest batch any rank
// has begun (a peer may be inside it, waiting on this rank's tensor-parallel collective or
// pipeline transfer), so every rank runs exactly that many.
class EvalStop {
 public:
  explicit EvalStop(int ranks) : begun_(static_cast<size_t>(ranks), -1) {}
  // Whether rank r runs batch e.
  bool begin(int r, int64_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_at_ < 0 && StopSignals::pending() != 0)
      for (int64_t b : begun_) stop_at_ = std::max(stop_at_, b + 1);
    if (stop_at_ >= 0 && e >= stop_at_) return false;
    begun_[static_cast<size_t>(r)] = e;
    return true;
  }
  bool cut_short(int64_t batches) const { return stop_at_ >= 0 && stop_at_ < batches; }

 private:
  std::mutex mu_;
  std::vector<int64_t> begun_;
  int64_t stop_at_ = -1;  // -1: no stop yet
};

// One stage: rank r's rows of each validation batch through the whole model (or its tensor shard)
// in its step workspace; every rank computes the losses (a tensor group's are the same).
void OneStage::evaluate_rank(World& world, const RunContext& run, int r, int64_t batches, EvalStop& stop,
                             EvalSums& sums) {
  const int B = world.split().micro, T = run.T;
  const bool is_gpt = run.is_gpt;
  const int D = is_gpt ? 0 : run.mc.input_dim, classes = run.mc.classes;
  RankState& R = world.rank(r);
  Workspace& ws = *ws_[static_cast<size_t>(r)];
  Stream& s = world.device(r).compute();
  ZeroEngine& engine = world.engine();
  HostBatch hb;
  hb.tokens.resize(static_cast<size_t>(B * T));
  hb.images.resize(static_cast<size_t>(B * D));
  hb.targets.resize(static_cast<size_t>(B * T));
  std::vector<float> logits(is_gpt ? 0 : static_cast<size_t>(B * classes));
  for (int64_t e = 0; e < batches && stop.begin(r, e); ++e) {
    heartbeat();  // a batch done: a long evaluation is not a hang (core/heartbeat.h)
    if (is_gpt)
      run.lang->batch(Split::kValidation, static_cast<uint64_t>(e), world.data_rank(r) * B, B, T, hb.tokens.data(),
                      hb.targets.data());
    else
      run.images->examples(Split::kValidation, (e * world.data_ranks() + world.data_rank(r)) * B, B,
                           hb.images.data(), hb.targets.data());
    world.upload(r, hb);
    engine.rank(r).begin_micro_batch(0, /*forward_only=*/true);
    world.model().forward(s, engine.rank(r), ws, R.batches[0], 0.0f, false);
    engine.rank(r).end_micro_batch();
    for (int i = 0; !is_gpt && i < B; ++i)  // widened from a 16-bit MLP's logits
      ws.read_logits_row(s, i, logits.data() + static_cast<size_t>(i) * classes);
    s.copy(R.losses.data(), ws.losses().data, R.losses.size() * 4);
    s.synchronize();  // hb, the losses and the logits are ready
    double batch = 0;
    for (float l : R.losses) batch += l;
    sums.loss += batch;
    sums.count += static_cast<int64_t>(B) * T;
    for (int i = 0; !is_gpt && i < B; ++i) {
      const float* row = logits.data() + static_cast<size_t>(i) * classes;
      const int pred = static_cast<int>(std::max_element(row, row + classes) - row);
      sums.correct += pred == hb.targets[static_cast<size_t>(i)];
    }
  }
}

// Pipeline stages: each data rank's validation batch flows forward through the virtual stages in
// order on blocking transfers (one batch at a time needs no schedule, and a chain cannot
// deadlock); the last virtual stage computes the losses, in workspaces of its own for the pass.
void PipelineStages::evaluate_rank(World& world, const RunContext& run, int r, int64_t batches, EvalStop& stop,
                                   EvalSums& sums) {
  const int B = world.split().micro, T = run.T;
  Device& d = world.device(r);
  Stream& s = d.compute();
  const Model& model = world.model_of(r);
  RankState& R = world.rank(r);
  std::vector<std::unique_ptr<Workspace>> ws;
  for (int c = 0; c < model.chunks(); ++c) ws.push_back(model.make_chunk_workspace(d, B, T, c));
  HostBatch hb;
  hb.tokens.resize(static_cast<size_t>(B * T));
  hb.targets.resize(static_cast<size_t>(B * T));
  world.engine_of(r).rank(world.engine_rank(r)).begin_pipeline_step(/*forward_only=*/true);
  for (int64_t e = 0; e < batches && stop.begin(r, e); ++e) {
    heartbeat();  // a batch done: a long evaluation is not a hang (core/heartbeat.h)
    run.lang->batch(Split::kValidation, static_cast<uint64_t>(e), world.data_rank(r) * B, B, T, hb.tokens.data(),
                    hb.targets.data());
    world.upload(r, hb);  // into the rank's first micro-batch buffers, which the step will refill
    Workspace* head = forward_stages(world, r, ws, R.batches[0]);
    if (head) s.copy(R.losses.data(), head->losses().data, R.losses.size() * 4);
    s.synchronize();  // hb is read and the losses are written
    if (!head) continue;
    for (float l : R.losses) sums.loss += l;  // one running sum (a batch's is not rounded apart)
    sums.count += static_cast<int64_t>(B) * T;
  }
}

EvalResult evaluate(World& world, const RunContext& run, int batches_gpt) {
  const int N = world.size(), B = world.split().micro;
  const bool is_gpt = run.is_gpt;
  std::vector<EvalSums> sums(static_cast<size_t>(N));
  EvalStop stop(N);
  const int64_t batches = is_gpt ? batches_gpt
                                 : run.images->num_examples(Split::kValidation) /
                                       (static_cast<int64_t>(world.data_ranks()) * B);
  world.for_ranks([&](int r) {
    const NvtxRange eval_range(NvtxCategory::kStep, "eval", world.device(r).index());
    world.stages().evaluate_rank(world, run, r, batches, stop, sums[static_cast<size_t>(r)]);
  });
  double ls = 0;
  int64_t c = 0, n = 0;
  // Every global rank's sums (every process's), added in rank order as one process adds them
  // (counts are exact in a double); global rank g is local rank g % N of its process. Each
  // process's row ends with whether a stop signal cut its evaluation short (it then means nothing
  // anywhere; the stop itself is agreed at the next step, StepStats::stop_signal).
  std::vector<double> mine;
  for (const EvalSums& r : sums)
    mine.insert(mine.end(), {r.loss, static_cast<double>(r.correct), static_cast<double>(r.count)});
  mine.push_back(stop.cut_short(batches) ? 1.0 : 0.0);
  const std::vector<double> all = run.processes->all_gather(mine, "the evaluation's losses");
  bool interrupted = false;
  for (size_t p = 0; p + mine.size() <= all.size(); p += mine.size()) {
    for (int r = 0; r < N; ++r) {
      if (!world.tensor_lead(r)) continue;  // a tensor group's ranks hold the same losses
      const double* sums = all.data() + p + 3 * static_cast<size_t>(r);
      ls += sums[0];
      c += static_cast<int64_t>(sums[1]);
      n += static_cast<int64_t>(sums[2]);
    }
    interrupted = interrupted || all[p + mine.size() - 1] != 0;
  }
  EvalResult out;
  out.interrupted = interrupted;
  out.loss = n ? ls / static_cast<double>(n) : 0;
  if (!is_gpt) out.accuracy = n ? static_cast<double>(c) / static_cast<double>(n) : 0;
  return out;
}

}  // namespace zt
