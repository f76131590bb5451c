"""GPU probe: the host (Python) time of one ``backend="triton"`` fwd+bwd call, which the GPU
waits through when nothing else is queued (a tiny shape makes the GPU work negligible), and
the functions it goes to (cProfile, by own time). At a large shape the host runs at the GPU's
pace (launches block once the launch queue is full): the benchmarks' timing, which waits only
at the end, never sees host time there (H100: 63 ms of host time per 81 ms call at Llama).

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
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        one()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
