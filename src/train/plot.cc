// Loss curve as SVG: a linear plot with "nice" 1/2/5 ticks, grid, axis labels and a legend.
// Coordinates are written with one decimal; one polyline point per training step.
#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/files.h"
#include "train/svg.h"
#include "core/status.h"

namespace zt {

namespace {

using namespace svg;  // train/svg.h: frame, num, xml_escape, nice_step, decimals_for

}  // namespace

std::string loss_curve_svg(const LossCurve& c) {
  // Data ranges: x over steps [0, n], y over every finite value shown (floor included).
  const int n = static_cast<int>(c.train.size());
  int x_max = std::max(n, 1);
  for (const auto& [s, v] : c.eval) x_max = std::max(x_max, s);
  double y_lo = INFINITY, y_hi = -INFINITY;
  auto take = [&](double v) {
    if (std::isfinite(v)) y_lo = std::min(y_lo, v), y_hi = std::max(y_hi, v);
  };
  for (double v : c.train) take(v);
  for (const auto& e : c.eval) take(e.second);
  if (c.floor) take(*c.floor);
  const Axes ax = make_axes(y_lo, y_hi, x_max);
  const double pw = ax.pw;
  auto X = [&](double s) { return ax.X(s); };
  auto Y = [&](double v) { return ax.Y(v); };
  std::string o = open_frame(ax, c.title.empty() ? "loss" : c.title, "loss (nats)");

  // Data.
  if (c.floor)
    o += "<line class=\"floor\" x1=\"" + num(kLeft) + "\" y1=\"" + num(Y(*c.floor)) + "\" x2=\"" + num(kLeft + pw) +
         "\" y2=\"" + num(Y(*c.floor)) + "\" stroke=\"#2ca02c\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>\n";
  o += "<polyline class=\"train\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.2\" stroke-linejoin=\"round\" points=\"";
  for (int i = 0; i < n; ++i) {
    const double v = std::isfinite(c.train[static_cast<size_t>(i)]) ? c.train[static_cast<size_t>(i)] : ax.y_hi;
    if (i) o += ' ';
    o += num(X(i + 1)) + "," + num(Y(v));
  }
  o += "\"/>\n";
  if (!c.eval.empty()) {
    o += "<polyline class=\"eval\" fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"1.5\" points=\"";
    for (size_t i = 0; i < c.eval.size(); ++i) {
      if (i) o += ' ';
      o += num(X(c.eval[i].first)) + "," + num(Y(c.eval[i].second));
    }
    o += "\"/>\n<g fill=\"#ff7f0e\">\n";
    for (const auto& [s, v] : c.eval) o += "<circle cx=\"" + num(X(s)) + "\" cy=\"" + num(Y(v)) + "\" r=\"3.5\"/>\n";
    o += "</g>\n";
  }

  // Legend, top right inside the plot area.
  struct Entry { const char* label; const char* color; const char* dash; bool dot; };
  std::vector<Entry> entries = {{"train loss", "#1f77b4", "", false}};
  if (!c.eval.empty()) entries.push_back({"validation loss", "#ff7f0e", "", true});
  if (c.floor) entries.push_back({"entropy floor", "#2ca02c", "6 4", false});
  const double lw = 190, lh = 10 + 20.0 * static_cast<double>(entries.size());
  const double lx = kLeft + pw - lw - 10, ly = kTop + 10;
  o += "<g class=\"legend\">\n<rect x=\"" + num(lx) + "\" y=\"" + num(ly) + "\" width=\"" + num(lw) + "\" height=\"" +
       num(lh) + "\" fill=\"white\" fill-opacity=\"0.9\" stroke=\"#999\"/>\n";
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const double y = ly + 18 + 20.0 * static_cast<double>(i);
    o += "<line x1=\"" + num(lx + 10) + "\" y1=\"" + num(y - 4) + "\" x2=\"" + num(lx + 40) + "\" y2=\"" + num(y - 4) +
         "\" stroke=\"" + e.color + "\" stroke-width=\"2\"" + (*e.dash ? std::string(" stroke-dasharray=\"") + e.dash + "\"" : "") + "/>\n";
    if (e.dot) o += "<circle cx=\"" + num(lx + 25) + "\" cy=\"" + num(y - 4) + "\" r=\"3.5\" fill=\"" + e.color + "\"/>\n";
    std::string label = e.label;
    if (c.floor && std::string(e.label) == "entropy floor") label += " (" + num(*c.floor, 4) + ")";
    o += "<text x=\"" + num(lx + 48) + "\" y=\"" + num(y) + "\">" + xml_escape(label) + "</text>\n";
  }
  o += "</g>\n</svg>\n";
  return o;
}

void check_plot_path(const std::string& path) { check_output_path(path, "--plot file"); }

void write_loss_curve_svg(const std::string& path, const LossCurve& curve) {
  write_file_atomic(path, loss_curve_svg(curve), "--plot file");
}

}  // namespace zt
