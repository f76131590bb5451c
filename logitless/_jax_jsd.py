"""Linear JSD on the JAX side: argument checks and flattening, the front door (re-exported by
:mod:`logitless.jax`), the per-row-block math shared by both JAX backends, and the chunked
``jax.custom_vjp`` driver.

A backend supplies a *head*: what to do with one chunk's student and teacher logits (the
per-token loss, and optionally the student logit gradient). The math is written for blocks of
rows and columns: the XLA head applies it to whole rows at once, the Pallas kernels to the
column blocks of a row segment in turn (online max / sums), whose per-segment results
``stats_merge`` (pass 1) and a sum (pass 2) combine. See :mod:`logitless.specs.linear_jsd`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _jax_common as common
from ._keywords import check_tuning, jsd_not_vocab_parallel, unexpected_keyword
from .specs import linear_jsd as spec
from .specs.tiling import ChunkPlan

__all__ = ["linear_jsd", "available_backends"]

_BACKENDS = {"xla": "logitless.xla_jsd", "pallas": "logitless.pallas_kernels.linear_jsd"}
KINDS = ("forward_kl", "reverse_kl", "jsd")


def available_backends():
    """Backend names; ``None`` picks "pallas" when JAX's default backend is a GPU, else "xla"."""
    return ["pallas", "xla"] if jax.default_backend() == "gpu" else ["xla", "pallas"]


# ------------------------------------------------------------------------------ arguments
@dataclasses.dataclass(frozen=True)
class Prepared:
    xs: jax.Array                 # (N, H_s)
    ws: jax.Array                 # (V, H_s) for layout "vh", (H_s, V) for "hv" (never copied)
    xt: jax.Array                 # (N, H_t)
    wt: jax.Array                 # (V, H_t) / (H_t, V)
    y: Optional[jax.Array]        # (N,) int32 or None
    layout: str
    problem: spec.Problem
    needs: Tuple[bool, bool] = (True, True)  # (dX, dW) wanted: see _jax_common.Prepared


def prepare(xs, ws, xt, wt, y, opts: spec.LinearJSDOptions, weight_layout="vh") -> Prepared:
    """Check types, dtypes and shapes (errors name the argument); flatten to 2-D. Concrete
    targets are range-checked eagerly; traced ones turn a bad target into a NaN loss."""
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight")
    for name, a in zip(names, (xs, ws, xt, wt)):
        common._require_array(name, a)
        if jnp.dtype(a.dtype) not in common.FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {a.dtype}")
    common._require_array("target", y, optional=True)
    if jnp.dtype(ws.dtype) != jnp.dtype(xs.dtype):
        raise TypeError(f"student_weight dtype {ws.dtype} does not match student_input dtype "
                        f"{xs.dtype}")
    if jnp.dtype(wt.dtype) != jnp.dtype(xt.dtype):
        raise TypeError(f"teacher_weight dtype {wt.dtype} does not match teacher_input dtype "
                        f"{xt.dtype}")
    if y is not None:
        ydt = jnp.dtype(y.dtype)
        if ydt == jnp.bool_ or not jnp.issubdtype(ydt, jnp.integer):
            raise TypeError(f"target must hold integer class indices, got dtype {ydt}")
    common.check_int32_ignore_index(opts.ignore_index, "targets")
    if weight_layout not in ("vh", "hv"):
        raise ValueError(f"weight_layout must be 'vh' (V, H) or 'hv' (H, V), got {weight_layout!r}")
    problem = spec.check_shapes(xs.shape, ws.shape, xt.shape, wt.shape,
                                None if y is None else y.shape, options=opts,
                                weight_layout=weight_layout)
    if y is not None:
        common.check_concrete_labels(y, problem.v, opts.ignore_index)
    xs, ws, xt, wt, y = common.match_varying(xs, ws, xt, wt, y)  # inside shard_map
    n = problem.n
    # the teacher needs no stop_gradient: the custom_vjp gives it no cotangent, and as the
    # caller's very arrays the unfused path's residuals stay the inputs (no copy out of a jit)
    return Prepared(xs=jnp.reshape(xs, (n, problem.h_s)), ws=jnp.asarray(ws),
                    xt=jnp.reshape(xt, (n, problem.h_t)), wt=jnp.asarray(wt),
                    y=None if y is None else common.labels_int32(jnp.reshape(y, (n,)),
                                                                 opts.ignore_index),
                    layout=weight_layout, problem=problem)


# ------------------------------------------------------------------ per-block math (fp32)
# Rows are tokens, (R,) per-row values, (R, C) blocks of columns. a = z_s/T, b = z_t/T, z_s the
# raw student logits; every quantity in natural units. As in the Triton kernel
# (logitless/triton_kernels/jsd_rows.py, whose docstring derives it): the normalizer gap
# c = L_b − L_a comes from log1p(E_Q[expm1(b − a)]) and the per-element terms from
# δ = b − a − c = log P − log Q and Λ = log1p(β·expm1(δ)), so that a KL or JSD of nearly equal
# distributions (second order in their difference) is not swamped by rounding of O(10) values.
# b − a is always formed as (z_t − z_s)/T (:func:`scaled`).
FAR, GAP, SMALL, HIGH_BETA = spec.FAR, spec.GAP, spec.SMALL, spec.HIGH_BETA  # see the spec


