// Philox dropout on the CPU: the stream of common/philox.h (= Triton's tl.rand and the CUDA
// kernel), in fixed chunks over the flat index so the result does not depend on the thread count.
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

constexpr int64_t kChunk = 4096;

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
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t start = chunk * kChunk, count = std::min(kChunk, numel - start);
      widen(src + start * element, values.data(), count, storage);
      for (int64_t i = 0; i < count; ++i) {
        const bool keep = dropout_keep(seed, offset, static_cast<uint64_t>(start + i), p_f);
        values[i] = keep ? values[i] / keep_divisor : 0.0f;
      }
      narrow(values.data(), dst + start * element, count, storage);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CPU, m) { m.impl("philox_dropout", &philox_dropout_cpu); }

}  // namespace remat
