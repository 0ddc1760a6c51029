// IDX parsing and validation, Fashion-MNIST loading, and the Philox-driven epoch shuffle.
#include "data/image_data.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include <sys/stat.h>
#include <zlib.h>

#include "core/philox.h"
#include "core/files.h"
#include "core/status.h"

namespace zt {

namespace {

constexpr uint64_t kShuffleStream[2] = {fnv1a("zt/data/images/shuffle/train"),
                                        fnv1a("zt/data/images/shuffle/validation")};
constexpr uint8_t kIdxUnsignedByte = 0x08;
constexpr int64_t kMaxIdxBytes = int64_t{1} << 40;  // guards the product of dims against overflow

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool dir_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The whole (decompressed) content; files that are not gzip pass through unchanged. The file is
// opened through InputFile (a FIFO or device is refused before zlib reads a byte) and inflated
// from memory, so reads are bounded by its size at open.
std::vector<uint8_t> read_maybe_gzip(const std::string& path) {
  std::vector<uint8_t> raw = InputFile::open(path, "IDX file").read_all(kMaxIdxBytes);
  if (raw.size() < 2 || raw[0] != 0x1f || raw[1] != 0x8b) return raw;
  z_stream zs{};
  ZT_CHECK(::inflateInit2(&zs, 15 + 32) == Z_OK, "zlib inflateInit2 failed");  // +32: gzip header
  std::vector<uint8_t> out;
  std::vector<uint8_t> chunk(1 << 20);
  size_t pos = 0;  // the next raw byte not yet handed to zlib
  int rc = Z_OK;
  for (;;) {
    if (zs.avail_in == 0 && pos < raw.size()) {
      const size_t n = std::min<size_t>(raw.size() - pos, size_t{1} << 30);
      zs.next_in = raw.data() + pos;
      zs.avail_in = static_cast<uInt>(n);
      pos += n;
    }
    zs.next_out = chunk.data();
    zs.avail_out = static_cast<uInt>(chunk.size());
    rc = ::inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR) {
      const std::string what = zs.msg ? zs.msg : "zlib error " + std::to_string(rc);
      ::inflateEnd(&zs);
      ZT_THROW(ErrorKind::kInvalidArgument, path, ": the gzip data is corrupt (", what, ")");
    }
    out.insert(out.end(), chunk.begin(), chunk.end() - zs.avail_out);
    if (out.size() > static_cast<uint64_t>(kMaxIdxBytes)) {
      ::inflateEnd(&zs);
      ZT_THROW(ErrorKind::kInvalidArgument, path, ": the gzip data inflates to more than 2^40 bytes");
    }
    if (rc == Z_STREAM_END) {
      // Another gzip member may follow (gzip(1) concatenates them); anything else is ignored.
      const size_t next = pos - zs.avail_in;
      if (next + 1 < raw.size() && raw[next] == 0x1f && raw[next + 1] == 0x8b) {
        ::inflateReset(&zs);
        continue;
      }
      break;
    }
    if (rc == Z_BUF_ERROR && zs.avail_in == 0 && pos == raw.size()) break;  // input ran out mid-stream
  }
  ::inflateEnd(&zs);
  if (rc != Z_STREAM_END)
    ZT_THROW(ErrorKind::kInvalidArgument, path, ": the gzip data ends early (truncated download?)");
  return out;
}

std::string find_idx(const std::string& dir, const std::string& name) {
  for (const std::string& candidate : {dir + "/" + name, dir + "/" + name + ".gz"})
    if (file_exists(candidate)) return candidate;
  ZT_THROW(ErrorKind::kInvalidArgument, dir, ": neither ", name, " nor ", name,
           ".gz is in this directory; it must hold the four IDX files of the dataset");
}

}  // namespace

