// fp32 causal attention through cuBLAS (kernels/ops.h flash_attention_* contract; #28 item 7): the
// products on tensor cores (TF32 when the device's MathMode says so, --tf32) or as true fp32 GEMMs,
// instead of the tiled kernel's CUDA-core dot products. Per batch row b and group of heads
// (ops::gemm_attention_heads_per_chunk: the group's [heads, T, T] fp32 scores fit
// ops::gemm_attention_chunk_bytes()):
//   forward:  S = scale Q K^T (one strided-batched GEMM over the group's heads, full T x T, or per
//             causal row block up to its last key: ops::gemm_attention_row_splits), a row
//             kernel: P = causal softmax of S in place (zero above the diagonal) and lse; O = P V.
//   backward: S again; dP = dO V^T; a row kernel: D = rowsum(dO * O), P = exp(S - lse) (zero above
//             the diagonal), dS = P (dP - D), in place; dV = P^T dO, dQ = scale dS K, dK = scale
//             dS^T Q (beta 1 accumulates into dqkv, beta 0 overwrites without reading it).
// The GEMMs' parameters come from kernels/gemm_attention_plan.h, which a CPU test runs through a
// float64 reference GEMM. Twice the causal half's FLOPs by default (the GEMMs run the full square;
// with s row splits (s + 1) / (2 s) of the square), at tensor-core speed. The score buffers are
// the stream's attention block (stream_blocks.h, ops::flash_attention_library_bytes for f32):
// taken by available() at the shape's first call (eager, before any capture), so a launch
// allocates nothing. Deterministic: cuBLAS is bit-reproducible on one stream and workspace, the
// row kernels sum in a fixed order. lse is the tiled kernels' and cuDNN's (log-sum-exp of the
// scaled scores), so a forward of one path and a backward of another pair up.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <tuple>

#include "core/status.h"
#include "kernels/cuda/stream_blocks.h"
#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"
#include "kernels/gemm_attention_plan.h"
#include "kernels/ops.h"

namespace zt::cuda_ops {
namespace {

using detail::gemm_strided_batched;
using detail::kWarpSize;

// Below this T a declined shape costs little on the tiled kernel: no line about it.
constexpr int64_t kAnnounceFallbackFromT = 256;

// The backward's row kernel over one chunk: S [rows, T] (scaled scores) becomes P = exp(S - lse)
// (0 above the diagonal) and dP [rows, T] becomes dS = P (dP - D), D = sum_c dout[i, c] out[i, c]
// over the row's head (double), over the row's first row_width columns (its row block's end,
// gemm_attention_plan.h; the GEMMs wrote nothing past it). out, dout: the chunk's first head in
// [T, C]-strided rows.
__global__ void softmax_backward_rows_kernel(float* __restrict__ S, float* __restrict__ dP,
                                             const float* __restrict__ lse, const float* __restrict__ out,
                                             const float* __restrict__ dout, int64_t rows, int64_t T, int64_t C,
                                             int64_t hs, int64_t row_block) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * detail::kWarpRowsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * detail::kWarpRowsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += warps) {
    const int64_t h = r / T, i = r % T;
    const float* o = out + i * C + h * hs;
    const float* dy = dout + i * C + h * hs;
    double d = 0.0;
    for (int64_t c = lane; c < hs; c += kWarpSize) d += static_cast<double>(dy[c]) * o[c];
    const float D = static_cast<float>(detail::warp_sum(d));
    const float L = lse[r];
    float* p = S + r * T;
    float* g = dP + r * T;
    const int64_t width = zt::gemm_attention::row_width(i, T, row_block);
    for (int64_t j = lane; j < width; j += kWarpSize) {
      const float pj = j <= i ? exp_elem(p[j] - L) : 0.0f;
      const float dpj = g[j];
      p[j] = pj;
      g[j] = pj * (dpj - D);
    }
  }
}

namespace plan = zt::gemm_attention;

// Device pointers of the plan's buffers (inputs cast to float*: cuBLAS only reads them).
using Buffers = std::array<float*, 6>;
float* ptr(const Buffers& p, const plan::Operand& o) { return p[static_cast<size_t>(o.buf)] + o.offset; }

void run(cublasHandle_t h, const plan::Gemm& g, const Buffers& p, bool tf32) {
  gemm_strided_batched(h, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N, g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, g.m, g.n, g.k, g.alpha,
                       ptr(p, g.a), g.a.ld, g.a.stride, ptr(p, g.b), g.b.ld, g.b.stride, g.beta, ptr(p, g.c), g.c.ld,
                       g.c.stride, g.batch, tf32);
}

