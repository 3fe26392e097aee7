// Element conversions and 16-byte packs shared by the CUDA kernels. The functions are
// __host__ __device__ so that host programs can run kernel bodies over host arrays in tests.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/math.h"

// `#pragma unroll` in __host__ __device__ functions: the host compiler does not know it.
#if defined(__CUDA_ARCH__)
#define REMAT_UNROLL _Pragma("unroll")
#else
#define REMAT_UNROLL
#endif

namespace remat {

// N elements of T moved as one access: 16 bytes (LDG.128 / STG.128) when N = 16 / sizeof(T).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

inline REMAT_HOST_DEVICE float to_float(float v) { return v; }
inline REMAT_HOST_DEVICE float to_float(__half v) { return __half2float(v); }
inline REMAT_HOST_DEVICE float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even, the rounding torch uses for the same casts (the host versions of the
// cuda_fp16 / cuda_bf16 casts round the same way).
template <typename T>
inline REMAT_HOST_DEVICE T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "T must be float, __half or __nv_bfloat16");
    return __float2bfloat16_rn(v);
  }
}

// Stores a pack. On the device a 16-byte pack goes out as one st.global.v4: a plain struct store
// is split by the compiler into 2- and 4-byte stores at some call sites (seen in the sm_90 SASS).
template <typename T, int N>
inline REMAT_HOST_DEVICE void write_pack(T* ptr, const Pack<T, N>& pack) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(Pack<T, N>) == 16) {
    uint32_t words[4];
    __builtin_memcpy(words, &pack, 16);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(words[0]), "r"(words[1]),
                 "r"(words[2]), "r"(words[3])
                 : "memory");
  } else {
    *reinterpret_cast<Pack<T, N>*>(ptr) = pack;
  }
#else
  __builtin_memcpy(static_cast<void*>(ptr), &pack, sizeof(pack));
#endif
}

}  // namespace remat
