"""Both JSD heads' fp16 tile logits from one GEMM at full tile width: what does it cost?

The fp16 tiles path (``fp16_tile_logits``) is faster than torch.compile, but nearly equal heads
lose their difference to each head's own rounding, which is why it is opt-in. The probe's
``-choice`` form (``jsd_logit_storage_probe.py``, s37) keeps every regime at fp32 logits'
gradients: per teacher element the smaller of its remainder below its own tile maximum and its
exact difference from the student, rounded to the nearest fp16 whose lowest bit records which.
That needs both heads' exact tiles in one epilogue. Two 128 × 256 fp32 accumulators are the
whole register file, and s37's two 128 × 128 ones cost 1.154x the two one-head GEMMs.

Here one program computes the student's 128 × 256 tile, stores its fp16 form, parks the exact
fp32 tile in a per-program scratch slot (128 KiB, L2-resident: 132 slots are 17 MiB), then
computes the teacher's tile in the same registers and encodes it against the parked student.
Modes (``--modes``):

* ``seq``: both tiles in one program, each stored as plain tile offsets (no scratch): the cost
  of two K loops per persistent tile;
* ``seq-scratch``: ``seq`` plus the scratch round trip;
* ``choice``: the full epilogue (the choice encoding, and the teacher's tile maxima as the row
  kernel would rebuild it);
* ``choice-halves``: ``choice`` with the scratch through block pointers and the epilogue (and
  the fp16 stores) in two column halves, to hold fewer registers at once;

against two ``logits_gemm.logits_tile_offsets`` calls (the library's tiles GEMMs), interleaved.

Measured (H200, thirty-eighth session, ``results/nvidia-h200-s38-seq-dual-gemm-*.json``): one
accumulator carried from −z_s into the teacher's K loop (``seq``, so that it ends as
z_t − z_s) runs at 1.026-1.036x the two GEMMs (two zero-initialised accumulators, the first
version: 4.7x, spilling); parking the exact student 1.14x; the choice epilogue 1.9-2.1x
(200-650 spills): the exact student and the teacher's tile do not fit the registers together
at 128 × 256, and the epilogue does not overlap the next tile's K loop.

    python3 benchmarks/seq_dual_gemm_probe.py            (GPU: timing)
    TRITON_INTERPRET=1 python3 benchmarks/seq_dual_gemm_probe.py --check   (CPU: the encoding)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks import common
from logitless.triton_kernels import logits_gemm
from logitless.triton_kernels.logits_gemm import grouped_tile, tile_product_into

MODES = {"seq": 0, "seq-scratch": 1, "choice": 2, "choice-halves": 3}


@triton.jit
def _sat16(r):
    return tl.where(r < -65504.0, -65504.0, tl.where(r > 65504.0, 65504.0, r)).to(tl.float16)


@triton.jit
def _choice_round16(val, use):
    """``val`` to the nearest fp16 whose lowest mantissa bit is ``use``: int16 bits."""
    r = _sat16(val)
    bits = r.to(tl.int16, bitcast=True)
    wrong = (bits & 1) != use.to(tl.int16)
    mag = bits & 0x7FFF
    up = ((tl.abs(val) > tl.abs(r.to(tl.float32))) | (mag == 0)) & (mag != 0x7BFF)
    return tl.where(wrong, bits + tl.where(up, 1, -1).to(tl.int16), bits)


@triton.jit
def _halves(x, BM: tl.constexpr, BN: tl.constexpr):
    """Columns [0, BN/2) and [BN/2, BN) of a [BM, BN] tile (in the accumulator's layout a
    thread's registers split in two: no data movement, if the compiler sees it)."""
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _choice_tile(d, zs, o_s, o_t, zt_desc, om, on, cmask):
    """The teacher's (half) tile against the exact student zs, d = z_t − z_s, o_t its tile-row
    maxima: the choice encoding stored; returns the row maxima of the teacher as the row
    kernel would rebuild it (for pass 1)."""
    own = d + zs - o_t[:, None]
    use = tl.abs(d) < tl.abs(own)
    bits = _choice_round16(tl.where(use, d, own), use)
    zt_desc.store([om, on], bits.to(tl.float16, bitcast=True))
    v = bits.to(tl.float16, bitcast=True).to(tl.float32)  # the bit is part of the value
    zs_hat = _sat16(zs - o_s[:, None]).to(tl.float32) + o_s[:, None]
    rebuilt = tl.where(use, zs_hat + v, o_t[:, None] + v)
    return tl.max(tl.where(cmask[None, :], rebuilt, float("-inf")), 1)


@triton.jit
def seq_dual_kernel(xs_desc, ws_desc, xt_desc, wt_desc, zs_desc, zt_desc, zsh_desc, zth_desc,
                    os_ptr,
                    ot_ptr, omax_ptr, scratch_ptr, M, N, KS, KT, num_programs, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    INTERPRET: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    loc = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    slot = scratch_ptr + pid.to(tl.int64) * (BM * BN) + loc
    for tile in tl.range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        rows = (om + tl.arange(0, BM)).to(tl.int64)
        idx = rows * num_pid_n + pid_n
        cmask = (on + tl.arange(0, BN)) < N
        acc = tile_product_into(tl.zeros((BM, BN), dtype=tl.float32), xs_desc, ws_desc, om,
                                on, tl.cdiv(KS, BK), BK, INTERPRET)
        o_s = tl.max(tl.where(cmask[None, :], acc, float("-inf")), 1)
        if MODE == 3:  # half-tile stores: half the shared memory to stage them
            q0, q1 = _halves(_sat16(acc - o_s[:, None]), BM, BN)
            zsh_desc.store([om, on], q0)
            zsh_desc.store([om, on + BN // 2], q1)
        else:
            zs_desc.store([om, on], _sat16(acc - o_s[:, None]))
        tl.store(os_ptr + idx, o_s, mask=rows < M)
        if MODE == 1 or MODE == 2:
            tl.store(slot, acc)
        if MODE == 3:  # the exact student parked in two halves through block pointers
            s0, s1 = _halves(acc, BM, BN)
            tl.store(tl.make_block_ptr(scratch_ptr, (num_programs * BM, BN), (BN, 1),
                                       (pid * BM, 0), (BM, BN // 2), (1, 0)), s0)
            tl.store(tl.make_block_ptr(scratch_ptr, (num_programs * BM, BN), (BN, 1),
                                       (pid * BM, BN // 2), (BM, BN // 2), (1, 0)), s1)
        # the same registers go on into the teacher's product from −z_s: d = z_t − z_s (two
        # zero-initialised accumulators were two live 128 × 256 tiles: the whole register file)
        acc = tile_product_into(-acc, xt_desc, wt_desc, om, on, tl.cdiv(KT, BK), BK, INTERPRET)
        if MODE == 0:  # timing only: d stored as is
            o_t = tl.max(tl.where(cmask[None, :], acc, float("-inf")), 1)
            zt_desc.store([om, on], _sat16(acc))
        elif MODE == 1:
            o_t = tl.max(tl.where(cmask[None, :], acc, float("-inf")), 1)
            zt_desc.store([om, on], _sat16(acc + 0.0 * tl.load(slot)))
        elif MODE == 3:
            d0, d1 = _halves(acc, BM, BN)
            p0 = tl.make_block_ptr(scratch_ptr, (num_programs * BM, BN), (BN, 1), (pid * BM, 0),
                                   (BM, BN // 2), (1, 0))
            p1 = tl.make_block_ptr(scratch_ptr, (num_programs * BM, BN), (BN, 1),
                                   (pid * BM, BN // 2), (BM, BN // 2), (1, 0))
            c0, c1 = _halves(cmask[None, :] & (tl.zeros((BM, BN), dtype=tl.int32) == 0), BM, BN)
            m0 = tl.max(tl.where(c0, d0 + tl.load(p0), float("-inf")), 1)
            m1 = tl.max(tl.where(c1, d1 + tl.load(p1), float("-inf")), 1)
            o_t = tl.maximum(m0, m1)
            h = on + tl.arange(0, BN // 2)
            r0 = _choice_tile(d0, tl.load(p0), o_s, o_t, zth_desc, om, on, h < N)
            r1 = _choice_tile(d1, tl.load(p1), o_s, o_t, zth_desc, om, on + BN // 2,
                              h + BN // 2 < N)
            tl.store(omax_ptr + idx, tl.maximum(r0, r1), mask=rows < M)
        else:
            zs = tl.load(slot)
            o_t = tl.max(tl.where(cmask[None, :], acc + zs, float("-inf")), 1)
            tl.store(omax_ptr + idx, _choice_tile(acc, zs, o_s, o_t, zt_desc, om, on, cmask),
                     mask=rows < M)
        tl.store(ot_ptr + idx, o_t, mask=rows < M)


def seq_dual(xs, ws, xt, wt, zs, zt, os_, ot, omax, scratch, mode, t, num_sms, interpret):
    m, n = xs.shape[0], ws.shape[0]
    bm, bn, bk = t["bm"], t["bn"], t["bk"]
    programs = max(1, min(num_sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)))
    desc = lambda a, rows: TensorDescriptor.from_tensor(a, [rows, bk])  # noqa: E731
    return seq_dual_kernel[(programs,)](
        desc(xs, bm), desc(ws, bn), desc(xt, bm), desc(wt, bn),
        TensorDescriptor.from_tensor(zs, [bm, bn]), TensorDescriptor.from_tensor(zt, [bm, bn]),
        TensorDescriptor.from_tensor(zs, [bm, bn // 2]),
        TensorDescriptor.from_tensor(zt, [bm, bn // 2]), os_, ot, omax, scratch, m, n, xs.shape[1], xt.shape[1], programs, BM=bm, BN=bn, BK=bk,
        GROUP_M=t["group_m"], INTERPRET=interpret, MODE=MODES[mode], num_stages=t["stages"],
        num_warps=t["warps"])


def buffers(m, n, t, device, programs):
    tiles = triton.cdiv(n, t["bn"])
    f16 = lambda: torch.empty(m, n, dtype=torch.float16, device=device)  # noqa: E731
    f32 = lambda: torch.empty(m, tiles, dtype=torch.float32, device=device)  # noqa: E731
    return (f16(), f16(), f32(), f32(), f32(),
            torch.empty(programs * t["bm"] * t["bn"], dtype=torch.float32, device=device))


def np_choice(zs, zt, bn):
    """The encoding in NumPy (jsd_logit_storage_probe.choice_round16's rule)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from jsd_logit_storage_probe import choice_round16
    v = zt.shape[1]
    pad = lambda a: np.pad(a, ((0, 0), (0, -v % bn)), constant_values=-np.inf)  # noqa: E731
    o = np.repeat(pad(zt).reshape(zt.shape[0], -1, bn).max(2), bn, axis=1)[:, :v]
    own, dif = (zt - o).astype(np.float32), (zt - zs).astype(np.float32)
    use = np.abs(dif) < np.abs(own)
    return choice_round16(np.where(use, dif, own), use).astype(np.float16)


def check(mode="choice"):
    interpret = not torch.cuda.is_available()
    dev = "cpu" if interpret else "cuda"
    t = logits_gemm.tiles(interpret)
    m, n, k = 40, 100, 48
    g = torch.Generator(device=dev).manual_seed(0)
    xs = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    ws = torch.randn(n, k, generator=g, device=dev).to(torch.bfloat16)
    xt = (xs.float() + 1e-3 * torch.randn(m, k, generator=g, device=dev)).to(torch.bfloat16)
    wt = torch.where(torch.arange(n, device=dev)[:, None] % 2 == 0, ws,
                     torch.randn(n, k, generator=g, device=dev).to(torch.bfloat16))
    out = buffers(m, n + (-n % 8), t, dev, 8)
    zs, zt = out[0][:, :n], out[1][:, :n]
    seq_dual(xs, ws, xt, wt, zs, zt, *out[2:], mode, t, 8, interpret)
    # the rule applied to fp32 products (the GEMM's own sums differ from them only in the
    # order of additions: an ulp of z, which can tip a rounding of the small differences)
    ref_s = (xs.float() @ ws.float().T).cpu().numpy()
    ref_t = (xt.float() @ wt.float().T).cpu().numpy()
    want = np_choice(ref_s, ref_t, t["bn"])
    got = zt.cpu().numpy()
    same = got.view(np.int16) == want.view(np.int16)
    # within two of the encoding's steps plus what the summation order moves: a few fp32
    # ulps of the logits themselves, large beside the small differences of agreeing heads
    noise = 16 * np.spacing(np.maximum(np.abs(ref_s), np.abs(ref_t))).astype(np.float64)
    tol = 4 * np.abs(np.spacing(want)).astype(np.float64) + noise
    near = np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tol
    # the choice bit itself (one step of the value, inside tol): where the two forms' sizes
    # are not within the noise of each other, it must say which form was stored
    bn, v = t["bn"], ref_s.shape[1]
    tmax = lambda a: np.repeat(  # noqa: E731 - each element's tile-row maximum
        np.pad(a, ((0, 0), (0, -v % bn)), constant_values=-np.inf).reshape(m, -1, bn).max(2),
        bn, axis=1)[:, :v]
    own, dif = ref_t - tmax(ref_t), ref_t - ref_s
    clear = np.abs(np.abs(dif) - np.abs(own)) > 2 * noise
    bit = (got.view(np.int16) & 1) == 1
    bit_ok = bit[clear] == (np.abs(dif) < np.abs(own))[clear]
    # the offsets, and the teacher's maxima as a row kernel rebuilds it from what was stored
    first = lambda a: a[:, ::bn]  # noqa: E731 - one column per tile
    os_k, ot_k, omax_k = (b[:, :-(-v // bn)].cpu().numpy() for b in out[2:5])
    zs_k = zs.cpu().numpy().astype(np.float32)
    val = got.astype(np.float32)
    rebuilt = np.where(bit, (zs_k + np.repeat(os_k, bn, 1)[:, :v]) + val,
                       np.repeat(ot_k, bn, 1)[:, :v] + val)
    omax_ref = first(tmax(rebuilt))
    errs = {"offsets_s": float(np.abs(os_k - first(tmax(ref_s))).max()),
            "offsets_t": float(np.abs(ot_k - first(tmax(ref_t))).max()),
            "teacher_maxima": float(np.abs(omax_k - omax_ref).max())}
    print(json.dumps({"mode": mode, "bits_equal_fraction": float(same.mean()),
                      "within_tolerance_fraction": float(near.mean()),
                      "choice_bit_right_fraction": float(bit_ok.mean()), **errs}))
    if not near.all():
        raise SystemExit(f"{mode}: encoding disagrees with the NumPy rule")
    if not bit_ok.all():
        raise SystemExit(f"{mode}: the choice bit does not say which form was stored")
    if not (errs["offsets_s"] < 1e-4 and errs["offsets_t"] < 1e-4
            and errs["teacher_maxima"] < 1e-5):
        raise SystemExit(f"{mode}: offsets or rebuilt maxima wrong: {errs}")
    err_s = np.abs(zs_k.astype(np.float64) - (ref_s - tmax(ref_s))).max()
    if not err_s < 2e-2:  # fp16 of remainders up to ~20 (ulp 2^-6) plus summation order
        raise SystemExit(f"{mode}: the student's tile remainders are off by {err_s}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rows", type=int, default=1024, help="tokens per sub-chunk")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", default="seq,seq-scratch,choice,choice-halves")
    ap.add_argument("--stages", default="3", help="comma list of pipeline depths to try")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.check:
        for mode in ("choice", "choice-halves"):
            check(mode)
        return
    dev = "cuda"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n, k = a.rows, a.vocab, a.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g, device=dev) * 0.05).to(torch.bfloat16)  # noqa
    xs, ws, xt, wt = mk(m, k), mk(n, k), mk(m, k), mk(n, k)
    t0 = logits_gemm.tiles(False)
    base = buffers(m, n, t0, dev, num_sms)
    steps = {"two tile GEMMs": lambda: (
        logits_gemm.logits_tile_offsets(xs, ws, base[0], base[2], False, num_sms),
        logits_gemm.logits_tile_offsets(xt, wt, base[1], base[3], False, num_sms))}
    info = {}
    for st in map(int, a.stages.split(",")):
        t = dict(t0, stages=st)
        for mode in a.modes.split(","):
            buf = buffers(m, n, t, dev, num_sms)
            name = f"{mode}/stages{st}"
            try:
                kern = seq_dual(xs, ws, xt, wt, *buf, mode, t, num_sms, False)
                torch.cuda.synchronize()
                info[name] = dict(regs=kern.n_regs, spills=kern.n_spills,
                                  shared=kern.metadata.shared)
                steps[name] = (lambda buf=buf, mode=mode, t=t:
                               seq_dual(xs, ws, xt, wt, *buf, mode, t, num_sms, False))
            except Exception as e:  # noqa: BLE001 - a mode that does not build is a result
                info[name] = f"{type(e).__name__}: {str(e)[:200]}"
    names = list(steps)
    ts = common.time_interleaved([steps[s] for s in names], device=dev, reps=a.reps,
                                 warmup_calls=2)
    ref = ts[0].median_ms
    rows = [dict(name=s, ms=tm.median_ms, iqr_ms=tm.iqr_ms, x_two=tm.median_ms / ref,
                 **({"kernel": info[s]} if s in info else {})) for s, tm in zip(names, ts)]
    for s, v in info.items():
        if isinstance(v, str):
            rows.append(dict(name=s, error=v))
    for r in rows:
        print(json.dumps(r))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(
            {"env": common.environment(dev), "shape": dict(rows=m, vocab=n, hidden=k),
             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
