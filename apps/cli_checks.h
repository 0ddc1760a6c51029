// Validators for zerotrain's numeric flags whose messages state the accepted range ("--steps:
// must be a whole number >= 1, got '-5'"); CLI11's PositiveNumber/NonNegativeNumber print the
// double range "0.000000 to 1797...", and accept 1.5 for an integer flag.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <string>

namespace zt_cli {

// A whole number in [lo, hi] (hi defaults to INT_MAX, the range of the int flags).
inline CLI::Validator whole(long long lo, long long hi = INT_MAX) {
  const std::string range = hi == INT_MAX ? ">= " + std::to_string(lo)
                                          : "from " + std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0' || errno == ERANGE || v < lo || v > hi)
          return "must be a whole number " + range + ", got '" + s + "'";
        return {};
      },
      "(" + range + ")");
}

// A finite number above `lo` (strict) or at least `lo`. The flags are floats: a value beyond
// the largest float would silently become inf, so it is out of range.
inline CLI::Validator number(double lo, bool strict) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", lo);
  const std::string range = std::string(strict ? "> " : ">= ") + buf;
  return CLI::Validator(
      [lo, strict, range](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || std::isnan(v) || (strict ? v <= lo : v < lo))
          return "must be a number " + range + ", got '" + s + "'";
        if (std::fabs(v) > FLT_MAX)
          return "is out of range for a float (at most 3.4e38), got '" + s + "'";
        return {};
      },
      "(" + range + ")");
}

// A path or name that must not be empty (`--metrics ''` would otherwise silently do nothing).
inline CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& s) -> std::string { return s.empty() ? "must not be empty; give a value or leave the flag out" : std::string(); }, "");
}

// An unsigned 64-bit whole number (seeds).
inline CLI::Validator seed() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        std::strtoull(s.c_str(), &end, 10);
        if (s.empty() || s[0] == '-' || *end != '\0' || errno == ERANGE)
          return "must be a whole number from 0 to 18446744073709551615, got '" + s + "'";
        return {};
      },
      "(0 to 2^64-1)");
}

}  // namespace zt_cli
