// CPU backend: simulated devices, streams as worker-drained queues, events as markers.
#include "runtime/cpu/cpu_device.h"

#include <unistd.h>

#include <cstring>

#include "core/capture_rules.h"
#include "core/heartbeat.h"
#include "core/status.h"
#include "memory/pool_stream.h"

namespace zt::cpu {

// ---- Marker / CpuEvent ----------------------------------------------------

namespace {
std::atomic<uint64_t> g_host_syncs{0};
void count_host_sync() { g_host_syncs.fetch_add(1, std::memory_order_relaxed); }
std::atomic<uint64_t> g_host_funcs{0};
}  // namespace

uint64_t host_synchronizations() { return g_host_syncs.load(std::memory_order_relaxed); }
uint64_t host_functions_run() { return g_host_funcs.load(std::memory_order_relaxed); }

namespace {
std::atomic<EventWaitProbe> g_wait_probe{nullptr};
}  // namespace

void set_event_wait_probe(EventWaitProbe probe) { g_wait_probe.store(probe); }

void Marker::signal() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    done_at_ = std::chrono::steady_clock::now();
  }
  cv_.notify_all();
}

std::optional<std::chrono::steady_clock::time_point> Marker::done_at() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return std::nullopt;
  return done_at_;
}

bool Marker::wait(const CpuDevice* waiter) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_ || (waiter != nullptr && waiter->abandoned()); });
  return done_;
}

void Marker::wake() {
  // Taking the mutex orders this after a waiter's check of the abandonment flag (no lost wakeup).
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

bool Marker::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::shared_ptr<Marker> CpuEvent::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return latest_;
}

void CpuEvent::set_current(std::shared_ptr<Marker> m) {
  std::lock_guard<std::mutex> lock(mu_);
  latest_ = std::move(m);
}

bool CpuEvent::query() {
  if (this_thread_captures()) [[unlikely]]
    refuse_on_capturing_thread(CaptureRule::kEventQuery, "a CPU event");
  auto m = current();
  return !m || m->done();
}

void CpuEvent::synchronize() {
  if (this_thread_captures()) [[unlikely]]
    refuse_on_capturing_thread(CaptureRule::kEventQuery, "a CPU event");
  auto m = current();
  if (!m) return;
  if (const EventWaitProbe probe = g_wait_probe.load()) probe(m->tasks_behind(), m->tasks_total());
  m->wait();
}

std::optional<double> CpuEvent::seconds_since(const Event& start) const {
  const auto* other = dynamic_cast<const CpuEvent*>(&start);
  if (other == nullptr) return std::nullopt;
  const std::shared_ptr<Marker> a = other->current(), b = current();
  if (!a || !b) return std::nullopt;
  const auto ta = a->done_at(), tb = b->done_at();
  if (!ta || !tb) return std::nullopt;
  return std::chrono::duration<double>(*tb - *ta).count();
}

static CpuEvent& as_cpu_event(const Event& e) {
  auto* ce = dynamic_cast<const CpuEvent*>(&e);
  ZT_CHECK(ce != nullptr, "an event of another backend was used with a CPU stream");
  return *const_cast<CpuEvent*>(ce);
}

// ---- CpuStream --------------------------------------------------------------

void enqueue(Stream& s, std::function<void()> fn, const char* name) {
  auto* cs = s.backend() == Backend::kCpu ? dynamic_cast<CpuStream*>(&s) : nullptr;
  ZT_CHECK(cs != nullptr, name, " was launched through the CPU backend on a stream of ", s.device().name(),
           ", which is not a CPU stream");
  cs->enqueue(std::move(fn), name);
}

CpuStream::CpuStream(CpuDevice& device, int id, StreamPriority /*priority*/)
    : device_(device), id_(id), worker_([this] { run(); }) {}

CpuStream::~CpuStream() {
  note_capture_ended(this);  // a capture left open on this thread (the stream is going away)
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  worker_.join();
}

