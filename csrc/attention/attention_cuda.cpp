// ATen glue of the CUDA flash-attention kernels: argument checks, output and workspace
// allocation, the current stream. The kernels themselves (attention.cu) see only raw pointers,
// strides and sizes, so they compile with nvcc without the torch headers.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "attention/attention.h"
#include "attention/attention_checks.h"
#include "common/aten_glue.h"

namespace remat {
namespace {

ScalarKind attention_kind(at::ScalarType type) {
  return scalar_kind_of(type, "the CUDA attention kernels", KernelDtypes::kHalfOnly);
}

int device_attribute(cudaDeviceAttr attribute, int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

// Checks that only the CUDA kernels impose, after the shared checks of attention_checks.h.
// (q, k, v, and the other tensors share q's device and dtype by then.)
void check_cuda_attention(const at::Tensor& q) {
  TORCH_CHECK(q.is_cuda(), "q, k and v must be CUDA tensors for the CUDA attention kernels, got q on ", q.device());
  attention_kind(q.scalar_type());  // fp16 / bf16 only
  const int device = q.get_device();
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
  const int minor = device_attribute(cudaDevAttrComputeCapabilityMinor, device);
  TORCH_CHECK(major >= 8, "the CUDA attention kernels need compute capability 8.0 or newer (bf16/fp16 tensor cores, "
              "cp.async), this GPU is sm_", major, minor, "; use backend='triton' or 'torch'");
  TORCH_CHECK(q.size(0) <= kAttentionCudaMaxGridYZ, "the CUDA attention kernels take at most ",
              kAttentionCudaMaxGridYZ, " batch entries, got ", q.size(0), "; split the batch");
  TORCH_CHECK(q.size(2) <= kAttentionCudaMaxGridYZ, "the CUDA attention kernels take at most ",
              kAttentionCudaMaxGridYZ, " query heads, got ", q.size(2));
  TORCH_CHECK(q.size(3) <= kAttentionCudaMaxHeadDim, "the CUDA attention kernels take head dims up to ",
              kAttentionCudaMaxHeadDim, ", got ", q.size(3), "; use backend='triton' or 'torch'");
  const size_t needed = attention_cuda_smem_bytes(q.size(3));
  const int allowed = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  TORCH_CHECK(needed <= static_cast<size_t>(allowed), "the CUDA attention kernels need ", needed,
              " bytes of shared memory per block at head dim ", q.size(3), ", this GPU allows ", allowed,
              "; use backend='triton' or 'torch'");
}


// Rope tables: pointers and the batch stride (0 when the tables broadcast over the batch).
struct RopeArgs {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t batch_stride = 0;
};

RopeArgs rope_args(const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
  RopeArgs rope;
  if (!cos.has_value()) return rope;
  rope.cos = cos->const_data_ptr<float>();  // contiguous fp32, checked by check_attention_options
  rope.sin = sin->const_data_ptr<float>();
  rope.batch_stride = cos->size(0) == 1 ? 0 : cos->size(1) * cos->size(2);
  return rope;
}

// The fields the forward and backward parameter structs share: sizes, q/k/v strides, rope, the
// mask window, scale, softcap and dropout.
template <typename Params>
void set_shared_params(Params& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const RopeArgs& rope, const c10::optional<at::Tensor>& rng, int64_t window_left,
                       int64_t window_right, double scale, double softcap, double dropout_p) {
  p.cos = rope.cos;
  p.sin = rope.sin;
  p.rng = static_cast<const int64_t*>(optional_ptr(rng));
  p.batch = q.size(0);
  p.n = q.size(1);
  p.m = k.size(1);
  p.hq = q.size(2);
  p.hkv = k.size(2);
  p.head_dim = q.size(3);
  p.q_batch_stride = q.stride(0);
  p.q_row_stride = q.stride(1);
  p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0);
  p.k_row_stride = k.stride(1);
  p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0);
  p.v_row_stride = v.stride(1);
  p.v_head_stride = v.stride(2);
  p.rope_batch_stride = rope.batch_stride;
  p.window_left = window_left;
  p.window_right = window_right;
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.dropout_p = static_cast<float>(dropout_p);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda_op(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const c10::optional<at::Tensor>& cos,
                                                         const c10::optional<at::Tensor>& sin,
                                                         const c10::optional<at::Tensor>& rng, double scale,
                                                         double softcap, int64_t window_left, int64_t window_right,
                                                         double dropout_p) {
  check_attention_qkv(q, k, v);
  check_attention_options(q, k, cos, sin, rng, scale, softcap, dropout_p);
  check_cuda_attention(q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t batch = q.size(0), n = q.size(1), hq = q.size(2), head_dim = q.size(3);
  at::Tensor o = at::empty({batch, n, hq, head_dim}, q.options());
  at::Tensor lse = at::empty({batch, hq, n}, q.options().dtype(at::kFloat));
  const RopeArgs rope = rope_args(cos, sin);

  AttentionFwdParams p{};
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  set_shared_params(p, q, k, v, rope, rng, window_left, window_right, scale, softcap, dropout_p);
  C10_CUDA_CHECK(attention_fwd_cuda(p, attention_kind(q.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
    const c10::optional<at::Tensor>& rng, double scale, double softcap, int64_t window_left, int64_t window_right,
    double dropout_p, bool deterministic) {
  check_attention_qkv(q, k, v);
  check_attention_options(q, k, cos, sin, rng, scale, softcap, dropout_p);
  check_attention_bwd_extra(dout, q, o, lse);
  check_cuda_attention(q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t batch = q.size(0), n = q.size(1), hq = q.size(2), head_dim = q.size(3);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  const auto f32 = q.options().dtype(at::kFloat);
  // Workspaces of this call: Delta = rowsum(dout * o), and the fp32 dq the atomics add into.
  at::Tensor delta = at::empty({batch, hq, n}, f32);
  at::Tensor dq_accum = deterministic ? at::Tensor() : at::zeros({batch, n, hq, head_dim}, f32);
  const RopeArgs rope = rope_args(cos, sin);

  AttentionBwdParams p{};
  p.dout = dout.const_data_ptr();
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.o = o.const_data_ptr();
  p.lse = lse.const_data_ptr<float>();
  set_shared_params(p, q, k, v, rope, rng, window_left, window_right, scale, softcap, dropout_p);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.delta = delta.data_ptr<float>();
  p.dq_accum = deterministic ? nullptr : dq_accum.data_ptr<float>();
  p.dout_batch_stride = dout.stride(0);
  p.dout_row_stride = dout.stride(1);
  p.dout_head_stride = dout.stride(2);
  p.o_batch_stride = o.stride(0);
  p.o_row_stride = o.stride(1);
  p.o_head_stride = o.stride(2);
  p.deterministic = deterministic;
  C10_CUDA_CHECK(attention_bwd_cuda(p, attention_kind(q.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return {dq, dk, dv};
}

// Packed (variable-length) sequences: the dense kernels with cu_seqlens in the params (see
// attention.h), q, k, v [total, H, D] seen as one batch of S sequences with batch strides 0.
template <typename Params>
void set_packed_params(Params& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                       int64_t max_seqlen_k, const c10::optional<at::Tensor>& cos,
                       const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& rng,
                       int64_t window_left, int64_t window_right, double scale, double softcap, double dropout_p) {
  set_shared_params(p, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), RopeArgs{}, rng, window_left, window_right,
                    scale, softcap, dropout_p);
  p.batch = cu_seqlens_q.numel() - 1;
  p.n = max_seqlen_q;
  p.m = max_seqlen_k;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = 0;
  p.cos = cos.has_value() ? cos->const_data_ptr<float>() : nullptr;
  p.sin = sin.has_value() ? sin->const_data_ptr<float>() : nullptr;
  p.rope_batch_stride = 0;
  p.rope_token_stride = cos.has_value() && cos->dim() == 3 ? q.size(2) / 2 : 0;
  p.cu_seqlens_q = cu_seqlens_q.const_data_ptr<int32_t>();
  p.cu_seqlens_k = cu_seqlens_k.const_data_ptr<int32_t>();
  p.total_q = q.size(0);
}

void check_cuda_packed(const at::Tensor& q, const at::Tensor& cu_seqlens_q) {
  check_cuda_attention(q.unsqueeze(0));
  TORCH_CHECK(cu_seqlens_q.numel() - 1 <= kAttentionCudaMaxGridYZ, "the CUDA attention kernels take at most ",
              kAttentionCudaMaxGridYZ, " packed sequences, got ", cu_seqlens_q.numel() - 1);
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd_cuda_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, const c10::optional<at::Tensor>& cos,
    const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& rng, double scale, double softcap,
    int64_t window_left, int64_t window_right, double dropout_p) {
  // The offsets' values were checked on the host by the caller (remat.checks.check_varlen_offsets):
  // reading them here would cost a device sync.
  check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, false);
  check_attention_options(q.unsqueeze(0), k.unsqueeze(0), c10::nullopt, c10::nullopt, rng, scale, softcap,
                          dropout_p);
  check_cuda_packed(q, cu_seqlens_q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t total_q = q.size(0), hq = q.size(1), head_dim = q.size(2);
  // Sequences without keys leave their o rows 0 and lse +inf (and so does a call without any).
  at::Tensor o = max_seqlen_k == 0 ? at::zeros({total_q, hq, head_dim}, q.options())
                                   : at::empty({total_q, hq, head_dim}, q.options());
  at::Tensor lse = at::full({hq, total_q}, INFINITY, q.options().dtype(at::kFloat));
  if (total_q == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) return {o, lse};
  AttentionFwdParams p{};
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  set_packed_params(p, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, window_left,
                    window_right, scale, softcap, dropout_p);
  C10_CUDA_CHECK(attention_fwd_cuda(p, attention_kind(q.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cuda_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
    const c10::optional<at::Tensor>& rng, double scale, double softcap, int64_t window_left, int64_t window_right,
    double dropout_p, bool deterministic) {
  check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, false);
  check_attention_options(q.unsqueeze(0), k.unsqueeze(0), c10::nullopt, c10::nullopt, rng, scale, softcap,
                          dropout_p);
  check_attention_varlen_bwd_extra(dout, q, o, lse);
  check_cuda_packed(q, cu_seqlens_q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t total_q = q.size(0), hq = q.size(1), head_dim = q.size(2);
  const bool empty = total_q == 0 || k.size(0) == 0 || max_seqlen_q == 0 || max_seqlen_k == 0;
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  if (empty) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor delta = at::empty({hq, total_q}, f32);
  at::Tensor dq_accum = deterministic ? at::Tensor() : at::zeros({total_q, hq, head_dim}, f32);

  AttentionBwdParams p{};
  p.dout = dout.const_data_ptr();
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.o = o.const_data_ptr();
  p.lse = lse.const_data_ptr<float>();
  set_packed_params(p, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, window_left,
                    window_right, scale, softcap, dropout_p);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.delta = delta.data_ptr<float>();
  p.dq_accum = deterministic ? nullptr : dq_accum.data_ptr<float>();
  p.dout_batch_stride = p.o_batch_stride = 0;
  p.dout_row_stride = dout.stride(0);
  p.dout_head_stride = dout.stride(1);
  p.o_row_stride = o.stride(0);
  p.o_head_stride = o.stride(1);
  p.deterministic = deterministic;
  C10_CUDA_CHECK(attention_bwd_cuda(p, attention_kind(q.scalar_type()), c10::cuda::getCurrentCUDAStream()));
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CUDA, m) {
  m.impl("attention_fwd", &attention_fwd_cuda_op);
  m.impl("attention_bwd", &attention_bwd_cuda_op);
  m.impl("attention_varlen_fwd", &attention_varlen_fwd_cuda_op);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd_cuda_op);
}

}  // namespace remat
