// Checkpoint storage: round trips written by concurrent files and read back over any ranges
// (resharding), latest/keep/prune, resume fallback, refusal of every kind of damage (truncation and
// bit flips in each file, path traversal, symlinks, unknown versions, gaps/overlaps, wrong sizes),
// and crash safety: a child process saving checkpoints is SIGKILLed at random instants and resume
// must always find the newest complete one with exactly the data written for its step; a failure
// injected at every point of a background save leaves the earlier checkpoints intact; directory
// ownership (owner record, run lock, what prune may delete) and early refusal of bad directories.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "core/status.h"
#include "model/config.h"
#include "model/model.h"
#include "sanitizer.h"
#include "train/state_io.h"
#include "test_util.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using test_util::TempDir;
using test_util::read_bytes;
using test_util::write_file;
using nlohmann::json;

// Runs f, which must throw zt::Error of `kind` whose message contains every part.
template <typename F>
std::string expect_error(F&& f, ErrorKind kind, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& p : parts) EXPECT_THAT(e.message(), HasSubstr(p));
    return e.message();
  }
  ADD_FAILURE() << "expected zt::Error mentioning '" << *parts.begin() << "'";
  return {};
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The bytes of array `a` at `step`: a pure function of (step, a), so any reader can check them.
std::vector<uint8_t> array_bytes(int64_t step, int a, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  uint64_t state = splitmix64(static_cast<uint64_t>(step) * 1000003u + static_cast<uint64_t>(a));
  for (size_t i = 0; i < bytes; i += 8) {
    state = splitmix64(state);
    std::memcpy(out.data() + i, &state, std::min<size_t>(8, bytes - i));
  }
  return out;
}

struct ArraySpec {
  std::string name;
  StorageDType dtype;
  uint64_t numel;
  std::vector<int64_t> shape;
};

// Awkward sizes: 1, a prime, a power of two +- 1, zero, several dtypes.
std::vector<ArraySpec> test_arrays() {
  return {{"wte/master", StorageDType::kF32, 100003, {}},
          {"h.0/master", StorageDType::kF32, 4097, {17, 241}},
          {"h.0/adam_m", StorageDType::kBF16, 65535, {}},
          {"tokens", StorageDType::kI32, 7, {7}},
          {"rng", StorageDType::kU8, 1, {}},
          {"empty", StorageDType::kF16, 0, {0, 3}},
          {"counts", StorageDType::kI64, 1023, {}}};
}

// Writes `arrays` at `step` as num_files files, file r holding rank r's contiguous share of every
// array (uneven splits), each share written in up to `pieces` calls, one thread per file.
std::string save(const std::string& root, int64_t step, int num_files, const std::vector<ArraySpec>& arrays,
                 int keep = 0, int pieces = 2, json meta = json::object()) {
  CheckpointWriter w(root, step, num_files);
  for (const ArraySpec& a : arrays) w.declare_array(a.name, a.dtype, a.numel, a.shape);
  std::vector<std::thread> threads;
  for (int r = 0; r < num_files; ++r) {
    threads.emplace_back([&, r] {
      for (size_t ai = 0; ai < arrays.size(); ++ai) {
        const ArraySpec& a = arrays[ai];
        const uint64_t elem = storage_dtype_size(a.dtype);
        const std::vector<uint8_t> data = array_bytes(step, static_cast<int>(ai), a.numel * elem);
        // Rank r's share: [r * n / R, (r + 1) * n / R), uneven on purpose.
        const uint64_t b = a.numel * r / num_files, e = a.numel * (r + 1) / num_files;
        for (int p = 0; p < pieces; ++p) {
          const uint64_t pb = b + (e - b) * p / pieces, pe = b + (e - b) * (p + 1) / pieces;
          w.write_range(r, a.name, pb, data.data() + pb * elem, (pe - pb) * elem);
        }
      }
      if (r % 2 == 0) w.finish_file(r);  // the others are finished by commit
    });
  }
  for (std::thread& t : threads) t.join();
  if (meta.empty()) meta = json{{"model", "gpt-tiny"}, {"zero_stage", 2}, {"devices", num_files}};
  return w.commit(meta, keep);
}

void expect_arrays(const CheckpointReader& r, int64_t step, const std::vector<ArraySpec>& arrays) {
  for (size_t ai = 0; ai < arrays.size(); ++ai) {
    const ArraySpec& a = arrays[ai];
    ASSERT_TRUE(r.has_array(a.name)) << a.name;
    EXPECT_EQ(r.array(a.name).numel, a.numel);
    EXPECT_EQ(r.array(a.name).dtype, a.dtype);
    EXPECT_EQ(r.array(a.name).shape, a.shape);
    const uint64_t elem = storage_dtype_size(a.dtype);
    const std::vector<uint8_t> expected = array_bytes(step, static_cast<int>(ai), a.numel * elem);
    std::vector<uint8_t> got(a.numel * elem + 1, 0xcd);  // poisoned, one guard byte
    r.read(a.name, 0, a.numel, got.data());
    EXPECT_EQ(got.back(), 0xcd) << a.name << ": read past the requested range";
    got.pop_back();
    EXPECT_TRUE(got == expected) << a.name << " differs at step " << step;
  }
}

std::string manifest_text(const std::string& dir) {
  const std::vector<uint8_t> b = read_bytes(dir + "/manifest.json");
  return std::string(b.begin(), b.end());
}

// Re-computes the manifest's own checksum after a test edits its text on purpose, so that the
// rule under test (not the checksum) is what refuses it.
std::string reseal(const std::string& text) {
  const size_t p = std::string(R"({"format":"zerotrain-checkpoint","version":1,"xxh64":")").size();
  const std::string body = text.substr(p + 16);
  return text.substr(0, p) + hex64(xxh64(body.data(), body.size())) + body;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size()))
    s.replace(pos, from.size(), to);
  return s;
}

// ---- names -----------------------------------------------------------------------------------

TEST(CheckpointNames, StepDirectoriesAndPlainFileNames) {
  EXPECT_EQ(format_step_dir(100), "step-00000100");
  EXPECT_EQ(format_step_dir(0), "step-00000000");
  EXPECT_EQ(format_step_dir(123456789012), "step-123456789012");
  EXPECT_EQ(parse_step_dir("step-00000100"), 100);
  EXPECT_EQ(parse_step_dir("step-123456789012"), 123456789012);
  EXPECT_EQ(parse_step_dir("step-100"), std::nullopt);  // not canonical
  EXPECT_EQ(parse_step_dir("step-0000010x"), std::nullopt);
  EXPECT_EQ(parse_step_dir("latest"), std::nullopt);
  EXPECT_EQ(parse_step_dir("step-"), std::nullopt);
  EXPECT_EQ(format_rank_file(3), "rank-00003.bin");

  EXPECT_TRUE(is_plain_file_name("rank-00000.bin"));
  for (const char* bad : {"", ".", "..", "../x", "/etc/passwd", "a/b", ".hidden", "a\\b", "x\n"})
    EXPECT_FALSE(is_plain_file_name(bad)) << bad;
  EXPECT_FALSE(is_plain_file_name(std::string(256, 'a')));
  EXPECT_FALSE(is_plain_file_name(std::string("a\0b", 3)));
}

// ---- round trip and resharding ---------------------------------------------------------------

TEST(Checkpoint, RoundTripFromConcurrentFiles) {
  TempDir dir;
  const auto arrays = test_arrays();
  const std::string path = save(dir.str(), 100, 4, arrays, 0, 3);
  EXPECT_EQ(path, dir.path("step-00000100"));
  const CheckpointReader r = CheckpointReader::open(path);
  EXPECT_EQ(r.step(), 100);
  EXPECT_EQ(r.meta().at("model"), "gpt-tiny");
  EXPECT_EQ(r.meta().at("zero_stage"), 2);
  EXPECT_EQ(r.manifest().files.size(), 4u);
  EXPECT_FALSE(r.has_array("nope"));
  expect_error([&] { r.array("nope"); }, ErrorKind::kInvalidArgument, {"has no array 'nope'"});
  expect_arrays(r, 100, arrays);
  // Only the committed files: no temporaries left behind.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"manifest.json", "rank-00000.bin", "rank-00001.bin",
                                             "rank-00002.bin", "rank-00003.bin"}));
}

