// The sweep directory's records, as bytes: sweep.json (the owner record: the sweep's identity,
// checksummed) and the journal (one checksummed line per event: a trial started, a rung report
// and its decision, a promotion, a result). Pure parsing and formatting, no file access, so the
// fuzzer reaches every branch; runner.cc owns the files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace zt::sweep {

inline constexpr char kSweepFileName[] = "sweep.json";
inline constexpr char kJournalFileName[] = "sweep.journal";
inline constexpr char kSweepLockFileName[] = ".sweep.lock";
inline constexpr int kSweepFormatVersion = 2;

enum class TrialStatus { kFinished, kStopped, kFailed, kDoesNotFit };
const char* status_name(TrialStatus s);  // "finished", "stopped", "failed", "does not fit"
std::optional<TrialStatus> parse_status(std::string_view text);

// One trial's outcome, as a result record (and results.jsonl) holds it.
struct TrialOutcome {
  int id = 0;
  std::vector<std::pair<std::string, std::string>> values;
  TrialStatus status = TrialStatus::kFailed;
  std::string reason;  // why it stopped, failed or did not fit
  int steps = 0;       // steps trained (the last step reached)
  std::optional<double> final_loss;  // training loss of the last step
  std::optional<double> best_val, last_val;
  std::vector<std::pair<int, double>> val_curve;  // (step, validation loss) of every evaluation
  std::vector<int> devices;  // pool indices it ran on (this run of the sweep; empty when not run)
  // This process's order of events (a counter under the runner's lock): when it acquired and
  // released its devices; tests check that no two trials held one device at once.
  int64_t acquired_seq = -1, released_seq = -1;
  bool resumed = false;  // loaded from the journal, not run by this process
};

nlohmann::json outcome_json(const TrialOutcome& t);  // results.jsonl's line

// One journal event.
struct JournalRecord {
  enum class Kind { kStart, kReport, kPromote, kResult };
  Kind kind = Kind::kStart;
  int trial = 0;
  int step = 0;                  // kReport, kPromote: the rung's step
  std::optional<double> loss;    // kReport: the validation loss (nullopt: not finite)
  bool go = false;               // kReport: the decision (true = continue)
  TrialOutcome result;           // kResult
};

// "<16 hex digits: xxHash64 of the JSON> <JSON>\n".
std::string journal_line(const JournalRecord& r);

struct ParsedJournal {
  std::vector<JournalRecord> records;
  uint64_t valid_bytes = 0;  // the prefix made of whole, valid lines
  bool torn_tail = false;    // bytes after it: the last append, cut short by a kill
};

// Parses the journal of a sweep of `trials` trials. The last line may be torn (missing its
// newline, or failing its checksum): it is reported, not an error. Any other damage (a bad
// checksum before the end, a checksummed line that is not a record of ours, a trial id outside
// the sweep) throws zt::Error(kInvalidArgument) with one sentence naming `what` and the line.
// verify = false skips the checksums (the fuzzer: so that mutations reach the record rules).
ParsedJournal parse_journal(std::string_view text, int trials, const std::string& what, bool verify = true);

// sweep.json: who owns the directory and what the sweep is. `identity` is compared whole by a
// rerun (the resolved flag values and the trials' values); `command` is for people.
struct SweepRecord {
  nlohmann::json identity;
  std::string command;
};
std::string format_sweep_record(const SweepRecord& r);
// Throws kInvalidArgument (one sentence naming `what`) for anything but a valid record of this
// format version (a record of an older ZeroTrain says so).
SweepRecord parse_sweep_record(std::string_view text, const std::string& what);

// The identity: {"flags": ["name = value", ...] (sorted), "trials": [[["lr", "0.001"], ...], ...]}.
nlohmann::json make_identity(std::vector<std::string> flags,
                             const std::vector<std::vector<std::pair<std::string, std::string>>>& trials);
// The first difference between two identities, for a sentence: "--lr was 0.001 and is now 0.002";
// empty when they are equal.
std::string identity_difference(const nlohmann::json& was, const nlohmann::json& now);

}  // namespace zt::sweep
