// safetensors: round trip (whole-file writer and streaming writer), sliced reads, and one malformed
// file per validation rule, each refused with a message naming the file and the rule.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "core/status.h"
#include "test_util.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using test_util::TempDir;
using test_util::expect_invalid;
using test_util::read_bytes;
using test_util::write_file;
using nlohmann::json;

// A file from a header text and a data section, with an explicit header length (default: right).
std::vector<uint8_t> make_file(const std::string& header, size_t data_bytes,
                               std::optional<uint64_t> declared_len = std::nullopt) {
  const uint64_t n = declared_len.value_or(header.size());
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = static_cast<uint8_t>(i * 7 + 1);
  return out;
}

std::vector<float> ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i) - 3.25f;
  return v;
}

TEST(Safetensors, RoundTrip) {
  TempDir dir;
  const std::vector<float> wte = ramp(50 * 16, 0.5f);
  const std::vector<uint16_t> h = {1, 2, 3, 0x7f80, 0xffff, 0};
  const std::vector<int32_t> ids = {-1, 0, 50256};
  const std::vector<uint8_t> flags = {1, 0, 1};
  const std::string path = dir.path("model.safetensors");
  write_safetensors(path,
                    {{"wte.weight", StorageDType::kF32, {50, 16}, wte.data(), wte.size() * 4},
                     {"h.0.ln_1.weight", StorageDType::kBF16, {2, 3}, h.data(), h.size() * 2},
                     {"ids", StorageDType::kI32, {3}, ids.data(), 12},
                     {"scalar_empty", StorageDType::kF16, {0}, nullptr, 0},
                     {"flags", StorageDType::kBool, {3}, flags.data(), 3}},
                    {{"format", "pt"}, {"zerotrain_step", "100"}});
  // The header is padded so the data section starts 8-byte aligned.
  const std::vector<uint8_t> raw = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(raw[8], '{');

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.tensors().size(), 5u);
  EXPECT_EQ(f.metadata().at("zerotrain_step"), "100");
  const SafetensorsEntry& e = f.at("wte.weight");
  EXPECT_EQ(e.dtype, StorageDType::kF32);
  EXPECT_EQ(e.shape, (std::vector<int64_t>{50, 16}));
  EXPECT_EQ(e.numel(), 800u);
  const std::vector<uint8_t> got = f.read("wte.weight");
  ASSERT_EQ(got.size(), wte.size() * 4);
  EXPECT_EQ(std::memcmp(got.data(), wte.data(), got.size()), 0);
  EXPECT_TRUE(f.read("h.0.ln_1.weight") == std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(h.data()),
                                                                  reinterpret_cast<const uint8_t*>(h.data()) + 12));
  EXPECT_TRUE(f.read("flags") == flags);
  EXPECT_TRUE(f.read("scalar_empty").empty());
  // A slice: rows 10..19 of wte (what one rank of a sharded --init-from reads).
  std::vector<float> rows(10 * 16);
  f.read(e, 10 * 16 * 4, rows.size() * 4, rows.data());
  EXPECT_EQ(std::memcmp(rows.data(), wte.data() + 160, rows.size() * 4), 0);
  expect_invalid([&] { f.read(e, 1, e.bytes(), rows.data()); }, {"cannot read"});
  expect_invalid([&] { f.at("nope"); }, {"model.safetensors", "no tensor 'nope'"});
  EXPECT_EQ(f.find("nope"), nullptr);
  // parse on the bytes in memory agrees with the file reader.
  const SafetensorsHeader hdr = parse_safetensors(raw, "mem");
  EXPECT_EQ(hdr.data_offset, 8 + n);
  EXPECT_EQ(hdr.tensors.size(), 5u);
}

TEST(Safetensors, StreamingWriterIsAtomic) {
  TempDir dir;
  const std::string path = dir.path("out.safetensors");
  const std::vector<float> a = ramp(1000, 1.0f), b = ramp(7, 2.0f);
  {
    SafetensorsWriter w(path, {{"a", StorageDType::kF32, {10, 100}}, {"b", StorageDType::kF32, {7}}});
    w.write(a.data(), 2000);
    w.write(a.data() + 500, 2000);
    expect_invalid([&] { w.commit(); }, {"4000 bytes of tensor data were written", "hold 4028"});
    // Abandoned: no file, no temporary.
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir.path("")));
  {
    SafetensorsWriter w(path, {{"a", StorageDType::kF32, {10, 100}}, {"b", StorageDType::kF32, {7}}});
    w.write(a.data(), 4000);
    expect_invalid([&] { w.write(b.data(), 32); }, {"more tensor data"});
    w.write(b.data(), 28);
    w.commit();
  }
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::vector<float> got(7);
  f.read(f.at("b"), 0, 28, got.data());
  EXPECT_EQ(got, b);
  expect_invalid([&] { SafetensorsWriter(path, {{"a", StorageDType::kF32, {1}}, {"a", StorageDType::kF32, {1}}}); },
                 {"given twice"});
  expect_invalid([&] { SafetensorsWriter(path, {{"__metadata__", StorageDType::kF32, {1}}}); }, {"not allowed"});
  expect_invalid([&] { SafetensorsWriter(path, {{"x", StorageDType::kF32, {-1}}}); }, {"negative or overflowing"});
  expect_invalid([&] { SafetensorsWriter(path, {{"x", StorageDType::kF64, {1ll << 62, 4}}}); }, {"overflowing"});
  expect_invalid([&] { write_safetensors(path, {{"x", StorageDType::kF32, {3}, a.data(), 8}}); }, {"8 bytes given"});
}

