// C++ CPU kernels of the norm blocks (OpenMP over rows through at::parallel_for), with the same
// recompute contract as the CUDA and Triton kernels: the forward saves only its input (x, or
// h = x + residual) and fp32 per-row statistics; the backward recomputes x_hat from them.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/math.h"
#include "norm/norm_checks.h"

namespace remat {
namespace {

// Rows handled per parallel task: enough elements to amortise the task, few enough to balance.
int64_t rows_per_task(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// Eight independent fp32 lanes: the loop vectorises, and the sum is more accurate than one
// running fp32 accumulator.
float lane_sum(const float* v, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lanes[k] += v[i + k];
  for (; i < n; ++i) lanes[i % 8] += v[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

float lane_sum_of_products(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lanes[k] += a[i + k] * b[i + k];
  for (; i < n; ++i) lanes[i % 8] += a[i] * b[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

float lane_sum_of_centered_squares(const float* v, float mean, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const float d = v[i + k] - mean;
      lanes[k] += d * d;
    }
  for (; i < n; ++i) {
    const float d = v[i] - mean;
    lanes[i % 8] += d * d;
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

template <typename T>
void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void norm_fwd_kernel(const at::Tensor& x, const at::Tensor* weight, const at::Tensor* bias,
                     const at::Tensor* residual, float eps, bool is_rms, at::Tensor& y,
                     at::Tensor& h, at::Tensor& mean, at::Tensor& rstd) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const T* x_ptr = x.const_data_ptr<T>();
  const T* res_ptr = residual ? residual->const_data_ptr<T>() : nullptr;
  const int64_t x_stride = x.stride(0), res_stride = residual ? residual->stride(0) : 0;
  std::vector<float> w_f(weight ? cols : 0), b_f(bias ? cols : 0);
  if (weight) load_row(weight->contiguous().const_data_ptr<T>(), w_f.data(), cols);
  if (bias) load_row(bias->contiguous().const_data_ptr<T>(), b_f.data(), cols);
  T* y_ptr = y.data_ptr<T>();
  T* h_ptr = residual ? h.data_ptr<T>() : nullptr;
  float* mean_ptr = is_rms ? nullptr : mean.data_ptr<float>();
  float* rstd_ptr = rstd.data_ptr<float>();

  at::parallel_for(0, rows, rows_per_task(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> u(cols);
    for (int64_t row = begin; row < end; ++row) {
      const T* x_row = x_ptr + row * x_stride;
      if (res_ptr) {
        // h is rounded to T before the statistics, exactly as the backward will read it.
        const T* r_row = res_ptr + row * res_stride;
        T* h_row = h_ptr + row * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const T rounded = static_cast<T>(static_cast<float>(x_row[c]) + static_cast<float>(r_row[c]));
          h_row[c] = rounded;
          u[c] = static_cast<float>(rounded);
        }
      } else {
        load_row(x_row, u.data(), cols);
      }
      float row_mean = 0.f, row_rstd;
      if (is_rms) {
        row_rstd = rms_rstd(lane_sum_of_products(u.data(), u.data(), cols), cols, eps);
      } else {
        row_mean = lane_sum(u.data(), cols) / static_cast<float>(cols);
        const float var = lane_sum_of_centered_squares(u.data(), row_mean, cols) / static_cast<float>(cols);
        row_rstd = layer_norm_rstd(var, eps);
        mean_ptr[row] = row_mean;
      }
      rstd_ptr[row] = row_rstd;
      T* y_row = y_ptr + row * cols;
      for (int64_t c = 0; c < cols; ++c) {
        float v = (u[c] - row_mean) * row_rstd;
        if (weight) v *= w_f[c];
        if (bias) v += b_f[c];
        y_row[c] = static_cast<T>(v);
      }
    }
  });
}

// Weight-gradient partials: rows are split into a fixed number of contiguous chunks that depends
// only on the shape, each chunk sums into its own fp32 row, and the chunks are added in index
// order, so dw and db are bitwise identical whatever the thread count.
int64_t num_row_chunks(int64_t rows) { return std::min<int64_t>(rows, 32); }

template <typename T>
void norm_bwd_kernel(const at::Tensor& dy, const at::Tensor* dh, const at::Tensor& h,
                     const at::Tensor* weight, const float* mean_ptr, const float* rstd_ptr,
                     bool has_bias, bool is_rms, at::Tensor& dx, at::Tensor& dw, at::Tensor& db) {
  const int64_t rows = h.size(0), cols = h.size(1);
  const T* dy_ptr = dy.const_data_ptr<T>();
  const T* dh_ptr = dh ? dh->const_data_ptr<T>() : nullptr;
  const T* h_ptr = h.const_data_ptr<T>();
  const int64_t dy_stride = dy.stride(0), dh_stride = dh ? dh->stride(0) : 0, h_stride = h.stride(0);
  std::vector<float> w_f(weight ? cols : 0);
  if (weight) load_row(weight->contiguous().const_data_ptr<T>(), w_f.data(), cols);
  T* dx_ptr = dx.data_ptr<T>();
  const int64_t chunks = num_row_chunks(rows);
  std::vector<float> dw_partial(weight ? chunks * cols : 0, 0.f);
  std::vector<float> db_partial(has_bias ? chunks * cols : 0, 0.f);

  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<float> x_hat(cols), g(cols), dy_f(cols);
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t row_begin = rows * chunk / chunks, row_end = rows * (chunk + 1) / chunks;
      float* dw_row = weight ? dw_partial.data() + chunk * cols : nullptr;
      float* db_row = has_bias ? db_partial.data() + chunk * cols : nullptr;
      for (int64_t row = row_begin; row < row_end; ++row) {
        const float row_mean = is_rms ? 0.f : mean_ptr[row];
        const float row_rstd = rstd_ptr[row];
        const T* h_row = h_ptr + row * h_stride;
        load_row(dy_ptr + row * dy_stride, dy_f.data(), cols);
        for (int64_t c = 0; c < cols; ++c) {
          x_hat[c] = (static_cast<float>(h_row[c]) - row_mean) * row_rstd;
          g[c] = weight ? dy_f[c] * w_f[c] : dy_f[c];
        }
        const float inv_cols = 1.f / static_cast<float>(cols);
        const float mean_g_xhat = lane_sum_of_products(g.data(), x_hat.data(), cols) * inv_cols;
        const float mean_g = is_rms ? 0.f : lane_sum(g.data(), cols) * inv_cols;
        T* dx_row = dx_ptr + row * cols;
        const T* dh_row = dh_ptr ? dh_ptr + row * dh_stride : nullptr;
        for (int64_t c = 0; c < cols; ++c) {
          float v = row_rstd * (g[c] - x_hat[c] * mean_g_xhat - mean_g);
          if (dh_row) v += static_cast<float>(dh_row[c]);
          dx_row[c] = static_cast<T>(v);
        }
        if (dw_row)
          for (int64_t c = 0; c < cols; ++c) dw_row[c] += dy_f[c] * x_hat[c];
        if (db_row)
          for (int64_t c = 0; c < cols; ++c) db_row[c] += dy_f[c];
      }
    }
  });

  auto reduce_chunks = [&](const std::vector<float>& partial, at::Tensor& out) {
    T* out_ptr = out.data_ptr<T>();
    at::parallel_for(0, cols, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        float total = 0.f;
        for (int64_t chunk = 0; chunk < chunks; ++chunk) total += partial[chunk * cols + c];
        out_ptr[c] = static_cast<T>(total);
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
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor y = at::empty({rows, cols}, x.options());
  // Without a residual the saved input is x itself, and h is an empty placeholder.
  at::Tensor h = residual.has_value() ? at::empty({rows, cols}, x.options()) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({is_rms ? 0 : rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows > 0 && cols > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "norm_fwd_cpu", [&] {
      norm_fwd_kernel<scalar_t>(x, weight ? &*weight : nullptr, bias ? &*bias : nullptr,
                                residual ? &*residual : nullptr, static_cast<float>(eps), is_rms,
                                y, h, mean, rstd);
    });
  }
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& mean,
    const at::Tensor& rstd, bool has_bias, bool is_rms) {
  check_norm_bwd_args(dy, dh, h, weight, rstd);
  if (!is_rms) check_stats(*mean, "mean", h);
  TORCH_CHECK(h.device().is_cpu(), "h must be a CPU tensor");
  const int64_t rows = h.size(0), cols = h.size(1);
  at::Tensor dx = at::empty({rows, cols}, h.options());
  at::Tensor dw = at::empty({weight.has_value() ? cols : 0}, h.options());
  at::Tensor db = at::empty({has_bias ? cols : 0}, h.options());
  if (cols > 0 && rows == 0) {
    dw.zero_();
    db.zero_();
  }
  if (rows > 0 && cols > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "norm_bwd_cpu", [&] {
      norm_bwd_kernel<scalar_t>(dy, dh ? &*dh : nullptr, h, weight ? &*weight : nullptr,
                                is_rms ? nullptr : mean->const_data_ptr<float>(),
                                rstd.const_data_ptr<float>(), has_bias, is_rms, dx, dw, db);
    });
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
