"""The "cudnn" attention core: cuDNN's fused flash attention through PyTorch's own operators
(aten::_scaled_dot_product_cudnn_attention and its backward), inside remat's attention Function.

Why: stock PyTorch runs it. On sm_90 and sm_10x GPUs with cuDNN newer than 9.15, torch 2.14's
scaled_dot_product_attention tries cuDNN first (sdp_utils.cpp check_prefer_cudnn_attention;
TORCH_CUDNN_SDPA_DEPRIORITIZED=1 turns that off), so a stock Hugging Face model on an H100 or H200
runs this kernel, not FlashAttention-2. Published measurements put it ahead of FlashAttention-2 on
Hopper: 1.45x for forward plus backward on an H100 (pytorch/pytorch#128888: fp16, B1 H16 N4096
D128 causal, 894 against 1297 us) and 1.7-2.3x on Hopper training shapes
(huggingface/transformers#48163). Not measured by remat on a GPU yet.

Contract: the one of every attention core (remat.ops.attention): q, k, v, o and an fp32
logsumexp per row are saved (cuDNN's natural-log softmax statistics, [B, Hq, N, 1], kept as the
[B, Hq, N] view and handed back unchanged), the probabilities are recomputed in backward. Rope is
remat's, rotated once per pass around the core (remat.ops.attention.rotated_once). q, k, v go in
as [B, H, N, D] views of remat's [B, N, H, D] tensors (the layout Hugging Face models pass); cuDNN
allocates o, dq, dk and dv like q, k and v, so they come back contiguous in [B, N, H, D]. GQA is
cuDNN's own (k and v keep their Hkv heads).

What it takes: cudnn_unsupported_reason.
"""

import os

import torch

from remat.backend import device_capability
from remat.ops.attention import AttentionOps, no_rope_tables, rotated_once, windowless_top_left_reason
from remat.options import AttentionOptions

# torch.backends.cudnn.version() numbers (major * 10000 + minor * 100 + patch). PyTorch prefers
# cuDNN attention above 9.15 (its comment: 9.15.1 fixed sequence lengths not divisible by 128,
# pytorch/pytorch#169849); remat takes cuDNN only there, asked for by name too.
_MIN_VERSION_ABOVE = 91500
# Head dims up to 128 run on every cuDNN 9; 256 needs cuDNN > 9.22 built with cuDNN frontend >= 1.24
# on sm_90/sm_10x (sdp_utils.cpp check_cudnn_tensor_shapes), which Python cannot see, so D above 128
# stays with FlashAttention-2.
_MAX_HEAD_DIM = 128
# cuDNN's grid limits on the batch and the query heads (check_cudnn_tensor_shapes).
_MAX_BATCH_OR_HEADS = 65535
# cuDNN's attention graphs assume 16-byte aligned pointers and strides (PyTorch's MHA.cpp: "cuDNN
# requires 16-byte pointer/stride alignment"; frontends without set_alignment hardcode 16-byte
# descriptors). PyTorch hands the dense operator's tensors to cuDNN as they are, checking only that
# the last dimension has stride 1 (and that during SDPA's backend choice, not in the operator).
_ALIGNMENT_BYTES = 16


@torch.compiler.assume_constant_result
def _cudnn_version():
    """torch.backends.cudnn.version() (None without cuDNN), a constant to torch.compile."""
    return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None


@torch.compiler.assume_constant_result
def _deprioritized():
    """TORCH_CUDNN_SDPA_DEPRIORITIZED=1: PyTorch does not put cuDNN first (read once there too)."""
    return os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") == "1"


@torch.compiler.assume_constant_result
def _cudnn_sdp_enabled():
    """torch.backends.cuda.cudnn_sdp_enabled() (PyTorch's switch for cuDNN attention, which
    enable_cudnn_sdp and sdpa_kernel set), a constant to torch.compile."""
    return torch.backends.cuda.cudnn_sdp_enabled()


