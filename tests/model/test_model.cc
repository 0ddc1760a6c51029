// Models: parameter counts against GPT-2's published sizes; the GPT and MLP forward losses and
// every gradient against a float64 reference model composed of the float64 op references
// (gradients by central finite differences of that reference, so nothing here trusts the
// backward code under test); deterministic initialisation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/philox.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "resident_params.h"
#include "runtime/runtime.h"
#include "train/sampler.h"

namespace zt {
namespace {

using Blocks = std::vector<std::vector<double>>;

TEST(ModelConfig, PresetParameterCountsMatchGpt2) {
  EXPECT_EQ(make_model_config("gpt2-124m").num_parameters(), 124'439'808);
  EXPECT_EQ(make_model_config("gpt2-350m").num_parameters(), 354'823'168);
  EXPECT_EQ(make_model_config("gpt2-774m").num_parameters(), 774'030'080);
  EXPECT_EQ(make_model_config("gpt2-1558m").num_parameters(), 1'557'611'200);
  // The logical layout holds the real parameters; the GPT's local one also wte's padding rows
  // (the vocabulary padded to a multiple of 128: 50257 -> 50304 rows for GPT-2).
  for (const auto& name : model_preset_names()) {
    const ModelConfig c = make_model_config(name);
    const auto model = make_model(c);
    const ParamLayout& logical = model->tensor_map() ? *model->tensor_map()->logical : model->layout();
    EXPECT_EQ(logical.total_parameters(), c.num_parameters()) << name;
    const int64_t padding = c.kind == ModelKind::kGpt ? (ops::padded_vocab(c.vocab) - c.vocab) * c.embd : 0;
    EXPECT_EQ(model->layout().total_parameters(), c.num_parameters() + padding) << name;
  }
  EXPECT_EQ(make_model(make_model_config("gpt2-124m"))->layout().block(0).tensors[0].shape, (Shape{50304, 768}));
}

TEST(ModelConfig, OverridesAndErrors) {
  ModelOverrides o;
  o.layers = 2;
  o.embd = 64;
  o.heads = 2;
  const ModelConfig c = make_model_config("gpt-tiny", o);
  EXPECT_EQ(c.layers, 2);
  EXPECT_EQ(c.embd, 64);
  EXPECT_THROW(make_model_config("gpt-huge"), Error);
  o.heads = 3;
  try {
    make_model_config("gpt-tiny", o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("divisible"), std::string::npos);
  }
}

// Single-device parameter access over host-initialised blocks. With `only_visited` it acts like
// ZeRO stage 3 at its strictest: only the block of the latest before_* call holds its parameters,
// every other block is NaN, so a model reading a block outside its visit (a recompute issued
// before before_backward) gets NaN gradients.
class TestParams final : public ParamAccess {
 public:
  TestParams(Device& d, const ParamLayout& layout, bool only_visited = false) : d_(d), only_visited_(only_visited) {
    for (const auto& b : layout.blocks()) {
      p_.emplace_back(d.memory(), b.numel * 4, d.compute(), "p");
      g_.emplace_back(d.memory(), b.numel * 4, d.compute(), "g");
      host_.emplace_back(b.numel);
    }
  }
  // Sets block b's parameters (call with the device idle).
  void set(int b, const std::vector<float>& v) {
    host_[b] = v;
    d_.compute().copy(params(b), v.data(), v.size() * 4);
    d_.compute().synchronize();
  }
  int device_index() const override { return d_.index(); }
  float* params(int b) override { return p_[b].as<float>(); }
  float* grads(int b) override { return g_[b].as<float>(); }
  std::vector<int> forward_order, backward_done;
  void before_forward(int b) override {
    forward_order.push_back(b);
    visit(b);
  }
  void before_backward(int b) override { visit(b); }
  void after_backward(int b) override { backward_done.push_back(b); }

 private:
  void visit(int b) {
    if (!only_visited_) return;
    Stream& s = d_.compute();
    for (size_t i = 0; i < p_.size(); ++i)
      if (static_cast<int>(i) != b) s.memset(p_[i].data(), 0xFF, p_[i].size());  // NaN
    s.copy(params(b), host_[b].data(), host_[b].size() * 4);
    s.synchronize();  // host_ may be set again by the test after this
  }
  Device& d_;
  bool only_visited_;
  std::vector<DeviceBuffer> p_, g_;
  std::vector<std::vector<float>> host_;
};

// ---- float64 reference models ----------------------------------------------------------------

const double* tensor(const Blocks& p, const ParamLayout& L, const std::string& name) {
  auto [b, t] = L.find(name);
  return p[b].data() + t->offset;
}

double gpt_loss_ref(const ModelConfig& c, const ParamLayout& L, const Blocks& p,
                    const std::vector<int32_t>& tok, const std::vector<int32_t>& tgt, int64_t B, int64_t T) {
  const int64_t C = c.embd, NH = c.heads, V = c.vocab, BT = B * T;
  auto span = [&](const std::string& n, int64_t len) { return std::span<const double>(tensor(p, L, n), len); };
  std::vector<double> x(BT * C);
  ref::encoder_forward_ref(x, tok, span("wte.weight", V * C), span("wpe.weight", T * C), B, T, C);
  std::vector<double> ln(BT * C), mean(BT), rstd(BT), qkv(BT * 3 * C), y(BT * C), pre(B * NH * T * T),
      att(B * NH * T * T), proj(BT * C), h(BT * 4 * C), hg(BT * 4 * C);
  for (int l = 0; l < c.layers; ++l) {
    const std::string pf = "h." + std::to_string(l) + ".";
    ref::layernorm_forward_ref(ln, mean, rstd, x, span(pf + "ln_1.weight", C), span(pf + "ln_1.bias", C), BT, C, 1e-5);
    ref::matmul_forward_ref(qkv, ln, span(pf + "attn.c_attn.weight", 3 * C * C), span(pf + "attn.c_attn.bias", 3 * C), BT, C, 3 * C);
    ref::attention_forward_ref(y, pre, att, qkv, B, T, C, NH);
    ref::matmul_forward_ref(proj, y, span(pf + "attn.c_proj.weight", C * C), span(pf + "attn.c_proj.bias", C), BT, C, C);
    for (int64_t i = 0; i < BT * C; ++i) x[i] += proj[i];
    ref::layernorm_forward_ref(ln, mean, rstd, x, span(pf + "ln_2.weight", C), span(pf + "ln_2.bias", C), BT, C, 1e-5);
    ref::matmul_forward_ref(h, ln, span(pf + "mlp.c_fc.weight", 4 * C * C), span(pf + "mlp.c_fc.bias", 4 * C), BT, C, 4 * C);
    ref::gelu_forward_ref(hg, h);
    ref::matmul_forward_ref(proj, hg, span(pf + "mlp.c_proj.weight", 4 * C * C), span(pf + "mlp.c_proj.bias", C), BT, 4 * C, C);
    for (int64_t i = 0; i < BT * C; ++i) x[i] += proj[i];
  }
  ref::layernorm_forward_ref(ln, mean, rstd, x, span("ln_f.weight", C), span("ln_f.bias", C), BT, C, 1e-5);
  std::vector<double> logits(BT * V), losses(BT), dl(BT * V);
  ref::matmul_forward_ref(logits, ln, span("wte.weight", V * C), {}, BT, C, V);
  ref::classifier_ref(losses, dl, logits, tgt, BT, V, 0.0);
  double s = 0;
  for (double v : losses) s += v;
  return s / static_cast<double>(BT);
}

double mlp_loss_ref(const ModelConfig& c, const ParamLayout& L, const Blocks& p, const std::vector<double>& in,
                    const std::vector<int32_t>& labels, int64_t B) {
  std::vector<double> x = in;
  int64_t width = c.input_dim;
  const int n = L.num_blocks();
  for (int i = 0; i < n; ++i) {
    const auto& w = L.block(i).tensors[0];
    const int64_t out = w.shape[0];
    std::vector<double> y(B * out);
    ref::matmul_forward_ref(y, x, std::span<const double>(p[i].data() + w.offset, out * width),
                            std::span<const double>(p[i].data() + L.block(i).tensors[1].offset, out), B, width, out);
    if (i + 1 < n) ref::relu_forward_ref(y, std::vector<double>(y));
    x = std::move(y);
    width = out;
  }
  std::vector<double> losses(B), dl(B * width);
  ref::classifier_ref(losses, dl, x, labels, B, width, 0.0);
  double s = 0;
  for (double v : losses) s += v;
  return s / static_cast<double>(B);
}

// Runs the model's forward+backward on the CPU backend and compares the loss and a sample of
// gradient coordinates (every tensor, first/last/random elements) with the float64 reference.
template <typename LossRef>
void check_model(const ModelConfig& c, const Batch& batch_host_shapes, const std::vector<char>& inputs_bytes,
                 const std::vector<int32_t>& targets, LossRef loss_ref, int positions,
                 Recompute recompute = Recompute::kNone) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  auto model = make_model(c, recompute);
  const ParamLayout& L = model->layout();
  TestParams P(d, L, /*only_visited=*/true);
  Blocks host(L.num_blocks());
  for (int b = 0; b < L.num_blocks(); ++b) {
    std::vector<float> f(L.block(b).numel);
    init_block_host(L.block(b), 99, f.data());
    // Perturb norms/biases away from 1/0 so their gradients are exercised generically.
    for (auto& t : L.block(b).tensors)
      if (t.init != ParamInit::kNormal)
        for (int64_t i = 0; i < t.numel; ++i) f[t.offset + i] += 0.1f * philox_normal(5, b * 100 + t.offset, i);
    P.set(b, f);
    s.memset(P.grads(b), 0, f.size() * 4);
    s.synchronize();
    host[b].assign(f.begin(), f.end());
  }
  auto ws = model->make_workspace(d, batch_host_shapes.B, batch_host_shapes.T);
  DeviceBuffer din(d.memory(), inputs_bytes.size(), s, "in"), dtg(d.memory(), targets.size() * 4, s, "tg");
  s.copy(din.data(), inputs_bytes.data(), inputs_bytes.size());
  s.copy(dtg.data(), targets.data(), targets.size() * 4);
  Batch batch = batch_host_shapes;
  batch.inputs.data = din.data();
  batch.inputs.device = 0;
  batch.targets.data = dtg.data();
  batch.targets.device = 0;
  model->forward(s, P, *ws, batch, 1.0f / positions, true);
  model->backward(s, P, *ws, batch);
  std::vector<float> losses(positions);
  s.copy(losses.data(), ws->losses().data, losses.size() * 4);
  s.synchronize();
  double loss = 0;
  for (float l : losses) loss += l;
  loss /= positions;
  const double ref_loss = loss_ref(host);
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss)) << "forward loss";

