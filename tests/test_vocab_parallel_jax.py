"""Vocab-parallel linear cross-entropy in JAX: ``shard_map`` over 2 and 4 host devices.

JAX fixes its device count when it initialises, and other tests in this pytest process have
imported it already, so the checks run in a subprocess (``vocab_parallel_jax_worker.py``)
started with ``--xla_force_host_platform_device_count=4``; it prints its results as JSON.
The worker compares every case (every option and reduction, fp32 and bf16, several chunks,
all-ignored batches, a device owning none of the targets; jit of the VJP through shard_map)
with the float64 spec under the shared harness rule.
"""
import pytest

from helpers import run_jax_worker


@pytest.mark.parametrize("part", ["4", "2"], ids=["4dev", "2dev"])
def test_vocab_parallel_jax_equals_spec(part):
    res = run_jax_worker("vocab_parallel_jax_worker.py", args=(part,))
    assert not res["failures"], "\n".join(res["failures"])
    # the case matrix really ran
    assert res["checked"] >= (25 if part == "4" else 15), res
    if part == "4":
        return
    assert res["count"] == 6.0, res   # global_token_count psum-ed over a "dp" axis
    # narrow labels counted as the loss reads them (see the worker)
    assert res["narrow_counts"] == [4.0, 4.0, 3.0], res
    assert res["concrete_labels_rel_err"] <= 1e-5, res  # closed-over global labels
    for msg in res["bad_concrete"]:  # ... and out-of-range ones an error, as documented
        assert "target out of range" in msg and "[0, 10)" in msg, res
