// The CPU backend: N simulated devices in one process, with the CUDA stream/event semantics.
// Each stream is an in-order queue drained by its own worker thread; an event record is a marker
// task; a wait is a task that blocks its worker until the marker has run. A missing wait is a
// real data race here, exactly as on a GPU, and ThreadSanitizer reports it.
//
// Faults (Device::inject_fault / abandon): a device keeps one atomic fault word. A worker loads
// it (relaxed) once per non-control task; only a non-zero word takes the slow path (admit()),
// which fails an injected error, parks the task on an injected hang, or skips it on a failed
// device. Control tasks (event records and waits) never block on a fault and run even on a failed
// device, so that no waiter, on this device or another, hangs behind a failure. Released by
// abandon(): the parked tasks (then skipped, the device being failed) and the device's own event
// waits, which would otherwise block its workers on a marker of another hung device.
//
// Stream capture (runtime/stream.h): while capturing, push() appends the task (its closure holds
// the kernel's arguments by value, as a CUDA graph holds a kernel's parameters) to the capture
// instead of the queue; a CpuGraph's launch() appends copies of those tasks to a queue in one go.
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
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/capture_rules.h"
#include "memory/caching_allocator.h"
#include "runtime/device.h"

namespace zt::cpu {

class CpuDevice;

// Tests: how often a host thread has drained CPU-backend work (Stream::synchronize,
// Device::synchronize), process-wide since start: the host synchronisations of a training step.
// Event waits are not counted (the pool's teardown waits on a timing-dependent number of them).
uint64_t host_synchronizations();
// Tests: host functions (Stream::host_func) CPU streams have run, process-wide since start, those
// of captured graphs counted at each replay. On a GPU each stalls its stream until CUDA's host
// thread has run it (cudaLaunchHostFunc), and CUDA may run the host functions of all streams on one
// thread, so the hot path of a step should have none.
uint64_t host_functions_run();
// Tests: called on every host wait for a CPU event (Event::synchronize) with the number of tasks
// its stream had been given after the event's record when the wait began (0: the wait drains the
// stream as a synchronize would) and the stream's tasks so far. Lets a test tell a wait on the
// work just enqueued from one on an earlier step's, behind which the next step is queued.
// nullptr: none. Set it only while no device runs.
using EventWaitProbe = void (*)(uint64_t tasks_behind, uint64_t tasks_total);
void set_event_wait_probe(EventWaitProbe probe);

// Enqueues `fn` on `s`, which must be a CPU stream (the checked downcast of the CPU backend:
// another backend's stream is a zt::Error(kInternal) naming the task and the stream's device).
// `name`: a string literal (kept, not copied) naming the task for the runtime's TaskObserver.
// CPU kernels of the op table launch through this.
void enqueue(Stream& s, std::function<void()> fn, const char* name);

// One record() of an event: completes when the stream's worker reaches it.
class Marker {
 public:
  void signal();
  // Blocks until signalled; with `waiter`, also returns once that device is abandoned (its
  // streams stop waiting; see CpuDevice::abandon). Returns whether the marker was signalled.
  bool wait(const CpuDevice* waiter = nullptr);
  bool done();
  // When signal() ran (host clock), nullopt before.
  std::optional<std::chrono::steady_clock::time_point> done_at();
  // Makes blocked wait()s re-check their waiter's abandonment.
  void wake();
  // The recording stream's task count (shared, outlives the stream) and this record's place in
  // it, for the event-wait probe.
  void set_place(std::shared_ptr<const std::atomic<uint64_t>> tasks, uint64_t seq) {
    tasks_ = std::move(tasks);
    seq_ = seq;
  }
  // Tasks the recording stream was given after this record (0 when not known).
  uint64_t tasks_behind() const { return tasks_ ? tasks_->load() - seq_ : 0; }
  uint64_t tasks_total() const { return tasks_ ? tasks_->load() : 0; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point done_at_{};
  std::shared_ptr<const std::atomic<uint64_t>> tasks_;
  uint64_t seq_ = 0;
};

class CpuEvent final : public Event {
 public:
  bool query() override;
  void synchronize() override;
  // Every CPU event times: a marker notes the host clock when the worker reaches it.
  std::optional<double> seconds_since(const Event& start) const override;
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
  bool synchronize_for(std::chrono::milliseconds timeout) override;
  bool query() override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_peer(Device& dst_device, void* dst, const void* src, size_t bytes) override;
  void memset(void* dst, int value, size_t bytes) override;
  void host_func(std::function<void()> fn) override;
  void* native_handle() override { return nullptr; }
  void begin_capture() override;
  std::unique_ptr<StreamGraph> end_capture() override;
  bool capturing() const override { return capturing_.load(std::memory_order_acquire); }
  void invalidate_capture(const std::string& why) override;

