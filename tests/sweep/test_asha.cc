// ASHA (src/sweep/asha.h): rung steps, the promotion rule on hand-derived toys and against a
// direct sort-based implementation of the rule over random asynchronous arrival orders, replay.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "core/status.h"
#include "sweep/asha.h"
#include "test_util.h"

namespace zt::sweep {
namespace {

struct Report {
  int trial, step;
  double loss;
};

// The rule written out directly: every loss recorded at the rung so far (this one included),
// sorted by (loss, trial id); continue iff this trial's position is below floor(n / eta), with
// eta = eta_num / eta_den so the floor is integer arithmetic, independent of Asha's doubles.
class ReferenceAsha {
 public:
  ReferenceAsha(int eta_num, int eta_den) : num_(eta_num), den_(eta_den) {}
  bool report(int trial, int step, double loss) {
    auto& at = recorded_[step];
    at.emplace_back(std::isfinite(loss) ? loss : INFINITY, trial);
    auto sorted = at;
    std::sort(sorted.begin(), sorted.end());
    const auto pos = std::find(sorted.begin(), sorted.end(), std::make_pair(at.back().first, trial)) - sorted.begin();
    const long top = static_cast<long>(at.size()) * den_ / num_;
    return std::isfinite(loss) && pos < top;
  }

