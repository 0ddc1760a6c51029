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
#include <algorithm>
#include <string>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
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

struct TpPlan {
  int64_t B, T, C, NH, L, V, Vp, D;  // V real, Vp padded vocabulary; D = tensor degree
  bool sp;
  int64_t R;  // rows a rank's residual stream holds
  int64_t total = 0;
  int64_t encoded, lnf, lnf_mean, lnf_rstd, logits, losses;
  // attn_scratch: flash_attention_backward's scratch, shared by every layer.
  int64_t full, full2, dresidual, dfch, dfch_gelu, datty, dqkv, attn_scratch, attn_scratch_numel;
  int64_t stat_max, gmax, stat_part, gsum, rep, row;
  int64_t rep_numel;  // padded to a multiple of D
  // lse: the attention's log-sum-exp per (batch, local head, query), [B, NH/D, T]; with qkv and atty
  // all the tiled attention's backward reads (no T x T matrix is kept).
  struct Layer {
    int64_t ln1, ln1_mean, ln1_rstd, qkv, atty, lse, residual2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu, residual3;
  };
  std::vector<Layer> layers;

  int64_t add(int64_t n) {
    const int64_t off = total;
    total += (n + 63) / 64 * 64;
    return off;
  }

  TpPlan(const ModelConfig& c, int64_t B_, int64_t T_, int degree, bool sequence, int64_t rep_max)
      : B(B_), T(T_), C(c.embd), NH(c.heads), L(c.layers), V(c.vocab), Vp(padded_vocab(c.vocab, degree)),
        D(degree), sp(sequence) {
    const int64_t BT = B * T, Cl = C / D, NHl = NH / D;
    R = sp ? BT / D : BT;
    rep_numel = (rep_max + D - 1) / D * D;
    encoded = add(R * C);
    layers.resize(static_cast<size_t>(L));
    for (auto& l : layers) {
      l.ln1 = add(R * C), l.ln1_mean = add(R), l.ln1_rstd = add(R), l.qkv = add(BT * 3 * Cl), l.atty = add(BT * Cl);
      l.lse = add(B * NHl * T), l.residual2 = add(R * C), l.ln2 = add(R * C), l.ln2_mean = add(R), l.ln2_rstd = add(R);
      l.fch = add(BT * 4 * Cl), l.fch_gelu = add(BT * 4 * Cl), l.residual3 = add(R * C);
    }
    lnf = add(R * C), lnf_mean = add(R), lnf_rstd = add(R), logits = add(BT * (Vp / D)), losses = add(BT);
    full = add(BT * C), full2 = add(BT * C), dresidual = add(R * C);
    dfch = add(BT * 4 * Cl), dfch_gelu = add(BT * 4 * Cl), datty = add(BT * Cl), dqkv = add(BT * 3 * Cl);
    attn_scratch_numel = static_cast<int64_t>((ops::flash_attention_scratch_bytes(B, T, Cl, NHl) + 3) / 4);
    attn_scratch = add(attn_scratch_numel);
    stat_max = add(D * BT), gmax = add(BT), stat_part = add(D * 2 * BT), gsum = add(2 * BT);
    rep = add(rep_numel), row = add(Vp);
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
  TpWorkspace(const GptTp& model, const ModelConfig& c, Device& d, int B, int T, int degree, bool sp, int64_t rep_max)
      : plan(c, B, T, degree, sp, rep_max), model(model), device(d.index()),
        buf(d.memory(), static_cast<size_t>(plan.total) * 4, d.compute(), "activations"),
        gathered(d.create_event()), reduced(d.create_event()) {}
  int B() const override { return static_cast<int>(plan.B); }
  int T() const override { return static_cast<int>(plan.T); }
  TensorView losses() override { return view(plan.losses, Shape{plan.B * plan.T}); }
  // The rank's shard of the padded vocabulary's logits: [B*T, Vp / degree].
  TensorView logits() override { return view(plan.logits, Shape{plan.B * plan.T, plan.Vp / plan.D}); }
  size_t bytes() const override { return buf.size(); }
  void read_logits_row(Stream& s, int row, float* out) override;

  TensorView view(int64_t off, Shape s) { return TensorView{buf.as<float>() + off, DType::kF32, s, device}; }

  TpPlan plan;
  const GptTp& model;
  int device;
  DeviceBuffer buf;
  // Recorded on the comm stream right after a collective the compute stream waits for later.
  std::unique_ptr<Event> gathered, reduced;
  TpRank rank{};  // the device's rank in the model's communicator and its tensor group
};

TensorView rows_of(TensorView v, int64_t first_row, int64_t rows) {
  const int64_t width = v.shape.numel() / v.shape[0];
  return TensorView{static_cast<float*>(v.data) + first_row * width, v.dtype, Shape{rows, width}, v.device};
}

class GptTp final : public Model {
 public:
  GptTp(const ModelConfig& c, const TensorParallel& tp) : config_(c), tp_(tp), logical_(gpt_layout(c)) {
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
    const int64_t C = c.embd, V = c.vocab;
    auto add = [&](int block, int lb, int li, Shape shape, TensorSplit split) {
      const ParamTensor& g = logical_.block(lb).tensors[static_cast<size_t>(li)];
      layout_.add_tensor(block, g.name, shape, g.init, g.init_std, g.weight_decay);
      map_.places.resize(static_cast<size_t>(layout_.num_blocks()));
      map_.places[static_cast<size_t>(block)].push_back({lb, li, split});
    };
    const int emb = layout_.add_block("embeddings");
    add(emb, 0, 0, Shape{padded_vocab(V, D) / D, C}, TensorSplit::kRows);
    add(emb, 0, 1, Shape{c.seq_len, C}, TensorSplit::kReplicated);
    for (int l = 0; l < c.layers; ++l) {
      const int b = layout_.add_block("h." + std::to_string(l)), lb = l + 1;
      add(b, lb, kQkvw, Shape{3 * C / D, C}, TensorSplit::kQkvRows);
      add(b, lb, kQkvb, Shape{3 * C / D}, TensorSplit::kQkvRows);
      add(b, lb, kAttprojw, Shape{C, C / D}, TensorSplit::kCols);
      add(b, lb, kFcw, Shape{4 * C / D, C}, TensorSplit::kRows);
      add(b, lb, kFcb, Shape{4 * C / D}, TensorSplit::kRows);
      add(b, lb, kFcprojw, Shape{C, 4 * C / D}, TensorSplit::kCols);
      for (LayerTensor k : kRepTensors) add(b, lb, k, Shape{C}, TensorSplit::kReplicated);
    }
    const int lnf = layout_.add_block("ln_f");
    add(lnf, c.layers + 1, 0, Shape{C}, TensorSplit::kReplicated);
    add(lnf, c.layers + 1, 1, Shape{C}, TensorSplit::kReplicated);
    for (int b = 0; b < layout_.num_blocks(); ++b)
      rep_max_ = std::max(rep_max_, layout_.block(b).numel - map_.replicated_from(b));
  }

  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  const TensorMap* tensor_map() const override { return &map_; }

