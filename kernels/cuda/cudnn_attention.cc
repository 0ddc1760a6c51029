// Fused causal attention through cuDNN 9's graph API (the cudnn-frontend C++ headers): SDPA forward
// and backward graphs for f16/bf16 over the packed qkv [B, T, 3C], built once per shape and cached.
// Whatever they decline (fp32, a shape cuDNN does not support, no cuDNN) the tiled kernels serve.
//
// Rules:
//  - A shape is (GPU, B, T, C, NH, dtype, deterministic backward); its forward and backward graphs
//    are built together at its first use (or when the memory plan asks what they need), before any
//    CUDA graph capture: the first micro-batch of a shape runs eagerly (train/graph_step.h). A
//    direction that failed to build is remembered as declined, so no call retries it; at T >= 256
//    the first decline of the run prints one line with what the tiled kernel costs instead.
//  - One cuDNN handle per GPU for the process (never destroyed: it outlives every stream); calls
//    on it are serialized by a mutex, and each call binds it to the launching stream first.
//  - The workspace is what cuDNN asks for (get_workspace_size), whatever it is: the deterministic
//    backward's is quadratic in T (ops.h cudnn_attention_workspace_formula), and the memory plan
//    counts the same bytes (measured through cudnn_attention_workspace on a GPU).
//  - The workspace and the backward's staging buffer share the stream's attention block
//    (stream_blocks.h; the fp32 GEMM attention uses the same block): ops::
//    flash_attention_library_bytes of the shape's two workspaces, taken by available() at the
//    shape's first call, grown (once per larger shape) only when a later shape needs more, freed
//    with the stream. A launch allocates nothing, so a captured graph replays it. Workspace at the
//    block's start, the backward's staging dqkv after the larger workspace (rounded up to 256
//    bytes: cuDNN's and the accumulate kernel's alignment). A block the pool cannot give declines
//    the shape (the tiled kernels need no workspace).
//  - lse is cuDNN's softmax statistics (log-sum-exp of the scaled scores, fp32 [B, NH, T]), the
//    tiled kernels' lse, so a forward of one and a backward of the other pair up.
#include "kernels/cuda/cuda_ops.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "core/status.h"

namespace zt::cuda_ops {
namespace {
// What the tiled kernel costs instead of cuDNN's, per layer, measured on an H200 at GPT-2 124M's
// shape (B=16, T=1024, 12 heads of 64, bf16; ../shared/gpu/2026-12-04): backward 46.5 ms against
// 0.33 ms; forward (fp32 tiled, 14.7 ms) against 0.12 ms. Measured before the tiled kernels kept
// their rows in registers (commit after 72def63); the line says so until a GPU re-measures it.
constexpr int kTiledBackwardSlowdown = 140;
constexpr int kTiledForwardSlowdown = 120;
// Below this T the tiled kernel's cost is small enough not to announce a fallback.
constexpr int64_t kAnnounceFallbackFromT = 256;
}  // namespace

void announce_attention_fallback(bool backward, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                                 bool deterministic, const std::string& why) {
  static std::atomic<bool> announced{false};
  if (T < kAnnounceFallbackFromT || announced.exchange(true)) return;
  std::fprintf(stderr,
               "attention: cuDNN declined the %s%s at B=%lld T=%lld heads=%lldx%lld %s (%s); the tiled kernel runs "
               "instead (before its register rewrite it was ~%dx slower per layer on an H200; not re-measured)\n",
               backward && deterministic ? "deterministic " : "", backward ? "backward" : "forward",
               static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(NH),
               static_cast<long long>(C / NH), dtype_name(dtype), why.c_str(),
               backward ? kTiledBackwardSlowdown : kTiledForwardSlowdown);
}
}  // namespace zt::cuda_ops

#if defined(ZT_WITH_CUDNN)

#include <cudnn.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cudnn_frontend.h>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/stream_blocks.h"
#include "kernels/ops.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace zt::cuda_ops {
namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

