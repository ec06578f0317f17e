// Fused cross-entropy: the forward reduces each row in one block (no fp32 copy of the logits, one
// float of statistics saved per row); the backward writes the logits' gradient in their own dtype.
#include "cross_entropy.cuh"

#define BMT_CE_THREADS 256  // threads per row block; a power of two for the tree merge

namespace bmt {

template <typename C>
__device__ void ce_forward(const typename C::storage* logits, const long long* target, float* loss,
                           float* lse, long long n_classes, long long ignore_index, float smoothing) {
  __shared__ SoftmaxAcc part[BMT_CE_THREADS];
  long long row = blockIdx.x;
  const typename C::storage* x = logits + row * n_classes;
  SoftmaxAcc acc = softmax_acc_empty();
  for (long long j = threadIdx.x; j < n_classes; j += BMT_CE_THREADS) softmax_acc_push(acc, C::load(x[j]));
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = BMT_CE_THREADS / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) part[threadIdx.x] = softmax_acc_merge(part[threadIdx.x], part[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    ce_row_finish<C>(x, target[row], n_classes, ignore_index, smoothing, part[0], loss + row, lse + row);
  }
}

template <typename C>
__device__ void ce_backward(const typename C::storage* logits, const long long* target, const float* lse,
                            const float* row_scale, typename C::storage* grad, long long n_rows,
                            long long n_classes, float smoothing) {
  long long total = n_rows * n_classes;
  long long stride = static_cast<long long>(blockDim.x) * gridDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    long long row = i / n_classes;
    grad[i] = ce_grad_element<C>(logits[i], lse[row], i - row * n_classes == target[row],
                                 static_cast<float>(n_classes), smoothing, row_scale[row]);
  }
}

}  // namespace bmt

#define BMT_CE_KERNELS(SUFFIX, CODEC)                                                                    \
  extern "C" __global__ void bmt_ce_forward_##SUFFIX(const CODEC::storage* logits, const long long* target, \
                                                     float* loss, float* lse, long long n_classes,         \
                                                     long long ignore_index, float smoothing) {            \
    bmt::ce_forward<CODEC>(logits, target, loss, lse, n_classes, ignore_index, smoothing);                 \
  }                                                                                                         \
  extern "C" __global__ void bmt_ce_backward_##SUFFIX(const CODEC::storage* logits, const long long* target,\
                                                      const float* lse, const float* row_scale,            \
                                                      CODEC::storage* grad, long long n_rows,              \
                                                      long long n_classes, float smoothing) {              \
    bmt::ce_backward<CODEC>(logits, target, lse, row_scale, grad, n_rows, n_classes, smoothing);           \
  }

BMT_CE_KERNELS(f32, bmt::F32)
BMT_CE_KERNELS(bf16, bmt::BF16)
BMT_CE_KERNELS(f16, bmt::F16)
