// The sweep runner (sweep/runner.h). One host thread per running trial calls train(); the caller's
// thread hands out device subsets (DevicePacker) and reacts when a trial ends. Files in SWEEP_DIR:
//   sweep.json      the owner record: the sweep's identity (resolved flags and trials), checksummed;
//                   a directory that is not empty and has none is not a sweep and is refused
//   .sweep.lock     flock'd by the one sweep running in the directory
//   sweep.journal   the sweep's state, append-only, one checksummed line per event: a trial
//                   started (or was promoted), reported at a rung (with the decision), ended
//                   (result). A rerun replays it: Asha's history, the paused set, the results.
//   results.jsonl, rungs.jsonl   views of the journal for people and scripts (rebuilt from it on
//                   every start, appended after it; never read back)
//   trial-NNN/      ckpt/ (saved at every rung and at the end), metrics.jsonl (the trial's records
//                   over all runs of the sweep), metrics.run.jsonl (the current run's, merged in after)
// Every file goes through core/files.h: regular files only, no symbolic links, no FIFOs.
//
// Resume repairs, never freezes: a trial the journal shows in flight (started, no result) is run
// again first, from its last complete checkpoint, before anything new starts (so a one-device
// sweep reports in the same order as an uninterrupted one), unless it had paused at a rung with
// its records complete (the rung's checkpoint and metrics present): then it waits paused as before.
#include "sweep/runner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "core/files.h"
#include "core/philox.h"
#include "core/status.h"
#include "data/image_data.h"
#include "data/language_data.h"
#include "model/config.h"
#include "runtime/runtime.h"
#include "sweep/asha.h"
#include "sweep/packer.h"
#include "train/batch_split.h"
#include "train/plan.h"
#include "train/run_shape.h"
#include "train/signals.h"

namespace zt::sweep {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint64_t kMaxJournalBytes = uint64_t{1} << 30;

std::string trial_name(int id) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "trial-%03d", id);
  return buf;
}

std::string trial_dir(const std::string& root, int id) { return root + "/" + trial_name(id); }

// The JSON objects of a JSON-lines file written by this process's code (a trial's metrics): a torn
// last line (a kill in the middle of a write) is skipped. Regular files only (core/files.h).
std::vector<json> read_jsonl(const std::string& path, const std::string& what) {
  std::vector<json> out;
  const std::optional<std::string> text = read_small_file(path, what);
  if (!text) return out;
  size_t at = 0;
  while (at < text->size()) {
    size_t nl = text->find('\n', at);
    if (nl == std::string::npos) nl = text->size();
    if (nl > at) {
      json j = json::parse(std::string_view(*text).substr(at, nl - at), nullptr, false);
      if (!j.is_discarded() && j.is_object()) out.push_back(std::move(j));
    }
    at = nl + 1;
  }
  return out;
}

std::optional<int> int_of(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) return std::nullopt;
  const int64_t v = it->get<int64_t>();
  if (v < INT32_MIN || v > INT32_MAX) return std::nullopt;
  return static_cast<int>(v);
}

std::optional<double> finite_number(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return std::nullopt;
  const double v = it->get<double>();
  return std::isfinite(v) ? std::optional<double>(v) : std::nullopt;
}

std::string event_of(const json& j) {
  const auto it = j.find("event");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// metrics.jsonl = its records up to step `cut` + every record of metrics.run.jsonl (cut < 0: just
// before the run file's first step). A killed run's file is merged the same way before the next.
void merge_run_metrics(const std::string& dir, int cut) {
  const std::string run_path = dir + "/metrics.run.jsonl", path = dir + "/metrics.jsonl";
  if (!read_small_file(run_path, "trial metrics file")) return;
  const std::vector<json> run = read_jsonl(run_path, "trial metrics file");
  if (cut < 0) {
    cut = INT32_MAX;
    for (const json& r : run)
      if (const auto step = int_of(r, "step")) cut = std::min(cut, *step - 1);
  }
  std::string text;
  for (const json& r : read_jsonl(path, "trial metrics file"))
    if (const auto step = int_of(r, "step"); step && *step <= cut) text += r.dump() + "\n";
  for (const json& r : run) text += r.dump() + "\n";
  write_file_atomic(path, text, "trial metrics file");
  fs::remove(run_path);
}

// The trial's curve and losses from its merged metrics.
void fill_from_metrics(const std::string& dir, TrialOutcome& t) {
  t.val_curve.clear();
  t.steps = 0;
  for (const json& r : read_jsonl(dir + "/metrics.jsonl", "trial metrics file")) {
    const auto step = int_of(r, "step");
    if (!step) continue;
    const std::string ev = event_of(r);
    if (ev == "eval") {
      if (const auto v = finite_number(r, "val_loss")) t.val_curve.emplace_back(*step, *v);
    } else if (ev.empty() && r.contains("loss")) {
      t.steps = std::max(t.steps, *step);
      t.final_loss = finite_number(r, "loss");
    }
  }
  if (!t.val_curve.empty()) {
    t.last_val = t.val_curve.back().second;
    t.best_val = t.last_val;
    for (const auto& e : t.val_curve) t.best_val = std::min(*t.best_val, e.second);
  }
}

// Whether the merged metrics hold the evaluation at `step` (a paused trial's rung).
bool metrics_have_eval(const std::string& dir, int step) {
  for (const json& r : read_jsonl(dir + "/metrics.jsonl", "trial metrics file"))
    if (event_of(r) == "eval" && int_of(r, "step") == step) return true;
  return false;
}

std::string plain_values(const std::vector<std::pair<std::string, std::string>>& values) {
  const std::string s = format_values(values);
  return s.empty() ? s : s.substr(1);
}

std::string device_list(const std::vector<int>& devs) {
  std::string s;
  for (int d : devs) s += (s.empty() ? "" : ",") + std::to_string(d);
  return s;
}

// `path` (which the sweep reads or writes) must be absent or of `type` (S_IFREG, S_IFDIR), never
// a symbolic link: one sentence otherwise.
void require_type(const std::string& path, unsigned type) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    ZT_THROW(ErrorKind::kInvalidArgument, path, ": cannot check it (", errno_text(errno), ")");
  }
  if ((st.st_mode & S_IFMT) == type) return;
  ZT_THROW(ErrorKind::kInvalidArgument, "the sweep's ", path, " is ", file_type_name(st.st_mode), ", not ",
           type == S_IFDIR ? "a directory" : "a regular file",
           "; the sweep only uses its own files, so move it away (or start a new --sweep-dir)");
}

