// Failure handling of the communicator: abort() releases every rank waiting in a rendezvous (a
// collective or a point-to-point match), which then throws; errors of a rendezvous are stored once
// (StoredError) and rethrown on every member's thread.
#include "comm/communicator.h"

#include <mutex>
#include <string>
#include "comm/communicator_impl.h"

namespace zt {

void Communicator::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(impl_->rv_mu);
    if (!impl_->aborted) impl_->abort_reason = why;
    impl_->aborted = true;
  }
  impl_->rv_cv.notify_all();
}

bool Communicator::aborted() const {
  std::lock_guard<std::mutex> lock(impl_->rv_mu);
  return impl_->aborted;
}

}  // namespace zt
