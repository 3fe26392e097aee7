// Device code of the flash-attention kernels (forward, and the backward with recompute) on tensor
// cores, for sm_80 and later. The launchers are in attention.cu; the interface in attention.h.
//
// Recompute contract. The forward saves only o and the fp32 logsumexp per query row (plus the
// caller's q, k, v and the Philox seed/offset). The backward recomputes every probability tile
// P = exp2(t * log2e - lse * log2e) from q, k and lse, and the dropout mask from (seed, offset),
// in shared memory; nothing of size N x M ever reaches device memory.
//
// Matrix products. WMMA (nvcuda::wmma) 16x16x16 fragments of 16-bit inputs (fp16 or bf16) with
// fp32 accumulators. Operand tiles live in shared memory, row-major with padded leading
// dimensions; score tiles (S = Q K^T, dP = dO V^T) are stored from the accumulators to shared
// memory as fp32 and all element-wise work (masking, softcap, softmax, dropout, dS) reads and
// writes them there, where the (row, column) of every element is explicit. The one place that
// touches accumulator elements in registers is the forward's per-row rescale of the output
// accumulator (see row_of_accumulator_elements).
//
// Loads. Tiles move global -> shared as 16-byte cp.async chunks where D % 8 == 0 and the strides
// and base are aligned (TileFlags), else element by element; rope is then applied in place in
// shared memory (fp32 math, rounded to the dtype) between two barriers. Outputs are staged in
// shared memory as fp32 and rounded once when written.
//
// Head dim. D (1..256) is padded with zeros to a bucket DP in {32, 64, 96, 128, 192, 256}: rows
// of q, k, v, dout tiles hold zeros in columns D..DP-1, which add nothing to any dot product and
// whose outputs are never written. Rows past N (queries) or M (keys) are zero-filled and masked.
//
// Alignment rules WMMA imposes, and how they are met: load/store_matrix_sync need a 256-bit
// (32-byte) aligned pointer and a leading dimension that is a multiple of 8 elements for 16-bit
// types, 4 for fp32. Every shared-memory region starts at a multiple of 128 bytes; every fragment
// pointer is region + (16 * a) * ld + 16 * b elements, i.e. a multiple of 32 bytes for 16-bit
// types (16 * 2 = 32) and of 64 for fp32; the leading dimensions are DP + 8 and BN + 8 (16-bit)
// and BN + 4, DP + 4, 16 (fp32). The +8 / +4 padding shifts consecutive rows by 16 bytes so the
// row reads of one fragment load fall in different banks.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include "attention/attention.h"
#include "common/attention_math.h"
#include "common/pack.cuh"
#include "common/philox.h"

// bf16 WMMA and cp.async need sm_80. Compiled for an older architecture (a TORCH_CUDA_ARCH_LIST
// that lists one), the tensor-core kernels reduce to a trap, so that the extension still builds;
// the ATen glue rejects GPUs below sm_80 before any launch.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define REMAT_ATTENTION_ARCH_UNSUPPORTED 1
#endif

namespace remat {
namespace attn_detail {

namespace wmma = nvcuda::wmma;

constexpr int kWarpSize = 32;
constexpr int kFrag = 16;  // WMMA tile edge
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::row_major>;
// A read transposed: element (r, c) of the fragment is element (c, r) of the row-major tile.
template <typename T>
using FragAT = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::col_major>;
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::row_major>;
// B read transposed: B(k, n) = tile(n, k), for products with a transposed row-major tile (Q K^T).
template <typename T>
using FragBT = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;
constexpr int kAccElements = FragC::num_elements;
static_assert(kAccElements <= 8, "row indices of the accumulator elements are packed 4 bits each");
// Row (0..15) of accumulator element e, from the packed word of row_of_accumulator_elements.
__device__ __forceinline__ int acc_row(uint32_t rows, int e) { return static_cast<int>((rows >> (4 * e)) & 15u); }

constexpr int align_bytes(int bytes) { return (bytes + 127) / 128 * 128; }
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
constexpr int max_int(int a, int b) { return a > b ? a : b; }
constexpr int kElem = 2;  // bytes of fp16 / bf16

// Smallest bucket that holds the head dim: the kernels are instantiated for these only (common
// head dims 64, 128, 96 / 80, 256, 192 / 160 waste no work or at most 20%; 16..31 run at 32).
constexpr int head_dim_bucket(int64_t head_dim) {
  return head_dim <= 32    ? 32
         : head_dim <= 64  ? 64
         : head_dim <= 96  ? 96
         : head_dim <= 128 ? 128
         : head_dim <= 192 ? 192
                           : 256;
}

// ---------------------------------------------------------------------------------------------
// Tile shapes and shared-memory layouts. Byte sizes below are for the 16-bit types.
//
// Forward: 4 warps, 64 query rows per block, warp w owning rows 16w..16w+15 of every tile, so
// the softmax of a row needs only its own warp (no block barrier between S and P V). The output
// accumulator O [64, DP] stays in registers (DP / 16 fragments per warp: 64 fp32 registers at
// DP = 128, 128 at DP = 256), which is what limits the rows per warp to 16. Key tiles of 64
// (32 above DP = 128). Shared memory: q, k, v tiles (16-bit), S (fp32), P (16-bit), one float
// per row: 41 KB (DP 32), 53 KB (64), 77 KB (128: two blocks per SM on sm_80's 164 KB), 80 KB
// (256, with 32-key tiles; 64-key tiles would need 128 KB: one block per SM on sm_90 too).
template <int DP>
struct FwdTiles {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockM = kFrag * kWarps;
  static constexpr int kBlockN = DP <= 128 ? 64 : 32;
  // Blocks per SM the registers must allow (__launch_bounds__): 4 (128 registers per thread) where
  // shared memory allows 4 blocks on sm_90 (DP <= 64); 2 otherwise, which caps nothing below the
  // 255-register maximum.
  static constexpr int kMinBlocks = DP <= 64 ? 4 : 2;
  static constexpr int kLdT = DP + 8;        // q, k, v tiles (16-bit elements)
  static constexpr int kLdS = kBlockN + 4;   // S (fp32)
  static constexpr int kLdP = kBlockN + 8;   // P (16-bit)
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + align_bytes(kBlockM * kLdT * kElem);
  static constexpr int kV = kK + align_bytes(kBlockN * kLdT * kElem);
  static constexpr int kS = kV + align_bytes(kBlockN * kLdT * kElem);
  static constexpr int kP = kS + align_bytes(kBlockM * kLdS * 4);
  static constexpr int kRow = kP + align_bytes(kBlockM * kLdP * kElem);
  static constexpr int kBytes = kRow + align_bytes(kBlockM * 4);
  static_assert(kLdS >= kFrag, "the per-warp 16x16 staging tile lives in the warp's S rows");
};

// Backward, dK/dV kernel: 8 warps, one block per (key block, batch, kv head), looping over the
// group's query heads and their visible query blocks. dK and dV of the key block [kBlockN, DP]
// accumulate in registers: warp w owns key rows (w % kRowTiles) * 16 .. + 15 and kColTiles
// column fragments starting at (w / kRowTiles) * kColTiles, i.e. 2 * kColTiles fragments
// (64 fp32 registers at DP = 128 and 256). kBlockN = 64 keys (32 at DP = 256, which keeps the
// fragments per warp at 2 * 4), query steps of kBlockM = 32 rows (64 at DP = 256), so that each
// of the 8 warps computes one 16x16 fragment of S and of dP per step. Shared memory: k, v
// (once), q, dout per step (16-bit), S and dP (fp32), P and dS (16-bit), lse and Delta:
// 41 KB (DP 32), 53 KB (64), 77 KB (128: two blocks per SM on sm_80), 127 KB (256). Above
// DP = 128 the tiles are those of DP = 256.
template <int DP>
struct DkDvTiles {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockN = DP <= 128 ? 64 : 32;
  static constexpr int kBlockM = DP <= 128 ? 32 : 64;
  // Two blocks of 8 warps per SM (at most 128 registers per thread) where shared memory allows it.
  static constexpr int kMinBlocks = DP <= 128 ? 2 : 1;
  static constexpr int kRowTiles = kBlockN / kFrag;
  static constexpr int kColGroups = kWarps / kRowTiles;
  static constexpr int kColTiles = DP / kFrag / kColGroups;
  static_assert(kWarps % kRowTiles == 0 && (DP / kFrag) % kColGroups == 0, "dK/dV warp partition");
  static constexpr int kLdT = DP + 8;
  static constexpr int kLdS = kBlockN + 4;
  static constexpr int kLdP = kBlockN + 8;
  static constexpr int kLdO = DP + 4;  // fp32 staging of dK / dV in the epilogue
  static constexpr int kK = 0;
  static constexpr int kV = kK + align_bytes(kBlockN * kLdT * kElem);
  static constexpr int kQ = kV + align_bytes(kBlockN * kLdT * kElem);
  static constexpr int kDo = kQ + align_bytes(kBlockM * kLdT * kElem);
  static constexpr int kS = kDo + align_bytes(kBlockM * kLdT * kElem);
  static constexpr int kDp = kS + align_bytes(kBlockM * kLdS * 4);
  static constexpr int kPd = kDp + align_bytes(kBlockM * kLdS * 4);
  static constexpr int kDs = kPd + align_bytes(kBlockM * kLdP * kElem);
  static constexpr int kLse = kDs + align_bytes(kBlockM * kLdP * kElem);
  static constexpr int kDelta = kLse + align_bytes(kBlockM * 4);
  static constexpr int kMain = kDelta + align_bytes(kBlockM * 4);
  // Epilogue staging (from offset 0, once the loop is over): one [kBlockN, DP] fp32 tile.
  static constexpr int kBytes = max_int(kMain, align_bytes(kBlockN * kLdO * 4));
  // Non-deterministic mode: each warp stages one 16x16 fp32 dq fragment (1 KB) for its atomics
  // in the S region, which is dead between the dS computation and the next step's S.
  static_assert(kWarps * kFrag * kFrag * 4 <= kBlockM * kLdS * 4, "dq atomic staging fits in S");
};

// Backward, dQ kernel (deterministic mode): 8 warps, one block per (query block of 64 rows,
// batch, query head), looping over the visible key tiles. dQ [64, DP] accumulates in registers:
// warp w owns rows (w % 4) * 16 .. + 15 and DP / 32 column fragments (32 fp32 registers at
// DP = 128, 64 at DP = 256). Key tiles of 64 for DP <= 64 and 32 above, so that at DP = 128 the
// block needs 75 KB (two blocks per SM on sm_80); 64 KB / 80 KB / 75 KB / 123 KB for DP = 32 /
// 64 / 128 / 256 (the fp32 S and dP tiles dominate at small DP; two blocks per SM either way).
template <int DP>
struct DqTiles {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = DP <= 64 ? 64 : 32;
  static constexpr int kMinBlocks = DP <= 128 ? 2 : 1;  // as DkDvTiles
  static constexpr int kRowTiles = kBlockM / kFrag;
  static constexpr int kColGroups = kWarps / kRowTiles;
  static constexpr int kColTiles = DP / kFrag / kColGroups;
  static_assert(kWarps % kRowTiles == 0 && (DP / kFrag) % kColGroups == 0, "dQ warp partition");
  static constexpr int kLdT = DP + 8;
  static constexpr int kLdS = kBlockN + 4;
  static constexpr int kLdP = kBlockN + 8;
  static constexpr int kLdO = DP + 4;
  static constexpr int kQ = 0;
  static constexpr int kDo = kQ + align_bytes(kBlockM * kLdT * kElem);
  static constexpr int kK = kDo + align_bytes(kBlockM * kLdT * kElem);
  static constexpr int kV = kK + align_bytes(kBlockN * kLdT * kElem);
  static constexpr int kS = kV + align_bytes(kBlockN * kLdT * kElem);
  static constexpr int kDp = kS + align_bytes(kBlockM * kLdS * 4);
  static constexpr int kDs = kDp + align_bytes(kBlockM * kLdS * 4);
  static constexpr int kLse = kDs + align_bytes(kBlockM * kLdP * kElem);
  static constexpr int kDelta = kLse + align_bytes(kBlockM * 4);
  static constexpr int kMain = kDelta + align_bytes(kBlockM * 4);
  static constexpr int kBytes = max_int(kMain, align_bytes(kBlockM * kLdO * 4));
};

// Small element-wise kernels: Delta = rowsum(dout * o) (a warp per row) and the dq cast.
constexpr int kSmallThreads = 256;

// Which global tiles may be moved as 16-byte packs: D % 8 == 0, 16-byte aligned base, and every
// stride a multiple of 8 elements (then every row chunk of 8 is aligned). rope: D/2 % 8 == 0 and
// 16-byte aligned tables. out: the contiguous outputs with D % 8 == 0.
struct TileFlags {
  bool q_vec, k_vec, v_vec, do_vec, rope_vec, out_vec;
};

// ---------------------------------------------------------------------------------------------
// Problem geometry shared by the kernels.

struct Geometry {
  int64_t n, m, shift, left, right;

