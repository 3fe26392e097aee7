"""Paths of the Triton attention kernels that the shared attention tests do not single out: the
dropout stream read four keys per Philox call at any row length and tile shape; the dK/dV kernel
with each kv head's query heads split over several programs (GQA, MQA, rope rotated before the kernels, window, softcap,
dropout, packed sequences, both backward modes) against the unsplit kernel and the float64
reference, and the launcher's choice of the split; TF32 dots following PyTorch's fp32 matmul
setting; head dims that are not powers of two split into power-of-two column parts against the
float64 reference and the padded tiles; RoPE in the forward kernel (forward-only calls: a call
with a backward rotates q and k outside the kernels, remat.ops.attention rope_rotated_once) with
the rotation halves padded by default or split with launch.ROPE_SPLIT_HALVES; the backward
launchers refusing rotary tables before any kernel.

Runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1 (tiny shapes), or on a CUDA GPU
without it.
"""

import contextlib
import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA GPU; neither is here",
                allow_module_level=True)
pytest.importorskip("triton")

import remat  # noqa: E402
from remat.autograd.common import draw_rng_state  # noqa: E402
from remat.kernels.attention import launch, tuning  # noqa: E402
from remat.reference import attention_dropout_keep, attention_reference  # noqa: E402

from _checks import assert_within_2x_of_stock  # noqa: E402
from helpers import (  # noqa: E402
    attention_eager,
    deterministic_mode,
    make_inputs,
    mask_from_output,
    run_and_check,
)

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


@pytest.mark.skipif(not INTERPRETED, reason="the tile override is for the interpreter's launches")
@pytest.mark.parametrize("tile", [(16, 16), (16, 32), (32, 16)], ids=["m16-n16", "m16-n32", "m32-n16"])
@pytest.mark.parametrize("m", [37, 64], ids=["m37", "m64"])
def test_dropout_mask_reads_four_keys_per_philox_call(m, tile, monkeypatch):
    """The forward's keep mask is remat.reference.attention_dropout_keep bit for bit: rows of M
    keys take ceil(M / 4) counters each (M = 37 leaves a partial last group), and each key tile
    interleaves the four words of its counters in key order, whatever the tile shape."""
    monkeypatch.setattr(tuning, "INTERPRETER_TILE", tile)
    b, hq, n, p = 2, 2, 5, 0.3
    torch.manual_seed(11)
    rng = draw_rng_state("cpu")
    expected = attention_dropout_keep(rng[0], rng[1], (b, hq, n, m), p)
    got = mask_from_output("triton", b, hq, n, m, p, seed=11, device=DEVICE)
    assert torch.equal(got, expected)
    assert 0.5 < expected.float().mean().item() < 0.9


# dK/dV with each kv head's query heads split over several programs (HEAD_SPLITS), which the
# launchers pick on a GPU when the per-kv-head grid leaves multiprocessors idle; forced here with
# the launch module's override. name: spec (tests/helpers.py), the splits tried.
SPLIT_CASES = [
    pytest.param(dict(b=2, n=33, m=40, hq=4, hkv=2, d=32, causal=True, rope="per_batch", dropout=0.2), (2,),
                 id="gqa2-causal-rope-dropout"),
    pytest.param(dict(b=1, n=21, m=37, hq=4, hkv=1, d=16, window=(6, 3), softcap=5.0), (2, 4),
                 id="mqa4-window-softcap"),
    pytest.param(dict(b=1, n=19, m=19, hq=4, hkv=1, d=32, causal=True, rope="shared", window=(5, None),
                      dropout=0.3), (4,), id="mqa4-rope-window-dropout"),
]


def record_head_splits(monkeypatch):
    """The HEAD_SPLITS of every dK/dV launch from now on, in order."""
    seen = []
    original = launch._launch

    def recording(kernel, kernel_name, grid_of, args, constexprs, *rest, **options):
        if kernel_name == "dkdv":
            seen.append(constexprs["HEAD_SPLITS"])
        return original(kernel, kernel_name, grid_of, args, constexprs, *rest, **options)

    monkeypatch.setattr(launch, "_launch", recording)
    return seen


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
@pytest.mark.parametrize("spec,splits", SPLIT_CASES)
def test_dkdv_head_split_matches_unsplit_and_reference(spec, splits, deterministic, monkeypatch):
    """Every split gives the unsplit kernel's gradients up to fp32 summation order (the partial sums
    add in another order), o and (deterministic) dq bit for bit (other kernels), and each is within
    the 2x rule of the float64 reference (run_and_check)."""
    seen = record_head_splits(monkeypatch)
    monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", None)
    unsplit = run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    for count in splits:
        monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", count)
        split = run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
        assert torch.equal(split[0], unsplit[0])
        if deterministic:
            assert torch.equal(split[1], unsplit[1])
        for name, a, b in zip(("dq", "dk", "dv"), split[1:], unsplit[1:]):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * b.abs().max().item(), msg=name)
    expected = [1] + list(splits) if INTERPRETED else None
    assert expected is None or seen == expected


