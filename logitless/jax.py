"""JAX front door.

``linear_cross_entropy`` computes ``cross_entropy(x @ linear_weight.T + linear_bias, labels)``
without materializing the ``[N, V]`` logits, with the keywords of the PyTorch front door
(class weights, label smoothing, z-loss, softcap, ``return_lse``). It works under
``jax.jit``, ``jax.grad``, ``jax.value_and_grad`` and ``jax.vmap`` (reverse mode: the ops are
``jax.custom_vjp`` functions, so ``jax.jvp`` / ``jax.jacfwd`` of them raise JAX's
custom_vjp error). Options (label smoothing, β, temperature, ...) are Python numbers, fixed at
trace time. Every backend implements :mod:`logitless.specs.linear_cross_entropy`; see there for
the exact math.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import _jax_common as common
from ._keywords import check_tuning
from .specs.linear_cross_entropy import LinearCrossEntropyOptions

__all__ = ["linear_cross_entropy", "available_backends", "global_token_count"]

# backend name -> module implementing ``linear_cross_entropy(prepared, opts, **tuning)`` and
# listing its tuning keywords in ``TUNING``. Imported lazily (Pallas is only needed for "pallas").
_BACKENDS = {
    "xla": "logitless.xla_chunked",
    "pallas": "logitless.pallas_kernels.linear_cross_entropy",
}


def available_backends():
    """Backend names; ``None`` picks "pallas" when JAX's default backend is a GPU, else "xla"."""
    return ["pallas", "xla"] if jax.default_backend() == "gpu" else ["xla", "pallas"]


def _resolve(backend: Optional[str]):
    if backend is None:
        backend = available_backends()[0]
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {sorted(_BACKENDS)}, got {backend!r}")
    return backend, importlib.import_module(_BACKENDS[backend])


