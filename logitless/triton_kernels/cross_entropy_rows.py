"""The fused softmax/cross-entropy work on a block of logits, as one Triton kernel.

The GEMMs around it run through cuBLAS (or, for the forward's logits, :mod:`.logits_gemm`);
this kernel is everything between them. (With ``logits_gemm="triton"`` the recomputing sweeps
skip it: :mod:`.logits_gemm` writes dz from its epilogue by this kernel's ``@jit`` formulas.)
For each row of a ``[rows, cols]`` logits buffer (a token chunk with all V columns, or all tokens with a
slice of V starting at ``col_offset``) it can

* pass 1 (``COMPUTE_LSE``): stream the row once for max / Σexp (one exp per element, block-wise
  online rescaling), the smoothing sum Σ_v w_v c_v and the target logit; store lse and the
  per-token loss of the spec. With ``FROM_TILES`` the max / Σexp come instead from the per-tile
  partials that the logits GEMM's epilogue left (:mod:`.logits_gemm`; no smoothing): no pass;
* pass 2 (``WRITE_GRAD``): stream it again and overwrite it in place with the logit gradient
  dz = (g·A + h)·p − g·B·[v = y] − g·m·(ε/V)·w_v, times the softcap derivative.

The buffer holds the GEMM product x·Wᵀ without the bias, rounded once to the input dtype; the
kernel adds the bias in fp32 as it reads (``_logit``).

A persistent grid keeps only ~#SMs rows in flight, so pass 2 re-reads the row from L2. Long
rows are split into segments (``SEGS``), one program per (row, segment), whose pass-1
partials (max, Σexp, target logit, smoothing sum) meet in memory: in one launch (``PHASE``
FUSED: the segments of a row wait for each other at a counter; tickets handed out in order
leave at most one row incomplete, so the launch cannot deadlock while a row's segments can
all be resident, and a wait past ``MAX_SPIN`` polls makes the row NaN instead of hanging) or
in two (STATS, GRAD: the interpreter, which runs programs one after another). Many small
programs per SM keep more bytes in flight than one whole-row program each, and each segment
is short enough to stay in L2 until pass 2.
All math is fp32; loads are upcast at once (the Triton interpreter mis-computes bf16 math).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fast_math import DIFF, EXACT, FMA, exp_from, exp_ftz, rcp_approx
from .narrow_cast import round_bf16_bits
from .row_sync import wait_row as _wait_row

@triton.jit
def _tanh(u):
    # tanh through exp of a non-positive argument: no overflow, works in the interpreter. Below
    # |u| = 1/4, where 1 − e^(−2|u|) would cancel (an absolute error of ~6e-8 whatever |u|: a
    # softcap far above the logits capped them all by ~softcap·3e-8), its odd series through
    # u⁹, whose first neglected term is < 1e-8 of tanh there.
    # (exp_ftz: e ≤ 1, a subnormal one is 0 next to 1; rcp_approx: 1 + e lies in [1, 2], where
    # the approximate reciprocal needs none of ptxas's range fix-ups of a division)
    a = tl.abs(u)
    e = exp_ftz(-2.0 * a)
    u2 = u * u
    series = u * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 +
                                                                     u2 * (62.0 / 2835.0)))))
    t = (1.0 - e) * rcp_approx(1.0 + e)
    return tl.where(a < 0.25, series, tl.where(u < 0, -t, t))


@triton.jit
def _cap(z, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:  # times the row-invariant 1/softcap: no division per element
        z = softcap * _tanh(z * (1.0 / softcap))
    return z


@triton.jit
def _finite_ref(m):
    """The reference point of an online Σexp: the running max, or 0 while it is still −inf
    (every logit so far −inf, e.g. a block of a vocabulary masked by a −inf bias), where
    exp(−inf − (−inf)) would be NaN."""
    return tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def _logit(base, bias_ptr, col_offset, cols, lmask, mask, HAS_BIAS: tl.constexpr,
           EVICT: tl.constexpr = ""):
    """Logits ``cols`` of a row as fp32: the stored GEMM product (loaded where ``lmask``, which
    may reach into the row's padding: past ``mask`` the values are junk for the caller to
    mask) plus, with a bias, its entry added here in fp32. cuBLAS (H100, torch 2.11) rounds
    twice when it adds a bias into a strided output whose width is a multiple of 8 (our
    buffers are column views): round(round(xWᵀ) + b) in ~30% of the entries; here it is
    round(xWᵀ) + b, with nothing rounded after the bias is in."""
    z = tl.load(base + cols, mask=lmask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + col_offset + cols, mask=mask, other=0.0).to(tl.float32)
    return z


@triton.jit
def _target(y, ignore_index, V, cw_ptr, HAS_CW: tl.constexpr):
    """(valid, in_range, y_safe, omega, mask_f) of targets ``y`` (int64, a scalar or a vector
    of rows): ``y_safe`` is a class index safe to read at (0 for an ignored or out-of-range
    target), ``omega`` the token's weight ω (0 when ignored)."""
    valid = y != ignore_index
    in_range = (y >= 0) & (y < V)
    mask_f = tl.where(valid, 1.0, 0.0)
    y_safe = tl.where(valid & in_range, y, 0)
    if HAS_CW:
        omega = mask_f * tl.load(cw_ptr + y_safe).to(tl.float32)
    else:
        omega = mask_f
    return valid, in_range, y_safe, omega, mask_f


