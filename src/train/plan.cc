// Memory plan: per-device bytes of a training run from the sizing functions of the engine
// (plan_engine_memory), the model (workspace_bytes), the communicator (planned_buffer_bytes)
// and the pool (pool_rounded_size and segment rules), plus the trainer's batch buffers; then the
// verdict and the cheapest change that fits; and the largest model of a family per ZeRO stage,
// recompute and offload (`plan --largest`).
//
// What the device must hold is predicted as the pool's reserved bytes at the peak: every block
// rounded as the pool rounds it, small blocks packed into small-pool segments per stream, large
// blocks in segments rounded to the large-pool granularity (what the pool's out-of-memory fallback
// reserves when memory is tight). The trainer's own buffers are counted from the description World
// allocates them from (train/rank_buffers.h); its workspaces from the model's (a workspace(B, T)
// per rank, the pipeline stages' ModelStageWork slots, and a workspace(1, T) for sampling, GPT).
// Not modelled: CUDA's sum_squares workspace (a few KiB, allocated when no transient is live), and
// the pool handing out a whole large free block when the tail would be <= 1 MiB (depends on the
// allocation order; under 1% on the tested runs).
#include "train/plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>
#include <utility>

#include "comm/communicator.h"
#include "kernels/ops.h"
#include "core/format.h"
#include "core/status.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "pipeline/model_stage.h"
#include "pipeline/partition.h"
#include "pipeline/schedule.h"
#include "runtime/cuda/gemm_workspace.h"
#include "runtime/host_staging.h"
#include "runtime/runtime.h"
#include "zero/engine.h"

namespace zt {

namespace {

// The pool block the attention library's workspace holds on each device's compute stream:
// ops::flash_attention_library_bytes of the run's shape where the devices have the library path,
// else none (the CPU backend; kernels/ops.h). 16-bit activations: cuDNN's workspace as the library
// asks where the plan can ask it (a GPU: in.attention_workspace), else by formula. fp32: the GEMM
// attention's two score buffers, exact by formula (ops::gemm_attention_workspace). With tensor
// parallelism a rank attends over its heads only: C / degree channels in heads / degree heads.
struct AttentionBlock {
  size_t block = 0, workspace = 0;
  bool measured = false;
};
AttentionBlock plan_attention(const ModelConfig& mc, const PlanInputs& in) {
  AttentionBlock a;
  const DType act = run_activation_dtype(in.working);
  if (!in.attention_library || mc.kind != ModelKind::kGpt) return a;
  const int tp = std::max(in.tensor, 1);
  const int64_t B = in.micro_batch, T = in.seq_len, C = mc.embd / tp, NH = mc.heads / tp;
  ops::AttentionWorkspace ws;
  if (act == DType::kF32) {
    ws = ops::gemm_attention_workspace(T, NH);
  } else if (act == DType::kF16 || act == DType::kBF16) {
    ws = {0, static_cast<int64_t>(ops::cudnn_attention_workspace_formula(B, T, C, NH, in.deterministic_attention))};
    if (in.attention_workspace) {
      const std::optional<ops::AttentionWorkspace> asked =
          in.attention_workspace(B, T, C, NH, act, in.deterministic_attention);
      if (!asked) return a;
      ws = *asked;
      a.measured = true;
    }
  } else {
    return a;
  }
  a.block = ops::flash_attention_library_bytes(B, T, C, act, ws);
  a.workspace = a.block ? static_cast<size_t>(std::max<int64_t>({ws.forward, ws.backward, 0})) : 0;
  return a;
}

// The model a run of these inputs builds (a pipeline's stages aside: plan_pipeline).
std::unique_ptr<Model> plan_model(const ModelConfig& mc, const PlanInputs& in) {
  return make_model(mc, in.recompute, TensorParallel{in.tensor, in.sequence_parallel}, run_activation_dtype(in.working));
}

// "fp32", or "bf16 + fp32 master, bf16 activations" (every model computes in the working dtype)
// / ", fp32 activations" (a model made with fp32 activations on 16-bit parameters).
std::string precision_label(ModelKind kind, const PlanInputs& in) {
  if (in.working == DType::kF32) return "fp32";
  ModelConfig mc;
  mc.kind = kind;
  return std::string(dtype_name(in.working)) + " + fp32 master, " + dtype_name(run_activation_dtype(in.working)) +
         " activations";
}

// The CPU backend simulates up to this many devices (runtime/device_spec.cc).
constexpr int kMaxCpuPlanDevices = 64;

struct Alloc {
  size_t bytes;
  bool comm_stream;
  bool engine_transient = false;  // a pipeline stage's step buffer (freed and re-allocated each step)
};

// Small-pool segments for these blocks of one stream: first-fit decreasing into segments of
// pool_small_segment_bytes() (the pool never splits a block across segments, so blocks near 1 MiB
// leave holes that count). The first segment with room is found in a max-tree over the segments'
// free bytes, so a plan stays O(n log n) in the blocks (a linear scan per block was quadratic).
size_t small_segments_bytes(std::vector<size_t> rounded, size_t* work) {
  const size_t seg = pool_small_segment_bytes();
  std::sort(rounded.rbegin(), rounded.rend());
  size_t leaves = 1;
  while (leaves < rounded.size()) leaves *= 2;
  std::vector<size_t> tree(2 * leaves, 0);  // free bytes; unused segments have none (every block is > 0)
  size_t used = 0;
  for (size_t r : rounded) {
    size_t i = 1;
    if (tree[1] >= r) {
      while (i < leaves) i = tree[2 * i] >= r ? 2 * i : 2 * i + 1;
      tree[i] -= r;
    } else {
      i = leaves + used++;
      tree[i] = seg - r;
    }
    for (i /= 2; i >= 1; i /= 2) tree[i] = std::max(tree[2 * i], tree[2 * i + 1]);
    *work += 1 + 2 * static_cast<size_t>(std::log2(static_cast<double>(leaves)) + 1);
  }
  *work += rounded.size() + 2 * leaves;
  return used * seg;
}

// Reserved bytes of a run: resident blocks plus, for each pool, the phase that needs the most, plus
// a fragmentation allowance for large transients.
// Small-pool segments stay reserved once a transient freed a hole in them (only a segment with no
// live block can be released), so the small pool is sized for the resident blocks with the largest
// phase's small transients; large blocks get segments rounded to the large granularity.
size_t reserved_bytes(const std::vector<Alloc>& resident, const std::vector<std::vector<Alloc>>& phases, size_t* work) {
  auto split = [](const std::vector<Alloc>& v, std::vector<size_t>& compute, std::vector<size_t>& comm, size_t& large) {
    for (const Alloc& a : v) {
      const size_t r = pool_rounded_size(a.bytes);
      if (r == 0) continue;
      if (pool_is_small(r))
        (a.comm_stream ? comm : compute).push_back(r);
      else
        large += pool_large_segment_bytes(r);
    }
  };
  std::vector<size_t> compute, comm;
  size_t large = 0;
  split(resident, compute, comm, large);
  size_t best_small = 0, best_large = 0, largest = 0;
  for (const auto& phase : phases) {
    std::vector<size_t> c = compute, m = comm;
    size_t l = 0;
    split(phase, c, m, l);
    best_small = std::max(best_small, small_segments_bytes(c, work) + small_segments_bytes(m, work));
    best_large = std::max(best_large, l);
    for (const Alloc& a : phase)
      if (a.engine_transient && !pool_is_small(pool_rounded_size(a.bytes)))
        largest = std::max(largest, pool_large_segment_bytes(pool_rounded_size(a.bytes)));
  }
  // Freed transients' cached segments get split by smaller transients (a pipeline stage's step
  // buffers; the ZeRO engine's transient arena is one block that is never freed), so re-allocating
  // the largest one may need a fresh segment while the split ones are still partly live: one more
  // segment of the largest large transient.
  return large + best_small + best_large + largest;
}

size_t sum_rounded(const std::vector<Alloc>& live) {
  size_t n = 0;
  for (const Alloc& a : live) n += pool_rounded_size(a.bytes);
  return n;
}

size_t device_memory(const PlanInputs& in, int d) {
  if (in.device_memory.empty()) return 0;
  return in.device_memory[std::min(static_cast<size_t>(d), in.device_memory.size() - 1)];
}

}  // namespace

std::string format_plan_bytes(size_t bytes) {
  // GiB with two decimals, smaller units with one (the plan table's columns).
  return format_bytes(static_cast<double>(bytes), bytes >= (size_t{1} << 30) ? 2 : 1);
}

size_t parse_memory_size(const std::string& text, const std::string& flag) {
  auto bad = [&]() -> size_t {
    ZT_THROW(ErrorKind::kInvalidArgument, flag, " '", text,
             "' is not a memory size; write a number with an optional unit, e.g. 16GiB, 512MiB or 2GB");
  };
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) return bad();
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(text.substr(0, i), &used);
    if (used != i) return bad();
  } catch (...) {
    return bad();
  }
  std::string unit = text.substr(i);
  unit.erase(std::remove(unit.begin(), unit.end(), ' '), unit.end());
  std::string u;
  for (char c : unit) u.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  double mul = 0;
  if (u.empty() || u == "b") mul = 1;
  else if (u == "k" || u == "kib") mul = 1024.0;
  else if (u == "m" || u == "mib") mul = 1024.0 * 1024;
  else if (u == "g" || u == "gib") mul = 1024.0 * 1024 * 1024;
  else if (u == "t" || u == "tib") mul = 1024.0 * 1024 * 1024 * 1024;
  else if (u == "kb") mul = 1e3;
  else if (u == "mb") mul = 1e6;
  else if (u == "gb") mul = 1e9;
  else if (u == "tb") mul = 1e12;
  else return bad();
  const double bytes = v * mul;
  ZT_REQUIRE(bytes >= 1, flag, " '", text, "' is less than one byte; give the device's memory, e.g. 16GiB");
  ZT_REQUIRE(bytes <= 1e18, flag, " '", text, "' is above 1e18 bytes (about 888 PiB), the most a device's memory "
             "may be (a byte count must stay far inside 64 bits for the plan's sums)");
  return static_cast<size_t>(bytes);
}

