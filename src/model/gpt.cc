// GPT-2: token + learned position embeddings, pre-LayerNorm blocks of causal self-attention and
// a 4x GELU MLP, final LayerNorm, LM head tied to the token embedding. Forward and backward are
// written out op by op (as llm.c's train_gpt2.c), no autograd tape.
// Blocks: 0 = embeddings (wte, wpe; wte is also the LM head), 1..L = transformer layers,
// L+1 = final layernorm. Backward visits: head (block 0, partial), L+1, L..1, encoder (block 0).
// The vocabulary is padded (llm.c's Vp): the model's local wte holds ops::padded_vocab(V) rows
// (GPT-2: 50,304), rows >= V zero, so the LM head's GEMMs run over aligned tensor-core tiles. A
// TensorMap of degree 1 (model/tensor_split.h) maps the padded layout onto gpt_layout's real rows:
// checkpoints, exports, --init-from and initialisation speak the real vocabulary, as a
// tensor-parallel GPT's do. The padding rows stay zero: initialised to zero, never looked up
// (tokens < V), their logits left out of the softmax (dlogits 0), so their gradient is exactly
// zero and AdamW (zero moments, decay of zero) never moves them.
// Numerics: the whole model computes in fp32, or in 16 bits (make_model's activations): every
// activation, saved tensor, activation gradient and the logits in bf16/f16, parameters read in
// 16 bits, rounding points as the ops state them (kernels/ops.h); layernorm mean/rstd, lse,
// losses, scratch and parameter gradients fp32. Pipeline stages without tensor parallelism
// compute in either, as the whole model does.
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>

#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "model/gpt_chunks.h"
#include "model/model.h"

namespace zt {

// GPT-2's parameter blocks (see the top of this file); also the logical layout of a
// tensor-parallel GPT (model/gpt_tp.cc).
ParamLayout gpt_layout(const ModelConfig& c) {
  ParamLayout layout;
  const int64_t C = c.embd, V = c.vocab, T = c.seq_len, L = c.layers;
  const float std = 0.02f, proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  const int emb = layout.add_block("embeddings");
  layout.add_tensor(emb, "wte.weight", Shape{V, C}, ParamInit::kNormal, std, true);
  layout.add_tensor(emb, "wpe.weight", Shape{T, C}, ParamInit::kNormal, std, true);
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    const int b = layout.add_block("h." + std::to_string(l));
    layout.add_tensor(b, p + "ln_1.weight", Shape{C}, ParamInit::kOnes, 0, false);
    layout.add_tensor(b, p + "ln_1.bias", Shape{C}, ParamInit::kZeros, 0, false);
    layout.add_tensor(b, p + "attn.c_attn.weight", Shape{3 * C, C}, ParamInit::kNormal, std, true);
    layout.add_tensor(b, p + "attn.c_attn.bias", Shape{3 * C}, ParamInit::kZeros, 0, false);
    layout.add_tensor(b, p + "attn.c_proj.weight", Shape{C, C}, ParamInit::kNormal, proj_std, true);
    layout.add_tensor(b, p + "attn.c_proj.bias", Shape{C}, ParamInit::kZeros, 0, false);
    layout.add_tensor(b, p + "ln_2.weight", Shape{C}, ParamInit::kOnes, 0, false);
    layout.add_tensor(b, p + "ln_2.bias", Shape{C}, ParamInit::kZeros, 0, false);
    layout.add_tensor(b, p + "mlp.c_fc.weight", Shape{4 * C, C}, ParamInit::kNormal, std, true);
    layout.add_tensor(b, p + "mlp.c_fc.bias", Shape{4 * C}, ParamInit::kZeros, 0, false);
    layout.add_tensor(b, p + "mlp.c_proj.weight", Shape{C, 4 * C}, ParamInit::kNormal, proj_std, true);
    layout.add_tensor(b, p + "mlp.c_proj.bias", Shape{C}, ParamInit::kZeros, 0, false);
  }
  const int lnf = layout.add_block("ln_f");
  layout.add_tensor(lnf, "ln_f.weight", Shape{C}, ParamInit::kOnes, 0, false);
  layout.add_tensor(lnf, "ln_f.bias", Shape{C}, ParamInit::kZeros, 0, false);
  return layout;
}

std::vector<int> gpt_forward_order(int layers) {
  std::vector<int> o;
  for (int b = 0; b <= layers + 1; ++b) o.push_back(b);
  o.push_back(0);  // LM head (tied to wte)
  return o;
}

std::vector<int> gpt_backward_order(int layers) {
  std::vector<int> o = {0, layers + 1};
  for (int l = layers; l >= 1; --l) o.push_back(l);
  o.push_back(0);  // encoder
  return o;
}

