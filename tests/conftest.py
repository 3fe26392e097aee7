"""Shared test setup.

Every torch.empty result (from Python and from the C++ extension's at::empty alike) is filled
with NaN, so an output element a kernel forgot to write fails loudly: PyTorch does this when
deterministic algorithms are on and fill_uninitialized_memory is set.
"""

import os

import pytest
import torch

# Deterministic algorithms on CUDA need a fixed cuBLAS workspace (set before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

torch.use_deterministic_algorithms(True)
torch.utils.deterministic.fill_uninitialized_memory = True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
