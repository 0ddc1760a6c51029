// GPT-2 split over a tensor group (Megatron-LM's layout, Shoeybi et al. 2019): column-parallel
// QKV and MLP up-projection, row-parallel attention output and MLP down-projection, heads split
// across the group, vocabulary-parallel embedding and cross-entropy (no rank ever holds the full
// logits), and, by default, sequence parallelism (Korthikanti et al. 2022) for everything between.
//
// Local blocks mirror GPT-2's (model/tensor_split.h for the splits): 0 = wte's vocabulary shard
// (also the LM head) and wpe, 1..L = each layer's split matrices and biases followed by its
// replicated tensors (layernorms, row-parallel biases), L+1 = ln_f. Keeping each block's
// replicated tensors last gives one contiguous region whose gradients are summed over the tensor
// group in one collective and whose norm the engine reports apart (counted once per group).
//
// With sequence parallelism a rank's residual stream is rows [t R, (t+1) R) of the flattened
// [B*T, C] activations (R = B*T / degree): layernorm, residual adds and the row-parallel biases run
// on those rows, an all-gather of the layernorm output enters each column-parallel matmul (and is
// redone in backward instead of keeping the gathered copy), and a reduce-scatter of the partial
// sums leaves each row-parallel one. Without it, every rank holds all rows and all-reduces instead.
// Replicated tensors' gradients come from the rank's rows only and are all-reduced over the group.
//
// Overlap, where the dependencies allow it, with sequence parallelism:
//  - forward, each column-parallel matmul (QKV, MLP up, LM head): the rank multiplies its own rows
//    while the all-gather brings the other ranks' rows, then multiplies those (collective matmul
//    in one step: 1/T of the GEMM hides the gather);
//  - backward, each column-parallel layer (and the LM head): the re-gather of its input starts
//    right after the previous matmul has read the shared buffer, and runs under the ops before the
//    weight gradient needs it (GELU's or attention's backward, and the input gradient's GEMM,
//    which does not read it); the input gradient's reduce-scatter (all-reduce without sequence
//    parallelism) then runs under the weight gradient's GEMM.
// A started collective is waited for through an event recorded right after it on the rank's comm
// stream (nothing else can enqueue there while the rank's thread is in the call). The row-parallel
// outputs' reduce-scatters sit between dependent ops and are waited for at once.
//
// Pipeline stages (make_gpt_stage with tp.degree > 1) run chunks of layers as the one-device stage
// does (model/gpt.cc): a stage's local blocks are the whole model's local blocks it needs, in the
// one-device stage's order (the last stage's tied LM head a copy of block 0), and the rank's
// residual rows cross stages. The split backward (zb-h1) keeps every collective in backward_input:
// it gathers and keeps all rows of each weight gradient's inputs and sums the replicated gradients
// over the group into per-layer slots, so backward_weight only multiplies and adds on the rank.
// Replicated gradients always go through such a scratch, summed before they are added, so the
// split and the fused backward add the same bits.
#include <algorithm>
#include <string>
#include <utility>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "model/gpt_chunks.h"
#include "model/model.h"

namespace zt {

namespace {

constexpr float kLayerNormEps = 1e-5f;

// Logical tensor indices of a GPT-2 layer block (gpt_layout).
enum LayerTensor { kLn1w, kLn1b, kQkvw, kQkvb, kAttprojw, kAttprojb, kLn2w, kLn2b, kFcw, kFcb, kFcprojw, kFcprojb };
// A local layer block: the split qkvw, qkvb, attprojw, fcw, fcb, fcprojw (indices 0-5), then the
// replicated ln1w, ln1b, attprojb, ln2w, ln2b, fcprojb (indices 6-11).
constexpr LayerTensor kRepTensors[] = {kLn1w, kLn1b, kAttprojb, kLn2w, kLn2b, kFcprojb};

// The vocabulary a tensor-parallel GPT splits: padded to a multiple of 64 x degree (Megatron pads
// to 128 x degree), so every rank holds a whole number of 64-row tiles (GPT-2's 50257 is prime
// to every degree: 50304 rows at degree 2). Padding rows are zero, never looked up, left out of
// the softmax, and receive no gradient; checkpoints keep the real rows only.
int64_t padded_vocab(int64_t V, int degree) {
  const int64_t q = int64_t{64} * degree;
  return (V + q - 1) / q * q;
}

// One chunk's activations (the whole model is one chunk with the embedding and the head; a
// pipeline stage's chunk plans only its own layers, and the final layernorm, logits, losses and
// the loss statistics only with the head). `encoded` is the chunk's input rows: the embedding's
// output, or the activation received from the previous chunk.
//
// Offsets are in bytes. Activations, their gradients, the logits and every buffer a collective
// moves between them (the row-parallel partial sums, gathered rows) take `act_bytes` each element
// (4: fp32, 2: bf16/f16); layernorm statistics, lse, the cross-entropy statistics, losses, the
// replicated gradients' sums and the attention scratch are fp32.
struct TpPlan {
  int64_t B, T, C, NH, L, V, Vp, D;  // V real, Vp padded vocabulary; D = tensor degree; L = the chunk's layers
  bool sp, head, split;
  int64_t R;  // rows a rank's residual stream holds
  int64_t act_bytes = 4;
  int64_t total = 0;
  int64_t encoded, lnf = 0, lnf_mean = 0, lnf_rstd = 0, logits = 0, losses = 0;
  // attn_scratch: flash_attention_backward's scratch, shared by every layer.
  int64_t full, full2, dresidual, dfch, dfch_gelu, datty, dqkv, attn_scratch, attn_scratch_numel;
  int64_t stat_max = 0, gmax = 0, stat_part = 0, gsum = 0, rep, row = 0;
  int64_t row_wide = 0;  // 16-bit: the gathered logits row widened to fp32 (read_logits_row), [V]
  int64_t rep_numel;  // padded to a multiple of D
  // Where backward reads all B*T rows of the LM head's input and of the embedding's output gradient,
  // and where it sums ln_f's and the embeddings' replicated gradients: the shared scratch (`full`,
  // `rep`; without sequence parallelism the rank's own rows, which are all rows), or, with a split
  // backward, slots backward_input fills and backward_weight reads.
  int64_t lnf_all = 0, demb_all = 0, lnf_rep = 0, emb_rep = 0;
  // lse: the attention's log-sum-exp per (batch, local head, query), [B, NH/D, T]; with qkv and atty
  // all the tiled attention's backward reads (no T x T matrix is kept).
  struct Layer {
    int64_t ln1, ln1_mean, ln1_rstd, qkv, atty, lse, residual2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu, residual3;
    // What a layer's weight gradients read (all rows of both layernorm outputs and of the residual
    // gradient entering each row-parallel matmul, the column-parallel matmuls' output gradients)
    // and its replicated gradients' sum: the shared scratch, or per-layer slots (split backward).
    int64_t ln1_all, ln2_all, dres3_all, dres2_all, dfch, dqkv, rep;
  };
  std::vector<Layer> layers;

