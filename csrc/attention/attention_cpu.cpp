// C++ CPU flash attention: the blocked algorithm of the GPU kernels with the same recompute
// contract. The forward keeps a running max and sum per query row over key tiles (online softmax,
// exp2 domain) and never forms the N x M probabilities; it returns o and the fp32 logsumexp. The
// backward recomputes each probability tile from q, k and lse (and the dropout mask from the
// Philox seed and offset), in two passes with no shared accumulators, so it is deterministic: one
// over key blocks for dk and dv, one over query blocks for dq.
//
// Per-element math (visibility, softcap, rope, online softmax, Philox) comes from
// common/attention_math.h and common/philox.h, which the CUDA kernels use too. Rounding points
// follow the GPU kernels: rotated q and k, the probabilities before the PV product, and dS before
// the dq/dk products are rounded to the input dtype; everything accumulates in fp32.
//
// Inputs are first widened (and rotated) into fp32 working copies laid out [batch, head, row, Dp]
// (Dp: D padded with zeros to a multiple of 16), plus k and v transposed to [batch, head, Dp, Mp]
// (Mp: M padded to a multiple of 64), so every tile product is one register-blocked loop over
// contiguous fp32 rows. Those copies are temporaries of the call, never saved.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <tuple>
#include <vector>

#include "attention/attention_checks.h"
#include "common/attention_math.h"
#include "common/cpu_convert.h"
#include "common/philox.h"

namespace remat {
namespace {

// 32 query rows x 64 keys: an fp32 score tile of 8 KB plus the matching probability tile stay in
// L1 next to a 64-row slice of k and v at head dim 64. Key tiles start at multiples of 64.
constexpr int64_t kBlockQ = 32;
constexpr int64_t kBlockK = 64;

float round_to_storage(float value, Storage storage) {
  switch (storage) {
    case Storage::kFloat16: return static_cast<float>(static_cast<_Float16>(value));
    case Storage::kBFloat16: return std::bit_cast<float>(static_cast<uint32_t>(round_to_bf16(value)) << 16);
    default: return value;
  }
}

// Tile products run through one register-blocked kernel: out[rows x width] += A[rows x inner] *
// B[inner x width], width a multiple of 16. A block of 4 output rows x 16 columns (8 vector
// registers of 8 floats) stays in registers across the whole inner loop, so each step is 2 loads
// of B, 4 broadcasts of A and 8 multiply-adds. A is read with strides, so the same kernel also
// multiplies by a transposed tile (dv = P^T dout, dk = dS^T q). GCC vector types make the blocking
// explicit (its auto-vectoriser scalarised the plain-array version: 13 vs 59 GFLOP/s on one core).
constexpr int64_t kColumnBlock = 16;
typedef float Vec8 __attribute__((vector_size(32), aligned(4), may_alias));

template <int kRows>
[[gnu::always_inline]] inline void product_block(const float* __restrict__ a, int64_t a_row, int64_t a_col,
                                                 const float* __restrict__ b, int64_t ldb, int64_t inner,
                                                 float* __restrict__ out, int64_t ldo) {
  Vec8 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = *reinterpret_cast<const Vec8*>(out + r * ldo);
    acc[r][1] = *reinterpret_cast<const Vec8*>(out + r * ldo + 8);
  }
  for (int64_t k = 0; k < inner; ++k) {
    const Vec8 b_low = *reinterpret_cast<const Vec8*>(b + k * ldb);
    const Vec8 b_high = *reinterpret_cast<const Vec8*>(b + k * ldb + 8);
    for (int r = 0; r < kRows; ++r) {
      const float a_value = a[r * a_row + k * a_col];
      acc[r][0] += a_value * b_low;
      acc[r][1] += a_value * b_high;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    *reinterpret_cast<Vec8*>(out + r * ldo) = acc[r][0];
    *reinterpret_cast<Vec8*>(out + r * ldo + 8) = acc[r][1];
  }
}

// out[r][c] += sum_k a[r * a_row + k * a_col] * b[k * ldb + c] for r < rows, c < width, k < inner.
REMAT_CPU_CLONES void product_accumulate(const float* a, int64_t a_row, int64_t a_col, int64_t rows, const float* b,
                                         int64_t ldb, int64_t inner, int64_t width, float* out, int64_t ldo) {
  for (int64_t c0 = 0; c0 < width; c0 += kColumnBlock) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      product_block<4>(a + r * a_row, a_row, a_col, b + c0, ldb, inner, out + r * ldo + c0, ldo);
    for (; r < rows; ++r) product_block<1>(a + r * a_row, a_row, a_col, b + c0, ldb, inner, out + r * ldo + c0, ldo);
  }
}

// factors[c] = keep_scale or 0 (dropout keeps or drops) for the kBlockK consecutive elements of a
// stream row from the group of `first_counter` on: kBlockK / 4 Philox calls, all four words used.
REMAT_CPU_CLONES void dropout_factors(uint64_t seed, uint64_t first_counter, float p, float keep_scale,
                                      float* __restrict__ factors) {
  static_assert(kBlockK % kPhiloxWords == 0, "key tiles must hold whole Philox groups");
  uint32_t words[kBlockK];
  philox_stream_block(words, kBlockK / kPhiloxWords, seed, first_counter);
  for (int64_t c = 0; c < kBlockK; ++c) factors[c] = dropout_keeps(words[c], p) ? keep_scale : 0.0f;
}

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

struct Problem {
  int64_t batch, n, m, hq, hkv, head_dim, group, shift;
  int64_t left, right;
  float scale, softcap, dropout_p, keep_scale;
  bool dropout;
  uint64_t seed, offset;
  Storage storage;
  // The dropout stream's rows (common/philox.h): element (b, h, i, j) is element j of row
  // ((b + drop_batch) * hq + h) * drop_rows + i, rows of drop_cols elements. Dense calls: (0, N, M).
  // A sequence s of a packed call: (s, max_seqlen_q, max_seqlen_k), the zero-padded batch's stream.
  int64_t drop_batch, drop_rows, drop_cols;

