"""The fused JSD work on blocks of student and teacher logits, as one Triton kernel.

The GEMMs around it run through cuBLAS; this kernel is everything between them. For each row
(token) of a ``[rows, V]`` pair of logits buffers it computes the per-token loss of
:mod:`logitless.specs.linear_jsd` and, optionally, writes the student logit gradient dz into a
third buffer. The math runs in base 2 (``a = z_s·log2(e)/T``, ``b = z_t·log2(e)/T``, so that
Q = 2^(a − L_a), P = 2^(b − L_b) with L the base-2 log-sum-exp): three logical passes over a
row, since the general case needs both normalizers before K = KL(Q‖M) and K before dz:

1. stats: online max / Σ2^(·) of a and b (and of the raw logits for the hard-label term when
   T != 1), the target logit, and for β ∈ {0, 1} the online Σ 2^(b−m)·(b − a) (or its mirror)
   that yields the KL itself -- so the KL kinds need no second pass;
2. (0 < β < 1 only) K = Σ Q·(log Q − log M) and the loss, with log M = log2(βP + (1−β)Q);
3. the gradient, g·m·((1/T)·∂J/∂a + w_h·(S − onehot)), in dz's dtype.

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
"""
from __future__ import annotations

import triton
import triton.language as tl

from .narrow_cast import round_bf16_bits

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)
# Partial sums per (row, segment), fp32: pass-1 stats then the two pass-2 sums.
NUM_FIELDS = 10
F_MA, F_SA, F_MB, F_SB, F_W, F_MZ, F_SZ, F_ZY, F_K, F_J = (tl.constexpr(i) for i in range(10))
KIND_FORWARD_KL, KIND_REVERSE_KL, KIND_JSD = 0, 1, 2
# M = βP + (1−β)Q at or below this contributes nothing measurable (and log2 of a subnormal
# would flush to -inf): such vocabulary entries get zero loss terms and zero gradient.
M_TINY = tl.constexpr(1e-30)


@triton.jit
def _load_block(s_row, t_row, cols, cmask, c_s):
    """a = z_s·log2(e)/T and b = z_t·log2(e)/T (fp32), the raw student logits z_s."""
    zs = tl.load(s_row + cols, mask=cmask, other=0.0).to(tl.float32)
    zt = tl.load(t_row + cols, mask=cmask, other=0.0).to(tl.float32)
    return zs * c_s, zt * c_s, zs


@triton.jit
def _online(m, s, x):
    """Fold a block of base-2 exponents x (masked lanes -inf) into a running max / Σ2^(x−m)."""
    m_new = tl.maximum(m, tl.max(x, 0))
    s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), 0)
    return m_new, s


