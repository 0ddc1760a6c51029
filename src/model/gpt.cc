// GPT-2 (token + learned position embeddings, pre-LayerNorm blocks of causal self-attention and a
// 4x GELU MLP, final LayerNorm, LM head tied to wte), op by op as llm.c's train_gpt2.c, split over a
// tensor group of D ranks (Megatron-LM, Shoeybi et al. 2019); the plain GPT is the group of one.
// A rank's local block b holds its shard of gpt_layout's block logical_block(b) (0 embeddings, 1..L
// layers, L+1 ln_f); the TensorMap maps it back, so checkpoints, exports and init speak gpt_layout.
//  - D = 1: wte padded (llm.c's Vp) to ops::padded_vocab(V) rows, so the LM head's GEMMs run on
//    aligned tensor-core tiles; fused ops (bias and GELU epilogues, LM head, fused classifier).
//  - D > 1: column-parallel QKV and c_fc, row-parallel output projections, heads split, a
//    vocabulary-parallel embedding and cross-entropy. A layer block holds its split tensors first
//    and its replicated ones (layernorms, row-parallel biases) last: one region whose gradients a
//    scratch sums over the group before adding them (a split backward adds the fused bits), whose
//    norm the engine counts once per group. With sequence parallelism (Korthikanti et al. 2022) a
//    rank's residual stream is rows [t R, (t+1) R) of the [B*T, C] activations (R = B*T/D); an
//    all-gather enters each column-parallel matmul, overlapping the rank's own rows' GEMM (redone in
//    backward, under the ops before the weight gradient), and a reduce-scatter leaves each
//    row-parallel one (all-reduces without it); input-gradient reductions run under weight GEMMs.
// wte's padding rows are zero, never looked up, out of the softmax: no gradient ever moves them.
// Numerics: fp32, or 16 bits (activations, saved tensors, their gradients, logits and what the
// collectives move; parameters read in 16 bits); statistics, losses and parameter gradients fp32.
// Pipeline stages (make_gpt_stage) run chunks of layers and send the rank's residual rows on; the
// split backward (zb-h1) runs every collective in backward_input, backward_weight none.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <utility>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "model/model.h"

namespace zt {

ParamLayout gpt_layout(const ModelConfig& c) {
  ParamLayout layout;
  const int64_t C = c.embd;
  const float std = 0.02f, proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.layers));
  int b = layout.add_block("embeddings");
  layout.add_tensor(b, "wte.weight", Shape{c.vocab, C}, ParamInit::kNormal, std, true);
  layout.add_tensor(b, "wpe.weight", Shape{c.seq_len, C}, ParamInit::kNormal, std, true);
  std::string p;
  auto norm = [&](const std::string& n) {
    layout.add_tensor(b, p + n + ".weight", Shape{C}, ParamInit::kOnes, 0, false);
    layout.add_tensor(b, p + n + ".bias", Shape{C}, ParamInit::kZeros, 0, false);
  };
  auto linear = [&](const std::string& n, int64_t out, int64_t in, float sd) {
    layout.add_tensor(b, p + n + ".weight", Shape{out, in}, ParamInit::kNormal, sd, true);
    layout.add_tensor(b, p + n + ".bias", Shape{out}, ParamInit::kZeros, 0, false);
  };
  for (int l = 0; l < c.layers; ++l) {
    b = layout.add_block("h." + std::to_string(l)), p = "h." + std::to_string(l) + ".";
    norm("ln_1"), linear("attn.c_attn", 3 * C, C, std), linear("attn.c_proj", C, C, proj_std);
    norm("ln_2"), linear("mlp.c_fc", 4 * C, C, std), linear("mlp.c_proj", C, 4 * C, proj_std);
  }
  b = layout.add_block("ln_f"), p = "";
  norm("ln_f");
  return layout;
}

namespace {

// A D > 1 local layer block's order of the logical tensors.
constexpr LayerTensor kTpOrder[] = {kQkvw, kQkvb, kAttprojw, kFcw, kFcb, kFcprojw,
                                    kLn1w, kLn1b, kAttprojb, kLn2w, kLn2b, kFcprojb};

// The local wte's rows: D = 1 pads to a multiple of 128 (ops::padded_vocab; GPT-2 50257 -> 50304);
// D > 1 to a multiple of 64 D (Megatron pads to 128 D), each rank a whole number of 64-row tiles.
int64_t padded_vocab(int64_t V, int64_t D) { return D == 1 ? ops::padded_vocab(V) : (V + 64 * D - 1) / (64 * D) * 64 * D; }
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One chunk of a model (a whole model is one chunk with the embedding and the head) and its blocks.
struct GptChunk : PipelineChunk {
  int emb_block = -1;             // embedding chunks: the block of wte (or the rank's shard) and wpe
  std::vector<int> layer_blocks;  // the block of each of its layers
  int lnf_block = -1, head_block = -1;  // head chunks: ln_f, and the block whose wte is the LM head
};

// Which parts of a backward one call runs: both (backward()), or the zero-bubble split.
enum class BackPass { kFused, kInput, kWeight };
// What one call of layer_forward runs: the training/eval forward, or a backward's recompute.
enum class BlockPass { kForward, kSelective, kFull };

// One chunk's workspace arena: activations, their gradients, logits and what collectives move in the
// activation dtype. Residual-stream buffers hold the rank's R rows, split matmuls' all B*T rows of
// 1/D of the columns. Under recomputation, layers share slots that backward re-runs the writing op
// into right before reading:
//  - selective: ln1, ln2 (outputs; mean/rstd stay) and the GELU output, re-run from the kept
//    residual and residual2 (D = 1: c_fc's GEMM with its GELU, one fused op; D > 1 the GELU of the
//    kept fch); re-running attention would cost its forward to save O(T) a row;
//  - full: all but residual3 (the next block's input); the block's output projection and add are
//    not re-run (backward never reads them).
// A split backward keeps per layer what backward_weight reads (D = 1: the matmuls' and layernorms'
// output gradients; D > 1: all rows of the weight gradients' inputs, the summed replicated
// gradients); the fused backward takes them from shared scratch.
struct Plan : WorkspaceArena {
  int64_t B, T, C, NH, L, V, Vp, D, R, Cl, NHl;  // L: the chunk's layers; Cl, NHl: a rank's width and heads
  Recompute recompute;
  bool sp, head, split;
  int64_t encoded, lnf = 0, lnf_mean = 0, lnf_rstd = 0, logits = 0, losses = 0, row = 0, row_wide = 0;
  int64_t full, full2, dresidual, dln = 0, dfch, dfch_gelu = 0, datty, dqkv, attn_scratch, attn_scratch_numel;
  int64_t stat_max = 0, gmax = 0, stat_part = 0, gsum = 0, rep = 0;
  int64_t dlnf = 0, ln_scratch = 0, lnf_all = 0, demb_all = 0, lnf_rep = 0, emb_rep = 0;
  struct Layer {
    int64_t ln1, ln1_mean, ln1_rstd, qkv, atty, lse, residual2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu, residual3;
    int64_t dres3, dres2, dfch, dqkv, dln2 = 0, dln1 = 0, ln1_all = 0, ln2_all = 0, rep = 0;
  };
  std::vector<Layer> layers;

