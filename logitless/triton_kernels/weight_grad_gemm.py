"""The fast mode's weight-gradient GEMM: ``acc (+)= dz[:, cols]ᵀ · x_c`` into an fp32
accumulator, as a persistent tensor-descriptor (TMA) GEMM of ours.

Each output tile's accumulator starts from the tile already in ``acc`` (loaded before the
tile's K loop, so its latency hides behind the loop's first operand loads), sums the chunk's
tokens in fp32 on the tensor cores and is stored back once: the same one fp32 sum per chunk as
cuBLAS's ``addmm(out_dtype=float32)``. Measured against that on an H100 by
``benchmarks/grad_overlap_probe.py`` (see DESIGN.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .logits_gemm import grouped_tile

# Hopper: 128 vocabulary rows x 128 hidden columns of fp32 per tile (its load / store staging
# plus 4 stages of operands fit the shared memory; a 128 x 256 fp32 tile does not with 3).
GPU_TILES = dict(bm=128, bn=128, bk=64, group_m=8, stages=4, warps=8)
INTERPRET_TILES = dict(bm=16, bn=32, bk=16, group_m=2, stages=1, warps=4)


@triton.jit
def dw_accumulate_kernel(dz_desc, x_desc, acc_desc, acc_ptr, M, N, K, col_offset, num_programs,
                         FIRST: tl.constexpr, C_PTR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,
                         WS: tl.constexpr = False):
    """acc[m, n] (+)= Σ_k dz[k, col_offset + m]·x[k, n] for the ``[M, N]`` accumulator; K
    tokens. Columns of dz past ``col_offset + M`` (another accumulator's rows) only reach
    rows past M, which the store clips; tokens past K and classes past dz's width load as 0."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(pid, num_pid_m * num_pid_n, num_programs, flatten=not INTERPRET,
                         warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        rows = (om + tl.arange(0, BM)).to(tl.int64)
        cols = on + tl.arange(0, BN)
        cmask = (rows[:, None] < M) & (cols[None, :] < N)
        if FIRST:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        elif C_PTR:  # through registers: no shared-memory staging of the fp32 tile
            acc = tl.load(acc_ptr + rows[:, None] * N + cols[None, :], mask=cmask, other=0.0)
        else:
            acc = acc_desc.load([om, on])
        for ki in range(k_tiles):
            a = dz_desc.load([ki * BK, col_offset + om])  # [BK, BM]: dz's rows are tokens
            b = x_desc.load([ki * BK, on])
            if INTERPRET:  # the interpreter mis-computes half-precision dots: upcast
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a.T, b, acc)
        if C_PTR:
            tl.store(acc_ptr + rows[:, None] * N + cols[None, :], acc, mask=cmask)
        else:
            acc_desc.store([om, on], acc)


def tiles(interpret: bool) -> dict:
    return INTERPRET_TILES if interpret else GPU_TILES


def accumulate_(acc: torch.Tensor, dz: torch.Tensor, col_offset: int, x_c: torch.Tensor,
                first: bool, interpret: bool, num_sms: int, tile_cfg=None) -> None:
    """``acc (+)= dz[:, col_offset : col_offset + rows(acc)]ᵀ · x_c`` (``acc = …`` when
    ``first``). ``acc``: fp32 ``[rows, H]``, contiguous; ``dz``: ``[tokens, V]`` and ``x_c``
    ``[tokens, H]`` in one half-precision dtype, row-major with 16-byte aligned rows."""
    m, n = acc.shape
    k = x_c.shape[0]
    if m == 0 or n == 0:
        return
    if k == 0:
        if first:
            acc.zero_()
        return
    t = tile_cfg or tiles(interpret)
    bm, bn, bk = t["bm"], t["bn"], t["bk"]
    programs = max(1, min(num_sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)))
    dw_accumulate_kernel[(programs,)](
        TensorDescriptor.from_tensor(dz, [bk, bm]), TensorDescriptor.from_tensor(x_c, [bk, bn]),
        TensorDescriptor.from_tensor(acc, [bm, bn]), acc, m, n, k, col_offset, programs,
        FIRST=first, C_PTR=t.get("c_ptr", False), BM=bm, BN=bn, BK=bk, GROUP_M=t["group_m"], INTERPRET=interpret,
        WS=t.get("ws", False), num_stages=t["stages"], num_warps=t["warps"])
