"""PyTorch front door.

``linear_cross_entropy`` is a drop-in for ``torch.nn.functional.linear_cross_entropy``
(same positional order and keyword names) that never materializes the ``[N, V]`` logits, plus
z-loss, softcap, ``return_lse`` and a choice of backend. Every backend implements
:mod:`logitless.specs.linear_cross_entropy`; see there for the exact math.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from . import _torch_common as common
from .specs.linear_cross_entropy import LinearCrossEntropyOptions

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "available_backends"]

# backend name -> module implementing ``linear_cross_entropy(prepared, opts, **tuning)``
# and listing its tuning keywords in ``TUNING``. Imported lazily: "pallas" pulls in JAX.
_BACKENDS = {
    "torch": "logitless.torch_chunked",
    "triton": "logitless.triton_kernels.linear_cross_entropy",
    "pallas": "logitless.bridge.linear_cross_entropy",
}


def _triton_usable(device: torch.device) -> bool:
    return common.triton_usable(device, _LOADED)


def available_backends(device="cpu"):
    """Backends that can run on ``device`` (``None`` picks the first of these)."""
    return common.available_backends(torch.device(device), _LOADED)


_LOADED = {}


def _load(name: str):
    return common.load_backend(_LOADED, _BACKENDS, name)


def _resolve(backend: Optional[str], device: torch.device, dtype: torch.dtype):
    if backend is None:  # Triton on CUDA for the dtypes it has kernels for (not float64)
        backend = "triton" if (_triton_usable(device) and dtype != torch.float64) else "torch"
    _check_backend(backend)
    return backend, _load(backend)


def _check_backend(backend):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {sorted(_BACKENDS)}, got {backend!r}")


# The Triton backend's tuning keywords where Triton is not installed (its module cannot be
# imported to read them): a GPU script's keywords are then still known, warned about and
# dropped on CPU. tests/test_torch_errors.py checks it against the module's TUNING.
_TRITON_TUNING = ("low_memory", "chunk_size", "vocab_chunk_size", "memory_budget",
                  "grad_accum_dtype", "block_v", "num_warps", "logits_gemm", "segment_size",
                  "row_sync", "skip_ignored", "dx_gemm", "dx_chunk_size")


def _tuning_names(backend: Optional[str]):
    if backend is not None:
        _check_backend(backend)
    return common.tuning_names(backend, _LOADED, _load, _TRITON_TUNING)


# Load the cheap backends now so that a first call under torch.compile needs no import;
# "pallas" imports JAX and stays lazy.
_load("torch")
try:
    import triton  # noqa: F401
    _load("triton")
except ImportError:
    pass


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None,
                         reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                         softcap=None, return_lse=False, backend=None, process_group=None,
                         vocab_start_index=None, vocab_size=None, options=None, **tuning):
    """``cross_entropy(input @ linear_weight.T + linear_bias, target)`` without the logits.

    Args:
        input: ``(..., H)`` hidden states (float32, bfloat16 or float16; float64 on
            ``backend="torch"``).
        linear_weight: ``(V, H)`` classifier / LM-head weight, same dtype as ``input``. May be
            non-contiguous (e.g. the transpose of a tied embedding).
        target: ``(...)`` integer class indices in ``[0, V)`` or ``ignore_index``.
        linear_bias: optional ``(V,)`` bias.
        weight: optional ``(V,)`` per-class weights, as in ``F.cross_entropy`` (constants:
            one that requires grad is refused, as there).
        reduction: ``"mean"`` (Σ w·loss / Σ w over non-ignored tokens; 0 when all are
            ignored), ``"sum"`` or ``"none"`` (per-token losses shaped like ``target``).
        ignore_index: target value that contributes neither loss nor gradient (``None`` means
            -100, as in PyTorch).
        label_smoothing: in ``[0, 1]``, exactly as ``F.cross_entropy``.
        z_loss: coefficient of ``lse²`` added per token (PaLM), weighted and reduced like it.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        return_lse: also return the per-token log-sum-exp (of the capped logits), shaped like
            ``target``; it is differentiable.
        backend: ``None`` (Triton on CUDA, except float64; else ``"torch"``), ``"triton"``, ``"torch"``
            (chunked plain PyTorch) or ``"pallas"`` (the JAX/Pallas port through DLPack).
        **tuning: the chosen backend's chunk sizes and options as plain keywords (listed
            below). A keyword no backend takes is a TypeError. With ``backend=None``, one of
            the backend *not* picked (e.g. ``low_memory=True`` where no GPU makes it pick
            "torch") is dropped with a warning; with a named backend it is a TypeError.
        process_group: vocab (tensor) parallelism: ``linear_weight``, ``linear_bias`` and
            ``weight`` are this rank's contiguous slice of the vocabulary, ``input`` and
            ``target`` (global class indices) are the same on every rank of the group; the
            loss and lse are global, dX is summed over the group, dW/db are this rank's
            slices. Runs :mod:`logitless.vocab_parallel_torch` (backend ``None``/"torch"),
            whose tuning keywords are its own (``chunk_size``, ``memory_budget``): any other
            (e.g. Triton's ``low_memory``) is a TypeError here, also with ``backend=None``.
        vocab_start_index, vocab_size: with ``process_group``, where this rank's slice starts
            and the global V; default an equal split (``rank * V_local``, ``world * V_local``).
        options: accepted for ``F.linear_cross_entropy`` compatibility. Its chunking settings
            do not apply (logitless always chunks; ``chunk_size`` / ``memory_budget`` tune
            it); ``allow_retain_graph=True`` needs ``backend="torch"`` or ``"pallas"``
            (``"triton"`` finishes its saved gradients in place: one backward per forward).

    Tuning keywords (defaults in parentheses; ``None`` means derived from the budget or
    the shapes):

    * ``backend="torch"`` (:func:`logitless.torch_chunked.linear_cross_entropy`):
      ``chunk_size`` (None: from ``memory_budget``), tokens per chunk;
      ``memory_budget`` (None: 1 GiB), bytes for one chunk's fp32 logits and their gradient.
    * ``backend="triton"`` (:func:`logitless.triton_kernels.linear_cross_entropy.linear_cross_entropy`,
      whose docstring details them): ``low_memory`` (False); ``chunk_size`` (None: from
      ``memory_budget``), tokens per chunk; ``vocab_chunk_size`` (None: from
      ``memory_budget``), vocabulary rows per chunk of the low-memory dW sweep;
      ``memory_budget`` (None: 896 MiB, or 256 MiB with ``low_memory=True``), bytes for one
      logits block; ``grad_accum_dtype`` (``torch.float32``, or the input dtype);
      ``block_v`` (None: from the row length), ``num_warps`` (None: from the block);
      ``logits_gemm`` (``"auto"``: ``"triton"`` for ``low_memory=True`` on a Hopper GPU
      where that GEMM can run, else ``"cublas"``; or either explicitly);
      ``segment_size`` (None: 8192 on a GPU), columns of a row per row-kernel program (longer
      rows are split over programs where lse is computed from cuBLAS's logits);
      ``row_sync`` (True: a row's segments meet in one launch); ``skip_ignored`` ("auto":
      on a Hopper GPU the fast forward leaves ignored tokens out of the logits GEMM, ours
      then, and the row kernel: bf16/fp16, lse not returned, mean/sum or no gradient, not
      with ``low_memory`` or ``logits_gemm="cublas"``; True raises where it cannot run;
      False computes every token); ``dx_gemm`` ("cublas"; "triton": with skip_ignored, dX
      of the live rows only, by a GEMM of ours: pays where many tokens are ignored);
      ``dx_chunk_size`` (None: on a GPU with H >= 4096, the rows one wave of 256 x 128
      output tiles covers, 1024 at H = 4096 on 132 SMs; else whole chunks), rows per cuBLAS
      dX GEMM call.
    * ``backend="pallas"``: the keywords of :func:`logitless.jax.linear_cross_entropy`'s
      ``"pallas"`` backend (``logitless.pallas_kernels.linear_cross_entropy.TUNING``).
    * with ``process_group``: ``chunk_size``, ``memory_budget`` (as ``"torch"``).

    Under ``torch.autocast``, ``input``, ``linear_weight`` and ``linear_bias`` are cast to
    the autocast dtype first, as ``F.linear`` would cast them (gradients reach the originals).

    Forward-mode AD (``torch.func.jvp``, ``jacfwd``) is refused (NotImplementedError): the
    op has a reverse-mode backward only. ``torch.func.vmap`` of the forward works (per
    sample) on ``"triton"`` and ``"torch"``; ``"pallas"`` refuses any ``torch.func``
    transform (NotImplementedError: DLPack cannot export its wrapped tensors).

    Activation checkpointing: inside a *non-reentrant* ``torch.utils.checkpoint`` (the
    default ``use_reentrant=False``), the fast Triton path's first, discarded forward still
    computes the full gradients (2 extra GEMMs and a transient fp32 ``[V, H]`` buffer) as
    the real forward does. Use ``use_reentrant=True``, ``low_memory=True``, or keep the loss
    outside the checkpointed block.

    Returns:
        The loss (float32; float64 for float64 inputs), or ``(loss, lse)`` with
        ``return_lse=True``.
    """
    opts = LinearCrossEntropyOptions(
        reduction=reduction, ignore_index=-100 if ignore_index is None else ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, return_lse=return_lse)
    if tuning:
        common.check_keyword_names("linear_cross_entropy", tuning, _PARAMETERS,
                                   _tuning_names(backend))
    input, linear_weight, linear_bias = common.autocast_inputs(input, linear_weight, linear_bias)
    vocab_parallel = (process_group is not None or vocab_start_index is not None
                      or vocab_size is not None)
    prepared = common.prepare(input, linear_weight, target, linear_bias, weight,
                              ignore_index=opts.ignore_index, empty_vocab=vocab_parallel)
    if vocab_parallel:
        return _vocab_parallel(prepared, opts, backend, process_group, vocab_start_index,
                               vocab_size, tuning)
    name, impl = _resolve(backend, prepared.x.device, prepared.x.dtype)
    if getattr(options, "allow_retain_graph", False) and getattr(impl, "ONE_BACKWARD", False):
        raise ValueError(f"options.allow_retain_graph=True needs backend='torch' or 'pallas'; "
                         f"backend={name!r} finishes its saved gradients in place in backward, "
                         f"so it runs one backward per forward")
    if tuning:
        tuning = common.tuning_for_backend("linear_cross_entropy", name, impl.TUNING, tuning,
                                           explicit=backend is not None)
    if not getattr(impl, "CHECKS_TARGETS", False):  # else inside its op (vmap runs it per sample)
        common.check_targets(prepared.y, prepared.problem.v, opts.ignore_index)
    with common.autocast_off(prepared.x.device):
        loss, lse = impl.linear_cross_entropy(prepared, opts, **tuning)
    return _shaped(loss, lse, prepared, opts)


_PARAMETERS = tuple(p for p in inspect.signature(linear_cross_entropy).parameters
                    if p != "tuning")


def _shaped(loss, lse, prepared, opts):
    shape = prepared.problem.batch_shape
    if opts.reduction == "none":
        loss = loss.reshape(shape)
    return (loss, lse.reshape(shape)) if opts.return_lse else loss


def _vocab_parallel(prepared, opts, backend, process_group, vocab_start_index, vocab_size,
                    tuning):
    from . import vocab_parallel_torch as vp
    if process_group is None:
        raise ValueError("vocab_start_index / vocab_size need process_group")
    if backend not in (None, "torch"):
        raise ValueError(f"process_group (vocab parallelism) runs on backend None or 'torch', "
                         f"got backend={backend!r}")
    _vocab_parallel_tuning(tuning)
    shard = vp.resolve_shard(process_group, prepared.problem.v, vocab_start_index, vocab_size)
    common.check_targets(prepared.y, shard.v, opts.ignore_index)
    with common.autocast_off(prepared.x.device):
        loss, lse = vp.vocab_parallel_linear_cross_entropy(prepared, opts, shard, **tuning)
    return _shaped(loss, lse, prepared, opts)


def _vocab_parallel_tuning(tuning):
    from . import vocab_parallel_torch as vp
    unknown = sorted(set(tuning) - set(vp.TUNING))
    if unknown:
        raise TypeError(f"unknown tuning keyword(s) {unknown} with process_group; "
                        f"it accepts {list(vp.TUNING)}")


class LinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`linear_cross_entropy`: options at construction,
    ``forward(input, linear_weight, target, linear_bias=None)``."""

    def __init__(self, *, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                 z_loss=0.0, softcap=None, return_lse=False, backend=None, process_group=None,
                 vocab_start_index=None, vocab_size=None, options=None, **tuning):
        super().__init__()
        if backend is not None:  # a misspelled backend fails here, not at the first forward
            _check_backend(backend)
        if tuning:  # misspelled or foreign keywords fail here, not at the first forward
            names, hints = common.module_keywords(
                LinearCrossEntropyLoss, ("input", "linear_weight", "target", "linear_bias"))
            common.check_keyword_names(type(self).__name__, tuning, names,
                                       _tuning_names(backend), hints)
            if process_group is not None:
                _vocab_parallel_tuning(tuning)
            elif backend is not None:
                common.tuning_for_backend(type(self).__name__, backend, _load(backend).TUNING,
                                          tuning, explicit=True)
        self.register_buffer("weight", weight)
        self.options = LinearCrossEntropyOptions(
            reduction=reduction, ignore_index=-100 if ignore_index is None else ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            return_lse=return_lse)
        self.backend = backend
        self.process_group = process_group
        self.vocab_parallel = dict(vocab_start_index=vocab_start_index, vocab_size=vocab_size)
        self.compat_options = options  # F.linear_cross_entropy's options object
        self.tuning = dict(tuning)

    def forward(self, input, linear_weight, target, linear_bias=None):
        o = self.options
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
            reduction=o.reduction, ignore_index=o.ignore_index,
            label_smoothing=o.label_smoothing, z_loss=o.z_loss, softcap=o.softcap,
            return_lse=o.return_lse, backend=self.backend, process_group=self.process_group,
            options=self.compat_options, **self.vocab_parallel, **self.tuning)

    def extra_repr(self):
        return f"{self.options}, backend={self.backend!r}"


# Tiled MLP and the fused SwiGLU (logitless/tiled_mlp_torch.py).
from .tiled_mlp_torch import SwiGLUMLP, TiledMLP, swiglu, tiled_mlp  # noqa: E402

__all__ += ["tiled_mlp", "TiledMLP", "SwiGLUMLP", "swiglu"]

# Fused linear JSD for distillation (logitless/_torch_jsd.py).
from ._torch_jsd import LinearJSDLoss, linear_jsd  # noqa: E402

__all__ += ["linear_jsd", "LinearJSDLoss"]

# Data-parallel normalisation (logitless/distributed_torch.py).
from .distributed_torch import global_token_count  # noqa: E402

__all__ += ["global_token_count"]
