// Error construction; kept out of line so throwing sites stay small.
#include "core/status.h"

namespace zt {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInternal: return "internal error";
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kOutOfMemory: return "out of memory";
    case ErrorKind::kDevice: return "device error";
    case ErrorKind::kIo: return "I/O error";
    case ErrorKind::kDiverged: return "training diverged";
    case ErrorKind::kLostProcess: return "lost process";
  }
  return "error";
}

static std::string with_location(const std::string& message, const char* file, int line) {
  if (!file) return message;
  return message + " [" + file + ":" + std::to_string(line) + "]";
}

Error::Error(ErrorKind kind, std::string message, const char* file, int line)
    : std::runtime_error(with_location(message, file, line)),
      kind_(kind),
      message_(std::move(message)),
      file_(file),
      line_(line) {}

namespace detail {
void throw_error(ErrorKind kind, const char* file, int line, std::string message) {
  throw Error(kind, std::move(message), file, line);
}
}  // namespace detail

}  // namespace zt