namespace {

// The rank's trainer buffers in the pool (train/rank_buffers.h; pinned host ones are not) as
// resident compute-stream blocks; returns their bytes.
size_t add_rank_buffers(const RankBuffers& buffers, std::vector<Alloc>& resident) {
  size_t bytes = 0;
  for (const RankBuffer* b : buffers.all()) {
    if (b->pinned_host) continue;
    for (int k = 0; k < b->count; ++k) resident.push_back({b->bytes, false});
    bytes += b->total();
  }
  return bytes;
}

// One device's plan from what it holds resident and its phases (phase 0: a training step; phase
// 1, if any: a forward-only pass with `extra_ws` more workspace bytes), reported by kind at the
// phase with the most pool bytes in blocks.
DevicePlan device_plan(const EngineMemoryPlan& eng, const std::vector<Alloc>& resident,
                       const std::vector<std::vector<Alloc>>& phases, size_t ws, size_t extra_ws, size_t comm,
                       size_t batch, size_t library, const AttentionBlock& attention, size_t* work) {
  DevicePlan dev;
  for (size_t p = 0; p < phases.size(); ++p) {
    std::vector<Alloc> live = resident;
    live.insert(live.end(), phases[p].begin(), phases[p].end());
    const size_t peak = sum_rounded(live);
    if (p > 0 && peak <= dev.peak_allocated) continue;
    dev.peak_allocated = peak;
    dev.activations = ws + (p == 1 ? extra_ws : 0);
    dev.transient = 0;
    for (const auto& t : p == 1 ? eng.forward_peak : eng.train_peak) dev.transient += t.bytes;
  }
  dev.params = eng.state.params;
  dev.grads = eng.state.grads;
  dev.optimizer = eng.state.optimizer;
  dev.host = eng.host;
  dev.host_staging = HostStaging::planned_pinned_bytes();
  dev.comm = comm;
  dev.batch = batch;
  dev.library = library;
  dev.attention = attention.block;
  dev.attention_workspace = attention.workspace;
  dev.attention_measured = attention.measured;
  dev.total = reserved_bytes(resident, phases, work);
  const size_t requested = dev.params + dev.grads + dev.optimizer + dev.activations + dev.comm + dev.transient +
                           dev.batch + dev.library + dev.attention;
  dev.pool_overhead = dev.total > requested ? dev.total - requested : 0;
  return dev;
}

// A pipelined run's plan: per stage, what World allocates for a pipeline on each of the stage's
// D data ranks — the stage engine's resident buffers (ZeroOptions::pipeline), the ModelStageWork's
// workspaces (the schedule's live micro-batches per chunk) and input-gradient buffers, a batch per
// micro-batch, the norm partials, the tied embedding's exchange buffer (first and last stage) and
// the stage communicator's ring buffers; phases: the step (the engine's step-long buckets and fp32
// copies) and an evaluation (one workspace per chunk and the fp32 copies).
MemoryPlan plan_pipeline(const ModelConfig& mc, const PlanInputs& in) {
  const int N = in.devices, P = in.pipeline, V = in.virtual_stages, B = in.micro_batch, T = in.seq_len;
  const int m = in.micro_batches;
  ZT_REQUIRE(mc.kind == ModelKind::kGpt, "--pipeline-parallel splits GPT models only");
  const int TP = in.tensor;
  ZT_REQUIRE(TP >= 1 && N % TP == 0, "--tensor-parallel ", TP, " does not divide the ", N, " devices");
  validate_pipeline_shape(N / TP, P, V, mc.layers);
  const int D = N / TP / P, per_stage = D * TP;
  const PipelineCosts costs = gpt_pipeline_costs(mc, T);
  const PipelinePartition part = in.pp_layout.empty() ? partition_pipeline(costs, P, V)
                                                      : partition_from_layout(costs, parse_pp_layout(in.pp_layout), P, V);
  const Schedule sched = make_schedule(in.pp_schedule, P, m, V);
  const auto specs = pipeline_stage_specs(part, sched.splits_backward());
  ZeroOptions zo;
  zo.stage = in.zero_stage;
  zo.sgd = in.sgd;
  zo.working = in.working;
  zo.pipeline = true;
  zo.tensor = TP;
  MemoryPlan plan;
  plan.inputs = in;
  std::vector<DevicePlan> stages;
  for (int s = 0; s < P; ++s) {
    const auto model = make_gpt_stage(mc, specs[static_cast<size_t>(s)], in.recompute,
                                      TensorParallel{TP, in.sequence_parallel}, run_activation_dtype(in.working));
    const EngineMemoryPlan eng = plan_engine_memory(*model, per_stage, zo);
    plan.work += eng.work;
    std::vector<Alloc> resident;
    for (size_t b : eng.resident) resident.push_back({b, false});
    const WorkspaceSlots slots = workspace_slots(sched, s);
    size_t act = 0, eval_ws = 0;
    std::vector<Alloc> eval;
    for (int c = 0; c < model->chunks(); ++c) {
      const size_t ws = model->chunk_workspace_bytes(B, T, c);
      for (int k = 0; k < slots.per_chunk[static_cast<size_t>(c)]; ++k) resident.push_back({ws, false}), act += ws;
      const size_t grad = sched.virtual_stage(s, c) > 0 ? static_cast<size_t>(B) * T * mc.embd * dtype_size(model->activation_dtype()) : 0;
      for (int k = 0; k < m; ++k) resident.push_back({grad, false}), act += grad;
      eval.push_back({ws, false});
      eval_ws += ws;
    }
    // The trainer's buffers (a batch per micro-batch, the tied gradient, norms, step scalars): all
    // in the stage's batch column.
    const RankBuffers buffers = rank_buffers(plan_rank_buffer_shape(mc, in), *model);
    const size_t batch = add_rank_buffers(buffers, resident);
    // The stage communicator's ring buffers (its engine's reductions), and with tensor parallelism
    // the world communicator's (the tensor groups' reductions run there).
    const size_t stage_comm = in.staged_comm ? Communicator::planned_buffer_bytes(per_stage) : 0;
    const size_t world_comm = in.staged_comm && TP > 1 ? Communicator::planned_buffer_bytes(N) : 0;
    const size_t comm = stage_comm + world_comm;
    for (int q = 0; q < 2 * Communicator::kRecvSlots; ++q) {
      const size_t slot = q < Communicator::kRecvSlots ? stage_comm : world_comm;
      if (slot) resident.push_back({slot / Communicator::kRecvSlots, true});
    }
    if (in.gemm_workspace) resident.push_back({in.gemm_workspace, false});
    const AttentionBlock attention = plan_attention(mc, in);
    if (attention.block) resident.push_back({attention.block, false});
    std::vector<std::vector<Alloc>> phases(2);
    for (const auto& t : eng.train_peak) phases[0].push_back({t.bytes, t.comm_stream, true});
    for (const auto& t : eng.forward_peak) phases[1].push_back({t.bytes, t.comm_stream, true});
    phases[1].insert(phases[1].end(), eval.begin(), eval.end());
    // A 16-bit stage's attention may take the library path: its workspace is resident as above.
    DevicePlan dev =
        device_plan(eng, resident, phases, act, eval_ws, comm, batch, in.gemm_workspace, attention, &plan.work);
    dev.stage = s;
    stages.push_back(dev);
  }
  // Device r holds stage r / (D x T) (the mesh's pipeline axis is outermost).
  for (int r = 0; r < N; ++r) {
    DevicePlan d = stages[static_cast<size_t>(r / per_stage)];
    d.memory = device_memory(in, r);
    plan.fits = plan.fits && d.fits();
    plan.per_device.push_back(d);
  }
  return plan;
}

// The plan of `in` for an already built model of `mc` (the search for a fix plans many
// configurations of one model).
MemoryPlan plan_for(const Model& model_ref, const ModelConfig& mc, const PlanInputs& in) {
  ZT_REQUIRE(in.devices >= 1, "the plan needs at least one device, got ", in.devices);
  ZT_REQUIRE(in.zero_stage >= 0 && in.zero_stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", in.zero_stage);
  ZT_REQUIRE(in.micro_batch >= 1 && in.seq_len >= 1 && in.micro_batches >= 1, "micro-batch ", in.micro_batch,
             ", sequence length ", in.seq_len, " and accumulation ", in.micro_batches, " must all be at least 1");
  const bool gpt = mc.kind == ModelKind::kGpt;
  ZT_REQUIRE(!gpt || in.seq_len <= mc.seq_len, "sequence length ", in.seq_len, " is above the model's context of ",
             mc.seq_len, " tokens; raise --seq-len or lower --train-seq-len");
  const Model* model = &model_ref;
  const int N = in.devices, B = in.micro_batch, T = gpt ? in.seq_len : 1;
  ZeroOptions zo;
  zo.stage = in.zero_stage;
  zo.sgd = in.sgd;
  zo.micro_batches = in.micro_batches;
  zo.working = in.working;
  zo.offload = in.offload;  // the device optimizer bytes drop by the offloaded part, counted in eng.host
  zo.offload_fraction = in.offload_fraction;
  zo.offload_delay = in.offload && in.offload_delay;
  zo.tensor = in.tensor;
  const EngineMemoryPlan eng = plan_engine_memory(*model, N, zo);
  size_t work = eng.work;

  // Resident on every rank: engine buffers, activations, batch buffers (compute stream), ring
  // receive buffers (comm stream; staged reductions only).
  std::vector<Alloc> resident;
  for (size_t b : eng.resident) resident.push_back({b, false});
  const size_t ws = model->workspace_bytes(B, T);
  resident.push_back({ws, false});
  // The trainer's buffers; the batch column: inputs, targets and norm partials (the step scalars
  // count in the pool column).
  const RankBuffers buffers = rank_buffers(plan_rank_buffer_shape(mc, in), *model);
  add_rank_buffers(buffers, resident);
  const size_t comm = in.staged_comm ? Communicator::planned_buffer_bytes(N) : 0;
  for (int q = 0; q < Communicator::kRecvSlots && comm; ++q) resident.push_back({comm / Communicator::kRecvSlots, true});
  if (in.gemm_workspace) resident.push_back({in.gemm_workspace, false});
  const AttentionBlock attention = plan_attention(mc, in);
  if (attention.block) resident.push_back({attention.block, false});
  work += resident.size();

  // Two phases: a training micro-batch, and (GPT) the end-of-run sample's forward with its own
  // workspace next to everything resident.
  std::vector<std::vector<Alloc>> phases;
  auto phase_allocs = [](const std::vector<PlannedBuffer>& transients, size_t extra_ws) {
    std::vector<Alloc> v;
    for (const auto& t : transients) v.push_back({t.bytes, t.comm_stream, !t.arena});
    if (extra_ws) v.push_back({extra_ws, false});
    return v;
  };
  phases.push_back(phase_allocs(eng.train_peak, 0));
  const size_t sample_ws = gpt && in.sampling ? model->workspace_bytes(1, T) : 0;
  if (sample_ws) phases.push_back(phase_allocs(eng.forward_peak, sample_ws));

  const DevicePlan dev =
      device_plan(eng, resident, phases, ws, sample_ws, comm,
                  buffers.inputs.total() + buffers.targets.total() + buffers.norms.total(), in.gemm_workspace, attention,
                  &work);

  MemoryPlan plan;
  plan.inputs = in;
  plan.work = work + static_cast<size_t>(N);
  for (int r = 0; r < N; ++r) {
    DevicePlan d = dev;
    d.memory = device_memory(in, r);
    plan.fits = plan.fits && d.fits();
    plan.per_device.push_back(d);
  }
  return plan;
}

}  // namespace

RankBufferShape plan_rank_buffer_shape(const ModelConfig& mc, const PlanInputs& in) {
  const bool gpt = mc.kind == ModelKind::kGpt;
  return RankBufferShape{.gpt = gpt,
                         .micro_batch = in.micro_batch,
                         .seq_len = gpt ? in.seq_len : 1,
                         .input_dim = gpt ? 0 : mc.input_dim,
                         .ranks = in.devices,
                         .data_ranks = in.devices / std::max(in.tensor, 1) / std::max(in.pipeline, 1),
                         .micro_batches = in.micro_batches,
                         .pipeline = in.pipeline > 1};
}

MemoryPlan plan_memory_only(const ModelConfig& mc, const PlanInputs& in) {
  if (in.pipeline > 1) return plan_pipeline(mc, in);
  return plan_for(*plan_model(mc, in), mc, in);
}

namespace {

size_t peak_total(const MemoryPlan& p) {
  size_t m = 0;
  for (const auto& d : p.per_device) m = std::max(m, d.total);
  return m;
}

size_t peak_host(const MemoryPlan& p) {
  size_t m = 0;
  for (const auto& d : p.per_device) m = std::max(m, d.host);
  return m;
}

bool offload_changed(const PlanInputs& a, const PlanInputs& b) {
  return a.offload != b.offload || (b.offload && a.offload_fraction != b.offload_fraction);
}

// The levers that change neither the batch nor the devices, in the order plan_memory tries them:
// each one alone (stage, then recompute, then offload), then two or more together, cheapest first
// (no offload before offload, then the lighter recompute, then the lower stage).
std::vector<PlanInputs> lever_runs(const PlanInputs& in) {
  std::vector<PlanInputs> out;
  const int rc0 = static_cast<int>(in.recompute), full = static_cast<int>(Recompute::kFull);
  const bool can_offload = !in.offload || in.offload_fraction < 1.0f;
  auto with = [&](int stage, int rc, bool offload) {
    PlanInputs c = in;
    c.zero_stage = stage;
    c.recompute = static_cast<Recompute>(rc);
    if (offload) c.offload = true, c.offload_fraction = 1.0f;
    return c;
  };
  for (int st = in.zero_stage + 1; st <= 3; ++st) out.push_back(with(st, rc0, false));
  for (int rc = rc0 + 1; rc <= full; ++rc) out.push_back(with(in.zero_stage, rc, false));
  // Offload needs stage 1 or above (at stage 0 every device keeps the whole optimizer state).
  if (can_offload && in.zero_stage >= 1) out.push_back(with(in.zero_stage, rc0, true));
  for (bool off : {false, true}) {
    if (off && !can_offload) continue;
    for (int rc = rc0; rc <= full; ++rc)
      for (int st = in.zero_stage; st <= 3; ++st)
        if ((st != in.zero_stage) + (rc != rc0) + off >= 2 && !(off && st == 0)) out.push_back(with(st, rc, off));
  }
  return out;
}

// "--zero-stage 3 --recompute full --offload optimizer": what `c` changes of `in`.
std::string lever_flags(const PlanInputs& in, const PlanInputs& c) {
  std::string t;
  auto add = [&](const std::string& f) { t += (t.empty() ? "" : " ") + f; };
  if (c.zero_stage != in.zero_stage) add("--zero-stage " + std::to_string(c.zero_stage));
  if (c.recompute != in.recompute) add(std::string("--recompute ") + recompute_name(c.recompute));
  if (c.offload != in.offload) add("--offload optimizer");
  if (c.offload && in.offload_fraction != c.offload_fraction) add("--offload-fraction 1");
  return t;
}

PlanSuggestion suggestion_for(PlanSuggestion::Kind kind, const PlanInputs& c, std::string text) {
  PlanSuggestion s;
  s.kind = kind;
  s.zero_stage = c.zero_stage;
  s.micro_batch = c.micro_batch;
  s.micro_batches = c.micro_batches;
  s.devices = c.devices;
  s.recompute = c.recompute;
  s.offload = c.offload;
  s.offload_fraction = c.offload_fraction;
  s.text = std::move(text);
  return s;
}

// Plans of one model configuration under every recompute mode (each mode is its own model: what
// the workspace keeps differs).
class ModelsByRecompute {
 public:
  explicit ModelsByRecompute(const ModelConfig& mc) : mc_(mc) {}
  MemoryPlan plan(const PlanInputs& in) {
    auto& m = models_[static_cast<int>(in.recompute)];
    if (!m || m->activation_dtype() != run_activation_dtype(in.working)) m = plan_model(mc_, in);
    return plan_for(*m, mc_, in);
  }

