// The training loop: one host thread per device drives forward/backward through the ZeRO engine;
// host synchronisation happens once per step (to read the loss and the gradient norm).
#include "train/trainer.h"
#include "train/plan.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/nvtx.h"
#include "core/philox.h"
#include "core/status.h"
#include "data/image_data.h"
#include "data/language_data.h"
#include "data/prefetcher.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "runtime/runtime.h"
#include "comm/communicator.h"
#include "zero/engine.h"
#include "train/report.h"
#include "train/trace.h"
#include "train/state_io.h"
#include "train/export.h"

namespace zt {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string si(double v) {
  char buf[32];
  if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

// Host-side batch: what the data layer fills and the prefetcher double-buffers.
struct HostBatch {
  std::vector<int32_t> tokens;   // GPT inputs [B*T]
  std::vector<float> images;     // MLP inputs [B*D]
  std::vector<int32_t> targets;  // [B*T] or [B]
};

// Runs fn(rank) on one host thread per rank (inline for one rank) and rethrows the first error.
// Each rank's thread drives its own device; collectives rendezvous inside the Communicator, so a
// rank that fails abandons the communicator: the others stop waiting for it and fail too, and the
// error that happened first (the cause, not the abandoned rendezvous) is rethrown.
// Watchdog: when the ranks have not all returned after `timeout`, on_timeout() runs once (it
// abandons the devices that stopped answering and the communicator, which releases the threads).
struct Watchdog {
  std::chrono::milliseconds timeout{0};  // 0 = none
  std::function<void()> on_timeout;
};
void run_ranks(int n, const std::function<void(int)>& fn, Communicator& comm, const Watchdog& wd = {}) {
  if (n == 1 && wd.timeout.count() == 0) {
    fn(0);
    return;
  }
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
        }
        comm.abort("rank " + std::to_string(r) + " failed: " + e.what());
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
        }
        comm.abort("rank " + std::to_string(r) + " failed");
      }
      std::lock_guard<std::mutex> lock(mu);
      ++finished;
      cv.notify_all();
    });
  if (wd.timeout.count() > 0) {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, wd.timeout, [&] { return finished == n; })) {
      lock.unlock();
      wd.on_timeout();
    }
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// Runs fn when the scope ends (also by an exception).
struct ScopeExit {
  std::function<void()> fn;
  ~ScopeExit() { fn(); }
};

void print_sample_text(const std::string& s) { std::printf("%s\n", s.c_str()); }

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
      if (value.empty() || *end != 0 || v < 0 || v > 1000000000) bad("has a bad number '" + value + "'");
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

Precision parse_precision(const std::string& s) {
  if (s == "auto") return Precision::kAuto;
  if (s == "fp32") return Precision::kFp32;
  if (s == "bf16") return Precision::kBf16;
  if (s == "fp16") return Precision::kFp16;
  ZT_THROW(ErrorKind::kInvalidArgument, "--precision must be fp32, bf16, fp16 or auto, got '", s, "'");
}

