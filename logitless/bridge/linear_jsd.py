"""``logitless.torch.linear_jsd(..., backend="pallas")``: the JAX/Pallas port called from
PyTorch through the bridge.

:func:`logitless.jax.linear_jsd` runs as a :class:`~logitless.bridge.autograd.JaxFunction`:
forward and backward are each one jit-compiled JAX call, compiled once per (options, tuning,
shapes, dtypes), and every tensor crosses zero-copy. The copies that can happen, all small or
caused by the caller's layout: int64 targets become int32 (after the front door's sync-free
range check); hidden states that are not contiguous after flattening are made contiguous; the
heads are used as they are when contiguous ``(V, H)`` or transposes of contiguous ``(H, V)``
(both heads must then share one layout: a teacher head in the other layout is copied).
``mean``/``sum`` take the JAX backend's fused path (gradients in the forward sweep).
"""
from __future__ import annotations

import importlib

import torch

from .. import _torch_common as common
from .. import _torch_jsd as jsd_common
from .. import _jax_jsd as jax_jsd
from ..specs import linear_jsd as spec
from .autograd import (JaxFunction, refuse_functorch, refuse_interpret_x64,
                       refuse_wide_ignore_index)

__all__ = ["TUNING", "linear_jsd"]
# the front door leaves the target range check to bridged() (after the torch.func refusal)
CHECKS_TARGETS = True

_JAX_BACKEND = "pallas"
_JAX_BACKEND_MODULES = {"pallas": "logitless.pallas_kernels.linear_jsd",
                        "xla": "logitless.xla_jsd"}


def __getattr__(name):
    # TUNING is the Pallas backend's: read on demand so importing this imports no kernels
    if name == "TUNING":
        return tuple(importlib.import_module(_JAX_BACKEND_MODULES[_JAX_BACKEND]).TUNING)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _jax_loss(xs, ws, xt, wt, y, *, opts, layout, backend, tuning, needs):
    return jax_jsd.run(xs, ws, xt, wt, y, opts, layout, backend, dict(tuning), needs)


_OP = JaxFunction(_jax_loss, name="linear_jsd",
                  no_double_backward=common.NO_DOUBLE_BACKWARD.format(op="linear_jsd"))


def _in_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """``w`` (V, H) as the tensor JAX reads for ``layout`` (a view when the strides allow)."""
    t = w if layout == "vh" else w.t()
    return t if t.is_contiguous() else t.contiguous()


# Dynamo cannot trace JAX or DLPack: under torch.compile the whole bridged call is one graph
# break that runs eagerly (its checks too: traced, each was a break of its own)
@torch.compiler.disable
def bridged(p: jsd_common.Prepared, opts: spec.LinearJSDOptions, jax_backend: str, tuning):
    """The torch-backend contract over any JAX backend ("pallas", "xla")."""
    refuse_functorch("linear_jsd", p.xs, p.ws, p.xt, p.wt, p.y)
    refuse_wide_ignore_index(opts.ignore_index)
    if p.y is not None:  # after: vmap can't batch it
        common.check_targets(p.y, p.problem.v, opts.ignore_index)
    if torch.float64 in (p.xs.dtype, p.xt.dtype):
        raise TypeError("float64 inputs are not supported by the JAX backends (JAX runs "
                        "without x64); use backend='torch' or float32")
    layout = "hv" if (not p.ws.is_contiguous() and p.ws.t().is_contiguous()) else "vh"
    if jax_backend == "pallas" and not p.xs.is_cuda and "interpret" not in tuning:
        tuning = {**tuning, "interpret": True}  # CPU tensors: a CPU computation
    needs = (p.xs.requires_grad, p.ws.requires_grad)  # a frozen head costs no dW GEMM
    if jax_backend == "pallas":
        refuse_interpret_x64("linear_jsd", tuning.get("interpret"), needs)
    return _OP(p.xs.contiguous(), _in_layout(p.ws, layout), p.xt.contiguous(),
               _in_layout(p.wt, layout), p.y, opts=opts, layout=layout, backend=jax_backend,
               tuning=tuple(sorted(tuning.items())), needs=needs)


def linear_jsd(p: jsd_common.Prepared, opts: spec.LinearJSDOptions, **tuning):
    """The loss (float32) reduced per ``opts.reduction`` (flat ``(N,)`` for "none"),
    differentiable w.r.t. the student's input and weight."""
    return bridged(p, opts, _JAX_BACKEND, tuning)
