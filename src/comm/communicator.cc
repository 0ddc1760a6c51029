// The communicator's construction, its groups and their calls, completion and counters (see
// communicator.h for the contract). The collectives are in collectives.cc, point-to-point in
// p2p.cc, abort in failure.cc, receive buffers and their planning in buffers.cc (NCCL's shape: one
// file per API area).
#include "comm/communicator.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "comm/communicator_impl.h"

namespace zt {

namespace {

std::string ranks_name(const std::vector<int>& ranks) {
  std::string s = "{";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ranks[i]);
  }
  return s + "}";
}

}  // namespace

// ---- construction ----------------------------------------------------------------------------

Communicator::Communicator(std::vector<Device*> devices, size_t chunk_bytes, CommPath path)
    : devices_(std::move(devices)), chunk_bytes_(chunk_bytes), path_(path), impl_(std::make_unique<Impl>()) {
  ZT_REQUIRE(!devices_.empty(), "Communicator: needs at least one device");
  const int n = world();
  for (int r = 0; r < n; ++r) {
    ZT_REQUIRE(devices_[r] != nullptr, "Communicator: device of rank ", r, " is null");
    for (int q = 0; q < r; ++q)
      ZT_REQUIRE(devices_[q] != devices_[r], "Communicator: ", devices_[r]->name(),
                 " is given twice (ranks ", q, " and ", r, "); every rank needs its own device");
    ZT_REQUIRE(devices_[r]->backend() == devices_[0]->backend(), "Communicator: ",
               devices_[0]->name(), " and ", devices_[r]->name(), " use different backends");
  }
  // Peer access is not required: copy_peer stages through host memory where GPUs lack it, and
  // groups without it in every direction take the staged ring (CommGroupState::peer_access).

  // The probe runs only where a reduction can take the staged path: elsewhere it would time a path
  // no collective of this communicator takes.
  const bool probe = chunk_bytes_ == kProbeChunk && n > 1 && !reduces_directly(devices_, path_);
  if (chunk_bytes_ == kProbeChunk) chunk_bytes_ = kDefaultChunkBytes;
  // A chunk holds at least one element of any type.
  impl_->slot_bytes = slot_bytes_for(chunk_bytes_);
  impl_->ranks.resize(static_cast<size_t>(n));
  impl_->posted = std::vector<Impl::Posted>(static_cast<size_t>(n));  // not movable: no resize
  for (int r = 0; r < n; ++r) {
    Impl::Rank& rk = impl_->ranks[r];
    Device& d = *devices_[r];
    rk.producer = d.create_event();
    rk.ready = d.create_event();
    rk.sent = d.create_event();
    rk.done = d.create_event();
    rk.stepped = d.create_event();
    for (auto& e : rk.slot_free) e = d.create_event();
  }
  std::vector<int> all(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) all[static_cast<size_t>(r)] = r;
  impl_->world = group(all).state_;
  impl_->world->is_world = true;
  if (probe) probe_chunking();
}

// Receive buffers are freed into their pool, tied to the comm stream they were allocated on. Every
// peer write into one is followed, on that stream, by a wait for it and the reduction that reads
// it, so reuse of the memory on that stream is ordered after all of it (no host wait needed).
Communicator::~Communicator() = default;

CommGroup Communicator::group(std::vector<int> ranks) {
  ZT_REQUIRE(!ranks.empty(), "Communicator::group: a group needs at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i) {
    ZT_REQUIRE(ranks[i] >= 0 && ranks[i] < world(), "Communicator::group: rank ", ranks[i],
               " of ", ranks_name(ranks), " is not a rank of a ", world(), "-rank communicator");
    for (size_t j = 0; j < i; ++j)
      ZT_REQUIRE(ranks[j] != ranks[i], "Communicator::group: rank ", ranks[i], " appears twice in ",
                 ranks_name(ranks), "; every member must be a different rank");
  }
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  auto& slot = impl_->groups[ranks];
  if (!slot) {
    auto g = std::make_unique<CommGroupState>();
    g->name = ranks_name(ranks);
    g->counters.resize(ranks.size());
    g->arrivals.resize(ranks.size());
    g->peer_access = true;
    for (int a : ranks)
      for (int b : ranks)
        if (a != b && !devices_[static_cast<size_t>(a)]->can_access_peer(*devices_[static_cast<size_t>(b)]))
          g->peer_access = false;
    g->members = std::move(ranks);
    slot = std::move(g);
  }
  return CommGroup(this, slot.get());
}

CommGroup Communicator::world_group() { return CommGroup(this, impl_->world); }

// ---- groups ----------------------------------------------------------------------------------

const detail::CommGroupState& CommGroup::state() const {
  ZT_REQUIRE(state_ != nullptr, "CommGroup: an empty handle (get groups from Communicator::group)");
  return *state_;
}
int CommGroup::size() const { return static_cast<int>(state().members.size()); }
const std::vector<int>& CommGroup::ranks() const { return state().members; }
int CommGroup::index_of(int rank) const { return state().index_of(rank); }
const std::string& CommGroup::name() const { return state().name; }

void CommGroup::reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kReduceScatter, 0, full, producers);
}
void CommGroup::all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kAllGather, 0, full, producers);
}
void CommGroup::all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kAllReduce, 0, full, producers);
}
void CommGroup::broadcast(int root, const std::vector<TensorView>& bufs, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kBroadcast, root, bufs, producers);
}
void CommGroup::reduce_scatter(int rank, TensorView full, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kReduceScatter, 0, full, producer, tag);
}
void CommGroup::all_gather(int rank, TensorView full, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kAllGather, 0, full, producer, tag);
}
void CommGroup::all_reduce(int rank, TensorView full, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kAllReduce, 0, full, producer, tag);
}
void CommGroup::broadcast(int rank, int root, TensorView buf, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kBroadcast, root, buf, producer, tag);
}

CommCounters CommGroup::counters(int rank) const {
  const int pos = state().index_of(rank);
  ZT_REQUIRE(pos >= 0, "counters: rank ", rank, " is not a member of group ", state_->name);
  std::lock_guard<std::mutex> lock(comm_->impl_->enqueue_mu);
  return state_->counters[static_cast<size_t>(pos)];
}

// ---- completion and accounting ---------------------------------------------------------------

void Communicator::wait_done(int rank, Stream& consumer) {
  ZT_REQUIRE(rank >= 0 && rank < world(), "wait_done: rank ", rank, " is not a rank of a ",
             world(), "-rank communicator");
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  consumer.wait(*impl_->ranks[rank].done);
}

CommCounters Communicator::counters(int rank) const {
  ZT_REQUIRE(rank >= 0 && rank < world(), "counters: rank ", rank, " is not a rank of a ",
             world(), "-rank communicator");
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  return impl_->ranks[rank].counters;
}

void Communicator::reset_counters() {
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  for (auto& r : impl_->ranks) r.counters = CommCounters{};
}

}  // namespace zt
