"""``backend="triton"`` for linear JSD: cuBLAS GEMMs on token chunks around one Triton kernel.

Per chunk of ``C`` tokens (``chunk_size``), in sub-chunks of ``c`` tokens (``logits_chunk_size``):

1. the student and teacher logits GEMMs, written with fp32 accuracy (``fp32_logits=True``,
   the default: JSD's gradient has no exact dominant term, so logits rounded to bf16 move it
   by ~1e-2; see the spec) into two ``[c, V]`` buffers: on a Hopper-class GPU by our TMA
   GEMM as fp16 remainders below each row's maximum in its 256-column tile, the maxima
   beside them, with ``fp16_tile_logits`` (opt-in: half the bytes, 0.93x the time at Llama's
   head on an H200, the loss ~1e-5 less accurate), else (the default) as fp32 by cuBLAS;
2. the row kernel (:mod:`.jsd_rows`): both normalizers, the per-token loss, and the student
   logit gradient dz written into a ``[C, V]`` buffer in the input dtype;

then, per chunk, ``dX = dz·W_s`` and ``dW (+)= dzᵀ·X_s`` (cuBLAS; on Hopper, with ``fp16_dz``, the
default there, dz is fp16 times a power of two and both GEMMs are ours, :mod:`.mixed_gemm`,
converting W_s and X_s to fp16 in registers: bf16 dz moves the gradients by 2.2e-3, fp16 dz
leaves them at the bf16 result's own 1.7e-3; W_s's and X_s's own power-of-two scales for the
conversion, 1 unless a value passes 65504, come from one max|t| pass each). For ``mean``/``sum`` this
all happens in the forward (gradients for the unit upstream gradient, ``1/Σm`` folded into dz
so dX is rounded once); backward only scales by the upstream scalar (exact: the gradient is
linear in it). Four GEMMs per token, the floor of the op. ``reduction="none"`` recomputes in
backward with per-token upstream gradients.

dW accumulates in an fp32 accumulator through ``torch.addmm(out_dtype=float32, out=acc)``
(in place, no ``[V, H]`` temporaries; the first chunk assigns), which backward narrows into the
final gradient *in place* (:mod:`.narrow_cast`): accumulator and result never coexist, and the
upstream scalar is applied before the one rounding. dX is kept in fp32 (written by fp32-output
GEMMs) and narrowed the same way, so it too is rounded once whatever the upstream scalar (a
bf16 dX scaled in backward would be rounded twice). Since backward finishes the saved gradients in
place, a second backward through the same graph (``retain_graph=True``) raises
(``narrow_cast.hand_over_once``) rather than returning gradients scaled twice.

Memory beyond inputs and gradients: the fp32 accumulators' extra ``2·(V + N)·H`` bytes, plus
``C·V·itemsize + 2·c·V·4`` bytes of buffers (``memory_budget``, default 896 MiB: C = 1792,
c = 384 (C/4 rounded down to a multiple of 128) at V = 128256 in bf16; with ``fp16_dz`` equal chunks
in whole 1024s and c = C/8: C = 2048, c = 256, see :func:`chunk_plan`); with
``fp16_tile_logits`` ``C·V·2 + c·V·2`` plus ``2·c·⌈V/256⌉·4`` of offsets: the student's fp16
logits are written into the rows of dz's buffer that their gradient will take (pass 3
overwrites each element after reading it), the chunks are made equal (C = 2048 at N = 8192,
four of them) and c = C/2 rounded down to a multiple of 256 (1024). No host syncs; the
ops are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces
them. Only the gradients autograd needs are computed (a frozen student head: no dW GEMM).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch
import triton

from .. import _torch_common as common
from .. import _torch_jsd as jsd_common
from ..specs import linear_jsd as spec
from ..specs.tiling import ChunkPlan, balanced, next_power_of_2, plan_token_chunks
from . import INTERPRETED
from . import jsd_rows
from .abs_max import abs_max
from . import logits_gemm
from .narrow_cast import accumulate_split_, accumulator_pair, finish_, hand_over_once

TUNING = ("chunk_size", "logits_chunk_size", "memory_budget", "fp32_logits", "grad_accum_dtype",
          "block_v", "segment_size", "num_warps", "programs_per_sm", "row_sync", "dx_chunk_size",
          "fp16_tile_logits", "fp16_dz")
# the target range check runs in the forward op (_fwd_op), as in torch_chunked (see there)
CHECKS_TARGETS = True

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FAST_BUDGET = 896 << 20     # dz [C, V] + two fp32 logits [C/4, V]: C = 1792 at V = 128256, bf16
LOGITS_SHARE = 4            # c = C / LOGITS_SHARE with fp32 logits (C / 2 with half logits)
DZ16_PIECE = 1024           # fp16 dz with fp32 logits: chunks in whole 1024s (see chunk_plan)
# Row kernel on a GPU: programs of 4 warps stream 1024-column blocks, each owning an
# 8192-column segment of a row (64 KiB of fp32 logits, re-read from L1/L2 by passes 2 and 3),
# two programs per SM. H100, whole fwd+bwd at N=8192, H=4096, V=128256, β = 0.5, interleaved
# A/Bs (benchmarks/row_stages_ab.py, results/…-s24-jsd-row-warps-ab.jsonl): 0.984x and 0.966x
# against 8 warps x 2048 columns (4 warps alone 0.992x; 4096-column segments and 4 programs
# per SM no better); the forward KL 1.013x (0.989-1.024), within the spread.
GPU_BLOCK = 1024
GPU_SEGMENT = 8192
GPU_WARPS = 4
GPU_PROGRAMS_PER_SM = 2
# Software-pipelining depth of the row loops (tl.range num_stages): 2 and 3 measured no faster
# than 1 (1.007x, 1.012x; intervals include 1; benchmarks/row_stages_ab.py; a segment is only
# 4 blocks long). Above 1, mind the shared memory it takes (see linear_cross_entropy._rows).
GPU_ROW_STAGES = 1
REDUCTIONS = common.REDUCTION_CODES
KINDS = {"forward_kl": jsd_rows.KIND_FORWARD_KL, "reverse_kl": jsd_rows.KIND_REVERSE_KL,
         "jsd": jsd_rows.KIND_JSD}
NO_GRAD, FULL_GRAD = 0, 1
# How the logits are stored between their GEMMs and the row kernel (the ops' ``logits_mode``)
LOGITS_INPUT, LOGITS_FP32, LOGITS_TILES = 0, 1, 2

_INTERPRET = INTERPRETED


def _interpret() -> bool:
    return _INTERPRET


@dataclasses.dataclass(frozen=True)
class Config:
    chunk: int            # tokens per dX / dW chunk (C)
    sub_chunk: int        # tokens per logits GEMM / row-kernel launch (c <= C)
    fp32_logits: bool
    block: int            # row-kernel columns per step (power of 2)
    segment: int          # columns of a row per program (multiple of block)
    num_warps: int
    grid: int             # persistent programs (fused kernel); 0 = one per SM x programs_per_sm
    row_sync: int         # 1 fused with per-row barriers, 0 or -1 (default) one launch per pass
    dx_rows: int = 0      # rows per dX GEMM call (0: whole chunks; common.dx_piece_rows)
    tile_w: int = 0       # > 0: fp16 logits relative to the maxima of tiles this wide
    dz_scale: float = 0.0  # > 0: dz in fp16 times this power of 2 (fp16_dz, see _dz16_scale)


# ----------------------------------------------------------------------------- launching
def _row_kernel(zs, zt, dz, y, g, loss, opts_t, v, cfg: Config, write_loss, write_grad,
                offs=None):
    """Row kernel over ``zs[:rows]`` / ``zt[:rows]`` (see jsd_rows); ``offs``: the (student,
    teacher) tile offsets of fp16 logits (``cfg.tile_w``)."""
    kind, beta, temperature, ignore_index, hard_w = opts_t
    rows = zs.shape[0]
    if rows == 0:
        return
    segs = triton.cdiv(v, cfg.segment)
    dev = zs.device
    # One launch per pass is the default: on the H100 it measured 1-2.5 ms faster per Llama-size
    # call than the fused kernel with per-row barriers (benchmarks/jsd_profile.py, 3 runs).
    fused = segs == 1 or cfg.row_sync == 1
    if fused and segs > 1 and (_interpret() or segs > _max_resident_segments(dev)):
        fused = False  # programs that wait for each other must be resident together
    # absent buffers are never dereferenced (constexpr switches): any tensor stands in
    part = (torch.empty(rows, segs, jsd_rows.NUM_FIELDS, dtype=torch.float32, device=dev)
            if segs > 1 else zs)
    # int32 even when unused: Triton 3.6 type-checks the (dead) barrier code's atomics
    sync = torch.zeros(2 + rows if (fused and segs > 1) else 1, dtype=torch.int32, device=dev)
    dummy = zs
    args = (zs, zs.stride(0), zt, zt.stride(0),
            dz if dz is not None else zs, dz.stride(0) if dz is not None else 0,
            y if y is not None else dummy, g if g is not None else dummy,
            0 if (g is None or g.numel() == 1) else 1,
            loss if loss is not None else dummy, part, sync,
            *(offs if offs is not None else (dummy, dummy)),
            offs[0].stride(0) if offs is not None else 0, rows, v,
            common.load_cols(v, *(t for t in (zs, zt, dz) if t is not None)),
            ignore_index, 1.0 / temperature, beta, 1.0 - beta, hard_w)
    meta = dict(KIND=kind, HAS_Y=y is not None, HARD=hard_w > 0, T_ONE=temperature == 1.0,
                WRITE_LOSS=write_loss, WRITE_GRAD=write_grad, SEGS=segs,
                SEGS_P2=max(2, next_power_of_2(segs)), SEG=cfg.segment, BLOCK=cfg.block,
                ROUND_BF16=_interpret() and dz is not None and dz.dtype == torch.bfloat16,
                FORM=spec.beta_form(beta) if kind == jsd_rows.KIND_JSD else 0,
                STAGES=1 if _interpret() else GPU_ROW_STAGES, TILE_W=cfg.tile_w,
                num_warps=cfg.num_warps)
    if fused:
        grid = rows if _interpret() else min(cfg.grid, rows * segs)
        jsd_rows.jsd_rows_kernel[(max(1, grid),)](*args, PHASE=0, **meta)
        return
    for phase in ((1, 2, 3) if kind == jsd_rows.KIND_JSD else (1, 3)):
        if phase != 3:
            # pass 2 with tiles keeps Λ for a pass 3 that writes a gradient: it reads WRITE_GRAD
            keep = phase == 2 and cfg.tile_w > 0 and write_grad
            meta_p = dict(meta, WRITE_LOSS=False, WRITE_GRAD=keep)
        else:
            meta_p = meta
        jsd_rows.jsd_rows_kernel[(rows * segs,)](*args, PHASE=phase, **meta_p)


def _max_resident_segments(device) -> int:
    """Programs guaranteed resident together: one per SM at least."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _logits(x, w, out, cfg: Config, offs=None):
    if cfg.tile_w:
        logits_gemm.logits_tile_offsets(x, w, out, offs, _interpret(),
                                        _max_resident_segments(x.device) if x.is_cuda else 1)
        return out
    if not cfg.fp32_logits:
        return common.vocab_mm_(x, w.t(), out, axis=1)
    for s, e in common.vocab_parts(w.shape[0]):  # fp32 results: no thin-GEMM concern
        jsd_common.logits_f32(x, w[s:e], out=out[:, s:e])
    return out


