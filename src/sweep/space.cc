// Parsing --space / --space-file into a SearchSpace, and expanding it into trials (grid or
// seeded random draws). Every user mistake is one sentence naming the spec it came from.
#include "sweep/space.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include <nlohmann/json.hpp>

#include "core/files.h"
#include "core/philox.h"
#include "core/status.h"
#include "core/suggest.h"

namespace zt::sweep {
namespace {

using Kind = Dimension::Kind;

// Integers beyond this are not exact in a double (Dimension::lo/hi).
constexpr double kMaxExactInt = 9007199254740992.0;  // 2^53
// A space file is a few lines; anything near this is not one.
constexpr uint64_t kMaxSpaceFileBytes = 1 << 20;
const std::string kSpecExamples = "e.g. lr=1e-3,3e-4, lr=log:1e-4..1e-2, lr=lin:0.1..0.5 or warmup-steps=int:0..200";

[[noreturn]] void invalid(const std::string& sentence) { ZT_THROW(ErrorKind::kInvalidArgument, sentence); }

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

bool parse_double(const std::string& text, double& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && errno != ERANGE && std::isfinite(out);
}

// Reads "A..B" of a range spec; `where` opens every sentence ("--space 'lr=log:1..x'").
void parse_range(const std::string& body, Kind kind, const std::string& where, Dimension& dim) {
  const size_t dots = body.find("..");
  if (dots == std::string::npos)
    invalid(where + " is malformed: a range is written LO..HI (" + kSpecExamples + ").");
  const std::string lo_text = trim(body.substr(0, dots)), hi_text = trim(body.substr(dots + 2));
  if (!parse_double(lo_text, dim.lo) || !parse_double(hi_text, dim.hi))
    invalid(where + " is malformed: the bounds of a range must be finite numbers (" + kSpecExamples + ").");
  if (kind == Kind::kInt) {
    for (const double v : {dim.lo, dim.hi})
      if (v != std::floor(v) || std::fabs(v) > kMaxExactInt)
        invalid(where + " has a bound that is not a whole number; an int range is written like int:0..200.");
  }
  if (dim.lo > dim.hi) invalid(where + " is an empty range: its low bound is above its high bound.");
  if (kind == Kind::kLog && dim.lo <= 0)
    invalid(where + " is not a valid log range: both bounds must be above 0.");
}

// The list part of a spec: values separated by ',' (or by ';' when any is present, for values
// that contain commas).
std::vector<std::string> split_list(const std::string& body) {
  const char sep = body.find(';') != std::string::npos ? ';' : ',';
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t end = body.find(sep, pos);
    out.push_back(trim(body.substr(pos, end == std::string::npos ? std::string::npos : end - pos)));
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return out;
}

void check_list(const std::string& where, const std::vector<std::string>& values) {
  if (values.empty() || (values.size() == 1 && values[0].empty()))
    invalid(where + " is an empty list: give at least one value (" + kSpecExamples + ").");
  std::set<std::string> seen;
  for (const std::string& v : values) {
    if (v.empty()) invalid(where + " is malformed: it has an empty value between separators.");
    if (!seen.insert(v).second) invalid(where + " lists the value '" + v + "' twice.");
  }
}

// SPEC after "NAME=": a range with a kind prefix, else a list.
void parse_spec_body(const std::string& body, const std::string& where, Dimension& dim) {
  static const std::pair<const char*, Kind> kPrefixes[] = {{"log:", Kind::kLog}, {"lin:", Kind::kLinear},
                                                           {"int:", Kind::kInt}};
  for (const auto& [prefix, kind] : kPrefixes) {
    if (body.rfind(prefix, 0) == 0) {
      dim.kind = kind;
      parse_range(body.substr(std::string(prefix).size()), kind, where, dim);
      return;
    }
  }
  // "1e-4..1e-2" or "exp:1..2" is a range with a missing or unknown kind, not a one-value list
  // (list values may contain ".." or ':' themselves: data=../a.txt, devices=cpu:2).
  const size_t dots = body.find("..");
  if (dots != std::string::npos && body.find_first_of(",;") == std::string::npos) {
    const size_t colon = body.find(':');
    const std::string kind = colon == std::string::npos ? "" : body.substr(0, colon);
    const std::string range = colon == std::string::npos ? body : body.substr(colon + 1);
    const size_t rdots = range.find("..");
    double a, b;
    const bool numeric = rdots != std::string::npos && parse_double(trim(range.substr(0, rdots)), a) &&
                         parse_double(trim(range.substr(rdots + 2)), b);
    if (numeric && kind.empty())
      invalid(where + " is malformed: a range needs its kind, log:, lin: or int: (" + kSpecExamples + ").");
    if (numeric && std::all_of(kind.begin(), kind.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); }))
      invalid(where + " is malformed: '" + kind + ":' is not a range kind; use log:, lin: or int:.");
  }
  dim.kind = Kind::kList;
  dim.values = split_list(body);
  check_list(where, dim.values);
}