namespace {

constexpr float kLayerNormEps = 1e-5f;

// Offsets (in bytes) of every activation in the workspace arena. Under recomputation, fields of
// different layers share one offset (the recompute scratch): backward re-runs the forward op
// that wrote it, from kept inputs, right before reading it.
// Attention is the tiled (flash-style) op: a layer keeps its output and log-sum-exp (lse,
// [B, NH, T]) for backward, never a T x T matrix; backward's scratch is one buffer for all layers.
//  - none:      every layer keeps all it wrote;
//  - selective: ln1, ln2 (outputs only; mean/rstd stay per layer) and the GELU output share one
//               scratch: re-run from the kept residual and fch (attention output and lse stay per
//               layer: re-running attention would cost its forward to save only O(T) per row); in
//               16 bits the GELU output re-runs with c_fc's GEMM (block_forward says why);
//  - full:      only residual3 (the next block's input) stays per layer; the whole block forward
//               re-runs into one shared set in its backward (all but the output projection and add,
//               whose results backward never reads).
//  A pipeline chunk plans only its own layers; `encoded` is its input (the encoder's output, or the
//  activation received from the previous chunk), the final layernorm, logits and losses exist only
//  in a head chunk, and a split backward keeps each layer's four matmul output gradients for
//  backward_weight.
struct GptPlan {
  int64_t B, T, C, NH, L, V;
  // The logits' row length and the local wte's rows: V padded to a multiple of 128
  // (ops::padded_vocab; GPT-2 50257 -> 50304), so every logits row is 512-byte aligned and the LM
  // head's GEMMs have M/N/K multiples of 8 (aligned tensor-core tiles, no ragged last tile).
  int64_t Vp = 0;
  Recompute recompute;
  bool head, split;
  // Offsets are in bytes. Activations, their gradients and the logits take `act_bytes` each
  // element (4: fp32, 2: bf16/f16); layernorm statistics, lse, losses and scratch are fp32.
  int64_t act_bytes = 4;
  int64_t total = 0;
  int64_t encoded, lnf = 0, lnf_mean = 0, lnf_rstd = 0, logits = 0, losses = 0;
  int64_t logits_row = 0;  // 16-bit: one row of logits widened to fp32 (read_logits_row), [V]
  // shared scratch (not needed by backward, or reused across layers)
  int64_t attproj, fcproj, dresidual, dln, dfch, datty, dqkv, attn_scratch, attn_scratch_numel;
  struct Layer {
    int64_t ln1, ln1_mean, ln1_rstd, qkv, atty, lse, residual2, ln2, ln2_mean, ln2_rstd, fch,
        fch_gelu, residual3;
    // Split backward: the output gradients of the four matmuls and two layernorms, kept by
    // backward_input for backward_weight.
    int64_t dres3 = 0, dfch = 0, dln2 = 0, dres2 = 0, dqkv = 0, dln1 = 0;
  };
  int64_t dlnf = 0, ln_scratch = 0;  // split: ln_f's kept output gradient; discarded [2C] weight gradients
  std::vector<Layer> layers;

  int64_t add_bytes(int64_t bytes) {
    const int64_t off = total;
    total += (bytes + 255) / 256 * 256;  // 256-byte alignment for every activation
    return off;
  }
  int64_t act(int64_t n) { return add_bytes(n * act_bytes); }  // n elements of the activation dtype
  int64_t f32(int64_t n) { return add_bytes(n * 4); }          // n fp32 elements