IdxArray read_idx(const std::string& path, int expected_ndim) {
  std::vector<uint8_t> bytes = read_maybe_gzip(path);
  const uint32_t expected_magic = (uint32_t{kIdxUnsignedByte} << 8) | static_cast<uint32_t>(expected_ndim);
  char want[16];
  std::snprintf(want, sizeof(want), "0x%08x", expected_magic);
  ZT_REQUIRE(bytes.size() >= 4, path, ": the file is ", bytes.size(),
             " bytes, too short for an IDX header (expected magic ", want, ")");
  const uint32_t magic = (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) | bytes[3];
  char got[16];
  std::snprintf(got, sizeof(got), "0x%08x", magic);
  ZT_REQUIRE(magic == expected_magic, path, ": the magic number is ", got, ", not ", want,
             " (an IDX unsigned-byte array with ", expected_ndim, " dimension",
             expected_ndim == 1 ? "" : "s", "); is this the right file?");
  const size_t header = 4 + 4 * static_cast<size_t>(expected_ndim);
  ZT_REQUIRE(bytes.size() >= header, path, ": the file is ", bytes.size(), " bytes, too short for the ",
             header, "-byte IDX header (truncated)");
  IdxArray a;
  int64_t payload = 1;
  for (int d = 0; d < expected_ndim; ++d) {
    const uint8_t* p = bytes.data() + 4 + 4 * d;
    const int64_t dim = static_cast<int32_t>((uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3]);
    ZT_REQUIRE(dim >= 0 && (d == 0 || dim > 0), path, ": dimension ", d, " of the IDX header is ", dim,
               ", which is not a valid size");
    payload *= dim;
    ZT_REQUIRE(payload <= kMaxIdxBytes, path, ": the IDX header's dimensions describe more than 2^40 bytes");
    a.dims.push_back(dim);
  }
  const auto have = static_cast<int64_t>(bytes.size() - header);
  if (have != payload) {
    std::string dims;
    for (size_t d = 0; d < a.dims.size(); ++d) dims += (d ? " x " : "") + std::to_string(a.dims[d]);
    ZT_THROW(ErrorKind::kInvalidArgument, path, ": the IDX header declares ", dims, " = ", payload,
             " bytes of data, but the file holds ", have, " (", have < payload ? "truncated" : "trailing data", ")");
  }
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(header));
  a.data = std::move(bytes);
  return a;
}

IdxImageData::IdxImageData(const std::string& dir, uint64_t seed, ImageNormalization norm, int num_classes)
    : dir_(dir), seed_(seed), norm_(norm), num_classes_(num_classes) {
  ZT_REQUIRE(num_classes > 0, "the number of classes must be positive (got ", num_classes, ")");
  ZT_REQUIRE(dir_exists(dir), dir, ": no such directory; pass a directory holding the IDX files");
  load_split(Split::kTrain, "train");
  load_split(Split::kValidation, "t10k");
  const std::vector<uint8_t>& px = pixels_[0];
  ZT_REQUIRE(!px.empty(), dir, ": the training images file holds no images");
  // Statistics of the training images, in double, on the x/255 scale.
  uint64_t sum = 0, sum_sq = 0;
  for (uint8_t v : px) {
    sum += v;
    sum_sq += uint64_t{v} * v;
  }
  const double n = static_cast<double>(px.size());
  const double mean = static_cast<double>(sum) / n / 255.0;
  const double var = static_cast<double>(sum_sq) / n / (255.0 * 255.0) - mean * mean;
  const double sd = std::sqrt(std::max(var, 1e-12));
  mean_ = static_cast<float>(mean);
  std_ = static_cast<float>(sd);
  for (int v = 0; v < 256; ++v) {
    const double unit = v / 255.0;
    lut_[v] = static_cast<float>(norm == ImageNormalization::kStandardize ? (unit - mean) / sd : unit);
  }
}

void IdxImageData::load_split(Split split, const std::string& prefix) {
  const std::string image_path = find_idx(dir_, prefix + "-images-idx3-ubyte");
  const std::string label_path = find_idx(dir_, prefix + "-labels-idx1-ubyte");
  IdxArray images = read_idx(image_path, 3);
  IdxArray labels = read_idx(label_path, 1);
  if (split == Split::kTrain) {
    rows_ = images.dims[1];
    cols_ = images.dims[2];
    image_size_ = static_cast<int>(rows_ * cols_);
  } else {
    ZT_REQUIRE(images.dims[1] == rows_ && images.dims[2] == cols_, image_path, ": the images are ",
               images.dims[1], " x ", images.dims[2], " but the training images are ", rows_, " x ", cols_);
  }
  ZT_REQUIRE(labels.dims[0] == images.dims[0], label_path, ": the file holds ", labels.dims[0],
             " labels but ", image_path, " holds ", images.dims[0],
             " images; the two files must describe the same examples");
  const int s = static_cast<int>(split);
  labels_[s].resize(labels.data.size());
  for (size_t i = 0; i < labels.data.size(); ++i) {
    ZT_REQUIRE(labels.data[i] < num_classes_, label_path, ": label ", int{labels.data[i]}, " at position ",
               i, " is out of range for ", num_classes_, " classes");
    labels_[s][i] = labels.data[i];
  }
  pixels_[s] = std::move(images.data);
}

