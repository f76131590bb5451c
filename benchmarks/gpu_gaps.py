"""Where a fused op leaves the GPU idle: one fwd+bwd of ``backend="triton"`` under the profiler,
its kernels laid end to end. Prints the span from the first kernel's start to the last one's
end, the time some kernel runs, the idle gaps between them (the largest, with the kernels on
either side) and the lead-in (step called -> first kernel starts; the profiler's own first
launch adds ~2.5 ms to it). Without the profiler it times the step alone (CUDA events, the
host running ahead as in training), queued behind a 30 ms GPU spin, and queued behind 30 ms
of GEMMs, each minus the spin or GEMMs alone. Behind GEMMs the host's work before the first
launch is hidden and the GPU stays as loaded as in the step: ``host_bound_loaded_ms`` is
what the host's pace costs. Behind the spin the GPU starts cool and under its power limit:
``host_bound_ms`` mixes the host with clocks (H200: 14-18% faster behind a spin, equal
behind GEMMs; results/nvidia-h200-s34-behind-spin.txt).

    PYTHONPATH=. python3 benchmarks/gpu_gaps.py --op jsd [--kwargs '{"row_sync": true}']
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import logitless.torch as lt  # noqa: E402
from benchmarks import common  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _step(op, n, h, v, kw):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    if op == "ce":
        return lambda: torch.autograd.grad(
            lt.linear_cross_entropy(x, w, y, backend="triton", **kw), (x, w))
    xt = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16()
    wt = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).bfloat16()
    return lambda: torch.autograd.grad(
        lt.linear_jsd(x, w, xt, wt, y, backend="triton", **{"beta": 0.5, **kw}), (x, w))


def _gaps(trace_path, t_call_us):
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    ks = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                if e.get("cat") in GPU_CATS and e.get("ph") == "X")
    if not ks:
        raise SystemExit("no GPU activity in the trace (profiler without CUDA?)")
    gaps, busy, end = [], 0.0, ks[0][0]
    prev = None  # the kernel whose end is `end` (with overlapping kernels, not the last begun)
    for s, e, name in ks:
        if s > end:
            gaps.append((s - end, prev, name))
        busy += max(0.0, e - max(s, end))
        if e >= end:
            end, prev = e, name
    span = end - ks[0][0]
    lead = ks[0][0] - t_call_us if t_call_us is not None else None
    return dict(kernels=len(ks), span_ms=span / 1e3, busy_ms=busy / 1e3,
                idle_ms=(span - busy) / 1e3, lead_in_ms=None if lead is None else lead / 1e3,
                largest_gaps_us=[(round(g, 1), a[:60] if a else None, b[:60])
                                 for g, a, b in sorted(gaps, reverse=True)[:12]],
                gaps_over_20us=sum(1 for g in gaps if g[0] > 20))


def _host_before_first_launch(events, top=30):
    """The host's Python functions and ops that started before the first kernel launch,
    longest first (nested: an outer one includes the inner ones), clipped at that launch."""
    launches = [e["ts"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and ("aunch" in e.get("name", "") or "emset" in e.get("name", ""))]
    if not launches:
        return []
    first = min(launches)
    rows = [(min(e["ts"] + e.get("dur", 0), first) - e["ts"], e["name"]) for e in events
            if e.get("cat") in ("python_function", "cpu_op") and e.get("ph") == "X"
            and e["ts"] < first]
    return [(round(d, 1), n[:110]) for d, n in sorted(rows, reverse=True)[:top]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=("jsd", "ce"), default="jsd")
    ap.add_argument("--shape", default="", help="N,H,V (default: the op's TARGETS shape)")
    ap.add_argument("--kwargs", default="{}", help="JSON keyword arguments of the op")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--host", action="store_true",
                    help="also list the host work before the first launch (Python stacks)")
    a = ap.parse_args()
    n, h, v = (map(int, a.shape.split(",")) if a.shape else
               ((8192, 4096, 128256) if a.op == "jsd" else (16384, 4096, 128256)))
    step = _step(a.op, n, h, v, json.loads(a.kwargs))
    # The same step queued behind a GPU spin long enough to hide the host's work before its
    # first launch (and any stretch where the host falls behind): what the step costs the GPU
    # when a training loop's host runs ahead, as it does between layers.
    cycles = int(0.03 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # ~30 ms

    def behind():
        torch.cuda._sleep(cycles)
        step()
    t_behind = common.time_interleaved([behind, lambda: torch.cuda._sleep(cycles)],
                                       device="cuda", reps=a.reps, warmup_calls=2)
    gpu_ms = t_behind[0].median_ms - t_behind[1].median_ms
    # The spin leaves the GPU near idle for 30 ms, cool and under its power limit: behind it a
    # step may run at higher clocks. Behind ~30 ms of GEMMs instead the GPU stays as loaded
    # as in the step: a difference that remains is the host's.
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    per = common.time_fn(lambda: big @ big, device="cuda", reps=5, warmup=2).median_ms
    k = max(1, round(30 / per))

    def gemms():
        for _ in range(k):
            big @ big

    def behind_gemms():
        gemms()
        step()
    # the step alone in the same rotation, so that clock drift between runs does not enter
    t_g = common.time_interleaved([step, behind_gemms, gemms], device="cuda", reps=a.reps,
                                  warmup_calls=2)
    timed = t_g[0].median_ms
    gpu_loaded_ms = t_g[1].median_ms - t_g[2].median_ms
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        with torch.profiler.profile(activities=acts, with_stack=a.host) as prof:
            with torch.profiler.record_function("gpu_gaps.step"):
                step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
        mark = [e["ts"] for e in events if e.get("name") == "gpu_gaps.step"
                and e.get("cat") == "user_annotation"]  # the host's, not its GPU twin
        rec = _gaps(path, mark[0] if mark else None)
        if a.host:
            rec["host_before_first_launch_us"] = _host_before_first_launch(events)
    print(json.dumps(dict(op=a.op, shape=[n, h, v], kwargs=json.loads(a.kwargs),
                          timed_ms=round(timed, 3), behind_a_spin_ms=round(gpu_ms, 3),
                          host_bound_ms=round(timed - gpu_ms, 3),
                          behind_gemms_ms=round(gpu_loaded_ms, 3),
                          host_bound_loaded_ms=round(timed - gpu_loaded_ms, 3), **rec,
                          gpu=torch.cuda.get_device_name(), when=time.strftime("%F %T")),
                     indent=1))


if __name__ == "__main__":
    main()
