// GPT checkpoints on one device: weights, the model's forward for evaluation, a KV-cache decode for
// generation (see generate.h). The decode runs the ops of model/gpt.cc's layer forward (one-device
// GPT) in the same order on the cache's rows; only attention differs (ops::decode_attention over
// the cache instead of the tiled kernel over a window), so its logits equal the model's forward
// within the dtype's rounding, and the tests hold it to that.
#include "train/generate.h"

#include <algorithm>
#include <cmath>

#include "checkpoint/checkpoint.h"
#include "core/philox.h"
#include "core/status.h"
#include "data/language_data.h"
#include "data/token_shards.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "train/export.h"
#include "train/sampler.h"

namespace zt {

namespace {

// evaluate_device's default forward size: rows per forward keep B x T at most this many tokens.
constexpr int64_t kEvalTokens = 16384;

// Forward-only parameters in device memory: the local blocks of the one-device model (wte padded),
// fp32, or rounded once to the 16-bit dtype by ops::cast (the fp32 copy then freed).
class DeviceParams final : public ParamAccess {
 public:
  DeviceParams(Device& d, const Model& model, const std::vector<std::vector<float>>& logical, DType dtype)
      : device_(d.index()), dtype_(dtype) {
    Stream& s = d.compute();
    std::vector<const float*> blocks;
    for (const auto& b : logical) blocks.push_back(b.data());
    std::vector<std::vector<float>> local;  // alive until the stream has read them
    for (int b = 0; b < model.layout().num_blocks(); ++b) {
      local.push_back(model.tensor_map()->local_block(0, b, blocks));
      const int64_t n = static_cast<int64_t>(local.back().size());
      DeviceBuffer f32(d.memory(), static_cast<size_t>(n) * 4, s, "parameters");
      s.copy(f32.data(), local.back().data(), static_cast<size_t>(n) * 4);
      if (dtype == DType::kF32) {
        f32_.push_back(std::move(f32));
        continue;
      }
      DeviceBuffer h(d.memory(), static_cast<size_t>(n) * dtype_size(dtype), s, "parameters");
      ops::cast(s, TensorView{h.data(), dtype, Shape{n}, device_}, TensorView{f32.data(), DType::kF32, Shape{n}, device_});
      half_.push_back(std::move(h));
    }
    s.synchronize();
  }
  int device_index() const override { return device_; }
  float* params(int block) override {
    ZT_CHECK(dtype_ == DType::kF32, "fp32 parameters of a ", dtype_name(dtype_), " inference model");
    return f32_.at(static_cast<size_t>(block)).as<float>();
  }
  float* grads(int) override { ZT_CHECK(false, "gradients of an inference model"); return nullptr; }
  DType param_dtype() const override { return dtype_; }
  void* param_data(int block) override {
    return dtype_ == DType::kF32 ? params(block) : half_.at(static_cast<size_t>(block)).data();
  }