Device& CpuStream::device() { return device_; }

uint64_t CpuStream::push(std::function<void()> fn, bool control, const char* name) {
  if (capturing()) {
    std::string failed;
    {
      std::lock_guard<std::mutex> lock(capture_mu_);
      if (capturing_.load(std::memory_order_relaxed)) {
        if (capture_error_.empty()) {
          captured_.push_back(Task{std::move(fn), control, name});
          return 0;
        }
        failed = capture_error_;
      }
    }
    // CUDA returns cudaErrorStreamCaptureInvalidated for work submitted to a failed capture
    // (thrown outside the mutex: fn's state may free pool memory as it is destroyed).
    if (!failed.empty())
      throw CaptureError(CaptureRule::kUseAfterInvalidation, capture_refusal(CaptureRule::kUseAfterInvalidation, where()) +
                                                                 "; the capture failed first because: " + failed);
  }
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Task{std::move(fn), control, name});
    seq = ++submitted_;
    tasks_->store(seq);
  }
  cv_work_.notify_one();
  return seq;
}

void CpuStream::run() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Stop only once the queue is empty: work submitted before destruction still runs.
      cv_work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    bool admitted = true;
    if (!task.control && !device_.healthy()) [[unlikely]]
      admitted = device_.admit(id_);
    if (admitted) {
      TaskObserver* observer = task.control ? nullptr : device_.task_observer();
      const auto start = observer ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
      try {
        task.fn();
      } catch (...) {
        device_.set_error(std::current_exception(), device_.name() + " stream " + std::to_string(id_));
      }
      if (observer) observer->on_task(device_.index(), id_, task.name, start, std::chrono::steady_clock::now());
      if (!task.control) heartbeat();  // the hang watchdog's sign of progress
    }
    task.fn = nullptr;  // release captured state before reporting completion
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++completed_;
    }
    cv_done_.notify_all();
  }
}

void CpuStream::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = submitted_;
  cv_done_.wait(lock, [&] { return completed_ >= target; });
}

bool CpuStream::drain_until(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = submitted_;
  return cv_done_.wait_until(lock, deadline, [&] { return completed_ >= target; });
}

void CpuStream::release_wait() {
  std::shared_ptr<Marker> marker;
  {
    std::lock_guard<std::mutex> lock(wait_mu_);
    marker = waiting_on_;
  }
  if (marker) marker->wake();
}

std::string CpuStream::where() const { return device_.name() + " stream " + std::to_string(id_); }

void CpuStream::synchronize() {
  if (capturing()) refuse_in_capture(CaptureRule::kStreamSynchronize);
  count_host_sync();
  drain();
  device_.throw_if_failed();
}

bool CpuStream::synchronize_for(std::chrono::milliseconds timeout) {
  if (capturing()) refuse_in_capture(CaptureRule::kStreamSynchronize);
  if (!drain_until(std::chrono::steady_clock::now() + timeout)) return false;
  device_.throw_if_failed();
  return true;
}

bool CpuStream::query() {
  if (capturing()) refuse_in_capture(CaptureRule::kStreamQuery);
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = completed_ == submitted_;
  }
  device_.throw_if_failed();
  return idle;
}

void CpuStream::record(Event& event) {
  if (capturing()) {
    // Fails the capture without throwing (the next work submitted to it throws), as the CUDA
    // backend does: nothing is recorded.
    invalidate_capture(capture_refusal(CaptureRule::kRecordInCapture, where()));
    return;
  }
  auto marker = std::make_shared<Marker>();
  as_cpu_event(event).set_current(marker);
  const uint64_t seq = push([marker] { marker->signal(); }, /*control=*/true);
  marker->set_place(tasks_, seq);  // read only by the host thread that waits on it later
}

