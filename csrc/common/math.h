// Scalar math shared by the CUDA kernels and the C++ CPU kernels, so that both compute the same
// arithmetic. Compiles with g++ (host only) and with nvcc (host and device).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define REMAT_HOST_DEVICE __host__ __device__
#else
#define REMAT_HOST_DEVICE
#endif

namespace remat {

// ceil(a / b) for a >= 0, b > 0: grid sizes and tile counts.
inline REMAT_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 1/sqrt(v). On the device rsqrtf (at most 2 ulp from the exact value, as torch's CUDA norms use);
// on the host 1/std::sqrt, which may differ from the device result in the last bits.
inline REMAT_HOST_DEVICE float reciprocal_sqrt(float v) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(v);
#else
  return 1.0f / std::sqrt(v);
#endif
}

// RMSNorm: 1/sqrt(mean(u^2) + eps) from the fp32 sum of squares over a row of `cols` elements.
inline REMAT_HOST_DEVICE float rms_rstd(float sum_sq, int64_t cols, float eps) {
  return reciprocal_sqrt(sum_sq / static_cast<float>(cols) + eps);
}

// LayerNorm: 1/sqrt(var + eps), var being the centered (two-pass) biased variance of the row.
inline REMAT_HOST_DEVICE float layer_norm_rstd(float var, float eps) {
  return reciprocal_sqrt(var + eps);
}

}  // namespace remat