  struct Task {
    std::function<void()> fn;
    bool control;  // event records/waits run even on a failed device, so no waiter hangs
    const char* name;
  };
  // A graph's launch: copies of `tasks`, in order, behind everything submitted so far.
  void enqueue_all(const std::vector<Task>& tasks);

  // Adds work to the queue (kernels reach it through cpu::enqueue). name: a string literal (it is
  // kept, not copied) naming the task for the observer.
  void enqueue(std::function<void()> fn, const char* name = "op") { push(std::move(fn), /*control=*/false, name); }
  // Waits for the queue to drain without rethrowing device errors (teardown).
  void drain();
  // drain() that gives up at `deadline`: false when work is still pending then.
  bool drain_until(std::chrono::steady_clock::time_point deadline);
  // The device was abandoned: stop waiting on another device's marker, if this stream's worker is.
  void release_wait();

 private:
  // Fails the capture and throws the refusal (a call CUDA refuses during capture).
  [[noreturn]] void refuse_in_capture(CaptureRule rule);
  std::string where() const;  // "cpu:0 stream 1", for refusals
  // Returns the stream's task count with this one (0 when captured).
  uint64_t push(std::function<void()> fn, bool control, const char* name = "control");
  void run();

  CpuDevice& device_;
  const int id_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  std::deque<Task> queue_;
  uint64_t submitted_ = 0;  // guarded by mu_
  // submitted_, readable without mu_ by the event-wait probe (set_event_wait_probe).
  std::shared_ptr<std::atomic<uint64_t>> tasks_ = std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t completed_ = 0;  // guarded by mu_
  bool stop_ = false;
  // The marker this stream's worker is blocked on in a wait task, for release_wait().
  std::mutex wait_mu_;
  std::shared_ptr<Marker> waiting_on_;  // guarded by wait_mu_
  std::atomic<bool> capturing_{false};
  mutable std::mutex capture_mu_;
  std::vector<Task> captured_;  // guarded by capture_mu_
  std::string capture_error_;   // guarded by capture_mu_: the first reason the capture failed
  std::thread::id capture_thread_;  // guarded by capture_mu_: the thread that began the capture
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
  bool synchronize_for(std::chrono::milliseconds timeout) override;
  bool failed() const override { return (fault_.load(std::memory_order_acquire) & kFailed) != 0; }
  void set_task_observer(TaskObserver* observer) override;
  TaskObserver* task_observer() const { return observer_.load(std::memory_order_acquire); }
  void inject_fault(FaultKind kind) override;
  bool hang_injected() const override;
  void abandon(const std::string& why) override;

  // Records the first failure of any stream operation; later operations are skipped.
  void set_error(std::exception_ptr error, const std::string& where);
  // Throws the sticky error, if any, as zt::Error(kDevice). Surfaces an injected error first.
  void throw_if_failed();

  // The workers' per-task check: true while no fault is injected and the device has not failed
  // (the hot path: one relaxed load).
  bool healthy() const { return fault_.load(std::memory_order_relaxed) == 0; }
  // The slow path when !healthy(), on the worker of stream `stream_id` before a non-control task:
  // fails an injected error, blocks on an injected hang until abandon(). Returns whether the task
  // may run (false: the device has failed, the task is skipped).
  bool admit(int stream_id);
  bool abandoned() const { return (fault_.load(std::memory_order_acquire) & kAbandoned) != 0; }

 private:
  // Bits of fault_.
  static constexpr uint32_t kFailed = 1;       // sticky error; error_message_ says which
  static constexpr uint32_t kErrorArmed = 2;   // inject_fault(kError) not yet surfaced
  static constexpr uint32_t kHang = 4;         // inject_fault(kHang)
  static constexpr uint32_t kAbandoned = 8;    // abandon() was called

  // Sets the sticky error unless one is set already (the first error wins).
  void fail(std::string message);
  void fail_locked(std::string message);  // error_mu_ held
  // Turns an armed injected error into the sticky error; `where` names the failing operation.
  void surface_injected_error(const std::string& where);
  std::vector<CpuStream*> stream_list();
  // Throws (and fails the capture) when a stream of this device is capturing: CUDA refuses a
  // device-wide synchronisation then.
  void refuse_while_capturing(const char* call);

  const int index_;
  size_t total_memory_;
  std::unique_ptr<CachingAllocator> pool_;
  std::mutex streams_mu_;
  std::vector<std::unique_ptr<CpuStream>> streams_;  // guarded by streams_mu_
  CpuStream* compute_ = nullptr;
  CpuStream* comm_ = nullptr;
  std::atomic<uint32_t> fault_{0};  // kFailed | kErrorArmed | kHang | kAbandoned
  std::atomic<TaskObserver*> observer_{nullptr};
  mutable std::mutex error_mu_;
  std::string error_message_;  // guarded by error_mu_
  // A task parked on an injected hang waits here for kAbandoned.
  std::mutex hang_mu_;
  std::condition_variable hang_cv_;
};

}  // namespace zt::cpu