  int64_t add_bytes(int64_t bytes) {
    const int64_t off = total;
    total += (bytes + 255) / 256 * 256;  // 256-byte alignment for every buffer
    return off;
  }
  int64_t act(int64_t n) { return add_bytes(n * act_bytes); }  // n elements of the activation dtype
  int64_t f32(int64_t n) { return add_bytes(n * 4); }          // n fp32 elements

  // rep_max: the largest replicated tail of any local block; rep_layer: of a layer block.
  TpPlan(const ModelConfig& c, int64_t B_, int64_t T_, int degree, bool sequence, int64_t rep_max, int64_t rep_layer,
         int64_t layer_count, bool head_, bool embedding, bool split_, DType activations)
      : B(B_), T(T_), C(c.embd), NH(c.heads), L(layer_count), V(c.vocab), Vp(padded_vocab(c.vocab, degree)),
        D(degree), sp(sequence), head(head_), split(split_),
        act_bytes(static_cast<int64_t>(dtype_size(activations))) {
    const int64_t BT = B * T, Cl = C / D, NHl = NH / D;
    R = sp ? BT / D : BT;
    rep_numel = (rep_max + D - 1) / D * D;
    encoded = act(R * C);
    layers.resize(static_cast<size_t>(L));
    for (auto& l : layers) {
      l.ln1 = act(R * C), l.ln1_mean = f32(R), l.ln1_rstd = f32(R), l.qkv = act(BT * 3 * Cl), l.atty = act(BT * Cl);
      l.lse = f32(B * NHl * T), l.residual2 = act(R * C), l.ln2 = act(R * C), l.ln2_mean = f32(R), l.ln2_rstd = f32(R);
      l.fch = act(BT * 4 * Cl), l.fch_gelu = act(BT * 4 * Cl), l.residual3 = act(R * C);
    }
    if (head) lnf = act(R * C), lnf_mean = f32(R), lnf_rstd = f32(R), logits = act(BT * (Vp / D)), losses = f32(BT);
    full = act(BT * C), full2 = act(BT * C), dresidual = act(R * C);
    dfch = act(BT * 4 * Cl), dfch_gelu = act(BT * 4 * Cl), datty = act(BT * Cl), dqkv = act(BT * 3 * Cl);
    attn_scratch_numel = static_cast<int64_t>((ops::flash_attention_scratch_bytes(B, T, Cl, NHl) + 3) / 4);
    attn_scratch = f32(attn_scratch_numel);
    if (head) stat_max = f32(D * BT), gmax = f32(BT), stat_part = f32(D * 2 * BT), gsum = f32(2 * BT);
    rep = f32(rep_numel);
    if (head) row = act(Vp);
    if (head && act_bytes != 4) row_wide = f32(V);
    // A layernorm output's rows are all rows without sequence parallelism; a residual gradient
    // changes after its matmul, so a split backward keeps a copy.
    auto all_rows = [&](int64_t own) { return !sp ? own : split ? act(BT * C) : full; };
    const int64_t dres_all = sp ? full : dresidual;
    for (auto& l : layers) {
      l.ln1_all = all_rows(l.ln1), l.ln2_all = all_rows(l.ln2);
      l.dres3_all = split ? act(BT * C) : dres_all, l.dres2_all = split ? act(BT * C) : dres_all;
      l.dfch = split ? act(BT * 4 * Cl) : dfch, l.dqkv = split ? act(BT * 3 * Cl) : dqkv;
      l.rep = split ? f32((rep_layer + D - 1) / D * D) : rep;
    }
    if (head) lnf_all = all_rows(lnf), lnf_rep = split ? f32(rep_numel) : rep;
    if (embedding) demb_all = split ? act(BT * C) : dres_all, emb_rep = split ? f32(rep_numel) : rep;
  }
};

// One rank's view of its tensor group (found once, when its workspace is made).
struct TpRank {
  Communicator* comm;
  CommGroup group;
  int rank;  // communicator rank
  int t;     // coordinate on the tensor axis = position in the group

  // Per-rank collectives on the comm stream, after everything `s` issued; `s` waits for them.
  enum class Op { kAllGather, kReduceScatter, kAllReduce };
  void all_gather(Stream& s, TensorView full, const char* tag) const { run(s, Op::kAllGather, full, tag, nullptr); }
  void reduce_scatter(Stream& s, TensorView full, const char* tag) const { run(s, Op::kReduceScatter, full, tag, nullptr); }
  void all_reduce(Stream& s, TensorView full, const char* tag) const { run(s, Op::kAllReduce, full, tag, nullptr); }
  // The same collectives, started after everything `s` issued but not waited for: `done` is
  // recorded on the comm stream right after, for s.wait(done) when the result is needed.
  void start(Stream& s, Op op, TensorView full, const char* tag, Event& done) const { run(s, op, full, tag, &done); }

