// ASHA's rung arithmetic and promotion rule (see asha.h); the sweep runner calls report() at
// each rung, pauses the trial when it returns false, and asks promotable() before it starts a
// new trial.
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

namespace {

// Rung entries in rank order, (loss, trial id) ascending.
template <class Entry>
std::vector<const Entry*> ranked(const std::vector<Entry>& rung) {
  std::vector<const Entry*> order;
  for (const Entry& e : rung) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->loss < b->loss || (a->loss == b->loss && a->trial < b->trial);
  });
  return order;
}

}  // namespace

std::vector<std::pair<int, int>> Asha::promotable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return promotable_locked();
}

std::vector<std::pair<int, int>> Asha::promotable_locked() const {
  std::vector<std::pair<int, int>> out;
  for (size_t k = entries_.size(); k-- > 0;) {
    const std::vector<Entry>& rung = entries_[k];
    const auto top = static_cast<size_t>(std::floor(static_cast<double>(rung.size()) / eta_));
    const std::vector<const Entry*> order = ranked(rung);
    for (size_t i = 0; i < top && i < order.size(); ++i)
      if (!order[i]->promoted && std::isfinite(order[i]->loss)) out.emplace_back(order[i]->trial, rungs_[k]);
  }
  return out;
}

void Asha::promote(int trial, int step) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<std::pair<int, int>> can = promotable_locked();
  ZT_CHECK(std::find(can.begin(), can.end(), std::make_pair(trial, step)) != can.end(), "ASHA: trial ", trial,
           " is not promotable from step ", step);
  for (Entry& e : entries_[static_cast<size_t>(rung_index(step))])
    if (e.trial == trial) e.promoted = true;
}

}  // namespace zt::sweep
