"""Paths of the Triton attention kernels that the shared attention tests do not single out: the
dropout stream read four keys per Philox call at any row length and tile shape; the dK/dV kernel
with each kv head's query heads split over several programs (GQA, MQA, rope, window, softcap,
dropout, packed sequences, both backward modes) against the unsplit kernel and the float64
reference, and the launcher's choice of the split; TF32 dots following PyTorch's fp32 matmul
setting; head dims that are not powers of two split into power-of-two column parts (with RoPE
the rotation halves too) against the float64 reference and the padded tiles.

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
    constexprs with the chosen configuration's (the backward kernels' rotation halves) over them."""
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
    BLOCK_D, BLOCK_D2 and each rotation half of D/2 split by the same rule (40 -> 32 + 16, 48 -> 32 + 16,
    96 -> 64 + 32, 72 -> 64 + 16) or padded where that is no narrower (20 -> 32, 24 -> 32, 56 -> 64, 32 -> 32).
    The split's tuning class is that of the held columns' next power of two (80, 96: the 128 class; 192:
    the 256 class), and with RoPE the halves' parts never hold more columns than that class."""
    parts = launch._head_dim_parts
    assert [parts(d, False) for d in (80, 96, 192, 40)] == [(64, 64, 16, 0), (64, 64, 32, 0), (128, 128, 64, 0),
                                                           (32, 32, 16, 0)]
    assert [parts(d, False) for d in (8, 24, 64, 112, 128, 200)] == [
        (16, 16, 0, 0), (32, 32, 0, 0), (64, 64, 0, 0), (128, 128, 0, 0), (128, 128, 0, 0), (256, 256, 0, 0)]
    assert [parts(d, True) for d in (80, 96, 192, 144, 40, 48, 64, 112, 2, 256)] == [
        (64, 32, 16, 16), (64, 32, 32, 16), (128, 64, 64, 32), (128, 64, 16, 16), (32, 32, 16, 0), (32, 32, 16, 0),
        (64, 32, 0, 0), (128, 64, 0, 0), (16, 16, 0, 0), (256, 128, 0, 0)]
    for d in range(2, 257, 2):
        block_d, block_h, block_d2, block_h2 = parts(d, True)
        padded_half = max(16, 1 << (d // 2 - 1).bit_length())
        assert block_h + block_h2 >= d // 2 and block_h + block_h2 <= padded_half
        assert block_h2 == 0 or (block_h2 >= 16 and block_h + block_h2 < padded_half and block_h < d // 2)
        assert 2 * (block_h + block_h2) <= max(64, 1 << (block_d + block_d2 - 1).bit_length())
    for d, padded in ((80, 128), (96, 128), (192, 256)):
        block_d, _, block_d2, _ = parts(d, False)
        for name in ("fwd", "dq", "dkdv"):
            flags = dict(ROPE=False, DROPOUT=False)
            assert (tuning._configs_for(name, dict(flags, BLOCK_D=block_d, BLOCK_D2=block_d2), torch.bfloat16)
                    is tuning._configs_for(name, dict(flags, BLOCK_D=padded, BLOCK_D2=0), torch.bfloat16))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
@pytest.mark.parametrize("spec,blocks", SPLIT_HEAD_DIM_CASES)
def test_split_head_dim_within_reference(spec, blocks, deterministic, monkeypatch):
    """Forward and backward at split head dims within the 2x rule of the float64 reference
    (run_and_check, fp32), and every forward, dK/dV and dQ launch gets the split tiles."""
    seen = record_launch_constexprs(monkeypatch)
    run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    assert sorted(name for name, _ in seen) == (["dkdv", "dq", "fwd"] if deterministic else ["dkdv", "fwd"])
    assert all((c["BLOCK_D"], c["BLOCK_H"], c["BLOCK_D2"], c["BLOCK_H2"]) == (blocks[0], blocks[0], blocks[1], 0)
               for _, c in seen)


def test_split_head_dim_bf16_within_reference(monkeypatch):
    """bf16 at D = 96 (64 + 32), GQA, both backward modes: the 2x rule against float64."""
    seen = record_launch_constexprs(monkeypatch)
    spec = dict(b=1, n=18, m=18, hq=4, hkv=2, d=96, causal=True)
    for deterministic in (True, False):
        run_and_check(spec, torch.bfloat16, "triton", deterministic=deterministic, device=DEVICE)
    assert seen and all(c["BLOCK_D2"] == 32 for _, c in seen)


def favour_split_halves(monkeypatch):
    """Install a timing tuner whose fake clock makes every candidate with split rotation halves
    (BLOCK_H2 > 0) faster than every other (interpreter: no shared memory to check); returns it."""
    def time(run, reset):
        return 1.0 if run.args[0].kwargs.get("BLOCK_H2", 0) > 0 else 2.0

    limit = dict(shared_memory_limit=lambda index: 0) if INTERPRETED else {}
    tuner = tuning.Tuner(True, capturing=lambda: False, time_candidate=time, **limit)
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    return tuner


def backward_default(blocks):
    """The backward kernels' default (BLOCK_D, BLOCK_H, BLOCK_D2, BLOCK_H2) for the forward's
    `blocks`: split rotation halves padded (a split's first part is half the padded half)."""
    block_d, block_h, block_d2, block_h2 = blocks
    return (block_d, 2 * block_h, block_d2, 0) if block_h2 else blocks


def assert_rope_tiles(seen, blocks):
    """The forward launched `blocks`, every dK/dV and dQ launch `backward_default(blocks)`."""
    assert seen
    for name, c in seen:
        expected = blocks if name == "fwd" else backward_default(blocks)
        assert (c["BLOCK_D"], c["BLOCK_H"], c["BLOCK_D2"], c["BLOCK_H2"]) == expected, name


# RoPE at split head dims: name: spec, the expected (BLOCK_D, BLOCK_H, BLOCK_D2, BLOCK_H2) of the
# forward launch (the backward kernels: the same with padded halves, `backward_default`). D = 40: v
# side 32 + 16, halves of 20 padded to 32 (16 + 16 is no narrower); 80: halves of 40 as 32 + 16;
# 96: 48 as 32 + 16; 192: 96 as 64 + 32.
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


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
@pytest.mark.parametrize("spec,blocks", ROPE_SPLIT_CASES)
def test_rope_splits_the_rotation_halves(spec, blocks, deterministic, monkeypatch):
    """With RoPE, v, o, dout, dv run as BLOCK_D + BLOCK_D2 columns and q, k as two rotation halves of
    BLOCK_H + BLOCK_H2 columns each in the forward (four tiles, the rotation per part), the backward
    kernels by default with padded halves: o, dq, dk, dv within the 2x rule of float64 (fp32),
    every launch with the expected tiles. Then the tuner choosing the split halves for the backward
    too (four tiles of q, k, dq, dk, the transposed rotation per part): again within the rule."""
    seen = record_launch_constexprs(monkeypatch)
    run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    assert sorted(name for name, _ in seen) == (["dkdv", "dq", "fwd"] if deterministic else ["dkdv", "fwd"])
    assert_rope_tiles(seen, blocks)
    if blocks[3]:
        seen.clear()
        favour_split_halves(monkeypatch)
        run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
        assert seen and all((c["BLOCK_D"], c["BLOCK_H"], c["BLOCK_D2"], c["BLOCK_H2"]) == blocks for _, c in seen)


def test_rope_split_halves_bf16_within_reference(monkeypatch):
    """bf16 at D = 80 with RoPE (forward halves 32 + 16, backward 64 by default), GQA, causal,
    both backward modes: the rotated parts rounded to bf16 before the dots, dq and dk rounded once
    after the transposed rotation, within the 2x rule of float64; again with the tuner choosing
    the split halves for the backward (fake timing), and its cached choices per key hold them."""
    seen = record_launch_constexprs(monkeypatch)
    spec = dict(b=1, n=17, m=17, hq=4, hkv=2, d=80, causal=True, rope="per_batch")
    for deterministic in (True, False):
        run_and_check(spec, torch.bfloat16, "triton", deterministic=deterministic, device=DEVICE)
    assert_rope_tiles(seen, (64, 32, 16, 16))
    seen.clear()
    tuner = favour_split_halves(monkeypatch)
    for deterministic in (True, False):
        run_and_check(spec, torch.bfloat16, "triton", deterministic=deterministic, device=DEVICE)
    assert seen and all((c["BLOCK_H"], c["BLOCK_H2"]) == (32, 16) for _, c in seen)
    backward = {key[0]: config for key, config in tuner.choices.items() if key[0] != "fwd"}
    assert sorted(backward) == ["dkdv", "dkdv_atomic", "dq"]
    assert all((c.kwargs["BLOCK_H"], c.kwargs["BLOCK_H2"]) == (32, 16) for c in backward.values())


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
def test_split_head_dim_varlen(deterministic, monkeypatch):
    """Packed sequences at D = 80 (v side 64 + 16, RoPE halves 32 + 16), GQA, a sequence without
    queries: within the 2x rule of the float64 per-sequence reference, launched with the split
    tiles."""
    from test_varlen_attention import make_varlen_inputs, reference_outputs, run_varlen

    spec = dict(lens_q=[9, 0, 17], lens_k=[9, 3, 19], hq=4, hkv=2, d=80, causal=True, window=(7, None),
                rope="per_token")
    seen = record_launch_constexprs(monkeypatch)
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(spec, torch.float32)
    with contextlib.nullcontext() if deterministic else deterministic_mode(False):
        got = run_varlen(spec, q, k, v, dout, cu_q, cu_k, rope, "triton", device=DEVICE, deterministic=deterministic)
    reference = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, None, torch.float64)
    stock = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, None, torch.float32)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), got, stock, reference):
        assert_within_2x_of_stock(name, value, stock_value, ref, torch.float32)
    assert_rope_tiles(seen, (64, 32, 16, 16))


def padded_head_dim_parts(head_dim, rope):
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
    padded tiles forced; the padded run launches BLOCK_D2 = BLOCK_H2 = 0, the split one BLOCK_D2 > 0
    and, with RoPE, BLOCK_H2 > 0 (the rotation halves' parts; the backward's split halves chosen by
    a tuner that times them faster)."""
    rope = "rope" in spec
    seen = record_launch_constexprs(monkeypatch)
    favour_split_halves(monkeypatch)
    split = run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    assert seen and all(c["BLOCK_D2"] > 0 and (c["BLOCK_H2"] > 0) == rope for _, c in seen)
    seen.clear()
    monkeypatch.setattr(launch, "_head_dim_parts", padded_head_dim_parts)
    padded = run_and_check(spec, torch.float32, "triton", deterministic=deterministic, device=DEVICE)
    assert seen and all(c["BLOCK_D2"] == 0 and c["BLOCK_H2"] == 0 and c["BLOCK_D"] == 128 for _, c in seen)
    assert all(c["BLOCK_H"] == (64 if rope else 128) for _, c in seen)
    for name, a, b in zip(("o", "dq", "dk", "dv"), split, padded):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)
