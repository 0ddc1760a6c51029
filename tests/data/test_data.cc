// Data layer: the synthetic source's exact entropy rate, sampler determinism and independence from
// how a global batch is split, llm.c shard round trips, text files, IDX images (hand-written files
// and, when installed, Fashion-MNIST), the prefetcher, and one test per bad-input message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include "core/status.h"
#include "data/image_data.h"
#include "data/language_data.h"
#include "data/prefetcher.h"
#include "data/synthetic_data.h"
#include "data/text_data.h"
#include "data/token_shards.h"
#include "test_util.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using test_util::TempDir;
using test_util::expect_invalid;
using test_util::write_file;

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

struct TokenBatch {
  std::vector<int32_t> inputs, targets;
};

TokenBatch fetch(const LanguageData& d, Split split, uint64_t step, int64_t first, int count, int T) {
  TokenBatch b{std::vector<int32_t>(static_cast<size_t>(count) * T, -7),
               std::vector<int32_t>(static_cast<size_t>(count) * T, -7)};  // poisoned
  d.batch(split, step, first, count, T, b.inputs.data(), b.targets.data());
  return b;
}

// ---- synthetic --------------------------------------------------------------------------------

const SyntheticData& synthetic_1337() {
  static const SyntheticData data(1337);
  return data;
}

TEST(Synthetic, StationaryDistributionIsAFixedPoint) {
  const MarkovSource& src = synthetic_1337().source();
  constexpr int K = MarkovSource::kSymbols;
  const std::vector<double>& pi = src.stationary();
  ASSERT_EQ(pi.size(), static_cast<size_t>(MarkovSource::kContexts));
  double total = 0;
  for (double p : pi) {
    EXPECT_GT(p, 0.0) << "every context must be recurrent";
    total += p;
  }
  EXPECT_NEAR(total, 1.0, 1e-13);
  std::vector<double> next(pi.size(), 0.0);
  for (int ctx = 0; ctx < MarkovSource::kContexts; ++ctx) {
    double row = 0;
    int successors = 0;
    for (int s = 0; s < K; ++s) {
      const double p = src.prob(ctx, s);
      row += p;
      successors += p > 0;
      next[static_cast<size_t>((ctx % K) * K + s)] += pi[static_cast<size_t>(ctx)] * p;
    }
    EXPECT_NEAR(row, 1.0, 1e-14) << "context " << ctx;
    EXPECT_GE(successors, MarkovSource::kMinSuccessors);
    EXPECT_LE(successors, MarkovSource::kMaxSuccessors);
  }
  double residual = 0;
  for (size_t c = 0; c < pi.size(); ++c) residual += std::fabs(next[c] - pi[c]);
  EXPECT_LT(residual, 1e-11) << "||pi P - pi||_1 after " << src.power_iterations() << " iterations";
}

TEST(Synthetic, EntropyRateMatchesTheCorpus) {
  const SyntheticData& data = synthetic_1337();
  const MarkovSource& src = data.source();
  const std::vector<uint8_t>& text = data.corpus();
  constexpr int K = MarkovSource::kSymbols;
  ASSERT_EQ(text.size(), SyntheticData::kDefaultBytes);
  std::vector<double> counts(static_cast<size_t>(MarkovSource::kContexts) * K, 0.0);
  double cross_entropy = 0;  // -mean log P_true(x_t | x_{t-2}, x_{t-1})
  for (size_t t = 2; t < text.size(); ++t) {
    const int a = MarkovSource::byte_symbol(text[t - 2]), b = MarkovSource::byte_symbol(text[t - 1]),
              c = MarkovSource::byte_symbol(text[t]);
    ASSERT_GE(a, 0);
    ASSERT_GE(b, 0);
    ASSERT_GE(c, 0);
    const double p = src.prob(a * K + b, c);
    ASSERT_GT(p, 0.0) << "the corpus took a transition the chain does not have";
    cross_entropy -= std::log(p);
    counts[static_cast<size_t>((a * K + b) * K + c)] += 1;
  }
  const double n = static_cast<double>(text.size() - 2);
  cross_entropy /= n;
  double empirical = 0;  // plug-in conditional entropy from trigram counts
  for (int ctx = 0; ctx < MarkovSource::kContexts; ++ctx) {
    double row = 0;
    for (int s = 0; s < K; ++s) row += counts[static_cast<size_t>(ctx * K + s)];
    // Near-deterministic rows make a few contexts rare; every context the chain visits at least
    // 10 times in expectation must appear.
    if (src.stationary()[static_cast<size_t>(ctx)] * n >= 10) {
      EXPECT_GT(row, 0) << "context " << ctx;
    }
    for (int s = 0; s < K; ++s) {
      const double k = counts[static_cast<size_t>(ctx * K + s)];
      if (k > 0) empirical -= k / n * std::log(k / row);
    }
  }
  const double rate = src.entropy_rate();
  std::printf("synthetic seed 1337: %zu bytes, entropy rate %.6f nats/token (order-1 %.6f), "
              "corpus plug-in %.6f, cross-entropy %.6f, %d power iterations\n",
              text.size(), rate, src.order1_entropy(), empirical, cross_entropy, src.power_iterations());
  EXPECT_NEAR(empirical, rate, 0.01);
  EXPECT_NEAR(cross_entropy, rate, 0.01);
  EXPECT_GT(rate, 0.3);  // a real learning problem, not a trivial one
  EXPECT_GT(src.order1_entropy(), rate + 0.1);  // context 2 matters
  ASSERT_TRUE(data.entropy_rate().has_value());
  EXPECT_EQ(*data.entropy_rate(), rate);
  EXPECT_DOUBLE_EQ(*data.loss_floor(64), (src.order1_entropy() + 63 * rate) / 64);
  EXPECT_DOUBLE_EQ(*data.loss_floor(1), src.order1_entropy());
}

