"""Public functions, one module per block: argument checks and reshaping, then the autograd
Function.

Every function checks its inputs and raises TypeError / ValueError naming the argument before any
kernel runs, and never writes into a tensor it was handed.
"""

from remat.functional.attention import attention, norm_attention
from remat.functional.cross_entropy import linear_cross_entropy
from remat.functional.dropout import dropout
from remat.functional.lora import lora_linear
from remat.functional.mlp import gated_mlp, geglu_mlp, gelu_mlp, norm_gelu_mlp, norm_mlp, swiglu_mlp
from remat.functional.norm import layer_norm, rms_norm

__all__ = [
    "attention",
    "dropout",
    "gated_mlp",
    "geglu_mlp",
    "gelu_mlp",
    "layer_norm",
    "linear_cross_entropy",
    "lora_linear",
    "norm_attention",
    "norm_gelu_mlp",
    "norm_mlp",
    "rms_norm",
    "swiglu_mlp",
]
