// A synthetic pipeline stage whose actions only take time (a sleep per F, B and W on the compute
// stream; a fused backward is B + W), with small transfer buffers: it measures a schedule's
// bubble on devices free of the CPU contention a real model would add (tests and bench_pipeline).
#pragma once

#include <chrono>
#include <thread>
#include <vector>

#include "memory/caching_allocator.h"
#include "pipeline/runtime.h"
#include "runtime/device.h"

namespace zt {

class TimedStage final : public StageWork {
 public:
  TimedStage(Device& d, int chunks, int micro_batches, std::chrono::microseconds unit)
      : d_(d), micro_(micro_batches), unit_(unit) {
    for (int i = 0; i < 4 * chunks * micro_batches; ++i) bufs_.emplace_back(d.memory(), 64, d.compute(), "timed_stage");
  }
  Stream& stream() override { return d_.compute(); }
  void forward(int, int) override { busy(1); }
  void backward(int, int) override { busy(2); }
  void backward_input(int, int) override { busy(1); }
  void backward_weight(int, int) override { busy(1); }
  TensorView activation_out(int c, int m) override { return buf(0, c, m); }
  TensorView activation_in(int c, int m) override { return buf(1, c, m); }
  TensorView gradient_out(int c, int m) override { return buf(2, c, m); }
  TensorView gradient_in(int c, int m) override { return buf(3, c, m); }

 private:
  void busy(int units) {
    const auto d = unit_ * units;
    d_.compute().host_func([d] { std::this_thread::sleep_for(d); });
  }
  TensorView buf(int kind, int c, int m) {
    return TensorView{bufs_[static_cast<size_t>((c * micro_ + m) * 4 + kind)].data(), DType::kF32, Shape{16}, d_.index()};
  }
  Device& d_;
  int micro_;
  std::chrono::microseconds unit_;
  std::vector<DeviceBuffer> bufs_;
};

// One step of `schedule` over TimedStages on `stages` fresh simulated CPU devices, each F, B and W
// taking `unit`: every stage's compute spans (measure_bubble gives the bubble).
std::vector<StageSpan> timed_step(const Schedule& schedule, std::chrono::microseconds unit);

}  // namespace zt