 private:
  int num_, den_;
  std::map<int, std::vector<std::pair<double, int>>> recorded_;
};

TEST(Asha, RungsAreMinStepsTimesPowersOfEtaBelowMaxSteps) {
  EXPECT_EQ(Asha(1, 9, 3).rungs(), (std::vector<int>{1, 3}));
  EXPECT_EQ(Asha(1, 10, 3).rungs(), (std::vector<int>{1, 3, 9}));
  EXPECT_EQ(Asha(1, 27, 3).rungs(), (std::vector<int>{1, 3, 9}));
  EXPECT_EQ(Asha(22, 600, 3).rungs(), (std::vector<int>{22, 66, 198, 594}));
  EXPECT_EQ(Asha(2, 100, 2).rungs(), (std::vector<int>{2, 4, 8, 16, 32, 64}));
  EXPECT_EQ(Asha(100, 1000, 4).rungs(), (std::vector<int>{100, 400}));
  // min == max: nothing to stop early at.
  EXPECT_TRUE(Asha(50, 50, 3).rungs().empty());
  // eta 2.5: 1, 2.5 -> 3, 6.25 -> 6, 15.625 -> 16 (halves round up).
  EXPECT_EQ(Asha(1, 20, 2.5).rungs(), (std::vector<int>{1, 3, 6, 16}));
  // eta 1.5: 1, 1.5 -> 2, 2.25 -> 2 (repeats rung 2: skipped), 3.375 -> 3, 5.06 -> 5, 7.59 -> 8.
  EXPECT_EQ(Asha(1, 10, 1.5).rungs(), (std::vector<int>{1, 2, 3, 5, 8}));
  // Closed form for integer eta over many (min, max, eta).
  for (int eta = 2; eta <= 5; ++eta)
    for (int min = 1; min <= 7; ++min)
      for (int max = min; max <= 200; max += 7) {
        std::vector<int> want;
        for (long r = min; r < max; r *= eta) want.push_back(static_cast<int>(r));
        EXPECT_EQ(Asha(min, max, eta).rungs(), want) << min << " " << max << " " << eta;
      }
}

TEST(Asha, NextRungAndIsRung) {
  const Asha a(1, 9, 3);
  EXPECT_EQ(a.next_rung(0), 1);
  EXPECT_EQ(a.next_rung(1), 3);
  EXPECT_EQ(a.next_rung(2), 3);
  EXPECT_EQ(a.next_rung(3), 9);
  EXPECT_EQ(a.next_rung(8), 9);
  EXPECT_TRUE(a.is_rung(1));
  EXPECT_TRUE(a.is_rung(3));
  EXPECT_FALSE(a.is_rung(2));
  EXPECT_FALSE(a.is_rung(9));
}

// 9 trials, eta 3, min 1, max 9: rungs at steps 1 and 3. Losses at step 1, by trial id:
//   0: 0.9  1: 0.5  2: 0.7  3: 0.3  4: 0.8  5: 0.6  6: 0.2  7: 0.95  8: 0.4
// Arrivals in id order (n = entries at the rung with this one, top = floor(n / 3)):
//   t0 n1 top0 stop | t1 n2 top0 stop | t2 n3 top1, 0.5 better -> stop | t3 n4 top1, best -> go
//   t4 n5 top1 stop | t5 n6 top2, 0.3 0.5 better -> stop | t6 n7 top2, best -> go | t7 n8 stop
//   t8 n9 top3, 0.2 0.3 better -> rank 2 -> go.                      promoted at step 1: {3, 6, 8}
// At step 3 (arrivals 3, 6, 8 with 0.25, 0.18, 0.1): n1 stop, n2 stop, n3 top1 best -> go: only
// trial 8 trains to step 9.
constexpr double kStep1[9] = {0.9, 0.5, 0.7, 0.3, 0.8, 0.6, 0.2, 0.95, 0.4};

TEST(Asha, ClosedFormToyInIdOrder) {
  Asha a(1, 9, 3);
  std::vector<int> promoted;
  for (int t = 0; t < 9; ++t)
    if (a.report(t, 1, kStep1[t])) promoted.push_back(t);
  EXPECT_EQ(promoted, (std::vector<int>{3, 6, 8}));
  EXPECT_FALSE(a.report(3, 3, 0.25));
  EXPECT_FALSE(a.report(6, 3, 0.18));
  EXPECT_TRUE(a.report(8, 3, 0.1));
  EXPECT_EQ(a.recorded(0), 9);
  EXPECT_EQ(a.recorded(1), 3);
}

// The same losses arriving in the reverse order: ASHA judges each arrival against what its rung
// holds at that moment, so the set differs from the id-order run (and from synchronous halving,
// which would keep the best three, {6, 3, 8}).
//   t8 0.4 n1 stop | t7 n2 stop | t6 0.2 n3 top1 best -> go | t5 0.6 n4 top1 stop | t4 n5 stop
//   t3 0.3 n6 top2, only 0.2 better -> go | t2 n7 top2 stop | t1 0.5 n8 top2, 0.4 0.2 0.3 better
//   -> stop | t0 n9 top3 stop.                                          promoted: {6, 3}
TEST(Asha, ArrivalOrderMatters) {
  Asha a(1, 9, 3);
  std::vector<int> promoted;
  for (int t = 8; t >= 0; --t)
    if (a.report(t, 1, kStep1[t])) promoted.push_back(t);
  EXPECT_EQ(promoted, (std::vector<int>{6, 3}));

  // A trial early at a rung with few entries is judged against those alone: with eta 2, the
  // second arrival continues when it beats the first, however good later arrivals are.
  Asha b(1, 4, 2);
  EXPECT_FALSE(b.report(0, 1, 5.0));  // n 1, top 0
  EXPECT_TRUE(b.report(1, 1, 4.0));   // n 2, top 1, best of {5, 4}
  EXPECT_FALSE(b.report(2, 1, 4.5));  // n 3, top 1, 4.0 better
  EXPECT_TRUE(b.report(3, 1, 0.1));   // n 4, top 2
  EXPECT_TRUE(b.report(4, 1, 0.2));   // n 5, top 2, only 0.1 better
  EXPECT_FALSE(b.report(5, 1, 4.0));  // n 6, top 3, 0.1 0.2 4.0(trial 1, smaller id) better
}

TEST(Asha, TiesGoToTheSmallerTrialId) {
  {
    Asha a(1, 4, 2);
    EXPECT_FALSE(a.report(5, 1, 1.0));  // n 1
    EXPECT_TRUE(a.report(3, 1, 1.0));   // n 2, top 1: the tie with trial 5 goes to 3
  }
  {
    Asha a(1, 4, 2);
    EXPECT_FALSE(a.report(3, 1, 1.0));
    EXPECT_FALSE(a.report(5, 1, 1.0));  // trial 3 ranks first
  }
}

TEST(Asha, NonFiniteLossesStopAndRankLast) {
  Asha a(1, 4, 2);
  EXPECT_FALSE(a.report(0, 1, NAN));
  EXPECT_TRUE(a.report(1, 1, 7.0));  // n 2, top 1: any finite loss beats NaN
  EXPECT_FALSE(a.report(2, 1, INFINITY));
  EXPECT_FALSE(a.report(3, 1, NAN));  // n 4, top 2, but a NaN never continues
  EXPECT_TRUE(a.report(4, 1, 9.0));   // n 5, top 2: 7.0 better, NaN/inf worse
}

// Many trials, random losses, reports interleaved as an asynchronous sweep would make them:
// each trial starts at a random time and takes a random time per rung. Asha agrees with the
// direct implementation on every decision, and a fresh Asha replaying the history agrees too.
TEST(Asha, MatchesDirectRuleOverRandomArrivalOrders) {
  struct Case {
    int min, max, num, den;
  };
  for (const Case c : {Case{1, 27, 3, 1}, Case{2, 64, 2, 1}, Case{1, 20, 5, 2}, Case{3, 200, 4, 1}}) {
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      test_util::Rng rng(seed);
      const int trials = 40;
      const auto losses = rng.uniform(trials * 8, 0.0f, 10.0f);
      const auto start = rng.uniform(trials, 0.0f, 5.0f);
      const auto duration = rng.uniform(trials * 8, 0.5f, 2.0f);
      const double eta = static_cast<double>(c.num) / c.den;
      Asha asha(c.min, c.max, eta);
      ReferenceAsha ref(c.num, c.den);
      const std::vector<int> rungs = asha.rungs();
      ASSERT_GE(rungs.size(), 3u);
      // (time, trial, rung index) events, earliest first.
      std::vector<std::tuple<double, int, int>> queue;
      for (int t = 0; t < trials; ++t) queue.emplace_back(start[static_cast<size_t>(t)], t, 0);
      std::vector<Report> history;
      std::vector<bool> decisions;
      while (!queue.empty()) {
        const auto it = std::min_element(queue.begin(), queue.end());
        const auto [time, t, k] = *it;
        queue.erase(it);
        const double loss = losses[static_cast<size_t>(t * 8 + k)];
        const int step = rungs[static_cast<size_t>(k)];
        const bool go = asha.report(t, step, loss);
        ASSERT_EQ(go, ref.report(t, step, loss)) << "trial " << t << " step " << step << " seed " << seed;
        history.push_back({t, step, loss});
        decisions.push_back(go);
        if (go && k + 1 < static_cast<int>(rungs.size()))
          queue.emplace_back(time + duration[static_cast<size_t>(t * 8 + k)], t, k + 1);
      }
      // Some trials continue at every rung and some stop: the toy exercises both outcomes.
      EXPECT_NE(std::count(decisions.begin(), decisions.end(), true), 0);
      EXPECT_NE(std::count(decisions.begin(), decisions.end(), false), 0);

      Asha replay(c.min, c.max, eta);
      for (size_t i = 0; i < history.size(); ++i)
        ASSERT_EQ(replay.report(history[i].trial, history[i].step, history[i].loss), decisions[i]) << i;
      // After a replay, a resumed trial re-reaching a rung with the same loss gets the decision
      // made the first time, whatever has been recorded since.
      for (size_t i = 0; i < history.size(); ++i)
        ASSERT_EQ(replay.report(history[i].trial, history[i].step, history[i].loss), decisions[i]) << i;
    }
  }
}

TEST(Asha, MovedStateKeepsDeciding) {
  Asha a(1, 9, 3);
  for (int t = 0; t < 5; ++t) a.report(t, 1, kStep1[t]);
  Asha b = std::move(a);
  for (int t = 5; t < 9; ++t) EXPECT_EQ(b.report(t, 1, kStep1[t]), t == 6 || t == 8) << t;  // as in id order
  Asha c(2, 4, 2);
  c = std::move(b);
  EXPECT_EQ(c.rungs(), (std::vector<int>{1, 3}));
  EXPECT_EQ(c.recorded(0), 9);
}

TEST(Asha, MisuseIsAnInternalError) {
  Asha a(1, 9, 3);
  const auto kind_of = [&](int trial, int step, double loss) -> std::optional<ErrorKind> {
    try {
      a.report(trial, step, loss);
    } catch (const Error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  EXPECT_EQ(kind_of(0, 2, 1.0), ErrorKind::kInternal);  // not a rung
  EXPECT_EQ(kind_of(0, 9, 1.0), ErrorKind::kInternal);  // max_steps is the end, not a rung
  EXPECT_EQ(kind_of(0, 3, 1.0), ErrorKind::kInternal);  // never reported step 1
  EXPECT_FALSE(a.report(0, 1, 1.0));                    // n 1: stops
  EXPECT_EQ(kind_of(0, 3, 1.0), ErrorKind::kInternal);  // stopped at step 1
  EXPECT_EQ(kind_of(0, 1, 2.0), ErrorKind::kInternal);  // step 1 again with another loss
  EXPECT_FALSE(a.report(0, 1, 1.0));                    // the same report again: same answer
  EXPECT_EQ(a.recorded(0), 1);
}

// A paused trial is promoted once later reports lift it into its rung's top floor(n/eta), the
// highest rung first (Li et al., Algorithm 2). Hand-derived with eta 3, rungs 1 and 3.
TEST(Asha, PausedTrialsArePromotedWhenTheTopFractionGrows) {
  Asha a(1, 9, 3);
  using P = std::vector<std::pair<int, int>>;
  EXPECT_FALSE(a.report(0, 1, 5.0));  // n 1, top 0: paused
  EXPECT_FALSE(a.report(1, 1, 4.0));  // n 2, top 0: paused
  EXPECT_TRUE(a.promotable().empty());
  EXPECT_FALSE(a.report(2, 1, 6.0));  // n 3, top 1 = trial 1 (4.0), not trial 2
  EXPECT_EQ(a.promotable(), (P{{1, 1}}));
  a.promote(1, 1);
  EXPECT_TRUE(a.promotable().empty());
  EXPECT_TRUE(a.report(3, 1, 3.0));   // n 4, top 1: the best so far continues on arrival
  EXPECT_FALSE(a.report(4, 1, 7.0));  // n 5, top 1
  EXPECT_FALSE(a.report(5, 1, 8.0));  // n 6, top 2 = trials 3 and 1, both promoted already
  EXPECT_TRUE(a.promotable().empty());
  EXPECT_FALSE(a.report(6, 1, 4.5));  // n 7, top 2
  EXPECT_FALSE(a.report(7, 1, 9.0));  // n 8, top 2
  EXPECT_FALSE(a.report(1, 3, 2.0));  // rung 3: n 1, top 0
  EXPECT_FALSE(a.report(3, 3, 2.5));  // n 2, top 0
  EXPECT_FALSE(a.report(8, 1, 9.5));  // rung 1: n 9, top 3 = trials 3, 1, 6
  // Trial 1 is the top of rung 3 once it holds three reports; for now only rung 1 has one.
  EXPECT_EQ(a.promotable(), (P{{6, 1}}));
  a.promote(6, 1);
  EXPECT_TRUE(a.report(6, 3, 1.0));   // rung 3: n 3, top 1, and 1.0 is the best there
  EXPECT_TRUE(a.promotable().empty());  // rung 3's top is trial 6, rung 1's are 3, 1, 6: all promoted
  EXPECT_THROW(a.promote(0, 1), Error);  // 5.0 is not in rung 1's top 3 (3.0, 4.0, 4.5)
}

// promotable() lists the highest rung first. eta 2, rungs 1 and 2.
TEST(Asha, PromotionsFromTheHighestRungFirst) {
  Asha a(1, 4, 2);
  using P = std::vector<std::pair<int, int>>;
  EXPECT_FALSE(a.report(0, 1, 1.0));  // n 1, top 0
  EXPECT_FALSE(a.report(1, 1, 2.0));  // n 2, top 1 = trial 0
  EXPECT_EQ(a.promotable(), (P{{0, 1}}));
  a.promote(0, 1);
  EXPECT_FALSE(a.report(0, 2, 3.0));  // rung 2: n 1, top 0
  EXPECT_TRUE(a.report(2, 1, 0.5));   // n 3, top 1
  EXPECT_FALSE(a.report(2, 2, 4.0));  // rung 2: n 2, top 1 = trial 0
  EXPECT_EQ(a.promotable(), (P{{0, 2}}));
  for (int t = 3; t <= 9; ++t) a.report(t, 1, std::vector<double>{1.5, 0.1, 0.2, 1.2, 5.0, 6.0, 7.0}[t - 3]);
  // Rung 1, ten reports, top 5: 0.1 (4), 0.2 (5), 0.5 (2), 1.0 (0), 1.2 (6); only trial 6 waits.
  EXPECT_EQ(a.promotable(), (P{{0, 2}, {6, 1}}));
}

TEST(Asha, BadSettingsAreOneSentence) {
  const auto message = [](int min, int max, double eta) -> std::string {
    try {
      Asha a(min, max, eta);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      return e.message();
    }
    return "";
  };
  EXPECT_NE(message(0, 10, 3).find("--min-steps"), std::string::npos);
  EXPECT_NE(message(10, 5, 3).find("--max-steps"), std::string::npos);
  EXPECT_NE(message(1, 10, 1).find("--eta"), std::string::npos);
  EXPECT_NE(message(1, 10, 0.5).find("--eta"), std::string::npos);
  EXPECT_NE(message(1, 10, NAN).find("--eta"), std::string::npos);
  EXPECT_NE(message(1, 10, INFINITY).find("--eta"), std::string::npos);
  for (const std::string& m : {message(0, 10, 3), message(10, 5, 3), message(1, 10, 1)}) {
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_EQ(m.back(), '.') << m;
  }
}

}  // namespace
}  // namespace zt::sweep
