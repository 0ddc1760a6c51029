// Every op ZeroTrain's models and optimizers use, forward and backward. One function per op,
// `Stream&` first; each checks shapes/dtypes (zt::Error naming the op and the sizes), then runs
// asynchronously through the op table of the stream's backend (kernels/op_table.h): kernels/cpu/
// (OpenBLAS + parallel_for, enqueued on the CPU stream) or kernels/cuda/ (cuBLAS + our kernels,
// launched on the CUDA stream). A backend without a kernel gets a fallback or one clear refusal.
//
// Conventions (as llm.c):
//  - Row-major, contiguous. N = rows (B*T for sequence ops), C = channels.
//  - Backward ops ACCUMULATE (+=) into every gradient output (din, dweight, dbias, ...); callers
//    zero gradient buffers when a step starts. Forward outputs are overwritten.
//  - Floating tensors are fp32 (dtype checked) except where an op says otherwise (cast,
//    accumulate, fill, add, the encoder, the position and bias ops, GELU, ReLU, the matmul family, the
//    layernorm family, the LM head, the vocabulary-parallel cross-entropy and the tiled attention
//    take f16/bf16 too); token ids/labels are int32.
//  - 16-bit activations (the ops marked "activation dtype"): f32, bf16 or f16, one dtype for all of
//    a call's activation tensors (else one sentence naming the tensor). 16-bit inputs are widened
//    exactly, the op computes in fp32 as its fp32 version does, and every 16-bit output is rounded
//    once to nearest even; a 16-bit output with += is read, added in fp32 and rounded once.
//  - Every view lives on the stream's device (view.device == stream.device().index()); leading
//    dimensions are free where a row count N is meant ([B,T,C] is N = B*T rows of C).
//  - Ops with empty outputs (zero elements) launch nothing.
//  - Results never depend on the number of CPU threads or on how work is chunked: reductions
//    across rows (dbias, dweight of layernorm, norms) use a fixed blocking and order.
#pragma once

#include <optional>

#include "core/tensor.h"
#include "runtime/stream.h"

