// Fused causal attention through cuDNN 9's graph API (the cudnn-frontend C++ headers): SDPA forward
// and backward graphs for f16/bf16 over the packed qkv [B, T, 3C], built once per shape and cached.
// Whatever they decline (fp32, a shape cuDNN does not support, no cuDNN) the tiled kernels serve.
//
// Rules:
//  - Graphs are keyed by (GPU, B, T, C, NH, dtype, direction); a key that failed to build is
//    remembered as declined, with one note per reason on stderr, so no call retries it.
//  - One cuDNN handle per GPU for the process (never destroyed: it outlives every stream); calls
//    on it are serialized by a mutex, and each call binds it to the launching stream first.
//  - The workspace and the backward's staging buffer share one pool block per stream (a
//    StreamResource, like the cuBLAS workspace): ops::flash_attention_library_bytes of the first
//    call's shape, taken on that call, grown (once per larger shape) only when a later call's
//    bound is larger, freed with the stream. A call allocates nothing else, so a captured graph
//    replays it, and the memory plan counts the block (its cuDNN attention workspace line).
//    Workspace at the block's start, the backward's staging dqkv at the end of the call's bound
//    (staging_offset); a graph whose workspace would not end before it is declined.
//  - lse is cuDNN's softmax statistics (log-sum-exp of the scaled scores, fp32 [B, NH, T]), the
//    tiled kernels' lse, so a forward of one and a backward of the other pair up.
#include "kernels/cuda/cuda_ops.h"

#include "core/status.h"

#if defined(ZT_WITH_CUDNN)

#include <cudnn.h>
#include <cuda_runtime.h>

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

