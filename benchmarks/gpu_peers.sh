#!/usr/bin/env bash
# Source on the GPU machine (no package index) to make the peers importable for benchmarks:
#   source benchmarks/gpu_peers.sh      (with the git-ignored .whl/ folder carried along)
# .whl/ holds liger-kernel, cut-cross-entropy, tokamax (+ its pure-Python deps) and jax-cce as
# wheels, fetched once elsewhere (benchmarks/results/README.md has the command).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -vi warn
# tokamax imports xprof's kernel-stats tool at import time; benchmarking needs none of it.
mkdir -p /tmp/stub/xprof/cli
touch /tmp/stub/xprof/__init__.py /tmp/stub/xprof/cli/__init__.py
printf 'def get_kernel_stats_tool(*args, **kwargs):\n    raise NotImplementedError("stub")\n' \
    > /tmp/stub/xprof/cli/tools.py
export PYTHONPATH=/tmp/site:/tmp/stub:$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
