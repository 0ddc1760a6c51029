// core/files.h: the input opener refuses FIFOs and devices without blocking and turns a file
// truncated while open into zt::Error; the writers refuse to replace anything but a regular file
// (leaving it as it was) and report every failed write, including standard output.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/files.h"
#include "core/status.h"
#include "test_util.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using test_util::TempDir;

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Runs f, which must throw zt::Error of `kind` whose message contains every part; returns it.
template <typename F>
std::string expect_error(F&& f, ErrorKind kind, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& p : parts) EXPECT_THAT(e.message(), HasSubstr(p));
    return e.message();
  }
  ADD_FAILURE() << "expected zt::Error(" << error_kind_name(kind) << ") mentioning '" << *parts.begin() << "'";
  return {};
}

unsigned file_type(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & S_IFMT;
}

// Runs body in a forked child (it may change stdout, signal dispositions or limits) and returns
// its exit status; the child exits 0 when body returns true.
template <typename F>
int in_child(F&& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    bool ok = false;
    try {
      ok = body();
    } catch (...) {
      ok = false;
    }
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// ---- InputFile --------------------------------------------------------------------------------

TEST(InputFile, ReadsARegularFileBoundedByItsSizeAtOpen) {
  TempDir dir;
  const std::string path = dir.path("a.bin");
  std::string text;
  for (int i = 0; i < 5000; ++i) text += static_cast<char>((i * 7 + 3) & 0xff);
  write_text(path, text);
  const InputFile f = InputFile::open(path, "test file");
  EXPECT_EQ(f.size(), text.size());
  const std::vector<uint8_t> all = f.read_all();
  EXPECT_EQ(std::string(all.begin(), all.end()), text);
  char mid[10];
  f.read_at(4990, mid, 10);
  EXPECT_EQ(std::string(mid, 10), text.substr(4990));
  // Growth after open is not read: the size was fixed at open.
  std::ofstream(path, std::ios::app) << "more";
  EXPECT_EQ(f.read_all().size(), text.size());
  expect_error([&] { f.read_at(4995, mid, 10); }, ErrorKind::kInvalidArgument, {path, "beyond the end", "5000-byte"});
  expect_error([&] { f.read_all(100); }, ErrorKind::kInvalidArgument, {path, "5000 bytes", "100-byte limit"});
}

TEST(InputFile, TruncatedWhileOpenIsAnErrorNotSigbus) {
  TempDir dir;
  const std::string path = dir.path("shrinks.bin");
  write_text(path, std::string(1 << 16, 'x'));
  const InputFile f = InputFile::open(path, "token shard");
  ASSERT_EQ(::truncate(path.c_str(), 1000), 0);
  std::vector<char> buf(4096);
  f.read_at(0, buf.data(), 1000);  // what is still there reads fine
  expect_error([&] { f.read_at(60000, buf.data(), 4096); }, ErrorKind::kIo,
               {path, "token shard", "65536 bytes when it was opened", "truncated"});
  expect_error([&] { f.read_all(); }, ErrorKind::kIo, {path, "now ends at byte 1000"});
}

TEST(InputFile, RefusesFifosWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.path("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { InputFile::open(fifo, "text file"); }, ErrorKind::kInvalidArgument,
               {fifo, "FIFO", "not a regular file"});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(file_type(fifo), static_cast<unsigned>(S_IFIFO));
}

TEST(InputFile, RefusesDevicesDirectoriesAndMissingFiles) {
  for (const char* dev : {"/dev/zero", "/dev/urandom", "/dev/null"}) {
    if (::access(dev, R_OK) != 0) continue;
    expect_error([&] { InputFile::open(dev, "text file"); }, ErrorKind::kInvalidArgument,
                 {dev, "character device", "not a regular file"});
  }
  TempDir dir;
  expect_error([&] { InputFile::open(dir.str(), "text file"); }, ErrorKind::kInvalidArgument, {dir.str(), "directory"});
  expect_error([&] { InputFile::open(dir.path("nope"), "text file"); }, ErrorKind::kInvalidArgument,
               {dir.path("nope"), "missing", "No such file"});
  // open_at without following links refuses a symbolic link; following is the default for inputs.
  write_text(dir.path("real"), "abc");
  fs::create_symlink(dir.path("real"), dir.path("link"));
  EXPECT_EQ(InputFile::open(dir.path("link"), "text file").size(), 3u);
  const UniqueFd d(::open(dir.str().c_str(), O_RDONLY | O_DIRECTORY));
  expect_error([&] { InputFile::open_at(d.get(), "link", "ck: link", false); }, ErrorKind::kInvalidArgument,
               {"ck: link", "symbolic link"});
  EXPECT_EQ(InputFile::open_at(d.get(), "real", "ck: real", false).size(), 3u);
}

// ---- writers: refusing what is not a regular file -----------------------------------------------

TEST(OutputFiles, RefuseAFifoAndLeaveIt) {
  TempDir dir;
  const std::string fifo = dir.path("metrics.jsonl");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { check_output_path(fifo, "--metrics file"); }, ErrorKind::kInvalidArgument,
               {"--metrics file '" + fifo + "'", "FIFO", "not a regular file"});
  expect_error([&] { OutputStream::open(fifo, "--metrics file"); }, ErrorKind::kInvalidArgument, {fifo, "FIFO"});
  expect_error([&] { write_file_atomic(fifo, "x", "--plot file"); }, ErrorKind::kInvalidArgument, {fifo, "FIFO"});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(file_type(fifo), static_cast<unsigned>(S_IFIFO));
  EXPECT_EQ(dir.names(), std::vector<std::string>{"metrics.jsonl"});  // no temporary file left
}

