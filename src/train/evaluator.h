// Evaluation on every rank in lockstep (stage 3's gathers need all of them): validation batch e is
// the same global batch whatever the device count, each rank its own rows.
#pragma once

#include <optional>

#include "train/world.h"

namespace zt {

struct EvalResult {
  double loss = 0;                  // mean validation loss per position (nats)
  std::optional<double> accuracy;  // classifiers: fraction of correct predictions
  // A stop signal (SIGINT/SIGTERM) ended it early on some process: loss and accuracy mean nothing.
  bool interrupted = false;
};

// GPT: `batches` global batches of the validation split; images: the whole test split. A stop
// signal ends it after the batches some rank has begun (every rank runs as many, so the collectives
// inside a batch pair up), marked interrupted: an endless --eval-batches cannot outlive a stop.
EvalResult evaluate(World& world, const RunContext& run, int batches);

}  // namespace zt
