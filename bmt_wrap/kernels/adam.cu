// Fused Adam over one flat range per launch: load the (low-precision) gradient, unscale, update the
// moments and the fp32 master, write the parameter. CuPy JIT-compiles this file (kernel_source()
// inlines the headers); tools/check_cuda.py compile-checks it for sm_90.
#include "adam.cuh"

namespace bmt {

template <typename C>
__device__ void adam_range(typename C::storage* param, const typename C::storage* grad, float* master,
                           float* exp_avg, float* exp_avg_sq, long long n, const AdamScalars& s) {
  long long stride = static_cast<long long>(blockDim.x) * gridDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    adam_element<C>(param, grad, master, exp_avg, exp_avg_sq, i, s);
  }
}

}  // namespace bmt

#define BMT_ADAM_KERNEL(NAME, CODEC)                                                                \
  extern "C" __global__ void NAME(CODEC::storage* param, const CODEC::storage* grad, float* master, \
                                  float* exp_avg, float* exp_avg_sq, long long n, float beta1,      \
                                  float beta2, float eps, float decay, float step_size,             \
                                  float inv_bc2_sqrt, float inv_scale) {                            \
    bmt::AdamScalars s = {beta1, beta2, eps, decay, step_size, inv_bc2_sqrt, inv_scale};           \
    bmt::adam_range<CODEC>(param, grad, master, exp_avg, exp_avg_sq, n, s);                         \
  }

BMT_ADAM_KERNEL(bmt_adam_f32, bmt::F32)
BMT_ADAM_KERNEL(bmt_adam_bf16, bmt::BF16)
BMT_ADAM_KERNEL(bmt_adam_f16, bmt::F16)
