"""JAX backends of linear cross-entropy (xla, pallas) and the naive jnp path, joining the shared harness."""
from __future__ import annotations

import numpy as np

from harness import (Backend, cached_jit, dtype_reduction_cover, interpreted, register,
                     tier_takes)
from op_linear_cross_entropy import OP


def _jax_inputs(case, inp):
    import jax.numpy as jnp
    dt = jnp.dtype(case.dtype)
    a = lambda v, dtype=dt: None if v is None else jnp.asarray(np.asarray(v, np.float32), dtype)
    return dict(x=a(inp.x), w=a(inp.w), b=a(inp.bias), y=jnp.asarray(inp.y.astype(np.int32)),
                cw=a(inp.class_weight, jnp.float32), g=a(inp.grad_output, jnp.float32),
                gl=a(inp.grad_lse, jnp.float32))


def _run_vjp(case, loss_and_lse, arrs, key=None):
    """jit(vjp) of ``loss_and_lse(x, w, b, y, cw) -> (loss, lse)`` with the case's cotangents,
    compiled once per ``key`` (:func:`harness.cached_jit`; None: every call)."""
    import jax

    def build():
        def go(x, w, b, y, cw, g, gl):
            def f(x, w, b):
                loss, lse = loss_and_lse(x, w, b, y, cw)
                return (loss, lse) if case.lse_grad else loss
            out, vjp = jax.vjp(f, x, w, b)
            dx, dw, db = vjp((g, gl) if case.lse_grad else g)
            return out, dx, dw, db
        return go

    a = arrs
    prog = jax.jit(build()) if key is None else cached_jit(key, build)
    out, dx, dw, db = prog(a["x"], a["w"], a["b"], a["y"], a["cw"], a["g"], a["gl"])
    f64 = lambda v: np.asarray(v, np.float64)
    loss = out[0] if case.lse_grad else out
    r = dict(loss=f64(loss), dx=f64(dx), dw=f64(dw))
    if case.lse_grad:
        r["lse"] = f64(out[1])
    if case.bias:
        r["db"] = f64(db)
    return r


def jax_backend_runner(backend, **fixed_tuning):
    def run(case, inp):
        import logitless.jax as lj
        tuning = dict(fixed_tuning)
        if case.chunk_size:
            tuning["chunk_size"] = case.chunk_size

        def loss_and_lse(x, w, b, y, cw):
            out = lj.linear_cross_entropy(
                x, w, y, linear_bias=b, weight=cw, reduction=case.reduction,
                label_smoothing=case.label_smoothing, z_loss=case.z_loss, softcap=case.softcap,
                return_lse=case.lse_grad, backend=backend, ignore_index=case.ignore_index,
                **tuning)
            return out if case.lse_grad else (out, None)
        key = ("ce", backend, tuple(sorted(tuning.items())), case)
        return _run_vjp(case, loss_and_lse, _jax_inputs(case, inp), key)
    return run


def _materialized(a):
    """``a`` rounded to its dtype's grid, in value and in gradient (reduce_precision's transpose
    rounds the cotangent too). XLA's default ``xla_allow_excess_precision`` lets the CPU compiler
    keep a bf16 GEMM's output (and the logit gradient feeding the next GEMM) in float32 when a
    convert follows; on a GPU the GEMMs materialize them in bf16. This pins the GPU behaviour,
    i.e. the precision the array types promise, on every platform."""
    import jax.numpy as jnp
    from jax import lax
    fi = jnp.finfo(a.dtype)
    return lax.reduce_precision(a, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def naive_jax(case, inp):
    """What a user writes without this library: logits materialized in the input dtype,
    upcast to float32 for the loss, gradients by autodiff."""
    import jax
    import jax.numpy as jnp

    def loss_and_lse(x, w, b, y, cw):
        logits = x @ w.T
        if b is not None:
            logits = logits + b
        c = _materialized(logits).astype(jnp.float32)
        if case.softcap:
            c = case.softcap * jnp.tanh(c / case.softcap)
        logp = jax.nn.log_softmax(c, axis=-1)
        lse = jax.nn.logsumexp(c, axis=-1)
        v = c.shape[-1]
        mask = y != case.ignore_index
        ys = jnp.where(mask, y, 0)
        cwv = jnp.ones(v, jnp.float32) if cw is None else cw
        omega = mask * cwv[ys]
        # selected, not multiplied by ω = 0: an ignored token's class may have logp = -inf
        nll = jnp.where(mask, -jnp.take_along_axis(logp, ys[:, None], axis=-1)[:, 0], 0.0)
        eps = case.label_smoothing
        tok = (1 - eps) * omega * nll + case.z_loss * omega * lse ** 2
        if eps:
            tok = tok - mask * eps * (logp * cwv).sum(-1) / v
        if case.reduction == "none":
            loss = tok
        elif case.reduction == "sum":
            loss = tok.sum()
        else:
            loss = tok.sum() / jnp.maximum(omega.sum(), 1e-30)
        return loss, lse
    return _run_vjp(case, loss_and_lse, _jax_inputs(case, inp), ("naive-ce", case))


register(Backend("naive-jax", naive_jax, naive="naive-jax", requires=("jax",)))
register(Backend("xla", jax_backend_runner("xla"), naive="naive-jax", requires=("jax",),
                 takes=tier_takes(OP)))
# Small blocks on CPU so the interpreted kernel walks several V blocks with a ragged last one,
# several row blocks with a ragged last one, on a persistent grid of 3 programs (so programs
# get different numbers of row blocks); on a GPU the defaults are tested.
def _pallas_test_tuning():
    import jax
    return {} if jax.default_backend() == "gpu" else dict(block_rows=4, block_v=32, grid_size=3)


def pallas_runner(case, inp):
    return jax_backend_runner("pallas", **_pallas_test_tuning())(case, inp)


register(Backend("pallas", pallas_runner, naive="naive-jax", requires=("jax",),
                 takes=tier_takes(OP)))


# Rows split over 4 programs (16-column blocks: at V = 97, 7 blocks make 4 segments of 2, 2, 2
# and 1 ragged block; at V = 61, 4 of 1): on a GPU one launch whose programs wait for each
# other per row (FUSED), interpreted the two-launch form (the same merge of the partials).
def pallas_split_runner(case, inp):
    import jax
    small = {} if jax.default_backend() == "gpu" else dict(block_rows=2, grid_size=3)
    return jax_backend_runner("pallas", row_split=4, block_v=16, **small)(case, inp)


def _split_cases(case) -> bool:
    """On a GPU every case; interpreted (CI time) cases that hold each dtype and each
    reduction once (``harness.dtype_reduction_cover``), the masked-vocabulary and one-token
    cases, and the chunked ones with smoothing."""
    import jax
    if jax.default_backend() == "gpu" or not interpreted():
        return True
    return case.id in dtype_reduction_cover(OP.cases()) or case.masked or case.n == 1 or bool(
        case.chunk_size and case.label_smoothing)


register(Backend("pallas-split", pallas_split_runner, naive="naive-jax", requires=("jax",),
                 takes=_split_cases))
