// What every model shares: make_model's dispatch and the Model/Workspace defaults a model that
// is not split (no tensor or pipeline parallelism) inherits.
#include <algorithm>

#include "core/status.h"
#include "model/model.h"

namespace zt {

std::unique_ptr<Model> make_mlp(const ModelConfig& config, DType activations);

std::unique_ptr<Model> make_gpt(const ModelConfig& config, Recompute recompute, const TensorParallel& tp,
                                DType activations);

// The MLP's activations are a few [B, hidden] rows: it keeps them under every recompute mode.
std::unique_ptr<Model> make_model(const ModelConfig& config, Recompute recompute, const TensorParallel& tp,
                                  DType activations) {
  ZT_REQUIRE(tp.degree == 1 || config.kind == ModelKind::kGpt, "tensor parallelism splits GPT models only, not the MLP");
  return config.kind == ModelKind::kGpt ? make_gpt(config, recompute, tp, activations) : make_mlp(config, activations);
}

DType run_activation_dtype(DType working) {
  const bool sixteen = working == DType::kBF16 || working == DType::kF16;
  return sixteen ? working : DType::kF32;
}

DType Model::compute_dtype(const ParamAccess& p) const {
  const DType activations = activation_dtype();
  if (activations == DType::kF32) return DType::kF32;
  const DType d = p.param_dtype();
  ZT_CHECK(d == DType::kBF16 || d == DType::kF16, "a model computing in ", dtype_name(activations),
           " was given parameters in ", dtype_name(d), " (it reads 16-bit parameters as they are)");
  return d;
}

namespace {
TensorView block_tensor(const ParamLayout& layout, void* base, DType dtype, int device, int block, int idx) {
  const ParamTensor& t = layout.block(block).tensors[static_cast<size_t>(idx)];
  return TensorView{static_cast<char*>(base) + t.offset * static_cast<int64_t>(dtype_size(dtype)), dtype, t.shape,
                    device};
}
}  // namespace

TensorView Model::param(ParamAccess& p, int block, int idx) const {
  const DType d = compute_dtype(p);
  return block_tensor(layout(), d == DType::kF32 ? static_cast<void*>(p.params(block)) : p.param_data(block), d,
                      p.device_index(), block, idx);
}

TensorView Model::grad(ParamAccess& p, int block, int idx) const {
  return block_tensor(layout(), p.grads(block), DType::kF32, p.device_index(), block, idx);
}

std::vector<int> Model::backward_order() const {
  std::vector<int> o = forward_order();
  std::reverse(o.begin(), o.end());
  return o;
}

void Workspace::read_logits_row(Stream& s, int row, float* out) {
  const TensorView l = logits();
  ZT_CHECK(l.dtype == DType::kF32, "read_logits_row of ", dtype_name(l.dtype), " logits without a widening override");
  const int64_t V = l.shape[1];
  s.copy(out, static_cast<const float*>(l.data) + static_cast<int64_t>(row) * V, static_cast<size_t>(V) * sizeof(float));
}

std::unique_ptr<Workspace> Model::make_chunk_workspace(Device& device, int B, int T, int chunk) const {
  ZT_CHECK(chunk == 0, "chunk ", chunk, " of a model that runs one chunk");
  return make_workspace(device, B, T);
}

size_t Model::chunk_workspace_bytes(int B, int T, int chunk) const {
  ZT_CHECK(chunk == 0, "chunk ", chunk, " of a model that runs one chunk");
  return workspace_bytes(B, T);
}

void Model::backward_input(Stream&, ParamAccess&, Workspace&, const Batch&) const {
  ZT_THROW(ErrorKind::kInternal, "this model was not made with a split backward (backward_input)");
}

void Model::backward_weight(Stream&, ParamAccess&, Workspace&, const Batch&) const {
  ZT_THROW(ErrorKind::kInternal, "this model was not made with a split backward (backward_weight)");
}

}  // namespace zt
