// The training loop (llm.c's main is the shape): resolve the run, build a World on the devices,
// then per step: enqueue it, read the previous one (one step late, train/step.h), log, evaluate,
// sample, checkpoint. Each side activity is one call that owns its state (train/evaluator.h, sampler.h, logger.h, checkpointer.h, recovery.h); when a
// device is lost, the World is rebuilt on the survivors from the newest host snapshot.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <regex>

#include "core/files.h"
#include "core/format.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "pipeline/simulate.h"
#include "train/checkpointer.h"
#include "train/evaluator.h"
#include "train/graph_step.h"
#include "train/logger.h"
#include "train/plan.h"
#include "train/processes.h"
#include "train/recovery.h"
#include "train/run_shape.h"
#include "train/sampler.h"
#include "tokenizer/bpe.h"
#include "train/signals.h"
#include "train/state_io.h"
#include "train/step.h"
#include "train/trace.h"
#include "train/world.h"

namespace zt {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The process a process group's sentence names as died or stalled (the last one named: a notice
// quotes the sentence of the process that gave up), or one it could not reach.
std::optional<int> lost_process_in(const std::string& why) {
  static const std::regex named(R"(rank (\d+) has died or stalled|(?:could not|failed to) (?:send to|receive from) rank (\d+))");
  std::optional<int> lost;
  for (auto it = std::sregex_iterator(why.begin(), why.end(), named); it != std::sregex_iterator(); ++it)
    lost = std::stoi((*it)[1].matched ? (*it)[1].str() : (*it)[2].str());
  return lost;
}

// Runs fn when the scope ends (also by an exception).
struct ScopeExit {
  std::function<void()> fn;
  ~ScopeExit() { fn(); }
};

}  // namespace

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kAuto: return "auto";
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}

FaultInjection parse_fault_injection(const std::string& spec) {
  FaultInjection f;
  auto bad = [&](const std::string& why) {
    ZT_THROW(ErrorKind::kInvalidArgument, "--inject-fault '", spec, "' ", why,
             "; expected device=D,step=S[,kind=error|hang], e.g. device=2,step=10");
  };
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string item = spec.substr(pos, comma - pos);
    const size_t eq = item.find('=');
    if (eq == std::string::npos) bad("has no key=value in '" + item + "'");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    auto number = [&] {
      char* end = nullptr;
      const long v = std::strtol(value.c_str(), &end, 10);
      if (value.empty() || *end != 0 || v < 0) bad("has a bad number '" + value + "'");
      if (v > 1000000000) bad("has " + key + "=" + value + ", above 1000000000 (it is held in 32 bits)");
      return static_cast<int>(v);
    };
    if (key == "device") f.device = number();
    else if (key == "step") f.step = number();
    else if (key == "kind" && (value == "error" || value == "hang")) f.hang = value == "hang";
    else bad("has an unknown item '" + item + "'");
    pos = comma + 1;
  }
  if (f.device < 0 || f.step < 1) bad("needs device=D and step=S >= 1");
  return f;
}

LossScale parse_loss_scale(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  LossScale ls;
  if (text == "auto") ls.mode = LossScale::Mode::kAuto;
  else if (text == "dynamic") ls.mode = LossScale::Mode::kDynamic;
  else if (text == "none") ls.mode = LossScale::Mode::kNone;
  else if (end && *end == 0 && !text.empty() && std::isfinite(v) && v > 0 && v <= 3.4e38)
    ls.mode = LossScale::Mode::kFixed, ls.fixed = static_cast<float>(v);
  else if (end && *end == 0 && !text.empty() && std::isfinite(v) && v > 3.4e38)
    ZT_THROW(ErrorKind::kInvalidArgument, "--loss-scale ", text,
             " is above 3.4e38, the largest fp32 number (the scale is held as a float)");
  else
    ZT_THROW(ErrorKind::kInvalidArgument, "--loss-scale must be dynamic, none or a positive number, got '", text, "'");
  return ls;
}

namespace {

// ---------------- run resolution: every check before anything is allocated ----------------------
// The data-independent part is train/run_shape.h (shared with `plan`); this opens the data and
// checks the model against it.
void open_data(RunContext& run) {
  TrainConfig& cfg = run.cfg;
  const ModelConfig& mc = run.mc;
  if (run.is_gpt) {
    run.lang = cfg.language_data ? cfg.language_data : open_language_data(cfg.data, cfg.seed, mc.vocab);
    ZT_REQUIRE(run.lang->vocab_size() <= mc.vocab, "the data has token ids up to ", run.lang->vocab_size() - 1,
               " but the model's vocabulary is ", mc.vocab, "; use --vocab ", run.lang->vocab_size(), " or more");
    run.lang->validate(run.T);
    if (const auto v = tokenizer_vocab_beside(cfg.data); v && *v <= mc.vocab)
      run.tokenizer = std::make_shared<const BpeTokenizer>(BpeTokenizer::load_dir(data_directory(cfg.data), 0));
    return;
  }
  run.images = cfg.image_data ? cfg.image_data
                              : open_image_data(cfg.data == "synthetic" ? "fashion-mnist" : cfg.data, cfg.seed);
  ZT_REQUIRE(run.images->image_size() == mc.input_dim && run.images->num_classes() == mc.classes, "the data has ",
             run.images->image_size(), " inputs and ", run.images->num_classes(), " classes, the model expects ",
             mc.input_dim, " and ", mc.classes);
  // Image data: the step count follows from the epochs and the training set's size.
  const int64_t per_epoch = run.images->batches_per_epoch(Split::kTrain, cfg.batch_size);
  ZT_REQUIRE(per_epoch >= 1, "--batch-size ", cfg.batch_size, " is larger than the training set");
  if (cfg.steps < 0) cfg.steps = static_cast<int>((cfg.epochs > 0 ? cfg.epochs : 3) * per_epoch);
  if (cfg.warmup_steps < 0) cfg.warmup_steps = std::max(1, cfg.steps / 50);
  if (cfg.eval_every < 0) cfg.eval_every = std::max(1, cfg.steps / 4);
}

// Refuses a run that cannot fit, with the cheapest fix, before anything is allocated; keeps the
// plan's predicted pool peak per device for the summary.
void check_fits(RunContext& run, Runtime& rt, const BatchSplit& split) {
  PlanInputs in = run.plan;
  in.micro_batch = split.micro;
  in.micro_batches = split.accum;
  const MemoryPlan plan = plan_run(run.mc, rt, in);
  require_fits(plan);
  run.planned_peak_bytes.clear();
  for (const DevicePlan& d : plan.per_device) run.planned_peak_bytes.push_back(d.peak_allocated);
}

// ---------------- the trainer --------------------------------------------------------------------
class Trainer {
 public:
  Trainer(RunContext& run, Logger& log, TraceRecorder* tracer) : run_(run), cfg_(run.cfg), log_(log), tracer_(tracer) {}
  TrainResult run(std::unique_ptr<Runtime> rt, DeviceSpec spec, const BatchSplit& split);