  size_t workspace_bytes(int B, int T) const override {
    return static_cast<size_t>(TpPlan(config_, B, T, tp_.degree, tp_.sequence, rep_max_).total) * 4;
  }
  std::unique_ptr<Workspace> make_workspace(Device& d, int B, int T) const override {
    ZT_REQUIRE(T >= 1 && T <= config_.seq_len, "sequence length ", T, " is above the model's context of ",
               config_.seq_len, " tokens");
    ZT_REQUIRE(!tp_.sequence || (int64_t{B} * T) % tp_.degree == 0, "sequence parallelism over ", tp_.degree,
               " ranks needs the micro-batch's tokens (", B, " x ", T, " = ", int64_t{B} * T,
               ") to be a multiple of ", tp_.degree, "; change --micro-batch-size or --seq-len, or pass --no-sequence-parallel");
    auto ws = std::make_unique<TpWorkspace>(*this, config_, d, B, T, tp_.degree, tp_.sequence, rep_max_);
    ws->rank = rank_of(d.index());
    return ws;
  }

  // GPT-2's orders: the blocks are the same.
  std::vector<int> forward_order() const override { return gpt_forward_order(config_.layers); }
  std::vector<int> backward_order() const override { return gpt_backward_order(config_.layers); }

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
    ZT_CHECK(batch.B == P.B && batch.T == P.T, "batch ", batch.B, "x", batch.T, " on a workspace for ", P.B, "x", P.T);
    const TpRank& tr = ws.rank;
    const int64_t BT = P.B * P.T, C = P.C, Vl = P.Vp / P.D;
    const int L = static_cast<int>(P.L);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    TensorView full = act(P.full, Shape{BT, C});

