// A World: runtime + communicator + model + engine + per-rank state (see world.h).
#include "train/world.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "checkpoint/safetensors.h"
#include "core/heartbeat.h"
#include "core/status.h"
#include "train/comm_engine.h"
#include "train/export.h"
#include "train/processes.h"
#include "train/state_io.h"

#if ZT_WITH_CUDA
#include "runtime/cuda/cuda_backend.h"
#endif

namespace zt {

void run_ranks(int n, const std::function<void(int)>& fn, Communicator& comm, std::chrono::milliseconds timeout,
               const std::function<void()>& on_timeout) {
  if (n == 1 && timeout.count() == 0) {
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
      } catch (...) {
        std::string what = "rank " + std::to_string(r) + " failed";
        try {
          throw;
        } catch (const std::exception& e) {
          what += std::string(": ") + e.what();
        } catch (...) {
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
        }
        comm.abort(what);
      }
      std::lock_guard<std::mutex> lock(mu);
      ++finished;
      cv.notify_all();
    });
  if (timeout.count() > 0) {
    // A hang is no progress for `timeout` (core/heartbeat.h), not a call that takes longer: the
    // counter is looked at a few times per timeout, and every change restarts the clock.
    using Clock = std::chrono::steady_clock;
    const auto look = std::max<Clock::duration>(timeout / 8, std::chrono::milliseconds(1));
    std::unique_lock<std::mutex> lock(mu);
    uint64_t seen = heartbeats();
    Clock::time_point last = Clock::now();
    while (!cv.wait_for(lock, std::min<Clock::duration>(look, last + timeout - Clock::now()),
                        [&] { return finished == n; })) {
      if (const uint64_t now = heartbeats(); now != seen) {
        seen = now;
        last = Clock::now();
      } else if (Clock::now() - last >= timeout) {
        lock.unlock();
        on_timeout();
        break;
      }
    }
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

namespace {

ZeroOptions zero_options(const RunContext& run, int accum, DType working, ZeroOptions::Scaling scaling) {
  const TrainConfig& cfg = run.cfg;
  ZeroOptions zo;
  zo.stage = cfg.zero_stage;
  zo.sgd = cfg.optimizer == OptimizerKind::kSgd;
  zo.micro_batches = accum;
  zo.working = working;
  zo.scaling = scaling;
  zo.initial_scale = run.initial_scale;
  zo.scale_config.growth_interval = cfg.scale_window;
  zo.scale_config.hysteresis = cfg.scale_hysteresis;
  zo.scale_config.min_scale = cfg.min_scale;
  zo.scale_config.max_scale = cfg.max_scale;
  zo.rounding = cfg.stochastic_rounding ? optim::Rounding::kStochastic : optim::Rounding::kNearest;
  zo.seed = cfg.seed;
  zo.offload = cfg.offload_optimizer;
  zo.offload_fraction = cfg.offload_fraction;
  zo.offload_delay = cfg.offload_delay_update;
  zo.tensor = cfg.tensor_parallel;
  return zo;
}

// The producer of rank r's prefetcher: micro-batch m of step s holds the rank's chunk of the step's
// global batch (train/batch_split.h), padded to split.micro rows with "ignore" targets.
Prefetcher<HostBatch>::Producer rank_rows(const RunContext& run, const BatchSplit& split, int r) {
  return [&run, split, r](int64_t micro_index, HostBatch& hb) {
    const uint64_t step = static_cast<uint64_t>(micro_index / split.accum);
    const int m = static_cast<int>(micro_index % split.accum);
    const int first = split.first_row(m, r), count = split.rows(m, r), B = split.micro, T = run.T;
    const int D = run.mc.input_dim;
    hb.targets.assign(static_cast<size_t>(B) * static_cast<size_t>(T), -1);
    if (run.is_gpt) {
      hb.tokens.assign(static_cast<size_t>(B) * static_cast<size_t>(T), 0);
      if (count > 0) run.lang->batch(Split::kTrain, step, first, count, T, hb.tokens.data(), hb.targets.data());
    } else {
      const int64_t per_epoch = run.images->batches_per_epoch(Split::kTrain, split.batch);
      hb.images.assign(static_cast<size_t>(B) * static_cast<size_t>(D), 0.0f);
      if (count > 0)
        run.images->batch(Split::kTrain, step / per_epoch, static_cast<int64_t>(step % per_epoch), split.batch, first,
                          count, hb.images.data(), hb.targets.data());
    }
  };
}

}  // namespace

World::World(const RunContext& run, std::unique_ptr<Runtime> rt, const BatchSplit& split, DType working,
             ZeroOptions::Scaling scaling)
    : run_(run), split_(split), scaling_(scaling), rt_(std::move(rt)) {
  for (int r = 0; r < rt_->size(); ++r) {
    devs_.push_back(&rt_->device(r));
    const char* tiles = std::getenv("ZT_GEMM_TILES");
    const bool gemm_tiles = run.cfg.gemm_tiles || (tiles != nullptr && std::string(tiles) == "on");
    devs_.back()->set_math_mode(MathMode{.tf32 = run.cfg.tf32,
                                         .deterministic_attention = run.cfg.deterministic_attention,
                                         .gemm_tiles = gemm_tiles});  // before any op is enqueued
  }
  const int N = size(), TP = run.cfg.tensor_parallel, PP = run.cfg.pipeline_parallel;
  comm_ = std::make_unique<Communicator>(devs_);
  ZT_REQUIRE(N % TP == 0, "--tensor-parallel ", TP, " does not divide the ", N,
             " devices this process drives (the tensor axis lives inside a process)");
  ZT_REQUIRE(N % (TP * PP) == 0, "--pipeline-parallel ", PP, " does not divide the ", N / TP, " device groups");
  mesh_ = std::make_unique<Mesh>(MeshShape{.data = N / TP / PP, .tensor = TP, .pipeline = PP}, N);
  host_scalars_ = PP > 1 || run.processes->size() > 1;
  ZeroOptions zo = zero_options(run, split.accum, working, scaling);
#if ZT_WITH_CUDA
  // Offloaded state on GPUs lives in pinned memory, so its copies are asynchronous DMA.
  // Pinned under a GPU of the run: the offload thread may not have used one when it first allocates.
  if (rt_->backend() == Backend::kCuda) {
    const int gpu = cuda::stream_ordinal(devs_.front()->compute().native_handle());
    zo.host_memory = [gpu] { return cuda::make_pinned_host_raw_allocator(gpu); };
  }
#endif
  if (PP > 1) build_pipeline(zo);
  else build_one_stage(zo);
  for (auto& e : engines_) e->set_tracing(run.cfg.test.zero_trace);
  init_parameters();

  const int B = split.micro, T = run.T, D = run.is_gpt ? 0 : run.mc.input_dim;
  ranks_.resize(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    RankState& R = rank(r);
    Device& d = device(r);
    Stream& s = d.compute();
    const ParamLayout& layout = model_of(r).layout();
    const RankBuffers buf = buffers_of(r);
    auto alloc = [&](const RankBuffer& b) { return DeviceBuffer(d.memory(), b.bytes, s, b.tag); };
    stages_->allocate(*this, r, B, T);
    for (int k = 0; k < buf.inputs.count; ++k) {
      R.inputs.push_back(alloc(buf.inputs));
      R.targets.push_back(alloc(buf.targets));
      Batch b;
      b.B = B;
      b.T = T;
      b.inputs = ConstTensorView{R.inputs.back().data(), buf.inputs.dtype, run.is_gpt ? Shape{B, T} : Shape{B, D}, d.index()};
      b.targets = ConstTensorView{R.targets.back().data(), buf.targets.dtype, run.is_gpt ? Shape{B, T} : Shape{B}, d.index()};
      R.batches.push_back(b);
    }
    if (buf.tied_scratch.count) R.tied_scratch = alloc(buf.tied_scratch);
    R.norms = alloc(buf.norms);
    R.step_rows = alloc(buf.step_rows);
    R.step_include = alloc(buf.step_include);
    R.step_out = alloc(buf.step_out);
    R.staged_inputs = buf.inputs.bytes;
    R.staged_bytes = buf.inputs.bytes + buf.targets.bytes;
    R.staged = d.alloc_host_pinned(static_cast<size_t>(kStepSlots * split.accum) * R.staged_bytes);
    for (int slot = 0; slot < buf.step_host.count; ++slot) {
      R.step_host[static_cast<size_t>(slot)] = d.alloc_host_pinned(buf.step_host.bytes);
      RankState::StepEvents& ev = R.events[static_cast<size_t>(slot)];
      for (auto* e : {&ev.step_begin, &ev.compute_done, &ev.grads_ready, &ev.opt_begin, &ev.opt_end})
        *e = d.create_timing_event();
    }
    R.losses.resize(static_cast<size_t>(B * T));
    R.norm_host.resize(static_cast<size_t>(2 * layout.num_blocks() + 1));
    // The ranks of a tensor group (and every stage of a pipeline) run the same rows: the batch
    // splits over the data axis.
    R.prefetch = std::make_unique<Prefetcher<HostBatch>>(rank_rows(run, split_, data_rank(r)));
  }
}

ParamLayout World::logical_layout() const { return stages_->logical_layout(*this); }

// Parameters: initialised once on the host (deterministic in the seed, independent of the
// device count and the tensor and pipeline degrees: the logical, one-device blocks), or read
// from --init-from; a tensor-parallel rank loads its shard of them, a pipeline stage its blocks.
void World::init_parameters() {
  const ParamLayout logical = logical_layout();
  std::vector<std::vector<float>> host(static_cast<size_t>(logical.num_blocks()));
  if (!run_.cfg.init_from.empty()) {
    std::vector<std::string> ignored;
    host = read_safetensors_weights(run_.cfg.init_from, run_.mc, logical, &ignored);
    init_note_ = "initialised from " + run_.cfg.init_from;
    if (!ignored.empty())
      init_note_ += " (" + std::to_string(ignored.size()) + " tensors the model does not use ignored, e.g. " + ignored[0] + ")";
  } else {
    for (int b = 0; b < logical.num_blocks(); ++b) {
      host[static_cast<size_t>(b)].resize(static_cast<size_t>(logical.block(b).numel));
      init_block_host(logical.block(b), run_.cfg.seed, host[static_cast<size_t>(b)].data());
    }
  }
  load_initial_parameters(host);
}

// Each rank loads its stage's blocks (the logical blocks it holds, logical_block), its tensor
// coordinate's shard of each where the stage is tensor-parallel.
void World::load_initial_parameters(const std::vector<std::vector<float>>& host) {
  std::vector<const float*> blocks;
  for (const auto& b : host) blocks.push_back(b.data());
  for (int r = 0; r < size(); ++r) {
    const Model& m = model_of(r);
    const TensorMap* tmap = m.tensor_map();
    std::vector<std::vector<float>> local;
    for (int b = 0; b < m.layout().num_blocks(); ++b)
      local.push_back(tmap ? tmap->local_block(mesh_->index(MeshAxis::kTensor, r), b, blocks)
                           : host[static_cast<size_t>(m.logical_block(b))]);
    engine_of(r).rank(engine_rank(r)).load_parameters(local);
  }
}

// One stage: one model over the world's ranks (tensor-parallel inside each tensor group), its ZeRO
// engine over the data axis, with every process's ranks where there are several.
void World::build_one_stage(const ZeroOptions& zero) {
  const int TP = run_.cfg.tensor_parallel;
  ZeroOptions zo = zero;
  // Every model computes in the working dtype (16-bit activations in a 16-bit run).
  models_.push_back(make_model(run_.mc, run_.cfg.recompute,
                               TensorParallel{TP, run_.cfg.sequence_parallel, comm_.get(), mesh_.get()},
                               run_activation_dtype(zo.working)));
  // The data axis over every process's devices, the tensor axis inside each (train/processes.h);
  // one process without --comm nccl: none, the engine's data group runs on comm_.
  collectives_ = run_.cfg.comm == CommEngine::kNccl
                     ? run_.processes->connect_nccl(devs_)
                     : run_.processes->connect(devs_, TP, run_.cfg.comm_topology == CommTopology::kHierarchical);
  zo.processes = collectives_.get();
  engines_.push_back(std::make_unique<ZeroEngine>(*models_[0], devs_, *comm_, zo));
  stages_ = std::make_unique<OneStage>(size());
}

// Pipeline stages: the mesh {data, tensor, pipeline = P}; stage s is a ZeRO engine
// (ZeroOptions::pipeline) of its own stage model over its D x T ranks (tensor fastest, each tensor
// coordinate sharded over its D data ranks), with its own communicator for the engine's collectives
// (stage_comms_; the world's carries the tensor groups' collectives, the activations between stages
// and the tied embedding's gradient between the first and the last stage).
void World::build_pipeline(const ZeroOptions& zero) {
  const TrainConfig& cfg = run_.cfg;
  const int P = cfg.pipeline_parallel, V = cfg.virtual_stages, m = split_.accum;
  const PipelineCosts costs = gpt_pipeline_costs(run_.mc, run_.T);
  PipelinePartition partition = cfg.pp_layout.empty() ? partition_pipeline(costs, P, V)
                                                      : partition_from_layout(costs, parse_pp_layout(cfg.pp_layout), P, V);
  const PipeSchedule kind = cfg.pp_schedule;
  Schedule schedule = make_schedule(kind, P, m, V);
  ZeroOptions zo = zero;
  zo.pipeline = true;
  zo.micro_batches = 1;  // the engine reduces once per step, after the schedule's last backward
  const auto specs = pipeline_stage_specs(partition, schedule.splits_backward());
  const MeshShape shape = mesh_->shape();
  for (int s = 0; s < P; ++s) {
    std::vector<Device*> devs;  // engine rank t + T * d (engine_rank)
    for (int d = 0; d < shape.data; ++d)
      for (int t = 0; t < shape.tensor; ++t)
        devs.push_back(devs_[static_cast<size_t>(mesh_->rank_at(MeshCoord{.data = d, .tensor = t, .pipeline = s}))]);
    stage_comms_.push_back(std::make_unique<Communicator>(devs));
    // Tensor-parallel stages run their tensor groups' collectives on the world communicator.
    models_.push_back(make_gpt_stage(run_.mc, specs[static_cast<size_t>(s)], cfg.recompute,
                                     TensorParallel{shape.tensor, cfg.sequence_parallel, comm_.get(), mesh_.get()},
                                     run_activation_dtype(zo.working)));
    engines_.push_back(std::make_unique<ZeroEngine>(*models_.back(), devs, *stage_comms_.back(), zo));
  }
  // --trace shows every rank's spans.
  stages_ = std::make_unique<PipelineStages>(*this, split_.micro, run_.T, std::move(partition), std::move(schedule),
                                             schedule_note(kind, P, m), !cfg.trace_path.empty());
}

RankBuffers World::buffers_of(int r) const {
  return rank_buffers(RankBufferShape{.gpt = run_.is_gpt,
                                      .micro_batch = split_.micro,
                                      .seq_len = run_.T,
                                      .input_dim = run_.is_gpt ? 0 : run_.mc.input_dim,
                                      .ranks = size(),
                                      .data_ranks = mesh_->shape().data,
                                      .micro_batches = split_.accum,
                                      .pipeline = mesh_->shape().pipeline > 1},
                      model_of(r));
}

// Work still queued on a device may read or write host memory this World owns (a batch being
// uploaded, losses being copied back) when an error unwinds a step on another rank's thread: it
// finishes before any member goes. A device with an injected hang is skipped (the runtime abandons
// it, and its parked work never runs); a failed device's queue drains, its error was reported.
// On CUDA a device still busy after --hang-timeout (its streams waiting on a GPU that faulted or
// hangs) would block the runtime's teardown forever (cudaStreamSynchronize): the process ends with
// one sentence instead (see hang_response).
World::~World() {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(run_.cfg.hang_timeout_s * 1000));
  std::string stuck;
  for (Device* d : devs_) {
    if (d->hang_injected()) continue;
    try {
      if (!d->synchronize_for(timeout)) stuck += (stuck.empty() ? "" : ", ") + d->name();
    } catch (const Error&) {
    }
  }
  if (!stuck.empty() && timeout.count() > 0 && rt_->backend() == Backend::kCuda)
    end_process_for_stuck_gpus(stuck, " while the run was being torn down");
}

