// Host launchers of the flash-attention kernels (attention_kernel.cuh): the launch logic
// (attention_launch.h) with the CUDA launch itself, the shared-memory opt-in and the shared-memory
// query. Only CUDA headers, so this file compiles without torch.
#include "attention/attention.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "attention/attention_kernel.cuh"
#include "attention/attention_launch.h"

namespace remat {
namespace {

using attn_detail::DkDvTiles;
using attn_detail::DqTiles;
using attn_detail::FwdTiles;

constexpr int kDefaultSmemLimit = 48 * 1024;  // dynamic shared memory without the opt-in

// Launches on a stream. Kernels that need more than 48 KB of dynamic shared memory opt in first
// (per device; cheap to repeat), which fails with cudaErrorInvalidValue when the device has less
// than that per block.
struct StreamLauncher {
  static constexpr int64_t kMaxGridStrideBlocks = int64_t{1} << 16;
  cudaStream_t stream;

  template <typename... Params, typename... Args>
  cudaError_t operator()(void (*kernel)(Params...), dim3 grid, int threads, int smem_bytes, const Args&... args) const {
    if (smem_bytes > kDefaultSmemLimit) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
      if (err != cudaSuccess) return err;
    }
    kernel<<<grid, threads, smem_bytes, stream>>>(args...);
    return cudaGetLastError();
  }
};

}  // namespace

size_t attention_cuda_smem_bytes(int64_t head_dim) {
  auto bytes = [](auto dp) -> size_t {
    constexpr int kDp = decltype(dp)::value;
    return static_cast<size_t>(
        std::max({FwdTiles<kDp>::kBytes, DkDvTiles<kDp>::kBytes, DqTiles<kDp>::kBytes}));
  };
  switch (attn_detail::head_dim_bucket(head_dim)) {
    case 32: return bytes(std::integral_constant<int, 32>{});
    case 64: return bytes(std::integral_constant<int, 64>{});
    case 96: return bytes(std::integral_constant<int, 96>{});
    case 128: return bytes(std::integral_constant<int, 128>{});
    case 192: return bytes(std::integral_constant<int, 192>{});
    default: return bytes(std::integral_constant<int, 256>{});
  }
}

cudaError_t attention_fwd_cuda(const AttentionFwdParams& p, ScalarKind kind, cudaStream_t stream) {
  return attn_launch::attention_fwd(p, kind, StreamLauncher{stream});
}

cudaError_t attention_bwd_cuda(const AttentionBwdParams& p, ScalarKind kind, cudaStream_t stream) {
  return attn_launch::attention_bwd(p, kind, StreamLauncher{stream});
}

}  // namespace remat
