"""Loads the compiled extension remat._C, which registers the torch.ops.remat operators."""

import torch  # noqa: F401  (the extension links against torch's libraries)

try:
    from remat import _C  # noqa: F401  (importing it registers the operators)

    LOADED = True
    LOAD_ERROR = None
except ImportError as error:
    LOADED = False
    LOAD_ERROR = str(error)

try:
    from remat import _build_info

    WITH_CUDA = LOADED and _build_info.WITH_CUDA
    CUDA_ARCHS = _build_info.CUDA_ARCHS if WITH_CUDA else ""
except ImportError:
    WITH_CUDA = False
    CUDA_ARCHS = ""