namespace zt::ops {

// ---- elementwise / utility ------------------------------------------------
// x[:] = value, x of the activation dtype (16-bit: value rounded once, so a representable value
// is stored exactly)
void fill(Stream& s, TensorView x, float value);
// x[:] *= alpha
void scale(Stream& s, TensorView x, float alpha);
// out = a + b (out may alias a or b); out, a, b of one activation dtype
void add(Stream& s, TensorView out, ConstTensorView a, ConstTensorView b);
// dst = src converted between f32/f16/bf16 (round to nearest even); same numel.
void cast(Stream& s, TensorView dst, ConstTensorView src);
// dst += src for f32/f16/bf16 (dst and src of one dtype, same numel): each element is widened
// to fp32, added, and rounded to the storage type once (round to nearest even). For f32 the bits
// equal add(dst, dst, src). The reduction step of the collectives (src/comm/).
void accumulate(Stream& s, TensorView dst, ConstTensorView src);
// accumulate with `src` in another device's memory that s's device can read directly
// (Device::can_access_peer: always on the CPU backend, one address space; on CUDA over the link
// once peer access is enabled): the same bits as accumulate, without staging src locally. dst
// lives on s's device; the caller orders the read after src's producer with an event, and src's
// owner must not write those elements until the read is done (the ring collectives' direct path).
void accumulate_peer(Stream& s, TensorView dst, ConstTensorView src);

// ---- tensor (vocabulary) parallelism ---------------------------------------------------
// Which rows of the vocabulary a rank's embedding/LM-head shard holds: rows [begin, begin + wte rows)
// of a vocabulary of `total` ids (total 0 = the shard is the whole vocabulary, begin must be 0).
// A shard may reach past `total` (a vocabulary padded to a multiple of the shard count): ids >=
// total are padding, never a token or a target; the cross-entropy ops leave those columns out of
// the max and the sums and give them gradient 0.
struct VocabRange {
  int64_t begin = 0;
  int64_t total = 0;
};

// ---- GPT-2 encoder: token + position embedding -----------------------------
// out[b,t] = (token in [begin, begin+Vl) ? wte[token-begin] : 0) + (wpe given ? wpe[t] : 0);
// tokens [B,T] int32, wte [Vl,C] (the shard `vocab` names; the whole table by default), wpe
// [maxT,C] with T <= maxT, or an empty view (data == nullptr): no position term. Token ids outside
// [0, total) (or [0, Vl) when total == 0) are a caller bug (data loaders validate); the CPU backend
// checks them. The default `vocab` keeps the single-device behaviour bit for bit. out, wte, wpe of
// one activation dtype (the sum of the widened rows, rounded once).
void encoder_forward(Stream& s, TensorView out, ConstTensorView tokens, ConstTensorView wte,
                     ConstTensorView wpe, VocabRange vocab = {});
// dwte[token-begin] += dout[b,t] for in-range tokens only; dwpe[t] += dout[b,t] (dwpe may be an
// empty view: skipped). dwte, dwpe fp32; dout of the activation dtype (widened exactly).
void encoder_backward(Stream& s, TensorView dwte, TensorView dwpe, ConstTensorView dout,
                      ConstTensorView tokens, VocabRange vocab = {});
// x[i, :] += wpe[(row0 + i) % T, :] for x [R, C] (rows of a flattened [B, T, C] starting at global
// row row0; R need not be a multiple of T), wpe [maxT, C], T <= maxT.
void position_forward(Stream& s, TensorView x, ConstTensorView wpe, int64_t row0, int64_t T);
// dwpe[(row0 + i) % T, :] += dx[i, :] (fixed order: deterministic, independent of threads). For
// row0 = 0 and R = B*T, the bits of encoder_backward's dwpe.
// Dtypes: x, dx of the activation dtype; wpe f32 or x's dtype; dwpe fp32 (widened dx added in fp32).
void position_backward(Stream& s, TensorView dwpe, ConstTensorView dx, int64_t row0, int64_t T);

// ---- layernorm over the last dim ------------------------------------------------
// in/out [N,C]; weight/bias [C]; mean/rstd [N] are saved for backward. rstd = 1/sqrt(var + eps),
// var the biased (population) variance.
// Dtypes (the 16-bit activation path): in, out, dout and din share one activation dtype, f32, bf16
// or f16; weight and bias share one dtype, f32 or the activations'; mean, rstd, dweight and dbias
// are fp32. 16-bit values are widened exactly, the op computes as in fp32 (statistics in fp32 from
// double sums), and each 16-bit output is rounded once; din += reads din, adds in fp32 and rounds
// once. fp32 calls keep their bits.
void layernorm_forward(Stream& s, TensorView out, TensorView mean, TensorView rstd,
                       ConstTensorView in, ConstTensorView weight, ConstTensorView bias, float eps);
void layernorm_backward(Stream& s, TensorView din, TensorView dweight, TensorView dbias,
                        ConstTensorView dout, ConstTensorView in, ConstTensorView weight,
                        ConstTensorView mean, ConstTensorView rstd);

// ---- GEMM tiles (MathMode::gemm_tiles) ----------------------------------------------------------
// While the stream's device has MathMode::gemm_tiles, every 16-bit GEMM of the matmul family and of
// the LM head must have M, N and K (rows, input and output width; the LM head's vocabulary rows and
// logits row length) multiples of kGemmTileMultiple and every operand 16-byte aligned: cuBLASLt's
// tensor-core tiles with 16-byte loads. Any other is refused (zt::Error kInvalidArgument) with one
// sentence naming the op and the shape, on every backend. fp32 GEMMs are not held to it.
constexpr int64_t kGemmTileMultiple = 8;
constexpr int64_t kGemmTileAlignBytes = 16;
// 16-bit GEMM calls the check has passed, process-wide (tests: proof that a run was checked).
uint64_t gemm_tiles_checked();

// ---- matmul with bias: out[N,OC] = in[N,C] @ weight[OC,C]^T + bias[OC] -----------
// bias may be an empty view (data == nullptr): no bias. Matrix products use BLAS (CPU) / cuBLASLt
// with cuBLAS as its fallback (CUDA).
// Dtypes (kernels/matmul_types.h; the 16-bit activation path): in, weight and dout are f32 or one
// 16-bit type (bf16/f16); out, din (and the fused ops' out_gelu/pre_gelu/dpre) are f32 or that
// 16-bit type; bias is f32 or that 16-bit type; dweight and dbias are always f32 (accumulated).
// Rounding points (as cuBLASLt with CUBLAS_COMPUTE_32F): 16-bit inputs are widened exactly, the
// products accumulate in fp32, the bias (widened) is added in fp32, and a 16-bit output is rounded
// once, to nearest even; a 16-bit din is read, added to in fp32 and rounded once. fp32 inputs under
// MathMode::tf32 are rounded to TF32 first (16-bit inputs are exact in TF32).
void matmul_forward(Stream& s, TensorView out, ConstTensorView in, ConstTensorView weight,
                    ConstTensorView bias);
// din[N,C] += dout @ weight (if given: the first layer of a model needs no din);
// dweight[OC,C] += dout^T @ in (if given: a tensor-parallel model issues din first, starts its
// reduction, then the weight gradient); dbias[OC] += sum_rows(dout) (if given)
// overwrite_din: din = dout @ weight instead (the GEMM's beta is 0), for a caller whose din holds
// nothing yet: no zero-fill pass before it. The bits of zero-filling din first and accumulating,
// except that an exactly zero element may keep the product's sign (-0 where 0 + -0 gives +0).
void matmul_backward(Stream& s, TensorView din, TensorView dweight, TensorView dbias,
                     ConstTensorView dout, ConstTensorView in, ConstTensorView weight,
                     bool overwrite_din = false);

// ---- matmul + GELU: the fused epilogues of an MLP's first layer (cuBLASLt GELU_AUX_BIAS, DGELU) ----
// pre_gelu[N,OC] = in @ weight^T + bias and out_gelu = gelu(pre_gelu), both OVERWRITTEN; GELU as
// gelu_forward, applied to the fp32 sum before pre_gelu's rounding (16-bit: two roundings of one
// fp32 value). On the CPU backend, for f32, the bits of matmul_forward(pre_gelu) then
// gelu_forward(out_gelu, pre_gelu) (a GPU epilogue may differ from them in the last bits).
// pre_gelu is what backward (and a recompute of the GELU) keeps. Dtypes as matmul_forward;
// out_gelu and pre_gelu share one dtype.
void matmul_gelu_forward(Stream& s, TensorView out_gelu, TensorView pre_gelu, ConstTensorView in,
                         ConstTensorView weight, ConstTensorView bias);
// The input gradient of a matmul whose input was gelu(pre_gelu), carried through the GELU:
// dpre[N,C] = gelu'(pre_gelu) * (dout[N,OC] @ weight[OC,C]), OVERWRITTEN (not +=: the GEMM's
// epilogue writes it); dbias[C] += sum_rows(dpre) if given (the bias gradient of the layer that
// produced pre_gelu): the column sums of the stored dpre, bias_backward(dbias, dpre)'s bits, as
// every other bias gradient sums its stored output gradient (llm.c likewise; a split backward that
// takes it from matmul_backward's dbias then adds the same bits, and a 16-bit dpre needs no fp32
// bias output from cuBLASLt's epilogue, which offers none). On the CPU backend, for f32, the bits
// of matmul_backward into a zeroed buffer, gelu_backward into a zeroed dpre and bias_backward (the
// ops the GPT's MLP ran before this op existed). Dtypes as
// matmul_backward: dout/weight the input type, dpre and pre_gelu one dtype (f32 or that type).
void matmul_backward_dgelu(Stream& s, TensorView dpre, TensorView dbias, ConstTensorView dout,
                           ConstTensorView weight, ConstTensorView pre_gelu);

// x[N, C] += bias[C] (broadcast over rows). x, dout of the activation dtype; bias f32 or x's dtype;
// dbias fp32 (the widened dout summed as fp32 dout would be).
void bias_forward(Stream& s, TensorView x, ConstTensorView bias);
// dbias[C] += sum over rows of dout[N, C]. On the CPU backend the bits matmul_backward's dbias adds
// for the same dout (one column-sum kernel); on CUDA matmul_backward's comes from cuBLASLt's BGRADB
// epilogue where it serves (equal within fp32 rounding, not bitwise).
void bias_backward(Stream& s, TensorView dbias, ConstTensorView dout);

// ---- causal multi-head self-attention -------------------------------------------
// qkv [B,T,3C] (q, k, v each [B,T,C] interleaved as in GPT-2's c_attn), NH heads of size C/NH.
// preatt, att [B,NH,T,T]: scaled scores and masked softmax (entries above the diagonal are 0 in
// att, unspecified in preatt). out [B,T,C] = att @ v per head.
void attention_forward(Stream& s, TensorView out, TensorView preatt, TensorView att,
                       ConstTensorView qkv, int num_heads);
// dqkv += ...; dpreatt and datt [B,NH,T,T] are scratch (overwritten, contents unspecified after).
void attention_backward(Stream& s, TensorView dqkv, TensorView dpreatt, TensorView datt,
                        ConstTensorView dout, ConstTensorView qkv, ConstTensorView att,
                        int num_heads);

// ---- tiled (flash-style) causal attention: no T x T buffer ------------------------------------
// Same math and layout as attention_forward/backward, computed tile by tile with an online
// softmax (O(T) memory per row, only the causal half of the tiles visited), scale 1/sqrt(C/NH).
// dtypes: qkv, out, dout and dqkv share one dtype, f32 or the 16-bit activations' f16/bf16;
// lse and scratch are fp32. Math is fp32 (16-bit inputs widened exactly); each output element
// is rounded to its dtype once (dqkv: old value + gradient, then rounded).
// Where the backend has a library path for the dtype and shape it runs instead, with the same lse
// (CUDA: cuDNN's SDPA for bf16/f16; for f32 the GEMM attention below, cuBLAS on tensor cores with
// --tf32); otherwise the tiled kernel. Which one served is invisible above kernels/ except in the
// bits (each within the dtype's tolerance of float64).
// out [B,T,C]; lse [B,NH,T] (fp32) = log sum_j exp(score_tj) per row, saved for backward.
void flash_attention_forward(Stream& s, TensorView out, TensorView lse, ConstTensorView qkv,
                             int num_heads);
// How a backward op writes a gradient: kAccumulate (+=, the convention above) or kOverwrite
// (= the gradient; the old contents, even NaN, are ignored: no zero-fill pass before it).
enum class GradWrite { kAccumulate, kOverwrite };
// dqkv [B,T,3C] += (or = with kOverwrite); out and lse from flash_attention_forward; scratch: at
// least flash_attention_scratch_bytes(B, T, C, NH) bytes of fp32 (any shape), overwritten. The
// tiled kernel allocates nothing else from the device pool; a library's fused attention keeps its
// workspace (and, with kAccumulate and 16-bit dqkv, a dqkv-sized staging buffer) in one pool block
// per stream, flash_attention_library_bytes of the shape's workspaces (below), held until the
// stream is destroyed. The device's MathMode::deterministic_attention picks the library's
// backward algorithm (CUDA: cuDNN's deterministic one by default).
void flash_attention_backward(Stream& s, TensorView dqkv, ConstTensorView dout,
                              ConstTensorView qkv, ConstTensorView out, ConstTensorView lse,
                              int num_heads, TensorView scratch,
                              GradWrite write = GradWrite::kAccumulate);
// The workspace (bytes) cuDNN's fused attention asks for at (B, T, C, NH) in 16 bits, by formula,
// for the plan where no GPU can be asked (kernels/cuda/cudnn_attention.cc asks cuDNN itself):
//  - deterministic backward (cuDNN 9 on Hopper: the dP-workspace decomposition, which the frontend
//    forces for a deterministic backward): a 16-bit dP of B x NH x T64 x T128 (queries rounded up
//    to 64, keys to 128: the frontend's own size of the Hopper dP, cudnn-frontend 1.32's
//    sdpa_backward; the same as T64 x T64 wherever T64 is a multiple of 128, up to 2x above it for
//    T <= 64) plus the frontend's fp32 softmax sums, B x NH x T: B*NH*(2*T64*T128 + 4*T). Measured
//    at B=16, T=1024, 12 heads of 64 on an H200: 403,439,872 bytes, this plus 256 (at T = 16 x
//    head size it equals the B*NH*T*(8*hs + 1)*4; it grows with T^2, not T);
//  - non-deterministic backward: the frontend's fp32 dQ accumulator and softmax sums,
//    B*NH*T*(hs + 1)*4 (exactly the frontend's part: cudnn-frontend 1.32's sdpa_backward node sizes
//    dQ_accum B*NH*T*hs*4 and softmax_sum B*NH*T*4; assumed: the backend engine adds nothing; not
//    yet measured). With CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT set below the dP's size, cuDNN >=
//    9.25 on Hopper serves the deterministic backward this way too (ordered dQ, linear in T): the
//    formula then overcounts, and a plan on the GPU asks cuDNN;
//  - the forward asks for much less (assumed at most the backward's).
size_t cudnn_attention_workspace_formula(int64_t B, int64_t T, int64_t C, int64_t NH, bool deterministic);
// What a library's fused attention asks for at one shape (its graphs built now, before any CUDA
// graph capture, and kept for the run): each direction's workspace in bytes, -1 where the library
// declines that direction (the tiled kernel serves it).
struct AttentionWorkspace {
  int64_t forward = -1, backward = -1;
  bool any() const { return forward >= 0 || backward >= 0; }
};
// The fp32 library path (CUDA: kernels/cuda/gemm_attention.cu): per batch row and group of heads,
// the scores of the whole [heads, T, T] block by one batched GEMM, a row kernel for the masked
// softmax, GEMMs for the rest (the backward recomputes the scores). A group holds as many heads as
// fit gemm_attention_chunk_bytes() of fp32 scores (at least one, at most NH); the forward needs one
// such buffer, the backward two (P and dS), each rounded up to 256 bytes. Exact: nothing is asked
// of the library, so the plan's figure holds on a GPU.
constexpr size_t kGemmAttentionChunkBytes = size_t{64} << 20;
// kGemmAttentionChunkBytes unless set_gemm_attention_chunk_bytes chose another (0: the default
// again) for the whole process: a benchmark's knob (bench_ops --attention times several, to find
// the fastest on a GPU: smaller chunks keep the scores in L2 between a GEMM and the row kernel,
// at more calls), read by the plan and the kernels alike, so their figures stay equal.
size_t gemm_attention_chunk_bytes();
void set_gemm_attention_chunk_bytes(size_t bytes);
// Causal blocking of the same path: the scores in this many row blocks, each computed only up to
// its last key (kernels/gemm_attention_plan.h): 1 (the default) runs the full T x T square; 2
// skips about a quarter of the GEMMs' work and the row kernels' bytes, 4 about 3/8, at 2 or 4 times
// the calls. Another benchmark's knob (set_...(0) restores 1), measured before it becomes a default;
// the workspace does not depend on it.
int64_t gemm_attention_row_splits();
void set_gemm_attention_row_splits(int64_t splits);
int64_t gemm_attention_heads_per_chunk(int64_t T, int64_t NH);
AttentionWorkspace gemm_attention_workspace(int64_t T, int64_t NH);
// How many times, in this process, a stream's library block (kernels/cuda/stream_blocks.h: cuDNN's
// or the GEMM attention's workspace, the matmul scratch) was freed for a larger one. A captured
// graph bakes in the block's address, so train/graph_step.cc captures again when this moves; no
// path grows a block between a capture and its replays today (evaluation and sampling ask for the
// training shape's size or less), and this keeps a future one from replaying into freed memory.
// The CPU backend has no such blocks (0, unless a test calls note_stream_block_replaced).
uint64_t stream_block_generation();
void note_stream_block_replaced();
// Asks s's backend: nullopt where it has no library attention for the dtype (the CPU backend; a
// CUDA build without cuDNN for 16 bits) or the library cannot start on the device; a GPU query
// takes a fraction of a second per new 16-bit shape (f32: gemm_attention_workspace).
std::optional<AttentionWorkspace> fused_attention_workspace(Stream& s, int64_t B, int64_t T, int64_t C, int64_t NH,
                                                            DType dtype, bool deterministic);
// The pool block a library's fused attention holds per stream for a shape whose directions ask
// for `ws` (taken at the shape's first library call, freed with the stream): 0 when the library
// declines both directions, else the larger workspace rounded up to 256 bytes, then for 16 bits
// the backward's staging dqkv [B, T, 3C] of `dtype` (for GradWrite::kAccumulate; f32 GEMMs
// accumulate into dqkv themselves). The memory plan counts it on each device's compute stream.
size_t flash_attention_library_bytes(int64_t B, int64_t T, int64_t C, DType dtype, const AttentionWorkspace& ws);
// The same block by the formula (16 bits: forward 0, backward cudnn_attention_workspace_formula;
// f32: gemm_attention_workspace).
size_t flash_attention_library_bytes(int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype, bool deterministic);
// What flash_attention_backward needs as scratch: D = rowsum(dout * out) per (b, h, t), fp32.
size_t flash_attention_scratch_bytes(int64_t B, int64_t T, int64_t C, int64_t NH);

// ---- attention shapes the CUDA kernels take --------------------------------------------------
// The CUDA tiled attention (kernels/cuda/flash_attention.cu) is the fallback wherever cuDNN or the
// fp32 GEMM attention decline a call (a head size or alignment cuDNN does not take, a workspace the
// pool cannot give: decided per call, on the GPU), so every shape a CUDA run trains must fit it:
// a head's row lives in registers in compile-time buckets up to kCudaMaxHeadSize, and the heads
// are a grid dimension (at most kCudaMaxGridHeads). The CPU backend takes any head size.
constexpr int64_t kCudaMaxHeadSize = 128;
constexpr int64_t kCudaMaxGridHeads = 65535;
// decode_attention on CUDA keeps one query's scores over the cache in shared memory: a cache of at
// most this many positions (the generator's KV cache; training never calls it).
constexpr int64_t kCudaMaxDecodeKeys = 8192;
// Throws zt::Error(kInvalidArgument) with one sentence where a GPT of width C and NH heads (the
// per-rank share under tensor parallelism has the same head size) has attention the CUDA kernels
// cannot run; called before a CUDA run allocates anything (train/run_shape.cc, train/generate.cc).
void require_cuda_attention_shape(int64_t C, int64_t NH);

// ---- attention of the newest positions over a KV cache (generation) ----------------------------
// qkv [S, 3C]: the q, k, v rows of positions 0..S-1 of one sequence (c_attn's layout, as above),
// the cache of keys and values with the new positions' queries last. out [n, C] (1 <= n <= S) =
// causal attention of the last n positions: row i (position S-n+i) attends keys and values
// 0..S-n+i, scale 1/sqrt(C/NH), NH heads: rows S-n..S-1 of flash_attention_forward's out on the
// sequence qkv (equal within fp32 rounding, not bitwise: the sums run in another order).
// dtypes: qkv and out one dtype, f32, f16 or bf16; math in fp32 (16-bit inputs widened exactly),
// each output rounded once. CUDA: one block per (head, row); S is at most 8,192 (its scores sit
// in shared memory), far above GPT-2's context of 1024.
void decode_attention(Stream& s, TensorView out, ConstTensorView qkv, int num_heads);

// ---- activations ----------------------------------------------------------------
// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). gelu_forward(out,
// in) and gelu_backward(din +=, in, dout) on one activation dtype; ReLU likewise.
void gelu_forward(Stream& s, TensorView out, ConstTensorView in);
void gelu_backward(Stream& s, TensorView din, ConstTensorView in, ConstTensorView dout);
void relu_forward(Stream& s, TensorView out, ConstTensorView in);
void relu_backward(Stream& s, TensorView din, ConstTensorView in, ConstTensorView dout);

// ---- fused classifier: softmax + cross-entropy + dlogits in one pass per row ------------
// logits [N, Vp] are overwritten IN PLACE with dlogits = (softmax(logits) - onehot(target))
// * dloss when compute_grad, else left unchanged; losses[N] (fp32) = -log softmax(logits)[target]
// (nats). targets [N] int32 in [0, V); a target < 0 means "ignore": loss 0, gradient 0.
// dloss_scale (optional, one fp32 in device memory, read when the op runs): dlogits use
// dloss * *dloss_scale instead of dloss (dynamic loss scaling); losses are unaffected.
// logits dtype: f32, or bf16/f16 (the 16-bit activation path's logits): every dtype computes in
// fp32 (sums in double), losses are fp32, dlogits are rounded once to the logits' dtype.
// vocab: the real vocabulary of a padded one (vocab.begin 0, vocab.total = V <= Vp; the default
// {} = every column is real): columns [V, Vp) take no part in the max and the sums, are never a
// target, and get dlogits 0 (GPT pads GPT-2's 50257 to 50304, a multiple of 128, for aligned
// rows). One sweep reads a row for its statistics, a second writes dlogits. A backend without a
// 16-bit kernel gets the fallback: fp32 scratch from the pool, cast, the fp32 kernel, cast back.
void classifier_forward_backward(Stream& s, TensorView logits, TensorView losses,
                                 ConstTensorView targets, float dloss, bool compute_grad,
                                 const float* dloss_scale = nullptr, VocabRange vocab = {});

// ---- the LM head over a padded vocabulary: logits rows of Vp >= V columns ------------------
// logits[N, Vp][:, :V] = in[N, C] @ wte[V, C]^T (fp32; TF32 under the device's math mode, as
// matmul_forward); columns [V, Vp) are not written. logits, in, wte, dlogits and din share one
// dtype, f32, bf16 or f16 (16-bit: fp32 accumulation, each output rounded once, din += rounded
// once); dwte is fp32. With Vp == V this is matmul_forward without bias, bit for bit (backends
// without the entry fall back to it then; with Vp > V they refuse).
void lm_head_forward(Stream& s, TensorView logits, ConstTensorView in, ConstTensorView wte);
// din[N, C] += dlogits[:, :V] @ wte and dwte[V, C] += dlogits[:, :V]^T @ in (each if given, as
// matmul_backward); columns [V, Vp) of dlogits are never read.
void lm_head_backward(Stream& s, TensorView din, TensorView dwte, ConstTensorView dlogits,
                      ConstTensorView in, ConstTensorView wte);
// Columns of the LM head's logits for a vocabulary of V: V rounded up to a multiple of 128
// (GPT-2: 50257 -> 50304), so every row starts 512-byte aligned (128-bit loads, an aligned ldc).
int64_t padded_vocab(int64_t V);

// ---- vocabulary-parallel cross-entropy: three ops around two all-gathers the caller does ----
// logits f32 or the 16-bit activations' f16/bf16 (widened exactly; vocab_loss_grad's gradient is
// rounded to that dtype once); max, out, sumexp, target_logit and losses are fp32.
// With T shards of logits [N, V] (shard k holds the columns [begin_k, begin_k + Vl)):
//  1. row_max: out[i] = max_j logits[i, j] over the shard logits [N, Vl] (its real columns: -inf
//     for a shard of padding only).
void row_max(Stream& s, TensorView out, ConstTensorView logits, VocabRange vocab = {});
//  2. (caller all-gathers the T ranks' row maxima into [T, N] and reduces them with reduce_slices
//     kMax) then vocab_partials with the global row max: out [2, N] (any shape of 2N elements):
//     out[0, i] = sum_j exp(logits[i, j] - max[i])   (fixed order)
//     out[1, i] = logits[i, targets[i] - vocab.begin] if targets[i] in [begin, begin + Vl), else 0
//     targets [N] int32, < 0 = ignore (both outputs 0 then). Targets >= total (Vl when total is 0)
//     are a caller bug the CPU backend checks.
void vocab_partials(Stream& s, TensorView out, ConstTensorView logits, ConstTensorView max,
                    ConstTensorView targets, VocabRange vocab);
//  3. (caller all-gathers the partials into [T, 2N] and sums them with reduce_slices kSum) then
//     vocab_loss_grad: losses[i] = log(sumexp[i]) + max[i] - target_logit[i] (0 for ignored rows);
//     when compute_grad, logits (in place) become (exp(logits - max)/sumexp - onehot) * dloss
//     (* *dloss_scale when given, as classifier_forward_backward), onehot at targets[i] - begin when
//     in range; ignored rows get gradient 0. With one shard (the whole vocabulary) this is
//     classifier_forward_backward up to the rounding of sumexp to fp32 (about 1 ulp).
void vocab_loss_grad(Stream& s, TensorView logits, TensorView losses, ConstTensorView max,
                     ConstTensorView sumexp, ConstTensorView target_logit, ConstTensorView targets,
                     VocabRange vocab, float dloss, bool compute_grad, const float* dloss_scale = nullptr);
// out[j] = reduce over k = 0..S-1 of in[k, j] (in [S, n], out [n]), in the fixed order k = 0, 1, ...
// (fp32 adds for kSum; exact for kMax).
enum class SliceReduce { kSum, kMax };
void reduce_slices(Stream& s, TensorView out, ConstTensorView in, SliceReduce kind);

// ---- optimizers over flat fp32 buffers (one call covers a whole flat shard) ------------
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  int step;  // 1-based, for bias correction
};
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; mhat = m/(1-b1^t); vhat = v/(1-b2^t);
// p -= lr (mhat / (sqrt(vhat) + eps) + wd p). `grad_scale` multiplies g first (unscaling,
// clipping). All views [n] fp32.
void adamw_update(Stream& s, TensorView params, ConstTensorView grads, TensorView m, TensorView v,
                  const AdamWParams& hp, float grad_scale = 1.0f);
