"""The fp16-dz student GEMMs of ``logitless/triton_kernels/mixed_gemm.py`` against cuBLAS (#6)

The thirty-eighth session's ``mixed_gemm_probe.py`` measured plain Triton's converting GEMM
(the bf16 operand transposed into wgmma's A, converted in registers) at 1.31-1.45x cuBLAS for
dX and 1.41x for dW, while the same kernel with both operands already fp16 ran at 0.99x.
The thirty-ninth and fortieth sessions built the warp-specialized Gluon form here (a TMA
producer warp, 8 MMA warps converting in registers; the form that became ``mixed_gemm.py``)
and measured its variants on an H200 at one 2048-token chunk of Llama-3's head:

* dX 0.999-1.01x cuBLAS's bf16 GEMM; with both operands fp16 the same: the conversion is free;
* waiting for each wgmma before the next stage's ldmatrix (no overlap) 1.24-1.36x: needed
  until the A registers of two consecutive stages were made distinct (ptxas had reused the
  in-flight wgmma's registers: wrong products, no warning);
* dW with a pointer read-modify-write epilogue: the whole tile at once 2.6-2.7x (spills), in
  8 column pieces 1.19x, with the accumulator tile prefetched into L2 by the producer 1.24x;
  through shared memory and the TMA unit's reduce-add **0.944x** cuBLAS's fp32-output addmm
  (``results/nvidia-h200-s40-gluon-mixed-gemm-tma-reduce.json``).

Those variants' code is in git history (commit d2e21c1); this probe now times and checks the
library's kernel, so that it measures what ships.

    python3 benchmarks/gluon_mixed_gemm_probe.py --out $OUT/gluon-mixed   (GPU)
    python3 benchmarks/gluon_mixed_gemm_probe.py --compile                (CPU: ptxas report)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def check(device="cuda"):
    """Both products at a small ragged shape against float64: {gemm: rel err}."""
    import torch

    from benchmarks import common
    from benchmarks.mixed_gemm_probe import make
    from logitless.triton_kernels import mixed_gemm
    c, v, h = 384, 1000, 512  # partial tiles in every dimension, K not a multiple of BK
    dz16, w, x = make(c, v, h, device)
    one = torch.ones(1, device=device)
    out = torch.zeros(c, h, device=device)
    mixed_gemm.dx_(dz16, w, out, one, one)
    acc = torch.ones(v, h, device=device)
    mixed_gemm.dw_(dz16, x, acc, one, one, first=False)
    return {"dx": common.rel_err(out, dz16.double() @ w.double()),
            "dw": common.rel_err(acc - 1.0, dz16.double().T @ x.double())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="build for sm_90 on the CPU only")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.compile:
        from logitless.triton_kernels import mixed_gemm
        rep = mixed_gemm.compile_report()
        print(json.dumps({k: {f: r[f] for f in ("ptxas", "rc", "shared_bytes")}
                          for k, r in rep.items()}, indent=1))
        return
    import torch

    from benchmarks import common
    from benchmarks.mixed_gemm_probe import make, time_forms
    from logitless.triton_kernels import mixed_gemm
    dev = "cuda"
    checked = check(dev)
    print(json.dumps(checked))
    if not all(e < 1e-5 for e in checked.values()):
        raise SystemExit(f"wrong on the GPU: {checked}")
    c, v, h = a.chunk, a.vocab, a.hidden
    dz16, w, x = make(c, v, h, dev)
    dzb = dz16.to(torch.bfloat16)
    one = torch.ones(1, device=dev)
    out = torch.empty(c, h, dtype=torch.float32, device=dev)
    acc = torch.zeros(v, h, dtype=torch.float32, device=dev)
    steps = {
        "dx/cublas-bf16": lambda: torch.mm(dzb, w, out_dtype=torch.float32),
        "dx/gluon": lambda: mixed_gemm.dx_(dz16, w, out, one, one),
        "dw/cublas-bf16": lambda: torch.addmm(acc, dzb.T, x, out_dtype=torch.float32, out=acc),
        "dw/gluon": lambda: mixed_gemm.dw_(dz16, x, acc, one, one, first=False),
    }
    rows = time_forms(steps, dev, a.reps)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(
            {"env": common.environment(dev), "shape": dict(chunk=c, vocab=v, hidden=h),
             "rows": rows, "gpu_check": checked}, indent=1))


if __name__ == "__main__":
    main()
