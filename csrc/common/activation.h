// Activation functions and their derivatives in fp32, shared by the CUDA kernels and the C++ CPU
// kernels (and mirrored by the Triton kernels), so every backend computes the same arithmetic.
#pragma once

#include <cmath>

#include "common/math.h"

namespace remat {

enum class Activation { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

inline REMAT_HOST_DEVICE float exp_f(float v) { return expf(v); }

// silu(g) = g * sigmoid(g).
inline REMAT_HOST_DEVICE float silu(float g) { return g / (1.f + exp_f(-g)); }

// d/dg silu(g) = s * (1 + g * (1 - s)), s = sigmoid(g).
inline REMAT_HOST_DEVICE float silu_grad(float g) {
  const float s = 1.f / (1.f + exp_f(-g));
  return s * (1.f + g * (1.f - s));
}

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhCoeff = 0.044715f;

// gelu(g) = g * Phi(g), exact (erf) form, as torch.nn.functional.gelu(approximate="none").
inline REMAT_HOST_DEVICE float gelu(float g) { return 0.5f * g * (1.f + erff(g * kInvSqrt2)); }

// d/dg gelu(g) = Phi(g) + g * phi(g).
inline REMAT_HOST_DEVICE float gelu_grad(float g) {
  const float cdf = 0.5f * (1.f + erff(g * kInvSqrt2));
  const float pdf = kInvSqrt2Pi * exp_f(-0.5f * g * g);
  return cdf + g * pdf;
}

// gelu with the tanh approximation, as torch.nn.functional.gelu(approximate="tanh").
inline REMAT_HOST_DEVICE float gelu_tanh(float g) {
  const float inner = kSqrt2OverPi * (g + kGeluTanhCoeff * g * g * g);
  return 0.5f * g * (1.f + tanhf(inner));
}

inline REMAT_HOST_DEVICE float gelu_tanh_grad(float g) {
  const float inner = kSqrt2OverPi * (g + kGeluTanhCoeff * g * g * g);
  const float t = tanhf(inner);
  const float d_inner = kSqrt2OverPi * (1.f + 3.f * kGeluTanhCoeff * g * g);
  return 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * d_inner;
}

inline REMAT_HOST_DEVICE float activate(Activation kind, float g) {
  switch (kind) {
    case Activation::kSilu: return silu(g);
    case Activation::kGelu: return gelu(g);
    default: return gelu_tanh(g);
  }
}

inline REMAT_HOST_DEVICE float activate_grad(Activation kind, float g) {
  switch (kind) {
    case Activation::kSilu: return silu_grad(g);
    case Activation::kGelu: return gelu_grad(g);
    default: return gelu_tanh_grad(g);
  }
}

}  // namespace remat
