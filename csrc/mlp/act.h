// Launch interface of the CUDA MLP activation kernels (no torch headers; see norm/norm.h).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/activation.h"
#include "common/scalar_kind.h"

namespace remat {

// All pointers: contiguous arrays of `numel` elements of the given kind (fp32 math inside).
// glu forward: h = act(gate) * up. act forward (up == nullptr): h = act(gate).
cudaError_t act_fwd_cuda(const void* gate, const void* up, void* h, int64_t numel, Activation activation,
                         ScalarKind kind, cudaStream_t stream);

// glu backward: dgate = dh * up * act'(gate), dup = dh * act(gate), h = act(gate) * up (when h is
// not nullptr). act backward (up == nullptr, dup == nullptr): dgate = dh * act'(gate), h = act(gate).
cudaError_t act_bwd_cuda(const void* dh, const void* gate, const void* up, void* dgate, void* dup, void* h,
                         int64_t numel, Activation activation, ScalarKind kind, cudaStream_t stream);

}  // namespace remat
