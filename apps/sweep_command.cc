// `zerotrain sweep` (apps/sweep_command.h): flags, the per-trial re-parse, every check before the
// first trial, then the runner, the leaderboard and the --plot SVG.
#include "sweep_command.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "cli_checks.h"
#include "config_file.h"
#include "core/status.h"
#include "flag_rules.h"
#include "model/config.h"
#include "runtime/runtime.h"
#include "sweep/runner.h"
#include "sweep/space.h"
#include "train/plot.h"
#include "train/processes.h"
#include "train/run_shape.h"

namespace zt {

namespace {

// Run flags a sweep sets itself per trial or for the whole pool: given on the command line they
// are refused (one sentence), and they cannot be swept.
const std::set<std::string> kSweepOwned = {"checkpoint-dir", "resume", "metrics", "trace", "profile-steps"};
const std::set<std::string> kNotSweepable = {"devices",  "device-memory", "checkpoint-dir", "resume", "metrics", "trace",
                                             "profile-steps", "plot", "quiet", "log-format", "steps", "save-every",
                                             "keep"};

std::vector<std::string> run_flag_names() {
  CLI::App app;
  RunFlags f;
  add_run_flags(app, f);
  zt_cli::harden(app);
  std::vector<std::string> names;
  for (const CLI::Option* o : app.get_options())
    if (!o->get_lnames().empty() && o->get_lnames()[0] != "help") names.push_back(o->get_lnames()[0]);
  return names;
}

// The text of a number the way generate_trials writes it.
std::string range_end(double v, bool integer) {
  char buf[64];
  if (integer) std::snprintf(buf, sizeof buf, "%d", static_cast<int>(v));
  else std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// The base flags plus `extra` parsed by a fresh copy of the run flag set: the same validators as
// `train`. A rejected value becomes zt::Error(kInvalidArgument) prefixed by `who`.
TrainConfig parse_run(const std::vector<std::string>& base, const std::vector<std::pair<std::string, std::string>>& extra,
                      const std::string& who) {
  CLI::App app;
  RunFlags f;
  add_run_flags(app, f);
  zt_cli::harden(app);  // as zerotrain's own parse: a repeated base flag's last value counts
  std::vector<std::string> args = base;
  for (const auto& [k, v] : extra) args.push_back("--" + k + "=" + v);
  std::reverse(args.begin(), args.end());  // CLI11 takes a vector in reverse order
  try {
    app.parse(args);
    return f.to_config();
  } catch (const CLI::ParseError& e) {
    ZT_THROW(ErrorKind::kInvalidArgument, who, ": ", e.what());
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kInvalidArgument) throw;
    ZT_THROW(ErrorKind::kInvalidArgument, who, ": ", e.message());
  }
}

// The identity a rerun of the sweep must match: every flag's resolved value (as --print-config
// writes it, automatic defaults resolved, numbers normalised to float precision so that "1e-3",
// "0.001" and the float the run uses agree) and every trial's values. Not the command line: the
// order of the flags, and flags that change no result (--quiet, --log-format, --plot, the
// timeouts), do not matter.
nlohmann::json sweep_identity(const CLI::App& sub, const TrainConfig& base_cfg, int max_steps, int per_trial,
                              Backend backend, const std::set<std::string>& swept,
                              const std::vector<sweep::TrialValues>& trials) {
  const auto normalized = [](std::string line) {
    const size_t eq = line.find(" = ");
    if (eq == std::string::npos) return line;
    const std::string value = line.substr(eq + 3);
    if (value.find_first_not_of("0123456789") == std::string::npos) return line;  // integers (seeds) exactly
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(v)) return line;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.7g", v);
    return line.substr(0, eq + 3) + buf;
  };
  std::vector<std::string> flags;
  std::set<std::string> named;
  const std::set<std::string> skip = {"quiet", "log-format", "plot", "sweep-dir", "space", "space-file",
                                      "hang-timeout", "comm-timeout", "sample-tokens"};
  const std::string text = format_config(sub, skip, {});
  size_t at = 0;
  while (at < text.size()) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(at, nl - at);
    at = nl + 1;
    if (line.empty() || line[0] == '#') continue;
    flags.push_back(normalized(line));
    named.insert(line.substr(0, line.find(" = ")));
  }
  try {
    TrainConfig trial = base_cfg;
    trial.steps = max_steps;
    const ModelConfig mc = make_model_config(trial.model, trial.overrides);
    const TrainConfig r = resolve_run_shape(trial, mc, per_trial, backend).cfg;
    const auto note = [&](const std::string& flag, double value) {
      if (named.count(flag) || swept.count(flag)) return;
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.9g", value);
      flags.push_back(normalized(flag + " = " + buf));
    };
    note("batch-size", r.batch_size);
    note("micro-batch-size", r.micro_batch_size);
    note("lr", r.lr);
    note("min-lr", r.min_lr);
    note("warmup-steps", r.warmup_steps);
    note("eval-every", r.eval_every);
    note("train-seq-len", r.train_seq_len);
  } catch (const Error&) {
    // The trials' own resolution reports it (a swept value may make the base valid).
  }
  std::vector<std::vector<std::pair<std::string, std::string>>> values;
  for (const sweep::TrialValues& t : trials) values.push_back(t.values);
  return sweep::make_identity(flags, values);
}

}  // namespace

