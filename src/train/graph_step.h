// --cuda-graphs: a rank's micro-batch forward+backward captured once (per shape) and replayed for
// every later micro-batch, piecewise around the ZeRO engine's hooks, which stay eager.
//
// Why piecewise: the engine's after_backward hook reduce-scatters each block's gradient on the
// comm stream with the other ranks, inside backward, and at stage 3 before_* gathers parameters.
// A capture holds one stream (runtime/stream.h), so the compute-stream work between two hooks is
// one piece, one graph: a micro-batch with L visited blocks is about 3L + 1 pieces, launched in
// order with each hook run eagerly in between (its allocations, frees, collectives, events and
// plan steps exactly as without graphs).
//
// Addresses: a piece's graph bakes in every address its work used. The batch, workspace and loss
// scale are the key (a new one captures again), and so is the generation of the streams' library
// blocks (kernels/ops.h stream_block_generation: cuDNN's workspace or a scratch freed for a larger
// one). The engine's buffers are whatever params(b),
// param_data(b) and grads(b) returned while the piece was issued; at ZeRO 2-3 and in 16-bit runs
// these are transient (gradient buckets, gathered parameters, widened fp32 copies) placed by the
// hook before the piece at the offsets the micro-batch's visit plan assigned them in the rank's
// transient arena (zero/visit_plan.h), so they repeat every micro-batch of a run and every piece
// replays after the first micro-batch captured it. The check stays: each piece keeps the
// addresses of its capture, and a replay launches a piece only after the hook before it ran and
// the engine returns exactly those addresses (the graph then touches the buffers the eager issue
// would touch, which the engine made safe for this stream). A ParamAccess whose buffers do move
// is still served: a piece keeps up to kMaxVariants graphs; when none matches, the micro-batch
// continues from that piece by issuing the model again (see issue()), capturing the piece anew
// (counted: recaptures()); `auto` goes eager when that happens for more than a quarter of the
// replayed pieces (kJudgeAfter).
//
// Issuing from piece k: the model issues the whole micro-batch again; the pieces before k, whose
// work already ran, are captured and discarded, their params/grads answered from the addresses
// recorded for them and their hooks skipped; from k on each piece is captured, launched at once
// (its stored graph when one matches the fresh addresses), and followed by its hook for real.
// The first capture of a shape is issuing from piece 0; the first micro-batch of each shape runs
// eagerly (warm-up: lazily created library state such as a stream's cuBLAS workspace comes from
// the pool, which a capture refuses). A capture that fails at piece k (the pool refuses an
// allocation, a record/wait, a synchronisation): `on` throws the reason (the hooks before piece
// k have run), `auto` notes it once and finishes the micro-batch eagerly from piece k, then runs
// eagerly from then on.
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
// `working`: the resolved parameter dtype (--precision); every dtype and ZeRO stage captures.
std::string cuda_graphs_unsupported(const TrainConfig& cfg, DType working);
// Whether rank_step captures and replays: --cuda-graphs on (its refusal came earlier, from
// resolve_run_shape), or auto on CUDA devices for a capturable configuration without --trace (a
// replay records no per-op times).
bool use_cuda_graphs(const TrainConfig& cfg, Backend backend, DType working);
// auto on CUDA devices with a configuration that cannot be captured, or under --trace: the
// header's one note ("" when auto captures).
std::string cuda_graphs_note(const TrainConfig& cfg, Backend backend, DType working);

class MicroBatchGraph {
 public:
  // Graphs a piece keeps for different addresses of the engine's buffers.
  static constexpr size_t kMaxVariants = 4;
  // auto: after this many micro-batches from graphs, gives graphs up when more than a quarter of
  // the replayed pieces had to be captured again.
  static constexpr uint64_t kJudgeAfter = 8;

  // required: --cuda-graphs on (a failed capture throws instead of falling back to eager).
  explicit MicroBatchGraph(bool required) : required_(required) {}

  // Forward (train) and backward of one micro-batch on `s`, as model.forward + model.backward
  // would issue them: eagerly for the first micro-batch of a shape, then captured once and
  // replayed. A new shape (B, T, workspace, batch buffers, dloss) captures again.
  void run(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch, float dloss);

  uint64_t replays() const { return replays_; }  // micro-batches run from graphs, their capture's included
  // Pieces captured again because the engine's buffers were at addresses no stored graph of the
  // piece was captured with.
  uint64_t recaptures() const { return recaptures_; }
  // Pieces of the current capture that hold work (the stretches between hooks that issue none
  // are not launched).
  size_t segments() const;
  // Why graphs were given up (auto), or that pieces were captured again; once ("" otherwise).
  std::string take_note();

 private:
  struct Key {
    const Workspace* ws = nullptr;
    const void *inputs = nullptr, *targets = nullptr;
    const float* loss_scale = nullptr;
    int B = 0, T = 0;
    float dloss = 0;
    uint64_t blocks = 0;  // ops::stream_block_generation(): a library block moved, graphs hold its old address
    bool operator==(const Key&) const = default;
  };
  enum class HookKind { kBeforeForward, kBeforeBackward, kAfterBackward };
  struct Hook {
    HookKind kind;
    int block;
    bool operator==(const Hook&) const = default;
  };
  // One params, grads or param_data answer of the engine, in the order the model asked.
  enum class UseKind { kParams, kGrads, kParamData };
  struct Use {
    UseKind kind;
    int block;
    void* ptr;
    bool operator==(const Use&) const = default;
  };
  static void* ask(ParamAccess& access, UseKind kind, int block);
  // A graph of a piece and the addresses it was captured with (graph null: no work).
  struct Variant {
    std::unique_ptr<StreamGraph> graph;
    std::vector<Use> uses;
  };
  // The work between hook i - 1 and hook i (the last piece: after the last hook). variants[0]
  // is the most recently used.
  struct Piece {
    std::vector<Variant> variants;
  };
  class PieceAccess;

  // Issues the micro-batch with the pieces before `from` already run (see the header); `eager`:
  // pieces from `from` on run without capture. A failed capture throws when required; under auto
  // it sets given_up_ and the micro-batch is finished eagerly.
  void issue(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch, float dloss,
             size_t from, bool eager);
  // The stored variant of piece i captured with the addresses `access` returns now (null: none).
  const Variant* matching(size_t i, ParamAccess& access) const;
  // Stores a piece's fresh capture (or finds the stored variant with the same addresses) and
  // launches it.
  void keep_and_launch(size_t i, std::unique_ptr<StreamGraph> fresh, std::vector<Use> uses, Stream& s);
  void run_hook(const Hook& h, ParamAccess& access) const;
  // auto: gives graphs up (note_) when re-capturing outweighs replaying (kJudgeAfter).
  void judge_recaptures();

  const bool required_;
  bool given_up_ = false;
  bool have_key_ = false;
  bool captured_ = false;  // of the current key
  Key key_;
  int eager_runs_ = 0;  // of the current key
  std::vector<Piece> pieces_;
  std::vector<Hook> hooks_;  // hooks_[i] runs between pieces_[i] and pieces_[i + 1]
  uint64_t replays_ = 0;
  uint64_t recaptures_ = 0;
  uint64_t replayed_pieces_ = 0;  // pieces holding work, of the replays after a capture
  bool recapture_noted_ = false;
  std::string note_;
};

}  // namespace zt
