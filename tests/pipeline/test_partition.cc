// The pipeline partitioner (pipeline/partition.h) against brute force over every contiguous split
// of small models, its describe() text, uneven counts, and the one-sentence refusals of bad
// layouts and pipeline shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <vector>

#include "core/status.h"
#include "pipeline/partition.h"

namespace zt {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.message();
  }
  return "";
}

// Every composition of n into `parts` positive counts.
void compositions(int n, int parts, std::vector<int>& cur, std::vector<std::vector<int>>& out) {
  if (parts == 1) {
    cur.push_back(n);
    out.push_back(cur);
    cur.pop_back();
    return;
  }
  for (int first = 1; first <= n - (parts - 1); ++first) {
    cur.push_back(first);
    compositions(n - first, parts - 1, cur, out);
    cur.pop_back();
  }
}

// (slowest part, largest part memory) of a split, summed independently of partition.cc.
std::pair<double, double> objective(const PipelineCosts& c, const std::vector<int>& counts) {
  double t_max = 0, m_max = 0;
  int b = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    double t = k == 0 ? c.embedding.time : 0, m = k == 0 ? c.embedding.memory : 0;
    for (int i = 0; i < counts[k]; ++i, ++b)
      t += c.blocks[size_t(b)].time, m += c.blocks[size_t(b)].memory;
    if (k + 1 == counts.size()) t += c.head.time, m += c.head.memory;
    t_max = std::max(t_max, t);
    m_max = std::max(m_max, m);
  }
  return {t_max, m_max};
}

TEST(PipePartition, MatchesBruteForceOnSmallModels) {
  // Fixed seed; small integer costs so that ties in time are common and the memory tie-break
  // counts.
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> cost(1, 5), extra(0, 6);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + trial % 9;
    PipelineCosts c;
    for (int i = 0; i < n; ++i) c.blocks.push_back({double(cost(rng)), double(cost(rng))});
    c.embedding = {double(extra(rng)), double(extra(rng))};
    c.head = {double(extra(rng)), double(extra(rng))};
    for (int P = 1; P <= 4; ++P)
      for (int V = 1; V <= 2; ++V) {
        if (P * V > n) continue;
        std::vector<std::vector<int>> all;
        std::vector<int> cur;
        compositions(n, P * V, cur, all);
        std::pair<double, double> best{1e300, 1e300};
        for (const auto& split : all) best = std::min(best, objective(c, split));
        const PipelinePartition p = partition_pipeline(c, P, V);
        ASSERT_EQ(p.parts(), P * V);
        int sum = 0;
        for (int k : p.blocks_per_part) {
          ASSERT_GE(k, 1);
          sum += k;
        }
        ASSERT_EQ(sum, n);
        EXPECT_EQ(objective(c, p.blocks_per_part), best) << "n=" << n << " P=" << P << " V=" << V;
        EXPECT_EQ(p.slowest_time(), best.first);
        ++checked;
      }
  }
  EXPECT_GT(checked, 1000);
}

PipelineCosts uniform(int n, PartCost embedding = {}, PartCost head = {}) {
  PipelineCosts c;
  c.blocks.assign(size_t(n), PartCost{1, 10});
  c.embedding = embedding;
  c.head = head;
  return c;
}

TEST(PipePartition, DescribeNamesEveryBlockOnce) {
  EXPECT_EQ(partition_pipeline(uniform(8), 2).describe(),
            "stage 0: embedding + h.0-h.3, stage 1: h.4-h.7 + ln_f + head");
  // A heavy embedding pulls blocks off the first stage: 2 + 2 = 4 = the 4 blocks of stage 1.
  EXPECT_EQ(partition_pipeline(uniform(6, {2, 0}), 2).describe(),
            "stage 0: embedding + h.0-h.1, stage 1: h.2-h.5 + ln_f + head");
  EXPECT_EQ(partition_pipeline(uniform(8), 2, 2).describe(),
            "stage 0: embedding + h.0-h.1 | h.4-h.5, stage 1: h.2-h.3 | h.6-h.7 + ln_f + head");
  EXPECT_EQ(partition_pipeline(uniform(3), 3).describe(),
            "stage 0: embedding + h.0, stage 1: h.1, stage 2: h.2 + ln_f + head");
}