  // Keys any of query rows [q_first, q_last] may see: [lo, hi), empty when hi <= lo. lo is rounded
  // down to a multiple of 4, so that key tiles from lo start at a group of the dropout stream (one
  // Philox call per four keys, common/philox.h); the at most 3 keys it adds are masked.
  __device__ void key_range(int64_t q_first, int64_t q_last, int64_t& lo, int64_t& hi) const {
    lo = left < 0 ? 0 : max64(0, q_first + shift - left) / kPhiloxWords * kPhiloxWords;
    hi = right < 0 ? m : min64(m, q_last + shift + right + 1);
  }
  // Query rows that see any of keys [k_first, k_last]: [lo, hi).
  __device__ void query_range(int64_t k_first, int64_t k_last, int64_t& lo, int64_t& hi) const {
    lo = right < 0 ? 0 : max64(0, k_first - shift - right);
    hi = left < 0 ? n : min64(n, k_last - shift + left + 1);
  }
  // Whether keys k0 .. k0 + block_n - 1 all exist and are all visible from every query row in
  // [q_first, q_last]: then the tile skips the per-element mask.
  __device__ bool tile_fully_visible(int64_t q_first, int64_t q_last, int64_t k0, int block_n) const {
    return k0 + block_n <= m && (left < 0 || k0 >= q_last + shift - left) &&
           (right < 0 || k0 + block_n - 1 <= q_first + shift + right);
  }
  __device__ bool visible(int64_t i, int64_t j) const {
    return j < m && attention_key_visible(i, j, shift, left, right);
  }
};

// The rows of one batch entry, or with cu_seqlens_q (packed sequences) of sequence b: its first
// rows in the packed inputs (0 for a batch entry, which its batch stride places), its first rows
// in the contiguous outputs' [B N] / [total] rows, and its lengths. Masks, tile ranges and
// positions use these lengths; the dropout stream's rows keep the params' n, m (for packed
// sequences the max_seqlen bounds: sequence b draws batch entry b of the zero-padded batch's rows).
struct SequenceRows {
  int64_t q_start, k_start, q_out, k_out, n, m;
};

template <typename Params>
__device__ __forceinline__ SequenceRows sequence_rows(const Params& p, int64_t b) {
  if (p.cu_seqlens_q == nullptr) return {0, 0, b * p.n, b * p.m, p.n, p.m};
  const int64_t q_start = p.cu_seqlens_q[b], k_start = p.cu_seqlens_k[b];
  return {q_start, k_start, q_start, k_start, p.cu_seqlens_q[b + 1] - q_start, p.cu_seqlens_k[b + 1] - k_start};
}

// Row (b, h, 0) of lse / Delta: fp32 [B, Hq, N], or [Hq, total_q] for packed sequences.
template <typename Params>
__device__ __forceinline__ int64_t stats_row(const Params& p, const SequenceRows& rows, int64_t b, int64_t h) {
  return p.cu_seqlens_q == nullptr ? (b * p.hq + h) * p.n : h * p.total_q + rows.q_start;
}

// The rope tables of (b): the batch's rows, or for packed sequences with per-token tables the rows
// from the sequence's first key on (rope_token_stride D/2; 0 for tables restarting per sequence).
template <typename Params>
__device__ __forceinline__ const float* rope_rows(const Params& p, const float* table, const SequenceRows& rows,
                                                  int64_t b) {
  return table != nullptr ? table + b * p.rope_batch_stride + rows.k_start * p.rope_token_stride : nullptr;
}

// Attention dropout reads the stream of common/philox.h in rows of `cols` keys: the [B, Hq, N, M]
// probabilities' row (b * Hq + h) * N + i (packed sequences: the zero-padded batch's, N, M =
// max_seqlen_q, max_seqlen_k). Each thread draws the four keys of a group from one Philox call.
struct Dropout {
  bool on;
  uint64_t seed, offset;
  float p, keep_scale;
  // Keys per row of the stream: M (packed sequences: max_seqlen_k).
  int64_t cols;

