// --config FILE and --print-config (apps/config_file.h): TOML through toml++, JSON through
// nlohmann-json, both reduced to one tree of (key, value) pairs that is checked against the
// subcommand's options and turned into "--name=value" arguments.
#include "config_file.h"

#include <toml++/toml.h>

#include <charconv>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <variant>

#include "core/files.h"
#include "core/status.h"
#include "core/suggest.h"

namespace zt {

namespace {

constexpr uint64_t kMaxConfigBytes = uint64_t{1} << 20;  // a config file is a page of flags, not data

// What an option takes, from CLI11's description of it.
enum class Kind { kFlag, kList, kInt, kUint, kFloat, kText };

Kind option_kind(const CLI::Option& o) {
  if (o.get_expected_max() == 0) return Kind::kFlag;  // CLI11's add_flag: expects no value
  if (o.get_expected_max() > 1) return Kind::kList;
  std::string t = o.get_type_name();
  t = t.substr(0, t.find(':'));
  if (t == "INT") return Kind::kInt;
  if (t == "UINT") return Kind::kUint;
  if (t == "FLOAT") return Kind::kFloat;
  return Kind::kText;
}

// One value of the file, whichever format it came from.
struct Value {
  enum class Type { kBool, kInt, kFloat, kString, kList, kTable } type;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<Value> items;        // kList: the items; kTable: the values of `keys`, in file order
  std::vector<std::string> keys;  // kTable
};

const char* type_words(Value::Type t) {
  switch (t) {
    case Value::Type::kBool: return "true or false";
    case Value::Type::kInt: return "an integer";
    case Value::Type::kFloat: return "a number with a fraction";
    case Value::Type::kString: return "a string";
    case Value::Type::kList: return "a list";
    case Value::Type::kTable: return "a table";
  }
  return "a value";
}

Value from_toml(const toml::node& n) {
  Value v;
  if (const auto* t = n.as_table()) {
    v.type = Value::Type::kTable;
    for (const auto& [k, child] : *t) v.keys.emplace_back(k.str()), v.items.push_back(from_toml(child));
  } else if (const auto* a = n.as_array()) {
    v.type = Value::Type::kList;
    for (const auto& child : *a) v.items.push_back(from_toml(child));
  } else if (const auto* s = n.as_string()) {
    v.type = Value::Type::kString, v.s = s->get();
  } else if (const auto* i = n.as_integer()) {
    v.type = Value::Type::kInt, v.i = i->get();
  } else if (const auto* f = n.as_floating_point()) {
    v.type = Value::Type::kFloat, v.f = f->get();
  } else if (const auto* b = n.as_boolean()) {
    v.type = Value::Type::kBool, v.b = b->get();
  } else {
    ZT_THROW(ErrorKind::kInvalidArgument, "--config: a date or time (line ", n.source().begin.line,
             ") is no flag's value; write it as a string");
  }
  return v;
}

Value from_json(const nlohmann::json& j, const std::string& path) {
  Value v;
  if (j.is_object()) {
    v.type = Value::Type::kTable;
    for (const auto& [k, child] : j.items()) v.keys.push_back(k), v.items.push_back(from_json(child, path));
  } else if (j.is_array()) {
    v.type = Value::Type::kList;
    for (const auto& child : j) v.items.push_back(from_json(child, path));
  } else if (j.is_string()) {
    v.type = Value::Type::kString, v.s = j.get<std::string>();
  } else if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) v.type = Value::Type::kString, v.s = std::to_string(u);
    else v.type = Value::Type::kInt, v.i = static_cast<int64_t>(u);
  } else if (j.is_number_integer()) {
    v.type = Value::Type::kInt, v.i = j.get<int64_t>();
  } else if (j.is_number_float()) {
    v.type = Value::Type::kFloat, v.f = j.get<double>();
  } else if (j.is_boolean()) {
    v.type = Value::Type::kBool, v.b = j.get<bool>();
  } else {
    ZT_THROW(ErrorKind::kInvalidArgument, "--config ", path, ": null is not a value; give the flag's value or leave the key out");
  }
  return v;
}

// The shortest text that reads back as the same double (so 1e-3 stays "0.001").
std::string number_text(double d) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d);
  return std::string(buf, r.ptr);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