TrainResult train(const TrainConfig& cfg_in) {
  TrainConfig cfg = cfg_in;
  // ---------------- validation and set-up (nothing is trained before all of it passed) -------
  ModelConfig mc = make_model_config(cfg.model, cfg.overrides);
  const bool is_gpt = mc.kind == ModelKind::kGpt;
  std::unique_ptr<LanguageData> lang;
  std::unique_ptr<ImageData> images;
  if (is_gpt) {
    ZT_REQUIRE(cfg.data != "fashion-mnist", "--data fashion-mnist is an image dataset; use it with --model mlp");
    lang = open_language_data(cfg.data, cfg.seed, mc.vocab);
    ZT_REQUIRE(lang->vocab_size() <= mc.vocab, "the data has token ids up to ", lang->vocab_size() - 1,
               " but the model's vocabulary is ", mc.vocab, "; use --vocab ", lang->vocab_size(), " or more");
    if (cfg.train_seq_len == 0) cfg.train_seq_len = mc.seq_len;
    ZT_REQUIRE(cfg.train_seq_len >= 1 && cfg.train_seq_len <= mc.seq_len, "sequence length ", cfg.train_seq_len,
               " is above the model's context of ", mc.seq_len, " tokens; raise --seq-len or lower --train-seq-len");
    lang->validate(cfg.train_seq_len);
  } else {
    images = open_image_data(cfg.data == "synthetic" ? "fashion-mnist" : cfg.data, cfg.seed);
    ZT_REQUIRE(images->image_size() == mc.input_dim && images->num_classes() == mc.classes,
               "the data has ", images->image_size(), " inputs and ", images->num_classes(),
               " classes, the model expects ", mc.input_dim, " and ", mc.classes);
  }
  ZT_REQUIRE(cfg.zero_stage >= 0 && cfg.zero_stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", cfg.zero_stage);
  const DeviceSpec spec = parse_device_spec(cfg.devices);
  // --trace: the recorder outlives the devices (their stream workers report to it).
  std::unique_ptr<TraceRecorder> tracer;
  if (!cfg.trace_path.empty()) {
    ZT_REQUIRE(std::ofstream(cfg.trace_path).good(), "cannot write --trace file '", cfg.trace_path, "'");
    tracer = std::make_unique<TraceRecorder>();
  }
  auto rt = Runtime::create(spec, CpuDeviceOptions{cfg.device_memory});
  int N = rt->size();

  if (cfg.batch_size < 0) cfg.batch_size = (is_gpt ? 8 : 128) * ((N + 1) / 2);
  ZT_REQUIRE(cfg.batch_size >= 1, "--batch-size must be at least 1, got ", cfg.batch_size);
  ZT_REQUIRE(cfg.batch_size % N == 0, "--batch-size ", cfg.batch_size, " does not split evenly over ", N,
             " devices; use a multiple of ", N);
  if (cfg.micro_batch_size == 0) cfg.micro_batch_size = cfg.batch_size / N;
  ZT_REQUIRE(cfg.micro_batch_size >= 1, "--micro-batch-size must be at least 1, got ", cfg.micro_batch_size);
  ZT_REQUIRE((cfg.batch_size / N) % cfg.micro_batch_size == 0, "--batch-size ", cfg.batch_size, " over ", N,
             " device", N == 1 ? "" : "s", " is ", cfg.batch_size / N, " per device, not a multiple of --micro-batch-size ",
             cfg.micro_batch_size, "; the global batch must split into whole micro-batches");
  int accum = cfg.batch_size / N / cfg.micro_batch_size;
  // Precision and loss scaling.
  const Precision precision = cfg.precision != Precision::kAuto ? cfg.precision
                              : rt->backend() == Backend::kCuda ? Precision::kBf16
                                                                : Precision::kFp32;
  const DType working = precision == Precision::kBf16 ? DType::kBF16 : precision == Precision::kFp16 ? DType::kF16 : DType::kF32;
  ZeroOptions::Scaling scaling = ZeroOptions::Scaling::kNone;
  float initial_scale = 1.0f;
  if (cfg.loss_scale == "auto") {
    if (precision == Precision::kFp16) scaling = ZeroOptions::Scaling::kDynamic, initial_scale = cfg.initial_scale;
  } else if (cfg.loss_scale == "dynamic") {
    scaling = ZeroOptions::Scaling::kDynamic, initial_scale = cfg.initial_scale;
  } else if (cfg.loss_scale != "none") {
    char* end = nullptr;
    const double v = std::strtod(cfg.loss_scale.c_str(), &end);
    ZT_REQUIRE(end && *end == 0 && !cfg.loss_scale.empty() && std::isfinite(v) && v > 0 && v <= 3.4e38,
               "--loss-scale must be dynamic, none or a positive number, got '", cfg.loss_scale, "'");
    scaling = ZeroOptions::Scaling::kFixed, initial_scale = static_cast<float>(v);
  }
  ZT_REQUIRE(cfg.scale_window >= 1, "--scale-window must be at least 1, got ", cfg.scale_window);
  ZT_REQUIRE(cfg.scale_hysteresis >= 1, "--scale-hysteresis must be at least 1, got ", cfg.scale_hysteresis);
  ZT_REQUIRE(cfg.min_scale > 0 && cfg.min_scale <= cfg.max_scale && cfg.initial_scale >= cfg.min_scale &&
                 cfg.initial_scale <= cfg.max_scale,
             "the loss scales must satisfy 0 < --min-scale <= --initial-scale <= --max-scale, got ", cfg.min_scale, ", ",
             cfg.initial_scale, ", ", cfg.max_scale);
  ZT_REQUIRE(cfg.max_skipped_steps >= 1, "--max-skipped-steps must be at least 1, got ", cfg.max_skipped_steps);
  ZT_REQUIRE(!cfg.on_scale_collapse_bf16 || precision == Precision::kFp16,
             "--on-scale-collapse bf16 applies to --precision fp16 runs only");
  int B = cfg.micro_batch_size;  // per device, per micro-batch
  const int T = is_gpt ? cfg.train_seq_len : 1;
  // Refuse a run that cannot fit, with the cheapest fix, before anything is allocated.
  auto check_fits = [&] {
    PlanInputs in;
    in.zero_stage = cfg.zero_stage;
    in.micro_batch = B;
    in.seq_len = T;
    in.sgd = cfg.optimizer == OptimizerKind::kSgd;
    in.micro_batches = accum;
    in.sampling = is_gpt && (cfg.sample_tokens > 0 || cfg.sample_every > 0);
    in.working = working;
    require_fits(plan_run(mc, *rt, in));
  };
  check_fits();
  if (!is_gpt) {
    const int64_t per_epoch = images->batches_per_epoch(Split::kTrain, cfg.batch_size);
    ZT_REQUIRE(per_epoch >= 1, "--batch-size ", cfg.batch_size, " is larger than the training set");
    if (cfg.steps < 0) cfg.steps = static_cast<int>((cfg.epochs > 0 ? cfg.epochs : 3) * per_epoch);
  }
  if (cfg.steps < 0) cfg.steps = 1500;  // gpt-tiny reaches within ~0.15 nats of the synthetic floor
  ZT_REQUIRE(cfg.steps >= 1, "--steps must be at least 1, got ", cfg.steps);
  // 1-based, inclusive; {0, 0} = no profiler capture.
  const std::pair<int, int> profile_range =
      cfg.profile_steps.empty() ? std::pair<int, int>{0, 0} : parse_step_range(cfg.profile_steps, cfg.steps);
  const bool on_cuda = rt->backend() == Backend::kCuda;
  // On CUDA the trace's stream tracks come from the engine's spans (the CPU backend reports tasks).
  if (tracer && on_cuda) cfg.zero_trace = true;
  if (cfg.lr < 0) cfg.lr = cfg.optimizer == OptimizerKind::kAdamW ? (is_gpt ? 3e-3f : 1e-3f) : 0.05f;
  ZT_REQUIRE(cfg.lr > 0 && std::isfinite(cfg.lr), "--lr must be positive, got ", cfg.lr);
  if (cfg.min_lr < 0) cfg.min_lr = cfg.lr / 10;
  if (cfg.warmup_steps < 0) cfg.warmup_steps = std::max(1, cfg.steps / 50);
  if (cfg.eval_every < 0) cfg.eval_every = std::max(1, cfg.steps / 4);
  ZT_REQUIRE(cfg.weight_decay >= 0, "--weight-decay must not be negative, got ", cfg.weight_decay);
  ZT_REQUIRE(cfg.grad_clip >= 0, "--grad-clip must not be negative, got ", cfg.grad_clip);
  ZT_REQUIRE(cfg.top_k >= 0 && cfg.temperature > 0, "--top-k must be >= 0 and --temperature > 0");

  std::FILE* metrics = nullptr;
  if (!cfg.metrics_path.empty()) {
    metrics = std::fopen(cfg.metrics_path.c_str(), "w");
    ZT_REQUIRE(metrics, "cannot write --metrics file '", cfg.metrics_path, "'");
  }
  // --log-format json: the metrics records go to stdout as well, in place of the text output.
  const bool json_log = cfg.log_format == LogFormat::kJson && !cfg.quiet;
  if (json_log) cfg.quiet = true;
  std::mutex emit_mu;  // the background checkpoint writer emits too
  auto emit = [&](const nlohmann::json& j) {
    std::lock_guard<std::mutex> lock(emit_mu);
    if (json_log) {
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
    if (!metrics) return;
    std::fprintf(metrics, "%s\n", j.dump().c_str());
    std::fflush(metrics);
  };

  TrainResult result;
  std::optional<HostSnapshot> snapshot;  // --snapshot-every: the newest host snapshot
  std::optional<DeviceSpec> next_spec;   // set when a device was lost: the survivors
  bool fault_injected = false;
  for (int world = 0;; ++world) {
    if (next_spec) {
      // The previous world's engine, communicator and buffers are gone; now its devices go too.
      rt.reset();
      rt = Runtime::create(*next_spec, CpuDeviceOptions{cfg.device_memory});
      N = rt->size();
      next_spec.reset();
      if (cfg.batch_size % N != 0)
        ZT_THROW(ErrorKind::kDevice, "cannot go on after losing a device: --batch-size ", cfg.batch_size,
                 " does not split over the ", N, " devices left; use a batch divisible by both device counts");
      cfg.micro_batch_size = (cfg.batch_size / N) % cfg.micro_batch_size == 0 ? cfg.micro_batch_size : cfg.batch_size / N;
      accum = cfg.batch_size / N / cfg.micro_batch_size;
      B = cfg.micro_batch_size;
      check_fits();
    }
    auto model = make_model(mc);
    const ParamLayout& layout = model->layout();
    const int num_blocks = layout.num_blocks();
    std::vector<Device*> devs;
    for (int r = 0; r < N; ++r) devs.push_back(&rt->device(r));
    Communicator comm(devs);
    std::vector<std::string> result_notes;
    std::string resumed_from, init_note;
    // Every per-rank phase runs under the watchdog: a device that stops answering is abandoned
    // (its stream work and everyone waiting on it are released with errors), so the run can
    // recover instead of hanging.
    Watchdog watchdog;
    watchdog.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.hang_timeout_s * 1000));
    std::string hung;  // devices the watchdog gave up on
    watchdog.on_timeout = [&] {
      std::vector<int> stuck;
      for (int r = 0; r < N; ++r)
        if (rt->device(r).hang_injected()) stuck.push_back(r);
      if (stuck.empty())  // a real hang: the devices whose work does not finish
        for (int r = 0; r < N; ++r) {
          try {
            if (!rt->device(r).synchronize_for(std::chrono::milliseconds(100))) stuck.push_back(r);
          } catch (const Error&) {
          }
        }
      if (stuck.size() == static_cast<size_t>(N)) stuck.clear();  // cannot tell which: give up below
      for (int r : stuck) {
        hung += (hung.empty() ? "" : ", ") + rt->device(r).name();
        rt->device(r).abandon("it stopped answering for " + std::to_string(cfg.hang_timeout_s) + " s (--hang-timeout)");
      }
      comm.abort(stuck.empty() ? "the devices stopped answering for " + std::to_string(cfg.hang_timeout_s) + " s"
                               : hung + " stopped answering");
    };
    const auto for_ranks = [&](const std::function<void(int)>& fn) { run_ranks(N, fn, comm, watchdog); };
    ZeroOptions zo;
    zo.stage = cfg.zero_stage;
    zo.sgd = cfg.optimizer == OptimizerKind::kSgd;
    zo.micro_batches = accum;
    zo.working = working;
    zo.scaling = scaling;
    zo.initial_scale = initial_scale;
    zo.scale_config.growth_interval = cfg.scale_window;
    zo.scale_config.hysteresis = cfg.scale_hysteresis;
    zo.scale_config.min_scale = cfg.min_scale;
    zo.scale_config.max_scale = cfg.max_scale;
    zo.rounding = cfg.stochastic_rounding ? optim::Rounding::kStochastic : optim::Rounding::kNearest;
    zo.seed = cfg.seed;
    ZeroEngine engine(*model, devs, comm, zo);
    engine.set_tracing(cfg.zero_trace);
    {
      // Initialised once on the host (deterministic in the seed, independent of the device count),
      // or read from --init-from.
      std::vector<std::vector<float>> host(static_cast<size_t>(num_blocks));
      if (!cfg.init_from.empty()) {
        std::vector<std::string> ignored;
        host = read_safetensors_weights(cfg.init_from, mc, layout, &ignored);
        init_note = "initialised from " + cfg.init_from;
        if (!ignored.empty()) init_note += " (" + std::to_string(ignored.size()) + " tensors the model does not use ignored, e.g. " + ignored[0] + ")";
      } else {
        for (int b = 0; b < num_blocks; ++b) {
          host[static_cast<size_t>(b)].resize(static_cast<size_t>(layout.block(b).numel));
          init_block_host(layout.block(b), cfg.seed, host[static_cast<size_t>(b)].data());
        }
      }
      for (int r = 0; r < N; ++r) engine.load_parameters(r, host);
    }
    const bool adamw = cfg.optimizer == OptimizerKind::kAdamW;
    // --resume: the newest complete checkpoint (auto) or the named one, whatever the device count
    // and ZeRO stage it was saved with; each rank reads the elements it keeps.
    int start_step = 0;
    int64_t updates = 0;  // optimizer updates made (skipped steps make none): AdamW's bias-correction count
    std::vector<int> prior_skipped;
    // The state of a checkpoint or a snapshot: the engine's arrays (resharded onto this world)
    // and the trainer's counters.
    auto apply_state = [&](const StateSource& src, const nlohmann::json& meta) {
      check_source_matches(src, *model, adamw);
      for_ranks([&](int r) { restore_rank(engine, *model, src, r); });
      start_step = meta.value("step", 0);
      updates = meta.value("updates", int64_t{0});
      prior_skipped = meta.value("skipped_steps", std::vector<int>{});
      if (meta.contains("loss_scale") && scaling != ZeroOptions::Scaling::kNone) {
        const auto& ls = meta["loss_scale"];
        const optim::LossScaleState st{ls.at("scale").get<float>(), ls.at("inv_scale").get<float>(),
                                       ls.at("good_steps").get<float>(), ls.at("hysteresis_left").get<float>(),
                                       ls.at("collapsed").get<float>(), ls.at("skipped").get<float>()};
        for (int r = 0; r < N; ++r) engine.set_loss_scale_state(r, st);
      }
    };
    if (world > 0) {
      // Recovery: the last snapshot, taken on the world that lost a device.
      apply_state(*source_of(*snapshot), snapshot->meta);
    } else if (!cfg.resume.empty()) {
      ZT_REQUIRE(cfg.resume != "auto" || !cfg.checkpoint_dir.empty(), "--resume auto needs --checkpoint-dir");
      auto resolved = resolve_resume(cfg.checkpoint_dir, cfg.resume, &result_notes);
      if (resolved) {
        const nlohmann::json& meta = resolved->reader.meta();
        // step == --steps: nothing to train; the state is loaded (resharded) and saved again,
        // which converts a checkpoint to another device count, stage or precision.
        ZT_REQUIRE(meta.value("step", 0) >= 1 && meta.value("step", 0) <= cfg.steps, "checkpoint ", resolved->path,
                   " is at step ", meta.value("step", 0), " but the run has --steps ", cfg.steps,
                   "; raise --steps to at least the checkpoint's step");
        apply_state(*source_of(resolved->reader), meta);
        resumed_from = resolved->path + " (step " + std::to_string(start_step) + ", saved on " +
                       std::to_string(meta.value("devices", 0)) + " device(s) at ZeRO stage " +
                       std::to_string(meta.value("zero_stage", -1)) + " in " + meta.value("precision", std::string("?")) + ")";
      } else {
        resumed_from = "nothing: " + cfg.checkpoint_dir + " holds no checkpoint yet, starting from scratch";
      }
    }
    std::unique_ptr<BackgroundSaver> saver;
    if (!cfg.checkpoint_dir.empty()) saver = std::make_unique<BackgroundSaver>(cfg.checkpoint_dir, cfg.keep);
    std::mutex saved_mu;
    std::vector<std::string> saved_messages;  // from the saving thread, printed by the loop

    // Per-rank state: activations, one micro-batch of inputs on the device, a prefetcher of this
    // rank's rows of every global batch, host scratch.
    const int D = is_gpt ? 0 : mc.input_dim;
    const int positions = B * T;  // per rank per micro-batch
    struct RankState {
      std::unique_ptr<Workspace> ws, sample_ws;
      DeviceBuffer inputs, targets, norms;
      Batch batch;
      std::unique_ptr<Prefetcher<HostBatch>> prefetch;
      std::vector<float> losses, norm_host;
      double loss_sum = 0;
      float found_inf = 0;
      optim::LossScaleState scale{};
    };
    std::vector<RankState> ranks(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      RankState& R = ranks[static_cast<size_t>(r)];
      Device& d = rt->device(r);
      Stream& s = d.compute();
      R.ws = model->make_workspace(d, B, T);
      R.inputs = DeviceBuffer(d.memory(), static_cast<size_t>(is_gpt ? B * T : B * D) * 4, s, "batch");
      R.targets = DeviceBuffer(d.memory(), static_cast<size_t>(B * T) * 4, s, "batch");
      R.norms = DeviceBuffer(d.memory(), static_cast<size_t>(num_blocks) * 4, s, "grad norm");
      R.batch.B = B;
      R.batch.T = T;
      R.batch.inputs = is_gpt ? ConstTensorView{R.inputs.data(), DType::kI32, Shape{B, T}, d.index()}
                              : ConstTensorView{R.inputs.data(), DType::kF32, Shape{B, D}, d.index()};
      R.batch.targets = ConstTensorView{R.targets.data(), DType::kI32, is_gpt ? Shape{B, T} : Shape{B}, d.index()};
      R.losses.resize(static_cast<size_t>(positions));
      R.norm_host.resize(static_cast<size_t>(num_blocks));
      // Rank r, micro-batch m of step s reads rows [m*N*B + r*B, +B) of the step's global batch.
      R.prefetch = std::make_unique<Prefetcher<HostBatch>>([&, r](int64_t micro_index, HostBatch& hb) {
        const uint64_t step = static_cast<uint64_t>(micro_index / accum);
        const int first = static_cast<int>(micro_index % accum) * N * B + r * B;
        if (is_gpt) {
          hb.tokens.resize(static_cast<size_t>(B * T));
          hb.targets.resize(static_cast<size_t>(B * T));
          lang->batch(Split::kTrain, step, first, B, T, hb.tokens.data(), hb.targets.data());
        } else {
          const int64_t per_epoch = images->batches_per_epoch(Split::kTrain, cfg.batch_size);
          hb.images.resize(static_cast<size_t>(B * D));
          hb.targets.resize(static_cast<size_t>(B));
          images->batch(Split::kTrain, step / per_epoch, static_cast<int64_t>(step % per_epoch), cfg.batch_size, first, B,
                        hb.images.data(), hb.targets.data());
        }
      });
    }

    auto upload = [&](int r, const HostBatch& hb) {
      RankState& R = ranks[static_cast<size_t>(r)];
      Stream& s = rt->device(r).compute();
      if (is_gpt) s.copy(R.inputs.data(), hb.tokens.data(), hb.tokens.size() * 4);
      else s.copy(R.inputs.data(), hb.images.data(), hb.images.size() * 4);
      s.copy(R.targets.data(), hb.targets.data(), hb.targets.size() * 4);
    };
    // Sum of this rank's per-position losses of the last forward (synchronizes its compute stream).
    auto read_losses = [&](int r) {
      RankState& R = ranks[static_cast<size_t>(r)];
      Stream& s = rt->device(r).compute();
      s.copy(R.losses.data(), R.ws->losses().data, R.losses.size() * 4);
      s.synchronize();
      double sum = 0;
      for (float l : R.losses) sum += l;
      return sum;
    };

    // Evaluation on every rank in lockstep (stage 3 gathers need all of them): global batch e of
    // the validation split, each rank its own rows. Returns the mean loss; sets accuracy for images.
    auto evaluate = [&](double* accuracy) -> double {
      std::vector<double> loss_sum(static_cast<size_t>(N), 0.0);
      std::vector<int64_t> correct(static_cast<size_t>(N), 0), count(static_cast<size_t>(N), 0);
      const int64_t batches = is_gpt ? cfg.eval_batches : images->num_examples(Split::kValidation) / (static_cast<int64_t>(N) * B);
      for_ranks([&](int r) {
        RankState& R = ranks[static_cast<size_t>(r)];
        Stream& s = rt->device(r).compute();
        const NvtxRange eval_range(NvtxCategory::kStep, "eval", rt->device(r).index());
        HostBatch hb;
        hb.tokens.resize(static_cast<size_t>(B * T));
        hb.images.resize(static_cast<size_t>(B * D));
        hb.targets.resize(static_cast<size_t>(B * T));
        std::vector<float> logits(is_gpt ? 0 : static_cast<size_t>(B * mc.classes));
        for (int64_t e = 0; e < batches; ++e) {
          if (is_gpt)
            lang->batch(Split::kValidation, static_cast<uint64_t>(e), r * B, B, T, hb.tokens.data(), hb.targets.data());
          else
            images->examples(Split::kValidation, (e * N + r) * B, B, hb.images.data(), hb.targets.data());
          upload(r, hb);
          engine.begin_micro_batch(r, 0, /*forward_only=*/true);
          model->forward(s, engine.access(r), *R.ws, R.batch, 0.0f, false);
          engine.end_micro_batch(r);
          if (!is_gpt) s.copy(logits.data(), R.ws->logits().data, logits.size() * 4);
          loss_sum[static_cast<size_t>(r)] += read_losses(r);  // synchronizes: hb and logits are ready
          count[static_cast<size_t>(r)] += positions;
          for (int i = 0; !is_gpt && i < B; ++i) {
            const float* row = logits.data() + static_cast<size_t>(i) * mc.classes;
            const int pred = static_cast<int>(std::max_element(row, row + mc.classes) - row);
            correct[static_cast<size_t>(r)] += pred == hb.targets[static_cast<size_t>(i)];
          }
        }
      });
      double ls = 0;
      int64_t c = 0, n = 0;
      for (int r = 0; r < N; ++r) {
        ls += loss_sum[static_cast<size_t>(r)];
        c += correct[static_cast<size_t>(r)];
        n += count[static_cast<size_t>(r)];
      }
      if (accuracy) *accuracy = n ? static_cast<double>(c) / static_cast<double>(n) : 0;
      return n ? ls / static_cast<double>(n) : 0;
    };

    // Sampling: autoregressive, temperature + top-k, deterministic in the seed. Every rank runs the
    // same forward in lockstep (stage 3 needs them all) and draws the same token; rank 0's text is
    // returned.
    auto sample = [&](int n_tokens, uint64_t salt) -> std::string {
      std::vector<std::string> texts(static_cast<size_t>(N));
      for_ranks([&](int r) {
        RankState& R = ranks[static_cast<size_t>(r)];
        Device& d = rt->device(r);
        Stream& s = d.compute();
        const NvtxRange sample_range(NvtxCategory::kStep, "sample", d.index());
        if (!R.sample_ws) R.sample_ws = model->make_workspace(d, 1, T);
        const int V = mc.vocab;
        std::vector<int32_t> ctx = {V >= 50257 ? 50256 : '\n'};
        std::vector<int32_t> in(static_cast<size_t>(T)), tg(static_cast<size_t>(T), -1);
        std::vector<float> row(static_cast<size_t>(V));
        Batch sb;
        sb.B = 1;
        sb.T = T;
        sb.inputs = ConstTensorView{R.inputs.data(), DType::kI32, Shape{1, T}, d.index()};
        sb.targets = ConstTensorView{R.targets.data(), DType::kI32, Shape{1, T}, d.index()};
        std::string& out = texts[static_cast<size_t>(r)];
        for (int k = 0; k < n_tokens; ++k) {
          const int len = std::min<int>(static_cast<int>(ctx.size()), T);
          std::fill(in.begin(), in.end(), 0);
          std::copy(ctx.end() - len, ctx.end(), in.begin());
          s.copy(R.inputs.data(), in.data(), in.size() * 4);
          s.copy(R.targets.data(), tg.data(), tg.size() * 4);
          engine.begin_micro_batch(r, 0, /*forward_only=*/true);
          model->forward(s, engine.access(r), *R.sample_ws, sb, 0.0f, false);
          engine.end_micro_batch(r);
          s.copy(row.data(), static_cast<float*>(R.sample_ws->logits().data) + static_cast<size_t>(len - 1) * V,
                 row.size() * 4);
          s.synchronize();
          std::vector<int> idx(static_cast<size_t>(V));
          std::iota(idx.begin(), idx.end(), 0);
          const int k_keep = cfg.top_k > 0 ? std::min(cfg.top_k, V) : V;
          std::partial_sort(idx.begin(), idx.begin() + k_keep, idx.end(),
                            [&](int a, int b) { return row[static_cast<size_t>(a)] > row[static_cast<size_t>(b)]; });
          const float mx = row[static_cast<size_t>(idx[0])];
          std::vector<double> p(static_cast<size_t>(k_keep));
          double z = 0;
          for (int i = 0; i < k_keep; ++i)
            z += p[static_cast<size_t>(i)] = std::exp((row[static_cast<size_t>(idx[static_cast<size_t>(i)])] - mx) / cfg.temperature);
          double u = philox_uniform(cfg.seed, 0x5a3b1e ^ salt, static_cast<uint64_t>(k)) * z;
          int pick = idx[static_cast<size_t>(k_keep - 1)];
          for (int i = 0; i < k_keep; ++i) {
            u -= p[static_cast<size_t>(i)];
            if (u <= 0) {
              pick = idx[static_cast<size_t>(i)];
              break;
            }
          }
          ctx.push_back(pick);
          if (V <= 256) {
            const char c = static_cast<char>(pick);
            out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? std::string(1, c) : "?";
          } else {
            if (!out.empty()) out.push_back(' ');
            out.append(std::to_string(pick));
          }
        }
      });
      return texts[0];
    };

    // ---------------- the loop -------------------------------------------------------------------
    result.devices = N;
    result.zero_stage = cfg.zero_stage;
    result.precision = precision_name(precision);
    result.entropy_floor = is_gpt ? lang->entropy_rate() : std::nullopt;
    const bool tty = isatty(STDOUT_FILENO);
    const int print_every = std::max(1, cfg.steps / 20);
    if (!cfg.quiet && world == 0) {
      std::printf("model: %s (%s parameters)\n", mc.describe().c_str(), si(static_cast<double>(layout.total_parameters())).c_str());
      std::printf("data: %s\n", is_gpt ? lang->describe().c_str() : images->describe().c_str());
      std::string names;
      for (int r = 0; r < N; ++r) names += (r ? ", " : "") + rt->device(r).name();
      std::printf("devices: %s (ZeRO stage %d, %s%s)\n", names.c_str(), cfg.zero_stage, precision_name(precision),
                  scaling == ZeroOptions::Scaling::kDynamic ? ", dynamic loss scaling"
                  : scaling == ZeroOptions::Scaling::kFixed ? ", fixed loss scale" : "");
      if (!rt->fallback_note().empty()) std::printf("note: %s\n", rt->fallback_note().c_str());
      std::printf("batch: %d x %d tokens = %d devices x %d micro-batches x %d, %d steps, %s lr %.2g\n", cfg.batch_size, T,
                  N, accum, B, cfg.steps, cfg.optimizer == OptimizerKind::kAdamW ? "AdamW" : "SGD", cfg.lr);
      if (result.entropy_floor) std::printf("entropy floor of the data: %.4f nats/token\n", *result.entropy_floor);
      for (const std::string& n : result_notes) std::printf("note: %s\n", n.c_str());
      if (!init_note.empty()) std::printf("%s\n", init_note.c_str());
      if (!resumed_from.empty()) std::printf("resumed from %s\n", resumed_from.c_str());
      std::fflush(stdout);
    }
    if (world == 0) {
      result.resume_notes = result_notes;
      result.start_step = start_step;
    } else {
      // The steps after the snapshot are redone: drop what they reported.
      result.losses.resize(static_cast<size_t>(start_step - result.start_step));
      result.loss_scales.resize(std::min(result.loss_scales.size(), result.losses.size()));
      std::erase_if(result.val_losses, [&](const auto& v) { return v.first > start_step; });
    }
    result.skipped_steps = prior_skipped;
    LrConfig lrc{cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps, cfg.schedule};
    const auto t0 = Clock::now();
    double train_time = 0;
    const float dloss = 1.0f / static_cast<float>(static_cast<int64_t>(positions) * accum * N);
    comm.reset_counters();
    // Evaluation and sampling run collectives too (stage 3 gathers); keep them out of the per-step
    // communication figure.
    std::vector<uint64_t> side_bytes(static_cast<size_t>(N), 0);
    auto exclude_comm = [&](const std::function<void()>& fn) {
      std::vector<uint64_t> before;
      for (int r = 0; r < N; ++r) before.push_back(comm.counters(r).bytes_sent);
      fn();
      for (int r = 0; r < N; ++r) side_bytes[static_cast<size_t>(r)] += comm.counters(r).bytes_sent - before[static_cast<size_t>(r)];
    };
    StepPhaseTimer phase_timer(N);
    int consecutive_skips = 0;
    // Every tensor's global shape and where it lives in its block's flat arrays.
    nlohmann::json tensor_table = nlohmann::json::array();
    for (const auto& blk : layout.blocks())
      for (const auto& t : blk.tensors) {
        std::vector<int64_t> shape;
        for (int i = 0; i < t.shape.ndim(); ++i) shape.push_back(t.shape[i]);
        tensor_table.push_back({{"name", t.name}, {"block", blk.name}, {"offset", t.offset}, {"shape", shape},
                                {"dtype", "f32"}});
      }
    // Everything a checkpoint needs beyond the engine's arrays.
    auto trainer_meta = [&](int steps_done) {
      nlohmann::json m = {{"model", {{"preset", mc.preset}, {"describe", mc.describe()}, {"layers", mc.layers},
                                     {"heads", mc.heads}, {"embd", mc.embd}, {"seq_len", mc.seq_len}, {"vocab", mc.vocab},
                                     {"input_dim", mc.input_dim}, {"hidden", mc.hidden}, {"classes", mc.classes}}},
                          {"precision", result.precision},
                          {"zero_stage", cfg.zero_stage},
                          {"devices", N},
                          {"step", steps_done},
                          {"tokens_seen", static_cast<int64_t>(steps_done) * cfg.batch_size * T},
                          // The data order is a function of (seed, step): the sampler continues at
                          // global batch `step`, whatever the device count.
                          {"sampler", {{"data", cfg.data}, {"seed", cfg.seed}, {"next_batch", steps_done},
                                       {"batch_size", cfg.batch_size}, {"seq_len", T}}},
                          {"rng", {{"seed", cfg.seed}, {"philox_counter", "step"}}},
                          {"optimizer", adamw ? "adamw" : "sgd"},
                        {"tensors", tensor_table},
                          {"updates", updates},
                          {"skipped_steps", result.skipped_steps},
                          {"lr_schedule", {{"lr", cfg.lr}, {"min_lr", cfg.min_lr}, {"warmup_steps", cfg.warmup_steps},
                                           {"steps", cfg.steps}, {"schedule", static_cast<int>(cfg.schedule)}}}};
      if (scaling != ZeroOptions::Scaling::kNone) {
        const optim::LossScaleState st = engine.loss_scale_state(0);
        m["loss_scale"] = {{"scale", st.scale}, {"inv_scale", st.inv_scale}, {"good_steps", st.good_steps},
                           {"hysteresis_left", st.hysteresis_left}, {"collapsed", st.collapsed}, {"skipped", st.skipped}};
      }
      return m;
    };
    // Fault tolerance: a snapshot now (so that a failure before the first periodic one loses only
    // the steps since the start), and what to do when a device fails.
    auto take_snapshot_now = [&](int steps_done) {
      const auto ts0 = Clock::now();
      snapshot = take_snapshot(engine, *model, adamw, steps_done, for_ranks);
      snapshot->meta = trainer_meta(steps_done);
      emit({{"event", "snapshot"}, {"step", steps_done}, {"bytes", snapshot->bytes()}, {"stall_ms", seconds_since(ts0) * 1e3}});
    };
    if (cfg.snapshot_every > 0) take_snapshot_now(start_step);
    auto recover_from_failure = [&](const Error& e, int step) -> bool {
      if (e.kind() != ErrorKind::kDevice || cfg.snapshot_every <= 0 || !snapshot) return false;
      std::vector<int> lost;
      for (int r = 0; r < N; ++r)
        if (rt->device(r).failed()) lost.push_back(r);
      if (lost.empty() || lost.size() == static_cast<size_t>(N)) return false;
      std::vector<int> ordinals;  // CUDA: the survivors' physical GPUs
      if (rt->backend() == Backend::kCuda) {
        const DeviceSpec now = parse_device_spec(cfg.devices);
        for (int r = 0; r < N; ++r)
          ordinals.push_back(now.cuda_ordinals.empty() ? r : now.cuda_ordinals[static_cast<size_t>(r) % now.cuda_ordinals.size()]);
      }
      DeviceSpec next;
      next.kind = rt->backend() == Backend::kCuda ? DeviceSpec::Kind::kCuda : DeviceSpec::Kind::kCpu;
      std::string names;
      for (int r = 0; r < N; ++r) {
        const bool gone = std::find(lost.begin(), lost.end(), r) != lost.end();
        if (gone) names += (names.empty() ? "" : ", ") + rt->device(r).name();
        else if (next.kind == DeviceSpec::Kind::kCuda) next.cuda_ordinals.push_back(ordinals[static_cast<size_t>(r)]);
      }
      next.cpu_count = N - static_cast<int>(lost.size());
      next.text = "the surviving devices";
      const int survivors = N - static_cast<int>(lost.size());
      Recovery rec{step + 1, names, hung.empty() ? e.message() : "stopped answering", static_cast<int>(snapshot->step), survivors};
      result.recoveries.push_back(rec);
      emit({{"event", "recovery"}, {"step", rec.failed_at_step}, {"device", rec.device}, {"cause", rec.cause},
            {"resumed_from_step", rec.resumed_from_step}, {"devices", survivors}});
      if (!cfg.quiet)
        std::printf("%sdevice %s failed at step %d (%s): dropping it, resharding the snapshot of step %d onto %d "
                    "devices and going on (%d steps redone)\n",
                    tty ? "\n" : "", names.c_str(), step + 1, rec.cause.c_str(), rec.resumed_from_step, survivors,
                    step - rec.resumed_from_step);
      next_spec = next;
      return true;
    };
    for (int step = start_step; step < cfg.steps; ++step) {
      try {
        if (cfg.inject_fault.device >= 0 && !fault_injected && step + 1 == cfg.inject_fault.step) {
          ZT_REQUIRE(cfg.inject_fault.device < N, "--inject-fault device=", cfg.inject_fault.device, " but the run has ", N,
                     " devices");
          fault_injected = true;
          rt->device(cfg.inject_fault.device).inject_fault(cfg.inject_fault.hang ? FaultKind::kHang : FaultKind::kError);
        }
        const auto ts = Clock::now();
        // nsys --capture-range=cudaProfilerApi records steps profile_range.first..second.
        if (on_cuda && step + 1 == profile_range.first) profiler_start();
        const ScopeExit stop_profiler{[&] {
          if (on_cuda && step + 1 == profile_range.second) profiler_stop();
        }};
        const NvtxRange step_range(NvtxCategory::kStep, "step " + std::to_string(step + 1));
        phase_timer.begin_step();
        const float lr = learning_rate(lrc, step);
        for_ranks([&](int r) {
          RankState& R = ranks[static_cast<size_t>(r)];
          Stream& s = rt->device(r).compute();
          const NvtxRange rank_step(NvtxCategory::kStep, "step " + std::to_string(step + 1), rt->device(r).index());
          R.loss_sum = 0;
          for (int m = 0; m < accum; ++m) {
            const HostBatch& hb = [&]() -> const HostBatch& {
              const NvtxRange data_range(NvtxCategory::kData, "data", rt->device(r).index());
              return R.prefetch->get(static_cast<int64_t>(step) * accum + m);
            }();
            upload(r, hb);
            R.batch.loss_scale = engine.loss_scale_device(r);
            engine.begin_micro_batch(r, m);
            model->forward(s, engine.access(r), *R.ws, R.batch, dloss, true);
            model->backward(s, engine.access(r), *R.ws, R.batch);
            engine.end_micro_batch(r);
            R.loss_sum += read_losses(r);  // synchronizes: hb may be recycled by the prefetcher after this
          }
          phase_timer.rank_compute_done(r);
          for (const GradientFault& f : cfg.gradient_faults)
            if (f.step == step + 1 && f.rank == r) engine.poke_gradient(r, f.block, f.offset, f.value);
          engine.check_gradients(r, R.norms.as<float>());
          s.copy(R.norm_host.data(), R.norms.data(), R.norm_host.size() * 4);
          s.copy(&R.found_inf, engine.found_inf_device(r), sizeof(float));
          s.copy(&R.scale, engine.loss_scale_state_device(r), sizeof R.scale);  // the scale this step's backward used
          s.synchronize();
        });
        phase_timer.gradients_ready();
        // Global loss and gradient norm, summed in a fixed order (rank, then block).
        double loss_sum = 0, sq = 0;
        for (const RankState& R : ranks) {
          loss_sum += R.loss_sum;
          for (float n2 : R.norm_host) sq += n2;
        }
        const double grad_norm = std::sqrt(sq);
        const double loss = loss_sum / (static_cast<double>(positions) * accum * N);
        const float step_scale = ranks[0].scale.scale;
        // Skip the update when some gradient (or the loss itself) is not finite: every rank read the
        // same combined flag on its device; a non-finite loss with finite gradients is flagged here.
        bool skipped = ranks[0].found_inf > 0;
        if (!skipped && !std::isfinite(loss)) {
          skipped = true;
          for_ranks([&](int r) { engine.mark_overflow(r); });
        }
        const float clip_scale = !skipped && cfg.grad_clip > 0 && grad_norm > cfg.grad_clip ? static_cast<float>(cfg.grad_clip / grad_norm) : 1.0f;
        OptimizerStep st;
        st.adamw = cfg.optimizer == OptimizerKind::kAdamW;
        st.lr = lr;
        st.beta1 = cfg.beta1;
        st.beta2 = cfg.beta2;
        st.eps = cfg.adam_eps;
        st.weight_decay = cfg.weight_decay;
        st.momentum = cfg.momentum;
        // AdamW's bias correction counts the updates made (a skipped step makes none).
        st.step = static_cast<int>(updates) + 1;
        st.grad_scale = clip_scale;
        phase_timer.optimizer_begin();
        // The sync makes the optimizer's time measurable (train/report.h); it changes no result.
        for_ranks([&](int r) {
          const NvtxRange rank_step(NvtxCategory::kStep, "step " + std::to_string(step + 1), rt->device(r).index());
          engine.optimizer_step(r, st);
          rt->device(r).compute().synchronize();
        });
        phase_timer.optimizer_done();
        result.loss_scales.push_back(step_scale);
        if (skipped) {
          result.skipped_steps.push_back(step + 1);
          ++consecutive_skips;
          std::string where;
          if (consecutive_skips == 1) {
            where = engine.first_nonfinite_gradient();  // lazily, only when a run of skips starts
            if (result.first_nonfinite.empty()) result.first_nonfinite = where;
          }
          const optim::LossScaleState after = engine.loss_scale_state(0);
          emit({{"event", "skipped"}, {"step", step + 1}, {"loss", std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(nullptr)},
                {"loss_scale", step_scale}, {"next_loss_scale", after.scale}, {"first_nonfinite", where}});
          if (!cfg.quiet) {
            std::printf("%sstep %d skipped: %s", tty ? "\n" : "", step + 1,
                        std::isfinite(loss) ? "non-finite gradient" : "non-finite loss");
            if (!where.empty()) std::printf(" (first in %s)", where.c_str());
            if (scaling == ZeroOptions::Scaling::kDynamic) std::printf("; loss scale %g -> %g", step_scale, after.scale);
            std::printf("\n");
          }
          if (after.collapsed != 0) {
            if (!cfg.on_scale_collapse_bf16)
              ZT_THROW(ErrorKind::kDiverged, "the fp16 loss scale collapsed to its minimum of ", cfg.min_scale, " at step ",
                       step + 1, ": the gradients overflow fp16 even unscaled; use --precision bf16 (or --on-scale-collapse "
                       "bf16), lower --lr, or lower --min-scale");
            engine.set_working_dtype(DType::kBF16);
            scaling = ZeroOptions::Scaling::kNone;
            result.switched_to_bf16_at = step + 1;
            result.precision = "bf16";
            consecutive_skips = 0;
            emit({{"event", "precision"}, {"step", step + 1}, {"precision", "bf16"}});
            if (!cfg.quiet)
              std::printf("the fp16 loss scale collapsed at step %d: continuing in bf16 from the current weights\n", step + 1);
          }
          if (consecutive_skips > cfg.max_skipped_steps)
            ZT_THROW(ErrorKind::kDiverged, consecutive_skips, " consecutive steps were skipped for non-finite ",
                     std::isfinite(loss) ? "gradients" : "losses", " (the last at step ", step + 1,
                     "); lower --lr, enable --grad-clip, or use --precision fp32 or bf16");
        } else {
          consecutive_skips = 0;
          ++updates;
        }
        phase_timer.end_step();
        const double dt = seconds_since(ts);
        train_time += dt;
        result.losses.push_back(loss);
        if (tracer)
          for (int r = 0; r < N; ++r)
            tracer->add_counter(r, "pool allocated", static_cast<double>(rt->device(r).memory().stats().allocated_bytes));
        result.final_loss = loss;
        const double tokens_done = static_cast<double>(step + 1 - start_step) * cfg.batch_size * T;
        const double tps = tokens_done / std::max(train_time, 1e-9);
        nlohmann::json rec = {{"step", step + 1}, {"loss", std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(nullptr)},
                              {"lr", lr}, {"tokens_per_s", static_cast<double>(cfg.batch_size) * T / dt},
                              {"grad_norm", std::isfinite(grad_norm) ? nlohmann::json(grad_norm) : nlohmann::json(nullptr)},
                              {"step_ms", dt * 1e3}, {"mem_bytes", max_allocated_bytes(devs)}, {"skipped", skipped},
                              {"skipped_total", result.skipped_steps.size()}};
        if (scaling != ZeroOptions::Scaling::kNone) rec["loss_scale"] = step_scale;
        emit(rec);
        if (!cfg.quiet && (tty || (step + 1) % print_every == 0 || step + 1 == cfg.steps)) {
          const double el = seconds_since(t0);
          const double eta = el / (step + 1 - start_step) * (cfg.steps - step - 1);
          std::string mp;
          if (scaling != ZeroOptions::Scaling::kNone) mp += " | scale " + si(step_scale);
          if (!result.skipped_steps.empty()) mp += " | skipped " + std::to_string(result.skipped_steps.size());
          std::printf("%sstep %*d/%d | loss %.4f | lr %.2e | %s tok/s | norm %.3f%s | mem %s | %s elapsed | ETA %s%s",
                      tty ? "\r" : "", static_cast<int>(std::to_string(cfg.steps).size()), step + 1, cfg.steps, loss, lr,
                      si(tps).c_str(), grad_norm, mp.c_str(), format_bytes(static_cast<double>(max_allocated_bytes(devs))).c_str(), format_hms(el).c_str(), format_hms(eta).c_str(), tty ? "   " : "\n");
          std::fflush(stdout);
        }
        const bool last = step + 1 == cfg.steps;
        if (last) {
          for (int r = 0; r < N; ++r) {
            const CommCounters c = comm.counters(r);
            result.comm_bytes_per_step_per_device.push_back((c.bytes_sent - side_bytes[static_cast<size_t>(r)]) /
                                                            static_cast<uint64_t>(cfg.steps - start_step));
          }
        }
        if ((cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last) {
          double acc = 0;
          if (cfg.zero_trace) {
            auto spans = engine.take_trace();
            result.trace.insert(result.trace.end(), spans.begin(), spans.end());
            engine.set_tracing(false);
          }
          exclude_comm([&] { result.val_loss = evaluate(is_gpt ? nullptr : &acc); });
          result.val_losses.emplace_back(step + 1, result.val_loss);
          engine.set_tracing(cfg.zero_trace);
          if (!is_gpt) result.accuracy = acc;
          nlohmann::json ev = {{"event", "eval"}, {"step", step + 1}, {"val_loss", result.val_loss}};
          if (!is_gpt) ev["accuracy"] = acc;
          emit(ev);
          if (!cfg.quiet) {
            std::printf("%seval at step %d: val loss %.4f", tty ? "\n" : "", step + 1, result.val_loss);
            if (!is_gpt) std::printf(", test accuracy %.2f%%", acc * 100);
            if (result.entropy_floor) std::printf(" (floor %.4f)", *result.entropy_floor);
            std::printf("\n");
          }
        }
        if (is_gpt && cfg.sample_every > 0 && (step + 1) % cfg.sample_every == 0 && !last && !cfg.quiet) {
          std::printf("%s--- sample at step %d ---\n", tty ? "\n" : "", step + 1);
          std::string text;
          exclude_comm([&] { text = sample(cfg.sample_tokens, static_cast<uint64_t>(step)); });
          print_sample_text(text);
        }
        if (cfg.snapshot_every > 0 && (step + 1) % cfg.snapshot_every == 0 && !last) take_snapshot_now(step + 1);
        if (saver && ((cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) || last)) {
          // Snapshot to host (the stall), then write and commit in the background.
          const auto ts0 = Clock::now();
          HostSnapshot snap = take_snapshot(engine, *model, adamw, step + 1, for_ranks);
          snap.meta = trainer_meta(step + 1);
          const double stall = seconds_since(ts0);
          const size_t bytes = snap.bytes();
          const int at = step + 1;
          saver->save(std::move(snap), [&, stall, bytes, at](const std::string& path, double secs) {
            std::lock_guard<std::mutex> lock(saved_mu);
            result.checkpoints.push_back(path);
            char line[512];
            std::snprintf(line, sizeof line, "checkpoint %s: %s, training stalled %.1f ms, written in the background in %.1f ms",
                          path.c_str(), format_bytes(static_cast<double>(bytes)).c_str(), stall * 1e3, secs * 1e3);
            saved_messages.push_back(line);
            emit({{"event", "checkpoint"}, {"step", at}, {"path", path}, {"bytes", bytes}, {"stall_ms", stall * 1e3},
                  {"write_ms", secs * 1e3}});
          });
          if (last) saver->wait();
        }
        {
          std::lock_guard<std::mutex> lock(saved_mu);
          if (!cfg.quiet)
            for (const std::string& m : saved_messages) std::printf("%s%s\n", tty ? "\n" : "", m.c_str());
          saved_messages.clear();
        }
      } catch (const Error& e) {
        // A device failed (an error at a synchronisation, or the watchdog gave up on it): with
        // --snapshot-every, drop it and go on from the last snapshot on the others.
        if (!recover_from_failure(e, step)) throw;
        break;
      }
    }
    if (start_step == cfg.steps && !next_spec) {
      // Nothing was left to train (a conversion): save what was loaded.
      result.comm_bytes_per_step_per_device.assign(static_cast<size_t>(N), 0);
      if (saver) {
        HostSnapshot snap = take_snapshot(engine, *model, adamw, start_step, for_ranks);
        snap.meta = trainer_meta(start_step);
        result.checkpoints.push_back(write_checkpoint(snap, cfg.checkpoint_dir, cfg.keep));
        if (!cfg.quiet) std::printf("checkpoint %s: saved what was loaded (no steps left)\n", result.checkpoints.back().c_str());
      }
    }
    if (saver) saver->wait();
    if (next_spec) continue;  // a device was lost: rebuild the world on the survivors
    result.steps = cfg.steps - result.start_step;
    result.seconds = seconds_since(t0);
    result.tokens_per_s = static_cast<double>(cfg.steps - start_step) * cfg.batch_size * T / std::max(train_time, 1e-9);
    if (is_gpt && cfg.sample_tokens > 0) {
      result.sample = sample(cfg.sample_tokens, 0xfeed);
      if (!cfg.quiet) {
        std::printf("--- sample (%d tokens, temperature %.2f, top-k %d) ---\n", cfg.sample_tokens, cfg.temperature, cfg.top_k);
        print_sample_text(result.sample);
      }
    }
    if (cfg.keep_final_params)
      for (int b = 0; b < num_blocks; ++b) {
        result.final_params.push_back(engine.master_to_host(b));
        result.final_working.push_back(engine.block_to_host(b));
        // The whole block's first moments, then its second ones (whatever the device count).
        std::vector<float> first, second;
        for (int r = 0; r < N; ++r) {
          const std::vector<float> m = engine.moments_to_host(r, b);
          const size_t n = static_cast<size_t>(engine.shard_of(r, b).size());
          first.insert(first.end(), m.begin(), m.begin() + static_cast<long>(n));
          second.insert(second.end(), m.begin() + static_cast<long>(n), m.end());
        }
        first.insert(first.end(), second.begin(), second.end());
        result.final_moments.push_back(std::move(first));
      }
    for (int r = 0; r < N; ++r) {
      result.peak_bytes_per_device.push_back(rt->device(r).memory().stats().peak_allocated_bytes);
      result.model_state_bytes_per_device.push_back(engine.model_state_bytes(r).total());
    }

    // The run report (train/report.h): throughput, MFU, time split, memory per device.
    RunReport report;
    report.steps = result.steps;
    report.seconds = result.seconds;
    report.train_seconds = train_time;
    report.final_loss = result.final_loss;
    report.val_loss = result.val_loss;
    report.entropy_floor = result.entropy_floor;
    report.accuracy = result.accuracy;
    report.per_example = !is_gpt;
    report.tokens_per_s = result.tokens_per_s;
    report.flops_per_token = result.flops_per_token = training_flops_per_token(mc, layout.total_parameters(), T);
    {
      std::vector<std::string> names;
      for (int r = 0; r < N; ++r) names.push_back(rt->device(r).name());
      report.peak_flops = total_peak_flops(names);
    }
    report.mfu = result.mfu = model_flops_utilization(report.flops_per_token, report.tokens_per_s, report.peak_flops);
    report.phases = result.time_split = phase_timer.totals();
    for (int r = 0; r < N; ++r) {
      const ModelStateBytes mb = engine.model_state_bytes(r);
      report.devices.push_back({rt->device(r).name(), mb.params, mb.grads, mb.optimizer,
                                ranks[static_cast<size_t>(r)].ws->bytes(), comm.buffer_bytes(r),
                                rt->device(r).memory().stats().peak_allocated_bytes,
                                result.comm_bytes_per_step_per_device[static_cast<size_t>(r)]});
    }

    nlohmann::json memory_breakdown = nlohmann::json::array();
    for (int r = 0; r < N; ++r) {
      const ModelStateBytes mb = engine.model_state_bytes(r);
      memory_breakdown.push_back({{"params", mb.params},
                                  {"grads", mb.grads},
                                  {"optimizer", mb.optimizer},
                                  {"activations", ranks[static_cast<size_t>(r)].ws->bytes()},
                                  {"comm_buffers", comm.buffer_bytes(r)},
                                  {"pool_peak", rt->device(r).memory().stats().peak_allocated_bytes}});
    }
    nlohmann::json summary = {{"event", "summary"},
                              {"steps", result.steps},
                              {"final_loss", result.final_loss},
                              {"val_loss", result.val_loss},
                              {"tokens_per_s", result.tokens_per_s},
                              {"seconds", result.seconds},
                              {"peak_bytes_per_device", result.peak_bytes_per_device},
                              {"model_state_bytes_per_device", result.model_state_bytes_per_device},
                              {"comm_bytes_per_step_per_device", result.comm_bytes_per_step_per_device},
                              {"memory_per_device", memory_breakdown},
                              {"parameters", layout.total_parameters()},
                              {"devices", N},
                              {"zero_stage", cfg.zero_stage}};
    if (result.entropy_floor) summary["entropy_floor"] = *result.entropy_floor;
    if (result.accuracy) summary["accuracy"] = *result.accuracy;
    summary.update(report_json(report));
    emit(summary);
    if (metrics) std::fclose(metrics);
    if (!cfg.quiet) {
      std::fputs(format_summary(report).c_str(), stdout);
      std::fflush(stdout);
    }
    if (tracer) {
      if (on_cuda) {
        static const char* const kSpanNames[] = {"forward ", "backward ", "reduce_scatter ", "gather "};
        for (const TraceSpan& sp : result.trace) {
          const bool comm_side = sp.kind == TraceSpan::kReduceScatter || sp.kind == TraceSpan::kGather;
          tracer->add_slice(rt->device(sp.rank).index(), comm_side ? 1 : 0, kSpanNames[sp.kind] + layout.block(sp.block).name,
                            "engine", sp.start_us, sp.end_us, engine.trace_origin());
        }
      }
      std::vector<std::string> names;
      for (int r = 0; r < N; ++r) names.push_back(rt->device(r).name());
      tracer->write(cfg.trace_path, names);
    }
    return result;
  }
}

}  // namespace zt
