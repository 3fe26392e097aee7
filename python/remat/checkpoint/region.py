"""``remat.checkpoint``: activation checkpointing of one region."""

import torch
import torch.utils.checkpoint


def checkpoint(fn, *args, preserve_rng_state=True, **kwargs):
    """Runs ``fn(*args, **kwargs)`` keeping none of its intermediates for backward; backward
    re-runs ``fn`` to recompute them.

    Non-reentrant (saved-tensor hooks): works with ``torch.autograd.grad``, keyword arguments,
    nesting, and inputs that do not require grad. The re-run sees the CPU and CUDA RNG state and
    the autocast state (CPU and CUDA, enabled and dtype) of the original run, so dropout masks and
    autocast casts repeat exactly. This is PyTorch's own non-reentrant implementation
    (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``), with its argument checked.

    Args:
        fn: a callable.
        *args, **kwargs: passed to ``fn``.
        preserve_rng_state: restore the RNG state for the re-run (default True).

    Returns:
        what ``fn`` returns.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {type(preserve_rng_state).__name__}")
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
    )
