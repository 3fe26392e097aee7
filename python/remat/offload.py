"""Host offload of what decoder layers keep for backward.

With offload on, every tensor that autograd saves inside a layer's forward (its input under a
checkpointed layer; its policy's saved tensors otherwise) goes to host memory when that forward
ends (not when saved: a Function may still write a saved tensor in place later in its forward,
as rope rotating the kept q and k), and comes back to the device one layer ahead of that layer's
backward:

- Out: on a CUDA device the copy runs on a side stream (one per device) after the work that made
  the tensor, into pinned host memory cut in pieces whose sizes are powers of two (:func:`host_pieces`;
  PyTorch's caching host allocator rounds every pinned block up to a power of two and reuses the
  blocks from step to step: one block of 8.5 GiB would hold 16); the device tensor's block is held
  for the side stream (``record_stream``) and
  returns to the allocator when the copy is done, so compute never waits for it.
- Back: the first time backward unpacks a tensor of layer i, layer i's tensors are brought back
  (on the side stream, waited on by the compute stream) unless they already are, and, with
  ``prefetch`` (the default), layer i - 1's copies (the next layer backward reaches) start on the
  side stream, each with an event the compute stream waits on before its first use. Without
  prefetch a layer's tensors come back only when its backward first needs them: the device holds
  one layer's kept tensors instead of two, and compute waits for that copy (at long context a
  small part of the layer's attention time: 8 GiB over a ~25 GB/s host link is ~0.3 s against
  seconds of attention at a million tokens; not measured on a GPU).

What stays on the device: parameters and views of them, and tensors below :data:`MIN_BYTES` (RNG
states, per-row statistics of short sequences). Views of one storage saved in one layer (a tensor
and its reshape, or the same tensor twice) share one copy of the storage span they cover. Host
copies live as long as the saved tensor would have: they are freed when they come back, or with
the graph if no backward runs.

The copies are exact: gradients equal those without offload bitwise. Under ``FakeTensorMode``
(``remat.estimate``) the same path runs on fake tensors, host copies are fake CPU tensors (the
estimate's ``host_bytes``) and nothing reaches the CUDA runtime: no stream, event or pinned
allocation. On a CPU device the host copy is a second CPU tensor (what the tests exercise); it
saves nothing there.

The CUDA path (side stream, events, pinned memory, record_stream) has not run on a GPU yet: the
CPU and fake paths are what the tests exercise.
"""

import contextlib
import threading
import weakref

import torch

from remat.checks import values_unknown

# Saved tensors smaller than this stay on the device: their copy would cost more in latency than
# the bytes are worth.
MIN_BYTES = 1 << 20


def _is_parameter(t):
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class _Block:
    """A span of one storage's elements on the host: what the saved views of that storage in one
    layer share (a tensor and a reshaped view of it are copied once)."""

    __slots__ = ("pending", "host", "device", "dtype", "fetched", "ready", "layer", "owner", "start", "end",
                 "__weakref__")

    def __init__(self, pending, device, layer, owner, start, end):
        self.pending = pending  # 1-D device view of the storage's elements [start, end), until copied
        self.host = None  # its host copy (uint8 pieces: host_pieces), made when the layer's forward ends
        self.device = device
        self.dtype = pending.dtype
        self.fetched = None  # the device copy, once brought back
        self.ready = None  # the CUDA event the compute stream waits on before using ``fetched``
        self.layer = layer
        self.owner = owner
        self.start, self.end = start, end

    def drop_host(self):
        if self.host is not None:
            self.owner._released(sum(piece.numel() for piece in self.host))
            self.host = None

    def __del__(self):
        self.drop_host()


class _Offloaded:
    """What the pack hook hands autograd for a saved tensor: its block and where the view lies
    in it."""

    __slots__ = ("block", "shape", "stride", "offset")

    def __init__(self, block, shape, stride, offset):
        self.block, self.shape, self.stride, self.offset = block, shape, stride, offset


