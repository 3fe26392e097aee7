#!/usr/bin/env bash
# `make gpu-check`: on a GPU machine with its own python3 and torch, no venv and no network.
# Builds the extension for sm_90 in place, runs the gpu-marked tests, then the benchmarks in order of
# what the project lacks most (attention: its default on an H200 changed to cuDNN untimed, then
# layers, norm, MLP, cross-entropy), then the Triton test
# modules compiled; each phase gets what is left of a deadline (GPU_CHECK_SECONDS, default 540 s
# from the start) so the whole check ends inside one device call. Writes under $OUT (or gpu-out/): log.txt (everything, tests and tables included) and
# one CSV per benchmark (the device tool brings back at most 8 files). Exits non-zero if the build,
# a test or a benchmark failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
deadline=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-540} ))
status=0

# phase SECONDS NAME CMD...: runs CMD for at most SECONDS or what is left before the deadline,
# stopping it with SIGINT (pytest then prints its summary so far); logs the exit status.
phase() {
  local want=$1 name=$2; shift 2
  local left=$(( deadline - $(date +%s) ))
  local limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 15 ]; then
    echo "== $name: skipped, ${left}s left before the deadline" | tee -a "$LOG"
    status=1
    return
  fi
  echo "== $name (at most ${limit}s)" | tee -a "$LOG"
  local start=$(date +%s)
  timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

# Wheels carried from the build machine (`make gpu-wheels`: Liger-Kernel, the benchmarks' baseline),
# installed without network into a folder of their own.
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  "$PY" -c "import liger_kernel; from importlib.metadata import version; print('liger-kernel', version('liger-kernel'))" \
    || echo "liger-kernel: not installed (make gpu-wheels here, carry .whl)"
  git log -1 --format='commit %h %s' 2>/dev/null
} 2>&1 | tee -a "$LOG"

echo "== build (archs $TORCH_CUDA_ARCH_LIST)" | tee -a "$LOG"
start=$(date +%s)
if ! timeout 240 "$PY" -m pip install --no-index --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log" | tee -a "$LOG"
  echo "build failed" | tee -a "$LOG"
  exit 1
fi
rm -f "$OUT/build.log"
echo "built in $(( $(date +%s) - start ))s" | tee -a "$LOG"
"$PY" -m remat info 2>&1 | tee -a "$LOG"

# What runs can be narrowed for a rerun inside the same device budget (whitespace-separated,
# no globbing; set to "" to skip): GPU_CHECK_TESTS (pytest arguments; default every gpu-marked test),
# GPU_CHECK_BENCHES (NAME or NAME:SECONDS, the most one may take; default below),
# GPU_CHECK_TRITON_TESTS (1: the Triton test modules, compiled), GPU_CHECK_TESTS_SECONDS (default
# 220: the most the first tests may take).
set -f
# The defaults put first what no GPU has run yet (the first H200 session, 2026-11-30, ran the
# attention tests and the attention, MLP and cross-entropy benchmarks; ~800 gpu tests take longer
# than one call, and xdist hands them out in the order given), and of that first the PyTorch
# attention cores, the default attention on an H200 (cudnn since 2026-12-01, aten for the rest),
# after the few long-context checks (tiled attention incl. windows and packed rows, the offload's
# CUDA path, the estimator against max_memory_allocated; issue 27), which are quick.
read -ra tests <<< "${GPU_CHECK_TESTS--m gpu tests/test_attention_tiling.py tests/test_offload.py tests/test_estimate.py \
tests/test_attention_cudnn_core.py tests/test_attention_aten_core.py \
tests/test_rope_rotate.py tests/test_norm.py tests/test_mlp.py tests/test_ops.py tests/test_cross_entropy.py \
tests/test_device_launch.py tests/test_attention_tuning.py tests/test_varlen_attention.py tests/test_attention.py}"
read -ra benches <<< "${GPU_CHECK_BENCHES-attention:90 layers:150 norm:45 mlp:40 cross_entropy:40}"
set +f
# REMAT_ATTENTION_AUTOTUNE=0: one tile per Triton attention kernel, so the many feature
# specializations of the tests compile once each instead of once per candidate tile; -n 12
# because compiling Triton kernels is CPU-bound (16 cores); -v puts every test's outcome in the log.
pytest_args=(-p no:cacheprovider -n 12 -v --timeout 90 -rfE --tb=short)
if [ "${#tests[@]}" -gt 0 ]; then
  phase "${GPU_CHECK_TESTS_SECONDS:-220}" "tests: ${tests[*]}" env REMAT_ATTENTION_AUTOTUNE=0 "$PY" -m pytest \
    "${pytest_args[@]}" "${tests[@]}"
fi
for entry in "${benches[@]}"; do
  # NAME or NAME:SECONDS (without SECONDS: 110 s attention, 80 s layers, 40 s others).
  bench=${entry%%:*}
  case $bench in attention) want=110 ;; layers) want=80 ;; *) want=40 ;; esac
  [ "$entry" = "$bench" ] || want=${entry#*:}
  phase "$want" "benchmark $bench" "$PY" -m benchmarks.run --quick --no-plots --only "$bench" --out "$OUT"
done
if [ "${GPU_CHECK_TRITON_TESTS:-1}" = 1 ]; then
  phase 120 "Triton test modules, compiled" env REMAT_ATTENTION_AUTOTUNE=0 "$PY" -m pytest "${pytest_args[@]}" \
    tests/test_triton_matmul.py tests/test_triton_attention.py tests/test_triton_gemm_paths.py \
    tests/test_attention_triton_paths.py
fi
echo "== done, status $status" | tee -a "$LOG"
exit $status
