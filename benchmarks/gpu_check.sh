#!/usr/bin/env bash
# `make gpu-check`: on a GPU machine with its own python3 and torch, no venv and no network.
# Builds the extension for sm_90 in place, runs the gpu-marked tests and a short benchmark, and
# writes logs and CSVs under $OUT (or gpu-out/): gpu.txt, build.log, tests.log, bench.log and one
# CSV per benchmark (at most 8 files come back from the device tool). Exits non-zero if the build
# or a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0

# Wheels carried from the build machine (`make gpu-wheels`: Liger-Kernel, the benchmarks' baseline),
# installed without network into a folder of their own.
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
"$PY" -c "import liger_kernel; from importlib.metadata import version; print('liger-kernel', version('liger-kernel'))" \
  >> "$OUT/gpu.txt" 2>&1 || echo "liger-kernel: not installed (make gpu-wheels here, carry .whl)" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"

echo "== build (sm_90)"
start=$(date +%s)
if ! "$PY" -m pip install --no-index --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -n 40 "$OUT/build.log"
  echo "build failed"
  exit 1
fi
echo "built in $(( $(date +%s) - start ))s"
"$PY" -m remat info | tee -a "$OUT/gpu.txt"

echo "== gpu tests"
# REMAT_ATTENTION_AUTOTUNE=0: one tile per Triton attention kernel, so the many feature
# specializations of the tests compile once each instead of once per candidate tile.
# Every gpu-marked test (they sit beside the CPU cases in each block's module), then the Triton
# test modules that run compiled wherever a GPU is present.
REMAT_ATTENTION_AUTOTUNE=0 timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests \
  2>&1 | tee "$OUT/tests.log" | tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
REMAT_ATTENTION_AUTOTUNE=0 timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_matmul.py \
  tests/test_triton_attention.py tests/test_triton_gemm_paths.py tests/test_attention_triton_paths.py \
  2>&1 | tee -a "$OUT/tests.log" | tail -n 10
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== benchmark"
timeout 240 "$PY" -m benchmarks.run --quick --no-plots --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -n 70
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