TEST(Synthetic, DeterministicInTheSeed) {
  const SyntheticData& a = synthetic_1337();
  const SyntheticData b(1337, 100000), c(1338, 100000);
  EXPECT_EQ(b.source().entropy_rate(), a.source().entropy_rate());
  EXPECT_TRUE(std::equal(b.corpus().begin(), b.corpus().end(), a.corpus().begin()))
      << "a shorter corpus is a prefix of a longer one with the same seed";
  EXPECT_NE(c.source().entropy_rate(), a.source().entropy_rate());
  size_t same = 0;
  for (size_t i = 0; i < b.corpus().size(); ++i) same += b.corpus()[i] == c.corpus()[i];
  EXPECT_LT(same, b.corpus().size() / 2);
  const SyntheticData a2(1337);
  const auto x = fetch(a, Split::kTrain, 5, 0, 4, 32), y = fetch(a2, Split::kTrain, 5, 0, 4, 32);
  EXPECT_EQ(x.inputs, y.inputs);
  EXPECT_EQ(x.targets, y.targets);
}

// ---- the sampler ------------------------------------------------------------------------------

TEST(Sampler, TargetsAreInputsShiftedByOne) {
  const SyntheticData& d = synthetic_1337();
  constexpr int T = 16;
  const auto b = fetch(d, Split::kTrain, 3, 0, 8, T);
  for (int r = 0; r < 8; ++r) {
    const WindowStart w = d.window_start(Split::kTrain, 3, r, T);
    const uint8_t* x = d.segments(Split::kTrain)[0].u8 + w.offset;
    for (int t = 0; t < T; ++t) {
      ASSERT_EQ(b.inputs[static_cast<size_t>(r * T + t)], x[t]);
      ASSERT_EQ(b.targets[static_cast<size_t>(r * T + t)], x[t + 1]);
    }
    for (int t = 0; t + 1 < T; ++t) ASSERT_EQ(b.targets[static_cast<size_t>(r * T + t)], b.inputs[static_cast<size_t>(r * T + t + 1)]);
  }
}

TEST(Sampler, SequenceIsIndependentOfHowTheBatchIsSplit) {
  const SyntheticData& d = synthetic_1337();
  constexpr int T = 24, G = 12;
  for (Split split : {Split::kTrain, Split::kValidation}) {
    for (uint64_t step : {0ull, 1ull, 977ull, (1ull << 32) - 1}) {
      const auto whole = fetch(d, split, step, 0, G, T);
      const auto lo = fetch(d, split, step, 0, G / 2, T), hi = fetch(d, split, step, G / 2, G / 2, T);
      std::vector<int32_t> joined = lo.inputs;
      joined.insert(joined.end(), hi.inputs.begin(), hi.inputs.end());
      EXPECT_EQ(joined, whole.inputs) << split_name(split) << " step " << step;
      joined = lo.targets;
      joined.insert(joined.end(), hi.targets.begin(), hi.targets.end());
      EXPECT_EQ(joined, whole.targets);
      // Uneven splits (3 devices of 5 + 4 + 3 rows) and single rows agree too.
      const auto a = fetch(d, split, step, 0, 5, T), b = fetch(d, split, step, 5, 4, T),
                 c = fetch(d, split, step, 9, 3, T);
      std::vector<int32_t> three = a.inputs;
      three.insert(three.end(), b.inputs.begin(), b.inputs.end());
      three.insert(three.end(), c.inputs.begin(), c.inputs.end());
      EXPECT_EQ(three, whole.inputs);
      const auto row7 = fetch(d, split, step, 7, 1, T);
      EXPECT_TRUE(std::equal(row7.inputs.begin(), row7.inputs.end(), whole.inputs.begin() + 7 * T));
    }
  }
  // Different steps and different sequence indices give different windows.
  std::set<uint64_t> starts;
  for (uint64_t step = 0; step < 20; ++step)
    for (int i = 0; i < 20; ++i) starts.insert(d.window_start(Split::kTrain, step, i, T).offset);
  EXPECT_GT(starts.size(), 390u);
}

TEST(Sampler, StepAndIndexLimits) {
  const SyntheticData& d = synthetic_1337();
  std::vector<int32_t> in(8), tg(8);
  expect_invalid([&] { d.batch(Split::kTrain, 1ull << 32, 0, 1, 8, in.data(), tg.data()); }, {"2^32"});
  expect_invalid([&] { d.batch(Split::kTrain, 0, (1ll << 32) - 1, 2, 4, in.data(), tg.data()); }, {"2^32"});
  expect_invalid([&] { d.validate(0); }, {"sequence length"});
}

