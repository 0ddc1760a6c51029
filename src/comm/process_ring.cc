// The cross-process ring (see process_ring.h): the Communicator's schedules over global ranks, one
// synchronous round at a time, with the hop between processes staged through host memory.
//
// Within a round the ordering needs only one event per device: device i's copy into device i+1's
// receive slot is recorded on `sent_[i]` before device i+1's comm stream waits on it and reduces.
// Across rounds every comm stream is synchronized, so a slot or a buffer region is never written
// while the previous round still reads it. In one round a device sends one shard and receives
// another ((g-k-1) vs (g-k-2) mod N for reduce-scatter, (g-k) vs (g-k-1) for all-gather), which
// differ for N >= 2, so its outgoing copy and its incoming write never touch the same bytes.
#include "comm/process_ring.h"

#include <algorithm>
#include <string>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels/ops.h"

namespace zt {

namespace {

const char* kind_text(uint32_t k) {
  switch (k) {
    case 0:
      return "reduce_scatter";
    case 1:
      return "all_gather";
    case 2:
      return "all_reduce";
    case 3:
      return "hierarchical_reduce_scatter";
    case 4:
      return "hierarchical_all_gather";
    case 5:
      return "hierarchical_all_reduce";
    default:
      return "?";
  }
}

int mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

char* byte_ptr(const TensorView& v) { return static_cast<char*>(v.data); }

// What every process must agree on for one call (all-gathered at its start).
struct Signature {
  uint32_t kind = 0;
  uint32_t dtype = 0;
  int64_t numel = 0;
};

// And for the ring itself (at construction).
struct RingShape {
  int64_t local_devices = 0;
  uint64_t chunk_bytes = 0;
};

}  // namespace

struct ProcessRing::Plan {
  Kind kind = Kind::kReduceScatter;
  DType dtype = DType::kF32;
  size_t esize = 0;
  int64_t numel = 0;
  int64_t shard = 0;
  int64_t chunk_elems = 0;
  int64_t chunks = 0;
  uint64_t call = 0;
};

ProcessRing::ProcessRing(ProcessGroup& group, std::vector<Device*> local_devices, size_t chunk_bytes)
    : group_(group), devices_(std::move(local_devices)), chunk_bytes_(chunk_bytes) {
  ZT_REQUIRE(!devices_.empty(), "ProcessRing: needs at least one local device");
  ZT_REQUIRE(chunk_bytes_ > 0, "ProcessRing: chunk_bytes must be positive");
  for (size_t i = 0; i < devices_.size(); ++i) {
    ZT_REQUIRE(devices_[i] != nullptr, "ProcessRing: local device ", i, " is null");
    for (size_t q = 0; q < i; ++q)
      ZT_REQUIRE(devices_[q] != devices_[i], "ProcessRing: ", devices_[i]->name(), " is given twice (local ", q,
                 " and ", i, "); every rank needs its own device");
  }
  process_ = group_.rank();
  processes_ = group_.size();
  const RingShape mine{static_cast<int64_t>(devices_.size()), chunk_bytes_};
  const std::vector<RingShape> all = group_.all_gather(mine, "the ring's shape");
  for (int p = 0; p < processes_; ++p) {
    const RingShape& s = all[static_cast<size_t>(p)];
    ZT_REQUIRE(s.local_devices == mine.local_devices && s.chunk_bytes == mine.chunk_bytes,
               "ProcessRing: process ", p, " has ", s.local_devices, " local devices and ", s.chunk_bytes,
               "-byte chunks but process ", process_, " has ", mine.local_devices, " and ", mine.chunk_bytes,
               "; every process must drive the same number of devices with the same chunk size");
  }
  for (Device* d : devices_) {
    producer_events_.push_back(d->create_event());
    sent_.push_back(d->create_event());
  }
  slots_.resize(devices_.size());
  counters_.resize(devices_.size());
  arrivals_.resize(devices_.size());
  const size_t slot = std::max<size_t>(chunk_bytes_, sizeof(float));
  // The flat ring stages one chunk; a hierarchical round stages one per local device.
  host_out_.resize(slot * devices_.size());
  host_in_.resize(slot * devices_.size());
}

// The slots go back to their pools on their comm streams, which are idle after every call.
ProcessRing::~ProcessRing() = default;

void ProcessRing::reset_counters() {
  for (auto& c : counters_) c = CommCounters{};
  bytes_sent_across_ = 0;
  bytes_received_across_ = 0;
}

ProcessRing::Plan ProcessRing::check(Kind kind, const std::vector<TensorView>& full,
                                     const std::vector<Stream*>& producers) {
  const char* op = kind_text(static_cast<uint32_t>(kind));
  const int n = local_size();
  ZT_REQUIRE(static_cast<int>(full.size()) == n, op, ": got ", full.size(), " buffers for ", n,
             " local devices (one per local device)");
  ZT_REQUIRE(producers.empty() || static_cast<int>(producers.size()) == n, op, ": got ", producers.size(),
             " producer streams for ", n, " local devices (one per local device, or none)");
  Plan p;
  p.kind = kind;
  p.dtype = full[0].dtype;
  p.numel = full[0].numel();
  ZT_REQUIRE(p.dtype == DType::kF32 || p.dtype == DType::kF16 || p.dtype == DType::kBF16, op,
             ": dtype ", dtype_name(p.dtype), " is not supported (f32, f16 or bf16)");
  p.esize = dtype_size(p.dtype);
  for (int i = 0; i < n; ++i) {
    const TensorView& b = full[static_cast<size_t>(i)];
    Device& dev = *devices_[static_cast<size_t>(i)];
    ZT_REQUIRE(b.dtype == p.dtype, op, ": local device ", i, " passes ", dtype_name(b.dtype), " but local device 0 passes ",
               dtype_name(p.dtype));
    ZT_REQUIRE(b.numel() == p.numel, op, ": local device ", i, " passes ", b.numel(),
               " elements but local device 0 passes ", p.numel, " (every rank needs the same numel)");
    ZT_REQUIRE(b.data != nullptr || b.numel() == 0, op, ": the buffer of local device ", i, " has no data");
    ZT_REQUIRE(b.numel() == 0 || b.device == dev.index(), op, ": the buffer of local device ", i, " is on device ",
               b.device, " but local device ", i, " is ", dev.name());
    Stream* prod = producers.empty() ? nullptr : producers[static_cast<size_t>(i)];
    ZT_REQUIRE(prod == nullptr || &prod->device() == &dev, op, ": the producer stream of local device ", i,
               " runs on ", prod ? prod->device().name() : "", " but local device ", i, " is ", dev.name());
  }
  ZT_REQUIRE(p.numel % world() == 0, op, ": ", p.numel, " elements per rank do not split into ", world(),
             " equal shards; pad the buffer to a multiple of the world size (zero/shard_plan.h)");
  p.shard = p.numel / world();
  p.chunk_elems = std::max<int64_t>(1, static_cast<int64_t>(chunk_bytes_ / p.esize));
  p.chunks = (p.shard + p.chunk_elems - 1) / p.chunk_elems;
  p.call = calls_++;

  const Signature mine{static_cast<uint32_t>(kind), static_cast<uint32_t>(p.dtype), p.numel};
  const std::vector<Signature> all =
      group_.all_gather(mine, std::string(op) + " #" + std::to_string(p.call) + " (its signature)");
  const auto call = [](const Signature& s) {
    return std::string(kind_text(s.kind)) + "(" + std::to_string(s.numel) + " x " +
           dtype_name(static_cast<DType>(s.dtype)) + ")";
  };
  for (int q = 0; q < processes_; ++q) {
    const Signature& s = all[static_cast<size_t>(q)];
    ZT_REQUIRE(s.kind == all[0].kind && s.dtype == all[0].dtype && s.numel == all[0].numel,
               "collective mismatch at call #", p.call, ": process 0 called ", call(all[0]), " but process ", q,
               " called ", call(s), "; every process must issue the same collectives in the same order");
  }
  return p;
}

void ProcessRing::prologue(const std::vector<Stream*>& producers) {
  for (int i = 0; i < local_size(); ++i) {
    Stream* prod = producers.empty() ? nullptr : producers[static_cast<size_t>(i)];
    if (prod != nullptr && prod != &comm(i)) {
      prod->record(*producer_events_[static_cast<size_t>(i)]);
      comm(i).wait(*producer_events_[static_cast<size_t>(i)]);
    }
  }
  // A local peer writes into device i+1's buffer (all-gather): only after every producer finished.
  synchronize_all();
}

void ProcessRing::synchronize_all() {
  for (int i = 0; i < local_size(); ++i) comm(i).synchronize();
}

void ProcessRing::exchange(const Plan& p, size_t bytes, const char* step_name, int k, int64_t j, void* to) {
  const int last = local_size() - 1;
  comm(last).synchronize();  // host_out_ holds the outgoing chunk
  const int next = (process_ + 1) % processes_;
  const int prev = (process_ + processes_ - 1) % processes_;
  const std::string what = std::string(step_name) + " #" + std::to_string(p.call) + " step " + std::to_string(k) +
                            " chunk " + std::to_string(j);
  group_.send_recv(next, host_out_.data(), bytes, prev, host_in_.data(), bytes, kTag, what);
  bytes_sent_across_ += bytes;
  bytes_received_across_ += bytes;
  // Synchronized at the end of the round, so host_in_ is not refilled before this copy ran.
  comm(0).copy(to, host_in_.data(), bytes);
}

void ProcessRing::ensure_slots() {
  const size_t slot = std::max<size_t>(chunk_bytes_, sizeof(float));
  for (int i = 0; i < local_size(); ++i)
    if (slots_[static_cast<size_t>(i)].data() == nullptr)
      slots_[static_cast<size_t>(i)] = DeviceBuffer(devices_[static_cast<size_t>(i)]->memory(), slot, comm(i), "comm_recv");
}

void ProcessRing::reduce_scatter_rounds(const Plan& p, const std::vector<TensorView>& full) {
  const int n = world();
  const int local = local_size();
  if (n == 1 || p.shard == 0) return;
  ensure_slots();
  const char* name = p.kind == Kind::kAllReduce ? "all_reduce" : "reduce_scatter";
  for (int k = 0; k < n - 1; ++k) {
    for (int64_t j = 0; j < p.chunks; ++j) {
      const int64_t off = j * p.chunk_elems;
      const int64_t len = std::min(p.chunk_elems, p.shard - off);
      const size_t bytes = static_cast<size_t>(len) * p.esize;
      // Step k: global rank g sends its partial of shard (g-k-1) mod N to g+1.
      for (int i = 0; i < local; ++i) {
        const int s = mod(global_rank(i) - k - 1, n);
        const char* src = byte_ptr(full[static_cast<size_t>(i)]) + static_cast<size_t>(s * p.shard + off) * p.esize;
        const bool to_local = i + 1 < local || processes_ == 1;
        const int dst = (i + 1) % local;
        counters_[static_cast<size_t>(i)].bytes_sent += bytes;
        if (to_local) {
          comm(i).copy_peer(*devices_[static_cast<size_t>(dst)], slots_[static_cast<size_t>(dst)].data(), src, bytes);
          comm(i).record(*sent_[static_cast<size_t>(i)]);
        } else {
          comm(i).copy(host_out_.data(), src, bytes);
        }
      }
      if (processes_ > 1) exchange(p, bytes, name, k, j, slots_[0].data());
      // g adds the partial of shard (g-1-k-1) mod N it received into its own.
      for (int i = 0; i < local; ++i) {
        const bool from_local = i > 0 || processes_ == 1;
        if (from_local) comm(i).wait(*sent_[static_cast<size_t>((i + local - 1) % local)]);
        counters_[static_cast<size_t>(i)].bytes_received += bytes;
        const int s = mod(global_rank(i) - 1 - k - 1, n);
        const int dev = devices_[static_cast<size_t>(i)]->index();
        TensorView own{byte_ptr(full[static_cast<size_t>(i)]) + static_cast<size_t>(s * p.shard + off) * p.esize,
                       p.dtype, Shape{len}, dev};
        ConstTensorView incoming{slots_[static_cast<size_t>(i)].data(), p.dtype, Shape{len}, dev};
        ops::accumulate(comm(i), own, incoming);
      }
      synchronize_all();
    }
  }
}

void ProcessRing::all_gather_rounds(const Plan& p, const std::vector<TensorView>& full) {
  const int n = world();
  const int local = local_size();
  if (n == 1 || p.shard == 0) return;
  const char* name = p.kind == Kind::kAllReduce ? "all_reduce" : "all_gather";
  for (int k = 0; k < n - 1; ++k) {
    for (int64_t j = 0; j < p.chunks; ++j) {
      const int64_t off = j * p.chunk_elems;
      const int64_t len = std::min(p.chunk_elems, p.shard - off);
      const size_t bytes = static_cast<size_t>(len) * p.esize;
      // Step k: global rank g forwards shard (g-k) mod N to g+1, straight into g+1's buffer.
      for (int i = 0; i < local; ++i) {
        const size_t at = static_cast<size_t>(mod(global_rank(i) - k, n) * p.shard + off) * p.esize;
        const bool to_local = i + 1 < local || processes_ == 1;
        const int dst = (i + 1) % local;
        counters_[static_cast<size_t>(i)].bytes_sent += bytes;
        counters_[static_cast<size_t>(dst)].bytes_received += to_local ? bytes : 0;
        if (to_local)
          comm(i).copy_peer(*devices_[static_cast<size_t>(dst)], byte_ptr(full[static_cast<size_t>(dst)]) + at,
                            byte_ptr(full[static_cast<size_t>(i)]) + at, bytes);
        else
          comm(i).copy(host_out_.data(), byte_ptr(full[static_cast<size_t>(i)]) + at, bytes);
      }
      if (processes_ > 1) {
        const size_t at = static_cast<size_t>(mod(global_rank(0) - 1 - k, n) * p.shard + off) * p.esize;
        counters_[0].bytes_received += bytes;
        exchange(p, bytes, name, k, j, byte_ptr(full[0]) + at);
      }
      synchronize_all();
    }
  }
}

void ProcessRing::exchange_all_local(const Plan& p, size_t bytes, const char* step_name, int k, int64_t j) {
  const size_t total = bytes * static_cast<size_t>(local_size());
  synchronize_all();  // host_out_ holds every local device's outgoing chunk
  const int next = (process_ + 1) % processes_;
  const int prev = (process_ + processes_ - 1) % processes_;
  const std::string what = std::string(step_name) + " #" + std::to_string(p.call) + " cross-process step " +
                           std::to_string(k) + " chunk " + std::to_string(j);
  group_.send_recv(next, host_out_.data(), total, prev, host_in_.data(), total, kTag, what);
  bytes_sent_across_ += total;
  bytes_received_across_ += total;
}

// Shard index of (process q, local index i): global shards are process-major, g = q*L + i.
void ProcessRing::hier_reduce_scatter_rounds(const Plan& p, const std::vector<TensorView>& full) {
  const int local = local_size();
  const int procs = processes_;
  if (world() == 1 || p.shard == 0) return;
  ensure_slots();
  const char* name = p.kind == Kind::kHierAllReduce ? "hierarchical_all_reduce" : "hierarchical_reduce_scatter";
  const auto at = [&](int shard_index, int64_t off) { return static_cast<size_t>(shard_index * p.shard + off) * p.esize; };
  // Inside the process: step k, device i sends its partials of shards {q*L + (i-k-1) mod L} to i+1.
  for (int k = 0; k < local - 1; ++k)
    for (int q = 0; q < procs; ++q)
      for (int64_t j = 0; j < p.chunks; ++j) {
        const int64_t off = j * p.chunk_elems;
        const int64_t len = std::min(p.chunk_elems, p.shard - off);
        const size_t bytes = static_cast<size_t>(len) * p.esize;
        for (int i = 0; i < local; ++i) {
          const int dst = (i + 1) % local;
          const int s = q * local + mod(i - k - 1, local);
          comm(i).copy_peer(*devices_[static_cast<size_t>(dst)], slots_[static_cast<size_t>(dst)].data(),
                            byte_ptr(full[static_cast<size_t>(i)]) + at(s, off), bytes);
          comm(i).record(*sent_[static_cast<size_t>(i)]);
          counters_[static_cast<size_t>(i)].bytes_sent += bytes;
        }
        for (int i = 0; i < local; ++i) {
          comm(i).wait(*sent_[static_cast<size_t>((i + local - 1) % local)]);
          counters_[static_cast<size_t>(i)].bytes_received += bytes;
          const int s = q * local + mod(i - 1 - k - 1, local);
          const int dev = devices_[static_cast<size_t>(i)]->index();
          ops::accumulate(comm(i), TensorView{byte_ptr(full[static_cast<size_t>(i)]) + at(s, off), p.dtype, Shape{len}, dev},
                          ConstTensorView{slots_[static_cast<size_t>(i)].data(), p.dtype, Shape{len}, dev});
        }
        synchronize_all();
      }
  // Across processes: for every local index i a ring of K processes; step k, process r sends its
  // partial of shard ((r-k-1) mod K)*L + i to r+1.
  for (int k = 0; k < procs - 1; ++k)
    for (int64_t j = 0; j < p.chunks; ++j) {
      const int64_t off = j * p.chunk_elems;
      const int64_t len = std::min(p.chunk_elems, p.shard - off);
      const size_t bytes = static_cast<size_t>(len) * p.esize;
      for (int i = 0; i < local; ++i) {
        const int s = mod(process_ - k - 1, procs) * local + i;
        comm(i).copy(host_out_.data() + static_cast<size_t>(i) * bytes, byte_ptr(full[static_cast<size_t>(i)]) + at(s, off),
                     bytes);
        counters_[static_cast<size_t>(i)].bytes_sent += bytes;
      }
      exchange_all_local(p, bytes, name, k, j);
      for (int i = 0; i < local; ++i) {
        const int s = mod(process_ - 1 - k - 1, procs) * local + i;
        const int dev = devices_[static_cast<size_t>(i)]->index();
        counters_[static_cast<size_t>(i)].bytes_received += bytes;
        comm(i).copy(slots_[static_cast<size_t>(i)].data(), host_in_.data() + static_cast<size_t>(i) * bytes, bytes);
        ops::accumulate(comm(i), TensorView{byte_ptr(full[static_cast<size_t>(i)]) + at(s, off), p.dtype, Shape{len}, dev},
                        ConstTensorView{slots_[static_cast<size_t>(i)].data(), p.dtype, Shape{len}, dev});
      }
      synchronize_all();
    }
}

void ProcessRing::hier_all_gather_rounds(const Plan& p, const std::vector<TensorView>& full) {
  const int local = local_size();
  const int procs = processes_;
  if (world() == 1 || p.shard == 0) return;
  const char* name = p.kind == Kind::kHierAllReduce ? "hierarchical_all_reduce" : "hierarchical_all_gather";
  const auto at = [&](int shard_index, int64_t off) { return static_cast<size_t>(shard_index * p.shard + off) * p.esize; };
  // Across processes: step k, process r forwards shard ((r-k) mod K)*L + i of every local i.
  for (int k = 0; k < procs - 1; ++k)
    for (int64_t j = 0; j < p.chunks; ++j) {
      const int64_t off = j * p.chunk_elems;
      const int64_t len = std::min(p.chunk_elems, p.shard - off);
      const size_t bytes = static_cast<size_t>(len) * p.esize;
      for (int i = 0; i < local; ++i) {
        const int s = mod(process_ - k, procs) * local + i;
        comm(i).copy(host_out_.data() + static_cast<size_t>(i) * bytes, byte_ptr(full[static_cast<size_t>(i)]) + at(s, off),
                     bytes);
        counters_[static_cast<size_t>(i)].bytes_sent += bytes;
      }
      exchange_all_local(p, bytes, name, k, j);
      for (int i = 0; i < local; ++i) {
        const int s = mod(process_ - 1 - k, procs) * local + i;
        counters_[static_cast<size_t>(i)].bytes_received += bytes;
        comm(i).copy(byte_ptr(full[static_cast<size_t>(i)]) + at(s, off), host_in_.data() + static_cast<size_t>(i) * bytes,
                     bytes);
      }
      synchronize_all();
    }
  // Inside the process: step k, device i forwards shards {q*L + (i-k) mod L} to i+1.
  for (int k = 0; k < local - 1; ++k)
    for (int q = 0; q < procs; ++q)
      for (int64_t j = 0; j < p.chunks; ++j) {
        const int64_t off = j * p.chunk_elems;
        const int64_t len = std::min(p.chunk_elems, p.shard - off);
        const size_t bytes = static_cast<size_t>(len) * p.esize;
        for (int i = 0; i < local; ++i) {
          const int dst = (i + 1) % local;
          const size_t a = at(q * local + mod(i - k, local), off);
          comm(i).copy_peer(*devices_[static_cast<size_t>(dst)], byte_ptr(full[static_cast<size_t>(dst)]) + a,
                            byte_ptr(full[static_cast<size_t>(i)]) + a, bytes);
          counters_[static_cast<size_t>(i)].bytes_sent += bytes;
          counters_[static_cast<size_t>(dst)].bytes_received += bytes;
        }
        synchronize_all();
      }
}

void ProcessRing::run(const Plan& p, const std::vector<TensorView>& full, const std::vector<Stream*>& producers,
                      bool scatter, bool gather, bool hierarchical) {
  try {
    prologue(producers);
    if (scatter) hierarchical ? hier_reduce_scatter_rounds(p, full) : reduce_scatter_rounds(p, full);
    if (gather) hierarchical ? hier_all_gather_rounds(p, full) : all_gather_rounds(p, full);
  } catch (const Error& e) {
    // A local failure (a device error, a hung device abandoned) mid-collective: tell the peers at
    // once rather than let them wait out their timeout. A broken group has told them already.
    if (!group_.broken())
      group_.abort("rank " + std::to_string(process_) + " failed in " + kind_text(static_cast<uint32_t>(p.kind)) +
                   " #" + std::to_string(p.call) + ": " + e.message());
    throw;
  }
  for (auto& c : counters_) ++c.collectives;
}

void ProcessRing::group_call(Kind kind, const std::vector<TensorView>& full, const std::vector<Stream*>& producers) {
  const bool scatter = kind != Kind::kAllGather && kind != Kind::kHierAllGather;
  const bool gather = kind != Kind::kReduceScatter && kind != Kind::kHierReduceScatter;
  const bool hierarchical = kind == Kind::kHierReduceScatter || kind == Kind::kHierAllGather || kind == Kind::kHierAllReduce;
  run(check(kind, full, producers), full, producers, scatter, gather, hierarchical);
}

void ProcessRing::hierarchical_reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) {
  group_call(Kind::kHierReduceScatter, full, producers);
}