  // The key range [lo, hi) that any of query rows [i0, i1) can see.
  std::pair<int64_t, int64_t> key_range(int64_t i0, int64_t i1) const {
    const int64_t lo = left < 0 ? 0 : std::max<int64_t>(0, i0 + shift - left);
    const int64_t hi = right < 0 ? m : std::min<int64_t>(m, i1 - 1 + shift + right + 1);
    return {lo, std::max(lo, hi)};
  }
  // The query range [lo, hi) whose rows see any of keys [j0, j1).
  std::pair<int64_t, int64_t> query_range(int64_t j0, int64_t j1) const {
    const int64_t lo = right < 0 ? 0 : std::max<int64_t>(0, j0 - shift - right);
    const int64_t hi = left < 0 ? n : std::min<int64_t>(n, j1 - 1 - shift + left + 1);
    return {lo, std::max(lo, hi)};
  }
  // factors[c] for the kBlockK keys j0 + c of query row (b, h, i), j0 a multiple of kBlockK: 1/(1-p)
  // where the dropout mask keeps the element, 0 where it drops it, 1 without dropout. One Philox
  // call per four keys; keys past M draw words no element uses.
  void keep_factors(int64_t b, int64_t h, int64_t i, int64_t j0, float* factors) const {
    if (!dropout) {
      std::fill(factors, factors + kBlockK, 1.0f);
      return;
    }
    const uint64_t row = static_cast<uint64_t>(((b + drop_batch) * hq + h) * drop_rows + i);
    dropout_factors(seed, stream_counter(offset, row, static_cast<uint64_t>(j0), static_cast<uint64_t>(drop_cols)),
                    dropout_p, keep_scale, factors);
  }
};

struct Rope {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t batch_stride = 0, rows = 0, half = 0;

