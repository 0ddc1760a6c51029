// `zerotrain plan`: resolves the run as `train` does (devices, batch split, sequence length) and
// prints train/plan.h's per-device prediction and verdict.
#include "plan_command.h"

#include <cstdio>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/config.h"
#include "runtime/runtime.h"
#include "train/plan.h"
#include "train/trainer.h"

namespace zt {

namespace {

std::vector<int> parse_hidden(const std::string& hidden) {
  std::vector<int> out;
  size_t pos = 0;
  while (!hidden.empty() && pos <= hidden.size()) {
    const size_t comma = hidden.find(',', pos);
    const std::string item = hidden.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    ZT_REQUIRE(!item.empty() && *end == '\0' && v > 0 && v <= (1 << 20), "--hidden '", hidden,
               "' must be positive sizes separated by commas, e.g. 256,128");
    out.push_back(static_cast<int>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace

struct PlanCommand::Flags {
  std::string model = "gpt-tiny", devices = "all", optimizer = "adamw", hidden, precision = "auto";
  ModelOverrides overrides;
  int zero_stage = 2, batch_size = -1, micro_batch_size = 0, train_seq_len = 0;
  size_t device_memory = 0;
};

void add_device_memory_option(CLI::App& sub, size_t& bytes) {
  sub.add_option_function<std::string>(
         "--device-memory",
         [&bytes](const std::string& s) {
           try {
             bytes = parse_memory_size(s);
           } catch (const Error& e) {
             throw CLI::ValidationError(e.message());
           }
         },
         "Memory of each simulated CPU device (e.g. 16GiB, 512MiB); plan: also overrides a GPU's memory")
      ->type_name("SIZE");
}

PlanCommand::PlanCommand(CLI::App& app) : f_(std::make_shared<Flags>()) {
  sub_ = app.add_subcommand("plan", "Predict per-device memory of a training run and whether it fits");
  Flags& f = *f_;
  std::string presets;
  for (const auto& n : model_preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  sub_->add_option("--model", f.model, "Model preset: " + presets)->capture_default_str();
  sub_->add_option("--devices", f.devices, "Devices: all (every GPU, else 2 simulated), cpu:N, cuda:0,1,3, cuda:0x4")
      ->capture_default_str();
  sub_->add_option("--zero-stage", f.zero_stage, "ZeRO stage 0-3")->capture_default_str()->check(CLI::Range(0, 3));
  sub_->add_option("--batch-size", f.batch_size, "Global batch (default 8 per 2 devices; MLP 128)")
      ->check(CLI::PositiveNumber);
  sub_->add_option("--micro-batch-size", f.micro_batch_size, "Per-device micro-batch (default batch / devices)")
      ->check(CLI::PositiveNumber);
  sub_->add_option("--train-seq-len", f.train_seq_len, "Tokens per training sequence (default: the context)")
      ->check(CLI::PositiveNumber);
  sub_->add_option("--optimizer", f.optimizer, "adamw or sgd")->capture_default_str()->check(CLI::IsMember({"adamw", "sgd"}));
  sub_->add_option("--layers", f.overrides.layers, "Override the preset's layer count")->check(CLI::PositiveNumber);
  sub_->add_option("--heads", f.overrides.heads, "Override the preset's head count")->check(CLI::PositiveNumber);
  sub_->add_option("--embd", f.overrides.embd, "Override the preset's width")->check(CLI::PositiveNumber);
  sub_->add_option("--seq-len", f.overrides.seq_len, "Override the model's context length")->check(CLI::PositiveNumber);
  sub_->add_option("--vocab", f.overrides.vocab, "Override the vocabulary size")->check(CLI::PositiveNumber);
  sub_->add_option("--hidden", f.hidden, "MLP hidden sizes, e.g. 256,128");
  sub_->add_option("--precision", f.precision, "fp32, bf16, fp16 or auto (bf16 on GPUs, fp32 on the CPU backend)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "fp32", "bf16", "fp16"}));
  add_device_memory_option(*sub_, f.device_memory);
}

bool PlanCommand::parsed() const { return sub_->parsed(); }

int PlanCommand::run() {
  Flags f = *f_;
  f.overrides.hidden = parse_hidden(f.hidden);
  const ModelConfig mc = make_model_config(f.model, f.overrides);
  const bool gpt = mc.kind == ModelKind::kGpt;
  auto rt = Runtime::create(parse_device_spec(f.devices), CpuDeviceOptions{f.device_memory});
  const int N = rt->size();
  // The same resolution and checks as train() (train/trainer.cc).
  if (f.batch_size < 0) f.batch_size = (gpt ? 8 : 128) * ((N + 1) / 2);
  ZT_REQUIRE(f.batch_size % N == 0, "--batch-size ", f.batch_size, " does not split evenly over ", N,
             " devices; use a multiple of ", N);
  if (f.micro_batch_size == 0) f.micro_batch_size = f.batch_size / N;
  ZT_REQUIRE(f.micro_batch_size >= 1 && (f.batch_size / N) % f.micro_batch_size == 0, "--batch-size ", f.batch_size,
             " over ", N, " device", N == 1 ? "" : "s", " is ", f.batch_size / N,
             " per device, not a multiple of --micro-batch-size ", f.micro_batch_size,
             "; the global batch must split into whole micro-batches");
  const int T = gpt ? (f.train_seq_len ? f.train_seq_len : mc.seq_len) : 1;
  PlanInputs in;
  in.zero_stage = f.zero_stage;
  in.micro_batch = f.micro_batch_size;
  in.seq_len = T;
  in.sgd = f.optimizer == "sgd";
  in.micro_batches = f.batch_size / N / f.micro_batch_size;
  in.sampling = gpt;
  {
    const Precision p = parse_precision(f.precision);
    const bool gpu = rt->backend() == Backend::kCuda;
    in.working = p == Precision::kBf16 || (p == Precision::kAuto && gpu) ? DType::kBF16
                 : p == Precision::kFp16                                 ? DType::kF16
                                                                         : DType::kF32;
  }
  MemoryPlan plan = plan_run(mc, *rt, in);
  if (f.device_memory) {  // also states (overrides) the memory of real GPUs
    in = plan.inputs;
    in.device_memory.assign(static_cast<size_t>(N), f.device_memory);
    plan = plan_memory(mc, in);
  }
  std::printf("devices: %s (%s backend)\n", f.devices.c_str(), backend_name(rt->backend()));
  if (!rt->fallback_note().empty()) std::printf("note: %s\n", rt->fallback_note().c_str());
  std::printf("%s", format_plan(mc, plan).c_str());
  return 0;
}

}  // namespace zt