// Several processes (train/checkpointer.h): a lead part and another part write their files into
// their own staging directories; the other hands over (as text, as MPI carries it), the lead
// adopts and commits one checkpoint equal to a one-writer save, with no staging left behind.
TEST(Checkpoint, PartsHandOverToTheLeadWhichCommitsOneCheckpoint) {
  TempDir dir;
  const auto arrays = test_arrays();
  const int files = 4;
  CheckpointWriter lead(dir.str(), 7, files, WriterPart{0, 2, true});
  CheckpointWriter other(dir.str(), 7, files, WriterPart{2, 2, false});
  for (CheckpointWriter* w : {&lead, &other})
    for (const ArraySpec& a : arrays) w->declare_array(a.name, a.dtype, a.numel, a.shape);
  for (int r = 0; r < files; ++r) {
    CheckpointWriter& w = r < 2 ? lead : other;
    for (size_t ai = 0; ai < arrays.size(); ++ai) {
      const ArraySpec& a = arrays[ai];
      const uint64_t elem = storage_dtype_size(a.dtype);
      const std::vector<uint8_t> data = array_bytes(7, static_cast<int>(ai), a.numel * elem);
      const uint64_t b = a.numel * r / files, e = a.numel * (r + 1) / files;
      w.write_range(r, a.name, b, data.data() + b * elem, (e - b) * elem);
    }
  }
  // A part writes only its own files; the lead cannot commit without the others'.
  expect_error([&] { other.write_range(0, arrays[0].name, 0, "abcd", 4); }, ErrorKind::kInvalidArgument,
               {"belongs to another process's part"});
  expect_error([&] { lead.commit(json::object(), 0); }, ErrorKind::kInvalidArgument,
               {"rank-00002.bin was never handed over"});
  const json part = json::parse(other.hand_over().dump());
  lead.adopt(part);
  expect_error([&] { lead.adopt(part); }, ErrorKind::kInvalidArgument, {"already present"});
  const std::string path = lead.commit(json{{"devices", files}}, 0);
  const CheckpointReader r = CheckpointReader::open(path);
  EXPECT_EQ(r.manifest().files.size(), 4u);
  expect_arrays(r, 7, arrays);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.str())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lock", "latest", "step-00000007"}));
}

// A snapshot of ranks [first, first + count) of `world`, two blocks sharded evenly (the last rank
// shorter), AdamW moments and bf16 working bits, every value distinct.
HostSnapshot part_snapshot(int first, int count, int world) {
  HostSnapshot s;
  s.step = 6;
  s.working = DType::kBF16;
  s.adamw = true;
  s.block_names = {"wte", "h.0"};
  s.block_numel = {1001, 77};
  s.first_rank = first;
  s.world_ranks = world;
  s.meta = json{{"step", 6}, {"devices", world}};
  for (int r = first; r < first + count; ++r) {
    std::vector<HostShard> blocks;
    for (size_t b = 0; b < 2; ++b) {
      const int64_t n = s.block_numel[b], per = (n + world - 1) / world;
      const int64_t lo = std::min(n, per * r), hi = std::min(n, per * (r + 1));
      HostShard h;
      h.begin = lo;
      for (int64_t i = lo; i < hi; ++i) {
        h.master.push_back(static_cast<float>(b * 10000 + i) + 0.25f);
        h.m.push_back(-static_cast<float>(i));
        h.v.push_back(static_cast<float>(i) * 0.5f);
        h.working.push_back(static_cast<uint8_t>(i));
        h.working.push_back(static_cast<uint8_t>(b));
      }
      blocks.push_back(std::move(h));
    }
    s.shards.push_back(std::move(blocks));
  }
  return s;
}

// What replication sends: a snapshot's shards survive the bytes unchanged.
TEST(Checkpoint, SnapshotShardsRoundTripThroughBytes) {
  const HostSnapshot s = part_snapshot(2, 2, 4);
  const HostSnapshot t = deserialize_shards(serialize_shards(s));
  EXPECT_EQ(t.step, s.step);
  EXPECT_EQ(t.working, s.working);
  EXPECT_EQ(t.first_rank, 2);
  EXPECT_EQ(t.world_ranks, 4);
  EXPECT_EQ(t.block_names, s.block_names);
  EXPECT_EQ(t.block_numel, s.block_numel);
  ASSERT_EQ(t.shards.size(), 2u);
  for (size_t r = 0; r < 2; ++r)
    for (size_t b = 0; b < 2; ++b) {
      EXPECT_EQ(t.shards[r][b].begin, s.shards[r][b].begin);
      EXPECT_EQ(t.shards[r][b].master, s.shards[r][b].master);
      EXPECT_EQ(t.shards[r][b].m, s.shards[r][b].m);
      EXPECT_EQ(t.shards[r][b].v, s.shards[r][b].v);
      EXPECT_EQ(t.shards[r][b].working, s.shards[r][b].working);
    }
}

// A lost process's ranks survive as the replica its neighbour wrote: the parts are assembled into
// one checkpoint holding every rank's elements (a rank held twice adopted once), and the partial
// directories go; an incomplete set is left alone and assembles nothing.
TEST(Checkpoint, PartialsThatHoldEveryRankAssembleIntoACheckpoint) {
  TempDir dir;
  const std::string root = dir.str();
  write_snapshot_part(part_snapshot(0, 2, 4), root, partial_dir_name(6, 0));
  EXPECT_EQ(assemble_partials(root, 0), std::nullopt);  // ranks 2 and 3 are missing
  EXPECT_TRUE(fs::exists(root + "/" + partial_dir_name(6, 0) + "/" + kPartialFileName));
  write_snapshot_part(part_snapshot(2, 2, 4), root, partial_dir_name(6, 1) + "-held-by-0");
  write_snapshot_part(part_snapshot(1, 3, 4), root, partial_dir_name(6, 2));  // overlaps both
  const std::optional<std::string> path = assemble_partials(root, 0);
  ASSERT_TRUE(path.has_value());
  EXPECT_EQ(*path, root + "/step-00000006");
  const CheckpointReader r = CheckpointReader::open(*path);
  EXPECT_EQ(r.manifest().files.size(), 4u);
  EXPECT_EQ(r.meta().at("devices"), 4);
  const HostSnapshot all = part_snapshot(0, 4, 4);
  for (size_t b = 0; b < 2; ++b) {
    const uint64_t n = static_cast<uint64_t>(all.block_numel[b]);
    std::vector<float> master(n, std::nanf("")), v(n, std::nanf(""));
    r.read(all.block_names[b] + "/master", 0, n, master.data());
    r.read(all.block_names[b] + "/v", 0, n, v.data());
    for (const auto& rank : all.shards)
      for (size_t i = 0; i < rank[b].master.size(); ++i) {
        EXPECT_EQ(master[static_cast<size_t>(rank[b].begin) + i], rank[b].master[i]);
        EXPECT_EQ(v[static_cast<size_t>(rank[b].begin) + i], rank[b].v[i]);
      }
  }
  for (const auto& e : fs::directory_iterator(root))
    EXPECT_NE(e.path().filename().string().rfind("partial-", 0), 0u) << e.path();
  // Nothing newer than the checkpoint: nothing to assemble.
  EXPECT_EQ(assemble_partials(root, 0), std::nullopt);
}

// Written by 4 ranks, read back as 3 ranks, 1 rank and random ranges: the bytes of every element
// are the ones written, whichever stored ranges the request crosses.
TEST(Checkpoint, AnyRangeReadsReshard) {
  TempDir dir;
  const auto arrays = test_arrays();
  const CheckpointReader r = CheckpointReader::open(save(dir.str(), 7, 4, arrays, 0, 2));
  std::mt19937_64 rng(42);
  for (size_t ai = 0; ai < arrays.size(); ++ai) {
    const ArraySpec& a = arrays[ai];
    const uint64_t elem = storage_dtype_size(a.dtype);
    const std::vector<uint8_t> expected = array_bytes(7, static_cast<int>(ai), a.numel * elem);
    for (const int readers : {1, 3, 5}) {
      std::vector<uint8_t> got(a.numel * elem, 0xcd);
      for (int q = 0; q < readers; ++q) {
        const uint64_t b = a.numel * q / readers, e = a.numel * (q + 1) / readers;
        r.read(a.name, b, e - b, got.data() + b * elem);
      }
      EXPECT_TRUE(got == expected) << a.name << " read by " << readers << " ranks";
    }
    for (int trial = 0; trial < 50 && a.numel > 0; ++trial) {
      const uint64_t b = rng() % a.numel;
      const uint64_t n = rng() % (a.numel - b + 1);
      std::vector<uint8_t> got(n * elem + 1, 0xcd);
      r.read(a.name, b, n, got.data());
      EXPECT_EQ(got.back(), 0xcd);
      EXPECT_TRUE(std::equal(got.begin(), got.end() - 1, expected.begin() + static_cast<ptrdiff_t>(b * elem)))
          << a.name << " [" << b << ", +" << n << ")";
    }
    expect_error([&] { r.read(a.name, a.numel, 1, nullptr); }, ErrorKind::kInvalidArgument, {"cannot read"});
    expect_error([&] { r.read(a.name, 1, UINT64_MAX, nullptr); }, ErrorKind::kInvalidArgument, {"cannot read"});
  }
}

TEST(Checkpoint, ConcurrentReadersSeeTheSameBytes) {
  TempDir dir;
  const auto arrays = test_arrays();
  const CheckpointReader r = CheckpointReader::open(save(dir.str(), 3, 3, arrays));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const ArraySpec& a = arrays[0];
      const std::vector<uint8_t> expected = array_bytes(3, 0, a.numel * 4);
      const uint64_t b = a.numel * t / 4, e = a.numel * (t + 1) / 4;
      std::vector<uint8_t> got((e - b) * 4);
      r.read(a.name, b, e - b, got.data());
      if (!std::equal(got.begin(), got.end(), expected.begin() + static_cast<ptrdiff_t>(b * 4))) ++mismatches;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mismatches, 0);
}

// ---- latest, keep, prune, replace ------------------------------------------------------------