  const float* cos_row(int64_t b, int64_t pos) const { return cos + b * batch_stride + pos * half; }
  const float* sin_row(int64_t b, int64_t pos) const { return sin + b * batch_stride + pos * half; }
};

Rope make_rope(const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
  Rope rope;
  if (!cos.has_value()) return rope;
  rope.cos = cos->const_data_ptr<float>();
  rope.sin = sin->const_data_ptr<float>();
  rope.rows = cos->size(1);
  rope.half = cos->size(2);
  rope.batch_stride = cos->size(0) == 1 ? 0 : rope.rows * rope.half;
  return rope;
}

Problem make_problem(const at::Tensor& q, const at::Tensor& k, const c10::optional<at::Tensor>& rng, double scale,
                     double softcap, int64_t window_left, int64_t window_right, double dropout_p) {
  Problem p;
  p.batch = q.size(0);
  p.n = q.size(1);
  p.hq = q.size(2);
  p.head_dim = q.size(3);
  p.m = k.size(1);
  p.hkv = k.size(2);
  p.group = p.hq / p.hkv;
  p.shift = p.m - p.n;
  p.left = window_left;
  p.right = window_right;
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.dropout_p = static_cast<float>(dropout_p);
  p.keep_scale = 1.0f / (1.0f - p.dropout_p);
  p.dropout = dropout_p > 0;
  p.seed = p.offset = 0;
  if (p.dropout) {
    const int64_t* state = rng->const_data_ptr<int64_t>();
    p.seed = static_cast<uint64_t>(state[0]);
    p.offset = static_cast<uint64_t>(state[1]);
  }
  p.storage = storage_of(q.scalar_type());
  p.drop_batch = 0;
  p.drop_rows = p.n;
  p.drop_cols = p.m;
  return p;
}

// fp32 copy [B, H, L, Dp] of x [B, L, H, D] (any strides, unit last stride), Dp = D rounded up to
// 16 with zero columns. With rope, row l is rotated at position l + first_position and rounded to
// x's dtype, as the GPU kernels' operands are.
std::vector<float> load_rows(const at::Tensor& x, const Rope& rope, int64_t first_position, Storage storage,
                             int64_t padded_dim) {
  const int64_t batch = x.size(0), length = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const int64_t element = x.element_size();
  std::vector<float> out(batch * heads * length * padded_dim, 0.0f);
  const char* base = static_cast<const char*>(x.const_data_ptr());
  at::parallel_for(0, batch * heads * length, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t l = row % length, h = (row / length) % heads, b = row / (length * heads);
      const char* src = base + (b * x.stride(0) + l * x.stride(1) + h * x.stride(2)) * element;
      float* dst = out.data() + row * padded_dim;
      widen(src, dst, head_dim, storage);
      if (rope.cos == nullptr) continue;
      const int64_t half = head_dim / 2, rope_b = rope.batch_stride == 0 ? 0 : b;
      const float* c = rope.cos_row(rope_b, l + first_position);
      const float* s = rope.sin_row(rope_b, l + first_position);
      for (int64_t d = 0; d < half; ++d) {
        float y1, y2;
        rope_rotate(dst[d], dst[d + half], c[d], s[d], y1, y2);
        dst[d] = round_to_storage(y1, storage);
        dst[d + half] = round_to_storage(y2, storage);
      }
    }
  });
  return out;
}

// [G, L, Dp] -> [G, Dp, Lp] with Lp = L rounded up to kBlockK (zero columns), so a 64-key tile
// starting at a multiple of 64 never reads past a head.
std::vector<float> transpose_rows(const std::vector<float>& rows, int64_t groups, int64_t length, int64_t padded_dim,
                                  int64_t padded_length) {
  std::vector<float> out(groups * padded_dim * padded_length, 0.0f);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t l = 0; l < length; ++l)
        for (int64_t d = 0; d < padded_dim; ++d)
          out[(g * padded_dim + d) * padded_length + l] = rows[(g * length + l) * padded_dim + d];
  });
  return out;
}

// Writes fp32 row `values` (rope gradient undone at `position` when rope is on) into dst.
void store_row(float* values, const Rope& rope, int64_t b, int64_t position, int64_t head_dim, void* dst,
               Storage storage) {
  if (rope.cos != nullptr) {
    const int64_t half = head_dim / 2, rope_b = rope.batch_stride == 0 ? 0 : b;
    const float* c = rope.cos_row(rope_b, position);
    const float* s = rope.sin_row(rope_b, position);
    for (int64_t d = 0; d < half; ++d) {
      float dx1, dx2;
      rope_rotate_grad(values[d], values[d + half], c[d], s[d], dx1, dx2);
      values[d] = dx1;
      values[d + half] = dx2;
    }
  }
  narrow(values, dst, head_dim, storage);
}

