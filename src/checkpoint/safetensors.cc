// safetensors reading (validated, see safetensors.h) and atomic writing.
#include "checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/file_io.h"
#include "core/files.h"
#include "core/status.h"

namespace zt {
namespace {

using nlohmann::json;

constexpr char kMetadataKey[] = "__metadata__";

[[noreturn]] void invalid(const std::string& where, const std::string& what) {
  ZT_THROW(ErrorKind::kInvalidArgument, where, ": not a valid safetensors file: ", what);
}

std::string shown(std::string_view s) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 200; ++i) {
    const auto u = static_cast<unsigned char>(s[i]);
    out += (u < 0x20 || u == 0x7f) ? '?' : s[i];
  }
  if (s.size() > 200) out += "...";
  return out + "'";
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// N from the first 8 bytes, checked against the limits and the file size.
uint64_t header_length(std::span<const uint8_t> prefix, uint64_t file_size, const std::string& where) {
  if (prefix.size() < 8 || file_size < 8)
    invalid(where, "the file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  const uint64_t n = read_le64(prefix.data());
  if (n > kSafetensorsMaxHeaderBytes)
    invalid(where, "the header length " + std::to_string(n) + " exceeds the " +
                       std::to_string(kSafetensorsMaxHeaderBytes) + "-byte limit");
  if (n > file_size - 8)
    invalid(where, "the header length " + std::to_string(n) + " runs past the end of the " +
                       std::to_string(file_size) + "-byte file (truncated?)");
  return n;
}

uint64_t checked_numel(const std::vector<int64_t>& shape, bool* ok) {
  uint64_t n = 1;
  *ok = true;
  for (const int64_t d : shape)
    if (d < 0 || !checked_mul(n, static_cast<uint64_t>(d), &n)) *ok = false;
  return n;
}

}  // namespace

uint64_t SafetensorsEntry::numel() const {
  bool ok;
  return checked_numel(shape, &ok);
}

const SafetensorsEntry* SafetensorsHeader::find(std::string_view name) const {
  for (const SafetensorsEntry& e : tensors)
    if (e.name == name) return &e;
  return nullptr;
}

SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> prefix, uint64_t file_size,
                                           const std::string& where) {
  const uint64_t n = header_length(prefix, file_size, where);
  if (prefix.size() - 8 < n) invalid(where, "the header bytes were not supplied");  // caller's bug, reported
  SafetensorsHeader h;
  h.data_offset = 8 + n;
  h.data_bytes = file_size - h.data_offset;
  const auto* text = reinterpret_cast<const char*>(prefix.data() + 8);
  if (n == 0 || text[0] != '{') invalid(where, "the header does not start with '{'");

  // Duplicate names would silently shadow each other in a JSON object: refuse them.
  // The format is 3 levels deep ({name: {shape: [..]}}); deeper nesting is refused unbuilt.
  std::set<std::string> keys;
  std::string duplicate;
  bool too_deep = false;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > 8) {
      too_deep = true;
      return false;
    }
    if (event == json::parse_event_t::key && depth == 1 && duplicate.empty() && parsed.is_string() &&
        !keys.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json root;
  try {
    root = json::parse(text, text + n, on_event);
  } catch (const json::exception& e) {
    invalid(where, std::string("the header is not valid JSON: ") + e.what());
  }
  if (too_deep) invalid(where, "the header nests JSON deeper than 8 levels");
  if (!root.is_object()) invalid(where, "the header is not a JSON object");
  if (!duplicate.empty()) invalid(where, "tensor " + shown(duplicate) + " appears twice in the header");

  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) invalid(where, "\"__metadata__\" is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) invalid(where, "\"__metadata__\" value of " + shown(k) + " is not a string");
        h.metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    const std::string ctx = "tensor " + shown(key);
    if (key.empty()) invalid(where, "a tensor has an empty name");
    if (!value.is_object()) invalid(where, ctx + " is not described by an object");
    SafetensorsEntry e;
    e.name = key;
    const auto dtype = value.find("dtype");
    if (dtype == value.end() || !dtype->is_string()) invalid(where, ctx + " has no string \"dtype\"");
    const std::optional<StorageDType> dt = parse_safetensors_dtype(dtype->get_ref<const std::string&>());
    if (!dt) invalid(where, ctx + " has unsupported dtype " + shown(dtype->get_ref<const std::string&>()));
    e.dtype = *dt;
    const auto shape = value.find("shape");
    if (shape == value.end() || !shape->is_array()) invalid(where, ctx + " has no \"shape\" array");
    for (const json& d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        invalid(where, ctx + " has a shape dimension that is not a non-negative integer");
      e.shape.push_back(d.get<int64_t>());
    }
    const auto offsets = value.find("data_offsets");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned())
      invalid(where, ctx + " has no \"data_offsets\" pair of non-negative integers");
    e.begin = (*offsets)[0].get<uint64_t>();
    e.end = (*offsets)[1].get<uint64_t>();
    if (e.end < e.begin) invalid(where, ctx + " has data_offsets that end before they begin");
    if (e.end > h.data_bytes)
      invalid(where, ctx + " has data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                         ") beyond the " + std::to_string(h.data_bytes) + "-byte data section (truncated?)");
    bool ok;
    const uint64_t numel = checked_numel(e.shape, &ok);
    uint64_t bytes = 0;
    if (!ok || !checked_mul(numel, storage_dtype_size(e.dtype), &bytes))
      invalid(where, ctx + " has a shape whose size overflows");
    if (bytes != e.end - e.begin)
      invalid(where, ctx + " has shape and dtype needing " + std::to_string(bytes) + " bytes, but its data_offsets span " +
                         std::to_string(e.end - e.begin));
    h.tensors.push_back(std::move(e));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t next = 0;
  for (const SafetensorsEntry& e : h.tensors) {
    if (e.begin < next) invalid(where, "tensor " + shown(e.name) + " overlaps another tensor's data");
    if (e.begin > next)
      invalid(where, "bytes [" + std::to_string(next) + ", " + std::to_string(e.begin) +
                         ") of the data section belong to no tensor");
    next = e.end;
  }
  if (next != h.data_bytes)
    invalid(where, "bytes [" + std::to_string(next) + ", " + std::to_string(h.data_bytes) +
                       ") of the data section belong to no tensor");
  return h;
}