TEST(Checkpoint, LatestNamesTheNewestCommit) {
  TempDir dir;
  const auto arrays = test_arrays();
  EXPECT_EQ(read_latest(dir.str()), std::nullopt);
  EXPECT_TRUE(list_checkpoints(dir.path("missing")).empty());
  save(dir.str(), 100, 2, arrays);
  EXPECT_EQ(read_latest(dir.str()), "step-00000100");
  save(dir.str(), 200, 2, arrays);
  EXPECT_EQ(read_latest(dir.str()), "step-00000200");
  EXPECT_EQ(manifest_text(dir.path("step-00000200")).back(), '\n');
  const auto entries = list_checkpoints(dir.str());
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].step, 100);
  EXPECT_EQ(entries[1].step, 200);
  EXPECT_TRUE(entries[1].has_manifest);
  EXPECT_EQ(entries[1].path, dir.path("step-00000200"));
}

TEST(Checkpoint, KeepPrunesOnlyAfterTheNewOneIsComplete) {
  TempDir dir;
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 1000, {}}};
  for (int64_t step = 1; step <= 5; ++step) save(dir.str(), step, 2, arrays, 2);
  auto entries = list_checkpoints(dir.str());
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].step, 4);
  EXPECT_EQ(entries[1].step, 5);
  expect_arrays(CheckpointReader::open(entries[0].path), 4, arrays);

  // keep 0 keeps all; keep 1 leaves only the new one.
  for (int64_t step = 6; step <= 8; ++step) save(dir.str(), step, 1, arrays, 0);
  EXPECT_EQ(list_checkpoints(dir.str()).size(), 5u);
  save(dir.str(), 9, 1, arrays, 1);
  entries = list_checkpoints(dir.str());
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].step, 9);

  // A save of a lower step (resuming an older checkpoint) is never pruned by its own keep.
  save(dir.str(), 3, 1, arrays, 1);
  entries = list_checkpoints(dir.str());
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].step, 3);
  EXPECT_EQ(read_latest(dir.str()), "step-00000003");
}

TEST(Checkpoint, LeftoversOfInterruptedSavesAreIgnoredByLoadsAndRemovedByTheNextSave) {
  TempDir dir;
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 100, {}}};
  save(dir.str(), 1, 1, arrays);
  // An interrupted save's staging directory, a step directory without manifest, a trash directory,
  // a latest temporary.
  fs::create_directories(dir.path(".tmp-step-00000002-99999-0"));
  write_file(dir.path(".tmp-step-00000002-99999-0/.rank-00000.bin.tmp"), std::string("partial"));
  fs::create_directories(dir.path("step-00000003"));
  write_file(dir.path("step-00000003/rank-00000.bin"), std::string("partial"));
  fs::create_directories(dir.path(".trash-step-00000000-1-0"));
  write_file(dir.path(".latest.tmp-99999"), std::string("step-0000000"));

  std::vector<std::string> notes;
  auto resolved = resolve_resume(dir.str(), ResumeFrom::newest(), &notes);
  ASSERT_TRUE(resolved);
  EXPECT_EQ(resolved->step, 1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0], HasSubstr("step-00000003"));
  EXPECT_THAT(notes[0], HasSubstr("no manifest.json"));
  EXPECT_THAT(notes[0], HasSubstr("falling back to step-00000001"));
  EXPECT_TRUE(fs::exists(dir.path("step-00000003")));  // a load never deletes

  save(dir.str(), 4, 1, arrays);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.str())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  // The step directory without a manifest is no save's leftover (saves appear by rename): kept.
  EXPECT_EQ(names, (std::vector<std::string>{".lock", "latest", "step-00000001", "step-00000003", "step-00000004"}));
  EXPECT_EQ(read_bytes(dir.path("step-00000003/rank-00000.bin")).size(), 7u);
}

TEST(Checkpoint, SavingAnExistingStepReplacesItAtomically) {
  TempDir dir;
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 5000, {}}};
  save(dir.str(), 10, 2, arrays);
  // Same step, different content (a different writer split and meta): the new one wins whole.
  CheckpointWriter w(dir.str(), 10, 1);
  w.declare_array("x", StorageDType::kF32, 5000);
  const std::vector<uint8_t> data = array_bytes(99, 0, 5000 * 4);
  w.write_range(0, "x", 0, data.data(), data.size());
  w.commit(json{{"run", "second"}}, 0);
  const CheckpointReader r = CheckpointReader::open(dir.path("step-00000010"));
  EXPECT_EQ(r.meta().at("run"), "second");
  EXPECT_EQ(r.manifest().files.size(), 1u);
  std::vector<uint8_t> got(data.size());
  r.read("x", 0, 5000, got.data());
  EXPECT_TRUE(got == data);
  EXPECT_FALSE(fs::exists(dir.path("step-00000010/rank-00001.bin")));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.str())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lock", "latest", "step-00000010"}));
}

TEST(Checkpoint, AnUncommittedWriterLeavesNothing) {
  TempDir dir;
  {
    CheckpointWriter w(dir.str(), 5, 2);
    w.declare_array("x", StorageDType::kF32, 10);
    const float v[10] = {};
    w.write_range(0, "x", 0, v, sizeof(v));
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.str())) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{".lock"});
  EXPECT_EQ(resolve_resume(dir.str(), ResumeFrom::newest(), nullptr), std::nullopt);
}

TEST(Checkpoint, WriterMisuseIsRefused) {
  TempDir dir;
  const float v[16] = {};
  {
    CheckpointWriter w(dir.str(), 1, 2);
    w.declare_array("x", StorageDType::kF32, 8, {2, 4});
    expect_error([&] { w.declare_array("x", StorageDType::kF32, 8); }, ErrorKind::kInvalidArgument, {"declared twice"});
    expect_error([&] { w.declare_array("y", StorageDType::kF32, 8, {3, 3}); }, ErrorKind::kInvalidArgument, {"shape"});
    expect_error([&] { w.declare_array("z", StorageDType::kF64, UINT64_MAX / 4); }, ErrorKind::kInvalidArgument, {"too many"});
    expect_error([&] { w.write_range(0, "nope", 0, v, 4); }, ErrorKind::kInvalidArgument, {"not declared"});
    expect_error([&] { w.write_range(2, "x", 0, v, 4); }, ErrorKind::kInvalidArgument, {"outside"});
    expect_error([&] { w.write_range(0, "x", 0, v, 6); }, ErrorKind::kInvalidArgument, {"not whole"});
    expect_error([&] { w.write_range(0, "x", 6, v, 12); }, ErrorKind::kInvalidArgument, {"lie outside"});
    expect_error([&] { w.write_range(0, "x", UINT64_MAX, v, 4); }, ErrorKind::kInvalidArgument, {"lie outside"});
    // A second writer on the same root, in this process or another, is refused while this lives.
    expect_error([&] { CheckpointWriter(dir.str(), 2, 1); }, ErrorKind::kInvalidArgument, {"only one run"});
    w.write_range(0, "x", 0, v, 16);
    expect_error([&] { w.commit(json::object(), 0); }, ErrorKind::kInvalidArgument, {"[4, 8)", "never written"});
    w.write_range(1, "x", 2, v, 16);
    expect_error([&] { w.commit(json::object(), 0); }, ErrorKind::kInvalidArgument, {"[2, 4)", "written twice"});
    expect_error([&] { w.commit(json::array(), 0); }, ErrorKind::kInvalidArgument, {"JSON object"});
  }
  expect_error([&] { CheckpointWriter(dir.str(), -1, 1); }, ErrorKind::kInvalidArgument, {"non-negative"});
  expect_error([&] { CheckpointWriter(dir.str(), 1, 0); }, ErrorKind::kInvalidArgument, {"1 to"});
  write_file(dir.path("afile"), std::string("x"));
  // A file where the directory should be is the user's mistake (exit 2), not a disk failure.
  expect_error([&] { CheckpointWriter(dir.path("afile"), 1, 1); }, ErrorKind::kInvalidArgument, {"afile"});
  {
    CheckpointWriter w(dir.str(), 1, 1);
    w.declare_array("x", StorageDType::kF32, 2);
    w.write_range(0, "x", 0, v, 8);
    w.finish_file(0);
    expect_error([&] { w.write_range(0, "x", 0, v, 8); }, ErrorKind::kInvalidArgument, {"already finished"});
    w.commit(json::object(), 0);
    expect_error([&] { w.commit(json::object(), 0); }, ErrorKind::kInvalidArgument, {"already committed"});
  }
  EXPECT_EQ(CheckpointReader::open(dir.path("step-00000001")).array("x").numel, 2u);
}

// ---- resume ----------------------------------------------------------------------------------

void flip_bit(const std::string& path, uint64_t byte, int bit) {
  std::vector<uint8_t> b = read_bytes(path);
  ASSERT_LT(byte, b.size());
  b[byte] ^= static_cast<uint8_t>(1u << bit);
  write_file(path, b);
}

