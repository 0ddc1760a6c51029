// zerotrain: the one binary. Subcommands: train (the default job trains gpt-tiny on the synthetic
// corpus), info (devices, peer access, build), plan (will it fit? apps/plan_command.cc), sweep (many
// trials at once, apps/sweep_command.cc). The only
// place an error becomes an exit code.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <set>
#include <sstream>
#include <cstdio>
#include <vector>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "cli_checks.h"
#include "cli_choice.h"
#include "config_file.h"
#include "flag_rules.h"
#include "comm/mesh.h"
#include "comm/nccl_comm.h"
#include "core/files.h"
#include "core/status.h"
#include "core/suggest.h"
#include "memory/caching_allocator.h"
#include "plan_command.h"
#include "run_flags.h"
#include "sweep_command.h"
#include "tokenize_cmd.h"
#include "generate_cmd.h"
#include "tokenizer/bpe.h"
#include "runtime/runtime.h"
#include "train/plot.h"
#include "train/processes.h"
#include "train/report.h"
#include "train/run_shape.h"
#include "train/trainer.h"
#include "train/export.h"

namespace {

constexpr int kExitRuntimeError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitDiverged = 3;  // the loss scale collapsed, or too many consecutive steps were skipped
constexpr int kExitLostProcess = 4;  // another process of an mpirun launch died or stalled (scripts may relaunch)

std::string human_bytes(double b) { return zt::format_bytes(b); }

// Predicted bytes per training step inside and across processes (ZeroTrain's ring collectives, fp32
// gradients and parameters, shards unpadded): K processes of this machine's L devices.
void print_traffic(int processes, int local, const std::string& model, int stage) {
  const zt::ModelConfig mc = zt::make_model_config(model);
  const int n = processes * local;
  // Stages 0-2: a gradient reduce-scatter and a parameter all-gather per step; stage 3 gathers the
  // parameters twice (forward and backward).
  const uint64_t passes = stage == 3 ? 3 : 2;
  const uint64_t shard = static_cast<uint64_t>(mc.num_parameters()) * 4 / static_cast<uint64_t>(n);
  std::printf("traffic per step, %s at ZeRO stage %d in fp32 over %d process%s x %d device%s (N = %d):\n",
              model.c_str(), stage, processes, processes == 1 ? "" : "es", local, local == 1 ? "" : "s", n);
  for (bool hier : {false, true}) {
    if (processes == 1 && hier) break;
    const zt::CollectiveTraffic t = zt::collective_traffic(processes, local, hier, passes * shard);
    std::printf("  %-13s %s between the devices of each process, %s out of each process\n",
                processes == 1 ? "one process" : hier ? "hierarchical" : "flat",
                human_bytes(static_cast<double>(t.inside)).c_str(), human_bytes(static_cast<double>(t.across)).c_str());
  }
}

// Measured peer-copy bandwidth: a copy of kProbe bytes from row to column, timed on the host
// around the source's comm stream (after one warm-up copy).
void print_peer_bandwidth(zt::Runtime& rt) {
  const size_t kProbe = rt.backend() == zt::Backend::kCuda ? (size_t{64} << 20) : (size_t{16} << 20);
  std::vector<zt::DeviceBuffer> bufs;
  for (int i = 0; i < rt.size(); ++i) {
    zt::Device& d = rt.device(i);
    bufs.emplace_back(d.memory(), kProbe, d.comm(), "bandwidth probe");
    d.comm().memset(bufs.back().data(), 1, kProbe);
    d.comm().synchronize();
  }
  std::printf("peer copy bandwidth, GB/s (%s copies, row -> column):\n     ", human_bytes(static_cast<double>(kProbe)).c_str());
  for (int j = 0; j < rt.size(); ++j) std::printf("%8d", j);
  std::printf("\n");
  for (int i = 0; i < rt.size(); ++i) {
    std::printf("  %2d ", i);
    zt::Stream& s = rt.device(i).comm();
    for (int j = 0; j < rt.size(); ++j) {
      if (i == j) {
        std::printf("%8s", "-");
        continue;
      }
      s.copy_peer(rt.device(j), bufs[static_cast<size_t>(j)].data(), bufs[static_cast<size_t>(i)].data(), kProbe);
      s.synchronize();
      constexpr int kReps = 3;
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < kReps; ++k)
        s.copy_peer(rt.device(j), bufs[static_cast<size_t>(j)].data(), bufs[static_cast<size_t>(i)].data(), kProbe);
      s.synchronize();
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%8.1f", static_cast<double>(kProbe) * kReps / sec / 1e9);
    }
    std::printf("\n");
  }
}

