// Float64 references for kernels/ops.h (see ops_ref.h): plain loops over the formulas.
#include "kernels/ref/ops_ref.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace zt::ref {

void encoder_forward_ref(DSpan out, ISpan tokens, CDSpan wte, CDSpan wpe, int64_t B, int64_t T,
                         int64_t C, int64_t begin) {
  const int64_t V = static_cast<int64_t>(wte.size()) / C;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t local = tokens[b * T + t] - begin;
      for (int64_t c = 0; c < C; ++c)
        out[(b * T + t) * C + c] = (local >= 0 && local < V ? wte[local * C + c] : 0.0) +
                                   (wpe.empty() ? 0.0 : wpe[t * C + c]);
    }
}

void encoder_backward_ref(DSpan dwte, DSpan dwpe, CDSpan dout, ISpan tokens, int64_t B, int64_t T,
                          int64_t C, int64_t begin) {
  const int64_t V = static_cast<int64_t>(dwte.size()) / C;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t local = tokens[b * T + t] - begin;
      for (int64_t c = 0; c < C; ++c) {
        const double d = dout[(b * T + t) * C + c];
        if (local >= 0 && local < V) dwte[local * C + c] += d;
        if (!dwpe.empty()) dwpe[t * C + c] += d;
      }
    }
}

void position_forward_ref(DSpan x, CDSpan wpe, int64_t R, int64_t C, int64_t row0, int64_t T) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) x[r * C + c] += wpe[((row0 + r) % T) * C + c];
}

void position_backward_ref(DSpan dwpe, CDSpan dx, int64_t R, int64_t C, int64_t row0, int64_t T) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) dwpe[((row0 + r) % T) * C + c] += dx[r * C + c];
}

void bias_forward_ref(DSpan x, CDSpan bias, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < C; ++c) x[r * C + c] += bias[c];
}

void bias_backward_ref(DSpan dbias, CDSpan dout, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < C; ++c) dbias[c] += dout[r * C + c];
}

void layernorm_forward_ref(DSpan out, DSpan mean, DSpan rstd, CDSpan in, CDSpan weight, CDSpan bias,
                           int64_t N, int64_t C, double eps) {
  for (int64_t r = 0; r < N; ++r) {
    const double* x = &in[r * C];
    double m = 0;
    for (int64_t i = 0; i < C; ++i) m += x[i];
    m /= C;
    double var = 0;
    for (int64_t i = 0; i < C; ++i) var += (x[i] - m) * (x[i] - m);
    var /= C;
    const double s = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < C; ++i) out[r * C + i] = (x[i] - m) * s * weight[i] + bias[i];
    mean[r] = m;
    rstd[r] = s;
  }
}

void layernorm_backward_ref(DSpan din, DSpan dweight, DSpan dbias, CDSpan dout, CDSpan in,
                            CDSpan weight, CDSpan mean, CDSpan rstd, int64_t N, int64_t C) {
  for (int64_t r = 0; r < N; ++r) {
    const double* x = &in[r * C];
    const double* dy = &dout[r * C];
    double dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int64_t i = 0; i < C; ++i) {
      const double norm = (x[i] - mean[r]) * rstd[r];
      dnorm_mean += weight[i] * dy[i];
      dnorm_norm_mean += weight[i] * dy[i] * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    for (int64_t i = 0; i < C; ++i) {
      const double norm = (x[i] - mean[r]) * rstd[r];
      dbias[i] += dy[i];
      dweight[i] += norm * dy[i];
      din[r * C + i] += (weight[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * rstd[r];
    }
  }
}

void matmul_forward_ref(DSpan out, CDSpan in, CDSpan weight, CDSpan bias, int64_t N, int64_t C,
                        int64_t OC) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = bias.empty() ? 0.0 : bias[o];
      for (int64_t i = 0; i < C; ++i) acc += in[r * C + i] * weight[o * C + i];
      out[r * OC + o] = acc;
    }
}

