"""Plain PyTorch norms (``torch.nn.RMSNorm``, ``torch.nn.LayerNorm``, exact types, no subclasses),
replaced one by one in any model."""

from torch import nn

from remat.models.registry import Family, Part
from remat.nn.norm import LayerNorm, RMSNorm

FAMILY = Family(
    name="torch",
    parts=(
        Part("norm", (nn.RMSNorm,), RMSNorm.from_module),
        Part("norm", (nn.LayerNorm,), LayerNorm.from_module),
    ),
)
