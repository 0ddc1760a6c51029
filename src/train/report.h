// End-of-run report: model FLOPs per token and MFU, the host-measured split of step time into
// compute / exposed communication / optimizer, per-device memory, and their text/JSON forms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/format.h"  // format_bytes, format_hms (re-exported for the report's users)
#include "model/config.h"

namespace zt {

class Device;

// Training FLOPs (forward + backward) per token, the PaLM (Chowdhery et al. 2022, appendix B) /
// nanoGPT convention: 6*N for the matrix products of N parameters (2 forward, 4 backward; N counts
// every parameter, embeddings included, as llm.c and nanoGPT do) plus 12*L*T*C for attention
// scores and their weighted sum (L layers, T tokens of context, C width). The attention term counts
// the full T x T score matrix, not its causal half (llm.c's later 6*L*T*C does); element-wise ops
// (layernorm, GELU, softmax, AdamW) are not counted. MLP: 6*N per example (no attention).
double training_flops_per_token(const ModelConfig& mc, int64_t parameters, int seq_len);

// The number format the GEMMs run in, which picks the peak MFU divides by: the activation dtype
// on tensor cores in 16-bit runs (bf16, fp16), else fp32 on CUDA cores, or TF32 with --tf32.
enum class PeakKind { kFp32, kTf32, kBf16, kFp16 };
const char* peak_kind_name(PeakKind kind);   // "fp32", "tf32", "bf16", "fp16" (JSON peak_kind)
const char* peak_kind_label(PeakKind kind);  // "FP32", "TF32", "BF16", "FP16" (the summary line)
// The number format the model's GEMMs run in: its activation dtype's tensor cores (bf16, fp16), else
// fp32, or TF32 under --tf32.
PeakKind gemm_peak_kind(DType activations, bool tf32);

// Peak dense (no structured sparsity) FLOP/s of one GPU in `kind`, from NVIDIA's datasheet for
// its name as the runtime reports it ("cuda:0 (NVIDIA H200)"). nullopt when unknown (a GPU not in
// the table, a kind it has no figure for), and for CPU devices.
std::optional<double> peak_flops(const std::string& device_name, PeakKind kind);
// Sum over the distinct physical GPUs behind the devices (logical devices sharing one GPU count
// once); nullopt when any device's peak is unknown.
std::optional<double> total_peak_flops(const std::vector<std::string>& device_names, PeakKind kind);
// Throughput is measured after warm-up: the first steps of a run build library plans (cuDNN
// graphs, cuBLASLt heuristics), take pool memory and capture CUDA graphs, and would understate the
// steady state. Of a run's n timed steps the summary leaves out warmup_steps_excluded(n): the
// first 2, or 1 of a 2-step run, none of a 1-step run (kWarmupRule says so in the JSON).
int warmup_steps_excluded(int timed_steps);
inline constexpr const char* kWarmupRule = "the first 2 steps (1 of a 2-step run, none of a 1-step run)";
// Tokens (or examples) per second over the steps after warm-up: the steps' count x
// tokens_per_step over their summed seconds (`step_seconds`: each timed step's, in order).
double steady_tokens_per_s(const std::vector<double>& step_seconds, double tokens_per_step);
// Achieved model FLOP/s over the peak; nullopt when the peak is unknown.
std::optional<double> model_flops_utilization(double flops_per_token, double tokens_per_s,
                                              std::optional<double> peak_flops);

// Seconds of training steps, split into phases (see StepPhaseTimer).
struct PhaseTimes {
  double compute = 0;    // forward/backward of the step's micro-batches on the compute streams
  double comm = 0;       // after the last backward, waiting for the gradient reductions to land
  double optimizer = 0;  // optimizer_step: its issue on the host plus its run on the compute stream
  double other = 0;      // the rest of the step: host-side loss/norm sums, thread start-up, logging
  // Part of compute, not a phase of its own: seconds a device's compute stream spent re-running
  // forward ops inside backward (--recompute), the mean over devices.
  double recompute = 0;
  // Not added to total(): --offload optimizer's host update (the slowest rank's, per step): the
  // part the devices waited for (exposed: wherever the wait fell, the step's optimizer phase or the
  // next step's compute; see ZeroRank::take_host_update_seconds), and its whole host time.
  double host_optimizer = 0;
  double host_optimizer_total = 0;
  double total() const { return compute + comm + optimizer + other; }
};

// Measures PhaseTimes once per step, without host synchronisations of its own: the step's wall
// time on the host clock (begin_step .. end_step: the trainer begins it when the previous step
// was handled and ends it when this step was read, one step late: the next step's enqueue falls
// inside it), split by timing events on each rank's compute stream (train/step.cc records them,
// one set per step slot, read with the step):
//   step_begin .. compute_done : compute (the slowest rank): forward/backward of every micro-batch,
//        including any collective the compute stream had to wait for mid-step (a stage-3 gather
//        not hidden by prefetch, the previous step's parameter all-gather).
//   compute_done .. grads_ready : exposed communication: the gradient check needs every gradient
//        reduce-scatter finished; the time past the last backward is the reduction tail that
//        backward did not hide (the slowest rank's end, less compute).
//   opt_begin .. opt_end : the update on the compute stream (stage 0 includes its gradient
//        all-gather; stages 1-2's parameter all-gather runs on the comm stream afterwards and, if
//        not hidden, shows up in the next step's compute), plus the host's time issuing it
//        (optimizer_begin .. optimizer_done, the host span issued during the frame). The update is
//        read with its own step (read_step waits for its opt_end, enqueued before the next step).
//   the remainder of the wall time : other.
// A rank whose events cannot time (nullopt) counts its whole host wait as compute. It is an
// approximation: overlapped work is attributed to one phase.
class StepPhaseTimer {
 public:
  explicit StepPhaseTimer(int ranks);
  void begin_step();
  // Device seconds of rank's compute and exposed-communication phases; thread-safe per rank (each
  // rank writes its own slot), called once its step's work has completed.
  void rank_phases(int rank, std::optional<double> compute, std::optional<double> comm);
  void rank_recompute(int rank, double seconds);  // this step's recompute stream time; same rule
  // An update's device seconds and (--offload optimizer) its host update's seconds; same rule.
  void rank_optimizer(int rank, std::optional<double> seconds, double host_seconds = 0, double host_exposed = 0);
  void optimizer_begin();
  void optimizer_done();
  void end_step();
  const PhaseTimes& totals() const { return totals_; }

