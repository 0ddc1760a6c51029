// Byte-level BPE throughput on one core (bytes of text per second): GPT-2's split alone, encoding
// with the piece cache warm (steady state on a large corpus) and from an empty cache (every piece
// merged once). Text: Python's standard library sources (real prose and code, ~4 MB) when present,
// else generated words; merges learned from that text (8000, as a small GPT-2-style vocabulary).
#include <benchmark/benchmark.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"

namespace {

const std::string& corpus() {
  static const std::string text = [] {
    std::string s;
    namespace fs = std::filesystem;
    std::vector<fs::path> files;
    for (const char* dir : {"/usr/lib/python3.11", "/usr/lib/python3"})
      if (fs::is_directory(dir))
        for (const auto& e : fs::directory_iterator(dir))
          if (e.path().extension() == ".py") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::ostringstream os;
      os << std::ifstream(f).rdbuf();
      s += os.str();
      if (s.size() > (size_t{4} << 20)) break;
    }
    std::mt19937 rng(1);
    const char* words[] = {"the", "naïve", "東京", "it's", "1984", "👍", "  ", "\n", "don't", "data"};
    while (s.size() < (size_t{4} << 20)) s += std::string(words[rng() % 10]) + " ";
    return s;
  }();
  return text;
}

const std::string& tokenizer_dir() {
  static const std::string dir = [] {
    const std::string d = (std::filesystem::temp_directory_path() / "zt_bench_tokenizer").string();
    std::filesystem::create_directories(d);
    zt::BpeTokenizer::train({corpus()}, 8000).save(d);
    return d;
  }();
  return dir;
}

void BM_SplitGpt2(benchmark::State& state) {
  const std::string& text = corpus();
  for (auto _ : state) {
    size_t pieces = 0;
    zt::split_gpt2(text, [&](size_t, size_t) { ++pieces; });
    benchmark::DoNotOptimize(pieces);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}
BENCHMARK(BM_SplitGpt2)->Unit(benchmark::kMillisecond);

void BM_EncodeWarmCache(benchmark::State& state) {
  const std::string& text = corpus();
  zt::BpeTokenizer tok = zt::BpeTokenizer::load_dir(tokenizer_dir(), 0);
  std::vector<int32_t> ids;
  tok.encode(text, &ids);
  for (auto _ : state) {
    ids.clear();
    tok.encode(text, &ids);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["bytes_per_token"] = static_cast<double>(text.size()) / static_cast<double>(ids.size());
}
BENCHMARK(BM_EncodeWarmCache)->Unit(benchmark::kMillisecond);

void BM_EncodeColdCache(benchmark::State& state) {
  const std::string& text = corpus();
  std::vector<int32_t> ids;
  for (auto _ : state) {
    state.PauseTiming();
    zt::BpeTokenizer tok = zt::BpeTokenizer::load_dir(tokenizer_dir(), 0);
    ids.clear();
    state.ResumeTiming();
    tok.encode(text, &ids);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}
BENCHMARK(BM_EncodeColdCache)->Unit(benchmark::kMillisecond);

}  // namespace
