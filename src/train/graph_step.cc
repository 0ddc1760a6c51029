// --cuda-graphs (train/graph_step.h): which runs can capture, and the piecewise capture/replay of
// one rank's micro-batch around the engine's hooks.
#include "train/graph_step.h"

#include <algorithm>

#include "core/status.h"
#include "kernels/ops.h"

namespace zt {

namespace {

// Null for a graph without work (a stretch between hooks that issues nothing is not launched).
std::unique_ptr<StreamGraph> nonempty(std::unique_ptr<StreamGraph> g) {
  return g && g->size() > 0 ? std::move(g) : nullptr;
}

}  // namespace

std::string cuda_graphs_unsupported(const TrainConfig& cfg, DType working) {
  if (cfg.pipeline_parallel > 1)
    return "pipeline stages exchange activations with their neighbours inside every micro-batch";
  if (cfg.tensor_parallel > 1) return "tensor parallelism runs collectives inside every layer's forward and backward";
  (void)working;  // every ZeRO stage and precision: the engine's buffers are checked per piece
  return "";
}

namespace {
// Why auto stays eager in a run it could capture ("" when it captures): --trace times each op by
// an event pair, which a replayed graph does not record, so a graphed run's trace would hold no
// per-op times (scripts/op_table.py reads them). --cuda-graphs on still captures under --trace.
std::string auto_stays_eager(const TrainConfig& cfg, DType working) {
  std::string why = cuda_graphs_unsupported(cfg, working);
  if (why.empty() && !cfg.trace_path.empty())
    why = "--trace times every op, which a replayed graph does not (--cuda-graphs on captures anyway)";
  return why;
}
}  // namespace

bool use_cuda_graphs(const TrainConfig& cfg, Backend backend, DType working) {
  switch (cfg.cuda_graphs) {
    case CudaGraphs::kOff: return false;
    case CudaGraphs::kOn: return true;
    case CudaGraphs::kAuto: return backend == Backend::kCuda && auto_stays_eager(cfg, working).empty();
  }
  return false;
}

std::string cuda_graphs_note(const TrainConfig& cfg, Backend backend, DType working) {
  if (cfg.cuda_graphs != CudaGraphs::kAuto || backend != Backend::kCuda) return "";
  const std::string why = auto_stays_eager(cfg, working);
  return why.empty() ? "" : "--cuda-graphs auto runs eagerly: " + why;
}

// The model's view while MicroBatchGraph::issue runs it: pieces before `from` captured and
// discarded with their recorded addresses and no hooks; later pieces captured and launched at each
// hook (or, eager, issued directly), the hooks run for real.
class MicroBatchGraph::PieceAccess final : public ParamAccess {
 public:
  PieceAccess(MicroBatchGraph& g, ParamAccess& inner, Stream& s, size_t from, bool eager)
      : g_(g), inner_(inner), s_(s), from_(from), eager_(eager) {}
  int device_index() const override { return inner_.device_index(); }
  float* params(int b) override { return static_cast<float*>(use(UseKind::kParams, b)); }
  float* grads(int b) override { return static_cast<float*>(use(UseKind::kGrads, b)); }
  DType param_dtype() const override { return inner_.param_dtype(); }
  void* param_data(int b) override { return use(UseKind::kParamData, b); }
  void before_forward(int b) override { boundary(Hook{HookKind::kBeforeForward, b}); }
  void before_backward(int b) override { boundary(Hook{HookKind::kBeforeBackward, b}); }
  void after_backward(int b) override { boundary(Hook{HookKind::kAfterBackward, b}); }

  void start() { begin_piece(); }
  void finish() { end_piece(); }
  size_t piece() const { return piece_; }
  // A capture of a piece at or after `from` is open or ending: what fails now failed the capture.
  bool live() const { return live_; }

 private:
  bool skipped() const { return piece_ < from_; }

