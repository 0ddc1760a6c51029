// Run output: metrics records and text (see logger.h).
#include "train/logger.h"

#include <unistd.h>


#include "core/status.h"

namespace zt {

Logger::Logger(const std::string& metrics_path, bool json_stdout, bool quiet)
    : json_stdout_(json_stdout && !quiet), text_(!quiet && !json_stdout), tty_(isatty(STDOUT_FILENO) != 0) {
  if (!metrics_path.empty()) metrics_ = OutputStream::open(metrics_path, "--metrics file");
}

void Logger::emit(const nlohmann::json& record) {
  const std::string s = record.dump();
  std::lock_guard<std::mutex> lock(mu_);
  if (json_stdout_) write_stdout_line(s);  // checked: a full or closed stdout is an error
  if (metrics_) metrics_->write_line(s);
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
  if (metrics_) metrics_->close();
}


}  // namespace zt
