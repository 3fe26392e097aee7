// Fused linear + cross-entropy on the CPU: per vocabulary chunk the logits come from ATen's GEMM
// (cross_entropy_glue.h; oneDNN/MKL, as F.linear), and this file's epilogues, parallel over rows,
// widen each row to fp32 (common/cpu_convert.h) and fold it into the running softmax statistics
// (forward) or overwrite it with the logit gradient (backward, cross_entropy_math.h's arithmetic,
// the CUDA kernels' too). Only one chunk of logits [T, C] exists at a time, in x's dtype, plus one
// fp32 row per thread.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "common/cpu_convert.h"
#include "cross_entropy/cross_entropy_glue.h"
#include "cross_entropy/cross_entropy_math.h"

namespace remat {
namespace {

// Rows per parallel task: each row is a full chunk (thousands of columns), so a few rows make a
// task worth scheduling.
constexpr int64_t kRowGrain = 4;

// Caps the fp32 row in place (z = softcap * tanh(z / softcap)); th receives the tanh.
REMAT_CPU_CLONES void cap_row(float* __restrict__ z, float* __restrict__ th, int64_t n, float softcap) {
  for (int64_t j = 0; j < n; ++j) z[j] = lce_cap(z[j], softcap, &th[j]);
}

REMAT_CPU_CLONES float row_max(const float* __restrict__ z, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, z[j]);
  return m;
}

REMAT_CPU_CLONES float sum_exp_minus(const float* __restrict__ z, int64_t n, float shift) {
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) s += std::exp(z[j] - shift);
  return s;
}

REMAT_CPU_CLONES float row_sum(const float* __restrict__ z, int64_t n) {
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) s += z[j];
  return s;
}

REMAT_CPU_CLONES void dlogit_row(float* __restrict__ z, const float* __restrict__ th, int64_t n, int64_t target_col,
                                 float lse, LceRowTerms terms, float softcap) {
  for (int64_t j = 0; j < n; ++j) z[j] = lce_dlogit(z[j], th[j], j == target_col, lse, terms, softcap);
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                                const c10::optional<at::Tensor>& bias,
                                                                const at::Tensor& target, int64_t ignore_index,
                                                                double label_smoothing, double softcap, double z_loss,
                                                                int64_t chunk) {
  check_lce_args(x, weight, bias, target, chunk);
  const int64_t tokens = x.size(0), vocab = weight.size(0);
  const LceCoefficients c = lce_coefficients(label_smoothing, vocab, z_loss, softcap);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor max_t = at::full({tokens}, -std::numeric_limits<float>::infinity(), f32);
  at::Tensor sum_exp_t = at::zeros({tokens}, f32), sum_z_t = at::zeros({tokens}, f32);
  at::Tensor z_target_t = at::zeros({tokens}, f32);
  float *m = max_t.data_ptr<float>(), *s = sum_exp_t.data_ptr<float>();
  float *sz = sum_z_t.data_ptr<float>(), *zt = z_target_t.data_ptr<float>();
  const at::Tensor target_c = target.contiguous();
  const int64_t* t = target_c.const_data_ptr<int64_t>();
  const Storage storage = storage_of(x.scalar_type());
  for_each_logits_chunk(x, weight, bias, chunk, [&](const at::Tensor& logits, int64_t start) {
    const int64_t width = logits.size(1), element = logits.element_size();
    const char* src = static_cast<const char*>(logits.const_data_ptr());
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> z(width), th(width);
      for (int64_t r = begin; r < end; ++r) {
        widen(src + r * width * element, z.data(), width, storage);
        if (c.softcap > 0.0f) cap_row(z.data(), th.data(), width, c.softcap);
        // The torch backend's order: the new max first, then the chunk's exps against it.
        const float new_max = std::max(m[r], row_max(z.data(), width));
        s[r] = s[r] * std::exp(m[r] - new_max) + sum_exp_minus(z.data(), width, new_max);
        m[r] = new_max;
        if (c.smoothing) sz[r] += row_sum(z.data(), width);
        if (t[r] >= start && t[r] < start + width) zt[r] += z[t[r] - start];
      }
    });
  });
  at::Tensor loss = at::empty({tokens}, f32), lse = at::empty({tokens}, f32);
  float *loss_p = loss.data_ptr<float>(), *lse_p = lse.data_ptr<float>();
  for (int64_t r = 0; r < tokens; ++r) {
    lse_p[r] = m[r] + std::log(s[r]);
    loss_p[r] = t[r] != ignore_index ? lce_token_loss(lse_p[r], zt[r], sz[r], c) : 0.0f;
  }
  return {loss, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& target,
    const at::Tensor& lse, const at::Tensor& grad_loss, const c10::optional<at::Tensor>& grad_lse,
    int64_t ignore_index, double label_smoothing, double softcap, double z_loss, int64_t chunk, bool need_dx,
    bool need_dw, bool need_db) {
  check_lce_args(x, weight, bias, target, chunk);
  check_lce_row_vector(lse, "lse", x);
  check_lce_row_vector(grad_loss, "grad_loss", x);
  if (grad_lse.has_value()) check_lce_row_vector(*grad_lse, "grad_lse", x);
  const int64_t tokens = x.size(0), vocab = weight.size(0);
  const LceCoefficients c = lce_coefficients(label_smoothing, vocab, z_loss, softcap);
  const at::Tensor target_c = target.contiguous(), lse_c = lse.contiguous(), grad_c = grad_loss.contiguous();
  const at::Tensor grad_lse_c = grad_lse.has_value() ? grad_lse->contiguous() : at::Tensor();
  const int64_t* t = target_c.const_data_ptr<int64_t>();
  const float* lse_p = lse_c.const_data_ptr<float>();
  std::vector<LceRowTerms> terms(tokens);
  for (int64_t r = 0; r < tokens; ++r) {
    const float g = t[r] != ignore_index ? grad_c.const_data_ptr<float>()[r] : 0.0f;
    terms[r] = lce_row_terms(g, lse_p[r], grad_lse_c.defined() ? grad_lse_c.const_data_ptr<float>()[r] : 0.0f, c);
  }
  LceGradients grads(x, weight, bias, need_dx, need_dw, need_db, chunk);
  const Storage storage = storage_of(x.scalar_type());
  for_each_logits_chunk(x, weight, bias, chunk, [&](const at::Tensor& logits, int64_t start) {
    const int64_t width = logits.size(1), element = logits.element_size();
    char* data = static_cast<char*>(logits.data_ptr());
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> z(width), th(width);
      for (int64_t r = begin; r < end; ++r) {
        char* row = data + r * width * element;
        widen(row, z.data(), width, storage);
        if (c.softcap > 0.0f) cap_row(z.data(), th.data(), width, c.softcap);
        dlogit_row(z.data(), th.data(), width, t[r] - start, lse_p[r], terms[r], c.softcap);
        narrow(z.data(), row, width, storage);
      }
    });
    grads.add_chunk(logits, x, weight, start);
  });
  return grads.finish(x);
}

}  // namespace

