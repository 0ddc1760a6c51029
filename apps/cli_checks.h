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
#include <vector>

namespace zt_cli {

// A whole number in [lo, hi] (hi defaults to INT_MAX, the range of the int flags). A value above
// hi is refused with the real limit ("at most 2147483647, the largest count this flag holds"),
// not with the lower bound alone.
inline CLI::Validator whole(long long lo, long long hi = INT_MAX) {
  const std::string range = hi == INT_MAX ? ">= " + std::to_string(lo)
                                          : "from " + std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        const bool digits = !s.empty() && *end == '\0';
        if (digits && (errno == ERANGE ? s[0] != '-' : v > hi) && hi == INT_MAX)
          return "must be at most " + std::to_string(hi) + " (the largest count this flag holds, a 32-bit integer), got '" +
                 s + "'";
        if (!digits || errno == ERANGE || v < lo || v > hi)
          return "must be a whole number " + range + ", got '" + s + "'";
        return {};
      },
      "(" + range + ")");
}

// Seconds that the run turns into a std::chrono deadline: milliseconds (so at least 0.001 s, or
// the timeout would round to 0 and fire at once) added to a 64-bit nanosecond clock (so at most
// 1e9 s, about 31 years: 1e10 s would overflow the deadline into the past).
inline constexpr double kMinSeconds = 0.001, kMaxSeconds = 1e9;
inline CLI::Validator seconds() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || !std::isfinite(v) || v < kMinSeconds)
          return "must be a number of seconds from 0.001 (one millisecond, the unit the timeout counts in) to 1e9, got '" +
                 s + "'";
        if (v > kMaxSeconds)
          return "must be at most 1e9 seconds (about 31 years; a longer timeout overflows the 64-bit nanosecond clock "
                 "its deadline is counted on), got '" + s + "'";
        return {};
      },
      "(0.001 to 1e9)");
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

// Applied to a whole CLI::App after every option is defined (apps/zerotrain.cc, the sweep's
// re-parse, the CLI fuzzer), so that flags added later get them without a line of their own:
// a scalar option (and a flag) given twice takes its last value (`$BASE --steps 400` overrides
// the --steps in $BASE, as argparse and torchrun do); options that collect values (--inject-fault)
// keep every one.
inline void harden(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    // A flag expects 0 values, a scalar 1, a list option (std::vector) many.
    if (o->get_expected_max() <= 1) o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) harden(*sub);
}

// CLI11 reads `--metrics= --quiet` (an empty value after '=') as `--metrics --quiet`: the next
// argument becomes the value, a file named "--quiet" is written and --quiet is lost. Returns the
// sentence refusing the first such argument of `args` (empty when there is none); arguments after
// a bare "--" are values, not flags.
inline std::string empty_assignment(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--") break;
    if (a.size() > 3 && a.rfind("--", 0) == 0 && a.back() == '=' && a.find('=') == a.size() - 1)
      return a + " has an empty value; give one after the '=' (" + a + "VALUE) or leave the flag out";
  }
  return {};
}

}  // namespace zt_cli
