r"""Vocab-parallel (tensor-parallel) linear cross-entropy on ``torch.distributed``.

Each rank of ``process_group`` holds a contiguous slice ``W[v0:v1]`` of the LM head (and the
same slices of the bias and class weights), the *same* hidden states ``x (N, H)`` and the same
*global* targets ``y (N,)``. Every rank returns the same loss (and lse) and its own slices of
dW/db; dX is the full gradient, already summed over the group (do not all-reduce it again,
e.g. through a Megatron "copy to tensor-parallel region" in front of the head).

Where a rank's slice sits: ``vocab_start_index`` (v0) and ``vocab_size`` (global V) keywords.
Left out, the split is equal: ``v0 = rank · V_local``, ``V = world · V_local``. Uneven splits
pass both; a rank may hold an empty slice (``V_local = 0``, e.g. V smaller than the group): it
contributes ``lse_r = −inf`` and nothing else, and joins every collective like the others (a
rank that stayed out would leave the rest waiting in them). Nothing is derived by a collective
at call time; instead the consistency of the slices (they must tile ``[0, V)`` exactly, with
V >= 1, and every rank must give the same V) rides along in the forward's single collective and
is checked with a device-side assert (no host sync).

Algorithm (the spec's math, :mod:`logitless.specs.linear_cross_entropy`, split over V):

forward, per token chunk (plan of :mod:`logitless.specs.tiling` on ⌈V / world⌉, the same
on every rank even for uneven slices, so that the backward's per-chunk all-reduces pair up; a
slice wider than that holds proportionally more than ``memory_budget``), no collective:
    c = capped(x_c · W_localᵀ + b_local) in fp32
    lse_r = logsumexp_v c      c_y,r = c[y − v0] if v0 ≤ y < v1 else 0 (mask, no sentinel)
    wc_r  = Σ_v w_v c_v        (label smoothing only)
once per call, ONE all_gather of the stacked per-token rows (lse_r, c_y,r, wc_r, w_y,r) and
the rank's (V_local, v0, V, Σ w_local) in float64: lse = logsumexp over ranks of lse_r (stable:
each lse_r is computed with its own max), c_y = Σ_r c_y,r, wc, ω = m·w_y and Ω = Σ w summed.
backward, per chunk: recompute c, dz from the *global* lse (the spec's gradient with V the
global V, the target term only on the owning rank), dW_local and db_local in place in fp32,
dX partial = dz · W_local in fp32, all-reduced SUM asynchronously while the next chunk runs.
Collectives per call: 1 in forward, one per chunk in backward; no host syncs.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _torch_common as common
from .specs import linear_cross_entropy as spec
from .specs.tiling import plan_token_chunks

__all__ = ["vocab_parallel_linear_cross_entropy", "TUNING"]

TUNING = ("chunk_size", "memory_budget")

# Rows of the per-token block every rank contributes to the forward's all_gather.
_LSE, _CY, _WC, _WY = range(4)
# Per-rank scalars appended to it: slice size, slice start, the V it claims, Σ of its class weights.
_S_VLOCAL, _S_START, _S_V, _S_OMEGA = range(4)
_NUM_SCALARS = 4


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunk_logits(x, w, bias, acc, softcap):
    # The GEMM in the input dtype, as nn.Linear would; the loss math in fp32 (fp64 for fp64).
    return common.capped_(F.linear(x, w, bias).to(acc), softcap)


class _Shard:
    """This rank's place in the vocabulary, plain Python (no tensors)."""

    def __init__(self, group, rank, world, v_local, v0, v):
        self.group, self.rank, self.world = group, rank, world
        self.v_local, self.v0, self.v = v_local, v0, v