 private:
  void run(Stream& s, Op op, TensorView full, const char* tag, Event* done) const {
    OptionalNvtxRange range;  // the tensor-collectives track of --trace
    if (ranges_enabled()) range.open(NvtxCategory::kTensorParallel, tag, comm->device(rank).index());
    if (op == Op::kAllGather) group.all_gather(rank, full, &s, tag);
    if (op == Op::kReduceScatter) group.reduce_scatter(rank, full, &s, tag);
    if (op == Op::kAllReduce) group.all_reduce(rank, full, &s, tag);
    if (done) {
      comm->device(rank).comm().record(*done);
    } else {
      comm->wait_done(rank, s);
    }
  }
};

class GptTp;

class TpWorkspace final : public Workspace {
 public:
  TpWorkspace(const GptTp& model, TpPlan plan_, Device& d, int chunk_, bool embedding_)
      : plan(std::move(plan_)), model(model), chunk(chunk_), embedding(embedding_), device(d.index()),
        buf(d.memory(), static_cast<size_t>(plan.total), d.compute(), "activations"),
        gathered(d.create_event()), reduced(d.create_event()) {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return static_cast<int>(plan.T); }
  TensorView losses() override { return plan.head ? f32(plan.losses, Shape{plan.B * plan.T}) : TensorView{}; }
  // The rank's shard of the padded vocabulary's logits: [B*T, Vp / degree], in the activation dtype.
  TensorView logits() override {
    return plan.head ? view(plan.logits, Shape{plan.B * plan.T, plan.Vp / plan.D}) : TensorView{};
  }
  size_t bytes() const override { return buf.size(); }
  void read_logits_row(Stream& s, int row, float* out) override;
  // What crosses pipeline stages is the rank's residual stream (model.h): its rows [B*T/D, C] with
  // sequence parallelism, all of them [B, T, C] (equal on every rank of the group) without.
  TensorView stage_input() override { return embedding ? TensorView{} : residual_view(plan.encoded); }
  TensorView stage_output() override {
    return plan.head || plan.L == 0 ? TensorView{} : residual_view(plan.layers.back().residual3);
  }
  TensorView stage_gradient() override { return plan.head && embedding ? TensorView{} : residual_view(plan.dresidual); }

  // An activation (the workspace's activation dtype) or an fp32 tensor at byte offset `off`.
  TensorView view(int64_t off, Shape s) { return TensorView{buf.as<char>() + off, dtype, s, device}; }
  TensorView f32(int64_t off, Shape s) { return TensorView{buf.as<char>() + off, DType::kF32, s, device}; }
  TensorView residual_view(int64_t off) {
    return plan.sp ? view(off, Shape{plan.R, plan.C}) : view(off, Shape{plan.B, plan.T, plan.C});
  }

