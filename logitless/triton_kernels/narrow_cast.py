"""Turn a float32 weight-gradient accumulator into the final half-precision gradient *in place*,
so that accumulator and result never coexist (and scale a gradient in place).

With an fp32 ``[V, H]`` accumulator (4·V·H bytes) and a bf16 result (2·V·H bytes), a plain
cast holds both at the end: 6·V·H bytes, 3.2 GB at the Llama-3 shape. Here the accumulator is
two allocations, ``a`` (rows ``[0, V1)``, ``V1`` = ceil(V/2) rounded up to a multiple of 8) and
``b`` (the other rows):

1. ``a`` is narrowed onto its own first half: element i is written at byte 2i, which is
   fp32 element i/2 -- already read if elements are processed in increasing order. Launches
   over the ranges [0, B), [B, 2B), [2B, 4B), ... keep every launch's writes off its own
   reads and onto elements an earlier launch consumed (log2(V1·H/B) launches, each a
   vectorized pass).
2. ``b`` is cast into the second half of ``a``'s bytes (which ``b`` fits, as V − V1 <= V1).

``a``'s storage then holds the whole ``[V, H]`` result; ``b`` is freed by its owner. The
upstream scale is applied on the way (one rounding, from fp32). Peak: the accumulator alone.

The same vectorized kernel also scales and casts out of place (:func:`scale_cast`) and scales
in place (:func:`scale_`); PyTorch's mixed-dtype ``torch.mul(..., out=)`` takes a generic,
non-vectorized path that is ~2.5x slower. Every scale is a (1,) device tensor: no host sync.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import _torch_common as common
from .._torch_common import accumulate_mm_

FIRST = 4096  # elements narrowed by the first, single-program launch


@triton.jit
def round_bf16_bits(v):
    """The Triton interpreter's fp32->bf16 cast truncates (the GPU rounds to nearest even):
    pre-round the bits of normal numbers so that interpreted runs see the GPU's values (the one
    copy of this trick: every interpreted kernel that writes bf16 uses it). Zeros and
    subnormals are left alone; a NaN becomes the canonical one, as the GPU makes it (rounding
    the bits of a NaN would carry into the sign or truncate it to inf)."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = (bits & 0x7F800000) != 0
    bits += tl.where(normal, 0x7FFF + ((bits >> 16) & 1), 0)
    bits = tl.where(v != v, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled_copy_kernel(src_ptr, dst_ptr, scale_ptr, start, stop, HAS_SCALE: tl.constexpr,
                        SYNC: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """dst[i] = src[i]·scale for i in [start, stop), computed in fp32."""
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < stop
    v = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale_ptr).to(tl.float32)
    if ROUND_BF16:
        v = round_bf16_bits(v)
    if SYNC:  # source and destination overlap inside this (single) program
        tl.debug_barrier()
    tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=mask)


def _launch(src, dst, scale, start, stop, interpret, sync=False):
    n = stop - start
    if n <= 0:
        return
    block = FIRST if sync else 4096
    _scaled_copy_kernel[(1 if sync else triton.cdiv(n, block),)](
        src, dst, src if scale is None else scale, start, stop, HAS_SCALE=scale is not None,
        SYNC=sync, ROUND_BF16=interpret and dst.dtype == torch.bfloat16, BLOCK=block,
        num_warps=8)


