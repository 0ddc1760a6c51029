// main() of test_mpi, run by ctest under `mpirun -np K test_mpi --local-devices L`: one world process
// group for the tests' fixtures, only rank 0 prints gtest's progress (the others print failures).
// --kill-test runs only test_process_kill.cc's test (its own ctest entries).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/mpi_test_env.h"
#include "comm/process_group.h"

namespace zt::mpitest {
namespace {
ProcessGroup* g_world = nullptr;
int g_local_devices = 1;
bool g_kill_mode = false;

// Failures of ranks other than 0, each line prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace

ProcessGroup& world() { return *g_world; }
int local_devices() { return g_local_devices; }
bool kill_mode() { return g_kill_mode; }
}  // namespace zt::mpitest

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--local-devices") == 0 && i + 1 < argc) {
      zt::mpitest::g_local_devices = std::atoi(argv[i + 1]);
      ++i;
    } else if (std::strcmp(argv[i], "--kill-test") == 0) {
      zt::mpitest::g_kill_mode = true;
      ::testing::GTEST_FLAG(filter) = "ProcessKill.*";
    } else {
      std::fprintf(stderr, "test_mpi: unknown argument '%s' (usage: mpirun -np K test_mpi --local-devices L)\n",
                   argv[i]);
      return 2;
    }
  }
  if (zt::mpitest::g_local_devices < 1) {
    std::fprintf(stderr, "test_mpi: --local-devices must be at least 1\n");
    return 2;
  }
  int rc = 1;
  {
    zt::ProcessGroup world(std::chrono::seconds(60));
    zt::mpitest::g_world = &world;
    if (world.rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new zt::mpitest::RankFailurePrinter(world.rank()));
    }
    rc = RUN_ALL_TESTS();
    // A peer is dead: no collective verdict, no MPI_Finalize (it would wait for the dead).
    if (zt::mpitest::g_kill_mode) std::_Exit(rc);
    // Every process reports the job's verdict, so that one failing rank fails them all.
    for (const int r : world.all_gather(rc, "the test results"))
      if (r != 0) rc = 1;
    zt::mpitest::g_world = nullptr;
  }
  zt::mpi_finalize();
  return rc;
}
