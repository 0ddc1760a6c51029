// Progress heartbeats for the hang watchdog (train/world.h, run_ranks): whatever does work on a
// rank's behalf beats — a device stream finishing an op, the ranks of a collective meeting, a
// sampled token, an evaluation batch — and the watchdog trips only when nothing has beaten for
// --hang-timeout. Slow is not hung: a rank that takes 20 minutes over a sample is answering.
#pragma once

#include <atomic>
#include <cstdint>

namespace zt {

// One counter for the process (relaxed: only "has it changed" is read). A process runs one
// training World at a time, so no other world's progress can hide a hang.
inline std::atomic<uint64_t> g_heartbeats{0};

inline void heartbeat() noexcept { g_heartbeats.fetch_add(1, std::memory_order_relaxed); }
inline uint64_t heartbeats() noexcept { return g_heartbeats.load(std::memory_order_relaxed); }

}  // namespace zt