SweepCommand::SweepCommand(CLI::App& app) : f_(std::make_shared<RunFlags>()), o_(std::make_shared<Options>()) {
  sub_ = app.add_subcommand("sweep",
                            "Run many trials of a search space at once, each on its own devices, with early stopping "
                            "(accepts every train flag; --plot draws the trials' validation curves)");
  add_run_flags(*sub_, *f_);
  Options& o = *o_;
  sub_->add_option("--space", o.space,
                   "NAME=SPEC, may repeat: a train flag and its values: lr=1e-3,3e-4 (list), lr=log:1e-4..1e-2, "
                   "lr=lin:0.1..0.5, warmup-steps=int:0..200 (ranges need --trials)")
      ->check(zt_cli::non_empty());
  sub_->add_option("--space-file", o.space_file,
                   "JSON search space: {\"lr\": [1e-3, 3e-4], \"warmup-steps\": \"int:0..200\"}")
      ->check(CLI::ExistingFile);
  sub_->add_option("--trials", o.trials, "Random search: this many draws, seeded by --seed (0 = the full grid)")
      ->capture_default_str()->check(zt_cli::whole(0, 100000));
  sub_->add_option("--devices-per-trial", o.devices_per_trial, "Devices each trial runs on (a disjoint subset of --devices)")
      ->capture_default_str()->check(zt_cli::whole(1));
  sub_->add_option("--scheduler", o.scheduler, "none (every trial runs --max-steps) or asha (stop bad trials at rungs)")
      ->capture_default_str()->check(CLI::IsMember({"none", "asha"}));
  sub_->add_option("--eta", o.eta, "ASHA: rungs are min-steps x eta^k; the top 1/eta at a rung continue")
      ->capture_default_str()->check(zt_cli::number(1, true));
  sub_->add_option("--min-steps", o.min_steps, "ASHA: the first rung (default: max-steps / eta^K, eta^K <= the number of trials)")
      ->check(zt_cli::whole(1));
  sub_->add_option("--max-steps", o.max_steps,
                   "Steps of a trial that is never stopped; every trial's LR schedule spans it (default: --steps, else "
                   "train's default)")
      ->check(zt_cli::whole(1));
  sub_->add_option("--sweep-dir", o.sweep_dir,
                   "Directory of the sweep: sweep.json, results.jsonl, trial-NNN/{ckpt,metrics.jsonl}; the same "
                   "command again continues it")
      ->required()->check(zt_cli::non_empty());
}

bool SweepCommand::parsed() const { return sub_->parsed(); }

