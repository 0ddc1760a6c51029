// The --trace timeline: a Chrome/Perfetto trace-event JSON file (open it in ui.perfetto.dev or
// chrome://tracing). One process per device (pid = device index), one track per stream (tid =
// stream id: 0 compute, 1 comm) plus a "host ranges" track holding that device's NVTX ranges; the
// main thread's ranges go to an extra "host" process. Counters ("ph":"C") carry pool bytes.
//
// Stream slices come from the runtime's TaskObserver (runtime/observer.h), which the recorder
// implements; pass it to Runtime::create. What a slice means depends on the backend:
//  - cpu: every stream task (kernel, copy, peer copy, host function), timed on the host clock when
//    the stream's worker starts and finishes it (exact: that is when the simulated device works);
//  - cuda: every op and copy, timed by an event pair around it on its stream, resolved when the
//    stream is synchronized (GPU times mapped onto the host clock). add_slice also takes the ZeRO
//    engine's spans (a block's forward/backward, reduce-scatter, gather) when a caller has them.
// Host ranges (step, forward h.3, reduce_scatter ..., data) are the same on both backends. With
// --pipeline-parallel each device also has a "pipeline F/B/W" track: its stage's actions
// ("F m3", "B m3 c1", "W m3") when its compute stream ran them.
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/nvtx.h"
#include "runtime/observer.h"

namespace zt {

// "A:B" -> {A, B}: 1-based steps, inclusive, 1 <= A <= B <= steps. Throws kInvalidArgument with
// one sentence (for --profile-steps).
std::pair<int, int> parse_step_range(std::string_view text, int steps);

class TraceRecorder final : public TaskObserver, public RangeSink {
 public:
  using Clock = std::chrono::steady_clock;
  // Track ids inside a device's process.
  static constexpr int kHostTid = 100;   // NVTX ranges of the device's host thread
  static constexpr int kTensorTid = 101;  // its tensor-parallel collectives' ranges (their own track)
  static constexpr int kPipelineTid = 102;  // its pipeline stage's F, B and W as the compute stream ran them
  static constexpr int kHostPid = 1000;  // process of ranges with no device (the main thread)

  // Installs itself as the range sink (forwarding ranges to the sink installed before). As a task
  // observer it must outlive the Runtime it is given to (create it first, destroy it after).
  TraceRecorder();
  ~TraceRecorder() override;
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  void on_task(int device, int stream, const char* name, Clock::time_point start, Clock::time_point end) override;
  void push(NvtxCategory category, std::string_view name, int device) override;
  void pop() override;

  // A slice on a device stream's track (start/end in microseconds since `origin`).
  void add_slice(int device, int stream, std::string name, const char* category, double start_us, double end_us,
                 Clock::time_point origin);
  // A counter sample now, e.g. pool allocated bytes of a device.
  void add_counter(int device, const std::string& name, double value);

  // The whole trace: metadata (process/thread names; device_names[i] names pid i), then every
  // track's events in timestamp order.
  nlohmann::json to_json(const std::vector<std::string>& device_names) const;
  // Writes to_json to `path`; throws kInvalidArgument when the file cannot be written.
  void write(const std::string& path, const std::vector<std::string>& device_names) const;

 private:
  struct Slice {
    int pid, tid;
    std::string name;
    const char* category;
    double ts, dur;
  };
  struct Counter {
    int pid;
    std::string name;
    double ts, value;
  };
  struct Open {
    NvtxCategory category;
    std::string name;
    int device;
    double ts;
  };
  double us(Clock::time_point t) const { return std::chrono::duration<double, std::micro>(t - origin_).count(); }

  const Clock::time_point origin_ = Clock::now();
  RangeSink* previous_sink_ = nullptr;
  mutable std::mutex mu_;
  std::vector<Slice> slices_;                                // guarded by mu_
  std::vector<Counter> counters_;                            // guarded by mu_
  std::map<std::thread::id, std::vector<Open>> open_;        // guarded by mu_: per-thread range stacks
};

}  // namespace zt
