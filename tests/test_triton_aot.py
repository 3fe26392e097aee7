"""Every Triton kernel compiles ahead of time for sm_80 and sm_90, with no GPU present.

The interpreter (TRITON_INTERPRET=1) runs kernels as Python and lets through what the compiler
rejects (layouts, type promotion, unsupported ops, resource limits), so each kernel module in
kernels/ exposes `aot_specs()`, yielding (name, kernel, signature, constexprs, num_warps) in the
form `triton.compiler.ASTSource` takes, and this test compiles every spec with `triton.compile`
for a `GPUTarget`. The compile runs in one subprocess without TRITON_INTERPRET: with it set at
import time, `@triton.jit` makes interpreter objects that `triton.compile` cannot take. The
subprocess is this file run as a script; it prints one JSON object with a result per spec and arch.
"""

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS_DIR = REPO / "kernels"
ARCHS = (80, 90)


def kernel_module_names():
    return sorted(path.stem for path in KERNELS_DIR.glob("*.py") if path.stem != "__init__")


def load_kernel_module(stem):
    """remat.kernels.<stem> when it is importable and is this checkout's file, else the file."""
    path = KERNELS_DIR / f"{stem}.py"
    try:
        module = importlib.import_module(f"remat.kernels.{stem}")
        if Path(module.__file__).resolve() == path.resolve():
            return module
    except ModuleNotFoundError as error:
        if error.name not in ("remat", "remat.kernels", f"remat.kernels.{stem}"):
            raise
    spec = importlib.util.spec_from_file_location(f"_remat_aot_kernels_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_id(name, arch):
    return f"{name}-sm{arch}"


def compile_all(archs):
    """{case id: {"cubin": bytes, "ptx": chars, "ptx_target": str, "seconds": float} or
    {"error": traceback}}, for every spec of every kernel module and every arch."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for stem in kernel_module_names():
        try:
            specs = list(load_kernel_module(stem).aot_specs())
        except Exception:
            results[f"{stem}-import"] = {"error": traceback.format_exc()}
            continue
        for name, kernel, signature, constexprs, num_warps in specs:
            for arch in archs:
                start = time.perf_counter()
                try:
                    compiled = triton_compile(
                        ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                        target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": num_warps},
                    )
                    ptx = compiled.asm["ptx"]
                    target_line = next(
                        (line.split()[1] for line in ptx.splitlines()
                         if line.startswith(".target")), "")
                    results[case_id(name, arch)] = {
                        "cubin": len(compiled.asm["cubin"]),
                        "ptx": len(ptx),
                        "ptx_target": target_line,
                        "seconds": time.perf_counter() - start,
                    }
                except Exception:
                    results[case_id(name, arch)] = {"error": traceback.format_exc()}
    return results


def collect_case_ids():
    """Case ids for parametrization, listed in this process (interpreted or not); a module that
    fails to import or has no aot_specs becomes a failing case of its own."""
    ids = []
    for stem in kernel_module_names():
        try:
            names = [spec[0] for spec in load_kernel_module(stem).aot_specs()]
        except Exception:
            ids.append(f"{stem}-import")
            continue
        ids.extend(case_id(name, arch) for name in names for arch in ARCHS)
    return ids


@pytest.fixture(scope="module")
def aot_results(tmp_path_factory):
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A fresh cache, so every run really compiles instead of finding last run's binaries.
    environment["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    completed = subprocess.run(
        [sys.executable, __file__, *map(str, ARCHS)], cwd=REPO, env=environment,
        capture_output=True, text=True, timeout=1800,
    )
    assert completed.returncode == 0, (
        f"AOT compile subprocess failed ({completed.returncode}):\n{completed.stderr[-5000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", collect_case_ids())
def test_compiles_for_gpu_target(case, aot_results):
    assert case in aot_results, f"{case}: not compiled (the subprocess listed other specs)"
    result = aot_results[case]
    assert "error" not in result, f"{case}: compile failed:\n{result.get('error')}"
    arch = int(case.rsplit("-sm", 1)[1])
    assert result["cubin"] > 0, f"{case}: empty cubin"
    assert result["ptx"] > 0, f"{case}: empty PTX"
    # sm_90 builds target sm_90a (Hopper-specific instructions allowed).
    assert result["ptx_target"].startswith(f"sm_{arch}"), (
        f"{case}: PTX targets {result['ptx_target']!r}, expected sm_{arch}")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: triton.compile needs real JIT functions")
    print(json.dumps(compile_all([int(arch) for arch in sys.argv[1:]] or list(ARCHS))))
