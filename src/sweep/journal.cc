// The sweep directory's records (sweep/journal.h): checksummed journal lines and the owner record.
// Every accessor checks the JSON type first: a damaged file is one sentence, never a type_error.
#include "sweep/journal.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>

#include <xxhash.h>

#include "core/status.h"

namespace zt::sweep {

namespace {

using json = nlohmann::json;

constexpr char kFormatName[] = "zerotrain sweep";

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t hash_of(std::string_view text) { return XXH64(text.data(), text.size(), 0); }

// A record that fails a rule: the caller turns it into one sentence with the file and line.
struct Bad {
  std::string why;
};

const json& field(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) throw Bad{std::string("it has no \"") + key + "\""};
  return *it;
}

int int_field(const json& j, const char* key, int lo, int hi) {
  const json& v = field(j, key);
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    x = u > static_cast<uint64_t>(INT_MAX) ? int64_t{INT_MAX} + 1 : static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    throw Bad{std::string("\"") + key + "\" is not a whole number"};
  }
  if (x < lo || x > hi)
    throw Bad{std::string("\"") + key + "\" is " + std::to_string(x) + ", outside " + std::to_string(lo) + ".." +
              std::to_string(hi)};
  return static_cast<int>(x);
}

std::string string_field(const json& j, const char* key) {
  const json& v = field(j, key);
  if (!v.is_string()) throw Bad{std::string("\"") + key + "\" is not a string"};
  return v.get<std::string>();
}

bool bool_field(const json& j, const char* key) {
  const json& v = field(j, key);
  if (!v.is_boolean()) throw Bad{std::string("\"") + key + "\" is not true or false"};
  return v.get<bool>();
}

// A finite number, or null for none.
std::optional<double> number_field(const json& j, const char* key) {
  const json& v = field(j, key);
  if (v.is_null()) return std::nullopt;
  if (!v.is_number() || !std::isfinite(v.get<double>())) throw Bad{std::string("\"") + key + "\" is not a number"};
  return v.get<double>();
}

json opt_json(const std::optional<double>& v) { return v && std::isfinite(*v) ? json(*v) : json(nullptr); }

std::vector<std::pair<std::string, std::string>> values_from(const json& v) {
  if (!v.is_array()) throw Bad{"\"values\" is not a list"};
  std::vector<std::pair<std::string, std::string>> out;
  for (const json& p : v) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_string() || !p[1].is_string())
      throw Bad{"\"values\" holds something other than [name, value] pairs"};
    out.emplace_back(p[0].get<std::string>(), p[1].get<std::string>());
  }
  return out;
}

json values_json(const std::vector<std::pair<std::string, std::string>>& values) {
  json v = json::array();
  for (const auto& [k, x] : values) v.push_back({k, x});
  return v;
}

JournalRecord record_from(const json& j, int trials) {
  if (!j.is_object()) throw Bad{"it is not a JSON object"};
  JournalRecord r;
  const std::string event = string_field(j, "event");
  r.trial = int_field(j, "trial", 0, trials - 1);
  if (event == "start") {
    r.kind = JournalRecord::Kind::kStart;
  } else if (event == "report") {
    r.kind = JournalRecord::Kind::kReport;
    r.step = int_field(j, "step", 1, INT_MAX);
    r.loss = number_field(j, "loss");
    r.go = bool_field(j, "continue");
  } else if (event == "promote") {
    r.kind = JournalRecord::Kind::kPromote;
    r.step = int_field(j, "step", 1, INT_MAX);
  } else if (event == "result") {
    r.kind = JournalRecord::Kind::kResult;
    TrialOutcome& t = r.result;
    t.id = r.trial;
    t.values = values_from(field(j, "values"));
    const std::string status = string_field(j, "status");
    const auto s = parse_status(status);
    if (!s) throw Bad{"its status \"" + status + "\" is not one of finished, stopped, failed, does not fit"};
    t.status = *s;
    t.reason = string_field(j, "reason");
    t.steps = int_field(j, "steps", 0, INT_MAX);
    t.final_loss = number_field(j, "final_loss");
    t.best_val = number_field(j, "best_val_loss");
    t.last_val = number_field(j, "last_val_loss");
    const json& curve = field(j, "val_curve");
    if (!curve.is_array()) throw Bad{"\"val_curve\" is not a list"};
    for (const json& p : curve) {
      if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number() ||
          !std::isfinite(p[1].get<double>()))
        throw Bad{"\"val_curve\" holds something other than [step, loss] pairs"};
      t.val_curve.emplace_back(static_cast<int>(std::clamp<int64_t>(p[0].get<int64_t>(), 0, INT_MAX)),
                               p[1].get<double>());
    }
    t.resumed = true;
  } else {
    throw Bad{"its event \"" + event + "\" is not one of start, report, promote, result"};
  }
  return r;
}

}  // namespace

