// The sweep's search space (src/sweep/space.h): --space texts and the JSON file, grid order,
// seeded random draws inside their ranges, and one clear sentence for every bad spec.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>

#include "core/status.h"
#include "sweep/space.h"
#include "test_util.h"

namespace zt::sweep {
namespace {

using Kind = Dimension::Kind;

const std::vector<std::string> kFlags = {"lr", "min-lr", "warmup-steps", "embd", "layers", "hidden",
                                         "weight-decay", "data", "grad-clip", "seed", "batch-size"};

SearchSpace parse(const std::vector<std::string>& specs, const std::string& file = "") {
  return parse_space(specs, file, kFlags);
}

// The sentence a bad space is refused with (kInvalidArgument); "" when nothing was thrown.
std::string refusal(const std::vector<std::string>& specs, const std::string& file = "") {
  try {
    parse(specs, file);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.message();
    const std::string& m = e.message();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_TRUE(m.back() == '.' || m.back() == '?') << m;
    return m;
  }
  ADD_FAILURE() << "not refused";
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string write_file(const test_util::TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.path(name);
  std::ofstream(path) << text;
  return path;
}

TEST(SweepSpace, ListsAndRanges) {
  const SearchSpace s = parse({"lr=1e-3, 3e-4,1e-4", "--embd=128,256", "warmup-steps=int:0..200",
                               "min-lr=log:1e-5..1e-3", "weight-decay=lin:0..0.2"});
  ASSERT_EQ(s.dims.size(), 5u);
  EXPECT_EQ(s.dims[0].flag, "lr");
  EXPECT_EQ(s.dims[0].kind, Kind::kList);
  EXPECT_EQ(s.dims[0].values, (std::vector<std::string>{"1e-3", "3e-4", "1e-4"}));  // as written
  EXPECT_EQ(s.dims[1].flag, "embd");  // "--" is optional
  EXPECT_EQ(s.dims[1].values, (std::vector<std::string>{"128", "256"}));
  EXPECT_EQ(s.dims[2].kind, Kind::kInt);
  EXPECT_EQ(s.dims[2].lo, 0);
  EXPECT_EQ(s.dims[2].hi, 200);
  EXPECT_EQ(s.dims[3].kind, Kind::kLog);
  EXPECT_EQ(s.dims[3].lo, 1e-5);
  EXPECT_EQ(s.dims[3].hi, 1e-3);
  EXPECT_EQ(s.dims[4].kind, Kind::kLinear);
  EXPECT_EQ(s.dims[4].hi, 0.2);
  EXPECT_FALSE(s.is_grid());
  EXPECT_EQ(s.grid_size(), 0);
  EXPECT_TRUE(parse({"lr=1e-3", "embd=128,256"}).is_grid());
  EXPECT_EQ(parse({"lr=1e-3", "embd=128,256"}).grid_size(), 2);
  // A single-point range is a range of one value, not an error.
  EXPECT_EQ(parse({"warmup-steps=int:5..5"}).dims[0].lo, 5);
  // Values that contain commas are separated by ';'; list values may hold ".." and ':'.
  EXPECT_EQ(parse({"hidden=256,128;512"}).dims[0].values, (std::vector<std::string>{"256,128", "512"}));
  EXPECT_EQ(parse({"data=../a.txt,cpu:2"}).dims[0].values, (std::vector<std::string>{"../a.txt", "cpu:2"}));
}

TEST(SweepSpace, JsonFileInItsOwnOrderAfterTheFlags) {
  test_util::TempDir dir("sweep_space_json");
  const std::string path = write_file(
      dir, "space.json",
      R"({"lr": [1e-3, 3e-4], "warmup-steps": "int:0..200", "embd": [128, 256], "hidden": ["256,128", "512"],)"
      R"( "min-lr": "log:1e-5..1e-4", "grad-clip": "0.5,1", "seed": 7})");
  const SearchSpace s = parse({"layers=2,4"}, path);
  ASSERT_EQ(s.dims.size(), 8u);
  EXPECT_EQ(s.dims[7].kind, Kind::kList);
  EXPECT_EQ(s.dims[7].values, (std::vector<std::string>{"7"}));  // a lone number: one value
  std::vector<std::string> order;
  for (const Dimension& d : s.dims) order.push_back(d.flag);
  EXPECT_EQ(order, (std::vector<std::string>{"layers", "lr", "warmup-steps", "embd", "hidden", "min-lr", "grad-clip",
                                             "seed"}));
  // Numbers keep their value exactly (shortest round-trip text), strings stay as written.
  ASSERT_EQ(s.dims[1].values.size(), 2u);
  EXPECT_EQ(std::strtod(s.dims[1].values[0].c_str(), nullptr), 1e-3);
  EXPECT_EQ(std::strtod(s.dims[1].values[1].c_str(), nullptr), 3e-4);
  EXPECT_EQ(s.dims[2].kind, Kind::kInt);
  EXPECT_EQ(s.dims[2].hi, 200);
  EXPECT_EQ(s.dims[3].values, (std::vector<std::string>{"128", "256"}));
  EXPECT_EQ(s.dims[4].values, (std::vector<std::string>{"256,128", "512"}));
  EXPECT_EQ(s.dims[5].kind, Kind::kLog);
  EXPECT_EQ(s.dims[6].values, (std::vector<std::string>{"0.5", "1"}));  // a list in a spec string
}

TEST(SweepSpace, GridIsTheCartesianProductFirstDimensionSlowest) {
  const SearchSpace s = parse({"lr=a1,a2", "embd=b1,b2,b3", "layers=c1,c2"});
  const auto trials = generate_trials(s, 0, 7);
  ASSERT_EQ(trials.size(), 12u);
  int id = 0;
  for (const char* a : {"a1", "a2"})
    for (const char* b : {"b1", "b2", "b3"})
      for (const char* c : {"c1", "c2"}) {
        const TrialValues& t = trials[static_cast<size_t>(id)];
        EXPECT_EQ(t.id, id);
        const std::vector<std::pair<std::string, std::string>> want = {{"lr", a}, {"embd", b}, {"layers", c}};
        EXPECT_EQ(t.values, want) << id;
        ++id;
      }
  // The grid does not depend on the seed.
  const auto again = generate_trials(s, 0, 99);
  for (size_t i = 0; i < trials.size(); ++i) EXPECT_EQ(again[i].values, trials[i].values);
}

TEST(SweepSpace, RandomDrawsStayInsideTheirRangesAndSpanThem) {
  const SearchSpace s = parse({"lr=log:1e-4..1e-2", "weight-decay=lin:0.1..0.5", "warmup-steps=int:0..200",
                               "embd=64,128,256"});
  const int n = 4000;
  const auto trials = generate_trials(s, n, 1234);
  ASSERT_EQ(trials.size(), static_cast<size_t>(n));
  double log_min = 1e9, log_max = -1e9, log_sum = 0, lin_min = 1e9, lin_max = -1e9, lin_sum = 0;
  std::set<long> ints;
  std::map<std::string, int> embd;
  for (int i = 0; i < n; ++i) {
    const TrialValues& t = trials[static_cast<size_t>(i)];
    EXPECT_EQ(t.id, i);
    ASSERT_EQ(t.values.size(), 4u);
    EXPECT_EQ(t.values[0].first, "lr");
    EXPECT_EQ(t.values[3].first, "embd");
    // Reals are printed as "%.9g" of themselves (enough digits for the value the trial runs).
    const double lr = std::strtod(t.values[0].second.c_str(), nullptr);
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.9g", lr);
    EXPECT_EQ(t.values[0].second, buf);
    ASSERT_GE(lr, 1e-4);
    ASSERT_LE(lr, 1e-2);
    log_min = std::min(log_min, std::log10(lr));
    log_max = std::max(log_max, std::log10(lr));
    log_sum += std::log10(lr);
    const double wd = std::strtod(t.values[1].second.c_str(), nullptr);
    ASSERT_GE(wd, 0.1);
    ASSERT_LE(wd, 0.5);
    lin_min = std::min(lin_min, wd);
    lin_max = std::max(lin_max, wd);
    lin_sum += wd;
    // Integers as "%d": digits only.
    const std::string& w = t.values[2].second;
    ASSERT_EQ(w.find_first_not_of("0123456789"), std::string::npos) << w;
    const long v = std::strtol(w.c_str(), nullptr, 10);
    ASSERT_GE(v, 0);
    ASSERT_LE(v, 200);
    ints.insert(v);
    ++embd[t.values[3].second];
  }
  // Log-uniform: log10 spans [-4, -2] with mean -3 (standard error 0.58/sqrt(4000) = 0.009).
  EXPECT_LT(log_min, -3.99);
  EXPECT_GT(log_max, -2.01);
  EXPECT_NEAR(log_sum / n, -3.0, 0.05);
  EXPECT_LT(lin_min, 0.101);
  EXPECT_GT(lin_max, 0.499);
  EXPECT_NEAR(lin_sum / n, 0.3, 0.01);
  EXPECT_EQ(ints.size(), 201u);  // every integer of 0..200, the bounds included
  ASSERT_EQ(embd.size(), 3u);
  for (const auto& [value, count] : embd) EXPECT_NEAR(count, n / 3.0, 150) << value;
}

TEST(SweepSpace, SameSeedSameTrialsOtherSeedOthers) {
  const SearchSpace s = parse({"lr=log:1e-4..1e-2", "warmup-steps=int:0..200", "layers=2,4"});
  const auto a = generate_trials(s, 20, 5), b = generate_trials(s, 20, 5), c = generate_trials(s, 20, 6);
  ASSERT_EQ(a.size(), 20u);
  size_t same_as_c = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].values, b[i].values);
    same_as_c += a[i].values == c[i].values;
  }
  EXPECT_EQ(same_as_c, 0u);
  // More trials extend the list without changing the first ones; adding a dimension leaves the
  // other dimensions' draws alone.
  const auto longer = generate_trials(s, 30, 5);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(longer[i].values, a[i].values);
  const auto wider = generate_trials(parse({"lr=log:1e-4..1e-2", "embd=lin:1..2", "warmup-steps=int:0..200",
                                            "layers=2,4"}),
                                     20, 5);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(wider[i].values[0], a[i].values[0]);
    EXPECT_EQ(wider[i].values[2], a[i].values[1]);
    EXPECT_EQ(wider[i].values[3], a[i].values[2]);
  }
  // A grid space with --trials draws at random from its lists.
  const auto drawn = generate_trials(parse({"layers=1,2,3,4,5,6,7,8"}), 10, 5);
  ASSERT_EQ(drawn.size(), 10u);
}

