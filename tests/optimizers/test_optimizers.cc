// The mixed-precision optimizer ops of optimizers/optimizers.h on every backend (CPU always; CUDA
// when a usable GPU exists, else GTEST_SKIP): fused multi-tensor AdamW / SGD against float64
// references written here (fp32 master and moments within ~1e-6, 16-bit working copies exactly the
// nearest-even rounding of the resulting master), bitwise against the per-tensor ops, every
// (param, grad) dtype pair, sizes 1, primes and the chunk size +- 1, NaN-poisoned outputs; the skip
// flag (nothing written); stochastic rounding (reproducible, seed-dependent, one of the two
// neighbours, unbiased); unscale_check's norms and overflow detection with inf/NaN injected at
// chosen places, and its determinism; the loss scaler's transition over scripted sequences, host
// against device; argument validation.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"
#include "core/status.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/elementwise.h"
#include "kernels/multi_tensor_elem.h"
#include "kernels/op_test_util.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "optimizers/optimizers.h"
#include "runtime/runtime.h"

namespace zt {

namespace {

using optim::AdamWConfig;
using optim::GradSegment;
using optim::kMultiTensorChunk;
using optim::LossScaleConfig;
using optim::LossScaleState;
using optim::OptimizerSegment;
using optim::Rounding;
using optim::SegmentList;
using optim::SgdConfig;
using optim::StepScalars;
using ::testing::HasSubstr;

using DVec = std::vector<double>;
using FVec = std::vector<float>;
using Bytes = std::vector<uint8_t>;

constexpr DType kFloatTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// ---- random inputs (Philox: every value a pure function of seed, stream, index) ---------------

uint64_t test_seed() {
  if (const char* s = std::getenv("ZT_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return 20250112;
}

using test_util::Rng;
using op_test::make_runtime;

// ---- dtype encoding
// -------------------------------------------------------------------------------

uint16_t to_bits16(float x, DType t) {
  return t == DType::kBF16 ? float_to_bf16_bits(x) : float_to_half_bits(x);
}
float from_bits16(uint16_t b, DType t) {
  return t == DType::kBF16 ? bf16_bits_to_float(b) : half_bits_to_float(b);
}

Bytes encode(const FVec& f, DType t) {
  Bytes out(f.size() * dtype_size(t));
  for (size_t i = 0; i < f.size(); ++i) {
    if (t == DType::kF32) {
      std::memcpy(&out[4 * i], &f[i], 4);
    } else {
      const uint16_t b = to_bits16(f[i], t);
      std::memcpy(&out[2 * i], &b, 2);
    }
  }
  return out;
}

FVec decode(const Bytes& bytes, DType t) {
  FVec f(bytes.size() / dtype_size(t));
  for (size_t i = 0; i < f.size(); ++i) {
    if (t == DType::kF32) {
      std::memcpy(&f[i], &bytes[4 * i], 4);
    } else {
      uint16_t b;
      std::memcpy(&b, &bytes[2 * i], 2);
      f[i] = from_bits16(b, t);
    }
  }
  return f;
}

// The values a buffer of dtype t holds after storing f (nearest-even).
FVec stored(const FVec& f, DType t) { return decode(encode(f, t), t); }

// ---- comparisons
// ----------------------------------------------------------------------------------

struct Tol {
  double rtol, rms_tol;
};
// A handful of fp32 roundings per element against float64: |err| <= 1e-6 |ref| + 1e-6 rms(ref)
// (the rms term covers moments that cancel to ~0: their error is relative to the terms' size).
constexpr Tol kTolUpdate{1e-6, 1e-6};

::testing::AssertionResult close(const FVec& got, const DVec& ref, Tol tol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  double sq = 0;
  for (double r : ref) sq += r * r;
  const double atol = tol.rms_tol * std::sqrt(sq / std::max<size_t>(1, ref.size()));
  size_t bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    if (!(err <= tol.rtol * std::fabs(ref[i]) + atol)) {  // NaN fails
      if (bad < 5) msg << "\n  [" << i << "] got " << got[i] << " want " << ref[i];
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " out of tolerance" << msg.str();
}

::testing::AssertionResult same_bytes(const Bytes& got, const Bytes& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return ::testing::AssertionFailure()
             << "first differing byte at " << i << " of " << got.size();
  return ::testing::AssertionSuccess();
}

Bytes bytes_of(const FVec& f) {
  Bytes b(f.size() * 4);
  if (!f.empty()) std::memcpy(b.data(), f.data(), b.size());
  return b;
}

// ---- float64 references
// ---------------------------------------------------------------------------

struct RefState {
  DVec p, m, v;
};

RefState adamw_ref(const FVec& p, const FVec& g, const FVec& m, const FVec& v,
                   const AdamWConfig& hp, double wd, double grad_scale) {
  RefState r{DVec(p.begin(), p.end()), DVec(m.begin(), m.end()), DVec(v.begin(), v.end())};
  const double b1 = hp.beta1, b2 = hp.beta2;
  const double bc1 = 1.0 - std::pow(b1, hp.step), bc2 = 1.0 - std::pow(b2, hp.step);
  for (size_t i = 0; i < p.size(); ++i) {
    const double gi = double{g[i]} * grad_scale;
    r.m[i] = b1 * r.m[i] + (1.0 - b1) * gi;
    r.v[i] = b2 * r.v[i] + (1.0 - b2) * gi * gi;
    const double mhat = r.m[i] / bc1, vhat = r.v[i] / bc2;
    r.p[i] -= double{hp.lr} * (mhat / (std::sqrt(vhat) + double{hp.eps}) + wd * r.p[i]);
  }
  return r;
}

RefState sgd_ref(const FVec& p, const FVec& g, const FVec& buf, const SgdConfig& hp, double wd,
                 double grad_scale) {
  RefState r{DVec(p.begin(), p.end()), DVec(buf.begin(), buf.end()), {}};
  for (size_t i = 0; i < p.size(); ++i) {
    const double gp = double{g[i]} * grad_scale + wd * r.p[i];
    r.m[i] = double{hp.momentum} * r.m[i] + gp;
    r.p[i] -= double{hp.lr} * (hp.nesterov ? gp + double{hp.momentum} * r.m[i] : r.m[i]);
  }
  return r;
}

// ---- segments on a device
// ------------------------------------------------------------------------

// One segment's inputs on the host; `grad` holds the values exactly as the grad dtype stores them.
struct HostSeg {
  int64_t n = 0;
  float wd = 0;
  uint64_t rng_offset = 0;
  FVec master, m, v, grad;
};

// Segments with these sizes: master ~ N(0,1), m ~ N(0, 1e-3), v ~ U(0, 1e-4), grads ~ N(0, 0.01)
// times `loss_scale`, rounded to grad_dtype; weight decay cycles through 0.1, 0, 0.01.
std::vector<HostSeg> make_segs(Rng& rng, const std::vector<int64_t>& sizes, DType grad_dtype,
                               float loss_scale) {
  std::vector<HostSeg> segs;
  uint64_t offset = 0;
  const float decays[] = {0.1f, 0.0f, 0.01f};
  for (size_t i = 0; i < sizes.size(); ++i) {
    HostSeg s;
    s.n = sizes[i];
    s.wd = decays[i % 3];
    s.rng_offset = offset;
    offset += static_cast<uint64_t>(s.n);
    s.master = rng.normal(s.n);
    s.m = rng.normal(s.n, 1e-3f);
    s.v = rng.uniform(s.n, 0.0f, 1e-4f);
    s.grad = stored(rng.normal(s.n, 0.01f * loss_scale), grad_dtype);
    segs.push_back(std::move(s));
  }
  return segs;
}

// How the working copy relates to the master.
enum class ParamMode { kIsMaster, kSeparateF32, kBF16, kF16 };
DType param_dtype_of(ParamMode mode) {
  return mode == ParamMode::kBF16  ? DType::kBF16
         : mode == ParamMode::kF16 ? DType::kF16
                                   : DType::kF32;
}
const char* mode_name(ParamMode mode) {
  switch (mode) {
    case ParamMode::kIsMaster:
      return "f32 param == master";
    case ParamMode::kSeparateF32:
      return "f32 param (own buffer)";
    case ParamMode::kBF16:
      return "bf16 param";
    case ParamMode::kF16:
      return "f16 param";
  }
  return "?";
}
constexpr ParamMode kParamModes[] = {ParamMode::kIsMaster, ParamMode::kSeparateF32,
                                     ParamMode::kBF16, ParamMode::kF16};

class OptimTest : public ::testing::TestWithParam<Backend> {
 public:  // the helpers are used by UnscaleRun too
  void SetUp() override {
    std::string reason;
    rt_ = make_runtime(GetParam(), &reason);
    if (!rt_) GTEST_SKIP() << reason;
    dev_ = &rt_->device(0);
    s_ = &dev_->compute();
  }

  Stream& s() { return *s_; }

  DeviceBuffer alloc(size_t bytes) { return DeviceBuffer(dev_->memory(), bytes, *s_, "test"); }
  void put(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    s_->copy(dst, src, bytes);
    s_->synchronize();
  }
  Bytes get(const void* src, size_t bytes) {
    Bytes out(bytes);
    if (bytes == 0) return out;
    s_->copy(out.data(), src, bytes);
    s_->synchronize();
    return out;
  }
  FVec get_f(const void* src, int64_t n) {
    return decode(get(src, static_cast<size_t>(n) * 4), DType::kF32);
  }
  DeviceBuffer scalar(float value) {
    DeviceBuffer b = alloc(sizeof(float));
    put(b.data(), &value, sizeof(float));
    return b;
  }
  template <typename T>
  DeviceBuffer device_list(const std::vector<T>& list) {
    DeviceBuffer b = alloc(std::max<size_t>(1, list.size()) * sizeof(T));
    put(b.data(), list.data(), list.size() * sizeof(T));
    return b;
  }

  // A list of segments on the device: param buffers are NaN-poisoned (all bits set).
  struct DevSegs {
    std::vector<DeviceBuffer> owned;
    std::vector<OptimizerSegment> list;
    DeviceBuffer device;
    DType param_dtype = DType::kF32, grad_dtype = DType::kF32;
    SegmentList<OptimizerSegment> segs() const {
      return {list, static_cast<const OptimizerSegment*>(device.data())};
    }
  };

  DevSegs upload(const std::vector<HostSeg>& hs, ParamMode mode, DType grad_dtype, bool with_v) {
    DevSegs d;
    d.param_dtype = param_dtype_of(mode);
    d.grad_dtype = grad_dtype;
    for (const HostSeg& h : hs) {
      const size_t n = static_cast<size_t>(h.n);
      auto buffer = [&](size_t bytes) -> void* {
        d.owned.push_back(alloc(bytes));
        return d.owned.back().data();
      };
      OptimizerSegment seg;
      seg.n = h.n;
      seg.weight_decay = h.wd;
      seg.rng_offset = h.rng_offset;
      seg.master = static_cast<float*>(buffer(n * 4));
      put(seg.master, h.master.data(), n * 4);
      seg.m = static_cast<float*>(buffer(n * 4));
      put(seg.m, h.m.data(), n * 4);
      if (with_v) {
        seg.v = static_cast<float*>(buffer(n * 4));
        put(seg.v, h.v.data(), n * 4);
      }
      void* grad = buffer(n * dtype_size(grad_dtype));
      const Bytes gb = encode(h.grad, grad_dtype);
      put(grad, gb.data(), gb.size());
      seg.grad = grad;
      if (mode == ParamMode::kIsMaster) {
        seg.param = seg.master;
      } else {
        seg.param = buffer(n * dtype_size(d.param_dtype));
        const Bytes poison(n * dtype_size(d.param_dtype), 0xff);
        put(seg.param, poison.data(), poison.size());
      }
      d.list.push_back(seg);
    }
    d.device = device_list(d.list);
    return d;
  }

  // Everything a segment holds after the op, as bytes.
  struct SegOut {
    Bytes master, m, v, param;
  };
  SegOut download(const DevSegs& d, size_t i) {
    const OptimizerSegment& seg = d.list[i];
    const size_t n = static_cast<size_t>(seg.n);
    SegOut o;
    o.master = get(seg.master, n * 4);
    o.m = get(seg.m, n * 4);
    if (seg.v) o.v = get(seg.v, n * 4);
    o.param = get(seg.param, n * dtype_size(d.param_dtype));
    return o;
  }

  std::unique_ptr<Runtime> rt_;
  Device* dev_ = nullptr;
  Stream* s_ = nullptr;
  Rng rng_{test_seed()};
};

// Segment sizes: 1, primes, the chunk size +- 1, an empty segment, two chunks + 1.
const std::vector<int64_t> kSizes = {1,
                                     7,
                                     kMultiTensorChunk - 1,
                                     0,
                                     kMultiTensorChunk,
                                     257,
                                     kMultiTensorChunk + 1,
                                     65537,
                                     2 * kMultiTensorChunk + 1};

// Checks one segment's outputs against the float64 reference and the working-copy rule.
void expect_segment(const HostSeg& h, const RefState& ref, const FVec& master, const FVec& m,
                    const FVec* v, const Bytes& param, ParamMode mode) {
  EXPECT_TRUE(close(master, ref.p, kTolUpdate)) << "master";
  EXPECT_TRUE(close(m, ref.m, kTolUpdate)) << "m";
  if (v) {
    EXPECT_TRUE(close(*v, ref.v, kTolUpdate)) << "v";
  }
  if (mode == ParamMode::kIsMaster) return;
  // The working copy is exactly the nearest-even rounding of the master just computed.
  EXPECT_TRUE(same_bytes(param, encode(master, param_dtype_of(mode)))) << "param vs round(master)";
}

// ---- AdamW / SGD against float64
// -----------------------------------------------------------------

TEST_P(OptimTest, AdamWMatchesFloat64ForEveryDtypePair) {
  const float loss_scale = 1024.0f, clip = 0.75f;
  DeviceBuffer inv = scalar(1.0f / loss_scale), no_skip = scalar(0.0f), clip_d = scalar(clip);
  for (ParamMode mode : kParamModes) {
    for (DType gt : kFloatTypes) {
      SCOPED_TRACE(::testing::Message() << mode_name(mode) << ", grad " << dtype_name(gt));
      const std::vector<HostSeg> hs = make_segs(rng_, kSizes, gt, loss_scale);
      DevSegs d = upload(hs, mode, gt, /*with_v=*/true);
      const AdamWConfig hp{1e-3f, 0.9f, 0.95f, 1e-8f, 5};
      StepScalars sc;
      sc.inv_loss_scale = static_cast<const float*>(inv.data());
      sc.found_inf = static_cast<const float*>(no_skip.data());
      sc.clip = static_cast<const float*>(clip_d.data());
      optim::adamw_multi(s(), d.segs(), d.param_dtype, gt, hp, sc);
      s().synchronize();
      for (size_t i = 0; i < hs.size(); ++i) {
        SCOPED_TRACE(::testing::Message() << "segment " << i << " (n = " << hs[i].n << ")");
        const SegOut o = download(d, i);
        const RefState ref = adamw_ref(hs[i].master, hs[i].grad, hs[i].m, hs[i].v, hp, hs[i].wd,
                                       double{clip} / loss_scale);
        const FVec v = decode(o.v, DType::kF32);
        expect_segment(hs[i], ref, decode(o.master, DType::kF32), decode(o.m, DType::kF32), &v,
                       o.param, mode);
      }
    }
  }
}

TEST_P(OptimTest, SgdMatchesFloat64ForEveryDtypePair) {
  const float loss_scale = 8.0f, clip = 1.0f;
  DeviceBuffer inv = scalar(1.0f / loss_scale), clip_d = scalar(clip);
  for (bool nesterov : {false, true}) {
    for (ParamMode mode : kParamModes) {
      for (DType gt : kFloatTypes) {
        SCOPED_TRACE(::testing::Message() << mode_name(mode) << ", grad " << dtype_name(gt)
                                          << ", nesterov " << nesterov);
        const std::vector<HostSeg> hs = make_segs(rng_, kSizes, gt, loss_scale);
        DevSegs d = upload(hs, mode, gt, /*with_v=*/false);  // SGD: v == nullptr
        const SgdConfig hp{0.05f, 0.9f, nesterov};
        StepScalars sc;
        sc.inv_loss_scale = static_cast<const float*>(inv.data());
        sc.clip = static_cast<const float*>(clip_d.data());
        optim::sgd_multi(s(), d.segs(), d.param_dtype, gt, hp, sc);
        s().synchronize();
        for (size_t i = 0; i < hs.size(); ++i) {
          SCOPED_TRACE(::testing::Message() << "segment " << i << " (n = " << hs[i].n << ")");
          const SegOut o = download(d, i);
          const RefState ref =
              sgd_ref(hs[i].master, hs[i].grad, hs[i].m, hp, hs[i].wd, double{clip} / loss_scale);
          expect_segment(hs[i], ref, decode(o.master, DType::kF32), decode(o.m, DType::kF32),
                         nullptr, o.param, mode);
        }
      }
    }
  }
}

// With fp32 param == master and inverse scale 1 (absent, or 1.0 on the device), the bits are those
// of the per-tensor ops with grad_scale = clip, segment by segment.
TEST_P(OptimTest, BitsEqualThePerTensorOps) {
  const float clip = 0.5f;
  DeviceBuffer one = scalar(1.0f), clip_d = scalar(clip);
  for (bool device_one : {false, true}) {
    SCOPED_TRACE(device_one ? "inv_loss_scale = 1 on the device" : "inv_loss_scale absent");
    const std::vector<HostSeg> hs = make_segs(rng_, kSizes, DType::kF32, 1.0f);
    DevSegs multi = upload(hs, ParamMode::kIsMaster, DType::kF32, true);
    DevSegs single = upload(hs, ParamMode::kIsMaster, DType::kF32, true);
    StepScalars sc;
    sc.clip = static_cast<const float*>(clip_d.data());
    if (device_one) sc.inv_loss_scale = static_cast<const float*>(one.data());
    const AdamWConfig hp{3e-3f, 0.8f, 0.99f, 1e-6f, 3};
    optim::adamw_multi(s(), multi.segs(), DType::kF32, DType::kF32, hp, sc);
    for (const OptimizerSegment& seg : single.list) {
      const Shape shape{seg.n};
      const int dev = dev_->index();
      ops::adamw_update(s(), TensorView{seg.master, DType::kF32, shape, dev},
                        ConstTensorView{seg.grad, DType::kF32, shape, dev},
                        TensorView{seg.m, DType::kF32, shape, dev},
                        TensorView{seg.v, DType::kF32, shape, dev},
                        {hp.lr, hp.beta1, hp.beta2, hp.eps, seg.weight_decay, hp.step}, clip);
    }
    s().synchronize();
    for (size_t i = 0; i < hs.size(); ++i) {
      const SegOut a = download(multi, i), b = download(single, i);
      EXPECT_TRUE(same_bytes(a.master, b.master)) << "adamw master, segment " << i;
      EXPECT_TRUE(same_bytes(a.m, b.m)) << "adamw m, segment " << i;
      EXPECT_TRUE(same_bytes(a.v, b.v)) << "adamw v, segment " << i;
    }

    for (bool nesterov : {false, true}) {
      DevSegs smulti = upload(hs, ParamMode::kIsMaster, DType::kF32, false);
      DevSegs ssingle = upload(hs, ParamMode::kIsMaster, DType::kF32, false);
      const SgdConfig shp{0.1f, 0.9f, nesterov};
      optim::sgd_multi(s(), smulti.segs(), DType::kF32, DType::kF32, shp, sc);
      for (const OptimizerSegment& seg : ssingle.list) {
        const Shape shape{seg.n};
        const int dev = dev_->index();
        ops::sgd_update(s(), TensorView{seg.master, DType::kF32, shape, dev},
                        ConstTensorView{seg.grad, DType::kF32, shape, dev},
                        TensorView{seg.m, DType::kF32, shape, dev},
                        {shp.lr, shp.momentum, seg.weight_decay, nesterov}, clip);
      }
      s().synchronize();
      for (size_t i = 0; i < hs.size(); ++i) {
        const SegOut a = download(smulti, i), b = download(ssingle, i);
        EXPECT_TRUE(same_bytes(a.master, b.master)) << "sgd master, segment " << i;
        EXPECT_TRUE(same_bytes(a.m, b.m)) << "sgd buf, segment " << i;
      }
    }
  }
}

// Optimizer offload runs the host loop (adamw_host / sgd_host) in place of the device op and
// promises the device op's bits (README, "Optimizer offload"). On CUDA that holds only when nvcc
// contracts none of the update's products into an FMA (kernels/elementwise.h mul_rn; the first
// CUDA build contracted four of AdamW's): the same segments through both, byte for byte, with a
// loss scale, a clip factor, weight decay, 16-bit gradients and working copies. On the CPU
// backend both are the same loop; the CUDA instance is the check.
TEST_P(OptimTest, HostUpdateEqualsTheDeviceUpdateBitForBit) {
  const float inv = 1.0f / 1024.0f, clip = 0.75f, no_skip = 0.0f;
  DeviceBuffer inv_d = scalar(inv), clip_d = scalar(clip), skip_d = scalar(no_skip);
  const std::vector<int64_t> sizes = {1, 7, 257, kMultiTensorChunk + 1};
  for (ParamMode mode : {ParamMode::kIsMaster, ParamMode::kBF16}) {
    for (DType gt : {DType::kF32, DType::kBF16}) {
      for (int kind = 0; kind < 3; ++kind) {  // AdamW, SGD, SGD with Nesterov momentum
        SCOPED_TRACE(::testing::Message() << mode_name(mode) << ", grad " << dtype_name(gt) << ", "
                                          << (kind == 0 ? "AdamW" : kind == 1 ? "SGD" : "SGD Nesterov"));
        const bool adamw = kind == 0;
        const std::vector<HostSeg> hs = make_segs(rng_, sizes, gt, 1024.0f);
        DevSegs d = upload(hs, mode, gt, adamw);
        // The host copies of the same segments.
        std::vector<FVec> master(hs.size()), m(hs.size()), v(hs.size());
        std::vector<Bytes> grad(hs.size()), param(hs.size());
        std::vector<OptimizerSegment> host_list = d.list;  // n, weight decay, rng offset
        for (size_t i = 0; i < hs.size(); ++i) {
          master[i] = hs[i].master, m[i] = hs[i].m, v[i] = hs[i].v, grad[i] = encode(hs[i].grad, gt);
          param[i] = Bytes(static_cast<size_t>(hs[i].n) * dtype_size(d.param_dtype), 0xff);
          OptimizerSegment& seg = host_list[i];
          seg.master = master[i].data(), seg.m = m[i].data(), seg.v = adamw ? v[i].data() : nullptr;
          seg.grad = grad[i].data();
          seg.param = mode == ParamMode::kIsMaster ? static_cast<void*>(seg.master) : param[i].data();
        }
        StepScalars dev_sc, host_sc;
        dev_sc.inv_loss_scale = static_cast<const float*>(inv_d.data());
        dev_sc.clip = static_cast<const float*>(clip_d.data());
        dev_sc.found_inf = static_cast<const float*>(skip_d.data());
        host_sc.inv_loss_scale = &inv, host_sc.clip = &clip, host_sc.found_inf = &no_skip;
        if (adamw) {
          const AdamWConfig hp{3e-3f, 0.9f, 0.95f, 1e-8f, 7};
          optim::adamw_multi(s(), d.segs(), d.param_dtype, gt, hp, dev_sc);
          optim::adamw_host(host_list, d.param_dtype, gt, hp, host_sc);
        } else {
          const SgdConfig hp{0.1f, 0.9f, kind == 2, 7};
          optim::sgd_multi(s(), d.segs(), d.param_dtype, gt, hp, dev_sc);
          optim::sgd_host(host_list, d.param_dtype, gt, hp, host_sc);
        }
        s().synchronize();
        bool moved = false;
        for (size_t i = 0; i < hs.size(); ++i) {
          SCOPED_TRACE(::testing::Message() << "segment " << i << " (n = " << hs[i].n << ")");
          const SegOut o = download(d, i);
          EXPECT_TRUE(same_bytes(o.master, encode(master[i], DType::kF32))) << "master";
          EXPECT_TRUE(same_bytes(o.m, encode(m[i], DType::kF32))) << "m";
          if (adamw) {
            EXPECT_TRUE(same_bytes(o.v, encode(v[i], DType::kF32))) << "v";
          }
          EXPECT_TRUE(same_bytes(o.param, mode == ParamMode::kIsMaster ? encode(master[i], DType::kF32) : param[i]))
              << "working copy";
          moved = moved || master[i] != hs[i].master;
        }
        EXPECT_TRUE(moved) << "the update changed nothing: the comparison proves nothing";
      }
    }
  }
}

// found_inf != 0 when the op runs: nothing is written (the poisoned working copy stays poisoned);
// found_inf == 0: the step runs.
TEST_P(OptimTest, SkippedStepWritesNothing) {
  DeviceBuffer skip = scalar(0.0f);
  for (ParamMode mode : {ParamMode::kIsMaster, ParamMode::kBF16}) {
    for (bool adamw : {true, false}) {
      SCOPED_TRACE(::testing::Message() << mode_name(mode) << (adamw ? ", adamw" : ", sgd"));
      const std::vector<HostSeg> hs =
          make_segs(rng_, {1, 300, kMultiTensorChunk + 1}, DType::kBF16, 1.0f);
      DevSegs d = upload(hs, mode, DType::kBF16, adamw);
      std::vector<SegOut> before;
      for (size_t i = 0; i < hs.size(); ++i) before.push_back(download(d, i));
      StepScalars sc;
      sc.found_inf = static_cast<const float*>(skip.data());
      sc.rounding = Rounding::kStochastic;
      auto step = [&] {
        if (adamw) {
          optim::adamw_multi(s(), d.segs(), d.param_dtype, DType::kBF16, AdamWConfig{1e-2f}, sc);
        } else {
          optim::sgd_multi(s(), d.segs(), d.param_dtype, DType::kBF16, SgdConfig{1e-2f}, sc);
        }
      };
      // The flag is set by stream work queued before the op, as the overflow check would.
      const float one = 1.0f;
      s().copy(skip.data(), &one, sizeof(float));
      step();
      s().synchronize();
      for (size_t i = 0; i < hs.size(); ++i) {
        const SegOut after = download(d, i);
        EXPECT_TRUE(same_bytes(after.master, before[i].master)) << "segment " << i;
        EXPECT_TRUE(same_bytes(after.m, before[i].m)) << "segment " << i;
        EXPECT_TRUE(same_bytes(after.v, before[i].v)) << "segment " << i;
        EXPECT_TRUE(same_bytes(after.param, before[i].param)) << "segment " << i;
      }
      const float zero = 0.0f;
      s().copy(skip.data(), &zero, sizeof(float));
      step();
      s().synchronize();
      for (size_t i = 0; i < hs.size(); ++i) {
        const SegOut after = download(d, i);
        EXPECT_FALSE(same_bytes(after.master, before[i].master)) << "segment " << i;
        if (mode != ParamMode::kIsMaster) {
          const FVec p = decode(after.param, d.param_dtype);
          EXPECT_TRUE(std::none_of(p.begin(), p.end(), [](float x) { return std::isnan(x); }));
        }
      }
    }
  }
}

// ---- the device update counter (StepScalars::update_count)
// ---------------------------------------------------------

// The step read from the device counter gives the bits of the host's step (updates + 1) through a
// run of updates and skips, the bias corrections included; a skipped update does not count, an
// empty list still does.
TEST_P(OptimTest, UpdateCounterGivesTheHostStep) {
  for (bool adamw : {true, false}) {
    SCOPED_TRACE(adamw ? "adamw" : "sgd");
    const std::vector<HostSeg> hs = make_segs(rng_, {1, 300, kMultiTensorChunk + 1}, DType::kBF16, 1.0f);
    DevSegs counted = upload(hs, ParamMode::kBF16, DType::kBF16, adamw);
    DevSegs given = upload(hs, ParamMode::kBF16, DType::kBF16, adamw);
    DevSegs empty = upload({}, ParamMode::kBF16, DType::kBF16, adamw);
    DeviceBuffer skip = scalar(0.0f);
    const uint32_t resumed = 3;  // updates made before (a resumed run)
    DeviceBuffer count = alloc(sizeof(uint32_t)), empty_count = alloc(sizeof(uint32_t));
    put(count.data(), &resumed, sizeof resumed);
    put(empty_count.data(), &resumed, sizeof resumed);
    int64_t updates = resumed;
    for (const float flag : {0.0f, 1.0f, 0.0f, 0.0f, 1.0f, 1.0f, 0.0f}) {
      put(skip.data(), &flag, sizeof flag);
      StepScalars sc;
      sc.found_inf = static_cast<const float*>(skip.data());
      sc.rounding = Rounding::kStochastic;
      sc.seed = 11;
      auto run = [&](DevSegs& d, int step, uint32_t* counter) {
        StepScalars c = sc;
        c.update_count = counter;
        AdamWConfig a{1e-2f};
        a.step = step;
        SgdConfig g{1e-2f};
        g.step = step;
        if (adamw) optim::adamw_multi(s(), d.segs(), d.param_dtype, DType::kBF16, a, c);
        else optim::sgd_multi(s(), d.segs(), d.param_dtype, DType::kBF16, g, c);
      };
      run(counted, 1, static_cast<uint32_t*>(count.data()));  // the config's step is not used
      run(given, static_cast<int>(updates) + 1, nullptr);
      run(empty, 1, static_cast<uint32_t*>(empty_count.data()));
      s().synchronize();
      if (flag == 0.0f) ++updates;
      for (size_t i = 0; i < hs.size(); ++i) {
        const SegOut a = download(counted, i), b = download(given, i);
        EXPECT_TRUE(same_bytes(a.master, b.master) && same_bytes(a.m, b.m) && same_bytes(a.v, b.v) &&
                    same_bytes(a.param, b.param))
            << "segment " << i << " after " << updates << " updates";
      }
      uint32_t n = 0, ne = 0;
      std::memcpy(&n, get(count.data(), sizeof n).data(), sizeof n);
      std::memcpy(&ne, get(empty_count.data(), sizeof ne).data(), sizeof ne);
      EXPECT_EQ(n, updates);
      EXPECT_EQ(ne, updates);
    }
  }
}

// The bias correction 1 - beta^step by binary exponentiation equals the float of std::pow's in
// double (what the host computed before the step moved to the device) for the common betas.
TEST(BiasCorrection, EqualsTheDoublePowRounded) {
  for (const float beta : {0.9f, 0.95f, 0.98f, 0.99f, 0.999f}) {
    int differ = 0;
    for (int step = 1; step <= 300000; ++step)
      differ += adamw_bias_correction(beta, static_cast<uint64_t>(step)) !=
                static_cast<float>(1.0 - std::pow(static_cast<double>(beta), step));
    EXPECT_EQ(differ, 0) << "beta " << beta;
  }
}

// ---- stochastic rounding
// -----------------------------------------------------------------------------

// The 16-bit values adjacent to x: lo <= |x| <= hi in magnitude (lo == hi when x is representable),
// as bits with x's sign.
struct Neighbours {
  uint16_t lo, hi;
};
Neighbours neighbours(float x, DType t) {
  const float ax = std::fabs(x);
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  uint16_t near = to_bits16(ax, t);
  const float nv = from_bits16(near, t);
  if (nv == ax) return {static_cast<uint16_t>(sign | near), static_cast<uint16_t>(sign | near)};
  const uint16_t lo = nv > ax ? near - 1 : near;
  return {static_cast<uint16_t>(sign | lo), static_cast<uint16_t>(sign | (lo + 1))};
}

TEST_P(OptimTest, StochasticRoundingIsReproducibleAndPicksANeighbour) {
  for (DType pt : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(pt));
    const ParamMode mode = pt == DType::kBF16 ? ParamMode::kBF16 : ParamMode::kF16;
    const std::vector<HostSeg> hs =
        make_segs(rng_, {5, kMultiTensorChunk + 3, 1000}, DType::kF32, 1.0f);
    auto run = [&](uint64_t seed, std::vector<SegOut>* out) {
      DevSegs d = upload(hs, mode, DType::kF32, true);
      StepScalars sc;
      sc.rounding = Rounding::kStochastic;
      sc.seed = seed;
      optim::adamw_multi(s(), d.segs(), pt, DType::kF32, AdamWConfig{1e-3f}, sc);
      s().synchronize();
      out->clear();
      for (size_t i = 0; i < hs.size(); ++i) out->push_back(download(d, i));
    };
    std::vector<SegOut> a, b, c;
    run(11, &a);
    run(11, &b);
    run(12, &c);
    size_t differing = 0, total = 0, rounded_up = 0, inexact = 0;
    for (size_t i = 0; i < hs.size(); ++i) {
      EXPECT_TRUE(same_bytes(a[i].param, b[i].param)) << "same seed, segment " << i;
      EXPECT_TRUE(same_bytes(a[i].master, c[i].master)) << "the master does not depend on the seed";
      const FVec master = decode(a[i].master, DType::kF32);
      for (size_t j = 0; j < master.size(); ++j) {
        uint16_t pa, pc;
        std::memcpy(&pa, &a[i].param[2 * j], 2);
        std::memcpy(&pc, &c[i].param[2 * j], 2);
        const Neighbours nb = neighbours(master[j], pt);
        ASSERT_TRUE(pa == nb.lo || pa == nb.hi)
            << "segment " << i << " [" << j << "]: master " << master[j] << " became "
            << from_bits16(pa, pt) << ", not " << from_bits16(nb.lo, pt) << " or "
            << from_bits16(nb.hi, pt);
        differing += pa != pc;
        inexact += nb.lo != nb.hi;
        rounded_up += nb.lo != nb.hi && pa == nb.hi;
        ++total;
      }
    }
    // Each inexact element picks its upper neighbour with probability = its fraction: for random
    // masters about half round up, and another seed changes about a third of the elements.
    EXPECT_GT(differing, total / 5) << "another seed should round many elements differently";
    EXPECT_GT(rounded_up, inexact / 3);
    EXPECT_LT(rounded_up, inexact * 2 / 3);
  }
}

// With lr = 0 the master keeps its value x; the working copy is then n independent stochastic
// roundings of x, whose mean must be x within a few standard errors (nearest-even would be off by
// min(f, 1-f) spacings, hundreds of standard errors).
TEST_P(OptimTest, StochasticRoundingIsUnbiased) {
  struct Case {
    DType dtype;
    float x;
  };
  const Case cases[] = {
      {DType::kBF16, 1.0f + 0.3f / 128},                          // 30% of a bf16 spacing above 1
      {DType::kBF16, -3.7e-3f},                                   // negative, arbitrary fraction
      {DType::kBF16, 1.2e-39f},                                   // fp32 subnormal
      {DType::kF16, 1.0f + 0.8f / 1024},                          // 80% of an f16 spacing above 1
      {DType::kF16, -0.1234567f},        {DType::kF16, 3.3e-6f},  // f16 subnormal range
      {DType::kF16, 65519.0f},  // between the largest half and the step to inf
  };
  const int64_t n = 200003;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.dtype) << " x = " << c.x);
    HostSeg h;
    h.n = n;
    h.master = FVec(n, c.x);
    h.m = FVec(n, 0.0f);
    h.v = FVec(n, 0.0f);
    h.grad = rng_.normal(n);
    DevSegs d = upload({h}, c.dtype == DType::kBF16 ? ParamMode::kBF16 : ParamMode::kF16,
                       DType::kF32, true);
    StepScalars sc;
    sc.rounding = Rounding::kStochastic;
    sc.seed = 99;
    optim::adamw_multi(s(), d.segs(), c.dtype, DType::kF32, AdamWConfig{0.0f}, sc);
    s().synchronize();
    const SegOut o = download(d, 0);
    ASSERT_TRUE(same_bytes(o.master, bytes_of(h.master))) << "lr = 0 keeps the master";
    const Neighbours nb = neighbours(c.x, c.dtype);
    const double lo = from_bits16(nb.lo, c.dtype);
    const double hi = c.x == 65519.0f ? 65536.0 : from_bits16(nb.hi, c.dtype);
    const double f = (double{c.x} - lo) / (hi - lo);
    double sum = 0;
    int64_t ups = 0;
    const FVec p = decode(o.param, c.dtype);
    for (int64_t i = 0; i < n; ++i) {
      uint16_t bits;
      std::memcpy(&bits, &o.param[2 * i], 2);
      ASSERT_TRUE(bits == nb.lo || bits == nb.hi) << "[" << i << "] " << p[i];
      ups += bits == nb.hi;
      sum += p[i];
    }
    const double frac_up = static_cast<double>(ups) / n;
    const double stderr_frac = std::sqrt(f * (1 - f) / n);
    EXPECT_NEAR(frac_up, f, 5 * stderr_frac + 1e-12) << "share rounded up";
    if (std::isfinite(hi) && c.x != 65519.0f) {
      const double mean = sum / n;
      EXPECT_NEAR(mean, c.x, 5 * std::fabs(hi - lo) * stderr_frac) << "mean of the roundings";
    }
  }
}

// The random word of element i is keyed by rng_offset + i, so splitting a tensor into segments
// (with the matching offsets) changes nothing; the step changes the draws.
TEST_P(OptimTest, StochasticRoundingIsKeyedByGlobalIndexAndStep) {
  const int64_t n = 3 * kMultiTensorChunk + 17, cut = kMultiTensorChunk + 5;
  HostSeg whole = make_segs(rng_, {n}, DType::kF32, 1.0f)[0];
  whole.wd = 0.05f;
  whole.rng_offset = 1000;
  auto part = [&](int64_t b, int64_t e) {
    HostSeg h;
    h.n = e - b;
    h.wd = whole.wd;
    h.rng_offset = whole.rng_offset + static_cast<uint64_t>(b);
    h.master.assign(whole.master.begin() + b, whole.master.begin() + e);
    h.m.assign(whole.m.begin() + b, whole.m.begin() + e);
    h.v.assign(whole.v.begin() + b, whole.v.begin() + e);
    h.grad.assign(whole.grad.begin() + b, whole.grad.begin() + e);
    return h;
  };
  auto params = [&](const std::vector<HostSeg>& hs, int step) {
    DevSegs d = upload(hs, ParamMode::kBF16, DType::kF32, true);
    StepScalars sc;
    sc.rounding = Rounding::kStochastic;
    sc.seed = 5;
    AdamWConfig hp{1e-3f};
    hp.step = step;
    optim::adamw_multi(s(), d.segs(), DType::kBF16, DType::kF32, hp, sc);
    s().synchronize();
    Bytes all;
    for (size_t i = 0; i < hs.size(); ++i) {
      const Bytes p = download(d, i).param;
      all.insert(all.end(), p.begin(), p.end());
    }
    return all;
  };
  const Bytes one = params({whole}, 2);
  EXPECT_TRUE(same_bytes(params({part(0, cut), part(cut, n)}, 2), one));
  // A different step draws different words (and changes the bias correction, but only slightly).
  EXPECT_FALSE(same_bytes(params({whole}, 3), one));
}

// ---- unscale_check
// ----------------------------------------------------------------------------------

struct GradCase {
  std::vector<int64_t> sizes;
  std::vector<int> outs;
  int num_out;
};

// Double reference: sum over segments with out == k of (g * inv)^2.
DVec norms_ref(const std::vector<FVec>& grads, const std::vector<int>& outs, int num_out,
               float inv) {
  DVec norms(static_cast<size_t>(num_out), 0.0);
  for (size_t s = 0; s < grads.size(); ++s)
    for (float g : grads[s]) {
      const double u = double{g} * inv;
      norms[outs[s]] += u * u;
    }
  return norms;
}

class UnscaleRun {
 public:
  UnscaleRun(OptimTest& t, const std::vector<FVec>& grads, const std::vector<int>& outs, DType gt)
      : t_(t) {
    for (size_t s = 0; s < grads.size(); ++s) {
      const Bytes b = encode(grads[s], gt);
      buffers_.push_back(t.alloc(b.size()));
      t.put(buffers_.back().data(), b.data(), b.size());
      list_.push_back(
          GradSegment{buffers_.back().data(), static_cast<int64_t>(grads[s].size()), outs[s]});
    }
    device_ = t.device_list(list_);
  }
  SegmentList<GradSegment> segs() const {
    return {list_, static_cast<const GradSegment*>(device_.data())};
  }