@pytest.mark.parametrize("spec,splits", [SPLIT_CASES[0]])
def test_dkdv_head_split_bf16_within_reference(spec, splits, monkeypatch):
    """bf16: the split's partial sums are rounded once, after the sum (2x rule against float64)."""
    seen = record_head_splits(monkeypatch)
    monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", splits[-1])
    run_and_check(spec, torch.bfloat16, "triton", device=DEVICE)
    assert not INTERPRETED or seen == [splits[-1]]


VARLEN_SPLIT_CASES = [
    pytest.param(dict(lens_q=[9, 0, 17], lens_k=[9, 3, 19], hq=4, hkv=1, d=32, causal=True, rope="per_token",
                      dropout=0.2), id="mqa4-rope-dropout-zero-queries"),
    pytest.param(dict(lens_q=[3, 1, 18], lens_k=[7, 0, 21], hq=4, hkv=2, d=16, causal=True, window=(6, None),
                      softcap=5.0), id="gqa2-window-softcap-zero-keys"),
]


@pytest.mark.parametrize("spec", VARLEN_SPLIT_CASES)
def test_dkdv_head_split_varlen(spec, monkeypatch):
    """Packed sequences (lengths 0 on either side): split and unsplit agree up to fp32 summation
    order (dq, o bit for bit) and both are within the 2x rule of the float64 per-sequence reference."""
    from test_varlen_attention import make_varlen_inputs, reference_outputs, run_varlen, sequence_keeps

    group = spec["hq"] // spec["hkv"]
    seen = record_head_splits(monkeypatch)
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(spec, torch.float32)
    results = []
    for count in (None, group):
        monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", count)
        torch.manual_seed(77)
        rng = draw_rng_state(DEVICE).cpu()
        torch.manual_seed(77)
        results.append(run_varlen(spec, q, k, v, dout, cu_q, cu_k, rope, "triton", device=DEVICE))
    unsplit, split = results
    keeps = sequence_keeps(spec, rng)
    reference = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, keeps, torch.float64)
    stock = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, keeps, torch.float32)
    assert torch.equal(split[0], unsplit[0]) and torch.equal(split[1], unsplit[1])
    for name, a, b, stock_value, ref in zip(("o", "dq", "dk", "dv"), split, unsplit, stock, reference):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * b.abs().max().item(), msg=name)
        assert_within_2x_of_stock(name, a, stock_value, ref, torch.float32)
    assert not INTERPRETED or seen == [1, group]


def test_dkdv_head_split_choice(monkeypatch):
    """The smallest divisor of the group that fills the device, no split when the per-kv-head grid
    already does (or the group is 1, or no multiprocessor count), the override when set."""
    monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", None)
    choose = launch._dkdv_head_splits
    assert choose(64, 8, 132) == 4  # B = 1, Hkv = 1, M = 4096 with 64-key tiles: 64 * 2 < 132 <= 64 * 4
    assert choose(64, 6, 132) == 3
    assert choose(10, 6, 132) == 6  # even the whole group leaves SMs idle
    assert choose(132, 8, 132) == 1
    assert choose(8, 1, 132) == 1
    assert choose(8, 8, None) == 1
    monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", 2)
    assert choose(500, 4, 132) == 2
    assert choose(500, 1, 132) == 1
    with pytest.raises(ValueError, match="does not divide"):
        choose(500, 3, 132)


