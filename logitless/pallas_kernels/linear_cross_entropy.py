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
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import _jax_common as common
from ..specs import linear_cross_entropy as spec
from ..specs.tiling import ceil_div, next_power_of_2
from . import _launch as launch

TUNING = ("chunk_size", "memory_budget", "block_rows", "block_v", "num_warps", "num_stages",
          "grid_size", "row_split", "row_sync", "fp32_logits", "interpret")

# Every GPU-specific default in one place. The chunk budget covers the one [chunk, V] logits
# buffer; the float32 dW accumulator (V·H·4 bytes) comes on top of it. ``programs_per_sm``
# sizes the persistent grid (grid_size = SMs × it). Whole rows per program (``row_split=1``),
# tuned on an H100 (benchmarks/jax_linear_cross_entropy.py, bf16): few rows in flight, so that
# sweep 2 re-reads its row from L2; 1 GiB / 16K-column blocks / 16 warps gave 78.5 ms at
# N=16384,H=4096,V=128256 (512 MiB / 4K / 8 warps: 82.7) and 48.0 ms at N=8192,H=2304,V=256000
# (56.5): fewer chunks mean fewer passes over the fp32 dW accumulator, and long blocks stream
# the rows faster.
GPU_DEFAULTS = dict(memory_budget=1 << 30, block_rows=1, block_v=16384, num_warps=16,
                    num_stages=2, programs_per_sm=1)
# By default a GPU splits long rows over programs of about ROW_SEGMENT columns each
# (``default_row_split``): with whole rows (one 16-warp program per SM, so that a row's re-read
# stays in L2) the kernel streams at a latency-bound ~50% of HBM's peak; with many small
# programs a row's segments are read once between them and re-read from L2. Row kernels per
# fwd+bwd on an H100 (benchmarks/jax_ce_split_probe.py, results/…-s25-jax-ce-split.jsonl):
# Llama 5.12-5.18 -> 4.29 ms, Gemma 5.36-5.43 -> 4.35 ms with 2048-column blocks, 2 warps, 16
# programs per SM (4096 columns: Gemma 4.25, Llama 4.81; 8-program SMs within 0.2 ms).
ROW_SEGMENT = 16384


def default_row_split(v: int) -> int:
    """The power of 2 nearest V / ROW_SEGMENT (in log scale), at least 1: 8 at V = 128256 and
    151936, 16 at 256000, 4 at 50257, 1 below ~23K."""
    return 1 << max(0, round(math.log2(max(v, 1) / ROW_SEGMENT)))


SPLIT_DEFAULTS = dict(GPU_DEFAULTS, block_v=2048, num_warps=2, programs_per_sm=16)


# How a call's programs meet the rows (``row_split`` k programs per row block, each on one of
# k column segments, when k > 1):
SINGLE = "single"  # k = 1: each program walks whole rows (a persistent grid), both sweeps
FUSED = "fused"    # k > 1, one launch: the k programs of a row block exchange their sweep-1
#                    partials through memory and wait for each other at a per-row counter
STATS = "stats"    # k > 1, two launches (interpret mode, or row_sync=False): sweep 1 writes
GRAD = "grad"      # the partials, then a second launch merges them and writes dz
_NPART = 4         # sweep-1 partials per segment: max, Σexp, target logit, smoothing sum
# polls of a row counter before a FUSED program gives up on its peers (then its row's loss or
# gradient is NaN, and every later wait of the launch gives up at once): far beyond any real
# wait (~µs), it only bounds a hang where fewer than k programs could be resident (another
# kernel holding all SMs but a few; the head launches in one only where k <= programs, SMs)
MAX_SPIN = 1 << 22
# L2 eviction hints (sweep 1's loads, sweep 2's loads, dz's stores): keep the row in L2 for
# sweep 2's re-read
EVICT = ("evict_last", "evict_first", "evict_first")


def _wait_row(sync_ref, rb, target):
    """FUSED: arrive at row block ``rb``'s counter and wait for ``target`` arrivals; True
    unless timed out (or an earlier wait of the launch did). The barrier orders this
    program's partial stores before its arrival; Pallas' atomics are acquire-release at GPU
    scope, so the polls order the peers' stores before our (L1-bypassing) loads."""
    plgpu.debug_barrier()
    plgpu.atomic_add(sync_ref, 2 + rb, np.int32(1))
    aborted = plgpu.atomic_add(sync_ref, 1, np.int32(0)) != 0
    poll = lambda: plgpu.atomic_add(sync_ref, 2 + rb, np.int32(0))
    count, _ = lax.while_loop(lambda c: (c[0] < target) & (c[1] < MAX_SPIN),
                              lambda c: (poll(), c[1] + 1),
                              (poll(), jnp.where(aborted, np.int32(MAX_SPIN), np.int32(0))))
    ok = count >= target
    plgpu.atomic_xchg(sync_ref, 1, np.int32(1), mask=~ok)
    return ok & (plgpu.atomic_add(sync_ref, 1, np.int32(0)) == 0)