 private:
  const ModelConfig& mc_;
  std::unique_ptr<Model> models_[3];
};

}  // namespace

namespace {

// Nothing fits: what even every lever at its most, with micro-batch 1, needs.
PlanSuggestion nothing_fits(const PlanInputs& in, const std::vector<PlanInputs>& levers,
                            const std::function<MemoryPlan(const PlanInputs&)>& plan_of, size_t* work) {
  PlanInputs c = levers.empty() ? in : levers.back();  // every lever at its most
  c.zero_stage = 3;
  c.micro_batch = 1;
  c.micro_batches = in.micro_batches * in.micro_batch;
  const MemoryPlan p = plan_of(c);
  if (work) *work += p.work;
  std::string most = "ZeRO stage 3";
  if (c.recompute != Recompute::kNone) most += std::string(" with --recompute ") + recompute_name(c.recompute);
  if (c.offload) most += std::string(c.recompute != Recompute::kNone ? "," : " with") + " --offload optimizer";
  return suggestion_for(PlanSuggestion::kNothing, c,
                        "even " + most + " and micro-batch 1 needs " + format_plan_bytes(peak_total(p)) +
                            " per device; use a smaller model or a shorter --train-seq-len, or devices with more "
                            "memory");
}

}  // namespace

PlanSuggestion cheapest_fix(const PlanInputs& in, const std::function<MemoryPlan(const PlanInputs&)>& plan_of,
                            size_t* work) {
  auto fits = [&](const PlanInputs& c, MemoryPlan* out) {
    *out = plan_of(c);
    if (work) *work += out->work;
    return out->fits;
  };
  auto predicted = [](const MemoryPlan& p) {
    std::string t = " (predicted " + format_plan_bytes(peak_total(p)) + " per device";
    if (const size_t host = peak_host(p)) t += ", " + format_plan_bytes(host) + " of host memory per device";
    return t + ")";
  };
  MemoryPlan p;
  // 1. The levers that keep the batch and the devices, alone, then together.
  const std::vector<PlanInputs> levers = lever_runs(in);
  for (const PlanInputs& c : levers) {
    if (!fits(c, &p)) continue;
    const int changed = (c.zero_stage != in.zero_stage) + (c.recompute != in.recompute) + offload_changed(in, c);
    const PlanSuggestion::Kind kind = changed > 1                      ? PlanSuggestion::kCombined
                                      : c.zero_stage != in.zero_stage  ? PlanSuggestion::kZeroStage
                                      : c.recompute != in.recompute    ? PlanSuggestion::kRecompute
                                                                       : PlanSuggestion::kOffload;
    return suggestion_for(kind, c, "use " + lever_flags(in, c) + predicted(p));
  }
  // 2. A smaller micro-batch with more accumulation (the same global batch, slower steps), alone,
  // then with the levers: the largest micro-batch that fits with any of them.
  auto smaller_micro_batch = [&](const PlanInputs& base, PlanSuggestion::Kind kind) {
    for (int b = in.micro_batch - 1; b >= 1; --b) {
      if (in.micro_batch % b) continue;
      PlanInputs c = base;
      c.micro_batch = b;
      c.micro_batches = in.micro_batches * (in.micro_batch / b);
      if (!fits(c, &p)) continue;
      const std::string flags = lever_flags(in, c);
      return std::optional<PlanSuggestion>(suggestion_for(
          kind, c,
          "use " + (flags.empty() ? "" : flags + " with ") + "--micro-batch-size " + std::to_string(b) + " (" +
              std::to_string(c.micro_batches) + " accumulation steps, same global batch)" + predicted(p)));
    }
    return std::optional<PlanSuggestion>();
  };
  // 3. More devices (those that exist), keeping the global batch (and the tensor degree: the
  // batch splits over the data axis).
  const long global = static_cast<long>(in.devices / in.tensor) * in.micro_batch * in.micro_batches;
  auto more_devices = [&](const PlanInputs& base, PlanSuggestion::Kind kind) {
    for (int n = in.devices + 1; n <= in.max_devices; ++n) {
      if (n % in.tensor || global % (n / in.tensor)) continue;
      const int per = static_cast<int>(global / (n / in.tensor));
      int b = std::min(in.micro_batch, per);
      while (per % b) --b;
      PlanInputs c = base;
      c.devices = n;
      c.micro_batch = b;
      c.micro_batches = per / b;
      c.device_memory.clear();
      for (int r = 0; r < n; ++r) c.device_memory.push_back(device_memory(in, r));
      if (!fits(c, &p)) continue;
      std::string text = "run on " + std::to_string(n) + " devices";
      const std::string flags = lever_flags(in, c);
      if (!flags.empty()) text += " with " + flags;
      if (b != in.micro_batch)
        text += (flags.empty() ? " with " : " ") + std::string("--micro-batch-size ") + std::to_string(b);
      return std::optional<PlanSuggestion>(suggestion_for(kind, c, text + " (same global batch)" + predicted(p)));
    }
    return std::optional<PlanSuggestion>();
  };
  if (auto s = smaller_micro_batch(in, PlanSuggestion::kMicroBatch)) return *s;
  if (auto s = more_devices(in, PlanSuggestion::kDevices)) return *s;
  // 4. Both: the levers with the largest micro-batch that fits, then with more devices. A lever
  // run that does not fit at micro-batch 1 fits at no larger one (activations and batch buffers
  // only grow with it), so it is dropped after one plan.
  std::vector<const PlanInputs*> with_micro_batch;
  for (const PlanInputs& lever : levers) {
    PlanInputs c = lever;
    c.micro_batch = 1;
    c.micro_batches = in.micro_batches * in.micro_batch;
    if (in.micro_batch > 1 && fits(c, &p)) with_micro_batch.push_back(&lever);
  }
  for (int b = in.micro_batch - 1; b >= 1; --b) {
    if (in.micro_batch % b) continue;
    for (const PlanInputs* lever : with_micro_batch) {
      PlanInputs c = *lever;
      c.micro_batch = b;
      c.micro_batches = in.micro_batches * (in.micro_batch / b);
      if (!fits(c, &p)) continue;
      return suggestion_for(PlanSuggestion::kCombined, c,
                            "use " + lever_flags(in, c) + " with --micro-batch-size " + std::to_string(b) + " (" +
                                std::to_string(c.micro_batches) + " accumulation steps, same global batch)" +
                                predicted(p));
    }
  }
  for (const PlanInputs& lever : levers)
    if (auto s = more_devices(lever, PlanSuggestion::kCombined)) return *s;
  return nothing_fits(in, levers, plan_of, work);
}

MemoryPlan plan_memory(const ModelConfig& mc, const PlanInputs& in) {
  if (in.pipeline > 1) {
    // The fix search's levers are not all valid with a pipeline (ZeRO stage 3, the device count
    // the stages divide): the heaviest stage is named and the levers a pipeline has suggested.
    MemoryPlan plan = plan_pipeline(mc, in);
    if (plan.fits) return plan;
    int heaviest = 0;
    for (size_t r = 0; r < plan.per_device.size(); ++r)
      if (plan.per_device[r].total > plan.per_device[static_cast<size_t>(heaviest)].total) heaviest = static_cast<int>(r);
    plan.suggestion = suggestion_for(
        PlanSuggestion::kNothing, in,
        "stage " + std::to_string(plan.per_device[static_cast<size_t>(heaviest)].stage) +
            " is the heaviest; give it fewer blocks with --pp-layout, use more pipeline stages, a higher "
            "--zero-stage (up to 2), a smaller --micro-batch-size, or --recompute");
    return plan;
  }
  ModelsByRecompute models(mc);
  MemoryPlan plan = models.plan(in);
  if (plan.fits) return plan;
  plan.suggestion = cheapest_fix(in, [&](const PlanInputs& c) { return models.plan(c); }, &plan.work);
  return plan;
}

std::string MemoryPlan::verdict() const {
  if (fits) return "";
  size_t need = 0, have = 0, short_by = 0;
  int worst = 0;
  for (size_t r = 0; r < per_device.size(); ++r) {
    const DevicePlan& d = per_device[r];
    if (!d.fits() && d.total - d.memory > short_by)
      short_by = d.total - d.memory, need = d.total, have = d.memory, worst = static_cast<int>(r);
  }
  std::ostringstream os;
  os << "the run does not fit: at ZeRO stage " << inputs.zero_stage << " with micro-batch " << inputs.micro_batch
     << " it needs " << format_plan_bytes(need) << " on device " << worst << ", which has " << format_plan_bytes(have)
     << "; cheapest fix: " << suggestion.text;
  return os.str();
}

namespace {
// The plan's line about the attention library's block (nothing where there is none).
void format_attention_block(std::ostream& os, const ModelConfig& mc, const MemoryPlan& plan) {
  const PlanInputs& in = plan.inputs;
  const DevicePlan& d = plan.per_device[0];
  const auto F = format_plan_bytes;
  if (d.attention == 0) return;
  const bool gemm = run_activation_dtype(in.working) == DType::kF32;
  os << "attention library workspace (" << (gemm ? "cuBLAS GEMM attention" : "cuDNN")
     << ", compute stream, from the pool): " << F(d.attention) << " per device, in each total: ";
  if (gemm) {
    const int64_t heads = ops::gemm_attention_heads_per_chunk(in.seq_len, mc.heads / std::max(in.tensor, 1));
    os << "two fp32 score buffers of " << heads << " head" << (heads == 1 ? "" : "s") << " x " << in.seq_len << " x "
       << in.seq_len << " (exact)\n";
    return;
  }
  os << F(d.attention_workspace) << " workspace of cuDNN's "
     << (in.deterministic_attention ? "deterministic" : "non-deterministic") << " backward ("
     << (d.attention_measured ? "measured: what cuDNN asked for on this GPU" : "formula; measured on a GPU when run there")
     << ") + " << F(d.attention - ((d.attention_workspace + 255) & ~size_t{255})) << " staging dqkv";
  // The deterministic workspace is quadratic in T (GB at T 4096): name the linear alternative's.
  if (in.deterministic_attention) {
    const int tp = std::max(in.tensor, 1);
    os << "; --deterministic-attention off: "
       << F(ops::cudnn_attention_workspace_formula(in.micro_batch, in.seq_len, mc.embd / tp, mc.heads / tp, false))
       << " workspace (formula, linear in T)";
  }
  os << "\n";
}

// The plain cuBLAS path's fp32 scratch (kernels/cuda/stream_blocks.h, the matmul scratch): a 16-bit
// matmul that cuBLASLt refuses computes its [rows, OC] result in fp32 in a block of the compute
// stream, grown to the widest refused product. Not in the total: a run whose GEMMs cuBLASLt serves
// never takes it, and only the GPU knows what it refuses (each refusal prints one note). The
// widest: a GPT's c_fc, B*T rows of 4C / tensor degree (its GELU forward and DGELU backward); an
// MLP's widest layer over B rows. 0 where the outputs are fp32 or no GEMM library runs.
size_t plain_matmul_scratch_bound(const ModelConfig& mc, const PlanInputs& in) {
  if (in.gemm_workspace == 0 || run_activation_dtype(in.working) == DType::kF32) return 0;
  size_t rows = static_cast<size_t>(in.micro_batch), widest = 0;
  if (mc.kind == ModelKind::kGpt) {
    rows *= static_cast<size_t>(in.seq_len);
    widest = static_cast<size_t>(4 * mc.embd / std::max(in.tensor, 1));
  } else {
    widest = static_cast<size_t>(mc.classes);
    for (int h : mc.hidden) widest = std::max(widest, static_cast<size_t>(h));
  }
  return rows * widest * sizeof(float);
}
}  // namespace

size_t snapshot_host_bytes(const ModelConfig& mc, const PlanInputs& in) {
  // The arrays a snapshot holds cover the logical blocks (a GPT's padded vocabulary rows included).
  int64_t numel = 0;
  if (mc.kind == ModelKind::kGpt) {
    const ParamLayout layout = gpt_layout(mc);  // blocks() refers into it: not a temporary
    for (const auto& b : layout.blocks()) numel += b.numel;
  } else {
    numel = mc.num_parameters();
  }
  const size_t per_element = 4 * (in.sgd ? 2 : 3) + (in.working != DType::kF32 ? dtype_size(in.working) : 0);
  return static_cast<size_t>(numel) * per_element;
}

std::string format_plan(const ModelConfig& mc, const MemoryPlan& plan) {
  const PlanInputs& in = plan.inputs;
  std::ostringstream os;
  char head[512];
  std::snprintf(head, sizeof head,
                "memory plan: %s (%.2fM parameters), %d device%s%s, ZeRO stage %d, %s, %s, micro-batch %d x %d, "
                "%d micro-batch%s per step\n",
                mc.describe().c_str(), static_cast<double>(mc.num_parameters()) / 1e6, in.devices,
                in.devices == 1 ? "" : "s",
                in.tensor > 1 ? (" (" + std::to_string(in.devices / in.tensor) + " data x " + std::to_string(in.tensor) +
                                 " tensor" + (in.sequence_parallel ? ", sequence-parallel)" : ")")).c_str()
                              : "",
                in.zero_stage,
                precision_label(mc.kind, in).c_str(),
                in.sgd ? "SGD" : "AdamW", in.micro_batch,
                mc.kind == ModelKind::kGpt ? in.seq_len : 1, in.micro_batches, in.micro_batches == 1 ? "" : "es");
  os << head;
  int heaviest = 0;  // the device (and so the stage) with the largest predicted total
  for (size_t r = 0; r < plan.per_device.size(); ++r)
    if (plan.per_device[r].total > plan.per_device[static_cast<size_t>(heaviest)].total) heaviest = static_cast<int>(r);
  if (in.pipeline > 1)
    os << "pipeline: " << in.pipeline << " stages (" << in.devices / in.pipeline << " devices each), schedule "
       << pipe_schedule_name(in.pp_schedule) << (in.virtual_stages > 1 ? " x " + std::to_string(in.virtual_stages) + " virtual stages" : "")
       << "; device r holds stage r / " << in.devices / in.pipeline << "; heaviest: stage "
       << plan.per_device[static_cast<size_t>(heaviest)].stage << " ("
       << format_plan_bytes(plan.per_device[static_cast<size_t>(heaviest)].total) << ")\n";
  const char* cols[] = {"device", "params", "grads", "optimizer", "activations", "comm", "transient", "batch",
                        "pool", "total", "memory", "fits"};
  char line[512];
  std::snprintf(line, sizeof line, "%-7s %10s %10s %10s %11s %9s %10s %9s %9s %10s %10s %5s\n", cols[0], cols[1],
                cols[2], cols[3], cols[4], cols[5], cols[6], cols[7], cols[8], cols[9], cols[10], cols[11]);
  os << line;
  const auto F = format_plan_bytes;
  for (size_t r = 0; r < plan.per_device.size(); ++r) {
    const DevicePlan& d = plan.per_device[r];
    std::snprintf(line, sizeof line, "%-7zu %10s %10s %10s %11s %9s %10s %9s %9s %10s %10s %5s\n", r,
                  F(d.params).c_str(), F(d.grads).c_str(), F(d.optimizer).c_str(), F(d.activations).c_str(),
                  F(d.comm).c_str(), F(d.transient).c_str(), F(d.batch).c_str(), F(d.pool_overhead).c_str(),
                  F(d.total).c_str(), d.memory ? F(d.memory).c_str() : "-", d.fits() ? "yes" : "NO");
    os << line;
  }
  if (in.gemm_workspace)
    os << "GEMM library workspace (cuBLAS and cuBLASLt share it, compute stream, from the pool): "
       << F(in.gemm_workspace) << " per device, in each total\n";
  if (const size_t scratch = plain_matmul_scratch_bound(mc, in))
    os << "matmul scratch (fp32 results of the 16-bit GEMMs cuBLASLt refuses, on the plain cuBLAS path; each "
          "refusal prints a note): up to "
       << F(scratch) << " per device, not in the totals (a run whose GEMMs cuBLASLt serves takes none)\n";
  if (in.gemm_workspace)  // CUDA devices: what the GPU holds besides the pools
    os << "outside the pools, not planned (leave room for them): each GPU's CUDA context, the kernels and handles "
          "of CUDA, cuBLAS and cuDNN, captured CUDA graphs, and NCCL's buffers with --comm nccl\n";
  format_attention_block(os, mc, plan);
  os << "pinned host staging (snapshot and checkpoint copies, from the first one on): "
     << F(plan.per_device[0].host_staging) << " per device, outside the pool\n";
  os << "host memory of a recovery snapshot or checkpoint save (the whole model's state, pageable): "
     << F(snapshot_host_bytes(mc, in)) << " each; --snapshot-every keeps one (two while the next is taken), "
        "a save of another step one more until it is written\n";
  if (in.offload)
    os << "host (offloaded optimizer, " << static_cast<int>(in.offload_fraction * 100 + 0.5) << "% of each shard): "
       << F(plan.per_device[0].host) << " per device, " << F(plan.per_device[0].host * plan.per_device.size())
       << " in all\n";
  if (plan.fits) {
    const DevicePlan& top = plan.per_device[static_cast<size_t>(in.pipeline > 1 ? heaviest : 0)];
    os << "verdict: fits (predicted pool peak " << F(top.peak_allocated) << " in blocks, " << F(top.total)
       << (in.pipeline > 1 ? " reserved on the heaviest stage's devices)\n" : " reserved per device)\n");
  } else {
    os << "verdict: " << plan.verdict() << "\n";
  }
  return os.str();
}

std::string format_parameter_count(int64_t n) {
  const char* units[] = {"", " K", " M", " B", " T"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1000 && u < 4) v /= 1000, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 || v >= 100 ? "%.0f%s" : v >= 10 ? "%.1f%s" : "%.2f%s", v, units[u]);
  return buf;
}

