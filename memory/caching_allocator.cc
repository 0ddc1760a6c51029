// The per-device caching memory pool: segments from a RawAllocator, carved into blocks, cached
// on free and reused without going back to the raw allocator (cudaMalloc is slow and synchronizes).
//
// Design notes (the rules, in the manner of PyTorch's CUDACachingAllocator):
//
//  - Sizes. A request of n bytes becomes a block of round_size(n): a multiple of kMinBlockSize
//    (512), so every block start is 512-aligned within a 256-aligned segment. Requests up to
//    kSmallSize (1 MiB) are "small" and come from the small pool, whose segments are
//    kSmallBuffer (2 MiB) and pack many small requests. Larger requests come from the large
//    pool: a new segment is kLargeBuffer (20 MiB) for requests below kMinLargeAlloc (10 MiB),
//    and the request rounded up to kRoundLarge (2 MiB) above it. The two pools never mix, so
//    small short-lived blocks do not fragment the large segments.
//
//  - Blocks are tied to a stream. Every segment, and so every block in it, belongs to the stream
//    it was first allocated for, and a cached block is only handed out to a request on that same
//    stream. Work on one stream is ordered, so a block freed by the host is reusable on its own
//    stream at once: the next user's work queues behind the previous user's work.
//
//  - Reuse on another stream only after an event. When a block was used by another stream
//    (record_stream), free() records an event on each such stream and the block stays pending
//    until every event has completed; only then does it return to the pool. Pending events are
//    polled (never waited for) at the start of every allocate(), and by empty_cache().
//
//  - Best fit. Free blocks live in a set ordered by (stream, size, address); a request takes the
//    smallest free block of its stream that is large enough. A block is split when the remainder
//    is worth keeping: in the small pool when it is at least kMinBlockSize, in the large pool
//    only when it is more than kSmallSize (a smaller tail would only ever serve small requests,
//    which the large pool does not). The lower part is handed out; the tail stays cached.
//
//  - Coalescing. Blocks of a segment form an address-ordered list; a freed block merges with a
//    free neighbour on either side, so a segment whose blocks are all free is one block again.
//    The segment's first block is never deleted by a merge (the higher block is absorbed), so
//    Segment::head stays valid for the segment's lifetime.
//
//  - Out of memory: the fallback chain when the raw allocator returns nullptr is
//      1. wait for pending cross-stream frees (mutex released while waiting), retry the cache;
//      2. release every cached segment that holds no live block, retry the raw allocator;
//      3. for large requests, retry with a segment of just the request's size (no 20 MiB slack);
//      4. throw zt::Error(kOutOfMemory) with a report: device, request, allocated, reserved,
//         largest free block, the largest live allocations by tag, and what to do.
//
//  - Releasing a segment (empty_cache, OOM fallback) first synchronizes the segment's stream, as
//    cudaFree synchronizes the device: queued work may still use memory the host has freed. The
//    destructor does not (the device drains its streams before destroying its pool).
//
//  - Statistics: allocated/requested/active count blocks the caller holds (a block pending on
//    events is no longer allocated, but its segment is still reserved).
//
//  - Stream capture (runtime/stream.h, core/capture_rules.h): an allocation for a capturing
//    stream is refused, and a free of a block of a capturing stream fails that capture: a graph
//    bakes the addresses its work uses in, and the pool would hand the memory to someone else
//    while the graph may still be launched. Allocate before capturing and keep the memory for the
//    graph's lifetime. On a thread with a capture in progress (CUDA's thread-local capture mode),
//    the pool serves other streams from its cache only: a new segment (cudaMalloc) or a released
//    one (cudaFree) would fail the thread's captures, as CUDA does, and the pending cross-stream
//    events are not polled there (cudaEventQuery is refused too; the next allocation on another
//    thread, or after the capture, polls them).
//
//  - Threads: one mutex guards all state; it is never held while waiting for an event or a
//    stream. A cache hit does not call malloc (Block objects and container nodes are recycled).
#include "memory/caching_allocator.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "core/capture_rules.h"
#include "core/format.h"
#include "core/status.h"
#include "memory/pool_stream.h"