 private:
  OptimTest& t_;
  std::vector<DeviceBuffer> buffers_;
  std::vector<GradSegment> list_;
  DeviceBuffer device_;
};

TEST_P(OptimTest, UnscaleCheckNormsMatchFloat64) {
  // Segments into 4 outputs; output 2 has no segment (must read 0).
  const std::vector<int64_t> sizes = {1,    kMultiTensorChunk + 1,     0,
                                      4099, kMultiTensorChunk - 1,     kMultiTensorChunk,
                                      7,    3 * kMultiTensorChunk + 11};
  const std::vector<int> outs = {0, 1, 3, 0, 1, 3, 3, 0};
  const int num_out = 4;
  for (DType gt : kFloatTypes) {
    for (float loss_scale : {1.0f, 4096.0f, 3.0f}) {
      SCOPED_TRACE(::testing::Message()
                   << "grad " << dtype_name(gt) << ", loss scale " << loss_scale);
      std::vector<FVec> grads;
      for (int64_t n : sizes) grads.push_back(stored(rng_.normal(n, 0.02f * loss_scale), gt));
      const float inv = 1.0f / loss_scale;
      UnscaleRun run(*this, grads, outs, gt);
      DeviceBuffer d_inv = scalar(inv), norms = alloc(num_out * sizeof(float));
      const FVec poison(num_out, std::numeric_limits<float>::quiet_NaN());
      put(norms.data(), poison.data(), num_out * sizeof(float));
      DeviceBuffer found = scalar(7.0f);  // overwritten with 0
      optim::unscale_check(s(), run.segs(), gt, static_cast<const float*>(d_inv.data()),
                           static_cast<float*>(norms.data()), num_out,
                           static_cast<float*>(found.data()));
      s().synchronize();
      const FVec got = get_f(norms.data(), num_out);
      EXPECT_TRUE(close(got, norms_ref(grads, outs, num_out, inv), Tol{1e-6, 0.0}));
      EXPECT_EQ(got[2], 0.0f);
      EXPECT_EQ(get_f(found.data(), 1)[0], 0.0f);
    }
  }
}

TEST_P(OptimTest, UnscaleCheckFindsInfAndNaNWherever) {
  const std::vector<int64_t> sizes = {3, kMultiTensorChunk + 1, 2 * kMultiTensorChunk + 5, 1};
  const std::vector<int> outs = {0, 1, 1, 2};
  const int num_out = 3;
  struct Injection {
    size_t seg;
    int64_t index;
    float value;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Injection injections[] = {
      {0, 0, inf},
      {1, kMultiTensorChunk, -inf},         // first element of the second chunk
      {1, kMultiTensorChunk - 1, nan},      // last element of the first chunk
      {2, 2 * kMultiTensorChunk + 4, nan},  // last element of the list's longest segment
      {3, 0, -inf},
  };
  for (DType gt : kFloatTypes) {
    std::vector<FVec> clean;
    for (int64_t n : sizes) clean.push_back(stored(rng_.normal(n), gt));
    auto check = [&](const std::vector<FVec>& grads, const std::vector<bool>& bad_outs,
                     float expected_flag) {
      UnscaleRun run(*this, grads, outs, gt);
      DeviceBuffer norms = alloc(num_out * sizeof(float));
      DeviceBuffer found = scalar(expected_flag == 0.0f ? 1.0f : 0.0f);  // must be overwritten
      optim::unscale_check(s(), run.segs(), gt, nullptr, static_cast<float*>(norms.data()), num_out,
                           static_cast<float*>(found.data()));
      s().synchronize();
      EXPECT_EQ(get_f(found.data(), 1)[0], expected_flag);
      const FVec got = get_f(norms.data(), num_out);
      const DVec ref = norms_ref(clean, outs, num_out, 1.0f);
      for (int k = 0; k < num_out; ++k) {
        if (bad_outs[k]) {
          EXPECT_FALSE(std::isfinite(got[k])) << "norm " << k;
        } else {
          EXPECT_NEAR(got[k], ref[k], 1e-6 * ref[k]) << "norm " << k;
        }
      }
    };
    SCOPED_TRACE(dtype_name(gt));
    check(clean, {false, false, false}, 0.0f);
    for (const Injection& inj : injections) {
      SCOPED_TRACE(::testing::Message()
                   << "segment " << inj.seg << " [" << inj.index << "] = " << inj.value);
      std::vector<FVec> grads = clean;
      grads[inj.seg][inj.index] = inj.value;
      std::vector<bool> bad(num_out, false);
      bad[outs[inj.seg]] = true;
      check(grads, bad, 1.0f);
    }
  }
  // A finite fp32 gradient that overflows when unscaled by an inverse scale > 1 is non-finite.
  std::vector<FVec> big = {FVec{3e38f, 1.0f}};
  UnscaleRun run(*this, big, {0}, DType::kF32);
  DeviceBuffer inv = scalar(2.0f), norms = alloc(sizeof(float)), found = scalar(0.0f);
  optim::unscale_check(s(), run.segs(), DType::kF32, static_cast<const float*>(inv.data()),
                       static_cast<float*>(norms.data()), 1, static_cast<float*>(found.data()));
  s().synchronize();
  EXPECT_EQ(get_f(found.data(), 1)[0], 1.0f);
}

// The sum order is fixed by the chunking: the CPU result equals a sequential evaluation of the same
// order (per chunk the 8-lane sum of kernels/cpu, chunks in order, segments in list order), so it
// cannot depend on the thread count; and every backend repeats its bits run to run.
TEST_P(OptimTest, UnscaleCheckIsDeterministic) {
  const std::vector<int64_t> sizes = {kMultiTensorChunk * 5 + 3, 17, kMultiTensorChunk - 1, 100000};
  const std::vector<int> outs = {0, 1, 0, 0};
  std::vector<FVec> grads;
  for (int64_t n : sizes) grads.push_back(stored(rng_.normal(n, 3.0f, 0.5f), DType::kBF16));
  UnscaleRun run(*this, grads, outs, DType::kBF16);
  const float inv = 0.37f;
  DeviceBuffer d_inv = scalar(inv);
  auto once = [&] {
    DeviceBuffer norms = alloc(2 * sizeof(float)), found = scalar(5.0f);
    optim::unscale_check(s(), run.segs(), DType::kBF16, static_cast<const float*>(d_inv.data()),
                         static_cast<float*>(norms.data()), 2, static_cast<float*>(found.data()));
    s().synchronize();
    return get_f(norms.data(), 2);
  };
  const FVec first = once();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(same_bytes(bytes_of(once()), bytes_of(first)));
  if (GetParam() != Backend::kCpu) return;
  double norms[2] = {0, 0};
  for (size_t s = 0; s < grads.size(); ++s) {
    double seg_sum = 0;
    const int64_t n = static_cast<int64_t>(grads[s].size());
    for (int64_t b = 0; b < n; b += kMultiTensorChunk) {
      const float* g = grads[s].data() + b;
      seg_sum += cpu_kernels::detail::lane_sum(std::min(kMultiTensorChunk, n - b), [&](int64_t i) {
        const double u = g[i] * inv;
        return u * u;
      });
    }
    norms[outs[s]] += seg_sum;
  }
  EXPECT_EQ(first[0], static_cast<float>(norms[0]));
  EXPECT_EQ(first[1], static_cast<float>(norms[1]));
}

TEST_P(OptimTest, UnscaleCheckOfAnEmptyListWritesZeros) {
  DeviceBuffer norms = alloc(3 * sizeof(float)), found = scalar(1.0f);
  const FVec poison(3, std::numeric_limits<float>::quiet_NaN());
  put(norms.data(), poison.data(), 3 * sizeof(float));
  std::vector<GradSegment> none;
  optim::unscale_check(s(), {none, nullptr}, DType::kF16, nullptr,
                       static_cast<float*>(norms.data()), 3, static_cast<float*>(found.data()));
  s().synchronize();
  EXPECT_EQ(get_f(norms.data(), 3), FVec(3, 0.0f));
  EXPECT_EQ(get_f(found.data(), 1)[0], 0.0f);
}

// ---- loss scaling
// ---------------------------------------------------------------------------------

::testing::AssertionResult same_state(const LossScaleState& a, const LossScaleState& b) {
  if (std::memcmp(&a, &b, sizeof(a)) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "scale " << a.scale << " vs " << b.scale << ", inv " << a.inv_scale << " vs "
         << b.inv_scale << ", good " << a.good_steps << " vs " << b.good_steps << ", hysteresis "
         << a.hysteresis_left << " vs " << b.hysteresis_left << ", collapsed " << a.collapsed
         << " vs " << b.collapsed << ", skipped " << a.skipped << " vs " << b.skipped;
}

// The documented transition, step by step, on a hand-written script.
TEST(LossScale, HostTransitionFollowsTheScript) {
  LossScaleConfig c;
  c.growth_interval = 3;
  c.hysteresis = 2;
  c.min_scale = 1.0f;
  c.max_scale = 64.0f;
  LossScaleState st = optim::initial_loss_scale_state(16.0f, c);
  EXPECT_TRUE(same_state(st, LossScaleState{16, 1.0f / 16, 0, 2, 0, 0}));
  struct Step {
    bool overflow;
    LossScaleState want;  // scale, inv, good, hysteresis_left, collapsed, skipped
  };
  const Step script[] = {
      {false, {16, 1.0f / 16, 1, 2, 0, 0}},
      {true, {16, 1.0f / 16, 0, 1, 0, 1}},  // hysteresis absorbs the first overflow
      {true, {8, 1.0f / 8, 0, 1, 0, 2}},    // then backs off
      {true, {4, 1.0f / 4, 0, 1, 0, 3}},    // and again (hysteresis is not restored by backoff)
      {false, {4, 1.0f / 4, 1, 1, 0, 3}},
      {false, {4, 1.0f / 4, 2, 1, 0, 3}},
      {false, {8, 1.0f / 8, 0, 2, 0, 3}},  // growth interval reached: grow, restore hysteresis
      {false, {8, 1.0f / 8, 1, 2, 0, 3}},
      {true, {8, 1.0f / 8, 0, 1, 0, 4}},  // an overflow resets the good-step count
      {false, {8, 1.0f / 8, 1, 1, 0, 4}},
      {false, {8, 1.0f / 8, 2, 1, 0, 4}},
      {false, {16, 1.0f / 16, 0, 2, 0, 4}},
  };
  for (size_t i = 0; i < std::size(script); ++i) {
    optim::loss_scale_transition(st, script[i].overflow, c);
    EXPECT_TRUE(same_state(st, script[i].want)) << "after scripted step " << i;
  }
  // Growth stops at max_scale.
  for (int i = 0; i < 3 * 5; ++i) optim::loss_scale_transition(st, false, c);
  EXPECT_EQ(st.scale, 64.0f);
  EXPECT_EQ(st.inv_scale, 1.0f / 64);
  // Repeated overflows: one absorbed by hysteresis, then 64 -> 1 in six backoffs, then collapse.
  for (int i = 0; i < 7; ++i) optim::loss_scale_transition(st, true, c);
  EXPECT_EQ(st.scale, 1.0f);
  EXPECT_EQ(st.collapsed, 0.0f);
  optim::loss_scale_transition(st, true, c);
  EXPECT_EQ(st.collapsed, 1.0f);
  EXPECT_EQ(st.scale, 1.0f);
  EXPECT_EQ(st.skipped, 12.0f);
  // Collapse is sticky.
  for (int i = 0; i < 3; ++i) optim::loss_scale_transition(st, false, c);
  EXPECT_EQ(st.collapsed, 1.0f);
  // Backoff never goes below min_scale.
  LossScaleConfig c2;
  c2.min_scale = 3.0f;
  c2.backoff = 0.25f;
  LossScaleState s2 = optim::initial_loss_scale_state(8.0f, c2);
  optim::loss_scale_transition(s2, true, c2);
  EXPECT_EQ(s2.scale, 3.0f);
  EXPECT_EQ(s2.inv_scale, 1.0f / 3.0f);
}

// clip_factor against the trainer's host formula, written out here: included partials and loss
// sums added in double in rank-then-entry order, norm = sqrt, skipped on a flag > 0 or a
// non-finite loss, clip = max_norm / norm only when not skipped and norm > max_norm > 0. The
// bits must be equal (the trainer's printed norms and losses, and the clipped update, depend on
// it), on random rows over several rank counts, with and without clipping, and with faults.
TEST_P(OptimTest, ClipFactorMatchesTheHostSumBitForBit) {
  struct Case {
    int ranks, row;
    float max_norm;
    const char* fault;  // "", "flag", "inf loss", "nan loss", "excluded nan loss"
  };
  const Case cases[] = {{1, 2, 1.0f, ""},       {1, 9, 0.0f, ""},          {3, 16, 0.5f, ""},
                        {3, 16, 1e6f, ""},      {8, 42, 0.25f, ""},        {5, 42, 0.25f, "flag"},
                        {4, 10, 0.3f, "inf loss"}, {4, 10, 0.3f, "nan loss"}, {4, 10, 0.3f, "excluded nan loss"}};
  for (const Case& c : cases) {
    for (float flag0 : {0.0f, 2.0f}) {
      SCOPED_TRACE(::testing::Message() << c.ranks << " ranks of " << c.row << ", max_norm " << c.max_norm << ", "
                                        << c.fault << ", own flag " << flag0);
      const size_t n = static_cast<size_t>(c.ranks) * static_cast<size_t>(c.row);
      const int partials = c.row - 2;
      std::vector<float> parts(n), include(n);
      const FVec mag = rng_.uniform(static_cast<int64_t>(n), -8.0f, 4.0f), pick = rng_.uniform(static_cast<int64_t>(n), 0, 1);
      for (size_t i = 0; i < n; ++i) {
        parts[i] = std::exp2(mag[i]) * (1.0f + pick[i]);  // squared norms: >= 0, over 12 binades
        include[i] = pick[i] < 0.75f ? 1.0f : 0.0f;
      }
      for (int g = 0; g < c.ranks; ++g) parts[static_cast<size_t>(g * c.row + partials + 1)] = 0.0f;  // flags
      const size_t loss1 = static_cast<size_t>(std::min(1, c.ranks - 1) * c.row + partials);
      if (std::string(c.fault) == "flag") parts[static_cast<size_t>(c.row + partials + 1)] = 1.0f;
      if (std::string(c.fault) == "inf loss") parts[loss1] = std::numeric_limits<float>::infinity(), include[loss1] = 1;
      if (std::string(c.fault) == "nan loss") parts[loss1] = std::numeric_limits<float>::quiet_NaN(), include[loss1] = 1;
      if (std::string(c.fault) == "excluded nan loss")
        parts[loss1] = std::numeric_limits<float>::quiet_NaN(), include[loss1] = 0;

      // The host formula.
      double sq = 0, loss = 0;
      bool skipped = false;
      for (int g = 0; g < c.ranks; ++g) {
        const size_t base = static_cast<size_t>(g) * static_cast<size_t>(c.row);
        for (int k = 0; k < partials; ++k)
          if (include[base + static_cast<size_t>(k)] != 0) sq += parts[base + static_cast<size_t>(k)];
        if (include[base + static_cast<size_t>(partials)] != 0) loss += parts[base + static_cast<size_t>(partials)];
        skipped = skipped || parts[base + static_cast<size_t>(partials) + 1] > 0;
      }
      if (!std::isfinite(loss)) skipped = true;
      const double norm = std::sqrt(sq);
      const float clip = !skipped && c.max_norm > 0 && norm > c.max_norm ? static_cast<float>(c.max_norm / norm) : 1.0f;
      const float flag_after = skipped && !(flag0 > 0) ? 1.0f : flag0;

      DeviceBuffer dp = alloc(n * 4), di = alloc(n * 4), dout = alloc(4 * sizeof(double)), flag = scalar(flag0);
      put(dp.data(), parts.data(), n * 4);
      put(di.data(), include.data(), n * 4);
      std::vector<double> poison(4, std::numeric_limits<double>::quiet_NaN());
      put(dout.data(), poison.data(), 4 * sizeof(double));
      auto* out = static_cast<double*>(dout.data());
      optim::clip_factor(s(), static_cast<const float*>(dp.data()), static_cast<const float*>(di.data()), c.ranks, c.row,
                         c.max_norm, out, reinterpret_cast<float*>(out + 3), static_cast<float*>(flag.data()));
      const Bytes got = get(dout.data(), 4 * sizeof(double));
      double got_d[3];
      float got_clip;
      std::memcpy(got_d, got.data(), sizeof got_d);
      std::memcpy(&got_clip, got.data() + 3 * sizeof(double), sizeof got_clip);
      const double want[3] = {norm, loss, skipped ? 1.0 : 0.0};
      EXPECT_EQ(std::memcmp(got_d, want, sizeof want), 0)
          << "norm " << got_d[0] << " vs " << norm << ", loss " << got_d[1] << " vs " << loss << ", skipped "
          << got_d[2] << " vs " << skipped;
      EXPECT_EQ(std::bit_cast<uint32_t>(got_clip), std::bit_cast<uint32_t>(clip)) << got_clip << " vs " << clip;
      EXPECT_EQ(get_f(flag.data(), 1)[0], flag_after);
      if (std::string(c.fault).empty() && flag0 == 0 && partials > 0 && c.max_norm > 0 && c.max_norm < 1e5f) {
        EXPECT_LT(clip, 1.0f) << "the case is meant to clip";
      }
    }
  }
  // Bad input: one sentence naming the op.
  DeviceBuffer tiny = alloc(8 * sizeof(double));
  auto* d = static_cast<double*>(tiny.data());
  const auto* f = reinterpret_cast<const float*>(d);
  EXPECT_THROW(optim::clip_factor(s(), f, f, 0, 2, 1.0f, d, reinterpret_cast<float*>(d + 3), nullptr), Error);
  EXPECT_THROW(optim::clip_factor(s(), f, f, 1, 2, -1.0f, d, reinterpret_cast<float*>(d + 3), nullptr), Error);
}

// The device op, driven by found_inf values written on the stream, repeats the host transition
// bit for bit, for power-of-two and awkward factors.
TEST_P(OptimTest, LossScaleUpdateOnTheDeviceMatchesTheHost) {
  LossScaleConfig configs[3];
  configs[0].growth_interval = 4;
  configs[0].hysteresis = 1;
  configs[0].max_scale = 1024.0f;
  configs[1].growth_interval = 2;
  configs[1].hysteresis = 3;
  configs[1].min_scale = 0.5f;
  configs[1].max_scale = 100.0f;
  configs[2].growth = 3.0f;
  configs[2].backoff = 0.3f;
  configs[2].growth_interval = 3;
  configs[2].hysteresis = 2;
  configs[2].min_scale = 0.7f;
  configs[2].max_scale = 5000.0f;
  for (const LossScaleConfig& c : configs) {
    LossScaleState host = optim::initial_loss_scale_state(c.max_scale / 4, c);
    DeviceBuffer state = alloc(sizeof(LossScaleState)), found = scalar(0.0f);
    put(state.data(), &host, sizeof(host));
    // Mostly good steps with bursts of overflows, long enough to grow to the top, back off to the
    // bottom and collapse.
    std::vector<bool> script;
    for (int i = 0; i < 40; ++i) script.push_back(i % 9 == 4 || i % 13 == 0);
    for (int i = 0; i < 30; ++i) script.push_back(false);
    for (int i = 0; i < 40; ++i) script.push_back(i % 5 != 2);
    for (size_t i = 0; i < script.size(); ++i) {
      const float flag =
          script[i] ? (i % 2 ? 1.0f : std::numeric_limits<float>::quiet_NaN()) : 0.0f;
      s().copy(found.data(), &flag, sizeof(float));
      optim::loss_scale_update(s(), static_cast<LossScaleState*>(state.data()),
                               static_cast<const float*>(found.data()), c);
      optim::loss_scale_transition(host, script[i], c);
      LossScaleState dev;
      s().copy(&dev, state.data(), sizeof(dev));
      s().synchronize();
      ASSERT_TRUE(same_state(dev, host)) << "step " << i;
    }
    EXPECT_EQ(host.collapsed, 1.0f) << "the script ends in collapse";
  }
}

// ---- arguments and lifetimes
// ----------------------------------------------------------------------

using op_test::error_of;  // the kernel tests' helper (kernels/op_test_util.h)

TEST_P(OptimTest, ArgumentsAreValidated) {
  const std::vector<HostSeg> hs = make_segs(rng_, {10, 20}, DType::kF32, 1.0f);
  DevSegs d = upload(hs, ParamMode::kBF16, DType::kF32, /*with_v=*/false);
  const StepScalars sc;
  // AdamW needs v; SGD does not.
  Error e = error_of([&] { optim::adamw_multi(s(), d.segs(), DType::kBF16, DType::kF32, {}, sc); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e.message(), HasSubstr("adamw_multi: segment 0 (n = 10) has a null v pointer"));
  optim::sgd_multi(s(), d.segs(), DType::kBF16, DType::kF32, SgdConfig{0.1f}, sc);
  s().synchronize();
  EXPECT_THAT(error_of([&] {
                optim::sgd_multi(s(), d.segs(), DType::kI32, DType::kF32, SgdConfig{}, sc);
              }).message(),
              HasSubstr("sgd_multi: the param dtype is int32 but must be fp32, bf16 or fp16"));
  EXPECT_THAT(error_of([&] {
                optim::sgd_multi(s(), d.segs(), DType::kBF16, DType::kI32, SgdConfig{}, sc);
              }).message(),
              HasSubstr("sgd_multi: the grad dtype is int32"));
  std::vector<OptimizerSegment> bad = d.list;
  bad[1].grad = nullptr;
  EXPECT_THAT(error_of([&] {
                optim::sgd_multi(s(), {bad, nullptr}, DType::kBF16, DType::kF32, SgdConfig{}, sc);
              }).message(),
              HasSubstr("sgd_multi: segment 1 (n = 20) has a null grad pointer"));
  bad = d.list;
  bad[0].param = bad[0].master;
  EXPECT_THAT(error_of([&] {
                optim::sgd_multi(s(), {bad, nullptr}, DType::kBF16, DType::kF32, SgdConfig{}, sc);
              }).message(),
              HasSubstr("working copy at the fp32 master's address"));
  EXPECT_THAT(error_of([&] {
                AdamWConfig hp;
                hp.step = 0;
                optim::adamw_multi(s(), d.segs(), DType::kBF16, DType::kF32, hp, sc);
              }).message(),
              HasSubstr("adamw_multi: step 0 must be >= 1"));
  // Null pointers are fine in empty segments, and empty lists launch nothing.
  std::vector<OptimizerSegment> empty(2);
  optim::adamw_multi(s(), {empty, nullptr}, DType::kF16, DType::kF16, {}, sc);
  optim::sgd_multi(s(), {{}, nullptr}, DType::kF16, DType::kF16, {}, sc);

  std::vector<GradSegment> grads = {GradSegment{d.list[0].grad, 10, 2}};
  DeviceBuffer norms = alloc(2 * sizeof(float));
  EXPECT_THAT(
      error_of([&] {
        optim::unscale_check(s(), {grads, nullptr}, DType::kF32, nullptr,
                             static_cast<float*>(norms.data()), 2, nullptr);
      }).message(),
      HasSubstr("unscale_check: segment 0 adds to norms_out[2] but norms_out has 2 entries"));
  LossScaleConfig lc;
  lc.backoff = 2.0f;
  EXPECT_THAT(error_of([&] { optim::initial_loss_scale_state(1.0f, lc); }).message(),
              HasSubstr("backoff 2 must be in (0, 1]"));
  EXPECT_THAT(error_of([&] { optim::initial_loss_scale_state(1e9f, LossScaleConfig{}); }).message(),
              HasSubstr("must be within [min_scale, max_scale]"));
  if (GetParam() == Backend::kCuda) {
    const std::vector<HostSeg> hv = make_segs(rng_, {10}, DType::kF32, 1.0f);
    DevSegs dv = upload(hv, ParamMode::kIsMaster, DType::kF32, true);
    EXPECT_THAT(error_of([&] {
                  optim::adamw_multi(s(), {dv.list, nullptr}, DType::kF32, DType::kF32, {}, sc);
                }).message(),
                HasSubstr("adamw_multi: the segment list has no device copy"));
  }
  s().synchronize();
}

// The CPU backend runs the op later, on the stream's worker: the host list must be copied when the
// op is queued, since the caller's span may be gone (here: overwritten) by then. CPU only (the CUDA
// kernels read the device list): no cuda instance, so a GPU run counts no skip for it.
class OptimCpuTest : public OptimTest {};
TEST_P(OptimCpuTest, HostListIsCopiedWhenTheOpIsQueued) {
  const std::vector<HostSeg> hs = make_segs(rng_, {1000, 5}, DType::kF32, 1.0f);
  DevSegs d = upload(hs, ParamMode::kIsMaster, DType::kF32, true);
  std::atomic<bool> release{false};
  s().host_func([&] {
    while (!release.load()) std::this_thread::yield();
  });
  {
    auto list = std::make_unique<std::vector<OptimizerSegment>>(d.list);
    optim::adamw_multi(s(), {*list, nullptr}, DType::kF32, DType::kF32, AdamWConfig{1e-3f}, {});
    std::fill(list->begin(), list->end(), OptimizerSegment{});  // then gone
  }
  {
    std::vector<GradSegment> grads = {GradSegment{d.list[0].grad, 1000, 0}};
    DeviceBuffer norms = alloc(sizeof(float));
    optim::unscale_check(s(), {grads, nullptr}, DType::kF32, nullptr,
                         static_cast<float*>(norms.data()), 1, nullptr);
    grads[0] = GradSegment{};
    release = true;
    s().synchronize();
    EXPECT_NEAR(get_f(norms.data(), 1)[0], norms_ref({hs[0].grad}, {0}, 1, 1.0f)[0], 1e-3);
  }
  const AdamWConfig hp{1e-3f};
  for (size_t i = 0; i < hs.size(); ++i) {
    const RefState ref = adamw_ref(hs[i].master, hs[i].grad, hs[i].m, hs[i].v, hp, hs[i].wd, 1.0);
    EXPECT_TRUE(close(get_f(d.list[i].master, hs[i].n), ref.p, kTolUpdate)) << "segment " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, OptimTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });
INSTANTIATE_TEST_SUITE_P(Backends, OptimCpuTest, ::testing::Values(Backend::kCpu),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });

}  // namespace
}  // namespace zt
