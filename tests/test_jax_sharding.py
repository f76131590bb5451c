"""The JAX ops on sharded data: ``shard_map`` data parallelism with ``check_vma=True`` (its
default; the gradient of a replicated weight is the sum of the shards'), a dp × tp mesh with
the vocab-parallel loss, ``backend="pallas"`` under ``shard_map`` (a clear error off a GPU, a
Triton lowering for one), and Explicit mesh axes (``jax.sharding.set_mesh``).

JAX fixes its device count when it initialises, and other tests in this pytest process have
imported it already, so every check runs in one subprocess (``jax_sharding_worker.py``) with
4 host devices; it compares each sharded run with the same op on the whole arrays and prints
its results as JSON.
"""
import pytest

import harness
from helpers import run_jax_worker

pytest.importorskip("jax")
CHECKS = {"dp_lce_xla_sum", "dp_lce_xla_none_lse", "dp_lce_xla_grad_inside", "dp_jsd_xla_sum",
          "dp_tiled_mlp_swiglu", "dp_tiled_mlp_any_fn",
          "dp_x_tp_vocab_parallel", "dp_pallas_interpret_clear_error",
          "dp_pallas_lowers_for_cuda", "explicit_mesh_set", "explicit_mesh_not_set"}


def test_sharded_runs_equal_the_unsharded_op():
    res = run_jax_worker("jax_sharding_worker.py")
    assert set(res["results"]) == CHECKS, sorted(res["results"])  # every check really ran
    failures = {k: v for k, v in res["results"].items() if v is not None}
    assert not failures, "\n\n".join(f"{k}: {v}" for k, v in sorted(failures.items()))


def _jax_gpu():
    try:
        import jax
        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # noqa: BLE001 - no backend at all
        return False


@pytest.mark.gpu
def test_pallas_inside_shard_map_on_a_gpu_equals_the_unsharded_op():
    """The Pallas kernels (CE, JSD, the tiled SwiGLU) run inside shard_map with check_vma on
    a one-GPU mesh and give the unsharded op's loss and gradients (the CPU worker can only
    lower them, and JAX 0.11 not even that without a GPU)."""
    if not _jax_gpu():  # asked here, not at collection: JAX's backend starts on first use
        pytest.skip("needs a CUDA GPU")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import logitless.jax as lj
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    k = jax.random.split(jax.random.PRNGKey(harness.SEED), 6)
    n, h, v = 256, 128, 1031
    x = jax.random.normal(k[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(k[1], (v, h)) * 0.05).astype(jnp.bfloat16)
    xt = jax.random.normal(k[2], (n, h), jnp.bfloat16)
    wt = (jax.random.normal(k[3], (v, h)) * 0.05).astype(jnp.bfloat16)
    y = jax.random.randint(k[4], (n,), 0, v)
    mlp = lj.SwiGLUMLP(h, 384, backend="pallas")
    params = mlp.init(k[5], jnp.bfloat16)
    ops = {
        "lce": (lambda a, b: lj.linear_cross_entropy(a, b, y, reduction="sum",
                                                     backend="pallas"), (x, w)),
        "jsd": (lambda a, b: lj.linear_jsd(a, b, xt, wt, y, reduction="sum",
                                           backend="pallas"), (x, w)),
        "tiled_mlp": (lambda p, a: jnp.sum(lj.tiled_mlp(mlp, p, a[None], num_shards=4)
                                           .astype(jnp.float32) ** 2), (params, x)),
    }
    for name, (f, args) in ops.items():
        specs = (P(), P("dp")) if name == "tiled_mlp" else (P("dp"), P())
        plain = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
        mapped = jax.shard_map(lambda a, b: jax.lax.psum(f(a, b), "dp"), mesh=mesh,
                               in_specs=specs, out_specs=P())
        sharded = jax.jit(jax.value_and_grad(mapped, argnums=(0, 1)))(*args)
        for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)):
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            assert np.all(np.isfinite(got)), name
            err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
            assert err <= 1e-6, (name, err)
