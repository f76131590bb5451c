"""Any JAX function as a ``torch.autograd`` op, through ``jax.vjp``.

``JaxFunction(fn)`` wraps ``fn(*arrays, **static) -> array | tuple of arrays``; calling it with
torch tensors (or ``None``) positionally and hashable Python values as keywords runs ``fn`` in
JAX and returns torch tensors that PyTorch autograd can differentiate::

    op = JaxFunction(my_jax_loss)                  # once, at module level
    loss, lse = op(x, w, targets, reduction="mean")  # tensors in, tensors out
    loss.backward()                                # jax.vjp runs; x.grad, w.grad are set

How it works, and what it costs:

* Forward is one jit-compiled call of ``jax.vjp(fn, *differentiable inputs)``; backward one
  jit-compiled call of the pullback. Both are compiled once per static config and input
  signature -- shapes included: every new token count compiles anew (pad to a few sizes when
  it varies) -- and kept in a least-recently-used cache on the ``JaxFunction``
  (``cache_size`` signatures, 32 by default; an evicted one compiles again when it returns).
  Every tensor crosses zero-copy (:mod:`.dlpack`), in both directions, with CUDA stream
  ordering by events.
* Differentiable inputs are the floating tensors that require grad (when grad mode is on);
  everything else -- integer targets, class weights -- enters as a constant, and gets
  ``None`` as its gradient. With nothing to differentiate, only ``jit(fn)`` runs.
* The pullback's residuals are stored with ``ctx.save_for_backward`` as zero-copy torch
  views, so PyTorch owns their lifetime (freed after backward unless ``retain_graph``;
  ``saved_tensors_hooks`` apply) and catches in-place modification of saved inputs. A
  residual that *is* one of the inputs (e.g. ``x`` and ``W`` kept by a ``custom_vjp``) is not
  returned from the jit-compiled forward -- XLA would copy it -- but re-read from the input.
* Reverse mode only: inputs carrying a forward-mode tangent (``torch.autograd.forward_ad``)
  are refused, as are tensors under a ``torch.func`` transform (they cannot cross DLPack).
* Integer outputs are marked non-differentiable; outputs that receive no gradient (``None``)
  get zeros built inside the compiled backward.
* The inputs may be copied only where :func:`.dlpack.would_copy` says so (e.g. int64 targets
  without x64, non-dense strides); an upstream gradient with stride 0 (the backward of
  ``.sum()``) is materialized before JAX reads it.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import _jax_common as jax_common
from .. import _torch_common as common
from .dlpack import _export, _x64_enabled, to_jax, to_torch

__all__ = ["JaxFunction"]


@dataclasses.dataclass
class _Plan:
    """One compiled forward/backward pair: a static config plus an input signature."""

    fwd: Callable = None
    bwd: Callable = None
    # Filled while tracing the forward (trace-time facts, fixed for this signature):
    out_tree: Any = None          # treedef of fn's output
    out_avals: Tuple = ()         # (shape, dtype) per output leaf
    vjp_tree: Any = None          # treedef of the pullback (its leaves are the residuals)
    sources: Tuple = ()           # per residual leaf: ("in", k) | ("out", i) | ("res", j)


def _kind(t: Optional[torch.Tensor], name: str) -> Optional[str]:
    """None (absent), "d" (differentiated: a floating tensor requiring grad) or "n" (constant)."""
    if t is None:
        return None
    if t.requires_grad and t.is_complex():
        raise TypeError(f"{name}: complex tensors requiring grad are not supported (PyTorch and "
                        "JAX use conjugate conventions for complex gradients)")
    return "d" if (t.requires_grad and t.is_floating_point()) else "n"


def _merge(kinds, diff, other):
    """Rebuild fn's positional arguments from the differentiable and constant arrays."""
    it_d, it_o = iter(diff), iter(other)
    return [None if k is None else next(it_d) if k == "d" else next(it_o) for k in kinds]


def _build_plan(fn, static, kinds) -> _Plan:
    plan = _Plan()

    def forward(diff, other):
        out, pullback = jax.vjp(lambda *d: fn(*_merge(kinds, d, other), **static), *diff)
        out_leaves, plan.out_tree = jax.tree_util.tree_flatten(out)
        res_leaves, plan.vjp_tree = jax.tree_util.tree_flatten(pullback)
        plan.out_avals = tuple((o.shape, o.dtype) for o in out_leaves)
        # A residual that is an input (or an output) would be copied by XLA on the way out of
        # the jit; tracer identity says it is the same value, so hand back the original.
        ins = {id(a): k for k, a in enumerate(list(diff) + list(other))}
        outs = {id(o): i for i, o in enumerate(out_leaves)}
        sources, kept = [], []
        for r in res_leaves:
            if id(r) in ins:
                sources.append(("in", ins[id(r)]))
            elif id(r) in outs:
                sources.append(("out", outs[id(r)]))
            else:
                sources.append(("res", len(kept)))
                kept.append(r)
        plan.sources = tuple(sources)
        return out_leaves, kept

    def backward(residuals, cts, present):
        cts = iter(cts)
        full = []
        for (shape, dtype), here in zip(plan.out_avals, present):
            if not jnp.issubdtype(dtype, jnp.inexact):
                full.append(np.zeros(shape, jax.dtypes.float0))
            elif here:
                full.append(next(cts).astype(dtype))
            else:
                full.append(jnp.zeros(shape, dtype))
        pullback = jax.tree_util.tree_unflatten(plan.vjp_tree, residuals)
        return pullback(jax.tree_util.tree_unflatten(plan.out_tree, full))

    plan.fwd = jax.jit(forward)
    plan.bwd = jax.jit(backward, static_argnums=2)
    return plan


