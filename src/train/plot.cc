// Loss curve as SVG: a linear plot with "nice" 1/2/5 ticks, grid, axis labels and a legend.
// Coordinates are written with one decimal; one polyline point per training step.
#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/files.h"
#include "core/status.h"

namespace zt {

namespace {

constexpr double kWidth = 800, kHeight = 480;
constexpr double kLeft = 72, kRight = 24, kTop = 44, kBottom = 58;  // plot-area margins

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

// Tick spacing of 1, 2 or 5 times a power of ten giving about `target` intervals over [lo, hi].
double nice_step(double lo, double hi, int target) {
  const double raw = std::max(hi - lo, 1e-12) / target;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

// Decimals enough to tell ticks `step` apart.
int decimals_for(double step) { return std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9))); }

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
  o += "<text x=\"" + num(kWidth / 2) + "\" y=\"26\" text-anchor=\"middle\" font-size=\"15\">" +
       xml_escape(c.title.empty() ? "loss" : c.title) + "</text>\n";

  // Grid and ticks.
  o += "<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
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
  o += "</g>\n";
  o += "<g stroke=\"#333\" stroke-width=\"1\">\n";
  for (double v = y_lo; v <= y_hi + y_step / 2; v += y_step)
    o += "<line x1=\"" + num(kLeft - 4) + "\" y1=\"" + num(Y(v)) + "\" x2=\"" + num(kLeft) + "\" y2=\"" + num(Y(v)) + "\"/>\n";
  for (double s = 0; s <= x_hi + x_step / 2; s += x_step)
    o += "<line x1=\"" + num(X(s)) + "\" y1=\"" + num(kTop + ph) + "\" x2=\"" + num(X(s)) + "\" y2=\"" + num(kTop + ph + 4) + "\"/>\n";
  o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop) + "\" x2=\"" + num(kLeft) + "\" y2=\"" + num(kTop + ph) + "\"/>\n";
  o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop + ph) + "\" x2=\"" + num(kLeft + pw) + "\" y2=\"" + num(kTop + ph) + "\"/>\n";
  o += "</g>\n";
  o += "<text x=\"" + num(kLeft + pw / 2) + "\" y=\"" + num(kHeight - 14) + "\" text-anchor=\"middle\">step</text>\n";
  o += "<text transform=\"translate(18 " + num(kTop + ph / 2) +
       ") rotate(-90)\" text-anchor=\"middle\">loss (nats)</text>\n";

  // Data.
  if (c.floor)
    o += "<line class=\"floor\" x1=\"" + num(kLeft) + "\" y1=\"" + num(Y(*c.floor)) + "\" x2=\"" + num(kLeft + pw) +
         "\" y2=\"" + num(Y(*c.floor)) + "\" stroke=\"#2ca02c\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>\n";
  o += "<polyline class=\"train\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.2\" stroke-linejoin=\"round\" points=\"";
  for (int i = 0; i < n; ++i) {
    const double v = std::isfinite(c.train[static_cast<size_t>(i)]) ? c.train[static_cast<size_t>(i)] : y_hi;
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