TEST(SweepSpace, BadSpecsAreOneSentenceEach) {
  EXPECT_TRUE(contains(refusal({"lrr=1e-3"}), "did you mean 'lr'?"));
  EXPECT_TRUE(contains(refusal({"warmup-stpes=int:0..5"}), "did you mean 'warmup-steps'?"));
  EXPECT_TRUE(contains(refusal({"frobnicate=1"}), "not a train flag."));
  EXPECT_TRUE(contains(refusal({"lr="}), "empty list"));
  EXPECT_TRUE(contains(refusal({"lr=1,,2"}), "empty value"));
  EXPECT_TRUE(contains(refusal({"lr=1,2,1"}), "'1' twice"));
  EXPECT_TRUE(contains(refusal({"lr=lin:0.5..0.1"}), "empty range"));
  EXPECT_TRUE(contains(refusal({"warmup-steps=int:10..2"}), "empty range"));
  EXPECT_TRUE(contains(refusal({"lr=log:0..1e-2"}), "above 0"));
  EXPECT_TRUE(contains(refusal({"lr=log:-1..1e-2"}), "above 0"));
  EXPECT_TRUE(contains(refusal({"warmup-steps=int:0.5..10"}), "whole number"));
  EXPECT_TRUE(contains(refusal({"warmup-steps=int:0..1e300"}), "whole number"));
  EXPECT_TRUE(contains(refusal({"lr=1e-3", "lr=3e-4"}), "'lr' is given twice"));
  EXPECT_TRUE(contains(refusal({"lr=1e-3", "--lr=3e-4"}), "'lr' is given twice"));
  EXPECT_TRUE(contains(refusal({"lr"}), "malformed"));
  EXPECT_TRUE(contains(refusal({"=1e-3"}), "names no flag"));
  EXPECT_TRUE(contains(refusal({"lr=1e-4..1e-2"}), "needs its kind"));
  EXPECT_TRUE(contains(refusal({"lr=exp:1e-4..1e-2"}), "'exp:' is not a range kind"));
  EXPECT_TRUE(contains(refusal({"lr=log:1e-4"}), "LO..HI"));
  EXPECT_TRUE(contains(refusal({"lr=log:a..b"}), "finite numbers"));
  EXPECT_TRUE(contains(refusal({"lr=lin:0..inf"}), "finite numbers"));
  EXPECT_TRUE(contains(refusal({}), "needs a search space"));
}

