// parallel_for over a process-wide worker pool, used by the CPU backend's kernels. Several
// simulated devices call it concurrently; each call's caller thread works on its own range too,
// so nested or concurrent calls never deadlock. Kernels must give results that do not depend on
// how [0, n) is split (no cross-chunk floating-point reductions whose order varies).
#pragma once

#include <cstdint>
#include <functional>

namespace zt {

// Threads used by parallel_for (caller included): $ZT_NUM_THREADS, else hardware concurrency.
int parallel_threads();
// Runs fn(begin, end) over chunks of [0, n) of at least `grain` items; returns when all are done.
// Exceptions from fn are rethrown (the first one) on the calling thread.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace zt
