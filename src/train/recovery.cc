// Which devices survive a failure (see recovery.h).
#include "train/recovery.h"

namespace zt {

std::optional<Survivors> surviving_devices(World& world, const DeviceSpec& current) {
  const int N = world.size();
  const bool cuda = world.runtime().backend() == Backend::kCuda;
  Survivors s;
  s.spec.kind = cuda ? DeviceSpec::Kind::kCuda : DeviceSpec::Kind::kCpu;
  s.spec.text = "the surviving devices";
  // Tensor and pipeline parallelism: a model replica (the ranks of one data coordinate: its tensor
  // groups and pipeline stages) that lost a member cannot run its layers; the whole replica is
  // dropped and the survivors form a smaller data axis (the snapshot is in the logical layout, so
  // it reshards onto any mesh).
  const Mesh& mesh = world.mesh();
  auto group_lost = [&](int r) {
    for (int q = 0; q < N; ++q)
      if (mesh.index(MeshAxis::kData, q) == mesh.index(MeshAxis::kData, r) && world.device(q).failed()) return true;
    return false;
  };
  for (int r = 0; r < N; ++r) {
    if (world.device(r).failed()) {
      s.lost += (s.lost.empty() ? "" : ", ") + world.device(r).name();
    } else if (group_lost(r)) {
      s.dropped += (s.dropped.empty() ? "" : ", ") + world.device(r).name();
    } else {
      ++s.count;
      // CUDA: the survivor's physical GPU (logical devices may share one).
      if (cuda)
        s.spec.cuda_ordinals.push_back(current.cuda_ordinals.empty()
                                           ? r
                                           : current.cuda_ordinals[static_cast<size_t>(r) % current.cuda_ordinals.size()]);
    }
  }
  s.spec.cpu_count = s.count;
  if (s.count == N || s.count == 0) return std::nullopt;
  return s;
}

}  // namespace zt
