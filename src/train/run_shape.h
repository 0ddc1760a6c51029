// Run resolution: a TrainConfig plus the device count and backend -> the RunContext every part of
// a run reads (defaults filled, accumulation, precision, loss scaling, plan inputs), with every
// flag-combination check that needs no data. `train`, `plan`, `sweep` and the CLI fuzzer share it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"
#include "runtime/backend.h"
#include "train/plan.h"
#include "train/trainer.h"
#include "zero/engine.h"

namespace zt {

// Upper bounds on what a flag-derived shape may reach (the parameter bound, 2^40, is checked by
// make_model_config); beyond them a run is refused before
// anything is allocated (the sizes would overflow the kernels' 64-bit index math long before a
// workstation could hold them).
inline constexpr int64_t kMaxLayerActivation = int64_t{1} << 40;    // elements of one layer's activations
inline constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 31;   // tokens in one micro-batch

class BpeTokenizer;
class ImageData;
class LanguageData;
class Processes;

// What the whole run shares, resolved once before the first world is built: resolve_run_shape
// fills the shape (opening nothing), train() then the data and the process group.
struct RunContext {
  // The input with every data-independent default filled: batch_size, micro_batch_size, lr,
  // min_lr, train_seq_len (GPT), and steps, warmup_steps, eval_every when the step count is known
  // without the data (GPT, or --steps given; image data derives steps from its epochs when train()
  // opens it).
  TrainConfig cfg;
  ModelConfig mc;
  bool is_gpt = true;
  int devices = 1;  // every process's
  Backend backend = Backend::kCpu;
  int accum = 1;  // micro-batches per step (gradient accumulation)
  int T = 1;      // tokens per training sequence (1 for images)
  Precision precision = Precision::kFp32;
  DType working = DType::kF32;  // parameters and gradients
  ZeroOptions::Scaling scaling = ZeroOptions::Scaling::kNone;
  float initial_scale = 1.0f;
  PlanInputs plan;  // the memory plan's inputs (plan_run(mc, runtime, plan) / require_fits)
  // What that plan predicted for this process's devices (DevicePlan::peak_allocated: the pool peak in
  // blocks), set by train() when it checks the run fits; the summary puts it beside the measured
  // peak (peak_bytes_per_device), so a GPU run shows how far the plan is off without a second run.
  std::vector<size_t> planned_peak_bytes;
  // Shared and read-only: a sweep's trials read one copy concurrently (TrainConfig::language_data).
  std::shared_ptr<const LanguageData> lang;
  std::shared_ptr<const ImageData> images;
  // This process's place among the launch's processes (train/processes.h): Processes::alone() in a
  // plain launch (resolve_run_shape), every exchange between processes then the identity.
  Processes* processes = nullptr;
  // The BPE tokenizer beside token shards (zerotrain tokenize's vocab.json + merges.txt): samples
  // are decoded through it. Null for other data.
  std::shared_ptr<const BpeTokenizer> tokenizer;
};

// The default global batch for `devices`: 8 sequences (128 MLP examples) per 2 devices, rounded
// up to a multiple of the device count (1 and 2 devices: 8, 3: 18, 4: 16).
int default_batch_size(bool gpt, int devices);

// Throws zt::Error(kInvalidArgument) with one sentence for any invalid value or combination.
// Opens no file and allocates nothing.
RunContext resolve_run_shape(const TrainConfig& cfg, const ModelConfig& mc, int devices, Backend backend);

// The run's files: no output may be one of the inputs or another output (compared by inode when
// both exist, else by canonical path). Inputs: --data (when it names a file), --init-from,
// --resume (a checkpoint path); outputs: --metrics, --trace, `plot` (the app's --plot),
// --checkpoint-dir. Also refuses --init-from together with a --resume that resumes a checkpoint
// (the checkpoint's weights would silently win): an explicit checkpoint always, `auto` when
// --checkpoint-dir already holds one.
void check_run_paths(const TrainConfig& cfg, const std::string& plot = "");

}  // namespace zt