  // rng: device (seed, offset), read once per thread (a broadcast load).
  __device__ static Dropout make(float p, const int64_t* rng, int64_t cols) {
    Dropout d{p > 0.0f, 0, 0, p, 1.0f, cols};
    if (d.on) {
      d.seed = static_cast<uint64_t>(rng[0]);
      d.offset = static_cast<uint64_t>(rng[1]);
      d.keep_scale = 1.0f / (1.0f - p);
    }
    return d;
  }
  // factors[w] for keys key + w (w < 4, key a multiple of 4) of stream row `row`: 1/(1-p) where the
  // mask keeps the element, 0 where it drops it; 1 when off. One Philox call, all four words.
  __device__ void factors4(uint64_t row, int64_t key, float (&factors)[kPhiloxWords]) const {
    if (!on) {
#pragma unroll
      for (int w = 0; w < kPhiloxWords; ++w) factors[w] = 1.0f;
      return;
    }
    const PhiloxWords words = philox4(seed, stream_counter(offset, row, static_cast<uint64_t>(key),
                                                           static_cast<uint64_t>(cols)));
#pragma unroll
    for (int w = 0; w < kPhiloxWords; ++w) factors[w] = dropout_keeps(words.word[w], p) ? keep_scale : 0.0f;
  }
};

// ---------------------------------------------------------------------------------------------
// Global <-> shared memory.

template <typename T>
__device__ __forceinline__ void load8_shared(const T* src, T (&out)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(src);
  memcpy(out, &u, 16);
}

template <typename T>
__device__ __forceinline__ void store8_shared(T* dst, const T (&in)[8]) {
  uint4 u;
  memcpy(&u, in, 16);
  *reinterpret_cast<uint4*>(dst) = u;
}

template <typename T>
__device__ __forceinline__ void zero8_shared(T* dst) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);  // +0 in fp16 and bf16
}

// 16 bytes global -> shared without passing through registers (sm_80 cp.async, L2 only: the
// tiles are read once per block). Completion: cp_async_wait_all() by the issuing thread, then a
// barrier before other threads read the data.
// Host builds of these kernels (the CPU emulation of tests/cuda_emulation) define
// REMAT_HOST_CP_ASYNC_16(dst, src) and REMAT_HOST_CP_ASYNC_WAIT_ALL(), which defer each copy to
// the issuing thread's wait; without them a host build copies at once.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
#if defined(__CUDA_ARCH__) && !defined(REMAT_ATTENTION_ARCH_UNSUPPORTED)
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
#elif defined(REMAT_HOST_CP_ASYNC_16)
  REMAT_HOST_CP_ASYNC_16(smem_dst, gmem_src);
#else
  memcpy(smem_dst, gmem_src, 16);
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && !defined(REMAT_ATTENTION_ARCH_UNSUPPORTED)
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#elif defined(REMAT_HOST_CP_ASYNC_WAIT_ALL)
  REMAT_HOST_CP_ASYNC_WAIT_ALL();
#endif
}

// Starts copying rows 0 .. valid_rows - 1 of a global [*, head_dim] slice (row r at
// src + r * row_stride, unit column stride) into the shared tile dst [ROWS][ld] (16-bit),
// zero-filling columns head_dim .. DP - 1 and rows valid_rows .. ROWS - 1. vec (TileFlags): 16-byte
// chunks by cp.async; otherwise element loads through registers (any D, any alignment). All
// threads of the block call this; the data may be read after cp_async_wait_all() and a barrier.
template <typename T, int ROWS, int DP, int THREADS>
__device__ __forceinline__ void load_tile(T* __restrict__ dst, int ld, const T* __restrict__ src, int64_t row_stride,
                                          int valid_rows, int head_dim, bool vec) {
  constexpr int kChunks = DP / 8;
  for (int idx = static_cast<int>(threadIdx.x); idx < ROWS * kChunks; idx += THREADS) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    T* out = dst + r * ld + c;
    if (r >= valid_rows || c >= head_dim) {
      zero8_shared(out);
      continue;
    }
    const T* in = src + r * row_stride + c;
    if (vec) {  // head_dim % 8 == 0: the chunk is entirely inside the row
      cp_async_16(out, in);
      continue;
    }
    T x[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = c + e < head_dim ? in[e] : from_float<T>(0.0f);
    store8_shared(out, x);
  }
}

// Rotary embedding of a loaded tile, in place: row r < valid_rows is rotated at position
// first_pos + r (cos and sin point at the batch's [S, head_dim / 2] tables) in fp32 from its T
// values and rounded back to T, as the QK^T operand is defined. The thread that owns pair
// (d, d + half) reads and writes both elements. rope_vec (TileFlags): half % 8 == 0, 8 pairs per
// step with float4 table reads. All threads call this between two barriers.
template <typename T, int DP, int THREADS>
__device__ __forceinline__ void rope_tile(T* __restrict__ tile, int ld, int valid_rows, int head_dim,
                                          const float* __restrict__ cos, const float* __restrict__ sin,
                                          int64_t first_pos, bool rope_vec) {
  const int half = head_dim / 2;
  if (rope_vec) {
    const int groups = half / 8;
#pragma unroll 1
    for (int idx = static_cast<int>(threadIdx.x); idx < valid_rows * groups; idx += THREADS) {
      const int r = idx / groups, c = (idx % groups) * 8;
      T* row = tile + r * ld;
      T x1[8], x2[8];
      load8_shared(row + c, x1);
      load8_shared(row + c + half, x2);
      const int64_t at = (first_pos + r) * half + c;
      const float4 c_lo = *reinterpret_cast<const float4*>(cos + at);
      const float4 c_hi = *reinterpret_cast<const float4*>(cos + at + 4);
      const float4 s_lo = *reinterpret_cast<const float4*>(sin + at);
      const float4 s_hi = *reinterpret_cast<const float4*>(sin + at + 4);
      const float cs[8] = {c_lo.x, c_lo.y, c_lo.z, c_lo.w, c_hi.x, c_hi.y, c_hi.z, c_hi.w};
      const float sn[8] = {s_lo.x, s_lo.y, s_lo.z, s_lo.w, s_hi.x, s_hi.y, s_hi.z, s_hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float a, b;
        rope_rotate(to_float(x1[e]), to_float(x2[e]), cs[e], sn[e], a, b);
        x1[e] = from_float<T>(a);
        x2[e] = from_float<T>(b);
      }
      store8_shared(row + c, x1);
      store8_shared(row + c + half, x2);
    }
    return;
  }
#pragma unroll 1
  for (int idx = static_cast<int>(threadIdx.x); idx < valid_rows * half; idx += THREADS) {
    const int r = idx / half, d = idx % half;
    T* row = tile + r * ld;
    const int64_t at = (first_pos + r) * half + d;
    float a, b;
    rope_rotate(to_float(row[d]), to_float(row[d + half]), cos[at], sin[at], a, b);
    row[d] = from_float<T>(a);
    row[d + half] = from_float<T>(b);
  }
}

