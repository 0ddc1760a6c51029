// cuBLAS's recommended workspace per stream by GPU generation: the CUDA devices' gemm_workspace_bytes()
// and the memory plan of GPUs this machine does not have (train/plan.h plan_absent_gpus) read it here.
#pragma once

#include <cstddef>

namespace zt::cuda {

// 32 MiB on Hopper (compute capability 9) and newer, 4 MiB before.
constexpr size_t recommended_gemm_workspace_bytes(int major) { return major >= 9 ? size_t{32} << 20 : size_t{4} << 20; }

}  // namespace zt::cuda