  GptPlan(const ModelConfig& c, int64_t B_, int64_t T_, Recompute r, int64_t layer_count, bool head_, bool split_,
          DType activations)
      : B(B_), T(T_), C(c.embd), NH(c.heads), L(layer_count), V(c.vocab), recompute(r), head(head_), split(split_),
        act_bytes(static_cast<int64_t>(dtype_size(activations))) {
    const int64_t BT = B * T, BTC = BT * C, lse_size = B * NH * T;
    encoded = act(BTC);
    layers.resize(static_cast<size_t>(L));
    // Fields that do not depend on the layer are allocated once and copied into every layer.
    Layer shared{};
    if (r == Recompute::kSelective) {
      shared.ln1 = act(BTC), shared.ln2 = act(BTC), shared.fch_gelu = act(4 * BTC);
    } else if (r == Recompute::kFull) {
      shared.ln1 = act(BTC), shared.ln1_mean = f32(BT), shared.ln1_rstd = f32(BT), shared.qkv = act(3 * BTC);
      shared.atty = act(BTC), shared.lse = f32(lse_size), shared.residual2 = act(BTC), shared.ln2 = act(BTC);
      shared.ln2_mean = f32(BT), shared.ln2_rstd = f32(BT), shared.fch = act(4 * BTC);
      shared.fch_gelu = act(4 * BTC);
    }
    for (auto& l : layers) {
      l = shared;
      if (r == Recompute::kNone) l.ln1 = act(BTC);
      if (r != Recompute::kFull) l.ln1_mean = f32(BT), l.ln1_rstd = f32(BT), l.qkv = act(3 * BTC), l.atty = act(BTC);
      if (r != Recompute::kFull) l.lse = f32(lse_size);
      if (r != Recompute::kFull) l.residual2 = act(BTC);
      if (r == Recompute::kNone) l.ln2 = act(BTC);
      if (r != Recompute::kFull) l.ln2_mean = f32(BT), l.ln2_rstd = f32(BT), l.fch = act(4 * BTC);
      if (r == Recompute::kNone) l.fch_gelu = act(4 * BTC);
      l.residual3 = act(BTC);
      if (split) {
        l.dres3 = act(BTC), l.dfch = act(4 * BTC), l.dln2 = act(BTC);
        l.dres2 = act(BTC), l.dqkv = act(3 * BTC), l.dln1 = act(BTC);
      }
    }
    Vp = ops::padded_vocab(V);
    if (head) lnf = act(BTC), lnf_mean = f32(BT), lnf_rstd = f32(BT), logits = act(BT * Vp), losses = f32(BT);
    if (head && act_bytes != 4) logits_row = f32(V);
    if (split) ln_scratch = f32(2 * C);
    if (split && head) dlnf = act(BTC);
    attproj = act(BTC), fcproj = act(BTC);
    // No GELU output gradient: matmul_backward_dgelu carries c_proj's input gradient through the GELU.
    dresidual = act(BTC), dln = act(BTC), dfch = act(4 * BTC);
    datty = act(BTC), dqkv = act(3 * BTC);
    attn_scratch_numel = static_cast<int64_t>((ops::flash_attention_scratch_bytes(B, T, C, NH) + 3) / 4);
    attn_scratch = f32(attn_scratch_numel);
  }
};

class GptWorkspace final : public Workspace {
 public:
  GptWorkspace(const ModelConfig& c, Device& d, int B, int T, Recompute r, int chunk_, const GptChunk& k, bool split,
               DType activations)
      : plan(c, B, T, r, k.layers, k.head, split, activations), chunk(chunk_), embedding(k.embedding),
        dtype(activations), device(d.index()), buf(d.memory(), static_cast<size_t>(plan.total), d.compute(), "activations") {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return static_cast<int>(plan.T); }
  TensorView losses() override { return plan.head ? f32(plan.losses, Shape{plan.B * plan.T}) : TensorView{}; }
  // [B*T, Vp] in the activation dtype: columns >= V are padding (never a logit; dlogits 0 after a
  // train forward).
  TensorView logits() override {
    return plan.head ? view(plan.logits, Shape{plan.B * plan.T, plan.Vp}) : TensorView{};
  }
  // The real vocabulary's V logits only: a padded id is never sampled. 16-bit logits are widened
  // (exactly) on the device into the fp32 row scratch first.
  void read_logits_row(Stream& s, int row, float* out) override {
    ZT_CHECK(plan.head, "logits of a pipeline chunk without the LM head");
    const TensorView r = view(plan.logits + static_cast<int64_t>(row) * plan.Vp * plan.act_bytes, Shape{plan.V});
    if (dtype == DType::kF32) {
      s.copy(out, r.data, static_cast<size_t>(plan.V) * sizeof(float));
      return;
    }
    const TensorView wide = f32(plan.logits_row, Shape{plan.V});
    ops::cast(s, wide, r);
    s.copy(out, wide.data, static_cast<size_t>(plan.V) * sizeof(float));
  }
  TensorView stage_input() override { return embedding ? TensorView{} : view(plan.encoded, Shape{plan.B, plan.T, plan.C}); }
  TensorView stage_output() override {
    return plan.head ? TensorView{} : view(plan.layers.back().residual3, Shape{plan.B, plan.T, plan.C});
  }
  TensorView stage_gradient() override {
    return plan.head && embedding ? TensorView{} : view(plan.dresidual, Shape{plan.B, plan.T, plan.C});
  }
  size_t bytes() const override { return buf.size(); }
  double take_recompute_seconds() override { return recompute_s.exchange(0.0); }

  // Brackets a backward's recompute ops with stream callbacks, so that the time counted is when
  // the stream ran them (the host only enqueues them). Both callbacks run in stream order.
  void recompute_begin(Stream& s) {
    s.host_func([this] { recompute_start = now(); });
  }
  void recompute_end(Stream& s) {
    s.host_func([this] { recompute_s.store(recompute_s.load() + (now() - recompute_start)); });
  }

  // An activation (the workspace's activation dtype) or an fp32 tensor at byte offset `off`.
  TensorView view(int64_t off, Shape s) { return TensorView{buf.as<char>() + off, dtype, s, device}; }
  TensorView f32(int64_t off, Shape s) { return TensorView{buf.as<char>() + off, DType::kF32, s, device}; }