// --tensor-parallel T / --pipeline-parallel P: the mesh a train run would form on these
// devices, its groups, and whether each group's members reach each other directly (a pipeline
// group's neighbours exchange activations; device r holds stage r / (devices / P)).
void print_mesh(zt::Runtime& rt, int tensor, int pipeline) {
  ZT_REQUIRE(rt.size() % (tensor * pipeline) == 0, tensor > 1 ? "--tensor-parallel " : "--pipeline-parallel ",
             tensor * pipeline, " does not divide the ", rt.size(), rt.size() == 1 ? " device" : " devices");
  const zt::Mesh mesh(
      zt::MeshShape{.data = rt.size() / tensor / pipeline, .tensor = tensor, .pipeline = pipeline}, rt.size());
  std::printf("mesh: %s\n", mesh.describe().c_str());
  std::vector<zt::MeshAxis> axes;
  if (tensor > 1) axes.push_back(zt::MeshAxis::kTensor);
  if (pipeline > 1) axes.push_back(zt::MeshAxis::kPipeline);
  axes.push_back(zt::MeshAxis::kData);
  for (zt::MeshAxis axis : axes) {
    std::printf("  %s groups:", zt::mesh_axis_name(axis));
    for (const auto& g : mesh.groups(axis)) {
      bool peer = true;
      for (int a : g)
        for (int b : g) peer = peer && (a == b || rt.device(a).can_access_peer(rt.device(b)));
      std::string members;
      for (int a : g) {
        if (!members.empty()) members += ',';
        members += std::to_string(a);
      }
      std::printf(" {%s}%s", members.c_str(), peer ? "" : " (no peer access)");
    }
    std::printf("\n");
  }
}

// `zerotrain info`'s flags.
struct InfoFlags {
  std::string devices = "all";
  int tensor = 1, pipeline = 1;
  int processes = zt::launched_processes();
  std::string model = "gpt-tiny";
  int stage = 2;
};

