"""What this installation of remat can run: ``remat.info()`` and ``python -m remat info``."""

import torch

from remat import _extension, backend
from remat.ops import rope
from remat.ops.attention import cpu_flash_is_fast
from remat.ops.attention_cudnn import cudnn_preferred

OPS = ("rms_norm", "layer_norm", "swiglu_mlp", "geglu_mlp", "gelu_mlp", "norm_mlp", "attention", "dropout",
       "linear_cross_entropy")


def _requested_or_error():
    try:
        return backend.requested_backend()
    except ValueError as error:
        return f"invalid: {error}"


def info_dict():
    """A dict describing the extension build, Triton, the GPU and the default backends."""
    gpu = torch.cuda.is_available()
    triton_version = None
    if backend.triton_available():
        import triton

        triton_version = triton.__version__
    default_cpu = backend.default_backend(torch.device("cpu"))
    default_gpu = backend.default_backend(torch.device("cuda")) if gpu else None
    # PyTorch's CPU flash kernel is the fastest CPU attention only for dtypes it runs at full speed
    # here (remat.ops.attention.cpu_flash_is_fast: 16-bit ones need oneDNN's native GEMMs).
    fast = [name for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                     ("float16", torch.float16)) if cpu_flash_is_fast(dtype)]
    attention_cpu = f"aten ({', '.join(fast)}) if it takes the call, else {default_cpu}"
    attention_gpu = None
    if gpu:
        remat_kernels = "triton" if backend.unavailable_reason("triton", torch.device("cuda")) is None else default_gpu
        # cuDNN first where stock PyTorch tries it first (remat.ops.attention_cudnn.cudnn_preferred).
        cudnn = "cudnn (cuDNN) if it takes the call, else " if cudnn_preferred(torch.device("cuda", 0)) else ""
        attention_gpu = f"{cudnn}aten (FlashAttention-2) if it takes the call, else {remat_kernels}"
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "extension_built": _extension.LOADED,
        "extension_error": _extension.LOAD_ERROR,
        "extension_cuda_kernels": _extension.WITH_CUDA,
        "cuda_archs": _extension.CUDA_ARCHS,
        "triton": triton_version,
        "triton_interpreter": backend.triton_interpreted(),
        "gpu": torch.cuda.get_device_name(0) if gpu else None,
        "gpu_capability": torch.cuda.get_device_capability(0) if gpu else None,
        "cuda_kernels_on_gpu": (backend.cuda_kernels_reason(torch.device("cuda", 0)) or "yes") if gpu else None,
        "requested_backend": _requested_or_error(),
        # The rotation of q and k around the attention cores that take no rope (remat.ops.rope).
        "rope_rotation": {"cpu": rope.rope_implementation("cpu"),
                          "cuda": rope.rope_implementation("cuda") if gpu else None},
        "default_backend": {op: {"cpu": attention_cpu if op == "attention" else default_cpu,
                                 "cuda": attention_gpu if op == "attention" else default_gpu}
                            for op in OPS},
    }


def info(file=None):
    """Print what is available: extension built or not, CUDA archs compiled, Triton version, GPU
    present, which implementation rotates q and k for the attention paths that rotate once, and
    which backend each op would use on CPU and CUDA tensors."""
    d = info_dict()
    lines = [
        f"torch                 {d['torch']} (CUDA {d['torch_cuda']})",
        f"extension remat._C    {'built' if d['extension_built'] else 'not built: ' + str(d['extension_error'])}",
        "CUDA kernels          "
        + (f"compiled for archs {d['cuda_archs']}" if d["extension_cuda_kernels"] else "not compiled"),
        f"Triton                {d['triton'] or 'not installed'}"
        + (" (interpreter on)" if d["triton_interpreter"] else ""),
        f"GPU                   {d['gpu'] or 'none'}"
        + (f" (sm_{''.join(map(str, d['gpu_capability']))})" if d["gpu_capability"] else ""),
        f"CUDA kernels run here {d['cuda_kernels_on_gpu'] or 'n/a (no GPU)'}",
        f"REMAT_BACKEND/context {d['requested_backend'] or 'not set'}",
        f"rope rotation         cpu -> {d['rope_rotation']['cpu']}, "
        f"cuda -> {d['rope_rotation']['cuda'] or 'n/a (no GPU)'} (q, k rotated once around cores without rope)",
    ]
    for op, choice in d["default_backend"].items():
        lines.append(f"{op:<21} default backend: cpu -> {choice['cpu']}, cuda -> {choice['cuda'] or 'n/a (no GPU)'}")
    print("\n".join(lines), file=file)