// Shard tokens that name their own global position: token == position, so a sequence reveals
// exactly where it was read from.
TEST(Sampler, TrainAndValidationAreDisjoint) {
  TempDir dir;
  std::vector<uint16_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);
  write_token_shard(dir.path("corpus.bin"), tokens);
  const TokenShardData d(dir.path("corpus.bin"), 42, kGpt2VocabSize);
  EXPECT_EQ(d.num_tokens(Split::kTrain), 18000u);
  EXPECT_EQ(d.num_tokens(Split::kValidation), 2000u);
  constexpr int T = 64;
  for (uint64_t step = 0; step < 50; ++step) {
    const auto tr = fetch(d, Split::kTrain, step, 0, 16, T), va = fetch(d, Split::kValidation, step, 0, 16, T);
    for (int r = 0; r < 16; ++r) {
      const int32_t t0 = tr.inputs[static_cast<size_t>(r * T)], v0 = va.inputs[static_cast<size_t>(r * T)];
      ASSERT_LE(t0 + T, 17999) << "a training sequence reads validation tokens";
      ASSERT_GE(v0, 18000) << "a validation sequence reads training tokens";
      ASSERT_LE(v0 + T, 19999);
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(tr.inputs[static_cast<size_t>(r * T + t)], t0 + t);
        ASSERT_EQ(tr.targets[static_cast<size_t>(r * T + t)], t0 + t + 1);
        ASSERT_EQ(va.targets[static_cast<size_t>(r * T + t)], v0 + t + 1);
      }
    }
  }
}

// ---- llm.c token shards -----------------------------------------------------------------------

TEST(TokenShards, RoundTripWithNamedValidationShards) {
  TempDir dir;
  // Sizes: a prime, a short one, and one exactly T+1 (a single window).
  constexpr int T = 32;
  const std::vector<std::pair<std::string, size_t>> files = {
      {"tiny_train_000.bin", 1009}, {"tiny_train_001.bin", 40}, {"tiny_train_002.bin", T + 1},
      {"tiny_val_000.bin", 500}};
  std::map<std::string, std::vector<uint16_t>> content;
  uint32_t state = 12345;
  for (const auto& [name, n] : files) {
    std::vector<uint16_t> t(n);
    for (auto& x : t) {
      state = state * 1664525u + 1013904223u;
      x = static_cast<uint16_t>((state >> 8) % kGpt2VocabSize);
    }
    write_token_shard(dir.path(name), t);
    content[dir.path(name)] = t;
  }
  write_file(dir.path("notes.txt"), std::string("x"));  // not matched by the glob
  const TokenShardData d(dir.path("tiny_*.bin"), 7, kGpt2VocabSize);
  ASSERT_EQ(d.files(Split::kTrain).size(), 3u);
  ASSERT_EQ(d.files(Split::kValidation).size(), 1u);
  EXPECT_EQ(d.files(Split::kValidation)[0], dir.path("tiny_val_000.bin"));
  EXPECT_EQ(d.num_tokens(Split::kTrain), 1009u + 40u + T + 1);
  EXPECT_EQ(d.num_windows(Split::kTrain, T), (1009u - T) + (40u - T) + 1u);
  EXPECT_EQ(d.vocab_size(), kGpt2VocabSize);
  std::set<int> segments_seen;
  for (Split split : {Split::kTrain, Split::kValidation}) {
    for (uint64_t step = 0; step < 40; ++step) {
      const auto b = fetch(d, split, step, 0, 8, T);
      for (int r = 0; r < 8; ++r) {
        const WindowStart w = d.window_start(split, step, r, T);
        const std::vector<uint16_t>& src = content.at(d.files(split)[static_cast<size_t>(w.segment)]);
        ASSERT_LE(w.offset + T + 1, src.size());
        if (split == Split::kTrain) segments_seen.insert(w.segment);
        for (int t = 0; t < T; ++t) {
          ASSERT_EQ(b.inputs[static_cast<size_t>(r * T + t)], src[w.offset + t]);
          ASSERT_EQ(b.targets[static_cast<size_t>(r * T + t)], src[w.offset + t + 1]);
        }
      }
    }
  }
  // Every training shard is sampled, the one-window shard included (~20 hits expected here).
  for (uint64_t step = 0; step < 2500; ++step)
    for (int r = 0; r < 8; ++r) segments_seen.insert(d.window_start(Split::kTrain, step, r, T).segment);
  EXPECT_EQ(segments_seen.size(), 3u);
  // The same data through the factory, by glob and by a single .bin path.
  const auto via_factory = open_language_data(dir.path("tiny_*.bin"), 7, kGpt2VocabSize);
  EXPECT_EQ(fetch(*via_factory, Split::kTrain, 3, 0, 4, T).inputs, fetch(d, Split::kTrain, 3, 0, 4, T).inputs);
  const auto single = open_language_data(dir.path("tiny_train_000.bin"), 7, 0);
  EXPECT_EQ(single->vocab_size(), kGpt2VocabSize);
  EXPECT_EQ(single->num_tokens(Split::kValidation), 100u);
}

TEST(TokenShards, LastTenPercentSpansShards) {
  TempDir dir;
  std::vector<uint16_t> a(700), b(300);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint16_t>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(700 + i);
  write_token_shard(dir.path("part_a.bin"), a);
  write_token_shard(dir.path("part_b.bin"), b);
  const TokenShardData d(dir.path("part_*.bin"), 1, 1000);
  EXPECT_EQ(d.num_tokens(Split::kTrain), 900u);
  EXPECT_EQ(d.num_tokens(Split::kValidation), 100u);
  ASSERT_EQ(d.segments(Split::kValidation).size(), 1u);
  EXPECT_EQ(d.segments(Split::kValidation)[0].at(0), 900);
  EXPECT_EQ(d.files(Split::kTrain).size(), 2u);
}

