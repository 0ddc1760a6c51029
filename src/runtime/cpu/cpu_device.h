// The CPU backend: N simulated devices in one process, with the CUDA stream/event semantics.
// Each stream is an in-order queue drained by its own worker thread; an event record is a marker
// task; a wait is a task that blocks its worker until the marker has run. A missing wait is a
// real data race here, exactly as on a GPU, and ThreadSanitizer reports it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "memory/caching_allocator.h"
#include "runtime/device.h"

namespace zt::cpu {

class CpuDevice;

// Sees every task a CPU stream runs (the --trace timeline): called on the stream's worker right
// after the task, with the host clock at its start and end. Event records and waits are not
// reported. Must be thread-safe (every worker calls it).
class StreamTaskObserver {
 public:
  virtual ~StreamTaskObserver() = default;
  virtual void on_task(int device, int stream, const char* name, std::chrono::steady_clock::time_point start,
                       std::chrono::steady_clock::time_point end) = 0;
};
// Process-wide; none by default (then a task costs one atomic load more). Install before the
// devices are created and remove after they are destroyed. Returns the previous observer.
StreamTaskObserver* set_stream_task_observer(StreamTaskObserver* observer);

// One record() of an event: completes when the stream's worker reaches it.
class Marker {
 public:
  void signal();
  void wait();
  bool done();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

class CpuEvent final : public Event {
 public:
  bool query() override;
  void synchronize() override;
  // The record current at this instant (nullptr if never recorded).
  std::shared_ptr<Marker> current() const;
  void set_current(std::shared_ptr<Marker> m);

 private:
  mutable std::mutex mu_;
  std::shared_ptr<Marker> latest_;
};

class CpuStream final : public Stream {
 public:
  CpuStream(CpuDevice& device, int id, StreamPriority priority);
  ~CpuStream() override;

  Device& device() override;
  Backend backend() const override { return Backend::kCpu; }
  int id() const override { return id_; }
  void record(Event& event) override;
  void wait(const Event& event) override;
  void synchronize() override;
  bool query() override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_peer(Device& dst_device, void* dst, const void* src, size_t bytes) override;
  void memset(void* dst, int value, size_t bytes) override;
  void host_func(std::function<void()> fn) override { enqueue(std::move(fn), "host_func"); }
  void* native_handle() override { return nullptr; }

  // Adds work to the queue. Kernels of the CPU backend launch through this. name: a string
  // literal (it is kept, not copied) naming the task on the trace timeline.
  void enqueue(std::function<void()> fn, const char* name = "op") { push(std::move(fn), /*control=*/false, name); }
  // Waits for the queue to drain without rethrowing device errors (teardown).
  void drain();

 private:
  struct Task {
    std::function<void()> fn;
    bool control;  // event records/waits run even on a failed device, so no waiter hangs
    const char* name;
  };
  void push(std::function<void()> fn, bool control, const char* name = "control");
  void run();

  CpuDevice& device_;
  const int id_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  std::deque<Task> queue_;
  uint64_t submitted_ = 0;  // guarded by mu_
  uint64_t completed_ = 0;  // guarded by mu_
  bool stop_ = false;
  std::thread worker_;
};

class CpuDevice final : public Device {
 public:
  CpuDevice(int index, size_t memory_bytes);
  ~CpuDevice() override;

  int index() const override { return index_; }
  Backend backend() const override { return Backend::kCpu; }
  std::string name() const override { return "cpu:" + std::to_string(index_); }
  size_t total_memory() const override { return total_memory_; }
  Stream& compute() override { return *compute_; }
  Stream& comm() override { return *comm_; }
  Stream& create_stream(StreamPriority priority) override;
  std::unique_ptr<Event> create_event() override { return std::make_unique<CpuEvent>(); }
  CachingAllocator& memory() override { return *pool_; }
  bool can_access_peer(const Device& other) const override { return other.backend() == Backend::kCpu; }
  void synchronize() override;
  bool failed() const override { return failed_.load(std::memory_order_acquire); }

  // Records the first failure of any stream operation; later operations are skipped.
  void set_error(std::exception_ptr error, const std::string& where);
  // Throws the sticky error, if any, as zt::Error(kDevice).
  void throw_if_failed() const;

 private:
  const int index_;
  size_t total_memory_;
  std::unique_ptr<CachingAllocator> pool_;
  std::mutex streams_mu_;
  std::vector<std::unique_ptr<CpuStream>> streams_;  // guarded by streams_mu_
  CpuStream* compute_ = nullptr;
  CpuStream* comm_ = nullptr;
  std::atomic<bool> failed_{false};
  mutable std::mutex error_mu_;
  std::string error_message_;
};

}  // namespace zt::cpu
