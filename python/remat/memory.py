"""Saved-for-backward byte accounting, measured with torch.autograd.graph.saved_tensors_hooks,
and what a forward really keeps alive, measured with a TorchDispatchMode (``retained_bytes``).

Every pack hook here hands autograd ``t.detach()``, never ``t``: a pack hook receives a saved
output with its ``grad_fn``, and the node's saved variable keeping that tensor makes a cycle (tensor
-> grad_fn -> saved variable -> packed tensor) through C++ that ``gc.collect()`` cannot break
(PyTorch's tensor traverse does not walk the autograd graph). A graph that no backward consumes
(a measured forward whose output is dropped) would stay alive for good, with every tensor it
saved. The detached tensor shares the storage and version counter; autograd puts the ``grad_fn``
back when it unpacks. For the same reason a pack hook holds no tensor that reaches the graph:
each saved variable keeps its pack hook (and what the hook references) as long as it lives.
"""

import gc
import weakref
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
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
        nbytes = 0 if span is None else span[1] - span[0]
        self.saved.append(SavedTensor(tuple(t.shape), t.dtype, nbytes, is_param))
        if not is_param and span is not None:
            self._ranges.setdefault(_storage_key(t), []).append(span)
        return t.detach()  # not t: see the module docstring

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
    union of the byte ranges its saved views cover). Autograd must run backward on this thread (CPU
    tensors) for the hooks to see the recomputation.
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
        return _Held(t.detach(), self, self._add(t))  # not t: see the module docstring

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


# Ops whose output is a tensor made outside the dispatcher (torch.tensor, torch.as_tensor,
# torch.from_numpy) and handed in as their input: the storage is new although it is an input.
_FRESH_OPS = ("aten::lift_fresh", "aten::lift_fresh_copy")


class RetainedStorage(NamedTuple):
    """A storage created during the forward and still alive after it (see RetainedTensorLog)."""

    nbytes: int
    device: torch.device
    shape: tuple  # of the first tensor seen on the storage
    dtype: torch.dtype
    op: str  # the operator that produced it
    saved: bool  # whether autograd saved a tensor on it for backward


def _storage_of(t):
    """t's untyped storage, or None for tensors without one (sparse, nested, some subclasses)."""
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError):
        return None


class _StorageTracker(TorchDispatchMode):
    """Sorts every storage that an operator touches into existing-before (first seen as an input)
    and created (first seen as an output), holding weak references only."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name not in _FRESH_OPS:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.log._note_input(t)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.log._note_output(t, func)
        return out


class RetainedTensorLog:
    """Measures what a forward keeps alive: a context manager around the forward, then
    :meth:`retained` with the forward's outputs.

    While active, a ``TorchDispatchMode`` sees every operator call (including those inside autograd
    Functions' forwards, the outputs of remat's C++ and Triton custom ops, and ``torch.tensor`` /
    ``torch.from_numpy`` through ``aten::lift_fresh``) and keeps a weak reference to each output
    tensor's storage; a storage first seen as an operator's input existed before (parameters, the
    caller's inputs, module buffers, views of them) and is never counted. The saved-tensor hooks
    record what autograd saves, as :class:`SavedTensorLog` does (``saved``, ``total_bytes``).

    Retained: after the block (and ``gc.collect()``, so reference cycles do not count), every
    storage created inside it that is still alive and is not a storage of ``outputs`` (nor one
    they view). Each storage counts once, by its whole ``nbytes``: a saved 1-element view of a
    large temporary keeps, and counts, the whole temporary. Holding the outputs keeps the autograd
    graph and so everything it references: ``save_for_backward``, tensors stashed on ``ctx``, in
    closures or in globals.

    Slack: none known; remat's blocks on the CPU retain exactly the storages they save (the 16-byte
    RNG states are saved too). Not seen: memory allocated inside an operator's implementation and
    kept outside its outputs (a C++ kernel's static workspace, allocator caches), memory that is not
    a tensor storage (numpy arrays, Python objects), and a tensor made without any operator call
    (returned by an extension's plain pybind function, not a registered op), which counts as
    existing before. Under ``torch.no_grad`` no graph exists and a forward that keeps nothing in
    globals retains 0 bytes. On the meta device storages count their nominal size.
    """

    def __init__(self):
        self.saved_log = SavedTensorLog()
        self._created = {}  # storage key -> (weakref to storage, shape, dtype, op name)
        self._existing = {}  # storage key -> weakref to storage
        self._saved_keys = set()
        self._mode = None

    # A storage key (the StorageImpl address) is reused once its storage is freed: an entry whose
    # weak reference died no longer says anything about the key.
    def _known(self, table, key):
        entry = table.get(key)
        if entry is None:
            return False
        ref = entry[0] if isinstance(entry, tuple) else entry
        if ref() is None:
            del table[key]
            return False
        return True

    def _note_input(self, t):
        storage = _storage_of(t)
        if storage is None:
            return
        key = storage._cdata
        if not self._known(self._created, key) and not self._known(self._existing, key):
            self._existing[key] = weakref.ref(storage)

    def _note_output(self, t, func):
        storage = _storage_of(t)
        if storage is None:
            return
        key = storage._cdata
        if not self._known(self._created, key) and not self._known(self._existing, key):
            self._created[key] = (weakref.ref(storage), tuple(t.shape), t.dtype, str(func))

    def _pack(self, t):
        storage = _storage_of(t)
        if storage is not None:
            self._saved_keys.add(storage._cdata)
        return self.saved_log._pack(t)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, SavedTensorLog._unpack)
        self._hooks.__enter__()
        self._mode = _StorageTracker(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._mode = None
        self._hooks.__exit__(*exc)
        return False

    @property
    def saved(self):
        return self.saved_log.saved

    @property
    def total_bytes(self):
        """Saved-for-backward bytes, as :func:`saved_bytes` counts them."""
        return self.saved_log.total_bytes

    def retained(self, outputs=()):
        """The storages created during the block that are alive now, less those of ``outputs``
        (any nesting of tuples, lists and dicts of tensors). Call it while the outputs are alive."""
        gc.collect()
        excluded = set()
        for t in tree_leaves(outputs):
            if isinstance(t, torch.Tensor):
                storage = _storage_of(t)
                if storage is not None:
                    excluded.add(storage._cdata)
        kept = []
        for key, (ref, shape, dtype, op) in list(self._created.items()):
            storage = ref()
            if storage is None or key in excluded:
                continue
            kept.append(RetainedStorage(storage.nbytes(), storage.device, shape, dtype, op,
                                        key in self._saved_keys))
        return kept

    def retained_bytes(self, outputs=()):
        """Bytes of :meth:`retained`."""
        return sum(s.nbytes for s in self.retained(outputs))


def retained_bytes(fn, *args, **kwargs):
    """Bytes that ``fn(*args, **kwargs)`` keeps alive through its outputs (or anywhere else) after
    it returns: storages created during the call, still alive while its outputs are, other than
    the outputs' own storages. Parameters and the caller's inputs existed before and never count;
    each storage counts once, by its whole size (see :class:`RetainedTensorLog`).

    For a forward that keeps only what it saves for backward this equals the bytes it saves for
    storages it created: ``saved_bytes`` less the saved inputs and outputs. A tensor stashed on
    ``ctx`` outside ``save_for_backward`` counts here and not in ``saved_bytes``.

    Returns:
        int, the number of bytes.
    """
    with RetainedTensorLog() as log:
        out = fn(*args, **kwargs)
    return log.retained_bytes(out)
