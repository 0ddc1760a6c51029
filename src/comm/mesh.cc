// Device mesh arithmetic (see the design note in mesh.h): positions <-> coordinates <-> ranks.
#include "comm/mesh.h"

#include <algorithm>

#include "core/status.h"

namespace zt {

const char* mesh_axis_name(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::kData:
      return "data";
    case MeshAxis::kTensor:
      return "tensor";
    case MeshAxis::kPipeline:
      return "pipeline";
  }
  return "?";
}

namespace {

std::vector<int> iota_ranks(int n) {
  ZT_REQUIRE(n >= 1, "mesh: ", n, " devices given; a mesh needs at least one device");
  std::vector<int> r(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) r[static_cast<size_t>(i)] = i;
  return r;
}

int axis_of(const MeshShape& s, MeshAxis a) {
  switch (a) {
    case MeshAxis::kData:
      return s.data;
    case MeshAxis::kTensor:
      return s.tensor;
    case MeshAxis::kPipeline:
      return s.pipeline;
  }
  return 0;
}

int& coord_on(MeshCoord& c, MeshAxis a) {
  switch (a) {
    case MeshAxis::kData:
      return c.data;
    case MeshAxis::kTensor:
      return c.tensor;
    case MeshAxis::kPipeline:
      break;
  }
  return c.pipeline;
}

std::string shape_text(const MeshShape& s) {
  return std::to_string(s.data) + " data x " + std::to_string(s.tensor) + " tensor x " +
         std::to_string(s.pipeline) + " pipeline";
}

}  // namespace

Mesh::Mesh(MeshShape shape, int devices) : Mesh(shape, iota_ranks(devices)) {}

Mesh::Mesh(MeshShape shape, std::vector<int> ranks) : shape_(shape), ranks_(std::move(ranks)) {
  for (MeshAxis a : {MeshAxis::kData, MeshAxis::kTensor, MeshAxis::kPipeline})
    ZT_REQUIRE(axis_of(shape_, a) >= 1, "mesh: the ", mesh_axis_name(a), " axis is ",
               axis_of(shape_, a), "; every axis needs at least 1 device (use 1 for an unused axis)");
  const int64_t product =
      int64_t{shape_.data} * int64_t{shape_.tensor} * int64_t{shape_.pipeline};
  ZT_REQUIRE(product == static_cast<int64_t>(ranks_.size()), "mesh: ", shape_text(shape_), " needs ",
             product, " devices but ", ranks_.size(),
             " are given; the product of the axes must equal the device count");
  int max_rank = -1;
  for (int r : ranks_) {
    ZT_REQUIRE(r >= 0, "mesh: rank ", r, " is negative; ranks are communicator ranks (0, 1, ...)");
    max_rank = std::max(max_rank, r);
  }
  position_by_rank_.assign(static_cast<size_t>(max_rank + 1), -1);
  for (size_t p = 0; p < ranks_.size(); ++p) {
    int& slot = position_by_rank_[static_cast<size_t>(ranks_[p])];
    ZT_REQUIRE(slot < 0, "mesh: rank ", ranks_[p], " is given twice; every position needs its own rank");
    slot = static_cast<int>(p);
  }
}

int Mesh::size(MeshAxis axis) const { return axis_of(shape_, axis); }

int Mesh::position_of(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(position_by_rank_.size())) return -1;
  return position_by_rank_[static_cast<size_t>(rank)];
}

int Mesh::checked_position(int rank, const char* op) const {
  const int p = position_of(rank);
  ZT_REQUIRE(p >= 0, "mesh ", op, ": rank ", rank, " is not in the mesh ", describe());
  return p;
}

// position = tensor + T * (data + D * pipeline)
MeshCoord Mesh::coord_of_position(int p) const {
  MeshCoord c;
  c.tensor = p % shape_.tensor;
  p /= shape_.tensor;
  c.data = p % shape_.data;
  c.pipeline = p / shape_.data;
  return c;
}

int Mesh::position_of_coord(const MeshCoord& c) const {
  return c.tensor + shape_.tensor * (c.data + shape_.data * c.pipeline);
}

MeshCoord Mesh::coord(int rank) const { return coord_of_position(checked_position(rank, "coord")); }

int Mesh::rank_at(MeshCoord c) const {
  for (MeshAxis a : {MeshAxis::kData, MeshAxis::kTensor, MeshAxis::kPipeline}) {
    const int v = coord_on(c, a);
    ZT_REQUIRE(v >= 0 && v < size(a), "mesh rank_at: ", mesh_axis_name(a), " coordinate ", v,
               " is outside 0..", size(a) - 1, " of ", describe());
  }
  return ranks_[static_cast<size_t>(position_of_coord(c))];
}

int Mesh::index(MeshAxis axis, int rank) const {
  MeshCoord c = coord_of_position(checked_position(rank, "index"));
  return coord_on(c, axis);
}

std::vector<int> Mesh::group(MeshAxis axis, int rank) const {
  MeshCoord c = coord_of_position(checked_position(rank, "group"));
  std::vector<int> out;
  out.reserve(static_cast<size_t>(size(axis)));
  for (int i = 0; i < size(axis); ++i) {
    coord_on(c, axis) = i;
    out.push_back(ranks_[static_cast<size_t>(position_of_coord(c))]);
  }
  return out;
}

std::vector<std::vector<int>> Mesh::groups(MeshAxis axis) const {
  std::vector<std::vector<int>> out;
  for (int p = 0; p < size(); ++p) {
    MeshCoord c = coord_of_position(p);
    if (coord_on(c, axis) == 0) out.push_back(group(axis, ranks_[static_cast<size_t>(p)]));
  }
  return out;
}

int Mesh::pipeline_next(int rank) const {
  MeshCoord c = coord_of_position(checked_position(rank, "pipeline_next"));
  if (c.pipeline + 1 >= shape_.pipeline) return -1;
  ++c.pipeline;
  return ranks_[static_cast<size_t>(position_of_coord(c))];
}

int Mesh::pipeline_prev(int rank) const {
  MeshCoord c = coord_of_position(checked_position(rank, "pipeline_prev"));
  if (c.pipeline == 0) return -1;
  --c.pipeline;
  return ranks_[static_cast<size_t>(position_of_coord(c))];
}

std::string Mesh::describe() const {
  return shape_text(shape_) + " (" + std::to_string(size()) + " ranks)";
}

}  // namespace zt
