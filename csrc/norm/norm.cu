// Host launchers of the norm kernels (norm_kernel.cuh): argument checks, the vectorized or scalar
// path, the block shape, the launch. Only CUDA headers, so this file compiles in seconds.
#include "norm/norm.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "norm/norm_kernel.cuh"

namespace remat {
namespace {

using norm_detail::kBwdRegisterChunks;
using norm_detail::kFwdRegisterChunks;
using norm_detail::kMaxBlockThreads;
using norm_detail::kWarpSize;
using norm_detail::kWarpsPerBlock;

constexpr int64_t kMinBlockThreads = 64;
// Threads an SM holds at once with 64 registers each (65536 registers per SM on sm_80 and sm_90).
constexpr int64_t kResidentThreadsPerSm = 1024;

struct RowLayout {
  int threads_per_row;  // kWarpSize (warp per row) or block_threads (block per row)
  int block_threads;
};

// `register_chunks`: the chunks per thread the kernel keeps in registers (forward: the cached
// input, 16 values, 8 on the scalar path; backward: the dw/db accumulators, 8 + 8 values). One
// warp per row, kWarpsPerBlock rows per block, while a warp's registers hold the row: up to 512
// columns forward (256 scalar) and 256 backward, which the backward's warp-per-row mode requires.
// Otherwise one block per row with just enough threads for its registers to hold the row (one
// 16-byte access per tensor and chunk, few idle lanes), at least two warps and at most
// kMaxBlockThreads; past 16K columns forward (8K scalar) and 8K backward a thread has more chunks
// than registers hold.
RowLayout choose_layout(int64_t cols, int vec, int register_chunks) {
  const int64_t vectors = ceil_div(cols, vec);
  if (vectors <= static_cast<int64_t>(kWarpSize) * register_chunks) {
    return {kWarpSize, kWarpSize * kWarpsPerBlock};
  }
  const int64_t wanted = ceil_div(ceil_div(vectors, register_chunks), kWarpSize) * kWarpSize;
  const int64_t threads = std::clamp<int64_t>(wanted, kMinBlockThreads, kMaxBlockThreads);
  return {static_cast<int>(threads), static_cast<int>(threads)};
}

bool is_aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <typename T, int VEC, bool IS_RMS>
cudaError_t launch_fwd(const NormFwdParams& params, cudaStream_t stream) {
  const RowLayout layout = choose_layout(params.cols, VEC, kFwdRegisterChunks<VEC>);
  const int64_t rows_per_block = layout.block_threads / layout.threads_per_row;
  const int64_t grid = std::min<int64_t>(ceil_div(params.rows, rows_per_block), INT_MAX);
  norm_detail::norm_fwd_kernel<T, VEC, IS_RMS>
      <<<static_cast<unsigned>(grid), layout.block_threads, 0, stream>>>(params,
                                                                           layout.threads_per_row);
  return cudaGetLastError();
}

template <typename T, int VEC, bool IS_RMS>
cudaError_t launch_bwd(const NormBwdParams& params, cudaStream_t stream) {
  const RowLayout layout = choose_layout(params.cols, VEC, kBwdRegisterChunks<VEC>);
  const bool warp_per_row = layout.threads_per_row == kWarpSize;
  const size_t staging_bytes =
      warp_per_row ? static_cast<size_t>(layout.block_threads) * VEC * sizeof(float) : 0;
  norm_detail::norm_bwd_kernel<T, VEC, IS_RMS>
      <<<params.num_partials, layout.block_threads, staging_bytes, stream>>>(
          params, layout.threads_per_row);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_fwd(const NormFwdParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool has_residual = p.residual != nullptr;
  const bool vectorized = p.cols % kVec == 0 && p.x_row_stride % kVec == 0 &&
                          (!has_residual || p.residual_row_stride % kVec == 0) &&
                          is_aligned(p.x, 16) && is_aligned(p.residual, 16) &&
                          is_aligned(p.weight, 16) && is_aligned(p.bias, 16) &&
                          is_aligned(p.y, 16) && (!has_residual || is_aligned(p.h, 16));
  if (p.is_rms) {
    return vectorized ? launch_fwd<T, kVec, true>(p, stream) : launch_fwd<T, 1, true>(p, stream);
  }
  return vectorized ? launch_fwd<T, kVec, false>(p, stream) : launch_fwd<T, 1, false>(p, stream);
}

template <typename T>
cudaError_t dispatch_bwd(const NormBwdParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool has_dh = p.dh != nullptr;
  const bool vectorized = p.cols % kVec == 0 && p.dy_row_stride % kVec == 0 &&
                          p.h_row_stride % kVec == 0 && (!has_dh || p.dh_row_stride % kVec == 0) &&
                          is_aligned(p.dy, 16) && is_aligned(p.dh, 16) && is_aligned(p.h, 16) &&
                          is_aligned(p.weight, 16) && is_aligned(p.dx, 16) &&
                          is_aligned(p.dw_partial, 16) && is_aligned(p.db_partial, 16);
  if (p.is_rms) {
    return vectorized ? launch_bwd<T, kVec, true>(p, stream) : launch_bwd<T, 1, true>(p, stream);
  }
  return vectorized ? launch_bwd<T, kVec, false>(p, stream) : launch_bwd<T, 1, false>(p, stream);
}

}  // namespace

int norm_bwd_num_partials(int64_t rows, int64_t cols, int sm_count) {
  // One partial per block. The backward's block for this width (choose_layout; the scalar layout
  // has the same size, 8 values per thread, up to rounding) times blocks per SM should fill the
  // 1024 threads an SM can hold at the kernels' 64 registers per thread: more partials would only
  // add [num_partials, cols] fp32 traffic (about 1024 * 8 values per SM per array, written here
  // and read by the caller's sum); fewer would leave SMs idle. Never more than rows.
  const int64_t block_threads = choose_layout(cols, 1, kBwdRegisterChunks<1>).block_threads;
  const int64_t blocks_per_sm = std::max<int64_t>(1, kResidentThreadsPerSm / block_threads);
  const int64_t partials = std::min(rows, std::max(sm_count, 1) * blocks_per_sm);
  return static_cast<int>(std::clamp<int64_t>(partials, 1, INT_MAX));
}

cudaError_t norm_fwd_cuda(const NormFwdParams& params, ScalarKind kind, cudaStream_t stream) {
  if (params.rows < 0 || params.cols < 0) return cudaErrorInvalidValue;
  if (params.rows == 0 || params.cols == 0) return cudaSuccess;
  if (params.x == nullptr || params.y == nullptr || params.rstd == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (params.residual != nullptr && params.h == nullptr) return cudaErrorInvalidValue;
  if (params.is_rms ? params.bias != nullptr : params.mean == nullptr) return cudaErrorInvalidValue;
  switch (kind) {
    case ScalarKind::kFloat32:
      return dispatch_fwd<float>(params, stream);
    case ScalarKind::kFloat16:
      return dispatch_fwd<__half>(params, stream);
    case ScalarKind::kBFloat16:
      return dispatch_fwd<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t norm_bwd_cuda(const NormBwdParams& params, ScalarKind kind, cudaStream_t stream) {
  if (params.rows < 0 || params.cols < 0 || params.num_partials < 1) return cudaErrorInvalidValue;
  // No columns: dx and the partials are empty. No rows but columns: the kernel still runs, to
  // write zeros to the partials.
  if (params.cols == 0) return cudaSuccess;
  if (params.rows > 0 &&
      (params.dy == nullptr || params.h == nullptr || params.rstd == nullptr ||
       params.dx == nullptr || (!params.is_rms && params.mean == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (params.is_rms && params.db_partial != nullptr) return cudaErrorInvalidValue;
  switch (kind) {
    case ScalarKind::kFloat32:
      return dispatch_bwd<float>(params, stream);
    case ScalarKind::kFloat16:
      return dispatch_bwd<__half>(params, stream);
    case ScalarKind::kBFloat16:
      return dispatch_bwd<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace remat
