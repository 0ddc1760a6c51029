// Host inference of GPT checkpoints: weights, KV-cache forward, generation, evaluation (see generate.h).
// The math is the model's (model/gpt.cc): pre-LayerNorm blocks (eps 1e-5), causal attention scaled
// by 1/sqrt(head size), GPT-2's tanh GELU (kernels/elementwise.h), the LM head tied to wte; in fp32
// with float64 softmax/loss sums, so it equals the device forward within fp32 rounding.
#include "train/generate.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "checkpoint/checkpoint.h"
#include "core/philox.h"
#include "core/status.h"
#include "data/language_data.h"
#include "data/token_shards.h"
#include "kernels/elementwise.h"
#include "model/model.h"
#include "train/export.h"
#include "train/sampler.h"

namespace zt {

namespace {

constexpr float kLayerNormEps = 1e-5f;

void layernorm(const float* x, const float* w, const float* b, int n, int64_t C, float* out) {
  for (int i = 0; i < n; ++i) {
    const float* r = x + i * C;
    double mean = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) mean += r[c];
    mean /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) var += (r[c] - mean) * (r[c] - mean);
    const double rstd = 1.0 / std::sqrt(var / static_cast<double>(C) + kLayerNormEps);
    for (int64_t c = 0; c < C; ++c)
      out[i * C + c] = static_cast<float>((r[c] - mean) * rstd) * w[c] + b[c];
  }
}

// out[n, OC] = in[n, IC] @ w[OC, IC]^T + bias
void linear(const float* in, const float* w, const float* bias, int n, int64_t IC, int64_t OC, float* out) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, static_cast<int>(OC), static_cast<int>(IC), 1.0f, in,
              static_cast<int>(IC), w, static_cast<int>(IC), 0.0f, out, static_cast<int>(OC));
  if (bias)
    for (int i = 0; i < n; ++i)
      for (int64_t o = 0; o < OC; ++o) out[i * OC + o] += bias[o];
}

}  // namespace

const float* HostGpt::tensor(const std::string& name) const {
  const auto [b, t] = layout.find(name);
  return blocks[static_cast<size_t>(b)].data() + t->offset;
}

HostGpt load_host_gpt(const std::string& spec) {
  HostGpt m;
  m.checkpoint = resolve_checkpoint_dir(spec);
  const CheckpointReader reader = CheckpointReader::open(m.checkpoint);
  m.meta = reader.meta();
  m.step = reader.step();
  m.mc = config_from_meta(m.meta, m.checkpoint);
  ZT_REQUIRE(m.mc.kind == ModelKind::kGpt, m.checkpoint, " holds a ", m.mc.preset,
             " classifier, not a GPT; generate and eval read language models");
  m.layout = gpt_layout(m.mc);
  // The checkpoint holds the logical (one-device) blocks whatever layout wrote it.
  for (const auto& b : m.layout.blocks()) {
    const std::string array = b.name + "/master";
    ZT_REQUIRE(reader.has_array(array) && reader.array(array).numel == static_cast<uint64_t>(b.numel), m.checkpoint,
               " does not hold this model's '", array, "'");
    m.blocks.emplace_back(static_cast<size_t>(b.numel));
    reader.read(array, 0, static_cast<uint64_t>(b.numel), m.blocks.back().data());
  }
  return m;
}

KvCache::KvCache(const ModelConfig& mc) : cap_(mc.seq_len), C_(mc.embd) {
  const size_t n = static_cast<size_t>(mc.layers) * static_cast<size_t>(cap_) * static_cast<size_t>(C_);
  k_.resize(n);
  v_.resize(n);
}

