// End-of-run report: FLOPs/MFU arithmetic, the per-step phase timer, and the summary's text and
// JSON forms. The FLOP formula and the measurement boundaries are documented in report.h.
#include "train/report.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>

#include "memory/caching_allocator.h"
#include "runtime/device.h"

namespace zt {

double training_flops_per_token(const ModelConfig& mc, int64_t parameters, int seq_len) {
  const double n = static_cast<double>(parameters);
  if (mc.kind != ModelKind::kGpt) return 6.0 * n;
  return 6.0 * n + 12.0 * mc.layers * static_cast<double>(seq_len) * mc.embd;
}

const char* peak_kind_name(PeakKind kind) {
  switch (kind) {
    case PeakKind::kFp32: return "fp32";
    case PeakKind::kTf32: return "tf32";
    case PeakKind::kBf16: return "bf16";
    case PeakKind::kFp16: return "fp16";
  }
  return "?";
}

const char* peak_kind_label(PeakKind kind) {
  switch (kind) {
    case PeakKind::kFp32: return "FP32";
    case PeakKind::kTf32: return "TF32";
    case PeakKind::kBf16: return "BF16";
    case PeakKind::kFp16: return "FP16";
  }
  return "?";
}

PeakKind gemm_peak_kind(DType activations, bool tf32) {
  if (activations == DType::kBF16) return PeakKind::kBf16;
  if (activations == DType::kF16) return PeakKind::kFp16;
  return tf32 ? PeakKind::kTf32 : PeakKind::kFp32;
}

std::optional<double> peak_flops(const std::string& device_name, PeakKind kind) {
  if (device_name.rfind("cuda:", 0) != 0) return std::nullopt;
  // Dense figures from NVIDIA's product datasheets (boost clock; the datasheets' tensor figures
  // "with sparsity" halved). fp32 is the CUDA-core (non-tensor) rate. 0 = no figure here. The
  // first entry whose key occurs in the name wins, so more specific names come first. The SXM
  // parts report no form factor in their name ("NVIDIA H100 80GB HBM3"), hence bare "H100"/"H200"
  // = SXM.
  struct Peaks {
    const char* key;
    double fp32, tf32, bf16, fp16;
  };
  static const Peaks kPeaks[] = {
      {"H200 NVL", 60e12, 0, 0, 0},         {"H200", 67e12, 494e12, 989e12, 989e12},
      {"H100 PCIe", 51e12, 378e12, 756e12, 756e12}, {"H100 NVL", 60e12, 0, 0, 0},
      {"H100", 67e12, 494e12, 989e12, 989e12},      {"A100", 19.5e12, 156e12, 312e12, 312e12},
      {"L40S", 91.6e12, 183e12, 362e12, 362e12},    {"V100", 15.7e12, 0, 0, 125e12},
  };
  for (const Peaks& p : kPeaks)
    if (device_name.find(p.key) != std::string::npos) {
      const double f = kind == PeakKind::kFp32   ? p.fp32
                       : kind == PeakKind::kTf32 ? p.tf32
                       : kind == PeakKind::kBf16 ? p.bf16
                                                 : p.fp16;
      return f > 0 ? std::optional<double>(f) : std::nullopt;
    }
  return std::nullopt;
}

std::optional<double> total_peak_flops(const std::vector<std::string>& device_names, PeakKind kind) {
  if (device_names.empty()) return std::nullopt;
  std::set<std::string> physical;  // "cuda:0": logical devices on one GPU share its peak
  double total = 0;
  for (const std::string& name : device_names) {
    const std::optional<double> p = peak_flops(name, kind);
    if (!p) return std::nullopt;
    if (physical.insert(name.substr(0, name.find(' '))).second) total += *p;
  }
  return total;
}

std::string short_device_name(const std::string& name) {
  const size_t paren = name.find(" (");
  if (paren == std::string::npos) return name;
  std::string out = name.substr(0, paren);
  // Logical devices on one GPU (cuda:0x2) stay apart: "[logical 1 of 2 on GPU 0]" -> "[1 of 2]".
  const std::string kLogical = " [logical ";
  if (const size_t l = name.find(kLogical, paren); l != std::string::npos) {
    const size_t from = l + kLogical.size(), to = name.find(" on GPU", from);
    out += " [" + name.substr(from, to == std::string::npos ? std::string::npos : to - from) + "]";
  }
  return out;
}

int warmup_steps_excluded(int timed_steps) { return std::clamp(timed_steps - 1, 0, 2); }

double steady_tokens_per_s(const std::vector<double>& step_seconds, double tokens_per_step) {
  const int n = static_cast<int>(step_seconds.size());
  const int skip = warmup_steps_excluded(n);
  double seconds = 0;
  for (int i = skip; i < n; ++i) seconds += step_seconds[static_cast<size_t>(i)];
  return (n - skip) * tokens_per_step / std::max(seconds, 1e-9);
}

std::optional<double> model_flops_utilization(double flops_per_token, double tokens_per_s,
                                              std::optional<double> peak_flops) {
  if (!peak_flops || *peak_flops <= 0) return std::nullopt;
  return flops_per_token * tokens_per_s / *peak_flops;
}

// ---- StepPhaseTimer ---------------------------------------------------------------------------

StepPhaseTimer::StepPhaseTimer(int ranks)
    : rank_compute_(static_cast<size_t>(std::max(ranks, 1)), 0.0),
      rank_comm_(rank_compute_.size(), 0.0),
      rank_recompute_(rank_compute_.size(), 0.0),
      rank_opt_(rank_compute_.size(), 0.0),
      rank_host_opt_(rank_compute_.size(), 0.0),
      rank_host_exposed_(rank_compute_.size(), 0.0) {}

double StepPhaseTimer::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void StepPhaseTimer::begin_step() {
  step_start_ = now();
  for (auto* v : {&rank_compute_, &rank_comm_, &rank_recompute_, &rank_opt_, &rank_host_opt_, &rank_host_exposed_})
    std::fill(v->begin(), v->end(), 0.0);
  opt_begin_ = opt_end_ = step_start_;
}

void StepPhaseTimer::rank_phases(int rank, std::optional<double> compute, std::optional<double> comm) {
  const size_t r = static_cast<size_t>(rank);
  if (compute && comm) {
    rank_compute_.at(r) = std::max(0.0, *compute);
    rank_comm_.at(r) = std::max(0.0, *comm);
  } else {
    rank_compute_.at(r) = std::max(0.0, now() - step_start_);  // no device timing: the host's wait
    rank_comm_.at(r) = 0;
  }
}
void StepPhaseTimer::rank_recompute(int rank, double seconds) { rank_recompute_.at(static_cast<size_t>(rank)) = seconds; }
void StepPhaseTimer::rank_optimizer(int rank, std::optional<double> seconds, double host_seconds, double host_exposed) {
  rank_opt_.at(static_cast<size_t>(rank)) += std::max(0.0, seconds.value_or(0.0));
  rank_host_opt_.at(static_cast<size_t>(rank)) += host_seconds;
  rank_host_exposed_.at(static_cast<size_t>(rank)) += host_exposed;
}
void StepPhaseTimer::optimizer_begin() { opt_begin_ = now(); }
void StepPhaseTimer::optimizer_done() { opt_end_ = now(); }

void StepPhaseTimer::end_step() {
  const double wall = now() - step_start_;
  const double compute = *std::max_element(rank_compute_.begin(), rank_compute_.end());
  double reduced = compute;  // the slowest rank's compute + exposed communication
  for (size_t r = 0; r < rank_compute_.size(); ++r) reduced = std::max(reduced, rank_compute_[r] + rank_comm_[r]);
  const double comm = reduced - compute;
  const double opt = std::max(0.0, opt_end_ - opt_begin_) + *std::max_element(rank_opt_.begin(), rank_opt_.end());
  totals_.compute += compute;
  totals_.comm += comm;
  totals_.optimizer += opt;
  totals_.other += std::max(0.0, wall - compute - comm - opt);
  totals_.host_optimizer += *std::max_element(rank_host_exposed_.begin(), rank_host_exposed_.end());
  totals_.host_optimizer_total += *std::max_element(rank_host_opt_.begin(), rank_host_opt_.end());
  for (double s : rank_recompute_) totals_.recompute += s / static_cast<double>(rank_recompute_.size());
}

// ---- formatting -------------------------------------------------------------------------------

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string si(double v, const char* unit) { return format_si(v, unit); }

std::string pad(const std::string& s, size_t width, bool left = false) {
  if (s.size() >= width) return s;
  return left ? s + std::string(width - s.size(), ' ') : std::string(width - s.size(), ' ') + s;
}

}  // namespace

