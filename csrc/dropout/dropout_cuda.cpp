// ATen glue of the CUDA Philox dropout kernel: checks, allocation, the current stream.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/aten_glue.h"
#include "dropout/dropout.h"
#include "dropout/dropout_checks.h"

namespace remat {
namespace {

at::Tensor philox_dropout_cuda_op(const at::Tensor& x, const at::Tensor& rng, double p) {
  check_philox_dropout_args(x, rng, p);
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got one on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options());
  C10_CUDA_CHECK(philox_dropout_cuda(x.const_data_ptr(), y.data_ptr(), rng.const_data_ptr<int64_t>(), x.numel(),
                                     static_cast<float>(p), static_cast<float>(1.0 - p), scalar_kind_of(x.scalar_type(), "remat's dropout kernel"),
                                     c10::cuda::getCurrentCUDAStream()));
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CUDA, m) { m.impl("philox_dropout", &philox_dropout_cuda_op); }

}  // namespace remat