  // Every block's after_backward fired exactly once.
  std::vector<int> done = P.backward_done;
  std::sort(done.begin(), done.end());
  ASSERT_EQ(static_cast<int>(done.size()), L.num_blocks());
  for (int b = 0; b < L.num_blocks(); ++b) EXPECT_EQ(done[b], b);

  std::mt19937 rng(3);
  int checked = 0;
  for (int b = 0; b < L.num_blocks(); ++b) {
    std::vector<float> g(L.block(b).numel);
    s.copy(g.data(), P.grads(b), g.size() * 4);
    s.synchronize();
    for (const auto& t : L.block(b).tensors) {
      std::vector<int64_t> idx = {0, t.numel - 1, static_cast<int64_t>(rng() % t.numel), static_cast<int64_t>(rng() % t.numel)};
      for (int64_t i : idx) {
        const double h = 1e-5;
        Blocks plus = host, minus = host;
        plus[b][t.offset + i] += h;
        minus[b][t.offset + i] -= h;
        const double fd = (loss_ref(plus) - loss_ref(minus)) / (2 * h);
        const double got = g[t.offset + i];
        EXPECT_NEAR(got, fd, 2e-4 * std::fabs(fd) + 2e-6) << t.name << "[" << i << "]";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 20);
}

TEST(Gpt, ForwardLossAndEveryGradientMatchFloat64Reference) {
  ModelOverrides o;
  o.layers = 2, o.heads = 2, o.embd = 16, o.seq_len = 9, o.vocab = 37;
  const ModelConfig c = make_model_config("gpt-tiny", o);
  const int B = 2, T = 7;  // T below the context: wpe is sliced
  std::vector<int32_t> tok(B * T), tgt(B * T);
  std::mt19937 rng(11);
  for (auto& t : tok) t = rng() % c.vocab;
  for (auto& t : tgt) t = rng() % c.vocab;
  std::vector<char> bytes(reinterpret_cast<char*>(tok.data()), reinterpret_cast<char*>(tok.data() + tok.size()));
  Batch shapes;
  shapes.B = B, shapes.T = T;
  shapes.inputs = ConstTensorView{nullptr, DType::kI32, Shape{B, T}, 0};
  shapes.targets = ConstTensorView{nullptr, DType::kI32, Shape{B, T}, 0};
  auto model = make_model(c);
  const ParamLayout& L = model->layout();
  // Under recomputation backward reads re-run activations; with 2 layers the shared scratch holds
  // layer 1's values when layer 0's backward starts, so a missing or misplaced re-run shows.
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    SCOPED_TRACE(recompute_name(r));
    check_model(c, shapes, bytes, tgt, [&](const Blocks& p) { return gpt_loss_ref(c, L, p, tok, tgt, B, T); }, B * T, r);
  }
}

// Activation bytes per mode, from the shapes: per layer, none keeps ln1, ln2 (BTC each), qkv
// (3BTC), attention output (BTC) and its log-sum-exp (B*NH*T), residual2 and residual3 (BTC each),
// fch and its GELU (4BTC each), and four mean/rstd vectors (BT each). Selective keeps one shared
// copy of ln1, ln2 and GELU output; full keeps residual3 per layer and one shared copy of
// everything else. Every activation is padded to 64 floats.
TEST(Gpt, WorkspaceUnderRecomputeShrinksByTheDroppedActivations) {
  ModelOverrides o;
  o.layers = 5, o.heads = 4, o.embd = 24, o.seq_len = 13, o.vocab = 50;
  const ModelConfig c = make_model_config("gpt-tiny", o);
  const int64_t B = 3, T = 11, C = c.embd, NH = c.heads, L = c.layers;
  auto pad = [](int64_t floats) { return (floats + 63) / 64 * 64 * 4; };
  const int64_t BT = B * T, BTC = BT * C, lse = B * NH * T;
  const int64_t dropped_selective = 2 * pad(BTC) + pad(4 * BTC);
  const int64_t per_layer = 4 * pad(BTC) + pad(3 * BTC) + pad(lse) + 2 * pad(4 * BTC) + 4 * pad(BT) + pad(BTC);
  const int64_t dropped_full = per_layer - pad(BTC);  // all but residual3
  const auto none = static_cast<int64_t>(make_model(c, Recompute::kNone)->workspace_bytes(B, T));
  const auto sel = static_cast<int64_t>(make_model(c, Recompute::kSelective)->workspace_bytes(B, T));
  const auto full = static_cast<int64_t>(make_model(c, Recompute::kFull)->workspace_bytes(B, T));
  EXPECT_EQ(none - sel, (L - 1) * dropped_selective);
  EXPECT_EQ(none - full, (L - 1) * dropped_full);
  // The workspace takes what workspace_bytes says, in every mode.
  auto rt = Runtime::create_cpu(1);
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    auto m = make_model(c, r);
    EXPECT_EQ(m->make_workspace(rt->device(0), B, T)->bytes(), m->workspace_bytes(B, T)) << recompute_name(r);
  }
  // The MLP keeps a few rows of activations and recomputes nothing.
  const ModelConfig mlp = make_model_config("mlp");
  EXPECT_EQ(make_model(mlp, Recompute::kFull)->workspace_bytes(8, 1), make_model(mlp)->workspace_bytes(8, 1));
}