def _rows_into_pair(a, parts, s, mm):
    """``mm(a_rows, out_rows)`` for rows [s, s + len(a)) of an fp32 result held in the split
    pair ``parts`` (once or twice: a chunk may straddle the split)."""
    top, bottom = parts
    r1 = top.shape[0]
    e = s + a.shape[0]
    if s < r1:
        mm(a[: min(e, r1) - s], top[s:min(e, r1)])
    if e > r1:
        lo = max(s, r1)
        mm(a[lo - s:], bottom[lo - r1:e - r1])


def _range_scale(t):
    """(1,) fp32 on ``t``'s device: 1 where every ``|t|`` <= 65504 (fp16's largest), else the
    power of 2 that brings the largest into fp16's range, for the fp16-dz GEMMs' conversion
    of a bf16 operand (bf16 reaches 3e38: a weight of 7e4 converted as it is would be inf,
    and inf·0 a NaN gradient). One read of ``t``, no host sync."""
    if t.is_contiguous():
        amax = abs_max(t)
    else:
        lo, hi = torch.aminmax(t)
        amax = torch.maximum(hi.float(), -lo.float())
    return torch.exp2(-torch.ceil(torch.log2(amax / 65504.0)).clamp_(min=0.0)).reshape(1)


def _as_fp16(t, t_scale):
    """What the Gluon GEMMs multiply: ``t_scale · t`` rounded to fp16, as fp32."""
    return (t.float() * t_scale).half().float()


