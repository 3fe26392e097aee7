"""Triton launches run on their tensors' device and stream (remat.ops.device): every Triton
operator is wrapped, the wrapper enters the device of the operator's first tensor (checked on the
CPU under the interpreter by recording what it enters), and with two GPUs a call on cuda:1 while
cuda:0 is current gives the same result as on cuda:0 (gpu-marked)."""

import pytest
import torch

import remat
from remat.ops import device as device_mod

from helpers import cpu_backends

needs_interpreter = pytest.mark.skipif("triton" not in cpu_backends(),
                                       reason="Triton runs on the CPU only under TRITON_INTERPRET=1")


def test_every_triton_op_runs_on_its_tensors_device():
    registered = {name.split("::", 1)[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("remat_triton::")}
    assert registered, "no Triton ops registered"
    unguarded = {name for name in registered if f"triton_{name}" not in device_mod.GUARDED}
    assert not unguarded, f"Triton ops launched without entering their tensors' device: {sorted(unguarded)}"


@needs_interpreter
def test_launches_enter_the_first_tensors_device(monkeypatch):
    entered = []
    real = device_mod.launch_device

    def spy(tensor):
        entered.append(tensor.device)
        return real(tensor)

    monkeypatch.setattr(device_mod, "launch_device", spy)
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.ones(40, requires_grad=True)
    remat.rms_norm(x, w, backend="triton").sum().backward()
    q = torch.randn(1, 5, 2, 16, requires_grad=True)
    remat.attention(q, q, q, causal=True, backend="triton").sum().backward()
    assert len(entered) == 4 and set(entered) == {torch.device("cpu")}  # two forwards, two backwards


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("block", ["rms_norm", "attention", "dropout"])
def test_second_gpu_while_first_is_current(block):
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 2, 32, generator=g).to(torch.bfloat16)

    def run(device):
        t = x.to(device).requires_grad_()
        torch.manual_seed(3)
        if block == "rms_norm":
            out = remat.rms_norm(t, None, backend="triton")
        elif block == "attention":
            out = remat.attention(t, t, t, causal=True, backend="triton")
        else:
            out = remat.dropout(t, 0.3, backend="triton")
        out.float().square().sum().backward()
        torch.cuda.synchronize(device)
        return out.detach().cpu(), t.grad.cpu()

    first, second = run("cuda:0"), run("cuda:1")
    assert torch.cuda.current_device() == 0
    for a, b in zip(first, second):
        assert torch.equal(a, b)
