// Point-to-point copies between ranks (see communicator.h): transfers, matched send/receive
// pairs, posted sends and their completion, all by the peer-copy rule.
#include "comm/communicator.h"

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "comm/communicator_impl.h"

namespace zt {

// ---- point-to-point --------------------------------------------------------------------------

namespace {

void check_transfer(const char* op, const std::vector<Device*>& devices, int src, const ConstTensorView& from,
                    int dst, const TensorView& to) {
  const int n = static_cast<int>(devices.size());
  ZT_REQUIRE(src >= 0 && src < n, op, ": rank ", src, " is not a rank of a ", n, "-rank communicator");
  ZT_REQUIRE(dst >= 0 && dst < n, op, ": rank ", dst, " is not a rank of a ", n, "-rank communicator");
  ZT_REQUIRE(src != dst, op, ": rank ", src, " cannot send to itself (use a copy on its own stream)");
  ZT_REQUIRE(from.dtype == to.dtype && from.numel() == to.numel(), op, ": rank ", src, " sends ",
             from.numel(), " x ", dtype_name(from.dtype), " but rank ", dst, " receives ", to.numel(),
             " x ", dtype_name(to.dtype), " (both sides need the same dtype and numel)");
  ZT_REQUIRE(from.numel() == 0 || (from.data != nullptr && from.device == devices[src]->index()),
             op, ": the send buffer of rank ", src, " is not on ", devices[src]->name());
  ZT_REQUIRE(to.numel() == 0 || (to.data != nullptr && to.device == devices[dst]->index()), op,
             ": the receive buffer of rank ", dst, " is not on ", devices[dst]->name());
}

void check_producer(const char* op, const std::vector<Device*>& devices, int rank, Stream* prod) {
  ZT_REQUIRE(prod == nullptr || &prod->device() == devices[rank], op, ": the producer stream of rank ",
             rank, " runs on ", prod ? prod->device().name() : "", " but rank ", rank, " is ",
             devices[rank]->name(), " (pass a stream of the rank's own device)");
}

}  // namespace

void Communicator::transfer(const std::vector<Transfer>& transfers, const std::vector<Stream*>& producers) {
  ZT_REQUIRE(producers.empty() || static_cast<int>(producers.size()) == world(), "transfer: got ",
             producers.size(), " producer streams for ", world(), " ranks (one per rank, or none)");
  for (int r = 0; r < static_cast<int>(producers.size()); ++r) check_producer("transfer", devices_, r, producers[r]);
  std::vector<Copy> copies;
  for (const Transfer& t : transfers) {
    check_transfer("transfer", devices_, t.src, t.from, t.dst, t.to);
    Copy c{t.src, t.dst, static_cast<const char*>(t.from.data), static_cast<char*>(t.to.data),
           static_cast<size_t>(t.from.numel()) * dtype_size(t.from.dtype),
           producers.empty() ? nullptr : producers[t.src], producers.empty() ? nullptr : producers[t.dst]};
    copies.push_back(c);
  }
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  impl_->enqueue_copies(devices_, copies);
}

// Enqueues copies by the peer-copy rule (see the notes at the top of the header), with enqueue_mu
// held. All records of `ready` before any copy, all copies before the receivers' waits on `sent`:
// so every wait captures a record enqueued before it (no cycle), and a later record of the same
// event only covers more work of the same stream.
void Communicator::Impl::enqueue_copies(const std::vector<Device*>& devices, const std::vector<Copy>& copies) {
  std::vector<char> involved(devices.size(), 0);
  const auto after_producer = [&](int r, Stream* prod) {
    Stream& comm = devices[r]->comm();
    if (prod != nullptr && prod != &comm) {
      prod->record(*ranks[r].producer);
      comm.wait(*ranks[r].producer);
    }
  };
  const auto source_stream = [&](const Copy& c) -> Stream& {
    return c.src_copied != nullptr ? link(devices, c.src, c.dst) : devices[c.src]->comm();
  };
  for (const Copy& c : copies) {
    if (c.src_posted != nullptr)
      source_stream(c).wait(*c.src_posted);
    else
      after_producer(c.src, c.src_producer);
    after_producer(c.dst, c.dst_producer);
    devices[c.dst]->comm().record(*ranks[c.dst].ready);
    involved[c.dst] = 1;
    if (c.src_copied == nullptr) involved[c.src] = 1;  // a posted send's side is its link stream
  }
  for (const Copy& c : copies) {
    Stream& comm = source_stream(c);
    if (c.bytes > 0) {
      comm.wait(*ranks[c.dst].ready);
      comm.copy_peer(*devices[c.dst], c.to, c.from, c.bytes);
      comm.record(*ranks[c.src].sent);
      if (c.src_copied != nullptr) {
        comm.record(*c.src_copied);
        comm.record(*link_of(devices, c.src, c.dst).copied);
      }
    }
    ranks[c.src].counters.bytes_sent += c.bytes;
    ranks[c.dst].counters.bytes_received += c.bytes;
    ++ranks[c.src].counters.transfers;
    ++ranks[c.dst].counters.transfers;
  }
  for (const Copy& c : copies)
    if (c.bytes > 0) devices[c.dst]->comm().wait(*ranks[c.src].sent);
  for (size_t r = 0; r < devices.size(); ++r)
    if (involved[r]) devices[r]->comm().record(*ranks[r].done);
}

void Communicator::send(int rank, int peer, ConstTensorView buf, Stream* producer) {
  P2POp op{true, rank, peer, TensorView{const_cast<void*>(buf.data), buf.dtype, buf.shape, buf.device}, producer};
  p2p_call(rank, &op, 1);
}

void Communicator::recv(int rank, int peer, TensorView buf, Stream* producer) {
  P2POp op{false, peer, rank, buf, producer};
  p2p_call(rank, &op, 1);
}

void Communicator::send_recv(int rank, int send_to, ConstTensorView send_buf, int recv_from,
                             TensorView recv_buf, Stream* producer) {
  P2POp ops[2] = {
      P2POp{true, rank, send_to, TensorView{const_cast<void*>(send_buf.data), send_buf.dtype, send_buf.shape, send_buf.device}, producer},
      P2POp{false, recv_from, rank, recv_buf, producer}};
  p2p_call(rank, ops, 2);
}

void Communicator::p2p_call(int rank, P2POp* ops, int count) {
  const int n = world();
  for (int k = 0; k < count; ++k) {
    const P2POp& op = ops[k];
    const char* name = op.is_send ? "send" : "recv";
    ZT_REQUIRE(rank >= 0 && rank < n, name, ": rank ", rank, " is not a rank of a ", n, "-rank communicator");
    const int peer = op.is_send ? op.dst : op.src;
    ZT_REQUIRE(peer >= 0 && peer < n, name, ": peer ", peer, " of rank ", rank, " is not a rank of a ", n,
               "-rank communicator");
    ZT_REQUIRE(peer != rank, name, ": rank ", rank, " cannot ", op.is_send ? "send to" : "receive from",
               " itself (use a copy on its own stream)");
    ZT_REQUIRE(op.buf.numel() == 0 || (op.buf.data != nullptr && op.buf.device == devices_[rank]->index()),
               name, ": the buffer of rank ", rank, " is not on ", devices_[rank]->name());
    check_producer(name, devices_, rank, op.producer);
  }
  std::optional<NvtxRange> range;
  if (ranges_enabled())
    range.emplace(NvtxCategory::kCollective,
                  collective_label(count == 2 ? "send_recv" : ops[0].is_send ? "send" : "recv", {},
                                   ops[0].buf.numel() * static_cast<int64_t>(dtype_size(ops[0].buf.dtype))),
                  devices_[rank]->index());
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.rv_mu);
  if (im.aborted)
    ZT_THROW(ErrorKind::kDevice, ops[0].is_send ? "send" : "recv", " on rank ", rank, " abandoned: ", im.abort_reason);
  for (int k = 0; k < count; ++k) {
    P2POp* op = &ops[k];
    const auto key = std::make_pair(op->src, op->dst);
    auto& others = op->is_send ? im.pending_recvs[key] : im.pending_sends[key];
    if (others.empty()) {
      (op->is_send ? im.pending_sends[key] : im.pending_recvs[key]).push_back(op);
      continue;
    }
    P2POp* other = others.front();
    others.pop_front();
    if (op->is_send)
      match(op, other);
    else
      match(other, op);
  }
  im.rv_cv.notify_all();
  const auto all_done = [&] {
    for (int k = 0; k < count; ++k)
      if (!ops[k].done) return false;
    return true;
  };
  im.rv_cv.wait(lock, [&] { return all_done() || im.aborted; });
  if (!all_done()) {  // aborted: withdraw what no peer matched, so nobody matches it later
    for (int k = 0; k < count; ++k) {
      if (ops[k].done) continue;
      const auto key = std::make_pair(ops[k].src, ops[k].dst);
      auto& q = ops[k].is_send ? im.pending_sends[key] : im.pending_recvs[key];
      q.erase(std::remove(q.begin(), q.end(), &ops[k]), q.end());
    }
    ZT_THROW(ErrorKind::kDevice, ops[0].is_send ? "send" : "recv", " on rank ", rank, " abandoned: ", im.abort_reason);
  }
  for (int k = 0; k < count; ++k)
    if (ops[k].error.set) ops[k].error.raise();
}

