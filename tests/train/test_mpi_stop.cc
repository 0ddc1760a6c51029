// Agreed stops across processes (#31 reproduction 11): SIGTERM or SIGINT to one process of an
// `mpirun -np 2 zerotrain train` launch becomes one stop every process makes after the same step,
// with one stop checkpoint holding every rank and exit 143/130 from every process, instead of a
// stall until --comm-timeout and exit 4. Runs mpirun itself (label "mpi").
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <map>
#include <string>

#include "checkpoint/checkpoint.h"
#include "test_util.h"

namespace zt {
namespace {

using test_util::run_binary;

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = 0; (at = text.find(what, at)) != std::string::npos; ++at) ++n;
  return n;
}

// Process `victim` of 2 (2 devices each) receives `sig` when step 3 starts.
void stop_one(int victim, int sig) {
  const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
  SCOPED_TRACE(name + " to process " + std::to_string(victim));
  test_util::TempDir dir("mpi_stop");
  const std::string ck = dir.path("ck");
  // --comm-timeout 600: a process left waiting for the other would hit ctest's timeout, or exit 4,
  // long before; the agreed stop takes one step.
  const auto r = run_binary(
      "ZEROTRAIN_TEST_SIGNAL=" + std::to_string(victim) + ",3," + std::to_string(sig) + " " + MPIEXEC_BIN +
          " -np 2 --allow-run-as-root --oversubscribe -x ZEROTRAIN_TEST_SIGNAL sh -c '" + ZEROTRAIN_BIN +
          " train --devices cpu:2 --layers 1 --embd 32 --heads 2 --seq-len 16 --eval-batches 1 --eval-every 0 "
          "--sample-tokens 0 --steps 50 --save-every 100 --comm-timeout 600 --quiet --checkpoint-dir " +
          ck + "; echo exit code $?'",
      "");
  EXPECT_EQ(count(r.output, "exit code " + std::to_string(128 + sig)), 2u) << r.output;
  EXPECT_EQ(count(r.output, "zerotrain: stopped by " + name + " after step 3; checkpoint " + ck + "/step-00000003"), 2u)
      << r.output;
  EXPECT_EQ(count(r.output, "died or stalled"), 0u) << r.output;
  // One stop checkpoint of every rank (both processes' files under one manifest), loadable, and
  // nothing else saved.
  const CheckpointReader reader = CheckpointReader::open(ck + "/step-00000003");
  EXPECT_EQ(reader.manifest().files.size(), 4u);
  EXPECT_EQ(reader.meta().at("devices"), 4);
  EXPECT_EQ(list_checkpoints(ck).size(), 1u);
}

TEST(MpiStop, SigtermToOneProcessStopsEveryProcessAfterTheSameStep) { stop_one(1, SIGTERM); }
TEST(MpiStop, SigintToTheFirstProcessStopsEveryProcessAfterTheSameStep) { stop_one(0, SIGINT); }

// scripts/elastic reports a failed launch: mpirun --enable-recovery exits 0 even when every
// process failed, so the script takes the processes' own exit codes (here: bad input, 2).
TEST(MpiStop, ElasticExitsNonZeroWhenTheProcessesFailed) {
  test_util::TempDir dir("mpi_elastic_fail");
  const auto r = run_binary(std::string(ELASTIC_SCRIPT) + " 2 --allow-run-as-root --oversubscribe -- " + ZEROTRAIN_BIN,
                            "train --devices cpu:1 --layers 1 --embd 32 --heads 2 --seq-len 16 --steps 2 "
                            "--lr -1 --checkpoint-dir " + dir.path("ck"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("scripts/elastic: process 0 exited with code 2"), std::string::npos) << r.output;
  // And a launch that ends well is still 0.
  const auto ok = run_binary(std::string(ELASTIC_SCRIPT) + " 2 --allow-run-as-root --oversubscribe -- " + ZEROTRAIN_BIN,
                             "train --devices cpu:1 --layers 1 --embd 32 --heads 2 --seq-len 16 --steps 1 "
                             "--eval-batches 1 --sample-tokens 0 --quiet --checkpoint-dir " + dir.path("ck2"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

}  // namespace
}  // namespace zt
