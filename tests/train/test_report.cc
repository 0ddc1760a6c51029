// Run output: the loss-curve SVG, the FLOP/MFU arithmetic, nearest-name suggestions, and the
// binary's --log-format json / --plot / "did you mean" behaviour as a user meets it.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/suggest.h"
#include "model/config.h"
#include "train/plot.h"
#include "train/report.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;

// Checks that every tag is closed in order (self-closing or matched), the root is <svg>, and
// returns the names of the opening tags seen.
bool well_formed(const std::string& xml, std::vector<std::string>* tags, std::string* why) {
  std::vector<std::string> stack;
  size_t pos = 0;
  bool root_seen = false;
  while ((pos = xml.find('<', pos)) != std::string::npos) {
    const size_t end = xml.find('>', pos);
    if (end == std::string::npos) return *why = "unterminated tag", false;
    const std::string tag = xml.substr(pos + 1, end - pos - 1);
    pos = end + 1;
    if (tag.empty()) return *why = "empty tag", false;
    if (tag[0] == '/') {
      if (stack.empty() || stack.back() != tag.substr(1)) return *why = "mismatched </" + tag.substr(1) + ">", false;
      stack.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \n/"));
    if (!root_seen && name != "svg") return *why = "root is <" + name + ">", false;
    if (root_seen && stack.empty()) return *why = "content after the root", false;
    root_seen = true;
    tags->push_back(name);
    if (tag.back() != '/') stack.push_back(name);
  }
  if (!stack.empty()) return *why = "unclosed <" + stack.back() + ">", false;
  return root_seen;
}

// The value of attribute `attr` of the first element containing `marker`.
std::string attribute_after(const std::string& xml, const std::string& marker, const std::string& attr) {
  const size_t at = xml.find(marker);
  if (at == std::string::npos) return {};
  const size_t a = xml.find(attr + "=\"", at);
  if (a == std::string::npos) return {};
  const size_t b = a + attr.size() + 2;
  return xml.substr(b, xml.find('"', b) - b);
}

TEST(Plot, SvgIsWellFormedWithOnePointPerStep) {
  zt::LossCurve c;
  for (int i = 0; i < 137; ++i) c.train.push_back(5.5 * std::exp(-i / 20.0) + 0.75 + 0.01 * (i % 3));
  c.eval = {{50, 1.2}, {100, 0.9}, {137, 0.8}};
  c.floor = 0.7497;
  c.title = "gpt-tiny on <synthetic> & co";
  const std::string svg = zt::loss_curve_svg(c);
  ASSERT_EQ(svg.rfind("<svg", 0), 0u);
  std::vector<std::string> tags;
  std::string why;
  ASSERT_TRUE(well_formed(svg, &tags, &why)) << why;
  EXPECT_NE(svg.find("&lt;synthetic&gt; &amp; co"), std::string::npos);
  std::istringstream pts(attribute_after(svg, "class=\"train\"", "points"));
  std::string p;
  int n = 0;
  while (pts >> p) {
    EXPECT_NE(p.find(','), std::string::npos) << p;
    ++n;
  }
  EXPECT_EQ(n, 137);
  EXPECT_NE(svg.find("class=\"floor\""), std::string::npos);
  EXPECT_NE(attribute_after(svg, "class=\"floor\"", "stroke-dasharray"), "");
  EXPECT_NE(svg.find("class=\"eval\""), std::string::npos);
  EXPECT_NE(svg.find("entropy floor"), std::string::npos);
  EXPECT_NE(svg.find(">step</text>"), std::string::npos);

  c.floor.reset();
  c.eval.clear();
  const std::string plain = zt::loss_curve_svg(c);
  ASSERT_TRUE(well_formed(plain, &tags, &why)) << why;
  EXPECT_EQ(plain.find("class=\"floor\""), std::string::npos);
  EXPECT_EQ(plain.find("entropy floor"), std::string::npos);

  // Degenerate inputs still give a valid document.
  for (const std::vector<double>& train : {std::vector<double>{}, std::vector<double>{2.0}, std::vector<double>(5, 1.0)}) {
    zt::LossCurve d;
    d.train = train;
    ASSERT_TRUE(well_formed(zt::loss_curve_svg(d), &tags, &why)) << why;
  }
}

TEST(Report, FlopsAndMfuByHand) {
  zt::ModelConfig gpt;
  gpt.kind = zt::ModelKind::kGpt;
  gpt.layers = 2;
  gpt.embd = 8;
  // 6*N + 12*L*T*C = 6*1000 + 12*2*16*8 = 6000 + 3072.
  EXPECT_DOUBLE_EQ(zt::training_flops_per_token(gpt, 1000, 16), 9072.0);
  zt::ModelConfig mlp;
  mlp.kind = zt::ModelKind::kMlp;
  EXPECT_DOUBLE_EQ(zt::training_flops_per_token(mlp, 1000, 1), 6000.0);

  using zt::PeakKind;
  EXPECT_EQ(zt::peak_flops("cuda:0 (NVIDIA H200)", PeakKind::kFp32), 67e12);
  EXPECT_EQ(zt::peak_flops("cuda:1 (NVIDIA H100 80GB HBM3)", PeakKind::kFp32), 67e12);
  EXPECT_EQ(zt::peak_flops("cuda:0 (NVIDIA H100 PCIe)", PeakKind::kFp32), 51e12);
  EXPECT_EQ(zt::peak_flops("cpu:0", PeakKind::kFp32), std::nullopt);
  EXPECT_EQ(zt::peak_flops("cuda:0 (Some Future GPU)", PeakKind::kFp32), std::nullopt);
  // Dense tensor-core peaks (the datasheets' sparse figures halved): H100 SXM and H200 989 bf16,
  // 494 TF32; A100 312 / 156 / 19.5.
  for (const char* h : {"cuda:0 (NVIDIA H200)", "cuda:0 (NVIDIA H100 80GB HBM3)"}) {
    EXPECT_EQ(zt::peak_flops(h, PeakKind::kTf32), 494e12) << h;
    EXPECT_EQ(zt::peak_flops(h, PeakKind::kBf16), 989e12) << h;
    EXPECT_EQ(zt::peak_flops(h, PeakKind::kFp16), 989e12) << h;
  }
  EXPECT_EQ(zt::peak_flops("cuda:0 (NVIDIA A100-SXM4-80GB)", PeakKind::kBf16), 312e12);
  EXPECT_EQ(zt::peak_flops("cuda:0 (NVIDIA A100-SXM4-80GB)", PeakKind::kTf32), 156e12);
  EXPECT_EQ(zt::peak_flops("cuda:0 (NVIDIA A100-SXM4-80GB)", PeakKind::kFp32), 19.5e12);
  // No figure for that kind (V100 has no TF32 or bf16; the NVL parts are not in the table): unknown.
  EXPECT_EQ(zt::peak_flops("cuda:0 (Tesla V100-SXM2-16GB)", PeakKind::kTf32), std::nullopt);
  EXPECT_EQ(zt::peak_flops("cuda:0 (NVIDIA H200 NVL)", PeakKind::kBf16), std::nullopt);
  // The peak of the format the GEMMs run in: a 16-bit model's dtype (--tf32 changes nothing there),
  // else fp32, or TF32 with --tf32.
  EXPECT_EQ(zt::gemm_peak_kind(zt::DType::kF32, false), PeakKind::kFp32);
  EXPECT_EQ(zt::gemm_peak_kind(zt::DType::kF32, true), PeakKind::kTf32);
  EXPECT_EQ(zt::gemm_peak_kind(zt::DType::kBF16, false), PeakKind::kBf16);
  EXPECT_EQ(zt::gemm_peak_kind(zt::DType::kBF16, true), PeakKind::kBf16);
  EXPECT_EQ(zt::gemm_peak_kind(zt::DType::kF16, false), PeakKind::kFp16);
  // Two physical H100s: twice the peak; four logical devices on one H200: its peak once.
  EXPECT_EQ(zt::total_peak_flops({"cuda:0 (NVIDIA H100 80GB HBM3)", "cuda:1 (NVIDIA H100 80GB HBM3)"}, PeakKind::kFp32),
            134e12);
  EXPECT_EQ(zt::total_peak_flops({"cuda:0 (NVIDIA H200) [logical 0 of 2 on GPU 0]",
                                  "cuda:0 (NVIDIA H200) [logical 1 of 2 on GPU 0]"},
                                 PeakKind::kTf32),
            494e12);
  EXPECT_EQ(zt::total_peak_flops({"cpu:0", "cpu:1"}, PeakKind::kFp32), std::nullopt);
  // One unknown device makes the whole sum unknown.
  EXPECT_EQ(zt::total_peak_flops({"cuda:0 (NVIDIA H200)", "cuda:1 (Tesla V100-SXM2-16GB)"}, PeakKind::kBf16),
            std::nullopt);

  // 9072 FLOP/token at 1e6 tokens/s on one H200.
  const auto mfu = zt::model_flops_utilization(9072, 1e6, 67e12);
  ASSERT_TRUE(mfu);
  EXPECT_DOUBLE_EQ(*mfu, 9072.0 * 1e6 / 67e12);
  EXPECT_EQ(zt::model_flops_utilization(9072, 1e6, std::nullopt), std::nullopt);

  zt::RunReport r;
  r.steps = 3;
  r.tokens_per_s = 1000;
  r.flops_per_token = 9072;
  r.phases = {1.0, 0.5, 0.25, 0.25};
  r.devices.push_back({"cpu:0", 1 << 20, 1 << 20, 2 << 20, 3 << 20, 0, 8 << 20, 512});
  const std::string text = zt::format_summary(r);
  EXPECT_NE(text.find("summary: 3 steps"), std::string::npos) << text;
  EXPECT_NE(text.find("MFU          n/a"), std::string::npos) << text;
  EXPECT_NE(text.find("compute 1.00 s (50%)"), std::string::npos) << text;
  EXPECT_NE(text.find("8.00 MiB"), std::string::npos) << text;
  const nlohmann::json j = zt::report_json(r);
  EXPECT_TRUE(j["mfu"].is_null());
  EXPECT_EQ(j["peak_kind"], "fp32");
  EXPECT_DOUBLE_EQ(j["time_split"]["comm_s"].get<double>(), 0.5);

  // The summary and the JSON name the peak MFU was taken against.
  r.devices = {{"cuda:0 (NVIDIA H200)"}};
  r.tokens_per_s = 1e9;
  r.peak_kind = PeakKind::kTf32;
  r.peak_flops = zt::total_peak_flops({r.devices[0].name}, r.peak_kind);
  r.mfu = zt::model_flops_utilization(r.flops_per_token, r.tokens_per_s, r.peak_flops);
  const std::string tf32_text = zt::format_summary(r);
  EXPECT_NE(tf32_text.find("MFU          1.8% of 494 TFLOP/s TF32 peak"), std::string::npos) << tf32_text;
  const nlohmann::json jt = zt::report_json(r);
  EXPECT_EQ(jt["peak_kind"], "tf32");
  EXPECT_DOUBLE_EQ(jt["peak_flops"].get<double>(), 494e12);
  EXPECT_DOUBLE_EQ(jt["mfu"].get<double>(), 9072.0 * 1e9 / 494e12);
  r.peak_kind = PeakKind::kFp32;
  r.peak_flops = 19.5e12;
  r.mfu = zt::model_flops_utilization(r.flops_per_token, r.tokens_per_s, r.peak_flops);
  EXPECT_NE(zt::format_summary(r).find("of 19.5 TFLOP/s FP32 peak"), std::string::npos) << zt::format_summary(r);
  r.peak_kind = PeakKind::kBf16;
  r.peak_flops = r.mfu = std::nullopt;
  EXPECT_NE(zt::format_summary(r).find("n/a (BF16 peak FLOP/s of these devices unknown)"), std::string::npos);
}

TEST(Suggest, NearestName) {
  EXPECT_EQ(zt::edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(zt::edit_distance("", "abc"), 3u);
  const std::vector<std::string> flags = {"--model", "--steps", "--seed", "--epochs", "--lr", "--min-lr", "--top-k"};
  EXPECT_EQ(zt::nearest_name("--stpes", flags), "--steps");
  EXPECT_EQ(zt::nearest_name("--step", flags), "--steps");
  EXPECT_EQ(zt::nearest_name("--modle", flags), "--model");
  EXPECT_EQ(zt::nearest_name("--frobnicate", flags), std::nullopt);
  EXPECT_EQ(zt::nearest_name("trian", {"train", "info"}), "train");
  EXPECT_EQ(zt::nearest_name("frobnicate", {"train", "info"}), std::nullopt);
}

// ---- the binary ------------------------------------------------------------------------------

using zt::test_util::RunResult;

RunResult run(const std::string& args, bool with_stderr = true) {
  return zt::test_util::run_binary(ZEROTRAIN_BIN, args, with_stderr);
}

TEST(Binary, SuggestsTheNearestFlagAndSubcommand) {
  RunResult r = run("train --stpes 5");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--stpes"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("did you mean --steps?"), std::string::npos) << r.output;
  r = run("info --devics cpu:2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("did you mean --devices?"), std::string::npos) << r.output;
  r = run("trian");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("did you mean 'train'?"), std::string::npos) << r.output;
  r = run("train --log-format yaml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("json"), std::string::npos) << r.output;
  // Numeric flags say what they accept.
  r = run("train --zero-stage 7");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("not in range 0 to 3"), std::string::npos) << r.output;
}

// The summary records of a --log-format json run's output (every line must parse).
std::vector<nlohmann::json> summary_records(const std::string& output) {
  std::vector<nlohmann::json> out;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("event", "") == "summary") out.push_back(std::move(j));
  }
  return out;
}

