"""Per-row cost of the fast linear CE's three chunk GEMMs at several chunk sizes (GPU): logits
``[M, H]·[V, H]ᵀ`` (bf16 out), dX ``[M, V]·[V, H]`` (bf16 out) and the fp32-accumulating dW
``acc += [M, V]ᵀ·[M, H]`` (two halves of V, as ``narrow_cast.accumulate_split_``), each timed
alone, two interleaved rounds, for each chunk size M of ``--ms`` (``--shape``'s N is only a
label: list N itself in ``--ms`` for the unchunked GEMMs). Chooses nothing; prints JSON lines
(µs per token).

    PYTHONPATH=. python3 benchmarks/chunk_gemm_probe.py --shape 16384,4096,128256 --ms 2048,3277,3584
"""
import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402


def bench(fn, reps=20):
    return common.time_fn(fn, device="cuda", reps=reps, warmup=3).median_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--ms", default="2048,3072,3277,3328,3584,4096")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    n, h, v = map(int, a.shape.split(","))
    ms = [int(m) for m in a.ms.split(",")]
    dev = "cuda"
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(max(ms), h, device=dev, dtype=torch.bfloat16)
    z = torch.randn(max(ms), v, device=dev, dtype=torch.bfloat16) * 0.01
    v1 = (v + 1) // 2
    acc = (torch.zeros(v1, h, device=dev), torch.zeros(v - v1, h, device=dev))
    for r in range(a.rounds):
        for m in ms:
            zm, xm = z[:m], x[:m]
            out_l = torch.empty(m, v, device=dev, dtype=torch.bfloat16)
            out_x = torch.empty(m, h, device=dev, dtype=torch.bfloat16)
            t_l = bench(lambda: torch.mm(xm, w.t(), out=out_l))
            t_x = bench(lambda: torch.mm(zm, w, out=out_x))

            def dw():
                torch.addmm(acc[0], zm[:, :v1].t(), xm, out_dtype=torch.float32, out=acc[0])
                torch.addmm(acc[1], zm[:, v1:].t(), xm, out_dtype=torch.float32, out=acc[1])
            t_w = bench(dw)
            us = lambda t: round(t * 1e3 / m, 4)
            print(json.dumps(dict(shape=[n, h, v], round=r, m=m, logits_us_per_token=us(t_l),
                                  dx_us_per_token=us(t_x), dw_acc_us_per_token=us(t_w),
                                  sum_us_per_token=us(t_l + t_x + t_w),
                                  ms=[round(t_l, 3), round(t_x, 3), round(t_w, 3)])),
                  flush=True)


if __name__ == "__main__":
    main()