// The tiled attention keeps no T x T buffer: at GPT-2 124M's shape, T = 1024, B = 4, the workspace
// is the T x T attention's plan (the formula below: per layer the probabilities B*NH*T*T, plus the
// scores and both gradients, one shared copy each) less those four buffers, plus an lse per
// layer and one backward scratch.
TEST(Gpt, WorkspaceAtT1024HoldsNoTxTBuffer) {
  const ModelConfig c = make_model_config("gpt2-124m");
  const int64_t B = 4, T = 1024, C = c.embd, NH = c.heads, L = c.layers, V = c.vocab;
  ASSERT_EQ(T, c.seq_len);
  auto pad = [](int64_t floats) { return (floats + 63) / 64 * 64 * 4; };
  const int64_t BT = B * T, BTC = BT * C, att = B * NH * T * T;
  const int64_t old_per_layer =
      4 * pad(BTC) + pad(3 * BTC) + pad(att) + 2 * pad(4 * BTC) + 4 * pad(BT) + pad(BTC);
  const int64_t old_once = pad(BTC) /* encoded */ + pad(BTC) + 2 * pad(BT) + pad(BT * ops::padded_vocab(V)) + pad(BT) /* ln_f, logits, losses */ +
                           pad(att) + 2 * pad(BTC) /* preatt, attproj, fcproj */ +
                           2 * pad(BTC) + 2 * pad(4 * BTC) + pad(BTC) + pad(3 * BTC) /* gradients */ +
                           2 * pad(att) /* dpreatt, datt */;
  const int64_t old_bytes = L * old_per_layer + old_once;
  const int64_t tiled = static_cast<int64_t>(make_model(c)->workspace_bytes(static_cast<int>(B), static_cast<int>(T)));
  const int64_t four_buffers = B * NH * T * T * 4 * 4;
  EXPECT_LE(tiled, old_bytes - four_buffers);
  const int64_t scratch = pad((static_cast<int64_t>(ops::flash_attention_scratch_bytes(B, T, C, NH)) + 3) / 4);
  // Less the GELU output's gradient (4 B T C): matmul_backward_dgelu writes c_fc's output gradient at once.
  EXPECT_EQ(tiled, old_bytes - (L + 3) * pad(att) + L * pad(B * NH * T) + scratch - pad(4 * BTC));
  // No buffer grows faster than T, in any mode or tensor-parallel layout (a T x T one would make
  // the workspace at 2T more than twice that at T).
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    auto m = make_model(c, r);
    EXPECT_LE(m->workspace_bytes(4, 1024), 2 * m->workspace_bytes(4, 512)) << recompute_name(r);
  }
  for (int degree : {2, 4})
    for (bool sequence : {true, false}) {
      TensorParallel tp;
      tp.degree = degree, tp.sequence = sequence;
      auto m = make_model(c, Recompute::kNone, tp);
      EXPECT_LE(m->workspace_bytes(4, 1024), 2 * m->workspace_bytes(4, 512)) << degree << " " << sequence;
    }
}

