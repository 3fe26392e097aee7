// Launch logic of the flash-attention kernels (attention_kernel.cuh), shared by the CUDA launchers
// (attention.cu) and the CPU emulation that runs the same kernels as host code
// (tests/cuda_emulation): argument checks, the 16-byte access conditions (TileFlags), the dtype and
// head-dim bucket dispatch, the grids and the kernel sequence of the backward. Host code only, no
// torch. The launch itself goes through a Launcher:
//   launcher(kernel, grid, threads, dynamic_smem_bytes, kernel_args...) -> cudaError_t
// and Launcher::kMaxGridStrideBlocks caps the grid of the grid-stride dq conversion kernel.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attention/attention.h"
#include "attention/attention_kernel.cuh"
#include "common/math.h"

namespace remat {
namespace attn_launch {

inline bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// A [*, *, *, D] operand can be moved in 16-byte packs of 8 elements when every row chunk of 8
// starts 16-byte aligned.
inline bool packs_ok(const void* ptr, int64_t head_dim, int64_t batch_stride, int64_t row_stride,
                     int64_t head_stride) {
  return head_dim % 8 == 0 && aligned_16(ptr) && batch_stride % 8 == 0 && row_stride % 8 == 0 &&
         head_stride % 8 == 0;
}

// The rope tables are read 8 floats at a time (two float4) from position * D/2 + c, c % 8 == 0.
inline bool rope_packs_ok(const float* cos, const float* sin, int64_t head_dim) {
  return cos != nullptr && (head_dim / 2) % 8 == 0 && aligned_16(cos) && aligned_16(sin);
}

// Shapes every kernel relies on (the ATen glue checks them with messages first).
inline bool valid_shape(int64_t batch, int64_t n, int64_t m, int64_t hq, int64_t hkv, int64_t head_dim) {
  return batch >= 1 && n >= 1 && m >= 1 && hq >= 1 && hkv >= 1 && hq % hkv == 0 && head_dim >= 1 &&
         head_dim <= kAttentionCudaMaxHeadDim && batch <= kAttentionCudaMaxGridYZ && hq <= kAttentionCudaMaxGridYZ &&
         ceil_div(std::max(n, m), 32) <= INT_MAX;
}

template <typename Params>
bool valid_options(const Params& p) {
  if ((p.cos == nullptr) != (p.sin == nullptr) || (p.cos != nullptr && p.head_dim % 2 != 0)) return false;
  return p.dropout_p >= 0.0f && p.dropout_p < 1.0f && (p.dropout_p == 0.0f || p.rng != nullptr);
}

// Calls launch.template operator()<T, DP>() for the dtype and the head-dim bucket.
template <typename Launch>
cudaError_t dispatch(ScalarKind kind, int64_t head_dim, const Launch& launch) {
  const int bucket = attn_detail::head_dim_bucket(head_dim);
  auto by_bucket = [&]<typename T>() -> cudaError_t {
    switch (bucket) {
      case 32: return launch.template operator()<T, 32>();
      case 64: return launch.template operator()<T, 64>();
      case 96: return launch.template operator()<T, 96>();
      case 128: return launch.template operator()<T, 128>();
      case 192: return launch.template operator()<T, 192>();
      case 256: return launch.template operator()<T, 256>();
    }
    return cudaErrorInvalidValue;
  };
  switch (kind) {
    case ScalarKind::kFloat16: return by_bucket.template operator()<__half>();
    case ScalarKind::kBFloat16: return by_bucket.template operator()<__nv_bfloat16>();
    case ScalarKind::kFloat32: return cudaErrorInvalidValue;  // fp32: the Triton and torch backends
  }
  return cudaErrorInvalidValue;
}

template <typename Launcher>
cudaError_t attention_fwd(const AttentionFwdParams& p, ScalarKind kind, const Launcher& launcher) {
  using attn_detail::FwdTiles;
  if (!valid_shape(p.batch, p.n, p.m, p.hq, p.hkv, p.head_dim) || !valid_options(p)) return cudaErrorInvalidValue;
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr || p.lse == nullptr) {
    return cudaErrorInvalidValue;
  }
  attn_detail::TileFlags flags{};
  flags.q_vec = packs_ok(p.q, p.head_dim, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  flags.k_vec = packs_ok(p.k, p.head_dim, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  flags.v_vec = packs_ok(p.v, p.head_dim, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  flags.rope_vec = rope_packs_ok(p.cos, p.sin, p.head_dim);
  flags.out_vec = p.head_dim % 8 == 0 && aligned_16(p.o);
  return dispatch(kind, p.head_dim, [&]<typename T, int DP>() -> cudaError_t {
    using L = FwdTiles<DP>;
    const dim3 grid(static_cast<unsigned>(ceil_div(p.n, L::kBlockM)), static_cast<unsigned>(p.hq),
                    static_cast<unsigned>(p.batch));
    return launcher(attn_detail::attention_fwd_kernel<T, DP>, grid, L::kThreads, L::kBytes, p, flags);
  });
}

template <typename Launcher>
cudaError_t attention_bwd(const AttentionBwdParams& p, ScalarKind kind, const Launcher& launcher) {
  using attn_detail::DkDvTiles;
  using attn_detail::DqTiles;
  using attn_detail::kSmallThreads;
  if (!valid_shape(p.batch, p.n, p.m, p.hq, p.hkv, p.head_dim) || !valid_options(p)) return cudaErrorInvalidValue;
  if (p.dout == nullptr || p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr ||
      p.lse == nullptr || p.dq == nullptr || p.dk == nullptr || p.dv == nullptr || p.delta == nullptr ||
      (!p.deterministic && p.dq_accum == nullptr)) {
    return cudaErrorInvalidValue;
  }
  attn_detail::TileFlags flags{};
  flags.q_vec = packs_ok(p.q, p.head_dim, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  flags.k_vec = packs_ok(p.k, p.head_dim, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  flags.v_vec = packs_ok(p.v, p.head_dim, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  flags.do_vec = packs_ok(p.dout, p.head_dim, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride);
  flags.rope_vec = rope_packs_ok(p.cos, p.sin, p.head_dim);
  flags.out_vec = false;  // the backward epilogues store element by element

  return dispatch(kind, p.head_dim, [&]<typename T, int DP>() -> cudaError_t {
    // 1. Delta = rowsum(dout * o), a warp per row (packed sequences: their total_q rows).
    const int64_t query_rows = p.cu_seqlens_q != nullptr ? p.total_q : p.batch * p.n;
    const int64_t delta_blocks = ceil_div(query_rows * p.hq, kSmallThreads / 32);
    if (delta_blocks > INT_MAX) return cudaErrorInvalidValue;
    cudaError_t err = launcher(attn_detail::attention_bwd_delta_kernel<T>, dim3(static_cast<unsigned>(delta_blocks)),
                               kSmallThreads, 0, p);
    if (err != cudaSuccess) return err;

    // 2. dK, dV (and, non-deterministic, dq into dq_accum with atomics).
    using KV = DkDvTiles<DP>;
    const dim3 kv_grid(static_cast<unsigned>(ceil_div(p.m, KV::kBlockN)), static_cast<unsigned>(p.hkv),
                       static_cast<unsigned>(p.batch));
    err = launcher(p.deterministic ? attn_detail::attention_bwd_dkdv_kernel<T, DP, false>
                                   : attn_detail::attention_bwd_dkdv_kernel<T, DP, true>,
                   kv_grid, KV::kThreads, KV::kBytes, p, flags);
    if (err != cudaSuccess) return err;

    if (p.deterministic) {
      // 3a. dQ, one block per query block, no atomics.
      using Q = DqTiles<DP>;
      const dim3 q_grid(static_cast<unsigned>(ceil_div(p.n, Q::kBlockM)), static_cast<unsigned>(p.hq),
                        static_cast<unsigned>(p.batch));
      return launcher(attn_detail::attention_bwd_dq_kernel<T, DP>, q_grid, Q::kThreads, Q::kBytes, p, flags);
    }
    // 3b. dq = inverse rope of dq_accum, cast (grid-stride; the cap only bounds the grid).
    const int64_t per_row = p.cos != nullptr ? p.head_dim / 2 : p.head_dim;
    const int64_t items = query_rows * p.hq * per_row;
    const int64_t blocks = std::min<int64_t>(ceil_div(items, kSmallThreads), Launcher::kMaxGridStrideBlocks);
    return launcher(attn_detail::attention_bwd_dq_convert_kernel<T>, dim3(static_cast<unsigned>(blocks)),
                    kSmallThreads, 0, p);
  });
}

}  // namespace attn_launch
}  // namespace remat
