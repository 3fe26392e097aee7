"""What fits: the device peak of one training step, predicted without running it.

:func:`estimate` runs a model's forward and backward on fake tensors (``FakeTensorMode``: shapes,
dtypes and devices, no data and no kernels) and counts the bytes of every tensor storage alive at
each moment, from the operator that creates it to the moment its last reference dies. That is
what the CUDA caching allocator reports as allocated (``torch.cuda.max_memory_allocated``), up to
its rounding of each block to 512 bytes, which the count applies for a CUDA target. The same run
works for a model on the CPU, where a real step can be measured against it.

A CUDA target needs no GPU: the model is built on fake CUDA tensors (``remat.planning.fit`` does it from a
Hugging Face config). Two parts of PyTorch need the device itself and are stood in for:

- The autograd engine asks the CUDA runtime for each device's primary context before a backward
  over CUDA tensors (``GraphTask::stash_current_streams``), which fails without a driver. A
  backward over fake CUDA tensors therefore runs in :class:`GraphWalk`, a walk of the autograd
  graph in the engine's own order (ready nodes by descending sequence number, gradient
  accumulators first) that calls each node, accumulates incoming gradients as the engine does for
  tensor subclasses (out of place) and frees a node's saved tensors right after it runs (as the
  engine's ``release_variables``). On fake CPU tensors the walk and the engine reach the same
  peak (tested). A real run's engine adds a second gradient into a plain tensor it holds alone in
  place (input_buffer.cpp, can_accumulate_inplace), so where such a sum falls on the peak the
  estimate counts one gradient more than a GPU would hold (an over-count, never an under-count).
- Hugging Face's mask preparation (``masking_utils.find_packed_sequence_indices``) cannot read
  fake position ids and assumes packed rows, which builds a [B, 1, N, N] mask that a real run over
  dense rows never makes (and that keeps SDPA off its fused kernels). The rows of an estimate are
  dense by construction, so for its duration that function answers "not packed" for fake position
  ids (:func:`_dense_rows_in_hugging_face`; real tensors still get the real function).
- remat's fused loss allocates inside its op (one chunk of logits, the fp32 dx accumulator and,
  on a GPU with 16-bit inputs, cuBLAS's fp32 product): :func:`cross_entropy_scratch_bytes` adds
  it for the call's duration, for every target.
- The CUDA attention backward kernels allocate scratch inside the call (FlashAttention-2's fp32
  dq accumulator and, with GQA, Hq-head dk/dv; cuDNN's workspace), which a fake kernel does not:
  :func:`kernel_scratch_bytes` adds it for the call's duration.
- On a CPU target, PyTorch's CPU flash attention kernels (SDPA's CPU kernel, and remat's aten
  attention core, which calls them per query tile in a tiled backward) allocate per-thread blocks
  of scores and probabilities inside the call: :func:`cpu_flash_attention_scratch_bytes` adds them
  for the call's duration. A tiled step's peak is inside such a backward call (up to 7% of a tiny
  model's peak in tests).
- remat's mixture-of-experts block counts the rows routed to each expert on the host, which a
  fake tensor cannot answer: under an estimate every expert gets an equal share
  (``remat.autograd.moe.balanced_expert_counts``), and :attr:`Estimate.assumptions` says so.
  Hugging Face's own experts (``experts_implementation="grouped_mm"``, its default) have static
  shapes and need no assumption; its "eager" experts (``nonzero``) cannot be estimated.
- Code that asks ``torch.cuda.get_device_capability`` (Hugging Face's grouped-GEMM experts) gets
  the simulated GPU's capability (``cuda_capability``) for the estimate's duration.
- ``F.scaled_dot_product_attention`` picks its kernel from the device's properties; on a fake CUDA
  tensor that query falls back to the math kernel, which materialises the [B, H, N, M] scores no
  real GPU run would. The estimate runs SDPA as the flash kernel does on an sm_80+ GPU (output,
  fp32 logsumexp; backward: fp32 dq accumulator) where flash applies (no mask, head dim <= 256,
  16-bit dtype) and as the memory-efficient kernel otherwise.

Not counted: on a CPU target, what ATen's 16-bit CPU GEMMs allocate inside a call (their copies,
also those inside the CPU flash attention kernels; none of it on a GPU target); tensors made
outside PyTorch's dispatcher, such as the CPU RNG state (5,056 bytes) ``torch.utils.checkpoint``
stashes per checkpointed region (host memory for a GPU target), memory a kernel allocates and
frees inside one call (cuBLAS workspaces, the allocator's fragmentation and cache), the CUDA
context (about 0.5 GiB, part of the reserve the budget leaves), and anything outside tensor
storages.
"""

import bisect
import contextlib
import dataclasses
import heapq
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.autograd.common import refuse_double_backward
from remat.backend import simulated_gpu
from remat.memory import _storage_of
from remat.sequences import SEQUENCE_PARALLEL_FLAG

# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK_BYTES = 512

KINDS = ("parameters", "gradients", "optimizer", "saved", "other")


def is_fake(t):
    """Whether ``t`` is a fake tensor (shapes only, no data): value checks cannot run on it."""
    return isinstance(t, FakeTensor)