namespace {

// The device with the highest total (every device plans the same bytes today; the memories may differ).
DevicePlan peak_device(const MemoryPlan& p) {
  DevicePlan best;
  for (const auto& d : p.per_device)
    if (d.total >= best.total) best = d;
  return best;
}

// largest_fitting, with the plan of its answer (of the smallest member when none fits).
int largest_with_plan(const std::vector<ModelConfig>& family, const PlanInputs& in, MemoryPlan* answer,
                      size_t* plans, size_t* work) {
  ZT_REQUIRE(!family.empty(), "the model family to search is empty");
  auto plan_of = [&](int i) {
    const ModelConfig& m = family[static_cast<size_t>(i)];
    // The plan `plan` makes of that model: a pipeline's per-stage plan when there is one.
    MemoryPlan p = plan_memory_only(m, in);
    if (plans) ++*plans;
    if (work) *work += p.work;
    return p;
  };
  // Invariant: `lo` fits (or is -1), `hi` does not (or is past the end).
  int lo = -1, hi = static_cast<int>(family.size());
  MemoryPlan lo_plan;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    MemoryPlan p = plan_of(mid);
    if (p.fits)
      lo = mid, lo_plan = std::move(p);
    else
      hi = mid;
  }
  if (answer) *answer = lo >= 0 ? std::move(lo_plan) : plan_of(0);
  return lo;
}

}  // namespace

