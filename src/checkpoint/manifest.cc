// Manifest text <-> Manifest, with every structural rule checked (see manifest.h).
#include "checkpoint/manifest.h"

#include <algorithm>
#include <limits>
#include <map>

#include "checkpoint/file_io.h"
#include "core/status.h"

namespace zt {
namespace {

using nlohmann::json;

// The exact start of a version-1 manifest: the checksum's 16 hex digits follow, and they cover
// every byte after themselves.
constexpr std::string_view kPrefixV1 = R"({"format":"zerotrain-checkpoint","version":1,"xxh64":")";

[[noreturn]] void corrupt(const std::string& where, const std::string& what) {
  ZT_THROW(ErrorKind::kInvalidArgument, where, ": ", what, "; the checkpoint is corrupt");
}

const json& member(const json& obj, const char* key, const std::string& where, const std::string& ctx) {
  const auto it = obj.find(key);
  if (it == obj.end()) corrupt(where, ctx + " has no \"" + key + "\" field");
  return *it;
}

uint64_t get_u64(const json& obj, const char* key, const std::string& where, const std::string& ctx) {
  const json& v = member(obj, key, where, ctx);
  if (!v.is_number_unsigned()) corrupt(where, ctx + ": \"" + key + "\" is not a non-negative integer");
  return v.get<uint64_t>();
}

const std::string& get_string(const json& obj, const char* key, const std::string& where,
                              const std::string& ctx) {
  const json& v = member(obj, key, where, ctx);
  if (!v.is_string()) corrupt(where, ctx + ": \"" + key + "\" is not a string");
  return v.get_ref<const std::string&>();
}

uint64_t get_hash(const json& obj, const std::string& where, const std::string& ctx) {
  const std::optional<uint64_t> h = parse_hex64(get_string(obj, "xxh64", where, ctx));
  if (!h) corrupt(where, ctx + ": \"xxh64\" is not 16 lower-case hex digits");
  return *h;
}

std::string shown(const std::string& s) {
  // Names come from the file: bound and sanitise what goes into a message.
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 200; ++i) {
    const auto u = static_cast<unsigned char>(s[i]);
    out += (u < 0x20 || u == 0x7f) ? '?' : s[i];
  }
  if (s.size() > 200) out += "...";
  return out + "'";
}

json range_json(const Manifest& m, const ManifestRange& r) {
  return json{{"file", m.files[r.file].name}, {"begin", r.begin}, {"count", r.count},
              {"offset", r.offset}, {"bytes", r.bytes}, {"xxh64", hex64(r.xxh64)}};
}

}  // namespace

