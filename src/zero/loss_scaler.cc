// A rank's loss-scale state and overflow flags in device memory (zero/loss_scaler.h).
#include "zero/loss_scaler.h"

#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "zero/visit_plan.h"

namespace zt {

namespace {

TensorView f32(float* p, int64_t n, int device) { return TensorView{p, DType::kF32, Shape{n}, device}; }

}  // namespace

LossScaler::LossScaler(Device& d, Stream& compute, int world, const ZeroOptions& opt)
    : compute_(compute), world_(world), device_(d.index()), opt_(opt) {
  static_assert(kScalerBytes >= sizeof(optim::LossScaleState) + sizeof(uint32_t));
  state_ = DeviceBuffer(d.memory(), kScalerBytes, compute_, "loss scale");
  flags_ = DeviceBuffer(d.memory(), static_cast<size_t>(world_) * sizeof(float), compute_, "loss scale");
  set_update_count(0);  // reset keeps it: a switch of the working dtype goes on counting
  reset();
}

const float* LossScaler::scale_device() const {
  if (opt_.scaling == ZeroOptions::Scaling::kNone) return nullptr;
  return &state_device()->scale;
}

const float* LossScaler::inv_scale_device() const {
  return opt_.scaling == ZeroOptions::Scaling::kNone ? nullptr : &state_device()->inv_scale;
}

void LossScaler::mark_overflow() { ops::fill(compute_, f32(flags_.as<float>(), 1, device_), 1.0f); }

void LossScaler::reset() {
  const bool none = opt_.scaling == ZeroOptions::Scaling::kNone;
  const optim::LossScaleState st = optim::initial_loss_scale_state(none ? 1.0f : opt_.initial_scale,
                                                                   none ? optim::LossScaleConfig{} : opt_.scale_config);
  compute_.copy(state_.data(), &st, sizeof st);
  ops::fill(compute_, f32(flags_.as<float>(), world_, device_), 0.0f);
  compute_.synchronize();  // st lives on this stack frame
}

void LossScaler::update() {
  if (opt_.scaling != ZeroOptions::Scaling::kDynamic) return;
  const NvtxRange scale_range(NvtxCategory::kLossScale, "loss scale update", device_);
  optim::loss_scale_update(compute_, state_.as<optim::LossScaleState>(), flags_.as<float>(), opt_.scale_config);
}

uint32_t* LossScaler::update_count_device() {
  return reinterpret_cast<uint32_t*>(static_cast<char*>(state_.data()) + sizeof(optim::LossScaleState));
}

void LossScaler::set_update_count(int64_t updates) {
  ZT_REQUIRE(updates >= 0 && updates < int64_t{UINT32_MAX}, "the update count ", updates, " is out of range");
  const auto n = static_cast<uint32_t>(updates);
  compute_.copy(update_count_device(), &n, sizeof n);
  compute_.synchronize();  // n lives on this stack frame
}

int64_t LossScaler::update_count() {
  uint32_t n = 0;
  compute_.copy(&n, update_count_device(), sizeof n);
  compute_.synchronize();
  return n;
}

void LossScaler::set_state(const optim::LossScaleState& st) {
  compute_.copy(state_.data(), &st, sizeof st);
  compute_.synchronize();
}

optim::LossScaleState LossScaler::state() {
  optim::LossScaleState st{};
  compute_.copy(&st, state_.data(), sizeof st);
  compute_.synchronize();
  return st;
}

}  // namespace zt