  void* use(UseKind kind, int b) {
    if (skipped()) {
      const std::vector<Use>& uses = g_.pieces_.at(piece_).variants.at(0).uses;
      ZT_CHECK(next_ < uses.size() && uses[next_].kind == kind && uses[next_].block == b, "the model asked for block ",
               b, "'s buffer ", static_cast<int>(kind), " where its earlier issue of the micro-batch did not");
      return uses[next_++].ptr;
    }
    const bool was_live = live_;
    live_ = false;  // the engine's own checks are not capture failures
    void* p = ask(inner_, kind, b);
    live_ = was_live;
    if (!eager_) fresh_.push_back(Use{kind, b, p});
    return p;
  }

  void boundary(const Hook& h) {
    end_piece();
    if (piece_ < g_.hooks_.size()) {
      ZT_CHECK(g_.hooks_[piece_] == h, "the model issued its hooks in a different order than at the capture");
    } else {
      g_.hooks_.push_back(h);
    }
    if (!skipped()) g_.run_hook(h, inner_);
    ++piece_;
    begin_piece();
  }

  void begin_piece() {
    next_ = 0;
    fresh_.clear();
    if (skipped() || !eager_) {
      live_ = !skipped();
      s_.begin_capture();
    }
  }

  void end_piece() {
    if (skipped()) {
      s_.end_capture();  // this piece's work ran already: discarded
      return;
    }
    if (eager_) return;
    std::unique_ptr<StreamGraph> fresh = s_.end_capture();  // throws the capture's failure
    live_ = false;
    g_.keep_and_launch(piece_, std::move(fresh), std::move(fresh_), s_);
    fresh_ = {};
  }

  MicroBatchGraph& g_;
  ParamAccess& inner_;
  Stream& s_;
  const size_t from_;
  const bool eager_;
  size_t piece_ = 0;
  size_t next_ = 0;  // skipped pieces: the next recorded use to answer
  bool live_ = false;
  std::vector<Use> fresh_;  // live pieces: the addresses the engine returned
};

void MicroBatchGraph::run(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch,
                          float dloss) {
  const Key key{&ws, batch.inputs.data, batch.targets.data, batch.loss_scale, batch.B, batch.T, dloss,
                ops::stream_block_generation()};
  if (!have_key_ || !(key == key_)) {
    key_ = key;
    have_key_ = true;
    eager_runs_ = 0;
    captured_ = false;
    pieces_.clear();
    hooks_.clear();
  }
  if (given_up_ || eager_runs_ < 1) {
    ++eager_runs_;
    model.forward(s, access, ws, batch, dloss, true);
    model.backward(s, access, ws, batch);
    key_.blocks = ops::stream_block_generation();  // what the warm-up grew is what a capture will use
    return;
  }
  if (!captured_) {
    pieces_.clear();
    hooks_.clear();
    captured_ = true;
    issue(model, s, access, ws, batch, dloss, 0, /*eager=*/false);
    replays_ += given_up_ ? 0 : 1;
    return;
  }
  ++replays_;
  replayed_pieces_ += segments();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    if (i > 0) run_hook(hooks_[i - 1], access);
    const Variant* v = matching(i, access);
    if (!v) {
      issue(model, s, access, ws, batch, dloss, i, /*eager=*/false);
      judge_recaptures();
      return;
    }
    std::vector<Variant>& vs = pieces_[i].variants;
    const auto at = vs.begin() + (v - vs.data());
    std::rotate(vs.begin(), at, at + 1);  // most recently used first: a later issue answers from it
    if (vs[0].graph) vs[0].graph->launch(s);
  }
}

void MicroBatchGraph::judge_recaptures() {
  if (required_ || given_up_ || replays_ < kJudgeAfter || recaptures_ * 4 <= replayed_pieces_) return;
  given_up_ = true;
  note_ = "--cuda-graphs auto runs eagerly from here on: the engine placed its transient buffers at new addresses "
          "for " + std::to_string(recaptures_) + " of " + std::to_string(replayed_pieces_) +
          " replayed pieces, and capturing them again costs more than issuing them";
}

