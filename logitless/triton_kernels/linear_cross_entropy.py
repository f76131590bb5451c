"""``backend="triton"``: fused linear cross-entropy for PyTorch on CUDA.

The three GEMMs of the op (logits, dX, dW) run through cuBLAS on token chunks; everything in
between — log-sum-exp, the loss, the logit gradient — is one Triton kernel
(:mod:`.cross_entropy_rows`) that rewrites each chunk of logits into its gradient in place.
``logits_gemm="triton"`` (opt-in) computes the forward's logits with a Triton GEMM instead,
whose epilogue leaves the softmax statistics (:mod:`.logits_gemm`): the row kernel then
reads each chunk once instead of twice; and recomputing sweeps write dz from such a GEMM's
epilogue, with no logits block and no row pass. ``skip_ignored`` (the default on Hopper)
leaves ignored tokens out of the fast forward's logits GEMM (ours) and row kernel
(:mod:`.live_rows`), and ``dx_gemm="triton"`` out of its dX GEMM (:mod:`.dx_gemm`).
Two operating points, one keyword:

* ``low_memory=False`` (default, *fast*): for ``mean``/``sum`` the forward also produces the
  gradients (for a unit upstream gradient), so the logits GEMM runs once; backward only scales
  them by the upstream scalar (exact: the gradient is linear in it). dW accumulates in place in
  an fp32 ``[V, H]`` buffer of two allocations, which backward narrows *in place* into the
  gradient (:mod:`.narrow_cast`: accumulator and result never coexist); ``grad_accum_dtype``
  trades accuracy for memory. Three GEMMs.
* ``low_memory=True``: the forward produces the loss, lse and dX from small token chunks;
  backward recomputes the logits in *vocabulary* chunks and writes each dW slice with one
  GEMM over all tokens (fp32 inside cuBLAS, one rounding), so no ``[V, H]`` accumulator exists.
  Four GEMMs, and only a ``memory_budget``-sized block of logits at a time.

``reduction="none"`` or a gradient flowing into ``lse`` needs per-token upstream gradients, so
backward recomputes (token sweep for dX, and dW accumulated in fp32 or via the vocabulary
sweep). Nothing here synchronizes with the host: sizes are static, scalars stay on device.
The ops are registered with ``torch.library`` so ``torch.compile`` traces them without breaks.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from .. import _torch_common as common
from ..specs import linear_cross_entropy as spec
from ..specs.tiling import next_power_of_2, plan_token_chunks
from . import INTERPRETED
from . import fast_math
from . import dx_gemm, live_rows
from . import logits_gemm as stats_gemm
from .cross_entropy_rows import FUSED, GRAD, NUM_PARTS, STATS, cross_entropy_rows_kernel
from .narrow_cast import (accumulate_split_, accumulator_pair, finish_, hand_over_once,
                          scale_cast, scale_cast_op, scale_op)

TUNING = ("low_memory", "chunk_size", "vocab_chunk_size", "memory_budget", "grad_accum_dtype",
          "block_v", "num_warps", "logits_gemm", "segment_size", "row_sync", "skip_ignored",
          "dx_gemm", "dx_chunk_size")
# the target range check runs in the forward op (_fwd_op), as in torch_chunked (see there)
CHECKS_TARGETS = True
# backward finishes the forward's saved gradients in place (narrow_cast.hand_over_once): one
# backward per forward, so the front door refuses F.linear_cross_entropy's allow_retain_graph
ONE_BACKWARD = True

# One [chunk, V] block of logits: 3584 tokens at V=128256 in bf16. Peak extra memory is the
# fp32 dW accumulator (4·V·H, narrowed in place into the 2·V·H result) plus this block: 1.97 GB
# at the Llama-3 shape (H=4096), inside the 2 GB goal; 1 GiB (4096 tokens) gave 2.10 GB.
# A V that is not a multiple of 8 adds an fp32 [chunk, H] dX buffer (common.mm_over_vocab).
FAST_BUDGET = 896 << 20
# Each fast-mode chunk's dW GEMM reads and writes the [V, H] fp32 accumulator: 8·V·H bytes
# against 2·C·V·H FLOPs, i.e. C/4 FLOP per byte, near the H100's ridge at C ≈ 1800. So when the
# budget gives chunks shorter than this (a large V: 1792 tokens at Gemma-2's 256000), the
# default plan takes fewer, balanced chunks of about this many tokens, the block growing at most
# to the accumulator's own size. H100 (results/…-s16-gemma-chunks.json): Gemma 51.4-51.8 ms in
# 4 x 1792 + 1024 tokens against 47.2-47.6 in 2 x 4096, at 3.28 GB peak extra instead of 2.1.
FAST_MIN_CHUNK = 3584
# The low-memory mode's one block (its whole peak extra memory, as each dW slice goes straight
# into the gradient): 1024 tokens, or 8192 vocabulary rows for 16k tokens, at V=128256. On an
# H100 256 MiB ran 3% (Llama) / 5% (Gemma) faster than 128 MiB, at 0.27 GB (goal 0.3).
LOW_MEMORY_BUDGET = 1 << 28
REDUCTIONS = common.REDUCTION_CODES
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Row-kernel launch (persistent grid). Measured on an H100 (benchmarks/triton_probe.py stages):
# long rows stream fastest as one 32-warp program per SM with 32K-element blocks (1.04 ms per
# bf16 [4096, 128256] chunk for both passes; 16K blocks 1.11; 4 programs/SM x 8 warps x 4K
# 1.18; a plain copy of the chunk 0.71); short rows need several programs per SM to keep
# enough bytes in flight.
LONG_ROW = 16384
LONG_ROW_BLOCK = 32768
LONG_ROW_PROGRAMS_PER_SM = 1
LONG_ROW_WARPS = 32
PROGRAMS_PER_SM = 4
# Software-pipelining depth of the row loops (tl.range num_stages) on the GPU. Whole fwd+bwd
# calls against 1 stage (benchmarks/row_stages_ab.py, interleaved, two runs): Llama 0.996x and
# 0.997x (95% intervals include 1), Gemma 0.982x and 0.993x (the second's includes 1); 2
# stages, 16K blocks or 2 programs/SM x 16 warps no better. Where its shared-memory buffers
# do not fit (fp32 rows, class weights; smaller GPUs), _rows falls back to 1.
ROW_STAGES = 3
# Rows split over programs (cross_entropy_rows' SEGS) where lse is computed from the logits:
# each program streams one ROW_SEGMENT-column segment of a row (sweep 1, then sweep 2 re-reads
# it from L2), the segments' partial sums meet in memory, in one launch on a GPU. Whole rows
# (one 32-warp program per SM) leave the kernel latency-bound. Row kernel per bf16 chunk on an
# H100 (benchmarks/lce_split_probe.py, results/…-s26-lce-split-*.jsonl): 3584 x 128256 0.88 ->
# 0.77 ms, 4096 x 256000 2.12 -> 1.71, 1024 x 128256 0.275 -> 0.243 with 8192-column segments
# of 2048-column blocks, 2 warps, 16 programs per SM (16384 x 4096 x 4 warps within 2%; 32768
# and 1-warp programs slower; two launches 18-30% slower than whole rows; without the L2
# hints +4-6%). Whole fwd+bwd, interleaved A/B against whole rows (row_stages_ab.py): Llama
# 0.997x, Gemma 0.991x (intervals include 1; the kernel's gain, ~0.5 / 0.9 ms, is within the
# calls' spread). The low-memory setting on Hopper never splits (its lse comes from the own
# GEMM's statistics): its "0.983x" in that run (0.963-0.997) compared identical code.
ROW_SEGMENT = 8192
SPLIT_BLOCK = 2048
SPLIT_WARPS = 2
SPLIT_PROGRAMS_PER_SM = 16
# segments per row at most (the partials, 16 bytes per segment and row, and the merge's vector
# grow with them): tiny segment_size / block_v settings get longer segments
MAX_SEGMENTS = 256
# L2 eviction hints of split rows: sweep 1's loads stay for sweep 2's re-read, whose loads and
# stores need not
SPLIT_EVICT = ("evict_last", "evict_first")
_ROW_STAGES_FITTING = {}  # launch key -> 1 where ROW_STAGES' buffers did not fit (see _rows)

# grad_mode of the forward op
NO_GRAD, FULL_GRAD, DX_ONLY = 0, 1, 2
# logits_gemm of the ops: who computes the logits (see logits_gemm.py): cuBLAS, or GEMMs of
# ours with the forward's softmax statistics / the recomputing sweeps' dz in their epilogues;
# "auto" is resolved inside the ops (_resolve_gemm), where the data pointers are real
LOGITS_GEMM = {"auto": 0, "cublas": 1, "triton": 2}
# skip_ignored of the ops: ignored tokens' rows left out of the logits GEMM and the row
# kernel (live_rows.py); "auto" is resolved inside the ops (_resolve_skip), as LOGITS_GEMM's
SKIP_IGNORED = {"auto": 0, False: 1, True: 2}
# dx_gemm of the front door: with skip_ignored, dX of a chunk's live rows only by our GEMM
# (dx_gemm.py) instead of cuBLAS over every row. H200 (results/…-s31-dx-gemm-*): ours is
# 1.13-1.19x cuBLAS on a whole chunk (no split-K), so it wins only where many tokens are
# ignored: whole fwd+bwd 0.862x with half of them ignored at Llama, 0.979x / 1.026x with 10%
# at Gemma / Llama; opt-in
DX_GEMMS = ("cublas", "triton")


@dataclasses.dataclass(frozen=True)
class Config:
    chunk: int          # tokens per chunk (token sweeps)
    vocab_chunk: int    # vocabulary rows per chunk (the low-memory dW sweep)
    block_v: int        # 0 = pick from the row length
    num_warps: int      # 0 = pick from the block
    logits_gemm: int = LOGITS_GEMM["cublas"]  # who computes the logits (LOGITS_GEMM)
    segment: int = 0    # row-kernel columns per program (0: ROW_SEGMENT on a GPU)
    row_sync: bool = True  # split rows: one launch whose segments wait for each other
    skip_ignored: bool = False  # ignored tokens' rows skipped (resolved: see _resolve_skip)
    dx_gemm: bool = False  # with skip_ignored, dX of the live rows by dx_gemm.py
    dx_rows: int = 0    # rows per cuBLAS dX GEMM call (0: whole chunks; common.dx_piece_rows)


_INTERPRET = INTERPRETED


def _interpret() -> bool:
    return _INTERPRET


# ----------------------------------------------------------------------------- launching
def _layout(cfg, n_cols, compute_lse, stats, gpu):
    """(block, segment columns, segments, num_warps, programs per SM) of a row-kernel launch.
    Rows are split where ``cfg``'s segment (0: ``ROW_SEGMENT`` on a GPU, whole rows
    interpreted) rounded up to whole blocks is shorter than the row and the kernel computes
    lse from the logits (the split is for that sweep's re-read; never from the own GEMM's
    tile statistics, nor for a gradient pass), in at most ``MAX_SEGMENTS`` segments. A given
    ``block_v`` sets the split's warps too (one per 1024 columns, at least ``SPLIT_WARPS``),
    and a split that rounds to one segment takes the whole-row settings."""
    seg = cfg.segment or (ROW_SEGMENT if gpu else 0)
    if seg and seg < n_cols and compute_lse and stats is None:
        block = cfg.block_v or (SPLIT_BLOCK if gpu else min(1024, next_power_of_2(n_cols)))
        fewest = -(-n_cols // MAX_SEGMENTS)
        seg = -(-max(seg, fewest, block) // block) * block  # whole blocks
        segs = triton.cdiv(n_cols, seg)
        if segs > 1:
            warps = cfg.num_warps or max(SPLIT_WARPS, min(32, block // 1024))
            return block, seg, segs, warps, SPLIT_PROGRAMS_PER_SM
    long_row = n_cols >= LONG_ROW
    if gpu:
        block = cfg.block_v or min(LONG_ROW_BLOCK if long_row else 4096, next_power_of_2(n_cols))
    else:  # interpreter: programs run one after another; small blocks only cost Python time
        block = cfg.block_v or min(1024, next_power_of_2(n_cols))
    warps = cfg.num_warps or (LONG_ROW_WARPS if long_row else max(1, min(8, block // 256)))
    return block, n_cols, 1, warps, LONG_ROW_PROGRAMS_PER_SM if long_row else PROGRAMS_PER_SM


def _rows(buf, bias, n_rows, n_cols, col_offset, y, cw, omega_sum, lse, loss, g, h, opts_t, v,
          cfg, compute_lse, write_grad, stats=None, live=None):
    """Run the row kernel over ``buf[:n_rows, :n_cols]`` (see cross_entropy_rows), which holds
    x·Wᵀ without the bias (the whole ``[V]`` bias, or None: the kernel adds it); ``stats``:
    the logits GEMM's per-tile (max, Σexp), ``[n_rows, n_tiles]`` each, for lse; ``live``:
    an int32 (1,) device tensor, the rows below it live, the rest ignored tokens that were
    never computed (``HAS_LIVE``)."""
    ignore_index, eps, z_loss, softcap = opts_t
    if n_rows == 0:
        return
    dev = buf.device
    gpu = buf.is_cuda and not _interpret()
    block, seg_cols, segs, num_warps, per_sm = _layout(cfg, n_cols, compute_lse, stats, gpu)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if gpu else None
    # persistent on a GPU; interpreted, one program per (row, segment), run one after another
    grid = min(n_rows * segs, max(1, int(sms * per_sm))) if gpu else n_rows * segs
    # one launch only where a row's segments are sure to run at once (no more of them than
    # programs, nor than SMs: every SM holds at least one program); else two
    fused = segs > 1 and cfg.row_sync and sms is not None and segs <= min(grid, sms)
    dummy = lse  # any fp32 tensor stands in for absent optional pointers
    part = (torch.empty(n_rows, segs, NUM_PARTS, dtype=torch.float32, device=dev)
            if segs > 1 else dummy)
    # int32 even when unused: Triton type-checks the (dead) waiting code's atomics
    sync = (torch.zeros(2 + n_rows, dtype=torch.int32, device=dev) if fused
            else torch.empty(1, dtype=torch.int32, device=dev))
    flags = dict(COMPUTE_LSE=compute_lse, WRITE_GRAD=write_grad, FROM_TILES=stats is not None,
                 HAS_CW=cw is not None, SMOOTH=eps > 0, HAS_Z=z_loss > 0,
                 HAS_SOFTCAP=softcap is not None, HAS_H=h is not None, HAS_BIAS=bias is not None,
                 BLOCK_V=block, ROUND_BF16=_interpret() and buf.dtype == torch.bfloat16,
                 SEGS=segs, SEGS_P2=max(2, next_power_of_2(segs)),
                 EXP_FORM=fast_math.form_for(buf.dtype == torch.float32),
                 HAS_LIVE=live is not None,
                 **(dict(zip(("EVICT1", "EVICT2"), SPLIT_EVICT)) if segs > 1 else {}))
    launch = functools.partial(
        cross_entropy_rows_kernel[(grid,)],
        buf, buf.stride(0), dummy if bias is None else bias,
        y, dummy if cw is None else cw, dummy if omega_sum is None else omega_sum,
        lse, dummy if loss is None else loss,
        dummy if g is None else g, 0 if g is None or g.numel() == 1 else 1,
        dummy if h is None else h,
        n_rows, n_cols, common.load_cols(n_cols, buf), col_offset, v, ignore_index,
        eps, z_loss, 1.0 if softcap is None else softcap,
        dummy if stats is None else stats[0], dummy if stats is None else stats[1],
        0 if stats is None else stats[0].shape[1], part, sync, seg_cols,
        sync if live is None else live, num_warps=num_warps, **flags)
    key = (buf.device, buf.dtype, None if bias is None else bias.dtype,
           None if cw is None else cw.dtype, num_warps, tuple(flags.values()))
    if segs == 1 or fused:
        _launch_rows(launch, key, PHASE=FUSED)
    else:
        _launch_rows(launch, key + (STATS,), PHASE=STATS, WRITE_GRAD=False)
        _launch_rows(launch, key + (GRAD,), PHASE=GRAD)


def _launch_rows(launch, key, **meta):
    stages = 1 if _interpret() else _ROW_STAGES_FITTING.get(key, ROW_STAGES)
    if stages > 1:
        try:
            launch(STAGES=stages, **meta)
            return
        except OutOfResources:
            # the pipeline's shared-memory buffers ((stages - 1) x the block's loads: 256 KiB
            # for fp32 rows of 32K columns, more with class weights) exceed this GPU's; Triton
            # refuses before launching anything
            _ROW_STAGES_FITTING[key] = 1
    launch(STAGES=1, **meta)


def _logits(x_c, w, out):
    """out = x_c @ wᵀ through cuBLAS, in the input dtype (fp32 accumulation), in the vocabulary
    parts of ``common.vocab_parts`` (an odd V would put the whole GEMM on slow kernels). The
    bias is the row kernel's (``_logit`` in cross_entropy_rows): cuBLAS rounds twice adding it
    into a strided output such as these column views."""
    return common.vocab_mm_(x_c, w.t(), out, axis=1)


def _logit_grads(x, w, col_offset, out, bias, y, cw, omega_sum, lse, g, h, opts_t, v, cfg):
    """``out`` = dz of classes ``[col_offset, col_offset + out.shape[1])`` for all rows of
    ``x`` with ``lse`` known (a recomputing backward): through cuBLAS then the row kernel's
    gradient pass, or, with ``logits_gemm="triton"``, one GEMM of ours whose epilogue writes dz
    (:func:`.logits_gemm.logit_grads`: no logits stored, no pass over them)."""
    if cfg.logits_gemm == LOGITS_GEMM["triton"]:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 3
        stats_gemm.logit_grads(x, w, col_offset, out, bias, y, cw, omega_sum, lse, g, h, opts_t,
                               _interpret(), sms)
        return out
    _logits(x, w[col_offset:col_offset + out.shape[1]], out)
    _rows(out, bias, x.shape[0], out.shape[1], col_offset, y, cw, omega_sum, lse, None, g, h,
          opts_t, v, cfg, compute_lse=False, write_grad=True)
    return out


def _ones(like):
    return torch.ones(1, dtype=torch.float32, device=like.device)


# ----------------------------------------------------------------------------- sweeps
def _forward(x, w, bias, y, cw, opts_t, cfg, grad_mode, needs, accum_dtype, scalars):
    """Token sweep: per-token loss and lse; with ``grad_mode`` also those of dX (and dW, db)
    that ``needs`` (need_dx, need_dw, need_db) asks for, for the uniform upstream gradient
    ``g``. ``scalars()`` -> (Σ class weights or None, g as a (1,) device tensor), called once,
    after the first chunk's logits GEMM is queued. A frozen head costs neither its GEMM nor
    its accumulator."""
    n, hdim = x.shape
    v = w.shape[0]
    dev = x.device
    full = grad_mode == FULL_GRAD
    need_dx, need_dw, need_db = (bool(grad_mode) and needs[0], full and needs[1],
                                 full and needs[2] and bias is not None)
    token_loss = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    dx = torch.empty(n, hdim, dtype=x.dtype, device=dev) if need_dx else x.new_empty(0)
    dw = (accumulator_pair(v, hdim, accum_dtype, w.dtype, x, zero=n == 0) if need_dw
          else (x.new_empty(0), x.new_empty(0)))  # distinct: op outputs may not alias
    db = (torch.zeros if n == 0 else torch.empty)(v, dtype=torch.float32, device=dev) \
        if need_db else x.new_empty(0)
    rows = min(cfg.chunk, n)
    stats_on = cfg.logits_gemm == LOGITS_GEMM["triton"] and n > 0
    skip = cfg.skip_ignored and n > 0
    buf = common.rows_buffer(rows, v, x.dtype, dev)  # 16-byte aligned rows (also for TMA)
    if stats_on:  # per-tile softmax statistics from our GEMM's epilogue
        n_tiles = stats_gemm.stat_tiles(v, _interpret())
        stat_pair = (torch.empty(rows, n_tiles, dtype=torch.float32, device=dev),
                     torch.empty(rows, n_tiles, dtype=torch.float32, device=dev))
    # persistent grid of our GEMM: one program per SM (interpreter: a few, run in turn)
    sms = (torch.cuda.get_device_properties(dev).multi_processor_count if x.is_cuda else 3)
    if skip:
        # each chunk's live tokens first (perm), their count per chunk on device (live): our
        # GEMM and the row kernel leave the ignored rows out, without a host sync. The chunk's
        # rows of x are gathered into dX's own rows of the chunk (perm keeps each chunk's
        # tokens inside it), which after dW take the chunk's dX in that order, put back in the
        # tokens' order through the logits block (free by then) as scratch; with no dX, x is
        # gathered into a buffer of one chunk. No [N, H] temporary: peak memory as without
        perm, live = live_rows.live_first(y, opts_t[0], cfg.chunk)
        xbuf = dx if need_dx else torch.empty(rows, hdim, dtype=x.dtype, device=dev)
        if need_dx:
            in_chunk = perm - torch.arange(n, device=dev) // cfg.chunk * cfg.chunk
            # [rows, H] over the block's storage where it is large enough (V padded >= H)
            scratch = (torch.as_strided(buf, (rows, hdim), (hdim, 1))
                       if buf.untyped_storage().nbytes() >= rows * hdim * buf.element_size()
                       else torch.empty(rows, hdim, dtype=x.dtype, device=dev))
        y_run = y.index_select(0, perm)
        lse_run, loss_run = torch.empty_like(lse), torch.empty_like(token_loss)
    else:
        y_run, lse_run, loss_run = y, lse, token_loss
    for i, s in enumerate(range(0, n, cfg.chunk)):
        e = min(s + cfg.chunk, n)
        blk = buf[: e - s]
        stats = (stat_pair[0][: e - s], stat_pair[1][: e - s]) if stats_on else None
        x_c, lv = x[s:e], None
        if skip:
            x_c = torch.index_select(x, 0, perm[s:e], out=xbuf[s:e] if need_dx else
                                     xbuf[: e - s])
            lv = live[i:i + 1]
        if stats_on or skip:
            stats_gemm.logits_with_stats(x_c, w, bias, blk, *(stats or (None, None)),
                                          opts_t[3], _interpret(), sms, live=lv)
        else:
            _logits(x_c, w, blk)
        if s == 0:
            omega_sum, g = scalars()
        _rows(blk, bias, e - s, v, 0, y_run[s:e], cw, omega_sum, lse_run[s:e],
              loss_run[s:e], g, None, opts_t, v, cfg, compute_lse=True,
              write_grad=need_dx or need_dw or need_db, stats=stats, live=lv)
        if need_dx and not skip:
            common.mm_over_vocab(blk, w, dx[s:e], cfg.dx_rows)
        _accumulate(dw, db, blk, x_c, first=s == 0)
        if need_dx and skip:  # x_c (dx[s:e]) is free now: the chunk's dX in perm's order
            if cfg.dx_gemm:
                dx_gemm.dx_live(blk, w, x_c, lv, _interpret(), sms)
            else:
                common.mm_over_vocab(blk, w, x_c, cfg.dx_rows)
            sc = scratch[: e - s].copy_(x_c)  # the block is not read again before the next
            x_c.index_copy_(0, in_chunk[s:e], sc)  # chunk's logits GEMM overwrites it
    if n == 0:
        scalars()
    if skip:  # back to the tokens' order
        token_loss.index_copy_(0, perm, loss_run)
        lse.index_copy_(0, perm, lse_run)
    return token_loss, lse, dx, dw, db


def _token_sweep(x, w, bias, y, cw, omega_sum, lse, g, h, opts_t, cfg, need_dx, dw_acc, db_acc):
    """Recompute per token chunk with per-token upstream g (and h on lse): dX, and dW/db
    accumulated into the given fp32 buffers when they are not None."""
    n, hdim = x.shape
    v = w.shape[0]
    dx = torch.empty(n, hdim, dtype=x.dtype, device=x.device) if need_dx else x.new_empty(0)
    buf = common.rows_buffer(min(cfg.chunk, n), v, x.dtype, x.device)
    for s in range(0, n, cfg.chunk):
        e = min(s + cfg.chunk, n)
        blk = _logit_grads(x[s:e], w, 0, buf[: e - s], bias, y[s:e], cw, omega_sum, lse[s:e],
                           g if g.numel() == 1 else g[s:e], None if h is None else h[s:e],
                           opts_t, v, cfg)
        if need_dx:
            common.mm_over_vocab(blk, w, dx[s:e], cfg.dx_rows)
        _accumulate(dw_acc, db_acc, blk, x[s:e], first=s == 0)
    return dx


def _accumulate(dw, db, dz, x_c, first):
    """dW (+)= dzᵀ·x_c in place (fp32 inside cuBLAS) into the accumulator pair ``dw`` (see
    :func:`.narrow_cast.accumulator_pair`), db (+)= Σ dz; the first chunk assigns."""
    if dw is not None and dw[0].numel():
        accumulate_split_(dw, dz, x_c, first=first)
    if db is not None and db.numel():
        if first:
            torch.sum(dz, 0, dtype=torch.float32, out=db)
        else:
            db += dz.sum(0, dtype=torch.float32)


def _vocab_sweep(x, w, bias, y, cw, omega_sum, lse, g, h, opts_t, cfg, post_scale, dw_out, db_out):
    """Recompute per vocabulary chunk (all tokens): each dW / db slice in one GEMM over all
    tokens (two where the chunk's width is not a multiple of 8: its aligned bulk, then the
    rest), fp32 inside, times ``post_scale``, written once into the final gradient."""
    n = x.shape[0]
    v = w.shape[0]
    buf = common.rows_buffer(n, min(cfg.vocab_chunk, v), x.dtype, x.device)
    for s in range(0, v, cfg.vocab_chunk):
        e = min(s + cfg.vocab_chunk, v)
        blk = _logit_grads(x, w, s, buf[:, : e - s], bias, y, cw, omega_sum, lse, g, h, opts_t,
                           v, cfg)
        if dw_out is not None:
            if post_scale is None and dw_out.dtype != torch.float16:
                # straight into the gradient: fp32 inside cuBLAS, as F.linear's backward (which
                # also lets cuBLAS sum split-K parts in bf16 unless
                # torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is off);
                # fp16, whose range a sum over all tokens can leave, takes the fp32 slice below
                common.vocab_mm_(blk.t(), x, dw_out[s:e], axis=0)
            else:
                for a, b in common.vocab_parts(e - s):
                    _cast(common.mm_f32(blk[:, a:b].t(), x), post_scale, dw_out.dtype,
                          out=dw_out[s + a:s + b])
        if db_out is not None:
            _cast(blk.sum(0, dtype=torch.float32), post_scale, db_out.dtype, out=db_out[s:e])


# ----------------------------------------------------------------------------- torch.library ops
def _opts_tuple(ignore_index, label_smoothing, z_loss, softcap):
    return (ignore_index, label_smoothing, z_loss, None if softcap <= 0 else softcap)


def _omega_sum(cw):
    return None if cw is None else cw.sum().reshape(1)


@torch.library.custom_op("logitless::linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
            cw: Optional[torch.Tensor], reduction: int, ignore_index: int, label_smoothing: float,
            z_loss: float, softcap: float, grad_mode: int, need_dx: bool, need_dw: bool,
            need_db: bool, low_memory: bool, chunk: int, vocab_chunk: int, block_v: int,
            num_warps: int, accum_fp32: bool, gemm: int, segment: int,
            row_sync: bool, skip: int, own_dx: bool, dx_rows: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor, torch.Tensor]:
    """-> (loss, lse, Σω or 1, dX, dW part a, dW part b, db): the gradients (for an upstream
    1, with 1/Σω folded in unless fp16) only with ``grad_mode`` and only those needed; dW as
    the accumulator pair of :func:`.narrow_cast.accumulator_pair` (part b empty unless split).
    ``low_memory`` is for backward (the fast forward never sees it); ``gemm``: a
    ``LOGITS_GEMM`` code; ``skip``: a ``SKIP_IGNORED`` code (the front door passes "auto" or
    True only where the lse of ignored tokens is never used: see ``_skip_conflict``);
    ``own_dx``: dX by ``dx_gemm`` (the front door passes it with ``skip`` True only)."""
    with common.on_device(x):
        cfg = Config(chunk, vocab_chunk, block_v, num_warps,
                     _resolve_gemm(gemm, x, w, bias, low_memory), segment, row_sync,
                     _resolve_skip(skip, x, w, own_dx), own_dx, dx_rows)
        opts_t = _opts_tuple(ignore_index, label_smoothing, z_loss, softcap)
        found = {}

        def scalars():
            """(Σ class weights, upstream g) and the target check, once the first logits GEMM
            is queued: the GPU runs it while the host launches these ~15 small kernels. This
            matters where a call starts on an idle GPU (after a synchronization; a host that
            runs ahead hides it): H100, Llama shape, the first GEMM started 1.44 ms into such
            a call, now 0.76-0.81 (the front door's and torch.library's Python before it)."""
            common.check_targets(y, w.shape[0], ignore_index)
            denom = torch.ones((), dtype=torch.float32, device=x.device)
            if reduction == REDUCTIONS["mean"]:
                denom = common.mean_denominator(
                    common.token_weight_total(y, cw, ignore_index, torch.float32))
            found["denom"] = denom
            g = (1.0 / denom).reshape(1) if common.folds_mean(reduction, x.dtype) else _ones(x)
            return _omega_sum(cw), g

        accum = _accum_dtype(x.dtype, x.shape[0], chunk, accum_fp32)
        token_loss, lse, dx, dw, db = _forward(x, w, bias, y, cw, opts_t, cfg, grad_mode,
                                               (need_dx, need_dw, need_db), accum, scalars)
        denom = found["denom"]
        if reduction == REDUCTIONS["none"]:
            loss = token_loss
        else:
            loss = token_loss.sum() / denom
        return loss, lse, denom, dx, dw[0], dw[1], db


def _resolve_gemm(code, x, w, bias, low_memory):
    """The ``LOGITS_GEMM`` code the sweeps run: "triton" once the tensors' layouts are
    checked (inside the ops, where their data pointers are real, not under tracing; the options
    were checked up front), "auto" as "triton" for the low-memory setting on a Hopper GPU
    (compute capability 9.x) where that GEMM can run (there it measured 1.6% faster than
    cuBLAS, the fast setting 0.5% slower: results/…-s18-logits-gemm-ab.jsonl), else
    "cublas". The forward and backward ops resolve the same inputs alike. No tokens: no GEMM
    runs, nothing to check."""
    triton_code, cublas = LOGITS_GEMM["triton"], LOGITS_GEMM["cublas"]
    if code == LOGITS_GEMM["auto"]:  # measured on Hopper only: not picked elsewhere
        own = (low_memory and x.is_cuda and x.shape[0] > 0
               and torch.cuda.get_device_capability(x.device)[0] == 9
               and not stats_gemm.unsupported_layout(x, w, bias))
        return triton_code if own else cublas
    why = code == triton_code and x.shape[0] > 0 and stats_gemm.unsupported_layout(x, w, bias)
    if why:
        raise ValueError(f"logits_gemm='triton' cannot run here: {why}")
    return code


def _skip_asked_by(own_dx: bool) -> str:
    """The keyword that asked for skip_ignored, as errors name it."""
    return "dx_gemm='triton' (which skips ignored tokens)" if own_dx else "skip_ignored=True"


def _resolve_skip(code, x, w, own_dx=False):
    """Whether the forward skips ignored tokens (``SKIP_IGNORED`` code): True once ``w``'s
    layout suits our GEMM's tensor descriptors (checked inside the op, where data pointers are
    real; the tokens' rows are gathered into a buffer of ours, so ``x``'s layout does not
    matter); "auto" as True on a Hopper GPU (compute capability 9.x, where it was measured)
    where it can run. The front door already turned "auto" off where options rule it out."""
    if code == SKIP_IGNORED[False] or x.shape[0] == 0:
        return False
    why = stats_gemm.unsupported_layout(None, w, None)
    if code == SKIP_IGNORED["auto"]:
        return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 and not why
                and x.shape[1] % 8 == 0)
    who = _skip_asked_by(own_dx)
    if why:
        raise ValueError(f"{who} cannot run here: {why}")
    if x.shape[1] % 8:
        raise ValueError(f"{who} cannot run here: the hidden size must be a multiple of 8 "
                         f"for the tensor descriptors (got {x.shape[1]})")
    return True


def _amortized_chunk(n, v, h, itemsize, chunk, accum_fp32):
    """The fast mode's default tokens per chunk: the budget's ``chunk``, or, where that is
    under ``FAST_MIN_CHUNK`` and there is more than one chunk to take, about
    ``FAST_MIN_CHUNK`` tokens in chunks of equal size (one chunk where ``n`` is closer to it
    than to two), so that the fp32 dW accumulator's pass per chunk is amortized; never a
    block larger than that accumulator (4·V·H bytes: then more, still equal, chunks) nor than
    the budget's where there is none (bf16 accumulation; the caller also skips this where no
    dW is computed)."""
    if not accum_fp32 or chunk >= FAST_MIN_CHUNK or n <= chunk:
        return chunk
    cap = max(chunk, (4 * v * h) // (v * itemsize))  # tokens whose block is the accumulator's size
    chunks = max(1, round(n / FAST_MIN_CHUNK), -(-n // cap))  # equal chunks under the cap too
    return max(chunk, -(-n // chunks))


def _accum_dtype(dtype, n, chunk, accum_fp32):
    """The fused forward's dW accumulator: fp32 across chunks; a single chunk needs none (one
    GEMM, one rounding). fp16 always takes fp32, whatever ``grad_accum_dtype`` asks: these
    sums are for an upstream gradient of 1 (not yet divided by Σω for "mean", see
    ``common.folds_mean``; nor by the caller's divisor after "sum", e.g. ``num_items``), and
    in fp16's range they can overflow where the real gradient does not."""
    if dtype == torch.float16:
        return torch.float32
    return dtype if (n <= chunk or not accum_fp32) else torch.float32


@_fwd_op.register_fake
def _(x, w, bias, y, cw, reduction, ignore_index, label_smoothing, z_loss, softcap, grad_mode,
      need_dx, need_dw, need_db, low_memory, chunk, vocab_chunk, block_v, num_warps, accum_fp32,
      gemm, segment, row_sync, skip, own_dx, dx_rows):
    n, hdim = x.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    full = grad_mode == FULL_GRAD
    accum = _accum_dtype(x.dtype, n, chunk, accum_fp32)
    loss = x.new_empty(n, **f32) if reduction == 0 else x.new_empty((), **f32)
    dw = (accumulator_pair(v, hdim, accum, w.dtype, x) if (full and need_dw)
          else (x.new_empty(0), x.new_empty(0)))
    return (loss, x.new_empty(n, **f32), x.new_empty((), **f32),
            x.new_empty(n, hdim) if (grad_mode and need_dx) else x.new_empty(0)) + dw + (
            x.new_empty(v, **f32) if (full and need_db and bias is not None) else x.new_empty(0),)


@torch.library.custom_op("logitless::linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
            cw: Optional[torch.Tensor], lse: torch.Tensor, g: torch.Tensor,
            h: Optional[torch.Tensor], post_scale: Optional[torch.Tensor], ignore_index: int,
            label_smoothing: float, z_loss: float, softcap: float, need_dx: bool, need_dw: bool,
            need_db: bool, low_memory: bool, chunk: int, vocab_chunk: int, block_v: int,
            num_warps: int, accum_fp32: bool, gemm: int, segment: int,
            row_sync: bool, dx_rows: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recomputing backward. ``g``: per-token upstream gradient (N,) or a uniform one (1,);
    ``h``: upstream gradient of lse; ``post_scale`` multiplies the vocabulary-sweep results;
    ``gemm``: the forward's ``LOGITS_GEMM`` code, resolved as there."""
    with common.on_device(x):
        cfg = Config(chunk, vocab_chunk, block_v, num_warps,
                     _resolve_gemm(gemm, x, w, bias, low_memory), segment, row_sync,
                     dx_rows=dx_rows)
        opts_t = _opts_tuple(ignore_index, label_smoothing, z_loss, softcap)
        v, hdim = w.shape
        omega_sum = _omega_sum(cw)
        need_db = need_db and bias is not None
        if low_memory:
            dx = (_token_sweep(x, w, bias, y, cw, omega_sum, lse, g, h, opts_t, cfg, True, None,
                               None) if need_dx else x.new_empty(0))
            dw = torch.empty(v, hdim, dtype=w.dtype, device=w.device) if need_dw else None
            db = torch.empty(v, dtype=bias.dtype, device=w.device) if need_db else None
            if need_dw or need_db:
                _vocab_sweep(x, w, bias, y, cw, omega_sum, lse, g, h, opts_t, cfg, post_scale, dw,
                             db)
            return dx, x.new_empty(0) if dw is None else dw, x.new_empty(0) if db is None else db
        accum = torch.float32 if accum_fp32 else w.dtype
        dw_acc = (accumulator_pair(v, hdim, accum, w.dtype, x, zero=x.shape[0] == 0) if need_dw
                  else None)
        db_acc = ((torch.zeros if x.shape[0] == 0 else torch.empty)(v, dtype=torch.float32,
                                                                    device=w.device)
                  if need_db else None)
        dx = _token_sweep(x, w, bias, y, cw, omega_sum, lse, g, h, opts_t, cfg, need_dx, dw_acc,
                          db_acc)
        dw = (x.new_empty(0) if dw_acc is None
              else finish_(dw_acc[0], dw_acc[1], None, (v, hdim), w.dtype, _interpret()))
        db = x.new_empty(0) if db_acc is None else _cast(db_acc, None, bias.dtype)
        return dx, dw, db


@_bwd_op.register_fake
def _(x, w, bias, y, cw, lse, g, h, post_scale, ignore_index, label_smoothing, z_loss, softcap,
      need_dx, need_dw, need_db, low_memory, chunk, vocab_chunk, block_v, num_warps, accum_fp32,
      gemm, segment, row_sync, dx_rows):
    need_db = need_db and bias is not None
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
            w.new_empty(w.shape) if need_dw else x.new_empty(0),
            w.new_empty(w.shape[0]) if need_db else x.new_empty(0))


def _cast(acc, scale, dtype, out=None):
    """(acc · scale) in ``dtype``, computed in fp32, with no acc-sized temporary; ``out`` may
    be ``acc`` itself (in place)."""
    if scale is None and acc.dtype == dtype and out is None:
        return acc
    return scale_cast(acc, scale, dtype, _interpret(), out=out)


def _setup_context(ctx, inputs, output):
    (x, w, bias, y, cw, reduction, ignore_index, label_smoothing, z_loss, softcap, grad_mode,
     _need_dx, _need_dw, _need_db, low_memory, chunk, vocab_chunk, block_v, num_warps,
     accum_fp32, gemm, segment, row_sync, _skip, _own_dx, dx_rows) = inputs
    loss, lse, denom, dx, dw_a, dw_b, db = output
    ctx.save_for_backward(x, w, bias, y, cw, lse, denom, dx, dw_a, dw_b, db)
    ctx.args = dict(reduction=reduction, ignore_index=ignore_index,
                    label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                    grad_mode=grad_mode, low_memory=low_memory, chunk=chunk,
                    vocab_chunk=vocab_chunk, block_v=block_v, num_warps=num_warps,
                    accum_fp32=accum_fp32, gemm=gemm, segment=segment, row_sync=row_sync,
                    dx_rows=dx_rows)
    ctx.set_materialize_grads(False)


def _backward(ctx, g_loss, g_lse, _g_denom, _g_dx, _g_dwa, _g_dwb, _g_db):
    """Gradients of (loss, lse). Returned detached: some are the forward's saved outputs, which
    would otherwise reach ``torch.autograd.grad`` callers as tensors that require grad."""
    if torch.is_grad_enabled():
        raise RuntimeError(common.NO_DOUBLE_BACKWARD.format(op="linear_cross_entropy"))
    grads = _gradients(ctx, g_loss, g_lse)
    return tuple(None if t is None else t.detach() for t in grads) + (None,) * 23


def _gradients(ctx, g_loss, g_lse):
    """(dX, dW, db), None where not needed."""
    a = ctx.args
    if g_loss is None and g_lse is None:
        return (None,) * 3
    uniform = a["reduction"] != REDUCTIONS["none"]
    saved_grads = uniform and g_lse is None and a["grad_mode"] != NO_GRAD
    if saved_grads:  # before the saved tensors are unpacked (autograd's version check)
        hand_over_once(ctx, "linear_cross_entropy")
    x, w, bias, y, cw, lse, denom, dx_saved, dw_a, dw_b, db_saved = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    low_memory = a["low_memory"]
    scale = None
    if uniform and g_loss is not None:
        scale = (g_loss.float() / denom).reshape(1)  # mean: g/Σω; sum: denom is 1
    if saved_grads:
        # The forward already holds the gradients for the upstream 1 (or 1/Σω): scale them
        # (exact in fp32; a no-op rounding for the usual upstream 1.0).
        saved_scale = (g_loss.float().reshape(1) if common.folds_mean(a["reduction"], x.dtype)
                       else scale)
        gx = None
        if need_x:  # dx_saved is ours alone (the front door drops it): scale it in place
            scale_op(dx_saved, saved_scale, _interpret())
            gx = dx_saved
        if a["grad_mode"] == FULL_GRAD:
            gw = (finish_(dw_a, dw_b, saved_scale, tuple(w.shape), w.dtype, _interpret())
                  if need_w else None)
            gb = (scale_cast_op(db_saved, saved_scale, bias.dtype, _interpret())
                  if (need_b and bias is not None) else None)
            return gx, gw, gb
        # low memory: dW and db from the vocabulary sweep for the upstream g/Σω. In bf16/fp32
        # it goes into dz (each dW slice is then one GEMM straight into the gradient's dtype);
        # fp16 computes unscaled and scales after (g/Σω·p can leave fp16's range).
        fold = x.dtype != torch.float16
        _, gw, gb = _bwd_op(x, w, bias, y, cw, lse, scale if fold else _ones(x), None,
                            None if fold else scale, a["ignore_index"],
                            a["label_smoothing"], a["z_loss"], a["softcap"], False, need_w,
                            need_b, True, a["chunk"], a["vocab_chunk"], a["block_v"],
                            a["num_warps"], a["accum_fp32"], a["gemm"], a["segment"],
                            a["row_sync"], a["dx_rows"])
        return gx, gw if need_w else None, gb if (need_b and bias is not None) else None
    # Per-token upstream (reduction="none") or a gradient on lse: recompute.
    if g_loss is None:
        g = torch.zeros(1, dtype=torch.float32, device=x.device)
    else:
        g = scale if uniform else g_loss.float().contiguous()
    h = None if g_lse is None else g_lse.float().contiguous()
    gx, gw, gb = _bwd_op(x, w, bias, y, cw, lse, g, h, None, a["ignore_index"],
                         a["label_smoothing"], a["z_loss"], a["softcap"], need_x, need_w,
                         need_b, low_memory, a["chunk"], a["vocab_chunk"], a["block_v"],
                         a["num_warps"], a["accum_fp32"], a["gemm"], a["segment"],
                         a["row_sync"], a["dx_rows"])
    return (gx if need_x else None, gw if need_w else None,
            gb if (need_b and bias is not None) else None)


torch.library.register_autograd("logitless::linear_cross_entropy_fwd", _backward,
                                setup_context=_setup_context)


# ----------------------------------------------------------------------------- entry point
def linear_cross_entropy(p: common.Prepared, opts: spec.LinearCrossEntropyOptions, *,
                         low_memory=False, chunk_size=None, vocab_chunk_size=None,
                         memory_budget=None, grad_accum_dtype=torch.float32, block_v=None,
                         num_warps=None, logits_gemm="auto", segment_size=None,
                         row_sync=True, skip_ignored="auto", dx_gemm="cublas",
                         dx_chunk_size=None):
    """Returns ``(loss, lse)``; see the module docstring for the two operating points.

    Tuning (defaults in parentheses): ``low_memory`` (False), ``chunk_size`` (None: from
    ``memory_budget``; tokens per chunk), ``vocab_chunk_size`` (None: from ``memory_budget``;
    vocabulary rows per chunk of the low-memory dW sweep), ``memory_budget`` (None: 896 MiB,
    256 MiB with ``low_memory=True``; bytes for one logits block, which sets both chunk sizes
    when they are not given; with neither given, the fast mode computing dW with fp32
    accumulation takes chunks of about 3584 tokens where 896 MiB would give fewer, in equal
    chunks and a block no larger than the fp32 dW accumulator: each chunk's dW GEMM makes a
    pass over that accumulator. At Gemma-2's V = 256000: 2 x 4096 tokens instead of
    4 x 1792 + 1024, 8% faster on an H100 at 3.3 GB peak extra instead of 2.1),
    ``grad_accum_dtype`` (``torch.float32``, or the weight's dtype to save ``2·V·H`` bytes at
    some accuracy cost; fast mode only; fp16's fused forward
    accumulates in fp32 regardless, as its sums are not yet scaled by the upstream gradient
    and could overflow fp16), ``block_v`` (None: from the row length, 32768 for rows of
    16384 or more, else up to 4096; 2048 where rows are split; the row-kernel block, a power of
    2),
    ``num_warps`` (None: 32 for long rows, else block/256 capped to [1, 8]; for split rows
    block/1024, at least 2), ``segment_size`` (None: 8192 on a GPU, whole rows interpreted;
    columns of a row per program, rounded up to whole blocks, where the kernel computes lse
    from the logits: such rows longer than this are split over programs, each streaming one
    segment; at most 256 segments; not where lse comes from ``logits_gemm="triton"``'s
    statistics, nor in gradient-only passes),
    ``row_sync`` (True: a row's segments meet in one launch, waiting for each other at a
    counter in memory, where they can all run at once; False, interpreted, or else: two
    launches, the segments' partial sums passed between them; slower),
    ``logits_gemm`` (``"auto"``; who computes the logits: ``"cublas"``, or ``"triton"``: a
    GEMM of ours whose epilogue also leaves the softmax statistics, saving the row kernel one
    of its two passes over the logits, and whose recomputing sweeps (low-memory backward,
    "none", lse gradients) take dz from a GEMM epilogue; for bf16/fp16, row-major operands
    with 16-byte aligned rows, no label smoothing, a compute-capability 9.x/10.x GPU.
    ``"auto"`` picks it for ``low_memory=True`` on a Hopper GPU (compute capability 9.x,
    where it was measured) where it can run, cuBLAS otherwise: on an
    H100 it made low-memory calls 1.6% faster and fast-mode ones 0.5% slower, in
    interleaved runs; see DESIGN.md),
    ``skip_ignored`` (``"auto"``; True: the fast forward leaves ignored tokens out of the
    logits GEMM and the row kernel (:mod:`.live_rows`: each chunk's live tokens first, their
    count read on device), the logits then computed by our GEMM (with ``logits_gemm``
    "triton" its statistics variant, else the plain one); for bf16/fp16, ``linear_weight``
    row-major with 16-byte aligned rows, a hidden size that is a multiple of 8, a compute-
    capability 9.x/10.x GPU (or the interpreter); not with ``low_memory``,
    ``return_lse`` (ignored tokens' lse would be needed), ``logits_gemm="cublas"`` or
    per-token upstream gradients (``reduction="none"`` with gradients). ``"auto"`` takes it
    on a Hopper GPU where all of that holds. False: every token's logits computed),
    ``dx_gemm`` (``"cublas"``; ``"triton"``: with ``skip_ignored`` (which it then requires:
    True unless given False, which is an error) dX of each chunk's live rows only, by our
    GEMM (:mod:`.dx_gemm`), instead of cuBLAS over every row: ours is slower on a whole chunk,
    so it pays where many tokens are ignored (H200, Llama shape: 0.86x the whole call with
    half of them ignored, about even with 10%)), ``dx_chunk_size`` (None: on a GPU with H >=
    4096, the rows one wave of cuBLAS's 256 x 128 output tiles covers, 1024 at H = 4096 on
    132 SMs, else whole chunks; see ``common.dx_piece_rows``; rows per cuBLAS dX GEMM call: a chunk's dX in pieces of at most
    this many rows).

    One backward per forward: the fast path hands its saved gradients over in place, so a
    second backward through the same graph (``retain_graph=True``) raises (backend="torch"
    recomputes and allows it); double backward (``create_graph=True``) raises on every
    backend.
    """
    x = p.x
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"backend='triton' supports float32/bfloat16/float16 input, got {x.dtype}; "
                        "use backend='torch' for float64")
    common.check_triton_device(x, "input", "backend='triton'", _interpret())
    if not isinstance(low_memory, bool):
        raise TypeError(f"low_memory must be a bool, got {low_memory!r}")
    if grad_accum_dtype not in (torch.float32, x.dtype):
        raise ValueError(f"grad_accum_dtype must be torch.float32 or the input dtype {x.dtype}, "
                         f"got {grad_accum_dtype!r}")
    if block_v is not None and (not common.is_int(block_v) or block_v < 16 or
                                block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of 2 >= 16, got {block_v!r}")
    if num_warps is not None and (not common.is_int(num_warps) or
                                  num_warps not in (1, 2, 4, 8, 16, 32)):
        raise ValueError(f"num_warps must be a power of 2 in [1, 32], got {num_warps!r}")
    if segment_size is not None and (not common.is_int(segment_size) or segment_size < 1):
        raise ValueError(f"segment_size must be a positive int, got {segment_size!r}")
    if not isinstance(row_sync, bool):
        raise TypeError(f"row_sync must be a bool, got {row_sync!r}")
    if not isinstance(logits_gemm, str) or logits_gemm not in LOGITS_GEMM:
        raise ValueError(f"logits_gemm must be one of {list(LOGITS_GEMM)}, got {logits_gemm!r}")
    if not (skip_ignored == "auto" or isinstance(skip_ignored, bool)):
        raise ValueError(f"skip_ignored must be 'auto', True or False, got {skip_ignored!r}")
    if not isinstance(dx_gemm, str) or dx_gemm not in DX_GEMMS:
        raise ValueError(f"dx_gemm must be one of {list(DX_GEMMS)}, got {dx_gemm!r}")
    own_dx = dx_gemm == "triton"
    dx_rows = common.check_dx_chunk_size(dx_chunk_size, x)
    if own_dx and skip_ignored is False:
        raise ValueError("dx_gemm='triton' computes the live rows of dX only: it needs "
                         "skip_ignored (True or 'auto'), not False")
    why = logits_gemm != "cublas" and stats_gemm.unsupported_options(x.dtype,
                                                                     opts.label_smoothing)
    if why and logits_gemm == "triton":  # layouts are checked in the op (real data pointers)
        raise ValueError(f"logits_gemm='triton' cannot run here: {why}")
    gemm_given = logits_gemm
    if logits_gemm == "auto" and (why or not low_memory):
        logits_gemm = "cublas"  # "auto" may pick ours for the low-memory setting only
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size),
                        ("memory_budget", memory_budget)):
        if value is not None and (not common.is_int(value) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    n, v = p.problem.n, p.problem.v
    itemsize = x.element_size()
    budget = memory_budget if memory_budget is not None else (
        LOW_MEMORY_BUDGET if low_memory else FAST_BUDGET)
    chunk = plan_token_chunks(n, v, bytes_per_element=itemsize, budget_bytes=budget,
                              chunk_size=chunk_size).chunk
    vocab_chunk = plan_token_chunks(v, max(n, 1), bytes_per_element=itemsize, budget_bytes=budget,
                                    chunk_size=vocab_chunk_size).chunk

    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and x.requires_grad
    need_dw = grad_on and p.w.requires_grad  # False for a frozen head (e.g. LoRA)
    need_db = grad_on and p.bias is not None and p.bias.requires_grad
    if not low_memory and chunk_size is None and memory_budget is None and need_dw:
        # only a dW accumulator's pass is amortized: a frozen head or no grad keeps the budget's
        # plan (fp16 accumulates in fp32 whatever grad_accum_dtype says: see _accum_dtype)
        chunk = _amortized_chunk(n, v, p.problem.h, itemsize, chunk,
                                 grad_accum_dtype == torch.float32 or x.dtype == torch.float16)
    grad_mode = NO_GRAD
    if (need_dx or need_dw or need_db) and opts.reduction != "none":
        grad_mode = DX_ONLY if low_memory else FULL_GRAD
    skip = True if own_dx else skip_ignored
    if skip is not False:
        why = _skip_conflict(x.dtype, opts, low_memory, gemm_given, grad_mode,
                             need_dx or need_dw or need_db)
        if why and skip is True:
            raise ValueError(f"{_skip_asked_by(own_dx)} cannot run here: {why}")
        skip = False if why else skip
    y = p.y if p.y.dtype in (torch.int32, torch.int64) else p.y.long()
    loss, lse, _denom, _dx, _dwa, _dwb, _db = _fwd_op(
        x, p.w, p.bias, y, p.class_weight, REDUCTIONS[opts.reduction], opts.ignore_index,
        float(opts.label_smoothing), float(opts.z_loss), float(opts.softcap or 0.0), grad_mode,
        need_dx, need_dw, need_db, low_memory, chunk, vocab_chunk, block_v or 0, num_warps or 0,
        grad_accum_dtype == torch.float32, LOGITS_GEMM[logits_gemm], segment_size or 0,
        row_sync, SKIP_IGNORED[skip], own_dx and skip is True, dx_rows)
    return loss, lse


def _skip_conflict(dtype, opts, low_memory, logits_gemm, grad_mode, any_grad) -> str:
    """Why these options rule ``skip_ignored`` out ('' when they do not; the layouts and the
    GPU are checked in the op: ``_resolve_skip``). ``logits_gemm`` as the caller gave it."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it runs bfloat16/float16 inputs only (got {dtype}; fp32 would run as TF32)"
    if low_memory:
        return "the low-memory setting recomputes from every token's lse"
    if opts.return_lse:
        return "return_lse=True returns the lse of ignored tokens too"
    if logits_gemm == "cublas":
        return "it needs our logits GEMM (logits_gemm 'auto' or 'triton'), not cuBLAS"
    if any_grad and grad_mode != FULL_GRAD:
        return "per-token upstream gradients (reduction='none') recompute from every token's lse"
    return ""
