"""Zero-copy tensors between PyTorch and JAX over DLPack, with every copy made explicit.

``to_jax(tensor)`` and ``to_torch(array)`` share memory on CPU and CUDA for float32, bfloat16,
float16 (and the other common dtypes). Plain DLPack gets several cases silently wrong; here
each one is handled on purpose, and :func:`would_copy` tells a caller beforehand whether (and
why) ``to_jax`` will copy:

========================================  ================================================
case                                      what ``to_jax`` does
========================================  ================================================
``requires_grad=True``                    exports ``tensor.detach()`` (same memory; no
                                          gradient crosses -- use :class:`JaxFunction`)
transposed / permuted dense strides       zero-copy; the JAX array carries that layout and
                                          jit compiles for it
step-sliced / overlapping strides         copy (``.contiguous()``): XLA cannot view them
data pointer not 64-byte aligned          copy: JAX would copy silently (CPU) or hand a
                                          misaligned pointer to kernels that assume it
int64 / uint64 while JAX runs without     copy to int32 / uint32 in PyTorch, with a range
x64                                       check (async on CUDA: no host sync); JAX would
                                          truncate silently
float64 / complex128 without x64          ``TypeError`` (JAX would silently round to 32 bits)
negative / conjugate bit set              copy (``resolve_neg`` / ``resolve_conj``)
========================================  ================================================

The ``copy`` argument follows the array-API convention: ``None`` (default) copies only in the
cases above, ``False`` raises :class:`ZeroCopyError` naming the reason instead, ``True`` always
copies. ``to_torch`` never needs a copy for a single-device ``jax.Array``.

Stream safety (CUDA). Both directions use the DLPack ``stream`` handshake, which orders with
events, never a device synchronize: ``jax.dlpack.from_dlpack`` hands PyTorch the stream JAX
waits on, and ``Tensor.__dlpack__(stream=...)`` makes it wait for the work queued so far on
PyTorch's *current* stream; ``torch.from_dlpack`` hands JAX PyTorch's current stream, on which
JAX enqueues a wait for the array's definition event. So a tensor produced asynchronously on
the current stream is complete before JAX reads it, and the reverse. Work on a *non-current*
PyTorch stream is not covered (as with any PyTorch op): make the current stream wait for it
first. Buffers handed across keep their producer alive through the DLPack deleter.

Writing into shared memory in place (a PyTorch write to a tensor returned by ``to_torch``, or
to a tensor whose JAX view is still in use) breaks JAX's immutability assumption: only do it
when JAX no longer uses the array.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import jax
import numpy as np
import torch

__all__ = ["to_jax", "to_torch", "would_copy", "ZeroCopyError", "ALIGNMENT"]

ALIGNMENT = 64  # bytes; XLA's minimum buffer alignment (it copies, or refuses, below it)

# The DLPack stream handshake. Tests flip this (``_unsynchronized()``) to show that the race
# test fails without it; never turn it off in real code.
_SYNC_STREAMS = True

_DL_CUDA = 2  # DLDeviceType.kDLCUDA in the DLPack header

_WIDE_TO_NARROW = {torch.int64: torch.int32, torch.uint64: torch.uint32}
_NO_NARROWING = (torch.float64, torch.complex128)


class ZeroCopyError(BufferError):
    """``copy=False`` was asked for, but the conversion needs a copy (the message says why)."""


def _x64_enabled() -> bool:
    return jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64)


def _is_compact(shape, strides) -> bool:
    """Dense strides of some dimension order (what XLA can view): contiguous, transposed,
    permuted. Size-1 dims do not count; a size-0 tensor is always fine."""
    if 0 in shape:
        return True
    dims = sorted((s, n) for n, s in zip(shape, strides) if n > 1)
    expected = 1
    for stride, n in dims:
        if stride != expected:
            return False
        expected *= n
    return True


def would_copy(tensor: torch.Tensor) -> Optional[str]:
    """Why ``to_jax(tensor)`` would copy, or ``None`` when it is zero-copy.

    Raises ``TypeError`` for tensors ``to_jax`` refuses (float64 without x64, sparse, ...).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"to_jax expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"to_jax supports strided (dense) tensors only, got layout {tensor.layout}")
    x64 = _x64_enabled()
    if tensor.dtype in _NO_NARROWING and not x64:
        raise TypeError(
            f"{tensor.dtype} tensor: JAX runs without x64 and would silently round it to 32 bits; "
            f"convert it yourself (e.g. .float()) or enable jax_enable_x64")
    if tensor.dtype in _WIDE_TO_NARROW and not x64:
        return (f"{tensor.dtype} -> {_WIDE_TO_NARROW[tensor.dtype]}: JAX runs without x64 "
                f"(pass int32 targets to avoid this copy)")
    if tensor.is_conj():
        return "the conjugate bit is set"
    if tensor.is_neg():
        return "the negative bit is set"
    if not _is_compact(tensor.shape, tensor.stride()):
        return (f"strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)} are not a "
                f"dense layout (XLA views only contiguous or permuted-contiguous memory)")
    if tensor.data_ptr() % ALIGNMENT:
        return (f"data pointer is not {ALIGNMENT}-byte aligned (storage offset "
                f"{tensor.storage_offset()} elements)")
    return None


