// The balanced contiguous split of blocks over pipeline parts, --pp-layout parsing and validation.
#include "pipeline/partition.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/status.h"

namespace zt {

namespace {

using detail::concat;

std::string layout_text(const std::vector<int>& layout) {
  std::string s;
  for (size_t i = 0; i < layout.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(layout[i]);
  }
  return s;
}

// Cost of part `part` of `parts` holding blocks [begin, end).
PartCost part_cost(const PipelineCosts& c, int part, int parts, int begin, int end) {
  PartCost r;
  if (part == 0) r = c.embedding;
  for (int i = begin; i < end; ++i) {
    r.time += c.blocks[size_t(i)].time;
    r.memory += c.blocks[size_t(i)].memory;
  }
  if (part == parts - 1) {
    r.time += c.head.time;
    r.memory += c.head.memory;
  }
  return r;
}

PipelinePartition make_partition(const PipelineCosts& c, std::vector<int> counts, int P, int V) {
  PipelinePartition p;
  p.stages = P;
  p.virtual_stages = V;
  p.blocks_per_part = std::move(counts);
  int begin = 0;
  for (int k = 0; k < p.parts(); ++k) {
    const int end = begin + p.blocks_per_part[size_t(k)];
    p.part_costs.push_back(part_cost(c, k, p.parts(), begin, end));
    begin = end;
  }
  return p;
}

// Min over splits of blocks into `parts` contiguous non-empty runs of max over parts of key(part),
// where only runs with time <= time_bound are allowed; returns the counts (empty: none feasible).
template <typename Key>
std::vector<int> min_max_split(const PipelineCosts& c, int parts, double time_bound, Key key) {
  const int n = static_cast<int>(c.blocks.size());
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][j]: the least max key over the first j blocks in k parts; from[k][j]: start of part k.
  std::vector<std::vector<double>> best(size_t(parts) + 1, std::vector<double>(size_t(n) + 1, inf));
  std::vector<std::vector<int>> from(size_t(parts) + 1, std::vector<int>(size_t(n) + 1, -1));
  best[0][0] = -inf;
  for (int k = 1; k <= parts; ++k)
    for (int j = k; j <= n - (parts - k); ++j)
      for (int i = k - 1; i < j; ++i) {
        if (best[size_t(k - 1)][size_t(i)] == inf) continue;
        const PartCost pc = part_cost(c, k - 1, parts, i, j);
        if (pc.time > time_bound) continue;
        const double v = std::max(best[size_t(k - 1)][size_t(i)], key(pc));
        if (v < best[size_t(k)][size_t(j)]) {
          best[size_t(k)][size_t(j)] = v;
          from[size_t(k)][size_t(j)] = i;
        }
      }
  if (best[size_t(parts)][size_t(n)] == inf) return {};
  std::vector<int> counts(static_cast<size_t>(parts));
  for (int k = parts, j = n; k > 0; --k) {
    const int i = from[size_t(k)][size_t(j)];
    counts[size_t(k - 1)] = j - i;
    j = i;
  }
  return counts;
}

}  // namespace

int PipelinePartition::first_block(int part) const {
  return std::accumulate(blocks_per_part.begin(), blocks_per_part.begin() + part, 0);
}

double PipelinePartition::slowest_time() const {
  double t = 0;
  for (const PartCost& c : part_costs) t = std::max(t, c.time);
  return t;
}

double PipelinePartition::largest_memory() const {
  std::vector<double> per_stage(size_t(stages), 0);
  for (int k = 0; k < parts(); ++k) per_stage[size_t(k % stages)] += part_costs[size_t(k)].memory;
  return *std::max_element(per_stage.begin(), per_stage.end());
}

std::string PipelinePartition::describe() const {
  std::string out;
  for (int s = 0; s < stages; ++s) {
    out += concat(s ? ", " : "", "stage ", s, ": ");
    for (int c = 0; c < virtual_stages; ++c) {
      const int k = c * stages + s, b = first_block(k), n = blocks_per_part[size_t(k)];
      if (c) out += " | ";
      if (k == 0) out += "embedding + ";
      out += n == 1 ? concat("h.", b) : concat("h.", b, "-h.", b + n - 1);
      if (k == parts() - 1) out += " + ln_f + head";
    }
  }
  return out;
}

