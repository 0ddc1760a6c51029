// What the SVG plots share (train/plot.cc's loss curve, sweep/sweep_plot.cc's validation curves):
// the frame's size and margins, number formatting, XML escaping and "nice" 1/2/5 tick spacing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace zt::svg {

inline constexpr double kWidth = 800, kHeight = 480;
inline constexpr double kLeft = 72, kRight = 24, kTop = 44, kBottom = 58;  // plot-area margins

inline std::string num(double v, int decimals = 1) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

inline std::string xml_escape(const std::string& s) {
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
inline double nice_step(double lo, double hi, int target) {
  const double raw = std::max(hi - lo, 1e-12) / target;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

// Decimals enough to tell ticks `step` apart.
inline int decimals_for(double step) { return std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9))); }

// The plot area's data ranges snapped to nice ticks, and the data-to-pixel maps.
struct Axes {
  double y_lo = 0, y_hi = 1, y_step = 1, x_hi = 1, x_step = 1;
  double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;  // plot area in pixels
  double X(double step) const { return kLeft + step / x_hi * pw; }
  double Y(double v) const { return kTop + (y_hi - v) / (y_hi - y_lo) * ph; }
};

// y over [y_lo, y_hi] (no finite value: 0..1), x over steps [0, x_max].
inline Axes make_axes(double y_lo, double y_hi, int x_max) {
  Axes a;
  if (!std::isfinite(y_lo)) y_lo = 0, y_hi = 1;
  if (y_hi - y_lo < 1e-9) y_lo -= 0.5, y_hi += 0.5;
  a.y_step = nice_step(y_lo, y_hi, 6);
  a.y_lo = std::floor(y_lo / a.y_step) * a.y_step;
  a.y_hi = std::ceil(y_hi / a.y_step) * a.y_step;
  a.x_step = std::max(1.0, nice_step(0, std::max(x_max, 1), 8));
  a.x_hi = std::ceil(std::max(x_max, 1) / a.x_step) * a.x_step;
  return a;
}

// The document up to the data: <svg> on a white background, the title, grid, tick marks and
// labels, axes, "step" under the x axis and `y_label` beside the y axis. Close it with "</svg>\n".
inline std::string open_frame(const Axes& a, const std::string& title, const std::string& y_label) {
  const double pw = a.pw, ph = a.ph;
  std::string o;
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(kWidth, 0) + "\" height=\"" + num(kHeight, 0) +
       "\" viewBox=\"0 0 " + num(kWidth, 0) + " " + num(kHeight, 0) +
       "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  o += "<rect x=\"0\" y=\"0\" width=\"" + num(kWidth, 0) + "\" height=\"" + num(kHeight, 0) + "\" fill=\"white\"/>\n";
  o += "<text x=\"" + num(kWidth / 2) + "\" y=\"26\" text-anchor=\"middle\" font-size=\"15\">" + xml_escape(title) +
       "</text>\n";
  o += "<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  for (double v = a.y_lo; v <= a.y_hi + a.y_step / 2; v += a.y_step)
    o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(a.Y(v)) + "\" x2=\"" + num(kLeft + pw) + "\" y2=\"" + num(a.Y(v)) + "\"/>\n";
  for (double s = 0; s <= a.x_hi + a.x_step / 2; s += a.x_step)
    o += "<line x1=\"" + num(a.X(s)) + "\" y1=\"" + num(kTop) + "\" x2=\"" + num(a.X(s)) + "\" y2=\"" + num(kTop + ph) + "\"/>\n";
  o += "</g>\n<g fill=\"#333\">\n";
  const int yd = decimals_for(a.y_step);
  for (double v = a.y_lo; v <= a.y_hi + a.y_step / 2; v += a.y_step)
    o += "<text x=\"" + num(kLeft - 8) + "\" y=\"" + num(a.Y(v) + 4) + "\" text-anchor=\"end\">" + num(v, yd) + "</text>\n";
  for (double s = 0; s <= a.x_hi + a.x_step / 2; s += a.x_step)
    o += "<text x=\"" + num(a.X(s)) + "\" y=\"" + num(kTop + ph + 18) + "\" text-anchor=\"middle\">" + num(s, 0) + "</text>\n";
  o += "</g>\n<g stroke=\"#333\" stroke-width=\"1\">\n";
  for (double v = a.y_lo; v <= a.y_hi + a.y_step / 2; v += a.y_step)
    o += "<line x1=\"" + num(kLeft - 4) + "\" y1=\"" + num(a.Y(v)) + "\" x2=\"" + num(kLeft) + "\" y2=\"" + num(a.Y(v)) + "\"/>\n";
  for (double s = 0; s <= a.x_hi + a.x_step / 2; s += a.x_step)
    o += "<line x1=\"" + num(a.X(s)) + "\" y1=\"" + num(kTop + ph) + "\" x2=\"" + num(a.X(s)) + "\" y2=\"" + num(kTop + ph + 4) + "\"/>\n";
  o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop) + "\" x2=\"" + num(kLeft) + "\" y2=\"" + num(kTop + ph) + "\"/>\n";
  o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop + ph) + "\" x2=\"" + num(kLeft + pw) + "\" y2=\"" + num(kTop + ph) + "\"/>\n";
  o += "</g>\n";
  o += "<text x=\"" + num(kLeft + pw / 2) + "\" y=\"" + num(kHeight - 14) + "\" text-anchor=\"middle\">step</text>\n";
  o += "<text transform=\"translate(18 " + num(kTop + ph / 2) + ") rotate(-90)\" text-anchor=\"middle\">" +
       xml_escape(y_label) + "</text>\n";
  return o;
}

}  // namespace zt::svg