json rung_view(const JournalRecord& r) {
  if (r.kind == JournalRecord::Kind::kPromote) return {{"trial", r.trial}, {"step", r.step}, {"promote", true}};
  return {{"trial", r.trial}, {"step", r.step}, {"loss", r.loss ? json(*r.loss) : json(nullptr)}, {"continue", r.go}};
}

}  // namespace

// A trial's --devices: on CUDA the pool's GPUs at those positions. On the CPU backend a trial of k
// devices gets k fresh simulated devices of the sweep's --device-memory: simulated devices share
// nothing but the host (no memory, no links between runtimes), so k new ones are the same thing
// as k of the pool's; the packer's indices still bound how many run at once.
std::string subset_spec(const SweepSpec& spec, const std::vector<int>& devs) {
  if (spec.backend == Backend::kCpu) return "cpu:" + std::to_string(devs.size());
  // Logical devices on one GPU (--devices cuda:0x4) are written as ordinal x count: the device
  // syntax refuses an ordinal listed twice.
  std::vector<std::pair<int, int>> groups;  // (ordinal, count), in order of first appearance
  for (int d : devs) {
    const int ordinal = spec.cuda_ordinals.at(static_cast<size_t>(d));
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == ordinal; });
    if (it == groups.end()) groups.emplace_back(ordinal, 1);
    else ++it->second;
  }
  std::string s;
  for (const auto& [ordinal, count] : groups)
    s += (s.empty() ? "" : ",") + std::to_string(ordinal) + (count > 1 ? "x" + std::to_string(count) : "");
  return "cuda:" + s;
}

namespace {

// One copy of each distinct dataset the trials read (a swept --seed, --data or --vocab opens another).
struct DataCache {
  std::map<std::tuple<std::string, uint64_t, int>, std::shared_ptr<const LanguageData>> lang;
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<const ImageData>> images;
  void attach(TrainConfig& cfg) {
    const ModelConfig mc = make_model_config(cfg.model, cfg.overrides);
    if (mc.kind == ModelKind::kGpt) {
      auto& slot = lang[{cfg.data, cfg.seed, mc.vocab}];
      if (!slot) slot = open_language_data(cfg.data, cfg.seed, mc.vocab);
      cfg.language_data = slot;
    } else {
      const std::string name = cfg.data == "synthetic" ? "fashion-mnist" : cfg.data;
      auto& slot = images[{name, cfg.seed}];
      if (!slot) slot = open_image_data(name, cfg.seed);
      cfg.image_data = slot;
    }
  }
};

class Runner {
 public:
  explicit Runner(const SweepSpec& spec) : spec_(spec), asha_(spec.min_steps, spec.max_steps, spec.eta) {
    // Tests and bench/crash_sweeps.sh: SIGKILL this process right after its n-th journal append
    // (before the append's view), to put a kill at an exact point of the sweep's protocol.
    if (const char* v = std::getenv("ZT_TEST_SWEEP_KILL_AFTER")) kill_after_ = std::atoi(v);
  }
  SweepResult run();