@triton.jit
def _grad_coefs(g, h, lse, omega, mask_f, omega_sum, V, eps, z_loss, HAS_Z: tl.constexpr,
                SMOOTH: tl.constexpr, HAS_H: tl.constexpr):
    """Per-token coefficients of dz = coef_p·p − coef_y·[v = y] − coef_w·w_v (then times the
    softcap derivative), for upstream gradients g (loss) and h (lse)."""
    a = (1.0 - eps) * omega
    if HAS_Z:
        a += 2.0 * z_loss * omega * lse
    if SMOOTH:
        a += mask_f * (eps / V) * omega_sum
    coef_p = g * a
    if HAS_H:
        coef_p += h
    return coef_p, g * (1.0 - eps) * omega, g * mask_f * (eps / V)


@triton.jit
def _logit_grad(c, lse, coef_p, coef_y, coef_w, is_y, wv, softcap, SMOOTH: tl.constexpr,
                HAS_CW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EXP_FORM: tl.constexpr = 0):
    """dz at capped logits ``c`` (fp32; every other argument broadcasts against it): ``is_y``
    marks the target's column, ``wv`` the class weights (read only with smoothing and class
    weights); ``EXP_FORM`` how p = e^(c − lse) is computed (:mod:`.fast_math`)."""
    d = coef_p * exp_from(c, lse, EXP_FORM)
    d -= tl.where(is_y, coef_y, 0.0)
    if SMOOTH:
        if HAS_CW:
            d -= coef_w * wv
        else:
            d -= coef_w
    if HAS_SOFTCAP:
        r = c * (1.0 / softcap)
        d *= 1.0 - r * r
    return d


# Sweep-1 partials per (row, segment) where rows are split (SEGS > 1), fp32: the segment's max,
# its Σexp relative to that max, the target's capped logit (0 outside the target's segment),
# the smoothing sum.
NUM_PARTS = 4
# How the segments of a row meet (SEGS > 1): FUSED, one launch whose programs wait for their
# row's other segments at a counter in memory; STATS then GRAD, two launches (the interpreter,
# which runs programs one after another, or row_sync off).
FUSED, STATS, GRAD = 0, 1, 2
# (a jit function reads module globals only as constexprs)
_NP, _FUSED, _STATS, _GRAD = (tl.constexpr(c) for c in (NUM_PARTS, FUSED, STATS, GRAD))


@triton.jit
def _merge_parts(part, SEGS: tl.constexpr, SEGS_P2: tl.constexpr):
    """(max, Σexp, target logit, smoothing sum) of a row from its segments' partials."""
    idx = tl.arange(0, SEGS_P2)
    smask = idx < SEGS
    pm = tl.load(part + idx * _NP, mask=smask, other=-float("inf"), cache_modifier=".cg")
    ps = tl.load(part + idx * _NP + 1, mask=smask, other=0.0, cache_modifier=".cg")
    py = tl.load(part + idx * _NP + 2, mask=smask, other=0.0, cache_modifier=".cg")
    pw = tl.load(part + idx * _NP + 3, mask=smask, other=0.0, cache_modifier=".cg")
    m = tl.max(pm, 0)
    # a segment with no live class (max −inf) has a sum of 0 and a factor e^(−inf) = 0
    s = tl.sum(ps * tl.exp(pm - _finite_ref(m)), 0)
    return m, s, tl.sum(py, 0), tl.sum(pw, 0)