def _dx16_(dz16, w, out, scale, w_scale, rows):
    """``out = scale · dz16 @ fp16(w_scale · w)`` in fp32 (``scale`` holds 1/w_scale): the
    Gluon kernel on a GPU, in GEMMs of at most ``rows`` rows (one wave of output tiles; 0:
    whole), an fp32 product of the same fp16 operands elsewhere (the interpreter's tests)."""
    if dz16.is_cuda and not _interpret():
        from . import mixed_gemm
        step = rows if 0 < rows < dz16.shape[0] else max(1, dz16.shape[0])
        for r in range(0, dz16.shape[0], step):
            mixed_gemm.dx_(dz16[r:r + step], w, out[r:r + step], scale, w_scale)
    else:
        torch.mm(dz16.float(), _as_fp16(w, w_scale), out=out).mul_(scale)


def _dw16_(pair, dz16, x_c, scale, x_scale, first):
    """``dW (+)= scale · dz16ᵀ · fp16(x_scale · x_c)`` into the split fp32 pair (columns of dz16
    are its rows), as :func:`_dx16_` does dX. The first chunk assigns."""
    a, b = pair
    for acc, lo, hi in ((a, 0, a.shape[0]), (b, a.shape[0], dz16.shape[1])):
        if hi <= lo:
            continue
        if dz16.is_cuda and not _interpret():
            from . import mixed_gemm
            mixed_gemm.dw_(dz16[:, lo:hi], x_c, acc, scale, x_scale, first)
        else:
            part = torch.mm(dz16[:, lo:hi].t().float(), _as_fp16(x_c, x_scale)).mul_(scale)
            acc.copy_(part) if first else acc.add_(part)


def _sweep(xs, ws, xt, wt, y, g, opts_t, cfg: Config, want_loss, want_grad, accum, dx_fp32,
           need_dx=True, need_dw=True):
    """One pass over the tokens: per-token losses (fp32, when ``want_loss``) and, when
    ``want_grad``, dX (if ``need_dx``) and dW (if ``need_dw``: a frozen head costs neither its
    GEMM nor its accumulator) for the upstream gradient ``g`` ((1,) uniform or (N,) per token;
    or a function returning it, called once, after the first logits GEMMs are queued).
    ``accum``: "fp32" (dW in a split fp32 accumulator, to be narrowed in place) or "input"
    (dW in the input dtype); ``dx_fp32``: dX kept in fp32 the same way (the fast mode, whose
    backward still applies the upstream scalar: rounding once, then). Returns
    (token_loss, dX part a, dX part b, dW part a, dW part b); part b is empty when unsplit."""
    n, hs = xs.shape
    v = ws.shape[0]
    dev = xs.device
    dt = xs.dtype
    token_loss = torch.empty(n, dtype=torch.float32, device=dev) if want_loss else None
    dx = (xs.new_empty(0), xs.new_empty(0))
    dw = (xs.new_empty(0), xs.new_empty(0))
    if want_grad and need_dx:
        dx = accumulator_pair(n, hs, torch.float32 if dx_fp32 else dt, dt, xs)
    if want_grad and need_dw:
        dw = accumulator_pair(v, hs, torch.float32 if accum == "fp32" else dt, dt, xs,
                              zero=n == 0)
    ldt = torch.float16 if cfg.tile_w else torch.float32 if cfg.fp32_logits else dt
    c = min(cfg.sub_chunk, n)
    dz_dt = torch.float16 if cfg.dz_scale else dt
    dz_buf = common.rows_buffer(min(cfg.chunk, n), v, dz_dt, dev) if want_grad else None
    # fp16 dz: the row kernel's upstream, the GEMMs' scale, the operands' scales
    g_rows = w_scale = x_scale = dx_scale = dw_scale = None
    # fp16 tiles with a gradient: the student's logits go where their rows' dz will be (the
    # same 2 bytes per element; pass 3 overwrites each element it has read), so the chunk's
    # buffers are [C, V] + [c, V] instead of [C, V] + 2 x [c, V]
    in_place = cfg.tile_w > 0 and dz_buf is not None
    zs_buf = dz_buf.view(ldt) if in_place else common.rows_buffer(c, v, ldt, dev)
    zt_buf = common.rows_buffer(c, v, ldt if cfg.fp32_logits else xt.dtype, dev)
    offs_buf = (tuple(torch.empty(c, logits_gemm.stat_tiles(v, _interpret()),
                                  dtype=torch.float32, device=dev) for _ in range(2))
                if cfg.tile_w else None)  # (student, teacher)
    for s in range(0, n, cfg.chunk):
        e = min(s + cfg.chunk, n)
        for ss in range(s, e, cfg.sub_chunk):
            ee = min(ss + cfg.sub_chunk, e)
            offs = None if offs_buf is None else tuple(o[: ee - ss] for o in offs_buf)
            zs_rows = zs_buf[ss - s: ee - s] if in_place else zs_buf[: ee - ss]
            zs = _logits(xs[ss:ee], ws, zs_rows, cfg, None if offs is None else offs[0])
            zt = _logits(xt[ss:ee], wt, zt_buf[: ee - ss], cfg, None if offs is None else offs[1])
            if callable(g):
                g = g()
            if cfg.dz_scale and g_rows is None:
                # dz16 = dz_scale·(the gradient for an upstream 1); the GEMMs multiply their
                # fp32 sums by g / dz_scale (one fp32 rounding)
                assert g.numel() == 1, "fp16 dz takes a uniform upstream gradient"
                g_rows = torch.full((1,), cfg.dz_scale, dtype=torch.float32, device=dev)
                mm_scale = (g.float() / cfg.dz_scale).reshape(1)
                # the bf16 operands' own scales for fp16 (1 unless past its range), undone
                # in the epilogues
                if need_dx:
                    w_scale = _range_scale(ws)
                    dx_scale = mm_scale / w_scale
                if need_dw:
                    x_scale = _range_scale(xs)
                    dw_scale = mm_scale / x_scale
            g_k = g_rows if cfg.dz_scale else g
            _row_kernel(zs, zt, None if dz_buf is None else dz_buf[ss - s: ee - s],
                        None if y is None else y[ss:ee],
                        None if not want_grad else (g_k if g_k.numel() == 1 else g_k[ss:ee]),
                        None if token_loss is None else token_loss[ss:ee], opts_t, v, cfg,
                        write_loss=want_loss, write_grad=want_grad, offs=offs)
        dz = dz_buf[: e - s] if want_grad else None
        if want_grad and need_dx:
            if cfg.dz_scale:
                _rows_into_pair(dz, dx, s, lambda a, o: _dx16_(a, ws, o, dx_scale, w_scale,
                                                               cfg.dx_rows))
            elif dx_fp32:
                _rows_into_pair(dz, dx, s,
                                lambda a, o: common.mm_over_vocab(a, ws, o, cfg.dx_rows))
            else:
                common.mm_over_vocab(dz, ws, dx[0][s:e], cfg.dx_rows)
        if want_grad and need_dw:
            if cfg.dz_scale:
                _dw16_(dw, dz, xs[s:e], dw_scale, x_scale, first=s == 0)
            else:
                accumulate_split_(dw, dz, xs[s:e], first=s == 0)
    if callable(g):  # no tokens
        g()
    return (token_loss,) + dx + dw


