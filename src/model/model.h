// The model interface the trainer (and later the ZeRO engine) drives: explicit forward and
// backward over parameter blocks, with hooks around each block so that sharding engines can
// gather parameters before a block runs and reduce its gradients once they are final.
#pragma once

#include <memory>

#include "core/dtype.h"
#include "memory/caching_allocator.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/tensor_split.h"
#include "runtime/device.h"

namespace zt {

class Communicator;
class Mesh;

// Where the model reads parameters and accumulates gradients, block by block. An fp32 model reads
// params(), a 16-bit one param_data() (Model::param); gradients are fp32 for every model.
class ParamAccess {
 public:
  virtual ~ParamAccess() = default;
  virtual int device_index() const = 0;  // the device the buffers live on
  virtual float* params(int block) = 0;  // flat fp32 buffer of block `block`, valid after before_*
  virtual float* grads(int block) = 0;   // flat fp32 gradient buffer (accumulated with +=)
  // The dtype param_data() holds: f32 (then param_data == params), bf16 or f16.
  virtual DType param_dtype() const { return DType::kF32; }
  // Flat buffer of block `block` in param_dtype(), valid after before_*.
  virtual void* param_data(int block) { return params(block); }
  virtual void before_forward(int block) {}
  virtual void before_backward(int block) {}
  // Every gradient of `block` for this micro-batch has been issued on the stream.
  virtual void after_backward(int block) {}
};

// One micro-batch on the device. GPT: inputs [B,T] int32 tokens, targets [B,T] int32.
// MLP: inputs [B,input_dim] fp32, targets [B] int32 labels (T = 1).
struct Batch {
  ConstTensorView inputs;
  ConstTensorView targets;
  int B = 0, T = 0;
  // Device float multiplying the loss gradient (dynamic loss scaling), read when the op runs; null: 1.
  const float* loss_scale = nullptr;
};

// Activation memory for one (B, T), planned once: a single pool allocation carved into views.
class Workspace {
 public:
  virtual ~Workspace() = default;
  virtual int B() const = 0;
  virtual int T() const = 0;
  // Per-position losses of the last forward: [B*T] (GPT) or [B] (MLP), nats.
  virtual TensorView losses() = 0;
  // Logits of the last forward when it ran with train=false: [B*T, Vp/D] (GPT: the rank's shard of
  // the padded vocabulary, columns >= V padding) or [B, classes]. read_logits_row reads real ids.
  virtual TensorView logits() = 0;
  virtual size_t bytes() const = 0;
  // Seconds the device stream spent re-running forward ops inside backward() (--recompute) since
  // the last call; read only after synchronizing the stream the model ran on.
  virtual double take_recompute_seconds() { return 0; }
  // Row `row` of the logits of the last forward (train=false) over the whole vocabulary, into host
  // memory `out` (vocab floats), ready when `s` has run. A tensor-parallel workspace gathers the
  // rank's vocabulary shards first (a tensor-group collective: every rank of the group calls it).
  virtual void read_logits_row(Stream& s, int row, float* out);
  // Pipeline stages (make_gpt_stage): a workspace serves one chunk. The activation it reads instead
  // of embedding tokens (received before forward), the one forward leaves for the next chunk, and
  // the gradient with respect to that (received before backward, turned in place into the gradient
  // with respect to the chunk's input). Empty where the chunk has no such neighbour.
  virtual TensorView stage_input() { return {}; }
  virtual TensorView stage_output() { return {}; }
  virtual TensorView stage_gradient() { return {}; }
};

// A workspace over one pool allocation (a WorkspaceArena's total bytes) on its device.
class ArenaWorkspace : public Workspace {
 public:
  ArenaWorkspace(Device& d, int64_t bytes, DType activations)
      : dtype(activations), device(d.index()), buf(d.memory(), static_cast<size_t>(bytes), d.compute(), "activations") {}
  size_t bytes() const override { return buf.size(); }
  // An activation (in `dtype`) or an fp32 tensor at byte offset `off`.
  TensorView act(int64_t off, Shape s) { return TensorView{buf.as<char>() + off, dtype, s, device}; }
  TensorView f32(int64_t off, Shape s) { return TensorView{buf.as<char>() + off, DType::kF32, s, device}; }