// Working layout of one call: padded head dim and key count, and the 64-aligned key range.
struct Layout {
  int64_t dim, keys;  // Dp (multiple of 16), Mp (multiple of kBlockK)
};

Layout make_layout(const Problem& p) { return {round_up(p.head_dim, kColumnBlock), round_up(p.m, kBlockK)}; }

// scores[r][c] = q_r . k_(j0 + c) for a full 64-key tile (j0 a multiple of 64).
void score_tile(const float* q_rows, int64_t rows, const float* k_transposed, int64_t j0, const Layout& layout,
                float* scores) {
  std::fill(scores, scores + rows * kBlockK, 0.0f);
  product_accumulate(q_rows, layout.dim, 1, rows, k_transposed + j0, layout.keys, layout.dim, kBlockK, scores,
                     kBlockK);
}

// The forward of one problem: q [B, N, Hq, D], k, v [B, M, Hkv, D] (views, any strides with a unit
// last stride). Writes o at o_base as a contiguous [B, N, Hq, D] block and lse at
// lse_base[(b * Hq + h) * lse_head_stride + i].
void forward_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Rope& rope, const Problem& p,
                  char* o_base, float* lse_base, int64_t lse_head_stride) {
  const Layout layout = make_layout(p);
  const int64_t D = p.head_dim, Dp = layout.dim;
  const int64_t o_element = q.element_size();
  const std::vector<float> qf = load_rows(q, rope, p.shift, p.storage, Dp);
  const std::vector<float> kt =
      transpose_rows(load_rows(k, rope, 0, p.storage, Dp), p.batch * p.hkv, p.m, Dp, layout.keys);
  const std::vector<float> vf = load_rows(v, Rope{}, 0, p.storage, Dp);
  const int64_t q_blocks = (p.n + kBlockQ - 1) / kBlockQ;

  at::parallel_for(0, p.batch * p.hq * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kBlockQ * kBlockK), probs(kBlockQ * kBlockK), acc(kBlockQ * Dp), keep(kBlockK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % q_blocks, h = (task / q_blocks) % p.hq, b = task / (q_blocks * p.hq);
      const int64_t kv = b * p.hkv + h / p.group;
      const int64_t i0 = block * kBlockQ, rows = std::min(kBlockQ, p.n - i0);
      const float* q_rows = qf.data() + ((b * p.hq + h) * p.n + i0) * Dp;
      const float* k_cols = kt.data() + kv * Dp * layout.keys;
      const float* v_rows = vf.data() + kv * p.m * Dp;
      OnlineSoftmax softmax[kBlockQ];
      std::fill(acc.begin(), acc.end(), 0.0f);
      const auto [lo, hi] = p.key_range(i0, i0 + rows);
      for (int64_t j0 = lo / kBlockK * kBlockK; j0 < hi; j0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, hi - j0);
        score_tile(q_rows, rows, k_cols, j0, layout, scores.data());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float* s = scores.data() + r * kBlockK;
          float* w = probs.data() + r * kBlockK;
          float tile_max = -INFINITY;
          for (int64_t c = 0; c < cols; ++c) {
            s[c] = attention_key_visible(i, j0 + c, p.shift, p.left, p.right)
                       ? attention_logit(s[c], p.scale, p.softcap) * kLog2e
                       : -INFINITY;
            tile_max = max_keeping_nan(tile_max, s[c]);
          }
          std::fill(w, w + kBlockK, 0.0f);
          // Nothing to add: no visible key of logit above -inf. A NaN logit keeps tile_max NaN
          // (std::max would drop it), so a tile whose only visible logit is NaN is not skipped.
          if (tile_max == -INFINITY) continue;
          const float factor = softmax[r].rescale_for(tile_max);
          float* a = acc.data() + r * Dp;
          if (factor != 1.0f)
            for (int64_t d = 0; d < Dp; ++d) a[d] *= factor;
          p.keep_factors(b, h, i, j0, keep.data());
          for (int64_t c = 0; c < cols; ++c) {
            if (s[c] == -INFINITY) continue;
            const float weight = softmax[r].weight(s[c]);
            softmax[r].sum += weight;
            w[c] = round_to_storage(weight * keep[c], p.storage);
          }
        }
        // acc += probs (rows x cols) @ v[j0 : j0 + cols].
        product_accumulate(probs.data(), kBlockK, 1, rows, v_rows + j0 * Dp, Dp, cols, Dp, acc.data(), Dp);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        float* a = acc.data() + r * Dp;
        const float sum = softmax[r].sum;
        for (int64_t d = 0; d < D; ++d) a[d] = softmax_row_empty(sum) ? 0.0f : a[d] / sum;
        narrow(a, o_base + ((b * p.n + i) * p.hq + h) * D * o_element, D, p.storage);
        lse_base[(b * p.hq + h) * lse_head_stride + i] = softmax[r].lse();
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const c10::optional<at::Tensor>& cos,
                                                     const c10::optional<at::Tensor>& sin,
                                                     const c10::optional<at::Tensor>& rng, double scale,
                                                     double softcap, int64_t window_left, int64_t window_right,
                                                     double dropout_p) {
  check_attention_qkv(q, k, v);
  check_attention_options(q, k, cos, sin, rng, scale, softcap, dropout_p);
  const Problem p = make_problem(q, k, rng, scale, softcap, window_left, window_right, dropout_p);
  at::Tensor o = at::empty({p.batch, p.n, p.hq, p.head_dim}, q.options());
  at::Tensor lse = at::empty({p.batch, p.hq, p.n}, q.options().dtype(at::kFloat));
  forward_core(q, k, v, make_rope(cos, sin), p, static_cast<char*>(o.data_ptr()), lse.data_ptr<float>(), p.n);
  return {o, lse};
}

