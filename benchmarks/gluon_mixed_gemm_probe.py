"""Does a warp-specialized Gluon GEMM convert bf16 to fp16 at cuBLAS's speed? (#6's 2e-3)

The thirty-eighth session's ``mixed_gemm_probe.py`` measured the plain-Triton converting GEMM
(the bf16 operand transposed into wgmma's A, converted in registers) at 1.31-1.45x cuBLAS for
dX and 1.41x for dW, while the same kernel with both operands already fp16 ran at 0.99x: the
conversion, not the tiles, costs the time. Triton's loop (PTX, compiled for sm_90 on the CPU)
does the ldmatrix, the conversion and a CTA-wide ``bar.sync`` before every wgmma, and two more
``bar.sync`` around the TMA issue, in the same warps that issue the MMAs.

Here the same products with the loads moved to a producer warp (``gl.warp_specialize``): one
TMA warp fills a ring of stages and signals per-stage mbarriers; the 8 MMA warps (two warp
groups splitting each 128-row tile) wait on a stage, ldmatrix its A block into registers,
convert it, issue the wgmma asynchronously with one still in flight, and release the stage
of the wgmma that has completed. No CTA-wide barrier in the loop.

Products (the ``tr`` forms of ``mixed_gemm_probe``; output fp32, stored transposed by
pointers):
* dX: ``dXᵀ [H, C] = Wᵀ [H, V] · dz16ᵀ [V, C]``: A = W's [BK, BM] blocks, permuted; B = dz16's
  [BN, BK] blocks, permuted;
* dW: ``dWᵀ [H, V] += xᵀ [H, C] · dz16 [C, V]``: A = x's [BK, BM] blocks, permuted; B = dz16's
  [BK, BN] blocks; the fp32 accumulator read and written in the epilogue.
``CONVERT=False`` with fp16 A is the kernel's own speed without the conversion.

Gluon does not run under TRITON_INTERPRET, so this runs on a Hopper GPU only; ``--compile``
builds it for sm_90 on the CPU (no driver) and prints ptxas' registers, spills and warnings.

    python3 benchmarks/gluon_mixed_gemm_probe.py --out $OUT/gluon-mixed   (GPU)
    python3 benchmarks/gluon_mixed_gemm_probe.py --compile                (CPU)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma,
                                                              warpgroup_mma_init,
                                                              warpgroup_mma_wait)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[the box at ``coord``] += shared ``src``, by the TMA unit (cp.reduce.async.bulk
    .tensor .add; the adds happen in L2). Tracked like a TMA store (``tma.store_wait``).
    Gluon's hopper ``tma`` module has no wrapper for it; the builder op is in triton 3.6 and
    3.7."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of ``tile`` in GROUP_M-row super-tiles (L2 reuse of B across rows)."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, empty, ready, c_ptr, ldc, M, N, K, num_programs,
            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, B_T: gl.constexpr,
            GROUP_M: gl.constexpr, PIPE: gl.constexpr, PREFETCH_C: gl.constexpr):
    """The producer warp: every (tile, k) stage of this program into the ring, in order
    (``PIPE`` 2: an even number of k stages per tile, the last one past K zero-filled)."""
    stages: gl.constexpr = a_bufs.shape[0]
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    if PIPE == 2:
        k_tiles = gl.cdiv(K, 2 * BK) * 2
    i = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_tiles):
            s = i % stages
            # a fresh mbarrier counts as if its phase 1 had completed: the first pass waits
            # on nothing
            mbarrier.wait(empty.index(s), ((i // stages) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [ki * BK, pid_m * BM], bar, a_bufs.index(s))
            if B_T:
                tma.async_copy_global_to_shared(b_desc, [pid_n * BN, ki * BK], bar,
                                                b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [ki * BK, pid_n * BN], bar,
                                                b_bufs.index(s))
            if PREFETCH_C:
                if ki == k_tiles // 2:  # the epilogue's read-modify-write then hits L2
                    _prefetch_tile(c_ptr, ldc, M, N, pid_m * BM, pid_n * BN, BM, BN)
            i += 1


@gluon.jit
def _prefetch_tile(c_ptr, ldc, M, N, row0, col0, BM: gl.constexpr, BN: gl.constexpr):
    """Prefetch c[col0 : col0 + BN, row0 : row0 + BM] (fp32) into L2, 128-byte lines, from
    one warp; addresses past the tensor clamped to its last row / column."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // (BM // 32), BM // 32], [1, 1], [1, 0])
    lines = gl.arange(0, BM // 32, layout=gl.SliceLayout(0, layout))
    h = gl.minimum(row0 + lines * 32, M - 1)
    for r in range(BN // 32):
        v = gl.minimum(col0 + r * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, layout)),
                       N - 1)
        ptrs = c_ptr + v.to(gl.int64)[:, None] * ldc + h[None, :]
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stage_a(a_bufs, i, ready, a_layout: gl.constexpr, CONVERT: gl.constexpr):
    """Wait for stage ``i``'s operands; A's block into registers (fp16)."""
    stages: gl.constexpr = a_bufs.shape[0]
    s = i % stages
    mbarrier.wait(ready.index(s), (i // stages) & 1)
    a = a_bufs.index(s).permute((1, 0)).load(a_layout)
    if CONVERT:
        a = a.to(gl.float16)
    return a


@gluon.jit
def _stage_b(b_bufs, i, B_T: gl.constexpr):
    s = i % b_bufs.shape[0]
    if B_T:
        return b_bufs.index(s).permute((1, 0))
    else:
        return b_bufs.index(s)


@gluon.jit
def _mma(a_bufs, b_bufs, empty, ready, c_ptr, ldc, c_desc, c_bufs, M, N, K, num_programs,
         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, B_T: gl.constexpr,
         CONVERT: gl.constexpr, ADD: gl.constexpr, GROUP_M: gl.constexpr, PIPE: gl.constexpr,
         PIECES: gl.constexpr, EPI: gl.constexpr, num_warps: gl.constexpr):
    """The consumer warps: acc [BM, BN] = A · B over K per tile, the tile stored transposed
    into c [N, M] (fp32; ``ADD``: added to what c holds).

    A wgmma reads its register operand asynchronously, and ptxas does not keep a later
    write out of those registers: with one wgmma left in flight and the next stage's
    ldmatrix into the same registers, the products were wrong on the GPU. ``PIPE`` 0: wait
    for each wgmma before the next stage (no overlap). ``PIPE`` 2: two stages per loop
    iteration with their own register sets (K padded to an even number of stages with the
    TMA's zero fill); each set is a dependency of the wait that retires its wgmma, so it
    stays live, and its registers unwritten, until then."""
    stages: gl.constexpr = a_bufs.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    i = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = warpgroup_mma_init(gl.zeros((BM, BN), gl.float32, mma_layout))
        if PIPE == 0:
            for ki in range(k_tiles):
                a = _stage_a(a_bufs, i, ready, a_layout, CONVERT)
                acc = warpgroup_mma(a, _stage_b(b_bufs, i, B_T), acc, is_async=True)
                warpgroup_mma_wait(0, deps=(acc, a))
                mbarrier.arrive(empty.index(i % stages))
                i += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        else:
            a1 = gl.zeros((BM, BK), gl.float16, a_layout)
            for kk in range(0, k_tiles, 2):
                a0 = _stage_a(a_bufs, i, ready, a_layout, CONVERT)
                acc = warpgroup_mma(a0, _stage_b(b_bufs, i, B_T), acc, is_async=True)
                # retires the wgmma of the previous pair's second stage (a1)
                warpgroup_mma_wait(1, deps=(acc, a1))
                mbarrier.arrive(empty.index((i + stages - 1) % stages), pred=kk > 0)
                i += 1
                a1 = _stage_a(a_bufs, i, ready, a_layout, CONVERT)
                acc = warpgroup_mma(a1, _stage_b(b_bufs, i, B_T), acc, is_async=True)
                warpgroup_mma_wait(1, deps=(acc, a0))
                mbarrier.arrive(empty.index((i + stages - 1) % stages))
                i += 1
            acc = warpgroup_mma_wait(0, deps=(acc, a1))[0]
            mbarrier.arrive(empty.index((i + stages - 1) % stages))
        if EPI == 1:
            # through shared memory: each column piece, transposed, into one of two staging
            # buffers, added to c by the TMA unit while the next piece (and the next tile's
            # K loop) goes on; no load of c into registers
            pieces = _split_n(acc, PIECES)
            for j in gl.static_range(PIECES):
                staging = c_bufs.index(j % 2)
                tma.store_wait(1)  # the reduce that read this buffer two pieces ago is done
                staging.permute((1, 0)).store(pieces[j])
                fence_async_shared()
                _tma_reduce_add(c_desc, [pid_n * BN + j * (BN // PIECES), pid_m * BM], staging)
        elif PIECES == 1:
            _store_piece(acc, c_ptr, ldc, M, N, pid_m * BM, pid_n * BN, ADD)
        else:
            # in column pieces: one piece's loaded accumulator, offsets and pointers live at
            # a time (the whole tile's spilled: 2 KB of stack for dW)
            pieces = _split_n(acc, PIECES)
            for j in gl.static_range(PIECES):
                _store_piece(pieces[j], c_ptr, ldc, M, N, pid_m * BM,
                             pid_n * BN + j * (BN // PIECES), ADD)
    if EPI == 1:
        tma.store_wait(0)


@gluon.jit
def _split_n(x, PIECES: gl.constexpr):
    """x [R, C] as PIECES column pieces [R, C / PIECES], in column order (halving each piece
    along the register bits of its columns: no data moves)."""
    xs = (x, )
    for _ in gl.static_range(PIECES.bit_length() - 1):
        halves = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            halves += y.reshape(y.shape[0], 2, y.shape[1] // 2).permute(0, 2, 1).split()
        xs = halves
    return xs


@gluon.jit
def _store_piece(acc, c_ptr, ldc, M, N, row0, col0, ADD: gl.constexpr):
    """acc [R, C] into c[col0 + c, row0 + r] (fp32; ``ADD``: added to what is there)."""
    layout: gl.constexpr = acc.type.layout
    rows = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    base = c_ptr + col0.to(gl.int64) * ldc + row0
    offs = cols[None, :] * ldc + rows[:, None]  # int32: C · ldc < 2^31
    mask = (row0 + rows < M)[:, None] & (col0 + cols < N)[None, :]
    if ADD:
        acc = acc + gl.load(base + offs, mask=mask, other=0.0)
    gl.store(base + offs, acc, mask=mask)


LOADER_REGS = gl.constexpr(40)  # the producer warp's registers (its warp group's, per thread)


@gluon.jit
def mixed_ws_kernel(a_desc, b_desc, c_ptr, ldc, c_desc, M, N, K, num_programs,
                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                    STAGES: gl.constexpr, B_T: gl.constexpr, CONVERT: gl.constexpr,
                    ADD: gl.constexpr, GROUP_M: gl.constexpr, PIPE: gl.constexpr,
                    PIECES: gl.constexpr, PREFETCH_C: gl.constexpr, EPI: gl.constexpr,
                    num_warps: gl.constexpr):
    """c [N, M] (+)= (A [M, K] · B [K, N])ᵀ, persistent; A from a [K, M] descriptor (blocks
    [BK, BM]), B from a [N, K] (``B_T``, blocks [BN, BK]) or [K, N] one (blocks [BK, BN])."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if EPI == 1:  # ``EPI`` 1 (dW): c's pieces staged for the TMA's reduce, two buffers
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape,
                                           c_desc.layout)
    else:
        c_bufs = a_bufs
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(ready.index(s), count=1)
    gl.warp_specialize([
        (_mma, (a_bufs, b_bufs, empty, ready, c_ptr, ldc, c_desc, c_bufs, M, N, K, num_programs,
                BM, BN, BK, B_T, CONVERT, ADD, GROUP_M, PIPE, PIECES, EPI, num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, empty, ready, c_ptr, ldc, M, N, K,
                   num_programs, BM, BN, BK, B_T, GROUP_M, PIPE, ADD and PREFETCH_C)),
    ], [1], [LOADER_REGS])


# bm, bn, bk, stages, warps, group, pipe, epilogue pieces, dW's accumulator tile prefetched,
# dW's epilogue (0: pointer read-modify-write, 1: TMA reduce from shared memory)
CONFIGS = [(128, 256, 64, 4, 8, 8, 2, 8, False, 0), (128, 256, 64, 4, 8, 8, 2, 8, False, 1),
           (128, 256, 64, 3, 8, 8, 2, 4, False, 1), (128, 256, 64, 4, 8, 8, 2, 16, False, 1)]


def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def _gl_dtype(t):
    import torch
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]


def launch(gemm, a_op, dz16, out, cfg, num_sms):
    """One product: ``gemm`` "dx" (out [C, H] = dz16 [C, V] · W, ``a_op`` = W [V, H]) or "dw"
    (out [V, H] += dz16ᵀ · x, ``a_op`` = x [C, H]); ``a_op`` bf16 (converted) or fp16."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    bm, bn, bk, stages, warps, group, pipe, pieces, prefetch, epi = cfg
    a_block = [bk, bm]
    a_desc = TensorDescriptor.from_tensor(a_op, a_block, _layout(a_block, _gl_dtype(a_op)))
    dx = gemm == "dx"
    b_block = [bn, bk] if dx else [bk, bn]
    b_desc = TensorDescriptor.from_tensor(dz16, b_block, _layout(b_block, gl.float16))
    k, m = a_op.shape
    n = dz16.shape[0] if dx else dz16.shape[1]
    programs = max(1, min(num_sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)))
    c_block = [bn // pieces, bm]
    c_desc = TensorDescriptor.from_tensor(out, c_block, _layout(c_block, gl.float32))
    mixed_ws_kernel[(programs,)](a_desc, b_desc, out, out.stride(0), c_desc, m, n, k, programs,
                                 BM=bm, BN=bn, BK=bk, STAGES=stages, B_T=dx,
                                 CONVERT=a_op.dtype != dz16.dtype, ADD=not dx, GROUP_M=group,
                                 PIPE=pipe, PIECES=pieces, PREFETCH_C=prefetch,
                                 EPI=0 if dx else epi, num_warps=warps)


def compile_report(cfg=CONFIGS[0], arch=90):
    """Build every form for sm_``arch`` on the CPU: {form: ptxas' summary and warnings}."""
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from logitless.triton_kernels.jsd_rows import _cuda_tool
    bm, bn, bk, stages, warps, group, pipe, pieces, prefetch, epi = cfg
    c_block = [bn // pieces, bm]
    res = {}
    for gemm in ("dx", "dw"):
        for a_dt in ("bf16", "fp16"):
            a_gl = gl.bfloat16 if a_dt == "bf16" else gl.float16
            b_block = [bn, bk] if gemm == "dx" else [bk, bn]
            sig = dict(a_desc=f"tensordesc<{a_dt}[{bk},{bm}],{_layout([bk, bm], a_gl)!r}>",
                       b_desc=f"tensordesc<fp16[{b_block[0]},{b_block[1]}],"
                              f"{_layout(b_block, gl.float16)!r}>",
                       c_ptr="*fp32", ldc="i32",
                       c_desc=f"tensordesc<fp32[{c_block[0]},{c_block[1]}],"
                              f"{_layout(c_block, gl.float32)!r}>",
                       M="i32", N="i32", K="i32", num_programs="i32")
            cons = dict(BM=bm, BN=bn, BK=bk, STAGES=stages, B_T=gemm == "dx",
                        CONVERT=a_dt == "bf16", ADD=gemm == "dw", GROUP_M=group,
                        PIPE=pipe, PIECES=pieces, PREFETCH_C=prefetch,
                        EPI=0 if gemm == "dx" else epi, num_warps=warps)
            src = GluonASTSource(fn=mixed_ws_kernel, constexprs=cons,
                                 signature={**sig, **{k: "constexpr" for k in cons}},
                                 attrs={(2,): [["tt.divisibility", 16]],
                                        (3,): [["tt.divisibility", 16]]})
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": warps})
            ptx = compiled.asm["ptx"]
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.ptx")
                Path(path).write_text(ptx)
                r = subprocess.run([_cuda_tool("ptxas", arch), f"-arch=sm_{arch}a", "-v", path,
                                    "-o", os.path.join(d, "k.cubin")],
                                   capture_output=True, text=True)
            lines = [ln.strip() for ln in r.stderr.splitlines()
                     if "registers" in ln or "spill" in ln or "arning" in ln]
            count = {p: ptx.count(p) for p in ("wgmma.mma_async", "wgmma.wait_group",
                                               "ldmatrix", "cvt.rn.f16x2.f32", "bar.sync",
                                               "mbarrier.arrive", "mbarrier.try_wait")}
            res[f"{gemm}/{a_dt}"] = {"ptxas": lines, "rc": r.returncode, "ptx_counts": count,
                                     "shared_bytes": compiled.metadata.shared}
            if os.environ.get("GLUON_PROBE_DUMP"):
                Path(os.environ["GLUON_PROBE_DUMP"], f"{gemm}-{a_dt}.ptx").write_text(ptx)
                Path(os.environ["GLUON_PROBE_DUMP"], f"{gemm}-{a_dt}.ttgir").write_text(
                    compiled.asm["ttgir"])
    return res


def check(device="cuda"):
    """Every form at a small ragged shape against an fp64 product: {form: rel err}."""
    import torch

    from benchmarks import common
    from benchmarks.mixed_gemm_probe import make
    res = {}
    c, v, h = 384, 1000, 512  # partial tiles in every dimension, K not a multiple of BK
    dz16, w, x = make(c, v, h, device)
    ref_dx = dz16.double() @ w.double()
    ref_dw = dz16.double().T @ x.double()
    for cfg in CONFIGS:
        tag = "x".join(map(str, cfg))
        for a_dt in (torch.bfloat16, torch.float16):
            out = torch.zeros(c, h, dtype=torch.float32, device=device)
            launch("dx", w.to(a_dt), dz16, out, cfg, 8)
            res[f"dx/{a_dt}/{tag}"] = common.rel_err(out, ref_dx)
            acc = torch.ones(v, h, dtype=torch.float32, device=device)
            launch("dw", x.to(a_dt), dz16, acc, cfg, 8)
            res[f"dw/{a_dt}/{tag}"] = common.rel_err(acc - 1.0, ref_dw)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="build for sm_90 on the CPU only")
    ap.add_argument("--config", type=int, default=0, help="--compile: CONFIGS[this]")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.compile:
        print(json.dumps(compile_report(CONFIGS[a.config]), indent=1))
        return
    import torch

    from benchmarks import common
    from benchmarks.mixed_gemm_probe import make
    dev = "cuda"
    checked = check(dev)
    print(json.dumps(checked))
    wrong = {k: e for k, e in checked.items() if not e < 1e-5}
    if wrong:
        raise SystemExit(f"wrong on the GPU: {wrong}")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    c, v, h = a.chunk, a.vocab, a.hidden
    dz16, w, x = make(c, v, h, dev)
    dzb, w16, x16 = dz16.to(torch.bfloat16), w.half(), x.half()
    out = torch.empty(c, h, dtype=torch.float32, device=dev)
    acc = torch.zeros(v, h, dtype=torch.float32, device=dev)
    # the full shape once per dW form (many tiles per program, every TMA reduce in flight)
    # against fp32 cuBLAS over the same operands
    ref = torch.mm(dz16.float().T, x.float())
    for cfg in CONFIGS:
        acc.fill_(1.0)
        launch("dw", x, dz16, acc, cfg, num_sms)
        checked[f"full/dw/{'x'.join(map(str, cfg))}"] = common.rel_err(acc - 1.0, ref)
    del ref
    print(json.dumps({k: e for k, e in checked.items() if k.startswith("full/")}))
    wrong = {k: e for k, e in checked.items() if not e < 1e-5}
    if wrong:
        raise SystemExit(f"wrong on the GPU at the full shape: {wrong}")
    steps = {
        "dx/cublas-bf16": lambda: torch.mm(dzb, w, out_dtype=torch.float32),
        "dw/cublas-bf16": lambda: torch.addmm(acc, dzb.T, x, out_dtype=torch.float32, out=acc),
    }
    for cfg in CONFIGS:
        tag = "x".join(map(str, cfg))
        dx_tag = "x".join(map(str, cfg[:-1]))  # dX ignores the dW epilogue's form
        for name, wa, xa in (("convert", w, x), ("f16", w16, x16)):
            steps[f"dx/{name}/{dx_tag}"] = (lambda wa=wa, cfg=cfg:
                                            launch("dx", wa, dz16, out, cfg, num_sms))
            steps[f"dw/{name}/{tag}"] = (lambda xa=xa, cfg=cfg:
                                         launch("dw", xa, dz16, acc, cfg, num_sms))
    rows = []
    for gemm in ("dx", "dw"):
        names = [n for n in steps if n.startswith(gemm + "/")]
        ts = common.time_interleaved([steps[n] for n in names], device=dev, reps=a.reps,
                                     warmup_calls=2)
        base = ts[names.index(f"{gemm}/cublas-bf16")].median_ms
        for n, t in zip(names, ts):
            rows.append({"name": n, "ms": t.median_ms, "iqr_ms": t.iqr_ms,
                         "x_cublas_bf16": t.median_ms / base})
    rows.sort(key=lambda r: (r["name"][:2], r["ms"]))
    for r in rows:
        print(f"{r['name']:34s} {r['ms']:7.3f} ms  {r['x_cublas_bf16']:.3f}x  "
              f"(iqr {r['iqr_ms']:.3f})")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(
            {"env": common.environment(dev), "shape": dict(chunk=c, vocab=v, hidden=h),
             "rows": rows, "gpu_check": checked}, indent=1))


if __name__ == "__main__":
    main()
