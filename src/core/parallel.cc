// A small work-sharing pool: jobs are split into chunks that workers and the caller claim with
// an atomic counter; the caller waits until every chunk has finished.
#include "core/parallel.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace zt {

namespace {

struct Job {
  const std::function<void(int64_t, int64_t)>* fn;
  int64_t n, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;  // guarded by mu

  // Claims and runs chunks until none are left; returns true if it finished the last one.
  void work() {
    for (;;) {
      const int64_t c = next.fetch_add(1);
      if (c >= num_chunks) return;
      const int64_t b = c * chunk, e = std::min(n, b + chunk);
      try {
        (*fn)(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
      if (done.fetch_add(1) + 1 == num_chunks) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return threads_; }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    // About 4 chunks per thread for balance, never below the grain.
    job->chunk = std::max<int64_t>(grain, (n + threads_ * 4 - 1) / (threads_ * 4));
    job->num_chunks = (n + job->chunk - 1) / job->chunk;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(job);
    }
    cv_.notify_all();
    job->work();
    {
      std::unique_lock<std::mutex> lock(job->mu);
      job->cv.wait(lock, [&] { return job->done.load() == job->num_chunks; });
      if (job->error) std::rethrow_exception(job->error);
    }
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (stop_) return;
        job = jobs_.front();
        // A job whose chunks are all claimed leaves the queue; its owner waits for completion.
        if (job->next.load() >= job->num_chunks) {
          jobs_.pop_front();
          continue;
        }
      }
      job->work();
      std::lock_guard<std::mutex> lock(mu_);
      if (!jobs_.empty() && jobs_.front() == job) jobs_.pop_front();
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;
  bool stop_ = false;
};

int configured_threads() {
  if (const char* env = std::getenv("ZT_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1 && n <= 1024) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

Pool& pool() {
  static Pool p(configured_threads());
  return p;
}

}  // namespace

int parallel_threads() { return pool().threads(); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (n <= grain || pool().threads() == 1) {
    fn(0, n);
    return;
  }
  pool().run(n, grain, fn);
}

}  // namespace zt