TEST(Resume, AutoTakesTheNewestValidAndFallsBackWithANote) {
  TempDir dir;
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 3000, {}}, {"y", StorageDType::kBF16, 77, {}}};
  EXPECT_EQ(resolve_resume(dir.path("nothing-here"), ResumeFrom::newest(), nullptr), std::nullopt);
  EXPECT_EQ(resolve_resume(dir.str(), ResumeFrom::newest(), nullptr), std::nullopt);
  for (int64_t step : {100, 200, 300}) save(dir.str(), step, 3, arrays);

  std::vector<std::string> notes;
  auto resolved = resolve_resume(dir.str(), ResumeFrom::newest(), &notes);
  ASSERT_TRUE(resolved);
  EXPECT_EQ(resolved->step, 300);
  EXPECT_EQ(resolved->path, dir.path("step-00000300"));
  EXPECT_TRUE(notes.empty());
  expect_arrays(resolved->reader, 300, arrays);

  flip_bit(dir.path("step-00000300/rank-00001.bin"), 1234, 5);
  resolved = resolve_resume(dir.str(), ResumeFrom::newest(), &notes);
  ASSERT_TRUE(resolved);
  EXPECT_EQ(resolved->step, 200);
  expect_arrays(resolved->reader, 200, arrays);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0], HasSubstr("step-00000300 is unusable"));
  EXPECT_THAT(notes[0], HasSubstr("rank-00001.bin: checksum mismatch"));
  EXPECT_THAT(notes[0], HasSubstr("falling back to step-00000200"));

  // Two bad ones: a truncated manifest too.
  notes.clear();
  const std::string m = manifest_text(dir.path("step-00000200"));
  write_file(dir.path("step-00000200/manifest.json"), m.substr(0, m.size() / 2));
  resolved = resolve_resume(dir.str(), ResumeFrom::newest(), &notes);
  ASSERT_TRUE(resolved);
  EXPECT_EQ(resolved->step, 100);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_THAT(notes[1], HasSubstr("manifest.json"));
  EXPECT_THAT(notes[1], HasSubstr("falling back to step-00000100"));

  // None usable: an error, not a silent fresh start.
  fs::remove(dir.path("step-00000100/rank-00002.bin"));
  expect_error([&] { resolve_resume(dir.str(), ResumeFrom::newest(), nullptr); }, ErrorKind::kInvalidArgument,
               {"none is usable", "rank-00002.bin: the file is missing"});

  // A step directory renamed by hand is refused: the manifest says which step it holds.
  TempDir other;
  save(other.str(), 1, 1, arrays);
  save(other.str(), 400, 1, arrays);
  fs::rename(other.path("step-00000400"), other.path("step-00000500"));
  notes.clear();
  resolved = resolve_resume(other.str(), ResumeFrom::newest(), &notes);
  ASSERT_TRUE(resolved);
  EXPECT_EQ(resolved->step, 1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0], HasSubstr("manifest says step 400"));
}

TEST(Resume, ExplicitPathHasNoFallback) {
  TempDir dir;
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 300, {}}};
  save(dir.str(), 1, 2, arrays);
  save(dir.str(), 2, 2, arrays);
  auto resolved = resolve_resume("", ResumeFrom::checkpoint(dir.path("step-00000001")), nullptr);
  ASSERT_TRUE(resolved);
  EXPECT_EQ(resolved->step, 1);
  expect_arrays(resolved->reader, 1, arrays);
  flip_bit(dir.path("step-00000002/rank-00000.bin"), 10, 0);
  expect_error([&] { resolve_resume("", ResumeFrom::checkpoint(dir.path("step-00000002")), nullptr); }, ErrorKind::kInvalidArgument,
               {"step-00000002: rank-00000.bin: checksum mismatch"});
  expect_error([&] { resolve_resume("", ResumeFrom::checkpoint(dir.str()), nullptr); }, ErrorKind::kInvalidArgument, {"holds checkpoints but is not one"});
  expect_error([&] { resolve_resume("", ResumeFrom::checkpoint(dir.path("nope")), nullptr); }, ErrorKind::kInvalidArgument, {"does not exist"});
  expect_error([&] { resolve_resume("", ResumeFrom{}, nullptr); }, ErrorKind::kInvalidArgument, {"--resume"});
}

// ---- damage: every file, truncated or bit-flipped, is refused naming the file ------------------

TEST(Corruption, TruncationOfEveryFileIsDetected) {
  TempDir dir;
  const auto arrays = test_arrays();
  const std::string ck = save(dir.str(), 1, 3, arrays);
  for (const auto& e : fs::directory_iterator(ck)) {
    const std::string name = e.path().filename().string();
    const std::vector<uint8_t> original = read_bytes(e.path().string());
    for (const size_t keep : {size_t{0}, original.size() / 2, original.size() - 1}) {
      write_file(e.path().string(), original.data(), keep);
      const std::string msg = expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {name});
      if (name != "manifest.json") {
        EXPECT_THAT(msg, HasSubstr("truncated"));
      }
      // Sizes-only verification catches truncation too.
      expect_error([&] { CheckpointReader::open(ck, CheckpointReader::Verify::kSizesOnly); },
                   ErrorKind::kInvalidArgument, {name});
    }
    std::vector<uint8_t> longer = original;
    longer.push_back(0);
    write_file(e.path().string(), longer);
    expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {name});
    write_file(e.path().string(), original);
  }
  expect_arrays(CheckpointReader::open(ck), 1, arrays);
}

TEST(Corruption, BitFlipsInEveryFileAreDetected) {
  TempDir dir;
  const auto arrays = test_arrays();
  const std::string ck = save(dir.str(), 1, 3, arrays);
  std::mt19937_64 rng(7);
  const int flips = test::kSanitized ? 12 : 40;
  for (const auto& e : fs::directory_iterator(ck)) {
    const std::string name = e.path().filename().string();
    const std::vector<uint8_t> original = read_bytes(e.path().string());
    for (int t = 0; t < flips; ++t) {
      std::vector<uint8_t> damaged = original;
      // Single bits anywhere, the first and last bytes, and a few multi-byte smears.
      const uint64_t at = t == 0 ? 0 : t == 1 ? original.size() - 1 : rng() % original.size();
      damaged[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
      if (t % 5 == 4) damaged[rng() % original.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
      write_file(e.path().string(), damaged);
      const std::string msg = expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument,
                                           {"checkpoint " + ck + ": " + name});
      if (name != "manifest.json") {
        EXPECT_THAT(msg, HasSubstr("checksum mismatch"));
      }
    }
    write_file(e.path().string(), original);
  }
  expect_arrays(CheckpointReader::open(ck), 1, arrays);
}

// ---- unsafe or malformed manifests -------------------------------------------------------------

TEST(Corruption, PathTraversalNamesAreRefused) {
  TempDir dir;
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 100, {}}};
  const std::string ck = save(dir.str(), 1, 2, arrays);
  const std::string original = manifest_text(ck);
  // A copy of the real file where the traversal would land, so only the name rule can refuse it.
  fs::copy_file(ck + "/rank-00001.bin", dir.path("x"));
  for (const char* bad : {"../x", "/etc/passwd", "a/b", "..", ".", ".rank-00001.bin", "", "a\\b"}) {
    write_file(ck + "/manifest.json", reseal(replace_all(original, "rank-00001.bin", bad)));
    expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument,
                 {"manifest.json", "is not a plain name inside the checkpoint directory"});
  }
  write_file(ck + "/manifest.json", original);
  EXPECT_NO_THROW(CheckpointReader::open(ck));
}

TEST(Corruption, SymlinkedFilesAreRefused) {
  TempDir dir;
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 100, {}}};
  const std::string ck = save(dir.str(), 1, 2, arrays);
  // Identical bytes outside the checkpoint: only the no-symlink rule can refuse it.
  fs::rename(ck + "/rank-00001.bin", dir.path("outside.bin"));
  fs::create_symlink(dir.path("outside.bin"), ck + "/rank-00001.bin");
  expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {"rank-00001.bin", "symbolic link"});
  fs::remove(ck + "/rank-00001.bin");
  fs::rename(dir.path("outside.bin"), ck + "/rank-00001.bin");
  fs::rename(ck + "/manifest.json", dir.path("m.json"));
  fs::create_symlink(dir.path("m.json"), ck + "/manifest.json");
  expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {"manifest.json", "symbolic link"});
  fs::remove(ck + "/manifest.json");
  fs::create_directory(ck + "/manifest.json");
  expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {"manifest.json", "not a regular file"});
}

TEST(Corruption, UnknownFormatVersionIsRefusedByName) {
  TempDir dir;
  const std::string ck = save(dir.str(), 1, 1, {{"x", StorageDType::kF32, 10, {}}});
  const std::string original = manifest_text(ck);
  write_file(ck + "/manifest.json", reseal(replace_all(original, "\"version\":1,", "\"version\":2,")));
  expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument,
               {"manifest.json", "format version 2", "reads only version 1"});
  write_file(ck + "/manifest.json", replace_all(original, "zerotrain-checkpoint", "zerotrain-checkpoinX"));
  expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {"not a ZeroTrain checkpoint manifest"});
  write_file(ck + "/manifest.json", std::string("[1,2,3]"));
  expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {"not a JSON object"});
  write_file(ck + "/manifest.json", std::string(""));
  expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {"not valid JSON"});
}

