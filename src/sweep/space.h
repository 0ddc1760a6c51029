// A sweep's search space (which train flags vary, over which values) and the trials drawn from it:
// the full grid of lists, or seeded random draws that are the same on every machine.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace zt::sweep {

struct Dimension {
  enum class Kind { kList, kLog, kLinear, kInt };
  std::string flag;                 // a train flag's long name without "--", e.g. "lr", "warmup-steps"
  Kind kind = Kind::kList;
  std::vector<std::string> values;  // kList: the values as written
  double lo = 0, hi = 0;            // ranges: lo..hi inclusive
};

// "list", "log", "lin" or "int": the kind as a spec writes it.
const char* dimension_kind_name(Dimension::Kind kind);

struct SearchSpace {
  std::vector<Dimension> dims;
  bool is_grid() const;  // every dimension a list
  // Trials in the full grid (the product of the lists' sizes, saturating at INT64_MAX); 0 when a
  // dimension is a range.
  int64_t grid_size() const;
};

// The most trials generate_trials makes (a grid's product or --trials): more is a mistake, not a
// sweep to start.
inline constexpr int64_t kMaxGridTrials = 100000;

// "--space NAME=SPEC" texts: "lr=1e-3,3e-4", "lr=log:1e-4..1e-2", "lr=lin:0.1..0.5",
// "warmup-steps=int:0..200". JSON file (--space-file): {"lr": [1e-3, 3e-4], "warmup-steps":
// "int:0..200", "embd": [128, 256]} (a list or a spec string per flag). Throws
// zt::Error(kInvalidArgument) with one sentence: malformed spec, empty list or range (lo > hi,
// log with lo <= 0), a flag given twice, an unknown flag — `known_flags` are the train flags'
// long names; the message suggests the nearest name (core/suggest.h).
//
// Also: a name may be written with its "--"; a list value given twice is refused (it would run
// the same trial twice); a list whose values contain commas (--hidden 256,128) separates them
// with ';' ("hidden=256,128;512"), or the JSON file lists them as strings; int bounds are whole
// numbers within +-2^53; an empty space (no specs, no file) is refused; in the file a lone number
// or boolean is a list of that one value ({"layers": 4}). Dimensions come in the
// order given: the --space texts first, then the file's keys in the file's order. `known_flags`
// may be written with or without their "--".
SearchSpace parse_space(const std::vector<std::string>& specs, const std::string& space_file,
                        const std::vector<std::string>& known_flags);

struct TrialValues {
  int id = 0;  // 0-based; trial directory trial-%03d
  std::vector<std::pair<std::string, std::string>> values;  // (flag, value text), in dims order
};

// Grid (trials == 0 and is_grid(): the full cartesian product, first dimension slowest) or random
// search (trials > 0: `trials` draws, seeded, the same list for the same seed on any machine —
// use core/philox.h or a fixed-algorithm generator, not std::uniform_*_distribution whose output
// is implementation-defined). Integers as "%d", reals printed with enough digits to round-trip
// ("%.9g"). Throws kInvalidArgument if trials == 0 and a dimension is a range.
//
// Random draws: each dimension draws from its own Philox stream (named by its flag) at index =
// trial id, so adding a dimension or more trials never changes the values other trials get. A log
// range is uniform in log(value), a lin range uniform in value, an int range uniform over its
// integers, a list uniform over its values (draws may repeat). Also throws kInvalidArgument for
// trials < 0 and for more than kMaxGridTrials trials (grid or random).
std::vector<TrialValues> generate_trials(const SearchSpace& space, int trials, uint64_t seed);

// The texts to validate a dimension with before any trial starts ("a value outside the flag's own
// range"): a list's values, or a range's two bounds printed as a trial's values are. Every value a
// trial can get lies between the bounds, so checking them covers a flag whose valid values are an
// interval.
std::vector<std::string> probe_values(const Dimension& dim);

}  // namespace zt::sweep