void matmul_backward_ref(DSpan din, DSpan dweight, DSpan dbias, CDSpan dout, CDSpan in,
                         CDSpan weight, int64_t N, int64_t C, int64_t OC) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t o = 0; o < OC; ++o) {
      const double d = dout[r * OC + o];
      if (!din.empty())
        for (int64_t i = 0; i < C; ++i) din[r * C + i] += d * weight[o * C + i];
      for (int64_t i = 0; i < C; ++i) dweight[o * C + i] += d * in[r * C + i];
      if (!dbias.empty()) dbias[o] += d;
    }
}

void attention_forward_ref(DSpan out, DSpan preatt, DSpan att, CDSpan qkv, int64_t B, int64_t T,
                           int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const double* q = &qkv[(b * T + t) * 3 * C + h * hs];
        double* pre = &preatt[((b * NH + h) * T + t) * T];
        double* a = &att[((b * NH + h) * T + t) * T];
        double mx = -INFINITY;
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          const double* k = &qkv[(b * T + t2) * 3 * C + C + h * hs];
          double dot = 0;
          for (int64_t i = 0; i < hs; ++i) dot += q[i] * k[i];
          pre[t2] = dot * scale;
          mx = std::max(mx, pre[t2]);
        }
        double sum = 0;
        for (int64_t t2 = 0; t2 <= t; ++t2) sum += std::exp(pre[t2] - mx);
        for (int64_t t2 = 0; t2 < T; ++t2) a[t2] = t2 <= t ? std::exp(pre[t2] - mx) / sum : 0.0;
        double* o = &out[(b * T + t) * C + h * hs];
        for (int64_t i = 0; i < hs; ++i) {
          double acc = 0;
          for (int64_t t2 = 0; t2 <= t; ++t2)
            acc += a[t2] * qkv[(b * T + t2) * 3 * C + 2 * C + h * hs + i];
          o[i] = acc;
        }
      }
}

void attention_backward_ref(DSpan dqkv, CDSpan dout, CDSpan qkv, CDSpan att, int64_t B, int64_t T,
                            int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const double* a = &att[((b * NH + h) * T + t) * T];
        const double* dy = &dout[(b * T + t) * C + h * hs];
        const int64_t q_off = (b * T + t) * 3 * C + h * hs;
        // out[t] = sum_t2 a[t2] v[t2]
        std::vector<double> da(static_cast<size_t>(t + 1));
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          const int64_t v_off = (b * T + t2) * 3 * C + 2 * C + h * hs;
          for (int64_t i = 0; i < hs; ++i) {
            da[t2] += dy[i] * qkv[v_off + i];
            dqkv[v_off + i] += a[t2] * dy[i];
          }
        }
        // a = softmax(pre): dpre[t2] = a[t2] (da[t2] - sum_t3 a[t3] da[t3])
        double dot = 0;
        for (int64_t t3 = 0; t3 <= t; ++t3) dot += a[t3] * da[t3];
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          const double dpre = a[t2] * (da[t2] - dot);
          const int64_t k_off = (b * T + t2) * 3 * C + C + h * hs;
          for (int64_t i = 0; i < hs; ++i) {
            dqkv[q_off + i] += dpre * scale * qkv[k_off + i];
            dqkv[k_off + i] += dpre * scale * qkv[q_off + i];
          }
        }
      }
}

namespace {
constexpr double kGeluS = 0.79788456080286535588;  // sqrt(2/pi)
constexpr double kGeluC = 0.044715;
}  // namespace

void gelu_forward_ref(DSpan out, CDSpan in) {
  for (size_t i = 0; i < in.size(); ++i) {
    const double x = in[i];
    out[i] = 0.5 * x * (1.0 + std::tanh(kGeluS * (x + kGeluC * x * x * x)));
  }
}

void gelu_backward_ref(DSpan din, CDSpan in, CDSpan dout) {
  for (size_t i = 0; i < in.size(); ++i) {
    const double x = in[i];
    const double t = std::tanh(kGeluS * (x + kGeluC * x * x * x));
    const double grad =
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kGeluS * (1.0 + 3.0 * kGeluC * x * x);
    din[i] += grad * dout[i];
  }
}

void relu_forward_ref(DSpan out, CDSpan in) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = in[i] > 0 ? in[i] : 0.0;
}

void relu_backward_ref(DSpan din, CDSpan in, CDSpan dout) {
  for (size_t i = 0; i < in.size(); ++i) din[i] += in[i] > 0 ? dout[i] : 0.0;
}

