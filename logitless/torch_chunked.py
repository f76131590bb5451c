"""``backend="torch"``: the spec in plain PyTorch ops, chunked over tokens.

What CPU-only users get, and the fallback anywhere Triton is missing. Forward keeps only the
per-token lse; backward recomputes each chunk's logits. At most one ``[chunk, V]`` block of
logits (plus its fp32 copy) exists at a time, and dW accumulates in place in fp32. Forward
and backward are ``torch.library`` ops (``logitless::chunked_linear_cross_entropy_fwd/_bwd``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import _torch_common as common
from .specs import linear_cross_entropy as spec
from .specs.tiling import plan_token_chunks

TUNING = ("chunk_size", "memory_budget")
# The front door leaves the target range check to the forward op (below): inside the op it
# runs on plain per-sample tensors under torch.func.vmap, whose fallback has no rule for the
# device assert.
CHECKS_TARGETS = True


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunk_logits(x, w, bias, acc, softcap):
    # The GEMM runs in the input dtype, as nn.Linear would; the loss math in fp32.
    return common.capped_(F.linear(x, w, bias).to(acc), softcap)


def _forward(x, w, bias, y, class_weight, opts, plan):
    """-> (loss, lse, Σω): the loss reduced per ``opts.reduction``; Σω (or 1) for "mean"."""
    acc = _acc_dtype(x)
    n = x.shape[0]
    token_loss = torch.empty(n, dtype=acc, device=x.device)
    lse = torch.empty(n, dtype=acc, device=x.device)
    omega_sum = common.class_weight_sum(class_weight, w.shape[0], token_loss)
    for s, e in plan.bounds():
        c = _chunk_logits(x[s:e], w, bias, acc, opts.softcap)
        t = common.token_terms(c, y[s:e], class_weight, opts, omega_sum)
        token_loss[s:e] = t.loss
        lse[s:e] = t.lse
        del c, t  # before the next chunk's logits exist: one chunk at a time
    denom = torch.ones((), dtype=acc, device=x.device)
    if opts.reduction == "none":
        return token_loss, lse, denom
    if opts.reduction == "mean":
        denom = common.mean_denominator(
            common.token_weight_total(y, class_weight, opts.ignore_index, acc))
    return token_loss.sum() / denom, lse, denom


def _backward(x, w, bias, y, class_weight, denom, g_loss, g_lse, opts, plan, needs):
    """(dX, dW, db) for the upstream gradients of (loss, lse); each None unless needed."""
    acc = _acc_dtype(x)
    n, v = x.shape[0], w.shape[0]
    need_x, need_w, need_b = needs
    if g_loss is None:
        g_tok_all = torch.zeros(n, dtype=acc, device=x.device)
    elif opts.reduction == "none":
        g_tok_all = g_loss.to(acc)
    else:
        g_tok_all = (g_loss.to(acc) / denom).expand(n)  # denom is 1 for "sum"
    h_all = None if g_lse is None else g_lse.to(acc)
    omega_sum = common.class_weight_sum(class_weight, v, g_tok_all)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
    dw = torch.empty(v, x.shape[1], dtype=acc, device=x.device) if need_w else None
    db = torch.empty(v, dtype=acc, device=x.device) if (need_b and bias is not None) else None
    if n == 0:  # no chunk runs: nothing assigns the accumulators
        for t in (dw, db):
            if t is not None:
                t.zero_()
    for s, e in plan.bounds():
        xc = x[s:e]
        c = _chunk_logits(xc, w, bias, acc, opts.softcap)
        t = common.token_terms(c, y[s:e], class_weight, opts, omega_sum)
        dz = common.grad_capped_logits_(c, t, g_tok_all[s:e],
                                        None if h_all is None else h_all[s:e],
                                        class_weight, opts, omega_sum)
        del c
        if db is not None:
            common.accumulate_rows_(db, dz, first=s == 0)
        dz_low = dz.to(x.dtype)
        del dz
        if dx is not None:
            torch.mm(dz_low, w, out=dx[s:e])
        if dw is not None:
            common.accumulate_mm_(dw, dz_low.t(), xc, first=s == 0)
        del dz_low, t  # before the next chunk's logits exist: one chunk at a time
    return (dx, None if dw is None else dw.to(w.dtype),
            None if db is None else db.to(bias.dtype))


# torch.library ops, so that torch.compile sees one opaque call whatever the number of chunks
# (the Python chunk loop would otherwise specialize the graph on N) and gives eager results.
def _opts(reduction, ignore_index, label_smoothing, z_loss, softcap):
    return spec.LinearCrossEntropyOptions(
        reduction=common.reduction_name(reduction), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap or None)


def _plan(x, w, chunk):
    return plan_token_chunks(x.shape[0], w.shape[0], bytes_per_element=1, chunk_size=chunk)


@torch.library.custom_op("logitless::chunked_linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
            cw: Optional[torch.Tensor], reduction: int, ignore_index: int,
            label_smoothing: float, z_loss: float, softcap: float, chunk: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss, lse, Σω or 1)."""
    common.check_targets(y, w.shape[0], ignore_index)
    return _forward(x, w, bias, y, cw, _opts(reduction, ignore_index, label_smoothing, z_loss,
                                             softcap), _plan(x, w, chunk))