 private:
  bool train_world(World& w);
  bool must_flush(World& w, int step) const;
  bool fault_due(int step) const;
  bool read_pending(World& w, std::optional<PendingStep>& pending, bool latest);
  bool finish_step(World& w, int step, const StepStats& st, double dt, bool latest);
  void start_world(World& w, int index);
  void print_header(World& w, const std::string& resumed_from);
  void inject_faults(World& w, int step);
  void after_step(World& w, int step, const StepStats& st, double dt);
  void on_skipped(World& w, int step, const StepStats& st, bool latest);
  EvalAction evaluate_at(World& w, int step);
  void save_at(World& w, int step);
  bool recover(World& w, const Error& e, int step);
  void lost_process(World& w, const Error& e, int step);
  void stop_for_signal(World& w, int step, int sig);
  void finish(World& w);
  void keep_final_state(World& w);
  RunReport run_report(World& w);
  nlohmann::json memory_report(World& w, RunReport& report);
  void write_trace(World& w);
  // Evaluation and sampling run collectives too (stage 3 gathers); keep them out of the per-step
  // communication figure.
  template <typename Fn> void side_comm(World& w, Fn fn);

  RunContext& run_;
  TrainConfig& cfg_;
  Logger& log_;
  TraceRecorder* tracer_;
  TrainResult result_;
  TrainCounters counters_;
  // --snapshot-every: the newest host snapshot (never changed once taken: a save of its step shares it).
  std::shared_ptr<const HostSnapshot> snapshot_;
  std::optional<Survivors> survivors_;    // set when a device was lost
  DeviceSpec spec_;                       // the current world's devices
  std::vector<bool> faults_done_;
  DType working_ = DType::kF32;
  ZeroOptions::Scaling scaling_ = ZeroOptions::Scaling::kNone;
  int consecutive_skips_ = 0;
  // Read every step before the next is enqueued from now on (a skipped step was read late).
  bool eager_ = false;
  Clock::time_point mark_;  // where the wall time of the step read next began (read_pending)
  int world_start_ = 0;  // the step the current world started from
  double train_time_ = 0;
  std::vector<double> step_seconds_;  // each timed step of the current world (the summary's throughput)
  Clock::time_point t0_;
  std::unique_ptr<StepPhaseTimer> timer_;
  std::vector<uint64_t> side_bytes_, side_tensor_bytes_;
  uint64_t side_across_ = 0;  // of w.bytes_sent_across(), like side_bytes_
  std::unique_ptr<Checkpointer> checkpointer_;
};

TrainResult Trainer::run(std::unique_ptr<Runtime> rt, DeviceSpec spec, const BatchSplit& first_split) {
  working_ = run_.working;
  scaling_ = run_.scaling;
  spec_ = std::move(spec);
  faults_done_.assign(cfg_.inject_faults.size(), false);
  result_.precision = precision_name(run_.precision);
  result_.entropy_floor = run_.is_gpt ? run_.lang->entropy_rate() : std::nullopt;
  const StopSignals signals;
  checkpointer_ = std::make_unique<Checkpointer>(run_, log_);  // before --resume: it owns the directory
  BatchSplit split = first_split;
  for (int index = 0;; ++index) {
    if (survivors_) {
      // The lost world is gone (devices included); the survivors share the same global batch.
      spec_ = survivors_->spec;
      survivors_.reset();
      rt = Runtime::create(spec_, CpuDeviceOptions{cfg_.device_memory}, tracer_);
      split = split_batch(cfg_.batch_size, rt->size() / cfg_.tensor_parallel / cfg_.pipeline_parallel,
                          cfg_.micro_batch_size);
      check_fits(run_, *rt, split);
    }
    World world(run_, std::move(rt), split, working_, scaling_);
    start_world(world, index);
    if (train_world(world)) {
      if (result_.signal == 0) finish(world);  // a stop by signal reported itself in one line
      return result_;
    }
  }
}

// Loads the state the world starts from: the newest snapshot after a lost device, else a
// checkpoint with --resume, else the seeded initialisation the World was built with.
void Trainer::start_world(World& w, int index) {
  std::string resumed_from;
  std::vector<std::string> notes;
  if (index > 0) {
    counters_ = w.apply_state(*source_of(*snapshot_), snapshot_->meta);
  } else if (!cfg_.resume.fresh()) {
    // Every process opens the checkpoint itself (each reads what its ranks keep) and all must have
    // chosen the same one; a process that cannot open it is named to the others rather than left
    // to time out.
    std::optional<ResolvedCheckpoint> resolved;
    std::optional<Error> failed;
    try {
      resolved = resolve_resume(cfg_.checkpoint_dir, cfg_.resume, &notes);
    } catch (const Error& e) {
      failed = e;
    }
    const double mine = failed ? -2.0 : resolved ? static_cast<double>(resolved->step) : -1.0;
    const std::vector<double> all = run_.processes->all_gather({mine}, "the checkpoint each process resumes from");
    if (failed) throw *failed;
    for (size_t p = 0; p < all.size(); ++p) {
      ZT_REQUIRE(all[p] != -2.0, "process ", p, " could not open the checkpoint to resume from (its own error says "
                 "why); every process must see the same checkpoint directory (a file system shared by all)");
      ZT_REQUIRE(all[p] == mine, "process ", p, " would resume from step ", all[p], " but process ",
                 run_.processes->rank(), " from step ", mine, "; every process must see the same checkpoint directory");
    }
    if (resolved) {
      const nlohmann::json& meta = resolved->reader.meta();
      // step == --steps: nothing to train; the state is loaded (resharded) and saved again, which
      // converts a checkpoint to another device count, stage or precision.
      ZT_REQUIRE(meta.value("step", 0) >= 1 && meta.value("step", 0) <= cfg_.steps, "checkpoint ", resolved->path,
                 " is at step ", meta.value("step", 0), " but the run has --steps ", cfg_.steps,
                 "; raise --steps to at least the checkpoint's step");
      counters_ = w.apply_state(*source_of(resolved->reader), meta);
      resumed_from = resolved->path + " (step " + std::to_string(counters_.step) + ", saved on " +
                     std::to_string(meta.value("devices", 0)) + " device(s) at ZeRO stage " +
                     std::to_string(meta.value("zero_stage", -1)) + " in " + meta.value("precision", std::string("?")) + ")";
    } else {
      resumed_from = "nothing: " + cfg_.checkpoint_dir + " holds no checkpoint yet, starting from scratch";
    }
  }
  if (index == 0) {
    result_.resume_notes = notes;
    result_.start_step = counters_.step;
    print_header(w, resumed_from);
    checkpointer_->write_run_config();
  } else {
    // The steps after the snapshot are redone: drop what they reported.
    result_.losses.resize(static_cast<size_t>(counters_.step - result_.start_step));
    result_.loss_scales.resize(std::min(result_.loss_scales.size(), result_.losses.size()));
    std::erase_if(result_.val_losses, [&](const auto& v) { return v.first > counters_.step; });
  }
  result_.skipped_steps = counters_.skipped_steps;
  // AdamW's step count lives on the devices (OptimizerStep::step_on_device): from the state loaded.
  w.for_ranks([&](int r) { w.engine_of(r).rank(w.engine_rank(r)).scaler().set_update_count(counters_.updates); });
  result_.devices = w.size() * run_.processes->size();
  result_.zero_stage = cfg_.zero_stage;
  timer_ = std::make_unique<StepPhaseTimer>(w.size());
  side_bytes_.assign(static_cast<size_t>(w.size()), 0);
  side_tensor_bytes_.assign(static_cast<size_t>(w.size()), 0);
  side_across_ = 0;
  w.reset_comm_counters();
  t0_ = Clock::now();
  train_time_ = 0;
  step_seconds_.clear();
  world_start_ = counters_.step;
  if (cfg_.snapshot_every > 0) {
    // A snapshot now, so that a failure before the first periodic one loses only the steps since the start.
    const auto ts0 = Clock::now();
    snapshot_ = std::make_shared<const HostSnapshot>(snapshot_world(w, run_, counters_, result_.precision, scaling_));
    checkpointer_->replicate(*snapshot_);
    log_.emit({{"event", "snapshot"}, {"step", counters_.step}, {"bytes", snapshot_->bytes()},
               {"stall_ms", seconds_since(ts0) * 1e3}});
  }
}

void Trainer::print_header(World& w, const std::string& resumed_from) {
  if (!log_.text()) return;
  const ModelConfig& mc = run_.mc;
  char buf[512];
  log_.line("model: " + mc.describe() + " (" + format_count(static_cast<double>(run_.mc.num_parameters())) +
            " parameters)");
  log_.line("data: " + (run_.is_gpt ? run_.lang->describe() : run_.images->describe()));
  std::string names;
  for (const std::string& n : w.device_names()) names += (names.empty() ? "" : ", ") + n;
  std::snprintf(buf, sizeof buf, "devices: %s (ZeRO stage %d, %s%s%s%s)", names.c_str(), cfg_.zero_stage,
                precision_name(run_.precision), cfg_.tf32 ? ", TF32 matmuls" : "",
                cfg_.deterministic_attention ? "" : ", non-deterministic attention backward",
                scaling_ == ZeroOptions::Scaling::kDynamic ? ", dynamic loss scaling"
                : scaling_ == ZeroOptions::Scaling::kFixed ? ", fixed loss scale"
                                                            : "");
  log_.line(buf);
  if (!w.runtime().fallback_note().empty()) log_.line("note: " + w.runtime().fallback_note());
  if (const std::string n = cuda_graphs_note(cfg_, w.runtime().backend(), run_.working); !n.empty())
    log_.line("note: " + n);
  const bool tp = cfg_.tensor_parallel > 1;
  // The mesh of every process's ranks (the tensor axis inside each process, pipelines in one).
  const MeshShape shape = w.mesh().shape();
  const std::string mesh =
      Mesh(MeshShape{.data = w.data_ranks(), .tensor = shape.tensor, .pipeline = shape.pipeline},
           w.data_ranks() * shape.tensor * shape.pipeline)
          .describe() +
      run_.processes->span();
  if (tp)
    log_.line("mesh: " + mesh + ", tensor-parallel GPT (Megatron layout" +
              (cfg_.sequence_parallel ? ", sequence parallel)" : ")"));
  for (const std::string& line : w.stages().describe(w, tp)) log_.line(line);
  const bool ranks = w.mesh().shape().data < w.size();
  std::snprintf(buf, sizeof buf, "batch: %d x %d tokens = %d %s x %d micro-batch%s x %d, %d steps, %s lr %.2g",
                cfg_.batch_size, run_.T, w.data_ranks(),
                w.data_ranks() == 1 ? (ranks ? "data rank" : "device") : (ranks ? "data ranks" : "devices"),
                w.split().accum, w.split().accum == 1 ? "" : "es", w.split().micro, cfg_.steps,
                cfg_.optimizer == OptimizerKind::kAdamW ? "AdamW" : "SGD", cfg_.lr);
  log_.line(buf);
  if (result_.entropy_floor) {
    std::snprintf(buf, sizeof buf, "entropy floor of the data: %.4f nats/token", *result_.entropy_floor);
    log_.line(buf);
  }
  for (const std::string& n : result_.resume_notes) log_.line("note: " + n);
  if (!w.init_note().empty()) log_.line(w.init_note());
  if (!resumed_from.empty()) log_.line("resumed from " + resumed_from);
}

// Whether step `step`, just enqueued, must be read before the next one is (step.h says which host
// decisions may come one step late): the last step, a side activity after it (evaluation, sample,
// snapshot, checkpoint), a pending stop signal, the host path (pipeline stages, several processes:
// read already), and runs whose skipped steps need the eager order (a scaled loss, poked gradients).
bool Trainer::must_flush(World& w, int step) const {
  const int n = step + 1;
  const bool last = n == cfg_.steps;
  if (last || !cfg_.test.read_scalars_late || eager_ || w.host_scalars()) return true;
  if (scaling_ != ZeroOptions::Scaling::kNone || !cfg_.test.gradient_faults.empty()) return true;
  if ((cfg_.eval_every > 0 && n % cfg_.eval_every == 0) ||
      std::find(cfg_.eval_steps.begin(), cfg_.eval_steps.end(), n) != cfg_.eval_steps.end())
    return true;
  if (run_.is_gpt && cfg_.sample_every > 0 && n % cfg_.sample_every == 0 && log_.text()) return true;
  if (cfg_.snapshot_every > 0 && n % cfg_.snapshot_every == 0) return true;
  if (checkpointer_->enabled() && cfg_.save_every > 0 && n % cfg_.save_every == 0) return true;
  return StopSignals::pending() != 0;
}

// An --inject-fault that fires when step `step` (0-based) starts.
bool Trainer::fault_due(int step) const {
  for (size_t i = 0; i < cfg_.inject_faults.size(); ++i)
    if (!faults_done_[i] && cfg_.inject_faults[i].step == step + 1) return true;
  return false;
}

// Reads the pending step and handles it (finish_step). latest: no later step is enqueued (a flush).
// Its wall time runs from the end of the previous step's handling (or from its own enqueue when
// none was pending): the host's time per step, without logging and side activities.
bool Trainer::read_pending(World& w, std::optional<PendingStep>& pending, bool latest) {
  const PendingStep p = std::move(*pending);
  pending.reset();
  const StepStats st = read_step(w, p, *timer_);
  timer_->end_step();
  const bool stop = finish_step(w, p.step, st, seconds_since(mark_), latest);
  mark_ = Clock::now();
  timer_->begin_step();
  return stop;
}

// The loop. Returns true when the run is over (all steps done, or stopped by a signal), false
// when a device was lost and the run goes on in a new World (survivors_ is set). Step k + 1 is
// enqueued before step k is read (one step late) unless must_flush(k) says otherwise.
bool Trainer::train_world(World& w) {
  const LrConfig lrc{cfg_.lr, cfg_.min_lr, cfg_.warmup_steps, cfg_.steps, cfg_.schedule};
  const bool on_cuda = w.runtime().backend() == Backend::kCuda;
  // 1-based, inclusive; {0, 0} = no profiler capture.
  const std::pair<int, int> profile =
      cfg_.profile_steps.empty() ? std::pair<int, int>{0, 0} : parse_step_range(cfg_.profile_steps, cfg_.steps);
  std::optional<PendingStep> pending;
  for (int step = counters_.step; step < cfg_.steps; ++step) {
    int at = step;  // the step an error belongs to: the one being read or enqueued
    try {
      if (pending && fault_due(step)) {
        // The fault hits step `step` as when every step is read at once: the earlier one first.
        at = pending->step;
        if (read_pending(w, pending, true)) return true;  // a stop signal came meanwhile
        at = step;
      }
      inject_faults(w, step);
      if (!pending) {
        mark_ = Clock::now();
        timer_->begin_step();
      }
      {
        // nsys --capture-range=cudaProfilerApi records steps profile.first..second.
        if (on_cuda && step + 1 == profile.first) profiler_start();
        const ScopeExit stop_profiler{[&] {
          if (on_cuda && step + 1 == profile.second) profiler_stop();
        }};
        const NvtxRange step_range(NvtxCategory::kStep, "step " + std::to_string(step + 1));
        PendingStep next = enqueue_step(w, run_, step, learning_rate(lrc, step), counters_.updates, *timer_);
        if (pending) {
          at = pending->step;
          read_pending(w, pending, false);  // one step late: the devices run `step` meanwhile
          at = step;
        }
        pending = std::move(next);
      }
      if (must_flush(w, step) && read_pending(w, pending, true)) return true;
    } catch (const Error& e) {
      // Several processes: a lost one stops every survivor (one sentence with the step).
      if (run_.processes->size() > 1) lost_process(w, e, at);
      // A device failed (an error at a synchronisation, or the watchdog gave up on it): with
      // --snapshot-every, drop it and go on from the last snapshot on the others.
      if (!recover(w, e, at)) throw;
      checkpointer_->wait();
      return false;
    }
  }
  if (result_.start_step == cfg_.steps && checkpointer_->enabled()) {
    // Nothing was left to train (a conversion): save what was loaded.
    const std::string path = checkpointer_->save_now(snapshot_world(w, run_, counters_, result_.precision, scaling_));
    log_.line("checkpoint " + path + ": saved what was loaded (no steps left)");
  }
  checkpointer_->wait();
  return true;
}

// Step `step` read: its records, then (latest: no later step is enqueued) what follows it —
// evaluation, sample, snapshot, checkpoint, a stop. must_flush made every step that needs one of
// those the latest when read. Returns true when the run stops here.
bool Trainer::finish_step(World& w, int step, const StepStats& st, double dt, bool latest) {
  result_.cuda_graphs = result_.cuda_graphs || st.graphs;
  if (!st.note.empty()) log_.line("note: " + st.note);
  if (tracer_) w.stages().trace(w, *tracer_);
  result_.loss_scales.push_back(st.loss_scale);
  if (st.skipped) {
    on_skipped(w, step, st, latest);
    // Read late, a skipped step's gradients were gone: read every step from here (a run of skips
    // is diagnosed and limited in the eager order).
    eager_ = true;
  } else {
    consecutive_skips_ = 0;
    ++counters_.updates;
  }
  after_step(w, step, st, dt);
  counters_.step = step + 1;
  counters_.skipped_steps = result_.skipped_steps;
  checkpointer_->poll();
  for (const std::string& m : checkpointer_->take_messages()) log_.line(m);
  if (!latest) return false;
  const bool last = step + 1 == cfg_.steps;
  if (last) {
    // The training steps' traffic, read before the final evaluation's gathers add to it.
    result_.comm_bytes_per_step_per_device.clear();
    result_.tensor_bytes_per_step_per_device.clear();
    const uint64_t steps = static_cast<uint64_t>(cfg_.steps - world_start_);
    for (int r = 0; r < w.size(); ++r) {
      result_.comm_bytes_per_step_per_device.push_back(
          (w.bytes_sent(r) - side_bytes_[static_cast<size_t>(r)]) / steps);
      result_.tensor_bytes_per_step_per_device.push_back(
          (w.tensor_bytes_sent(r) - side_tensor_bytes_[static_cast<size_t>(r)]) / steps);
    }
    // Every device's sent bytes count its hops to other processes too; the rest stayed inside.
    uint64_t sent = 0;
    for (uint64_t b : result_.comm_bytes_per_step_per_device) sent += b;
    result_.across_bytes_per_step = (w.bytes_sent_across() - side_across_) / steps;
    result_.inside_bytes_per_step = sent - std::min(sent, result_.across_bytes_per_step);
  }
  EvalAction action = EvalAction::kContinue;
  if ((cfg_.eval_every > 0 && (step + 1) % cfg_.eval_every == 0) || last ||
      std::find(cfg_.eval_steps.begin(), cfg_.eval_steps.end(), step + 1) != cfg_.eval_steps.end())
    action = evaluate_at(w, step);
  if (run_.is_gpt && cfg_.sample_every > 0 && (step + 1) % cfg_.sample_every == 0 && !last && log_.text()) {
    log_.line("--- sample at step " + std::to_string(step + 1) + " ---");
    std::string text;
    side_comm(w, [&] { text = sample_text(w, run_, cfg_.sample_tokens, static_cast<uint64_t>(step)); });
    log_.line(text);
  }
  if (cfg_.snapshot_every > 0 && (step + 1) % cfg_.snapshot_every == 0 && !last) {
    const auto ts0 = Clock::now();
    snapshot_ = std::make_shared<const HostSnapshot>(snapshot_world(w, run_, counters_, result_.precision, scaling_));
    checkpointer_->replicate(*snapshot_);
    log_.emit({{"event", "snapshot"}, {"step", step + 1}, {"bytes", snapshot_->bytes()},
               {"stall_ms", seconds_since(ts0) * 1e3}});
  }
  if (checkpointer_->enabled() &&
      ((cfg_.save_every > 0 && (step + 1) % cfg_.save_every == 0) || last || action != EvalAction::kContinue))
    save_at(w, step);
  if (action == EvalAction::kStop && !last) {
    checkpointer_->wait();
    result_.stopped_at = step + 1;
    return true;
  }
  // The stop every process learnt with the step's sums (StepStats::stop_signal), so that every
  // process stops after the same step and writes its part of one stop checkpoint.
  if (const int sig = last ? 0 : st.stop_signal; sig != 0) {
    stop_for_signal(w, step, sig);
    return true;
  }
  return false;
}

// --inject-fault device=D,step=S: D is a position in the current world's device list; each fault
// fires once (steps redone after a recovery do not fire it again).
void Trainer::inject_faults(World& w, int step) {
  // Tests of a lost process: ZEROTRAIN_TEST_SIGKILL="P,S" makes process P kill itself with SIGKILL
  // when step S starts (1-based), as a crashed node would vanish.
  if (const char* spec = std::getenv("ZEROTRAIN_TEST_SIGKILL")) {
    int p = -1, s = -1;
    if (std::sscanf(spec, "%d,%d", &p, &s) == 2 && p == run_.processes->rank() && s == step + 1) std::raise(SIGKILL);
  }
  // ZEROTRAIN_TEST_SIGNAL="P,S,SIG": process P receives signal SIG when step S starts (a stop sent
  // to one rank; the processes must agree on it at the step's end).
  if (const char* spec = std::getenv("ZEROTRAIN_TEST_SIGNAL")) {
    int p = -1, s = -1, sig = 0;
    if (std::sscanf(spec, "%d,%d,%d", &p, &s, &sig) == 3 && p == run_.processes->rank() && s == step + 1)
      std::raise(sig);
  }
  for (size_t i = 0; i < cfg_.inject_faults.size(); ++i) {
    const FaultInjection& f = cfg_.inject_faults[i];
    if (faults_done_[i] || step + 1 != f.step) continue;
    ZT_REQUIRE(f.device < w.size(), "--inject-fault device=", f.device, " but the run has ", w.size(), w.size() == 1 ? " device" : " devices");
    faults_done_[i] = true;
    w.device(f.device).inject_fault(f.hang ? FaultKind::kHang : FaultKind::kError);
  }
}

void Trainer::on_skipped(World& w, int step, const StepStats& st, bool latest) {
  ZeroEngine& engine = w.engine_of(0);
  result_.skipped_steps.push_back(step + 1);
  ++consecutive_skips_;
  std::string where;
  // Several processes: no one holds every gradient. Read late (not latest): the step after it
  // overwrote them, so it is not named (only an unscaled run without poked gradients reads late).
  if (consecutive_skips_ == 1 && run_.processes->size() == 1 && latest) {
    // Lazily, only when a run of skips starts; a pipeline's stages in order.
    const int stages = w.mesh().shape().pipeline;
    for (int p = 0; p < stages && where.empty(); ++p)
      where = w.engine_of(w.mesh().rank_at({.data = 0, .tensor = 0, .pipeline = p})).first_nonfinite_gradient();
    if (result_.first_nonfinite.empty()) result_.first_nonfinite = where;
  }
  const optim::LossScaleState after = engine.rank(0).scaler().state();
  const bool finite = std::isfinite(st.loss);
  log_.emit({{"event", "skipped"}, {"step", step + 1}, {"loss", finite ? nlohmann::json(st.loss) : nlohmann::json(nullptr)},
             {"loss_scale", st.loss_scale}, {"next_loss_scale", after.scale}, {"first_nonfinite", where}});
  std::string msg = "step " + std::to_string(step + 1) + " skipped: " + (finite ? "non-finite gradient" : "non-finite loss");
  if (!where.empty()) msg += " (first in " + where + ")";
  if (scaling_ == ZeroOptions::Scaling::kDynamic) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "; loss scale %g -> %g", st.loss_scale, after.scale);
    msg += buf;
  }
  log_.line(msg);
  if (after.collapsed != 0) {
    if (!cfg_.on_scale_collapse_bf16)
      ZT_THROW(ErrorKind::kDiverged, "the fp16 loss scale collapsed to its minimum of ", cfg_.min_scale, " at step ",
               step + 1, ": the gradients overflow fp16 even unscaled; use --precision bf16 (or --on-scale-collapse "
               "bf16), lower --lr, or lower --min-scale");
    for (int p = 0; p < w.mesh().shape().pipeline; ++p)  // every pipeline stage's engine (one without stages)
      w.engine_of(w.mesh().rank_at({.data = 0, .tensor = 0, .pipeline = p})).set_working_dtype(DType::kBF16);
    working_ = DType::kBF16;
    scaling_ = ZeroOptions::Scaling::kNone;
    result_.switched_to_bf16_at = step + 1;
    result_.precision = "bf16";
    consecutive_skips_ = 0;
    log_.emit({{"event", "precision"}, {"step", step + 1}, {"precision", "bf16"}});
    log_.line("the fp16 loss scale collapsed at step " + std::to_string(step + 1) +
              ": continuing in bf16 from the current weights");
  }
  if (consecutive_skips_ > cfg_.max_skipped_steps)
    ZT_THROW(ErrorKind::kDiverged, consecutive_skips_, " consecutive steps were skipped for non-finite ",
             finite ? "gradients" : "losses", " (the last at step ", step + 1,
             "); lower --lr, enable --grad-clip, or use --precision fp32 or bf16");
}