std::string IdxImageData::describe() const {
  return "IDX images " + dir_ + " (" + std::to_string(num_examples(Split::kTrain)) + " train / " +
         std::to_string(num_examples(Split::kValidation)) + " test, " + std::to_string(rows_) + "x" +
         std::to_string(cols_) + ", " + std::to_string(num_classes_) + " classes, " +
         (norm_ == ImageNormalization::kStandardize ? "standardised" : "scaled to [0, 1]") + ")";
}

void IdxImageData::convert(Split split, int64_t example, float* out) const {
  const uint8_t* px = raw_image(split, example);
  for (int p = 0; p < image_size_; ++p) out[p] = lut_[px[p]];
}

std::vector<int32_t> IdxImageData::permutation(Split split, uint64_t epoch) const {
  ZT_REQUIRE(epoch < (uint64_t{1} << 32), "epoch ", epoch, " is beyond the shuffle's range of 2^32 epochs");
  const int64_t n = num_examples(split);
  std::vector<int32_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  // Fisher-Yates from the top; the swap partner of position i is Philox block (epoch, i).
  for (int64_t i = n - 1; i > 0; --i) {
    const Philox4x32 r = philox_block(seed_, kShuffleStream[static_cast<int>(split)],
                                      (epoch << 32) | static_cast<uint64_t>(i));
    const uint64_t x = (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
    const auto j = static_cast<int64_t>(x % static_cast<uint64_t>(i + 1));
    std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
  }
  return perm;
}

std::shared_ptr<const std::vector<int32_t>> IdxImageData::cached_permutation(Split split, uint64_t epoch) const {
  const int s = static_cast<int>(split);
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (!cache_[s] || cache_epoch_[s] != epoch) {
    cache_[s] = std::make_shared<const std::vector<int32_t>>(permutation(split, epoch));
    cache_epoch_[s] = epoch;
  }
  return cache_[s];
}

void IdxImageData::batch(Split split, uint64_t epoch, int64_t batch_index, int batch_size, int first,
                         int count, float* images, int32_t* labels) const {
  ZT_REQUIRE(batch_size > 0, "the batch size must be positive (got ", batch_size, ")");
  ZT_REQUIRE(first >= 0 && count >= 0 && first + count <= batch_size, "rows [", first, ", ", first + count,
             ") are not inside a batch of ", batch_size);
  const int64_t batches = batches_per_epoch(split, batch_size);
  ZT_REQUIRE(batch_index >= 0 && batch_index < batches, "batch ", batch_index, " does not exist: the ",
             split_name(split), " split of ", dir_, " has ", batches, " full batches of ", batch_size);
  const auto perm = cached_permutation(split, epoch);
  const int64_t base = batch_index * batch_size + first;
  for (int r = 0; r < count; ++r) {
    const int32_t example = (*perm)[static_cast<size_t>(base + r)];
    convert(split, example, images + static_cast<size_t>(r) * image_size_);
    labels[r] = label(split, example);
  }
}

void IdxImageData::examples(Split split, int64_t first, int count, float* images, int32_t* labels) const {
  ZT_REQUIRE(first >= 0 && count >= 0 && first + count <= num_examples(split), "examples [", first, ", ",
             first + count, ") are outside the ", split_name(split), " split of ", dir_, " (",
             num_examples(split), " examples)");
  for (int r = 0; r < count; ++r) {
    convert(split, first + r, images + static_cast<size_t>(r) * image_size_);
    labels[r] = label(split, first + r);
  }
}

std::unique_ptr<ImageData> open_image_data(const std::string& spec, uint64_t seed, ImageNormalization norm) {
  if (spec == "fashion-mnist") {
    ZT_REQUIRE(dir_exists(kFashionMnistDir), "fashion-mnist: ", kFashionMnistDir,
               " does not exist; install the Debian package dataset-fashion-mnist "
               "(apt-get install dataset-fashion-mnist, or run scripts/setup) or pass a directory "
               "holding the IDX files");
    return std::make_unique<IdxImageData>(kFashionMnistDir, seed, norm);
  }
  return std::make_unique<IdxImageData>(spec, seed, norm);
}

}  // namespace zt
