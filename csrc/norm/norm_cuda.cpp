// ATen glue of the CUDA norm kernels: argument checks, output allocation, the current stream and
// the deterministic sum of the weight-gradient partials. The kernels themselves (norm.cu) see
// only raw pointers and sizes, so they compile with nvcc without the torch headers.
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/aten_glue.h"
#include "norm/norm.h"
#include "norm/norm_checks.h"

namespace remat {
namespace {

ScalarKind scalar_kind(at::ScalarType type) { return scalar_kind_of(type, "remat's norm kernels"); }

int sm_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd_cuda_op(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, double eps, bool is_rms) {
  check_norm_fwd_args(x, weight, bias, residual, eps);
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  // Weight and bias are read with unit stride.
  const auto w = weight ? c10::optional<at::Tensor>(weight->contiguous()) : c10::nullopt;
  const auto b = bias ? c10::optional<at::Tensor>(bias->contiguous()) : c10::nullopt;
  at::Tensor y = at::empty({rows, cols}, x.options());
  at::Tensor h = residual ? at::empty({rows, cols}, x.options()) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({is_rms ? 0 : rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return {y, h, mean, rstd};
  NormFwdParams params{};
  params.x = x.const_data_ptr();
  params.residual = optional_ptr(residual);
  params.weight = optional_ptr(w);
  params.bias = optional_ptr(b);
  params.y = y.data_ptr();
  params.h = residual ? h.data_ptr() : nullptr;
  params.mean = is_rms ? nullptr : mean.data_ptr<float>();
  params.rstd = rstd.data_ptr<float>();
  params.rows = rows;
  params.cols = cols;
  params.x_row_stride = x.stride(0);
  params.residual_row_stride = residual ? residual->stride(0) : 0;
  params.eps = static_cast<float>(eps);
  params.is_rms = is_rms;
  C10_CUDA_CHECK(norm_fwd_cuda(params, scalar_kind(x.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd_cuda_op(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& mean,
    const at::Tensor& rstd, bool has_bias, bool is_rms) {
  check_norm_bwd_args(dy, dh, h, weight, rstd);
  if (!is_rms) check_stats(*mean, "mean", h);
  TORCH_CHECK(h.is_cuda(), "h must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t rows = h.size(0), cols = h.size(1);
  const auto w = weight ? c10::optional<at::Tensor>(weight->contiguous()) : c10::nullopt;
  at::Tensor dx = at::empty({rows, cols}, h.options());
  if (rows == 0 || cols == 0) {
    return {dx, at::zeros({weight ? cols : 0}, h.options()), at::zeros({has_bias ? cols : 0}, h.options())};
  }
  const int partials = norm_bwd_num_partials(rows, cols, sm_count(h.get_device()));
  const auto f32 = h.options().dtype(at::kFloat);
  at::Tensor dw_partial = at::empty({weight ? partials : 0, cols}, f32);
  at::Tensor db_partial = at::empty({has_bias ? partials : 0, cols}, f32);
  NormBwdParams params{};
  params.dy = dy.const_data_ptr();
  params.dh = optional_ptr(dh);
  params.h = h.const_data_ptr();
  params.weight = optional_ptr(w);
  params.mean = is_rms ? nullptr : mean->const_data_ptr<float>();
  params.rstd = rstd.const_data_ptr<float>();
  params.dx = dx.data_ptr();
  params.dw_partial = weight ? dw_partial.data_ptr<float>() : nullptr;
  params.db_partial = has_bias ? db_partial.data_ptr<float>() : nullptr;
  params.rows = rows;
  params.cols = cols;
  params.dy_row_stride = dy.stride(0);
  params.dh_row_stride = dh ? dh->stride(0) : 0;
  params.h_row_stride = h.stride(0);
  params.num_partials = partials;
  params.is_rms = is_rms;
  C10_CUDA_CHECK(norm_bwd_cuda(params, scalar_kind(h.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  // A column reduction over the partials: deterministic (no atomics) for a given shape and device.
  at::Tensor dw = weight ? dw_partial.sum(0).to(h.scalar_type()) : at::empty({0}, h.options());
  at::Tensor db = has_bias ? db_partial.sum(0).to(h.scalar_type()) : at::empty({0}, h.options());
  return {dx, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& residual, double eps) {
  auto [y, h, mean, rstd] = norm_fwd_cuda_op(x, weight, c10::nullopt, residual, eps, /*is_rms=*/true);
  return {y, h, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, double eps) {
  return norm_fwd_cuda_op(x, weight, bias, residual, eps, /*is_rms=*/false);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& dy, const c10::optional<at::Tensor>& dh,
                                                     const at::Tensor& h, const c10::optional<at::Tensor>& weight,
                                                     const at::Tensor& rstd) {
  auto [dx, dw, db] = norm_bwd_cuda_op(dy, dh, h, weight, c10::nullopt, rstd, false, /*is_rms=*/true);
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const c10::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd, bool has_bias) {
  return norm_bwd_cuda_op(dy, dh, h, weight, mean, rstd, has_bias, /*is_rms=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
}

}  // namespace remat
