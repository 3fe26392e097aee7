"""What fits: the device peak of one training step, predicted without running it.

:func:`estimate` runs a model's forward and backward on fake tensors (``FakeTensorMode``: shapes,
dtypes and devices, no data and no kernels) and counts the bytes of every tensor storage alive at
each moment, from the operator that creates it to the moment its last reference dies. That is
what the CUDA caching allocator reports as allocated (``torch.cuda.max_memory_allocated``), up to
its rounding of each block to 512 bytes, which the count applies for a CUDA target. The same run
works for a model on the CPU, where a real step can be measured against it.

A CUDA target needs no GPU: the model is built on fake CUDA tensors (``remat.fit`` does it from a
Hugging Face config). Two parts of PyTorch need the device itself and are stood in for:

- The autograd engine asks the CUDA runtime for each device's primary context before a backward
  over CUDA tensors (``GraphTask::stash_current_streams``), which fails without a driver. A
  backward over fake CUDA tensors therefore runs in :class:`GraphWalk`, a walk of the autograd
  graph in the engine's own order (ready nodes by descending sequence number, gradient
  accumulators first) that calls each node, accumulates incoming gradients as the engine does for
  tensor subclasses (out of place) and frees a node's saved tensors right after it runs (as the
  engine's ``release_variables``). On fake CPU tensors the walk and the engine reach the same
  peak (tested).
- Hugging Face's mask preparation (``masking_utils.find_packed_sequence_indices``) cannot read
  fake position ids and assumes packed rows, which builds a [B, 1, N, N] mask that a real run over
  dense rows never makes (and that keeps SDPA off its fused kernels). The rows of an estimate are
  dense by construction, so for its duration that function answers "not packed" for fake position
  ids (:func:`_dense_rows_in_hugging_face`; real tensors still get the real function).
- ``F.scaled_dot_product_attention`` picks its kernel from the device's properties; on a fake CUDA
  tensor that query falls back to the math kernel, which materialises the [B, H, N, M] scores no
  real GPU run would. The estimate runs SDPA as the flash kernel does on an sm_80+ GPU (output,
  fp32 logsumexp; backward: fp32 dq accumulator) where flash applies (no mask, head dim <= 256,
  16-bit dtype) and as the memory-efficient kernel otherwise.

Not counted: memory a kernel allocates and frees inside one call (cuBLAS workspaces, the
allocator's fragmentation and cache), the CUDA context (about 0.5 GiB, part of the reserve the
budget leaves), and anything outside tensor storages.
"""

