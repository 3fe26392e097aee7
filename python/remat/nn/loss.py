"""The output block as a module: an lm_head (``nn.Linear``'s ``weight`` [V, H] and ``bias``) and the
cross-entropy loss in one, running remat.linear_cross_entropy, so the logits are never stored."""

import math

import torch
from torch import nn

from remat import checks, functional
from remat.autograd.cross_entropy import REDUCTIONS


class LinearCrossEntropy(nn.Module):
    """lm_head + cross-entropy: ``forward(x, target)`` returns
    ``F.cross_entropy(F.linear(x, weight, bias).float(), target, ...)`` (see
    remat.linear_cross_entropy) without the [tokens, vocab] logits.

    Parameters and state_dict keys are ``nn.Linear(in_features, out_features, bias)``'s:
    ``weight`` [vocab, hidden] and ``bias`` [vocab], so an lm_head's state_dict loads as is, and
    :meth:`from_module` shares an lm_head's (or a tied embedding's) parameters.

    Args:
        in_features: hidden size H. out_features: vocabulary size V.
        bias: learn a bias (default False, as most lm_heads).
        ignore_index, reduction, label_smoothing, softcap, z_loss, chunk_size, backend: as for
            remat.linear_cross_entropy, fixed per module.

    Mixed precision: parameters in another dtype than x (fp32 master weights, bf16 activations) are
    cast to x's dtype inside autograd, so their gradients arrive in their own dtype.
    """

    def __init__(self, in_features, out_features, bias=False, *, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, softcap=None, z_loss=0.0, chunk_size=None, backend=None, device=None,
                 dtype=None):
        super().__init__()
        checks.check_choice(reduction, "reduction", REDUCTIONS)
        checks.check_positive(softcap, "softcap")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.softcap, self.z_loss, self.chunk_size, self.backend = softcap, z_loss, chunk_size, backend
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        """nn.Linear's initialisation (Kaiming-uniform weight, uniform bias)."""
        if self.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_module(cls, stock, **options):
        """A LinearCrossEntropy sharing ``stock``'s parameters (no copy): an ``nn.Linear`` lm_head
        (with or without bias), or an ``nn.Embedding`` whose weight the lm_head ties. ``options``
        are the constructor's keyword arguments (ignore_index, reduction, ...)."""
        if isinstance(stock, nn.Linear):
            module = cls(stock.in_features, stock.out_features, bias=stock.bias is not None, device="meta", **options)
            module.weight = stock.weight
            module.bias = stock.bias
            return module
        if isinstance(stock, nn.Embedding):
            module = cls(stock.embedding_dim, stock.num_embeddings, bias=False, device="meta", **options)
            module.weight = stock.weight
            return module
        raise TypeError("from_module expects nn.Linear (an lm_head) or nn.Embedding (tied), got "
                        f"{type(stock).__name__}")

    def forward(self, x, target, *, return_lse=False):
        checks.check_input(x)
        return functional.linear_cross_entropy(
            x, checks.cast_like(self.weight, x), target, checks.cast_like(self.bias, x),
            ignore_index=self.ignore_index, reduction=self.reduction, label_smoothing=self.label_smoothing,
            softcap=self.softcap, z_loss=self.z_loss, return_lse=return_lse, chunk_size=self.chunk_size,
            backend=self.backend)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, softcap={self.softcap}, "
                f"z_loss={self.z_loss}, label_smoothing={self.label_smoothing}")
