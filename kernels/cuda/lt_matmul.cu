// The matmul family on cuBLASLt (kernels/ops.h): fp32 (TF32 under MathMode::tf32) or 16-bit inputs
// with fp32 accumulation (CUBLAS_COMPUTE_32F) and the epilogues that spare a pass over memory:
// BIAS (forward), GELU_AUX_BIAS (forward: pre-GELU aux and GELU output), DGELU (backward through
// the GELU; DGELU_BGRAD with the bias gradient for an fp32 output), BGRADB (the weight GEMM's bias
// gradient).
//
// Each launcher returns false, having launched nothing, when cuBLASLt refuses any of its GEMMs (no
// algorithm for the shape, dtypes, epilogue or alignments: e.g. an aux leading dimension that is
// not a multiple of 8, odd 16-bit leading dimensions, a bias-gradient type it does not write) or
// when ZT_CUBLASLT=off; kernels/cuda/op_table.cc then runs the plain cuBLAS path (blas_ops.cu),
// and the first refusal of each kind of GEMM says so in one line on stderr.
// The heuristic runs once per problem and stream (cublas_handle.h GemmContext::lt_algos) and is
// told the stream's pool workspace, so every algorithm it picks fits in it.
//
// cuBLASLt writes bias gradients (it does not add): they go to a scratch and are added to dbias
// (ops.h's "+="). GEMMs whose result accumulates (din, dweight) run with beta = 1.
// Row-major <-> column-major as in blas_ops.cu: the row-major product Y = A @ B is the
// column-major Y^T = B^T A^T, operands swapped.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"

namespace zt::cuda_ops {
namespace {

using detail::gemm_context;
using detail::GemmContext;
using detail::LtAlgo;
using detail::LtKey;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// The largest power of two (up to 256) dividing the address: the heuristic's answer depends on it.
int64_t alignment(const void* p) {
  if (p == nullptr) return 256;
  const auto a = reinterpret_cast<uintptr_t>(p);
  int64_t align = 1;
  while (align < 256 && (a & static_cast<uintptr_t>(align)) == 0) align *= 2;
  return align;
}

// One column-major GEMM D = op(A) op(B) + beta D (C is D) with its epilogue.
struct LtGemm {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* D = nullptr;
  int64_t ldd = 0;
  cudaDataType_t ab = CUDA_R_32F, d = CUDA_R_32F;
  float beta = 0.0f;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // bias, or the bias gradient it writes
  cudaDataType_t bias_type = CUDA_R_32F;
  const void* aux = nullptr;  // pre-GELU: written by GELU_AUX_BIAS, read by DGELU
  int64_t aux_ld = 0;
  bool tf32 = false;
};

// Descriptors of one call; destroyed with it (host-side objects, cheap to make).
class LtDescs {
 public:
  explicit LtDescs(const LtGemm& g) {
    const bool fast = g.tf32 && g.ab == CUDA_R_32F;
    ZT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, fast ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F));
    set(CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(g.ta));
    set(CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(g.tb));
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(g.epilogue));
    if (g.bias != nullptr) {
      set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
      set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(g.bias_type));
    }
    if (g.aux != nullptr) {
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, static_cast<int32_t>(g.d));
    }
    const bool an = g.ta == CUBLAS_OP_N, bn = g.tb == CUBLAS_OP_N;
    ZT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_, g.ab, an ? g.m : g.k, an ? g.k : g.m, g.lda));
    ZT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_, g.ab, bn ? g.k : g.n, bn ? g.n : g.k, g.ldb));
    ZT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d_, g.d, g.m, g.n, g.ldd));
  }
  ~LtDescs() {
    if (d_ != nullptr) (void)cublasLtMatrixLayoutDestroy(d_);
    if (b_ != nullptr) (void)cublasLtMatrixLayoutDestroy(b_);
    if (a_ != nullptr) (void)cublasLtMatrixLayoutDestroy(a_);
    if (op_ != nullptr) (void)cublasLtMatmulDescDestroy(op_);
  }
  LtDescs(const LtDescs&) = delete;
  LtDescs& operator=(const LtDescs&) = delete;

  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;

 private:
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, attr, &value, sizeof(value)));
  }
};

