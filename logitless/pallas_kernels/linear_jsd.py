"""``backend="pallas"`` for linear JSD: Pallas kernels per token chunk between XLA GEMMs.

Per chunk of tokens (the plan of :mod:`logitless.specs.tiling`, equal chunks, padded to a
whole number of them):

1. the student and teacher logits GEMMs through XLA, written as float32 straight from the
   half-precision GEMM (``fp32_logits=True``, the default: JSD's gradient needs unrounded
   logits, see the spec);
2. one Pallas launch per pass, each program on one row block and one column segment
   (``segment_size`` columns): pass 1 the segment's online normalizers of both heads (and,
   for β ∈ {0, 1}, the KL sums), merged per row in XLA into the gap c = L_b − L_a; pass 2
   (0 < β < 1) the segment's sums of K = KL(Q‖M) (and of Q, its divisor) and of the loss;
   pass 3 the student logit gradient in the input dtype (and, when it runs, the JSD loss
   sums instead of pass 2);
3. dX_c = dz_c·W_s and dW += dz_cᵀ·x_s,c through XLA, dW accumulating in float32.

The chunk loop and the ``jax.custom_vjp`` are the shared driver of :mod:`logitless._jax_jsd`,
whose row-block math the kernels run on each column block. Every load is masked: ragged row
and vocabulary ends never read out of bounds; masked logits read as 0 and are excluded from
the reductions. GPU: Pallas' Triton backend; elsewhere interpret mode (where, as for linear
cross-entropy, a gradient with ``jax_enable_x64`` on raises ``NotImplementedError``: a Pallas
interpreter limitation; the loss alone runs; use ``backend="xla"``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import _jax_common as common
from .. import _jax_jsd as jc
from ..specs import linear_jsd as spec
from ..specs.tiling import ceil_div
from . import _launch as launch

TUNING = ("chunk_size", "logits_chunk_size", "memory_budget", "block_rows", "block_v",
          "num_warps", "num_stages", "segment_size", "fp32_logits", "interpret")

# GPU defaults (H100, N = 8192, H = 4096, V = 128256; benchmarks/jax_jsd_profile.py and
# results/…-jax-jsd-tuning.jsonl). The budget covers a chunk's gradient buffer and its two float32
# logits buffers, 10 bytes per logit for bf16 inputs: 2048-token chunks there. The logits GEMMs
# run on whole chunks, which they need to be fast (below ~1024 rows they slow down; sub-chunks
# also cost a copy into the chunk's gradient buffer), and every chunk is a pass of XLA's float32
# dW accumulation (~0.5 ms at 1024 tokens). Measured, ms: 1792-token chunks with 384-token logits
# sub-chunks (the previous default) 72.5-73.7 and 4.6 GB of XLA temporaries; 1024 / 1024 68.5 and
# 3.0 GB; 2048 / 1024 67.1-67.9; 2048 / 2048 63.2-65.3 and 3.8 GB, all with the previous kernel
# (one persistent 16-warp program per SM walking whole rows, three sweeps each), which one launch
# per pass over 8192-column segments beats by ~2 ms (61.7-61.8 against 63.8-63.9 in one run;
# 2048-column blocks, 4 warps; other shapes within 1 ms).
GPU_DEFAULTS = dict(memory_budget=2560 << 20, block_rows=1, block_v=2048, num_warps=4,
                    num_stages=2, segment_size=8192)
# Tokens per chunk over tokens per logits GEMM by default (1: no sub-chunks; the Triton backend
# uses 4, as torch's float32 accumulation costs a pass over dW per chunk).
LOGITS_SHARE = 1


# One launch per pass. Program (r, s) takes row block r and column segment s (``seg_blocks``
# blocks of ``block_v``). Pass 1 writes each segment's pass-1 carry, XLA merges them
# (``jc.stats_merge``); pass 2 (0 < β < 1) writes each segment's K, J and ΣQ sums; pass 3 writes
# dz (and then the segments' J, which pass 2 leaves out). Every segment starts on a live
# column (there are ⌈V / segment⌉ of them), so its running maxima are finite after its first
# block and a masked block after it adds nothing.
_ROWS = 7  # the row values of ``jc.stats_finish`` (M_s, log s_a, M_t, log s_b, c, far, lsd)


def _segment(zs_ref, zt_ref, y_ref, *, v, block_rows, block_v, seg_blocks, inv_t):
    """(rows, rmask, block) of this program: block(t) loads the segment's t-th column block
    (the raw logits z_s, z_t as float32 and d of ``_jax_jsd.scaled_gap``) over the buffers'
    whole width (``lmask``: the padded vocabulary of ``_jax_common.VocabWeight`` too, so that the loads
    vectorize; a mask bound such as 50257 would keep them scalar); ``cmask`` keeps the columns
    past ``v`` out of every sum."""
    n_rows = zs_ref.shape[0]
    r0 = pl.program_id(0) * block_rows
    c0 = pl.program_id(1) * (seg_blocks * block_v)
    rmask = (r0 + launch.iota(block_rows)) < n_rows
    rows = pl.ds(r0, block_rows)
    y = plgpu.load(y_ref.at[rows], mask=rmask, other=-1) if y_ref is not None else None

    def block(t):
        cols = c0 + t * block_v + launch.iota(block_v)
        cmask = cols < v
        span = pl.ds(c0 + t * block_v, block_v)
        lmask = rmask[:, None] & (cols < zs_ref.shape[1])[None, :]
        zs = plgpu.load(zs_ref.at[rows, span], mask=lmask, other=0.0).astype(jnp.float32)
        zt = plgpu.load(zt_ref.at[rows, span], mask=lmask, other=0.0).astype(jnp.float32)
        d = jc.scaled_gap(zs, zt, inv_t)
        is_target = (cols[None, :] == y[:, None]) if y is not None else \
            jnp.zeros((block_rows, block_v), bool)
        return zs, zt, d, cmask, is_target, span, lmask

    return rows, rmask, block


def _load_row_values(ref, k, rows, rmask):
    """Row k of a (values, rows) array, for this row block."""
    return plgpu.load(ref.at[pl.ds(k, 1), rows], mask=rmask[None, :], other=0.0)[0]


def _store_parts(out_ref, values, rows, rmask):
    """Row vectors ``values`` into rows ``segment·len(values) + k`` of ``out_ref``."""
    base = pl.program_id(1) * len(values)
    for k, val in enumerate(values):
        plgpu.store(out_ref.at[pl.ds(base + k, 1), rows], val[None, :], mask=rmask[None, :])


def _stats_kernel(zs_ref, zt_ref, *refs, has_y, seg_blocks, kw, **tile):
    y_ref = refs[0] if has_y else None
    rows, rmask, block = _segment(zs_ref, zt_ref, y_ref, seg_blocks=seg_blocks, **tile)

    def body(t, carry):
        zs, zt, d, cmask, is_target, _, _ = block(t)
        return jc.stats_update(carry, zs, zt, d, cmask, is_target, inv_t=tile["inv_t"], **kw)

    stats = lax.fori_loop(launch.I0, np.int32(seg_blocks), body,
                          jc.stats_init(tile["block_rows"]))
    _store_parts(refs[-1], stats, rows, rmask)


def _sums_kernel(zs_ref, zt_ref, row_ref, out_ref, *, seg_blocks, beta, with_j, **tile):
    rows, rmask, block = _segment(zs_ref, zt_ref, None, seg_blocks=seg_blocks, **tile)
    row_vals = tuple(_load_row_values(row_ref, k, rows, rmask) for k in range(_ROWS))

    def body(t, carry):
        zs, zt, _, cmask, _, _, _ = block(t)
        return jc.jsd_sums_update(carry, zs, zt, row_vals, cmask, beta=beta,
                                  inv_t=tile["inv_t"], with_j=with_j)

    zero = jnp.zeros((tile["block_rows"],), jnp.float32)
    _store_parts(out_ref, lax.fori_loop(launch.I0, np.int32(seg_blocks), body, (zero,) * 3),
                 rows, rmask)


def _grad_kernel(zs_ref, zt_ref, *refs, has_y, seg_blocks, beta, hard_w, with_j, kw, **tile):
    y_ref = refs[0] if has_y else None
    row_ref, dz_ref = (refs[-3], refs[-2]) if with_j else (refs[-2], refs[-1])
    rows, rmask, block = _segment(zs_ref, zt_ref, y_ref, seg_blocks=seg_blocks, **tile)
    vals = [_load_row_values(row_ref, k, rows, rmask) for k in range(_ROWS + 3)]
    row_vals, (l_z, kk, coef) = tuple(vals[:_ROWS]), vals[_ROWS:]

    def body(t, j):
        zs, zt, _, cmask, is_target, span, lmask = block(t)
        dz = jc.grad_block(zs, zt, is_target, row_vals, l_z, kk, coef, coef * hard_w,
                           beta=beta, inv_t=tile["inv_t"], j_live=cmask if with_j else None,
                           **kw)
        if with_j:
            dz, j_part = dz
            j = j + j_part
        if zs_ref.shape[1] > tile["v"]:  # the padded classes' gradient is 0 (the GEMMs read them)
            dz = jnp.where(cmask[None, :], dz, 0.0)
        plgpu.store(dz_ref.at[rows, span], dz.astype(dz_ref.dtype), mask=lmask)
        return j

    j = lax.fori_loop(launch.I0, np.int32(seg_blocks), body,
                      jnp.zeros((tile["block_rows"],), jnp.float32))
    if with_j:
        _store_parts(refs[-1], (j,), rows, rmask)


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
    segment_size: int
    interpret: bool
    fp32_logits: bool = True
    takes_padded_vocab = True  # (not a field) no trimmed copies of the logits for the kernels

    @property
    def logits_dtype(self):
        return jnp.float32 if self.fp32_logits else None

    def _call(self, zs, zt, y, coef, grad_dtype, *, v):
        """Three launches (two for the KL kinds or the loss alone), grid (row blocks,
        segments); the per-row merges between them run in XLA. The gradient's segments cover
        the buffers' whole width (the padded vocabulary, whose gradient is 0)."""
        n_rows, width = zs.shape
        block_rows, block_v = launch.block_shape(self, n_rows, v)
        seg_blocks = min(max(1, self.segment_size // block_v), ceil_div(v, block_v))
        n_seg = ceil_div(v, seg_blocks * block_v)
        grid = (ceil_div(n_rows, block_rows), n_seg)
        write_grad = grad_dtype is not None
        launch.check_interpret_x64(self, write_grad)
        hard, t_one = self.hard_w > 0, self.temperature == 1.0
        kw = dict(kind=self.kind, hard=hard, t_one=t_one)
        tile = dict(v=v, block_rows=block_rows, block_v=block_v, seg_blocks=seg_blocks,
                    inv_t=1.0 / self.temperature)
        parts = lambda k: jax.ShapeDtypeStruct((n_seg * k, n_rows), jnp.float32)
        ys = [y] if y is not None else []

        def run(kernel, inputs, out, name, aliases=None, grid=grid):
            return launch.call(self, kernel, inputs, out, grid=grid, aliases=aliases or {},
                               name=name)

        n_stats = len(jc.stats_init(1))
        stats = run(functools.partial(_stats_kernel, has_y=y is not None, kw=kw, **tile),
                    [zs, zt] + ys, parts(n_stats), "logitless_linear_jsd_stats")
        stats = jc.stats_merge(tuple(stats.reshape(n_seg, n_stats, n_rows).transpose(1, 0, 2)),
                               inv_t=tile["inv_t"], **kw)
        row_vals, l_z, z_y, kl = jc.stats_finish(stats, inv_t=tile["inv_t"], **kw)
        # JSD: J's terms go with the gradient where it is written (pass 3 forms the Q and Λ
        # they need anyway), sparing pass 2, the one pass above HBM bandwidth, an exp and
        # more per element (H100: results/…-s24-jax-jsd-j-in-grad-ab.jsonl)
        j_in_grad = write_grad and self.kind == "jsd"
        if self.kind == "jsd":
            sums = run(functools.partial(_sums_kernel, beta=self.beta, with_j=not j_in_grad,
                                         **tile),
                       [zs, zt, jnp.stack(row_vals)], parts(3),
                       "logitless_linear_jsd_sums")
            k, jj, qs = jnp.sum(sums.reshape(n_seg, 3, n_rows), axis=0)
            kk = jc.jsd_k(k, qs)
        else:
            kk = jj = kl
        if not write_grad:
            return jc.row_loss(jj, l_z, z_y, self.hard_w, hard)
        in_place = jnp.dtype(grad_dtype) == zs.dtype  # dz overwrites zs
        grad_grid = (grid[0], ceil_div(width, seg_blocks * block_v))
        dz_shape = jax.ShapeDtypeStruct(zs.shape, grad_dtype)
        out = run(functools.partial(_grad_kernel, has_y=y is not None, beta=self.beta,
                                    hard_w=self.hard_w, with_j=j_in_grad, kw=kw, **tile),
                  [zs, zt] + ys + [jnp.stack(row_vals + (l_z, kk, coef))],
                  (dz_shape, jax.ShapeDtypeStruct((grad_grid[1], n_rows), jnp.float32))
                  if j_in_grad else dz_shape, "logitless_linear_jsd_grad",
                  aliases={0: 0} if in_place else None, grid=grad_grid)
        if j_in_grad:
            dz, j_parts = out
            # the segments past v (padding only) add exact zeros: leaving them out keeps J's
            # sum the same as for an unpadded buffer (32 partials instead of 31 had rounded
            # one fp32 ulp apart)
            jj = jnp.sum(j_parts[:n_seg], axis=0)
        else:
            dz = out
        return jc.row_loss(jj, l_z, z_y, self.hard_w, hard), dz

    def loss(self, zs, zt, y, *, v):
        return self._call(zs, zt, y, None, None, v=v)

    def loss_grad(self, zs, zt, y, coef, grad_dtype, *, v):
        return self._call(zs, zt, y, coef, grad_dtype, v=v)


def linear_jsd(p: jc.Prepared, opts: spec.LinearJSDOptions, *, chunk_size=None,
               logits_chunk_size=None, memory_budget=None, block_rows=None, block_v=None,
               num_warps=None, num_stages=None, segment_size=None, fp32_logits=True,
               interpret=None):
    """The loss reduced per ``opts.reduction`` (flat for "none").

    Tuning: ``chunk_size`` (tokens per dX / dW chunk), ``logits_chunk_size`` (tokens per
    logits GEMM and kernel call), ``memory_budget`` (bytes of the chunk's gradient and logits
    buffers; sets both sizes when not given), ``block_rows`` × ``block_v`` (the kernels' tile,
    powers of two), ``num_warps``, ``num_stages`` (Triton), ``segment_size`` (columns per
    program, a power of two; at least ``block_v`` in effect), ``fp32_logits`` (False: logits
    in the input dtype, less memory and traffic, ~1e-2 less accurate gradients in bf16),
    ``interpret`` (default: True unless JAX's default backend is a GPU).
    """
    settings = launch.resolve(GPU_DEFAULTS, block_rows=block_rows, block_v=block_v,
                              num_warps=num_warps, num_stages=num_stages,
                              fp32_logits=fp32_logits, interpret=interpret)
    segment_size = common.check_tuning(
        "segment_size", launch.pick(GPU_DEFAULTS, segment_size, "segment_size"),
        power_of_2=True, hi=1 << 20)
    head = PallasHead(kind=opts.kind, beta=opts.beta, temperature=opts.temperature,
                      hard_w=opts.hard_loss_weight, segment_size=segment_size, **settings)
    plan, sub = jc.plan_chunks(p, fp32_logits, LOGITS_SHARE,
                               launch.pick(GPU_DEFAULTS, memory_budget, "memory_budget"),
                               chunk_size, logits_chunk_size)
    return jc.chunked_linear_jsd(p, opts, plan, head, sub)