Value parse_file(const std::string& path) {
  const bool json = ends_with(path, ".json"), toml_file = ends_with(path, ".toml");
  ZT_REQUIRE(json || toml_file, "--config ", path, ": the file must end in .toml or .json (its format)");
  const std::vector<uint8_t> bytes = InputFile::open(path, "config file").read_all(kMaxConfigBytes);
  const std::string text(bytes.begin(), bytes.end());
  if (json) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      ZT_THROW(ErrorKind::kInvalidArgument, "--config ", path, " is not valid JSON (", e.what(), ")");
    }
    ZT_REQUIRE(j.is_object(), "--config ", path, " must hold one JSON object of flag names and values");
    return from_json(j, path);
  }
  try {
    return from_toml(toml::parse(text, path));
  } catch (const toml::parse_error& e) {
    ZT_THROW(ErrorKind::kInvalidArgument, "--config ", path, " is not valid TOML: ", std::string(e.description()),
             " (line ", e.source().begin.line, ", column ", e.source().begin.column, ")");
  }
}

// The text of one scalar value for an option of `kind`; throws naming the key.
std::string scalar_text(const Value& v, Kind kind, const std::string& where) {
  auto wrong = [&](const char* want) {
    ZT_THROW(ErrorKind::kInvalidArgument, where, " must be ", want, ", not ", type_words(v.type));
  };
  switch (kind) {
    case Kind::kInt:
      if (v.type != Value::Type::kInt) wrong("a whole number");
      return std::to_string(v.i);
    case Kind::kUint:
      // Seeds reach 2^64 - 1, beyond TOML's 64-bit signed integers: a string of digits too.
      if (v.type == Value::Type::kString && !v.s.empty() && v.s.find_first_not_of("0123456789") == std::string::npos)
        return v.s;
      if (v.type != Value::Type::kInt) wrong("a whole number");
      return std::to_string(v.i);
    case Kind::kFloat:
      if (v.type == Value::Type::kInt) return std::to_string(v.i);
      if (v.type != Value::Type::kFloat) wrong("a number");
      return number_text(v.f);
    case Kind::kText:
    case Kind::kList:
      if (v.type == Value::Type::kString) {
        ZT_REQUIRE(!v.s.empty(), where, " is empty; give a value or leave the key out");
        return v.s;
      }
      if (v.type == Value::Type::kInt) return std::to_string(v.i);
      if (v.type == Value::Type::kFloat) return number_text(v.f);
      wrong("a string");
    case Kind::kFlag:
      break;
  }
  wrong("a value");
  return {};
}

std::string normalized(std::string key) {
  for (char& c : key)
    if (c == '_') c = '-';
  return key;
}

}  // namespace

void add_config_option(CLI::App& sub) {
  sub.add_option("--config", "A TOML or JSON file of flags (the flag names as keys, e.g. steps = 400); flags given "
                             "on the command line override it")
      ->type_name("FILE");
}

std::string config_path(const std::vector<std::string>& args) {
  std::string path;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--") break;
    if (args[i] == "--config" && i + 1 < args.size()) path = args[++i];
    else if (args[i].rfind("--config=", 0) == 0) path = args[i].substr(9);
  }
  return path;
}

std::vector<std::string> config_arguments(const CLI::App& sub, const std::string& path,
                                          const std::vector<std::string>& cli_args) {
  const Value root = parse_file(path);
  std::vector<std::string> names;  // every long name, for suggestions
  for (const CLI::Option* o : sub.get_options())
    for (const std::string& n : o->get_lnames())
      if (n != "help" && n != "config") names.push_back(n);
  // Flattened: top-level keys and those of one level of sections.
  std::vector<std::pair<std::string, const Value*>> entries;
  for (size_t i = 0; i < root.keys.size(); ++i) {
    const std::string& k = root.keys[i];
    const Value& v = root.items[i];
    if (v.type != Value::Type::kTable) {
      entries.emplace_back(k, &v);
      continue;
    }
    for (size_t i2 = 0; i2 < v.keys.size(); ++i2) {
      const std::string& k2 = v.keys[i2];
      const Value& v2 = v.items[i2];
      ZT_REQUIRE(v2.type != Value::Type::kTable, "--config ", path, ": [", k, ".", k2,
                 "] nests a table in a section; sections only group flags (one level)");
      entries.emplace_back(k2, &v2);
    }
  }
  std::vector<std::string> args;
  std::set<const CLI::Option*> seen;
  for (const auto& [raw_key, v] : entries) {
    const std::string key = normalized(raw_key);
    const std::string where = "--config " + path + ": " + raw_key;
    ZT_REQUIRE(key != "config", "--config ", path, ": a config file cannot name another (key 'config')");
    const CLI::Option* o = key == "help" ? nullptr : sub.get_option_no_throw("--" + key);
    if (!o) {
      const auto near = nearest_name(key, names);
      ZT_THROW(ErrorKind::kInvalidArgument, "--config ", path, ": unknown key '", raw_key, "', not a ", sub.get_name(),
               " flag", near ? "; did you mean '" + *near + "'?" : std::string());
    }
    ZT_REQUIRE(seen.insert(o).second, "--config ", path, ": '", raw_key, "' sets --", o->get_lnames()[0],
               " a second time");
    const Kind kind = option_kind(*o);
    const std::string flag = "--" + key;
    if (kind == Kind::kFlag) {
      ZT_REQUIRE(v->type == Value::Type::kBool, where, " must be true or false, not ", type_words(v->type));
      args.push_back(v->b ? flag : flag + "=false");
      continue;
    }
    if (kind == Kind::kList) {
      // The command line's list replaces the file's (the file is the base a run overrides).
      bool on_cli = false;
      for (const std::string& a : cli_args)
        for (const std::string& n : o->get_lnames())
          on_cli = on_cli || a == "--" + n || a.rfind("--" + n + "=", 0) == 0;
      if (on_cli) continue;
      if (v->type == Value::Type::kList) {
        for (const Value& item : v->items) args.push_back(flag + "=" + scalar_text(item, kind, where));
      } else {
        args.push_back(flag + "=" + scalar_text(*v, kind, where));
      }
      continue;
    }
    ZT_REQUIRE(v->type != Value::Type::kList, where, " takes one value, not a list");
    args.push_back(flag + "=" + scalar_text(*v, kind, where));
  }
  return args;
}

