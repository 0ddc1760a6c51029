// CPU kernels for the optimizer updates over flat fp32 buffers (per-element math shared with
// CUDA in kernels/elementwise.h).
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/elementwise.h"

namespace zt::cpu_kernels {

namespace {

ZT_CPU_CLONES void adamw_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                               float* __restrict v, int64_t b, int64_t e, float lr, float beta1,
                               float beta2, float eps, float wd, float bc1, float bc2,
                               float grad_scale) {
  for (int64_t i = b; i < e; ++i)
    adamw_elem(p[i], g[i], m[i], v[i], lr, beta1, beta2, eps, wd, bc1, bc2, grad_scale);
}

ZT_CPU_CLONES void sgd_range(float* __restrict p, const float* __restrict g, float* __restrict buf,
                             int64_t b, int64_t e, float lr, float momentum, float wd,
                             bool nesterov, float grad_scale) {
  for (int64_t i = b; i < e; ++i)
    sgd_elem(p[i], g[i], buf[i], lr, momentum, wd, nesterov, grad_scale);
}

}  // namespace

void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, float bias_correction1,
                  float bias_correction2, float grad_scale) {
  parallel_for(n, detail::kElemGrain, [=](int64_t b, int64_t e) {
    adamw_range(params, grads, m, v, b, e, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                bias_correction2, grad_scale);
  });
}

void sgd_update(float* params, const float* grads, float* momentum_buf, int64_t n, float lr,
                float momentum, float weight_decay, bool nesterov, float grad_scale) {
  parallel_for(n, detail::kElemGrain, [=](int64_t b, int64_t e) {
    sgd_range(params, grads, momentum_buf, b, e, lr, momentum, weight_decay, nesterov, grad_scale);
  });
}

}  // namespace zt::cpu_kernels