// Recomputes one [rows x cols] tile of the backward: probabilities (dropped and rounded) into
// `probs` and dS (rounded) into `dscores`, from the score tile `scores` (q . k) and `dprobs`
// (dout . v). Delta and lse are per query row. Entries past `cols` are zeroed.
void backward_tile(const Problem& p, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                   const float* lse, const float* delta, const float* scores, const float* dprobs, float* probs,
                   float* dscores) {
  float keep[kBlockK];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    const float lse_log2 = lse[i] * kLog2e;
    p.keep_factors(b, h, i, j0, keep);
    for (int64_t c = 0; c < kBlockK; ++c) {
      const int64_t at = r * kBlockK + c, j = j0 + c;
      if (c >= cols || !attention_key_visible(i, j, p.shift, p.left, p.right)) {
        probs[at] = dscores[at] = 0.0f;
        continue;
      }
      const float logit = attention_logit(scores[at], p.scale, p.softcap);
      const float prob = exp2f(logit * kLog2e - lse_log2);
      probs[at] = round_to_storage(prob * keep[c], p.storage);
      const float dscore = prob * (dprobs[at] * keep[c] - delta[i]) * attention_logit_grad(logit, p.scale, p.softcap);
      dscores[at] = round_to_storage(dscore, p.storage);
    }
  }
}

// Where the backward of one problem writes: dq, dk, dv as contiguous [B, N, Hq, D] / [B, M, Hkv, D]
// blocks; lse read at lse[(b * Hq + h) * lse_head_stride + i].
struct BackwardOut {
  char* dq;
  char* dk;
  char* dv;
  const float* lse;
  int64_t lse_head_stride;
};

