// A World: everything one set of devices needs to train — runtime, communicator, model, ZeRO
// engine and per-rank state (activations, device-side inputs, a prefetcher of the rank's rows of
// every global batch) — built together and destroyed together. Recovery from a lost device throws
// a World away and builds the next one on the survivors.
#pragma once

#include <array>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "data/image_data.h"
#include "data/language_data.h"
#include "data/prefetcher.h"
#include "memory/caching_allocator.h"
#include "memory/pinned_host_buffer.h"
#include "model/model.h"
#include "runtime/runtime.h"
#include "train/batch_split.h"
#include "train/plan.h"
#include "train/rank_buffers.h"
#include "train/run_shape.h"
#include "train/stages.h"
#include "train/trainer.h"
#include "zero/engine.h"

namespace zt {

class BpeTokenizer;

class StateSource;
class Processes;
class MicroBatchGraph;  // train/graph_step.h


// Host-side rows of one micro-batch: what the data layer fills and the prefetcher double-buffers.
struct HostBatch {
  std::vector<int32_t> tokens;   // GPT inputs [B*T]
  std::vector<float> images;     // MLP inputs [B*D]
  std::vector<int32_t> targets;  // [B*T] or [B]; -1 (ignore) on padding rows
};

// One rank's buffers and host scratch.
struct RankState {
  // norms: the 2 * blocks gradient-norm partials (ZeroRank::check_gradients), then the step's
  // loss sum and one micro-batch's (kLossSlots floats), summed on the device and read once per step.
  DeviceBuffer norms;
  // The step's device batches: one per micro-batch a step keeps live (one; a pipeline stage: every
  // micro-batch of the step, rank_buffers.h), each over its inputs and targets.
  std::vector<DeviceBuffer> inputs, targets;
  std::vector<Batch> batches;
  // The first and last pipeline stage: the partner's gradient of the tied embedding (else empty).
  DeviceBuffer tied_scratch;
  std::unique_ptr<Prefetcher<HostBatch>> prefetch;
  // The step's own copies of its micro-batches, in pinned host memory (Device::alloc_host_pinned):
  // a stream copy reads its host source when it runs, and the prefetcher recycles a batch at the
  // next get(); these stay untouched until the step was read, so no micro-batch needs a host wait.
  // Pinned because CUDA may make a copy from pageable memory wait for the stream's earlier work
  // (the documented "might be synchronous" of cudaMemcpyAsync), which would hold the host at the
  // next step's upload until the step before drained. Two steps' worth (kStepSlots * accum slots
  // of staged_bytes, the step's slot first): the next step is staged while this one may still be
  // uploading. A slot holds a micro-batch's inputs (staged_inputs bytes), then its targets.
  PinnedHostBuffer staged;
  size_t staged_bytes = 0, staged_inputs = 0;  // one slot; its inputs' part (RankBuffers)
  std::vector<float> losses, norm_host;  // norm_host: norms' 2 * blocks partials, then the loss sum
  double loss_sum = 0;
  float found_inf = 0;
  optim::LossScaleState scale{};
  // The step's global scalars on the device (train/step.cc, one process without pipeline stages):
  // step_rows holds every rank's row (its norm partials, loss sum and overflow flag), all-gathered;
  // step_include says which entries count (uploaded once from step_include_host); step_out the
  // result of optim::clip_factor (norm, loss sum, skipped as doubles, then the clip factor), read
  // by the optimizer on the device and copied with the loss-scale state into step_host (pinned).
  DeviceBuffer step_rows, step_include, step_out;
  std::vector<float> step_include_host;
  // One per step slot (a step's slot: its index % kStepSlots): the host reads step k's while
  // step k + 1 is enqueued, which writes the other.
  std::array<PinnedHostBuffer, kStepSlots> step_host;
  // Elsewhere (several processes, pipeline stages) the host computes the clip factor and copies it
  // from clip_host into step_out's clip (a member: the copy reads it when the stream runs it).
  float clip_host = 1.0f;
  // Bytes the step scalars' all-gathers sent from this rank on the world communicator (not
  // tensor-axis traffic where the tensor group is the world group: World::tensor_bytes_sent).
  uint64_t scalar_bytes = 0;
  // Timing events on the compute stream (train/step.cc), per step slot: the step's start, its
  // last backward, its gradients checked, and the update's span, read when the step is read.
  struct StepEvents {
    std::unique_ptr<Event> step_begin, compute_done, grads_ready, opt_begin, opt_end;
  };
  std::array<StepEvents, kStepSlots> events;
  // --cuda-graphs: the rank's captured micro-batch (train/graph_step.h); null while eager.
  std::shared_ptr<MicroBatchGraph> graph;
};

// The trainer's counters that a checkpoint or snapshot carries besides the engine's arrays.
struct TrainCounters {
  int step = 0;          // steps completed
  int64_t updates = 0;   // optimizer updates made (AdamW's bias-correction count)
  std::vector<int> skipped_steps;
};

class World {
 public:
  // Builds the world on `rt`'s devices, with parameters initialised from the seed (or
  // --init-from); `working`/`scaling`: the precision now (fp16 may have fallen back to bf16).
  World(const RunContext& run, std::unique_ptr<Runtime> rt, const BatchSplit& split, DType working,
        ZeroOptions::Scaling scaling);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int size() const { return static_cast<int>(devs_.size()); }
  Runtime& runtime() { return *rt_; }
  Device& device(int r) { return *devs_[static_cast<size_t>(r)]; }
  const std::vector<Device*>& devices() const { return devs_; }
  Communicator& comm() { return *comm_; }
  // Every world is a pipeline of mesh().shape().pipeline stages (one without --pipeline-parallel):
  // rank r's stage, its index in the stage's engine (its data x tensor position), and that stage's
  // engine and model. How the ranks run them (train/stages.h): stages().
  StageRunner& stages() { return *stages_; }
  int stage_of(int r) const { return mesh_->index(MeshAxis::kPipeline, r); }
  // A stage's engine orders its (data x tensor) ranks tensor-fastest, as the mesh does (with one
  // stage: the rank itself).
  int engine_rank(int r) const {
    return mesh_->index(MeshAxis::kTensor, r) + mesh_->shape().tensor * mesh_->index(MeshAxis::kData, r);
  }
  ZeroEngine& engine_of(int r) { return *engines_[static_cast<size_t>(stage_of(r))]; }
  const Model& model_of(int r) const { return *models_[static_cast<size_t>(stage_of(r))]; }
  // The rank speaks for its group in the step's loss: its tensor group's first rank, of the last
  // pipeline stage (the one that computes the loss).
  bool loss_lead(int r) const { return tensor_lead(r) && stage_of(r) == mesh_->shape().pipeline - 1; }
  // The step's scalars (norms, loss, skip, clip) are summed on the host after one synchronisation
  // per rank — pipeline stages (the head stage's losses), several processes (the partials cross
  // them) — rather than on the devices (train/step.cc).
  bool host_scalars() const { return host_scalars_; }
  // The (data x tensor x pipeline) mesh of the ranks; data x 1 x 1 without model parallelism.
  const Mesh& mesh() const { return *mesh_; }
  // The rank speaks for its tensor group in host-side sums (losses, replicated norms): coordinate 0.
  bool tensor_lead(int r) const { return mesh_->index(MeshAxis::kTensor, r) == 0; }
  // Rank r's data index among every process's ranks (its batch rows): its data index in one process.
  // Several processes: the tensor axis is inside each, so global rank g's data index is g / T.
  int data_rank(int r) const {
    return collectives_ ? collectives_->global_rank(r) / mesh_->shape().tensor : mesh_->index(MeshAxis::kData, r);
  }
  // Data ranks over every process (mesh().shape().data in one process).
  int data_ranks() const {
    return collectives_ ? collectives_->world() / mesh_->shape().tensor : mesh_->shape().data;
  }
  // The communicators' counters and receive buffers of rank r (its pipeline stage's included).
  void reset_comm_counters();
  size_t comm_buffer_bytes(int r) const;
  // Bytes rank r sent in every collective and transfer (its pipeline stage's collectives and, over
  // several processes, the cross-process ring's hops included).
  uint64_t bytes_sent(int r);
  // Bytes this process sent to other processes since reset_comm_counters (0 in one process).
  uint64_t bytes_sent_across() const;
  // Bytes rank r sent in its tensor group's collectives (0 without tensor parallelism).
  uint64_t tensor_bytes_sent(int r);
  // The logical (one-device) model's blocks, whatever the tensor and pipeline degrees: what the
  // initialisation, --init-from and checkpoints address.
  ParamLayout logical_layout() const;
  // The one stage's model and engine of a world without pipeline stages (else: model_of / engine_of).
  const Model& model() const;
  ZeroEngine& engine();
  // Every stage's engine, first stage first (one without pipeline stages).
  std::vector<ZeroEngine*> engines();
  RankState& rank(int r) { return ranks_[static_cast<size_t>(r)]; }
  const BatchSplit& split() const { return split_; }
  const std::string& init_note() const { return init_note_; }
  std::vector<std::string> device_names() const;

