"""Comparison helpers: the FlashAttention rule of DESIGN.md section 7."""

import torch

# Absolute floor, relative to the reference's largest magnitude, for when stock PyTorch happens
# to be exact: about half a unit in the last place of each dtype.
FLOOR = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3, torch.float64: 1e-12}


def max_error(value, reference):
    return (value.double() - reference.double()).abs().max().item() if reference.numel() else 0.0


def assert_within_2x_of_stock(name, value, stock, reference, dtype):
    """value's error against the float64 reference is at most twice stock PyTorch's error (the
    same computation done by stock PyTorch in ``dtype``), plus a small floor."""
    assert value.shape == reference.shape, f"{name}: shape {tuple(value.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(value).all(), f"{name}: non-finite values (an unwritten output?)"
    err = max_error(value, reference)
    stock_err = max_error(stock, reference)
    scale = max(1.0, reference.abs().max().item() if reference.numel() else 1.0)
    bound = 2 * stock_err + FLOOR[dtype] * scale
    assert err <= bound, f"{name}: error {err:.3e} > 2 x stock error {stock_err:.3e} + floor ({bound:.3e})"
