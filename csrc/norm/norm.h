// Launch interface of the CUDA norm kernels. Plain C++: no torch headers, so that the .cu files
// that implement it compile with nvcc alone, and the ATen glue (norm_cuda.cpp) compiles with g++.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/scalar_kind.h"

namespace remat {

// Forward of RMSNorm (is_rms) or LayerNorm over the last dimension of a [rows, cols] matrix.
// x and residual: row-major with unit column stride and the given row strides (in elements).
// h = x + residual, rounded to the input type, written to `h` (contiguous) when residual is set;
// the statistics are computed from that rounded h, exactly as the backward will read it.
// weight and bias: [cols] or nullptr; bias is always nullptr for RMSNorm.
// y: contiguous [rows, cols]. mean (LayerNorm only, else nullptr) and rstd: fp32 [rows].
struct NormFwdParams {
  const void* x;
  const void* residual;
  const void* weight;
  const void* bias;
  void* y;
  void* h;
  float* mean;
  float* rstd;
  int64_t rows;
  int64_t cols;
  int64_t x_row_stride;
  int64_t residual_row_stride;
  float eps;
  bool is_rms;
};

// Backward with recompute: x_hat is recomputed from h (the saved norm input), mean and rstd.
// dy, dh (gradient flowing into the returned h, or nullptr), h: unit column stride, row strides
// as given. dx: contiguous [rows, cols], dx = d(norm)/dh + dh, accumulated in fp32, rounded once.
// dw_partial / db_partial: fp32 [num_partials, cols], or nullptr when there is no weight / bias;
// partial p holds the sum over the rows the kernel assigned to partial p. The caller sums the
// partials over dim 0 in a fixed order (deterministic, no atomics).
struct NormBwdParams {
  const void* dy;
  const void* dh;
  const void* h;
  const void* weight;
  const float* mean;
  const float* rstd;
  void* dx;
  float* dw_partial;
  float* db_partial;
  int64_t rows;
  int64_t cols;
  int64_t dy_row_stride;
  int64_t dh_row_stride;
  int64_t h_row_stride;
  int num_partials;
  bool is_rms;
};

// Number of weight-gradient partials the backward uses for this shape on a device with
// `sm_count` multiprocessors (at most rows, at least 1).
int norm_bwd_num_partials(int64_t rows, int64_t cols, int sm_count);

// Launch on `stream`; return the launch error (cudaSuccess when the launch went through).
cudaError_t norm_fwd_cuda(const NormFwdParams& params, ScalarKind kind, cudaStream_t stream);
cudaError_t norm_bwd_cuda(const NormBwdParams& params, ScalarKind kind, cudaStream_t stream);

}  // namespace remat
