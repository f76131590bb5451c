"""GPU probe: the fast mode's fp32-accumulating weight-gradient GEMM of one token chunk
(``acc += dzᵀ·x_c`` into the split fp32 pair of ``narrow_cast.accumulator_pair``), cuBLAS
(``narrow_cast.accumulate_split_``) against ours (``weight_grad_gemm.accumulate_``) for tile
settings from ``--tiles`` (JSON list), interleaved rounds, with the largest difference between
the two results. JSON lines.

    PYTHONPATH=. python3 benchmarks/weight_grad_probe.py --shape 16384,4096,128256 --ms 3584
"""
import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from logitless._torch_common import rows_buffer  # noqa: E402
from logitless.triton_kernels import weight_grad_gemm as wg  # noqa: E402
from logitless.triton_kernels.narrow_cast import accumulate_split_, accumulator_pair  # noqa: E402

TILES = [dict(bm=128, bn=128, bk=64, group_m=8, stages=3, warps=8),
         dict(bm=128, bn=128, bk=64, group_m=8, stages=4, warps=8, c_ptr=True),
         dict(bm=128, bn=256, bk=64, group_m=8, stages=3, warps=8, c_ptr=True),
         dict(bm=128, bn=256, bk=64, group_m=8, stages=4, warps=8, c_ptr=True),
         dict(bm=256, bn=128, bk=64, group_m=8, stages=3, warps=8, c_ptr=True)]


def bench(fn, reps=20):
    return common.time_fn(fn, device="cuda", reps=reps, warmup=3).median_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384,4096,128256")
    ap.add_argument("--ms", default="3584")
    ap.add_argument("--tiles", default=json.dumps(TILES))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    _, h, v = map(int, a.shape.split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    acc = accumulator_pair(v, h, torch.float32, torch.bfloat16, torch.empty(0, device="cuda"),
                           zero=True)
    r1 = acc[0].shape[0]
    for m in map(int, a.ms.split(",")):
        dz = rows_buffer(m, v, torch.bfloat16, "cuda")
        dz.copy_(torch.randn(m, v, device="cuda", dtype=torch.bfloat16) * 1e-2)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)

        def cublas():
            accumulate_split_(acc, dz, x, first=False)

        def ours(t):
            def f():
                wg.accumulate_(acc[0], dz, 0, x, False, False, sms, t)
                wg.accumulate_(acc[1], dz, r1, x, False, False, sms, t)
            return f
        cands = [("cublas", None, cublas)]
        for t in json.loads(a.tiles):
            try:
                f = ours(t)
                for p in acc:
                    p.zero_()
                f()
                got = torch.cat([p.clone() for p in acc])
                for p in acc:
                    p.zero_()
                cublas()
                ref = torch.cat(acc)
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                cands.append((json.dumps(t), err, f))
            except Exception as e:  # noqa: BLE001 (a tile setting that does not compile)
                print(json.dumps({"tiles": t, "error": str(e)[:200]}), flush=True)
        for r in range(a.rounds):
            for name, err, f in cands:
                print(json.dumps({"shape": [m, h, v], "round": r, "candidate": name,
                                  "ms": round(bench(f), 4), "max_rel_diff": err}), flush=True)
        del dz, x


if __name__ == "__main__":
    main()
