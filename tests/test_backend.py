"""Backend choice: argument > use_backend context > REMAT_BACKEND > default."""

import pytest
import torch

import remat
from remat import _extension, backend, ops


@pytest.fixture
def record_backend(monkeypatch):
    """Record which backend's ops the autograd Functions were given."""
    used = []
    real = ops.ops_for

    def spy(block, name):
        if block == "norm":
            used.append(name)
        return real(block, name)

    monkeypatch.setattr("remat.autograd.norm.ops_for", spy)
    return used


def test_default_on_cpu(record_backend, monkeypatch):
    monkeypatch.delenv("REMAT_BACKEND", raising=False)
    remat.rms_norm(torch.randn(2, 8), None)
    assert record_backend == ["cpp" if _extension.LOADED else "torch"]


def test_precedence(record_backend, monkeypatch):
    x = torch.randn(2, 8)
    monkeypatch.setenv("REMAT_BACKEND", "torch")
    remat.rms_norm(x)
    with remat.use_backend("cpp" if _extension.LOADED else "torch"):
        remat.rms_norm(x)
        with remat.use_backend("torch"):
            remat.rms_norm(x)
        remat.rms_norm(x, backend="torch")
    expected_ctx = "cpp" if _extension.LOADED else "torch"
    assert record_backend == ["torch", expected_ctx, "torch", "torch"]


def test_use_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match="use_backend"):
        with remat.use_backend("jax"):
            pass


def test_use_backend_restores_on_error(monkeypatch):
    """An exception leaving a use_backend block restores the request that held before it: the
    enclosing context's, or none at all."""
    monkeypatch.delenv("REMAT_BACKEND", raising=False)
    assert backend.requested_backend() is None
    with pytest.raises(KeyError):
        with remat.use_backend("torch"):
            assert backend.requested_backend() == "torch"
            raise KeyError
    assert backend.requested_backend() is None
    with remat.use_backend("cpp"):
        with pytest.raises(KeyError):
            with remat.use_backend("torch"):
                raise KeyError
        assert backend.requested_backend() == "cpp"
    assert backend.requested_backend() is None
    assert getattr(backend._state, "stack", []) == []


def test_default_choice_table(monkeypatch):
    """GPU tensors prefer the CUDA kernels (on a GPU they were built for: an sm_90 one is faked
    here), then Triton, then torch; CPU tensors the C++ kernels."""
    monkeypatch.setattr(backend, "device_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    expected = "cuda" if _extension.WITH_CUDA else ("triton" if backend.triton_available() else "torch")
    assert backend.default_backend(cuda) == expected
    assert backend.default_backend(torch.device("cpu")) == ("cpp" if _extension.LOADED else "torch")


def _extension_status(out):
    line = next(line for line in out.splitlines() if line.startswith("extension remat._C"))
    return line.removeprefix("extension remat._C").strip()


def test_info_reports(capsys, monkeypatch):
    remat.info()
    out = capsys.readouterr().out
    assert "extension remat._C" in out and "Triton" in out
    # Exactly "built" when the extension loaded, else "not built: <why>" ("not built" contains "built").
    expected = "built" if _extension.LOADED else f"not built: {_extension.LOAD_ERROR}"
    assert _extension_status(out) == expected
    d = remat.info.__globals__["info_dict"]()
    assert d["extension_built"] == _extension.LOADED
    assert d["default_backend"]["rms_norm"]["cpu"] == backend.default_backend(torch.device("cpu"))
    # CPU attention: the aten core for the dtypes PyTorch's flash kernel runs at full speed here.
    import remat.ops.attention as attention_ops

    real_check = attention_ops._onednn_has_native_gemm
    for native, dtypes in ((True, "float32, bfloat16, float16"), (False, "float32")):
        monkeypatch.setattr(attention_ops, "_onednn_has_native_gemm", lambda kind, native=native: native)
        entry = remat.info.__globals__["info_dict"]()["default_backend"]["attention"]["cpu"]
        assert entry == f"aten ({dtypes}) if it takes the call, else {backend.default_backend(torch.device('cpu'))}"
    monkeypatch.setattr(attention_ops, "_onednn_has_native_gemm", real_check)
    assert d["rope_rotation"]["cpu"] == ("cpp" if _extension.LOADED else "torch")
    assert f"rope rotation         cpu -> {d['rope_rotation']['cpu']}" in out
    # The other branch, whichever this installation has.
    monkeypatch.setattr(_extension, "LOADED", not _extension.LOADED)
    monkeypatch.setattr(_extension, "LOAD_ERROR", None if _extension.LOADED else "ImportError: test")
    remat.info()
    expected = "built" if _extension.LOADED else "not built: ImportError: test"
    assert _extension_status(capsys.readouterr().out) == expected


def test_python_m_remat_info():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "remat", "info"], capture_output=True, text=True, check=True)
    assert "default backend" in out.stdout


@pytest.mark.parametrize("archs,capability,runs", [
    ("8.0;9.0", (8, 0), True), ("8.0;9.0", (8, 6), True), ("8.0;9.0", (9, 0), True),
    ("8.0;9.0", (7, 5), False), ("8.0;9.0", (10, 0), False), ("8.0;9.0", (12, 0), False),
    ("8.0;9.0+PTX", (10, 0), True), ("8.0;9.0+PTX", (12, 0), True), ("8.0+PTX", (8, 9), True),
    ("9.0a", (9, 0), True), ("9.0a", (10, 0), False), ("9.0a+PTX", (10, 0), False), ("8.0 9.0", (9, 0), True),
    ("10.0f", (10, 3), True), ("10.0f", (12, 0), False), ("10.0f+PTX", (12, 0), False),
])
def test_arch_list_runs_on(archs, capability, runs):
    assert backend.arch_list_runs_on(archs, capability) is runs


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA build for 8.0;9.0 and a GPU of a chosen capability, without a GPU."""
    def install(capability, archs="8.0;9.0"):
        monkeypatch.setattr(_extension, "LOADED", True)
        monkeypatch.setattr(_extension, "WITH_CUDA", True)
        monkeypatch.setattr(_extension, "CUDA_ARCHS", archs)
        monkeypatch.setattr(backend, "device_capability", lambda index: capability)
        monkeypatch.delenv("REMAT_BACKEND", raising=False)
    return install


def test_default_skips_cuda_kernels_built_for_other_archs(fake_gpu):
    device = torch.device("cuda", 0)
    fake_gpu((9, 0))
    assert backend.default_backend(device) == "cuda"
    fake_gpu((12, 0))
    assert backend.default_backend(device) == ("triton" if backend.triton_available() else "torch")
    with pytest.raises(backend.BackendUnavailableError, match=r"archs '8.0;9.0'.*sm_120"):
        backend._resolve("cuda", device)
    fake_gpu((12, 0), archs="8.0;9.0+PTX")
    assert backend.default_backend(device) == "cuda"
    assert backend._resolve("cuda", device) == "cuda"


def test_named_archs_are_refused_with_a_reason(fake_gpu):
    """torch also takes names such as "Ampere" in TORCH_CUDA_ARCH_LIST; remat cannot compare them with
    a GPU, so its CUDA kernels are not chosen, and asking for them says why."""
    with pytest.raises(ValueError, match="major.minor"):
        backend.parse_arch_list("Ampere")
    fake_gpu((9, 0), archs="Ampere;Hopper")
    device = torch.device("cuda", 0)
    assert backend.default_backend(device) != "cuda"
    with pytest.raises(backend.BackendUnavailableError, match="cannot be compared"):
        backend._resolve("cuda", device)
