// Prefetcher: one background thread produces batch k+1 into a second host buffer while the caller
// consumes batch k (double buffering), so data preparation overlaps the training step.
//
// Rules:
//  - the producer fills `out` with batch `index` completely and depends on nothing but `index`
//    (it may reuse the buffer's allocation: a slot holds batch k-2 when it is handed batch k);
//    then get(k) returns exactly what producer(k, buffer) gives without a prefetcher;
//  - the reference get(k) returns stays valid, and untouched by the worker, until the next get();
//  - get(k) after get(k-1) finds k already prefetched; any other index (a resume, a jump) is
//    produced on demand and prefetching continues from there;
//  - an exception thrown while producing batch k is rethrown by get(k) (a failed prefetch of a
//    batch never asked for is dropped); the destructor waits for the batch in flight, then joins.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace zt {

template <typename Batch>
class Prefetcher {
 public:
  using Producer = std::function<void(int64_t index, Batch& out)>;

  // Both buffers start as copies of `prototype` (e.g. vectors already sized for one batch).
  explicit Prefetcher(Producer producer, const Batch& prototype = Batch{})
      : producer_(std::move(producer)) {
    slots_[0].batch = prototype;
    slots_[1].batch = prototype;
    worker_ = std::thread([this] { run(); });
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  const Batch& get(int64_t index) {
    std::unique_lock<std::mutex> lock(mu_);
    int s = find(index);
    if (s < 0) {
      // Not prefetched: let any job in flight finish (it is for another index), then produce this.
      cv_.wait(lock, [&] { return !busy(); });
      s = slots_[0].state == State::kEmpty ? 0 : 1;
      schedule(s, index);
    }
    cv_.wait(lock, [&] { return slots_[s].state == State::kReady; });
    if (slots_[s].error) {
      std::exception_ptr error = std::exchange(slots_[s].error, nullptr);
      slots_[s].state = State::kEmpty;
      std::rethrow_exception(error);
    }
    // The consumer has released the other slot (it held the previous batch): prefetch index+1.
    const int o = 1 - s;
    if (find(index + 1) != o) {
      cv_.wait(lock, [&] { return slots_[o].state != State::kPending; });
      schedule(o, index + 1);
    }
    return slots_[s].batch;
  }

 private:
  enum class State { kEmpty, kPending, kReady };
  struct Slot {
    Batch batch{};
    int64_t index = -1;
    State state = State::kEmpty;
    std::exception_ptr error;
  };

  int find(int64_t index) const {
    for (int s = 0; s < 2; ++s)
      if (slots_[s].state != State::kEmpty && slots_[s].index == index) return s;
    return -1;
  }
  bool busy() const { return slots_[0].state == State::kPending || slots_[1].state == State::kPending; }

  void schedule(int s, int64_t index) {
    slots_[s].index = index;
    slots_[s].state = State::kPending;
    slots_[s].error = nullptr;
    job_ = s;
    cv_.notify_all();
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || job_ >= 0; });
      if (stop_) return;
      const int s = std::exchange(job_, -1);
      const int64_t index = slots_[s].index;
      lock.unlock();
      // Slot s is ours alone until it is marked ready: the consumer never reads a pending slot.
      std::exception_ptr error;
      try {
        producer_(index, slots_[s].batch);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      slots_[s].error = error;
      slots_[s].state = State::kReady;
      cv_.notify_all();
    }
  }

  Producer producer_;
  std::mutex mu_;
  std::condition_variable cv_;
  Slot slots_[2];
  int job_ = -1;  // slot the worker should fill next, -1 when none
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace zt
