// Host snapshots, checkpoint writing and resharded restore of the engine's state (see state_io.h).
#include "train/state_io.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "checkpoint/file_io.h"
#include "comm/mesh.h"
#include "core/files.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "zero/shard_plan.h"

namespace zt {

namespace {

enum class Kind { kMaster, kM, kV, kWorking };
const char* kind_suffix(Kind k) {
  switch (k) {
    case Kind::kMaster: return "/master";
    case Kind::kM: return "/m";
    case Kind::kV: return "/v";
    case Kind::kWorking: return "/working";
  }
  return "";
}
std::string array_name(const std::string& block, Kind k) { return block + kind_suffix(k); }

// The arrays of checkpoints and snapshots are the logical (one-device) blocks whatever the tensor
// degree; a tensor-parallel model's local blocks map onto them (model/tensor_split.h).
const ParamLayout& logical_layout(const Model& model) {
  return model.tensor_map() ? *model.tensor_map()->logical : model.layout();
}
int tensor_coord(const ZeroEngine& engine, int rank) {
  const int T = engine.tensor_size(), N = engine.world();
  return Mesh(MeshShape{.data = N / T, .tensor = T}, N).index(MeshAxis::kTensor, rank);
}

// The ranks' shards of local blocks -> shards of the logical blocks (each logical block cut into
// one contiguous range per rank), so that a snapshot of a tensor-parallel run is laid out as any
// other run's. Replicated tensors are written by every rank of a tensor group (equal bits).
HostSnapshot to_logical(const HostSnapshot& local, const TensorMap& map, const ZeroEngine& engine) {
  const ParamLayout& L = *map.logical;
  const int N = static_cast<int>(local.shards.size());
  HostSnapshot out;
  out.step = local.step;
  out.working = local.working;
  out.adamw = local.adamw;
  out.meta = local.meta;
  for (const auto& b : L.blocks()) {
    out.block_names.push_back(b.name);
    out.block_numel.push_back(b.numel);
  }
  out.shards.assign(static_cast<size_t>(N), std::vector<HostShard>(static_cast<size_t>(L.num_blocks())));
  const bool mixed = local.working != DType::kF32;
  const size_t es = mixed ? dtype_size(local.working) : 0;
  // A process of a multi-process run holds only its own ranks' shards (the others are empty). Then
  // each rank keeps its own range, mapped onto the logical block: possible when the map sends a
  // shard to one consecutive logical range (degree 1: the padded vocabulary's rows beyond V map
  // nowhere), not for a tensor-parallel split.
  const bool partial = std::any_of(local.shards.begin(), local.shards.end(), [](const auto& s) { return s.empty(); });
  if (partial) {
    for (int r = 0; r < N; ++r) {
      if (local.shards[static_cast<size_t>(r)].empty()) continue;
      const int t = tensor_coord(engine, r);
      for (int b = 0; b < map.local->num_blocks(); ++b) {
        const HostShard& h = local.shards[static_cast<size_t>(r)][static_cast<size_t>(b)];
        map.for_each_run(t, b, h.begin, h.begin + static_cast<int64_t>(h.master.size()),
                         [&](int to, int64_t lo, int64_t li, int64_t count) {
                           HostShard& o = out.shards[static_cast<size_t>(r)][static_cast<size_t>(to)];
                           if (o.master.empty()) o.begin = lo;
                           ZT_REQUIRE(o.begin + static_cast<int64_t>(o.master.size()) == lo,
                                      "a checkpoint of a tensor-parallel model across processes is not supported "
                                      "yet: save it from one process (several devices), then resume anywhere");
                           const size_t at = static_cast<size_t>(li - h.begin), k = static_cast<size_t>(count);
                           o.master.insert(o.master.end(), h.master.begin() + at, h.master.begin() + at + k);
                           o.m.insert(o.m.end(), h.m.begin() + at, h.m.begin() + at + k);
                           if (local.adamw) o.v.insert(o.v.end(), h.v.begin() + at, h.v.begin() + at + k);
                           if (mixed)
                             o.working.insert(o.working.end(), h.working.begin() + at * es,
                                              h.working.begin() + (at + k) * es);
                         });
      }
    }
    return out;
  }
  for (int lb = 0; lb < L.num_blocks(); ++lb) {
    const size_t n = static_cast<size_t>(L.block(lb).numel);
    std::vector<float> master(n, 0.0f), m(n, 0.0f), v(local.adamw ? n : 0, 0.0f);
    std::vector<uint8_t> working(n * es, 0);
    for (int r = 0; r < N; ++r) {
      const int t = tensor_coord(engine, r);
      for (int b = 0; b < map.local->num_blocks(); ++b) {
        const auto& places = map.places[static_cast<size_t>(b)];
        if (std::none_of(places.begin(), places.end(), [&](const LogicalPlace& p) { return p.block == lb; })) continue;
        const HostShard& h = local.shards[static_cast<size_t>(r)][static_cast<size_t>(b)];
        map.for_each_run(t, b, h.begin, h.begin + static_cast<int64_t>(h.master.size()),
                         [&](int to, int64_t lo, int64_t li, int64_t count) {
                           if (to != lb) return;
                           const size_t at = static_cast<size_t>(li - h.begin), k = static_cast<size_t>(count);
                           std::copy_n(h.master.data() + at, k, master.data() + lo);
                           std::copy_n(h.m.data() + at, k, m.data() + lo);
                           if (local.adamw) std::copy_n(h.v.data() + at, k, v.data() + lo);
                           if (mixed) std::memcpy(working.data() + static_cast<size_t>(lo) * es, h.working.data() + at * es, k * es);
                         });
      }
    }
    for (int r = 0; r < N; ++r) {
      const size_t lo = n * static_cast<size_t>(r) / static_cast<size_t>(N), hi = n * static_cast<size_t>(r + 1) / static_cast<size_t>(N);
      HostShard& h = out.shards[static_cast<size_t>(r)][static_cast<size_t>(lb)];
      h.begin = static_cast<int64_t>(lo);
      h.master.assign(master.begin() + static_cast<ptrdiff_t>(lo), master.begin() + static_cast<ptrdiff_t>(hi));
      h.m.assign(m.begin() + static_cast<ptrdiff_t>(lo), m.begin() + static_cast<ptrdiff_t>(hi));
      if (local.adamw) h.v.assign(v.begin() + static_cast<ptrdiff_t>(lo), v.begin() + static_cast<ptrdiff_t>(hi));
      if (mixed) h.working.assign(working.begin() + static_cast<ptrdiff_t>(lo * es), working.begin() + static_cast<ptrdiff_t>(hi * es));
    }
  }
  return out;
}

}  // namespace

size_t HostSnapshot::bytes() const {
  size_t n = 0;
  for (const auto& rank : shards)
    for (const HostShard& s : rank) n += (s.master.size() + s.m.size() + s.v.size()) * 4 + s.working.size();
  return n;
}

HostSnapshot take_snapshot(ZeroEngine& engine, const Model& model, bool adamw, int64_t step,
                           const std::function<void(const std::function<void(int)>&)>& for_ranks) {
  const ParamLayout& L = model.layout();
  HostSnapshot snap;
  snap.step = step;
  snap.working = engine.working_dtype();
  snap.adamw = adamw;
  for (const auto& b : L.blocks()) {
    snap.block_names.push_back(b.name);
    snap.block_numel.push_back(b.numel);
  }
  snap.shards.resize(static_cast<size_t>(engine.world()));
  const bool mixed = snap.working != DType::kF32;
  for_ranks([&](int r) {
    const NvtxRange range(NvtxCategory::kCheckpoint, "snapshot to host", r);
    auto& mine = snap.shards[static_cast<size_t>(r)];
    mine.resize(static_cast<size_t>(L.num_blocks()));
    for (int b = 0; b < L.num_blocks(); ++b) {
      const ShardRange sh = engine.rank(r).shard_of(b);
      HostShard& h = mine[static_cast<size_t>(b)];
      const size_t n = static_cast<size_t>(sh.size());
      h.begin = sh.begin;
      h.master.resize(n);
      h.m.resize(n);
      h.v.resize(adamw ? n : 0);
      h.working.resize(mixed ? n * dtype_size(snap.working) : 0);
      engine.rank(r).state_to_host(b, h.master.data(), h.m.data(), adamw ? h.v.data() : nullptr,
                           mixed ? h.working.data() : nullptr);
    }
  });
  if (const TensorMap* map = model.tensor_map()) return to_logical(snap, *map, engine);
  return snap;
}

// ---- sources ----------------------------------------------------------------------------------

namespace {

class ReaderSource final : public StateSource {
 public:
  explicit ReaderSource(const CheckpointReader& r) : r_(r) {}
  bool has(const std::string& a) const override { return r_.has_array(a); }
  StorageDType dtype(const std::string& a) const override { return r_.array(a).dtype; }
  uint64_t numel(const std::string& a) const override { return r_.array(a).numel; }
  void read(const std::string& a, uint64_t begin, uint64_t count, void* out) const override {
    r_.read(a, begin, count, out);
  }
  std::string describe() const override { return "checkpoint " + r_.path(); }
  const nlohmann::json& meta() const override { return r_.meta(); }