@triton.jit
def _seg_stats(s_row, t_row, col0, col1, y_local, c_s, KIND: tl.constexpr, HARD: tl.constexpr,
               T_ONE: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 over columns [col0, col1): (m_a, s_a, m_b, s_b, w, m_z, s_z, z_y) with
    w = Σ 2^(b−m_b)·(b−a) (forward KL) or Σ 2^(a−m_a)·(a−b) (reverse KL), z_y the target's raw
    logit in base-2 units (0 when the target is elsewhere)."""
    offs = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
    m_a = zero - float("inf")
    s_a = zero
    m_b = zero - float("inf")
    s_b = zero
    w = zero
    m_z = zero - float("inf")
    s_z = zero
    z_y = zero
    for start in range(col0, col1, BLOCK):
        cols = start + offs
        cmask = cols < col1
        a, b, zs = _load_block(s_row, t_row, cols, cmask, c_s)
        a_live = tl.where(cmask, a, -float("inf"))
        b_live = tl.where(cmask, b, -float("inf"))
        if KIND == 0:   # forward KL: Σ P·(b − a), weights of the teacher
            m_new = tl.maximum(m_b, tl.max(b_live, 0))
            e = tl.exp2(b_live - m_new)
            w = w * tl.exp2(m_b - m_new) + tl.sum(e * tl.where(cmask, b - a, 0.0), 0)
            s_b = s_b * tl.exp2(m_b - m_new) + tl.sum(e, 0)
            m_b = m_new
            m_a, s_a = _online(m_a, s_a, a_live)
        elif KIND == 1:  # reverse KL: Σ Q·(a − b), weights of the student
            m_new = tl.maximum(m_a, tl.max(a_live, 0))
            e = tl.exp2(a_live - m_new)
            w = w * tl.exp2(m_a - m_new) + tl.sum(e * tl.where(cmask, a - b, 0.0), 0)
            s_a = s_a * tl.exp2(m_a - m_new) + tl.sum(e, 0)
            m_a = m_new
            m_b, s_b = _online(m_b, s_b, b_live)
        else:
            m_a, s_a = _online(m_a, s_a, a_live)
            m_b, s_b = _online(m_b, s_b, b_live)
        if HARD:
            z2 = zs * LOG2E
            if not T_ONE:
                m_z, s_z = _online(m_z, s_z, tl.where(cmask, z2, -float("inf")))
            z_y += tl.sum(tl.where(cols == y_local, z2, 0.0), 0)
    return m_a, s_a, m_b, s_b, w, m_z, s_z, z_y


@triton.jit
def _lse2(m, s):
    return m + tl.log2(s)


@triton.jit
def _combine_lse(part, field_m, field_s, segs_idx, smask):
    """Base-2 log-sum-exp of a row from its segments' (max, Σ) partials."""
    m = tl.load(part + segs_idx * 10 + field_m, mask=smask, other=-float("inf"),
                cache_modifier=".cg")
    s = tl.load(part + segs_idx * 10 + field_s, mask=smask, other=0.0, cache_modifier=".cg")
    mx = tl.max(m, 0)
    return mx + tl.log2(tl.sum(s * tl.exp2(m - mx), 0))


@triton.jit
def _combine_sum(part, field, segs_idx, smask):
    return tl.sum(tl.load(part + segs_idx * 10 + field, mask=smask, other=0.0,
                          cache_modifier=".cg"), 0)


@triton.jit
def _combine_weighted(part, field_w, field_m, lse, segs_idx, smask):
    """Σ_j w_j·2^(m_j − lse): a row's Σ P·(b − a) (or Σ Q·(a − b)) from segment partials."""
    w = tl.load(part + segs_idx * 10 + field_w, mask=smask, other=0.0, cache_modifier=".cg")
    m = tl.load(part + segs_idx * 10 + field_m, mask=smask, other=-float("inf"),
                cache_modifier=".cg")
    return tl.sum(tl.where(smask, w * tl.exp2(m - lse), 0.0), 0)


@triton.jit
def _log_m(lq, lp, beta):
    """log2 M with M = β·2^lp + (1−β)·2^lq, Q = 2^lq; ``live`` where M is not negligible."""
    q = tl.exp2(lq)
    mm = beta * tl.exp2(lp) + (1.0 - beta) * q
    live = mm > M_TINY
    return q, tl.log2(tl.where(live, mm, 1.0)), live


@triton.jit
def _seg_jsd_sums(s_row, t_row, col0, col1, c_s, l_a, l_b, beta, BLOCK: tl.constexpr):
    """Pass 2 (0 < β < 1) over [col0, col1): Σ Q·ℓ and Σ β·P·(log P − log M) + (1−β)·Q·ℓ in
    base-2 units, ℓ = log Q − log M."""
    offs = tl.arange(0, BLOCK)
    k = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
    j = k
    for start in range(col0, col1, BLOCK):
        cols = start + offs
        cmask = cols < col1
        a, b, zs = _load_block(s_row, t_row, cols, cmask, c_s)
        lq = a - l_a
        lp = b - l_b
        q, lm, live = _log_m(lq, lp, beta)
        live = live & cmask
        ell = lq - lm
        qell = q * ell
        k += tl.sum(tl.where(live, qell, 0.0), 0)
        j += tl.sum(tl.where(live, beta * tl.exp2(lp) * (lp - lm) + (1.0 - beta) * qell, 0.0), 0)
    return k, j


@triton.jit
def _seg_grad(s_row, t_row, dz_row, col0, col1, y_local, c_s, l_a, l_b, l_z, kk, beta,
              coef, hard_coef, poison, KIND: tl.constexpr, HARD: tl.constexpr,
              T_ONE: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 3 over [col0, col1): dz = coef·D + hard_coef·(S − [v = y]) (+ poison), D the base
    KL/JSD gradient in ∂/∂a units: (Q − P)/ln2 (forward KL), Q·(λ − K) (reverse KL, λ and K in
    base 2), (1−β)·Q·(ℓ − K) (JSD); coef carries g·m·ln2/T (forward KL: g·m/T, see caller)."""
    offs = tl.arange(0, BLOCK)
    for start in range(col0, col1, BLOCK):
        cols = start + offs
        cmask = cols < col1
        a, b, zs = _load_block(s_row, t_row, cols, cmask, c_s)
        lq = a - l_a
        lp = b - l_b
        if KIND == 0:
            q = tl.exp2(lq)
            d = coef * (q - tl.exp2(lp))
        elif KIND == 1:
            q = tl.exp2(lq)
            d = coef * q * (lq - lp - kk)
        else:
            q, lm, live = _log_m(lq, lp, beta)
            d = tl.where(live, coef * (1.0 - beta) * q * (lq - lm - kk), 0.0)
        if HARD:
            if T_ONE:
                sv = q
            else:
                sv = tl.exp2(zs * LOG2E - l_z)
            d += hard_coef * (sv - tl.where(cols == y_local, 1.0, 0.0))
        d += poison
        if ROUND_BF16:
            d = round_bf16_bits(d)
        tl.store(dz_row + cols, d.to(dz_row.dtype.element_ty), mask=cmask)


@triton.jit
def _zero_seg(dz_row, col0, col1, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(col0, col1, BLOCK):
        cols = start + offs
        tl.store(dz_row + cols, tl.zeros([BLOCK], dtype=tl.float32).to(dz_row.dtype.element_ty),
                 mask=cols < col1)


@triton.jit
def _wait_row(cnt_ptr, abort_ptr, target, MAX_SPIN: tl.constexpr):
    """Arrive at a row's counter and wait until ``target`` arrivals: True unless timed out.
    The barrier orders this program's partial stores before the release; the acquire polls
    (one thread each, result broadcast: the loop condition is uniform) order the other
    segments' stores before our loads. A timeout raises the launch's abort flag, so that
    later rows give up at once instead of each waiting MAX_SPIN polls."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    spins = tl.where(tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="gpu") != 0, MAX_SPIN, 0)
    while (c < target) & (spins < MAX_SPIN):
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    ok = c >= target
    if not ok:
        tl.atomic_xchg(abort_ptr, 1, sem="relaxed", scope="gpu")
    return ok


@triton.jit
def _row_segment(row, seg, s_ptr, s_stride, t_ptr, t_stride, dz_ptr, dz_stride, y_ptr, g_ptr,
                 g_stride, loss_ptr, part_ptr, sync_ptr, V, ignore_index, c_s, inv_t, beta,
                 hard_w, KIND: tl.constexpr, HAS_Y: tl.constexpr, HARD: tl.constexpr,
                 T_ONE: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
                 PHASE: tl.constexpr, SEGS: tl.constexpr, SEGS_P2: tl.constexpr,
                 SEG: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr,
                 MAX_SPIN: tl.constexpr):
    row64 = tl.cast(row, tl.int64)
    s_row = s_ptr + row64 * s_stride
    t_row = t_ptr + row64 * t_stride
    dz_row = dz_ptr + row64 * dz_stride
    col0 = seg * SEG
    col1 = tl.minimum(col0 + SEG, V)
    if HAS_Y:
        y = tl.load(y_ptr + row64).to(tl.int64)
        keep = y != ignore_index
        bad = keep & ((y < 0) | (y >= V))   # out of range: poisoned below, never read
        y_local = tl.where(keep & (~bad), y, -1)
    else:
        keep = row >= 0
        bad = row < 0
        y_local = tl.cast(row * 0 - 1, tl.int64)
    part = part_ptr + row64 * (SEGS * 10)
    segs_idx = tl.arange(0, SEGS_P2)
    smask = segs_idx < SEGS
    sync = SEGS > 1 and PHASE == 0
    if keep:
        zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
        ok = zero == 0.0
        # ---------------------------------------------------------------- pass 1
        if PHASE <= 1:
            m_a, s_a, m_b, s_b, w, m_z, s_z, z_y = _seg_stats(
                s_row, t_row, col0, col1, y_local, c_s, KIND, HARD, T_ONE, BLOCK)
            if SEGS > 1:
                p = part + seg * 10
                tl.store(p + F_MA, m_a)
                tl.store(p + F_SA, s_a)
                tl.store(p + F_MB, m_b)
                tl.store(p + F_SB, s_b)
                tl.store(p + F_W, w)
                tl.store(p + F_MZ, m_z)
                tl.store(p + F_SZ, s_z)
                tl.store(p + F_ZY, z_y)
        if sync:
            ok = ok & _wait_row(sync_ptr + 2 + row64, sync_ptr + 1, SEGS, MAX_SPIN)
        if PHASE != 1:
            if SEGS > 1:
                l_a = _combine_lse(part, F_MA, F_SA, segs_idx, smask)
                l_b = _combine_lse(part, F_MB, F_SB, segs_idx, smask)
                if KIND == 0:
                    w_row = _combine_weighted(part, F_W, F_MB, l_b, segs_idx, smask)
                elif KIND == 1:
                    w_row = _combine_weighted(part, F_W, F_MA, l_a, segs_idx, smask)
                else:
                    w_row = zero
                if HARD:
                    z_y_row = _combine_sum(part, F_ZY, segs_idx, smask)
                    if T_ONE:
                        l_z = l_a
                    else:
                        l_z = _combine_lse(part, F_MZ, F_SZ, segs_idx, smask)
                else:
                    z_y_row = zero
                    l_z = zero
            else:
                l_a = _lse2(m_a, s_a)
                l_b = _lse2(m_b, s_b)
                if KIND == 0:
                    w_row = w * tl.exp2(m_b - l_b)
                elif KIND == 1:
                    w_row = w * tl.exp2(m_a - l_a)
                else:
                    w_row = zero
                z_y_row = z_y
                l_z = l_a
                if HARD:
                    if not T_ONE:
                        l_z = _lse2(m_z, s_z)
            # ------------------------------------------------------------ pass 2
            kk = zero
            jj = zero
            if KIND == 2:
                if PHASE != 3:
                    k_seg, j_seg = _seg_jsd_sums(s_row, t_row, col0, col1, c_s, l_a, l_b, beta,
                                                 BLOCK)
                    if SEGS > 1:
                        tl.store(part + seg * 10 + F_K, k_seg)
                        tl.store(part + seg * 10 + F_J, j_seg)
                    else:
                        kk = k_seg
                        jj = j_seg
                if sync:
                    ok = ok & _wait_row(sync_ptr + 2 + row64, sync_ptr + 1, 2 * SEGS,
                                        MAX_SPIN)
                if PHASE != 2:
                    if SEGS > 1:
                        kk = _combine_sum(part, F_K, segs_idx, smask)
                        jj = _combine_sum(part, F_J, segs_idx, smask)
            elif KIND == 0:
                jj = w_row - l_b + l_a       # KL(P‖Q) in bits
            else:
                jj = w_row - l_a + l_b       # KL(Q‖P) in bits
                kk = jj
            # ------------------------------------------------------------ pass 3
            if PHASE != 2:
                nan = tl.where(ok & (~bad), 0.0, float("nan"))
                if WRITE_LOSS:
                    if seg == 0:
                        loss = LN2 * jj
                        if HARD:
                            loss += hard_w * LN2 * (l_z - z_y_row)
                        tl.store(loss_ptr + row64, loss + nan)
                if WRITE_GRAD:
                    g = tl.load(g_ptr + row64 * g_stride).to(tl.float32)
                    if KIND == 0:
                        coef = g * inv_t
                    else:
                        coef = g * inv_t * LN2
                    _seg_grad(s_row, t_row, dz_row, col0, col1, y_local, c_s, l_a, l_b, l_z,
                              kk, beta, coef, g * hard_w, nan, KIND, HARD, T_ONE, ROUND_BF16,
                              BLOCK)
    else:
        if PHASE == 0 or PHASE == 3:
            if WRITE_LOSS:
                if seg == 0:
                    tl.store(loss_ptr + row64, tl.where(bad, float("nan"), 0.0))
            if WRITE_GRAD:
                _zero_seg(dz_row, col0, col1, BLOCK)


@triton.jit
def jsd_rows_kernel(
    s_ptr, s_stride, t_ptr, t_stride, dz_ptr, dz_stride,
    y_ptr, g_ptr, g_stride, loss_ptr, part_ptr, sync_ptr,
    n_rows, V, ignore_index, c_s, inv_t, beta, hard_w,
    KIND: tl.constexpr, HAS_Y: tl.constexpr, HARD: tl.constexpr, T_ONE: tl.constexpr,
    WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, PHASE: tl.constexpr,
    SEGS: tl.constexpr, SEGS_P2: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr = False, MAX_SPIN: tl.constexpr = 1 << 20,
):
    """Per-token loss (``loss_ptr``, fp32) and/or the student logit gradient (``dz_ptr``) for
    rows [0, n_rows) of the student / teacher logits buffers. ``c_s`` = log2(e)/T, ``inv_t`` =
    1/T, ``g`` the upstream gradient per row (``g_stride`` 0: one for all rows), ``part_ptr``
    fp32 [n_rows, SEGS, 10] partials (SEGS > 1), ``sync_ptr`` int32 [2 + n_rows] zeros
    (``PHASE`` 0 with SEGS > 1: the ticket counter, the abort flag, one counter per row)."""
    if PHASE == 0:
        if SEGS > 1:
            total = n_rows * SEGS
            ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
            while ticket < total:
                _row_segment(ticket // SEGS, ticket % SEGS, s_ptr, s_stride, t_ptr, t_stride,
                             dz_ptr, dz_stride, y_ptr, g_ptr, g_stride, loss_ptr, part_ptr,
                             sync_ptr, V, ignore_index, c_s, inv_t, beta, hard_w, KIND, HAS_Y,
                             HARD, T_ONE, WRITE_LOSS, WRITE_GRAD, PHASE, SEGS, SEGS_P2, SEG,
                             BLOCK, ROUND_BF16, MAX_SPIN)
                ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        else:
            for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
                _row_segment(row, 0, s_ptr, s_stride, t_ptr, t_stride, dz_ptr, dz_stride,
                             y_ptr, g_ptr, g_stride, loss_ptr, part_ptr, sync_ptr, V,
                             ignore_index, c_s, inv_t, beta, hard_w, KIND, HAS_Y, HARD, T_ONE,
                             WRITE_LOSS, WRITE_GRAD, PHASE, SEGS, SEGS_P2, SEG, BLOCK,
                             ROUND_BF16, MAX_SPIN)
    else:
        pid = tl.program_id(0)
        _row_segment(pid // SEGS, pid % SEGS, s_ptr, s_stride, t_ptr, t_stride, dz_ptr,
                     dz_stride, y_ptr, g_ptr, g_stride, loss_ptr, part_ptr, sync_ptr, V,
                     ignore_index, c_s, inv_t, beta, hard_w, KIND, HAS_Y, HARD, T_ONE,
                     WRITE_LOSS, WRITE_GRAD, PHASE, SEGS, SEGS_P2, SEG, BLOCK, ROUND_BF16,
                     MAX_SPIN)


# ----------------------------------------------------------------------------- diagnostics
def compile_report(arch: int = 90, variants=None) -> str:
    """Compile the kernel for a CUDA ``arch`` without a GPU (CI runs interpreted and never
    compiles) and report ptxas' registers and spills per variant, one ``variant ...`` line
    each. Needs no driver; run it without TRITON_INTERPRET."""
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    base = dict(KIND=KIND_JSD, HAS_Y=True, HARD=False, T_ONE=True, WRITE_LOSS=True,
                WRITE_GRAD=True, PHASE=0, SEGS=16, SEGS_P2=16, SEG=8192, BLOCK=2048,
                ROUND_BF16=False, MAX_SPIN=1 << 20)
    variants = variants or [
        dict(), dict(KIND=KIND_FORWARD_KL), dict(KIND=KIND_REVERSE_KL, HARD=True),
        dict(HARD=True, T_ONE=False), dict(SEGS=1, SEGS_P2=2, SEG=131072),
        dict(PHASE=1), dict(PHASE=2), dict(PHASE=3, HAS_Y=False), dict(WRITE_GRAD=False),
        dict(num_warps=16, BLOCK=4096, SEG=16384, SEGS=8, SEGS_P2=8),
    ]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    sig = dict(s_ptr="*fp32", s_stride="i32", t_ptr="*fp32", t_stride="i32", dz_ptr="*bf16",
               dz_stride="i32", y_ptr="*i64", g_ptr="*fp32", g_stride="i32", loss_ptr="*fp32",
               part_ptr="*fp32", sync_ptr="*i32", n_rows="i32", V="i32", ignore_index="i32",
               c_s="fp32", inv_t="fp32", beta="fp32", hard_w="fp32")
    # what the launcher's specialization sees at runtime: 16-aligned buffers and row strides
    # (the buffers' rows are padded), V a multiple of 16 (as 128256)
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n.endswith("_stride") or n == "V"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned
             if n != "g_stride"}
    lines = []
    for v in variants:
        v = dict(v)
        num_warps = v.pop("num_warps", 8)
        cons = {**base, **v}
        src = ASTSource(fn=jsd_rows_kernel, signature={**sig, **{k: "constexpr" for k in cons}},
                        constexprs=cons, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps})
        info = ""
        if os.path.exists(ptxas):
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.ptx")
                with open(path, "w") as f:
                    f.write(compiled.asm["ptx"])
                r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.devnull],
                                   capture_output=True, text=True)
                info = "; ".join(ln.split("info    : ")[-1].strip() for ln in r.stderr.splitlines()
                                 if "registers" in ln or "spill" in ln)
        lines.append(f"variant {v} num_warps={num_warps}: {info}")
    return "\n".join(lines)
