// safetensors export of checkpoints and --init-from (see export.h).
#include "train/export.h"

#include <algorithm>
#include <filesystem>
#include <cstring>
#include <map>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "core/dtype.h"
#include "core/files.h"
#include "core/status.h"
#include "model/model.h"
#include "tokenizer/bpe.h"

namespace zt {

namespace {

// GPT-2's Conv1D weights: Hugging Face stores them [in, out].
bool is_conv1d(const ModelConfig& mc, const std::string& name) {
  if (mc.kind != ModelKind::kGpt) return false;
  for (const char* s : {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"})
    if (name.size() > std::char_traits<char>::length(s) && name.ends_with(s)) return true;
  return false;
}

std::vector<int64_t> dims(const Shape& s) {
  std::vector<int64_t> d;
  for (int i = 0; i < s.ndim(); ++i) d.push_back(s[i]);
  return d;
}

}  // namespace

std::string resolve_checkpoint_dir(const std::string& spec) {
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(spec) / kManifestFileName)) return spec;
  std::vector<std::string> notes;
  auto got = resolve_resume(spec, ResumeFrom::newest(), &notes);
  ZT_REQUIRE(got.has_value(), "'", spec, "' is neither a checkpoint directory nor a checkpoint root holding one");
  return got->path;
}

ModelConfig config_from_meta(const nlohmann::json& meta, const std::string& where) {
  ZT_REQUIRE(meta.contains("model") && meta["model"].is_object() && meta["model"].contains("preset"), where,
             " has no model description in its manifest");
  const auto& m = meta["model"];
  ModelOverrides o;
  try {
    o.layers = m.value("layers", 0);
    o.heads = m.value("heads", 0);
    o.embd = m.value("embd", 0);
    o.seq_len = m.value("seq_len", 0);
    o.vocab = m.value("vocab", 0);
    o.hidden = m.value("hidden", std::vector<int>{});
    return make_model_config(m.at("preset").get<std::string>(), o);
  } catch (const nlohmann::json::exception& e) {
    ZT_THROW(ErrorKind::kInvalidArgument, where, " has a malformed model description: ", e.what());
  }
}

namespace {

// The model configuration a checkpoint was saved with (from its manifest).
ModelConfig checkpoint_model_config(const std::string& checkpoint_dir) {
  const CheckpointReader r = CheckpointReader::open(checkpoint_dir, CheckpointReader::Verify::kSizesOnly);
  return config_from_meta(r.meta(), checkpoint_dir);
}

}  // namespace

ExportReport export_safetensors(const std::string& spec, const std::string& out_path) {
  // Before reading gigabytes: a device node, FIFO, directory or link at --out is refused here, and
  // SafetensorsWriter's AtomicFile looks again just before its rename.
  check_output_path(out_path, "--out file");
  const std::string dir = resolve_checkpoint_dir(spec);
  const CheckpointReader reader = CheckpointReader::open(dir);
  const ModelConfig mc = config_from_meta(reader.meta(), dir);
  const auto model = make_model(mc);
  // The checkpoint's arrays and the file hold the real vocabulary (the GPT's padded wte is local).
  const ParamLayout& L = model->tensor_map() ? *model->tensor_map()->logical : model->layout();
  std::vector<SafetensorsWriter::Spec> specs;
  for (const auto& b : L.blocks())
    for (const auto& t : b.tensors) {
      std::vector<int64_t> shape = dims(t.shape);
      if (is_conv1d(mc, t.name)) std::swap(shape[0], shape[1]);
      if (t.name == "wte.weight") shape[0] = mc.vocab;  // exactly V rows, whatever padding the layout has
      specs.push_back({t.name, StorageDType::kF32, shape});
    }
  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {"zerotrain_model", mc.describe()},
                                                   {"zerotrain_step", std::to_string(reader.step())}};
  SafetensorsWriter w(out_path, specs, meta);
  ExportReport rep;
  rep.checkpoint = dir;
  rep.step = reader.step();
  for (const auto& b : L.blocks()) {
    const std::string array = b.name + "/master";
    ZT_REQUIRE(reader.has_array(array) && reader.array(array).numel == static_cast<uint64_t>(b.numel), dir,
               " does not hold this model's '", array, "'");
    for (const auto& t : b.tensors) {
      const int64_t numel = t.name == "wte.weight" && mc.kind == ModelKind::kGpt ? int64_t{mc.vocab} * mc.embd : t.numel;
      std::vector<float> v(static_cast<size_t>(numel));
      reader.read(array, static_cast<uint64_t>(t.offset), static_cast<uint64_t>(numel), v.data());
      if (is_conv1d(mc, t.name)) {
        const int64_t out = t.shape[0], in = t.shape[1];
        std::vector<float> tr(v.size());
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i) tr[static_cast<size_t>(i * out + o)] = v[static_cast<size_t>(o * in + i)];
        v.swap(tr);
      }
      w.write(v.data(), v.size() * 4);
      ++rep.tensors;
      rep.bytes += v.size() * 4;
    }
  }
  w.commit();
  return rep;
}

