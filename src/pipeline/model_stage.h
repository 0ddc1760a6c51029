// A pipeline stage of a model (make_gpt_stage) as the runtime's StageWork: parameters and gradients
// through the caller's ParamAccess (a plain one in tests; the ZeRO engine's in training), the
// micro-batches set before the step, and as few workspaces as the schedule keeps live.
//
// Memory: a workspace (one chunk's activations) is taken when a micro-batch first touches the
// chunk (its activation's receive, or its forward) and given back after its backward (its W under
// a split backward); so a stage holds the schedule's peak of live micro-batches per chunk (1F1B:
// P - s on stage s; GPipe: m), which workspace_slots() tells without devices. The input gradient a
// chunk sends upstream is copied out of the workspace into a per-micro-batch buffer of B*T*C, so
// giving the workspace back never waits for the upstream stage's receive.
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/pinned_host_buffer.h"
#include "model/model.h"
#include "pipeline/partition.h"
#include "pipeline/runtime.h"

namespace zt {

// A GPT's parts for the partitioner (partition.h), from the closed forms of the model: time = the
// training FLOPs per token of each block (matmuls 6 x 12C^2, attention 6 x 2TC), the embedding
// (a gather: ~0) and the head (6 x C x vocab, the tied LM head's matmuls, and the layernorm);
// memory = the model states of its parameters (16 bytes each, fp32 AdamW) — equal layers, so the
// balanced split puts fewer layers beside the head.
PipelineCosts gpt_pipeline_costs(const ModelConfig& config, int T);

// The local block of a stage model that holds the embeddings (the first stage's) or their tied
// copy (the last stage's LM head), -1 on the stages between: the pair whose gradients are summed.
int tied_embedding_block(const Model& model);

// What each stage runs under `partition` (part k = virtual stage k lives on stage k % P as chunk
// k / P; the first part embeds, the last holds the head).
std::vector<PipelineStageSpec> pipeline_stage_specs(const PipelinePartition& partition, bool split_backward);

// Workspace slots per chunk that stage `stage` of `schedule` needs, and each (chunk, micro-batch)'s
// slot, in the order the stage's list takes and gives them back.
struct WorkspaceSlots {
  std::vector<int> per_chunk;                          // slots of each chunk
  std::map<std::pair<int, int>, int> slot;             // (chunk, micro) -> slot
  std::map<std::pair<int, int>, bool> reused;          // the slot served an earlier micro-batch
};
WorkspaceSlots workspace_slots(const Schedule& schedule, int stage);

// Pool bytes a ModelStageWork of stage `stage` holds through a step (workspaces and input-gradient
// buffers), without devices: what a per-stage memory plan adds for activations.
size_t stage_activation_bytes(const Model& model, int B, int T, const Schedule& schedule, int stage);

class ModelStageWork final : public StageWork {
 public:
  // `model` is stage `stage`'s model of `schedule` (chunks() == schedule.virtual_stages); B x T
  // tokens per micro-batch.
  ModelStageWork(const Model& model, Device& device, ParamAccess& access, int B, int T, const Schedule& schedule,
                 int stage);

  // Micro-batch m's device batch (the embedding chunk reads its inputs, the head chunk its targets
  // and loss_scale) and the weight of one position's loss in the step's objective.
  void set_batch(int micro, const Batch& batch, float dloss);
  // Head stages: the sum of the step's per-position losses (synchronizes the stream); 0 elsewhere.
  double loss_sum();
  // Pool bytes of the workspaces and gradient buffers this stage holds through a step.
  size_t bytes() const;

  Stream& stream() override { return device_.compute(); }
  void forward(int chunk, int micro) override;
  void backward(int chunk, int micro) override;
  void backward_input(int chunk, int micro) override;
  void backward_weight(int chunk, int micro) override;
  TensorView activation_out(int chunk, int micro) override { return workspace(chunk, micro).stage_output(); }
  TensorView activation_in(int chunk, int micro) override { return workspace(chunk, micro).stage_input(); }
  TensorView gradient_out(int chunk, int micro) override;
  TensorView gradient_in(int chunk, int micro) override { return workspace(chunk, micro).stage_gradient(); }
  const Event* receive_after(int chunk, int micro) override;

 private:
  Workspace& workspace(int chunk, int micro);
  void send_gradient(int chunk, int micro);
  void release(int chunk, int micro);  // the last use of (chunk, micro)'s workspace is enqueued

  const Model& model_;
  Device& device_;
  ParamAccess& access_;
  int stages_, micro_batches_;
  int virtual_stage0_;  // virtual stage of chunk 0 (= the stage index)
  WorkspaceSlots slots_;
  int head_chunk_ = -1;
  std::vector<std::vector<std::unique_ptr<Workspace>>> ws_;  // [chunk][slot]
  std::vector<std::vector<std::unique_ptr<Event>>> freed_;  // [chunk][slot]: recorded at release
  std::vector<DeviceBuffer> grad_out_;                       // [chunk * micro_batches + micro]
  std::vector<Batch> batches_;
  std::vector<float> dloss_;
  // The head chunk's losses of each micro-batch (B*T floats), copied after its forward, read by
  // loss_sum() after the step's synchronisation. Pinned host memory (Device::alloc_host_pinned).
  std::vector<PinnedHostBuffer> loss_host_;
  size_t loss_floats_ = 0;
};

}  // namespace zt
