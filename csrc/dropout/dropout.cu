// Philox dropout on the GPU: one thread per element in a grid-stride loop; the mask comes from
// common/philox.h (the stream of Triton's tl.rand and of the CPU kernel), so it is never stored.
#include "dropout/dropout.h"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/philox.h"

namespace remat {
namespace {

constexpr int kThreads = 256;
// Past 65536 blocks the threads loop: more threads than any GPU holds at once.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

__device__ inline float load_float(const float* x, int64_t i) { return x[i]; }
__device__ inline float load_float(const __half* x, int64_t i) { return __half2float(x[i]); }
__device__ inline float load_float(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ inline void store_float(float* y, int64_t i, float v) { y[i] = v; }
__device__ inline void store_float(__half* y, int64_t i, float v) { y[i] = __float2half_rn(v); }
__device__ inline void store_float(__nv_bfloat16* y, int64_t i, float v) { y[i] = __float2bfloat16_rn(v); }

template <typename T>
__global__ void philox_dropout_kernel(const T* __restrict__ x, T* __restrict__ y, const int64_t* __restrict__ rng,
                                      int64_t numel, float p, float keep_divisor) {
  const uint64_t seed = static_cast<uint64_t>(rng[0]), offset = static_cast<uint64_t>(rng[1]);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool keep = dropout_keep(seed, offset, static_cast<uint64_t>(i), p);
    store_float(y, i, keep ? load_float(x, i) / keep_divisor : 0.0f);
  }
}

template <typename T>
cudaError_t launch(const void* x, void* y, const int64_t* rng, int64_t numel, float p, float keep_divisor,
                   cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const int64_t blocks = std::min((numel + kThreads - 1) / kThreads, kMaxBlocks);
  philox_dropout_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<T*>(y), rng, numel, p, keep_divisor);
  return cudaGetLastError();
}

}  // namespace

cudaError_t philox_dropout_cuda(const void* x, void* y, const int64_t* rng, int64_t numel, float p,
                                float keep_divisor, ScalarKind kind, cudaStream_t stream) {
  switch (kind) {
    case ScalarKind::kFloat32: return launch<float>(x, y, rng, numel, p, keep_divisor, stream);
    case ScalarKind::kFloat16: return launch<__half>(x, y, rng, numel, p, keep_divisor, stream);
    case ScalarKind::kBFloat16: return launch<__nv_bfloat16>(x, y, rng, numel, p, keep_divisor, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace remat
