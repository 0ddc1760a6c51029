// Issue 12 acceptance: every `zerotrain` example command in README.md runs as written, in README
// order in one scratch directory, in a fast form (few steps, tiny GPT-2 shapes) with the real binary.
// The README is read at test time, so new examples of the same forms are picked up automatically.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;

// One zerotrain invocation found in a fenced shell block.
struct Example {
  int line = 0;                  // 1-based README line where the (possibly continued) command starts
  std::string text;              // the logical line as written (continuations joined)
  std::vector<std::string> env;  // NAME=VALUE words before the program
  std::vector<std::string> args; // the words after the program, shell quoting removed
  std::string wrapper;           // the word the command was wrapped in (e.g. "nsys"), run without it
  std::string error;             // set when the line uses a shell form this extractor does not run
};

bool is_zerotrain(const std::string& word) {
  return word == "zerotrain" || (word.size() > 10 && word.compare(word.size() - 10, 10, "/zerotrain") == 0);
}

bool is_assignment(const std::string& word) {
  const size_t eq = word.find('=');
  if (eq == std::string::npos || eq == 0) return false;
  return std::all_of(word.begin(), word.begin() + static_cast<std::ptrdiff_t>(eq),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

// Splits one logical shell line into simple commands (separated by && || ; | &), each a list of
// words with POSIX quoting removed; a `#` starting a word ends the line. Redirections and
// substitutions are reported in `error`, since running them faithfully needs a real shell.
std::vector<std::vector<std::string>> shell_commands(const std::string& s, std::string& error) {
  std::vector<std::vector<std::string>> cmds(1);
  std::string word;
  bool in_word = false;
  auto end_word = [&] {
    if (in_word) cmds.back().push_back(word);
    word.clear();
    in_word = false;
  };
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == ' ' || c == '\t') {
      end_word();
    } else if (c == '#' && !in_word) {
      break;
    } else if (c == '\'') {
      const size_t close = s.find('\'', i + 1);
      if (close == std::string::npos) {
        error = "unterminated single quote";
        return {};
      }
      word += s.substr(i + 1, close - i - 1);
      in_word = true;
      i = close;
    } else if (c == '"') {
      size_t j = i + 1;
      for (; j < s.size() && s[j] != '"'; ++j) {
        if (s[j] == '\\' && j + 1 < s.size() && std::string("$`\"\\").find(s[j + 1]) != std::string::npos) {
          word += s[++j];
        } else if (s[j] == '$' || s[j] == '`') {
          error = "a substitution inside double quotes";
          return {};
        } else {
          word += s[j];
        }
      }
      if (j >= s.size()) {
        error = "unterminated double quote";
        return {};
      }
      in_word = true;
      i = j;
    } else if (c == '\\') {
      if (i + 1 < s.size()) word += s[++i];
      in_word = true;
    } else if (c == '&' || c == '|' || c == ';') {
      end_word();
      if (i + 1 < s.size() && s[i + 1] == c && c != ';') ++i;  // && or ||
      cmds.emplace_back();
    } else if (c == '$' && !in_word && (i + 1 == s.size() || s[i + 1] == ' ')) {
      cmds.back().push_back("$");  // a prompt, dropped by the caller
    } else if (c == '>' || c == '<' || c == '$' || c == '`' || c == '(' || c == ')') {
      error = std::string("the shell operator '") + c + "'";
      return {};
    } else {
      word += c;
      in_word = true;
    }
  }
  end_word();
  std::erase_if(cmds, [](const std::vector<std::string>& c) { return c.empty(); });
  return cmds;
}

