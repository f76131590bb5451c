"""Can the JSD's dX / dW GEMMs take fp16 dz at cuBLAS's speed? (#6's 2e-3 error goal)

A CPU model (``--model``: N = 1024, H = 1024, V = 32768, the target's input statistics, the
JSD's β = 0.5 gradient in float64, two seeds) puts the error of bf16 dz at 2.14-2.18e-3 /
2.31-2.35e-3 (dX / dW), of fp16 dz (one power-of-two scale for the call) at 1.67e-3 /
1.67e-3, of the exact gradients rounded to bf16 at 1.66e-3: the goal needs dz in fp16. The other operands (W_s,
x_s) are bf16, cuBLAS multiplies only like with like, and an fp16 copy of W_s is 1 GB over
the memory goal. So: Triton GEMMs that convert the bf16 operand to fp16 in registers, timed
interleaved with cuBLAS's bf16 GEMMs of the same shapes (one token chunk of the JSD's plan).

Forms, per GEMM:
* ``nat``: ``dz16 · fp16(W)`` as written: Triton converts the B operand, which wgmma reads
  from shared memory (a round trip through registers);
* ``tr``: the transposed product ``(fp16(Wᵀ) · dz16ᵀ)ᵀ``: the converted operand is A, which
  wgmma can take from registers;
* ``f16``: both operands fp16 already (the kernel's own speed, no conversion);
and cuBLAS ``bf16`` (the floor's GEMM) and ``f16`` (an fp16 copy of the bf16 operand).
dW adds the fp32 accumulator's read-modify-write (``acc += dz16ᵀ · x``), as the op needs.
Which wgmma operand path Triton takes for each form was not read from the TTGIR.

Measured (H200, thirty-eighth session, ``results/nvidia-h200-s38-mixed-gemm-*.json``; cuBLAS's
time moved 7% between the two runs, so each ratio is to its own run's cuBLAS): ``tr-f16``
0.99x for dX (dW 1.17x with its pointer read-modify-write epilogue); converting, the best of
21 configs (``--sweep``: warp-specialized 128 × 256 × 64) 1.31x for dX and 1.41x for dW;
``nat`` 1.87x and worse. +0.8 / +1.4 ms per 2048-token chunk, ~9 ms a call at the target:
a dead end for #6's error goal in plain Triton.

    python3 benchmarks/mixed_gemm_probe.py --out $OUT/mixed   (GPU)
    TRITON_INTERPRET=1 python3 benchmarks/mixed_gemm_probe.py --check   (CPU: correctness only)
    python3 benchmarks/mixed_gemm_probe.py --model   (CPU, ~30 s: the errors above)
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks import common
from logitless.triton_kernels.logits_gemm import grouped_tile


@triton.jit
def _store(c_ptr, ldc, rows, cols, R, C, acc, TRANSPOSED: tl.constexpr, ADD: tl.constexpr = False):
    """acc (or accᵀ: ``TRANSPOSED``, acc indexed [cols, rows]) into c[rows, cols] (fp32) by
    pointers: no shared-memory staging (an fp32 128 x 256 tile is 128 KiB)."""
    r = rows.to(tl.int64)
    if TRANSPOSED:
        offs = r[None, :] * ldc + cols[:, None]
        mask = (rows < R)[None, :] & (cols < C)[:, None]
    else:
        offs = r[:, None] * ldc + cols[None, :]
        mask = (rows < R)[:, None] & (cols < C)[None, :]
    if ADD:
        acc += tl.load(c_ptr + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc, mask=mask)


@triton.jit
def mixed_kernel(a_desc, b_desc, c_ptr, ldc, M, N, K, num_programs, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 CONVERT: tl.constexpr, INTERPRET: tl.constexpr, A_T: tl.constexpr,
                 B_T: tl.constexpr, CONVERT_A: tl.constexpr, OUT_T: tl.constexpr,
                 ADD: tl.constexpr, WS: tl.constexpr = False):
    """acc [M, N] = A [M, K] · B [K, N], fp32, persistent over output tiles. A's blocks are
    loaded [BM, BK] (or [BK, BM] and transposed: ``A_T``), B's [BK, BN] (or [BN, BK] and
    transposed: ``B_T``); ``CONVERT``: the bf16 operand (A if ``CONVERT_A``, else B) to fp16
    in registers. acc is stored into c [M, N] (or its transpose c [N, M]: ``OUT_T``), added
    to what c holds (``ADD``: dW's fp32 accumulator)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    for tile in tl.range(pid, num_pid_m * num_pid_n, num_programs, flatten=not INTERPRET,
                         warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            if A_T:
                a = a_desc.load([ki * BK, pid_m * BM]).T
            else:
                a = a_desc.load([pid_m * BM, ki * BK])
            if B_T:
                b = b_desc.load([pid_n * BN, ki * BK]).T
            else:
                b = b_desc.load([ki * BK, pid_n * BN])
            if CONVERT and CONVERT_A:
                a = a.to(tl.float16)
            elif CONVERT:
                b = b.to(tl.float16)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        if OUT_T:
            _store(c_ptr, ldc, cols, rows, N, M, acc, True, ADD)
        else:
            _store(c_ptr, ldc, rows, cols, M, N, acc, False, ADD)


def _launch(descs, m, n, k, cfg, num_sms, convert, interpret, **layout):
    bm, bn, bk, stages, warps, group = cfg[:6]
    ws = {"WS": True} if len(cfg) > 6 and cfg[6] else {}
    programs = max(1, min(num_sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)))
    mixed_kernel[(programs,)](*descs, m, n, k, programs, BM=bm, BN=bn, BK=bk, GROUP_M=group,
                              CONVERT=convert, INTERPRET=interpret, num_stages=stages,
                              num_warps=warps, **layout, **ws)