@triton.jit
def _ce_row(row, seg, logits_ptr, stride_row, bias_ptr, y_ptr, cw_ptr, omega_sum,
            lse_ptr, loss_ptr, g_ptr, g_stride, h_ptr, part_ptr, sync_ptr,
            n_cols, n_load, seg_cols, col_offset, V, ignore_index, eps, z_loss, softcap,
            stat_m_ptr, stat_s_ptr, n_tiles,
            COMPUTE_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr, FROM_TILES: tl.constexpr,
            HAS_CW: tl.constexpr, SMOOTH: tl.constexpr, HAS_Z: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, HAS_H: tl.constexpr, HAS_BIAS: tl.constexpr,
            BLOCK_V: tl.constexpr, ROUND_BF16: tl.constexpr, STAGES: tl.constexpr,
            SEGS: tl.constexpr, SEGS_P2: tl.constexpr, PHASE: tl.constexpr,
            MAX_SPIN: tl.constexpr, EVICT1: tl.constexpr, EVICT2: tl.constexpr,
            EXP_FORM: tl.constexpr):
    """Segment ``seg`` (columns [seg·seg_cols, (seg + 1)·seg_cols)) of one row; with SEGS = 1
    the whole row."""
    offs = tl.arange(0, BLOCK_V)
    row64 = tl.cast(row, tl.int64)
    base = logits_ptr + row64 * stride_row
    y = tl.load(y_ptr + row64).to(tl.int64)
    valid, in_range, y_safe, omega, mask_f = _target(y, ignore_index, V, cw_ptr, HAS_CW)
    y_local = y_safe - col_offset  # the target's column inside this buffer, if it is here
    # compared with int32 columns per element: one instruction instead of three in 64 bits
    # (|y_local| < V < 2^31)
    y_col = y_local.to(tl.int32)
    col0 = seg * seg_cols
    col1 = tl.minimum(col0 + seg_cols, n_cols)
    split = SEGS > 1
    part = part_ptr + row64 * (SEGS * _NP)

    if COMPUTE_LSE:
        # scalar fp32 tensors (not Python floats) so the loop-carried types are stable
        zero = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float32), 0)
        m = zero - float("inf")
        s = zero
        wc = zero
        c_y = zero
        ok = zero == 0.0  # (names bound inside a constexpr branch do not leave it)
        here = (y_local >= col0) & (y_local < col1) & valid
        if PHASE != _GRAD:
            if FROM_TILES:  # fold the GEMM epilogue's per-tile max / Σexp
                for start in range(0, n_tiles, BLOCK_V):
                    t = start + offs
                    tmask = t < n_tiles
                    tm = tl.load(stat_m_ptr + row64 * n_tiles + t, mask=tmask,
                                 other=-float("inf"))
                    ts = tl.load(stat_s_ptr + row64 * n_tiles + t, mask=tmask, other=0.0)
                    m_new = tl.maximum(m, tl.max(tm, 0))
                    m_ref = _finite_ref(m_new)
                    s = s * tl.exp(m - m_ref) + tl.sum(ts * tl.exp(tm - m_ref), 0)
                    m = m_new
            else:
                for start in tl.range(col0, col1, BLOCK_V, num_stages=STAGES):
                    cols = start + offs
                    cmask = cols < col1
                    z = _logit(base, bias_ptr, col_offset, cols, cols < n_load, cmask, HAS_BIAS,
                               EVICT1)
                    c = _cap(z, softcap, HAS_SOFTCAP)  # junk (even NaN) in the row's padding
                    if SMOOTH:
                        if HAS_CW:
                            wv = tl.load(cw_ptr + col_offset + cols, mask=cmask,
                                         other=0.0).to(tl.float32)
                            wc += tl.sum(tl.where(cmask, wv * c, 0.0), 0)
                        else:
                            wc += tl.sum(tl.where(cmask, c, 0.0), 0)
                    c = tl.where(cmask, c, -float("inf"))
                    m_new = tl.maximum(m, tl.max(c, 0))
                    m_ref = _finite_ref(m_new)
                    s = s * tl.exp(m - m_ref) + tl.sum(exp_from(c, m_ref, EXP_FORM), 0)
                    m = m_new
            # read before any segment of the row writes dz over it (after the wait below)
            z_y = _logit(base, bias_ptr, col_offset, tl.where(here, y_local, 0), here, here,
                         HAS_BIAS, "")
            c_y = tl.where(here, _cap(z_y, softcap, HAS_SOFTCAP), 0.0)
            if split:
                mine = part + seg * _NP
                tl.store(mine, m)
                tl.store(mine + 1, s)
                tl.store(mine + 2, c_y)
                tl.store(mine + 3, wc)
        if PHASE != _STATS:
            if split:
                if PHASE == _FUSED:
                    ok = _wait_row(sync_ptr + 2 + row64, sync_ptr + 1, SEGS, MAX_SPIN)
                m, s, c_y, wc = _merge_parts(part, SEGS, SEGS_P2)
                m = tl.where(ok, m, float("nan"))  # timed out: NaN, never garbage
            lse = m + tl.log(s)
            loss = (1.0 - eps) * omega * (lse - c_y)
            if SMOOTH:
                # selected, not times the mask: an ignored token's wc may be −inf (0·inf)
                loss += tl.where(mask_f > 0, (eps / V) * (omega_sum * lse - wc), 0.0)
            if HAS_Z:
                loss += z_loss * omega * lse * lse
            # an out-of-range target poisons its loss: an error, never silent garbage
            loss = tl.where(valid & (~in_range), float("nan"), loss)
            if seg == 0:
                tl.store(lse_ptr + row64, lse)
                tl.store(loss_ptr + row64, loss)
    else:
        lse = tl.load(lse_ptr + row64).to(tl.float32)

    if WRITE_GRAD and PHASE != _STATS:
        # an ignored token's gradient is 0 whatever its upstream g (F.cross_entropy's rule):
        # selected, as g·0 would turn an inf or NaN g into NaN in every dW row
        g = tl.where(valid, tl.load(g_ptr + row64 * g_stride).to(tl.float32), 0.0)
        h = 0.0
        if HAS_H:
            h = tl.load(h_ptr + row64).to(tl.float32)
        coef_p, coef_y, coef_w = _grad_coefs(g, h, lse, omega, mask_f, omega_sum, V, eps,
                                             z_loss, HAS_Z, SMOOTH, HAS_H)
        # Backwards over the segment: its most recently read tail is the likeliest in L2.
        n_blocks = tl.cdiv(col1 - col0, BLOCK_V)
        for i in tl.range(0, n_blocks, num_stages=STAGES):
            cols = col0 + (n_blocks - 1 - i) * BLOCK_V + offs
            cmask = cols < col1
            lmask = cols < n_load
            z = _logit(base, bias_ptr, col_offset, cols, lmask, cmask, HAS_BIAS,
                       EVICT2)
            c = _cap(z, softcap, HAS_SOFTCAP)
            wv = 0.0
            if SMOOTH and HAS_CW:
                wv = tl.load(cw_ptr + col_offset + cols, mask=cmask, other=0.0).to(tl.float32)
            d = _logit_grad(c, lse, coef_p, coef_y, coef_w, cols == y_col, wv, softcap,
                            SMOOTH, HAS_CW, HAS_SOFTCAP, EXP_FORM)
            if ROUND_BF16:  # the interpreter's cast truncates; the GPU rounds
                d = round_bf16_bits(d)
            # the padding too (junk there, read by no GEMM): a bound that is a multiple
            # of 16 lets the store vectorize, as the loads
            tl.store(base + cols, d.to(logits_ptr.dtype.element_ty), mask=lmask,
                     eviction_policy=EVICT2)