    // Embedding: each rank looks up the tokens of its vocabulary shard (zeros elsewhere); the sum
    // over the group is the embedding. Positions are added on the rank's rows.
    p.before_forward(0);
    const TensorView wte = param(p, 0, 0);
    const TensorView wpe = param(p, 0, 1);
    ops::encoder_forward(s, act(P.full, Shape{P.B, P.T, C}), batch.inputs, wte, ConstTensorView{},
                         ops::VocabRange{tr.t * Vl, P.V});
    TensorView encoded = act(P.encoded, Shape{P.R, C});
    s.copy(encoded.data, leave(s, tr, ws, full, "tp embedding").data, static_cast<size_t>(P.R * C) * 4);
    ops::position_forward(s, encoded, wpe, row0(P, tr), P.T);

    TensorView residual = encoded;
    for (int l = 0; l < L; ++l) {
      p.before_forward(l + 1);
      layer_forward(s, tr, ws, p, l, residual);
      residual = act(P.layers[static_cast<size_t>(l)].residual3, Shape{P.R, C});
    }

    p.before_forward(L + 1);
    TensorView lnf = act(P.lnf, Shape{P.R, C});
    ops::layernorm_forward(s, lnf, act(P.lnf_mean, Shape{P.R}), act(P.lnf_rstd, Shape{P.R}), residual,
                           param(p, L + 1, 0), param(p, L + 1, 1), kLayerNormEps);
    p.before_forward(0);  // the LM head reads wte again (stage 3 gathers it again)
    TensorView logits = act(P.logits, Shape{BT, Vl});
    column_matmul(s, tr, ws, logits, lnf, param(p, 0, 0), ConstTensorView{}, "tp ln_f");

    // Vocabulary-parallel cross-entropy: the row maxima, then the sums of exponentials and the
    // target logits, each combined over the group in a fixed order.
    const ConstTensorView targets{batch.targets.data, DType::kI32, Shape{BT}, batch.targets.device};
    TensorView stat_max = act(P.stat_max, Shape{P.D, BT});
    ops::row_max(s, act(P.stat_max + tr.t * BT, Shape{BT}), logits, ops::VocabRange{tr.t * Vl, P.V});
    tr.all_gather(s, act(P.stat_max, Shape{P.D * BT}), "tp logits max");
    TensorView gmax = act(P.gmax, Shape{BT});
    ops::reduce_slices(s, gmax, stat_max, ops::SliceReduce::kMax);
    const ops::VocabRange vocab{tr.t * Vl, P.V};
    ops::vocab_partials(s, act(P.stat_part + tr.t * 2 * BT, Shape{2, BT}), logits, gmax, targets, vocab);
    tr.all_gather(s, act(P.stat_part, Shape{P.D * 2 * BT}), "tp logits sums");
    ops::reduce_slices(s, act(P.gsum, Shape{2 * BT}), act(P.stat_part, Shape{P.D, 2 * BT}), ops::SliceReduce::kSum);
    ops::vocab_loss_grad(s, logits, act(P.losses, Shape{BT}), gmax, act(P.gsum, Shape{BT}), act(P.gsum + BT, Shape{BT}),
                         targets, vocab, dloss, train, batch.loss_scale);
  }

