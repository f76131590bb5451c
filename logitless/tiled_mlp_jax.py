"""Tiled MLP for JAX: ``tiled_mlp``, the ready-made ``SwiGLUMLP`` and the fused ``swiglu``
(see :mod:`logitless.specs.tiled_mlp` for the algorithm).

``tiled_mlp(fn, params, x)`` is a ``jax.custom_vjp`` whose residuals are ``params`` and ``x``
only. Its forward walks the shards in a ``lax.fori_loop`` (one traced shard; the ragged last
one traced on its own) writing each into the output; its backward walks them again, writing
``dx`` per shard and summing the parameter gradients in a loop carry (in each leaf's dtype, or
fp32 for half-precision leaves with ``grad_accum_dtype=jnp.float32``), so only one shard's
intermediates are live at a time.

* any ``fn``: ``jax.vjp`` of ``fn`` per shard (XLA drops the unused output GEMM of the
  recompute); each shard's parameter cotangents (in the parameters' dtype) are added to the
  accumulators;
* a :class:`SwiGLUMLP`: the shard backward written out (:func:`_swiglu_shard_grads`):
  gate/up recomputed, the fused SwiGLU kernels, and each weight gradient GEMM emitted in the
  accumulator's dtype and added to it (no per-shard rounding, no per-shard gradient buffer
  once XLA folds the sum into the GEMM).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _jax_common as common
from ._keywords import check_tuning
from .pallas_kernels import swiglu as _pallas
from .specs import tiled_mlp as spec

__all__ = ["tiled_mlp", "SwiGLUMLP", "swiglu"]

HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SWIGLU_BACKENDS = ("pallas", "xla")


# ----------------------------------------------------------------------------- tiled_mlp
def _walk(plan: spec.ShardPlan, first, body, carry):
    """``carry = first(start, size)`` on the first shard (so it may create the carry), then
    ``carry = body(start, size, carry)`` over the other full shards (a loop) and the tail."""
    size, full, tail = plan.shard, plan.full_shards, plan.tail
    carry = first(0, size if full else tail) if first is not None else carry
    start = 1 if first is not None else 0
    if full - start == 1:
        carry = body(start * size, size, carry)
    elif full - start > 1:
        carry = lax.fori_loop(start, full, lambda i, c: body(i * size, size, c), carry)
    if full and tail:
        carry = body(full * size, tail, carry)
    return carry


def _accum_dtype(dtype, accum_fp32: bool, num_shards: int):
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if (accum_fp32 and num_shards > 1 and dtype in HALF_DTYPES) \
        else dtype


def _tiled(fn, plan: spec.ShardPlan, x_shape, accum_fp32: bool, out_shape, out_dtype,
           fused: bool):
    n, hidden = plan.n, x_shape[-1]
    h_out = out_shape[-1]
    shard_in = lambda size: spec.shard_shape(x_shape, size)
    shard_out = lambda size: spec.shard_shape(x_shape, size)[:-1] + (h_out,)
    tokens = lambda a, start, size: lax.dynamic_slice_in_dim(a, start, size, axis=0)
    acc_dtype = lambda leaf: _accum_dtype(leaf.dtype, accum_fp32, plan.num_shards)

    def forward(params, x):
        x2 = jnp.reshape(x, (n, hidden))

        def body(start, size, y2):
            ys = fn(params, jnp.reshape(tokens(x2, start, size), shard_in(size)))
            return lax.dynamic_update_slice_in_dim(
                y2, jnp.reshape(ys, (size, h_out)).astype(out_dtype), start, 0)

        y2 = _walk(plan, None, body, common.zeros_like_axes((n, h_out), out_dtype, x2))
        return jnp.reshape(y2, tuple(x_shape[:-1]) + (h_out,))

    @jax.custom_vjp
    def f(params, x):
        return forward(params, x)

    def f_fwd(params, x):
        return forward(params, x), (params, x)

    def f_bwd(res, dy):
        params, x = res
        x2 = jnp.reshape(x, (n, hidden))
        dy2 = jnp.reshape(dy, (n, h_out)).astype(out_dtype)

        def step(start, size, acc):
            """(parameter-gradient accumulators, dx of the shard); ``acc`` is None on the
            first shard, which creates the accumulators by assignment (no zero-fill)."""
            xs, dys = tokens(x2, start, size), tokens(dy2, start, size)
            if fused:
                return _swiglu_shard_grads(fn, params, xs, dys, acc, acc_dtype)
            shard_fn = lambda p, xs: fn(p, jnp.reshape(xs, shard_in(size)))
            _, vjp = jax.vjp(shard_fn, params, xs)
            dp, dxs = vjp(jnp.reshape(dys, shard_out(size)))
            if acc is None:
                return jax.tree_util.tree_map(lambda g: g.astype(acc_dtype(g)), dp), dxs
            return jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, dp), dxs

        def first(start, size):
            acc, dxs = step(start, size, None)
            dx2 = common.zeros_like_axes((n, hidden), x2.dtype, x2)
            return acc, lax.dynamic_update_slice_in_dim(dx2, dxs.astype(x2.dtype), start, 0)

        def body(start, size, carry):
            acc, dx2 = carry
            acc, dxs = step(start, size, acc)
            return acc, lax.dynamic_update_slice_in_dim(dx2, dxs.astype(x2.dtype), start, 0)

        acc, dx2 = _walk(plan, first, body, None)
        dparams = jax.tree_util.tree_map(lambda a, p: a.astype(p.dtype), acc, params)
        return dparams, jnp.reshape(dx2, x.shape)

    f.defvjp(f_fwd, f_bwd)
    return f


# Built and jit-compiled once per (fn, plan, ...): an eager call then compiles once, not on
# every call. Only for a SwiGLUMLP itself (a frozen dataclass of ints: hashed by value, holds
# no arrays). Any other fn may read state that changes between calls (an attribute, a
# closed-over variable) or close over an outer trace's values: keyed by identity, a cached
# program would replay stale values or leak tracers, so it is built (and traced) per call.
_tiled_jit = functools.lru_cache(maxsize=64)(lambda *key: jax.jit(_tiled(*key)))


def _tiled_fn(fn, *key):
    return _tiled_jit(fn, *key) if type(fn) is SwiGLUMLP else _tiled(fn, *key)


def _swiglu_shard_grads(mlp, params, xs, dys, acc, acc_dtype):
    """One shard's backward of a :class:`SwiGLUMLP`, written out: recompute gate and up only
    (not the shard's output), and add each weight gradient to its accumulator straight from
    the GEMM in the accumulator's dtype (fp32: no per-shard rounding, and XLA can run the sum
    as the GEMM's beta=1 epilogue in place). ``xs (n, H)``, ``dys (n, H_out)``."""
    pg, pu, pd = (params[k] for k in ("gate_proj", "up_proj", "down_proj"))
    g, u = _dense(xs, pg), _dense(xs, pu)
    backend = _resolve_backend(mlp.backend)
    fwd, bwd = _swiglu_kernels(backend)
    over_tokens = (((0,), (0,)), ((), ()))   # aᵀ·b, the tokens contracted
    times_wt = (((1,), (1,)), ((), ()))      # a·Wᵀ for a (in, out) kernel W

    def add(path, value):
        prev = acc
        for k in path:
            prev = None if prev is None else prev[k]
        return value if prev is None else prev + value

    def weight_grad(name, a, b):
        kernel = params[name]["kernel"]
        d = lax.dot_general(a, b, over_tokens, preferred_element_type=acc_dtype(kernel))
        return add((name, "kernel"), d)

    def bias_grad(name, d):
        return add((name, "bias"), jnp.sum(d, axis=0, dtype=acc_dtype(params[name]["bias"])))

    h = fwd(g, u)
    new = {"down_proj": {"kernel": weight_grad("down_proj", h, dys)}}
    # The Pallas SwiGLU backward writes dg, du over g, u (input_output_aliases). Nothing
    # ordered it after the forward kernel's reads of g, u, so XLA copied both first (H100,
    # TARGETS shape: temp 537 -> 453 MB, ~2 ms without): the barrier makes h (so those reads)
    # a dependency of the g, u the backward gets. The XLA SwiGLU overwrites nothing, and the
    # barrier would only keep XLA from fusing h into its consumers.
    if backend == "pallas":
        g, u, _ = lax.optimization_barrier((g, u, h))
    dg, du = bwd(lax.dot_general(dys, pd["kernel"], times_wt), g, u)
    new["gate_proj"] = {"kernel": weight_grad("gate_proj", xs, dg)}
    new["up_proj"] = {"kernel": weight_grad("up_proj", xs, du)}
    for name, d in (("gate_proj", dg), ("up_proj", du), ("down_proj", dys)):
        if "bias" in params[name]:
            new[name]["bias"] = bias_grad(name, d)
    dxs = lax.dot_general(dg, pg["kernel"], times_wt) + lax.dot_general(du, pu["kernel"], times_wt)
    return new, dxs


def _is_plain_swiglu(fn, params) -> bool:
    """A :class:`SwiGLUMLP` (not a subclass) with parameters of its own layout."""
    if type(fn) is not SwiGLUMLP or not isinstance(params, dict) or \
            set(params) != {"gate_proj", "up_proj", "down_proj"}:
        return False
    want = {"kernel", "bias"} if fn.bias else {"kernel"}
    return all(isinstance(p, dict) and set(p) == want for p in params.values())


def _hoist_closure(fn, params, x_shape, dtype, plan: spec.ShardPlan):
    """``(fn, params)`` with the values ``fn`` closes over that are being differentiated (a
    Flax NNX module's parameters under ``nnx.grad``, a weight closed over under ``jax.grad``)
    made explicit inputs, so that the custom VJP gives them gradients: closed over, they
    would leak a tracer out of it. ``jax.closure_convert`` hoists only such values (constants
    stay closed over) and is specialised to shapes: one conversion per shard size. It caches
    on the function it is given, so it gets a fresh wrapper each time (``fn`` itself may close
    over other values on the next call: a cache hit would replay stale ones), and only where
    ``fn`` closes over a traced value at all (each call would otherwise add a cache entry
    holding ``fn``'s constants)."""
    sizes = sorted({plan.shard if plan.full_shards else plan.tail, plan.tail} - {0})
    probes = {s: jax.ShapeDtypeStruct(spec.shard_shape(x_shape, s), dtype) for s in sizes}
    closed = jax.make_jaxpr(lambda p, xs: fn(p, xs))(params, probes[sizes[0]]).consts
    if not any(isinstance(c, jax.core.Tracer) for c in closed):
        return fn, params
    converted, hoisted = {}, []
    for size in sizes:
        conv, consts = jax.closure_convert(lambda p, xs: fn(p, xs), params, probes[size])
        converted[size] = (conv, len(hoisted), len(consts))
        hoisted += consts
    if not hoisted:
        return fn, params

    def explicit(p, xs):
        conv, first, count = converted[xs.shape[-2]]
        return conv(p[0], xs, *p[1][first:first + count])
    return explicit, (params, tuple(hoisted))


def tiled_mlp(fn, params, x, *, num_shards: Optional[int] = None,
              grad_accum_dtype=None):
    """``fn(params, x)`` computed shard by shard over the tokens, recomputed in backward.

    Args:
        fn: ``fn(params, x_shard) -> y_shard``, position-wise (``[..., n, H] -> [..., n,
            H_out]``) and deterministic, e.g. a :class:`SwiGLUMLP` (no dropout: a key closed
            over would draw the same mask in every shard). Values it closes over may be
            differentiated too (e.g. ``lambda _, x: module(x)`` for a Flax NNX module under
            ``nnx.grad``): they are hoisted into explicit inputs of the custom VJP
            (``jax.closure_convert``).
        params: a pytree of floating arrays.
        x: ``[..., T, H]`` (e.g. ``[B, T, H]`` or ``[T, H]``). The ``B·T`` tokens are split
            into ``num_shards`` shards of ``ceil(B·T / num_shards)`` consecutive tokens (the
            last one shorter); ``fn`` sees each as ``[1, …, 1, n, H]``.
        num_shards: default ``ceil(T / H)``.
        grad_accum_dtype: ``None`` (default) sums parameter cotangents over shards in each
            leaf's dtype; ``jnp.float32`` sums half-precision ones in fp32 and rounds once
            (more accurate, fp32 accumulators in the backward's temp memory).

    Works under ``jax.jit``, ``jax.grad``, ``jax.vjp`` and ``jax.vmap``, inside
    ``jax.shard_map`` (parameters replicated over a data axis get the sum of the shards'
    gradients) and with Explicit mesh axes (the shard loop runs under ``auto_axes``).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(params, x), got {type(fn).__name__}")
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"x must be a jax.Array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got {x.dtype}")
    if grad_accum_dtype is not None and jnp.dtype(grad_accum_dtype) != jnp.float32:
        raise ValueError("grad_accum_dtype must be jnp.float32 or None (each leaf's own dtype), "
                         f"got {grad_accum_dtype!r}")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(f"params{jax.tree_util.keystr(path)} must be a floating array, got "
                            f"{getattr(leaf, 'dtype', type(leaf).__name__)}; pass anything "
                            "else to fn by closure")
    plan = spec.plan_shards(x.shape, num_shards)
    probe = jax.ShapeDtypeStruct(spec.shard_shape(x.shape, max(plan.shard, 1)), x.dtype)
    out_spec = jax.eval_shape(fn, params, probe)
    if not isinstance(out_spec, jax.ShapeDtypeStruct):
        raise TypeError(f"fn must return one array, got {out_spec}")
    if tuple(out_spec.shape[:-1]) != probe.shape[:-1]:
        raise ValueError(f"fn must be position-wise: a shard of shape {list(probe.shape)} gave "
                         f"an output of shape {list(out_spec.shape)}")
    if plan.n == 0:
        return fn(params, x)
    fused = _is_plain_swiglu(fn, params)
    if not fused:
        fn, params = _hoist_closure(fn, params, tuple(x.shape), x.dtype, plan)
    tiled = _tiled_fn(fn, plan, tuple(x.shape), grad_accum_dtype is not None,
                      tuple(out_spec.shape), jnp.dtype(out_spec.dtype), fused)

    def run(params, x):
        # inside shard_map: x and every parameter vary over the same mesh axes (the custom
        # VJP's cotangents have their primals' types; the casts' transposes psum dparams over
        # data-parallel axes, dx over axes only the parameters are split on)
        leaves, tree = jax.tree_util.tree_flatten(params)
        *leaves, x = common.match_varying(*leaves, x)
        return tiled(jax.tree_util.tree_unflatten(tree, leaves), x)

    # an Explicit token sharding: the shard loop runs under auto_axes, the output sharded
    # like x's tokens
    return common.on_auto_axes(
        run, (params, x), lambda: jax.sharding.PartitionSpec(*common.spec_of(x)[:-1], None))


# ----------------------------------------------------------------------------- SwiGLU
def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _swiglu_xla_value(gate, up):
    c = _compute_dtype(gate.dtype)
    return _pallas.swiglu_math(gate.astype(c), up.astype(c)).astype(gate.dtype)


# The rules call the plain math, not the custom_vjp function: under forward-mode over reverse
# (jax.hessian, jvp of grad) the fwd rule runs inside the outer JVP, which a custom_vjp refuses.
_swiglu_xla = jax.custom_vjp(_swiglu_xla_value)


def _swiglu_xla_fwd(gate, up):
    return _swiglu_xla_value(gate, up), (gate, up)


def _swiglu_xla_bwd(res, dh):
    gate, up = res
    c = _compute_dtype(gate.dtype)
    dg, du = _pallas.swiglu_grad_math(dh.astype(c), gate.astype(c), up.astype(c))
    return dg.astype(gate.dtype), du.astype(up.dtype)


_swiglu_xla.defvjp(_swiglu_xla_fwd, _swiglu_xla_bwd)


def _resolve_backend(backend):
    if backend is None:
        backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend not in SWIGLU_BACKENDS:
        raise ValueError(f"backend must be None or one of {SWIGLU_BACKENDS}, got {backend!r}")
    return backend


def _swiglu_xla_forward(gate, up):
    return _swiglu_xla_fwd(gate, up)[0]


def _swiglu_xla_backward(grad_h, gate, up):
    return _swiglu_xla_bwd((gate, up), grad_h)


def _swiglu_kernels(backend):
    """(forward, backward) of the SwiGLU alone (no autodiff) for a resolved ``backend``."""
    if backend == "pallas":
        return _pallas.swiglu_forward, _pallas.swiglu_backward
    return _swiglu_xla_forward, _swiglu_xla_backward


def swiglu(gate, up, *, backend: Optional[str] = None, **tuning):
    """``silu(gate) * up``, differentiable, computed in fp32 and rounded once; only ``gate`` and
    ``up`` are saved for backward.

    ``backend``: ``None`` ("pallas" when JAX's default backend is a GPU, else "xla"),
    ``"pallas"`` (the Pallas kernels; ``tuning``: ``block_rows``, ``block_cols``,
    ``num_warps``, ``interpret``) or ``"xla"`` (the same math in jnp, fused by XLA).
    """
    if _resolve_backend(backend) == "pallas":
        check_tuning("swiglu", tuning, ("gate", "up", "backend"), "backend='pallas'",
                     _pallas.TUNING)
        # elementwise: under an Explicit sharding the kernel runs on auto axes, the result
        # sharded like gate
        return common.on_auto_axes(lambda g, u: _pallas.swiglu(g, u, **tuning), (gate, up),
                                   lambda: jax.sharding.PartitionSpec(*common.spec_of(gate)))
    if tuning:
        raise TypeError(f"backend='xla' takes no tuning keywords, got {sorted(tuning)}")
    _pallas.check_pair(gate, up)
    return _swiglu_xla(gate, up)


def _dense(x, p):
    if "bias" not in p:
        return jnp.dot(x, p["kernel"])
    # the bias added to the fp32 (fp64 for fp64) product: one rounding, as in a GEMM epilogue
    # (torch's addmm)
    out = jnp.result_type(x, p["kernel"])
    acc = jnp.promote_types(out, jnp.float32)
    y = jnp.dot(x, p["kernel"], preferred_element_type=acc)
    return (y + p["bias"].astype(acc)).astype(out)


@dataclasses.dataclass(frozen=True)
class SwiGLUMLP:
    """Llama's MLP, ``down(silu(gate(x)) * up(x))``, as a pure function of its parameters.

    ``params = mlp.init(key, dtype)`` is ``{"gate_proj": {"kernel": (H, I)[, "bias": (I,)]},
    "up_proj": ..., "down_proj": {"kernel": (I, H)[, "bias": (H,)]}}`` (Flax ``Dense``
    layout: the transpose of PyTorch's ``nn.Linear`` weight). ``mlp(params, x)`` applies it;
    ``lj.tiled_mlp(mlp, params, x)`` applies it tiled. ``backend`` picks the SwiGLU's.
    """

    hidden_size: int
    intermediate_size: int
    bias: bool = False
    backend: Optional[str] = None

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.backend is not None and self.backend not in SWIGLU_BACKENDS:
            raise ValueError(f"backend must be None or one of {SWIGLU_BACKENDS}, "
                             f"got {self.backend!r}")

    def init(self, key, dtype=jnp.float32):
        """Parameters drawn like ``nn.Linear``'s: uniform in ±1/√fan_in."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        params = {}
        for k, (name, (fan_in, fan_out)) in zip(jax.random.split(key, 3), shapes.items()):
            bound = 1.0 / math.sqrt(fan_in)
            kk, kb = jax.random.split(k)
            p = {"kernel": jax.random.uniform(kk, (fan_in, fan_out), dtype, -bound, bound)}
            if self.bias:
                p["bias"] = jax.random.uniform(kb, (fan_out,), dtype, -bound, bound)
            params[name] = p
        return params

    def __call__(self, params, x):
        gate = _dense(x, params["gate_proj"])
        up = _dense(x, params["up_proj"])
        return _dense(swiglu(gate, up, backend=self.backend), params["down_proj"])
