// The alignment invariant that carries ZeroTrain's bitwise promises onto a GPU: every GEMM, LM head,
// attention and classifier call of a training run sees its operands at the same addresses modulo
// 256 bytes at every ZeRO stage, with and without --cuda-graphs, recomputation and offload.
//
// Why it matters there and not here: cuBLASLt picks its algorithm from the operands' alignments
// (kernels/cuda/lt_matmul.cu tells the heuristic each pointer's alignment up to 256 bytes, and the
// algorithm cache is keyed by them), cuDNN's SDPA graphs check 16-byte alignment at execute, and the
// fused classifier moves a row as 128-bit packs only when the row starts 16-byte aligned (another
// summation order). So two modes whose operands sat at different offsets could sum the same GEMM in
// another order on a GPU while the CPU backend (OpenBLAS, alignment-blind) gives them the same bits.
// What keeps them equal is shared code, the same on both backends: pool blocks at 512-byte multiples
// of >= 256-byte-aligned segments (memory/caching_allocator.cc; cudaMalloc aligns to 256), workspace
// buffers at 256-byte multiples (model/model.h WorkspaceArena), the ZeRO transient arena's offsets
// at pool-rounded sizes (zero/visit_plan.cc), one pool block per block buffer, and each parameter at
// its fixed offset in its block (model/layout.h). This test records the addresses the CPU op table
// is called with and holds them to that.
//
// And with --cuda-graphs on, no such call is first met inside a capture: each is issued eagerly on
// its stream before (the warm-up micro-batch), so on a GPU cuBLASLt's heuristic and cuDNN's plan
// builds run outside captures, where a failure is a real refusal (CUDA 13.3's cuBLASLt fails the
// heuristic on a capturing stream, vllm.cpp#1732; lt_matmul.cu and cudnn_attention.cc fail the
// capture then, rather than fall back to the plain cuBLAS path or the tiled attention, whose bits
// are not the eager run's; --cuda-graphs auto then runs eagerly).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "sanitizer.h"
#include "test_util.h"
#include "kernels/matmul_types.h"
#include "kernels/op_table.h"
#include "train/trainer.h"