def _capability(device):
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())


def cudnn_preferred(device):
    """Whether stock PyTorch's scaled_dot_product_attention tries cuDNN first on ``device`` (a CUDA
    device), by torch 2.14's rule (sdp_utils.cpp check_prefer_cudnn_attention): cuDNN newer than
    9.15, an sm_9x or sm_10x GPU (with a CUDA toolkit before 13: sm_x0 or sm_x3 only), and
    TORCH_CUDNN_SDPA_DEPRIORITIZED not set to 1. Where it holds, attention's default backend on
    CUDA is this core for the calls it takes."""
    version = _cudnn_version()
    if _deprioritized() or version is None or version <= _MIN_VERSION_ABOVE:
        return False
    major, minor = _capability(device)
    if major not in (9, 10):
        return False
    cuda_major = int((torch.version.cuda or "0").split(".")[0])
    return cuda_major >= 13 or minor in (0, 3)


def cudnn_unsupported_reason(batch, n, m, hq, hkv, head_dim, dtype, device, options, varlen=False):
    """Why the cudnn core cannot run attention of ``batch`` x N queries and M keys (Hq / Hkv heads
    of dim D, ``dtype`` on ``device``) with these :class:`remat.options.AttentionOptions`, or None.

    cuDNN through PyTorch's operator has no softcap and no sliding window, and its causal mask
    aligns top-left (remat's bottom-right: causal needs N == M). Dropout and packed sequences go to
    the aten core (FlashAttention-2's dropout and its variable-length entry). It needs a CUDA (not
    ROCm) build of PyTorch with cuDNN, cuDNN attention enabled in PyTorch
    (torch.backends.cuda.cudnn_sdp_enabled(): off after enable_cudnn_sdp(False) or inside an
    sdpa_kernel context without it), cuDNN 9.15.1 or newer, an sm_80..sm_121 GPU, float16/bfloat16, head dims that are
    multiples of 8 up to 128, batch and Hq up to 65535, at least two queries and two keys (cuDNN
    takes no single key; single-query calls, decoding, stay with FlashAttention-2: open cuDNN
    defects hit them on some GPUs, pytorch/pytorch#193893 and cudnn-frontend#1072), and a
    backward that need not be deterministic (cuDNN's is not, and PyTorch's SDPA refuses it under
    torch.use_deterministic_algorithms(True))."""
    if options.softcap > 0:
        return "PyTorch's cuDNN attention has no logit softcap"
    if options.dropout_p > 0:
        return "remat runs dropout on the aten core (FlashAttention-2's own dropout), not on cuDNN"
    mask_reason = windowless_top_left_reason("PyTorch's cuDNN attention", n, m, options)
    if mask_reason is not None:
        return mask_reason
    if varlen:
        return "packed (cu_seqlens) calls go to the aten core (FlashAttention-2's variable-length entry)"
    if device.type != "cuda":
        return f"cuDNN attention runs CUDA tensors, and the input is on {device}"
    if torch.version.hip is not None or _cudnn_version() is None:
        return "this PyTorch build has no cuDNN for CUDA"
    if _cudnn_version() <= _MIN_VERSION_ABOVE:
        return (f"cuDNN {_cudnn_version()} is older than 9.15.1, which fixed sequence lengths not divisible by 128 "
                "(pytorch/pytorch#169849)")
    if not _cudnn_sdp_enabled():
        return ("cuDNN attention is disabled in PyTorch (torch.backends.cuda.enable_cudnn_sdp(False), or an "
                "sdpa_kernel context without it)")
    capability = _capability(device)
    if not (8, 0) <= capability <= (12, 1):
        return f"PyTorch's cuDNN attention runs on sm_80 to sm_121 GPUs; this one is sm_{capability[0]}{capability[1]}"
    if dtype not in (torch.float16, torch.bfloat16):
        return "cuDNN attention takes float16/bfloat16"
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        return f"remat's cudnn core takes head dims that are multiples of 8 up to {_MAX_HEAD_DIM}"
    if batch > _MAX_BATCH_OR_HEADS or hq > _MAX_BATCH_OR_HEADS:
        return f"cuDNN attention takes a batch and query heads up to {_MAX_BATCH_OR_HEADS}"
    if n < 2 or m < 2:
        return "one query (decoding) or one key: left to FlashAttention-2 (see cudnn_unsupported_reason)"
    if options.deterministic or torch.are_deterministic_algorithms_enabled():
        return ("cuDNN's attention backward is not deterministic, and this call asks for a deterministic backward "
                "(deterministic=True, or torch.use_deterministic_algorithms(True))")
    return None


