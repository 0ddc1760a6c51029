// A new user's path through the binary, with the spellings the README gives: tokenize a book with
// learned merges, train on the shards, generate text, evaluate the checkpoint (the loss its run's
// last evaluation reported, same batches), export it for Hugging Face; and bad tokenizer files
// refused with one sentence, exit code 2 and nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "tokenizer/byte_level.h"

namespace {

namespace fs = std::filesystem;
using zt::test_util::RunResult;

class TextToModel : public ::testing::Test {
 protected:
  // zerotrain run inside the test's directory, so relative paths read as a user types them.
  RunResult run(const std::string& args, bool with_stderr = true) {
    return zt::test_util::run_binary("cd '" + dir_.path("") + "' && " ZEROTRAIN_BIN, args, with_stderr);
  }
  std::string path(const std::string& name) const { return dir_.path(name); }
  void write(const std::string& name, const std::string& text) { std::ofstream(path(name), std::ios::binary) << text; }
  zt::test_util::TempDir dir_{"text_to_model"};
};

// ~80 KB of prose: 400 made-up words (enough distinct pairs for 512 merges), contractions, digits,
// punctuation, non-ASCII.
std::string book() {
  static const char* kSyllables[] = {"ka", "lo", "mi", "ne", "tu", "ra", "so", "vi", "de", "po", "an", "el", "or",
                                     "ün", "ça", "東", "京"};
  static const char* kWords[] = {"The", "it's", "don't", "we'll", "1984", "3.14", ",", "."};
  std::mt19937 rng(5);
  std::vector<std::string> words(kWords, kWords + 8);
  while (words.size() < 400) {
    std::string w;
    for (int k = 0, n = 2 + static_cast<int>(rng() % 3); k < n; ++k) w += kSyllables[rng() % 17];
    words.push_back(w);
  }
  std::string s;
  for (int i = 0; i < 12000; ++i) {
    s += words[rng() % words.size()];
    s += rng() % 9 ? " " : "\n";
  }
  return s;
}

std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> v;
  std::istringstream is(out);
  for (std::string line; std::getline(is, line);)
    if (!line.empty() && line[0] == '{') v.push_back(nlohmann::json::parse(line));
  return v;
}

