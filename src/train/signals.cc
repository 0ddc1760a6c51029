// SIGINT/SIGTERM handling for the training loop (see signals.h).
#include "train/signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>

namespace zt {

namespace {

std::atomic<int> g_pending{0};
struct sigaction g_old_int, g_old_term;

extern "C" void on_stop_signal(int sig) {
  int expected = 0;
  if (!g_pending.compare_exchange_strong(expected, sig)) _exit(128 + sig);  // the second signal
}

}  // namespace

StopSignals::StopSignals() {
  g_pending.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;  // reads and writes in flight are not cut short
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_old_int);
  sigaction(SIGTERM, &sa, &g_old_term);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &g_old_int, nullptr);
  sigaction(SIGTERM, &g_old_term, nullptr);
}

int StopSignals::pending() { return g_pending.load(); }


}  // namespace zt
