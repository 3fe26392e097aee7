// Per-element and per-token arithmetic of the fused linear + cross-entropy, shared by the CUDA
// kernels and the C++ CPU kernels (host and device), in the order of remat.ops.cross_entropy's
// torch backend: logits capped in fp32, softmax from the saved lse, the gradient formed in fp32
// and rounded once by the caller.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/math.h"

namespace remat {

// Coefficients computed once on the host, in double and then rounded to float, as PyTorch rounds a
// Python number multiplying an fp32 tensor: 1 - eps, eps / V, z_loss and 2 z_loss.
struct LceCoefficients {
  float one_minus_eps;
  float eps_over_vocab;
  float z_loss;
  float two_z_loss;
  float softcap;  // 0: off
  bool smoothing;
};

inline LceCoefficients lce_coefficients(double smoothing, int64_t vocab, double z_loss, double softcap) {
  return {static_cast<float>(1.0 - smoothing), static_cast<float>(smoothing / static_cast<double>(vocab)),
          static_cast<float>(z_loss), static_cast<float>(2.0 * z_loss), static_cast<float>(softcap),
          smoothing > 0.0};
}

// The capped logit softcap * tanh(z / softcap) of an fp32 logit (z itself without softcap); *th
// receives the tanh, whose square the derivative needs.
inline REMAT_HOST_DEVICE float lce_cap(float z, float softcap, float* th) {
  if (softcap > 0.0f) {
    const float t = tanhf(z / softcap);
    *th = t;
    return t * softcap;
  }
  *th = 0.0f;
  return z;
}

// A token's loss from its logsumexp, target logit and (with smoothing) sum of logits:
// lse - (1 - eps) z_t - (eps / V) sum_j z_j + z_loss lse^2.
inline REMAT_HOST_DEVICE float lce_token_loss(float lse, float z_target, float sum_z, const LceCoefficients& c) {
  float loss = lse - c.one_minus_eps * z_target;
  if (c.smoothing) loss = loss - c.eps_over_vocab * sum_z;
  if (c.z_loss > 0.0f) loss = loss + c.z_loss * lse * lse;
  return loss;
}

// Per-token terms of the logit gradient, from g (the token's loss gradient, 0 if ignored), its lse
// and the gradient of the returned lse (0 if unused): dz_j = p_j scale - smooth - hit [j == t].
struct LceRowTerms {
  float scale;
  float smooth;
  float hit;
};

inline REMAT_HOST_DEVICE LceRowTerms lce_row_terms(float g, float lse, float grad_lse, const LceCoefficients& c) {
  float scale = c.z_loss > 0.0f ? g * (1.0f + c.two_z_loss * lse) : g;
  scale = scale + grad_lse;
  return {scale, g * c.eps_over_vocab, g * c.one_minus_eps};
}

// d loss / d raw logit for one column, in fp32: p scale - smooth - hit [target], times
// 1 - tanh^2 under softcap. z is the capped logit, th its tanh.
inline REMAT_HOST_DEVICE float lce_dlogit(float z, float th, bool is_target, float lse, const LceRowTerms& r,
                                          float softcap) {
  float dz = expf(z - lse) * r.scale;
  dz = dz - r.smooth;
  if (is_target) dz = dz - r.hit;
  if (softcap > 0.0f) dz = dz * (1.0f - th * th);
  return dz;
}

}  // namespace remat
