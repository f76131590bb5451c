"""``backend="torch"`` for linear JSD: the spec in plain PyTorch ops, chunked over tokens.

What CPU-only users get, and the fallback anywhere Triton is missing. Forward keeps only the
per-token losses; backward recomputes each chunk's two logits blocks (fp32, as the spec
requires) and writes dX per chunk while dW accumulates in place in fp32. Forward and backward
are ``torch.library`` ops (``logitless::chunked_linear_jsd_fwd/_bwd``).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import _torch_common as common
from . import _torch_jsd as jsd_common
from .specs import linear_jsd as spec
from .specs.tiling import plan_token_chunks

TUNING = ("chunk_size", "memory_budget")
# the target range check runs in the forward op (below), as in torch_chunked (see there)
CHECKS_TARGETS = True
# Live [chunk, V] float32 temporaries of one chunk (two logits blocks, the two distributions
# and δ, log ratios and their far-apart forms, the gradient): the plan budgets this many per
# token and vocab entry. Counted at its peak (live tensors under a dispatch mode, eighth
# session): ~11.3 blocks; 8 had undercounted it. Nineteenth session, process peak RSS of one
# chunk's terms at T != 1: ~8.4 blocks with the two logits blocks (0 < β < 1), ~6.3 (KLs).
_TEMPORARIES = 12


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _distributions(zs, zt, t):
    """(Q, P, δ) of a chunk: Q = softmax(z_s/T), P = softmax(z_t/T), δ = log P − log Q, formed
    as the kernels form them (logitless/triton_kernels/jsd_rows.py derives it). δ = d − c with
    d = (z_t − z_s)/T, the difference taken before the scaling (so exactly 0 where the heads
    agree, at any T), and the normalizer gap c = L_b − L_a = log1p(E_Q[expm1(d)]) where the
    heads are close: log P − log Q as a difference of two log-softmaxes rounds its O(|z|/T)
    terms to ~ulp(|z|), which swamps a KL second order in the heads' difference (β = 1 came
    out negative). Far apart (some d >= FAR or |gap| >= GAP) d − c would cancel two terms of
    O(|c|) (a teacher a constant above the student, or a low T): δ there is the difference of
    each head's own log-softmax, (z_t − max z_t)/T − log s_b − ((z_s − max z_s)/T − log s_a),
    small where it matters. Q and P are each normalized by their own sum, not by e^−L: L's
    rounding would be a factor on every element that the gradients' −Q·(δ + K) forms then
    fail to cancel."""
    ms, mt = zs.amax(1, keepdim=True), zt.amax(1, keepdim=True)
    ea = ((zs - ms) / t).exp_()  # e^(a − max a): T > 0 keeps the argmax
    eb = ((zt - mt) / t).exp_()
    sa, sb = ea.sum(1, keepdim=True), eb.sum(1, keepdim=True)
    lsa, lsb = sa.log(), sb.log()
    d = (zt - zs) / t
    gap = (mt - ms) / t + (lsb - lsa)
    saturated = (sa < 1 + spec.SMALL) & (sb < 1 + spec.SMALL) & (gap.abs() >= spec.SMALL)
    close = (d.amax(1, keepdim=True) < spec.FAR) & (gap.abs() < spec.GAP) & ~saturated
    u = (ea * torch.expm1(d.clamp(max=spec.FAR))).sum(1, keepdim=True)
    c = torch.where(close, torch.log1p(u / sa), gap)
    far = (zt - mt).sub_(zs - ms).div_(t).sub_(lsb - lsa)
    return ea.div_(sa), eb.div_(sb), torch.where(close, d.sub_(c), far)


def chunk_terms(zs, zt, y, opts: spec.LinearJSDOptions, want_grad: bool):
    """Per-token loss l_i / m_i (J_i + w_h·ce_i) and, if wanted, ∂(J + w_h·ce)/∂z (C, V) for a
    chunk of fp32/fp64 student and teacher logits (the spec's formulas, row-wise, in the forms
    of the spec's precision notes)."""
    beta, t = opts.beta, opts.temperature
    q, p, delta = _distributions(zs, zt, t)
    da = None
    if opts.kind == "forward_kl":
        loss = (p * delta).sum(1)
        if want_grad:
            # Q − P, as −Q·expm1(δ) where P ≈ Q (the difference would cancel)
            da = torch.where(delta.abs() < spec.SMALL, -q * torch.expm1(delta), q - p)
    elif opts.kind == "reverse_kl":
        loss = -(q * delta).sum(1)
        if want_grad:
            da = -q * (delta + loss[:, None])
    else:
        ell, lpm = _log_ratios(delta, beta)
        kl_qm = (q * ell).sum(1)
        loss = beta * (p * lpm).sum(1) + (1 - beta) * kl_qm
        if want_grad:
            da = (1 - beta) * q * (ell - kl_qm[:, None])
    dz = None if da is None else da.div_(t)
    if opts.has_hard_loss:
        y_safe = torch.where(y != opts.ignore_index, y, torch.zeros_like(y)).long()
        logs = torch.log_softmax(zs, dim=1)
        loss = loss - opts.hard_loss_weight * logs.gather(1, y_safe[:, None])[:, 0]
        if want_grad:
            dce = logs.exp_()
            dce.scatter_add_(1, y_safe[:, None], -torch.ones_like(dce[:, :1]))
            dz.add_(dce, alpha=opts.hard_loss_weight)
    return loss, dz


def _log_ratios(delta, beta):
    """(log Q − log M, log P − log M) from δ = log P − log Q, 0 < β < 1, without the
    cancellation of differences of log-probabilities (the spec's precision note): as β → 0,
    log Q − log M → 0 while (1−β)·Σ Q·(·) carries the loss; as β → 1, log P − log M → 0."""
    lb, l1b = math.log(beta), math.log1p(-beta)
    # 0-d device scalars (a fill, not a host-to-device copy) for logaddexp's tensor operands
    lb_t, l1b_t = delta.new_full((), lb), delta.new_full((), l1b)
    # log M/Q = log(β·e^δ + 1 − β) and log M/P = log(β + (1−β)·e^−δ), through log1p/expm1 of
    # arguments that cannot overflow, logaddexp where they could (|δ| > FAR: no cancellation)
    m_q = torch.where(delta > spec.FAR, torch.logaddexp(delta + lb, l1b_t),
                      torch.log1p(beta * torch.expm1(delta.clamp(max=spec.FAR))))
    if beta > spec.HIGH_BETA:
        # for δ < −1, 1 − β carries log M/Q: from float64, not 1 − fp32(β) inside β·expm1(δ)
        m_q = torch.where(delta < -1.0, torch.logaddexp(delta + lb, l1b_t), m_q)
        m_p = torch.where(-delta > spec.FAR, torch.logaddexp(lb_t, l1b - delta),
                          torch.log1p((1 - beta) * torch.expm1((-delta).clamp(max=spec.FAR))))
        return -m_q, -m_p
    # δ − log M/Q would keep only ulp(δ) where δ > FAR (log M/Q ≈ δ + log β there)
    return -m_q, torch.where(delta > spec.FAR, -torch.logaddexp(lb_t, l1b - delta), delta - m_q)


def _mask(y, n, opts, like):
    if y is None:
        return torch.ones(n, dtype=like.dtype, device=like.device)
    return (y != opts.ignore_index).to(like.dtype)


def _chunk(xs, ws, xt, wt, y, s, e, acc, opts, want_grad):
    """:func:`chunk_terms` of tokens [s, e): both logits blocks computed in fp32 (as the spec
    requires), then held in ``acc``."""
    return chunk_terms(jsd_common.logits_f32(xs[s:e], ws).to(acc),
                       jsd_common.logits_f32(xt[s:e], wt).to(acc),
                       None if y is None else y[s:e], opts, want_grad)


def _forward(xs, ws, xt, wt, y, opts, plan):
    """-> (loss reduced per ``opts.reduction``, Σm or 1)."""
    acc = _acc_dtype(xs)
    n = xs.shape[0]
    token_loss = torch.empty(n, dtype=acc, device=xs.device)
    for s, e in plan.bounds():
        if e <= s:
            continue
        token_loss[s:e], _ = _chunk(xs, ws, xt, wt, y, s, e, acc, opts, want_grad=False)
    token_loss *= _mask(y, n, opts, token_loss)
    denom = torch.ones((), dtype=acc, device=xs.device)
    if opts.reduction == "none":
        return token_loss, denom
    if opts.reduction == "mean":
        denom = jsd_common.mean_denominator(y, n, opts.ignore_index, xs).to(acc)
    return token_loss.sum() / denom, denom


def _backward(xs, ws, xt, wt, y, denom, g_loss, opts, plan, need_x, need_w):
    """(dX, dW) for the upstream gradient ``g_loss``; each None unless needed."""
    acc = _acc_dtype(xs)
    n, v = xs.shape[0], ws.shape[0]
    g = g_loss.to(acc)
    g_tok = g if opts.reduction == "none" else (g / denom).expand(n)  # denom 1 for "sum"
    # an ignored token's gradient is 0 whatever its upstream gradient (F.cross_entropy's
    # rule): selected, as g·0 would turn an inf or NaN there into NaN in every dW row
    g_tok = torch.where(_mask(y, n, opts, g_tok) != 0, g_tok, 0.0)
    dx = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device) if need_x else None
    dw = torch.empty(v, xs.shape[1], dtype=acc, device=xs.device) if need_w else None
    first = True
    for s, e in plan.bounds():
        if e <= s:
            continue
        _, dz = _chunk(xs, ws, xt, wt, y, s, e, acc, opts, want_grad=True)
        dz_low = dz.mul_(g_tok[s:e, None]).to(xs.dtype)
        del dz
        if dx is not None:
            torch.mm(dz_low, ws, out=dx[s:e])
        if dw is not None:
            common.accumulate_mm_(dw, dz_low.t(), xs[s:e], first=first)
        del dz_low  # before the next chunk's logits exist
        first = False
    if dw is not None and first:  # no tokens at all
        dw.zero_()
    return dx, None if dw is None else dw.to(ws.dtype)