TEST(TokenShards, BadShardsAreRejectedAtLoad) {
  TempDir dir;
  std::vector<uint16_t> tokens(100, 5);
  auto shard_bytes = [&](int32_t magic, int32_t version, int32_t count, size_t n_tokens) {
    std::vector<uint8_t> bytes(kShardHeaderBytes + 2 * n_tokens, 0);
    std::memcpy(bytes.data(), &magic, 4);
    std::memcpy(bytes.data() + 4, &version, 4);
    std::memcpy(bytes.data() + 8, &count, 4);
    return bytes;
  };
  const std::string magic = dir.path("magic.bin");
  write_file(magic, shard_bytes(20240519, 1, 100, 100));
  expect_invalid([&] { TokenShardData(magic, 0, kGpt2VocabSize); }, {magic, "magic number is 20240519", "20240520"});

  const std::string version = dir.path("version.bin");
  write_file(version, shard_bytes(kShardMagic, 7, 100, 100));
  expect_invalid([&] { TokenShardData(version, 0, kGpt2VocabSize); }, {version, "version 7"});

  const std::string truncated = dir.path("truncated.bin");
  write_file(truncated, shard_bytes(kShardMagic, 1, 100, 99));
  expect_invalid([&] { TokenShardData(truncated, 0, kGpt2VocabSize); },
                 {truncated, "declares 100 tokens", "1224 bytes", "1222 bytes", "truncated"});

  const std::string trailing = dir.path("trailing.bin");
  write_file(trailing, shard_bytes(kShardMagic, 1, 100, 101));
  expect_invalid([&] { TokenShardData(trailing, 0, kGpt2VocabSize); }, {trailing, "trailing data"});

  const std::string stub = dir.path("stub.bin");
  write_file(stub, std::vector<uint8_t>(100, 0));
  expect_invalid([&] { TokenShardData(stub, 0, kGpt2VocabSize); }, {stub, "100 bytes", "1024-byte"});

  const std::string range = dir.path("train_000.bin");
  tokens[17] = 51234;
  write_token_shard(range, tokens);
  expect_invalid([&] { TokenShardData(range, 0, kGpt2VocabSize); },
                 {range + ": token 51234 at position 17 is out of range for vocab 50257"});
  // The first bad file in sorted order is the one named, even in a glob.
  expect_invalid([&] { open_language_data(dir.path("*.bin"), 0, kGpt2VocabSize); }, {magic});

  expect_invalid([&] { TokenShardData(dir.path("nothing_*.bin"), 0, kGpt2VocabSize); },
                 {dir.path("nothing_*.bin"), "no file matches"});
  expect_invalid([&] { open_language_data(dir.path("absent.bin"), 0, kGpt2VocabSize); },
                 {dir.path("absent.bin"), "does not exist"});

  TempDir only_val;
  write_token_shard(only_val.path("x_val_000.bin"), std::vector<uint16_t>(50, 1));
  expect_invalid([&] { TokenShardData(only_val.path("*.bin"), 0, kGpt2VocabSize); },
                 {only_val.path("*.bin"), "validation shard"});
}

// Runs f, which must throw zt::Error of `kind` whose message contains every part.
template <typename F>
void expect_error_kind(F&& f, ErrorKind kind, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected zt::Error(" << error_kind_name(kind) << ") mentioning '" << *parts.begin() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& p : parts) EXPECT_THAT(e.message(), HasSubstr(p));
  }
}

// Regression (issue 12): shards were memory-mapped, so one truncated during training killed the
// process with SIGBUS. Now the sampler preads and the shrink is a zt::Error(kIo) naming the file.
TEST(TokenShards, TruncatedWhileTrainingIsAnErrorNotSigbus) {
  TempDir dir;
  const std::string path = dir.path("live_train.bin");
  std::vector<uint16_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);
  write_token_shard(path, tokens);
  const TokenShardData d(path, 5, kGpt2VocabSize);
  constexpr int T = 32;
  const auto before = fetch(d, Split::kTrain, 0, 0, 8, T);
  for (int r = 0; r < 8; ++r)
    for (int t = 0; t < T; ++t)  // token == position: the reads are the file's bytes
      ASSERT_EQ(before.targets[static_cast<size_t>(r * T + t)], before.inputs[static_cast<size_t>(r * T)] + t + 1);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(kShardHeaderBytes)), 0);
  expect_error_kind([&] { fetch(d, Split::kTrain, 1, 0, 8, T); }, ErrorKind::kIo, {path, "truncated"});
  expect_error_kind([&] { fetch(d, Split::kValidation, 1, 0, 8, T); }, ErrorKind::kIo, {path, "truncated"});
}

TEST(TokenShards, RewrittenWithOutOfVocabTokensWhileTrainingIsAnError) {
  TempDir dir;
  const std::string path = dir.path("live_train.bin");
  write_token_shard(path, std::vector<uint16_t>(3000, 7));
  const TokenShardData d(path, 5, 1000);
  EXPECT_EQ(fetch(d, Split::kTrain, 0, 0, 4, 16).inputs[0], 7);
  // Same size, every token now 0xffff (out of range for vocab 1000), written in place.
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(kShardHeaderBytes));
  const std::string ff(6000, '\xff');
  f.write(ff.data(), static_cast<std::streamsize>(ff.size()));
  f.close();
  expect_error_kind([&] { fetch(d, Split::kTrain, 1, 0, 4, 16); }, ErrorKind::kIo, {path, "65535", "vocab 1000"});
}

