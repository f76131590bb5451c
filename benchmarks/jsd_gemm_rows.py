"""Per-token cost of the JSD's cuBLAS GEMMs against the rows they get: the cost model behind
``backend="triton"``'s chunk plan (``chunk_size`` C for dX/dW, ``logits_chunk_size`` c for the
fp32 logits GEMMs).

Times, alone on the GPU, at H and V of the target:

* ``logits``: ``[c, H] @ [H, V]`` bf16 -> fp32 (one head's logits of a sub-chunk);
* ``dx``: ``[C, V] @ [V, H]`` bf16 -> fp32 (the chunk's dX);
* ``dw``: ``acc[V, H] += [V, C] @ [C, H]`` into an fp32 accumulator (the chunk's dW);

and prints microseconds per token with the kernel cuBLAS picked, against the same GEMM over
all N tokens at once in bf16 (the floor's share).

    PYTHONPATH=. python3 benchmarks/jsd_gemm_rows.py [--rows 256,384,512,768] [--out F.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402


def kernel_name(fn) -> str:
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return ",".join(names)[:90]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--logits-rows", default="256,384,448,512,640,768,896,1024")
    ap.add_argument("--chunk-rows", default="768,1024,1280,1536,1792,2048")
    ap.add_argument("--dx-rows", default="",
                    help="only the dX GEMM, bf16 and fp32 out, at these row counts")
    ap.add_argument("--neighbour", type=int, default=0,
                    help="rows c: the fp32 logits GEMM's kernel time (profiler) back to back "
                         "against the same GEMM between memory-bound kernels over both heads' "
                         "[c, V] fp32 buffers (the row kernel's traffic), then exit")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = "cuda"
    bf = dict(device=dev, dtype=torch.bfloat16)
    x = torch.randn(a.n, a.h, **bf)
    w = torch.randn(a.v, a.h, **bf)
    recs = []

    def record(kind, rows, fn):
        ms = common.time_fn(fn, device=dev, reps=a.reps, warmup=3).median_ms
        r = dict(kind=kind, rows=rows, ms=ms, us_per_token=1e3 * ms / rows,
                 kernel=kernel_name(fn))
        recs.append(r)
        print(json.dumps(r), flush=True)

    if a.neighbour:
        c = a.neighbour
        zs = torch.empty(c, a.v, device=dev, dtype=torch.float32)
        zt = torch.randn(c, a.v, device=dev, dtype=torch.float32)

        def gemm():
            torch.mm(x[:c], w.t(), out_dtype=torch.float32, out=zs)

        def mixed():
            gemm()
            torch.mm(x[c:2 * c], w.t(), out_dtype=torch.float32, out=zt)
            zs.mul_(1.0000001)  # read + write both heads: ~4x the row kernel's HBM bytes
            zt.mul_(1.0000001)

        for name, fn in (("alone", gemm), ("between memory-bound kernels", mixed)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(a.reps):
                    fn()
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA and "mul" not in e.key:
                    us = getattr(e, "device_time", None) or e.cuda_time
                    print(json.dumps(dict(mode=name, rows=c, kernel=e.key[:70], calls=e.count,
                                          us_per_call=us)), flush=True)
        return
    if a.dx_rows:  # the dX GEMM alone: how its time per token depends on the rows it gets
        for r in map(int, a.dx_rows.split(",")):
            dz = torch.randn(r, a.v, **bf)
            for odt in (torch.bfloat16, torch.float32):
                dx = torch.empty(r, a.h, device=dev, dtype=odt)
                record(f"dx_{str(odt)[6:]}", r, lambda: torch.mm(dz, w, out_dtype=odt, out=dx))
            del dz, dx
        return save(a.out, recs)
    # the floor's shares: each GEMM over all N tokens in bf16
    g = torch.randn(a.n, a.v, **bf)
    record("floor_logits", a.n, lambda: torch.mm(x, w.t()))
    record("floor_dx", a.n, lambda: torch.mm(g, w))
    record("floor_dw", a.n, lambda: torch.mm(g.t(), x))
    del g
    torch.cuda.empty_cache()
    for c in map(int, a.logits_rows.split(",")):
        out = torch.empty(c, a.v, device=dev, dtype=torch.float32)
        record("logits", c, lambda: torch.mm(x[:c], w.t(), out_dtype=torch.float32, out=out))
        del out
    acc = torch.zeros(a.v, a.h, device=dev, dtype=torch.float32)
    for cc in map(int, a.chunk_rows.split(",")):
        dz = torch.randn(cc, a.v, **bf)
        dx = torch.empty(cc, a.h, device=dev, dtype=torch.float32)
        record("dx", cc, lambda: torch.mm(dz, w, out_dtype=torch.float32, out=dx))
        record("dw", cc, lambda: torch.addmm(acc, dz.t(), x[:cc], out_dtype=torch.float32,
                                             out=acc))
        del dz, dx
    save(a.out, recs)


def save(path, recs):
    if path:
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in recs))


if __name__ == "__main__":
    main()
