"""Vocab-parallel linear cross-entropy in JAX: ``shard_map`` over 2 and 4 host devices (4 where
the kernels are not interpreted, see ``PARTS``).

JAX fixes its device count when it initialises, and other tests in this pytest process have
imported it already, so the checks run in a subprocess (``vocab_parallel_jax_worker.py``)
started with ``--xla_force_host_platform_device_count=4``; it prints its results as JSON.
The worker compares every case (every option and reduction, fp32 and bf16, several chunks,
all-ignored batches, a device owning none of the targets; jit of the VJP through shard_map)
with the float64 spec under the shared harness rule.
"""
import pytest

from harness import interpreted
from helpers import run_jax_worker

# CI time: off a GPU the 2-device matrix alone (every option, all its variants); the GPU runs
# (benchmarks/gpu_tests.sh) and LOGITLESS_FULL_MATRIX=1 add the 4-device one (plain cases,
# N = 1, the chunked one), which took ~15 s on a 2-core CI machine
PARTS = ["2"] if interpreted() else ["4", "2"]


@pytest.mark.parametrize("part", PARTS, ids=[f"{p}dev" for p in PARTS])
def test_vocab_parallel_jax_equals_spec(part):
    res = run_jax_worker("vocab_parallel_jax_worker.py", args=(part,))
    assert not res["failures"], "\n".join(res["failures"])
    # the case matrix really ran
    assert res["checked"] >= (8 if part == "4" else 24), res
    if part == "4":
        return
    assert res["count"] == 6.0, res   # global_token_count psum-ed over a "dp" axis
    # narrow labels counted as the loss reads them (see the worker)
    assert res["narrow_counts"] == [4.0, 4.0, 3.0], res
    assert res["concrete_labels_rel_err"] <= 1e-5, res  # closed-over global labels
    for msg in res["bad_concrete"]:  # ... and out-of-range ones an error, as documented
        assert "target out of range" in msg and "[0, 10)" in msg, res


def test_docstring_says_where_to_take_the_gradient():
    """Under shard_map(check_vma=False) or pmap a gradient taken *inside* the mapped function
    comes out wrong (dW times the axis size: JAX transposes the psum without knowing the loss
    is replicated; a hand-written psum/pmax loss does the same). The worker checks the
    gradient taken outside; the docstring must tell users to take it there."""
    import logitless.jax as lj
    doc = " ".join(lj.linear_cross_entropy.__doc__.split())
    assert "check_vma=False" in doc and "jax.pmap" in doc, doc
    assert "take the gradient *outside* the mapped function" in doc, doc


def test_linear_jsd_says_it_has_no_vocab_parallel_path():
    """axis_name= is a keyword of linear_cross_entropy: linear_jsd said "unknown tuning keyword(s)
    ['axis_name'] for backend='xla'", as if another backend took it."""
    import jax.numpy as jnp

    import logitless.jax as lj
    x, w = jnp.ones((3, 4)), jnp.ones((5, 4))
    with pytest.raises(TypeError, match="unexpected keyword argument 'axis_name' "
                                        r"\(linear_jsd has no vocab-parallel path"):
        lj.linear_jsd(x, w, x, w, axis_name="tp")