// Records the step, emits its metrics and redraws the progress line.
void Trainer::after_step(World& w, int step, const StepStats& st, double dt) {
  train_time_ += dt;
  step_seconds_.push_back(dt);
  result_.losses.push_back(st.loss);
  result_.final_loss = st.loss;
  const size_t mem = max_allocated_bytes(w.devices());
  if (tracer_)
    for (int r = 0; r < w.size(); ++r)
      tracer_->add_counter(r, "pool allocated", static_cast<double>(w.device(r).memory().stats().allocated_bytes));
  const auto finite_or_null = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
  nlohmann::json rec = {{"step", step + 1}, {"loss", finite_or_null(st.loss)}, {"lr", st.lr},
                        {"tokens_per_s", static_cast<double>(cfg_.batch_size) * run_.T / dt},
                        {"grad_norm", finite_or_null(st.grad_norm)}, {"step_ms", dt * 1e3}, {"mem_bytes", mem},
                        {"skipped", st.skipped}, {"skipped_total", result_.skipped_steps.size()}};
  if (scaling_ != ZeroOptions::Scaling::kNone) rec["loss_scale"] = st.loss_scale;
  log_.emit(rec);
  const int print_every = std::max(1, cfg_.steps / 20);
  if (!log_.text() || !(log_.tty() || (step + 1) % print_every == 0 || step + 1 == cfg_.steps)) return;
  const double done = step + 1 - world_start_;
  const double tps = done * cfg_.batch_size * run_.T / std::max(train_time_, 1e-9);
  const double el = seconds_since(t0_), eta = el / done * (cfg_.steps - step - 1);
  std::string mp;
  if (scaling_ != ZeroOptions::Scaling::kNone) mp += " | scale " + format_count(st.loss_scale);
  if (!result_.skipped_steps.empty()) mp += " | skipped " + std::to_string(result_.skipped_steps.size());
  char buf[512];
  std::snprintf(buf, sizeof buf, "step %*d/%d | loss %.4f | lr %.2e | %s tok/s | norm %.3f%s | mem %s | %s elapsed | ETA %s",
                static_cast<int>(std::to_string(cfg_.steps).size()), step + 1, cfg_.steps, st.loss, st.lr, format_count(tps).c_str(),
                st.grad_norm, mp.c_str(), format_bytes(static_cast<double>(mem)).c_str(), format_hms(el).c_str(),
                format_hms(eta).c_str());
  log_.progress(buf);
}