void validate_manifest(Manifest& m, const std::string& where) {
  if (m.step < 0) corrupt(where, "the step is negative");
  if (!m.meta.is_object()) corrupt(where, "\"meta\" is not a JSON object");
  if (m.files.empty()) corrupt(where, "the manifest lists no files");
  if (m.files.size() > (uint64_t{1} << 20)) corrupt(where, "the manifest lists more than 2^20 files");
  std::map<std::string_view, size_t> file_index;
  for (size_t f = 0; f < m.files.size(); ++f) {
    const ManifestFile& file = m.files[f];
    if (!is_plain_file_name(file.name))
      corrupt(where, "file name " + shown(file.name) +
                         " is not a plain name inside the checkpoint directory (no '/', no '..', "
                         "not absolute, not hidden)");
    if (!file_index.emplace(file.name, f).second) corrupt(where, "file " + shown(file.name) + " is listed twice");
    if (file.size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      corrupt(where, "file " + shown(file.name) + " has an impossible size");
  }

  // Per file: (offset, bytes) of every range stored in it, to check they tile the file.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> extents(m.files.size());
  std::map<std::string_view, size_t> array_index;
  for (ManifestArray& a : m.arrays) {
    const std::string ctx = "array " + shown(a.name);
    if (a.name.empty()) corrupt(where, "an array has an empty name");
    if (a.name.size() > 4096) corrupt(where, "an array name is longer than 4096 bytes");
    if (!array_index.emplace(a.name, 0).second) corrupt(where, ctx + " is listed twice");
    const uint64_t elem = storage_dtype_size(a.dtype);
    uint64_t total_bytes;
    if (!checked_mul(a.numel, elem, &total_bytes) || total_bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      corrupt(where, ctx + ": numel " + std::to_string(a.numel) + " is too large");
    if (!a.shape.empty()) {
      uint64_t product = 1;
      for (const int64_t d : a.shape) {
        if (d < 0 || !checked_mul(product, static_cast<uint64_t>(d), &product))
          corrupt(where, ctx + ": the shape has a negative or overflowing dimension");
      }
      if (product != a.numel)
        corrupt(where, ctx + ": the shape's product " + std::to_string(product) + " is not numel " +
                           std::to_string(a.numel));
    }
    std::sort(a.ranges.begin(), a.ranges.end(),
              [](const ManifestRange& x, const ManifestRange& y) { return x.begin < y.begin; });
    uint64_t next = 0;  // the first element not yet covered
    for (const ManifestRange& r : a.ranges) {
      const std::string rctx = ctx + " range [" + std::to_string(r.begin) + ", +" + std::to_string(r.count) + ")";
      if (r.file >= m.files.size()) corrupt(where, rctx + " refers to no listed file");
      if (r.count == 0) corrupt(where, rctx + " is empty");
      if (r.begin > next) corrupt(where, ctx + ": elements [" + std::to_string(next) + ", " + std::to_string(r.begin) + ") are stored in no range (a gap)");
      if (r.begin < next) corrupt(where, rctx + " overlaps the previous range");
      uint64_t end;
      if (!checked_add(r.begin, r.count, &end) || end > a.numel)
        corrupt(where, rctx + " goes past the array's " + std::to_string(a.numel) + " elements");
      uint64_t bytes;
      if (!checked_mul(r.count, elem, &bytes) || bytes != r.bytes)
        corrupt(where, rctx + ": " + std::to_string(r.bytes) + " bytes do not hold " + std::to_string(r.count) +
                           " elements of " + storage_dtype_name(a.dtype));
      uint64_t file_end;
      const ManifestFile& file = m.files[r.file];
      if (!checked_add(r.offset, r.bytes, &file_end) || file_end > file.size)
        corrupt(where, rctx + " lies beyond the end of " + shown(file.name) + " (" + std::to_string(file.size) + " bytes)");
      extents[r.file].emplace_back(r.offset, r.bytes);
      next = end;
    }
    if (next != a.numel)
      corrupt(where, ctx + ": elements [" + std::to_string(next) + ", " + std::to_string(a.numel) + ") are stored in no range (a gap)");
  }

  for (size_t f = 0; f < m.files.size(); ++f) {
    std::vector<std::pair<uint64_t, uint64_t>>& ext = extents[f];
    std::sort(ext.begin(), ext.end());
    uint64_t next = 0;
    for (const auto& [offset, bytes] : ext) {
      if (offset != next)
        corrupt(where, "bytes " + std::to_string(std::min(offset, next)) + ".. of " + shown(m.files[f].name) +
                           (offset > next ? " belong to no range" : " belong to two ranges"));
      next = offset + bytes;  // cannot overflow: offset + bytes <= size was checked
    }
    if (next != m.files[f].size)
      corrupt(where, "bytes " + std::to_string(next) + ".. of " + shown(m.files[f].name) + " belong to no range");
  }
}

std::string serialize_manifest(Manifest m) {
  validate_manifest(m, "checkpoint manifest being written");
  json files = json::array();
  for (const ManifestFile& f : m.files)
    files.push_back(json{{"name", f.name}, {"size", f.size}, {"xxh64", hex64(f.xxh64)}});
  std::string body;
  body += "\",\n\"step\":" + std::to_string(m.step);
  body += ",\n\"meta\":" + m.meta.dump(1);
  body += ",\n\"files\":[\n";
  for (size_t i = 0; i < files.size(); ++i) body += (i ? ",\n" : "") + files[i].dump();
  body += "\n],\n\"arrays\":[\n";
  for (size_t i = 0; i < m.arrays.size(); ++i) {
    const ManifestArray& a = m.arrays[i];
    json ranges = json::array();
    for (const ManifestRange& r : a.ranges) ranges.push_back(range_json(m, r));
    json aj = {{"name", a.name}, {"dtype", storage_dtype_name(a.dtype)}, {"numel", a.numel},
               {"shape", a.shape}, {"ranges", std::move(ranges)}};
    body += (i ? ",\n" : "") + aj.dump();
  }
  body += "\n]}\n";
  return std::string(kPrefixV1) + hex64(xxh64(body.data(), body.size())) + body;
}

namespace {

// The manifest's JSON object. Nesting is bounded so that nothing downstream (printing meta,
// destroying it) recurses deeply; containers below the limit are not even built.
json parse_manifest_json(std::string_view text, const std::string& where) {
  if (text.size() > kMaxManifestBytes)
    corrupt(where, "the manifest is " + std::to_string(text.size()) + " bytes, more than the " +
                       std::to_string(kMaxManifestBytes) + " a manifest may have");
  bool too_deep = false;
  const json::parser_callback_t limit_depth = [&](int depth, json::parse_event_t, json&) {
    if (depth <= kMaxManifestJsonDepth) return true;
    too_deep = true;
    return false;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), limit_depth);
  } catch (const json::exception& e) {
    corrupt(where, std::string("the manifest is not valid JSON (truncated or damaged): ") + e.what());
  }
  if (too_deep)
    corrupt(where, "the manifest nests JSON deeper than " + std::to_string(kMaxManifestJsonDepth) + " levels");
  if (!root.is_object()) corrupt(where, "the manifest is not a JSON object");
  return root;
}

// The format name and version, and (verify_checksum) the checksum of the text after its prefix.
void check_manifest_header(const json& root, std::string_view text, const std::string& where, bool verify_checksum) {
  const auto format = root.find("format");
  if (format == root.end() || !format->is_string() || format->get_ref<const std::string&>() != kCheckpointFormat)
    corrupt(where, std::string("the manifest does not say \"format\": \"") + kCheckpointFormat +
                       "\", so it is not a ZeroTrain checkpoint manifest");
  const auto version = root.find("version");
  if (version == root.end() || !version->is_number_integer())
    corrupt(where, "the manifest has no integer format \"version\"");
  if (version->get<int64_t>() != kCheckpointFormatVersion)
    ZT_THROW(ErrorKind::kInvalidArgument, where, ": the checkpoint has format version ", version->dump(),
             ", but this ZeroTrain reads only version ", kCheckpointFormatVersion,
             "; load it with the ZeroTrain that wrote it (or a newer one)");
  if (!verify_checksum) return;
  const size_t p = kPrefixV1.size();
  const std::optional<uint64_t> stored =
      text.size() >= p + 16 && text.substr(0, p) == kPrefixV1 ? parse_hex64(text.substr(p, 16)) : std::nullopt;
  if (!stored) corrupt(where, "the manifest's own checksum is missing or malformed");
  const std::string_view body = text.substr(p + 16);
  const uint64_t actual = xxh64(body.data(), body.size());
  if (actual != *stored)
    corrupt(where, "checksum mismatch in the manifest itself (xxHash64 " + hex64(actual) + ", recorded " +
                       hex64(*stored) + ")");
}

// "files": their entries, and each name's index in `index`.
std::vector<ManifestFile> parse_manifest_files(const json& files, const std::string& where,
                                               std::map<std::string, uint32_t>& index) {
  if (!files.is_array()) corrupt(where, "\"files\" is not an array");
  std::vector<ManifestFile> out;
  for (const json& f : files) {
    if (!f.is_object()) corrupt(where, "an entry of \"files\" is not an object");
    ManifestFile file;
    file.name = get_string(f, "name", where, "a file entry");
    const std::string ctx = "file " + shown(file.name);
    file.size = get_u64(f, "size", where, ctx);
    file.xxh64 = get_hash(f, where, ctx);
    if (!index.emplace(file.name, static_cast<uint32_t>(out.size())).second) corrupt(where, ctx + " is listed twice");
    out.push_back(std::move(file));
    if (out.size() > (uint64_t{1} << 20)) corrupt(where, "the manifest lists more than 2^20 files");
  }
  return out;
}

// One range of array `ctx`; its file must be one "files" lists (`file_index`).
ManifestRange parse_manifest_range(const json& rj, const std::map<std::string, uint32_t>& file_index,
                                   const std::string& where, const std::string& ctx) {
  if (!rj.is_object()) corrupt(where, ctx + ": a range is not an object");
  ManifestRange r;
  const std::string& file = get_string(rj, "file", where, ctx + " range");
  const auto it = file_index.find(file);
  if (it == file_index.end()) {
    if (!is_plain_file_name(file))
      corrupt(where, ctx + ": range file name " + shown(file) +
                         " is not a plain name inside the checkpoint directory (no '/', no '..', "
                         "not absolute, not hidden)");
    corrupt(where, ctx + ": a range refers to file " + shown(file) + ", which \"files\" does not list");
  }
  r.file = it->second;
  r.begin = get_u64(rj, "begin", where, ctx + " range");
  r.count = get_u64(rj, "count", where, ctx + " range");
  r.offset = get_u64(rj, "offset", where, ctx + " range");
  r.bytes = get_u64(rj, "bytes", where, ctx + " range");
  r.xxh64 = get_hash(rj, where, ctx + " range");
  return r;
}

ManifestArray parse_manifest_array(const json& aj, const std::map<std::string, uint32_t>& file_index,
                                   const std::string& where) {
  if (!aj.is_object()) corrupt(where, "an entry of \"arrays\" is not an object");
  ManifestArray a;
  a.name = get_string(aj, "name", where, "an array entry");
  const std::string ctx = "array " + shown(a.name);
  const std::string& dtype = get_string(aj, "dtype", where, ctx);
  const std::optional<StorageDType> dt = parse_storage_dtype(dtype);
  if (!dt) corrupt(where, ctx + ": unknown dtype " + shown(dtype));
  a.dtype = *dt;
  a.numel = get_u64(aj, "numel", where, ctx);
  if (const auto shape = aj.find("shape"); shape != aj.end()) {
    if (!shape->is_array()) corrupt(where, ctx + ": \"shape\" is not an array");
    for (const json& d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        corrupt(where, ctx + ": a shape dimension is not a non-negative integer");
      a.shape.push_back(d.get<int64_t>());
    }
  }
  const json& ranges = member(aj, "ranges", where, ctx);
  if (!ranges.is_array()) corrupt(where, ctx + ": \"ranges\" is not an array");
  for (const json& rj : ranges) a.ranges.push_back(parse_manifest_range(rj, file_index, where, ctx));
  return a;
}

}  // namespace

Manifest parse_manifest(std::string_view text, const std::string& where, bool verify_checksum) {
  const json root = parse_manifest_json(text, where);
  check_manifest_header(root, text, where, verify_checksum);
  Manifest m;
  const json& step = member(root, "step", where, "the manifest");
  if (!step.is_number_integer() || step.get<int64_t>() < 0 ||
      (step.is_number_unsigned() && step.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
    corrupt(where, "\"step\" is not a non-negative integer");
  m.step = step.get<int64_t>();
  m.meta = member(root, "meta", where, "the manifest");
  std::map<std::string, uint32_t> file_index;
  m.files = parse_manifest_files(member(root, "files", where, "the manifest"), where, file_index);
  const json& arrays = member(root, "arrays", where, "the manifest");
  if (!arrays.is_array()) corrupt(where, "\"arrays\" is not an array");
  m.arrays.reserve(arrays.size());
  for (const json& aj : arrays) m.arrays.push_back(parse_manifest_array(aj, file_index, where));
  validate_manifest(m, where);
  return m;
}

}  // namespace zt
