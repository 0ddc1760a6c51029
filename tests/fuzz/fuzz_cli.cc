// libFuzzer target: zerotrain's run flags. The input is split into argv words (at newlines or
// NULs), parsed by the real flag definitions (apps/run_flags.h) on a `train` subcommand and
// resolved into a run shape (model config + train/run_shape.h) without training or touching a
// file. CLI11 parse errors and zt::Error are expected; a crash, another exception, a sanitizer
// report or a broken invariant of the resolved shape (__builtin_trap) is a finding.
#include <CLI/CLI.hpp>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cli_checks.h"
#include "core/status.h"
#include "model/config.h"
#include "run_flags.h"
#include "runtime/runtime.h"
#include "train/run_shape.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> words(1);
  for (size_t i = 0; i < size && words.size() <= 64; ++i) {
    const char ch = static_cast<char>(data[i]);
    if (ch == '\n' || ch == '\0') words.emplace_back();
    else words.back().push_back(ch);
  }
  if (words.back().empty()) words.pop_back();
  std::vector<const char*> argv = {"zerotrain", "train"};
  for (const std::string& w : words) argv.push_back(w.c_str());

  CLI::App app{"fuzz"};
  app.require_subcommand(1);
  zt::RunFlags flags;
  CLI::App* train = app.add_subcommand("train", "");
  zt::add_run_flags(*train, flags);
  zt_cli::harden(app);  // as zerotrain's main: a repeated flag's last value counts
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return 0;
  }
  try {
    zt::TrainConfig tc = flags.to_config();
    
    const zt::ModelConfig mc = zt::make_model_config(tc.model, tc.overrides);
    const zt::DeviceSpec spec = zt::parse_device_spec(tc.devices);
    // The device count without creating devices or asking the environment ("all" = 2 simulated).
    int n = 2;
    if (spec.kind == zt::DeviceSpec::Kind::kCpu && spec.cpu_count) n = spec.cpu_count;
    if (spec.kind == zt::DeviceSpec::Kind::kCuda && !spec.cuda_ordinals.empty())
      n = static_cast<int>(spec.cuda_ordinals.size());
    const zt::Backend backend = spec.kind == zt::DeviceSpec::Kind::kCuda ? zt::Backend::kCuda : zt::Backend::kCpu;
    const zt::RunContext s = zt::resolve_run_shape(tc, mc, n, backend);
    const zt::TrainConfig& c = s.cfg;
    if (mc.num_parameters() <= 0 || mc.num_parameters() > (int64_t{1} << 40)) __builtin_trap();
    if (c.batch_size < 1 || c.batch_size % n != 0 || c.micro_batch_size < 1) __builtin_trap();
    if (int64_t{s.accum} * c.micro_batch_size * n != c.batch_size) __builtin_trap();
    if (s.plan.micro_batches != s.accum || s.plan.micro_batch != c.micro_batch_size || s.plan.devices != n)
      __builtin_trap();
    if (s.T < 1 || (mc.kind == zt::ModelKind::kGpt && s.T > mc.seq_len)) __builtin_trap();
    if (!(c.lr > 0) || !(c.min_lr >= 0) || !std::isfinite(c.lr)) __builtin_trap();
  } catch (const zt::Error&) {
  }
  return 0;
}
