// The loss curve of a run as a self-contained SVG (no dependencies, no scripts, no external
// fonts): training loss per step, evaluation points, and the data's entropy floor when known.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zt {

struct LossCurve {
  std::vector<double> train;                 // loss of step i+1 at index i
  std::vector<std::pair<int, double>> eval;  // (step, validation loss)
  std::optional<double> floor;               // best reachable loss (synthetic data), dashed
  std::string title;
};

// The SVG document. The training curve is one <polyline> with one point per step.
std::string loss_curve_svg(const LossCurve& curve);

// Fails early (before training) with one sentence (kInvalidArgument) when `path` cannot be
// written: a missing or read-only folder, or something other than a regular file at the path.
void check_plot_path(const std::string& path);
// Replaces `path` with the SVG atomically (core/files.h AtomicFile); a failed write, fsync or
// rename throws zt::Error(kIo) naming the file.
void write_loss_curve_svg(const std::string& path, const LossCurve& curve);

}  // namespace zt