TEST(Mlp, ForwardLossAndEveryGradientMatchFloat64Reference) {
  ModelConfig c = make_model_config("mlp");
  c.input_dim = 13;
  c.hidden = {11, 7};
  c.classes = 5;
  const int B = 6;
  std::vector<float> in(B * c.input_dim);
  std::vector<int32_t> labels(B);
  std::mt19937 rng(12);
  std::normal_distribution<float> nd;
  for (auto& v : in) v = nd(rng);
  for (auto& l : labels) l = rng() % c.classes;
  std::vector<double> in64(in.begin(), in.end());
  std::vector<char> bytes(reinterpret_cast<char*>(in.data()), reinterpret_cast<char*>(in.data() + in.size()));
  Batch shapes;
  shapes.B = B, shapes.T = 1;
  shapes.inputs = ConstTensorView{nullptr, DType::kF32, Shape{B, c.input_dim}, 0};
  shapes.targets = ConstTensorView{nullptr, DType::kI32, Shape{B}, 0};
  auto model = make_model(c);
  const ParamLayout& L = model->layout();
  check_model(c, shapes, bytes, labels, [&](const Blocks& p) { return mlp_loss_ref(c, L, p, in64, labels, B); }, B);
}

TEST(Init, DeterministicAndGpt2Scaled) {
  const ModelConfig c = make_model_config("gpt-tiny");
  auto model = make_model(c);
  const ParamLayout& L = model->layout();
  const ParamBlock& b1 = L.block(1);
  std::vector<float> a(b1.numel), b(b1.numel), other(b1.numel);
  init_block_host(b1, 7, a.data());
  init_block_host(b1, 7, b.data());
  init_block_host(b1, 8, other.data());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
  EXPECT_NE(std::memcmp(a.data(), other.data(), a.size() * 4), 0);
  for (const auto& t : b1.tensors) {
    double s2 = 0;
    for (int64_t i = 0; i < t.numel; ++i) s2 += double(a[t.offset + i]) * a[t.offset + i];
    const double rms = std::sqrt(s2 / t.numel);
    if (t.init == ParamInit::kNormal) {
      EXPECT_NEAR(rms, t.init_std, 0.1 * t.init_std) << t.name;
    } else if (t.init == ParamInit::kOnes) {
      EXPECT_EQ(rms, 1.0) << t.name;
    } else {
      EXPECT_EQ(rms, 0.0) << t.name;
    }
  }
  // Residual projections are scaled by 1/sqrt(2 L).
  auto [blk, proj] = L.find("h.0.attn.c_proj.weight");
  EXPECT_FLOAT_EQ(proj->init_std, 0.02f / std::sqrt(2.0f * c.layers));
}

