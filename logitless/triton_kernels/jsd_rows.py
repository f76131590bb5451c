"""The fused JSD work on blocks of student and teacher logits, as one Triton kernel.

The GEMMs around it run through cuBLAS; this kernel is everything between them. For each row
(token) of a ``[rows, V]`` pair of logits buffers it computes the per-token loss of
:mod:`logitless.specs.linear_jsd` and, optionally, writes the student logit gradient dz into a
third buffer. With a = z_s/T, b = z_t/T, L_a / L_b their log-sum-exps, Q = e^(a − L_a):

1. stats: online Σexp of a and of b relative to the heads' *raw* maxima M_s = max z_s, M_t
   (log Q = (z_s − M_s)/T − log s_a: z − M is exact near the maximum, z/T − max z/T carries
   ulp(z/T), 1e-3 at T = 1e-3), the target logit (and the raw logits' normalizer for the
   hard-label term at T != 1), and the teacher-student normalizer gap c = L_b − L_a
   computed *accurately* while the heads are close: c = log1p(E_Q[expm1(d)]) with
   d = (z_t − z_s)/T, not as a difference of two O(10) log-sum-exps, whose rounding (~1e-6)
   would swamp a KL or JSD of nearly equal distributions (it is second order in their
   difference). Far-apart heads (some d > 30, or |L_b − L_a| ≥ 1, where the log1p form
   itself cancels) take c = (M_t − M_s)/T + log s_b − log s_a. For β ∈ {0, 1} the online
   Σ P·δ (or −Σ Q·δ) then gives the KL itself: no second pass;
2. (0 < β < 1 only) with δ = log P − log Q, per element log Q − log M = −Λ,
   Λ = log1p(β·expm1(δ)) (accurate for small δ), and the sums K = KL(Q‖M) = −Σ Q·Λ (taken
   as −Σ Q·Λ / Σ Q, so that the rounding of L_a that every Q carries cancels: the gradient
   below then sums to 0 over the row as it must) and J = Σ β·P·(δ − Λ) − (1−β)·Q·Λ;
3. the gradient, g·m·((1/T)·∂J/∂a + w_h·(S − onehot)), in dz's dtype:
   ∂J/∂a = −Q·expm1(δ) (forward KL), −Q·(δ + J) (reverse KL), −(1−β)·Q·(Λ + K) (JSD).

δ is d − c where the heads are close (d is exactly 0 where they agree, which z_t/T − z_s/T
under a fused multiply-add is not) and ((z_t − M_t) − (z_s − M_s))/T − (log s_b − log s_a)
where their normalizers lie far apart (a teacher a constant above the student: d − c would
cancel two terms of O(c)); the KL kinds' pass-1 sums are kept in both forms for that choice.
Pass 2 takes P from the teacher's own statistics where δ or c is large (log Q + δ would
cancel there).

Rows are split into ``SEGS`` segments of ``SEG`` columns, one program per (row, segment), so
that a program's segment (and its re-reads in passes 2 and 3) stays in its SM's L1/L2. A row's
segments meet through per-segment partials in global memory, two ways:

* ``PHASE = 0`` (fused): a persistent grid takes (row, segment) tickets from an atomic counter
  and the segments of a row wait for each other at per-row counters (release/acquire atomics)
  between the passes. Tickets are handed out in order, so at most one row is ever incomplete
  and the kernel cannot deadlock as long as ``SEGS`` programs can be resident at once; a wait
  that still exceeds ``MAX_SPIN`` polls poisons the row with NaN instead of hanging. With
  ``SEGS = 1`` there is nothing to wait for (and nothing goes through memory).
* ``PHASE = 1, 2, 3`` (one launch per pass): no waiting at all, at the cost of reading the
  row from memory once per pass. The Triton interpreter, which runs programs one after
  another, needs this for ``SEGS > 1``.

All math is fp32; loads are upcast at once (the Triton interpreter mis-computes bf16 math).
Exponentials are ``tl.exp``'s but with subnormal results flushed to 0 (:mod:`.fast_math`: one
``MUFU.EX2`` instead of six instructions); none of them needs a result under 2⁻¹²⁶. The
per-element logs (log1p past its polynomial) are ``lg2.approx`` (MUFU.LG2), as in the Pallas
kernels; the per-row ones stay libdevice's accurate logf.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..specs import linear_jsd as spec
from .fast_math import exp_ftz, log_approx
from .narrow_cast import round_bf16_bits
from .row_sync import wait_row as _wait_row

# Partial sums per (row, segment), fp32: pass-1 stats then the three pass-2 sums.
NUM_FIELDS = 14
_NF = tl.constexpr(NUM_FIELDS)
(F_MS, F_SA, F_MT, F_SB, F_U, F_MD, F_W, F_WF, F_MZ, F_SZ, F_ZY, F_K,
 F_J, F_QS) = (tl.constexpr(i) for i in range(NUM_FIELDS))
KIND_FORWARD_KL, KIND_REVERSE_KL, KIND_JSD = 0, 1, 2
# The thresholds of the accurate forms, shared with the JAX kernels (see the spec): FAR (b − a
# beyond which expm1 would overflow and c = L_b − L_a, Λ = log β + δ are exact enough), SMALL
# (the Taylor-polynomial range of expm1 / log1p), GAP (|L_b − L_a| from which c is the plain
# difference: log1p(E_Q[expm1(b − a)]) cancels when E_Q[·] = e^c − 1 is near −1).
FAR = tl.constexpr(spec.FAR)
EXPM1_MAX = tl.constexpr(spec.EXPM1_MAX)
SMALL = tl.constexpr(spec.SMALL)
GAP = tl.constexpr(spec.GAP)


@triton.jit
def _tile_offsets(o_row, start, limit, other, TILE_W: tl.constexpr, BLOCK: tl.constexpr):
    """The offsets of the BLOCK / TILE_W tiles of the block at ``start`` (a multiple of
    TILE_W), ``other`` for tiles from ``limit`` on."""
    first = start + tl.arange(0, BLOCK // TILE_W) * TILE_W
    return tl.load(o_row + first // TILE_W, mask=first < limit, other=other)


@triton.jit
def _load_logits(row, o_row, start, cols, lmask, col1_load, TILE_W: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One head's raw logits (fp32) of the block at ``start`` where ``lmask``; ``TILE_W`` > 0:
    stored as fp16 z − o relative to the maximum o of their ``TILE_W``-column GEMM tile
    (``o_row``: the row's fp32 offsets, see ``logits_gemm.logits_tile_offsets``). A block of
    whole tiles (blocks start at multiples of BLOCK) loads its BLOCK / TILE_W offsets once and
    broadcasts them: one load per element, as a gather, was one LDG per element (ptxas does
    not merge equal addresses)."""
    z = tl.load(row + cols, mask=lmask, other=0.0).to(tl.float32)
    if TILE_W > 0:
        if BLOCK >= TILE_W:
            NT: tl.constexpr = BLOCK // TILE_W
            o = _tile_offsets(o_row, start, col1_load, 0.0, TILE_W, BLOCK)
            z += tl.reshape(tl.broadcast_to(o[:, None], (NT, TILE_W)), (BLOCK,))
        else:
            z += tl.load(o_row + cols // TILE_W, mask=lmask, other=0.0)
    return z


@triton.jit
def _block_max(z, cmask, o_row, start, col1, TILE_W: tl.constexpr, BLOCK: tl.constexpr):
    """The maximum of one head's logits over the block's live columns. Stored as tile offsets
    that is the largest offset of the block's tiles, bit for bit: a tile's maximum was stored
    as z − o = 0 and every other element as a remainder <= 0, so each o is its tile's maximum
    as loaded; no cross-warp reduction over the block then (a block of whole tiles)."""
    if TILE_W > 0 and BLOCK >= TILE_W:
        return tl.max(_tile_offsets(o_row, start, col1, -float("inf"), TILE_W, BLOCK), 0)
    else:
        return tl.max(tl.where(cmask, z, -float("inf")), 0)


@triton.jit
def _load_block(s_row, t_row, start, cols, lmask, col1_load, inv_t, so_row, to_row,
                TILE_W: tl.constexpr, BLOCK: tl.constexpr):
    """The raw logits z_s, z_t (fp32) and d = (z_t − z_s)/T, loaded where ``lmask``: it may
    reach into the rows' padding (see ``common.load_cols``), junk the callers mask. d is the
    difference scaled, not z_t/T − z_s/T: with the multiply fused into the subtraction (an
    FMA, as the GPU compiles it) that is z_t·(1/T) − round(z_s·(1/T)), the rounding residual
    of z/T where the heads are equal, not 0 (a JSD of equal heads at T = 0.3 had come out
    1e-6, with gradients to match). Equal heads stored as tile offsets stay equal (same
    tile maxima, same fp16 remainders); nearly equal ones do not keep their difference
    (each head is rounded on its own), which is why fp16 tiles are opt-in."""
    if TILE_W > 0:
        zs = _load_logits(s_row, so_row, start, cols, lmask, col1_load, TILE_W, BLOCK)
        zt = _load_logits(t_row, to_row, start, cols, lmask, col1_load, TILE_W, BLOCK)
    else:  # inline: each helper call costs the interpreted kernels (CI) ~10%
        zs = tl.load(s_row + cols, mask=lmask, other=0.0).to(tl.float32)
        zt = tl.load(t_row + cols, mask=lmask, other=0.0).to(tl.float32)
    return zs, zt, (zt - zs) * inv_t


@triton.jit
def _expm1(x):
    """e^x − 1 to a few ulps relative, also for small |x| (x <= FAR: no overflow)."""
    small = tl.abs(x) < SMALL
    t = tl.where(small, x, 0.0)  # the polynomial only ever sees small arguments
    p = t * (1.0 + t * (0.5 + t * (1.0 / 6.0 + t * (1.0 / 24.0 + t * (1.0 / 120.0 +
                                                                       t * (1.0 / 720.0))))))
    return tl.where(small, p, exp_ftz(x) - 1.0)


@triton.jit
def _log1p(y, FAST: tl.constexpr = False):
    """log(1 + y) to a few ulps relative, also for small |y| (y > −1); ``FAST``: past the
    polynomial, :func:`.fast_math.log_approx` (per-element calls: libdevice's logf would be
    ~25 instructions; ~20 ulps at |y| = 0.1 instead of 1) instead of ``tl.log``."""
    small = tl.abs(y) < SMALL
    t = tl.where(small, y, 0.0)
    p = t * (1.0 - t * (0.5 - t * (1.0 / 3.0 - t * (0.25 - t * (0.2 - t * (1.0 / 6.0 -
                                                                          t * (1.0 / 7.0)))))))
    if FAST:
        return tl.where(small, p, log_approx(1.0 + y))
    return tl.where(small, p, tl.log(1.0 + y))


@triton.jit
def _online(m, s, x):
    """Fold a block of exponents x (masked lanes -inf) into a running max / Σe^(x−m)."""
    m_new = tl.maximum(m, tl.max(x, 0))
    s = s * exp_ftz(m - m_new) + tl.sum(exp_ftz(x - m_new), 0)
    return m_new, s


@triton.jit
def _max_shift(ms_old, ms_new, mt_old, mt_new, seen, inv_t):
    """How much the far-form KL terms ((z_t − M_t) − (z_s − M_s))/T of the columns summed so
    far drop when the raw maxima move from old to new; 0 before any live column (``seen`` 0,
    maxima −inf; ``seen`` > 0 once one was summed: a 0/1 flag, or a segment's Σ e^(…)). See
    ``_jax_jsd.max_shift``."""
    ms_old = tl.where(seen > 0, ms_old, ms_new)  # no inf − inf computed (and discarded)
    mt_old = tl.where(seen > 0, mt_old, mt_new)
    return ((mt_new - mt_old) - (ms_new - ms_old)) * inv_t


@triton.jit
def _seg_stats(s_row, t_row, so_row, to_row, col0, col1, col1_load, y_local, inv_t,
               KIND: tl.constexpr, HARD: tl.constexpr, T_ONE: tl.constexpr, BLOCK: tl.constexpr,
               STAGES: tl.constexpr, TILE_W: tl.constexpr):
    """Pass 1 over columns [col0, col1): (M_s, s_a, M_t, s_b, u, md, w, w_far, m_z, s_z, z_y)
    with M_s, M_t the heads' raw maxima, s_a = Σ e^((z_s − M_s)/T) (s_b likewise),
    u = Σ e^((z_s−M_s)/T)·expm1(d), md = max d, for the KL kinds the row KL's sums in both
    forms (``_finish_stats`` picks one): w = Σ e^((z_t−M_t)/T)·d (forward KL) or
    −Σ e^((z_s−M_s)/T)·d (reverse KL), w_far the same with ±((z_t − M_t) − (z_s − M_s))/T for
    d; z_y the target's raw logit (0 when it is elsewhere)."""
    offs = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
    ms = zero - float("inf")
    mt = zero - float("inf")
    m_z = zero - float("inf")
    s_z = zero
    # The sums are kept per lane and reduced once at the end: a cross-warp reduction per block
    # and sum cost ~3 instructions per element (one here). Only the maxima, which every
    # exponent of the block needs, are reduced per block (and the hard-label normalizer's
    # online sum at T != 1, a rare path).
    lane = tl.zeros([BLOCK], dtype=tl.float32)
    s_a = lane
    s_b = lane
    u = lane
    md = lane - float("inf")
    w = lane
    wf = lane
    z_y = lane
    for start in tl.range(col0, col1, BLOCK, num_stages=STAGES):
        cols = start + offs
        cmask = cols < col1
        zs, zt, d = _load_block(s_row, t_row, start, cols, cols < col1_load, col1_load, inv_t,
                                so_row, to_row, TILE_W, BLOCK)
        d = tl.where(cmask, d, 0.0)
        if TILE_W > 0:  # else inline, as in _load_block (interpreted helper calls cost CI)
            ms_new = tl.maximum(ms, _block_max(zs, cmask, so_row, start, col1, TILE_W, BLOCK))
            mt_new = tl.maximum(mt, _block_max(zt, cmask, to_row, start, col1, TILE_W, BLOCK))
        else:
            ms_new = tl.maximum(ms, tl.max(tl.where(cmask, zs, -float("inf")), 0))
            mt_new = tl.maximum(mt, tl.max(tl.where(cmask, zt, -float("inf")), 0))
        xa = (zs - ms_new) * inv_t  # exponents relative to the raw maxima
        xb = (zt - mt_new) * inv_t
        ra = exp_ftz((ms - ms_new) * inv_t)
        rb = exp_ftz((mt - mt_new) * inv_t)
        ea = tl.where(cmask, exp_ftz(xa), 0.0)
        eb = tl.where(cmask, exp_ftz(xb), 0.0)
        u = u * ra + ea * _expm1(tl.minimum(d, FAR))
        md = tl.maximum(md, tl.where(cmask, d, -float("inf")))
        # a live column seen before this block (the sums of _max_shift's rule are per lane)
        seen = tl.where(ms > -float("inf"), 1.0, 0.0)
        if KIND == 0:   # forward KL: Σ P·δ, weights of the teacher
            shift = _max_shift(ms, ms_new, mt, mt_new, seen, inv_t)
            w = w * rb + eb * d
            wf = (wf - s_b * shift) * rb + tl.where(cmask, eb * (xb - xa), 0.0)
        elif KIND == 1:  # reverse KL: −Σ Q·δ, weights of the student
            shift = _max_shift(ms, ms_new, mt, mt_new, seen, inv_t)
            w = w * ra - ea * d
            wf = (wf + s_a * shift) * ra - tl.where(cmask, ea * (xb - xa), 0.0)
        s_a = s_a * ra + ea
        s_b = s_b * rb + eb
        ms = ms_new
        mt = mt_new
        if HARD:
            if not T_ONE:
                m_z, s_z = _online(m_z, s_z, tl.where(cmask, zs, -float("inf")))
            z_y += tl.where(cols == y_local, zs, 0.0)
    return (ms, tl.sum(s_a, 0), mt, tl.sum(s_b, 0), tl.sum(u, 0), tl.max(md, 0), tl.sum(w, 0),
            tl.sum(wf, 0), m_z, s_z, tl.sum(z_y, 0))


@triton.jit
def _finish_stats(ms, s_a, mt, s_b, u, md, w, wf, inv_t, KIND: tl.constexpr):
    """A row's (log s_a, log s_b, log s_b − log s_a, c, near, w·) from its merged pass-1 sums
    (the difference as ±log1p(larger / smaller − 1): the GPU's logs of two O(1-10) sums leave
    ~1e-7 in it, 20x the naive error of a small KL in far rows on the H100): c = L_b − L_a as
    log1p(E_Q[expm1(d)]) while the heads are close (``near``, the spec's rule: not where both
    are saturated and c is past the log1p polynomial), else the difference (of the
    raw maxima and of the log-sums apart); w· the row's Σ P·d (forward KL) or −Σ Q·d (reverse
    KL) where near, else the far form's (see ``_row_offsets``), 0 for JSD. Normalized by the
    sums themselves: e^(m − L) would carry L's rounding, which the reverse KL's gradient
    −Q·(δ + KL) then fails to cancel."""
    ls_a = tl.log(s_a)
    ls_b = tl.log(s_b)
    # the smaller sum divides: (s_b − s_a)/s_a → −1 where s_b ≪ s_a (a sharp teacher beside a
    # flat student) and the log1p of it keeps only ulp(1)/(s_b/s_a) (9e-5 at a ratio of 1e-3)
    lsd = tl.where(s_b >= s_a, _log1p((s_b - s_a) / s_a), -_log1p((s_a - s_b) / s_b))
    gap = (mt - ms) * inv_t + lsd
    saturated = (s_a < 1.0 + SMALL) & (s_b < 1.0 + SMALL) & (tl.abs(gap) >= SMALL)
    near = (md < FAR) & (tl.abs(gap) < GAP) & (~saturated)  # the spec's rule, by SMALL
    c = tl.where(near, _log1p(u / s_a), gap)
    w_row = ms * 0.0
    if KIND == 0:
        w_row = tl.where(near, w, wf) / s_b
    elif KIND == 1:
        w_row = tl.where(near, w, wf) / s_a
    return ls_a, ls_b, lsd, c, near, w_row


@triton.jit
def _row_offsets(ms, mt, lsd, c, near):
    """(A, B, C) with δ = log P − log Q = ((z_t − A) − (z_s − B))/T − C: (0, 0, c) where the
    heads are close (z_t − z_s is exact where they agree, c the accurate gap), (M_t, M_s,
    log s_b − log s_a) where their normalizers lie far apart, where (z_t − z_s)/T − c would
    cancel two terms of O(c) (a teacher a constant above the student). See
    ``_jax_jsd.row_offsets``."""
    return tl.where(near, 0.0, mt), tl.where(near, 0.0, ms), tl.where(near, c, lsd)


@triton.jit
def _log_ratio(zs, zt, oa, ob, oc, inv_t):
    """δ = log P − log Q per element (offsets from ``_row_offsets``)."""
    return ((zt - oa) - (zs - ob)) * inv_t - oc


@triton.jit
def _log_q(z, m, ls, inv_t):
    """log softmax(z/T) = (z − max z)/T − log s, from the raw maximum: not z/T − L, as L ≈
    max z/T is O(10) at a confident head (O(|z|/T) at a low T), and its rounding would be a
    factor on every Q, while z − max z is exact at the maximum and log s, the log of a sum
    >= 1, is small there (the split log_softmax makes). Also log P, from the teacher's."""
    return (z - m) * inv_t - ls


@triton.jit
def _load_field(part, field, segs_idx, smask, other):
    return tl.load(part + segs_idx * _NF + field, mask=smask, other=other,
                   cache_modifier=".cg")


@triton.jit
def _combine_stats(part, segs_idx, smask, inv_t, KIND: tl.constexpr, HARD: tl.constexpr,
                   T_ONE: tl.constexpr):
    """A row's (M_s, log s_a, M_t, log s_b, c, near, w·, L_z, z_y) from its segments' pass-1
    partials (see ``_finish_stats``)."""
    ms_p = _load_field(part, F_MS, segs_idx, smask, -float("inf"))
    s_a = _load_field(part, F_SA, segs_idx, smask, 0.0)
    mt_p = _load_field(part, F_MT, segs_idx, smask, -float("inf"))
    s_b = _load_field(part, F_SB, segs_idx, smask, 0.0)
    u = _load_field(part, F_U, segs_idx, smask, 0.0)
    ms = tl.max(ms_p, 0)
    mt = tl.max(mt_p, 0)
    ka = exp_ftz((ms_p - ms) * inv_t)
    kb = exp_ftz((mt_p - mt) * inv_t)
    md = tl.max(_load_field(part, F_MD, segs_idx, smask, -float("inf")), 0)
    w = ms * 0.0
    wf = w
    if KIND == 0:
        w = tl.sum(_load_field(part, F_W, segs_idx, smask, 0.0) * kb, 0)
        wf = tl.sum((_load_field(part, F_WF, segs_idx, smask, 0.0) -
                     s_b * _max_shift(ms_p, ms, mt_p, mt, s_b, inv_t)) * kb, 0)
    elif KIND == 1:
        w = tl.sum(_load_field(part, F_W, segs_idx, smask, 0.0) * ka, 0)
        wf = tl.sum((_load_field(part, F_WF, segs_idx, smask, 0.0) +
                     s_a * _max_shift(ms_p, ms, mt_p, mt, s_a, inv_t)) * ka, 0)
    ls_a, ls_b, lsd, c, near, w_row = _finish_stats(ms, tl.sum(s_a * ka, 0), mt,
                                                    tl.sum(s_b * kb, 0), tl.sum(u * ka, 0),
                                                    md, w, wf, inv_t, KIND)
    l_z = ms * inv_t + ls_a
    z_y = ms * 0.0
    if HARD:
        z_y = tl.sum(_load_field(part, F_ZY, segs_idx, smask, 0.0), 0)
        if not T_ONE:
            m_z = _load_field(part, F_MZ, segs_idx, smask, -float("inf"))
            mz = tl.max(m_z, 0)
            l_z = mz + tl.log(tl.sum(_load_field(part, F_SZ, segs_idx, smask, 0.0) *
                                     exp_ftz(m_z - mz), 0))
    return ms, ls_a, mt, ls_b, lsd, c, near, w_row, l_z, z_y


@triton.jit
def _far(beta, omb, FORM: tl.constexpr):
    """spec.far_delta(β): δ beyond which Λ = log β + δ and log P/M = −log β to fp32."""
    if FORM == 1:
        return FAR
    else:
        # tensor first: constexpr + tensor would wrap the sum in a constexpr (interpreter)
        return tl.maximum(tl.log(omb) - tl.log(beta), 0.0) + FAR


@triton.jit
def _jsd_terms(lq, delta, beta, omb, FORM: tl.constexpr):
    """Per element (0 < β < 1): Q and Λ = log M − log Q from log Q and δ = log P − log Q.
    ``FORM``: spec.beta_form(β), a compile-time switch."""
    q = exp_ftz(lq)
    far = _far(beta, omb, FORM)
    lb = tl.log(beta)
    if FORM == 2:  # β < TINY_BETA: far passes EXPM1_MAX, β·expm1(δ) would overflow there
        u = delta + lb
        l1b = _log1p(-beta)
        hi = tl.maximum(u, l1b)
        mid = hi + _log1p(exp_ftz(tl.minimum(u, l1b) - hi), True)
        lam = tl.where(delta > far, u, tl.where(
            delta > EXPM1_MAX, mid, _log1p(beta * _expm1(tl.minimum(delta, EXPM1_MAX)), True)))
    else:
        lam = tl.where(delta > far, lb + delta,
                       _log1p(beta * _expm1(tl.minimum(delta, far)), True))
    if FORM == 1:  # β > spec.HIGH_BETA
        # log(β·e^δ + 1 − β) for δ < −1, where 1 − β carries it: as a logaddexp of log(1 − β)
        # from the host's 1 − β (in fp32, β·expm1(δ) would make it 1 − fp32(β))
        u = _log1p(-omb) + delta
        v = tl.log(omb)
        hi = tl.maximum(u, v)
        lam = tl.where(delta < -1.0, hi + _log1p(exp_ftz(tl.minimum(u, v) - hi), True), lam)
    return q, lam


@triton.jit
def _log_p_over_m(delta, lam, beta, omb, FORM: tl.constexpr):
    """log P − log M. As δ − Λ it cancels beyond ``_far`` (Λ = log β + δ there: only ulp(δ)
    would be left), which takes the limit −log β, and as β → 1 (it tends to 0 with
    1 − β = ``omb``): for β > HIGH_BETA (``FORM`` 1, compile-time) −log1p((1−β)·expm1(−δ)),
    or −logaddexp(log β, log(1−β) − δ) where −δ > FAR."""
    if FORM == 1:
        nd = -delta
        lb = _log1p(-omb)
        lo = tl.log(omb) + nd
        hi = tl.maximum(lb, lo)
        far = hi + _log1p(exp_ftz(tl.minimum(lb, lo) - hi), True)
        r = -tl.where(nd > FAR, far, _log1p(omb * _expm1(tl.minimum(nd, FAR)), True))
    else:
        r = tl.where(delta > _far(beta, omb, FORM), -tl.log(beta), delta - lam)
    return r


@triton.jit
def _lam_encode(lam, lo):
    """Λ for its 16-bit slot, and Λ as pass 3 will decode it: fp16 of Λ where Λ >= lo/2, of
    Λ − lo below (lo = log(1 − β) <= Λ: the value where P ≪ Q), the choice in the mantissa's
    lowest bit. Where Q is large the gradient takes Λ + K, and −K, a Q-weighted mean of Λ,
    lies in [lo, 0]: Λ stored as is kept ulp(|lo|) beside that cancellation, which doubled
    the gradient errors at T < 1 with dissimilar heads (P ≪ Q where Q is large, Λ ≈ −K ≈ lo);
    stored relative to the nearer end it keeps ~10 bits of the small difference from it,
    and the heads' nearly equal case (Λ ≈ 0) keeps its precision
    (``benchmarks/jsd_logit_storage_probe.py``, ``+lamsplit``). Past fp16's range (the far
    form's Λ = log β + δ, where Q underflows): saturated, not inf (0·inf = NaN); where(),
    not minimum(), which drops NaN on a GPU."""
    # Clearing the bit after rounding moves |Λ − end| toward 0 by up to one 10-bit ulp, a
    # bias; harmless here: K sums the same decoded values and the loss takes fp32 Λ, so no
    # plain sum keeps it (a stored *logit* so rounded biased the loss: the probe's -choice)
    upper = lam < 0.5 * lo
    s = tl.where(upper, lam - lo, lam)
    cleared = tl.where(s > 65504.0, 65504.0, s).to(tl.float16).to(tl.int16, bitcast=True) & -2
    # what _lam_decode gives for these bits, from the choice at hand (no second unpacking)
    back = cleared.to(tl.float16, bitcast=True).to(tl.float32) + tl.where(upper, lo, 0.0)
    return (cleared | upper.to(tl.int16)).to(tl.float16, bitcast=True), back


@triton.jit
def _lam_decode(bits, lo):
    """Λ (fp32) from the int16 bits of :func:`_lam_encode`'s slot."""
    low = (bits & -2).to(tl.float16, bitcast=True).to(tl.float32)
    return low + tl.where((bits & 1) != 0, lo, 0.0)


@triton.jit
def _seg_jsd_sums(s_row, t_row, so_row, to_row, col0, col1, col1_load, inv_t, ms, ls_a, mt,
                  ls_b, c, oa, ob, oc, beta, omb, FORM: tl.constexpr, BLOCK: tl.constexpr,
                  STAGES: tl.constexpr, TILE_W: tl.constexpr, KEEP_LAM: tl.constexpr):
    """Pass 2 (0 < β < 1) over [col0, col1): −Σ Q·Λ and Σ Q (K is their ratio: Q carries the
    rounding of L_a as a factor common to the row, which K must not; see
    ``_jax_jsd.jsd_k``) and Σ β·P·log(P/M) − (1−β)·Q·Λ (→ J); ``omb`` = 1 − β, computed on
    the host (in fp32, 1 − β would lose it as β → 1). With tile offsets (``TILE_W`` > 0) and
    a gradient to write (``KEEP_LAM``) each Λ also goes, in 16 bits (:func:`_lam_encode`),
    over the teacher's logit it came from (read only here): pass 3 then reads Λ instead of
    recomputing it, at the same bytes; K then sums the stored Λ, as pass 3 uses it (J keeps
    fp32 Λ)."""
    offs = tl.arange(0, BLOCK)
    if KEEP_LAM:
        lo = tl.log(omb)  # log(1 − β), the lower end of Λ (1 − β from the host, see above)
    k = tl.zeros([BLOCK], dtype=tl.float32)  # per lane, reduced at the end (see _seg_stats)
    j = k
    qs = k
    for start in tl.range(col0, col1, BLOCK, num_stages=STAGES):
        cols = start + offs
        cmask = cols < col1
        lmask = cols < col1_load
        zs, zt, _ = _load_block(s_row, t_row, start, cols, lmask, col1_load, inv_t, so_row,
                                to_row, TILE_W, BLOCK)
        lq = _log_q(zs, ms, ls_a, inv_t)
        delta = _log_ratio(zs, zt, oa, ob, oc, inv_t)
        q, lam = _jsd_terms(lq, delta, beta, omb, FORM)
        qlam = q * lam
        qlam_k = qlam
        if KEEP_LAM:
            # K from the Λ pass 3 will read (as stored), so that the row's gradient
            # Q·(Λ + K) still sums to 0: with K from fp32 Λ each element's rounding would
            # stay in it, times 1/T (T = 0.01 gave garbage)
            lam16, lam_read = _lam_encode(lam, lo)
            tl.store(t_row + cols, lam16, mask=lmask)
            qlam_k = q * lam_read
        # P as Q·e^δ where the heads are close (consistent with δ), else from the teacher's
        # own statistics: log Q + δ cancels two terms of O(|z|/T) or O(|c|) where δ or the
        # normalizer gap c is large (one exp either way)
        p = exp_ftz(tl.where(tl.maximum(tl.abs(delta), tl.abs(c)) < 1.0, lq + delta,
                            _log_q(zt, mt, ls_b, inv_t)))
        k -= tl.where(cmask, qlam_k, 0.0)
        qs += tl.where(cmask, q, 0.0)
        lpm = _log_p_over_m(delta, lam, beta, omb, FORM)
        j += tl.where(cmask, beta * p * lpm - omb * qlam, 0.0)
    return tl.sum(k, 0), tl.sum(j, 0), tl.sum(qs, 0)


@triton.jit
def _seg_grad(s_row, t_row, so_row, to_row, dz_row, col0, col1_load, y_local, inv_t, ms, ls_a,
              mt, ls_b, oa, ob, oc, l_z, kk, beta, omb, coef, hard_coef, poison,
              KIND: tl.constexpr, HARD: tl.constexpr, T_ONE: tl.constexpr,
              ROUND_BF16: tl.constexpr, FORM: tl.constexpr, BLOCK: tl.constexpr,
              STAGES: tl.constexpr, TILE_W: tl.constexpr):
    """Pass 3 over [col0, col1_load): dz = coef·∂J/∂a + hard_coef·(S − [v = y]) (+ poison),
    with coef = g·m/T, hard_coef = g·m·w_h, kk the row's KL (reverse KL) or K (JSD); the
    JSD's Λ read from the teacher's buffer where pass 2 left it (``TILE_W`` > 0)."""
    offs = tl.arange(0, BLOCK)
    if KIND == 2 and TILE_W > 0:
        lo = tl.log(omb)  # log(1 − β): see _lam_encode (1 − β = 0 for the KL kinds)
    for start in tl.range(col0, col1_load, BLOCK, num_stages=STAGES):
        cols = start + offs
        lmask = cols < col1_load  # the padding too: junk there, read by no GEMM
        if KIND == 2 and TILE_W > 0:
            zs = _load_logits(s_row, so_row, start, cols, lmask, col1_load, TILE_W, BLOCK)
            lq = _log_q(zs, ms, ls_a, inv_t)
        else:
            zs, zt, _ = _load_block(s_row, t_row, start, cols, lmask, col1_load, inv_t, so_row,
                                    to_row, TILE_W, BLOCK)
            lq = _log_q(zs, ms, ls_a, inv_t)
            delta = _log_ratio(zs, zt, oa, ob, oc, inv_t)
        if KIND == 0:
            q = exp_ftz(lq)
            # Q − P: as −Q·expm1(δ) where P ≈ Q (no cancellation); elsewhere P from the
            # teacher's own statistics (e^(lq + δ) would add the rounding of δ)
            g = tl.where(tl.abs(delta) < SMALL, -q * _expm1(delta),
                         q - exp_ftz(_log_q(zt, mt, ls_b, inv_t)))
        elif KIND == 1:
            q = exp_ftz(lq)
            g = -q * (delta + kk)
        else:
            if TILE_W > 0:
                q = exp_ftz(lq)
                lam = _lam_decode(tl.load(t_row + cols, mask=lmask, other=0.0)
                                  .to(tl.int16, bitcast=True), lo)
            else:
                q, lam = _jsd_terms(lq, delta, beta, omb, FORM)
            g = -omb * q * (lam + kk)
        dz = coef * g
        if HARD:
            if T_ONE:
                sv = q
            else:
                sv = exp_ftz(zs - l_z)
            dz += hard_coef * (sv - tl.where(cols == y_local, 1.0, 0.0))
        dz += poison
        if ROUND_BF16:
            dz = round_bf16_bits(dz)
        tl.store(dz_row + cols, dz.to(dz_row.dtype.element_ty), mask=lmask)


@triton.jit
def _zero_seg(dz_row, col0, col1, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(col0, col1, BLOCK):
        cols = start + offs
        tl.store(dz_row + cols, tl.zeros([BLOCK], dtype=tl.float32).to(dz_row.dtype.element_ty),
                 mask=cols < col1)


@triton.jit
def _row_segment(row, seg, s_ptr, s_stride, t_ptr, t_stride, dz_ptr, dz_stride, y_ptr, g_ptr,
                 g_stride, loss_ptr, part_ptr, sync_ptr, so_ptr, to_ptr, o_stride, V, V_LOAD,
                 ignore_index, inv_t, beta, omb, hard_w, KIND: tl.constexpr,
                 HAS_Y: tl.constexpr, HARD: tl.constexpr,
                 T_ONE: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
                 PHASE: tl.constexpr, SEGS: tl.constexpr, SEGS_P2: tl.constexpr,
                 SEG: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr,
                 MAX_SPIN: tl.constexpr, FORM: tl.constexpr, STAGES: tl.constexpr,
                 TILE_W: tl.constexpr):
    row64 = tl.cast(row, tl.int64)
    s_row = s_ptr + row64 * s_stride
    t_row = t_ptr + row64 * t_stride
    so_row = so_ptr + row64 * o_stride  # tile offsets (TILE_W > 0), else never read
    to_row = to_ptr + row64 * o_stride
    dz_row = dz_ptr + row64 * dz_stride
    col0 = seg * SEG
    col1 = tl.minimum(col0 + SEG, V)
    col1_load = tl.minimum(col0 + SEG, V_LOAD)  # a multiple of 16 where the rows are padded
    if HAS_Y:
        y = tl.load(y_ptr + row64).to(tl.int64)
        keep = y != ignore_index
        bad = keep & ((y < 0) | (y >= V))   # out of range: poisoned below, never read
        y_local = tl.where(keep & (~bad), y, -1)
    else:
        keep = row >= 0
        bad = row < 0
        y_local = tl.cast(row * 0 - 1, tl.int64)
    part = part_ptr + row64 * (SEGS * _NF)
    segs_idx = tl.arange(0, SEGS_P2)
    smask = segs_idx < SEGS
    sync = SEGS > 1 and PHASE == 0
    if keep:
        zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
        ok = zero == 0.0
        # ---------------------------------------------------------------- pass 1
        if PHASE <= 1:
            ms, s_a, mt, s_b, u, md, w, wf, m_z, s_z, z_y = _seg_stats(
                s_row, t_row, so_row, to_row, col0, col1, col1_load, y_local, inv_t, KIND, HARD,
                T_ONE, BLOCK, STAGES, TILE_W)
            if SEGS > 1:
                p = part + seg * _NF
                tl.store(p + F_MS, ms)
                tl.store(p + F_SA, s_a)
                tl.store(p + F_MT, mt)
                tl.store(p + F_SB, s_b)
                tl.store(p + F_U, u)
                tl.store(p + F_MD, md)
                tl.store(p + F_W, w)
                tl.store(p + F_WF, wf)
                tl.store(p + F_MZ, m_z)
                tl.store(p + F_SZ, s_z)
                tl.store(p + F_ZY, z_y)
        if sync:
            ok = ok & _wait_row(sync_ptr + 2 + row64, sync_ptr + 1, SEGS, MAX_SPIN)
        if PHASE != 1:
            if SEGS > 1:
                ms, ls_a, mt, ls_b, lsd, c, near, w_row, l_z, z_y_row = _combine_stats(
                    part, segs_idx, smask, inv_t, KIND, HARD, T_ONE)
            else:
                ls_a, ls_b, lsd, c, near, w_row = _finish_stats(ms, s_a, mt, s_b, u, md, w,
                                                                wf, inv_t, KIND)
                z_y_row = z_y
                l_z = ms * inv_t + ls_a
                if HARD:
                    if not T_ONE:
                        l_z = m_z + tl.log(s_z)
            oa, ob, oc = _row_offsets(ms, mt, lsd, c, near)
            # ------------------------------------------------------------ pass 2
            kk = zero
            jj = zero
            if KIND == 2:
                if PHASE != 3:
                    k_seg, j_seg, q_seg = _seg_jsd_sums(s_row, t_row, so_row, to_row, col0, col1,
                                                        col1_load, inv_t, ms, ls_a, mt, ls_b, c,
                                                        oa, ob, oc, beta, omb, FORM, BLOCK,
                                                        STAGES, TILE_W, TILE_W > 0 and WRITE_GRAD)
                    if TILE_W > 0 and PHASE == 0:
                        tl.debug_barrier()  # pass 3 of this program reads the Λ it stored
                    if SEGS > 1:
                        tl.store(part + seg * _NF + F_K, k_seg)
                        tl.store(part + seg * _NF + F_J, j_seg)
                        tl.store(part + seg * _NF + F_QS, q_seg)
                    else:
                        kk = k_seg / q_seg
                        jj = j_seg
                if sync:
                    ok = ok & _wait_row(sync_ptr + 2 + row64, sync_ptr + 1, 2 * SEGS,
                                        MAX_SPIN)
                if PHASE != 2:
                    if SEGS > 1:
                        kk = tl.sum(_load_field(part, F_K, segs_idx, smask, 0.0), 0) / \
                            tl.sum(_load_field(part, F_QS, segs_idx, smask, 0.0), 0)
                        jj = tl.sum(_load_field(part, F_J, segs_idx, smask, 0.0), 0)
            elif KIND == 0:
                jj = w_row - oc              # KL(P‖Q) = Σ P·δ (see _finish_stats)
            else:
                jj = w_row + oc              # KL(Q‖P) = −Σ Q·δ
                kk = jj
            # ------------------------------------------------------------ pass 3
            if PHASE != 2:
                nan = tl.where(ok & (~bad), 0.0, float("nan"))
                if WRITE_LOSS:
                    if seg == 0:
                        loss = jj
                        if HARD:
                            loss += hard_w * (l_z - z_y_row)
                        tl.store(loss_ptr + row64, loss + nan)
                if WRITE_GRAD:
                    g = tl.load(g_ptr + row64 * g_stride).to(tl.float32)
                    _seg_grad(s_row, t_row, so_row, to_row, dz_row, col0, col1_load, y_local,
                              inv_t, ms, ls_a, mt, ls_b, oa, ob, oc, l_z, kk, beta, omb,
                              g * inv_t, g * hard_w, nan, KIND, HARD, T_ONE, ROUND_BF16, FORM,
                              BLOCK, STAGES, TILE_W)
    else:
        if PHASE == 0 or PHASE == 3:
            if WRITE_LOSS:
                if seg == 0:
                    tl.store(loss_ptr + row64, tl.where(bad, float("nan"), 0.0))
            if WRITE_GRAD:
                _zero_seg(dz_row, col0, col1_load, BLOCK)


@triton.jit
def jsd_rows_kernel(
    s_ptr, s_stride, t_ptr, t_stride, dz_ptr, dz_stride,
    y_ptr, g_ptr, g_stride, loss_ptr, part_ptr, sync_ptr, so_ptr, to_ptr, o_stride,
    n_rows, V, V_LOAD, ignore_index, inv_t, beta, omb, hard_w,
    KIND: tl.constexpr, HAS_Y: tl.constexpr, HARD: tl.constexpr, T_ONE: tl.constexpr,
    WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, PHASE: tl.constexpr,
    SEGS: tl.constexpr, SEGS_P2: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr = False, MAX_SPIN: tl.constexpr = 1 << 20,
    FORM: tl.constexpr = 0, STAGES: tl.constexpr = 1, TILE_W: tl.constexpr = 0,
):
    """Per-token loss (``loss_ptr``, fp32) and/or the student logit gradient (``dz_ptr``) for
    rows [0, n_rows) of the student / teacher logits buffers. ``inv_t`` = 1/T, ``g`` the
    upstream gradient per row (``g_stride`` 0: one for all rows), ``part_ptr``
    fp32 [n_rows, SEGS, NUM_FIELDS] partials (SEGS > 1), ``sync_ptr`` int32 [2 + n_rows] zeros
    (``PHASE`` 0 with SEGS > 1: the ticket counter, the abort flag, one counter per row).
    ``V_LOAD`` >= V: the columns every row of the buffers has (``common.load_cols``; a load
    bound that is a multiple of 16 vectorizes, one of V = 50257 does not). ``TILE_W`` > 0: the
    logits buffers hold fp16 z − o with o per row and ``TILE_W`` columns in ``so_ptr`` /
    ``to_ptr`` (fp32, row stride ``o_stride``), and the JSD's pass 2 leaves Λ in the teacher's
    buffer for pass 3 where it writes a gradient (``WRITE_GRAD``: passed to pass 2 too, which
    reads it for nothing else; see :func:`_seg_jsd_sums`)."""
    if PHASE == 0:
        if SEGS > 1:
            total = n_rows * SEGS
            ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
            while ticket < total:
                _row_segment(ticket // SEGS, ticket % SEGS, s_ptr, s_stride, t_ptr, t_stride,
                             dz_ptr, dz_stride, y_ptr, g_ptr, g_stride, loss_ptr, part_ptr,
                             sync_ptr, so_ptr, to_ptr, o_stride, V, V_LOAD, ignore_index, inv_t, beta,
                             omb, hard_w, KIND, HAS_Y, HARD, T_ONE, WRITE_LOSS, WRITE_GRAD,
                             PHASE, SEGS, SEGS_P2, SEG, BLOCK, ROUND_BF16, MAX_SPIN, FORM,
                             STAGES, TILE_W)
                ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        else:
            for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
                _row_segment(row, 0, s_ptr, s_stride, t_ptr, t_stride, dz_ptr, dz_stride,
                             y_ptr, g_ptr, g_stride, loss_ptr, part_ptr, sync_ptr, so_ptr,
                             to_ptr, o_stride, V, V_LOAD, ignore_index, inv_t, beta, omb,
                             hard_w, KIND, HAS_Y, HARD, T_ONE, WRITE_LOSS, WRITE_GRAD, PHASE,
                             SEGS, SEGS_P2, SEG, BLOCK, ROUND_BF16, MAX_SPIN, FORM, STAGES,
                             TILE_W)
    else:
        pid = tl.program_id(0)
        _row_segment(pid // SEGS, pid % SEGS, s_ptr, s_stride, t_ptr, t_stride, dz_ptr,
                     dz_stride, y_ptr, g_ptr, g_stride, loss_ptr, part_ptr, sync_ptr, so_ptr,
                     to_ptr, o_stride, V, V_LOAD, ignore_index, inv_t, beta, omb, hard_w, KIND,
                     HAS_Y, HARD, T_ONE, WRITE_LOSS, WRITE_GRAD, PHASE, SEGS, SEGS_P2, SEG,
                     BLOCK, ROUND_BF16, MAX_SPIN, FORM, STAGES, TILE_W)


# ----------------------------------------------------------------------------- diagnostics
def _cuda_tool(name: str, arch: int) -> str:
    """The CUDA tool Triton itself uses (its ``ptxas`` may be a system one, newer than the
    bundle: the PTX it emits then needs that one), else the bundle, PATH, /usr/local/cuda."""
    import os
    import shutil

    candidates = []
    try:  # triton >= 3.4; a missing or renamed helper just falls through
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(arch).path
        candidates.append(ptxas if name == "ptxas" else os.path.join(os.path.dirname(ptxas), name))
    except Exception:  # noqa: BLE001
        pass
    candidates += [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                name), shutil.which(name) or "",
                   os.path.join("/usr/local/cuda/bin", name)]
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise RuntimeError(f"{name} not found (Triton's own, its bundle, PATH, /usr/local/cuda/bin)")


def sass_loops(sass: str):
    """(instructions as (address, text), innermost loops as (first, last) addresses) of a
    kernel's SASS. A loop is [header, last backward branch to it] (all back-edges to one header
    are one loop); the innermost ones contain no other (the column loops: the persistent row
    loop and the passes' sequence hold them). ``benchmarks/jsd_rows_sass.py`` counts them."""
    import re
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    ends = {}
    for addr, text in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            ends[int(m.group(1), 16)] = addr  # in address order: the last back-edge wins
    loops = list(ends.items())
    inner = [(a, b) for a, b in loops
             if not any((a, b) != (c, d) and a <= c and d <= b for c, d in loops)]
    return code, inner


def _local_ops(sass: str):
    """(local-memory loads/stores, those inside an innermost loop) of a kernel's SASS."""
    import re
    code, inner = sass_loops(sass)
    local = [addr for addr, text in code if re.search(r"\b(STL|LDL)\b", text)]
    return len(local), sum(any(a <= x <= b for a, b in inner) for x in local)


BASE_VARIANT = dict(KIND=KIND_JSD, HAS_Y=True, HARD=False, T_ONE=True, WRITE_LOSS=True,
                    WRITE_GRAD=True, PHASE=0, SEGS=16, SEGS_P2=16, SEG=8192, BLOCK=1024,
                    ROUND_BF16=False, MAX_SPIN=1 << 20, FORM=0, STAGES=1, TILE_W=0)


def compile_sass(variant, arch: int = 90, num_warps: int = 4, kernel=None):
    """(ptxas' register / spill lines, SASS) of ``kernel`` (default ``jsd_rows_kernel``; a
    saved version's for code A/Bs) for a CUDA ``arch`` with ``BASE_VARIANT`` updated by
    ``variant``, as the launcher specializes it at runtime: 16-aligned buffers and row strides
    (the buffers' rows are padded), V a multiple of 16 (as 128256). Needs no driver; run it
    without TRITON_INTERPRET."""
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tiled = (variant.get("TILE_W") or 0) > 0  # fp16 logits beside fp32 tile offsets
    sig = dict(s_ptr="*fp16" if tiled else "*fp32", s_stride="i32",
               t_ptr="*fp16" if tiled else "*fp32", t_stride="i32", dz_ptr="*bf16",
               dz_stride="i32", y_ptr="*i64", g_ptr="*fp32", g_stride="i32", loss_ptr="*fp32",
               part_ptr="*fp32", sync_ptr="*i32", so_ptr="*fp32", to_ptr="*fp32",
               o_stride="i32", n_rows="i32", V="i32", V_LOAD="i32",
               ignore_index="i32", inv_t="fp32", beta="fp32", omb="fp32", hard_w="fp32")
    kernel = kernel or jsd_rows_kernel
    params = set(kernel.arg_names)  # a saved older version may take fewer
    sig = {k: t for k, t in sig.items() if k in params}
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n.endswith("_stride")
               or n in ("V", "V_LOAD")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned
             if n not in ("g_stride", "o_stride")}
    cons = {k: c for k, c in {**BASE_VARIANT, **variant}.items() if k in params}
    if set(variant) - params:
        raise ValueError(f"this kernel takes no {sorted(set(variant) - params)}")
    src = ASTSource(fn=kernel, constexprs=cons, attrs=attrs,
                    signature={**sig, **{k: "constexpr" for k in cons}})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps})
    ptxas = _cuda_tool("ptxas", arch)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        cubin = os.path.join(d, "k.cubin")
        r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", cubin],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{ptxas} failed:\n{r.stderr[-2000:]}")
        info = "; ".join(ln.split("info    : ")[-1].strip() for ln in r.stderr.splitlines()
                         if "registers" in ln or "spill" in ln)
        sass = subprocess.run([_cuda_tool("cuobjdump", arch), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    return info, sass


def compile_report(arch: int = 90, variants=None) -> str:
    """Compile the kernel for a CUDA ``arch`` without a GPU (CI runs interpreted and never
    compiles) and report ptxas' registers and spills per variant, one ``variant ...`` line
    each. Needs no driver; run it without TRITON_INTERPRET."""
    variants = variants or [
        dict(), dict(KIND=KIND_FORWARD_KL), dict(KIND=KIND_REVERSE_KL, HARD=True),
        dict(HARD=True, T_ONE=False), dict(SEGS=1, SEGS_P2=2, SEG=131072),
        dict(PHASE=1), dict(PHASE=2), dict(PHASE=3, HAS_Y=False), dict(WRITE_GRAD=False),
        dict(FORM=1), dict(PHASE=2, FORM=1), dict(PHASE=3, FORM=1), dict(PHASE=2, FORM=2),
        dict(num_warps=16, BLOCK=4096, SEG=16384, SEGS=8, SEGS_P2=8),
        dict(TILE_W=256), dict(PHASE=1, TILE_W=256), dict(PHASE=2, TILE_W=256),
        dict(PHASE=3, TILE_W=256), dict(PHASE=3, KIND=KIND_FORWARD_KL, TILE_W=256),
    ]
    lines = []
    for v in variants:
        v = dict(v)
        num_warps = v.pop("num_warps", 4)  # with BLOCK: linear_jsd's GPU defaults
        info, sass = compile_sass(v, arch, num_warps)
        # A few per-row scalars spilled outside the column loops cost nothing (once per
        # row); a spill inside a column loop costs per block.
        n_local, n_inner = _local_ops(sass)
        info += f"; {n_local} local ops, {n_inner} in innermost loops"
        lines.append(f"variant {v} num_warps={num_warps}: {info}")
    return "\n".join(lines)