void World::end_process_for_stuck_gpus(const std::string& names, const std::string& when) const {
  // Not an exception: threads waiting inside CUDA cannot be joined, and a stuck GPU's streams and
  // memory cannot be released (cudaStreamSynchronize, cudaFree wait for it), so nothing could unwind
  // to apps/. Checkpoints on disk stay whole (written atomically, as under SIGKILL).
  std::string failed;
  for (const Device* d : devs_)
    if (d->failed()) failed += (failed.empty() ? "" : ", ") + d->name();
  std::string tail;
  if (!failed.empty()) tail += " (after " + failed + " failed)";
  tail += ": a GPU whose work does not finish cannot be released or torn down inside the process, so the run ends "
          "here instead of recovering";
  if (!run_.cfg.checkpoint_dir.empty())
    tail += "; --resume auto continues from the last complete checkpoint in " + run_.cfg.checkpoint_dir;
  std::fprintf(stderr, "zerotrain: %s made no progress for %g s (--hang-timeout)%s%s\n", names.c_str(),
               run_.cfg.hang_timeout_s, when.c_str(), tail.c_str());
  std::fflush(nullptr);
  std::_Exit(1);
}

const Model& World::model() const {
  ZT_CHECK(models_.size() == 1, "a pipelined world has a model per stage (model_of)");
  return *models_[0];
}