@triton.jit
def _live_count(live_ptr, n_rows, HAS_LIVE: tl.constexpr):
    if HAS_LIVE:
        return tl.minimum(tl.load(live_ptr), n_rows)
    return n_rows


@triton.jit
def _blank_row(row, seg, logits_ptr, stride_row, lse_ptr, loss_ptr, n_cols, seg_cols,
               COMPUTE_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Segment ``seg`` of a row past the live count (an ignored token whose logits were
    never computed): dz = 0 over the segment, lse = loss = 0, nothing read."""
    row64 = tl.cast(row, tl.int64)
    if WRITE_GRAD:
        base = logits_ptr + row64 * stride_row
        col0 = seg * seg_cols
        col1 = tl.minimum(col0 + seg_cols, n_cols)
        zeros = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
        for start in range(col0, col1, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(base + cols, zeros, mask=cols < col1)
    if COMPUTE_LSE:
        if seg == 0:
            tl.store(lse_ptr + row64, 0.0)
            tl.store(loss_ptr + row64, 0.0)


@triton.jit
def cross_entropy_rows_kernel(
    logits_ptr, stride_row, bias_ptr,
    y_ptr, cw_ptr, omega_sum_ptr,
    lse_ptr, loss_ptr,
    g_ptr, g_stride, h_ptr,
    n_rows, n_cols, n_load, col_offset, V, ignore_index,
    eps, z_loss, softcap, stat_m_ptr, stat_s_ptr, n_tiles,
    part_ptr, sync_ptr, seg_cols, live_ptr,
    COMPUTE_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr, FROM_TILES: tl.constexpr,
    HAS_CW: tl.constexpr, SMOOTH: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_H: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_V: tl.constexpr, ROUND_BF16: tl.constexpr = False, STAGES: tl.constexpr = 1,
    SEGS: tl.constexpr = 1, SEGS_P2: tl.constexpr = 2, PHASE: tl.constexpr = 0,
    MAX_SPIN: tl.constexpr = 1 << 22, EVICT1: tl.constexpr = "", EVICT2: tl.constexpr = "",
    EXP_FORM: tl.constexpr = 0, HAS_LIVE: tl.constexpr = False,
):
    """Rows [0, n_rows) of the buffer, each in ``SEGS`` segments of ``seg_cols`` columns (the
    last one ragged). SEGS = 1: a persistent grid walks whole rows. SEGS > 1 (only with
    ``COMPUTE_LSE`` from the logits): ``PHASE`` FUSED takes (row, segment) tickets in order
    from an atomic counter, so at most one row is ever incomplete and SEGS resident programs
    suffice, and a row's segments wait for each other between the sweeps (``sync_ptr``: int32
    [2 + n_rows] zeros: the ticket counter, the abort flag, one counter per row); STATS
    writes the partials (``part_ptr``: fp32 [n_rows, SEGS, NUM_PARTS]), GRAD merges them and
    finishes (loss, lse, dz) in a second launch. ``EVICT1`` / ``EVICT2``: L2 eviction hints
    of sweep 1's loads / sweep 2's loads and stores ("": none). ``EXP_FORM``: how the
    per-element exponentials are computed (:mod:`.fast_math`; 0, ``EXACT``: ``tl.exp``).
    ``HAS_LIVE``: only rows below ``*live_ptr`` (int32, read from device memory) are live;
    the rest, ignored tokens whose logits were never computed (junk in the buffer), get
    dz = 0 and lse = loss = 0 after the live rows' work, nothing read (``_blank_row``)."""
    # split rows merge pass-1 partials of the logits: tile statistics would be folded whole by
    # every segment, and a gradient pass has nothing to merge
    tl.static_assert(SEGS == 1 or (COMPUTE_LSE and not FROM_TILES))
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if HAS_CW:
        omega_sum = tl.load(omega_sum_ptr).to(tl.float32)
    else:
        omega_sum = V * 1.0
    n_live = _live_count(live_ptr, n_rows, HAS_LIVE)
    if SEGS > 1 and PHASE == _FUSED:
        total = n_live * SEGS
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        while ticket < total:
            _ce_row(ticket // SEGS, ticket % SEGS, logits_ptr, stride_row, bias_ptr, y_ptr,
                    cw_ptr, omega_sum, lse_ptr, loss_ptr, g_ptr, g_stride, h_ptr, part_ptr,
                    sync_ptr, n_cols, n_load, seg_cols, col_offset, V, ignore_index, eps,
                    z_loss, softcap, stat_m_ptr, stat_s_ptr, n_tiles, COMPUTE_LSE, WRITE_GRAD,
                    FROM_TILES, HAS_CW, SMOOTH, HAS_Z, HAS_SOFTCAP, HAS_H, HAS_BIAS, BLOCK_V,
                    ROUND_BF16, STAGES, SEGS, SEGS_P2, PHASE, MAX_SPIN, EVICT1, EVICT2,
                    EXP_FORM)
            ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    else:
        for t in range(pid, n_live * SEGS, nprog):
            _ce_row(t // SEGS, t % SEGS, logits_ptr, stride_row, bias_ptr, y_ptr,
                    cw_ptr, omega_sum, lse_ptr, loss_ptr, g_ptr, g_stride, h_ptr, part_ptr,
                    sync_ptr, n_cols, n_load, seg_cols, col_offset, V, ignore_index, eps,
                    z_loss, softcap, stat_m_ptr, stat_s_ptr, n_tiles, COMPUTE_LSE, WRITE_GRAD,
                    FROM_TILES, HAS_CW, SMOOTH, HAS_Z, HAS_SOFTCAP, HAS_H, HAS_BIAS, BLOCK_V,
                    ROUND_BF16, STAGES, SEGS, SEGS_P2, PHASE, MAX_SPIN, EVICT1, EVICT2,
                    EXP_FORM)
    if HAS_LIVE and PHASE != _STATS:  # (the blank rows' partials are never read)
        for t in range(pid, (n_rows - n_live) * SEGS, nprog):
            _blank_row(n_live + t // SEGS, t % SEGS, logits_ptr, stride_row, lse_ptr, loss_ptr,
                       n_cols, seg_cols, COMPUTE_LSE, WRITE_GRAD, BLOCK_V)


