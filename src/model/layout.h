// Parameter layout: a model's parameters grouped into blocks, each block one contiguous flat
// buffer (parameters and gradients alike), each tensor a view at a fixed offset. ZeRO sharding
// slices these flat buffers; checkpoints and exports name tensors through this layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace zt {

enum class ParamInit { kNormal, kZeros, kOnes };

struct ParamTensor {
  std::string name;   // GPT-2 names: "h.3.attn.c_attn.weight" (our weights are [out, in])
  Shape shape;
  int64_t offset = 0;  // elements from the start of the block's flat buffer
  int64_t numel = 0;
  ParamInit init = ParamInit::kZeros;
  float init_std = 0;
  bool weight_decay = false;  // matrices and embeddings decay; biases and norms do not
  // Elements `init` fills, from the start; the rest stay zero (a padded tensor's padding rows: the
  // GPT's LM head/embedding table padded to a multiple of 128 rows). -1: all of them.
  int64_t init_numel = -1;
};

struct ParamBlock {
  std::string name;
  std::vector<ParamTensor> tensors;
  int64_t numel = 0;  // flat buffer length, including alignment padding between tensors
};

class ParamLayout {
 public:
  // Tensor offsets inside a block are multiples of this many elements (64 bytes in fp32).
  static constexpr int64_t kAlign = 16;

  int add_block(std::string name);
  // init_numel: ParamTensor::init_numel (-1: the whole tensor).
  void add_tensor(int block, std::string name, Shape shape, ParamInit init, float init_std,
                  bool weight_decay, int64_t init_numel = -1);

  const std::vector<ParamBlock>& blocks() const { return blocks_; }
  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  const ParamBlock& block(int b) const { return blocks_.at(static_cast<size_t>(b)); }
  int64_t total_parameters() const;  // sum of tensor sizes (no padding)
  // Block index and tensor of a name; throws kInvalidArgument naming the tensor if absent.
  std::pair<int, const ParamTensor*> find(const std::string& name) const;

 private:
  std::vector<ParamBlock> blocks_;
};

// Fills a block's parameters on the host, deterministically from the seed: element i of tensor t
// is a function of (seed, name of t, i) only, never of the device count or thread count.
void init_block_host(const ParamBlock& block, uint64_t seed, float* out);

}  // namespace zt