// Regression (issue 12): a FIFO as --data hung in open(); /dev/zero read until memory ran out.
TEST(Factory, FifosAndDevicesAreRefusedQuickly) {
  TempDir dir;
  const std::string fifo = dir.path("data.txt");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string fifo_bin = dir.path("data.bin");
  ASSERT_EQ(::mkfifo(fifo_bin.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  expect_invalid([&] { open_language_data(fifo, 0, 0); }, {fifo, "FIFO", "not a regular file"});
  expect_invalid([&] { open_language_data(fifo_bin, 0, 0); }, {fifo_bin, "FIFO", "not a regular file"});
  for (const char* dev : {"/dev/zero", "/dev/urandom"})
    if (::access(dev, R_OK) == 0)
      expect_invalid([&] { open_language_data(dev, 0, 0); }, {dev, "character device", "not a regular file"});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // IDX readers share the opener.
  expect_invalid([&] { read_idx(fifo, 3); }, {fifo, "FIFO"});
  if (::access("/dev/zero", R_OK) == 0) expect_invalid([&] { read_idx("/dev/zero", 3); }, {"/dev/zero", "character device"});
}

// A path that exists is that file, even with glob characters in its name; only a path that does
// not exist is a pattern.
TEST(Factory, GlobCharactersInAnExistingNameAreThatFile) {
  TempDir dir;
  const std::string text = dir.path("notes[1]*.txt");
  write_file(text, std::vector<uint8_t>(500, 'q'));
  const auto t = open_language_data(text, 0, 0);
  EXPECT_EQ(t->vocab_size(), 256);
  EXPECT_EQ(t->num_tokens(Split::kTrain) + t->num_tokens(Split::kValidation), 500u);
  EXPECT_THAT(t->describe(), HasSubstr("text file"));
  // "shard[1].bin" also matches shard1.bin as a pattern; the existing file wins.
  write_token_shard(dir.path("shard[1].bin"), std::vector<uint16_t>(300, 11));
  write_token_shard(dir.path("shard1.bin"), std::vector<uint16_t>(300, 22));
  const TokenShardData literal(dir.path("shard[1].bin"), 0, kGpt2VocabSize);
  EXPECT_EQ(literal.files(Split::kTrain), std::vector<std::string>{dir.path("shard[1].bin")});
  EXPECT_EQ(fetch(literal, Split::kTrain, 0, 0, 1, 8).inputs[0], 11);
  // A pattern that names no existing file is still a pattern.
  const TokenShardData pattern(dir.path("shard?.bin"), 0, kGpt2VocabSize);
  EXPECT_EQ(pattern.files(Split::kTrain), std::vector<std::string>{dir.path("shard1.bin")});
}

TEST(TokenShards, ShorterThanASequence) {
  TempDir dir;
  write_token_shard(dir.path("small_train.bin"), std::vector<uint16_t>(100, 1));
  write_token_shard(dir.path("small_val.bin"), std::vector<uint16_t>(20, 1));
  const TokenShardData d(dir.path("small_*.bin"), 0, kGpt2VocabSize);
  d.validate(19);
  expect_invalid([&] { d.validate(20); }, {dir.path("small_*.bin"), "validation split", "T+1 = 21", "20"});
  std::vector<int32_t> in(64 * 2), tg(64 * 2);
  expect_invalid([&] { d.batch(Split::kTrain, 0, 2, 64, in.data(), tg.data()); },
                 {dir.path("small_*.bin"), "T+1 = 65"});
}

// ---- text files -------------------------------------------------------------------------------

TEST(TextFile, BytesAreTokens) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += "line " + std::to_string(i) + ": the quick brown fox\n";
  text += "\xff\x80";  // high bytes are tokens too
  const std::string path = dir.path("corpus.txt");
  write_file(path, std::vector<uint8_t>(text.begin(), text.end()));
  const auto d = open_language_data(path, 3, 0);
  EXPECT_EQ(d->vocab_size(), 256);
  EXPECT_EQ(d->num_tokens(Split::kTrain) + d->num_tokens(Split::kValidation), text.size());
  EXPECT_EQ(d->num_tokens(Split::kValidation), text.size() / 10);
  EXPECT_FALSE(d->entropy_rate().has_value());
  constexpr int T = 40;
  const size_t n_train = text.size() - text.size() / 10;
  for (Split split : {Split::kTrain, Split::kValidation}) {
    const auto b = fetch(*d, split, 11, 0, 6, T);
    for (int r = 0; r < 6; ++r) {
      std::string row;
      for (int t = 0; t < T; ++t) row += static_cast<char>(b.inputs[static_cast<size_t>(r * T + t)]);
      row += static_cast<char>(b.targets[static_cast<size_t>(r * T + T - 1)]);
      const size_t at = split == Split::kTrain ? text.substr(0, n_train).find(row) : text.find(row, n_train);
      EXPECT_NE(at, std::string::npos) << split_name(split) << " row " << r;
    }
  }
  const std::string small = dir.path("small.txt");
  write_file(small, std::vector<uint8_t>(100, 'a'));
  const auto s = open_language_data(small, 0, 0);
  s->validate(9);
  expect_invalid([&] { s->validate(10); }, {small, "validation split", "last 10% of the file", "T+1 = 11"});
  expect_invalid([&] { s->validate(95); }, {small, "train split", "T+1 = 96", "90"});
}

TEST(TextFile, BadFiles) {
  TempDir dir;
  const std::string missing = dir.path("missing.txt");
  expect_invalid([&] { open_language_data(missing, 0, 0); }, {missing, "missing", "No such file"});
  const std::string empty = dir.path("empty.txt");
  write_file(empty, std::string());
  expect_invalid([&] { open_language_data(empty, 0, 0); }, {empty, "empty"});
  expect_invalid([&] { open_language_data(dir.str(), 0, 0); }, {dir.str(), "directory"});
  const std::string ok = dir.path("ok.txt");
  write_file(ok, std::vector<uint8_t>(1000, 'z'));
  expect_invalid([&] { open_language_data(ok, 0, 128); }, {ok, "256", "128"});
  expect_invalid([&] { open_language_data("", 0, 0); }, {"empty", "synthetic"});
}

TEST(Factory, Synthetic) {
  const auto d = open_language_data("synthetic", 1337, 50257);
  ASSERT_TRUE(d->entropy_rate().has_value());
  EXPECT_EQ(*d->entropy_rate(), synthetic_1337().source().entropy_rate());
  EXPECT_EQ(d->vocab_size(), 256);
  EXPECT_THAT(d->describe(), HasSubstr("seed 1337"));
  EXPECT_EQ(fetch(*d, Split::kValidation, 9, 3, 2, 16).inputs,
            fetch(synthetic_1337(), Split::kValidation, 9, 3, 2, 16).inputs);
}

// ---- IDX images -------------------------------------------------------------------------------

std::vector<uint8_t> idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out;
  auto be32 = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
  };
  be32(magic);
  for (uint32_t d : dims) be32(d);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