def _merge_parts(parts_ref, rows, rmask, split, segs, fused):
    """The row block's sweep-1 state merged over its ``segs`` segments' partials (``split``
    rows per field: a power of 2, the rows past ``segs`` read as no classes at all)."""
    live = (launch.iota(split) < segs)[:, None] & rmask[None, :]

    def load(f):
        kw = dict(volatile=True) if fused else {}  # past L1, which is not coherent across SMs
        return plgpu.load(parts_ref.at[pl.ds(f * split, split), rows], mask=live,
                          other=-jnp.inf if f == 0 else 0.0, **kw)
    m_p, s_p, c_y, wc = (load(f) for f in range(_NPART))
    m = jnp.max(m_p, axis=0)
    # a segment's sum is relative to its max; where that is -inf (no live class) the sum is 0
    # and so is its factor (a reference of 0 there would make it 0·e^(−m) = NaN at m < −88);
    # the row's reference is 0 while m is −inf, as in sweep 1
    ref = jnp.where(m == -jnp.inf, 0.0, m)
    s = jnp.sum(s_p * jnp.exp(m_p - ref[None, :]), axis=0)
    return m, s, jnp.sum(c_y, axis=0), jnp.sum(wc, axis=0)


def segments(width: int, block_v: int, split: int):
    """(blocks per segment, segments) of rows ``width`` columns wide split ``split`` ways: the
    last segment holds the ragged end; where the blocks do not divide, fewer than ``split``
    segments hold any (e.g. 75 blocks 16 ways: 5 each, 15 segments)."""
    n_blocks = ceil_div(width, block_v)
    seg_blocks = ceil_div(n_blocks, split)
    return seg_blocks, ceil_div(n_blocks, seg_blocks)