void CpuStream::wait(const Event& event) {
  auto marker = as_cpu_event(event).current();
  if (capturing()) {
    // An event recorded before the capture is "a non-captured event": CUDA refuses the wait
    // (cudaErrorStreamCaptureIsolation). A never-recorded one CUDA would ignore; we refuse any
    // wait in a capture (single-stream captures).
    invalidate_capture(capture_refusal(marker ? CaptureRule::kWaitOnUncapturedEvent : CaptureRule::kWaitInCapture,
                                       where()));
    return;
  }
  if (!marker) return;  // never recorded: nothing to wait for (as cudaStreamWaitEvent)
  // Published in waiting_on_ so that abandoning this device releases the worker: the marker may
  // belong to another device that is hung. (Ordering against abandon(): it sets kAbandoned before
  // it reads waiting_on_, and Marker::wait checks the flag under the marker's mutex.)
  push(
      [this, marker] {
        {
          std::lock_guard<std::mutex> lock(wait_mu_);
          waiting_on_ = marker;
        }
        marker->wait(&device_);
        std::lock_guard<std::mutex> lock(wait_mu_);
        waiting_on_.reset();
      },
      /*control=*/true);
}

void CpuStream::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  ZT_CHECK(dst && src, "copy of ", bytes, " bytes with a null pointer on ", device_.name());
  enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); }, "copy");
}

void CpuStream::copy_peer(Device& dst_device, void* dst, const void* src, size_t bytes) {
  ZT_CHECK(dst_device.backend() == Backend::kCpu, "peer copy from ", device_.name(), " to ",
           dst_device.name(), ": backends differ");
  if (bytes == 0) return;
  ZT_CHECK(dst && src, "peer copy of ", bytes, " bytes with a null pointer on ", device_.name());
  enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); }, "copy_peer");
}

void CpuStream::host_func(std::function<void()> fn) {
  ZT_CHECK(static_cast<bool>(fn), "host_func needs a callable");
  // Counted when it runs, so that a graph's replays count too (cpu::host_functions_run).
  enqueue(
      [fn = std::move(fn)] {
        g_host_funcs.fetch_add(1, std::memory_order_relaxed);
        fn();
      },
      "host_func");
}

void CpuStream::memset(void* dst, int value, size_t bytes) {
  if (bytes == 0) return;
  ZT_CHECK(dst, "memset of ", bytes, " bytes on a null pointer on ", device_.name());
  enqueue([dst, value, bytes] { std::memset(dst, value, bytes); }, "memset");
}

// ---- stream capture ---------------------------------------------------------

namespace {

class CpuGraph final : public StreamGraph {
 public:
  CpuGraph(CpuDevice& device, std::vector<CpuStream::Task> tasks) : device_(device), tasks_(std::move(tasks)) {}
  void launch(Stream& s) override {
    auto* cs = s.backend() == Backend::kCpu ? dynamic_cast<CpuStream*>(&s) : nullptr;
    ZT_CHECK(cs != nullptr && &cs->device() == &device_, "a graph captured on ", device_.name(),
             " was launched on a stream of ", s.device().name());
    if (cs->capturing())
      throw CaptureError(CaptureRule::kLaunchIntoCapture,
                         capture_refusal(CaptureRule::kLaunchIntoCapture, "a graph of " + device_.name()));
    cs->enqueue_all(tasks_);
  }
  size_t size() const override { return tasks_.size(); }

 private:
  CpuDevice& device_;
  const std::vector<CpuStream::Task> tasks_;  // copied into the queue by every launch
};

}  // namespace

void CpuStream::begin_capture() {
  std::lock_guard<std::mutex> lock(capture_mu_);
  ZT_REQUIRE(!capturing_.load(std::memory_order_relaxed), "stream ", id_, " of ", device_.name(),
             " is capturing already: end that capture first");
  captured_.clear();
  capture_error_.clear();
  capture_thread_ = std::this_thread::get_id();
  capturing_.store(true, std::memory_order_release);
  note_capture_begun(this);
}

