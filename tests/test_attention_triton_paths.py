"""Paths of the Triton attention kernels that the shared attention tests do not single out: the
dropout stream read four keys per Philox call at any row length and tile shape.

Runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1 (tiny shapes), or on a CUDA GPU
without it.
"""

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA GPU; neither is here",
                allow_module_level=True)
pytest.importorskip("triton")

from remat.autograd.common import draw_rng_state  # noqa: E402
from remat.kernels.attention import tuning  # noqa: E402
from remat.reference import attention_dropout_keep  # noqa: E402

from helpers import mask_from_output  # noqa: E402

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
