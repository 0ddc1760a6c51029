// --cuda-graphs: a rank's micro-batch forward+backward captured once (per shape) and replayed for
// every later micro-batch, piecewise around the ZeRO engine's hooks, which stay eager.
//
// Why piecewise: the engine's after_backward hook reduce-scatters each block's gradient on the
// comm stream with the other ranks, inside backward. A capture holds one stream (runtime/
// stream.h), so the compute-stream work between two hooks is one graph: a micro-batch with L
// visited blocks is about 3L + 1 graphs, launched in order with each hook run eagerly in between
// (its collectives, events and plan steps exactly as without graphs). The graphs bake in every
// address the model used, so a configuration is capturable only when the engine hands out the
// same buffers for every micro-batch: resident parameters and gradient buckets, i.e. ZeRO stage 0
// or 1 in fp32 (--tf32 or not); stages 2-3 and 16-bit runs allocate a block's gradient bucket or
// fp32 copies inside the micro-batch, tensor parallelism runs collectives inside each layer, and a
// pipeline stage exchanges activations with its neighbours, so those run eagerly.
//
// The capture is a dry run: the model issues one micro-batch into the captures with the hooks only
// marking segment boundaries (nothing runs, no hook's side effect happens), then the captured
// micro-batch is replayed for real. A failed capture therefore leaves nothing half done: `auto`
// notes why and runs eagerly from then on, `on` throws the reason. The first micro-batch of each
// shape runs eagerly (warm-up: lazily created library state such as a stream's cuBLAS workspace
// comes from the pool, which a capture refuses).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/model.h"
#include "runtime/backend.h"
#include "runtime/stream.h"
#include "train/trainer.h"

namespace zt {

// Why micro-batches of a run with this configuration cannot be captured ("" when they can).
// `working`: the resolved parameter dtype (--precision).
std::string cuda_graphs_unsupported(const TrainConfig& cfg, DType working);
// Whether rank_step captures and replays: --cuda-graphs on (its refusal came earlier, from
// resolve_run_shape), or auto on CUDA devices for a capturable configuration.
bool use_cuda_graphs(const TrainConfig& cfg, Backend backend, DType working);
// auto on CUDA devices with a configuration that cannot be captured: the header's one note ("").
std::string cuda_graphs_note(const TrainConfig& cfg, Backend backend, DType working);

class MicroBatchGraph {
 public:
  // required: --cuda-graphs on (a failed capture throws instead of falling back to eager).
  explicit MicroBatchGraph(bool required) : required_(required) {}

  // Forward (train) and backward of one micro-batch on `s`, as model.forward + model.backward
  // would issue them: eagerly for the first micro-batch of a shape, then captured once and
  // replayed. A new shape (B, T, workspace, batch buffers, dloss) captures again.
  void run(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch, float dloss);

  uint64_t replays() const { return replays_; }  // micro-batches run from graphs
  // Graphs of the current capture that hold work (the stretches between hooks that issue none
  // are not launched).
  size_t segments() const;
  // auto: why graphs were given up, once ("" otherwise, and after the first call).
  std::string take_note();

 private:
  struct Key {
    const Workspace* ws = nullptr;
    const void *inputs = nullptr, *targets = nullptr;
    const float* loss_scale = nullptr;
    int B = 0, T = 0;
    float dloss = 0;
    bool operator==(const Key&) const = default;
  };
  enum class HookKind { kBeforeForward, kBeforeBackward, kAfterBackward };
  struct Hook {
    HookKind kind;
    int block;
  };
  // An address segment `segment` read from the access (params or grads of `block`).
  struct Use {
    size_t segment;
    bool grads;
    int block;
    float* ptr;
  };
  class CaptureAccess;

  // The dry run into segments_; false (note_ set) when auto gives up, throws when required.
  bool capture(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch, float dloss);
  void replay(Stream& s, ParamAccess& access);
  void check_uses(size_t segment, ParamAccess& access) const;
  static std::unique_ptr<StreamGraph> nonempty(std::unique_ptr<StreamGraph> g) {
    return g->size() > 0 ? std::move(g) : nullptr;
  }

  const bool required_;
  bool given_up_ = false;
  bool have_key_ = false;
  Key key_;
  int eager_runs_ = 0;  // of the current key
  std::vector<std::unique_ptr<StreamGraph>> segments_;  // null: nothing was captured there
  std::vector<Hook> hooks_;  // hooks_[i] runs between segments_[i] and segments_[i + 1]
  std::vector<Use> uses_;
  uint64_t replays_ = 0;
  std::string note_;
};

}  // namespace zt
