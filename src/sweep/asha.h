// Early stopping for a sweep: asynchronous successive halving (ASHA), decided at each rung as a
// trial reports, so a stopped trial frees its devices at once.
#pragma once

#include <mutex>
#include <utility>
#include <vector>

namespace zt::sweep {

// Asynchronous successive halving (Li et al., "A System for Massively Parallel Hyperparameter
// Tuning", ASHA, Algorithm 2): rungs at min_steps * eta^k (k = 0.., below max_steps). A trial
// reaching rung k with loss L continues at once iff it is in the top floor(n_k / eta) of the n_k
// losses recorded at rung k so far (ties: smaller trial id first). Otherwise it is paused, not
// stopped: as later trials report, the top fraction of rung k grows, and promotable() names the
// paused trials now in it (the paper's get_job looks for a promotion before starting a new trial).
// A trial still paused when the sweep runs out of work has stopped there.
//
// Details: n_k counts the reporting trial itself, so the first trials at a rung (n_k < eta)
// pause. Rung k's step is min_steps * eta^k rounded to the nearest integer, halves up (the product
// by repeated double multiplication, identical on every machine); a rung that rounds onto the
// previous one is skipped. A non-finite loss (a diverged trial) is recorded as worse than every
// finite one and is never promoted. Thread-safe; decisions depend only on the order of report()
// and promote() calls.
class Asha {
 public:
  // Throws kInvalidArgument (one sentence naming --min-steps, --max-steps or --eta) unless
  // 1 <= min_steps <= max_steps and eta > 1 (finite).
  Asha(int min_steps, int max_steps, double eta);
  Asha(Asha&& other) noexcept;             // movable (the mutex is not moved; a fresh one guards the state)
  Asha& operator=(Asha&& other) noexcept;
  std::vector<int> rungs() const;                       // the steps at which trials report
  // Record trial's validation loss at `step` (a rung); returns true = continue (promoted on
  // arrival), false = pause (promotable() may name it later).
  // Throws kInternal when `step` is not a rung, when the trial did not continue from the rung
  // below, or when it reports a rung again with a different loss; the same (trial, step, loss)
  // again returns the decision made the first time (a resumed trial re-reaching a rung).
  bool report(int trial, int step, double loss);
  // Resumability: rebuild the state by replaying the recorded report() and promote() calls in
  // their original order (the same history gives the same decisions).

  // Paused trials that are now in their rung's top floor(n_k / eta), best first: from the highest
  // rung down, by (loss, trial id) within a rung. Each entry is (trial, the rung's step).
  std::vector<std::pair<int, int>> promotable() const;
  // Promotes a paused trial from rung `step`: it continues to the next rung. Throws kInternal
  // unless (trial, step) is one of promotable().
  void promote(int trial, int step);

  int min_steps() const { return min_steps_; }
  int max_steps() const { return max_steps_; }
  double eta() const { return eta_; }
  bool is_rung(int step) const;
  // The first rung after `step`, or max_steps when none is left: where a continuing trial
  // evaluates and reports next.
  int next_rung(int step) const;
  // Losses recorded at rung index k so far.
  int recorded(int k) const;

 private:
  struct Entry {
    int trial;
    double loss;  // non-finite losses stored as +inf
    bool promoted;
    double reported;  // the loss as reported (bitwise, NaN too) for the repeat check
  };
  int rung_index(int step) const;  // -1 when not a rung
  std::vector<std::pair<int, int>> promotable_locked() const;

  int min_steps_ = 1, max_steps_ = 1;
  double eta_ = 3;
  std::vector<int> rungs_;
  mutable std::mutex mu_;
  std::vector<std::vector<Entry>> entries_;  // per rung, in arrival order
};

}  // namespace zt::sweep
