"""Option structures: the non-tensor arguments of a fused block, carried as one named value from
the public functions through the autograd Functions to the operators, so that a new option is one
field rather than a new positional argument in every signature (FlashAttention's params struct;
csrc/attention/attention.h holds the C++ counterpart).

NamedTuples, so torch.compile treats them as constants and they pass through
``torch.autograd.Function.apply`` unchanged.
"""

from typing import NamedTuple


class AttentionOptions(NamedTuple):
    """The attention kernels' scalar arguments, in the order of the operators' signatures
    (remat.ops.attention): ``attention_fwd(q, k, v, cos, sin, rng, *options[:5])`` and
    ``attention_bwd(dout, q, k, v, o, lse, cos, sin, rng, *options)``.

    scale: logit scale (> 0). softcap: 0 (off) or the cap. window_left / window_right: the visible
    key band around each query's position, -1 = unbounded (causal: window_right = 0).
    dropout_p: probability in [0, 1). deterministic: GPU backward without atomics.
    """

    scale: float
    softcap: float = 0.0
    window_left: int = -1
    window_right: int = -1
    dropout_p: float = 0.0
    deterministic: bool = True


class NormAttentionOptions(NamedTuple):
    """The pre-norm attention sub-block's non-tensor arguments (remat.autograd.norm_attention).

    shape: (B, N, Hq, Hkv, D). norm: "rms", "layer" or "gemma" (RMSNorm with weight 1 + w in
    fp32). eps: the norm's epsilon. attention: the :class:`AttentionOptions`. keep_qkv: save q, k,
    v for backward (True) or recompute them with the projection GEMMs (False). norm_backend: the
    backend of the norm kernels, which differs from the attention's when that is one of the
    PyTorch cores, "aten" or "cudnn" (attention only). qk_norm: None, or the per-head norm of q
    and k over D after the projections and before rope ("rms": Qwen3; "gemma": Gemma 3); qk_eps:
    its epsilon. max_seqlen: with packed sequences (cu_seqlens), the upper bound of their
    lengths; None for a dense call. tile_tokens: None, or the tokens per tile of the sequence-tiled
    path (remat.autograd.norm_attention_tiled: causal, dense, no dropout). sequence_parallel:
    None, or (process group, its size P): x is this rank's shard of the sequence and the attention
    runs over the group's shards (remat.sequence_parallel); cu_seqlens and max_seqlen then describe
    the whole sequence.
    """

    shape: tuple
    norm: str
    eps: float
    attention: AttentionOptions
    keep_qkv: bool
    norm_backend: str
    qk_norm: str | None = None
    qk_eps: float = 0.0
    max_seqlen: int | None = None
    tile_tokens: int | None = None
    sequence_parallel: tuple | None = None