def cudnn_aligned(t):
    """``t`` itself when cuDNN can read it as is: last dimension of stride 1, storage offset and
    every other stride (of dimensions longer than 1) multiples of 16 bytes; else a contiguous copy
    (a new allocation, which PyTorch's allocators align to at least 16 bytes). A slice at an odd
    element offset, or heads cut from a wider row, take the copy; every layout remat and Hugging
    Face models produce (projections viewed as heads, rotated copies, fused-qkv slices at multiples
    of D) does not.

    Not checked: the base pointer of the storage (PyTorch's CUDA caching allocator aligns every
    block to 512 bytes), and under torch.compile the storage offset (dynamo cannot trace
    Tensor.storage_offset inside an autograd.Function); there an operand at an odd offset reaches
    cuDNN as it does from stock SDPA."""
    size = t.element_size()
    aligned = t.stride(-1) == 1 and \
        all(stride * size % _ALIGNMENT_BYTES == 0 for stride, extent in zip(t.stride()[:-1], t.shape[:-1])
            if extent > 1)
    if aligned and not torch.compiler.is_compiling():
        aligned = t.storage_offset() * size % _ALIGNMENT_BYTES == 0
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


def _check_cudnn_call(q, k, options):
    reason = cudnn_unsupported_reason(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                                      q.dtype, q.device, options)
    if reason is not None:
        raise ValueError(f"the cudnn attention core cannot run this call: {reason}")


def _cudnn_core_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p):
    """Forward through cuDNN (q and k rotated; each operand copied first only where cuDNN could not
    read it, cudnn_aligned): o [B, N, Hq, D] and lse [B, Hq, N], the view of cuDNN's [B, Hq, N, 1]
    statistics."""
    no_rope_tables(cos, sin)
    _check_cudnn_call(q, k, AttentionOptions(scale, softcap, window_left, window_right, dropout_p, False))
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *(cudnn_aligned(t).transpose(1, 2) for t in (q, k, v)), None, True, 0.0, window_right == 0, False,
        scale=scale)[:2]
    return o.transpose(1, 2).contiguous(), lse.squeeze(-1)


def _cudnn_core_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p,
                    deterministic):
    """Backward through cuDNN (q and k rotated), the probabilities recomputed from q, k and the
    forward's statistics (operands copied first where misaligned, cudnn_aligned). The seed and
    offset tensors are read only with dropout (never here)."""
    no_rope_tables(cos, sin)
    unused = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *(cudnn_aligned(t).transpose(1, 2) for t in (dout, q, k, v, o)), lse.unsqueeze(-1), unused, unused, None,
        None, None, q.shape[1], k.shape[1], 0.0, window_right == 0, scale=scale)
    return tuple(g.transpose(1, 2).contiguous() for g in (dq, dk, dv))


# Dense calls only (packed ones go to the aten core); rope rotated once around the core.
CUDNN_OPS = rotated_once(AttentionOps(_cudnn_core_fwd, _cudnn_core_bwd))
cudnn_attention_fwd, cudnn_attention_bwd = CUDNN_OPS.attention_fwd, CUDNN_OPS.attention_bwd
