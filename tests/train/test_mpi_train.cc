// `mpirun -np K zerotrain train --devices cpu:L` against one process on cpu:K*L (#18): every step's
// loss and gradient norm and every evaluation bit for bit, at ZeRO stages 0-3, fp32 and bf16, with
// and without tensor parallelism; and the refusals. Runs the binary under mpirun itself (ctest
// label "mpi", release/cpu presets only).
#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace zt {
namespace {

using test_util::run_binary;

struct Record {
  std::string event;  // "step" or "eval"
  int step = 0;
  double loss = 0, grad_norm = 0;  // an evaluation: its loss, and its accuracy (classifiers) as grad_norm
};

// The step and eval records of a --log-format json run.
std::vector<Record> records(const std::string& output) {
  std::vector<Record> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;
    if (j.contains("event") && j["event"] == "eval")
      out.push_back({"eval", j["step"].get<int>(), j["val_loss"].get<double>(), j.value("accuracy", 0.0)});
    else if (!j.contains("event") && j.contains("loss"))
      out.push_back({"step", j["step"].get<int>(), j["loss"].get<double>(), j["grad_norm"].get<double>()});
  }
  return out;
}

uint64_t bits(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

const std::string kRun = "--steps 3 --eval-batches 1 --log-format json";
const std::string kModel = "--model gpt-tiny --layers 2 --embd 32 " + kRun;

std::string mpirun(int np) {
  return std::string(MPIEXEC_BIN) + " -np " + std::to_string(np) + " --allow-run-as-root --oversubscribe " +
         ZEROTRAIN_BIN;
}

// K processes of L devices against one process of K*L devices, same flags.
void expect_same_run(int K, int L, const std::string& flags, const std::string& model = kModel) {
  SCOPED_TRACE(std::to_string(K) + " processes x cpu:" + std::to_string(L) + " " + flags);
  const auto one = run_binary(ZEROTRAIN_BIN, "train --devices cpu:" + std::to_string(K * L) + " " + model + " " + flags);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto many = run_binary(mpirun(K), "train --devices cpu:" + std::to_string(L) + " --comm-timeout 60 " + model +
                                              " " + flags);
  ASSERT_EQ(many.exit_code, 0) << many.output;
  const std::vector<Record> a = records(one.output), b = records(many.output);
  ASSERT_EQ(a.size(), 6u) << one.output;  // 3 steps, an evaluation after each
  // Only process 0 prints: the same number of records, not K times as many.
  ASSERT_EQ(b.size(), a.size()) << many.output;
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].event + " " + std::to_string(a[i].step));
    EXPECT_EQ(b[i].event, a[i].event);
    EXPECT_EQ(b[i].step, a[i].step);
    EXPECT_EQ(bits(b[i].loss), bits(a[i].loss)) << b[i].loss << " vs " << a[i].loss;
    EXPECT_EQ(bits(b[i].grad_norm), bits(a[i].grad_norm)) << b[i].grad_norm << " vs " << a[i].grad_norm;
  }
}

TEST(MpiTrain, TwoProcessesOfTwoDevicesEqualFourDevicesAtEveryStage) {
  for (int stage = 0; stage <= 3; ++stage) expect_same_run(2, 2, "--zero-stage " + std::to_string(stage));
}

TEST(MpiTrain, TwoProcessesEqualOneInBf16) {
  expect_same_run(2, 2, "--zero-stage 3 --precision bf16");
  expect_same_run(2, 2, "--zero-stage 1 --precision bf16");
}

TEST(MpiTrain, FourProcessesOfOneDevice) { expect_same_run(4, 1, "--zero-stage 2"); }

TEST(MpiTrain, GradientAccumulationAcrossProcesses) {
  // 2 micro-batches per step: rank g's rows are chunk m * 4 + g of the global batch in both runs.
  expect_same_run(2, 2, "--zero-stage 2 --batch-size 8 --micro-batch-size 1");
}

TEST(MpiTrain, ClassifierAcrossProcesses) {
  // The image data's rows and the evaluation's examples (and its accuracy) follow the global rank too.
  expect_same_run(2, 2, "--zero-stage 3", "--model mlp " + kRun);
}

TEST(MpiTrain, RefusesWhatIsNotBuiltWithOneSentence) {
  test_util::TempDir dir("mpi_train_refuse");
  const auto r = run_binary(mpirun(2), "train --devices cpu:1 " + kModel + " --trace " + dir.path("t.json"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--trace is not supported when zerotrain runs as 2 processes"), std::string::npos)
      << r.output;
  const auto p = run_binary(mpirun(2), "train --devices cpu:2 " + kModel + " --pipeline-parallel 2");
  EXPECT_NE(p.exit_code, 0);
  EXPECT_NE(p.output.find("--pipeline-parallel is not supported"), std::string::npos) << p.output;
}

// Tensor parallelism across processes: the tensor axis inside each process, the data axis across
// (global rank p * L + i has tensor coordinate i % T), so the run equals one process's on cpu:K*L
// with the same --tensor-parallel, whose data groups have the same order.
TEST(MpiTrain, TensorParallelAcrossProcessesAtEveryStage) {
  for (int stage = 0; stage <= 3; ++stage)
    expect_same_run(2, 2, "--tensor-parallel 2 --zero-stage " + std::to_string(stage));
}

TEST(MpiTrain, TensorParallelAcrossProcessesInBf16) {
  expect_same_run(2, 2, "--tensor-parallel 2 --zero-stage 1 --precision bf16");
  expect_same_run(2, 2, "--tensor-parallel 2 --zero-stage 3 --precision bf16");
}

TEST(MpiTrain, TensorParallelAcrossProcessesWithoutSequenceParallelism) {
  expect_same_run(2, 2, "--tensor-parallel 2 --zero-stage 2 --no-sequence-parallel");
}

TEST(MpiTrain, TensorParallelWithTwoDataRanksInEachProcess) {
  // cpu:4 with T = 2: each tensor coordinate's data ring has two devices in each process (a local
  // hop, then a hop across), and the steps accumulate 2 micro-batches.
  expect_same_run(2, 4, "--tensor-parallel 2 --zero-stage 3 --precision bf16 --batch-size 16 --micro-batch-size 2");
}

TEST(MpiTrain, RefusesATensorDegreeThatDoesNotDivideEachProcess) {
  // 4 divides the 2 x 2 ranks, but the tensor axis must fit inside one process.
  const auto r = run_binary(mpirun(2), "train --devices cpu:2 " + kModel + " --tensor-parallel 4");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("does not divide the 2 devices"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace zt