  void backward(Stream& s, ParamAccess& p, Workspace& wsb, const Batch& batch) const override {
    auto& ws = static_cast<TpWorkspace&>(wsb);
    const TpPlan& P = ws.plan;
    const TpRank& tr = ws.rank;
    const int64_t BT = P.B * P.T, C = P.C, Vl = P.Vp / P.D;
    const int L = static_cast<int>(P.L);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    TensorView dresidual = act(P.dresidual, Shape{P.R, C});
    ops::fill(s, dresidual, 0.0f);

    // LM head: logits = lnf @ wte_shard^T; dlnf is a partial sum over the vocabulary shards.
    p.before_backward(0);
    const TensorView lnf_all = start_enter(s, tr, ws, act(P.lnf, Shape{P.R, C}), "tp ln_f");
    const TensorView dlnf = column_backward(s, tr, ws, act(P.logits, Shape{BT, Vl}), lnf_all, param(p, 0, 0),
                                            grad(p, 0, 0), TensorView{}, "tp d ln_f");
    const int lnf_block = L + 1;
    p.before_backward(lnf_block);
    const RepGrads rg = rep_grads(s, ws, p, lnf_block);
    const TensorView last_res = L > 0 ? act(P.layers[static_cast<size_t>(L - 1)].residual3, Shape{P.R, C})
                                      : act(P.encoded, Shape{P.R, C});
    ops::layernorm_backward(s, dresidual, rg.at(0), rg.at(1), dlnf, last_res, param(p, lnf_block, 0),
                            act(P.lnf_mean, Shape{P.R}), act(P.lnf_rstd, Shape{P.R}));
    finish_rep(s, tr, ws, p, lnf_block);
    p.after_backward(lnf_block);

    for (int l = L - 1; l >= 0; --l) {
      p.before_backward(l + 1);
      layer_backward(s, tr, ws, p, l, dresidual);
      finish_rep(s, tr, ws, p, l + 1);
      p.after_backward(l + 1);
    }

    // Encoder: positions from the rank's rows (summed over the group), tokens of its shard from
    // all rows.
    p.before_backward(0);
    const RepGrads pg = rep_grads(s, ws, p, 0);
    ops::position_backward(s, pg.at(1), dresidual, row0(P, tr), P.T);
    finish_rep(s, tr, ws, p, 0);
    const TensorView dres_all = enter(s, tr, ws, dresidual, "tp d embedding");
    const TensorView dres3{dres_all.data, DType::kF32, Shape{P.B, P.T, C}, dres_all.device};
    ops::encoder_backward(s, grad(p, 0, 0), TensorView{}, dres3, batch.inputs, ops::VocabRange{tr.t * Vl, P.V});
    p.after_backward(0);
  }

  void read_logits_row(TpWorkspace& ws, Stream& s, int row, float* out) const {
    const TpPlan& P = ws.plan;
    const TpRank& tr = ws.rank;
    const int64_t Vl = P.Vp / P.D;
    s.copy(ws.buf.as<float>() + P.row + tr.t * Vl, ws.buf.as<float>() + P.logits + static_cast<int64_t>(row) * Vl,
           static_cast<size_t>(Vl) * 4);
    tr.all_gather(s, ws.view(P.row, Shape{P.Vp}), "tp logits row");
    s.copy(out, ws.buf.as<float>() + P.row, static_cast<size_t>(P.V) * 4);
  }

 private:
  // Gradient views of block b's tensors for this micro-batch (indexed as the block's tensors):
  // its replicated tensors' views are, with sequence parallelism, a zeroed scratch (summed over
  // the group and added to the gradients by finish_rep); everything else is the gradients.
  struct RepGrads {
    std::vector<TensorView> views;
    TensorView at(size_t i) const { return views.at(i); }
  };
  RepGrads rep_grads(Stream& s, TpWorkspace& ws, ParamAccess& p, int block) const {
    RepGrads g;
    const ParamBlock& pb = layout_.block(block);
    const int64_t from = map_.replicated_from(block);
    if (ws.plan.sp) ops::fill(s, ws.view(ws.plan.rep, Shape{padded(pb.numel - from, ws.plan.D)}), 0.0f);
    for (size_t i = 0; i < pb.tensors.size(); ++i) {
      const ParamTensor& t = pb.tensors[i];
      g.views.push_back(ws.plan.sp && t.offset >= from ? ws.view(ws.plan.rep + t.offset - from, t.shape)
                                                       : grad(p, block, static_cast<int>(i)));
    }
    return g;
  }
  void finish_rep(Stream& s, const TpRank& tr, TpWorkspace& ws, ParamAccess& p, int block) const {
    if (!ws.plan.sp) return;
    const int64_t from = map_.replicated_from(block), n = layout_.block(block).numel - from;
    tr.all_reduce(s, ws.view(ws.plan.rep, Shape{padded(n, ws.plan.D)}), "tp replicated grads");
    ops::accumulate(s, TensorView{p.grads(block) + from, DType::kF32, Shape{n}, p.device_index()},
                    ws.view(ws.plan.rep, Shape{n}));
  }

