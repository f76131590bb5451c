r"""Vocab-parallel (tensor-parallel) linear cross-entropy for JAX: ``lax.pmax``/``lax.psum``
over a named mesh axis, for use inside ``shard_map``.

Inside the mapped function each device holds an equal contiguous slice of the LM head along V
(``(V/n, H)``, or ``(H, V/n)`` with ``weight_layout="hv"``; the same slice of the bias and class
weights), the same hidden states ``x`` and the same *global* labels. The slice of device ``i``
of the axis is ``[i·V/n, (i+1)·V/n)`` (``lax.axis_index``); global ``V = n·V_local``.
Every device returns the same loss/lse; dX is the full gradient (summed over the axis inside
the VJP), dW/db are the device's slices. Splits are equal (as ``shard_map`` makes them): the axis size
must divide V; uneven splits are a PyTorch-side feature (``vocab_start_index``).

Recipe (``jax.sharding`` + ``shard_map``; ``jax.shard_map`` in jax >= 0.8)::

    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))  # not make_mesh: its default axis
                                                       # types are Explicit in recent JAX
    def loss_fn(x, w, labels):
        return logitless.jax.linear_cross_entropy(x, w, labels, axis_name="tp")
    sharded = jax.shard_map(loss_fn, mesh=mesh, in_specs=(P(), P("tp", None), P()),
                            out_specs=P())
    loss, (dx, dw) = jax.value_and_grad(sharded, argnums=(0, 1))(x, w, labels)

``w`` may live sharded (``jax.device_put(w, NamedSharding(mesh, P("tp", None)))``); ``dw``
comes back with that sharding. With a second, data-parallel axis, shard ``x``/``labels`` on it
and use ``reduction="sum"`` divided by :func:`global_token_count` over that axis.

Per call: the chunked forward computes each device's per-token (lse_r, c_y,r, Σ w·c) with no
collective; then one ``pmax`` of lse_r and one ``psum`` of the stacked per-token rows give the
global lse, target logit (from the owning device, masked: no sentinel), smoothing sum and
token weight. Backward recomputes each chunk, dz from the global lse (the shared
:func:`logitless._jax_common.grad_logits`), and ``psum``\ s each chunk's float32 dX.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _jax_common as common
from .specs import linear_cross_entropy as spec
from .specs.tiling import ChunkPlan, plan_token_chunks

__all__ = ["vocab_parallel_linear_cross_entropy", "global_token_count", "TUNING"]

TUNING = ("chunk_size", "memory_budget")


def _axis_size(axis_name) -> int:
    size = getattr(lax, "axis_size", None)
    return size(axis_name) if size is not None else lax.psum(1, axis_name)


@dataclasses.dataclass(frozen=True)
class _Static:
    opts: spec.LinearCrossEntropyOptions
    plan: ChunkPlan
    v_local: int
    layout: str
    axis_name: object
    # what common._walk_chunks reads
    head: object = None


def _capped(z, bias, softcap):
    z = z.astype(jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)[None, :]
    return common.capped(z, softcap)


def _ownership(st, y):
    """Global V, mask m, own (target in this device's slice), local index, bad targets."""
    v = st.v_local * _axis_size(st.axis_name)
    v0 = lax.axis_index(st.axis_name) * st.v_local
    mask = y != st.opts.ignore_index
    bad = mask & ((y < 0) | (y >= v))
    own = mask & ~bad & (y >= v0) & (y < v0 + st.v_local)
    return v, mask, bad, own, jnp.where(own, y - v0, 0)


def _global_terms(st, x, w, bias, y, cw):
    """Per-token global lse, ω, the per-token loss (N,), Ω and V."""
    n = x.shape[0]
    v, mask, bad, own, y_loc = _ownership(st, y)
    smoothing = st.opts.uses_smoothing
    wv = common.VocabWeight(w, st.layout)  # a local V not a multiple of 8: padded GEMMs

    def body(start, size, carry):
        lse_l, cy_l, wc_l = carry
        c = _capped(wv.trim(wv.logits(common._tokens(x, start, size))), bias, st.opts.softcap)
        yl = common._tokens(y_loc, start, size)
        is_t = lax.broadcasted_iota(jnp.int32, c.shape, 1) == yl[:, None]
        upd = lambda a, val: lax.dynamic_update_slice_in_dim(a, val, start, 0)
        lse_l = upd(lse_l, jax.nn.logsumexp(c, axis=1))
        cy_l = upd(cy_l, jnp.sum(jnp.where(is_t, c, 0.0), axis=1))
        if smoothing:
            wc_l = upd(wc_l, jnp.sum(c, axis=1) if cw is None else
                       jnp.dot(c, cw, precision=lax.Precision.HIGHEST))  # full fp32
        return lse_l, cy_l, wc_l

    zeros = common.zeros_like_axes((n,), jnp.float32, w)  # the chunks' values vary like w
    lse_l, cy_l, wc_l = common._walk_chunks(st, n, body, (zeros, zeros, zeros))
    cy_l = jnp.where(own, cy_l, 0.0)
    wy_l = zeros if cw is None else jnp.where(own, cw[y_loc], 0.0)
    # lse over devices, stable: each lse_r already has its own max
    gmax = lax.stop_gradient(lax.pmax(lse_l, st.axis_name))
    omega_l = jnp.full((), st.v_local, jnp.float32) if cw is None else jnp.sum(cw)
    sums = lax.psum(jnp.concatenate([jnp.stack([jnp.exp(lse_l - gmax), cy_l, wc_l, wy_l]),
                                     jnp.broadcast_to(omega_l, (4, 1))], axis=1), st.axis_name)
    lse = gmax + jnp.log(sums[0, :n])
    m = mask.astype(jnp.float32)
    omega = m if cw is None else sums[3, :n]
    omega = jnp.where(bad, jnp.nan, omega)  # a label outside [0, V): NaN, loud
    big_omega = sums[0, n]
    coefs = _coefs(st, omega, m, big_omega, v)
    wc = sums[2, :n] if smoothing else None
    tok = common.token_loss(lse, sums[1, :n], wc, *coefs)
    return tok, lse, omega, big_omega


def _coefs(st, omega, m, big_omega, v):
    """(b, sm, smo, zw) of the shared per-token math, with the global V and Ω."""
    eps = st.opts.label_smoothing
    sm = m * (eps / v)
    return (1.0 - eps) * omega, sm, sm * big_omega, st.opts.z_loss * omega


def _reduce(st, tok, omega):
    if st.opts.reduction == "none":
        return tok
    total = jnp.sum(tok)
    return total / common.mean_denominator(omega) if st.opts.reduction == "mean" else total


def _grads(st, x, w, bias, y, cw, lse, omega, big_omega, g_tok, h_tok, sum_dx=True):
    """dX (``sum_dx``: summed over the axis here; else each device's part, which an unchecked
    ``shard_map`` sums itself), this device's dW slice and db slice."""
    n = x.shape[0]
    v, mask, _, own, y_loc = _ownership(st, y)
    b, sm, smo, zw = _coefs(st, omega, mask.astype(jnp.float32), big_omega, v)
    wv = common.VocabWeight(w, st.layout)  # a local V not a multiple of 8: padded GEMMs

    def body(start, size, carry):
        dx, dw, db = carry
        tk = lambda a: common._tokens(a, start, size)
        xc = tk(x)
        c = _capped(wv.trim(wv.logits(xc)), bias, st.opts.softcap)
        is_t = (lax.broadcasted_iota(jnp.int32, c.shape, 1) == tk(y_loc)[:, None]) & \
            tk(own)[:, None]
        dz = common.grad_logits(c, tk(lse), is_t, cw, tk(b), tk(sm), tk(smo), tk(zw),
                                tk(g_tok), tk(h_tok), softcap=st.opts.softcap,
                                smoothing=st.opts.uses_smoothing).astype(x.dtype)
        # this device's part of dX in fp32, summed over the axis, rounded once
        dz_p = wv.pad(dz)
        part = wv.grad_input(dz_p, jnp.float32)
        if sum_dx:
            part = lax.psum(part, st.axis_name)
        dx = lax.dynamic_update_slice_in_dim(dx, part.astype(x.dtype), start, 0)
        dw_c = wv.grad_weight(dz_p, xc)
        dw = dw_c if dw is None else dw + dw_c
        if bias is not None:
            db_c = jnp.sum(dz.astype(jnp.float32), axis=0)
            db = db_c if db is None else db + db_c
        return dx, dw, db

    dx0 = common.zeros_like_axes(x.shape, x.dtype, x)  # psum-ed over the axis: varies like x
    dx, dw, db = common._walk_chunks(st, n, body, (dx0, None, None))
    if dw is None:  # no tokens
        dw = common.zeros_like_axes(w.shape, jnp.float32, w)
        db = None if bias is None else common.zeros_like_axes(bias.shape, jnp.float32, w)
    return dx, common.trim_vocab(dw, wv.v, st.layout), db


@functools.lru_cache(maxsize=256)
def _custom_vjp_fn(st: _Static):
    """The differentiable ``(x, w, bias, y, cw) -> (loss, lse)`` for ``st``, jit-compiled
    (compiled once per ``st`` and signature; inlined under an outer jit / shard_map)."""
    @jax.custom_vjp
    def f(x, w, bias, y, cw):
        tok, lse, omega, _ = _global_terms(st, x, w, bias, y, cw)
        return _reduce(st, tok, omega), lse

    def f_fwd(x, w, bias, y, cw):
        tok, lse, omega, big_omega = _global_terms(st, x, w, bias, y, cw)
        return (_reduce(st, tok, omega), lse), (x, w, bias, y, cw, lse, omega, big_omega)

    def f_bwd(res, cts):
        x, w, bias, y, cw, lse, omega, big_omega = res
        g, h = cts
        n = x.shape[0]
        # shard_map(check_vma=False) hands each device 1/n of a replicated output's cotangent
        # and sums a replicated input's (x's) cotangent over the axis itself, as it transposes
        # the psum it cannot see in this rule: undo the first, let it do the second (dW and db
        # came out divided by the axis size). With check_vma the cotangents arrive whole.
        unchecked = not common.varying_axes(lax.axis_index(st.axis_name))
        if unchecked:
            g, h = lax.psum(g, st.axis_name), lax.psum(h, st.axis_name)
        g = g.astype(jnp.float32)
        if st.opts.reduction == "mean":
            g = g / common.mean_denominator(omega)
        g_tok = jnp.where(y != st.opts.ignore_index, g, 0.0)  # ignored: 0 whatever g is
        h_tok = jnp.broadcast_to(h.astype(jnp.float32), (n,))
        dx, dw, db = _grads(st, x, w, bias, y, cw, lse, omega, big_omega, g_tok, h_tok,
                            sum_dx=not unchecked)
        return (dx, dw.astype(w.dtype), None if db is None else db.astype(bias.dtype),
                None, None)

    f.defvjp(f_fwd, f_bwd)
    return jax.jit(f)


def vocab_parallel_linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions,
                                        axis_name, *, chunk_size=None, memory_budget=None):
    """Returns ``(loss, lse)`` (lse None unless ``opts.return_lse``); ``p`` holds this device's
    slices (``p.problem.v`` = V_local). Must run inside ``shard_map`` binding ``axis_name``."""
    plan = plan_token_chunks(p.problem.n, p.problem.v, bytes_per_element=8,
                             budget_bytes=memory_budget,
                             chunk_size=chunk_size)
    st = _Static(opts=opts, plan=plan, v_local=p.problem.v, layout=p.layout, axis_name=axis_name)
    loss, lse = _custom_vjp_fn(st)(p.x, p.w, p.bias, p.y, p.class_weight)
    return loss, (lse if opts.return_lse else None)