// Every zerotrain command in the README's ```sh / ``` blocks (other languages are not commands).
std::vector<Example> extract_examples(const std::string& readme) {
  std::vector<Example> out;
  std::istringstream in(readme);
  std::string raw;
  int lineno = 0;
  bool in_block = false, shell_block = false;
  std::string logical;
  int logical_start = 0;
  while (std::getline(in, raw)) {
    ++lineno;
    if (!raw.empty() && raw.back() == '\r') raw.pop_back();
    const size_t first = raw.find_first_not_of(" \t");
    if (first != std::string::npos && raw.compare(first, 3, "```") == 0) {
      if (!in_block) {
        std::string info = raw.substr(first + 3);
        info.erase(0, info.find_first_not_of(" \t"));
        info = info.substr(0, info.find_first_of(" \t{"));
        shell_block = info.empty() || info == "sh" || info == "bash" || info == "shell" || info == "console";
      }
      in_block = !in_block;
      logical.clear();
      continue;
    }
    if (!in_block || !shell_block) continue;
    if (logical.empty()) logical_start = lineno;
    // A trailing backslash (outside a comment) continues the command on the next line.
    size_t end = raw.find_last_not_of(" \t");
    if (end != std::string::npos && raw[end] == '\\' && raw.find('#') == std::string::npos) {
      logical += raw.substr(0, end) + " ";
      continue;
    }
    logical += raw;
    std::string error;
    const auto cmds = shell_commands(logical, error);
    bool mentions = false;
    std::istringstream words_in(logical);
    for (std::string w; words_in >> w;) mentions |= is_zerotrain(w);
    if (!error.empty() && mentions) {
      Example ex;
      ex.line = logical_start;
      ex.text = logical;
      ex.error = error;
      out.push_back(ex);
    }
    for (std::vector<std::string> words : cmds) {
      if (!words.empty() && words[0] == "$") words.erase(words.begin());  // a prompt
      const auto prog = std::find_if(words.begin(), words.end(), is_zerotrain);
      if (prog == words.end()) continue;
      Example ex;
      ex.line = logical_start;
      ex.text = logical;
      auto w = words.begin();
      for (; w != prog && is_assignment(*w); ++w) ex.env.push_back(*w);
      if (w != prog) ex.wrapper = *w;
      ex.args.assign(prog + 1, words.end());
      out.push_back(ex);
    }
    logical.clear();
  }
  return out;
}

// --- the fast form ---------------------------------------------------------------------------

// Index of the value of `flag` (`--flag V` or `--flag=V`), or -1.
struct FlagRef {
  int index = -1;
  bool joined = false;  // --flag=V
};

FlagRef find_flag(const std::vector<std::string>& a, const std::string& flag) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == flag && i + 1 < a.size()) return {static_cast<int>(i) + 1, false};
    if (a[i].rfind(flag + "=", 0) == 0) return {static_cast<int>(i), true};
  }
  return {};
}

std::string flag_value(const std::vector<std::string>& a, const std::string& flag, const std::string& fallback = "") {
  const FlagRef r = find_flag(a, flag);
  if (r.index < 0) return fallback;
  const std::string& w = a[static_cast<size_t>(r.index)];
  return r.joined ? w.substr(flag.size() + 1) : w;
}

void set_flag(std::vector<std::string>& a, const std::string& flag, const std::string& value) {
  const FlagRef r = find_flag(a, flag);
  if (r.index < 0) {
    a.push_back(flag);
    a.push_back(value);
  } else {
    a[static_cast<size_t>(r.index)] = r.joined ? flag + "=" + value : value;
  }
}

std::vector<std::string> flag_values(const std::vector<std::string>& a, const std::string& flag) {
  std::vector<std::string> v;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == flag && i + 1 < a.size()) v.push_back(a[i + 1]);
    if (a[i].rfind(flag + "=", 0) == 0) v.push_back(a[i].substr(flag.size() + 1));
  }
  return v;
}

// `train` in the fast form: 2 steps (a resume 4, so it trains past the checkpoint the fast run
// before it wrote; at least the last step a --profile-steps range or an --inject-fault names, so
// the example still does what it shows), a short sample, one evaluation batch, and GPT-2 presets
// shrunk to one small layer with their other flags kept.
std::vector<std::string> fast_form(std::vector<std::string> a) {
  if (!a.empty() && a[0] == "sweep") {  // every trial at most 6 steps (ASHA keeps its rungs below)
    const std::string max = flag_value(a, "--max-steps");
    if (max.empty() || std::atoi(max.c_str()) > 6) set_flag(a, "--max-steps", "6");
    set_flag(a, "--eval-batches", "1");
    return a;
  }
  if (a.empty() || a[0] != "train") return a;
  int steps = find_flag(a, "--resume").index >= 0 ? 4 : 2;
  for (const std::string& f : flag_values(a, "--inject-fault")) {
    const size_t p = f.find("step=");
    if (p != std::string::npos) steps = std::max(steps, std::atoi(f.c_str() + p + 5));
  }
  const std::string profile = flag_value(a, "--profile-steps");
  if (const size_t colon = profile.find(':'); colon != std::string::npos)
    steps = std::max(steps, std::atoi(profile.c_str() + colon + 1));
  const std::string model = flag_value(a, "--model", "gpt-tiny");
  // --steps replaces --epochs (given both, train refuses --epochs as doing nothing).
  for (size_t i = 0; i < a.size();) {
    if (a[i].rfind("--epochs=", 0) == 0) a.erase(a.begin() + static_cast<std::ptrdiff_t>(i));
    else if (a[i] == "--epochs") a.erase(a.begin() + static_cast<std::ptrdiff_t>(i), a.begin() + static_cast<std::ptrdiff_t>(std::min(a.size(), i + 2)));
    else ++i;
  }
  set_flag(a, "--steps", std::to_string(steps));
  set_flag(a, "--sample-tokens", "8");
  set_flag(a, "--eval-batches", "1");
  if (model.rfind("gpt2-", 0) == 0) {
    for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
             {"--layers", "1"}, {"--embd", "64"}, {"--heads", "2"}, {"--seq-len", "64"}, {"--train-seq-len", "64"}})
      set_flag(a, flag, value);
  }
  return a;
}