// Enqueues a matched pair's copy, with rv_mu held; errors go to both halves.
void Communicator::match(P2POp* s, P2POp* r) {
  Impl& im = *impl_;
  StoredError error;
  try {
    check_transfer("send/recv", devices_, s->src, s->buf, r->dst, r->buf);
    Copy c{s->src, r->dst, static_cast<const char*>(s->buf.data), static_cast<char*>(r->buf.data),
           static_cast<size_t>(s->buf.numel()) * dtype_size(s->buf.dtype), s->producer, r->producer};
    if (s->ticket != 0) {
      c.src_producer = nullptr;
      c.src_posted = s->event.get();
      c.src_copied = s->event.get();
    }
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);
    im.enqueue_copies(devices_, {c});
    s->copy_recorded = s->ticket != 0 && c.bytes > 0;
  } catch (...) {
    error.capture(std::current_exception());
  }
  s->error = r->error = error;
  s->done = r->done = true;
  if (s->ticket != 0 && !error.set) {
    Impl::Posted& p = im.posted[static_cast<size_t>(s->src)];
    p.completed.push_back(s->ticket);
    if (p.completed.size() > kMaxUnwaitedSends) im.forget(s->src, p.completed.front());
  }
}

// Drops a posted send's record (after wait_send, or when too many were never waited for).
void Communicator::Impl::forget(int rank, uint64_t ticket) {
  Posted& p = posted[static_cast<size_t>(rank)];
  const auto it = p.live.find(ticket);
  if (it == p.live.end()) return;
  const auto c = std::find(p.completed.begin(), p.completed.end(), ticket);
  if (c != p.completed.end()) p.completed.erase(c);
  p.free_events.push_back(std::move(it->second->event));
  p.live.erase(it);
}

