// Operator schemas of the remat library and the (empty) Python module remat._C.
// Implementations register per dispatch key in the <block>_cpu.cpp / <block>_cuda.cpp files;
// fake (meta) implementations for torch.compile live in python/remat/ops/.
#include <Python.h>

#include <torch/library.h>

TORCH_LIBRARY(remat, m) {
  // Norm blocks. x, residual, dy, dh: [rows, cols] with unit column stride. h is x + residual
  // rounded to x's type when residual is given, else an empty tensor (the saved input is then x).
  // mean and rstd are fp32 [rows]. dw / db are empty when there is no weight / bias.
  m.def("rms_norm_fwd(Tensor x, Tensor? weight, Tensor? residual, float eps)"
        " -> (Tensor y, Tensor h, Tensor rstd)");
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps)"
        " -> (Tensor y, Tensor h, Tensor mean, Tensor rstd)");
  m.def("rms_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd)"
        " -> (Tensor dx, Tensor dw)");
  m.def("layer_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean,"
        " Tensor rstd, bool has_bias) -> (Tensor dx, Tensor dw, Tensor db)");
  // MLP activations, pointwise over contiguous tensors of one shape; fp32 math, one rounding.
  // activation: "silu", "gelu" (erf) or "gelu_tanh". glu: h = act(gate) * up. The backward
  // recomputes act(gate) and its derivative from the saved pre-activations, and h itself (for the
  // down projection's weight gradient) when need_h, else h is empty.
  m.def("glu_fwd(Tensor gate, Tensor up, str activation) -> Tensor h");
  m.def("glu_bwd(Tensor dh, Tensor gate, Tensor up, str activation, bool need_h)"
        " -> (Tensor dgate, Tensor dup, Tensor h)");
  m.def("act_fwd(Tensor pre, str activation) -> Tensor h");
  m.def("act_bwd(Tensor dh, Tensor pre, str activation, bool need_h) -> (Tensor dpre, Tensor h)");
  // Flash attention (python/remat/ops/attention.py documents the full contract). q [B, N, Hq, D],
  // k and v [B, M, Hkv, D] with unit last stride; o [B, N, Hq, D] contiguous in q's dtype; lse fp32
  // [B, Hq, N], +inf for rows that see no key. cos/sin: fp32 [1 or B, S >= M, D/2] or None.
  // rng: int64 [2] = (seed, offset) when dropout_p > 0, else None. window_left/right: -1 =
  // unbounded (causal is window_right = 0). softcap: 0 = off. The backward recomputes the
  // probabilities (and the dropout mask) from q, k, lse and rng; dq, dk, dv are contiguous.
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? cos, Tensor? sin, Tensor? rng,"
        " float scale, float softcap, int window_left, int window_right, float dropout_p)"
        " -> (Tensor o, Tensor lse)");
  m.def("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? cos,"
        " Tensor? sin, Tensor? rng, float scale, float softcap, int window_left, int window_right,"
        " float dropout_p, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
  // Packed (variable-length) attention, FlashAttention's varlen convention: q [total_q, Hq, D], k and
  // v [total_k, Hkv, D]; cu_seqlens_q / cu_seqlens_k int32 [S + 1] offsets (from 0, non-decreasing,
  // ending at the totals); max_seqlen_q / _k upper bounds of the lengths. o [total_q, Hq, D], lse
  // fp32 [Hq, total_q]. cos/sin: fp32 [S_rows, D/2] (positions restart per sequence) or
  // [1, T, D/2] (per packed key token). Dropout: the zero-padded batch's Philox stream.
  m.def("attention_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,"
        " SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? cos, Tensor? sin, Tensor? rng, float scale, float softcap,"
        " int window_left, int window_right, float dropout_p) -> (Tensor o, Tensor lse)");
  m.def("attention_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,"
        " Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? cos, Tensor? sin,"
        " Tensor? rng, float scale, float softcap, int window_left, int window_right, float dropout_p,"
        " bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
  // Rotary embedding applied once to a whole tensor (python/remat/ops/rope.py states the contract):
  // x [B, L, H, D] with unit last stride; cos/sin fp32 contiguous [R, D/2]; token (b, l) reads row
  // rows[b * L + l] (int64 [B * L]) or b * table_batch_stride + first_position + l; inverse applies
  // the transpose (gradients). y contiguous [B, L, H, D] in x's dtype, bitwise PyTorch's rotation.
  m.def("rope_rotate(Tensor x, Tensor cos, Tensor sin, Tensor? rows, int first_position, int table_batch_stride,"
        " bool inverse) -> Tensor y");
  // Dropout with a Philox mask that is never stored: y = keep ? x / (1 - p) : 0, keep(i) from
  // word i % 4 of the Philox call at counter offset + i / 4, rng = (seed, offset) (common/philox.h).
  // x contiguous.
  // The backward applies the same op to dy.
  m.def("philox_dropout(Tensor x, Tensor rng, float p) -> Tensor y");
  // Linear + cross-entropy that never stores the [T, V] logits (python/remat/ops/cross_entropy.py
  // documents the contract). x [T, H] with unit column stride, weight [V, H], bias [V] or None, target
  // int64 [T]; loss and lse fp32 [T]; softcap 0 = off; chunk = vocabulary columns per chunk.
  // grad_loss fp32 [T] (the reduction applied), grad_lse fp32 [T] or None; dx, dw, db are empty
  // when not needed.
  m.def("linear_cross_entropy_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index,"
        " float label_smoothing, float softcap, float z_loss, int chunk) -> (Tensor loss, Tensor lse)");
  m.def("linear_cross_entropy_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor lse,"
        " Tensor grad_loss, Tensor? grad_lse, int ignore_index, float label_smoothing, float softcap, float z_loss,"
        " int chunk, bool need_dx, bool need_dw, bool need_db) -> (Tensor dx, Tensor dw, Tensor db)");
}

// The module carries no functions: importing it runs the registrations above, and Python calls
// the operators through torch.ops.remat.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
