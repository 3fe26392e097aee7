// Conversions between the storage types (fp32, fp16, bf16) and fp32 working buffers, for the C++
// CPU kernels: data is widened to fp32 arrays, processed by plain loops, and narrowed back with
// one round-to-nearest-even, exactly as c10::Half / c10::BFloat16 round.
//
// The loops are compiled twice (REMAT_CPU_CLONES: target_clones x86-64-v3, i.e. AVX2+FMA+F16C,
// and baseline x86-64, chosen at load time), so they vectorise on current CPUs and still run on
// old ones. Everything here has internal linkage (an unnamed namespace): each kernel file gets its
// own copy, which keeps target_clones away from inline/COMDAT functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <bit>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define REMAT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define REMAT_CPU_CLONES
#endif

namespace remat {
namespace {

enum class Storage { kFloat32, kFloat16, kBFloat16 };

Storage storage_of(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return Storage::kFloat32;
    case at::kHalf: return Storage::kFloat16;
    case at::kBFloat16: return Storage::kBFloat16;
    default: TORCH_CHECK(false, "remat CPU kernels take float32, float16 or bfloat16, got ", type);
  }
}

// dst[i] = float(src[i]).
REMAT_CPU_CLONES void widen(const void* src, float* dst, int64_t n, Storage storage) {
  if (storage == Storage::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (storage == Storage::kFloat16) {
    const _Float16* s = static_cast<const _Float16*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(s[i]) << 16);
  }
}

uint16_t round_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  bits = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : bits + 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__)
// The bf16 rounding with AVX2 (the compiler does not vectorise the 32->16-bit narrowing well):
// round the bit pattern to nearest even, canonical NaN, pack 16 values per iteration.
__attribute__((target("avx2"))) void narrow_bf16_avx2(const float* src, uint16_t* dst, int64_t n) {
  const __m256i half_ulp = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  const __m256i quiet_nan = _mm256_set1_epi32(0x7FC00000);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i halves[2];
    for (int half = 0; half < 2; ++half) {
      const __m256 v = _mm256_loadu_ps(src + i + 8 * half);
      const __m256i bits = _mm256_castps_si256(v);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
      __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(half_ulp, lsb));
      rounded = _mm256_blendv_epi8(rounded, quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
      halves[half] = _mm256_srli_epi32(rounded, 16);
    }
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves[0], halves[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  for (; i < n; ++i) dst[i] = round_to_bf16(src[i]);
}

const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
#endif

// dst[i] = src[i] rounded to nearest even in the storage type, as c10::Half / c10::BFloat16 do
// (NaN becomes the canonical bf16 NaN 0x7FC0).
REMAT_CPU_CLONES void narrow(const float* src, void* dst, int64_t n, Storage storage) {
  if (storage == Storage::kFloat32) {
    if (src != dst) std::memcpy(dst, src, n * sizeof(float));
  } else if (storage == Storage::kFloat16) {
    _Float16* d = static_cast<_Float16*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<_Float16>(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
#if defined(__x86_64__) && defined(__GNUC__)
    if (kHaveAvx2) return narrow_bf16_avx2(src, d, n);
#endif
    for (int64_t i = 0; i < n; ++i) d[i] = round_to_bf16(src[i]);
  }
}

// The data as fp32: src itself for fp32 storage, else widened into buffer.
[[maybe_unused]] const float* as_float(const void* src, float* buffer, int64_t n, Storage storage) {
  if (storage == Storage::kFloat32) return static_cast<const float*>(src);
  widen(src, buffer, n, storage);
  return buffer;
}

// Where an fp32 result goes: straight into the output for fp32 storage, else a buffer that
// narrow() then rounds into the output.
[[maybe_unused]] float* float_target(void* dst, float* buffer, Storage storage) {
  return storage == Storage::kFloat32 ? static_cast<float*>(dst) : buffer;
}

}  // namespace
}  // namespace remat
