// What test_mpi's main() sets up for its tests: the world process group and L, the number of
// simulated CPU devices each process drives (--local-devices).
#pragma once

#include "comm/process_group.h"

namespace zt::mpitest {

// Every process of the launch; the tests use it to stay in step (barriers), not as the group under
// test (a test that breaks a group makes its own).
ProcessGroup& world();
int local_devices();
// --kill-test: this launch runs only the SIGKILL test (a process will die; no final barrier, no
// MPI_Finalize).
bool kill_mode();

}  // namespace zt::mpitest
