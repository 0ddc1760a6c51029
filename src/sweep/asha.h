// Early stopping for a sweep: asynchronous successive halving (ASHA), decided at each rung as a
// trial reports, so a stopped trial frees its devices at once.
#pragma once

#include <mutex>
#include <vector>

namespace zt::sweep {

// src/sweep/asha.h — asynchronous successive halving (Li et al., "A System for Massively
// Parallel Hyperparameter Tuning", ASHA): rungs at min_steps * eta^k (k = 0.., below max_steps);
// a trial reaching rung k with loss L is promoted (continues) iff it is in the top
// floor(n_k / eta) of the n_k losses recorded at rung k so far (ties: smaller trial id first);
// otherwise it stops. scheduler none: every trial continues to max_steps.
//
// Details: n_k counts the reporting trial itself, so the first trials at a rung (n_k < eta) stop;
// a decision is final when made (later, better reports never revive a stopped trial). Rung k's
// step is min_steps * eta^k rounded to the nearest integer, halves up (the product by repeated
// double multiplication, identical on every machine); a rung that rounds onto the previous one is
// skipped. A non-finite loss (a diverged trial) is recorded as worse than every finite one and
// always stops. Thread-safe; decisions depend only on the order of report() calls.
class Asha {
 public:
  // Throws kInvalidArgument (one sentence naming --min-steps, --max-steps or --eta) unless
  // 1 <= min_steps <= max_steps and eta > 1 (finite).
  Asha(int min_steps, int max_steps, double eta);
  Asha(Asha&& other) noexcept;             // movable (the mutex is not moved; a fresh one guards the state)
  Asha& operator=(Asha&& other) noexcept;
  std::vector<int> rungs() const;                       // the steps at which trials report
  // Record trial's validation loss at `step` (a rung); returns true = continue, false = stop.
  // Throws kInternal when `step` is not a rung, when the trial did not continue from the rung
  // below, or when it reports a rung again with a different loss; the same (trial, step, loss)
  // again returns the decision made the first time (a resumed trial re-reaching a rung).
  bool report(int trial, int step, double loss);
  // Resumability: rebuild the state from recorded (trial, step, loss) in the original order.
  // (report() called again with the same history gives the same decisions.)

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

  int min_steps_ = 1, max_steps_ = 1;
  double eta_ = 3;
  std::vector<int> rungs_;
  mutable std::mutex mu_;
  std::vector<std::vector<Entry>> entries_;  // per rung, in arrival order
};

}  // namespace zt::sweep