  GptPlan plan;
  int chunk;
  bool embedding;
  // The activations' dtype: the model's, or for a 16-bit model the 16-bit type of the parameters
  // of the last forward (Gpt::compute_dtype).
  DType dtype;
  int device;
  DeviceBuffer buf;

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  double recompute_start = 0;            // written and read only by this workspace's stream callbacks
  std::atomic<double> recompute_s{0.0};  // read by the host after synchronizing the stream
};

// What one call of Gpt::block_forward runs: the training/eval forward, or a backward's recompute.
enum class BlockPass { kForward, kSelective, kFull };

// Parameter views of one layer block.
struct LayerParams {
  TensorView ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
};

class Gpt final : public Model {
 public:
  // The whole model: one chunk, local blocks = logical blocks.
  Gpt(const ModelConfig& c, Recompute r, DType activations)
      : config_(c), recompute_(r), activations_(activations), whole_(gpt_layout(c)) {
    ZT_CHECK(activations == DType::kF32 || activations == DType::kBF16 || activations == DType::kF16,
             "GPT activations in ", dtype_name(activations));
    init_map();
    GptChunk k;
    k.layers = c.layers, k.embedding = k.head = true;
    k.emb_block = k.head_block = 0, k.lnf_block = c.layers + 1;
    for (int l = 0; l < c.layers; ++l) k.layer_blocks.push_back(l + 1);
    chunks_.push_back(k);
    for (int b = 0; b < whole_.num_blocks(); ++b) take(b);
  }
  // A pipeline stage (make_gpt_stage): its layout holds copies of the logical blocks it runs.
  Gpt(const ModelConfig& c, const PipelineStageSpec& spec, Recompute r, DType activations)
      : config_(c), recompute_(r), activations_(activations), split_(spec.split_backward), whole_(gpt_layout(c)) {
    ZT_CHECK(activations == DType::kF32 || activations == DType::kBF16 || activations == DType::kF16,
             "GPT activations in ", dtype_name(activations));
    init_map();
    chunks_ = gpt_stage_chunks(c, spec, [this](int logical) { return take(logical); });
  }

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  DType activation_dtype() const override { return activations_; }
  // Degree 1: the padded wte's real rows map onto gpt_layout's, its padding rows nowhere.
  const TensorMap* tensor_map() const override { return &map_; }
  int chunks() const override { return static_cast<int>(chunks_.size()); }
  int logical_block(int block) const override { return logical_.at(static_cast<size_t>(block)); }

  size_t workspace_bytes(int B, int T) const override {
    size_t total = 0;
    for (int c = 0; c < chunks(); ++c) total += chunk_workspace_bytes(B, T, c);
    return total;
  }
  size_t chunk_workspace_bytes(int B, int T, int chunk) const override {
    const GptChunk& k = chunks_.at(static_cast<size_t>(chunk));
    return static_cast<size_t>(GptPlan(config_, B, T, recompute_, k.layers, k.head, split_, activations_).total);
  }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int T) const override {
    ZT_CHECK(chunks_.size() == 1, "make_workspace on a ", chunks_.size(), "-chunk stage (use make_chunk_workspace)");
    return make_chunk_workspace(d, B, T, 0);
  }
  std::unique_ptr<Workspace> make_chunk_workspace(Device& d, int B, int T, int chunk) const override {
    ZT_REQUIRE(T >= 1 && T <= config_.seq_len, "sequence length ", T, " is above the model's context of ",
               config_.seq_len, " tokens");
    ZT_CHECK(chunk >= 0 && chunk < chunks(), "chunk ", chunk, " of a ", chunks(), "-chunk model");
    return std::make_unique<GptWorkspace>(config_, d, B, T, recompute_, chunk, chunks_[static_cast<size_t>(chunk)], split_,
                                          activations_);
  }

