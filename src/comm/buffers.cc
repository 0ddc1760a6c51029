// The communicator's receive buffers and their planning: whether reductions read peers directly
// (no buffers), the bytes a rank's receive slots take, and how many it uses.
#include "comm/communicator.h"

#include <mutex>
#include <vector>

#include "core/status.h"
#include "kernels/op_table.h"
#include "comm/communicator_impl.h"

namespace zt {

bool Communicator::reduces_directly(const std::vector<Device*>& devices, CommPath path) {
  if (path != CommPath::kAuto || devices.empty()) return false;
  const OpTable* table = op_table(devices[0]->backend());
  if (table == nullptr || !table->has_entry(OpId::kAccumulatePeer)) return false;
  for (const Device* a : devices)
    for (const Device* b : devices)
      if (a != b && !a->can_access_peer(*b)) return false;
  return true;
}

size_t Communicator::planned_buffer_bytes(int world, size_t chunk_bytes) {
  if (chunk_bytes == kProbeChunk) return world > 1 ? kRecvBudgetBytes : 0;  // every choice holds the budget
  return world > 1 ? static_cast<size_t>(kRecvSlots) * slot_bytes_for(chunk_bytes) : 0;
}

int Communicator::recv_slots() const {
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  return impl_->recv_slots;
}
size_t Communicator::buffer_bytes(int rank) const {
  ZT_REQUIRE(rank >= 0 && rank < world(), "buffer_bytes: rank ", rank, " is not a rank of a ", world(),
             "-rank communicator");
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  size_t n = 0;
  for (const auto& slot : impl_->ranks[rank].slots) n += slot.size();
  return n;
}

}  // namespace zt