TEST_F(TextToModel, TokenizeTrainGenerateEvalExport) {
  write("book.txt", book());
  RunResult r = run("tokenize book.txt --train-merges 512 --out tok/");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* f : {"tok/vocab.json", "tok/merges.txt", "tok/train_000000.bin", "tok/val_000000.bin"})
    EXPECT_TRUE(fs::exists(path(f))) << f;

  // The model's vocabulary comes from the tokenizer beside the shards.
  r = run("train --data 'tok/*.bin' --checkpoint-dir ck --devices cpu:1 --steps 6 --eval-every 3 --eval-batches 2 "
          "--sample-tokens 0 --log-format json", /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  double run_val_loss = NAN;
  for (const auto& j : json_lines(r.output))
    if (j.value("event", "") == "eval") run_val_loss = j["val_loss"].get<double>();
  ASSERT_TRUE(std::isfinite(run_val_loss)) << r.output;

  r = run("generate --checkpoint ck --tokenizer tok --prompt \"The \" --max-new-tokens 40");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("The ", 0), 0u) << r.output;
  EXPECT_GT(r.output.size(), 10u) << r.output;
  r = run("generate --checkpoint ck --tokenizer tok --prompt \"The \" --max-new-tokens 40 --log-format json", false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json g = nlohmann::json::parse(r.output);
  EXPECT_EQ(g["tokens"].size(), 40u);
  EXPECT_EQ(g["step"], 6);
  // --dump-step-logits: the logits each token was drawn from ([tokens, vocab] fp32, the real ids of
  // the padded head); greedy picks each row's first argmax, and the first row is the prompt's last
  // position, which --dump-logits computes through the model's forward (the KV cache within fp32
  // rounding of it, as test_generate holds it).
  r = run("generate --checkpoint ck --tokenizer tok --prompt \"The \" --max-new-tokens 5 --temperature 0 "
          "--log-format json --dump-step-logits steps.f32 --dump-logits prompt.f32", false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    auto floats = [&](const char* name) {
      std::vector<float> out(static_cast<size_t>(fs::file_size(path(name))) / 4);
      std::ifstream(path(name), std::ios::binary).read(reinterpret_cast<char*>(out.data()),
                                                       static_cast<std::streamsize>(out.size() * 4));
      return out;
    };
    const nlohmann::json j = nlohmann::json::parse(r.output);
    const std::vector<int> tokens = j["tokens"].get<std::vector<int>>(), prompt = j["prompt_tokens"].get<std::vector<int>>();
    const std::vector<float> steps = floats("steps.f32"), pre = floats("prompt.f32");
    const size_t V = 256 + 512 + 1;
    ASSERT_EQ(tokens.size(), 5u);
    ASSERT_EQ(steps.size(), 5 * V);
    ASSERT_EQ(pre.size(), prompt.size() * V);
    for (size_t k = 0; k < tokens.size(); ++k) {
      const auto row = steps.begin() + static_cast<std::ptrdiff_t>(k * V);
      EXPECT_EQ(std::max_element(row, row + static_cast<std::ptrdiff_t>(V)) - row, tokens[k]) << "token " << k;
    }
    float mx = 0;
    for (size_t v = 0; v < V; ++v) mx = std::max(mx, std::fabs(pre[pre.size() - V + v]));
    for (size_t v = 0; v < V; ++v) ASSERT_NEAR(steps[v], pre[pre.size() - V + v], 1e-5 * mx + 1e-5) << v;
  }
  r = run("generate --checkpoint ck --tokenizer tok --max-new-tokens 2 --dump-step-logits nodir/x.f32");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--dump-step-logits file"), std::string::npos) << r.output;

  r = run("eval --checkpoint ck --data 'tok/*val*.bin' --log-format json", false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json e = nlohmann::json::parse(r.output);
  // The same forward on the same device kind, over the same micro-batches, summed the same way: the
  // run's evaluation bit for bit (JSON prints doubles round-trip exact).
  EXPECT_EQ(e["val_loss"].get<double>(), run_val_loss) << r.output;
  EXPECT_EQ(e["device"], "cpu:0") << r.output;
  EXPECT_EQ(e["precision"], "fp32") << r.output;
  EXPECT_EQ(e["batches"], 2);
  EXPECT_NEAR(e["perplexity"].get<double>(), std::exp(run_val_loss), 1e-4 * std::exp(run_val_loss));
  r = run("eval --checkpoint ck --data 'tok/*val*.bin'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("val loss"), std::string::npos) << r.output;
  // 16 bits on the same path: bf16 weights (rounded once) and activations. Each rounding moves a
  // value by at most 2^-8 of it; the mean loss moves by a few such roundings' worth, 4 * 2^-8 here.
  r = run("eval --checkpoint ck --data 'tok/*val*.bin' --precision bf16 --log-format json", false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json e16 = nlohmann::json::parse(r.output);
  EXPECT_EQ(e16["precision"], "bf16");
  EXPECT_NE(e16["val_loss"].get<double>(), run_val_loss);  // 16 bits really ran
  EXPECT_NEAR(e16["val_loss"].get<double>(), run_val_loss, 4 * 0x1p-8 * run_val_loss) << r.output;
  r = run("generate --checkpoint ck --prompt \"The \" --max-new-tokens 8 --precision bf16 --log-format json", false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["tokens"].size(), 8u);
  // One device: a selection of several is refused with one sentence (exit 2), as is a bad precision.
  r = run("generate --checkpoint ck --devices cpu:2 --prompt x");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--devices cpu:2: generate and eval run on one device; pass cpu:1 or cuda:N"),
            std::string::npos) << r.output;
  EXPECT_EQ(run("eval --checkpoint ck --precision fp8").exit_code, 2);

  // transformers' layout (bench/peer_hf_export.py loads it and compares logits).
  r = run("export --checkpoint ck --format hf --out hf/");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* f : {"hf/config.json", "hf/model.safetensors", "hf/vocab.json", "hf/merges.txt", "hf/tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(path(f))) << f;
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(path("hf/config.json")));
  EXPECT_EQ(cfg["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(cfg["activation_function"], "gelu_new");
  // The tokenizer's vocabulary: bytes, merges, <|endoftext|>.
  const auto vocab = static_cast<int>(nlohmann::json::parse(std::ifstream(path("tok/vocab.json"))).size());
  EXPECT_EQ(vocab, 256 + 512 + 1);
  EXPECT_EQ(cfg["vocab_size"], vocab);
  EXPECT_EQ(cfg["eos_token_id"], vocab - 1);
  // safetensors: an 8-byte little-endian header length, then the JSON header.
  std::ifstream st(path("hf/model.safetensors"), std::ios::binary);
  uint64_t n = 0;
  st.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  st.read(header.data(), static_cast<std::streamsize>(n));
  const nlohmann::json h = nlohmann::json::parse(header);
  EXPECT_EQ(h["wte.weight"]["shape"], nlohmann::json::array({vocab, cfg["n_embd"].get<int>()}));
  const int C = cfg["n_embd"].get<int>();
  EXPECT_EQ(h["h.0.attn.c_attn.weight"]["shape"], nlohmann::json::array({C, 3 * C}));  // Conv1D: [in, out]
  EXPECT_FALSE(h.contains("lm_head.weight"));  // tied to wte
}

// Checkpoints of tensor- and pipeline-parallel runs hold the one-device tensors: eval reads them and
// reports each run's last evaluation (rows = data ranks x micro-batch, as the run evaluated); the
// runs' samples (both sampler paths) print as text.
TEST_F(TextToModel, EvalReadsTensorAndPipelineParallelCheckpoints) {
  write("book.txt", book());
  ASSERT_EQ(run("tokenize book.txt --train-merges 64 --out tok").exit_code, 0);
  for (const std::string layout : {"--tensor-parallel 2", "--pipeline-parallel 2 --micro-batch-size 2"}) {
    SCOPED_TRACE(layout);
    fs::remove_all(path("ck"));
    fs::remove(path("m.jsonl"));
    RunResult r = run("train --data 'tok/*.bin' --checkpoint-dir ck --devices cpu:2 --steps 3 --eval-every 0 "
                      "--eval-batches 1 --sample-tokens 12 --metrics m.jsonl " + layout, false);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // The run's sample is decoded through the tokenizer beside the shards: text, not token ids.
    const size_t at = r.output.find("--- sample (12 tokens");
    ASSERT_NE(at, std::string::npos) << r.output;
    const size_t from = r.output.find('\n', at) + 1;
    const std::string sample = r.output.substr(from, r.output.find("\nsummary:", from) - from);
    EXPECT_NE(sample.find_first_not_of("0123456789 \n"), std::string::npos) << sample;
    std::ostringstream metrics;
    metrics << std::ifstream(path("m.jsonl")).rdbuf();
    double run_val_loss = NAN;
    for (const auto& j : json_lines(metrics.str()))
      if (j.value("event", "") == "eval") run_val_loss = j["val_loss"].get<double>();
    r = run("eval --checkpoint ck --data 'tok/*val*.bin' --log-format json", false);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NEAR(nlohmann::json::parse(r.output)["val_loss"].get<double>(), run_val_loss, 1e-5 * run_val_loss);
    r = run("generate --checkpoint ck --prompt \"The \" --max-new-tokens 5 --temperature 0");
    EXPECT_EQ(r.exit_code, 0) << r.output;  // the tokenizer beside the run's data
  }
}

// vocab.json of the 256 byte symbols (id = byte) plus `extra` entries ("\"tok\":id").
std::string byte_vocab(const std::string& extra) {
  std::string j = "{";
  for (int b = 0; b < 256; ++b) {
    std::string sym = zt::byte_symbol(static_cast<uint8_t>(b));
    if (sym == "\"" || sym == "\\") sym = "\\" + sym;
    j += (b ? "," : "") + std::string("\"") + sym + "\":" + std::to_string(b);
  }
  return j + extra + "}";
}

TEST_F(TextToModel, BadTokenizerFilesAreRefusedAndNothingIsWritten) {
  write("book.txt", "some text to tokenize\n");
  struct Case {
    std::string vocab, merges, expect;
  };
  const Case cases[] = {
      {byte_vocab(",\"ab\":256,\"abc\":257"), "#version: 0.2\na b\nab", "is not two symbols separated by one space"},
      {byte_vocab(",\"ab\":256,\"abc\":257"), "#version: 0.2\na b\n", "merges.txt looks truncated"},
      {byte_vocab(",\"a\xe4\xb8\x80\":256"), "", "which is no byte's symbol"},
      {byte_vocab(",\"<|big|>\":70000"), "", "more than the 65536 a uint16 token shard can hold"},
  };
  for (const Case& c : cases) {
    write("vocab.json", c.vocab);
    write("merges.txt", c.merges);
    const RunResult r = run("tokenize book.txt --vocab vocab.json --merges merges.txt --out out/");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one sentence: " << r.output;
    EXPECT_FALSE(fs::exists(path("out"))) << "written despite the refusal: " << c.expect;
  }
}

}  // namespace
