"""``backend="xla"``: the spec in plain JAX ops, chunked over tokens.

What CPU (and TPU) users get. The chunk loop, the custom VJP and the GEMMs are the shared
driver of :mod:`logitless._jax_common`; this module only supplies the per-chunk head, whose
elementwise work XLA fuses. At most one ``[chunk, V]`` block of logits (and its float32 working
copy) exists at a time; dW accumulates in float32.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from . import _jax_common as common
from .specs import linear_cross_entropy as spec

TUNING = ("chunk_size", "memory_budget")


@dataclasses.dataclass(frozen=True)
class XlaHead(common.Head):
    softcap: float | None
    smoothing: bool

    def _capped(self, z, bias):
        z = z.astype(jnp.float32)
        if bias is not None:
            z = z + bias.astype(jnp.float32)[None, :]
        return common.capped(z, self.softcap)

    def _stats(self, c, y, coefs, cw):
        lse = jnp.max(c, axis=1)
        lse = lse + jnp.log(jnp.sum(jnp.exp(c - lse[:, None]), axis=1))
        is_target = lax.broadcasted_iota(jnp.int32, c.shape, 1) == y[:, None]
        c_y = jnp.sum(jnp.where(is_target, c, 0.0), axis=1)
        wc = None
        if self.smoothing:
            wc = jnp.sum(c, axis=1) if cw is None else \
                jnp.dot(c, cw, precision=lax.Precision.HIGHEST)  # full fp32, as the GEMMs
        k = coefs
        loss = common.token_loss(lse, c_y, wc, k[common.B], k[common.SM], k[common.SMO],
                                 k[common.ZW])
        return loss, lse, is_target

    def loss_lse(self, z, y, coefs, bias, cw):
        loss, lse, _ = self._stats(self._capped(z, bias), y, coefs, cw)
        return loss, lse

    def loss_lse_grad(self, z, y, coefs, bias, cw, grad_dtype):
        c = self._capped(z, bias)
        loss, lse, is_target = self._stats(c, y, coefs, cw)
        k = coefs
        dz = common.grad_logits(c, lse, is_target, cw, k[common.B], k[common.SM],
                                k[common.SMO], k[common.ZW], k[common.G], k[common.H],
                                softcap=self.softcap, smoothing=self.smoothing)
        return loss, lse, dz.astype(grad_dtype)


def linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, *,
                         chunk_size=None, memory_budget=None):
    """Returns ``(loss, lse)``: loss reduced per ``opts.reduction`` (flat for "none")."""
    # budget the float32 working copy of a chunk's logits and of their gradient
    plan = common.token_plan(p.problem.n, p.problem.v, bytes_per_element=8,
                             budget_bytes=memory_budget, chunk_size=chunk_size)
    head = XlaHead(softcap=opts.softcap, smoothing=opts.uses_smoothing)
    return common.chunked_linear_cross_entropy(p, opts, plan, head)
