"""Does running the row kernel on a side stream, overlapping the next logits GEMM, pay?

A/B in one process, interleaved rounds, against the default (one stream) of the Triton
backends: linear CE (fast mode, Llama shape) and linear JSD (N=8192, H=4096, V=128256).

    PYTHONPATH=. python3 benchmarks/overlap_probe.py [--rounds 2] [--out results.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import logitless.torch as lt  # noqa: E402
from benchmarks import common  # noqa: E402
from logitless.triton_kernels import linear_cross_entropy as tce  # noqa: E402
from logitless.triton_kernels import linear_jsd as tjsd  # noqa: E402

# (label, module constants of linear_cross_entropy, keywords)
CE_SETTINGS = [
    ("default", {}, {}),
    ("split2", dict(OVERLAP_SPLIT=2), {}),
    ("split4", dict(OVERLAP_SPLIT=4), {}),
    ("split4-prio", dict(OVERLAP_SPLIT=4, SIDE_PRIORITY=-1), {}),
    ("split4-grid0.25", dict(OVERLAP_SPLIT=4, OVERLAP_GRID=0.25), {}),
    ("split7", dict(OVERLAP_SPLIT=7), {}),
]
JSD_SETTINGS = [
    ("default", {}, {}),
    ("overlap", {}, dict(overlap=True)),
    ("overlap-prio", dict(SIDE_PRIORITY=-1), dict(overlap=True)),
    ("overlap-c256", {}, dict(overlap=True, logits_chunk_size=256)),
    ("overlap-c256-prio", dict(SIDE_PRIORITY=-1), dict(overlap=True, logits_chunk_size=256)),
]


def _time(fn):
    return common.time_fn(fn, device="cuda", reps=10, warmup=2).median_ms


def _measure(label, module, consts, step, ref, record):
    saved = {k: getattr(module, k) for k in consts}
    for k, val in consts.items():
        setattr(module, k, val)
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - sum(t.numel() * t.element_size()
                                                              for t in out)
        diff = [0.0, 0.0] if ref[0] is None else [
            float((o.float() - r.float()).norm() / r.float().norm()) for o, r in zip(out, ref[0])]
        if ref[0] is None:
            ref[0] = out
        del out
        t = _time(step)
    finally:
        for k, val in saved.items():
            setattr(module, k, val)
    record(dict(label=label, ms=t, extra_gb=peak / 1e9, grad_diff=diff))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--which", default="ce,jsd")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []

    def record(tag):
        def rec(r):
            r = dict(r, op=tag)
            rows.append(r)
            print(json.dumps(r), flush=True)
        return rec

    gen = torch.Generator(device="cuda").manual_seed(0)
    if "ce" in a.which:
        n, h, v = 16384, 4096, 128256
        x = (torch.randn(n, h, device="cuda", generator=gen) / h ** 0.25).bfloat16()
        x.requires_grad_()
        w = (torch.randn(v, h, device="cuda", generator=gen) / h ** 0.25).bfloat16()
        w.requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda", generator=gen)
        y[torch.rand(n, device="cuda", generator=gen) < 0.1] = -100
        g = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)

        def floor():
            torch.mm(x, w.t())
            torch.mm(g, w)
            torch.mm(g.t(), x)

        def step(kw):
            loss = lt.linear_cross_entropy(x, w, y, backend="triton", **kw)
            return torch.autograd.grad(loss, (x, w))

        ref = [None]
        for r in range(a.rounds):
            record("ce")(dict(label="floor", ms=_time(floor), round=r))
            for label, consts, kw in CE_SETTINGS:
                _measure(label, tce, consts, lambda kw=kw: step(kw), ref, record("ce"))
        del x, w, y, g, ref
        torch.cuda.empty_cache()
    if "jsd" in a.which:
        from benchmarks.jsd_profile import inputs
        xs, ws, xt, wt, y = inputs(8192, 4096, 128256)
        g = torch.randn(8192, 128256, device="cuda", dtype=torch.bfloat16)

        def floor():
            torch.mm(xs, ws.t())
            torch.mm(xt, wt.t())
            torch.mm(g, ws)
            torch.mm(g.t(), xs)

        def step(kw):
            loss = lt.linear_jsd(xs, ws, xt, wt, y, backend="triton", **kw)
            return torch.autograd.grad(loss, (xs, ws))

        ref = [None]
        for r in range(a.rounds):
            record("jsd")(dict(label="floor", ms=_time(floor), round=r))
            for label, consts, kw in JSD_SETTINGS:
                _measure(label, tjsd, consts, lambda kw=kw: step(kw), ref, record("jsd"))
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
