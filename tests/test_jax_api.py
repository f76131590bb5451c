"""The JAX front door beyond the shared harness: the transformations (jit, grad,
value_and_grad, vmap), the Flax (H, V) weight layout without a copy, argument errors naming the
argument, out-of-range targets (eager error; NaN under jit), and the Triton lowering of the
Pallas kernels for a GPU (checked on CPU by lowering for CUDA, at the TARGETS shapes)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import logitless.jax as lj  # noqa: E402
from logitless.specs import linear_cross_entropy as spec  # noqa: E402

from harness import SEED  # noqa: E402
from helpers import assert_close_rel, gemm_shapes, jaxpr_eqns  # noqa: E402

BACKENDS = ["xla", "pallas"]
TOL = 2e-5  # float32 inputs against the float64 spec (blocked fp32 reductions)


def _problem(n=23, h=12, v=41, *, batch=(), bias=False, salt=0, dtype=jnp.float32):
    rng = np.random.default_rng([SEED, salt, n, h, v])
    x = rng.standard_normal((*batch, n, h))
    w = rng.standard_normal((v, h)) * (2.0 / np.sqrt(h))
    y = rng.integers(0, v, (*batch, n))
    y[rng.random((*batch, n)) < 0.2] = -100
    b = rng.standard_normal(v) * 0.3 if bias else None
    j = lambda a: None if a is None else jnp.asarray(a, dtype)
    return j(x), j(w), jnp.asarray(y, jnp.int32), j(b)


def _ref(x, w, y, b=None, **opts):
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)
    return spec.reference(f64(x), f64(w), np.asarray(y), bias=f64(b),
                          options=spec.LinearCrossEntropyOptions(**opts))


def _assert_close(a, r, tol=TOL):
    assert_close_rel(a, r, tol)


# --------------------------------------------------------------------- transformations
@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_grad_and_value_and_grad(backend):
    x, w, y, b = _problem(bias=True)
    f = lambda x, w, b: lj.linear_cross_entropy(x, w, y, linear_bias=b, backend=backend,
                                                label_smoothing=0.1, chunk_size=8)
    loss, (dx, dw, db) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, b)
    ref = _ref(x, w, y, b, label_smoothing=0.1)
    _assert_close(loss, ref["loss"])
    _assert_close(dx, ref["dx"])
    _assert_close(dw, ref["dw"])
    _assert_close(db, ref["db"])
    assert loss.dtype == jnp.float32 and dx.dtype == x.dtype and db.shape == b.shape
    # jax.grad (not jitted by us) gives the same gradients
    gx = jax.grad(f)(x, w, b)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(dx), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_reduction_and_lse_keep_the_label_shape(backend):
    """(B, T, H) inputs: "none" losses and lse come back (B, T); per-token cotangents and an
    lse cotangent reach the gradient (the backward recomputes with them)."""
    x, w, y, _ = _problem(n=7, batch=(3,), salt=1)
    rng = np.random.default_rng([SEED, 2])
    g = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    gl = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)

    def f(x, w):
        loss, lse = lj.linear_cross_entropy(x, w, y, reduction="none", return_lse=True,
                                            z_loss=1e-2, backend=backend, chunk_size=5)
        assert loss.shape == y.shape and lse.shape == y.shape
        return jnp.sum(loss * g) + jnp.sum(lse * gl)

    dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    ref = spec.reference(np.asarray(x, np.float64).reshape(21, -1), np.asarray(w, np.float64),
                         np.asarray(y).reshape(-1),
                         options=spec.LinearCrossEntropyOptions(reduction="none", z_loss=1e-2),
                         grad_output=np.asarray(g).reshape(-1), grad_lse=np.asarray(gl).reshape(-1))
    _assert_close(dx.reshape(21, -1), ref["dx"])
    _assert_close(dw, ref["dw"])


@pytest.mark.parametrize("bad", [np.nan])
@pytest.mark.parametrize("lse", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens_get_zero_gradient_whatever_their_cotangent(backend, lse, bad):
    """"none" losses with an inf or NaN cotangent at ignored tokens (a per-sequence mean over
    an all-padding sequence): their gradient is 0, as F.cross_entropy gives, i.e. bit for bit
    the result of a 0 cotangent there. The backward had multiplied the cotangent by the token's
    0 weight: NaN in every dW row. An lse cotangent on an ignored token still flows."""
    x, w, y, b = _problem(n=13, bias=True, salt=5)
    y = y.at[1::3].set(-100).at[0].set(3)
    ign = np.asarray(y) == -100
    rng = np.random.default_rng([SEED, 6])
    g0 = np.where(ign, 0.0, rng.random(13)).astype(np.float32)
    gl = jnp.asarray(rng.random(13), jnp.float32)
    f = lambda x, w, b: lj.linear_cross_entropy(x, w, y, linear_bias=b, reduction="none",
                                                return_lse=lse, label_smoothing=0.1,
                                                z_loss=1e-3, backend=backend, chunk_size=5)
    out, pullback = jax.vjp(f, x, w, b)

    def grads(g):
        g = jnp.asarray(g)
        return pullback((g, gl) if lse else g)
    for got, want in zip(grads(np.where(ign, np.float32(bad), g0)), grads(g0)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("backend", BACKENDS + ["pallas-split"])
def test_vmap_over_a_leading_batch_axis(backend):
    """vmap of value_and_grad over sequences sharing one weight: each sequence is its own
    mean (not one mean over the flattened batch), dW is per sequence."""
    x, w, y, _ = _problem(n=9, batch=(2,), salt=3)
    # pallas: a persistent grid, so the batching rule's extra grid axis meets the row loop;
    # split rows: on a GPU the tickets and row counters in memory, interpreted two launches
    tuning = {"pallas": dict(grid_size=2, block_rows=2, block_v=16),
              "pallas-split": dict(grid_size=3, block_rows=2, block_v=16, row_split=2)
              }.get(backend, {})
    backend = backend.split("-")[0]
    f = lambda x, w, y: lj.linear_cross_entropy(x, w, y, backend=backend, chunk_size=4, **tuning)
    loss, (dx, dw) = jax.jit(jax.vmap(jax.value_and_grad(f, argnums=(0, 1)),
                                      in_axes=(0, None, 0)))(x, w, y)
    assert loss.shape == (2,) and dx.shape == x.shape and dw.shape == (2, *w.shape)
    for i in range(2):
        ref = _ref(x[i], w, y[i])
        _assert_close(loss[i], ref["loss"])
        _assert_close(dx[i], ref["dx"])
        _assert_close(dw[i], ref["dw"])


@pytest.mark.parametrize("fp32_logits", [False, True])
def test_pallas_split_rows_where_every_logit_is_far_below_zero(fp32_logits):
    """Rows split over programs (on a GPU one launch with waits, interpreted two launches):
    with every logit ~ -100 and whole segments of classes masked by a -inf bias, the
    segments' sums merge relative to the row's maximum (a segment with no live class adds 0,
    not 0·e^100), as whole rows and the xla backend compute them; bf16 inputs, float32 logits
    or not."""
    x, w, y, _ = _problem(n=11, h=8, v=40, salt=14)
    # 5 blocks of 8 columns split 4 ways make 3 segments of 2 blocks: the second has no live class
    bias = jnp.full((40,), -100.0).at[16:32].set(-jnp.inf).astype(jnp.bfloat16)
    y = jnp.where((y >= 16) & (y < 32), 3, y)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def run(backend, **kw):
        f = lambda x, w: lj.linear_cross_entropy(x, w, y, linear_bias=bias, backend=backend,
                                                 **kw)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
    f32 = lambda a: np.asarray(a, np.float32)
    whole = run("pallas", row_split=1, block_v=8, fp32_logits=fp32_logits)
    split = run("pallas", row_split=4, block_v=8, fp32_logits=fp32_logits)
    xla = run("xla")
    assert np.isfinite(float(split[0])) and all(np.isfinite(f32(g)).all() for g in split[1])
    # the same logits and their rounding: equal but for the order of the segments' sums
    _assert_close(split[0], whole[0], 1e-6)
    for g, r in zip(split[1], whole[1]):
        assert np.abs(f32(g) - f32(r)).max() <= 2 ** -7 * np.abs(f32(r)).max()  # bf16 ulps
    # near the xla backend's (its logits and bias are summed and rounded otherwise: bf16
    # logits of ~-100 are 0.5 apart)
    _assert_close(split[0], xla[0], 1e-3)


def test_pallas_split_rows_fewer_segments_than_programs_max_in_the_last():
    """36 classes (padded to 40) in 4-column blocks split 8 ways: 5 segments of 2 blocks, the
    last one a live block and a block of padding only. The merge reads the 3 partial rows no
    segment wrote as no classes (Σ w_v c_v included: label smoothing, class weights); its
    reference is the row's max, here in the last segment and 100 above the others (e^100
    overflows float32); the padding block's gradient is written 0 (float32 logits: dz is a
    fresh buffer, and dX = dz·W sees the padding). Against whole rows."""
    x, w, y, _ = _problem(n=11, h=8, v=36, salt=15)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    bias = jnp.zeros((36,), jnp.bfloat16).at[32:].set(100.0)
    cw = jnp.asarray(np.random.default_rng([SEED, 15]).random(36) + 0.5, jnp.float32)

    def run(row_split):
        def f(x, w, b):
            out = lj.linear_cross_entropy(x, w, y, linear_bias=b, weight=cw, reduction="none",
                                          label_smoothing=0.1, return_lse=True, backend="pallas",
                                          block_v=4, row_split=row_split, fp32_logits=True)
            return out[0].sum() + 0.5 * out[1].sum(), out
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(x, w, bias)
    f32 = lambda a: np.asarray(a, np.float32)
    (_, split), gs = run(8)
    (_, whole), gw = run(1)
    for a, r in zip(split, whole):
        _assert_close(a, r, 1e-6)
    for g, r in zip(gs, gw):
        assert np.isfinite(f32(g)).all()
        assert np.abs(f32(g) - f32(r)).max() <= 2 ** -7 * np.abs(f32(r)).max()  # bf16 ulps


def test_pallas_default_row_split_and_its_launch_settings():
    """On a GPU rows split default_row_split(V) ways (the power of 2 nearest V / ROW_SEGMENT)
    with SPLIT_DEFAULTS' launch settings (2 warps), whole rows below ~23K classes with
    GPU_DEFAULTS' (16); interpreted, whole rows. Traced only: interpret=False traces on a CPU."""
    from logitless.pallas_kernels.linear_cross_entropy import default_row_split
    assert [default_row_split(v) for v in (1, 23170, 23171, 50257, 128256, 151936, 256000)] \
        == [1, 1, 2, 4, 8, 8, 16]

    def kernels(v, interpret):
        f = lambda x, w: lj.linear_cross_entropy(x, w, jnp.zeros((64,), jnp.int32),  # noqa
                                                 backend="pallas", interpret=interpret)
        s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(s(64, 16), s(v, 16)).jaxpr
        ks = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name == "pallas_call"]
        # the partials (4 per segment, float32) pass from the stats to the merge: the split
        split = {o.aval.shape[0] // 4 for k in ks for o in k.outvars
                 if o.aval.ndim == 2 and o.aval.dtype == jnp.float32}
        return split, {k.params["compiler_params"].num_warps for k in ks}
    assert kernels(50257, False) == ({4}, {2})
    assert kernels(20000, False) == (set(), {16})
    assert kernels(50257, True) == (set(), {16})


