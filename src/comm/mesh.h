// Device mesh: lays a communicator's ranks out on named axes (data, tensor, pipeline) and answers
// "which ranks form my tensor / data / pipeline group". The only place where rank arithmetic for
// 3D parallelism lives; callers pass the groups to Communicator::group().
//
// Design note:
//  - Order of the axes, as in Megatron-LM and torchtitan: tensor varies fastest, then data, then
//    pipeline:  position = tensor + T * (data + D * pipeline).  Tensor-parallel peers exchange the
//    most bytes (activations in every layer, on the critical path), so they are adjacent ranks,
//    which on a workstation are usually the GPUs sharing a switch or an NVLink bridge; data groups
//    stride by T and talk once per step (gradients, overlapped with backward); pipeline stages are
//    the outermost blocks and only pass activations to their neighbour stage.
//  - Any axis may be 1; the product of the axes must equal the number of ranks. Shapes are named
//    fields (MeshShape{.data = 2, .tensor = 2}), never positional, so the order above cannot be
//    confused with the order of arguments.
//  - A mesh maps positions to communicator ranks: 0..size-1 by default, or an explicit list for a
//    sub-mesh (a sweep trial on part of the devices), in which case groups name those ranks.
//  - The group of rank r along axis A: the ranks whose other coordinates equal r's, ordered by
//    their coordinate on A. So r's position in its group is its coordinate on A — the index that
//    shards (data), splits (tensor) and stages (pipeline) are numbered by — and the same call on
//    every member gives the same ordered list (which Communicator::group needs to share state).
//  - Pure arithmetic on values: no devices, so planners and tests use it without a runtime.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zt {

enum class MeshAxis : uint8_t { kData, kTensor, kPipeline };
const char* mesh_axis_name(MeshAxis axis);  // "data", "tensor", "pipeline"

struct MeshShape {
  int data = 1;
  int tensor = 1;
  int pipeline = 1;
};

struct MeshCoord {
  int data = 0;
  int tensor = 0;
  int pipeline = 0;
  bool operator==(const MeshCoord&) const = default;
};

class Mesh {
 public:
  // Ranks 0..devices-1. A shape whose axes are not all >= 1, or whose product differs from the
  // number of ranks, is refused with one sentence (zt::Error, kInvalidArgument).
  Mesh(MeshShape shape, int devices);
  // Position p of the mesh is communicator rank ranks[p] (distinct, non-negative).
  Mesh(MeshShape shape, std::vector<int> ranks);

  const MeshShape& shape() const { return shape_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int size(MeshAxis axis) const;
  // Communicator ranks in position order.
  const std::vector<int>& ranks() const { return ranks_; }
  bool contains(int rank) const { return position_of(rank) >= 0; }

  MeshCoord coord(int rank) const;     // rank must be in the mesh
  int rank_at(MeshCoord coord) const;  // every coordinate within its axis
  // rank's coordinate on `axis` = its position in group(axis, rank).
  int index(MeshAxis axis, int rank) const;

  // Members of rank's group along `axis`, ordered by their coordinate on it.
  std::vector<int> group(MeshAxis axis, int rank) const;
  std::vector<int> tensor_group(int rank) const { return group(MeshAxis::kTensor, rank); }
  std::vector<int> data_group(int rank) const { return group(MeshAxis::kData, rank); }
  std::vector<int> pipeline_group(int rank) const { return group(MeshAxis::kPipeline, rank); }
  // Every group along `axis` (size()/size(axis) of them, disjoint, covering the mesh), ordered by
  // their first member's position.
  std::vector<std::vector<int>> groups(MeshAxis axis) const;

  // The rank of the next / previous pipeline stage with the same data and tensor coordinates;
  // -1 past the last / before the first stage.
  int pipeline_next(int rank) const;
  int pipeline_prev(int rank) const;

  // "2 data x 2 tensor x 1 pipeline (4 ranks)"
  std::string describe() const;

 private:
  int position_of(int rank) const;  // -1 when not in the mesh
  int checked_position(int rank, const char* op) const;
  MeshCoord coord_of_position(int p) const;
  int position_of_coord(const MeshCoord& c) const;

  MeshShape shape_;
  std::vector<int> ranks_;
  std::vector<int> position_by_rank_;  // indexed by rank, -1 when absent
};

}  // namespace zt
