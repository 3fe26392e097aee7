// C++ CPU kernels of the MLP activations (glu_fwd, glu_bwd, act_fwd, act_bwd), with the same
// recompute contract as the CUDA and Triton kernels: the forward saves only the pre-activations
// (gate and up, or pre), and the backward recomputes act(gate), act'(gate) and, when asked, h.
//
// Elementwise over flat contiguous arrays cut into tiles of kTile elements on a fixed grid
// (tile t covers [t * kTile, (t + 1) * kTile)); at::parallel_for hands out runs of tiles, at least
// kGrain elements per task. Each tile's inputs are widened into fp32 buffers, plain loops over
// the buffers compute the outputs, and each output is narrowed with one round-to-nearest-even.
// The math is exactly activate / activate_grad of common/activation.h, with the activation a
// template argument (dispatched once per tile, not per element), so every loop body is one
// branch-free expression. The loops are compiled for x86-64-v3 and baseline (REMAT_CPU_CLONES,
// see common/cpu_convert.h), the silu ones for x86-64-v4 (AVX-512) as well.
//
// Forward and backward compute act(gate) with the same out-of-line function on the same tile
// (same length, 64-byte-aligned buffers), whatever the thread count, so the h the backward
// recomputes (and dup = dh * act(gate)) match the forward bit for bit, even though the vectorised
// loop body and its scalar remainder may call different expf/erff/tanhf implementations.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>

// Vectorised expf, erff and tanhf from glibc's libmvec, without -ffast-math. glibc's
// <bits/math-vector.h> declares the SIMD variants only under __FAST_MATH__; declaring them here
// lets GCC vectorise the activation loops at -O3 with IEEE semantics otherwise unchanged (no
// reassociation, NaN and inf kept), calling _ZGVdN8v_expf etc. (AVX2 clone), _ZGVbN4v_expf
// (baseline clone) or _ZGVeN16v_expf (AVX-512 clone). `const` says the calls neither read nor set
// errno as far as we care (we never read it); GCC needs it to vectorise expf, which may set ERANGE.
// Measured over [-20, 20] with glibc 2.36, the 4- and 8-lane functions are within 2.8 (expf),
// 1.9 (erff) and 1.0 (tanhf) fp32 ulp, against 0.5 / 1.5 / 2.1 for the scalar ones: far below
// the bf16/fp16 rounding; fp32 outputs' errors measured at most 1.34x eager torch's (SLEEF).
// erff/tanhf need glibc >= 2.35; libmvec is linked through the libm.so linker script.
// Define REMAT_CPU_NO_LIBMVEC to compile the plain scalar calls instead (4x slower for silu,
// 10-35x for the gelu variants).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) && \
    !defined(REMAT_CPU_NO_LIBMVEC)
#if __GLIBC_PREREQ(2, 35)
#define REMAT_CPU_LIBMVEC 1
extern "C" float expf(float) noexcept __attribute__((const, simd("notinbranch")));
extern "C" float erff(float) noexcept __attribute__((const, simd("notinbranch")));
extern "C" float tanhf(float) noexcept __attribute__((const, simd("notinbranch")));
#endif
#endif

#include "common/activation.h"
#include "common/cpu_convert.h"
#include "mlp/act_checks.h"