 private:
  const CheckpointReader& r_;
};

class SnapshotSource final : public StateSource {
 public:
  explicit SnapshotSource(const HostSnapshot& s) : s_(s) {}
  bool has(const std::string& a) const override {
    Kind k;
    const int b = find(a, &k);
    if (b < 0) return false;
    if (k == Kind::kV) return s_.adamw;
    if (k == Kind::kWorking) return s_.working != DType::kF32;
    return true;
  }
  StorageDType dtype(const std::string& a) const override {
    Kind k;
    find(a, &k);
    return k == Kind::kWorking ? to_storage_dtype(s_.working) : StorageDType::kF32;
  }
  uint64_t numel(const std::string& a) const override {
    Kind k;
    const int b = find(a, &k);
    ZT_CHECK(b >= 0, "snapshot has no array ", a);
    return static_cast<uint64_t>(s_.block_numel[static_cast<size_t>(b)]);
  }
  void read(const std::string& a, uint64_t begin, uint64_t count, void* out) const override {
    Kind k;
    const int b = find(a, &k);
    ZT_CHECK(b >= 0 && has(a), "snapshot has no array ", a);
    const size_t es = k == Kind::kWorking ? dtype_size(s_.working) : 4;
    const uint64_t end = begin + count;
    uint64_t covered = 0;
    for (const auto& rank : s_.shards) {
      const HostShard& h = rank[static_cast<size_t>(b)];
      const uint64_t hb = static_cast<uint64_t>(h.begin), he = hb + h.master.size();
      const uint64_t lo = std::max(begin, hb), hi = std::min(end, he);
      if (lo >= hi) continue;
      const uint8_t* src = nullptr;
      switch (k) {
        case Kind::kMaster: src = reinterpret_cast<const uint8_t*>(h.master.data()); break;
        case Kind::kM: src = reinterpret_cast<const uint8_t*>(h.m.data()); break;
        case Kind::kV: src = reinterpret_cast<const uint8_t*>(h.v.data()); break;
        case Kind::kWorking: src = h.working.data(); break;
      }
      std::memcpy(static_cast<uint8_t*>(out) + (lo - begin) * es, src + (lo - hb) * es, (hi - lo) * es);
      covered += hi - lo;
    }
    ZT_CHECK(covered == count, "snapshot ranges do not cover ", a, " [", begin, ", ", end, ")");
  }
  std::string describe() const override { return "the snapshot of step " + std::to_string(s_.step); }
  const nlohmann::json& meta() const override { return s_.meta; }