def _narrow_ints(t: torch.Tensor) -> torch.Tensor:
    """int64 -> int32 (uint64 -> uint32) copy, after an async range check (no host sync)."""
    narrow = _WIDE_TO_NARROW[t.dtype]
    if t.numel():
        info = torch.iinfo(narrow)
        # uint64 has no comparison kernels: its bits as int64, where values >= 2**63 are
        # negative (below uint32's minimum 0, so refused as they should be)
        v = t.view(torch.int64) if t.dtype == torch.uint64 else t
        ok = ((v >= info.min) & (v <= info.max)).all()
        torch._assert_async(ok, f"to_jax: a {t.dtype} value does not fit {narrow} (JAX runs "
                                f"without x64), so it cannot cross the bridge")
    return t.to(narrow, memory_format=torch.contiguous_format)


def _prepare(tensor: torch.Tensor, copy: Optional[bool]) -> torch.Tensor:
    """The tensor that is actually exported: detached, and copied when needed or asked."""
    reason = would_copy(tensor)
    t = tensor.detach()
    if reason is None:
        return t.clone(memory_format=torch.contiguous_format) if copy else t
    if copy is False:
        raise ZeroCopyError(f"to_jax(copy=False) needs a copy: {reason}")
    if t.dtype in _WIDE_TO_NARROW and not _x64_enabled():
        t = _narrow_ints(t)
    else:
        t = t.resolve_conj().resolve_neg()
    # A fresh allocation is dense and aligned (PyTorch allocators align to >= 64 bytes).
    if would_copy(t) is not None:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class _Unsynced:
    """Test-only DLPack producer that skips the stream handshake (see ``_unsynchronized``)."""

    def __init__(self, obj, stream):
        self._obj, self._stream = obj, stream

    def __dlpack_device__(self):
        return self._obj.__dlpack_device__()

    def __dlpack__(self, stream=None, **kwargs):
        return self._obj.__dlpack__(stream=self._stream, **kwargs)


_side_stream = None


def _unsynced_side_stream():
    """A PyTorch stream nobody computes on: JAX is told to order itself against this one
    instead of the consumer's, which is how the handshake is disabled for jax -> torch."""
    global _side_stream
    if _side_stream is None:
        _side_stream = torch.cuda.Stream()
    return _side_stream.cuda_stream


@contextlib.contextmanager
def _unsynchronized():
    """Disable the CUDA stream handshake (tests only: demonstrates the race it prevents)."""
    global _SYNC_STREAMS
    old, _SYNC_STREAMS = _SYNC_STREAMS, False
    try:
        yield
    finally:
        _SYNC_STREAMS = old


def _device_guard(t: torch.Tensor):
    # Tensor.__dlpack__ refuses a CUDA tensor that is not on the current device.
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _export(tensor: torch.Tensor, copy: Optional[bool]):
    """(exported torch tensor, jax array): the first owns the memory the second views."""
    t = _prepare(tensor, copy)
    src = t if (_SYNC_STREAMS or not t.is_cuda) else _Unsynced(t, -1)
    with _device_guard(t):
        # copy=False: were JAX to find a reason to copy after all, it must fail loudly.
        return t, jax.dlpack.from_dlpack(src, copy=False)


def to_jax(tensor: torch.Tensor, *, copy: Optional[bool] = None) -> jax.Array:
    """A ``jax.Array`` on the tensor's device viewing the tensor's memory (see the module
    docstring for the cases that copy). ``copy``: ``None`` copy only when needed, ``False``
    raise :class:`ZeroCopyError` instead, ``True`` always copy."""
    return _export(tensor, copy)[1]


def to_torch(array: jax.Array, *, copy: Optional[bool] = None) -> torch.Tensor:
    """A ``torch.Tensor`` on the array's device viewing the array's memory (its strides follow
    the array's layout). ``copy=True`` returns a PyTorch-owned copy; ``None``/``False`` never
    copy. The tensor keeps the JAX buffer alive; see the module docstring on writing to it."""
    if isinstance(array, jax.core.Tracer):
        raise TypeError("to_torch needs a concrete jax.Array; it cannot run inside jax.jit / "
                        "jax.grad tracing")
    if not isinstance(array, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(array).__name__}")
    if len(array.devices()) != 1:
        raise ValueError(f"to_torch needs an array on one device; this one is sharded over "
                         f"{len(array.devices())}")
    src = array
    if not _SYNC_STREAMS and int(array.__dlpack_device__()[0]) == _DL_CUDA:
        src = _Unsynced(array, _unsynced_side_stream())
    t = torch.from_dlpack(src)
    return t.clone() if copy else t
