// Sampling text from the model (see sampler.h).
#include "train/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/heartbeat.h"
#include "core/nvtx.h"
#include "core/philox.h"
#include "tokenizer/bpe.h"

namespace zt {

int sample_top_k(const std::vector<float>& row, int top_k, float temperature, double u01) {
  const int V = static_cast<int>(row.size());
  std::vector<int> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  const int k_keep = top_k > 0 ? std::min(top_k, V) : V;
  std::partial_sort(idx.begin(), idx.begin() + k_keep, idx.end(),
                    [&](int a, int b) { return row[static_cast<size_t>(a)] > row[static_cast<size_t>(b)]; });
  const float mx = row[static_cast<size_t>(idx[0])];
  std::vector<double> p(static_cast<size_t>(k_keep));
  double z = 0;
  for (int i = 0; i < k_keep; ++i)
    z += p[static_cast<size_t>(i)] = std::exp((row[static_cast<size_t>(idx[static_cast<size_t>(i)])] - mx) / temperature);
  double u = u01 * z;
  for (int i = 0; i < k_keep; ++i) {
    u -= p[static_cast<size_t>(i)];
    if (u <= 0) return idx[static_cast<size_t>(i)];
  }
  return idx[static_cast<size_t>(k_keep - 1)];
}

namespace {

// The text of token `pick` (bytes as text, other vocabularies as token ids).
void append_token(std::string& out, int pick, int V) {
  if (V <= 256) {
    const char c = static_cast<char>(pick);
    out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? std::string(1, c) : "?";
  } else {
    if (!out.empty()) out.push_back(' ');
    out.append(std::to_string(pick));
  }
}

// The context a sample starts from: the tokenizer's <|endoftext|>, GPT-2's, or a newline byte.
int32_t start_token(const RunContext& run) {
  if (run.tokenizer && run.tokenizer->end_of_text()) return *run.tokenizer->end_of_text();
  return run.mc.vocab >= 50257 ? 50256 : '\n';
}

// What both ways of sampling share: the context and its window of T tokens (the forward's one
// row), the draw from the logits of the window's last position, and the text.
class Sample {
 public:
  Sample(const RunContext& run, uint64_t salt)
      : run_(run), salt_(salt), ctx_{start_token(run)}, window_(static_cast<size_t>(run.T)),
        targets_(static_cast<size_t>(run.T), -1), logits_(static_cast<size_t>(run.mc.vocab)) {}
  // The batch of one row over the device's inputs and targets (the targets: ignore everywhere).
  Batch row_batch(void* inputs, void* targets, int device) const {
    Batch b;
    b.B = 1;
    b.T = run_.T;
    b.inputs = ConstTensorView{inputs, DType::kI32, Shape{1, run_.T}, device};
    b.targets = ConstTensorView{targets, DType::kI32, Shape{1, run_.T}, device};
    return b;
  }
  const std::vector<int32_t>& targets() const { return targets_; }
  // The last T tokens of the context, zero-padded after them.
  const std::vector<int32_t>& window() {
    std::fill(window_.begin(), window_.end(), 0);
    std::copy(ctx_.end() - (last() + 1), ctx_.end(), window_.begin());
    return window_;
  }
  int last() const { return std::min<int>(static_cast<int>(ctx_.size()), run_.T) - 1; }  // the window's last position
  float* logits() { return logits_.data(); }  // of the last position, filled by the caller
  // Token k of the sample, drawn from logits() (deterministic in the seed, the salt and k).
  int32_t draw(int k) const {
    const TrainConfig& cfg = run_.cfg;
    return sample_top_k(logits_, cfg.top_k, cfg.temperature,
                        philox_uniform(cfg.seed, 0x5a3b1e ^ salt_, static_cast<uint64_t>(k)));
  }
  void take(int32_t pick) {
    ctx_.push_back(pick);
    append_token(text_, pick, run_.mc.vocab);
    picks_.push_back(pick);
  }
  std::string text() const { return run_.tokenizer ? run_.tokenizer->decode_text(picks_) : text_; }