std::vector<std::vector<float>> read_safetensors_weights(const std::string& path, const ModelConfig& mc,
                                                         const ParamLayout& layout, std::vector<std::string>* ignored) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::vector<std::vector<float>> blocks;
  std::vector<std::string> used;
  for (const auto& b : layout.blocks()) {
    std::vector<float> host(static_cast<size_t>(b.numel), 0.0f);
    for (const auto& t : b.tensors) {
      const SafetensorsEntry* e = f.find(t.name);
      if (!e) e = f.find("transformer." + t.name);
      ZT_REQUIRE(e != nullptr, path, " has no tensor '", t.name, "' (the model is ", mc.describe(), ")");
      used.push_back(e->name);
      std::vector<int64_t> want = dims(t.shape);
      const bool conv = is_conv1d(mc, t.name);
      if (conv) std::swap(want[0], want[1]);
      auto shape_str = [](const std::vector<int64_t>& s) {
        std::string r = "[";
        for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
        return r + "]";
      };
      ZT_REQUIRE(e->shape == want, path, ": tensor '", e->name, "' has shape ", shape_str(e->shape), ", the model needs ",
                 shape_str(want));
      ZT_REQUIRE(e->dtype == StorageDType::kF32 || e->dtype == StorageDType::kBF16 || e->dtype == StorageDType::kF16,
                 path, ": tensor '", e->name, "' is ", safetensors_dtype_name(e->dtype), "; F32, BF16 or F16 are supported");
      const std::vector<uint8_t> raw = f.read(e->name);
      std::vector<float> v(static_cast<size_t>(t.numel));
      for (size_t i = 0; i < v.size(); ++i) {
        if (e->dtype == StorageDType::kF32) {
          std::memcpy(&v[i], raw.data() + i * 4, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, raw.data() + i * 2, 2);
          v[i] = e->dtype == StorageDType::kBF16 ? bf16_bits_to_float(h) : half_bits_to_float(h);
        }
      }
      float* dst = host.data() + t.offset;
      if (conv) {
        const int64_t out = t.shape[0], in = t.shape[1];
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i) dst[o * in + i] = v[static_cast<size_t>(i * out + o)];
      } else {
        std::copy(v.begin(), v.end(), dst);
      }
    }
    blocks.push_back(std::move(host));
  }
  if (ignored)
    for (const auto& e : f.tensors())
      if (std::find(used.begin(), used.end(), e.name) == used.end()) ignored->push_back(e.name);
  return blocks;
}

HfExportReport export_hf(const std::string& spec, const std::string& out_dir, const std::string& tokenizer_dir) {
  namespace fs = std::filesystem;
  const std::string dir = resolve_checkpoint_dir(spec);
  const ModelConfig mc = checkpoint_model_config(dir);
  ZT_REQUIRE(mc.kind == ModelKind::kGpt, dir, " holds a ", mc.preset, " classifier; --format hf exports GPT models");
  std::error_code ec;
  ZT_REQUIRE(!fs::exists(out_dir, ec) || fs::is_directory(out_dir, ec), "--out ", out_dir, " exists and is not a directory");
  std::optional<BpeTokenizer> tok;
  std::string tokenizer_from = tokenizer_dir;
  if (tokenizer_from.empty()) {  // the tokenizer beside the token shards the run trained on, if any
    const nlohmann::json meta = CheckpointReader::open(dir, CheckpointReader::Verify::kSizesOnly).meta();
    const std::string data = meta.contains("sampler") ? meta["sampler"].value("data", std::string()) : "";
    if (!data.empty() && tokenizer_vocab_beside(data)) tokenizer_from = data_directory(data);
  }
  if (!tokenizer_from.empty()) {
    tok = load_tokenizer_if_present(tokenizer_from, 0);
    ZT_REQUIRE(tok.has_value(), "--tokenizer ", tokenizer_from, " holds no vocab.json and merges.txt");
    ZT_REQUIRE(tok->vocab_size() <= mc.vocab, "the tokenizer in ", tokenizer_from, " has ", tok->vocab_size(),
               " tokens, more than the model's vocabulary of ", mc.vocab);
  }
  fs::create_directories(out_dir, ec);
  ZT_REQUIRE(!ec, "cannot create --out directory ", out_dir, ": ", ec.message());
  HfExportReport rep;
  rep.weights = export_safetensors(dir, out_dir + "/model.safetensors");
  // transformers' GPT2Config: our GPT is GPT-2's architecture without dropout.
  nlohmann::ordered_json cfg = {
      {"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", mc.vocab},
      {"n_positions", mc.seq_len}, {"n_ctx", mc.seq_len}, {"n_embd", mc.embd}, {"n_layer", mc.layers},
      {"n_head", mc.heads}, {"n_inner", nullptr}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", 1e-5},
      {"resid_pdrop", 0.0}, {"embd_pdrop", 0.0}, {"attn_pdrop", 0.0}, {"initializer_range", 0.02},
      {"scale_attn_weights", true}, {"tie_word_embeddings", true}, {"use_cache", true}, {"torch_dtype", "float32"}};
  if (tok && tok->end_of_text()) {
    cfg["bos_token_id"] = *tok->end_of_text();
    cfg["eos_token_id"] = *tok->end_of_text();
  }
  write_file_atomic(out_dir + "/config.json", cfg.dump(2) + "\n", "config.json");
  rep.files = {"config.json", "model.safetensors"};
  if (tok) {
    tok->save(out_dir);
    nlohmann::ordered_json tc = {{"tokenizer_class", "GPT2Tokenizer"}, {"model_max_length", mc.seq_len},
                                 {"add_prefix_space", false}};
    if (tok->end_of_text())
      for (const char* k : {"bos_token", "eos_token", "unk_token"}) tc[k] = kEndOfText;
    write_file_atomic(out_dir + "/tokenizer_config.json", tc.dump(2) + "\n", "tokenizer_config.json");
    rep.files.insert(rep.files.end(), {"vocab.json", "merges.txt", "tokenizer_config.json"});
  }
  return rep;
}

}  // namespace zt