ZeroEngine& World::engine() {
  ZT_CHECK(engines_.size() == 1, "a pipelined world has an engine per stage (engine_of)");
  return *engines_[0];
}

std::vector<ZeroEngine*> World::engines() {
  std::vector<ZeroEngine*> out;
  for (auto& e : engines_) out.push_back(e.get());
  return out;
}

std::vector<std::string> World::device_names() const {
  std::vector<std::string> names;
  for (const Device* d : devs_) names.push_back(d->name());
  return names;
}

void World::for_ranks(const std::function<void(int)>& fn) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(run_.cfg.hang_timeout_s * 1000));
  run_ranks(size(), fn, *comm_, timeout, [this] { on_watchdog_timeout(); });
}

// A device that stops answering is abandoned (its stream work and everyone waiting on it are
// released with errors), so that the run can recover instead of hanging.
HangResponse hang_response(Backend backend, const std::vector<bool>& injected, const std::vector<bool>& stuck) {
  HangResponse h;
  const int n = static_cast<int>(injected.size());
  for (int r = 0; r < n; ++r)
    if (injected[static_cast<size_t>(r)]) h.abandon.push_back(r);
  if (!h.abandon.empty()) return h;  // released by abandon() on every backend
  for (int r = 0; r < n && r < static_cast<int>(stuck.size()); ++r)
    if (stuck[static_cast<size_t>(r)]) h.abandon.push_back(r);
  if (backend == Backend::kCuda && !h.abandon.empty()) {
    h.end_process = true;
    return h;
  }
  if (static_cast<int>(h.abandon.size()) == n) h.abandon.clear();  // cannot tell which: give up below
  return h;
}

