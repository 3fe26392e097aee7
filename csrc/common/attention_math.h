// Per-element attention math shared by the CUDA and C++ CPU flash-attention kernels: which keys a
// query sees, the softcap transform and its derivative, rotary embedding, and the online-softmax
// update in the exp2 domain. Triton (kernels/attention.py) and the torch backend follow the same
// definitions.
#pragma once

#include <cmath>
#include <cstdint>

#include "math.h"

namespace remat {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Query row i sits at position i + shift, shift = M - N (bottom-right alignment: the last query
// is aligned with the last key, as in FlashAttention >= 2.1). It sees key j when
// j >= pos - left (left < 0: unbounded) and j <= pos + right (right < 0: unbounded). Causal is
// right = 0.
inline REMAT_HOST_DEVICE bool attention_key_visible(int64_t i, int64_t j, int64_t shift,
                                                    int64_t left, int64_t right) {
  const int64_t pos = i + shift;
  return (left < 0 || j >= pos - left) && (right < 0 || j <= pos + right);
}

// Logit in natural units from the fp32 dot product: scale * dot, or, with softcap > 0,
// softcap * tanh(scale * dot / softcap) (Gemma 2).
inline REMAT_HOST_DEVICE float attention_logit(float dot, float scale, float softcap) {
  if (softcap > 0.0f) return softcap * tanhf(dot * scale / softcap);
  return dot * scale;
}

// d logit / d dot, evaluated from the logit itself: scale * (1 - (logit / softcap)^2) with
// softcap, scale without.
inline REMAT_HOST_DEVICE float attention_logit_grad(float logit, float scale, float softcap) {
  if (softcap > 0.0f) {
    const float t = logit / softcap;
    return scale * (1.0f - t * t);
  }
  return scale;
}

// Rotary embedding, rotate-half convention (Llama, GPT-NeoX): the pair (x1, x2) = (x[d],
// x[d + D/2]) becomes (x1 cos - x2 sin, x2 cos + x1 sin).
inline REMAT_HOST_DEVICE void rope_rotate(float x1, float x2, float c, float s, float& y1,
                                          float& y2) {
  y1 = x1 * c - x2 * s;
  y2 = x2 * c + x1 * s;
}

// The transpose of rope_rotate, which maps the gradient of the rotated pair back to the input.
inline REMAT_HOST_DEVICE void rope_rotate_grad(float g1, float g2, float c, float s, float& dx1,
                                               float& dx2) {
  dx1 = g1 * c + g2 * s;
  dx2 = g2 * c - g1 * s;
}

// max(a, b) that is NaN when either operand is (fmaxf and std::max return the other operand).
inline REMAT_HOST_DEVICE float max_keeping_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// Whether a softmax row with this final sum saw no key (or only keys of logit -inf): its output is
// then exactly 0, whatever its accumulator holds (a key the row does not see, in a tile it shares
// with rows that see it, still adds 0 * v, NaN when v is NaN or infinite), and its lse +inf. The
// test is sum == 0, not sum > 0: a NaN sum (a NaN or +inf logit, see OnlineSoftmax) fails sum > 0
// and would turn a poisoned row into an empty one (o = 0, lse = +inf) where stock's softmax gives
// NaN.
inline REMAT_HOST_DEVICE bool softmax_row_empty(float sum) { return sum == 0.0f; }

// Running max and sum of one softmax row in the exp2 domain (logits times log2 e). Masked keys are
// skipped by the caller, so an empty row keeps max = -inf and sum = 0.
//
// Non-finite logits propagate as in stock's softmax (exp(t - max) / sum, NaN for the whole row):
// a NaN logit gets the weight exp2(NaN - max) = NaN and a +inf one (which raises the max to +inf)
// exp2(inf - inf) = NaN, so the sum is NaN and with it the row's output (acc / sum) and lse; every
// later rescale keeps them NaN (NaN * factor). A -inf logit weighs 0, as a masked key does. The
// running max may lose a NaN (fmaxf returns the other operand): the NaN weight is what carries it.
struct OnlineSoftmax {
  float max_log2 = -INFINITY;
  float sum = 0.0f;

  // Raises the running max to cover a new tile whose largest exp2-domain logit is tile_max, and
  // returns the factor by which the accumulated sum and output must be scaled.
  inline REMAT_HOST_DEVICE float rescale_for(float tile_max) {
    const float new_max = fmaxf(max_log2, tile_max);
    const float factor = (new_max == -INFINITY) ? 1.0f : exp2f(max_log2 - new_max);
    max_log2 = new_max;
    sum *= factor;
    return factor;
  }

  // exp2(logit_log2 - max), the unnormalised probability of one visible key.
  inline REMAT_HOST_DEVICE float weight(float logit_log2) const { return exp2f(logit_log2 - max_log2); }

  // Natural-log logsumexp of the row: +inf for a row that saw no key (its output is 0 and its
  // probabilities exp(logit - inf) are 0 in backward), NaN for a row with a NaN or +inf logit (its
  // probabilities in backward are then NaN throughout, as stock's softmax of such a row).
  inline REMAT_HOST_DEVICE float lse() const {
    return softmax_row_empty(sum) ? INFINITY : (max_log2 + log2f(sum)) * kLn2;
  }
};

}  // namespace remat
