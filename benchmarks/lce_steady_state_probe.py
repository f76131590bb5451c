"""Steady-state timing of the Triton fast linear CE, its three-GEMM floor and torch.compile at
the Llama shape (TARGETS): each alone (back-to-back calls, CUDA events), interleaved as the
benchmark times them, the host's launch time per call, and the GPU's busy time and idle gaps
in a profile of 3 back-to-back calls (is the gap to the floor kernel time or host time?), and
how far into a call (GPU time from its start) our first logits GEMM is queued.

    PYTHONPATH=. python3 benchmarks/lce_steady_state_probe.py
"""
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks import linear_cross_entropy as B  # noqa: E402
from benchmarks.kernel_table import cuda_spans, idle_gaps  # noqa: E402
import logitless.torch as lt  # noqa: E402

shape = B.SHAPES["llama3-8b"]
dev = "cuda"
x, w, y = B.make_inputs(shape, dev, 1234)
ours = B.make_step(lambda x, w, y: lt.linear_cross_entropy(x, w, y, backend="triton"), x, w, y)
floor, _ = B.floor_step(shape, x, w, device=dev, seed=1234)
compile_fn = torch.compile(lambda x, w, y: torch.nn.functional.cross_entropy(
    (x @ w.t()).float(), y, ignore_index=-100))
comp = B.make_step(compile_fn, x, w, y)
steps = {"ours": ours, "floor": floor, "compile": comp}
for name, s in steps.items():
    for _ in range(3):
        s()
    torch.cuda.synchronize()


def host(s, reps=5):
    """Median host time of a call (its launches, no synchronization)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = s()
        ts.append((time.perf_counter() - t) * 1e3)
        del out
    torch.cuda.synchronize()
    return statistics.median(ts)


for rnd in range(3):  # back-to-back calls of each step alone, CUDA events
    print("alone:", {k: round(common.time_fn(s, device=dev, reps=15, warmup=0).median_ms, 2)
                     for k, s in steps.items()})
t = common.time_interleaved(list(steps.values()), device=dev, reps=15, warmup_s=2)
print("interleaved:", {k: round(v.median_ms, 2) for k, v in zip(steps, t)})
print("host ms per call (launch only, no sync):", {k: round(host(s), 2) for k, s in steps.items()})


def first_gemm_delay(reps=10):
    """Median GPU ms from a call's start (after a sync) to our first logits GEMM's launch: the
    GPU idles there but for the small kernels queued before it."""
    from logitless.triton_kernels import linear_cross_entropy as lce
    real, marks, delays = lce._logits, [], []

    def spy(*a, **k):
        if not marks:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[0].record()
        return real(*a, **k)
    lce._logits = spy
    try:
        for _ in range(reps):
            marks.clear()
            torch.cuda.synchronize()
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            ours()
            torch.cuda.synchronize()
            delays.append(e0.elapsed_time(marks[0]))
    finally:
        lce._logits = real
    return statistics.median(delays)


print("ours: GPU ms from a call's start to its first logits GEMM:", round(first_gemm_delay(), 3))
for name in ("ours", "floor"):
    s = steps[name]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            s()
        torch.cuda.synchronize()
    busy, span, idle, gaps = idle_gaps(cuda_spans(prof, width=50))
    print(f"{name}: 3 calls busy {busy:.2f} ms span {span:.2f} ms idle {idle:.2f} ms")
    for g in gaps[:8]:
        print("   gap %.3f ms after %s before %s" % g)
