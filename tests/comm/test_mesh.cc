// Device mesh layouts (tensor fastest, then data, then pipeline) checked rank by rank against the
// closed form rank = t + T*(d + D*p), sub-meshes over explicit ranks, and bad shapes refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "comm/mesh.h"
#include "core/status.h"
#include "test_util.h"

namespace zt {
namespace {

using ::testing::HasSubstr;

// Closed-form groups of position q for a D x T x P mesh over ranks 0..N-1.
std::vector<int> closed_tensor(int q, int D, int T) {
  (void)D;
  std::vector<int> g;
  for (int i = 0; i < T; ++i) g.push_back(q / T * T + i);
  return g;
}
std::vector<int> closed_data(int q, int D, int T) {
  std::vector<int> g;
  for (int i = 0; i < D; ++i) g.push_back(q % T + T * i + T * D * (q / (T * D)));
  return g;
}
std::vector<int> closed_pipeline(int q, int D, int T, int P) {
  std::vector<int> g;
  for (int i = 0; i < P; ++i) g.push_back(q % (T * D) + T * D * i);
  return g;
}

struct Layout {
  int data, tensor, pipeline;
};

TEST(Mesh, GroupsMatchTheClosedFormForEveryLayout) {
  // data x tensor (x pipeline).
  for (const Layout l : {Layout{2, 2, 1}, Layout{2, 2, 2}, Layout{1, 4, 1}, Layout{3, 1, 1}, Layout{8, 1, 1},
                         Layout{1, 1, 1}, Layout{2, 3, 2}, Layout{1, 2, 4}}) {
    const int D = l.data, T = l.tensor, P = l.pipeline, N = D * T * P;
    const Mesh mesh(MeshShape{.data = D, .tensor = T, .pipeline = P}, N);
    SCOPED_TRACE(mesh.describe());
    ASSERT_EQ(mesh.size(), N);
    EXPECT_EQ(mesh.size(MeshAxis::kData), D);
    EXPECT_EQ(mesh.size(MeshAxis::kTensor), T);
    EXPECT_EQ(mesh.size(MeshAxis::kPipeline), P);
    for (int r = 0; r < N; ++r) {
      EXPECT_EQ(mesh.tensor_group(r), closed_tensor(r, D, T)) << "rank " << r;
      EXPECT_EQ(mesh.data_group(r), closed_data(r, D, T)) << "rank " << r;
      EXPECT_EQ(mesh.pipeline_group(r), closed_pipeline(r, D, T, P)) << "rank " << r;
      const MeshCoord c = mesh.coord(r);
      EXPECT_EQ(c, (MeshCoord{.data = r / T % D, .tensor = r % T, .pipeline = r / (T * D)})) << "rank " << r;
      EXPECT_EQ(mesh.rank_at(c), r);
      // A rank's position in each group is its coordinate on that axis.
      for (MeshAxis a : {MeshAxis::kData, MeshAxis::kTensor, MeshAxis::kPipeline}) {
        const auto g = mesh.group(a, r);
        EXPECT_EQ(g[static_cast<size_t>(mesh.index(a, r))], r);
        // Every member computes the same ordered list.
        for (int q : g) EXPECT_EQ(mesh.group(a, q), g);
      }
      EXPECT_EQ(mesh.pipeline_next(r), c.pipeline + 1 < P ? r + T * D : -1);
      EXPECT_EQ(mesh.pipeline_prev(r), c.pipeline > 0 ? r - T * D : -1);
    }
    // groups(axis): N / size disjoint groups covering every rank once.
    for (MeshAxis a : {MeshAxis::kData, MeshAxis::kTensor, MeshAxis::kPipeline}) {
      const auto gs = mesh.groups(a);
      EXPECT_EQ(static_cast<int>(gs.size()), N / mesh.size(a));
      std::multiset<int> seen;
      for (const auto& g : gs) {
        EXPECT_EQ(static_cast<int>(g.size()), mesh.size(a));
        seen.insert(g.begin(), g.end());
      }
      std::multiset<int> all;
      for (int r = 0; r < N; ++r) all.insert(r);
      EXPECT_EQ(seen, all) << mesh_axis_name(a);
    }
  }
}

TEST(Mesh, NamedLayoutsSpelledOut) {
  const Mesh m22(MeshShape{.data = 2, .tensor = 2}, 4);
  EXPECT_EQ(m22.groups(MeshAxis::kTensor), (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(m22.groups(MeshAxis::kData), (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(m22.pipeline_group(3), (std::vector<int>{3}));
  const Mesh m222(MeshShape{.data = 2, .tensor = 2, .pipeline = 2}, 8);
  EXPECT_EQ(m222.tensor_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(m222.data_group(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(m222.pipeline_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(m222.describe(), "2 data x 2 tensor x 2 pipeline (8 ranks)");
  const Mesh m14(MeshShape{.data = 1, .tensor = 4}, 4);
  EXPECT_EQ(m14.tensor_group(2), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(m14.data_group(2), (std::vector<int>{2}));
  const Mesh m31(MeshShape{.data = 3, .tensor = 1}, 3);
  EXPECT_EQ(m31.data_group(1), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(m31.tensor_group(1), (std::vector<int>{1}));
  const Mesh m811(MeshShape{.data = 8}, 8);
  EXPECT_EQ(m811.data_group(0), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(m811.groups(MeshAxis::kTensor).size(), 8u);
}

// A sub-mesh over explicit ranks (a sweep trial on devices 7, 2, 5, 4): groups name those ranks.
TEST(Mesh, SubMeshOverExplicitRanks) {
  const Mesh m(MeshShape{.data = 2, .tensor = 2}, std::vector<int>{7, 2, 5, 4});
  EXPECT_EQ(m.tensor_group(2), (std::vector<int>{7, 2}));
  EXPECT_EQ(m.tensor_group(4), (std::vector<int>{5, 4}));
  EXPECT_EQ(m.data_group(7), (std::vector<int>{7, 5}));
  EXPECT_EQ(m.data_group(4), (std::vector<int>{2, 4}));
  EXPECT_EQ(m.coord(4), (MeshCoord{.data = 1, .tensor = 1, .pipeline = 0}));
  EXPECT_EQ(m.rank_at(MeshCoord{.data = 1, .tensor = 0}), 5);
  EXPECT_TRUE(m.contains(5));
  EXPECT_FALSE(m.contains(0));
  EXPECT_FALSE(m.contains(100));
}

using test_util::invalid_argument_message;

TEST(Mesh, BadShapesAreRefusedWithOneSentence) {
  EXPECT_EQ(invalid_argument_message([] { Mesh(MeshShape{.data = 3, .tensor = 2}, 4); }),
            "mesh: 3 data x 2 tensor x 1 pipeline needs 6 devices but 4 are given; the product of "
            "the axes must equal the device count");
  EXPECT_EQ(invalid_argument_message([] { Mesh(MeshShape{.data = 2, .tensor = 0}, 4); }),
            "mesh: the tensor axis is 0; every axis needs at least 1 device (use 1 for an unused axis)");
  EXPECT_THAT(invalid_argument_message([] { Mesh(MeshShape{.pipeline = -2}, 2); }), HasSubstr("the pipeline axis is -2"));
  EXPECT_THAT(invalid_argument_message([] { Mesh(MeshShape{}, 0); }), HasSubstr("a mesh needs at least one device"));
  // No int overflow: 65536^3 is not 0 modulo 2^32.
  EXPECT_THAT(invalid_argument_message([] { Mesh(MeshShape{.data = 65536, .tensor = 65536, .pipeline = 65536}, 1); }),
              HasSubstr("needs 281474976710656 devices but 1 are given"));
  EXPECT_THAT(invalid_argument_message([] { Mesh(MeshShape{.data = 2}, std::vector<int>{3, 3}); }),
              HasSubstr("rank 3 is given twice"));
  EXPECT_THAT(invalid_argument_message([] { Mesh(MeshShape{.data = 2}, std::vector<int>{0, -1}); }),
              HasSubstr("rank -1 is negative"));
  const Mesh m(MeshShape{.data = 2, .tensor = 2}, 4);
  EXPECT_THAT(invalid_argument_message([&] { m.tensor_group(4); }), HasSubstr("rank 4 is not in the mesh 2 data x 2 tensor"));
  EXPECT_THAT(invalid_argument_message([&] { m.rank_at(MeshCoord{.data = 2}); }),
              HasSubstr("data coordinate 2 is outside 0..1"));
}

}  // namespace
}  // namespace zt
