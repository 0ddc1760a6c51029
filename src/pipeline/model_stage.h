// A pipeline stage of a model (make_gpt_stage) as the runtime's StageWork: one workspace per
// (chunk, micro-batch) for the step, parameters and gradients through the caller's ParamAccess
// (a plain one in tests; the ZeRO engine's in training), micro-batches set before the step.
#pragma once

#include <memory>
#include <vector>

#include "model/model.h"
#include "pipeline/partition.h"
#include "pipeline/runtime.h"

namespace zt {

// What each stage runs under `partition` (part k = virtual stage k lives on stage k % P as chunk
// k / P; the first part embeds, the last holds the head).
std::vector<PipelineStageSpec> pipeline_stage_specs(const PipelinePartition& partition, bool split_backward);

class ModelStageWork final : public StageWork {
 public:
  // `model` is the stage's model (chunks() chunks); B x T tokens per micro-batch.
  ModelStageWork(const Model& model, Device& device, ParamAccess& access, int B, int T, int micro_batches);

  // Micro-batch m's device batch (the embedding chunk reads its inputs, the head chunk its targets
  // and loss_scale) and the weight of one position's loss in the step's objective.
  void set_batch(int micro, const Batch& batch, float dloss);
  // Head stages: the sum of the step's per-position losses (synchronizes the stream); 0 elsewhere.
  double loss_sum();
  bool has_head() const { return head_chunk_ >= 0; }
  Workspace& workspace(int chunk, int micro) { return *ws_[index(chunk, micro)]; }

  Stream& stream() override { return device_.compute(); }
  void forward(int chunk, int micro) override;
  void backward(int chunk, int micro) override;
  void backward_input(int chunk, int micro) override;
  void backward_weight(int chunk, int micro) override;
  TensorView activation_out(int chunk, int micro) override { return workspace(chunk, micro).stage_output(); }
  TensorView activation_in(int chunk, int micro) override { return workspace(chunk, micro).stage_input(); }
  TensorView gradient_out(int chunk, int micro) override { return workspace(chunk, micro).stage_gradient(); }
  TensorView gradient_in(int chunk, int micro) override { return workspace(chunk, micro).stage_gradient(); }

 private:
  size_t index(int chunk, int micro) const;

  const Model& model_;
  Device& device_;
  ParamAccess& access_;
  int micro_batches_;
  int head_chunk_ = -1;
  std::vector<std::unique_ptr<Workspace>> ws_;  // [chunk * micro_batches + micro]
  std::vector<Batch> batches_;
  std::vector<float> dloss_;
};

}  // namespace zt
