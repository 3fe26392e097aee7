// Device code of the fused RMSNorm / LayerNorm kernels (optionally with the residual add fused
// in front). The launchers are in norm.cu; the interface and the parameter structs in norm.h.
//
// Recompute contract. The forward saves only the norm input (x, or h = round(x + residual) which
// it writes anyway because the caller returns it) and fp32 statistics per row: rstd, plus mean for
// LayerNorm. It does not save x_hat or y. The backward recomputes
// x_hat = (h - mean) * rstd (RMSNorm: h * rstd) from them chunk by chunk in registers, which costs
// a few FLOPs per element instead of reading a saved [rows, cols] tensor.
//
// Work layout shared by both kernels. A row is handled by `threads_per_row` threads: one warp
// (several rows per block) when the row is narrow, or the whole block when it is wide; the
// launcher chooses. Thread `lane` of a row owns the chunks of VEC consecutive columns that start
// at lane * VEC + k * threads_per_row * VEC, k = 0, 1, ...; the loops walk the row by chunks, so
// any number of columns works. With VEC > 1 (16-byte loads and stores) the launcher guarantees
// that cols and every row stride are multiples of VEC and every base pointer is 16-byte aligned,
// so a chunk is either entirely inside the row or entirely past it.
//
// Determinism. Every sum has a fixed order for a given shape and launch: sequential within a
// thread, a fixed shuffle tree within a warp, warps in index order within a block. There are no
// atomics.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/math.h"
#include "common/pack.cuh"
#include "norm/norm.h"

namespace remat {
namespace norm_detail {

constexpr int kWarpSize = 32;

// Values per thread held in registers, as chunks of VEC columns.
// Forward: the first kFwdRegisterChunks<VEC> chunks of a thread's part of the row (16 values, 8 on
// the scalar path) stay in registers as fp32 between the statistics pass(es) and the output pass;
// later chunks are read again from global memory (L1/L2 hits: the block read them moments before).
// Backward: the dw and db accumulators of the first kBwdRegisterChunks<VEC> chunks of a thread's
// columns (8 + 8 values) live in registers across all the rows of its partial; the columns of
// later chunks (only in block-per-row mode, for rows wider than 8 * blockDim.x, so past 8192
// columns) accumulate in the block's own row of dw_partial / db_partial.
// These sizes keep the kernels within the 64 registers that kMaxBlockThreads allows, with at most
// a few values spilled to local memory (ptxas -v reports them).
template <int VEC>
constexpr int kFwdRegisterChunks = VEC == 1 ? 8 : 16 / VEC;
template <int VEC>
constexpr int kBwdRegisterChunks = 8 / VEC;
constexpr int kWarpsPerBlock = 8;
// The kernels are compiled for blocks of up to this many threads (__launch_bounds__), which caps
// them at 64 registers per thread.
constexpr int kMaxBlockThreads = 1024;

// VEC elements of T moved as one access: 16 bytes (one LDG.128/STG.128) when VEC = 16 / sizeof(T).
template <typename T, int VEC>
__device__ __forceinline__ void load_chunk(const T* ptr, float (&out)[VEC]) {
  const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(ptr);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(pack.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_chunk(T* ptr, const float (&in)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pack.v[i] = from_float<T>(in[i]);
  write_pack(ptr, pack);
}

template <int VEC>
__device__ __forceinline__ void fill(float (&values)[VEC], float value) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) values[i] = value;
}

// fp32 chunks of dw_partial / db_partial: float4 accesses when VEC is a multiple of 4 (the launcher
// then guarantees 16-byte alignment of those arrays), scalar ones otherwise.
template <int VEC>
constexpr int kFloatPackWidth = VEC % 4 == 0 ? 4 : 1;

template <int VEC>
__device__ __forceinline__ void load_float_chunk(const float* ptr, float (&out)[VEC]) {
  constexpr int kWidth = kFloatPackWidth<VEC>;
#pragma unroll
  for (int i = 0; i < VEC; i += kWidth) {
    const Pack<float, kWidth> pack = *reinterpret_cast<const Pack<float, kWidth>*>(ptr + i);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) out[i + j] = pack.v[j];
  }
}

template <int VEC>
__device__ __forceinline__ void store_float_chunk(float* ptr, const float (&in)[VEC]) {
  constexpr int kWidth = kFloatPackWidth<VEC>;
#pragma unroll
  for (int i = 0; i < VEC; i += kWidth) {
    Pack<float, kWidth> pack;
#pragma unroll
    for (int j = 0; j < kWidth; ++j) pack.v[j] = in[i + j];
    write_pack(ptr + i, pack);
  }
}

// Butterfly sum: every lane ends with the same, bit-identical total (a + b == b + a in IEEE).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Replaces each of the N values by its sum over the threads of one row, and gives every one of
// those threads the total. threads_per_row is either a warp (no shared memory, no barrier) or the
// whole block, whose threads must all call this together.
template <int N>
__device__ __forceinline__ void row_sum(float (&values)[N], int threads_per_row) {
#pragma unroll
  for (int n = 0; n < N; ++n) values[n] = warp_sum(values[n]);
  if (threads_per_row == kWarpSize) return;

  __shared__ float warp_totals[N][kWarpSize];
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;
  if (lane == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) warp_totals[n][warp] = values[n];
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) values[n] = warp_sum(lane < num_warps ? warp_totals[n][lane] : 0.0f);
  // The next call writes warp_totals again: every warp must have read it first.
  __syncthreads();
}