// Gaps, overlaps and wrong sizes in an otherwise valid, checksummed manifest.
TEST(Corruption, GapsOverlapsAndWrongSizesInTheManifestAreRefused) {
  TempDir dir;
  const std::string ck = save(dir.str(), 1, 2, {{"x", StorageDType::kF32, 100, {}}}, 0, 1);
  const std::string original = manifest_text(ck);
  // File 0 holds elements [0, 50) at offset 0, file 1 holds [50, 100) at offset 0.
  ASSERT_THAT(original, HasSubstr(R"("begin":50,"bytes":200,"count":50)"));
  struct Case {
    std::string from, to, expect;
  };
  const std::vector<Case> cases = {
      {R"("begin":50,"bytes":200,"count":50)", R"("begin":51,"bytes":196,"count":49)", "a gap"},
      {R"("begin":50,"bytes":200,"count":50)", R"("begin":49,"bytes":200,"count":50)", "overlaps"},
      {R"("begin":50,"bytes":200,"count":50)", R"("begin":50,"bytes":204,"count":51)", "goes past"},
      {R"("begin":50,"bytes":200,"count":50)", R"("begin":50,"bytes":196,"count":50)", "do not hold"},
      {R"("begin":50,"bytes":200,"count":50)", R"("begin":50,"bytes":0,"count":0)", "is empty"},
      {R"("numel":100)", R"("numel":18446744073709551615)", "too large"},
      {R"("numel":100)", R"("numel":-100)", "not a non-negative integer"},
      {R"("numel":100)", R"("numel":100.5)", "not a non-negative integer"},
      {R"("shape":[])", R"("shape":[3,33])", "shape's product"},
      {R"("dtype":"f32")", R"("dtype":"f128")", "unknown dtype"},
      {R"("offset":0)", R"("offset":18446744073709551615)", "beyond the end"},
      {R"("name":"rank-00001.bin","size":200)", R"("name":"rank-00001.bin","size":400)", "belong to no range"},
      {R"("name":"rank-00001.bin")", R"("name":"rank-00000.bin")", "listed twice"},
      {R"("file":"rank-00001.bin")", R"("file":"rank-00009.bin")", "does not list"},
      {R"("step":1)", R"("step":-1)", "not a non-negative integer"},
      {R"("meta":{)", R"("meta":[],"x":{)", "not a JSON object"},
  };
  for (const Case& c : cases) {
    const std::string edited = replace_all(original, c.from, c.to);
    ASSERT_NE(edited, original) << c.from;
    write_file(ck + "/manifest.json", reseal(edited));
    expect_error([&] { CheckpointReader::open(ck); }, ErrorKind::kInvalidArgument, {"manifest.json", c.expect});
  }
  write_file(ck + "/manifest.json", original);
  EXPECT_NO_THROW(CheckpointReader::open(ck));
}

TEST(Corruption, ManifestParserRulesWithoutTheChecksum) {
  // parse_manifest(verify_checksum=false) still applies every other rule (what the fuzzer runs).
  const auto parse = [](const json& j) { return parse_manifest(j.dump(), "m", false); };
  json ok = {{"format", "zerotrain-checkpoint"}, {"version", 1}, {"step", 5}, {"meta", json::object()},
             {"files", {{{"name", "a.bin"}, {"size", 8}, {"xxh64", "0000000000000000"}}}},
             {"arrays", {{{"name", "x"}, {"dtype", "f32"}, {"numel", 2},
                          {"ranges", {{{"file", "a.bin"}, {"begin", 0}, {"count", 2}, {"offset", 0},
                                       {"bytes", 8}, {"xxh64", "0123456789abcdef"}}}}}}}};
  const Manifest m = parse(ok);
  EXPECT_EQ(m.step, 5);
  ASSERT_EQ(m.arrays.size(), 1u);
  EXPECT_EQ(m.arrays[0].ranges[0].xxh64, 0x0123456789abcdefull);
  expect_error([&] { parse_manifest(ok.dump(), "m", true); }, ErrorKind::kInvalidArgument, {"own checksum"});

  json bad = ok;
  bad["files"][0]["xxh64"] = "0123456789ABCDEF";
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"16 lower-case hex"});
  bad = ok;
  bad["files"] = json::array();
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"does not list"});
  bad = ok;
  bad["arrays"].push_back(ok["arrays"][0]);
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"listed twice"});
  bad = ok;
  bad["arrays"][0]["name"] = "";
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"empty name"});
  bad = ok;
  bad["arrays"][0].erase("ranges");
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"no \"ranges\""});
  bad = ok;
  bad["arrays"][0]["shape"] = {-1, -2};
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"shape dimension"});
  bad = ok;
  bad["arrays"][0]["shape"] = {4294967296ull, 4294967296ull};
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"overflowing"});
  bad = ok;
  bad["version"] = 1.5;
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"integer format \"version\""});
  expect_error([&] { parse_manifest(std::string(kMaxManifestBytes + 1, ' '), "m", false); }, ErrorKind::kInvalidArgument,
               {"more than"});
  bad = ok;
  json deep = json::object();
  for (int i = 0; i < 70; ++i) deep = json{{"d", deep}};
  bad["meta"] = deep;
  expect_error([&] { parse(bad); }, ErrorKind::kInvalidArgument, {"deeper than 64"});
  const std::string nested(200000, '[');  // not even valid JSON: refused without building it
  expect_error([&] { parse_manifest(nested, "m", false); }, ErrorKind::kInvalidArgument, {"m: "});
}

// ---- crash safety ----------------------------------------------------------------------------

constexpr int kCrashFiles = 3;
constexpr int kCrashKeep = 3;

std::vector<ArraySpec> crash_arrays() {
  // ~2.3 MB per checkpoint over 3 files.
  return {{"wte", StorageDType::kF32, 300007, {}}, {"h.0", StorageDType::kBF16, 250001, {}},
          {"h.1", StorageDType::kF32, 140000, {}}, {"step", StorageDType::kI64, 1, {}}};
}