#include "kernels/ops.h"
#include "memory/caching_allocator.h"
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
  bool backward;
  bool operator==(const Key&) const = default;
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = std::hash<int>()(k.device);
    for (int64_t v : {k.B, k.T, k.C, k.NH, static_cast<int64_t>(k.dtype), static_cast<int64_t>(k.backward)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;  // null: declined
  int64_t workspace = 0;
};

struct State {
  std::mutex mu;
  std::unordered_map<Key, Plan, KeyHash> plans;
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

// The handle of GPU `device` (current: the caller's DeviceGuard), or nullptr.
cudnnHandle_t handle_for(State& st, int device) {
  auto it = st.handles.find(device);
  if (it != st.handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t status = cudnnCreate(&h);
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

// The backward's staging dqkv in the stream's block: at bound - staging rounded down to 256
// bytes (cuDNN's and the accumulate kernel's alignment), ending within the bound; the workspace
// must end at or before it.
size_t staging_offset(const Key& k) {
  const size_t staging = static_cast<size_t>(k.B * k.T * 3 * k.C) * dtype_size(k.dtype);
  return (ops::flash_attention_library_bytes(k.B, k.T, k.C, k.NH, k.dtype) - staging) & ~size_t{255};
}

// Builds the graph of `k`; on failure returns the reason (plan.graph stays null).
std::string build(const Key& k, cudnnHandle_t handle, Plan* plan) {
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
  if (!k.backward) {
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
    // Deterministic: the ops' results must not change from run to run (cuda_ops.h contract).
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("sdpa_backward")
                    .set_causal_mask(true)
                    .set_attn_scale(scale)
                    .set_deterministic_algorithm(true);
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
  const size_t cap =
      k.backward ? staging_offset(k) : ops::flash_attention_library_bytes(k.B, k.T, k.C, k.NH, k.dtype);
  if (static_cast<size_t>(workspace) > cap)
    return "workspace of " + std::to_string(workspace) + " bytes exceeds the planned " + std::to_string(cap);
  plan->graph = std::move(g);
  plan->workspace = workspace;
  return {};
}

// The plan of `k` (built on first use), or nullptr when cuDNN declines it. Caller holds st.mu.
const Plan* plan_for(State& st, const Key& k) {
  auto it = st.plans.find(k);
  if (it != st.plans.end()) return it->second.graph ? &it->second : nullptr;
  Plan plan;
  if (cudnnHandle_t h = handle_for(st, k.device)) {
    std::string why;
    try {
      why = build(k, h, &plan);
    } catch (const std::exception& e) {  // the frontend throws on some backend errors
      why = e.what();
    }
    if (!why.empty()) {
      plan = Plan{};
      // One note per direction, dtype and head size: a shape class, not every T.
      const std::string what = std::string("cuDNN attention ") + (k.backward ? "backward" : "forward") +
                               " declines " + dtype_name(k.dtype) + " head size " + std::to_string(k.C / k.NH);
      note_once(st, what,
                what + " (first at B=" + std::to_string(k.B) + " T=" + std::to_string(k.T) +
                    " heads=" + std::to_string(k.NH) + "): " + why);
    }
  }
  auto [pos, inserted] = st.plans.emplace(k, std::move(plan));
  (void)inserted;
  return pos->second.graph ? &pos->second : nullptr;
}

// The stream's attention block (see the rules above). Used under State::mu only.
class CudnnWorkspace final : public cuda::StreamResource {
 public:
  explicit CudnnWorkspace(Stream& stream) : pool_(stream.device().memory()) {}
  // Runs with the stream drained (StreamResource's contract): nothing uses the block any more.
  ~CudnnWorkspace() override { release(); }
  CudnnWorkspace(const CudnnWorkspace&) = delete;
  CudnnWorkspace& operator=(const CudnnWorkspace&) = delete;

  // At least `bytes` bytes for work on `s`, this resource's stream. A larger request frees the
  // block (stream-ordered: work already issued keeps it) and takes one of `bytes`.
  void* reserve(Stream& s, size_t bytes) {
    if (bytes <= bytes_) return block_;
    release();
    block_ = pool_.allocate(bytes, s, "cuDNN attention workspace");
    bytes_ = bytes;
    return block_;
  }

 private:
  void release() noexcept {
    if (block_ != nullptr) {
      try {
        pool_.free(block_);
      } catch (...) {  // a failed device's pool: its memory goes with the pool anyway
      }
    }
    block_ = nullptr;
    bytes_ = 0;
  }

  CachingAllocator& pool_;
  void* block_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<cuda::StreamResource> make_workspace(Stream& stream) {
  return std::make_unique<CudnnWorkspace>(stream);
}

// The stream's block, holding at least ops::flash_attention_library_bytes of the call's shape.
char* workspace_block(Stream& s, void* native, const Key& k) {
  auto& r = static_cast<CudnnWorkspace&>(cuda::stream_resource(native, cuda::kCudnnResource, &make_workspace));
  return static_cast<char*>(r.reserve(s, ops::flash_attention_library_bytes(k.B, k.T, k.C, k.NH, k.dtype)));
}

// The GPU of a cudaStream_t; launches and handles must target it (not the thread's current GPU).
// From the runtime's registry: CUDA refuses cudaStreamGetDevice on a capturing stream.
int stream_device(void* native) { return cuda::stream_ordinal(native); }

// Runs `plan` on the stream; `workspace`: the stream's block (at least plan.workspace bytes).
void execute(State& st, const Plan& plan, int device, void* native, void* workspace,
             std::unordered_map<int64_t, void*>& pack) {
  std::string failure;
  {
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

bool cudnn_attention_available(void* native, bool backward, int64_t B, int64_t T, int64_t C, int64_t NH,
                               DType dtype) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) return false;
  const int device = stream_device(native);
  const cuda::DeviceGuard guard(device);
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mu);
  return plan_for(st, Key{device, B, T, C, NH, dtype, backward}) != nullptr;
}

void cudnn_attention_forward(Stream& s, void* native, void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                             int64_t C, int64_t NH, DType dtype) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mu);
  const int device = stream_device(native);
  const cuda::DeviceGuard guard(device);
  const Key key{device, B, T, C, NH, dtype, false};
  const Plan* plan = plan_for(st, key);
  ZT_CHECK(plan != nullptr, "cudnn_attention_forward called for a shape cuDNN declined");
  char* block = workspace_block(s, native, key);
  std::unordered_map<int64_t, void*> pack{{kQ, mut(qkv)},
                                          {kK, byte(mut(qkv), C, dtype)},
                                          {kV, byte(mut(qkv), 2 * C, dtype)},
                                          {kO, out},
                                          {kStats, lse}};
  execute(st, *plan, device, native, block, pack);
}

void cudnn_attention_backward(Stream& s, void* native, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                              DType dtype, bool accumulate) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mu);
  const int device = stream_device(native);
  const cuda::DeviceGuard guard(device);
  const Key key{device, B, T, C, NH, dtype, true};
  const Plan* plan = plan_for(st, key);
  ZT_CHECK(plan != nullptr, "cudnn_attention_backward called for a shape cuDNN declined");
  // cuDNN writes gradients; `+=` goes through a staging dqkv in the block's tail (every column is
  // some head's q, k or v, so all of it is written) and accumulate, which rounds the sum once more.
  char* block = workspace_block(s, native, key);
  const int64_t n = B * T * 3 * C;
  void* target = accumulate ? block + staging_offset(key) : dqkv;
  std::unordered_map<int64_t, void*> pack{
      {kQ, mut(qkv)},   {kK, byte(mut(qkv), C, dtype)}, {kV, byte(mut(qkv), 2 * C, dtype)},
      {kO, mut(out)},   {kdO, mut(dout)},               {kStats, mut(lse)},
      {kdQ, target},    {kdK, byte(target, C, dtype)},  {kdV, byte(target, 2 * C, dtype)}};
  execute(st, *plan, device, native, block, pack);
  if (accumulate) cuda_ops::accumulate(native, dqkv, target, dtype, n);
}

}  // namespace zt::cuda_ops

#else  // no cuDNN in this build: every call declines, the tiled kernels serve

namespace zt::cuda_ops {
bool cudnn_attention_available(void*, bool, int64_t, int64_t, int64_t, int64_t, DType) { return false; }
void cudnn_attention_forward(Stream&, void*, void*, float*, const void*, int64_t, int64_t, int64_t, int64_t,
                             DType) {
  ZT_CHECK(false, "cudnn_attention_forward: this build has no cuDNN");
}
void cudnn_attention_backward(Stream&, void*, void*, const void*, const void*, const void*, const float*, int64_t,
                              int64_t, int64_t, int64_t, DType, bool) {
  ZT_CHECK(false, "cudnn_attention_backward: this build has no cuDNN");
}
}  // namespace zt::cuda_ops

#endif
