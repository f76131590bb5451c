"""``backend="xla"`` for linear JSD: the spec in plain JAX ops, chunked over tokens.

What CPU (and TPU) users get. The chunk loop, the custom VJP and the GEMMs are the shared
driver of :mod:`logitless._jax_jsd`; this module only supplies the per-chunk head, the shared
row-block math applied to whole rows, whose elementwise work XLA fuses. At most one chunk of
float32 student and teacher logits (and their float32 working arrays) exists at a time; dW
accumulates in float32.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from . import _jax_jsd as jc
from .specs import linear_jsd as spec

TUNING = ("chunk_size", "logits_chunk_size", "memory_budget")
_TEMPORARIES = 8  # live [sub-chunk, V] float32 arrays of the head, budgeted by the plan
_LOGITS_SHARE = 4


@dataclasses.dataclass(frozen=True)
class XlaHead(jc.Head):
    kind: str
    beta: float
    temperature: float
    hard_w: float
    t_one: bool

    logits_dtype = jnp.float32  # JSD needs unrounded logits (see the spec)

    def _rows(self, zs, zt, y, coef, grad_dtype):
        zs, zt = zs.astype(jnp.float32), zt.astype(jnp.float32)
        inv_t = 1.0 / self.temperature
        hard = self.hard_w > 0
        is_target = (lax.broadcasted_iota(jnp.int32, zs.shape, 1) == y[:, None]
                     if y is not None else jnp.zeros(zs.shape, bool))
        kw = dict(inv_t=inv_t, kind=self.kind, hard=hard, t_one=self.t_one)
        stats = jc.stats_update(jc.stats_init(zs.shape[0]), zs, zt, jc.scaled_gap(zs, zt, inv_t),
                                None, is_target, **kw)
        rows, l_z, z_y, kl = jc.stats_finish(stats, **kw)
        if self.kind == "jsd":
            zero = jnp.zeros_like(l_z)
            k, jj, qs = jc.jsd_sums_update((zero,) * 3, zs, zt, rows, None, beta=self.beta,
                                           inv_t=inv_t)
            kk = jc.jsd_k(k, qs)
        else:
            kk = jj = kl
        loss = jc.row_loss(jj, l_z, z_y, self.hard_w, hard)
        if grad_dtype is None:
            return loss
        dz = jc.grad_block(zs, zt, is_target, rows, l_z, kk, coef, coef * self.hard_w,
                           beta=self.beta, **kw)
        return loss, dz.astype(grad_dtype)

    def loss(self, zs, zt, y):
        return self._rows(zs, zt, y, None, None)

    def loss_grad(self, zs, zt, y, coef, grad_dtype):
        return self._rows(zs, zt, y, coef, grad_dtype)


def linear_jsd(p: jc.Prepared, opts: spec.LinearJSDOptions, *, chunk_size=None,
               logits_chunk_size=None, memory_budget=None):
    """The loss reduced per ``opts.reduction`` (flat for "none"). ``chunk_size``: tokens per
    dX / dW chunk; ``logits_chunk_size``: tokens per logits GEMM and head call;
    ``memory_budget``: bytes for both (default 1 GiB)."""
    plan, sub = jc.plan_chunks(p, True, _LOGITS_SHARE, memory_budget, chunk_size,
                               logits_chunk_size, temporaries=_TEMPORARIES)
    head = XlaHead(kind=opts.kind, beta=opts.beta, temperature=opts.temperature,
                   hard_w=opts.hard_loss_weight, t_one=opts.temperature == 1.0)
    return jc.chunked_linear_jsd(p, opts, plan, head, sub)