void backward_core(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& o, const Rope& rope, const Problem& p, const BackwardOut& out) {
  const Layout layout = make_layout(p);
  const int64_t D = p.head_dim, Dp = layout.dim, Mp = layout.keys;
  const int64_t element = q.element_size();

  const std::vector<float> qf = load_rows(q, rope, p.shift, p.storage, Dp);
  const std::vector<float> kf = load_rows(k, rope, 0, p.storage, Dp);
  const std::vector<float> kt = transpose_rows(kf, p.batch * p.hkv, p.m, Dp, Mp);
  const std::vector<float> vt = transpose_rows(load_rows(v, Rope{}, 0, p.storage, Dp), p.batch * p.hkv, p.m, Dp, Mp);
  const std::vector<float> dof = load_rows(dout, Rope{}, 0, p.storage, Dp);
  const std::vector<float> of = load_rows(o, Rope{}, 0, p.storage, Dp);
  // Delta_i = dout_i . o_i (fp32), the softmax backward's row term.
  std::vector<float> delta(p.batch * p.hq * p.n);
  at::parallel_for(0, p.batch * p.hq * p.n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += dof[row * Dp + d] * of[row * Dp + d];
      delta[row] = sum;
    }
  });

  // dk, dv: one task per key block of one (batch, kv head); it visits the group's query heads.
  const int64_t k_blocks = (p.m + kBlockK - 1) / kBlockK;
  at::parallel_for(0, p.batch * p.hkv * k_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kBlockQ * kBlockK), dprobs(kBlockQ * kBlockK), probs(kBlockQ * kBlockK),
        dscores(kBlockQ * kBlockK), dk_acc(kBlockK * Dp), dv_acc(kBlockK * Dp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % k_blocks, kvh = (task / k_blocks) % p.hkv, b = task / (k_blocks * p.hkv);
      const int64_t kv = b * p.hkv + kvh;
      const int64_t j0 = block * kBlockK, cols = std::min(kBlockK, p.m - j0);
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
      const auto [qlo, qhi] = p.query_range(j0, j0 + cols);
      for (int64_t h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
        const int64_t row0 = (b * p.hq + h) * p.n;
        const float* lse_rows = out.lse + (b * p.hq + h) * out.lse_head_stride;
        for (int64_t i0 = qlo; i0 < qhi; i0 += kBlockQ) {
          const int64_t rows = std::min(kBlockQ, qhi - i0);
          const float* q_rows = qf.data() + (row0 + i0) * Dp;
          const float* do_rows = dof.data() + (row0 + i0) * Dp;
          score_tile(q_rows, rows, kt.data() + kv * Dp * Mp, j0, layout, scores.data());
          score_tile(do_rows, rows, vt.data() + kv * Dp * Mp, j0, layout, dprobs.data());
          backward_tile(p, b, h, i0, rows, j0, cols, lse_rows, delta.data() + row0, scores.data(),
                        dprobs.data(), probs.data(), dscores.data());
          // dv += probs^T @ dout, dk += dS^T @ q (rotated), over this tile's rows.
          product_accumulate(probs.data(), 1, kBlockK, cols, do_rows, Dp, rows, Dp, dv_acc.data(), Dp);
          product_accumulate(dscores.data(), 1, kBlockK, cols, q_rows, Dp, rows, Dp, dk_acc.data(), Dp);
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t j = j0 + c, at = ((b * p.m + j) * p.hkv + kvh) * D;
        store_row(dk_acc.data() + c * Dp, rope, b, j, D, out.dk + at * element, p.storage);
        narrow(dv_acc.data() + c * Dp, out.dv + at * element, D, p.storage);
      }
    }
  });

  // dq: one task per query block of one (batch, query head).
  const int64_t q_blocks = (p.n + kBlockQ - 1) / kBlockQ;
  at::parallel_for(0, p.batch * p.hq * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kBlockQ * kBlockK), dprobs(kBlockQ * kBlockK), probs(kBlockQ * kBlockK),
        dscores(kBlockQ * kBlockK), dq_acc(kBlockQ * Dp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % q_blocks, h = (task / q_blocks) % p.hq, b = task / (q_blocks * p.hq);
      const int64_t kv = b * p.hkv + h / p.group, row0 = (b * p.hq + h) * p.n;
      const float* lse_rows = out.lse + (b * p.hq + h) * out.lse_head_stride;
      const int64_t i0 = block * kBlockQ, rows = std::min(kBlockQ, p.n - i0);
      std::fill(dq_acc.begin(), dq_acc.end(), 0.0f);
      const auto [lo, hi] = p.key_range(i0, i0 + rows);
      for (int64_t j0 = lo / kBlockK * kBlockK; j0 < hi; j0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, hi - j0);
        score_tile(qf.data() + (row0 + i0) * Dp, rows, kt.data() + kv * Dp * Mp, j0, layout, scores.data());
        score_tile(dof.data() + (row0 + i0) * Dp, rows, vt.data() + kv * Dp * Mp, j0, layout, dprobs.data());
        backward_tile(p, b, h, i0, rows, j0, cols, lse_rows, delta.data() + row0, scores.data(),
                      dprobs.data(), probs.data(), dscores.data());
        // dq += dS @ k (rotated).
        product_accumulate(dscores.data(), kBlockK, 1, rows, kf.data() + (kv * p.m + j0) * Dp, Dp, cols, Dp,
                           dq_acc.data(), Dp);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        store_row(dq_acc.data() + r * Dp, rope, b, i + p.shift, D,
                  out.dq + ((b * p.n + i) * p.hq + h) * D * element, p.storage);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
    const c10::optional<at::Tensor>& rng, double scale, double softcap, int64_t window_left, int64_t window_right,
    double dropout_p, bool /*deterministic: the CPU backward is always deterministic*/) {
  check_attention_qkv(q, k, v);
  check_attention_options(q, k, cos, sin, rng, scale, softcap, dropout_p);
  check_attention_bwd_extra(dout, q, o, lse);
  const Problem p = make_problem(q, k, rng, scale, softcap, window_left, window_right, dropout_p);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  const BackwardOut out{static_cast<char*>(dq.data_ptr()), static_cast<char*>(dk.data_ptr()),
                        static_cast<char*>(dv.data_ptr()), lse.const_data_ptr<float>(), p.n};
  backward_core(dout, q, k, v, o, make_rope(cos, sin), p, out);
  return {dq, dk, dv};
}