template <typename Fn>
void Trainer::side_comm(World& w, Fn fn) {
  std::vector<uint64_t> before, before_tensor;
  const uint64_t before_across = w.bytes_sent_across();
  for (int r = 0; r < w.size(); ++r) {
    before.push_back(w.bytes_sent(r));
    before_tensor.push_back(w.tensor_bytes_sent(r));
  }
  fn();
  for (int r = 0; r < w.size(); ++r) {
    side_bytes_[static_cast<size_t>(r)] += w.bytes_sent(r) - before[static_cast<size_t>(r)];
    side_tensor_bytes_[static_cast<size_t>(r)] += w.tensor_bytes_sent(r) - before_tensor[static_cast<size_t>(r)];
  }
  side_across_ += w.bytes_sent_across() - before_across;
}

EvalAction Trainer::evaluate_at(World& w, int step) {
  // The tests' ZeRO trace (TestHooks::zero_trace) leaves the evaluation's spans out.
  const bool trace = cfg_.test.zero_trace;
  if (trace)
    for (ZeroEngine* e : w.engines()) {
      auto spans = e->take_trace();
      result_.trace.insert(result_.trace.end(), spans.begin(), spans.end());
      e->set_tracing(false);
    }
  EvalResult ev;
  side_comm(w, [&] { ev = evaluate(w, run_, cfg_.eval_batches); });
  if (trace)
    for (ZeroEngine* e : w.engines()) e->set_tracing(true);
  if (ev.interrupted) {  // a stop signal: the run stops after the next step, agreed by every process
    log_.line("eval at step " + std::to_string(step + 1) + ": interrupted by a stop signal");
    return EvalAction::kContinue;
  }
  result_.val_loss = ev.loss;
  result_.val_losses.emplace_back(step + 1, ev.loss);
  if (ev.accuracy) result_.accuracy = ev.accuracy;
  nlohmann::json rec = {{"event", "eval"}, {"step", step + 1}, {"val_loss", ev.loss}};
  if (ev.accuracy) rec["accuracy"] = *ev.accuracy;
  log_.emit(rec);
  char buf[160];
  int n = std::snprintf(buf, sizeof buf, "eval at step %d: val loss %.4f", step + 1, ev.loss);
  if (ev.accuracy) n += std::snprintf(buf + n, sizeof buf - n, ", test accuracy %.2f%%", *ev.accuracy * 100);
  if (result_.entropy_floor) std::snprintf(buf + n, sizeof buf - n, " (floor %.4f)", *result_.entropy_floor);
  log_.line(buf);
  return cfg_.on_eval ? cfg_.on_eval(step + 1, ev.loss) : EvalAction::kContinue;
}