// The child: saves step after step with the real writer until it is killed.
[[noreturn]] void crash_child(const std::string& root, int64_t first_step) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  try {
    for (int64_t step = first_step;; ++step) save(root, step, kCrashFiles, crash_arrays(), kCrashKeep, 2, json{{"step", step}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crash child: %s\n", e.what());
    ::_exit(2);
  }
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// Trials, seed and delays: ZT_CRASH_TRIALS / ZT_CRASH_SEED override (bench/crash_trials.sh runs
// 1000 trials). Each trial forks a child that saves checkpoints continuously, SIGKILLs it after a
// random delay spanning a few saves (so kills land in every phase: file writes, fsyncs, renames,
// latest, pruning), then checks what resume finds.
TEST(CheckpointCrash, SigkillAtRandomInstantsLeavesTheNewestCompleteCheckpointLoadable) {
  if (test::kThreadSanitizer) GTEST_SKIP() << "fork() with a multi-threaded child under TSan";
  const int trials = env_int("ZT_CRASH_TRIALS", 50);
  const auto seed = static_cast<uint64_t>(env_int("ZT_CRASH_SEED", 20240520));
  TempDir dir;
  const std::string root = dir.path("ckpt");
  const auto arrays = crash_arrays();

  // Calibrate: how long one save takes here, so the delays span a few of them.
  const auto t0 = std::chrono::steady_clock::now();
  save(dir.path("calibrate"), 1, kCrashFiles, arrays, 0, 2, json{{"step", 1}});
  const auto save_us = std::max<int64_t>(
      200, std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  std::mt19937_64 rng(seed);
  int64_t last = -1;
  int loaded = 0, replaced = 0;
  // Where the kills landed, from what they left behind (evidence the delays cover every phase).
  int mid_write = 0, latest_lagging = 0, unpruned = 0;
  for (int trial = 0; trial < trials; ++trial) {
    // Usually continue after the newest; sometimes re-save it (exercises replacing step-N).
    int64_t first = last < 0 ? 1 : last + 1;
    if (last > 0 && rng() % 5 == 0) {
      first = last;
      ++replaced;
    }
    const int64_t delay_us = static_cast<int64_t>(rng() % static_cast<uint64_t>(3 * save_us));
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) crash_child(root, first);
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "trial " << trial << ": the child ended by itself (status " << status << ")";

    for (const auto& e : fs::directory_iterator(root))
      if (e.path().filename().string().rfind(".tmp-", 0) == 0) {
        ++mid_write;
        break;
      }
    std::vector<std::string> notes;
    std::optional<ResolvedCheckpoint> resolved;
    ASSERT_NO_THROW(resolved = resolve_resume(root, ResumeFrom::newest(), &notes)) << "trial " << trial;
    EXPECT_TRUE(notes.empty()) << "trial " << trial << ": " << notes.front();
    // Every directory named step-N is complete: none newer than the one chosen, none damaged.
    const auto entries = list_checkpoints(root);
    for (const CheckpointEntry& e : entries)
      EXPECT_NO_THROW(CheckpointReader::open(e.path)) << "trial " << trial << ": " << e.name << " is incomplete";
    if (!resolved) {
      EXPECT_TRUE(entries.empty());
      EXPECT_EQ(last, -1) << "trial " << trial << ": a committed checkpoint vanished";
      continue;
    }
    ++loaded;
    ASSERT_FALSE(entries.empty());
    EXPECT_EQ(resolved->step, entries.back().step) << "trial " << trial;
    EXPECT_GE(resolved->step, last) << "trial " << trial << ": resume went backwards";
    EXPECT_EQ(resolved->reader.meta().at("step"), resolved->step);
    expect_arrays(resolved->reader, resolved->step, arrays);
    // latest never names an incomplete checkpoint. It may lag the newest: a kill between the
    // rename into place and the update of latest (repeatedly, over consecutive trials).
    if (const auto latest = read_latest(root)) {
      EXPECT_NO_THROW(CheckpointReader::open(root + "/" + *latest)) << "trial " << trial << ": latest = " << *latest;
      EXPECT_LE(parse_step_dir(*latest).value_or(-1), resolved->step);
      if (*latest != format_step_dir(resolved->step)) ++latest_lagging;
    }
    if (entries.size() > static_cast<size_t>(kCrashKeep)) ++unpruned;
    last = resolved->step;
    if (::testing::Test::HasFailure()) break;
  }
  RecordProperty("trials", trials);
  RecordProperty("checkpoints_committed", static_cast<int>(last));
  std::printf("crash trials: %d, loaded after %d of them, newest step %lld, %d re-saves of an existing step, "
              "one save ~%lld us; killed mid-save %d, between rename and latest %d, before pruning %d\n",
              trials, loaded, static_cast<long long>(last), replaced, static_cast<long long>(save_us), mid_write,
              latest_lagging, unpruned);
  EXPECT_GT(loaded, trials / 2) << "kills land too early: the delays do not span a save";
}


// ---- failures during a background save (the save-protocol test hook) ------------------------

// A hand-made two-rank snapshot whose values are a pure function of (step, rank, block, kind).
HostSnapshot fake_snapshot(int64_t step) {
  HostSnapshot snap;
  snap.step = step;
  snap.adamw = true;
  snap.block_names = {"wte", "h.0"};
  snap.block_numel = {1001, 257};
  snap.meta = json{{"step", step}};
  snap.shards.resize(2);
  for (int r = 0; r < 2; ++r)
    for (size_t b = 0; b < 2; ++b) {
      HostShard h;
      const int64_t n = snap.block_numel[b];
      h.begin = n * r / 2;
      const size_t count = static_cast<size_t>(n * (r + 1) / 2 - h.begin);
      for (std::vector<float>* v : {&h.master, &h.m, &h.v}) {
        v->resize(count);
        for (size_t i = 0; i < count; ++i)
          (*v)[i] = static_cast<float>(splitmix64(static_cast<uint64_t>(step) * 7919 + b * 131 + (h.begin + i) +
                                                  static_cast<uint64_t>(v == &h.m) * 17 + static_cast<uint64_t>(v == &h.v) * 29) %
                                       100000) * 1e-3f;
      }
      snap.shards[static_cast<size_t>(r)].push_back(std::move(h));
    }
  return snap;
}

// Every file under dir (recursively) with its bytes, so "byte-identical" is one comparison.
std::map<std::string, std::vector<uint8_t>> tree_bytes(const std::string& dir) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = read_bytes(e.path().string());
  return out;
}

// The restored arrays of a checkpoint equal the snapshot of its step, element for element.
void expect_snapshot(const std::string& ckpt, int64_t step) {
  const CheckpointReader reader = CheckpointReader::open(ckpt);
  const auto src = source_of(reader);
  const HostSnapshot want = fake_snapshot(step);
  const auto want_src = source_of(want);
  for (const std::string& block : want.block_names)
    for (const char* kind : {"/master", "/m", "/v"}) {
      const std::string a = block + kind;
      const uint64_t n = want_src->numel(a);
      std::vector<float> got(n), expected(n);
      src->read(a, 0, n, got.data());
      want_src->read(a, 0, n, expected.data());
      EXPECT_TRUE(std::memcmp(got.data(), expected.data(), n * 4) == 0) << ckpt << ": " << a;
    }
}

// Installs a hook for the scope of a test, removing it however the test ends.
struct ScopedHook {
  explicit ScopedHook(SaveFaultHook h) { set_save_fault_hook(std::move(h)); }
  ~ScopedHook() { set_save_fault_hook({}); }
};

struct InjectedFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TEST(SaveFaults, AFailureAtEveryPointLeavesTheEarlierCheckpointsIntactAndResumable) {
  for (const SavePoint point : kAllSavePoints) {
    for (const bool zt_error : {true, false}) {
      SCOPED_TRACE(std::string(save_point_name(point)) + (zt_error ? " (zt::Error)" : " (std::runtime_error)"));
      TempDir dir;
      const std::string root = dir.path("ckpt");
      BackgroundSaver saver(root, 2);
      saver.save(fake_snapshot(1), nullptr);
      saver.save(fake_snapshot(2), nullptr);
      saver.wait();
      const auto before = tree_bytes(root);
      std::atomic<int> hits{0};
      std::vector<std::string> collected;
      {
        ScopedHook hook([&](SavePoint p, const std::string& path) {
          if (p != point || hits++ != 0) return;  // the first time the point is reached
          if (zt_error) ZT_THROW(ErrorKind::kIo, path, ": injected failure at ", save_point_name(p));
          throw InjectedFailure(std::string("injected failure at ") + save_point_name(p));
        });
        saver.save(fake_snapshot(3), [&](const std::string& path, double) { collected.push_back(path); });
        if (point == SavePoint::kPrune) {
          EXPECT_NO_THROW(saver.wait()) << "pruning is best effort: the checkpoint is complete";
        } else if (zt_error) {
          EXPECT_THROW(saver.wait(), Error);
        } else {
          EXPECT_THROW(saver.wait(), InjectedFailure);
        }
      }
      EXPECT_GE(hits.load(), 1) << "the point was never reached";
      EXPECT_EQ(collected.size(), point == SavePoint::kPrune ? 1u : 0u) << "on_done runs only after a commit";
      // The earlier checkpoints, byte for byte, and latest never names anything incomplete.
      const auto after = tree_bytes(root);
      for (const auto& [name, bytes] : before) {
        if (name == kLatestFileName) continue;
        ASSERT_TRUE(after.count(name)) << name << " vanished";
        EXPECT_TRUE(after.at(name) == bytes) << name << " changed";
      }
      const bool committed = point == SavePoint::kFsyncRoot || point == SavePoint::kLatest || point == SavePoint::kPrune;
      EXPECT_EQ(fs::exists(root + "/step-00000003"), committed);
      for (const auto& e : fs::directory_iterator(root))
        EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << "staging left behind: " << e.path();
      std::optional<ResolvedCheckpoint> resolved;
      ASSERT_NO_THROW(resolved = resolve_resume(root, ResumeFrom::newest(), nullptr));
      ASSERT_TRUE(resolved);
      EXPECT_EQ(resolved->step, committed ? 3 : 2);
      expect_snapshot(resolved->path, resolved->step);
      expect_snapshot(root + "/step-00000001", 1);
      const auto latest = read_latest(root);
      ASSERT_TRUE(latest);
      EXPECT_EQ(*latest, point == SavePoint::kPrune ? "step-00000003" : "step-00000002");
      // Nothing is wedged: the next save goes through and prunes as asked.
      saver.save(fake_snapshot(4), nullptr);
      ASSERT_NO_THROW(saver.wait());
      expect_snapshot(root + "/step-00000004", 4);
      EXPECT_EQ(read_latest(root), "step-00000004");
      EXPECT_EQ(list_checkpoints(root).size(), 2u);
    }
  }
}

TEST(SaveFaults, TheNextSaveRethrowsAFailureAndDoesNotStart) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  BackgroundSaver saver(root, 0);
  ScopedHook hook([](SavePoint p, const std::string& path) {
    if (p == SavePoint::kManifest && path.find("step-00000001") != std::string::npos)
      ZT_THROW(ErrorKind::kIo, path, ": no space left on device (injected)");
  });
  saver.save(fake_snapshot(1), nullptr);
  expect_error([&] { saver.save(fake_snapshot(2), nullptr); }, ErrorKind::kIo, {"no space left", "manifest.json"});
  EXPECT_NO_THROW(saver.wait());  // reported once
  EXPECT_TRUE(list_checkpoints(root).empty()) << "the save after a failure must not start";
}