std::unique_ptr<StreamGraph> CpuStream::end_capture() {
  std::vector<Task> tasks;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(capture_mu_);
    ZT_REQUIRE(capturing_.load(std::memory_order_relaxed), "stream ", id_, " of ", device_.name(), " is not capturing");
    // Checked before anything changes: the capture stays open for the thread that began it.
    if (capture_thread_ != std::this_thread::get_id())
      throw CaptureError(CaptureRule::kEndOnOtherThread, capture_refusal(CaptureRule::kEndOnOtherThread, where()));
    capturing_.store(false, std::memory_order_release);
    tasks.swap(captured_);
    error.swap(capture_error_);
  }
  note_capture_ended(this);
  if (!error.empty()) throw_invalidated_capture(where(), error);
  return std::make_unique<CpuGraph>(device_, std::move(tasks));
}

void CpuStream::invalidate_capture(const std::string& why) {
  std::vector<Task> dropped;  // destroyed outside the mutex: a task's state may free pool memory
  std::lock_guard<std::mutex> lock(capture_mu_);
  if (!capturing_.load(std::memory_order_relaxed) || !capture_error_.empty()) return;
  capture_error_ = why;
  dropped.swap(captured_);  // nothing of a failed capture can run
}

void CpuStream::refuse_in_capture(CaptureRule rule) {
  std::string why = capture_refusal(rule, where());
  invalidate_capture(why);
  throw CaptureError(rule, std::move(why));
}

void CpuStream::enqueue_all(const std::vector<Task>& tasks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Task& t : tasks) queue_.push_back(t);
    submitted_ += tasks.size();
    tasks_->store(submitted_);
  }
  cv_work_.notify_one();
}

// ---- CpuDevice --------------------------------------------------------------

static size_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

CpuDevice::CpuDevice(int index, size_t memory_bytes)
    : index_(index), total_memory_(memory_bytes ? memory_bytes : physical_memory_bytes()) {
  pool_ = std::make_unique<CachingAllocator>(name(), std::make_unique<HostRawAllocator>(memory_bytes));
  streams_.push_back(std::make_unique<CpuStream>(*this, 0, StreamPriority::kNormal));
  streams_.push_back(std::make_unique<CpuStream>(*this, 1, StreamPriority::kHigh));
  compute_ = streams_[0].get();
  comm_ = streams_[1].get();
}

CpuDevice::~CpuDevice() {
  // A device hung on purpose never drains: give up on it (see Runtime::~Runtime).
  if (hang_injected()) abandon("the device was destroyed while it hung (injected fault)");
  // Finish queued work before the pool (which the work may use) goes away.
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    for (auto& s : streams_) s->drain();
  }
  pool_.reset();
  streams_.clear();
}

Stream& CpuDevice::create_stream(StreamPriority priority) {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_.push_back(std::make_unique<CpuStream>(*this, static_cast<int>(streams_.size()), priority));
  return *streams_.back();
}

std::vector<CpuStream*> CpuDevice::stream_list() {
  std::lock_guard<std::mutex> lock(streams_mu_);
  std::vector<CpuStream*> streams;
  for (auto& s : streams_) streams.push_back(s.get());
  return streams;
}

void CpuDevice::refuse_while_capturing(const char* call) {
  for (auto* s : stream_list())
    if (s->capturing()) {
      std::string why = capture_refusal(CaptureRule::kDeviceSynchronize,
                                        std::string(call) + " of " + name() + ", stream " + std::to_string(s->id()) +
                                            " capturing");
      s->invalidate_capture(why);
      throw CaptureError(CaptureRule::kDeviceSynchronize, std::move(why));
    }
}

void CpuDevice::synchronize() {
  refuse_while_capturing("synchronize()");
  count_host_sync();
  for (auto* s : stream_list()) s->drain();
  throw_if_failed();
}