TEST(OutputFiles, RefuseASymlinkAndADirectoryAndLeaveThem) {
  TempDir dir;
  const std::string target = dir.path("target.txt");
  write_text(target, "precious");
  const std::string link = dir.path("out.svg");
  fs::create_symlink(target, link);
  expect_error([&] { OutputStream::open(link, "--trace file"); }, ErrorKind::kInvalidArgument, {link, "symbolic link"});
  expect_error([&] { write_file_atomic(link, "new", "--plot file"); }, ErrorKind::kInvalidArgument, {link, "symbolic link"});
  EXPECT_EQ(file_type(link), static_cast<unsigned>(S_IFLNK));
  EXPECT_EQ(fs::read_symlink(link).string(), target);
  EXPECT_EQ(read_text(target), "precious");

  const std::string sub = dir.path("sub");
  fs::create_directory(sub);
  write_text(sub + "/keep", "k");
  expect_error([&] { OutputStream::open(sub, "--metrics file"); }, ErrorKind::kInvalidArgument, {sub, "directory"});
  expect_error([&] { AtomicFile(sub, "--out file"); }, ErrorKind::kInvalidArgument, {sub, "directory"});
  EXPECT_EQ(file_type(sub), static_cast<unsigned>(S_IFDIR));
  EXPECT_EQ(read_text(sub + "/keep"), "k");
  expect_error([&] { check_output_path(dir.path("no/such/dir/x"), "--plot file"); }, ErrorKind::kInvalidArgument,
               {"does not exist"});
  EXPECT_EQ(dir.names(), (std::vector<std::string>{"out.svg", "sub", "target.txt"}));
}

TEST(OutputFiles, RefuseDeviceNodesAndLeaveThemCharacterDevices) {
  for (const char* dev : {"/dev/null", "/dev/full"}) {
    if (::access(dev, F_OK) != 0) continue;
    ASSERT_EQ(file_type(dev), static_cast<unsigned>(S_IFCHR));
    expect_error([&] { OutputStream::open(dev, "--metrics file"); }, ErrorKind::kInvalidArgument,
                 {dev, "character device"});
    expect_error([&] { AtomicFile(dev, "--out file"); }, ErrorKind::kInvalidArgument, {dev, "character device"});
    expect_error([&] { write_file_atomic(dev, "weights", "--out file"); }, ErrorKind::kInvalidArgument, {dev});
    EXPECT_EQ(file_type(dev), static_cast<unsigned>(S_IFCHR)) << dev << " must stay a device node";
  }
}

TEST(OutputFiles, AtomicCommitLooksAgainBeforeTheRename) {
  TempDir dir;
  const std::string path = dir.path("weights.safetensors");
  AtomicFile f(path, "--out file");
  f.write("data");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);  // appears while the file is being written
  expect_error([&] { f.commit(); }, ErrorKind::kInvalidArgument, {path, "FIFO"});
  EXPECT_EQ(file_type(path), static_cast<unsigned>(S_IFIFO));
}

// ---- writers: what they write, and failures ---------------------------------------------------