# torch.library ops, so that torch.compile sees one opaque call whatever the number of chunks
# (the Python chunk loop would otherwise specialize the graph on N) and gives eager results.
def _opts(reduction, beta, temperature, ignore_index, hard_w):
    return spec.LinearJSDOptions(beta=beta, temperature=temperature, ignore_index=ignore_index,
                                 reduction=common.reduction_name(reduction),
                                 hard_loss_weight=hard_w)


def _plan(xs, ws, chunk):
    return plan_token_chunks(xs.shape[0], ws.shape[0], bytes_per_element=1, chunk_size=chunk)


@torch.library.custom_op("logitless::chunked_linear_jsd_fwd", mutates_args=())
def _fwd_op(xs: torch.Tensor, ws: torch.Tensor, xt: torch.Tensor, wt: torch.Tensor,
            y: Optional[torch.Tensor], reduction: int, beta: float, temperature: float,
            ignore_index: int, hard_w: float, chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (loss, Σm or 1)."""
    if y is not None:
        common.check_targets(y, ws.shape[0], ignore_index)
    return _forward(xs, ws, xt, wt, y, _opts(reduction, beta, temperature, ignore_index, hard_w),
                    _plan(xs, ws, chunk))


@_fwd_op.register_fake
def _(xs, ws, xt, wt, y, reduction, beta, temperature, ignore_index, hard_w, chunk):
    acc = _acc_dtype(xs)
    loss = (xs.new_empty(xs.shape[0], dtype=acc) if reduction == common.REDUCTION_CODES["none"]
            else xs.new_empty((), dtype=acc))
    return loss, xs.new_empty((), dtype=acc)


@torch.library.custom_op("logitless::chunked_linear_jsd_bwd", mutates_args=())
def _bwd_op(xs: torch.Tensor, ws: torch.Tensor, xt: torch.Tensor, wt: torch.Tensor,
            y: Optional[torch.Tensor], denom: torch.Tensor, g_loss: torch.Tensor,
            reduction: int, beta: float, temperature: float, ignore_index: int, hard_w: float,
            chunk: int, need_x: bool, need_w: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (dX, dW), each empty unless needed."""
    dx, dw = _backward(xs, ws, xt, wt, y, denom, g_loss,
                       _opts(reduction, beta, temperature, ignore_index, hard_w),
                       _plan(xs, ws, chunk), need_x, need_w)
    return (xs.new_empty(0) if dx is None else dx, xs.new_empty(0) if dw is None else dw)


@_bwd_op.register_fake
def _(xs, ws, xt, wt, y, denom, g_loss, reduction, beta, temperature, ignore_index, hard_w,
      chunk, need_x, need_w):
    return (xs.new_empty(xs.shape) if need_x else xs.new_empty(0),
            ws.new_empty(ws.shape) if need_w else xs.new_empty(0))


def _setup_context(ctx, inputs, output):
    xs, ws, xt, wt, y, *opts_chunk = inputs
    ctx.save_for_backward(xs, ws, xt, wt, y, output[1])
    ctx.opts_chunk = opts_chunk
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, g_loss, _g_denom):
    if torch.is_grad_enabled():
        raise RuntimeError(common.NO_DOUBLE_BACKWARD.format(op="linear_jsd"))
    xs, ws, xt, wt, y, denom = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    none = (None,) * 9
    if g_loss is None or not (need_x or need_w):
        return (None, None) + none
    dx, dw = _bwd_op(xs, ws, xt, wt, y, denom, g_loss, *ctx.opts_chunk, need_x, need_w)
    return (dx if need_x else None, dw if need_w else None) + none


torch.library.register_autograd("logitless::chunked_linear_jsd_fwd", _autograd_backward,
                                setup_context=_setup_context)


def linear_jsd(p: jsd_common.Prepared, opts: spec.LinearJSDOptions, *, chunk_size=None,
               memory_budget=None):
    """Returns the loss reduced per ``opts.reduction`` (flat ``(N,)`` for "none").

    Tuning: ``chunk_size`` (None: from ``memory_budget``; tokens per chunk),
    ``memory_budget`` (None: 1 GiB, ``specs.tiling.DEFAULT_BUDGET_BYTES``; bytes for one
    chunk's fp32 temporaries)."""
    bytes_per = _TEMPORARIES * torch.finfo(_acc_dtype(p.xs)).bits // 8
    plan = plan_token_chunks(p.problem.n, p.problem.v, bytes_per_element=bytes_per,
                             budget_bytes=memory_budget, chunk_size=chunk_size)
    loss, _denom = _fwd_op(p.xs, p.ws, p.xt, p.wt, p.y, common.REDUCTION_CODES[opts.reduction],
                           opts.beta, opts.temperature, opts.ignore_index,
                           opts.hard_loss_weight, plan.chunk)
    return loss