 private:
  int device_;
  DType dtype_;
  std::vector<DeviceBuffer> f32_, half_;
};

// Rows [first, first + rows) of a row-major buffer of `width` columns of `t`, as [rows, width].
TensorView rows_view(void* base, DType t, int64_t width, int64_t first, int64_t rows, int device) {
  return TensorView{static_cast<char*>(base) + first * width * static_cast<int64_t>(dtype_size(t)), t, Shape{rows, width},
                    device};
}

// The model's forward over B sequences of T tokens, train=false: losses and logits in its workspace.
struct ModelForward {
  DeviceGpt& m;
  int B, T;
  std::unique_ptr<Workspace> ws;
  DeviceBuffer in, tg;
  Batch batch;
  ModelForward(DeviceGpt& model, int B_, int T_)
      : m(model), B(B_), T(T_), ws(model.model->make_workspace(*model.device, B_, T_)),
        in(model.device->memory(), static_cast<size_t>(B_) * T_ * 4, model.device->compute(), "inputs"),
        tg(model.device->memory(), static_cast<size_t>(B_) * T_ * 4, model.device->compute(), "targets") {
    const int d = model.device->index();
    batch.B = B;
    batch.T = T;
    batch.inputs = ConstTensorView{in.data(), DType::kI32, Shape{B, T}, d};
    batch.targets = ConstTensorView{tg.data(), DType::kI32, Shape{B, T}, d};
  }
  // tokens and targets: B*T each, host memory read before the next synchronize of the stream.
  void run(const int32_t* tokens, const int32_t* targets) {
    Stream& s = m.device->compute();
    s.copy(in.data(), tokens, static_cast<size_t>(B) * T * 4);
    s.copy(tg.data(), targets, static_cast<size_t>(B) * T * 4);
    m.model->forward(s, *m.params, *ws, batch, 0.0f, false);
  }
};

}  // namespace

DeviceGpt make_device_gpt(const ModelConfig& mc, const std::vector<std::vector<float>>& blocks, Device& device,
                          DType dtype) {
  ZT_REQUIRE(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16,
             "inference runs in fp32, bf16 or fp16, not ", dtype_name(dtype));
  if (device.backend() == Backend::kCuda) ops::require_cuda_attention_shape(mc.embd, mc.heads);
  DeviceGpt m;
  m.mc = mc;
  m.device = &device;
  m.dtype = dtype;
  m.model = make_model(mc, Recompute::kNone, {}, dtype);
  const ParamLayout logical = gpt_layout(mc);
  ZT_CHECK(static_cast<int>(blocks.size()) == logical.num_blocks(), "a GPT of ", logical.num_blocks(), " blocks given ",
           blocks.size());
  m.params = std::make_unique<DeviceParams>(device, *m.model, blocks, dtype);
  return m;
}

DeviceGpt load_device_gpt(const std::string& spec, Device& device, DType dtype) {
  const std::string dir = resolve_checkpoint_dir(spec);
  const CheckpointReader reader = CheckpointReader::open(dir);
  const ModelConfig mc = config_from_meta(reader.meta(), dir);
  ZT_REQUIRE(mc.kind == ModelKind::kGpt, dir, " holds a ", mc.preset, " classifier, not a GPT; generate and eval read "
             "language models");
  // The checkpoint holds the logical (one-device) blocks whatever layout wrote it.
  std::vector<std::vector<float>> blocks;
  const ParamLayout layout = gpt_layout(mc);
  for (const auto& b : layout.blocks()) {
    const std::string array = b.name + "/master";
    ZT_REQUIRE(reader.has_array(array) && reader.array(array).numel == static_cast<uint64_t>(b.numel), dir,
               " does not hold this model's '", array, "'");
    blocks.emplace_back(static_cast<size_t>(b.numel));
    reader.read(array, 0, static_cast<uint64_t>(b.numel), blocks.back().data());
  }
  DeviceGpt m = make_device_gpt(mc, blocks, device, dtype);
  m.checkpoint = dir;
  m.meta = reader.meta();
  m.step = reader.step();
  return m;
}

// ---- the KV cache -------------------------------------------------------------------------------

struct KvCache::Buffers {
  std::vector<DeviceBuffer> qkv;  // per layer [cap, 3C]
  DeviceBuffer res, res2, ln, atty, proj, fch, fch_gelu, mean, rstd, logits, logits32, tokens;
};

KvCache::KvCache(DeviceGpt& model) : m_(model), cap_(model.mc.seq_len), b_(std::make_unique<Buffers>()) {
  Device& d = *m_.device;
  Stream& s = d.compute();
  const int64_t cap = cap_, C = m_.mc.embd, Vp = m_.model->layout().block(0).tensors[0].shape[0];
  const size_t a = dtype_size(m_.dtype);
  auto buf = [&](int64_t elems, size_t bytes_each) { return DeviceBuffer(d.memory(), static_cast<size_t>(elems) * bytes_each, s, "kv cache"); };
  for (int l = 0; l < m_.mc.layers; ++l) b_->qkv.push_back(buf(cap * 3 * C, a));
  b_->res = buf(cap * C, a), b_->res2 = buf(cap * C, a), b_->ln = buf(cap * C, a), b_->atty = buf(cap * C, a);
  b_->proj = buf(cap * C, a), b_->fch = buf(cap * 4 * C, a), b_->fch_gelu = buf(cap * 4 * C, a);
  b_->mean = buf(cap, 4), b_->rstd = buf(cap, 4), b_->logits = buf(cap * Vp, a), b_->tokens = buf(cap, 4);
  if (m_.dtype != DType::kF32) b_->logits32 = buf(cap * Vp, 4);
}

KvCache::~KvCache() = default;

void KvCache::forward(const int32_t* tokens, int n, float* logits, bool all_rows) {
  const ModelConfig& mc = m_.mc;
  const int64_t C = mc.embd, V = mc.vocab, p0 = len_;
  ZT_REQUIRE(n >= 1 && p0 + n <= cap_, "the context holds ", cap_, " tokens; ", p0 + n, " do not fit");
  for (int i = 0; i < n; ++i)
    ZT_REQUIRE(tokens[i] >= 0 && tokens[i] < V, "token ", tokens[i], " is outside the model's vocabulary of ", V);
  Device& d = *m_.device;
  Stream& s = d.compute();
  const int dev = d.index();
  const DType a = m_.dtype;
  const ParamLayout& layout = m_.model->layout();
  const int64_t Vp = layout.block(0).tensors[0].shape[0];
  auto w = [&](int block, int idx) { return m_.model->param(*m_.params, block, idx); };
  auto act = [&](const DeviceBuffer& b, int64_t width, int64_t first, int64_t rows) {
    return rows_view(b.data(), a, width, first, rows, dev);
  };
  auto stat = [&](const DeviceBuffer& b, int64_t rows) { return TensorView{b.data(), DType::kF32, Shape{rows}, dev}; };
  Buffers& B = *b_;

  s.copy(B.tokens.data(), tokens, static_cast<size_t>(n) * 4);
  const TensorView wte = w(0, 0), wpe = w(0, 1);
  const TensorView res = act(B.res, C, 0, n), res2 = act(B.res2, C, 0, n), ln = act(B.ln, C, 0, n);
  ops::encoder_forward(s, TensorView{res.data, a, Shape{1, n, C}, dev},
                       ConstTensorView{B.tokens.data(), DType::kI32, Shape{1, n}, dev}, wte,
                       rows_view(wpe.data, a, C, p0, n, dev), ops::VocabRange{0, V});
  for (int l = 0; l < mc.layers; ++l) {
    const int blk = 1 + l;
    auto lw = [&](LayerTensor k) { return w(blk, k); };
    const DeviceBuffer& cache = B.qkv[static_cast<size_t>(l)];
    ops::layernorm_forward(s, ln, stat(B.mean, n), stat(B.rstd, n), res, lw(kLn1w), lw(kLn1b), kGptLayerNormEps);
    ops::matmul_forward(s, act(cache, 3 * C, p0, n), ln, lw(kQkvw), lw(kQkvb));  // the new rows, into the cache
    ops::decode_attention(s, act(B.atty, C, 0, n), act(cache, 3 * C, 0, p0 + n), mc.heads);
    ops::matmul_forward(s, act(B.proj, C, 0, n), act(B.atty, C, 0, n), lw(kAttprojw), lw(kAttprojb));
    ops::residual_layernorm_forward(s, res2, ln, stat(B.mean, n), stat(B.rstd, n), res, act(B.proj, C, 0, n),
                                    lw(kLn2w), lw(kLn2b), kGptLayerNormEps);
    ops::matmul_gelu_forward(s, act(B.fch_gelu, 4 * C, 0, n), act(B.fch, 4 * C, 0, n), ln, lw(kFcw), lw(kFcb));
    ops::matmul_forward(s, act(B.proj, C, 0, n), act(B.fch_gelu, 4 * C, 0, n), lw(kFcprojw), lw(kFcprojb));
    ops::add(s, res, res2, act(B.proj, C, 0, n));
  }
  const int64_t rows = all_rows ? n : 1, first = n - rows;
  const int lnf = mc.layers + 1;
  const TensorView lnf_out = act(B.ln, C, 0, rows);
  ops::layernorm_forward(s, lnf_out, stat(B.mean, rows), stat(B.rstd, rows), act(B.res, C, first, rows), w(lnf, 0),
                         w(lnf, 1), kGptLayerNormEps);
  ops::lm_head_forward(s, act(B.logits, Vp, 0, rows), lnf_out, wte);
  const DeviceBuffer* wide = &B.logits;
  if (a != DType::kF32) {
    ops::cast(s, rows_view(B.logits32.data(), DType::kF32, Vp, 0, rows, dev), act(B.logits, Vp, 0, rows));
    wide = &B.logits32;
  }
  for (int64_t r = 0; r < rows; ++r)  // the real vocabulary of each padded row
    s.copy(logits + r * V, wide->as<float>() + r * Vp, static_cast<size_t>(V) * 4);
  s.synchronize();
  len_ = static_cast<int>(p0 + n);
}

// ---- the model's forward ------------------------------------------------------------------------

std::vector<float> full_forward_logits(DeviceGpt& m, const std::vector<int32_t>& tokens) {
  const int n = static_cast<int>(tokens.size()), T = m.mc.seq_len, V = m.mc.vocab;
  ZT_REQUIRE(n >= 1 && n <= T, "the model's context holds ", T, " tokens; ", n, " do not fit");
  // The window at the start of a full-context row (causal: the padding after it changes nothing).
  std::vector<int32_t> in(static_cast<size_t>(T), 0), tg(static_cast<size_t>(T), -1);
  std::copy(tokens.begin(), tokens.end(), in.begin());
  ModelForward f(m, 1, T);
  f.run(in.data(), tg.data());
  std::vector<float> logits(static_cast<size_t>(n) * V);
  Stream& s = m.device->compute();
  for (int r = 0; r < n; ++r) f.ws->read_logits_row(s, r, logits.data() + static_cast<size_t>(r) * V);
  s.synchronize();
  return logits;
}

std::vector<int32_t> generate(DeviceGpt& m, const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  ZT_REQUIRE(!prompt.empty(), "the prompt has no tokens");
  const int T = m.mc.seq_len, V = m.mc.vocab;
  std::vector<int32_t> ids = prompt;
  // The cache's longest attention (the last token's, or the context once the window slides): the
  // CUDA decode kernel's scores sit in shared memory, so it is checked before the first token.
  const int64_t longest = std::min<int64_t>(static_cast<int64_t>(prompt.size()) + o.max_new_tokens - 1, T);
  ZT_REQUIRE(!o.use_cache || o.max_new_tokens <= 0 || m.device->backend() != Backend::kCuda ||
                 longest <= ops::kCudaMaxDecodeKeys,
             "generating ", o.max_new_tokens, " tokens after a prompt of ", prompt.size(), " attends over up to ",
             longest, " cached positions, above the ", ops::kCudaMaxDecodeKeys,
             " that the CUDA decode kernel takes; lower --max-new-tokens or shorten the prompt");
  std::unique_ptr<KvCache> cache = o.use_cache ? std::make_unique<KvCache>(m) : nullptr;
  std::vector<float> row(static_cast<size_t>(V));
  for (int k = 0; k < o.max_new_tokens; ++k) {
    const int n = static_cast<int>(ids.size()), window = std::min(n, T);  // past the context: the last T
    if (!cache) {
      const std::vector<float> all = full_forward_logits(m, std::vector<int32_t>(ids.end() - window, ids.end()));
      std::copy(all.end() - V, all.end(), row.begin());
    } else if (n <= T && cache->length() == n - 1) {
      cache->forward(&ids.back(), 1, row.data(), false);  // the cache holds every earlier token
    } else {
      cache->clear();
      cache->forward(ids.data() + (n - window), window, row.data(), false);
    }
    if (o.step_logits) o.step_logits->insert(o.step_logits->end(), row.begin(), row.end());
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

// ---- evaluation ---------------------------------------------------------------------------------

EvalReport evaluate_device(DeviceGpt& m, const LanguageData& data, int batches, int rows, int T, int micro) {
  ZT_REQUIRE(T >= 1 && T <= m.mc.seq_len, "the evaluation's sequence length ", T, " exceeds the model's context ",
             m.mc.seq_len);
  data.validate(T);
  int B = micro > 0 ? micro : rows;
  while (micro == 0 && B > 1 && (static_cast<int64_t>(B) * T > kEvalTokens || rows % B != 0)) --B;
  ZT_REQUIRE(rows % B == 0, "the evaluation's ", rows, " rows are not a multiple of ", B, " rows per forward");
  ModelForward f(m, B, T);
  Stream& s = m.device->compute();
  std::vector<int32_t> in(static_cast<size_t>(rows) * T), tg(in.size());
  std::vector<float> losses(static_cast<size_t>(B) * T);
  double sum = 0;
  EvalReport r;
  for (int e = 0; e < batches; ++e) {
    data.batch(Split::kValidation, static_cast<uint64_t>(e), 0, rows, T, in.data(), tg.data());
    for (int c = 0; c < rows / B; ++c) {
      const size_t off = static_cast<size_t>(c) * B * T;
      f.run(in.data() + off, tg.data() + off);
      s.copy(losses.data(), f.ws->losses().data, losses.size() * 4);
      s.synchronize();
      double part = 0;  // as OneStage::evaluate_rank sums a micro-batch, then adds it to the rank's sum
      for (float l : losses) part += l;
      sum += part;
      r.tokens += losses.size();
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