// A [B, T] micro-batch of tokens and targets drawn uniformly from [0, vocab) by mt19937(seed), on
// device d (uploaded on its compute stream).
struct RandomBatch {
  RandomBatch(Device& d, int B, int T, int64_t vocab, uint32_t seed)
      : tokens(static_cast<size_t>(B) * T), targets(tokens.size()),
        in(d.memory(), static_cast<size_t>(B) * T * 4, d.compute(), "in"),
        tg(d.memory(), static_cast<size_t>(B) * T * 4, d.compute(), "tg") {
    std::mt19937 rng(seed);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % vocab);
    for (auto& t : targets) t = static_cast<int32_t>(rng() % vocab);
    d.compute().copy(in.data(), tokens.data(), tokens.size() * 4);
    d.compute().copy(tg.data(), targets.data(), targets.size() * 4);
    batch.B = B, batch.T = T;
    batch.inputs = ConstTensorView{in.data(), DType::kI32, Shape{B, T}, d.index()};
    batch.targets = ConstTensorView{tg.data(), DType::kI32, Shape{B, T}, d.index()};
  }
  std::vector<int32_t> tokens, targets;  // the host copies
  DeviceBuffer in, tg;
  Batch batch;
};

// The LM head's logits rows are padded to a multiple of 128 columns (37 -> 128 here). The padding
// is first filled with a logit far above every real one: were any of it read as a logit, the loss
// (compared with the unpadded float64 model) and the greedy pick would change. The sampler draws
// from read_logits_row, which returns the 37 real logits only; a train forward leaves gradient 0
// in the padding and the same losses.
TEST(Gpt, PaddedVocabularyIsMaskedAndNeverSampled) {
  ModelOverrides o;
  o.layers = 1, o.heads = 2, o.embd = 16, o.seq_len = 8, o.vocab = 37;
  const ModelConfig c = make_model_config("gpt-tiny", o);
  const int B = 2, T = 8, BT = B * T;
  const int64_t V = c.vocab, Vp = ops::padded_vocab(V);
  ASSERT_EQ(Vp, 128);
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  auto model = make_model(c);
  const ParamLayout& L = model->layout();
  TestParams P(d, L);
  Blocks host(L.num_blocks());
  for (int b = 0; b < L.num_blocks(); ++b) {
    std::vector<float> f(L.block(b).numel);
    init_block_host(L.block(b), 21, f.data());
    P.set(b, f);
    host[b].assign(f.begin(), f.end());
  }
  const RandomBatch random(d, B, T, V, 5);
  const Batch& batch = random.batch;
  auto ws = model->make_workspace(d, B, T);
  const TensorView logits = ws->logits();
  ASSERT_EQ(logits.shape, (Shape{BT, Vp}));
  const std::vector<float> huge(static_cast<size_t>(BT * Vp), 1e4f);
  s.copy(logits.data, huge.data(), huge.size() * 4);

  model->forward(s, P, *ws, batch, 0.0f, /*train=*/false);
  std::vector<float> losses(BT), l(static_cast<size_t>(BT * Vp));
  s.copy(losses.data(), ws->losses().data, BT * 4);
  s.copy(l.data(), logits.data, l.size() * 4);
  s.synchronize();
  double mean = 0;
  for (float x : losses) mean += x;
  mean /= BT;
  const double want = gpt_loss_ref(c, L, host, random.tokens, random.targets, B, T);
  EXPECT_NEAR(mean, want, 1e-5 * want);
  for (int row = 0; row < BT; ++row) {
    std::vector<float> out(static_cast<size_t>(V) + 1, -7.0f);  // one sentinel past the vocabulary
    ws->read_logits_row(s, row, out.data());
    s.synchronize();
    EXPECT_EQ(out[V], -7.0f) << "read_logits_row wrote past the real vocabulary";
    out.pop_back();
    const float* real = l.data() + static_cast<int64_t>(row) * Vp;
    EXPECT_EQ(std::memcmp(out.data(), real, V * 4), 0) << "row " << row;
    const int64_t argmax = std::max_element(real, real + V) - real;
    EXPECT_EQ(sample_top_k(out, 1, 1.0f, 0.5), argmax) << "row " << row;
    for (double u : {0.0, 0.37, 0.999}) EXPECT_LT(sample_top_k(out, 0, 1.0f, u), V);
  }

  model->forward(s, P, *ws, batch, 1.0f / BT, /*train=*/true);
  std::vector<float> train_losses(BT);
  s.copy(train_losses.data(), ws->losses().data, BT * 4);
  s.copy(l.data(), logits.data, l.size() * 4);
  s.synchronize();
  EXPECT_EQ(std::memcmp(train_losses.data(), losses.data(), BT * 4), 0);
  int padding_not_zero = 0;
  for (int row = 0; row < BT; ++row) {
    double sum = 0;  // softmax - onehot sums to 0 over the real columns
    for (int64_t j = 0; j < V; ++j) sum += l[row * Vp + j];
    EXPECT_NEAR(sum, 0.0, 1e-7) << "row " << row;
    for (int64_t j = V; j < Vp; ++j) padding_not_zero += l[row * Vp + j] != 0.0f || std::signbit(l[row * Vp + j]);
  }
  EXPECT_EQ(padding_not_zero, 0);
}