 private:
  void open_dir();
  void load_state();
  void prepare();
  // final_promotion: the end-of-sweep promotion (see run()): no rungs, never the stopped shortcut.
  void run_trial(int id, std::vector<int> devs, bool final_promotion = false);
  EvalAction on_eval(int id, int step, double loss);
  // ASHA: the best paused trial it would promote now, or -1; caller holds mu_.
  std::pair<int, int> next_promotion() const;
  void finish_paused(int id);  // records a trial still paused at the end as stopped; caller holds mu_
  void live_eval(int id, int step, double loss);
  void finish_trial(TrialOutcome t);  // records it (journal, results.jsonl) and prints its line
  // Appends to the journal, then to the record's view; caller holds mu_ (or is alone). A failure
  // is kept in fatal_ (the sweep stops launching, records nothing more and rethrows it) and thrown.
  void record(const JournalRecord& r);
  void launch(int id, const std::vector<int>& devs, const char* how);
  void live(const std::string& line);
  // The steps of run(), in order.
  std::vector<int> pending_trials() const;
  void launch_ready(DevicePacker& packer, const std::vector<int>& pending, size_t& next, size_t& next_rerun);
  bool record_or_release(const JournalRecord& r, DevicePacker& packer, const std::vector<int>& devs);
  void join_ended(std::unique_lock<std::mutex>& lock, DevicePacker& packer);
  void promote_best_to_max_steps(std::unique_lock<std::mutex>& lock, DevicePacker& packer);