struct Key {
  int device;
  int64_t B, T, C, NH;
  DType dtype;
  bool deterministic;  // the backward's algorithm (the forward is deterministic either way)
  bool operator==(const Key&) const = default;
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = std::hash<int>()(k.device);
    for (int64_t v : {k.B, k.T, k.C, k.NH, static_cast<int64_t>(k.dtype), static_cast<int64_t>(k.deterministic)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;  // null: declined
  int64_t workspace = -1;                   // bytes cuDNN asked for; -1: declined
};

// Both directions of one shape and where they live in the stream's block.
struct Shape {
  Plan forward, backward;
  size_t block = 0;           // ops::flash_attention_library_bytes of the two workspaces
  size_t staging_offset = 0;  // the backward's staging dqkv: after the larger workspace
  bool usable = true;         // false: the pool could not give the block (both directions decline)
  const Plan& plan(bool backward) const { return backward ? this->backward : forward; }
};

struct State {
  std::mutex mu;
  std::unordered_map<Key, Shape, KeyHash> shapes;
  std::unordered_map<int, cudnnHandle_t> handles;  // nullptr: cuDNN unusable on that GPU
  std::set<std::string> noted;
};
// Leaked on purpose: handles and graphs must not be torn down after the CUDA runtime at exit.
State& state() {
  static State* s = new State;
  return *s;
}

// Prints `why` the first time `key` is seen.
void note_once(State& st, const std::string& key, const std::string& why) {
  if (st.noted.insert(key).second)
    std::fprintf(stderr, "note: %s; the tiled attention kernel runs instead\n", why.c_str());
}

// The run's one line when cuDNN declines a direction at T >= 256 (announce_attention_fallback).
void announce_fallback(const Key& k, bool backward, const std::string& why) {
  announce_attention_fallback(backward, k.B, k.T, k.C, k.NH, k.dtype, k.deterministic, why);
}

// The handle of GPU `device` (current: the caller's DeviceGuard), or nullptr. `capturing`: the
// caller's stream captures, where a failure may be the capture's (cudnnCreate allocates device
// memory): it fails the capture (zt::Error) instead of marking cuDNN unusable on the GPU, whose
// fallback, the tiled kernels, gives other bits than the eager run's.
cudnnHandle_t handle_for(State& st, int device, bool capturing) {
  auto it = st.handles.find(device);
  if (it != st.handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t status = cudnnCreate(&h);
  if (status != CUDNN_STATUS_SUCCESS && capturing)
    ZT_THROW(ErrorKind::kDevice, "cuDNN could not start on GPU ", device, " inside a stream capture (",
             cudnnGetErrorString(status), "); run the attention once outside the capture first");
  if (status != CUDNN_STATUS_SUCCESS) {
    note_once(st, "handle " + std::to_string(device),
              std::string("cuDNN could not start on GPU ") + std::to_string(device) + " (" +
                      cudnnGetErrorString(status) + ", library version " + std::to_string(cudnnGetVersion()) +
                      ")");
    h = nullptr;
  }
  st.handles.emplace(device, h);
  return h;
}

std::vector<int64_t> qkv_stride(const Key& k) { return {k.T * 3 * k.C, k.C / k.NH, 3 * k.C, 1}; }
std::vector<int64_t> out_stride(const Key& k) { return {k.T * k.C, k.C / k.NH, k.C, 1}; }

// Builds the graph of one direction of `k`; on failure returns the reason (plan.graph stays null).
std::string build(const Key& k, bool backward, cudnnHandle_t handle, Plan* plan) {
  const int64_t hs = k.C / k.NH;
  const std::vector<int64_t> dims{k.B, k.NH, k.T, hs}, sdims{k.B, k.NH, k.T, 1},
      sstride{k.NH * k.T, k.T, 1, 1};
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(k.dtype == DType::kBF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto input = [&](const char* name, int64_t uid, const std::vector<int64_t>& stride) {
    return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(stride));
  };
  auto Q = input("Q", kQ, qkv_stride(k)), K = input("K", kK, qkv_stride(k)), V = input("V", kV, qkv_stride(k));
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("sdpa_forward")
                    .set_generate_stats(true)
                    .set_causal_mask(true)
                    .set_attn_scale(scale);
    auto [O, stats] = g->sdpa(Q, K, V, opts);
    O->set_output(true).set_uid(kO).set_dim(dims).set_stride(out_stride(k));
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(sdims).set_stride(sstride);
  } else {
    auto O = input("O", kO, out_stride(k)), dO = input("dO", kdO, out_stride(k));
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim(sdims)
                               .set_stride(sstride)
                               .set_data_type(fe::DataType_t::FLOAT));
    // Deterministic (the default, --deterministic-attention on): bitwise the same run to run, as
    // every op of ZeroTrain's own; off: cuDNN's faster backward with fp32 atomics in dQ.
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("sdpa_backward")
                    .set_causal_mask(true)
                    .set_attn_scale(scale)
                    .set_deterministic_algorithm(k.deterministic);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, stats, opts);
    dQ->set_output(true).set_uid(kdQ).set_dim(dims).set_stride(qkv_stride(k));
    dK->set_output(true).set_uid(kdK).set_dim(dims).set_stride(qkv_stride(k));
    dV->set_output(true).set_uid(kdV).set_dim(dims).set_stride(qkv_stride(k));
  }
  for (auto step : {+[](fe::graph::Graph& gr, cudnnHandle_t) { return gr.validate(); },
                    +[](fe::graph::Graph& gr, cudnnHandle_t h) { return gr.build_operation_graph(h); },
                    +[](fe::graph::Graph& gr, cudnnHandle_t) {
                      return gr.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
                    },
                    +[](fe::graph::Graph& gr, cudnnHandle_t) { return gr.check_support(); },
                    +[](fe::graph::Graph& gr, cudnnHandle_t h) { return gr.build_plans(h); }}) {
    auto status = step(*g, handle);
    if (!status.is_good()) return status.get_message();
  }
  int64_t workspace = 0;
  if (auto status = g->get_workspace_size(workspace); !status.is_good()) return status.get_message();
  plan->graph = std::move(g);
  plan->workspace = workspace;
  return {};
}