CollectiveTraffic collective_traffic(int processes, int local_devices, bool hierarchical, uint64_t shard_bytes) {
  const uint64_t K = static_cast<uint64_t>(processes), L = static_cast<uint64_t>(local_devices), N = K * L;
  if (K == 1) return {L * (L - 1) * shard_bytes, 0};
  if (hierarchical) return {L * (L - 1) * K * shard_bytes, L * (K - 1) * shard_bytes};
  return {(L - 1) * (N - 1) * shard_bytes, (N - 1) * shard_bytes};
}

size_t max_allocated_bytes(const std::vector<Device*>& devices) {
  size_t m = 0;
  for (Device* d : devices) m = std::max(m, d->memory().stats().allocated_bytes);
  return m;
}

std::string format_summary(const RunReport& r) {
  std::string out = "summary: " + std::to_string(r.steps) + " steps in " + format_hms(r.seconds) + ", final loss " +
                    fmt("%.4f", r.final_loss) + ", val loss " + fmt("%.4f", r.val_loss);
  if (r.entropy_floor) out += " (floor " + fmt("%.4f", *r.entropy_floor) + ")";
  if (r.accuracy) out += ", test accuracy " + fmt("%.2f%%", *r.accuracy * 100);
  out += "\n";

  const char* unit = r.per_example ? "example" : "token";
  out += "  throughput   " + si(r.tokens_per_s, (std::string(unit) + "s/s").c_str()) + ", model " +
         si(r.flops_per_token * r.tokens_per_s, "FLOP/s") + " (" + si(r.flops_per_token, "FLOP") + "/" + unit + ")";
  out += r.warmup_steps_excluded == 0 ? std::string(", every step timed")
                                      : ", after warm-up (the first " +
                                            (r.warmup_steps_excluded == 1 ? std::string("step")
                                                                          : std::to_string(r.warmup_steps_excluded) + " steps") +
                                            " left out)";
  out += "\n";
  out += "  MFU          ";
  if (r.mfu)
    out += fmt("%.1f%%", *r.mfu * 100) + " of " + fmt("%.4g", *r.peak_flops / 1e12) + " TFLOP/s " + peak_kind_label(r.peak_kind) +
           " peak\n";
  else
    out += std::string("n/a (") + peak_kind_label(r.peak_kind) + " peak FLOP/s of these devices unknown)\n";
  const double total = r.phases.total();
  auto share = [&](double s) { return fmt(s < 10 ? "%.2f s" : "%.1f s", s) + " (" + fmt("%.0f%%", total > 0 ? 100 * s / total : 0) + ")"; };
  out += "  time split   compute " + share(r.phases.compute) + " | exposed comm " + share(r.phases.comm) +
         " | optimizer " + share(r.phases.optimizer) + " | other " + share(r.phases.other) + "\n";
  if (r.phases.recompute > 0)
    out += "  recompute    " + fmt(r.phases.recompute < 10 ? "%.2f s" : "%.1f s", r.phases.recompute) +
           " per device re-running forward ops in backward (" +
           fmt("%.0f%%", r.phases.compute > 0 ? 100 * r.phases.recompute / r.phases.compute : 0) + " of compute)\n";
  if (r.cuda_graphs)
    out += "  graphs       each rank's micro-batches replayed from captured graphs (--cuda-graphs)\n";
  if (r.host_peak > 0)
    out += "  offload      host optimizer exposed " + share(r.phases.host_optimizer) + " of " +
           fmt(r.phases.host_optimizer_total < 10 ? "%.2f s" : "%.1f s", r.phases.host_optimizer_total) + ", host memory " +
           format_bytes(static_cast<double>(r.host_peak)) + " per device\n";

  if (r.pipeline) {
    const PipelineReport& p = *r.pipeline;
    out += "  pipeline     " + p.schedule + ", " + std::to_string(p.stages) + " stages" +
           (p.virtual_stages > 1 ? " x " + std::to_string(p.virtual_stages) + " virtual" : "") + ", " +
           std::to_string(p.micro_batches) + " micro-batches: bubble " + fmt("%.3f", p.measured_bubble) +
           " measured, " + fmt("%.3f", p.theoretical_bubble) + " in theory\n";
  }

  const TrafficReport& t = r.traffic;
  // One device per process (the usual one-GPU run) has no devices to exchange with: no "1 devices".
  out += "  traffic      ";
  if (t.local_devices > 1)
    out += "per step " + format_bytes(static_cast<double>(t.inside_per_step)) + " between the " +
           std::to_string(t.local_devices) + " devices" + (t.processes > 1 ? " of each process, " : "");
  else
    out += t.processes > 1 ? "per step " : "none: one device";
  if (t.processes > 1)
    out += format_bytes(static_cast<double>(t.across_per_step)) + " out of each of the " +
           std::to_string(t.processes) + " processes (" + (t.local_devices > 1 ? "" : "one device each, ") +
           t.topology + ")\n";
  else
    out += t.local_devices > 1 ? ", none across processes\n" : "\n";

  // Per-device table; the first column as wide as the longest device name, short form: a GPU's
  // description ("cuda:0 (NVIDIA H200, compute capability 9.0, 132 SMs, PCI …)") is in the run's
  // header already and would push the columns past any terminal's width.
  std::vector<std::string> names;
  for (const DeviceReport& d : r.devices) names.push_back(short_device_name(d.name));
  size_t w = 6;
  for (const std::string& n : names) w = std::max(w, n.size());
  // With tensor parallelism the bytes sent split by axis: data (ZeRO) and tensor (activations).
  const bool tp = std::any_of(r.devices.begin(), r.devices.end(), [](const DeviceReport& d) { return d.tensor_sent_per_step > 0; });
  std::vector<const char*> heads = {"params", "grads", "optimizer", "activations", "comm buf", "pool peak", "sent/step"};
  if (tp) heads.back() = "data/step", heads.push_back("tensor/step");
  out += "  " + pad("device", w, true);
  for (const char* h : heads) out += "  " + pad(h, 11);
  out += "\n";
  for (size_t i = 0; i < r.devices.size(); ++i) {
    const DeviceReport& d = r.devices[i];
    out += "  " + pad(names[i], w, true);
    std::vector<double> cols = {double(d.params),       double(d.grads),     double(d.optimizer),
                                double(d.activations),  double(d.comm_buffers), double(d.pool_peak),
                                double(d.sent_per_step - d.tensor_sent_per_step)};
    if (tp) cols.push_back(double(d.tensor_sent_per_step));
    for (double v : cols) out += "  " + pad(format_bytes(v), 11);
    out += "\n";
  }
  return out;
}

