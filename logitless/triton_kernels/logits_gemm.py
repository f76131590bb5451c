"""Logits GEMMs in Triton with softmax work in their epilogues.

:func:`logits_with_stats` (the forward) and :func:`logit_grads` (a recomputing backward, the
log-sum-exp known: the epilogue writes dz instead of the logits, no row pass follows).

Both are ``x_c · Wᵀ`` as a persistent tensor-descriptor (TMA) GEMM. The forward's epilogue,
besides storing the
tile (rounded to the input dtype, without the bias: the row kernel adds it, as on the cuBLAS
path), reduces the tile's logits ``z = x_c·Wᵀ + b`` per row to the max and Σexp of the
soft-capped values: ``[rows, ceil(V / BN)]`` partial statistics. The row kernel then folds
them into the log-sum-exp (:mod:`.cross_entropy_rows`, ``FROM_TILES``) instead of streaming the
logits once for it: the chunk's softmax work becomes one read+write pass instead of two.

Statistics are taken of the logits as the row kernel reads them (stored product + bias), so
the loss and the gradient see the same numbers as with cuBLAS and a two-pass row kernel.
(The plain form, ``STATS=False`` with a live-row count, is the fast forward's logits GEMM on
Hopper by default: ``skip_ignored``, :mod:`.live_rows`.) The statistics form is opt-in
(``logits_gemm="triton"``): on an H100 (``benchmarks/logits_gemm_probe.py``) this GEMM is
~0.35 ms slower than cuBLAS per 3584-token Llama chunk and the pass it saves ~0.5 ms; the
dz epilogue saves ~0.1 ms per low-memory vocabulary block; whole fwd+bwd runs measured within
the ±2% run-to-run spread of the cuBLAS path (DESIGN.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .cross_entropy_rows import _cap, _finite_ref, _grad_coefs, _logit_grad, _target
from .fast_math import exp_from, form_for  # form_for(False): 16-bit operands only
from .narrow_cast import round_bf16_bits

# Tiles for Hopper (benchmarks/gemm_probe.py: 128x256x64, 3 stages, 8 warps, grouped by 16
# row tiles, flattened persistent loop, best of the configurations probed). The interpreter
# takes small tiles, so that tests cross several row, column and K tiles.
GPU_TILES = dict(bm=128, bn=256, bk=64, group_m=16, stages=3, warps=8)
INTERPRET_TILES = dict(bm=16, bn=32, bk=16, group_m=2, stages=1, warps=4)


@triton.jit
def grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a persistent GEMM's ``tile``-th output tile, in grouped
    order: GROUP_M row tiles share each column tile of B while it is in L2."""
    group = tile // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    gm = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % (GROUP_M * num_pid_n)) % gm, (tile % (GROUP_M * num_pid_n)) // gm