 private:
  double now() const;
  double step_start_ = 0, opt_begin_ = 0, opt_end_ = 0;
  std::vector<double> rank_compute_, rank_comm_, rank_recompute_, rank_opt_, rank_host_opt_, rank_host_exposed_;
  PhaseTimes totals_;
};

// The summary table's name of a device: "cuda:0 (NVIDIA H200, …) [logical 1 of 2 on GPU 0]" ->
// "cuda:0 [1 of 2]"; CPU names ("cpu:0") unchanged.
std::string short_device_name(const std::string& name);

struct DeviceReport {
  std::string name;
  size_t params = 0, grads = 0, optimizer = 0, activations = 0, comm_buffers = 0, pool_peak = 0;
  uint64_t sent_per_step = 0;
  uint64_t tensor_sent_per_step = 0;  // of sent_per_step: on the tensor axis (--tensor-parallel)
};

// --pipeline-parallel: the schedule and its bubble, measured (idle compute time between a step's
// first and last action over its stages, from the recorded stream spans, averaged over the steps)
// beside the schedule's closed form.
struct PipelineReport {
  std::string schedule;
  int stages = 1, virtual_stages = 1, micro_batches = 1;
  double measured_bubble = 0, theoretical_bubble = 0;
};

// Bytes a training step moves, measured (averaged over the steps): between this process's devices
// (every peer copy of every collective and transfer) and from this process to other processes (the
// cross-process ring's data messages; 0 in one process). Process 0's figures; every process of a
// ring moves the same. Closed forms per reduce-scatter or all-gather of shard_bytes per rank, K
// processes of L devices, N = K*L: flat ring (N-1) * shard_bytes across and (L-1) * (N-1) *
// shard_bytes inside; hierarchical L * (K-1) * shard_bytes across and L * (L-1) * K * shard_bytes
// inside.
struct TrafficReport {
  int processes = 1;
  int local_devices = 1;
  std::string topology = "flat";  // --comm-topology
  uint64_t inside_per_step = 0;
  uint64_t across_per_step = 0;
};

// What one reduce-scatter or all-gather of shard_bytes per rank moves, by the closed forms above:
// inside each process and out of each process.
struct CollectiveTraffic {
  uint64_t inside = 0, across = 0;
};
CollectiveTraffic collective_traffic(int processes, int local_devices, bool hierarchical, uint64_t shard_bytes);

struct RunReport {
  int steps = 0;
  double seconds = 0;        // wall clock of the loop, evaluations included
  double train_seconds = 0;  // training steps only
  double final_loss = 0, val_loss = 0;
  std::optional<double> entropy_floor, accuracy;
  bool per_example = false;  // MLP: throughput is examples/s
  double tokens_per_s = 0;   // after warm-up (steady_tokens_per_s)
  int warmup_steps_excluded = 0;  // the steps tokens_per_s (and so the MFU) leaves out
  double flops_per_token = 0;
  std::optional<double> peak_flops;  // all devices together, of peak_kind
  PeakKind peak_kind = PeakKind::kFp32;
  std::optional<double> mfu;
  PhaseTimes phases;
  std::vector<DeviceReport> devices;
  size_t host_peak = 0;  // --offload optimizer: the largest device's host-arena peak (0: no offload)
  std::optional<PipelineReport> pipeline;
  TrafficReport traffic;
  bool cuda_graphs = false;  // --cuda-graphs: micro-batches were replayed from captured graphs
};

// The text summary: the one-line "summary:" headline, then a table of throughput, MFU, time split
// and per-device memory/communication.
std::string format_summary(const RunReport& r);
// Fields added to the JSON summary record: flops_per_token, peak_flops (null), peak_kind ("tf32"), mfu (null),
// warmup_steps_excluded and warmup_rule (kWarmupRule: what tokens_per_s and mfu leave out),
// time_split {compute_s, comm_s, optimizer_s, other_s, recompute_s, host_optimizer_s},
// traffic {processes, local_devices, topology, inside_bytes_per_step, across_bytes_per_step}, and with a
// pipeline: pipeline {schedule, stages, virtual_stages, micro_batches, measured_bubble, theoretical_bubble}.
nlohmann::json report_json(const RunReport& r);

// Largest pool allocation now over the devices, as shown on the progress line ("mem 3.1 MiB").
size_t max_allocated_bytes(const std::vector<Device*>& devices);

}  // namespace zt