  // rep_max / rep_layer: the largest replicated tail of any local block / of a layer block (D > 1).
  Plan(const ModelConfig& c, int64_t B_, int64_t T_, Recompute r, const TensorParallel& tp, int64_t rep_max,
       int64_t rep_layer, const GptChunk& k, bool split_, DType activations)
      : WorkspaceArena{static_cast<int64_t>(dtype_size(activations))}, B(B_), T(T_), C(c.embd), NH(c.heads),
        L(k.layers), V(c.vocab), Vp(padded_vocab(c.vocab, tp.degree)), D(tp.degree),
        R(tp.sequence && D > 1 ? B * T / D : B * T), Cl(C / D), NHl(NH / D), recompute(r), sp(tp.sequence && D > 1),
        head(k.head), split(split_) {
    const int64_t BT = B * T, RC = R * C, lse = B * NHl * T;
    encoded = act(RC);
    layers.resize(static_cast<size_t>(L));
    Layer shared{};  // the slots every layer shares under recomputation
    if (r == Recompute::kSelective) {
      shared.ln1 = act(RC), shared.ln2 = act(RC), shared.fch_gelu = act(BT * 4 * Cl);
    } else if (r == Recompute::kFull) {
      shared.ln1 = act(RC), shared.ln1_mean = f32(R), shared.ln1_rstd = f32(R), shared.qkv = act(BT * 3 * Cl);
      shared.atty = act(BT * Cl), shared.lse = f32(lse), shared.residual2 = act(RC), shared.ln2 = act(RC);
      shared.ln2_mean = f32(R), shared.ln2_rstd = f32(R), shared.fch = act(BT * 4 * Cl), shared.fch_gelu = act(BT * 4 * Cl);
    }
    for (auto& l : layers) {
      l = shared;
      if (r == Recompute::kNone) l.ln1 = act(RC), l.ln2 = act(RC), l.fch_gelu = act(BT * 4 * Cl);
      if (r != Recompute::kFull) {
        l.ln1_mean = f32(R), l.ln1_rstd = f32(R), l.qkv = act(BT * 3 * Cl), l.atty = act(BT * Cl), l.lse = f32(lse);
        l.residual2 = act(RC), l.ln2_mean = f32(R), l.ln2_rstd = f32(R), l.fch = act(BT * 4 * Cl);
      }
      l.residual3 = act(RC);
    }
    if (head) lnf = act(RC), lnf_mean = f32(R), lnf_rstd = f32(R), logits = act(BT * (Vp / D)), losses = f32(BT);
    if (head && act_bytes != 4) row_wide = f32(V);  // 16 bits: a logits row widened (read_logits_row)
    full = act(BT * C), full2 = act(BT * C), dresidual = act(RC);
    dfch = act(BT * 4 * Cl), datty = act(BT * Cl), dqkv = act(BT * 3 * Cl);
    attn_scratch_numel = static_cast<int64_t>((ops::flash_attention_scratch_bytes(B, T, Cl, NHl) + 3) / 4);
    attn_scratch = f32(attn_scratch_numel);
    if (D == 1) {
      dln = act(BT * C);  // no GELU output gradient: matmul_backward_dgelu carries it through
    } else {
      dfch_gelu = act(BT * 4 * Cl), rep = f32(round_up(rep_max, D));
      if (head) stat_max = f32(D * BT), gmax = f32(BT), stat_part = f32(D * 2 * BT), gsum = f32(2 * BT), row = act(Vp);
    }
    // All rows of a layernorm output (its own rows without sequence parallelism); a residual
    // gradient changes after its matmul, so a split backward keeps a copy.
    auto all_rows = [&](int64_t own) { return !sp ? own : split ? act(BT * C) : full; };
    const int64_t dres_all = sp ? full : dresidual;
    for (auto& l : layers) {
      l.dres3 = split ? act(BT * C) : dres_all, l.dres2 = split ? act(BT * C) : dres_all;
      l.dfch = split ? act(BT * 4 * Cl) : dfch, l.dqkv = split ? act(BT * 3 * Cl) : dqkv;
      l.ln1_all = all_rows(l.ln1), l.ln2_all = all_rows(l.ln2);
      if (D == 1) l.dln2 = split ? act(RC) : dln, l.dln1 = split ? act(RC) : dln;
      if (D > 1) l.rep = split ? f32(round_up(rep_layer, D)) : rep;
    }
    if (D == 1 && split) ln_scratch = f32(2 * C);
    if (head) dlnf = D == 1 && split ? act(RC) : dln;
    if (D > 1 && head) lnf_all = all_rows(lnf), lnf_rep = split ? f32(round_up(rep_max, D)) : rep;
    if (k.embedding) demb_all = D > 1 && split ? act(BT * C) : dres_all;
    if (D > 1 && k.embedding) emb_rep = split ? f32(round_up(rep_max, D)) : rep;
  }
};

// One rank's view of its tensor group (D = 1: no communicator, t = 0).
struct TpRank {
  Communicator* comm = nullptr;
  CommGroup group;
  int rank = 0, t = 0;  // communicator rank; coordinate on the tensor axis = position in the group

