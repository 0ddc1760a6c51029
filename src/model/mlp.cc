// MLP classifier: Linear -> ReLU -> ... -> Linear -> softmax cross-entropy. One block per layer.
// With 16-bit activations (make_model) the input rows, activations, their gradients and the logits
// are 16-bit and the GEMMs read the 16-bit parameters; the losses and every gradient stay fp32.
#include <algorithm>
#include <cmath>
#include <utility>

#include "core/status.h"
#include "kernels/ops.h"
#include "model/model.h"

namespace zt {

namespace {

// Activations, their gradients, the logits and the 16-bit copy of the input in the activation
// dtype; the losses and the fp32 logits scratch of a 16-bit run (read_logits_row) fp32.
struct MlpPlan : WorkspaceArena {
  int64_t B, logits = 0, losses = 0, dx = 0, dh = 0, width = 0;
  int64_t input = -1, logits_f32 = -1;  // 16-bit only
  std::vector<int64_t> h, a;  // pre- and post-activation of each hidden layer
  std::vector<int64_t> dims;  // input, hidden..., classes

  MlpPlan(std::vector<int64_t> dims_, int64_t B_, DType activations)
      : WorkspaceArena{static_cast<int64_t>(dtype_size(activations))}, B(B_), dims(std::move(dims_)) {
    width = *std::max_element(dims.begin() + 1, dims.end());
    if (act_bytes != 4) input = act(B * dims[0]);
    for (size_t i = 0; i + 2 < dims.size(); ++i) {
      h.push_back(act(B * dims[i + 1]));
      a.push_back(act(B * dims[i + 1]));
    }
    logits = act(B * dims.back());
    losses = f32(B);
    if (act_bytes != 4) logits_f32 = f32(B * dims.back());
    dx = act(B * width);
    dh = act(B * width);
  }
};

class MlpWorkspace final : public ArenaWorkspace {
 public:
  MlpWorkspace(MlpPlan plan_, Device& d, DType activations)
      : ArenaWorkspace(d, plan_.total, activations), plan(std::move(plan_)) {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return 1; }
  TensorView losses() override { return f32(plan.losses, Shape{plan.B}); }
  TensorView logits() override { return act(plan.logits, Shape{plan.B, plan.dims.back()}); }
  // 16-bit logits are widened (exactly) on the device into the fp32 scratch first.
  void read_logits_row(Stream& s, int row, float* out) override {
    const int64_t K = plan.dims.back();
    if (dtype == DType::kF32) return Workspace::read_logits_row(s, row, out);
    const TensorView wide = f32(plan.logits_f32 + row * K * 4, Shape{K});
    ops::cast(s, wide, act(plan.logits + row * K * plan.act_bytes, Shape{K}));
    s.copy(out, wide.data, static_cast<size_t>(K) * sizeof(float));
  }

  MlpPlan plan;
};

class Mlp final : public Model {
 public:
  Mlp(const ModelConfig& c, DType activations) : config_(c), activations_(activations), dims_{c.input_dim} {
    dims_.insert(dims_.end(), c.hidden.begin(), c.hidden.end());
    dims_.push_back(c.classes);
    for (size_t i = 0; i + 1 < dims_.size(); ++i) {
      const int64_t in = dims_[i], out = dims_[i + 1];
      const std::string name = "fc" + std::to_string(i);
      const int b = layout_.add_block(name);
      // He initialisation for ReLU layers, LeCun for the output layer.
      const float std = std::sqrt((i + 2 == dims_.size() ? 1.0f : 2.0f) / static_cast<float>(in));
      layout_.add_tensor(b, name + ".weight", Shape{out, in}, ParamInit::kNormal, std, true);
      layout_.add_tensor(b, name + ".bias", Shape{out}, ParamInit::kZeros, 0, false);
    }
  }

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  DType activation_dtype() const override { return activations_; }
  size_t workspace_bytes(int B, int) const override {
    return static_cast<size_t>(MlpPlan(dims_, B, activations_).total);
  }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int) const override {
    return std::make_unique<MlpWorkspace>(MlpPlan(dims_, B, activations_), d, activations_);
  }

