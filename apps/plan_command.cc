// `zerotrain plan`: resolves the run exactly as `train` does (train/run_shape.h: devices, batch
// split, sequence length, precision) and prints train/plan.h's per-device prediction and verdict.
// --data is not opened: the plan depends on the model and the batch shape, not on the tokens
// (only the name is checked, e.g. fashion-mnist with a GPT model is refused as train refuses it).
#include "plan_command.h"

#include <cstdio>
#include <set>
#include <string>

#include "core/status.h"
#include "flag_rules.h"
#include "model/config.h"
#include "runtime/runtime.h"
#include "train/plan.h"
#include "train/run_shape.h"
#include "train/trainer.h"

namespace zt {

namespace {
// train's rules, but --device-memory counts on GPUs too: there it states (overrides) their memory.
std::vector<InapplicableFlag> plan_inapplicable_flags(const RunContext& shape, const ModelConfig& mc) {
  std::vector<InapplicableFlag> flags = inapplicable_run_flags(shape, mc);
  std::erase_if(flags, [](const InapplicableFlag& f) { return f.flag == "device-memory"; });
  return flags;
}
}  // namespace

PlanCommand::PlanCommand(CLI::App& app) : f_(std::make_shared<RunFlags>()) {
  sub_ = app.add_subcommand("plan", "Predict per-device memory of a training run and whether it fits "
                                    "(accepts every train flag)");
  add_run_flags(*sub_, *f_);
  sub_->add_flag("--largest", largest_,
                 "Instead of one run's plan: the largest GPT-2-shape model that fits these devices, batch and "
                 "--train-seq-len (default 1024) under each ZeRO stage, recompute and offload");
}

bool PlanCommand::parsed() const { return sub_->parsed(); }

int PlanCommand::run() {
  TrainConfig tc = f_->to_config();
  if (largest_) {
    // The family fixes the model: a model flag would be silently ignored, so it is refused.
    for (const char* flag : {"--model", "--layers", "--heads", "--embd", "--seq-len", "--vocab", "--hidden"})
      ZT_REQUIRE(sub_->count(flag) == 0, "plan --largest searches the GPT-2 shape family (heads = width/64, vocab "
                                         "50257, context = --train-seq-len); drop ", flag);
    if (!tc.train_seq_len) tc.train_seq_len = 1024;
  }
  // With --tensor-parallel T, the members whose heads T divides (the others cannot be split).
  std::vector<ModelConfig> family;
  if (largest_) {
    family = gpt2_shape_family(tc.train_seq_len);
    std::erase_if(family, [&](const ModelConfig& m) { return m.heads % std::max(1, tc.tensor_parallel) != 0; });
    ZT_REQUIRE(!family.empty(), "no GPT-2 shape has a head count --tensor-parallel ", tc.tensor_parallel, " divides");
  }
  const ModelConfig mc = largest_ ? family.front() : make_model_config(tc.model, tc.overrides);
  const DeviceSpec spec = parse_device_spec(tc.devices);
  MemoryPlan plan;
  int devices = 0;
  Backend backend = Backend::kCpu;
  // Outlives every plan below: on GPUs plan.inputs.attention_workspace asks cuDNN through device 0's
  // compute stream, and --largest asks it again for each shape it tries.
  std::unique_ptr<Runtime> rt;
  if (spec.kind == DeviceSpec::Kind::kCuda && !cuda_availability().usable) {
    // GPUs this machine does not have: planned from --device-memory, the library workspaces by
    // their GPU rules (train/plan.h plan_absent_gpus).
    const CudaAvailability cuda = cuda_availability();
    ZT_REQUIRE(tc.device_memory > 0, "--devices ", spec.text, " asks for GPUs, but no usable GPU was found (",
               cuda.reason, "); to plan for GPUs this machine does not have, give their memory with --device-memory "
               "(e.g. 141GiB for an H200), or use --devices cpu:N for simulated devices");
    ZT_REQUIRE(!spec.cuda_ordinals.empty(), "--devices ", spec.text,
               " means every GPU, and this machine has none to count; name them, e.g. --devices cuda:0,1 or cuda:0x4");
    const int n = static_cast<int>(spec.cuda_ordinals.size());
    devices = n;
    backend = Backend::kCuda;
    const RunContext shape = resolve_run_shape(tc, mc, n, Backend::kCuda);
    refuse_given(*sub_, plan_inapplicable_flags(shape, mc));
    plan = plan_absent_gpus(mc, shape.plan, spec.cuda_ordinals, tc.device_memory);
    const std::set<int> gpus(spec.cuda_ordinals.begin(), spec.cuda_ordinals.end());
    const int g = static_cast<int>(gpus.size());
    // Logical devices sharing a GPU (cuda:0x2) each get their share of it, as on the GPU.
    const std::string shared = g == n ? "" : ", shared by its logical devices (--devices " + tc.devices + ")";
    std::printf("devices: %s (cuda backend; no usable GPU here: planned as %d GPU%s of %s%s, Hopper or newer, with "
                "cuDNN)\n",
                tc.devices.c_str(), g, g == 1 ? "" : "s", format_plan_bytes(tc.device_memory).c_str(), shared.c_str());
  } else {
    rt = Runtime::create(spec, CpuDeviceOptions{tc.device_memory});
    devices = rt->size();
    backend = rt->backend();
    const RunContext shape = resolve_run_shape(tc, mc, rt->size(), rt->backend());
    refuse_given(*sub_, plan_inapplicable_flags(shape, mc));
    plan = plan_run(mc, *rt, shape.plan);
    if (tc.device_memory) {  // also states (overrides) the memory of real GPUs
      PlanInputs in = plan.inputs;
      in.device_memory.assign(static_cast<size_t>(rt->size()), tc.device_memory);
      // A GPU's memory, shared by the logical devices on it (cuda:0x2), as Device::total_memory is.
      if (rt->backend() == Backend::kCuda && spec.cuda_ordinals.size() == static_cast<size_t>(rt->size()))
        in.device_memory = logical_device_memory(spec.cuda_ordinals, tc.device_memory);
      plan = plan_memory(mc, in);
    }
    std::printf("devices: %s (%s backend)\n", tc.devices.c_str(), backend_name(rt->backend()));
    if (!rt->fallback_note().empty()) std::printf("note: %s\n", rt->fallback_note().c_str());
  }
  if (largest_) {
    // The same rules as `plan` and `train` of each answer: a family member the run's shape refuses
    // (fewer blocks than pipeline stages, ...) is no answer, and a row whose stage, recompute or
    // offload the run refuses (ZeRO-3 or offload with --pipeline-parallel, ...) is not listed.
    auto accepted = [&](const ModelConfig& m, const PlanInputs& c) {
      TrainConfig t = tc;
      t.zero_stage = c.zero_stage;
      t.recompute = c.recompute;
      t.offload_optimizer = c.offload;
      try {
        resolve_run_shape(t, m, devices, backend);
        return true;
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kInvalidArgument) throw;
        return false;
      }
    };
    std::erase_if(family, [&](const ModelConfig& m) { return !accepted(m, plan.inputs); });
    ZT_REQUIRE(!family.empty(), "no GPT-2 shape can run with these flags (the smallest, ", mc.describe(),
               ", is refused); check them with plan of that model");
    std::printf("%s", format_largest(plan_largest(family, plan.inputs, [&](const PlanInputs& c) {
                                       return accepted(family.front(), c);
                                     })).c_str());
    return 0;
  }
  std::printf("%s", format_plan(mc, plan).c_str());
  return 0;
}

}  // namespace zt
