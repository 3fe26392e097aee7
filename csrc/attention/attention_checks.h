// Argument checks shared by the CPU and CUDA attention operators. The Python layer
// (remat.attention) raises ValueError/TypeError for bad input before calling an operator; these
// checks guard direct callers of torch.ops.remat.attention_* and fail with a RuntimeError naming
// the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace remat {

constexpr int64_t kMaxAttentionHeadDim = 256;

// q [B, N, Hq, D]; k, v [B, M, Hkv, D] with Hq % Hkv == 0; one dtype and device; unit last stride.
inline void check_attention_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, "q must be 4-D [B, N, Hq, D], got ", q.dim(), " dims");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "k and v must be 4-D [B, M, Hkv, D]");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "k must be [", q.size(0), ", M, Hkv, ",
              q.size(3), "], got ", k.sizes());
  TORCH_CHECK(q.size(0) >= 1 && q.size(1) >= 1 && k.size(1) >= 1 && k.size(2) >= 1,
              "attention needs B, N, M and heads >= 1");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "q heads (", q.size(2), ") must be a multiple of k/v heads (",
              k.size(2), ")");
  TORCH_CHECK(q.size(3) >= 1 && q.size(3) <= kMaxAttentionHeadDim, "head dim must be in 1..",
              kMaxAttentionHeadDim, ", got ", q.size(3));
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k and v must share one dtype");
    TORCH_CHECK(t->device() == q.device(), "q, k and v must be on one device");
    TORCH_CHECK(t->stride(3) == 1, "q, k and v must have unit stride in the head dim");
  }
}

// cos/sin fp32 contiguous [1 or B, S >= M, D/2]; rng int64 [2]; scalar arguments in range.
inline void check_attention_options(const at::Tensor& q, const at::Tensor& k,
                                    const c10::optional<at::Tensor>& cos,
                                    const c10::optional<at::Tensor>& sin,
                                    const c10::optional<at::Tensor>& rng, double scale,
                                    double softcap, double dropout_p) {
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin must be given together");
  if (cos.has_value()) {
    TORCH_CHECK(q.size(3) % 2 == 0, "rope needs an even head dim, got ", q.size(3));
    TORCH_CHECK(q.size(1) <= k.size(1), "rope needs N <= M (query i sits at position i + M - N)");
    for (const at::Tensor* t : {&*cos, &*sin}) {
      TORCH_CHECK(t->dim() == 3 && (t->size(0) == 1 || t->size(0) == q.size(0)) && t->size(1) >= k.size(1) &&
                      t->size(2) == q.size(3) / 2,
                  "cos/sin must be [1 or B, S >= M, D/2] = [1 or ", q.size(0), ", >= ", k.size(1), ", ",
                  q.size(3) / 2, "], got ", t->sizes());
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "cos/sin must be contiguous float32");
      TORCH_CHECK(t->device() == q.device(), "cos/sin must be on ", q.device());
    }
    TORCH_CHECK(cos->sizes() == sin->sizes(), "cos and sin must have one shape");
  }
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0 = off), got ", softcap);
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK((dropout_p > 0) == rng.has_value(), "rng (seed, offset) must be given exactly when dropout_p > 0");
  if (rng.has_value()) {
    TORCH_CHECK(rng->dim() == 1 && rng->size(0) == 2 && rng->scalar_type() == at::kLong && rng->is_contiguous(),
                "rng must be a contiguous int64 tensor [2] = (seed, offset)");
    TORCH_CHECK(rng->device() == q.device(), "rng must be on ", q.device());
  }
}

inline void check_attention_bwd_extra(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& o,
                                      const at::Tensor& lse) {
  for (const at::Tensor* t : {&dout, &o}) {
    TORCH_CHECK(t->sizes() == q.sizes(), "dout and o must have q's shape ", q.sizes(), ", got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(),
                "dout and o must have q's dtype and device");
    TORCH_CHECK(t->stride(3) == 1, "dout and o must have unit stride in the head dim");
  }
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(2) && lse.size(2) == q.size(1) &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.device() == q.device(),
              "lse must be a contiguous float32 [B, Hq, N] tensor");
}