// Snapshot to host (the stall), then write and commit in the background. When the recovery
// snapshot was taken after this same step (--snapshot-every dividing --save-every, the usual
// setting), it holds exactly these bytes and meta: the save shares it instead of stalling again
// for a second device-to-host copy of every shard (1.7 GB for GPT-2 124M in bf16 with AdamW).
void Trainer::save_at(World& w, int step) {
  const auto ts0 = Clock::now();
  const bool shared = snapshot_ && snapshot_->step == counters_.step;
  std::shared_ptr<const HostSnapshot> snap =
      shared ? snapshot_ : std::make_shared<const HostSnapshot>(snapshot_world(w, run_, counters_, result_.precision, scaling_));
  checkpointer_->save(std::move(snap), seconds_since(ts0), shared);
  if (step + 1 == cfg_.steps) checkpointer_->wait();
}

// Several processes, an error at `step`: when it names a process that died or stalled (the
// process group's sentence: every survivor names the same one), throws kLostProcess with one
// sentence naming its ranks, that process and the step, after writing this process's part of the
// newest snapshot (--snapshot-every with --checkpoint-dir). Any other error gets the step and goes on.
void Trainer::lost_process(World& w, const Error& e, int step) {
  if (e.kind() != ErrorKind::kDevice) return;
  const std::string& why = e.message();
  const std::optional<int> lost = lost_process_in(why);
  const std::string at = "step " + std::to_string(step + 1) + ": ";
  if (!lost) throw Error(e.kind(), at + why);
  const int L = w.size();
  const int first = *lost * L;
  std::string msg = at + (L == 1 ? "rank " + std::to_string(first) + " (process " + std::to_string(*lost) + ") has"
                                 : "ranks " + std::to_string(first) + "-" + std::to_string(first + L - 1) +
                                       " (process " + std::to_string(*lost) + ") have") +
                    " died or stalled: " + why;
  if (checkpointer_->enabled()) {
    // This process's ranks of the newest snapshot and the replica it holds: one part is not a
    // checkpoint (--resume refuses it); --resume auto assembles the survivors' parts when they hold
    // every rank. Complete checkpoints are left as they are.
    if (snapshot_) try {
        msg += "; this process's part of the snapshot of step " + std::to_string(snapshot_->step) + " is in " +
               checkpointer_->write_partial(*snapshot_, run_.processes->rank());
      } catch (const Error& we) {
        msg += "; writing this process's part of the snapshot failed too (" + we.message() + ")";
      }
    const std::optional<std::string> latest = read_latest(cfg_.checkpoint_dir);
    msg += std::string("; --resume auto continues from ") + (snapshot_ ? "the survivors' parts if they hold every rank, else " : "") +
           (latest ? "the last complete checkpoint, " + cfg_.checkpoint_dir + "/" + *latest
                   : std::string("scratch (no complete checkpoint was saved yet)"));
  }
  log_.emit({{"event", "lost_process"}, {"step", step + 1}, {"process", *lost}, {"message", msg}});
  throw Error(ErrorKind::kLostProcess, msg);
}

