"""``backend="pallas"``: linear cross-entropy with one Pallas kernel per token chunk.

Per chunk of tokens (the plan of :mod:`logitless.specs.tiling`):

1. the logits GEMM through XLA, in the input dtype (the very logits a naive user gets);
2. one Pallas kernel over the chunk's rows: sweep 1 over a row's vocabulary computes the online
   max / log-sum-exp, the target logit, the smoothing sum Σ_v w_v c_v, the token's loss and lse;
   sweep 2 (when gradients are wanted) writes the logit gradient dz over the logits buffer
   itself (``input_output_aliases``), in the input dtype;
3. dX_c = dz_c·W and dW += dz_cᵀ·x_c through XLA, dW accumulating in float32.

The chunk loop and the ``jax.custom_vjp`` (gradients computed in the forward sweep for
mean/sum, recomputed per chunk otherwise) are the shared driver of :mod:`logitless._jax_common`.
Only one ``[chunk, V]`` buffer (logits, then their gradient) exists at a time.

GPU: the kernel uses Pallas' Triton backend (``compiler_params`` from
``jax.experimental.pallas.triton``); masked loads/stores cover the ragged ends of rows and of
the row blocks, and Pallas switches to 64-bit offsets when a buffer passes 2³² bytes. On other
platforms it runs in interpret mode (whose gradient sweep, in jax 0.10, cannot run with
``jax_enable_x64`` on: its discharge of a masked store inside a loop mixes int32 and int64
indices, so a gradient there raises ``NotImplementedError``; the loss alone runs; use
``backend="xla"``).
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

from .. import _jax_common as common
from ..specs import linear_cross_entropy as spec
from ..specs.tiling import ceil_div
from . import _launch as launch

TUNING = ("chunk_size", "memory_budget", "block_rows", "block_v", "num_warps", "num_stages",
          "grid_size", "fp32_logits", "interpret")

# Every GPU-specific default in one place. The chunk budget covers the one [chunk, V] logits
# buffer; the float32 dW accumulator (V·H·4 bytes) comes on top of it. ``programs_per_sm``
# sizes the persistent grid (grid_size = SMs × it): few rows in flight, so that sweep 2
# re-reads its row from L2. Tuned on an H100 (benchmarks/jax_linear_cross_entropy.py, bf16):
# 1 GiB / 16K-column blocks / 16 warps gave 78.5 ms at N=16384,H=4096,V=128256 (512 MiB / 4K /
# 8 warps: 82.7) and 48.0 ms at N=8192,H=2304,V=256000 (56.5): fewer chunks mean fewer passes
# over the fp32 dW accumulator, and long blocks stream the rows faster.
GPU_DEFAULTS = dict(memory_budget=1 << 30, block_rows=1, block_v=16384, num_warps=16,
                    num_stages=2, programs_per_sm=1)


def _rows_kernel(z_ref, y_ref, coef_ref, *refs, v, block_rows, block_v, grid_size, softcap,
                 smoothing, has_bias, has_cw, write_grad):
    """Program p handles row blocks p, p + grid_size, ... of ``block_rows`` rows each, and
    walks each row's vocabulary in ``block_v`` columns: sweep 1 forward, sweep 2 (the gradient)
    backward, so that it starts on the columns sweep 1 read last (still in cache).

    refs: [bias (V,)], [class weights (V,) f32], loss (C,) f32, lse (C,) f32, [dz (C, vp),
    aliasing z unless z is float32 logits of half-precision inputs]. ``z`` and ``dz`` may be
    wider than ``v`` (the padded vocabulary of ``_jax_common.VocabWeight``): columns past ``v``
    are loaded (a mask bound such as 50257 would keep every load scalar; the padded width, a
    multiple of 8, lets them vectorize) but masked out of every reduction, and their gradient
    is written as 0. Every load is masked at the width, so ragged row / vocabulary ends never
    read out of bounds; masked logits read as 0 (finite).
    """
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    cw_ref = refs.pop(0) if has_cw else None
    loss_ref, lse_ref = refs[0], refs[1]
    dz_ref = refs[2] if write_grad else None
    n_rows = z_ref.shape[0]
    n_vblocks = ceil_div(v, block_v)

    def row_block(r0):
        rmask = (r0 + launch.iota(block_rows)) < n_rows
        rows = pl.ds(r0, block_rows)
        y = plgpu.load(y_ref.at[rows], mask=rmask, other=-1)
        # coef_ref is the (6, C) coefficient array flattened: row k of it starts at k·C
        coef = [plgpu.load(coef_ref.at[pl.ds(k * n_rows + r0, block_rows)], mask=rmask,
                           other=0.0) for k in range(common.NUM_COEFS)]
        b, sm, smo, zw, g, h = (coef[k] for k in (common.B, common.SM, common.SMO, common.ZW,
                                                   common.G, common.H))

        def block(j):
            """Capped logits of column block j (fp32), column mask, target indicator, w_v."""
            cols = j * block_v + launch.iota(block_v)
            cmask = cols < v
            span = pl.ds(j * block_v, block_v)
            lmask = cols < z_ref.shape[1]  # the padding too: a bound of 8k vectorizes
            z = plgpu.load(z_ref.at[rows, span], mask=rmask[:, None] & lmask[None, :],
                           other=0.0).astype(jnp.float32)
            if has_bias:
                z = z + plgpu.load(bias_ref.at[span], mask=cmask,
                                   other=0.0).astype(jnp.float32)[None, :]
            cw = plgpu.load(cw_ref.at[span], mask=cmask, other=0.0) if has_cw else None
            is_target = cols[None, :] == y[:, None]
            return common.capped(z, softcap), cmask, is_target, cw, span

        def sweep1(j, carry):
            m, s, c_y, wc = carry
            c, cmask, is_target, cw, _ = block(j)
            live = jnp.where(cmask[None, :], c, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(live, axis=1))
            # while the max is still -inf (a block of classes masked by a -inf bias) the sum's
            # reference point is 0, not -inf: exp(-inf - -inf) would be NaN
            ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            s = s * common.exp(m - ref) + jnp.sum(common.exp(live - ref[:, None]), axis=1)
            c_y = c_y + jnp.sum(jnp.where(is_target, c, 0.0), axis=1)
            if smoothing:
                wterm = c if cw is None else c * cw[None, :]
                wc = wc + jnp.sum(jnp.where(cmask[None, :], wterm, 0.0), axis=1)
            return m_new, s, c_y, wc

        zeros = jnp.zeros((block_rows,), jnp.float32)
        init = (jnp.full((block_rows,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
        m, s, c_y, wc = lax.fori_loop(launch.I0, np.int32(n_vblocks), sweep1, init)
        lse = m + jnp.log(s)
        loss = common.token_loss(lse, c_y, wc if smoothing else None, b, sm, smo, zw)
        plgpu.store(loss_ref.at[rows], loss, mask=rmask)
        plgpu.store(lse_ref.at[rows], lse, mask=rmask)

        if write_grad:
            def sweep2(j):
                c, cmask, is_target, cw, span = block(j)
                dz = common.grad_logits(c, lse, is_target, cw, b, sm, smo, zw, g, h,
                                        softcap=softcap, smoothing=smoothing)
                return dz, cmask, span

            launch.store_grad_backwards(dz_ref, rows, rmask, v, block_v, sweep2)

    launch.walk_row_blocks(row_block, n_rows, block_rows, grid_size)


@dataclasses.dataclass(frozen=True)
class PallasHead(common.Head):
    softcap: Optional[float]
    smoothing: bool
    block_rows: int
    block_v: int
    num_warps: int
    num_stages: int
    grid_size: Optional[int]  # None: one program per row block
    interpret: bool
    fp32_logits: bool = False
    takes_padded_vocab = True  # (not a field) no trimmed copy of the logits for the kernel

    @property
    def logits_dtype(self):
        return jnp.float32 if self.fp32_logits else None

    def _call(self, z, y, coefs, bias, cw, grad_dtype=None, *, v):
        n_rows = z.shape[0]
        block_rows, block_v, grid_size = launch.tile(self, n_rows, v)
        has_cw = cw is not None and self.smoothing  # class weights enter the kernel only here
        inputs = [z, y, coefs.reshape(-1)] + ([bias] if bias is not None else []) \
            + ([cw] if has_cw else [])
        write_grad = grad_dtype is not None
        launch.check_interpret_x64(self, write_grad)
        out_shape = [jax.ShapeDtypeStruct((n_rows,), jnp.float32)] * 2
        if write_grad:
            out_shape.append(jax.ShapeDtypeStruct(z.shape, grad_dtype))
        # the gradient overwrites the logits buffer in place when their dtypes agree
        in_place = write_grad and jnp.dtype(grad_dtype) == z.dtype
        kernel = functools.partial(
            _rows_kernel, v=v, block_rows=block_rows, block_v=block_v, grid_size=grid_size,
            softcap=self.softcap, smoothing=self.smoothing, has_bias=bias is not None,
            has_cw=has_cw, write_grad=write_grad)
        return launch.call(self, kernel, inputs, tuple(out_shape), grid=(grid_size,),
                           aliases={0: 2} if in_place else {},
                           name="logitless_linear_cross_entropy_rows")

    def loss_lse(self, z, y, coefs, bias, cw, *, v):
        return self._call(z, y, coefs, bias, cw, v=v)

    def loss_lse_grad(self, z, y, coefs, bias, cw, grad_dtype, *, v):
        return self._call(z, y, coefs, bias, cw, grad_dtype, v=v)


def linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, *,
                         chunk_size=None, memory_budget=None, block_rows=None, block_v=None,
                         num_warps=None, num_stages=None, grid_size=None, fp32_logits=False,
                         interpret=None):
    """Returns ``(loss, lse)``: loss reduced per ``opts.reduction`` (flat for "none").

    Tuning: ``chunk_size`` / ``memory_budget`` (bytes of the one [chunk, V] logits buffer),
    ``block_rows`` × ``block_v`` (the kernel's tile, powers of two), ``num_warps``,
    ``num_stages`` (Triton), ``grid_size`` (programs of the persistent grid; default: SMs ×
    ``GPU_DEFAULTS["programs_per_sm"]`` on a GPU, one program per row block when interpreted),
    ``fp32_logits`` (the logits GEMM writes float32 and the kernel writes the bf16/fp16
    gradient to a second buffer: the loss math sees unrounded logits, for 3 bytes more per
    [chunk, V] element of memory and traffic; no effect for float32 inputs),
    ``interpret`` (default: True unless JAX's default backend is a GPU).
    """
    settings = launch.resolve(GPU_DEFAULTS, block_rows=block_rows, block_v=block_v,
                              num_warps=num_warps, num_stages=num_stages,
                              fp32_logits=fp32_logits, interpret=interpret)
    head = PallasHead(
        softcap=opts.softcap, smoothing=opts.uses_smoothing, **settings,
        grid_size=launch.resolve_grid(GPU_DEFAULTS, grid_size, settings["interpret"]))
    bytes_per = p.x.dtype.itemsize + (4 if fp32_logits and p.x.dtype.itemsize < 4 else 0)
    plan = common.token_plan(p.problem.n, p.problem.v, bytes_per_element=bytes_per,
                             budget_bytes=launch.pick(GPU_DEFAULTS, memory_budget,
                                                      "memory_budget"),
                             chunk_size=chunk_size)
    return common.chunked_linear_cross_entropy(p, opts, plan, head)
