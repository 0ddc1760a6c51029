// The sweep runner (sweep/runner.h). One host thread per running trial calls train(); the caller's
// thread hands out device subsets (DevicePacker) and reacts when a trial ends. Files in SWEEP_DIR:
//   sweep.json      the command and space; a rerun with another command is refused
//   results.jsonl   one line per finished trial (finished, stopped, failed, does not fit): never rerun
//   rungs.jsonl     every ASHA report (trial, step, loss, decision) and promotion of a paused trial
//                   (trial, step, "promote") in order: a rerun rebuilds Asha and the paused set from
//                   it and gives a rung already reported its recorded decision
//   trial-NNN/      ckpt/ (saved at every rung and at the end), metrics.jsonl (the trial's records
//                   over all runs of the sweep), metrics.run.jsonl (the current run's, merged in after)
#include "sweep/runner.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

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

std::string trial_dir(const std::string& root, int id) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "trial-%03d", id);
  return (fs::path(root) / buf).string();
}

std::string trial_name(int id) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "trial-%03d", id);
  return buf;
}

// Lines that parse; a torn last line (a kill in the middle of a write) is skipped.
std::vector<json> read_jsonl(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object()) out.push_back(std::move(j));
  }
  return out;
}

// One write with O_APPEND, then fsync: a reader sees whole lines (the last one possibly torn by a kill).
void append_line(const std::string& path, const std::string& line) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) ZT_THROW(ErrorKind::kIo, "cannot open ", path, " for appending: ", errno_text(errno));
  const std::string text = line + "\n";
  try {
    write_all(fd, text.data(), text.size(), path);
    fsync_fd(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

std::optional<double> finite_number(const json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_number()) return std::nullopt;
  return j[key].get<double>();
}

json values_json(const std::vector<std::pair<std::string, std::string>>& values) {
  json v = json::array();
  for (const auto& [k, x] : values) v.push_back({k, x});
  return v;
}

json outcome_json(const TrialOutcome& t) {
  json curve = json::array();
  for (const auto& [s, v] : t.val_curve) curve.push_back({s, v});
  const auto opt = [](const std::optional<double>& v) { return v && std::isfinite(*v) ? json(*v) : json(nullptr); };
  return {{"trial", t.id},        {"values", values_json(t.values)}, {"status", t.status},
          {"reason", t.reason},   {"steps", t.steps},                {"final_loss", opt(t.final_loss)},
          {"best_val_loss", opt(t.best_val)}, {"last_val_loss", opt(t.last_val)}, {"val_curve", curve}};
}

TrialOutcome outcome_from_json(const json& j) {
  TrialOutcome t;
  t.id = j.value("trial", -1);
  for (const auto& p : j.value("values", json::array()))
    if (p.is_array() && p.size() == 2) t.values.emplace_back(p[0].get<std::string>(), p[1].get<std::string>());
  t.status = j.value("status", std::string());
  t.reason = j.value("reason", std::string());
  t.steps = j.value("steps", 0);
  t.final_loss = finite_number(j, "final_loss");
  t.best_val = finite_number(j, "best_val_loss");
  t.last_val = finite_number(j, "last_val_loss");
  for (const auto& p : j.value("val_curve", json::array()))
    if (p.is_array() && p.size() == 2) t.val_curve.emplace_back(p[0].get<int>(), p[1].get<double>());
  t.resumed = true;
  return t;
}

// metrics.jsonl = its records up to step `cut` + every record of metrics.run.jsonl (cut < 0: just
// before the run file's first step). A killed run's file is merged the same way before the next.
void merge_run_metrics(const std::string& dir, int cut) {
  const std::string run_path = dir + "/metrics.run.jsonl", path = dir + "/metrics.jsonl";
  if (!fs::exists(run_path)) return;
  const std::vector<json> run = read_jsonl(run_path);
  if (cut < 0) {
    cut = INT32_MAX;
    for (const json& r : run)
      if (r.contains("step")) cut = std::min(cut, r["step"].get<int>() - 1);
  }
  std::string text;
  for (const json& r : read_jsonl(path))
    if (r.contains("step") && r["step"].get<int>() <= cut) text += r.dump() + "\n";
  for (const json& r : run) text += r.dump() + "\n";
  write_file_atomic(path, text, "trial metrics file");
  fs::remove(run_path);
}

// The trial's curve and losses from its merged metrics.
void fill_from_metrics(const std::string& dir, TrialOutcome& t) {
  t.val_curve.clear();
  t.steps = 0;
  for (const json& r : read_jsonl(dir + "/metrics.jsonl")) {
    if (!r.contains("step")) continue;
    const int step = r["step"].get<int>();
    const std::string ev = r.value("event", std::string());
    if (ev == "eval") {
      if (const auto v = finite_number(r, "val_loss")) t.val_curve.emplace_back(step, *v);
    } else if (ev.empty() && r.contains("loss")) {
      t.steps = std::max(t.steps, step);
      t.final_loss = finite_number(r, "loss");
    }
  }
  if (!t.val_curve.empty()) {
    t.last_val = t.val_curve.back().second;
    t.best_val = t.last_val;
    for (const auto& e : t.val_curve) t.best_val = std::min(*t.best_val, e.second);
  }
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
  explicit Runner(const SweepSpec& spec) : spec_(spec), asha_(spec.min_steps, spec.max_steps, spec.eta) {}
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
  void finish_trial(TrialOutcome t);  // records it (results.jsonl) and prints its line
  void live(const std::string& line);

  const SweepSpec& spec_;
  Asha asha_;
  std::set<int> rungs_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, TrialOutcome> done_;                // finished trials (earlier runs and this one)
  std::map<std::pair<int, int>, bool> decisions_;   // (trial, rung step) -> continue
  std::vector<TrainConfig> configs_;                // ready to run (devices etc. set at launch)
  std::vector<std::string> unfit_;                  // per trial: the plan's verdict ("" fits)
  std::vector<int> ended_;                          // trial ids whose threads are done (to join)
  std::map<int, int> paused_;                       // ASHA: trial -> the rung step it waits at
  int64_t seq_ = 0;
  int signal_ = 0;
};

void Runner::live(const std::string& line) {
  if (!spec_.live) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Runner::open_dir() {
  fs::create_directories(spec_.dir);
  const std::string path = spec_.dir + "/sweep.json";
  json trials = json::array();
  for (const TrialValues& t : spec_.trials) trials.push_back({{"trial", t.id}, {"values", values_json(t.values)}});
  const json want = {{"command", spec_.command}, {"space", spec_.space_specs}, {"trials", trials}};
  if (fs::exists(path)) {
    std::ifstream f(path);
    const json have = json::parse(f, nullptr, false);
    ZT_REQUIRE(!have.is_discarded() && have.value("command", std::string()) == spec_.command, "--sweep-dir ",
               spec_.dir, " holds a different sweep (",
               have.is_discarded() ? std::string("unreadable sweep.json") : "command: " + have.value("command", std::string()),
               "); rerun that exact command to continue it, or give a new --sweep-dir");
    return;
  }
  write_file_atomic(path, want.dump(2) + "\n", "sweep.json");
}

void Runner::load_state() {
  for (const json& j : read_jsonl(spec_.dir + "/results.jsonl")) {
    TrialOutcome t = outcome_from_json(j);
    if (t.id >= 0 && t.id < static_cast<int>(spec_.trials.size())) done_[t.id] = std::move(t);
  }
  // Asha's state is the sequence of its reports: replay them in their original order.
  for (const json& j : read_jsonl(spec_.dir + "/rungs.jsonl")) {
    const int trial = j.value("trial", -1), step = j.value("step", 0);
    if (trial < 0) continue;
    if (j.value("promote", false)) {
      asha_.promote(trial, step);
      decisions_[{trial, step}] = true;
      paused_.erase(trial);
      continue;
    }
    if (decisions_.count({trial, step})) continue;  // a report repeated by a resumed run
    // A diverged trial's NaN loss is written as null.
    const double loss = j.contains("loss") && j["loss"].is_number() ? j["loss"].get<double>() : NAN;
    const bool go = asha_.report(trial, step, loss);
    decisions_[{trial, step}] = go;
    if (!go && !done_.count(trial)) paused_[trial] = step;
  }
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
  t.status = "stopped";
  t.reason = "ASHA: not in the top 1/eta at its rung";
  try {
    fill_from_metrics(trial_dir(spec_.dir, id), t);
  } catch (const std::exception&) {
  }
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
      const BatchSplit split = even_split(shape.cfg.batch_size, k, shape.cfg.micro_batch_size);
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
    go = asha_.report(id, step, loss);
    decisions_[{id, step}] = go;
    append_line(spec_.dir + "/rungs.jsonl",
                json{{"trial", id}, {"step", step}, {"loss", loss}, {"continue", go}}.dump());
  }
  return go ? EvalAction::kSave : EvalAction::kStop;
}

void Runner::finish_trial(TrialOutcome t) {
  // Caller holds mu_.
  append_line(spec_.dir + "/results.jsonl", outcome_json(t).dump());
  std::string what = t.status;
  if (t.status == "stopped") what = "stopped at step " + std::to_string(t.steps);
  if (!t.reason.empty() && t.status != "stopped") what += ": " + t.reason;
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
    t.status = "finished";
    if (final_promotion) t.reason = "promoted at the end as the best at the highest rung reached";
  } catch (const Error& e) {
    merge_run_metrics(dir, -1);
    t.status = "failed";
    t.reason = (e.kind() == ErrorKind::kDiverged ? "diverged: "
                : e.kind() == ErrorKind::kDevice ? "device failed: "
                : e.kind() == ErrorKind::kOutOfMemory ? "out of memory: "
                                                      : "") + e.message();
  } catch (const std::exception& e) {
    t.status = "failed";
    t.reason = std::string("internal error: ") + e.what();
  }
  try {
    fill_from_metrics(dir, t);
  } catch (const std::exception&) {
  }
  std::lock_guard lock(mu_);
  if (sig != 0) {
    signal_ = sig;  // not recorded: a rerun continues it from its checkpoint
  } else {
    try {
      finish_trial(t);
    } catch (const std::exception& e) {
      live(trial_name(id) + " | results.jsonl not written: " + e.what());
    }
  }
  if (done_.count(id)) done_[id].released_seq = seq_;
  ++seq_;
  ended_.push_back(id);
  cv_.notify_all();
}

