"""Fused SwiGLU ``h = silu(gate) * up`` and its backward as Pallas kernels, with a
``jax.custom_vjp`` that saves only ``gate`` and ``up``.

Elementwise over ``[rows, cols]`` (the leading dims flattened), one ``block_rows ×
block_cols`` tile per program of a 2-D grid, every load and store masked (ragged edges never
touch memory out of bounds). Math in fp32, rounded once to the output dtype. The backward
kernel writes ``d gate`` and ``d up`` over ``gate`` and ``up`` (``input_output_aliases``): the
residuals are dead after it. GPU: Pallas' Triton backend; elsewhere interpret mode.

:func:`swiglu_math` / :func:`swiglu_grad_math` are the jnp math on fp32 blocks: the kernels
run them per tile, :mod:`logitless.tiled_mlp_jax` on whole arrays (its ``backend="xla"``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..specs.tiling import ceil_div, next_power_of_2
from ._launch import typed_call

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# GPU: 4096-element tiles, 4 warps (32 elements per thread). Interpreted: the grid is a
# sequential loop, so few large tiles.
GPU_TILE_ELEMENTS = 4096
GPU_MAX_BLOCK_COLS = 1024
GPU_NUM_WARPS = 4
INTERPRET_TILE_ELEMENTS = 1 << 16


def _sigmoid(g):
    # 1/(1+exp(-g)): exp lowers everywhere (Triton included); exp overflow gives σ = 0.
    return 1.0 / (1.0 + jnp.exp(-g))


def swiglu_math(g, u):
    """``silu(g)·u`` on fp32 arrays."""
    return g * _sigmoid(g) * u


def swiglu_grad_math(dh, g, u):
    """``(d g, d u)`` of ``silu(g)·u`` on fp32 arrays."""
    s = _sigmoid(g)
    silu = g * s
    return dh * u * (s + silu * (1.0 - s)), dh * silu


# ----------------------------------------------------------------------------- kernels
def _tile(n_rows, n_cols, block_rows, block_cols):
    r0 = pl.program_id(0) * block_rows
    c0 = pl.program_id(1) * block_cols
    rmask = r0 + jnp.arange(block_rows, dtype=jnp.int32) < n_rows
    cmask = c0 + jnp.arange(block_cols, dtype=jnp.int32) < n_cols
    return (pl.ds(r0, block_rows), pl.ds(c0, block_cols)), rmask[:, None] & cmask[None, :]


def _load(ref, idx, mask):
    return plgpu.load(ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)


def _fwd_kernel(g_ref, u_ref, h_ref, *, block_rows, block_cols):
    idx, mask = _tile(g_ref.shape[0], g_ref.shape[1], block_rows, block_cols)
    h = swiglu_math(_load(g_ref, idx, mask), _load(u_ref, idx, mask))
    plgpu.store(h_ref.at[idx], h.astype(h_ref.dtype), mask=mask)


def _bwd_kernel(dh_ref, g_ref, u_ref, dg_ref, du_ref, *, block_rows, block_cols):
    idx, mask = _tile(g_ref.shape[0], g_ref.shape[1], block_rows, block_cols)
    dg, du = swiglu_grad_math(_load(dh_ref, idx, mask), _load(g_ref, idx, mask),
                              _load(u_ref, idx, mask))
    plgpu.store(dg_ref.at[idx], dg.astype(dg_ref.dtype), mask=mask)
    plgpu.store(du_ref.at[idx], du.astype(du_ref.dtype), mask=mask)


@dataclasses.dataclass(frozen=True)
class Config:
    block_rows: Optional[int]   # None: from the tile size
    block_cols: Optional[int]
    num_warps: int
    interpret: bool

    def blocks(self, n_rows, n_cols):
        tile = INTERPRET_TILE_ELEMENTS if self.interpret else GPU_TILE_ELEMENTS
        bc = self.block_cols or min(next_power_of_2(max(n_cols, 1)),
                                    tile if self.interpret else GPU_MAX_BLOCK_COLS)
        br = self.block_rows or min(max(1, tile // bc), next_power_of_2(max(n_rows, 1)))
        return br, bc

    def call(self, kernel, args, n_out, name, aliases=None):
        n_rows, n_cols = args[-1].shape
        br, bc = self.blocks(n_rows, n_cols)
        out = jax.ShapeDtypeStruct((n_rows, n_cols), args[-1].dtype)
        return typed_call(
            functools.partial(kernel, block_rows=br, block_cols=bc), args,
            out if n_out == 1 else (out,) * n_out,
            grid=(ceil_div(n_rows, br), ceil_div(n_cols, bc)),
            input_output_aliases=aliases or {}, interpret=self.interpret,
            compiler_params=plgpu.CompilerParams(num_warps=self.num_warps, num_stages=1),
            name=name)


def _fwd2d(cfg: Config, g, u):
    return cfg.call(_fwd_kernel, (g, u), 1, "logitless_swiglu_fwd")


def _bwd2d(cfg: Config, dh, g, u):
    # d gate over gate, d up over up: callers pass residuals that die here
    return cfg.call(_bwd_kernel, (dh.astype(g.dtype), g, u), 2, "logitless_swiglu_bwd",
                    aliases={1: 0, 2: 1})


@functools.lru_cache(maxsize=64)
def _custom_vjp_fn(cfg: Config):
    @jax.custom_vjp
    def f(g, u):
        return _fwd2d(cfg, g, u)

    def f_fwd(g, u):
        return _fwd2d(cfg, g, u), (g, u)

    def f_bwd(res, dh):
        return _bwd2d(cfg, dh, *res)

    f.defvjp(f_fwd, f_bwd)
    return f


def check_pair(gate, up):
    for name, a in (("gate", gate), ("up", up)):
        if not isinstance(a, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax.Array, got {type(a).__name__}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got {a.dtype}")
    if gate.shape != up.shape:
        raise ValueError(f"up has shape {list(up.shape)} but gate has {list(gate.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"up dtype {up.dtype} does not match gate dtype {gate.dtype}")
    if gate.ndim == 0:
        raise ValueError("gate and up must have at least one dimension")


TUNING = ("block_rows", "block_cols", "num_warps", "interpret")


def _config(gate, up, block_rows=None, block_cols=None, num_warps=None, interpret=None) -> Config:
    check_pair(gate, up)
    if jnp.dtype(gate.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"the Pallas SwiGLU supports float32/bfloat16/float16, got {gate.dtype}")
    for name, v in (("block_rows", block_rows), ("block_cols", block_cols)):
        bad = isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1)
        if v is not None and bad:
            raise ValueError(f"{name} must be a power of two, got {v!r}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of 2 in [1, 32], got {num_warps!r}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    elif not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool or None, got {interpret!r}")
    return Config(block_rows, block_cols, num_warps or GPU_NUM_WARPS, interpret)


def _rows(a):
    return jnp.reshape(a, (-1, a.shape[-1]))


def swiglu(gate, up, **tuning):
    """``silu(gate) * up`` through the Pallas kernels (differentiable).

    Tuning: ``block_rows`` × ``block_cols`` (powers of two; default a 4096-element tile on a
    GPU), ``num_warps`` (default 4), ``interpret`` (default: True unless JAX's default
    backend is a GPU).
    """
    cfg = _config(gate, up, **tuning)
    if gate.size == 0:
        return jnp.zeros(gate.shape, gate.dtype)
    return jnp.reshape(_custom_vjp_fn(cfg)(_rows(gate), _rows(up)), gate.shape)


def swiglu_forward(gate, up, **tuning):
    """The forward kernel alone (not differentiable)."""
    cfg = _config(gate, up, **tuning)
    if gate.size == 0:
        return jnp.zeros(gate.shape, gate.dtype)
    return jnp.reshape(_fwd2d(cfg, _rows(gate), _rows(up)), gate.shape)


def swiglu_backward(grad_h, gate, up, **tuning):
    """``(d gate, d up)`` from the backward kernel alone (written over ``gate`` and ``up``
    when the caller no longer needs them)."""
    cfg = _config(gate, up, **tuning)
    if grad_h.shape != gate.shape:
        raise ValueError(f"grad_h has shape {list(grad_h.shape)} but gate has {list(gate.shape)}")
    if gate.size == 0:
        return jnp.zeros(gate.shape, gate.dtype), jnp.zeros(up.shape, up.dtype)
    dg, du = _bwd2d(cfg, _rows(grad_h), _rows(gate), _rows(up))
    return jnp.reshape(dg, gate.shape), jnp.reshape(du, up.shape)