const char* status_name(TrialStatus s) {
  switch (s) {
    case TrialStatus::kFinished: return "finished";
    case TrialStatus::kStopped: return "stopped";
    case TrialStatus::kFailed: return "failed";
    case TrialStatus::kDoesNotFit: return "does not fit";
  }
  return "failed";
}

std::optional<TrialStatus> parse_status(std::string_view text) {
  for (TrialStatus s : {TrialStatus::kFinished, TrialStatus::kStopped, TrialStatus::kFailed, TrialStatus::kDoesNotFit})
    if (text == status_name(s)) return s;
  return std::nullopt;
}

json outcome_json(const TrialOutcome& t) {
  json curve = json::array();
  for (const auto& [s, v] : t.val_curve)
    if (std::isfinite(v)) curve.push_back({s, v});
  return {{"trial", t.id},
          {"values", values_json(t.values)},
          {"status", status_name(t.status)},
          {"reason", t.reason},
          {"steps", t.steps},
          {"final_loss", opt_json(t.final_loss)},
          {"best_val_loss", opt_json(t.best_val)},
          {"last_val_loss", opt_json(t.last_val)},
          {"val_curve", curve}};
}

std::string journal_line(const JournalRecord& r) {
  json j;
  switch (r.kind) {
    case JournalRecord::Kind::kStart: j = {{"event", "start"}, {"trial", r.trial}}; break;
    case JournalRecord::Kind::kReport:
      j = {{"event", "report"}, {"trial", r.trial}, {"step", r.step}, {"loss", opt_json(r.loss)}, {"continue", r.go}};
      break;
    case JournalRecord::Kind::kPromote: j = {{"event", "promote"}, {"trial", r.trial}, {"step", r.step}}; break;
    case JournalRecord::Kind::kResult: {
      TrialOutcome t = r.result;
      t.id = r.trial;
      j = outcome_json(t);
      j["event"] = "result";
      break;
    }
  }
  const std::string body = j.dump();
  return hex64(hash_of(body)) + " " + body + "\n";
}

ParsedJournal parse_journal(std::string_view text, int trials, const std::string& what, bool verify) {
  ParsedJournal out;
  size_t at = 0;
  int line_no = 0;
  while (at < text.size()) {
    ++line_no;
    const size_t nl = text.find('\n', at);
    if (nl == std::string_view::npos) {  // no newline: the last append, torn
      out.torn_tail = true;
      break;
    }
    const std::string_view line = text.substr(at, nl - at);
    const bool last = nl + 1 == text.size();
    bool checksum_ok = line.size() > 17 && line[16] == ' ';
    if (checksum_ok && verify) {
      const std::string_view body = line.substr(17);
      checksum_ok = hex64(hash_of(body)) == line.substr(0, 16);
    }
    if (!checksum_ok) {
      if (last) {  // a torn final line (a kill or power loss in the middle of the last append)
        out.torn_tail = true;
        break;
      }
      ZT_THROW(ErrorKind::kInvalidArgument, what, " is damaged at line ", line_no,
               " (its checksum does not match); the sweep directory was changed by something other than "
               "ZeroTrain, so restore it from a copy or start a new --sweep-dir");
    }
    const json j = json::parse(line.substr(17), nullptr, false);
    try {
      if (j.is_discarded()) throw Bad{"it is not JSON"};
      out.records.push_back(record_from(j, trials));
    } catch (const Bad& b) {
      ZT_THROW(ErrorKind::kInvalidArgument, what, " line ", line_no, " is not a record of this sweep (", b.why,
               "); restore the sweep directory from a copy or start a new --sweep-dir");
    }
    at = nl + 1;
    out.valid_bytes = at;
  }
  return out;
}