// One direction of `k` built, or declined with its reason (announced). Caller holds st.mu.
// `capturing`: as handle_for's, a failure fails the capture instead of declining the shape for
// good (the tiled fallback's bits are not cuDNN's).
Plan build_direction(State& st, const Key& k, bool backward, cudnnHandle_t h, bool capturing) {
  Plan plan;
  std::string why;
  try {
    why = build(k, backward, h, &plan);
  } catch (const std::exception& e) {  // the frontend throws on some backend errors
    why = e.what();
  }
  if (why.empty()) return plan;
  if (capturing)
    ZT_THROW(ErrorKind::kDevice, "cuDNN could not build its attention ", backward ? "backward" : "forward", " at B=",
             k.B, " T=", k.T, " inside a stream capture (", why, "); run the attention once outside the capture first");
  announce_fallback(k, backward, why);
  return Plan{};
}

// The shape of `k` (both directions built on first use), or nullptr when cuDNN cannot start on
// the GPU. Caller holds st.mu; `capturing`: the caller's stream captures (handle_for).
Shape* shape_for(State& st, const Key& k, bool capturing) {
  auto it = st.shapes.find(k);
  if (it != st.shapes.end()) return &it->second;
  cudnnHandle_t h = handle_for(st, k.device, capturing);
  if (h == nullptr) return nullptr;
  Shape shape;
  shape.forward = build_direction(st, k, false, h, capturing);
  shape.backward = build_direction(st, k, true, h, capturing);
  const ops::AttentionWorkspace ws{shape.forward.workspace, shape.backward.workspace};
  shape.block = ops::flash_attention_library_bytes(k.B, k.T, k.C, k.dtype, ws);
  shape.staging_offset = (static_cast<size_t>(std::max<int64_t>({ws.forward, ws.backward, 0})) + 255) & ~size_t{255};
  return &st.shapes.emplace(k, std::move(shape)).first->second;
}

// The stream's attention block, holding at least the shape's block bytes (available() took it).
char* workspace_block(Stream& s, void* native, const Shape& shape) {
  return static_cast<char*>(detail::stream_block(s, native, detail::StreamBlock::kAttention, shape.block));
}

// The GPU of a cudaStream_t; launches and handles must target it (not the thread's current GPU).
// From the runtime's registry: CUDA refuses cudaStreamGetDevice on a capturing stream.
int stream_device(void* native) { return cuda::stream_ordinal(native); }

// Runs `plan` on the stream; `workspace`: the stream's block (at least plan.workspace bytes).
void execute(State& st, const Plan& plan, int device, void* native, void* workspace,
             std::unordered_map<int64_t, void*>& pack) {
  std::string failure;
  {
    // The callers hold one too; this one keeps the function correct on its own (a no-op switch).
    const cuda::DeviceGuard guard(device);
    cudnnHandle_t h = st.handles.at(device);
    const cudnnStatus_t status = cudnnSetStream(h, static_cast<cudaStream_t>(native));
    try {
      if (status != CUDNN_STATUS_SUCCESS) {
        failure = std::string("cudnnSetStream: ") + cudnnGetErrorString(status);
      } else if (auto e = plan.graph->execute(h, pack, workspace); !e.is_good()) {
        failure = e.get_message();
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  ZT_REQUIRE(failure.empty(), "cuDNN attention failed on GPU ", device, ": ", failure);
}

char* byte(void* p, int64_t elements, DType t) { return static_cast<char*>(p) + elements * dtype_size(t); }
void* mut(const void* p) { return const_cast<void*>(p); }  // the variant pack takes void*

}  // namespace

bool cudnn_attention_available(Stream& s, void* native, bool backward, int64_t B, int64_t T, int64_t C, int64_t NH,
                               DType dtype, bool deterministic) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) return false;
  const int device = stream_device(native);
  const cuda::DeviceGuard guard(device);
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mu);
  const Key key{device, B, T, C, NH, dtype, deterministic};
  Shape* shape = shape_for(st, key, s.capturing());
  if (shape == nullptr || !shape->usable || !shape->plan(backward).graph) return false;
  try {
    workspace_block(s, native, *shape);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kOutOfMemory) throw;
    shape->usable = false;
    announce_fallback(key, backward,
                      "its workspace block of " + std::to_string(shape->block) + " bytes does not fit in the pool");
    return false;
  }
  return true;
}