bool has_glob(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// An llm.c token shard: 256 int32 header words (magic, version, count), then uint16 tokens (all
// below 256, so any vocabulary holds them).
void write_shard(const fs::path& p, int ntok) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = ntok;
  std::vector<uint16_t> tokens(static_cast<size_t>(ntok));
  for (int i = 0; i < ntok; ++i) tokens[static_cast<size_t>(i)] = static_cast<uint16_t>((i * 7 + i / 13) % 251);
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
  f.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
}

// Creates the input a command's --data names when it does not exist yet: llm.c shards for a .bin
// file or glob (a glob's `*`/`?` filled in), a text file otherwise.
void create_data(const fs::path& dir, const std::string& data) {
  if (data.empty() || data == "synthetic" || data == "fashion-mnist") return;
  std::string name = data;
  if (has_glob(name)) {
    for (char& c : name)
      if (c == '*' || c == '?') c = 'x';
    ASSERT_EQ(name.find('['), std::string::npos) << "the test cannot fill in the glob " << data;
  }
  const fs::path p = dir / name;
  if (fs::exists(p)) return;
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  if (p.extension() == ".bin") {
    write_shard(p, 1 << 16);
  } else {
    std::string text;
    for (int i = 0; text.size() < (1u << 16); ++i)
      text += "Line " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog.\n";
    std::ofstream(p, std::ios::binary) << text;
  }
}

std::string sh_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The words as a shell command line (quoted only where a shell would need it).
std::string join(const std::vector<std::string>& words) {
  std::string s;
  for (const std::string& w : words) {
    const bool plain = !w.empty() && w.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                         "0123456789-_./:=,+@%") == std::string::npos;
    s += (s.empty() ? "" : " ") + (plain ? w : sh_quote(w));
  }
  return s;
}

zt::test_util::RunResult run_in(const fs::path& dir, const std::vector<std::string>& env,
                                const std::vector<std::string>& args) {
  std::string cmd = "cd " + sh_quote(dir.string()) + " && exec env";
  for (const std::string& e : env) cmd += " " + sh_quote(e);
  cmd += " " + sh_quote(ZEROTRAIN_BIN);
  for (const std::string& a : args) cmd += " " + sh_quote(a);
  return zt::test_util::run_command(cmd + " 2>&1");
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);)
    if (l.find_first_not_of(" \t\r") != std::string::npos) v.push_back(l);
  return v;
}

// --- tests -----------------------------------------------------------------------------------

TEST(ReadmeExtractor, FindsCommandsInShellBlocksOnly) {
  const std::string md =
      "text zerotrain train --steps 9\n"
      "```sh\n"
      "zerotrain train --data 'a b/*_x_*.bin' \\\n"
      "    --lr 6e-4   # a comment 'with quotes'\n"
      "$ zerotrain plan --model \"gpt2-124m\"\n"
      "output line mentioning zerotrain-like words\n"
      "scripts/setup && cmake --build x && build/release/apps/zerotrain info\n"
      "nsys profile -o zt build/release/apps/zerotrain train --devices all\n"
      "ZT_CPU_DEVICES=3 zerotrain info\n"
      "apps/zerotrain.cc  the binary\n"
      "```\n"
      "```cpp\n"
      "zerotrain train --not-a-command\n"
      "```\n"
      "```\n"
      "zerotrain info > out.txt\n"
      "```\n";
  const std::vector<Example> ex = extract_examples(md);
  ASSERT_EQ(ex.size(), 6u);
  EXPECT_EQ(ex[0].line, 3);
  EXPECT_EQ(ex[0].args, (std::vector<std::string>{"train", "--data", "a b/*_x_*.bin", "--lr", "6e-4"}));
  EXPECT_EQ(ex[1].line, 5);
  EXPECT_EQ(ex[1].args, (std::vector<std::string>{"plan", "--model", "gpt2-124m"}));
  EXPECT_EQ(ex[2].args, (std::vector<std::string>{"info"}));
  EXPECT_EQ(ex[3].wrapper, "nsys");
  EXPECT_EQ(ex[3].args, (std::vector<std::string>{"train", "--devices", "all"}));
  EXPECT_EQ(ex[4].env, (std::vector<std::string>{"ZT_CPU_DEVICES=3"}));
  EXPECT_EQ(ex[4].wrapper, "");
  EXPECT_EQ(ex[5].line, 16);
  EXPECT_NE(ex[5].error.find("'>'"), std::string::npos) << ex[5].error;
}