TEST(SweepSpace, BadSpaceFilesAreOneSentenceEach) {
  test_util::TempDir dir("sweep_space_bad");
  const auto file = [&](const std::string& text) { return refusal({}, write_file(dir, "s.json", text)); };
  EXPECT_TRUE(contains(file(R"({"lr": [1e-3, 3e-4)"), "not valid JSON"));
  EXPECT_TRUE(contains(file(R"([1, 2])"), "not a JSON object"));
  EXPECT_TRUE(contains(file(R"({"lr": [1e-3], "lr": [3e-4]})"), "'lr' is given twice"));
  EXPECT_TRUE(contains(file(R"({"lrr": [1e-3]})"), "did you mean 'lr'?"));
  EXPECT_TRUE(contains(file(R"({"lr": []})"), "empty list"));
  EXPECT_TRUE(contains(file(R"({"lr": null})"), "malformed"));
  EXPECT_TRUE(contains(file(R"({"lr": {"lo": 1}})"), "malformed"));
  EXPECT_TRUE(contains(file(R"({"lr": [[1]]})"), "not a number, string or boolean"));
  EXPECT_TRUE(contains(file(R"({"lr": "log:1..0.5"})"), "empty range"));
  EXPECT_TRUE(contains(file(R"({"warmup-steps": "int:0..2.5"})"), "whole number"));
  EXPECT_TRUE(contains(refusal({"lr=1"}, write_file(dir, "t.json", R"({"lr": [2]})")), "'lr' is given twice"));
  // A missing file is refused before anything starts, by the shared input opener.
  EXPECT_THROW(parse({"lr=1"}, dir.path("missing.json")), Error);
}