namespace {

// The run flags given on the command line as `--name=value` (switches as `--name`), without the
// swept ones and --plot: the base every trial's flags are parsed from.
std::vector<std::string> given_run_flags(const CLI::App& sub, const std::vector<std::string>& names,
                                         const std::set<std::string>& swept) {
  std::vector<std::string> base;
  for (const CLI::Option* opt : sub.get_options()) {
    if (opt->get_lnames().empty() || opt->count() == 0) continue;
    const std::string name = opt->get_lnames()[0];
    if (std::find(names.begin(), names.end(), name) == names.end() || swept.count(name) || name == "plot") continue;
    if (opt->get_type_size_max() == 0) {
      base.push_back("--" + name);
      continue;
    }
    for (const std::string& r : opt->results()) base.push_back("--" + name + "=" + r);
  }
  return base;
}

// The flags that do nothing in every trial's combination and are not swept (a swept value may make
// a flag count in some trials: then it stays). A trial whose shape is refused is the runner's to
// report, so it does not count here.
std::vector<InapplicableFlag> flags_no_trial_uses(const sweep::SweepSpec& s, const std::string& sweep_dir,
                                                  const std::set<std::string>& swept) {
  std::map<std::string, InapplicableFlag> everywhere;
  bool first = true;
  for (const TrainConfig& c : s.configs) {
    std::map<std::string, InapplicableFlag> here;
    try {
      TrainConfig trial = c;
      trial.steps = s.max_steps;
      trial.checkpoint_dir = sweep_dir;  // the runner gives every trial a checkpoint directory
      const ModelConfig mc = make_model_config(trial.model, trial.overrides);
      for (const InapplicableFlag& f :
           inapplicable_run_flags(resolve_run_shape(trial, mc, s.devices_per_trial, s.backend), mc))
        here.emplace(f.flag, f);
    } catch (const Error&) {
      continue;
    }
    if (first) everywhere = here;
    else std::erase_if(everywhere, [&](const auto& kv) { return !here.count(kv.first); });
    first = false;
  }
  std::vector<InapplicableFlag> refused;
  for (const auto& [name, f] : everywhere)
    if (!swept.count(name)) refused.push_back(f);
  return refused;
}

}  // namespace