bool Trainer::recover(World& w, const Error& e, int step) {
  if (e.kind() != ErrorKind::kDevice || cfg_.snapshot_every <= 0 || !snapshot_) return false;
  survivors_ = surviving_devices(w, spec_);
  if (!survivors_) return false;
  const std::string cause = w.hung().empty() ? e.message() : "stopped answering";
  const Recovery rec{step + 1, survivors_->lost, cause, static_cast<int>(snapshot_->step), survivors_->count};
  result_.recoveries.push_back(rec);
  log_.emit({{"event", "recovery"}, {"step", rec.failed_at_step}, {"device", rec.device}, {"cause", rec.cause},
             {"resumed_from_step", rec.resumed_from_step}, {"devices", rec.devices_after}});
  char buf[1024];
  const std::string peers = survivors_->dropped.empty() ? ""
                            : std::string(" and its ") + w.stages().replica_name() + " (" +
                                  survivors_->dropped + ")";
  std::snprintf(buf, sizeof buf,
                "device %s failed at step %d (%s): dropping it%s, resharding the snapshot of step %d onto %d devices and "
                "going on (%d steps redone)",
                rec.device.c_str(), step + 1, rec.cause.c_str(), peers.c_str(), rec.resumed_from_step, rec.devices_after,
                step - rec.resumed_from_step);
  log_.line(buf);
  return true;
}

