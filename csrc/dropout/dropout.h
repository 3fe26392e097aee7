// Launch interface of the CUDA Philox dropout kernel (no torch headers).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/scalar_kind.h"

namespace remat {

// y[i] = keep(i) ? x[i] / keep_divisor : 0, keep(i) = dropout_keeps(word i % 4 of
// philox4(seed, offset + i / 4), p) with (seed, offset) = rng[0], rng[1] read on the device
// (common/philox.h). x, y: contiguous arrays of `numel`.
cudaError_t philox_dropout_cuda(const void* x, void* y, const int64_t* rng, int64_t numel, float p,
                                float keep_divisor, ScalarKind kind, cudaStream_t stream);

}  // namespace remat
