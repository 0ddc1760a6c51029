// MLP classifier: Linear -> ReLU -> ... -> Linear -> softmax cross-entropy. One block per layer.
// With 16-bit activations (make_model) the input rows, activations, their gradients and the logits
// are 16-bit and the GEMMs read the 16-bit parameters; the losses and every gradient stay fp32.
#include <algorithm>
#include <cmath>

#include "core/status.h"
#include "kernels/ops.h"
#include "model/model.h"

namespace zt {

namespace {

// Offsets are in bytes. Activations, their gradients, the logits and the 16-bit copy of the input
// take `act_bytes` each element (4: fp32, 2: bf16/f16); the losses and the fp32 logits scratch of
// a 16-bit run (read_logits_row) are fp32.
struct MlpPlan {
  int64_t B, act_bytes, total = 0, logits = 0, losses = 0, dx = 0, dh = 0, width = 0;
  int64_t input = -1, logits_f32 = -1;  // 16-bit only
  std::vector<int64_t> h, a;  // pre- and post-activation of each hidden layer
  std::vector<int64_t> dims;  // input, hidden..., classes

  int64_t add_bytes(int64_t bytes) {
    const int64_t off = total;
    total += (bytes + 255) / 256 * 256;
    return off;
  }
  int64_t act(int64_t n) { return add_bytes(n * act_bytes); }
  MlpPlan(const ModelConfig& c, int64_t B_, DType activations)
      : B(B_), act_bytes(static_cast<int64_t>(dtype_size(activations))) {
    dims.push_back(c.input_dim);
    for (int hd : c.hidden) dims.push_back(hd);
    dims.push_back(c.classes);
    width = *std::max_element(dims.begin() + 1, dims.end());
    if (act_bytes != 4) input = act(B * dims[0]);
    for (size_t i = 0; i + 2 < dims.size(); ++i) {
      h.push_back(act(B * dims[i + 1]));
      a.push_back(act(B * dims[i + 1]));
    }
    logits = act(B * c.classes);
    losses = add_bytes(B * 4);
    if (act_bytes != 4) logits_f32 = add_bytes(B * c.classes * 4);
    dx = act(B * width);
    dh = act(B * width);
  }
};

class MlpWorkspace final : public Workspace {
 public:
  MlpWorkspace(const ModelConfig& c, Device& d, int B, DType activations)
      : plan(c, B, activations),
        dtype(activations),
        device(d.index()),
        buf(d.memory(), static_cast<size_t>(plan.total), d.compute(), "activations") {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return 1; }
  TensorView losses() override { return at(plan.losses, DType::kF32, Shape{plan.B}); }
  TensorView logits() override { return view(plan.logits, Shape{plan.B, plan.dims.back()}); }
  size_t bytes() const override { return buf.size(); }
  // 16-bit logits are widened (exactly) on the device into the fp32 scratch first.
  void read_logits_row(Stream& s, int row, float* out) override {
    const int64_t K = plan.dims.back();
    if (dtype == DType::kF32) return Workspace::read_logits_row(s, row, out);
    const TensorView wide = at(plan.logits_f32 + row * K * 4, DType::kF32, Shape{K});
    ops::cast(s, wide, view(plan.logits + row * K * plan.act_bytes, Shape{K}));
    s.copy(out, wide.data, static_cast<size_t>(K) * sizeof(float));
  }
  TensorView at(int64_t off, DType t, Shape s) { return TensorView{buf.as<char>() + off, t, s, device}; }
  TensorView view(int64_t off, Shape s) { return at(off, dtype, s); }