@triton.jit
def tile_product_into(acc, x_desc, w_desc, om, on, k_tiles, BK: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """``acc`` plus the fp32 tile of x·Wᵀ at rows ``om`` of x and rows ``on`` of W (a probe
    carries one accumulator through two heads' products: benchmarks/seq_dual_gemm_probe.py)."""
    for ki in range(k_tiles):
        a = x_desc.load([om, ki * BK])
        b = w_desc.load([on, ki * BK])
        if INTERPRET:  # the interpreter mis-computes half-precision dots: upcast
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _tile_product(x_desc, w_desc, om, on, k_tiles, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, INTERPRET: tl.constexpr):
    """The fp32 ``[BM, BN]`` tile of x·Wᵀ at rows ``om`` of x and rows ``on`` of W."""
    return tile_product_into(tl.zeros((BM, BN), dtype=tl.float32), x_desc, w_desc, om, on,
                             k_tiles, BK, INTERPRET)


@triton.jit
def logits_stats_kernel(x_desc, w_desc, z_desc, bias_ptr, stat_m_ptr, stat_s_ptr, live_ptr, M,
                        N, K, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, num_programs, INTERPRET: tl.constexpr,
                        WS: tl.constexpr = False, EXP_FORM: tl.constexpr = 0,
                        STATS: tl.constexpr = True, HAS_LIVE: tl.constexpr = False,
                        OFFSETS: tl.constexpr = False):
    """``STATS``: the per-tile statistics too (else the plain product); ``HAS_LIVE``: only
    the first ``*live_ptr`` rows (read from device memory, no host sync) are computed, the
    row tiles past them skipped (their rows of ``z`` keep what they held). ``OFFSETS`` (with
    ``STATS`` False): each row of a tile stored relative to its maximum o (fp32, into
    ``stat_m_ptr``), ``z − o`` in ``z``'s (16-bit) dtype: see :func:`logits_tile_offsets`."""
    pid = tl.program_id(0)
    if HAS_LIVE:
        M = tl.minimum(M, tl.load(live_ptr))
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(pid, num_tiles, num_programs, flatten=not INTERPRET, warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = _tile_product(x_desc, w_desc, om, on, k_tiles, BM, BN, BK, INTERPRET)
        cols = on + tl.arange(0, BN)
        cmask = cols < N
        if OFFSETS:
            o = tl.max(tl.where(cmask[None, :], acc, float("-inf")), 1)
            r = acc - o[:, None]
            # more than fp16's range below the maximum: saturated, not −inf (two −inf heads
            # would give d = NaN); its softmax weight e^(−65504/T) is 0 in fp32 for T < ~700.
            # NaN stays NaN (comparisons with it are false)
            r = tl.where(r < -65504.0, -65504.0, r)
            z_desc.store([om, on], r.to(z_desc.dtype))
            rows = (om + tl.arange(0, BM)).to(tl.int64)
            tl.store(stat_m_ptr + rows * num_pid_n + pid_n, o, mask=rows < M)
        else:
            if INTERPRET and z_desc.dtype == tl.bfloat16:
                acc = round_bf16_bits(acc)  # the interpreter's cast truncates; the GPU rounds
            zq = acc.to(z_desc.dtype)
            z_desc.store([om, on], zq)
        if STATS:
            z = zq.to(tl.float32)
            if HAS_BIAS:  # stored without it, as the cuBLAS path: the row kernel adds it
                z += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            c = _cap(z, softcap, HAS_SOFTCAP)
            c = tl.where(cmask[None, :], c, float("-inf"))
            m = tl.max(c, 1)
            # a tile of −inf logits (a vocabulary masked by a −inf bias): (−inf, 0), never NaN
            s = tl.sum(exp_from(c, _finite_ref(m)[:, None], EXP_FORM), 1)
            rows = (om + tl.arange(0, BM)).to(tl.int64)
            idx = rows * num_pid_n + pid_n
            tl.store(stat_m_ptr + idx, m, mask=rows < M)
            tl.store(stat_s_ptr + idx, s, mask=rows < M)


@triton.jit
def logits_grad_kernel(x_desc, w_desc, dz_desc, bias_ptr, y_ptr, cw_ptr, omega_sum_ptr, lse_ptr,
                       g_ptr, g_stride, h_ptr, M, N, K, col_offset, V, ignore_index, eps, z_loss,
                       softcap, num_programs, HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr,
                       SMOOTH: tl.constexpr, HAS_Z: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                       HAS_H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,
                       WS: tl.constexpr = False, EXP_FORM: tl.constexpr = 0):
    """dz of rows ``[0, M)`` and classes ``[col_offset, col_offset + N)`` straight from the
    GEMM's accumulator, the log-sum-exp being known (a recomputing backward): the logits are
    rounded to the input dtype as the forward's were, the bias joins in fp32, and the tile is
    rewritten into its gradient by the row kernel's own formula (``_logit_grad``). No logits
    are stored, and no pass over a logits block follows."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    if HAS_CW:
        omega_sum = tl.load(omega_sum_ptr).to(tl.float32)
    else:
        omega_sum = V * 1.0
    for tile in tl.range(pid, num_pid_m * num_pid_n, num_programs, flatten=not INTERPRET,
                         warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        # W's rows past this chunk (or past V: zeros) give junk columns that the store clips
        acc = _tile_product(x_desc, w_desc, om, col_offset + on, k_tiles, BM, BN, BK, INTERPRET)
        if INTERPRET and dz_desc.dtype == tl.bfloat16:
            acc = round_bf16_bits(acc)  # the interpreter's cast truncates; the GPU rounds
        z = acc.to(dz_desc.dtype).to(tl.float32)  # the logits as the forward rounded them
        cols = col_offset + on + tl.arange(0, BN)  # class indices
        cmask = cols < col_offset + N
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        c = _cap(z, softcap, HAS_SOFTCAP)
        rows = (om + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < M
        y = tl.load(y_ptr + rows, mask=rmask, other=ignore_index).to(tl.int64)
        valid, in_range, y_safe, omega, mask_f = _target(y, ignore_index, V, cw_ptr, HAS_CW)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        # an ignored token's gradient is 0 whatever its g (selected, as in the row kernel)
        g = tl.where(valid, tl.load(g_ptr + rows * g_stride, mask=rmask, other=0.0), 0.0)
        h = tl.zeros((BM,), dtype=tl.float32)
        if HAS_H:
            h = tl.load(h_ptr + rows, mask=rmask, other=0.0)
        coef_p, coef_y, coef_w = _grad_coefs(g, h, lse, omega, mask_f, omega_sum, V, eps, z_loss,
                                             HAS_Z, SMOOTH, HAS_H)
        wv = tl.zeros((BN,), dtype=tl.float32)
        if SMOOTH and HAS_CW:
            wv = tl.load(cw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        d = _logit_grad(c, lse[:, None], coef_p[:, None], coef_y[:, None], coef_w[:, None],
                        cols[None, :] == y_safe.to(tl.int32)[:, None], wv[None, :], softcap, SMOOTH,
                        HAS_CW, HAS_SOFTCAP, EXP_FORM)
        if INTERPRET and dz_desc.dtype == tl.bfloat16:
            d = round_bf16_bits(d)
        dz_desc.store([om, on], d.to(dz_desc.dtype))


def logit_grads(x: torch.Tensor, w: torch.Tensor, col_offset: int, out: torch.Tensor, bias, y,
                cw, omega_sum, lse, g, h, opts_t, interpret: bool, num_sms: int) -> None:
    """``out`` (``[rows of x, n]``) = dz of classes ``[col_offset, col_offset + n)`` for the
    known ``lse`` (:func:`logits_grad_kernel`): one GEMM, no logits block, no row pass.
    ``g``: the upstream gradient, (1,) or one per row; ``h``: that of lse, or None."""
    m, k = x.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return
    ignore_index, eps, z_loss, softcap = opts_t
    t, programs, descriptors = _persistent_launch(x, w, out, interpret, num_sms)
    logits_grad_kernel[(programs,)](
        *descriptors, lse if bias is None else bias, y,
        lse if cw is None else cw, lse if omega_sum is None else omega_sum, lse, g,
        0 if g.numel() == 1 else 1, lse if h is None else h, m, n, k, col_offset, w.shape[0],
        ignore_index, eps, z_loss, 1.0 if softcap is None else softcap, programs,
        HAS_BIAS=bias is not None, HAS_CW=cw is not None, SMOOTH=eps > 0, HAS_Z=z_loss > 0,
        HAS_SOFTCAP=softcap is not None, HAS_H=h is not None, BM=t["bm"], BN=t["bn"], BK=t["bk"],
        GROUP_M=t["group_m"], INTERPRET=interpret, WS=t.get("ws", False),
        EXP_FORM=form_for(False), num_stages=t["stages"], num_warps=t["warps"])


def _persistent_launch(x, w, out, interpret: bool, num_sms: int):
    """(tiles, programs, tensor descriptors of x, w, out) of a persistent GEMM writing ``out``:
    one program per SM, or per output tile where there are fewer."""
    t = tiles(interpret)
    bm, bn, bk = t["bm"], t["bn"], t["bk"]
    return t, persistent_programs(out.shape[0], out.shape[1], t, num_sms), (
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]))


def persistent_programs(m: int, n: int, t: dict, num_sms: int) -> int:
    """Programs of a persistent GEMM writing an ``[m, n]`` output in tiles ``t``: one per SM,
    or per output tile where there are fewer."""
    return max(1, min(num_sms, triton.cdiv(m, t["bm"]) * triton.cdiv(n, t["bn"])))


def tiles(interpret: bool) -> dict:
    return INTERPRET_TILES if interpret else GPU_TILES


def unsupported_options(dtype: torch.dtype, label_smoothing) -> str:
    """Why the op's dtype / options rule this GEMM out ('' when they do not)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it runs bfloat16/float16 inputs only (got {dtype}; fp32 would run as TF32)"
    if label_smoothing > 0:
        return "label smoothing needs a second pass over the logits (its sum of w_v*c_v)"
    return ""


def unsupported_layout(x: torch.Tensor, w: torch.Tensor, bias) -> str:
    """Why these tensors (layouts, device) rule this GEMM out ('' when they do not); ``x``
    None: ``w`` alone (the caller gathers the tokens' rows into a buffer of its own)."""
    if w.is_cuda and torch.cuda.get_device_capability(w.device)[0] not in (9, 10):
        return ("its tiles need a Hopper-class GPU's shared memory (compute capability 9.x or "
                f"10.x; this one is {torch.cuda.get_device_capability(w.device)})")
    for name, t in (("input", x), ("linear_weight", w)):
        if t is None:
            continue
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16:
            return (f"{name} must be row-major with 16-byte aligned rows for the tensor "
                    f"descriptors (strides {tuple(t.stride())})")
        if t.data_ptr() % 16:
            return (f"{name} must start at a 16-byte aligned address for the tensor "
                    f"descriptors (it starts {t.data_ptr() % 16} bytes past one: a view at an "
                    "odd column offset?)")
    if bias is not None and bias.stride(0) != 1:
        return "linear_bias must be contiguous"
    return ""


def logits_with_stats(x_c: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor,
                      stat_m, stat_s, softcap, interpret: bool, num_sms: int,
                      live=None) -> None:
    """``out = x_c·wᵀ`` and per (row, column tile) max / Σexp of the capped logits
    ``out + bias`` into ``stat_m`` / ``stat_s`` (``[rows, n_tiles]``, row-major, fp32); with
    ``stat_m`` None the product alone (bias and softcap unused). ``live``: an int32 device
    tensor (1,): only rows below it are computed (see :func:`logits_stats_kernel`)."""
    m, k = x_c.shape
    n = w.shape[0]
    if m == 0:
        return
    t, programs, descriptors = _persistent_launch(x_c, w, out, interpret, num_sms)
    stats = stat_m is not None
    dummy = stat_m if stats else out
    logits_stats_kernel[(programs,)](
        *descriptors, bias if (stats and bias is not None) else dummy, dummy,
        stat_s if stats else dummy, dummy if live is None else live, m, n, k,
        1.0 if softcap is None else softcap,
        HAS_BIAS=stats and bias is not None, HAS_SOFTCAP=stats and softcap is not None,
        BM=t["bm"], BN=t["bn"], BK=t["bk"], GROUP_M=t["group_m"], num_programs=programs,
        INTERPRET=interpret, WS=t.get("ws", False), EXP_FORM=form_for(False), STATS=stats,
        HAS_LIVE=live is not None, num_stages=t["stages"], num_warps=t["warps"])


def logits_tile_offsets(x_c: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                        offsets: torch.Tensor, interpret: bool, num_sms: int) -> None:
    """``x_c·wᵀ`` in 16 bits without losing what fp32 logits hold for a softmax: per row of
    each ``[BM, BN]`` output tile, o = the row's maximum over the tile's columns goes to
    ``offsets`` (``[rows, n_tiles]``, fp32, row-major) and ``z − o`` to ``out`` (fp16). The
    logits that matter for softmax work lie within a few units of their tile's maximum,
    where fp16 keeps 2⁻¹¹ or better: the JSD's gradients from logits stored so are as
    accurate as from fp32 ones at T = 1 (``benchmarks/jsd_logit_storage_probe.py``), at half
    the bytes, unless the two heads nearly agree (their small difference is rounded away).
    A remainder past fp16's range (65504 below the maximum) is saturated."""
    m, k = x_c.shape
    if m == 0:
        return
    if out.dtype != torch.float16 or offsets.dtype != torch.float32:
        raise TypeError(f"logits_tile_offsets writes fp16 logits and fp32 offsets, got "
                        f"{out.dtype} / {offsets.dtype}")
    n_tiles = stat_tiles(w.shape[0], interpret)
    if tuple(offsets.shape) != (m, n_tiles) or offsets.stride() != (n_tiles, 1):
        raise ValueError(f"offsets must be a contiguous [{m}, {n_tiles}] (rows, tiles) array, "
                         f"got shape {tuple(offsets.shape)}, strides {offsets.stride()}")
    t, programs, descriptors = _persistent_launch(x_c, w, out, interpret, num_sms)
    logits_stats_kernel[(programs,)](
        *descriptors, offsets, offsets, offsets, offsets, m, w.shape[0], k, 1.0,
        HAS_BIAS=False, HAS_SOFTCAP=False, BM=t["bm"], BN=t["bn"], BK=t["bk"],
        GROUP_M=t["group_m"], num_programs=programs, INTERPRET=interpret,
        WS=t.get("ws", False), EXP_FORM=form_for(False), STATS=False, HAS_LIVE=False,
        OFFSETS=True, num_stages=t["stages"], num_warps=t["warps"])


def stat_tiles(v: int, interpret: bool) -> int:
    """Column tiles per row of the statistics."""
    return triton.cdiv(v, tiles(interpret)["bn"])