LtKey key_of(const LtGemm& g) {
  return LtKey{g.ta, g.tb, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.ab, g.d, g.beta == 0.0f ? 0 : 1,
               static_cast<int64_t>(g.epilogue), g.bias != nullptr ? g.bias_type + 1 : 0, g.aux_ld, g.tf32 ? 1 : 0,
               alignment(g.A), alignment(g.B), alignment(g.D), alignment(g.bias), alignment(g.aux), 0, 0, 0, 0};
}

const char* type_name(cudaDataType_t t) {
  return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "fp16" : t == CUDA_R_32F ? "fp32" : "other";
}

const char* epilogue_name(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT:
      return "plain";
    case CUBLASLT_EPILOGUE_BIAS:
      return "BIAS";
    case CUBLASLT_EPILOGUE_GELU_AUX:
      return "GELU_AUX";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
      return "GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU:
      return "DGELU";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD:
      return "DGELU_BGRAD";
    case CUBLASLT_EPILOGUE_BGRADB:
      return "BGRADB";
    default:
      return "other";
  }
}

// The process's one stderr line per kind of GEMM (epilogue, types) that cuBLASLt refuses: the
// plain cuBLAS path then runs it, slower (an unfused epilogue, an fp32 scratch for 16-bit outputs),
// which a GPU run's log should show without a profiler. ZT_CUBLASLT=off refuses silently.
void note_refusal(const LtGemm& g, cublasStatus_t status, int found) {
  static std::mutex mu;
  static std::set<std::tuple<int, int, int, int, int>> noted;
  const std::lock_guard<std::mutex> lock(mu);
  const int bias = g.bias != nullptr ? static_cast<int>(g.bias_type) : -1;
  if (!noted.insert({static_cast<int>(g.epilogue), static_cast<int>(g.ab), static_cast<int>(g.d), bias, g.tf32 ? 1 : 0})
           .second)
    return;
  std::fprintf(stderr,
               "note: cuBLASLt has no kernel for a %s GEMM (A/B %s%s, D %s%s%s, m %lld n %lld k %lld: %s); the plain "
               "cuBLAS path runs this kind of GEMM instead (slower)\n",
               epilogue_name(g.epilogue), type_name(g.ab), g.tf32 ? " tf32" : "", type_name(g.d),
               bias >= 0 ? ", bias " : "", bias >= 0 ? type_name(g.bias_type) : "", static_cast<long long>(g.m),
               static_cast<long long>(g.n), static_cast<long long>(g.k),
               status != CUBLAS_STATUS_SUCCESS ? cublasGetStatusName(status)
               : found == 0                    ? "no algorithm"
                                               : "the algorithm found cannot run it");
}

// The bias-gradient epilogues write into the workspace's tail (kLtBiasScratchBytes: 65,536 fp32
// columns); a wider bias (a 4C of more than 65,536) takes the plain path for that GEMM, said once.
bool bias_fits(const GemmContext& ctx, int64_t columns) {
  if (lt_bias_scratch_bytes(columns) <= ctx.bias_scratch_bytes) return true;
  static std::atomic<bool> noted{false};
  if (!noted.exchange(true))
    std::fprintf(stderr,
                 "note: cuBLASLt's bias-gradient epilogue writes %lld columns, more than its %zu-byte scratch holds; "
                 "the plain cuBLAS path runs these GEMMs instead (slower)\n",
                 static_cast<long long>(columns), ctx.bias_scratch_bytes);
  return false;
}

