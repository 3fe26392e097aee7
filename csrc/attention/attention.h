// Launch interface of the CUDA flash-attention kernels. Plain C++: no torch headers, so that the
// .cu file that implements it compiles with nvcc alone and the ATen glue (attention_cuda.cpp)
// compiles with g++. The math follows python/remat/ops/attention.py (the contract of every
// backend); the per-element pieces come from common/attention_math.h and common/philox.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "common/scalar_kind.h"

namespace remat {

// Forward. q [B, N, Hq, D]; k, v [B, M, Hkv, D] (Hq % Hkv == 0; query head h reads kv head
// h / (Hq / Hkv)); strides in elements for the batch, row (token) and head dims, unit stride in
// the head dim. o: [B, N, Hq, D] contiguous, q's dtype. lse: fp32 [B, Hq, N] contiguous, +inf
// for a row that sees no key (whose o row is 0).
// cos, sin: fp32 [Bc, S, D/2] contiguous tables or nullptr (no rope); rope_batch_stride is
// S * D/2 when Bc == B and 0 when Bc == 1. Key j is rotated at position j, query i at i + M - N.
// rng: device pointer to int64 (seed, offset), read by the kernels, when dropout_p > 0; else
// nullptr. window_left / window_right: -1 = unbounded (causal is window_right = 0). softcap:
// 0 = off.
// Packed (variable-length) sequences: cu_seqlens_q / cu_seqlens_k, device int32 [batch + 1]
// offsets (nullptr for a dense call): q is [total_q, Hq, D] and k, v [total_k, Hkv, D] with batch
// strides 0, batch is the number of sequences S, n / m their max_seqlen bounds (the grids and the
// dropout stream rows of the zero-padded batch), o [total_q, Hq, D], lse [Hq, total_q]. Rope:
// rope_batch_stride 0 and rope_token_stride D/2 for per-token tables [1, T, D/2] (rows follow the
// packed keys), 0 for tables [S_rows, D/2] that restart in every sequence.
struct AttentionFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  const float* cos;
  const float* sin;
  const int64_t* rng;
  int64_t batch, n, m, hq, hkv, head_dim;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t rope_batch_stride;
  int64_t window_left, window_right;
  float scale, softcap, dropout_p;
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int64_t total_q, rope_token_stride;
};

// Backward with recompute. dout and o are [B, N, Hq, D] with the given strides (unit head-dim
// stride); q, k, v, lse, cos, sin, rng, and the scalars as in the forward. dq [B, N, Hq, D] and
// dk, dv [B, M, Hkv, D]: contiguous, q's dtype.
// Workspaces the caller allocates: delta, fp32 [B, Hq, N] (written here: rowsum(dout * o));
// dq_accum, fp32 [B, N, Hq, D] filled with zeros when !deterministic (the dK/dV kernel adds the
// dq contributions into it with atomics), nullptr when deterministic (a separate dQ kernel, no
// atomics: the result is bitwise reproducible for a given shape and device).
struct AttentionBwdParams {
  const void* dout;
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const float* lse;
  const float* cos;
  const float* sin;
  const int64_t* rng;
  void* dq;
  void* dk;
  void* dv;
  float* delta;
  float* dq_accum;
  int64_t batch, n, m, hq, hkv, head_dim;
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t rope_batch_stride;
  int64_t window_left, window_right;
  float scale, softcap, dropout_p;
  bool deterministic;
  const int32_t* cu_seqlens_q;  // packed sequences as in AttentionFwdParams (Delta [Hq, total_q],
  const int32_t* cu_seqlens_k;  // dq_accum [total_q, Hq, D]); nullptr for a dense call
  int64_t total_q, rope_token_stride;
};

// Largest head dim the kernels take (they pad D with zeros to a bucket of 32, 64, 96, 128, 192
// or 256 in shared memory).
constexpr int64_t kAttentionCudaMaxHeadDim = 256;
// Grid limits: the batch and the query heads index grid.z and grid.y.
constexpr int64_t kAttentionCudaMaxGridYZ = 65535;

// Dynamic shared memory (bytes per block) the largest of the forward and backward kernels needs
// at this head dim; the caller compares it with cudaDevAttrMaxSharedMemoryPerBlockOptin so that
// a GPU with less (e.g. sm_86/sm_89 at D > 128) gets a clear error instead of a failed launch.
size_t attention_cuda_smem_bytes(int64_t head_dim);

// Launch on `stream` (kind: kFloat16 or kBFloat16); return the first launch error
// (cudaSuccess when every launch went through).
cudaError_t attention_fwd_cuda(const AttentionFwdParams& params, ScalarKind kind, cudaStream_t stream);
cudaError_t attention_bwd_cuda(const AttentionBwdParams& params, ScalarKind kind, cudaStream_t stream);

}  // namespace remat
