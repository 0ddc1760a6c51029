// The training loop over every selected device: data (prefetched, each device its own rows of
// the global batch), forward/backward with gradient accumulation, ZeRO stage 0-3 sharding,
// global-norm clipping, AdamW/SGD, LR schedule, evaluation, sampling, metrics.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "train/report.h"
#include "train/schedule.h"
#include "zero/engine.h"

namespace zt {

enum class OptimizerKind { kAdamW, kSgd };
// Progress output: text (progress line, evaluations, summary table) or JSON lines on stdout (the
// same records as --metrics).
enum class LogFormat { kText, kJson };

struct TrainConfig {
  std::string model = "gpt-tiny";
  ModelOverrides overrides;
  std::string data = "synthetic";
  std::string devices = "all";
  size_t device_memory = 0;  // --device-memory: bytes per simulated (CPU) device; 0 = unlimited
  int zero_stage = 2;
  int steps = -1;            // -1 = the default for the data (see resolve())
  int epochs = 0;            // image data: steps = epochs * batches per epoch when steps == -1
  int batch_size = -1;       // global, in sequences (GPT) or examples (MLP); -1 = default
  int micro_batch_size = 0;  // per device; 0 = batch_size / devices (no accumulation)
  int train_seq_len = 0;     // GPT: tokens per training sequence; 0 = the model's context
  float lr = -1;             // -1 = default for the optimizer
  float min_lr = -1;         // -1 = lr / 10
  int warmup_steps = -1;     // -1 = 2% of steps
  LrSchedule schedule = LrSchedule::kCosine;
  float weight_decay = 0.0f;
  float grad_clip = 1.0f;    // 0 = no clipping
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  float beta1 = 0.9f, beta2 = 0.95f, adam_eps = 1e-8f, momentum = 0.9f;
  uint64_t seed = 1337;
  int eval_every = -1;       // -1 = default (a few evals per run); 0 = only at the end
  int eval_batches = 8;
  int sample_every = 0;      // 0 = only at the end
  int sample_tokens = 200;
  float temperature = 0.8f;
  int top_k = 40;
  std::string metrics_path;
  std::string trace_path;     // --trace: Chrome/Perfetto trace-event JSON (train/trace.h)
  std::string profile_steps;  // --profile-steps A:B: cudaProfilerStart before step A, Stop after B (1-based)
  bool quiet = false;        // no progress line (tests)
  LogFormat log_format = LogFormat::kText;
  bool keep_final_params = false;  // tests: return the full parameters of every block
  bool zero_trace = false;         // tests: record compute/comm spans (TrainResult::trace)
};

struct TrainResult {
  int steps = 0;
  double final_loss = 0;     // mean training loss of the last step
  double val_loss = 0;       // last evaluation
  std::optional<double> accuracy;      // classifier: test accuracy at the end
  std::optional<double> entropy_floor;  // synthetic data: best reachable loss
  double tokens_per_s = 0;
  double seconds = 0;
  std::vector<double> losses;  // per step
  std::vector<std::pair<int, double>> val_losses;  // (step, validation loss) of every evaluation
  PhaseTimes time_split;       // host-measured, training steps only (see StepPhaseTimer)
  double flops_per_token = 0;  // training_flops_per_token()
  std::optional<double> mfu;   // when the devices' peak FLOP/s is known
  std::vector<size_t> peak_bytes_per_device;
  std::vector<size_t> model_state_bytes_per_device;
  std::vector<uint64_t> comm_bytes_per_step_per_device;  // bytes sent, averaged over steps
  int devices = 1;
  int zero_stage = 0;
  std::string sample;
  std::vector<std::vector<float>> final_params;  // with keep_final_params
  std::vector<TraceSpan> trace;                  // with zero_trace (training steps only)
};

// Runs a whole training job; prints progress to stdout unless quiet. All validation of the
// configuration, data and model happens before the first step; a bad input throws
// zt::Error(kInvalidArgument) with one sentence.
TrainResult train(const TrainConfig& config);

}  // namespace zt