def expm1(x):
    """e^x − 1 to a few ulps relative, also for small |x| (polynomial: Pallas-lowerable)."""
    small = jnp.abs(x) < SMALL
    t = jnp.where(small, x, 0.0)
    p = t * (1.0 + t * (0.5 + t * (1.0 / 6.0 + t * (1.0 / 24.0 + t * (1.0 / 120.0 +
                                                                       t * (1.0 / 720.0))))))
    return jnp.where(small, p, common.exp(x) - 1.0)


def log1p(y):
    """log(1 + y) to a few ulps relative, also for small |y| (y > −1)."""
    small = jnp.abs(y) < SMALL
    t = jnp.where(small, y, 0.0)
    p = t * (1.0 - t * (0.5 - t * (1.0 / 3.0 - t * (0.25 - t * (0.2 - t * (1.0 / 6.0 -
                                                                          t * (1.0 / 7.0)))))))
    return jnp.where(small, p, common.log(1.0 + y))


def scaled_gap(zs, zt, inv_t):
    """d = (z_t − z_s)/T from raw logits: the difference scaled, not z_t/T − z_s/T: where a
    compiler fuses the multiply into the subtraction (an FMA: XLA on a CPU, Triton on a GPU)
    the latter is z_t·(1/T) − round(z_s·(1/T)), the rounding residual of z/T where the heads
    are equal, not 0 (a JSD of equal heads at T = 0.3 came out 1e-6)."""
    return (zt - zs) * inv_t


def stats_init(rows: int):
    """(M_s, s_a, M_t, s_b, u, md, w, w_far, m_z, s_z, z_y) before any column; M_s and M_t are
    the heads' *raw* maxima (max z, not max z/T: see :func:`log_q`)."""
    zeros = jnp.zeros((rows,), jnp.float32)
    ninf = jnp.full((rows,), -jnp.inf, jnp.float32)
    return ninf, zeros, ninf, zeros, zeros, ninf, zeros, zeros, ninf, zeros, zeros


def _online(m, s, x):
    """Fold a block of exponents x (masked lanes -inf) into running (max, Σ exp(x − max))."""
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    return m_new, s * common.exp(m - m_new) + jnp.sum(common.exp(x - m_new[:, None]), axis=1)


def max_shift(ms_old, ms_new, mt_old, mt_new, s_old, inv_t):
    """How much the far-form KL terms ((z_t − M_t) − (z_s − M_s))/T of the columns summed so
    far move when the raw maxima move from (M_s, M_t) old to new: they drop by this. 0 before
    any live column (s_old = 0, where the maxima are −inf)."""
    ms_old = jnp.where(s_old > 0, ms_old, ms_new)  # no inf − inf computed (and discarded)
    mt_old = jnp.where(s_old > 0, mt_old, mt_new)
    return ((mt_new - mt_old) - (ms_new - ms_old)) * inv_t


def stats_update(carry, zs, zt, d, cmask, is_target, *, inv_t, kind, hard, t_one):
    """Pass 1 over a column block of raw logits (d = :func:`scaled_gap`): online normalizers
    s_a = Σ e^((z_s − M_s)/T), s_b likewise, u = Σ e^((z_s−M_s)/T)·expm1(d), md = max d, and for
    the KL kinds the row KL's sums in both forms (:func:`stats_finish` picks one): w =
    Σ e^((z_t−M_t)/T)·d (forward) or −Σ e^((z_s−M_s)/T)·d (reverse), and w_far the same with d
    replaced by ±((z_t − M_t) − (z_s − M_s))/T. For the hard-label term the target logit (and
    z_s's normalizer, T != 1)."""
    ms, s_a, mt, s_b, u, md, w, wf, m_z, s_z, z_y = carry
    live = jnp.ones(zs.shape, bool) if cmask is None else jnp.broadcast_to(cmask[None, :],
                                                                           zs.shape)
    d = jnp.where(live, d, 0.0)
    ms_new = jnp.maximum(ms, jnp.max(jnp.where(live, zs, -jnp.inf), axis=1))
    mt_new = jnp.maximum(mt, jnp.max(jnp.where(live, zt, -jnp.inf), axis=1))
    # exponents relative to the raw maxima: (z − M)/T
    xa, xb = (zs - ms_new[:, None]) * inv_t, (zt - mt_new[:, None]) * inv_t
    ra, rb = common.exp((ms - ms_new) * inv_t), common.exp((mt - mt_new) * inv_t)
    ea = jnp.where(live, common.exp(xa), 0.0)
    eb = jnp.where(live, common.exp(xb), 0.0)
    u = u * ra + jnp.sum(ea * expm1(jnp.minimum(d, FAR)), axis=1)
    md = jnp.maximum(md, jnp.max(jnp.where(live, d, -jnp.inf), axis=1))
    if kind != "jsd":
        shift = max_shift(ms, ms_new, mt, mt_new, s_b if kind == "forward_kl" else s_a, inv_t)
        far_d = jnp.where(live, xb - xa, 0.0)  # padded columns may hold anything (NaN)
        if kind == "forward_kl":
            w = w * rb + jnp.sum(eb * d, axis=1)
            wf = (wf - s_b * shift) * rb + jnp.sum(eb * far_d, axis=1)
        else:
            w = w * ra - jnp.sum(ea * d, axis=1)
            wf = (wf + s_a * shift) * ra - jnp.sum(ea * far_d, axis=1)
    s_a = s_a * ra + jnp.sum(ea, axis=1)
    s_b = s_b * rb + jnp.sum(eb, axis=1)
    if hard:
        if not t_one:
            m_z, s_z = _online(m_z, s_z, jnp.where(live, zs, -jnp.inf))
        z_y = z_y + jnp.sum(jnp.where(is_target, zs, 0.0), axis=1)
    return ms_new, s_a, mt_new, s_b, u, md, w, wf, m_z, s_z, z_y