void ProcessRing::hierarchical_all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) {
  group_call(Kind::kHierAllGather, full, producers);
}

void ProcessRing::hierarchical_all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) {
  group_call(Kind::kHierAllReduce, full, producers);
}

void ProcessRing::reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) {
  group_call(Kind::kReduceScatter, full, producers);
}

void ProcessRing::all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) {
  group_call(Kind::kAllGather, full, producers);
}

void ProcessRing::all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) {
  group_call(Kind::kAllReduce, full, producers);
}

void ProcessRing::reduce_scatter(int local, TensorView full, Stream* producer) {
  rank_call(Kind::kReduceScatter, local, full, producer);
}

void ProcessRing::all_gather(int local, TensorView full, Stream* producer) {
  rank_call(Kind::kAllGather, local, full, producer);
}

void ProcessRing::all_reduce(int local, TensorView full, Stream* producer) {
  rank_call(Kind::kAllReduce, local, full, producer);
}

void ProcessRing::hierarchical_reduce_scatter(int local, TensorView full, Stream* producer) {
  rank_call(Kind::kHierReduceScatter, local, full, producer);
}

void ProcessRing::hierarchical_all_gather(int local, TensorView full, Stream* producer) {
  rank_call(Kind::kHierAllGather, local, full, producer);
}