// The cached algorithm for g, asking the heuristic the first time; nullptr: cuBLASLt refuses g.
// A heuristic that fails while `stream` captures fails the capture instead (zt::Error, nothing
// cached, nothing launched): inside a capture the failure may be the capture's (CUDA 13.3's
// cuBLASLt cannot read a capturing stream's context, vllm.cpp#1732), and a cached refusal would run
// this GEMM, and every later one of its key, on the plain cuBLAS path, whose bits are not the eager
// run's. --cuda-graphs asks every key eagerly first (its warm-up micro-batch; tests/train/
// test_operand_alignment.cc checks that no library call is first met inside a capture).
const cublasLtMatmulAlgo_t* find_algo(const GemmContext& ctx, cudaStream_t stream, const LtGemm& g) {
  const LtKey key = key_of(g);
  auto it = ctx.lt_algos->find(key);
  if (it == ctx.lt_algos->end()) {
    LtAlgo entry;
    const LtDescs desc(g);
    cublasLtMatmulPreference_t pref = nullptr;
    ZT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx.workspace_bytes;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t status =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    // The operands' alignments, told to the heuristic: it may then pick kernels with 16-byte
    // (vectorised, tensor-core) loads, and never one that needs more than the pointers have. The
    // key holds the same alignments, so a cached algorithm is reused only where it is valid.
    const uint32_t align_a = static_cast<uint32_t>(alignment(g.A)), align_b = static_cast<uint32_t>(alignment(g.B)),
                   align_d = static_cast<uint32_t>(alignment(g.D));
    for (const auto& [attr, value] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
                                      std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
                                      std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
                                      std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}})
      if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
    // A 16-bit D is rounded once from the fp32 sum (ops.h): split-K partials are reduced in the
    // compute type, never added up in D's type (INPLACE, OUTPUT_TYPE), as the cuBLAS handle's
    // CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION does for the plain path. An fp32 D keeps them all.
    const uint32_t reductions = g.d == CUDA_R_32F ? static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_MASK)
                                                  : static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE) |
                                                        static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                                    sizeof(reductions));
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(ctx.lt, desc.op_, desc.a_, desc.b_, desc.d_, desc.d_, pref, 1, &result,
                                              &found);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    // NOT_SUPPORTED / INVALID_VALUE / no result: cuBLASLt has no kernel for this problem.
    entry.usable = status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (!entry.usable && cuda::stream_capturing(stream))
      ZT_THROW(ErrorKind::kDevice, "cuBLASLt's heuristic, first asked for a ", epilogue_name(g.epilogue), " GEMM (A/B ",
               type_name(g.ab), ", D ", type_name(g.d), ", m ", g.m, " n ", g.n, " k ", g.k,
               ") inside a stream capture, found no algorithm (",
               status != CUBLAS_STATUS_SUCCESS ? cublasGetStatusName(status) : "no result",
               "); run the GEMM once outside the capture first");
    if (entry.usable) entry.algo = result.algo;
    if (!entry.usable) note_refusal(g, status, found);
    it = ctx.lt_algos->emplace(key, entry).first;
  }
  return it->second.usable ? &it->second.algo : nullptr;
}

void run(const GemmContext& ctx, cudaStream_t stream, const LtGemm& g, const cublasLtMatmulAlgo_t* algo) {
  const LtDescs desc(g);
  const float alpha = 1.0f;
  ZT_CUBLAS_CHECK(cublasLtMatmul(ctx.lt, desc.op_, &alpha, g.A, desc.a_, g.B, desc.b_, &g.beta, g.D, desc.d_, g.D,
                                 desc.d_, algo, ctx.workspace, ctx.workspace_bytes, stream));
}

// dst[i] += src[i]: the bias gradient cuBLASLt wrote, added under ops.h's "+=".
__global__ void add_into_kernel(float* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] += src[i];
}

void add_into(cudaStream_t stream, float* dst, const float* src, int64_t n) {
  add_into_kernel<<<detail::grid_for(n), detail::kElementwiseBlock, 0, stream>>>(dst, src, n);
  ZT_CUDA_CHECK(cudaGetLastError());
}

// Forward: out^T[OC,N] = W[OC,C] (W^T stored, op T) * in^T[C,N]; bias per row of out^T.
LtGemm forward_gemm(void* out, const void* in, const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC,
                    bool tf32) {
  LtGemm g;
  g.ta = CUBLAS_OP_T, g.tb = CUBLAS_OP_N;
  g.m = OC, g.n = N, g.k = C;
  g.A = weight, g.lda = C, g.B = in, g.ldb = C, g.D = out, g.ldd = OC;
  g.ab = cuda_type(t.in), g.d = cuda_type(t.out), g.tf32 = tf32;
  return g;
}

// din^T[C,N] (+)= W^T[C,OC] (W stored [OC,C] = column-major [C,OC]) * dout^T[OC,N].
LtGemm din_gemm(void* din, const void* dout, const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC,
                bool tf32, float beta) {
  LtGemm g;
  g.m = C, g.n = N, g.k = OC;
  g.A = weight, g.lda = C, g.B = dout, g.ldb = OC, g.D = din, g.ldd = C;
  g.ab = cuda_type(t.in), g.d = cuda_type(t.out), g.beta = beta, g.tf32 = tf32;
  return g;
}

}  // namespace

size_t lt_bias_scratch_bytes(int64_t n) { return static_cast<size_t>((n + 63) / 64 * 64) * sizeof(float); }

