"""GPU probe: the Pallas linear JSD of this tree against an older version of its code, A/B in
one process, timed interleaved (floor old new, rotated each round) by the wall clock up to the
result, so that clock drift hits them alike.

The old version is two files (``git show <commit>:logitless/_jax_jsd.py`` and
``...:logitless/pallas_kernels/linear_jsd.py``), loaded as modules of the package and joined to
the front door as backend ``"pallas-old"``; its chunk driver takes the front door's prepared
arguments, so the two versions must agree on those. Case: N=8192, H=4096, V=128256, bf16,
fwd+bwd, floor: its four GEMMs through XLA. JSON lines: per variant the median ms, its ratio to
the floor calls timed with it, its paired ratio to the one run first (``--first``: old by
default) with a 95% bootstrap interval, and the loss.

    PYTHONPATH=. python3 benchmarks/jax_jsd_code_ab.py --old-jax-jsd OLD1.py \
        --old-pallas OLD2.py --reps 20 [--beta 0.5] [--small]
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
import logitless.jax as lj  # noqa: E402
from logitless import _jax_jsd  # noqa: E402


def _join_old(jax_jsd_path, pallas_path):
    common.load_module_file("logitless._ab_jax_jsd", jax_jsd_path)
    common.load_module_file("logitless.pallas_kernels._ab_linear_jsd", pallas_path,
                            [("from .. import _jax_jsd as jc",
                              "from .. import _ab_jax_jsd as jc")])
    _jax_jsd._BACKENDS["pallas-old"] = "logitless.pallas_kernels._ab_linear_jsd"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-jax-jsd", required=True)
    ap.add_argument("--old-pallas", required=True)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--first", choices=("old", "new"), default="old",
                    help="which version runs first in each round (position bias check)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU dry run)")
    a = ap.parse_args()
    _join_old(a.old_jax_jsd, a.old_pallas)
    print(json.dumps({"about": __doc__.split("\n\n")[0], "gpu": str(jax.devices()[0]),
                      "jax": jax.__version__, "beta": a.beta, "git": common.git_provenance()}),
          flush=True)
    n, h, v = (64, 32, 1000) if a.small else (8192, 4096, 128256)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    xs, xt = ((jax.random.normal(k, (n, h)) * 0.5).astype(jnp.bfloat16) for k in keys[:2])
    ws, wt = ((jax.random.normal(k, (v, h)) * h ** -0.5).astype(jnp.bfloat16) for k in keys[2:4])
    y = jax.random.randint(keys[4], (n,), 0, v)
    g = jnp.full((n, v), 1e-3, jnp.bfloat16)
    gemms = jax.jit(lambda xs, ws, xt, wt, g: (xs @ ws.T, xt @ wt.T, g @ ws, g.T @ xs))
    names = ["pallas-old", "pallas"] if a.first == "old" else ["pallas", "pallas-old"]
    steps, losses = [], []
    for name in names:
        loss = lambda xs, ws, xt, wt, y, name=name: lj.linear_jsd(xs, ws, xt, wt, y, beta=a.beta,
                                                                  backend=name)
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(xs, ws, xt, wt, y).compile()
        steps.append(lambda fn=fn: fn(xs, ws, xt, wt, y))
        losses.append(float(jax.block_until_ready(steps[-1]())[0]))
    timings = common.time_interleaved([lambda: gemms(xs, ws, xt, wt, g)] + steps, device="cpu",
                                      reps=a.reps, warmup_s=a.warmup_s, wall=True)
    ft, ts = timings[0], timings[1:]
    for i, (name, t) in enumerate(zip(names, ts)):
        rec = {"variant": name, "ms": round(t.median_ms, 3), "floor_ms": round(ft.median_ms, 3),
               "x_floor": round(t.median_ms / ft.median_ms, 4),
               "x_floor_ci95": [round(r, 4) for r in common.paired_ratio_ci(t.times_ms,
                                                                            ft.times_ms)],
               "loss": losses[i]}
        if i:
            rec["ratio_to_first"] = round(t.median_ms / ts[0].median_ms, 4)
            rec["ratio_ci95"] = [round(r, 4) for r in common.paired_ratio_ci(t.times_ms,
                                                                             ts[0].times_ms)]
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