def stats_finish(carry, *, inv_t, kind, hard, t_one):
    """-> ((M_s, log s_a, M_t, log s_b, c, far, lsd), L_z, z_y, kl): the row values the later
    passes take (:func:`row_offsets`), with c = L_b − L_a, far = 1.0 where the heads'
    normalizers lie apart (0.0 where c is the accurate log1p form) and lsd = log s_b − log s_a
    taken as ±log1p(larger sum / smaller sum − 1), the form the Triton kernel needs (two logs
    of O(1-10) sums leave an ulp of each in their difference: with the GPU's fast logs 20x the
    naive error of a small KL in far rows); L_z, z_y for the hard-label term and kl the row's
    KL (nats) for the KL kinds, else 0."""
    ms, s_a, mt, s_b, u, md, w, wf, m_z, s_z, z_y = carry
    ls_a, ls_b = jnp.log(s_a), jnp.log(s_b)
    # the smaller sum divides: (s_b − s_a)/s_a → −1 where s_b ≪ s_a (a sharp teacher beside a
    # flat student) and the log1p of it keeps only ulp(1)/(s_b/s_a) (9e-5 at a ratio of 1e-3)
    lsd = jnp.where(s_b >= s_a, log1p((s_b - s_a) / s_a), -log1p((s_a - s_b) / s_b))
    gap = (mt - ms) * inv_t + lsd
    saturated = (s_a < 1.0 + SMALL) & (s_b < 1.0 + SMALL) & (jnp.abs(gap) >= SMALL)
    near = (md < FAR) & (jnp.abs(gap) < GAP) & ~saturated  # the spec's rule, by SMALL
    c = jnp.where(near, log1p(u / s_a), gap)
    l_z = ms * inv_t + ls_a if (t_one or not hard) else m_z + jnp.log(s_z)
    # normalized by the sums themselves: e^(m − L) would carry L's rounding, which the reverse
    # KL's gradient −Q·(δ + KL) then fails to cancel where δ + KL is small (as jsd_k for JSD).
    # Far apart, Σ P·d − c cancels two terms of O(c): there the sums relative to the maxima.
    if kind == "forward_kl":
        kl = jnp.where(near, w / s_b - c, wf / s_b - lsd)
    elif kind == "reverse_kl":
        kl = jnp.where(near, w / s_a + c, wf / s_a + lsd)
    else:
        kl = jnp.zeros_like(ms)
    return (ms, ls_a, mt, ls_b, c, jnp.where(near, 0.0, 1.0), lsd), l_z, z_y, kl


def stats_merge(parts, *, inv_t, kind, hard, t_one):
    """Pass-1 carries of column segments (each field (segments, rows)) merged into one per row:
    the normalizers' sums (and u, w, w_far) rescaled to the common maxima."""
    ms_p, s_a, mt_p, s_b, u, md, w, wf, m_z, s_z, z_y = parts
    ms, mt = jnp.max(ms_p, axis=0), jnp.max(mt_p, axis=0)
    ra, rb = jnp.exp((ms_p - ms) * inv_t), jnp.exp((mt_p - mt) * inv_t)
    if kind == "forward_kl":
        w = jnp.sum(w * rb, axis=0)
        wf = jnp.sum((wf - s_b * max_shift(ms_p, ms, mt_p, mt, s_b, inv_t)) * rb, axis=0)
    elif kind == "reverse_kl":
        w = jnp.sum(w * ra, axis=0)
        wf = jnp.sum((wf + s_a * max_shift(ms_p, ms, mt_p, mt, s_a, inv_t)) * ra, axis=0)
    else:
        w, wf = w[0], wf[0]  # unused
    if hard and not t_one:
        mz = jnp.max(m_z, axis=0)
        s_z = jnp.sum(s_z * jnp.exp(m_z - mz), axis=0)
    else:  # unused
        mz, s_z = m_z[0], s_z[0]
    return (ms, jnp.sum(s_a * ra, axis=0), mt, jnp.sum(s_b * rb, axis=0),
            jnp.sum(u * ra, axis=0), jnp.max(md, axis=0), w, wf, mz, s_z, jnp.sum(z_y, axis=0))


