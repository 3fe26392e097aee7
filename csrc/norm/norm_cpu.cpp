// C++ CPU kernels of the norm blocks (OpenMP over rows through at::parallel_for), with the same
// recompute contract as the CUDA and Triton kernels: the forward saves only its input (x, or
// h = x + residual) and fp32 per-row statistics; the backward recomputes x_hat from them.
//
// Each row is widened to an fp32 buffer, processed by plain loops over fp32 arrays, and narrowed
// back (common/cpu_convert.h); the loops are compiled for x86-64-v3 and baseline x86-64.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "common/cpu_convert.h"
#include "common/math.h"
#include "norm/norm_checks.h"

namespace remat {
namespace {

// Row reductions keep 32 independent fp32 partial sums (four AVX2 registers, so the adds do not
// wait on each other) and add them pairwise at the end: vectorised, more accurate than one
// running sum, and in a fixed order, so deterministic for a given binary.
constexpr int kLanes = 32;

float reduce_lanes(float* lanes) {
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  return lanes[0];
}

REMAT_CPU_CLONES float sum(const float* __restrict__ v, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) lanes[k] += v[i + k];
  for (int k = 0; i < n; ++i, ++k) lanes[k] += v[i];
  return reduce_lanes(lanes);
}

REMAT_CPU_CLONES float sum_of_squares(const float* __restrict__ v, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) lanes[k] += v[i + k] * v[i + k];
  for (int k = 0; i < n; ++i, ++k) lanes[k] += v[i] * v[i];
  return reduce_lanes(lanes);
}

REMAT_CPU_CLONES float centered_sum_of_squares(const float* __restrict__ v, float mean, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) lanes[k] += (v[i + k] - mean) * (v[i + k] - mean);
  for (int k = 0; i < n; ++i, ++k) lanes[k] += (v[i] - mean) * (v[i] - mean);
  return reduce_lanes(lanes);
}

// out = (u - mean) * rstd * weight + bias; weight and bias may be null.
REMAT_CPU_CLONES void normalize(const float* __restrict__ u, float mean, float rstd, const float* __restrict__ weight, const float* __restrict__ bias,
                                float* __restrict__ out, int64_t n) {
  if (weight && bias) {
    for (int64_t i = 0; i < n; ++i) out[i] = (u[i] - mean) * rstd * weight[i] + bias[i];
  } else if (weight) {
    for (int64_t i = 0; i < n; ++i) out[i] = (u[i] - mean) * rstd * weight[i];
  } else if (bias) {
    for (int64_t i = 0; i < n; ++i) out[i] = (u[i] - mean) * rstd + bias[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = (u[i] - mean) * rstd;
  }
}

// Backward, first pass over a row: recomputes x_hat = (h - mean) * rstd and g = dy * weight (or
// dy) in registers, accumulates dw += dy * x_hat and db += dy, and returns sum(g * x_hat) and
// sum(g). Specialised so that each variant is one branch-free vectorised loop.
template <bool kWeight, bool kDw, bool kDb>
[[gnu::always_inline]] inline void reduce_pass(const float* __restrict__ h, const float* __restrict__ dy,
                                               const float* __restrict__ weight, float mean, float rstd,
                                               float* __restrict__ dw, float* __restrict__ db, float* sum_g_xhat,
                                               float* sum_g, int64_t n) {
  float total_g_xhat = 0.f, total_g = 0.f;
#pragma omp simd reduction(+ : total_g_xhat, total_g)
  for (int64_t i = 0; i < n; ++i) {
    const float x_hat = (h[i] - mean) * rstd;
    const float g = kWeight ? dy[i] * weight[i] : dy[i];
    total_g_xhat += g * x_hat;
    total_g += g;
    if constexpr (kDw) dw[i] += dy[i] * x_hat;
    if constexpr (kDb) db[i] += dy[i];
  }
  *sum_g_xhat = total_g_xhat;
  *sum_g = total_g;
}

REMAT_CPU_CLONES void backward_reduce(const float* h, const float* dy, const float* weight, float mean, float rstd,
                                      float* dw, float* db, float* sum_g_xhat, float* sum_g, int64_t n) {
  const int variant = (weight ? 4 : 0) | (dw ? 2 : 0) | (db ? 1 : 0);
  switch (variant) {
    case 0: return reduce_pass<false, false, false>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
    case 1: return reduce_pass<false, false, true>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
    case 2: return reduce_pass<false, true, false>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
    case 3: return reduce_pass<false, true, true>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
    case 4: return reduce_pass<true, false, false>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
    case 5: return reduce_pass<true, false, true>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
    case 6: return reduce_pass<true, true, false>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
    default: return reduce_pass<true, true, true>(h, dy, weight, mean, rstd, dw, db, sum_g_xhat, sum_g, n);
  }
}

// Backward, second pass: dx = rstd * (g - x_hat * mean_g_xhat - mean_g) (+ dh), with x_hat and g
// recomputed again rather than stored by the first pass.
template <bool kWeight, bool kDh>
[[gnu::always_inline]] inline void dx_pass(const float* __restrict__ h, const float* __restrict__ dy,
                                           const float* __restrict__ weight, const float* __restrict__ dh,
                                           float mean, float rstd, float mean_g_xhat, float mean_g,
                                           float* __restrict__ dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x_hat = (h[i] - mean) * rstd;
    const float g = kWeight ? dy[i] * weight[i] : dy[i];
    const float grad = rstd * (g - x_hat * mean_g_xhat - mean_g);
    dx[i] = kDh ? grad + dh[i] : grad;
  }
}