std::string format_sweep_record(const SweepRecord& r) {
  const json j = {{"format", kFormatName},
                  {"version", kSweepFormatVersion},
                  {"command", r.command},
                  {"identity", r.identity},
                  {"checksum", hex64(hash_of(r.identity.dump()))}};
  return j.dump(2) + "\n";
}

SweepRecord parse_sweep_record(std::string_view text, const std::string& what) {
  const json j = json::parse(text, nullptr, false);
  try {
    if (j.is_discarded() || !j.is_object()) throw Bad{"it is not a JSON object"};
    if (!j.contains("format") && j.contains("command"))
      ZT_THROW(ErrorKind::kInvalidArgument, what, " was written by an older ZeroTrain (before the sweep journal), "
               "whose sweeps cannot be continued; start a new --sweep-dir");
    if (string_field(j, "format") != kFormatName) throw Bad{"its \"format\" is not \"zerotrain sweep\""};
    const int version = int_field(j, "version", 0, INT_MAX);
    if (version != kSweepFormatVersion)
      ZT_THROW(ErrorKind::kInvalidArgument, what, " has format version ", version, ", this ZeroTrain reads version ",
               kSweepFormatVersion, "; use the ZeroTrain that made it or start a new --sweep-dir");
    SweepRecord r;
    r.command = string_field(j, "command");
    r.identity = field(j, "identity");
    if (string_field(j, "checksum") != hex64(hash_of(r.identity.dump()))) throw Bad{"its checksum does not match"};
    const json& flags = field(r.identity, "flags");
    const json& trials = field(r.identity, "trials");
    if (!flags.is_array() || !trials.is_array()) throw Bad{"its identity is not flags and trials"};
    for (const json& f : flags)
      if (!f.is_string()) throw Bad{"its identity's flags are not strings"};
    for (const json& t : trials) values_from(t);
    return r;
  } catch (const Bad& b) {
    ZT_THROW(ErrorKind::kInvalidArgument, what, " is damaged (", b.why,
             "); restore the sweep directory from a copy or start a new --sweep-dir");
  }
}

json make_identity(std::vector<std::string> flags,
                   const std::vector<std::vector<std::pair<std::string, std::string>>>& trials) {
  std::sort(flags.begin(), flags.end());
  json t = json::array();
  for (const auto& v : trials) t.push_back(values_json(v));
  return {{"flags", flags}, {"trials", t}};
}

std::string identity_difference(const json& was, const json& now) {
  if (was == now) return "";
  // Flags: "name = value" lines, sorted by name.
  const auto flag_map = [](const json& id) {
    std::vector<std::pair<std::string, std::string>> m;
    if (id.contains("flags") && id["flags"].is_array())
      for (const json& f : id["flags"]) {
        if (!f.is_string()) continue;
        const std::string s = f.get<std::string>();
        const size_t eq = s.find(" = ");
        if (eq == std::string::npos) m.emplace_back(s, "");
        else m.emplace_back(s.substr(0, eq), s.substr(eq + 3));
      }
    return m;
  };
  const auto a = flag_map(was), b = flag_map(now);
  const auto find = [](const auto& m, const std::string& k) -> const std::string* {
    for (const auto& [n, v] : m)
      if (n == k) return &v;
    return nullptr;
  };
  for (const auto& [n, v] : a) {
    const std::string* w = find(b, n);
    if (!w) return "--" + n + " was " + v + " and is now not given";
    if (*w != v) return "--" + n + " was " + v + " and is now " + *w;
  }
  for (const auto& [n, v] : b)
    if (!find(a, n)) return "--" + n + " was not given and is now " + v;
  const json& ta = was.contains("trials") ? was["trials"] : json::array();
  const json& tb = now.contains("trials") ? now["trials"] : json::array();
  if (ta.size() != tb.size())
    return "its search space had " + std::to_string(ta.size()) + " trials and has " + std::to_string(tb.size()) + " now";
  for (size_t i = 0; i < ta.size(); ++i)
    if (ta[i] != tb[i]) {
      char name[32];
      std::snprintf(name, sizeof name, "trial-%03zu", i);
      return std::string("its search space differs (") + name + " was " + ta[i].dump() + " and is now " +
             tb[i].dump() + ")";
    }
  return "its records differ";
}

}  // namespace zt::sweep
