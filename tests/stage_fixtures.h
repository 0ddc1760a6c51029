// Fixtures of the pipeline-stage tests (tests/pipeline/test_pipeline_runtime.cc and
// tests/model/test_gpt_tp_stage.cc): a tiny GPT, deterministic micro-batches on a device, and the
// one-device reference step they are checked against, and the comparisons of its results.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "model/model.h"
#include "resident_params.h"
#include "runtime/runtime.h"

namespace zt::stage_test {

using Blocks = std::vector<std::vector<float>>;

// 4 layers, 32 wide, 4 heads, context 16; vocabulary 96 (padded to 128 at tensor degree 2, so the
// last vocabulary shard is partly padding).
inline ModelConfig tiny_config() {
  ModelOverrides o;
  o.layers = 4;
  o.embd = 32;
  o.heads = 4;
  o.seq_len = 16;
  o.vocab = 96;
  return make_model_config("gpt-tiny", o);
}

constexpr int kB = 2, kT = 8;

// Micro-batch m's tokens or targets (some positions ignored).
inline std::vector<int32_t> tokens(const ModelConfig& c, int m, bool targets) {
  std::vector<int32_t> v;
  for (int i = 0; i < kB * kT; ++i) {
    if (targets && (i + m) % 7 == 3)
      v.push_back(-1);
    else
      v.push_back(((i + 17 * m) * (targets ? 53 : 37) + (targets ? 5 : 11)) % c.vocab);
  }
  return v;
}

// A device's copy of every micro-batch.
struct DeviceBatches {
  std::vector<DeviceBuffer> buffers;
  std::vector<Batch> batches;
  DeviceBatches(const ModelConfig& c, Device& d, int micro) {
    Stream& s = d.compute();
    for (int m = 0; m < micro; ++m) {
      Batch b;
      b.B = kB, b.T = kT;
      for (bool targets : {false, true}) {
        const std::vector<int32_t> host = tokens(c, m, targets);
        buffers.emplace_back(d.memory(), host.size() * 4, s, "batch");
        s.copy(buffers.back().data(), host.data(), host.size() * 4);
        s.synchronize();
        (targets ? b.targets : b.inputs) = ConstTensorView{buffers.back().data(), DType::kI32, Shape{kB, kT}, d.index()};
      }
      batches.push_back(b);
    }
  }
};

inline float dloss_of(int micro) { return 1.0f / static_cast<float>(micro * kB * kT); }

struct StepResult {
  double loss = 0;  // sum over positions, nats
  Blocks grads;     // logical blocks (a tied head copy's gradient added to block 0's)
};

// The local blocks of `m` (a GPT or a pipeline stage of it, whose wte is padded, model/gpt.cc; or
// tensor rank t's shards) from logical blocks.
// The loss within tol relative, and every block's gradient within tol of its largest magnitude.
inline void expect_close(const StepResult& got, const StepResult& want, double tol, const std::string& what) {
  EXPECT_NEAR(got.loss, want.loss, tol * std::fabs(want.loss)) << what;
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t b = 0; b < want.grads.size(); ++b) {
    double scale = 0, worst = 0;
    for (float w : want.grads[b]) scale = std::max(scale, static_cast<double>(std::fabs(w)));
    for (size_t i = 0; i < want.grads[b].size(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(got.grads[b][i]) - want.grads[b][i]));
    EXPECT_LE(worst, tol * scale) << what << ": logical block " << b;
  }
}

inline bool same_bits(const StepResult& a, const StepResult& b) {
  if (a.loss != b.loss) return false;
  for (size_t k = 0; k < a.grads.size(); ++k)
    if (std::memcmp(a.grads[k].data(), b.grads[k].data(), a.grads[k].size() * 4) != 0) return false;
  return true;
}

inline Blocks to_local(const Model& m, const Blocks& logical, int t = 0) {
  std::vector<const float*> ptrs;
  for (const auto& b : logical) ptrs.push_back(b.data());
  Blocks out;
  for (int b = 0; b < m.layout().num_blocks(); ++b) out.push_back(m.tensor_map()->local_block(t, b, ptrs));
  return out;
}
// Adds local block b of `m` (tensor rank t) at its logical places (padding maps nowhere).
inline void add_logical(const Model& m, int b, const std::vector<float>& local, Blocks& logical, int t = 0) {
  m.tensor_map()->for_each_run(t, b, 0, m.layout().block(b).numel, [&](int lb, int64_t lo, int64_t li, int64_t n) {
    for (int64_t k = 0; k < n; ++k)
      logical[static_cast<size_t>(lb)][static_cast<size_t>(lo + k)] += local[static_cast<size_t>(li + k)];
  });
}
inline Blocks zero_logical(const ModelConfig& c) {
  const ParamLayout whole = gpt_layout(c);
  Blocks out;
  for (const auto& b : whole.blocks()) out.emplace_back(static_cast<size_t>(b.numel), 0.0f);
  return out;
}

// One device, the whole model, `micro` micro-batches accumulated in order: the reference; load()
// sets new parameters (gradients zeroed) for the next step. Parameters and gradients are logical
// blocks (the model's padded wte mapped onto the real rows).
class OneDeviceRig {
 public:
  OneDeviceRig(const ModelConfig& c, const Blocks& host, int micro)
      : rt_(Runtime::create_cpu(1)), model_(make_model(c)), micro_(micro), c_(c), local_(to_local(*model_, host)),
        p_(rt_->device(0), model_->layout(), [&](int b) -> const std::vector<float>& { return local_[static_cast<size_t>(b)]; }),
        db_(c, rt_->device(0), micro), ws_(model_->make_workspace(rt_->device(0), kB, kT)) {}
  void load(const Blocks& host) {
    local_ = to_local(*model_, host);
    p_.load([&](int b) -> const std::vector<float>& { return local_[static_cast<size_t>(b)]; });
  }
  StepResult step() {
    Device& d = rt_->device(0);
    StepResult r;
    std::vector<float> losses(kB * kT);
    for (int m = 0; m < micro_; ++m) {
      model_->forward(d.compute(), p_, *ws_, db_.batches[static_cast<size_t>(m)], dloss_of(micro_), true);
      d.compute().copy(losses.data(), ws_->losses().data, losses.size() * 4);
      model_->backward(d.compute(), p_, *ws_, db_.batches[static_cast<size_t>(m)]);
      d.compute().synchronize();
      for (float l : losses) r.loss += l;
    }
    r.grads = zero_logical(c_);
    for (int b = 0; b < model_->layout().num_blocks(); ++b) add_logical(*model_, b, p_.grad_host(b), r.grads);
    return r;
  }

 private:
  std::unique_ptr<Runtime> rt_;
  std::unique_ptr<Model> model_;
  int micro_;
  ModelConfig c_;
  Blocks local_;
  ResidentParams p_;
  DeviceBatches db_;
  std::unique_ptr<Workspace> ws_;
};

inline StepResult run_one_device(const ModelConfig& c, const Blocks& host, int micro) {
  return OneDeviceRig(c, host, micro).step();
}

}  // namespace zt::stage_test