 private:
  const RunContext& run_;
  uint64_t salt_;
  std::vector<int32_t> ctx_, window_, targets_, picks_;
  std::vector<float> logits_;
  std::string text_;
};

}  // namespace

// Pipeline stages: per token, the context flows forward through the virtual stages in order (as
// an evaluation batch of one row), the last stage draws the token from its logits and sends it
// back to the first stage, the only one that reads tokens. Every data rank samples the same text.
std::string PipelineStages::sample_rank(World& world, const RunContext& run, int r, int n_tokens, uint64_t salt) {
  const int T = run.T, P = world.mesh().shape().pipeline;
  Device& d = world.device(r);
  Stream& s = d.compute();
  const Model& model = world.model_of(r);
  Communicator& comm = world.comm();
  const int stage = world.stage_of(r);
  const std::vector<int> group = world.mesh().pipeline_group(r);
  std::vector<std::unique_ptr<Workspace>> ws;
  for (int c = 0; c < model.chunks(); ++c) ws.push_back(model.make_chunk_workspace(d, 1, T, c));
  DeviceBuffer inputs(d.memory(), static_cast<size_t>(T) * 4, s, "sample"), targets(d.memory(), static_cast<size_t>(T) * 4, s, "sample");
  DeviceBuffer token(d.memory(), 4, s, "sample token");
  const TensorView token_view{token.data(), DType::kI32, Shape{1}, d.index()};
  Sample sample(run, salt);
  const Batch sb = sample.row_batch(inputs.data(), targets.data(), d.index());
  s.copy(targets.data(), sample.targets().data(), static_cast<size_t>(T) * 4);
  world.engine_of(r).rank(world.engine_rank(r)).begin_pipeline_step(/*forward_only=*/true);
  int32_t pick = 0;
  for (int k = 0; k < n_tokens; ++k) {
    heartbeat();  // a token done: slow sampling is not a hang (core/heartbeat.h)
    if (stage == 0) s.copy(inputs.data(), sample.window().data(), static_cast<size_t>(T) * 4);
    if (Workspace* head = forward_stages(world, r, ws, sb)) {
      head->read_logits_row(s, sample.last(), sample.logits());
      s.synchronize();
      pick = sample.draw(k);
      s.copy(token.data(), &pick, 4);
      comm.send(r, group[0], token_view, &s);  // the first stage embeds the next context
      comm.wait_done(r, s);
      s.synchronize();  // `pick` is read by the copy
    }
    if (stage == 0) {
      comm.recv(r, group[static_cast<size_t>(P - 1)], token_view, &s);
      comm.wait_done(r, s);
      s.copy(&pick, token.data(), 4);
      s.synchronize();
    }
    sample.take(pick);
  }
  return sample.text();
}

// One stage: each rank runs the whole model (or its tensor shard) on the context in a workspace of
// one row, made at the first sample and kept.
std::string OneStage::sample_rank(World& world, const RunContext& run, int r, int n_tokens, uint64_t salt) {
  const int T = run.T;
  RankState& R = world.rank(r);
  Device& d = world.device(r);
  Stream& s = d.compute();
  ZeroRank& engine = world.engine().rank(r);
  std::unique_ptr<Workspace>& ws = sample_ws_[static_cast<size_t>(r)];
  if (!ws) ws = world.model().make_workspace(d, 1, T);
  Sample sample(run, salt);
  const Batch sb = sample.row_batch(R.inputs[0].data(), R.targets[0].data(), d.index());
  for (int k = 0; k < n_tokens; ++k) {
    heartbeat();  // a token done: slow sampling is not a hang (core/heartbeat.h)
    s.copy(R.inputs[0].data(), sample.window().data(), static_cast<size_t>(T) * 4);
    s.copy(R.targets[0].data(), sample.targets().data(), static_cast<size_t>(T) * 4);
    engine.begin_micro_batch(0, /*forward_only=*/true);
    world.model().forward(s, engine, *ws, sb, 0.0f, false);
    engine.end_micro_batch();
    ws->read_logits_row(s, sample.last(), sample.logits());
    s.synchronize();
    sample.take(sample.draw(k));
  }
  return sample.text();
}

std::string sample_text(World& world, const RunContext& run, int n_tokens, uint64_t salt) {
  std::vector<std::string> texts(static_cast<size_t>(world.size()));
  world.for_ranks([&](int r) {
    const NvtxRange sample_range(NvtxCategory::kStep, "sample", world.device(r).index());
    texts[static_cast<size_t>(r)] = world.stages().sample_rank(world, run, r, n_tokens, salt);
  });
  return texts[0];  // every rank drew the same
}

}  // namespace zt
