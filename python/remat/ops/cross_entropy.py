"""The fused linear + cross-entropy operators of every backend, behind one signature (see
csrc/ops.cpp). x [T, H] (unit column stride), weight [V, H] (the lm_head layout), bias [V] or None,
target int64 [T]; logits z = x W^T + b are computed by a GEMM in x's dtype and rounded to it (as
``F.linear`` stores them), then up-cast to fp32, capped (``softcap * tanh(z / softcap)`` when
softcap > 0) and never stored beyond one vocabulary chunk of ``chunk`` columns.

- ``linear_cross_entropy_fwd(x, weight, bias, target, ignore_index, label_smoothing, softcap,
  z_loss, chunk) -> (loss, lse)``: fp32 [T] each. lse = logsumexp_j z_j (online over the chunks);
  loss = lse - (1 - eps) z_target - (eps / V) sum_j z_j + z_loss * lse^2 for a token whose target
  is not ignore_index, 0 for an ignored one (its lse is still computed).
- ``linear_cross_entropy_bwd(x, weight, bias, target, lse, grad_loss, grad_lse, ignore_index,
  label_smoothing, softcap, z_loss, chunk, need_dx, need_dw, need_db) -> (dx, dw, db)``:
  grad_loss fp32 [T] is the gradient of each token's loss (the reduction's scale applied; read
  for non-ignored tokens only), grad_lse fp32 [T] or None that of the returned lse. Per chunk the
  logits are recomputed (same GEMM, same rounding), and with p = exp(z - lse), g = grad_loss
  (0 for ignored tokens):
  dz_j = p_j (g (1 + 2 z_loss lse) + grad_lse) - g (1 - eps) [j == target] - g eps / V, times
  1 - tanh^2 under softcap, rounded to x's dtype (where autograd's cast of the fp32 logits
  rounds the gradient). dW rows of the chunk = dz^T x and db = column sums of dz, each one GEMM
  or sum per chunk rounded once, as F.linear's backward; dx = sum over chunks of dz W_chunk,
  accumulated in fp32 and rounded once at the end, as one GEMM over the whole vocabulary would (with
  one chunk, that GEMM in x's dtype itself).
  dx [T, H] in x's dtype, dw [V, H] contiguous in weight's dtype, db [V]; empty(0) when not
  needed.

Target values outside [0, V) other than ignore_index are rejected by remat.functional before any
operator runs; the kernels only compare targets with column indices, never address memory with
them, so such a value cannot make a kernel read out of bounds (it contributes no target logit).
"""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from remat import _extension
from remat.ops.device import on_tensor_device


class CrossEntropyOps(NamedTuple):
    linear_cross_entropy_fwd: object
    linear_cross_entropy_bwd: object


def _chunks(vocab, chunk):
    """(start, end) of each vocabulary chunk."""
    chunk = max(int(chunk), 1)
    return [(start, min(vocab, start + chunk)) for start in range(0, vocab, chunk)]


def _chunk_logits(x, weight, bias, start, end, softcap):
    """(z, tanh term) of one chunk: the GEMM in x's dtype (F.linear, so the rounding is eager's),
    up-cast to fp32, then capped. The tanh term is None without softcap."""
    z = F.linear(x, weight[start:end], bias[start:end] if bias is not None else None).float()
    if softcap > 0:
        t = torch.tanh(z / softcap)
        return t * softcap, t
    return z, None


def torch_linear_cross_entropy_fwd(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, chunk):
    """The plain-PyTorch version, the readable specification: an online logsumexp over the
    vocabulary chunks; per token only fp32 running statistics (max, sum of exp, sum of logits and
    the target's logit) live between chunks."""
    tokens, vocab = x.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    row_max = torch.full((tokens,), float("-inf"), **f32)
    sum_exp = torch.zeros(tokens, **f32)
    sum_z = torch.zeros(tokens, **f32)
    z_target = torch.zeros(tokens, **f32)
    for start, end in _chunks(vocab, chunk):
        z, _ = _chunk_logits(x, weight, bias, start, end, softcap)
        new_max = torch.maximum(row_max, z.amax(dim=1))
        sum_exp = sum_exp * torch.exp(row_max - new_max) + torch.exp(z - new_max[:, None]).sum(dim=1)
        row_max = new_max
        if label_smoothing > 0:
            sum_z += z.sum(dim=1)
        in_chunk = (target >= start) & (target < end)
        column = (target - start).clamp(0, end - start - 1)
        z_target += torch.where(in_chunk, z.gather(1, column[:, None])[:, 0], 0.0)
    lse = row_max + torch.log(sum_exp)
    loss = lse - (1.0 - label_smoothing) * z_target
    if label_smoothing > 0:
        loss = loss - (label_smoothing / vocab) * sum_z
    if z_loss > 0:
        loss = loss + z_loss * lse * lse
    loss = torch.where(target != ignore_index, loss, 0.0)
    return loss, lse


