"""GPU probe: one fast-mode chunk's dX GEMM (``dz·W``, K = V) and fp32-accumulating dW GEMM
(``acc += dzᵀ·x_c``) run one after the other on one stream, or with dX on a side stream so
that each GEMM's last, partly filled wave of tiles overlaps the other's. Chunk sizes from
``--ms``; medians of interleaved rounds, JSON lines.

    PYTHONPATH=. python3 benchmarks/grad_overlap_probe.py --shape 16384,4096,128256 --ms 2048,3584
"""
import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.chunk_gemm_probe import bench  # noqa: E402
from logitless.triton_kernels.narrow_cast import accumulate_split_, accumulator_pair  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--ms", default="2048,3584")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    _, h, v = map(int, a.shape.split(","))
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    acc = accumulator_pair(v, h, torch.float32, torch.bfloat16, w, zero=True)
    side = torch.cuda.Stream()
    for m in map(int, a.ms.split(",")):
        dz = torch.randn(m, v, device="cuda", dtype=torch.bfloat16) * 1e-3
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)

        def serial():
            torch.mm(dz, w, out=dx)
            accumulate_split_(acc, dz, x, first=False)

        def overlapped():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                torch.mm(dz, w, out=dx)
            accumulate_split_(acc, dz, x, first=False)
            cur.wait_stream(side)

        def dx_only():
            torch.mm(dz, w, out=dx)

        def dw_only():
            accumulate_split_(acc, dz, x, first=False)
        for r in range(a.rounds):
            row = {"shape": [m, h, v], "round": r}
            for name, fn in (("serial", serial), ("overlapped", overlapped), ("dx", dx_only),
                             ("dw", dw_only)):
                row[name + "_ms"] = round(bench(fn), 4)
            row["overlap_gain"] = round(row["serial_ms"] / row["overlapped_ms"], 4)
            print(json.dumps(row), flush=True)
        del dz, x, dx


if __name__ == "__main__":
    main()
