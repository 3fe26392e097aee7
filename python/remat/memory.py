"""Saved-for-backward byte accounting, measured with torch.autograd.graph.saved_tensors_hooks."""

from typing import NamedTuple

import torch


class SavedTensor(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    is_parameter: bool


def _span(t):
    """Byte range [start, end) of the storage that tensor t covers."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return start, start + extent * t.element_size()


class SavedTensorLog:
    """Records every tensor autograd saves while active (a context manager).

    ``total_bytes`` counts each storage once, as the union of the byte ranges its saved views
    cover, and leaves out ``nn.Parameter`` tensors and views of them (they live whether or not
    backward runs).
    """

    def __init__(self):
        self.saved = []
        self._ranges = {}
        self._hooks = None

    def _pack(self, t):
        # A view of a parameter (a reshaped weight) shares the parameter's storage.
        is_param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        span = _span(t)
        self.saved.append(SavedTensor(tuple(t.shape), t.dtype, 0 if span is None else span[1] - span[0], is_param))
        if not is_param and span is not None:
            self._ranges.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(span)
        return t

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False

    @property
    def total_bytes(self):
        total = 0
        for spans in self._ranges.values():
            end_so_far = None
            for start, end in sorted(spans):
                if end_so_far is not None and start < end_so_far:
                    start = end_so_far
                if end > start:
                    total += end - start
                end_so_far = end if end_so_far is None else max(end_so_far, end)
        return total


def saved_bytes(fn, *args, **kwargs):
    """Bytes that autograd saves for backward while ``fn(*args, **kwargs)`` runs.

    Parameters are excluded and views of one storage count once. The output of ``fn`` is
    discarded, and with it the saved tensors.

    Returns:
        int, the number of bytes.
    """
    with SavedTensorLog() as log:
        fn(*args, **kwargs)
    return log.total_bytes
