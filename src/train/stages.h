// How a World's ranks run the model: every world is a pipeline of P stages, and the StageRunner is
// what differs between one stage and several. The trainer, the step's scalars, the evaluation's
// and the sample's sums, snapshots and reports are written once over it; nothing above it asks how
// many stages there are.
//
//  - OneStage (P = 1): every rank holds the whole model (or its tensor shard) and one workspace;
//    each micro-batch runs forward and backward through the engine's overlapped per-block hooks
//    (optionally from a captured CUDA graph), and one process's step scalars stay on the devices.
//  - PipelineStages (P > 1): each rank holds its stage's chunks and runs its list of the schedule
//    (pipeline/runtime.h) through a ModelStageWork; the stage engines reduce once per step, the
//    first and last stage sum the tied embedding's gradient, and the scalars are summed on the host.
//
// Running a one-stage world through the schedule runtime (a pipeline of one) would lose what only
// one stage has (the per-block overlap of the reduction with the backward, CUDA graphs, the device
// scalars, MLPs) and change its reduction order and memory, so both ways stay, behind this seam.
// Each area keeps its two halves side by side: the step in step.cc, evaluation in evaluator.cc,
// sampling in sampler.cc, snapshots in checkpointer.cc, the rest in stages.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/model.h"
#include "pipeline/model_stage.h"
#include "pipeline/partition.h"
#include "pipeline/runtime.h"
#include "pipeline/schedule.h"

namespace zt {

class World;
struct RunContext;
struct HostSnapshot;
struct PipelineReport;
class TraceRecorder;
struct TrainResult;

// A validation pass's per-rank sums (evaluator.cc) and the stop that cuts it short everywhere.
struct EvalSums {
  double loss = 0;
  int64_t correct = 0, count = 0;  // count: positions (GPT) or examples (MLP) the rank's losses cover
};
class EvalStop;

class StageRunner {
 public:
  virtual ~StageRunner() = default;

  // Rank r's workspaces for micro-batches of B x T, allocated where World allocates the rank's
  // step buffers (a pipeline stage's runner holds its own from its construction).
  virtual void allocate(World& w, int r, int B, int T) {}
  // Rank r's forward and backward of step `step`'s micro-batches, its gradient check and its share
  // of the step's scalars (step.cc), from rank r's host thread; `dloss` weighs one position.
  virtual void rank_step(World& w, const RunContext& run, int step, int r, float dloss) = 0;
  // On the host after every rank's rank_step returned.
  virtual void after_step(World& w) {}
  // Rank r's seconds of recompute since the last call (the step's phase split).
  virtual double take_recompute_seconds(int r) { return 0; }

  // Rank r's share of a validation pass of `batches` batches (evaluator.cc): its sums, where it
  // computes losses; every rank runs the batches `stop` lets it, in lockstep with its peers.
  virtual void evaluate_rank(World& w, const RunContext& run, int r, int64_t batches, EvalStop& stop,
                             EvalSums& sums) = 0;
  // The text rank r samples (sampler.cc): n_tokens drawn from the model in lockstep with the others.
  virtual std::string sample_rank(World& w, const RunContext& run, int r, int n_tokens, uint64_t salt) = 0;
  // The model's state in the logical (one-device) layout (checkpointer.cc).
  virtual HostSnapshot snapshot(World& w, bool adamw, int64_t step) = 0;

