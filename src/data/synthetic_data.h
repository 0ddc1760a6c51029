// The default dataset: a byte corpus drawn from a random order-2 Markov chain whose entropy rate
// (the best loss any model can reach, nats/token) is computed exactly, so a training run can be
// judged against a known floor without downloading anything.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "data/language_data.h"

namespace zt {

// The source: 23 symbols ('a'..'t', ' ', '\n', '.'); a context is the previous two symbols
// (a, b), numbered a * kSymbols + b. Each context has 2-5 successors with random weights, about a
// quarter of them near-deterministic. Irreducibility is built in, not hoped for: every context's
// successors include the next symbol of a de Bruijn sequence B(23, 2), whose cycle passes through
// all 529 contexts, so the stationary distribution is unique and the corpus visits every context.
class MarkovSource {
 public:
  static constexpr int kSymbols = 23;
  static constexpr int kContexts = kSymbols * kSymbols;
  static constexpr int kMinSuccessors = 2;
  static constexpr int kMaxSuccessors = 5;

  explicit MarkovSource(uint64_t seed);

  static uint8_t symbol_byte(int symbol);  // the byte a symbol is written as
  static int byte_symbol(uint8_t byte);    // -1 for bytes outside the alphabet
  // P(next | context), exactly as sampling uses it.
  double prob(int context, int next) const {
    return probs_[static_cast<size_t>(context) * kSymbols + static_cast<size_t>(next)];
  }
  // Stationary distribution over contexts: pi P = pi to ~1e-12 (lazy power iteration in double).
  const std::vector<double>& stationary() const { return stationary_; }
  // H(X_t | X_{t-2}, X_{t-1}) under pi, in nats: the entropy rate of the chain.
  double entropy_rate() const { return entropy_rate_; }
  // H(X_t | X_{t-1}) under pi: the best loss for a target that sees one token of context.
  double order1_entropy() const { return order1_entropy_; }
  // Best mean loss over a window of T targets: the first target sees one token, the others two or
  // more, so (order1_entropy + (T-1) * entropy_rate) / T.
  double loss_floor(int T) const;
  // n bytes of text: the first context drawn from pi, then the chain; Philox stream `stream`.
  std::vector<uint8_t> generate(uint64_t n, uint64_t stream) const;
  int power_iterations() const { return power_iterations_; }

 private:
  uint64_t seed_;
  std::vector<double> probs_;  // [kContexts, kSymbols]
  std::vector<double> stationary_;
  double entropy_rate_ = 0;
  double order1_entropy_ = 0;
  int power_iterations_ = 0;
};

// A source and the corpus it generated: immutable, so every SyntheticData of one (seed, size) in
// a process shares one (see SyntheticData).
struct SyntheticCorpus {
  MarkovSource source;
  std::vector<uint8_t> bytes;
};

// Bytes as tokens (vocab 256); the last 10% of the corpus is the validation split. The source and
// corpus of the last few (seed, size) pairs opened are kept for the process: a process that trains
// again and again (tests, sweeps) draws each corpus once, where generating 2 MiB took ~15% of a
// short run.
class SyntheticData : public TokenWindows {
 public:
  static constexpr uint64_t kDefaultBytes = uint64_t{2} << 20;  // 2 MiB

  explicit SyntheticData(uint64_t seed, uint64_t corpus_bytes = kDefaultBytes);

  std::string describe() const override;
  std::optional<double> entropy_rate() const override { return source().entropy_rate(); }
  std::optional<double> loss_floor(int T) const override { return source().loss_floor(T); }

  const MarkovSource& source() const { return shared_->source; }
  const std::vector<uint8_t>& corpus() const { return shared_->bytes; }

 private:
  std::shared_ptr<const SyntheticCorpus> shared_;
};

}  // namespace zt