  static int64_t row0(const TpPlan& P, const TpRank& tr) { return P.sp ? tr.t * P.R : 0; }
  // A collective's buffer holds degree equal shards.
  static int64_t padded(int64_t n, int64_t degree) { return (n + degree - 1) / degree * degree; }

  // Into a column-parallel matmul: the rank's rows [R, C] -> all rows [B*T, C] (an all-gather into
  // the `full` scratch with sequence parallelism; the rows themselves without).
  TensorView enter(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView local, const char* tag) const {
    const TpPlan& P = ws.plan;
    if (!P.sp) return local;
    TensorView full = ws.view(P.full, Shape{P.B * P.T, P.C});
    s.copy(rows_of(full, tr.t * P.R, P.R).data, local.data, static_cast<size_t>(P.R * P.C) * 4);
    tr.all_gather(s, ws.view(P.full, Shape{P.B * P.T * P.C}), tag);
    return full;
  }
  // enter() started but not waited for: finish_enter() before reading other ranks' rows (the
  // rank's own are in place at once).
  TensorView start_enter(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView local, const char* tag) const {
    const TpPlan& P = ws.plan;
    if (!P.sp) return local;
    TensorView full = ws.view(P.full, Shape{P.B * P.T, P.C});
    s.copy(rows_of(full, tr.t * P.R, P.R).data, local.data, static_cast<size_t>(P.R * P.C) * 4);
    tr.start(s, TpRank::Op::kAllGather, ws.view(P.full, Shape{P.B * P.T * P.C}), tag, *ws.gathered);
    return full;
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
    const TensorView all = start_enter(s, tr, ws, local, tag);
    const int64_t mine = tr.t * P.R, BT = P.B * P.T;
    ops::matmul_forward(s, rows_of(out, mine, P.R), rows_of(all, mine, P.R), weight, bias);
    finish_enter(s, ws);
    if (mine > 0) ops::matmul_forward(s, rows_of(out, 0, mine), rows_of(all, 0, mine), weight, bias);
    if (mine + P.R < BT)
      ops::matmul_forward(s, rows_of(out, mine + P.R, BT - mine - P.R), rows_of(all, mine + P.R, BT - mine - P.R), weight, bias);
  }
  // Backward of a column-parallel matmul out = in_all @ weight^T + bias whose input's gather was
  // started (start_enter): the input gradient first (it does not read in_all), its reduction over
  // the group started, then the weight and bias gradients under it; returns the rank's rows of
  // the input gradient.
  TensorView column_backward(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView dout, TensorView in_all,
                             TensorView weight, TensorView dweight, TensorView dbias, const char* tag) const {
    TensorView din = ws.view(ws.plan.full2, Shape{ws.plan.B * ws.plan.T, ws.plan.C});
    ops::fill(s, din, 0.0f);
    ops::matmul_backward(s, din, TensorView{}, TensorView{}, dout, in_all, weight);
    start_leave(s, tr, ws, din, tag);
    finish_enter(s, ws);
    ops::matmul_backward(s, TensorView{}, dweight, dbias, dout, in_all, weight);
    return finish_leave(s, tr, ws, din);
  }

