// zerotrain: the one binary. Subcommands: train (the default job trains gpt-tiny on the synthetic
// corpus), info (devices, peer access, build), plan (will it fit? apps/plan_command.cc). The only
// place an error becomes an exit code.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstdlib>
#include <iostream>
#include <string>

#include "cli_checks.h"
#include "core/status.h"
#include "core/suggest.h"
#include "memory/caching_allocator.h"
#include "plan_command.h"
#include "runtime/runtime.h"
#include "train/plot.h"
#include "train/report.h"
#include "train/trainer.h"
#include "train/export.h"

namespace {

constexpr int kExitRuntimeError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitDiverged = 3;  // the loss scale collapsed, or too many consecutive steps were skipped

std::string human_bytes(double b) { return zt::format_bytes(b); }

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
  // Measured peer-copy bandwidth: a copy of kProbe bytes from row to column, timed on the host
  // around the source's comm stream (after one warm-up copy).
  if (rt->size() > 1) {
    const size_t kProbe = rt->backend() == zt::Backend::kCuda ? (size_t{64} << 20) : (size_t{16} << 20);
    std::vector<zt::DeviceBuffer> bufs;
    for (int i = 0; i < rt->size(); ++i) {
      zt::Device& d = rt->device(i);
      bufs.emplace_back(d.memory(), kProbe, d.comm(), "bandwidth probe");
      d.comm().memset(bufs.back().data(), 1, kProbe);
      d.comm().synchronize();
    }
    std::printf("peer copy bandwidth, GB/s (%s copies, row -> column):\n     ", human_bytes(static_cast<double>(kProbe)).c_str());
    for (int j = 0; j < rt->size(); ++j) std::printf("%8d", j);
    std::printf("\n");
    for (int i = 0; i < rt->size(); ++i) {
      std::printf("  %2d ", i);
      zt::Stream& s = rt->device(i).comm();
      for (int j = 0; j < rt->size(); ++j) {
        if (i == j) {
          std::printf("%8s", "-");
          continue;
        }
        s.copy_peer(rt->device(j), bufs[static_cast<size_t>(j)].data(), bufs[static_cast<size_t>(i)].data(), kProbe);
        s.synchronize();
        constexpr int kReps = 3;
        const auto t0 = std::chrono::steady_clock::now();
        for (int k = 0; k < kReps; ++k)
          s.copy_peer(rt->device(j), bufs[static_cast<size_t>(j)].data(), bufs[static_cast<size_t>(i)].data(), kProbe);
        s.synchronize();
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("%8.1f", static_cast<double>(kProbe) * kReps / sec / 1e9);
      }
      std::printf("\n");
    }
  }
  const zt::MemoryStats st = rt->device(0).memory().stats();
  std::printf("pool: a caching allocator per device; requests rounded to %s, requests up to 1 MiB packed "
              "into %s segments, larger ones in their own segments rounded to 2 MiB; blocks are tied to their "
              "stream (reused elsewhere only after an event); device 0 holds %s reserved\n",
              human_bytes(static_cast<double>(zt::pool_rounded_size(1))).c_str(),
              human_bytes(static_cast<double>(zt::pool_small_segment_bytes())).c_str(),
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
  std::string schedule = "cosine", optimizer = "adamw", hidden, log_format = "text", plot_path, precision = "auto",
              on_collapse = "stop";
  std::vector<std::string> inject_faults;
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
    train->add_option("--steps", tc.steps, "Optimizer steps (default 1500; MLP: --epochs worth)")->check(zt_cli::whole(1));
    train->add_option("--epochs", tc.epochs, "Image data: epochs to train when --steps is not given (default 3)")
        ->check(zt_cli::whole(1));
    train->add_option("--batch-size", tc.batch_size, "Global batch in sequences/examples (default 8; MLP 128)")
        ->check(zt_cli::whole(1));
    train->add_option("--micro-batch-size", tc.micro_batch_size, "Per-device micro-batch; accumulation = batch / (devices x micro-batch)")
        ->check(zt_cli::whole(1));
    train->add_option("--lr", tc.lr, "Peak learning rate (default 3e-3 GPT, 1e-3 MLP, 0.05 SGD)")->check(zt_cli::number(0, true));
    train->add_option("--min-lr", tc.min_lr, "Final learning rate (default lr/10)")->check(zt_cli::number(0, false));
    train->add_option("--warmup-steps", tc.warmup_steps, "Linear warmup steps (default 2% of steps)")
        ->check(zt_cli::whole(0));
    train->add_option("--lr-schedule", schedule, "cosine, linear or constant")->capture_default_str()
        ->check(CLI::IsMember({"cosine", "linear", "constant"}));
    train->add_option("--weight-decay", tc.weight_decay, "Decoupled weight decay (matrices and embeddings)")
        ->capture_default_str()->check(zt_cli::number(0, false));
    train->add_option("--grad-clip", tc.grad_clip, "Clip the global gradient norm to this (0 = off)")
        ->capture_default_str()->check(zt_cli::number(0, false));
    train->add_option("--optimizer", optimizer, "adamw or sgd (momentum 0.9)")->capture_default_str()
        ->check(CLI::IsMember({"adamw", "sgd"}));
    train->add_option("--seed", tc.seed, "Seed for initialisation, data order and sampling")->capture_default_str()
        ->check(zt_cli::seed());
    train->add_option("--eval-every", tc.eval_every, "Evaluate every N steps (default 4 times a run)")
        ->check(zt_cli::whole(0));
    train->add_option("--eval-batches", tc.eval_batches, "Validation batches per evaluation")->capture_default_str()
        ->check(zt_cli::whole(1));
    train->add_option("--sample-every", tc.sample_every, "Print a text sample every N steps (0 = only at the end)")
        ->check(zt_cli::whole(0));
    train->add_option("--sample-tokens", tc.sample_tokens, "Tokens per sample")->capture_default_str()
        ->check(zt_cli::whole(0));
    train->add_option("--temperature", tc.temperature, "Sampling temperature")->capture_default_str()
        ->check(zt_cli::number(0, true));
    train->add_option("--top-k", tc.top_k, "Sample from the k most likely tokens (0 = all)")->capture_default_str()
        ->check(zt_cli::whole(0));
    train->add_option("--metrics", tc.metrics_path, "Write JSON lines: one per step, eval and a summary");
    train->add_option("--trace", tc.trace_path,
                      "Write a Chrome/Perfetto trace (JSON): stream work and host ranges per device, pool bytes");
    train->add_option("--profile-steps", tc.profile_steps,
                      "A:B: CUDA profiler capture (cudaProfilerStart/Stop) around steps A..B, for nsys "
                      "--capture-range=cudaProfilerApi");
    train->add_option("--layers", tc.overrides.layers, "Override the preset's layer count")->check(zt_cli::whole(1));
    train->add_option("--heads", tc.overrides.heads, "Override the preset's head count")->check(zt_cli::whole(1));
    train->add_option("--embd", tc.overrides.embd, "Override the preset's width")->check(zt_cli::whole(1));
    train->add_option("--seq-len", tc.overrides.seq_len, "Override the model's context length")->check(zt_cli::whole(1));
    train->add_option("--train-seq-len", tc.train_seq_len, "Tokens per training sequence (default: the context)")
        ->check(zt_cli::whole(1));
    train->add_option("--vocab", tc.overrides.vocab, "Override the vocabulary size")->check(zt_cli::whole(1));
    train->add_option("--hidden", hidden, "MLP hidden sizes, e.g. 256,128");
    train->add_flag("--quiet", tc.quiet, "No progress output");
    zt::add_device_memory_option(*train, tc.device_memory);
    train->add_option("--log-format", log_format, "text (progress line, summary table) or json (the --metrics records on stdout)")
        ->capture_default_str()->check(CLI::IsMember({"text", "json"}));
    train->add_option("--plot", plot_path, "Write the loss curve (train, eval, entropy floor) as an SVG file");
    train->add_option("--precision", precision,
                      "Parameters and gradients: fp32, bf16, fp16, or auto (bf16 on GPUs, fp32 on the CPU backend); "
                      "master weights and moments stay fp32")
        ->capture_default_str()->check(CLI::IsMember({"auto", "fp32", "bf16", "fp16"}));
    train->add_option("--loss-scale", tc.loss_scale, "dynamic, none, a fixed number, or auto (dynamic for fp16, none otherwise)")
        ->capture_default_str();
    train->add_option("--initial-scale", tc.initial_scale, "Dynamic loss scaling: initial scale")->capture_default_str()
        ->check(zt_cli::number(0, true));
    train->add_option("--scale-window", tc.scale_window, "Dynamic loss scaling: overflow-free steps before the scale doubles")
        ->capture_default_str()->check(zt_cli::whole(1));
    train->add_option("--scale-hysteresis", tc.scale_hysteresis,
                      "Dynamic loss scaling: overflows tolerated (step skipped, scale kept) before the scale halves")
        ->capture_default_str()->check(zt_cli::whole(1));
    train->add_option("--min-scale", tc.min_scale, "Dynamic loss scaling: the scale never goes below this; an overflow there is a collapse")
        ->capture_default_str()->check(zt_cli::number(0, true));
    train->add_option("--max-scale", tc.max_scale, "Dynamic loss scaling: the scale never grows above this")
        ->capture_default_str()->check(zt_cli::number(0, true));
    train->add_flag("--stochastic-rounding", tc.stochastic_rounding,
                    "Round the 16-bit parameters stochastically from the fp32 master (seeded by --seed)");
    train->add_option("--on-scale-collapse", on_collapse,
                      "fp16: when the loss scale collapses, stop (exit code 3) or continue in bf16")
        ->capture_default_str()->check(CLI::IsMember({"stop", "bf16"}));
    train->add_option("--init-from", tc.init_from, "Start from these weights (safetensors, GPT-2 tensor names) instead of a seeded init");
    train->add_option("--checkpoint-dir", tc.checkpoint_dir,
                      "Save sharded checkpoints here (every --save-every steps and at the end), atomically");
    train->add_option("--save-every", tc.save_every, "Save a checkpoint every N steps (0 = only at the end)")
        ->capture_default_str()->check(zt_cli::whole(0));
    train->add_option("--keep", tc.keep, "Complete checkpoints to keep (older ones are pruned after a save; 0 = all)")
        ->capture_default_str()->check(zt_cli::whole(0));
    train->add_option("--resume", tc.resume,
                      "auto (the newest complete checkpoint in --checkpoint-dir, else start fresh) or a checkpoint "
                      "directory; any device count and ZeRO stage");
    train->add_option("--snapshot-every", tc.snapshot_every,
                      "Keep a host-memory snapshot of every shard every N steps; a failed device is then dropped and "
                      "the run goes on from the snapshot on the others (0 = off)")
        ->capture_default_str()->check(zt_cli::whole(0));
    train->add_option("--inject-fault", inject_faults,
                      "device=D,step=S[,kind=error|hang]: make device D (its position among the devices at that "
                      "step) fail at step S (testing recovery; may be given more than once)");
    train->add_option("--hang-timeout", tc.hang_timeout_s, "Seconds a step may take before its devices count as hung")
        ->capture_default_str()->check(zt_cli::number(0, true));
    train->add_option("--max-skipped-steps", tc.max_skipped_steps,
                      "Stop (exit code 3) after this many consecutive steps skipped for non-finite gradients or loss")
        ->capture_default_str()->check(zt_cli::whole(1));
  }