// The summary's throughput leaves out warm-up: tokens over the steps after the first 2 divided by
// their time, both read back from the per-step records (step_ms and tokens_per_s: tokens per step
// = tokens_per_s x step_ms); the JSON names how many steps it left out and the rule.
TEST(Binary, ThroughputLeavesOutTheWarmUpSteps) {
  for (const int steps : {5, 2}) {
    const RunResult r = run("train --devices cpu:1 --steps " + std::to_string(steps) +
                                " --layers 1 --embd 32 --heads 2 --batch-size 2 --train-seq-len 16 --sample-tokens 0 "
                                "--eval-every 0 --log-format json",
                            /*with_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::vector<double> seconds, tokens;
    nlohmann::json summary;
    std::istringstream in(r.output);
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.value("event", "") == "summary") summary = j;
      if (j.contains("event") || !j.contains("step_ms")) continue;
      seconds.push_back(j["step_ms"].get<double>() / 1e3);
      tokens.push_back(j["tokens_per_s"].get<double>() * seconds.back());
    }
    ASSERT_EQ(seconds.size(), static_cast<size_t>(steps)) << r.output;
    const size_t skip = steps == 5 ? 2 : 1;
    double t = 0, n = 0;
    for (size_t i = skip; i < seconds.size(); ++i) t += seconds[i], n += tokens[i];
    EXPECT_NEAR(n, 32.0 * static_cast<double>(steps - skip), 1e-6);  // batch 2 x 16 tokens
    ASSERT_TRUE(summary.is_object()) << r.output;
    EXPECT_EQ(summary["warmup_steps_excluded"], skip);
    EXPECT_EQ(summary["warmup_rule"], zt::kWarmupRule);
    EXPECT_NEAR(summary["tokens_per_s"].get<double>(), n / t, 1e-9 * n / t);
  }
}

// The rule itself, and the summary table saying what it left out.
TEST(Report, WarmUpRuleAndSummaryLine) {
  EXPECT_EQ(zt::warmup_steps_excluded(0), 0);
  EXPECT_EQ(zt::warmup_steps_excluded(1), 0);
  EXPECT_EQ(zt::warmup_steps_excluded(2), 1);
  EXPECT_EQ(zt::warmup_steps_excluded(3), 2);
  EXPECT_EQ(zt::warmup_steps_excluded(100), 2);
  // Slow first steps do not count: 3 steps of 0.5 s after two of 10 s, 1000 tokens each.
  EXPECT_DOUBLE_EQ(zt::steady_tokens_per_s({10, 10, 0.5, 0.5, 0.5}, 1000), 2000);
  EXPECT_DOUBLE_EQ(zt::steady_tokens_per_s({10, 0.25}, 1000), 4000);
  EXPECT_DOUBLE_EQ(zt::steady_tokens_per_s({0.5}, 1000), 2000);
  zt::RunReport r;
  r.steps = 5;
  r.tokens_per_s = 2000;
  r.warmup_steps_excluded = 2;
  EXPECT_NE(zt::format_summary(r).find("2.00 ktokens/s"), std::string::npos) << zt::format_summary(r);
  EXPECT_NE(zt::format_summary(r).find("after warm-up (the first 2 steps left out)"), std::string::npos)
      << zt::format_summary(r);
  r.warmup_steps_excluded = 1;
  EXPECT_NE(zt::format_summary(r).find("after warm-up (the first step left out)"), std::string::npos);
  r.warmup_steps_excluded = 0;
  EXPECT_NE(zt::format_summary(r).find("every step timed"), std::string::npos);
  EXPECT_EQ(zt::report_json(r)["warmup_steps_excluded"], 0);
}

// --tf32 is shown in the header and the JSON summary, and the MFU line names the TF32 peak.
TEST(Binary, Tf32FlagIsShownInHeaderAndSummary) {
  const std::string args = "train --devices cpu:1 --steps 2 --layers 1 --embd 32 --heads 2 --sample-tokens 0 --tf32";
  RunResult r = run(args, /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("fp32, TF32 matmuls)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("n/a (TF32 peak FLOP/s of these devices unknown)"), std::string::npos) << r.output;
  r = run(args + " --log-format json", /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<nlohmann::json> summaries = summary_records(r.output);
  ASSERT_EQ(summaries.size(), 1u) << r.output;
  EXPECT_EQ(summaries[0]["tf32"], true) << r.output;
  EXPECT_EQ(summaries[0]["peak_kind"], "tf32") << r.output;
}

// The summary's peak follows the format the GEMMs run in: bf16 for a model computing in 16 bits
// (every model under --precision bf16, the tensor-parallel GPT too), fp32 for an fp32 run.
TEST(Binary, PeakKindFollowsTheModelsComputeDtype) {
  const std::string base = "train --steps 2 --layers 1 --embd 32 --heads 2 --sample-tokens 0 --eval-every 0 "
                           "--log-format json --devices cpu:2";
  for (const auto& [flags, kind] : {std::pair<std::string, std::string>{" --precision bf16", "bf16"},
                                    {" --precision bf16 --tensor-parallel 2", "bf16"},
                                    {" --precision fp32 --tensor-parallel 2", "fp32"}}) {
    const RunResult r = run(base + flags, /*with_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<nlohmann::json> summaries = summary_records(r.output);
    ASSERT_EQ(summaries.size(), 1u) << r.output;
    EXPECT_EQ(summaries[0]["peak_kind"], kind) << flags << ": " << r.output;
  }
}

TEST(Binary, JsonLogLinesParseAndPlotIsWritten) {
  const fs::path dir = fs::temp_directory_path() / ("zt_report_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string plot = (dir / "loss.svg").string();
  const RunResult r = run("train --devices cpu:2 --steps 6 --layers 1 --embd 32 --heads 2 --sample-tokens 0 "
                          "--eval-every 3 --log-format json --plot " + plot,
                          /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream in(r.output);
  std::string line;
  int steps = 0, evals = 0, summaries = 0;
  while (std::getline(in, line)) {
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(line)) << "not a JSON line: " << line;
    if (j.contains("event") && j["event"] == "summary") {
      ++summaries;
      EXPECT_EQ(j["steps"], 6);
      EXPECT_TRUE(j["mfu"].is_null()) << line;  // CPU devices: peak unknown
      EXPECT_EQ(j["peak_kind"], "fp32") << line;
      EXPECT_EQ(j["tf32"], false) << line;
      EXPECT_GT(j["flops_per_token"].get<double>(), 0);
      for (const char* k : {"compute_s", "comm_s", "optimizer_s", "other_s"})
        EXPECT_GE(j["time_split"][k].get<double>(), 0) << k;
      EXPECT_EQ(j["peak_bytes_per_device"].size(), 2u);
    } else if (j.contains("event") && j["event"] == "eval") {
      ++evals;
    } else {
      ++steps;
      EXPECT_EQ(j["step"], steps);
      EXPECT_TRUE(j.contains("loss") && j.contains("mem_bytes")) << line;
    }
  }
  EXPECT_EQ(steps, 6);
  EXPECT_EQ(evals, 2);
  EXPECT_EQ(summaries, 1);

  std::ifstream f(plot);
  std::stringstream svg;
  svg << f.rdbuf();
  std::vector<std::string> tags;
  std::string why;
  EXPECT_TRUE(well_formed(svg.str(), &tags, &why)) << why;
  EXPECT_NE(svg.str().find("class=\"floor\""), std::string::npos);
  fs::remove_all(dir);
}

TEST(Binary, TextSummaryTable) {
  const RunResult r = run("train --devices cpu:2 --steps 4 --layers 1 --embd 32 --heads 2 --sample-tokens 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"summary:", "throughput", "MFU          n/a", "time split", "exposed comm", "pool peak", "| mem "})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
}

}  // namespace

namespace {

// The traffic closed forms against a count of the schedules' hops: flat, every global rank g sends
// N-1 shards to g+1 (a hop out of the process when g is its last device); hierarchical, every
// device sends (L-1) * K shards around its process's ring, then K-1 shards to the same local
// index of the next process.
TEST(Report, CollectiveTrafficCountsTheRingsHops) {
  const uint64_t S = 1000;
  for (int K = 1; K <= 4; ++K)
    for (int L = 1; L <= 4; ++L) {
      SCOPED_TRACE(std::to_string(K) + " x " + std::to_string(L));
      const int N = K * L;
      uint64_t flat_in = 0, flat_out = 0, hier_in = 0, hier_out = 0;
      for (int g = 0; g < N; ++g) {  // process 0's devices are g < L
        if (g >= L) continue;
        const bool leaves = ((g + 1) % N) / L != g / L;
        (leaves ? flat_out : flat_in) += static_cast<uint64_t>(N - 1) * S;
        hier_in += static_cast<uint64_t>((L - 1) * K) * S;
        hier_out += static_cast<uint64_t>(K - 1) * S;
      }
      const zt::CollectiveTraffic flat = zt::collective_traffic(K, L, false, S);
      EXPECT_EQ(flat.inside, flat_in);
      EXPECT_EQ(flat.across, flat_out);
      if (K == 1) continue;  // one process: no hierarchy, the flat ring
      const zt::CollectiveTraffic hier = zt::collective_traffic(K, L, true, S);
      EXPECT_EQ(hier.inside, hier_in);
      EXPECT_EQ(hier.across, hier_out);
    }
}

// A GPU's long description stays in the header; the summary table names the device short, and
// logical devices on one GPU apart.
TEST(Report, SummaryTableNamesGpusShort) {
  EXPECT_EQ(zt::short_device_name("cpu:3"), "cpu:3");
  EXPECT_EQ(zt::short_device_name("cuda:0 (NVIDIA H200, compute capability 9.0, 132 SMs, PCI 00000000:19:00.0)"),
            "cuda:0");
  EXPECT_EQ(zt::short_device_name("cuda:1 (NVIDIA H200, compute capability 9.0, 132 SMs) [logical 2 of 4 on GPU 1]"),
            "cuda:1 [2 of 4]");
  zt::RunReport r;
  r.devices.push_back({"cuda:0 (NVIDIA H200, compute capability 9.0, 132 SMs) [logical 0 of 2 on GPU 0]", 1 << 20});
  r.devices.push_back({"cuda:0 (NVIDIA H200, compute capability 9.0, 132 SMs) [logical 1 of 2 on GPU 0]", 1 << 20});
  const std::string text = zt::format_summary(r);
  EXPECT_NE(text.find("\n  device                params"), std::string::npos) << text;
  EXPECT_NE(text.find("\n  cuda:0 [0 of 2]     1.00 MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("\n  cuda:0 [1 of 2]     1.00 MiB"), std::string::npos) << text;
  EXPECT_EQ(text.find("compute capability"), std::string::npos) << text;
}

TEST(Report, SummaryShowsTheTrafficInsideAndAcrossProcesses) {
  zt::RunReport r;
  r.traffic = {2, 2, "hierarchical", 3 << 20, 1 << 20};
  const std::string text = zt::format_summary(r);
  EXPECT_NE(text.find("traffic      per step 3.00 MiB between the 2 devices of each process, 1.00 MiB out of each of "
                      "the 2 processes (hierarchical)"),
            std::string::npos)
      << text;
  const nlohmann::json j = zt::report_json(r);
  EXPECT_EQ(j["traffic"]["topology"], "hierarchical");
  EXPECT_EQ(j["traffic"]["inside_bytes_per_step"].get<uint64_t>(), uint64_t{3} << 20);
  EXPECT_EQ(j["traffic"]["across_bytes_per_step"].get<uint64_t>(), uint64_t{1} << 20);
  r.traffic = {1, 4, "flat", 5 << 20, 0};
  EXPECT_NE(zt::format_summary(r).find("between the 4 devices, none across processes"), std::string::npos)
      << zt::format_summary(r);
  // One GPU (the default run on a one-GPU machine): nothing to exchange, and no "1 devices".
  r.traffic = {1, 1, "flat", 0, 0};
  EXPECT_NE(zt::format_summary(r).find("traffic      none: one device\n"), std::string::npos) << zt::format_summary(r);
  r.traffic = {2, 1, "flat", 0, 7 << 20};
  EXPECT_NE(zt::format_summary(r).find("traffic      per step 7.00 MiB out of each of the 2 processes (one device "
                                       "each, flat)\n"),
            std::string::npos)
      << zt::format_summary(r);
  EXPECT_EQ(zt::format_summary(r).find("1 devices"), std::string::npos);
}

}  // namespace
