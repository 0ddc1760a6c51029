// GPT-2: token + learned position embeddings, pre-LayerNorm blocks of causal self-attention and
// a 4x GELU MLP, final LayerNorm, LM head tied to the token embedding. Forward and backward are
// written out op by op (as llm.c's train_gpt2.c), no autograd tape.
// Blocks: 0 = embeddings (wte, wpe; wte is also the LM head), 1..L = transformer layers,
// L+1 = final layernorm. Backward visits: head (block 0, partial), L+1, L..1, encoder (block 0).
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>

#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
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

// Offsets (in floats) of every activation in the workspace arena. Under recomputation, fields of
// different layers share one offset (the recompute scratch): backward re-runs the forward op
// that wrote it, from kept inputs, right before reading it.
// Attention is the tiled (flash-style) op: a layer keeps its output and log-sum-exp (lse,
// [B, NH, T]) for backward, never a T x T matrix; backward's scratch is one buffer for all layers.
//  - none:      every layer keeps all it wrote;
//  - selective: ln1, ln2 (outputs only; mean/rstd stay per layer) and the GELU output share one
//               scratch: re-run from the kept residual and fch (attention output and lse stay per
//               layer: re-running attention would cost its forward to save only O(T) per row);
//  - full:      only residual3 (the next block's input) stays per layer; the whole block forward
//               re-runs into one shared set in its backward (all but the output projection and add,
//               whose results backward never reads).
struct GptPlan {
  int64_t B, T, C, NH, L, V;
  Recompute recompute;
  int64_t total = 0;
  int64_t encoded, lnf, lnf_mean, lnf_rstd, logits, losses;
  // shared scratch (not needed by backward, or reused across layers)
  int64_t attproj, fcproj, dresidual, dln, dfch, dfch_gelu, datty, dqkv, attn_scratch, attn_scratch_numel;
  struct Layer {
    int64_t ln1, ln1_mean, ln1_rstd, qkv, atty, lse, residual2, ln2, ln2_mean, ln2_rstd, fch,
        fch_gelu, residual3;
  };
  std::vector<Layer> layers;

  int64_t add(int64_t n) {
    const int64_t off = total;
    total += (n + 63) / 64 * 64;  // 256-byte alignment for every activation
    return off;
  }

  GptPlan(const ModelConfig& c, int64_t B_, int64_t T_, Recompute r)
      : B(B_), T(T_), C(c.embd), NH(c.heads), L(c.layers), V(c.vocab), recompute(r) {
    const int64_t BT = B * T, BTC = BT * C, lse_size = B * NH * T;
    encoded = add(BTC);
    layers.resize(static_cast<size_t>(L));
    // Fields that do not depend on the layer are allocated once and copied into every layer.
    Layer shared{};
    if (r == Recompute::kSelective) {
      shared.ln1 = add(BTC), shared.ln2 = add(BTC), shared.fch_gelu = add(4 * BTC);
    } else if (r == Recompute::kFull) {
      shared.ln1 = add(BTC), shared.ln1_mean = add(BT), shared.ln1_rstd = add(BT), shared.qkv = add(3 * BTC);
      shared.atty = add(BTC), shared.lse = add(lse_size), shared.residual2 = add(BTC), shared.ln2 = add(BTC);
      shared.ln2_mean = add(BT), shared.ln2_rstd = add(BT), shared.fch = add(4 * BTC);
      shared.fch_gelu = add(4 * BTC);
    }
    for (auto& l : layers) {
      l = shared;
      if (r == Recompute::kNone) l.ln1 = add(BTC);
      if (r != Recompute::kFull) l.ln1_mean = add(BT), l.ln1_rstd = add(BT), l.qkv = add(3 * BTC), l.atty = add(BTC);
      if (r != Recompute::kFull) l.lse = add(lse_size);
      if (r != Recompute::kFull) l.residual2 = add(BTC);
      if (r == Recompute::kNone) l.ln2 = add(BTC);
      if (r != Recompute::kFull) l.ln2_mean = add(BT), l.ln2_rstd = add(BT), l.fch = add(4 * BTC);
      if (r == Recompute::kNone) l.fch_gelu = add(4 * BTC);
      l.residual3 = add(BTC);
    }
    lnf = add(BTC), lnf_mean = add(BT), lnf_rstd = add(BT), logits = add(BT * V), losses = add(BT);
    attproj = add(BTC), fcproj = add(BTC);
    dresidual = add(BTC), dln = add(BTC), dfch = add(4 * BTC), dfch_gelu = add(4 * BTC);
    datty = add(BTC), dqkv = add(3 * BTC);
    attn_scratch_numel = static_cast<int64_t>((ops::flash_attention_scratch_bytes(B, T, C, NH) + 3) / 4);
    attn_scratch = add(attn_scratch_numel);
  }
};