  void forward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch, float dloss,
               bool train) const override {
    auto& ws = static_cast<GptWorkspace&>(wsb);
    const GptPlan& P = ws.plan;
    const GptChunk& K = chunks_[static_cast<size_t>(ws.chunk)];
    ZT_CHECK(batch.B == P.B && batch.T == P.T, "batch ", batch.B, "x", batch.T, " on a workspace for ", P.B, "x", P.T);
    ws.dtype = compute_dtype(p);
    const int64_t BT = P.B * P.T, C = P.C;
    const int L = K.layers;
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto f32 = [&](int64_t off, Shape sh) { return ws.f32(off, sh); };

    TensorView residual = act(P.encoded, Shape{P.B, P.T, C});
    if (K.embedding) {
      p.before_forward(K.emb_block);
      const TensorView wte = param(p, K.emb_block, 0), wpe_full = param(p, K.emb_block, 1);
      const TensorView wpe{wpe_full.data, wpe_full.dtype, Shape{P.T, C}, wpe_full.device};
      ops::encoder_forward(s, residual, batch.inputs, wte, wpe, ops::VocabRange{0, P.V});
    }

    for (int l = 0; l < L; ++l) {
      const int b = K.layer_blocks[static_cast<size_t>(l)];
      p.before_forward(b);
      const LayerParams w = layer_params(p, b);
      block_forward(s, ws, w, l, BlockPass::kForward);
      residual = act(P.layers[static_cast<size_t>(l)].residual3, Shape{P.B, P.T, C});
    }
    if (!K.head) return;  // the pipeline sends stage_output() (the last residual) on

    p.before_forward(K.lnf_block);
    const TensorView res_final{residual.data, residual.dtype, Shape{BT, C}, residual.device};
    TensorView lnf = act(P.lnf, Shape{BT, C});
    ops::layernorm_forward(s, lnf, f32(P.lnf_mean, Shape{BT}), f32(P.lnf_rstd, Shape{BT}), res_final,
                           param(p, K.lnf_block, 0), param(p, K.lnf_block, 1), kLayerNormEps);
    p.before_forward(K.head_block);  // the LM head reads wte again (stage 3 gathers it again)
    TensorView logits = act(P.logits, Shape{BT, P.Vp});
    ops::lm_head_forward(s, logits, lnf, param(p, K.head_block, 0));
    const ConstTensorView targets{batch.targets.data, DType::kI32, Shape{BT}, batch.targets.device};
    ops::classifier_forward_backward(s, logits, f32(P.losses, Shape{BT}), targets, dloss, train, batch.loss_scale,
                                     ops::VocabRange{0, P.V});
  }

  void backward(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const override {
    backward_pass(s, p, static_cast<GptWorkspace&>(ws), batch, BackPass::kFused);
  }
  void backward_input(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const override {
    ZT_CHECK(split_, "backward_input on a model made without split_backward");
    backward_pass(s, p, static_cast<GptWorkspace&>(ws), batch, BackPass::kInput);
  }
  void backward_weight(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const override {
    ZT_CHECK(split_, "backward_weight on a model made without split_backward");
    backward_pass(s, p, static_cast<GptWorkspace&>(ws), batch, BackPass::kWeight);
  }

  std::vector<int> forward_order() const override { return chunks_forward_order(chunks_); }
  std::vector<int> backward_order() const override { return chunks_backward_order(chunks_); }

 private:
  // One chunk's backward. kFused is backward(); kInput computes the chain of input gradients
  // through the chunk and keeps the output gradient of every matmul and layernorm; kWeight adds
  // every parameter gradient from those (kInput writes none, so a sharding engine reduces a
  // block's gradient once, after its kWeight). Hooks: kFused and kInput call before_backward,
  // kFused and kWeight after_backward.
  void backward_pass(Stream& s, ParamAccess& p, GptWorkspace& ws, const Batch& batch, BackPass pass) const {
    const GptPlan& P = ws.plan;
    const GptChunk& K = chunks_[static_cast<size_t>(ws.chunk)];
    const int64_t BT = P.B * P.T, C = P.C;
    const int L = K.layers, NH = static_cast<int>(P.NH);
    const bool input = pass != BackPass::kWeight, weight = pass != BackPass::kInput, fused = pass == BackPass::kFused;
    ZT_CHECK(ws.dtype == compute_dtype(p), "backward in ", dtype_name(compute_dtype(p)), " after a forward in ",
             dtype_name(ws.dtype));
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto f32 = [&](int64_t off, Shape sh) { return ws.f32(off, sh); };
    auto zero = [&](TensorView v) { ops::fill(s, v, 0.0f); };
    // Keeps `v` in the layer's slot for backward_weight (split) and returns where weight reads it.
    auto keep = [&](TensorView v, int64_t slot) {
      if (fused) return v;
      TensorView k = act(slot, v.shape);
      if (input) s.copy(k.data, v.data, static_cast<size_t>(v.numel()) * dtype_size(v.dtype));
      return k;
    };
    const TensorView none{};
    TensorView dresidual = act(P.dresidual, Shape{BT, C});
    // A layernorm's output gradient: scratch (fused), or the slot kInput fills and kWeight reads.
    auto dln_at = [&](int64_t slot) { return act(fused ? P.dln : slot, Shape{BT, C}); };
    // A layernorm's backward from `dout`. kInput sends its weight gradients to a discarded scratch,
    // kWeight its input gradient (the kernel's weight gradients do not depend on the input
    // gradient, so the split adds the fused bits).
    auto ln_back = [&](TensorView dout, ConstTensorView in, ConstTensorView w, TensorView gw, TensorView gb,
                       ConstTensorView mean, ConstTensorView rstd) {
      ops::layernorm_backward(s, input ? dresidual : act(P.dln, Shape{BT, C}), weight ? gw : f32(P.ln_scratch, Shape{C}),
                              weight ? gb : f32(P.ln_scratch + 4 * C, Shape{C}), dout, in, w, mean, rstd);
    };
    // Without a head the gradient of the chunk's output was received into dresidual.
    if (K.head) {
      // LM head: logits = lnf @ wte^T (dlogits were left in the logits by the forward)
      const TensorView dlogits = act(P.logits, Shape{BT, P.Vp}), lnf = act(P.lnf, Shape{BT, C});
      const TensorView dln = dln_at(P.dlnf);
      if (input) {
        zero(dresidual);
        p.before_backward(K.head_block);
        zero(dln);
      }
      ops::lm_head_backward(s, input ? dln : none, weight ? grad(p, K.head_block, 0) : none, dlogits, lnf,
                            param(p, K.head_block, 0));
      if (weight && K.head_block != K.emb_block) p.after_backward(K.head_block);
      // final layernorm
      if (input) p.before_backward(K.lnf_block);
      const int64_t last_res = L > 0 ? P.layers[static_cast<size_t>(L - 1)].residual3 : P.encoded;
      ln_back(dln, act(last_res, Shape{BT, C}), param(p, K.lnf_block, 0), grad(p, K.lnf_block, 0),
              grad(p, K.lnf_block, 1), f32(P.lnf_mean, Shape{BT}), f32(P.lnf_rstd, Shape{BT}));
      if (weight) p.after_backward(K.lnf_block);
    }

    for (int l = L - 1; l >= 0; --l) {
      const int b = K.layer_blocks[static_cast<size_t>(l)];
      if (input) p.before_backward(b);
      const LayerParams w = layer_params(p, b);
      const LayerParams g = layer_grads(p, b);
      const auto& A = P.layers[static_cast<size_t>(l)];
      const int64_t res_in = l > 0 ? P.layers[static_cast<size_t>(l - 1)].residual3 : P.encoded;
      // After before_backward: stage 3 has gathered this block again, so the recompute sees the
      // same parameters as the forward did. It writes activations only, never a gradient.
      if (input && P.recompute != Recompute::kNone) {
        OptionalNvtxRange range;
        if (ranges_enabled()) range.open(NvtxCategory::kBackward, "recompute h." + std::to_string(K.first_layer + l), p.device_index());
        ws.recompute_begin(s);
        block_forward(s, ws, w, l, P.recompute == Recompute::kFull ? BlockPass::kFull : BlockPass::kSelective);
        ws.recompute_end(s);
      }
      TensorView dfch = act(fused ? P.dfch : A.dfch, Shape{BT, 4 * C});
      TensorView datty = act(P.datty, Shape{BT, C});
      TensorView dqkv = act(fused ? P.dqkv : A.dqkv, Shape{BT, 3 * C});
      // residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
      const TensorView dres3 = keep(dresidual, A.dres3);
      // c_proj's input gradient carried through the GELU in one op (a GEMM epilogue on GPUs), which
      // also sums c_fc's bias gradient when this pass computes weight gradients too.
      const bool fc_bias_in_dgelu = input && weight;
      if (input)
        ops::matmul_backward_dgelu(s, dfch, fc_bias_in_dgelu ? g.fcb : none, dres3, w.fcprojw,
                                   act(A.fch, Shape{BT, 4 * C}));
      if (weight)
        ops::matmul_backward(s, none, g.fcprojw, g.fcprojb, dres3, act(A.fch_gelu, Shape{BT, 4 * C}), w.fcprojw);
      const TensorView dln2 = dln_at(A.dln2);  // no earlier writer: the matmul overwrites it
      ops::matmul_backward(s, input ? dln2 : none, weight ? g.fcw : none, weight && !fc_bias_in_dgelu ? g.fcb : none,
                           dfch, act(A.ln2, Shape{BT, C}), w.fcw, /*overwrite_din=*/true);
      ln_back(dln2, act(A.residual2, Shape{BT, C}), w.ln2w, g.ln2w, g.ln2b, f32(A.ln2_mean, Shape{BT}),
              f32(A.ln2_rstd, Shape{BT}));
      // residual2 = residual + attproj(attention(qkv(ln1(residual))))
      const TensorView dres2 = keep(dresidual, A.dres2);
      // datty and dln1 have no earlier writer in this layer: their matmuls overwrite (no zero fill).
      ops::matmul_backward(s, input ? datty : none, weight ? g.attprojw : none, weight ? g.attprojb : none, dres2,
                           act(A.atty, Shape{BT, C}), w.attprojw, /*overwrite_din=*/true);
      // dqkv has no earlier writer in this layer: overwritten (no zero fill, and no staging buffer
      // for a library's 16-bit attention backward).
      if (input)
        ops::flash_attention_backward(s, TensorView{dqkv.data, dqkv.dtype, Shape{P.B, P.T, 3 * C}, dqkv.device},
                                      act(P.datty, Shape{P.B, P.T, C}), act(A.qkv, Shape{P.B, P.T, 3 * C}),
                                      act(A.atty, Shape{P.B, P.T, C}), f32(A.lse, Shape{P.B, P.NH, P.T}), NH,
                                      f32(P.attn_scratch, Shape{P.attn_scratch_numel}), ops::GradWrite::kOverwrite);
      const TensorView dln1 = dln_at(A.dln1);
      ops::matmul_backward(s, input ? dln1 : none, weight ? g.qkvw : none, weight ? g.qkvb : none, dqkv,
                           act(A.ln1, Shape{BT, C}), w.qkvw, /*overwrite_din=*/true);
      ln_back(dln1, act(res_in, Shape{BT, C}), w.ln1w, g.ln1w, g.ln1b, f32(A.ln1_mean, Shape{BT}),
              f32(A.ln1_rstd, Shape{BT}));
      if (weight) p.after_backward(b);
    }

    if (!K.embedding) return;  // dresidual now holds the gradient of the chunk's input
    if (input) p.before_backward(K.emb_block);
    if (weight) {
      const TensorView dwpe_full = grad(p, K.emb_block, 1);
      const TensorView dwpe{dwpe_full.data, DType::kF32, Shape{P.T, C}, dwpe_full.device};
      ops::encoder_backward(s, grad(p, K.emb_block, 0), dwpe, act(P.dresidual, Shape{P.B, P.T, C}), batch.inputs,
                            ops::VocabRange{0, P.V});
      p.after_backward(K.emb_block);
    }
  }

 private:
  // Layer l's forward ops (pass kForward), or the subset a backward re-runs: selective re-runs
  // the ops whose outputs it did not keep (both layernorms, GELU) from kept inputs; full re-runs
  // everything backward reads. The same call writes the same bits each time.
  void block_forward(Stream& s, GptWorkspace& ws, const LayerParams& w, int l, BlockPass pass) const {
    const GptPlan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C;
    const int NH = static_cast<int>(P.NH);
    const bool fwd = pass == BlockPass::kForward, matmuls = pass != BlockPass::kSelective;
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto f32 = [&](int64_t off, Shape sh) { return ws.f32(off, sh); };
    const auto& A = P.layers[static_cast<size_t>(l)];
    const TensorView res_in = act(l > 0 ? P.layers[static_cast<size_t>(l - 1)].residual3 : P.encoded, Shape{BT, C});
    TensorView ln1 = act(A.ln1, Shape{BT, C}), qkv = act(A.qkv, Shape{BT, 3 * C});
    TensorView atty = act(A.atty, Shape{BT, C}), attproj = act(P.attproj, Shape{BT, C});
    TensorView res2 = act(A.residual2, Shape{BT, C}), ln2 = act(A.ln2, Shape{BT, C});
    TensorView fch = act(A.fch, Shape{BT, 4 * C}), fch_gelu = act(A.fch_gelu, Shape{BT, 4 * C});
    ops::layernorm_forward(s, ln1, f32(A.ln1_mean, Shape{BT}), f32(A.ln1_rstd, Shape{BT}), res_in, w.ln1w,
                           w.ln1b, kLayerNormEps);
    if (matmuls) {  // selective keeps qkv, the attention output and its lse per layer
      ops::matmul_forward(s, qkv, ln1, w.qkvw, w.qkvb);
      ops::flash_attention_forward(s, act(A.atty, Shape{P.B, P.T, C}), f32(A.lse, Shape{P.B, P.NH, P.T}),
                                   act(A.qkv, Shape{P.B, P.T, 3 * C}), NH);
    }
    // residual2 = residual + attproj and ln2 = layernorm(residual2) in one pass (the bits of the add
    // and the layernorm); selective recompute re-runs only the layernorm from the kept residual2.
    // The block's later add (residual3) stays separate: the layernorm after it is the next block's,
    // whose parameters ZeRO stage 3 gathers only at that block's before_forward.
    if (matmuls) {
      ops::matmul_forward(s, attproj, atty, w.attprojw, w.attprojb);
      ops::residual_layernorm_forward(s, res2, ln2, f32(A.ln2_mean, Shape{BT}), f32(A.ln2_rstd, Shape{BT}),
                                      res_in, attproj, w.ln2w, w.ln2b, kLayerNormEps);
    } else {
      ops::layernorm_forward(s, ln2, f32(A.ln2_mean, Shape{BT}), f32(A.ln2_rstd, Shape{BT}), res2, w.ln2w,
                             w.ln2b, kLayerNormEps);
    }
    // c_fc and its GELU in one op (a GEMM epilogue on GPUs); a selective recompute keeps fch, the
    // pre-GELU aux, and in fp32 re-runs the GELU alone (the bits of the fused op's on the CPU
    // backend). In 16 bits the fused op takes the GELU of the fp32 sum, not of the rounded fch, so
    // a selective recompute re-runs the fused op (c_fc's GEMM again, rewriting fch's same bits):
    // every recompute mode keeps the forward's bits.
    if (matmuls || ws.dtype != DType::kF32)
      ops::matmul_gelu_forward(s, fch_gelu, fch, ln2, w.fcw, w.fcb);
    else
      ops::gelu_forward(s, fch_gelu, fch);
    if (!fwd) return;  // backward never reads the block's output projection or its sum
    TensorView fcproj = act(P.fcproj, Shape{BT, C}), res3 = act(A.residual3, Shape{BT, C});
    ops::matmul_forward(s, fcproj, fch_gelu, w.fcprojw, w.fcprojb);
    ops::add(s, res3, res2, fcproj);
  }

  // The dtype this model computes in on `p` (param_compute_dtype).
  DType compute_dtype(ParamAccess& p) const { return param_compute_dtype(activations_, p); }
  // Parameters in the compute dtype; gradients are fp32.
  TensorView param(ParamAccess& p, int block, int idx) const { return block_param(layout_, activations_, p, block, idx); }
  TensorView grad(ParamAccess& p, int block, int idx) const { return block_grad(layout_, p, block, idx); }
  static LayerParams views(const std::function<TensorView(int)>& at) {
    return LayerParams{at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11)};
  }
  LayerParams layer_params(ParamAccess& p, int block) const {
    return views([&](int i) { return param(p, block, i); });
  }
  LayerParams layer_grads(ParamAccess& p, int block) const {
    return views([&](int i) { return grad(p, block, i); });
  }

  void init_map() {
    map_.degree = 1;
    map_.logical = &whole_;
    map_.local = &layout_;
  }
  // A local copy of logical block `logical` (wte padded to Vp rows, the padding initialised to
  // zero) and its map entries; returns its index.
  int take(int logical) {
    const int b = layout_.add_block(whole_.block(logical).name);
    map_.places.resize(static_cast<size_t>(layout_.num_blocks()));
    const auto& tensors = whole_.block(logical).tensors;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ParamTensor& t = tensors[i];
      const bool wte = logical == 0 && i == 0;
      const Shape shape = wte ? Shape{ops::padded_vocab(t.shape[0]), t.shape[1]} : t.shape;
      layout_.add_tensor(b, t.name, shape, t.init, t.init_std, t.weight_decay, wte ? t.numel : -1);
      map_.places.back().push_back({logical, static_cast<int>(i), wte ? TensorSplit::kRows : TensorSplit::kReplicated});
    }
    logical_.push_back(logical);
    return b;
  }

  ModelConfig config_;
  Recompute recompute_;
  DType activations_ = DType::kF32;
  bool split_ = false;
  ParamLayout whole_;   // gpt_layout: the real vocabulary (what checkpoints and exports hold)
  ParamLayout layout_;  // the local blocks: wte padded
  TensorMap map_;
  std::vector<GptChunk> chunks_;
  std::vector<int> logical_;  // logical block of each local block
};

}  // namespace

