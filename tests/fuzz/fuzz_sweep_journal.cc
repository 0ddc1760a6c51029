// libFuzzer target: a sweep directory's records -> parse_journal and parse_sweep_record (what a
// rerun of `zerotrain sweep` reads back). Refusals are zt::Error; an accepted journal's records
// must format and parse back to the same records, an accepted sweep.json to the same identity.
// The journal is parsed with its checksums and without them (so that mutations reach the rules).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/status.h"
#include "sweep/journal.h"

namespace {

bool same_record(const zt::sweep::JournalRecord& a, const zt::sweep::JournalRecord& b) {
  if (a.kind != b.kind || a.trial != b.trial || a.step != b.step || a.go != b.go || a.loss != b.loss) return false;
  const zt::sweep::TrialOutcome &x = a.result, &y = b.result;
  return x.values == y.values && x.status == y.status && x.reason == y.reason && x.steps == y.steps &&
         x.final_loss == y.final_loss && x.best_val == y.best_val && x.last_val == y.last_val &&
         x.val_curve == y.val_curve;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int trials = 1 + data[0] % 16;  // the sweep's trial count
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  // A refusal is a zt::Error; the round trips run outside the try, so an error there escapes (a bug).
  for (const bool verify : {false, true}) {
    zt::sweep::ParsedJournal j;
    try {
      j = zt::sweep::parse_journal(text, trials, "fuzz: sweep.journal", verify);
    } catch (const zt::Error&) {
      continue;
    }
    if (j.valid_bytes > text.size() || (!j.torn_tail && j.valid_bytes != text.size())) __builtin_trap();
    std::string again;
    for (const auto& r : j.records) again += zt::sweep::journal_line(r);
    const zt::sweep::ParsedJournal k = zt::sweep::parse_journal(again, trials, "fuzz: round trip");
    if (k.torn_tail || k.records.size() != j.records.size()) __builtin_trap();
    for (size_t i = 0; i < k.records.size(); ++i)
      if (!same_record(j.records[i], k.records[i])) __builtin_trap();
  }
  zt::sweep::SweepRecord r;
  try {
    r = zt::sweep::parse_sweep_record(text, "fuzz: sweep.json");
  } catch (const zt::Error&) {
    return 0;
  }
  const zt::sweep::SweepRecord again =
      zt::sweep::parse_sweep_record(zt::sweep::format_sweep_record(r), "fuzz: round trip");
  if (again.identity != r.identity || again.command != r.command) __builtin_trap();
  if (!zt::sweep::identity_difference(r.identity, r.identity).empty()) __builtin_trap();
  return 0;
}
