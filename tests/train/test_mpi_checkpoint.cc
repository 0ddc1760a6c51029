// Checkpoints across processes and lost processes (#18 items 4 and 5): a checkpoint written by
// `mpirun -np 2 zerotrain train --devices cpu:2` resumes in one process on cpu:4 (and the reverse)
// with the losses of an uninterrupted run bit for bit; a SIGKILLed process stops the survivors
// within --comm-timeout with one sentence naming it and the step. Runs mpirun itself (label "mpi").
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace zt {
namespace {

using test_util::run_binary;

// Step -> loss of a --log-format json run (only process 0 prints).
std::map<int, double> losses(const std::string& output) {
  std::map<int, double> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || j.contains("event") || !j.contains("loss")) continue;
    EXPECT_EQ(out.count(j["step"].get<int>()), 0u) << "step " << j["step"] << " reported twice:\n" << output;
    out[j["step"].get<int>()] = j["loss"].get<double>();
  }
  return out;
}

uint64_t bits(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// Every step of `tail` reports the loss `whole` reports for it, bit for bit (and tail has steps from..to).
void expect_same_losses(const std::map<int, double>& whole, const std::map<int, double>& tail, int from, int to) {
  ASSERT_EQ(tail.size(), static_cast<size_t>(to - from + 1));
  for (int s = from; s <= to; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    ASSERT_TRUE(whole.count(s) && tail.count(s));
    EXPECT_EQ(bits(tail.at(s)), bits(whole.at(s))) << tail.at(s) << " vs " << whole.at(s);
  }
}

std::string mpirun(int np, const std::string& extra = "") {
  return std::string(MPIEXEC_BIN) + " -np " + std::to_string(np) + " --allow-run-as-root --oversubscribe " + extra;
}

const std::string kModel = "--model gpt-tiny --layers 2 --embd 32 --eval-every 0 --eval-batches 1 --log-format json ";

std::string one(int devices, const std::string& flags) {
  return "train --devices cpu:" + std::to_string(devices) + " " + kModel + flags;
}

// Every file of a directory (name -> bytes), to prove a checkpoint untouched.
std::map<std::string, std::string> files_of(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out[e.path().filename()] = test_util::read_text(e.path());
  return out;
}

class MpiCheckpoint : public ::testing::TestWithParam<int> {};

TEST_P(MpiCheckpoint, TwoProcessesSaveOneProcessResumesBitForBit) {
  const std::string stage = "--zero-stage " + std::to_string(GetParam()) + " ";
  test_util::TempDir dir("mpi_ckpt_2to1");
  const auto whole = run_binary(ZEROTRAIN_BIN, one(4, stage + "--steps 4"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string ck = dir.path("ck");
  const auto saved = run_binary(mpirun(2) + ZEROTRAIN_BIN,
                                one(2, stage + "--steps 4 --comm-timeout 60 --save-every 2 --checkpoint-dir " + ck));
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  expect_same_losses(losses(whole.output), losses(saved.output), 1, 4);
  // One checkpoint of 4 ranks: both processes' files under one manifest.
  const nlohmann::json manifest = nlohmann::json::parse(test_util::read_text(ck + "/step-00000002/manifest.json"));
  EXPECT_EQ(manifest["files"].size(), 4u) << manifest.dump();
  EXPECT_EQ(manifest["meta"]["devices"], 4);
  const auto resumed = run_binary(ZEROTRAIN_BIN, one(4, stage + "--steps 4 --resume " + ck + "/step-00000002"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  expect_same_losses(losses(whole.output), losses(resumed.output), 3, 4);
}

TEST_P(MpiCheckpoint, OneProcessSavesTwoProcessesResumeBitForBit) {
  const std::string stage = "--zero-stage " + std::to_string(GetParam()) + " ";
  test_util::TempDir dir("mpi_ckpt_1to2");
  const std::string ck = dir.path("ck");
  const auto whole = run_binary(ZEROTRAIN_BIN, one(4, stage + "--steps 4 --save-every 2 --checkpoint-dir " + ck));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  std::filesystem::remove_all(ck + "/step-00000004");
  {
    std::ofstream(ck + "/latest") << "step-00000002\n";
  }
  // --resume auto under the same --checkpoint-dir: process 0 holds the directory's lease for the
  // launch and process 1 is let in; both resume from step 2 and save step 4 together.
  const auto resumed = run_binary(mpirun(2) + ZEROTRAIN_BIN,
                                  one(2, stage + "--steps 4 --comm-timeout 60 --resume auto --checkpoint-dir " + ck));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  expect_same_losses(losses(whole.output), losses(resumed.output), 3, 4);
  EXPECT_EQ(test_util::read_text(ck + "/latest"), "step-00000004\n");
  EXPECT_EQ(nlohmann::json::parse(test_util::read_text(ck + "/step-00000004/manifest.json"))["files"].size(), 4u);
  // Nothing left to train: the processes save what they loaded together (the synchronous save).
  const auto converted = run_binary(mpirun(2) + ZEROTRAIN_BIN,
                                    one(2, stage + "--steps 4 --comm-timeout 60 --resume auto --checkpoint-dir " + ck));
  ASSERT_EQ(converted.exit_code, 0) << converted.output;
  EXPECT_TRUE(losses(converted.output).empty()) << converted.output;
  EXPECT_NO_THROW(nlohmann::json::parse(test_util::read_text(ck + "/step-00000004/manifest.json"))) << converted.output;
}

INSTANTIATE_TEST_SUITE_P(Stages, MpiCheckpoint, ::testing::Values(1, 3),
                         [](const auto& info) { return "Stage" + std::to_string(info.param); });

TEST(MpiCheckpointResharding, TwoProcessCheckpointResumesOnTwoDevicesAsAOneProcessOneDoes) {
  // Onto another device count the losses are those of resuming the one-process checkpoint there.
  test_util::TempDir dir("mpi_ckpt_reshard");
  const std::string a = dir.path("a"), b = dir.path("b"), flags = "--zero-stage 2 --steps 4 --save-every 2 ";
  ASSERT_EQ(run_binary(ZEROTRAIN_BIN, one(4, flags + "--checkpoint-dir " + a)).exit_code, 0);
  const auto many = run_binary(mpirun(2) + ZEROTRAIN_BIN, one(2, flags + "--comm-timeout 60 --checkpoint-dir " + b));
  ASSERT_EQ(many.exit_code, 0) << many.output;
  const auto from_one = run_binary(ZEROTRAIN_BIN, one(2, "--zero-stage 2 --steps 4 --resume " + a + "/step-00000002"));
  const auto from_many = run_binary(ZEROTRAIN_BIN, one(2, "--zero-stage 2 --steps 4 --resume " + b + "/step-00000002"));
  ASSERT_EQ(from_one.exit_code, 0) << from_one.output;
  ASSERT_EQ(from_many.exit_code, 0) << from_many.output;
  expect_same_losses(losses(from_one.output), losses(from_many.output), 3, 4);
}

TEST(MpiCheckpointLease, AnotherRunsDirectoryIsRefusedByEveryProcess) {
  test_util::TempDir dir("mpi_ckpt_lease");
  const std::string ck = dir.path("ck");
  ASSERT_EQ(run_binary(ZEROTRAIN_BIN, one(2, "--steps 2 --checkpoint-dir " + ck)).exit_code, 0);
  // Another seed is another run: process 0 refuses the directory and process 1 says the same
  // (each process wraps its exit code in a line).
  const auto r = run_binary(mpirun(2) + "sh -c '" + ZEROTRAIN_BIN + " " +
                                one(1, "--steps 2 --seed 7 --comm-timeout 60 --checkpoint-dir " + ck) +
                                "; echo exit code $?'",
                            "");
  size_t refusals = 0, exits = 0;
  for (size_t at = 0; (at = r.output.find("holds 1 checkpoint(s) of another run", at)) != std::string::npos; ++at)
    ++refusals;
  for (size_t at = 0; (at = r.output.find("exit code 2", at)) != std::string::npos; ++at) ++exits;
  EXPECT_EQ(refusals, 2u) << r.output;
  EXPECT_EQ(exits, 2u) << r.output;
}

// SIGKILL process `victim` of `np` when step 5 starts; the survivors stop within the timeout with
// the sentence, exit code 4 and their parts of the step-4 snapshot; the complete checkpoint that
// was in the directory is untouched.
void kill_one(int np, int local, int victim) {
  SCOPED_TRACE(std::to_string(np) + " processes, process " + std::to_string(victim) + " killed");
  test_util::TempDir dir("mpi_ckpt_kill");
  const std::string ck = dir.path("ck");
  const std::string batch = "--batch-size " + std::to_string(2 * np * local) + " ";
  const auto first = run_binary(mpirun(np) + ZEROTRAIN_BIN,
                                one(local, batch + "--steps 2 --comm-timeout 60 --checkpoint-dir " + ck));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto before = files_of(ck + "/step-00000002");
  const std::string latest = test_util::read_text(ck + "/latest");
  const double timeout_s = 3;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_binary(
      "ZEROTRAIN_TEST_SIGKILL=" + std::to_string(victim) + ",5 " +
          mpirun(np, "--enable-recovery -x ZEROTRAIN_TEST_SIGKILL ") + "sh -c '" + ZEROTRAIN_BIN + " " +
          one(local, batch + "--steps 20 --snapshot-every 2 --resume auto --comm-timeout 3 --checkpoint-dir " + ck) +
          "; echo exit code $?'",
      "");
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Startup and the four steps take about a second; the survivors then wait out the timeout (and
  // the chain walk, a fifth of it) and write their parts.
  EXPECT_LT(wall, timeout_s * 1.2 + 12) << r.output;
  const std::string who = local == 1 ? "rank " + std::to_string(victim) + " (process " + std::to_string(victim) + ") has"
                                     : "ranks " + std::to_string(victim * local) + "-" +
                                           std::to_string(victim * local + local - 1) + " (process " +
                                           std::to_string(victim) + ") have";
  const std::string sentence = "zerotrain: step 5: " + who + " died or stalled: ";
  size_t said = 0, exits = 0;
  for (size_t at = 0; (at = r.output.find(sentence, at)) != std::string::npos; ++at) ++said;
  for (size_t at = 0; (at = r.output.find("exit code 4", at)) != std::string::npos; ++at) ++exits;
  EXPECT_EQ(said, static_cast<size_t>(np - 1)) << r.output;
  EXPECT_EQ(exits, static_cast<size_t>(np - 1)) << r.output;
  // One line each: the sentence is not followed by a second error line of the same process.
  EXPECT_EQ(r.output.find("zerotrain: internal error"), std::string::npos) << r.output;
  for (int p = 0; p < np; ++p) {
    const std::string part = ck + "/partial-step-00000004-process-" + std::to_string(p);
    EXPECT_EQ(std::filesystem::exists(part + "/partial.json"), p != victim) << part << "\n" << r.output;
    if (p == victim) continue;
    for (int l = 0; l < local; ++l)
      EXPECT_TRUE(std::filesystem::exists(part + "/rank-0000" + std::to_string(p * local + l) + ".bin")) << part;
    // --resume refuses a part with one sentence.
    const auto refused = run_binary(ZEROTRAIN_BIN, one(np * local, batch + "--steps 20 --resume " + part));
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_NE(refused.output.find("is one process's part of a snapshot"), std::string::npos) << refused.output;
  }
  EXPECT_EQ(files_of(ck + "/step-00000002"), before);
  EXPECT_EQ(test_util::read_text(ck + "/latest"), latest);
}

TEST(MpiLostProcess, KillOneOfTwo) { kill_one(2, 2, 1); }
TEST(MpiLostProcess, KillOneOfThree) { kill_one(3, 1, 0); }

double final_loss(const std::string& output) {
  double loss = -1;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.value("event", "") == "summary") loss = j["final_loss"].get<double>();
  }
  return loss;
}

// Item 6: one of 3 processes is killed at step 7; each survivor holds its own and its neighbour's
// ranks of the step-6 snapshot, scripts/elastic relaunches the 2 survivors, which assemble the
// parts into a checkpoint and finish the run within 1% of an uninterrupted run's final loss.
TEST(MpiLostProcess, ElasticRelaunchFinishesTheRun) {
  test_util::TempDir dir("mpi_ckpt_elastic");
  const std::string ck = dir.path("ck");
  const std::string flags = "--batch-size 6 --steps 12 --snapshot-every 2 ";
  const auto whole = run_binary(mpirun(3) + ZEROTRAIN_BIN, one(1, flags + "--comm-timeout 60"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto r = run_binary("ZEROTRAIN_TEST_SIGKILL=1,7 " + std::string(ELASTIC_SCRIPT) +
                                " 3 --allow-run-as-root --oversubscribe -x ZEROTRAIN_TEST_SIGKILL -- " + ZEROTRAIN_BIN,
                            one(1, flags + "--comm-timeout 3 --checkpoint-dir " + ck));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("zerotrain: step 7: rank 1 (process 1) has died or stalled"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("relaunching the 2 survivors"), std::string::npos) << r.output;
  // The relaunch resumed from the assembled snapshot of step 6 (every rank: process 1's from
  // process 2's replica), not from scratch: it reported steps 7-12 only.
  EXPECT_TRUE(std::filesystem::exists(ck + "/step-00000006/manifest.json")) << r.output;
  const std::map<int, double> resumed = losses(r.output.substr(r.output.find("relaunching")));
  ASSERT_FALSE(resumed.empty()) << r.output;
  EXPECT_EQ(resumed.begin()->first, 7) << r.output;
  EXPECT_EQ(resumed.rbegin()->first, 12) << r.output;
  for (const auto& e : std::filesystem::directory_iterator(ck))
    EXPECT_EQ(e.path().filename().string().rfind("partial-", 0), std::string::npos) << e.path();
  const double a = final_loss(whole.output), b = final_loss(r.output);
  ASSERT_GT(a, 0) << whole.output;
  EXPECT_NEAR(b, a, 0.01 * a) << r.output;
}

}  // namespace
}  // namespace zt