def split_rows(v: int) -> int:
    """Rows of the first accumulator allocation: at least half (its bytes must hold the whole
    narrowed result), a multiple of 8 so that the second GEMM's operand ``dz[:, r1:]`` starts
    16-byte aligned (cuBLAS falls back to slow kernels otherwise, e.g. at V = 151655); all of
    ``v`` (no second allocation) when that multiple of 8 would pass ``v``."""
    return min(v, -(-((v + 1) // 2) // 8) * 8)


def accumulator_pair(rows: int, cols: int, accum_dtype: torch.dtype, out_dtype: torch.dtype,
                     like: torch.Tensor, zero: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(a, b): a ``[rows, cols]`` gradient accumulator that :func:`finish_` turns into the
    ``out_dtype`` result in place. fp32 for a 2-byte result: the two allocations :func:`narrow_`
    narrows (rows ``[0, split_rows(rows))`` and the rest); else one ``accum_dtype`` tensor and
    an empty ``b``. Allocated like ``like`` (its device; fake tensors under tracing), zeroed
    with ``zero`` (when no chunk will assign it)."""
    if accum_dtype == torch.float32 and out_dtype.itemsize == 2:
        r1 = split_rows(rows)
        pair = (like.new_empty(r1, cols, dtype=torch.float32),
                like.new_empty(rows - r1, cols, dtype=torch.float32))
    else:
        pair = (like.new_empty(rows, cols, dtype=accum_dtype),
                like.new_empty(0, dtype=accum_dtype))
    if zero:
        for t in pair:
            t.zero_()
    return pair


def accumulate_split_(pair: Tuple[torch.Tensor, torch.Tensor], dz: torch.Tensor,
                      x_c: torch.Tensor, first: bool) -> None:
    """``dW (+)= dzᵀ·x_c`` into a weight-gradient accumulator: the split fp32 pair of
    :func:`accumulator_pair` (columns of ``dz`` are its rows: one GEMM per half, the half
    holding the end of a vocabulary that is not a multiple of 8 cut again there), or one tensor
    in ``pair[0]`` with ``pair[1]`` empty. The first chunk assigns."""
    a, b = pair
    pieces = ((a, 0, a.shape[0]),) + (((b, a.shape[0], dz.shape[1]),) if b.numel() else ())
    for acc, s, e in pieces:  # each cut again where the vocabulary's 8-aligned bulk ends
        for ps, pe in common.vocab_parts(dz.shape[1]):
            lo, hi = max(s, ps), min(e, pe)
            if lo >= hi:
                continue
            if hi - lo < common.VOCAB_ALIGN and acc.dtype != torch.float32:  # thin, half acc
                common.thin_mm_(dz[:, lo:hi].t(), x_c, acc[lo - s:hi - s], add=not first)
            else:
                accumulate_mm_(acc[lo - s:hi - s], dz[:, lo:hi].t(), x_c, first=first)


def finish_(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor],
            shape: Tuple[int, int], dtype: torch.dtype, interpret: bool) -> torch.Tensor:
    """The accumulated gradient times ``scale`` in ``dtype``, in place: narrowed from its fp32
    split pair (one rounding), or scaled where it is (already in ``dtype``). Goes through the
    ``torch.library`` ops, so compiled graphs see the mutation."""
    if a.dtype == dtype:
        if scale is not None:
            scale_op(a, scale, interpret)
        return a
    narrow_op(a, b, scale, dtype, interpret)
    return narrowed_view(a, shape[0], shape[1], dtype)


def narrow_(a: torch.Tensor, b: Optional[torch.Tensor], scale: Optional[torch.Tensor],
            dtype: torch.dtype, interpret: bool) -> None:
    """Write ``(cat(a, b) · scale)`` as ``dtype`` into ``a``'s storage (see the module doc)."""
    assert a.dtype == torch.float32 and a.is_contiguous() and dtype.itemsize == 2
    dst = a.view(-1).view(dtype)  # 2·numel(a) slots of the narrow type over a's bytes
    src = a.view(-1)
    n_a = src.numel()
    _launch(src, dst, scale, 0, min(FIRST, n_a), interpret, sync=True)
    lo = FIRST
    while lo < n_a:
        _launch(src, dst, scale, lo, min(2 * lo, n_a), interpret)
        lo *= 2
    if b is not None and b.numel():
        assert b.is_contiguous() and b.numel() <= n_a
        _launch(b.view(-1), dst[n_a:], scale, 0, b.numel(), interpret)


def narrowed_view(a: torch.Tensor, v: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[V, H]`` ``dtype`` result that :func:`narrow_` left in ``a``'s storage."""
    return a.view(-1).view(dtype)[: v * h].view(v, h)


def scale_cast(src: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype,
               interpret: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``src · scale`` as a ``dtype`` tensor, computed in fp32 (``scale`` None: a plain cast).
    ``out`` (contiguous; may be ``src`` itself: each element is read and written by the same
    thread) receives the result."""
    if out is None:
        out = torch.empty(src.shape, dtype=dtype, device=src.device)
    assert src.is_contiguous() and out.is_contiguous() and out.numel() == src.numel()
    _launch(src.view(-1), out.view(-1), scale, 0, src.numel(), interpret)
    return out


def scale_(t: torch.Tensor, scale: torch.Tensor, interpret: bool) -> None:
    """``t *= scale`` in place."""
    scale_cast(t, scale, t.dtype, interpret, out=t)


@torch.library.custom_op("logitless::narrow_", mutates_args=("a",))
def narrow_op(a: torch.Tensor, b: Optional[torch.Tensor], scale: Optional[torch.Tensor],
              dtype: torch.dtype, interpret: bool) -> None:
    with common.on_device(a):
        narrow_(a, b, scale, dtype, interpret)


@narrow_op.register_fake
def _(a, b, scale, dtype, interpret):
    return None


# torch.library ops, so autograd formulas that call these stay traceable by torch.compile.
@torch.library.custom_op("logitless::scale_cast", mutates_args=())
def scale_cast_op(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  interpret: bool) -> torch.Tensor:
    with common.on_device(src):
        return scale_cast(src, scale, dtype, interpret)


@scale_cast_op.register_fake
def _(src, scale, dtype, interpret):
    return src.new_empty(src.shape, dtype=dtype)


@torch.library.custom_op("logitless::scale_", mutates_args=("t",))
def scale_op(t: torch.Tensor, scale: torch.Tensor, interpret: bool) -> None:
    with common.on_device(t):
        scale_(t, scale, interpret)


@scale_op.register_fake
def _(t, scale, interpret):
    return None


def hand_over_once(ctx, op):
    """The forward's saved gradients are finished in place and handed over: a second backward
    through the same graph (retain_graph=True) would get them scaled twice, so it is refused
    with a message (autograd's version check would also refuse it, less clearly)."""
    if getattr(ctx, "handed_over", False):
        raise RuntimeError(
            f"{op} (backend='triton') supports one backward per forward: the forward's saved "
            "gradients were finished in place by the first. For a second backward through the "
            "same graph (retain_graph=True), use backend='torch' (it recomputes in backward), "
            "or run the forward again.")
    ctx.handed_over = True