  const SweepSpec& spec_;
  Asha asha_;
  std::set<int> rungs_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<FileLock> lock_;
  std::optional<AppendFile> journal_;
  std::map<int, TrialOutcome> done_;                // finished trials (earlier runs and this one)
  std::map<std::pair<int, int>, bool> decisions_;   // (trial, rung step) -> continue
  std::vector<TrainConfig> configs_;                // ready to run (devices etc. set at launch)
  std::vector<std::string> unfit_;                  // per trial: the plan's verdict ("" fits)
  std::vector<int> ended_;                          // trial ids whose threads are done (to join)
  std::map<int, int> paused_;                       // ASHA: trial -> the rung step it waits at
  std::vector<int> rerun_first_;                    // in flight when the last run ended: run first
  std::map<int, std::thread> threads_;
  std::map<int, std::vector<int>> held_;
  std::map<int, int64_t> acquired_;
  std::exception_ptr fatal_;
  int64_t seq_ = 0;
  int signal_ = 0;
  int kill_after_ = 0, appended_ = 0;
};

void Runner::live(const std::string& line) {
  if (!spec_.live) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Runner::record(const JournalRecord& r) {
  try {
    ZT_CHECK(journal_.has_value(), "the sweep journal is not open");
    journal_->append(journal_line(r));
    if (kill_after_ > 0 && ++appended_ == kill_after_) ::raise(SIGKILL);
    if (r.kind == JournalRecord::Kind::kResult)
      append_durable(spec_.dir + "/results.jsonl", outcome_json(r.result).dump() + "\n", "the sweep's results.jsonl");
    else if (r.kind != JournalRecord::Kind::kStart)
      append_durable(spec_.dir + "/rungs.jsonl", rung_view(r).dump() + "\n", "the sweep's rungs.jsonl");
  } catch (...) {
    if (!fatal_) fatal_ = std::current_exception();
    throw;
  }
}

// Settles that SWEEP_DIR is this sweep's before anything is written into it: a new or empty
// directory becomes the sweep's (sweep.json), one with this sweep's sweep.json continues it, and
// everything else is refused with one sentence naming the fix. Then the lock, then the files'
// types (a FIFO or a symbolic link where a sweep file belongs is refused, never opened).
void Runner::open_dir() {
  const std::string& dir = spec_.dir;
  ZT_REQUIRE(!dir.empty(), "--sweep-dir is empty; name a directory");
  {
    std::error_code ec;
    const fs::path canon = fs::weakly_canonical(dir, ec);
    ZT_REQUIRE(ec || canon != fs::path("/"), "--sweep-dir ", dir, " is the root directory; give a directory of its "
               "own for the sweep, e.g. --sweep-dir sweeps/lr");
    const char* home = std::getenv("HOME");
    if (!ec && home && *home) {
      std::error_code ec2;
      const fs::path h = fs::weakly_canonical(home, ec2);
      ZT_REQUIRE(ec2 || canon != h, "--sweep-dir ", dir, " is your home directory; give a directory of its own for "
                 "the sweep, e.g. --sweep-dir sweeps/lr");
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    ZT_REQUIRE(S_ISDIR(st.st_mode), "--sweep-dir ", dir, " is ", file_type_name(st.st_mode),
               ", not a directory; give a new or empty directory (or a sweep's)");
  } else {
    std::error_code ec;
    fs::create_directories(dir, ec);
    ZT_REQUIRE(!ec, "--sweep-dir ", dir, " cannot be created (", ec.message(), "); choose a directory this user can "
               "write");
  }
  const std::string record_path = dir + "/" + kSweepFileName;
  require_type(record_path, S_IFREG);
  // Ownership before the lock file is made: a foreign directory gets nothing written into it.
  bool ours = ::lstat(record_path.c_str(), &st) == 0;
  if (!ours) {
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      // What a sweep killed before its sweep.json was committed leaves behind.
      if (name == kSweepLockFileName || name.rfind(std::string(".") + kSweepFileName + ".tmp-", 0) == 0) continue;
      ZT_THROW(ErrorKind::kInvalidArgument, "--sweep-dir ", dir, " is not empty and holds no sweep (no ",
               kSweepFileName, "; it has ", name, "); a sweep only continues its own directory, so give a new or "
               "empty --sweep-dir");
    }
    ZT_REQUIRE(!ec, "--sweep-dir ", dir, " cannot be listed (", ec.message(), "); check its permissions");
  }
  std::string holder;
  lock_ = FileLock::try_acquire(dir + "/" + kSweepLockFileName, "the sweep's lock file", &holder);
  ZT_REQUIRE(lock_.has_value(), "--sweep-dir ", dir, " is in use by another running sweep",
             holder.empty() ? std::string() : " (process " + holder + ")",
             "; wait for it to finish (or stop it) before running this command, or give another --sweep-dir");

  json identity = spec_.identity;
  if (identity.is_null()) {
    std::vector<std::vector<std::pair<std::string, std::string>>> values;
    for (const TrialValues& t : spec_.trials) values.push_back(t.values);
    identity = make_identity({"command = " + spec_.command}, values);
  }
  const std::string what = "--sweep-dir " + dir + "'s " + kSweepFileName;
  if (const auto text = read_small_file(record_path, what, 64 << 20)) {
    const SweepRecord have = parse_sweep_record(*text, what);
    ZT_REQUIRE(have.identity == identity, "--sweep-dir ", dir, " holds a different sweep: ",
               identity_difference(have.identity, identity),
               "; run that sweep's command to continue it, or give a new --sweep-dir");
  } else {
    write_file_atomic(record_path, format_sweep_record({identity, spec_.command}), "the sweep's " +
                      std::string(kSweepFileName));
  }
  for (const char* name : {kJournalFileName, "results.jsonl", "rungs.jsonl"}) require_type(dir + "/" + name, S_IFREG);
  for (size_t i = 0; i < spec_.trials.size(); ++i) {
    const std::string t = trial_dir(dir, static_cast<int>(i));
    require_type(t, S_IFDIR);
    require_type(t + "/ckpt", S_IFDIR);
    require_type(t + "/metrics.jsonl", S_IFREG);
    require_type(t + "/metrics.run.jsonl", S_IFREG);
  }
}

void Runner::load_state() {
  const std::string path = spec_.dir + "/" + kJournalFileName;
  const std::string what = "--sweep-dir " + spec_.dir + "'s " + kJournalFileName;
  const std::string text = read_small_file(path, what, kMaxJournalBytes).value_or(std::string());
  const ParsedJournal parsed = parse_journal(text, static_cast<int>(spec_.trials.size()), what);
  journal_ = AppendFile::open(path, what);
  if (parsed.torn_tail) journal_->truncate(parsed.valid_bytes);  // the append a kill cut short

  // Replay. A checksummed journal that Asha refuses (a report out of order) was edited: one sentence.
  std::vector<int> in_flight;  // started or promoted, no result yet: in order of their start
  std::map<int, int> stopped_at;  // trial -> rung step of its last "pause" decision (not promoted since)
  try {
    for (const JournalRecord& r : parsed.records) {
      switch (r.kind) {
        case JournalRecord::Kind::kStart:
          std::erase(in_flight, r.trial);
          in_flight.push_back(r.trial);
          break;
        case JournalRecord::Kind::kReport: {
          if (decisions_.count({r.trial, r.step})) break;
          const bool go = asha_.report(r.trial, r.step, r.loss.value_or(NAN));
          decisions_[{r.trial, r.step}] = go;
          if (!go) stopped_at[r.trial] = r.step;
          break;
        }
        case JournalRecord::Kind::kPromote:
          asha_.promote(r.trial, r.step);
          decisions_[{r.trial, r.step}] = true;
          stopped_at.erase(r.trial);
          std::erase(in_flight, r.trial);
          in_flight.push_back(r.trial);
          break;
        case JournalRecord::Kind::kResult:
          done_[r.trial] = r.result;
          std::erase(in_flight, r.trial);
          stopped_at.erase(r.trial);
          break;
      }
    }
  } catch (const Error& e) {
    ZT_THROW(ErrorKind::kInvalidArgument, what, " is inconsistent (", e.message(), "); restore the sweep directory "
             "from a copy or start a new --sweep-dir");
  }
  // Paused trials wait for a promotion only with their records complete; anything else in flight
  // runs again from its last complete checkpoint (its recorded decisions are given back to it).
  for (int id : in_flight) {
    const std::string dir = trial_dir(spec_.dir, id);
    merge_run_metrics(dir, -1);  // what a killed run of it wrote
    const auto it = stopped_at.find(id);
    if (it != stopped_at.end() && fs::is_directory(dir + "/ckpt/" + format_step_dir(it->second)) &&
        metrics_have_eval(dir, it->second)) {
      paused_[id] = it->second;
    } else {
      rerun_first_.push_back(id);
    }
  }
  // The views, rebuilt from the journal (a kill may have come between an append and its view's).
  std::string results, rungs;
  for (const JournalRecord& r : parsed.records) {
    if (r.kind == JournalRecord::Kind::kResult) results += outcome_json(r.result).dump() + "\n";
    else if (r.kind != JournalRecord::Kind::kStart) rungs += rung_view(r).dump() + "\n";
  }
  write_file_atomic(spec_.dir + "/results.jsonl", results, "the sweep's results.jsonl");
  write_file_atomic(spec_.dir + "/rungs.jsonl", rungs, "the sweep's rungs.jsonl");
}

std::pair<int, int> Runner::next_promotion() const {
  if (!spec_.asha) return {-1, 0};
  for (const auto& [trial, step] : asha_.promotable())
    if (const auto it = paused_.find(trial); it != paused_.end() && it->second == step) return {trial, step};
  return {-1, 0};
}

void Runner::finish_paused(int id) {
  TrialOutcome t;
  t.id = id;
  t.values = spec_.trials[static_cast<size_t>(id)].values;
  t.status = TrialStatus::kStopped;
  t.reason = "ASHA: not in the top 1/eta at its rung";
  fill_from_metrics(trial_dir(spec_.dir, id), t);
  finish_trial(std::move(t));
}

// Every trial's run resolved and planned before any starts; a user's mistake throws (one
// sentence naming the trial), a plan that does not fit is recorded.
void Runner::prepare() {
  const int k = spec_.devices_per_trial;
  ZT_REQUIRE(k >= 1 && k <= spec_.devices, "--devices-per-trial ", k, " is more than the sweep's ", spec_.devices,
             " devices; lower it or give --devices more");
  if (spec_.asha)
    for (int r : asha_.rungs()) rungs_.insert(r);
  std::vector<int> first(static_cast<size_t>(k));
  for (int i = 0; i < k; ++i) first[static_cast<size_t>(i)] = i;
  configs_.resize(spec_.configs.size());
  unfit_.assign(spec_.configs.size(), "");
  for (size_t i = 0; i < spec_.configs.size(); ++i) {
    TrainConfig cfg = spec_.configs[i];
    cfg.devices = subset_spec(spec_, first);
    cfg.steps = spec_.max_steps;
    try {
      const ModelConfig mc = make_model_config(cfg.model, cfg.overrides);
      const RunContext shape = resolve_run_shape(cfg, mc, k, spec_.backend);
      // As train() splits it: over the data-parallel ranks (tensor and pipeline groups share a batch).
      const int data_ranks = std::max(1, k / shape.cfg.tensor_parallel / shape.cfg.pipeline_parallel);
      const BatchSplit split = even_split(shape.cfg.batch_size, data_ranks, shape.cfg.micro_batch_size);
      PlanInputs in = shape.plan;
      in.micro_batch = split.micro;
      in.micro_batches = split.accum;
      auto rt = Runtime::create(parse_device_spec(cfg.devices), CpuDeviceOptions{cfg.device_memory});
      const MemoryPlan plan = plan_run(mc, *rt, in);
      if (!plan.fits) unfit_[i] = plan.verdict();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kInvalidArgument) throw;
      ZT_THROW(ErrorKind::kInvalidArgument, trial_name(static_cast<int>(i)), " (",
               plain_values(spec_.trials[i].values), "): ", e.message());
    }
    configs_[i] = std::move(cfg);
  }
}

// Caller holds mu_ (or is alone).
void Runner::live_eval(int id, int step, double loss) {
  char buf[64];
  std::snprintf(buf, sizeof buf, " | step %d | val %.4f", step, loss);
  live(trial_name(id) + " |" + format_values(spec_.trials[static_cast<size_t>(id)].values) + buf + " | running");
}

EvalAction Runner::on_eval(int id, int step, double loss) {
  std::unique_lock lock(mu_);
  live_eval(id, step, loss);
  if (!rungs_.count(step)) return EvalAction::kContinue;
  bool go;
  if (const auto it = decisions_.find({id, step}); it != decisions_.end()) {
    go = it->second;  // reported before a kill: the same decision again
  } else {
    if (fatal_) std::rethrow_exception(fatal_);  // nothing more is recorded
    go = asha_.report(id, step, loss);
    decisions_[{id, step}] = go;
    JournalRecord r;
    r.kind = JournalRecord::Kind::kReport;
    r.trial = id;
    r.step = step;
    if (std::isfinite(loss)) r.loss = loss;
    r.go = go;
    record(r);
  }
  return go ? EvalAction::kSave : EvalAction::kStop;
}

void Runner::finish_trial(TrialOutcome t) {
  // Caller holds mu_.
  JournalRecord r;
  r.kind = JournalRecord::Kind::kResult;
  r.trial = t.id;
  r.result = t;
  record(r);
  std::string what = status_name(t.status);
  if (t.status == TrialStatus::kStopped) what = "stopped at step " + std::to_string(t.steps);
  if (!t.reason.empty() && t.status != TrialStatus::kStopped) what += ": " + t.reason;
  char buf[96] = "";
  if (t.final_loss) std::snprintf(buf, sizeof buf, " | step %d | loss %.4f", t.steps, *t.final_loss);
  if (t.last_val) std::snprintf(buf + std::strlen(buf), sizeof buf - std::strlen(buf), " | val %.4f", *t.last_val);
  live(trial_name(t.id) + " |" + format_values(t.values) + buf + " | " + what);
  done_[t.id] = std::move(t);
}

void Runner::run_trial(int id, std::vector<int> devs, bool final_promotion) {
  const std::string dir = trial_dir(spec_.dir, id);
  TrialOutcome t;
  t.id = id;
  t.values = spec_.trials[static_cast<size_t>(id)].values;
  t.devices = devs;
  int sig = 0;
  // A failure of the machine or of the sweep's own files (kIo: a full disk, a failed fsync; the
  // metrics merge) is not the trial's: nothing is recorded, the sweep stops, a rerun repairs it.
  std::exception_ptr environment;
  try {
    fs::create_directories(dir);
    merge_run_metrics(dir, -1);  // what a killed run of this trial wrote
    TrainConfig cfg = configs_[static_cast<size_t>(id)];
    cfg.devices = subset_spec(spec_, devs);
    cfg.checkpoint_dir = dir + "/ckpt";
    cfg.resume = ResumeFrom::newest();
    cfg.metrics_path = dir + "/metrics.run.jsonl";
    cfg.quiet = true;
    cfg.log_format = LogFormat::kText;
    cfg.sample_tokens = 0;  // nobody reads a trial's sample
    cfg.keep = std::max(cfg.keep, 2);
    if (!final_promotion) cfg.eval_steps.assign(rungs_.begin(), rungs_.end());
    cfg.on_eval = [this, id, final_promotion](int step, double loss) {
      return final_promotion ? (live_eval(id, step, loss), EvalAction::kContinue) : on_eval(id, step, loss);
    };
    const TrainResult r = train(cfg);
    merge_run_metrics(dir, r.start_step);
    sig = r.signal;
    if (r.stopped_at > 0) {
      // Paused at a rung (its checkpoint saved there): promotable later, recorded as stopped if
      // the sweep ends first.
      std::lock_guard lock(mu_);
      paused_[id] = r.stopped_at;
      live(trial_name(id) + " |" + format_values(t.values) + " | paused at step " + std::to_string(r.stopped_at) +
           " (not in the top 1/eta of its rung yet)");
      if (done_.count(id)) done_[id].released_seq = seq_;
      ++seq_;
      ended_.push_back(id);
      cv_.notify_all();
      return;
    }
    t.status = TrialStatus::kFinished;
    if (final_promotion) t.reason = "promoted at the end as the best at the highest rung reached";
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kIo) environment = std::current_exception();
    t.status = TrialStatus::kFailed;
    t.reason = (e.kind() == ErrorKind::kDiverged ? "diverged: "
                : e.kind() == ErrorKind::kDevice ? "device failed: "
                : e.kind() == ErrorKind::kOutOfMemory ? "out of memory: "
                                                      : "") + e.message();
    try {
      merge_run_metrics(dir, -1);
    } catch (const std::exception&) {
      if (!environment) environment = std::current_exception();
    }
  } catch (const std::exception& e) {
    t.status = TrialStatus::kFailed;
    t.reason = std::string("internal error: ") + e.what();
  }
  if (!environment) {
    try {
      fill_from_metrics(dir, t);
    } catch (const std::exception&) {
      environment = std::current_exception();
    }
  }
  std::lock_guard lock(mu_);
  if (sig != 0) {
    signal_ = sig;  // not recorded: a rerun continues it from its checkpoint
  } else if (fatal_ || environment) {
    if (!fatal_) fatal_ = environment;  // not recorded: run() rethrows it once the others end
  } else {
    try {
      finish_trial(t);
    } catch (const std::exception&) {
      // fatal_ holds it: run() rethrows after the running trials end.
    }
  }
  if (done_.count(id)) done_[id].released_seq = seq_;
  ++seq_;
  ended_.push_back(id);
  cv_.notify_all();
}