void World::on_watchdog_timeout() {
  const int N = size();
  const double secs = run_.cfg.hang_timeout_s;
  std::vector<bool> injected(static_cast<size_t>(N)), stuck(static_cast<size_t>(N));
  bool any_injected = false;
  for (int r = 0; r < N; ++r) any_injected |= injected[static_cast<size_t>(r)] = device(r).hang_injected();
  if (!any_injected)  // a real hang: the devices whose work does not finish
    for (int r = 0; r < N; ++r) {
      try {
        stuck[static_cast<size_t>(r)] = !device(r).synchronize_for(std::chrono::milliseconds(100));
      } catch (const Error&) {
      }
    }
  const HangResponse h = hang_response(rt_->backend(), injected, stuck);
  std::string names;
  for (int r : h.abandon) names += (names.empty() ? "" : ", ") + device(r).name();
  if (h.end_process) end_process_for_stuck_gpus(names, "");
  if (!names.empty()) hung_ += (hung_.empty() ? "" : ", ") + names;
  for (int r : h.abandon)
    device(r).abandon("it stopped answering for " + std::to_string(secs) + " s (--hang-timeout)");
  comm_->abort(h.abandon.empty() ? "the devices stopped answering for " + std::to_string(secs) + " s"
                                 : hung_ + " stopped answering");
}

