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

A persistent grid keeps only ~#SMs rows in flight, so pass 2 re-reads the row from L2.
All math is fp32; loads are upcast at once (the Triton interpreter mis-computes bf16 math).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .narrow_cast import round_bf16_bits

@triton.jit
def _tanh(u):
    # tanh through exp of a non-positive argument: no overflow, works in the interpreter. Below
    # |u| = 1/4, where 1 − e^(−2|u|) would cancel (an absolute error of ~6e-8 whatever |u|: a
    # softcap far above the logits capped them all by ~softcap·3e-8), its odd series through
    # u⁹, whose first neglected term is < 1e-8 of tanh there.
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    u2 = u * u
    series = u * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 +
                                                                     u2 * (62.0 / 2835.0)))))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.25, series, tl.where(u < 0, -t, t))


@triton.jit
def _cap(z, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    return z


@triton.jit
def _finite_ref(m):
    """The reference point of an online Σexp: the running max, or 0 while it is still −inf
    (every logit so far −inf, e.g. a block of a vocabulary masked by a −inf bias), where
    exp(−inf − (−inf)) would be NaN."""
    return tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def _logit(base, bias_ptr, col_offset, cols, lmask, mask, HAS_BIAS: tl.constexpr):
    """Logits ``cols`` of a row as fp32: the stored GEMM product (loaded where ``lmask``, which
    may reach into the row's padding: past ``mask`` the values are junk for the caller to
    mask) plus, with a bias, its entry added here in fp32. cuBLAS (H100, torch 2.11) rounds
    twice when it adds a bias into a strided output whose width is a multiple of 8 (our
    buffers are column views): round(round(xWᵀ) + b) in ~30% of the entries; here it is
    round(xWᵀ) + b, with nothing rounded after the bias is in."""
    z = tl.load(base + cols, mask=lmask, other=0.0).to(tl.float32)
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
                HAS_CW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dz at capped logits ``c`` (fp32; every other argument broadcasts against it): ``is_y``
    marks the target's column, ``wv`` the class weights (read only with smoothing and class
    weights)."""
    d = coef_p * tl.exp(c - lse)
    d -= tl.where(is_y, coef_y, 0.0)
    if SMOOTH:
        if HAS_CW:
            d -= coef_w * wv
        else:
            d -= coef_w
    if HAS_SOFTCAP:
        r = c / softcap
        d *= 1.0 - r * r
    return d


@triton.jit
def cross_entropy_rows_kernel(
    logits_ptr, stride_row, bias_ptr,
    y_ptr, cw_ptr, omega_sum_ptr,
    lse_ptr, loss_ptr,
    g_ptr, g_stride, h_ptr,
    n_rows, n_cols, n_load, col_offset, V, ignore_index,
    eps, z_loss, softcap, stat_m_ptr, stat_s_ptr, n_tiles,
    COMPUTE_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr, FROM_TILES: tl.constexpr,
    HAS_CW: tl.constexpr, SMOOTH: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_H: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_V: tl.constexpr, ROUND_BF16: tl.constexpr = False, STAGES: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_V)
    if HAS_CW:
        omega_sum = tl.load(omega_sum_ptr).to(tl.float32)
    else:
        omega_sum = V * 1.0
    for row in range(pid, n_rows, nprog):
        row64 = tl.cast(row, tl.int64)
        base = logits_ptr + row64 * stride_row
        y = tl.load(y_ptr + row64).to(tl.int64)
        valid, in_range, y_safe, omega, mask_f = _target(y, ignore_index, V, cw_ptr, HAS_CW)
        y_local = y_safe - col_offset  # the target's column inside this buffer, if it is here

        if COMPUTE_LSE:
            # scalar fp32 tensors (not Python floats) so the loop-carried types are stable
            zero = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float32), 0)
            m = zero - float("inf")
            s = zero
            wc = zero
            if FROM_TILES:  # fold the GEMM epilogue's per-tile max / Σexp
                for start in range(0, n_tiles, BLOCK_V):
                    t = start + offs
                    tmask = t < n_tiles
                    tm = tl.load(stat_m_ptr + row64 * n_tiles + t, mask=tmask, other=-float("inf"))
                    ts = tl.load(stat_s_ptr + row64 * n_tiles + t, mask=tmask, other=0.0)
                    m_new = tl.maximum(m, tl.max(tm, 0))
                    m_ref = _finite_ref(m_new)
                    s = s * tl.exp(m - m_ref) + tl.sum(ts * tl.exp(tm - m_ref), 0)
                    m = m_new
            else:
                for start in tl.range(0, n_cols, BLOCK_V, num_stages=STAGES):
                    cols = start + offs
                    cmask = cols < n_cols
                    z = _logit(base, bias_ptr, col_offset, cols, cols < n_load, cmask, HAS_BIAS)
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
                    s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(c - m_ref), 0)
                    m = m_new
            lse = m + tl.log(s)
            here = (y_local >= 0) & (y_local < n_cols) & valid
            z_y = _logit(base, bias_ptr, col_offset, tl.where(here, y_local, 0), here, here,
                         HAS_BIAS)
            c_y = _cap(z_y, softcap, HAS_SOFTCAP)
            loss = (1.0 - eps) * omega * (lse - c_y)
            if SMOOTH:
                # selected, not times the mask: an ignored token's wc may be −inf (0·inf)
                loss += tl.where(mask_f > 0, (eps / V) * (omega_sum * lse - wc), 0.0)
            if HAS_Z:
                loss += z_loss * omega * lse * lse
            # an out-of-range target poisons its loss: an error, never silent garbage
            loss = tl.where(valid & (~in_range), float("nan"), loss)
            tl.store(lse_ptr + row64, lse)
            tl.store(loss_ptr + row64, loss)
        else:
            lse = tl.load(lse_ptr + row64).to(tl.float32)

        if WRITE_GRAD:
            # an ignored token's gradient is 0 whatever its upstream g (F.cross_entropy's rule):
            # selected, as g·0 would turn an inf or NaN g into NaN in every dW row
            g = tl.where(valid, tl.load(g_ptr + row64 * g_stride).to(tl.float32), 0.0)
            h = 0.0
            if HAS_H:
                h = tl.load(h_ptr + row64).to(tl.float32)
            coef_p, coef_y, coef_w = _grad_coefs(g, h, lse, omega, mask_f, omega_sum, V, eps,
                                                 z_loss, HAS_Z, SMOOTH, HAS_H)
            # Backwards over the row: its most recently read tail is the likeliest to be in L2.
            n_blocks = tl.cdiv(n_cols, BLOCK_V)
            for i in tl.range(0, n_blocks, num_stages=STAGES):
                cols = (n_blocks - 1 - i) * BLOCK_V + offs
                cmask = cols < n_cols
                lmask = cols < n_load
                z = _logit(base, bias_ptr, col_offset, cols, lmask, cmask, HAS_BIAS)
                c = _cap(z, softcap, HAS_SOFTCAP)
                wv = 0.0
                if SMOOTH and HAS_CW:
                    wv = tl.load(cw_ptr + col_offset + cols, mask=cmask, other=0.0).to(tl.float32)
                d = _logit_grad(c, lse, coef_p, coef_y, coef_w, cols == y_local, wv, softcap,
                                SMOOTH, HAS_CW, HAS_SOFTCAP)
                if ROUND_BF16:  # the interpreter's cast truncates; the GPU rounds
                    d = round_bf16_bits(d)
                # the padding too (junk there, read by no GEMM): a bound that is a multiple
                # of 16 lets the store vectorize, as the loads
                tl.store(base + cols, d.to(logits_ptr.dtype.element_ty), mask=lmask)
