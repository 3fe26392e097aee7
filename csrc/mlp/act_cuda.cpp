// ATen glue of the CUDA MLP activation kernels: argument checks, output allocation, the current
// stream. The kernels themselves (act.cu) see only raw pointers and sizes, so they compile with
// nvcc without the torch headers.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/aten_glue.h"
#include "mlp/act.h"
#include "mlp/act_checks.h"

namespace remat {
namespace {

ScalarKind scalar_kind(at::ScalarType type) { return scalar_kind_of(type, "remat's activation kernels"); }

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

// h when the caller asked for it, else an empty tensor (the schema's "h is empty").
at::Tensor optional_output(bool wanted, const at::Tensor& like) {
  return wanted ? at::empty(like.sizes(), like.options()) : at::empty({0}, like.options());
}

at::Tensor glu_fwd_cuda(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  check_same_layout(gate, up, "gate", "up");
  check_cuda(gate, "gate");
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor h = at::empty(gate.sizes(), gate.options());
  C10_CUDA_CHECK(act_fwd_cuda(gate.const_data_ptr(), up.const_data_ptr(), h.data_ptr(), gate.numel(), act,
                              scalar_kind(gate.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return h;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> glu_bwd_cuda(const at::Tensor& dh, const at::Tensor& gate,
                                                            const at::Tensor& up, c10::string_view activation,
                                                            bool need_h) {
  const Activation act = parse_activation(activation);
  check_same_layout(gate, up, "gate", "up");
  check_same_layout(gate, dh, "gate", "dh");
  check_cuda(gate, "gate");
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor dgate = at::empty(gate.sizes(), gate.options());
  at::Tensor dup = at::empty(gate.sizes(), gate.options());
  at::Tensor h = optional_output(need_h, gate);
  C10_CUDA_CHECK(act_bwd_cuda(dh.const_data_ptr(), gate.const_data_ptr(), up.const_data_ptr(), dgate.data_ptr(),
                              dup.data_ptr(), need_h ? h.data_ptr() : nullptr, gate.numel(), act,
                              scalar_kind(gate.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return {dgate, dup, h};
}

at::Tensor act_fwd_cuda_op(const at::Tensor& pre, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  check_same_layout(pre, pre, "pre", "pre");
  check_cuda(pre, "pre");
  const c10::cuda::CUDAGuard guard(pre.device());
  at::Tensor h = at::empty(pre.sizes(), pre.options());
  C10_CUDA_CHECK(act_fwd_cuda(pre.const_data_ptr(), nullptr, h.data_ptr(), pre.numel(), act,
                              scalar_kind(pre.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return h;
}

std::tuple<at::Tensor, at::Tensor> act_bwd_cuda_op(const at::Tensor& dh, const at::Tensor& pre,
                                                   c10::string_view activation, bool need_h) {
  const Activation act = parse_activation(activation);
  check_same_layout(pre, dh, "pre", "dh");
  check_cuda(pre, "pre");
  const c10::cuda::CUDAGuard guard(pre.device());
  at::Tensor dpre = at::empty(pre.sizes(), pre.options());
  at::Tensor h = optional_output(need_h, pre);
  C10_CUDA_CHECK(act_bwd_cuda(dh.const_data_ptr(), pre.const_data_ptr(), nullptr, dpre.data_ptr(), nullptr,
                              need_h ? h.data_ptr() : nullptr, pre.numel(), act, scalar_kind(pre.scalar_type()),
                              c10::cuda::getCurrentCUDAStream()));
  return {dpre, h};
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CUDA, m) {
  m.impl("glu_fwd", &glu_fwd_cuda);
  m.impl("glu_bwd", &glu_bwd_cuda);
  m.impl("act_fwd", &act_fwd_cuda_op);
  m.impl("act_bwd", &act_bwd_cuda_op);
}

}  // namespace remat
