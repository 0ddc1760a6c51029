// The order-2 Markov source, its exact stationary distribution and entropy rate, and the corpus.
// All randomness is Philox keyed by the seed, so a seed names one chain and one corpus everywhere.
#include "data/synthetic_data.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <utility>

#include "core/philox.h"
#include "core/status.h"

namespace zt {

namespace {

constexpr uint64_t kChainStream = fnv1a("zt/data/synthetic/chain");
constexpr uint64_t kCorpusStream = fnv1a("zt/data/synthetic/corpus");
constexpr uint64_t kWordsPerContext = 64;  // Philox words reserved for drawing one context's row

// Stationary distribution: stop when an iteration moves pi by less than this (L1). Rounding puts
// the floor near 529 * 1e-16, so this is as tight as double allows.
constexpr double kStationaryTolerance = 1e-13;
constexpr int kMaxPowerIterations = 10'000'000;

constexpr char kAlphabet[MarkovSource::kSymbols + 1] = "abcdefghijklmnopqrst \n.";

// De Bruijn sequence B(k, 2) by the FKM (Lyndon word) algorithm: every ordered pair of symbols
// occurs exactly once as a cyclically consecutive pair.
void de_bruijn(int k, int n, int t, int p, std::vector<int>& a, std::vector<int>& out) {
  if (t > n) {
    if (n % p == 0) out.insert(out.end(), a.begin() + 1, a.begin() + p + 1);
    return;
  }
  a[static_cast<size_t>(t)] = a[static_cast<size_t>(t - p)];
  de_bruijn(k, n, t + 1, p, a, out);
  for (int j = a[static_cast<size_t>(t - p)] + 1; j < k; ++j) {
    a[static_cast<size_t>(t)] = j;
    de_bruijn(k, n, t + 1, t, a, out);
  }
}

// Uniform double in (0, 1) from 64 random bits, 53 of them kept.
double unit_double(uint32_t hi, uint32_t lo) {
  const uint64_t x = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return (static_cast<double>(x) + 0.5) * 0x1.0p-53;
}

}  // namespace

uint8_t MarkovSource::symbol_byte(int symbol) { return static_cast<uint8_t>(kAlphabet[symbol]); }

int MarkovSource::byte_symbol(uint8_t byte) {
  for (int s = 0; s < kSymbols; ++s)
    if (static_cast<uint8_t>(kAlphabet[s]) == byte) return s;
  return -1;
}

MarkovSource::MarkovSource(uint64_t seed) : seed_(seed) {
  std::vector<int> a(3, 0), cycle;
  de_bruijn(kSymbols, 2, 1, 1, a, cycle);
  ZT_CHECK(cycle.size() == static_cast<size_t>(kContexts), "de Bruijn length ", cycle.size());
  std::vector<int> cycle_next(kContexts, -1);
  for (size_t j = 0; j < cycle.size(); ++j) {
    const int ctx = cycle[j] * kSymbols + cycle[(j + 1) % cycle.size()];
    cycle_next[static_cast<size_t>(ctx)] = cycle[(j + 2) % cycle.size()];
  }

  probs_.assign(static_cast<size_t>(kContexts) * kSymbols, 0.0);
  for (int ctx = 0; ctx < kContexts; ++ctx) {
    uint64_t word = static_cast<uint64_t>(ctx) * kWordsPerContext;
    auto next_u32 = [&] { return philox_u32(seed, kChainStream, word++); };
    auto next_unit = [&] {
      const uint32_t hi = next_u32();
      return unit_double(hi, next_u32());
    };
    const int k = kMinSuccessors + static_cast<int>(next_u32() % (kMaxSuccessors - kMinSuccessors + 1));
    // Successors: the de Bruijn next symbol plus k-1 others by a partial Fisher-Yates shuffle.
    const int forced = cycle_next[static_cast<size_t>(ctx)];
    std::vector<int> others;
    for (int s = 0; s < kSymbols; ++s)
      if (s != forced) others.push_back(s);
    std::vector<int> succ{forced};
    for (int j = 0; j < k - 1; ++j) {
      const size_t pick = j + next_u32() % (others.size() - static_cast<size_t>(j));
      std::swap(others[static_cast<size_t>(j)], others[pick]);
      succ.push_back(others[static_cast<size_t>(j)]);
    }
    std::vector<double> w(static_cast<size_t>(k));
    if (next_u32() % 4 == 0) {  // near-deterministic: one successor takes almost all the mass
      const int dominant = static_cast<int>(next_u32() % static_cast<uint32_t>(k));
      for (int j = 0; j < k; ++j) w[static_cast<size_t>(j)] = j == dominant ? 1.0 : 0.005 + 0.025 * next_unit();
    } else {  // Dirichlet(1)-like weights, kept off zero so that every successor is seen
      for (int j = 0; j < k; ++j) w[static_cast<size_t>(j)] = 0.02 - std::log(next_unit());
    }
    double total = 0;
    for (double x : w) total += x;
    for (int j = 0; j < k; ++j)
      probs_[static_cast<size_t>(ctx) * kSymbols + static_cast<size_t>(succ[static_cast<size_t>(j)])] =
          w[static_cast<size_t>(j)] / total;
  }

  // Lazy chain (P + I) / 2: same stationary distribution, aperiodic, so power iteration converges.
  std::vector<double> pi(kContexts, 1.0 / kContexts), next(kContexts);
  for (power_iterations_ = 1; power_iterations_ <= kMaxPowerIterations; ++power_iterations_) {
    for (int c = 0; c < kContexts; ++c) next[static_cast<size_t>(c)] = 0.5 * pi[static_cast<size_t>(c)];
    for (int ctx = 0; ctx < kContexts; ++ctx) {
      const double mass = 0.5 * pi[static_cast<size_t>(ctx)];
      const int b = ctx % kSymbols;
      for (int s = 0; s < kSymbols; ++s) {
        const double p = prob(ctx, s);
        if (p > 0) next[static_cast<size_t>(b * kSymbols + s)] += mass * p;
      }
    }
    double total = 0;
    for (double x : next) total += x;
    double moved = 0;
    for (int c = 0; c < kContexts; ++c) {
      next[static_cast<size_t>(c)] /= total;
      moved += std::fabs(next[static_cast<size_t>(c)] - pi[static_cast<size_t>(c)]);
    }
    pi.swap(next);
    if (moved < kStationaryTolerance) break;
  }
  ZT_CHECK(power_iterations_ <= kMaxPowerIterations, "stationary distribution did not converge");
  stationary_ = pi;

  double h2 = 0;
  std::vector<double> joint(static_cast<size_t>(kContexts), 0.0);  // q(b, c)
  std::vector<double> marginal(kSymbols, 0.0);                     // q(b)
  for (int ctx = 0; ctx < kContexts; ++ctx) {
    const double pc = pi[static_cast<size_t>(ctx)];
    const int b = ctx % kSymbols;
    marginal[static_cast<size_t>(b)] += pc;
    for (int s = 0; s < kSymbols; ++s) {
      const double p = prob(ctx, s);
      if (p <= 0) continue;
      h2 -= pc * p * std::log(p);
      joint[static_cast<size_t>(b * kSymbols + s)] += pc * p;
    }
  }
  double h1 = 0;
  for (int bc = 0; bc < kContexts; ++bc) {
    const double q = joint[static_cast<size_t>(bc)];
    if (q > 0) h1 -= q * std::log(q / marginal[static_cast<size_t>(bc / kSymbols)]);
  }
  entropy_rate_ = h2;
  order1_entropy_ = h1;
}

double MarkovSource::loss_floor(int T) const {
  ZT_REQUIRE(T >= 1, "the sequence length must be at least 1 (got ", T, ")");
  return (order1_entropy_ + (T - 1) * entropy_rate_) / T;
}

std::vector<uint8_t> MarkovSource::generate(uint64_t n, uint64_t stream) const {
  ZT_REQUIRE(n >= 2, "a synthetic corpus needs at least 2 bytes (got ", n, ")");
  // Sparse rows for sampling: successor symbols and cumulative probabilities.
  std::vector<int> succ(static_cast<size_t>(kContexts) * kMaxSuccessors, 0);
  std::vector<double> cum(static_cast<size_t>(kContexts) * kMaxSuccessors, 0.0);
  std::vector<int> count(kContexts, 0);
  for (int ctx = 0; ctx < kContexts; ++ctx) {
    double c = 0;
    for (int s = 0; s < kSymbols; ++s) {
      if (prob(ctx, s) <= 0) continue;
      const size_t at = static_cast<size_t>(ctx) * kMaxSuccessors + static_cast<size_t>(count[static_cast<size_t>(ctx)]++);
      c += prob(ctx, s);
      succ[at] = s;
      cum[at] = c;
    }
  }
  std::vector<uint8_t> out(n);
  auto uniform = [&](uint64_t t) {
    const Philox4x32 r = philox_block(seed_, stream, t);
    return unit_double(r.v[0], r.v[1]);
  };
  // First context from pi, so that the corpus is stationary from its first byte.
  int ctx = kContexts - 1;
  double u = uniform(0), c = 0;
  for (int k = 0; k < kContexts; ++k) {
    c += stationary_[static_cast<size_t>(k)];
    if (u < c) {
      ctx = k;
      break;
    }
  }
  out[0] = symbol_byte(ctx / kSymbols);
  out[1] = symbol_byte(ctx % kSymbols);
  for (uint64_t t = 2; t < n; ++t) {
    u = uniform(t);
    const size_t base = static_cast<size_t>(ctx) * kMaxSuccessors;
    const int m = count[static_cast<size_t>(ctx)];
    int s = succ[base + static_cast<size_t>(m - 1)];  // rounding: cum may end just below 1
    for (int j = 0; j < m; ++j) {
      if (u < cum[base + static_cast<size_t>(j)]) {
        s = succ[base + static_cast<size_t>(j)];
        break;
      }
    }
    out[t] = symbol_byte(s);
    ctx = (ctx % kSymbols) * kSymbols + s;
  }
  return out;
}

namespace {

// The last kCachedCorpora (seed, size) pairs opened, newest last. Bounded: a sweep over seeds
// keeps a few corpora of 2 MiB, not one per seed.
constexpr size_t kCachedCorpora = 4;

std::shared_ptr<const SyntheticCorpus> cached_corpus(uint64_t seed, uint64_t bytes) {
  struct Entry {
    uint64_t seed, bytes;
    std::shared_ptr<const SyntheticCorpus> corpus;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < cache.size(); ++i)
      if (cache[i].seed == seed && cache[i].bytes == bytes) {
        std::rotate(cache.begin() + static_cast<std::ptrdiff_t>(i), cache.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                    cache.end());
        return cache.back().corpus;
      }
  }
  // Drawn outside the lock (two threads may both draw one; the bytes are the same).
  MarkovSource source(seed);
  std::vector<uint8_t> corpus = source.generate(bytes, kCorpusStream);
  auto made = std::make_shared<const SyntheticCorpus>(SyntheticCorpus{std::move(source), std::move(corpus)});
  const std::lock_guard<std::mutex> lock(mu);
  if (cache.size() == kCachedCorpora) cache.erase(cache.begin());
  cache.push_back({seed, bytes, made});
  return made;
}

}  // namespace

SyntheticData::SyntheticData(uint64_t seed, uint64_t corpus_bytes)
    : TokenWindows(seed, 256, "synthetic"), shared_(cached_corpus(seed, corpus_bytes)) {
  const std::vector<uint8_t>& bytes = corpus();
  const uint64_t n_val = bytes.size() / 10;
  const uint64_t n_train = bytes.size() - n_val;
  segments_[0].push_back(TokenSegment{bytes.data(), nullptr, n_train});
  segments_[1].push_back(TokenSegment{bytes.data() + n_train, nullptr, n_val});
  split_what_[0] = "first 90% of the synthetic corpus";
  split_what_[1] = "last 10% of the synthetic corpus";
}

std::string SyntheticData::describe() const {
  return "synthetic order-2 Markov corpus (" + std::to_string(corpus().size()) + " bytes, seed " +
         std::to_string(seed()) + ", entropy rate " + std::to_string(source().entropy_rate()) +
         " nats/token)";
}

}  // namespace zt
