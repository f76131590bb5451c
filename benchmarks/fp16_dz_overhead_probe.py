"""Why is ``fp16_dz`` slower in a timed loop than its profiled kernels say? (diagnostic)

Per setting: the host's issue time of one fwd+bwd (no sync), the timed median, and the mixed
GEMM's launch cost alone (tiny shapes, GPU time negligible); the SM clock under load.

    PYTHONPATH=. python3 benchmarks/fp16_dz_overhead_probe.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import logitless.torch as lt  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.jsd_profile import inputs  # noqa: E402


def clocks():
    r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                        "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip()


def main():
    from logitless.triton_kernels import mixed_gemm
    res = {}
    dz = torch.randn(256, 256, device="cuda").half()
    w = torch.randn(256, 128, device="cuda").bfloat16()
    out = torch.empty(256, 128, device="cuda")
    one = torch.ones(1, device="cuda")
    for _ in range(3):
        mixed_gemm.dx_(dz, w, out, one, one)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        mixed_gemm.dx_(dz, w, out, one, one)
    res["dx_launch_us"] = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        torch.mm(dz, dz)
    res["torch_mm_launch_us"] = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    xs, ws, xt, wt, y = inputs(8192, 4096, 128256)
    for kw in ({"fp16_dz": False}, {"fp16_dz": True},
               {"fp16_tile_logits": True, "fp16_dz": False},
               {"fp16_tile_logits": True, "fp16_dz": True}):
        def step():
            xs.grad = ws.grad = None
            lt.linear_jsd(xs, ws, xt, wt, y, backend="triton", **kw).backward()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        issue = []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            issue.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        t = common.time_fn(step, device="cuda", reps=10, warmup=1)
        res[json.dumps(kw)] = dict(issue_ms=issue, median_ms=t.median_ms, clocks=clocks())
        print(json.dumps(kw), res[json.dumps(kw)], flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
