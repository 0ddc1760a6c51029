// The table of flags that only count in some combinations (apps/flag_rules.h). One rule per
// flag, stated on the resolved shape (precision "auto" already decided, defaults filled), so
// `plan`, `train` and `sweep` judge a flag the same way.
#include "flag_rules.h"

#include "core/status.h"

namespace zt {

std::vector<InapplicableFlag> inapplicable_run_flags(const RunContext& s, const ModelConfig& mc) {
  const TrainConfig& c = s.cfg;
  const bool gpt = mc.kind == ModelKind::kGpt;
  const bool dynamic = s.scaling == ZeroOptions::Scaling::kDynamic;
  const bool sampling = gpt && c.sample_tokens > 0;
  std::vector<InapplicableFlag> out;
  auto rule = [&](bool applies, const char* flag, const char* needs) {
    if (!applies) out.push_back({flag, needs});
  };
  rule(c.pipeline_parallel > 1, "pp-schedule", "--pipeline-parallel 2 or more");
  rule(c.pipeline_parallel > 1 && c.pp_schedule == PipeSchedule::kInterleaved, "virtual-stages",
       "--pp-schedule interleaved with --pipeline-parallel 2 or more");
  rule(c.pipeline_parallel > 1, "pp-layout", "--pipeline-parallel 2 or more");
  rule(c.offload_optimizer, "offload-fraction", "--offload optimizer");
  rule(c.offload_optimizer, "offload-delay-update", "--offload optimizer");
  rule(c.tensor_parallel > 1, "sequence-parallel", "--tensor-parallel 2 or more");
  for (const char* f : {"initial-scale", "scale-window", "scale-hysteresis", "min-scale", "max-scale"})
    rule(dynamic, f, "dynamic loss scaling (--precision fp16, or --loss-scale dynamic)");
  rule(dynamic && s.precision == Precision::kFp16, "on-scale-collapse",
       "--precision fp16 with dynamic loss scaling");
  rule(s.working != DType::kF32, "stochastic-rounding", "16-bit parameters (--precision bf16 or fp16)");
  // A 16-bit run's matrix products take 16-bit inputs (every model computes in its working dtype),
  // so there is no fp32 product to round; on GPUs --precision auto is bf16.
  rule(s.working == DType::kF32, "tf32", "fp32 parameters (--precision fp32; auto is bf16 on GPUs)");
  for (const char* f : {"temperature", "top-k", "sample-every"})
    rule(sampling, f, "text samples (a GPT model with --sample-tokens above 0)");
  rule(!gpt && c.steps < 0, "epochs", "image data (--model mlp) without --steps");
  rule(!gpt, "hidden", "--model mlp");
  rule(gpt, "train-seq-len", "a GPT model");
  for (const char* f : {"save-every", "keep"}) rule(!c.checkpoint_dir.empty(), f, "--checkpoint-dir");
  rule(c.schedule != LrSchedule::kConstant, "min-lr", "--lr-schedule cosine or linear");
  // A GPU brings its own memory, which the run is planned against; `plan` keeps the flag (there it
  // states a GPU's memory) and leaves this rule out (apps/plan_command.cc).
  rule(s.backend == Backend::kCpu, "device-memory",
       "simulated CPU devices (--devices cpu:N), since a GPU's own memory bounds the run (zerotrain plan "
       "--device-memory plans for a GPU of another size)");
  return out;
}

void refuse_given(const CLI::App& sub, const std::vector<InapplicableFlag>& flags) {
  for (const InapplicableFlag& f : flags) {
    const CLI::Option* o = sub.get_option_no_throw("--" + f.flag);
    if (!o || o->count() == 0) continue;
    ZT_THROW(ErrorKind::kInvalidArgument, "--", f.flag, " does nothing in this run: it needs ", f.needs,
             "; drop it or add that");
  }
}

}  // namespace zt
