// Per-row cross-entropy math (with label smoothing), shared by the CUDA kernels (cross_entropy.cu)
// and the host harness that CI compares with torch.nn.functional.cross_entropy.
#pragma once

#include "numeric.cuh"

namespace bmt {

// Running softmax statistics of part of a row: merged pairwise, so any split of a row (threads of a
// block, chunks of a serial loop) reduces to the same quantities without a second pass.
struct SoftmaxAcc {
  float max;    // largest logit seen
  float sum;    // sum of exp(x - max)
  float sum_x;  // sum of the logits (the label-smoothing term)
};

BMT_HD SoftmaxAcc softmax_acc_empty() {
  SoftmaxAcc a;
  a.max = -infinity();
  a.sum = 0.0f;
  a.sum_x = 0.0f;
  return a;
}

BMT_HD void softmax_acc_push(SoftmaxAcc& a, float x) {
  a.sum_x += x;
  if (x > a.max) {
    a.sum = a.sum * expf(a.max - x) + 1.0f;
    a.max = x;
  } else if (a.max != -infinity()) {  // exp(-inf - -inf) would be NaN; the term is 0
    a.sum += expf(x - a.max);
  }
}

BMT_HD SoftmaxAcc softmax_acc_merge(const SoftmaxAcc& a, const SoftmaxAcc& b) {
  SoftmaxAcc r;
  r.sum_x = a.sum_x + b.sum_x;
  r.max = a.max > b.max ? a.max : b.max;
  if (r.max == -infinity()) {
    r.sum = 0.0f;
  } else {
    r.sum = a.sum * expf(a.max - r.max) + b.sum * expf(b.max - r.max);
  }
  return r;
}

BMT_HD float softmax_acc_lse(const SoftmaxAcc& a) { return a.max + logf(a.sum); }

// Loss of one row: (1 - e) * (lse - x_target) + e * (lse - mean(x)), as torch defines smoothing.
BMT_HD float ce_loss(float lse, float x_target, float sum_x, float n_classes, float smoothing) {
  float loss = (1.0f - smoothing) * (lse - x_target);
  if (smoothing > 0.0f) loss += smoothing * (lse - sum_x / n_classes);  // 0 * -inf would be NaN
  return loss;
}

// Finish row `row` from its statistics: ignored rows give loss 0; an out-of-range target gives NaN
// (the kernel cannot raise; NaN surfaces in the loss instead of reading out of bounds).
template <typename C>
BMT_HD void ce_row_finish(const typename C::storage* row, long long target, long long n_classes,
                          long long ignore_index, float smoothing, const SoftmaxAcc& acc, float* loss,
                          float* lse) {
  if (target == ignore_index) {
    *loss = 0.0f;
    *lse = 0.0f;
    return;
  }
  float row_lse = softmax_acc_lse(acc);
  *lse = row_lse;
  if (target < 0 || target >= n_classes) {
    *loss = bits_to_float(0x7fc00000u);
    return;
  }
  *loss = ce_loss(row_lse, C::load(row[target]), acc.sum_x, static_cast<float>(n_classes), smoothing);
}

// d loss / d x for one element, times the row's incoming gradient `scale` (0 for ignored rows).
template <typename C>
BMT_HD typename C::storage ce_grad_element(typename C::storage x, float lse, bool is_target,
                                           float n_classes, float smoothing, float scale) {
  if (scale == 0.0f) return C::store(0.0f);
  float target_prob = smoothing / n_classes + (is_target ? 1.0f - smoothing : 0.0f);
  return C::store(scale * (expf(C::load(x) - lse) - target_prob));
}

}  // namespace bmt