PipelinePartition partition_pipeline(const PipelineCosts& costs, int stages, int virtual_stages) {
  const int blocks = static_cast<int>(costs.blocks.size());
  // Devices = stages: the device count is the caller's to check; here only stages vs blocks.
  validate_pipeline_shape(stages, stages, virtual_stages, blocks);
  const int parts = stages * virtual_stages;
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<int> by_time =
      min_max_split(costs, parts, inf, [](const PartCost& c) { return c.time; });
  ZT_CHECK(!by_time.empty(), "no split of ", blocks, " blocks into ", parts, " parts");
  const double slowest = make_partition(costs, by_time, stages, virtual_stages).slowest_time();
  // Part times recomputed in the same summation order, so the bound admits the optimum itself.
  std::vector<int> by_memory =
      min_max_split(costs, parts, slowest, [](const PartCost& c) { return c.memory; });
  ZT_CHECK(!by_memory.empty(), "the time-optimal split is not feasible in the memory pass");
  return make_partition(costs, std::move(by_memory), stages, virtual_stages);
}

PipelinePartition partition_from_layout(const PipelineCosts& costs, const std::vector<int>& layout,
                                        int stages, int virtual_stages) {
  validate_pp_layout(layout, static_cast<int>(costs.blocks.size()), stages, virtual_stages);
  return make_partition(costs, layout, stages, virtual_stages);
}

std::vector<int> parse_pp_layout(const std::string& text) {
  std::vector<int> out;
  size_t i = 0;
  while (true) {
    const size_t comma = text.find(',', i);
    const std::string item =
        text.substr(i, comma == std::string::npos ? std::string::npos : comma - i);
    const bool digits =
        !item.empty() && item.size() <= 9 &&
        std::all_of(item.begin(), item.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    ZT_REQUIRE(digits, "--pp-layout '", text, "': '", item,
               "' is not a block count; give one count per stage, e.g. 4,4,3,1");
    out.push_back(std::stoi(item));
    if (comma == std::string::npos) break;
    i = comma + 1;
  }
  return out;
}

void validate_pp_layout(const std::vector<int>& layout, int blocks, int stages,
                        int virtual_stages) {
  const int parts = stages * virtual_stages;
  const std::string text = layout_text(layout);
  ZT_REQUIRE(static_cast<int>(layout.size()) == parts, "--pp-layout ", text, " has ", layout.size(),
             " entries but the pipeline has ", parts,
             virtual_stages > 1
                 ? concat(" chunks (", stages, " stages x ", virtual_stages, " virtual stages)")
                 : std::string(" stages"),
             "; give one block count per ", virtual_stages > 1 ? "chunk" : "stage");
  for (size_t k = 0; k < layout.size(); ++k)
    ZT_REQUIRE(layout[k] >= 1, "--pp-layout ", text, " gives ", layout[k], " blocks to ",
               virtual_stages > 1 ? "chunk " : "stage ", k, "; every ",
               virtual_stages > 1 ? "chunk" : "stage", " needs at least one block");
  const long sum = std::accumulate(layout.begin(), layout.end(), 0L);
  ZT_REQUIRE(sum == blocks, "--pp-layout ", text, " covers ", sum, " blocks but the model has ",
             blocks, "; the counts must add up to ", blocks,
             " so that every block is in exactly one stage");
}

void validate_pipeline_shape(int devices, int stages, int virtual_stages, int blocks) {
  ZT_REQUIRE(stages >= 1, "--pipeline-parallel ", stages, ": a pipeline needs at least one stage");
  ZT_REQUIRE(virtual_stages >= 1, "--virtual-stages ", virtual_stages,
             ": each stage needs at least one chunk");
  ZT_REQUIRE(devices % stages == 0, "--pipeline-parallel ", stages, " does not divide the ",
             devices, " devices; data x tensor x pipeline must equal the device count");
  const long parts = long(stages) * virtual_stages;
  ZT_REQUIRE(parts <= blocks, "--pipeline-parallel ", stages,
             virtual_stages > 1
                 ? concat(" x --virtual-stages ", virtual_stages, " = ", parts, " chunks")
                 : std::string(" stages"),
             " but the model has only ", blocks, " blocks; every ",
             virtual_stages > 1 ? "chunk" : "stage", " needs at least one block");
}

}  // namespace zt
