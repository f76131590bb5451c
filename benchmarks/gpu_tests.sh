#!/usr/bin/env bash
# The test suite on a CUDA machine, in groups with time limits, logs under ${OUT:-/tmp/gpu-tests}:
#   bash benchmarks/gpu_tests.sh [group ...]     (groups: lce jsd mlp bridge other all; default all)
# WORKERS=n runs each group on n pytest-xdist processes sharing the GPU (default 1; the GPU
# image has xdist): most of the time is compiling kernels on the host, which n cores share.
# On the device tool's machine carry .whl/ so that peers import (benchmarks/gpu_peers.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-tests}
mkdir -p "$OUT"
[ -d .whl ] && source benchmarks/gpu_peers.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
groups=${*:-all}
[ "$groups" = all ] && groups="lce jsd mlp bridge other"
# one seed for every group, printed so that a failure can be replayed (pytest -q hides the header)
export LOGITLESS_TEST_SEED=${LOGITLESS_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}
echo "LOGITLESS_TEST_SEED=$LOGITLESS_TEST_SEED"
status=0
for g in $groups; do
  case $g in
    lce) files="tests/test_linear_cross_entropy.py tests/test_triton_backend.py tests/test_triton_fast_math.py tests/test_parity.py tests/test_torch_edge_cases.py" ;;
    jsd) files="tests/test_linear_jsd.py tests/test_parity_jsd.py tests/test_linear_jsd_jax.py tests/test_mixed_gemm.py" ;;
    mlp) files="tests/test_tiled_mlp.py tests/test_swiglu.py tests/test_tiled_mlp_ddp.py" ;;
    bridge) files="tests/test_bridge.py tests/test_jax_api.py tests/test_torch_errors.py" ;;
    other) files="tests/test_jax_sharding.py tests/test_transformers_integration.py tests/test_readme.py tests/test_distributed_training.py tests/test_vocab_parallel_torch.py tests/test_vocab_parallel_jax.py tests/test_spec.py tests/test_tiling.py tests/test_imports.py" ;;
    *) echo "unknown group $g"; exit 2 ;;
  esac
  start=$(date +%s)
  par=""
  [ "${WORKERS:-1}" -gt 1 ] && par="-n $WORKERS"
  timeout "${LIMIT:-450}" $PY -m pytest -q -p no:cacheprovider $par $files > "$OUT/tests-$g.log" 2>&1
  rc=$?
  echo "$g: rc=$rc in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/tests-$g.log")"
  [ $rc -ne 0 ] && status=1
done
exit $status
