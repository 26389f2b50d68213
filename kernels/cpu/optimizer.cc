// Adam and SGD steps on fp32 master weights (kernels/api.h). Plain scalar math in
// a fixed order per element: the result does not depend on the thread split, so
// replicas with the same inputs get the same bits.
#include <cmath>

#include "cpu_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cpu {

void optimizer_step(ThreadPool& pool, const OptimizerConfig& cfg, const OptimizerArgs& a) {
  cfg.validate();
  MOE_CHECK(a.step >= 1, "optimizer: step must be >= 1, got ", a.step);
  MOE_CHECK(cfg.kind == OptimizerKind::kSgd || (a.m && a.v), "optimizer: adam needs its moment buffers");
  const float lr = cfg.lr, b1 = cfg.beta1, b2 = cfg.beta2, eps = cfg.eps;
  const float c1 = 1.0f - static_cast<float>(std::pow(static_cast<double>(b1), static_cast<double>(a.step)));
  const float c2 = 1.0f - static_cast<float>(std::pow(static_cast<double>(b2), static_cast<double>(a.step)));
  parallel_blocks(pool, a.count, 1 << 14, [&](int64_t i0, int64_t i1, int) {
    for (int64_t i = i0; i < i1; ++i) {
      const float g = a.grad[i];
      float w = a.weight[i];
      if (cfg.kind == OptimizerKind::kSgd) {
        w -= lr * g;
      } else {
        const float m = b1 * a.m[i] + (1.0f - b1) * g;
        const float v = b2 * a.v[i] + (1.0f - b2) * g * g;
        a.m[i] = m;
        a.v[i] = v;
        w -= lr * (m / c1) / (std::sqrt(v / c2) + eps);
      }
      a.weight[i] = w;
      if (a.rounded) a.rounded[i] = round_to_bf16(w);
    }
  });
}

}  // namespace moe::kernels::cpu
