"""``backend="pallas"`` for linear JSD: one Pallas kernel per token chunk between XLA GEMMs.

Per chunk of tokens (the plan of :mod:`logitless.specs.tiling`):

1. the student and teacher logits GEMMs through XLA, written as float32 straight from the
   half-precision GEMM (``fp32_logits=True``, the default: JSD's gradient needs unrounded
   logits, see the spec);
2. one Pallas kernel over the chunk's rows, three sweeps over a row's vocabulary: the online
   normalizers of both heads (and, for β ∈ {0, 1}, the KL itself), then (0 < β < 1)
   K = KL(Q‖M) and the loss, then the student logit gradient (written backwards, starting on
   the columns the previous sweep read last) in the input dtype;
3. dX_c = dz_c·W_s and dW += dz_cᵀ·x_s,c through XLA, dW accumulating in float32.

The chunk loop and the ``jax.custom_vjp`` are the shared driver of :mod:`logitless._jax_jsd`,
whose row-block math the kernel runs on each column block. Every load is masked: ragged row
and vocabulary ends never read out of bounds; masked logits read as 0 and are excluded from
the reductions. GPU: Pallas' Triton backend; elsewhere interpret mode (where, as for linear
cross-entropy, a gradient with ``jax_enable_x64`` on raises ``NotImplementedError``: a Pallas
interpreter limitation; the loss alone runs; use ``backend="xla"``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import _jax_jsd as jc
from ..specs import linear_jsd as spec
from ..specs.tiling import ceil_div
from . import _launch as launch

TUNING = ("chunk_size", "logits_chunk_size", "memory_budget", "block_rows", "block_v",
          "num_warps", "num_stages", "grid_size", "fp32_logits", "interpret")

# GPU defaults, by analogy with the linear-CE kernel's H100 tuning (long column blocks, one
# 16-warp program per SM); to be re-tuned with benchmarks/linear_jsd.py. The budget covers the
# chunk's two float32 logits buffers and its gradient buffer.
GPU_DEFAULTS = dict(memory_budget=896 << 20, block_rows=1, block_v=8192, num_warps=16,
                    num_stages=2, programs_per_sm=1)
# With float32 logits of half-precision inputs the logits GEMMs and the kernel run on
# sub-chunks of chunk / LOGITS_SHARE tokens (the gradient buffer keeps the whole chunk, so
# that dW's float32 accumulator is read and written once per chunk): as the Triton backend.
LOGITS_SHARE = 4


def _rows_kernel(zs_ref, zt_ref, *refs, v, block_rows, block_v, grid_size, kind, beta,
                 temperature, hard_w, has_y, t_one, write_grad):
    """Program p handles row blocks p, p + grid_size, ... of ``block_rows`` rows each.
    refs: [y (C,) int32, -1 = no target column], [coef (C,) f32 = g·m], loss (C,) f32,
    [dz (C, V)]."""
    refs = list(refs)
    y_ref = refs.pop(0) if has_y else None
    coef_ref = refs.pop(0) if write_grad else None
    loss_ref = refs[0]
    dz_ref = refs[1] if write_grad else None
    n_rows = zs_ref.shape[0]
    n_vblocks = ceil_div(v, block_v)
    hard = hard_w > 0
    kw = dict(kind=kind, hard=hard, t_one=t_one)
    inv_t = 1.0 / temperature

    def row_block(r0):
        rmask = (r0 + launch.iota(block_rows)) < n_rows
        rows = pl.ds(r0, block_rows)
        y = plgpu.load(y_ref.at[rows], mask=rmask, other=-1) if has_y else None

        def block(j):
            cols = j * block_v + launch.iota(block_v)
            cmask = cols < v
            span = pl.ds(j * block_v, block_v)
            m2 = rmask[:, None] & cmask[None, :]
            zs = plgpu.load(zs_ref.at[rows, span], mask=m2, other=0.0).astype(jnp.float32)
            zt = plgpu.load(zt_ref.at[rows, span], mask=m2, other=0.0).astype(jnp.float32)
            is_target = (cols[None, :] == y[:, None]) if has_y else \
                jnp.zeros((block_rows, block_v), bool)
            return zs, zt, cmask, is_target, span

        def sweep1(j, carry):
            zs, zt, cmask, is_target, _ = block(j)
            return jc.stats_update(carry, zs * inv_t, zt * inv_t, zs, cmask, is_target, **kw)

        stats = lax.fori_loop(launch.I0, np.int32(n_vblocks), sweep1, jc.stats_init(block_rows))
        l_a, c, l_z, z_y, kl = jc.stats_finish(stats, **kw)
        if kind == "jsd":
            def sweep2(j, carry):
                zs, zt, cmask, _, _ = block(j)
                return jc.jsd_sums_update(carry, zs * inv_t, zt * inv_t, l_a, c, cmask,
                                          beta=beta)

            zero = jnp.zeros((block_rows,), jnp.float32)
            kk, jj = lax.fori_loop(launch.I0, np.int32(n_vblocks), sweep2, (zero, zero))
        else:
            kk = jj = kl
        plgpu.store(loss_ref.at[rows], jc.row_loss(jj, l_z, z_y, hard_w, hard), mask=rmask)

        if write_grad:
            coef = plgpu.load(coef_ref.at[rows], mask=rmask, other=0.0)

            def sweep3(j):
                zs, zt, cmask, is_target, span = block(j)
                dz = jc.grad_block(zs * inv_t, zt * inv_t, zs, is_target, l_a, c, l_z, kk,
                                   coef, coef * hard_w, beta=beta, temperature=temperature, **kw)
                return dz, cmask, span

            launch.store_grad_backwards(dz_ref, rows, rmask, n_vblocks, sweep3)

    launch.walk_row_blocks(row_block, n_rows, block_rows, grid_size)


@dataclasses.dataclass(frozen=True)
class PallasHead(jc.Head):
    kind: str
    beta: float
    temperature: float
    hard_w: float
    block_rows: int
    block_v: int
    num_warps: int
    num_stages: int
    grid_size: Optional[int]  # None: one program per row block
    interpret: bool
    fp32_logits: bool = True

    @property
    def logits_dtype(self):
        return jnp.float32 if self.fp32_logits else None

    def _call(self, zs, zt, y, coef, grad_dtype):
        n_rows, v = zs.shape
        block_rows, block_v, grid_size = launch.tile(self, n_rows, v)
        write_grad = grad_dtype is not None
        launch.check_interpret_x64(self, write_grad)
        inputs = [zs, zt] + ([y] if y is not None else []) + ([coef] if write_grad else [])
        out_shape = [jax.ShapeDtypeStruct((n_rows,), jnp.float32)]
        if write_grad:
            out_shape.append(jax.ShapeDtypeStruct(zs.shape, grad_dtype))
        in_place = write_grad and jnp.dtype(grad_dtype) == zs.dtype  # dz overwrites zs
        kernel = functools.partial(
            _rows_kernel, v=v, block_rows=block_rows, block_v=block_v, grid_size=grid_size,
            kind=self.kind, beta=self.beta, temperature=self.temperature, hard_w=self.hard_w,
            has_y=y is not None, t_one=self.temperature == 1.0, write_grad=write_grad)
        out = launch.call(self, kernel, inputs, out_shape, grid_size=grid_size,
                          aliases={0: 1} if in_place else {}, name="logitless_linear_jsd_rows")
        return out if write_grad else out[0]

    def loss(self, zs, zt, y):
        return self._call(zs, zt, y, None, None)

    def loss_grad(self, zs, zt, y, coef, grad_dtype):
        return self._call(zs, zt, y, coef, grad_dtype)


def linear_jsd(p: jc.Prepared, opts: spec.LinearJSDOptions, *, chunk_size=None,
               logits_chunk_size=None, memory_budget=None, block_rows=None, block_v=None,
               num_warps=None, num_stages=None, grid_size=None, fp32_logits=True,
               interpret=None):
    """The loss reduced per ``opts.reduction`` (flat for "none").

    Tuning: ``chunk_size`` (tokens per dX / dW chunk), ``logits_chunk_size`` (tokens per
    logits GEMM and kernel call), ``memory_budget`` (bytes of the chunk's gradient and logits
    buffers; sets both sizes when not given), ``block_rows`` × ``block_v`` (the kernel's tile,
    powers of two), ``num_warps``,
    ``num_stages`` (Triton), ``grid_size`` (persistent programs; default SMs ×
    ``GPU_DEFAULTS["programs_per_sm"]`` on a GPU, one per row block when interpreted),
    ``fp32_logits`` (False: logits in the input dtype, less memory and traffic, ~1e-2 less
    accurate gradients in bf16), ``interpret`` (default: True unless JAX's default backend is
    a GPU).
    """
    settings = launch.resolve(GPU_DEFAULTS, block_rows=block_rows, block_v=block_v,
                              num_warps=num_warps, num_stages=num_stages, grid_size=grid_size,
                              fp32_logits=fp32_logits, interpret=interpret)
    head = PallasHead(
        kind=opts.kind, beta=opts.beta, temperature=opts.temperature,
        hard_w=opts.hard_loss_weight, **settings)
    plan, sub = jc.plan_chunks(p, fp32_logits, LOGITS_SHARE,
                               launch.pick(GPU_DEFAULTS, memory_budget, "memory_budget"),
                               chunk_size, logits_chunk_size)
    return jc.chunked_linear_jsd(p, opts, plan, head, sub)