// Caller holds mu_.
void Runner::launch(int id, const std::vector<int>& devs, const char* how) {
  held_[id] = devs;
  acquired_[id] = seq_++;
  live(trial_name(id) + " |" + format_values(spec_.trials[static_cast<size_t>(id)].values) + " | " + how +
       " on device" + (devs.size() == 1 ? " " : "s ") + device_list(devs));
  threads_.emplace(id, std::thread([this, id, d = devs] { run_trial(id, d); }));
}

// Trial ids not done, paused or continued first, in the order they start: ASHA shuffles it
// (Fisher-Yates with Philox: the same order on every machine and every rerun).
std::vector<int> Runner::pending_trials() const {
  std::vector<int> order(spec_.trials.size()), pending;
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  if (spec_.asha)
    for (size_t i = order.size(); i > 1; --i)
      std::swap(order[i - 1], order[philox_u32(spec_.order_seed, 0x5eed, i) % i]);
  for (int id : order)
    if (!done_.count(id) && !paused_.count(id) &&
        std::find(rerun_first_.begin(), rerun_first_.end(), id) == rerun_first_.end())
      pending.push_back(id);  // paused ones wait for a promotion
  return pending;
}

// Caller holds mu_. Launches what the free devices allow: the trials continued from the last run
// first (as they came first then), then promotions of paused trials (ASHA's get_job), then new
// trials from pending[next] on (one that does not fit is recorded as such, without devices).
void Runner::launch_ready(DevicePacker& packer, const std::vector<int>& pending, size_t& next, size_t& next_rerun) {
  while (signal_ == 0 && !fatal_) {
    if (next_rerun < rerun_first_.size()) {
      auto devs = packer.acquire(spec_.devices_per_trial);
      if (!devs) return;
      launch(rerun_first_[next_rerun++], *devs, "continued");
      continue;
    }
    if (const auto [pid, pstep] = next_promotion(); pid >= 0) {
      // The paused run's thread ends right after its report: join it (join_ended) before starting
      // the promoted run, whose thread takes the same key (a second std::thread emplaced under
      // a live key would be destroyed joinable: std::terminate).
      if (threads_.count(pid) != 0) return;
      auto devs = packer.acquire(spec_.devices_per_trial);
      if (!devs) return;
      JournalRecord r;
      r.kind = JournalRecord::Kind::kPromote, r.trial = pid, r.step = pstep;
      if (!record_or_release(r, packer, *devs)) return;
      asha_.promote(pid, pstep);
      decisions_[{pid, pstep}] = true;
      paused_.erase(pid);
      launch(pid, *devs, ("promoted at step " + std::to_string(pstep)).c_str());
      continue;
    }
    if (next >= pending.size()) return;
    const int id = pending[next];
    if (!unfit_[static_cast<size_t>(id)].empty()) {
      TrialOutcome t;
      t.id = id;
      t.values = spec_.trials[static_cast<size_t>(id)].values;
      t.status = TrialStatus::kDoesNotFit;
      t.reason = unfit_[static_cast<size_t>(id)];
      try {
        finish_trial(std::move(t));
      } catch (const std::exception&) {
        return;
      }
      ++next;
      continue;
    }
    auto devs = packer.acquire(spec_.devices_per_trial);
    if (!devs) return;
    JournalRecord r;
    r.kind = JournalRecord::Kind::kStart, r.trial = id;
    if (!record_or_release(r, packer, *devs)) return;
    ++next;
    launch(id, *devs, "started");
  }
}