uint64_t Communicator::isend(int rank, int peer, ConstTensorView buf, Stream* producer) {
  const int n = world();
  ZT_REQUIRE(rank >= 0 && rank < n, "isend: rank ", rank, " is not a rank of a ", n, "-rank communicator");
  ZT_REQUIRE(peer >= 0 && peer < n, "isend: peer ", peer, " of rank ", rank, " is not a rank of a ", n,
             "-rank communicator");
  ZT_REQUIRE(peer != rank, "isend: rank ", rank, " cannot send to itself (use a copy on its own stream)");
  ZT_REQUIRE(buf.numel() == 0 || (buf.data != nullptr && buf.device == devices_[rank]->index()),
             "isend: the buffer of rank ", rank, " is not on ", devices_[rank]->name());
  check_producer("isend", devices_, rank, producer);
  std::optional<NvtxRange> range;
  if (ranges_enabled())
    range.emplace(NvtxCategory::kCollective,
                  collective_label("isend", {}, buf.numel() * static_cast<int64_t>(dtype_size(buf.dtype))),
                  devices_[rank]->index());
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.rv_mu);
  if (im.aborted) ZT_THROW(ErrorKind::kDevice, "isend on rank ", rank, " abandoned: ", im.abort_reason);
  Impl::Posted& p = im.posted[static_cast<size_t>(rank)];
  auto op = std::make_unique<P2POp>(true, rank, peer,
                                    TensorView{const_cast<void*>(buf.data), buf.dtype, buf.shape, buf.device},
                                    nullptr);
  op->ticket = p.next_ticket++;
  if (p.free_events.empty()) {
    op->event = devices_[rank]->create_event();
  } else {
    op->event = std::move(p.free_events.back());
    p.free_events.pop_back();
  }
  // The copy is enqueued on the link stream later; the record of what it must follow is taken
  // now: at match time the producer may hold later work (even work that waits for this copy).
  {
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);  // other threads enqueue on comm
    (producer != nullptr ? *producer : devices_[rank]->comm()).record(*op->event);
  }
  P2POp* raw = op.get();
  const uint64_t ticket = raw->ticket;
  p.live.emplace(ticket, std::move(op));
  auto& recvs = im.pending_recvs[std::make_pair(rank, peer)];
  if (recvs.empty()) {
    im.pending_sends[std::make_pair(rank, peer)].push_back(raw);
    return ticket;
  }
  P2POp* r = recvs.front();
  recvs.pop_front();
  match(raw, r);
  lock.unlock();
  im.rv_cv.notify_all();
  return ticket;
}

void Communicator::wait_send(int rank, uint64_t ticket, Stream& consumer) {
  ZT_REQUIRE(rank >= 0 && rank < world(), "wait_send: rank ", rank, " is not a rank of a ", world(),
             "-rank communicator");
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.rv_mu);
  Impl::Posted& p = im.posted[static_cast<size_t>(rank)];
  ZT_REQUIRE(ticket >= 1 && ticket < p.next_ticket, "wait_send: ", ticket, " is not a ticket of rank ", rank,
             " (isend returns them; rank ", rank, " posted ", p.next_ticket - 1, " sends)");
  const auto it = p.live.find(ticket);
  if (it == p.live.end()) {
    // Waited for already, or forgotten: the newest copy of each of the rank's links covers it (a
    // superset). Not the rank's `sent`: its newest record may be on another link's stream or the
    // comm stream, which never waited for this copy.
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);
    for (auto& [key, l] : im.links)
      if (key.first == rank) consumer.wait(*l.copied);
    return;
  }
  P2POp* op = it->second.get();
  im.rv_cv.wait(lock, [&] { return op->done || im.aborted; });
  if (!op->done)
    ZT_THROW(ErrorKind::kDevice, "wait_send on rank ", rank, " (isend to rank ", op->dst, ") abandoned: ",
             im.abort_reason);
  if (op->error.set) {
    const StoredError error = op->error;
    im.forget(rank, ticket);
    error.raise();
  }
  if (op->copy_recorded) {
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);
    consumer.wait(*op->event);
  }
  im.forget(rank, ticket);
}

}  // namespace zt