TEST(OutputFiles, StreamTruncatesARegularFileAndWritesLines) {
  TempDir dir;
  const std::string path = dir.path("run.jsonl");
  write_text(path, "old content that is longer than the new one\n");
  OutputStream s = OutputStream::open(path, "--metrics file");
  s.write_line("{\"step\":1}");
  s.write_line("{\"step\":2}");
  EXPECT_EQ(read_text(path), "{\"step\":1}\n{\"step\":2}\n");  // unbuffered: visible at once
  s.close();
  s.close();  // idempotent
  EXPECT_FALSE(s.is_open());
  EXPECT_EQ(read_text(path), "{\"step\":1}\n{\"step\":2}\n");
}

TEST(OutputFiles, AtomicReplacesOrLeavesTheOldFile) {
  TempDir dir;
  const std::string path = dir.path("loss.svg");
  write_text(path, "old");
  {
    AtomicFile f(path, "--plot file");
    f.write("half-written");
    EXPECT_EQ(read_text(path), "old");
  }  // destroyed uncommitted
  EXPECT_EQ(read_text(path), "old");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"loss.svg"});
  write_file_atomic(path, "<svg/>", "--plot file");
  EXPECT_EQ(read_text(path), "<svg/>");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"loss.svg"});
}

TEST(OutputFiles, WriteOntoDevFullIsAnIoError) {
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no /dev/full";
  const UniqueFd fd(::open("/dev/full", O_WRONLY));
  ASSERT_TRUE(fd);
  expect_error([&] { write_all(fd.get(), "x", 1, "--metrics file '/dev/full'"); }, ErrorKind::kIo,
               {"/dev/full", "No space left on device", "free some space"});
}

TEST(OutputFiles, AFailedWriteToARegularFileThrows) {
  // A file-size limit makes the kernel refuse the write (EFBIG), as a full disk would (ENOSPC).
  TempDir dir;
  const std::string path = dir.path("big.jsonl");
  const std::string atomic_path = dir.path("big.safetensors");
  const int status = in_child([&] {
    std::signal(SIGXFSZ, SIG_IGN);
    const rlimit lim{1000, 1000};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return false;
    bool stream_threw = false, atomic_threw = false;
    OutputStream s = OutputStream::open(path, "--metrics file");
    s.write_line(std::string(500, 'a'));
    try {
      s.write_line(std::string(800, 'b'));
    } catch (const Error& e) {
      stream_threw = e.kind() == ErrorKind::kIo && e.message().find(path) != std::string::npos &&
                     e.message().find("writing failed") != std::string::npos;
    }
    try {
      AtomicFile f(atomic_path, "--out file");
      f.write(std::string(2000, 'c'));
      f.commit();
    } catch (const Error& e) {
      atomic_threw = e.kind() == ErrorKind::kIo && e.message().find(atomic_path) != std::string::npos;
    }
    return stream_threw && atomic_threw;
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_FALSE(fs::exists(atomic_path));
  EXPECT_EQ(dir.names(), std::vector<std::string>{"big.jsonl"});  // no temporary file left
}

// ---- standard output ----------------------------------------------------------------------------

TEST(StdoutLine, FullDeviceThrows) {
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no /dev/full";
  const int status = in_child([] {
    const int full = ::open("/dev/full", O_WRONLY);
    if (full < 0 || ::dup2(full, STDOUT_FILENO) < 0) return false;
    try {
      write_stdout_line("{\"step\":1}");
    } catch (const Error& e) {
      return e.kind() == ErrorKind::kIo && e.message().find("standard output") != std::string::npos &&
             e.message().find("No space left") != std::string::npos;
    }
    return false;
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

TEST(StdoutLine, ClosedPipeThrowsInsteadOfKillingTheProcess) {
  const int status = in_child([] {
    int fds[2];
    if (::pipe(fds) != 0) return false;
    ::close(fds[0]);  // nobody reads
    if (::dup2(fds[1], STDOUT_FILENO) < 0) return false;
    try {
      write_stdout_line("{\"step\":1}");
    } catch (const Error& e) {
      // Still alive (SIGPIPE was held off and consumed), with the error as a sentence.
      sigset_t pending;
      sigpending(&pending);
      return e.kind() == ErrorKind::kIo && e.message().find("Broken pipe") != std::string::npos &&
             sigismember(&pending, SIGPIPE) == 0;
    }
    return false;
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

TEST(StdoutLine, WritesTheLineAfterBufferedText) {
  TempDir dir;
  const std::string path = dir.path("out.txt");
  const int status = in_child([&] {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ::dup2(fd, STDOUT_FILENO) < 0) return false;
    std::printf("text first\n");  // sits in stdio's buffer until write_stdout_line flushes it
    write_stdout_line("{\"a\":1}");
    return true;
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(read_text(path), "text first\n{\"a\":1}\n");
}

}  // namespace
}  // namespace zt
