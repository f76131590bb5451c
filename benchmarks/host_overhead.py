"""GPU probe: the host (Python) time of one ``backend="triton"`` fwd+bwd call, which the GPU
waits through when nothing else is queued (a tiny shape makes the GPU work negligible), and
the functions it goes to (cProfile, by own time).

    PYTHONPATH=. python3 benchmarks/host_overhead.py [n,h,v] [json keywords]
"""
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import logitless.torch as lt  # noqa: E402
from benchmarks.triton_probe import inputs  # noqa: E402


def main():
    n, h, v = map(int, (sys.argv[1] if len(sys.argv) > 1 else "256,256,4096").split(","))
    kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    x, w, y = inputs(n, h, v)

    def one():
        x.grad = w.grad = None
        lt.linear_cross_entropy(x, w, y, backend="triton", **kw).backward()
    for _ in range(5):
        one()
    torch.cuda.synchronize()
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        one()
    host = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    print(f"{n},{h},{v} {kw}: host {host:.3f} ms per fwd+bwd call")
    # From an empty queue (as a timed call starts): host ms until the first GEMM is launched,
    # when the GPU has only small kernels until then
    first = []
    real_mm = torch.mm

    def spy(*a, **k):
        if len(first) == len(starts):
            first.append(time.perf_counter())
        return real_mm(*a, **k)
    starts = []
    torch.mm = spy
    try:
        for _ in range(20):
            torch.cuda.synchronize()
            x.grad = w.grad = None
            starts.append(time.perf_counter())
            loss = lt.linear_cross_entropy(x, w, y, backend="triton", **kw)
            loss.backward()
    finally:
        torch.mm = real_mm
    torch.cuda.synchronize()
    lag = sorted((f - s) * 1e3 for f, s in zip(first, starts))
    print(f"host ms from the call to its first GEMM launch: median {lag[len(lag) // 2]:.3f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        one()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