bool lt_matmul_forward(void* stream, void* out, const void* in, const void* weight, const void* bias, MatmulTypes t,
                       int64_t N, int64_t C, int64_t OC, bool tf32) {
  detail::LaunchScope scope(stream);
  const GemmContext ctx = gemm_context(scope.stream());
  if (ctx.lt == nullptr) return false;
  LtGemm g = forward_gemm(out, in, weight, t, N, C, OC, tf32);
  if (bias != nullptr) g.epilogue = CUBLASLT_EPILOGUE_BIAS, g.bias = bias, g.bias_type = cuda_type(t.bias);
  const cublasLtMatmulAlgo_t* algo = find_algo(ctx, scope.stream(), g);
  if (algo == nullptr) return false;
  run(ctx, scope.stream(), g, algo);
  return true;
}

bool lt_matmul_gelu_forward(void* stream, void* out_gelu, void* pre_gelu, const void* in, const void* weight,
                            const void* bias, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32) {
  detail::LaunchScope scope(stream);
  const GemmContext ctx = gemm_context(scope.stream());
  if (ctx.lt == nullptr) return false;
  LtGemm g = forward_gemm(out_gelu, in, weight, t, N, C, OC, tf32);
  g.epilogue = bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  g.bias = bias, g.bias_type = cuda_type(t.bias);
  g.aux = pre_gelu, g.aux_ld = OC;
  const cublasLtMatmulAlgo_t* algo = find_algo(ctx, scope.stream(), g);
  if (algo == nullptr) return false;
  run(ctx, scope.stream(), g, algo);
  return true;
}

bool lt_matmul_backward(void* stream, void* din, float* dweight, float* dbias, const void* dout, const void* in,
                        const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool overwrite_din,
                        bool tf32) {
  detail::LaunchScope scope(stream);
  const GemmContext ctx = gemm_context(scope.stream());
  if (ctx.lt == nullptr) return false;
  if (dbias != nullptr && !bias_fits(ctx, OC)) return false;
  float* const bias_scratch = ctx.bias_scratch;
  // Every GEMM's algorithm first: a refusal must come before anything is launched.
  const LtGemm gd = din_gemm(din, dout, weight, t, N, C, OC, tf32, overwrite_din ? 0.0f : 1.0f);
  // dweight^T[C,OC] += in^T[C,N] * dout[N,OC] (dout^T stored, op T); BGRADB sums op(B) over k = N:
  // the bias gradient, written to the scratch.
  LtGemm gw;
  gw.tb = CUBLAS_OP_T;
  gw.m = C, gw.n = OC, gw.k = N;
  gw.A = in, gw.lda = C, gw.B = dout, gw.ldb = OC, gw.D = dweight, gw.ldd = C;
  gw.ab = cuda_type(t.in), gw.d = CUDA_R_32F, gw.beta = 1.0f, gw.tf32 = tf32;
  // Under TF32 the epilogue might sum the rounded operand; ops.h sums dout unrounded, so the bias
  // gradient then comes from the plain path's column sums (same bits as bias_backward).
  const bool bgradb = dbias != nullptr && !(tf32 && t.in == DType::kF32);
  if (bgradb) gw.epilogue = CUBLASLT_EPILOGUE_BGRADB, gw.bias = bias_scratch, gw.bias_type = CUDA_R_32F;
  const cublasLtMatmulAlgo_t* ad = din != nullptr ? find_algo(ctx, scope.stream(), gd) : nullptr;
  if (din != nullptr && ad == nullptr) return false;
  // A bias gradient without a weight gradient has no GEMM to ride on: the plain path's column sums.
  if (dweight == nullptr && dbias != nullptr) return false;
  const cublasLtMatmulAlgo_t* aw = dweight != nullptr ? find_algo(ctx, scope.stream(), gw) : nullptr;
  if (dweight != nullptr && aw == nullptr) return false;
  if (din != nullptr) run(ctx, scope.stream(), gd, ad);
  if (dweight != nullptr) {
    run(ctx, scope.stream(), gw, aw);
    if (bgradb) add_into(scope.stream(), dbias, bias_scratch, OC);
  }
  if (dbias != nullptr && !bgradb) bias_backward(stream, dbias, dout, t.in, N, OC);
  return true;
}

