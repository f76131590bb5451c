"""``backend="torch"``: the spec in plain PyTorch ops, chunked over tokens.

What CPU-only users get, and the fallback anywhere Triton is missing. Forward keeps only the
per-token lse; backward recomputes each chunk's logits. At most one ``[chunk, V]`` block of
logits (plus its fp32 copy) exists at a time, and dW accumulates in place in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _torch_common as common
from .specs import linear_cross_entropy as spec
from .specs.tiling import plan_token_chunks

TUNING = ("chunk_size", "memory_budget")


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunk_logits(x, w, bias, acc, softcap):
    # The GEMM runs in the input dtype, as nn.Linear would; the loss math in fp32.
    return common.capped(F.linear(x, w, bias).to(acc), softcap)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, y, class_weight, opts, plan):
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
        if opts.reduction == "none":
            loss, denom = token_loss, None
        else:
            denom = None
            loss = token_loss.sum()
            if opts.reduction == "mean":
                denom = common.mean_denominator(
                    common.token_weight_total(y, class_weight, opts.ignore_index, acc))
                loss = loss / denom
        ctx.opts, ctx.plan = opts, plan
        ctx.save_for_backward(x, w, bias, y, class_weight, denom)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, g_loss, g_lse):
        x, w, bias, y, class_weight, denom = ctx.saved_tensors
        opts, plan = ctx.opts, ctx.plan
        acc = _acc_dtype(x)
        n, v = x.shape[0], w.shape[0]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if g_loss is None and g_lse is None:
            return (None,) * 7
        if g_loss is None:
            g_tok_all = torch.zeros(n, dtype=acc, device=x.device)
        elif opts.reduction == "none":
            g_tok_all = g_loss.to(acc)
        else:
            g = g_loss.to(acc)
            g_tok_all = (g / denom if denom is not None else g).expand(n)
        h_all = None if g_lse is None else g_lse.to(acc)
        omega_sum = common.class_weight_sum(class_weight, v, g_tok_all)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        dw = torch.empty(v, x.shape[1], dtype=acc, device=x.device) if need_w else None
        db = torch.empty(v, dtype=acc, device=x.device) if (need_b and bias is not None) else None
        for s, e in plan.bounds():
            xc = x[s:e]
            c = _chunk_logits(xc, w, bias, acc, opts.softcap)
            t = common.token_terms(c, y[s:e], class_weight, opts, omega_sum)
            dz = common.grad_capped_logits(c, t, g_tok_all[s:e],
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
        return (dx, None if dw is None else dw.to(w.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None)


def linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, *,
                         chunk_size=None, memory_budget=None):
    """Returns ``(loss, lse)``: loss reduced per ``opts.reduction`` (flat for "none"), lse (N,)."""
    bytes_per = 2 * torch.finfo(_acc_dtype(p.x)).bits // 8  # fp32 logits + their gradient
    plan = plan_token_chunks(p.problem.n, p.problem.v, bytes_per_element=bytes_per,
                             budget_bytes=memory_budget, chunk_size=chunk_size)
    return _ChunkedLinearCrossEntropy.apply(p.x, p.w, p.bias, p.y, p.class_weight, opts, plan)
