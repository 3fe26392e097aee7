// CUDA epilogues of the fused linear + cross-entropy: one thread block per token row of a chunk
// of logits (cuBLAS computed them; see cross_entropy.h). The forward folds the row into the row's
// running softmax statistics with per-thread online (max, sum of exp) pairs merged across the
// block; the backward overwrites each logit with its gradient (cross_entropy_math.h, the CPU
// kernels' arithmetic). No atomics: each row's statistics are written by one thread.
#include "cross_entropy/cross_entropy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace remat {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ inline float load_float(const float* p, int64_t i) { return p[i]; }
__device__ inline float load_float(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ inline float load_float(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ inline void store_float(float* p, int64_t i, float v) { p[i] = v; }
__device__ inline void store_float(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ inline void store_float(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// (max, sum of exp(z - max)) of two partial rows merged; an empty part has max -inf.
__device__ inline void merge(float& m, float& s, float other_m, float other_s) {
  const float new_m = fmaxf(m, other_m);
  if (new_m == -INFINITY) return;
  s = s * expf(m - new_m) + other_s * expf(other_m - new_m);
  m = new_m;
}

// Block-wide merge of every thread's (m, s) and sums of a and b; the result in thread 0.
__device__ void block_reduce(float& m, float& s, float& a, float& b) {
  __shared__ float shared[4][kWarps];
  for (int offset = 16; offset > 0; offset /= 2) {
    const float om = __shfl_down_sync(0xffffffffu, m, offset), os = __shfl_down_sync(0xffffffffu, s, offset);
    merge(m, s, om, os);
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared[0][warp] = m;
    shared[1][warp] = s;
    shared[2][warp] = a;
    shared[3][warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      merge(m, s, shared[0][w], shared[1][w]);
      a += shared[2][w];
      b += shared[3][w];
    }
  }
}

template <typename T>
__global__ void lce_fwd_chunk_kernel(LceChunk chunk, float* __restrict__ row_max, float* __restrict__ sum_exp,
                                     float* __restrict__ sum_z, float* __restrict__ z_target) {
  const int64_t row = blockIdx.x;
  const T* logits = static_cast<const T*>(chunk.logits) + row * chunk.cols;
  const int64_t target_col = chunk.target[row] - chunk.col_start;
  float m = -INFINITY, s = 0.0f, total = 0.0f, at_target = 0.0f;
  for (int64_t j = threadIdx.x; j < chunk.cols; j += kThreads) {
    float th;
    const float z = lce_cap(load_float(logits, j), chunk.coefficients.softcap, &th);
    if (z > m) {
      s = s * expf(m - z) + 1.0f;
      m = z;
    } else {
      s += expf(z - m);
    }
    total += z;
    if (j == target_col) at_target = z;
  }
  block_reduce(m, s, total, at_target);
  if (threadIdx.x == 0) {
    float rm = row_max[row], rs = sum_exp[row];
    merge(rm, rs, m, s);
    row_max[row] = rm;
    sum_exp[row] = rs;
    sum_z[row] += total;
    z_target[row] += at_target;
  }
}

__global__ void lce_fwd_finalize_kernel(int64_t rows, const int64_t* __restrict__ target, int64_t ignore_index,
                                        LceCoefficients c, const float* __restrict__ row_max,
                                        const float* __restrict__ sum_exp, const float* __restrict__ sum_z,
                                        const float* __restrict__ z_target, float* __restrict__ loss,
                                        float* __restrict__ lse) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= rows) return;
  const float value = row_max[row] + logf(sum_exp[row]);
  lse[row] = value;
  loss[row] = target[row] != ignore_index ? lce_token_loss(value, z_target[row], sum_z[row], c) : 0.0f;
}

template <typename T>
__global__ void lce_bwd_chunk_kernel(LceChunk chunk, const float* __restrict__ lse, const float* __restrict__ grad_loss,
                                     const float* __restrict__ grad_lse) {
  const int64_t row = blockIdx.x;
  T* logits = static_cast<T*>(chunk.logits) + row * chunk.cols;
  const int64_t target = chunk.target[row];
  const float g = target != chunk.ignore_index ? grad_loss[row] : 0.0f;
  const float row_lse = lse[row];
  const LceRowTerms terms = lce_row_terms(g, row_lse, grad_lse != nullptr ? grad_lse[row] : 0.0f, chunk.coefficients);
  const int64_t target_col = target - chunk.col_start;
  const float softcap = chunk.coefficients.softcap;
  for (int64_t j = threadIdx.x; j < chunk.cols; j += kThreads) {
    float th;
    const float z = lce_cap(load_float(logits, j), softcap, &th);
    store_float(logits, j, lce_dlogit(z, th, j == target_col, row_lse, terms, softcap));
  }
}

template <typename T>
cudaError_t launch_fwd(const LceChunk& chunk, float* row_max, float* sum_exp, float* sum_z, float* z_target,
                       cudaStream_t stream) {
  lce_fwd_chunk_kernel<T><<<static_cast<unsigned>(chunk.rows), kThreads, 0, stream>>>(chunk, row_max, sum_exp, sum_z,
                                                                                      z_target);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const LceChunk& chunk, const float* lse, const float* grad_loss, const float* grad_lse,
                       cudaStream_t stream) {
  lce_bwd_chunk_kernel<T><<<static_cast<unsigned>(chunk.rows), kThreads, 0, stream>>>(chunk, lse, grad_loss,
                                                                                      grad_lse);
  return cudaGetLastError();
}

}  // namespace

cudaError_t lce_fwd_chunk_cuda(const LceChunk& chunk, float* row_max, float* sum_exp, float* sum_z, float* z_target,
                               ScalarKind kind, cudaStream_t stream) {
  if (chunk.rows == 0 || chunk.cols == 0) return cudaSuccess;
  switch (kind) {
    case ScalarKind::kFloat32: return launch_fwd<float>(chunk, row_max, sum_exp, sum_z, z_target, stream);
    case ScalarKind::kFloat16: return launch_fwd<__half>(chunk, row_max, sum_exp, sum_z, z_target, stream);
    case ScalarKind::kBFloat16: return launch_fwd<__nv_bfloat16>(chunk, row_max, sum_exp, sum_z, z_target, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t lce_fwd_finalize_cuda(int64_t rows, const int64_t* target, int64_t ignore_index,
                                  const LceCoefficients& coefficients, const float* row_max, const float* sum_exp,
                                  const float* sum_z, const float* z_target, float* loss, float* lse,
                                  cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = ceil_div(rows, kThreads);
  lce_fwd_finalize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      rows, target, ignore_index, coefficients, row_max, sum_exp, sum_z, z_target, loss, lse);
  return cudaGetLastError();
}

cudaError_t lce_bwd_chunk_cuda(const LceChunk& chunk, const float* lse, const float* grad_loss,
                               const float* grad_lse, ScalarKind kind, cudaStream_t stream) {
  if (chunk.rows == 0 || chunk.cols == 0) return cudaSuccess;
  switch (kind) {
    case ScalarKind::kFloat32: return launch_bwd<float>(chunk, lse, grad_loss, grad_lse, stream);
    case ScalarKind::kFloat16: return launch_bwd<__half>(chunk, lse, grad_loss, grad_lse, stream);
    case ScalarKind::kBFloat16: return launch_bwd<__nv_bfloat16>(chunk, lse, grad_loss, grad_lse, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace remat
