// Checks shared by the tests that run the whole trainer: bitwise equality of final states, and a
// run that must stop with a given error.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/status.h"
#include "train/trainer.h"

namespace zt::test {

// Same sizes and the same bytes, block by block.
inline bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0) return false;
  return true;
}

// Master weights, working parameters and moments (keep_final_params runs).
inline void expect_same_state(const TrainResult& a, const TrainResult& b, const std::string& what) {
  EXPECT_TRUE(same_bits(a.final_params, b.final_params)) << what << ": master weights differ";
  EXPECT_TRUE(same_bits(a.final_working, b.final_working)) << what << ": working parameters differ";
  EXPECT_TRUE(same_bits(a.final_moments, b.final_moments)) << what << ": moments differ";
}

// train(c) must throw zt::Error of `kind` whose message contains `text`.
inline void expect_train_error(const TrainConfig& c, ErrorKind kind, const std::string& text) {
  try {
    train(c);
    ADD_FAILURE() << "the run did not stop; expected an error containing '" << text << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.message();
    EXPECT_NE(e.message().find(text), std::string::npos) << e.message();
  }
}

}  // namespace zt::test
