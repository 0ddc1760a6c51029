// Issue 16 item 3: the GPT-2 shape family; `plan --largest` (answer fits, next does not, monotone
// in stage/recompute/offload; the reported model trains in its memory, the next is refused); the
// cheapest-fix chain with recompute and offload (its order, and its proposals followed fit).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "core/status.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "model/model.h"
#include "test_util.h"
#include "train/plan.h"
#include "train/run_shape.h"
#include "train/trainer.h"

namespace zt {
namespace {

// A 4-device run at a small scale (64 tokens, micro-batch 1, 2 GiB): the answers lie inside the
// family, and stage 3 > 2 > 1 > 0. (Not a law: below ~1 GiB the stage 2 gradient bucket of the
// tied 50257-token embedding costs more than sharding the gradients saves on such small shapes.)
PlanInputs small_run(size_t memory = size_t{2} << 30) {
  PlanInputs in;
  in.devices = 4;
  in.device_memory = {memory};
  in.micro_batch = 1;
  in.seq_len = 64;
  in.max_devices = 4;
  return in;
}

PlanInputs with_levers(PlanInputs in, int stage, Recompute rc, bool offload) {
  in.zero_stage = stage;
  in.recompute = rc;
  in.offload = offload;
  return in;
}

std::string levers_name(const PlanInputs& in) {
  return "stage " + std::to_string(in.zero_stage) + ", recompute " + recompute_name(in.recompute) +
         (in.offload ? ", offload" : "");
}

TEST(PlanLargest, FamilyFollowsGpt2ShapesAndGrowsEveryTensor) {
  const std::vector<ModelConfig> family = gpt2_shape_family(512);
  ASSERT_GE(family.size(), 30u);
  int named = 0;
  for (size_t i = 0; i < family.size(); ++i) {
    const ModelConfig& m = family[i];
    SCOPED_TRACE(m.describe());
    EXPECT_EQ(m.heads * 64, m.embd);
    EXPECT_EQ(m.vocab, 50257);
    EXPECT_EQ(m.seq_len, 512);
    EXPECT_LE(m.num_parameters(), int64_t{1} << 40);
    if (i > 0) {  // every tensor grows or stays: the memory of any run is monotone along the family
      EXPECT_GT(m.embd, family[i - 1].embd);
      EXPECT_GE(m.layers, family[i - 1].layers);
      EXPECT_GT(m.num_parameters(), family[i - 1].num_parameters());
    }
    const std::string name = gpt2_shape_name(m);
    if (!name.empty()) ++named;
    if (m.layers <= 48) {  // the parameter count of what the model really allocates (wte padded)
      EXPECT_EQ(make_model(m)->layout().total_parameters(),
                m.num_parameters() + (ops::padded_vocab(m.vocab) - m.vocab) * m.embd);
    }
  }
  EXPECT_EQ(named, 4);
  auto has = [&](int L, int C, const std::string& name) {
    for (const ModelConfig& m : family)
      if (m.layers == L && m.embd == C) return gpt2_shape_name(m) == name;
    return false;
  };
  EXPECT_TRUE(has(12, 768, "GPT-2 small"));
  EXPECT_TRUE(has(24, 1024, "GPT-2 medium"));
  EXPECT_TRUE(has(36, 1280, "GPT-2 large"));
  EXPECT_TRUE(has(48, 1600, "GPT-2 XL"));
  EXPECT_GT(family.back().layers, 48) << "the family goes beyond XL";
  EXPECT_THROW(gpt2_shape_family(0), Error);
}

TEST(PlanLargest, AnswerFitsAndTheNextShapeDoesNot) {
  const std::vector<ModelConfig> family = gpt2_shape_family(64);
  const PlanInputs base = small_run();
  int nontrivial = 0;
  const PlanInputs runs[] = {with_levers(base, 0, Recompute::kNone, false),
                             with_levers(base, 1, Recompute::kNone, true),
                             with_levers(base, 2, Recompute::kSelective, false),
                             with_levers(base, 3, Recompute::kNone, false),
                             with_levers(base, 3, Recompute::kFull, true)};
  for (const PlanInputs& in : runs) {
    SCOPED_TRACE(levers_name(in));
    size_t plans = 0;
    const int got = largest_fitting(family, in, &plans);
    // The reference: every member planned in turn.
    int scan = -1;
    for (size_t i = 0; i < family.size(); ++i)
      if (plan_memory_only(family[i], in).fits) scan = static_cast<int>(i);
    EXPECT_EQ(got, scan);
    if (got >= 0) {
      EXPECT_TRUE(plan_memory_only(family[static_cast<size_t>(got)], in).fits);
    }
    if (got + 1 < static_cast<int>(family.size())) {
      EXPECT_FALSE(plan_memory_only(family[static_cast<size_t>(got + 1)], in).fits);
    }
    nontrivial += got > 0 && got + 1 < static_cast<int>(family.size());
    // A binary search: about log2 of the family's size, not its size.
    EXPECT_LE(plans, static_cast<size_t>(std::ceil(std::log2(family.size() + 1.0))) + 1);
  }
  EXPECT_GE(nontrivial, 4) << "the setting should put most answers inside the family";
}

// --tensor-parallel 2 over the members whose heads 2 divides (what `plan --largest --tp 2` searches):
// every row, recompute included (the one GPT recomputes under tensor parallelism), each answer fits
// by a scan of the family and the next member does not, and a split model fits at least what one
// device's share does.
TEST(PlanLargest, TensorParallelRowsSearchTheSplittableShapes) {
  std::vector<ModelConfig> family = gpt2_shape_family(64);
  std::erase_if(family, [](const ModelConfig& m) { return m.heads % 2 != 0; });
  PlanInputs in = small_run();
  in.tensor = 2;
  const LargestTable t = plan_largest(family, in);
  ASSERT_EQ(t.rows.size(), 21u) << "every stage and recompute mode, offload at stages 1-3";
  for (const LargestRow& row : t.rows) {
    const PlanInputs c = with_levers(in, row.zero_stage, row.recompute, row.offload);
    int scan = -1;
    for (size_t i = 0; i < family.size(); ++i)
      if (plan_memory_only(family[i], c).fits) scan = static_cast<int>(i);
    EXPECT_EQ(row.index, scan) << levers_name(c);
  }
  PlanInputs plain = small_run();
  plain.zero_stage = 1;
  const int one = largest_fitting(family, plain);
  PlanInputs split = plain;
  split.tensor = 2;
  EXPECT_GE(largest_fitting(family, split), one) << "splitting every layer over 2 devices fits at least as much";
}

TEST(PlanLargest, MonotoneInStageRecomputeAndOffload) {
  const std::vector<ModelConfig> family = gpt2_shape_family(64);
  const LargestTable t = plan_largest(family, small_run());
  ASSERT_EQ(t.rows.size(), 21u);  // offload needs stage 1 or above: no stage-0 offload rows
  auto at = [&](int st, Recompute rc, bool off) {
    for (const LargestRow& r : t.rows)
      if (r.zero_stage == st && r.recompute == rc && r.offload == off) return r.index;
    ADD_FAILURE() << "no row for stage " << st;
    return -2;
  };
  const Recompute modes[] = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
  for (int st = 0; st <= 3; ++st)
    for (int m = 0; m < 3; ++m)
      for (bool off : {false, true}) {
        if (off && st == 0) continue;
        SCOPED_TRACE("stage " + std::to_string(st) + ", recompute " + recompute_name(modes[m]) + ", offload " +
                     std::to_string(off));
        const int here = at(st, modes[m], off);
        EXPECT_GE(here, 0) << "the smallest shape fits every combination here";
        if (st > 0 && !(off && st == 1)) {
          EXPECT_GE(here, at(st - 1, modes[m], off));
        }
        if (m > 0) {
          EXPECT_GE(here, at(st, modes[m - 1], off));
        }
        if (off) {
          EXPECT_GE(here, at(st, modes[m], false));
        }
      }
  EXPECT_GT(at(3, Recompute::kNone, false), at(0, Recompute::kNone, false)) << "stage 3 fits a larger model";
  // Each row's device peak is the plan of the shape it names, within the memory.
  for (const LargestRow& r : t.rows) {
    ASSERT_GE(r.index, 0);
    const MemoryPlan p = plan_memory_only(family[static_cast<size_t>(r.index)],
                                          with_levers(small_run(), r.zero_stage, r.recompute, r.offload));
    EXPECT_EQ(r.peak.total, p.per_device[0].total);
    EXPECT_EQ(r.peak.host, p.per_device[0].host);
    EXPECT_LE(r.peak.total, size_t{2} << 30);
  }
  EXPECT_LE(t.plans, 24 * (static_cast<size_t>(std::ceil(std::log2(family.size() + 1.0))) + 1));
  const std::string table = format_largest(t);
  EXPECT_NE(table.find("largest model"), std::string::npos) << table;
  EXPECT_NE(table.find("stage 3 with --recompute full --offload optimizer:"), std::string::npos) << table;
}

// A plan function with closed-form savings: every lever takes a fixed number of bytes off.
struct FakePlans {
  size_t base = 1000, stage_saving = 0, selective = 0, full = 0, offload = 0, per_micro_batch = 0;
  size_t memory = 0;
  int calls = 0;
  MemoryPlan operator()(const PlanInputs& c) {
    ++calls;
    size_t save = stage_saving * static_cast<size_t>(c.zero_stage);
    save += c.recompute == Recompute::kSelective ? selective : c.recompute == Recompute::kFull ? full : 0;
    save += c.offload ? offload : 0;
    save += per_micro_batch * static_cast<size_t>(8 - c.micro_batch);
    MemoryPlan p;
    p.inputs = c;
    DevicePlan d;
    d.total = base > save ? base - save : 0;
    d.memory = memory;
    d.host = c.offload ? 77 : 0;
    p.per_device.assign(static_cast<size_t>(c.devices), d);
    p.fits = d.fits();
    p.work = 1;
    return p;
  }
};

TEST(PlanLargest, FixChainTriesRecomputeBeforeOffload) {
  PlanInputs in;
  in.devices = 2;
  in.zero_stage = 0;
  in.micro_batch = 8;
  in.max_devices = 2;
  auto fix = [&](FakePlans f) {
    size_t work = 0;
    const PlanSuggestion s = cheapest_fix(in, std::ref(f), &work);
    EXPECT_EQ(work, static_cast<size_t>(f.calls));
    return s;
  };
  FakePlans f;
  f.memory = 900;
  f.selective = 50, f.full = 120, f.offload = 300;  // full recompute and offload both fit alone
  PlanSuggestion s = fix(f);
  EXPECT_EQ(s.kind, PlanSuggestion::kRecompute) << s.text;
  EXPECT_EQ(s.recompute, Recompute::kFull);
  EXPECT_FALSE(s.offload);
  EXPECT_NE(s.text.find("use --recompute full (predicted"), std::string::npos) << s.text;

  f.stage_saving = 100;  // a higher stage fits too: it comes first
  s = fix(f);
  EXPECT_EQ(s.kind, PlanSuggestion::kZeroStage) << s.text;
  EXPECT_EQ(s.zero_stage, 1);
  EXPECT_EQ(s.recompute, Recompute::kNone);

  f.stage_saving = 0, f.full = 60;  // only offload fits, and it needs stage 1 or above
  s = fix(f);
  EXPECT_EQ(s.kind, PlanSuggestion::kCombined) << s.text;
  EXPECT_TRUE(s.offload);
  EXPECT_EQ(s.zero_stage, 1);
  EXPECT_NE(s.text.find("use --zero-stage 1 --offload optimizer (predicted 700 B per device, 77 B of host memory per "
                        "device)"),
            std::string::npos)
      << s.text;

  f.offload = 40, f.stage_saving = 30;  // only levers together: the lowest stage with selective recompute
  s = fix(f);
  EXPECT_EQ(s.kind, PlanSuggestion::kCombined) << s.text;
  EXPECT_EQ(s.zero_stage, 2);
  EXPECT_EQ(s.recompute, Recompute::kSelective);
  EXPECT_FALSE(s.offload);
  EXPECT_NE(s.text.find("use --zero-stage 2 --recompute selective (predicted"), std::string::npos) << s.text;

  f.stage_saving = 0, f.selective = 0, f.full = 0, f.offload = 0, f.per_micro_batch = 30;  // only a smaller micro-batch
  s = fix(f);
  EXPECT_EQ(s.kind, PlanSuggestion::kMicroBatch) << s.text;
  EXPECT_EQ(s.micro_batch, 4);
  EXPECT_EQ(s.micro_batches, 2);

  f.per_micro_batch = 12, f.full = 60;  // micro-batch 4 with full recompute beats micro-batch 1 alone
  s = fix(f);
  EXPECT_EQ(s.kind, PlanSuggestion::kCombined) << s.text;
  EXPECT_EQ(s.micro_batch, 4);
  EXPECT_EQ(s.recompute, Recompute::kFull);
  EXPECT_NE(s.text.find("use --recompute full with --micro-batch-size 4"), std::string::npos) << s.text;

  f.memory = 1;  // nothing fits: the message names every lever at its most
  s = fix(f);
  EXPECT_EQ(s.kind, PlanSuggestion::kNothing) << s.text;
  EXPECT_NE(s.text.find("even ZeRO stage 3 with --recompute full, --offload optimizer and micro-batch 1 needs"),
            std::string::npos)
      << s.text;
}

// The real plan: every proposal, followed, fits (per plan_memory_only) across memories from
// "nothing fits" to "fits as asked".
TEST(PlanLargest, ProposalsFollowedFit) {
  ModelOverrides o;
  o.layers = 2;
  o.embd = 128;
  o.vocab = 512;
  const ModelConfig mc = make_model_config("gpt-tiny", o);
  PlanInputs in = small_run();
  in.zero_stage = 0;
  in.micro_batch = 4;
  in.max_devices = 8;
  in.sampling = true;
  const size_t asked = plan_memory_only(mc, in).per_device[0].total;
  // The chain's last try before "nothing fits": every lever at its most, micro-batch 1.
  PlanInputs most = with_levers(in, 3, Recompute::kFull, true);
  most.micro_batch = 1;
  most.micro_batches = 4;
  const size_t least = plan_memory_only(mc, most).per_device[0].total;
  ASSERT_LT(least, asked);
  int followed = 0;
  for (int k = 0; k <= 8; ++k) {
    PlanInputs c = in;
    c.device_memory = {least + (asked - least) * static_cast<size_t>(k) / 8};
    const MemoryPlan plan = plan_memory(mc, c);
    if (plan.fits) continue;
    const PlanSuggestion& s = plan.suggestion;
    SCOPED_TRACE(s.text);
    ASSERT_NE(s.kind, PlanSuggestion::kNothing);
    PlanInputs f = c;
    f.zero_stage = s.zero_stage;
    f.recompute = s.recompute;
    f.offload = s.offload;
    f.offload_fraction = s.offload_fraction;
    f.micro_batch = s.micro_batch;
    f.micro_batches = s.micro_batches;
    f.devices = s.devices;
    EXPECT_EQ(static_cast<long>(f.devices) * f.micro_batch * f.micro_batches,
              static_cast<long>(c.devices) * c.micro_batch * c.micro_batches)
        << "the global batch is kept";
    EXPECT_TRUE(plan_memory_only(mc, f).fits);
    ++followed;
  }
  EXPECT_GE(followed, 4);
}

// Recompute before offload, where both cut the peak (skipped until the model's workspace and the
// engine's optimizer bytes depend on them).
TEST(PlanLargest, RealPlanProposesRecomputeBeforeOffload) {
  ModelOverrides o;
  o.layers = 2;
  o.embd = 128;
  o.vocab = 512;
  const ModelConfig mc = make_model_config("gpt-tiny", o);
  PlanInputs st3 = small_run();
  st3.micro_batch = 4;
  st3.sampling = true;
  st3.zero_stage = 3;
  const size_t none = plan_memory_only(mc, st3).per_device[0].total;
  const size_t full = plan_memory_only(mc, with_levers(st3, 3, Recompute::kFull, false)).per_device[0].total;
  const size_t off = plan_memory_only(mc, with_levers(st3, 3, Recompute::kNone, true)).per_device[0].total;
  if (full >= none || off >= none) GTEST_SKIP() << "recompute or offload does not change the plan yet";
  st3.device_memory = {std::max(full, off)};
  const MemoryPlan plan = plan_memory(mc, st3);
  ASSERT_FALSE(plan.fits);
  EXPECT_EQ(plan.suggestion.kind, PlanSuggestion::kRecompute) << plan.suggestion.text;
  EXPECT_NE(plan.suggestion.text.find("--recompute"), std::string::npos) << plan.suggestion.text;
  EXPECT_TRUE(plan_memory_only(mc, with_levers(st3, 3, plan.suggestion.recompute, false)).fits);
}

// Issue 16's target at a small scale: the model plan --largest reports for stage 3 + full
// recompute + offload trains in the memory it was planned for (measured pool peak within it), and
// train refuses the next shape up before allocating anything.
TEST(PlanLargest, ReportedModelTrainsAndTheNextIsRefused) {
  const std::vector<ModelConfig> family = gpt2_shape_family(16);
  auto run_of = [](const ModelConfig& m, size_t memory) {
    TrainConfig c;
    c.model = "gpt2-124m";
    c.overrides.layers = m.layers, c.overrides.embd = m.embd, c.overrides.heads = m.heads;
    c.overrides.seq_len = m.seq_len, c.overrides.vocab = m.vocab;
    c.devices = "cpu:4";
    c.zero_stage = 3;
    c.recompute = Recompute::kFull;
    c.offload_optimizer = true;
    c.steps = 2;
    c.batch_size = 4;
    c.train_seq_len = 16;
    c.eval_every = 0;
    c.eval_batches = 1;
    c.sample_tokens = 2;
    c.quiet = true;
    c.device_memory = memory;
    return c;
  };
  // The plan inputs train derives from that run (sampling, accumulation, precision).
  auto inputs = [&](size_t memory) {
    PlanInputs in = resolve_run_shape(run_of(family[0], memory), family[0], 4, Backend::kCpu).plan;
    in.device_memory = {memory};
    return in;
  };
  // A memory between what shapes 1 and 2 need: the search must answer 1.
  const size_t one = plan_memory_only(family[1], inputs(0)).per_device[0].total;
  const size_t two = plan_memory_only(family[2], inputs(0)).per_device[0].total;
  ASSERT_LT(one, two);
  const size_t memory = (one + two) / 2;
  ASSERT_EQ(largest_fitting(family, inputs(memory)), 1);

  const TrainResult r = train(run_of(family[1], memory));
  EXPECT_EQ(r.steps, 2);
  ASSERT_EQ(r.peak_bytes_per_device.size(), 4u);
  for (size_t peak : r.peak_bytes_per_device) EXPECT_LE(peak, memory);
  try {
    train(run_of(family[2], memory));
    ADD_FAILURE() << "the next shape up was not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.message();
    EXPECT_NE(e.message().find("does not fit"), std::string::npos) << e.message();
  }
}

TEST(PlanLargest, BinaryPrintsTheTable) {
  const auto r = test_util::run_binary(
      ZEROTRAIN_BIN, "plan --largest --devices cpu:4 --device-memory 2GiB --batch-size 4 --train-seq-len 64");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("stage  recompute  offload"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("largest model"), std::string::npos) << r.output;
  // 21 rows (no offload at stage 0), stage-major, in the order of the combinations.
  std::istringstream lines(r.output);
  std::string line;
  std::vector<std::string> rows;
  while (std::getline(lines, line))
    if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0]))) rows.push_back(line);
  ASSERT_EQ(rows.size(), 21u) << r.output;
  EXPECT_EQ(rows[0].rfind("0      none       none", 0), 0u) << rows[0];
  EXPECT_EQ(rows[1].rfind("0      selective  none", 0), 0u) << rows[1];
  EXPECT_EQ(rows[20].rfind("3      full       optimizer", 0), 0u) << rows[20];
  for (const std::string& row : rows) EXPECT_NE(row.find(" x "), std::string::npos) << row;  // a shape fits each
  const auto bad = test_util::run_binary(ZEROTRAIN_BIN, "plan --largest --model gpt2-124m");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("drop --model"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace zt