def test_pallas_store_grad_backwards_stores_only_the_given_blocks():
    """``blocks=(first, end)`` (one row segment): column blocks first..end-1 get the gradient
    (0 past the vocabulary), every other block keeps what it held: on a GPU dz overwrites the
    logits in place, and another segment's program may still read its blocks."""
    from jax.experimental import pallas as pl

    from logitless.pallas_kernels import _launch as launch

    def kernel(z_ref, dz_ref):
        def grad_block(j):
            cols = j * 4 + launch.iota(4)
            return jnp.full((2, 4), 1.0, jnp.float32) * (j + 1), cols < 14, pl.ds(j * 4, 4)
        launch.store_grad_backwards(dz_ref, pl.ds(0, 2), launch.iota(2) < 2, 14, 4, grad_block,
                                    blocks=(np.int32(1), np.int32(4)))
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2, 16), jnp.float32),
                         input_output_aliases={0: 0}, interpret=True)(jnp.full((2, 16), -1.0))
    want = np.repeat([-1.0, 2, 3, 4], 4)
    want[14:] = 0.0
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(want, (2, 16)))


@pytest.mark.parametrize("v", [40, 41])
@pytest.mark.parametrize("backend", BACKENDS)
def test_flax_hv_layout_uses_the_kernel_as_is(backend, v):
    """A Flax Dense kernel (H, V) with weight_layout="hv": right values and an (H, V) gradient,
    and nowhere in the traced program (forward, backward, nested loops) is the weight or its
    gradient transposed or copied (the GEMMs read it through their dimension numbers; an odd V
    is padded, see the next test)."""
    x, w, y, _ = _problem(h=12, v=v, salt=4)
    kernel = jnp.asarray(np.asarray(w).T)  # (H, V), as flax.linen.Dense stores it
    f = lambda x, k: lj.linear_cross_entropy(x, k, y, weight_layout="hv", backend=backend,
                                             chunk_size=8)
    vg = jax.value_and_grad(f, argnums=(0, 1))
    loss, (dx, dk) = jax.jit(vg)(x, kernel)
    ref = _ref(x, w, y)
    assert dk.shape == kernel.shape
    _assert_close(loss, ref["loss"])
    _assert_close(dx, ref["dx"])
    _assert_close(dk.T, ref["dw"])
    vp = -(-v // 8) * 8  # the padded vocabulary's GEMMs: their weight must not move either
    weight_shapes = {kernel.shape, kernel.shape[::-1], (12, vp), (vp, 12)}
    moved = [e for e in jaxpr_eqns(jax.make_jaxpr(vg)(x, kernel).jaxpr)
             if e.primitive.name in ("transpose", "copy", "copy_p")
             and any(tuple(getattr(v.aval, "shape", ())) in weight_shapes for v in e.invars)]
    assert not moved, moved


@pytest.mark.parametrize("layout", ["vh", "hv"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_vocabularies_run_every_gemm_on_aligned_parts(backend, layout):
    """V = 61: no GEMM of the forward or backward has V as a dimension (an odd leading
    dimension puts XLA's GPU GEMMs on slow kernels, 2-4x); they run on the vocabulary padded
    to 64, and the results stay right."""
    x, w, y, b = _problem(h=12, v=61, salt=7, bias=True)
    k = w if layout == "vh" else jnp.asarray(np.asarray(w).T)
    f = lambda x, k, b: lj.linear_cross_entropy(x, k, y, linear_bias=b, weight_layout=layout,
                                                backend=backend, chunk_size=8)
    vg = jax.value_and_grad(f, argnums=(0, 1, 2))
    dims = {d for shape in gemm_shapes(jax.make_jaxpr(vg)(x, k, b).jaxpr) for d in shape}
    assert 61 not in dims and 64 in dims, sorted(dims)
    loss, (dx, dk, db) = jax.jit(vg)(x, k, b)
    ref = _ref(x, w, y, b)
    _assert_close(loss, ref["loss"])
    _assert_close(dx, ref["dx"])
    _assert_close(dk if layout == "vh" else dk.T, ref["dw"])
    _assert_close(db, ref["db"])


@pytest.mark.parametrize("backend, budget, chunk", [("xla", 61 * 8 * 16, 16),
                                                     ("pallas", 61 * 4 * 32, 24)])
def test_chunks_from_the_budget_pad_the_tokens_to_whole_chunks(backend, budget, chunk):
    """N = 37 with a budget for 16 (xla) / 32 (pallas) tokens: the chunks are made equal and
    the tokens padded to a whole number of them (XLA would give a ragged last chunk buffers of
    its own), so every GEMM runs on exactly ``chunk`` tokens; per-token losses, lse and the
    gradients (per-token cotangents) stay right and unpadded."""
    x, w, y, b = _problem(n=37, h=12, v=61, salt=9, bias=True)
    f = lambda x, w, b: lj.linear_cross_entropy(x, w, y, linear_bias=b, reduction="none",
                                                return_lse=True, backend=backend,
                                                memory_budget=budget)
    dims = {d for shape in gemm_shapes(jax.make_jaxpr(
        lambda x, w, b: jax.vjp(f, x, w, b)[1]((jnp.ones(37), jnp.ones(37))))(x, w, b).jaxpr)
        for d in shape}
    assert dims == {12, 64, chunk}, sorted(dims)
    (tok, lse), vjp = jax.vjp(f, x, w, b)
    g, h = (jnp.asarray(np.random.default_rng([SEED, 33, k]).standard_normal(37), jnp.float32)
            for k in range(2))
    dx, dw, db = vjp((g, h))
    assert tok.shape == lse.shape == (37,) and dx.shape == x.shape
    ref = _ref(x, w, y, b, reduction="none", return_lse=True)
    _assert_close(tok, ref["loss"])
    _assert_close(lse, ref["lse"])
    full = spec.reference(*(np.asarray(a, np.float64) for a in (x, w)), np.asarray(y),
                          bias=np.asarray(b, np.float64), grad_output=np.asarray(g, np.float64),
                          grad_lse=np.asarray(h, np.float64),
                          options=spec.LinearCrossEntropyOptions(reduction="none",
                                                                 return_lse=True))
    _assert_close(dx, full["dx"])
    _assert_close(dw, full["dw"])
    _assert_close(db, full["db"])


@pytest.mark.parametrize("fp32_logits", [False, True])
def test_pallas_kernel_ignores_and_zeroes_the_padded_vocabulary(fp32_logits):
    """The Pallas row kernel on logits padded past V (as the driver hands them over at an odd
    V) with NaN in the padded columns: loss and lse as on the unpadded logits, dz the same in
    the real columns and exactly 0 in the padded ones (the dX GEMM reads them), whether dz
    overwrites the logits (bf16) or is its own buffer (fp32 logits)."""
    from logitless import _jax_common as common
    from logitless.pallas_kernels.linear_cross_entropy import PallasHead
    n, v, vp = 11, 61, 64
    rng = np.random.default_rng([SEED, 31])
    dt = jnp.float32 if fp32_logits else jnp.bfloat16
    z = jnp.asarray(rng.standard_normal((n, v)) * 3, dt)
    zp = jnp.concatenate([z, jnp.full((n, vp - v), jnp.nan, dt)], axis=1)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    opts = spec.LinearCrossEntropyOptions(label_smoothing=0.1, z_loss=1e-3)
    coefs, _ = common.token_coefficients(y, None, opts, v)
    coefs = common.with_upstream(coefs, 0.5, 0.25)
    bias = jnp.asarray(rng.standard_normal(v), jnp.bfloat16)
    head = PallasHead(softcap=30.0, smoothing=True, block_rows=2, block_v=16, num_warps=4,
                      num_stages=1, grid_size=None, interpret=True, fp32_logits=fp32_logits)
    want = head.loss_lse_grad(z, y, coefs, bias, None, jnp.bfloat16, v=v)
    got = head.loss_lse_grad(zp, y, coefs, bias, None, jnp.bfloat16, v=v)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dz = np.asarray(got[2].astype(jnp.float32))
    np.testing.assert_array_equal(dz[:, :v], np.asarray(want[2].astype(jnp.float32)))
    assert (dz[:, v:] == 0).all(), dz[:, v:]


class _CompileCounter:
    """Counts JAX's compile-pipeline events (tracing to a jaxpr, lowering, backend compile)
    through the public ``jax.monitoring`` listeners."""

    def __init__(self):
        self.events = []

    def _listen(self, name, *_, **__):
        if name.startswith("/jax/core/compile/"):
            self.events.append(name)

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def compiles(self):
        return sum("backend_compile" in e for e in self.events)


def _eager_ops():
    x, w, y, b = _problem(n=20, h=8, v=37, bias=True, salt=11)
    xt = x[::-1] * 0.5
    mlp = lj.SwiGLUMLP(8, 16, backend="xla")
    params = mlp.init(jax.random.PRNGKey(0))
    ce = lambda backend, **kw: lj.linear_cross_entropy(
        x, w, y, linear_bias=b, backend=backend, chunk_size=8, label_smoothing=0.1, **kw)
    return {
        "ce_xla": lambda: ce("xla"),
        "ce_pallas": lambda: ce("pallas", block_v=16),
        "ce_none_lse": lambda: ce("xla", reduction="none", return_lse=True),
        "ce_grad": lambda: jax.grad(lambda x: ce("xla"))(x),
        "jsd_xla": lambda: lj.linear_jsd(x, w, xt, w, y, backend="xla", chunk_size=8),
        "jsd_pallas": lambda: lj.linear_jsd(x, w, xt, w, None, backend="pallas", chunk_size=8),
        "tiled_mlp": lambda: lj.tiled_mlp(mlp, params, x, num_shards=3),
        "tiled_mlp_grad": lambda: jax.grad(
            lambda p: jnp.sum(lj.tiled_mlp(mlp, p, x, num_shards=3)))(params),
    }


@pytest.mark.parametrize("op", list(_eager_ops()))
def test_eager_calls_compile_once(op):
    """Outside jax.jit, each op compiles on its first call only: warm calls reuse the
    compiled program (a cached jit of the chunk loop / Pallas call), they do not rebuild it."""
    run = _eager_ops()[op]
    with _CompileCounter() as cold:
        first = jax.block_until_ready(run())
    assert cold.compiles() > 0, "the counter saw no compile at all: it counts nothing"
    with _CompileCounter() as warm:
        for _ in range(3):
            again = jax.block_until_ready(run())
    assert warm.compiles() == 0, warm.events
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_X64_PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    import jax
    if sys.argv[1] == "x64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import logitless.jax as lj

    rng = np.random.default_rng(int(sys.argv[2]))
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    x, w, xt, wt = f32(21, 8), f32(37, 8), f32(21, 8), f32(37, 8)
    y = jnp.asarray(rng.integers(0, 37, 21), jnp.int32)
    ce = lambda be: lambda x, w: lj.linear_cross_entropy(
        x, w, y, backend=be, chunk_size=8, label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    jsd = lambda be: lambda x, w: lj.linear_jsd(
        x, w, xt, wt, y, beta=0.5, temperature=2.0, hard_loss_weight=0.3, backend=be,
        chunk_size=8)
    out = {}
    for name, op in (("ce", ce), ("jsd", jsd)):
        for be in ("xla", "pallas"):
            out[f"{name}_{be}_loss"] = np.asarray(op(be)(x, w))
            try:
                loss, (dx, dw) = jax.value_and_grad(op(be), argnums=(0, 1))(x, w)
            except NotImplementedError as e:
                assert be == "pallas" and "jax_enable_x64" in str(e), e
                continue
            for k, v in (("loss", loss), ("dx", dx), ("dw", dw)):
                assert v.dtype == jnp.float32, (name, be, k, v.dtype)
                out[f"{name}_{be}_grad_{k}"] = np.asarray(v)
    np.savez(sys.argv[3], **out)
""")


def test_float32_inputs_under_x64_give_the_same_results(tmp_path):
    """jax_enable_x64 (process-global, hence subprocesses): float32 inputs give the float32
    loss and gradients they give without it (no float64 constant leaks into a loop carry),
    for linear CE and JSD with every option that brings a constant (smoothing, z-loss,
    softcap; β, T, the hard-label weight). The interpreted Pallas gradient, which JAX's
    interpreter cannot run under x64, is a clear NotImplementedError instead; its loss runs."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = {}
    for mode in ("x32", "x64"):
        path = tmp_path / f"{mode}.npz"
        r = subprocess.run([sys.executable, "-c", _X64_PROBE, mode, str(SEED % 2**31), str(path)],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        res[mode] = dict(np.load(path))
    x32, x64 = res["x32"], res["x64"]
    assert {"ce_xla_grad_dw", "jsd_xla_grad_dw", "ce_pallas_loss", "jsd_pallas_loss"} <= set(x64)
    assert set(x64) <= set(x32)
    for k in x64:
        assert np.isfinite(x64[k]).all(), k
        np.testing.assert_allclose(x64[k], x32[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_default_backend_follows_the_platform():
    assert lj.available_backends()[0] == ("pallas" if jax.default_backend() == "gpu" else "xla")
    x, w, y, _ = _problem(salt=5)
    a = lj.linear_cross_entropy(x, w, y)
    _assert_close(a, _ref(x, w, y)["loss"])


def test_pallas_fp32_logits_skips_the_logits_rounding():
    """bf16 inputs with ``fp32_logits=True``: the loss sees unrounded logits (error ~1e-7
    instead of bf16's ~1e-4), gradients still come out in bf16 (written to their own buffer)."""
    x, w, y, b = _problem(bias=True, salt=9, dtype=jnp.bfloat16)
    f = lambda x, w, b: lj.linear_cross_entropy(x, w, y, linear_bias=b, backend="pallas",
                                                z_loss=1e-3, chunk_size=8, fp32_logits=True)
    loss, (dx, dw, db) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, b)
    ref = _ref(x, w, y, b, z_loss=1e-3)
    assert dx.dtype == dw.dtype == db.dtype == jnp.bfloat16
    _assert_close(loss, ref["loss"], tol=1e-5)
    for got, key in ((dx, "dx"), (dw, "dw"), (db, "db")):
        _assert_close(got, ref[key], tol=1e-2)  # bf16 gradients: ~3e-3


def test_pallas_second_order_derivatives_raise_a_clear_error():
    """The Pallas kernels have no JVP rule: jax.hessian / grad of grad name the backend to use
    instead of failing inside Pallas (first-order gradients: the shared harness)."""
    x, w, y, b = _problem(n=11, h=8, v=17, bias=True, salt=5)
    lce = lambda b: lj.linear_cross_entropy(x, w, y, linear_bias=b, backend="pallas",
                                            chunk_size=4)
    msg = r"backend='pallas' has no second-order derivatives.*use backend='xla'"
    with pytest.raises(NotImplementedError, match=msg):
        jax.hessian(lce)(b)
    jsd = lambda xs: lj.linear_jsd(xs, w, x, w[::-1], y, backend="pallas", chunk_size=4)
    with pytest.raises(NotImplementedError, match=msg):
        jax.grad(lambda xs: jnp.sum(jax.grad(jsd)(xs) ** 2))(x)
    act = lambda g: jnp.sum(lj.swiglu(g, x, backend="pallas") ** 2)
    with pytest.raises(NotImplementedError, match=msg):
        jax.grad(lambda g: jnp.sum(jax.grad(act)(g) ** 2))(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [-1.0, 0.05])
def test_mean_divides_by_the_class_weight_sum_whatever_its_size_or_sign(backend, scale):
    """"mean" divides by Σω as it is (F.cross_entropy's rule; only Σω = 0 gives 0): negative
    (Σω = -4 here) and below 1 (0.2), where a divisor clamped to 1 or to |Σω| would pass the
    shared harness (its class weights are in [0.25, 2])."""
    x, w, _, _ = _problem(n=6, h=8, v=5, salt=13)
    y = jnp.array([0, 0, 1, 2, -100, 0])
    cw = np.array([-1.0, -0.5, -0.5, 1.0, 1.0]) * (1.0 if scale < 0 else -scale)
    loss, (dx, dw) = jax.value_and_grad(
        lambda x, w: lj.linear_cross_entropy(x, w, y, weight=cw, backend=backend),
        argnums=(0, 1))(x, w)
    f64 = lambda a: np.asarray(a, np.float64)
    ref = spec.reference(f64(x), f64(w), np.asarray(y), weight=f64(cw),
                         options=spec.LinearCrossEntropyOptions())
    for got, key in ((loss, "loss"), (dx, "dx"), (dw, "dw")):
        _assert_close(got, ref[key])


@pytest.mark.parametrize("reduction, lse", [("mean", False), ("none", False), ("sum", True)])
def test_teacher_and_class_weights_are_constants_at_every_order(reduction, lse):
    """The teacher (linear_jsd) and the class weights (linear_cross_entropy) get no gradient,
    and their cross second derivatives with the differentiated inputs are 0 too, as for
    ``stop_gradient``: the custom_vjp's residuals had carried them (d/dteacher of dL/dstudent
    was 2.4e-2 while d/dstudent of dL/dteacher was 0: an asymmetric Hessian). Both rule pairs:
    the fused forward ("mean"/"sum") and the recomputing one ("none", or lse returned)."""
    x, w, y, _ = _problem(n=5, h=4, v=7, bias=False, salt=6)
    xt = x[::-1] * 0.7
    total = lambda out: jnp.sum(out[0] + out[1]) if lse else jnp.sum(out)
    jsd = lambda xs, xt: jnp.sum(lj.linear_jsd(xs, w, xt, w[::-1], y, backend="xla",
                                               reduction=reduction))
    assert not jnp.any(jax.jacrev(jax.grad(jsd, argnums=0), argnums=1)(x, xt))
    cw = jnp.linspace(0.5, 1.5, 7)
    ce = lambda x, cw: total(lj.linear_cross_entropy(x, w, y, weight=cw, backend="xla",
                                                     reduction=reduction, return_lse=lse))
    assert not jnp.any(jax.jacrev(jax.grad(ce, argnums=0), argnums=1)(x, cw))
    assert jnp.any(jax.jacrev(jax.grad(ce, argnums=0), argnums=0)(x, cw))  # the test can see


def test_traced_tuning_keywords_say_how_to_pass_them():
    """A chunk or block size that is a traced value (or a 0-d array) is refused with the hint
    the options give (close over it / mark it static), not a bare "must be a positive int"."""
    x, w, y, _ = _problem(n=5, h=4, v=7, bias=False, salt=7)
    for kw in ("chunk_size", "memory_budget"):
        with pytest.raises(TypeError, match=f"{kw} must be an int.*mark it static"):
            jax.jit(lambda c: lj.linear_cross_entropy(x, w, y, backend="xla", **{kw: c}))(64)
    with pytest.raises(TypeError, match="block_v must be an int.*mark it static"):
        lj.linear_cross_entropy(x, w, y, backend="pallas", block_v=jnp.array(128))


# ------------------------------------------------------------------------ bad arguments
def _args():
    x, w, y, b = _problem(n=5, h=4, v=7, bias=True, salt=6)
    return dict(x=x, linear_weight=w, labels=y, linear_bias=b)


BAD = [
    (dict(x=np.arange(20).reshape(5, 4)), TypeError, "x must be float32"),
    (dict(x=[[0.0] * 4] * 5), TypeError, "x must be a jax.Array"),
    (dict(linear_weight=jnp.zeros((7, 4), jnp.bfloat16)), TypeError, "linear_weight dtype"),
    (dict(linear_bias=jnp.zeros((7,), jnp.float16)), TypeError, "linear_bias dtype"),
    (dict(linear_bias=jnp.zeros((6,))), ValueError, "linear_bias must have shape"),
    (dict(labels=jnp.zeros((5,))), TypeError, "labels must hold integer"),
    (dict(labels=jnp.zeros((5,), bool)), TypeError, "labels must hold integer"),
    (dict(labels=jnp.zeros((4,), jnp.int32)), ValueError,
     "labels must have shape x.shape[:-1] = (5,)"),
    (dict(linear_weight=jnp.zeros((7, 5))), ValueError, "hidden size mismatch: x has H=4"),
    (dict(x=jnp.zeros((), jnp.float32)), ValueError, "x must have at least 1 dimension"),
    (dict(linear_weight=jnp.zeros((7,))), ValueError, "linear_weight must be 2-D"),
    (dict(weight=jnp.ones((6,))), ValueError, "weight (class weights) must have shape"),
    (dict(weight=jnp.ones((7,), jnp.int32)), TypeError, "weight (class weights) must be a floating"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be <= 1.0"),
    (dict(softcap=0.0), ValueError, "softcap must be > 0"),
    (dict(ignore_index=2**40), ValueError, "ignore_index must fit in int32"),
    # a jnp scalar option (e.g. annealed under jit): refused, saying how to pass it
    (dict(label_smoothing=jnp.float32(0.1)), TypeError, "pass a Python number (float(t) of a 0-d "
     "tensor or array; under jax.jit close over"),
    (dict(ignore_index=jnp.int32(-100)), TypeError, "ignore_index must be an int, got Array"),
    (dict(weight_layout="vhh"), ValueError, "weight_layout must be"),
    (dict(backend="triton"), ValueError, "backend must be None or one of"),
    (dict(backend="xla", block_v=64), TypeError, "unknown tuning keyword(s) ['block_v']"),
    # a misspelled option is Python's TypeError with a suggestion, not a "tuning keyword"
    (dict(reducton="sum"), TypeError,
     "linear_cross_entropy() got an unexpected keyword argument 'reducton' (did you mean "
     "'reduction'?)"),
    (dict(backend="xla", chunk_sze=8), TypeError, "['chunk_sze'] for backend='xla' (did you "
                                                  "mean 'chunk_size'?)"),
    # a typo nearer a tuning keyword than a parameter stays a tuning-keyword error
    (dict(backend="pallas", inteapret=True), TypeError, "(did you mean 'interpret'?)"),
    (dict(reducton="sum", axis_name="tp"), TypeError, "(did you mean 'reduction'?)"),
    (dict(backend="pallas", blocks=64), TypeError, "it accepts ['chunk_size'"),
    (dict(backend="pallas", block_v=48), ValueError, "block_v must be a power of two"),
    (dict(backend="pallas", num_warps=64), ValueError, "num_warps must be a power of two"),
    (dict(backend="pallas", grid_size=0), ValueError, "grid_size must be an int"),
    (dict(backend="pallas", row_split=3), ValueError, "row_split must be a power of two"),
    (dict(backend="pallas", row_sync=1), TypeError, "row_sync must be a bool"),
    (dict(backend="pallas", interpret="yes"), TypeError, "interpret must be a bool"),
    (dict(backend="pallas", fp32_logits=1), TypeError, "fp32_logits must be a bool"),
    (dict(backend="xla", chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(backend="xla", chunk_size=True), ValueError, "chunk_size must be a positive int"),
    (dict(backend="pallas", block_v=np.bool_(True)), ValueError, "block_v must be a power"),
    (dict(backend="pallas", memory_budget=-1), ValueError, "memory_budget must be"),
]


@pytest.mark.parametrize("change,exc,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_raise_naming_the_argument(change, exc, message):
    args = {**_args(), **change}
    with pytest.raises(exc) as info:
        lj.linear_cross_entropy(args.pop("x"), args.pop("linear_weight"), args.pop("labels"),
                                **args)
    assert message in str(info.value)


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_integer_tuning_values_are_accepted(op, backend):
    """Tuning sizes computed with NumPy (np.int64) work as the equal Python ints do."""
    x, w, y, _ = _problem(n=9, h=4, v=37, salt=12)
    tuning = dict(chunk_size=4)
    if backend == "pallas":
        tuning.update(block_v=16, block_rows=2, num_warps=4)
        if op == "linear_cross_entropy":
            tuning["grid_size"] = 3
        else:
            tuning["segment_size"] = 32
    if op == "linear_jsd":
        tuning["logits_chunk_size"] = 2
        f = lambda **t: lj.linear_jsd(x, w, x * 0.5, w, y, backend=backend, **t)
    else:
        f = lambda **t: lj.linear_cross_entropy(x, w, y, backend=backend, **t)
    want = f(**tuning)
    got = f(**{k: np.int64(v) for k, v in tuning.items()})
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    budget = f(memory_budget=np.int64(1 << 20))
    _assert_close(budget, np.asarray(want, np.float64), 1e-6)


def test_label_smoothing_with_class_weights_runs_every_fp32_product_in_full_precision():
    """Σ_v w_v·c_v (label smoothing with class weights) is a matrix-vector product: like every
    float32 GEMM it must ask for HIGHEST precision (DEFAULT is TF32-like on a GPU)."""
    x, w, y, _ = _problem(n=9, h=4, v=37, salt=13)
    cw = jnp.asarray(np.random.default_rng([SEED, 13]).random(37) + 0.5, jnp.float32)
    f = lambda x, w: lj.linear_cross_entropy(x, w, y, weight=cw, label_smoothing=0.1,
                                             backend="xla", chunk_size=4)
    eqns = [e for e in jaxpr_eqns(jax.make_jaxpr(jax.value_and_grad(f, (0, 1)))(x, w).jaxpr)
            if e.primitive.name == "dot_general"]
    assert eqns
    for e in eqns:
        prec = e.params["precision"]
        precs = prec if isinstance(prec, tuple) else (prec,)
        assert all(p == jax.lax.Precision.HIGHEST for p in precs), (prec, e)


# --------------------------------------------------------------------- targets out of range
@pytest.mark.parametrize("bad", [7, 1000, -3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_labels_raise_when_concrete(backend, bad):
    x, w, y, _ = _problem(n=5, h=4, v=7, salt=7)
    labels = np.asarray(y).astype(np.int64)  # NumPy int64 labels are accepted (made int32)
    labels[2] = bad
    with pytest.raises(ValueError, match=r"target out of range: .*\[0, 7\).*ignore_index=-100"):
        lj.linear_cross_entropy(x, w, labels, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_labels_under_jit_give_nan(backend):
    """Traced labels cannot be checked without a host sync: a bad label poisons its token's
    loss, the reduced loss and the gradients with NaN; other tokens' losses stay finite."""
    x, w, y, _ = _problem(n=12, h=4, v=7, salt=8)
    y = y.at[3].set(7).at[5].set(-3).at[9].set(2**30)  # past V, negative, far past V
    bad = np.zeros(12, bool)
    bad[[3, 5, 9]] = True

    @jax.jit
    def run(x, w, y):
        mean, grads = jax.value_and_grad(
            lambda x, w: lj.linear_cross_entropy(x, w, y, backend=backend, chunk_size=8),
            argnums=(0, 1))(x, w)
        none = lj.linear_cross_entropy(x, w, y, reduction="none", backend=backend, chunk_size=8)
        return mean, grads, none

    mean, (dx, dw), none = run(x, w, y)
    assert np.isnan(float(mean))
    assert np.isnan(np.asarray(dw)).any()
    none = np.asarray(none)
    assert np.isnan(none[bad]).all() and np.isfinite(none[~bad]).all()
    clean = y.at[3].set(-100).at[5].set(-100).at[9].set(-100)
    np.testing.assert_allclose(none[~bad], np.asarray(lj.linear_cross_entropy(
        x, w, clean, reduction="none", backend=backend))[~bad], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_labels_outside_int32_are_out_of_range_not_wrapped(backend):
    """uint32 labels are cast to int32 for the kernels: 2^32 - 100 must not wrap to -100
    (an ignored token) nor 2^31 + 1 to a negative class: under jit they poison with NaN."""
    x, w, _, _ = _problem(n=6, h=4, v=7, salt=9)
    wrapped = np.array([1, 2, 3, 4, 5, 6], np.uint32)
    wrapped[1], wrapped[2] = 2**32 - 100, 2**31 + 1
    with pytest.raises(ValueError, match="target out of range"):
        lj.linear_cross_entropy(x, w, wrapped, backend=backend)
    run = jax.jit(lambda y: lj.linear_cross_entropy(x, w, y, reduction="none", backend=backend))
    none = np.asarray(run(jnp.asarray(wrapped)))
    assert np.isnan(none[[1, 2]]).all() and np.isfinite(none[[0, 3, 4, 5]]).all()


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_fp16_mean_gradients_survive_loss_scaling(op):
    """fp16 "mean" over many tokens: the fused forward must not fold 1/N into the fp16 logit
    gradients (p/N underflows) before a loss scale (here 2^16) arrives in backward. The
    scaled-and-unscaled gradients keep the error of the unfused path ("sum" scaled outside)."""
    n, h, v = 32768, 8, 64
    rng = np.random.default_rng([SEED, 10])
    f16 = lambda a: jnp.asarray(a, jnp.float16)
    x = f16(rng.standard_normal((n, h)))
    w = f16(rng.standard_normal((v, h)) * 0.5)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    xt, wt = f16(rng.standard_normal((n, h))), f16(rng.standard_normal((v, h)) * 0.5)
    # everything as arguments: closed-over arrays would be constant-folded by XLA (slow)
    if op == "linear_cross_entropy":
        f = lambda x, w, xt, wt, y, red: lj.linear_cross_entropy(x, w, y, reduction=red,
                                                                 backend="xla")
    else:
        f = lambda x, w, xt, wt, y, red: lj.linear_jsd(x, w, xt, wt, y, reduction=red,
                                                       backend="xla")
    args = (x, w, xt, wt, y)
    scaled = jax.jit(jax.grad(lambda *a: 65536.0 * f(*a, "mean"), argnums=(0, 1)))(*args)
    unfused = jax.jit(jax.grad(lambda *a: (65536.0 / n) * f(*a, "sum"), argnums=(0, 1)))(*args)
    for got, want in zip(scaled, unfused):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.isfinite(got).all()
        assert np.linalg.norm(got - want) <= 2e-3 * np.linalg.norm(want)


# ---------------------------------------------------------------- GPU lowering, on CPU
def _lower_for_cuda(n, h, v, dtype=jnp.bfloat16, **kw):
    s = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)

    def f(x, w, b):
        out = lj.linear_cross_entropy(x, w, jnp.zeros((n,), jnp.int32), linear_bias=b,
                                      backend="pallas", interpret=False, **kw)
        return out[0].sum() + out[1].sum() if isinstance(out, tuple) else out.sum()

    traced = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).trace(s(n, h), s(v, h), s(v))
    return traced.lower(lowering_platforms=("cuda",)).as_text()




@pytest.mark.parametrize("n,h,v", [(16384, 4096, 128256), (8192, 2304, 256000)])
def test_pallas_lowers_to_triton_at_the_target_shapes(n, h, v):
    """The kernels lower through Pallas' Triton backend (power-of-two blocks, only supported
    primitives, 64-bit offsets where a chunk passes 2³² bytes) with the GPU defaults and a
    persistent grid; lowering needs no GPU. Abstract shapes: nothing is allocated."""
    hlo = _lower_for_cuda(n, h, v, grid_size=132)
    assert "xla.gpu.triton" in hlo
    # a whole-batch chunk whose logits pass 2**32 bytes: Pallas must switch to 64-bit offsets
    assert "xla.gpu.triton" in _lower_for_cuda(n, h, v, chunk_size=n)


@pytest.mark.parametrize("split", [dict(), dict(row_split=2), dict(row_split=4, row_sync=False),
                                   dict(row_split=4, grid_size=3)], ids=str)
def test_pallas_lowers_to_triton_with_every_option(split):
    """Whole rows; rows split over programs that wait for each other (one launch per call, the
    only kernel with atomics); split rows in two launches per call, asked for or because fewer
    programs than segments could not all run at once (a wait would never end)."""
    tuning = dict(chunk_size=128, block_rows=2, block_v=256, grid_size=7)
    hlo = _lower_for_cuda(300, 64, 1000, reduction="none", return_lse=True, z_loss=1e-3,
                          label_smoothing=0.1, softcap=30.0, **{**tuning, **split})
    one_launch = split.get("row_split", 1) > 1 and split.get("row_sync", True) and \
        split.get("grid_size", 7) >= split["row_split"]
    two = split.get("row_split", 1) > 1 and not one_launch
    # forward and gradient kernels, full and tail chunks (twice as many launches split in two)
    assert hlo.count("xla.gpu.triton") >= (8 if two else 4)
    assert ("atomic" in hlo) == one_launch
    assert "xla.gpu.triton" in _lower_for_cuda(300, 64, 1000, chunk_size=128, fp32_logits=True)


@pytest.mark.parametrize("kw", [dict(), dict(fp32_logits=True), dict(block_v=4),
                                dict(block_v=16, row_split=128)], ids=str)
def test_pallas_lowers_to_triton_at_an_odd_vocabulary(kw):
    """V = 1001: the padded logits (1008 wide) with the gradient stored over the whole width."""
    hlo = _lower_for_cuda(300, 64, 1001, chunk_size=128, **kw)
    assert hlo.count("xla.gpu.triton") >= 2  # the gradient kernels of the full and tail chunks


# --------------------------------------------------------------------- global_token_count
def test_global_token_count_with_class_weights_never_clamps_a_bad_label():
    """weight[labels] would clamp an out-of-range label to the last class in JAX: concrete
    labels raise instead, traced ones give a NaN count (as the loss does)."""
    w = jnp.asarray([0.5, 2.0, 1.0, 4.0])
    good = jnp.asarray([0, 3, -100, 1, 3])
    assert float(lj.global_token_count(good, weight=w)) == 0.5 + 4.0 + 2.0 + 4.0
    assert float(lj.global_token_count(good)) == 4.0
    for bad in (4, -2):
        labels = good.at[1].set(bad)
        with pytest.raises(ValueError, match=r"target out of range: .*\[0, 4\)"):
            lj.global_token_count(labels, weight=w)
        assert np.isnan(float(jax.jit(lambda y: lj.global_token_count(y, weight=w))(labels)))
    assert float(jax.jit(lambda y: lj.global_token_count(y, weight=w))(good)) == 10.5
    with pytest.raises(ValueError, match="must be 1-D"):
        lj.global_token_count(good, weight=w[None])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs JAX on a GPU")
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_few_row_gemms_round_once(rows):
    """The chunk GEMMs of a batch of a few tokens (the logits x·Wᵀ and dX = dz·W in bf16): XLA's
    GPU took a split-K Triton GEMM for 1 row whose partial sums were rounded to bf16 before
    being added (parity suite, N = 1: the JAX backends' dX 3x the naive error). Each result
    must be the float64 product rounded once, up to fp32 accumulation: at most 1 ulp off."""
    from logitless import _jax_common as common
    rng = np.random.default_rng([SEED, rows, 61])
    for k, m in ((61, 16), (4099, 64)):
        a = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, m)), jnp.bfloat16)  # a [V, H] weight, V = k
        exact = np.asarray(a, np.float64) @ np.asarray(w, np.float64)
        once = np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float64)
        for got in (common.grad_input(a, w, "vh"), common.logits(a, w.T, "vh")):
            got = np.asarray(got.astype(jnp.float32), np.float64)
            ulp = np.abs(once) * 2.0 ** -7
            assert np.all(np.abs(got - once) <= ulp + 1e-30), (k, m, np.abs(got - once).max())


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_pallas_kernels_take_ptx_exp_on_a_gpu_and_jnp_elsewhere(op):
    """Inside the Pallas kernels compiled for a GPU, every per-element exp / log of the shared
    math is one PTX ``ex2.approx.ftz`` / ``lg2.approx`` (``_launch.PTX_MATH``: Pallas would call
    libdevice's ~15-20-instruction expf / logf, and the JSD passes were issue-bound on them);
    in interpret mode (off a GPU), which cannot run inline assembly, none is."""
    x, w, y = _problem(n=9, h=8, v=37)[:3]
    if op == "linear_jsd":
        f = lambda x, w: lj.linear_jsd(x, w, x, w * 0.5, y, beta=0.5, backend="pallas")  # noqa
    else:
        f = lambda x, w: lj.linear_cross_entropy(x, w, y, backend="pallas")  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(x, w).jaxpr
    kernels = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    assert kernels
    asm = [e.params["asm"] for k in kernels for e in jaxpr_eqns(k.params["jaxpr"])
           if e.primitive.name == "elementwise_inline_asm_p"]
    if jax.default_backend() == "gpu":
        # exps flush subnormal results (the bare MUFU.EX2); logs keep subnormal arguments
        assert any(a.startswith("ex2.approx.ftz.f32 ") for a in asm), asm
        assert all(a.startswith(("ex2.approx.ftz.f32 ", "lg2.approx.f32 ")) for a in asm), asm
    else:
        assert asm == []
