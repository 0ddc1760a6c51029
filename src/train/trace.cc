// TraceRecorder: collects stream tasks, host ranges and counters; writes trace-event JSON.
#include "train/trace.h"

#include "core/files.h"

#include <algorithm>
#include <charconv>
#include <fstream>

#include "core/status.h"
#include "runtime/runtime.h"

namespace zt {

std::pair<int, int> parse_step_range(std::string_view text, int steps) {
  const size_t colon = text.find(':');
  int a = 0, b = 0;
  bool ok = colon != std::string_view::npos;
  if (ok) {
    const std::string_view l = text.substr(0, colon), r = text.substr(colon + 1);
    const auto pa = std::from_chars(l.data(), l.data() + l.size(), a);
    const auto pb = std::from_chars(r.data(), r.data() + r.size(), b);
    ok = !l.empty() && !r.empty() && pa.ec == std::errc{} && pa.ptr == l.data() + l.size() && pb.ec == std::errc{} &&
         pb.ptr == r.data() + r.size();
  }
  if (!ok && colon != std::string_view::npos) {
    // Digits only, yet unparsed: beyond int (steps are 32-bit counts), which is the real reason.
    const std::string_view l = text.substr(0, colon), r = text.substr(colon + 1);
    const auto digits = [](std::string_view v) {
      return !v.empty() && v.find_first_not_of("0123456789") == std::string_view::npos;
    };
    ZT_REQUIRE(!(digits(l) && digits(r)), "--profile-steps '", text, "' has a step above 2147483647 (steps are "
               "32-bit counts); give steps of the run, such as 10:12");
  }
  ZT_REQUIRE(ok, "--profile-steps '", text, "' must be FIRST:LAST, two step numbers such as 10:12");
  ZT_REQUIRE(a >= 1 && a <= b && b <= steps, "--profile-steps ", a, ":", b, " must satisfy 1 <= FIRST <= LAST <= ",
             steps, " (the run's steps)");
  return {a, b};
}

TraceRecorder::TraceRecorder() {
  previous_sink_ = set_range_sink(this);
}

TraceRecorder::~TraceRecorder() {
  set_range_sink(previous_sink_);
}

void TraceRecorder::on_task(int device, int stream, const char* name, Clock::time_point start, Clock::time_point end) {
  const double ts = us(start), te = us(end);
  {
    std::lock_guard<std::mutex> lock(mu_);
    slices_.push_back(Slice{device, stream, name, "stream", ts, te - ts});
  }
}

void TraceRecorder::push(NvtxCategory category, std::string_view name, int device) {
  const double ts = us(Clock::now());
  {
    std::lock_guard<std::mutex> lock(mu_);
    open_[std::this_thread::get_id()].push_back(Open{category, std::string(name), device, ts});
  }
  if (previous_sink_) previous_sink_->push(category, name, device);
}

void TraceRecorder::pop() {
  const double te = us(Clock::now());
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(std::this_thread::get_id());
    if (it != open_.end() && !it->second.empty()) {
      Open o = std::move(it->second.back());
      it->second.pop_back();
      if (it->second.empty()) open_.erase(it);
      const int tid = o.category == NvtxCategory::kTensorParallel ? kTensorTid : kHostTid;
      slices_.push_back(Slice{o.device >= 0 ? o.device : kHostPid, tid, std::move(o.name),
                              nvtx_category_name(o.category), o.ts, te - o.ts});
    }
  }
  if (previous_sink_) previous_sink_->pop();
}

void TraceRecorder::add_slice(int device, int stream, std::string name, const char* category, double start_us,
                              double end_us, Clock::time_point origin) {
  const double shift = us(origin);
  std::lock_guard<std::mutex> lock(mu_);
  slices_.push_back(Slice{device, stream, std::move(name), category, start_us + shift, end_us - start_us});
}

void TraceRecorder::add_counter(int device, const std::string& name, double value) {
  const double ts = us(Clock::now());
  std::lock_guard<std::mutex> lock(mu_);
  counters_.push_back(Counter{device, name, ts, value});
}

nlohmann::json TraceRecorder::to_json(const std::vector<std::string>& device_names) const {
  std::vector<Slice> slices;
  std::vector<Counter> counters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slices = slices_;
    counters = counters_;
  }
  // Per track in time order; an enclosing range (same start, longer) before what it encloses.
  std::stable_sort(slices.begin(), slices.end(), [](const Slice& a, const Slice& b) {
    if (a.pid != b.pid) return a.pid < b.pid;
    if (a.tid != b.tid) return a.tid < b.tid;
    if (a.ts != b.ts) return a.ts < b.ts;
    return a.dur > b.dur;
  });
  std::stable_sort(counters.begin(), counters.end(), [](const Counter& a, const Counter& b) {
    if (a.pid != b.pid) return a.pid < b.pid;
    if (a.name != b.name) return a.name < b.name;
    return a.ts < b.ts;
  });
  nlohmann::json events = nlohmann::json::array();
  std::map<int, std::vector<int>> tracks;  // pid -> tids seen
  for (const Slice& s : slices) {
    auto& tids = tracks[s.pid];
    if (std::find(tids.begin(), tids.end(), s.tid) == tids.end()) tids.push_back(s.tid);
  }
  for (const Counter& c : counters) tracks[c.pid];
  for (const auto& [pid, tids] : tracks) {
    std::string pname = pid == kHostPid ? "host"
                        : pid >= 0 && pid < static_cast<int>(device_names.size()) ? device_names[static_cast<size_t>(pid)]
                                                                                  : "device " + std::to_string(pid);
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", pname}}}});
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"sort_index", pid}}}});
    for (int tid : tids) {
      const std::string tname = tid == kHostTid     ? "host ranges"
                                : tid == kTensorTid ? "tensor collectives"
                                : tid == kPipelineTid ? "pipeline F/B/W"
                                : tid == 0          ? "compute stream"
                                : tid == 1          ? "comm stream"
                                                    : "stream " + std::to_string(tid);
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", tname}}}});
      events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"sort_index", tid}}}});
    }
  }
  for (const Slice& s : slices)
    events.push_back({{"name", s.name}, {"cat", s.category}, {"ph", "X"}, {"ts", s.ts}, {"dur", std::max(0.0, s.dur)},
                      {"pid", s.pid}, {"tid", s.tid}});
  for (const Counter& c : counters)
    events.push_back({{"name", c.name}, {"ph", "C"}, {"ts", c.ts}, {"pid", c.pid}, {"tid", 0}, {"args", {{"bytes", c.value}}}});
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
}

void TraceRecorder::write(const std::string& path, const std::vector<std::string>& device_names) const {
  write_file_atomic(path, to_json(device_names).dump() + "\n", "--trace file");
}

}  // namespace zt