  enum class Op { kAllGather, kReduceScatter, kAllReduce };
  // A collective on the comm stream after everything `s` issued; `s` waits for it, or with `done`
  // does not: `done` is recorded on the comm stream right after, for s.wait(done) when needed.
  void run(Stream& s, Op op, TensorView full, const char* tag, Event* done = nullptr) const {
    OptionalNvtxRange range;  // the tensor-collectives track of --trace
    if (ranges_enabled()) range.open(NvtxCategory::kTensorParallel, tag, comm->device(rank).index());
    if (op == Op::kAllGather) group.all_gather(rank, full, &s, tag);
    if (op == Op::kReduceScatter) group.reduce_scatter(rank, full, &s, tag);
    if (op == Op::kAllReduce) group.all_reduce(rank, full, &s, tag);
    if (done) comm->device(rank).comm().record(*done);
    if (!done) comm->wait_done(rank, s);
  }
};

TensorView rows_of(TensorView v, int64_t first_row, int64_t rows) {
  const int64_t width = v.shape.numel() / v.shape[0];
  return TensorView{static_cast<char*>(v.data) + first_row * width * static_cast<int64_t>(dtype_size(v.dtype)), v.dtype,
                    Shape{rows, width}, v.device};
}
TensorView flat(TensorView v) { return TensorView{v.data, v.dtype, Shape{v.shape.numel()}, v.device}; }

class GptWorkspace final : public ArenaWorkspace {
 public:
  GptWorkspace(Plan plan_, Device& d, int chunk_, bool embedding_, DType activations, TpRank rank_)
      : ArenaWorkspace(d, plan_.total, activations), plan(std::move(plan_)), chunk(chunk_), embedding(embedding_),
        gathered(plan.D > 1 ? d.create_event() : nullptr), reduced(plan.D > 1 ? d.create_event() : nullptr),
        rank(std::move(rank_)) {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return static_cast<int>(plan.T); }
  TensorView losses() override { return plan.head ? f32(plan.losses, Shape{plan.B * plan.T}) : TensorView{}; }
  // [B*T, Vp/D], the rank's shard of the padded vocabulary (columns >= V: padding, dlogits 0).
  TensorView logits() override { return plan.head ? act(plan.logits, Shape{plan.B * plan.T, plan.Vp / plan.D}) : TensorView{}; }
  // The real V logits (a padded id is never sampled), gathered over the group, widened on the device.
  void read_logits_row(Stream& s, int row_index, float* out) override {
    ZT_CHECK(plan.head, "logits of a pipeline chunk without the LM head");
    const int64_t Vl = plan.Vp / plan.D, bytes = plan.act_bytes;
    int64_t src = plan.logits + static_cast<int64_t>(row_index) * Vl * bytes;
    if (plan.D > 1) {
      s.copy(buf.as<char>() + plan.row + rank.t * Vl * bytes, buf.as<char>() + src, static_cast<size_t>(Vl * bytes));
      rank.run(s, TpRank::Op::kAllGather, act(plan.row, Shape{plan.Vp}), "tp logits row");
      src = plan.row;
    }
    if (dtype != DType::kF32) ops::cast(s, f32(plan.row_wide, Shape{plan.V}), act(src, Shape{plan.V})), src = plan.row_wide;
    s.copy(out, buf.as<char>() + src, static_cast<size_t>(plan.V) * sizeof(float));
  }
  // What crosses pipeline stages: the rank's residual stream (make_gpt_stage).
  TensorView stage_input() override { return embedding ? TensorView{} : residual(plan.encoded); }
  TensorView stage_output() override { return plan.head ? TensorView{} : residual(plan.layers.back().residual3); }
  TensorView stage_gradient() override { return plan.head && embedding ? TensorView{} : residual(plan.dresidual); }
  double take_recompute_seconds() override { return recompute_s.exchange(0.0); }
  // Stream callbacks around a backward's recompute ops: the time counted is when the stream ran them.
  void recompute_begin(Stream& s) { s.host_func([this] { recompute_start = now(); }); }
  void recompute_end(Stream& s) { s.host_func([this] { recompute_s.store(recompute_s.load() + (now() - recompute_start)); }); }
  TensorView residual(int64_t off) { return act(off, plan.sp ? Shape{plan.R, plan.C} : Shape{plan.B, plan.T, plan.C}); }
  TensorView all_rows(int64_t off) { return act(off, Shape{plan.B * plan.T, plan.C}); }
  // The rank's rows of layer l's input; l = the chunk's layer count: the chunk's output.
  TensorView layer_input(int l) {
    return act(l > 0 ? plan.layers[static_cast<size_t>(l - 1)].residual3 : plan.encoded, Shape{plan.R, plan.C});
  }
  int64_t row0() const { return plan.sp ? rank.t * plan.R : 0; }  // the first of the rank's rows

  // ---- the tensor group's layers (D = 1: the plain ops, no collective) ----
  // All B*T rows of the rank's rows `local` [R, C] at `dst`: an all-gather with sequence parallelism,
  // started (the stream waits on `gathered` later) or waited for; else `local`, copied if elsewhere.
  TensorView gather_rows(Stream& s, TensorView local, int64_t dst, const char* tag, bool wait = false) {
    const TensorView all = all_rows(dst), mine = rows_of(all, row0(), plan.R);
    if (mine.data != local.data) s.copy(mine.data, local.data, static_cast<size_t>(plan.R * plan.C * plan.act_bytes));
    if (plan.sp) rank.run(s, TpRank::Op::kAllGather, flat(all), tag, wait ? nullptr : gathered.get());
    return all;
  }
  // out [B*T, N] = (all rows of `local`) @ weight^T + bias: the rank's own rows while the gather
  // runs, then the others.
  void column_matmul(Stream& s, TensorView out, TensorView local, ConstTensorView weight, ConstTensorView bias,
                     const char* tag) {
    if (!plan.sp) return ops::matmul_forward(s, out, local, weight, bias);
    const TensorView all = gather_rows(s, local, plan.full, tag);
    const int64_t mine = row0(), R = plan.R, rest = plan.B * plan.T - mine - R;
    ops::matmul_forward(s, rows_of(out, mine, R), rows_of(all, mine, R), weight, bias);
    s.wait(*gathered);
    if (mine > 0) ops::matmul_forward(s, rows_of(out, 0, mine), rows_of(all, 0, mine), weight, bias);
    if (rest > 0) ops::matmul_forward(s, rows_of(out, mine + R, rest), rows_of(all, mine + R, rest), weight, bias);
  }
  // Backward of out = in_all @ weight^T + bias, returning the rank's rows of the input gradient.
  // D = 1: one call, din at `din_slot`. D > 1, in_all's gather started: the input gradient first (it
  // does not read in_all), its reduction started, then the weight and bias gradients under it.
  TensorView column_backward(Stream& s, TensorView dout, TensorView in_all, TensorView weight, TensorView dweight,
                             TensorView dbias, int64_t din_slot, const char* tag, BackPass pass) {
    const bool input = pass != BackPass::kWeight, weights = pass != BackPass::kInput;
    const TensorView none{}, din = plan.D == 1 ? act(din_slot, Shape{plan.R, plan.C}) : all_rows(plan.full2);
    if (plan.D == 1 || !input) {
      ops::matmul_backward(s, input ? din : none, weights ? dweight : none, weights ? dbias : none, dout, in_all, weight,
                           /*overwrite_din=*/true);
      return din;  // D = 1 kWeight: the slot kInput filled
    }
    ops::matmul_backward(s, din, none, none, dout, in_all, weight, /*overwrite_din=*/true);
    rank.run(s, plan.sp ? TpRank::Op::kReduceScatter : TpRank::Op::kAllReduce, flat(din), tag, reduced.get());
    if (plan.sp) s.wait(*gathered);
    if (weights) ops::matmul_backward(s, none, dweight, dbias, dout, in_all, weight);
    s.wait(*reduced);
    return plan.sp ? rows_of(din, row0(), plan.R) : din;
  }
  // Partial sums over all rows [B*T, C] -> their sum on the rank's rows (reduce-scatter or all-reduce).
  TensorView leave(Stream& s, TensorView partial, const char* tag) {
    rank.run(s, plan.sp ? TpRank::Op::kReduceScatter : TpRank::Op::kAllReduce, flat(partial), tag);
    return plan.sp ? rows_of(partial, row0(), plan.R) : partial;
  }
  // The rank's rows of a row-parallel matmul's output (D > 1: its partial sums left, then the bias).
  TensorView row_matmul(Stream& s, TensorView in, ConstTensorView weight, ConstTensorView bias, const char* tag) {
    const TensorView full = all_rows(plan.full);
    if (plan.D == 1) return ops::matmul_forward(s, full, in, weight, bias), full;
    ops::matmul_forward(s, full, in, weight, ConstTensorView{});
    const TensorView out = leave(s, full, tag);
    ops::bias_forward(s, out, bias);
    return out;
  }
  // All rows of a row-parallel matmul's output gradient, at `slot` when a split backward keeps it;
  // D > 1 input passes first sum the replicated bias's gradient.
  TensorView row_backward_out(Stream& s, int64_t slot, TensorView dbias, const char* tag, bool input) {
    if (!input) return all_rows(slot);
    const TensorView dresidual = act(plan.dresidual, Shape{plan.R, plan.C});
    if (plan.D > 1) ops::bias_backward(s, dbias, dresidual);
    return gather_rows(s, dresidual, slot, tag, true);
  }
  // A layernorm's backward from `dout` into dresidual. D > 1: input passes only (weight gradients
  // go to the replicated scratch). D = 1: kInput sends weight gradients to a discarded scratch,
  // kWeight the input gradient (neither depends on the other: the split adds the fused bits).
  void ln_back(Stream& s, BackPass pass, TensorView dout, ConstTensorView in, ConstTensorView w, TensorView gw,
               TensorView gb, ConstTensorView mean, ConstTensorView rstd) {
    const bool input = pass != BackPass::kWeight, keep = pass != BackPass::kInput || plan.D > 1;
    if (plan.D > 1 && !input) return;
    ops::layernorm_backward(s, act(input ? plan.dresidual : plan.dln, Shape{plan.R, plan.C}),
                            keep ? gw : f32(plan.ln_scratch, Shape{plan.C}),
                            keep ? gb : f32(plan.ln_scratch + 4 * plan.C, Shape{plan.C}), dout, in, w, mean, rstd);
  }

