// Test fixtures for models driven without an engine: every block of a layout resident on one
// device (parameters from host vectors, gradients accumulated from zero), and host blocks
// initialised as the trainer initialises them.
#pragma once

#include <functional>
#include <vector>

#include "memory/caching_allocator.h"
#include "model/model.h"

namespace zt {

// Block b of `L` filled by init_block_host(seed): the trainer's initial parameters.
inline std::vector<std::vector<float>> init_blocks(const ParamLayout& L, uint64_t seed) {
  std::vector<std::vector<float>> host(static_cast<size_t>(L.num_blocks()));
  for (int b = 0; b < L.num_blocks(); ++b) {
    host[static_cast<size_t>(b)].resize(static_cast<size_t>(L.block(b).numel));
    init_block_host(L.block(b), seed, host[static_cast<size_t>(b)].data());
  }
  return host;
}

class ResidentParams final : public ParamAccess {
 public:
  using HostBlock = std::function<const std::vector<float>&(int block)>;
  ResidentParams(Device& d, const ParamLayout& L, const HostBlock& host) : d_(d) {
    for (int b = 0; b < L.num_blocks(); ++b) {
      const size_t bytes = static_cast<size_t>(L.block(b).numel) * sizeof(float);
      p_.emplace_back(d.memory(), bytes, d.compute(), "p");
      g_.emplace_back(d.memory(), bytes, d.compute(), "g");
    }
    load(host);
  }
  ResidentParams(Device& d, const ParamLayout& L, const std::vector<std::vector<float>>& host)
      : ResidentParams(d, L, [&host](int b) -> const std::vector<float>& { return host[static_cast<size_t>(b)]; }) {}
  // New parameters (block b from host(b)), gradients zeroed; call with the device idle.
  void load(const HostBlock& host) {
    for (size_t b = 0; b < p_.size(); ++b) {
      d_.compute().copy(p_[b].data(), host(static_cast<int>(b)).data(), p_[b].size());
      d_.compute().memset(g_[b].data(), 0, g_[b].size());
    }
    d_.compute().synchronize();
  }
  int device_index() const override { return d_.index(); }
  float* params(int b) override { return p_[static_cast<size_t>(b)].as<float>(); }
  float* grads(int b) override { return g_[static_cast<size_t>(b)].as<float>(); }
  std::vector<float> grad_host(int b) {
    std::vector<float> out(g_[static_cast<size_t>(b)].size() / sizeof(float));
    d_.compute().copy(out.data(), grads(b), out.size() * sizeof(float));
    d_.compute().synchronize();
    return out;
  }

 private:
  Device& d_;
  std::vector<DeviceBuffer> p_, g_;
};

}  // namespace zt
