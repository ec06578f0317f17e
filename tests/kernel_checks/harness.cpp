// Host harness: runs the kernels' per-element functions (bmt_wrap/kernels/*.cuh) on the CPU, built
// with g++ and called through ctypes, so the tests compare the kernels' arithmetic with torch on
// machines without a GPU. Loops replace the grid; the row reduction mirrors the kernel's block.
#include <vector>

#include "adam.cuh"
#include "cross_entropy.cuh"

using namespace bmt;

namespace {

template <typename C>
void adam_all(void* param, const void* grad, float* master, float* m, float* v, long long n,
              const AdamScalars& s) {
  for (long long i = 0; i < n; ++i) {
    adam_element<C>(static_cast<typename C::storage*>(param), static_cast<const typename C::storage*>(grad),
                    master, m, v, i, s);
  }
}

// One row as the forward kernel reduces it: `threads` strided partial sums, then a tree merge.
template <typename C>
void ce_forward_rows(const void* logits, const long long* target, float* loss, float* lse, long long n_rows,
                     long long n_classes, long long ignore_index, float smoothing, int threads) {
  const typename C::storage* x = static_cast<const typename C::storage*>(logits);
  std::vector<SoftmaxAcc> part(threads);
  for (long long row = 0; row < n_rows; ++row) {
    const typename C::storage* r = x + row * n_classes;
    for (int t = 0; t < threads; ++t) {
      part[t] = softmax_acc_empty();
      for (long long j = t; j < n_classes; j += threads) softmax_acc_push(part[t], C::load(r[j]));
    }
    for (int stride = threads / 2; stride > 0; stride >>= 1) {
      for (int t = 0; t < stride; ++t) part[t] = softmax_acc_merge(part[t], part[t + stride]);
    }
    ce_row_finish<C>(r, target[row], n_classes, ignore_index, smoothing, part[0], loss + row, lse + row);
  }
}

template <typename C>
void ce_backward_all(const void* logits, const long long* target, const float* lse, const float* row_scale,
                     void* grad, long long n_rows, long long n_classes, float smoothing) {
  const typename C::storage* x = static_cast<const typename C::storage*>(logits);
  typename C::storage* g = static_cast<typename C::storage*>(grad);
  for (long long i = 0; i < n_rows * n_classes; ++i) {
    long long row = i / n_classes;
    g[i] = ce_grad_element<C>(x[i], lse[row], i - row * n_classes == target[row],
                              static_cast<float>(n_classes), smoothing, row_scale[row]);
  }
}

}  // namespace

extern "C" {

// dtype codes: 0 float32, 1 bfloat16, 2 float16.
void h_to_float(int dtype, const u16* in, float* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = dtype == 1 ? bf16_to_float(in[i]) : half_to_float(in[i]);
}

void h_from_float(int dtype, const float* in, u16* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = dtype == 1 ? float_to_bf16(in[i]) : float_to_half(in[i]);
}

void h_is_finite(const float* in, unsigned char* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = is_finite(in[i]) ? 1 : 0;
}

void h_adam(int dtype, void* param, const void* grad, float* master, float* m, float* v, long long n,
            float beta1, float beta2, float eps, float decay, float step_size, float inv_bc2_sqrt,
            float inv_scale) {
  AdamScalars s = {beta1, beta2, eps, decay, step_size, inv_bc2_sqrt, inv_scale};
  if (dtype == 0) adam_all<F32>(param, grad, master, m, v, n, s);
  if (dtype == 1) adam_all<BF16>(param, grad, master, m, v, n, s);
  if (dtype == 2) adam_all<F16>(param, grad, master, m, v, n, s);
}

void h_ce_forward(int dtype, const void* logits, const long long* target, float* loss, float* lse,
                  long long n_rows, long long n_classes, long long ignore_index, float smoothing, int threads) {
  if (dtype == 0) ce_forward_rows<F32>(logits, target, loss, lse, n_rows, n_classes, ignore_index, smoothing, threads);
  if (dtype == 1) ce_forward_rows<BF16>(logits, target, loss, lse, n_rows, n_classes, ignore_index, smoothing, threads);
  if (dtype == 2) ce_forward_rows<F16>(logits, target, loss, lse, n_rows, n_classes, ignore_index, smoothing, threads);
}

void h_ce_backward(int dtype, const void* logits, const long long* target, const float* lse,
                   const float* row_scale, void* grad, long long n_rows, long long n_classes, float smoothing) {
  if (dtype == 0) ce_backward_all<F32>(logits, target, lse, row_scale, grad, n_rows, n_classes, smoothing);
  if (dtype == 1) ce_backward_all<BF16>(logits, target, lse, row_scale, grad, n_rows, n_classes, smoothing);
  if (dtype == 2) ce_backward_all<F16>(logits, target, lse, row_scale, grad, n_rows, n_classes, smoothing);
}

}  // extern "C"
