// Run output: metrics records and text (see logger.h).
#include "train/logger.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/status.h"

namespace zt {

Logger::Logger(const std::string& metrics_path, bool json_stdout, bool quiet)
    : path_(metrics_path), json_stdout_(json_stdout && !quiet), text_(!quiet && !json_stdout),
      tty_(isatty(STDOUT_FILENO) != 0) {
  if (!path_.empty()) {
    metrics_ = std::fopen(path_.c_str(), "w");
    ZT_REQUIRE(metrics_, "cannot write --metrics file '", path_, "': ", std::strerror(errno));
  }
}

Logger::~Logger() {
  if (metrics_) std::fclose(metrics_);
}

void Logger::emit(const nlohmann::json& record) {
  const std::string s = record.dump() + "\n";
  std::lock_guard<std::mutex> lock(mu_);
  if (json_stdout_ && (std::fputs(s.c_str(), stdout) == EOF || std::fflush(stdout) != 0))
    ZT_THROW(ErrorKind::kIo, "cannot write the JSON log to standard output: ", std::strerror(errno));
  if (metrics_ && (std::fputs(s.c_str(), metrics_) == EOF || std::fflush(metrics_) != 0))
    ZT_THROW(ErrorKind::kIo, "cannot write --metrics file '", path_, "': ", std::strerror(errno));
}

void Logger::line(const std::string& s) {
  if (!text_) return;
  std::lock_guard<std::mutex> lock(mu_);
  std::printf("%s%s\n", mid_progress_ ? "\n" : "", s.c_str());
  mid_progress_ = false;
  std::fflush(stdout);
}

void Logger::progress(const std::string& s) {
  if (!text_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (tty_) {
    std::printf("\r%s   ", s.c_str());
    mid_progress_ = true;
  } else {
    std::printf("%s\n", s.c_str());
  }
  std::fflush(stdout);
}

void Logger::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!metrics_) return;
  const bool ok = std::fflush(metrics_) == 0 && fsync(fileno(metrics_)) == 0;
  const int err = errno;
  const bool closed = std::fclose(metrics_) == 0;
  metrics_ = nullptr;
  if (!ok || !closed) ZT_THROW(ErrorKind::kIo, "cannot write --metrics file '", path_, "': ", std::strerror(err));
}

std::string si(double v) {
  char buf[32];
  if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

}  // namespace zt