  TpPlan plan;
  const GptTp& model;
  int chunk;
  bool embedding;
  // The activations' dtype: f32, or for a 16-bit model the 16-bit type of the parameters of the
  // last forward (GptTp::compute_dtype; bf16 and f16 take the same bytes).
  DType dtype = DType::kF32;
  int device;
  DeviceBuffer buf;
  // Recorded on the comm stream right after a collective the compute stream waits for later.
  std::unique_ptr<Event> gathered, reduced;
  TpRank rank{};  // the device's rank in the model's communicator and its tensor group
};

TensorView rows_of(TensorView v, int64_t first_row, int64_t rows) {
  const int64_t width = v.shape.numel() / v.shape[0];
  return TensorView{static_cast<char*>(v.data) + first_row * width * static_cast<int64_t>(dtype_size(v.dtype)),
                    v.dtype, Shape{rows, width}, v.device};
}

class GptTp final : public Model {
 public:
  // The whole model (spec null: one chunk, local blocks mirror the logical blocks), or a pipeline
  // stage (make_gpt_stage): its layout holds the rank's shards of the logical blocks it runs, in
  // the one-device stage's order.
  GptTp(const ModelConfig& c, const TensorParallel& tp, DType activations, const PipelineStageSpec* spec = nullptr)
      : config_(c), tp_(tp), activations_(activations), split_(spec && spec->split_backward), logical_(gpt_layout(c)) {
    ZT_CHECK(activations == DType::kF32 || activations == DType::kBF16 || activations == DType::kF16,
             "GPT activations in ", dtype_name(activations));
    const int D = tp.degree;
    auto refuse = [&](const char* what, int value) {
      int best = 1;
      for (int k = 1; k <= value && k <= D; ++k)
        if (value % k == 0) best = k;
      ZT_THROW(ErrorKind::kInvalidArgument, "--tensor-parallel ", D, " does not divide the model's ", what, " (",
               value, "); the nearest valid degree is ", best);
    };
    if (c.heads % D != 0) refuse("heads", c.heads);
    if (c.embd % D != 0) refuse("width", c.embd);
    if ((4 * c.embd) % D != 0) refuse("MLP width", 4 * c.embd);

    map_.degree = D;
    map_.logical = &logical_;
    map_.local = &layout_;
    if (!spec) {
      GptChunk k;
      k.layers = c.layers, k.embedding = k.head = true;
      k.emb_block = k.head_block = take(0);
      for (int l = 0; l < c.layers; ++l) k.layer_blocks.push_back(take(l + 1));
      k.lnf_block = take(c.layers + 1);
      chunks_.push_back(k);
    } else {
      chunks_ = gpt_stage_chunks(c, *spec, [this](int lb) { return take(lb); });
    }
    for (int b = 0; b < layout_.num_blocks(); ++b) {
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
  // The logical block a local block holds the rank's shard of (every tensor of a local block comes
  // from one logical block).
  int logical_block(int block) const override {
    return map_.places.at(static_cast<size_t>(block)).at(0).block;
  }

  size_t workspace_bytes(int B, int T) const override {
    size_t total = 0;
    for (int c = 0; c < chunks(); ++c) total += chunk_workspace_bytes(B, T, c);
    return total;
  }
  size_t chunk_workspace_bytes(int B, int T, int chunk) const override {
    return static_cast<size_t>(plan(B, T, chunk).total);
  }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int T) const override {
    ZT_CHECK(chunks_.size() == 1, "make_workspace on a ", chunks_.size(), "-chunk stage (use make_chunk_workspace)");
    return make_chunk_workspace(d, B, T, 0);
  }
  std::unique_ptr<Workspace> make_chunk_workspace(Device& d, int B, int T, int chunk) const override {
    ZT_REQUIRE(T >= 1 && T <= config_.seq_len, "sequence length ", T, " is above the model's context of ",
               config_.seq_len, " tokens");
    ZT_REQUIRE(!tp_.sequence || (int64_t{B} * T) % tp_.degree == 0, "sequence parallelism over ", tp_.degree,
               " ranks needs the micro-batch's tokens (", B, " x ", T, " = ", int64_t{B} * T,
               ") to be a multiple of ", tp_.degree, "; change --micro-batch-size or --seq-len, or pass --no-sequence-parallel");
    ZT_CHECK(chunk >= 0 && chunk < chunks(), "chunk ", chunk, " of a ", chunks(), "-chunk model");
    auto ws = std::make_unique<TpWorkspace>(*this, plan(B, T, chunk), d, chunk,
                                            chunks_[static_cast<size_t>(chunk)].embedding);
    ws->dtype = activations_;
    ws->rank = rank_of(d.index());
    return ws;
  }

  std::vector<int> forward_order() const override { return chunks_forward_order(chunks_); }
  std::vector<int> backward_order() const override { return chunks_backward_order(chunks_); }

  TpRank rank_of(int device) const {
    ZT_CHECK(tp_.comm && tp_.mesh, "a tensor-parallel model built for planning cannot run");
    for (int r = 0; r < tp_.comm->world(); ++r)
      if (tp_.comm->device(r).index() == device) {
        return TpRank{tp_.comm, tp_.comm->group(tp_.mesh->tensor_group(r)), r, tp_.mesh->index(MeshAxis::kTensor, r)};
      }
    ZT_CHECK(false, "device ", device, " is not in the tensor-parallel model's communicator");
    return {};
  }

  void forward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch, float dloss, bool train) const override {
    auto& ws = static_cast<TpWorkspace&>(wsb);
    const TpPlan& P = ws.plan;
    const GptChunk& K = chunks_[static_cast<size_t>(ws.chunk)];
    ZT_CHECK(batch.B == P.B && batch.T == P.T, "batch ", batch.B, "x", batch.T, " on a workspace for ", P.B, "x", P.T);
    ws.dtype = compute_dtype(p);
    const TpRank& tr = ws.rank;
    const int64_t BT = P.B * P.T, C = P.C, Vl = P.Vp / P.D;
    const int L = static_cast<int>(P.L);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto f32 = [&](int64_t off, Shape sh) { return ws.f32(off, sh); };
    TensorView full = act(P.full, Shape{BT, C});

    // Embedding: each rank looks up the tokens of its vocabulary shard (zeros elsewhere); the sum
    // over the group is the embedding. Positions are added on the rank's rows. Without it the
    // chunk's input rows were received into `encoded`.
    TensorView residual = act(P.encoded, Shape{P.R, C});
    if (K.embedding) {
      p.before_forward(K.emb_block);
      const TensorView wte = param(p, K.emb_block, 0);
      const TensorView wpe = param(p, K.emb_block, 1);
      ops::encoder_forward(s, act(P.full, Shape{P.B, P.T, C}), batch.inputs, wte, ConstTensorView{},
                           ops::VocabRange{tr.t * Vl, P.V});
      s.copy(residual.data, leave(s, tr, ws, full, "tp embedding").data, static_cast<size_t>(P.R * C * P.act_bytes));
      ops::position_forward(s, residual, wpe, row0(P, tr), P.T);
    }

    for (int l = 0; l < L; ++l) {
      const int b = K.layer_blocks[static_cast<size_t>(l)];
      p.before_forward(b);
      layer_forward(s, tr, ws, p, l, b, residual);
      residual = act(P.layers[static_cast<size_t>(l)].residual3, Shape{P.R, C});
    }
    if (!K.head) return;  // the pipeline sends stage_output() (the last residual rows) on

    p.before_forward(K.lnf_block);
    TensorView lnf = act(P.lnf, Shape{P.R, C});
    ops::layernorm_forward(s, lnf, f32(P.lnf_mean, Shape{P.R}), f32(P.lnf_rstd, Shape{P.R}), residual,
                           param(p, K.lnf_block, 0), param(p, K.lnf_block, 1), kLayerNormEps);
    p.before_forward(K.head_block);  // the LM head reads wte again (stage 3 gathers it again)
    TensorView logits = act(P.logits, Shape{BT, Vl});
    column_matmul(s, tr, ws, logits, lnf, param(p, K.head_block, 0), ConstTensorView{}, "tp ln_f");

    // Vocabulary-parallel cross-entropy: the row maxima, then the sums of exponentials and the
    // target logits, each combined over the group in a fixed order.
    const ConstTensorView targets{batch.targets.data, DType::kI32, Shape{BT}, batch.targets.device};
    TensorView stat_max = f32(P.stat_max, Shape{P.D, BT});
    ops::row_max(s, f32(P.stat_max + tr.t * BT * 4, Shape{BT}), logits, ops::VocabRange{tr.t * Vl, P.V});
    tr.all_gather(s, f32(P.stat_max, Shape{P.D * BT}), "tp logits max");
    TensorView gmax = f32(P.gmax, Shape{BT});
    ops::reduce_slices(s, gmax, stat_max, ops::SliceReduce::kMax);
    const ops::VocabRange vocab{tr.t * Vl, P.V};
    ops::vocab_partials(s, f32(P.stat_part + tr.t * 2 * BT * 4, Shape{2, BT}), logits, gmax, targets, vocab);
    tr.all_gather(s, f32(P.stat_part, Shape{P.D * 2 * BT}), "tp logits sums");
    ops::reduce_slices(s, f32(P.gsum, Shape{2 * BT}), f32(P.stat_part, Shape{P.D, 2 * BT}), ops::SliceReduce::kSum);
    ops::vocab_loss_grad(s, logits, f32(P.losses, Shape{BT}), gmax, f32(P.gsum, Shape{BT}), f32(P.gsum + BT * 4, Shape{BT}),
                         targets, vocab, dloss, train, batch.loss_scale);
  }

