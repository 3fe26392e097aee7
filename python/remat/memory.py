"""Saved-for-backward byte accounting, measured with torch.autograd.graph.saved_tensors_hooks."""

from typing import NamedTuple

import torch


class SavedTensor(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    is_parameter: bool


def _storage_key(t):
    """Identifies t's storage (the C++ StorageImpl), also for meta tensors, whose data pointers
    are all null."""
    return t.untyped_storage()._cdata


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
            self._ranges.setdefault(_storage_key(t), []).append(span)
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
        return sum(_union_bytes(spans) for spans in self._ranges.values())


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


_active_peak_trackers = []


class _Held:
    """What a PeakSavedBytes pack hook hands autograd: the saved tensor, plus a release of its bytes
    when autograd drops it (after the node's backward, or with the graph)."""

    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tensor, tracker, key):
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self):
        if self.key is not None:
            self.tracker._release(self.key)


class PeakSavedBytes:
    """Tracks the bytes saved for backward that are alive, over forward and backward, and their
    peak (a context manager around both passes).

    Saved tensors are counted from autograd's pack hook until autograd releases them; tensors that
    remat's checkpoint executor holds itself (checkpoints between segments) are counted while held.
    Parameters and views of them are excluded; a storage saved several times counts once (the
    union of the byte ranges its saved views cover). Autograd must run backward on this thread (CPU tensors) for the hooks to
    see the recomputation.
    """

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._live = {}
        self._hooks = None

    def _add(self, t):
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return None
        span = _span(t)
        if span is None:
            return None
        storage = _storage_key(t)
        entry = self._live.setdefault(storage, [])
        before = _union_bytes(entry)
        entry.append(span)
        self.current += _union_bytes(entry) - before
        self.peak = max(self.peak, self.current)
        return storage, span

    def _release(self, key):
        storage, span = key
        entry = self._live.get(storage)
        if not entry:
            return
        before = _union_bytes(entry)
        entry.remove(span)
        self.current -= before - _union_bytes(entry)
        if not entry:
            del self._live[storage]

    def hold(self, t):
        """Count ``t`` as held until :meth:`release` is called with the returned key."""
        return self._add(t)

    def release(self, key):
        if key is not None:
            self._release(key)

    def _pack(self, t):
        return _Held(t, self, self._add(t))

    @staticmethod
    def _unpack(held):
        return held.tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _active_peak_trackers.append(self)
        return self

    def __exit__(self, *exc):
        _active_peak_trackers.remove(self)
        self._hooks.__exit__(*exc)
        return False


def _union_bytes(spans):
    total, end_so_far = 0, None
    for start, end in sorted(spans):
        if end_so_far is not None and start < end_so_far:
            start = end_so_far
        if end > start:
            total += end - start
        end_so_far = end if end_so_far is None else max(end_so_far, end)
    return total


def note_held(t):
    """Called by remat's executors for tensors they hold for backward (checkpoints); returns keys
    for :func:`note_released`. A no-op unless a PeakSavedBytes tracker is active."""
    return [(tracker, tracker.hold(t)) for tracker in _active_peak_trackers]


def note_released(keys):
    for tracker, key in keys:
        tracker.release(key)
