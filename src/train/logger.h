// Run output: the metrics records (JSON lines to --metrics and, with --log-format json, to stdout)
// and the human-readable text (header, progress line, evaluations, notes). One object owns both so
// that the loop says what happened once and the format decides how it is shown.
#pragma once

#include <cstdio>
#include <mutex>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/files.h"

namespace zt {

class Logger {
 public:
  // metrics_path: "" = no metrics file. json_stdout: the records go to stdout, and no text.
  // quiet: neither text nor JSON on stdout (tests).
  Logger(const std::string& metrics_path, bool json_stdout, bool quiet);
  Logger(const Logger&) = delete;
  Logger& operator=(const Logger&) = delete;

  // One record; thread-safe (the background checkpoint writer emits too). A failed write (full
  // disk, closed stdout) throws zt::Error(kIo) naming the destination.
  void emit(const nlohmann::json& record);
  // Text output (suppressed with json_stdout or quiet). `line` is printed on its own line; on a
  // terminal the progress line is redrawn in place and other lines start below it.
  bool text() const { return text_; }
  bool tty() const { return tty_; }
  void line(const std::string& s);
  void progress(const std::string& s);
  // Flushes and closes the metrics file, checking that everything reached it.
  void close();

 private:
  std::optional<OutputStream> metrics_;
  bool json_stdout_ = false, text_ = true, tty_ = false, mid_progress_ = false;
  std::mutex mu_;
};

}  // namespace zt
