// The plain types of the optimizer ops (optimizers/optimizers.h): segment lists, hyper-parameters,
// the device scalars a step reads, the loss-scale configuration and state. Below the kernels, so
// that the backends' op tables and the multi-tensor kernels (kernels/cpu/multi_tensor.h,
// kernels/cuda/multi_tensor.h) name them without including the optimizers' API above them.
#pragma once

#include <cstdint>
#include <span>

namespace zt::optim {

// One parameter tensor's slice of a rank's shard.
struct OptimizerSegment {
  void* param = nullptr;        // working copy (dtype `param_dtype` of the op); == master when that is f32
  const void* grad = nullptr;   // gradient (dtype `grad_dtype` of the op), scaled by the loss scale
  float* master = nullptr;      // fp32 master weights
  float* m = nullptr;           // AdamW first moment / SGD momentum buffer
  float* v = nullptr;           // AdamW second moment (nullptr for SGD)
  int64_t n = 0;
  float weight_decay = 0;       // 0 for tensors without decay (biases, layernorm, embeddings' pos)
  uint64_t rng_offset = 0;      // stochastic rounding: global index of the first element (stream of Philox)
};

// A list in host memory (read by the launcher) and the same entries in device memory (read by
// CUDA kernels; on the CPU backend `device` may be null and `host` is used).
template <typename T>
struct SegmentList {
  std::span<const T> host;
  const T* device = nullptr;
};

enum class Rounding { kNearest, kStochastic };

struct AdamWConfig {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  int step = 1;  // 1-based, bias correction
};
struct SgdConfig {
  float lr = 0, momentum = 0.9f;
  bool nesterov = false;
  int step = 1;  // 1-based; SGD's update does not use it: only stochastic rounding's Philox counter
};

// Scalars read on the device when the op runs (all optional: nullptr = 1, no skip, 1).
struct StepScalars {
  const float* inv_loss_scale = nullptr;  // multiplies every gradient (fp32) before the update
  const float* found_inf = nullptr;       // != 0: the step is skipped, nothing is written
  const float* clip = nullptr;            // gradient clipping factor (clip_factor writes it)
  Rounding rounding = Rounding::kNearest;  // of the 16-bit working copy
  uint64_t seed = 0;                       // stochastic rounding: Philox key; counter = (step, rng_offset + i)
  // The rank's count of updates made so far, in device memory (nullptr: the config's step). When
  // set, the op's step is *update_count + 1, read when the op runs (AdamW's bias correction,
  // computed then with zt::adamw_bias_correction: the host's bits; stochastic rounding's Philox
  // counter; SGD's update itself does not use it), and an update that is not skipped adds 1 after
  // its last read. So the host enqueues step after step without knowing whether the previous
  // ones were skipped. The host ops (adamw_host / sgd_host) read and count a host copy.
  uint32_t* update_count = nullptr;
};

// One gradient shard for the check.
struct GradSegment {
  const void* grad = nullptr;  // dtype `grad_dtype`
  int64_t n = 0;
  int out = 0;  // index into norms_out
};

// Dynamic loss scaling (optimizers.h loss_scale_update): its configuration and its state in device memory.
struct LossScaleConfig {
  float growth = 2.0f, backoff = 0.5f;
  int growth_interval = 2000;
  int hysteresis = 1;
  float min_scale = 1.0f, max_scale = 16777216.0f;  // 2^24
};
struct LossScaleState {
  float scale, inv_scale, good_steps, hysteresis_left, collapsed, skipped;
};
static_assert(sizeof(LossScaleState) == 6 * sizeof(float));

}  // namespace zt::optim
