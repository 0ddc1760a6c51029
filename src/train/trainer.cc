// The single-device training loop. Host synchronisation happens once per step (to read the loss
// and the gradient norm); everything else is queued on the device's compute stream.
#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/philox.h"
#include "core/status.h"
#include "data/image_data.h"
#include "data/language_data.h"
#include "data/prefetcher.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "runtime/runtime.h"

namespace zt {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string hms(double s) {
  const long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

std::string si(double v) {
  char buf[32];
  if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

// Host-side batch: what the data layer fills and the prefetcher double-buffers.
struct HostBatch {
  std::vector<int32_t> tokens;   // GPT inputs [B*T]
  std::vector<float> images;     // MLP inputs [B*D]
  std::vector<int32_t> targets;  // [B*T] or [B]
};

// Parameters, gradients and optimizer state of every block on one device.
class DeviceParams final : public ParamAccess {
 public:
  DeviceParams(Device& d, const ParamLayout& layout, bool sgd) : device_(d) {
    for (const auto& b : layout.blocks()) {
      const size_t bytes = static_cast<size_t>(b.numel) * sizeof(float);
      params_.emplace_back(d.memory(), bytes, d.compute(), "parameters");
      grads_.emplace_back(d.memory(), bytes, d.compute(), "gradients");
      m_.emplace_back(d.memory(), bytes, d.compute(), "optimizer state");
      if (!sgd) v_.emplace_back(d.memory(), bytes, d.compute(), "optimizer state");
    }
  }
  int device_index() const override { return device_.index(); }
  float* params(int b) override { return params_[static_cast<size_t>(b)].as<float>(); }
  float* grads(int b) override { return grads_[static_cast<size_t>(b)].as<float>(); }
  float* m(int b) { return m_[static_cast<size_t>(b)].as<float>(); }
  float* v(int b) { return v_[static_cast<size_t>(b)].as<float>(); }

 private:
  Device& device_;
  std::vector<DeviceBuffer> params_, grads_, m_, v_;
};

TensorView flat(float* p, int64_t n, int device) { return TensorView{p, DType::kF32, Shape{n}, device}; }

void print_sample_text(const std::string& s) { std::printf("%s\n", s.c_str()); }

}  // namespace

TrainResult train(const TrainConfig& cfg_in) {
  TrainConfig cfg = cfg_in;
  // ---------------- validation and set-up (nothing is trained before all of it passed) -------
  ModelConfig mc = make_model_config(cfg.model, cfg.overrides);
  const bool is_gpt = mc.kind == ModelKind::kGpt;
  std::unique_ptr<LanguageData> lang;
  std::unique_ptr<ImageData> images;
  if (is_gpt) {
    ZT_REQUIRE(cfg.data != "fashion-mnist", "--data fashion-mnist is an image dataset; use it with --model mlp");
    lang = open_language_data(cfg.data, cfg.seed, mc.vocab);
    ZT_REQUIRE(lang->vocab_size() <= mc.vocab, "the data has token ids up to ", lang->vocab_size() - 1,
               " but the model's vocabulary is ", mc.vocab, "; use --vocab ", lang->vocab_size(), " or more");
    if (cfg.train_seq_len == 0) cfg.train_seq_len = mc.seq_len;
    ZT_REQUIRE(cfg.train_seq_len >= 1 && cfg.train_seq_len <= mc.seq_len, "sequence length ", cfg.train_seq_len,
               " is above the model's context of ", mc.seq_len, " tokens; raise --seq-len or lower --train-seq-len");
    lang->validate(cfg.train_seq_len);
  } else {
    images = open_image_data(cfg.data == "synthetic" ? "fashion-mnist" : cfg.data, cfg.seed);
    ZT_REQUIRE(images->image_size() == mc.input_dim && images->num_classes() == mc.classes,
               "the data has ", images->image_size(), " inputs and ", images->num_classes(),
               " classes, the model expects ", mc.input_dim, " and ", mc.classes);
  }
  if (cfg.batch_size < 0) cfg.batch_size = is_gpt ? 8 : 128;
  ZT_REQUIRE(cfg.batch_size >= 1, "--batch-size must be at least 1, got ", cfg.batch_size);
  if (cfg.micro_batch_size == 0) cfg.micro_batch_size = cfg.batch_size;
  ZT_REQUIRE(cfg.micro_batch_size >= 1, "--micro-batch-size must be at least 1, got ", cfg.micro_batch_size);
  ZT_REQUIRE(cfg.batch_size % cfg.micro_batch_size == 0, "--batch-size ", cfg.batch_size,
             " is not a multiple of --micro-batch-size ", cfg.micro_batch_size,
             "; the global batch must split into whole micro-batches");
  const int accum = cfg.batch_size / cfg.micro_batch_size;
  const int B = cfg.micro_batch_size;
  const int T = is_gpt ? cfg.train_seq_len : 1;
  if (!is_gpt) {
    const int64_t per_epoch = images->batches_per_epoch(Split::kTrain, cfg.batch_size);
    ZT_REQUIRE(per_epoch >= 1, "--batch-size ", cfg.batch_size, " is larger than the training set");
    if (cfg.steps < 0) cfg.steps = static_cast<int>((cfg.epochs > 0 ? cfg.epochs : 3) * per_epoch);
  }
  if (cfg.steps < 0) cfg.steps = 1500;  // gpt-tiny reaches within ~0.15 nats of the synthetic floor
  ZT_REQUIRE(cfg.steps >= 1, "--steps must be at least 1, got ", cfg.steps);
  if (cfg.lr < 0) cfg.lr = cfg.optimizer == OptimizerKind::kAdamW ? (is_gpt ? 3e-3f : 1e-3f) : 0.05f;
  ZT_REQUIRE(cfg.lr > 0 && std::isfinite(cfg.lr), "--lr must be positive, got ", cfg.lr);
  if (cfg.min_lr < 0) cfg.min_lr = cfg.lr / 10;
  if (cfg.warmup_steps < 0) cfg.warmup_steps = std::max(1, cfg.steps / 50);
  if (cfg.eval_every < 0) cfg.eval_every = std::max(1, cfg.steps / 4);
  ZT_REQUIRE(cfg.weight_decay >= 0, "--weight-decay must not be negative, got ", cfg.weight_decay);
  ZT_REQUIRE(cfg.grad_clip >= 0, "--grad-clip must not be negative, got ", cfg.grad_clip);
  ZT_REQUIRE(cfg.top_k >= 0 && cfg.temperature > 0, "--top-k must be >= 0 and --temperature > 0");

  // Until the ZeRO engine lands a run uses one device: the first GPU, else one simulated device.
  std::string devices = cfg.devices;
  if (devices.empty()) devices = cuda_availability().usable ? "cuda:0" : "cpu:1";
  const DeviceSpec spec = parse_device_spec(devices);
  auto rt = Runtime::create(spec);
  ZT_REQUIRE(rt->size() == 1, "--devices ", cfg.devices, " selects ", rt->size(),
               " devices, but multi-device (ZeRO) training is not implemented yet; select one device, e.g. cpu:1 or cuda:0");
  Device& dev = rt->device(0);
  Stream& s = dev.compute();
  const int di = dev.index();

  std::FILE* metrics = nullptr;
  if (!cfg.metrics_path.empty()) {
    metrics = std::fopen(cfg.metrics_path.c_str(), "w");
    ZT_REQUIRE(metrics, "cannot write --metrics file '", cfg.metrics_path, "'");
  }
  auto emit = [&](const nlohmann::json& j) {
    if (!metrics) return;
    std::fprintf(metrics, "%s\n", j.dump().c_str());
    std::fflush(metrics);
  };

  auto model = make_model(mc);
  const ParamLayout& layout = model->layout();
  DeviceParams P(dev, layout, cfg.optimizer == OptimizerKind::kSgd);
  {
    // Initialise on the host (deterministic in the seed), copy, zero optimizer state.
    for (int b = 0; b < layout.num_blocks(); ++b) {
      const ParamBlock& blk = layout.block(b);
      std::vector<float> host(static_cast<size_t>(blk.numel));
      init_block_host(blk, cfg.seed, host.data());
      s.copy(P.params(b), host.data(), host.size() * sizeof(float));
      ops::fill(s, flat(P.m(b), blk.numel, di), 0.0f);
      if (cfg.optimizer == OptimizerKind::kAdamW) ops::fill(s, flat(P.v(b), blk.numel, di), 0.0f);
      s.synchronize();  // `host` goes out of scope
    }
  }
  auto ws = model->make_workspace(dev, B, T);

  // Device input buffers for one micro-batch.
  const int D = is_gpt ? 0 : mc.input_dim;
  DeviceBuffer d_inputs(dev.memory(), static_cast<size_t>(is_gpt ? B * T : B * D) * 4, s, "batch");
  DeviceBuffer d_targets(dev.memory(), static_cast<size_t>(B * T) * 4, s, "batch");
  DeviceBuffer d_norm(dev.memory(), static_cast<size_t>(layout.num_blocks()) * 4, s, "grad norm");
  Batch batch;
  batch.B = B;
  batch.T = T;
  if (is_gpt)
    batch.inputs = ConstTensorView{d_inputs.data(), DType::kI32, Shape{B, T}, di};
  else
    batch.inputs = ConstTensorView{d_inputs.data(), DType::kF32, Shape{B, D}, di};
  batch.targets = ConstTensorView{d_targets.data(), DType::kI32, is_gpt ? Shape{B, T} : Shape{B}, di};

  auto fill_train = [&](int64_t micro_index, HostBatch& hb) {
    const uint64_t step = static_cast<uint64_t>(micro_index / accum);
    const int first = static_cast<int>(micro_index % accum) * B;
    if (is_gpt) {
      hb.tokens.resize(static_cast<size_t>(B * T));
      hb.targets.resize(static_cast<size_t>(B * T));
      lang->batch(Split::kTrain, step, first, B, T, hb.tokens.data(), hb.targets.data());
    } else {
      const int64_t per_epoch = images->batches_per_epoch(Split::kTrain, cfg.batch_size);
      hb.images.resize(static_cast<size_t>(B * D));
      hb.targets.resize(static_cast<size_t>(B));
      images->batch(Split::kTrain, step / per_epoch, static_cast<int64_t>(step % per_epoch), cfg.batch_size,
                    first, B, hb.images.data(), hb.targets.data());
    }
  };
  Prefetcher<HostBatch> prefetch(fill_train);

  auto upload = [&](const HostBatch& hb) {
    if (is_gpt) s.copy(d_inputs.data(), hb.tokens.data(), hb.tokens.size() * 4);
    else s.copy(d_inputs.data(), hb.images.data(), hb.images.size() * 4);
    s.copy(d_targets.data(), hb.targets.data(), hb.targets.size() * 4);
  };

  const int positions = B * T;
  std::vector<float> host_losses(static_cast<size_t>(positions));
  auto read_losses = [&]() {
    s.copy(host_losses.data(), ws->losses().data, host_losses.size() * 4);
    s.synchronize();
    double sum = 0;
    for (float l : host_losses) sum += l;
    return sum;
  };

  // Evaluation: mean validation loss (and accuracy for the classifier), forward only.
  auto evaluate = [&](double* accuracy) -> double {
    HostBatch hb;
    double loss_sum = 0;
    int64_t count = 0, correct = 0;
    if (is_gpt) {
      hb.tokens.resize(static_cast<size_t>(B * T));
      hb.targets.resize(static_cast<size_t>(B * T));
      for (int e = 0; e < cfg.eval_batches; ++e) {
        lang->batch(Split::kValidation, static_cast<uint64_t>(e), 0, B, T, hb.tokens.data(), hb.targets.data());
        upload(hb);
        model->forward(s, P, *ws, batch, 0.0f, false);
        s.synchronize();  // hb is reused next iteration
        loss_sum += read_losses();
        count += positions;
      }
    } else {
      const int64_t n = images->num_examples(Split::kValidation);
      hb.images.resize(static_cast<size_t>(B * D));
      hb.targets.resize(static_cast<size_t>(B));
      std::vector<float> logits(static_cast<size_t>(B * mc.classes));
      for (int64_t first = 0; first + B <= n; first += B) {
        images->examples(Split::kValidation, first, B, hb.images.data(), hb.targets.data());
        upload(hb);
        model->forward(s, P, *ws, batch, 0.0f, false);
        s.copy(logits.data(), ws->logits().data, logits.size() * 4);
        loss_sum += read_losses();
        for (int i = 0; i < B; ++i) {
          const float* row = logits.data() + static_cast<size_t>(i) * mc.classes;
          const int pred = static_cast<int>(std::max_element(row, row + mc.classes) - row);
          correct += pred == hb.targets[static_cast<size_t>(i)];
        }
        count += B;
      }
      if (accuracy) *accuracy = count ? static_cast<double>(correct) / count : 0;
    }
    return count ? loss_sum / count : 0;
  };

  // Sampling: autoregressive, temperature + top-k, deterministic in the seed.
  std::unique_ptr<Workspace> sample_ws;
  auto sample = [&](int n_tokens, uint64_t salt) -> std::string {
    if (!sample_ws) sample_ws = model->make_workspace(dev, 1, T);
    const int V = mc.vocab;
    std::vector<int32_t> ctx = {V >= 50257 ? 50256 : '\n'};
    std::vector<int32_t> in(static_cast<size_t>(T)), tg(static_cast<size_t>(T), -1);
    std::vector<float> row(static_cast<size_t>(V));
    Batch sb;
    sb.B = 1;
    sb.T = T;
    sb.inputs = ConstTensorView{d_inputs.data(), DType::kI32, Shape{1, T}, di};
    sb.targets = ConstTensorView{d_targets.data(), DType::kI32, Shape{1, T}, di};
    std::string out;
    for (int k = 0; k < n_tokens; ++k) {
      const int len = std::min<int>(static_cast<int>(ctx.size()), T);
      std::fill(in.begin(), in.end(), 0);
      std::copy(ctx.end() - len, ctx.end(), in.begin());
      s.copy(d_inputs.data(), in.data(), in.size() * 4);
      s.copy(d_targets.data(), tg.data(), tg.size() * 4);
      model->forward(s, P, *sample_ws, sb, 0.0f, false);
      s.copy(row.data(), static_cast<float*>(sample_ws->logits().data) + static_cast<size_t>(len - 1) * V,
             row.size() * 4);
      s.synchronize();
      // top-k over logits / temperature
      std::vector<int> idx(static_cast<size_t>(V));
      std::iota(idx.begin(), idx.end(), 0);
      const int k_keep = cfg.top_k > 0 ? std::min(cfg.top_k, V) : V;
      std::partial_sort(idx.begin(), idx.begin() + k_keep, idx.end(),
                        [&](int a, int b) { return row[static_cast<size_t>(a)] > row[static_cast<size_t>(b)]; });
      const float mx = row[static_cast<size_t>(idx[0])];
      std::vector<double> p(static_cast<size_t>(k_keep));
      double z = 0;
      for (int i = 0; i < k_keep; ++i) z += p[static_cast<size_t>(i)] = std::exp((row[static_cast<size_t>(idx[static_cast<size_t>(i)])] - mx) / cfg.temperature);
      double u = philox_uniform(cfg.seed, 0x5a3b1e ^ salt, static_cast<uint64_t>(k)) * z;
      int pick = idx[static_cast<size_t>(k_keep - 1)];
      for (int i = 0; i < k_keep; ++i) {
        u -= p[static_cast<size_t>(i)];
        if (u <= 0) {
          pick = idx[static_cast<size_t>(i)];
          break;
        }
      }
      ctx.push_back(pick);
      if (V <= 256) {
        const char c = static_cast<char>(pick);
        out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? std::string(1, c) : "?";
      } else {
        if (!out.empty()) out.push_back(' ');
        out.append(std::to_string(pick));
      }
    }
    return out;
  };

  // ---------------- the loop -------------------------------------------------------------------
  TrainResult result;
  result.entropy_floor = is_gpt ? lang->entropy_rate() : std::nullopt;
  const bool tty = isatty(STDOUT_FILENO);
  const int print_every = std::max(1, cfg.steps / 20);
  if (!cfg.quiet) {
    std::printf("model: %s (%s parameters)\n", mc.describe().c_str(), si(static_cast<double>(layout.total_parameters())).c_str());
    std::printf("data: %s\n", is_gpt ? lang->describe().c_str() : images->describe().c_str());
    std::printf("device: %s%s%s\n", dev.name().c_str(), rt->fallback_note().empty() ? "" : " — ",
                rt->fallback_note().c_str());
    std::printf("batch: %d x %d tokens (%d micro-batches of %d), %d steps, %s lr %.2g\n", cfg.batch_size, T, accum, B,
                cfg.steps, cfg.optimizer == OptimizerKind::kAdamW ? "AdamW" : "SGD", cfg.lr);
    if (result.entropy_floor) std::printf("entropy floor of the data: %.4f nats/token\n", *result.entropy_floor);
    std::fflush(stdout);
  }
  LrConfig lrc{cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps, cfg.schedule};
  const auto t0 = Clock::now();
  double train_time = 0;
  const float dloss = 1.0f / static_cast<float>(positions * accum);
  std::vector<float> norms(static_cast<size_t>(layout.num_blocks()));
  for (int step = 0; step < cfg.steps; ++step) {
    const auto ts = Clock::now();
    const float lr = learning_rate(lrc, step);
    for (int b = 0; b < layout.num_blocks(); ++b) ops::fill(s, flat(P.grads(b), layout.block(b).numel, di), 0.0f);
    double loss_sum = 0;
    for (int m = 0; m < accum; ++m) {
      const HostBatch& hb = prefetch.get(static_cast<int64_t>(step) * accum + m);
      upload(hb);
      model->forward(s, P, *ws, batch, dloss, true);
      model->backward(s, P, *ws, batch);
      loss_sum += read_losses();  // synchronizes: hb may be recycled by the prefetcher after this
    }
    for (int b = 0; b < layout.num_blocks(); ++b)
      ops::sum_squares(s, TensorView{d_norm.as<float>() + b, DType::kF32, Shape{1}, di},
                       flat(P.grads(b), layout.block(b).numel, di));
    s.copy(norms.data(), d_norm.data(), norms.size() * 4);
    s.synchronize();
    double sq = 0;
    for (float n2 : norms) sq += n2;
    const double grad_norm = std::sqrt(sq);
    const float clip_scale = cfg.grad_clip > 0 && grad_norm > cfg.grad_clip ? static_cast<float>(cfg.grad_clip / grad_norm) : 1.0f;
    for (int b = 0; b < layout.num_blocks(); ++b) {
      for (const ParamTensor& t : layout.block(b).tensors) {
        const float wd = t.weight_decay ? cfg.weight_decay : 0.0f;
        TensorView pv = flat(P.params(b) + t.offset, t.numel, di);
        TensorView gv = flat(P.grads(b) + t.offset, t.numel, di);
        TensorView mv = flat(P.m(b) + t.offset, t.numel, di);
        if (cfg.optimizer == OptimizerKind::kAdamW) {
          ops::adamw_update(s, pv, gv, mv, flat(P.v(b) + t.offset, t.numel, di),
                            ops::AdamWParams{lr, cfg.beta1, cfg.beta2, cfg.adam_eps, wd, step + 1}, clip_scale);
        } else {
          ops::sgd_update(s, pv, gv, mv, ops::SgdParams{lr, cfg.momentum, wd, false}, clip_scale);
        }
      }
    }
    s.synchronize();
    const double loss = loss_sum / (static_cast<double>(positions) * accum);
    ZT_REQUIRE(std::isfinite(loss), "the training loss became ", loss, " at step ", step + 1,
               "; lower --lr or enable --grad-clip");
    const double dt = seconds_since(ts);
    train_time += dt;
    result.losses.push_back(loss);
    result.final_loss = loss;
    const double tokens_done = static_cast<double>(step + 1) * cfg.batch_size * T;
    const double tps = tokens_done / std::max(train_time, 1e-9);
    emit({{"step", step + 1}, {"loss", loss}, {"lr", lr}, {"tokens_per_s", static_cast<double>(cfg.batch_size) * T / dt},
          {"grad_norm", grad_norm}, {"step_ms", dt * 1e3}});
    if (!cfg.quiet && (tty || (step + 1) % print_every == 0 || step + 1 == cfg.steps)) {
      const double el = seconds_since(t0);
      const double eta = el / (step + 1) * (cfg.steps - step - 1);
      std::printf("%sstep %*d/%d | loss %.4f | lr %.2e | %s tok/s | norm %.3f | %s elapsed | ETA %s%s",
                  tty ? "\r" : "", static_cast<int>(std::to_string(cfg.steps).size()), step + 1, cfg.steps, loss, lr,
                  si(tps).c_str(), grad_norm, hms(el).c_str(), hms(eta).c_str(), tty ? "   " : "\n");
      std::fflush(stdout);
    }
    const bool last = step + 1 == cfg.steps;
    if ((cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last) {
      double acc = 0;
      result.val_loss = evaluate(is_gpt ? nullptr : &acc);
      if (!is_gpt) result.accuracy = acc;
      nlohmann::json ev = {{"event", "eval"}, {"step", step + 1}, {"val_loss", result.val_loss}};
      if (!is_gpt) ev["accuracy"] = acc;
      emit(ev);
      if (!cfg.quiet) {
        std::printf("%seval at step %d: val loss %.4f", tty ? "\n" : "", step + 1, result.val_loss);
        if (!is_gpt) std::printf(", test accuracy %.2f%%", acc * 100);
        if (result.entropy_floor) std::printf(" (floor %.4f)", *result.entropy_floor);
        std::printf("\n");
      }
    }
    if (is_gpt && cfg.sample_every > 0 && (step + 1) % cfg.sample_every == 0 && !last && !cfg.quiet) {
      std::printf("%s--- sample at step %d ---\n", tty ? "\n" : "", step + 1);
      print_sample_text(sample(cfg.sample_tokens, static_cast<uint64_t>(step)));
    }
  }
  result.steps = cfg.steps;
  result.seconds = seconds_since(t0);
  result.tokens_per_s = static_cast<double>(cfg.steps) * cfg.batch_size * T / std::max(train_time, 1e-9);
  if (is_gpt && cfg.sample_tokens > 0) {
    result.sample = sample(cfg.sample_tokens, 0xfeed);
    if (!cfg.quiet) {
      std::printf("--- sample (%d tokens, temperature %.2f, top-k %d) ---\n", cfg.sample_tokens, cfg.temperature, cfg.top_k);
      print_sample_text(result.sample);
    }
  }
  for (int i = 0; i < rt->size(); ++i) result.peak_bytes_per_device.push_back(rt->device(i).memory().stats().peak_allocated_bytes);

  nlohmann::json summary = {{"event", "summary"},
                            {"steps", result.steps},
                            {"final_loss", result.final_loss},
                            {"val_loss", result.val_loss},
                            {"tokens_per_s", result.tokens_per_s},
                            {"seconds", result.seconds},
                            {"peak_bytes_per_device", result.peak_bytes_per_device},
                            {"parameters", layout.total_parameters()},
                            {"devices", rt->size()}};
  if (result.entropy_floor) summary["entropy_floor"] = *result.entropy_floor;
  if (result.accuracy) summary["accuracy"] = *result.accuracy;
  emit(summary);
  if (metrics) std::fclose(metrics);
  if (!cfg.quiet) {
    std::printf("summary: %d steps in %s, final loss %.4f, val loss %.4f", result.steps, hms(result.seconds).c_str(),
                result.final_loss, result.val_loss);
    if (result.entropy_floor) std::printf(" (floor %.4f)", *result.entropy_floor);
    if (result.accuracy) std::printf(", test accuracy %.2f%%", *result.accuracy * 100);
    std::printf(", %s tok/s, peak memory %.1f MiB\n", si(result.tokens_per_s).c_str(),
                static_cast<double>(result.peak_bytes_per_device[0]) / (1 << 20));
  }
  return result;
}

}  // namespace zt
