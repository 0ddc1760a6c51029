// libFuzzer target: checkpoint manifest text -> parse_manifest. Both with the text checksum (what
// a load does) and without it (so mutations reach the schema and range rules). A manifest that
// parses must serialise and parse back to the same arrays and files.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "checkpoint/manifest.h"
#include "core/status.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (const bool verify : {false, true}) {
    zt::Manifest m;
    try {
      m = zt::parse_manifest(text, "fuzz: manifest.json", verify);
    } catch (const zt::Error&) {
      continue;  // refused: the expected outcome for almost every input
    }
    // Accepted: the round trip must hold (a zt::Error here escapes and is reported as a bug).
    const zt::Manifest again = zt::parse_manifest(zt::serialize_manifest(m), "fuzz: round trip", true);
    if (again.step != m.step || again.files.size() != m.files.size() || again.arrays.size() != m.arrays.size())
      __builtin_trap();
    for (size_t a = 0; a < m.arrays.size(); ++a) {
      const zt::ManifestArray& x = m.arrays[a];
      const zt::ManifestArray& y = again.arrays[a];
      if (x.name != y.name || x.numel != y.numel || x.dtype != y.dtype || x.ranges.size() != y.ranges.size())
        __builtin_trap();
      uint64_t covered = 0;
      for (size_t r = 0; r < x.ranges.size(); ++r) {
        if (x.ranges[r].begin != covered || x.ranges[r].offset != y.ranges[r].offset) __builtin_trap();
        covered += x.ranges[r].count;
      }
      if (covered != x.numel) __builtin_trap();
    }
  }
  return 0;
}
