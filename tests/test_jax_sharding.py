"""The JAX ops on sharded data: ``shard_map`` data parallelism with ``check_vma=True`` (its
default; the gradient of a replicated weight is the sum of the shards'), a dp × tp mesh with
the vocab-parallel loss, ``backend="pallas"`` under ``shard_map`` (a clear error off a GPU, a
Triton lowering for one), and Explicit mesh axes (``jax.sharding.set_mesh``).

JAX fixes its device count when it initialises, and other tests in this pytest process have
imported it already, so every check runs in one subprocess (``jax_sharding_worker.py``) with
4 host devices; it compares each sharded run with the same op on the whole arrays and prints
its results as JSON.
"""
import json
import os
import subprocess
import sys

import pytest

import harness

pytest.importorskip("jax")
HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = {"dp_lce_xla_sum", "dp_lce_xla_none_lse", "dp_lce_xla_grad_inside", "dp_jsd_xla_sum",
          "dp_tiled_mlp_swiglu", "dp_tiled_mlp_any_fn",
          "dp_x_tp_vocab_parallel", "dp_pallas_interpret_clear_error",
          "dp_pallas_lowers_for_cuda", "explicit_mesh_set", "explicit_mesh_not_set"}


def test_sharded_runs_equal_the_unsharded_op():
    env = dict(os.environ, LOGITLESS_TEST_SEED=str(harness.SEED),
               XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "jax_sharding_worker.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 4, res
    assert set(res["results"]) == CHECKS, sorted(res["results"])  # every check really ran
    failures = {k: v for k, v in res["results"].items() if v is not None}
    assert not failures, "\n\n".join(f"{k}: {v}" for k, v in sorted(failures.items()))
