"""Builds remat and its extension remat._C.

The CUDA toolkit is found from CUDA_HOME / CUDA_PATH or by locating a real toolkit root (one that
holds bin/nvcc, include/cuda_runtime.h and lib64/libcudart.so), never by asking whether a GPU is
present: build machines have none. With a toolkit the extension holds the CUDA kernels for
TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX": sm_80 and sm_90 machine code, and sm_90 PTX that the
driver compiles for newer GPUs) and the C++ CPU kernels; without one, or with
REMAT_SKIP_CUDA_BUILD=1, it holds the C++ CPU kernels only.
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# Machine code for Ampere and Hopper, and Hopper PTX that the driver compiles for newer GPUs
# (Blackwell sm_100 / sm_120), so no GPU since sm_80 lacks a kernel image.
DEFAULT_ARCHS = "8.0;9.0+PTX"


def _is_toolkit_root(path):
    return bool(path) and all(
        os.path.exists(os.path.join(path, part))
        for part in ("bin/nvcc", "include/cuda_runtime.h")
    ) and any(os.path.exists(os.path.join(path, lib, "libcudart.so")) for lib in ("lib64", "lib"))


def find_cuda_root():
    """The CUDA toolkit root, or None. An nvcc on PATH may be a wrapper script (as on our build
    machines), so its own folder is checked and then the usual install folders."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        if os.path.getsize(nvcc) < 4096:
            with open(nvcc, errors="replace") as script:
                for word in script.read().split():
                    if word.endswith("/bin/nvcc"):
                        candidates.append(os.path.dirname(os.path.dirname(word)))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for path in candidates:
        if _is_toolkit_root(path):
            return os.path.realpath(path)
    return None


def build_jobs():
    """Parallel compile jobs: one per core, but at most one per 3 GiB of memory, since a
    translation unit that includes the torch headers takes 1-2 GiB."""
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8
    return max(1, min(os.cpu_count() or 1, int(mem_gib // 3)))


def write_build_info(with_cuda, archs, cuda_root):
    path = os.path.join(ROOT, "python", "remat", "_build_info.py")
    with open(path, "w") as out:
        out.write('"""Written by setup.py at build time."""\n\n')
        out.write(f"WITH_CUDA = {with_cuda!r}\n")
        out.write(f"CUDA_ARCHS = {archs!r}\n")
        out.write(f"CUDA_ROOT = {cuda_root!r}\n")


def extension_modules():
    skip_cuda = os.environ.get("REMAT_SKIP_CUDA_BUILD", "0") == "1"
    cuda_root = None if skip_cuda else find_cuda_root()
    if cuda_root:
        # torch.utils.cpp_extension reads CUDA_HOME when it is imported; set it first.
        os.environ["CUDA_HOME"] = cuda_root
    os.environ.setdefault("MAX_JOBS", str(build_jobs()))
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpp_sources = ["csrc/ops.cpp", "csrc/norm/norm_cpu.cpp", "csrc/mlp/act_cpu.cpp",
                   "csrc/attention/attention_cpu.cpp", "csrc/dropout/dropout_cpu.cpp",
                   "csrc/cross_entropy/cross_entropy_cpu.cpp", "csrc/rope/rope_cpu.cpp"]
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if cuda_root:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        print(f"remat: building CUDA kernels with {cuda_root} for archs {archs}", file=sys.stderr)
        ext = CUDAExtension(
            "remat._C",
            sources=cpp_sources
            + ["csrc/norm/norm_cuda.cpp", "csrc/norm/norm.cu", "csrc/mlp/act_cuda.cpp", "csrc/mlp/act.cu",
               "csrc/attention/attention_cuda.cpp", "csrc/attention/attention.cu", "csrc/dropout/dropout_cuda.cpp",
               "csrc/dropout/dropout.cu", "csrc/cross_entropy/cross_entropy_cuda.cpp",
               "csrc/cross_entropy/cross_entropy.cu"],
            include_dirs=include_dirs,
            define_macros=[("REMAT_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"],
            },
            extra_link_args=["-fopenmp"],
        )
        write_build_info(True, archs, cuda_root)
    else:
        why = "REMAT_SKIP_CUDA_BUILD=1" if skip_cuda else "no CUDA toolkit found"
        print(f"remat: {why}; building the C++ CPU kernels only", file=sys.stderr)
        ext = CppExtension(
            "remat._C",
            sources=cpp_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
        write_build_info(False, "", None)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_modules()

setup(
    name="remat",
    version="0.1.0",
    description="Fused transformer kernels that save only block inputs and recompute in backward",
    # Every package under python/remat, and kernels/ (with its subpackages) as remat.kernels.
    packages=find_packages("python") + ["remat.kernels"] + [f"remat.kernels.{p}" for p in find_packages("kernels")],
    package_dir={"remat": "python/remat", "remat.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
)