  // leave(), started but not waited for (finish_leave waits and returns the rank's rows).
  void start_leave(Stream& s, const TpRank& tr, TpWorkspace& ws, TensorView partial, const char* tag) const {
    const TensorView flat{partial.data, DType::kF32, Shape{partial.shape.numel()}, partial.device};
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
    const TensorView flat{partial.data, DType::kF32, Shape{partial.shape.numel()}, partial.device};
    if (!P.sp) {
      tr.all_reduce(s, flat, tag);
      return partial;
    }
    tr.reduce_scatter(s, flat, tag);
    return rows_of(partial, tr.t * P.R, P.R);
  }

  void layer_forward(Stream& s, const TpRank& tr, TpWorkspace& ws, ParamAccess& p, int l, TensorView res_in) const {
    const TpPlan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C, Cl = C / P.D, R = P.R;
    const int NHl = static_cast<int>(P.NH / P.D);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    const auto& A = P.layers[static_cast<size_t>(l)];
    const int blk = l + 1;
    TensorView full = act(P.full, Shape{BT, C});

    TensorView ln1 = act(A.ln1, Shape{R, C});
    ops::layernorm_forward(s, ln1, act(A.ln1_mean, Shape{R}), act(A.ln1_rstd, Shape{R}), res_in, param(p, blk, 6),
                           param(p, blk, 7), kLayerNormEps);
    column_matmul(s, tr, ws, act(A.qkv, Shape{BT, 3 * Cl}), ln1, param(p, blk, 0), param(p, blk, 1), "tp ln_1");
    ops::flash_attention_forward(s, act(A.atty, Shape{P.B, P.T, Cl}), act(A.lse, Shape{P.B, NHl, P.T}),
                                 act(A.qkv, Shape{P.B, P.T, 3 * Cl}), NHl);
    ops::matmul_forward(s, full, act(A.atty, Shape{BT, Cl}), param(p, blk, 2), ConstTensorView{});
    TensorView attproj = leave(s, tr, ws, full, "tp attn.c_proj");
    ops::bias_forward(s, attproj, param(p, blk, 8));
    TensorView res2 = act(A.residual2, Shape{R, C});
    ops::add(s, res2, res_in, attproj);

    TensorView ln2 = act(A.ln2, Shape{R, C});
    ops::layernorm_forward(s, ln2, act(A.ln2_mean, Shape{R}), act(A.ln2_rstd, Shape{R}), res2, param(p, blk, 9),
                           param(p, blk, 10), kLayerNormEps);
    TensorView fch = act(A.fch, Shape{BT, 4 * Cl}), fch_gelu = act(A.fch_gelu, Shape{BT, 4 * Cl});
    column_matmul(s, tr, ws, fch, ln2, param(p, blk, 3), param(p, blk, 4), "tp ln_2");
    ops::gelu_forward(s, fch_gelu, fch);
    ops::matmul_forward(s, full, fch_gelu, param(p, blk, 5), ConstTensorView{});
    TensorView fcproj = leave(s, tr, ws, full, "tp mlp.c_proj");
    ops::bias_forward(s, fcproj, param(p, blk, 11));
    ops::add(s, act(A.residual3, Shape{R, C}), res2, fcproj);
  }