void write_gzip(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

// A tiny dataset of 5x3 images: 37 training and 11 test examples; pixel p of image i is
// (7i + 3p) mod 256, label i mod 10. Train files gzip-compressed, test files plain.
struct TinyIdx {
  static constexpr int kRows = 5, kCols = 3, kTrain = 37, kTest = 11;
  TempDir dir;
  static std::vector<uint8_t> pixels(int n, int offset) {
    std::vector<uint8_t> px;
    for (int i = 0; i < n; ++i)
      for (int p = 0; p < kRows * kCols; ++p) px.push_back(static_cast<uint8_t>((7 * (i + offset) + 3 * p) % 256));
    return px;
  }
  static std::vector<uint8_t> labels(int n, int offset) {
    std::vector<uint8_t> l;
    for (int i = 0; i < n; ++i) l.push_back(static_cast<uint8_t>((i + offset) % 10));
    return l;
  }
  TinyIdx() {
    write_gzip(dir.path("train-images-idx3-ubyte.gz"), idx_bytes(0x803, {kTrain, kRows, kCols}, pixels(kTrain, 0)));
    write_gzip(dir.path("train-labels-idx1-ubyte.gz"), idx_bytes(0x801, {kTrain}, labels(kTrain, 0)));
    write_file(dir.path("t10k-images-idx3-ubyte"), idx_bytes(0x803, {kTest, kRows, kCols}, pixels(kTest, 100)));
    write_file(dir.path("t10k-labels-idx1-ubyte"), idx_bytes(0x801, {kTest}, labels(kTest, 100)));
  }
};

TEST(IdxImages, LoadsPlainAndGzip) {
  TinyIdx tiny;
  const IdxImageData d(tiny.dir.str(), 5, ImageNormalization::kUnitRange);
  EXPECT_EQ(d.num_classes(), 10);
  EXPECT_EQ(d.image_size(), 15);
  EXPECT_EQ(d.num_examples(Split::kTrain), TinyIdx::kTrain);
  EXPECT_EQ(d.num_examples(Split::kValidation), TinyIdx::kTest);
  std::vector<float> img(static_cast<size_t>(TinyIdx::kTest) * 15, NAN);
  std::vector<int32_t> lab(TinyIdx::kTest, -1);
  d.examples(Split::kValidation, 0, TinyIdx::kTest, img.data(), lab.data());
  const auto px = TinyIdx::pixels(TinyIdx::kTest, 100);
  for (int i = 0; i < TinyIdx::kTest; ++i) {
    EXPECT_EQ(lab[static_cast<size_t>(i)], (i + 100) % 10);
    for (int p = 0; p < 15; ++p)
      ASSERT_EQ(img[static_cast<size_t>(i * 15 + p)], static_cast<float>(px[static_cast<size_t>(i * 15 + p)] / 255.0));
  }
  // Standardisation uses the training images' statistics, computed in double.
  const auto train_px = TinyIdx::pixels(TinyIdx::kTrain, 0);
  double sum = 0, sq = 0;
  for (uint8_t v : train_px) {
    sum += v / 255.0;
    sq += (v / 255.0) * (v / 255.0);
  }
  const double mean = sum / train_px.size(), sd = std::sqrt(sq / train_px.size() - mean * mean);
  const IdxImageData s(tiny.dir.str(), 5, ImageNormalization::kStandardize);
  EXPECT_NEAR(s.mean(), mean, 1e-6);
  EXPECT_NEAR(s.stddev(), sd, 1e-6);
  s.examples(Split::kTrain, 3, 1, img.data(), lab.data());
  for (int p = 0; p < 15; ++p)
    EXPECT_NEAR(img[static_cast<size_t>(p)], (train_px[static_cast<size_t>(45 + p)] / 255.0 - mean) / sd, 1e-5);
}

TEST(IdxImages, EpochShuffleIsDeterministicAndComplete) {
  TinyIdx tiny;
  const IdxImageData d(tiny.dir.str(), 5, ImageNormalization::kUnitRange);
  const IdxImageData same(tiny.dir.str(), 5, ImageNormalization::kUnitRange);
  const IdxImageData other(tiny.dir.str(), 6, ImageNormalization::kUnitRange);
  const auto p0 = d.permutation(Split::kTrain, 0);
  EXPECT_EQ(p0, same.permutation(Split::kTrain, 0));
  EXPECT_NE(p0, d.permutation(Split::kTrain, 1));
  EXPECT_NE(p0, other.permutation(Split::kTrain, 0));
  std::vector<int32_t> sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < TinyIdx::kTrain; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);

  constexpr int B = 6;
  const int64_t batches = d.batches_per_epoch(Split::kTrain, B);
  EXPECT_EQ(batches, TinyIdx::kTrain / B);  // the partial batch is dropped
  for (uint64_t epoch : {0ull, 1ull, 2ull}) {
    std::multiset<int32_t> seen;
    for (int64_t b = 0; b < batches; ++b) {
      std::vector<float> img(B * 15, NAN), lo(B * 15, NAN);
      std::vector<int32_t> lab(B, -1), lo_lab(B, -1);
      d.batch(Split::kTrain, epoch, b, B, img.data(), lab.data());
      // Rows 0..2 and 3..5 fetched separately (two devices) match the whole batch.
      d.batch(Split::kTrain, epoch, b, B, 0, 3, lo.data(), lo_lab.data());
      d.batch(Split::kTrain, epoch, b, B, 3, 3, lo.data() + 45, lo_lab.data() + 3);
      EXPECT_EQ(img, lo);
      EXPECT_EQ(lab, lo_lab);
      const auto perm = d.permutation(Split::kTrain, epoch);
      for (int r = 0; r < B; ++r) {
        const int32_t ex = perm[static_cast<size_t>(b * B + r)];
        seen.insert(ex);
        EXPECT_EQ(lab[static_cast<size_t>(r)], ex % 10);
        EXPECT_EQ(img[static_cast<size_t>(r * 15)], static_cast<float>((7 * ex) % 256 / 255.0));
      }
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(batches * B));
    EXPECT_EQ(std::set<int32_t>(seen.begin(), seen.end()).size(), seen.size()) << "an example repeated within an epoch";
  }
  std::vector<float> img(B * 15);
  std::vector<int32_t> lab(B);
  expect_invalid([&] { d.batch(Split::kTrain, 0, batches, B, img.data(), lab.data()); }, {"batch 6 does not exist"});
}