@dataclasses.dataclass
class Estimate:
    """One training step's predicted memory.

    Attributes:
        peak_bytes: the most device bytes alive at once over the step (parameters included).
        host_bytes: the most host (CPU) bytes that the step keeps for a device target (offloaded
            tensors; for a CUDA target as pinned blocks, each rounded up to a power of two by
            PyTorch's caching host allocator: :func:`pinned_host_bytes`); 0 for a CPU target, whose
            bytes are all in ``peak_bytes``.
        phases: peak device bytes per phase (``"forward"``, ``"backward"``, ``"optimizer"``).
        breakdown: device bytes by kind at the peak (``KINDS``: parameters and buffers, gradients
            of trainable parameters, optimizer states, tensors saved for backward, other:
            activations in flight, the backward's working set, the loss).
        peak_phase: the phase in which the peak happened.
        after_forward_bytes: device bytes alive when the forward has returned (parameters, what
            is kept for backward, the loss): what the backward starts from.
        device: the target device.
        tokens: batch_size * seq_len of the step.
        assumptions: what the step had to assume where fake tensors hold no data (sorted texts;
            empty for dense models): remat's mixture-of-experts blocks assume balanced routing.
        method: how the numbers were reached (remat.planning.composed: composed from a few layers, or
            simulated whole and why); empty from this module's :func:`estimate` alone.
    """

    peak_bytes: int
    host_bytes: int
    phases: dict
    breakdown: dict
    peak_phase: str
    device: torch.device
    tokens: int
    after_forward_bytes: int = 0
    assumptions: tuple = ()
    method: str = ""
    # With ``segments=`` layers: {(phase, place): the most device bytes alive while it ran}, place the
    # layer's index in that list, or "outside" (embedding, final norm, head and loss).
    segment_peaks: dict = dataclasses.field(default_factory=dict)

    def __str__(self):
        parts = ", ".join(f"{kind} {format_bytes(self.breakdown.get(kind, 0))}" for kind in KINDS)
        assumed = "".join(f"; assumed: {text}" for text in self.assumptions)
        return (f"peak {format_bytes(self.peak_bytes)} on {self.device} in the {self.peak_phase} ({parts}); "
                f"host {format_bytes(self.host_bytes)}; {self.tokens} tokens{assumed}")


# One set per estimate running (innermost last): what the step assumed where fake tensors lack data.
_ASSUMPTIONS = []


def note_assumption(text):
    """Records ``text`` on the estimate running now (:attr:`Estimate.assumptions`); no-op outside
    one. Code that must stand in for data a fake tensor lacks (expert routing) calls it."""
    if _ASSUMPTIONS:
        _ASSUMPTIONS[-1].add(text)


def estimating():
    """Whether an :func:`estimate` is running (on this thread's step): code that would move data
    between processes (remat.sequence_parallel's all-to-alls) then only allocates its buffers."""
    return bool(_ASSUMPTIONS)


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def kernel_scratch_bytes(func, args, device_type="cuda"):
    """The memory a kernel takes from the allocator for the length of one call, on top of its
    outputs (a fake tensor's kernel allocates only the outputs), for a target of ``device_type``;
    0 for any other operator:

    - remat's fused linear + cross-entropy (csrc/cross_entropy, the cpp and cuda backends; the
      triton backend, kernels/cross_entropy.py): :func:`cross_entropy_scratch_bytes`.

    on a CPU target, PyTorch's CPU flash attention kernels:

    - ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (SDPA on the CPU,
      remat's aten attention core): :func:`cpu_flash_attention_scratch_bytes`.

    and on a CUDA target, PyTorch's attention backward kernels:

    - ``aten._flash_attention_backward`` (FlashAttention-2's mha_bwd / mha_varlen_bwd): the fp32 dq
      accumulator ``[B, N rounded to 128, Hq, D rounded to 32]`` (varlen: ``[T + 128 B, Hq, D]``),
      the fp32 softmax_d ``[B, Hq, N rounded]``, and with GQA the Hq-head dk and dv ``[B, M, Hq,
      D]`` it sums over each group afterwards.
    - ``aten._scaled_dot_product_cudnn_attention_backward``: cuDNN sizes its workspace at run
      time; it is counted as the same fp32 dq accumulator and softmax sum ``[B, Hq, N, D + 1]``
      (cuDNN's flash backward accumulates dQ in fp32), an assumption until a GPU run measures it
      (the gpu-marked estimate test compares with a real peak).
    """
    if not _CROSS_ENTROPY_OPS:  # filled at the first call, once remat's ops are registered
        _CROSS_ENTROPY_OPS.update(_cross_entropy_ops())
    if func in _CROSS_ENTROPY_OPS:
        return cross_entropy_scratch_bytes(_CROSS_ENTROPY_OPS[func], args, device_type)
    if device_type == "cpu":
        return cpu_flash_attention_scratch_bytes(func, args)
    if device_type != "cuda":
        return 0
    if func is torch.ops.aten._flash_attention_backward.default:
        query, key = args[1], args[2]
        varlen = query.dim() == 3
        if varlen:
            (total, heads, dim), batch = query.shape, args[6].numel() - 1
            rows = total + 128 * batch
            keys = key.shape[0]
        else:
            batch, n, heads, dim = query.shape
            rows, keys = batch * _round_up(n, 128), batch * key.shape[1]
        accumulator = 4 * rows * heads * _round_up(dim, 32)
        softmax_d = 4 * rows * heads
        kv_heads = key.shape[-2]
        expanded = 2 * keys * heads * dim * key.element_size() if kv_heads != heads else 0
        return accumulator + softmax_d + expanded
    if func is torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default:
        batch, heads, n, dim = args[1].shape
        return 4 * batch * heads * n * (dim + 1)
    return 0


# PyTorch's CPU flash attention splits the queries into blocks of 256 rows from 768 queries on, of
# 64 from 192 on, else of 32, and the keys into blocks of 512 (FlashAttentionKernel.cpp,
# flash_attention_kernel_impl and flash_attention_backward_kernel_impl).
_CPU_FLASH_KV_SPLIT = 512


def _cpu_flash_q_split(queries):
    return 256 if queries >= 768 else 64 if queries >= 192 else 32


