"""Where linear JSD's time goes on a GPU: a kernel-level profile of one fwd+bwd of
``backend="triton"`` and a sweep of chunk settings (time, peak extra memory; ``--kernels``:
each setting's device time split into row kernel, GEMMs and the rest, from one profiled call,
coarse: one call's clocks; ``--profile '{"fp16_tile_logits": true}'``: the settings of the
final kernel-by-kernel table; ``--timeline``: each setting's kernels from their start/end
times: the GPU's busy and idle time inside the call, device time per kernel name).

    PYTHONPATH=. python3 benchmarks/jsd_profile.py [--n 8192 --h 4096 --v 128256]
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

SWEEP = [  # backend="triton" tuning keywords
    {}, dict(row_sync=True),
    dict(programs_per_sm=3), dict(programs_per_sm=4),
    dict(num_warps=4, block_v=1024, programs_per_sm=4),
    dict(block_v=4096, segment_size=16384), dict(segment_size=16384), dict(segment_size=32768),
    dict(chunk_size=2048, logits_chunk_size=512), dict(chunk_size=1536, logits_chunk_size=512),
    dict(chunk_size=2048, logits_chunk_size=256),
    dict(fp32_logits=False),
]


def inputs(n, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = (torch.randn(n, h, device="cuda", generator=g) / h ** 0.25).bfloat16().requires_grad_()
    ws = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.25 * 2).bfloat16()
    ws.requires_grad_()
    xt = (xs.detach().float() + 0.5 * torch.randn(n, h, device="cuda", generator=g)
          / h ** 0.25).bfloat16()
    wt = (ws.detach().float() + 0.5 * torch.randn(v, h, device="cuda", generator=g)
          / h ** 0.25 * 2).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return xs, ws, xt, wt, y


def time_ms(fn, reps=10, warmup=2):
    return common.time_fn(fn, device="cuda", reps=reps, warmup=warmup).median_ms


def kernel_split(step):
    """Device time (ms) of one profiled ``step()`` by kind: the JSD row kernel, GEMMs
    (cuBLAS's nvjet kernels, ours), everything else; kernels only (the ops that launch them
    carry the same time again)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    split = {"rows": 0.0, "gemms": 0.0, "other": 0.0}
    for e in prof.key_averages():
        if e.cpu_time_total > 0:  # an op on the host (its kernels are listed on their own)
            continue
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        name = e.key.lower()
        kind = ("rows" if "jsd_rows" in name else
                "gemms" if ("nvjet" in name or "gemm" in name or "xmma" in name
                            or "logits_stats" in name) else "other")
        split[kind] += us / 1e3
    return {k: round(v, 3) for k, v in split.items()}


def timeline(step):
    """One profiled ``step()`` from its kernels' own start/end times: device time per kernel
    name (each kernel once: key_averages can count a Triton launch twice), the time the GPU was
    busy (the union of the kernels' intervals) and the span from the first kernel's start to the
    last one's end; span - busy is time the GPU sat idle inside the call."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events()
               if str(getattr(e, "device_type", "")).endswith("CUDA")]
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    per = {}
    busy, end = 0.0, None
    gaps = []
    for s, t, name in spans:
        per[name] = per.get(name, 0.0) + (t - s) / 1e3
        if end is None or s >= end:
            if end is not None:
                gaps.append((s - end) / 1e3)
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    span = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    top = sorted(per.items(), key=lambda kv: -kv[1])[:12]
    gaps.sort(reverse=True)
    return {"span_ms": round(span, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_ms": round(span - busy / 1e3, 3), "kernels": len(spans),
            "largest_gaps_ms": [round(g, 3) for g in gaps[:5]],
            "per_kernel_ms": {k[:70]: round(v, 3) for k, v in top}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--sweep", default=None,
                    help="JSON list of tuning-keyword dicts (default: the built-in SWEEP)")
    ap.add_argument("--profile", default="{}",
                    help="JSON tuning keywords of the call profiled kernel by kernel at the end")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile one call of each sweep entry: its row kernel's, GEMMs' "
                         "and other kernels' device time")
    ap.add_argument("--timeline", action="store_true",
                    help="also profile one call of each sweep entry from its kernels' start/end "
                         "times: busy vs idle time in the call, device time per kernel name")
    a = ap.parse_args()
    sweep = json.loads(a.sweep) if a.sweep else SWEEP
    xs, ws, xt, wt, y = inputs(a.n, a.h, a.v)
    g = torch.randn(a.n, a.v, device="cuda", dtype=torch.bfloat16)

    def floor():
        torch.mm(xs, ws.t())
        torch.mm(xt, wt.t())
        torch.mm(g, ws)
        torch.mm(g.t(), xs)

    fl = time_ms(floor)
    del g
    torch.cuda.empty_cache()
    print(f"floor (4 GEMMs): {fl:.2f} ms")
    ref = None
    for kw in sweep:
        def step(kw=kw):
            loss = lt.linear_jsd(xs, ws, xt, wt, y, backend="triton", **kw)
            return torch.autograd.grad(loss, (xs, ws))
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - sum(t.numel() * t.element_size()
                                                              for t in out)
        # every setting computes the same gradients (the first one is the reference)
        diff = [0.0, 0.0] if ref is None else [
            float((o.float() - r.float()).norm() / r.float().norm()) for o, r in zip(out, ref)]
        ref = out if ref is None else ref
        del out
        t = time_ms(step)
        print(f"{kw}: {t:.2f} ms ({t / fl:.3f}x), extra {peak / 1e9:.2f} GB, "
              f"dX/dW rel diff to the first {diff[0]:.1e}/{diff[1]:.1e}", flush=True)
        if a.kernels:
            print("   kernels (ms): " + json.dumps(kernel_split(step)), flush=True)
        if a.timeline:
            print("   timeline: " + json.dumps(timeline(step)), flush=True)

    profiled = json.loads(a.profile)
    print(f"profile of {profiled}:")

    def step():
        loss = lt.linear_jsd(xs, ws, xt, wt, y, backend="triton", **profiled)
        return torch.autograd.grad(loss, (xs, ws))
    step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    for key in ("device_time_total", "cuda_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=14,
                                            max_name_column_width=60))
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by=key, row_limit=16, max_name_column_width=30,
                max_shapes_column_width=70))
            break
        except Exception:  # noqa: BLE001 - the key's name differs across torch versions
            continue


if __name__ == "__main__":
    main()