class _Call:
    """Per-call state handed through ``Function.apply`` (not a tensor: autograd ignores it)."""

    def __init__(self, kinds, exported, arrays, no_double_backward):
        self.plan, self.kinds, self.no_double_backward = None, kinds, no_double_backward
        # Inputs in the order the plan numbers them ("in", k): differentiable, then constants.
        d = [i for i, k in enumerate(k for k in kinds if k) if k == "d"]
        n = [i for i, k in enumerate(k for k in kinds if k) if k == "n"]
        self.exported = [exported[i] for i in d + n]
        self.diff = [arrays[i] for i in d]
        self.other = [arrays[i] for i in n]


class _Bridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        plan = call.plan
        out_leaves, kept = plan.fwd(call.diff, call.other)
        outs = [to_torch(o) for o in out_leaves]
        by_source = {"in": call.exported, "out": outs, "res": [to_torch(r) for r in kept]}
        ctx.plan, ctx.kinds, ctx.no_double_backward = plan, call.kinds, call.no_double_backward
        ctx.save_for_backward(*(by_source[kind][i] for kind, i in plan.sources))
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(
            *(o for o, (_, dt) in zip(outs, plan.out_avals) if not jnp.issubdtype(dt, jnp.inexact)))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # create_graph=True: the pullback runs in JAX, outside PyTorch's graph. (A plain
        # once_differentiable errs only when an incoming gradient requires grad, which the
        # gradient of loss.backward() does not: the second-order term vanished silently.)
        if torch.is_grad_enabled():
            raise RuntimeError(ctx.no_double_backward)
        plan, kinds = ctx.plan, ctx.kinds
        present = tuple(g is not None for g in grads)
        if not any(present):
            return (None,) * (1 + len(kinds))
        residuals = [to_jax(t) for t in ctx.saved_tensors]
        cts = [to_jax(g) for g in grads if g is not None]
        it = iter(plan.bwd(residuals, cts, present))
        out: List[Optional[torch.Tensor]] = [None]
        for k, need in zip(kinds, ctx.needs_input_grad[1:]):
            g = next(it) if k == "d" else None
            out.append(to_torch(g) if (g is not None and need) else None)
        return tuple(out)


class _LRU:
    """A dict of at most ``size`` entries, the least recently used dropped first (with it its
    jit-compiled programs, once nothing else holds them)."""

    def __init__(self, size: int):
        self.size = size
        self._d: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()

    def get_or_make(self, key, make: Callable[[], Any]):
        value = self._d.get(key)
        if value is None:
            value = self._d[key] = make()
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        else:
            self._d.move_to_end(key)
        return value

    def __len__(self):
        return len(self._d)

    def keys(self):
        return self._d.keys()

    def values(self):
        return self._d.values()