  void layer_backward(Stream& s, const TpRank& tr, TpWorkspace& ws, ParamAccess& p, int l, TensorView dresidual) const {
    const TpPlan& P = ws.plan;
    const int64_t BT = P.B * P.T, C = P.C, Cl = C / P.D, R = P.R;
    const int NHl = static_cast<int>(P.NH / P.D);
    auto act = [&](int64_t off, Shape sh) { return ws.view(off, sh); };
    auto zero = [&](TensorView v) { ops::fill(s, v, 0.0f); };
    const auto& A = P.layers[static_cast<size_t>(l)];
    const int blk = l + 1;
    const TensorView res_in = l > 0 ? act(P.layers[static_cast<size_t>(l - 1)].residual3, Shape{R, C})
                                    : act(P.encoded, Shape{R, C});
    const RepGrads rg = rep_grads(s, ws, p, blk);

    // residual3 = residual2 + fcproj(gelu(fc(ln2(residual2)))) + bias
    ops::bias_backward(s, rg.at(11), dresidual);
    const TensorView dres_all = enter(s, tr, ws, dresidual, "tp d mlp.c_proj");
    TensorView dfch_gelu = act(P.dfch_gelu, Shape{BT, 4 * Cl}), dfch = act(P.dfch, Shape{BT, 4 * Cl});
    zero(dfch_gelu);
    ops::matmul_backward(s, dfch_gelu, grad(p, blk, 5), TensorView{}, dres_all, act(A.fch_gelu, Shape{BT, 4 * Cl}),
                         param(p, blk, 5));
    zero(dfch);
    const TensorView ln2_all = start_enter(s, tr, ws, act(A.ln2, Shape{R, C}), "tp ln_2");
    ops::gelu_backward(s, dfch, act(A.fch, Shape{BT, 4 * Cl}), dfch_gelu);
    const TensorView dln2 = column_backward(s, tr, ws, dfch, ln2_all, param(p, blk, 3), grad(p, blk, 3), grad(p, blk, 4),
                                            "tp d ln_2");
    ops::layernorm_backward(s, dresidual, rg.at(9), rg.at(10), dln2, act(A.residual2, Shape{R, C}), param(p, blk, 9),
                            act(A.ln2_mean, Shape{R}), act(A.ln2_rstd, Shape{R}));

    // residual2 = residual + attproj(attention(qkv(ln1(residual)))) + bias
    ops::bias_backward(s, rg.at(8), dresidual);
    const TensorView dres2_all = enter(s, tr, ws, dresidual, "tp d attn.c_proj");
    TensorView datty = act(P.datty, Shape{BT, Cl}), dqkv = act(P.dqkv, Shape{BT, 3 * Cl});
    zero(datty);
    ops::matmul_backward(s, datty, grad(p, blk, 2), TensorView{}, dres2_all, act(A.atty, Shape{BT, Cl}), param(p, blk, 2));
    const TensorView ln1_all = start_enter(s, tr, ws, act(A.ln1, Shape{R, C}), "tp ln_1");
    zero(dqkv);
    ops::flash_attention_backward(s, act(P.dqkv, Shape{P.B, P.T, 3 * Cl}), act(P.datty, Shape{P.B, P.T, Cl}),
                                  act(A.qkv, Shape{P.B, P.T, 3 * Cl}), act(A.atty, Shape{P.B, P.T, Cl}),
                                  act(A.lse, Shape{P.B, NHl, P.T}), NHl, act(P.attn_scratch, Shape{P.attn_scratch_numel}));
    const TensorView dln1 = column_backward(s, tr, ws, dqkv, ln1_all, param(p, blk, 0), grad(p, blk, 0), grad(p, blk, 1),
                                            "tp d ln_1");
    ops::layernorm_backward(s, dresidual, rg.at(6), rg.at(7), dln1, res_in, param(p, blk, 6), act(A.ln1_mean, Shape{R}),
                            act(A.ln1_rstd, Shape{R}));
  }

  TensorView tensor_at(float* base, int device, int block, int idx) const {
    const ParamTensor& t = layout_.block(block).tensors[static_cast<size_t>(idx)];
    return TensorView{base + t.offset, DType::kF32, t.shape, device};
  }
  TensorView param(ParamAccess& p, int block, int idx) const { return tensor_at(p.params(block), p.device_index(), block, idx); }
  TensorView grad(ParamAccess& p, int block, int idx) const { return tensor_at(p.grads(block), p.device_index(), block, idx); }

  ModelConfig config_;
  TensorParallel tp_;
  ParamLayout logical_, layout_;
  TensorMap map_;
  int64_t rep_max_ = 0;
};

void TpWorkspace::read_logits_row(Stream& s, int row, float* out) {
  static_cast<const GptTp&>(model).read_logits_row(*this, s, row, out);
}

}  // namespace

std::unique_ptr<Model> make_gpt_tp(const ModelConfig& config, const TensorParallel& tp) {
  return std::make_unique<GptTp>(config, tp);
}

}  // namespace zt