// Packed (variable-length) attention: sequence s holds queries cu_seqlens_q[s] .. cu_seqlens_q[s+1]
// - 1 of q [total_q, Hq, D] and keys cu_seqlens_k[s] .. of k, v [total_k, Hkv, D]. Each sequence
// is one dense problem (B = 1) over views of the packed tensors, writing straight into its rows of
// the packed outputs (lse [Hq, total_q]: head stride total_q). Sequences run one after another,
// each parallel over its heads and blocks. A sequence without queries leaves its dk, dv rows 0;
// one without keys leaves its o and dq rows 0 and its lse +inf.
struct PackedSequence {
  int64_t index, q0, n, k0, m;
};

std::vector<PackedSequence> packed_sequences(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k) {
  const int32_t* cu_q = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* cu_k = cu_seqlens_k.const_data_ptr<int32_t>();
  std::vector<PackedSequence> sequences;
  for (int64_t s = 0; s + 1 < cu_seqlens_q.numel(); ++s) {
    const PackedSequence sequence{s, cu_q[s], cu_q[s + 1] - cu_q[s], cu_k[s], cu_k[s + 1] - cu_k[s]};
    if (sequence.n > 0 && sequence.m > 0) sequences.push_back(sequence);
  }
  return sequences;
}

// Sequence views [1, L, H, D] of a packed [total, H, D] tensor.
at::Tensor sequence_view(const at::Tensor& packed, int64_t start, int64_t length) {
  return packed.narrow(0, start, length).unsqueeze(0);
}

// The rope tables of one sequence: [S, D/2] tables restart per sequence (row = position in it);
// [1, T, D/2] tables are per packed key token (rows from the sequence's first key on).
Rope sequence_rope(const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, int64_t k0) {
  Rope rope;
  if (!cos.has_value()) return rope;
  const bool per_token = cos->dim() == 3;
  rope.half = cos->size(-1);
  rope.rows = cos->size(-2) - (per_token ? k0 : 0);
  const int64_t first = per_token ? k0 * rope.half : 0;
  rope.cos = cos->const_data_ptr<float>() + first;
  rope.sin = sin->const_data_ptr<float>() + first;
  return rope;
}