namespace zt {

namespace {

constexpr size_t kMinBlockSize = 512;             // every block size is a multiple of this
constexpr size_t kSmallSize = size_t{1} << 20;    // requests up to here use the small pool
constexpr size_t kSmallBuffer = size_t{2} << 20;  // small-pool segment size
constexpr size_t kLargeBuffer = size_t{20} << 20; // large-pool segment for requests < kMinLargeAlloc
constexpr size_t kMinLargeAlloc = size_t{10} << 20;
constexpr size_t kRoundLarge = size_t{2} << 20;   // large segments are multiples of this
// Larger requests cannot be rounded without overflow; no device has that much memory anyway.
constexpr size_t kMaxRequest = size_t{1} << 60;
constexpr int kReportTopTags = 5;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

size_t round_size(size_t bytes) { return bytes < kMinBlockSize ? kMinBlockSize : round_up(bytes, kMinBlockSize); }

// Size of the segment requested from the raw allocator for a block of `size` (already rounded).
size_t segment_size_for(size_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return round_up(size, kRoundLarge);
}

struct Segment;

enum class BlockState : uint8_t {
  kFree,       // in its pool's free set
  kAllocated,  // held by a caller (in Impl::live)
  kPending,    // freed by the caller, waiting for events of other streams (in no set)
};

struct Block {
  char* ptr = nullptr;
  size_t size = 0;  // bytes of the block (a multiple of kMinBlockSize)
  PoolStream* stream = nullptr;
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address-ordered neighbours within the segment
  Block* next = nullptr;
  BlockState state = BlockState::kFree;
  size_t requested = 0;        // kAllocated: bytes the caller asked for
  const char* tag = nullptr;   // kAllocated: caller's label, for OOM reports
  std::vector<PoolStream*> stream_uses;  // kAllocated: other streams passed to record_stream()
  int event_count = 0;         // kPending: events not yet completed
};

struct Segment {
  char* base = nullptr;
  size_t size = 0;
  PoolStream* stream = nullptr;  // every block of the segment belongs to this stream
  bool small = false;    // which pool its blocks belong to
  Block* head = nullptr; // block at `base`; stable (merges absorb the higher block)
};

// Best-fit order: a lower_bound on (stream, size, nullptr) finds the smallest large-enough block
// of that stream.
struct BlockLess {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return std::less<PoolStream*>()(a->stream, b->stream);
    if (a->size != b->size) return a->size < b->size;
    return std::less<char*>()(a->ptr, b->ptr);
  }
};
using BlockSet = std::set<Block*, BlockLess>;
using LiveMap = std::unordered_map<const void*, Block*>;

}  // namespace

size_t pool_rounded_size(size_t bytes) { return bytes == 0 ? 0 : round_size(bytes); }
bool pool_is_small(size_t rounded_bytes) { return rounded_bytes <= kSmallSize; }
size_t pool_small_segment_bytes() { return kSmallBuffer; }
size_t pool_large_segment_bytes(size_t rounded_bytes) { return round_up(rounded_bytes, kRoundLarge); }

struct CachingAllocator::Impl {
  Impl(const std::string& name, RawAllocator& raw_allocator) : device_name(name), raw(raw_allocator) {}

  struct PendingEvent {
    std::shared_ptr<PoolEvent> event;  // shared: an OOM wait uses it with the mutex released
    Block* block;
  };

  const std::string& device_name;
  RawAllocator& raw;

  mutable std::mutex mu;  // guards everything below
  BlockSet small_free;
  BlockSet large_free;
  LiveMap live;  // kAllocated blocks by address
  std::map<char*, std::unique_ptr<Segment>> segments;
  std::vector<PendingEvent> pending;
  MemoryStats stats;

  // A cache hit must not call malloc: Block objects and the nodes of the free sets and of `live`
  // are recycled (a few dozen at most are kept).
  static constexpr size_t kMaxSpare = 64;
  std::vector<Block*> spare_blocks;
  std::vector<BlockSet::node_type> spare_set_nodes;
  std::vector<LiveMap::node_type> spare_live_nodes;

