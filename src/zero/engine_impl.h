// The engine's internals shared by its source files (zero/engine.cc, zero/rank_step.cc,
// zero/engine_state.cc): what every rank reads (EngineImpl: the model, devices, options, plans,
// tracing) and the view helpers. Not for use outside src/zero.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/mesh.h"
#include "core/status.h"
#include "zero/engine.h"
#include "zero/rank.h"

namespace zt {

namespace {

inline TensorView f32(float* p, int64_t n, int device) { return TensorView{p, DType::kF32, Shape{n}, device}; }
inline TensorView typed(void* p, DType t, int64_t n, int device) { return TensorView{p, t, Shape{n}, device}; }
// Element i of a buffer of dtype t.
inline void* at(void* base, DType t, int64_t i) { return static_cast<char*>(base) + i * static_cast<int64_t>(dtype_size(t)); }
inline size_t bytes_of(int64_t n, DType t = DType::kF32) { return static_cast<size_t>(n) * dtype_size(t); }

// Copies n floats of device memory at src to the host through the rank's pinned staging, after
// the stream's work; returns when dst holds them.
inline void to_host(HostStaging& staging, Stream& s, float* dst, const void* src, int64_t n) {
  if (n <= 0) return;
  staging.to_host(s, dst, src, static_cast<size_t>(n) * 4);
}

}  // namespace

// Where and when a traced span started (filled in by a stream callback).
struct SpanStart {
  double us = 0;
  uint64_t seq = 0, issued = 0;
};

// What the engine's ranks share: the model, devices, communicator, options, mesh and visit plans,
// and the trace the ranks' streams record into.
struct EngineImpl {
  EngineImpl(const Model& m, std::vector<Device*> devs, Communicator& c, const ZeroOptions& o)
      : model(m),
        devices(std::move(devs)),
        comm(c),
        opt(o),
        policy(policy_for_stage(o.stage)),
        mesh(MeshShape{.data = data_parallel_size(engine_world(devices.size(), o), o), .tensor = o.tensor},
             engine_world(devices.size(), o)) {
    ZT_CHECK(comm.world() == static_cast<int>(devices.size()), "communicator and engine disagree on the world size");
    ZT_CHECK(!o.processes || (!o.pipeline && !o.offload),
             "an engine over several processes runs data and tensor parallelism only (no pipeline or offload)");
    ZT_CHECK(!o.processes || o.processes->tensor_degree() == o.tensor, "the engine's tensor degree ", o.tensor,
             " is not its cross-process collectives' ", o.processes ? o.processes->tensor_degree() : 0);
    ZT_REQUIRE(!o.offload_delay || o.offload, "--offload-delay-update needs --offload optimizer");
    ZT_CHECK(!o.pipeline || (o.stage <= 2 && !o.offload && o.micro_batches == 1),
             "a pipeline stage's engine runs ZeRO stages 0-2 without offload, reducing once per step");
    ZT_REQUIRE(m.activation_dtype() == DType::kF32 || dtype_size(o.working) == dtype_size(m.activation_dtype()),
               "a model computing in ", dtype_name(m.activation_dtype()), " needs 16-bit working parameters, not ",
               dtype_name(o.working), "; use --precision bf16 or fp16, or an fp32 model");
    const ParamLayout& L = model.layout();
    std::vector<BlockBufferBytes> sizes;
    for (int b = 0; b < L.num_blocks(); ++b) sizes.push_back(block_sizes(L.block(b).numel, opt));
    make_plans(sizes);
    for (int r = 0; r < local_size(); ++r)
      ranks.push_back(std::make_unique<ZeroRank>(*this, r, *devices[static_cast<size_t>(r)]));
  }

  void make_plans(const std::vector<BlockBufferBytes>& sizes) {
    const auto fwd = model.forward_order(), bwd = model.backward_order();
    train_plan = make_visit_plan(fwd, bwd, sizes, policy, mixed(), widen(), false);
    forward_plan = make_visit_plan(fwd, bwd, sizes, policy, mixed(), widen(), true);
    // Training and forward-only micro-batches share it (each begins after the other's work).
    arena_bytes = opt.pipeline ? 0 : std::max(train_plan.arena_bytes, forward_plan.arena_bytes);
  }

  // Delayed offload update: every rank's pending host update applied (engine_state.cc); one thread.
  void settle_offload();

  bool mixed() const { return opt.working != DType::kF32; }
  // Mixed precision for a model computing in fp32: blocks run on fp32 copies (kComputeParams).
  bool widen() const { return widens_params(opt.working, model.activation_dtype()); }
  BlockBufferBytes block_sizes(int64_t numel, const ZeroOptions& o) const {
    return zt::block_buffer_bytes(numel, world(), o, model.activation_dtype());
  }
  // Global ranks (every process's; this process's devices alone without opt.processes).
  static int engine_world(size_t local, const ZeroOptions& o) {
    return o.processes ? o.processes->world() : static_cast<int>(local);
  }
  int world() const { return engine_world(devices.size(), opt); }
  int local_size() const { return static_cast<int>(devices.size()); }
  int global_rank(int local) const { return opt.processes ? opt.processes->global_rank(local) : local; }
  void require_one_process(const char* what) const {
    ZT_REQUIRE(!opt.processes || opt.processes->world() == local_size(), what,
               " needs every rank in this process; it is not built for a run over several processes");
  }
  int data_size() const { return mesh.size(MeshAxis::kData); }
  int tensor_size() const { return mesh.size(MeshAxis::kTensor); }
  ZeroRank& rank(int r) { return *ranks.at(static_cast<size_t>(r)); }
  // The ranks of tensor coordinate t, by data index.
  std::vector<int> tensor_ranks(int t) const {
    ZT_REQUIRE(t >= 0 && t < tensor_size(), "tensor coordinate ", t, " is outside the engine's tensor degree of ",
               tensor_size());
    return mesh.data_group(mesh.rank_at(MeshCoord{.data = 0, .tensor = t}));
  }

  // ---- tracing ----
  bool tracing = false;
  std::mutex trace_mu;
  std::vector<TraceSpan> spans;
  std::atomic<uint64_t> trace_seq{0};
  const std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double now_us() const {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  // Opens a span when `s` reaches this point; close_span records it when `s` reaches that point.
  std::shared_ptr<SpanStart> open_span(Stream& s, uint64_t issued) {
    auto start = std::make_shared<SpanStart>();
    start->issued = issued;
    s.host_func([this, start] {
      start->us = now_us();
      start->seq = ++trace_seq;
    });
    return start;
  }
  void close_span(Stream& s, std::shared_ptr<SpanStart> start, TraceSpan::Kind kind, int rank, int block) {
    s.host_func([this, start, kind, rank, block] {
      const double end = now_us();
      const uint64_t end_seq = ++trace_seq;
      std::lock_guard<std::mutex> lock(trace_mu);
      spans.push_back(TraceSpan{kind, rank, block, start->us, end, start->issued, start->seq, end_seq});
    });
  }

  const Model& model;
  std::vector<Device*> devices;
  Communicator& comm;
  ZeroOptions opt;
  const ShardingPolicy policy;
  const Mesh mesh;  // {data = N / tensor, tensor}
  VisitPlan train_plan, forward_plan;  // what each micro-batch's hooks allocate and free
  size_t arena_bytes = 0;              // each rank's transient arena
  std::vector<std::unique_ptr<ZeroRank>> ranks;
};


}  // namespace zt
