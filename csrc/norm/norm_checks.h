// Argument checks shared by the CPU and CUDA norm operators. The Python layer raises
// ValueError/TypeError for bad input before calling an operator; these checks guard direct
// callers of torch.ops.remat.* and fail with a RuntimeError naming the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace remat {

inline void check_rows_matrix(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, cols], got ", t.dim(), " dims");
  TORCH_CHECK(t.sizes() == like.sizes(), name, " must have shape ", like.sizes(), ", got ",
              t.sizes());
  TORCH_CHECK(t.numel() == 0 || t.size(1) <= 1 || t.stride(1) == 1, name, " must have unit column stride");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ",
              like.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device());
}

inline void check_norm_vector(const c10::optional<at::Tensor>& t, const char* name,
                              const at::Tensor& like) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == like.size(1), name, " must have shape [",
              like.size(1), "], got ", t->sizes());
  TORCH_CHECK(t->scalar_type() == like.scalar_type(), name, " must have dtype ",
              like.scalar_type(), ", got ", t->scalar_type());
  TORCH_CHECK(t->device() == like.device(), name, " must be on ", like.device());
}

inline void check_stats(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == like.size(0) && t.is_contiguous(), name,
              " must be a contiguous [", like.size(0), "] tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device());
}

inline void check_norm_fwd_args(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& residual, double eps) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, cols], got ", x.dim(), " dims");
  TORCH_CHECK(x.numel() == 0 || x.size(1) <= 1 || x.stride(1) == 1, "x must have unit column stride");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be float32, float16 or bfloat16");
  TORCH_CHECK(x.size(1) >= 1, "x must have at least one column");
  TORCH_CHECK(eps > 0, "eps must be positive, got ", eps);
  check_norm_vector(weight, "weight", x);
  check_norm_vector(bias, "bias", x);
  if (residual.has_value()) check_rows_matrix(*residual, "residual", x);
}

inline void check_norm_bwd_args(const at::Tensor& dy, const c10::optional<at::Tensor>& dh,
                                const at::Tensor& h, const c10::optional<at::Tensor>& weight,
                                const at::Tensor& rstd) {
  TORCH_CHECK(h.dim() == 2, "h must be 2-D [rows, cols], got ", h.dim(), " dims");
  TORCH_CHECK(h.numel() == 0 || h.size(1) <= 1 || h.stride(1) == 1, "h must have unit column stride");
  TORCH_CHECK(h.size(1) >= 1, "h must have at least one column");
  check_rows_matrix(dy, "dy", h);
  if (dh.has_value()) check_rows_matrix(*dh, "dh", h);
  check_norm_vector(weight, "weight", h);
  check_stats(rstd, "rstd", h);
}

}  // namespace remat
