// MLP classifier: Linear -> ReLU -> ... -> Linear -> softmax cross-entropy. One block per layer.
#include <algorithm>
#include <cmath>

#include "core/status.h"
#include "kernels/ops.h"
#include "model/model.h"

namespace zt {

namespace {

struct MlpPlan {
  int64_t B, total = 0, logits = 0, losses = 0, dx = 0, dh = 0, width = 0;
  std::vector<int64_t> h, a;  // pre- and post-activation of each hidden layer
  std::vector<int64_t> dims;  // input, hidden..., classes

  int64_t add(int64_t n) {
    const int64_t off = total;
    total += (n + 63) / 64 * 64;
    return off;
  }
  MlpPlan(const ModelConfig& c, int64_t B_) : B(B_) {
    dims.push_back(c.input_dim);
    for (int hd : c.hidden) dims.push_back(hd);
    dims.push_back(c.classes);
    width = *std::max_element(dims.begin(), dims.end());
    for (size_t i = 0; i + 2 < dims.size(); ++i) {
      h.push_back(add(B * dims[i + 1]));
      a.push_back(add(B * dims[i + 1]));
    }
    logits = add(B * c.classes);
    losses = add(B);
    dx = add(B * width);
    dh = add(B * width);
  }
};

class MlpWorkspace final : public Workspace {
 public:
  MlpWorkspace(const ModelConfig& c, Device& d, int B)
      : plan(c, B), device(d.index()), buf(d.memory(), static_cast<size_t>(plan.total) * 4, d.compute(), "activations") {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return 1; }
  TensorView losses() override { return view(plan.losses, Shape{plan.B}); }
  TensorView logits() override { return view(plan.logits, Shape{plan.B, plan.dims.back()}); }
  size_t bytes() const override { return buf.size(); }
  TensorView view(int64_t off, Shape s) { return TensorView{buf.as<float>() + off, DType::kF32, s, device}; }

  MlpPlan plan;
  int device;
  DeviceBuffer buf;
};

class Mlp final : public Model {
 public:
  explicit Mlp(const ModelConfig& c) : config_(c) {
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
  size_t workspace_bytes(int B, int) const override { return static_cast<size_t>(MlpPlan(config_, B).total) * 4; }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int) const override {
    return std::make_unique<MlpWorkspace>(config_, d, B);
  }

  void forward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch, float dloss,
               bool train) const override {
    auto& ws = static_cast<MlpWorkspace&>(wsb);
    const MlpPlan& P = ws.plan;
    const int n = layout_.num_blocks();
    ConstTensorView x = batch.inputs;
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
    ConstTensorView dout = ws.logits();  // holds dlogits after a train forward
    for (int i = n - 1; i >= 0; --i) {
      p.before_backward(i);
      ConstTensorView in = i == 0 ? batch.inputs
                                  : ConstTensorView(ws.view(P.a[static_cast<size_t>(i - 1)], Shape{P.B, P.dims[i]}));
      TensorView dx = ws.view(P.dx, Shape{P.B, P.dims[i]});
      ops::fill(s, dx, 0.0f);
      ops::matmul_backward(s, dx, grad(p, i, 0), grad(p, i, 1), dout, in, param(p, i, 0));
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
  TensorView param(ParamAccess& p, int block, int idx) const {
    const ParamTensor& t = layout_.block(block).tensors[static_cast<size_t>(idx)];
    return TensorView{p.params(block) + t.offset, DType::kF32, t.shape, p.device_index()};
  }
  TensorView grad(ParamAccess& p, int block, int idx) const {
    const ParamTensor& t = layout_.block(block).tensors[static_cast<size_t>(idx)];
    return TensorView{p.grads(block) + t.offset, DType::kF32, t.shape, p.device_index()};
  }

  ModelConfig config_;
  ParamLayout layout_;
};

}  // namespace

std::unique_ptr<Model> make_mlp(const ModelConfig& config) { return std::make_unique<Mlp>(config); }

}  // namespace zt