def accumulate_dx(dx_acc, dz, w_chunk):
    """dx_acc (fp32 [T, H]) += dz [T, C] @ w_chunk [C, H] with fp32 accumulation and no rounding
    of the product to dz's dtype: fp32 inputs add in place; 16-bit inputs use a GEMM with an fp32
    output on CUDA, and on the CPU (which has no such GEMM in ATen) fp32 copies of the operands,
    exact (a 16-bit value is an fp32 value) and taken in column blocks of dz (2048, fewer when
    T C / H is smaller) so that neither copy is larger than an fp32 chunk of logits [T, C]."""
    if dz.dtype == torch.float32:
        dx_acc.addmm_(dz, w_chunk)
    elif dz.device.type == "cuda":
        dx_acc.add_(torch.mm(dz, w_chunk, out_dtype=torch.float32))
    else:
        tokens, columns = dz.shape
        block = max(1, min(columns, 2048, (tokens * columns) // max(w_chunk.shape[1], 1)))
        for k in range(0, columns, block):
            dx_acc.addmm_(dz[:, k:k + block].float(), w_chunk[k:k + block].float())


def torch_linear_cross_entropy_bwd(x, weight, bias, target, lse, grad_loss, grad_lse, ignore_index, label_smoothing,
                                   softcap, z_loss, chunk, need_dx, need_dw, need_db):
    """The plain-PyTorch backward: per chunk the logits are recomputed and turned into dz (in x's
    dtype); dW and db rows come from one GEMM / sum per chunk, dx is accumulated in fp32."""
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    valid = target != ignore_index
    g = torch.where(valid, grad_loss, 0.0)
    scale = g * (1.0 + 2.0 * z_loss * lse) if z_loss > 0 else g
    if grad_lse is not None:
        scale = scale + grad_lse
    smooth = g * (label_smoothing / vocab)
    hit = g * (1.0 - label_smoothing)
    chunks = _chunks(vocab, chunk)
    # One chunk: dx is F.linear's own backward GEMM in x's dtype; several: an fp32 sum of terms.
    dx_acc = x.new_zeros((tokens, hidden), dtype=torch.float32) if need_dx and len(chunks) > 1 else None
    dx = x.new_empty(0)
    dw = torch.empty((vocab, hidden), dtype=weight.dtype, device=x.device) if need_dw else weight.new_empty(0)
    db = torch.empty(vocab, dtype=bias.dtype, device=x.device) if need_db else x.new_empty(0)
    for start, end in chunks:
        z, t = _chunk_logits(x, weight, bias, start, end, softcap)
        dz = torch.exp(z - lse[:, None]) * scale[:, None]
        if label_smoothing > 0:
            dz -= smooth[:, None]
        in_chunk = (target >= start) & (target < end)
        column = (target - start).clamp(0, end - start - 1)
        dz.scatter_add_(1, column[:, None], torch.where(in_chunk, -hit, 0.0)[:, None])
        if t is not None:
            dz *= 1.0 - t * t
        dz = dz.to(x.dtype)
        if need_dw:
            torch.mm(dz.t(), x, out=dw[start:end])
        if need_db:
            torch.sum(dz, dim=0, out=db[start:end])
        if need_dx and dx_acc is None:
            dx = dz @ weight
        elif need_dx:
            accumulate_dx(dx_acc, dz, weight[start:end])
    if dx_acc is not None:
        dx = dx_acc.to(x.dtype)
    return dx, dw, db


TORCH_OPS = CrossEntropyOps(torch_linear_cross_entropy_fwd, torch_linear_cross_entropy_bwd)


def _fake_fwd(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, chunk):
    tokens = x.shape[0]
    return x.new_empty(tokens, dtype=torch.float32), x.new_empty(tokens, dtype=torch.float32)


def _fake_bwd(x, weight, bias, target, lse, grad_loss, grad_lse, ignore_index, label_smoothing, softcap, z_loss,
              chunk, need_dx, need_dw, need_db):
    dx = x.new_empty(x.shape if need_dx else (0,))
    dw = weight.new_empty(weight.shape if need_dw else (0,))
    db = (bias if bias is not None else x).new_empty((weight.shape[0],) if need_db else (0,))
    return dx, dw, db


EXTENSION_OPS = None
if _extension.LOADED and hasattr(torch.ops.remat, "linear_cross_entropy_fwd"):
    torch.library.register_fake("remat::linear_cross_entropy_fwd")(_fake_fwd)
    torch.library.register_fake("remat::linear_cross_entropy_bwd")(_fake_bwd)
    EXTENSION_OPS = CrossEntropyOps(torch.ops.remat.linear_cross_entropy_fwd,
                                    torch.ops.remat.linear_cross_entropy_bwd)


@torch.library.custom_op("remat_triton::linear_cross_entropy_fwd", mutates_args=())
@on_tensor_device
def triton_linear_cross_entropy_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                                    ignore_index: int, label_smoothing: float, softcap: float, z_loss: float,
                                    chunk: int) -> tuple[Tensor, Tensor]:
    from remat.kernels import cross_entropy

    return cross_entropy.linear_cross_entropy_fwd(x, weight, bias, target, ignore_index, label_smoothing, softcap,
                                                  z_loss)


@torch.library.custom_op("remat_triton::linear_cross_entropy_bwd", mutates_args=())
@on_tensor_device
def triton_linear_cross_entropy_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
                                    grad_loss: Tensor, grad_lse: Optional[Tensor], ignore_index: int,
                                    label_smoothing: float, softcap: float, z_loss: float, chunk: int,
                                    need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    from remat.kernels import cross_entropy

    return cross_entropy.linear_cross_entropy_bwd(x, weight, bias, target, lse, grad_loss, grad_lse, ignore_index,
                                                  label_smoothing, softcap, z_loss, chunk, need_dx, need_dw,
                                                  need_db)


triton_linear_cross_entropy_fwd.register_fake(_fake_fwd)
triton_linear_cross_entropy_bwd.register_fake(_fake_bwd)

TRITON_OPS = CrossEntropyOps(triton_linear_cross_entropy_fwd, triton_linear_cross_entropy_bwd)


# Read by remat.ops.ops_for; None where the extension is not built.
OPS = {"torch": TORCH_OPS, "triton": TRITON_OPS, "cpp": EXTENSION_OPS, "cuda": EXTENSION_OPS}
