// The public ops of kernels/ops.h: validate dtypes, shapes and devices (a zt::Error naming the op
// and the shapes), then launch through the op table of the stream's backend (kernels/op_table.h),
// falling back to a composition of other ops where a backend has no kernel. Nothing here waits
// for the work, and nothing here knows a backend's types.
#include "kernels/ops.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "kernels/elementwise.h"
#include "kernels/op_table.h"
#include "memory/caching_allocator.h"
#include "runtime/device.h"

namespace zt::ops {

namespace {

// The table of s's backend for an op over fp32 tensors.
const OpTable& f32_kernel(Stream& s, OpId op) { return require_kernel(s, op, {DType::kF32}); }

bool present(const ConstTensorView& v) { return v.data != nullptr; }

// dtype, storage and device of one view. Every view an op touches must live on the stream's
// device (a host pointer handed to a GPU kernel is a crash; on the CPU backend it hides a bug).
void check_view(Stream& s, const char* op, const char* name, const ConstTensorView& v,
                DType dtype) {
  ZT_REQUIRE(v.dtype == dtype, op, ": ", name, " ", v.shape.str(), " is ", dtype_name(v.dtype),
             " but must be ", dtype_name(dtype));
  ZT_REQUIRE(v.data != nullptr || v.numel() == 0, op, ": ", name, " ", v.shape.str(),
             " has no data");
  ZT_REQUIRE(v.data == nullptr || v.device == s.device().index(), op, ": ", name, " ",
             v.shape.str(), " is on device ", v.device, " but the stream runs on ",
             s.device().name(), " (index ", s.device().index(), ")");
}

void check_f32(Stream& s, const char* op, const char* name, const ConstTensorView& v) {
  check_view(s, op, name, v, DType::kF32);
}

int64_t last_dim(const ConstTensorView& v) {
  return v.shape.ndim() ? v.shape[v.shape.ndim() - 1] : 1;
}

// rows of a [..., C] view
int64_t rows(const ConstTensorView& v) {
  const int64_t c = last_dim(v);
  return c ? v.numel() / c : 0;
}

bool is_vector(const ConstTensorView& v, int64_t n) {
  return v.shape.ndim() == 1 && v.shape[0] == n;
}

// Same leading dims as `ref`, last dim `last`.
bool same_rows(const ConstTensorView& v, const ConstTensorView& ref, int64_t last) {
  if (v.shape.ndim() != ref.shape.ndim() || v.shape.ndim() == 0) return false;
  for (int i = 0; i + 1 < v.shape.ndim(); ++i)
    if (v.shape[i] != ref.shape[i]) return false;
  return last_dim(v) == last;
}

float* f32(const TensorView& v) { return static_cast<float*>(v.data); }
const float* f32(const ConstTensorView& v) { return static_cast<const float*>(v.data); }
const int32_t* i32(const ConstTensorView& v) { return static_cast<const int32_t*>(v.data); }

}  // namespace

// ---- elementwise / utility ------------------------------------------------------------------

namespace {
// The matmul family's rule for a 16-bit path's first tensor (defined with it below): f32, f16 or
// bf16, on the stream's device. Its dtype is the call's activation dtype (ops.h).
void check_in_type(Stream& s, const char* op, const char* name, const ConstTensorView& v);
// A parameter beside activations of `in`'s dtype (bias, wpe): f32 or that dtype.
void check_out_type(Stream& s, const char* op, const char* name, const ConstTensorView& v, DType in);
}  // namespace

void fill(Stream& s, TensorView x, float value) {
  check_in_type(s, "fill", "x", x);
  const int64_t n = x.numel();
  if (n == 0) return;
  require_kernel(s, OpId::kFill, {x.dtype}).fill(s, x.data, x.dtype, n, value);
}

void scale(Stream& s, TensorView x, float alpha) {
  check_f32(s, "scale", "x", x);
  const int64_t n = x.numel();
  if (n == 0) return;
  f32_kernel(s, OpId::kScale).scale(s, f32(x), n, alpha);
}

void add(Stream& s, TensorView out, ConstTensorView a, ConstTensorView b) {
  check_in_type(s, "add", "out", out);
  const DType dt = out.dtype;
  check_view(s, "add", "a", a, dt);
  check_view(s, "add", "b", b, dt);
  ZT_REQUIRE(a.numel() == out.numel() && b.numel() == out.numel(), "add: out ", out.shape.str(),
             " but a ", a.shape.str(), " and b ", b.shape.str(), " (element counts must match)");
  const int64_t n = out.numel();
  if (n == 0) return;
  require_kernel(s, OpId::kAdd, {dt}).add(s, out.data, a.data, b.data, dt, n);
}

void cast(Stream& s, TensorView dst, ConstTensorView src) {
  ZT_REQUIRE(dst.dtype != DType::kI32 && src.dtype != DType::kI32,
             "cast: converts between f32, f16 and bf16, not ", dtype_name(src.dtype), " -> ",
             dtype_name(dst.dtype));
  check_view(s, "cast", "dst", dst, dst.dtype);
  check_view(s, "cast", "src", src, src.dtype);
  ZT_REQUIRE(dst.numel() == src.numel(), "cast: dst ", dst.shape.str(), " but src ",
             src.shape.str(), " (element counts must match)");
  const int64_t n = dst.numel();
  if (n == 0) return;
  const DType dt = dst.dtype, st = src.dtype;
  if (const OpTable* t = find_kernel(s, OpId::kCast)) {
    t->cast(s, dst.data, dt, src.data, st, n);
  } else if (dt == st) {
    // Fallback: a conversion to the same type is a copy, which every stream has.
    s.copy(dst.data, src.data, static_cast<size_t>(n) * dtype_size(dt));
  } else {
    refuse_op(s, OpId::kCast, {dt, st});
  }
}

void accumulate(Stream& s, TensorView dst, ConstTensorView src) {
  ZT_REQUIRE(dst.dtype == DType::kF32 || dst.dtype == DType::kF16 || dst.dtype == DType::kBF16,
             "accumulate: dst ", dst.shape.str(), " is ", dtype_name(dst.dtype),
             " but must be fp32, fp16 or bf16");
  check_view(s, "accumulate", "dst", dst, dst.dtype);
  check_view(s, "accumulate", "src", src, dst.dtype);
  ZT_REQUIRE(dst.numel() == src.numel(), "accumulate: dst ", dst.shape.str(), " but src ",
             src.shape.str(), " (element counts must match)");
  const int64_t n = dst.numel();
  if (n == 0) return;
  const DType t = dst.dtype;
  if (const OpTable* k = find_kernel(s, OpId::kAccumulate)) {
    k->accumulate(s, dst.data, src.data, t, n);
  } else if (const OpTable* a = t == DType::kF32 ? find_kernel(s, OpId::kAdd) : nullptr) {
    // Fallback: in fp32, accumulate is add(dst, dst, src), bit for bit (ops.h).
    a->add(s, dst.data, dst.data, src.data, t, n);
  } else {
    refuse_op(s, OpId::kAccumulate, {t});
  }
}

void accumulate_peer(Stream& s, TensorView dst, ConstTensorView src) {
  ZT_REQUIRE(dst.dtype == DType::kF32 || dst.dtype == DType::kF16 || dst.dtype == DType::kBF16,
             "accumulate_peer: dst ", dst.shape.str(), " is ", dtype_name(dst.dtype),
             " but must be fp32, fp16 or bf16");
  check_view(s, "accumulate_peer", "dst", dst, dst.dtype);
  // src lives on a peer device: only its type and storage are checked here.
  ZT_REQUIRE(src.dtype == dst.dtype, "accumulate_peer: src ", src.shape.str(), " is ",
             dtype_name(src.dtype), " but must be ", dtype_name(dst.dtype));
  ZT_REQUIRE(src.data != nullptr || src.numel() == 0, "accumulate_peer: src ", src.shape.str(),
             " has no data");
  ZT_REQUIRE(dst.numel() == src.numel(), "accumulate_peer: dst ", dst.shape.str(), " but src ",
             src.shape.str(), " (element counts must match)");
  const int64_t n = dst.numel();
  if (n == 0) return;
  const DType t = dst.dtype;
  require_kernel(s, OpId::kAccumulatePeer, {t}).accumulate_peer(s, dst.data, src.data, t, n);
}

// ---- encoder and position embedding ------------------------------------------------------------

namespace {

// The vocabulary total of a shard of `rows` rows (total 0 = the shard is the whole vocabulary).
int64_t check_vocab(const char* op, const VocabRange& vocab, const char* table,
                    const ConstTensorView& t, int64_t rows) {
  if (vocab.total == 0) {
    ZT_REQUIRE(vocab.begin == 0, op, ": vocab begin ", vocab.begin, " needs a vocab total (", table,
               " ", t.shape.str(), " is a shard only when total > 0)");
    return rows;
  }
  // Padding (ids >= total) may fill the shard's tail or all of it (a padded vocabulary).
  ZT_REQUIRE(vocab.begin >= 0 && vocab.total > 0, op, ": ", table, " ", t.shape.str(), " as the vocabulary rows [",
             vocab.begin, ", ", vocab.begin + rows, ") is not a shard of a vocabulary of ", vocab.total);
  return vocab.total;
}

struct EncoderDims {
  int64_t B, T, C, V, total;
};
// x (out or dout) of the activation dtype; wte/wpe (or dwte/dwpe) of `table_dtype`: x's dtype
// forward, fp32 (parameter gradients) backward.
EncoderDims check_encoder(Stream& s, const char* op, const ConstTensorView& x, const char* x_name,
                          const ConstTensorView& tokens, const ConstTensorView& wte,
                          const char* wte_name, const ConstTensorView& wpe, const char* wpe_name,
                          const VocabRange& vocab, bool table_is_activation) {
  check_in_type(s, op, x_name, x);
  const DType table_dtype = table_is_activation ? x.dtype : DType::kF32;
  check_view(s, op, "tokens", tokens, DType::kI32);
  check_view(s, op, wte_name, wte, table_dtype);
  ZT_REQUIRE(tokens.shape.ndim() == 2, op, ": tokens ", tokens.shape.str(), " must be [B, T]");
  ZT_REQUIRE(wte.shape.ndim() == 2, op, ": ", wte_name, " ", wte.shape.str(), " must be [V, C]");
  const EncoderDims d{tokens.shape[0], tokens.shape[1], wte.shape[1], wte.shape[0],
                      check_vocab(op, vocab, wte_name, wte, wte.shape[0])};
  if (present(wpe)) {
    check_view(s, op, wpe_name, wpe, table_dtype);
    ZT_REQUIRE(wpe.shape.ndim() == 2 && wpe.shape[1] == d.C, op, ": ", wte_name, " ",
               wte.shape.str(), " and ", wpe_name, " ", wpe.shape.str(),
               " must be [V, C] and [maxT, C]");
    ZT_REQUIRE(d.T <= wpe.shape[0], op, ": tokens ", tokens.shape.str(), " has T = ", d.T, " but ",
               wpe_name, " ", wpe.shape.str(), " holds only ", wpe.shape[0], " positions");
  }
  ZT_REQUIRE(x.shape == (Shape{d.B, d.T, d.C}), op, ": ", x_name, " ", x.shape.str(),
             " but tokens ", tokens.shape.str(), " and ", wte_name, " ", wte.shape.str(), " need ",
             Shape{d.B, d.T, d.C}.str());
  return d;
}

// x [R, C] (rows of [..., C]) of the activation dtype against wpe [maxT, C]: f32 or x's dtype
// forward (a parameter), f32 backward (a parameter gradient, wpe_is_grad). Returns R.
int64_t check_position(Stream& s, const char* op, const ConstTensorView& x, const char* x_name,
                       const ConstTensorView& wpe, const char* wpe_name, int64_t row0, int64_t T,
                       bool wpe_is_grad) {
  check_in_type(s, op, x_name, x);
  if (wpe_is_grad)
    check_f32(s, op, wpe_name, wpe);
  else
    check_out_type(s, op, wpe_name, wpe, x.dtype);
  ZT_REQUIRE(wpe.shape.ndim() == 2 && x.shape.ndim() >= 1 && last_dim(x) == wpe.shape[1], op, ": ",
             x_name, " ", x.shape.str(), " and ", wpe_name, " ", wpe.shape.str(),
             " must be [..., C] and [maxT, C]");
  ZT_REQUIRE(T >= 1 && T <= wpe.shape[0] && row0 >= 0, op, ": T = ", T, " and row0 = ", row0,
             " with ", wpe_name, " ", wpe.shape.str(), " (need 1 <= T <= ", wpe.shape[0],
             " and row0 >= 0)");
  return rows(x);
}

}  // namespace

void encoder_forward(Stream& s, TensorView out, ConstTensorView tokens, ConstTensorView wte,
                     ConstTensorView wpe, VocabRange vocab) {
  const EncoderDims d = check_encoder(s, "encoder_forward", out, "out", tokens, wte, "wte", wpe, "wpe", vocab,
                                      /*table_is_activation=*/true);
  if (out.numel() == 0) return;
  require_kernel(s, OpId::kEncoderForward, {out.dtype})
      .encoder_forward(s, out.data, i32(tokens), wte.data, present(wpe) ? wpe.data : nullptr, out.dtype, d.B,
                       d.T, d.C, d.V, vocab.begin, d.total);
}

void encoder_backward(Stream& s, TensorView dwte, TensorView dwpe, ConstTensorView dout,
                      ConstTensorView tokens, VocabRange vocab) {
  const EncoderDims d = check_encoder(s, "encoder_backward", dout, "dout", tokens, dwte, "dwte",
                                      dwpe, "dwpe", vocab, /*table_is_activation=*/false);
  if (dout.numel() == 0) return;
  require_kernel(s, OpId::kEncoderBackward, {dout.dtype})
      .encoder_backward(s, f32(dwte), present(dwpe) ? f32(dwpe) : nullptr, dout.data, dout.dtype, i32(tokens),
                        d.B, d.T, d.C, d.V, vocab.begin, d.total);
}

void position_forward(Stream& s, TensorView x, ConstTensorView wpe, int64_t row0, int64_t T) {
  const int64_t R = check_position(s, "position_forward", x, "x", wpe, "wpe", row0, T, /*wpe_is_grad=*/false);
  if (x.numel() == 0) return;
  require_kernel(s, OpId::kPositionForward, {x.dtype, wpe.dtype})
      .position_forward(s, x.data, wpe.data, x.dtype, wpe.dtype, R, last_dim(x), row0, T);
}

void position_backward(Stream& s, TensorView dwpe, ConstTensorView dx, int64_t row0, int64_t T) {
  const int64_t R = check_position(s, "position_backward", dx, "dx", dwpe, "dwpe", row0, T, /*wpe_is_grad=*/true);
  if (dx.numel() == 0) return;
  require_kernel(s, OpId::kPositionBackward, {dx.dtype})
      .position_backward(s, f32(dwpe), dx.data, dx.dtype, R, last_dim(dx), row0, T);
}

// ---- layernorm
// -----------------------------------------------------------------------------------

namespace {

// The matmul family's dtype checks (defined with it below), shared by the layernorm family and the
// LM head: an activation dtype of f32, f16 or bf16, and parameters of f32 or that dtype.
void check_in_type(Stream& s, const char* op, const char* name, const ConstTensorView& v);
void check_same_type(Stream& s, const char* op, const char* name, const ConstTensorView& v, DType in);
void check_out_type(Stream& s, const char* op, const char* name, const ConstTensorView& v, DType in);

// weight and bias (or dweight's partner weight alone: bias empty) of a layernorm over C columns of
// activations `act`: one dtype, f32 or act. Returns it.
DType check_norm_params(Stream& s, const char* op, const ConstTensorView& weight, const ConstTensorView* bias,
                        DType act) {
  check_out_type(s, op, "weight", weight, act);
  if (bias != nullptr) check_same_type(s, op, "bias", *bias, weight.dtype);
  return weight.dtype;
}

}  // namespace

void layernorm_forward(Stream& s, TensorView out, TensorView mean, TensorView rstd,
                       ConstTensorView in, ConstTensorView weight, ConstTensorView bias,
                       float eps) {
  constexpr const char* op = "layernorm_forward";
  check_in_type(s, op, "in", in);
  const DType act = in.dtype;
  check_same_type(s, op, "out", out, act);
  const DType wt = check_norm_params(s, op, weight, &bias, act);
  check_f32(s, op, "mean", mean);
  check_f32(s, op, "rstd", rstd);
  const int64_t C = last_dim(in), N = rows(in);
  ZT_REQUIRE(in.shape.ndim() >= 1 && C > 0, op, ": in ", in.shape.str(),
             " must be [..., C], C > 0");
  ZT_REQUIRE(out.shape == in.shape, op, ": in ", in.shape.str(), " but out ", out.shape.str());
  ZT_REQUIRE(is_vector(weight, C) && is_vector(bias, C), op, ": in ", in.shape.str(),
             " but weight ", weight.shape.str(), " and bias ", bias.shape.str(), " (need [", C,
             "])");
  ZT_REQUIRE(mean.numel() == N && rstd.numel() == N, op, ": in ", in.shape.str(), " has ", N,
             " rows but mean ", mean.shape.str(), " and rstd ", rstd.shape.str());
  ZT_REQUIRE(eps >= 0.0f, op, ": eps ", eps, " must be >= 0");
  if (N == 0) return;
  require_kernel(s, OpId::kLayernormForward, {act, wt})
      .layernorm_forward(s, out.data, f32(mean), f32(rstd), in.data, act, weight.data, bias.data, wt, N, C, eps);
}

void layernorm_backward(Stream& s, TensorView din, TensorView dweight, TensorView dbias,
                        ConstTensorView dout, ConstTensorView in, ConstTensorView weight,
                        ConstTensorView mean, ConstTensorView rstd) {
  constexpr const char* op = "layernorm_backward";
  check_in_type(s, op, "in", in);
  const DType act = in.dtype;
  check_same_type(s, op, "din", din, act);
  check_same_type(s, op, "dout", dout, act);
  const DType wt = check_norm_params(s, op, weight, nullptr, act);
  for (auto [name, v] : {std::pair<const char*, ConstTensorView>{"dweight", dweight},
                         {"dbias", dbias},
                         {"mean", mean},
                         {"rstd", rstd}})
    check_f32(s, op, name, v);
  const int64_t C = last_dim(in), N = rows(in);
  ZT_REQUIRE(in.shape.ndim() >= 1 && C > 0, op, ": in ", in.shape.str(),
             " must be [..., C], C > 0");
  ZT_REQUIRE(din.shape == in.shape && dout.shape == in.shape, op, ": in ", in.shape.str(),
             " but din ", din.shape.str(), " and dout ", dout.shape.str());
  ZT_REQUIRE(is_vector(weight, C) && is_vector(dweight, C) && is_vector(dbias, C), op, ": in ",
             in.shape.str(), " but weight ", weight.shape.str(), ", dweight ", dweight.shape.str(),
             " and dbias ", dbias.shape.str(), " (need [", C, "])");
  ZT_REQUIRE(mean.numel() == N && rstd.numel() == N, op, ": in ", in.shape.str(), " has ", N,
             " rows but mean ", mean.shape.str(), " and rstd ", rstd.shape.str());
  if (N == 0) return;
  require_kernel(s, OpId::kLayernormBackward, {act, wt})
      .layernorm_backward(s, din.data, f32(dweight), f32(dbias), dout.data, in.data, act, weight.data, wt,
                          f32(mean), f32(rstd), N, C);
}

// ---- matmul
// ----------------------------------------------------------------------------------------

namespace {

bool is_16bit(DType t) { return t == DType::kF16 || t == DType::kBF16; }

// The matmul family's dtype rules (ops.h): `in` f32 or 16-bit; the outputs f32 or `in`'s type.
void check_in_type(Stream& s, const char* op, const char* name, const ConstTensorView& v) {
  ZT_REQUIRE(v.dtype == DType::kF32 || is_16bit(v.dtype), op, ": ", name, " ", v.shape.str(), " is ",
             dtype_name(v.dtype), " but must be fp32, fp16 or bf16");
  check_view(s, op, name, v, v.dtype);
}
void check_same_type(Stream& s, const char* op, const char* name, const ConstTensorView& v, DType in) {
  check_view(s, op, name, v, in);
}
// f32 or `in` (the dtype the GEMM's C/D or bias may take).
void check_out_type(Stream& s, const char* op, const char* name, const ConstTensorView& v, DType in) {
  ZT_REQUIRE(v.dtype == DType::kF32 || v.dtype == in, op, ": ", name, " ", v.shape.str(), " is ",
             dtype_name(v.dtype), " but must be fp32", in == DType::kF32 ? "" : " or ",
             in == DType::kF32 ? "" : dtype_name(in), " (in is ", dtype_name(in), ")");
  check_view(s, op, name, v, v.dtype);
}

// weight [OC, C] against in [..., C]; returns {N, C, OC}.
struct GemmDims {
  int64_t N, C, OC;
};
GemmDims check_weight(const char* op, const ConstTensorView& weight, const ConstTensorView& in,
                      const char* in_name) {
  ZT_REQUIRE(weight.shape.ndim() == 2, op, ": weight ", weight.shape.str(), " must be [OC, C]");
  const int64_t OC = weight.shape[0], C = weight.shape[1];
  ZT_REQUIRE(C > 0 && in.shape.ndim() >= 1 && last_dim(in) == C, op, ": ", in_name, " ", in.shape.str(),
             " but weight ", weight.shape.str(), " (", in_name, " must be [..., ", C, "])");
  return {rows(in), C, OC};
}

const OpTable& matmul_kernel(Stream& s, OpId op, MatmulTypes t) {
  return require_kernel(s, op, {t.in, t.out, t.bias});
}

std::atomic<uint64_t> g_gemm_tiles_checked{0};

// MathMode::gemm_tiles (ops.h): a 16-bit GEMM's dimensions multiples of 8, its operands 16-byte
// aligned. `dims` are the GEMM's M/N/K (and the LM head's logits row length), `operands` its
// tensors (empty views skipped).
void check_gemm_tiles(Stream& s, const char* op, DType in, std::initializer_list<std::pair<const char*, int64_t>> dims,
                      std::initializer_list<std::pair<const char*, ConstTensorView>> operands) {
  if (!is_16bit(in) || !s.device().math_mode().gemm_tiles) return;
  std::string shape, odd;
  for (const auto& [name, n] : dims) {
    shape += std::string(shape.empty() ? "" : ", ") + name + " " + std::to_string(n);
    if (n % kGemmTileMultiple != 0) odd += std::string(odd.empty() ? "" : ", ") + name + " " + std::to_string(n);
  }
  ZT_REQUIRE(odd.empty(), op, ": a ", dtype_name(in), " GEMM of ", shape, " has ", odd,
             ", not a multiple of ", kGemmTileMultiple, "; 16-bit GEMMs must run on whole tensor-core tiles "
             "(pad the shape: the GPT pads its vocabulary to a multiple of 128, widths and token counts must be "
             "multiples of 8)");
  for (const auto& [name, v] : operands)
    ZT_REQUIRE(v.data == nullptr || reinterpret_cast<uintptr_t>(v.data) % kGemmTileAlignBytes == 0, op, ": ", name, " ",
               v.shape.str(), " of a ", dtype_name(in), " GEMM of ", shape, " starts at an address that is not ",
               kGemmTileAlignBytes, "-byte aligned; 16-bit GEMMs must have aligned operands for tensor-core loads");
  g_gemm_tiles_checked.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

uint64_t gemm_tiles_checked() { return g_gemm_tiles_checked.load(std::memory_order_relaxed); }

void matmul_forward(Stream& s, TensorView out, ConstTensorView in, ConstTensorView weight,
                    ConstTensorView bias) {
  constexpr const char* op = "matmul_forward";
  check_in_type(s, op, "in", in);
  const MatmulTypes t{in.dtype, out.dtype, present(bias) ? bias.dtype : DType::kF32};
  check_same_type(s, op, "weight", weight, t.in);
  check_out_type(s, op, "out", out, t.in);
  if (present(bias)) check_out_type(s, op, "bias", bias, t.in);
  const GemmDims d = check_weight(op, weight, in, "in");
  ZT_REQUIRE(same_rows(out, in, d.OC), op, ": in ", in.shape.str(), " and weight ",
             weight.shape.str(), " but out ", out.shape.str());
  ZT_REQUIRE(!present(bias) || is_vector(bias, d.OC), op, ": weight ", weight.shape.str(),
             " but bias ", bias.shape.str());
  if (d.N == 0 || d.OC == 0) return;
  check_gemm_tiles(s, op, t.in, {{"N", d.N}, {"C", d.C}, {"OC", d.OC}},
                   {{"in", in}, {"weight", weight}, {"out", out}, {"bias", bias}});
  matmul_kernel(s, OpId::kMatmulForward, t)
      .matmul_forward(s, out.data, in.data, weight.data, present(bias) ? bias.data : nullptr, t, d.N, d.C, d.OC);
}

void matmul_backward(Stream& s, TensorView din, TensorView dweight, TensorView dbias,
                     ConstTensorView dout, ConstTensorView in, ConstTensorView weight, bool overwrite_din) {
  constexpr const char* op = "matmul_backward";
  check_in_type(s, op, "in", in);
  const MatmulTypes t{in.dtype, present(din) ? din.dtype : DType::kF32, DType::kF32};
  if (present(din)) check_out_type(s, op, "din", din, t.in);
  if (present(dweight)) check_f32(s, op, "dweight", dweight);
  if (present(dbias)) check_f32(s, op, "dbias", dbias);
  check_same_type(s, op, "dout", dout, t.in);
  check_same_type(s, op, "weight", weight, t.in);
  const GemmDims d = check_weight(op, weight, in, "in");
  ZT_REQUIRE(same_rows(dout, in, d.OC), op, ": in ", in.shape.str(), " and weight ",
             weight.shape.str(), " but dout ", dout.shape.str());
  ZT_REQUIRE(!present(din) || din.shape == in.shape, op, ": in ", in.shape.str(), " but din ",
             din.shape.str());
  ZT_REQUIRE(!present(dweight) || dweight.shape == weight.shape, op, ": weight ", weight.shape.str(),
             " but dweight ", dweight.shape.str());
  ZT_REQUIRE(!present(dbias) || is_vector(dbias, d.OC), op, ": weight ", weight.shape.str(),
             " but dbias ", dbias.shape.str());
  if (d.N == 0 || d.OC == 0) return;
  check_gemm_tiles(s, op, t.in, {{"N", d.N}, {"C", d.C}, {"OC", d.OC}},
                   {{"din", din}, {"dweight", dweight}, {"dbias", dbias}, {"dout", dout}, {"in", in}, {"weight", weight}});
  matmul_kernel(s, OpId::kMatmulBackward, t)
      .matmul_backward(s, present(din) ? din.data : nullptr, present(dweight) ? f32(dweight) : nullptr,
                       present(dbias) ? f32(dbias) : nullptr, dout.data, in.data, weight.data, t, d.N, d.C, d.OC,
                       overwrite_din);
}

// The fused ops' fallbacks compose the unfused ops through the table. 16-bit outputs go through
// one fp32 scratch from the device pool (stream-ordered: freed after the launches, reused only by
// later work on this stream), so the rounding points are those of the fused kernels.
void matmul_gelu_forward(Stream& s, TensorView out_gelu, TensorView pre_gelu, ConstTensorView in,
                         ConstTensorView weight, ConstTensorView bias) {
  constexpr const char* op = "matmul_gelu_forward";
  check_in_type(s, op, "in", in);
  const MatmulTypes t{in.dtype, pre_gelu.dtype, present(bias) ? bias.dtype : DType::kF32};
  check_same_type(s, op, "weight", weight, t.in);
  check_out_type(s, op, "pre_gelu", pre_gelu, t.in);
  check_view(s, op, "out_gelu", out_gelu, t.out);
  if (present(bias)) check_out_type(s, op, "bias", bias, t.in);
  const GemmDims d = check_weight(op, weight, in, "in");
  ZT_REQUIRE(same_rows(pre_gelu, in, d.OC) && out_gelu.shape == pre_gelu.shape, op, ": in ", in.shape.str(),
             " and weight ", weight.shape.str(), " but pre_gelu ", pre_gelu.shape.str(), " and out_gelu ",
             out_gelu.shape.str());
  ZT_REQUIRE(!present(bias) || is_vector(bias, d.OC), op, ": weight ", weight.shape.str(), " but bias ",
             bias.shape.str());
  if (d.N == 0 || d.OC == 0) return;
  check_gemm_tiles(s, op, t.in, {{"N", d.N}, {"C", d.C}, {"OC", d.OC}},
                   {{"in", in}, {"weight", weight}, {"pre_gelu", pre_gelu}, {"out_gelu", out_gelu}, {"bias", bias}});
  const void* b = present(bias) ? bias.data : nullptr;
  if (const OpTable* k = find_kernel(s, OpId::kMatmulGeluForward)) {
    k->matmul_gelu_forward(s, out_gelu.data, pre_gelu.data, in.data, weight.data, b, t, d.N, d.C, d.OC);
    return;
  }
  const int64_t n = d.N * d.OC;
  if (t.out == DType::kF32) {
    matmul_kernel(s, OpId::kMatmulForward, t)
        .matmul_forward(s, pre_gelu.data, in.data, weight.data, b, t, d.N, d.C, d.OC);
    f32_kernel(s, OpId::kGeluForward).gelu_forward(s, out_gelu.data, pre_gelu.data, DType::kF32, n);
    return;
  }
  MatmulTypes wide = t;
  wide.out = DType::kF32;
  const OpTable& mm = matmul_kernel(s, OpId::kMatmulForward, wide);
  const OpTable& gelu = f32_kernel(s, OpId::kGeluForward);
  const OpTable& cast_k = require_kernel(s, OpId::kCast, {t.out, DType::kF32});
  // fp32 scratch: the GEMM's result and its GELU.
  DeviceBuffer acc(s.device().memory(), static_cast<size_t>(n) * 8, s, "matmul_gelu_forward fallback");
  float* a = acc.as<float>();
  mm.matmul_forward(s, a, in.data, weight.data, b, wide, d.N, d.C, d.OC);
  cast_k.cast(s, pre_gelu.data, t.out, a, DType::kF32, n);
  gelu.gelu_forward(s, a + n, a, DType::kF32, n);
  cast_k.cast(s, out_gelu.data, t.out, a + n, DType::kF32, n);
}

void matmul_backward_dgelu(Stream& s, TensorView dpre, TensorView dbias, ConstTensorView dout,
                           ConstTensorView weight, ConstTensorView pre_gelu) {
  constexpr const char* op = "matmul_backward_dgelu";
  check_in_type(s, op, "dout", dout);
  const MatmulTypes t{dout.dtype, dpre.dtype, DType::kF32};
  check_same_type(s, op, "weight", weight, t.in);
  check_out_type(s, op, "dpre", dpre, t.in);
  check_view(s, op, "pre_gelu", pre_gelu, t.out);
  if (present(dbias)) check_f32(s, op, "dbias", dbias);
  ZT_REQUIRE(weight.shape.ndim() == 2, op, ": weight ", weight.shape.str(), " must be [OC, C]");
  const int64_t OC = weight.shape[0], C = weight.shape[1];
  ZT_REQUIRE(OC > 0 && dout.shape.ndim() >= 1 && last_dim(dout) == OC, op, ": dout ", dout.shape.str(),
             " but weight ", weight.shape.str(), " (dout must be [..., ", OC, "])");
  ZT_REQUIRE(same_rows(dpre, dout, C) && pre_gelu.shape == dpre.shape, op, ": dout ", dout.shape.str(),
             " and weight ", weight.shape.str(), " but dpre ", dpre.shape.str(), " and pre_gelu ",
             pre_gelu.shape.str());
  ZT_REQUIRE(!present(dbias) || is_vector(dbias, C), op, ": weight ", weight.shape.str(), " but dbias ",
             dbias.shape.str());
  const int64_t N = rows(dout);
  if (N == 0 || C == 0) return;
  check_gemm_tiles(s, op, t.in, {{"N", N}, {"C", C}, {"OC", OC}},
                   {{"dpre", dpre}, {"dbias", dbias}, {"dout", dout}, {"weight", weight}, {"pre_gelu", pre_gelu}});
  float* db = present(dbias) ? f32(dbias) : nullptr;
  if (const OpTable* k = find_kernel(s, OpId::kMatmulBackwardDgelu)) {
    k->matmul_backward_dgelu(s, dpre.data, db, dout.data, weight.data, pre_gelu.data, t, N, C, OC);
    return;
  }
  // dgrad = dout @ weight into a zeroed fp32 buffer (matmul_backward's din, no dweight: `in` is
  // not read), then dpre = 0 + gelu'(pre) * dgrad: the bits of the unfused ops for f32.
  const int64_t n = N * C;
  MatmulTypes wide = t;
  wide.out = DType::kF32;
  const OpTable& mm = matmul_kernel(s, OpId::kMatmulBackward, wide);
  const OpTable& fill_k = f32_kernel(s, OpId::kFill);
  const OpTable& gelu = f32_kernel(s, OpId::kGeluBackward);
  const OpTable* cast_k = t.out == DType::kF32 ? nullptr : &require_kernel(s, OpId::kCast, {DType::kF32, t.out});
  const OpTable* bias_k = db != nullptr ? &require_kernel(s, OpId::kBiasBackward, {t.out}) : nullptr;
  const bool wide_out = t.out == DType::kF32;
  // fp32 scratch: dgrad, and for a 16-bit dpre also the widened pre_gelu and the fp32 dpre.
  DeviceBuffer scratch(s.device().memory(), static_cast<size_t>(n) * 4 * (wide_out ? 1 : 3), s,
                       "matmul_backward_dgelu fallback");
  float* dgrad = scratch.as<float>();
  fill_k.fill(s, dgrad, DType::kF32, n, 0.0f);
  mm.matmul_backward(s, dgrad, nullptr, nullptr, dout.data, nullptr, weight.data, wide, N, C, OC, false);
  const float* pre = wide_out ? f32(pre_gelu) : dgrad + n;
  float* d32 = wide_out ? f32(dpre) : dgrad + 2 * n;
  if (!wide_out) cast_k->cast(s, dgrad + n, DType::kF32, pre_gelu.data, t.out, n);
  fill_k.fill(s, d32, DType::kF32, n, 0.0f);
  gelu.gelu_backward(s, d32, pre, dgrad, DType::kF32, n);
  if (!wide_out) cast_k->cast(s, dpre.data, t.out, d32, DType::kF32, n);
  if (bias_k != nullptr) bias_k->bias_backward(s, db, dpre.data, t.out, N, C);  // the stored dpre's column sums
}

// ---- bias --------------------------------------------------------------------------------------

namespace {
// x [..., C] of the activation dtype against bias [C]: f32 or x's dtype forward (a parameter), f32
// backward (a parameter gradient, bias_is_grad). Returns the row count.
int64_t check_bias(Stream& s, const char* op, const ConstTensorView& x, const char* x_name,
                   const ConstTensorView& bias, const char* bias_name, bool bias_is_grad) {
  check_in_type(s, op, x_name, x);
  if (bias_is_grad)
    check_f32(s, op, bias_name, bias);
  else
    check_out_type(s, op, bias_name, bias, x.dtype);
  ZT_REQUIRE(x.shape.ndim() >= 1 && is_vector(bias, last_dim(x)), op, ": ", x_name, " ",
             x.shape.str(), " but ", bias_name, " ", bias.shape.str(), " (need [",
             x.shape.ndim() ? last_dim(x) : 0, "])");
  return rows(x);
}
}  // namespace

void bias_forward(Stream& s, TensorView x, ConstTensorView bias) {
  const int64_t N = check_bias(s, "bias_forward", x, "x", bias, "bias", /*bias_is_grad=*/false);
  if (x.numel() == 0) return;
  require_kernel(s, OpId::kBiasForward, {x.dtype, bias.dtype})
      .bias_forward(s, x.data, bias.data, x.dtype, bias.dtype, N, last_dim(x));
}

void bias_backward(Stream& s, TensorView dbias, ConstTensorView dout) {
  const int64_t N = check_bias(s, "bias_backward", dout, "dout", dbias, "dbias", /*bias_is_grad=*/true);
  if (dout.numel() == 0) return;
  require_kernel(s, OpId::kBiasBackward, {dout.dtype})
      .bias_backward(s, f32(dbias), dout.data, dout.dtype, N, last_dim(dout));
}

// ---- attention
// --------------------------------------------------------------------------------------

namespace {
struct AttentionDims {
  int64_t B, T, C, NH;
};
AttentionDims check_attention(const char* op, const ConstTensorView& qkv, int num_heads,
                              std::initializer_list<std::pair<const char*, ConstTensorView>> btc,
                              std::initializer_list<std::pair<const char*, ConstTensorView>> bhtt) {
  ZT_REQUIRE(qkv.shape.ndim() == 3 && qkv.shape[2] % 3 == 0 && qkv.shape[2] > 0, op, ": qkv ",
             qkv.shape.str(), " must be [B, T, 3C]");
  const AttentionDims d{qkv.shape[0], qkv.shape[1], qkv.shape[2] / 3, num_heads};
  ZT_REQUIRE(num_heads > 0 && d.C % num_heads == 0, op, ": qkv ", qkv.shape.str(), " has C = ", d.C,
             ", which ", num_heads, " heads do not divide");
  for (const auto& [name, v] : btc)
    ZT_REQUIRE(v.shape == (Shape{d.B, d.T, d.C}), op, ": qkv ", qkv.shape.str(), " but ", name, " ",
               v.shape.str(), " (need ", Shape{d.B, d.T, d.C}.str(), ")");
  for (const auto& [name, v] : bhtt)
    ZT_REQUIRE(v.shape == (Shape{d.B, d.NH, d.T, d.T}), op, ": qkv ", qkv.shape.str(), " with ",
               num_heads, " heads but ", name, " ", v.shape.str(), " (need ",
               Shape{d.B, d.NH, d.T, d.T}.str(), ")");
  return d;
}
}  // namespace

void attention_forward(Stream& s, TensorView out, TensorView preatt, TensorView att,
                       ConstTensorView qkv, int num_heads) {
  constexpr const char* op = "attention_forward";
  for (auto [name, v] : {std::pair<const char*, ConstTensorView>{"out", out},
                         {"preatt", preatt},
                         {"att", att},
                         {"qkv", qkv}})
    check_f32(s, op, name, v);
  const AttentionDims d =
      check_attention(op, qkv, num_heads, {{"out", out}}, {{"preatt", preatt}, {"att", att}});
  if (d.B * d.T == 0) return;
  f32_kernel(s, OpId::kAttentionForward).attention_forward(s, f32(out), f32(preatt), f32(att), f32(qkv), d.B, d.T, d.C,
               d.NH);
}

void attention_backward(Stream& s, TensorView dqkv, TensorView dpreatt, TensorView datt,
                        ConstTensorView dout, ConstTensorView qkv, ConstTensorView att,
                        int num_heads) {
  constexpr const char* op = "attention_backward";
  for (auto [name, v] : {std::pair<const char*, ConstTensorView>{"dqkv", dqkv},
                         {"dpreatt", dpreatt},
                         {"datt", datt},
                         {"dout", dout},
                         {"qkv", qkv},
                         {"att", att}})
    check_f32(s, op, name, v);
  const AttentionDims d = check_attention(op, qkv, num_heads, {{"dout", dout}},
                                          {{"dpreatt", dpreatt}, {"datt", datt}, {"att", att}});
  ZT_REQUIRE(dqkv.shape == qkv.shape, op, ": qkv ", qkv.shape.str(), " but dqkv ",
             dqkv.shape.str());
  if (d.B * d.T == 0) return;
  f32_kernel(s, OpId::kAttentionBackward).attention_backward(s, f32(dqkv), f32(dpreatt), f32(datt), f32(dout), f32(qkv),
               f32(att), d.B, d.T, d.C, d.NH);
}

size_t flash_attention_scratch_bytes(int64_t B, int64_t T, int64_t /*C*/, int64_t NH) {
  return static_cast<size_t>(B * NH * T) * sizeof(float);
}

void require_cuda_attention_shape(int64_t C, int64_t NH) {
  ZT_REQUIRE(NH >= 1 && C % NH == 0, "a width of ", C, " does not split into ", NH, " heads");
  const int64_t hs = C / NH;
  if (hs > kCudaMaxHeadSize) {
    int64_t fewest = (C + kCudaMaxHeadSize - 1) / kCudaMaxHeadSize;  // the fewest heads that divide C
    while (C % fewest != 0) ++fewest;
    ZT_THROW(ErrorKind::kInvalidArgument, "the model's heads are ", hs, " wide (", C, " / ", NH,
             " heads), above the ", kCudaMaxHeadSize, " that the CUDA attention kernels take; use --heads ", fewest,
             " or more (a divisor of ", C, "), or the CPU backend");
  }
  ZT_REQUIRE(NH <= kCudaMaxGridHeads, "the model has ", NH, " heads, above the ", kCudaMaxGridHeads,
             " that the CUDA attention kernels take (one grid row per head); use fewer, wider heads (--heads)");
}

size_t cudnn_attention_workspace_formula(int64_t B, int64_t T, int64_t C, int64_t NH, bool deterministic) {
  const auto rows = static_cast<size_t>(B * NH);
  if (deterministic) {
    const auto t64 = static_cast<size_t>((T + 63) / 64 * 64), t128 = static_cast<size_t>((T + 127) / 128 * 128);
    return rows * (2 * t64 * t128 + 4 * static_cast<size_t>(T));
  }
  return rows * static_cast<size_t>(T) * static_cast<size_t>(C / NH + 1) * 4;
}

namespace {
size_t round_up_256(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
bool library_dtype(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }
std::atomic<size_t> g_gemm_attention_chunk_bytes{kGemmAttentionChunkBytes};
std::atomic<int64_t> g_gemm_attention_row_splits{1};
std::atomic<uint64_t> g_stream_block_generation{0};
}  // namespace

uint64_t stream_block_generation() { return g_stream_block_generation.load(std::memory_order_acquire); }
void note_stream_block_replaced() { g_stream_block_generation.fetch_add(1, std::memory_order_acq_rel); }

int64_t gemm_attention_row_splits() { return g_gemm_attention_row_splits.load(std::memory_order_relaxed); }
void set_gemm_attention_row_splits(int64_t splits) {
  g_gemm_attention_row_splits.store(std::max<int64_t>(splits, 1), std::memory_order_relaxed);
}

size_t gemm_attention_chunk_bytes() { return g_gemm_attention_chunk_bytes.load(std::memory_order_relaxed); }
void set_gemm_attention_chunk_bytes(size_t bytes) {
  g_gemm_attention_chunk_bytes.store(bytes == 0 ? kGemmAttentionChunkBytes : bytes, std::memory_order_relaxed);
}

int64_t gemm_attention_heads_per_chunk(int64_t T, int64_t NH) {
  const auto per_head = static_cast<size_t>(T) * static_cast<size_t>(T) * sizeof(float);
  return std::clamp<int64_t>(static_cast<int64_t>(gemm_attention_chunk_bytes() / std::max<size_t>(per_head, 1)), 1,
                             NH);
}

AttentionWorkspace gemm_attention_workspace(int64_t T, int64_t NH) {
  const auto scores = static_cast<int64_t>(
      round_up_256(static_cast<size_t>(gemm_attention_heads_per_chunk(T, NH) * T * T) * sizeof(float)));
  return {scores, 2 * scores};
}

size_t flash_attention_library_bytes(int64_t B, int64_t T, int64_t C, DType dtype, const AttentionWorkspace& ws) {
  if (!library_dtype(dtype) || !ws.any()) return 0;
  const size_t workspace = round_up_256(static_cast<size_t>(std::max<int64_t>({ws.forward, ws.backward, 0})));
  if (dtype == DType::kF32) return workspace;
  return workspace + static_cast<size_t>(B * T * 3 * C) * dtype_size(dtype);
}

size_t flash_attention_library_bytes(int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype, bool deterministic) {
  const AttentionWorkspace ws =
      dtype == DType::kF32
          ? gemm_attention_workspace(T, NH)
          : AttentionWorkspace{0, static_cast<int64_t>(cudnn_attention_workspace_formula(B, T, C, NH, deterministic))};
  return flash_attention_library_bytes(B, T, C, dtype, ws);
}

std::optional<AttentionWorkspace> fused_attention_workspace(Stream& s, int64_t B, int64_t T, int64_t C, int64_t NH,
                                                            DType dtype, bool deterministic) {
  if (!library_dtype(dtype)) return std::nullopt;
  ZT_REQUIRE(B > 0 && T > 0 && NH > 0 && C % NH == 0, "fused_attention_workspace: B=", B, " T=", T, " C=", C,
             " heads=", NH, " is not an attention shape");
  const OpTable* t = op_table(s.device().backend());
  if (t == nullptr || t->fused_attention_workspace == nullptr) return std::nullopt;
  AttentionWorkspace ws;
  if (!t->fused_attention_workspace(s, B, T, C, NH, dtype, deterministic, &ws.forward, &ws.backward))
    return std::nullopt;
  return ws;
}

namespace {
// The activations' dtype of the tiled attention ops: f32, f16 or bf16 (ops.h).
DType attention_dtype(const char* op, const ConstTensorView& qkv) {
  ZT_REQUIRE(qkv.dtype == DType::kF32 || qkv.dtype == DType::kF16 || qkv.dtype == DType::kBF16, op,
             ": qkv ", qkv.shape.str(), " is ", dtype_name(qkv.dtype), " but must be fp32, fp16 or bf16");
  return qkv.dtype;
}
}  // namespace

void flash_attention_forward(Stream& s, TensorView out, TensorView lse, ConstTensorView qkv,
                             int num_heads) {
  constexpr const char* op = "flash_attention_forward";
  const DType dt = attention_dtype(op, qkv);
  check_view(s, op, "qkv", qkv, dt);
  check_view(s, op, "out", out, dt);
  check_f32(s, op, "lse", lse);
  const AttentionDims d = check_attention(op, qkv, num_heads, {{"out", out}}, {});
  ZT_REQUIRE(lse.shape == (Shape{d.B, d.NH, d.T}), op, ": qkv ", qkv.shape.str(), " with ",
             num_heads, " heads but lse ", lse.shape.str(), " (need ",
             Shape{d.B, d.NH, d.T}.str(), ")");
  if (d.B * d.T == 0) return;
  if (const OpTable* t = find_kernel(s, OpId::kFusedAttentionForward);
      t != nullptr && t->fused_attention_forward(s, out.data, f32(lse), qkv.data, d.B, d.T, d.C, d.NH, dt))
    return;
  require_kernel(s, OpId::kFlashAttentionForward, {dt})
      .flash_attention_forward(s, out.data, f32(lse), qkv.data, d.B, d.T, d.C, d.NH, dt);
}

void flash_attention_backward(Stream& s, TensorView dqkv, ConstTensorView dout,
                              ConstTensorView qkv, ConstTensorView out, ConstTensorView lse,
                              int num_heads, TensorView scratch, GradWrite write) {
  constexpr const char* op = "flash_attention_backward";
  const DType dt = attention_dtype(op, qkv);
  for (auto [name, v] : {std::pair<const char*, ConstTensorView>{"dqkv", dqkv},
                         {"dout", dout},
                         {"qkv", qkv},
                         {"out", out}})
    check_view(s, op, name, v, dt);
  check_f32(s, op, "lse", lse);
  check_f32(s, op, "scratch", scratch);
  const AttentionDims d =
      check_attention(op, qkv, num_heads, {{"dout", dout}, {"out", out}}, {});
  ZT_REQUIRE(dqkv.shape == qkv.shape, op, ": qkv ", qkv.shape.str(), " but dqkv ",
             dqkv.shape.str());
  ZT_REQUIRE(lse.shape == (Shape{d.B, d.NH, d.T}), op, ": qkv ", qkv.shape.str(), " with ",
             num_heads, " heads but lse ", lse.shape.str(), " (need ",
             Shape{d.B, d.NH, d.T}.str(), ")");
  const size_t need = flash_attention_scratch_bytes(d.B, d.T, d.C, d.NH);
  ZT_REQUIRE(scratch.nbytes() >= need, op, ": scratch ", scratch.shape.str(), " holds ",
             scratch.nbytes(), " bytes but qkv ", qkv.shape.str(), " with ", num_heads,
             " heads needs ", need);
  if (d.B * d.T == 0) return;
  const bool accumulate = write == GradWrite::kAccumulate;
  if (const OpTable* t = find_kernel(s, OpId::kFusedAttentionBackward);
      t != nullptr && t->fused_attention_backward(s, dqkv.data, dout.data, qkv.data, out.data, f32(lse), d.B,
                                                  d.T, d.C, d.NH, dt, accumulate))
    return;
  require_kernel(s, OpId::kFlashAttentionBackward, {dt})
      .flash_attention_backward(s, dqkv.data, dout.data, qkv.data, out.data, f32(lse), f32(scratch), d.B, d.T,
                                d.C, d.NH, dt, accumulate);
}

void decode_attention(Stream& s, TensorView out, ConstTensorView qkv, int num_heads) {
  constexpr const char* op = "decode_attention";
  const DType dt = attention_dtype(op, qkv);
  check_view(s, op, "qkv", qkv, dt);
  check_view(s, op, "out", out, dt);
  ZT_REQUIRE(qkv.shape.ndim() == 2 && qkv.shape[1] % 3 == 0 && qkv.shape[1] > 0 && qkv.shape[0] >= 1, op, ": qkv ",
             qkv.shape.str(), " must be [S, 3C] with S >= 1");
  const int64_t S = qkv.shape[0], C = qkv.shape[1] / 3;
  ZT_REQUIRE(num_heads > 0 && C % num_heads == 0, op, ": qkv ", qkv.shape.str(), " has C = ", C, ", which ",
             num_heads, " heads do not divide");
  ZT_REQUIRE(out.shape.ndim() == 2 && out.shape[1] == C && out.shape[0] >= 1 && out.shape[0] <= S, op, ": qkv ",
             qkv.shape.str(), " but out ", out.shape.str(), " (need [n, ", C, "] with 1 <= n <= ", S, ")");
  require_kernel(s, OpId::kDecodeAttention, {dt}).decode_attention(s, out.data, qkv.data, out.shape[0], S, C,
                                                                   num_heads, dt);
}

// ---- activations
// ----------------------------------------------------------------------------------

namespace {
// out, in (and dout) of `dtype`.
int64_t check_unary(Stream& s, const char* op, const ConstTensorView& out, const char* out_name,
                    const ConstTensorView& in, const ConstTensorView* dout, DType dtype = DType::kF32) {
  check_view(s, op, out_name, out, dtype);
  check_view(s, op, "in", in, dtype);
  ZT_REQUIRE(out.numel() == in.numel(), op, ": in ", in.shape.str(), " but ", out_name, " ",
             out.shape.str());
  if (dout != nullptr) {
    check_view(s, op, "dout", *dout, dtype);
    ZT_REQUIRE(dout->numel() == in.numel(), op, ": in ", in.shape.str(), " but dout ",
               dout->shape.str());
  }
  return in.numel();
}
}  // namespace

void gelu_forward(Stream& s, TensorView out, ConstTensorView in) {
  check_in_type(s, "gelu_forward", "in", in);
  const DType dt = in.dtype;
  const int64_t n = check_unary(s, "gelu_forward", out, "out", in, nullptr, dt);
  if (n == 0) return;
  require_kernel(s, OpId::kGeluForward, {dt}).gelu_forward(s, out.data, in.data, dt, n);
}

void gelu_backward(Stream& s, TensorView din, ConstTensorView in, ConstTensorView dout) {
  check_in_type(s, "gelu_backward", "in", in);
  const DType dt = in.dtype;
  const int64_t n = check_unary(s, "gelu_backward", din, "din", in, &dout, dt);
  if (n == 0) return;
  require_kernel(s, OpId::kGeluBackward, {dt}).gelu_backward(s, din.data, in.data, dout.data, dt, n);
}

void relu_forward(Stream& s, TensorView out, ConstTensorView in) {
  check_in_type(s, "relu_forward", "in", in);
  const DType dt = in.dtype;
  const int64_t n = check_unary(s, "relu_forward", out, "out", in, nullptr, dt);
  if (n == 0) return;
  require_kernel(s, OpId::kReluForward, {dt}).relu_forward(s, out.data, in.data, dt, n);
}

void relu_backward(Stream& s, TensorView din, ConstTensorView in, ConstTensorView dout) {
  check_in_type(s, "relu_backward", "in", in);
  const DType dt = in.dtype;
  const int64_t n = check_unary(s, "relu_backward", din, "din", in, &dout, dt);
  if (n == 0) return;
  require_kernel(s, OpId::kReluBackward, {dt}).relu_backward(s, din.data, in.data, dout.data, dt, n);
}

// ---- classifier
// -------------------------------------------------------------------------------------

void classifier_forward_backward(Stream& s, TensorView logits, TensorView losses,
                                 ConstTensorView targets, float dloss, bool compute_grad,
                                 const float* dloss_scale, VocabRange vocab) {
  constexpr const char* op = "classifier_forward_backward";
  ZT_REQUIRE(logits.dtype == DType::kF32 || logits.dtype == DType::kBF16 || logits.dtype == DType::kF16, op,
             ": logits ", logits.shape.str(), " are ", dtype_name(logits.dtype), " but must be f32, bf16 or f16");
  check_view(s, op, "logits", logits, logits.dtype);
  check_f32(s, op, "losses", losses);
  check_view(s, op, "targets", targets, DType::kI32);
  const int64_t ld = last_dim(logits), N = rows(logits);
  ZT_REQUIRE(logits.shape.ndim() >= 1 && ld > 0, op, ": logits ", logits.shape.str(),
             " must be [..., V], V > 0");
  ZT_REQUIRE(vocab.begin == 0 && vocab.total >= 0 && vocab.total <= ld, op, ": vocab [", vocab.begin, ", ",
             vocab.total, ") must start at 0 and fit in the ", ld, " columns of logits ", logits.shape.str(),
             " (shards use row_max / vocab_partials / vocab_loss_grad)");
  const int64_t V = vocab.total > 0 ? vocab.total : ld;
  ZT_REQUIRE(losses.numel() == N && targets.numel() == N, op, ": logits ", logits.shape.str(),
             " has ", N, " rows but losses ", losses.shape.str(), " and targets ",
             targets.shape.str());
  if (N == 0) return;
  require_kernel(s, OpId::kClassifierForwardBackward, {logits.dtype})
      .classifier_forward_backward(s, logits.data, logits.dtype, f32(losses), i32(targets), N, ld, V, dloss,
                                   compute_grad, dloss_scale);
}

// ---- LM head over a padded vocabulary -------------------------------------------------------------

int64_t padded_vocab(int64_t V) { return (V + 127) / 128 * 128; }

namespace {
struct HeadDims {
  int64_t N, C, V, ld;
};
// logits (or dlogits), in and wte share one activation dtype (f32, f16 or bf16).
HeadDims check_head(Stream& s, const char* op, const char* logits_name, const ConstTensorView& logits,
                    const ConstTensorView& in, const ConstTensorView& wte) {
  check_in_type(s, op, "in", in);
  check_same_type(s, op, logits_name, logits, in.dtype);
  check_same_type(s, op, "wte", wte, in.dtype);
  ZT_REQUIRE(wte.shape.ndim() == 2 && in.shape.ndim() >= 1 && last_dim(in) == wte.shape[1], op, ": in ",
             in.shape.str(), " and wte ", wte.shape.str(), " must be [..., C] and [V, C]");
  const HeadDims d{rows(in), wte.shape[1], wte.shape[0], last_dim(logits)};
  ZT_REQUIRE(logits.shape.ndim() >= 1 && rows(logits) == d.N && d.ld >= d.V, op, ": ", logits_name, " ",
             logits.shape.str(), " must be [", d.N, ", Vp] with Vp >= ", d.V, " for in ", in.shape.str(),
             " and wte ", wte.shape.str());
  return d;
}
}  // namespace

void lm_head_forward(Stream& s, TensorView logits, ConstTensorView in, ConstTensorView wte) {
  constexpr const char* op = "lm_head_forward";
  const HeadDims d = check_head(s, op, "logits", logits, in, wte);
  if (d.N == 0) return;
  const DType act = in.dtype;
  check_gemm_tiles(s, op, act, {{"N", d.N}, {"C", d.C}, {"V", d.V}, {"Vp", d.ld}},
                   {{"logits", logits}, {"in", in}, {"wte", wte}});
  if (const OpTable* t = find_kernel(s, OpId::kLmHeadForward)) {
    t->lm_head_forward(s, logits.data, in.data, wte.data, act, d.N, d.C, d.V, d.ld);
    return;
  }
  if (d.ld != d.V) refuse_op(s, OpId::kLmHeadForward, {act});
  matmul_forward(s, logits, in, wte, ConstTensorView{});
}

void lm_head_backward(Stream& s, TensorView din, TensorView dwte, ConstTensorView dlogits, ConstTensorView in,
                      ConstTensorView wte) {
  constexpr const char* op = "lm_head_backward";
  const HeadDims d = check_head(s, op, "dlogits", dlogits, in, wte);
  const DType act = in.dtype;
  if (present(din)) {
    check_same_type(s, op, "din", din, act);
    ZT_REQUIRE(din.shape == in.shape, op, ": in ", in.shape.str(), " but din ", din.shape.str());
  }
  if (present(dwte)) {
    check_f32(s, op, "dwte", dwte);
    ZT_REQUIRE(dwte.shape == wte.shape, op, ": wte ", wte.shape.str(), " but dwte ", dwte.shape.str());
  }
  if (d.N == 0 || (!present(din) && !present(dwte))) return;
  check_gemm_tiles(s, op, act, {{"N", d.N}, {"C", d.C}, {"V", d.V}, {"Vp", d.ld}},
                   {{"din", din}, {"dwte", dwte}, {"dlogits", dlogits}, {"in", in}, {"wte", wte}});
  if (const OpTable* t = find_kernel(s, OpId::kLmHeadBackward)) {
    t->lm_head_backward(s, present(din) ? din.data : nullptr, present(dwte) ? f32(dwte) : nullptr, dlogits.data,
                        in.data, wte.data, act, d.N, d.C, d.V, d.ld);
    return;
  }
  if (d.ld != d.V) refuse_op(s, OpId::kLmHeadBackward, {act});
  matmul_backward(s, din, dwte, TensorView{}, dlogits, in, wte);
}

// ---- vocabulary-parallel cross-entropy ------------------------------------------------------------

namespace {
// logits [..., V], V > 0, f32 or 16-bit (the activation dtype); returns N (rows).
int64_t check_logits(Stream& s, const char* op, const ConstTensorView& logits) {
  check_in_type(s, op, "logits", logits);
  ZT_REQUIRE(logits.shape.ndim() >= 1 && last_dim(logits) > 0, op, ": logits ", logits.shape.str(),
             " must be [..., V], V > 0");
  return rows(logits);
}
// One element per row of logits; targets int32, everything else fp32.
void check_rows(Stream& s, const char* op, const ConstTensorView& logits, int64_t N,
                std::initializer_list<std::pair<const char*, ConstTensorView>> per_row,
                const ConstTensorView* targets = nullptr) {
  if (targets != nullptr) {
    check_view(s, op, "targets", *targets, DType::kI32);
    ZT_REQUIRE(targets->numel() == N, op, ": logits ", logits.shape.str(), " has ", N,
               " rows but targets ", targets->shape.str());
  }
  for (const auto& [name, v] : per_row) {
    check_f32(s, op, name, v);
    ZT_REQUIRE(v.numel() == N, op, ": logits ", logits.shape.str(), " has ", N, " rows but ", name,
               " ", v.shape.str());
  }
}
}  // namespace

void row_max(Stream& s, TensorView out, ConstTensorView logits, VocabRange vocab) {
  constexpr const char* op = "row_max";
  const int64_t N = check_logits(s, op, logits), V = last_dim(logits);
  check_rows(s, op, logits, N, {{"out", out}});
  const int64_t total = check_vocab(op, vocab, "logits", logits, V);
  if (N == 0) return;
  require_kernel(s, OpId::kRowMax, {logits.dtype})
      .row_max(s, f32(out), logits.data, logits.dtype, N, V, vocab.begin, total);
}

void vocab_partials(Stream& s, TensorView out, ConstTensorView logits, ConstTensorView max,
                    ConstTensorView targets, VocabRange vocab) {
  constexpr const char* op = "vocab_partials";
  const int64_t N = check_logits(s, op, logits), V = last_dim(logits);
  check_rows(s, op, logits, N, {{"max", max}}, &targets);
  check_f32(s, op, "out", out);
  ZT_REQUIRE(out.numel() == 2 * N, op, ": logits ", logits.shape.str(), " has ", N,
             " rows but out ", out.shape.str(), " (need [2, ", N, "])");
  const int64_t total = check_vocab(op, vocab, "logits", logits, V);
  if (N == 0) return;
  require_kernel(s, OpId::kVocabPartials, {logits.dtype})
      .vocab_partials(s, f32(out), logits.data, logits.dtype, f32(max), i32(targets), N, V, vocab.begin, total);
}

void vocab_loss_grad(Stream& s, TensorView logits, TensorView losses, ConstTensorView max,
                     ConstTensorView sumexp, ConstTensorView target_logit, ConstTensorView targets,
                     VocabRange vocab, float dloss, bool compute_grad, const float* dloss_scale) {
  constexpr const char* op = "vocab_loss_grad";
  const int64_t N = check_logits(s, op, logits), V = last_dim(logits);
  check_rows(s, op, logits, N,
             {{"losses", losses}, {"max", max}, {"sumexp", sumexp}, {"target_logit", target_logit}},
             &targets);
  const int64_t total = check_vocab(op, vocab, "logits", logits, V);
  if (N == 0) return;
  require_kernel(s, OpId::kVocabLossGrad, {logits.dtype})
      .vocab_loss_grad(s, logits.data, logits.dtype, f32(losses), f32(max), f32(sumexp), f32(target_logit),
                       i32(targets), N, V, vocab.begin, total, dloss, compute_grad, dloss_scale);
}

void reduce_slices(Stream& s, TensorView out, ConstTensorView in, SliceReduce kind) {
  constexpr const char* op = "reduce_slices";
  check_f32(s, op, "out", out);
  check_f32(s, op, "in", in);
  const int64_t S = in.shape.ndim() ? in.shape[0] : 0, n = out.numel();
  ZT_REQUIRE(in.shape.ndim() >= 1 && S >= 1 && in.numel() == S * n, op, ": in ", in.shape.str(),
             " must be [S, n] with S >= 1 slices of out ", out.shape.str(), "'s ", n, " elements");
  if (n == 0) return;
  f32_kernel(s, OpId::kReduceSlices)
      .reduce_slices(s, f32(out), f32(in), S, n, kind == SliceReduce::kMax);
}

// ---- optimizers
// ------------------------------------------------------------------------------------------

void adamw_update(Stream& s, TensorView params, ConstTensorView grads, TensorView m, TensorView v,
                  const AdamWParams& hp, float grad_scale) {
  constexpr const char* op = "adamw_update";
  for (auto [name, t] : {std::pair<const char*, ConstTensorView>{"params", params},
                         {"grads", grads},
                         {"m", m},
                         {"v", v}})
    check_f32(s, op, name, t);
  const int64_t n = params.numel();
  ZT_REQUIRE(grads.numel() == n && m.numel() == n && v.numel() == n, op, ": params ",
             params.shape.str(), " but grads ", grads.shape.str(), ", m ", m.shape.str(), ", v ",
             v.shape.str(), " (element counts must match)");
  ZT_REQUIRE(hp.step >= 1, op, ": step ", hp.step, " must be >= 1 (it counts from 1)");
  if (n == 0) return;
  const float bc1 = adamw_bias_correction(hp.beta1, hp.step);
  const float bc2 = adamw_bias_correction(hp.beta2, hp.step);
  f32_kernel(s, OpId::kAdamwUpdate).adamw_update(s, f32(params), f32(grads), f32(m), f32(v), n, hp.lr, hp.beta1,
               hp.beta2, hp.eps, hp.weight_decay, bc1, bc2, grad_scale);
}

void sgd_update(Stream& s, TensorView params, ConstTensorView grads, TensorView momentum_buf,
                const SgdParams& hp, float grad_scale) {
  constexpr const char* op = "sgd_update";
  check_f32(s, op, "params", params);
  check_f32(s, op, "grads", grads);
  check_f32(s, op, "momentum_buf", momentum_buf);
  const int64_t n = params.numel();
  ZT_REQUIRE(grads.numel() == n && momentum_buf.numel() == n, op, ": params ", params.shape.str(),
             " but grads ", grads.shape.str(), " and momentum_buf ", momentum_buf.shape.str(),
             " (element counts must match)");
  if (n == 0) return;
  f32_kernel(s, OpId::kSgdUpdate).sgd_update(s, f32(params), f32(grads), f32(momentum_buf), n, hp.lr, hp.momentum,
               hp.weight_decay, hp.nesterov, grad_scale);
}

// ---- reductions
// ----------------------------------------------------------------------------------------

void sum_squares(Stream& s, TensorView out, ConstTensorView x) {
  constexpr const char* op = "sum_squares";
  check_f32(s, op, "out", out);
  check_f32(s, op, "x", x);
  ZT_REQUIRE(out.numel() == 1, op, ": out ", out.shape.str(), " must hold one element");
  const int64_t n = x.numel();
  f32_kernel(s, OpId::kSumSquares).sum_squares(s, f32(out), f32(x), n);
}

void sum(Stream& s, TensorView out, ConstTensorView x) {
  constexpr const char* op = "sum";
  check_f32(s, op, "out", out);
  check_f32(s, op, "x", x);
  ZT_REQUIRE(out.numel() == 1, op, ": out ", out.shape.str(), " must hold one element");
  f32_kernel(s, OpId::kSum).sum(s, f32(out), f32(x), x.numel());
}

// ---- fused residual add + layernorm ------------------------------------------------------------

void residual_layernorm_forward(Stream& s, TensorView residual_out, TensorView ln_out, TensorView mean,
                                TensorView rstd, ConstTensorView a, ConstTensorView b,
                                ConstTensorView weight, ConstTensorView bias, float eps) {
  constexpr const char* op = "residual_layernorm_forward";
  const DType act = a.dtype;
  ZT_REQUIRE(act == DType::kF32 || act == DType::kBF16 || act == DType::kF16, op, ": a ", a.shape.str(), " is ",
             dtype_name(act), " but activations must be fp32, bf16 or fp16");
  for (auto [name, v] : {std::pair<const char*, ConstTensorView>{"residual_out", residual_out},
                         {"ln_out", ln_out},
                         {"a", a},
                         {"b", b}})
    check_view(s, op, name, v, act);
  check_f32(s, op, "mean", mean);
  check_f32(s, op, "rstd", rstd);
  const DType wt = check_norm_params(s, op, weight, &bias, act);
  const int64_t C = last_dim(a), N = rows(a);
  ZT_REQUIRE(a.shape.ndim() >= 1 && C > 0, op, ": a ", a.shape.str(), " must be [..., C], C > 0");
  // Rows of C, as add and layernorm_forward accept them (leading dims may differ).
  for (const ConstTensorView& v : {ConstTensorView(b), ConstTensorView(residual_out), ConstTensorView(ln_out)})
    ZT_REQUIRE(v.numel() == a.numel() && last_dim(v) == C, op, ": a ", a.shape.str(), " but b ", b.shape.str(),
               ", residual_out ", residual_out.shape.str(), " and ln_out ", ln_out.shape.str(),
               " (all must be ", N, " rows of ", C, ")");
  ZT_REQUIRE(is_vector(weight, C) && is_vector(bias, C), op, ": a ", a.shape.str(), " but weight ",
             weight.shape.str(), " and bias ", bias.shape.str(), " (need [", C, "])");
  ZT_REQUIRE(mean.numel() == N && rstd.numel() == N, op, ": a ", a.shape.str(), " has ", N, " rows but mean ",
             mean.shape.str(), " and rstd ", rstd.shape.str());
  ZT_REQUIRE(eps >= 0.0f, op, ": eps ", eps, " must be >= 0");
  ZT_REQUIRE(ln_out.data == nullptr || (ln_out.data != a.data && ln_out.data != b.data &&
                                        ln_out.data != residual_out.data),
             op, ": ln_out ", ln_out.shape.str(), " must not alias a, b or residual_out");
  if (N == 0) return;
  if (const OpTable* t = find_kernel(s, OpId::kResidualLayernormForward)) {
    t->residual_layernorm_forward(s, residual_out.data, ln_out.data, f32(mean), f32(rstd), a.data, b.data, act,
                                  weight.data, bias.data, wt, N, C, eps);
  } else if (act == DType::kF32) {
    // Fallback: the composition the fused kernels reproduce bit for bit.
    add(s, residual_out, a, b);
    layernorm_forward(s, ln_out, mean, rstd, residual_out, weight, bias, eps);
  } else {
    refuse_op(s, OpId::kResidualLayernormForward, {act, wt});
  }
}

}  // namespace zt::ops
