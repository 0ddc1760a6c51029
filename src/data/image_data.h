// Image classification data: the ImageData interface, IDX files (MNIST / Fashion-MNIST, plain or
// gzip-compressed), and epoch-wise shuffling that is a pure function of (seed, epoch).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/language_data.h"

namespace zt {

// Batching contract: epoch e visits the split in the order of a permutation that depends only on
// (seed, split, e) (Fisher-Yates driven by Philox). Batch b of a global batch size G holds the
// examples at permutation positions [b*G, (b+1)*G); a device asks for its own rows
// [first, first + count) of it. The last partial batch of an epoch is dropped.
class ImageData {
 public:
  virtual ~ImageData() = default;

  virtual std::string describe() const = 0;
  virtual int num_classes() const = 0;
  virtual int image_size() const = 0;  // floats per image (784 for 28x28)
  virtual int64_t num_examples(Split split) const = 0;
  int64_t batches_per_epoch(Split split, int batch_size) const {
    return batch_size > 0 ? num_examples(split) / batch_size : 0;
  }
  // Rows [first, first + count) of batch `batch_index` of `epoch`: images [count, image_size()],
  // labels [count].
  virtual void batch(Split split, uint64_t epoch, int64_t batch_index, int batch_size, int first,
                     int count, float* images, int32_t* labels) const = 0;
  void batch(Split split, uint64_t epoch, int64_t batch_index, int batch_size, float* images,
             int32_t* labels) const {
    batch(split, epoch, batch_index, batch_size, 0, batch_size, images, labels);
  }
  // Examples [first, first + count) in file order (evaluation needs no shuffle).
  virtual void examples(Split split, int64_t first, int count, float* images, int32_t* labels) const = 0;
};

// One IDX file: dims and the raw unsigned-byte payload (only type 0x08 is used by these datasets).
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};
// Reads an IDX file (gzip-compressed or not: zlib reads both) and checks its magic against
// 0x0000080<ndim>, its dimensions, and that the payload is exactly the product of the dims.
IdxArray read_idx(const std::string& path, int expected_ndim);

enum class ImageNormalization {
  kUnitRange,    // x / 255
  kStandardize,  // (x / 255 - mean) / std, with mean and std of the training images
};

// Images and labels from IDX files: "<prefix>-images-idx3-ubyte[.gz]" and
// "<prefix>-labels-idx1-ubyte[.gz]" in `dir`, prefixes "train" and "t10k" (the test set serves as
// the validation split). Labels must lie in [0, num_classes).
class IdxImageData : public ImageData {
 public:
  IdxImageData(const std::string& dir, uint64_t seed,
               ImageNormalization norm = ImageNormalization::kStandardize, int num_classes = 10);

  std::string describe() const override;
  int num_classes() const override { return num_classes_; }
  int image_size() const override { return image_size_; }
  int64_t num_examples(Split split) const override {
    return static_cast<int64_t>(labels_[static_cast<int>(split)].size());
  }
  void batch(Split split, uint64_t epoch, int64_t batch_index, int batch_size, int first, int count,
             float* images, int32_t* labels) const override;
  using ImageData::batch;
  void examples(Split split, int64_t first, int count, float* images, int32_t* labels) const override;

  // The order epoch `epoch` visits the split in.
  std::vector<int32_t> permutation(Split split, uint64_t epoch) const;
  float mean() const { return mean_; }
  float stddev() const { return std_; }
  // Raw bytes of one image and its label (tests).
  const uint8_t* raw_image(Split split, int64_t i) const {
    return pixels_[static_cast<int>(split)].data() + static_cast<size_t>(i) * image_size_;
  }
  int32_t label(Split split, int64_t i) const { return labels_[static_cast<int>(split)][static_cast<size_t>(i)]; }

 private:
  void load_split(Split split, const std::string& prefix);
  void convert(Split split, int64_t example, float* out) const;
  std::shared_ptr<const std::vector<int32_t>> cached_permutation(Split split, uint64_t epoch) const;

  std::string dir_;
  uint64_t seed_;
  ImageNormalization norm_;
  int num_classes_;
  int image_size_ = 0;
  int64_t rows_ = 0, cols_ = 0;
  std::vector<uint8_t> pixels_[2];
  std::vector<int32_t> labels_[2];
  float mean_ = 0, std_ = 1;
  float lut_[256] = {};  // the float each byte becomes, rounded once from double

  // The last permutation of each split: batches of one epoch all reuse it.
  mutable std::mutex cache_mu_;
  mutable std::shared_ptr<const std::vector<int32_t>> cache_[2];
  mutable uint64_t cache_epoch_[2] = {0, 0};
};

// Where the Debian package dataset-fashion-mnist installs its files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// spec: "fashion-mnist" (the Debian package's files) or a directory holding the four IDX files.
std::unique_ptr<ImageData> open_image_data(const std::string& spec, uint64_t seed,
                                           ImageNormalization norm = ImageNormalization::kStandardize);

}  // namespace zt
