// Which implementation of the device runtime a device belongs to.
#pragma once

namespace zt {

enum class Backend { kCpu, kCuda };

inline const char* backend_name(Backend b) { return b == Backend::kCpu ? "cpu" : "cuda"; }

}  // namespace zt
