// Argument checks shared by the CPU and CUDA Philox dropout operators.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace remat {

inline void check_philox_dropout_args(const at::Tensor& x, const at::Tensor& rng, double p) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(rng.dim() == 1 && rng.size(0) == 2 && rng.scalar_type() == at::kLong && rng.is_contiguous(),
              "rng must be a contiguous int64 tensor [2] = (seed, offset)");
  TORCH_CHECK(rng.device() == x.device(), "rng must be on ", x.device());
  TORCH_CHECK(p >= 0 && p < 1, "p must be in [0, 1), got ", p);
}

}  // namespace remat