namespace {

std::string toml_string(const std::string& s) {
  std::ostringstream out;
  out << toml::value<std::string>(s);
  return out.str();
}

// A value of an option as TOML: a number when the option is one and the text is one, else a
// string (a seed beyond 2^63, a SIZE, a name).
std::string toml_value(const std::string& text, Kind kind) {
  char* end = nullptr;
  if (kind == Kind::kInt || kind == Kind::kUint) {
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (!text.empty() && *end == '\0' && errno == 0) return std::to_string(v);
  } else if (kind == Kind::kFloat) {
    const double v = std::strtod(text.c_str(), &end);
    if (!text.empty() && *end == '\0' && std::isfinite(v)) {
      std::string t = number_text(v);
      // TOML reads "3" as an integer, which a float flag accepts too; keep it readable as is.
      return t;
    }
  }
  return toml_string(text);
}

}  // namespace

std::string format_config(const CLI::App& sub, const std::set<std::string>& skip,
                          const std::vector<std::string>& auto_values) {
  std::string out = "# zerotrain " + sub.get_name() +
                    ": the flags of this run; `zerotrain " + sub.get_name() +
                    " --config FILE` runs it again (flags given after it override the file).\n";
  std::string not_given, not_applying;
  for (const CLI::Option* o : sub.get_options()) {
    if (o->get_lnames().empty()) continue;
    const std::string name = o->get_lnames()[0];
    if (name == "help" || name == "config" || name == "print-config") continue;
    if (skip.count(name)) {
      not_applying += (not_applying.empty() ? "" : ", ") + name;
      continue;
    }
    const Kind kind = option_kind(*o);
    if (kind == Kind::kFlag) {
      if (o->count() == 0) {
        not_given += (not_given.empty() ? "" : ", ") + name;
        continue;
      }
      out += name + " = " + (o->as<bool>() ? "true" : "false") + "\n";
      continue;
    }
    if (kind == Kind::kList) {
      if (o->count() == 0) {
        not_given += (not_given.empty() ? "" : ", ") + name;
        continue;
      }
      std::string items;
      for (const std::string& r : o->results()) items += (items.empty() ? "" : ", ") + toml_string(r);
      out += name + " = [" + items + "]\n";
      continue;
    }
    std::string text;
    if (o->count() > 0) text = o->reduced_results().back();
    else text = o->get_default_str();
    if (text.empty()) {
      bool resolved = false;
      for (const std::string& line : auto_values) resolved = resolved || line.rfind(name + " = ", 0) == 0;
      if (!resolved) not_given += (not_given.empty() ? "" : ", ") + name;
      continue;
    }
    out += name + " = " + toml_value(text, kind) + "\n";
  }
  if (!auto_values.empty()) {
    out += "# resolved by the run from the flags above (automatic defaults, not read back):\n";
    for (const std::string& line : auto_values) out += "#   " + line + "\n";
  }
  if (!not_given.empty()) out += "# not given (their defaults apply): " + not_given + "\n";
  if (!not_applying.empty()) out += "# not applying to this run (left out): " + not_applying + "\n";
  return out;
}

}  // namespace zt
