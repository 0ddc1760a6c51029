// GPT inference on a device (train/generate.h), on the CPU backend: the KV-cache decode and the
// model's own forward against a float64 forward written out here, the cache one token at a time
// against the model's forward (greedy generation must pick the same tokens, also past the context),
// sampling's determinism in the seed, and bf16 against fp32 within a bound derived below. On every
// backend (GenerateBackendTest: the CUDA instance on a GPU, gpu-check): the cache and the model's
// forward in fp32/bf16/fp16 against float64 within the tolerance policy's bounds (tests/README.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "model/model.h"
#include "runtime/runtime.h"
#include "train/generate.h"

#include "tolerance.h"

namespace zt {
namespace {

struct RandomGpt {
  ModelConfig mc;
  ParamLayout layout;
  std::vector<std::vector<float>> blocks;
  const float* tensor(const std::string& name) const {
    const auto [b, t] = layout.find(name);
    return blocks[static_cast<size_t>(b)].data() + t->offset;
  }
};

RandomGpt random_gpt(uint32_t seed) {
  RandomGpt m;
  ModelOverrides o;
  o.layers = 2;
  o.heads = 2;
  o.embd = 32;
  o.seq_len = 16;
  o.vocab = 50;
  m.mc = make_model_config("gpt-tiny", o);
  m.layout = gpt_layout(m.mc);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.4f);  // large enough that the logits are far from ties
  for (const auto& b : m.layout.blocks()) {
    m.blocks.emplace_back(static_cast<size_t>(b.numel));
    for (float& v : m.blocks.back()) v = nd(rng);
  }
  return m;
}

// GPT-2's forward in float64, naively: logits [n, V] of tokens at positions 0..n-1.
std::vector<double> reference_logits(const RandomGpt& m, const std::vector<int32_t>& tok) {
  const int64_t C = m.mc.embd, V = m.mc.vocab, NH = m.mc.heads, hs = C / NH;
  const int n = static_cast<int>(tok.size());
  auto W = [&](const std::string& name) { return m.tensor(name); };
  std::vector<double> x(static_cast<size_t>(n * C));
  for (int i = 0; i < n; ++i)
    for (int64_t c = 0; c < C; ++c) x[i * C + c] = double(W("wte.weight")[tok[i] * C + c]) + W("wpe.weight")[i * C + c];
  auto ln = [&](const std::vector<double>& in, const float* w, const float* b) {
    std::vector<double> out(in.size());
    for (int i = 0; i < n; ++i) {
      double mu = 0, var = 0;
      for (int64_t c = 0; c < C; ++c) mu += in[i * C + c];
      mu /= C;
      for (int64_t c = 0; c < C; ++c) var += (in[i * C + c] - mu) * (in[i * C + c] - mu);
      const double r = 1 / std::sqrt(var / C + 1e-5);
      for (int64_t c = 0; c < C; ++c) out[i * C + c] = (in[i * C + c] - mu) * r * w[c] + b[c];
    }
    return out;
  };
  auto lin = [&](const std::vector<double>& in, int64_t IC, const float* w, const float* b, int64_t OC) {
    std::vector<double> out(static_cast<size_t>(n * OC));
    for (int i = 0; i < n; ++i)
      for (int64_t o = 0; o < OC; ++o) {
        double s = b ? b[o] : 0.0;
        for (int64_t k = 0; k < IC; ++k) s += in[i * IC + k] * double(w[o * IC + k]);
        out[i * OC + o] = s;
      }
    return out;
  };
  for (int l = 0; l < m.mc.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    const auto qkv = lin(ln(x, W(p + "ln_1.weight"), W(p + "ln_1.bias")), C, W(p + "attn.c_attn.weight"),
                         W(p + "attn.c_attn.bias"), 3 * C);
    std::vector<double> att(x.size(), 0.0);
    for (int i = 0; i < n; ++i)
      for (int64_t h = 0; h < NH; ++h) {
        std::vector<double> s(static_cast<size_t>(i + 1));
        double mx = -1e300, z = 0;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t e = 0; e < hs; ++e) d += qkv[i * 3 * C + h * hs + e] * qkv[j * 3 * C + C + h * hs + e];
          s[j] = d / std::sqrt(double(hs));
          mx = std::max(mx, s[j]);
        }
        for (int j = 0; j <= i; ++j) z += s[j] = std::exp(s[j] - mx);
        for (int j = 0; j <= i; ++j)
          for (int64_t e = 0; e < hs; ++e) att[i * C + h * hs + e] += s[j] / z * qkv[j * 3 * C + 2 * C + h * hs + e];
      }
    const auto proj = lin(att, C, W(p + "attn.c_proj.weight"), W(p + "attn.c_proj.bias"), C);
    for (size_t e = 0; e < x.size(); ++e) x[e] += proj[e];
    auto fc = lin(ln(x, W(p + "ln_2.weight"), W(p + "ln_2.bias")), C, W(p + "mlp.c_fc.weight"), W(p + "mlp.c_fc.bias"), 4 * C);
    for (double& f : fc) f = 0.5 * f * (1 + std::tanh(std::sqrt(2 / M_PI) * (f + 0.044715 * f * f * f)));
    const auto out = lin(fc, 4 * C, W(p + "mlp.c_proj.weight"), W(p + "mlp.c_proj.bias"), C);
    for (size_t e = 0; e < x.size(); ++e) x[e] += out[e];
  }
  return lin(ln(x, W("ln_f.weight"), W("ln_f.bias")), C, W("wte.weight"), nullptr, V);
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