// Packed (variable-length) attention: q [total_q, Hq, D]; k, v [total_k, Hkv, D]; cu_seqlens_q / _k
// contiguous int32 [S + 1] on q's device; cos/sin fp32 contiguous [S_rows >= max_seqlen_k, D/2]
// (positions restart per sequence) or [1, T >= total_k, D/2] (per packed key token), or absent.
// With read_values (CPU tensors, where reading is free), the offsets are checked too: from 0,
// non-decreasing, ending at the totals, no sequence longer than its max_seqlen, and N_s <= M_s with
// rope. On CUDA the Python layer has checked them (remat.checks.check_varlen_offsets).
inline void check_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                   int64_t max_seqlen_q, int64_t max_seqlen_k, const c10::optional<at::Tensor>& cos,
                                   const c10::optional<at::Tensor>& sin, bool read_values) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "packed attention takes q [total_q, Hq, D] and k, v [total_k, Hkv, D]");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(2) == q.size(2), "k must have q's head dim ", q.size(2), ", got ", k.sizes());
  TORCH_CHECK(q.size(1) >= 1 && k.size(1) >= 1 && q.size(1) % k.size(1) == 0,
              "q heads (", q.size(1), ") must be a positive multiple of k/v heads (", k.size(1), ")");
  TORCH_CHECK(q.size(2) >= 1 && q.size(2) <= kMaxAttentionHeadDim, "head dim must be in 1..",
              kMaxAttentionHeadDim, ", got ", q.size(2));
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k and v must share one dtype");
    TORCH_CHECK(t->device() == q.device(), "q, k and v must be on one device");
    TORCH_CHECK(t->stride(2) == 1, "q, k and v must have unit stride in the head dim");
  }
  for (const at::Tensor* cu : {&cu_seqlens_q, &cu_seqlens_k}) {
    TORCH_CHECK(cu->dim() == 1 && cu->numel() >= 2 && cu->scalar_type() == at::kInt && cu->is_contiguous() &&
                    cu->device() == q.device(),
                "cu_seqlens_q / cu_seqlens_k must be contiguous int32 [S + 1] tensors on ", q.device());
  }
  TORCH_CHECK(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must have one length");
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "max_seqlen_q and max_seqlen_k must be >= 0");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin must be given together");
  if (cos.has_value()) {
    TORCH_CHECK(q.size(2) % 2 == 0, "rope needs an even head dim, got ", q.size(2));
    for (const at::Tensor* t : {&*cos, &*sin}) {
      const bool restart = t->dim() == 2 && t->size(0) >= max_seqlen_k;
      const bool per_token = t->dim() == 3 && t->size(0) == 1 && t->size(1) >= k.size(0);
      TORCH_CHECK((restart || per_token) && t->size(-1) == q.size(2) / 2,
                  "packed cos/sin must be [S >= max_seqlen_k, D/2] or [1, T >= total_k, D/2], got ", t->sizes());
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "cos/sin must be contiguous float32");
      TORCH_CHECK(t->device() == q.device(), "cos/sin must be on ", q.device());
    }
    TORCH_CHECK(cos->sizes() == sin->sizes(), "cos and sin must have one shape");
  }
  if (!read_values) return;
  const int32_t* cu_q = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* cu_k = cu_seqlens_k.const_data_ptr<int32_t>();
  const int64_t sequences = cu_seqlens_q.numel() - 1;
  TORCH_CHECK(cu_q[0] == 0 && cu_k[0] == 0, "cu_seqlens_q and cu_seqlens_k must start at 0");
  TORCH_CHECK(cu_q[sequences] == q.size(0) && cu_k[sequences] == k.size(0),
              "cu_seqlens_q / cu_seqlens_k must end at total_q = ", q.size(0), " / total_k = ", k.size(0));
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t n = cu_q[s + 1] - cu_q[s], m = cu_k[s + 1] - cu_k[s];
    TORCH_CHECK(n >= 0 && m >= 0, "cu_seqlens_q and cu_seqlens_k must be non-decreasing");
    TORCH_CHECK(n <= max_seqlen_q && m <= max_seqlen_k, "sequence ", s, " is longer than max_seqlen_q / _k");
    TORCH_CHECK(!cos.has_value() || n <= m, "rope needs N <= M in every sequence (sequence ", s, ")");
  }
}

inline void check_attention_varlen_bwd_extra(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& o,
                                             const at::Tensor& lse) {
  for (const at::Tensor* t : {&dout, &o}) {
    TORCH_CHECK(t->sizes() == q.sizes(), "dout and o must have q's shape ", q.sizes(), ", got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(),
                "dout and o must have q's dtype and device");
    TORCH_CHECK(t->stride(2) == 1, "dout and o must have unit stride in the head dim");
  }
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0) &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.device() == q.device(),
              "lse must be a contiguous float32 [Hq, total_q] tensor");
}

}  // namespace remat