def cpu_flash_attention_scratch_bytes(func, args, threads=None):
    """What PyTorch's CPU flash attention kernels allocate inside one call beyond their outputs (0
    for any other operator): read from the kernels' source (aten/src/ATen/native/cpu/
    FlashAttentionKernel.cpp) and equal to the profiler's allocator records of real calls in fp32
    (PyTorch 2.14, 1, 2 and 4 threads, 32 to 300 queries; tests/test_estimate.py) and of the bf16
    forward; the bf16 backward allocates more (below). The operator's q is
    [B, Hq, N, D], k [B, Hkv, M, D]; the kernels work on blocks of Qs = min(N, 32, 64 from 192
    queries on, 256 from 768 on) queries and Ks = min(M, 512) keys, with per-thread buffers for T =
    ``threads`` threads (default ``torch.get_num_threads()``: at::get_num_threads() sizes them
    whatever the shapes); "accumulation type": fp32 for 16-bit and fp32 inputs, fp64 for fp64.

    - ``aten._scaled_dot_product_flash_attention_for_cpu``: ``buf`` [T, Qs Ks + 2 Qs + Qs D] in the
      accumulation type (a block of scores, the row maxima and sums, the output block) and, for
      16-bit inputs, ``buf_reduced`` [T, Qs, Ks] in the input's dtype.
    - ``aten._scaled_dot_product_flash_attention_for_cpu_backward``: ``buf`` [T, 2 Qs Ks] in the
      accumulation type (a block of probabilities and one of their gradients), for 16-bit inputs
      ``buf_reduced`` [T, 2 Qs Ks] in the input's dtype, ``dsum`` [Qs] in the accumulation type
      per thread the B Hq heads are split over (min(T, B Hq)), and a contiguous copy of grad_out
      where grad_out as [B, N, Hq, D] is not contiguous (``grad_out.contiguous()`` in
      flash_attention_backward_kernel_impl; remat's aten core passes a contiguous one). The
      profiler records the calling thread's allocations only: a measured peak in this call is
      (T - 1) Qs dsum elements below the count.

    Both live for the length of the call. Not counted: with 16-bit inputs, the GEMMs inside the
    kernels (cpublas::gemm) allocate and free buffers of their own: a bf16 backward call peaked 13
    KiB (32 queries) to 225 KiB (800 queries, D 64) above this count at 1 thread, about twice that
    at 2 (profiled 2026-12-06); with fp16
    on a CPU whose oneDNN packs fp16 (AMX-FP16), the forward's packed copies of k and v, made with
    ``new`` outside the tensor allocator.
    """
    forward = func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if not forward and func is not torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return 0
    grad_out, query, key = (None, *args[:2]) if forward else args[:3]
    threads = torch.get_num_threads() if threads is None else threads
    batch, heads, queries, dim = query.shape
    keys = key.shape[2]
    q_split = min(queries, _cpu_flash_q_split(queries))
    kv_split = min(keys, _CPU_FLASH_KV_SPLIT)
    element = query.element_size()
    accumulate = 8 if query.dtype == torch.float64 else 4
    reduced = query.dtype in (torch.float16, torch.bfloat16)
    if forward:
        scratch = threads * (q_split * kv_split + 2 * q_split + q_split * dim) * accumulate
        return scratch + (threads * q_split * kv_split * element if reduced else 0)
    scratch = threads * 2 * q_split * kv_split * accumulate
    if reduced:
        scratch += threads * 2 * q_split * kv_split * element
    scratch += min(threads, batch * heads) * q_split * accumulate
    if not grad_out.transpose(1, 2).is_contiguous():
        scratch += grad_out.numel() * grad_out.element_size()
    return scratch


def _cross_entropy_ops():
    """{operator: (implementation, pass)} of remat's fused cross-entropy ops that are registered."""
    table = {}
    for namespace, implementation in (("remat", "extension"), ("remat_triton", "triton")):
        library = getattr(torch.ops, namespace)
        for name, which in (("linear_cross_entropy_fwd", "forward"), ("linear_cross_entropy_bwd", "backward")):
            if hasattr(library, name):
                table[getattr(library, name).default] = (implementation, which)
    return table


_CROSS_ENTROPY_OPS = {}