TEST(IdxImages, CorruptFiles) {
  // Each case starts from the valid tiny dataset and breaks one file.
  auto with = [](const std::string& name, const std::vector<uint8_t>& bytes, std::initializer_list<std::string> parts) {
    TinyIdx tiny;
    const std::string path = tiny.dir.path(name);
    std::filesystem::remove(path + ".gz");
    write_file(path, bytes);
    std::vector<std::string> want{path};
    want.insert(want.end(), parts.begin(), parts.end());
    try {
      IdxImageData(tiny.dir.str(), 0);
      ADD_FAILURE() << "corrupt " << name << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
        for (const std::string& p : want) EXPECT_THAT(e.message(), HasSubstr(p)) << name;
    }
  };
  const auto px = TinyIdx::pixels(TinyIdx::kTrain, 0);
  const auto lb = TinyIdx::labels(TinyIdx::kTrain, 0);
  with("train-images-idx3-ubyte", idx_bytes(0x801, {37, 5, 3}, px), {"magic number is 0x00000801", "0x00000803"});
  with("train-labels-idx1-ubyte", idx_bytes(0x803, {37}, lb), {"magic number is 0x00000803", "0x00000801"});
  std::vector<uint8_t> cut = px;
  cut.resize(px.size() - 7);
  with("train-images-idx3-ubyte", idx_bytes(0x803, {37, 5, 3}, cut), {"37 x 5 x 3 = 555 bytes", "548", "truncated"});
  with("train-images-idx3-ubyte", {0, 0, 8, 3, 0, 0}, {"too short", "16-byte IDX header"});
  with("train-images-idx3-ubyte", {0, 0}, {"too short for an IDX header"});
  std::vector<uint8_t> lb36(lb.begin(), lb.end() - 1);
  with("train-labels-idx1-ubyte", idx_bytes(0x801, {36}, lb36), {"36 labels", "37 images"});
  std::vector<uint8_t> bad_label = lb;
  bad_label[4] = 12;
  with("train-labels-idx1-ubyte", idx_bytes(0x801, {37}, bad_label), {"label 12 at position 4", "10 classes"});
  with("t10k-images-idx3-ubyte", idx_bytes(0x803, {11, 3, 5}, TinyIdx::pixels(11, 100)), {"3 x 5", "5 x 3"});

  {  // A gzip stream cut in the middle.
    TinyIdx tiny;
    const std::string gz = tiny.dir.path("train-images-idx3-ubyte.gz");
    std::vector<uint8_t> bytes = read_bytes(gz);
    bytes.resize(bytes.size() / 2);
    write_file(gz, bytes);
    expect_invalid([&] { IdxImageData(tiny.dir.str(), 0); }, {gz});
  }
  {  // A missing file.
    TinyIdx tiny;
    std::filesystem::remove(tiny.dir.path("t10k-labels-idx1-ubyte"));
    expect_invalid([&] { IdxImageData(tiny.dir.str(), 0); }, {tiny.dir.str(), "t10k-labels-idx1-ubyte"});
  }
  expect_invalid([&] { open_image_data("/nonexistent/zt-images", 0); }, {"/nonexistent/zt-images", "no such directory"});
}