// One file per rule; each must be refused naming the file.
TEST(Safetensors, MalformedFilesAreRefusedRuleByRule) {
  TempDir dir;
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})";
  ASSERT_NO_THROW(parse_safetensors(make_file(ok, 12), "f"));
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"empty file", {}, "shorter than the 8-byte header length"},
      {"7 bytes", std::vector<uint8_t>(7, 0), "shorter than the 8-byte header length"},
      {"header > 100 MB", make_file("{}", 0, 100'000'001), "exceeds the 100000000-byte limit"},
      {"header length past the end", make_file(ok, 12, ok.size() + 13), "runs past the end"},
      {"header length 2^64-1", make_file(ok, 12, UINT64_MAX), "exceeds"},
      {"zero header length", make_file("", 0), "does not start with '{'"},
      {"not starting with {", make_file(" {}", 0), "does not start with '{'"},
      {"not JSON", make_file("{\"a\":", 0), "not valid JSON"},
      {"trailing garbage", make_file("{}x", 0), "not valid JSON"},
      {"not an object", make_file("[1]", 0), "does not start with '{'"},
      {"duplicate tensor", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "appears twice"},
      {"metadata not an object", make_file(R"({"__metadata__":[1]})", 0), "\"__metadata__\" is not an object"},
      {"metadata value not a string", make_file(R"({"__metadata__":{"k":1}})", 0), "is not a string"},
      {"tensor not an object", make_file(R"({"a":[1]})", 0), "not described by an object"},
      {"empty name", make_file(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4), "empty name"},
      {"no dtype", make_file(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), "no string \"dtype\""},
      {"unknown dtype", make_file(R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16), "unsupported dtype 'F128'"},
      {"no shape", make_file(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4), "no \"shape\" array"},
      {"negative dim", make_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), "not a non-negative integer"},
      {"fractional dim", make_file(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4), "not a non-negative integer"},
      {"shape overflow", make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4), "overflows"},
      {"elem size overflow", make_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,4]}})", 4), "overflows"},
      {"size mismatch", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4), "needing 8 bytes"},
      {"no offsets", make_file(R"({"a":{"dtype":"F32","shape":[1]}})", 4), "data_offsets"},
      {"one offset", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4), "data_offsets"},
      {"negative offset", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 4), "data_offsets"},
      {"end before begin", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4), "end before they begin"},
      {"offsets beyond data", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 4), "beyond the 4-byte data section"},
      {"huge offsets", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,18446744073709551615]}})", 4), "beyond"},
      {"overlap", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "overlaps"},
      {"hole", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12), "bytes [4, 8)"},
      {"trailing data", make_file(ok, 16), "bytes [12, 16)"},
      {"truncated data", make_file(ok, 11), "beyond the 11-byte data section"},
      {"deep nesting", make_file(R"({"__metadata__":{"k":[[[[[[[[[[1]]]]]]]]]]}})", 0), "deeper than 8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    expect_invalid([&] { parse_safetensors(c.bytes, "mem.safetensors"); }, {"mem.safetensors", c.expect});
    const std::string path = dir.path("bad.safetensors");
    write_file(path, c.bytes);
    expect_invalid([&] { SafetensorsFile::open(path); }, {path, c.expect});
  }
  expect_invalid([&] { SafetensorsFile::open(dir.path("missing.safetensors")); }, {"missing", "No such file"});
  expect_invalid([&] { SafetensorsFile::open(dir.path("")); }, {"not a regular file"});
}

// Issue 12: the writer refuses to replace anything but a regular file (the rename used to turn
// `export --out /dev/full` into a regular file), and the reader refuses FIFOs and devices and
// reports a file truncated while open.
TEST(Safetensors, WriterRefusesNonRegularTargetsAndLeavesThem) {
  TempDir dir;
  const float x[3] = {1.0f, -2.0f, 3.5f};
  const std::vector<SafetensorsTensor> tensors = {{"x", StorageDType::kF32, {3}, x, sizeof(x)}};
  const std::string fifo = dir.path("out.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_invalid([&] { write_safetensors(fifo, tensors); }, {fifo, "FIFO"});
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  expect_invalid([&] { SafetensorsFile::open(fifo); }, {fifo, "FIFO"});
  for (const char* dev : {"/dev/full", "/dev/null"}) {
    if (::access(dev, F_OK) != 0) continue;
    expect_invalid([&] { write_safetensors(dev, tensors); }, {dev, "character device"});
    ASSERT_EQ(::lstat(dev, &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode)) << dev << " must stay a device node";
  }
  const std::string link = dir.path("link.safetensors");
  fs::create_symlink(dir.path("elsewhere"), link);
  expect_invalid([&] { write_safetensors(link, tensors); }, {link, "symbolic link"});
  EXPECT_FALSE(fs::exists(dir.path("elsewhere")));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path("")), fs::directory_iterator{}), 2);  // no temp left
}

TEST(Safetensors, TruncatedWhileOpenIsAnIoError) {
  TempDir dir;
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  const std::string path = dir.path("w.safetensors");
  write_safetensors(path, {{"v", StorageDType::kF32, {1000}, v.data(), v.size() * 4}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(f.header().data_offset + 100)), 0);
  float head[25];
  f.read(f.at("v"), 0, sizeof(head), head);
  EXPECT_EQ(std::memcmp(head, v.data(), sizeof(head)), 0);
  try {
    f.read("v");
    ADD_FAILURE() << "expected zt::Error(kIo)";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo) << e.what();
    EXPECT_THAT(e.message(), HasSubstr(path));
    EXPECT_THAT(e.message(), HasSubstr("truncated"));
  }
}

}  // namespace
}  // namespace zt