def row_offsets(ms, ls_a, mt, ls_b, c, far, lsd):
    """(A, B, C) per row such that δ = log P − log Q = ((z_t − A) − (z_s − B))/T − C
    (:func:`log_ratio`): (0, 0, c) where the heads are close (z_t − z_s is exact where they
    agree, c the accurate gap), (M_t, M_s, log s_b − log s_a) where their normalizers lie far
    apart, where (z_t − z_s)/T − c would cancel two terms of O(c) (a teacher a constant above
    the student: 10-17× the naive error at an offset of 30)."""
    far = far > 0
    return (jnp.where(far, mt, 0.0), jnp.where(far, ms, 0.0),
            jnp.where(far, lsd, c))


def log_ratio(zs, zt, offsets, inv_t):
    """δ = log P − log Q per element (``offsets`` from :func:`row_offsets`)."""
    a_off, b_off, c_off = offsets
    return ((zt - a_off[:, None]) - (zs - b_off[:, None])) * inv_t - c_off[:, None]


def log_q(z, m, ls, inv_t):
    """log softmax(z/T) = (z − max z)/T − log s, from the raw maximum: not z/T − L, as L ≈ max
    z/T is O(10) at a confident head (and O(|z|/T) at a low T), and its rounding would be a
    factor on every Q, while z − max z is exact at the maximum and log s, the log of a sum
    >= 1, is small there (the split log_softmax makes). Also log P, from the teacher's."""
    return (z - m[:, None]) * inv_t - ls[:, None]


def _jsd_terms(lq, delta, beta):
    """Q and Λ = log M − log Q per element from log Q and δ = log P − log Q (0 < β < 1)."""
    q = common.exp(lq)
    form = spec.beta_form(beta)
    far = FAR if form == 1 else spec.far_delta(beta)
    if form == 2:  # β < TINY_BETA: far passes EXPM1_MAX, where β·expm1(δ) would overflow
        mid = jnp.logaddexp(delta + math.log(beta), math.log1p(-beta))
        lam = jnp.where(delta > far, delta + math.log(beta), jnp.where(
            delta > spec.EXPM1_MAX, mid,
            log1p(beta * expm1(jnp.minimum(delta, spec.EXPM1_MAX)))))
    else:
        lam = jnp.where(delta > far, math.log(beta) + delta,
                        log1p(beta * expm1(jnp.minimum(delta, far))))
    if beta > HIGH_BETA:
        # log(β·e^δ + 1 − β) for δ < −1, where 1 − β carries it: a logaddexp with log(1 − β)
        # taken in float64 (in fp32, β·expm1(δ) would make it 1 − fp32(β))
        lam = jnp.where(delta < -1.0, jnp.logaddexp(math.log(beta) + delta, math.log1p(-beta)),
                        lam)
    return q, lam


def _jsd_loss_terms(zt, lq, delta, q, lam, rows, *, beta, inv_t):
    """β·P·log(P/M) − (1−β)·Q·Λ per element (J's terms), from log Q, δ, Q and Λ."""
    _, _, mt, ls_b, c, _, _ = rows
    # P as Q·e^δ where the heads are close (consistent with δ), else from the teacher's own
    # statistics: log Q + δ cancels two terms of O(|z|/T) or O(|c|) where δ or the
    # normalizer gap c is large (one exp either way)
    close = jnp.maximum(jnp.abs(delta), jnp.abs(c)[:, None]) < 1.0
    p = common.exp(jnp.where(close, lq + delta, log_q(zt, mt, ls_b, inv_t)))
    return beta * p * _log_p_over_m(delta, lam, beta) - (1.0 - beta) * q * lam


def jsd_sums_update(carry, zs, zt, rows, cmask, *, beta, inv_t, with_j=True):
    """Pass 2 (0 < β < 1) over a column block of raw logits, ``rows`` the row values of
    :func:`stats_finish`: −Σ Q·Λ and ΣQ (K = KL(Q‖M) is their ratio, :func:`jsd_k`), and
    (``with_j``; else it stays as it was: :func:`grad_block` can sum it instead) J =
    Σ β·P·log(P/M) − (1−β)·Q·Λ."""
    k, j, qs = carry
    ms, ls_a = rows[:2]
    lq = log_q(zs, ms, ls_a, inv_t)
    delta = log_ratio(zs, zt, row_offsets(*rows), inv_t)
    q, lam = _jsd_terms(lq, delta, beta)
    live = True if cmask is None else cmask[None, :]
    k = k - jnp.sum(jnp.where(live, q * lam, 0.0), axis=1)
    qs = qs + jnp.sum(jnp.where(live, q, 0.0), axis=1)
    if with_j:
        terms = _jsd_loss_terms(zt, lq, delta, q, lam, rows, beta=beta, inv_t=inv_t)
        j = j + jnp.sum(jnp.where(live, terms, 0.0), axis=1)
    return k, j, qs