class GptWorkspace final : public Workspace {
 public:
  GptWorkspace(const ModelConfig& c, Device& d, int B, int T, Recompute r)
      : plan(c, B, T, r), device(d.index()), buf(d.memory(), static_cast<size_t>(plan.total) * 4, d.compute(), "activations") {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return static_cast<int>(plan.T); }
  TensorView losses() override { return view(plan.losses, Shape{plan.B * plan.T}); }
  TensorView logits() override { return view(plan.logits, Shape{plan.B * plan.T, plan.V}); }
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

  TensorView view(int64_t off, Shape s) { return TensorView{buf.as<float>() + off, DType::kF32, s, device}; }

  GptPlan plan;
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
  Gpt(const ModelConfig& c, Recompute r) : config_(c), recompute_(r), layout_(gpt_layout(c)) {}

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }

  size_t workspace_bytes(int B, int T) const override {
    return static_cast<size_t>(GptPlan(config_, B, T, recompute_).total) * 4;
  }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int T) const override {
    ZT_REQUIRE(T >= 1 && T <= config_.seq_len, "sequence length ", T, " is above the model's context of ",
               config_.seq_len, " tokens");
    return std::make_unique<GptWorkspace>(config_, d, B, T, recompute_);
  }

  void forward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch, float dloss,
               bool train) const override {
    auto& ws = static_cast<GptWorkspace&>(wsb);
    const GptPlan& P = ws.plan;
    ZT_CHECK(batch.B == P.B && batch.T == P.T, "batch ", batch.B, "x", batch.T, " on a workspace for ", P.B, "x", P.T);
    const int64_t BT = P.B * P.T, C = P.C;
    const int L = static_cast<int>(P.L);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };

    p.before_forward(0);
    const TensorView wte = param(p, 0, 0), wpe_full = param(p, 0, 1);
    const TensorView wpe{wpe_full.data, DType::kF32, Shape{P.T, C}, wpe_full.device};
    TensorView residual = act(P.encoded, Shape{P.B, P.T, C});
    ops::encoder_forward(s, residual, batch.inputs, wte, wpe);

    for (int l = 0; l < L; ++l) {
      p.before_forward(l + 1);
      const LayerParams w = layer_params(p, l + 1);
      block_forward(s, ws, w, l, BlockPass::kForward);
      residual = act(P.layers[static_cast<size_t>(l)].residual3, Shape{P.B, P.T, C});
    }

    p.before_forward(L + 1);
    const TensorView res_final{residual.data, DType::kF32, Shape{BT, C}, residual.device};
    TensorView lnf = act(P.lnf, Shape{BT, C});
    ops::layernorm_forward(s, lnf, act(P.lnf_mean, Shape{BT}), act(P.lnf_rstd, Shape{BT}), res_final,
                           param(p, L + 1, 0), param(p, L + 1, 1), kLayerNormEps);
    p.before_forward(0);  // the LM head reads wte again (stage 3 gathers it again)
    TensorView logits = act(P.logits, Shape{BT, P.V});
    ops::matmul_forward(s, logits, lnf, param(p, 0, 0), ConstTensorView{});
    const ConstTensorView targets{batch.targets.data, DType::kI32, Shape{BT}, batch.targets.device};
    ops::classifier_forward_backward(s, logits, act(P.losses, Shape{BT}), targets, dloss, train, batch.loss_scale);
  }

  void backward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch) const override {
    auto& ws = static_cast<GptWorkspace&>(wsb);
    const GptPlan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C;
    const int L = static_cast<int>(P.L), NH = static_cast<int>(P.NH);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto zero = [&](TensorView v) { ops::fill(s, v, 0.0f); };

    TensorView dresidual = act(P.dresidual, Shape{BT, C});
    TensorView dln = act(P.dln, Shape{BT, C});
    zero(dresidual);

    // LM head: logits = lnf @ wte^T
    p.before_backward(0);
    zero(dln);
    ops::matmul_backward(s, dln, grad(p, 0, 0), TensorView{}, act(P.logits, Shape{BT, P.V}),
                         act(P.lnf, Shape{BT, C}), param(p, 0, 0));
    // final layernorm
    p.before_backward(L + 1);
    const int64_t last_res = L > 0 ? P.layers[static_cast<size_t>(L - 1)].residual3 : P.encoded;
    ops::layernorm_backward(s, dresidual, grad(p, L + 1, 0), grad(p, L + 1, 1), dln,
                            act(last_res, Shape{BT, C}), param(p, L + 1, 0),
                            act(P.lnf_mean, Shape{BT}), act(P.lnf_rstd, Shape{BT}));
    p.after_backward(L + 1);

    for (int l = L - 1; l >= 0; --l) {
      p.before_backward(l + 1);
      const LayerParams w = layer_params(p, l + 1);
      const LayerParams g = layer_grads(p, l + 1);
      const auto& A = P.layers[static_cast<size_t>(l)];
      const int64_t res_in = l > 0 ? P.layers[static_cast<size_t>(l - 1)].residual3 : P.encoded;
      // After before_backward: stage 3 has gathered this block again, so the recompute sees the
      // same parameters as the forward did. It writes activations only, never a gradient.
      if (P.recompute != Recompute::kNone) {
        OptionalNvtxRange range;
        if (ranges_enabled()) range.open(NvtxCategory::kBackward, "recompute h." + std::to_string(l), p.device_index());
        ws.recompute_begin(s);
        block_forward(s, ws, w, l, P.recompute == Recompute::kFull ? BlockPass::kFull : BlockPass::kSelective);
        ws.recompute_end(s);
      }
      TensorView dfch_gelu = act(P.dfch_gelu, Shape{BT, 4 * C}), dfch = act(P.dfch, Shape{BT, 4 * C});
      TensorView datty = act(P.datty, Shape{BT, C}), dqkv = act(P.dqkv, Shape{BT, 3 * C});
      // residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
      zero(dfch_gelu);
      ops::matmul_backward(s, dfch_gelu, g.fcprojw, g.fcprojb, dresidual, act(A.fch_gelu, Shape{BT, 4 * C}), w.fcprojw);
      zero(dfch);
      ops::gelu_backward(s, dfch, act(A.fch, Shape{BT, 4 * C}), dfch_gelu);
      zero(dln);
      ops::matmul_backward(s, dln, g.fcw, g.fcb, dfch, act(A.ln2, Shape{BT, C}), w.fcw);
      ops::layernorm_backward(s, dresidual, g.ln2w, g.ln2b, dln, act(A.residual2, Shape{BT, C}), w.ln2w,
                              act(A.ln2_mean, Shape{BT}), act(A.ln2_rstd, Shape{BT}));
      // residual2 = residual + attproj(attention(qkv(ln1(residual))))
      zero(datty);
      ops::matmul_backward(s, datty, g.attprojw, g.attprojb, dresidual, act(A.atty, Shape{BT, C}), w.attprojw);
      zero(dqkv);
      ops::flash_attention_backward(s, act(P.dqkv, Shape{P.B, P.T, 3 * C}), act(P.datty, Shape{P.B, P.T, C}),
                                    act(A.qkv, Shape{P.B, P.T, 3 * C}), act(A.atty, Shape{P.B, P.T, C}),
                                    act(A.lse, Shape{P.B, P.NH, P.T}), NH, act(P.attn_scratch, Shape{P.attn_scratch_numel}));
      zero(dln);
      ops::matmul_backward(s, dln, g.qkvw, g.qkvb, dqkv, act(A.ln1, Shape{BT, C}), w.qkvw);
      ops::layernorm_backward(s, dresidual, g.ln1w, g.ln1b, dln, act(res_in, Shape{BT, C}), w.ln1w,
                              act(A.ln1_mean, Shape{BT}), act(A.ln1_rstd, Shape{BT}));
      p.after_backward(l + 1);
    }

    p.before_backward(0);
    const TensorView dwpe_full = grad(p, 0, 1);
    const TensorView dwpe{dwpe_full.data, DType::kF32, Shape{P.T, C}, dwpe_full.device};
    ops::encoder_backward(s, grad(p, 0, 0), dwpe, act(P.dresidual, Shape{P.B, P.T, C}), batch.inputs);
    p.after_backward(0);
  }

  std::vector<int> forward_order() const override { return gpt_forward_order(config_.layers); }
  std::vector<int> backward_order() const override { return gpt_backward_order(config_.layers); }

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
    const auto& A = P.layers[static_cast<size_t>(l)];
    const TensorView res_in = act(l > 0 ? P.layers[static_cast<size_t>(l - 1)].residual3 : P.encoded, Shape{BT, C});
    TensorView ln1 = act(A.ln1, Shape{BT, C}), qkv = act(A.qkv, Shape{BT, 3 * C});
    TensorView atty = act(A.atty, Shape{BT, C}), attproj = act(P.attproj, Shape{BT, C});
    TensorView res2 = act(A.residual2, Shape{BT, C}), ln2 = act(A.ln2, Shape{BT, C});
    TensorView fch = act(A.fch, Shape{BT, 4 * C}), fch_gelu = act(A.fch_gelu, Shape{BT, 4 * C});
    ops::layernorm_forward(s, ln1, act(A.ln1_mean, Shape{BT}), act(A.ln1_rstd, Shape{BT}), res_in, w.ln1w,
                           w.ln1b, kLayerNormEps);
    if (matmuls) {  // selective keeps qkv, the attention output and its lse per layer
      ops::matmul_forward(s, qkv, ln1, w.qkvw, w.qkvb);
      ops::flash_attention_forward(s, act(A.atty, Shape{P.B, P.T, C}), act(A.lse, Shape{P.B, P.NH, P.T}),
                                   act(A.qkv, Shape{P.B, P.T, 3 * C}), NH);
    }
    if (matmuls) {
      ops::matmul_forward(s, attproj, atty, w.attprojw, w.attprojb);
      ops::add(s, res2, res_in, attproj);
    }
    ops::layernorm_forward(s, ln2, act(A.ln2_mean, Shape{BT}), act(A.ln2_rstd, Shape{BT}), res2, w.ln2w,
                           w.ln2b, kLayerNormEps);
    if (matmuls) ops::matmul_forward(s, fch, ln2, w.fcw, w.fcb);
    ops::gelu_forward(s, fch_gelu, fch);
    if (!fwd) return;  // backward never reads the block's output projection or its sum
    TensorView fcproj = act(P.fcproj, Shape{BT, C}), res3 = act(A.residual3, Shape{BT, C});
    ops::matmul_forward(s, fcproj, fch_gelu, w.fcprojw, w.fcprojb);
    ops::add(s, res3, res2, fcproj);
  }

  TensorView tensor_at(float* base, int device, int block, int idx) const {
    const ParamTensor& t = layout_.block(block).tensors[static_cast<size_t>(idx)];
    return TensorView{base + t.offset, DType::kF32, t.shape, device};
  }
  TensorView param(ParamAccess& p, int block, int idx) const {
    return tensor_at(p.params(block), p.device_index(), block, idx);
  }
  TensorView grad(ParamAccess& p, int block, int idx) const {
    return tensor_at(p.grads(block), p.device_index(), block, idx);
  }
  static LayerParams views(const std::function<TensorView(int)>& at) {
    return LayerParams{at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11)};
  }
  LayerParams layer_params(ParamAccess& p, int block) const {
    return views([&](int i) { return param(p, block, i); });
  }
  LayerParams layer_grads(ParamAccess& p, int block) const {
    return views([&](int i) { return grad(p, block, i); });
  }

  ModelConfig config_;
  Recompute recompute_;
  ParamLayout layout_;
};

}  // namespace

std::unique_ptr<Model> make_gpt(const ModelConfig& config, Recompute recompute) {
  return std::make_unique<Gpt>(config, recompute);
}

}  // namespace zt
