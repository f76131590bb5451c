"""Where does ``fp16_dz``'s time go in a sustained loop? (#6; diagnostic, GPU)

A profiled single call said the Gluon GEMMs take cuBLAS's device time, yet the timed medians
were 1.7-4 ms apart. Here, per setting, each stage of the op is bracketed by CUDA events
inside a loop of back-to-back calls (no syncs; the host stays far ahead): the logits GEMMs,
the row kernel, dX, dW, the range checks, and the rest; plus the host's issue time per call
and the SM clock and power right after the loop.

    PYTHONPATH=. python3 benchmarks/fp16_dz_overhead_probe.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import logitless.torch as lt  # noqa: E402
from benchmarks.jsd_profile import inputs  # noqa: E402
from logitless.triton_kernels import linear_jsd as tj  # noqa: E402

STAGES = {"_logits": "logits", "_row_kernel": "rows", "_rows_into_pair": "dx",
          "accumulate_split_": "dw", "_dw16_": "dw", "_range_scale": "range"}


def clocks():
    r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                        "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip()


def bracket(events):
    """Wrap the stage functions of linear_jsd so that each call records (stage, start, end)."""
    for name, stage in STAGES.items():
        real = getattr(tj, name)

        def wrapped(*a, _real=real, _stage=stage, **k):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = _real(*a, **k)
            e.record()
            events.append((_stage, s, e))
            return out
        setattr(tj, name, wrapped)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    events = []
    bracket(events)
    xs, ws, xt, wt, y = inputs(8192, 4096, 128256)
    res = {}
    settings = ({"fp16_dz": False}, {"fp16_dz": True},
                {"fp16_tile_logits": True, "fp16_dz": False},
                {"fp16_tile_logits": True, "fp16_dz": True})
    for rnd in range(2):  # twice, the order reversed: the GPU's clock drifts with its heat
        for kw in (settings if rnd == 0 else settings[::-1]):
            def step():
                xs.grad = ws.grad = None
                lt.linear_jsd(xs, ws, xt, wt, y, backend="triton", **kw).backward()
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            events.clear()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            issue = time.perf_counter()
            t0.record()
            for _ in range(a.calls):
                step()
            t1.record()
            issue = (time.perf_counter() - issue) / a.calls * 1e3
            torch.cuda.synchronize()
            per = {}
            for stage, s, e in events:
                per[stage] = per.get(stage, 0.0) + s.elapsed_time(e) / a.calls
            total = t0.elapsed_time(t1) / a.calls
            per = {k: round(v, 3) for k, v in sorted(per.items())}
            per["rest"] = round(total - sum(per.values()), 3)
            rec = dict(ms_per_call=round(total, 3), stages_ms=per, issue_ms=round(issue, 2),
                       clocks_after=clocks())
            res.setdefault(json.dumps(kw), []).append(rec)
            print(json.dumps(kw), json.dumps(rec), flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