// The first SIGINT/SIGTERM: the step is done; save it (when the run checkpoints) and stop.
void Trainer::stop_for_signal(World& w, int step, int sig) {
  checkpointer_->wait();
  std::string saved;
  if (checkpointer_->enabled() && !(cfg_.save_every > 0 && (step + 1) % cfg_.save_every == 0))
    checkpointer_->save_now(snapshot_world(w, run_, counters_, result_.precision, scaling_));
  const auto paths = checkpointer_->paths();
  if (checkpointer_->enabled() && !paths.empty()) saved = "; checkpoint " + paths.back() + " (continue with --resume auto)";
  result_.signal = sig;
  result_.steps = step + 1 - result_.start_step;
  result_.checkpoints = paths;
  log_.emit({{"event", "stopped"}, {"step", step + 1}, {"signal", sig}});
  std::fprintf(stderr, "zerotrain: stopped by %s after step %d%s\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
               step + 1, saved.c_str());
  log_.close();
}

}  // namespace

namespace {

// The end of the run: final sample, the report (throughput, MFU, time split, memory per device),
// the summary record and the trace.
// Tests' hook (TestHooks::keep_final_params): AdamW's step count as the devices hold it
// (OptimizerStep::step_on_device), and the logical blocks' parameters and moments where one engine
// holds them all (StageRunner::keep_final_state).
void Trainer::keep_final_state(World& w) {
  for (int r = 0; r < w.size(); ++r)
    result_.final_update_counts.push_back(w.engine_of(r).rank(w.engine_rank(r)).scaler().update_count());
  w.stages().keep_final_state(w, run_, counters_.step, result_);
}

// The summary's figures: throughput, MFU, phases, traffic and the pipeline's bubble.
RunReport Trainer::run_report(World& w) {
  RunReport report;
  report.steps = result_.steps;
  report.seconds = result_.seconds;
  report.train_seconds = train_time_;
  report.final_loss = result_.final_loss;
  report.val_loss = result_.val_loss;
  report.entropy_floor = result_.entropy_floor;
  report.accuracy = result_.accuracy;
  report.per_example = !run_.is_gpt;
  report.tokens_per_s = result_.tokens_per_s;
  report.warmup_steps_excluded = warmup_steps_excluded(static_cast<int>(step_seconds_.size()));
  report.flops_per_token = result_.flops_per_token =
      training_flops_per_token(run_.mc, run_.mc.num_parameters(), run_.T);
  // A 16-bit model's GEMMs run in the working dtype at the end of the run (an fp16 run that switched
  // to bf16 after a scale collapse: the peaks of the two are the same on every GPU of the table).
  // Every pipeline stage computes in one dtype (run_activation_dtype): the first rank's model says it.
  const Model& model = w.model_of(0);
  const DType act = model.activation_dtype() == DType::kF32 ? DType::kF32 : working_;
  report.peak_kind = gemm_peak_kind(act, cfg_.tf32);
  report.peak_flops = total_peak_flops(w.device_names(), report.peak_kind);
  report.mfu = result_.mfu = model_flops_utilization(report.flops_per_token, report.tokens_per_s, report.peak_flops);
  report.phases = result_.time_split = timer_->totals();
  report.cuda_graphs = result_.cuda_graphs;
  report.traffic = TrafficReport{run_.processes->size(), w.size(),
                                 cfg_.comm_topology == CommTopology::kHierarchical ? "hierarchical" : "flat",
                                 result_.inside_bytes_per_step, result_.across_bytes_per_step};
  report.pipeline = w.stages().report();
  if (report.pipeline) {
    result_.measured_bubble = report.pipeline->measured_bubble;
    result_.theoretical_bubble = report.pipeline->theoretical_bubble;
  }
  return report;
}

// Each device's memory and traffic, into the report, the result and the summary's
// memory_per_device.
nlohmann::json Trainer::memory_report(World& w, RunReport& report) {
  const int N = w.size();
  nlohmann::json memory = nlohmann::json::array();
  result_.planned_peak_bytes_per_device = run_.planned_peak_bytes;
  for (int r = 0; r < N; ++r) {
    ZeroEngine& engine = w.engine_of(r);
    const int er = w.engine_rank(r);
    const ModelStateBytes mb = engine.rank(er).model_state_bytes();
    const size_t peak = w.device(r).memory().stats().peak_allocated_bytes;
    const size_t act = w.stages().activation_bytes(r);
    result_.peak_bytes_per_device.push_back(peak);
    result_.model_state_bytes_per_device.push_back(mb.total());
    result_.host_peak_bytes_per_device.push_back(engine.rank(er).host_peak_bytes());
    report.host_peak = std::max(report.host_peak, engine.rank(er).host_peak_bytes());
    result_.activation_bytes_per_device.push_back(act);
    const uint64_t tensor_sent = r < static_cast<int>(result_.tensor_bytes_per_step_per_device.size())
                                     ? result_.tensor_bytes_per_step_per_device[static_cast<size_t>(r)]
                                     : 0;
    report.devices.push_back({w.device(r).name(), mb.params, mb.grads, mb.optimizer, act, w.comm_buffer_bytes(r), peak,
                              result_.comm_bytes_per_step_per_device[static_cast<size_t>(r)], tensor_sent});
    memory.push_back({{"params", mb.params}, {"grads", mb.grads}, {"optimizer", mb.optimizer}, {"activations", act},
                      {"comm_buffers", w.comm_buffer_bytes(r)}, {"pool_peak", peak}, {"tensor_sent_per_step", tensor_sent}});
  }
  return memory;
}

void Trainer::finish(World& w) {
  const int N = w.size();
  result_.checkpoints = checkpointer_->paths();
  result_.steps = counters_.step - result_.start_step;  // counters_.step < --steps when on_eval stopped the run
  result_.seconds = seconds_since(t0_);
  // After warm-up (report.h): the first steps build library plans and capture graphs.
  result_.tokens_per_s = steady_tokens_per_s(step_seconds_, static_cast<double>(cfg_.batch_size) * run_.T);
  if (result_.comm_bytes_per_step_per_device.empty()) result_.comm_bytes_per_step_per_device.assign(static_cast<size_t>(N), 0);
  if (run_.is_gpt && cfg_.sample_tokens > 0) {
    result_.sample = sample_text(w, run_, cfg_.sample_tokens, 0xfeed);
    char buf[128];
    std::snprintf(buf, sizeof buf, "--- sample (%d tokens, temperature %.2f, top-k %d) ---", cfg_.sample_tokens,
                  cfg_.temperature, cfg_.top_k);
    log_.line(buf);
    log_.line(result_.sample);
  }
  if (cfg_.test.keep_final_params) keep_final_state(w);
  RunReport report = run_report(w);
  const nlohmann::json memory = memory_report(w, report);
  nlohmann::json summary = {{"event", "summary"},
                            {"steps", result_.steps},
                            {"final_loss", result_.final_loss},
                            {"val_loss", result_.val_loss},
                            {"tokens_per_s", result_.tokens_per_s},
                            {"seconds", result_.seconds},
                            {"peak_bytes_per_device", result_.peak_bytes_per_device},
                            {"planned_peak_bytes_per_device", result_.planned_peak_bytes_per_device},
                            {"model_state_bytes_per_device", result_.model_state_bytes_per_device},
                            {"host_peak_bytes_per_device", result_.host_peak_bytes_per_device},
                            {"comm_bytes_per_step_per_device", result_.comm_bytes_per_step_per_device},
                            {"memory_per_device", memory},
                            {"parameters", run_.mc.num_parameters()},
                            {"devices", result_.devices},
                            {"tensor_parallel", cfg_.tensor_parallel},
                            {"zero_stage", cfg_.zero_stage},
                            {"tf32", cfg_.tf32},
                            {"deterministic_attention", cfg_.deterministic_attention},
                            {"cuda_graphs", result_.cuda_graphs}};
  if (result_.entropy_floor) summary["entropy_floor"] = *result_.entropy_floor;
  if (result_.accuracy) summary["accuracy"] = *result_.accuracy;
  summary.update(report_json(report));
  log_.emit(summary);
  log_.close();
  if (log_.text()) {
    std::fputs(format_summary(report).c_str(), stdout);
    std::fflush(stdout);
  }
  write_trace(w);
}

void Trainer::write_trace(World& w) {
  // Both backends report their stream work to the recorder (the runtime's task observer). The CUDA
  // backend reports a stream's spans when the stream is next synchronized or found idle, which the
  // loop never does to a comm stream (it reads the compute stream's events): without this, the
  // collectives and the ZeRO bucket copies would be missing from the trace.
  if (!tracer_) return;
  w.runtime().synchronize();
  tracer_->write(cfg_.trace_path, w.device_names());
}

}  // namespace