@contextlib.contextmanager
def tf32_matmuls(enabled):
    """torch.backends.cuda.matmul.allow_tf32 = enabled inside the block, restored after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def record_launch_constexprs(monkeypatch):
    """(kernel name, constexprs) of every tuned attention launch from now on: the launcher's
    constexprs (the column tiles among them) with the chosen configuration's (the tile) over them."""
    seen = []
    original = launch._launch

    def recording(kernel, kernel_name, grid_of, args, constexprs, *rest, **options):
        config = original(kernel, kernel_name, grid_of, args, constexprs, *rest, **options)
        seen.append((kernel_name, dict(constexprs, **config.kwargs)))
        return config

    monkeypatch.setattr(launch, "_launch", recording)
    return seen


@pytest.mark.parametrize("dtype,allow,expected", [(torch.float32, True, True), (torch.float32, False, False),
                                                  (torch.bfloat16, True, False)],
                         ids=["fp32-tf32", "fp32-ieee", "bf16-tf32-ignored"])
def test_tf32_constexpr_follows_pytorch_setting(dtype, allow, expected, monkeypatch):
    """Every forward, dK/dV and dQ launch gets TF32 = PyTorch's fp32 matmul setting at the call
    for fp32 operands, and False for 16-bit ones (their dots ignore it: no second variant); the
    tuner keys the two variants apart. The interpreter multiplies in IEEE either way (numerics:
    the gpu-marked test below)."""
    seen = record_launch_constexprs(monkeypatch)
    q, k, v = (torch.randn(1, 20, 2, 16, device=DEVICE).to(dtype).requires_grad_() for _ in range(3))
    with tf32_matmuls(allow):
        remat.attention(q, k, v, causal=True, backend="triton").sum().backward()
    assert sorted(name for name, _ in seen) == ["dkdv", "dq", "fwd"]
    assert all(constexprs["TF32"] is expected for _, constexprs in seen)
    shape = tuning.LaunchShape(20, 20, 1, -1, 0, -1)
    flags = dict(seen[0][1])
    keys = {tuning.tuning_key("fwd", dtype, dict(flags, TF32=value), shape) for value in (False, True)}
    assert len(keys) == 2


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_tf32_numerics_on_gpu():
    """fp32 attention with allow_tf32 on: within the 2x rule of stock PyTorch with TF32 matmuls
    (error vs float64), and different from the IEEE result (the TF32 dots ran); with it off,
    within the rule of stock IEEE fp32."""
    spec = dict(b=2, n=200, m=200, hq=4, hkv=2, d=64, causal=True)
    with tf32_matmuls(False):
        ieee = run_and_check(spec, torch.float32, "triton", device=DEVICE)
    with tf32_matmuls(True):
        q, k, v, dout, _ = make_inputs(spec, torch.float32, device=DEVICE)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = remat.attention(*leaves, causal=True, backend="triton")
        o.backward(dout)
        got = [o.detach()] + [t.grad for t in leaves]
        # Stock: the eager computation in fp32 on the GPU, its matmuls in TF32 too.
        stock_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        stock_o = attention_reference(*stock_leaves, causal=True)
        stock_o.backward(dout)
        stock = [stock_o.detach()] + [t.grad for t in stock_leaves]
    reference = attention_eager(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), None, spec, None, torch.float64)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), got, stock, reference):
        assert_within_2x_of_stock(name, value.cpu(), stock_value.cpu(), ref, torch.float32)
    assert not torch.equal(got[0].cpu(), ieee[0])


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_dkdv_head_split_chosen_on_gpu(monkeypatch):
    """MQA with one kv head and batch 1 (the per-kv-head grid far below the SM count): the launcher
    splits the group (the smallest divisor that fills the device), and both the split and the
    forced unsplit backward are within the 2x rule of the float64 reference."""
    spec = dict(b=1, n=512, m=512, hq=8, hkv=1, d=64, causal=True)
    seen = record_head_splits(monkeypatch)
    monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", None)
    run_and_check(spec, torch.bfloat16, "triton", device=DEVICE)
    block_n = tuning._configs_for("dkdv", dict(BLOCK_D=64, ROPE=False, DROPOUT=False, ATOMIC_DQ=False),
                                  torch.bfloat16)[0].kwargs["BLOCK_N"]
    multiprocessors = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert seen == [launch._dkdv_head_splits(-(-512 // block_n), 8, multiprocessors)]
    assert seen[0] > 1
    monkeypatch.setattr(launch, "DKDV_HEAD_SPLITS", 1)
    run_and_check(spec, torch.bfloat16, "triton", device=DEVICE)
    assert seen[-1] == 1


# Split head dims (launch._head_dim_parts): a D that is not a power of two runs as two power-of-two
# column parts when they are narrower than the padded tile; with RoPE v, o, dout, dv so, and q, k
# (dq, dk) as two rotation halves, each of them split the same way. name: spec, the expected
# (BLOCK_D, BLOCK_D2) of the forward, dK/dV and dQ launches.
SPLIT_HEAD_DIM_CASES = [
    pytest.param(dict(b=1, n=17, m=19, hq=4, hkv=2, d=80, causal=True), (64, 16), id="d80-gqa2-causal"),
    pytest.param(dict(b=2, n=9, m=18, hq=2, hkv=1, d=96, window=(5, 2), softcap=5.0, dropout=0.2), (64, 32),
                 id="d96-mqa-window-softcap-dropout"),
    pytest.param(dict(b=1, n=17, m=17, hq=2, hkv=1, d=192, causal=True), (128, 64), id="d192-mqa-causal"),
]


def test_head_dim_parts_and_their_tile_class():
    """(BLOCK_D, BLOCK_H, BLOCK_D2, BLOCK_H2): 80 -> 64 + 16, 96 -> 64 + 32, 192 -> 128 + 64, 40 -> 32 + 16;
    powers of two and 112 (64 + 64 is no narrower than 128) stay padded. With RoPE the same split of
    BLOCK_D, BLOCK_D2; each rotation half of D/2 padded (BLOCK_H2 = 0) unless split_halves, then split
    by the same rule (40 -> 32 + 16, 48 -> 32 + 16, 96 -> 64 + 32, 72 -> 64 + 16) or padded where that is
    no narrower (20 -> 32, 24 -> 32, 56 -> 64, 32 -> 32). The split's tuning class is that of the held
    columns' next power of two (80, 96: the 128 class; 192: the 256 class), and with RoPE the halves'
    parts never hold more columns than that class. split_halves changes nothing without RoPE."""
    parts = launch._head_dim_parts
    for split_halves in (False, True):
        assert [parts(d, False, split_halves) for d in (80, 96, 192, 40)] == [
            (64, 64, 16, 0), (64, 64, 32, 0), (128, 128, 64, 0), (32, 32, 16, 0)]
        assert [parts(d, False, split_halves) for d in (8, 24, 64, 112, 128, 200)] == [
            (16, 16, 0, 0), (32, 32, 0, 0), (64, 64, 0, 0), (128, 128, 0, 0), (128, 128, 0, 0), (256, 256, 0, 0)]
    rope_dims = (80, 96, 192, 144, 40, 48, 64, 112, 2, 256)
    assert [parts(d, True, True) for d in rope_dims] == [
        (64, 32, 16, 16), (64, 32, 32, 16), (128, 64, 64, 32), (128, 64, 16, 16), (32, 32, 16, 0), (32, 32, 16, 0),
        (64, 32, 0, 0), (128, 64, 0, 0), (16, 16, 0, 0), (256, 128, 0, 0)]
    assert [parts(d, True, False) for d in rope_dims] == [
        (64, 64, 16, 0), (64, 64, 32, 0), (128, 128, 64, 0), (128, 128, 16, 0), (32, 32, 16, 0), (32, 32, 16, 0),
        (64, 32, 0, 0), (128, 64, 0, 0), (16, 16, 0, 0), (256, 128, 0, 0)]
    for d in range(2, 257, 2):
        padded_half = max(16, 1 << (d // 2 - 1).bit_length())
        block_d, block_h, block_d2, block_h2 = parts(d, True, False)
        assert (block_h, block_h2) == (padded_half, 0)
        block_d, block_h, block_d2, block_h2 = parts(d, True, True)
        assert block_h + block_h2 >= d // 2 and block_h + block_h2 <= padded_half
        assert block_h2 == 0 or (block_h2 >= 16 and block_h + block_h2 < padded_half and block_h < d // 2)
        assert 2 * (block_h + block_h2) <= max(64, 1 << (block_d + block_d2 - 1).bit_length())
    for d, padded in ((80, 128), (96, 128), (192, 256)):
        block_d, _, block_d2, _ = parts(d, False, False)
        for name in ("fwd", "dq", "dkdv"):
            flags = dict(ROPE=False, DROPOUT=False)
            assert (tuning._configs_for(name, dict(flags, BLOCK_D=block_d, BLOCK_D2=block_d2), torch.bfloat16)
                    is tuning._configs_for(name, dict(flags, BLOCK_D=padded, BLOCK_D2=0), torch.bfloat16))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
@pytest.mark.parametrize("spec,blocks", SPLIT_HEAD_DIM_CASES)
def test_split_head_dim_within_reference(spec, blocks, deterministic, monkeypatch):
    """Forward and backward at split head dims within the 2x rule of the float64 reference
    (run_and_check, fp32), and every forward, dK/dV and dQ launch gets the split tiles (the
    forward's q/k tiles the same, BLOCK_H = BLOCK_D without RoPE)."""
    seen = record_launch_constexprs(monkeypatch)
    run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    assert sorted(name for name, _ in seen) == (["dkdv", "dq", "fwd"] if deterministic else ["dkdv", "fwd"])
    assert all((c["BLOCK_D"], c["BLOCK_D2"]) == blocks for _, c in seen)
    assert all((c["BLOCK_H"], c["BLOCK_H2"]) == (blocks[0], 0) for name, c in seen if name == "fwd")


def test_split_head_dim_bf16_within_reference(monkeypatch):
    """bf16 at D = 96 (64 + 32), GQA, both backward modes: the 2x rule against float64."""
    seen = record_launch_constexprs(monkeypatch)
    spec = dict(b=1, n=18, m=18, hq=4, hkv=2, d=96, causal=True)
    for deterministic in (True, False):
        run_and_check(spec, torch.bfloat16, "triton", deterministic=deterministic, device=DEVICE)
    assert seen and all(c["BLOCK_D2"] == 32 for _, c in seen)


def split_rope_halves(monkeypatch):
    """Turn launch.ROPE_SPLIT_HALVES on (REMAT_ATTENTION_ROPE_SPLIT_HALVES=1) for the rest of the test."""
    monkeypatch.setattr(launch, "ROPE_SPLIT_HALVES", True)


def padded_halves(blocks):
    """The default (BLOCK_D, BLOCK_H, BLOCK_D2, BLOCK_H2) for the split layout's `blocks`: the rotation
    halves padded (a split's first part is half the padded half)."""
    block_d, block_h, block_d2, block_h2 = blocks
    return (block_d, 2 * block_h, block_d2, 0) if block_h2 else blocks


def assert_rope_forward_launch(seen, blocks):
    """The call launched the forward kernel only, once, with RoPE and the column tiles `blocks`."""
    assert [name for name, _ in seen] == ["fwd"]
    c = seen[0][1]
    assert c["ROPE"] is True
    assert (c["BLOCK_D"], c["BLOCK_H"], c["BLOCK_D2"], c["BLOCK_H2"]) == blocks


def forward_only_within_reference(spec, dtype):
    """o of remat.attention(..., backend="triton") on the case's inputs, none of which needs a
    gradient (a forward-only call: the forward kernel rotates q and k itself), within the 2x rule of
    the float64 reference (stock: the eager computation in ``dtype``). Returns o on the CPU."""
    q, k, v, dout, rope = make_inputs(spec, dtype, device=DEVICE)
    dropout = spec.get("dropout", 0.0)
    torch.manual_seed(1234)
    rng = draw_rng_state(DEVICE).cpu()
    torch.manual_seed(1234)
    o = remat.attention(q, k, v, causal=spec.get("causal", False), dropout_p=dropout, rope=rope,
                        window=spec.get("window"), softcap=spec.get("softcap"), backend="triton").cpu()
    keep = None
    if dropout:
        keep = attention_dropout_keep(rng[0], rng[1], (spec["b"], spec["hq"], spec["n"], spec["m"]), dropout)
    reference, stock = (attention_eager(q, k, v, dout, rope, spec, keep, t)[0] for t in (torch.float64, dtype))
    assert o.dtype == dtype
    assert_within_2x_of_stock("o", o, stock, reference, dtype)
    return o


# RoPE at split head dims: name: spec, the expected (BLOCK_D, BLOCK_H, BLOCK_D2, BLOCK_H2) of the
# forward launch with ROPE_SPLIT_HALVES (by default: the same with padded halves, `padded_halves`).
# D = 40: v side 32 + 16, halves of 20 padded to 32 (16 + 16 is no narrower); 80: halves of 40 as
# 32 + 16; 96: 48 as 32 + 16; 192: 96 as 64 + 32.
ROPE_SPLIT_CASES = [
    pytest.param(dict(b=1, n=17, m=33, hq=4, hkv=2, d=40, causal=True, rope="shared"), (32, 32, 16, 0),
                 id="d40-gqa2-causal"),
    pytest.param(dict(b=1, n=17, m=17, hq=4, hkv=2, d=80, causal=True, rope="shared"), (64, 32, 16, 16),
                 id="d80-gqa2-causal"),
    pytest.param(dict(b=1, n=17, m=33, hq=4, hkv=2, d=80, window=(6, 3), softcap=5.0, rope="per_batch"),
                 (64, 32, 16, 16), id="d80-gqa2-window-softcap"),
    pytest.param(dict(b=2, n=9, m=18, hq=4, hkv=2, d=96, rope="per_batch", dropout=0.2, softcap=5.0),
                 (64, 32, 32, 16), id="d96-gqa2-dropout-softcap"),
    pytest.param(dict(b=1, n=17, m=17, hq=2, hkv=1, d=192, causal=True, rope="shared"), (128, 64, 64, 32),
                 id="d192-mqa-causal"),
]


@pytest.mark.parametrize("spec,blocks", ROPE_SPLIT_CASES)
def test_rope_forward_in_either_rotation_halves_layout(spec, blocks, monkeypatch):
    """A forward-only call with RoPE: v, o run as BLOCK_D + BLOCK_D2 columns and q, k as two
    rotation halves, by default padded: o within the 2x rule of float64 (fp32), the forward kernel
    launched with RoPE and the padded halves. Then with ROPE_SPLIT_HALVES each half is held as
    BLOCK_H + BLOCK_H2 columns (four q/k tiles, each part rotated on its own): again within the rule,
    launched with the split tiles, and o equal to the padded layout's up to fp32 summation order."""
    seen = record_launch_constexprs(monkeypatch)
    padded = forward_only_within_reference(spec, torch.float32)
    assert_rope_forward_launch(seen, padded_halves(blocks))
    if blocks[3]:
        seen.clear()
        split_rope_halves(monkeypatch)
        split = forward_only_within_reference(spec, torch.float32)
        assert_rope_forward_launch(seen, blocks)
        torch.testing.assert_close(split, padded, rtol=1e-5, atol=1e-5 * padded.abs().max().item())


@pytest.mark.parametrize("split_halves,blocks", [(False, (64, 64, 16, 0)), (True, (64, 32, 16, 16))],
                         ids=["padded-halves", "split-halves"])
def test_rope_forward_bf16_within_reference(split_halves, blocks, monkeypatch):
    """bf16 at D = 80 with RoPE (halves 64 by default, 32 + 16 with ROPE_SPLIT_HALVES), GQA, causal,
    forward only: the rotated parts rounded to bf16 before the dots, o within the 2x rule of float64."""
    monkeypatch.setattr(launch, "ROPE_SPLIT_HALVES", split_halves)
    seen = record_launch_constexprs(monkeypatch)
    forward_only_within_reference(dict(b=1, n=17, m=17, hq=4, hkv=2, d=80, causal=True, rope="per_batch"),
                                  torch.bfloat16)
    assert_rope_forward_launch(seen, blocks)


@pytest.mark.parametrize("split_halves", [False, True], ids=["padded-halves", "split-halves"])
@pytest.mark.parametrize("head_dim", [80, 96], ids=["d80", "d96"])
def test_rope_forward_large_logits_in_either_layout(head_dim, split_halves, monkeypatch):
    """fp32, causal, RoPE, logits of tens (q, k ~ 3 N(0, 1)), the forward kernel launched directly
    with the tables: o within the 2x rule of the float64 reference in either halves layout, with
    (BLOCK_H, BLOCK_H2) = (64, 0), or (32, 16) split (both head dims' halves, 40 and 48 columns)."""
    monkeypatch.setattr(launch, "ROPE_SPLIT_HALVES", split_halves)
    seen = record_launch_constexprs(monkeypatch)
    torch.manual_seed(0)
    n = 32
    q, k = (3.0 * torch.randn(1, n, 1, head_dim) for _ in range(2))
    v = torch.randn(1, n, 1, head_dim)
    angles = 6.28 * torch.rand(1, n, head_dim // 2)
    cos, sin = angles.cos(), angles.sin()
    scale = head_dim ** -0.5

    def reference(dtype):
        leaves = [t.to(dtype) for t in (q, k, v)]
        return attention_reference(*leaves, causal=True, scale=scale, rope=(cos.to(dtype), sin.to(dtype)))

    o, _ = launch.attention_fwd(*(t.to(DEVICE) for t in (q, k, v, cos, sin)), None, scale, 0.0, -1, 0, 0.0)
    assert_within_2x_of_stock("o", o.cpu(), reference(torch.float32), reference(torch.float64), torch.float32)
    assert [name for name, _ in seen] == ["fwd"]
    assert (seen[0][1]["BLOCK_H"], seen[0][1]["BLOCK_H2"]) == ((32, 16) if split_halves else (64, 0))


VARLEN_D80 = dict(lens_q=[9, 0, 17], lens_k=[9, 3, 19], hq=4, hkv=2, d=80, causal=True, window=(7, None),
                  rope="per_token")


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
def test_split_head_dim_varlen(deterministic, monkeypatch):
    """Packed sequences at D = 80 (64 + 16) with RoPE, GQA, a sequence without queries, forward and
    backward: within the 2x rule of the float64 per-sequence reference, every launch with the split
    tiles, and no backward launch given RoPE fields (its kernels take q and k rotated)."""
    from test_varlen_attention import make_varlen_inputs, reference_outputs, run_varlen

    seen = record_launch_constexprs(monkeypatch)
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(VARLEN_D80, torch.float32)
    with contextlib.nullcontext() if deterministic else deterministic_mode(False):
        got = run_varlen(VARLEN_D80, q, k, v, dout, cu_q, cu_k, rope, "triton", device=DEVICE,
                         deterministic=deterministic)
    reference = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, VARLEN_D80, None, torch.float64)
    stock = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, VARLEN_D80, None, torch.float32)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), got, stock, reference):
        assert_within_2x_of_stock(name, value, stock_value, ref, torch.float32)
    assert seen and all((c["BLOCK_D"], c["BLOCK_D2"]) == (64, 16) for _, c in seen)
    assert all(not {"ROPE", "BLOCK_H", "BLOCK_H2"} & set(c) for name, c in seen if name != "fwd")


@pytest.mark.parametrize("tables", ["per_token", "restart"])
@pytest.mark.parametrize("split_halves,blocks", [(False, (64, 64, 16, 0)), (True, (64, 32, 16, 16))],
                         ids=["padded-halves", "split-halves"])
def test_rope_forward_varlen_in_either_layout(split_halves, blocks, tables, monkeypatch):
    """Packed sequences at D = 80 with RoPE tables per packed token or restarting per sequence
    ([S, D/2]), forward only: the forward kernel rotates with the halves of the option, o within
    the 2x rule of the float64 per-sequence reference."""
    from test_varlen_attention import make_varlen_inputs, reference_outputs

    monkeypatch.setattr(launch, "ROPE_SPLIT_HALVES", split_halves)
    seen = record_launch_constexprs(monkeypatch)
    spec = dict(VARLEN_D80, rope=tables)
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(spec, torch.float32)
    o = remat.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_seqlens_q=cu_q.to(DEVICE),
                        cu_seqlens_k=cu_k.to(DEVICE), causal=True, rope=tuple(t.to(DEVICE) for t in rope),
                        window=spec["window"], backend="triton").cpu()
    reference = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, None, torch.float64)[0]
    stock = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, None, torch.float32)[0]
    assert_within_2x_of_stock("o", o, stock, reference, torch.float32)
    assert_rope_forward_launch(seen, blocks)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_training_rope_with_large_logits_at_split_head_dims(head_dim, deterministic):
    """fp32 causal attention with RoPE at D = 80 / 96 (q/k as 64 + 16 / 64 + 32 column parts) and
    q, k ~ 3 N(0, 1) (logits of tens): the training path (q and k rotated once outside the kernels)
    within the 2x rule of stock fp32 for o, dq, dk, dv. The backward recomputes P against the
    forward's lse, so its QK^T must sum the column parts in the forward's order: at these logits a
    different order breaks the rule (as the forward/backward rotation-halves mismatch did)."""
    g = torch.Generator().manual_seed(head_dim)
    n = 32
    q, k = (3.0 * torch.randn(1, n, 1, head_dim, generator=g) for _ in range(2))
    v, dout = (torch.randn(1, n, 1, head_dim, generator=g) for _ in range(2))
    angles = 6.28 * torch.rand(n, head_dim // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()

    def stock(dtype):
        leaves = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = attention_reference(*leaves, causal=True, rope=(cos[None].to(dtype), sin[None].to(dtype)))
        out.backward(dout.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    leaves = [t.to(DEVICE, copy=True).requires_grad_() for t in (q, k, v)]
    with deterministic_mode(deterministic):
        o = remat.attention(*leaves, causal=True, rope=(cos.to(DEVICE), sin.to(DEVICE)), backend="triton")
        o.backward(dout.to(DEVICE))
    got = [o.detach().cpu()] + [t.grad.cpu() for t in leaves]
    for name, value, stock_value, reference in zip(("o", "dq", "dk", "dv"), got, stock(torch.float32),
                                                   stock(torch.float64)):
        assert_within_2x_of_stock(name, value, stock_value, reference, torch.float32)


def test_backward_launchers_refuse_rope_tables(monkeypatch):
    """attention_bwd and attention_varlen_bwd given cos and/or sin (tables the forward takes) raise
    ValueError saying q and k must come rotated, before any kernel is launched or compiled."""
    launched = []

    class NoKernel:
        def __getitem__(self, grid):
            launched.append(grid)
            raise AssertionError("a backward kernel was launched")

    monkeypatch.setattr(launch, "_launch", lambda *args, **kwargs: launched.append(args))
    monkeypatch.setattr(launch, "_attn_bwd_preprocess_kernel", NoKernel())
    monkeypatch.setattr(launch, "_attn_bwd_dq_postprocess_kernel", NoKernel())
    q, k = torch.randn(1, 5, 2, 16, device=DEVICE), torch.randn(1, 7, 1, 16, device=DEVICE)
    o, lse = torch.zeros_like(q), torch.zeros(1, 2, 5, device=DEVICE)
    cos = torch.ones(1, 7, 8, device=DEVICE)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    for tables in ((cos, cos), (cos, None), (None, cos)):
        for deterministic in (True, False):
            with pytest.raises(ValueError, match="already rotated"):
                launch.attention_bwd(q, q, k, k, o, lse, *tables, None, 0.25, 0.0, -1, 0, 0.0, deterministic)
            with pytest.raises(ValueError, match="already rotated"):
                launch.attention_varlen_bwd(q[0], q[0], k[0], k[0], o[0], lse[0], cu_q, cu_k, 3, 4,
                                            *(None if t is None else t[0] for t in tables), None, 0.25, 0.0, -1, 0,
                                            0.0, deterministic)
    assert launched == []


def padded_head_dim_parts(head_dim, rope, split_halves):
    """launch._head_dim_parts without the split: the padded tiles (BLOCK_D2 = BLOCK_H2 = 0)."""
    padded = max(16, 1 << (head_dim - 1).bit_length())
    return padded, max(16, 1 << (head_dim // 2 - 1).bit_length()) if rope else padded, 0, 0


@pytest.mark.parametrize("spec", [
    pytest.param(dict(b=1, n=17, m=19, hq=4, hkv=2, d=80, causal=True), id="d80-gqa2-causal"),
    pytest.param(dict(b=1, n=12, m=12, hq=2, hkv=1, d=96, rope="shared", dropout=0.2), id="d96-rope-dropout"),
    pytest.param(dict(b=1, n=17, m=33, hq=4, hkv=2, d=80, rope="per_batch", window=(6, 3), softcap=5.0),
                 id="d80-rope-gqa2-window-softcap"),
])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
def test_split_head_dim_matches_padded_tiles(spec, deterministic, monkeypatch):
    """The split tiles compute what the padded ones do (fp32: the same products, the dots' sums
    split in parts, so equal up to fp32 summation order): o, dq, dk, dv against a run with the
    padded tiles forced; the padded run launches BLOCK_D2 = 0 (BLOCK_D = 128), the split one
    BLOCK_D2 > 0, in every kernel (with RoPE and a backward the kernels get q and k rotated)."""
    seen = record_launch_constexprs(monkeypatch)
    split = run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    assert seen and all(c["BLOCK_D2"] > 0 for _, c in seen)
    seen.clear()
    monkeypatch.setattr(launch, "_head_dim_parts", padded_head_dim_parts)
    padded = run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    assert seen and all(c["BLOCK_D2"] == 0 and c["BLOCK_D"] == 128 for _, c in seen)
    for name, a, b in zip(("o", "dq", "dk", "dv"), split, padded):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)