TEST(SaveFaults, TheCallbackRunsOnTheOwnersThreadAndNeverFromTheDestructor) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  {
    BackgroundSaver saver(root, 0);
    std::thread::id ran_on;
    saver.save(fake_snapshot(1), [&](const std::string&, double) { ran_on = std::this_thread::get_id(); });
    while (!saver.poll()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(ran_on, std::this_thread::get_id());
  }
  // The trainer's failure path: the saver is destroyed (by an exception) while a save is in
  // flight, after objects its callback uses (declared after it) are gone. The destructor must join
  // and drop the callback: under ASan a call would be a use after scope; here the flag says so.
  auto called = std::make_shared<std::atomic<bool>>(false);
  std::atomic<bool> in_prune{false};
  ScopedHook hook([&](SavePoint p, const std::string&) {
    if (p != SavePoint::kPrune) return;
    in_prune = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  try {
    BackgroundSaver saver(root, 0);
    std::vector<std::string> messages;  // destroyed before the saver
    saver.save(fake_snapshot(2), [&messages, called](const std::string& path, double) {
      messages.push_back(path);
      *called = true;
    });
    while (!in_prune) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    throw InjectedFailure("a device failed");
  } catch (const InjectedFailure&) {
  }
  EXPECT_FALSE(*called);
  expect_snapshot(root + "/step-00000002", 2);  // the save itself finished before the destructor returned
}

// ---- ownership of a checkpoint directory -----------------------------------------------------

RunIdentity identity(uint64_t seed, int heads = 2) {
  RunIdentity id;
  id.model = json{{"layers", 1}, {"heads", heads}, {"embd", 32}, {"seq_len", 16}, {"vocab", 256}, {"hidden", json::array()}};
  id.model_description = "gpt: 1 layers, " + std::to_string(heads) + " heads, 32 wide, 16 context, vocab 256";
  id.seed = seed;
  id.data = "synthetic";
  return id;
}

json owner_json(const std::string& root) {
  const auto b = read_bytes(root + "/" + kOwnerFileName);
  return json::parse(std::string(b.begin(), b.end()));
}

TEST(Ownership, TheFirstRunOwnsTheDirectoryAndAnotherRunIsRefused) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  std::string run_id;
  {
    const CheckpointDirLease lease = open_checkpoint_dir(root, identity(1), false);
    run_id = lease.run_id();
    EXPECT_EQ(run_id.size(), 16u);
    EXPECT_TRUE(lease.notes().empty());
    const json owner = owner_json(root);
    EXPECT_EQ(owner.at("run_id"), run_id);
    EXPECT_EQ(owner.at("identity").at("seed"), 1);
    save(root, 5, 2, test_arrays());
    EXPECT_EQ(CheckpointReader::open(root + "/step-00000005").meta().at("checkpoint_owner"), run_id);
  }
  const std::string msg = expect_error([&] { open_checkpoint_dir(root, identity(2), false); }, ErrorKind::kInvalidArgument,
                                       {root, "another run", run_id, "seed 1", "seed 2", "--resume auto",
                                        "another --checkpoint-dir"});
  EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 0);
  expect_error([&] { open_checkpoint_dir(root, identity(1, 4), false); }, ErrorKind::kInvalidArgument,
               {"4 heads", "2 heads"});
  // The owner again, or a resumed run: the same lineage.
  EXPECT_EQ(open_checkpoint_dir(root, identity(1), false).run_id(), run_id);
  EXPECT_EQ(open_checkpoint_dir(root, identity(2), true).run_id(), run_id);
  EXPECT_EQ(owner_json(root).at("identity").at("seed"), 2) << "the lineage continues with the resumed run's identity";
}

TEST(Ownership, ASecondConcurrentRunIsRefusedAtStart) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  {
    const CheckpointDirLease first = open_checkpoint_dir(root, identity(1), false);
    expect_error([&] { open_checkpoint_dir(root, identity(1), false); }, ErrorKind::kInvalidArgument,
                 {root, "in use by another running training run", "process " + std::to_string(::getpid())});
    expect_error([&] { open_checkpoint_dir(root, identity(1), true); }, ErrorKind::kInvalidArgument, {"in use"});
  }
  EXPECT_NO_THROW(open_checkpoint_dir(root, identity(1), false));  // released with the lease
}

TEST(Ownership, AnOwnerThatLeftNoCheckpointIsTakenOverWithANote) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  const std::string first = open_checkpoint_dir(root, identity(1), false).run_id();
  const CheckpointDirLease second = open_checkpoint_dir(root, identity(2), false);
  EXPECT_NE(second.run_id(), first);
  ASSERT_EQ(second.notes().size(), 1u);
  EXPECT_THAT(second.notes()[0], HasSubstr(first));
  EXPECT_THAT(second.notes()[0], HasSubstr("takes it over"));
}

// Every entry under root with its bytes, the run lock included, to show a refusal changed nothing.
std::map<std::string, std::string> tree_state(const std::string& root) { return test_util::tree_fingerprint(root); }

// #31 reproduction 2 and its class: a non-empty directory without a valid owner record is never
// adopted — checkpoints whose owner.json was removed (the same identity, with or without --resume),
// checkpoints from before owner records, a damaged record, a user's files — and the refusal leaves
// the directory as it was (no lock file either).
TEST(Ownership, ANonEmptyDirectoryWithoutAValidOwnerRecordIsNeverAdopted) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 100, {}}};
  {
    const CheckpointDirLease lease = open_checkpoint_dir(root, identity(7), false, 10);
    save(root, 1, 1, arrays);
  }
  fs::remove(root + "/" + kOwnerFileName);
  fs::remove(root + "/" + kRunLockFileName);
  const auto before = tree_state(root);
  for (const bool resuming : {false, true}) {
    const std::string msg = expect_error([&] { open_checkpoint_dir(root, identity(7), resuming, 10); },
                                         ErrorKind::kInvalidArgument,
                                         {root, "not empty", "step-00000001", "no owner record", "--resume " + root +
                                                                                                   "/step-N"});
    EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 0);
  }
  EXPECT_EQ(tree_state(root), before) << "a refused run writes nothing, not even its lock file";
  // Checkpoints from before owner records: the same.
  TempDir other;
  save(other.str(), 1, 1, arrays);
  expect_error([&] { open_checkpoint_dir(other.str(), identity(1), true); }, ErrorKind::kInvalidArgument,
               {"no owner record"});
  // A user's own files.
  TempDir mine;
  write_file(mine.path("notes.txt"), std::string("mine"));
  expect_error([&] { open_checkpoint_dir(mine.str(), identity(1), false); }, ErrorKind::kInvalidArgument,
               {"notes.txt", "no owner record"});
  // A damaged owner record.
  write_file(root + "/" + kOwnerFileName, std::string("{\"format\": 1"));
  const auto damaged = tree_state(root);
  expect_error([&] { open_checkpoint_dir(root, identity(7), true); }, ErrorKind::kInvalidArgument,
               {"not a valid owner record", "--resume " + root + "/step-N --checkpoint-dir NEW"});
  EXPECT_EQ(tree_state(root), damaged);
  // The fix the sentence names works: resuming into a new directory (only the lease is needed here).
  EXPECT_NO_THROW(open_checkpoint_dir(dir.path("new"), identity(7), true, 10));
}

// The file system's root and the home directory are nobody's checkpoint directory.
TEST(Ownership, TheRootAndTheHomeDirectoryAreRefused) {
  TempDir home;
  const char* old = std::getenv("HOME");
  const std::string saved = old ? old : "";
  ::setenv("HOME", home.str().c_str(), 1);
  expect_error([&] { open_checkpoint_dir(home.str(), identity(1), false); }, ErrorKind::kInvalidArgument,
               {"home directory", "checkpoints"});
  expect_error([&] { open_checkpoint_dir(home.str() + "/", identity(1), false); }, ErrorKind::kInvalidArgument,
               {"home directory"});
  old ? ::setenv("HOME", saved.c_str(), 1) : ::unsetenv("HOME");
  expect_error([&] { open_checkpoint_dir("/", identity(1), false); }, ErrorKind::kInvalidArgument,
               {"file system's root"});
  expect_error([&] { open_checkpoint_dir("/tmp/..", identity(1), false); }, ErrorKind::kInvalidArgument,
               {"file system's root"});
  EXPECT_TRUE(fs::is_empty(home.str()));
}

// The lease in .run.lock: released empty; a killed run's lease is stale and taken over with a note;
// a lease of another host renewed within the last minute is a live run there and is refused.
TEST(Ownership, AStaleLeaseIsToldApartFromALiveOne) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  const std::string lock = root + "/" + kRunLockFileName;
  {
    const CheckpointDirLease lease = open_checkpoint_dir(root, identity(1), false);
    const auto bytes = read_bytes(lock);
    const json held = json::parse(std::string(bytes.begin(), bytes.end()));
    EXPECT_EQ(held.at("pid"), ::getpid());
    EXPECT_GT(held.at("renewed").get<int64_t>(), 0);
  }
  EXPECT_TRUE(read_bytes(lock).empty()) << "a clean release empties the lease";
  EXPECT_TRUE(open_checkpoint_dir(root, identity(1), false).notes().empty());
  const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  auto leave = [&](const std::string& h, int64_t renewed) {
    write_file(lock, json{{"pid", 4242}, {"host", h}, {"started", renewed - 100}, {"renewed", renewed}}.dump());
  };
  // Killed on this host (its flock is gone): stale whatever its age.
  leave(host, now);
  {
    const CheckpointDirLease lease = open_checkpoint_dir(root, identity(1), false);
    ASSERT_EQ(lease.notes().size(), 1u);
    EXPECT_THAT(lease.notes()[0], HasSubstr("process 4242"));
    EXPECT_THAT(lease.notes()[0], HasSubstr("stale lease is taken over"));
  }
  // Another host, renewed just now: live there.
  leave("zt-other-host", now);
  expect_error([&] { open_checkpoint_dir(root, identity(1), false); }, ErrorKind::kInvalidArgument,
               {"in use by a training run on another host", "zt-other-host", "process 4242"});
  EXPECT_NE(read_bytes(lock).size(), 0u) << "a live lease of another host is left as it was";
  // Another host, silent for ten minutes: stale.
  leave("zt-other-host", now - 600);
  const CheckpointDirLease lease = open_checkpoint_dir(root, identity(1), false);
  ASSERT_EQ(lease.notes().size(), 1u);
  EXPECT_THAT(lease.notes()[0], HasSubstr("zt-other-host"));
}