  zt::PlanCommand plan(app);
  std::string export_checkpoint, export_out;
  CLI::App* exp = app.add_subcommand("export", "Write a checkpoint's weights as one safetensors file (GPT-2 tensor names)");
  exp->add_option("--checkpoint", export_checkpoint, "A checkpoint directory, or a --checkpoint-dir (its newest complete checkpoint)")
      ->required();
  exp->add_option("--out", export_out, "The .safetensors file to write (atomically)")->required();
  const std::vector<std::string> subcommands = {"train", "info", "plan", "export"};
  if (argc > 1 && argv[1][0] != '-' &&
      std::find(subcommands.begin(), subcommands.end(), argv[1]) == subcommands.end()) {
    std::string names;
    for (const auto& n : subcommands) names += (names.empty() ? "" : ", ") + n;
    const auto near = zt::nearest_name(argv[1], subcommands);
    const std::string hint = near ? "did you mean '" + *near + "'? " : "";
    std::fprintf(stderr, "zerotrain: unknown subcommand '%s'; %sexpected one of: %s\n", argv[1], hint.c_str(),
                 names.c_str());
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ExtrasError& e) {
    // "The following argument was not expected: --stpes" + the nearest flag of the subcommand.
    const CLI::App* sub = train;
    if (argc > 1 && argv[1][0] != '-') sub = app.get_subcommand(argv[1]);  // validated above
    std::vector<std::string> flags;
    for (const CLI::Option* o : sub->get_options())
      for (const std::string& n : o->get_lnames()) flags.push_back("--" + n);
    std::string msg = e.what(), hints;
    const size_t colon = msg.find(": ");
    std::string rest = colon == std::string::npos ? "" : msg.substr(colon + 2);
    for (size_t pos = 0; pos < rest.size();) {
      size_t end = rest.find(' ', pos);
      if (end == std::string::npos) end = rest.size();
      const std::string word = rest.substr(pos, end - pos), name = word.substr(0, word.find('='));
      if (name.rfind("--", 0) == 0)
        if (const auto near = zt::nearest_name(name, flags)) hints += "; did you mean " + *near + "?";
      pos = end + 1;
    }
    std::fprintf(stderr, "zerotrain %s: %s%s\nRun with --help for more information.\n", sub->get_name().c_str(),
                 msg.c_str(), hints.c_str());
    return kExitUsage;
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }

  try {
    if (info->parsed()) return run_info(devices);
    if (plan.parsed()) return plan.run();
    if (exp->parsed()) {
      const zt::ExportReport rep = zt::export_safetensors(export_checkpoint, export_out);
      std::printf("exported %zu tensors (%s, step %lld of %s) to %s\n", rep.tensors,
                  zt::format_bytes(static_cast<double>(rep.bytes)).c_str(), static_cast<long long>(rep.step),
                  rep.checkpoint.c_str(), export_out.c_str());
      return 0;
    }
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
      tc.log_format = log_format == "json" ? zt::LogFormat::kJson : zt::LogFormat::kText;
      tc.precision = zt::parse_precision(precision);
      tc.on_scale_collapse_bf16 = on_collapse == "bf16";
      for (const std::string& f : inject_faults) tc.inject_faults.push_back(zt::parse_fault_injection(f));
      if (!plot_path.empty()) zt::check_plot_path(plot_path);
      const zt::TrainResult result = zt::train(tc);
      if (!plot_path.empty()) {
        zt::LossCurve curve{result.losses, result.val_losses, result.entropy_floor, tc.model + " on " + tc.data};
        zt::write_loss_curve_svg(plot_path, curve);
        if (tc.log_format == zt::LogFormat::kText && !tc.quiet) std::printf("loss curve: %s\n", plot_path.c_str());
      }
      // Stopped by the first SIGINT/SIGTERM after a whole step (and its checkpoint): 128 + signal.
      return result.signal != 0 ? 128 + result.signal : 0;
    }
  } catch (const zt::Error& e) {
    std::fprintf(stderr, "zerotrain: %s\n", e.message().c_str());
    if (e.kind() == zt::ErrorKind::kDiverged) return kExitDiverged;
    return e.kind() == zt::ErrorKind::kInvalidArgument ? kExitUsage : kExitRuntimeError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zerotrain: internal error: %s\n", e.what());
    return kExitRuntimeError;
  }
  return 0;
}