def jsd_k(k, qs):
    """K = −Σ Q·Λ / Σ Q. Q = e^(a − L_a) carries the rounding of L_a (ulp(L_a): ~1e-6 at
    L_a ≈ 10) as one factor common to the row; divided out, the gradient −(1−β)·Q·(Λ + K)
    sums to 0 over the row as it must. Where Λ + K cancels (confident or far-apart heads)
    that factor alone had made fp32 dX 4-50× the naive path's error."""
    return k / jnp.where(qs > 0, qs, 1.0)


def _log_p_over_m(delta, lam, beta):
    """log P − log M: δ − Λ, which cancels beyond ``spec.far_delta`` (Λ = log β + δ there),
    which takes the limit −log β, and as β → 1: for β > HIGH_BETA (a static choice)
    −log1p((1−β)·expm1(−δ)), or −logaddexp(log β, log(1−β) − δ) where −δ > FAR."""
    if beta <= HIGH_BETA:
        return jnp.where(delta > spec.far_delta(beta), -math.log(beta), delta - lam)
    nd = -delta
    far = jnp.logaddexp(math.log(beta), math.log1p(-beta) + nd)
    return -jnp.where(nd > FAR, far, log1p((1.0 - beta) * expm1(jnp.minimum(nd, FAR))))


def grad_block(zs, zt, is_target, rows, l_z, kk, coef, hard_coef, *, kind, beta, inv_t, hard,
               t_one, j_live=None):
    """Pass 3: the student logit gradient of a column block of raw logits, coef·(1/T)·∂J/∂a +
    hard_coef·(S − onehot), with coef = g·m per row (and hard_coef = coef·w_h); ``rows`` the
    row values of :func:`stats_finish`, kk the row's KL (reverse KL) or K (JSD). With
    ``j_live`` (JSD only: the block's live columns, (C,) bool) -> (dz, the block's part of
    J per row): J's terms from the Q and Λ that dz needs anyway, so that pass 2 need not
    take them (it is the one pass above HBM bandwidth)."""
    ms, ls_a, mt, ls_b, _, _, _ = rows
    lq = log_q(zs, ms, ls_a, inv_t)
    delta = log_ratio(zs, zt, row_offsets(*rows), inv_t)
    if kind == "forward_kl":
        q = common.exp(lq)
        # Q − P: as −Q·expm1(δ) where P ≈ Q; elsewhere P from the teacher's own statistics
        # (e^(lq + δ) would add the rounding of δ)
        g = jnp.where(jnp.abs(delta) < SMALL, -q * expm1(delta),
                      q - common.exp(log_q(zt, mt, ls_b, inv_t)))
    elif kind == "reverse_kl":
        q = common.exp(lq)
        g = -q * (delta + kk[:, None])
    else:
        q, lam = _jsd_terms(lq, delta, beta)
        g = -(1.0 - beta) * q * (lam + kk[:, None])
    dz = g * (coef * inv_t)[:, None]
    if hard:
        sv = q if t_one else common.exp(zs - l_z[:, None])
        dz = dz + hard_coef[:, None] * (sv - jnp.where(is_target, 1.0, 0.0))
    if j_live is None:
        return dz
    terms = _jsd_loss_terms(zt, lq, delta, q, lam, rows, beta=beta, inv_t=inv_t)
    return dz, jnp.sum(jnp.where(j_live[None, :], terms, 0.0), axis=1)


def row_loss(kl_or_j, l_z, z_y, hard_w, hard):
    """J (nats) + w_h·(lse(z_s) − z_s[y])."""
    return kl_or_j + hard_w * (l_z - z_y) if hard else kl_or_j


# ---------------------------------------------------------------- per-token coefficients
def token_mask(y, n, opts: spec.LinearJSDOptions, v):
    """m (N,) float32: 0 for ignored tokens, 1 otherwise, NaN for a target outside [0, V)
    that is not ignore_index (its loss, the reduced loss and the gradients become NaN: loud,
    never garbage; the kernels never index with it)."""
    if y is None:
        return jnp.ones((n,), jnp.float32)
    keep = y != opts.ignore_index
    bad = keep & ((y < 0) | (y >= v))
    return jnp.where(bad, jnp.nan, keep.astype(jnp.float32))


def mean_denominator(m):
    total = jnp.sum(jnp.where(jnp.isnan(m), 1.0, m))
    return jnp.where(total > 0, total, 1.0)


# ------------------------------------------------------------------------ chunked driver
class Head:
    """What a backend does with one chunk: ``loss(zs, zt, y)`` -> (C,) float32 per-token
    J + w_h·ce (unmasked); ``loss_grad(zs, zt, y, coef, grad_dtype)`` -> (loss, dz (C, V) in
    ``grad_dtype``), dz for the per-row coefficient coef = g·m. ``y`` (C,) int32 with -1 for
    "no target here" (or None). ``logits_dtype`` is the dtype the driver's GEMMs hand over
    (None: the input dtype). Heads are hashable (static configuration of the program).
    ``takes_padded_vocab``: as for :class:`common.Head` (padded logits and ``v=``, dz padded)."""

    logits_dtype = None
    takes_padded_vocab = False


