"""Tuning probe for the Triton linear-CE backend (GPU): the three-GEMM floor, the backend's
fast and low-memory modes, and variants of the row kernel's launch, at TARGETS.md shapes.
Writes JSON lines to --out. Not a user benchmark (see linear_cross_entropy.py for that)."""
import argparse
import json
import time

import torch

import logitless.torch as lt
import logitless.triton_kernels.linear_cross_entropy as tlce


def bench(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def inputs(n, h, v, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=dtype, generator=g) * (2.0 / h ** 0.5)).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return x, w, y


def floor_ms(n, h, v):
    a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    gl = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)

    def f():
        torch.mm(a, w.t(), out=out)
        torch.mm(gl, w)
        torch.mm(gl.t(), a)
    t = bench(f)
    del a, w, gl, out
    torch.cuda.empty_cache()
    return t


def run_case(x, w, y, **kw):
    def f():
        x.grad = None
        w.grad = None
        loss = lt.linear_cross_entropy(x, w, y, backend="triton", **kw)
        loss.backward()
    t = bench(f)
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - x.grad.numel() * 2 - w.grad.numel() * 2
    return t, extra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384,4096,128256;8192,2304,256000")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--out", default="/dev/stdout")
    args = ap.parse_args()
    rows = []
    for shp in args.shapes.split(";"):
        n, h, v = map(int, shp.split(","))
        fl = floor_ms(n, h, v)
        flops = 6 * n * h * v
        print(f"shape {n},{h},{v}: floor {fl:.2f} ms ({flops / fl / 1e9:.0f} TFLOP/s)", flush=True)
        x, w, y = inputs(n, h, v)
        for variant in args.variants.split(";"):
            kw = {} if variant == "default" else json.loads(variant)
            pps = kw.pop("pps", None)
            if pps:
                tlce.PROGRAMS_PER_SM = pps
            try:
                t, extra = run_case(x, w, y, **kw)
                r = dict(shape=[n, h, v], variant=variant, ms=t, ratio=t / fl, floor_ms=fl,
                         extra_gib=extra / 2**30)
            except Exception as e:  # record and go on
                r = dict(shape=[n, h, v], variant=variant, error=repr(e)[:300])
            tlce.PROGRAMS_PER_SM = 4
            rows.append(r)
            print(json.dumps(r), flush=True)
        del x, w, y
        torch.cuda.empty_cache()
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