  Plan plan;
  int chunk;
  bool embedding;  // the chunk embeds tokens (no stage input)
  // Recorded on the comm stream right after a collective the compute stream waits for later.
  std::unique_ptr<Event> gathered, reduced;
  TpRank rank;

 private:
  static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
  double recompute_start = 0;            // written and read only by this workspace's stream callbacks
  std::atomic<double> recompute_s{0.0};  // read by the host after synchronizing the stream
};

class Gpt final : public Model {
 public:
  // The whole model (spec null: one chunk), or a pipeline stage (make_gpt_stage).
  Gpt(const ModelConfig& c, Recompute r, const TensorParallel& tp, DType activations, const PipelineStageSpec* spec)
      : config_(c), recompute_(r), tp_(tp), activations_(activations), split_(spec && spec->split_backward),
        whole_(gpt_layout(c)) {
    ZT_CHECK(activations == DType::kF32 || activations == DType::kBF16 || activations == DType::kF16,
             "GPT activations in ", dtype_name(activations));
    const int D = tp.degree;
    for (const auto& [what, value] : {std::pair{"heads", c.heads}, {"width", c.embd}, {"MLP width", 4 * c.embd}}) {
      int best = 1;
      for (int k = 1; k <= value && k <= D; ++k) best = value % k == 0 ? k : best;
      ZT_REQUIRE(value % D == 0, "--tensor-parallel ", D, " does not divide the model's ", what, " (", value,
                 "); the nearest valid degree is ", best);
    }
    map_.degree = D, map_.logical = &whole_, map_.local = &layout_;
    for (int k = 0; k < 12; ++k) slot_[D == 1 ? k : kTpOrder[k]] = k;
    const PipelineStageSpec whole{{PipelineChunk{0, c.layers, true, true}}};
    chunks_ = stage_chunks(spec ? *spec : whole);
    for (int b = 0; D > 1 && b < layout_.num_blocks(); ++b) {
      const int64_t rep = layout_.block(b).numel - map_.replicated_from(b);
      rep_max_ = std::max(rep_max_, rep);
      if (logical_block(b) >= 1 && logical_block(b) <= c.layers) rep_layer_ = std::max(rep_layer_, rep);
    }
  }

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  DType activation_dtype() const override { return activations_; }
  const TensorMap* tensor_map() const override { return &map_; }
  int chunks() const override { return static_cast<int>(chunks_.size()); }
  // Every tensor of a local block comes from one logical block.
  int logical_block(int block) const override { return map_.places.at(static_cast<size_t>(block)).at(0).block; }

  size_t workspace_bytes(int B, int T) const override {
    size_t total = 0;
    for (int c = 0; c < chunks(); ++c) total += chunk_workspace_bytes(B, T, c);
    return total;
  }
  size_t chunk_workspace_bytes(int B, int T, int chunk) const override { return static_cast<size_t>(plan(B, T, chunk).total); }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int T) const override {
    ZT_CHECK(chunks_.size() == 1, "make_workspace on a ", chunks_.size(), "-chunk stage (use make_chunk_workspace)");
    return make_chunk_workspace(d, B, T, 0);
  }
  std::unique_ptr<Workspace> make_chunk_workspace(Device& d, int B, int T, int chunk) const override {
    ZT_REQUIRE(T >= 1 && T <= config_.seq_len, "sequence length ", T, " is above the model's context of ",
               config_.seq_len, " tokens");
    const int D = tp_.degree;
    ZT_REQUIRE(D == 1 || !tp_.sequence || (int64_t{B} * T) % D == 0, "sequence parallelism over ", D,
               " ranks needs the micro-batch's tokens (", B, " x ", T, " = ", int64_t{B} * T, ") to be a multiple of ", D,
               "; change --micro-batch-size or --seq-len, or pass --no-sequence-parallel");
    return std::make_unique<GptWorkspace>(plan(B, T, chunk), d, chunk, chunks_[static_cast<size_t>(chunk)].embedding,
                                          activations_, rank_of(d.index()));
  }

