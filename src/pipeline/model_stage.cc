// A model's pipeline stage as StageWork (see model_stage.h).
#include "pipeline/model_stage.h"

#include "core/status.h"

namespace zt {

PipelineCosts gpt_pipeline_costs(const ModelConfig& c, int T) {
  const double C = c.embd, V = c.vocab;
  PipelineCosts costs;
  const double layer_params = 12 * C * C + 13 * C;
  costs.blocks.assign(static_cast<size_t>(c.layers), PartCost{6 * 12 * C * C + 6 * 2 * T * C, 16 * layer_params});
  costs.embedding = PartCost{0, 16 * (V + c.seq_len) * C};
  costs.head = PartCost{6 * C * V, 16 * (V * C + 2 * C)};  // the tied head's copy of wte, and ln_f
  return costs;
}

int tied_embedding_block(const Model& m) {
  for (int b = 0; b < m.layout().num_blocks(); ++b)
    if (m.logical_block(b) == 0) return b;
  return -1;
}

std::vector<PipelineStageSpec> pipeline_stage_specs(const PipelinePartition& partition, bool split_backward) {
  const int P = partition.stages, parts = partition.parts();
  std::vector<PipelineStageSpec> specs(static_cast<size_t>(P));
  for (PipelineStageSpec& s : specs) s.split_backward = split_backward;
  for (int k = 0; k < parts; ++k) {  // in virtual-stage order, so each stage's chunks are in chunk order
    PipelineChunk c;
    c.first_layer = partition.first_block(k);
    c.layers = partition.blocks_per_part[static_cast<size_t>(k)];
    c.embedding = k == 0;
    c.head = k == parts - 1;
    specs[static_cast<size_t>(k % P)].chunks.push_back(c);
  }
  return specs;
}

WorkspaceSlots workspace_slots(const Schedule& sched, int stage) {
  WorkspaceSlots w;
  w.per_chunk.assign(static_cast<size_t>(sched.virtual_stages), 0);
  std::vector<std::vector<int>> free(static_cast<size_t>(sched.virtual_stages));
  const ActionKind last_use = sched.splits_backward() ? ActionKind::kBackwardWeight : ActionKind::kBackward;
  for (const Action& a : sched.actions.at(static_cast<size_t>(stage))) {
    const auto key = std::make_pair(a.chunk, a.micro);
    auto& pool = free[static_cast<size_t>(a.chunk)];
    const bool touch = a.kind == ActionKind::kForward || (a.kind == ActionKind::kRecv && a.payload == Payload::kActivation);
    if (touch && !w.slot.contains(key)) {
      if (pool.empty()) {
        w.slot[key] = w.per_chunk[static_cast<size_t>(a.chunk)]++;
        w.reused[key] = false;
      } else {
        w.slot[key] = pool.back();
        pool.pop_back();
        w.reused[key] = true;
      }
    }
    if (a.kind == last_use) pool.push_back(w.slot.at(key));
  }
  return w;
}

namespace {
// The input gradient a chunk sends upstream (in the model's activation dtype): none from the first
// virtual stage.
size_t gradient_buffer_bytes(const Model& model, int B, int T, int virtual_stage) {
  return virtual_stage > 0 ? static_cast<size_t>(B) * T * model.config().embd * dtype_size(model.activation_dtype()) : 0;
}
}  // namespace

size_t stage_activation_bytes(const Model& model, int B, int T, const Schedule& sched, int stage) {
  const WorkspaceSlots slots = workspace_slots(sched, stage);
  size_t total = 0;
  for (int c = 0; c < model.chunks(); ++c) {
    // A chunk's workspace is one pool allocation of this many bytes (the model's own planning).
    const size_t ws = model.chunk_workspace_bytes(B, T, c);
    total += ws * static_cast<size_t>(slots.per_chunk[static_cast<size_t>(c)]);
    total += gradient_buffer_bytes(model, B, T, c * sched.stages + stage) * static_cast<size_t>(sched.micro_batches);
  }
  return total;
}

ModelStageWork::ModelStageWork(const Model& model, Device& device, ParamAccess& access, int B, int T,
                               const Schedule& sched, int stage)
    : model_(model), device_(device), access_(access), stages_(sched.stages), micro_batches_(sched.micro_batches),
      virtual_stage0_(stage), slots_(workspace_slots(sched, stage)) {
  ZT_CHECK(model.chunks() == sched.virtual_stages, "a ", model.chunks(), "-chunk stage model under a schedule of ",
           sched.virtual_stages, " virtual stages");
  for (int c = 0; c < model.chunks(); ++c) {
    ws_.emplace_back();
    freed_.emplace_back();
    for (int k = 0; k < slots_.per_chunk[static_cast<size_t>(c)]; ++k) {
      ws_.back().push_back(model.make_chunk_workspace(device, B, T, c));
      freed_.back().push_back(device.create_event());
    }
    if (!ws_.back().empty() && ws_.back().front()->losses().data != nullptr) head_chunk_ = c;
    for (int m = 0; m < micro_batches_; ++m)  // the first virtual stage sends no input gradient
      grad_out_.emplace_back(device.memory(), gradient_buffer_bytes(model, B, T, c * stages_ + stage), device.compute(),
                             "pipeline gradients");
  }
  batches_.resize(static_cast<size_t>(micro_batches_));
  dloss_.assign(static_cast<size_t>(micro_batches_), 0.0f);
  // Pinned: CUDA copies into pageable memory synchronously (the host would wait after every
  // micro-batch's forward for the device to finish it, and not enqueue the backward meanwhile).
  loss_floats_ = static_cast<size_t>(B) * T;
  if (head_chunk_ >= 0)
    for (int m = 0; m < micro_batches_; ++m) loss_host_.push_back(device.alloc_host_pinned(loss_floats_ * sizeof(float)));
}

size_t ModelStageWork::bytes() const {
  size_t total = 0;
  for (const auto& chunk : ws_)
    for (const auto& w : chunk) total += w->bytes();
  for (const DeviceBuffer& g : grad_out_) total += g.size();
  return total;
}

Workspace& ModelStageWork::workspace(int chunk, int micro) {
  const auto it = slots_.slot.find({chunk, micro});
  ZT_CHECK(it != slots_.slot.end(), "pipeline chunk ", chunk, " micro-batch ", micro, " has no workspace");
  return *ws_[static_cast<size_t>(chunk)][static_cast<size_t>(it->second)];
}

const Event* ModelStageWork::receive_after(int chunk, int micro) {
  const auto it = slots_.reused.find({chunk, micro});
  if (it == slots_.reused.end() || !it->second) return nullptr;
  return freed_[static_cast<size_t>(chunk)][static_cast<size_t>(slots_.slot.at({chunk, micro}))].get();
}

void ModelStageWork::release(int chunk, int micro) {
  stream().record(*freed_[static_cast<size_t>(chunk)][static_cast<size_t>(slots_.slot.at({chunk, micro}))]);
}

TensorView ModelStageWork::gradient_out(int chunk, int micro) {
  DeviceBuffer& g = grad_out_[static_cast<size_t>(chunk * micro_batches_ + micro)];
  const TensorView w = workspace(chunk, micro).stage_gradient();
  ZT_CHECK(g.size() > 0, "chunk ", chunk, " of the first virtual stage sends no gradient");
  return TensorView{g.data(), w.dtype, w.shape, w.device};
}

void ModelStageWork::set_batch(int micro, const Batch& batch, float dloss) {
  ZT_CHECK(micro >= 0 && micro < micro_batches_, "micro-batch ", micro, " of ", micro_batches_);
  batches_[static_cast<size_t>(micro)] = batch;
  dloss_[static_cast<size_t>(micro)] = dloss;
}

double ModelStageWork::loss_sum() {
  if (head_chunk_ < 0) return 0;
  stream().synchronize();
  double sum = 0;
  for (const PinnedHostBuffer& l : loss_host_)
    for (size_t i = 0; i < loss_floats_; ++i) sum += static_cast<const float*>(l.data())[i];
  return sum;
}

void ModelStageWork::forward(int chunk, int micro) {
  Workspace& ws = workspace(chunk, micro);
  model_.forward(stream(), access_, ws, batches_[static_cast<size_t>(micro)], dloss_[static_cast<size_t>(micro)], true);
  // The workspace may serve a later micro-batch before the step ends: keep the losses now.
  if (chunk == head_chunk_) {
    stream().copy(loss_host_[static_cast<size_t>(micro)].data(), ws.losses().data, loss_floats_ * sizeof(float));
  }
}

void ModelStageWork::send_gradient(int chunk, int micro) {
  if ((chunk * stages_ + virtual_stage0_) == 0) return;
  const TensorView to = gradient_out(chunk, micro), from = workspace(chunk, micro).stage_gradient();
  stream().copy(to.data, from.data, static_cast<size_t>(from.numel()) * dtype_size(from.dtype));
}

void ModelStageWork::backward(int chunk, int micro) {
  model_.backward(stream(), access_, workspace(chunk, micro), batches_[static_cast<size_t>(micro)]);
  send_gradient(chunk, micro);
  release(chunk, micro);
}

void ModelStageWork::backward_input(int chunk, int micro) {
  model_.backward_input(stream(), access_, workspace(chunk, micro), batches_[static_cast<size_t>(micro)]);
  send_gradient(chunk, micro);
}

void ModelStageWork::backward_weight(int chunk, int micro) {
  model_.backward_weight(stream(), access_, workspace(chunk, micro), batches_[static_cast<size_t>(micro)]);
  release(chunk, micro);
}

}  // namespace zt