def linear_cross_entropy(x, linear_weight, labels, *, linear_bias=None, weight=None,
                         reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                         softcap=None, return_lse=False, weight_layout="vh", backend=None,
                         axis_name=None, **tuning):
    """``cross_entropy(x @ linear_weight.T + linear_bias, labels)`` without the logits.

    Args:
        x: ``(..., H)`` hidden states (float32, bfloat16 or float16).
        linear_weight: the classifier / LM-head weight, same dtype as ``x``: ``(V, H)``, or the
            Flax ``Dense`` kernel ``(H, V)`` with ``weight_layout="hv"`` (used as it is, never
            transposed or copied).
        labels: ``(...)`` integer class indices in ``[0, V)`` or ``ignore_index`` (converted to
            int32). Out-of-range labels: when ``labels`` is a concrete array the call raises
            ``ValueError`` up front (reading the labels on the host); under ``jax.jit``,
            ``jax.vmap`` or any other trace they cannot be checked without a host sync, so a
            non-ignored label outside ``[0, V)`` makes its token's loss, the reduced loss and the
            gradients NaN instead (never a silent wrong value, never an out-of-bounds read).
        linear_bias: optional ``(V,)`` bias, same dtype as ``x``.
        weight: optional ``(V,)`` per-class weights, as in ``torch.nn.functional.cross_entropy``
            (constants: their gradient is zero).
        reduction: ``"mean"`` (Σ w·loss / Σ w over non-ignored tokens; 0 when all are ignored),
            ``"sum"`` or ``"none"`` (per-token losses shaped like ``labels``).
        ignore_index: label value that contributes neither loss nor gradient.
        label_smoothing: in ``[0, 1]``, exactly as PyTorch's cross-entropy.
        z_loss: coefficient of ``lse²`` added per token (PaLM), weighted and reduced like it.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        return_lse: also return the per-token log-sum-exp (of the capped logits), shaped like
            ``labels``; it is differentiable.
        weight_layout: ``"vh"`` for a ``(V, H)`` weight, ``"hv"`` for ``(H, V)``.
        backend: ``None`` ("pallas" when JAX's default backend is a GPU, else "xla"),
            ``"pallas"`` (Pallas kernels; interpreted on CPU) or ``"xla"`` (chunked plain JAX).
        axis_name: vocab (tensor) parallelism inside ``shard_map``: ``linear_weight`` (and
            ``linear_bias``, ``weight``) are this device's equal slice of V along the mesh axis
            ``axis_name``; ``x`` and ``labels`` (global indices) are the same on every device of
            it. Runs :mod:`logitless.vocab_parallel_jax` (backend ``None``/"xla"). Under
            ``shard_map(check_vma=False)`` or ``jax.pmap``, take the gradient *outside* the
            mapped function (``jax.grad`` of the mapped loss): taken inside, JAX
            transposes the op's ``psum`` without knowing the loss is replicated, and dW comes
            out multiplied by the axis size, dX wrong too (as for a hand-written
            ``psum``/``pmax`` loss). With ``check_vma=True`` (the default) either place works.
        **tuning: the chosen backend's keywords (any other is a TypeError); every default
            ``None`` means the value in brackets.

            * ``backend="xla"`` (and ``axis_name``): ``chunk_size=None`` (tokens per chunk;
              from ``memory_budget``), ``memory_budget=None`` (1 GiB: bytes of one chunk's
              float32 logits and gradient, 8 bytes per [chunk, V] element).
            * ``backend="pallas"``: ``chunk_size=None``, ``memory_budget=None`` (1 GiB: the one
              [chunk, V] logits buffer in the input dtype), ``row_split=None`` (programs per
              row, each on a column segment, a power of 2: on a GPU the power of 2 nearest
              V / 16384, e.g. 8 at V = 128256, 16 at 256000, 1 below ~23K; interpreted 1),
              ``row_sync=True`` (split rows in one launch, the programs of a row waiting for
              each other; False: two launches), ``block_rows=None`` (1) × ``block_v=None``
              (16384 for whole rows, 2048 for split ones; shrunk to V) the kernel's tile,
              powers of two; ``num_warps=None`` (16; split rows 2), ``num_stages=None`` (2);
              ``grid_size=None`` (programs of the persistent grid: on a GPU the SMs, 16 per SM
              for split rows; one per row block when interpreted); ``fp32_logits=False``
              (True: float32 logits, the gradient in a second buffer); ``interpret=None``
              (True unless JAX's default backend is a GPU).

    Sharding: inside ``jax.shard_map`` (``check_vma`` on or off) data parallelism and
    ``axis_name=`` work; for data parallelism, as for any JAX op: a weight replicated over a data axis gets the sum of the shards' dW. With
    Explicit mesh axes (``jax.sharding.set_mesh``, or arrays sharded on such a mesh) the op
    runs under ``jax.sharding.auto_axes``, per-token outputs sharded like ``labels``.
    ``backend="pallas"`` interpreted (off a GPU) cannot run inside ``shard_map`` with
    ``check_vma=True`` (``NotImplementedError``), and has no second-order derivatives.

    Gradient accumulation: under ``jax.grad`` of a ``lax.scan`` over micro-batches, the fused
    forward ("mean"/"sum" without ``return_lse``) keeps its dX and float32 dW as residuals of
    every step (K steps: K float32 [V, H] buffers). Wrap the loss in ``jax.checkpoint``
    inside the scan body to keep one (8 steps of 256 tokens, V=8192, H=256, float32,
    ``backend="xla"``, the weight's gradient: 96 -> 16 MiB of temporaries in XLA's compiled
    memory analysis on CPU).

    Returns:
        The loss (float32), or ``(loss, lse)`` with ``return_lse=True``. Logits and their
        gradients are computed in the input dtype by the GEMMs; the loss math, dW and db
        accumulate in float32.
    """
    opts = LinearCrossEntropyOptions(
        reduction=reduction, ignore_index=-100 if ignore_index is None else ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, return_lse=return_lse)
    if axis_name is not None:
        return _vocab_parallel(x, linear_weight, labels, linear_bias, weight, opts,
                               weight_layout, backend, axis_name, tuning)
    return _run(x, linear_weight, labels, linear_bias, weight, opts, weight_layout, backend,
                tuning)


