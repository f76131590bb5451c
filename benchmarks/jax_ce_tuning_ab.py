"""GPU probe: the Pallas linear cross-entropy under two sets of tuning keywords, A/B in one
process: per shape, fwd+bwd compiled for each set and timed interleaved with the XLA floor
(rotated rounds), with B's paired time ratio to A (95% bootstrap interval) and the largest
relative difference of their dX.

    PYTHONPATH=. python3 benchmarks/jax_ce_tuning_ab.py --a '{"row_split": 1}' --b '{}'
        [--reps 30] [--shapes 16384x4096x128256,8192x2304x256000] [--out FILE.jsonl]
"""
import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.jax_ptx_math_ab import _steps  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="JSON dict of tuning keywords")
    ap.add_argument("--b", required=True, help="JSON dict of tuning keywords")
    ap.add_argument("--shapes", default="16384x4096x128256,8192x2304x256000")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    kw = {"a": json.loads(a.a), "b": json.loads(a.b)}
    out = open(a.out, "a") if a.out else None
    head = {"about": __doc__.split("\n\n")[0], "gpu": str(jax.devices()[0]),
            "jax": jax.__version__, "git": common.git_provenance(), "a": kw["a"], "b": kw["b"]}
    common.emit_json(head, out)
    for shape in a.shapes.split(","):
        n, h, v = map(int, shape.split("x"))
        fns, args, floor = {}, None, None
        for name in ("a", "b"):
            vg, args, floor = _steps("ce", n, h, v, tuning=kw[name])
            fns[name] = jax.jit(vg).lower(*args).compile()
        res = {k: jax.block_until_ready(f(*args)) for k, f in fns.items()}
        t_floor, t_a, t_b = common.time_interleaved(
            [floor, lambda: fns["a"](*args), lambda: fns["b"](*args)], device="cpu",
            reps=a.reps, warmup_s=3.0, wall=True)
        dx_a, dx_b = (res[k][1][0].astype(jnp.float32) for k in ("a", "b"))
        rec = dict(shape=shape, floor_ms=t_floor.median_ms, a_ms=t_a.median_ms,
                   b_ms=t_b.median_ms, a_x_floor=t_a.median_ms / t_floor.median_ms,
                   b_x_floor=t_b.median_ms / t_floor.median_ms,
                   b_over_a=t_b.median_ms / t_a.median_ms,
                   b_over_a_ci95=common.paired_ratio_ci(t_b.times_ms, t_a.times_ms),
                   loss_a=float(res["a"][0]), loss_b=float(res["b"][0]),
                   dx_max_rel_diff=float(jnp.max(jnp.abs(dx_b - dx_a)) / jnp.max(jnp.abs(dx_a))))
        common.emit_json(rec, out)


if __name__ == "__main__":
    main()
