// The sweep's validation curves as one self-contained SVG, in train/plot.cc's style (same size,
// margins, 1/2/5 ticks, font): every trial that evaluated, the best (lowest final validation loss
// of a finished trial, else of any) drawn thick and labelled, stopped trials faded.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/files.h"
#include "sweep/runner.h"

namespace zt::sweep {

namespace {

constexpr double kWidth = 800, kHeight = 480;
constexpr double kLeft = 72, kRight = 24, kTop = 44, kBottom = 58;

std::string num(double v, int decimals = 1) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

double nice_step(double lo, double hi, int target) {
  const double raw = std::max(hi - lo, 1e-12) / target;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

int decimals_for(double step) { return std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9))); }

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
    const bool fin = t.status == "finished";
    const bool best_fin = best && best->status == "finished";
    if (!best || (fin && !best_fin) || (fin == best_fin && *t.last_val < *best->last_val)) best = &t;
  }
  int x_max = 1;
  double y_lo = INFINITY, y_hi = -INFINITY;
  for (const TrialOutcome& t : r.trials)
    for (const auto& [s, v] : t.val_curve) {
      x_max = std::max(x_max, s);
      if (std::isfinite(v)) y_lo = std::min(y_lo, v), y_hi = std::max(y_hi, v);
    }
  if (!std::isfinite(y_lo)) y_lo = 0, y_hi = 1;
  if (y_hi - y_lo < 1e-9) y_lo -= 0.5, y_hi += 0.5;
  const double y_step = nice_step(y_lo, y_hi, 6);
  y_lo = std::floor(y_lo / y_step) * y_step;
  y_hi = std::ceil(y_hi / y_step) * y_step;
  const double x_step = std::max(1.0, nice_step(0, x_max, 8));
  const double x_hi = std::ceil(x_max / x_step) * x_step;
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto X = [&](double s) { return kLeft + s / x_hi * pw; };
  auto Y = [&](double v) { return kTop + (y_hi - v) / (y_hi - y_lo) * ph; };

  std::string o;
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(kWidth, 0) + "\" height=\"" + num(kHeight, 0) +
       "\" viewBox=\"0 0 " + num(kWidth, 0) + " " + num(kHeight, 0) +
       "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  o += "<rect x=\"0\" y=\"0\" width=\"" + num(kWidth, 0) + "\" height=\"" + num(kHeight, 0) + "\" fill=\"white\"/>\n";
  o += "<text x=\"" + num(kWidth / 2) + "\" y=\"26\" text-anchor=\"middle\" font-size=\"15\">" + xml_escape(title) +
       "</text>\n<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  for (double v = y_lo; v <= y_hi + y_step / 2; v += y_step)
    o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(Y(v)) + "\" x2=\"" + num(kLeft + pw) + "\" y2=\"" + num(Y(v)) + "\"/>\n";
  for (double s = 0; s <= x_hi + x_step / 2; s += x_step)
    o += "<line x1=\"" + num(X(s)) + "\" y1=\"" + num(kTop) + "\" x2=\"" + num(X(s)) + "\" y2=\"" + num(kTop + ph) + "\"/>\n";
  o += "</g>\n<g fill=\"#333\">\n";
  const int yd = decimals_for(y_step);
  for (double v = y_lo; v <= y_hi + y_step / 2; v += y_step)
    o += "<text x=\"" + num(kLeft - 8) + "\" y=\"" + num(Y(v) + 4) + "\" text-anchor=\"end\">" + num(v, yd) + "</text>\n";
  for (double s = 0; s <= x_hi + x_step / 2; s += x_step)
    o += "<text x=\"" + num(X(s)) + "\" y=\"" + num(kTop + ph + 18) + "\" text-anchor=\"middle\">" + num(s, 0) + "</text>\n";
  o += "</g>\n<g stroke=\"#333\" stroke-width=\"1\">\n";
  o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop) + "\" x2=\"" + num(kLeft) + "\" y2=\"" + num(kTop + ph) + "\"/>\n";
  o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop + ph) + "\" x2=\"" + num(kLeft + pw) + "\" y2=\"" +
       num(kTop + ph) + "\"/>\n</g>\n";
  o += "<text x=\"" + num(kLeft + pw / 2) + "\" y=\"" + num(kHeight - 14) + "\" text-anchor=\"middle\">step</text>\n";
  o += "<text transform=\"translate(18 " + num(kTop + ph / 2) +
       ") rotate(-90)\" text-anchor=\"middle\">validation loss (nats)</text>\n";
  // The best last, so that it is drawn on top.
  std::vector<const TrialOutcome*> order;
  for (const TrialOutcome& t : r.trials)
    if (!t.val_curve.empty() && &t != best) order.push_back(&t);
  if (best) order.push_back(best);
  for (const TrialOutcome* t : order) {
    const bool is_best = t == best, faded = t->status != "finished";
    const std::string cls = is_best ? "best" : faded ? "stopped" : "trial";
    o += "<polyline class=\"" + cls + "\" data-trial=\"" + std::to_string(t->id) + "\" fill=\"none\" stroke=\"" +
         (is_best ? std::string("#d62728") : color_of(t->id)) + "\" stroke-width=\"" + (is_best ? "3" : "1.2") +
         "\" stroke-opacity=\"" + (faded && !is_best ? "0.3" : "0.9") + "\" points=\"";
    for (size_t i = 0; i < t->val_curve.size(); ++i) {
      const double v = std::isfinite(t->val_curve[i].second) ? t->val_curve[i].second : y_hi;
      o += (i ? " " : "") + num(X(t->val_curve[i].first)) + "," + num(Y(v));
    }
    o += "\"/>\n";
    // Points too: a trial stopped at the first rung has a curve of one point.
    o += "<g fill=\"" + (is_best ? std::string("#d62728") : color_of(t->id)) + "\" fill-opacity=\"" +
         (faded && !is_best ? "0.4" : "0.9") + "\">";
    for (const auto& [s, v] : t->val_curve)
      o += "<circle cx=\"" + num(X(s)) + "\" cy=\"" + num(Y(std::isfinite(v) ? v : y_hi)) + "\" r=\"" +
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
