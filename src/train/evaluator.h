// Evaluation on every rank in lockstep (stage 3's gathers need all of them): validation batch e is
// the same global batch whatever the device count, each rank its own rows.
#pragma once

#include <optional>

#include "train/world.h"

namespace zt {

struct EvalResult {
  double loss = 0;                  // mean validation loss per position (nats)
  std::optional<double> accuracy;  // classifiers: fraction of correct predictions
};

// GPT: `batches` global batches of the validation split; images: the whole test split.
EvalResult evaluate(World& world, const RunContext& run, int batches);

}  // namespace zt