// A swept flag's name: a train flag, written with or without its "--", never twice.
std::string checked_flag(std::string name, const std::string& where, const std::vector<std::string>& known_flags,
                         const std::vector<Dimension>& dims) {
  if (name.rfind("--", 0) == 0) name = name.substr(2);
  if (name.empty()) invalid(where + " is malformed: it names no flag (" + kSpecExamples + ").");
  if (std::find(known_flags.begin(), known_flags.end(), name) == known_flags.end()) {
    const auto near = nearest_name(name, known_flags);
    invalid(where + " names '" + name + "', which is not a train flag" +
            (near ? "; did you mean '" + *near + "'?" : "."));
  }
  for (const Dimension& d : dims)
    if (d.flag == name) invalid("The flag '" + name + "' is given twice in the search space.");
  return name;
}

// A JSON list element as flag text: strings as written, numbers in their shortest exact form.
std::string json_value_text(const nlohmann::ordered_json& v, const std::string& where) {
  if (v.is_string()) return trim(v.get<std::string>());
  if (v.is_number_integer() || v.is_number_unsigned() || v.is_number_float() || v.is_boolean()) return v.dump();
  invalid(where + " has a value that is not a number, string or boolean.");
}

void parse_space_file(const std::string& path, const std::vector<std::string>& known_flags,
                      std::vector<Dimension>& dims) {
  const std::vector<uint8_t> bytes = InputFile::open(path, "space file").read_all(kMaxSpaceFileBytes);
  const auto* text = reinterpret_cast<const char*>(bytes.data());
  using json = nlohmann::ordered_json;
  // Duplicate keys would silently keep only one value: refuse them.
  std::set<std::string> keys;
  std::string duplicate;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && duplicate.empty() && parsed.is_string() &&
        !keys.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json root;
  try {
    root = json::parse(text, text + bytes.size(), on_event);
  } catch (const json::exception&) {
    invalid("The space file " + path + " is not valid JSON; write it like {\"lr\": [1e-3, 3e-4], \"warmup-steps\": \"int:0..200\"}.");
  }
  if (!root.is_object())
    invalid("The space file " + path + " is not a JSON object of flag names, like {\"lr\": [1e-3, 3e-4]}.");
  if (!duplicate.empty()) invalid("The flag '" + duplicate + "' is given twice in the space file " + path + ".");
  for (const auto& [key, value] : root.items()) {
    const std::string where = "The space file's entry '" + key + "'";
    Dimension dim;
    dim.flag = checked_flag(key, "The space file " + path, known_flags, dims);
    if (value.is_array()) {
      dim.kind = Kind::kList;
      for (const json& v : value) dim.values.push_back(json_value_text(v, where));
      check_list(where, dim.values);
    } else if (value.is_string()) {
      parse_spec_body(trim(value.get<std::string>()), where, dim);
    } else if (value.is_number() || value.is_boolean()) {
      dim.values = {json_value_text(value, where)};  // one value: every trial gets it
    } else {
      invalid(where + " is malformed: give a list of values or a spec string such as \"log:1e-4..1e-2\".");
    }
    dims.push_back(std::move(dim));
  }
}

std::string format_real(double v, double lo, double hi) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  // Nine digits can round a value just inside a bound with more digits to just outside it.
  const double back = std::strtod(buf, nullptr);
  if (back < lo || back > hi) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string format_int(int64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  return buf;
}

// Uniform in [0, 1) with 53 random bits: two Philox words at (seed, stream, 2 * index + {0, 1}).
double uniform53(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t hi = philox_u32(seed, stream, 2 * index), lo = philox_u32(seed, stream, 2 * index + 1);
  return static_cast<double>(((hi << 32) | lo) >> 11) * 0x1.0p-53;
}

std::string draw(const Dimension& d, uint64_t seed, uint64_t trial) {
  const double u = uniform53(seed, fnv1a("zt/sweep/space/" + d.flag), trial);
  switch (d.kind) {
    case Kind::kList: {
      const size_t n = d.values.size();
      return d.values[std::min(n - 1, static_cast<size_t>(u * static_cast<double>(n)))];
    }
    case Kind::kInt: {
      const double count = d.hi - d.lo + 1;  // exact: both bounds are integers within 2^53
      return format_int(static_cast<int64_t>(std::min(d.hi, d.lo + std::floor(u * count))));
    }
    case Kind::kLinear:
      return format_real(std::clamp(d.lo + u * (d.hi - d.lo), d.lo, d.hi), d.lo, d.hi);
    case Kind::kLog: {
      const double l = std::log(d.lo), h = std::log(d.hi);
      return format_real(std::clamp(std::exp(l + u * (h - l)), d.lo, d.hi), d.lo, d.hi);
    }
  }
  ZT_CHECK(false, "unknown dimension kind");
  return "";
}

}  // namespace