SweepResult Runner::run() {
  prepare();  // before touching SWEEP_DIR: bad input leaves nothing behind
  open_dir();
  load_state();
  // The sweep's own handler: each trial's train() installs and restores the same one.
  const StopSignals signals;
  DevicePacker packer(spec_.devices);
  std::vector<int> pending;
  std::vector<int> order(spec_.trials.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  if (spec_.asha)  // Fisher-Yates with Philox: the same order on every machine and every rerun
    for (size_t i = order.size(); i > 1; --i)
      std::swap(order[i - 1], order[philox_u32(spec_.order_seed, 0x5eed, i) % i]);
  for (int id : order)
    if (!done_.count(id) && !paused_.count(id)) pending.push_back(id);  // paused ones wait for a promotion
  if (spec_.live) {
    std::printf("sweep: %zu trials (%zu done before), %d device%s, %d per trial, scheduler %s\n", spec_.trials.size(),
                spec_.trials.size() - pending.size(), spec_.devices, spec_.devices == 1 ? "" : "s",
                spec_.devices_per_trial, spec_.asha ? "asha" : "none");
    std::fflush(stdout);
  }
  std::map<int, std::thread> threads;
  std::map<int, std::vector<int>> held;
  std::map<int, int64_t> acquired;
  std::unique_lock lock(mu_);
  size_t next = 0;
  while (true) {
    const int sig = StopSignals::pending();
    if (sig != 0 && signal_ == 0) signal_ = sig;
    while (signal_ == 0) {
      // ASHA's get_job: a promotion of a paused trial comes before a new trial.
      if (const auto [pid, pstep] = next_promotion(); pid >= 0) {
        // The paused run's thread ends right after its report: join it (below) before starting
        // the promoted run, whose thread takes the same key (a second std::thread emplaced under
        // a live key would be destroyed joinable: std::terminate).
        if (threads.count(pid) != 0) break;
        auto devs = packer.acquire(spec_.devices_per_trial);
        if (!devs) break;
        asha_.promote(pid, pstep);
        decisions_[{pid, pstep}] = true;
        paused_.erase(pid);
        append_line(spec_.dir + "/rungs.jsonl", json{{"trial", pid}, {"step", pstep}, {"promote", true}}.dump());
        held[pid] = *devs;
        acquired[pid] = seq_++;
        live(trial_name(pid) + " |" + format_values(spec_.trials[static_cast<size_t>(pid)].values) +
             " | promoted at step " + std::to_string(pstep) + " on device" + (devs->size() == 1 ? " " : "s ") +
             device_list(*devs));
        threads.emplace(pid, std::thread([this, id = pid, d = *devs] { run_trial(id, d); }));
        continue;
      }
      if (next >= pending.size()) break;
      const int id = pending[next];
      if (!unfit_[static_cast<size_t>(id)].empty()) {
        TrialOutcome t;
        t.id = id;
        t.values = spec_.trials[static_cast<size_t>(id)].values;
        t.status = "does not fit";
        t.reason = unfit_[static_cast<size_t>(id)];
        finish_trial(std::move(t));
        ++next;
        continue;
      }
      auto devs = packer.acquire(spec_.devices_per_trial);
      if (!devs) break;
      ++next;
      held[id] = *devs;
      acquired[id] = seq_++;
      live(trial_name(id) + " |" + format_values(spec_.trials[static_cast<size_t>(id)].values) + " | started on device" +
           (devs->size() == 1 ? " " : "s ") + device_list(*devs));
      threads.emplace(id, std::thread([this, id, d = *devs] { run_trial(id, d); }));
    }
    // Taken out under the lock: trials that end while this thread joins others land in ended_ again.
    std::vector<int> ended;
    ended.swap(ended_);
    for (int id : ended) {
      lock.unlock();
      threads[id].join();
      lock.lock();
      threads.erase(id);
      packer.release(held[id]);
      held.erase(id);
      if (done_.count(id)) done_[id].acquired_seq = acquired[id];
    }
    if (threads.empty() && signal_ == 0 && next_promotion().first >= 0) continue;  // the last report made one
    if (threads.empty() && (next >= pending.size() || signal_ != 0)) break;
    cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return !ended_.empty(); });
  }
  // Out of work: the trials still paused stopped at their rungs.
  if (signal_ == 0) {
    std::vector<int> left;
    for (const auto& entry : paused_) left.push_back(entry.first);
    for (int id : left) finish_paused(id);
    paused_.clear();
  }
  // With fewer trials than eta^(rungs) nobody may reach --max-steps; then the best trial at the
  // highest rung reached continues there from its rung checkpoint (without further reports), so
  // that the sweep's pick has a full-length result.
  if (spec_.asha && signal_ == 0) {
    const TrialOutcome* best = nullptr;
    bool any_finished = false;
    for (const auto& [id, t] : done_) {
      any_finished |= t.status == "finished";
      if (t.status != "stopped" || !t.last_val) continue;
      if (!best || t.steps > best->steps || (t.steps == best->steps && *t.last_val < *best->last_val)) best = &t;
    }
    if (!any_finished && best) {
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
      if (done_.count(id)) done_[id].acquired_seq = at, done_[id].devices = *devs;
    }
  }
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
    const bool ran = t->status == "finished" || t->status == "stopped";
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
    std::string status = t->status;
    if (status == "stopped") status = "stopped at step " + std::to_string(t->steps);
    else if (!t->reason.empty()) status += ": " + t->reason;
    std::snprintf(buf, sizeof buf, "%4d  %-9s  %-*s  %6d  %10s  %8s  %8s  %s\n", ++rank, trial_name(t->id).c_str(),
                  static_cast<int>(wv), plain_values(t->values).c_str(), t->steps, num(t->final_loss).c_str(),
                  num(t->last_val).c_str(), num(t->best_val).c_str(), status.c_str());
    out += buf;
  }
  return out;
}

}  // namespace zt::sweep
