// zerotrain: the one binary. Subcommands: info (devices, peer access, build). The trainer
// (train) arrives with the compute issue. This is the only place an error becomes an exit code.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <string>

#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace {

constexpr int kExitRuntimeError = 1;
constexpr int kExitUsage = 2;

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", b, units[u]);
  return buf;
}

int run_info(const std::string& devices_flag) {
  const zt::DeviceSpec spec = zt::parse_device_spec(devices_flag);
  auto rt = zt::Runtime::create(spec);

  std::printf("ZeroTrain %s\n", ZT_VERSION_STR);
  std::printf("build: CUDA backend %s (archs %s), NVTX %s, BLAS OpenBLAS (%s)\n",
              ZT_WITH_CUDA ? "compiled" : "not compiled", ZT_CUDA_ARCHS_STR,
              ZT_NVTX_STR, openblas_get_config());
  const zt::CudaAvailability cuda = zt::cuda_availability();
  if (cuda.usable)
    std::printf("cuda: %d GPU%s visible\n", cuda.device_count, cuda.device_count == 1 ? "" : "s");
  else
    std::printf("cuda: %s\n", cuda.reason.c_str());
  if (!rt->fallback_note().empty()) std::printf("note: %s\n", rt->fallback_note().c_str());

  std::printf("devices (%s backend, %d):\n", zt::backend_name(rt->backend()), rt->size());
  for (int i = 0; i < rt->size(); ++i) {
    zt::Device& d = rt->device(i);
    std::printf("  [%d] %-40s memory %s\n", i, d.name().c_str(), human_bytes(static_cast<double>(d.total_memory())).c_str());
  }
  std::printf("peer access (row can read/write column directly):\n     ");
  for (int j = 0; j < rt->size(); ++j) std::printf("%4d", j);
  std::printf("\n");
  for (int i = 0; i < rt->size(); ++i) {
    std::printf("  %2d ", i);
    for (int j = 0; j < rt->size(); ++j)
      std::printf("%4s", i == j ? "-" : rt->device(i).can_access_peer(rt->device(j)) ? "Y" : "n");
    std::printf("\n");
  }
  const zt::MemoryStats st = rt->device(0).memory().stats();
  std::printf("pool: caching allocator per device (small requests packed in 2 MiB segments, "
              "large rounded to 2 MiB); device 0 reserved %s\n",
              human_bytes(static_cast<double>(st.reserved_bytes)).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeroTrain: one process trains across every local GPU, ZeRO-style"};
  app.require_subcommand(1);
  app.set_version_flag("--version", ZT_VERSION_STR);

  std::string devices = "all";
  CLI::App* info = app.add_subcommand("info", "Show devices, peer access and build options");
  info->add_option("--devices", devices, "Devices: all, cpu:N, cuda:0,1,3, cuda:0x4")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }

  try {
    if (info->parsed()) return run_info(devices);
  } catch (const zt::Error& e) {
    std::fprintf(stderr, "zerotrain: %s\n", e.message().c_str());
    return e.kind() == zt::ErrorKind::kInvalidArgument ? kExitUsage : kExitRuntimeError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zerotrain: internal error: %s\n", e.what());
    return kExitRuntimeError;
  }
  return 0;
}
