"""GPU probe: does the floor's data move its time? The floor multiplies a Gaussian bf16 G
[N, V] (benchmarks/linear_cross_entropy.floor_step); the op's real logit gradient has 10% zero
rows (ignored tokens) and tiny magnitudes (p / count), and an H100's clocks depend on the bits
its tensor cores toggle. Times the three floor GEMMs with each G interleaved (A B A B ...).
Not a user benchmark (DESIGN.md records what it found)."""
import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402


def real_gradient(x, w, ignored=0.1, seed=0):
    """The op's dz for mean reduction: (softmax(x·Wᵀ) − onehot) / count, 0 on ignored rows,
    in bf16 (what the fast mode feeds its dX / dW GEMMs)."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    n, v = x.shape[0], w.shape[0]
    y = torch.randint(0, v, (n,), device=x.device, generator=g)
    keep = torch.rand(n, device=x.device, generator=g) >= ignored
    out = torch.empty(n, v, device=x.device, dtype=torch.bfloat16)
    count = keep.sum().clamp_min(1).float()
    for s in range(0, n, 2048):  # fp32 softmax a slice at a time
        p = torch.softmax((x[s:s + 2048] @ w.t()).float(), dim=1)
        p[torch.arange(p.shape[0], device=x.device), y[s:s + 2048]] -= 1.0
        p *= (keep[s:s + 2048, None] / count)
        out[s:s + 2048] = p
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384,4096,128256;8192,2304,256000")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="/dev/stdout")
    a = ap.parse_args()
    with open(a.out, "a") as out:
        for spec in a.shapes.split(";"):
            n, h, v = map(int, spec.split(","))
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
            w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)).to(torch.bfloat16)
            gauss = torch.randn(n, v, device="cuda", generator=g, dtype=torch.bfloat16)
            real = real_gradient(x, w)
            steps = [common.gemm_step([(x, w.t()), (gmat, w), (gmat.t(), x)])[0]
                     for gmat in (gauss, real)]
            tg, tr = common.time_interleaved(steps, device="cuda", reps=a.reps, warmup_s=1.0)
            rec = dict(shape=[n, h, v], gaussian_ms=tg.median_ms, gradient_ms=tr.median_ms,
                       gradient_over_gaussian=tr.median_ms / tg.median_ms,
                       ci95=common.paired_ratio_ci(tr.times_ms, tg.times_ms))
            out.write(json.dumps(rec) + "\n")
            out.flush()
            del gauss, real, steps
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
