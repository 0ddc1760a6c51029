// ASHA's rung arithmetic and promotion rule (see asha.h); the sweep runner calls report() at
// each rung and stops the trial when it returns false.
#include "sweep/asha.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/status.h"

namespace zt::sweep {

Asha::Asha(int min_steps, int max_steps, double eta) : min_steps_(min_steps), max_steps_(max_steps), eta_(eta) {
  ZT_REQUIRE(min_steps >= 1, "--min-steps must be at least 1 (it is ", min_steps, ").");
  ZT_REQUIRE(max_steps >= min_steps, "--max-steps (", max_steps, ") must be at least --min-steps (", min_steps, ").");
  ZT_REQUIRE(std::isfinite(eta) && eta > 1, "--eta must be a number above 1, such as 3 (it is ", eta, ").");
  // Repeated multiplication, not pow(): the same doubles on every machine.
  for (double v = min_steps; v < max_steps; v *= eta) {
    const double r = std::round(v);
    if (r >= max_steps) break;
    const int step = static_cast<int>(r);
    if (rungs_.empty() || step > rungs_.back()) rungs_.push_back(step);
  }
  entries_.resize(rungs_.size());
}

Asha::Asha(Asha&& other) noexcept {
  std::lock_guard<std::mutex> lock(other.mu_);
  min_steps_ = other.min_steps_;
  max_steps_ = other.max_steps_;
  eta_ = other.eta_;
  rungs_ = std::move(other.rungs_);
  entries_ = std::move(other.entries_);
}

Asha& Asha::operator=(Asha&& other) noexcept {
  if (this == &other) return *this;
  std::scoped_lock lock(mu_, other.mu_);
  min_steps_ = other.min_steps_;
  max_steps_ = other.max_steps_;
  eta_ = other.eta_;
  rungs_ = std::move(other.rungs_);
  entries_ = std::move(other.entries_);
  return *this;
}

std::vector<int> Asha::rungs() const { return rungs_; }

int Asha::rung_index(int step) const {
  const auto it = std::lower_bound(rungs_.begin(), rungs_.end(), step);
  return it != rungs_.end() && *it == step ? static_cast<int>(it - rungs_.begin()) : -1;
}

bool Asha::is_rung(int step) const { return rung_index(step) >= 0; }

int Asha::next_rung(int step) const {
  const auto it = std::upper_bound(rungs_.begin(), rungs_.end(), step);
  return it == rungs_.end() ? max_steps_ : *it;
}

int Asha::recorded(int k) const {
  std::lock_guard<std::mutex> lock(mu_);
  ZT_CHECK(k >= 0 && k < static_cast<int>(entries_.size()), "rung index ", k);
  return static_cast<int>(entries_[static_cast<size_t>(k)].size());
}

bool Asha::report(int trial, int step, double loss) {
  std::lock_guard<std::mutex> lock(mu_);
  const int k = rung_index(step);
  ZT_CHECK(k >= 0, "ASHA: trial ", trial, " reported at step ", step, ", which is not a rung");
  std::vector<Entry>& rung = entries_[static_cast<size_t>(k)];
  for (const Entry& e : rung) {
    if (e.trial != trial) continue;
    ZT_CHECK(std::memcmp(&e.reported, &loss, sizeof loss) == 0, "ASHA: trial ", trial, " reported step ", step,
             " twice with different losses (", e.reported, " then ", loss, ")");
    return e.promoted;
  }
  if (k > 0) {
    const std::vector<Entry>& below = entries_[static_cast<size_t>(k - 1)];
    const bool continued = std::any_of(below.begin(), below.end(),
                                       [&](const Entry& e) { return e.trial == trial && e.promoted; });
    ZT_CHECK(continued, "ASHA: trial ", trial, " reported step ", step, " without continuing from step ",
             rungs_[static_cast<size_t>(k - 1)]);
  }
  const bool finite = std::isfinite(loss);
  const double key = finite ? loss : INFINITY;
  // Rank among every loss at this rung, itself included: (loss, trial id) ascending.
  size_t better = 0;
  for (const Entry& e : rung)
    if (e.loss < key || (e.loss == key && e.trial < trial)) ++better;
  const size_t n = rung.size() + 1;
  const auto top = static_cast<size_t>(std::floor(static_cast<double>(n) / eta_));
  const bool promoted = finite && better < top;
  rung.push_back({trial, key, promoted, loss});
  return promoted;
}

}  // namespace zt::sweep