int largest_fitting(const std::vector<ModelConfig>& family, const PlanInputs& in, size_t* plans, size_t* work) {
  return largest_with_plan(family, in, nullptr, plans, work);
}

LargestTable plan_largest(const std::vector<ModelConfig>& family, const PlanInputs& in,
                          const std::function<bool(const PlanInputs&)>& allowed) {
  LargestTable t;
  t.inputs = in;
  t.family = family;
  for (int st = 0; st <= 3; ++st) {
    for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
      for (bool off : {false, true}) {
        if (off && st == 0) continue;  // offload needs stage 1 or above
        PlanInputs c = in;
        c.zero_stage = st;
        c.recompute = rc;
        c.offload = off;
        if (allowed && !allowed(c)) continue;
        LargestRow row;
        row.zero_stage = st;
        row.recompute = rc;
        row.offload = off;
        MemoryPlan p;
        row.index = largest_with_plan(family, c, &p, &t.plans, &t.work);
        row.peak = peak_device(p);
        t.rows.push_back(row);
      }
    }
  }
  return t;
}

std::string format_largest(const LargestTable& t) {
  const PlanInputs& in = t.inputs;
  std::ostringstream os;
  size_t memory = 0;
  for (int r = 0; r < in.devices; ++r) memory = std::max(memory, device_memory(in, r));
  char line[512];
  std::snprintf(line, sizeof line,
                "largest GPT-2-shape model that fits: %d device%s x %s%s, %s, %s, micro-batch %d x %d, %d micro-batch%s "
                "per step\n",
                in.devices, in.devices == 1 ? "" : "s", format_plan_bytes(memory).c_str(),
                in.tensor > 1 ? (" (tensor-parallel " + std::to_string(in.tensor) + ", heads it divides only)").c_str() : "",
                precision_label(ModelKind::kGpt, in).c_str(),
                in.sgd ? "SGD" : "AdamW", in.micro_batch, in.seq_len, in.micro_batches,
                in.micro_batches == 1 ? "" : "es");
  os << line;
  std::snprintf(line, sizeof line, "%-5s  %-9s  %-9s  %-24s %10s %12s %12s\n", "stage", "recompute", "offload",
                "largest model", "parameters", "device peak", "host/device");
  os << line;
  auto shape = [](const ModelConfig& m) {
    std::string s = std::to_string(m.layers) + " x " + std::to_string(m.embd);
    const std::string name = gpt2_shape_name(m);
    return name.empty() ? s : s + " (" + name + ")";
  };
  bool none = false, last = false;
  for (const LargestRow& r : t.rows) {
    std::string model = "none fits", params = "-";
    if (r.index >= 0) {
      const ModelConfig& m = t.family[static_cast<size_t>(r.index)];
      model = shape(m);
      params = format_parameter_count(m.num_parameters());
      last = last || r.index + 1 == static_cast<int>(t.family.size());
    }
    none = none || r.index < 0;
    std::snprintf(line, sizeof line, "%-5d  %-9s  %-9s  %-24s %10s %12s %12s\n", r.zero_stage,
                  recompute_name(r.recompute), r.offload ? "optimizer" : "none", model.c_str(), params.c_str(),
                  format_plan_bytes(r.peak.total).c_str(), format_plan_bytes(r.peak.host).c_str());
    os << line;
  }
  os << "family: " << shape(t.family.front()) << " to " << shape(t.family.back()) << " (" << t.family.size()
     << " shapes; heads = width/64, vocab 50257, context " << in.seq_len
     << "); each row names the largest that fits, and the next shape up does not\n";
  os << "device peak: the predicted reserved bytes of that model on the fullest device; host/device: the "
        "offloaded optimizer state each device keeps in host memory\n";
  if (none) os << "none fits: even " << shape(t.family.front()) << " does not; its device peak is shown\n";
  if (last) os << "a row at the family's last shape may fit more (the family ends at the parameter limit)\n";
  // The headline of issue 16's target: what recompute and offload add on top of stage 3.
  const LargestRow* alone = nullptr;
  const LargestRow* most = nullptr;
  for (const LargestRow& r : t.rows) {
    if (r.zero_stage != 3) continue;
    if (r.recompute == Recompute::kNone && !r.offload) alone = &r;
    if (r.recompute == Recompute::kFull && r.offload) most = &r;
  }
  if (alone && most && alone->index >= 0 && most->index >= 0) {
    const double ratio = static_cast<double>(t.family[static_cast<size_t>(most->index)].num_parameters()) /
                         static_cast<double>(t.family[static_cast<size_t>(alone->index)].num_parameters());
    std::snprintf(line, sizeof line,
                  "stage 3 with --recompute full --offload optimizer: %.2fx the parameters of stage 3 alone\n", ratio);
    os << line;
  }
  return os.str();
}