def _opts_tuple(beta, temperature, ignore_index, hard_w):
    kind = KINDS[spec.LinearJSDOptions(beta=beta).kind]
    return kind, beta, temperature, ignore_index, hard_w


def _accum(dtype, accum_fp32, fused=False):
    """How dW accumulates: "fp32" (the split fp32 accumulator, narrowed in place at the end:
    one rounding whatever the number of chunks and the upstream scalar) or "input" (in the
    input dtype: fp32 inputs, or a half-precision accumulator by request). The ``fused``
    forward's fp16 sums are for an upstream gradient of 1, not yet scaled (1/Σm, or the
    caller's divisor after "sum"), and could overflow fp16 where the gradient does not: fp32
    whatever was requested."""
    if fused and dtype == torch.float16:
        return "fp32"
    return "fp32" if (accum_fp32 and dtype != torch.float32) else "input"


def _cfg(chunk, sub_chunk, logits_mode, block, segment, num_warps, grid, row_sync, dx_rows,
         dz_scale=0.0):
    tile_w = logits_gemm.tiles(_interpret())["bn"] if logits_mode == LOGITS_TILES else 0
    return Config(chunk, sub_chunk, logits_mode != LOGITS_INPUT, block, segment, num_warps, grid,
                  row_sync, dx_rows, tile_w, dz_scale)


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("logitless::linear_jsd_fwd", mutates_args=())
def _fwd_op(xs: torch.Tensor, ws: torch.Tensor, xt: torch.Tensor, wt: torch.Tensor,
            y: Optional[torch.Tensor], reduction: int, beta: float, temperature: float,
            ignore_index: int, hard_w: float, grad_mode: int, need_dx: bool, need_dw: bool,
            chunk: int, sub_chunk: int, logits_mode: int, accum_fp32: bool, block: int,
            segment: int, num_warps: int, grid: int, row_sync: int, dx_rows: int,
            dz_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor, torch.Tensor]:
    """-> (loss, Σm or 1, dX part a, dX part b, dW part a, dW part b): the gradients (for an
    upstream 1, with 1/Σm folded in unless fp16) only with ``grad_mode`` (mean/sum) and only
    those needed, in fp32 split pairs for half-precision inputs (see :func:`_sweep`);
    ``dz_scale`` > 0: through an fp16 dz (``fp16_dz``), unless a tensor's address rules out
    our GEMMs' TMA descriptors (checked here, where compiled graphs run real tensors)."""
    with common.on_device(xs):
        if dz_scale and xs.is_cuda and not _interpret():
            from . import mixed_gemm
            if not mixed_gemm.supported(ws, xs):
                dz_scale = 0.0
        cfg = _cfg(chunk, sub_chunk, logits_mode, block, segment, num_warps, grid, row_sync,
                   dx_rows, dz_scale)
        n = xs.shape[0]
        opts_t = _opts_tuple(beta, temperature, ignore_index, hard_w)
        found = {}

        def upstream():
            """g, and the target check, once the first logits GEMMs are queued: the GPU runs
            them while the host launches these small kernels (see the CE's ``scalars``)."""
            if y is not None:
                common.check_targets(y, ws.shape[0], ignore_index)
            denom = torch.ones((), dtype=torch.float32, device=xs.device)
            if reduction == REDUCTIONS["mean"]:
                denom = jsd_common.mean_denominator(y, n, ignore_index, xs)
            found["denom"] = denom
            return (1.0 / denom).reshape(1) if common.folds_mean(reduction, xs.dtype) else \
                torch.ones(1, dtype=torch.float32, device=xs.device)

        token_loss, dx_a, dx_b, dw_a, dw_b = _sweep(
            xs, ws, xt, wt, y, upstream, opts_t, cfg, True, grad_mode == FULL_GRAD,
            _accum(xs.dtype, accum_fp32, fused=True), xs.dtype != torch.float32, need_dx,
            need_dw)
        denom = found["denom"]
        loss = token_loss if reduction == REDUCTIONS["none"] else token_loss.sum() / denom
        return loss, denom, dx_a, dx_b, dw_a, dw_b