namespace zt {
namespace {

// Per call signature (op, sizes, dtypes, flags): the distinct tuples of its pointers' addresses
// modulo 256 (-1: nullptr) over every call of a run, on every device.
using Alignments = std::map<std::string, std::set<std::vector<int>>>;

struct Recorder {
  std::mutex mu;
  Alignments seen;
  // Per stream, the calls (signature and alignments) issued outside a capture so far, and the
  // calls a capture issued before any eager issue of the same call on that stream.
  std::set<std::tuple<const Stream*, std::string, std::vector<int>>> eager;
  std::vector<std::string> first_in_capture;
  int64_t captured = 0;  // calls issued inside a capture
  OpTable original;  // the CPU table the recording entries forward to
};
Recorder& recorder() {
  static Recorder r;
  return r;
}

struct Call {
  std::string signature;
  std::vector<int> alignments;
};
template <typename T>
void describe(Call& c, T* p) {
  c.alignments.push_back(p == nullptr ? -1 : static_cast<int>(reinterpret_cast<uintptr_t>(p) % 256));
}
void describe(Call& c, int64_t v) { c.signature += " " + std::to_string(v); }
void describe(Call& c, bool v) { c.signature += v ? " yes" : " no"; }
void describe(Call& c, DType t) { c.signature += std::string(" ") + dtype_name(t); }
void describe(Call& c, const MatmulTypes& t) {
  describe(c, t.in), describe(c, t.out), describe(c, t.bias);
}
void describe(Call&, float) {}  // eps, dloss: values, not layout

template <typename... A>
void record(const Stream& s, const char* op, const A&... a) {
  Call c{op, {}};
  (describe(c, a), ...);
  Recorder& r = recorder();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.seen[c.signature].insert(c.alignments);
  auto key = std::make_tuple(&s, c.signature, c.alignments);
  if (!s.capturing()) {
    r.eager.insert(std::move(key));
  } else {
    ++r.captured;
    if (!r.eager.contains(key)) r.first_in_capture.push_back(c.signature);
  }
}

// The CPU table with the alignment-sensitive entries recording before they forward.
#define ZT_RECORDING_ENTRY(op)                              \
  t.op = [](Stream& s, auto... a) {                         \
    record(s, #op, a...);                                   \
    return recorder().original.op(s, a...);                 \
  }
OpTable recording_table() {
  recorder().original = *op_table(Backend::kCpu);
  OpTable t = recorder().original;
  ZT_RECORDING_ENTRY(matmul_forward);
  ZT_RECORDING_ENTRY(matmul_backward);
  ZT_RECORDING_ENTRY(matmul_gelu_forward);
  ZT_RECORDING_ENTRY(matmul_backward_dgelu);
  ZT_RECORDING_ENTRY(lm_head_forward);
  ZT_RECORDING_ENTRY(lm_head_backward);
  ZT_RECORDING_ENTRY(flash_attention_forward);
  ZT_RECORDING_ENTRY(flash_attention_backward);
  ZT_RECORDING_ENTRY(classifier_forward_backward);
  return t;
}
#undef ZT_RECORDING_ENTRY

// A 2-layer GPT on two devices, batch 8 in micro-batches of 2 (2 per device and step).
TrainConfig small_run(int stage, Precision precision) {
  TrainConfig c = test_util::tiny_train_config(2, stage, 2);
  test_util::set_sanitizer_shape(c, 2);  // 2 layers, 32 wide, 2 heads, 16 tokens
  c.train_seq_len = 16;
  c.batch_size = 8;
  c.micro_batch_size = 2;
  c.precision = precision;
  c.cuda_graphs = CudaGraphs::kOff;
  return c;
}

// The run's alignments; `first_in_capture` (optional): the calls a capture met first, `captured`
// how many calls the captures issued.
Alignments alignments_of(const TrainConfig& c, std::vector<std::string>* first_in_capture = nullptr,
                         int64_t* captured = nullptr) {
  static const OpTable table = recording_table();
  const ScopedOpTable scoped(Backend::kCpu, &table);
  Recorder& r = recorder();
  {
    const std::lock_guard<std::mutex> lock(r.mu);
    r.seen.clear();
    r.eager.clear();
    r.first_in_capture.clear();
    r.captured = 0;
  }
  train(c);
  const std::lock_guard<std::mutex> lock(r.mu);
  if (first_in_capture != nullptr) *first_in_capture = r.first_in_capture;
  if (captured != nullptr) *captured = r.captured;
  return r.seen;
}

// One line per signature whose alignments differ (or that only one run made).
std::string differences(const Alignments& want, const Alignments& got) {
  std::string out;
  auto show = [](const std::set<std::vector<int>>* s) {
    if (s == nullptr) return std::string("no call");
    std::string t;
    for (const auto& v : *s) {
      t += "(";
      for (int a : v) t += std::to_string(a) + " ";
      t += ")";
    }
    return t;
  };
  std::set<std::string> keys;
  for (const auto& [k, v] : want) keys.insert(k);
  for (const auto& [k, v] : got) keys.insert(k);
  for (const std::string& k : keys) {
    const auto w = want.find(k), g = got.find(k);
    const auto* ws = w == want.end() ? nullptr : &w->second;
    const auto* gs = g == got.end() ? nullptr : &g->second;
    if (ws == nullptr || gs == nullptr || *ws != *gs) out += "\n  " + k + ": " + show(ws) + " vs " + show(gs);
  }
  return out;
}

TEST(OperandAlignment, EveryModeGivesTheLibraryCallsTheSameAlignments) {
  struct Mode {
    const char* name;
    int stage;
    CudaGraphs graphs = CudaGraphs::kOff;
    Recompute recompute = Recompute::kNone;
    bool offload = false;
  };
  const std::vector<Mode> modes =
      test::kThreadSanitizer
          ? std::vector<Mode>{{"stage 3, graphs on", 3, CudaGraphs::kOn}}
          : std::vector<Mode>{{"stage 1", 1},
                              {"stage 2", 2},
                              {"stage 3", 3},
                              {"stage 3, graphs on", 3, CudaGraphs::kOn},
                              {"stage 2, recompute selective", 2, CudaGraphs::kOff, Recompute::kSelective},
                              {"stage 3, recompute full, graphs on", 3, CudaGraphs::kOn, Recompute::kFull},
                              {"stage 1, offload optimizer", 1, CudaGraphs::kOff, Recompute::kNone, true}};
  const Alignments base = alignments_of(small_run(0, Precision::kBf16));
  // The check has something to hold: GEMMs were recorded, and their parameters sit at several
  // alignments below 256 (the 16-element tensor offsets inside a block), which a buffer placed at
  // another offset modulo 256 would shift.
  std::set<int> classes;
  for (const auto& [sig, tuples] : base)
    if (sig.rfind("matmul_", 0) == 0)
      for (const auto& t : tuples) classes.insert(t.begin(), t.end());
  EXPECT_GE(classes.size(), 3u) << "the GEMMs' operands sit at too few alignments for the check to bite";
  for (const char* op : {"matmul_forward", "matmul_gelu_forward", "matmul_backward", "matmul_backward_dgelu",
                         "lm_head_forward", "lm_head_backward", "flash_attention_forward", "flash_attention_backward",
                         "classifier_forward_backward"}) {
    bool called = false;
    for (const auto& [sig, tuples] : base) called = called || sig.rfind(std::string(op) + " ", 0) == 0;
    EXPECT_TRUE(called) << op << " was not called: the GPT's ops moved to other entries" << differences({}, base);
  }
  for (const Mode& m : modes) {
    TrainConfig c = small_run(m.stage, Precision::kBf16);
    c.cuda_graphs = m.graphs;
    c.recompute = m.recompute;
    c.offload_optimizer = m.offload;
    std::vector<std::string> first_in_capture;
    int64_t captured = 0;
    const Alignments got = alignments_of(c, &first_in_capture, &captured);
    EXPECT_EQ(captured > 0, m.graphs == CudaGraphs::kOn) << "bf16, " << m.name << ": " << captured << " calls captured";
    EXPECT_TRUE(got == base) << "bf16, " << m.name << " against stage 0:" << differences(base, got);
    // On a GPU a call first met inside a capture would ask cuBLASLt's heuristic (or build cuDNN's
    // plans) there; the eager warm-up micro-batch is meant to have asked everything already.
    std::string firsts;
    for (const std::string& f : first_in_capture) firsts += "\n  " + f;
    EXPECT_TRUE(first_in_capture.empty()) << "bf16, " << m.name << ": calls first issued inside a capture:" << firsts;
  }
  // fp32: its parameters are the engine's fp32 buffers (stage 0 resident, stage 3 gathered).
  if (!test::kThreadSanitizer) {
    const Alignments f0 = alignments_of(small_run(0, Precision::kFp32));
    const Alignments f3 = alignments_of(small_run(3, Precision::kFp32));
    EXPECT_TRUE(f3 == f0) << "fp32, stage 3 against stage 0:" << differences(f0, f3);
  }
}

}  // namespace
}  // namespace zt
