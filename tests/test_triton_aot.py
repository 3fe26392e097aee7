"""Every Triton kernel compiles ahead of time for sm_80 and sm_90, with no GPU present.

The interpreter (TRITON_INTERPRET=1) runs kernels as Python and lets through what the compiler
rejects (layouts, type promotion, unsupported ops, resource limits), so each kernel module or
subpackage of remat.kernels (kernels/ in the checkout) exposes `aot_specs()`, yielding (name,
kernel, signature, constexprs, num_warps[, options]) in the form `triton.compiler.ASTSource`
takes (options: more compile options, e.g. num_stages), and this test compiles every spec with
`triton.compile` for a `GPUTarget`. The compile runs in one
subprocess without TRITON_INTERPRET: with it set at import time, `@triton.jit` makes interpreter
objects that `triton.compile` cannot take. The subprocess is this file run as a script; it
imports the kernels as remat.kernels like every other caller, and prints one JSON object with a
result per spec and arch.
"""

import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
PACKAGE = "remat.kernels"


def _failing_specs(message):
    """An aot_specs stand-in that raises `message`: its module becomes a failing case."""
    def aot_specs():
        raise RuntimeError(message)
    return aot_specs


def kernel_spec_sources():
    """[(label, aot_specs)], one entry per distinct `aot_specs` function: every public module or
    subpackage of remat.kernels (a name without a leading underscore) must expose one (a
    subpackage may re-export its submodule's), and any submodule, at any depth, that defines its
    own adds it. A module that fails to import, or a public one with no `aot_specs`, gets one
    that raises why, so it becomes a failing case; private helper modules (kernels/_common.py)
    and the submodules of a subpackage need none."""
    sources, seen = [], set()

    def add(label, function):
        if id(function) not in seen:
            sources.append((label, function))
            seen.add(id(function))

    def walk(package, required):
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
            name = f"{package.__name__}.{info.name}"
            label = name[len(PACKAGE) + 1:]
            try:
                module = importlib.import_module(name)
            except Exception:
                add(label, _failing_specs(f"{name} failed to import:\n{traceback.format_exc()}"))
                continue
            function = getattr(module, "aot_specs", None)
            if function is not None and (required or function.__module__ == name):
                add(label, function)
            elif required and not info.name.startswith("_"):
                add(label, _failing_specs(f"{name} has no aot_specs()"))
            if info.ispkg:
                walk(module, required=False)

    try:
        root = importlib.import_module(PACKAGE)
    except Exception:
        return [("kernels", _failing_specs(f"{PACKAGE} failed to import:\n"
                                           f"{traceback.format_exc()}"))]
    walk(root, required=True)
    return sources


def case_id(name, arch):
    return f"{name}-sm{arch}"


def _dot_precisions(ttir):
    """The distinct operand precisions of the tt.dot ops in a TTIR listing: the printed
    inputPrecision, or "ieee", the attribute's default, which the printer leaves out."""
    precisions = set()
    for line in ttir.splitlines():
        if "tt.dot " in line:
            found = re.search(r"inputPrecision = (\w+)", line)
            precisions.add(found.group(1) if found else "ieee")
    return sorted(precisions)


def _ieee_fp32_dot_accumulators(ttir):
    """The ops defining the accumulator operand of each IEEE fp32 tt.dot in a TTIR listing:
    "arith.select" (the fresh zero of the two-level summation in kernels/_common.py `_dot`),
    "arith.constant" (a dot from zero), anything else (a loop-carried block argument: a dot
    chained into its running sum, the whole K as one rounding chain)."""
    defined_by = {}
    for line in ttir.splitlines():
        found = re.match(r"\s*(%[\w.]+)(?::\d+)? = ([\w.]+)", line)
        if found:
            defined_by[found.group(1)] = found.group(2)
    kinds = set()
    for line in ttir.splitlines():
        if "tt.dot " in line and "inputPrecision" not in line and re.search(r"xf32> \*", line):
            # Operands may be results of a multi-result op (scf.if yielding several: %11#0).
            accumulator = re.search(r"tt\.dot %[\w.#]+, %[\w.#]+, (%[\w.#]+)", line).group(1)
            kinds.add(defined_by.get(accumulator, "block argument"))
    return sorted(kinds)