const char* dimension_kind_name(Dimension::Kind kind) {
  switch (kind) {
    case Kind::kList: return "list";
    case Kind::kLog: return "log";
    case Kind::kLinear: return "lin";
    case Kind::kInt: return "int";
  }
  return "?";
}

bool SearchSpace::is_grid() const {
  return std::all_of(dims.begin(), dims.end(), [](const Dimension& d) { return d.kind == Kind::kList; });
}

int64_t SearchSpace::grid_size() const {
  if (!is_grid()) return 0;
  int64_t n = 1;
  for (const Dimension& d : dims) {
    const auto k = static_cast<int64_t>(d.values.size());
    n = (k != 0 && n > INT64_MAX / k) ? INT64_MAX : n * k;
  }
  return n;
}

SearchSpace parse_space(const std::vector<std::string>& specs, const std::string& space_file,
                        const std::vector<std::string>& flags_as_given) {
  std::vector<std::string> known_flags;
  for (const std::string& f : flags_as_given) known_flags.push_back(f.rfind("--", 0) == 0 ? f.substr(2) : f);
  SearchSpace space;
  for (const std::string& spec : specs) {
    const std::string where = "--space '" + spec + "'";
    const size_t eq = spec.find('=');
    if (eq == std::string::npos)
      invalid(where + " is malformed: write NAME=SPEC, " + kSpecExamples + ".");
    Dimension dim;
    dim.flag = checked_flag(trim(spec.substr(0, eq)), where, known_flags, space.dims);
    parse_spec_body(trim(spec.substr(eq + 1)), where, dim);
    space.dims.push_back(std::move(dim));
  }
  if (!space_file.empty()) parse_space_file(space_file, known_flags, space.dims);
  if (space.dims.empty())
    invalid("A sweep needs a search space: give --space NAME=SPEC (" + kSpecExamples + ") or --space-file FILE.");
  return space;
}

std::vector<TrialValues> generate_trials(const SearchSpace& space, int trials, uint64_t seed) {
  if (trials < 0) invalid("--trials must be 0 (the grid of every list) or a positive number of random draws.");
  std::vector<TrialValues> out;
  if (trials == 0) {
    for (const Dimension& d : space.dims)
      if (d.kind != Kind::kList)
        invalid("The search space's '" + d.flag + "' is a " + dimension_kind_name(d.kind) +
                " range, which only random search can draw from: give --trials N.");
    const int64_t n = space.grid_size();
    if (n > kMaxGridTrials)
      invalid("The grid has " + (n == INT64_MAX ? std::string("too many") : std::to_string(n)) +
              " trials, more than the " + std::to_string(kMaxGridTrials) +
              " a sweep runs; shorten the lists or give --trials N for random search.");
    out.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      TrialValues& t = out[static_cast<size_t>(i)];
      t.id = static_cast<int>(i);
      // Mixed-radix digits of i, the last dimension fastest.
      int64_t rest = i;
      t.values.resize(space.dims.size());
      for (size_t j = space.dims.size(); j-- > 0;) {
        const Dimension& d = space.dims[j];
        const auto k = static_cast<int64_t>(d.values.size());
        t.values[j] = {d.flag, d.values[static_cast<size_t>(rest % k)]};
        rest /= k;
      }
    }
    return out;
  }
  if (trials > kMaxGridTrials)
    invalid("--trials " + std::to_string(trials) + " is more than the " + std::to_string(kMaxGridTrials) +
            " trials a sweep runs.");
  out.resize(static_cast<size_t>(trials));
  for (int i = 0; i < trials; ++i) {
    out[static_cast<size_t>(i)].id = i;
    for (const Dimension& d : space.dims)
      out[static_cast<size_t>(i)].values.emplace_back(d.flag, draw(d, seed, static_cast<uint64_t>(i)));
  }
  return out;
}

std::vector<std::string> probe_values(const Dimension& dim) {
  switch (dim.kind) {
    case Kind::kList: return dim.values;
    case Kind::kInt: return {format_int(static_cast<int64_t>(dim.lo)), format_int(static_cast<int64_t>(dim.hi))};
    case Kind::kLog:
    case Kind::kLinear: return {format_real(dim.lo, dim.lo, dim.hi), format_real(dim.hi, dim.lo, dim.hi)};
  }
  return {};
}

}  // namespace zt::sweep