nlohmann::json report_json(const RunReport& r) {
  nlohmann::json j;
  j["flops_per_token"] = r.flops_per_token;
  j["peak_flops"] = r.peak_flops ? nlohmann::json(*r.peak_flops) : nlohmann::json(nullptr);
  j["peak_kind"] = peak_kind_name(r.peak_kind);
  j["mfu"] = r.mfu ? nlohmann::json(*r.mfu) : nlohmann::json(nullptr);
  j["warmup_steps_excluded"] = r.warmup_steps_excluded;
  j["warmup_rule"] = kWarmupRule;
  j["time_split"] = {{"compute_s", r.phases.compute},
                     {"comm_s", r.phases.comm},
                     {"optimizer_s", r.phases.optimizer},
                     {"other_s", r.phases.other},
                     {"recompute_s", r.phases.recompute},
                     {"host_optimizer_s", r.phases.host_optimizer},
                     {"host_optimizer_total_s", r.phases.host_optimizer_total}};
  j["traffic"] = {{"processes", r.traffic.processes},
                  {"local_devices", r.traffic.local_devices},
                  {"topology", r.traffic.topology},
                  {"inside_bytes_per_step", r.traffic.inside_per_step},
                  {"across_bytes_per_step", r.traffic.across_per_step}};
  if (r.pipeline)
    j["pipeline"] = {{"schedule", r.pipeline->schedule},
                     {"stages", r.pipeline->stages},
                     {"virtual_stages", r.pipeline->virtual_stages},
                     {"micro_batches", r.pipeline->micro_batches},
                     {"measured_bubble", r.pipeline->measured_bubble},
                     {"theoretical_bubble", r.pipeline->theoretical_bubble}};
  return j;
}

}  // namespace zt