def cross_entropy_scratch_bytes(op, args, device_type):
    """What remat's fused linear + cross-entropy allocates inside one call beyond its outputs, for
    ``op`` = (implementation, pass) and the op's arguments (x [T, H], weight [V, H], ..., the chunk
    C of vocabulary columns), element size s of x:

    - forward: the logits buffer of one chunk [T, min(C, V)] in x's dtype, which every chunk reuses,
      and four fp32 per-token statistics (the extension) or their per-split partials (triton,
      counted for one split).
    - backward: the same logits buffer (dz is written into it), the fp32 dx accumulator [T, H] when
      the vocabulary takes more than one chunk, and on the extension with 16-bit x: on a GPU
      cuBLAS's fp32 product [T, H] (``accumulate_dx``'s scratch), on the CPU fp32 copies of a block
      of dz and of the weight rows (``accumulate_dx_cpu_16bit``, blocks of at most 2048 columns).
      The triton backend accumulates dx in fp32 in its own GEMM (no product buffer).

    Source: csrc/cross_entropy/cross_entropy_glue.h, cross_entropy_cpu.cpp, kernels/cross_entropy.py.
    """
    implementation, which = op
    x, weight = args[0], args[1]
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    element = x.element_size()
    if which == "forward":
        chunk = min(max(int(args[8]), 1), vocab)
        return tokens * chunk * element + 4 * 4 * tokens
    chunk = min(max(int(args[11]), 1), vocab)
    need_dx = bool(args[12])
    scratch = tokens * chunk * element
    if need_dx and chunk < vocab:
        scratch += 4 * tokens * hidden
        if implementation == "extension" and element < 4:
            if device_type == "cuda":
                scratch += 4 * tokens * hidden
            else:
                block = max(1, min(chunk, 2048, tokens * chunk // max(hidden, 1)))
                scratch += 4 * tokens * block + 4 * block * hidden
    return scratch


def pinned_host_bytes(nbytes):
    """The host bytes PyTorch's caching host allocator holds for a pinned tensor of ``nbytes``
    (what remat's offload copies to on a GPU): the request rounded up to a power of two
    (aten/src/ATen/core/CachingHostAllocator.h, ``roundSize``: ``PowerOf2Ceil`` for every size up to
    ``pinned_max_round_threshold``, unlimited by default in PyTorch 2.14). An 8.5 GiB copy holds 16
    GiB; a freed block stays cached for the next copy of its size class, so a step's host peak is
    the most rounded bytes alive at once. 0 for 0."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def format_bytes(nbytes, digits=2):
    """``nbytes`` in GiB from 1 GiB up, else in MiB, with ``digits`` decimals (default 2)."""
    return f"{nbytes / 2**30:.{digits}f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.{digits}f} MiB"


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages alive, per device kind (device vs host), and the peak.

    Every operator's outputs are looked at; a storage not seen before is counted from then until
    it dies (a ``weakref.finalize`` on the storage's Python object, which PyTorch keeps for the
    storage's whole life). Storages that existed before (parameters, inputs) are added with
    :meth:`add_existing`. ``kind_of`` (a callable storage -> kind) sorts the bytes at each new
    peak into :data:`KINDS`.
    """

    def __init__(self, device, block_bytes=1):
        super().__init__()
        self.device = torch.device(device)
        self.block_bytes = block_bytes
        self.current = 0
        self.peak = 0
        self.host_current = 0
        self.host_peak = 0
        self.phase = "forward"
        self.phase_peaks = {}
        self.peak_phase = None
        self.kinds = {}  # storage key -> kind
        self.sizes = {}  # storage key -> (bytes, on the device)
        self.at_peak = {}
        self.segment = None  # (phase, place) being run, when the step is segmented by layers
        self.segment_peaks = {}
        self._finalizers = []

    def _rounded(self, nbytes):
        return -(-nbytes // self.block_bytes) * self.block_bytes

    def track(self, tensor, kind="other"):
        """Counts ``tensor``'s storage from now until it dies (once; a later call may give it a
        kind). The device is the tensor's (a fake tensor's storage is on the meta device)."""
        storage = _storage_of(tensor)
        if storage is None:
            return
        key = storage._cdata
        if key in self.sizes:
            if kind != "other":
                self.kinds[key] = kind
            return
        on_device = tensor.device.type == self.device.type
        if on_device:
            nbytes = self._rounded(storage.nbytes())
        elif self.device.type == "cuda":
            nbytes = pinned_host_bytes(storage.nbytes())
        else:
            nbytes = storage.nbytes()
        self.sizes[key] = (nbytes, on_device)
        self.kinds[key] = kind
        if on_device:
            self.current += nbytes
            self._note_level()
        else:
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)
        self._finalizers.append(weakref.finalize(storage, self._release, key))

    def mark(self, tensor, kind):
        """Sorts an already counted tensor's storage under ``kind`` (a saved tensor, a gradient)."""
        storage = _storage_of(tensor)
        # Parameters stay parameters when saved; a storage is a gradient or saved, first come.
        if storage is not None and self.kinds.get(storage._cdata) == "other":
            self.kinds[storage._cdata] = kind

    def _release(self, key):
        nbytes, on_device = self.sizes.pop(key)
        self.kinds.pop(key, None)
        if on_device:
            self.current -= nbytes
        else:
            self.host_current -= nbytes

    def _by_kind(self):
        totals = dict.fromkeys(KINDS, 0)
        for key, (nbytes, on_device) in self.sizes.items():
            if on_device:
                totals[self.kinds[key]] += nbytes
        return totals

    def set_phase(self, phase):
        self.phase = phase
        self.phase_peaks.setdefault(phase, self.current)

    def set_segment(self, place):
        """From now on the bytes alive are recorded as (phase, ``place``)'s (its peak starts at the
        bytes alive now)."""
        self.segment = (self.phase, place)
        self.segment_peaks[self.segment] = max(self.segment_peaks.get(self.segment, 0), self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        scratch = kernel_scratch_bytes(func, args, self.device.type)
        if scratch:
            self.transient(self._rounded(scratch))
        return out

    def transient(self, nbytes):
        """Counts ``nbytes`` on the device for the duration of one kernel (its scratch): a peak
        that includes it is recorded as "other"."""
        self._note_level(nbytes)

    def _note_level(self, transient=0):
        """Records the device bytes now (plus ``transient`` scratch, sorted as "other") as the peak
        and the phase's peak where they exceed them."""
        level = self.current + transient
        if level > self.peak:
            self.peak = level
            self.peak_phase = self.phase
            self.at_peak = self._by_kind()
            self.at_peak["other"] += transient
        if level > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = level
        if self.segment is not None and level > self.segment_peaks.get(self.segment, 0):
            self.segment_peaks[self.segment] = level

    def close(self):
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()


class _SavedHolder:
    """What the walk's pack hook gives autograd for a saved tensor: the tensor, dropped by
    :class:`GraphWalk` once the node that unpacked it has run (the engine's release_variables)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class GraphWalk:
    """Runs a backward by walking the autograd graph in Python, in the autograd engine's order,
    where the engine cannot run (fake CUDA tensors on a machine without a driver; module
    docstring).

    Order: the engine's CPU ready queue, a priority queue that runs gradient accumulators first and
    then the ready node with the highest sequence number (the most recently created). A node is
    ready when every node that feeds it has run. Incoming gradients for one input are summed out of
    place (the engine's rule for tensor subclasses such as fake tensors). Saved tensors are wrapped
    by this walk's pack hook (:meth:`saving`) and dropped right after the node that unpacked them
    runs; saved tensors packed by an inner hook (checkpointing) are released by that hook's owner,
    as with the engine.

    Leaf gradients follow AccumulateGrad's rule (:meth:`_accumulate`), with the leaf's tensor hooks
    and post-accumulate hooks. Not run: hooks registered on graph nodes or on non-leaf tensors
    (PyTorch keeps them where Python cannot list them); no backward of the backward (create_graph).
    """

    def __init__(self, on_pack=None):
        self._unpacked = []
        self._walking = False
        self._on_pack = on_pack
        self.on_node = None  # called with each node before it runs (the estimate's segments)

    def _pack(self, t):
        if self._on_pack is not None:
            self._on_pack(t)
        return _SavedHolder(t.detach())

    def _unpack(self, holder):
        if self._walking:  # under the engine, the engine releases what it unpacked
            self._unpacked.append(holder)
        return holder.tensor

    @contextlib.contextmanager
    def saving(self):
        """Wraps the forward: saved tensors go into holders this walk can release."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def backward(self, root, grad=None):
        """Computes the gradients of ``root`` (a scalar unless ``grad`` is given) into the
        ``.grad`` of the leaves that require it, as ``root.backward(grad)`` would.

        As the engine without ``retain_graph``, the graph is used up: nodes are let go as soon as
        they have run, so that (with nothing else holding them) they free what they saved, and the
        root is detached in place (unless it is a view) so that it does not hold the graph."""
        if root.grad_fn is None:
            raise RuntimeError("the root does not require grad and has no grad_fn")
        if grad is None:
            if root.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            grad = torch.ones_like(root)
        start, output_nr = root.grad_fn, root.output_nr
        if root._base is None:
            root.detach_()
        dependencies = self._dependencies(start)
        slots = [None] * self._input_count(start)
        slots[output_nr] = grad
        grad = None
        buffers = {self._key(start): slots}
        ready = [(self._priority(start), 0, self._key(start), start)]
        start = None
        self._walking = True
        # Non-reentrant checkpointing keys its recomputation by the engine's graph task id, which
        # is -1 outside the engine (a new recomputation per unpack); a GraphExecGroup is its key
        # for backwards run outside the engine: each region recomputes once.
        group = torch.utils.checkpoint.GraphExecGroup() if torch._C._get_graph_exec_group() is None else None
        try:
            with torch.no_grad(), group or contextlib.nullcontext():  # no_grad: no graph of the backward
                self._run(ready, buffers, dependencies)
        finally:
            self._walking = False
            self._unpacked.clear()

    def _run(self, ready, buffers, dependencies):
        counter = 1
        while ready:
            _, _, key, node = heapq.heappop(ready)
            inputs = buffers.pop(key)
            if self.on_node is not None:
                self.on_node(node)
            outputs = self._call(node, inputs)
            inputs = None
            for holder in self._unpacked:
                holder.tensor = None
            self._unpacked.clear()
            for (next_node, index), grad_out in self._routes(node, outputs):
                next_key = self._key(next_node)
                slots = buffers.setdefault(next_key, [None] * self._input_count(next_node))
                if grad_out is not None:
                    grad_out = self._validated(grad_out, next_node._input_metadata[index])
                    slots[index] = grad_out if slots[index] is None else slots[index] + grad_out
                grad_out = None
                dependencies[next_key] -= 1
                if dependencies[next_key] == 0:
                    del dependencies[next_key]
                    heapq.heappush(ready, (self._priority(next_node), counter, next_key, next_node))
                    counter += 1
                next_node = None
            # Let the node go: unless something else holds it, it is destroyed with what it saved
            # (the engine's release_variables after a node runs).
            outputs = node = None

    # The sequence number of a gradient accumulator (AccumulateGrad): UINT64_MAX.
    _ACCUMULATOR = 2**64 - 1

    @classmethod
    def _key(cls, node):
        """A key for a node that does not hold it (a Python wrapper of a C++ node keeps the node
        alive): its sequence number, unique among the nodes one thread records, or for a gradient
        accumulator the id of its leaf."""
        number = node._sequence_nr()
        return ("leaf", id(node.variable)) if number == cls._ACCUMULATOR else number

    @classmethod
    def _priority(cls, node):
        # heapq pops the smallest: accumulators (sequence number UINT64_MAX) first, then the
        # highest sequence number.
        return -node._sequence_nr()

    @staticmethod
    def _input_count(node):
        return len(node._input_metadata)

    @classmethod
    def _dependencies(cls, start):
        """{key: number of edges into the node} over the graph from ``start``."""
        dependencies = {}
        seen = {cls._key(start): start}  # holds the wrappers while counting (identity checks)
        stack = [start]
        while stack:
            node = stack.pop()
            for next_node, _ in node.next_functions:
                if next_node is None:
                    continue
                key = cls._key(next_node)
                dependencies[key] = dependencies.get(key, 0) + 1
                if key not in seen:
                    seen[key] = next_node
                    stack.append(next_node)
                elif seen[key] is not next_node:
                    raise RuntimeError(f"two autograd nodes share sequence number {key} ({seen[key].name()}, "
                                       f"{next_node.name()}): the graph was not recorded on one thread")
        return dependencies

    @staticmethod
    def _validated(grad, metadata):
        """The engine's validate_outputs: a gradient of a broadcast input is summed to the input's
        shape, and cast to its dtype."""
        if tuple(grad.shape) != tuple(metadata.shape):
            grad = grad.sum_to_size(metadata.shape)
        if grad.dtype != metadata.dtype:
            grad = grad.to(metadata.dtype)
        return grad

    @classmethod
    def _call(cls, node, inputs):
        if node._sequence_nr() == cls._ACCUMULATOR and hasattr(node, "variable"):
            cls._accumulate(node.variable, inputs[0])
            return ()
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            # A custom Function's backward gets zeros for outputs without a gradient (the default
            # materialize_grads=True; remat's Functions keep it).
            inputs = [
                g if g is not None else torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
                for g, meta in zip(inputs, node._input_metadata, strict=True)
            ]
            outputs = node.apply(*inputs)
        else:
            outputs = node(*inputs)
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        return outputs

    @staticmethod
    def _accumulate(leaf, grad):
        """AccumulateGrad's rule (accumulate_grad.h) for a gradient the engine holds alone: the
        leaf's tensor hooks run on it; a first gradient is taken as it is where its layout matches
        the leaf's (else copied into the leaf's layout), a later one added in place; then the
        post-accumulate hooks run. Called from Python the node itself would always copy (Python
        holds a second reference to the gradient), which the engine does only for a gradient
        another tensor shares."""
        for hook in (getattr(leaf, "_backward_hooks", None) or {}).values():
            result = hook(grad)
            if result is not None:
                grad = result
        if grad is None:
            return
        if leaf.grad is None:
            if grad.stride() == leaf.stride() and grad.dtype == leaf.dtype:
                leaf.grad = grad.detach()
            else:
                leaf.grad = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype,
                                                device=leaf.device).copy_(grad)
        else:
            leaf.grad += grad
        for hook in (getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(leaf)

    @staticmethod
    def _routes(node, outputs):
        """(edge, gradient) pairs of a node's outputs. A C++ node returns one gradient per edge. A
        custom Function's backward returns one per forward argument, tensors or not, while its
        edges exist for tensor arguments only; the arguments that need a gradient are exactly
        those with an edge to a node (``needs_input_grad``), in order."""
        edges = [edge for edge in node.next_functions if edge[0] is not None]
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            outputs = [g for g, needed in zip(outputs, node.needs_input_grad, strict=False) if needed]
            if len(outputs) != len(edges):
                raise RuntimeError(f"{node.name()}: {len(outputs)} gradients for {len(edges)} inputs that need one")
            return zip(edges, outputs, strict=True)
        return [(edge, g) for edge, g in zip(node.next_functions, outputs, strict=False) if edge[0] is not None]


class _FlashAttentionOnTarget(torch.autograd.Function):
    """The memory of PyTorch's CUDA flash / memory-efficient SDPA kernels, for fake tensors (the
    module docstring says why SDPA cannot pick its kernel there). Forward makes the output (the
    kernels write [B, N, H, D] and return it as a [B, H, N, D] view) and the fp32 logsumexp
    [B, H, N] (flash rounds N up to 128, efficient to 32), and saves q, k, v, output, logsumexp.
    Backward makes dq, dk, dv plus the kernels' fp32 scratch: softmax_d [B, H, N] and, for flash,
    the fp32 dq accumulator [B, N, H, D] (FlashAttention-2's mha_bwd), freed when it returns."""

    @staticmethod
    def forward(ctx, q, k, v, flash):
        batch, heads, n, dim = q.shape
        rounded = -(-n // (128 if flash else 32)) * (128 if flash else 32)
        out = torch.empty(batch, n, heads, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(batch, heads, rounded, dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.flash = flash
        return out

    @staticmethod
    @refuse_double_backward("remat.estimate's SDPA stand-in")
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        batch, heads, n, dim = q.shape
        rounded = lse.shape[-1]
        scratch = [torch.empty(batch, heads, rounded, dtype=torch.float32, device=q.device)]
        if ctx.flash:
            scratch.append(torch.empty(batch, rounded, heads, dim, dtype=torch.float32, device=q.device))
        dq = torch.empty(batch, n, heads, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
        dk = torch.empty(k.shape[0], k.shape[2], k.shape[1], k.shape[3], dtype=k.dtype,
                         device=k.device).transpose(1, 2)
        dv = torch.empty(v.shape[0], v.shape[2], v.shape[1], v.shape[3], dtype=v.dtype,
                         device=v.device).transpose(1, 2)
        del scratch
        return dq, dk, dv, None


class _SdpaAsOnTarget(torch.overrides.TorchFunctionMode):
    """Runs F.scaled_dot_product_attention on fake CUDA tensors with the memory of the kernel a
    real sm_80+ GPU would pick (see _FlashAttentionOnTarget); other calls pass through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _sdpa_on_target(*args, **kwargs)
        return func(*args, **kwargs)


def _sdpa_on_target(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    if query.device.type != "cuda" or not is_fake(query):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        # The fused kernels take equal head counts: PyTorch repeats k and v for them.
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    # Flash takes no mask and 16-bit inputs; the efficient kernel reads a given mask as it is.
    flash = attn_mask is None and query.shape[-1] <= 256 and query.dtype in (torch.float16, torch.bfloat16)
    return _FlashAttentionOnTarget.apply(query, key, value, flash)


def _fake_mode_of(tensors):
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if is_fake(t)}
    if len(modes) > 1:
        raise ValueError("the model's tensors belong to more than one FakeTensorMode")
    return next(iter(modes.values()), None)


def _check_estimate_arguments(model, seq_len, batch_size, optimizer, inputs, optimizer_shards=1):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("optimizer_shards", optimizer_shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if optimizer not in (None, "adam"):
        raise ValueError(f"optimizer must be None or 'adam', got {optimizer!r}")
    if inputs is not None and not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict of keyword arguments or None, got {type(inputs).__name__}")
    if not any(True for _ in model.parameters()):
        raise ValueError("model has no parameters")


def estimate(model, *, seq_len, batch_size=1, optimizer=None, inputs=None, walk=None, cuda_capability=(9, 0),
             optimizer_shards=1, segments=None):
    """Predicts the device memory of one training step of ``model`` (forward and backward).

    The step is ``model(input_ids=ids, labels=ids, use_cache=False).loss.backward()`` with
    ``ids`` of shape [batch_size, seq_len] (a Hugging Face causal LM, patched or not), or
    ``model(**inputs)`` with a loss as the output's ``loss`` or the output itself when ``inputs``
    is given (tensors in it are made fake). It runs on fake tensors: for a model on the CPU with real
    weights the parameters are stood in for by fake copies for the step's duration (the
    model and its gradients are not touched), and a model built on fake tensors (for example on
    fake CUDA tensors by ``remat.planning.fit``, with no GPU present) is used as it is.

    Args:
        model: an ``nn.Module`` whose parameters are on one device (the target).
        seq_len: tokens per sequence (int >= 1).
        batch_size: sequences per step (int >= 1). Default 1.
        optimizer: None (default: no optimizer states) or ``"adam"``: two fp32 states per
            trainable parameter element, alive through the step (as from the second step on).
        inputs: keyword arguments for the forward instead of the default ones (default None).
        walk: run the backward in :class:`GraphWalk` (True), in the autograd engine (False), or
            where the engine cannot run, fake CUDA tensors (None, default).
        cuda_capability: the compute capability of the GPU a fake CUDA model stands for (default
            (9, 0): H100/H200); remat picks its kernels for it (``remat.backend.simulated_gpu``).
        optimizer_shards: with ``"adam"``, the ranks its states are partitioned over (ZeRO stage
            1 or 2: each rank holds 1/shards of them; parameters and gradients are counted whole).
            Default 1.
        segments: None (default), or the model's decoder layers in forward order: the result's
            ``segment_peaks`` then holds the most bytes alive while each layer's forward ran and
            while its backward nodes ran (on the walk; under the autograd engine the backward is
            one segment), and outside them (:class:`_Segments`; remat.planning.composed reads it).

    A model patched with ``sequence_parallel`` (remat.sequence_parallel): the step is one rank's,
    ``seq_len`` its shard's tokens (the default inputs then carry position_ids); the all-to-alls
    allocate their buffers and send nothing.

    Returns:
        :class:`Estimate` (``peak_bytes``, ``host_bytes``, ``phases``, ``breakdown``).
    """
    _check_estimate_arguments(model, seq_len, batch_size, optimizer, inputs, optimizer_shards)
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"the model's parameters are on more than one device ({sorted(map(str, devices))}); "
                         "estimate takes a model on one device")
    device = next(iter(devices))
    mode = _fake_mode_of([*named.values(), *buffers.values()])
    swap = mode is None
    if swap:
        if device.type != "cpu":
            raise ValueError(f"a model with real tensors on {device} cannot be estimated without running it; "
                             "build it on fake tensors (FakeTensorMode) or on the CPU")
        mode = FakeTensorMode(allow_non_fake_inputs=False)
    if walk is None:
        walk = device.type == "cuda"
    tracker = LiveBytes(device, CUDA_BLOCK_BYTES if device.type == "cuda" else 1)
    graph_walk = GraphWalk(on_pack=lambda t: tracker.mark(t, "saved"))
    if inputs is not None:
        inputs = {key: mode.from_tensor(value) if isinstance(value, torch.Tensor) and not is_fake(value) else value
                  for key, value in inputs.items()}
    try:
        stand_ins = _fake_copies(model, mode) if swap else None
        on_target = contextlib.ExitStack()
        if device.type == "cuda":
            on_target.enter_context(simulated_gpu(cuda_capability))
            on_target.enter_context(_capability_of_the_target(cuda_capability))
        with mode, on_target, _standing_in(model, stand_ins):
            with _Segments(segments, tracker, graph_walk):
                result = _run_step(model, tracker, graph_walk, device, seq_len, batch_size, optimizer, inputs,
                                   walk, optimizer_shards)
    finally:
        tracker.close()
    return result


def _fake_copies(model, mode):
    """{id(tensor): fake copy} for the model's parameters (fake Parameters keeping requires_grad)
    and buffers; tensors sharing a storage (tied weights) share one copy."""
    copies, by_storage = {}, {}
    for t in (*model.parameters(), *model.buffers()):
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape)) if t.numel() else id(t)
        if key not in by_storage:
            fake = mode.from_tensor(t.detach())
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            by_storage[key] = fake
        copies[id(t)] = by_storage[key]
    return copies


@contextlib.contextmanager
def _standing_in(model, stand_ins):
    """Puts the fake copies in place of the model's parameters and buffers for the step (forward
    and backward: a checkpointed layer re-runs its forward in backward) and puts the real ones back
    after, whatever happens."""
    if stand_ins is None:
        yield
        return
    swapped = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is not None and id(t) in stand_ins:
                        swapped.append((table, name, t))
                        table[name] = stand_ins[id(t)]
        yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def _run_step(model, tracker, graph_walk, device, seq_len, batch_size, optimizer, inputs, walk, optimizer_shards=1):
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    for t in (*model.parameters(), *model.buffers()):
        if t.numel():
            tracker.track(t, "parameters")
    hooks = [p.register_post_accumulate_grad_hook(_mark_gradient(tracker)) for p in trainable.values()]
    states = []
    if optimizer == "adam":
        for p in trainable.values():
            for _ in range(2):
                state = torch.zeros(-(-p.numel() // optimizer_shards), dtype=torch.float32, device=p.device)
                tracker.track(state, "optimizer")
                states.append(state)
    if inputs is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is None:
            raise ValueError("model has no config.vocab_size; give the step's inputs")
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
        if model.__dict__.get(SEQUENCE_PARALLEL_FLAG):  # patched with sequence_parallel: seq_len is one rank's shard
            kwargs["position_ids"] = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    else:
        kwargs = dict(inputs)
    assumptions = set()
    _ASSUMPTIONS.append(assumptions)
    try:
        with tracker, _SdpaAsOnTarget(), graph_walk.saving(), _dense_rows_in_hugging_face():
            output = model(**kwargs)
            loss = output if isinstance(output, torch.Tensor) else output["loss"]
            if loss is None:
                raise ValueError("the model computed no loss: give labels (or inputs whose forward returns one)")
            output = None
            after_forward = tracker.current
            tracker.set_phase("backward")
            if walk:
                graph_walk.backward(loss)  # detaches loss: the walk lets the graph go as it runs
            else:
                loss.backward()
            loss = None
    finally:
        _ASSUMPTIONS.pop()  # estimates nest last in, first out
        for hook in hooks:
            hook.remove()
    for p in trainable.values():
        p.grad = None
    return Estimate(peak_bytes=tracker.peak, host_bytes=tracker.host_peak, phases=dict(tracker.phase_peaks),
                    breakdown=dict(tracker.at_peak), peak_phase=tracker.peak_phase, device=device,
                    tokens=batch_size * seq_len, after_forward_bytes=after_forward,
                    assumptions=tuple(sorted(assumptions)), segment_peaks=dict(tracker.segment_peaks))


class _Segments:
    """Sorts the bytes alive of an estimate's step by decoder layer (``layers``, in forward order;
    nothing without them): in forward, a layer's pre- and post-hooks start and end its segment and
    note the autograd sequence numbers its nodes take ((its input's node, its output's node]); in
    backward, the walk names each node before it runs, and a node within a layer's numbers is in
    that layer's segment. Places: the layer's index, "before" (the embedding's side: forward until
    the first layer, backward after it), "after" (the final norm, head and loss). A checkpointed
    layer's forward re-run in backward happens inside its own backward nodes (its hooks are ignored
    in backward). Gradient accumulators stay in the segment of the node that fed them."""

    def __init__(self, layers, tracker, walk):
        self.layers, self.tracker, self.walk = layers, tracker, walk
        self.handles, self.ranges, self.ends, self.starts = [], [], [], {}

    def __enter__(self):
        if not self.layers:
            return self
        self.tracker.set_segment("before")
        for place, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(
                lambda module, args, kwargs, place=place: self._entered(place, args, kwargs), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(
                lambda module, args, kwargs, output, place=place: self._left(place, output), with_kwargs=True))
        self.walk.on_node = self._node
        self._phase_hook = self.tracker.set_phase
        self.tracker.set_phase = self._set_phase
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        if self.layers:
            self.walk.on_node = None
            self.tracker.set_phase = self._phase_hook
        return False

    def _set_phase(self, phase):
        self._phase_hook(phase)
        self.tracker.set_segment("after")  # the backward starts at the loss

    @staticmethod
    def _sequence_number(tensors):
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                return t.grad_fn._sequence_nr()
        return None

    def _entered(self, place, args, kwargs):
        if self.tracker.phase != "forward":
            return
        start = self._sequence_number((args, kwargs))
        self.starts[place] = start if start is not None else (self.ranges[-1][1] if self.ranges else -1)
        self.tracker.set_segment(place)

    def _left(self, place, output):
        if self.tracker.phase != "forward":
            return
        end = self._sequence_number(output)
        if end is not None and place in self.starts:
            self.ranges.append((self.starts[place], end, place))
            self.ranges.sort()
            self.ends = [r[1] for r in self.ranges]
        self.tracker.set_segment("after")

    def _node(self, node):
        number = node._sequence_nr()
        if number == GraphWalk._ACCUMULATOR:
            return
        index = bisect.bisect_left(self.ends, number)
        if index < len(self.ranges) and self.ranges[index][0] < number:
            place = self.ranges[index][2]
        else:
            place = "after" if self.ranges and number > self.ends[-1] else "before"
        if self.tracker.segment != ("backward", place):
            self.tracker.set_segment(place)


def _mark_gradient(tracker):
    def mark(param):
        if param.grad is not None:
            tracker.mark(param.grad, "gradients")
    return mark



@contextlib.contextmanager
def _dense_rows_in_hugging_face():
    """For the estimate's duration, transformers' packed-row detection returns None (dense rows)
    for fake position ids, the estimate's own, instead of assuming packing (module docstring)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    detect = getattr(masking_utils, "find_packed_sequence_indices", None)
    if detect is None:
        yield
        return

    def dense_when_fake(position_ids):
        return None if is_fake(position_ids) else detect(position_ids)

    masking_utils.find_packed_sequence_indices = dense_when_fake
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = detect


@contextlib.contextmanager
def _capability_of_the_target(capability):
    """For the estimate's duration, ``torch.cuda.get_device_capability`` answers the simulated
    GPU's ``capability`` (Hugging Face asks it before its grouped-GEMM experts; without a driver the
    real query raises)."""
    query = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: tuple(capability)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = query


def on_fake_device(model, device="cuda", mode=None):
    """Gives a model built on the meta device fake tensors on ``device`` (in place; returns it), so
    that :func:`estimate` can run it: each meta parameter and buffer becomes a ``FakeTensor`` of
    its shape and dtype on ``device`` (tied tensors stay one tensor; ``requires_grad`` is kept).

    Build on meta, then apply what changes modules (PEFT adapters, which cannot be added to fake
    parameters: module ``_apply`` refuses to swap them), then call this, then ``remat.patch``.

    Args:
        model: an ``nn.Module`` whose parameters and buffers are all on the meta device.
        device: the device the fake tensors report (default ``"cuda"``, i.e. ``cuda:0``).
        mode: the ``FakeTensorMode`` they belong to (default: a new one).

    Returns:
        ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    not_meta = sorted({str(t.device) for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"})
    if not_meta:
        raise ValueError(f"on_fake_device takes a model on the meta device; it has tensors on {not_meta}")
    mode = mode if mode is not None else FakeTensorMode()
    made = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(FakeTensor(mode, param.data, device),
                                                         requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                if id(buffer) not in made:
                    made[id(buffer)] = FakeTensor(mode, buffer, device)
                module._buffers[name] = made[id(buffer)]
    return model