// ---- writer ----------------------------------------------------------------------------------

struct SafetensorsWriter::State {
  std::string path;
  std::unique_ptr<AtomicFile> file;
  uint64_t data_bytes = 0;
  uint64_t written = 0;
  bool committed = false;
};

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Spec> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : s_(std::make_unique<State>()) {
  ZT_REQUIRE(!path.empty(), "the safetensors output path is empty");
  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Spec& t : tensors) {
    ZT_REQUIRE(!t.name.empty() && t.name != kMetadataKey, "safetensors tensor name ", shown(t.name), " is not allowed");
    ZT_REQUIRE(names.insert(t.name).second, "safetensors tensor ", shown(t.name), " is given twice");
    bool ok;
    const uint64_t numel = checked_numel(t.shape, &ok);
    uint64_t bytes = 0, end = 0;
    ZT_REQUIRE(ok && checked_mul(numel, storage_dtype_size(t.dtype), &bytes) && checked_add(offset, bytes, &end),
               "safetensors tensor ", shown(t.name), " has a negative or overflowing shape");
    header[t.name] = json{{"dtype", safetensors_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  s_->data_bytes = offset;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  ZT_REQUIRE(text.size() <= kSafetensorsMaxHeaderBytes, path, ": the safetensors header would exceed 100 MB");

  s_->path = path;
  ZT_REQUIRE(path.back() != '/', path, ": the safetensors output path names a directory, not a file");
  s_->file = std::make_unique<AtomicFile>(path, "safetensors file");
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  s_->file->write(len, 8);
  s_->file->write(text);
}

// The AtomicFile removes its temporary file when destroyed uncommitted.
SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const void* data, uint64_t bytes) {
  ZT_REQUIRE(!s_->committed, s_->path, ": the safetensors file is already committed");
  uint64_t total;
  ZT_REQUIRE(checked_add(s_->written, bytes, &total) && total <= s_->data_bytes, s_->path,
             ": more tensor data written than the declared tensors hold (", s_->data_bytes, " bytes)");
  if (bytes == 0) return;
  s_->file->write(data, bytes);
  s_->written = total;
}

void SafetensorsWriter::commit() {
  ZT_REQUIRE(!s_->committed, s_->path, ": the safetensors file is already committed");
  ZT_REQUIRE(s_->written == s_->data_bytes, s_->path, ": ", s_->written, " bytes of tensor data were written, but the "
             "declared tensors hold ", s_->data_bytes);
  s_->file->commit();
  s_->committed = true;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Spec> specs;
  for (const SafetensorsTensor& t : tensors) {
    bool ok;
    const uint64_t numel = checked_numel(t.shape, &ok);
    uint64_t bytes = 0;
    ZT_REQUIRE(ok && checked_mul(numel, storage_dtype_size(t.dtype), &bytes) && bytes == t.bytes,
               "safetensors tensor ", shown(t.name), ": ", t.bytes, " bytes given, but its shape and dtype need ", bytes);
    ZT_REQUIRE(t.data != nullptr || t.bytes == 0, "safetensors tensor ", shown(t.name), ": null data");
    specs.push_back(SafetensorsWriter::Spec{t.name, t.dtype, t.shape});
  }
  SafetensorsWriter w(path, std::move(specs), metadata);
  for (const SafetensorsTensor& t : tensors) w.write(t.data, t.bytes);
  w.commit();
}

// ---- reader ----------------------------------------------------------------------------------

struct SafetensorsFile::State {
  InputFile file;
  SafetensorsHeader header;
};

SafetensorsFile::SafetensorsFile(std::unique_ptr<State> s) : s_(std::move(s)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  InputFile file = InputFile::open(path, "safetensors file");
  const uint64_t size = file.size();
  std::vector<uint8_t> prefix(std::min<uint64_t>(size, 8));
  file.read_at(0, prefix.data(), prefix.size());
  const uint64_t n = header_length(prefix, size, path);
  prefix.resize(8 + n);
  file.read_at(8, prefix.data() + 8, n);
  SafetensorsHeader header = parse_safetensors_header(prefix, size, path);
  return SafetensorsFile(std::make_unique<State>(State{std::move(file), std::move(header)}));
}

const std::string& SafetensorsFile::path() const { return s_->file.path(); }
const SafetensorsHeader& SafetensorsFile::header() const { return s_->header; }

const SafetensorsEntry& SafetensorsFile::at(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  ZT_REQUIRE(e != nullptr, path(), ": the safetensors file has no tensor ", shown(name));
  return *e;
}

void SafetensorsFile::read(const SafetensorsEntry& tensor, uint64_t offset, uint64_t bytes, void* out) const {
  uint64_t end;
  ZT_REQUIRE(checked_add(offset, bytes, &end) && end <= tensor.bytes(), path(), ": tensor ", shown(tensor.name),
             " has ", tensor.bytes(), " bytes; cannot read [", offset, ", +", bytes, ")");
  s_->file.read_at(s_->header.data_offset + tensor.begin + offset, out, bytes);
}

std::vector<uint8_t> SafetensorsFile::read(std::string_view name) const {
  const SafetensorsEntry& e = at(name);
  std::vector<uint8_t> out(e.bytes());
  read(e, 0, out.size(), out.data());
  return out;
}

}  // namespace zt
