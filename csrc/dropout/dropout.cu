// Philox dropout on the GPU: one thread per group of four consecutive elements in a grid-stride
// loop, drawing the group's four keep decisions from one Philox call (all four words: the stream
// of common/philox.h, of the Triton kernel and of the CPU kernel), so the mask is never stored.
// Where x and y are aligned to a group (4 elements), full groups move as one 8-byte (fp16/bf16)
// or 16-byte (fp32) access.
#include "dropout/dropout.h"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/pack.cuh"
#include "common/philox.h"

namespace remat {
namespace {

constexpr int kThreads = 256;
// Past 65536 blocks the threads loop: more threads than any GPU holds at once.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

template <typename T, bool kPacked>
__global__ void philox_dropout_kernel(const T* __restrict__ x, T* __restrict__ y, const int64_t* __restrict__ rng,
                                      int64_t numel, float p, float keep_divisor) {
  const uint64_t seed = static_cast<uint64_t>(rng[0]), offset = static_cast<uint64_t>(rng[1]);
  const int64_t groups = (numel + kPhiloxWords - 1) / kPhiloxWords;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Flat dropout is one row of numel elements: group g is the call at counter offset + g.
    const PhiloxWords words = philox4(seed, offset + static_cast<uint64_t>(g));
    const int64_t first = g * kPhiloxWords;
    if (kPacked && first + kPhiloxWords <= numel) {
      const Pack<T, kPhiloxWords> in = *reinterpret_cast<const Pack<T, kPhiloxWords>*>(x + first);
      Pack<T, kPhiloxWords> out;
#pragma unroll
      for (int w = 0; w < kPhiloxWords; ++w) {
        out.v[w] = from_float<T>(dropout_keeps(words.word[w], p) ? to_float(in.v[w]) / keep_divisor : 0.0f);
      }
      *reinterpret_cast<Pack<T, kPhiloxWords>*>(y + first) = out;
    } else {
#pragma unroll
      for (int w = 0; w < kPhiloxWords; ++w) {
        const int64_t i = first + w;
        if (i < numel) y[i] = from_float<T>(dropout_keeps(words.word[w], p) ? to_float(x[i]) / keep_divisor : 0.0f);
      }
    }
  }
}

template <typename T>
cudaError_t launch(const void* x, void* y, const int64_t* rng, int64_t numel, float p, float keep_divisor,
                   cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const int64_t groups = (numel + kPhiloxWords - 1) / kPhiloxWords;
  const unsigned blocks = static_cast<unsigned>(std::min((groups + kThreads - 1) / kThreads, kMaxBlocks));
  constexpr uintptr_t kGroupBytes = kPhiloxWords * sizeof(T);
  const bool packed =
      reinterpret_cast<uintptr_t>(x) % kGroupBytes == 0 && reinterpret_cast<uintptr_t>(y) % kGroupBytes == 0;
  if (packed) {
    philox_dropout_kernel<T, true><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), rng,
                                                                     numel, p, keep_divisor);
  } else {
    philox_dropout_kernel<T, false><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), rng,
                                                                      numel, p, keep_divisor);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t philox_dropout_cuda(const void* x, void* y, const int64_t* rng, int64_t numel, float p,
                                float keep_divisor, ScalarKind kind, cudaStream_t stream) {
  switch (kind) {
    case ScalarKind::kFloat32: return launch<float>(x, y, rng, numel, p, keep_divisor, stream);
    case ScalarKind::kFloat16: return launch<__half>(x, y, rng, numel, p, keep_divisor, stream);
    case ScalarKind::kBFloat16: return launch<__nv_bfloat16>(x, y, rng, numel, p, keep_divisor, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace remat