  void backward(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const override {
    backward_pass(s, p, static_cast<TpWorkspace&>(ws), batch, BackPass::kFused);
  }
  void backward_input(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const override {
    ZT_CHECK(split_, "backward_input on a model made without split_backward");
    backward_pass(s, p, static_cast<TpWorkspace&>(ws), batch, BackPass::kInput);
  }
  void backward_weight(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const override {
    ZT_CHECK(split_, "backward_weight on a model made without split_backward");
    backward_pass(s, p, static_cast<TpWorkspace&>(ws), batch, BackPass::kWeight);
  }

  void read_logits_row(TpWorkspace& ws, Stream& s, int row, float* out) const {
    const TpPlan& P = ws.plan;
    ZT_CHECK(P.head, "logits of a pipeline chunk without the LM head");
    const TpRank& tr = ws.rank;
    const int64_t Vl = P.Vp / P.D, bytes = P.act_bytes;
    char* base = ws.buf.as<char>();
    s.copy(base + P.row + tr.t * Vl * bytes, base + P.logits + static_cast<int64_t>(row) * Vl * bytes,
           static_cast<size_t>(Vl * bytes));
    tr.all_gather(s, ws.view(P.row, Shape{P.Vp}), "tp logits row");
    if (ws.dtype == DType::kF32) {
      s.copy(out, base + P.row, static_cast<size_t>(P.V) * sizeof(float));
      return;
    }
    // 16-bit logits: widened (exactly) on the device first, as the one-device GPT does.
    ops::cast(s, ws.f32(P.row_wide, Shape{P.V}), ws.view(P.row, Shape{P.V}));
    s.copy(out, base + P.row_wide, static_cast<size_t>(P.V) * sizeof(float));
  }

 private:
  // A local block holding the rank's shard of logical block `lb` (the embeddings, a layer, ln_f),
  // replicated tensors last.
  int take(int lb) {
    const int64_t C = config_.embd, V = config_.vocab;
    const int D = tp_.degree;
    const int block = layout_.add_block(logical_.block(lb).name);
    map_.places.resize(static_cast<size_t>(layout_.num_blocks()));
    auto add = [&](int li, Shape shape, TensorSplit split) {
      const ParamTensor& g = logical_.block(lb).tensors[static_cast<size_t>(li)];
      layout_.add_tensor(block, g.name, shape, g.init, g.init_std, g.weight_decay);
      map_.places[static_cast<size_t>(block)].push_back({lb, li, split});
    };
    if (lb == 0) {
      add(0, Shape{padded_vocab(V, D) / D, C}, TensorSplit::kRows);
      add(1, Shape{config_.seq_len, C}, TensorSplit::kReplicated);
    } else if (lb <= config_.layers) {
      add(kQkvw, Shape{3 * C / D, C}, TensorSplit::kQkvRows);
      add(kQkvb, Shape{3 * C / D}, TensorSplit::kQkvRows);
      add(kAttprojw, Shape{C, C / D}, TensorSplit::kCols);
      add(kFcw, Shape{4 * C / D, C}, TensorSplit::kRows);
      add(kFcb, Shape{4 * C / D}, TensorSplit::kRows);
      add(kFcprojw, Shape{C, 4 * C / D}, TensorSplit::kCols);
      for (LayerTensor k : kRepTensors) add(k, Shape{C}, TensorSplit::kReplicated);
    } else {
      add(0, Shape{C}, TensorSplit::kReplicated);
      add(1, Shape{C}, TensorSplit::kReplicated);
    }
    return block;
  }

  TpPlan plan(int B, int T, int chunk) const {
    ZT_CHECK(chunk >= 0 && chunk < chunks(), "chunk ", chunk, " of a ", chunks(), "-chunk model");
    const GptChunk& k = chunks_[static_cast<size_t>(chunk)];
    return TpPlan(config_, B, T, tp_.degree, tp_.sequence, rep_max_, rep_layer_, k.layers, k.head, k.embedding, split_,
                  activations_);
  }

  // One chunk's backward. kFused is backward(); kInput runs every collective and the chain of input
  // gradients through the chunk, and keeps what the weight gradients read (all rows of their
  // inputs and output gradients, the replicated gradients already summed over the group); kWeight
  // only multiplies and adds on the rank (every parameter gradient), so the collectives of a
  // tensor group come in the same order on every rank whatever the schedule puts between them.
  // kInput writes no parameter gradient (a sharding engine reduces a block's gradient once, after
  // its kWeight). Hooks: kFused and kInput call before_backward, kFused and kWeight after_backward.
  void backward_pass(Stream& s, ParamAccess& p, TpWorkspace& ws, const Batch& batch, BackPass pass) const {
    const TpPlan& P = ws.plan;
    const GptChunk& K = chunks_[static_cast<size_t>(ws.chunk)];
    const TpRank& tr = ws.rank;
    const int64_t BT = P.B * P.T, C = P.C, Vl = P.Vp / P.D;
    const int L = static_cast<int>(P.L);
    const bool input = pass != BackPass::kWeight, weight = pass != BackPass::kInput;
    ZT_CHECK(ws.dtype == compute_dtype(p), "backward in ", dtype_name(compute_dtype(p)), " after a forward in ",
             dtype_name(ws.dtype));
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto f32 = [&](int64_t off, Shape sh) { return ws.f32(off, sh); };
    // Without a head the gradient of the chunk's output rows was received into dresidual.
    TensorView dresidual = act(P.dresidual, Shape{P.R, C});

    if (K.head) {
      // LM head: logits = lnf @ wte_shard^T; dlnf is a partial sum over the vocabulary shards.
      if (input) {
        ops::fill(s, dresidual, 0.0f);
        p.before_backward(K.head_block);
      }
      const TensorView lnf_all = input ? start_all_rows(s, tr, ws, act(P.lnf, Shape{P.R, C}), P.lnf_all, "tp ln_f")
                                       : act(P.lnf_all, Shape{BT, C});
      const TensorView dlnf = column_backward(s, tr, ws, act(P.logits, Shape{BT, Vl}), lnf_all, param(p, K.head_block, 0),
                                              grad(p, K.head_block, 0), TensorView{}, "tp d ln_f", pass);
      if (weight && K.head_block != K.emb_block) p.after_backward(K.head_block);
      if (input) {
        p.before_backward(K.lnf_block);
        const RepGrads rg = rep_grads(s, ws, p, K.lnf_block, P.lnf_rep);
        const TensorView last_res = L > 0 ? act(P.layers[static_cast<size_t>(L - 1)].residual3, Shape{P.R, C})
                                          : act(P.encoded, Shape{P.R, C});
        ops::layernorm_backward(s, dresidual, rg.at(0), rg.at(1), dlnf, last_res, param(p, K.lnf_block, 0),
                                f32(P.lnf_mean, Shape{P.R}), f32(P.lnf_rstd, Shape{P.R}));
        reduce_rep(s, tr, ws, K.lnf_block, P.lnf_rep);
      }
      if (weight) {
        add_rep(s, ws, p, K.lnf_block, P.lnf_rep);
        p.after_backward(K.lnf_block);
      }
    }

    for (int l = L - 1; l >= 0; --l) {
      const int b = K.layer_blocks[static_cast<size_t>(l)];
      const int64_t rep = P.layers[static_cast<size_t>(l)].rep;
      if (input) p.before_backward(b);
      layer_backward(s, tr, ws, p, l, b, dresidual, pass);
      if (input) reduce_rep(s, tr, ws, b, rep);
      if (weight) {
        add_rep(s, ws, p, b, rep);
        p.after_backward(b);
      }
    }

    if (!K.embedding) return;  // dresidual now holds the gradient of the chunk's input rows
    // Encoder: positions from the rank's rows (summed over the group), tokens of its shard from
    // all rows.
    if (input) {
      p.before_backward(K.emb_block);
      const RepGrads pg = rep_grads(s, ws, p, K.emb_block, P.emb_rep);
      ops::position_backward(s, pg.at(1), dresidual, row0(P, tr), P.T);
      reduce_rep(s, tr, ws, K.emb_block, P.emb_rep);
      all_rows(s, tr, ws, dresidual, P.demb_all, "tp d embedding");
    }
    if (weight) {
      add_rep(s, ws, p, K.emb_block, P.emb_rep);
      ops::encoder_backward(s, grad(p, K.emb_block, 0), TensorView{}, act(P.demb_all, Shape{P.B, P.T, C}), batch.inputs,
                            ops::VocabRange{tr.t * Vl, P.V});
      p.after_backward(K.emb_block);
    }
  }

  // Views of block b's replicated gradients for this micro-batch (indexed as the block's tensors;
  // split tensors' entries are empty): a zeroed scratch at `rep`, summed over the group by
  // reduce_rep (with sequence parallelism each rank's rows give a partial sum) and added to the
  // gradients by add_rep.
  struct RepGrads {
    std::vector<TensorView> views;
    TensorView at(size_t i) const { return views.at(i); }
  };
  RepGrads rep_grads(Stream& s, TpWorkspace& ws, ParamAccess&, int block, int64_t rep) const {
    RepGrads g;
    const ParamBlock& pb = layout_.block(block);
    const int64_t from = map_.replicated_from(block);
    ops::fill(s, ws.f32(rep, Shape{padded(pb.numel - from, ws.plan.D)}), 0.0f);
    for (const ParamTensor& t : pb.tensors)
      g.views.push_back(t.offset >= from ? ws.f32(rep + (t.offset - from) * 4, t.shape) : TensorView{});
    return g;
  }
  void reduce_rep(Stream& s, const TpRank& tr, TpWorkspace& ws, int block, int64_t rep) const {
    if (!ws.plan.sp) return;  // every rank computed them from all rows
    const int64_t n = layout_.block(block).numel - map_.replicated_from(block);
    tr.all_reduce(s, ws.f32(rep, Shape{padded(n, ws.plan.D)}), "tp replicated grads");
  }
  void add_rep(Stream& s, TpWorkspace& ws, ParamAccess& p, int block, int64_t rep) const {
    const int64_t from = map_.replicated_from(block), n = layout_.block(block).numel - from;
    ops::accumulate(s, TensorView{p.grads(block) + from, DType::kF32, Shape{n}, p.device_index()},
                    ws.f32(rep, Shape{n}));
  }

  static int64_t row0(const TpPlan& P, const TpRank& tr) { return P.sp ? tr.t * P.R : 0; }
  // A collective's buffer holds degree equal shards.
  static int64_t padded(int64_t n, int64_t degree) { return (n + degree - 1) / degree * degree; }

  // All B*T rows of the rank's rows `local` [R, C], at `dst`: an all-gather with sequence
  // parallelism; without it the rows themselves, copied when `dst` is another place (a split
  // backward keeping a residual gradient that changes afterwards).
  TensorView all_rows(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView local, int64_t dst, const char* tag) const {
    const TpPlan& P = ws.plan;
    TensorView all = ws.view(dst, Shape{P.B * P.T, P.C});
    if (!P.sp) {
      if (all.data != local.data) s.copy(all.data, local.data, static_cast<size_t>(P.R * P.C * P.act_bytes));
      return all;
    }
    s.copy(rows_of(all, tr.t * P.R, P.R).data, local.data, static_cast<size_t>(P.R * P.C * P.act_bytes));
    tr.all_gather(s, ws.view(dst, Shape{P.B * P.T * P.C}), tag);
    return all;
  }
  // all_rows() started but not waited for: finish_enter() before reading other ranks' rows (the
  // rank's own are in place at once).
  TensorView start_all_rows(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView local, int64_t dst,
                            const char* tag) const {
    const TpPlan& P = ws.plan;
    TensorView all = ws.view(dst, Shape{P.B * P.T, P.C});
    if (!P.sp) {
      if (all.data != local.data) s.copy(all.data, local.data, static_cast<size_t>(P.R * P.C * P.act_bytes));
      return all;
    }
    s.copy(rows_of(all, tr.t * P.R, P.R).data, local.data, static_cast<size_t>(P.R * P.C * P.act_bytes));
    tr.start(s, TpRank::Op::kAllGather, ws.view(dst, Shape{P.B * P.T * P.C}), tag, *ws.gathered);
    return all;
  }
  void finish_enter(Stream& s, TpWorkspace& ws) const {
    if (ws.plan.sp) s.wait(*ws.gathered);
  }
  // out [B*T, N] = (all rows of `local`) @ weight^T + bias: the rank's own rows while the gather
  // runs, then the others.
  void column_matmul(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView out, TensorView local,
                     ConstTensorView weight, ConstTensorView bias, const char* tag) const {
    const TpPlan& P = ws.plan;
    if (!P.sp) {
      ops::matmul_forward(s, out, local, weight, bias);
      return;
    }
    const TensorView all = start_all_rows(s, tr, ws, local, P.full, tag);
    const int64_t mine = tr.t * P.R, BT = P.B * P.T;
    ops::matmul_forward(s, rows_of(out, mine, P.R), rows_of(all, mine, P.R), weight, bias);
    finish_enter(s, ws);
    if (mine > 0) ops::matmul_forward(s, rows_of(out, 0, mine), rows_of(all, 0, mine), weight, bias);
    if (mine + P.R < BT)
      ops::matmul_forward(s, rows_of(out, mine + P.R, BT - mine - P.R), rows_of(all, mine + P.R, BT - mine - P.R), weight, bias);
  }
  // Backward of a column-parallel matmul out = in_all @ weight^T + bias whose input's gather was
  // started (start_all_rows): the input gradient first (it does not read in_all), its reduction
  // over the group started, then the weight and bias gradients under it; returns the rank's rows
  // of the input gradient (kInput and kFused). kWeight runs only the weight and bias gradients.
  TensorView column_backward(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView dout, TensorView in_all,
                             TensorView weight, TensorView dweight, TensorView dbias, const char* tag,
                             BackPass pass) const {
    if (pass == BackPass::kWeight) {
      ops::matmul_backward(s, TensorView{}, dweight, dbias, dout, in_all, weight);
      return {};
    }
    TensorView din = ws.view(ws.plan.full2, Shape{ws.plan.B * ws.plan.T, ws.plan.C});
    ops::matmul_backward(s, din, TensorView{}, TensorView{}, dout, in_all, weight, /*overwrite_din=*/true);
    start_leave(s, tr, ws, din, tag);
    finish_enter(s, ws);
    if (pass == BackPass::kFused) ops::matmul_backward(s, TensorView{}, dweight, dbias, dout, in_all, weight);
    return finish_leave(s, tr, ws, din);
  }

  // leave(), started but not waited for (finish_leave waits and returns the rank's rows).
  void start_leave(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView partial, const char* tag) const {
    const TensorView flat{partial.data, partial.dtype, Shape{partial.shape.numel()}, partial.device};
    tr.start(s, ws.plan.sp ? TpRank::Op::kReduceScatter : TpRank::Op::kAllReduce, flat, tag, *ws.reduced);
  }
  TensorView finish_leave(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView partial) const {
    s.wait(*ws.reduced);
    return ws.plan.sp ? rows_of(partial, tr.t * ws.plan.R, ws.plan.R) : partial;
  }

  // Out of a row-parallel matmul (or the embedding): partial sums over all rows [B*T, C] -> the
  // sum on the rank's rows (reduce-scatter; an all-reduce without sequence parallelism).
  TensorView leave(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView partial, const char* tag) const {
    const TpPlan& P = ws.plan;
    const TensorView flat{partial.data, partial.dtype, Shape{partial.shape.numel()}, partial.device};
    if (!P.sp) {
      tr.all_reduce(s, flat, tag);
      return partial;
    }
    tr.reduce_scatter(s, flat, tag);
    return rows_of(partial, tr.t * P.R, P.R);
  }

  // Layer l of the workspace's chunk, local block blk.
  void layer_forward(Stream& s, const TpRank& tr, TpWorkspace& ws, ParamAccess& p, int l, int blk, TensorView res_in) const {
    const TpPlan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C, Cl = C / P.D, R = P.R;
    const int NHl = static_cast<int>(P.NH / P.D);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto f32 = [&](int64_t off, Shape sh) { return ws.f32(off, sh); };
    const auto& A = P.layers[static_cast<size_t>(l)];
    TensorView full = act(P.full, Shape{BT, C});

    TensorView ln1 = act(A.ln1, Shape{R, C});
    ops::layernorm_forward(s, ln1, f32(A.ln1_mean, Shape{R}), f32(A.ln1_rstd, Shape{R}), res_in, param(p, blk, 6),
                           param(p, blk, 7), kLayerNormEps);
    column_matmul(s, tr, ws, act(A.qkv, Shape{BT, 3 * Cl}), ln1, param(p, blk, 0), param(p, blk, 1), "tp ln_1");
    ops::flash_attention_forward(s, act(A.atty, Shape{P.B, P.T, Cl}), f32(A.lse, Shape{P.B, NHl, P.T}),
                                 act(A.qkv, Shape{P.B, P.T, 3 * Cl}), NHl);
    ops::matmul_forward(s, full, act(A.atty, Shape{BT, Cl}), param(p, blk, 2), ConstTensorView{});
    TensorView attproj = leave(s, tr, ws, full, "tp attn.c_proj");
    ops::bias_forward(s, attproj, param(p, blk, 8));
    TensorView res2 = act(A.residual2, Shape{R, C});
    TensorView ln2 = act(A.ln2, Shape{R, C});
    // The add and the layernorm in one pass (their bits; kernels/ops.h).
    ops::residual_layernorm_forward(s, res2, ln2, f32(A.ln2_mean, Shape{R}), f32(A.ln2_rstd, Shape{R}), res_in,
                                    attproj, param(p, blk, 9), param(p, blk, 10), kLayerNormEps);
    TensorView fch = act(A.fch, Shape{BT, 4 * Cl}), fch_gelu = act(A.fch_gelu, Shape{BT, 4 * Cl});
    column_matmul(s, tr, ws, fch, ln2, param(p, blk, 3), param(p, blk, 4), "tp ln_2");
    ops::gelu_forward(s, fch_gelu, fch);
    ops::matmul_forward(s, full, fch_gelu, param(p, blk, 5), ConstTensorView{});
    TensorView fcproj = leave(s, tr, ws, full, "tp mlp.c_proj");
    ops::bias_forward(s, fcproj, param(p, blk, 11));
    ops::add(s, act(A.residual3, Shape{R, C}), res2, fcproj);
  }

  // Layer l's backward (see backward_pass for the passes); its replicated gradients go to the
  // layer's scratch (reduce_rep and add_rep follow).
  void layer_backward(Stream& s, const TpRank& tr, TpWorkspace& ws, ParamAccess& p, int l, int blk,
                      TensorView dresidual, BackPass pass) const {
    const TpPlan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C, Cl = C / P.D, R = P.R;
    const int NHl = static_cast<int>(P.NH / P.D);
    const bool input = pass != BackPass::kWeight, weight = pass != BackPass::kInput;
    const TensorView none{};
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto f32 = [&](int64_t off, Shape sh) { return ws.f32(off, sh); };
    auto zero = [&](TensorView v) { ops::fill(s, v, 0.0f); };
    const auto& A = P.layers[static_cast<size_t>(l)];
    const TensorView res_in = l > 0 ? act(P.layers[static_cast<size_t>(l - 1)].residual3, Shape{R, C})
                                    : act(P.encoded, Shape{R, C});
    RepGrads rg;
    if (input) rg = rep_grads(s, ws, p, blk, A.rep);
    TensorView dfch_gelu = act(P.dfch_gelu, Shape{BT, 4 * Cl}), dfch = act(A.dfch, Shape{BT, 4 * Cl});
    TensorView datty = act(P.datty, Shape{BT, Cl}), dqkv = act(A.dqkv, Shape{BT, 3 * Cl});

    // residual3 = residual2 + fcproj(gelu(fc(ln2(residual2)))) + bias
    TensorView dres_all = act(A.dres3_all, Shape{BT, C});
    if (input) {
      ops::bias_backward(s, rg.at(11), dresidual);
      dres_all = all_rows(s, tr, ws, dresidual, A.dres3_all, "tp d mlp.c_proj");
      zero(dfch_gelu);
    }
    ops::matmul_backward(s, input ? dfch_gelu : none, weight ? grad(p, blk, 5) : none, none, dres_all,
                         act(A.fch_gelu, Shape{BT, 4 * Cl}), param(p, blk, 5));
    TensorView ln2_all = act(A.ln2_all, Shape{BT, C});
    if (input) {
      zero(dfch);
      ln2_all = start_all_rows(s, tr, ws, act(A.ln2, Shape{R, C}), A.ln2_all, "tp ln_2");
      ops::gelu_backward(s, dfch, act(A.fch, Shape{BT, 4 * Cl}), dfch_gelu);
    }
    const TensorView dln2 =
        column_backward(s, tr, ws, dfch, ln2_all, param(p, blk, 3), grad(p, blk, 3), grad(p, blk, 4), "tp d ln_2", pass);
    if (input)
      ops::layernorm_backward(s, dresidual, rg.at(9), rg.at(10), dln2, act(A.residual2, Shape{R, C}), param(p, blk, 9),
                              f32(A.ln2_mean, Shape{R}), f32(A.ln2_rstd, Shape{R}));

    // residual2 = residual + attproj(attention(qkv(ln1(residual)))) + bias
    TensorView dres2_all = act(A.dres2_all, Shape{BT, C});
    if (input) {
      ops::bias_backward(s, rg.at(8), dresidual);
      dres2_all = all_rows(s, tr, ws, dresidual, A.dres2_all, "tp d attn.c_proj");
    }
    ops::matmul_backward(s, input ? datty : none, weight ? grad(p, blk, 2) : none, none, dres2_all,
                         act(A.atty, Shape{BT, Cl}), param(p, blk, 2), /*overwrite_din=*/true);
    TensorView ln1_all = act(A.ln1_all, Shape{BT, C});
    if (input) {
      ln1_all = start_all_rows(s, tr, ws, act(A.ln1, Shape{R, C}), A.ln1_all, "tp ln_1");
      zero(dqkv);
      ops::flash_attention_backward(s, act(A.dqkv, Shape{P.B, P.T, 3 * Cl}), act(P.datty, Shape{P.B, P.T, Cl}),
                                    act(A.qkv, Shape{P.B, P.T, 3 * Cl}), act(A.atty, Shape{P.B, P.T, Cl}),
                                    f32(A.lse, Shape{P.B, NHl, P.T}), NHl, f32(P.attn_scratch, Shape{P.attn_scratch_numel}));
    }
    const TensorView dln1 =
        column_backward(s, tr, ws, dqkv, ln1_all, param(p, blk, 0), grad(p, blk, 0), grad(p, blk, 1), "tp d ln_1", pass);
    if (input)
      ops::layernorm_backward(s, dresidual, rg.at(6), rg.at(7), dln1, res_in, param(p, blk, 6), f32(A.ln1_mean, Shape{R}),
                              f32(A.ln1_rstd, Shape{R}));
  }

  // The dtype this model computes in on `p` (param_compute_dtype).
  DType compute_dtype(ParamAccess& p) const { return param_compute_dtype(activations_, p); }
  // Parameters in the compute dtype; gradients are fp32.
  TensorView param(ParamAccess& p, int block, int idx) const { return block_param(layout_, activations_, p, block, idx); }
  TensorView grad(ParamAccess& p, int block, int idx) const { return block_grad(layout_, p, block, idx); }

  ModelConfig config_;
  TensorParallel tp_;
  DType activations_ = DType::kF32;
  bool split_ = false;
  ParamLayout logical_, layout_;
  TensorMap map_;
  std::vector<GptChunk> chunks_;
  int64_t rep_max_ = 0, rep_layer_ = 0;
};

void TpWorkspace::read_logits_row(Stream& s, int row, float* out) {
  static_cast<const GptTp&>(model).read_logits_row(*this, s, row, out);
}

}  // namespace

std::unique_ptr<Model> make_gpt_tp(const ModelConfig& config, const TensorParallel& tp, DType activations) {
  return std::make_unique<GptTp>(config, tp, activations);
}

std::unique_ptr<Model> make_gpt_tp_stage(const ModelConfig& config, const PipelineStageSpec& stage,
                                         const TensorParallel& tp, DType activations) {
  return std::make_unique<GptTp>(config, tp, activations, &stage);
}

}  // namespace zt
