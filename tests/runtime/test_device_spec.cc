// The --devices grammar: every accepted form, and a clear error for each malformed one.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/status.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

TEST(DeviceSpec, ParsesAll) {
  EXPECT_EQ(parse_device_spec("all").kind, DeviceSpec::Kind::kAll);
}

TEST(DeviceSpec, ParsesCpu) {
  auto s = parse_device_spec("cpu:4");
  EXPECT_EQ(s.kind, DeviceSpec::Kind::kCpu);
  EXPECT_EQ(s.cpu_count, 4);
  EXPECT_EQ(parse_device_spec("cpu").cpu_count, 0);
  EXPECT_EQ(parse_device_spec("cpu:64").cpu_count, 64);
}

TEST(DeviceSpec, ParsesCudaLists) {
  auto s = parse_device_spec("cuda:0,1,3");
  EXPECT_EQ(s.kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(s.cuda_ordinals, (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(parse_device_spec("cuda:0x4").cuda_ordinals, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(parse_device_spec("cuda:1x2,0").cuda_ordinals, (std::vector<int>{1, 1, 0}));
  EXPECT_TRUE(parse_device_spec("cuda").cuda_ordinals.empty());
}

struct BadSpec {
  const char* text;
  const char* expect_in_message;
};

class DeviceSpecErrors : public ::testing::TestWithParam<BadSpec> {};

TEST_P(DeviceSpecErrors, RejectsWithAClearMessage) {
  const BadSpec& bad = GetParam();
  try {
    parse_device_spec(bad.text);
    FAIL() << "accepted '" << bad.text << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find(bad.expect_in_message), std::string::npos) << e.message();
    EXPECT_NE(e.message().find(bad.text), std::string::npos) << "message must quote the input";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DeviceSpecErrors,
    ::testing::Values(BadSpec{"", "unknown device kind"}, BadSpec{"gpu:0", "unknown device kind"},
                      BadSpec{"CPU:2", "unknown device kind"}, BadSpec{"cpu:", "nothing after"},
                      BadSpec{"cpu:0", "between 1 and 64"}, BadSpec{"cpu:65", "between 1 and 64"},
                      BadSpec{"cpu:-1", "not a device count"}, BadSpec{"cpu:two", "not a device count"},
                      BadSpec{"cpu:2.5", "not a device count"}, BadSpec{"cuda:", "nothing after"},
                      BadSpec{"cuda:0,,1", "empty entry"}, BadSpec{"cuda:0,", "empty entry"},
                      BadSpec{"cuda:a", "not a GPU ordinal"}, BadSpec{"cuda:0x0", "positive count"},
                      BadSpec{"cuda:0x", "positive count"}, BadSpec{"cuda:0,0", "listed twice"},
                      BadSpec{"cuda:0x65", "at most 64"}, BadSpec{"cuda:-1", "not a GPU ordinal"},
                      BadSpec{"all:2", "unknown device kind"}));

TEST(DeviceSpec, CpuDeviceCountFromEnvironment) {
  ::setenv("ZT_CPU_DEVICES", "5", 1);
  EXPECT_EQ(default_cpu_device_count(), 5);
  auto rt = Runtime::create(parse_device_spec("cpu"));
  EXPECT_EQ(rt->size(), 5);
  ::setenv("ZT_CPU_DEVICES", "zero", 1);
  EXPECT_THROW(default_cpu_device_count(), Error);
  ::unsetenv("ZT_CPU_DEVICES");
  EXPECT_EQ(default_cpu_device_count(), 2);
}

TEST(DeviceSpec, AllFallsBackToCpuWithOneLineNoteWhenNoGpu) {
  if (cuda_availability().usable) GTEST_SKIP() << "a GPU is present";
  auto rt = Runtime::create(parse_device_spec("all"));
  EXPECT_EQ(rt->backend(), Backend::kCpu);
  EXPECT_EQ(rt->size(), default_cpu_device_count());
  EXPECT_NE(rt->fallback_note().find("no usable GPU"), std::string::npos);
  EXPECT_EQ(rt->fallback_note().find('\n'), std::string::npos) << "one line";
}

TEST(DeviceSpec, ExplicitCudaWithoutGpuIsAClearError) {
  if (cuda_availability().usable) GTEST_SKIP() << "a GPU is present";
  try {
    Runtime::create(parse_device_spec("cuda:0"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("no usable GPU"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("cpu:N"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace zt
