"""Operator registration, one file per block: the extension's ops' fake kernels, the Triton
launchers as custom ops, and the plain-PyTorch implementations. Each block module holds an ``OPS``
table (backend name -> that backend's operators, one NamedTuple per block), and
:func:`ops_for` is the one place the autograd Functions get their operators from."""

from remat.backend import BACKENDS, BackendUnavailableError
from remat.ops import attention, attention_cudnn, cross_entropy, dropout, mlp, norm

_TABLES = {"norm": norm.OPS, "mlp": mlp.OPS, "attention": {**attention.OPS, "cudnn": attention_cudnn.CUDNN_OPS},
           "dropout": dropout.OPS, "cross_entropy": cross_entropy.OPS}
BLOCKS = tuple(_TABLES)


def ops_for(block, backend):
    """The operators of ``block`` (one of :data:`BLOCKS`) for a resolved ``backend`` name (one of
    remat.backend.BACKENDS). Unknown names raise ValueError; the extension's backends raise
    BackendUnavailableError when remat._C is not built."""
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend not in _TABLES[block]:
        raise BackendUnavailableError(f"remat backend {backend!r} has no {block} operators (it is one of PyTorch's "
                                      "fused attention cores, for attention only)")
    ops = _TABLES[block][backend]
    if ops is None:
        raise BackendUnavailableError(f"remat backend {backend!r} needs the compiled extension remat._C, which "
                                      "is not importable; build it with `pip install --no-build-isolation -e .`")
    return ops
