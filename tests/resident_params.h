// Test fixtures for models driven without an engine: every block of a layout resident on one
// device (parameters from host vectors, gradients accumulated from zero), and host blocks
// initialised as the trainer initialises them.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/dtype.h"
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

// Parameters held only in a 16-bit dtype (as the ZeRO engine's working buffers), fp32 gradients.
// params() fails the test: a 16-bit model must read every parameter through param_data, so every
// GEMM it issues takes its weight, and with it (one dtype per matmul) its input, in 16 bits.
class Params16 final : public ParamAccess {
 public:
  Params16(Device& d, const ParamLayout& layout, DType dtype) : d_(d), dtype_(dtype) {
    for (const auto& b : layout.blocks()) {
      p_.emplace_back(d.memory(), b.numel * 2, d.compute(), "p16");
      g_.emplace_back(d.memory(), b.numel * 4, d.compute(), "g");
    }
  }
  // Block b's parameters rounded to the dtype (nearest even); returns them widened to fp32.
  std::vector<float> set(int b, const std::vector<float>& v) {
    std::vector<uint16_t> bits(v.size());
    std::vector<float> wide(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      bits[i] = dtype_ == DType::kBF16 ? float_to_bf16_bits(v[i]) : float_to_half_bits(v[i]);
      wide[i] = dtype_ == DType::kBF16 ? bf16_bits_to_float(bits[i]) : half_bits_to_float(bits[i]);
    }
    d_.compute().copy(p_[static_cast<size_t>(b)].data(), bits.data(), bits.size() * 2);
    d_.compute().memset(g_[static_cast<size_t>(b)].data(), 0, g_[static_cast<size_t>(b)].size());
    d_.compute().synchronize();
    return wide;
  }
  int device_index() const override { return d_.index(); }
  float* params(int b) override {
    ADD_FAILURE() << "a 16-bit model asked for fp32 parameters of block " << b;
    return nullptr;
  }
  float* grads(int b) override { return g_[static_cast<size_t>(b)].as<float>(); }
  DType param_dtype() const override { return dtype_; }
  void* param_data(int b) override { return p_[static_cast<size_t>(b)].data(); }

 private:
  Device& d_;
  DType dtype_;
  std::vector<DeviceBuffer> p_, g_;
};

}  // namespace zt