bool lt_matmul_backward_dgelu(void* stream, void* dpre, float* dbias, const void* dout, const void* weight,
                              const void* pre_gelu, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32) {
  detail::LaunchScope scope(stream);
  const GemmContext ctx = gemm_context(scope.stream());
  if (ctx.lt == nullptr) return false;
  // dpre^T[C,N] = dgelu(W^T dout^T, pre^T). The bias gradient is the stored dpre's column sums
  // (ops.h). cuBLASLt's DGELU_BGRAD writes it in dpre's type (its bias output is D's type, the
  // exceptions being integer and fp8 kernels): for an fp32 dpre the epilogue sums it; a 16-bit dpre
  // takes DGELU alone and bias_backward's column sums of its stored values (one read of dpre).
  const bool bgrad = dbias != nullptr && t.out == DType::kF32;
  if (bgrad && !bias_fits(ctx, C)) return false;
  float* const bias_scratch = ctx.bias_scratch;
  LtGemm g = din_gemm(dpre, dout, weight, t, N, C, OC, tf32, 0.0f);
  g.epilogue = bgrad ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  g.aux = pre_gelu, g.aux_ld = C;
  if (bgrad) g.bias = bias_scratch, g.bias_type = CUDA_R_32F;
  const cublasLtMatmulAlgo_t* algo = find_algo(ctx, scope.stream(), g);
  if (algo == nullptr) return false;
  run(ctx, scope.stream(), g, algo);
  if (bgrad) add_into(scope.stream(), dbias, bias_scratch, C);
  if (dbias != nullptr && !bgrad) bias_backward(stream, dbias, dpre, t.out, N, C);
  return true;
}

// The LM head over logits rows of ld >= V elements (ops.h lm_head_forward/backward): the matmul
// GEMMs with the logits' leading dimension ld (the padded vocabulary; V == ld for the GPT, whose
// wte holds the padded rows), no bias. din and dwte accumulate (beta 1).
bool lt_lm_head_forward(void* stream, void* logits, const void* in, const void* wte, DType act, int64_t N, int64_t C,
                        int64_t V, int64_t ld, bool tf32) {
  detail::LaunchScope scope(stream);
  const GemmContext ctx = gemm_context(scope.stream());
  if (ctx.lt == nullptr) return false;
  const MatmulTypes t{act, act, act};
  LtGemm g = forward_gemm(logits, in, wte, t, N, C, V, tf32);
  g.ldd = ld;
  const cublasLtMatmulAlgo_t* algo = find_algo(ctx, scope.stream(), g);
  if (algo == nullptr) return false;
  run(ctx, scope.stream(), g, algo);
  return true;
}

bool lt_lm_head_backward(void* stream, void* din, float* dwte, const void* dlogits, const void* in, const void* wte,
                         DType act, int64_t N, int64_t C, int64_t V, int64_t ld, bool tf32) {
  detail::LaunchScope scope(stream);
  const GemmContext ctx = gemm_context(scope.stream());
  if (ctx.lt == nullptr) return false;
  const MatmulTypes t{act, act, act};
  LtGemm gd = din_gemm(din, dlogits, wte, t, N, C, V, tf32, 1.0f);
  gd.ldb = ld;
  // dwte^T[C,V] += in^T[C,N] * dlogits[N,V] (dlogits^T stored with ld, op T)
  LtGemm gw;
  gw.tb = CUBLAS_OP_T;
  gw.m = C, gw.n = V, gw.k = N;
  gw.A = in, gw.lda = C, gw.B = dlogits, gw.ldb = ld, gw.D = dwte, gw.ldd = C;
  gw.ab = cuda_type(act), gw.d = CUDA_R_32F, gw.beta = 1.0f, gw.tf32 = tf32;
  // Both algorithms first: a refusal must come before anything is launched.
  const cublasLtMatmulAlgo_t* ad = din != nullptr ? find_algo(ctx, scope.stream(), gd) : nullptr;
  if (din != nullptr && ad == nullptr) return false;
  const cublasLtMatmulAlgo_t* aw = dwte != nullptr ? find_algo(ctx, scope.stream(), gw) : nullptr;
  if (dwte != nullptr && aw == nullptr) return false;
  if (din != nullptr) run(ctx, scope.stream(), gd, ad);
  if (dwte != nullptr) run(ctx, scope.stream(), gw, aw);
  return true;
}

}  // namespace zt::cuda_ops