  // Runs fn(rank) on one host thread per rank under the hang watchdog; rethrows the first error.
  void for_ranks(const std::function<void(int)>& fn);
  // Devices the watchdog gave up on ("" if none).
  const std::string& hung() const { return hung_; }
  // Copies a host batch into rank r's device batch `micro` (on its compute stream). slot >= 0: through
  // staging slot `slot` of the rank's pinned RankState::staged (the training step's uploads, which
  // the host does not wait for); slot < 0: straight from hb, which must then outlive the copies (the
  // caller synchronizes: evaluation).
  void upload(int r, const HostBatch& hb, int micro = 0, int slot = -1);
  // Reshards a checkpoint's or snapshot's state onto this world; returns the trainer's counters.
  TrainCounters apply_state(const StateSource& src, const nlohmann::json& meta);

 private:
  void on_watchdog_timeout();
  // One sentence on stderr naming `names` (devices whose work does not finish; `when`: " while ..."
  // or "") and exit(1): see hang_response.
  [[noreturn]] void end_process_for_stuck_gpus(const std::string& names, const std::string& when) const;
  void build_one_stage(const ZeroOptions& zo);  // the one stage's model and engine
  void build_pipeline(const ZeroOptions& zo);   // each stage's model, engine and communicator
  // Rank r's trainer buffers (train/rank_buffers.h): what it allocates and the plan counts.
  RankBuffers buffers_of(int r) const;
  void init_parameters();  // the seeded (or --init-from) logical blocks onto every rank
  void load_initial_parameters(const std::vector<std::vector<float>>& host);