// Caller holds mu_. False (the devices given back) when the journal append failed: fatal_ holds it.
bool Runner::record_or_release(const JournalRecord& r, DevicePacker& packer, const std::vector<int>& devs) {
  try {
    record(r);
    return true;
  } catch (const std::exception&) {
    packer.release(devs);
    return false;
  }
}

// Joins the trials that ended and gives their devices back. Taken out under the lock: trials that
// end while this thread joins others land in ended_ again.
void Runner::join_ended(std::unique_lock<std::mutex>& lock, DevicePacker& packer) {
  std::vector<int> ended;
  ended.swap(ended_);
  for (int id : ended) {
    lock.unlock();
    threads_[id].join();
    lock.lock();
    threads_.erase(id);
    packer.release(held_[id]);
    held_.erase(id);
    if (done_.count(id)) done_[id].acquired_seq = acquired_[id];
  }
}

// With fewer trials than eta^(rungs) nobody may reach --max-steps; then the best trial at the
// highest rung reached continues there from its rung checkpoint (without further reports), so
// that the sweep's pick has a full-length result. Not journaled as a start: a rerun after a kill
// decides it again from the results, the same way. Caller holds mu_ through `lock`.
void Runner::promote_best_to_max_steps(std::unique_lock<std::mutex>& lock, DevicePacker& packer) {
  const TrialOutcome* best = nullptr;
  bool any_finished = false;
  for (const auto& [id, t] : done_) {
    any_finished |= t.status == TrialStatus::kFinished;
    if (t.status != TrialStatus::kStopped || !t.last_val) continue;
    if (!best || t.steps > best->steps || (t.steps == best->steps && *t.last_val < *best->last_val)) best = &t;
  }
  if (any_finished || !best) return;
  const int id = best->id;
  const auto devs = packer.acquire(spec_.devices_per_trial);
  ZT_CHECK(devs.has_value());
  const int64_t at = seq_++;
  live(trial_name(id) + " |" + format_values(spec_.trials[static_cast<size_t>(id)].values) +
       " | promoted to --max-steps on device" + (devs->size() == 1 ? " " : "s ") + device_list(*devs));
  lock.unlock();
  run_trial(id, *devs, true);
  lock.lock();
  ended_.clear();
  packer.release(*devs);
  if (fatal_) std::rethrow_exception(fatal_);
  if (done_.count(id)) done_[id].acquired_seq = at, done_[id].devices = *devs;
}

