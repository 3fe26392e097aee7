// Host launchers of the MLP activation kernels (act_kernel.cuh): pointer checks, the choice of the
// vectorized or scalar path, the grid, the launch. Only CUDA headers, so this file compiles
// without torch.
#include "mlp/act.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/math.h"
#include "mlp/act_kernel.cuh"

namespace remat {
namespace {

using act_detail::kBlockThreads;

// Grid cap. Past kMaxBlocks * kBlockThreads work items (16M: packs, or elements on the scalar
// path) the threads loop. That many threads are far more than a GPU holds at once (an H100 or
// H200: 132 SMs * 2048 threads), so the cap bounds the grid without leaving SMs idle.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

bool is_aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Enough threads for one pack each (the numel % vec tail needs fewer than one per pack position).
unsigned grid_blocks(int64_t numel, int vec) {
  return static_cast<unsigned>(std::min(ceil_div(ceil_div(numel, vec), kBlockThreads), kMaxBlocks));
}

// Compile-time values handed to the launch lambdas, which read them back with decltype.
template <typename T>
struct TypeTag {
  using type = T;
};
template <int V>
using VecTag = std::integral_constant<int, V>;
template <bool B>
using GatedTag = std::integral_constant<bool, B>;
template <Activation A>
using ActTag = std::integral_constant<Activation, A>;

template <typename T, int VEC, bool GATED, typename Launch>
cudaError_t dispatch_activation(Activation activation, const Launch& launch) {
  const TypeTag<T> type;
  const VecTag<VEC> vec;
  const GatedTag<GATED> gated;
  switch (activation) {
    case Activation::kSilu: return launch(type, vec, gated, ActTag<Activation::kSilu>{});
    case Activation::kGelu: return launch(type, vec, gated, ActTag<Activation::kGelu>{});
    case Activation::kGeluTanh: return launch(type, vec, gated, ActTag<Activation::kGeluTanh>{});
  }
  return cudaErrorInvalidValue;
}

// vectorized: 16-byte packs (VEC = 16 / sizeof(T)); every pointer must then be 16-byte aligned.
template <typename T, typename Launch>
cudaError_t dispatch_layout(bool vectorized, bool gated, Activation activation, const Launch& launch) {
  constexpr int kVec = 16 / sizeof(T);
  if (vectorized) {
    return gated ? dispatch_activation<T, kVec, true>(activation, launch)
                 : dispatch_activation<T, kVec, false>(activation, launch);
  }
  return gated ? dispatch_activation<T, 1, true>(activation, launch)
               : dispatch_activation<T, 1, false>(activation, launch);
}

// Calls launch(TypeTag<T>, VecTag<VEC>, GatedTag<GATED>, ActTag<ACT>) with the compile-time values
// that match the runtime ones.
template <typename Launch>
cudaError_t dispatch(ScalarKind kind, bool vectorized, bool gated, Activation activation,
                     const Launch& launch) {
  switch (kind) {
    case ScalarKind::kFloat32: return dispatch_layout<float>(vectorized, gated, activation, launch);
    case ScalarKind::kFloat16: return dispatch_layout<__half>(vectorized, gated, activation, launch);
    case ScalarKind::kBFloat16: return dispatch_layout<__nv_bfloat16>(vectorized, gated, activation, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t act_fwd_cuda(const void* gate, const void* up, void* h, int64_t numel, Activation activation,
                         ScalarKind kind, cudaStream_t stream) {
  if (numel < 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  if (gate == nullptr || h == nullptr) return cudaErrorInvalidValue;
  const bool gated = up != nullptr;
  const bool vectorized = is_aligned_16(gate) && is_aligned_16(up) && is_aligned_16(h);
  const auto launch = [&](auto type, auto vec, auto gated_tag, auto act) {
    using T = typename decltype(type)::type;
    constexpr int kVec = decltype(vec)::value;
    act_detail::act_fwd_kernel<T, kVec, decltype(gated_tag)::value, decltype(act)::value>
        <<<grid_blocks(numel, kVec), kBlockThreads, 0, stream>>>(
            static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(h), numel);
    return cudaGetLastError();
  };
  return dispatch(kind, vectorized, gated, activation, launch);
}

cudaError_t act_bwd_cuda(const void* dh, const void* gate, const void* up, void* dgate, void* dup, void* h,
                         int64_t numel, Activation activation, ScalarKind kind, cudaStream_t stream) {
  if (numel < 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  if (dh == nullptr || gate == nullptr || dgate == nullptr) return cudaErrorInvalidValue;
  // glu takes both up and dup, the plain activation neither.
  if ((up == nullptr) != (dup == nullptr)) return cudaErrorInvalidValue;
  const bool gated = up != nullptr;
  const bool vectorized = is_aligned_16(dh) && is_aligned_16(gate) && is_aligned_16(up) &&
                          is_aligned_16(dgate) && is_aligned_16(dup) && is_aligned_16(h);
  const auto launch = [&](auto type, auto vec, auto gated_tag, auto act) {
    using T = typename decltype(type)::type;
    constexpr int kVec = decltype(vec)::value;
    act_detail::act_bwd_kernel<T, kVec, decltype(gated_tag)::value, decltype(act)::value>
        <<<grid_blocks(numel, kVec), kBlockThreads, 0, stream>>>(
            static_cast<const T*>(dh), static_cast<const T*>(gate), static_cast<const T*>(up),
            static_cast<T*>(dgate), static_cast<T*>(dup), static_cast<T*>(h), numel);
    return cudaGetLastError();
  };
  return dispatch(kind, vectorized, gated, activation, launch);
}

}  // namespace remat