// Writes rows 0 .. valid_rows - 1 of the fp32 staging tile stage [ROWS][ld] to out (row r at
// out + r * row_stride), columns < head_dim, rounded to T once. With rope (cos != nullptr) the
// pair (d, d + half) first goes through rope_rotate_grad at position first_pos + r: the rows are
// gradients of rotated operands (dq, dk). All threads of the block call this.
template <typename T, int ROWS, int DP, int THREADS>
__device__ void store_rows(const float* __restrict__ stage, int ld, T* __restrict__ out, int64_t row_stride,
                           int valid_rows, int head_dim, const float* __restrict__ cos,
                           const float* __restrict__ sin, int64_t first_pos) {
  const int half = head_dim / 2;
  for (int idx = static_cast<int>(threadIdx.x); idx < ROWS * DP; idx += THREADS) {
    const int r = idx / DP, d = idx % DP;
    if (r >= valid_rows || d >= head_dim) continue;
    const float* row = stage + r * ld;
    T* dst = out + r * row_stride;
    if (cos == nullptr) {
      dst[d] = from_float<T>(row[d]);
      continue;
    }
    if (d >= half) continue;
    const int64_t at = (first_pos + r) * half + d;
    float dx1, dx2;
    rope_rotate_grad(row[d], row[d + half], cos[at], sin[at], dx1, dx2);
    dst[d] = from_float<T>(dx1);
    dst[d + half] = from_float<T>(dx2);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

// The row (0..15) of each element of this lane's accumulator fragments. WMMA leaves the
// element-to-(row, column) mapping of a fragment unspecified, but it is one fixed function of
// (fragment type, lane, element index): load_matrix_sync and store_matrix_sync of the same type
// and layout must be inverse to each other for mma_sync to mean anything. Loading a 16x16 tile
// whose every entry is its row number therefore tells each lane which row each of its elements
// belongs to in every FragC that is later stored with mem_row_major. `scratch` is a 16 x ld fp32
// region owned by the calling warp.
__device__ __forceinline__ uint32_t row_of_accumulator_elements(float* scratch, int ld, int lane) {
  for (int idx = lane; idx < kFrag * kFrag; idx += kWarpSize) {
    scratch[(idx / kFrag) * ld + idx % kFrag] = static_cast<float>(idx / kFrag);
  }
  __syncwarp();
  FragC frag;
  wmma::load_matrix_sync(frag, scratch, ld, wmma::mem_row_major);
  uint32_t rows = 0;
#pragma unroll
  for (int e = 0; e < kAccElements; ++e) rows |= static_cast<uint32_t>(frag.x[e]) << (4 * e);
  __syncwarp();
  return rows;
}

// One block: 64 query rows of one (batch, query head). Grid: (ceil(N / 64), Hq, B); the last
// query blocks, which see the most keys under a causal mask, are scheduled first.
//
// Per key tile (keys k0 .. k0 + kBlockN - 1 of the visible range):
//   barrier; load k (rotated) and v; barrier;
//   each warp: S[16, kBlockN] = Q_w K^T -> shared fp32; softmax of its 16 rows in shared memory:
//   masked logits -> running max (OnlineSoftmax) -> P = exp2(t2 - max), dropped and rounded to T
//   -> shared; the per-row rescale factor -> shared; O_w = O_w * factor + P V (registers).
// Softmax work: lane l handles row l / 2 and the columns of parity l % 2; the two lanes of a
// row combine their max and sum with one shuffle (both then hold bit-identical state).
template <typename T, int DP>
__global__ void __launch_bounds__(FwdTiles<DP>::kThreads, FwdTiles<DP>::kMinBlocks)
    attention_fwd_kernel(const AttentionFwdParams p, const TileFlags flags) {
#if defined(REMAT_ATTENTION_ARCH_UNSUPPORTED)
  __trap();
#else
  using L = FwdTiles<DP>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem + L::kQ);
  T* k_s = reinterpret_cast<T*>(smem + L::kK);
  T* v_s = reinterpret_cast<T*>(smem + L::kV);
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  T* p_s = reinterpret_cast<T*>(smem + L::kP);
  float* row_s = reinterpret_cast<float*>(smem + L::kRow);

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t q_block = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const SequenceRows seq = sequence_rows(p, b);
  const int64_t kvh = h / (p.hq / p.hkv);
  const int64_t q0 = q_block * L::kBlockM;
  if (q0 >= seq.n) return;  // a block past a packed sequence's end (the whole block leaves)
  const int valid_q = static_cast<int>(min64(L::kBlockM, seq.n - q0));
  const int head_dim = static_cast<int>(p.head_dim);
  const Geometry geo{seq.n, seq.m, seq.m - seq.n, p.window_left, p.window_right};
  const Dropout dropout = Dropout::make(p.dropout_p, p.rng, p.m);
  const float* cos = rope_rows(p, p.cos, seq, b);
  const float* sin = rope_rows(p, p.sin, seq, b);

  const T* q_g = static_cast<const T*>(p.q) + b * p.q_batch_stride + (seq.q_start + q0) * p.q_row_stride +
                 h * p.q_head_stride;
  const T* k_g = static_cast<const T*>(p.k) + b * p.k_batch_stride + seq.k_start * p.k_row_stride +
                 kvh * p.k_head_stride;
  const T* v_g = static_cast<const T*>(p.v) + b * p.v_batch_stride + seq.k_start * p.v_row_stride +
                 kvh * p.v_head_stride;

  load_tile<T, L::kBlockM, DP, L::kThreads>(q_s, L::kLdT, q_g, p.q_row_stride, valid_q, head_dim, flags.q_vec);
  cp_async_wait_all();
  __syncthreads();
  if (cos != nullptr) {  // read by S = Q K^T only after the barrier at the top of the key loop
    rope_tile<T, DP, L::kThreads>(q_s, L::kLdT, valid_q, head_dim, cos, sin, q0 + geo.shift, flags.rope_vec);
  }

  float* s_w = s_s + warp * kFrag * L::kLdS;  // this warp's 16 rows of S
  T* p_w = p_s + warp * kFrag * L::kLdP;
  float* row_w = row_s + warp * kFrag;
  const uint32_t acc_rows = row_of_accumulator_elements(s_w, L::kLdS, lane);

  FragC o_acc[DP / kFrag];
#pragma unroll
  for (int c = 0; c < DP / kFrag; ++c) wmma::fill_fragment(o_acc[c], 0.0f);

  // This lane's softmax row and column parity: it owns key groups 2c + parity (keys 8c + 4 parity
  // .. + 3) of every tile, so it draws their dropout factors with one Philox call per group.
  const int r = lane >> 1, parity = lane & 1;
  const int64_t i = q0 + warp * kFrag + r;
  const uint64_t drop_row = static_cast<uint64_t>((b * p.hq + h) * p.n + i);
  OnlineSoftmax softmax;

  int64_t k_lo, k_hi;
  geo.key_range(q0, q0 + valid_q - 1, k_lo, k_hi);
  for (int64_t k0 = k_lo; k0 < k_hi; k0 += L::kBlockN) {
    const int valid_k = static_cast<int>(min64(L::kBlockN, seq.m - k0));
    __syncthreads();  // every warp is done with the previous k / v tile (first pass: q is loaded)
    load_tile<T, L::kBlockN, DP, L::kThreads>(k_s, L::kLdT, k_g + k0 * p.k_row_stride, p.k_row_stride, valid_k,
                                              head_dim, flags.k_vec);
    load_tile<T, L::kBlockN, DP, L::kThreads>(v_s, L::kLdT, v_g + k0 * p.v_row_stride, p.v_row_stride, valid_k,
                                              head_dim, flags.v_vec);
    cp_async_wait_all();
    __syncthreads();
    if (cos != nullptr) {
      rope_tile<T, DP, L::kThreads>(k_s, L::kLdT, valid_k, head_dim, cos, sin, k0, flags.rope_vec);
      __syncthreads();
    }

    // S_w = Q_w K^T: 16 x kBlockN, fp32.
    {
      FragC s_acc[L::kBlockN / kFrag];
#pragma unroll
      for (int c = 0; c < L::kBlockN / kFrag; ++c) wmma::fill_fragment(s_acc[c], 0.0f);
#pragma unroll 1
      for (int kd = 0; kd < DP / kFrag; ++kd) {
        FragA<T> a;
        wmma::load_matrix_sync(a, q_s + warp * kFrag * L::kLdT + kd * kFrag, L::kLdT);
#pragma unroll
        for (int c = 0; c < L::kBlockN / kFrag; ++c) {
          FragBT<T> bt;
          wmma::load_matrix_sync(bt, k_s + c * kFrag * L::kLdT + kd * kFrag, L::kLdT);
          wmma::mma_sync(s_acc[c], a, bt, s_acc[c]);
        }
      }
#pragma unroll
      for (int c = 0; c < L::kBlockN / kFrag; ++c) {
        wmma::store_matrix_sync(s_w + c * kFrag, s_acc[c], L::kLdS, wmma::mem_row_major);
      }
    }
    __syncwarp();

    // Softmax of row r over this tile. Pass 1: masked exp2-domain logits (written back in
    // place; each element is read and written by the same lane) and their max (fmaxf may drop a
    // NaN logit from it; its NaN weight in pass 2 still poisons the row: OnlineSoftmax).
    const bool full = geo.tile_fully_visible(q0, q0 + valid_q - 1, k0, L::kBlockN);
    float* s_row = s_w + r * L::kLdS;
    float tile_max = -INFINITY;
#pragma unroll 2
    for (int c = 0; c < L::kBlockN / 8; ++c) {
#pragma unroll
      for (int w = 0; w < kPhiloxWords; ++w) {
        const int j = 8 * c + 4 * parity + w;
        const float t2 = full || geo.visible(i, k0 + j) ? attention_logit(s_row[j], p.scale, p.softcap) * kLog2e
                                                        : -INFINITY;
        s_row[j] = t2;
        tile_max = fmaxf(tile_max, t2);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    const float factor = softmax.rescale_for(tile_max);
    // Pass 2: probabilities; the row sum is of the undropped ones.
    T* p_row = p_w + r * L::kLdP;
    float tile_sum = 0.0f;
#pragma unroll 2
    for (int c = 0; c < L::kBlockN / 8; ++c) {
      const int j0 = 8 * c + 4 * parity;  // k0 + j0 is a multiple of 4 (k0 is: Geometry::key_range)
      float keep[kPhiloxWords];
      dropout.factors4(drop_row, k0 + j0, keep);
#pragma unroll
      for (int w = 0; w < kPhiloxWords; ++w) {
        const float t2 = s_row[j0 + w];
        const float weight = t2 == -INFINITY ? 0.0f : softmax.weight(t2);
        tile_sum += weight;
        p_row[j0 + w] = from_float<T>(weight * keep[w]);
      }
    }
    tile_sum += __shfl_xor_sync(kFullMask, tile_sum, 1);
    softmax.sum += tile_sum;
    if (parity == 0) row_w[r] = factor;
    __syncwarp();

    // O_w = O_w * factor(row) + P_w V.
    {
      float f[kAccElements];
#pragma unroll
      for (int e = 0; e < kAccElements; ++e) f[e] = row_w[acc_row(acc_rows, e)];
#pragma unroll
      for (int c = 0; c < DP / kFrag; ++c) {
#pragma unroll
        for (int e = 0; e < kAccElements; ++e) o_acc[c].x[e] *= f[e];
      }
      // At most 8 output fragments per pass over the key steps, so that the scheduler cannot
      // hoist more than 8 v fragments next to the 16 live accumulators of DP = 256 (without the
      // split, ptxas spills there).
      constexpr int kFrags = DP / kFrag;
      constexpr int kChunk = kFrags <= 8 ? kFrags : kFrags % 8 == 0 ? 8 : kFrags / 2;
      static_assert(kFrags % kChunk == 0 && kChunk <= 8, "PV fragment chunks");
#pragma unroll
      for (int c0 = 0; c0 < DP / kFrag; c0 += kChunk) {
#pragma unroll 1
        for (int kk = 0; kk < L::kBlockN / kFrag; ++kk) {
          FragA<T> a;
          wmma::load_matrix_sync(a, p_w + kk * kFrag, L::kLdP);
#pragma unroll
          for (int c = c0; c < c0 + kChunk; ++c) {
            FragB<T> bv;
            wmma::load_matrix_sync(bv, v_s + kk * kFrag * L::kLdT + c * kFrag, L::kLdT);
            wmma::mma_sync(o_acc[c], a, bv, o_acc[c]);
          }
        }
      }
    }
  }

  // Epilogue: o = O / l (exactly 0 for a row that saw no key, NaN for a NaN l: softmax_row_empty),
  // lse; staged through the warp's S rows.
  __syncwarp();  // every lane has read row_w (the factors) before it is overwritten
  if (parity == 0) row_w[r] = softmax.sum;
  __syncwarp();
  {
    float l[kAccElements];
    bool empty[kAccElements];
#pragma unroll
    for (int e = 0; e < kAccElements; ++e) {
      const float sum = row_w[acc_row(acc_rows, e)];
      empty[e] = softmax_row_empty(sum);
      l[e] = 1.0f / sum;
    }
#pragma unroll
    for (int c = 0; c < DP / kFrag; ++c) {
#pragma unroll
      for (int e = 0; e < kAccElements; ++e) o_acc[c].x[e] = empty[e] ? 0.0f : o_acc[c].x[e] * l[e];
    }
  }
  T* o_g = static_cast<T*>(p.o);
  const int out_r = lane >> 1, out_c = (lane & 1) * 8;  // 8 consecutive elements per lane
  const int64_t out_i = q0 + warp * kFrag + out_r;
  T* o_row = o_g + ((seq.q_out + out_i) * p.hq + h) * p.head_dim;
#pragma unroll
  for (int c = 0; c < DP / kFrag; ++c) {
    wmma::store_matrix_sync(s_w, o_acc[c], L::kLdS, wmma::mem_row_major);
    __syncwarp();
    const int d0 = c * kFrag + out_c;
    if (out_i < seq.n && d0 < head_dim) {
      const float* src = s_w + out_r * L::kLdS + out_c;
      if (flags.out_vec) {  // D % 8 == 0: the chunk is entirely inside the row
        Pack<T, 8> pack;
#pragma unroll
        for (int e = 0; e < 8; ++e) pack.v[e] = from_float<T>(src[e]);
        write_pack(o_row + d0, pack);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (d0 + e < head_dim) o_row[d0 + e] = from_float<T>(src[e]);
        }
      }
    }
    __syncwarp();
  }
  if (parity == 0 && i < seq.n) p.lse[stats_row(p, seq, b, h) + i] = softmax.lse();
#endif
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Delta[b, h, i] = sum_d dout[b, i, h, d] * o[b, i, h, d] in fp32: one warp per row.
template <typename T>
__global__ void __launch_bounds__(kSmallThreads) attention_bwd_delta_kernel(const AttentionBwdParams p) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kSmallThreads / kWarpSize) + threadIdx.x / kWarpSize;
  // Packed sequences: the total_q rows as one batch entry (Delta [Hq, total_q]; no batch stride).
  const bool packed = p.cu_seqlens_q != nullptr;
  const int64_t n = packed ? p.total_q : p.n, batch = packed ? 1 : p.batch;
  if (row >= batch * p.hq * n) return;  // whole warps leave together
  const int64_t i = row % n, h = (row / n) % p.hq, b = row / (n * p.hq);
  const T* dout = static_cast<const T*>(p.dout) + b * p.dout_batch_stride + i * p.dout_row_stride + h * p.dout_head_stride;
  const T* o = static_cast<const T*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
  float sum = 0.0f;
  for (int64_t d = lane; d < p.head_dim; d += kWarpSize) sum += to_float(dout[d]) * to_float(o[d]);
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
  if (lane == 0) p.delta[row] = sum;  // row = (b * Hq + h) * n + i
}

// S = Q K^T and dP = dO V^T for a [BM, BN] tile into shared fp32, 16x16 fragments spread over
// the warps (BM / 16 * BN / 16 a multiple of WARPS).
template <typename T, int BM, int BN, int DP, int WARPS>
__device__ __forceinline__ void score_tiles(const T* q_s, const T* do_s, const T* k_s, const T* v_s, int ld_t,
                                            float* s_s, float* dp_s, int ld_s, int warp) {
  constexpr int kTilesN = BN / kFrag, kTiles = BM / kFrag * kTilesN;
  static_assert(kTiles % WARPS == 0, "score tiles per warp");
#pragma unroll
  for (int t = 0; t < kTiles / WARPS; ++t) {
    const int tile = warp + t * WARPS;
    const int tr = tile / kTilesN, tc = tile % kTilesN;
    FragC s, dp;
    wmma::fill_fragment(s, 0.0f);
    wmma::fill_fragment(dp, 0.0f);
#pragma unroll 1
    for (int kd = 0; kd < DP / kFrag; ++kd) {
      FragA<T> a;
      FragBT<T> bt;
      wmma::load_matrix_sync(a, q_s + tr * kFrag * ld_t + kd * kFrag, ld_t);
      wmma::load_matrix_sync(bt, k_s + tc * kFrag * ld_t + kd * kFrag, ld_t);
      wmma::mma_sync(s, a, bt, s);
      wmma::load_matrix_sync(a, do_s + tr * kFrag * ld_t + kd * kFrag, ld_t);
      wmma::load_matrix_sync(bt, v_s + tc * kFrag * ld_t + kd * kFrag, ld_t);
      wmma::mma_sync(dp, a, bt, dp);
    }
    wmma::store_matrix_sync(s_s + tr * kFrag * ld_s + tc * kFrag, s, ld_s, wmma::mem_row_major);
    wmma::store_matrix_sync(dp_s + tr * kFrag * ld_s + tc * kFrag, dp, ld_s, wmma::mem_row_major);
  }
}

// Scalars of the backward's element-wise step.
struct BwdScalars {
  Geometry geo;
  Dropout dropout;
  float scale, softcap;
};

// The backward's element-wise step on a [BM, BN] tile (query rows q0.., keys k0..), all threads:
//   visible: t = logit(S), prob = exp2(t * log2e - lse * log2e), keep = 1/(1-p) or 0,
//            P_d = prob * keep, dS = prob * (dP * keep - Delta) * dlogit/ddot(t);
//   masked, or a row past N:  P_d = dS = 0.
// Rows past N (zero q and dout, lse = +inf, Delta = 0) are selected out too, even in full tiles:
// their score 0 * k is NaN where a key holds an infinite value, and exp2(NaN) would reach dk, dv.
// lse2_s holds lse * log2e per row. Writes P_d (when WANT_P) and dS rounded to T. Each thread
// takes four consecutive keys at a time (k0 is a multiple of 4: key blocks, Geometry::key_range):
// one Philox call for their dropout factors, 16-byte reads of S and dP (ld_s and the tile bases are
// multiples of 4 floats), 4-element writes of P_d and dS (ld_p a multiple of 4 elements).
template <typename T, int BM, int BN, int THREADS, bool WANT_P>
__device__ __forceinline__ void backward_tile(const BwdScalars& sc, const float* s_s, const float* dp_s, int ld_s,
                                              T* pd_s, T* ds_s, int ld_p, const float* lse2_s,
                                              const float* delta_s, int64_t q0, int64_t k0, bool full,
                                              uint64_t drop_head) {
  static_assert(BN % kPhiloxWords == 0, "key tiles hold whole Philox groups");
  constexpr int kGroups = BN / kPhiloxWords;
#pragma unroll 2
  for (int idx = static_cast<int>(threadIdx.x); idx < BM * kGroups; idx += THREADS) {
    const int r = idx / kGroups, c = kPhiloxWords * (idx % kGroups);
    const int64_t i = q0 + r;
    const bool row = i < sc.geo.n;
    const Pack<float, 4> s4 = *reinterpret_cast<const Pack<float, 4>*>(s_s + r * ld_s + c);
    const Pack<float, 4> dp4 = *reinterpret_cast<const Pack<float, 4>*>(dp_s + r * ld_s + c);
    float keep[kPhiloxWords];
    sc.dropout.factors4(drop_head + static_cast<uint64_t>(i), k0 + c, keep);
    Pack<T, 4> pd4, ds4;
#pragma unroll
    for (int w = 0; w < kPhiloxWords; ++w) {
      float pd = 0.0f, ds = 0.0f;
      if (row && (full || sc.geo.visible(i, k0 + c + w))) {
        const float t = attention_logit(s4.v[w], sc.scale, sc.softcap);
        const float prob = exp2f(t * kLog2e - lse2_s[r]);
        pd = prob * keep[w];
        ds = prob * (dp4.v[w] * keep[w] - delta_s[r]) * attention_logit_grad(t, sc.scale, sc.softcap);
      }
      pd4.v[w] = from_float<T>(pd);
      ds4.v[w] = from_float<T>(ds);
    }
    if constexpr (WANT_P) *reinterpret_cast<Pack<T, 4>*>(pd_s + r * ld_p + c) = pd4;
    *reinterpret_cast<Pack<T, 4>*>(ds_s + r * ld_p + c) = ds4;
  }
}

// lse * log2e (+inf past n) and Delta (0 past n) of query rows q0 .. q0 + BM - 1 of one head.
template <int BM>
__device__ __forceinline__ void load_row_stats(const AttentionBwdParams& p, int64_t row_head, int64_t n, int64_t q0,
                                               float* lse2_s, float* delta_s) {
  for (int r = static_cast<int>(threadIdx.x); r < BM; r += static_cast<int>(blockDim.x)) {
    const int64_t i = q0 + r;
    const bool valid = i < n;
    lse2_s[r] = valid ? p.lse[row_head + i] * kLog2e : INFINITY;
    delta_s[r] = valid ? p.delta[row_head + i] : 0.0f;
  }
}

// One block: keys k0 .. k0 + kBlockN - 1 of one (batch, kv head). Grid: (ceil(M / kBlockN), Hkv,
// B). For each query head h of the group and each visible query step q0:
//   barrier; load q (rotated), dout, lse, Delta; barrier; S, dP (one fragment each per warp);
//   barrier; P_d, dS (all threads); barrier; dV += P_d^T dO, dK += dS^T Q (registers);
//   ATOMIC_DQ: dq[q0..] += dS K, each warp staging its 16x16 fragments and adding them with
//   fp32 atomics to dq_accum.
// Epilogue: dK through rope_rotate_grad at the key positions, then dV, rounded once.
template <typename T, int DP, bool ATOMIC_DQ>
__global__ void __launch_bounds__(DkDvTiles<DP>::kThreads, DkDvTiles<DP>::kMinBlocks)
    attention_bwd_dkdv_kernel(const AttentionBwdParams p, const TileFlags flags) {
#if defined(REMAT_ATTENTION_ARCH_UNSUPPORTED)
  __trap();
#else
  using L = DkDvTiles<DP>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* k_s = reinterpret_cast<T*>(smem + L::kK);
  T* v_s = reinterpret_cast<T*>(smem + L::kV);
  T* q_s = reinterpret_cast<T*>(smem + L::kQ);
  T* do_s = reinterpret_cast<T*>(smem + L::kDo);
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  float* dp_s = reinterpret_cast<float*>(smem + L::kDp);
  T* pd_s = reinterpret_cast<T*>(smem + L::kPd);
  T* ds_s = reinterpret_cast<T*>(smem + L::kDs);
  float* lse2_s = reinterpret_cast<float*>(smem + L::kLse);
  float* delta_s = reinterpret_cast<float*>(smem + L::kDelta);

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t kvh = blockIdx.y, b = blockIdx.z;
  const SequenceRows seq = sequence_rows(p, b);
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * L::kBlockN;
  if (k0 >= seq.m) return;  // a block past a packed sequence's keys (the whole block leaves)
  const int valid_k = static_cast<int>(min64(L::kBlockN, seq.m - k0));
  const int64_t group = p.hq / p.hkv;
  const int head_dim = static_cast<int>(p.head_dim);
  const BwdScalars sc{{seq.n, seq.m, seq.m - seq.n, p.window_left, p.window_right},
                      Dropout::make(p.dropout_p, p.rng, p.m),
                      p.scale,
                      p.softcap};
  const float* cos = rope_rows(p, p.cos, seq, b);
  const float* sin = rope_rows(p, p.sin, seq, b);

  load_tile<T, L::kBlockN, DP, L::kThreads>(
      k_s, L::kLdT,
      static_cast<const T*>(p.k) + b * p.k_batch_stride + (seq.k_start + k0) * p.k_row_stride +
          kvh * p.k_head_stride,
      p.k_row_stride, valid_k, head_dim, flags.k_vec);
  load_tile<T, L::kBlockN, DP, L::kThreads>(
      v_s, L::kLdT,
      static_cast<const T*>(p.v) + b * p.v_batch_stride + (seq.k_start + k0) * p.v_row_stride +
          kvh * p.v_head_stride,
      p.v_row_stride, valid_k, head_dim, flags.v_vec);
  cp_async_wait_all();
  __syncthreads();
  if (cos != nullptr) {  // read only after the barriers of the loop (or of the epilogue)
    rope_tile<T, DP, L::kThreads>(k_s, L::kLdT, valid_k, head_dim, cos, sin, k0, flags.rope_vec);
  }

  // This warp's part of dK / dV: key rows wr*16.., column fragments wc*kColTiles...
  const int wr = warp % L::kRowTiles, wc = warp / L::kRowTiles;
  FragC dk_acc[L::kColTiles], dv_acc[L::kColTiles];
#pragma unroll
  for (int ct = 0; ct < L::kColTiles; ++ct) {
    wmma::fill_fragment(dk_acc[ct], 0.0f);
    wmma::fill_fragment(dv_acc[ct], 0.0f);
  }

  int64_t q_lo, q_hi;
  sc.geo.query_range(k0, k0 + valid_k - 1, q_lo, q_hi);
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    const int64_t row_head = stats_row(p, seq, b, h);  // row (b, h, 0) of lse / Delta
    const uint64_t drop_head = static_cast<uint64_t>((b * p.hq + h) * p.n);  // stream row (b, h, 0)
    const T* q_g = static_cast<const T*>(p.q) + b * p.q_batch_stride + seq.q_start * p.q_row_stride +
                   h * p.q_head_stride;
    const T* do_g = static_cast<const T*>(p.dout) + b * p.dout_batch_stride + seq.q_start * p.dout_row_stride +
                    h * p.dout_head_stride;
    for (int64_t q0 = q_lo; q0 < q_hi; q0 += L::kBlockM) {
      const int valid_q = static_cast<int>(min64(L::kBlockM, seq.n - q0));
      __syncthreads();  // the previous step is done with q, dout, P_d, dS, the stats and S
      load_tile<T, L::kBlockM, DP, L::kThreads>(q_s, L::kLdT, q_g + q0 * p.q_row_stride, p.q_row_stride, valid_q,
                                                head_dim, flags.q_vec);
      load_tile<T, L::kBlockM, DP, L::kThreads>(do_s, L::kLdT, do_g + q0 * p.dout_row_stride, p.dout_row_stride,
                                                valid_q, head_dim, flags.do_vec);
      load_row_stats<L::kBlockM>(p, row_head, seq.n, q0, lse2_s, delta_s);
      cp_async_wait_all();
      __syncthreads();
      if (cos != nullptr) {
        rope_tile<T, DP, L::kThreads>(q_s, L::kLdT, valid_q, head_dim, cos, sin, q0 + sc.geo.shift, flags.rope_vec);
        __syncthreads();
      }

      score_tiles<T, L::kBlockM, L::kBlockN, DP, L::kWarps>(q_s, do_s, k_s, v_s, L::kLdT, s_s, dp_s, L::kLdS, warp);
      __syncthreads();

      const bool full = sc.geo.tile_fully_visible(q0, q0 + valid_q - 1, k0, L::kBlockN);
      backward_tile<T, L::kBlockM, L::kBlockN, L::kThreads, true>(sc, s_s, dp_s, L::kLdS, pd_s, ds_s, L::kLdP,
                                                                  lse2_s, delta_s, q0, k0, full, drop_head);
      __syncthreads();

      // dV += P_d^T dO, dK += dS^T Q over the kBlockM query rows of this step.
#pragma unroll 1
      for (int mm = 0; mm < L::kBlockM / kFrag; ++mm) {
        FragAT<T> a_p, a_s;
        wmma::load_matrix_sync(a_p, pd_s + mm * kFrag * L::kLdP + wr * kFrag, L::kLdP);
        wmma::load_matrix_sync(a_s, ds_s + mm * kFrag * L::kLdP + wr * kFrag, L::kLdP);
#pragma unroll
        for (int ct = 0; ct < L::kColTiles; ++ct) {
          const int col = (wc * L::kColTiles + ct) * kFrag;
          FragB<T> bf;
          wmma::load_matrix_sync(bf, do_s + mm * kFrag * L::kLdT + col, L::kLdT);
          wmma::mma_sync(dv_acc[ct], a_p, bf, dv_acc[ct]);
          wmma::load_matrix_sync(bf, q_s + mm * kFrag * L::kLdT + col, L::kLdT);
          wmma::mma_sync(dk_acc[ct], a_s, bf, dk_acc[ct]);
        }
      }

      if constexpr (ATOMIC_DQ) {
        // dq rows q0.. += dS K: [kBlockM, DP] fragments spread over the warps. The staging tile
        // (16x16 fp32 per warp) sits in the S region, dead since the element-wise step.
        float* stage = s_s + warp * kFrag * kFrag;
        constexpr int kTilesD = DP / kFrag, kTiles = L::kBlockM / kFrag * kTilesD;
        float* dq_head = p.dq_accum + (seq.q_out * p.hq + h) * p.head_dim;  // (b, 0, h, 0)
        const int out_r = lane >> 1, out_c = (lane & 1) * 8;
        for (int tile = warp; tile < kTiles; tile += L::kWarps) {
          const int tr = tile / kTilesD, tc = tile % kTilesD;
          FragC acc;
          wmma::fill_fragment(acc, 0.0f);
#pragma unroll 1
          for (int kk = 0; kk < L::kBlockN / kFrag; ++kk) {
            FragA<T> a;
            FragB<T> bk;
            wmma::load_matrix_sync(a, ds_s + tr * kFrag * L::kLdP + kk * kFrag, L::kLdP);
            wmma::load_matrix_sync(bk, k_s + kk * kFrag * L::kLdT + tc * kFrag, L::kLdT);
            wmma::mma_sync(acc, a, bk, acc);
          }
          wmma::store_matrix_sync(stage, acc, kFrag, wmma::mem_row_major);
          __syncwarp();
          const int64_t i = q0 + tr * kFrag + out_r;
          if (i < seq.n) {
            float* dst = dq_head + i * p.hq * p.head_dim;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              const int d = tc * kFrag + out_c + e;
              if (d < head_dim) atomicAdd(dst + d, stage[out_r * kFrag + out_c + e]);
            }
          }
          __syncwarp();
        }
      }
    }
  }

  // Epilogue: stage dK, then dV, as fp32 [kBlockN, DP] from offset 0 (every region is dead).
  float* stage = reinterpret_cast<float*>(smem);
  const int64_t out_offset = ((seq.k_out + k0) * p.hkv + kvh) * p.head_dim;
  const int64_t out_row_stride = p.hkv * p.head_dim;
  __syncthreads();