SweepResult Runner::run() {
  prepare();  // before touching SWEEP_DIR: bad input leaves nothing behind
  open_dir();
  load_state();
  // The sweep's own handler: each trial's train() installs and restores the same one.
  const StopSignals signals;
  DevicePacker packer(spec_.devices);
  const std::vector<int> pending = pending_trials();
  if (spec_.live) {
    std::printf("sweep: %zu trials (%zu done before), %d device%s, %d per trial, scheduler %s\n", spec_.trials.size(),
                done_.size(), spec_.devices, spec_.devices == 1 ? "" : "s", spec_.devices_per_trial,
                spec_.asha ? "asha" : "none");
    std::fflush(stdout);
  }
  std::unique_lock lock(mu_);
  size_t next = 0, next_rerun = 0;
  while (true) {
    const int sig = StopSignals::pending();
    if (sig != 0 && signal_ == 0) signal_ = sig;
    launch_ready(packer, pending, next, next_rerun);
    join_ended(lock, packer);
    const bool stopping = signal_ != 0 || fatal_;
    if (threads_.empty() && !stopping && next_promotion().first >= 0) continue;  // the last report made one
    if (threads_.empty() && ((next >= pending.size() && next_rerun >= rerun_first_.size()) || stopping)) break;
    cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return !ended_.empty(); });
  }
  if (fatal_) std::rethrow_exception(fatal_);
  // Out of work: the trials still paused stopped at their rungs.
  if (signal_ == 0) {
    std::vector<int> left;
    for (const auto& entry : paused_) left.push_back(entry.first);
    for (int id : left) finish_paused(id);
    paused_.clear();
  }
  if (spec_.asha && signal_ == 0) promote_best_to_max_steps(lock, packer);
  SweepResult result;
  result.signal = signal_;
  for (auto& [id, t] : done_) {
    result.steps_trained += t.steps;
    result.trials.push_back(t);
  }
  return result;
}

}  // namespace

