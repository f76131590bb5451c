#!/usr/bin/env bash
# GPU check of fused linear JSD, from the repository root on a CUDA machine:
#   bash benchmarks/linear_jsd_gpu_check.sh tests   # JSD suites on CUDA (harness, parity, GPU-only)
#   bash benchmarks/linear_jsd_gpu_check.sh smoke   # tests + every benchmark candidate, small shape
#   bash benchmarks/linear_jsd_gpu_check.sh bench   # acceptance shape -> results/<gpu>-linear-jsd.json
#   bash benchmarks/linear_jsd_gpu_check.sh probe   # sweep the Triton row-kernel settings
# Liger-Kernel is installed from .whl/ into .peers/ when present and not importable.
# PY=python3.12 picks the interpreter; extra arguments go to benchmarks/linear_jsd.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import liger_kernel" 2>/dev/null && ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target .peers .whl/liger_kernel-*.whl
fi
[ -d .peers ] && export PYTHONPATH="$PYTHONPATH:$PWD/.peers"
what=${1:-smoke}
shift || true
run_tests() {
  $PY -m pytest -q -x -p no:cacheprovider tests/test_linear_jsd.py tests/test_parity_jsd.py \
    tests/test_linear_jsd_jax.py tests/test_mixed_gemm.py
}
case "$what" in
  tests) run_tests ;;
  smoke) run_tests && $PY benchmarks/linear_jsd.py --smoke "$@" ;;
  bench) $PY benchmarks/linear_jsd.py --shapes target "$@" ;;
  probe) $PY benchmarks/linear_jsd.py --probe --shapes target --reps 5 "$@" ;;
  *) echo "usage: $0 tests|smoke|bench|probe [benchmark args]"; exit 2 ;;
esac