class _LayerRecord:
    """The blocks of one layer's forward, in order, and whether they are back."""

    __slots__ = ("index", "blocks", "fetching", "seen")

    def __init__(self, index):
        self.index = index
        self.blocks = []  # weak references: the graph owns the blocks (through the handles)
        self.fetching = False
        self.seen = {}  # (storage key, dtype) -> [blocks], during the forward


def _span(t):
    """[start, end) of the storage elements (of t's dtype) that view t covers."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset(), t.storage_offset() + extent


class HostOffload:
    """Moves what the layers of one model save for backward to host memory and back (module
    docstring). One object per patched model; each layer's forward runs in :meth:`layer`.

    Args:
        min_bytes: saved tensors smaller than this stay on the device (default :data:`MIN_BYTES`).
        prefetch: bring layer i - 1's tensors back when layer i's backward starts (default True).

    Attributes:
        host_bytes: bytes now held on the host by this object's copies.
        peak_host_bytes: the most held at once since creation.
        copied_bytes: bytes copied to the host so far (each copy once).
    """

    def __init__(self, min_bytes=MIN_BYTES, prefetch=True):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch must be a bool, got {prefetch!r}")
        self.min_bytes, self.prefetch = min_bytes, prefetch
        self._records = {}  # layer index -> _LayerRecord of the current step
        self._streams = {}  # CUDA device index -> side stream
        self._lock = threading.Lock()
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.copied_bytes = 0

    def __getstate__(self):
        # Streams, events and host copies belong to a running step, not to a saved model.
        return {"min_bytes": self.min_bytes, "prefetch": self.prefetch}

    def __setstate__(self, state):
        self.__init__(state["min_bytes"], state.get("prefetch", True))

    @contextlib.contextmanager
    def layer(self, index):
        """Runs a layer's forward (layer ``index`` in forward order) with its saved tensors
        offloaded. Outside grad mode it does nothing."""
        if not torch.is_grad_enabled():
            yield
            return
        record = _LayerRecord(index)
        self._records[index] = record
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, record), self._unpack):
            yield
        # Copied when the forward ends, not when saved: a Function may write a saved tensor in
        # place later in the same forward (rope rotating the kept q and k), and backward reads it
        # as it is then.
        record.seen = {}
        for ref in record.blocks:
            block = ref()
            if block is not None and block.pending is not None:
                block.host = self._to_host(block.pending)
                block.pending = None

    # -- out ------------------------------------------------------------------------------------

    def _pack(self, t, record):
        if _is_parameter(t) or t.numel() * t.element_size() < self.min_bytes:
            return t.detach()  # not t: see remat.memory's module docstring
        start, end = _span(t)
        blocks = record.seen.setdefault((t.untyped_storage()._cdata, t.dtype), [])
        block = next((b for b in blocks if b.start <= start and end <= b.end), None)
        if block is None:
            flat = t.detach().as_strided((end - start,), (1,), start)
            block = _Block(flat, t.device, record, self, start, end)
            blocks.append(block)
            record.blocks.append(weakref.ref(block))
        return _Offloaded(block, tuple(t.shape), tuple(t.stride()), t.storage_offset() - block.start)

    def _to_host(self, t):
        """The host copy of the 1-D contiguous device span ``t``: a list of uint8 tensors, one per
        :func:`host_pieces` piece of its bytes (pinned on a GPU, so PyTorch's caching host
        allocator, which rounds every pinned block up to a power of two, holds no more than the
        bytes: an 8.5 GiB span takes 8 + 0.5 GiB, not 16)."""
        nbytes = t.numel() * t.element_size()
        data = t.view(torch.uint8)
        pieces = []
        if t.device.type == "cuda" and not values_unknown(t):
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                for start, size in host_pieces(nbytes):
                    piece = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    piece.copy_(data[start:start + size], non_blocking=True)
                    pieces.append(piece)
            t.record_stream(stream)  # the block returns to the allocator when the copies are done
        else:
            # Fake tensors (an estimate) and the CPU: plain copies, no stream.
            for start, size in host_pieces(nbytes):
                pieces.append(torch.empty(size, dtype=torch.uint8, device="cpu").copy_(data[start:start + size]))
        with self._lock:
            self.host_bytes += nbytes
            self.copied_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return pieces

    def _released(self, nbytes):
        with self._lock:
            self.host_bytes -= nbytes

    def _side_stream(self, device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    # -- back -----------------------------------------------------------------------------------

    def _unpack(self, handle):
        if not isinstance(handle, _Offloaded):
            return handle
        block = handle.block
        if block.pending is not None:  # unpacked inside the forward that saved it: not copied yet
            return block.pending.as_strided(handle.shape, handle.stride, handle.offset)
        record = block.layer
        if not record.fetching:
            self._fetch(record)
        previous = self._records.get(record.index - 1) if self.prefetch else None
        if previous is not None and not previous.fetching:
            self._fetch(previous)  # one layer ahead: the next one backward reaches
        if block.ready is not None:
            current = torch.cuda.current_stream(block.device)
            current.wait_event(block.ready)
            block.fetched.record_stream(current)  # made on the side stream, used and freed here
            block.ready = None
        return block.fetched.as_strided(handle.shape, handle.stride, handle.offset)

    def _fetch(self, record):
        record.fetching = True
        if self._records.get(record.index) is record:
            del self._records[record.index]
        for ref in record.blocks:
            block = ref()
            if block is None or block.host is None:
                continue
            host = block.host
            dtype, count = block.dtype, block.end - block.start
            if block.device.type == "cuda" and not values_unknown(host[0]):
                stream = self._side_stream(block.device)
                with torch.cuda.stream(stream):
                    block.fetched = _gathered(host, dtype, count, block.device, non_blocking=True)
                    block.ready = torch.cuda.Event()
                    block.ready.record(stream)
            else:
                block.fetched = _gathered(host, dtype, count, block.device)
            # Dropped now: a pinned block handed to a non-blocking copy is not reused by PyTorch's
            # caching host allocator before that copy's event completes.
            block.drop_host()
            host = None
        record.blocks = []


# The smallest piece a host copy is cut into (host_pieces): the last piece, rounded up to a power of
# two by the caching host allocator, wastes less than this per offloaded span.
PIECE_MIN_BYTES = 2 << 20


def host_pieces(nbytes):
    """[(byte offset, size)] covering ``nbytes``: powers of two from the largest down while more
    than :data:`PIECE_MIN_BYTES` remain, then the rest (the binary digits of ``nbytes`` above
    that). Pinned host blocks of those sizes are not inflated by PyTorch's power-of-two rounding
    (remat.planning.estimator.pinned_host_bytes), except the last, by less than PIECE_MIN_BYTES."""
    pieces, start, remaining = [], 0, int(nbytes)
    while remaining > PIECE_MIN_BYTES:
        size = 1 << (remaining.bit_length() - 1)
        pieces.append((start, size))
        start, remaining = start + size, remaining - size
    if remaining:
        pieces.append((start, remaining))
    return pieces


def _gathered(pieces, dtype, count, device, non_blocking=False):
    """A new 1-D tensor of ``count`` elements of ``dtype`` on ``device`` from the uint8 host
    ``pieces`` (in order)."""
    out = torch.empty(count, dtype=dtype, device=device)
    data = out.view(torch.uint8)
    start = 0
    for piece in pieces:
        data[start:start + piece.numel()].copy_(piece, non_blocking=non_blocking)
        start += piece.numel()
    return out


def offload_scope(offload, index):
    """The context a layer's forward runs in: ``offload.layer(index)``, or nothing without one."""
    if offload is None:
        return contextlib.nullcontext()
    return offload.layer(index)