#pragma unroll
  for (int ct = 0; ct < L::kColTiles; ++ct) {
    wmma::store_matrix_sync(stage + wr * kFrag * L::kLdO + (wc * L::kColTiles + ct) * kFrag, dk_acc[ct], L::kLdO,
                            wmma::mem_row_major);
  }
  __syncthreads();
  store_rows<T, L::kBlockN, DP, L::kThreads>(stage, L::kLdO, static_cast<T*>(p.dk) + out_offset, out_row_stride,
                                             valid_k, head_dim, cos, sin, k0);
  __syncthreads();
#pragma unroll
  for (int ct = 0; ct < L::kColTiles; ++ct) {
    wmma::store_matrix_sync(stage + wr * kFrag * L::kLdO + (wc * L::kColTiles + ct) * kFrag, dv_acc[ct], L::kLdO,
                            wmma::mem_row_major);
  }
  __syncthreads();
  store_rows<T, L::kBlockN, DP, L::kThreads>(stage, L::kLdO, static_cast<T*>(p.dv) + out_offset, out_row_stride,
                                             valid_k, head_dim, nullptr, nullptr, 0);
#endif
}

// Deterministic dQ. One block: 64 query rows of one (batch, query head). Grid: (ceil(N / 64),
// Hq, B), the last query blocks (most keys under a causal mask) first. Per visible key tile:
//   barrier; load k (rotated), v; barrier; S, dP; barrier; dS (all threads); barrier;
//   dQ += dS K (registers).
// Epilogue: dQ through rope_rotate_grad at the query positions, rounded once.
template <typename T, int DP>
__global__ void __launch_bounds__(DqTiles<DP>::kThreads, DqTiles<DP>::kMinBlocks)
    attention_bwd_dq_kernel(const AttentionBwdParams p, const TileFlags flags) {
#if defined(REMAT_ATTENTION_ARCH_UNSUPPORTED)
  __trap();
#else
  using L = DqTiles<DP>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem + L::kQ);
  T* do_s = reinterpret_cast<T*>(smem + L::kDo);
  T* k_s = reinterpret_cast<T*>(smem + L::kK);
  T* v_s = reinterpret_cast<T*>(smem + L::kV);
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  float* dp_s = reinterpret_cast<float*>(smem + L::kDp);
  T* ds_s = reinterpret_cast<T*>(smem + L::kDs);
  float* lse2_s = reinterpret_cast<float*>(smem + L::kLse);
  float* delta_s = reinterpret_cast<float*>(smem + L::kDelta);

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t q_block = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const SequenceRows seq = sequence_rows(p, b);
  const int64_t kvh = h / (p.hq / p.hkv);
  const int64_t q0 = q_block * L::kBlockM;
  if (q0 >= seq.n) return;  // a block past a packed sequence's end (the whole block leaves)
  const int valid_q = static_cast<int>(min64(L::kBlockM, seq.n - q0));
  const int head_dim = static_cast<int>(p.head_dim);
  const BwdScalars sc{{seq.n, seq.m, seq.m - seq.n, p.window_left, p.window_right},
                      Dropout::make(p.dropout_p, p.rng, p.m),
                      p.scale,
                      p.softcap};
  const float* cos = rope_rows(p, p.cos, seq, b);
  const float* sin = rope_rows(p, p.sin, seq, b);
  const int64_t row_head = stats_row(p, seq, b, h);
  const uint64_t drop_head = static_cast<uint64_t>((b * p.hq + h) * p.n);  // stream row (b, h, 0)

  load_tile<T, L::kBlockM, DP, L::kThreads>(
      q_s, L::kLdT,
      static_cast<const T*>(p.q) + b * p.q_batch_stride + (seq.q_start + q0) * p.q_row_stride +
          h * p.q_head_stride,
      p.q_row_stride, valid_q, head_dim, flags.q_vec);
  load_tile<T, L::kBlockM, DP, L::kThreads>(
      do_s, L::kLdT,
      static_cast<const T*>(p.dout) + b * p.dout_batch_stride + (seq.q_start + q0) * p.dout_row_stride +
          h * p.dout_head_stride,
      p.dout_row_stride, valid_q, head_dim, flags.do_vec);
  load_row_stats<L::kBlockM>(p, row_head, seq.n, q0, lse2_s, delta_s);
  cp_async_wait_all();
  __syncthreads();
  if (cos != nullptr) {  // read only after the barriers of the key loop (or of the epilogue)
    rope_tile<T, DP, L::kThreads>(q_s, L::kLdT, valid_q, head_dim, cos, sin, q0 + sc.geo.shift, flags.rope_vec);
  }

  const int wr = warp % L::kRowTiles, wc = warp / L::kRowTiles;
  FragC dq_acc[L::kColTiles];
