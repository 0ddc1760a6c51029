// CPU backend: simulated devices, streams as worker-drained queues, events as markers.
#include "runtime/cpu/cpu_device.h"

#include <unistd.h>

#include <cstring>

#include "core/status.h"

namespace zt::cpu {

// ---- Marker / CpuEvent ----------------------------------------------------

void Marker::signal() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

void Marker::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
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
  auto m = current();
  return !m || m->done();
}

void CpuEvent::synchronize() {
  if (auto m = current()) m->wait();
}

static CpuEvent& as_cpu_event(const Event& e) {
  auto* ce = dynamic_cast<const CpuEvent*>(&e);
  ZT_CHECK(ce != nullptr, "an event of another backend was used with a CPU stream");
  return *const_cast<CpuEvent*>(ce);
}

// ---- CpuStream --------------------------------------------------------------

namespace {
std::atomic<StreamTaskObserver*> g_task_observer{nullptr};
}  // namespace

StreamTaskObserver* set_stream_task_observer(StreamTaskObserver* observer) {
  return g_task_observer.exchange(observer, std::memory_order_acq_rel);
}

CpuStream::CpuStream(CpuDevice& device, int id, StreamPriority /*priority*/)
    : device_(device), id_(id), worker_([this] { run(); }) {}

CpuStream::~CpuStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  worker_.join();
}

Device& CpuStream::device() { return device_; }

void CpuStream::push(std::function<void()> fn, bool control, const char* name) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Task{std::move(fn), control, name});
    ++submitted_;
  }
  cv_work_.notify_one();
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
    if (task.control || !device_.failed()) {
      StreamTaskObserver* observer = task.control ? nullptr : g_task_observer.load(std::memory_order_acquire);
      const auto start = observer ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
      try {
        task.fn();
      } catch (...) {
        device_.set_error(std::current_exception(), device_.name() + " stream " + std::to_string(id_));
      }
      if (observer) observer->on_task(device_.index(), id_, task.name, start, std::chrono::steady_clock::now());
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

void CpuStream::synchronize() {
  drain();
  device_.throw_if_failed();
}

bool CpuStream::query() {
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = completed_ == submitted_;
  }
  device_.throw_if_failed();
  return idle;
}

void CpuStream::record(Event& event) {
  auto marker = std::make_shared<Marker>();
  as_cpu_event(event).set_current(marker);
  push([marker] { marker->signal(); }, /*control=*/true);
}

void CpuStream::wait(const Event& event) {
  auto marker = as_cpu_event(event).current();
  if (!marker) return;  // never recorded: nothing to wait for (as cudaStreamWaitEvent)
  push([marker] { marker->wait(); }, /*control=*/true);
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

void CpuStream::memset(void* dst, int value, size_t bytes) {
  if (bytes == 0) return;
  ZT_CHECK(dst, "memset of ", bytes, " bytes on a null pointer on ", device_.name());
  enqueue([dst, value, bytes] { std::memset(dst, value, bytes); }, "memset");
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

void CpuDevice::synchronize() {
  std::vector<CpuStream*> streams;
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    for (auto& s : streams_) streams.push_back(s.get());
  }
  for (auto* s : streams) s->drain();
  throw_if_failed();
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
  std::lock_guard<std::mutex> lock(error_mu_);
  if (failed_.load(std::memory_order_relaxed)) return;  // sticky: the first error wins
  error_message_ = "operation on " + where + " failed: " + what;
  failed_.store(true, std::memory_order_release);
}

void CpuDevice::throw_if_failed() const {
  if (!failed()) return;
  std::string msg;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    msg = error_message_;
  }
  ZT_THROW(ErrorKind::kDevice, msg);
}

}  // namespace zt::cpu