void classifier_ref(DSpan losses, DSpan dlogits, CDSpan logits, ISpan targets, int64_t N, int64_t V,
                    double dloss) {
  for (int64_t r = 0; r < N; ++r) {
    const double* x = &logits[r * V];
    double* d = &dlogits[r * V];
    if (targets[r] < 0) {
      losses[r] = 0;
      for (int64_t i = 0; i < V; ++i) d[i] = 0;
      continue;
    }
    double mx = -INFINITY;
    for (int64_t i = 0; i < V; ++i) mx = std::max(mx, x[i]);
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(x[i] - mx);
    losses[r] = std::log(sum) + mx - x[targets[r]];
    for (int64_t i = 0; i < V; ++i)
      d[i] = (std::exp(x[i] - mx) / sum - (i == targets[r] ? 1.0 : 0.0)) * dloss;
  }
}

void row_max_ref(DSpan out, CDSpan logits, int64_t N, int64_t V) {
  for (int64_t r = 0; r < N; ++r) {
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, logits[r * V + j]);
    out[r] = m;
  }
}

void vocab_partials_ref(DSpan out, CDSpan logits, CDSpan max, ISpan targets, int64_t N, int64_t V,
                        int64_t begin) {
  for (int64_t r = 0; r < N; ++r) {
    double sum = 0, target_logit = 0;
    if (targets[r] >= 0) {
      for (int64_t j = 0; j < V; ++j) sum += std::exp(logits[r * V + j] - max[r]);
      const int64_t local = targets[r] - begin;
      if (local >= 0 && local < V) target_logit = logits[r * V + local];
    }
    out[r] = sum;
    out[N + r] = target_logit;
  }
}

void vocab_loss_grad_ref(DSpan losses, DSpan dlogits, CDSpan logits, CDSpan max, CDSpan sumexp,
                         CDSpan target_logit, ISpan targets, int64_t N, int64_t V, int64_t begin,
                         double dloss) {
  for (int64_t r = 0; r < N; ++r) {
    const bool ignored = targets[r] < 0;
    losses[r] = ignored ? 0.0 : std::log(sumexp[r]) + max[r] - target_logit[r];
    const int64_t local = targets[r] - begin;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(logits[r * V + j] - max[r]) / sumexp[r];
      dlogits[r * V + j] = ignored ? 0.0 : (p - (j == local ? 1.0 : 0.0)) * dloss;
    }
  }
}

void reduce_slices_ref(DSpan out, CDSpan in, bool take_max) {
  const size_t n = out.size();
  for (size_t j = 0; j < n; ++j) {
    double acc = in[j];
    for (size_t k = 1; k * n < in.size(); ++k)
      acc = take_max ? std::max(acc, in[k * n + j]) : acc + in[k * n + j];
    out[j] = acc;
  }
}

void adamw_ref(DSpan params, CDSpan grads, DSpan m, DSpan v, const AdamWRef& hp,
               double grad_scale) {
  const double bc1 = 1.0 - std::pow(hp.beta1, hp.step);
  const double bc2 = 1.0 - std::pow(hp.beta2, hp.step);
  for (size_t i = 0; i < params.size(); ++i) {
    const double g = grads[i] * grad_scale;
    m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * g;
    v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * g * g;
    const double m_hat = m[i] / bc1, v_hat = v[i] / bc2;
    params[i] -= hp.lr * (m_hat / (std::sqrt(v_hat) + hp.eps) + hp.weight_decay * params[i]);
  }
}

void sgd_ref(DSpan params, CDSpan grads, DSpan momentum_buf, const SgdRef& hp, double grad_scale) {
  for (size_t i = 0; i < params.size(); ++i) {
    const double g = grads[i] * grad_scale + hp.weight_decay * params[i];
    momentum_buf[i] = hp.momentum * momentum_buf[i] + g;
    params[i] -= hp.lr * (hp.nesterov ? g + hp.momentum * momentum_buf[i] : momentum_buf[i]);
  }
}

double sum_squares_ref(CDSpan x) {
  double s = 0;
  for (double v : x) s += v * v;
  return s;
}

}  // namespace zt::ref