// ---- 16-bit activations (make_model(..., DType::kBF16)) ----------------------------------------

struct GptRun {
  double loss = 0;
  std::vector<std::vector<float>> grads;  // per block
};

// One training forward + backward of `model` on `P` (parameters set by the caller) over fixed
// random tokens; the mean loss and every block's gradient.
GptRun run_gpt(const Model& model, ParamAccess& P, Device& d, int B, int T, uint64_t seed) {
  Stream& s = d.compute();
  const ModelConfig& c = model.config();
  const int BT = B * T;
  const RandomBatch random(d, B, T, c.vocab, static_cast<uint32_t>(seed));
  const Batch& batch = random.batch;
  auto ws = model.make_workspace(d, B, T);
  model.forward(s, P, *ws, batch, 1.0f / BT, true);
  model.backward(s, P, *ws, batch);
  std::vector<float> losses(BT);
  EXPECT_EQ(ws->losses().dtype, DType::kF32);
  s.copy(losses.data(), ws->losses().data, BT * 4);
  GptRun out;
  const ParamLayout& L = model.layout();
  for (int b = 0; b < L.num_blocks(); ++b) {
    out.grads.emplace_back(L.block(b).numel);
    s.copy(out.grads.back().data(), P.grads(b), out.grads.back().size() * 4);
  }
  s.synchronize();
  for (float l : losses) out.loss += l;
  out.loss /= BT;
  return out;
}

// bf16 and fp16 runs against an fp32 run of the same (16-bit-representable) parameters. Each
// activation is rounded to 16 bits about ten times per layer (unit roundoff u: bf16 2^-8, fp16
// 2^-11), so the loss may move by a few u relative and a gradient tensor by some tens of u in
// relative L2 norm; the bounds are 4u (loss) and 16u (gradients). A model that secretly computed
// in fp32 would match bit for bit, which the last check rules out.
TEST(Gpt16, Bf16AndFp16TrackTheFp32RunOfTheSameParameters) {
  ModelOverrides o;
  o.layers = 2, o.heads = 2, o.embd = 32, o.seq_len = 16, o.vocab = 61;
  const ModelConfig c = make_model_config("gpt-tiny", o);
  const int B = 2, T = 16;
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double u = dt == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
    auto m16 = make_model(c, Recompute::kNone, {}, dt);
    auto m32 = make_model(c);
    EXPECT_EQ(m16->activation_dtype(), dt);
    EXPECT_EQ(m32->activation_dtype(), DType::kF32);
    const ParamLayout& L = m16->layout();
    Params16 P16(d, L, dt);
    TestParams P32(d, L);
    for (int b = 0; b < L.num_blocks(); ++b) {
      std::vector<float> f(L.block(b).numel);
      init_block_host(L.block(b), 7, f.data());
      for (auto& t : L.block(b).tensors)  // norms and biases away from 1/0
        if (t.init != ParamInit::kNormal)
          for (int64_t i = 0; i < t.numel; ++i) f[t.offset + i] += 0.1f * philox_normal(9, b * 100 + t.offset, i);
      P32.set(b, P16.set(b, f));
      d.compute().memset(P32.grads(b), 0, f.size() * 4);
    }
    const GptRun r16 = run_gpt(*m16, P16, d, B, T, 3), r32 = run_gpt(*m32, P32, d, B, T, 3);
    EXPECT_NEAR(r16.loss, r32.loss, 4 * u * r32.loss);
    bool any_differs = false;
    for (int b = 0; b < L.num_blocks(); ++b)
      for (const auto& t : L.block(b).tensors) {
        double err = 0, norm = 0;
        for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
          const double a = r16.grads[b][i], e = r32.grads[b][i];
          err += (a - e) * (a - e), norm += e * e;
          any_differs |= a != e;
        }
        ASSERT_GT(norm, 0) << t.name;
        EXPECT_LE(std::sqrt(err / norm), 16 * u) << t.name;
      }
    EXPECT_TRUE(any_differs) << "the 16-bit model computed the fp32 bits";
  }
}

