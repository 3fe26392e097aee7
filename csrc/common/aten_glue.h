// ATen-side glue shared by the .cpp files that launch the CUDA kernels (compiled by g++ against
// the torch headers; the .cu files never include this): the one mapping from an ATen dtype to the
// kernels' ScalarKind, and the raw pointer of an optional tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include "common/scalar_kind.h"

namespace remat {

// Which element types a family of kernels takes.
enum class KernelDtypes { kFloatingPoint, kHalfOnly };

// The kernels' element type for `type`; any other dtype raises, naming the kernels (`what`).
// kHalfOnly kernels (tensor-core attention) take float16 and bfloat16 only.
inline ScalarKind scalar_kind_of(at::ScalarType type, const char* what,
                                 KernelDtypes accepted = KernelDtypes::kFloatingPoint) {
  switch (type) {
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kFloat:
      if (accepted == KernelDtypes::kFloatingPoint) return ScalarKind::kFloat32;
      TORCH_CHECK(false, what, " take float16 or bfloat16 (tensor cores), got ", type,
                  "; for float32 use backend='triton' or 'torch'");
    default:
      TORCH_CHECK(false, what, " take ",
                  accepted == KernelDtypes::kFloatingPoint ? "float32, float16 or bfloat16" : "float16 or bfloat16",
                  ", got ", type);
  }
}

// The data pointer of an optional tensor, or nullptr.
inline const void* optional_ptr(const c10::optional<at::Tensor>& t) { return t ? t->const_data_ptr() : nullptr; }

}  // namespace remat
