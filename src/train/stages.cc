// The two ways a World runs its stages (see stages.h): workspaces, memory, header, report, trace
// and the tests' final state. The step, evaluation, sampling and snapshots are in their areas' files.
#include "train/stages.h"

#include <cstdio>

#include "pipeline/simulate.h"
#include "train/report.h"
#include "train/state_io.h"
#include "train/trace.h"
#include "train/trainer.h"
#include "train/world.h"

namespace zt {

std::optional<PipelineReport> StageRunner::report() const { return std::nullopt; }

// ---- one stage --------------------------------------------------------------------------------

void OneStage::allocate(World& w, int r, int B, int T) {
  ws_[static_cast<size_t>(r)] = w.model_of(r).make_workspace(w.device(r), B, T);
}

double OneStage::take_recompute_seconds(int r) { return ws_[static_cast<size_t>(r)]->take_recompute_seconds(); }

ParamLayout OneStage::logical_layout(const World& w) const {
  const TensorMap* map = w.model().tensor_map();
  return map ? *map->logical : w.model().layout();
}

size_t OneStage::activation_bytes(int r) const { return ws_[static_cast<size_t>(r)]->bytes(); }

void OneStage::keep_final_state(World& w, const RunContext& run, int64_t step, TrainResult& out) {
  const int N = w.size();
  ZeroEngine& engine = w.engine();
  const Model& model = w.model();
  // The logical (one-device) blocks, whatever the tensor degree.
  out.final_params = logical_parameters(engine, model, true);
  out.final_working = logical_parameters(engine, model, false);
  if (engine.tensor_size() == 1)
    for (int b = 0; b < model.layout().num_blocks(); ++b) {
      out.final_local_params.push_back(engine.master_to_host(b));
      out.final_local_working.push_back(engine.block_to_host(b));
    }
  if (model.tensor_map()) {
    const bool adamw = run.cfg.optimizer == OptimizerKind::kAdamW;
    const HostSnapshot snap =
        take_snapshot(engine, model, adamw, step, [&](const std::function<void(int)>& fn) { w.for_ranks(fn); });
    for (size_t b = 0; b < snap.block_names.size(); ++b) {
      std::vector<float> first, second;
      for (const auto& rank : snap.shards) {
        first.insert(first.end(), rank[b].m.begin(), rank[b].m.end());
        second.insert(second.end(), rank[b].v.begin(), rank[b].v.end());
      }
      first.insert(first.end(), second.begin(), second.end());
      out.final_moments.push_back(std::move(first));
    }
  } else {
    for (int b = 0; b < model.layout().num_blocks(); ++b) {
      // The whole block's first moments, then its second ones (whatever the device count).
      std::vector<float> first, second;
      for (int r = 0; r < N; ++r) {
        const std::vector<float> m = engine.rank(r).moments_to_host(b);
        const size_t n = static_cast<size_t>(engine.rank(r).shard_of(b).size());
        first.insert(first.end(), m.begin(), m.begin() + static_cast<long>(n));
        second.insert(second.end(), m.begin() + static_cast<long>(n), m.end());
      }
      first.insert(first.end(), second.begin(), second.end());
      out.final_moments.push_back(std::move(first));
    }
  }
}

// ---- pipeline stages ----------------------------------------------------------------------------

PipelineStages::PipelineStages(World& w, int B, int T, PipelinePartition partition, Schedule schedule,
                               std::string note, bool all_spans)
    : partition_(std::move(partition)),
      schedule_(std::move(schedule)),
      note_(std::move(note)),
      spans_(static_cast<size_t>(w.size())),
      span_timers_(static_cast<size_t>(w.size())),
      all_spans_(all_spans) {
  for (int r = 0; r < w.size(); ++r)
    work_.push_back(std::make_unique<ModelStageWork>(w.model_of(r), w.device(r), w.engine_of(r).rank(w.engine_rank(r)),
                                                     B, T, schedule_, w.stage_of(r)));
}

// A pipeline's logical model is no stage's: the whole GPT (pipelines run GPTs only).
ParamLayout PipelineStages::logical_layout(const World& w) const { return gpt_layout(w.model_of(0).config()); }

size_t PipelineStages::activation_bytes(int r) const { return work_[static_cast<size_t>(r)]->bytes(); }

std::vector<std::string> PipelineStages::describe(const World& w, bool tp) const {
  const Schedule& sc = schedule_;
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s%s%s schedule %s%s over %d micro-batches (bubble %.3f in theory)",
                tp ? "" : "mesh: ", tp ? "" : w.mesh().describe().c_str(), tp ? "pipeline:" : ", pipeline",
                pipe_schedule_name(sc.kind),
                sc.virtual_stages > 1 ? (" x " + std::to_string(sc.virtual_stages) + " virtual stages").c_str() : "",
                sc.micro_batches, theoretical_bubble(sc.kind, sc.stages, sc.micro_batches, sc.virtual_stages));
  std::vector<std::string> lines = {buf, "stages: " + partition_.describe()};
  if (!note_.empty()) lines.push_back("note: " + note_);
  return lines;
}

std::optional<PipelineReport> PipelineStages::report() const {
  PipelineReport p;
  p.schedule = pipe_schedule_name(schedule_.kind);
  p.stages = schedule_.stages, p.virtual_stages = schedule_.virtual_stages, p.micro_batches = schedule_.micro_batches;
  p.measured_bubble = bubble_steps_ ? bubble_sum_ / bubble_steps_ : 0;
  p.theoretical_bubble = theoretical_bubble(schedule_.kind, p.stages, p.micro_batches, p.virtual_stages);
  return p;
}

// The step's F, B and W on each device's "pipeline F/B/W" track (the stage runtime's spans count
// microseconds of the steady clock from its epoch).
void PipelineStages::trace(World& w, TraceRecorder& tracer) const {
  for (int r = 0; r < w.size(); ++r)
    for (const StageSpan& sp : spans_[static_cast<size_t>(r)]) {
      std::string name = std::string(action_kind_name(sp.kind)) + " m" + std::to_string(sp.micro);
      if (schedule_.virtual_stages > 1) name += " c" + std::to_string(sp.chunk);
      tracer.add_slice(w.device(r).index(), TraceRecorder::kPipelineTid, std::move(name), "pipeline", sp.start_us,
                       sp.end_us, TraceRecorder::Clock::time_point{});
    }
}

Workspace* PipelineStages::forward_stages(World& w, int r, std::vector<std::unique_ptr<Workspace>>& ws,
                                          const Batch& batch) {
  Stream& s = w.device(r).compute();
  Communicator& comm = w.comm();
  const Model& model = w.model_of(r);
  const int P = w.mesh().shape().pipeline, stage = w.stage_of(r), last = P * model.chunks() - 1;
  const std::vector<int> group = w.mesh().pipeline_group(r);
  Workspace* head = nullptr;
  for (int c = 0; c < model.chunks(); ++c) {
    const int g = c * P + stage;  // the virtual stage
    Workspace& cw = *ws[static_cast<size_t>(c)];
    if (g > 0) {
      comm.recv(r, group[static_cast<size_t>((g - 1) % P)], cw.stage_input(), &s);
      comm.wait_done(r, s);
    }
    model.forward(s, w.engine_of(r).rank(w.engine_rank(r)), cw, batch, 0.0f, false);
    if (g == last) {
      head = &cw;
    } else {
      comm.send(r, group[static_cast<size_t>((g + 1) % P)], cw.stage_output(), &s);
      comm.wait_done(r, s);
    }
  }
  return head;
}

}  // namespace zt