def compile_all(archs):
    """{case id: {"cubin": bytes, "ptx": chars, "ptx_target": str, "dot_precisions": [str],
    "ieee_fp32_dot_accumulators": [str], "fp32_fmas": int (fma.*.f32 instructions in the PTX),
    "fp32_arith_without_rounding_mode": int (mul/add/sub.f32 without .rn, which ptxas may still fuse
    into FMAs), "seconds": float} or {"error": traceback}}, for every spec of every kernel module and every
    arch."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for label, aot_specs in kernel_spec_sources():
        try:
            specs = list(aot_specs())
        except Exception:
            results[f"{label}-import"] = {"error": traceback.format_exc()}
            continue
        # A spec may add a sixth element: more compile options (num_stages).
        for name, kernel, signature, constexprs, num_warps, *options in specs:
            for arch in archs:
                start = time.perf_counter()
                try:
                    compiled = triton_compile(
                        ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                        target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": num_warps, **(options[0] if options else {})},
                    )
                    ptx = compiled.asm["ptx"]
                    target_line = next(
                        (line.split()[1] for line in ptx.splitlines()
                         if line.startswith(".target")), "")
                    results[case_id(name, arch)] = {
                        "cubin": len(compiled.asm["cubin"]),
                        "ptx": len(ptx),
                        "ptx_target": target_line,
                        "dot_precisions": _dot_precisions(compiled.asm["ttir"]),
                        "ieee_fp32_dot_accumulators": _ieee_fp32_dot_accumulators(compiled.asm["ttir"]),
                        "fp32_fmas": len(re.findall(r"\bfma\.\w+\.f32\b", ptx)),
                        "fp32_arith_without_rounding_mode": len(re.findall(r"\b(?:mul|add|sub)\.f32\b", ptx)),
                        "seconds": time.perf_counter() - start,
                    }
                except Exception:
                    results[case_id(name, arch)] = {"error": traceback.format_exc()}
    return results


def collect_case_ids():
    """Case ids for parametrization, listed in this process (interpreted or not); a module that
    fails to import or has no aot_specs becomes a failing case of its own."""
    ids = []
    for label, aot_specs in kernel_spec_sources():
        try:
            names = [spec[0] for spec in aot_specs()]
        except Exception:
            ids.append(f"{label}-import")
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


def fp32_dot_cases():
    """(case id, expected dot precision) for every fp32 spec of the GEMM kernels (kernels/matmul.py,
    fp32 x) and the attention kernels (kernels/attention, fp32 q): TF32=True (PyTorch's allow_tf32
    on) must compile every dot to TF32 tensor-core dots, TF32=False (PyTorch's default for fp32
    matmuls) to IEEE fp32 ones."""
    from remat.kernels import attention, matmul

    specs = [(spec, "x_ptr") for spec in matmul.aot_specs()] + [(spec, "q_ptr") for spec in attention.aot_specs()]
    return [pytest.param(case_id(name, arch), "tf32" if constexprs["TF32"] else "ieee", id=case_id(name, arch))
            for (name, _, signature, constexprs, *_), fp32_operand in specs
            if signature.get(fp32_operand) == "*fp32" for arch in ARCHS]


@pytest.mark.parametrize("case,precision", fp32_dot_cases())
def test_fp32_dots_follow_the_tf32_constexpr(case, precision, aot_results):
    result = aot_results[case]
    assert "error" not in result, f"{case}: compile failed:\n{result.get('error')}"
    assert result["dot_precisions"] == [precision], (
        f"{case}: tt.dot precisions {result['dot_precisions']}, expected [{precision!r}]")
    # IEEE fp32 dots sum each step from a fresh zero and add it to the running sum after
    # (kernels/_common.py `_dot`), never straight into a loop-carried accumulator.
    if precision == "ieee":
        assert result["ieee_fp32_dot_accumulators"], f"{case}: no IEEE fp32 tt.dot found in the TTIR listing"
        assert set(result["ieee_fp32_dot_accumulators"]) <= {"arith.select", "arith.constant"}, (
            f"{case}: IEEE fp32 dot accumulators defined by {result['ieee_fp32_dot_accumulators']}")


def test_attention_specs_cover_the_split_head_dims():
    """The attention specs compile the split head-dim variant (BLOCK_D2 > 0, kernels/attention/launch.py
    `_head_dim_parts`) of every main kernel at D = 80 and of the forward, dK/dV and dQ kernels at 96 and
    192; with the heavy features the v side split and, in the forward with RoPE, the default padded
    rotation halves (BLOCK_H2 = 0), at D = 80 and 96 (halves 64) and at 192 (128), packed and with the
    dK/dV head split too; the backward kernels with softcap and dropout and never RoPE (no BLOCK_H,
    BLOCK_H2, ROPE: q and k come rotated); the postprocess with padded columns; and the forward's split
    halves of launch.ROPE_SPLIT_HALVES ('-splithalves') at 80 (32 + 16) and 192 (64 + 32), the only
    split-halves specs."""
    from remat.kernels import attention

    constexprs_of = {name: constexprs for name, _, _, constexprs, *_ in attention.aot_specs()}
    tiles = {name: tuple(constexprs.get(block) for block in ("BLOCK_D", "BLOCK_H", "BLOCK_D2", "BLOCK_H2"))
             for name, constexprs in constexprs_of.items()}
    kinds = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "bwd_dkdv_atomic")
    assert all(tiles[f"attn_{kind}-bf16-d80"][2] == 16 for kind in kinds)
    assert tiles["attn_bwd_dq_postprocess-bf16-d80"] == (128, None, None, None)
    for head_dim, second in ((96, 32), (192, 64)):
        assert all(tiles[f"attn_{kind}-bf16-d{head_dim}"][2] == second for kind in ("fwd", "bwd_dkdv", "bwd_dq"))
    assert tiles["attn_fwd-bf16-d80-varlen"][2] == 16
    backward_kinds = ("bwd_dkdv", "bwd_dq", "bwd_dkdv_atomic")
    for head_dim, padded, kinds_of_dim in ((80, (64, 64, 16, 0), backward_kinds),
                                           (96, (64, 64, 32, 0), backward_kinds),
                                           (192, (128, 128, 64, 0), backward_kinds[:2])):
        assert tiles[f"attn_fwd-bf16-d{head_dim}-rope-softcap-dropout"] == padded
        assert all(tiles[f"attn_{kind}-bf16-d{head_dim}-softcap-dropout"] == (padded[0], None, padded[2], None)
                   for kind in kinds_of_dim)
    assert tiles["attn_fwd-bf16-d80-rope-softcap-dropout-varlen"] == (64, 64, 16, 0)
    for name in ("bwd_dkdv_atomic-bf16-d80-softcap-dropout-varlen", "bwd_dkdv_split4-bf16-d80-softcap-dropout",
                 "bwd_dkdv_atomic_split4-bf16-d80-softcap-dropout"):
        assert tiles[f"attn_{name}"] == (64, None, 16, None)
    split = {name: value for name, value in tiles.items() if name.endswith("-splithalves")}
    assert split == {"attn_fwd-bf16-d80-rope-softcap-dropout-splithalves": (64, 32, 16, 16),
                     "attn_fwd-bf16-d192-rope-softcap-dropout-splithalves": (128, 64, 64, 32)}
    assert not any(value[3] for name, value in tiles.items() if name not in split)
    assert not any("ROPE" in constexprs or "BLOCK_H" in constexprs
                   for name, constexprs in constexprs_of.items() if not name.startswith("attn_fwd"))
    assert all(constexprs["ROPE"] == ("-rope" in name)
               for name, constexprs in constexprs_of.items() if name.startswith("attn_fwd"))


def rope_rotate_cases():
    from remat.kernels import rope_rotate

    return [case_id(spec[0], arch) for spec in rope_rotate.aot_specs() for arch in ARCHS]


@pytest.mark.parametrize("case", rope_rotate_cases())
def test_rope_rotation_has_no_fma(case, aot_results):
    """The rope rotation (kernels/rope_rotate.py, launched with enable_fp_fusion=False) rounds each
    product on its own, as PyTorch's rotation does: its PTX holds no fp32 FMA, and every fp32
    mul/add/sub carries .rn (ptxas does not fuse those into FMAs). A control: the other kernels,
    compiled with fusion on, hold FMAs, so the count does find them."""
    result = aot_results[case]
    assert "error" not in result, f"{case}: compile failed:\n{result.get('error')}"
    assert result["fp32_fmas"] == 0, f"{case}: {result['fp32_fmas']} fp32 FMAs in the PTX"
    assert result["fp32_arith_without_rounding_mode"] == 0, (
        f"{case}: {result['fp32_arith_without_rounding_mode']} fp32 mul/add/sub without .rn, fusable by ptxas")
    controls = [value["fp32_fmas"] for name, value in aot_results.items()
                if not name.startswith("rope_rotate") and "error" not in value]
    assert controls and max(controls) > 0, "no fp32 FMA found in any other kernel's PTX"


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: triton.compile needs real JIT functions")
    print(json.dumps(compile_all([int(arch) for arch in sys.argv[1:]] or list(ARCHS))))
