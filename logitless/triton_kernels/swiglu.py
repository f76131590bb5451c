"""Fused SwiGLU ``h = silu(gate) * up`` and its backward as Triton kernels, plus the
``torch.library`` ops (``logitless::swiglu``, ``logitless::swiglu_backward``) with autograd,
so ``torch.compile`` traces them without graph breaks.

Both kernels are elementwise over ``[rows, cols]`` views whose columns are contiguous and
whose rows may be strided (e.g. the two halves of a fused ``[.., 2I]`` gate/up projection),
one ``BLOCK_R × BLOCK_C`` tile per program, 64-bit offsets. Math is fp32 from the half-
precision loads, rounded once to the output dtype (a naive ``F.silu(g) * u`` rounds twice).
The backward writes ``d gate`` and ``d up`` anywhere, including over ``gate`` and ``up``
themselves (each element is read before it is written, by the same program): the tiled MLP
backward needs no extra buffers for them. See :mod:`logitless.specs.tiled_mlp` for the math.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import _torch_common as common
from ..specs.tiling import next_power_of_2
from . import INTERPRETED
from .narrow_cast import round_bf16_bits

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One tile per program: 4096 elements (32 per thread at 4 warps: 16-byte vector accesses).
GPU_TILE_ELEMENTS = 4096
GPU_MAX_BLOCK_C = 2048
GPU_NUM_WARPS = 4
# Interpreted programs run one after another in Python: big tiles, few programs.
INTERPRET_TILE_ELEMENTS = 1 << 16

_INTERPRET = INTERPRETED  # (a module name of its own: tests patch it)


def interpreted() -> bool:
    return _INTERPRET


@triton.jit
def _tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One grid axis (up to 2^31 − 1 programs): the column tiles of a long row would pass the
    # 65535 of a second axis (a flattened gate wider than 134M elements).
    pid = tl.program_id(0).to(tl.int64)
    col_tiles = tl.cdiv(n_cols, BLOCK_C)
    rows = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows[:, None], cols[None, :], mask


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, n_rows, n_cols, g_stride, u_stride, h_stride,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROUND_BF16: tl.constexpr):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + rows * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    if ROUND_BF16:
        h = round_bf16_bits(h)
    tl.store(h_ptr + rows * h_stride + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_rows, n_cols,
                       dh_stride, g_stride, u_stride, dg_stride, du_stride,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROUND_BF16: tl.constexpr):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    dh = tl.load(dh_ptr + rows * dh_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    dg = dh * u * (s + silu * (1.0 - s))
    du = dh * silu
    if ROUND_BF16:
        dg = round_bf16_bits(dg)
        du = round_bf16_bits(du)
    tl.store(dg_ptr + rows * dg_stride + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + rows * du_stride + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers
def _check(name, t, like=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16 for the Triton SwiGLU, "
                        f"got {t.dtype}")
    common.check_triton_device(t, name, "the Triton SwiGLU", _INTERPRET)
    if like is not None:
        lname, lt = like
        if t.shape != lt.shape:
            raise ValueError(f"{name} has shape {list(t.shape)} but {lname} has {list(lt.shape)}")
        if t.dtype != lt.dtype:
            raise TypeError(f"{name} dtype {t.dtype} does not match {lname} dtype {lt.dtype}")
        if t.device != lt.device:
            raise ValueError(f"{name} is on {t.device} but {lname} is on {lt.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, cols]`` with contiguous columns: a view when the strides allow it
    (any row stride), else a contiguous copy (inputs only; outputs are ours)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _out(t: Optional[torch.Tensor], like: torch.Tensor, name: str) -> torch.Tensor:
    if t is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    _check(name, t, ("gate", like))
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.shape[-1] > 1 and t2.stride(-1) != 1 or t2.data_ptr() != t.data_ptr():
        raise ValueError(f"{name} must be viewable as [rows, cols] with contiguous columns")
    return t


def _launch_config(n_rows, n_cols, block_rows, block_cols, num_warps):
    if block_cols is None:
        block_cols = min(next_power_of_2(max(n_cols, 1)),
                         GPU_MAX_BLOCK_C if not _INTERPRET else INTERPRET_TILE_ELEMENTS)
    if block_rows is None:
        tile = INTERPRET_TILE_ELEMENTS if _INTERPRET else GPU_TILE_ELEMENTS
        block_rows = min(max(1, tile // block_cols), next_power_of_2(max(n_rows, 1)))
    for name, v in (("block_rows", block_rows), ("block_cols", block_cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of 2, got {v!r}")
    if num_warps is None:
        num_warps = GPU_NUM_WARPS
    elif num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of 2 in [1, 32], got {num_warps!r}")
    grid = (triton.cdiv(n_rows, block_rows) * triton.cdiv(n_cols, block_cols),)
    return grid, dict(BLOCK_R=block_rows, BLOCK_C=block_cols, num_warps=num_warps)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                   block_rows: Optional[int] = None, block_cols: Optional[int] = None,
                   num_warps: Optional[int] = None) -> torch.Tensor:
    """``silu(gate) * up`` (same shape and dtype as ``gate``), into ``out`` if given (which may
    be ``gate`` or ``up`` itself)."""
    _check("gate", gate)
    _check("up", up, ("gate", gate))
    out = _out(out, gate, "out")
    if gate.numel() == 0:
        return out
    g2, u2, h2 = _rows(gate), _rows(up), out.reshape(-1, out.shape[-1])
    grid, meta = _launch_config(g2.shape[0], g2.shape[1], block_rows, block_cols, num_warps)
    _swiglu_fwd_kernel[grid](g2, u2, h2, g2.shape[0], g2.shape[1],
                             g2.stride(0), u2.stride(0), h2.stride(0),
                             ROUND_BF16=_INTERPRET and gate.dtype == torch.bfloat16, **meta)
    return out


def swiglu_backward(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *,
                    grad_gate: Optional[torch.Tensor] = None,
                    grad_up: Optional[torch.Tensor] = None, block_rows: Optional[int] = None,
                    block_cols: Optional[int] = None, num_warps: Optional[int] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` of ``silu(gate) * up`` for the upstream ``grad_h``; written into
    ``grad_gate`` / ``grad_up`` when given (they may be ``gate`` / ``up`` themselves)."""
    _check("gate", gate)
    _check("up", up, ("gate", gate))
    _check("grad_h", grad_h, ("gate", gate))
    grad_gate = _out(grad_gate, gate, "grad_gate")
    grad_up = _out(grad_up, gate, "grad_up")
    if gate.numel() == 0:
        return grad_gate, grad_up
    dh2, g2, u2 = _rows(grad_h), _rows(gate), _rows(up)
    dg2, du2 = grad_gate.reshape(-1, gate.shape[-1]), grad_up.reshape(-1, gate.shape[-1])
    grid, meta = _launch_config(g2.shape[0], g2.shape[1], block_rows, block_cols, num_warps)
    _swiglu_bwd_kernel[grid](dh2, g2, u2, dg2, du2, g2.shape[0], g2.shape[1],
                             dh2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0),
                             du2.stride(0),
                             ROUND_BF16=_INTERPRET and gate.dtype == torch.bfloat16, **meta)
    return grad_gate, grad_up


# ----------------------------------------------------------------------------- torch.library
@torch.library.custom_op("logitless::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` through the Triton kernel (differentiable; fp32 math, one rounding)."""
    with common.on_device(gate):
        return swiglu_forward(gate, up)


@swiglu.register_fake
def _(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("logitless::swiglu_backward", mutates_args=())
def swiglu_backward_op(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    with common.on_device(gate):
        return swiglu_backward(grad_h, gate, up)


@swiglu_backward_op.register_fake
def _(grad_h, gate, up):
    new = lambda: torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    return new(), new()


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_h):
    gate, up = ctx.saved_tensors
    if grad_h is None:
        return None, None
    if torch.is_grad_enabled():
        # create_graph=True (a gradient penalty): the same math in differentiable torch ops,
        # as the CPU path has; the kernel's backward has no derivative of its own
        from ..tiled_mlp_torch import _swiglu_backward_torch
        dg, du = _swiglu_backward_torch(grad_h, gate, up)
    else:
        dg, du = swiglu_backward_op(grad_h, gate, up)
    return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None)


swiglu.register_autograd(_backward, setup_context=_setup_context)