void gpt_forward(const HostGpt& m, KvCache& cache, const int32_t* tokens, int n, float* logits, bool all_rows) {
  const ModelConfig& mc = m.mc;
  const int64_t C = mc.embd, V = mc.vocab, NH = mc.heads, hs = C / NH;
  const int p0 = cache.len_;
  ZT_REQUIRE(n >= 1 && p0 + n <= cache.cap_, "the context holds ", cache.cap_, " tokens; ", p0 + n, " do not fit");
  std::vector<float> x(static_cast<size_t>(n * C)), ln(x.size()), qkv(static_cast<size_t>(n * 3 * C)), att(x.size()),
      proj(x.size()), fc(static_cast<size_t>(n * 4 * C)), scores(static_cast<size_t>(p0 + n));
  const float* wte = m.tensor("wte.weight");
  const float* wpe = m.tensor("wpe.weight");
  for (int i = 0; i < n; ++i) {
    ZT_REQUIRE(tokens[i] >= 0 && tokens[i] < V, "token ", tokens[i], " is outside the model's vocabulary of ", V);
    for (int64_t c = 0; c < C; ++c) x[i * C + c] = wte[tokens[i] * C + c] + wpe[(p0 + i) * C + c];
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int l = 0; l < mc.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    layernorm(x.data(), m.tensor(p + "ln_1.weight"), m.tensor(p + "ln_1.bias"), n, C, ln.data());
    linear(ln.data(), m.tensor(p + "attn.c_attn.weight"), m.tensor(p + "attn.c_attn.bias"), n, C, 3 * C, qkv.data());
    float* K = cache.k_.data() + static_cast<size_t>(l) * cache.cap_ * C;
    float* Vc = cache.v_.data() + static_cast<size_t>(l) * cache.cap_ * C;
    for (int i = 0; i < n; ++i) {
      std::copy_n(qkv.data() + i * 3 * C + C, C, K + (p0 + i) * C);
      std::copy_n(qkv.data() + i * 3 * C + 2 * C, C, Vc + (p0 + i) * C);
    }
    for (int i = 0; i < n; ++i) {
      const int t = p0 + i;  // attends to positions 0..t
      for (int64_t h = 0; h < NH; ++h) {
        const float* q = qkv.data() + i * 3 * C + h * hs;
        float mx = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          const float* k = K + j * C + h * hs;
          float dot = 0;
          for (int64_t d = 0; d < hs; ++d) dot += q[d] * k[d];
          scores[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, scores[static_cast<size_t>(j)]);
        }
        double z = 0;
        for (int j = 0; j <= t; ++j) z += scores[static_cast<size_t>(j)] = std::exp(scores[static_cast<size_t>(j)] - mx);
        float* o = att.data() + i * C + h * hs;
        std::fill_n(o, hs, 0.0f);
        for (int j = 0; j <= t; ++j) {
          const float w = static_cast<float>(scores[static_cast<size_t>(j)] / z);
          const float* v = Vc + j * C + h * hs;
          for (int64_t d = 0; d < hs; ++d) o[d] += w * v[d];
        }
      }
    }
    linear(att.data(), m.tensor(p + "attn.c_proj.weight"), m.tensor(p + "attn.c_proj.bias"), n, C, C, proj.data());
    for (size_t e = 0; e < x.size(); ++e) x[e] += proj[e];
    layernorm(x.data(), m.tensor(p + "ln_2.weight"), m.tensor(p + "ln_2.bias"), n, C, ln.data());
    linear(ln.data(), m.tensor(p + "mlp.c_fc.weight"), m.tensor(p + "mlp.c_fc.bias"), n, C, 4 * C, fc.data());
    for (float& f : fc) f = gelu_forward_elem(f);
    linear(fc.data(), m.tensor(p + "mlp.c_proj.weight"), m.tensor(p + "mlp.c_proj.bias"), n, 4 * C, C, proj.data());
    for (size_t e = 0; e < x.size(); ++e) x[e] += proj[e];
  }
  cache.len_ = p0 + n;
  const int first = all_rows ? 0 : n - 1, rows = n - first;
  layernorm(x.data() + first * C, m.tensor("ln_f.weight"), m.tensor("ln_f.bias"), rows, C, ln.data());
  linear(ln.data(), wte, nullptr, rows, C, V, logits);  // the tied head: wte's first V rows
}

std::vector<int32_t> generate(const HostGpt& m, const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  ZT_REQUIRE(!prompt.empty(), "the prompt has no tokens");
  const int T = m.mc.seq_len;
  std::vector<int32_t> ids = prompt;
  KvCache cache(m.mc);
  std::vector<float> row(static_cast<size_t>(m.mc.vocab));
  for (int k = 0; k < o.max_new_tokens; ++k) {
    const int n = static_cast<int>(ids.size());
    if (o.use_cache && n <= T && cache.length() == n - 1) {
      gpt_forward(m, cache, &ids.back(), 1, row.data(), false);  // the cache holds every earlier token
    } else {
      const int window = std::min(n, T);  // past the context: the last T tokens, recomputed
      cache.clear();
      gpt_forward(m, cache, ids.data() + (n - window), window, row.data(), false);
    }
    int32_t pick;
    if (o.temperature <= 0) {
      pick = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    } else {
      pick = sample_top_k(row, o.top_k, o.temperature, philox_uniform(o.seed, 0x9e4e7a7e, static_cast<uint64_t>(k)));
    }
    ids.push_back(pick);
  }
  return ids;
}

EvalReport evaluate_host(const HostGpt& m, const LanguageData& data, int batches, int rows, int T) {
  ZT_REQUIRE(T >= 1 && T <= m.mc.seq_len, "the evaluation's sequence length ", T, " exceeds the model's context ",
             m.mc.seq_len);
  data.validate(T);
  const int64_t V = m.mc.vocab;
  std::vector<int32_t> in(static_cast<size_t>(rows) * T), tg(in.size());
  std::vector<float> logits(static_cast<size_t>(T * V));
  KvCache cache(m.mc);
  double sum = 0;
  EvalReport r;
  for (int e = 0; e < batches; ++e) {
    data.batch(Split::kValidation, static_cast<uint64_t>(e), 0, rows, T, in.data(), tg.data());
    for (int i = 0; i < rows; ++i) {
      cache.clear();
      gpt_forward(m, cache, in.data() + static_cast<size_t>(i) * T, T, logits.data(), true);
      for (int t = 0; t < T; ++t) {
        const float* l = logits.data() + t * V;
        const float mx = *std::max_element(l, l + V);
        double z = 0;
        for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(l[v]) - mx);
        const int32_t y = tg[static_cast<size_t>(i) * T + static_cast<size_t>(t)];
        sum += std::log(z) + mx - l[y];
        ++r.tokens;
      }
    }
  }
  r.loss = r.tokens ? sum / static_cast<double>(r.tokens) : 0;
  r.batches = batches;
  r.rows = rows;
  r.seq_len = T;
  return r;
}

std::unique_ptr<LanguageData> open_eval_data(const std::string& spec, uint64_t seed, int vocab) {
  const bool shards = spec.ends_with(".bin") || spec.find_first_of("*?[") != std::string::npos;
  if (shards && spec != "synthetic") return std::make_unique<TokenShardData>(spec, seed, vocab, /*validation_only=*/true);
  return open_language_data(spec, seed, vocab);
}

}  // namespace zt