namespace remat {
namespace {

// Elements per tile: the backward holds up to eight fp32 tile buffers, 32 KiB, in L1.
constexpr int64_t kTile = 1024;
// Minimum elements per parallel task (~32K): enough to amortise the task, few enough to balance.
constexpr int64_t kGrain = 32768;

// ---- Loops over one tile of fp32 buffers. ----

template <Activation kAct>
[[gnu::always_inline]] inline void act_loop(const float* __restrict__ g, float* __restrict__ a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = activate(kAct, g[i]);
}

template <Activation kAct>
[[gnu::always_inline]] inline void grad_loop(const float* __restrict__ g, float* __restrict__ da, int64_t n) {
  for (int64_t i = 0; i < n; ++i) da[i] = activate_grad(kAct, g[i]);
}

// Out of line (noinline), so the forward and the backward run the very same code on a tile.
template <Activation kAct>
__attribute__((noinline)) REMAT_CPU_CLONES void act_values(const float* g, float* a, int64_t n) {
  act_loop<kAct>(g, a, n);
}

template <Activation kAct>
__attribute__((noinline)) REMAT_CPU_CLONES void grad_values(const float* g, float* da, int64_t n) {
  grad_loop<kAct>(g, da, n);
}

// silu also gets an AVX-512 clone: libmvec's 16-lane expf is as accurate as its 8-lane one and
// about 1.4x faster per element. Not the gelu variants: the 16-lane erff / tanhf are less accurate
// (measured up to 4 / 1.4 fp32 ulp, against 1.9 / 1.0), which the gelu_tanh derivative's 1 - t^2
// amplifies (fp32 dgate error 1.6-2x eager torch's, against <= 1.3x with the 8-lane functions).
#if defined(REMAT_CPU_LIBMVEC)
#define REMAT_CPU_SILU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define REMAT_CPU_SILU_CLONES REMAT_CPU_CLONES
#endif

__attribute__((noinline)) REMAT_CPU_SILU_CLONES void silu_values(const float* g, float* a, int64_t n) {
  act_loop<Activation::kSilu>(g, a, n);
}

__attribute__((noinline)) REMAT_CPU_SILU_CLONES void silu_grad_values(const float* g, float* da, int64_t n) {
  grad_loop<Activation::kSilu>(g, da, n);
}

REMAT_CPU_CLONES void product(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                              int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

// dg = dh * u * da, du = dh * a.
REMAT_CPU_CLONES void glu_grads(const float* __restrict__ dh, const float* __restrict__ u, const float* __restrict__ a,
                                const float* __restrict__ da, float* __restrict__ dg, float* __restrict__ du,
                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dg[i] = dh[i] * u[i] * da[i];
    du[i] = dh[i] * a[i];
  }
}

using ValuesFn = void (*)(const float*, float*, int64_t);

ValuesFn act_values_for(Activation activation) {
  switch (activation) {
    case Activation::kSilu: return &silu_values;
    case Activation::kGelu: return &act_values<Activation::kGelu>;
    default: return &act_values<Activation::kGeluTanh>;
  }
}

ValuesFn grad_values_for(Activation activation) {
  switch (activation) {
    case Activation::kSilu: return &silu_grad_values;
    case Activation::kGelu: return &grad_values<Activation::kGelu>;
    default: return &grad_values<Activation::kGeluTanh>;
  }
}

// ---- Tiles: widen, compute, narrow. ----

// The fp32 buffers of one task, 64-byte aligned.
struct alignas(64) TileBuffers {
  float dh[kTile], g[kTile], u[kTile], a[kTile], da[kTile], dg[kTile], du[kTile], h[kTile];
};

const char* bytes_at(const at::Tensor& t, int64_t offset) {
  return static_cast<const char*>(t.const_data_ptr()) + offset * t.element_size();
}

char* bytes_at(at::Tensor& t, int64_t offset) {
  return static_cast<char*>(t.data_ptr()) + offset * t.element_size();
}

// Runs body(start, n, buffers) over every tile of [0, numel), in parallel.
template <typename Body>
void for_each_tile(int64_t numel, const Body& body) {
  const int64_t tiles = (numel + kTile - 1) / kTile;
  at::parallel_for(0, tiles, kGrain / kTile, [&](int64_t tile_begin, int64_t tile_end) {
    auto buffers = std::make_unique<TileBuffers>();
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t start = tile * kTile;
      body(start, std::min(kTile, numel - start), *buffers);
    }
  });
}

// h = act(gate) * up, or act(gate) when up is undefined.
void act_fwd_elements(const at::Tensor& gate, const at::Tensor& up, Activation activation, at::Tensor& h) {
  const Storage storage = storage_of(gate.scalar_type());
  const bool gated = up.defined();
  const ValuesFn act = act_values_for(activation);
  for_each_tile(gate.numel(), [&](int64_t start, int64_t n, TileBuffers& b) {
    widen(bytes_at(gate, start), b.g, n, storage);
    if (gated) {
      widen(bytes_at(up, start), b.u, n, storage);
      act(b.g, b.a, n);
      product(b.a, b.u, b.h, n);
    } else {
      act(b.g, b.h, n);
    }
    narrow(b.h, bytes_at(h, start), n, storage);
  });
}

// Gated (up defined): dgate = dh * up * act'(gate), dup = dh * act(gate), h = act(gate) * up.
// Plain: dgate = dh * act'(gate), h = act(gate). h is skipped when undefined.
void act_bwd_elements(const at::Tensor& dh, const at::Tensor& gate, const at::Tensor& up, Activation activation,
                      at::Tensor& dgate, at::Tensor& dup, at::Tensor& h) {
  const Storage storage = storage_of(gate.scalar_type());
  const bool gated = up.defined(), need_h = h.defined();
  const ValuesFn act = act_values_for(activation), grad = grad_values_for(activation);
  for_each_tile(gate.numel(), [&](int64_t start, int64_t n, TileBuffers& b) {
    widen(bytes_at(dh, start), b.dh, n, storage);
    widen(bytes_at(gate, start), b.g, n, storage);
    grad(b.g, b.da, n);
    if (gated) {
      widen(bytes_at(up, start), b.u, n, storage);
      act(b.g, b.a, n);
      glu_grads(b.dh, b.u, b.a, b.da, b.dg, b.du, n);
      narrow(b.du, bytes_at(dup, start), n, storage);
      if (need_h) {
        product(b.a, b.u, b.h, n);
        narrow(b.h, bytes_at(h, start), n, storage);
      }
    } else {
      product(b.dh, b.da, b.dg, n);
      if (need_h) {
        act(b.g, b.h, n);
        narrow(b.h, bytes_at(h, start), n, storage);
      }
    }
    narrow(b.dg, bytes_at(dgate, start), n, storage);
  });
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
}

// ---- Operators. ----

at::Tensor glu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  check_same_layout(gate, gate, "gate", "gate");
  check_same_layout(gate, up, "gate", "up");
  check_cpu(gate, "gate");
  at::Tensor h = at::empty(gate.sizes(), gate.options());
  if (gate.numel() > 0) act_fwd_elements(gate, up, act, h);
  return h;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> glu_bwd_cpu(const at::Tensor& dh, const at::Tensor& gate,
                                                           const at::Tensor& up, c10::string_view activation,
                                                           bool need_h) {
  const Activation act = parse_activation(activation);
  check_same_layout(gate, gate, "gate", "gate");
  check_same_layout(gate, up, "gate", "up");
  check_same_layout(gate, dh, "gate", "dh");
  check_cpu(gate, "gate");
  at::Tensor dgate = at::empty(gate.sizes(), gate.options());
  at::Tensor dup = at::empty(gate.sizes(), gate.options());
  // Without need_h, h is an empty placeholder of gate's dtype (as the fake implementation says).
  at::Tensor h = need_h ? at::empty(gate.sizes(), gate.options()) : at::empty({0}, gate.options());
  at::Tensor h_out = need_h ? h : at::Tensor();
  if (gate.numel() > 0) act_bwd_elements(dh, gate, up, act, dgate, dup, h_out);
  return {dgate, dup, h};
}

at::Tensor act_fwd_cpu(const at::Tensor& pre, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  check_same_layout(pre, pre, "pre", "pre");
  check_cpu(pre, "pre");
  at::Tensor h = at::empty(pre.sizes(), pre.options());
  if (pre.numel() > 0) act_fwd_elements(pre, at::Tensor(), act, h);
  return h;
}

std::tuple<at::Tensor, at::Tensor> act_bwd_cpu(const at::Tensor& dh, const at::Tensor& pre,
                                               c10::string_view activation, bool need_h) {
  const Activation act = parse_activation(activation);
  check_same_layout(pre, pre, "pre", "pre");
  check_same_layout(pre, dh, "pre", "dh");
  check_cpu(pre, "pre");
  at::Tensor dpre = at::empty(pre.sizes(), pre.options());
  at::Tensor h = need_h ? at::empty(pre.sizes(), pre.options()) : at::empty({0}, pre.options());
  at::Tensor h_out = need_h ? h : at::Tensor();
  at::Tensor no_dup;
  if (pre.numel() > 0) act_bwd_elements(dh, pre, at::Tensor(), act, dpre, no_dup, h_out);
  return {dpre, h};
}

}  // namespace

TORCH_LIBRARY_IMPL(remat, CPU, m) {
  m.impl("glu_fwd", &glu_fwd_cpu);
  m.impl("glu_bwd", &glu_bwd_cpu);
  m.impl("act_fwd", &act_fwd_cpu);
  m.impl("act_bwd", &act_bwd_cpu);
}

}  // namespace remat