class JaxFunction:
    """Wrap ``fn(*arrays, **static)`` (a JAX function returning an array or a tuple of arrays)
    as a PyTorch-callable, autograd-aware op. See the module docstring.

    ``name``: what errors and ``repr`` call it (default ``fn.__name__``);
    ``no_double_backward``: the message of the RuntimeError a backward under
    ``create_graph=True`` raises (default: one saying JAX's pullback is not differentiable
    by PyTorch's autograd); ``cache_size``: how many (static config, input signature) pairs
    keep their compiled programs (least recently used dropped first)."""

    def __init__(self, fn: Callable, *, name: Optional[str] = None,
                 no_double_backward: Optional[str] = None, cache_size: int = 32):
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "jax_function")
        # the error for a backward under create_graph=True
        self.no_double_backward = no_double_backward or (
            f"{self.name} (a JaxFunction) has no double backward (create_graph=True): its "
            "backward is JAX's pullback, which PyTorch's autograd cannot differentiate")
        # compiled programs per (static config, kinds, input signature): a jax.jit holds one
        # executable per shape it saw, so each signature gets its own, to be dropped
        self._plans = _LRU(cache_size)
        self._primal = _LRU(cache_size)
        self._lock = threading.Lock()

    def __repr__(self):
        return f"JaxFunction({self.name})"

    def _static_key(self, static):
        bad = [k for k, v in static.items() if not _hashable(v)]
        if bad:
            raise TypeError(f"{self.name}: keyword arguments are static (compiled in) and must be "
                            f"hashable; not hashable: {bad}")
        return tuple(sorted((k, _typed(v)) for k, v in static.items()))

    def _plan(self, static_key, static, kinds, arrays) -> _Plan:
        key = (static_key, kinds, _signature(arrays))
        with self._lock:
            return self._plans.get_or_make(key, lambda: _build_plan(self.fn, static, kinds))

    def _forward_only(self, static_key, static, tensors):
        arrays = [None if t is None else to_jax(t) for t in tensors]
        key = (static_key, _signature(arrays))
        with self._lock:
            f = self._primal.get_or_make(key, lambda: jax.jit(lambda *a: self.fn(*a, **static)))
        out = f(*arrays)
        return jax.tree_util.tree_map(to_torch, out)

    # Dynamo cannot trace into JAX or DLPack: under torch.compile the call is a graph break
    # and runs eagerly (so not under fullgraph=True), instead of failing inside dynamo.
    @torch.compiler.disable
    def __call__(self, *tensors, **static):
        for i, t in enumerate(tensors):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.name}: positional argument {i} must be a torch.Tensor or "
                                f"None, got {type(t).__name__}; pass Python values as keywords")
        refuse_functorch(self.name, *tensors)
        # a dual tensor's tangent would be dropped silently (the op registers a backward only)
        common.refuse_forward_ad(self.name, *((f"argument {i}", t) for i, t in enumerate(tensors)))
        static_key = self._static_key(static)
        kinds = tuple(_kind(t, f"{self.name}: argument {i}") for i, t in enumerate(tensors))
        if not (torch.is_grad_enabled() and "d" in kinds):
            return self._forward_only(static_key, static, tensors)
        exported, arrays = zip(*(_export(t, None) for t in tensors if t is not None))
        call = _Call(kinds, exported, arrays, self.no_double_backward)
        call.plan = self._plan(static_key, static, kinds, call.diff + call.other)
        outs = _Bridge.apply(call, *tensors)
        return jax.tree_util.tree_unflatten(call.plan.out_tree, outs)


# torch.func's wrappers (vmap's BatchedTensor, grad's) have no memory of their own to export
_FUNCTORCH_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def refuse_functorch(name: str, *tensors) -> None:
    """A clear error for tensors under a ``torch.func`` transform (``vmap``, ``grad``, ...):
    they cannot cross to JAX through DLPack (without this, PyTorch's "Batching rule not
    implemented" for some op on the way)."""
    if _FUNCTORCH_WRAPPED is not None and any(
            t is not None and _FUNCTORCH_WRAPPED(t) for t in tensors):
        raise NotImplementedError(
            f"{name}: the JAX bridge (backend='pallas') cannot run under a torch.func "
            "transform (vmap, grad, jacrev, ...): its tensors cross to JAX through DLPack. "
            "Use torch.autograd, backend='triton' or 'torch', or jax.vmap on the JAX side.")


def refuse_wide_ignore_index(ignore_index: int) -> None:
    """The JAX port's int32 check, up front: after the targets cross, the error depended on
    the data (targets holding such an index failed to cross the bridge)."""
    jax_common.check_int32_ignore_index(ignore_index, "the JAX port's targets",
                                        advice="; use backend='torch' or 'triton'")


def refuse_interpret_x64(op: str, interpret, needs) -> None:
    """A PyTorch caller's error for what the interpreted Pallas kernels cannot do: gradients
    under ``jax_enable_x64`` (the kernels' own error tells a JAX caller to pick
    ``backend='xla'``, which a PyTorch caller cannot). ``interpret``: the tuning value (None:
    interpreted off a GPU, as the kernels decide); ``needs``: which inputs want a gradient."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if interpret is True and torch.is_grad_enabled() and any(needs) and _x64_enabled():
        raise NotImplementedError(
            f"{op}(backend='pallas') runs the Pallas interpreter here (CPU tensors, or "
            "interpret=True), which cannot compute gradients while JAX's jax_enable_x64 is on "
            "(a Pallas interpreter limitation). Use backend='torch' (or 'triton' on a GPU), "
            "turn x64 off (jax.config.update('jax_enable_x64', False)), or call it under "
            "torch.no_grad() for the loss alone.")


def _signature(arrays):
    """The input signature a compiled program is specialised to (None: an absent input)."""
    return tuple(None if a is None else (a.shape, str(a.dtype)) for a in arrays)


def _typed(v):
    """``v`` as a cache key that tells apart values Python calls equal across types (True ==
    1 == 1.0, 2 == np.int64(2)): each value keyed with its type, inside tuples, lists,
    frozensets and dataclasses too. Otherwise a call with ``chunk_size=1`` would hand its
    compiled program (already validated) to a later ``chunk_size=True``."""
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_typed(e) for e in v)
    if isinstance(v, frozenset):
        return type(v), frozenset(_typed(e) for e in v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return type(v), tuple(_typed(getattr(v, f.name)) for f in dataclasses.fields(v))
    return type(v), v


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True