class DeviceGptTest : public ::testing::Test {
 protected:
  DeviceGpt load(const RandomGpt& g, DType t = DType::kF32) { return make_device_gpt(g.mc, g.blocks, rt_->device(0), t); }
  std::unique_ptr<Runtime> rt_ = Runtime::create_cpu(1);
};

TEST_F(DeviceGptTest, CacheAndModelForwardMatchFloat64Reference) {
  const RandomGpt g = random_gpt(1);
  DeviceGpt m = load(g);
  std::vector<int32_t> tok = {3, 17, 42, 0, 49, 8, 8, 23, 11, 5, 30, 2};
  const auto ref = reference_logits(g, tok);
  const double tol = 1e-5 * max_abs(ref) + 1e-5;
  KvCache cache(m);
  std::vector<float> prefill(ref.size(), NAN);
  cache.forward(tok.data(), static_cast<int>(tok.size()), prefill.data(), true);
  EXPECT_EQ(cache.length(), static_cast<int>(tok.size()));
  const std::vector<float> model = full_forward_logits(m, tok);
  ASSERT_EQ(model.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_NEAR(prefill[i], ref[i], tol) << "KV-cache prefill, logit " << i;
    ASSERT_NEAR(model[i], ref[i], tol) << "model forward, logit " << i;
  }
}

TEST_F(DeviceGptTest, OneTokenAtATimeEqualsTheModelsForward) {
  const RandomGpt g = random_gpt(2);
  DeviceGpt m = load(g);
  const std::vector<int32_t> tok = {7, 1, 33, 33, 12, 48, 0, 19, 26};
  const int V = m.mc.vocab;
  KvCache one_by_one(m);
  std::vector<float> step(static_cast<size_t>(V));
  const std::vector<float> full = full_forward_logits(m, tok);
  for (size_t t = 0; t < tok.size(); ++t) {
    one_by_one.forward(&tok[t], 1, step.data(), false);
    for (int v = 0; v < V; ++v) ASSERT_NEAR(step[v], full[t * V + v], 1e-4) << "position " << t << ", logit " << v;
  }
}

TEST_F(DeviceGptTest, GreedyGenerationWithTheCacheEqualsTheModelsForward) {
  for (uint32_t seed : {3u, 4u, 5u}) {
    const RandomGpt g = random_gpt(seed);
    DeviceGpt m = load(g);
    GenerateOptions o;
    o.temperature = 0;
    o.max_new_tokens = 24;  // past the 16-token context: the window slides
    const std::vector<int32_t> prompt = {static_cast<int32_t>(seed), 9, 4};
    const auto cached = generate(m, prompt, o);
    o.use_cache = false;
    const auto recomputed = generate(m, prompt, o);
    EXPECT_EQ(cached, recomputed) << "seed " << seed;
    ASSERT_EQ(cached.size(), prompt.size() + 24);
    EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), cached.begin()));
  }
}