def global_token_count(labels, *, ignore_index: int = -100, weight=None, axis_name=None):
    """Σ of the non-ignored labels (or of their class weights ``weight[labels]``) as float32,
    ``psum``-ed over ``axis_name`` (a data-parallel mesh axis; ``None``: this array only).
    The data-parallel mean is ``linear_cross_entropy(..., reduction="sum") / count``.

    With ``weight``, a label outside ``[0, len(weight))`` that is not ``ignore_index`` is an
    error: a ``ValueError`` for concrete labels, a NaN count under tracing (as the loss does),
    never a silently clamped class."""
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integers, got dtype {labels.dtype}")
    raw = labels
    # as the loss reads them: in uint8, -100 would wrap to class 156 and 256 to 0
    labels = common.labels_int32(labels, ignore_index)
    mask = labels != ignore_index
    if weight is None:
        count = jnp.sum(mask, dtype=jnp.float32)
    else:
        weight = jnp.asarray(weight, jnp.float32)
        if weight.ndim != 1:
            raise ValueError(f"weight (class weights) must be 1-D, got shape {weight.shape}")
        v = weight.shape[0]
        common.check_concrete_labels(raw, v, ignore_index)
        bad = mask & ((labels < 0) | (labels >= v))
        count = jnp.sum(jnp.where(mask & ~bad, weight[jnp.where(mask & ~bad, labels, 0)], 0.0))
        count = jnp.where(jnp.any(bad), jnp.nan, count)
    return count if axis_name is None else lax.psum(count, axis_name)
