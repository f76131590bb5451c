"""GPU probe: the CUDA kernels of one fwd+bwd of ``backend="triton"`` linear CE, summed by
kernel name (torch.profiler), and the eager call's median time, for each set of keywords:

    python3 benchmarks/kernel_table.py 8192,2304,256000 floor '{}' '{"chunk_size": 4096}'

(``floor``: the three bf16 cuBLAS GEMMs of the floor.) Also prints the GPU's idle time between
the call's first and last kernel (host-side gaps).

Not a user benchmark (DESIGN.md records what it found). The profiled call runs once, at the
clocks of that moment: compare kernels within one run, and ratios to a floor only in
benchmarks/linear_cross_entropy.py (interleaved timing)."""
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import logitless.torch as lt  # noqa: E402
from benchmarks.triton_probe import bench, inputs  # noqa: E402


def idle_gaps(spans):
    """``(kernels_ms, span_ms, idle_ms, gaps)`` of CUDA kernel ``spans`` ``(start_us, end_us,
    name)``: summed kernel time, first start to last end, the time with no kernel running in
    between, and those idle gaps as ``(ms, kernel before, kernel after)``, longest first."""
    busy, end, prev, gaps = 0.0, None, None, []
    for s, e, name in sorted(spans):
        if end is not None and s > end:
            gaps.append(((s - end) / 1e3, prev, name))
        prev = name
        if end is None or s >= end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / 1e3
    kernels = sum(e - s for s, e, _ in spans) / 1e3
    return kernels, span, span - busy / 1e3, sorted(gaps, reverse=True)


def cuda_spans(prof, width=40):
    """The CUDA kernels of a ``torch.profiler`` run as ``(start_us, end_us, name)``."""
    return [(e.time_range.start, e.time_range.end, e.name[:width]) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(n, h, v, kw, top=12):
    """``kw`` the op's keywords, or ``"floor"``: the three bf16 cuBLAS GEMMs of the floor."""
    x, w, y = inputs(n, h, v)
    if kw == "floor":
        gl = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
        z = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
        xd, wd = x.detach(), w.detach()

        def one():
            torch.mm(xd, wd.t(), out=z)
            torch.mm(gl, wd)
            torch.mm(gl.t(), xd)
    else:
        def one():
            x.grad = w.grad = None
            lt.linear_cross_entropy(x, w, y, backend="triton", **kw).backward()
    one()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        one()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t, c = rows.get(e.name[:60], (0.0, 0))
            rows[e.name[:60]] = (t + e.device_time / 1e3, c + 1)
    total = sum(t for t, _ in rows.values())
    # GPU time with no kernel running, between the call's first and last kernel
    _, span, idle, gaps = idle_gaps(cuda_spans(prof))
    print(f"== {n},{h},{v} {kw}: kernels {total:.2f} ms; span {span:.2f} ms, of it idle "
          f"{idle:.2f} ms; eager {bench(one):.2f} ms")
    for gap, before, after in gaps[:5]:
        print(f"  idle {gap:.3f} ms between {before} and {after}")
    for name, (t, c) in sorted(rows.items(), key=lambda r: -r[1][0])[:top]:
        print(f"  {t:7.2f} ms {c:4d}x  {name}")


if __name__ == "__main__":
    n, h, v = map(int, sys.argv[1].split(","))
    for spec in sys.argv[2:] or ["{}"]:
        kernel_table(n, h, v, spec if spec == "floor" else json.loads(spec))
