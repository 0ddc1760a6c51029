// The per-stream cuBLAS handle behind kernels/cuda/cublas_handle.h: a StreamResource of the
// stream (runtime/cuda/cuda_backend.h) whose workspace is a block of the device pool.
#include "kernels/cuda/cublas_handle.h"

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "memory/caching_allocator.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace zt::cuda_ops::detail {
namespace {

class CublasResource final : public cuda::StreamResource {
 public:
  explicit CublasResource(Stream& stream) : pool_(stream.device().memory()) {
    const size_t bytes = stream.device().gemm_workspace_bytes();
    bytes_ = bytes;
    // Allocated on this stream and only used by it: the pool's stream rules need no event.
    workspace_ = pool_.allocate(bytes, stream, "cuBLAS workspace");
    try {
      ZT_CUBLAS_CHECK(cublasCreate(&handle_));
      // cublasSetStream resets the workspace to cuBLAS's default pool: set the stream first.
      ZT_CUBLAS_CHECK(cublasSetStream(handle_, static_cast<cudaStream_t>(stream.native_handle())));
      ZT_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, bytes));
      ZT_CUBLAS_CHECK(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
      // A 16-bit output is rounded once from the fp32 sum (kernels/ops.h): split-K partials are
      // never reduced in the output's type. fp32 outputs are unaffected.
      ZT_CUBLAS_CHECK(cublasSetMathMode(
          handle_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
      const char* lt = std::getenv("ZT_CUBLASLT");
      if (lt == nullptr || std::strcmp(lt, "off") != 0) ZT_CUBLAS_CHECK(cublasLtCreate(&lt_));
    } catch (...) {
      release();
      throw;
    }
  }
  // Runs with the stream drained (StreamResource's contract): nothing uses the workspace any more.
  ~CublasResource() override { release(); }
  CublasResource(const CublasResource&) = delete;
  CublasResource& operator=(const CublasResource&) = delete;

  cublasHandle_t handle() const { return handle_; }
  GemmContext context() {
    // kMinStreamWorkspace (4 MiB) >= 2 x kLtBiasScratchBytes: the tail always fits.
    const size_t tail = kLtBiasScratchBytes;
    return GemmContext{lt_, workspace_, bytes_ - tail, &lt_algos_,
                       reinterpret_cast<float*>(static_cast<char*>(workspace_) + (bytes_ - tail)), tail};
  }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return bytes_; }

 private:
  void release() noexcept {
    if (lt_ != nullptr) (void)cublasLtDestroy(lt_);
    lt_ = nullptr;
    if (handle_ != nullptr) (void)cublasDestroy(handle_);
    handle_ = nullptr;
    if (workspace_ != nullptr) {
      try {
        pool_.free(workspace_);
      } catch (...) {  // a failed device's pool: its memory goes with the pool anyway
      }
    }
    workspace_ = nullptr;
    (void)cudaGetLastError();
  }

  CachingAllocator& pool_;
  void* workspace_ = nullptr;
  size_t bytes_ = 0;
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::map<LtKey, LtAlgo> lt_algos_;
};

std::unique_ptr<cuda::StreamResource> make_cublas(Stream& stream) {
  return std::make_unique<CublasResource>(stream);
}

}  // namespace

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    device = -1;
    (void)cudaGetLastError();
  }
  ::zt::detail::throw_error(
      ErrorKind::kDevice, file, line,
      ::zt::detail::concat("cuBLAS call ", call, " failed on GPU ", device, ": ",
                           cublasGetStatusName(status), " (", cublasGetStatusString(status), ")"));
}

cublasHandle_t cublas_handle(cudaStream_t stream) {
  auto& r = static_cast<CublasResource&>(cuda::stream_resource(stream, cuda::kCublasResource, &make_cublas));
  return r.handle();
}

GemmContext gemm_context(cudaStream_t stream) {
  auto& r = static_cast<CublasResource&>(cuda::stream_resource(stream, cuda::kCublasResource, &make_cublas));
  return r.context();
}

void* stream_workspace(cudaStream_t stream, size_t* bytes) {
  auto& r = static_cast<CublasResource&>(cuda::stream_resource(stream, cuda::kCublasResource, &make_cublas));
  ZT_CHECK(r.workspace() != nullptr && r.workspace_bytes() >= kMinStreamWorkspace, "the stream's cuBLAS workspace holds ",
           r.workspace_bytes(), " bytes, fewer than the ", kMinStreamWorkspace, " its kernels may use as scratch");
  *bytes = r.workspace_bytes();
  return r.workspace();
}

int cublas_int(int64_t v, const char* what) {
  ZT_CHECK(v >= 0 && v <= INT_MAX, "cuBLAS dimension ", what, " = ", v, " does not fit in int");
  return static_cast<int>(v);
}

void gemm_strided_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
                          int64_t k, float alpha, const float* A, int64_t lda, int64_t stride_a, const float* B,
                          int64_t ldb, int64_t stride_b, float beta, float* C, int64_t ldc, int64_t stride_c,
                          int64_t batch, bool tf32) {
  ZT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, ta, tb, cublas_int(m, "m"), cublas_int(n, "n"), cublas_int(k, "k"), &alpha, A, CUDA_R_32F,
      cublas_int(lda, "lda"), stride_a, B, CUDA_R_32F, cublas_int(ldb, "ldb"), stride_b, &beta, C, CUDA_R_32F,
      cublas_int(ldc, "ldc"), stride_c, cublas_int(batch, "batch"),
      tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace zt::cuda_ops::detail