@dataclasses.dataclass(frozen=True)
class _Static:
    opts: spec.LinearJSDOptions
    plan: ChunkPlan        # tokens per dX / dW chunk: one [chunk, vp] gradient buffer
    sub_chunk: int         # tokens per logits GEMM and head call (<= plan.chunk)
    v: int
    layout: str
    head: Head
    needs: Tuple[bool, bool] = (True, True)  # (dX, dW) wanted


def _tokens(a, start, size):
    return lax.dynamic_slice_in_dim(a, start, size, axis=0)


def _chunk_logits(st, xs, ws, xt, wt, start, size):
    """``ws`` / ``wt``: :class:`common.VocabWeight` (V padded to a multiple of 8)."""
    dt = st.head.logits_dtype
    return ws.logits(_tokens(xs, start, size), dt), wt.logits(_tokens(xt, start, size), dt)


def _head_loss(st, ws, zs, zt, y):
    if st.head.takes_padded_vocab:
        return st.head.loss(zs, zt, y, v=ws.v)
    return st.head.loss(ws.trim(zs), ws.trim(zt), y)


def _head_loss_grad(st, ws, zs, zt, y, coef, grad_dtype):
    """(loss, dz) with dz of the padded width."""
    if st.head.takes_padded_vocab:
        return st.head.loss_grad(zs, zt, y, coef, grad_dtype, v=ws.v)
    loss, dz = st.head.loss_grad(ws.trim(zs), ws.trim(zt), y, coef, grad_dtype)
    return loss, ws.pad(dz)


def _y_chunk(y, start, size):
    return None if y is None else _tokens(y, start, size)


def _forward(st: _Static, xs, ws, xt, wt, y):
    """Per-token losses l_i (N,), masked, without gradients (sub-chunk by sub-chunk)."""
    n = xs.shape[0]
    m = token_mask(y, n, st.opts, st.v)
    ys = None if y is None else common.column_targets(y, st.opts, st.v)
    # padding tokens (zero states, no target) are sliced off
    n_p = common.padded_tokens(n, st.sub_chunk)
    pad = common.pad_tokens
    xs, xt, ys = pad(xs, n_p), pad(xt, n_p), pad(ys, n_p, -1)
    ws, wt = common.VocabWeight(ws, st.layout), common.VocabWeight(wt, st.layout)

    def body(start, size, tok):
        zs, zt = _chunk_logits(st, xs, ws, xt, wt, start, size)
        return lax.dynamic_update_slice_in_dim(
            tok, _head_loss(st, ws, zs, zt, _y_chunk(ys, start, size)), start, 0)

    tok = common.walk(n_p, st.sub_chunk, body, common.zeros_like_axes((n_p,), jnp.float32, xs))
    return tok[:n] * m, m


def _grads(st: _Static, xs, ws, xt, wt, y, g, dx_dtype):
    """One sweep: masked per-token losses, dX (in ``dx_dtype``) and dW (float32, with
    :class:`common.VocabWeight`'s padded rows: :func:`common.trim_vocab`) for the
    upstream gradient g ((N,) per token, already divided by Σm for "mean"). Per chunk, the logits
    come in sub-chunks and the head writes their gradient into the chunk's [chunk, vp] buffer
    (vp: V padded to a multiple of 8, :class:`common.VocabWeight`); the
    dX / dW GEMMs then run once per chunk (dW's float32 accumulator is read and written once
    per chunk, so chunks should be large; the logits buffers stay small)."""
    n = xs.shape[0]
    m = token_mask(y, n, st.opts, st.v)
    ys = None if y is None else common.column_targets(y, st.opts, st.v)
    # an ignored token (m = 0) gets 0 whatever its upstream g (F.cross_entropy's rule), as g·0
    # would turn an inf or NaN g into NaN in every dW row; a bad target's NaN m stays
    coef = jnp.where(m == 0, 0.0, g * m)
    need_dx, need_dw = st.needs
    # padding tokens (zero states, no target, coefficient 0: zero gradient rows) are sliced off
    n_p = common.padded_tokens(n, st.plan.chunk)
    pad = common.pad_tokens
    xs, xt, ys, coef = pad(xs, n_p), pad(xt, n_p), pad(ys, n_p, -1), pad(coef, n_p)
    ws, wt = common.VocabWeight(ws, st.layout), common.VocabWeight(wt, st.layout)

    def body(start, size, carry):
        tok, dx, dw = carry

        def sub_body(s0, length, sub_carry):
            tok, dz = sub_carry
            zs, zt = _chunk_logits(st, xs, ws, xt, wt, s0, length)
            l_c, dz_c = _head_loss_grad(st, ws, zs, zt, _y_chunk(ys, s0, length),
                                        _tokens(coef, s0, length), xs.dtype)
            return (lax.dynamic_update_slice_in_dim(tok, l_c, s0, 0),
                    lax.dynamic_update_slice_in_dim(dz, dz_c, s0 - start, 0))

        # every row is overwritten by a sub-chunk
        dz = common.zeros_like_axes((size, ws.vp), xs.dtype, xs)
        tok, dz = common.walk(size, min(st.sub_chunk, size), sub_body, (tok, dz), start0=start)
        if need_dx:
            dx = lax.dynamic_update_slice_in_dim(
                dx, ws.grad_input(dz, dx_dtype), start, 0)
        if need_dw:  # the first chunk assigns: no zero-fill
            dw_c = ws.grad_weight(dz, _tokens(xs, start, size))
            dw = dw_c if dw is None else dw + dw_c
        return tok, dx, dw

    dx0 = common.zeros_like_axes(xs.shape, dx_dtype, xs) if need_dx else None
    tok, dx, dw = common.walk(n_p, st.plan.chunk, body,
                              (common.zeros_like_axes((n_p,), jnp.float32, xs), dx0, None))
    if n == 0 and need_dw:  # no tokens at all
        dw = ws.zero_grad_weight(xs)
    return tok[:n] * m, None if dx is None else dx[:n], dw