  // Each chunk's visits in chunk order (forward) and reverse chunk order (backward).
  std::vector<int> forward_order() const override {
    std::vector<int> o;
    for (const GptChunk& k : chunks_) {
      if (k.embedding) o.push_back(k.emb_block);
      o.insert(o.end(), k.layer_blocks.begin(), k.layer_blocks.end());
      if (k.head) o.insert(o.end(), {k.lnf_block, k.head_block});
    }
    return o;
  }

  void forward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch, float dloss, bool train) const override {
    auto& ws = static_cast<GptWorkspace&>(wsb);
    const Plan& P = ws.plan;
    const GptChunk& K = chunks_[static_cast<size_t>(ws.chunk)];
    ZT_CHECK(batch.B == P.B && batch.T == P.T, "batch ", batch.B, "x", batch.T, " on a workspace for ", P.B, "x", P.T);
    ws.dtype = compute_dtype(p);
    const TpRank& tr = ws.rank;
    const int64_t BT = P.B * P.T, C = P.C, Vl = P.Vp / P.D;
    const bool tp = P.D > 1;
    const ops::VocabRange vocab{tr.t * Vl, P.V};  // the rank's vocabulary shard

    // Without the embedding the chunk's input rows were received into `encoded`.
    const TensorView residual = ws.layer_input(0);
    if (K.embedding) {
      p.before_forward(K.emb_block);
      const TensorView wte = param(p, K.emb_block, 0), wpe = param(p, K.emb_block, 1);
      // D > 1: each rank looks up its vocabulary shard (zeros elsewhere), summed over the group, and
      // adds the positions of its rows.
      ops::encoder_forward(s, ws.act(tp ? P.full : P.encoded, Shape{P.B, P.T, C}), batch.inputs, wte,
                           tp ? TensorView{} : TensorView{wpe.data, wpe.dtype, Shape{P.T, C}, wpe.device}, vocab);
      if (tp) {
        s.copy(residual.data, ws.leave(s, ws.act(P.full, Shape{BT, C}), "tp embedding").data,
               static_cast<size_t>(P.R * C * P.act_bytes));
        ops::position_forward(s, residual, wpe, ws.row0(), P.T);
      }
    }
    for (int l = 0; l < K.layers; ++l) {
      const int b = K.layer_blocks[static_cast<size_t>(l)];
      p.before_forward(b);
      layer_forward(s, ws, p, l, b, BlockPass::kForward);
    }
    if (!K.head) return;  // the pipeline sends stage_output() (the last residual rows) on

    p.before_forward(K.lnf_block);
    TensorView lnf = ws.act(P.lnf, Shape{P.R, C});
    ops::layernorm_forward(s, lnf, ws.f32(P.lnf_mean, Shape{P.R}), ws.f32(P.lnf_rstd, Shape{P.R}), ws.layer_input(K.layers),
                           param(p, K.lnf_block, 0), param(p, K.lnf_block, 1), kGptLayerNormEps);
    p.before_forward(K.head_block);  // the LM head reads wte again (stage 3 gathers it again)
    const TensorView logits = ws.act(P.logits, Shape{BT, Vl});
    const ConstTensorView targets{batch.targets.data, DType::kI32, Shape{BT}, batch.targets.device};
    if (!tp) {
      ops::lm_head_forward(s, logits, lnf, param(p, K.head_block, 0));
      ops::classifier_forward_backward(s, logits, ws.f32(P.losses, Shape{BT}), targets, dloss, train, batch.loss_scale, vocab);
      return;
    }
    ws.column_matmul(s, logits, lnf, param(p, K.head_block, 0), ConstTensorView{}, "tp ln_f");
    // Vocabulary-parallel cross-entropy: the row maxima, then the sums of exponentials and the
    // target logits, each combined over the group in a fixed order.
    ops::row_max(s, ws.f32(P.stat_max + tr.t * BT * 4, Shape{BT}), logits, vocab);
    tr.run(s, TpRank::Op::kAllGather, ws.f32(P.stat_max, Shape{P.D * BT}), "tp logits max");
    const TensorView gmax = ws.f32(P.gmax, Shape{BT});
    ops::reduce_slices(s, gmax, ws.f32(P.stat_max, Shape{P.D, BT}), ops::SliceReduce::kMax);
    ops::vocab_partials(s, ws.f32(P.stat_part + tr.t * 2 * BT * 4, Shape{2, BT}), logits, gmax, targets, vocab);
    tr.run(s, TpRank::Op::kAllGather, ws.f32(P.stat_part, Shape{P.D * 2 * BT}), "tp logits sums");
    ops::reduce_slices(s, ws.f32(P.gsum, Shape{2 * BT}), ws.f32(P.stat_part, Shape{P.D, 2 * BT}), ops::SliceReduce::kSum);
    ops::vocab_loss_grad(s, logits, ws.f32(P.losses, Shape{BT}), gmax, ws.f32(P.gsum, Shape{BT}),
                         ws.f32(P.gsum + BT * 4, Shape{BT}), targets, vocab, dloss, train, batch.loss_scale);
  }

  void backward(Stream& s, ParamAccess& p, Workspace& w, const Batch& b) const override {
    backprop(s, p, w, b, BackPass::kFused);
  }
  void backward_input(Stream& s, ParamAccess& p, Workspace& w, const Batch& b) const override {
    backprop(s, p, w, b, BackPass::kInput);
  }
  void backward_weight(Stream& s, ParamAccess& p, Workspace& w, const Batch& b) const override {
    backprop(s, p, w, b, BackPass::kWeight);
  }

 private:
  // A local block holding the rank's shard of logical block `lb`: D = 1 a copy (wte padded, its
  // padding initialised to zero), D > 1 a layer's split tensors first, replicated ones last.
  int take(int lb) {
    const int64_t C = config_.embd, D = tp_.degree;
    const int block = layout_.add_block(whole_.block(lb).name);
    map_.places.resize(static_cast<size_t>(layout_.num_blocks()));
    const auto& tensors = whole_.block(lb).tensors;
    auto add = [&](int li, Shape shape, TensorSplit split, int64_t init_numel = -1) {
      const ParamTensor& g = tensors[static_cast<size_t>(li)];
      layout_.add_tensor(block, g.name, shape, g.init, g.init_std, g.weight_decay, init_numel);
      map_.places[static_cast<size_t>(block)].push_back({lb, li, split});
    };
    using enum TensorSplit;
    if (lb == 0) {
      add(0, Shape{padded_vocab(config_.vocab, D) / D, C}, kRows, D == 1 ? tensors[0].numel : -1);
      add(1, tensors[1].shape, kReplicated);
    } else if (lb <= config_.layers && D > 1) {
      add(kQkvw, Shape{3 * C / D, C}, kQkvRows), add(kQkvb, Shape{3 * C / D}, kQkvRows);
      add(kAttprojw, Shape{C, C / D}, kCols), add(kFcw, Shape{4 * C / D, C}, kRows), add(kFcb, Shape{4 * C / D}, kRows);
      add(kFcprojw, Shape{C, 4 * C / D}, kCols);
      for (int k = 6; k < 12; ++k) add(kTpOrder[k], Shape{C}, kReplicated);
    } else {
      for (size_t i = 0; i < tensors.size(); ++i) add(static_cast<int>(i), tensors[i].shape, kReplicated);
    }
    return block;
  }

  // A stage's chunks, taking local blocks in the layout order PipelineStageSpec states.
  std::vector<GptChunk> stage_chunks(const PipelineStageSpec& spec) {
    std::vector<GptChunk> chunks;
    bool embeds = false, heads = false;
    for (const PipelineChunk& pc : spec.chunks) embeds |= pc.embedding, heads |= pc.head;
    const int emb = embeds ? take(0) : -1;
    for (const PipelineChunk& pc : spec.chunks) {
      ZT_CHECK(pc.layers >= 1 && pc.first_layer >= 0 && pc.first_layer + pc.layers <= config_.layers,
               "pipeline chunk of layers ", pc.first_layer, "+", pc.layers, " in a ", config_.layers, "-layer model");
      GptChunk k{pc, pc.embedding ? emb : -1, {}, -1, -1};
      for (int l = 0; l < pc.layers; ++l) k.layer_blocks.push_back(take(pc.first_layer + l + 1));
      chunks.push_back(k);
    }
    if (heads) {
      const int lnf = take(config_.layers + 1), head = embeds ? emb : take(0);
      for (GptChunk& k : chunks)
        if (k.head) k.lnf_block = lnf, k.head_block = head;
    }
    return chunks;
  }

  Plan plan(int B, int T, int chunk) const {
    ZT_CHECK(chunk >= 0 && chunk < chunks(), "chunk ", chunk, " of a ", chunks(), "-chunk model");
    return Plan(config_, B, T, recompute_, tp_, rep_max_, rep_layer_, chunks_[static_cast<size_t>(chunk)], split_, activations_);
  }

  TpRank rank_of(int device) const {
    if (tp_.degree == 1) return TpRank{};
    ZT_CHECK(tp_.comm && tp_.mesh, "a tensor-parallel model built for planning cannot run");
    for (int r = 0; r < tp_.comm->world(); ++r)
      if (tp_.comm->device(r).index() == device)
        return TpRank{tp_.comm, tp_.comm->group(tp_.mesh->tensor_group(r)), r, tp_.mesh->index(MeshAxis::kTensor, r)};
    ZT_THROW(ErrorKind::kInternal, "device ", device, " is not in the tensor-parallel model's communicator");
  }

  // One chunk's backward. kFused is backward(); kInput runs the chain of input gradients and every
  // collective, keeping what the weight gradients read (Plan); kWeight adds every parameter gradient
  // on the rank alone (a sharding engine reduces a block's gradient once, after it). Hooks: kFused
  // and kInput call before_backward, kFused and kWeight after_backward.
  void backprop(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch, BackPass pass) const {
    ZT_CHECK(split_ || pass == BackPass::kFused, "a split backward on a model made without split_backward");
    auto& ws = static_cast<GptWorkspace&>(wsb);
    const Plan& P = ws.plan;
    const GptChunk& K = chunks_[static_cast<size_t>(ws.chunk)];
    const TpRank& tr = ws.rank;
    const int64_t BT = P.B * P.T, C = P.C, Vl = P.Vp / P.D;
    const bool input = pass != BackPass::kWeight, weight = pass != BackPass::kInput;
    ZT_CHECK(ws.dtype == compute_dtype(p), "backward in ", dtype_name(compute_dtype(p)), " after a forward in ",
             dtype_name(ws.dtype));
    const TensorView none{};
    // Without a head the gradient of the chunk's output rows was received into dresidual.
    const TensorView dresidual = ws.act(P.dresidual, Shape{P.R, C});
    if (K.head) {  // LM head: logits = lnf @ wte^T (dlogits were left in the logits by the forward)
      if (input) {
        ops::fill(s, dresidual, 0.0f);
        p.before_backward(K.head_block);
      }
      const TensorView dlogits = ws.act(P.logits, Shape{BT, Vl});
      TensorView dlnf = ws.act(P.dlnf, Shape{BT, C});
      if (P.D == 1) {
        if (input) ops::fill(s, dlnf, 0.0f);
        ops::lm_head_backward(s, input ? dlnf : none, weight ? grad(p, K.head_block, 0) : none, dlogits,
                              ws.act(P.lnf, Shape{BT, C}), param(p, K.head_block, 0));
      } else {  // dlnf: partial sums over the vocabulary shards
        const TensorView lnf_all = input ? ws.gather_rows(s, ws.act(P.lnf, Shape{P.R, C}), P.lnf_all, "tp ln_f")
                                         : ws.act(P.lnf_all, Shape{BT, C});
        dlnf = ws.column_backward(s, dlogits, lnf_all, param(p, K.head_block, 0), grad(p, K.head_block, 0), none, 0,
                               "tp d ln_f", pass);
      }
      if (weight && K.head_block != K.emb_block) p.after_backward(K.head_block);
      if (input) p.before_backward(K.lnf_block);
      const auto g = grads_of(s, ws, p, K.lnf_block, P.lnf_rep, input);
      ws.ln_back(s, pass, dlnf, ws.layer_input(K.layers), param(p, K.lnf_block, 0), g[0], g[1],
              ws.f32(P.lnf_mean, Shape{P.R}), ws.f32(P.lnf_rstd, Shape{P.R}));
      block_done(s, ws, p, K.lnf_block, P.lnf_rep, pass);
    }
    for (int l = K.layers - 1; l >= 0; --l) {
      const int b = K.layer_blocks[static_cast<size_t>(l)];
      if (input) p.before_backward(b);
      layer_backward(s, ws, p, l, b, pass);
      block_done(s, ws, p, b, P.layers[static_cast<size_t>(l)].rep, pass);
    }
    if (!K.embedding) return;  // dresidual now holds the gradient of the chunk's input rows
    // D > 1: positions from the rank's rows (summed over the group), tokens of its shard from all rows.
    if (input) p.before_backward(K.emb_block);
    if (input && P.D > 1)
      ops::position_backward(s, grads_of(s, ws, p, K.emb_block, P.emb_rep, true)[1], dresidual, ws.row0(), P.T);
    if (input) ws.gather_rows(s, dresidual, P.demb_all, "tp d embedding", true);
    if (weight) {
      const TensorView dwpe = grad(p, K.emb_block, 1);
      ops::encoder_backward(s, grad(p, K.emb_block, 0),
                            P.D > 1 ? TensorView{} : TensorView{dwpe.data, DType::kF32, Shape{P.T, C}, dwpe.device},
                            ws.act(P.demb_all, Shape{P.B, P.T, C}), batch.inputs, ops::VocabRange{tr.t * Vl, P.V});
    }
    block_done(s, ws, p, K.emb_block, P.emb_rep, pass);
  }

  // Layer l of the workspace's chunk: its forward (kForward), or the subset a backward re-runs:
  // selective re-runs the ops whose outputs it did not keep (both layernorms, GELU) from kept
  // inputs; full re-runs everything backward reads. The same call writes the same bits each time.
  void layer_forward(Stream& s, GptWorkspace& ws, ParamAccess& p, int l, int blk, BlockPass pass) const {
    auto w = [&](LayerTensor k) { return param(p, blk, slot_[k]); };
    const Plan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C, Cl = P.Cl, R = P.R;
    const bool fwd = pass == BlockPass::kForward, matmuls = pass != BlockPass::kSelective;
    const auto& A = P.layers[static_cast<size_t>(l)];
    const TensorView res_in = ws.layer_input(l);
    const TensorView ln1 = ws.act(A.ln1, Shape{R, C}), res2 = ws.act(A.residual2, Shape{R, C}), ln2 = ws.act(A.ln2, Shape{R, C});
    const TensorView fch = ws.act(A.fch, Shape{BT, 4 * Cl}), fch_gelu = ws.act(A.fch_gelu, Shape{BT, 4 * Cl});
    ops::layernorm_forward(s, ln1, ws.f32(A.ln1_mean, Shape{R}), ws.f32(A.ln1_rstd, Shape{R}), res_in, w(kLn1w), w(kLn1b),
                           kGptLayerNormEps);
    // residual2 = residual + attproj and ln2 = layernorm(residual2) in one pass (the bits of the add
    // and the layernorm); selective keeps qkv, the attention output, its lse and residual2. The
    // block's later add stays separate: the layernorm after it is the next block's, whose
    // parameters ZeRO stage 3 gathers only at that block's before_forward.
    if (matmuls) {
      ws.column_matmul(s, ws.act(A.qkv, Shape{BT, 3 * Cl}), ln1, w(kQkvw), w(kQkvb), "tp ln_1");
      ops::flash_attention_forward(s, ws.act(A.atty, Shape{P.B, P.T, Cl}), ws.f32(A.lse, Shape{P.B, P.NHl, P.T}),
                                   ws.act(A.qkv, Shape{P.B, P.T, 3 * Cl}), static_cast<int>(P.NHl));
      const TensorView attproj = ws.row_matmul(s, ws.act(A.atty, Shape{BT, Cl}), w(kAttprojw), w(kAttprojb), "tp attn.c_proj");
      ops::residual_layernorm_forward(s, res2, ln2, ws.f32(A.ln2_mean, Shape{R}), ws.f32(A.ln2_rstd, Shape{R}), res_in, attproj,
                                      w(kLn2w), w(kLn2b), kGptLayerNormEps);
    } else {
      ops::layernorm_forward(s, ln2, ws.f32(A.ln2_mean, Shape{R}), ws.f32(A.ln2_rstd, Shape{R}), res2, w(kLn2w), w(kLn2b),
                             kGptLayerNormEps);
    }
    // D = 1: c_fc and its GELU in one op (a GEMM epilogue on GPUs). A selective recompute re-runs
    // it (rewriting fch's same bits): in 16 bits it takes the GELU of the fp32 sum, not of the
    // rounded fch, and on CUDA cuBLASLt's epilogue evaluates GELU its own way in fp32 too, so the
    // GELU alone would give other bits than the forward's.
    if (P.D == 1) {
      ops::matmul_gelu_forward(s, fch_gelu, fch, ln2, w(kFcw), w(kFcb));
    } else {
      if (matmuls) ws.column_matmul(s, fch, ln2, w(kFcw), w(kFcb), "tp ln_2");
      ops::gelu_forward(s, fch_gelu, fch);
    }
    if (!fwd) return;  // backward never reads the block's output projection or its sum
    ops::add(s, ws.act(A.residual3, Shape{R, C}), res2, ws.row_matmul(s, fch_gelu, w(kFcprojw), w(kFcprojb), "tp mlp.c_proj"));
  }

  // Layer l's backward (see backprop for the passes); a tensor-parallel layer's replicated
  // gradients go to its scratch (block_done sums and adds them).
  void layer_backward(Stream& s, GptWorkspace& ws, ParamAccess& p, int l, int blk, BackPass pass) const {
    const Plan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C, Cl = P.Cl, R = P.R;
    const bool input = pass != BackPass::kWeight, weight = pass != BackPass::kInput, fused = pass == BackPass::kFused;
    const bool tp = P.D > 1;
    const TensorView none{};
    const auto& A = P.layers[static_cast<size_t>(l)];
    const TensorView res_in = ws.layer_input(l);
    auto w = [&](LayerTensor k) { return param(p, blk, slot_[k]); };
    // After before_backward: stage 3 has gathered this block again, so the recompute sees the
    // same parameters as the forward did. It writes activations only, never a gradient.
    if (input && P.recompute != Recompute::kNone) {
      OptionalNvtxRange range;
      const std::string name = "recompute h." + std::to_string(chunks_[static_cast<size_t>(ws.chunk)].first_layer + l);
      if (ranges_enabled()) range.open(NvtxCategory::kBackward, name, p.device_index());
      ws.recompute_begin(s);
      layer_forward(s, ws, p, l, blk, P.recompute == Recompute::kFull ? BlockPass::kFull : BlockPass::kSelective);
      ws.recompute_end(s);
    }
    const auto gv = grads_of(s, ws, p, blk, A.rep, input);
    auto g = [&](LayerTensor k) { return gv[static_cast<size_t>(slot_[k])]; };
    const TensorView dfch = ws.act(A.dfch, Shape{BT, 4 * Cl}), datty = ws.act(P.datty, Shape{BT, Cl});
    const TensorView dqkv = ws.act(A.dqkv, Shape{BT, 3 * Cl}), fch = ws.act(A.fch, Shape{BT, 4 * Cl});
    const TensorView fch_gelu = ws.act(A.fch_gelu, Shape{BT, 4 * Cl});
    // residual3 = residual2 + c_proj(gelu(c_fc(ln2(residual2))))
    const TensorView dres3 = ws.row_backward_out(s, A.dres3, g(kFcprojb), "tp d mlp.c_proj", input);
    // D = 1: c_proj's input gradient carried through the GELU in one op (a GEMM epilogue on GPUs),
    // which also sums c_fc's bias gradient when this pass computes weight gradients too.
    const TensorView dfch_gelu = ws.act(P.dfch_gelu, Shape{BT, 4 * Cl});
    if (input && tp) ops::fill(s, dfch_gelu, 0.0f);
    if (input && !tp) ops::matmul_backward_dgelu(s, dfch, fused ? g(kFcb) : none, dres3, w(kFcprojw), fch);
    if (weight || tp)
      ops::matmul_backward(s, input && tp ? dfch_gelu : none, weight ? g(kFcprojw) : none, weight && !tp ? g(kFcprojb) : none,
                           dres3, fch_gelu, w(kFcprojw));
    TensorView ln2_all = ws.act(A.ln2_all, Shape{BT, C});
    if (input && tp) {
      ops::fill(s, dfch, 0.0f);
      ln2_all = ws.gather_rows(s, ws.act(A.ln2, Shape{R, C}), A.ln2_all, "tp ln_2");
      ops::gelu_backward(s, dfch, fch, dfch_gelu);
    }
    const TensorView dln2 =
        ws.column_backward(s, dfch, ln2_all, w(kFcw), g(kFcw), fused && !tp ? none : g(kFcb), A.dln2, "tp d ln_2", pass);
    ws.ln_back(s, pass, dln2, ws.act(A.residual2, Shape{R, C}), w(kLn2w), g(kLn2w), g(kLn2b), ws.f32(A.ln2_mean, Shape{R}),
            ws.f32(A.ln2_rstd, Shape{R}));
    // residual2 = residual + c_proj(attention(c_attn(ln1(residual))))
    const TensorView dres2 = ws.row_backward_out(s, A.dres2, g(kAttprojb), "tp d attn.c_proj", input);
    // datty, dqkv (D = 1) and dln1 have no earlier writer in this layer: overwritten, no zero fill.
    ops::matmul_backward(s, input ? datty : none, weight ? g(kAttprojw) : none, weight && P.D == 1 ? g(kAttprojb) : none,
                         dres2, ws.act(A.atty, Shape{BT, Cl}), w(kAttprojw), /*overwrite_din=*/true);
    TensorView ln1_all = ws.act(A.ln1_all, Shape{BT, C});
    if (input) {
      if (P.D > 1) ln1_all = ws.gather_rows(s, ws.act(A.ln1, Shape{R, C}), A.ln1_all, "tp ln_1"), ops::fill(s, dqkv, 0.0f);
      ops::flash_attention_backward(s, ws.act(A.dqkv, Shape{P.B, P.T, 3 * Cl}), ws.act(P.datty, Shape{P.B, P.T, Cl}),
                                    ws.act(A.qkv, Shape{P.B, P.T, 3 * Cl}), ws.act(A.atty, Shape{P.B, P.T, Cl}),
                                    ws.f32(A.lse, Shape{P.B, P.NHl, P.T}), static_cast<int>(P.NHl),
                                    ws.f32(P.attn_scratch, Shape{P.attn_scratch_numel}),
                                    P.D == 1 ? ops::GradWrite::kOverwrite : ops::GradWrite::kAccumulate);
    }
    const TensorView dln1 = ws.column_backward(s, dqkv, ln1_all, w(kQkvw), g(kQkvw), g(kQkvb), A.dln1, "tp d ln_1", pass);
    ws.ln_back(s, pass, dln1, res_in, w(kLn1w), g(kLn1w), g(kLn1b), ws.f32(A.ln1_mean, Shape{R}), ws.f32(A.ln1_rstd, Shape{R}));
  }

  // Gradient views of block `block`'s tensors: the parameter gradients, except a tensor-parallel
  // block's replicated tensors, which point into the scratch at `rep` (zeroed by input passes).
  std::vector<TensorView> grads_of(Stream& s, GptWorkspace& ws, ParamAccess& p, int block, int64_t rep, bool input) const {
    const ParamBlock& pb = layout_.block(block);
    const int64_t from = ws.plan.D == 1 ? pb.numel : map_.replicated_from(block);
    if (from < pb.numel && input) ops::fill(s, ws.f32(rep, Shape{round_up(pb.numel - from, ws.plan.D)}), 0.0f);
    std::vector<TensorView> g;
    for (size_t i = 0; i < pb.tensors.size(); ++i) {
      const ParamTensor& t = pb.tensors[i];
      g.push_back(t.offset >= from ? ws.f32(rep + (t.offset - from) * 4, t.shape) : grad(p, block, static_cast<int>(i)));
    }
    return g;
  }
  // A block's backward is over: its replicated gradients summed over the group (input passes; without
  // sequence parallelism every rank computed them from all rows) and added (weight passes).
  void block_done(Stream& s, GptWorkspace& ws, ParamAccess& p, int block, int64_t rep, BackPass pass) const {
    const int64_t from = map_.replicated_from(block), n = layout_.block(block).numel - from;
    if (pass != BackPass::kWeight && ws.plan.sp)
      ws.rank.run(s, TpRank::Op::kAllReduce, ws.f32(rep, Shape{round_up(n, ws.plan.D)}), "tp replicated grads");
    if (pass == BackPass::kInput) return;
    if (ws.plan.D > 1)
      ops::accumulate(s, TensorView{p.grads(block) + from, DType::kF32, Shape{n}, p.device_index()}, ws.f32(rep, Shape{n}));
    p.after_backward(block);
  }

  ModelConfig config_;
  Recompute recompute_;
  TensorParallel tp_;
  DType activations_ = DType::kF32;
  bool split_ = false;
  ParamLayout whole_;   // gpt_layout: the logical blocks (the real vocabulary)
  ParamLayout layout_;  // the local blocks
  TensorMap map_;
  std::vector<GptChunk> chunks_;
  int slot_[12] = {};  // the local index of each logical layer tensor
  int64_t rep_max_ = 0, rep_layer_ = 0;
};

}  // namespace

std::unique_ptr<Model> make_gpt(const ModelConfig& c, Recompute r, const TensorParallel& tp, DType activations) {
  return std::make_unique<Gpt>(c, r, tp, activations, nullptr);
}

std::unique_ptr<Model> make_gpt_stage(const ModelConfig& config, const PipelineStageSpec& stage, Recompute recompute,
                                      const TensorParallel& tp, DType activations) {
  ZT_REQUIRE(config.kind == ModelKind::kGpt, "pipeline parallelism splits GPT models only, not the MLP");
  ZT_REQUIRE(!stage.chunks.empty(), "a pipeline stage runs at least one chunk");
  // backward_weight reads the layer inputs a recompute would have overwritten by then.
  ZT_REQUIRE(!(stage.split_backward && recompute != Recompute::kNone), "--recompute ", recompute_name(recompute),
             " is not supported with a split backward (zb-h1) yet; use --recompute none or another schedule");
  return std::make_unique<Gpt>(config, recompute, tp, activations, &stage);
}

}  // namespace zt
