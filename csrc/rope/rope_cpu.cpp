// Rotary embedding applied once to a whole q or k tensor on the CPU (python/remat/ops/rope.py
// states the contract). Tokens run in parallel; each token's cos/sin row is read once and applied
// to every head: widen the token to fp32, rotate all its heads, narrow once to the dtype (four
// calls per token: the loops are target_clones functions, called through their resolver).
//
// Rounding: each product and each sum rounds to fp32 on its own, as PyTorch's x1 * c - x2 * s
// does, so the result is bitwise PyTorch's (NaN sign and payload aside, which IEEE leaves open). GCC contracts a * b - c * d into an FMA by default
// (the x86-64-v3 clone has FMA; aarch64 always does), so the products and the sums are separate
// functions compiled with fp-contract off: a product reaches its sum only through memory, and the
// target_clones functions are called through their resolver, never inlined into each other.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <memory>
#include <optional>

#include "common/cpu_convert.h"

#if defined(__GNUC__) && !defined(__clang__)
#define REMAT_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define REMAT_NO_FP_CONTRACT
#endif

namespace remat {
namespace {

// One token's H heads, x [H, D] fp32 with halves (x1, x2) = (x[h, :D/2], x[h, D/2:]):
// a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s, each [H, D/2] (the four products of the rotation).
REMAT_CPU_CLONES REMAT_NO_FP_CONTRACT void rope_products(const float* __restrict__ x, const float* __restrict__ c,
                                                         const float* __restrict__ s, float* __restrict__ a,
                                                         float* __restrict__ b, float* __restrict__ d,
                                                         float* __restrict__ e, int64_t heads, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* x1 = x + h * 2 * half;
    const float* x2 = x1 + half;
    float *ah = a + h * half, *bh = b + h * half, *dh = d + h * half, *eh = e + h * half;
    for (int64_t i = 0; i < half; ++i) {
      ah[i] = x1[i] * c[i];
      bh[i] = x2[i] * s[i];
      dh[i] = x2[i] * c[i];
      eh[i] = x1[i] * s[i];
    }
  }
}

// y [H, D] fp32: (a - b, d + e) per head (the rotation), or (a + b, d - e) (its transpose, `inverse`).
REMAT_CPU_CLONES REMAT_NO_FP_CONTRACT void rope_sums(const float* __restrict__ a, const float* __restrict__ b,
                                                     const float* __restrict__ d, const float* __restrict__ e,
                                                     float* __restrict__ y, int64_t heads, int64_t half,
                                                     bool inverse) {
  const float sign = inverse ? 1.0f : -1.0f;  // exact: a + sign * b rounds once, as a -/+ b does
  for (int64_t h = 0; h < heads; ++h) {
    float* y1 = y + h * 2 * half;
    float* y2 = y1 + half;
    const float *ah = a + h * half, *bh = b + h * half, *dh = d + h * half, *eh = e + h * half;
    for (int64_t i = 0; i < half; ++i) y1[i] = ah[i] + sign * bh[i];
    for (int64_t i = 0; i < half; ++i) y2[i] = dh[i] - sign * eh[i];
  }
}

void check_rope_rotate_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "x must be [B, L, H, D] with an even D");
  TORCH_CHECK(x.numel() == 0 || x.stride(3) == 1, "x must have unit last stride");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->dim() == 2 && table->size(1) == x.size(3) / 2 && table->scalar_type() == at::kFloat &&
                    table->is_contiguous() && table->device() == x.device(),
                "cos and sin must be contiguous fp32 [R, D/2] tensors on x's device");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "cos and sin must have one shape");
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == x.size(0) * x.size(1) && rows->scalar_type() == at::kLong &&
                    rows->is_contiguous() && rows->device() == x.device(),
                "rows must be a contiguous int64 [B * L] tensor on x's device");
  }
}

at::Tensor rope_rotate_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const std::optional<at::Tensor>& rows, int64_t first_position, int64_t table_batch_stride,
                           bool inverse) {
  check_rope_rotate_args(x, cos, sin, rows);
  const int64_t batch = x.size(0), length = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const int64_t half = head_dim / 2, table_rows = cos.size(0);
  at::Tensor y = at::empty({batch, length, heads, head_dim}, x.options());
  const Storage storage = storage_of(x.scalar_type());
  const int64_t element = x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(y.data_ptr());
  const float* cos_data = cos.const_data_ptr<float>();
  const float* sin_data = sin.const_data_ptr<float>();
  const int64_t* row_data = rows.has_value() ? rows->const_data_ptr<int64_t>() : nullptr;
  const int64_t stride_b = x.stride(0), stride_l = x.stride(1), stride_h = x.stride(2);
  // Tokens per task: enough work (heads x D elements each) to amortise a task's buffers.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, heads * head_dim));
  // Heads of a token adjacent in memory (stride_h == D: a contiguous [B, L, H, D] tensor or a
  // slice of the sequence) are widened in one call, else one head at a time.
  const bool heads_adjacent = stride_h == head_dim;
  at::parallel_for(0, batch * length, grain, [&](int64_t begin, int64_t end) {
    const int64_t token_elements = heads * head_dim;
    // fp32 buffers of one token: its input, the four products, its output (not zero-filled).
    std::unique_ptr<float[]> buffer(new float[4 * token_elements]);
    float *in_f = buffer.get(), *a = in_f + token_elements, *b = a + token_elements / 2;
    float *d = b + token_elements / 2, *e = d + token_elements / 2, *out_f = e + token_elements / 2;
    for (int64_t token = begin; token < end; ++token) {
      const int64_t bi = token / length, li = token % length;
      const int64_t row = row_data ? row_data[token] : bi * table_batch_stride + first_position + li;
      TORCH_CHECK(row >= 0 && row < table_rows, "rope table row ", row, " out of range [0, ", table_rows, ")");
      const char* in = src + (bi * stride_b + li * stride_l) * element;
      if (heads_adjacent) {
        widen(in, in_f, token_elements, storage);
      } else {
        for (int64_t h = 0; h < heads; ++h) {
          widen(in + h * stride_h * element, in_f + h * head_dim, head_dim, storage);
        }
      }
      rope_products(in_f, cos_data + row * half, sin_data + row * half, a, b, d, e, heads, half);
      rope_sums(a, b, d, e, out_f, heads, half, inverse);
      narrow(out_f, dst + token * token_elements * element, token_elements, storage);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CPU, m) { m.impl("rope_rotate", &rope_rotate_cpu); }

}  // namespace remat
