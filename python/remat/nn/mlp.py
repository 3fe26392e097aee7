"""Drop-in MLP modules with Hugging Face's parameter names (LlamaMLP's gate/up/down_proj, or
c_fc/c_proj as nn.Linear), running remat's fused MLP Functions."""

from torch import nn

from remat import checks, functional
from remat.autograd.mlp import RECOMPUTE_MODES
from remat.nn.adapters import (
    ACTIVATION_FUNCTIONS,
    linear_projection,
    projection_features,
    read_projection,
    weights_like,
)
from remat.ops.mlp import ACTIVATIONS


def activation_of(module):
    """remat's activation name for a stock activation module (SiLU, GELU)."""
    if isinstance(module, nn.SiLU):
        return "silu"
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    name = type(module).__name__
    if name == "SiLUActivation":
        return "silu"
    if name in ("GELUActivation",):
        return "gelu"
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"):
        return "gelu_tanh"
    raise TypeError(f"unsupported activation module {name}; remat's MLPs take SiLU and GELU (erf or tanh)")


class SwiGLUMLP(nn.Module):
    """Gated MLP with the parameter names of Hugging Face's ``LlamaMLP``: ``gate_proj``,
    ``up_proj`` (``[intermediate, hidden]``) and ``down_proj`` (``[hidden, intermediate]``).

    Args:
        hidden, intermediate: sizes.
        bias: biases on the three projections (Llama's ``mlp_bias``), default False.
        activation: ``"silu"`` (SwiGLU, default), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU).
        recompute: ``"block"`` (default), ``"activation"`` or ``"none"``; see remat.swiglu_mlp.
        backend: remat backend name or None.

    The projections are read at each call (remat.nn.adapters). With PEFT LoRA layers or other
    linear modules among them the MLP runs projection by projection (remat.lora_linear, or the
    module's own forward under checkpoint), keeping what eager PyTorch keeps between them
    (``recompute`` then does not apply); inside remat's decoder layers the fused sub-block takes
    LoRA instead.
    """

    def __init__(self, hidden, intermediate, bias=False, *, activation="silu", recompute="block", backend=None,
                 device=None, dtype=None):
        super().__init__()
        checks.check_choice(activation, "activation", ACTIVATIONS)
        checks.check_choice(recompute, "recompute", RECOMPUTE_MODES)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, device=device, dtype=dtype)
        self.activation, self.recompute, self.backend = activation, recompute, backend

    @classmethod
    def from_module(cls, stock, *, recompute="block", backend=None):
        """A SwiGLUMLP sharing the projections (no copy) of a module with ``gate_proj``,
        ``up_proj``, ``down_proj`` (nn.Linear, PEFT LoRA layers or other linear modules: see
        remat.nn.adapters) and ``act_fn`` (SiLU or GELU), e.g. LlamaMLP."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            projection_features(getattr(stock, name, None), name, stock)
        activation = activation_of(stock.act_fn) if hasattr(stock, "act_fn") else "silu"
        module = cls(stock.gate_proj.in_features, stock.gate_proj.out_features, bias=False, activation=activation,
                     recompute=recompute, backend=backend, device="meta")
        module.gate_proj, module.up_proj, module.down_proj = stock.gate_proj, stock.up_proj, stock.down_proj
        return module

    def forward(self, x):
        projections = [read_projection(p) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        if any(p.generic or p.adapters for p in projections):
            # Adapters or other linear modules: each projection on its own (remat.nn.adapters).
            gate, up, down = (lambda t, p=p: linear_projection(p, t, self.backend) for p in projections)
            return down(ACTIVATION_FUNCTIONS[self.activation](gate(x)) * up(x))
        w, b = weights_like(projections, x)
        return functional.gated_mlp(x, *w, b_gate=b[0], b_up=b[1], b_down=b[2], activation=self.activation,
                                    recompute=self.recompute, backend=self.backend)


class GELUMLP(nn.Module):
    """GPT-2's MLP written with nn.Linear: ``c_fc`` (``[intermediate, hidden]``), GELU,
    ``c_proj`` (``[hidden, intermediate]``), with biases.

    Args:
        hidden, intermediate: sizes.
        bias: biases on both projections (default True, as GPT-2).
        approximate: ``"none"`` (erf) or ``"tanh"`` (GPT-2's ``gelu_new``).
        recompute, backend: as for SwiGLUMLP.
    """

    def __init__(self, hidden, intermediate, bias=True, *, approximate="none", recompute="block", backend=None,
                 device=None, dtype=None):
        super().__init__()
        checks.check_choice(approximate, "approximate", checks.GELU_APPROXIMATIONS)
        checks.check_choice(recompute, "recompute", RECOMPUTE_MODES)
        self.c_fc = nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype)
        self.c_proj = nn.Linear(intermediate, hidden, bias=bias, device=device, dtype=dtype)
        self.approximate, self.recompute, self.backend = approximate, recompute, backend

    @classmethod
    def from_module(cls, stock, *, recompute="block", backend=None):
        """A GELUMLP sharing ``c_fc`` and ``c_proj`` (nn.Linear; Hugging Face's GPT-2 uses
        transposed Conv1D layers, which this does not take) and the GELU flavour of ``act``."""
        for name in ("c_fc", "c_proj"):
            if not isinstance(getattr(stock, name, None), nn.Linear):
                raise TypeError(f"from_module expects a module with nn.Linear {name}, got {type(stock).__name__}")
        activation = activation_of(stock.act) if hasattr(stock, "act") else "gelu"
        if activation == "silu":
            raise TypeError("GELUMLP takes a GELU activation, got SiLU")
        module = cls(stock.c_fc.in_features, stock.c_fc.out_features, bias=False,
                     approximate="none" if activation == "gelu" else "tanh", recompute=recompute, backend=backend,
                     device="meta")
        module.c_fc, module.c_proj = stock.c_fc, stock.c_proj
        return module

    def forward(self, x):
        projections = [read_projection(p) for p in (self.c_fc, self.c_proj)]
        if any(p.generic or p.adapters for p in projections):
            # Adapters or other linear modules: each projection on its own (remat.nn.adapters).
            approximate = "none" if self.approximate == "none" else "tanh"
            hidden = nn.functional.gelu(linear_projection(projections[0], x, self.backend), approximate=approximate)
            return linear_projection(projections[1], hidden, self.backend)
        return functional.gelu_mlp(x, checks.cast_like(self.c_fc.weight, x), checks.cast_like(self.c_fc.bias, x),
                                   checks.cast_like(self.c_proj.weight, x), checks.cast_like(self.c_proj.bias, x),
                                   approximate=self.approximate, recompute=self.recompute, backend=self.backend)