  Block* make_block() {
    if (spare_blocks.empty()) return new Block;
    Block* b = spare_blocks.back();
    spare_blocks.pop_back();
    *b = Block{};
    return b;
  }
  void drop_block(Block* b) {
    if (spare_blocks.size() < kMaxSpare) {
      spare_blocks.push_back(b);
    } else {
      delete b;
    }
  }
  void keep_node(BlockSet::node_type&& node) {
    if (spare_set_nodes.size() < kMaxSpare) spare_set_nodes.push_back(std::move(node));
  }
  // Removes b from its pool; b's key (stream, size, ptr) must be unchanged since it was inserted.
  void pool_erase(Block* b) { keep_node(pool_of(b).extract(b)); }
  void pool_insert(Block* b) {
    if (spare_set_nodes.empty()) {
      pool_of(b).insert(b);
      return;
    }
    BlockSet::node_type node = std::move(spare_set_nodes.back());
    spare_set_nodes.pop_back();
    node.value() = b;
    pool_of(b).insert(std::move(node));
  }
  void live_insert(Block* b) {
    if (spare_live_nodes.empty()) {
      live.emplace(b->ptr, b);
      return;
    }
    LiveMap::node_type node = std::move(spare_live_nodes.back());
    spare_live_nodes.pop_back();
    node.key() = b->ptr;
    node.mapped() = b;
    live.insert(std::move(node));
  }
  void live_erase(LiveMap::const_iterator it) {
    LiveMap::node_type node = live.extract(it);
    if (spare_live_nodes.size() < kMaxSpare) spare_live_nodes.push_back(std::move(node));
  }

  BlockSet& pool_of(const Block* b) { return b->segment->small ? small_free : large_free; }

  LiveMap::const_iterator find_live_it(const void* ptr, const char* op) const {
    auto it = live.find(ptr);
    if (it == live.end()) {
      ZT_THROW(ErrorKind::kInternal, op, " of pointer ", ptr, " which is not a live allocation of the ",
               device_name, " memory pool (double free, or memory from another pool)");
    }
    return it;
  }
  Block* find_live(const void* ptr, const char* op) const { return find_live_it(ptr, op)->second; }

  Block* take_free_block(BlockSet& pool, PoolStream& stream, size_t size) {
    Block key;
    key.stream = &stream;
    key.size = size;
    auto it = pool.lower_bound(&key);
    if (it == pool.end() || (*it)->stream != &stream) return nullptr;
    Block* b = *it;
    keep_node(pool.extract(it));
    return b;
  }

  Block* new_segment(char* base, size_t size, bool small, PoolStream& stream) {
    auto seg = std::make_unique<Segment>();
    seg->base = base;
    seg->size = size;
    seg->small = small;
    seg->stream = &stream;
    Block* head = make_block();
    head->ptr = base;
    head->size = size;
    head->stream = &stream;
    head->segment = seg.get();
    seg->head = head;
    segments.emplace(base, std::move(seg));
    stats.reserved_bytes += size;
    stats.peak_reserved_bytes = std::max(stats.peak_reserved_bytes, stats.reserved_bytes);
    stats.num_raw_allocs++;
    stats.segments++;
    return head;
  }

  // Returns a block to its pool, merging it with free neighbours.
  void free_block(Block* b) {
    b->state = BlockState::kFree;
    b->requested = 0;
    b->tag = nullptr;
    b->stream_uses.clear();
    b->event_count = 0;
    if (Block* prev = b->prev; prev && prev->state == BlockState::kFree) {
      pool_erase(prev);  // before its size (part of the key) changes
      prev->size += b->size;
      prev->next = b->next;
      if (b->next) b->next->prev = prev;
      drop_block(b);
      b = prev;
    }
    if (Block* next = b->next; next && next->state == BlockState::kFree) {
      pool_erase(next);
      b->size += next->size;
      b->next = next->next;
      if (next->next) next->next->prev = b;
      drop_block(next);
    }
    pool_insert(b);
  }

  // Frees the blocks whose cross-stream events have all completed. Never blocks.
  void process_events() {
    if (this_thread_captures()) return;  // cudaEventQuery would fail the capture (design notes)
    for (size_t i = 0; i < pending.size();) {
      if (!pending[i].event->query()) {
        ++i;
        continue;
      }
      Block* b = pending[i].block;
      pending[i] = std::move(pending.back());
      pending.pop_back();
      if (--b->event_count == 0) free_block(b);
    }
  }