REMAT_CPU_CLONES void backward_dx(const float* h, const float* dy, const float* weight, const float* dh, float mean,
                                  float rstd, float mean_g_xhat, float mean_g, float* dx, int64_t n) {
  const int variant = (weight ? 2 : 0) | (dh ? 1 : 0);
  switch (variant) {
    case 0: return dx_pass<false, false>(h, dy, weight, dh, mean, rstd, mean_g_xhat, mean_g, dx, n);
    case 1: return dx_pass<false, true>(h, dy, weight, dh, mean, rstd, mean_g_xhat, mean_g, dx, n);
    case 2: return dx_pass<true, false>(h, dy, weight, dh, mean, rstd, mean_g_xhat, mean_g, dx, n);
    default: return dx_pass<true, true>(h, dy, weight, dh, mean, rstd, mean_g_xhat, mean_g, dx, n);
  }
}

// Rows handled per parallel task: enough elements to amortise the task, few enough to balance.
int64_t rows_per_task(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

std::vector<float> widened_vector(const c10::optional<at::Tensor>& t, int64_t cols) {
  std::vector<float> out(t ? cols : 0);
  if (t) {
    const at::Tensor c = t->contiguous();
    widen(c.const_data_ptr(), out.data(), cols, storage_of(c.scalar_type()));
  }
  return out;
}

const char* row_ptr(const at::Tensor& t, int64_t row, int64_t row_stride) {
  return static_cast<const char*>(t.const_data_ptr()) + row * row_stride * t.element_size();
}

void norm_fwd_rows(const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& residual, float eps, bool is_rms, at::Tensor& y, at::Tensor& h,
                   at::Tensor& mean, at::Tensor& rstd) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const Storage storage = storage_of(x.scalar_type());
  const int64_t elem = x.element_size();
  const std::vector<float> w = widened_vector(weight, cols), b = widened_vector(bias, cols);
  char* y_bytes = static_cast<char*>(y.data_ptr());
  char* h_bytes = residual ? static_cast<char*>(h.data_ptr()) : nullptr;
  float* mean_ptr = is_rms ? nullptr : mean.data_ptr<float>();
  float* rstd_ptr = rstd.data_ptr<float>();

  at::parallel_for(0, rows, rows_per_task(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> u_buffer(cols), out_buffer(cols);
    for (int64_t row = begin; row < end; ++row) {
      const float* u = as_float(row_ptr(x, row, x.stride(0)), u_buffer.data(), cols, storage);
      if (residual) {
        // h is rounded to the input type before the statistics, exactly as the backward reads it.
        char* h_row = h_bytes + row * cols * elem;
        const float* r = as_float(row_ptr(*residual, row, residual->stride(0)), out_buffer.data(), cols, storage);
        float* sum_target = float_target(h_row, out_buffer.data(), storage);
        for (int64_t c = 0; c < cols; ++c) sum_target[c] = u[c] + r[c];
        narrow(sum_target, h_row, cols, storage);
        u = as_float(h_row, u_buffer.data(), cols, storage);
      }
      float row_mean = 0.f, row_rstd;
      if (is_rms) {
        row_rstd = rms_rstd(sum_of_squares(u, cols), cols, eps);
      } else {
        row_mean = sum(u, cols) / static_cast<float>(cols);
        row_rstd = layer_norm_rstd(centered_sum_of_squares(u, row_mean, cols) / static_cast<float>(cols), eps);
        mean_ptr[row] = row_mean;
      }
      rstd_ptr[row] = row_rstd;
      char* y_row = y_bytes + row * cols * elem;
      float* y = float_target(y_row, out_buffer.data(), storage);
      normalize(u, row_mean, row_rstd, weight ? w.data() : nullptr, bias ? b.data() : nullptr, y, cols);
      narrow(y, y_row, cols, storage);
    }
  });
}

