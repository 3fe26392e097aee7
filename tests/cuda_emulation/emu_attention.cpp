// The CUDA flash-attention kernels (csrc/attention/attention_kernel.cuh) built for the CPU with the
// emulation of emu.h, behind a C interface for tests/test_cuda_emulation.py (ctypes).
//
// The launch logic is the real one (csrc/attention/attention_launch.h: argument checks, 16-byte
// access flags, dtype and head-dim dispatch, grids, the backward's kernel sequence); only the
// launcher differs: it runs each grid through emu::launch, and caps the grid of the grid-stride dq
// conversion at 3 blocks so that small tests take the grid-stride loop. Not covered here: the
// CUDA launcher itself (the triple-chevron launch, the shared-memory opt-in, stream handling) and
// the ATen glue (attention_cuda.cpp), which the test mirrors when it fills the parameter structs.
#include "emu.h"

#include <cstddef>
#include <cstdint>

#include "attention/attention.h"
#include "attention/attention_kernel.cuh"
#include "attention/attention_launch.h"

namespace remat {
namespace attn_detail {
// The kernels' `extern __shared__ unsigned char smem[]` (declared in this namespace).
alignas(1024) unsigned char smem[emu::kSmemCapacity];
}  // namespace attn_detail
}  // namespace remat

namespace {

struct EmuLauncher {
  static constexpr int64_t kMaxGridStrideBlocks = 3;

  template <typename... Params, typename... Args>
  cudaError_t operator()(void (*kernel)(Params...), dim3 grid, int threads, int smem_bytes, const Args&... args) const {
    const bool ok = emu::launch(grid, static_cast<unsigned>(threads), remat::attn_detail::smem,
                                static_cast<size_t>(smem_bytes), [&] { kernel(args...); });
    return ok ? cudaSuccess : cudaErrorLaunchFailure;
  }
};

}  // namespace

extern "C" {

// kind: the remat::ScalarKind value. Returns a cudaError_t value (0: success); after
// cudaErrorLaunchFailure, emu_last_error() says what went wrong inside the kernel.
int emu_attention_fwd(const remat::AttentionFwdParams* params, int kind) {
  return static_cast<int>(
      remat::attn_launch::attention_fwd(*params, static_cast<remat::ScalarKind>(kind), EmuLauncher{}));
}

int emu_attention_bwd(const remat::AttentionBwdParams* params, int kind) {
  return static_cast<int>(
      remat::attn_launch::attention_bwd(*params, static_cast<remat::ScalarKind>(kind), EmuLauncher{}));
}

const char* emu_last_error() { return emu::last_error(); }

// Layout checks for the ctypes mirrors of the parameter structs.
size_t emu_fwd_params_size() { return sizeof(remat::AttentionFwdParams); }
size_t emu_fwd_params_scale_offset() { return offsetof(remat::AttentionFwdParams, scale); }
size_t emu_bwd_params_size() { return sizeof(remat::AttentionBwdParams); }
size_t emu_bwd_params_scale_offset() { return offsetof(remat::AttentionBwdParams, scale); }

}  // extern "C"
