// The trainer's per-rank buffers (see rank_buffers.h).
#include "train/rank_buffers.h"

#include "model/model.h"
#include "pipeline/model_stage.h"
#include "zero/shard_plan.h"

namespace zt {

RankBuffers rank_buffers(const RankBufferShape& s, const Model& model) {
  RankBuffers b;
  const auto B = static_cast<size_t>(s.micro_batch), T = static_cast<size_t>(s.seq_len);
  const int m = s.pipeline ? s.micro_batches : 1;
  b.inputs = {"batch", B * (s.gpt ? T : static_cast<size_t>(s.input_dim)) * 4, s.gpt ? DType::kI32 : DType::kF32, m};
  b.targets = {"batch", B * T * 4, DType::kI32, m};
  b.tied_scratch = {"tied embedding gradient", 0, DType::kF32, 0};
  if (const int tied = s.pipeline ? tied_embedding_block(model) : -1; tied >= 0) {
    // The embeddings' gradient (the rank's tensor shard) as the engine pads it over the data ranks.
    b.tied_scratch.bytes = static_cast<size_t>(shard_range(model.layout().block(tied).numel, 0, s.data_ranks).padded_numel) * 4;
    b.tied_scratch.count = 1;
  }
  const size_t row = static_cast<size_t>(2 * model.layout().num_blocks() + kLossSlots) * 4;
  b.norms = {"grad norm", row, DType::kF32, 1};
  // Every rank's row of norm partials, loss sum and flag, and which entries count.
  b.step_rows = {"step scalars", static_cast<size_t>(s.ranks) * row, DType::kF32, 1};
  b.step_include = b.step_rows;
  b.step_out = {"step scalars", kStepOutBytes, DType::kF32, 1};  // doubles and a float (kF32: raw words)
  b.step_host = {"step scalars", kStepHostBytes, DType::kF32, kStepSlots, true};
  return b;
}

}  // namespace zt
