"""Which device a Triton launch runs on. Triton launches a kernel on the *current* CUDA device and
that device's current stream, not on the device of the tensors it is given: with tensors on
``cuda:1`` while ``cuda:0`` is current (one process driving two GPUs, ``device_map="auto"``) a
kernel would read another GPU's memory or race its stream. Every Triton operator therefore runs
inside :func:`launch_device` of its first tensor argument (:func:`on_tensor_device`)."""

import contextlib
import functools

import torch

# Names of the functions wrapped by on_tensor_device (tests check every Triton op is among them).
GUARDED = set()


def launch_device(tensor):
    """The context a Triton launch on ``tensor`` runs in: its CUDA device made current (and so its
    current stream the launch stream); nothing for CPU tensors (the interpreter)."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def on_tensor_device(fn):
    """Runs ``fn`` (a Triton operator's implementation) inside :func:`launch_device` of its first
    tensor argument. Keeps fn's signature, from which torch.library reads the operator schema."""

    @functools.wraps(fn)
    def launch(*args, **kwargs):
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        with launch_device(first):
            return fn(*args, **kwargs)

    GUARDED.add(fn.__name__)
    return launch
