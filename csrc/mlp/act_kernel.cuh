// Device code of the MLP activation kernels: glu (h = act(gate) * up) and plain activation
// (h = act(gate)), forward and backward. The launchers are in act.cu; the interface in act.h.
//
// Recompute contract. The MLP saves only the pre-activations (gate, and up for glu). The backward
// recomputes act(gate) and act'(gate) from them, and h too when the caller needs it for the down
// projection's weight gradient, instead of reading a saved activation.
//
// Numerics. Inputs are widened to fp32, the activation and its derivative come from
// common/activation.h (the arithmetic the CPU kernels share), and every output is rounded once to
// T with round-to-nearest-even, as torch rounds the same casts.
//
// Work layout. The arrays are flat: element i of every tensor belongs together. Thread `thread`
// of `num_threads` handles the packs of VEC consecutive elements starting at VEC * p for
// p = thread, thread + num_threads, ... (a grid-stride loop, 64-bit indices), then the last
// numel % VEC elements one at a time in the same way. With VEC > 1 the launcher guarantees that
// every pointer is 16-byte aligned and VEC * sizeof(T) == 16, so each pack is one 16-byte load or
// store per tensor. A thread loads all inputs of a pack before it stores any output, so an output
// may share its memory with an input of the same element (in place).
//
// The per-thread bodies are __host__ __device__ so that a host program can run them over host
// arrays, emulating any grid, to test indexing, tails and rounding without a GPU.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/activation.h"
#include "common/math.h"
#include "common/pack.cuh"

