// zerotrain: the one binary. Subcommands: train (the default job trains gpt-tiny on the synthetic
// corpus), info (devices, peer access, build). The only place an error becomes an exit code.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <vector>
#include <cstdlib>
#include <iostream>
#include <string>

#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"
#include "train/trainer.h"

namespace {

constexpr int kExitRuntimeError = 1;
constexpr int kExitUsage = 2;

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", b, units[u]);
  return buf;
}

int run_info(const std::string& devices_flag) {
  const zt::DeviceSpec spec = zt::parse_device_spec(devices_flag);
  auto rt = zt::Runtime::create(spec);

  std::printf("ZeroTrain %s\n", ZT_VERSION_STR);
  std::printf("build: CUDA backend %s (archs %s), NVTX %s, BLAS OpenBLAS (%s)\n",
              ZT_WITH_CUDA ? "compiled" : "not compiled", ZT_CUDA_ARCHS_STR,
              ZT_NVTX_STR, openblas_get_config());
  const zt::CudaAvailability cuda = zt::cuda_availability();
  if (cuda.usable)
    std::printf("cuda: %d GPU%s visible\n", cuda.device_count, cuda.device_count == 1 ? "" : "s");
  else
    std::printf("cuda: %s\n", cuda.reason.c_str());
  if (!rt->fallback_note().empty()) std::printf("note: %s\n", rt->fallback_note().c_str());

  std::printf("devices (%s backend, %d):\n", zt::backend_name(rt->backend()), rt->size());
  for (int i = 0; i < rt->size(); ++i) {
    zt::Device& d = rt->device(i);
    std::printf("  [%d] %-40s memory %s\n", i, d.name().c_str(), human_bytes(static_cast<double>(d.total_memory())).c_str());
  }
  std::printf("peer access (row can read/write column directly):\n     ");
  for (int j = 0; j < rt->size(); ++j) std::printf("%4d", j);
  std::printf("\n");
  for (int i = 0; i < rt->size(); ++i) {
    std::printf("  %2d ", i);
    for (int j = 0; j < rt->size(); ++j)
      std::printf("%4s", i == j ? "-" : rt->device(i).can_access_peer(rt->device(j)) ? "Y" : "n");
    std::printf("\n");
  }
  const zt::MemoryStats st = rt->device(0).memory().stats();
  std::printf("pool: caching allocator per device (small requests packed in 2 MiB segments, "
              "large rounded to 2 MiB); device 0 reserved %s\n",
              human_bytes(static_cast<double>(st.reserved_bytes)).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeroTrain: one process trains across every local GPU, ZeRO-style"};
  app.require_subcommand(1);
  app.set_version_flag("--version", ZT_VERSION_STR);

  std::string devices = "all";
  CLI::App* info = app.add_subcommand("info", "Show devices, peer access and build options");
  info->add_option("--devices", devices, "Devices: all, cpu:N, cuda:0,1,3, cuda:0x4")
      ->capture_default_str();

  zt::TrainConfig tc;
  std::string schedule = "cosine", optimizer = "adamw", hidden;
  CLI::App* train = app.add_subcommand("train", "Train a model (default: gpt-tiny on the synthetic corpus)");
  {
    std::string presets;
    for (const auto& n : zt::model_preset_names()) presets += (presets.empty() ? "" : ", ") + n;
    train->add_option("--model", tc.model, "Model preset: " + presets)->capture_default_str();
    train->add_option("--data", tc.data,
                      "synthetic, a text file, llm.c token shards (*.bin glob), or fashion-mnist (MLP)")
        ->capture_default_str();
    train->add_option("--devices", tc.devices, "Devices: all (every GPU, else 2 simulated), cpu:N, cuda:0,1,3, cuda:0x4")
        ->capture_default_str();
    train->add_option("--zero-stage", tc.zero_stage,
                      "ZeRO stage: 0 data parallel, 1 shard optimizer state, 2 + gradients, 3 + parameters")
        ->capture_default_str()->check(CLI::Range(0, 3));
    train->add_option("--steps", tc.steps, "Optimizer steps (default 1500; MLP: --epochs worth)")->check(CLI::PositiveNumber);
    train->add_option("--epochs", tc.epochs, "Image data: epochs to train when --steps is not given (default 3)")
        ->check(CLI::PositiveNumber);
    train->add_option("--batch-size", tc.batch_size, "Global batch in sequences/examples (default 8; MLP 128)")
        ->check(CLI::PositiveNumber);
    train->add_option("--micro-batch-size", tc.micro_batch_size, "Per-device micro-batch; accumulation = batch / (devices x micro-batch)")
        ->check(CLI::PositiveNumber);
    train->add_option("--lr", tc.lr, "Peak learning rate (default 3e-3 GPT, 1e-3 MLP, 0.05 SGD)")->check(CLI::PositiveNumber);
    train->add_option("--min-lr", tc.min_lr, "Final learning rate (default lr/10)")->check(CLI::NonNegativeNumber);
    train->add_option("--warmup-steps", tc.warmup_steps, "Linear warmup steps (default 2% of steps)")
        ->check(CLI::NonNegativeNumber);
    train->add_option("--lr-schedule", schedule, "cosine, linear or constant")->capture_default_str()
        ->check(CLI::IsMember({"cosine", "linear", "constant"}));
    train->add_option("--weight-decay", tc.weight_decay, "Decoupled weight decay (matrices and embeddings)")
        ->capture_default_str()->check(CLI::NonNegativeNumber);
    train->add_option("--grad-clip", tc.grad_clip, "Clip the global gradient norm to this (0 = off)")
        ->capture_default_str()->check(CLI::NonNegativeNumber);
    train->add_option("--optimizer", optimizer, "adamw or sgd (momentum 0.9)")->capture_default_str()
        ->check(CLI::IsMember({"adamw", "sgd"}));
    train->add_option("--seed", tc.seed, "Seed for initialisation, data order and sampling")->capture_default_str();
    train->add_option("--eval-every", tc.eval_every, "Evaluate every N steps (default 4 times a run)")
        ->check(CLI::NonNegativeNumber);
    train->add_option("--eval-batches", tc.eval_batches, "Validation batches per evaluation")->capture_default_str()
        ->check(CLI::PositiveNumber);
    train->add_option("--sample-every", tc.sample_every, "Print a text sample every N steps (0 = only at the end)")
        ->check(CLI::NonNegativeNumber);
    train->add_option("--sample-tokens", tc.sample_tokens, "Tokens per sample")->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    train->add_option("--temperature", tc.temperature, "Sampling temperature")->capture_default_str()
        ->check(CLI::PositiveNumber);
    train->add_option("--top-k", tc.top_k, "Sample from the k most likely tokens (0 = all)")->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    train->add_option("--metrics", tc.metrics_path, "Write JSON lines: one per step, eval and a summary");
    train->add_option("--layers", tc.overrides.layers, "Override the preset's layer count")->check(CLI::PositiveNumber);
    train->add_option("--heads", tc.overrides.heads, "Override the preset's head count")->check(CLI::PositiveNumber);
    train->add_option("--embd", tc.overrides.embd, "Override the preset's width")->check(CLI::PositiveNumber);
    train->add_option("--seq-len", tc.overrides.seq_len, "Override the model's context length")->check(CLI::PositiveNumber);
    train->add_option("--train-seq-len", tc.train_seq_len, "Tokens per training sequence (default: the context)")
        ->check(CLI::PositiveNumber);
    train->add_option("--vocab", tc.overrides.vocab, "Override the vocabulary size")->check(CLI::PositiveNumber);
    train->add_option("--hidden", hidden, "MLP hidden sizes, e.g. 256,128");
    train->add_flag("--quiet", tc.quiet, "No progress output");
  }

  const std::vector<std::string> subcommands = {"train", "info"};
  if (argc > 1 && argv[1][0] != '-' &&
      std::find(subcommands.begin(), subcommands.end(), argv[1]) == subcommands.end()) {
    std::string names;
    for (const auto& n : subcommands) names += (names.empty() ? "" : ", ") + n;
    std::fprintf(stderr, "zerotrain: unknown subcommand '%s'; expected one of: %s\n", argv[1], names.c_str());
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }

  try {
    if (info->parsed()) return run_info(devices);
    if (train->parsed()) {
      tc.schedule = zt::parse_lr_schedule(schedule);
      tc.optimizer = optimizer == "sgd" ? zt::OptimizerKind::kSgd : zt::OptimizerKind::kAdamW;
      if (!hidden.empty()) {
        size_t pos = 0;
        while (pos <= hidden.size()) {
          const size_t comma = hidden.find(',', pos);
          const std::string item = hidden.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
          char* end = nullptr;
          const long v = std::strtol(item.c_str(), &end, 10);
          if (item.empty() || *end != '\0' || v <= 0 || v > (1 << 20))
            throw zt::Error(zt::ErrorKind::kInvalidArgument, "--hidden '" + hidden + "' must be positive sizes separated by commas, e.g. 256,128");
          tc.overrides.hidden.push_back(static_cast<int>(v));
          if (comma == std::string::npos) break;
          pos = comma + 1;
        }
      }
      zt::train(tc);
      return 0;
    }
  } catch (const zt::Error& e) {
    std::fprintf(stderr, "zerotrain: %s\n", e.message().c_str());
    return e.kind() == zt::ErrorKind::kInvalidArgument ? kExitUsage : kExitRuntimeError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zerotrain: internal error: %s\n", e.what());
    return kExitRuntimeError;
  }
  return 0;
}
