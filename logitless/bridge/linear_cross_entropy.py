"""``logitless.torch.linear_cross_entropy(..., backend="pallas")``: the JAX/Pallas port called
from PyTorch through the bridge.

The JAX front door (:func:`logitless.jax.linear_cross_entropy`, ``backend="pallas"``) runs as a
:class:`~logitless.bridge.autograd.JaxFunction`: forward and backward are each one
jit-compiled JAX call, compiled once per (options, tuning, shapes, dtypes), and every tensor
crosses zero-copy. The copies that can happen, all small or caused by the caller's layout:

* int64 targets become int32 (4·N bytes; JAX runs without x64), after a range check that
  costs no host sync;
* ``input`` that is not contiguous (after flattening to ``(N, H)``) is made contiguous;
* ``linear_weight`` is used as it is when it is contiguous ``(V, H)`` or the transpose of a
  contiguous ``(H, V)`` (a tied embedding seen as ``E.T``: passed with ``weight_layout="hv"``);
  any other strides are made contiguous;
* an upstream gradient with stride 0 (e.g. from ``loss.sum()`` with ``reduction="none"``) is
  materialized (N floats).

Without ``return_lse``, ``mean``/``sum`` use the JAX backend's fused path (gradients computed in
the forward sweep, backward only scales them) -- the same program ``jax.value_and_grad`` runs.
"""
from __future__ import annotations

import importlib

import torch

from .. import _torch_common as common
from .. import jax as lj
from ..specs import linear_cross_entropy as spec
from .autograd import (JaxFunction, refuse_functorch, refuse_interpret_x64,
                       refuse_wide_ignore_index)

__all__ = ["TUNING", "linear_cross_entropy"]
# the front door leaves the target range check to bridged() (after the torch.func refusal)
CHECKS_TARGETS = True

_JAX_BACKEND = "pallas"
_JAX_BACKEND_MODULES = {"pallas": "logitless.pallas_kernels.linear_cross_entropy",
                        "xla": "logitless.xla_chunked"}


def __getattr__(name):
    # ``TUNING`` is the Pallas backend's: read it when asked (PEP 562), so that importing this
    # module does not import the Pallas kernels.
    if name == "TUNING":
        return tuning_keywords(_JAX_BACKEND)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tuning_keywords(jax_backend: str):
    """The tuning keywords of a JAX backend of :func:`logitless.jax.linear_cross_entropy`."""
    return tuple(importlib.import_module(_JAX_BACKEND_MODULES[jax_backend]).TUNING)


def _jax_loss(x, w, y, bias, class_weight, *, opts, layout, backend, tuning, needs):
    out = lj._run(x, w, y, bias, class_weight, opts, layout, backend, dict(tuning), needs)
    return out if opts.return_lse else (out,)


_OP = JaxFunction(_jax_loss, name="linear_cross_entropy",
                  no_double_backward=common.NO_DOUBLE_BACKWARD.format(op="linear_cross_entropy"))


def _weight_and_layout(w: torch.Tensor):
    """``(tensor, weight_layout)`` JAX reads without a relayout: (V, H) or its transpose."""
    if w.is_contiguous():
        return w, "vh"
    if w.t().is_contiguous():
        return w.t(), "hv"
    return w.contiguous(), "vh"


# Dynamo cannot trace JAX or DLPack: under torch.compile the whole bridged call is one graph
# break that runs eagerly (its checks too: traced, each was a break of its own)
@torch.compiler.disable
def bridged(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, jax_backend: str, tuning):
    """The torch-backend contract over any JAX backend (``"pallas"``, ``"xla"``)."""
    refuse_functorch("linear_cross_entropy", p.x, p.w, p.y, p.bias, p.class_weight)
    refuse_wide_ignore_index(opts.ignore_index)
    common.check_targets(p.y, p.problem.v, opts.ignore_index)  # after: vmap can't batch it
    if p.x.dtype == torch.float64:
        raise TypeError("float64 inputs are not supported by the JAX backends (JAX runs "
                        "without x64); use backend='torch' or float32")
    w, layout = _weight_and_layout(p.w)
    if jax_backend == "pallas" and not p.x.is_cuda and "interpret" not in tuning:
        # CPU tensors make a CPU computation even where JAX's default backend is a GPU
        tuning = {**tuning, "interpret": True}
    # the gradients autograd will ask for: a frozen head (LoRA) or input costs no dW / dX
    # GEMM, and the fused forward keeps no float32 [V, H] dW for it
    needs = tuple(t is not None and t.requires_grad for t in (p.x, p.w, p.bias))
    if jax_backend == "pallas":
        refuse_interpret_x64("linear_cross_entropy", tuning.get("interpret"), needs)
    out = _OP(p.x.contiguous(), w, p.y, p.bias, p.class_weight, opts=opts, layout=layout,
              backend=jax_backend, tuning=tuple(sorted(tuning.items())), needs=needs)
    return (out[0], out[1]) if opts.return_lse else (out[0], None)


def linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, **tuning):
    """Returns ``(loss, lse)``: loss (float32) reduced per ``opts.reduction`` (flat ``(N,)`` for
    "none"), lse ``(N,)`` when ``opts.return_lse`` else ``None`` (not computed, so that mean/sum
    take the fused path); both differentiable w.r.t. x, W and bias."""
    return bridged(p, opts, _JAX_BACKEND, tuning)