#pragma unroll
  for (int ct = 0; ct < L::kColTiles; ++ct) wmma::fill_fragment(dq_acc[ct], 0.0f);

  const T* k_g = static_cast<const T*>(p.k) + b * p.k_batch_stride + seq.k_start * p.k_row_stride +
                 kvh * p.k_head_stride;
  const T* v_g = static_cast<const T*>(p.v) + b * p.v_batch_stride + seq.k_start * p.v_row_stride +
                 kvh * p.v_head_stride;
  int64_t k_lo, k_hi;
  sc.geo.key_range(q0, q0 + valid_q - 1, k_lo, k_hi);
  for (int64_t k0 = k_lo; k0 < k_hi; k0 += L::kBlockN) {
    const int valid_k = static_cast<int>(min64(L::kBlockN, seq.m - k0));
    __syncthreads();  // the previous tile is done with k, v, dS (first pass: q, dout, stats loaded)
    load_tile<T, L::kBlockN, DP, L::kThreads>(k_s, L::kLdT, k_g + k0 * p.k_row_stride, p.k_row_stride, valid_k,
                                              head_dim, flags.k_vec);
    load_tile<T, L::kBlockN, DP, L::kThreads>(v_s, L::kLdT, v_g + k0 * p.v_row_stride, p.v_row_stride, valid_k,
                                              head_dim, flags.v_vec);
    cp_async_wait_all();
    __syncthreads();
    if (cos != nullptr) {
      rope_tile<T, DP, L::kThreads>(k_s, L::kLdT, valid_k, head_dim, cos, sin, k0, flags.rope_vec);
      __syncthreads();
    }

    score_tiles<T, L::kBlockM, L::kBlockN, DP, L::kWarps>(q_s, do_s, k_s, v_s, L::kLdT, s_s, dp_s, L::kLdS, warp);
    __syncthreads();

    const bool full = sc.geo.tile_fully_visible(q0, q0 + valid_q - 1, k0, L::kBlockN);
    backward_tile<T, L::kBlockM, L::kBlockN, L::kThreads, false>(sc, s_s, dp_s, L::kLdS, nullptr, ds_s, L::kLdP,
                                                                 lse2_s, delta_s, q0, k0, full, drop_head);
    __syncthreads();

#pragma unroll 1
    for (int kk = 0; kk < L::kBlockN / kFrag; ++kk) {
      FragA<T> a;
      wmma::load_matrix_sync(a, ds_s + wr * kFrag * L::kLdP + kk * kFrag, L::kLdP);
#pragma unroll
      for (int ct = 0; ct < L::kColTiles; ++ct) {
        FragB<T> bk;
        wmma::load_matrix_sync(bk, k_s + kk * kFrag * L::kLdT + (wc * L::kColTiles + ct) * kFrag, L::kLdT);
        wmma::mma_sync(dq_acc[ct], a, bk, dq_acc[ct]);
      }
    }
  }

  float* stage = reinterpret_cast<float*>(smem);
  __syncthreads();