def _owned(y, shard, ignore_index):
    """(own mask, local index): the target lies in this rank's [v0, v1); index 0 elsewhere
    (never read through: every use is masked by ``own``)."""
    own = (y >= shard.v0) & (y < shard.v0 + shard.v_local) & (y != ignore_index)
    return own, torch.where(own, y - shard.v0, torch.zeros_like(y))


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, y, class_weight, opts, plan, shard):
        acc = _acc_dtype(x)
        n = x.shape[0]
        smoothing = opts.uses_smoothing
        own, y_loc = _owned(y, shard, opts.ignore_index)
        # the per-token rows and the scalars of this rank, gathered in fp64 once (exact ints,
        # and the bytes are few: 4·N + 4 per rank)
        mine = torch.zeros(4 * n + _NUM_SCALARS, dtype=torch.float64, device=x.device)
        rows = mine[:4 * n].view(4, n)
        if shard.v_local == 0:  # an empty slice: a sum over no class (lse_r = log 0), no target
            rows[_LSE] = -math.inf
        else:
            for s, e in plan.bounds():
                c = _chunk_logits(x[s:e], w, bias, acc, opts.softcap)
                rows[_LSE, s:e] = common.logsumexp_rows(c)
                rows[_CY, s:e] = torch.where(own[s:e], c.gather(1, y_loc[s:e, None])[:, 0], 0.0)
                if smoothing:
                    rows[_WC, s:e] = c.sum(1) if class_weight is None else c @ class_weight
                del c
            if class_weight is not None:
                rows[_WY] = torch.where(own, class_weight[y_loc], 0.0)
        scal = mine[4 * n:]
        scal[_S_VLOCAL], scal[_S_START], scal[_S_V] = shard.v_local, shard.v0, shard.v
        scal[_S_OMEGA] = shard.v_local if class_weight is None else class_weight.sum()

        every = torch.empty(shard.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        _all_gather_flat(every, mine, group=shard.group)
        every = every.view(shard.world, mine.numel())
        _assert_tiling(every[:, 4 * n:], shard.v)
        rows_all = every[:, :4 * n].view(shard.world, 4, n)
        lse = torch.logsumexp(rows_all[:, _LSE], dim=0)
        sums = rows_all.sum(0)
        mask = (y != opts.ignore_index).to(torch.float64)
        omega = mask if class_weight is None else sums[_WY]
        big_omega = every[:, 4 * n + _S_OMEGA].sum()
        eps, v = opts.label_smoothing, shard.v
        loss = (1 - eps) * omega * (lse - sums[_CY])
        if smoothing:
            # selected, not times the mask: an ignored token's sum may be −inf (0·inf = NaN)
            loss = loss + torch.where(mask > 0, (eps / v) * (big_omega * lse - sums[_WC]), 0.0)
        if opts.z_loss:
            loss = loss + opts.z_loss * omega * lse * lse
        loss, lse, omega = loss.to(acc), lse.to(acc), omega.to(acc)
        big_omega = big_omega.to(acc)
        denom = None
        if opts.reduction != "none":
            loss = loss.sum()
            if opts.reduction == "mean":
                denom = common.mean_denominator(omega.sum())
                loss = loss / denom
        ctx.opts, ctx.plan, ctx.shard = opts, plan, shard
        ctx.save_for_backward(x, w, bias, y, class_weight, lse, omega, big_omega, denom)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, g_loss, g_lse):
        # create_graph=True: the error every backend gives (not mm()'s out= error from deep
        # inside), raised before any collective, so every rank raises and none waits
        if torch.is_grad_enabled():
            raise RuntimeError(common.NO_DOUBLE_BACKWARD.format(op="linear_cross_entropy"))
        x, w, bias, y, class_weight, lse, omega, big_omega, denom = ctx.saved_tensors
        opts, plan, shard = ctx.opts, ctx.plan, ctx.shard
        if g_loss is None and g_lse is None:
            return (None,) * 8
        acc = _acc_dtype(x)
        n = x.shape[0]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if g_loss is None:
            g_tok = torch.zeros(n, dtype=acc, device=x.device)
        elif opts.reduction == "none":
            g_tok = g_loss.to(acc)
        else:
            g = g_loss.to(acc)
            g_tok = (g / denom if denom is not None else g).expand(n)
        h_tok = None if g_lse is None else g_lse.to(acc)
        eps, v = opts.label_smoothing, shard.v
        mask = (y != opts.ignore_index).to(acc)
        g_tok = torch.where(mask != 0, g_tok, 0.0)  # ignored: 0 whatever the upstream
        own, y_loc = _owned(y, shard, opts.ignore_index)
        # per-token coefficients of dc = coef·p − [v = y]·tgt − sm·w_v (the spec's A, B terms)
        a = (1 - eps) * omega + 2 * opts.z_loss * omega * lse
        if opts.uses_smoothing:
            a = a + mask * (eps / v) * big_omega
        coef = g_tok * a if h_tok is None else g_tok * a + h_tok
        tgt = torch.where(own, -g_tok * (1 - eps) * omega, 0.0)
        sm = g_tok * mask * (eps / v)
        cw = class_weight if class_weight is not None else \
            torch.ones(shard.v_local, dtype=acc, device=x.device)

        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        dw = torch.empty(w.shape, dtype=acc, device=x.device) if need_w else None
        db = torch.empty(shard.v_local, dtype=acc, device=x.device) \
            if (need_b and bias is not None) else None
        pending = None  # (work, fp32 partial dX, start, stop): one all_reduce in flight
        for s, e in plan.bounds():
            xc = x[s:e]
            dz_low = None
            if shard.v_local:  # an empty slice has no logit: no dW/db, no dX term
                c = _chunk_logits(xc, w, bias, acc, opts.softcap)
                # in place where it can be: one [C, V_local] block beside c (the budget's two)
                dz = torch.sub(c, lse[s:e, None]).exp_().mul_(coef[s:e, None])
                dz.scatter_add_(1, y_loc[s:e, None], tgt[s:e, None])
                if opts.uses_smoothing:
                    dz.addr_(sm[s:e], cw.to(dz.dtype), alpha=-1)
                if opts.softcap is not None:
                    dz.mul_(c.div_(opts.softcap).square_().neg_().add_(1))
                del c
                if db is not None:
                    common.accumulate_rows_(db, dz, first=s == 0)
                dz_low = dz.to(x.dtype)
                del dz
                if dw is not None:
                    common.accumulate_mm_(dw, dz_low.t(), xc, first=s == 0)
            if dx is not None:
                part = torch.empty(e - s, x.shape[1], dtype=acc, device=x.device)
                if dz_low is None:
                    part.zero_()  # ... but the rank still joins the chunk's all-reduce
                else:
                    common.accumulate_mm_(part, dz_low, w, first=True)
                # finish the previous chunk's reduction before starting this one: one fp32
                # chunk buffer in flight, overlapping the next chunk's GEMMs on NCCL
                _finish(pending, dx)
                pending = (dist.all_reduce(part, group=shard.group, async_op=True), part, s, e)
            del dz_low
        _finish(pending, dx)
        return (dx, None if dw is None else dw.to(w.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None, None)


# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; 2.11 has
# only the old name. Same arguments.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _finish(pending, dx):
    if pending is not None:
        work, part, s, e = pending
        work.wait()
        dx[s:e].copy_(part)


def _assert_tiling(scalars, v):
    """Device-side check that the ranks' slices tile [0, V), V >= 1, and agree on V (no host
    sync): slices inside [0, V), pairwise disjoint, their sizes summing to V. (Not a chain
    of slices sorted by start: that misreads an empty slice [a, a) beside [a, b).)"""
    start, size = scalars[:, _S_START], scalars[:, _S_VLOCAL]
    stop = start + size
    empty = size == 0
    itself = torch.eye(len(size), dtype=torch.bool, device=size.device)
    apart = (stop[:, None] <= start[None, :]) | (stop[None, :] <= start[:, None]) | \
        empty[:, None] | empty[None, :] | itself
    ok = (scalars[:, _S_V] == v).all() & (start >= 0).all() & (stop <= v).all() & \
        apart.all() & (size.sum() == v) & (v >= 1)
    torch._assert_async(ok, "vocab-parallel linear_cross_entropy: the ranks' linear_weight "
                            "slices do not tile [0, vocab_size) with vocab_size >= 1 (check "
                            "vocab_start_index and vocab_size on every rank of process_group)")


def _int_arg(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return int(value)


def resolve_shard(process_group, v_local: int, vocab_start_index=None, vocab_size=None) -> _Shard:
    """This rank's slice of the vocabulary; errors name the argument."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group was given but torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    # what torch.distributed.new_group returns on a rank outside the new group (an int)
    if type(process_group) is int and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("process_group does not contain this process (it is "
                         "torch.distributed.GroupMember.NON_GROUP_MEMBER, which new_group "
                         "returns on ranks outside the group): call the vocab-parallel loss "
                         "only on the group's ranks")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD), got {type(process_group).__name__}")
    rank = dist.get_rank(group=process_group)
    world = dist.get_world_size(group=process_group)
    v0 = rank * v_local if vocab_start_index is None else _int_arg("vocab_start_index",
                                                                   vocab_start_index)
    v = world * v_local if vocab_size is None else _int_arg("vocab_size", vocab_size)
    if v0 < 0 or v0 + v_local > v:
        raise ValueError(
            f"this rank's linear_weight slice [vocab_start_index, vocab_start_index + V_local) "
            f"= [{v0}, {v0 + v_local}) does not lie in [0, vocab_size={v})")
    return _Shard(process_group, rank, world, v_local, v0, v)


def vocab_parallel_linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions,
                                        shard: _Shard, *, chunk_size=None, memory_budget=None):
    """Returns ``(loss, lse)`` like a backend; ``p`` holds this rank's slices (V = V_local)."""
    bytes_per = 2 * torch.finfo(_acc_dtype(p.x)).bits // 8  # fp32 logits + their gradient
    # Planned on a width every rank knows (not V_local): the backward all-reduces dX once per
    # chunk, and ranks with different plans would pair collectives of different sizes.
    width = max(1, -(-shard.v // shard.world))  # V = 0 is left to the forward's device assert
    plan = plan_token_chunks(p.problem.n, width, bytes_per_element=bytes_per,
                             budget_bytes=memory_budget, chunk_size=chunk_size)
    return _VocabParallelLinearCrossEntropy.apply(p.x, p.w, p.bias, p.y, p.class_weight, opts,
                                                  plan, shard)
