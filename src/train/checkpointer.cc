// Checkpoint meta, snapshots and background saves (see checkpointer.h).
#include "train/checkpointer.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "checkpoint/file_io.h"
#include "core/files.h"
#include "train/processes.h"

namespace zt {

namespace {

// Every tensor's global shape and where it lives in its block's flat arrays.
nlohmann::json tensor_table(const ParamLayout& layout) {
  nlohmann::json table = nlohmann::json::array();
  for (const auto& blk : layout.blocks())
    for (const auto& t : blk.tensors) {
      std::vector<int64_t> shape;
      for (int i = 0; i < t.shape.ndim(); ++i) shape.push_back(t.shape[i]);
      table.push_back({{"name", t.name}, {"block", blk.name}, {"offset", t.offset}, {"shape", shape}, {"dtype", "f32"}});
    }
  return table;
}

}  // namespace

nlohmann::json checkpoint_meta(World& world, const RunContext& run, const TrainCounters& counters,
                               const std::string& precision, ZeroOptions::Scaling scaling) {
  const TrainConfig& cfg = run.cfg;
  const ModelConfig& mc = run.mc;
  const int steps_done = counters.step;
  nlohmann::json m = {
      {"model", {{"preset", mc.preset}, {"describe", mc.describe()}, {"layers", mc.layers}, {"heads", mc.heads},
                 {"embd", mc.embd}, {"seq_len", mc.seq_len}, {"vocab", mc.vocab}, {"input_dim", mc.input_dim},
                 {"hidden", mc.hidden}, {"classes", mc.classes}}},
      {"precision", precision},
      {"zero_stage", cfg.zero_stage},
      {"devices", world.size() * run.processes->size()},
      {"step", steps_done},
      {"tokens_seen", static_cast<int64_t>(steps_done) * cfg.batch_size * run.T},
      // The data order is a function of (seed, step): the sampler continues at global batch
      // `step`, whatever the device count.
      {"sampler", {{"data", cfg.data}, {"seed", cfg.seed}, {"next_batch", steps_done}, {"batch_size", cfg.batch_size},
                   {"seq_len", run.T}}},
      {"rng", {{"seed", cfg.seed}, {"philox_counter", "step"}}},
      // What an evaluation reads (train/evaluator.h): batch e is sequences 0..rows-1 of validation
      // step e, e < batches; `zerotrain eval` reads the same.
      {"eval", {{"batches", cfg.eval_batches}, {"rows", world.data_ranks() * world.split().micro}, {"seq_len", run.T}}},
      {"optimizer", cfg.optimizer == OptimizerKind::kAdamW ? "adamw" : "sgd"},
      // The logical (one-device) tensors, whatever the tensor degree: the arrays hold those.
      {"tensors", tensor_table(world.logical_layout())},
      {"tensor_parallel", cfg.tensor_parallel},
      {"pipeline_parallel", cfg.pipeline_parallel},
      {"deterministic_attention", cfg.deterministic_attention},
      {"updates", counters.updates},
      {"skipped_steps", counters.skipped_steps},
      {"lr_schedule", {{"lr", cfg.lr}, {"min_lr", cfg.min_lr}, {"warmup_steps", cfg.warmup_steps}, {"steps", cfg.steps},
                       {"schedule", static_cast<int>(cfg.schedule)}}}};
  if (scaling != ZeroOptions::Scaling::kNone) {
    const optim::LossScaleState st = world.engine_of(0).rank(world.engine_rank(0)).scaler().state();
    m["loss_scale"] = {{"scale", st.scale}, {"inv_scale", st.inv_scale}, {"good_steps", st.good_steps},
                       {"hysteresis_left", st.hysteresis_left}, {"collapsed", st.collapsed}, {"skipped", st.skipped}};
  }
  return m;
}

// A pipelined world's snapshot in the logical layout: each stage's engine snapshots its blocks over
// its D data ranks, and logical block b's shards come from the stage that holds it (the embeddings
// from the first stage: the last stage's tied copy holds the same bits). Shard w of every block is
// written by engine rank w of its stage, as a run without stages on D x T devices would write it,
// so the checkpoint reshards onto any pipeline degree.
HostSnapshot PipelineStages::snapshot(World& world, bool adamw, int64_t step) {
  const MeshShape shape = world.mesh().shape();
  const ParamLayout logical = gpt_layout(world.model_of(0).config());
  HostSnapshot out;
  out.step = step;
  out.adamw = adamw;
  for (const auto& b : logical.blocks()) {
    out.block_names.push_back(b.name);
    out.block_numel.push_back(b.numel);
  }
  const int writers = shape.data * shape.tensor;  // a stage engine's ranks
  out.shards.assign(static_cast<size_t>(writers), std::vector<HostShard>(static_cast<size_t>(logical.num_blocks())));
  std::vector<bool> filled(static_cast<size_t>(logical.num_blocks()), false);
  for (int p = 0; p < shape.pipeline; ++p) {
    const int first = world.mesh().rank_at({.data = 0, .tensor = 0, .pipeline = p});
    const Model& model = world.model_of(first);
    HostSnapshot stage = take_snapshot(world.engine_of(first), model, adamw, step,
                                       [&](const std::function<void(int)>& fn) {
                                         world.for_ranks([&](int r) {
                                           if (world.stage_of(r) == p) fn(world.engine_rank(r));
                                         });
                                       });
    out.working = stage.working;
    // take_snapshot already maps a tensor-parallel stage's shards onto the logical blocks.
    const bool by_logical = model.tensor_map() != nullptr;
    for (int b = 0; b < model.layout().num_blocks(); ++b) {
      const auto lb = static_cast<size_t>(model.logical_block(b));
      if (filled[lb]) continue;  // the tied copy
      filled[lb] = true;
      for (int w = 0; w < writers; ++w)
        out.shards[static_cast<size_t>(w)][lb] = std::move(stage.shards[static_cast<size_t>(w)][by_logical ? lb : static_cast<size_t>(b)]);
    }
  }
  return out;
}

HostSnapshot OneStage::snapshot(World& world, bool adamw, int64_t step) {
  return take_snapshot(world.engine(), world.model(), adamw, step,
                       [&](const std::function<void(int)>& fn) { world.for_ranks(fn); });
}

HostSnapshot snapshot_world(World& world, const RunContext& run, const TrainCounters& counters,
                            const std::string& precision, ZeroOptions::Scaling scaling) {
  const bool adamw = run.cfg.optimizer == OptimizerKind::kAdamW;
  HostSnapshot snap = world.stages().snapshot(world, adamw, counters.step);
  snap.meta = checkpoint_meta(world, run, counters, precision, scaling);
  run.processes->own_part(snap, world.size());
  return snap;
}

Checkpointer::Checkpointer(const RunContext& run, Logger& log) : run_(run), log_(log) {
  const TrainConfig& cfg = run.cfg;
  if (cfg.checkpoint_dir.empty()) return;
  const RunIdentity id = run_identity(run.mc, cfg.seed, cfg.data);
  team_ = run.processes->checkpoint_team();  // collective: every process of the launch has the same --checkpoint-dir
  if (!team_) {
    lease_.emplace(open_checkpoint_dir(cfg.checkpoint_dir, id, !cfg.resume.fresh(), cfg.steps));
    if (cfg.resume.newest_in_dir()) assembled_ = assemble_partials(cfg.checkpoint_dir, cfg.keep);
  } else {
    // Process 0 takes the directory for the launch; the others follow its verdict, so that a
    // refusal is one sentence from every process rather than a hang on process 0's absence.
    nlohmann::json verdict = nlohmann::json::object();
    if (team_->process() == 0) try {
        lease_.emplace(open_checkpoint_dir(cfg.checkpoint_dir, id, !cfg.resume.fresh(), cfg.steps));
        // Before the others resolve --resume auto (they wait for this verdict).
        if (cfg.resume.newest_in_dir()) assembled_ = assemble_partials(cfg.checkpoint_dir, cfg.keep);
      } catch (const Error& e) {
        verdict = {{"error", e.message()}, {"kind", static_cast<int>(e.kind())}};
      }
    verdict = nlohmann::json::parse(team_->broadcast(verdict.dump()));
    if (verdict.contains("error")) {
      // Every process throws this same verdict: the team leaves without an abort notice, which
      // could reach a process still receiving the verdict first and replace its sentence.
      team_.reset();
      throw Error(static_cast<ErrorKind>(verdict["kind"].get<int>()), verdict["error"].get<std::string>());
    }
  }
  if (lease_)
    for (const std::string& n : lease_->notes()) log_.line("note: " + n);

  if (assembled_)
    log_.line("note: assembled " + *assembled_ + " from the parts of the snapshot the processes held when one was lost");
  saver_ = std::make_unique<BackgroundSaver>(cfg.checkpoint_dir, cfg.keep, team_.get());
}

void Checkpointer::write_run_config() {
  // Process 0 holds the lease. A resumed run replaces its predecessor's file (the same lineage).
  if (lease_ && !run_.cfg.run_config.empty())
    write_file_atomic((std::filesystem::path(run_.cfg.checkpoint_dir) / "config.toml").string(), run_.cfg.run_config,
                      "the run's config file");
}

Checkpointer::~Checkpointer() {
  // Joins the writer (a failure nobody collected is dropped: the run is already ending with an
  // error); the previous complete checkpoints are untouched either way.
  saver_.reset();
}

void Checkpointer::replicate(const HostSnapshot& snap) {
  if (!team_) return;
  wait();
  HostSnapshot held = deserialize_shards(team_->shift(serialize_shards(snap)));
  held.meta = snap.meta;  // the same on every process (the counters are)
  held_from_ = (team_->process() + run_.processes->size() - 1) % run_.processes->size();
  held_ = std::move(held);
}

std::string Checkpointer::write_partial(const HostSnapshot& snap, int process) {
  if (!saver_) return "";
  // The team's barrier would wait for the lost process: a save in flight is left to fail (its
  // staging directory is removed by the next complete save's cleanup).
  const std::string& root = run_.cfg.checkpoint_dir;
  std::string written = write_snapshot_part(snap, root, partial_dir_name(snap.step, process));
  if (held_ && held_->step == snap.step)
    written += " and " + write_snapshot_part(*held_, root, partial_dir_name(snap.step, held_from_) + "-held-by-" +
                                                      std::to_string(process));
  return written;
}

void Checkpointer::save(std::shared_ptr<const HostSnapshot> snap, double stall_s, bool shared) {
  const size_t bytes = snap->bytes();
  const int64_t at = snap->step;
  saver_->save(std::move(snap), [this, stall_s, bytes, at, shared](const std::string& path, double secs) {
    char line[512];
    // Several processes: the bytes, stall and time are this process's (0's, which prints).
    std::snprintf(line, sizeof line, "checkpoint %s: %s%s, training stalled %.1f ms%s, written in the background in %.1f ms",
                  path.c_str(), format_bytes(static_cast<double>(bytes)).c_str(), team_ ? " from process 0" : "",
                  stall_s * 1e3, shared ? " (the step's recovery snapshot, shared)" : "", secs * 1e3);
    {
      std::lock_guard<std::mutex> lock(mu_);
      paths_.push_back(path);
      messages_.push_back(line);
    }
    log_.emit({{"event", "checkpoint"}, {"step", at}, {"path", path}, {"bytes", bytes}, {"stall_ms", stall_s * 1e3},
               {"write_ms", secs * 1e3}, {"from_snapshot", shared}});
  });
}

std::string Checkpointer::save_now(const HostSnapshot& snap) {
  wait();
  const std::string path = write_checkpoint(snap, run_.cfg.checkpoint_dir, run_.cfg.keep, team_.get());
  std::lock_guard<std::mutex> lock(mu_);
  paths_.push_back(path);
  return path;
}

void Checkpointer::poll() {
  if (saver_) saver_->poll();
}

void Checkpointer::wait() {
  if (saver_) saver_->wait();
}

std::vector<std::string> Checkpointer::take_messages() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(messages_, {});
}

std::vector<std::string> Checkpointer::paths() {
  std::lock_guard<std::mutex> lock(mu_);
  return paths_;
}

}  // namespace zt