Problem sequence_problem(const at::Tensor& q_s, const at::Tensor& k_s, const c10::optional<at::Tensor>& rng,
                         double scale, double softcap, int64_t window_left, int64_t window_right, double dropout_p,
                         const PackedSequence& sequence, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  Problem p = make_problem(q_s, k_s, rng, scale, softcap, window_left, window_right, dropout_p);
  p.drop_batch = sequence.index;
  p.drop_rows = max_seqlen_q;
  p.drop_cols = max_seqlen_k;
  return p;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, const c10::optional<at::Tensor>& cos,
    const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& rng, double scale, double softcap,
    int64_t window_left, int64_t window_right, double dropout_p) {
  check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, true);
  check_attention_options(q.unsqueeze(0), k.unsqueeze(0), c10::nullopt, c10::nullopt, rng, scale, softcap,
                          dropout_p);
  const int64_t total_q = q.size(0), hq = q.size(1), head_dim = q.size(2);
  at::Tensor o = at::zeros({total_q, hq, head_dim}, q.options());
  at::Tensor lse = at::full({hq, total_q}, INFINITY, q.options().dtype(at::kFloat));
  char* o_base = static_cast<char*>(o.data_ptr());
  for (const PackedSequence& sequence : packed_sequences(cu_seqlens_q, cu_seqlens_k)) {
    const at::Tensor q_s = sequence_view(q, sequence.q0, sequence.n);
    const at::Tensor k_s = sequence_view(k, sequence.k0, sequence.m);
    const Problem p = sequence_problem(q_s, k_s, rng, scale, softcap, window_left, window_right, dropout_p, sequence,
                                       max_seqlen_q, max_seqlen_k);
    forward_core(q_s, k_s, sequence_view(v, sequence.k0, sequence.m), sequence_rope(cos, sin, sequence.k0), p,
                 o_base + sequence.q0 * hq * head_dim * o.element_size(), lse.data_ptr<float>() + sequence.q0,
                 total_q);
  }
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
    const c10::optional<at::Tensor>& rng, double scale, double softcap, int64_t window_left, int64_t window_right,
    double dropout_p, bool /*deterministic: the CPU backward is always deterministic*/) {
  check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, true);
  check_attention_options(q.unsqueeze(0), k.unsqueeze(0), c10::nullopt, c10::nullopt, rng, scale, softcap,
                          dropout_p);
  check_attention_varlen_bwd_extra(dout, q, o, lse);
  const int64_t total_q = q.size(0), hq = q.size(1), hkv = k.size(1), head_dim = q.size(2);
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  const int64_t element = q.element_size();
  for (const PackedSequence& sequence : packed_sequences(cu_seqlens_q, cu_seqlens_k)) {
    const at::Tensor q_s = sequence_view(q, sequence.q0, sequence.n);
    const at::Tensor k_s = sequence_view(k, sequence.k0, sequence.m);
    const Problem p = sequence_problem(q_s, k_s, rng, scale, softcap, window_left, window_right, dropout_p, sequence,
                                       max_seqlen_q, max_seqlen_k);
    const BackwardOut out{static_cast<char*>(dq.data_ptr()) + sequence.q0 * hq * head_dim * element,
                          static_cast<char*>(dk.data_ptr()) + sequence.k0 * hkv * head_dim * element,
                          static_cast<char*>(dv.data_ptr()) + sequence.k0 * hkv * head_dim * element,
                          lse.const_data_ptr<float>() + sequence.q0, total_q};
    backward_core(sequence_view(dout, sequence.q0, sequence.n), q_s, k_s, sequence_view(v, sequence.k0, sequence.m),
                  sequence_view(o, sequence.q0, sequence.n), sequence_rope(cos, sin, sequence.k0), p, out);
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CPU, m) {
  m.impl("attention_fwd", &attention_fwd_cpu);
  m.impl("attention_bwd", &attention_bwd_cpu);
  m.impl("attention_varlen_fwd", &attention_varlen_fwd_cpu);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd_cpu);
}

}  // namespace remat