TEST_F(DeviceGptTest, SamplingIsAFunctionOfTheSeed) {
  const RandomGpt g = random_gpt(6);
  DeviceGpt m = load(g);
  GenerateOptions o;
  o.max_new_tokens = 12;
  o.temperature = 1.0f;
  o.top_k = 0;
  const auto a = generate(m, {1}, o), b = generate(m, {1}, o);
  EXPECT_EQ(a, b);
  o.seed = 99;
  EXPECT_NE(generate(m, {1}, o), a);
  o.top_k = 1;  // top-1 is greedy whatever the temperature
  GenerateOptions greedy = o;
  greedy.temperature = 0;
  EXPECT_EQ(generate(m, {1}, o), generate(m, {1}, greedy));
}

// bf16 (weights rounded once, activations stored in bf16, fp32 math inside each op) against the
// float64 forward. Bound, first order in u = 2^-8 (bf16's unit roundoff): each stored rounding
// perturbs a value by at most u of its magnitude; the ones that reach a logit are the weights and
// the activations along one layer's path (ln_1, qkv, attention out, projection, residual, ln_2,
// fc, GELU, fc projection, residual: 10), times the layers, plus the embedding, ln_f and the logit
// itself (3). Taking every perturbation relative to the largest logit and letting layernorm at
// most double one (its 1/std of a residual stream whose std is O(1) here), the logits are within
// 2 (10 L + 3) u max|logit| of float64, about 0.18 max|logit| for L = 2: loose, yet far below a
// wrong model (random weights give logits of O(max|logit|) differences) and above what bf16 gives.
TEST_F(DeviceGptTest, Bf16StaysWithinItsBoundOfFloat64AndPicksRealTokens) {
  const RandomGpt g = random_gpt(7);
  const std::vector<int32_t> tok = {5, 44, 2, 31, 31, 9, 0, 17};
  const auto ref = reference_logits(g, tok);
  const double u = 0x1p-8, bound = 2 * (10 * g.mc.layers + 3) * u * max_abs(ref);
  for (DType t : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(t));
    DeviceGpt m = load(g, t);
    KvCache cache(m);
    std::vector<float> got(ref.size(), NAN);
    cache.forward(tok.data(), static_cast<int>(tok.size()), got.data(), true);
    const std::vector<float> model = full_forward_logits(m, tok);
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_NEAR(got[i], ref[i], bound) << "KV cache, logit " << i;
      ASSERT_NEAR(model[i], ref[i], bound) << "model forward, logit " << i;
      worst = std::max(worst, std::fabs(got[i] - ref[i]));
    }
    EXPECT_GT(worst, 0.0);  // 16 bits really ran: fp32 would be within 1e-5
    GenerateOptions o;
    o.max_new_tokens = 20;
    o.temperature = 1.0f;
    for (int32_t id : generate(m, tok, o)) EXPECT_TRUE(id >= 0 && id < g.mc.vocab) << id;
  }
}

// ---- every backend ------------------------------------------------------------------------------

// The same model on each backend against float64, with the tolerance policy's vendor bounds (a GPU
// runs cuBLAS/cuBLASLt GEMMs and, in the model's forward, cuDNN's attention; the decode runs
// ZeroTrain's decode_attention kernel). Bound, relative to the row's largest |logit|, from the
// first-order model of Bf16StaysWithinItsBoundOfFloat64AndPicksRealTokens: 2 (10 L + 3) rounding
// points' worth of a per-point error e, where a vendor's e is gamma_{4C}(u_acc) (fp32 accumulation
// over the longest reduction, 4C; tolerance.h) plus r = 2 roundings of the activation type. fp32:
// 7.1e-4 for L = 2, C = 32 (the CPU backend is within 1e-5); 16 bits: 0.18 (bf16) and 0.023 (fp16)
// times r, loose but far below the O(1) differences of a wrong position, head or cache row.
class GenerateBackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam() == Backend::kCpu) {
      rt_ = Runtime::create_cpu(1);
      return;
    }
    const CudaAvailability cuda = cuda_availability();
    if (!cuda.usable) GTEST_SKIP() << "no usable GPU: " << cuda.reason;
    rt_ = Runtime::create(parse_device_spec("cuda:0"));
  }
  static double bound(const RandomGpt& g, DType t) {
    const double e = tolerance::gamma(4 * g.mc.embd, tolerance::kAccRoundoff) +
                     tolerance::kVendorRoundings * tolerance::unit_roundoff(t);
    return 2 * (10 * g.mc.layers + 3) * e;
  }
  std::unique_ptr<Runtime> rt_;
};