std::string format_values(const std::vector<std::pair<std::string, std::string>>& values) {
  std::string s;
  for (const auto& [k, v] : values) s += " " + k + "=" + v;
  return s;
}

SweepResult run_sweep(const SweepSpec& spec) {
  ZT_REQUIRE(spec.configs.size() == spec.trials.size(), "internal: one config per trial");
  SweepSpec s = spec;
  // One dataset per distinct (data, seed, vocabulary), opened here and read by every trial.
  DataCache cache;
  for (TrainConfig& c : s.configs) cache.attach(c);
  Runner runner(s);
  return runner.run();
}

std::string format_leaderboard(const SweepResult& result) {
  std::vector<const TrialOutcome*> rows;
  for (const TrialOutcome& t : result.trials) rows.push_back(&t);
  const auto key = [](const TrialOutcome* t) {
    const bool ran = t->status == TrialStatus::kFinished || t->status == TrialStatus::kStopped;
    return std::make_tuple(ran && t->last_val ? 0 : 1, t->last_val.value_or(INFINITY), t->id);
  };
  std::stable_sort(rows.begin(), rows.end(), [&](auto* a, auto* b) { return key(a) < key(b); });
  size_t wv = 6;
  for (auto* t : rows) wv = std::max(wv, format_values(t->values).size());
  std::string out;
  char buf[1024];
  std::snprintf(buf, sizeof buf, "%4s  %-9s  %-*s  %6s  %10s  %8s  %8s  %s\n", "rank", "trial", static_cast<int>(wv),
                "values", "steps", "train loss", "val loss", "best val", "status");
  out += buf;
  int rank = 0;
  for (auto* t : rows) {
    const auto num = [](const std::optional<double>& v) {
      char b[32];
      if (v) std::snprintf(b, sizeof b, "%.4f", *v);
      else std::snprintf(b, sizeof b, "-");
      return std::string(b);
    };
    std::string status = status_name(t->status);
    if (t->status == TrialStatus::kStopped) status = "stopped at step " + std::to_string(t->steps);
    else if (!t->reason.empty()) status += ": " + t->reason;
    std::snprintf(buf, sizeof buf, "%4d  %-9s  %-*s  %6d  %10s  %8s  %8s  %s\n", ++rank, trial_name(t->id).c_str(),
                  static_cast<int>(wv), plain_values(t->values).c_str(), t->steps, num(t->final_loss).c_str(),
                  num(t->last_val).c_str(), num(t->best_val).c_str(), status.c_str());
    out += buf;
  }
  return out;
}

}  // namespace zt::sweep
