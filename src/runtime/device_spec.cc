// The one parser of device selections (--devices, ZT_CPU_DEVICES).
#include <charconv>
#include <cstdlib>
#include <set>

#include "core/status.h"
#include "runtime/runtime.h"

namespace zt {

namespace {

constexpr int kMaxLogicalDevices = 64;
constexpr const char* kGrammar = "expected all, cpu, cpu:N, cuda, cuda:0,1,3 or cuda:0x4";

// Parses a non-negative decimal integer that must consume the whole string.
bool parse_int(std::string_view s, int& out) {
  if (s.empty() || s.size() > 6) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

[[noreturn]] void bad_spec(std::string_view text, const std::string& why) {
  ZT_THROW(ErrorKind::kInvalidArgument, "invalid device selection '", text, "': ", why, " (",
           kGrammar, ")");
}

}  // namespace

DeviceSpec parse_device_spec(std::string_view text) {
  DeviceSpec spec;
  spec.text = std::string(text);
  if (text == "all") {
    spec.kind = DeviceSpec::Kind::kAll;
    return spec;
  }
  const size_t colon = text.find(':');
  const std::string_view kind = text.substr(0, colon);
  const bool has_arg = colon != std::string_view::npos;
  const std::string_view arg = has_arg ? text.substr(colon + 1) : std::string_view{};
  if (has_arg && arg.empty()) bad_spec(text, "nothing after ':'");

  if (kind == "cpu") {
    spec.kind = DeviceSpec::Kind::kCpu;
    if (!has_arg) return spec;
    int n = 0;
    if (!parse_int(arg, n)) bad_spec(text, "'" + std::string(arg) + "' is not a device count");
    if (n < 1 || n > kMaxLogicalDevices)
      bad_spec(text, "the device count must be between 1 and " + std::to_string(kMaxLogicalDevices));
    spec.cpu_count = n;
    return spec;
  }
  if (kind == "cuda") {
    spec.kind = DeviceSpec::Kind::kCuda;
    if (!has_arg) return spec;
    std::set<int> seen;
    size_t start = 0;
    while (start <= arg.size()) {
      const size_t comma = arg.find(',', start);
      const std::string_view item =
          arg.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
      if (item.empty()) bad_spec(text, "empty entry in the GPU list");
      const size_t x = item.find('x');
      int ordinal = 0, count = 1;
      if (!parse_int(item.substr(0, x), ordinal))
        bad_spec(text, "'" + std::string(item) + "' is not a GPU ordinal");
      if (x != std::string_view::npos) {
        if (!parse_int(item.substr(x + 1), count) || count < 1)
          bad_spec(text, "'" + std::string(item) + "' needs a positive count after 'x'");
      }
      if (!seen.insert(ordinal).second)
        bad_spec(text, "GPU " + std::to_string(ordinal) +
                           " is listed twice; use " + std::to_string(ordinal) +
                           "xN for N logical devices on one GPU");
      for (int i = 0; i < count; ++i) spec.cuda_ordinals.push_back(ordinal);
      if (static_cast<int>(spec.cuda_ordinals.size()) > kMaxLogicalDevices)
        bad_spec(text, "at most " + std::to_string(kMaxLogicalDevices) + " logical devices");
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    return spec;
  }
  bad_spec(text, "unknown device kind '" + std::string(kind) + "'");
}

int default_cpu_device_count() {
  const char* env = std::getenv("ZT_CPU_DEVICES");
  if (!env || !*env) return 2;
  int n = 0;
  if (!parse_int(env, n) || n < 1 || n > kMaxLogicalDevices)
    ZT_THROW(ErrorKind::kInvalidArgument, "ZT_CPU_DEVICES='", env,
             "' is not a device count between 1 and ", kMaxLogicalDevices);
  return n;
}

}  // namespace zt