@_fwd_op.register_fake
def _(xs, ws, xt, wt, y, reduction, beta, temperature, ignore_index, hard_w, grad_mode, need_dx,
      need_dw, chunk, sub_chunk, logits_mode, accum_fp32, block, segment, num_warps, grid,
      row_sync, dx_rows, dz_scale):
    n, hs, v = xs.shape[0], xs.shape[1], ws.shape[0]
    f32 = dict(dtype=torch.float32)
    loss = xs.new_empty(n, **f32) if reduction == REDUCTIONS["none"] else xs.new_empty((), **f32)
    empty = (xs.new_empty(0), xs.new_empty(0))
    full = grad_mode == FULL_GRAD
    dw_dtype = (torch.float32 if _accum(xs.dtype, accum_fp32, fused=True) == "fp32"
                else xs.dtype)
    grads = ((accumulator_pair(n, hs, torch.float32, xs.dtype, xs) if full and need_dx
              else empty) +
             (accumulator_pair(v, hs, dw_dtype, xs.dtype, xs) if full and need_dw else empty))
    return (loss, xs.new_empty((), **f32)) + grads


@torch.library.custom_op("logitless::linear_jsd_bwd", mutates_args=())
def _bwd_op(xs: torch.Tensor, ws: torch.Tensor, xt: torch.Tensor, wt: torch.Tensor,
            y: Optional[torch.Tensor], g: torch.Tensor, beta: float, temperature: float,
            ignore_index: int, hard_w: float, need_dx: bool, need_dw: bool, chunk: int,
            sub_chunk: int, logits_mode: int, accum_fp32: bool, block: int, segment: int,
            num_warps: int, grid: int, row_sync: int, dx_rows: int
            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Recomputing backward for per-token upstream gradients ``g`` (N,): (dX, dW), each empty
    unless needed. g is in dz already, so dX is written (rounded) once; dW is narrowed from
    fp32 without a scale."""
    with common.on_device(xs):
        cfg = _cfg(chunk, sub_chunk, logits_mode, block, segment, num_warps, grid, row_sync,
                   dx_rows)
        v, hs = ws.shape
        _, dx, _, dw_a, dw_b = _sweep(xs, ws, xt, wt, y, g, _opts_tuple(beta, temperature,
                                                                       ignore_index, hard_w),
                                      cfg, False, True, _accum(xs.dtype, accum_fp32), False,
                                      need_dx, need_dw)
        return dx, (finish_(dw_a, dw_b, None, (v, hs), xs.dtype, _interpret()) if need_dw
                    else dw_a)


@_bwd_op.register_fake
def _(xs, ws, xt, wt, y, g, beta, temperature, ignore_index, hard_w, need_dx, need_dw, chunk,
      sub_chunk, logits_mode, accum_fp32, block, segment, num_warps, grid, row_sync, dx_rows):
    return (xs.new_empty(xs.shape) if need_dx else xs.new_empty(0),
            xs.new_empty(ws.shape) if need_dw else xs.new_empty(0))


def _setup_context(ctx, inputs, output):
    (xs, ws, xt, wt, y, reduction, beta, temperature, ignore_index, hard_w, grad_mode, _need_dx,
     _need_dw, chunk, sub_chunk, logits_mode, accum_fp32, block, segment, num_warps, grid,
     row_sync, dx_rows, _dz_scale) = inputs
    loss, denom, dx_a, dx_b, dw_a, dw_b = output
    ctx.save_for_backward(xs, ws, xt, wt, y, denom, dx_a, dx_b, dw_a, dw_b)
    ctx.args = dict(reduction=reduction, beta=beta, temperature=temperature,
                    ignore_index=ignore_index, hard_w=hard_w, grad_mode=grad_mode, chunk=chunk,
                    sub_chunk=sub_chunk, logits_mode=logits_mode, accum_fp32=accum_fp32,
                    block=block, segment=segment, num_warps=num_warps, grid=grid,
                    row_sync=row_sync, dx_rows=dx_rows)
    ctx.set_materialize_grads(False)


def _finish(a, b, scale, shape, dtype):
    return finish_(a, b, scale, shape, dtype, _interpret())


def _backward(ctx, g_loss, _g_denom, _g_dxa, _g_dxb, _g_dwa, _g_dwb):
    a = ctx.args
    need_x, need_w = ctx.needs_input_grad[:2]
    none = (None,) * 22
    if torch.is_grad_enabled():
        raise RuntimeError(common.NO_DOUBLE_BACKWARD.format(op="linear_jsd"))
    if g_loss is None or not (need_x or need_w):
        return (None, None) + none
    if a["grad_mode"] == FULL_GRAD:  # before the saved tensors are unpacked (version check)
        hand_over_once(ctx, "linear_jsd")
    xs, ws, xt, wt, y, denom, dx_a, dx_b, dw_a, dw_b = ctx.saved_tensors
    if a["grad_mode"] == FULL_GRAD:
        # The forward holds the gradients for the upstream 1 (or 1/Σm): scale them (exact in
        # fp32). They are ours alone (the front door drops them): finished in place.
        scale = g_loss.float().reshape(1)
        if not common.folds_mean(a["reduction"], xs.dtype):
            scale = scale / denom
        # detached: saved outputs of the op would hand the caller tensors that require grad
        gx = _finish(dx_a, dx_b, scale, xs.shape, xs.dtype).detach() if need_x else None
        gw = _finish(dw_a, dw_b, scale, ws.shape, xs.dtype).detach() if need_w else None
        return (gx, gw) + none
    # reduction="none": per-token upstream gradients, recompute.
    gx, gw = _bwd_op(xs, ws, xt, wt, y, g_loss.float().contiguous(), a["beta"],
                     a["temperature"], a["ignore_index"], a["hard_w"], need_x, need_w,
                     a["chunk"], a["sub_chunk"], a["logits_mode"], a["accum_fp32"], a["block"],
                     a["segment"], a["num_warps"], a["grid"], a["row_sync"], a["dx_rows"])
    return (gx if need_x else None, gw if need_w else None) + none


torch.library.register_autograd("logitless::linear_jsd_fwd", _backward,
                                setup_context=_setup_context)


# ----------------------------------------------------------------------------- entry point
def chunk_plan(n: int, v: int, itemsize: int, fp32_logits: bool, fp16_tile_logits: bool,
               memory_budget=None, chunk_size=None, logits_chunk_size=None, fp16_dz=False):
    """(C, c): tokens per dX/dW chunk and per logits sub-chunk, the user's where given, else
    from ``memory_budget`` (see the module's memory paragraph). ``fp16_dz`` with fp32 logits:
    equal chunks in whole 1024s and c = C/8 (2048 / 256 at N = 8192, V = 128256): our dX GEMM
    then runs in whole one-wave pieces of 1024 rows, which at N a multiple of 2048 never
    straddle the fp32 dX pair's split (at the 1792-token chunks it measured +3.1 ms a call on
    an H200; cuBLAS's split-K kernels take such pieces in stride)."""
    logit_bytes = 2 if fp16_tile_logits else 4 if fp32_logits else itemsize
    share = LOGITS_SHARE if (fp32_logits and not fp16_tile_logits) else 2
    dz16_plan = fp16_dz and fp32_logits and not fp16_tile_logits
    if dz16_plan:
        share = 2 * LOGITS_SHARE
    budget = FAST_BUDGET if memory_budget is None else memory_budget
    # per (chunk row, column): dz, and the two heads' logits of a sub-chunk; with fp16 tiles
    # the student's logits share dz's buffer (see _sweep), only the teacher's come on top
    heads = 1 if fp16_tile_logits else 2
    plan = plan_token_chunks(n, v, bytes_per_element=itemsize + heads * logit_bytes // share,
                             budget_bytes=budget, chunk_size=chunk_size)
    if fp16_tile_logits and chunk_size is None:
        # equal chunks in whole 512s (sub-chunks then whole 256s): at N = 8192, V = 128256
        # 4 x 2048 rather than 3 x 2432 + 896, as many dW passes at less memory (1.91 GB)
        plan = balanced(plan, 512)
    elif dz16_plan and chunk_size is None and DZ16_PIECE <= plan.chunk < n:
        plan = balanced(ChunkPlan(n=n, chunk=plan.chunk // DZ16_PIECE * DZ16_PIECE), DZ16_PIECE)
    chunk = plan.chunk
    if logits_chunk_size is None:
        # fp16 tiles: a multiple of 256 tokens (1024 at C = 2048: the logits GEMMs' M; 512
        # measured 1.8% slower, H200)
        step = 256 if fp16_tile_logits else 128
        sub = chunk if chunk <= 128 else max(128, (chunk // share) // step * step)
    else:
        if isinstance(logits_chunk_size, bool) or not isinstance(logits_chunk_size, int) \
                or logits_chunk_size < 1:
            raise ValueError(f"logits_chunk_size must be a positive int, got {logits_chunk_size!r}")
        sub = logits_chunk_size
    sub = min(sub, chunk)
    return chunk, sub


def _tiles_can_run(p: jsd_common.Prepared, fp32_logits: bool) -> bool:
    """What ``fp16_tile_logits=None`` picks: True where its TMA GEMM runs (compiled, on a
    Hopper-class GPU, half-precision inputs in layouts the tensor descriptors take) and fp32
    logits were asked for."""
    if not fp32_logits or _interpret() or not p.xs.is_cuda:
        return False
    return all(x.dtype in (torch.bfloat16, torch.float16) and
               not logits_gemm.unsupported_layout(x, w, None)
               for x, w in ((p.xs, p.ws), (p.xt, p.wt)))


DZ16_MAX_SCALE = 2.0 ** 100  # past it the gradient is too small for fp16 (see _dz16_scale)


def _dz_bound(beta: float, temperature: float, hard_w: float) -> float:
    """A bound on ``|dz|`` for an upstream 1 (forward KL and JSD; the reverse KL's
    ``Q·(δ + KL)/T`` has none): the forward KL's ``(Q − P)/T`` is within 1/T; the JSD's
    ``(1 − β)·Q·(Λ − K)/T``, with Λ = log(Q/M) and K = Σ Q·Λ = KL(Q‖M) >= 0, within
    ``(1 − β)·(min(β, 1/e) + min(−log(1 − β), 1/(e·(1 − β))))/T``: Q·Λ >= Q − M >= −β·P >= −β
    (log x >= 1 − 1/x) and >= Q·log Q >= −1/e (M <= 1), while Q·Λ and K are at most
    −log(1 − β) (M >= (1 − β)·Q) and (1 − β)·(−log(1 − β)) <= 1/e. It vanishes with β, as
    the gradient does; the hard term's ``w_h·(S − [v = y])`` adds w_h."""
    if beta == 0.0:
        kl = 1.0
    else:
        far = min(-math.log1p(-beta), 1.0 / (math.e * (1.0 - beta)))
        kl = (1.0 - beta) * (min(beta, 1.0 / math.e) + far)
    return kl / temperature + hard_w


def _dz16_scale(beta: float, temperature: float, hard_w: float) -> float:
    """fp16 dz's power-of-two scale: the largest with ``S·bound <= 2^15`` (half fp16's range;
    :func:`_dz_bound`), so that a gradient as small as β·1e-5 (β = 1e-10, say) is still
    carried in fp16's normal range rather than lost below it."""
    return 2.0 ** math.floor(math.log2(32768.0 / _dz_bound(beta, temperature, hard_w)))


def _fp16_dz(requested, p: jsd_common.Prepared, opts: spec.LinearJSDOptions, grad_mode: int,
             accum_fp32: bool, need_dw: bool) -> float:
    """fp16 dz's scale (:func:`_dz16_scale`) where the student's gradient GEMMs take an fp16
    dz (``fp16_dz``; see linear_jsd), else 0. ``True`` is checked whether or not this call
    needs a gradient."""
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f"fp16_dz must be None or a bool, got {requested!r}")
    if requested is False:
        return 0.0
    why = None
    if opts.reduction == "none":
        why = "it takes one upstream gradient for every token: reduction 'mean' or 'sum'"
    elif opts.kind == "reverse_kl":
        why = "the reverse KL's (beta=1) logit gradient has no bound that fits fp16's range"
    elif (scale := _dz16_scale(opts.beta, opts.temperature,
                               opts.hard_loss_weight)) > DZ16_MAX_SCALE:
        why = ("the logit gradient is too small for fp16 at this beta / temperature (its "
               "scale would pass 2^100)")
    elif p.xs.dtype != torch.bfloat16 or p.ws.dtype != torch.bfloat16:
        why = (f"it is for bfloat16 student inputs and weights, got {p.xs.dtype} / "
               f"{p.ws.dtype} (float16 inputs already give an fp16 dz)")
    elif not accum_fp32 and need_dw:
        why = "it accumulates dW in fp32: grad_accum_dtype must be torch.float32"
    elif p.xs.is_cuda and not _interpret():
        try:
            from . import mixed_gemm
        except ImportError as e:  # a Triton without Gluon's Hopper API
            why = f"its GEMMs need Triton's Gluon ({e})"
        else:
            # the tensors' addresses are checked again in the op (_fwd_op): Dynamo cannot
            # trace data_ptr()
            if not mixed_gemm.supported(p.ws, p.xs,
                                        check_address=not torch.compiler.is_compiling()):
                why = ("its GEMMs need a Hopper GPU (compute capability 9.x) and bfloat16 "
                       "student weights and inputs with contiguous, 16-byte aligned rows "
                       "(H a multiple of 8)")
    if why is not None:
        if requested:
            raise ValueError(f"fp16_dz=True: {why}")
        return 0.0
    # by default only where our GEMMs run (the interpreter's fp32 products are for tests)
    on = grad_mode == FULL_GRAD and (bool(requested) or (p.xs.is_cuda and not _interpret()))
    return scale if on else 0.0


def _check_pow2(name, value, lo):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo
                              or value & (value - 1)):
        raise ValueError(f"{name} must be a power of 2 >= {lo}, got {value!r}")


def linear_jsd(p: jsd_common.Prepared, opts: spec.LinearJSDOptions, *, chunk_size=None,
               logits_chunk_size=None, memory_budget=None, fp32_logits=True,
               grad_accum_dtype=torch.float32, block_v=None, segment_size=None, num_warps=None,
               programs_per_sm=None, row_sync=None, dx_chunk_size=None, fp16_tile_logits=False,
               fp16_dz=None):
    """Returns the loss reduced per ``opts.reduction`` (flat ``(N,)`` for "none").

    Tuning (defaults in parentheses): ``chunk_size`` (None: from ``memory_budget``; tokens
    per dX/dW chunk; with ``fp16_dz`` and fp32 logits equal chunks in whole 1024s),
    ``logits_chunk_size`` (None: ``chunk_size / 4`` rounded down to a multiple of 128, ``/ 8``
    with ``fp16_dz`` and fp32 logits, ``/ 2`` without fp32 logits; tokens per logits GEMM and
    row-kernel launch), ``memory_budget`` (None: 896 MiB; bytes for the chunk buffers, which sets both
    when they are not given), ``fp32_logits`` (True; False: logits in the input dtype, faster
    and ~1e-2 less accurate), ``grad_accum_dtype`` (``torch.float32``, or the input dtype to
    save ``2·V·H`` bytes at some accuracy cost), ``block_v`` (None: 1024 on a GPU; row-kernel
    columns per step, a power of 2), ``segment_size`` (None: 8192 on a GPU; columns of a row
    per program, a multiple of ``block_v``), ``num_warps`` (None: 4),
    ``programs_per_sm`` (None: 2; persistent grid), ``row_sync`` (None or False: one launch
    per pass, the measured faster default; True: one fused launch with per-row barriers),
    ``dx_chunk_size`` (None: on a GPU with H >= 4096, the rows one wave of cuBLAS's
    256 x 128 output tiles covers, 1024 at H = 4096 on 132 SMs, else whole chunks; see
    ``common.dx_piece_rows``; rows per dX GEMM call: a chunk's dX in pieces of at most this
    many rows), ``fp16_tile_logits`` (False; None: True where it can run, i.e. bf16/fp16 inputs
    with fp32 logits on a Hopper-class GPU in layouts its TMA GEMM takes; True: the logits
    GEMMs are our TMA GEMM, which stores each logit in fp16 relative to the maximum of its
    row in its 256-column output tile (fp32, one per tile), half the bytes of fp32 logits at
    their accuracy for the gradients, and the JSD's pass 2 leaves Λ in fp16 for pass 3; an
    error where it cannot run; the student's logits then share dz's buffer, the chunks
    made from ``memory_budget`` are equal and ``logits_chunk_size`` defaults to
    ``chunk_size / 2`` rounded down to a multiple of 256 (2048 / 1024 at N = 8192,
    V = 128256). H200 at N = 8192, H = 4096, V = 128256: 0.93x the time of fp32 logits
    (1.23x the four-GEMM floor against 1.31x), 1.91 GB against 1.97, gradient errors within
    ~5% of theirs. Why it is opt-in:
    the loss itself comes out ~1e-5 relative off (per-token losses ~1e-4) instead of ~1e-7,
    and heads that nearly agree (a teacher within ~1e-3 of the student, self-distillation)
    lose their small difference to the rounding of each head: gradient errors 1e-2 to 4e-2
    where fp32 logits keep 2e-3). ``fp16_dz`` (None: True where it can run, i.e. bfloat16
    student inputs and weights, "mean"/"sum" with a gradient, fp32 weight-gradient
    accumulation, β < 1, on a Hopper GPU with aligned rows; True: an error where it cannot,
    except on the CPU's interpreter, where the GEMMs are fp32 products of the same operands;
    False: a bf16 dz): the student's logit gradient in fp16 times a power of two
    (:func:`_dz16_scale`) instead of bf16, its dX and dW GEMMs ours (:mod:`.mixed_gemm`,
    converting W_s and x_s to fp16 in registers); dX/dW errors 1.7e-3 against bf16 dz's
    2.2e-3 (the bf16 result's own rounding is 1.66e-3), at ~2.3 ms a call more on an H200 at
    N = 8192, H = 4096, V = 128256 (1.32x the four GEMMs against 1.29x; 1.25x against 1.22x
    with ``fp16_tile_logits``), in 1.91 GB; the student's logit gradient too small for fp16
    (a scale past 2^100, e.g. β/T below ~1e-26) keeps bf16 dz.
    """
    xs = p.xs
    for name, t in (("student_input", xs), ("teacher_input", p.xt)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"backend='triton' supports float32/bfloat16/float16 {name}, got "
                            f"{t.dtype}; use backend='torch' for float64")
    common.check_triton_device(xs, "student_input", "backend='triton'", _interpret())
    if not isinstance(fp32_logits, bool):
        raise TypeError(f"fp32_logits must be a bool, got {fp32_logits!r}")
    if fp16_tile_logits is not None and not isinstance(fp16_tile_logits, bool):
        raise TypeError(f"fp16_tile_logits must be None or a bool, got {fp16_tile_logits!r}")
    if fp16_tile_logits is None:
        fp16_tile_logits = _tiles_can_run(p, fp32_logits)
    elif fp16_tile_logits:
        if not fp32_logits:
            raise ValueError("fp16_tile_logits keeps fp32 logits' accuracy in 16 bits; it does "
                             "not combine with fp32_logits=False (logits rounded to the input "
                             "dtype)")
        for name, t in (("student_input", xs), ("teacher_input", p.xt)):
            if t.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"fp16_tile_logits needs bfloat16/float16 inputs (our TMA GEMM; "
                                 f"fp32 would run as TF32), got {name} {t.dtype}")
        for x, w, what in ((xs, p.ws, "student"), (p.xt, p.wt, "teacher")):
            why = logits_gemm.unsupported_layout(x, w, None)
            if why:
                raise ValueError(f"fp16_tile_logits: the {what} head's logits GEMM: {why}")
    if row_sync is not None and not isinstance(row_sync, bool):
        raise TypeError(f"row_sync must be None or a bool, got {row_sync!r}")
    if grad_accum_dtype not in (torch.float32, xs.dtype):
        raise ValueError(f"grad_accum_dtype must be torch.float32 or the input dtype {xs.dtype}, "
                         f"got {grad_accum_dtype!r}")
    _check_pow2("block_v", block_v, 16)
    if num_warps is not None and (not common.is_int(num_warps) or
                                  num_warps not in (1, 2, 4, 8, 16, 32)):
        raise ValueError(f"num_warps must be a power of 2 in [1, 32], got {num_warps!r}")
    if programs_per_sm is not None and (not common.is_int(programs_per_sm) or
                                        programs_per_sm < 1):
        raise ValueError(f"programs_per_sm must be a positive int, got {programs_per_sm!r}")
    n, v = p.problem.n, p.problem.v
    gpu = xs.is_cuda and not _interpret()
    dx_rows = common.check_dx_chunk_size(dx_chunk_size, xs)
    block = block_v or (GPU_BLOCK if gpu else 1024)
    block = min(block, max(16, next_power_of_2(v)))
    if segment_size is None:
        segment = GPU_SEGMENT if gpu else max(block, next_power_of_2(v))
    else:
        if not common.is_int(segment_size) or segment_size < 1:
            raise ValueError(f"segment_size must be a positive int, got {segment_size!r}")
        segment = segment_size
    segment = max(block, -(-segment // block) * block)  # whole blocks
    grid = 0
    if xs.is_cuda:
        sms = torch.cuda.get_device_properties(xs.device).multi_processor_count
        grid = sms * (programs_per_sm or GPU_PROGRAMS_PER_SM)
    need_dx = torch.is_grad_enabled() and xs.requires_grad
    need_dw = torch.is_grad_enabled() and p.ws.requires_grad
    grad_mode = FULL_GRAD if ((need_dx or need_dw) and opts.reduction != "none") else NO_GRAD
    dz_scale = _fp16_dz(fp16_dz, p, opts, grad_mode, grad_accum_dtype == torch.float32,
                        need_dw)
    chunk, sub = chunk_plan(n, v, xs.element_size(), fp32_logits, fp16_tile_logits,
                            memory_budget, chunk_size, logits_chunk_size, dz_scale > 0)
    y = p.y
    if y is not None and y.dtype not in (torch.int32, torch.int64):
        y = y.long()
    loss, _denom, _dxa, _dxb, _dwa, _dwb = _fwd_op(
        xs, p.ws, p.xt, p.wt, y, REDUCTIONS[opts.reduction], opts.beta, opts.temperature,
        opts.ignore_index, opts.hard_loss_weight, grad_mode, need_dx, need_dw, chunk, sub,
        LOGITS_TILES if fp16_tile_logits else LOGITS_FP32 if fp32_logits else LOGITS_INPUT,
        grad_accum_dtype == torch.float32, block, segment, num_warps or GPU_WARPS,
        grid, -1 if row_sync is None else int(row_sync), dx_rows, dz_scale)
    return loss