  // Waits for every pending event with the mutex released, then frees what completed.
  void synchronize_pending(std::unique_lock<std::mutex>& lock) {
    std::vector<std::shared_ptr<PoolEvent>> events;
    events.reserve(pending.size());
    for (auto& p : pending) events.push_back(p.event);
    lock.unlock();
    for (auto& e : events) e->synchronize();
    lock.lock();
    process_events();
  }

  // Releases every segment whose blocks are all free (it is then a single free block). Work
  // queued earlier on the segment's stream may still touch the memory, so that stream is
  // synchronized first, with the mutex released (cudaFree synchronizes the device for the same
  // reason; on the CPU backend a freed segment would otherwise be a use-after-free).
  void release_cached_segments(std::unique_lock<std::mutex>& lock) {
    if (this_thread_captures()) [[unlikely]] {
      for (const auto& [base, seg] : segments)
        if (seg->head->state == BlockState::kFree && seg->head->next == nullptr) {
          lock.unlock();
          refuse_on_capturing_thread(CaptureRule::kRawFree, "the pool of " + device_name + " releasing its cached "
                                                            "segments to '" + raw.name() + "'");
        }
      return;
    }
    std::vector<std::unique_ptr<Segment>> doomed;
    for (auto it = segments.begin(); it != segments.end();) {
      Block* head = it->second->head;
      if (head->state != BlockState::kFree || head->next != nullptr) {
        ++it;
        continue;
      }
      pool_erase(head);
      drop_block(head);
      it->second->head = nullptr;
      doomed.push_back(std::move(it->second));
      it = segments.erase(it);
    }
    if (doomed.empty()) return;
    std::vector<PoolStream*> streams;
    for (auto& seg : doomed) {
      if (std::find(streams.begin(), streams.end(), seg->stream) == streams.end()) streams.push_back(seg->stream);
    }
    lock.unlock();
    for (PoolStream* s : streams) {
      try {
        s->synchronize();
      } catch (...) {
        // A sticky device error: it resurfaces at the caller's next synchronize; the memory is
        // released regardless (failed work does not run).
      }
    }
    lock.lock();
    for (auto& seg : doomed) {
      raw.deallocate(seg->base, seg->size);
      stats.reserved_bytes -= seg->size;
      stats.num_raw_frees++;
      stats.segments--;
    }
  }

  size_t largest_free() const {
    size_t best = 0;
    for (const Block* b : small_free) best = std::max(best, b->size);
    for (const Block* b : large_free) best = std::max(best, b->size);
    return best;
  }