TEST(PipePartition, UnevenCountsKeepEveryBlock) {
  const PipelinePartition p = partition_pipeline(uniform(7), 2);
  EXPECT_EQ(p.blocks_per_part[0] + p.blocks_per_part[1], 7);
  EXPECT_EQ(p.slowest_time(), 4.0);
  const PipelinePartition q = partition_from_layout(uniform(12, {0, 5}, {0, 7}), {4, 4, 3, 1}, 4);
  EXPECT_EQ(q.describe(),
            "stage 0: embedding + h.0-h.3, stage 1: h.4-h.7, stage 2: h.8-h.10, "
            "stage 3: h.11 + ln_f + head");
  EXPECT_EQ(q.part_costs[0].memory, 45.0);
  EXPECT_EQ(q.part_costs[3].memory, 17.0);
  EXPECT_EQ(q.largest_memory(), 45.0);
}

TEST(PipePartition, ParsesLayouts) {
  EXPECT_EQ(parse_pp_layout("4,4,3,1"), (std::vector<int>{4, 4, 3, 1}));
  EXPECT_EQ(parse_pp_layout("12"), (std::vector<int>{12}));
  EXPECT_EQ(error_of([] { parse_pp_layout("4,,3"); }),
            "--pp-layout '4,,3': '' is not a block count; give one count per stage, e.g. 4,4,3,1");
  EXPECT_EQ(error_of([] { parse_pp_layout("4,x"); }),
            "--pp-layout '4,x': 'x' is not a block count; give one count per stage, e.g. 4,4,3,1");
  EXPECT_NE(error_of([] { parse_pp_layout("-1,3"); }), "");
}

TEST(PipePartition, RefusesBadLayoutsAndShapesWithOneSentence) {
  EXPECT_EQ(
      error_of([] {
        validate_pp_layout({4, 4, 3}, 12, 3);
      }),
      "--pp-layout 4,4,3 covers 11 blocks but the model has 12; the counts must add up to 12 so "
      "that every block is in exactly one stage");
  EXPECT_EQ(
      error_of([] {
        validate_pp_layout({4, 4, 5}, 12, 3);
      }),
      "--pp-layout 4,4,5 covers 13 blocks but the model has 12; the counts must add up to 12 so "
      "that every block is in exactly one stage");
  EXPECT_EQ(error_of([] {
              validate_pp_layout({6, 6}, 12, 4);
            }),
            "--pp-layout 6,6 has 2 entries but the pipeline has 4 stages; give one block count per "
            "stage");
  EXPECT_EQ(error_of([] {
              validate_pp_layout({6, 6}, 12, 2, 2);
            }),
            "--pp-layout 6,6 has 2 entries but the pipeline has 4 chunks (2 stages x 2 virtual "
            "stages); give one block count per chunk");
  EXPECT_EQ(error_of([] {
              validate_pp_layout({12, 0}, 12, 2);
            }),
            "--pp-layout 12,0 gives 0 blocks to stage 1; every stage needs at least one block");
  EXPECT_EQ(
      error_of([] { validate_pipeline_shape(8, 3, 1, 12); }),
      "--pipeline-parallel 3 does not divide the 8 devices; data x tensor x pipeline must equal "
      "the device count");
  EXPECT_EQ(
      error_of([] { validate_pipeline_shape(4, 4, 1, 3); }),
      "--pipeline-parallel 4 stages but the model has only 3 blocks; every stage needs at least "
      "one block");
  EXPECT_EQ(
      error_of([] { partition_pipeline(uniform(6), 4, 2); }),
      "--pipeline-parallel 4 x --virtual-stages 2 = 8 chunks but the model has only 6 blocks; "
      "every chunk needs at least one block");
  EXPECT_EQ(error_of([] { validate_pipeline_shape(8, 2, 1, 12); }), "");
}

}  // namespace
}  // namespace zt
