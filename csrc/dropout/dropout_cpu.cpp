// Philox dropout on the CPU: the stream of common/philox.h (one Philox call per four consecutive
// elements, all four words; = Triton's kernel and the CUDA kernel), in fixed chunks over the flat
// index so the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/cpu_convert.h"
#include "common/philox.h"
#include "dropout/dropout_checks.h"

namespace remat {
namespace {

// A multiple of four, so every chunk starts at a group of four and draws whole Philox calls.
constexpr int64_t kChunk = 4096;
static_assert(kChunk % kPhiloxWords == 0, "chunks must hold whole Philox groups");

// values[i] = keep(words[i]) ? values[i] / keep_divisor : 0 for i < count. The division runs on
// every element first: a division under the condition is not if-converted (it may trap), which
// would keep the loop scalar; this way both loops vectorise.
REMAT_CPU_CLONES void apply_dropout(float* __restrict__ values, const uint32_t* __restrict__ words, int64_t count,
                                    float p, float keep_divisor) {
  for (int64_t i = 0; i < count; ++i) values[i] /= keep_divisor;
  for (int64_t i = 0; i < count; ++i) values[i] = dropout_keeps(words[i], p) ? values[i] : 0.0f;
}

// The stream words of `count` elements from the group of `first_counter` on (one Philox call per
// four elements; the last call's unused words land in the padding of `words`).
REMAT_CPU_CLONES void stream_words(uint32_t* __restrict__ words, int64_t count, uint64_t seed,
                                   uint64_t first_counter) {
  philox_stream_block(words, (count + kPhiloxWords - 1) / kPhiloxWords, seed, first_counter);
}

at::Tensor philox_dropout_cpu(const at::Tensor& x, const at::Tensor& rng, double p) {
  check_philox_dropout_args(x, rng, p);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t* state = rng.const_data_ptr<int64_t>();
  const uint64_t seed = static_cast<uint64_t>(state[0]), offset = static_cast<uint64_t>(state[1]);
  const float p_f = static_cast<float>(p), keep_divisor = static_cast<float>(1.0 - p);
  const Storage storage = storage_of(x.scalar_type());
  const int64_t numel = x.numel(), element = x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(y.data_ptr());
  at::parallel_for(0, (numel + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values(kChunk);
    std::vector<uint32_t> words(kChunk);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t start = chunk * kChunk, count = std::min(kChunk, numel - start);
      widen(src + start * element, values.data(), count, storage);
      // Flat dropout is one row of numel elements: element i takes word i % 4 of counter offset + i / 4.
      stream_words(words.data(), count, seed, stream_counter(offset, 0, static_cast<uint64_t>(start), numel));
      apply_dropout(values.data(), words.data(), count, p_f, keep_divisor);
      narrow(values.data(), dst + start * element, count, storage);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CPU, m) { m.impl("philox_dropout", &philox_dropout_cpu); }

}  // namespace remat
