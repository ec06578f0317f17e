// The per-element Adam update (decoupled weight decay, as torch.optim.AdamW), shared by the CUDA
// kernel (adam.cu) and the host harness that CI compares with torch.
#pragma once

#include "numeric.cuh"

namespace bmt {

// Per-step scalars, computed once on the host in double precision.
struct AdamScalars {
  float beta1;
  float beta2;
  float eps;
  float decay;         // 1 - lr * weight_decay
  float step_size;     // lr / (1 - beta1^step)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float inv_scale;     // 1 / loss scale: gradients arrive scaled
};

BMT_HD void adam_update(float grad, float& weight, float& exp_avg, float& exp_avg_sq, const AdamScalars& s) {
  float g = grad * s.inv_scale;
  exp_avg = s.beta1 * exp_avg + (1.0f - s.beta1) * g;
  exp_avg_sq = s.beta2 * exp_avg_sq + (1.0f - s.beta2) * g * g;
  float denom = sqrtf(exp_avg_sq) * s.inv_bc2_sqrt + s.eps;
  weight = weight * s.decay - s.step_size * (exp_avg / denom);
}

// Element i of a flat range: with a master copy (low-precision params) the update runs on the fp32
// master and the parameter receives its rounding; without one the parameter is updated in place.
template <typename C>
BMT_HD void adam_element(typename C::storage* param, const typename C::storage* grad, float* master,
                         float* exp_avg, float* exp_avg_sq, long long i, const AdamScalars& s) {
  float weight = master ? master[i] : C::load(param[i]);
  adam_update(C::load(grad[i]), weight, exp_avg[i], exp_avg_sq[i], s);
  if (master) master[i] = weight;
  param[i] = C::store(weight);
}

}  // namespace bmt