void ProcessRing::hierarchical_all_reduce(int local, TensorView full, Stream* producer) {
  rank_call(Kind::kHierAllReduce, local, full, producer);
}

void ProcessRing::rank_call(Kind kind, int local, TensorView full, Stream* producer) {
  const char* op = kind_text(static_cast<uint32_t>(kind));
  ZT_REQUIRE(local >= 0 && local < local_size(), op, ": local device ", local, " is not one of ", local_size());
  std::unique_lock<std::mutex> lock(rv_mu_);
  Arrival& mine = arrivals_[static_cast<size_t>(local)];
  ZT_REQUIRE(!mine.arrived, op, ": local device ", local,
             " called while its previous collective still waits for the other local devices; use one host "
             "thread per local device");
  mine = Arrival{true, kind, full, producer};
  const uint64_t my_generation = generation_;
  if (++arrived_ < local_size()) {
    rv_cv_.wait(lock, [&] { return generation_ != my_generation; });
    if (generation_failed_) throw Error(error_kind_, error_message_);
    return;
  }
  // The last local thread runs the collective for all; the others stay blocked in the wait above,
  // so the arrivals cannot change meanwhile.
  lock.unlock();
  bool failed = false;
  ErrorKind kind_of_error = ErrorKind::kInternal;
  std::string message;
  try {
    std::vector<TensorView> bufs;
    std::vector<Stream*> producers;
    for (int i = 0; i < local_size(); ++i) {
      const Arrival& a = arrivals_[static_cast<size_t>(i)];
      ZT_REQUIRE(a.kind == arrivals_[0].kind, "collective mismatch inside process ", process_, ": local device 0 called ",
                 kind_text(static_cast<uint32_t>(arrivals_[0].kind)), " but local device ", i, " called ",
                 kind_text(static_cast<uint32_t>(a.kind)), "; every local thread must issue the same collectives");
      bufs.push_back(a.full);
      producers.push_back(a.producer);
    }
    group_call(arrivals_[0].kind, bufs, producers);
  } catch (const Error& e) {
    failed = true;
    kind_of_error = e.kind();
    message = e.message();
  }
  lock.lock();
  for (Arrival& a : arrivals_) a = Arrival{};
  arrived_ = 0;
  generation_failed_ = failed;
  error_kind_ = kind_of_error;
  error_message_ = message;
  ++generation_;
  lock.unlock();
  rv_cv_.notify_all();
  if (failed) throw Error(kind_of_error, message);
}

}  // namespace zt