_PARAMETERS = tuple(p for p in inspect.signature(linear_cross_entropy).parameters
                    if p != "tuning")


def _run(x, linear_weight, labels, linear_bias, weight, opts, weight_layout, backend, tuning,
         needs=(True, True, True)):
    """:func:`linear_cross_entropy` with its options built (no ``axis_name``); ``needs``: which
    of (dX, dW, db) the caller will use (the PyTorch bridge: a frozen head costs no dW GEMM
    and no float32 [V, H] accumulator; a skipped one gets a zero cotangent)."""
    name, impl = _resolve(backend)
    check_tuning("linear_cross_entropy", tuning, _PARAMETERS, f"backend={name!r}", impl.TUNING)

    def body(x, linear_weight, labels, linear_bias, weight):
        prepared = common.prepare(x, linear_weight, labels, linear_bias, weight,
                                  ignore_index=opts.ignore_index, weight_layout=weight_layout)
        prepared = dataclasses.replace(prepared, needs=tuple(needs))
        loss, lse = impl.linear_cross_entropy(prepared, opts, **tuning)
        return _shaped(loss, lse, prepared, opts)

    def out_specs():  # with an Explicit mesh: per-token outputs sharded like the labels
        tok = P(*common.spec_of(labels))
        loss = tok if opts.reduction == "none" else P()
        return (loss, tok) if opts.return_lse else loss

    return common.on_auto_axes(body, (x, linear_weight, labels, linear_bias, weight), out_specs)


def _shaped(loss, lse, prepared, opts):
    shape = prepared.problem.batch_shape
    if opts.reduction == "none":
        loss = jnp.reshape(loss, shape)
    return (loss, jnp.reshape(lse, shape)) if opts.return_lse else loss


def _vocab_parallel(x, linear_weight, labels, linear_bias, weight, opts, weight_layout, backend,
                    axis_name, tuning):
    from . import vocab_parallel_jax as vp
    if backend not in (None, "xla"):
        raise ValueError(f"axis_name (vocab parallelism) runs on backend None or 'xla', "
                         f"got backend={backend!r}")
    check_tuning("linear_cross_entropy", tuning, _PARAMETERS, "axis_name (vocab parallelism)",
                 vp.TUNING)
    # labels are global, the weight a slice: concrete labels are checked against the global
    # V = V_local · axis size, traced ones become NaN in the vocab-parallel math
    prepared = common.prepare(x, linear_weight, labels, linear_bias, weight,
                              ignore_index=opts.ignore_index, weight_layout=weight_layout,
                              check_range=False, vocab_axis=axis_name)
    size = vp._axis_size(axis_name)
    if isinstance(size, int):
        common.check_concrete_labels(labels, prepared.problem.v * size, opts.ignore_index)
    loss, lse = vp.vocab_parallel_linear_cross_entropy(prepared, opts, axis_name, **tuning)
    return _shaped(loss, lse, prepared, opts)


def global_token_count(labels, *, ignore_index=-100, weight=None, axis_name=None):
    """Non-ignored labels (or Σ of their class weights), ``psum``-ed over ``axis_name``: the
    data-parallel "mean" denominator (see :func:`logitless.vocab_parallel_jax.global_token_count`)."""
    from .vocab_parallel_jax import global_token_count as count
    return count(labels, ignore_index=ignore_index, weight=weight, axis_name=axis_name)


# Tiled MLP and the fused SwiGLU (logitless/tiled_mlp_jax.py).
from .tiled_mlp_jax import SwiGLUMLP, swiglu, tiled_mlp  # noqa: E402

__all__ += ["tiled_mlp", "SwiGLUMLP", "swiglu"]

# Fused linear JSD for distillation (logitless/_jax_jsd.py).
from ._jax_jsd import linear_jsd  # noqa: E402

__all__ += ["linear_jsd"]
