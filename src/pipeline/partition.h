// The pipeline partitioner: contiguous runs of transformer blocks per stage (or per chunk with
// virtual stages) that minimise the slowest stage's predicted time, ties broken by the largest
// stage's memory; the embedding goes to the first chunk, the final norm + head + loss to the last.
// Also --pp-layout parsing and the validation of pipeline shapes (one sentence per mistake).
//
// Design note:
//  - Parts: P*V chunks; chunk k (virtual stage k) lives on stage k % P (schedule.h). The costs
//    are per part, so with V > 1 the balance is per chunk (what the interleaved schedule waits on).
//  - Optimal, not greedy: a first dynamic programme finds the least possible slowest part T*; a
//    second, among splits whose every part takes at most T*, the least largest memory. (One
//    lexicographic DP would be wrong: a prefix with a worse time can still be under T* and hold
//    less memory.) O(parts * blocks^2), blocks in the hundreds at most.
//  - Every part holds at least one block: more parts than blocks is refused, never an empty stage
//    and never a silently dropped block.
#pragma once

#include <string>
#include <vector>

namespace zt {

struct PartCost {
  double time = 0;
  double memory = 0;  // bytes
};

struct PipelineCosts {
  std::vector<PartCost> blocks;  // h.0 .. h.(n-1)
  PartCost embedding;            // on the first part
  PartCost head;                 // final norm, head and loss, on the last part
};

struct PipelinePartition {
  int stages = 1;
  int virtual_stages = 1;
  std::vector<int> blocks_per_part;  // P*V counts, in virtual-stage order; each >= 1
  std::vector<PartCost> part_costs;  // predicted cost of each part (embedding/head included)

  int parts() const { return static_cast<int>(blocks_per_part.size()); }
  int first_block(int part) const;
  double slowest_time() const;    // max over parts
  double largest_memory() const;  // max over stages (a stage's chunks summed)
  // "stage 0: embedding + h.0-h.3, stage 1: h.4-h.7 + ln_f + head"; with V > 1 a stage's chunks
  // are joined with " | ": "stage 0: embedding + h.0-h.1 | h.4-h.5, ...".
  std::string describe() const;
};

// The balanced split of costs.blocks into stages*virtual_stages parts (validated first).
PipelinePartition partition_pipeline(const PipelineCosts& costs, int stages,
                                     int virtual_stages = 1);

// The split a user gave (--pp-layout), validated against the model, with its costs.
PipelinePartition partition_from_layout(const PipelineCosts& costs, const std::vector<int>& layout,
                                        int stages, int virtual_stages = 1);

// "4,4,3,1" -> {4, 4, 3, 1}; anything but comma-separated positive integers is one sentence.
std::vector<int> parse_pp_layout(const std::string& text);

// One sentence each: a layout whose count is not stages*virtual_stages, an entry below 1, counts
// that do not add up to the model's blocks.
void validate_pp_layout(const std::vector<int>& layout, int blocks, int stages,
                        int virtual_stages = 1);

// One sentence each: P < 1, P not dividing the devices, more parts (P*V) than blocks.
void validate_pipeline_shape(int devices, int stages, int virtual_stages, int blocks);

}  // namespace zt