namespace remat {
namespace act_detail {

constexpr int kBlockThreads = 256;

template <typename T, int N>
REMAT_HOST_DEVICE void load_pack(const T* ptr, float (&out)[N]) {
  Pack<T, N> pack;
#if defined(__CUDA_ARCH__)
  pack = *reinterpret_cast<const Pack<T, N>*>(ptr);
#else
  __builtin_memcpy(static_cast<void*>(&pack), ptr, sizeof(pack));
#endif
  REMAT_UNROLL
  for (int i = 0; i < N; ++i) out[i] = to_float(pack.v[i]);
}

// Rounds N values to T and stores them as one pack.
template <typename T, int N>
REMAT_HOST_DEVICE void store_pack(T* ptr, const float (&in)[N]) {
  Pack<T, N> pack;
  REMAT_UNROLL
  for (int i = 0; i < N; ++i) pack.v[i] = from_float<T>(in[i]);
  write_pack(ptr, pack);
}

// Forward of one element in fp32: act(gate) * up (GATED) or act(gate).
template <Activation ACT, bool GATED>
REMAT_HOST_DEVICE float act_fwd_value(float gate, float up) {
  const float a = activate(ACT, gate);
  if constexpr (GATED) {
    return a * up;
  } else {
    return a;
  }
}

struct ActGrads {
  float dgate;
  float dup;  // GATED only
  float h;    // the recomputed forward output
};

// Backward of one element in fp32.
// GATED: dgate = dh * up * act'(gate), dup = dh * act(gate), h = act(gate) * up.
// Plain: dgate = dh * act'(gate), h = act(gate).
template <Activation ACT, bool GATED>
REMAT_HOST_DEVICE ActGrads act_bwd_value(float dh, float gate, float up) {
  const float a = activate(ACT, gate);
  const float da = activate_grad(ACT, gate);
  ActGrads grads{};
  if constexpr (GATED) {
    grads.dgate = dh * up * da;
    grads.dup = dh * a;
    grads.h = a * up;
  } else {
    grads.dgate = dh * da;
    grads.h = a;
  }
  return grads;
}

// Forward over elements [first, first + N) (N = VEC for a pack, 1 for the tail). up is read only
// when GATED.
template <typename T, int N, bool GATED, Activation ACT>
REMAT_HOST_DEVICE void act_fwd_chunk(const T* gate, const T* up, T* h, int64_t first) {
  float g[N];
  float u[N];
  load_pack<T, N>(gate + first, g);
  if constexpr (GATED) load_pack<T, N>(up + first, u);
  float out[N];
  REMAT_UNROLL
  for (int i = 0; i < N; ++i) out[i] = act_fwd_value<ACT, GATED>(g[i], GATED ? u[i] : 1.0f);
  store_pack<T, N>(h + first, out);
}

// Backward over elements [first, first + N). up and dup are used only when GATED; h is written
// when not nullptr.
template <typename T, int N, bool GATED, Activation ACT>
REMAT_HOST_DEVICE void act_bwd_chunk(const T* dh, const T* gate, const T* up, T* dgate, T* dup, T* h,
                                     int64_t first) {
  float d[N];
  float g[N];
  float u[N];
  load_pack<T, N>(dh + first, d);
  load_pack<T, N>(gate + first, g);
  if constexpr (GATED) load_pack<T, N>(up + first, u);
  float dgate_out[N];
  float dup_out[N];
  float h_out[N];
  REMAT_UNROLL
  for (int i = 0; i < N; ++i) {
    const ActGrads grads = act_bwd_value<ACT, GATED>(d[i], g[i], GATED ? u[i] : 1.0f);
    dgate_out[i] = grads.dgate;
    dup_out[i] = grads.dup;
    h_out[i] = grads.h;
  }
  store_pack<T, N>(dgate + first, dgate_out);
  if constexpr (GATED) store_pack<T, N>(dup + first, dup_out);
  if (h != nullptr) store_pack<T, N>(h + first, h_out);
}

// The work of thread `thread` of `num_threads` (see Work layout).
template <typename T, int VEC, bool GATED, Activation ACT>
REMAT_HOST_DEVICE void act_fwd_thread(const T* gate, const T* up, T* h, int64_t numel, int64_t thread,
                                      int64_t num_threads) {
  const int64_t num_packs = numel / VEC;
  for (int64_t pack = thread; pack < num_packs; pack += num_threads) {
    act_fwd_chunk<T, VEC, GATED, ACT>(gate, up, h, pack * VEC);
  }
  if constexpr (VEC > 1) {
    for (int64_t i = num_packs * VEC + thread; i < numel; i += num_threads) {
      act_fwd_chunk<T, 1, GATED, ACT>(gate, up, h, i);
    }
  }
}

template <typename T, int VEC, bool GATED, Activation ACT>
REMAT_HOST_DEVICE void act_bwd_thread(const T* dh, const T* gate, const T* up, T* dgate, T* dup, T* h,
                                      int64_t numel, int64_t thread, int64_t num_threads) {
  const int64_t num_packs = numel / VEC;
  for (int64_t pack = thread; pack < num_packs; pack += num_threads) {
    act_bwd_chunk<T, VEC, GATED, ACT>(dh, gate, up, dgate, dup, h, pack * VEC);
  }
  if constexpr (VEC > 1) {
    for (int64_t i = num_packs * VEC + thread; i < numel; i += num_threads) {
      act_bwd_chunk<T, 1, GATED, ACT>(dh, gate, up, dgate, dup, h, i);
    }
  }
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Launch: blockDim.x <= kBlockThreads, any grid size.
template <typename T, int VEC, bool GATED, Activation ACT>
__global__ void __launch_bounds__(kBlockThreads)
    act_fwd_kernel(const T* gate, const T* up, T* h, int64_t numel) {
  act_fwd_thread<T, VEC, GATED, ACT>(gate, up, h, numel, global_thread(), grid_threads());
}

template <typename T, int VEC, bool GATED, Activation ACT>
__global__ void __launch_bounds__(kBlockThreads)
    act_bwd_kernel(const T* dh, const T* gate, const T* up, T* dgate, T* dup, T* h, int64_t numel) {
  act_bwd_thread<T, VEC, GATED, ACT>(dh, gate, up, dgate, dup, h, numel, global_thread(), grid_threads());
}

}  // namespace act_detail
}  // namespace remat