TEST_P(GenerateBackendTest, PrefillDecodeAndModelForwardStayWithinTheirBoundOfFloat64) {
  const RandomGpt g = random_gpt(11);
  const std::vector<int32_t> tok = {4, 49, 13, 0, 27, 27, 8, 36, 2, 45, 19, 30};
  const auto ref = reference_logits(g, tok);
  const int V = g.mc.vocab, n = static_cast<int>(tok.size()), prefill = 7;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(t));
    DeviceGpt m = make_device_gpt(g.mc, g.blocks, rt_->device(0), t);
    // The prompt's rows in one prefill, then one decode step per token (decode_attention with one
    // query row over the cache), then the model's own forward (the training kernels).
    KvCache cache(m);
    std::vector<float> got(static_cast<size_t>(n) * V, NAN);
    cache.forward(tok.data(), prefill, got.data(), true);
    for (int i = prefill; i < n; ++i) cache.forward(&tok[i], 1, got.data() + static_cast<size_t>(i) * V, false);
    const std::vector<float> model = full_forward_logits(m, tok);
    for (int i = 0; i < n; ++i) {
      const std::vector<double> r(ref.begin() + i * V, ref.begin() + (i + 1) * V);
      const double b = bound(g, t) * max_abs(r);
      for (int v = 0; v < V; ++v) {
        ASSERT_NEAR(got[i * V + v], r[v], b) << (i < prefill ? "prefill" : "decode") << " position " << i << ", logit " << v;
        ASSERT_NEAR(model[i * V + v], r[v], b) << "model forward, position " << i << ", logit " << v;
      }
    }
  }
}

// Greedy generation past the context (the window slides and is prefilled again): every token is the
// argmax of float64 logits of its window up to a near-tie the bound allows (the device's and the
// reference's logits each within b: the device's argmax is within 2b of the reference's maximum).
// Sampling from the 16-bit model draws only real ids (the padded vocabulary, 50 of 128 rows, never)
// and is a function of the seed on the device too.
TEST_P(GenerateBackendTest, GreedyTokensAreFloat64sArgmaxAndSamplesAreRealIds) {
  const RandomGpt g = random_gpt(12);
  const int V = g.mc.vocab, T = g.mc.seq_len;
  DeviceGpt m = make_device_gpt(g.mc, g.blocks, rt_->device(0), DType::kF32);
  GenerateOptions o;
  o.temperature = 0;
  o.max_new_tokens = 22;
  const std::vector<int32_t> prompt = {12, 3, 40};
  const std::vector<int32_t> ids = generate(m, prompt, o);
  ASSERT_EQ(ids.size(), prompt.size() + 22);
  for (size_t k = prompt.size(); k < ids.size(); ++k) {
    const size_t first = k > static_cast<size_t>(T) ? k - T : 0;
    const std::vector<int32_t> window(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.begin() + static_cast<std::ptrdiff_t>(k));
    const auto all = reference_logits(g, window);
    const std::vector<double> r(all.end() - V, all.end());
    const double top = *std::max_element(r.begin(), r.end());
    ASSERT_GE(r[static_cast<size_t>(ids[k])], top - 2 * bound(g, DType::kF32) * max_abs(r)) << "token " << k;
  }
  DeviceGpt m16 = make_device_gpt(g.mc, g.blocks, rt_->device(0), DType::kBF16);
  o.temperature = 1.0f;
  o.top_k = 0;
  o.max_new_tokens = 30;
  const std::vector<int32_t> a = generate(m16, prompt, o);
  for (int32_t id : a) EXPECT_TRUE(id >= 0 && id < V) << id;
  EXPECT_EQ(generate(m16, prompt, o), a);
}

INSTANTIATE_TEST_SUITE_P(Backends, GenerateBackendTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace zt
