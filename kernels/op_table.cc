// The registry of op tables (one per backend) and the lookups ops.cc and optimizers.cc use.
// The only file that knows which backends a build has.
#include "kernels/op_table.h"

#include <atomic>
#include <sstream>

#include "core/status.h"
#include "runtime/device.h"

namespace zt {

namespace {

const OpTable* builtin_table(Backend backend) {
  if (backend == Backend::kCpu) return &cpu_op_table();
#if ZT_WITH_CUDA
  return &cuda_op_table();
#else
  return nullptr;
#endif
}

// Replacements installed by ScopedOpTable (tests); nullptr = the built-in table.
std::atomic<const OpTable*> g_override[2] = {nullptr, nullptr};

size_t slot(Backend backend) { return backend == Backend::kCpu ? 0 : 1; }

}  // namespace

const char* op_name(OpId op) {
  switch (op) {
#define ZT_OP_NAME(id, name) \
  case OpId::id:             \
    return #name;
    ZT_OPS(ZT_OP_NAME)
#undef ZT_OP_NAME
    case OpId::kCount:
      break;
  }
  return "unknown op";
}

bool OpTable::has_entry(OpId op) const {
  switch (op) {
#define ZT_OP_HAS(id, name) \
  case OpId::id:            \
    return name != nullptr;
    ZT_OPS(ZT_OP_HAS)
#undef ZT_OP_HAS
    case OpId::kCount:
      break;
  }
  return false;
}

const OpTable* op_table(Backend backend) {
  if (const OpTable* t = g_override[slot(backend)].load(std::memory_order_acquire)) return t;
  return builtin_table(backend);
}

const OpTable* find_kernel(Stream& s, OpId op) {
  const OpTable* t = op_table(s.backend());
  return t != nullptr && t->has_entry(op) ? t : nullptr;
}

void refuse_op(Stream& s, OpId op, std::initializer_list<DType> dtypes) {
  std::ostringstream types;
  const char* sep = "";
  for (DType d : dtypes) {
    types << sep << dtype_name(d);
    sep = ", ";
  }
  const std::string what = dtypes.size() ? " for " + types.str() : "";
  if (op_table(s.backend()) == nullptr)
    ZT_THROW(ErrorKind::kInvalidArgument, op_name(op), ": this build has no ", backend_name(s.backend()),
             " backend (", s.device().name(), ")");
  ZT_THROW(ErrorKind::kInvalidArgument, op_name(op), ": the ", backend_name(s.backend()), " backend (",
           s.device().name(), ") has no kernel", what, " and no fallback applies");
}

const OpTable& require_kernel(Stream& s, OpId op, std::initializer_list<DType> dtypes) {
  const OpTable* t = find_kernel(s, op);
  if (t == nullptr) refuse_op(s, op, dtypes);
  return *t;
}

ScopedOpTable::ScopedOpTable(Backend backend, const OpTable* table)
    : backend_(backend), previous_(g_override[slot(backend)].exchange(table, std::memory_order_acq_rel)) {}

ScopedOpTable::~ScopedOpTable() { g_override[slot(backend_)].store(previous_, std::memory_order_release); }

}  // namespace zt