TrainResult train(const TrainConfig& config) {
  // Launched by mpirun/srun as several processes: data parallelism over every process's devices
  // (a plain launch is one process of one).
  const std::unique_ptr<Processes> procs = Processes::join(config);
  const ModelConfig mc = make_model_config(config.model, config.overrides);
  const DeviceSpec spec = parse_device_spec(config.devices);
  // --trace: the recorder is the runtime's task observer, so it outlives the devices.
  std::unique_ptr<TraceRecorder> tracer;
  if (!config.trace_path.empty()) {
    check_output_path(config.trace_path, "--trace file");
    tracer = std::make_unique<TraceRecorder>();
  }
  auto rt = Runtime::create(spec, CpuDeviceOptions{config.device_memory}, tracer.get());
  // Every process's devices (the same count in each: the engine checks) shape the run.
  const int devices = rt->size() * procs->size();
  RunContext run = resolve_run_shape(config, mc, devices, rt->backend());
  run.processes = procs.get();
  const BatchSplit split = even_split(run.cfg.batch_size, devices / run.cfg.tensor_parallel / run.cfg.pipeline_parallel,
                                    run.cfg.micro_batch_size);
  check_fits(run, *rt, split);
  open_data(run);
  if (!run.cfg.profile_steps.empty()) parse_step_range(run.cfg.profile_steps, run.cfg.steps);
  // --log-format json: the metrics records go to stdout as well, in place of the text output.
  // Several processes: process 0 prints and writes the metrics, the others are silent.
  const bool lead = procs->rank() == 0;
  Logger log(lead ? run.cfg.metrics_path : "", run.cfg.log_format == LogFormat::kJson, run.cfg.quiet || !lead);
  for (const std::string& note : procs->settle(run.cfg))
    if (log.text()) log.line("note: " + note);
  TrainResult result;
  {
    Trainer trainer(run, log, tracer.get());
    result = trainer.run(std::move(rt), spec, split);
  }
  procs->finalize();  // only after a run that ended well everywhere (it waits for every process)
  return result;
}

}  // namespace zt
