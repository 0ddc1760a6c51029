// Errors with context: zt::Error carries where it was raised and what was being done.
// Library code throws; only apps/ turns an error into an exit code (see apps/zerotrain.cc).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace zt {

// Category lets callers (the app, recovery code) react without parsing messages.
enum class ErrorKind {
  kInternal,      // a bug: an invariant did not hold
  kInvalidArgument,  // a user's mistake: bad flag, bad spec, bad file
  kOutOfMemory,   // a device pool could not satisfy a request
  kDevice,        // a device (real or simulated) reported a failure
  kIo,            // file system errors
  kDiverged,      // training cannot go on: the loss scale collapsed, or too many steps overflowed
  kLostProcess,   // another process of a multi-process run died or stalled (the survivors stop)
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message, const char* file = nullptr, int line = 0);
  ErrorKind kind() const { return kind_; }
  // The message without the source location: the sentence a user is shown.
  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  ErrorKind kind_;
  std::string message_;
  const char* file_;
  int line_;
};

namespace detail {
// Builds a message from any streamable arguments: ZT_CHECK(x > 0, "x=", x).
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, std::string message);
}  // namespace detail

}  // namespace zt

#define ZT_THROW(kind, ...) \
  ::zt::detail::throw_error((kind), __FILE__, __LINE__, ::zt::detail::concat(__VA_ARGS__))

// Internal invariant; a failure is a bug in ZeroTrain.
#define ZT_CHECK(cond, ...)                                                               \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::zt::detail::throw_error(::zt::ErrorKind::kInternal, __FILE__, __LINE__,           \
                                ::zt::detail::concat("check failed: " #cond ". ", ##__VA_ARGS__)); \
  } while (0)

// User-facing precondition; the message is the sentence the user reads.
#define ZT_REQUIRE(cond, ...)                                                             \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::zt::detail::throw_error(::zt::ErrorKind::kInvalidArgument, __FILE__, __LINE__,    \
                                ::zt::detail::concat(__VA_ARGS__));                       \
  } while (0)