void World::upload(int r, const HostBatch& hb, int micro, int slot) {
  RankState& R = rank(r);
  Stream& s = device(r).compute();
  const auto m = static_cast<size_t>(micro);
  const void* inputs = run_.is_gpt ? static_cast<const void*>(hb.tokens.data()) : hb.images.data();
  const size_t in_bytes = (run_.is_gpt ? hb.tokens.size() : hb.images.size()) * 4, target_bytes = hb.targets.size() * 4;
  const void* targets = hb.targets.data();
  if (slot >= 0) {
    ZT_CHECK(in_bytes <= R.staged_inputs && target_bytes <= R.staged_bytes - R.staged_inputs &&
                 static_cast<size_t>(slot + 1) * R.staged_bytes <= R.staged.size(),
             "a batch of ", in_bytes, " + ", target_bytes, " bytes does not fit staging slot ", slot);
    char* at = static_cast<char*>(R.staged.data()) + static_cast<size_t>(slot) * R.staged_bytes;
    std::memcpy(at, inputs, in_bytes);
    std::memcpy(at + R.staged_inputs, targets, target_bytes);
    inputs = at, targets = at + R.staged_inputs;
  }
  s.copy(R.inputs[m].data(), inputs, in_bytes);
  s.copy(R.targets[m].data(), targets, target_bytes);
}

