"""Worker of tests/test_jax_sharding.py, run as a subprocess: XLA_FLAGS must give JAX 4 host
devices before it initialises, which the pytest process (JAX already imported) cannot.

Each check runs one op on sharded data and compares it with the same op on the whole,
unsharded arrays (float32, relative error of the loss and of every gradient):

* ``shard_map`` data parallelism with its default ``check_vma=True``: the weight replicated,
  tokens split over "dp", the loss ``psum``-ed, gradients taken outside (dW must be the sum
  of the shards' dW) or inside the mapped function; a dp × tp mesh with the vocab-parallel
  loss;
* ``backend="pallas"`` there: off a GPU a clear ``NotImplementedError``; lowered for CUDA
  (interpret=False, no GPU needed) the kernels lower through Triton;
* Explicit mesh axes (``jax.sharding.set_mesh``, and a jit of Explicit-sharded arrays
  without a mesh set).

Prints one JSON line: {check name: error string or null}; exit status 0 either way.
"""
import json
import os
import sys
import time
import traceback

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the tests helpers, then the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import harness  # noqa: E402
import logitless.jax as lj  # noqa: E402

TOL = 1e-5  # float32: the shards' partial sums against one sum
N, H, V = 32, 8, 37
RESULTS = {}
SECONDS = {}


def check(name):
    def deco(fn):
        t0 = time.perf_counter()
        try:
            fn()
            RESULTS[name] = None
        except Exception as e:  # noqa: BLE001 - reported, the test asserts on it
            RESULTS[name] = f"{type(e).__name__}: {str(e)[:400]}\n" + \
                "".join(traceback.format_exc(limit=-3))[-800:]
        SECONDS[name] = round(time.perf_counter() - t0, 2)
        return fn
    return deco


def rel(a, r):
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    assert np.all(np.isfinite(a)), "non-finite result"
    return np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30)


def assert_close(got, want, what):
    for i, (a, r) in enumerate(zip(jax.tree_util.tree_leaves(got),
                                   jax.tree_util.tree_leaves(want))):
        e = rel(a, r)
        assert e <= TOL, f"{what}: leaf {i} rel err {e:.2e} > {TOL}"
    assert len(jax.tree_util.tree_leaves(got)) == len(jax.tree_util.tree_leaves(want)), what


rng = np.random.default_rng([harness.SEED, 77])
f32 = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
X, XT = f32(N, H), f32(N, H)
W, WT, B = f32(V, H, scale=0.5), f32(V, H, scale=0.5), f32(V, scale=0.3)
y_np = rng.integers(0, V, N)
y_np[::5] = -100
Y = jnp.asarray(y_np, jnp.int32)
devices = np.array(jax.devices()[:4])
DP = Mesh(devices, ("dp",), axis_types=(AxisType.Auto,))
shard_map = jax.shard_map


def dp_value_and_grad(local_loss, args, specs, argnums, mesh=DP, dp="dp"):
    """value_and_grad of psum over ``dp`` of ``local_loss`` under shard_map (check_vma default)."""
    mapped = shard_map(lambda *a: lax.psum(local_loss(*a), dp), mesh=mesh, in_specs=specs,
                       out_specs=P())
    return jax.jit(jax.value_and_grad(mapped, argnums=argnums))(*args)


def compare_dp(local_loss, args, specs, argnums, what):
    got = dp_value_and_grad(local_loss, args, specs, argnums)
    want = jax.jit(jax.value_and_grad(local_loss, argnums=argnums))(*args)
    assert_close(got, want, what)


LCE = dict(linear_bias=None, label_smoothing=0.1, z_loss=1e-3, chunk_size=3)
TOK, REP = P("dp"), P()


# ------------------------------------------------- shard_map data parallel, check_vma on
@check("dp_lce_xla_sum")
def _():
    f = lambda x, w, b, y: lj.linear_cross_entropy(x, w, y, backend="xla", reduction="sum",
                                                   **dict(LCE, linear_bias=b))
    compare_dp(f, (X, W, B, Y), (TOK, REP, REP, TOK), (0, 1, 2), "lce sum")


@check("dp_lce_xla_none_lse")
def _():
    def f(x, w, b, y):
        loss, lse = lj.linear_cross_entropy(x, w, y, backend="xla", reduction="none",
                                            return_lse=True, **dict(LCE, linear_bias=b))
        return jnp.sum(loss) + 0.5 * jnp.sum(lse)
    compare_dp(f, (X, W, B, Y), (TOK, REP, REP, TOK), (0, 1, 2), "lce none+lse")