// Forward. Per row: u = x, or h = round_to_T(x + residual) (stored to params.h) and u = h.
// RMSNorm: rstd = 1/sqrt(mean(u^2) + eps), y = round_to_T(u * rstd * w).
// LayerNorm: mean = mean(u), var = mean((u - mean)^2) (a second, centered pass),
// rstd = 1/sqrt(var + eps), y = round_to_T((u - mean) * rstd * w + b).
// Saves rstd (and mean) as fp32 per row. Launch: blockDim.x a multiple of threads_per_row, which
// is kWarpSize or blockDim.x; any grid size (rows are walked in a grid-stride loop).
template <typename T, int VEC, bool IS_RMS>
__global__ void __launch_bounds__(kMaxBlockThreads)
    norm_fwd_kernel(const NormFwdParams params, const int threads_per_row) {
  constexpr int kCachedChunks = kFwdRegisterChunks<VEC>;
  const T* x = static_cast<const T*>(params.x);
  const T* residual = static_cast<const T*>(params.residual);
  const T* weight = static_cast<const T*>(params.weight);
  const T* bias = IS_RMS ? nullptr : static_cast<const T*>(params.bias);
  T* y = static_cast<T*>(params.y);
  T* h = static_cast<T*>(params.h);
  const int64_t rows = params.rows;
  const int64_t cols = params.cols;

  const int tid = static_cast<int>(threadIdx.x);
  const int rows_per_block = static_cast<int>(blockDim.x) / threads_per_row;
  const int row_in_block = tid / threads_per_row;
  const int lane_in_row = tid % threads_per_row;
  const int64_t first_col = static_cast<int64_t>(lane_in_row) * VEC;
  const int64_t col_stride = static_cast<int64_t>(threads_per_row) * VEC;
  const int64_t num_row_groups = ceil_div(rows, rows_per_block);

  for (int64_t group = blockIdx.x; group < num_row_groups; group += gridDim.x) {
    const int64_t row = group * rows_per_block + row_in_block;
    // Only in warp-per-row mode (a whole warp at once); a block-per-row block always has a row.
    if (row >= rows) continue;

    const T* x_row = x + row * params.x_row_stride;
    const T* residual_row =
        residual == nullptr ? nullptr : residual + row * params.residual_row_stride;
    T* h_row = residual == nullptr ? nullptr : h + row * cols;
    T* y_row = y + row * cols;

    // The norm input of one chunk; with a residual, also rounds h and writes it out.
    auto load_input = [&](int64_t col, float (&u)[VEC]) {
      load_chunk<T, VEC>(x_row + col, u);
      if (residual_row != nullptr) {
        float r[VEC];
        load_chunk<T, VEC>(residual_row + col, r);
        Pack<T, VEC> h_pack;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          h_pack.v[i] = from_float<T>(u[i] + r[i]);
          u[i] = to_float(h_pack.v[i]);
        }
        write_pack(h_row + col, h_pack);
      }
    };
    // The same values again for a chunk that was not kept in registers. h was written by this
    // same thread in the first pass, so the read sees it.
    auto reload_input = [&](int64_t col, float (&u)[VEC]) {
      load_chunk<T, VEC>(residual_row != nullptr ? h_row + col : x_row + col, u);
    };

    // Pass 1: sum of u (LayerNorm) or of u^2 (RMSNorm) over this thread's columns.
    float cache[kCachedChunks][VEC];
    float thread_sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kCachedChunks; ++k) {
      const int64_t col = first_col + k * col_stride;
      if (col < cols) {
        load_input(col, cache[k]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          thread_sum += IS_RMS ? cache[k][i] * cache[k][i] : cache[k][i];
        }
      }
    }
