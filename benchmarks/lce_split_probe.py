"""GPU probe: the Triton CE row kernel (loss, lse and dz of one token chunk, as the fast mode's
forward runs it) with rows split over programs (``segment_size``), against whole rows. Per
setting: the kernel's GPU time per launch (CUDA events around ``--reps`` back-to-back launches
on one chunk, which each rewrites in place: timing does not depend on the values), and the
largest difference of loss, lse and dz from whole rows on fresh logits.

Settings are JSON dicts of the row kernel's launch constants (``SPLIT_BLOCK``,
``SPLIT_WARPS``, ``SPLIT_PROGRAMS_PER_SM``, ``SPLIT_EVICT`` of
``triton_kernels.linear_cross_entropy``), ``FAST_EXP`` (of ``triton_kernels.fast_math``) and
``segment`` / ``row_sync`` / ``block_v`` / ``num_warps`` (its ``Config``).

    PYTHONPATH=. python3 benchmarks/lce_split_probe.py [--chunk 3584x128256]
        [--sweep '[{"segment": 16384}, {"segment": 8192, "SPLIT_WARPS": 4}]'] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from logitless.triton_kernels import linear_cross_entropy as lce  # noqa: E402

SWEEP = [{"segment": s, "SPLIT_BLOCK": b, "SPLIT_WARPS": nw, "SPLIT_PROGRAMS_PER_SM": p}
         for s in (8192, 16384, 32768) for b, nw in ((2048, 2), (2048, 4), (4096, 4))
         for p in (8, 16)]
CONSTANTS = ("SPLIT_BLOCK", "SPLIT_WARPS", "SPLIT_PROGRAMS_PER_SM", "SPLIT_EVICT", "FAST_EXP")


def _owner(name):
    return lce.fast_math if name == "FAST_EXP" else lce


def run_rows(buf, y, lse, loss, setting):
    original = {k: getattr(_owner(k), k) for k in CONSTANTS}
    for k in CONSTANTS:
        if k in setting:
            setattr(_owner(k), k, setting[k])
    cfg = lce.Config(buf.shape[0], buf.shape[0], setting.get("block_v", 0),
                     setting.get("num_warps", 0), segment=setting.get("segment", 1 << 30),
                     row_sync=setting.get("row_sync", True))
    try:
        lce._rows(buf, None, buf.shape[0], buf.shape[1], 0, y, None, None, lse, loss,
                  lce._ones(buf), None, (-100, 0.0, 0.0, None), buf.shape[1], cfg,
                  compute_lse=True, write_grad=True)
    finally:
        for k, v in original.items():
            setattr(_owner(k), k, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", default="3584x128256", help="rows x V of the bf16 logits")
    ap.add_argument("--sweep", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows, v = map(int, a.chunk.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    keep = (torch.randn(rows, v, device="cuda", generator=g) * 2).bfloat16()
    y = torch.randint(0, v, (rows,), device="cuda", generator=g)
    y[::10] = -100
    buf = torch.empty_like(keep)
    lse = torch.empty(rows, device="cuda")
    loss = torch.empty(rows, device="cuda")
    out = open(a.out, "a") if a.out else None
    settings = [{}] + (json.loads(a.sweep) if a.sweep else SWEEP)  # {}: whole rows
    ref = None
    for s in settings:
        buf.copy_(keep)
        run_rows(buf, y, lse, loss, s)
        got = (loss.clone(), lse.clone(), buf.float())
        if ref is None:
            ref = got
        diff = [float((t - r).abs().nan_to_num(float("inf")).max()) for t, r in zip(got, ref)]
        del got
        times = []
        for _ in range(a.rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.reps):
                run_rows(buf, y, lse, loss, s)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / a.reps)
        times.sort()
        common.emit_json(dict(chunk=a.chunk, setting=s, ms=round(times[len(times) // 2], 4),
                              ms_min=round(times[0], 4), max_diff_loss_lse_dz=diff,
                              gb_per_s_2pass=round(2 * rows * v * 2 / times[0] / 1e6, 1)), out)


if __name__ == "__main__":
    main()
