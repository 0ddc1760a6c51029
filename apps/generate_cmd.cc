// `zerotrain generate` and `zerotrain eval` (see generate_cmd.h).
#include "generate_cmd.h"

#include <cmath>
#include <cstdio>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "cli_choice.h"
#include "core/files.h"
#include "core/status.h"
#include "data/language_data.h"
#include "runtime/runtime.h"
#include "tokenizer/bpe.h"
#include "train/generate.h"

namespace zt {

namespace {

// The checkpoint's tokenizer: --tokenizer DIR, else the one beside the data the run trained on;
// byte vocabularies need none.
std::optional<BpeTokenizer> find_tokenizer(const DeviceGpt& m, const std::string& flag) {
  if (!flag.empty()) {
    auto t = load_tokenizer_if_present(flag, 0);
    ZT_REQUIRE(t.has_value(), "--tokenizer ", flag, " holds no vocab.json and merges.txt");
    ZT_REQUIRE(t->vocab_size() <= m.mc.vocab, "the tokenizer in ", flag, " has ", t->vocab_size(),
               " tokens but the model's vocabulary is ", m.mc.vocab, "; is it the tokenizer the model was trained with?");
    return t;
  }
  const std::string data = m.meta.contains("sampler") ? m.meta["sampler"].value("data", std::string()) : "";
  if (!data.empty() && tokenizer_vocab_beside(data)) return load_tokenizer_if_present(data_directory(data), 0);
  ZT_REQUIRE(m.mc.vocab <= 256, "the model's vocabulary has ", m.mc.vocab, " tokens and no tokenizer was found "
             "beside its training data; pass --tokenizer DIR (the --out of zerotrain tokenize)");
  return std::nullopt;
}

CLI::Option* add_log_format(CLI::App* sub, bool& json) {
  return zt_cli::add_choice(*sub, "--log-format", json, zt_cli::Choices<bool>{{"text", false}, {"json", true}},
                            "text, or json: one JSON object on stdout");
}

// --devices and --precision of both commands: one device, the model's dtype.
void add_device_flags(CLI::App* sub, std::string& devices, Precision& precision) {
  sub->add_option("--devices", devices, "The one device to run on: all (the first GPU, else the CPU backend), cpu:1, "
                                        "cuda:N")->capture_default_str()->check(zt_cli::non_empty());
  zt_cli::add_choice(*sub, "--precision", precision,
                     zt_cli::Choices<Precision>{{"auto", Precision::kAuto}, {"fp32", Precision::kFp32},
                                                {"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}},
                     "Weights and activations: fp32, bf16, fp16, or auto (bf16 on GPUs, fp32 on the CPU backend)");
}

// A runtime of exactly one device: the checkpoint's tensor/pipeline layout is resharded to it.
std::unique_ptr<Runtime> one_device(const std::string& text) {
  DeviceSpec spec = parse_device_spec(text);
  const std::string why = "--devices " + text + ": generate and eval run on one device; pass cpu:1 or cuda:N";
  if (spec.kind == DeviceSpec::Kind::kAll) {
    spec.kind = cuda_availability().usable ? DeviceSpec::Kind::kCuda : DeviceSpec::Kind::kCpu;
    spec.cpu_count = 1;
  }
  if (spec.kind == DeviceSpec::Kind::kCpu) {
    ZT_REQUIRE(spec.cpu_count <= 1, why);
    spec.cpu_count = 1;
  }
  if (spec.kind == DeviceSpec::Kind::kCuda) {
    ZT_REQUIRE(spec.cuda_ordinals.size() <= 1, why);
    if (spec.cuda_ordinals.empty()) spec.cuda_ordinals = {0};
  }
  return Runtime::create(spec);
}

DType inference_dtype(Precision p, Backend b) {
  switch (p) {
    case Precision::kFp32: return DType::kF32;
    case Precision::kBf16: return DType::kBF16;
    case Precision::kFp16: return DType::kF16;
    case Precision::kAuto: break;
  }
  return b == Backend::kCuda ? DType::kBF16 : DType::kF32;
}

}  // namespace

GenerateCommand::GenerateCommand(CLI::App& app) {
  sub_ = app.add_subcommand("generate", "Text from a trained GPT checkpoint (one device, KV cache)");
  sub_->add_option("--checkpoint", checkpoint_, "A checkpoint directory, or a --checkpoint-dir (its newest complete one)")
      ->required()->check(zt_cli::non_empty());
  sub_->add_option("--prompt", prompt_, "Text to continue (default: <|endoftext|>, or a newline for byte models)");
  sub_->add_option("--tokenizer", tokenizer_, "Directory with vocab.json + merges.txt (default: beside the run's data)")
      ->check(zt_cli::non_empty());
  sub_->add_option("--max-new-tokens", max_new_tokens_, "Tokens to generate")->capture_default_str()->check(zt_cli::whole(0));
  sub_->add_option("--temperature", temperature_, "Sampling temperature; 0 = greedy")->capture_default_str()
      ->check(zt_cli::number(0, false));
  sub_->add_option("--top-k", top_k_, "Sample from the k most likely tokens; 0 = all")->capture_default_str()
      ->check(zt_cli::whole(0));
  sub_->add_option("--seed", seed_, "Sampling seed")->capture_default_str()->check(zt_cli::seed());
  add_log_format(sub_, json_);
  add_device_flags(sub_, devices_, precision_);
  sub_->add_option("--dump-logits", dump_logits_, "Also write the prompt positions' logits to FILE (float32, "
                   "[prompt tokens, vocab], row-major; peer tests)")->check(zt_cli::non_empty());
  sub_->add_option("--dump-step-logits", dump_step_logits_, "Also write the logits each generated token was drawn "
                   "from to FILE (float32, [max-new-tokens, vocab], row-major: the KV cache's; GPU-vs-CPU checks)")
      ->check(zt_cli::non_empty());
}

int GenerateCommand::run() {
  const std::unique_ptr<Runtime> rt = one_device(devices_);
  DeviceGpt m = load_device_gpt(checkpoint_, rt->device(0), inference_dtype(precision_, rt->backend()));
  std::optional<BpeTokenizer> tok = find_tokenizer(m, tokenizer_);
  std::vector<int32_t> prompt;
  if (tok) {
    if (!prompt_.empty()) tok->encode(prompt_, &prompt);
    else if (tok->end_of_text()) prompt.push_back(*tok->end_of_text());
  } else {
    for (char c : prompt_) prompt.push_back(static_cast<uint8_t>(c));
  }
  if (prompt.empty()) prompt.push_back('\n');
  if (!dump_logits_.empty()) {
    ZT_REQUIRE(static_cast<int>(prompt.size()) <= m.mc.seq_len, "--dump-logits: the prompt has ", prompt.size(),
               " tokens, more than the model's context of ", m.mc.seq_len);
    const std::vector<float> logits = full_forward_logits(m, prompt);
    write_file_atomic(dump_logits_, std::string_view(reinterpret_cast<const char*>(logits.data()), logits.size() * 4),
                      "--dump-logits file");
  }
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens_;
  o.temperature = temperature_;
  o.top_k = top_k_;
  o.seed = seed_;
  std::vector<float> step_logits;
  if (!dump_step_logits_.empty()) o.step_logits = &step_logits;
  const std::vector<int32_t> ids = generate(m, prompt, o);
  if (!dump_step_logits_.empty())
    write_file_atomic(dump_step_logits_, std::string_view(reinterpret_cast<const char*>(step_logits.data()),
                                                          step_logits.size() * 4), "--dump-step-logits file");
  const std::vector<int32_t> fresh(ids.begin() + static_cast<std::ptrdiff_t>(prompt.size()), ids.end());
  auto text = [&](const std::vector<int32_t>& v) {
    if (tok) return tok->decode_text(v);
    std::string s;
    for (int32_t id : v) s.push_back(static_cast<char>(id));
    return s;
  };
  if (json_) {
    const nlohmann::json j = {{"checkpoint", m.checkpoint}, {"step", m.step}, {"device", m.device->name()},
                              {"precision", dtype_name(m.dtype)}, {"prompt", prompt_},
                              {"completion", text(fresh)}, {"prompt_tokens", prompt}, {"tokens", fresh}};
    write_stdout_line(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    std::string line = prompt_;
    line += text(fresh);
    write_stdout_line(line);
  }
  return 0;
}

EvalCommand::EvalCommand(CLI::App& app) {
  sub_ = app.add_subcommand("eval", "Validation loss and perplexity of a GPT checkpoint over the batches its run's "
                                    "evaluation reads");
  sub_->add_option("--checkpoint", checkpoint_, "A checkpoint directory, or a --checkpoint-dir (its newest complete one)")
      ->required()->check(zt_cli::non_empty());
  sub_->add_option("--data", data_, "As train's --data; token shards all named *val* are the validation split "
                                    "(default: the run's data)")->check(zt_cli::non_empty());
  sub_->add_option("--eval-batches", batches_, "Batches (default: the run's --eval-batches)")->check(zt_cli::whole(1));
  sub_->add_option("--rows", rows_, "Sequences per batch (default: the run's evaluation batch)")->check(zt_cli::whole(1));
  add_log_format(sub_, json_);
  add_device_flags(sub_, devices_, precision_);
}

int EvalCommand::run() {
  const std::unique_ptr<Runtime> rt = one_device(devices_);
  DeviceGpt m = load_device_gpt(checkpoint_, rt->device(0), inference_dtype(precision_, rt->backend()));
  const nlohmann::json& meta = m.meta;
  const nlohmann::json sampler = meta.value("sampler", nlohmann::json::object());
  const nlohmann::json ev = meta.value("eval", nlohmann::json::object());
  const std::string data = data_.empty() ? sampler.value("data", std::string()) : data_;
  ZT_REQUIRE(!data.empty(), m.checkpoint, " does not name its data; pass --data");
  const uint64_t seed = sampler.value("seed", uint64_t{1337});
  const int T = ev.value("seq_len", sampler.value("seq_len", m.mc.seq_len));
  const int batches = batches_ ? batches_ : ev.value("batches", 8);
  const int rows = rows_ ? rows_ : ev.value("rows", sampler.value("batch_size", 8));
  const std::unique_ptr<LanguageData> lang = open_eval_data(data, seed, m.mc.vocab);
  const EvalReport r = evaluate_device(m, *lang, batches, rows, T);
  const double ppl = std::exp(r.loss);
  if (json_) {
    const nlohmann::json j = {{"event", "eval"}, {"checkpoint", m.checkpoint}, {"step", m.step}, {"data", data},
                              {"device", m.device->name()}, {"precision", dtype_name(m.dtype)},
                              {"batches", r.batches}, {"rows", r.rows}, {"seq_len", r.seq_len}, {"tokens", r.tokens},
                              {"val_loss", r.loss}, {"perplexity", ppl}};
    write_stdout_line(j.dump());
  } else {
    char buf[512];
    std::snprintf(buf, sizeof buf, "%s (step %lld) on %s: val loss %.4f, perplexity %.2f (%d batches x %d rows x %d tokens)",
                  m.checkpoint.c_str(), static_cast<long long>(m.step), data.c_str(), r.loss, ppl, r.batches, r.rows,
                  r.seq_len);
    write_stdout_line(buf);
  }
  return 0;
}

}  // namespace zt
