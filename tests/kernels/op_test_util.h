// Helpers of the op test binaries (test_kernels, test_tp_ops): Philox inputs, float64 comparisons
// with dtype-aware tolerances (Host16: 16-bit rounding and bounds), device tensors, the per-backend
// fixture, and the child-process runner
// that checks results do not depend on the thread count. Tolerances: see tests/kernels/test_ops.cc.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"
#include "core/status.h"
#include "core/tensor.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"
#include "test_util.h"

extern char** environ;

namespace zt {

// Test names and messages say "cpu"/"cuda" rather than the enum's bytes.
inline void PrintTo(Backend b, std::ostream* os) { *os << backend_name(b); }

namespace op_test {

using DVec = std::vector<double>;
using FVec = std::vector<float>;
using IVec = std::vector<int32_t>;

struct Tol {
  double rtol, rms_tol;
};
constexpr Tol kTolElem{1e-5, 1e-6};
constexpr Tol kTolReduce{1e-4, 2e-5};

// ---- random inputs ---------------------------------------------------------------------------

inline uint64_t test_seed() {
  if (const char* s = std::getenv("ZT_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return 20240917;
}

// Philox-based, a new stream per call (tests/test_util.h).
using test_util::Rng;

inline DVec to_d(const FVec& v) { return DVec(v.begin(), v.end()); }
inline FVec to_f(const DVec& v) {
  FVec f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

// ---- comparisons -------------------------------------------------------------------------------

inline ::testing::AssertionResult close(const FVec& got, const DVec& ref, Tol tol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  double sq = 0;
  for (double r : ref) sq += r * r;
  const double atol = tol.rms_tol * std::sqrt(sq / std::max<size_t>(1, ref.size()));
  size_t bad = 0;
  double worst = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    const double bound = tol.rtol * std::fabs(ref[i]) + atol;
    if (!(err <= bound)) {  // NaN fails
      if (bad < 5)
        msg << "\n  [" << i << "] got " << got[i] << " want " << ref[i] << " (err " << err << " > "
            << bound << ")";
      ++bad;
    }
    if (bound > 0 && err / bound > worst) worst = err / bound;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements out of tolerance (rtol " << tol.rtol
         << ", rms_tol " << tol.rms_tol << ", worst err/bound " << worst << ")" << msg.str();
}

template <typename T>
::testing::AssertionResult bitwise_equal(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure()
             << "first difference at [" << i << "]: " << +got[i] << " vs " << +want[i];
  return ::testing::AssertionSuccess();
}

// The host side of a 16-bit dtype: core/dtype.h's rounding (the one every kernel reproduces) and
// widening. Against float64 a 16-bit output may be off by half an ulp of itself (2^-8 relative in
// bf16, 2^-11 in fp16) on top of the fp32 arithmetic's kTolElem.
struct Host16 {
  DType t;
  uint16_t round(float v) const { return t == DType::kBF16 ? float_to_bf16_bits(v) : float_to_half_bits(v); }
  float widen(uint16_t h) const { return t == DType::kBF16 ? bf16_bits_to_float(h) : half_bits_to_float(h); }
  std::vector<uint16_t> round(const FVec& v) const {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = round(v[i]);
    return out;
  }
  FVec widen(const std::vector<uint16_t>& v) const {
    FVec out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = widen(v[i]);
    return out;
  }
  // close's bound with the relative half ulp added to kTolElem's rtol, and the dtype's
  // half subnormal spacing (2^-25 in fp16, 2^-134 in bf16) added to its absolute term: near zero
  // the relative bound does not hold.
  ::testing::AssertionResult close(const FVec& got, const DVec& ref) const {
    if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
    const double rtol = (t == DType::kBF16 ? 0x1p-8 : 0x1p-11) + kTolElem.rtol;
    double sq = 0;
    for (double r : ref) sq += r * r;
    const double atol = kTolElem.rms_tol * std::sqrt(sq / std::max<size_t>(1, ref.size())) +
                        (t == DType::kBF16 ? 0x1p-134 : 0x1p-25);
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = std::fabs(got[i] - ref[i]), bound = rtol * std::fabs(ref[i]) + atol;
      if (!(err <= bound))  // NaN fails
        return ::testing::AssertionFailure() << "[" << i << "] got " << got[i] << " want " << ref[i] << " (err "
                                             << err << " > " << bound << ")";
    }
    return ::testing::AssertionSuccess();
  }
};
constexpr uint16_t kPoison16 = 0x7e01;  // a NaN payload no conversion produces (fp16), ~1.7e38 in bf16

// ---- device tensors
// --------------------------------------------------------------------------------

// Memory from the device pool; host <-> device through stream copies.
// 16-bit storage: x rounded to bf16/f16 bits, and bits widened back (exact).
inline uint16_t bits16(float x, DType t) { return t == DType::kBF16 ? float_to_bf16_bits(x) : float_to_half_bits(x); }
inline float widen16(uint16_t b, DType t) { return t == DType::kBF16 ? bf16_bits_to_float(b) : half_bits_to_float(b); }
// x rounded to t (identity for f32): the values a t tensor holds.
inline FVec round_to(const FVec& x, DType t) {
  if (t == DType::kF32) return x;
  FVec r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = widen16(bits16(x[i], t), t);
  return r;
}

class DevTensor {
 public:
  DevTensor(Device& dev, Stream& s, DType dtype, Shape shape)
      : stream_(&s),
        buf_(dev.memory(), static_cast<size_t>(shape.numel()) * dtype_size(dtype), s, "test"),
        view_{buf_.data(), dtype, shape, dev.index()} {}
  operator TensorView() const { return view_; }       // NOLINT
  operator ConstTensorView() const { return view_; }  // NOLINT
  const TensorView& view() const { return view_; }

  void upload_bytes(const void* src) {
    stream_->copy(view_.data, src, view_.nbytes());
    stream_->synchronize();
  }
  template <typename T>
  void upload(const std::vector<T>& host) {
    ZT_CHECK(static_cast<int64_t>(host.size()) == view_.numel() &&
             sizeof(T) == dtype_size(view_.dtype));
    upload_bytes(host.data());
  }
  template <typename T>
  std::vector<T> download() const {
    ZT_CHECK(sizeof(T) == dtype_size(view_.dtype));
    std::vector<T> host(static_cast<size_t>(view_.numel()));
    stream_->copy(host.data(), view_.data, view_.nbytes());
    stream_->synchronize();
    return host;
  }
  FVec f() const { return download<float>(); }

 private:
  Stream* stream_;
  DeviceBuffer buf_;
  TensorView view_;
};

inline FVec nan_vec(int64_t n) {
  return FVec(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
}

inline std::unique_ptr<Runtime> make_runtime(Backend backend, std::string* skip_reason) {
  if (backend == Backend::kCpu) return Runtime::create_cpu(1);
  const CudaAvailability cuda = cuda_availability();
  if (!cuda.usable) {
    *skip_reason = "no usable GPU: " + cuda.reason;
    return nullptr;
  }
  return Runtime::create(parse_device_spec("cuda:0"));
}

// Each test binary derives its own suite from it (class OpsTest : public OpsFixture {}).
class OpsFixture : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    std::string reason;
    rt_ = make_runtime(GetParam(), &reason);
    if (!rt_) GTEST_SKIP() << reason;
    dev_ = &rt_->device(0);
    s_ = &dev_->compute();
  }

  Stream& s() { return *s_; }
  void sync() { s_->synchronize(); }

  DevTensor empty(Shape shape, DType dtype = DType::kF32) {
    return DevTensor(*dev_, *s_, dtype, shape);
  }
  DevTensor tensor(const FVec& host, Shape shape) {
    DevTensor t(*dev_, *s_, DType::kF32, shape);
    t.upload(host);
    return t;
  }
  DevTensor tensor(const IVec& host, Shape shape) {
    DevTensor t(*dev_, *s_, DType::kI32, shape);
    t.upload(host);
    return t;
  }
  DevTensor poisoned(Shape shape) { return tensor(nan_vec(shape.numel()), shape); }
  // A tensor of type t (f32, bf16, f16) holding round_to(host, t).
  DevTensor typed(const FVec& host, Shape shape, DType t) {
    if (t == DType::kF32) return tensor(host, shape);
    DevTensor d = empty(shape, t);
    upload_typed(d, host);
    return d;
  }
  // round_to(host, d's type) into d (f32, bf16, f16), at d's address (a captured graph's input).
  static void upload_typed(DevTensor& d, const FVec& host) {
    const DType t = d.view().dtype;
    if (t == DType::kF32) return d.upload(host);
    std::vector<uint16_t> bits(host.size());
    for (size_t i = 0; i < host.size(); ++i) bits[i] = bits16(host[i], t);
    d.upload(bits);
  }
  // The values of a tensor of any floating type, widened.
  static FVec values(const DevTensor& d) {
    const DType t = d.view().dtype;
    if (t == DType::kF32) return d.f();
    const std::vector<uint16_t> bits = d.download<uint16_t>();
    FVec v(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) v[i] = widen16(bits[i], t);
    return v;
  }

  std::unique_ptr<Runtime> rt_;
  Device* dev_ = nullptr;
  Stream* s_ = nullptr;
  Rng rng_{test_seed()};
};

inline std::string self_exe() {
  char buf[4096];
  const ssize_t len = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  ZT_CHECK(len > 0, "readlink /proc/self/exe");
  return std::string(buf, static_cast<size_t>(len));
}

// Runs this binary's test `child_test` (e.g. "Determinism.ChildWritesOutputs") with `threads`
// worker threads (zt pool and OpenBLAS) and returns what it wrote to $ZT_DETERMINISM_OUT.
inline std::vector<uint8_t> outputs_of_child(int threads, const std::string& child_test) {
  const std::string path = ::testing::TempDir() + "zt_determinism_" + std::to_string(getpid()) +
                           "_" + std::to_string(threads) + ".bin";
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("ZT_NUM_THREADS=", 0) == 0 || kv.rfind("OPENBLAS_NUM_THREADS=", 0) == 0 ||
        kv.rfind("ZT_DETERMINISM_OUT=", 0) == 0 || kv.rfind("GTEST_", 0) == 0)
      continue;
    env.push_back(kv);
  }
  env.push_back("ZT_NUM_THREADS=" + std::to_string(threads));
  env.push_back("OPENBLAS_NUM_THREADS=" + std::to_string(threads));
  env.push_back("ZT_DETERMINISM_OUT=" + path);
  std::vector<char*> envp;
  for (std::string& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  const std::string exe = self_exe();
  std::string filter = "--gtest_filter=" + child_test;
  char* argv[] = {const_cast<char*>(exe.c_str()), filter.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ZT_CHECK(rc == 0, "posix_spawn failed: ", std::strerror(rc));
  int status = 0;
  ZT_CHECK(waitpid(pid, &status, 0) == pid);
  ZT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child with ", threads,
           " threads failed (status ", status, ")");
  std::ifstream f(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  return bytes;
}

// The zt::Error f() throws (a test failure when it throws none): validation tests read its message.
template <typename F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no zt::Error thrown";
  return Error(ErrorKind::kInternal, "none");
}

}  // namespace op_test
}  // namespace zt