plan::Dims dims(int64_t B, int64_t T, int64_t C, int64_t NH) {
  return plan::dims(B, T, C, NH, ops::gemm_attention_heads_per_chunk(T, NH), ops::gemm_attention_row_splits());
}
// Bytes of one chunk's score buffer, rounded up to 256: the second buffer starts there.
size_t score_bytes(int64_t T, int64_t NH) { return static_cast<size_t>(ops::gemm_attention_workspace(T, NH).forward); }

// Shapes (GPU, T, NH, chunk bytes: what the block's size depends on) whose block the pool could
// not give: declined for the run.
struct Declined {
  std::mutex mu;
  std::set<std::tuple<int, int64_t, int64_t, size_t>> shapes;
  bool announced = false;
};
Declined& declined() {
  static Declined* d = new Declined;  // leaked: used until the process ends
  return *d;
}

}  // namespace

bool gemm_attention_available(Stream& s, void* native, int64_t B, int64_t T, int64_t C, int64_t NH) {
  const auto key = std::make_tuple(cuda::stream_ordinal(native), T, NH, ops::gemm_attention_chunk_bytes());
  Declined& dc = declined();
  {
    const std::lock_guard<std::mutex> lock(dc.mu);
    if (dc.shapes.count(key) != 0) return false;
  }
  const size_t bytes = ops::flash_attention_library_bytes(B, T, C, DType::kF32, ops::gemm_attention_workspace(T, NH));
  try {
    detail::stream_block(s, native, detail::StreamBlock::kAttention, bytes);
    return true;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kOutOfMemory) throw;
  }
  const std::lock_guard<std::mutex> lock(dc.mu);
  dc.shapes.insert(key);
  if (T >= kAnnounceFallbackFromT && !dc.announced) {
    dc.announced = true;
    std::fprintf(stderr,
                 "attention: the fp32 GEMM attention's score buffers (%zu bytes) do not fit in the pool at B=%lld "
                 "T=%lld heads=%lld; the tiled kernel runs instead (CUDA cores, no tensor cores)\n",
                 bytes, static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(NH));
  }
  return false;
}

void gemm_attention_forward(Stream& s, void* native, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                            int64_t C, int64_t NH, bool tf32) {
  const plan::Dims d = dims(B, T, C, NH);
  detail::LaunchScope scope(native);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  auto* S = static_cast<float*>(
      detail::stream_block(s, native, detail::StreamBlock::kAttention, 2 * score_bytes(T, NH)));
  const Buffers p{const_cast<float*>(qkv), out, nullptr, nullptr, S, nullptr};
  for (const plan::Chunk& c : plan::chunks(d)) {
    const plan::Phases g = plan::forward_gemms(d, c);
    for (const plan::Gemm& gemm : g.before) run(h, gemm, p, tf32);
    causal_softmax(scope.stream(), S, S, lse + c.lse_offset(d), c.nh * T, T, d.row_block);  // P in place, lse
    for (const plan::Gemm& gemm : g.after) run(h, gemm, p, tf32);
  }
}

void gemm_attention_backward(Stream& s, void* native, float* dqkv, const float* dout, const float* qkv,
                             const float* out, const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                             bool tf32, bool accumulate) {
  const plan::Dims d = dims(B, T, C, NH);
  detail::LaunchScope scope(native);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  const size_t scores = score_bytes(T, NH);
  auto* block = static_cast<char*>(detail::stream_block(s, native, detail::StreamBlock::kAttention, 2 * scores));
  auto* P = reinterpret_cast<float*>(block);
  auto* G = reinterpret_cast<float*>(block + scores);  // dP, then dS
  const Buffers p{const_cast<float*>(qkv), const_cast<float*>(out), const_cast<float*>(dout), dqkv, P, G};
  for (const plan::Chunk& c : plan::chunks(d)) {
    const plan::Phases g = plan::backward_gemms(d, c, accumulate);
    for (const plan::Gemm& gemm : g.before) run(h, gemm, p, tf32);
    softmax_backward_rows_kernel<<<detail::warp_row_grid(c.nh * T), detail::kWarpRowBlock, 0, scope.stream()>>>(
        P, G, lse + c.lse_offset(d), out + c.head_offset(d), dout + c.head_offset(d), c.nh * T, T, C, d.hs,
        d.row_block);
    ZT_CUDA_CHECK(cudaGetLastError());
    for (const plan::Gemm& gemm : g.after) run(h, gemm, p, tf32);
  }
}

}  // namespace zt::cuda_ops
