// ATen glue of the CUDA linear + cross-entropy: checks, the chunk loop with cuBLAS GEMMs
// (cross_entropy_glue.h) and the launches of this block's epilogue kernels (cross_entropy.cu) on
// the current stream.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "common/aten_glue.h"
#include "cross_entropy/cross_entropy.h"
#include "cross_entropy/cross_entropy_glue.h"

namespace remat {
namespace {

// The chunk grid is one block per row (gridDim.x < 2^31).
void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got one on ", x.device());
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31), "at most 2^31 - 1 tokens, got ", x.size(0));
}

LceChunk chunk_of(const at::Tensor& logits, int64_t start, const at::Tensor& target, int64_t ignore_index,
                  const LceCoefficients& c) {
  return {logits.data_ptr(), logits.size(0), logits.size(1), start, target.const_data_ptr<int64_t>(), ignore_index,
          c};
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_fwd_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                                 const c10::optional<at::Tensor>& bias,
                                                                 const at::Tensor& target, int64_t ignore_index,
                                                                 double label_smoothing, double softcap,
                                                                 double z_loss, int64_t chunk) {
  check_lce_args(x, weight, bias, target, chunk);
  check_rows(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const ScalarKind kind = scalar_kind_of(x.scalar_type(), "remat's cross-entropy kernels");
  const int64_t tokens = x.size(0);
  const LceCoefficients c = lce_coefficients(label_smoothing, weight.size(0), z_loss, softcap);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor row_max = at::full({tokens}, -std::numeric_limits<float>::infinity(), f32);
  at::Tensor sum_exp = at::zeros({tokens}, f32), sum_z = at::zeros({tokens}, f32), z_target = at::zeros({tokens}, f32);
  const at::Tensor target_c = target.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for_each_logits_chunk(x, weight, bias, chunk, [&](const at::Tensor& logits, int64_t start) {
    C10_CUDA_CHECK(lce_fwd_chunk_cuda(chunk_of(logits, start, target_c, ignore_index, c), row_max.data_ptr<float>(),
                                      sum_exp.data_ptr<float>(), sum_z.data_ptr<float>(), z_target.data_ptr<float>(),
                                      kind, stream));
  });
  at::Tensor loss = at::empty({tokens}, f32), lse = at::empty({tokens}, f32);
  C10_CUDA_CHECK(lce_fwd_finalize_cuda(tokens, target_c.const_data_ptr<int64_t>(), ignore_index, c,
                                       row_max.const_data_ptr<float>(), sum_exp.const_data_ptr<float>(),
                                       sum_z.const_data_ptr<float>(), z_target.const_data_ptr<float>(),
                                       loss.data_ptr<float>(), lse.data_ptr<float>(), stream));
  return {loss, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cuda(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& target,
    const at::Tensor& lse, const at::Tensor& grad_loss, const c10::optional<at::Tensor>& grad_lse,
    int64_t ignore_index, double label_smoothing, double softcap, double z_loss, int64_t chunk, bool need_dx,
    bool need_dw, bool need_db) {
  check_lce_args(x, weight, bias, target, chunk);
  check_lce_row_vector(lse, "lse", x);
  check_lce_row_vector(grad_loss, "grad_loss", x);
  if (grad_lse.has_value()) check_lce_row_vector(*grad_lse, "grad_lse", x);
  check_rows(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const ScalarKind kind = scalar_kind_of(x.scalar_type(), "remat's cross-entropy kernels");
  const LceCoefficients c = lce_coefficients(label_smoothing, weight.size(0), z_loss, softcap);
  const at::Tensor target_c = target.contiguous(), lse_c = lse.contiguous(), grad_c = grad_loss.contiguous();
  const at::Tensor grad_lse_c = grad_lse.has_value() ? grad_lse->contiguous() : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LceGradients grads(x, weight, bias, need_dx, need_dw, need_db, chunk);
  for_each_logits_chunk(x, weight, bias, chunk, [&](const at::Tensor& logits, int64_t start) {
    C10_CUDA_CHECK(lce_bwd_chunk_cuda(chunk_of(logits, start, target_c, ignore_index, c), lse_c.const_data_ptr<float>(),
                                      grad_c.const_data_ptr<float>(),
                                      grad_lse_c.defined() ? grad_lse_c.const_data_ptr<float>() : nullptr, kind,
                                      stream));
    grads.add_chunk(logits, x, weight, start);
  });
  return grads.finish(x);
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CUDA, m) {
  m.impl("linear_cross_entropy_fwd", &linear_cross_entropy_fwd_cuda);
  m.impl("linear_cross_entropy_bwd", &linear_cross_entropy_bwd_cuda);
}

}  // namespace remat
