// Philox4x32-10 (Salmon et al., SC'11) and remat's dropout stream. Compiles with g++ (host) and
// nvcc (host and device) so the CPU kernels test the arithmetic the GPU uses.
//
// Philox: key = (seed low word, seed high word), counter = (counter low word, counter high word,
// 0, 0); the four output words are those of Triton's tl.randint4x(seed, counter) with a 64-bit
// counter (remat.reference.philox_words).
//
// The dropout stream keyed by (seed, offset) is read in rows of `row_length` elements, four
// elements per Philox call: element (row, col) takes word col % 4 of the call at counter
//   offset + row * ceil(row_length / 4) + col / 4
// (remat.reference.philox_stream_words). Every backend draws one call per four elements of a row
// and uses all four words. Flat dropout of n elements is one row of length n (counter
// offset + i / 4, word i % 4). Attention dropout over the B x Hq x N x M probabilities reads row
// (b * Hq + h) * N + i of length M; packed sequences use the zero-padded batch's grid (N, M =
// max_seqlen_q, max_seqlen_k). An element is kept when the uniform of its word is at least p.
#pragma once

#include <cstdint>

#include "math.h"

namespace remat {

// Elements per Philox call in the dropout stream (the four output words).
constexpr int kPhiloxWords = 4;

struct PhiloxWords {
  uint32_t word[kPhiloxWords];
};

inline REMAT_HOST_DEVICE uint32_t mul_hi_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// The four output words of Philox4x32 with 10 rounds for counter `counter` under key `seed`.
inline REMAT_HOST_DEVICE PhiloxWords philox4(uint64_t seed, uint64_t counter) {
  constexpr uint32_t kKeyA = 0x9E3779B9u, kKeyB = 0xBB67AE85u;
  constexpr uint32_t kRoundA = 0xD2511F53u, kRoundB = 0xCD9E8D57u;
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#elif defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 10
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
  return {{c0, c1, c2, c3}};
}

// Triton's uint_to_uniform_float for 32-bit words: the word read as int32, negative values
// mirrored (~x), times the largest float that keeps INT32_MAX * scale below 1. Result in [0, 1).
inline REMAT_HOST_DEVICE float philox_uniform(uint32_t word) {
  const int32_t x = static_cast<int32_t>(word);
  return static_cast<float>(x ^ (x >> 31)) * 4.6566127342e-10f;  // x >> 31: all ones when x < 0
}

// Dropout keeps the element of stream word `word` when its uniform is at least p (so it is kept
// with probability 1 - p).
inline REMAT_HOST_DEVICE bool dropout_keeps(uint32_t word, float p) { return philox_uniform(word) >= p; }

// The Philox counter of the group of four elements (row, col & ~3 .. col | 3) of the stream.
inline REMAT_HOST_DEVICE uint64_t stream_counter(uint64_t offset, uint64_t row, uint64_t col, uint64_t row_length) {
  return offset + row * ((row_length + kPhiloxWords - 1) / kPhiloxWords) + col / kPhiloxWords;
}

// Host loop over consecutive groups of one row: words[4 * g + w] = word w of the Philox call at
// counter first_counter + g, for g < groups (the stream words of elements 4 * groups from the
// group of first_counter on). Written so that compilers vectorise it across groups; inlined into
// the CPU kernels' AVX2 clones.
inline void philox_stream_block(uint32_t* __restrict__ words, int64_t groups, uint64_t seed, uint64_t first_counter) {
  for (int64_t g = 0; g < groups; ++g) {
    const PhiloxWords call = philox4(seed, first_counter + static_cast<uint64_t>(g));
    for (int w = 0; w < kPhiloxWords; ++w) words[kPhiloxWords * g + w] = call.word[w];
  }
}

}  // namespace remat
