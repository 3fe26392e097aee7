"""remat: fused transformer-block kernels that save only the block inputs for backward and
recompute the fused intermediates inside the backward kernels."""

from remat import memory, nn
from remat.checkpoint import Plan, checkpoint, checkpoint_sequential, plan
from remat.backend import BACKENDS, BackendUnavailableError, use_backend
from remat.functional import layer_norm, rms_norm
from remat.info import info

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "Plan",
    "checkpoint",
    "checkpoint_sequential",
    "info",
    "layer_norm",
    "memory",
    "nn",
    "plan",
    "rms_norm",
    "use_backend",
]
__version__ = "0.1.0"