int available_devices(Runtime& rt) {
  if (rt.backend() == Backend::kCpu) return std::max(rt.size(), kMaxCpuPlanDevices);
  const CudaAvailability cuda = cuda_availability();
  return std::max(rt.size(), cuda.usable ? cuda.device_count : 0);
}

MemoryPlan plan_run(const ModelConfig& model, Runtime& rt, const PlanInputs& partial) {
  PlanInputs in = partial;
  in.devices = rt.size();
  in.device_memory.clear();
  in.gemm_workspace = 0;
  in.attention_library = rt.backend() == Backend::kCuda;
  // On GPUs the plan counts what cuDNN asks for (building the graphs the run then uses, before any
  // capture); the devices share one kind of GPU, so device 0 answers for all.
  if (in.attention_library) {
    Stream& s = rt.device(0).compute();
    in.attention_workspace = [&s](int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype, bool deterministic) {
      return ops::fused_attention_workspace(s, B, T, C, NH, dtype, deterministic);
    };
  }
  std::vector<Device*> devices;
  for (int r = 0; r < rt.size(); ++r) {
    in.device_memory.push_back(rt.device(r).total_memory());
    in.gemm_workspace = std::max(in.gemm_workspace, rt.device(r).gemm_workspace_bytes());
    devices.push_back(&rt.device(r));
  }
  in.staged_comm = !Communicator::reduces_directly(devices);
  in.max_devices = available_devices(rt);
  return plan_memory(model, in);
}

std::vector<size_t> logical_device_memory(const std::vector<int>& ordinals, size_t gpu_memory) {
  std::vector<size_t> out;
  for (int o : ordinals)
    out.push_back(gpu_memory / static_cast<size_t>(std::count(ordinals.begin(), ordinals.end(), o)));
  return out;
}

MemoryPlan plan_absent_gpus(const ModelConfig& model, const PlanInputs& partial, const std::vector<int>& ordinals,
                            size_t gpu_memory) {
  ZT_REQUIRE(!ordinals.empty(), "plan_absent_gpus: no device to plan");
  const int devices = static_cast<int>(ordinals.size());
  PlanInputs in = partial;
  in.devices = devices;
  in.device_memory = logical_device_memory(ordinals, gpu_memory);
  in.gemm_workspace = cuda::recommended_gemm_workspace_bytes(9);
  in.attention_library = true;
  in.attention_workspace = nullptr;  // the formula
  in.staged_comm = false;
  in.max_devices = devices;
  return plan_memory(model, in);
}

void require_fits(const MemoryPlan& plan) {
  if (!plan.fits) ZT_THROW(ErrorKind::kInvalidArgument, plan.verdict());
}

}  // namespace zt