std::unique_ptr<Model> make_gpt(const ModelConfig& config, Recompute recompute, DType activations) {
  return std::make_unique<Gpt>(config, recompute, activations);
}

std::unique_ptr<Model> make_gpt_tp_stage(const ModelConfig& config, const PipelineStageSpec& stage,
                                         const TensorParallel& tp, DType activations);

std::unique_ptr<Model> make_gpt_stage(const ModelConfig& config, const PipelineStageSpec& stage, Recompute recompute,
                                      const TensorParallel& tp, DType activations) {
  ZT_REQUIRE(config.kind == ModelKind::kGpt, "pipeline parallelism splits GPT models only, not the MLP");
  ZT_REQUIRE(!stage.chunks.empty(), "a pipeline stage runs at least one chunk");
  if (tp.degree > 1) {
    ZT_REQUIRE(recompute == Recompute::kNone, "--recompute ", recompute_name(recompute),
               " is not supported with tensor parallelism yet; use --recompute none");
    return make_gpt_tp_stage(config, stage, tp, activations);
  }
  // backward_weight reads the layer inputs a recompute would have overwritten by then.
  ZT_REQUIRE(!(stage.split_backward && recompute != Recompute::kNone), "--recompute ", recompute_name(recompute),
             " is not supported with a split backward (zb-h1) yet; use --recompute none or another schedule");
  return std::make_unique<Gpt>(config, stage, recompute, activations);
}

}  // namespace zt