#pragma unroll 1
    for (int64_t col = first_col + kCachedChunks * col_stride; col < cols; col += col_stride) {
      float u[VEC];
      load_input(col, u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) thread_sum += IS_RMS ? u[i] * u[i] : u[i];
    }

    float mean = 0.0f;
    float rstd;
    if constexpr (IS_RMS) {
      float sums[1] = {thread_sum};
      row_sum(sums, threads_per_row);
      rstd = rms_rstd(sums[0], cols, params.eps);
    } else {
      float sums[1] = {thread_sum};
      row_sum(sums, threads_per_row);
      mean = sums[0] / static_cast<float>(cols);

      // Pass 2 (LayerNorm): centered sum of squares.
      float thread_sq = 0.0f;
#pragma unroll
      for (int k = 0; k < kCachedChunks; ++k) {
        const int64_t col = first_col + k * col_stride;
        if (col < cols) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float d = cache[k][i] - mean;
            thread_sq += d * d;
          }
        }
      }
#pragma unroll 1
      for (int64_t col = first_col + kCachedChunks * col_stride; col < cols; col += col_stride) {
        float u[VEC];
        reload_input(col, u);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = u[i] - mean;
          thread_sq += d * d;
        }
      }
      float squares[1] = {thread_sq};
      row_sum(squares, threads_per_row);
      rstd = layer_norm_rstd(squares[0] / static_cast<float>(cols), params.eps);
    }
    if (lane_in_row == 0) {
      if constexpr (!IS_RMS) params.mean[row] = mean;
      params.rstd[row] = rstd;
    }

    // Last pass: y.
    auto store_output = [&](int64_t col, const float (&u)[VEC]) {
      float w[VEC];
      if (weight != nullptr) {
        load_chunk<T, VEC>(weight + col, w);
      } else {
        fill(w, 1.0f);
      }
      float out[VEC];
      if constexpr (IS_RMS) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = u[i] * rstd * w[i];
      } else {
        float b[VEC];
        if (bias != nullptr) {
          load_chunk<T, VEC>(bias + col, b);
        } else {
          fill(b, 0.0f);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = (u[i] - mean) * rstd * w[i] + b[i];
      }
      store_chunk<T, VEC>(y_row + col, out);
    };
#pragma unroll
    for (int k = 0; k < kCachedChunks; ++k) {
      const int64_t col = first_col + k * col_stride;
      if (col < cols) store_output(col, cache[k]);
    }
#pragma unroll 1
    for (int64_t col = first_col + kCachedChunks * col_stride; col < cols; col += col_stride) {
      float u[VEC];
      reload_input(col, u);
      store_output(col, u);
    }
  }
}

// Warp-per-row backward: the warps of a block hold dw (or db) accumulators for the same columns.
// Adds them in warp order through shared memory `staging` ([warps][kWarpSize * VEC] floats) and
// writes columns [chunk_first_col, chunk_first_col + kWarpSize * VEC) of out_row. The whole block
// calls this together.
template <int VEC>
__device__ __forceinline__ void sum_warps_and_store(float* staging, const float (&acc)[VEC],
                                                    float* out_row, int64_t chunk_first_col,
                                                    int64_t cols) {
  constexpr int kChunkWidth = kWarpSize * VEC;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;
  // The previous call may still be reading staging.
  __syncthreads();
#pragma unroll
  for (int i = 0; i < VEC; ++i) staging[warp * kChunkWidth + lane * VEC + i] = acc[i];
  __syncthreads();
  for (int idx = tid; idx < kChunkWidth; idx += static_cast<int>(blockDim.x)) {
    const int64_t col = chunk_first_col + idx;
    if (col < cols) {
      float total = 0.0f;
      for (int w = 0; w < num_warps; ++w) total += staging[w * kChunkWidth + idx];
      out_row[col] = total;
    }
  }
}