  [[noreturn]] void throw_oom(size_t bytes, PoolStream& stream, const char* tag) {
    stats.num_ooms++;
    // Largest live allocations, summed by tag.
    std::map<std::string, std::pair<size_t, size_t>> by_tag;  // tag -> (bytes, blocks)
    for (const auto& [ptr, b] : live) {
      auto& entry = by_tag[b->tag ? b->tag : "untagged"];
      entry.first += b->size;
      entry.second++;
    }
    std::vector<std::pair<std::string, std::pair<size_t, size_t>>> top(by_tag.begin(), by_tag.end());
    std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) {
      return a.second.first != b.second.first ? a.second.first > b.second.first : a.first < b.first;
    });
    if (top.size() > static_cast<size_t>(kReportTopTags)) top.resize(kReportTopTags);

    std::ostringstream os;
    os << device_name << " is out of memory: tried to allocate " << format_bytes(bytes) << " (" << bytes
       << " bytes) for '" << tag << "' on stream " << stream.id() << ". The pool has "
       << format_bytes(stats.allocated_bytes) << " allocated in " << stats.active_blocks << " blocks and "
       << format_bytes(stats.reserved_bytes) << " reserved in " << stats.segments
       << " segments; the largest free cached block is " << format_bytes(largest_free())
       << ", and the '" << raw.name() << "' allocator could not provide more even after the cache was released.";
    if (!top.empty()) {
      os << " Largest live allocations by tag:";
      for (size_t i = 0; i < top.size(); ++i) {
        os << (i ? ", " : " ") << top[i].first << " " << format_bytes(top[i].second.first) << " ("
           << top[i].second.second << (top[i].second.second == 1 ? " block)" : " blocks)");
      }
      os << ".";
    }
    os << " To fix: lower the batch size, sequence length or model size, shard more state (a higher ZeRO "
          "stage or more devices), or give the device more memory; `zerotrain plan` with the same flags "
          "shows what each device needs and the cheapest change that fits.";
    ZT_THROW(ErrorKind::kOutOfMemory, os.str());
  }

  // Finds or creates a block of at least `size` bytes for `stream`; runs the OOM fallback chain.
  // `hit` tells whether cached memory served the request.
  Block* get_block(std::unique_lock<std::mutex>& lock, size_t bytes, size_t size, PoolStream& stream,
                   const char* tag, bool& hit) {
    const bool small = size <= kSmallSize;
    BlockSet& pool = small ? small_free : large_free;
    hit = true;
    if (Block* b = take_free_block(pool, stream, size)) return b;

    const size_t seg_size = segment_size_for(size);
    if (this_thread_captures()) [[unlikely]] {
      lock.unlock();
      refuse_on_capturing_thread(CaptureRule::kRawAllocation,
                                 "the pool of " + device_name + " needs a new segment of " + std::to_string(seg_size) +
                                     " bytes from '" + raw.name() + "' for '" + tag + "' on stream " +
                                     std::to_string(stream.id()) + "; allocate it before the capture");
    }
    char* base = static_cast<char*>(raw.allocate(seg_size));
    if (!base && !pending.empty()) {
      synchronize_pending(lock);  // other threads may run meanwhile: look in the cache again
      if (Block* b = take_free_block(pool, stream, size)) return b;
      base = static_cast<char*>(raw.allocate(seg_size));
    }
    if (!base) {
      release_cached_segments(lock);  // releases the mutex while it waits: look in the cache again
      if (Block* b = take_free_block(pool, stream, size)) return b;
      base = static_cast<char*>(raw.allocate(seg_size));
    }
    size_t got = seg_size;
    if (!base && !small && round_up(size, kRoundLarge) < seg_size) {
      got = round_up(size, kRoundLarge);
      base = static_cast<char*>(raw.allocate(got));
    }
    if (!base) throw_oom(bytes, stream, tag);
    hit = false;
    return new_segment(base, got, small, stream);
  }

  void* allocate(size_t bytes, PoolStream& stream, const char* tag) {
    if (stream.capturing()) [[unlikely]] {
      std::string why = capture_refusal(CaptureRule::kPoolForCapturingStream,
                                        "the pool of " + device_name + " was asked for " + std::to_string(bytes) +
                                            " bytes for '" + tag + "' on stream " + std::to_string(stream.id()) +
                                            "; allocate before the capture");
      stream.invalidate_capture(why);
      throw CaptureError(CaptureRule::kPoolForCapturingStream, std::move(why));
    }
    std::unique_lock<std::mutex> lock(mu);
    process_events();
    if (bytes > kMaxRequest) throw_oom(bytes, stream, tag);
    const size_t size = round_size(bytes);
    bool hit = false;
    Block* b = get_block(lock, bytes, size, stream, tag, hit);

    const size_t remaining = b->size - size;
    if (b->segment->small ? remaining >= kMinBlockSize : remaining > kSmallSize) {
      Block* rest = make_block();
      rest->ptr = b->ptr + size;
      rest->size = remaining;
      rest->stream = b->stream;
      rest->segment = b->segment;
      rest->prev = b;
      rest->next = b->next;
      if (b->next) b->next->prev = rest;
      b->next = rest;
      b->size = size;
      pool_insert(rest);
    }
    b->state = BlockState::kAllocated;
    b->requested = bytes;
    b->tag = tag;
    live_insert(b);

    stats.allocated_bytes += b->size;
    stats.peak_allocated_bytes = std::max(stats.peak_allocated_bytes, stats.allocated_bytes);
    stats.requested_bytes += bytes;
    stats.num_allocs++;
    if (hit) stats.num_cache_hits++;
    stats.active_blocks++;
    return b->ptr;
  }

  void free(void* ptr) {
    Block* b = nullptr;
    std::vector<PoolStream*> uses;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = find_live_it(ptr, "free");
      b = it->second;
      if (b->stream->capturing()) [[unlikely]]
        b->stream->invalidate_capture(capture_refusal(
            CaptureRule::kPoolForCapturingStream, "the pool of " + device_name + " freed a block of '" +
                                                      std::string(b->tag ? b->tag : "untagged") + "' of stream " +
                                                      std::to_string(b->stream->id()) + "; free it after the capture"));
      live_erase(it);
      stats.allocated_bytes -= b->size;
      stats.requested_bytes -= b->requested;
      stats.active_blocks--;
      stats.num_frees++;
      if (b->stream_uses.empty()) {
        free_block(b);
        return;
      }
      // Pending and in no set: nothing else touches the block until its events are queued.
      uses = std::move(b->stream_uses);
      b->stream_uses.clear();
      b->state = BlockState::kPending;
      b->event_count = static_cast<int>(uses.size());
    }
    // Event creation and recording happen outside the mutex (on CUDA they are driver calls).
    std::vector<PendingEvent> events;
    events.reserve(uses.size());
    for (PoolStream* s : uses) {
      try {
        events.push_back(PendingEvent{s->record_new_event(), b});
      } catch (...) {
        // The stream's device failed: after a sticky CUDA error every later call, event creation
        // included, fails. No event can say when that stream is done with the block, so it stays
        // pending (event_count never reaches 0: never reused) until release_all returns its
        // segment. Not rethrown: free() runs in destructors (DeviceBuffer, a World torn down
        // after the failure), where an exception would be std::terminate.
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    for (auto& e : events) pending.push_back(std::move(e));
  }

  // Teardown: waits for pending events, then returns every segment to the raw allocator.
  void release_all() {
    for (auto& p : pending) {
      try {
        p.event->synchronize();
      } catch (...) {
        // A failed device: its memory is released regardless.
      }
    }
    pending.clear();
    for (auto& [base, seg] : segments) {
      for (Block* b = seg->head; b != nullptr;) {
        Block* next = b->next;
        delete b;
        b = next;
      }
      raw.deallocate(seg->base, seg->size);
    }
    segments.clear();
    for (Block* b : spare_blocks) delete b;
    spare_blocks.clear();
    small_free.clear();
    large_free.clear();
    live.clear();
  }
};