#pragma unroll
  for (int ct = 0; ct < L::kColTiles; ++ct) {
    wmma::store_matrix_sync(stage + wr * kFrag * L::kLdO + (wc * L::kColTiles + ct) * kFrag, dq_acc[ct], L::kLdO,
                            wmma::mem_row_major);
  }
  __syncthreads();
  store_rows<T, L::kBlockM, DP, L::kThreads>(stage, L::kLdO,
                                             static_cast<T*>(p.dq) + ((seq.q_out + q0) * p.hq + h) * p.head_dim,
                                             p.hq * p.head_dim, valid_q, head_dim, cos, sin, q0 + sc.geo.shift);
#endif
}

// The packed sequence that holds query row t (the last s with cu_seqlens_q[s] <= t: sequences
// without queries share their start with the next one and are passed over).
__device__ __forceinline__ int64_t sequence_of_row(const AttentionBwdParams& p, int64_t t) {
  int64_t lo = 0, hi = p.batch;  // cu_seqlens_q[lo] <= t < cu_seqlens_q[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.cu_seqlens_q[mid] <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// Non-deterministic mode's last step: dq = rope_rotate_grad(dq_accum) at the query positions
// (identity without rope), rounded to T. dq_accum and dq are contiguous [B, N, Hq, D] ([total_q,
// Hq, D] for packed sequences, whose rows find their sequence by a binary search of the offsets).
template <typename T>
__global__ void __launch_bounds__(kSmallThreads) attention_bwd_dq_convert_kernel(const AttentionBwdParams p) {
  const bool rope = p.cos != nullptr;
  const bool packed = p.cu_seqlens_q != nullptr;
  const int64_t per_row = rope ? p.head_dim / 2 : p.head_dim;
  const int64_t total = (packed ? p.total_q : p.batch * p.n) * p.hq * per_row;
  T* dq = static_cast<T*>(p.dq);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kSmallThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kSmallThreads) {
    const int64_t row = idx / per_row, d = idx % per_row;  // row = (b * N + i) * Hq + h
    const float* src = p.dq_accum + row * p.head_dim;
    T* dst = dq + row * p.head_dim;
    if (!rope) {
      dst[d] = from_float<T>(src[d]);
      continue;
    }
    const int64_t half = per_row;
    const int64_t token = row / p.hq;
    const int64_t b = packed ? sequence_of_row(p, token) : token / p.n;
    const SequenceRows seq = sequence_rows(p, b);
    const int64_t i = token - seq.q_out;
    const int64_t at = b * p.rope_batch_stride + seq.k_start * p.rope_token_stride + (i + seq.m - seq.n) * half + d;
    float dx1, dx2;
    rope_rotate_grad(src[d], src[d + half], p.cos[at], p.sin[at], dx1, dx2);
    dst[d] = from_float<T>(dx1);
    dst[d + half] = from_float<T>(dx2);
  }
}

}  // namespace attn_detail
}  // namespace remat