@check("dp_lce_xla_grad_inside")
def _():
    """A data-parallel step taking grads inside shard_map: JAX's rule for a replicated
    weight (its implicit cast to varying transposes to a psum) gives the summed dW there."""
    loss = lambda w, x, y: lj.linear_cross_entropy(x, w, y, backend="xla", reduction="sum",
                                                   chunk_size=3)
    step = shard_map(lambda w, x, y: jax.grad(loss)(w, x, y), mesh=DP,
                     in_specs=(REP, TOK, TOK), out_specs=REP)
    assert_close(jax.jit(step)(W, X, Y), jax.grad(loss)(W, X, Y), "dW inside shard_map")


@check("dp_jsd_xla_sum")
def _():
    f = lambda xs, ws, xt, y: lj.linear_jsd(xs, ws, xt, WT, y, backend="xla", reduction="sum",
                                            hard_loss_weight=0.3, chunk_size=3)
    compare_dp(f, (X, W, XT, Y), (TOK, REP, TOK, TOK), (0, 1), "jsd sum")


MLP = lj.SwiGLUMLP(H, 12, bias=True, backend="xla")
MLP_PARAMS = MLP.init(jax.random.PRNGKey(harness.SEED % (1 << 31)))
X3 = f32(4, N // 4, H)


@check("dp_tiled_mlp_swiglu")
def _():
    f = lambda p, x: jnp.sum(lj.tiled_mlp(MLP, p, x, num_shards=3) ** 2)
    compare_dp(f, (MLP_PARAMS, X3), (REP, TOK), (0, 1), "tiled SwiGLUMLP")


@check("dp_tiled_mlp_any_fn")
def _():
    fn = lambda p, x: jnp.tanh(x @ p["w"]) * p["s"]  # the generic per-shard VJP path
    params = {"w": f32(H, 5), "s": f32(5)}
    f = lambda p, x: jnp.sum(lj.tiled_mlp(fn, p, x, num_shards=3) ** 2)
    compare_dp(f, (params, X3), (REP, TOK), (0, 1), "tiled any fn")


@check("dp_x_tp_vocab_parallel")
def _():
    mesh = Mesh(devices.reshape(2, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    v = 40
    w, b = f32(v, H, scale=0.5), f32(v, scale=0.3)
    y = jnp.asarray(np.where(y_np >= 0, y_np % v, -100), jnp.int32)
    local = lambda x, w, b, y: lj.linear_cross_entropy(
        x, w, y, linear_bias=b, axis_name="tp", reduction="sum", label_smoothing=0.1)
    got = dp_value_and_grad(local, (X, w, b, y), (P("dp"), P("tp"), P("tp"), P("dp")),
                            (0, 1, 2), mesh=mesh)
    whole = lambda x, w, b, y: lj.linear_cross_entropy(x, w, y, linear_bias=b, backend="xla",
                                                       reduction="sum", label_smoothing=0.1)
    assert_close(got, jax.value_and_grad(whole, argnums=(0, 1, 2))(X, w, b, y), "dp x tp")


# ----------------------------------------------------------------------- pallas there
def _pallas_ops(interpret):
    kw = dict(backend="pallas", interpret=interpret)
    mlp = lj.SwiGLUMLP(H, 16, backend="pallas")
    params = mlp.init(jax.random.PRNGKey(0))
    pallas_kw = {"interpret": interpret}
    return {
        "lce": (lambda x, w, xt, y: lj.linear_cross_entropy(x, w, y, reduction="sum",
                                                            chunk_size=8, **kw)),
        "jsd": (lambda x, w, xt, y: lj.linear_jsd(x, w, xt, w[::-1], y, reduction="sum",
                                                  chunk_size=8, **kw)),
        "swiglu": (lambda x, w, xt, y: jnp.sum(lj.swiglu(x, xt, backend="pallas",
                                                         **pallas_kw) ** 2)),
        "tiled_mlp": (lambda x, w, xt, y: jnp.sum(lj.tiled_mlp(mlp, params, x[None],
                                                               num_shards=2))),
    }


@check("dp_pallas_interpret_clear_error")
def _():
    for name, f in _pallas_ops(None).items():
        try:
            dp_value_and_grad(f, (X, W, XT, Y), (TOK, REP, TOK, TOK), (0, 1))
        except NotImplementedError as e:
            msg = str(e)
            assert "backend='xla'" in msg and "check_vma=False" in msg and "'dp'" in msg, msg
        else:
            raise AssertionError(f"{name}: no NotImplementedError in interpret mode")


@check("dp_pallas_lowers_for_cuda")
def _():
    sds = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    for name, f in _pallas_ops(False).items():
        if name == "tiled_mlp":  # its SwiGLU kernels are checked by "swiglu"
            continue
        mapped = shard_map(lambda *a: lax.psum(f(*a), "dp"), mesh=DP,
                           in_specs=(TOK, REP, TOK, TOK), out_specs=P())
        traced = jax.jit(jax.value_and_grad(mapped, argnums=(0, 1))).trace(
            sds(64, 16), sds(V, 16), sds(64, 16), sds(64, dt=jnp.int32))
        try:
            hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
        except RuntimeError as e:
            # JAX 0.11 lowers Pallas for CUDA only with a GPU (or an abstract GPU device);
            # there test_jax_sharding's GPU test runs the kernels inside shard_map instead
            if "No supported GPU devices found" in str(e) and not jax.__version__.startswith("0.10."):
                return
            raise
        assert "xla.gpu.triton" in hlo, f"{name}: no Triton kernel in the CUDA lowering"


# -------------------------------------------------------------------- Explicit mesh axes
EXPLICIT = Mesh(devices, ("dp",), axis_types=(AxisType.Explicit,))


def _explicit_cases():
    """Each op once, and each kind of Pallas kernel (the JSD's take the same path as the
    cross-entropy's), per-token outputs on both backends."""
    mlp = lj.SwiGLUMLP(H, 12, backend="xla")
    params = mlp.init(jax.random.PRNGKey(1))

    def lce_pallas_none_lse(x, w, xt, y):
        loss, lse = lj.linear_cross_entropy(x, w, y, backend="pallas", reduction="none",
                                            return_lse=True, chunk_size=8, block_v=16)
        return jnp.sum(loss * jnp.arange(N)) + jnp.sum(lse)

    return {
        "lce_xla_mean": lambda x, w, xt, y: lj.linear_cross_entropy(
            x, w, y, backend="xla", label_smoothing=0.1, chunk_size=8),
        "lce_pallas_none_lse": lce_pallas_none_lse,
        "jsd_xla_none": lambda x, w, xt, y: jnp.sum(lj.linear_jsd(
            x, w, xt, WT, y, backend="xla", chunk_size=8, reduction="none") ** 2),
        "tiled_mlp_xla": lambda x, w, xt, y: jnp.sum(
            lj.tiled_mlp(mlp, params, jnp.reshape(x, (4, N // 4, H)), num_shards=3) ** 2),
        "swiglu_pallas": lambda x, w, xt, y: jnp.sum(lj.swiglu(x, xt, backend="pallas") ** 2),
    }


EXPLICIT_CASES = _explicit_cases()
EXPLICIT_WANT = {}


def _explicit_want(name):
    if name not in EXPLICIT_WANT:  # unsharded, no mesh set
        EXPLICIT_WANT[name] = jax.jit(jax.value_and_grad(EXPLICIT_CASES[name], argnums=(0, 1)))(
            X, W, XT, Y)
    return EXPLICIT_WANT[name]


@check("explicit_mesh_set")
def _():
    for k in EXPLICIT_CASES:
        _explicit_want(k)
    with jax.sharding.set_mesh(EXPLICIT):
        tok = lambda a: jax.device_put(a, P("dp"))
        args = (tok(X), W, tok(XT), tok(Y))
        for k, f in EXPLICIT_CASES.items():
            got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
            assert_close(got, _explicit_want(k), f"explicit {k}")
            assert got[1][0].sharding.spec[0] == "dp", (k, got[1][0].sharding)  # dX like x
        # per-token outputs come back sharded like the labels
        loss = jax.jit(lambda x, w, y: lj.linear_cross_entropy(x, w, y, reduction="none"))(
            args[0], W, args[3])
        assert loss.sharding.spec[0] == "dp", loss.sharding


@check("explicit_mesh_not_set")
def _():
    """jit of arrays sharded on an Explicit mesh, no mesh set (JAX 0.10's make_mesh gives
    Explicit axes by default)."""
    tok = lambda a: jax.device_put(a, NamedSharding(EXPLICIT, P("dp")))
    for k in ("lce_xla_mean", "jsd_xla_none"):
        got = jax.jit(jax.value_and_grad(EXPLICIT_CASES[k], argnums=(0, 1)))(
            tok(X), W, tok(XT), tok(Y))
        assert_close(got, _explicit_want(k), f"no mesh set: {k}")


print(json.dumps({"devices": len(jax.devices()), "jax": jax.__version__,
                  "results": RESULTS, "seconds": SECONDS}))
