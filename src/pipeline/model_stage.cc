// A model's pipeline stage as StageWork (see model_stage.h).
#include "pipeline/model_stage.h"

#include "core/status.h"

namespace zt {

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

ModelStageWork::ModelStageWork(const Model& model, Device& device, ParamAccess& access, int B, int T, int micro_batches)
    : model_(model), device_(device), access_(access), micro_batches_(micro_batches) {
  ZT_CHECK(micro_batches >= 1, "a pipeline step of ", micro_batches, " micro-batches");
  for (int c = 0; c < model.chunks(); ++c)
    for (int m = 0; m < micro_batches; ++m) ws_.push_back(model.make_chunk_workspace(device, B, T, c));
  for (int c = 0; c < model.chunks(); ++c)
    if (workspace(c, 0).losses().data != nullptr) head_chunk_ = c;
  batches_.resize(static_cast<size_t>(micro_batches));
  dloss_.assign(static_cast<size_t>(micro_batches), 0.0f);
}

size_t ModelStageWork::index(int chunk, int micro) const {
  ZT_CHECK(chunk >= 0 && chunk < model_.chunks() && micro >= 0 && micro < micro_batches_, "pipeline chunk ", chunk,
           " micro-batch ", micro, " of ", model_.chunks(), " x ", micro_batches_);
  return static_cast<size_t>(chunk) * static_cast<size_t>(micro_batches_) + static_cast<size_t>(micro);
}

void ModelStageWork::set_batch(int micro, const Batch& batch, float dloss) {
  index(0, micro);
  batches_[static_cast<size_t>(micro)] = batch;
  dloss_[static_cast<size_t>(micro)] = dloss;
}

double ModelStageWork::loss_sum() {
  if (head_chunk_ < 0) return 0;
  stream().synchronize();
  double sum = 0;
  std::vector<float> host;
  for (int m = 0; m < micro_batches_; ++m) {
    const TensorView l = workspace(head_chunk_, m).losses();
    host.resize(static_cast<size_t>(l.numel()));
    stream().copy(host.data(), l.data, host.size() * sizeof(float));
    stream().synchronize();
    for (float v : host) sum += v;
  }
  return sum;
}

void ModelStageWork::forward(int chunk, int micro) {
  model_.forward(stream(), access_, workspace(chunk, micro), batches_[static_cast<size_t>(micro)],
                 dloss_[static_cast<size_t>(micro)], true);
}

void ModelStageWork::backward(int chunk, int micro) {
  model_.backward(stream(), access_, workspace(chunk, micro), batches_[static_cast<size_t>(micro)]);
}

void ModelStageWork::backward_input(int chunk, int micro) {
  model_.backward_input(stream(), access_, workspace(chunk, micro), batches_[static_cast<size_t>(micro)]);
}

void ModelStageWork::backward_weight(int chunk, int micro) {
  model_.backward_weight(stream(), access_, workspace(chunk, micro), batches_[static_cast<size_t>(micro)]);
}

}  // namespace zt