int SweepCommand::run(const std::vector<std::string>& args) {
  const Options& o = *o_;
  // The runner drives every trial from this one process (each trial on its own devices); under a
  // launcher every process would run the whole sweep into the same directory.
  if (const int procs = launched_processes(); procs > 1)
    ZT_THROW(ErrorKind::kInvalidArgument, "sweep runs all its trials from one process (each on its own subset of "
             "--devices), but the launcher started ", procs, " processes; run `zerotrain sweep` without mpirun/srun");
  const std::vector<std::string> names = run_flag_names();
  for (const std::string& n : kSweepOwned)
    ZT_REQUIRE(sub_->get_option("--" + n)->count() == 0, "sweep sets --", n,
               " for each trial itself (under --sweep-dir); leave it out");
  ZT_REQUIRE(!o.space.empty() || !o.space_file.empty(), "sweep needs a search space: --space NAME=SPEC (e.g. "
             "--space lr=1e-3,3e-4) or --space-file FILE");
  const sweep::SearchSpace space = sweep::parse_space(o.space, o.space_file, names);
  std::set<std::string> swept;
  for (const sweep::Dimension& d : space.dims) {
    ZT_REQUIRE(!kNotSweepable.count(d.flag), "--space ", d.flag, ": --", d.flag,
               " cannot be swept (the sweep sets it for every trial; use --devices-per-trial, --max-steps or "
               "--sweep-dir)");
    swept.insert(d.flag);
  }
  // The base flags as given (the swept ones left out), re-parsed with each trial's values.
  const std::vector<std::string> base = given_run_flags(*sub_, names, swept);
  const TrainConfig base_cfg = parse_run(base, {}, "sweep");
  const DeviceSpec spec = parse_device_spec(base_cfg.devices);
  const PlannedDevices pool = planned_devices(spec);
  ZT_REQUIRE(o.devices_per_trial <= pool.count, "--devices-per-trial ", o.devices_per_trial, " is more than the ",
             pool.count, " devices of --devices ", base_cfg.devices, "; lower it or give more devices");
  // A range's ends are values a draw may take: judged by the flag's validator up front.
  for (const sweep::Dimension& d : space.dims) {
    if (d.kind == sweep::Dimension::Kind::kList) continue;
    const bool integer = d.kind == sweep::Dimension::Kind::kInt;
    for (double v : {d.lo, d.hi}) parse_run(base, {{d.flag, range_end(v, integer)}}, "--space " + d.flag);
  }
  const std::vector<sweep::TrialValues> trials = sweep::generate_trials(space, o.trials, base_cfg.seed);
  ZT_REQUIRE(!trials.empty(), "the search space has no trials");

  sweep::SweepSpec s;
  s.dir = o.sweep_dir;
  for (const std::string& a : args) s.command += (s.command.empty() ? "" : " ") + a;
  s.trials = trials;
  for (const sweep::TrialValues& t : trials) {
    char who[32];
    std::snprintf(who, sizeof who, "trial-%03d", t.id);
    s.configs.push_back(parse_run(base, t.values, who + std::string(" (") + sweep::format_values(t.values).substr(1) + ")"));
  }
  s.devices = pool.count;
  s.backend = pool.backend;
  if (pool.backend == Backend::kCuda) {
    s.cuda_ordinals = spec.cuda_ordinals;
    if (s.cuda_ordinals.empty())
      for (int i = 0; i < pool.count; ++i) s.cuda_ordinals.push_back(i);
  }
  s.devices_per_trial = o.devices_per_trial;
  s.asha = o.scheduler == "asha";
  s.eta = o.eta;
  s.order_seed = base_cfg.seed;
  ZT_REQUIRE(o.max_steps == 0 || base_cfg.steps < 0 || base_cfg.steps == o.max_steps, "--steps ", base_cfg.steps,
             " and --max-steps ", o.max_steps, " disagree; a sweep's trials run --max-steps (give one of them)");
  s.max_steps = o.max_steps > 0 ? o.max_steps : base_cfg.steps;
  if (s.max_steps <= 0) {
    const ModelConfig mc = make_model_config(base_cfg.model, base_cfg.overrides);
    s.max_steps = resolve_run_shape(base_cfg, mc, o.devices_per_trial, pool.backend).cfg.steps;
  }
  // Default: as many rungs as successive halving of this many trials has (eta^K <= trials), so that
  // about one trial is promoted past the last rung.
  const int halvings = std::max(1, static_cast<int>(std::floor(std::log(static_cast<double>(trials.size())) /
                                                               std::log(o.eta) + 1e-9)));
  s.min_steps = o.min_steps > 0 ? o.min_steps
                                : std::max(1, static_cast<int>(std::ceil(s.max_steps / std::pow(o.eta, halvings))));
  if (s.asha)
    ZT_REQUIRE(s.min_steps < s.max_steps, "--min-steps ", s.min_steps, " must be below --max-steps ", s.max_steps,
               " for ASHA to have a rung");
  // Flags that do nothing: the scheduler's own without ASHA, and a run flag that no trial's
  // combination uses (a swept value may make it count in some trials: then it stays).
  if (!s.asha)
    for (const char* flag : {"--min-steps", "--eta"})
      ZT_REQUIRE(sub_->count(flag) == 0, flag, " does nothing in this sweep: it needs --scheduler asha; drop it or "
                 "add that");
  refuse_given(*sub_, flags_no_trial_uses(s, o.sweep_dir, swept));
  s.identity = sweep_identity(*sub_, base_cfg, s.max_steps, o.devices_per_trial, pool.backend, swept, trials);
  s.live = !base_cfg.quiet;
  const std::string& plot = f_->plot;
  if (!plot.empty()) check_plot_path(plot);

  const sweep::SweepResult r = sweep::run_sweep(s);
  std::printf("\nleaderboard (%zu trials, %lld steps trained, sorted by validation loss):\n%s", r.trials.size(),
              static_cast<long long>(r.steps_trained), sweep::format_leaderboard(r).c_str());
  if (!plot.empty()) {
    sweep::write_sweep_svg(plot, r, base_cfg.model + " sweep: validation loss per trial");
    std::printf("validation curves: %s\n", plot.c_str());
  }
  std::fflush(stdout);
  if (r.signal != 0) {
    std::fprintf(stderr, "zerotrain: sweep stopped by a signal; run the same command again to continue it\n");
    return 128 + r.signal;
  }
  return 0;
}

}  // namespace zt