  DType dtype;  // f32, or the 16-bit type of the last forward's parameters (Model::compute_dtype)
  int device;
  DeviceBuffer buf;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const ParamLayout& layout() const = 0;
  // The dtype of the activations, saved tensors, activation gradients and GEMM inputs (make_model);
  // a 16-bit model reads ParamAccess::param_data, the engine's 16-bit working buffers as they are.
  virtual DType activation_dtype() const { return DType::kF32; }
  // Bytes make_workspace(B, T) will take from the pool (the memory plan uses the same number).
  virtual size_t workspace_bytes(int B, int T) const = 0;
  virtual std::unique_ptr<Workspace> make_workspace(Device& device, int B, int T) const = 0;
  // Forward and loss. With train=true the logits are turned into dlogits scaled by `dloss` (the
  // weight of one position's loss in the step's objective), ready for backward().
  virtual void forward(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch, float dloss,
                       bool train) const = 0;
  virtual void backward(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const = 0;
  // The blocks forward() and backward() visit, in order, one entry per before_forward /
  // before_backward call (a block may appear twice: GPT's tied embedding). ZeRO stage 3 uses it
  // to prefetch the next block's parameters and to decide when a gathered block can go.
  virtual std::vector<int> forward_order() const = 0;
  virtual std::vector<int> backward_order() const;  // default: forward_order reversed
  // How the local blocks map onto the logical layout (GPT: gpt_layout); null for the MLP.
  virtual const TensorMap* tensor_map() const { return nullptr; }

  // ---- pipeline stages (make_gpt_stage; a whole model is one chunk and its own logical model) ----
  // Chunks this model runs (a stage with V virtual stages runs V); workspaces serve one chunk each,
  // and forward()/backward() run the chunk of the workspace they are given.
  virtual int chunks() const { return 1; }
  virtual std::unique_ptr<Workspace> make_chunk_workspace(Device& device, int B, int T, int chunk) const;
  // Bytes make_chunk_workspace(B, T, chunk) takes from the pool (workspace_bytes sums the chunks).
  virtual size_t chunk_workspace_bytes(int B, int T, int chunk) const;
  // The logical block local block `block` holds (a tensor-parallel rank's shard of it); a pipeline
  // stage's tied LM head is a copy of block 0, so two stages may name the same.
  virtual int logical_block(int block) const { return block; }
  // The backward split for zero-bubble schedules: backward_input computes what the previous chunk
  // needs (the input gradient, and the layernorm gradients on the way), backward_weight the matmul
  // and embedding weight gradients from what backward_input kept. Together they add the bits
  // backward() adds. Only models made with split_backward support them.
  virtual void backward_input(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const;
  virtual void backward_weight(Stream& s, ParamAccess& p, Workspace& ws, const Batch& batch) const;

  // Tensor `idx` of layout() block `block`: its parameters in compute_dtype (inference reads them too).
  TensorView param(ParamAccess& p, int block, int idx) const;

 protected:
  // The dtype the model computes in on `p`: f32, or for a 16-bit model the 16-bit type of p's
  // parameters, read as they are (bf16 and f16 take the same workspace bytes, so an engine switching
  // its working dtype, --on-scale-collapse bf16, carries the activations with it).
  DType compute_dtype(const ParamAccess& p) const;
  // Tensor `idx` of layout() block `block`: its gradient in fp32.
  TensorView grad(ParamAccess& p, int block, int idx) const;
};

// A workspace's single allocation, planned as byte offsets, each buffer 256-byte aligned:
// activations in the activation dtype (act_bytes an element), the rest fp32.
struct WorkspaceArena {
  int64_t act_bytes, total = 0;
  int64_t add_bytes(int64_t bytes) {
    const int64_t off = total;
    total += (bytes + 255) / 256 * 256;
    return off;
  }
  int64_t act(int64_t n) { return add_bytes(n * act_bytes); }
  int64_t f32(int64_t n) { return add_bytes(n * 4); }
};

// One chunk of a pipeline stage: a contiguous run of transformer layers; the first virtual stage's
// chunk also runs the embedding, the last one's the final layernorm, the LM head and the loss.
struct PipelineChunk {
  int first_layer = 0, layers = 0;
  bool embedding = false, head = false;
};

// What one pipeline stage of GPT runs: its chunks in chunk order. The stage's layout holds the
// embeddings block if a chunk embeds, its layers' blocks in chunk order, then ln_f and (when the
// stage does not also embed) a copy of the embeddings block whose wte is the tied LM head — the
// Megatron arrangement: the copy's gradient is summed with the first stage's before the update.
struct PipelineStageSpec {
  std::vector<PipelineChunk> chunks;
  bool split_backward = false;  // keep what backward_weight needs (ZB-H1)
};
// Tensor parallelism of a model (Megatron-LM's layout, model/tensor_split.h): each rank runs the
// local model, and the collectives of its tensor group (mesh->tensor_group(rank)) run inside
// forward() and backward() on the ranks' comm streams.
struct TensorParallel {
  int degree = 1;
  // Sequence parallelism (Korthikanti et al. 2022): layernorms, residual adds and their
  // activations hold 1/degree of the rows; an all-gather enters each column-parallel matmul and a
  // reduce-scatter leaves each row-parallel one (instead of all-reduces).
  bool sequence = true;
  // Null for a model used only for its layout and memory plan (forward/backward then refuse).
  // Both must outlive the model; the comm's rank r drives device comm->device(r).
  Communicator* comm = nullptr;
  const Mesh* mesh = nullptr;
};

// `recompute` changes what the workspace keeps and what backward() re-runs, never the results.
// tp.degree > 1: GPT only (model/gpt.cc: one GPT, a plain GPT being its tensor group of one).
// activations: f32, or bf16/f16 (MLP and GPT): activations, saved tensors, activation gradients,
// logits, GEMM inputs and what the tensor collectives move in 16 bits (their sums accumulate in
// fp32 and round once per ring hop, comm/communicator.h, as Megatron sums in bf16); layernorm
// statistics, lse, losses, reductions and parameter gradients fp32 (kernels/ops.h).
std::unique_ptr<Model> make_model(const ModelConfig& config, Recompute recompute = Recompute::kNone,
                                  const TensorParallel& tp = {}, DType activations = DType::kF32);
// The activation dtype a training run's model computes in: the working dtype (bf16/f16) for every
// model (the MLP, and the GPT whole, tensor-parallel or a pipeline stage), else f32.
DType run_activation_dtype(DType working);

// A pipeline stage of GPT (GPT only; recompute not with split_backward; one sentence each), in
// fp32 or 16 bits as make_model's GPT. tp.degree > 1: built once per stage and run by every rank of
// the stage's tensor groups (each workspace finds its device's group in tp.comm/tp.mesh, so the mesh
// may have data and pipeline axes too). The contract:
//  - What crosses stages (stage_input/stage_output/stage_gradient) is the rank's part of the
//    residual stream, sent to the rank of the same tensor coordinate on the neighbouring stage:
//    with tp.sequence its rows [B*T/degree, C] (rows t*B*T/degree onward of the flattened [B*T, C]
//    activations), else all of them, [B, T, C], equal on every rank of the tensor group.
//  - layout() block b is, tensor for tensor, block logical_block(b) of make_model(config, kNone,
//    tp)'s layout, the tied LM head a copy of block 0 (its wpe part gets no gradient).
//  - backward_input runs every tensor-group collective of the backward, backward_weight none, so a
//    tensor group's collectives keep one order on every rank under zb-h1; split and fused backward
//    add the same bits.
std::unique_ptr<Model> make_gpt_stage(const ModelConfig& config, const PipelineStageSpec& stage,
                                      Recompute recompute = Recompute::kNone, const TensorParallel& tp = {},
                                      DType activations = DType::kF32);
// GPT-2's logical parameter layout (what checkpoints and exports hold): 0 embeddings (wte, wpe),
// 1..L layers, L+1 ln_f; a model's forward visits 0..L+1 then 0 again (the tied LM head).
ParamLayout gpt_layout(const ModelConfig& config);
// Its tensor indices within a layer block; GPT's LayerNorm epsilon.
enum LayerTensor { kLn1w, kLn1b, kQkvw, kQkvb, kAttprojw, kAttprojb, kLn2w, kLn2b, kFcw, kFcb, kFcprojw, kFcprojb };
constexpr float kGptLayerNormEps = 1e-5f;

}  // namespace zt