@_fwd_op.register_fake
def _(x, w, bias, y, cw, reduction, ignore_index, label_smoothing, z_loss, softcap, chunk):
    acc = _acc_dtype(x)
    n = x.shape[0]
    loss = x.new_empty(n, dtype=acc) if reduction == common.REDUCTION_CODES["none"] else \
        x.new_empty((), dtype=acc)
    return loss, x.new_empty(n, dtype=acc), x.new_empty((), dtype=acc)


@torch.library.custom_op("logitless::chunked_linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
            cw: Optional[torch.Tensor], denom: torch.Tensor, g_loss: Optional[torch.Tensor],
            g_lse: Optional[torch.Tensor], reduction: int, ignore_index: int,
            label_smoothing: float, z_loss: float, softcap: float, chunk: int, need_x: bool,
            need_w: bool, need_b: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dX, dW, db), each empty unless needed."""
    grads = _backward(x, w, bias, y, cw, denom, g_loss, g_lse,
                      _opts(reduction, ignore_index, label_smoothing, z_loss, softcap),
                      _plan(x, w, chunk), (need_x, need_w, need_b))
    return tuple(x.new_empty(0) if t is None else t for t in grads)


@_bwd_op.register_fake
def _(x, w, bias, y, cw, denom, g_loss, g_lse, reduction, ignore_index, label_smoothing, z_loss,
      softcap, chunk, need_x, need_w, need_b):
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            w.new_empty(w.shape) if need_w else x.new_empty(0),
            bias.new_empty(bias.shape) if (need_b and bias is not None) else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, w, bias, y, cw, *opts_chunk = inputs
    ctx.save_for_backward(x, w, bias, y, cw, output[2])
    ctx.opts_chunk = opts_chunk
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, g_loss, g_lse, _g_denom):
    if torch.is_grad_enabled():
        raise RuntimeError(common.NO_DOUBLE_BACKWARD.format(op="linear_cross_entropy"))
    x, w, bias, y, cw, denom = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    none = (None,) * 8
    if (g_loss is None and g_lse is None) or not (need_x or need_w or need_b):
        return (None,) * 3 + none
    dx, dw, db = _bwd_op(x, w, bias, y, cw, denom, g_loss, g_lse, *ctx.opts_chunk,
                         need_x, need_w, need_b and bias is not None)
    return (dx if need_x else None, dw if need_w else None,
            db if (need_b and bias is not None) else None) + none


torch.library.register_autograd("logitless::chunked_linear_cross_entropy_fwd",
                                _autograd_backward, setup_context=_setup_context)


def linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, *,
                         chunk_size=None, memory_budget=None):
    """Returns ``(loss, lse)``: loss reduced per ``opts.reduction`` (flat for "none"), lse (N,).

    Tuning: ``chunk_size`` (None: from ``memory_budget``; tokens per chunk),
    ``memory_budget`` (None: 1 GiB, ``specs.tiling.DEFAULT_BUDGET_BYTES``; bytes for one
    chunk's fp32 logits and their gradient)."""
    bytes_per = 2 * torch.finfo(_acc_dtype(p.x)).bits // 8  # fp32 logits + their gradient
    plan = plan_token_chunks(p.problem.n, p.problem.v, bytes_per_element=bytes_per,
                             budget_bytes=memory_budget, chunk_size=chunk_size)
    loss, lse, _denom = _fwd_op(p.x, p.w, p.bias, p.y, p.class_weight,
                                common.REDUCTION_CODES[opts.reduction], opts.ignore_index,
                                opts.label_smoothing, opts.z_loss, opts.softcap or 0.0, plan.chunk)
    return loss, lse
