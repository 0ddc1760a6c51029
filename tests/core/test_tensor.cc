// Shapes and views: numel, equality, printing, dtype-checked access, and error reporting.
#include <gtest/gtest.h>

#include "core/status.h"
#include "core/tensor.h"

namespace zt {
namespace {

TEST(Shape, NumelAndPrinting) {
  Shape s{4, 8, 64};
  EXPECT_EQ(s.ndim(), 3);
  EXPECT_EQ(s.numel(), 4 * 8 * 64);
  EXPECT_EQ(s[1], 8);
  EXPECT_EQ(s.str(), "[4, 8, 64]");
  EXPECT_EQ(Shape{}.numel(), 1);  // a scalar
  EXPECT_EQ((Shape{3, 0}).numel(), 0);
  EXPECT_EQ(s, (Shape{4, 8, 64}));
  EXPECT_NE(s, (Shape{4, 8}));
  EXPECT_THROW(s[3], Error);
  EXPECT_THROW((Shape{1, 2, 3, 4, 5, 6, 7}), Error);
}

TEST(TensorView, BytesAndTypedAccess) {
  float data[12];
  TensorView v{data, DType::kF32, Shape{3, 4}, 0};
  EXPECT_EQ(v.nbytes(), 48u);
  EXPECT_EQ(v.as<float>(), data);
  EXPECT_THROW(v.as<Half>(), Error);
  ConstTensorView c = v;
  EXPECT_EQ(c.as<const float>(), data);
  TensorView h{data, DType::kBF16, Shape{3, 4}, 0};
  EXPECT_EQ(h.nbytes(), 24u);
}

TEST(Status, ErrorCarriesKindMessageAndLocation) {
  try {
    ZT_REQUIRE(1 + 1 == 3, "two is not ", 3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.message(), "two is not 3");
    EXPECT_NE(std::string(e.what()).find("test_tensor.cc"), std::string::npos);
  }
  try {
    ZT_CHECK(false, "context ", 42);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(e.message().find("context 42"), std::string::npos);
  }
}

}  // namespace
}  // namespace zt
