// ATen side of the fused linear + cross-entropy, shared by the CPU and CUDA operators (g++ only):
// argument checks, the loop over vocabulary chunks whose logits come from one ATen GEMM each
// (cuBLAS on GPUs, oneDNN/MKL on CPUs, exactly as F.linear computes them), and the backward's
// GEMMs. The epilogues (softmax statistics, logit gradient) are each device's own kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <tuple>

#include "cross_entropy/cross_entropy_math.h"

namespace remat {

inline void check_lce_args(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           const at::Tensor& target, int64_t chunk) {
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1), "x must be [T, H] with unit column stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.size(0) >= 1,
              "weight must be [V >= 1, H=", x.size(1), "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
              "weight must have x's dtype and device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "bias must be [", weight.size(0), "]");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->device() == x.device(),
                "bias must have x's dtype and device");
  }
  TORCH_CHECK(target.dim() == 1 && target.size(0) == x.size(0) && target.scalar_type() == at::kLong &&
                  target.device() == x.device(),
              "target must be int64 [", x.size(0), "] on x's device");
  TORCH_CHECK(chunk >= 1, "chunk must be >= 1, got ", chunk);
}

inline void check_lce_row_vector(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(0) && t.scalar_type() == at::kFloat && t.device() == x.device(),
              name, " must be float32 [", x.size(0), "] on x's device");
}

// Calls epilogue(logits, start) for each vocabulary chunk [start, start + logits.size(1)), logits
// = x W_chunk^T (+ b_chunk) [T, width], contiguous, in x's dtype: the GEMM F.linear runs (addmm
// with the bias), written into one buffer of T * chunk elements that every chunk reuses.
template <class Epilogue>
void for_each_logits_chunk(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           int64_t chunk, Epilogue&& epilogue) {
  const int64_t tokens = x.size(0), vocab = weight.size(0);
  chunk = std::min(chunk, vocab);
  at::Tensor buffer = at::empty({tokens * chunk}, x.options());
  for (int64_t start = 0; start < vocab; start += chunk) {
    const int64_t width = std::min(chunk, vocab - start);
    at::Tensor logits = buffer.narrow(0, 0, tokens * width).view({tokens, width});
    const at::Tensor w_chunk = weight.narrow(0, start, width);
    if (bias.has_value()) {
      at::addmm_out(logits, bias->narrow(0, start, width), x, w_chunk.t());
    } else {
      at::mm_out(logits, x, w_chunk.t());
    }
    epilogue(logits, start);
  }
}

// dx_acc += dz @ w_chunk for 16-bit dz and w_chunk on the CPU, accumulated in fp32
// (cross_entropy_cpu.cpp).
void accumulate_dx_cpu_16bit(at::Tensor& dx_acc, const at::Tensor& dz, const at::Tensor& w_chunk);

// dx_acc (fp32 [T, H]) += dz [T, C] @ w_chunk [C, H], accumulated in fp32 and never rounded to
// dz's dtype (a 16-bit GEMM's output would be, once per chunk): fp32 adds in place; 16-bit on a
// GPU runs cuBLAS with an fp32 output (into `scratch`, [T, H] fp32, then added); 16-bit on the
// CPU, where ATen has no GEMM with an fp32 output, see accumulate_dx_cpu_16bit.
inline void accumulate_dx(at::Tensor& dx_acc, const at::Tensor& dz, const at::Tensor& w_chunk, at::Tensor& scratch) {
  if (dz.scalar_type() == at::kFloat) {
    dx_acc.addmm_(dz, w_chunk);
  } else if (dz.is_cuda()) {
    if (!scratch.defined()) scratch = at::empty(dx_acc.sizes(), dx_acc.options());
    at::mm_out(scratch, dz, w_chunk, at::kFloat);
    dx_acc.add_(scratch);
  } else {
    accumulate_dx_cpu_16bit(dx_acc, dz, w_chunk);
  }
}

// The backward's GEMMs for one chunk whose gradient dz [T, width] (x's dtype) is known: the
// chunk's rows of dW = dz^T x and of db = column sums of dz (one GEMM / sum each, rounded once, as
// F.linear's backward), and its term of dx. When one chunk holds the whole vocabulary, dx is the
// single GEMM dz @ W in x's dtype (F.linear's backward itself); else the chunks' terms are summed
// in fp32 (accumulate_dx) and rounded once at the end.
struct LceGradients {
  at::Tensor dx_acc, dx_direct, dw, db, scratch;
  bool need_dx, need_dw, need_db, one_chunk;

  LceGradients(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool need_dx_,
               bool need_dw_, bool need_db_, int64_t chunk)
      : need_dx(need_dx_), need_dw(need_dw_), need_db(need_db_ && bias.has_value()),
        one_chunk(chunk >= weight.size(0)) {
    dx_acc = need_dx && !one_chunk ? at::zeros(x.sizes(), x.options().dtype(at::kFloat)) : at::Tensor();
    dw = need_dw ? at::empty(weight.sizes(), weight.options()) : at::empty({0}, weight.options());
    db = need_db ? at::empty({weight.size(0)}, bias->options()) : at::empty({0}, x.options());
  }

  void add_chunk(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& weight, int64_t start) {
    const int64_t width = dz.size(1);
    if (need_dw) {
      at::Tensor rows = dw.narrow(0, start, width);
      at::mm_out(rows, dz.t(), x);
    }
    if (need_db) {
      at::Tensor rows = db.narrow(0, start, width);
      at::sum_out(rows, dz, {0});
    }
    if (need_dx && one_chunk) {
      dx_direct = at::mm(dz, weight);
    } else if (need_dx && dz.size(0) > 0) {
      accumulate_dx(dx_acc, dz, weight.narrow(0, start, width), scratch);
    }
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> finish(const at::Tensor& x) {
    if (!need_dx) return {at::empty({0}, x.options()), dw, db};
    return {one_chunk ? dx_direct : dx_acc.to(x.scalar_type()), dw, db};
  }
};

}  // namespace remat