  const RunContext& run_;
  BatchSplit split_;
  ZeroOptions::Scaling scaling_;
  std::unique_ptr<Runtime> rt_;  // before everything on its devices: destroyed after them
  std::vector<Device*> devs_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<DataCollectives> collectives_;  // multi-process runs (over every process) and --comm nccl: the engine's
  // The ring's counters at reset_comm_counters (it has no reset of its own).
  std::vector<uint64_t> ring_sent_base_;
  uint64_t ring_across_base_ = 0;
  std::unique_ptr<Mesh> mesh_;
  // Per pipeline stage: with several stages, each engine's own communicator over the stage's ranks
  // (none with one stage: its engine runs on comm_); declared before the engines that use them.
  std::vector<std::unique_ptr<Communicator>> stage_comms_;
  std::vector<std::unique_ptr<Model>> models_;
  std::vector<std::unique_ptr<ZeroEngine>> engines_;
  bool host_scalars_ = false;
  std::unique_ptr<StageRunner> stages_;
  std::vector<RankState> ranks_;
  std::string init_note_, hung_;
};

// What the hang watchdog does once nothing made progress for --hang-timeout (World's
// on_watchdog_timeout). injected[r]: rank r's device hangs on purpose (an injected fault, which
// abandon() releases); stuck[r]: its work did not finish within a short look (looked at only
// without injected hangs). A real GPU whose work does not finish cannot be released inside the
// process: the host threads waiting on it sit inside cudaEventSynchronize/cudaStreamSynchronize,
// and tearing it down would wait too (cudaStreamSynchronize, cudaFree) — so on CUDA the process
// ends with one sentence instead of hanging. Elsewhere the stuck devices are abandoned (none when
// all are stuck: which one stopped cannot be told) and the communicator is aborted.
struct HangResponse {
  std::vector<int> abandon;  // ranks whose devices are given up on
  bool end_process = false;
};
HangResponse hang_response(Backend backend, const std::vector<bool>& injected, const std::vector<bool>& stuck);

// Runs fn(rank) on one host thread per rank (inline for one rank without a timeout) and rethrows
// the first error. A rank that fails aborts the communicator, so the others stop waiting for it;
// the error that happened first (the cause) is rethrown. When the ranks have not all returned
// and nothing made progress (core/heartbeat.h) for `timeout` (0 = none), on_timeout() runs once to
// release them.
void run_ranks(int n, const std::function<void(int)>& fn, Communicator& comm, std::chrono::milliseconds timeout = {},
               const std::function<void()>& on_timeout = {});

}  // namespace zt
