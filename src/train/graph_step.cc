// --cuda-graphs (train/graph_step.h): which runs can capture, and the piecewise capture/replay of
// one rank's micro-batch around the engine's hooks.
#include "train/graph_step.h"

#include "core/status.h"

namespace zt {

std::string cuda_graphs_unsupported(const TrainConfig& cfg, DType working) {
  if (cfg.pipeline_parallel > 1)
    return "pipeline stages exchange activations with their neighbours inside every micro-batch";
  if (cfg.tensor_parallel > 1) return "tensor parallelism runs collectives inside every layer's forward and backward";
  if (cfg.zero_stage >= 2)
    return "ZeRO stage " + std::to_string(cfg.zero_stage) + " allocates each block's gradient bucket" +
           (cfg.zero_stage == 3 ? " and gathered parameters" : "") +
           " inside the micro-batch, at addresses a graph cannot keep; use --zero-stage 0 or 1";
  if (working != DType::kF32)
    return std::string("--precision ") + dtype_name(working) +
           " widens each block's parameters into fp32 copies allocated inside the micro-batch, at addresses a "
           "graph cannot keep; use --precision fp32";
  return "";
}

bool use_cuda_graphs(const TrainConfig& cfg, Backend backend, DType working) {
  switch (cfg.cuda_graphs) {
    case CudaGraphs::kOff: return false;
    case CudaGraphs::kOn: return true;
    case CudaGraphs::kAuto: return backend == Backend::kCuda && cuda_graphs_unsupported(cfg, working).empty();
  }
  return false;
}

std::string cuda_graphs_note(const TrainConfig& cfg, Backend backend, DType working) {
  if (cfg.cuda_graphs != CudaGraphs::kAuto || backend != Backend::kCuda) return "";
  const std::string why = cuda_graphs_unsupported(cfg, working);
  return why.empty() ? "" : "--cuda-graphs auto runs eagerly: " + why;
}

// The dry run's access: the engine's buffers (noted per segment), and every hook a segment
// boundary instead of the hook.
class MicroBatchGraph::CaptureAccess final : public ParamAccess {
 public:
  CaptureAccess(MicroBatchGraph& g, ParamAccess& inner, Stream& s) : g_(g), inner_(inner), s_(s) {}
  int device_index() const override { return inner_.device_index(); }
  float* params(int b) override { return note(false, b, inner_.params(b)); }
  float* grads(int b) override { return note(true, b, inner_.grads(b)); }
  void before_forward(int b) override { boundary(HookKind::kBeforeForward, b); }
  void before_backward(int b) override { boundary(HookKind::kBeforeBackward, b); }
  void after_backward(int b) override { boundary(HookKind::kAfterBackward, b); }

 private:
  float* note(bool grads, int b, float* p) {
    g_.uses_.push_back(Use{g_.segments_.size(), grads, b, p});
    return p;
  }
  void boundary(HookKind kind, int b) {
    g_.segments_.push_back(g_.nonempty(s_.end_capture()));
    g_.hooks_.push_back(Hook{kind, b});
    s_.begin_capture();
  }

  MicroBatchGraph& g_;
  ParamAccess& inner_;
  Stream& s_;
};

void MicroBatchGraph::run(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch,
                          float dloss) {
  const Key key{&ws, batch.inputs.data, batch.targets.data, batch.loss_scale, batch.B, batch.T, dloss};
  if (!have_key_ || !(key == key_)) {
    key_ = key;
    have_key_ = true;
    eager_runs_ = 0;
    segments_.clear();
    hooks_.clear();
    uses_.clear();
  }
  if (given_up_ || eager_runs_ < 1 || (segments_.empty() && !capture(model, s, access, ws, batch, dloss))) {
    ++eager_runs_;
    model.forward(s, access, ws, batch, dloss, true);
    model.backward(s, access, ws, batch);
    return;
  }
  replay(s, access);
}

bool MicroBatchGraph::capture(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch,
                              float dloss) {
  segments_.clear();
  hooks_.clear();
  uses_.clear();
  CaptureAccess dry(*this, access, s);
  std::string why;
  try {
    s.begin_capture();
    model.forward(s, dry, ws, batch, dloss, true);
    model.backward(s, dry, ws, batch);
    segments_.push_back(nonempty(s.end_capture()));
  } catch (const std::exception& e) {
    why = e.what();
    if (const auto* ze = dynamic_cast<const Error*>(&e)) why = ze->message();
    if (s.capturing()) {
      // Leave capture mode; its first reason says more than the call that tripped over it.
      try {
        s.end_capture();
      } catch (const Error& end) {
        why = end.message();
      }
    }
  }
  if (why.empty()) return true;
  segments_.clear();
  hooks_.clear();
  uses_.clear();
  if (required_) ZT_THROW(ErrorKind::kInvalidArgument, "--cuda-graphs on could not capture a micro-batch: ", why);
  given_up_ = true;
  note_ = "--cuda-graphs auto runs eagerly from here on: " + why;
  return false;
}

void MicroBatchGraph::check_uses(size_t segment, ParamAccess& access) const {
  for (const Use& u : uses_) {
    if (u.segment != segment) continue;
    float* now = u.grads ? access.grads(u.block) : access.params(u.block);
    ZT_CHECK(now == u.ptr, "a captured micro-batch would use block ", u.block, "'s ", u.grads ? "gradient" : "parameters",
             " at the address of the capture, but the engine moved them (a configuration cuda_graphs_unsupported "
             "should have refused)");
  }
}

void MicroBatchGraph::replay(Stream& s, ParamAccess& access) {
  check_uses(0, access);
  if (segments_[0]) segments_[0]->launch(s);
  for (size_t i = 0; i < hooks_.size(); ++i) {
    const Hook& h = hooks_[i];
    switch (h.kind) {
      case HookKind::kBeforeForward: access.before_forward(h.block); break;
      case HookKind::kBeforeBackward: access.before_backward(h.block); break;
      case HookKind::kAfterBackward: access.after_backward(h.block); break;
    }
    check_uses(i + 1, access);
    if (segments_[i + 1]) segments_[i + 1]->launch(s);
  }
  ++replays_;
}

size_t MicroBatchGraph::segments() const {
  size_t n = 0;
  for (const auto& g : segments_) n += g != nullptr;
  return n;
}

std::string MicroBatchGraph::take_note() {
  std::string n;
  n.swap(note_);
  return n;
}

}  // namespace zt
