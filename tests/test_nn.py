"""Drop-in modules: stock constructor arguments and state_dict keys, load_state_dict from stock
modules, from_module sharing parameters, and the same outputs and gradients as stock."""

import pytest
import torch

import remat
from remat import nn as rnn

from _checks import assert_within_2x_of_stock
from helpers import cpu_backends


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("shape", [64, (4, 16)], ids=["1d", "2d"])
def test_rms_norm_module_matches_stock(backend, shape):
    stock = torch.nn.RMSNorm(shape, eps=1e-5)
    with torch.no_grad():
        stock.weight.normal_()
    mine = rnn.RMSNorm(shape, eps=1e-5, backend=backend)
    assert mine.state_dict().keys() == stock.state_dict().keys()
    mine.load_state_dict(stock.state_dict())
    x = torch.randn(3, 5, 64).reshape(3, 5, *((shape,) if isinstance(shape, int) else shape))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_stock, y_mine = stock(x1), mine(x2)
    torch.testing.assert_close(y_mine, y_stock)
    y_stock.square().sum().backward()
    y_mine.square().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(mine.weight.grad, stock.weight.grad)


def test_rms_norm_default_eps_is_dtype_eps():
    stock = torch.nn.RMSNorm(32)
    mine = rnn.RMSNorm.from_module(stock)
    x = torch.randn(4, 32) * 1e-4
    torch.testing.assert_close(mine(x), stock(x))


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_module_matches_stock(backend, bias):
    stock = torch.nn.LayerNorm(48, bias=bias)
    with torch.no_grad():
        stock.weight.normal_()
        if bias:
            stock.bias.normal_()
    mine = rnn.LayerNorm(48, bias=bias, backend=backend)
    assert mine.state_dict().keys() == stock.state_dict().keys()
    mine.load_state_dict(stock.state_dict())
    x = torch.randn(2, 7, 48)
    torch.testing.assert_close(mine(x), stock(x))


@pytest.mark.parametrize("cls,stock_cls", [(rnn.RMSNorm, torch.nn.RMSNorm), (rnn.LayerNorm, torch.nn.LayerNorm)])
def test_from_module_shares_parameters(cls, stock_cls):
    stock = stock_cls(16)
    mine = cls.from_module(stock)
    assert mine.weight is stock.weight
    assert mine.eps == stock.eps
    if stock_cls is torch.nn.LayerNorm:
        assert mine.bias is stock.bias
    with pytest.raises(TypeError, match="from_module expects"):
        cls.from_module(torch.nn.Linear(2, 2))


def test_no_affine_modules_have_no_parameters():
    assert list(rnn.RMSNorm(8, elementwise_affine=False).parameters()) == []
    assert list(rnn.LayerNorm(8, elementwise_affine=False).parameters()) == []
    x = torch.randn(3, 8)
    torch.testing.assert_close(rnn.LayerNorm(8, elementwise_affine=False)(x),
                               torch.nn.functional.layer_norm(x, (8,)))


def test_module_residual_returns_sum_and_norm():
    mine = rnn.RMSNorm(32, eps=1e-6)
    x, r = torch.randn(5, 32), torch.randn(5, 32)
    y, h = mine(x, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (32,), mine.weight, 1e-6))


def test_module_casts_fp32_parameters_to_bf16_input():
    """bf16 activations with fp32 parameters (autocast-style training): the norm runs in bf16 and
    the fp32 weight receives its gradient through the cast."""
    mine = rnn.LayerNorm(32)
    with torch.no_grad():
        mine.weight.normal_()
        mine.bias.normal_()
    stock = torch.nn.LayerNorm(32)
    stock.load_state_dict(mine.state_dict())
    x = torch.randn(4, 32).bfloat16().requires_grad_()
    y = mine(x)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(4, 32)
    (y.float() * dy).sum().backward()
    assert mine.weight.grad is not None and mine.weight.grad.dtype == torch.float32
    # Stock: the same autocast-style cast of the fp32 parameters, LayerNorm in bf16.
    x_stock = x.detach().clone().requires_grad_()
    y_stock = torch.nn.functional.layer_norm(x_stock, (32,), stock.weight.bfloat16(), stock.bias.bfloat16())
    (y_stock.float() * dy).sum().backward()
    # float64 reference, with the parameters as the bf16 run sees them.
    x64 = x.detach().double().requires_grad_()
    w64, b64 = (p.detach().bfloat16().double().requires_grad_() for p in (mine.weight, mine.bias))
    y64 = torch.nn.functional.layer_norm(x64, (32,), w64, b64)
    (y64 * dy.double()).sum().backward()
    assert_within_2x_of_stock("y", y, y_stock, y64, torch.bfloat16)
    assert_within_2x_of_stock("dx", x.grad, x_stock.grad, x64.grad, torch.bfloat16)
    assert_within_2x_of_stock("dw", mine.weight.grad, stock.weight.grad, w64.grad, torch.bfloat16)
    assert_within_2x_of_stock("db", mine.bias.grad, stock.bias.grad, b64.grad, torch.bfloat16)


def test_wrong_trailing_shape_raises():
    with pytest.raises(ValueError, match="trailing dimensions"):
        rnn.RMSNorm((4, 8))(torch.randn(2, 8, 4))


def test_modules_in_package_namespace():
    assert remat.nn.RMSNorm is rnn.RMSNorm and remat.nn.LayerNorm is rnn.LayerNorm


def test_module_argument_checks():
    with pytest.raises(ValueError, match="eps must be a positive"):
        rnn.RMSNorm(8, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be a positive"):
        rnn.LayerNorm(8, eps=0.0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rnn.RMSNorm(8)([1.0] * 8)