  MlpPlan plan;
  DType dtype;  // of the last forward (the model's compute dtype on its parameters)
  int device;
  DeviceBuffer buf;
};

class Mlp final : public Model {
 public:
  Mlp(const ModelConfig& c, DType activations) : config_(c), activations_(activations) {
    int64_t in = c.input_dim;
    std::vector<int64_t> outs(c.hidden.begin(), c.hidden.end());
    outs.push_back(c.classes);
    for (size_t i = 0; i < outs.size(); ++i) {
      const bool last = i + 1 == outs.size();
      const std::string name = "fc" + std::to_string(i);
      const int b = layout_.add_block(name);
      // He initialisation for ReLU layers, LeCun for the output layer.
      const float std = std::sqrt((last ? 1.0f : 2.0f) / static_cast<float>(in));
      layout_.add_tensor(b, name + ".weight", Shape{outs[i], in}, ParamInit::kNormal, std, true);
      layout_.add_tensor(b, name + ".bias", Shape{outs[i]}, ParamInit::kZeros, 0, false);
      in = outs[i];
    }
  }

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  DType activation_dtype() const override { return activations_; }
  size_t workspace_bytes(int B, int) const override {
    return static_cast<size_t>(MlpPlan(config_, B, activations_).total);
  }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int) const override {
    return std::make_unique<MlpWorkspace>(config_, d, B, activations_);
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
      TensorView out = last ? ws.logits() : ws.view(P.h[static_cast<size_t>(i)], Shape{P.B, P.dims[i + 1]});
      ops::matmul_forward(s, out, x, param(p, i, 0), param(p, i, 1));
      if (!last) {
        TensorView a = ws.view(P.a[static_cast<size_t>(i)], Shape{P.B, P.dims[i + 1]});
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
                                  : ConstTensorView(ws.view(P.a[static_cast<size_t>(i - 1)], Shape{P.B, P.dims[i]}));
      // The first layer's input gradient (the data's) is not needed; the others overwrite dx.
      TensorView dx = i == 0 ? TensorView{} : ws.view(P.dx, Shape{P.B, P.dims[i]});
      ops::matmul_backward(s, dx, grad(p, i, 0), grad(p, i, 1), dout, in, param(p, i, 0), /*overwrite_din=*/true);
      p.after_backward(i);
      if (i > 0) {
        // dh may overwrite the previous dout: matmul_backward consumed it earlier on this stream.
        TensorView dh = ws.view(P.dh, Shape{P.B, P.dims[i]});
        ops::fill(s, dh, 0.0f);
        ops::relu_backward(s, dh, ws.view(P.h[static_cast<size_t>(i - 1)], Shape{P.B, P.dims[i]}), dx);
        dout = dh;
      }
    }
  }

  std::vector<int> forward_order() const override {
    std::vector<int> o;
    for (int b = 0; b < layout_.num_blocks(); ++b) o.push_back(b);
    return o;
  }
  std::vector<int> backward_order() const override {
    std::vector<int> o;
    for (int b = layout_.num_blocks() - 1; b >= 0; --b) o.push_back(b);
    return o;
  }

 private:
  // The first layer's input in the activation dtype: the batch's fp32 rows, or (16-bit) their copy
  // rounded once by forward (convert) and read again by backward.
  ConstTensorView input(Stream& s, MlpWorkspace& ws, const Batch& batch, bool convert) const {
    if (activations_ == DType::kF32) return batch.inputs;
    const TensorView x = ws.view(ws.plan.input, batch.inputs.shape);
    if (convert) ops::cast(s, x, batch.inputs);
    return x;
  }
  // The dtype this model computes in on `p` (param_compute_dtype).
  DType compute_dtype(ParamAccess& p) const { return param_compute_dtype(activations_, p); }
  // Parameters in the compute dtype (a 16-bit MLP reads the engine's 16-bit working parameters as
  // they are); gradients are fp32.
  TensorView param(ParamAccess& p, int block, int idx) const { return block_param(layout_, activations_, p, block, idx); }
  TensorView grad(ParamAccess& p, int block, int idx) const { return block_grad(layout_, p, block, idx); }

  ModelConfig config_;
  DType activations_;
  ParamLayout layout_;
};

}  // namespace

std::unique_ptr<Model> make_mlp(const ModelConfig& config, DType activations) {
  return std::make_unique<Mlp>(config, activations);
}

}  // namespace zt