def _rows_kernel(z_ref, y_ref, coef_ref, *refs, v, block_rows, block_v, grid_size, softcap,
                 smoothing, has_bias, has_cw, write_grad, split, phase):
    """SINGLE: program p handles row blocks p, p + grid_size, ... of ``block_rows`` rows each,
    and walks each row's vocabulary in ``block_v`` columns: sweep 1 forward, sweep 2 (the
    gradient) backward, so that it starts on the columns sweep 1 read last (still in cache).
    Split (k = ``split`` > 1): the same two sweeps over one of k column segments of a row
    block, the segments' sweep-1 partials merged in between (``phase``: FUSED takes
    (row block, segment) tickets in order from a counter, so that at most one row block is
    ever incomplete and k resident programs suffice; STATS / GRAD one launch each, program
    (row block, segment)). A row's segments then stream it from HBM once between them, and
    sweep 2 re-reads it from L2 with only k·grid_size segments in flight.

    refs: [bias (V,)], [class weights (V,) f32], [sync (2 + row blocks,) int32 zeros: FUSED;
    ticket, abort flag, one counter per row block], [partials (4·k, C) f32: GRAD]; outputs:
    partials (STATS), else loss (C,) f32, lse (C,) f32, [dz (C, vp), aliasing z unless z is
    float32 logits of half-precision inputs], and for FUSED the partials (scratch) and the sync
    buffer. ``z`` and ``dz`` may be wider than ``v`` (the padded vocabulary of
    ``_jax_common.VocabWeight``): columns past ``v`` are loaded (a mask bound such as 50257
    would keep every load scalar; the padded width, a multiple of 8, lets them vectorize) but
    masked out of every reduction, and their gradient is written as 0. Every load is masked
    at the width, so ragged row / vocabulary ends never read out of bounds; masked logits read
    as 0 (finite).
    """
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    cw_ref = refs.pop(0) if has_cw else None
    if phase == FUSED:
        refs.pop(0)  # the sync input, aliased to the last output
        sync_ref, parts_ref = refs[-1], refs[-2]
    elif phase == GRAD:
        parts_ref = refs.pop(0)
    elif phase == STATS:
        parts_ref = refs[0]
    if phase != STATS:
        loss_ref, lse_ref = refs[0], refs[1]
        dz_ref = refs[2] if write_grad else None
    n_rows, width = z_ref.shape
    n_vblocks = ceil_div(v, block_v)
    seg_blocks, segs = segments(width, block_v, split)

    def row_block(r0, seg):
        rmask = (r0 + launch.iota(block_rows)) < n_rows
        rows = pl.ds(r0, block_rows)
        y = plgpu.load(y_ref.at[rows], mask=rmask, other=-1)

        def block(j, evict=None):
            """Capped logits of column block j (fp32), column mask, target indicator, w_v."""
            cols = j * block_v + launch.iota(block_v)
            cmask = cols < v
            span = pl.ds(j * block_v, block_v)
            lmask = cols < width  # the padding too: a bound of 8k vectorizes
            z = plgpu.load(z_ref.at[rows, span], mask=rmask[:, None] & lmask[None, :],
                           other=0.0, eviction_policy=evict).astype(jnp.float32)
            if has_bias:
                z = z + plgpu.load(bias_ref.at[span], mask=cmask,
                                   other=0.0).astype(jnp.float32)[None, :]
            cw = plgpu.load(cw_ref.at[span], mask=cmask, other=0.0) if has_cw else None
            is_target = cols[None, :] == y[:, None]
            return common.capped(z, softcap), cmask, is_target, cw, span

        def sweep1(j, carry):
            m, s, c_y, wc = carry
            c, cmask, is_target, cw, _ = block(j, EVICT[0])
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

        j0 = seg * seg_blocks
        if phase != GRAD:
            zeros = jnp.zeros((block_rows,), jnp.float32)
            init = (jnp.full((block_rows,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
            part = lax.fori_loop(j0, jnp.minimum(j0 + seg_blocks, n_vblocks), sweep1, init)
        if phase in (STATS, FUSED):
            for f, val in enumerate(part):
                plgpu.store(parts_ref.at[pl.ds(f * split + seg, 1), rows], val[None, :],
                            mask=rmask[None, :])
        if phase == STATS:
            return
        if phase == SINGLE:
            m, s, c_y, wc = part
        else:
            ok = _wait_row(sync_ref, r0 // block_rows, segs) if phase == FUSED else None
            m, s, c_y, wc = _merge_parts(parts_ref, rows, rmask, split, segs, phase == FUSED)
            if ok is not None:  # timed out: the row is NaN rather than garbage
                m = jnp.where(ok, m, jnp.nan)
        # coef_ref is the (6, C) coefficient array flattened: row k of it starts at k·C
        coef = [plgpu.load(coef_ref.at[pl.ds(k * n_rows + r0, block_rows)], mask=rmask,
                           other=0.0) for k in range(common.NUM_COEFS)]
        b, sm, smo, zw, g, h = (coef[k] for k in (common.B, common.SM, common.SMO, common.ZW,
                                                   common.G, common.H))
        lse = m + jnp.log(s)
        loss = common.token_loss(lse, c_y, wc if smoothing else None, b, sm, smo, zw)
        first = rmask if split == 1 else rmask & (seg == 0)
        plgpu.store(loss_ref.at[rows], loss, mask=first)
        plgpu.store(lse_ref.at[rows], lse, mask=first)

        if write_grad:
            def sweep2(j):
                c, cmask, is_target, cw, span = block(j, EVICT[1])
                dz = common.grad_logits(c, lse, is_target, cw, b, sm, smo, zw, g, h,
                                        softcap=softcap, smoothing=smoothing)
                return dz, cmask, span

            n_wblocks = ceil_div(width, block_v)
            blocks = None if split == 1 else (j0, jnp.minimum(j0 + seg_blocks, n_wblocks))
            launch.store_grad_backwards(dz_ref, rows, rmask, v, block_v, sweep2, blocks,
                                        evict=EVICT[2])

    if phase == SINGLE:
        launch.walk_row_blocks(lambda r0: row_block(r0, launch.I0), n_rows, block_rows,
                               grid_size)
    elif phase == FUSED:
        total = np.int32(ceil_div(n_rows, block_rows) * segs)
        ticket = lambda: plgpu.atomic_add(sync_ref, 0, np.int32(1))

        def take(t):
            row_block((t // segs) * block_rows, t % segs)
            return ticket()

        lax.while_loop(lambda t: t < total, take, ticket())
    else:
        row_block(pl.program_id(0) * block_rows, pl.program_id(1))


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
    row_split: int = 1        # programs per row block (column segments), a power of 2
    row_sync: bool = True     # row_split > 1 on a GPU: one launch (else two)
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
        aliases = {0: 2} if in_place else {}
        n_row_blocks = ceil_div(n_rows, block_rows)
        split = min(self.row_split, next_power_of_2(ceil_div(z.shape[1], block_v)))
        segs = segments(z.shape[1], block_v, split)[1]
        kernel = functools.partial(
            _rows_kernel, v=v, block_rows=block_rows, block_v=block_v, grid_size=grid_size,
            softcap=self.softcap, smoothing=self.smoothing, has_bias=bias is not None,
            has_cw=has_cw, write_grad=write_grad, split=split)
        name = "logitless_linear_cross_entropy_rows"
        if segs == 1:
            return launch.call(self, functools.partial(kernel, phase=SINGLE, split=1), inputs,
                               tuple(out_shape), grid=(grid_size,), aliases=aliases, name=name)
        parts = jax.ShapeDtypeStruct((_NPART * split, n_rows), jnp.float32)
        tickets = n_row_blocks * segs
        grid = min(self.grid_size or tickets, tickets)
        # one launch only where a row's segments are sure to run at once: no more of them than
        # programs, nor than SMs (every SM holds at least one program); else two launches
        sms = launch.sm_count()
        if self.row_sync and not self.interpret and segs <= grid and (sms is None or segs <= sms):
            sync = jnp.zeros((2 + n_row_blocks,), jnp.int32)
            out = launch.call(self, functools.partial(kernel, phase=FUSED), inputs + [sync],
                              tuple(out_shape) + (parts, sync), grid=(grid,),
                              aliases={**aliases, len(inputs): len(out_shape) + 1}, name=name)
            return out[:len(out_shape)]
        grid = (n_row_blocks, segs)
        p = launch.call(self, functools.partial(kernel, phase=STATS), inputs, parts, grid=grid,
                        aliases={}, name=name + "_stats")
        return launch.call(self, functools.partial(kernel, phase=GRAD), inputs + [p],
                           tuple(out_shape), grid=grid, aliases=aliases, name=name)

    def loss_lse(self, z, y, coefs, bias, cw, *, v):
        return self._call(z, y, coefs, bias, cw, v=v)

    def loss_lse_grad(self, z, y, coefs, bias, cw, grad_dtype, *, v):
        return self._call(z, y, coefs, bias, cw, grad_dtype, v=v)


def linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, *,
                         chunk_size=None, memory_budget=None, block_rows=None, block_v=None,
                         num_warps=None, num_stages=None, grid_size=None, row_split=None,
                         row_sync=True, fp32_logits=False, interpret=None):
    """Returns ``(loss, lse)``: loss reduced per ``opts.reduction`` (flat for "none").

    Tuning: ``chunk_size`` / ``memory_budget`` (bytes of the one [chunk, V] logits buffer),
    ``block_rows`` × ``block_v`` (the kernel's tile, powers of two), ``num_warps``,
    ``num_stages`` (Triton), ``grid_size`` (programs of the persistent grid; default: SMs ×
    ``GPU_DEFAULTS["programs_per_sm"]`` on a GPU, one program per row block when interpreted),
    ``row_split`` (programs per row, each on one of that many column segments, a power of 2;
    at most one per ``block_v`` block; default on a GPU ``default_row_split(V)``, with
    ``SPLIT_DEFAULTS``' launch settings where that is > 1; interpreted: 1),
    ``row_sync`` (with ``row_split`` > 1 on a GPU: True, one launch whose programs wait for
    their row's other segments at a counter in memory, where a row's segments can all run at
    once: no more of them than ``grid_size`` or the SMs; False, interpreted, or else: two
    launches, the segments' partial sums passed between them),
    ``fp32_logits`` (the logits GEMM writes float32 and the kernel writes the bf16/fp16
    gradient to a second buffer: the loss math sees unrounded logits, for 3 bytes more per
    [chunk, V] element of memory and traffic; no effect for float32 inputs),
    ``interpret`` (default: True unless JAX's default backend is a GPU).
    """
    interpret = launch.resolve_interpret(interpret)
    if not isinstance(row_sync, bool):
        raise TypeError(f"row_sync must be a bool, got {row_sync!r}")
    if row_split is None:
        row_split = 1 if interpret else default_row_split(p.problem.v)
    row_split = common.check_tuning("row_split", row_split, power_of_2=True, hi=1024)
    defaults = SPLIT_DEFAULTS if row_split > 1 else GPU_DEFAULTS
    settings = launch.resolve(defaults, block_rows=block_rows, block_v=block_v,
                              num_warps=num_warps, num_stages=num_stages,
                              fp32_logits=fp32_logits, interpret=interpret)
    head = PallasHead(
        softcap=opts.softcap, smoothing=opts.uses_smoothing, **settings,
        grid_size=launch.resolve_grid(defaults, grid_size, interpret),
        row_split=row_split, row_sync=row_sync)
    bytes_per = p.x.dtype.itemsize + (4 if fp32_logits and p.x.dtype.itemsize < 4 else 0)
    plan = common.token_plan(p.problem.n, p.problem.v, bytes_per_element=bytes_per,
                             budget_bytes=launch.pick(GPU_DEFAULTS, memory_budget,
                                                      "memory_budget"),
                             chunk_size=chunk_size)
    return common.chunked_linear_cross_entropy(p, opts, plan, head)