// What a bf16 GPT keeps: about half the fp32 workspace (only layernorm statistics, lse, losses and
// the attention scratch stay fp32), logits in bf16 that read_logits_row widens exactly, and the
// same bits under every recompute mode.
TEST(Gpt16, Bf16WorkspaceIsHalfLogitsAreBf16AndRecomputeKeepsTheBits) {
  ModelOverrides o;
  o.layers = 2, o.heads = 2, o.embd = 32, o.seq_len = 16, o.vocab = 61;
  const ModelConfig c = make_model_config("gpt-tiny", o);
  const int B = 2, T = 16, BT = B * T;
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    const double ratio = static_cast<double>(make_model(c, r, {}, DType::kBF16)->workspace_bytes(B, T)) /
                         static_cast<double>(make_model(c, r)->workspace_bytes(B, T));
    EXPECT_GT(ratio, 0.45) << recompute_name(r);
    EXPECT_LT(ratio, 0.6) << recompute_name(r);
  }
  // At GPT-2 124M's shape the fp32 remainder (statistics, lse, scratch) is a few percent.
  const ModelConfig g = make_model_config("gpt2-124m");
  const double big = static_cast<double>(make_model(g, Recompute::kNone, {}, DType::kBF16)->workspace_bytes(4, 1024)) /
                     static_cast<double>(make_model(g)->workspace_bytes(4, 1024));
  EXPECT_GT(big, 0.5);
  EXPECT_LT(big, 0.53);
  // The tensor-parallel GPT too (degree 2, with and without sequence parallelism): the fp32
  // remainder there also holds the replicated gradients' sums and the cross-entropy statistics.
  for (bool sequence : {true, false}) {
    TensorParallel tp;
    tp.degree = 2, tp.sequence = sequence;
    const double tp_ratio =
        static_cast<double>(make_model(g, Recompute::kNone, tp, DType::kBF16)->workspace_bytes(4, 1024)) /
        static_cast<double>(make_model(g, Recompute::kNone, tp)->workspace_bytes(4, 1024));
    EXPECT_GT(tp_ratio, 0.5) << sequence;
    EXPECT_LT(tp_ratio, 0.53) << sequence;
    EXPECT_EQ(make_model(g, Recompute::kNone, tp, DType::kBF16)->activation_dtype(), DType::kBF16);
  }

  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  std::vector<GptRun> runs;
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    auto m = make_model(c, r, {}, DType::kBF16);
    const ParamLayout& L = m->layout();
    Params16 P(d, L, DType::kBF16);
    for (int b = 0; b < L.num_blocks(); ++b) {
      std::vector<float> f(L.block(b).numel);
      init_block_host(L.block(b), 13, f.data());
      P.set(b, f);
    }
    runs.push_back(run_gpt(*m, P, d, B, T, 5));
    if (r != Recompute::kNone) continue;
    // Logits of an evaluation forward: bf16 [BT, Vp]; read_logits_row widens row `row` exactly.
    auto ws = m->make_workspace(d, B, T);
    EXPECT_EQ(ws->logits().dtype, DType::kBF16);
    EXPECT_EQ(ws->bytes(), m->workspace_bytes(B, T));
    std::vector<int32_t> tok(BT, 3), tgt(BT, 4);
    DeviceBuffer din(d.memory(), BT * 4, s, "in"), dtg(d.memory(), BT * 4, s, "tg");
    for (int i = 0; i < BT; ++i) tok[i] = (7 * i) % c.vocab;
    s.copy(din.data(), tok.data(), BT * 4);
    s.copy(dtg.data(), tgt.data(), BT * 4);
    Batch batch;
    batch.B = B, batch.T = T;
    batch.inputs = ConstTensorView{din.data(), DType::kI32, Shape{B, T}, 0};
    batch.targets = ConstTensorView{dtg.data(), DType::kI32, Shape{B, T}, 0};
    m->forward(s, P, *ws, batch, 0.0f, false);
    const int64_t Vp = ws->logits().shape[1];
    std::vector<uint16_t> bits(static_cast<size_t>(BT * Vp));
    s.copy(bits.data(), ws->logits().data, bits.size() * 2);
    for (int row : {0, 5, BT - 1}) {
      std::vector<float> out(static_cast<size_t>(c.vocab) + 1, -7.0f);
      ws->read_logits_row(s, row, out.data());
      s.synchronize();
      EXPECT_EQ(out[c.vocab], -7.0f) << "read_logits_row wrote past the real vocabulary";
      for (int j = 0; j < c.vocab; ++j)
        ASSERT_EQ(out[j], bf16_bits_to_float(bits[static_cast<size_t>(row * Vp + j)])) << row << " " << j;
    }
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    EXPECT_EQ(runs[i].loss, runs[0].loss) << i;
    for (size_t b = 0; b < runs[0].grads.size(); ++b)
      EXPECT_EQ(std::memcmp(runs[i].grads[b].data(), runs[0].grads[b].data(), runs[0].grads[b].size() * 4), 0)
          << "block " << b << " mode " << i;
  }
}

}  // namespace
// The MLP in bf16 and fp16 against the fp32 MLP of the same (16-bit-representable) parameters and
// inputs rounded once: every activation is rounded to 16 bits about three times per layer, so the
// loss may move by a few u relative (bound 4u) and a gradient tensor by some u in relative L2 norm
// (bound 16u, as the GPT's). The workspace holds 16-bit activations (under 0.6 of fp32's, the fp32
// losses and logits scratch aside), and read_logits_row widens the 16-bit logits exactly.
TEST(Mlp16, Bf16AndFp16TrackTheFp32RunOfTheSameParameters) {
  ModelConfig c = make_model_config("mlp");
  c.input_dim = 48;
  c.hidden = {64, 40};
  c.classes = 10;
  const int B = 16;
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  std::vector<float> in(static_cast<size_t>(B) * c.input_dim);
  std::vector<int32_t> labels(B);
  for (auto& v : in) v = nd(rng);
  for (auto& l : labels) l = static_cast<int32_t>(rng() % c.classes);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double u = dt == DType::kBF16 ? 0x1p-8 : 0x1p-11;
    auto m16 = make_model(c, Recompute::kNone, {}, dt), m32 = make_model(c);
    EXPECT_EQ(m16->activation_dtype(), dt);
    const double ratio =
        static_cast<double>(m16->workspace_bytes(256, 1)) / static_cast<double>(m32->workspace_bytes(256, 1));
    EXPECT_GT(ratio, 0.45);
    EXPECT_LT(ratio, 0.6);
    const ParamLayout& L = m16->layout();
    Params16 P16(d, L, dt);
    TestParams P32(d, L);
    for (int b = 0; b < L.num_blocks(); ++b) {
      std::vector<float> f(L.block(b).numel);
      init_block_host(L.block(b), 5, f.data());
      for (auto& t : L.block(b).tensors)  // biases away from 0
        if (t.init != ParamInit::kNormal)
          for (int64_t i = 0; i < t.numel; ++i) f[t.offset + i] += 0.1f * philox_normal(3, b * 100 + t.offset, i);
      P32.set(b, P16.set(b, f));
      s.memset(P32.grads(b), 0, f.size() * 4);
    }
    // The fp32 model reads the inputs as the 16-bit one rounds them (once, on the device).
    std::vector<float> in_r(in.size());
    for (size_t i = 0; i < in.size(); ++i)
      in_r[i] = dt == DType::kBF16 ? bf16_bits_to_float(float_to_bf16_bits(in[i]))
                                   : half_bits_to_float(float_to_half_bits(in[i]));
    DeviceBuffer x16(d.memory(), in.size() * 4, s, "x16"), x32(d.memory(), in.size() * 4, s, "x32"),
        tg(d.memory(), labels.size() * 4, s, "tg");
    s.copy(x16.data(), in.data(), in.size() * 4);
    s.copy(x32.data(), in_r.data(), in.size() * 4);
    s.copy(tg.data(), labels.data(), labels.size() * 4);
    auto run = [&](const Model& m, ParamAccess& P, const DeviceBuffer& x, std::vector<float>* logits) {
      Batch batch;
      batch.B = B, batch.T = 1;
      batch.inputs = ConstTensorView{x.data(), DType::kF32, Shape{B, c.input_dim}, d.index()};
      batch.targets = ConstTensorView{tg.data(), DType::kI32, Shape{B}, d.index()};
      auto ws = m.make_workspace(d, B, 1);
      m.forward(s, P, *ws, batch, 0.0f, false);
      logits->resize(static_cast<size_t>(B) * c.classes);
      for (int i = 0; i < B; ++i) ws->read_logits_row(s, i, logits->data() + static_cast<size_t>(i) * c.classes);
      m.forward(s, P, *ws, batch, 1.0f / B, true);
      m.backward(s, P, *ws, batch);
      std::vector<float> losses(B);
      EXPECT_EQ(ws->losses().dtype, DType::kF32);
      s.copy(losses.data(), ws->losses().data, B * 4);
      GptRun out;
      for (int b = 0; b < L.num_blocks(); ++b) {
        out.grads.emplace_back(L.block(b).numel);
        s.copy(out.grads.back().data(), P.grads(b), out.grads.back().size() * 4);
      }
      s.synchronize();
      for (float l : losses) out.loss += l;
      out.loss /= B;
      return out;
    };
    std::vector<float> l16, l32;
    const GptRun r16 = run(*m16, P16, x16, &l16), r32 = run(*m32, P32, x32, &l32);
    EXPECT_NEAR(r16.loss, r32.loss, 4 * u * r32.loss);
    double lerr = 0, lnorm = 0;
    for (size_t i = 0; i < l32.size(); ++i) {
      lerr += (l16[i] - l32[i]) * double(l16[i] - l32[i]), lnorm += double(l32[i]) * l32[i];
      const float r = dt == DType::kBF16 ? bf16_bits_to_float(float_to_bf16_bits(l16[i]))
                                         : half_bits_to_float(float_to_half_bits(l16[i]));
      EXPECT_EQ(r, l16[i]) << "logit " << i << " is not a widened 16-bit value";
    }
    EXPECT_LE(std::sqrt(lerr / lnorm), 8 * u);
    bool any_differs = false;
    for (int b = 0; b < L.num_blocks(); ++b)
      for (const auto& t : L.block(b).tensors) {
        double err = 0, norm = 0;
        for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
          const double a = r16.grads[b][i], e = r32.grads[b][i];
          err += (a - e) * (a - e), norm += e * e;
          any_differs |= a != e;
        }
        ASSERT_GT(norm, 0) << t.name;
        EXPECT_LE(std::sqrt(err / norm), 16 * u) << t.name;
      }
    EXPECT_TRUE(any_differs) << "the 16-bit model computed the fp32 bits";
  }
}

}  // namespace zt
