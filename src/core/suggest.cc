// Edit distance and nearest-name suggestions for the command line.
#include "core/suggest.h"

#include <algorithm>
#include <numeric>

namespace zt {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  std::iota(prev.begin(), prev.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::optional<std::string> nearest_name(const std::string& given, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, given.size() / 3);
  std::optional<std::string> best;
  size_t best_d = limit + 1;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(given, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

}  // namespace zt
