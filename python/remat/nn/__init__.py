"""Drop-in modules with the constructor arguments and state_dict keys of their stock counterparts,
one module per block (norm, mlp, attention; layers holds the decoder-layer skeleton the model
families share). ``from_module`` converts a stock module, sharing its parameters.

The whole decoder layers of the model families live in remat.models and are re-exported here.
"""

from remat.models.gemma import GemmaLayer  # noqa: E402  (the families build on the modules above)
from remat.models.gpt2 import Conv1D, GPT2Layer  # noqa: E402
from remat.models.llama import LlamaLayer  # noqa: E402
from remat.models.phi3 import Phi3Layer  # noqa: E402
from remat.models.qwen3 import Qwen3Layer  # noqa: E402
from remat.nn.attention import Attention, QKNormAttention
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer
from remat.nn.loss import LinearCrossEntropy
from remat.nn.mlp import GELUMLP, SwiGLUMLP
from remat.nn.norm import GemmaRMSNorm, LayerNorm, RMSNorm

__all__ = [
    "Attention",
    "Conv1D",
    "GELUMLP",
    "GPT2Layer",
    "GemmaLayer",
    "GemmaRMSNorm",
    "LAYER_POLICIES",
    "LayerNorm",
    "LinearCrossEntropy",
    "LlamaLayer",
    "Phi3Layer",
    "PreNormDecoderLayer",
    "QKNormAttention",
    "Qwen3Layer",
    "RMSNorm",
    "SwiGLUMLP",
]
