"""remat: fused transformer-block kernels that save only the block inputs for backward and
recompute the fused intermediates inside the backward kernels."""

from remat import memory, nn
from remat.autograd.lora import LoRAAdapter
from remat.backend import BACKENDS, BackendUnavailableError, use_backend
from remat.checkpoint import Plan, checkpoint, checkpoint_sequential, plan
from remat.functional import (
    attention,
    dropout,
    gated_mlp,
    geglu_mlp,
    gelu_mlp,
    layer_norm,
    linear_cross_entropy,
    lora_linear,
    norm_attention,
    norm_gelu_mlp,
    norm_mlp,
    rms_norm,
    swiglu_mlp,
)
from remat.info import info
from remat.patch import PatchReport, patch, unpatch
from remat.planning.composed import estimate
from remat.planning.estimator import Estimate
from remat.planning.model_plan import ModelPlan, plan_model
from remat.trainer_callback import patch_callback

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "attention",
    "PatchReport",
    "Plan",
    "checkpoint",
    "checkpoint_sequential",
    "dropout",
    "Estimate",
    "estimate",
    "gated_mlp",
    "geglu_mlp",
    "gelu_mlp",
    "info",
    "layer_norm",
    "linear_cross_entropy",
    "LoRAAdapter",
    "lora_linear",
    "memory",
    "ModelPlan",
    "norm_attention",
    "norm_gelu_mlp",
    "nn",
    "norm_mlp",
    "patch",
    "patch_callback",
    "plan",
    "plan_model",
    "rms_norm",
    "swiglu_mlp",
    "unpatch",
    "use_backend",
]
__version__ = "0.1.0"