TEST(Ownership, PruneDeletesOnlyWhatTheLineageWroteAndMentionsStrayDirectoriesOnce) {
  TempDir dir, elsewhere;
  const std::string root = dir.path("ckpt");
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 100, {}}};
  // Another run's checkpoint copied in, and a step directory without a manifest.
  {
    const CheckpointDirLease other = open_checkpoint_dir(elsewhere.str(), identity(9), false);
    save(elsewhere.str(), 2, 1, arrays);
  }
  const CheckpointDirLease lease = open_checkpoint_dir(root, identity(1), false);
  save(root, 1, 1, arrays, 1);
  fs::copy(elsewhere.str() + "/step-00000002", root + "/step-00000002");
  fs::create_directories(root + "/step-00000009");
  write_file(root + "/step-00000009/notes.txt", std::string("mine"));
  const auto foreign = tree_bytes(root + "/step-00000002");
  for (int64_t step = 3; step <= 5; ++step) save(root, step, 1, arrays, 1);
  std::vector<int64_t> steps;
  for (const auto& e : list_checkpoints(root)) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 5, 9}));
  EXPECT_TRUE(tree_bytes(root + "/step-00000002") == foreign);
  EXPECT_EQ(read_bytes(root + "/step-00000009/notes.txt").size(), 4u);
  EXPECT_EQ(lease.notes().size(), 0u);  // it appeared after the lease was taken
}

// #31 reproduction 1: a name a save of this run would write (step-N up to its last step) that is
// not the lineage's own — a user's folder, a file, another run's checkpoint — is refused before
// step 1 and left as it was; beyond the last step it is left alone and named once.
TEST(Ownership, NamesTheRunWouldWriteMustBeFreeOrItsOwn) {
  TempDir dir, elsewhere;
  const std::string root = dir.path("ckpt");
  const std::vector<ArraySpec> arrays = {{"x", StorageDType::kF32, 100, {}}};
  std::string run_id;
  {
    const CheckpointDirLease lease = open_checkpoint_dir(root, identity(1), false, 2);
    run_id = lease.run_id();
    save(root, 2, 1, arrays);
  }
  {
    const CheckpointDirLease other = open_checkpoint_dir(elsewhere.str(), identity(9), false);
    save(elsewhere.str(), 3, 1, arrays);
  }
  fs::create_directories(root + "/step-00000001");
  write_file(root + "/step-00000001/notes.txt", std::string("mine"));
  const auto before = tree_state(root);
  expect_error([&] { open_checkpoint_dir(root, identity(1), true, 2); }, ErrorKind::kInvalidArgument,
               {"step-00000001", "no manifest.json", "step-1 checkpoint", "move it out"});
  EXPECT_EQ(tree_state(root), before);
  fs::rename(root + "/step-00000001", dir.path("moved"));
  // Its own step-2 is the lineage's: fine. Another run's checkpoint copied in at step 3: refused
  // by a run that reaches step 3, named once by one that does not.
  fs::copy(elsewhere.str() + "/step-00000003", root + "/step-00000003");
  expect_error([&] { open_checkpoint_dir(root, identity(1), true, 5); }, ErrorKind::kInvalidArgument,
               {"step-00000003, a checkpoint of another run"});
  {
    const CheckpointDirLease lease = open_checkpoint_dir(root, identity(1), true, 2);
    EXPECT_EQ(lease.run_id(), run_id);
    ASSERT_EQ(lease.notes().size(), 1u);
    EXPECT_THAT(lease.notes()[0], HasSubstr("step-00000003 is not this run's and beyond its last step; left alone"));
  }
  fs::remove_all(root + "/step-00000003");
  write_file(root + "/step-00000004", std::string("a file"));
  expect_error([&] { open_checkpoint_dir(root, identity(1), true, 4); }, ErrorKind::kInvalidArgument,
               {"step-00000004, which is not a directory"});
  fs::remove(root + "/step-00000004");
  fs::remove(root + "/latest");
  fs::create_directories(root + "/latest");
  expect_error([&] { open_checkpoint_dir(root, identity(1), true, 4); }, ErrorKind::kInvalidArgument,
               {"latest, which is not a regular file"});
}

TEST(Ownership, UnusableDirectoriesAreRefusedBeforeTraining) {
  TempDir dir;
  const std::string root = dir.path("ckpt");
  save(root, 10, 1, {{"x", StorageDType::kF32, 10, {}}});
  // The latest pointer instead of its directory, as --checkpoint-dir and as --resume.
  expect_error([&] { open_checkpoint_dir(root + "/latest", identity(1), false); }, ErrorKind::kInvalidArgument,
               {"'latest' pointer file", "--checkpoint-dir " + root + " instead"});
  expect_error([&] { resolve_resume(root, ResumeFrom::checkpoint(root + "/latest"), nullptr); }, ErrorKind::kInvalidArgument,
               {"'latest' pointer file", "--resume " + root + "/step-00000010", "--resume auto"});
  expect_error([&] { resolve_resume(root + "/latest", ResumeFrom::newest(), nullptr); }, ErrorKind::kInvalidArgument,
               {"'latest' pointer file"});
  expect_error([&] { resolve_resume(root, ResumeFrom::checkpoint(root + "/step-00000010/manifest.json"), nullptr); },
               ErrorKind::kInvalidArgument, {"is a file, not a checkpoint directory"});
  expect_error([&] { open_checkpoint_dir(root + "/latest/sub", identity(1), false); }, ErrorKind::kInvalidArgument,
               {"part of its path is a file"});
  // Not writable: a read-only directory (as root, which may write anywhere, a directory of sysfs).
  if (::geteuid() != 0) {
    const std::string ro = dir.path("ro");
    fs::create_directories(ro);
    ::chmod(ro.c_str(), 0555);
    expect_error([&] { open_checkpoint_dir(ro, identity(1), false); }, ErrorKind::kInvalidArgument,
                 {"not writable", "choose a directory"});
    expect_error([&] { open_checkpoint_dir(ro + "/sub", identity(1), false); }, ErrorKind::kInvalidArgument,
                 {"cannot be created"});
    ::chmod(ro.c_str(), 0755);
  } else if (fs::is_directory("/sys/kernel")) {
    // sysfs refuses new files to everyone; a non-empty directory there is refused before that.
    expect_error([&] { open_checkpoint_dir("/sys/kernel", identity(1), false); }, ErrorKind::kInvalidArgument,
                 {"not empty", "no owner record"});
    std::string empty_sysfs;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/sys/kernel", ec)) {
      struct statfs sfs {};
      if (e.is_directory(ec) && fs::is_empty(e.path(), ec) && ::statfs(e.path().c_str(), &sfs) == 0 &&
          sfs.f_type == 0x62656572 /* SYSFS_MAGIC */) {
        empty_sysfs = e.path().string();
        break;
      }
    }
    if (!empty_sysfs.empty())
      expect_error([&] { open_checkpoint_dir(empty_sysfs, identity(1), false); }, ErrorKind::kInvalidArgument,
                 {"not writable", "choose a directory"});
    expect_error([&] { open_checkpoint_dir("/sys/kernel/zt-checkpoints", identity(1), false); },
                 ErrorKind::kInvalidArgument, {"cannot be created"});
  }
}

// ---- resuming another model ------------------------------------------------------------------

TEST(ModelShape, ACheckpointOfAnotherShapeIsRefusedNamingBoth) {
  ModelOverrides o;
  o.layers = 1;
  o.embd = 32;
  o.heads = 2;
  o.seq_len = 16;
  const ModelConfig mc = make_model_config("gpt-tiny", o);
  const auto model = make_model(mc);
  HostSnapshot snap = fake_snapshot(1);
  const RunIdentity saved = run_identity(mc, 1, "synthetic");
  snap.meta["model"] = saved.model;
  snap.meta["model"]["heads"] = 4;  // same array sizes: only the recorded shape tells them apart
  snap.meta["model"]["describe"] = "gpt: 1 layers, 4 heads, 32 wide, 16 context, vocab 256";
  expect_error([&] { check_source_matches(*source_of(snap), *model, true); }, ErrorKind::kInvalidArgument,
               {"another model", "4 heads", mc.describe(), "heads 4 there, 2 here"});
  // The same shape passes the shape check (and fails later, on this fake snapshot's arrays).
  snap.meta["model"] = saved.model;
  const std::string msg = expect_error([&] { check_source_matches(*source_of(snap), *model, true); },
                                       ErrorKind::kInvalidArgument, {"the snapshot of step 1"});
  EXPECT_THAT(msg, ::testing::Not(HasSubstr("there,")));
}

}  // namespace
}  // namespace zt