struct SgdParams {
  float lr, momentum, weight_decay;
  bool nesterov;
};
// g' = g*grad_scale + wd p; buf = momentum buf + g'; p -= lr (nesterov ? g' + momentum buf : buf)
void sgd_update(Stream& s, TensorView params, ConstTensorView grads, TensorView momentum_buf,
                const SgdParams& hp, float grad_scale = 1.0f);

// ---- reductions ------------------------------------------------------------------------
// out[0] (fp32, device memory) = sum(x^2), accumulated in a fixed order (deterministic).
void sum_squares(Stream& s, TensorView out, ConstTensorView x);
// out[0] (fp32, device memory) = sum(x), accumulated in double in a fixed order (deterministic)
// and rounded once: a micro-batch's loss summed where it was computed, read once per step.
void sum(Stream& s, TensorView out, ConstTensorView x);

// ---- fused residual add + layernorm (issue #13) -----------------------------------------------
// residual_out = a + b; ln_out = layernorm(residual_out) as layernorm_forward (weight, bias, eps;
// mean/rstd [N] saved for backward). One pass over the rows instead of two.
// Dtypes: a, b, residual_out and ln_out share one activation dtype, f32, bf16 or f16 (the 16-bit
// activation path); weight and bias share one dtype, f32 or the activations'; mean and rstd are
// fp32. In 16 bits the sum is rounded to the activation dtype once, the statistics are taken in
// fp32/double from that rounded residual (what backward reads), and ln_out is rounded once:
// exactly add, then layernorm, each storing its result.
// Bits: on every backend those of add(residual_out, a, b) followed by layernorm_forward(ln_out,
// mean, rstd, residual_out, ...) (fp32); without a kernel, fp32 falls back to that composition and
// 16 bits are refused. residual_out may alias a or b; ln_out aliases nothing.
void residual_layernorm_forward(Stream& s, TensorView residual_out, TensorView ln_out, TensorView mean,
                                TensorView rstd, ConstTensorView a, ConstTensorView b,
                                ConstTensorView weight, ConstTensorView bias, float eps);

}  // namespace zt::ops