CLI::App* add_info_command(CLI::App& app, InfoFlags& f) {
  CLI::App* info = app.add_subcommand("info", "Show devices, peer access and build options");
  info->add_option("--devices", f.devices, "Devices: all, cpu:N, cuda:0,1,3, cuda:0x4")
      ->capture_default_str();
  info->add_option("--tensor-parallel,--tp", f.tensor, "Show the (data x tensor) mesh --tensor-parallel T forms")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  info->add_option("--pipeline-parallel,--pp", f.pipeline,
                   "Show the (data x pipeline) mesh --pipeline-parallel P forms")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  info->add_option("--processes", f.processes,
                   "Predict the traffic per step of K processes (mpirun -np K) of these devices each (default: "
                   "the processes of this launch)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  info->add_option("--model", f.model, "The model whose traffic per step to predict")
      ->capture_default_str()->check(CLI::IsMember(zt::model_preset_names()));
  info->add_option("--zero-stage", f.stage, "The ZeRO stage whose traffic per step to predict")
      ->capture_default_str()->check(CLI::Range(0, 3));
  return info;
}

int run_info(const InfoFlags& f) {
  const int tensor = f.tensor, pipeline = f.pipeline;
  const zt::DeviceSpec spec = zt::parse_device_spec(f.devices);
  auto rt = zt::Runtime::create(spec);

  std::printf("ZeroTrain %s\n", ZT_VERSION_STR);
  std::printf("build: CUDA backend %s (archs %s), NVTX %s, BLAS OpenBLAS (%s)\n",
              ZT_WITH_CUDA ? "compiled" : "not compiled", ZT_CUDA_ARCHS_STR,
              ZT_NVTX_STR, openblas_get_config());
#if ZT_WITH_CUDA
  // What CMake found decides the GPU's speed (cuDNN's attention) and --comm nccl: say it here.
#if defined(ZT_WITH_CUDNN)
  const char* cudnn = "cuDNN attention built";
#else
  const char* cudnn = "cuDNN attention not built (the slower tiled attention kernels serve alone; see README \"Building\")";
#endif
  std::printf("gpu libraries: %s, NCCL %s\n", cudnn, zt::nccl_built() ? "built" : "not built (--comm nccl refused)");
#endif
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
  if (rt->size() > 1) print_peer_bandwidth(*rt);
  if (tensor > 1 || pipeline > 1) print_mesh(*rt, tensor, pipeline);
  print_traffic(f.processes, rt->size(), f.model, f.stage);
  const zt::MemoryStats st = rt->device(0).memory().stats();
  std::printf("pool: a caching allocator per device; requests rounded to %s, requests up to 1 MiB packed "
              "into %s segments, larger ones in their own segments rounded to 2 MiB; blocks are tied to their "
              "stream (reused elsewhere only after an event); device 0 holds %s reserved\n",
              human_bytes(static_cast<double>(zt::pool_rounded_size(1))).c_str(),
              human_bytes(static_cast<double>(zt::pool_small_segment_bytes())).c_str(),
              human_bytes(static_cast<double>(st.reserved_bytes)).c_str());
  return 0;
}

// `zerotrain export`'s flags.
struct ExportFlags {
  std::string checkpoint, out, tokenizer;
  bool hf = false;  // --format hf
};

CLI::App* add_export_command(CLI::App& app, ExportFlags& f) {
  CLI::App* exp = app.add_subcommand("export", "Write a checkpoint's weights as one safetensors file (GPT-2 tensor names)");
  exp->add_option("--checkpoint", f.checkpoint, "A checkpoint directory, or a --checkpoint-dir (its newest complete checkpoint)")
      ->required();
  exp->add_option("--out", f.out, "The .safetensors file to write (atomically); with --format hf, a directory")
      ->required();
  zt_cli::add_choice(*exp, "--format", f.hf, zt_cli::Choices<bool>{{"safetensors", false}, {"hf", true}},
                     "safetensors (one file), or hf: config.json + model.safetensors (+ the "
                     "tokenizer) that transformers' GPT2LMHeadModel.from_pretrained loads");
  exp->add_option("--tokenizer", f.tokenizer, "--format hf: the tokenizer directory to include (default: the one "
                  "beside the run's token shards, if any)");
  return exp;
}

int run_export(const ExportFlags& f) {
  if (f.hf) {
    const zt::HfExportReport rep = zt::export_hf(f.checkpoint, f.out, f.tokenizer);
    std::string files;
    for (const auto& name : rep.files) files += (files.empty() ? "" : ", ") + name;
    std::printf("exported step %lld of %s for Hugging Face transformers (GPT2LMHeadModel) to %s: %s\n",
                static_cast<long long>(rep.weights.step), rep.weights.checkpoint.c_str(), f.out.c_str(),
                files.c_str());
    return 0;
  }
  const zt::ExportReport rep = zt::export_safetensors(f.checkpoint, f.out);
  std::printf("exported %zu tensors (%s, step %lld of %s) to %s\n", rep.tensors,
              zt::format_bytes(static_cast<double>(rep.bytes)).c_str(), static_cast<long long>(rep.step),
              rep.checkpoint.c_str(), f.out.c_str());
  return 0;
}

// `zerotrain train`: every data-independent check (and the defaults, e.g. a batch that splits over
// the devices) before train() opens the data or creates a device; --print-config stops there.
int run_train(CLI::App& train, const zt::RunFlags& run_flags, bool print_config) {
  zt::TrainConfig tc = run_flags.to_config();
  const std::string& plot_path = run_flags.plot;
  // Token shards with their tokenizer beside them (zerotrain tokenize): the model's vocabulary is
  // the tokenizer's unless --vocab says otherwise.
  if (tc.overrides.vocab == 0)
    if (const auto v = zt::tokenizer_vocab_beside(tc.data)) tc.overrides.vocab = *v;
  const zt::ModelConfig mc = zt::make_model_config(tc.model, tc.overrides);
  const zt::PlannedDevices devs = zt::planned_devices(zt::parse_device_spec(tc.devices));
  // Under mpirun every process drives as many devices: the run's shape counts all of them.
  const zt::RunContext shape = zt::resolve_run_shape(tc, mc, devs.count * zt::launched_processes(), devs.backend);
  tc = shape.cfg;
  const std::vector<zt::InapplicableFlag> inapplicable = zt::inapplicable_run_flags(shape, mc);
  zt::refuse_given(train, inapplicable);
  zt::check_run_paths(tc, plot_path);
  if (!plot_path.empty()) zt::check_plot_path(plot_path);
  if (print_config || !tc.checkpoint_dir.empty()) {
    std::set<std::string> skip;
    for (const zt::InapplicableFlag& f : inapplicable) skip.insert(f.flag);
    // The automatic defaults the run resolved (comments: the file leaves them automatic).
    std::vector<std::string> resolved;
    auto note = [&](const char* flag, auto value) {
      if (train.count(std::string("--") + flag) != 0) return;
      std::ostringstream os;
      os.precision(9);
      os << flag << " = " << value;
      resolved.push_back(os.str());
    };
    if (tc.steps > 0) note("steps", tc.steps);
    note("batch-size", tc.batch_size);
    note("micro-batch-size", tc.micro_batch_size);
    note("lr", tc.lr);
    if (!skip.count("min-lr")) note("min-lr", tc.min_lr);
    if (tc.warmup_steps >= 0) note("warmup-steps", tc.warmup_steps);
    if (tc.eval_every >= 0) note("eval-every", tc.eval_every);
    if (!skip.count("train-seq-len")) note("train-seq-len", tc.train_seq_len);
    // auto is bf16 on GPUs and fp32 on the CPU backend: the file says which this run got (whether
    // auto came from the default, the command line or a --config file, so printing is a fixed point).
    if (run_flags.config.precision == zt::Precision::kAuto)
      resolved.push_back(std::string("precision = '") + zt::precision_name(shape.precision) + "'");
    tc.run_config = zt::format_config(train, skip, resolved);
    if (print_config) {  // checked: a closed pipe or a full disk is an error, not exit 0
      zt::write_stdout_line(std::string_view(tc.run_config).substr(0, tc.run_config.size() - 1));
      return 0;
    }
  }
  const zt::TrainResult result = zt::train(tc);
  if (!plot_path.empty()) {
    zt::LossCurve curve{result.losses, result.val_losses, result.entropy_floor, tc.model + " on " + tc.data};
    zt::write_loss_curve_svg(plot_path, curve);
    if (tc.log_format == zt::LogFormat::kText && !tc.quiet) std::printf("loss curve: %s\n", plot_path.c_str());
  }
  // Stopped by the first SIGINT/SIGTERM after a whole step (and its checkpoint): 128 + signal.
  return result.signal != 0 ? 128 + result.signal : 0;
}

// Parses the command line into `app` (a run-shaped subcommand's --config file first, so that the
// command line's flags override it); `args` are the arguments parsed, without the program name.
// Returns the exit code when the process ends here (--help, --version, a usage error).
std::optional<int> parse_command_line(CLI::App& app, const CLI::App& train, int argc, char** argv,
                                      std::vector<std::string>& args) {
  const std::vector<std::string> subcommands = {"train", "info", "plan", "export", "sweep", "tokenize", "generate", "eval"};
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
  // The arguments CLI11 parses: the subcommand's --config file (as arguments) before the command
  // line's own, so that a flag on the command line overrides the file.
  args.assign(argv + 1, argv + argc);
  if (const std::string bad = zt_cli::empty_assignment(args); !bad.empty()) {
    std::fprintf(stderr, "zerotrain: %s\n", bad.c_str());
    return kExitUsage;
  }
  const std::set<std::string> run_shaped = {"train", "plan", "sweep"};  // the subcommands that take --config
  if (argc > 1 && run_shaped.count(args[0])) {
    const std::vector<std::string> rest(args.begin() + 1, args.end());
    if (const std::string path = zt::config_path(rest); !path.empty()) try {
        std::vector<std::string> merged = zt::config_arguments(*app.get_subcommand(args[0]), path, rest);
        merged.insert(merged.begin(), args[0]);
        merged.insert(merged.end(), rest.begin(), rest.end());
        args = std::move(merged);
      } catch (const zt::Error& e) {
        std::fprintf(stderr, "zerotrain: %s\n", e.message().c_str());
        return kExitUsage;
      }
  }
  std::vector<const char*> parse_argv = {argv[0]};
  for (const std::string& a : args) parse_argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(parse_argv.size()), parse_argv.data());
  } catch (const CLI::ExtrasError& e) {
    // "The following argument was not expected: --stpes" + the nearest flag of the subcommand.
    const CLI::App* sub = &train;
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
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeroTrain: one process trains across every local GPU, ZeRO-style"};
  app.require_subcommand(1);
  app.set_version_flag("--version", ZT_VERSION_STR);

  InfoFlags info_flags;
  CLI::App* info = add_info_command(app, info_flags);

  zt::RunFlags run_flags;
  CLI::App* train = app.add_subcommand("train", "Train a model (default: gpt-tiny on the synthetic corpus)");
  zt::add_run_flags(*train, run_flags);

  zt::PlanCommand plan(app);
  zt::SweepCommand sweep(app);
  zt::TokenizeCommand tokenize(app);
  zt::GenerateCommand generate(app);
  zt::EvalCommand eval(app);
  ExportFlags export_flags;
  CLI::App* exp = add_export_command(app, export_flags);
  // --config FILE for the run-shaped subcommands; train --print-config writes the resolved flags.
  for (CLI::App* sub : {train, app.get_subcommand("plan"), app.get_subcommand("sweep")}) zt::add_config_option(*sub);
  bool print_config = false;
  train->add_flag("--print-config", print_config,
                  "Write this run's flags (the given ones, the defaults, and as comments the values the run "
                  "resolves) as TOML to stdout and exit without training; --config of that file reproduces the run");
  // After every option exists (also those other files add): the last value of a repeated flag counts.
  zt_cli::harden(app);
  std::vector<std::string> args;
  if (const std::optional<int> exit_code = parse_command_line(app, *train, argc, argv, args)) return *exit_code;

  try {
    if (info->parsed()) return run_info(info_flags);
    if (plan.parsed()) return plan.run();
    if (sweep.parsed()) return sweep.run(std::vector<std::string>(args.begin() + 1, args.end()));
    if (tokenize.parsed()) return tokenize.run();
    if (generate.parsed()) return generate.run();
    if (eval.parsed()) return eval.run();
    if (exp->parsed()) return run_export(export_flags);
    if (train->parsed()) return run_train(*train, run_flags, print_config);
  } catch (const zt::Error& e) {
    std::fprintf(stderr, "zerotrain: %s\n", e.message().c_str());
    if (e.kind() == zt::ErrorKind::kDiverged) return kExitDiverged;
    if (e.kind() == zt::ErrorKind::kLostProcess) return kExitLostProcess;
    return e.kind() == zt::ErrorKind::kInvalidArgument ? kExitUsage : kExitRuntimeError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zerotrain: internal error: %s\n", e.what());
    return kExitRuntimeError;
  }
  return 0;
}