// Weight-gradient partials: rows are split into a fixed number of contiguous chunks that depends
// only on the shape, each chunk sums into its own fp32 row, and the chunks are added in index
// order, so dw and db are bitwise identical whatever the thread count.
int64_t num_row_chunks(int64_t rows) { return std::min<int64_t>(rows, 32); }

void norm_bwd_rows(const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
                   const c10::optional<at::Tensor>& weight, const float* mean_ptr, const float* rstd_ptr,
                   bool has_bias, at::Tensor& dx, at::Tensor& dw, at::Tensor& db) {
  const int64_t rows = h.size(0), cols = h.size(1);
  const Storage storage = storage_of(h.scalar_type());
  const int64_t elem = h.element_size();
  const std::vector<float> w = widened_vector(weight, cols);
  char* dx_bytes = static_cast<char*>(dx.data_ptr());
  const int64_t chunks = num_row_chunks(rows);
  std::vector<float> dw_partial(weight ? chunks * cols : 0, 0.f);
  std::vector<float> db_partial(has_bias ? chunks * cols : 0, 0.f);

  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<float> h_buffer(cols), dy_buffer(cols), dh_buffer(dh ? cols : 0), dx_buffer(cols);
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t row_begin = rows * chunk / chunks, row_end = rows * (chunk + 1) / chunks;
      float* dw_row = weight ? dw_partial.data() + chunk * cols : nullptr;
      float* db_row = has_bias ? db_partial.data() + chunk * cols : nullptr;
      for (int64_t row = row_begin; row < row_end; ++row) {
        const float row_mean = mean_ptr ? mean_ptr[row] : 0.f;
        const float row_rstd = rstd_ptr[row];
        const float* h_f = as_float(row_ptr(h, row, h.stride(0)), h_buffer.data(), cols, storage);
        const float* dy_f = as_float(row_ptr(dy, row, dy.stride(0)), dy_buffer.data(), cols, storage);
        const float* w_f = weight ? w.data() : nullptr;
        float sum_g_xhat, sum_g;
        backward_reduce(h_f, dy_f, w_f, row_mean, row_rstd, dw_row, db_row, &sum_g_xhat, &sum_g, cols);
        const float inv_cols = 1.f / static_cast<float>(cols);
        const float* dh_f = dh ? as_float(row_ptr(*dh, row, dh->stride(0)), dh_buffer.data(), cols, storage) : nullptr;
        char* dx_row = dx_bytes + row * cols * elem;
        float* dx_f = float_target(dx_row, dx_buffer.data(), storage);
        backward_dx(h_f, dy_f, w_f, dh_f, row_mean, row_rstd, sum_g_xhat * inv_cols,
                    mean_ptr ? sum_g * inv_cols : 0.f, dx_f, cols);
        narrow(dx_f, dx_row, cols, storage);
      }
    }
  });

  auto reduce_chunks = [&](const std::vector<float>& partial, at::Tensor& out) {
    char* out_bytes = static_cast<char*>(out.data_ptr());
    constexpr int64_t kColumnBlock = 1024;
    at::parallel_for(0, (cols + kColumnBlock - 1) / kColumnBlock, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> total(kColumnBlock);
      for (int64_t block = begin; block < end; ++block) {
        const int64_t c0 = block * kColumnBlock, n = std::min(kColumnBlock, cols - c0);
        std::fill(total.begin(), total.end(), 0.f);
        for (int64_t chunk = 0; chunk < chunks; ++chunk)
          for (int64_t c = 0; c < n; ++c) total[c] += partial[chunk * cols + c0 + c];
        narrow(total.data(), out_bytes + c0 * elem, n, storage);
      }
    });
  };
  if (weight) reduce_chunks(dw_partial, dw);
  if (has_bias) reduce_chunks(db_partial, db);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd_cpu(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, double eps, bool is_rms) {
  check_norm_fwd_args(x, weight, bias, residual, eps);
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor");
  storage_of(x.scalar_type());
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor y = at::empty({rows, cols}, x.options());
  // Without a residual the saved input is x itself, and h is an empty placeholder.
  at::Tensor h = residual.has_value() ? at::empty({rows, cols}, x.options()) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({is_rms ? 0 : rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows > 0 && cols > 0) norm_fwd_rows(x, weight, bias, residual, static_cast<float>(eps), is_rms, y, h, mean, rstd);
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& mean,
    const at::Tensor& rstd, bool has_bias, bool is_rms) {
  check_norm_bwd_args(dy, dh, h, weight, rstd);
  if (!is_rms) check_stats(*mean, "mean", h);
  TORCH_CHECK(h.device().is_cpu(), "h must be a CPU tensor");
  storage_of(h.scalar_type());
  const int64_t rows = h.size(0), cols = h.size(1);
  at::Tensor dx = at::empty({rows, cols}, h.options());
  at::Tensor dw = at::empty({weight.has_value() ? cols : 0}, h.options());
  at::Tensor db = at::empty({has_bias ? cols : 0}, h.options());
  if (rows == 0) {
    dw.zero_();
    db.zero_();
  } else if (cols > 0) {
    norm_bwd_rows(dy, dh, h, weight, is_rms ? nullptr : mean->const_data_ptr<float>(), rstd.const_data_ptr<float>(),
                  has_bias, dx, dw, db);
  }
  return {dx, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cpu(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& residual, double eps) {
  auto [y, h, mean, rstd] = norm_fwd_cpu(x, weight, c10::nullopt, residual, eps, /*is_rms=*/true);
  return {y, h, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, double eps) {
  return norm_fwd_cpu(x, weight, bias, residual, eps, /*is_rms=*/false);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& dy, const c10::optional<at::Tensor>& dh,
                                                    const at::Tensor& h, const c10::optional<at::Tensor>& weight,
                                                    const at::Tensor& rstd) {
  auto [dx, dw, db] = norm_bwd_cpu(dy, dh, h, weight, c10::nullopt, rstd, false, /*is_rms=*/true);
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const c10::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd, bool has_bias) {
  return norm_bwd_cpu(dy, dh, h, weight, mean, rstd, has_bias, /*is_rms=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cpu);
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
}

}  // namespace remat
