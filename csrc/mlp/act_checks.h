// Argument parsing and checks shared by the CPU and CUDA MLP activation operators (glu_fwd,
// glu_bwd, act_fwd, act_bwd). The Python layer validates its input first; these checks guard
// direct callers of torch.ops.remat.* and fail with a RuntimeError naming the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include "common/activation.h"

namespace remat {

// The `activation` argument of the operators: "silu", "gelu" (erf form) or "gelu_tanh". All three
// are accepted both gated (glu_*) and plain (act_*).
inline Activation parse_activation(c10::string_view activation) {
  if (activation == "silu") return Activation::kSilu;
  if (activation == "gelu") return Activation::kGelu;
  if (activation == "gelu_tanh") return Activation::kGeluTanh;
  TORCH_CHECK(false, "activation must be one of 'silu', 'gelu', 'gelu_tanh', got '", activation, "'");
}

// `other` must match `ref` element for element: same shape, dtype and device, and both contiguous
// (the kernels walk flat arrays; the operators require contiguity rather than copying). The dtype
// must be float32, float16 or bfloat16. Checking ref against itself validates ref alone.
inline void check_same_layout(const at::Tensor& ref, const at::Tensor& other, const char* ref_name,
                              const char* other_name) {
  const auto dtype = ref.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, ref_name,
              " must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(ref.is_contiguous(), ref_name, " must be contiguous");
  TORCH_CHECK(other.sizes() == ref.sizes(), other_name, " must have the shape of ", ref_name, " ",
              ref.sizes(), ", got ", other.sizes());
  TORCH_CHECK(other.scalar_type() == dtype, other_name, " must have the dtype of ", ref_name, " (",
              dtype, "), got ", other.scalar_type());
  TORCH_CHECK(other.device() == ref.device(), other_name, " must be on the device of ", ref_name, " (",
              ref.device(), "), got ", other.device());
  TORCH_CHECK(other.is_contiguous(), other_name, " must be contiguous");
}

}  // namespace remat