 private:
  int find(const std::string& a, Kind* kind) const {
    const size_t slash = a.rfind('/');
    if (slash == std::string::npos) return -1;
    const std::string block = a.substr(0, slash), suffix = a.substr(slash);
    bool ok = false;
    for (Kind k : {Kind::kMaster, Kind::kM, Kind::kV, Kind::kWorking})
      if (suffix == kind_suffix(k)) *kind = k, ok = true;
    if (!ok) return -1;
    for (size_t i = 0; i < s_.block_names.size(); ++i)
      if (s_.block_names[i] == block) return static_cast<int>(i);
    return -1;
  }
  const HostSnapshot& s_;
};

}  // namespace

std::unique_ptr<StateSource> source_of(const CheckpointReader& reader) { return std::make_unique<ReaderSource>(reader); }
std::unique_ptr<StateSource> source_of(const HostSnapshot& snapshot) { return std::make_unique<SnapshotSource>(snapshot); }

namespace {
// The shape keys of meta["model"] (train/trainer.cc writes them): what makes two models the same.
nlohmann::json model_shape(const ModelConfig& mc) {
  return {{"layers", mc.layers}, {"heads", mc.heads},         {"embd", mc.embd},       {"seq_len", mc.seq_len},
          {"vocab", mc.vocab},   {"input_dim", mc.input_dim}, {"hidden", mc.hidden},   {"classes", mc.classes}};
}
}  // namespace

RunIdentity run_identity(const ModelConfig& mc, uint64_t seed, const std::string& data) {
  RunIdentity id;
  id.model = model_shape(mc);
  id.model_description = mc.describe();
  id.seed = seed;
  id.data = data;
  return id;
}

void check_source_matches(const StateSource& src, const Model& model, bool adamw) {
  // The shape first: a different head count (or any shape change that keeps the array sizes)
  // would otherwise load and train a different model from these weights.
  const nlohmann::json& meta = src.meta();
  if (meta.is_object() && meta.contains("model") && meta["model"].is_object()) {
    const nlohmann::json& saved = meta["model"];
    const nlohmann::json mine = model_shape(model.config());
    std::string differs;
    for (const auto& [k, v] : mine.items())
      if (saved.contains(k) && saved[k] != v)
        differs += (differs.empty() ? "" : ", ") + k + " " + saved[k].dump() + " there, " + v.dump() + " here";
    ZT_REQUIRE(differs.empty(), src.describe(), " was saved from another model (",
               saved.value("describe", std::string("?")), "; this run is ", model.config().describe(), ": ", differs,
               "); resume with the same model flags, or start a fresh run in another --checkpoint-dir");
  }
  for (const auto& b : logical_layout(model).blocks()) {
    for (Kind k : {Kind::kMaster, Kind::kM}) {
      const std::string a = array_name(b.name, k);
      ZT_REQUIRE(src.has(a), src.describe(), " has no '", a, "': it was saved from another model (this one is ",
                 model.config().describe(), ")");
      ZT_REQUIRE(src.numel(a) == static_cast<uint64_t>(b.numel) && src.dtype(a) == StorageDType::kF32, src.describe(),
                 " holds ", src.numel(a), " elements of ", storage_dtype_name(src.dtype(a)), " for '", a, "', this model has ",
                 b.numel, " of f32: it was saved from another model (this one is ", model.config().describe(), ")");
    }
    const std::string v = array_name(b.name, Kind::kV);
    ZT_REQUIRE(src.has(v) == adamw, src.describe(), " was saved with the ", src.has(v) ? "AdamW" : "SGD",
               " optimizer; resume with --optimizer ", src.has(v) ? "adamw" : "sgd");
    if (adamw)
      ZT_REQUIRE(src.numel(v) == static_cast<uint64_t>(b.numel) && src.dtype(v) == StorageDType::kF32, src.describe(),
                 " has a malformed '", v, "'");
  }
}

void restore_rank(ZeroEngine& engine, const Model& model, const StateSource& src, int rank) {
  const ParamLayout& L = model.layout();
  const TensorMap* map = model.tensor_map();
  const int t = map ? tensor_coord(engine, rank) : 0;
  const DType W = engine.working_dtype();
  const NvtxRange range(NvtxCategory::kCheckpoint, "restore state", rank);
  for (int b = 0; b < L.num_blocks(); ++b) {
    const std::string& name = L.block(b).name;
    // Elements [lo, hi) of local block b's array `kind` into out (element size es): straight
    // from the array of the same name, or, tensor-parallel, from the logical arrays they map to.
    auto read = [&](Kind kind, int64_t lo, int64_t hi, void* out, size_t es) {
      if (hi <= lo) return;
      if (!map) {
        src.read(array_name(name, kind), static_cast<uint64_t>(lo), static_cast<uint64_t>(hi - lo), out);
        return;
      }
      map->for_each_run(t, b, lo, hi, [&](int lb, int64_t at, int64_t li, int64_t n) {
        src.read(array_name(map->logical->block(lb).name, kind), static_cast<uint64_t>(at), static_cast<uint64_t>(n),
                 static_cast<uint8_t*>(out) + static_cast<size_t>(li - lo) * es);
      });
    };
    const int64_t numel = L.block(b).numel;
    std::vector<float> master(static_cast<size_t>(numel), 0.0f);
    read(Kind::kMaster, 0, numel, master.data(), 4);
    const auto [lo, hi] = engine.rank(rank).state_range(b);
    const size_t n = static_cast<size_t>(hi - lo);
    std::vector<float> m(n, 0.0f), v;
    read(Kind::kM, lo, hi, m.data(), 4);
    // Every logical block's arrays were checked to exist alike (check_source_matches).
    const std::string& probe = map ? map->logical->block(map->places[static_cast<size_t>(b)][0].block).name : name;
    if (src.has(array_name(probe, Kind::kV))) {
      v.assign(n, 0.0f);
      read(Kind::kV, lo, hi, v.data(), 4);
    }
    // The saved 16-bit parameters when they are of this run's dtype (stochastic rounding makes
    // them more than the master rounded); else they are derived from the master.
    std::vector<uint8_t> working;
    const std::string wa = array_name(probe, Kind::kWorking);
    if (W != DType::kF32 && src.has(wa) && src.dtype(wa) == to_storage_dtype(W) &&
        src.numel(wa) == src.numel(array_name(probe, Kind::kMaster))) {
      working.assign(static_cast<size_t>(numel) * dtype_size(W), 0);
      read(Kind::kWorking, 0, numel, working.data(), dtype_size(W));
    }
    engine.rank(rank).load_state(b, master.data(), m.data(), v.empty() ? nullptr : v.data(),
                      working.empty() ? nullptr : working.data());
  }
}

std::vector<std::vector<float>> logical_parameters(ZeroEngine& engine, const Model& model, bool master) {
  const ParamLayout& L = model.layout();
  const TensorMap* map = model.tensor_map();
  std::vector<std::vector<float>> out;
  if (!map) {
    for (int b = 0; b < L.num_blocks(); ++b) out.push_back(master ? engine.master_to_host(b) : engine.block_to_host(b));
    return out;
  }
  for (const auto& lb : map->logical->blocks()) out.emplace_back(static_cast<size_t>(lb.numel), 0.0f);
  for (int t = 0; t < engine.tensor_size(); ++t)
    for (int b = 0; b < L.num_blocks(); ++b) {
      const std::vector<float> local = master ? engine.master_to_host(b, t) : engine.block_to_host(b, t);
      map->for_each_run(t, b, 0, L.block(b).numel, [&](int lb, int64_t at, int64_t li, int64_t n) {
        std::copy_n(local.data() + li, n, out[static_cast<size_t>(lb)].data() + at);
      });
    }
  return out;
}

namespace {

void declare_arrays(const HostSnapshot& snap, CheckpointWriter& writer) {
  const bool mixed = snap.working != DType::kF32;
  for (size_t b = 0; b < snap.block_names.size(); ++b) {
    const uint64_t n = static_cast<uint64_t>(snap.block_numel[b]);
    writer.declare_array(array_name(snap.block_names[b], Kind::kMaster), StorageDType::kF32, n);
    writer.declare_array(array_name(snap.block_names[b], Kind::kM), StorageDType::kF32, n);
    if (snap.adamw) writer.declare_array(array_name(snap.block_names[b], Kind::kV), StorageDType::kF32, n);
    if (mixed) writer.declare_array(array_name(snap.block_names[b], Kind::kWorking), to_storage_dtype(snap.working), n);
  }
}

// The snapshot's ranks into files first_rank + r, one thread per file (written concurrently).
void write_files(const HostSnapshot& snap, CheckpointWriter& writer) {
  const bool mixed = snap.working != DType::kF32;
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr error;
  for (int r = 0; r < static_cast<int>(snap.shards.size()); ++r)
    threads.emplace_back([&, r] {
      try {
        const int file = snap.first_rank + r;
        for (size_t b = 0; b < snap.block_names.size(); ++b) {
          const HostShard& h = snap.shards[static_cast<size_t>(r)][b];
          if (h.master.empty()) continue;
          const uint64_t begin = static_cast<uint64_t>(h.begin), fb = h.master.size() * 4;
          writer.write_range(file, array_name(snap.block_names[b], Kind::kMaster), begin, h.master.data(), fb);
          writer.write_range(file, array_name(snap.block_names[b], Kind::kM), begin, h.m.data(), fb);
          if (snap.adamw) writer.write_range(file, array_name(snap.block_names[b], Kind::kV), begin, h.v.data(), fb);
          if (mixed)
            writer.write_range(file, array_name(snap.block_names[b], Kind::kWorking), begin, h.working.data(),
                               h.working.size());
        }
        writer.finish_file(file);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

template <typename T>
void put(std::vector<uint8_t>& out, const T* data, size_t n) {
  const auto* b = reinterpret_cast<const uint8_t*>(data);
  out.insert(out.end(), b, b + n * sizeof(T));
}
template <typename T>
void take(const std::vector<uint8_t>& in, size_t& at, T* data, size_t n) {
  ZT_CHECK(at + n * sizeof(T) <= in.size(), "a replicated snapshot is shorter than its header says");
  std::memcpy(data, in.data() + at, n * sizeof(T));
  at += n * sizeof(T);
}

}  // namespace

std::vector<uint8_t> serialize_shards(const HostSnapshot& snap) {
  nlohmann::json sizes = nlohmann::json::array();
  for (const auto& rank : snap.shards)
    for (const HostShard& h : rank) sizes.push_back({h.begin, h.master.size(), h.v.size(), h.working.size()});
  const std::string header = nlohmann::json{{"step", snap.step}, {"working", static_cast<int>(snap.working)},
                                            {"adamw", snap.adamw}, {"blocks", snap.block_names},
                                            {"numel", snap.block_numel}, {"ranks", snap.shards.size()},
                                            {"first_rank", snap.first_rank}, {"world_ranks", snap.world_ranks},
                                            {"sizes", sizes}}
                                 .dump();
  std::vector<uint8_t> out;
  const uint64_t n = header.size();
  put(out, &n, 1);
  put(out, header.data(), header.size());
  for (const auto& rank : snap.shards)
    for (const HostShard& h : rank) {
      put(out, h.master.data(), h.master.size());
      put(out, h.m.data(), h.m.size());
      put(out, h.v.data(), h.v.size());
      put(out, h.working.data(), h.working.size());
    }
  return out;
}

HostSnapshot deserialize_shards(const std::vector<uint8_t>& bytes) {
  size_t at = 0;
  uint64_t n = 0;
  take(bytes, at, &n, 1);
  std::string header(n, '\0');
  take(bytes, at, header.data(), n);
  const nlohmann::json h = nlohmann::json::parse(header);
  HostSnapshot s;
  s.step = h["step"];
  s.working = static_cast<DType>(h["working"].get<int>());
  s.adamw = h["adamw"];
  s.block_names = h["blocks"].get<std::vector<std::string>>();
  s.block_numel = h["numel"].get<std::vector<int64_t>>();
  s.first_rank = h["first_rank"];
  s.world_ranks = h["world_ranks"];
  const size_t ranks = h["ranks"], blocks = s.block_names.size();
  s.shards.assign(ranks, std::vector<HostShard>(blocks));
  size_t i = 0;
  for (auto& rank : s.shards)
    for (HostShard& sh : rank) {
      const nlohmann::json& z = h["sizes"].at(i++);
      sh.begin = z[0];
      sh.master.resize(z[1]);
      sh.m.resize(z[1]);
      sh.v.resize(z[2]);
      sh.working.resize(z[3]);
      take(bytes, at, sh.master.data(), sh.master.size());
      take(bytes, at, sh.m.data(), sh.m.size());
      take(bytes, at, sh.v.data(), sh.v.size());
      take(bytes, at, sh.working.data(), sh.working.size());
    }
  return s;
}

void write_snapshot_files(const HostSnapshot& snap, CheckpointWriter& writer) {
  declare_arrays(snap, writer);
  write_files(snap, writer);
}

std::string write_snapshot_part(const HostSnapshot& snap, const std::string& root, const std::string& name) {
  const int files = snap.world_ranks > 0 ? snap.world_ranks : static_cast<int>(snap.shards.size());
  CheckpointWriter writer(root, snap.step, files, WriterPart{snap.first_rank, static_cast<int>(snap.shards.size()), false});
  write_snapshot_files(snap, writer);
  nlohmann::json part = writer.hand_over();
  const std::string staging = part["staging"].get<std::string>();
  part.erase("staging");
  part["partial"] = {{"step", snap.step}, {"ranks", files}, {"meta", snap.meta}};
  atomic_write_file(staging, kPartialFileName, part.dump(1));
  const std::string path = root + "/" + name;
  std::error_code ec;
  std::filesystem::remove_all(path, ec);  // an older partial of the same step and process
  if (::rename(staging.c_str(), path.c_str()) != 0)
    ZT_THROW(ErrorKind::kIo, path, ": cannot rename the partial snapshot into place (", errno_text(errno), ")");
  fsync_dir(root);
  return path;
}


namespace {

std::string sentence_of(const std::exception& e) {
  const auto* z = dynamic_cast<const Error*>(&e);
  return z ? z->message() : e.what();
}

}  // namespace

std::string write_checkpoint(const HostSnapshot& snap, const std::string& root, int keep, CheckpointTeam* team) {
  const int files = snap.world_ranks > 0 ? snap.world_ranks : static_cast<int>(snap.shards.size());
  if (!team) {
    CheckpointWriter writer(root, snap.step, files);
    declare_arrays(snap, writer);
    write_files(snap, writer);
    return writer.commit(snap.meta, keep);
  }
  // Every process reaches gather and broadcast whatever failed before them, so that none waits
  // for a part that will never come: a failure is reported to all, not waited out.
  const bool lead = team->process() == 0;
  std::optional<CheckpointWriter> writer;
  nlohmann::json mine = nlohmann::json::object();
  try {
    writer.emplace(root, snap.step, files, WriterPart{snap.first_rank, static_cast<int>(snap.shards.size()), lead});
    declare_arrays(snap, *writer);
    write_files(snap, *writer);
    if (!lead) mine = writer->hand_over();
  } catch (const std::exception& e) {
    mine = {{"error", sentence_of(e)}};
  }
  const std::vector<std::string> parts = team->gather(mine.dump());
  nlohmann::json outcome = nlohmann::json::object();
  if (lead) {
    std::string error;
    for (size_t p = 0; p < parts.size() && error.empty(); ++p) {
      const nlohmann::json part = p == 0 ? mine : nlohmann::json::parse(parts[p], nullptr, false);
      if (part.is_discarded() || part.contains("error"))
        error = "process " + std::to_string(p) + ": " + (part.is_discarded() ? "a malformed hand-over" : part["error"].get<std::string>());
    }
    if (error.empty()) try {
        for (size_t p = 1; p < parts.size(); ++p) writer->adopt(nlohmann::json::parse(parts[p]));
        outcome["path"] = writer->commit(snap.meta, keep);
      } catch (const std::exception& e) {
        error = "process 0: " + sentence_of(e);
      }
    if (!error.empty()) outcome = {{"error", error}};
  }
  const nlohmann::json result = nlohmann::json::parse(team->broadcast(outcome.dump()), nullptr, false);
  ZT_CHECK(!result.is_discarded() && (result.contains("path") || result.contains("error")),
           "checkpoint team: a malformed outcome from process 0");
  if (result.contains("error"))
    ZT_THROW(ErrorKind::kIo, "checkpoint ", format_step_dir(snap.step), " in ", root, " was not saved: ",
             result["error"].get<std::string>());
  return result["path"].get<std::string>();
}

struct BackgroundSaver::Job {
  // Owned by the job (the thread reads only these and the fields below it writes).
  std::shared_ptr<const HostSnapshot> snap;
  std::string root;
  int keep = 0;
  CheckpointTeam* team = nullptr;
  OnDone on_done;  // never touched by the thread
  std::thread thread;
  std::atomic<bool> finished{false};
  std::string path;
  double seconds = 0;
  std::exception_ptr error;
};

BackgroundSaver::BackgroundSaver(std::string root, int keep, CheckpointTeam* team)
    : root_(std::move(root)), keep_(keep), team_(team) {}

BackgroundSaver::~BackgroundSaver() {
  // Join only: on_done may reference what the owner already destroyed, and a failure has nowhere
  // to go (the run is ending, normally after an error of its own).
  if (job_ && job_->thread.joinable()) job_->thread.join();
}

void BackgroundSaver::save(std::shared_ptr<const HostSnapshot> snap, OnDone on_done) {
  ZT_CHECK(snap != nullptr, "BackgroundSaver::save: no snapshot");
  wait();
  auto job = std::make_unique<Job>();
  job->snap = std::move(snap);
  job->root = root_;
  job->keep = keep_;
  job->team = team_;
  job->on_done = std::move(on_done);
  Job* j = job.get();
  job->thread = std::thread([j] {
    try {
      const NvtxRange range(NvtxCategory::kCheckpoint, "checkpoint write step " + std::to_string(j->snap->step));
      const auto t0 = std::chrono::steady_clock::now();
      j->path = write_checkpoint(*j->snap, j->root, j->keep, j->team);
      j->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } catch (...) {
      j->error = std::current_exception();
    }
    // The snapshot's memory goes back now (when no one else shares it), not at the next collection.
    j->snap.reset();
    j->finished.store(true, std::memory_order_release);
  });
  job_ = std::move(job);
}

void BackgroundSaver::collect() {
  std::unique_ptr<Job> job = std::move(job_);
  if (job->thread.joinable()) job->thread.join();
  if (job->error) std::rethrow_exception(job->error);
  if (job->on_done) job->on_done(job->path, job->seconds);
}

bool BackgroundSaver::poll() {
  if (!job_) return true;
  if (!job_->finished.load(std::memory_order_acquire)) return false;
  collect();
  return true;
}

void BackgroundSaver::wait() {
  if (job_) collect();
}

}  // namespace zt
