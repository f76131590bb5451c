"""JAX backends of linear JSD (xla, pallas) and the naive jnp path, joining the shared harness."""
from __future__ import annotations

import math

import numpy as np

import op_linear_jsd
from harness import Backend, cached_jit, register, tier_takes

OP = "linear_jsd"


def jax_inputs(case, inp):
    import jax.numpy as jnp
    a = lambda v, dt: jnp.asarray(np.asarray(v, np.float32), jnp.dtype(dt))
    return dict(xs=a(inp.xs, case.dtype), ws=a(inp.ws, case.dtype), xt=a(inp.xt, case.t_dtype),
                wt=a(inp.wt, case.t_dtype),
                y=None if inp.y is None else jnp.asarray(inp.y.astype(np.int32)),
                g=jnp.asarray(np.asarray(inp.grad_output, np.float32)))


def run_vjp(key, loss_fn, arrs):
    """jit(vjp) of ``loss_fn(xs, ws, xt, wt, y)`` w.r.t. the student, with the case cotangent,
    compiled once per ``key`` (:func:`harness.cached_jit`); the teacher's cotangents must come
    back zero."""
    import jax

    def build():
        def go(xs, ws, xt, wt, y, g):
            loss, vjp = jax.vjp(lambda a, b, c, d: loss_fn(a, b, c, d, y), xs, ws, xt, wt)
            return (loss,) + vjp(g.astype(loss.dtype))
        return go

    a = arrs
    loss, dx, dw, dxt, dwt = cached_jit(key, build)(a["xs"], a["ws"], a["xt"], a["wt"], a["y"],
                                                    a["g"])
    assert not np.any(np.asarray(dxt, np.float32)) and not np.any(np.asarray(dwt, np.float32)), \
        "the teacher must get no gradient"
    f64 = lambda v: np.asarray(v, np.float64)
    return dict(loss=f64(loss), dx=f64(dx), dw=f64(dw))


def jsd_runner(backend, **fixed_tuning):
    def run(case, inp):
        import logitless.jax as lj
        tuning = dict(fixed_tuning)
        if case.chunk_size:
            tuning["chunk_size"] = case.chunk_size

        def loss_fn(xs, ws, xt, wt, y):
            return lj.linear_jsd(xs, ws, xt, wt, y, beta=case.beta, temperature=case.temperature,
                                 ignore_index=inp.ignore_index, reduction=case.reduction,
                                 hard_loss_weight=case.hard_loss_weight, backend=backend,
                                 **tuning)
        key = ("jsd", backend, tuple(sorted(tuning.items())), case, inp.ignore_index)
        return run_vjp(key, loss_fn, jax_inputs(case, inp))
    return run


def _half_gemm_fp32_logits(x, w):
    """x @ w.T with a float32 result from input-dtype operands; its VJP rounds the logits'
    gradient to the input dtype for the dX / dW GEMMs (see op_linear_jsd)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def f(x, w):
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, dz):
        x, w = res
        d = dz.astype(x.dtype)
        return (jnp.dot(d, w, preferred_element_type=jnp.float32).astype(x.dtype),
                jnp.dot(d.T, x, preferred_element_type=jnp.float32).astype(w.dtype))

    f.defvjp(fwd, bwd)
    return f(x, w)


def naive_jax_jsd(case, inp):
    """A careful user's version (Liger's recipe, as naive-torch): fp32 logits, log_softmax,
    the generalized JSD by logsumexp, jax.vjp."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def loss_fn(xs, ws, xt, wt, y):
        zs = _half_gemm_fp32_logits(xs, ws)
        zt = lax.stop_gradient(jnp.dot(xt, wt.T, preferred_element_type=jnp.float32))
        logq = jax.nn.log_softmax(zs / case.temperature, axis=-1)
        logp = jax.nn.log_softmax(zt / case.temperature, axis=-1)
        q, p = jnp.exp(logq), jnp.exp(logp)
        b = case.beta
        if b == 0:
            tok = jnp.sum(p * (logp - logq), -1)
        elif b == 1:
            tok = jnp.sum(q * (logq - logp), -1)
        else:
            logm = jnp.logaddexp(logq + math.log(1 - b), logp + math.log(b))
            tok = b * jnp.sum(p * (logp - logm), -1) + (1 - b) * jnp.sum(q * (logq - logm), -1)
        n = zs.shape[0]
        mask = jnp.ones(n) if y is None else (y != inp.ignore_index).astype(jnp.float32)
        if case.hard_loss_weight:
            ys = jnp.where(y != inp.ignore_index, y, 0)
            ce = -jnp.take_along_axis(jax.nn.log_softmax(zs, -1), ys[:, None], -1)[:, 0]
            tok = tok + case.hard_loss_weight * ce
        tok = tok * mask
        if case.reduction == "none":
            return tok
        if case.reduction == "sum":
            return tok.sum()
        return tok.sum() / jnp.maximum(mask.sum(), 1.0)
    return run_vjp(("naive-jsd", case, inp.ignore_index), loss_fn, jax_inputs(case, inp))


def pallas_test_tuning():
    """Small tiles on CPU so the interpreted kernels split rows into segments of two column
    blocks, with a ragged (or wholly masked) last block; on a GPU the defaults are tested."""
    import jax
    return {} if jax.default_backend() == "gpu" else \
        dict(block_rows=4, block_v=32, segment_size=64)


def pallas_runner(case, inp):
    return jsd_runner("pallas", **pallas_test_tuning())(case, inp)


register(Backend("naive-jax", naive_jax_jsd, naive="naive-jax", requires=("jax",), op=OP))
register(Backend("xla", jsd_runner("xla"), naive="naive-jax", requires=("jax",), op=OP,
                 takes=tier_takes(op_linear_jsd.OP)))
register(Backend("pallas", pallas_runner, naive="naive-jax", requires=("jax",), op=OP,
                 takes=tier_takes(op_linear_jsd.OP)))