  void forward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch, float dloss,
               bool train) const override {
    auto& ws = static_cast<MlpWorkspace&>(wsb);
    const MlpPlan& P = ws.plan;
    const int n = layout_.num_blocks();
    ws.dtype = compute_dtype(p);  // after --on-scale-collapse bf16, the engine's new working dtype
    ConstTensorView x = input(s, ws, batch, true);
    for (int i = 0; i < n; ++i) {
      p.before_forward(i);
      const bool last = i + 1 == n;
      TensorView out = last ? ws.logits() : ws.act(P.h[static_cast<size_t>(i)], Shape{P.B, P.dims[i + 1]});
      ops::matmul_forward(s, out, x, param(p, i, 0), param(p, i, 1));
      if (!last) {
        TensorView a = ws.act(P.a[static_cast<size_t>(i)], Shape{P.B, P.dims[i + 1]});
        ops::relu_forward(s, a, out);
        x = a;
      }
    }
    ops::classifier_forward_backward(s, ws.logits(), ws.losses(), batch.targets, dloss, train, batch.loss_scale);
  }

  void backward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch) const override {
    auto& ws = static_cast<MlpWorkspace&>(wsb);
    const MlpPlan& P = ws.plan;
    const int n = layout_.num_blocks();
    ZT_CHECK(ws.dtype == compute_dtype(p), "backward in ", dtype_name(compute_dtype(p)), " after a forward in ",
             dtype_name(ws.dtype));
    ConstTensorView dout = ws.logits();  // holds dlogits after a train forward
    for (int i = n - 1; i >= 0; --i) {
      p.before_backward(i);
      ConstTensorView in = i == 0 ? input(s, ws, batch, false)
                                  : ConstTensorView(ws.act(P.a[static_cast<size_t>(i - 1)], Shape{P.B, P.dims[i]}));
      // The first layer's input gradient (the data's) is not needed; the others overwrite dx.
      TensorView dx = i == 0 ? TensorView{} : ws.act(P.dx, Shape{P.B, P.dims[i]});
      ops::matmul_backward(s, dx, grad(p, i, 0), grad(p, i, 1), dout, in, param(p, i, 0), /*overwrite_din=*/true);
      p.after_backward(i);
      if (i > 0) {
        // dh may overwrite the previous dout: matmul_backward consumed it earlier on this stream.
        TensorView dh = ws.act(P.dh, Shape{P.B, P.dims[i]});
        ops::fill(s, dh, 0.0f);
        ops::relu_backward(s, dh, ws.act(P.h[static_cast<size_t>(i - 1)], Shape{P.B, P.dims[i]}), dx);
        dout = dh;
      }
    }
  }

  std::vector<int> forward_order() const override {
    std::vector<int> o;
    for (int b = 0; b < layout_.num_blocks(); ++b) o.push_back(b);
    return o;
  }

 private:
  // The first layer's input in the activation dtype: the batch's fp32 rows, or (16-bit) their copy
  // rounded once by forward (convert) and read again by backward.
  ConstTensorView input(Stream& s, MlpWorkspace& ws, const Batch& batch, bool convert) const {
    if (activations_ == DType::kF32) return batch.inputs;
    const TensorView x = ws.act(ws.plan.input, batch.inputs.shape);
    if (convert) ops::cast(s, x, batch.inputs);
    return x;
  }
  ModelConfig config_;
  DType activations_;
  std::vector<int64_t> dims_;  // each layer's width: input, hidden..., classes
  ParamLayout layout_;
};

}  // namespace

std::unique_ptr<Model> make_mlp(const ModelConfig& config, DType activations) {
  return std::make_unique<Mlp>(config, activations);
}

}  // namespace zt
