"""The student's gradient GEMMs with an fp16 dz and bf16 operands (Gluon, Hopper only).

Why: JSD's logit gradient rounded to bf16 moves dX and dW by ~2.2e-3 (relative, against an
fp32 reference); rounded to fp16 under a power-of-two scale it moves them by 1.67e-3, the
floor set by the bf16 result itself (``benchmarks/mixed_gemm_probe.py --model``). cuBLAS
multiplies only like with like, and Triton's ``tl.dot`` with one operand converted in
registers ran at 1.31-1.45x cuBLAS (the conversion and a CTA-wide barrier sit in the MMA
warps' loop). Here the loads move to a producer warp (``gl.warp_specialize``): one TMA warp
fills a ring of stages; the 8 MMA warps take the bf16 operand from shared memory into
registers, convert it to fp16 there and issue the wgmma with it as A (wgmma can take A from
registers, B only from shared memory), one wgmma in flight. On an H200 at one 2048-token
chunk of Llama-3's head (``benchmarks/gluon_mixed_gemm_probe.py``): dX 0.99-1.01x cuBLAS's
bf16 GEMM, dW 0.94x cuBLAS's fp32-output addmm (its epilogue adds into the accumulator by the
TMA unit, see below).

Both products are computed transposed, so that the converted operand is A:

* dX: ``dXᵀ [H, C] = W_sᵀ [H, V] · dz16ᵀ [V, C]`` (A: W_s's ``[BK, BM]`` blocks read
  permuted; B: dz16's ``[BN, BK]`` blocks, permuted), each tile scaled and stored transposed
  into the fp32 ``[C, H]`` output by pointers;
* dW: ``dW_sᵀ [H, V] += x_sᵀ [H, C] · dz16 [C, V]`` (A: x_s's blocks; B: dz16's ``[BK, BN]``
  blocks), each tile scaled, written transposed into shared memory in column pieces and added
  to the fp32 ``[V, H]`` accumulator by ``cp.reduce.async.bulk.tensor .add`` (the adds happen
  in L2, the MMA warps go on; a pointer read-modify-write epilogue was 1.19x cuBLAS, a whole
  tile of it spilled) -- or stored there, for the first chunk.

Two traps, both found on the GPU: a wgmma reads its register operand asynchronously and ptxas
does not keep the next stage's ldmatrix out of those registers (wrong products, no warning):
two stages per loop iteration with their own register sets, each a dependency of the wait that
retires its wgmma (K padded to an even number of stages by the TMA's zero fill). And the
epilogue must not load the whole fp32 tile at once (2 KB of spills): column pieces.

Needs: compute capability 9.x, Triton with Gluon's Hopper API (3.6 and 3.7 both have it), H a
multiple of 8 and 16-byte aligned operand rows (:func:`supported`). Gluon does not run under
``TRITON_INTERPRET``; tests compile the kernels for sm_90 on the CPU
(:func:`compile_report`) and check their products on a GPU.
"""
from __future__ import annotations

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma,
                                                              warpgroup_mma_init,
                                                              warpgroup_mma_wait)

# 128 x 256 x 64 tiles, 4 stages (48 KiB each), 8 MMA warps + 1 TMA warp, grouped by 8 row
# tiles, dW's epilogue in 8 pieces of 32 columns (two 16 KiB staging buffers): the best of the
# probe's configurations (3 stages with 4 pieces 1.10x, 16 pieces the same as 8).
BM, BN, BK, STAGES, WARPS, GROUP_M, PIECES = 128, 256, 64, 4, 8, 8, 8
LOADER_REGS = 40    # the producer warp's registers per thread (more spilled the MMA warps)
EPI_POINTERS, EPI_TMA_ADD, EPI_TMA_STORE = 0, 1, 2


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[the box at ``coord``] += shared ``src`` by the TMA unit, tracked like a TMA store
    (``tma.store_wait``). Gluon's Hopper ``tma`` module wraps no reduce; its builder has the
    op (Triton 3.6 and 3.7)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of ``tile`` in GROUP_M-row super-tiles (B's columns reused from L2)."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, empty, ready, M, N, K, num_programs,
            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, B_T: gl.constexpr,
            GROUP_M: gl.constexpr):
    """The producer warp: every (tile, k) stage of this program into the ring, in order, an
    even number of k stages per tile (the one past K zero-filled by the TMA)."""
    stages: gl.constexpr = a_bufs.shape[0]
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, 2 * BK) * 2
    i = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_tiles):
            s = i % stages
            # a fresh mbarrier counts as if its phase 1 had completed: the first lap waits
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
            i += 1


