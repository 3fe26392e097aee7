// Rotary embedding applied once to a whole q or k tensor on the CPU (python/remat/ops/rope.py
// states the contract). Tokens run in parallel; each token's cos/sin row is read once and applied
// to every head: widen the two halves to fp32, rotate, narrow once to the dtype.
//
// Rounding: each product and each sum rounds to fp32 on its own, as PyTorch's x1 * c - x2 * s
// does, so the result is bitwise PyTorch's. GCC contracts a * b - c * d into an FMA by default
// (the x86-64-v3 clone has FMA; aarch64 always does), so the products and the sums are separate
// functions compiled with fp-contract off: a product reaches its sum only through memory, and the
// target_clones functions are called through their resolver, never inlined into each other.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "common/cpu_convert.h"

#if defined(__GNUC__) && !defined(__clang__)
#define REMAT_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define REMAT_NO_FP_CONTRACT
#endif

namespace remat {
namespace {

// a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s (the four products of one rotation).
REMAT_CPU_CLONES REMAT_NO_FP_CONTRACT void rope_products(const float* __restrict__ x1,
                                                         const float* __restrict__ x2, const float* __restrict__ c,
                                                         const float* __restrict__ s, float* __restrict__ a,
                                                         float* __restrict__ b, float* __restrict__ d,
                                                         float* __restrict__ e, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    a[i] = x1[i] * c[i];
    b[i] = x2[i] * s[i];
    d[i] = x2[i] * c[i];
    e[i] = x1[i] * s[i];
  }
}

// y1 = a - b, y2 = d + e (the rotation), or y1 = a + b, y2 = d - e (its transpose, `inverse`).
REMAT_CPU_CLONES REMAT_NO_FP_CONTRACT void rope_sums(const float* __restrict__ a, const float* __restrict__ b,
                                                     const float* __restrict__ d, const float* __restrict__ e,
                                                     float* __restrict__ y1, float* __restrict__ y2, int64_t half,
                                                     bool inverse) {
  if (inverse) {
    for (int64_t i = 0; i < half; ++i) y1[i] = a[i] + b[i];
    for (int64_t i = 0; i < half; ++i) y2[i] = d[i] - e[i];
  } else {
    for (int64_t i = 0; i < half; ++i) y1[i] = a[i] - b[i];
    for (int64_t i = 0; i < half; ++i) y2[i] = d[i] + e[i];
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
  at::parallel_for(0, batch * length, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(8 * half);
    float *x1 = buffer.data(), *x2 = x1 + half, *a = x2 + half, *b = a + half, *d = b + half, *e = d + half;
    float *y1 = e + half, *y2 = y1 + half;
    for (int64_t token = begin; token < end; ++token) {
      const int64_t bi = token / length, li = token % length;
      const int64_t row = row_data ? row_data[token] : bi * table_batch_stride + first_position + li;
      TORCH_CHECK(row >= 0 && row < table_rows, "rope table row ", row, " out of range [0, ", table_rows, ")");
      const float* c = cos_data + row * half;
      const float* s = sin_data + row * half;
      for (int64_t h = 0; h < heads; ++h) {
        const char* in = src + (bi * stride_b + li * stride_l + h * stride_h) * element;
        char* out = dst + ((token * heads + h) * head_dim) * element;
        widen(in, x1, half, storage);
        widen(in + half * element, x2, half, storage);
        rope_products(x1, x2, c, s, a, b, d, e, half);
        rope_sums(a, b, d, e, y1, y2, half, inverse);
        narrow(y1, out, half, storage);
        narrow(y2, out + half * element, half, storage);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CPU, m) { m.impl("rope_rotate", &rope_rotate_cpu); }

}  // namespace remat