import contextlib
import dataclasses
import heapq
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.backend import simulated_gpu

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
            tensors); 0 for a CPU target, whose bytes are all in ``peak_bytes``.
        phases: peak device bytes per phase (``"forward"``, ``"backward"``, ``"optimizer"``).
        breakdown: device bytes by kind at the peak (``KINDS``: parameters and buffers, gradients
            of trainable parameters, optimizer states, tensors saved for backward, other:
            activations in flight, the backward's working set, the loss).
        peak_phase: the phase in which the peak happened.
        device: the target device.
        tokens: batch_size * seq_len of the step.
    """

    peak_bytes: int
    host_bytes: int
    phases: dict
    breakdown: dict
    peak_phase: str
    device: torch.device
    tokens: int

    def __str__(self):
        gib = 2**30
        parts = ", ".join(f"{kind} {self.breakdown.get(kind, 0) / gib:.2f}" for kind in KINDS)
        return (f"peak {self.peak_bytes / gib:.2f} GiB on {self.device} in the {self.peak_phase} ({parts}); "
                f"host {self.host_bytes / gib:.2f} GiB; {self.tokens} tokens")


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
        nbytes = self._rounded(storage.nbytes()) if on_device else storage.nbytes()
        self.sizes[key] = (nbytes, on_device)
        self.kinds[key] = kind
        if on_device:
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current
                self.peak_phase = self.phase
                self.at_peak = self._by_kind()
            if self.current > self.phase_peaks.get(self.phase, 0):
                self.phase_peaks[self.phase] = self.current
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def close(self):
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()


def _storage_of(t):
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError):
        return None


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

    Not supported (raise): hooks registered on graph nodes or on non-leaf tensors (the engine runs
    them; this walk cannot list them), ``create_graph``.
    """

    def __init__(self, on_pack=None):
        self._unpacked = []
        self._walking = False
        self._on_pack = on_pack

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
        ``.grad`` of the leaves that require it, as ``root.backward(grad)`` would."""
        if root.grad_fn is None:
            raise RuntimeError("the root does not require grad and has no grad_fn")
        if grad is None:
            if root.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            grad = torch.ones_like(root)
        start = root.grad_fn
        dependencies = self._dependencies(start)
        buffers = {start: [None] * self._input_count(start)}
        buffers[start][root.output_nr] = grad
        ready = [(self._priority(start), 0, start)]
        counter = 1
        self._walking = True
        try:
            with torch.no_grad():  # as the engine without create_graph: no graph of the backward
                self._run(ready, buffers, dependencies, counter)
        finally:
            self._walking = False
            self._unpacked.clear()

    def _run(self, ready, buffers, dependencies, counter):
        while ready:
            _, _, node = heapq.heappop(ready)
            inputs = buffers.pop(node)
            outputs = self._call(node, inputs)
            inputs = None
            for holder in self._unpacked:
                holder.tensor = None
            self._unpacked.clear()
            for (next_node, index), grad_out in self._routes(node, outputs):
                slots = buffers.setdefault(next_node, [None] * self._input_count(next_node))
                if grad_out is not None:
                    grad_out = self._validated(grad_out, next_node._input_metadata[index])
                    slots[index] = grad_out if slots[index] is None else slots[index] + grad_out
                grad_out = None
                dependencies[next_node] -= 1
                if dependencies[next_node] == 0:
                    heapq.heappush(ready, (self._priority(next_node), counter, next_node))
                    counter += 1
            outputs = None

    @staticmethod
    def _validated(grad, metadata):
        """The engine's validate_outputs: a gradient of a broadcast input is summed to the input's
        shape, and cast to its dtype."""
        if tuple(grad.shape) != tuple(metadata.shape):
            grad = grad.sum_to_size(metadata.shape)
        if grad.dtype != metadata.dtype:
            grad = grad.to(metadata.dtype)
        return grad

    @staticmethod
    def _priority(node):
        # heapq pops the smallest: accumulators (sequence number UINT64_MAX) first, then the
        # highest sequence number.
        return -node._sequence_nr()

    @staticmethod
    def _input_count(node):
        return len(node._input_metadata)

    @staticmethod
    def _dependencies(start):
        dependencies = {}
        seen = {start}
        stack = [start]
        while stack:
            node = stack.pop()
            for next_node, _ in node.next_functions:
                if next_node is None:
                    continue
                dependencies[next_node] = dependencies.get(next_node, 0) + 1
                if next_node not in seen:
                    seen.add(next_node)
                    stack.append(next_node)
        return dependencies

    @staticmethod
    def _call(node, inputs):
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


def _check_estimate_arguments(model, seq_len, batch_size, optimizer, inputs):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if optimizer not in (None, "adam"):
        raise ValueError(f"optimizer must be None or 'adam', got {optimizer!r}")
    if inputs is not None and not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict of keyword arguments or None, got {type(inputs).__name__}")
    if not any(True for _ in model.parameters()):
        raise ValueError("model has no parameters")


def estimate(model, *, seq_len, batch_size=1, optimizer=None, inputs=None, walk=None, cuda_capability=(9, 0)):
    """Predicts the device memory of one training step of ``model`` (forward and backward).

    The step is ``model(input_ids=ids, labels=ids, use_cache=False).loss.backward()`` with
    ``ids`` of shape [batch_size, seq_len] (a Hugging Face causal LM, patched or not), or
    ``model(**inputs)`` with a loss as the output's ``loss`` or the output itself when ``inputs``
    is given (tensors in it are made fake). It runs on fake tensors: for a model on the CPU with real
    weights the parameters are stood in for by fake copies (``torch.func.functional_call``; the
    model and its gradients are not touched), and a model built on fake tensors (for example on
    fake CUDA tensors by ``remat.fit``, with no GPU present) is used as it is.

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

    Returns:
        :class:`Estimate` (``peak_bytes``, ``host_bytes``, ``phases``, ``breakdown``).
    """
    _check_estimate_arguments(model, seq_len, batch_size, optimizer, inputs)
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
    try:
        fakes = None
        named_fake = named
        if swap:
            fakes = {}
            by_storage = {}  # tied weights stay one tensor
            for name, t in [*named.items(), *buffers.items()]:
                key = t.untyped_storage()._cdata if t.numel() else id(t)
                if key not in by_storage:
                    fake = mode.from_tensor(t.detach())
                    with mode:
                        by_storage[key] = fake.detach().requires_grad_(t.requires_grad)
                fakes[name] = by_storage[key]
            named_fake = {name: fakes[name] for name in named}
        with mode, simulated_gpu(cuda_capability) if device.type == "cuda" else contextlib.nullcontext():
            result = _run_step(model, fakes, named_fake, tracker, graph_walk, device, seq_len, batch_size,
                               optimizer, inputs, walk)
    finally:
        tracker.close()
    return result


def _run_step(model, fakes, params, tracker, graph_walk, device, seq_len, batch_size, optimizer, inputs, walk):
    trainable = {id(p): p for p in params.values() if p.requires_grad}
    for t in (fakes.values() if fakes is not None else (*params.values(), *model.buffers())):
        if t.numel():
            tracker.track(t, "parameters")
    hooks = [p.register_post_accumulate_grad_hook(_mark_gradient(tracker)) for p in trainable.values()]
    states = []
    if optimizer == "adam":
        for p in trainable.values():
            for _ in range(2):
                state = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                tracker.track(state, "optimizer")
                states.append(state)
    if inputs is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is None:
            raise ValueError("model has no config.vocab_size; give the step's inputs")
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    else:
        kwargs = dict(inputs)
    try:
        with tracker, _SdpaAsOnTarget(), graph_walk.saving(), _dense_rows_in_hugging_face():
            output = (torch.func.functional_call(model, fakes, (), kwargs, tie_weights=True, strict=False)
                      if fakes is not None else model(**kwargs))
            loss = output if isinstance(output, torch.Tensor) else output["loss"]
            if loss is None:
                raise ValueError("the model computed no loss: give labels (or inputs whose forward returns one)")
            output = None
            tracker.set_phase("backward")
            if walk:
                graph_walk.backward(loss)
            else:
                loss.backward()
            loss = None
    finally:
        for hook in hooks:
            hook.remove()
    for p in trainable.values():
        p.grad = None
    return Estimate(peak_bytes=tracker.peak, host_bytes=tracker.host_peak, phases=dict(tracker.phase_peaks),
                    breakdown=dict(tracker.at_peak), peak_phase=tracker.peak_phase, device=device,
                    tokens=batch_size * seq_len)


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