// Backward with recompute. Per row, from h (the saved norm input), mean and rstd:
// x_hat = (h - mean) * rstd (RMSNorm: h * rstd), g = dy * w,
// RMSNorm:   dx = rstd * (g - x_hat * mean(g * x_hat)),
// LayerNorm: dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g)),
// plus dh when given, rounded to T once. Block p (gridDim.x = num_partials) handles the row groups
// p, p + num_partials, ... and writes every column of row p of dw_partial (sum of dy * x_hat over
// its rows) and db_partial (sum of dy); a block without rows writes zeros.
// Launch: as the forward. In warp-per-row mode cols <= kWarpSize * VEC * kBwdRegisterChunks<VEC>
// (all accumulators in registers) and blockDim.x * VEC floats of dynamic shared memory.
template <typename T, int VEC, bool IS_RMS>
__global__ void __launch_bounds__(kMaxBlockThreads)
    norm_bwd_kernel(const NormBwdParams params, const int threads_per_row) {
  extern __shared__ float4 norm_bwd_dynamic_smem[];
  constexpr int kAccumulatorChunks = kBwdRegisterChunks<VEC>;

  const T* dy = static_cast<const T*>(params.dy);
  const T* dh = static_cast<const T*>(params.dh);
  const T* h = static_cast<const T*>(params.h);
  const T* weight = static_cast<const T*>(params.weight);
  T* dx = static_cast<T*>(params.dx);
  const int64_t rows = params.rows;
  const int64_t cols = params.cols;
  float* dw_row = params.dw_partial == nullptr
                      ? nullptr
                      : params.dw_partial + static_cast<int64_t>(blockIdx.x) * cols;
  float* db_row = IS_RMS || params.db_partial == nullptr
                      ? nullptr
                      : params.db_partial + static_cast<int64_t>(blockIdx.x) * cols;

  const int tid = static_cast<int>(threadIdx.x);
  const bool warp_per_row = threads_per_row == kWarpSize;
  const int rows_per_block = static_cast<int>(blockDim.x) / threads_per_row;
  const int row_in_block = tid / threads_per_row;
  const int64_t first_col = static_cast<int64_t>(tid % threads_per_row) * VEC;
  const int64_t col_stride = static_cast<int64_t>(threads_per_row) * VEC;
  const int64_t first_spilled_col = first_col + kAccumulatorChunks * col_stride;

  float dw_acc[kAccumulatorChunks][VEC];
  float db_acc[kAccumulatorChunks][VEC];
#pragma unroll
  for (int k = 0; k < kAccumulatorChunks; ++k) {
    fill(dw_acc[k], 0.0f);
    fill(db_acc[k], 0.0f);
  }
  // Columns past the register chunks accumulate in place in this block's partial rows. Only this
  // thread touches them (block-per-row mode: distinct threads own distinct columns), so a plain
  // load-add-store is safe; start them at zero.
#pragma unroll 1
  for (int64_t col = first_spilled_col; col < cols; col += col_stride) {
    float zeros[VEC];
    fill(zeros, 0.0f);
    if (dw_row != nullptr) store_float_chunk(dw_row + col, zeros);
    if (db_row != nullptr) store_float_chunk(db_row + col, zeros);
  }

  const int64_t num_row_groups = ceil_div(rows, rows_per_block);
  for (int64_t group = blockIdx.x; group < num_row_groups; group += gridDim.x) {
    const int64_t row = group * rows_per_block + row_in_block;
    // Only in warp-per-row mode (a whole warp at once); a block-per-row block always has a row.
    if (row >= rows) continue;

    const float mean = IS_RMS ? 0.0f : params.mean[row];
    const float rstd = params.rstd[row];
    const T* h_row = h + row * params.h_row_stride;
    const T* dy_row = dy + row * params.dy_row_stride;
    const T* dh_row = dh == nullptr ? nullptr : dh + row * params.dh_row_stride;
    T* dx_row = dx + row * cols;

    // Recomputes x_hat and g = dy * w for one chunk.
    auto recompute = [&](int64_t col, float (&x_hat)[VEC], float (&dy_f)[VEC], float (&g)[VEC]) {
      load_chunk<T, VEC>(h_row + col, x_hat);
      load_chunk<T, VEC>(dy_row + col, dy_f);
      if (weight != nullptr) {
        load_chunk<T, VEC>(weight + col, g);
      } else {
        fill(g, 1.0f);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        x_hat[i] = IS_RMS ? x_hat[i] * rstd : (x_hat[i] - mean) * rstd;
        g[i] *= dy_f[i];
      }
    };

    // Pass 1: row sums of g * x_hat and g, and this row's dw / db contributions.
    float sum_g_xhat = 0.0f;
    float sum_g = 0.0f;
#pragma unroll
    for (int k = 0; k < kAccumulatorChunks; ++k) {
      const int64_t col = first_col + k * col_stride;
      if (col < cols) {
        float x_hat[VEC], dy_f[VEC], g[VEC];
        recompute(col, x_hat, dy_f, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          sum_g_xhat += g[i] * x_hat[i];
          if constexpr (!IS_RMS) sum_g += g[i];
          dw_acc[k][i] += dy_f[i] * x_hat[i];
          if constexpr (!IS_RMS) db_acc[k][i] += dy_f[i];
        }
      }
    }
#pragma unroll 1
    for (int64_t col = first_spilled_col; col < cols; col += col_stride) {
      float x_hat[VEC], dy_f[VEC], g[VEC];
      recompute(col, x_hat, dy_f, g);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        sum_g_xhat += g[i] * x_hat[i];
        if constexpr (!IS_RMS) sum_g += g[i];
      }
      if (dw_row != nullptr) {
        float acc[VEC];
        load_float_chunk(dw_row + col, acc);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += dy_f[i] * x_hat[i];
        store_float_chunk(dw_row + col, acc);
      }
      if (db_row != nullptr) {
        float acc[VEC];
        load_float_chunk(db_row + col, acc);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += dy_f[i];
        store_float_chunk(db_row + col, acc);
      }
    }

    float mean_g_xhat;
    float mean_g = 0.0f;
    if constexpr (IS_RMS) {
      float sums[1] = {sum_g_xhat};
      row_sum(sums, threads_per_row);
      mean_g_xhat = sums[0] / static_cast<float>(cols);
    } else {
      float sums[2] = {sum_g_xhat, sum_g};
      row_sum(sums, threads_per_row);
      mean_g_xhat = sums[0] / static_cast<float>(cols);
      mean_g = sums[1] / static_cast<float>(cols);
    }

    // Pass 2: dx, reading h and dy again (L1/L2 hits: pass 1 just read them).
#pragma unroll 1
    for (int64_t col = first_col; col < cols; col += col_stride) {
      float x_hat[VEC], dy_f[VEC], g[VEC];
      recompute(col, x_hat, dy_f, g);
      float dh_f[VEC];
      if (dh_row != nullptr) {
        load_chunk<T, VEC>(dh_row + col, dh_f);
      } else {
        fill(dh_f, 0.0f);
      }
      float out[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d_norm = IS_RMS ? rstd * (g[i] - x_hat[i] * mean_g_xhat)
                                    : rstd * (g[i] - x_hat[i] * mean_g_xhat - mean_g);
        out[i] = d_norm + dh_f[i];
      }
      store_chunk<T, VEC>(dx_row + col, out);
    }
  }

  if (!warp_per_row) {
    // Block per row: this thread alone owns its columns of the partial rows.
#pragma unroll
    for (int k = 0; k < kAccumulatorChunks; ++k) {
      const int64_t col = first_col + k * col_stride;
      if (col < cols) {
        if (dw_row != nullptr) store_float_chunk(dw_row + col, dw_acc[k]);
        if (db_row != nullptr) store_float_chunk(db_row + col, db_acc[k]);
      }
    }
  } else {
    // Warp per row: all columns are in register chunks (launcher guarantee); the block's warps
    // share them, so add the warps' accumulators. dw_row and db_row are uniform over the block,
    // so every thread takes the same branches to the barriers inside.
    float* staging = reinterpret_cast<float*>(norm_bwd_dynamic_smem);
#pragma unroll
    for (int k = 0; k < kAccumulatorChunks; ++k) {
      const int64_t chunk_first_col = static_cast<int64_t>(k) * kWarpSize * VEC;
      if (chunk_first_col >= cols) break;
      if (dw_row != nullptr) sum_warps_and_store(staging, dw_acc[k], dw_row, chunk_first_col, cols);
      if (db_row != nullptr) sum_warps_and_store(staging, db_acc[k], db_row, chunk_first_col, cols);
    }
  }
}

}  // namespace norm_detail
}  // namespace remat