def _step(gemm, form, dz16, other, other16, out, cfg, num_sms, interpret):
    """One GEMM in ``form``: ``gemm`` "dx" (out [C, H] = dz16 [C, V] · W, ``other`` = W
    [V, H]) or "dw" (out [V, H] += dz16ᵀ · x, ``other`` = x [C, H]); ``other16`` its fp16
    copy (the ``-f16`` forms)."""
    bm, bn, bk = cfg[:3]
    c, v = dz16.shape
    h = other.shape[1]
    b = other16 if form.endswith("-f16") else other
    convert = not form.endswith("-f16")
    dx = gemm == "dx"
    if form.startswith("nat"):
        # dX: A = dz16 [C, V], K = V; dW: A = dz16ᵀ (its [BK, BM] blocks transposed), K = C
        descs = (TensorDescriptor.from_tensor(dz16, [bm, bk] if dx else [bk, bm]),
                 TensorDescriptor.from_tensor(b, [bk, bn]), out, out.stride(0))
        mnk = (c, h, v) if dx else (v, h, c)
        layout = dict(A_T=not dx, B_T=False, CONVERT_A=False, OUT_T=False, ADD=not dx)
    else:  # transposed: the converted operand first (A, from its [BK, BM] blocks), dz16 B
        descs = (TensorDescriptor.from_tensor(b, [bk, bm]),
                 TensorDescriptor.from_tensor(dz16, [bn, bk] if dx else [bk, bn]), out,
                 out.stride(0))
        mnk = (h, c, v) if dx else (h, v, c)
        layout = dict(A_T=True, B_T=dx, CONVERT_A=True, OUT_T=True, ADD=not dx)
    return lambda: _launch(descs, *mnk, cfg, num_sms, convert, interpret, **layout)


def dx_step(form, dz16, w, w16, out, cfg, num_sms, interpret):
    """out [C, H] = dz16 [C, V] · W [V, H] in ``form``."""
    return _step("dx", form, dz16, w, w16, out, cfg, num_sms, interpret)


def dw_step(form, dz16, x, x16, acc, cfg, num_sms, interpret):
    """acc [V, H] += dz16ᵀ · x in ``form``."""
    return _step("dw", form, dz16, x, x16, acc, cfg, num_sms, interpret)


FORMS = ("nat", "tr", "nat-f16", "tr-f16")


