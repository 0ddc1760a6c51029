// ZT_HOST_DEVICE marks per-element math shared by the CPU loops and the CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define ZT_HOST_DEVICE __host__ __device__
#define ZT_FORCEINLINE __forceinline__
#else
#define ZT_HOST_DEVICE
#define ZT_FORCEINLINE inline __attribute__((always_inline))
#endif