void MicroBatchGraph::issue(const Model& model, Stream& s, ParamAccess& access, Workspace& ws, const Batch& batch,
                            float dloss, size_t from, bool eager) {
  PieceAccess acc(*this, access, s, from, eager);
  std::string why;
  try {
    acc.start();
    model.forward(s, acc, ws, batch, dloss, true);
    model.backward(s, acc, ws, batch);
    acc.finish();
    return;
  } catch (const std::exception& e) {
    const bool failed_capture = acc.live();
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
    if (!failed_capture) throw;
  }
  if (required_) ZT_THROW(ErrorKind::kInvalidArgument, "--cuda-graphs on could not capture a micro-batch: ", why);
  given_up_ = true;
  note_ = "--cuda-graphs auto runs eagerly from here on: " + why;
  issue(model, s, access, ws, batch, dloss, acc.piece(), /*eager=*/true);
}

const MicroBatchGraph::Variant* MicroBatchGraph::matching(size_t i, ParamAccess& access) const {
  const std::vector<Variant>& vs = pieces_[i].variants;
  ZT_CHECK(!vs.empty(), "piece ", i, " of a captured micro-batch has no graph");
  // Every variant asked for the same buffers in the same order (the model issues deterministically).
  std::vector<void*> now;
  now.reserve(vs[0].uses.size());
  for (const Use& u : vs[0].uses) now.push_back(ask(access, u.kind, u.block));
  for (const Variant& v : vs) {
    bool same = true;
    for (size_t k = 0; k < now.size() && same; ++k) same = v.uses[k].ptr == now[k];
    if (same) return &v;
  }
  return nullptr;
}

void MicroBatchGraph::keep_and_launch(size_t i, std::unique_ptr<StreamGraph> fresh, std::vector<Use> uses,
                                      Stream& s) {
  if (pieces_.size() == i) pieces_.emplace_back();
  ZT_CHECK(i < pieces_.size(), "piece ", i, " issued before piece ", pieces_.size());
  std::vector<Variant>& vs = pieces_[i].variants;
  auto at = std::find_if(vs.begin(), vs.end(), [&](const Variant& v) { return v.uses == uses; });
  if (at != vs.end()) {
    std::rotate(vs.begin(), at, at + 1);  // the stored graph does the same work: fresh is dropped
  } else {
    if (!vs.empty()) {
      ++recaptures_;
      if (!recapture_noted_ && note_.empty())
        note_ = "--cuda-graphs: the engine placed a block's transient buffer at an address no graph of its piece "
                "was captured with, so that piece was captured again (this repeats when the pool's reuse varies)";
      recapture_noted_ = true;
    }
    if (vs.size() == kMaxVariants) vs.pop_back();  // the least recently used
    vs.insert(vs.begin(), Variant{nonempty(std::move(fresh)), std::move(uses)});
  }
  if (vs[0].graph) vs[0].graph->launch(s);
}

void* MicroBatchGraph::ask(ParamAccess& access, UseKind kind, int block) {
  switch (kind) {
    case UseKind::kParams: return access.params(block);
    case UseKind::kGrads: return access.grads(block);
    case UseKind::kParamData: return access.param_data(block);
  }
  ZT_THROW(ErrorKind::kInternal, "unknown buffer kind");
}

void MicroBatchGraph::run_hook(const Hook& h, ParamAccess& access) const {
  switch (h.kind) {
    case HookKind::kBeforeForward: access.before_forward(h.block); break;
    case HookKind::kBeforeBackward: access.before_backward(h.block); break;
    case HookKind::kAfterBackward: access.after_backward(h.block); break;
  }
}

size_t MicroBatchGraph::segments() const {
  size_t n = 0;
  for (const Piece& p : pieces_) n += !p.variants.empty() && p.variants[0].graph != nullptr;
  return n;
}

std::string MicroBatchGraph::take_note() {
  std::string n;
  n.swap(note_);
  return n;
}

}  // namespace zt