def _reduce(st: _Static, tok, m):
    if st.opts.reduction == "none":
        return tok
    total = jnp.sum(tok)
    return total / mean_denominator(m) if st.opts.reduction == "mean" else total


@functools.lru_cache(maxsize=256)
def _custom_vjp_fn(st: _Static):
    """The differentiable ``(xs, ws, xt, wt, y) -> loss`` for ``st``, jit-compiled (an eager
    call compiles once per ``st`` and input signature); the teacher and the targets get no
    cotangent.

    mean/sum: the forward rule runs the gradient sweep for an upstream gradient of 1 (or
    1/Σm), and the backward rule only scales dX and dW by the scalar cotangent; both stay in
    float32 until then (rounded once, whatever the cotangent). "none": the backward rule
    recomputes every chunk with per-token cotangents (in dz: dX is rounded once there too).
    """
    opts = st.opts

    @jax.custom_vjp
    def f(xs, ws, xt, wt, y):
        tok, m = _forward(st, xs, ws, xt, wt, y)
        return _reduce(st, tok, m)

    if opts.reduction != "none":
        def f_fwd(xs, ws, xt, wt, y):
            n = xs.shape[0]
            m = token_mask(y, n, opts, st.v)
            scale, post = common.mean_scales(opts.reduction, xs.dtype, m)
            tok, dx, dw = _grads(st, xs, ws, *common.constants(xt, wt), y,
                                 jnp.full((n,), scale, jnp.float32), jnp.float32)
            return _reduce(st, tok, m), (dx, dw, post, jnp.zeros((), xs.dtype))  # dtype tag

        def f_bwd(res, g):
            dx, dw, post, dt = res[0], res[1], res[2], res[3].dtype
            g = g.astype(jnp.float32) * post
            scale = lambda a: None if a is None else (g * a).astype(dt)
            return scale(dx), scale(common.trim_vocab(dw, st.v, st.layout)), None, None, None
    else:
        def f_fwd(xs, ws, xt, wt, y):
            tok, m = _forward(st, xs, ws, xt, wt, y)
            return tok, (xs, ws, xt, wt, y)

        def f_bwd(res, g):
            xs, ws, xt, wt, y = res
            _, dx, dw = _grads(st, xs, ws, *common.constants(xt, wt), y,
                               g.astype(jnp.float32), xs.dtype)
            dw = common.trim_vocab(dw, st.v, st.layout)
            return dx, None if dw is None else dw.astype(ws.dtype), None, None, None

    f.defvjp(f_fwd, f_bwd)
    return jax.jit(f)