TEST(SweepSpace, ProbeValuesAreTheListOrTheBoundsAsTrialsPrintThem) {
  const SearchSpace s = parse({"lr=log:1e-4..1e-2", "warmup-steps=int:-3..200", "embd=64,128", "weight-decay=lin:0..0.25"});
  EXPECT_EQ(probe_values(s.dims[0]), (std::vector<std::string>{"0.0001", "0.01"}));
  EXPECT_EQ(probe_values(s.dims[1]), (std::vector<std::string>{"-3", "200"}));
  EXPECT_EQ(probe_values(s.dims[2]), (std::vector<std::string>{"64", "128"}));
  EXPECT_EQ(probe_values(s.dims[3]), (std::vector<std::string>{"0", "0.25"}));
  // A bound with more digits than "%.9g" keeps is printed in full rather than rounded outside.
  const SearchSpace fine = parse({"lr=lin:0.12345678951..0.12345678959"});
  for (const std::string& v : probe_values(fine.dims[0])) {
    const double x = std::strtod(v.c_str(), nullptr);
    EXPECT_GE(x, fine.dims[0].lo) << v;
    EXPECT_LE(x, fine.dims[0].hi) << v;
  }
  for (const TrialValues& t : generate_trials(fine, 200, 3)) {
    const double x = std::strtod(t.values[0].second.c_str(), nullptr);
    ASSERT_GE(x, fine.dims[0].lo) << t.values[0].second;
    ASSERT_LE(x, fine.dims[0].hi) << t.values[0].second;
  }
}

TEST(SweepSpace, KnownFlagsMayCarryTheirDashes) {
  const SearchSpace s = parse_space({"lr=1,2"}, "", {"--lr", "--steps"});
  EXPECT_EQ(s.dims[0].flag, "lr");
  try {
    parse_space({"stpes=1"}, "", {"--lr", "--steps"});
    ADD_FAILURE() << "not refused";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("did you mean 'steps'?"), std::string::npos) << e.message();
  }
}

TEST(SweepSpace, GenerateRefusesWhatItCannotRun) {
  const auto refused = [](const SearchSpace& s, int trials) -> std::string {
    try {
      generate_trials(s, trials, 1);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      return e.message();
    }
    return "";
  };
  EXPECT_TRUE(contains(refused(parse({"layers=2,4", "lr=log:1e-4..1e-2"}), 0), "--trials N"));
  EXPECT_TRUE(contains(refused(parse({"layers=2,4"}), -1), "--trials"));
  // 10 lists of 4 values: 4^10 > 100000 trials.
  std::vector<std::string> big;
  for (int i = 0; i < 10; ++i) big.push_back(kFlags[static_cast<size_t>(i)] + "=1,2,3,4");
  EXPECT_TRUE(contains(refused(parse(big), 0), "more than"));
  EXPECT_EQ(generate_trials(parse(big), 3, 1).size(), 3u);  // random search over the same lists is fine
  EXPECT_TRUE(contains(refused(parse({"lr=log:1e-4..1e-2"}), static_cast<int>(kMaxGridTrials) + 1), "more than"));
}

}  // namespace
}  // namespace zt::sweep
