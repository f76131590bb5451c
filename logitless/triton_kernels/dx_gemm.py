"""dX = dz · W of a token chunk in Triton, for the live rows only (``skip_ignored``).

cuBLAS computes every row of a chunk; where each chunk's live tokens come first
(:mod:`.live_rows`) and their count sits in device memory, this persistent tensor-descriptor
(TMA) GEMM computes the row tiles below the count and stores zeros in the rest (those rows
of dX belong to ignored tokens; the caller's buffer may hold other data there), with no host
sync. ``dz [C, V]`` (the row kernel's output, rows padded) times ``W [V, H]`` (row-major),
fp32 accumulation, one rounding into dX's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .logits_gemm import INTERPRET_TILES, grouped_tile, persistent_programs
from .narrow_cast import round_bf16_bits

# Tiles for Hopper (benchmarks/logits_gemm_probe.py --dx-shapes); interpreted, the logits
# GEMM's small ones, so that tests cross several row, column and K tiles
GPU_TILES = dict(bm=128, bn=256, bk=64, group_m=8, stages=3, warps=8)


@triton.jit
def dx_kernel(a_desc, b_desc, c_desc, live_ptr, M, N, K, num_programs,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
              INTERPRET: tl.constexpr, HAS_LIVE: tl.constexpr, WS: tl.constexpr = False):
    pid = tl.program_id(0)
    live = M
    if HAS_LIVE:
        live = tl.minimum(M, tl.load(live_ptr))
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    live_m = tl.cdiv(live, BM)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(pid, live_m * num_pid_n, num_programs, flatten=not INTERPRET,
                         warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, live_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([ki * BK, on])
            if INTERPRET:  # the interpreter mis-computes half-precision dots: upcast
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if INTERPRET and c_desc.dtype == tl.bfloat16:
            acc = round_bf16_bits(acc)  # the interpreter's cast truncates; the GPU rounds
        c_desc.store([om, on], acc.to(c_desc.dtype))
    if HAS_LIVE:  # the ignored rows' tiles: zeros
        zero = tl.zeros((BM, BN), dtype=c_desc.dtype)
        for t in range(pid, (num_pid_m - live_m) * num_pid_n, num_programs):
            c_desc.store([(live_m + t // num_pid_n) * BM, (t % num_pid_n) * BN], zero)


def tiles(interpret: bool) -> dict:
    return INTERPRET_TILES if interpret else GPU_TILES


def dx_live(dz: torch.Tensor, w: torch.Tensor, out: torch.Tensor, live, interpret: bool,
            num_sms: int) -> None:
    """``out [C, H] = dz [C, V] · w [V, H]`` for the rows below ``live`` (an int32 device
    tensor (1,), or None: all), zeros in the rest. Operands as :func:`.logits_gemm.
    unsupported_layout` requires (row-major, 16-byte aligned rows and starts)."""
    m, k = dz.shape
    n = w.shape[1]
    if m == 0 or n == 0:
        return
    t = tiles(interpret)
    bm, bn, bk = t["bm"], t["bn"], t["bk"]
    programs = persistent_programs(m, n, t, num_sms)
    dx_kernel[(programs,)](
        TensorDescriptor.from_tensor(dz, [bm, bk]), TensorDescriptor.from_tensor(w, [bk, bn]),
        TensorDescriptor.from_tensor(out, [bm, bn]), out if live is None else live, m, n, k,
        programs, BM=bm, BN=bn, BK=bk, GROUP_M=t["group_m"], INTERPRET=interpret,
        HAS_LIVE=live is not None, WS=t.get("ws", False), num_stages=t["stages"],
        num_warps=t["warps"])