void World::reset_comm_counters() {
  comm_->reset_counters();
  for (auto& c : stage_comms_) c->reset_counters();
  if (collectives_) {
    ring_sent_base_.clear();
    for (int r = 0; r < size(); ++r) ring_sent_base_.push_back(collectives_->bytes_sent(r));
    ring_across_base_ = collectives_->bytes_sent_across();
  }
}

size_t World::comm_buffer_bytes(int r) const {
  size_t n = comm_->buffer_bytes(r);
  if (!stage_comms_.empty()) n += stage_comms_[static_cast<size_t>(stage_of(r))]->buffer_bytes(engine_rank(r));
  return n;
}

uint64_t World::bytes_sent(int r) {
  uint64_t n = comm_->counters(r).bytes_sent;
  if (!stage_comms_.empty())
    n += stage_comms_[static_cast<size_t>(stage_of(r))]->counters(engine_rank(r)).bytes_sent;
  if (collectives_)
    n += collectives_->bytes_sent(r) - (ring_sent_base_.empty() ? 0 : ring_sent_base_[static_cast<size_t>(r)]);
  return n;
}

uint64_t World::bytes_sent_across() const {
  return collectives_ ? collectives_->bytes_sent_across() - ring_across_base_ : 0;
}

uint64_t World::tensor_bytes_sent(int r) {
  if (mesh_->shape().tensor == 1) return 0;
  const std::vector<int> group = mesh_->tensor_group(r);
  const uint64_t n = comm_->group(group).counters(r).bytes_sent;
  // One data rank: the tensor group is the world group, whose counters hold the step scalars too.
  return static_cast<int>(group.size()) == size() ? n - rank(r).scalar_bytes : n;
}

TrainCounters World::apply_state(const StateSource& src, const nlohmann::json& meta) {
  const bool adamw = run_.cfg.optimizer == OptimizerKind::kAdamW;
  // A pipeline stage's blocks carry their logical names (its tied head copy the embeddings'), so
  // each stage reads its own blocks' arrays, whatever pipeline degree wrote them.
  for (int p = 0; p < mesh_->shape().pipeline; ++p)
    check_source_matches(src, model_of(mesh_->rank_at({.data = 0, .tensor = 0, .pipeline = p})), adamw);
  for_ranks([&](int r) { restore_rank(engine_of(r), model_of(r), src, engine_rank(r)); });
  TrainCounters c;
  c.step = meta.value("step", 0);
  c.updates = meta.value("updates", int64_t{0});
  c.skipped_steps = meta.value("skipped_steps", std::vector<int>{});
  if (meta.contains("loss_scale") && scaling_ != ZeroOptions::Scaling::kNone) {
    const auto& ls = meta["loss_scale"];
    const optim::LossScaleState st{ls.at("scale").get<float>(), ls.at("inv_scale").get<float>(),
                                   ls.at("good_steps").get<float>(), ls.at("hysteresis_left").get<float>(),
                                   ls.at("collapsed").get<float>(), ls.at("skipped").get<float>()};
    for (int r = 0; r < size(); ++r) engine_of(r).rank(engine_rank(r)).scaler().set_state(st);
  }
  return c;
}

}  // namespace zt