TEST(ReadmeExtractor, FastFormShrinksTrainOnly) {
  EXPECT_EQ(fast_form({"train", "--steps", "3000", "--sample-every", "500"}),
            (std::vector<std::string>{"train", "--steps", "2", "--sample-every", "500", "--sample-tokens", "8",
                                      "--eval-batches", "1"}));
  EXPECT_EQ(fast_form({"train", "--model=mlp", "--epochs", "3"}),
            (std::vector<std::string>{"train", "--model=mlp", "--steps", "2", "--sample-tokens", "8",
                                      "--eval-batches", "1"}));
  const auto gpt2 = fast_form({"train", "--model", "gpt2-124m", "--batch-size", "32", "--embd", "768"});
  EXPECT_EQ(flag_value(gpt2, "--embd"), "64");
  EXPECT_EQ(flag_value(gpt2, "--layers"), "1");
  EXPECT_EQ(flag_value(gpt2, "--train-seq-len"), "64");
  EXPECT_EQ(flag_value(gpt2, "--batch-size"), "32");
  EXPECT_EQ(flag_value(fast_form({"train", "--inject-fault", "device=2,step=13"}), "--steps"), "13");
  EXPECT_EQ(flag_value(fast_form({"train", "--profile-steps", "10:12"}), "--steps"), "12");
  EXPECT_EQ(flag_value(fast_form({"train", "--resume", "auto"}), "--steps"), "4");
  EXPECT_EQ(fast_form({"plan", "--steps", "3000"}), (std::vector<std::string>{"plan", "--steps", "3000"}));
  EXPECT_EQ(flag_value(fast_form({"sweep", "--max-steps", "1500", "--space", "lr=1e-3,2e-3"}), "--max-steps"), "6");
}

TEST(Readme, EveryExampleCommandRuns) {
  const std::string readme = zt::test_util::read_text(ZT_README);
  ASSERT_FALSE(readme.empty()) << "cannot read " << ZT_README;
  const std::vector<Example> examples = extract_examples(readme);
  ASSERT_GE(examples.size(), 15u) << "the extractor found too few zerotrain commands in " << ZT_README;

  // Whether `cuda:` selections can work here: without a usable GPU they must be refused.
  zt::test_util::TempDir dir("readme");
  const zt::test_util::RunResult probe = run_in(dir.root(), {}, {"info", "--devices", "cuda"});
  const bool have_gpu = probe.exit_code == 0 && probe.output.find("cuda:0") != std::string::npos;

  for (const Example& ex : examples) {
    SCOPED_TRACE("README.md:" + std::to_string(ex.line) + ": " + ex.text);
    if (!ex.error.empty()) {
      ADD_FAILURE() << "README.md:" << ex.line << " uses " << ex.error
                    << ", which this test cannot run; write the example as a plain command";
      continue;
    }
    const std::vector<std::string> args = fast_form(ex.args);
    for (const std::string& data : flag_values(args, "--data")) create_data(dir.root(), data);
    if (args[0] == "tokenize")  // its inputs: the words before the first flag
      for (size_t i = 1; i < args.size() && args[i].rfind("-", 0) != 0; ++i) create_data(dir.root(), args[i]);
    const std::string shown = "zerotrain " + join(args);
    SCOPED_TRACE("ran: " + shown + (ex.wrapper.empty() ? "" : " (without " + ex.wrapper + ")"));
    const auto t0 = std::chrono::steady_clock::now();
    const zt::test_util::RunResult r = run_in(dir.root(), ex.env, args);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[README.md:%d] %s -> exit %d (%.1f s)\n", ex.line, shown.c_str(), r.exit_code, secs);
    std::fflush(stdout);

    bool wants_cuda = false;
    for (const std::string& d : flag_values(args, "--devices")) wants_cuda |= d.rfind("cuda", 0) == 0;
    if (wants_cuda && !have_gpu) {
      // An explicit CUDA selection without a GPU: one sentence saying so, exit 1 or 2.
      EXPECT_TRUE(r.exit_code == 1 || r.exit_code == 2) << "exit " << r.exit_code << "\n" << r.output;
      EXPECT_EQ(lines_of(r.output).size(), 1u) << r.output;
      EXPECT_NE(r.output.find("no usable GPU"), std::string::npos) << r.output;
    } else {
      EXPECT_EQ(r.exit_code, 0) << r.output;
    }
  }
}

}  // namespace