# ----------------------------------------------------------------------------- diagnostics
def compile_variants(arch: int = 90) -> str:
    """Compile the kernel's forms (whole rows, split in one launch or two, every option, the
    tiles' statistics, the gradient alone, each exponential form) for a CUDA ``arch`` without
    a GPU, one ``variant ... ok`` line each (the interpreter never compiles); raises on a
    refusal. Run it without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(logits_ptr="*bf16", stride_row="i32", bias_ptr="*fp32", y_ptr="*i64",
               cw_ptr="*fp32", omega_sum_ptr="*fp32", lse_ptr="*fp32", loss_ptr="*fp32",
               g_ptr="*fp32", g_stride="i32", h_ptr="*fp32", n_rows="i32", n_cols="i32",
               n_load="i32", col_offset="i32", V="i32", ignore_index="i64", eps="fp32",
               z_loss="fp32", softcap="fp32", stat_m_ptr="*fp32", stat_s_ptr="*fp32",
               n_tiles="i32", part_ptr="*fp32", sync_ptr="*i32", seg_cols="i32",
               live_ptr="*i32")
    base = dict(COMPUTE_LSE=True, WRITE_GRAD=True, FROM_TILES=False, HAS_CW=False,
                SMOOTH=False, HAS_Z=False, HAS_SOFTCAP=False, HAS_H=False, HAS_BIAS=False,
                BLOCK_V=2048, ROUND_BF16=False, STAGES=3, SEGS=16, SEGS_P2=16, PHASE=FUSED,
                MAX_SPIN=1 << 22, EVICT1="evict_last", EVICT2="evict_first", EXP_FORM=FMA,
                HAS_LIVE=False)
    every = dict(HAS_CW=True, SMOOTH=True, HAS_Z=True, HAS_SOFTCAP=True, HAS_BIAS=True)
    whole = dict(SEGS=1, SEGS_P2=2, BLOCK_V=4096, EVICT1="", EVICT2="", num_warps=8)
    variants = [dict(), every, dict(WRITE_GRAD=False), dict(PHASE=STATS, WRITE_GRAD=False),
                dict(PHASE=GRAD), dict(PHASE=GRAD, **every), whole, dict(whole, **every),
                dict(whole, FROM_TILES=True), dict(whole, COMPUTE_LSE=False, HAS_H=True),
                dict(EXP_FORM=DIFF), dict(EXP_FORM=EXACT), dict(HAS_LIVE=True),
                dict(PHASE=GRAD, HAS_LIVE=True), dict(whole, HAS_LIVE=True),
                dict(whole, WRITE_GRAD=False, HAS_LIVE=True)]
    lines = []
    for v in variants:
        cons = {**base, **v}
        num_warps = cons.pop("num_warps", 2)  # the split's default (whole rows: 32 x 32768,
        # which takes minutes to compile: the form is the same)
        src = ASTSource(fn=cross_entropy_rows_kernel,
                        signature={**sig, **{k: "constexpr" for k in cons}}, constexprs=cons)
        triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
        lines.append(f"variant {v} ok")
    return "\n".join(lines)