def make(c, v, h, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    dz16 = (torch.randn(c, v, generator=g, device=device) * 0.01).to(torch.float16)
    w = (torch.randn(v, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    x = torch.randn(c, h, generator=g, device=device).to(torch.bfloat16)
    return dz16, w, x


def check(c, v, h, cfg, device, interpret):
    """Every form against an fp64 product; returns {gemm/form: rel err}."""
    dz16, w, x = make(c, v, h, device)
    ref_dx = dz16.double() @ w.double()
    ref_dw = dz16.double().T @ x.double()
    res = {}
    for form in FORMS:
        try:
            out = torch.zeros(c, h, dtype=torch.float32, device=device)
            dx_step(form, dz16, w, w.half(), out, cfg, 8, interpret)()
            res[f"dx/{form}"] = common.rel_err(out, ref_dx)
            acc = torch.ones(v, h, dtype=torch.float32, device=device)
            dw_step(form, dz16, x, x.half(), acc, cfg, 8, interpret)()
            res[f"dw/{form}"] = common.rel_err(acc - 1.0, ref_dw)
        except Exception as e:  # noqa: BLE001 - reported, and the check fails
            res[f"{form}"] = f"{type(e).__name__}: {str(e)[:160]}"

    return res


def model(seeds=(1, 2), n=1024, h=1024, v=32768, beta=0.5):
    """The rounding model quoted in the docstring: {seed: {form: (dX err, dW err)}}. The
    spec's convention (logitless/specs/linear_jsd.py): M = β·P + (1−β)·Q, P the teacher's,
    ∂J/∂z_s = (1−β)·Q·(ℓ − K) with ℓ = log Q − log M, K = Σ Q·ℓ."""
    import math
    res = {}
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        scale, agree = 2.0 / math.sqrt(h), math.sqrt(0.8)  # linear_jsd.py's LOGIT_STD, agreement
        xs, ws = r(n, h), r(v, h) * scale
        xt = xs * agree + r(n, h) * math.sqrt(1 - agree ** 2)
        wt = ws * agree + r(v, h) * scale * math.sqrt(1 - agree ** 2)
        bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
        xs, ws, xt, wt = map(bf, (xs, ws, xt, wt))
        lq, lp = torch.log_softmax(xs @ ws.T, -1), torch.log_softmax(xt @ wt.T, -1)
        q = lq.exp()
        ell = lq - torch.log(beta * lp.exp() + (1 - beta) * q)
        dz = (1 - beta) * q * (ell - (q * ell).sum(-1, keepdim=True)) / n  # "mean"
        dx, dw = dz @ ws, dz.T @ xs
        err = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        # fp16 dz needs a scale (dz ~ 1/(N·V) falls into fp16's subnormals): one power of two
        # for the whole call (what a GEMM can undo exactly), or per row (for dW it would have
        # to be folded into x's rows: the reduction runs over tokens)
        one = float(n * 64)
        row = torch.pow(2.0, 14 - torch.floor(torch.log2(dz.abs().amax(-1, keepdim=True))))
        res[seed] = {"exact, rounded to bf16": (err(bf(dx), dx), err(bf(dw), dw)),
                     "bf16 dz": (err(bf(bf(dz) @ ws), dx), err(bf(bf(dz).T @ xs), dw))}
        for name, sc in (("fp16 dz, one scale (x N*64)", one), ("fp16 dz, per-row scale", row)):
            d16 = (dz * sc).half().double() / sc
            res[seed][name] = (err(bf(d16 @ ws), dx), err(bf(d16.T @ xs), dw))
    return res


CONFIGS = [  # bm, bn, bk, stages, warps, group
    (128, 256, 64, 3, 8, 8), (128, 256, 64, 4, 8, 8), (128, 128, 64, 4, 8, 8),
    (256, 128, 64, 3, 8, 8), (128, 256, 64, 3, 8, 16), (128, 128, 64, 5, 4, 8),
]


# the converting ``tr`` form only (--sweep): where does its time go?
SWEEP = [(bm, bn, bk, st, wa, 8) for bm, bn, bk, st, wa in [
    (128, 256, 32, 4, 8), (128, 256, 32, 6, 8), (128, 256, 64, 2, 8), (128, 256, 128, 2, 8),
    (64, 256, 64, 4, 4), (64, 256, 64, 3, 4), (64, 128, 64, 4, 4), (128, 128, 64, 3, 4),
    (128, 128, 128, 3, 8), (128, 256, 64, 3, 4), (256, 128, 64, 2, 8), (64, 256, 128, 3, 4)]] + [
    (128, 256, 64, 3, 8, 8, True), (128, 128, 64, 4, 8, 8, True), (128, 256, 64, 2, 8, 8, True)]



def time_forms(steps, dev, reps):
    """Time each "dx/…" and "dw/…" step interleaved with the others of its GEMM; rows with
    each one's ratio to its GEMM's "…/cublas-bf16" step, printed, fastest first."""
    from benchmarks import common
    rows = []
    for gemm in ("dx", "dw"):
        names = [n for n in steps if n.startswith(gemm + "/")]
        ts = common.time_interleaved([steps[n] for n in names], device=dev, reps=reps,
                                     warmup_calls=2)
        base = ts[names.index(f"{gemm}/cublas-bf16")].median_ms
        for n, t in zip(names, ts):
            rows.append({"name": n, "ms": t.median_ms, "iqr_ms": t.iqr_ms,
                         "x_cublas_bf16": t.median_ms / base})
    rows.sort(key=lambda r: (r["name"][:2], r["ms"]))
    for r in rows:
        print(f"{r['name']:34s} {r['ms']:7.3f} ms  {r['x_cublas_bf16']:.3f}x  "
              f"(iqr {r['iqr_ms']:.3f})")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="correctness at a small shape only")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sweep", action="store_true",
                    help="the converting transposed form over more tiles (SWEEP)")
    ap.add_argument("--model", action="store_true", help="the CPU rounding model only")
    a = ap.parse_args(argv)
    if a.model:
        for seed, forms in model().items():
            for form, (ex, ew) in forms.items():
                print(f"seed {seed}  {form:36s} dX {ex:.3e}  dW {ew:.3e}")
        return
    if a.check:
        interpret = not torch.cuda.is_available()
        # K (104 for dX, 72 for dW) not a multiple of BK = 16, partial row and column tiles
        # (TMA needs 16-byte row strides: V = 104, not 100)
        res = check(72, 104, 56, (16, 32, 16, 1, 4, 2), "cuda" if not interpret else "cpu",
                    interpret)
        print(json.dumps(res, indent=1))
        bad = {k: e for k, e in res.items() if isinstance(e, str) or not e < 1e-5}
        if bad:
            raise SystemExit(f"wrong: {bad}")
        return
    dev = "cuda"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    checked = check(384, 1000 // 8 * 8, 512, CONFIGS[0], dev, False)
    print(json.dumps(checked))
    wrong = {k: e for k, e in checked.items() if not isinstance(e, str) and not e < 1e-5}
    if wrong:  # a form that builds must be right (one that does not build is reported)
        raise SystemExit(f"wrong on the GPU: {wrong}")
    c, v, h = a.chunk, a.vocab, a.hidden
    dz16, w, x = make(c, v, h, dev)
    dzb, w16, x16 = dz16.to(torch.bfloat16), w.half(), x.half()
    out = torch.empty(c, h, dtype=torch.float32, device=dev)
    acc = torch.zeros(v, h, dtype=torch.float32, device=dev)
    steps = {
        "dx/cublas-bf16": lambda: torch.mm(dzb, w, out_dtype=torch.float32),
        "dx/cublas-f16": lambda: torch.mm(dz16, w16, out_dtype=torch.float32),
        "dw/cublas-bf16": lambda: torch.addmm(acc, dzb.T, x, out_dtype=torch.float32, out=acc),
        "dw/cublas-f16": lambda: torch.addmm(acc, dz16.T, x16, out_dtype=torch.float32, out=acc),
    }
    grid = itertools.product(SWEEP, ("tr",)) if a.sweep else itertools.product(CONFIGS, FORMS)
    for cfg, form in grid:
        tag = "x".join(map(str, cfg[:6])) + ("-ws" if len(cfg) > 6 else "")
        steps[f"dx/{form}/{tag}"] = dx_step(form, dz16, w, w16, out, cfg, num_sms, False)
        steps[f"dw/{form}/{tag}"] = dw_step(form, dz16, x, x16, acc, cfg, num_sms, False)
    ok, failed = {}, []
    for name, fn in steps.items():  # compile (and drop what does not build)
        try:
            fn()
            torch.cuda.synchronize()
            ok[name] = fn
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            failed.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"{name}: {failed[-1]['error']}")
    rows = time_forms(ok, dev, a.reps)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(
            {"env": common.environment(dev), "shape": dict(chunk=c, vocab=v, hidden=h),
             "rows": rows, "not_built": failed, "gpu_check": checked}, indent=1))


if __name__ == "__main__":
    main()
