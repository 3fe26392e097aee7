// Philox4x32-10 (Salmon et al., SC'11), written to produce the same stream as Triton's
// tl.randint / tl.rand with a 64-bit offset: key = (seed low word, seed high word), counter =
// (offset low word, offset high word, 0, 0), output = the first word of the result. Compiles with
// g++ (host) and nvcc (host and device) so the CPU kernels test the arithmetic the GPU uses.
#pragma once

#include <cstdint>

#include "math.h"

namespace remat {

inline REMAT_HOST_DEVICE uint32_t mul_hi_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// First output word of Philox4x32 with 10 rounds for counter `counter` under key `seed`.
inline REMAT_HOST_DEVICE uint32_t philox_randint(uint64_t seed, uint64_t counter) {
  constexpr uint32_t kKeyA = 0x9E3779B9u, kKeyB = 0xBB67AE85u;
  constexpr uint32_t kRoundA = 0xD2511F53u, kRoundB = 0xCD9E8D57u;
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t prev_c0 = c0, prev_c2 = c2;
    c0 = mul_hi_u32(kRoundB, prev_c2) ^ c1 ^ k0;
    c2 = mul_hi_u32(kRoundA, prev_c0) ^ c3 ^ k1;
    c1 = kRoundB * prev_c2;
    c3 = kRoundA * prev_c0;
    k0 += kKeyA;
    k1 += kKeyB;
  }
  return c0;
}

// Triton's uint_to_uniform_float for 32-bit words: the word read as int32, negative values
// mirrored (~x), times the largest float that keeps INT32_MAX * scale below 1. Result in [0, 1).
inline REMAT_HOST_DEVICE float philox_uniform(uint32_t word) {
  int32_t x = static_cast<int32_t>(word);
  if (x < 0) x = ~x;
  return static_cast<float>(x) * 4.6566127342e-10f;
}

// Dropout keeps element `index` of a stream keyed by (seed, offset) when its uniform draw is at
// least p (so it is kept with probability 1 - p). Attention numbers element (b, h, i, j) of the
// B x Hq x N x M probability tensor as ((b * Hq + h) * N + i) * M + j.
inline REMAT_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t index, float p) {
  return philox_uniform(philox_randint(seed, offset + index)) >= p;
}

}  // namespace remat