const IdxImageData* fashion_mnist() {
  static const std::unique_ptr<IdxImageData> data = []() -> std::unique_ptr<IdxImageData> {
    if (!fs::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz") &&
        !fs::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte"))
      return nullptr;
    return std::make_unique<IdxImageData>(kFashionMnistDir, 1337);
  }();
  return data.get();
}

TEST(FashionMnist, LoadsTheDebianPackage) {
  const IdxImageData* d = fashion_mnist();
  if (!d) GTEST_SKIP() << "dataset-fashion-mnist is not installed (" << kFashionMnistDir << ")";
  EXPECT_EQ(d->num_examples(Split::kTrain), 60000);
  EXPECT_EQ(d->num_examples(Split::kValidation), 10000);
  EXPECT_EQ(d->image_size(), 784);
  EXPECT_EQ(d->num_classes(), 10);
  std::vector<int> per_class(10, 0);
  for (int64_t i = 0; i < 60000; ++i) per_class[static_cast<size_t>(d->label(Split::kTrain, i))]++;
  for (int c = 0; c < 10; ++c) EXPECT_EQ(per_class[static_cast<size_t>(c)], 6000);
  EXPECT_NEAR(d->mean(), 0.2860, 1e-3);  // the published Fashion-MNIST statistics
  EXPECT_NEAR(d->stddev(), 0.3530, 1e-3);
  // A standardised batch is roughly zero-mean, unit-variance, and has every value finite.
  constexpr int B = 512;
  std::vector<float> img(static_cast<size_t>(B) * 784, NAN);
  std::vector<int32_t> lab(B, -1);
  d->batch(Split::kTrain, 0, 3, B, img.data(), lab.data());
  double s = 0, sq = 0;
  for (float v : img) {
    ASSERT_TRUE(std::isfinite(v));
    s += v;
    sq += static_cast<double>(v) * v;
  }
  const double m = s / img.size();
  EXPECT_NEAR(m, 0.0, 0.1);
  EXPECT_NEAR(sq / img.size() - m * m, 1.0, 0.15);
  for (int32_t l : lab) EXPECT_TRUE(l >= 0 && l < 10);
  const auto via_factory = open_image_data("fashion-mnist", 1337);
  std::vector<float> img2(img.size());
  std::vector<int32_t> lab2(B);
  via_factory->batch(Split::kTrain, 0, 3, B, img2.data(), lab2.data());
  EXPECT_EQ(img, img2);
  EXPECT_EQ(lab, lab2);
}

// ---- prefetcher -------------------------------------------------------------------------------

TEST(Prefetcher, EqualsDirectProduction) {
  const SyntheticData& d = synthetic_1337();
  constexpr int B = 4, T = 32;
  auto produce = [&](int64_t k, TokenBatch& out) {
    out.inputs.assign(B * T, -1);
    out.targets.assign(B * T, -1);
    d.batch(Split::kTrain, static_cast<uint64_t>(k), 0, B, T, out.inputs.data(), out.targets.data());
  };
  Prefetcher<TokenBatch> prefetch(produce);
  // Sequential, a repeat, a jump forward (resume), a jump back, and sequential again.
  for (int64_t k : {0, 1, 2, 3, 3, 4, 10, 11, 12, 5, 6, 7, 8, 100, 101}) {
    TokenBatch direct;
    produce(k, direct);
    const TokenBatch& got = prefetch.get(k);
    ASSERT_EQ(got.inputs, direct.inputs) << "batch " << k;
    ASSERT_EQ(got.targets, direct.targets) << "batch " << k;
  }
}

TEST(Prefetcher, OverlapsProductionAndStressesHandOff) {
  // The producer writes k into every element; a consumer that sees any other value in batch k read
  // a buffer the worker was still filling.
  std::atomic<int> produced{0};
  Prefetcher<std::vector<int64_t>> prefetch(
      [&](int64_t k, std::vector<int64_t>& out) {
        for (auto& x : out) x = k;
        produced++;
      },
      std::vector<int64_t>(4096, -1));
  for (int64_t k = 0; k < 3000; ++k) {
    const std::vector<int64_t>& b = prefetch.get(k);
    for (int64_t x : b) ASSERT_EQ(x, k);
  }
  EXPECT_GE(produced.load(), 3000);
  // The next batch is being produced while the caller works on the current one.
  std::atomic<bool> started{false};
  Prefetcher<int> slow([&](int64_t k, int& out) {
    if (k == 1) started = true;
    out = static_cast<int>(k);
  });
  EXPECT_EQ(slow.get(0), 0);
  for (int i = 0; i < 2000 && !started; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(started.load()) << "batch 1 was not prefetched after get(0)";
  EXPECT_EQ(slow.get(1), 1);
}

TEST(Prefetcher, RethrowsProducerErrorsOnGet) {
  Prefetcher<int> prefetch([](int64_t k, int& out) {
    if (k == 2) ZT_THROW(ErrorKind::kInvalidArgument, "batch ", k, " is bad");
    out = static_cast<int>(k) * 10;
  });
  EXPECT_EQ(prefetch.get(0), 0);
  EXPECT_EQ(prefetch.get(1), 10);  // batch 2 fails in the background; nothing is thrown yet
  expect_invalid([&] { prefetch.get(2); }, {"batch 2 is bad"});
  expect_invalid([&] { prefetch.get(2); }, {"batch 2 is bad"});  // retried, fails again
  EXPECT_EQ(prefetch.get(3), 30);
  EXPECT_EQ(prefetch.get(4), 40);
}

TEST(Prefetcher, ShutsDownWithWorkInFlight) {
  std::atomic<int> calls{0};
  for (int round = 0; round < 20; ++round) {
    Prefetcher<int> prefetch([&](int64_t k, int& out) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
      out = static_cast<int>(k);
      calls++;
    });
    EXPECT_EQ(prefetch.get(round), round);
  }  // each destructor waits for the prefetch of round+1, then joins
  EXPECT_GE(calls.load(), 20);
  { Prefetcher<int> unused([](int64_t, int&) {}); }  // never asked: idle worker shuts down
}

}  // namespace
}  // namespace zt
