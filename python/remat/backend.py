"""Which implementation runs: the choice of backend.

Backends:
- ``"cuda"``: the extension's CUDA C++ kernels, for CUDA tensors.
- ``"cpp"``: the extension's C++ CPU kernels (OpenMP), for CPU tensors.
- ``"triton"``: the Triton kernels, for CUDA tensors; on CPU tensors only when the Triton
  interpreter is on (``TRITON_INTERPRET=1`` before Triton is imported), which is for testing.
- ``"torch"``: plain PyTorch implementations of the same recompute contracts, on any device.
- ``"aten"``: attention only: PyTorch's own fused attention kernels (the CPU flash kernel,
  FlashAttention-2 on CUDA), which keep remat's attention contract, for the calls whose features
  they have (remat.ops.attention.aten_unsupported_reason).
- ``"cudnn"``: attention only, CUDA tensors: cuDNN's fused attention through PyTorch's operator,
  what stock scaled_dot_product_attention runs on sm_90/sm_10x GPUs, for the calls it takes
  (remat.ops.attention_cudnn.cudnn_unsupported_reason).

Choice: the explicit ``backend=`` argument, else the innermost :func:`use_backend` context, else
the ``REMAT_BACKEND`` environment variable, else the default: on a CUDA tensor ``cuda`` if the
extension holds CUDA kernels that run on that GPU (machine code for its architecture, or PTX for
an older one that the driver compiles), else ``triton`` if Triton is installed, else ``torch``; on
a CPU tensor ``cpp`` if the extension is built, else ``torch``. A backend that was asked for and
cannot run raises :class:`BackendUnavailableError` saying why; nothing falls back silently.
"""

import contextlib
import importlib.util
import os
import threading

import torch

from remat import _extension

BACKENDS = ("cuda", "cpp", "triton", "torch", "aten", "cudnn")

_state = threading.local()


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run the given tensors here."""


def _check_name(name, source):
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name):
    """Run remat operators in this block with backend ``name`` (one of :data:`BACKENDS`),
    unless a call passes ``backend=`` itself. Contexts nest; the innermost wins."""
    _check_name(name, "use_backend(name)")
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


# Looked up once, at import: a plain constant to torch.compile, which would otherwise trace the
# import machinery (and warn about a cached function) inside every compiled CUDA attention call.
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available():
    """Whether the triton package is installed (looked up once, when remat is imported)."""
    return _TRITON_FOUND


def triton_interpreted():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def requested_backend(explicit=None):
    """The backend asked for by argument, context or environment, or None for the default."""
    if explicit is not None:
        return _check_name(explicit, "backend")
    stack = getattr(_state, "stack", None)
    if stack:
        return stack[-1]
    from_env = os.environ.get("REMAT_BACKEND")
    if from_env:
        return _check_name(from_env, "the REMAT_BACKEND environment variable")
    return None


def parse_arch_list(archs):
    """TORCH_CUDA_ARCH_LIST text ("8.0;9.0+PTX", spaces or semicolons) -> a list of (major, minor,
    ptx, suffix) tuples: suffix "a" is arch-specific code (runs on that arch only), "f" family code
    (same major, equal or newer minor), "" portable. Names torch also accepts ("Ampere", ...) are not
    in this form: ValueError."""
    entries = []
    for word in archs.replace(" ", ";").split(";"):
        word = word.strip()
        if not word:
            continue
        ptx = word.endswith("+PTX")
        word = word.removesuffix("+PTX")
        suffix = word[-1] if word[-1:] in ("a", "f") else ""
        major, _, minor = word.removesuffix(suffix).partition(".")
        if not (major.isdigit() and (minor or "0").isdigit()):
            raise ValueError(f"cannot read the CUDA arch {word!r} (expected major.minor, e.g. 9.0)")
        entries.append((int(major), int(minor or 0), ptx, suffix))
    return entries


def arch_list_runs_on(archs, capability):
    """Whether kernels built for ``archs`` (TORCH_CUDA_ARCH_LIST text) run on a GPU of compute
    ``capability`` (major, minor): machine code for X.Y runs on X.Z with Z >= Y (arch-specific
    X.Ya only on X.Y); PTX for X.Y is compiled by the driver for any capability >= X.Y."""
    major, minor = capability
    for arch_major, arch_minor, ptx, suffix in parse_arch_list(archs):
        if suffix == "a":
            # Arch-specific machine code and PTX run on that arch only.
            if (arch_major, arch_minor) == (major, minor):
                return True
        elif arch_major == major and arch_minor <= minor:
            return True
        elif ptx and not suffix and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


_simulated = threading.local()


@contextlib.contextmanager
def simulated_gpu(capability):
    """Answers device questions for fake CUDA tensors on a machine that may have no GPU: inside,
    :func:`device_capability` returns ``capability`` ((major, minor), e.g. (9, 0) for an H100/H200)
    and :func:`simulated_capability` says so. ``remat.estimate`` runs the step in it, so that
    remat's kernel choices are those of that GPU."""
    previous = getattr(_simulated, "capability", None)
    _simulated.capability = tuple(capability)
    try:
        yield
    finally:
        _simulated.capability = previous