bool cudnn_attention_workspace(Stream& s, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                               bool deterministic, int64_t* forward, int64_t* backward) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) return false;
  const int device = stream_device(s.native_handle());
  const cuda::DeviceGuard guard(device);
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mu);
  const Shape* shape = shape_for(st, Key{device, B, T, C, NH, dtype, deterministic}, s.capturing());
  if (shape == nullptr) return false;
  *forward = shape->forward.workspace;
  *backward = shape->backward.workspace;
  return true;
}

void cudnn_attention_forward(Stream& s, void* native, void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                             int64_t C, int64_t NH, DType dtype, bool deterministic) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mu);
  const int device = stream_device(native);
  const cuda::DeviceGuard guard(device);
  auto it = st.shapes.find(Key{device, B, T, C, NH, dtype, deterministic});
  ZT_CHECK(it != st.shapes.end() && it->second.usable && it->second.forward.graph,
           "cudnn_attention_forward called for a shape cuDNN declined");
  const Shape* shape = &it->second;
  char* block = workspace_block(s, native, *shape);
  std::unordered_map<int64_t, void*> pack{{kQ, mut(qkv)},
                                          {kK, byte(mut(qkv), C, dtype)},
                                          {kV, byte(mut(qkv), 2 * C, dtype)},
                                          {kO, out},
                                          {kStats, lse}};
  execute(st, shape->forward, device, native, block, pack);
}

void cudnn_attention_backward(Stream& s, void* native, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                              DType dtype, bool accumulate, bool deterministic) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mu);
  const int device = stream_device(native);
  const cuda::DeviceGuard guard(device);
  auto it = st.shapes.find(Key{device, B, T, C, NH, dtype, deterministic});
  ZT_CHECK(it != st.shapes.end() && it->second.usable && it->second.backward.graph,
           "cudnn_attention_backward called for a shape cuDNN declined");
  const Shape& shape = it->second;
  // cuDNN writes gradients; `+=` goes through a staging dqkv in the block's tail (every column is
  // some head's q, k or v, so all of it is written) and accumulate, which rounds the sum once more.
  char* block = workspace_block(s, native, shape);
  const int64_t n = B * T * 3 * C;
  void* target = accumulate ? block + shape.staging_offset : dqkv;
  std::unordered_map<int64_t, void*> pack{
      {kQ, mut(qkv)},   {kK, byte(mut(qkv), C, dtype)}, {kV, byte(mut(qkv), 2 * C, dtype)},
      {kO, mut(out)},   {kdO, mut(dout)},               {kStats, mut(lse)},
      {kdQ, target},    {kdK, byte(target, C, dtype)},  {kdV, byte(target, 2 * C, dtype)}};
  execute(st, shape.backward, device, native, block, pack);
  if (accumulate) cuda_ops::accumulate(native, dqkv, target, dtype, n);
}

}  // namespace zt::cuda_ops

#else  // no cuDNN in this build: every call declines, the tiled kernels serve

namespace zt::cuda_ops {
// Declines every call; the run's first 16-bit call at T >= 256 says why, since the tiled kernel
// serving instead is far slower there.
bool cudnn_attention_available(Stream&, void*, bool backward, int64_t B, int64_t T, int64_t C, int64_t NH,
                               DType dtype, bool deterministic) {
  if (dtype == DType::kF16 || dtype == DType::kBF16)
    announce_attention_fallback(backward, B, T, C, NH, dtype, deterministic,
                                "this build has no cuDNN: CMake found no libcudnn or no cudnn-frontend headers; "
                                "scripts/setup fetches the headers");
  return false;
}
bool cudnn_attention_workspace(Stream&, int64_t, int64_t, int64_t, int64_t, DType, bool, int64_t*, int64_t*) {
  return false;
}
void cudnn_attention_forward(Stream&, void*, void*, float*, const void*, int64_t, int64_t, int64_t, int64_t,
                             DType, bool) {
  ZT_CHECK(false, "cudnn_attention_forward: this build has no cuDNN");
}
void cudnn_attention_backward(Stream&, void*, void*, const void*, const void*, const void*, const float*, int64_t,
                              int64_t, int64_t, int64_t, DType, bool, bool) {
  ZT_CHECK(false, "cudnn_attention_backward: this build has no cuDNN");
}
}  // namespace zt::cuda_ops

#endif