@gluon.jit
def _stage_a(a_bufs, i, ready, a_scale, a_layout: gl.constexpr):
    """Wait for stage ``i``'s operands; A's block into registers, as fp16 (times ``a_scale``
    where that is not 1: a warp-uniform branch, the common case pays no multiply)."""
    stages: gl.constexpr = a_bufs.shape[0]
    s = i % stages
    mbarrier.wait(ready.index(s), (i // stages) & 1)
    a = a_bufs.index(s).permute((1, 0)).load(a_layout)
    if a_scale != 1.0:
        a16 = (a.to(gl.float32) * a_scale).to(gl.float16)
    else:
        a16 = a.to(gl.float16)
    return a16


@gluon.jit
def _stage_b(b_bufs, i, B_T: gl.constexpr):
    s = i % b_bufs.shape[0]
    if B_T:
        return b_bufs.index(s).permute((1, 0))
    else:
        return b_bufs.index(s)


@gluon.jit
def _split_n(x, PIECES: gl.constexpr):
    """x [R, C] as PIECES column pieces [R, C / PIECES], in column order (each halving splits
    the register bits of the columns: no data moves)."""
    xs = (x, )
    for _ in gl.static_range(PIECES.bit_length() - 1):
        halves = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            halves += y.reshape(y.shape[0], 2, y.shape[1] // 2).permute(0, 2, 1).split()
        xs = halves
    return xs


@gluon.jit
def _store_piece(acc, c_ptr, ldc, M, N, row0, col0):
    """acc [R, C] into c[col0 + c, row0 + r] (fp32, by pointers)."""
    layout: gl.constexpr = acc.type.layout
    rows = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    base = c_ptr + col0.to(gl.int64) * ldc + row0
    offs = cols[None, :] * ldc + rows[:, None]  # int32: a piece spans < 2^31 elements
    mask = (row0 + rows < M)[:, None] & (col0 + cols < N)[None, :]
    gl.store(base + offs, acc, mask=mask)


@gluon.jit
def _mma(a_bufs, b_bufs, empty, ready, c_ptr, ldc, c_desc, c_bufs, a_scale_ptr, scale_ptr, M,
         N, K, num_programs, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
         B_T: gl.constexpr, GROUP_M: gl.constexpr, PIECES: gl.constexpr, EPI: gl.constexpr,
         num_warps: gl.constexpr):
    """The consumer warps: acc [BM, BN] = (A·``*a_scale_ptr``) · B over K per tile, times
    ``*scale_ptr``, into c [N, M] transposed (``EPI``: by pointers, or added / stored by the
    TMA)."""
    stages: gl.constexpr = a_bufs.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    scale = gl.load(scale_ptr)
    a_scale = gl.load(a_scale_ptr)
    i = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = warpgroup_mma_init(gl.zeros((BM, BN), gl.float32, mma_layout))
        # two stages per iteration, each with its own A registers (see the module doc)
        a1 = gl.zeros((BM, BK), gl.float16, a_layout)
        for kk in range(0, k_tiles, 2):
            a0 = _stage_a(a_bufs, i, ready, a_scale, a_layout)
            acc = warpgroup_mma(a0, _stage_b(b_bufs, i, B_T), acc, is_async=True)
            warpgroup_mma_wait(1, deps=(acc, a1))  # retires the wgmma that read a1
            mbarrier.arrive(empty.index((i + stages - 1) % stages), pred=kk > 0)
            i += 1
            a1 = _stage_a(a_bufs, i, ready, a_scale, a_layout)
            acc = warpgroup_mma(a1, _stage_b(b_bufs, i, B_T), acc, is_async=True)
            warpgroup_mma_wait(1, deps=(acc, a0))
            mbarrier.arrive(empty.index((i + stages - 1) % stages))
            i += 1
        acc = warpgroup_mma_wait(0, deps=(acc, a1))[0]
        mbarrier.arrive(empty.index((i + stages - 1) % stages))
        pieces = _split_n(acc * scale, PIECES)
        for j in gl.static_range(PIECES):
            col0 = pid_n * BN + j * (BN // PIECES)
            if EPI == 0:
                _store_piece(pieces[j], c_ptr, ldc, M, N, pid_m * BM, col0)
            else:
                staging = c_bufs.index(j % 2)
                tma.store_wait(1)  # the TMA op that read this buffer two pieces ago is done
                staging.permute((1, 0)).store(pieces[j])
                fence_async_shared()
                if EPI == 1:
                    _tma_reduce_add(c_desc, [col0, pid_m * BM], staging)
                else:
                    tma.async_copy_shared_to_global(c_desc, [col0, pid_m * BM], staging)
    if EPI != 0:
        tma.store_wait(0)


@gluon.jit
def mixed_gemm_kernel(a_desc, b_desc, c_ptr, ldc, c_desc, a_scale_ptr, scale_ptr, M, N, K,
                      num_programs,
                      BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, B_T: gl.constexpr, GROUP_M: gl.constexpr,
                      PIECES: gl.constexpr, EPI: gl.constexpr, LOADER_REGS: gl.constexpr,
                      num_warps: gl.constexpr):
    """c [N, M] (+)= scale · ((a_scale·A) [M, K] · B [K, N])ᵀ, persistent; A bf16 from a [K, M]
    descriptor (blocks [BK, BM]); B fp16 from a [N, K] (``B_T``, blocks [BN, BK]) or a [K, N]
    descriptor (blocks [BK, BN])."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if EPI != 0:  # c's pieces staged for the TMA, two buffers
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape,
                                           c_desc.layout)
    else:
        c_bufs = a_bufs
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(ready.index(s), count=1)
    gl.warp_specialize([
        (_mma, (a_bufs, b_bufs, empty, ready, c_ptr, ldc, c_desc, c_bufs, a_scale_ptr,
                scale_ptr, M, N, K, num_programs, BM, BN, BK, B_T, GROUP_M, PIECES, EPI,
                num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, empty, ready, M, N, K, num_programs, BM,
                   BN, BK, B_T, GROUP_M)),
    ], [1], [LOADER_REGS])


# ----------------------------------------------------------------------------- host side
def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def _aligned(t: torch.Tensor, check_address: bool = True) -> bool:
    """A TMA operand: rows contiguous and apart (no overlapping or broadcast rows), row
    stride and (``check_address``) base 16-byte aligned."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])
            and (t.stride(0) * t.element_size()) % 16 == 0
            and (not check_address or t.data_ptr() % 16 == 0))


def supported(w: torch.Tensor, x: torch.Tensor, check_address: bool = True) -> bool:
    """Can this module run the student's GEMMs for head ``w [V, H]`` and tokens ``x [N, H]``
    (a Hopper GPU, bf16, aligned rows)? A host-side check of shapes and properties only
    (``check_address=False``: not of the data pointers, which a traced graph does not see)."""
    if not (w.is_cuda and x.is_cuda) or w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(w.device)[0] != 9:
        return False
    return (_aligned(w, check_address) and _aligned(x, check_address)
            and w.shape[1] % 8 == 0)


def _programs(m, n, device):
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms, triton.cdiv(m, BM) * triton.cdiv(n, BN)))


def dx_(dz16: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: torch.Tensor,
        w_scale: torch.Tensor) -> None:
    """``out [C, H] = scale · dz16 [C, V] · fp16(w_scale · w) [V, H]`` (fp32 out, fp16 dz16,
    bf16 w; the scales (1,) fp32 device tensors, ``w_scale`` from ``linear_jsd._range_scale``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    c, v = dz16.shape
    h = w.shape[1]
    if c == 0:
        return
    assert out.shape == (c, h) and out.dtype == torch.float32 and out.stride(1) == 1
    a_desc = TensorDescriptor.from_tensor(w, [BK, BM], _layout([BK, BM], gl.bfloat16))
    b_desc = TensorDescriptor.from_tensor(dz16, [BN, BK], _layout([BN, BK], gl.float16))
    progs = _programs(h, c, w.device)
    mixed_gemm_kernel[(progs,)](a_desc, b_desc, out, out.stride(0), a_desc, w_scale, scale, h,
                                c, v, progs, BM=BM, BN=BN, BK=BK, STAGES=STAGES, B_T=True,
                                GROUP_M=GROUP_M, PIECES=PIECES, EPI=EPI_POINTERS,
                                LOADER_REGS=LOADER_REGS, num_warps=WARPS)


def dw_(dz16: torch.Tensor, x: torch.Tensor, acc: torch.Tensor, scale: torch.Tensor,
        x_scale: torch.Tensor, first: bool) -> None:
    """``acc [V, H] (+)= scale · dz16ᵀ · fp16(x_scale · x)`` (``dz16 [C, V]`` fp16, ``x [C, H]``
    bf16, ``acc`` fp32 with 16-byte aligned rows; ``first``: assign instead of add)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    c, v = dz16.shape
    h = x.shape[1]
    assert acc.shape == (v, h) and acc.dtype == torch.float32 and _aligned(acc)
    if c == 0:
        if first:
            acc.zero_()
        return
    c_block = [BN // PIECES, BM]
    a_desc = TensorDescriptor.from_tensor(x, [BK, BM], _layout([BK, BM], gl.bfloat16))
    b_desc = TensorDescriptor.from_tensor(dz16, [BK, BN], _layout([BK, BN], gl.float16))
    c_desc = TensorDescriptor.from_tensor(acc, c_block, _layout(c_block, gl.float32))
    progs = _programs(h, v, x.device)
    mixed_gemm_kernel[(progs,)](a_desc, b_desc, acc, acc.stride(0), c_desc, x_scale, scale, h,
                                v, c, progs, BM=BM, BN=BN, BK=BK, STAGES=STAGES, B_T=False,
                                GROUP_M=GROUP_M, PIECES=PIECES,
                                EPI=EPI_TMA_STORE if first else EPI_TMA_ADD,
                                LOADER_REGS=LOADER_REGS, num_warps=WARPS)


def compile_report(arch: int = 90) -> dict:
    """Build each form for sm_``arch`` without a GPU: {form: ptxas' register / spill lines,
    its return code, the shared memory it takes}."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .jsd_rows import _cuda_tool
    res = {}
    for name, b_t, epi in (("dx", True, EPI_POINTERS), ("dw-add", False, EPI_TMA_ADD),
                           ("dw-store", False, EPI_TMA_STORE)):
        b_block = [BN, BK] if b_t else [BK, BN]
        c_block = [BN // PIECES, BM] if epi else [BK, BM]
        c_dt = gl.float32 if epi else gl.bfloat16
        sig = dict(a_desc=f"tensordesc<bf16[{BK},{BM}],{_layout([BK, BM], gl.bfloat16)!r}>",
                   b_desc=f"tensordesc<fp16[{b_block[0]},{b_block[1]}],"
                          f"{_layout(b_block, gl.float16)!r}>",
                   c_ptr="*fp32", ldc="i32",
                   c_desc=f"tensordesc<{'fp32' if epi else 'bf16'}[{c_block[0]},{c_block[1]}],"
                          f"{_layout(c_block, c_dt)!r}>",
                   a_scale_ptr="*fp32", scale_ptr="*fp32", M="i32", N="i32", K="i32", num_programs="i32")
        cons = dict(BM=BM, BN=BN, BK=BK, STAGES=STAGES, B_T=b_t, GROUP_M=GROUP_M,
                    PIECES=PIECES, EPI=epi, LOADER_REGS=LOADER_REGS, num_warps=WARPS)
        src = GluonASTSource(fn=mixed_gemm_kernel, constexprs=cons,
                             signature={**sig, **{k: "constexpr" for k in cons}},
                             attrs={(2,): [["tt.divisibility", 16]]})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": WARPS})
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            Path(path).write_text(compiled.asm["ptx"])
            r = subprocess.run([_cuda_tool("ptxas", arch), f"-arch=sm_{arch}a", "-v", path,
                                "-o", os.path.join(d, "k.cubin")], capture_output=True,
                               text=True)
        res[name] = dict(ptxas=[ln.strip() for ln in r.stderr.splitlines()
                                if "registers" in ln or "spill" in ln or "arning" in ln],
                         rc=r.returncode, shared_bytes=compiled.metadata.shared,
                         ptx=compiled.asm["ptx"])
    return res
