// Launch interface of the CUDA epilogue kernels of the fused linear + cross-entropy (no torch
// headers). The GEMMs that produce each vocabulary chunk's logits are cuBLAS's, called by the ATen
// glue (cross_entropy_cuda.cpp); these kernels turn a chunk of logits into running softmax
// statistics (forward) or into the logits' gradient, in place (backward).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/scalar_kind.h"
#include "cross_entropy/cross_entropy_math.h"

namespace remat {

// One chunk of logits: [rows, cols] contiguous in x's type, columns [col_start, col_start + cols)
// of the vocabulary. target: int64 [rows].
struct LceChunk {
  void* logits;
  int64_t rows;
  int64_t cols;
  int64_t col_start;
  const int64_t* target;
  int64_t ignore_index;
  LceCoefficients coefficients;
};

// Forward: folds the chunk into the fp32 running statistics of each row (row_max, sum_exp of
// exp(z - row_max), sum_z and z_target; initialised by the caller to -inf, 0, 0, 0).
cudaError_t lce_fwd_chunk_cuda(const LceChunk& chunk, float* row_max, float* sum_exp, float* sum_z, float* z_target,
                               ScalarKind kind, cudaStream_t stream);

// Forward, after the last chunk: lse = row_max + log(sum_exp) and each row's loss (0 for ignored).
cudaError_t lce_fwd_finalize_cuda(int64_t rows, const int64_t* target, int64_t ignore_index,
                                  const LceCoefficients& coefficients, const float* row_max, const float* sum_exp,
                                  const float* sum_z, const float* z_target, float* loss, float* lse,
                                  cudaStream_t stream);

// Backward: overwrites the chunk's logits with their gradient dz (lce_dlogit, rounded to the
// logits' type). lse, grad_loss: fp32 [rows]; grad_lse: fp32 [rows] or nullptr.
cudaError_t lce_bwd_chunk_cuda(const LceChunk& chunk, const float* lse, const float* grad_loss,
                               const float* grad_lse, ScalarKind kind, cudaStream_t stream);

}  // namespace remat