bool CpuDevice::synchronize_for(std::chrono::milliseconds timeout) {
  refuse_while_capturing("synchronize_for()");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto* s : stream_list()) {
    if (!s->drain_until(deadline)) return false;
  }
  throw_if_failed();
  return true;
}

void CpuDevice::set_task_observer(TaskObserver* observer) {
  // Drained first, so that once this returns no worker is still reporting to the previous
  // observer (a task reports before it counts as completed). A hung device cannot drain; its
  // parked tasks are skipped after abandon() and report nothing.
  if (!hang_injected())
    for (auto* s : stream_list()) s->drain();
  observer_.store(observer, std::memory_order_release);
}

void CpuDevice::inject_fault(FaultKind kind) {
  fault_.fetch_or(kind == FaultKind::kError ? kErrorArmed : kHang, std::memory_order_acq_rel);
}

bool CpuDevice::hang_injected() const {
  return (fault_.load(std::memory_order_acquire) & (kHang | kAbandoned)) == kHang;
}

void CpuDevice::abandon(const std::string& why) {
  // Failed first: every task released below is then skipped, and every synchronization throws.
  fail(name() + " was abandoned: " + why);
  {
    // Under hang_mu_, so that a worker between its check and its wait cannot miss the wakeup.
    std::lock_guard<std::mutex> lock(hang_mu_);
    fault_.fetch_or(kAbandoned, std::memory_order_acq_rel);
  }
  hang_cv_.notify_all();
  // Workers blocked in a wait task (on a marker of any device) stop waiting. The markers recorded
  // on this device's streams are then reached by its workers, which now skip every operation, so
  // they complete promptly and other devices' streams waiting on them proceed.
  for (auto* s : stream_list()) s->release_wait();
}

bool CpuDevice::admit(int stream_id) {
  const uint32_t state = fault_.load(std::memory_order_acquire);
  if ((state & (kHang | kAbandoned)) == kHang) {
    std::unique_lock<std::mutex> lock(hang_mu_);
    hang_cv_.wait(lock, [&] { return (fault_.load(std::memory_order_acquire) & kAbandoned) != 0; });
  }
  if (state & kErrorArmed) surface_injected_error(name() + " stream " + std::to_string(stream_id));
  return !failed();
}

void CpuDevice::surface_injected_error(const std::string& where) {
  // Under error_mu_, and kFailed before kErrorArmed is cleared: a stream that saw the armed bit
  // and lost the race to another finds the device failed when it gets the mutex, so no operation
  // started after the fault runs.
  std::lock_guard<std::mutex> lock(error_mu_);
  if (!(fault_.load(std::memory_order_relaxed) & kErrorArmed)) return;
  fail_locked("operation on " + where + " failed: injected fault (FaultKind::kError)");
  fault_.fetch_and(~kErrorArmed, std::memory_order_relaxed);
}

void CpuDevice::fail(std::string message) {
  std::lock_guard<std::mutex> lock(error_mu_);
  fail_locked(std::move(message));
}

void CpuDevice::fail_locked(std::string message) {
  if (fault_.load(std::memory_order_relaxed) & kFailed) return;  // sticky: the first error wins
  error_message_ = std::move(message);
  fault_.fetch_or(kFailed, std::memory_order_release);
}

void CpuDevice::set_error(std::exception_ptr error, const std::string& where) {
  std::string what;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    what = e.message();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown exception";
  }
  fail("operation on " + where + " failed: " + what);
}

void CpuDevice::throw_if_failed() {
  if (healthy()) [[likely]]
    return;
  // An injected error not yet met by any operation surfaces at the synchronization point.
  if (fault_.load(std::memory_order_acquire) & kErrorArmed) surface_injected_error(name());
  if (!failed()) return;
  std::string msg;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    msg = error_message_;
  }
  ZT_THROW(ErrorKind::kDevice, msg);
}

}  // namespace zt::cpu
