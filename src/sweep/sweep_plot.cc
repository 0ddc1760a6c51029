// The sweep's validation curves as one self-contained SVG, in train/plot.cc's style (same size,
// margins, 1/2/5 ticks, font): every trial that evaluated, the best (lowest final validation loss
// of a finished trial, else of any) drawn thick and labelled, stopped trials faded.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/files.h"
#include "sweep/runner.h"
#include "train/svg.h"

namespace zt::sweep {

namespace {

using namespace svg;  // train/svg.h: frame, num, xml_escape, nice_step, decimals_for

// Ten distinguishable colours (matplotlib's tab10); trial id picks one.
const char* color_of(int id) {
  static const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  return kColors[id % 10];
}

}  // namespace

std::string sweep_curves_svg(const SweepResult& r, const std::string& title) {
  const TrialOutcome* best = nullptr;
  for (const TrialOutcome& t : r.trials) {
    if (!t.last_val || t.val_curve.empty()) continue;
    const bool fin = t.status == TrialStatus::kFinished;
    const bool best_fin = best && best->status == TrialStatus::kFinished;
    if (!best || (fin && !best_fin) || (fin == best_fin && *t.last_val < *best->last_val)) best = &t;
  }
  int x_max = 1;
  double y_lo = INFINITY, y_hi = -INFINITY;
  for (const TrialOutcome& t : r.trials)
    for (const auto& [s, v] : t.val_curve) {
      x_max = std::max(x_max, s);
      if (std::isfinite(v)) y_lo = std::min(y_lo, v), y_hi = std::max(y_hi, v);
    }
  const Axes ax = make_axes(y_lo, y_hi, x_max);
  const double pw = ax.pw;
  auto X = [&](double s) { return ax.X(s); };
  auto Y = [&](double v) { return ax.Y(v); };
  std::string o = open_frame(ax, title, "validation loss (nats)");
  // The best last, so that it is drawn on top.
  std::vector<const TrialOutcome*> order;
  for (const TrialOutcome& t : r.trials)
    if (!t.val_curve.empty() && &t != best) order.push_back(&t);
  if (best) order.push_back(best);
  for (const TrialOutcome* t : order) {
    const bool is_best = t == best, faded = t->status != TrialStatus::kFinished;
    const std::string cls = is_best ? "best" : faded ? "stopped" : "trial";
    o += "<polyline class=\"" + cls + "\" data-trial=\"" + std::to_string(t->id) + "\" fill=\"none\" stroke=\"" +
         (is_best ? std::string("#d62728") : color_of(t->id)) + "\" stroke-width=\"" + (is_best ? "3" : "1.2") +
         "\" stroke-opacity=\"" + (faded && !is_best ? "0.3" : "0.9") + "\" points=\"";
    for (size_t i = 0; i < t->val_curve.size(); ++i) {
      const double v = std::isfinite(t->val_curve[i].second) ? t->val_curve[i].second : ax.y_hi;
      if (i) o += ' ';
      o += num(X(t->val_curve[i].first)) + "," + num(Y(v));
    }
    o += "\"/>\n";
    // Points too: a trial stopped at the first rung has a curve of one point.
    o += "<g fill=\"" + (is_best ? std::string("#d62728") : color_of(t->id)) + "\" fill-opacity=\"" +
         (faded && !is_best ? "0.4" : "0.9") + "\">";
    for (const auto& [s, v] : t->val_curve)
      o += "<circle cx=\"" + num(X(s)) + "\" cy=\"" + num(Y(std::isfinite(v) ? v : ax.y_hi)) + "\" r=\"" +
           (is_best ? "3.5" : "2.5") + "\"/>";
    o += "</g>\n";
  }
  if (best) {
    const auto& [s, v] = best->val_curve.back();
    o += "<text class=\"best-label\" x=\"" + num(std::min(X(s), kLeft + pw - 4)) + "\" y=\"" + num(Y(v) - 8) +
         "\" text-anchor=\"end\" fill=\"#d62728\">best: trial " + std::to_string(best->id) +
         xml_escape(format_values(best->values)) + " (" + num(v, 4) + ")</text>\n";
  }
  o += "<text x=\"" + num(kLeft + pw - 4) + "\" y=\"" + num(kTop + 16) +
       "\" text-anchor=\"end\" fill=\"#666\">faded: stopped early or failed</text>\n</svg>\n";
  return o;
}

void write_sweep_svg(const std::string& path, const SweepResult& result, const std::string& title) {
  write_file_atomic(path, sweep_curves_svg(result, title), "--plot file");
}

}  // namespace zt::sweep
