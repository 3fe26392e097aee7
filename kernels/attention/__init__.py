"""Triton flash attention with recompute backward: forward saves o and the fp32 logsumexp only.

The recompute contract (DESIGN.md section 2; python/remat/ops/attention.py states it for every
backend): the forward keeps q, k, v, o, lse (fp32 [B, Hq, N], natural log) and the dropout
seed/offset (the int64 rng tensor). The backward recomputes the probabilities P = exp(t - lse) tile
by tile from q, k and lse and the dropout mask from (seed, offset); the [N, M] matrices are never
written to memory. RoPE is the forward kernel's only (rotated on load, never written): the
backward kernels take q and k already rotated and refuse cos/sin, since a call with a backward
rotates q and k once per pass outside the kernels (remat.ops.attention rope_rotated_once) and
runs the forward kernel on them without RoPE too.

Shapes: q [B, N, Hq, D]; k, v [B, M, Hkv, D] (query head h reads kv head h // (Hq / Hkv)); any
strides with a unit last-dimension stride; D in 1..256 (even with RoPE, forward only). Query i sits at
position i + M - N (bottom-right alignment) and sees key j iff (left < 0 or j >= pos - left) and
(right < 0 or j <= pos + right); causal is right = 0.

Rounding points are those of an unfused PyTorch computation in the input dtype; fp32 inputs skip
every rounding (dots use IEEE fp32 products, or TF32 when PyTorch's
torch.backends.cuda.matmul.allow_tf32 is on at the call: the TF32 constexpr). Each module states the ones it implements:
- launch.py: the host launchers attention_fwd, attention_bwd, their packed (variable-length)
  variants attention_varlen_fwd, attention_varlen_bwd (argument checks, outputs, grids) and
  aot_specs, the specs of the ahead-of-time compile check; the forward's RoPE rotation-halves
  layout (ROPE_SPLIT_HALVES, REMAT_ATTENTION_ROPE_SPLIT_HALVES);
- forward.py: the forward kernel and its key-tile step (the online softmax, o and lse, RoPE);
- backward.py: the preprocess, dK/dV, dQ and postprocess kernels, deterministic and fast modes;
- logits.py: the logit (scale, softcap), the recomputed probabilities and the logit gradient;
- masks.py: the visible band (causal, windows, bounds), the tiles it covers, the dropout mask;
- rope.py: operand tiles (the forward's loaded rotated) and the QK^T and gradient dots;
- tuning.py: block sizes per kernel, autotuning (REMAT_ATTENTION_AUTOTUNE), the launch helper.
`_round`, `_dot` and `_INTERPRETED` are kernels/_common.py's, shared with the other kernels.
"""

from .launch import _MAX_HEAD_DIM as _MAX_HEAD_DIM
from .launch import aot_specs, attention_bwd, attention_fwd, attention_varlen_bwd, attention_varlen_fwd

# Reachable from the package as before the split, for reading: the launchers use tuning.py's own
# names, so assigning these here changes nothing.
from .tuning import _AUTOTUNE as _AUTOTUNE
from .tuning import _CONFIGS as _CONFIGS
from .tuning import _INTERPRETER_BLOCK as _INTERPRETER_BLOCK
from .tuning import _configs_for as _configs_for

__all__ = ["aot_specs", "attention_bwd", "attention_fwd", "attention_varlen_bwd", "attention_varlen_fwd"]