  // The logical (one-device) model's blocks, whatever the tensor and pipeline degrees: what the
  // initialisation, --init-from and checkpoints address.
  virtual ParamLayout logical_layout(const World& w) const = 0;
  // Pool bytes of rank r's activations (its workspaces) through a step.
  virtual size_t activation_bytes(int r) const = 0;
  // Lines of the run's header, after the mesh (`tp`: the mesh line was printed already).
  virtual std::vector<std::string> describe(const World& w, bool tp) const { return {}; }
  // The pipeline section of the run's report (none with one stage).
  virtual std::optional<PipelineReport> report() const;
  // The last step's compute spans on each device's pipeline track (--trace; none with one stage).
  virtual void trace(World& w, TraceRecorder& tracer) const {}
  // What a lost device's peers that go with it are (recovery's message): the ranks holding the
  // rest of its model copy.
  virtual const char* replica_name() const = 0;
  // Tests' hook (TestHooks::keep_final_params): the logical blocks' final parameters, working
  // copies and moments, where one engine holds them all (none for pipeline stages).
  virtual void keep_final_state(World& w, const RunContext& run, int64_t step, TrainResult& out) {}
};

// P = 1: the world's one engine and model; each rank's workspace for the step (B x T) and one for
// sampling (1 x T, made at the first sample and kept).
class OneStage final : public StageRunner {
 public:
  explicit OneStage(int ranks) : ws_(static_cast<size_t>(ranks)), sample_ws_(static_cast<size_t>(ranks)) {}
  void allocate(World& w, int r, int B, int T) override;
  void rank_step(World& w, const RunContext& run, int step, int r, float dloss) override;
  double take_recompute_seconds(int r) override;
  void evaluate_rank(World& w, const RunContext& run, int r, int64_t batches, EvalStop& stop, EvalSums& sums) override;
  std::string sample_rank(World& w, const RunContext& run, int r, int n_tokens, uint64_t salt) override;
  HostSnapshot snapshot(World& w, bool adamw, int64_t step) override;
  ParamLayout logical_layout(const World& w) const override;
  size_t activation_bytes(int r) const override;
  const char* replica_name() const override { return "tensor group"; }
  void keep_final_state(World& w, const RunContext& run, int64_t step, TrainResult& out) override;

 private:
  std::vector<std::unique_ptr<Workspace>> ws_, sample_ws_;  // per rank
};

// P > 1: the partition and schedule, each rank's stage runner, and the spans of the last step.
class PipelineStages final : public StageRunner {
 public:
  // Micro-batches of B x T; all_spans: every rank's spans (--trace), else the data-index-0 ranks'.
  PipelineStages(World& w, int B, int T, PipelinePartition partition, Schedule schedule, std::string note,
                 bool all_spans);
  void rank_step(World& w, const RunContext& run, int step, int r, float dloss) override;
  void after_step(World& w) override;
  void evaluate_rank(World& w, const RunContext& run, int r, int64_t batches, EvalStop& stop, EvalSums& sums) override;
  std::string sample_rank(World& w, const RunContext& run, int r, int n_tokens, uint64_t salt) override;
  HostSnapshot snapshot(World& w, bool adamw, int64_t step) override;
  ParamLayout logical_layout(const World& w) const override;
  size_t activation_bytes(int r) const override;
  std::vector<std::string> describe(const World& w, bool tp) const override;
  std::optional<PipelineReport> report() const override;
  void trace(World& w, TraceRecorder& tracer) const override;
  const char* replica_name() const override { return "model replica"; }

 private:
  // One forward (train=false) of `batch` through rank r's chunk workspaces `ws` in virtual-stage
  // order, each chunk's input received from the previous virtual stage and its output sent on
  // (blocking transfers: one batch at a time is a chain, which cannot deadlock). Returns the last
  // virtual stage's workspace (losses, logits) when rank r holds it, else null.
  Workspace* forward_stages(World& w, int r, std::vector<std::unique_ptr<Workspace>>& ws, const Batch& batch);

  PipelinePartition partition_;
  Schedule schedule_;
  std::string note_;                                   // the schedule's note when it degrades (m < P)
  std::vector<std::unique_ptr<ModelStageWork>> work_;  // per rank
  // Compute spans of each rank's last step (per rank; read after the step's sync): the data-index-0
  // ranks' always (the measured bubble), every rank's with all_spans (--trace).
  std::vector<std::vector<StageSpan>> spans_;
  std::vector<SpanTimer> span_timers_;  // per rank: the spans' times by events (no host functions)
  bool all_spans_ = false;
  double bubble_sum_ = 0;  // measured bubble fractions of the steps so far, summed
  int bubble_steps_ = 0;
};

}  // namespace zt