def plan_chunks(p: Prepared, fp32_logits: bool, share: int, budget, chunk_size,
                logits_chunk_size, temporaries: int = 1):
    """(plan, sub_chunk): chunks of C tokens for the gradient buffer [C, V] (input dtype) and
    the dX / dW GEMMs, sub-chunks of c tokens for the two logits buffers [c, V] (``share`` =
    C / c when fp32 logits of half-precision inputs, 1 otherwise), both from one budget;
    ``temporaries``: [c, V] float32 working arrays a head keeps besides the logits. Chunks
    from the budget are made equal (``balanced``), so that the drivers can pad the tokens to
    a whole number of them (``common.padded_tokens``)."""
    in_bytes = p.xs.dtype.itemsize
    logit_bytes = 4 if fp32_logits else in_bytes
    share = share if logit_bytes > in_bytes else 1
    per_token = in_bytes + (2 * logit_bytes + 4 * (temporaries - 1)) / share
    plan = common.token_plan(p.problem.n, p.problem.v, bytes_per_element=max(1, round(per_token)),
                             budget_bytes=budget, chunk_size=chunk_size)
    if logits_chunk_size is None:
        sub = plan.chunk if (share == 1 or plan.chunk <= 128) else \
            max(128, plan.chunk // share // 128 * 128)
    else:
        sub = common.check_tuning("logits_chunk_size", logits_chunk_size)
    return plan, min(sub, plan.chunk)


def chunked_linear_jsd(p: Prepared, opts: spec.LinearJSDOptions, plan: ChunkPlan, head: Head,
                       sub_chunk: Optional[int] = None):
    """The loss reduced per ``opts.reduction`` (flat ``(N,)`` for "none"). ``plan``: tokens per
    dX / dW chunk; ``sub_chunk``: tokens per logits GEMM and head call (default: the chunk)."""
    sub = plan.chunk if sub_chunk is None else max(1, min(sub_chunk, plan.chunk))
    st = _Static(opts=opts, plan=plan, sub_chunk=sub, v=p.problem.v, layout=p.layout, head=head,
                 needs=p.needs)
    return _custom_vjp_fn(st)(p.xs, p.ws, p.xt, p.wt, p.y)


# ------------------------------------------------------------------------------ front door
def _resolve(backend: Optional[str]):
    if backend is None:
        backend = available_backends()[0]
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {sorted(_BACKENDS)}, got {backend!r}")
    return backend, importlib.import_module(_BACKENDS[backend])


def linear_jsd(student_input, student_weight, teacher_input, teacher_weight, target=None, *,
               beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean",
               hard_loss_weight=0.0, weight_layout="vh", backend=None, **tuning):
    """Generalized JSD between a student and a teacher LM head without materializing either
    ``[N, V]`` logits array; the arguments of :func:`logitless.torch.linear_jsd`, JAX arrays
    (``temperature`` as there: the loss is not multiplied by T²; the usual
    ``α·T²·KL(P‖Q) + (1−α)·CE`` is ``α·T**2 * linear_jsd(..., beta=0.0, temperature=T,
    hard_loss_weight=(1−α)/(α·T**2))``).

    Works under ``jax.jit``, ``jax.grad``, ``jax.value_and_grad`` and ``jax.vmap``; the
    teacher arrays and the targets get zero cotangents. ``weight_layout="hv"`` takes both
    heads as ``(H, V)`` (Flax ``Dense`` kernels) without transposing them. Concrete targets
    outside ``[0, V)`` (other than ``ignore_index``) raise ``ValueError`` up front; traced ones
    make the loss and gradients NaN. ``backend``: ``None`` ("pallas" on a GPU, else "xla"),
    ``"pallas"`` or ``"xla"``.

    ``**tuning``: the chosen backend's keywords (any other is a TypeError); every default
    ``None`` means the value in brackets.

    * ``backend="xla"``: ``chunk_size=None`` (tokens per dX / dW chunk) and
      ``logits_chunk_size=None`` (tokens per logits GEMM), both from ``memory_budget=None``
      (1 GiB: the chunk's float32 logits and working arrays).
    * ``backend="pallas"``: ``chunk_size=None``, ``logits_chunk_size=None`` (the chunk),
      ``memory_budget=None`` (2.5 GiB: the chunk's gradient and two float32 logits buffers),
      ``block_rows=None`` (1) × ``block_v=None`` (2048, shrunk to V) the kernels' tile,
      powers of two; ``num_warps=None`` (4), ``num_stages=None`` (2); ``segment_size=None``
      (8192 columns per program); ``fp32_logits=True`` (False: logits in the input dtype,
      less memory, ~1e-2 less accurate bf16 gradients); ``interpret=None`` (True unless
      JAX's default backend is a GPU).

    Sharding, gradient accumulation: as :func:`logitless.jax.linear_cross_entropy` (works
    inside ``shard_map`` and with Explicit mesh axes; in a ``lax.scan`` over micro-batches,
    wrap the loss in ``jax.checkpoint``: "mean"/"sum" keep dX and a float32 dW per step).
    """
    opts = spec.LinearJSDOptions(
        beta=beta, temperature=temperature, reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index,
        hard_loss_weight=hard_loss_weight)
    return run(student_input, student_weight, teacher_input, teacher_weight, target, opts,
               weight_layout, backend, tuning)


_PARAMETERS = tuple(p for p in inspect.signature(linear_jsd).parameters if p != "tuning")


def run(xs, ws, xt, wt, target, opts: spec.LinearJSDOptions, weight_layout, backend, tuning,
        needs: Tuple[bool, bool] = (True, True)):
    """:func:`linear_jsd` with its options built; ``needs``: which of (dX, dW) the caller will
    use (the PyTorch bridge: a frozen student head costs no dW GEMM or accumulator)."""
    if "axis_name" in tuning:  # not a tuning keyword that one backend lacks: none has it
        raise unexpected_keyword("linear_jsd", "axis_name", (),
                                 {"axis_name": jsd_not_vocab_parallel("axis_name")})
    name, impl = _resolve(backend)
    check_tuning("linear_jsd", tuning, _PARAMETERS, f"backend={name!r}", impl.TUNING)

    def body(xs, ws, xt, wt, target):
        p = dataclasses.replace(prepare(xs, ws, xt, wt, target, opts, weight_layout),
                                needs=tuple(needs))
        loss = impl.linear_jsd(p, opts, **tuning)
        if opts.reduction == "none":
            loss = jnp.reshape(loss, p.problem.batch_shape)
        return loss

    def out_specs():  # with an Explicit mesh: per-token losses sharded like the tokens
        if opts.reduction != "none":
            return jax.sharding.PartitionSpec()
        tok = common.spec_of(target) if target is not None else common.spec_of(xs)[:-1]
        return jax.sharding.PartitionSpec(*tok)

    return common.on_auto_axes(body, (xs, ws, xt, wt, target), out_specs)