// fp32 copies of the operands, multiplied by ATen's fp32 GEMM: exact products (a 16-bit value is an
// fp32 value) accumulated in fp32, as a 16-bit GEMM accumulates before it rounds. ATen's CPU GEMMs
// have no fp32 output for 16-bit inputs (and oneDNN's bf16 GEMM with an fp32 output is not
// exported). The copies are made in blocks of kDxBlock rows of w_chunk (columns of dz), fewer
// when T C / H is smaller, so that no copy is larger than an fp32 chunk of logits [T, C]; at T = 1024,
// H = 512 and 16384-column chunks the copies then take 12 MiB instead of 96. Widened by
// common/cpu_convert.h on the calling thread: memory-bound, and an at::parallel_for here, between
// MKL's GEMMs, was measured 5-30x slower than the serial loop on the 2-core build machine.
// The cost: ATen's fp32 GEMM (MKL) ran 2-4x slower than its bf16 GEMM (oneDNN, AVX512-BF16) there,
// which is what several 16-bit chunks cost on the CPU; one chunk takes the 16-bit GEMM itself
// (LceGradients).
constexpr int64_t kDxBlock = 2048;

void accumulate_dx_cpu_16bit(at::Tensor& dx_acc, const at::Tensor& dz, const at::Tensor& w_chunk) {
  const int64_t tokens = dz.size(0), columns = dz.size(1), hidden = std::max<int64_t>(w_chunk.size(1), 1);
  const int64_t block = std::max<int64_t>(1, std::min({columns, kDxBlock, tokens * columns / hidden}));
  const Storage storage = storage_of(dz.scalar_type());
  const at::Tensor w_c = w_chunk.contiguous();
  at::Tensor dz_f = at::empty({tokens, block}, dx_acc.options());
  at::Tensor w_f = at::empty({block, hidden}, dx_acc.options());
  const char* dz_src = static_cast<const char*>(dz.const_data_ptr());
  const char* w_src = static_cast<const char*>(w_c.const_data_ptr());
  const int64_t element = dz.element_size(), dz_row = dz.stride(0);
  for (int64_t k = 0; k < columns; k += block) {
    const int64_t width = std::min(block, columns - k);
    at::Tensor dz_block = dz_f.narrow(1, 0, width), w_block = w_f.narrow(0, 0, width);
    float* dz_dst = dz_f.data_ptr<float>();
    float* w_dst = w_f.data_ptr<float>();
    for (int64_t r = 0; r < tokens; ++r) {
      widen(dz_src + (r * dz_row + k) * element, dz_dst + r * block, width, storage);
    }
    for (int64_t r = 0; r < width; ++r) {
      widen(w_src + (k + r) * hidden * element, w_dst + r * hidden, hidden, storage);
    }
    dx_acc.addmm_(dz_block, w_block);
  }
}

TORCH_LIBRARY_IMPL(remat, CPU, m) {
  m.impl("linear_cross_entropy_fwd", &linear_cross_entropy_fwd_cpu);
  m.impl("linear_cross_entropy_bwd", &linear_cross_entropy_bwd_cpu);
}

}  // namespace remat