CachingAllocator::CachingAllocator(std::string device_name, std::unique_ptr<RawAllocator> raw)
    : device_name_(std::move(device_name)), raw_(std::move(raw)) {
  ZT_CHECK(raw_ != nullptr, "memory pool of ", device_name_, " needs a raw allocator");
  impl_ = std::make_unique<Impl>(device_name_, *raw_);
}

CachingAllocator::~CachingAllocator() {
  if (impl_) impl_->release_all();
}

void* CachingAllocator::allocate(size_t bytes, PoolStream& stream, const char* tag) {
  if (bytes == 0) return nullptr;
  return impl_->allocate(bytes, stream, tag ? tag : "untagged");
}

void CachingAllocator::free(void* ptr) {
  if (ptr == nullptr) return;
  impl_->free(ptr);
}

void CachingAllocator::record_stream(void* ptr, PoolStream& stream) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  Block* b = impl_->find_live(ptr, "record_stream");
  if (&stream == b->stream) return;
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), &stream) == b->stream_uses.end()) {
    b->stream_uses.push_back(&stream);
  }
}

void CachingAllocator::empty_cache() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->process_events();
  impl_->release_cached_segments(lock);
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats.peak_allocated_bytes = impl_->stats.allocated_bytes;
  impl_->stats.peak_reserved_bytes = impl_->stats.reserved_bytes;
}

size_t CachingAllocator::block_size(void* ptr) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->find_live(ptr, "block_size")->size;
}

size_t CachingAllocator::largest_free_block() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->largest_free();
}

// ---- DeviceBuffer -----------------------------------------------------------

DeviceBuffer::DeviceBuffer(CachingAllocator& pool, size_t bytes, PoolStream& stream, const char* tag)
    : pool_(&pool), ptr_(pool.allocate(bytes, stream, tag)), bytes_(bytes) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = std::exchange(o.pool_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

DeviceBuffer DeviceBuffer::borrow(void* p, size_t bytes) {
  DeviceBuffer b;
  b.ptr_ = p;
  b.bytes_ = bytes;
  return b;
}

void DeviceBuffer::reset() {
  if (ptr_ != nullptr && pool_ != nullptr) pool_->free(ptr_);
  pool_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace zt
