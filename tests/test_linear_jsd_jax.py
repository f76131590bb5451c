"""The JAX linear-JSD front door beyond the shared harness: jit / grad / value_and_grad /
vmap, the Flax (H, V) layout without a copy, zero teacher cotangents, argument errors naming
the argument, out-of-range targets (eager error; NaN under jit), and the Pallas kernel's
Triton lowering for a GPU at the acceptance shape (checked on CPU, nothing allocated)."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import logitless.jax as lj  # noqa: E402
from logitless.specs import linear_jsd as spec  # noqa: E402

from harness import SEED  # noqa: E402
from helpers import assert_close_rel, gemm_shapes, jaxpr_eqns  # noqa: E402

BACKENDS = ["xla", "pallas"]
TOL = 2e-5  # float32 inputs against the float64 spec
PALLAS_SMALL = dict(block_rows=2, block_v=16, segment_size=32)  # V = 41: 32 + 9 columns


def _tuning(backend, **kw):
    return {**(PALLAS_SMALL if backend == "pallas" and jax.default_backend() != "gpu" else {}),
            **kw}


def _problem(n=23, hs=12, ht=9, v=41, *, batch=(), salt=0, dtype=jnp.float32):
    rng = np.random.default_rng([SEED, salt, n, hs, v])
    xs = rng.standard_normal((*batch, n, hs))
    ws = rng.standard_normal((v, hs)) * (2.0 / np.sqrt(hs))
    xt = rng.standard_normal((*batch, n, ht))
    wt = rng.standard_normal((v, ht)) * (2.0 / np.sqrt(ht))
    y = rng.integers(0, v, (*batch, n))
    y[rng.random((*batch, n)) < 0.2] = -100
    j = lambda a: jnp.asarray(a, dtype)
    return j(xs), j(ws), j(xt), j(wt), jnp.asarray(y, jnp.int32)


def _ref(xs, ws, xt, wt, y, g=None, **opts):
    f64 = lambda a: np.asarray(a, np.float64)
    return spec.reference(f64(xs), f64(ws), f64(xt), f64(wt), None if y is None else np.asarray(y),
                          options=spec.LinearJSDOptions(**opts), grad_output=g)


def _close(a, r, tol=TOL):
    assert_close_rel(a, r, tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_value_and_grad_and_teacher_cotangents(backend):
    xs, ws, xt, wt, y = _problem()
    opts = dict(beta=0.3, temperature=2.0, hard_loss_weight=0.25)
    # chunks of 8 tokens for dX / dW, logits in sub-chunks of 3 (ragged at both levels)
    f = lambda xs, ws, xt, wt: lj.linear_jsd(xs, ws, xt, wt, y, backend=backend, chunk_size=8,
                                             logits_chunk_size=3, **opts, **_tuning(backend))
    loss, (dx, dw, dxt, dwt) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(xs, ws, xt, wt)
    ref = _ref(xs, ws, xt, wt, y, **opts)
    _close(loss, ref["loss"])
    _close(dx, ref["dx"])
    _close(dw, ref["dw"])
    assert not np.any(np.asarray(dxt)) and not np.any(np.asarray(dwt))
    assert loss.dtype == jnp.float32 and dx.dtype == xs.dtype and dw.shape == ws.shape
    np.testing.assert_allclose(np.asarray(jax.grad(f)(xs, ws, xt, wt)), np.asarray(dx),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [np.nan])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens_get_zero_gradient_whatever_their_cotangent(backend, bad):
    """"none" losses with an inf or NaN cotangent at ignored tokens: their gradient is 0 (as
    for linear cross-entropy, and as the Triton kernel always did), bit for bit the result of
    a 0 cotangent there; the backward had multiplied the cotangent by the token's 0 mask."""
    xs, ws, xt, wt, y = _problem(n=13, salt=7)
    y = y.at[1::3].set(-100).at[0].set(3)
    ign = np.asarray(y) == -100
    g0 = np.where(ign, 0.0, np.random.default_rng([SEED, 8]).random(13)).astype(np.float32)
    f = lambda xs, ws: lj.linear_jsd(xs, ws, xt, wt, y, reduction="none", beta=0.3,
                                     hard_loss_weight=0.2, backend=backend, chunk_size=5,
                                     **_tuning(backend))
    _, pullback = jax.vjp(f, xs, ws)
    got = pullback(jnp.asarray(np.where(ign, np.float32(bad), g0)))
    for a, b in zip(got, pullback(jnp.asarray(g0))):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_plan_pads_to_equal_chunks(backend, reduction, monkeypatch):
    """A plan from the memory budget: equal chunks, the tokens padded to a whole number of
    them (no ragged last chunk); the padding must not reach the loss or the gradients."""
    from logitless import _jax_common
    n, v = 37, 100
    xs, ws, xt, wt, y = _problem(n=n, v=v, salt=7)
    # float32 inputs: 12 bytes per logit for pallas (gradient + two logits), 40 for xla (its
    # eight working arrays): budgets that make 24-token chunks, then 2 × 24 = 48 (11 padded)
    budget = 24 * v * (12 if backend == "pallas" else 40)
    padded = []
    pad = _jax_common.pad_tokens
    monkeypatch.setattr(_jax_common, "pad_tokens", lambda a, m, value=0, axis=0: (
        padded.append((None if a is None else a.shape[axis], m)), pad(a, m, value, axis))[1])
    opts = dict(beta=0.3, temperature=2.0, hard_loss_weight=0.5, reduction=reduction)
    g = np.random.default_rng(SEED).standard_normal(n) if reduction == "none" else None
    f = lambda xs, ws: lj.linear_jsd(xs, ws, xt, wt, y, backend=backend, memory_budget=budget,
                                     **opts, **_tuning(backend))
    loss, vjp = jax.vjp(f, xs, ws)
    dx, dw = vjp(jnp.ones_like(loss) if g is None else jnp.asarray(g, loss.dtype))
    assert (n, 48) in padded, padded
    ref = _ref(xs, ws, xt, wt, y, g, **opts)
    _close(loss, ref["loss"])
    _close(dx, ref["dx"])
    _close(dw, ref["dw"])
    assert loss.shape == (() if g is None else (n,)) and dx.shape == xs.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_none_reduction_keeps_the_batch_shape(backend, beta):
    """(B, T, H) inputs, no targets: per-token losses come back (B, T) and per-token
    cotangents reach the gradient (the backward recomputes with them)."""
    xs, ws, xt, wt, _ = _problem(n=7, batch=(3,), salt=1)
    g = jnp.asarray(np.random.default_rng([SEED, 2]).standard_normal((3, 7)), jnp.float32)

    def f(xs, ws):
        loss = lj.linear_jsd(xs, ws, xt, wt, beta=beta, temperature=0.7, reduction="none",
                             backend=backend, chunk_size=5, **_tuning(backend))
        assert loss.shape == (3, 7)
        return jnp.sum(loss * g)

    dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(xs, ws)
    ref = _ref(xs.reshape(21, -1), ws, xt.reshape(21, -1), wt, None, np.asarray(g).reshape(-1),
               beta=beta, temperature=0.7, reduction="none")
    _close(dx.reshape(21, -1), ref["dx"])
    _close(dw, ref["dw"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_a_leading_batch_axis(backend):
    """Each sequence its own mean; dW per sequence."""
    xs, ws, xt, wt, y = _problem(n=9, batch=(2,), salt=3)
    f = lambda xs, ws, xt, y: lj.linear_jsd(xs, ws, xt, wt, y, backend=backend, chunk_size=4,
                                            **_tuning(backend))
    loss, (dx, dw) = jax.jit(jax.vmap(jax.value_and_grad(f, argnums=(0, 1)),
                                      in_axes=(0, None, 0, 0)))(xs, ws, xt, y)
    assert loss.shape == (2,) and dw.shape == (2, *ws.shape)
    for i in range(2):
        ref = _ref(xs[i], ws, xt[i], wt, y[i])
        _close(loss[i], ref["loss"])
        _close(dx[i], ref["dx"])
        _close(dw[i], ref["dw"])


@pytest.mark.parametrize("v", [40, 41])
@pytest.mark.parametrize("backend", BACKENDS)
def test_flax_hv_layout_uses_the_kernels_as_they_are(backend, v):
    xs, ws, xt, wt, y = _problem(v=v, salt=4)
    ks, kt = jnp.asarray(np.asarray(ws).T), jnp.asarray(np.asarray(wt).T)  # (H, V) kernels
    f = lambda xs, ks: lj.linear_jsd(xs, ks, xt, kt, y, weight_layout="hv", backend=backend,
                                     chunk_size=8, **_tuning(backend))
    vg = jax.value_and_grad(f, argnums=(0, 1))
    loss, (dx, dk) = jax.jit(vg)(xs, ks)
    ref = _ref(xs, ws, xt, wt, y)
    assert dk.shape == ks.shape
    _close(loss, ref["loss"])
    _close(dx, ref["dx"])
    _close(dk.T, ref["dw"])
    vp = -(-v // 8) * 8  # the padded vocabulary's weights must not move either
    shapes = {ks.shape, ks.shape[::-1], kt.shape, kt.shape[::-1]} | {
        (k.shape[0], vp) for k in (ks, kt)} | {(vp, k.shape[0]) for k in (ks, kt)}
    moved = [e for e in jaxpr_eqns(jax.make_jaxpr(vg)(xs, ks).jaxpr)
             if e.primitive.name in ("transpose", "copy", "copy_p")
             and any(tuple(getattr(v.aval, "shape", ())) in shapes for v in e.invars)]
    assert not moved, moved


@pytest.mark.parametrize("layout", ["vh", "hv"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_vocabularies_run_every_gemm_on_aligned_parts(backend, layout):
    """V = 61: no GEMM (student and teacher logits, dX, dW) has V as a dimension; they run on
    the vocabulary padded to 64 (see tests/test_jax_api.py's test of the same name)."""
    xs, ws, xt, wt, y = _problem(v=61, salt=8)
    t = (lambda a: a) if layout == "vh" else (lambda a: jnp.asarray(np.asarray(a).T))
    f = lambda xs, ks: lj.linear_jsd(xs, ks, xt, t(wt), y, weight_layout=layout,
                                     backend=backend, chunk_size=8, **_tuning(backend))
    vg = jax.value_and_grad(f, argnums=(0, 1))
    dims = {d for shape in gemm_shapes(jax.make_jaxpr(vg)(xs, t(ws)).jaxpr) for d in shape}
    assert 61 not in dims and 64 in dims, sorted(dims)
    loss, (dx, dk) = jax.jit(vg)(xs, t(ws))
    ref = _ref(xs, ws, xt, wt, y)
    _close(loss, ref["loss"])
    _close(dx, ref["dx"])
    _close(dk if layout == "vh" else dk.T, ref["dw"])


@pytest.mark.parametrize("beta, block_v, segment", [(0.0, 4, 16), (0.5, 4, 16), (0.5, 2, 2)])
def test_pallas_kernels_ignore_and_zero_the_padded_vocabulary(beta, block_v, segment):
    """The Pallas JSD kernels on logits padded past V with NaN in the padded columns: loss as
    unpadded, dz the same in the real columns and exactly 0 in the padded ones (with 2-column
    segments the gradient launch has a segment more than the statistics launches)."""
    from logitless.pallas_kernels.linear_jsd import PallasHead
    n, v, vp = 9, 61, 64
    rng = np.random.default_rng([SEED, 32])
    zs, zt = (jnp.asarray(rng.standard_normal((n, v)) * 2, jnp.float32) for _ in range(2))
    pad = lambda z: jnp.concatenate([z, jnp.full((n, vp - v), jnp.nan, z.dtype)], axis=1)
    y = jnp.asarray(rng.integers(-1, v, n), jnp.int32)
    coef = jnp.asarray(rng.random(n), jnp.float32)
    head = PallasHead(kind=spec.LinearJSDOptions(beta=beta).kind, beta=beta, temperature=1.5,
                      hard_w=0.3, block_rows=2, block_v=block_v, num_warps=4, num_stages=1,
                      segment_size=segment, interpret=True)
    want = head.loss_grad(zs, zt, y, coef, jnp.bfloat16, v=v)
    got = head.loss_grad(pad(zs), pad(zt), y, coef, jnp.bfloat16, v=v)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    dz = np.asarray(got[1].astype(jnp.float32))
    np.testing.assert_array_equal(dz[:, :v], np.asarray(want[1].astype(jnp.float32)))
    assert (dz[:, v:] == 0).all(), dz[:, v:]


def _args():
    xs, ws, xt, wt, y = _problem(n=5, hs=4, ht=3, v=7, salt=6)
    return dict(student_input=xs, student_weight=ws, teacher_input=xt, teacher_weight=wt,
                target=y)


BAD = [
    (dict(student_input=np.arange(20).reshape(5, 4)), TypeError, "student_input must be float32"),
    (dict(teacher_weight=[[0.0] * 3] * 7), TypeError, "teacher_weight must be a jax.Array"),
    (dict(student_weight=jnp.zeros((7, 4), jnp.bfloat16)), TypeError, "student_weight dtype"),
    (dict(teacher_weight=jnp.zeros((7, 3), jnp.float16)), TypeError, "teacher_weight dtype"),
    (dict(target=jnp.zeros((5,))), TypeError, "target must hold integer"),
    (dict(target=jnp.zeros((4,), jnp.int32)), ValueError, "target must have shape"),
    (dict(teacher_weight=jnp.zeros((6, 3))), ValueError, "vocabulary mismatch"),
    (dict(teacher_input=jnp.zeros((4, 3))), ValueError, "leading shape"),
    (dict(student_weight=jnp.zeros((7, 5))), ValueError, "hidden size mismatch"),
    (dict(beta=1.5), ValueError, "beta must be <= 1.0"),
    (dict(temperature=0.0), ValueError, "temperature must be > 0"),
    (dict(target=None, hard_loss_weight=0.5), ValueError, "hard_loss_weight > 0 needs target"),
    (dict(ignore_index=2**40), ValueError, "ignore_index must fit in int32"),
    (dict(weight_layout="vhh"), ValueError, "weight_layout must be"),
    # (H, V) kernels: the message names the layout and the shape as given (here V, H swapped)
    (dict(weight_layout="hv"), ValueError, "student_weight (H, V) has shape (7, 4)"),
    (dict(backend="triton"), ValueError, "backend must be None or one of"),
    (dict(backend="xla", block_v=64), TypeError, "unknown tuning keyword(s) ['block_v']"),
    (dict(tempreature=2.0), TypeError, "linear_jsd() got an unexpected keyword argument "
                                       "'tempreature' (did you mean 'temperature'?)"),
    # the wording PyTorch's linear_jsd gives its vocab-parallel keywords (logitless/_keywords)
    (dict(axis_name="tp"), TypeError, "linear_jsd() got an unexpected keyword argument "
                                      "'axis_name' (linear_jsd has no vocab-parallel path "
                                      "(axis_name= is a keyword of linear_cross_entropy): give "
                                      "it the whole student and teacher heads)"),
    (dict(backend="pallas", block_v=48), ValueError, "block_v must be a power of two"),
    (dict(backend="pallas", fp32_logits=1), TypeError, "fp32_logits must be a bool"),
    (dict(backend="pallas", segment_size=3000), ValueError, "segment_size must be a power of two"),
    (dict(backend="pallas", grid_size=4), TypeError, "unknown tuning keyword(s) ['grid_size']"),
]


@pytest.mark.parametrize("change,exc,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_raise_naming_the_argument(change, exc, message):
    args = {**_args(), **change}
    with pytest.raises(exc) as info:
        lj.linear_jsd(args.pop("student_input"), args.pop("student_weight"),
                      args.pop("teacher_input"), args.pop("teacher_weight"), **args)
    assert message in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_targets_raise_when_concrete_and_give_nan_under_jit(backend):
    xs, ws, xt, wt, y = _problem(n=12, hs=4, ht=3, v=7, salt=8)
    bad_y = np.asarray(y).astype(np.int64)
    bad_y[2] = 7
    with pytest.raises(ValueError, match=r"target out of range: .*\[0, 7\)"):
        lj.linear_jsd(xs, ws, xt, wt, bad_y, backend=backend)
    y = y.at[3].set(7).at[5].set(-3)
    bad = np.zeros(12, bool)
    bad[[3, 5]] = True

    @jax.jit
    def run(xs, ws, y):
        kw = dict(backend=backend, chunk_size=8, hard_loss_weight=0.5, **_tuning(backend))
        mean, grads = jax.value_and_grad(lambda a, b: lj.linear_jsd(a, b, xt, wt, y, **kw),
                                         argnums=(0, 1))(xs, ws)
        return mean, grads, lj.linear_jsd(xs, ws, xt, wt, y, reduction="none", **kw)

    mean, (dx, dw), none = run(xs, ws, y)
    none = np.asarray(none)
    assert np.isnan(float(mean)) and np.isnan(np.asarray(dw)).any()
    assert np.isnan(none[bad]).all() and np.isfinite(none[~bad]).all()


def _lower_for_cuda(n, hs, ht, v, **kw):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    def f(xs, ws, xt, wt):
        return lj.linear_jsd(xs, ws, xt, wt, jnp.zeros((n,), jnp.int32), backend="pallas",
                             interpret=False, **kw)

    traced = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(s(n, hs), s(v, hs), s(n, ht),
                                                                 s(v, ht))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("opts", [dict(beta=0.5), dict(beta=0.0, temperature=2.0),
                                  dict(beta=1.0, hard_loss_weight=0.5, temperature=0.5),
                                  dict(beta=0.3, hard_loss_weight=0.2, fp32_logits=False)],
                         ids=str)
def test_pallas_lowers_to_triton_at_the_acceptance_shape(opts):
    """N=8192, H=4096, V=128256 (H_t = 5120 for the teacher), bf16, GPU defaults: the
    kernels (one per pass) lower through Pallas' Triton backend without a GPU."""
    hlo = _lower_for_cuda(8192, 4096, 5120, 128256, **opts)
    assert "xla.gpu.triton" in hlo
    passes = ["stats", "sums", "grad"] if 0 < opts["beta"] < 1 else ["stats", "grad"]
    for name in passes:
        assert f"logitless_linear_jsd_{name}" in hlo, name


@pytest.mark.parametrize("block_v", [None, 4])
def test_pallas_lowers_to_triton_at_an_odd_vocabulary(block_v):
    """V = 1001: the padded logits, the gradient launch's grid over the padded width."""
    kw = {} if block_v is None else dict(block_v=block_v, segment_size=4)
    hlo = _lower_for_cuda(300, 64, 48, 1001, beta=0.5, chunk_size=128, **kw)
    assert "logitless_linear_jsd_grad" in hlo


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.3, 1e-3])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equal_heads_give_exactly_zero_at_any_temperature(backend, temperature, beta):
    """Student = teacher: every divergence is 0 and so is its gradient, exactly, whatever T.
    With b − a formed from z/T, a compiler that fuses the multiply into the subtraction (XLA
    on a CPU; Triton on a GPU) left the rounding residual of z/T: loss ±1e-6 at T = 0.3 (a
    negative KL) and gradients up to 0.2 at T = 1e-3. Now d = (z_t − z_s)/T."""
    xs, ws, _, _, y = _problem(salt=5)
    # the teacher as arrays of its own: the same arrays would let XLA merge the two heads
    xt, wt = jnp.array(xs, copy=True), jnp.array(ws, copy=True)
    f = lambda xs, ws, xt, wt: lj.linear_jsd(xs, ws, xt, wt, y, beta=beta,
                                             temperature=temperature, reduction="sum",
                                             backend=backend, **_tuning(backend))
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(xs, ws, xt, wt)
    assert float(loss) == 0.0
    assert not np.asarray(dx).any() and not np.asarray(dw).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [2.0 ** -10, 2.0 ** -17])
def test_far_heads_at_a_low_temperature_keep_the_loss_digits(backend, temperature):
    """0 < β < 1, heads far apart at a low (power-of-two: exactly scaled) temperature: P taken
    as e^(log Q + δ) cancelled two terms of O(|z|/T), so the loss carried ulp(|z|/T): 1.2e-4
    relative at T = 2⁻¹⁰, 1.5e-2 at 2⁻¹⁷. P now comes from the teacher's own statistics
    there."""
    # exact logits (x = I, W = logitsᵀ): an fp32 GEMM's rounding, times 1/T, would be the
    # error measured instead
    rng = np.random.default_rng([SEED, 48])
    eye = np.eye(8, dtype=np.float32)
    zs, zt = (rng.standard_normal((2, 7, 8)) * 2).astype(np.float32)
    opts = dict(beta=0.5, temperature=temperature, reduction="none")
    loss = lj.linear_jsd(jnp.asarray(eye), jnp.asarray(zs), jnp.asarray(eye), jnp.asarray(zt),
                         None, backend=backend, **opts, **_tuning(backend))
    ref = _ref(eye, zs, eye, zt, None, **opts)["loss"]
    err = np.abs(np.asarray(loss, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 1e-6, err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.5, 0.9])
def test_independent_confident_heads_keep_the_jsd_loss(backend, beta):
    """Independent heads of logit std 20 at T = 0.3 (z/T spread ~70, exact logits: x = I):
    P must come from the teacher's own log-softmax where |δ| or |c| >= 1. A mutant taking P as
    e^(log Q + δ) everywhere (mutation review, twenty-second session) passed every other test
    with the loss 2.3e-6 to 5.3e-6 off here (the naive fp32 loss is as rough, so the
    harness's tolerance did not see it); the code is at <= 5e-7 (CPU, up to 2000 seeds)."""
    rng = np.random.default_rng([SEED, 49])
    zs, zt = (rng.standard_normal((2, 97, 8)) * 20).astype(np.float32)
    eye = np.eye(8, dtype=np.float32)
    opts = dict(beta=beta, temperature=0.3, reduction="none")
    loss = lj.linear_jsd(jnp.asarray(eye), jnp.asarray(zs), jnp.asarray(eye), jnp.asarray(zt),
                         None, backend=backend, **opts, **_tuning(backend))
    ref = _ref(eye, zs, eye, zt, None, **opts)["loss"]
    err = np.abs(np.asarray(loss, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 1e-6, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_heads_a_constant_apart_keep_the_jsd_loss(backend):
    """The teacher a constant 5 above the student at T = 2⁻¹⁰ (exact logits: x = I): the
    normalizer gap is ~5e3 while |δ| stays small, and P = e^(log Q + δ) cancelled terms of that
    size (1.5e-4 off): P comes from the teacher's statistics wherever |c| >= 1 too."""
    t = 2.0 ** -10
    rng = np.random.default_rng([SEED, 46])
    zs = (8.0 + 3 * t * rng.standard_normal((6, 41))).astype(np.float32)
    zt = (zs + 5.0 + t * rng.standard_normal((6, 41))).astype(np.float32)
    eye = np.eye(6, dtype=np.float32)
    opts = dict(beta=0.5, temperature=t, reduction="none")
    loss = lj.linear_jsd(jnp.asarray(eye), jnp.asarray(zs.T), jnp.asarray(eye),
                         jnp.asarray(zt.T), None, backend=backend, **opts, **_tuning(backend))
    ref = _ref(eye, zs.T, eye, zt.T, None, **opts)["loss"]
    err = np.abs(np.asarray(loss, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err
