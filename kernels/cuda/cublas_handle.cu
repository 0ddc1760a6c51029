// The per-(GPU, stream) cuBLAS handle cache behind kernels/cuda/cublas_handle.h.
#include "kernels/cuda/cublas_handle.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "runtime/cuda/cuda_check.h"

namespace zt::cuda_ops::detail {
namespace {

// cuBLAS's recommended workspace: 32 MiB on Hopper and newer, 4 MiB before. A private workspace
// per handle keeps GEMMs on different streams from sharing one (cuBLAS's reproducibility rule).
constexpr size_t kWorkspaceBytesHopper = size_t{32} << 20;
constexpr size_t kWorkspaceBytesOlder = size_t{4} << 20;

struct Key {
  int ordinal;
  cudaStream_t stream;
  bool operator==(const Key& o) const { return ordinal == o.ordinal && stream == o.stream; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<const void*>()(k.stream) * 31u + static_cast<size_t>(k.ordinal);
  }
};

class HandleCache {
 public:
  cublasHandle_t get(cudaStream_t stream, int ordinal) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(Key{ordinal, stream});
    if (it != handles_.end()) return it->second;
    cublasHandle_t handle = create(stream, ordinal);
    handles_.emplace(Key{ordinal, stream}, handle);
    return handle;
  }

 private:
  static cublasHandle_t create(cudaStream_t stream, int ordinal) {
    cuda::DeviceGuard guard(ordinal);
    int major = 0;
    ZT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal));
    const size_t workspace_bytes = major >= 9 ? kWorkspaceBytesHopper : kWorkspaceBytesOlder;
    void* workspace = nullptr;
    ZT_CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
    cublasHandle_t handle = nullptr;
    const cublasStatus_t created = cublasCreate(&handle);
    if (created != CUBLAS_STATUS_SUCCESS) {
      (void)cudaFree(workspace);
      throw_cublas_error(created, "cublasCreate(&handle)", __FILE__, __LINE__);
    }
    // cublasSetStream resets the workspace to cuBLAS's default pool: set the stream first.
    ZT_CUBLAS_CHECK(cublasSetStream(handle, stream));
    ZT_CUBLAS_CHECK(cublasSetWorkspace(handle, workspace, workspace_bytes));
    ZT_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
    ZT_CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
    return handle;
  }

  std::mutex mu_;
  std::unordered_map<Key, cublasHandle_t, KeyHash> handles_;
};

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

cublasHandle_t cublas_handle(cudaStream_t stream, int ordinal) {
  // Leaked on purpose (see the header): usable until the very end of the process.
  static HandleCache* cache = new HandleCache();
  return cache->get(stream, ordinal);
}

}  // namespace zt::cuda_ops::detail