def simulated_capability():
    """The capability :func:`simulated_gpu` set on this thread, or None outside it."""
    return getattr(_simulated, "capability", None)


@torch.compiler.assume_constant_result
def device_capability(index):
    """(major, minor) compute capability of CUDA device ``index`` (a constant to torch.compile),
    or the simulated GPU's inside :func:`simulated_gpu`."""
    simulated = simulated_capability()
    if simulated is not None:
        return simulated
    return torch.cuda.get_device_capability(index)


def cuda_kernels_reason(device):
    """Why the extension's CUDA kernels cannot run on ``device`` (a CUDA device), or None."""
    if not _extension.WITH_CUDA:
        return "remat._C was built without CUDA kernels (no CUDA toolkit, or REMAT_SKIP_CUDA_BUILD=1)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = device_capability(index)
    try:
        runs = arch_list_runs_on(_extension.CUDA_ARCHS, (major, minor))
    except ValueError as error:
        return (f"remat._C's recorded CUDA archs {_extension.CUDA_ARCHS!r} cannot be compared with this GPU "
                f"({error}); rebuild with TORCH_CUDA_ARCH_LIST in major.minor form, e.g. '8.0;9.0+PTX'")
    if not runs:
        return (f"remat._C holds CUDA kernels for archs {_extension.CUDA_ARCHS!r}, which do not run on this "
                f"GPU (sm_{major}{minor}); rebuild with TORCH_CUDA_ARCH_LIST='{major}.{minor}' (or an older arch "
                "with +PTX)")
    return None


def default_backend(device):
    """The backend used when none is asked for (see the module docstring)."""
    if device.type == "cuda":
        if _extension.LOADED and cuda_kernels_reason(device) is None:
            return "cuda"
        return "triton" if triton_available() else "torch"
    if device.type == "cpu" and _extension.LOADED:
        return "cpp"
    return "torch"


def unavailable_reason(name, device):
    """Why backend ``name`` cannot run tensors on ``device``, or None if it can."""
    if name == "torch":
        return None
    if name == "aten":
        if device.type in ("cpu", "cuda"):
            return None
        return f"PyTorch's fused attention kernels run CPU and CUDA tensors, and the input is on {device}"
    if name == "cudnn":
        if device.type == "cuda":
            return None
        return f"cuDNN attention runs CUDA tensors, and the input is on {device}; use backend='aten' on the CPU"
    if name in ("cuda", "cpp") and not _extension.LOADED:
        return (
            f"the compiled extension remat._C is not importable ({_extension.LOAD_ERROR}); "
            "build it with `pip install --no-build-isolation -e .` (see README)"
        )
    if name == "cuda":
        if device.type != "cuda":
            return f"it runs CUDA tensors and the input is on {device}; use backend='cpp' on the CPU"
        return cuda_kernels_reason(device)
    if name == "cpp":
        if device.type != "cpu":
            return f"it runs CPU tensors and the input is on {device}; use backend='cuda'"
        return None
    if name == "triton":
        if not triton_available():
            return "Triton is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpreted():
            return None
        return (
            f"Triton runs CUDA tensors and the input is on {device} "
            "(CPU tensors only under TRITON_INTERPRET=1, for testing)"
        )
    return f"unknown backend {name!r}"


def _resolve(explicit, device):
    name = requested_backend(explicit)
    if name is None:
        return default_backend(device)
    reason = unavailable_reason(name, device)
    if reason is not None:
        raise BackendUnavailableError(f"remat backend {name!r} cannot run here: {reason}")
    return name


def resolve_backend(explicit, tensor):
    """The backend that runs an operator on ``tensor``; raises BackendUnavailableError if the
    backend that was asked for cannot run it."""
    return _resolve(explicit, tensor.device)
