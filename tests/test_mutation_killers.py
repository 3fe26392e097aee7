"""Tests added for surviving mutants of `make mutate` (mutation/<block>.md names the mutant each one
kills). Test names start with the block (norm_, mlp_, attention_), which is how mutation/run.py
selects them for that block."""

import pytest

pytest.importorskip("triton")


def test_norm_triton_block_config_matches_its_documented_limits():
    """kernels/norm.py holds rows of up to 16384 (forward) / 8192 (backward) columns whole in one
    tile and tiles wider rows in 4096-column tiles, with 256 columns per warp from 1 to 16 warps
    (the ptxas-measured register budget of its comments; the interpreter ignores it, so no numerical
    test notices a shifted boundary)."""
    from remat.kernels import norm

    fwd, bwd = norm._MAX_SINGLE_TILE_COLS_FWD, norm._MAX_SINGLE_TILE_COLS_BWD
    assert (fwd, bwd, norm._TILED_BLOCK) == (16384, 8192, 4096)
    expected = {
        (1, fwd): (1, True, 1), (7, fwd): (8, True, 1), (256, fwd): (256, True, 1), (257, fwd): (512, True, 2),
        (512, fwd): (512, True, 2), (4096, fwd): (4096, True, 16), (8192, fwd): (8192, True, 16),
        (16384, fwd): (16384, True, 16), (16385, fwd): (4096, False, 16), (70000, fwd): (4096, False, 16),
        (8192, bwd): (8192, True, 16), (8193, bwd): (4096, False, 16),
    }
    for (cols, limit), config in expected.items():
        got = norm._block_config(cols, limit)
        assert got == config and all(type(a) is type(b) for a, b in zip(got, config)), (cols, limit, got)


def test_norm_triton_backward_partials_fill_one_wave_per_gpu(monkeypatch):
    """On a GPU the backward launches one wave: sm_count x (16 warps // num_warps) programs, at most
    one per row and at least one, an int (checked without a GPU, on a faked SM count)."""
    import torch

    from remat.kernels import norm

    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    cuda = torch.device("cuda")
    cases = {(10**6, 16): 132, (10**6, 4): 4 * 132, (10**6, 32): 132, (5, 1): 5, (0, 1): 1}
    for (rows, num_warps), programs in cases.items():
        got = norm._num_partials(rows, num_warps, cuda)
        assert got == programs and type(got) is int, (rows, num_warps, got)  # a grid size and a tensor dim
    assert norm._num_partials(10**6, 1, torch.device("cpu")) == norm._CPU_NUM_PARTIALS


def test_norm_default_eps_is_documented():
    """rms_norm's default eps is 1e-6 and layer_norm's 1e-5 (torch.nn.LayerNorm's), as documented;
    the float64-reference tests pass eps explicitly, so only this test pins the defaults."""
    import torch

    import remat

    x = 0.01 * torch.randn(4, 33, generator=torch.Generator().manual_seed(0))
    assert torch.equal(remat.rms_norm(x, backend="torch"), remat.rms_norm(x, None, 1e-6, backend="torch"))
    assert torch.equal(remat.layer_norm(x, backend="torch"), remat.layer_norm(x, None, None, 1e-5, backend="torch"))
    assert not torch.equal(remat.layer_norm(x, backend="torch"), remat.layer_norm(x, None, None, 1e-6, backend="torch"))
