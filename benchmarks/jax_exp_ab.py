"""GPU probe: how the Pallas kernels take e^x (``logitless._jax_common.exp``), A/B in one process.

Variants: ``"exp"`` (``jnp.exp``, which Pallas lowers to libdevice's expf) and ``"exp2"``
(``jnp.exp2(x·log₂e)``: one ``ex2.approx``, as Triton's ``tl.exp``). Each variant's program is
traced and compiled with ``_jax_common.exp`` set to it, then every program (and the XLA floor of
the op) is timed interleaved (floor A B floor A B ...) by the wall clock up to the result, so
that clock drift hits them alike. Cases: the linear JSD (N=8192, H=4096, V=128256, β = 0.5,
bf16; floor: its four GEMMs through XLA) and the linear CE (N=16384, H=4096, V=128256; floor:
three GEMMs), ``backend="pallas"``, fwd+bwd. JSON lines: per case and variant the median ms,
its ratio to the floor calls timed with it, its paired ratio to the first variant with a 95%
bootstrap interval, and the loss.

    PYTHONPATH=. python3 benchmarks/jax_exp_ab.py --reps 20 [--cases jsd,ce] [--small]
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
from logitless import _jax_common  # noqa: E402

VARIANTS = {"exp": jnp.exp, "exp2": _jax_common.exp}


def _inputs(n, h, v, heads):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * heads + 1)
    arrs = []
    for k in range(heads):
        arrs.append((jax.random.normal(keys[2 * k], (n, h)) * 0.5).astype(jnp.bfloat16))
        arrs.append((jax.random.normal(keys[2 * k + 1], (v, h)) * h ** -0.5)
                    .astype(jnp.bfloat16))
    y = jax.random.randint(keys[-1], (n,), 0, v)
    return arrs, y


def _case(name, small=False):
    """(loss_fn whose first two arguments are differentiated, its arguments, floor step); every
    array an argument (a closed-over one would be compiled in as a constant)."""
    if name == "jsd":
        n, h, v = (64, 32, 1000) if small else (8192, 4096, 128256)
        (xs, ws, xt, wt), y = _inputs(n, h, v, 2)
        g = jnp.full((n, v), 1e-3, jnp.bfloat16)
        loss = lambda xs, ws, xt, wt, y: lj.linear_jsd(xs, ws, xt, wt, y, beta=0.5,
                                                         backend="pallas")
        gemms = jax.jit(lambda xs, ws, xt, wt, g: (xs @ ws.T, xt @ wt.T, g @ ws, g.T @ xs))
        return loss, (xs, ws, xt, wt, y), lambda: gemms(xs, ws, xt, wt, g)
    n, h, v = (64, 32, 1000) if small else (16384, 4096, 128256)
    (x, w), y = _inputs(n, h, v, 1)
    g = jnp.full((n, v), 1e-3, jnp.bfloat16)
    loss = lambda x, w, y: lj.linear_cross_entropy(x, w, y, backend="pallas")
    gemms = jax.jit(lambda x, w, g: (x @ w.T, g @ w, g.T @ x))
    return loss, (x, w, y), lambda: gemms(x, w, g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="jsd,ce")
    ap.add_argument("--variants", default="exp,exp2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU dry run)")
    a = ap.parse_args()
    names = a.variants.split(",")
    print(json.dumps({"about": __doc__.split("\n\n")[0], "gpu": str(jax.devices()[0]),
                      "jax": jax.__version__, "git": common.git_provenance()}), flush=True)
    original = _jax_common.exp
    for case in a.cases.split(","):
        loss, args, floor = _case(case, a.small)
        steps = []
        try:
            for nm in names:
                _jax_common.exp = VARIANTS[nm]
                fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
                steps.append(lambda fn=fn: fn(*args))
                jax.block_until_ready(steps[-1]())
        finally:
            _jax_common.exp = original
        losses = [float(s()[0]) for s in steps]
        timings = common.time_interleaved([floor] + steps, device="cpu", reps=a.reps,
                                          warmup_s=a.warmup_s, wall=True)
        ft, ts = timings[0], timings[1:]
        for i, (nm, t) in enumerate(zip(names, ts)):
            rec = {"case": case, "variant": nm, "ms": round(t.median_ms, 3),
                   "floor_ms": round(ft.median_ms, 3),
                   "x_floor": round(t.median_ms / ft.median_ms, 4),
                   "x_floor_ci95": [round(r, 4) for r in
                                    common.paired_ratio_ci(t.times_ms, ft.times_ms)],
                   "loss": losses[i]}
            if i:
                rec["ratio_to_first"] = round(t.median_ms / ts[0].median_ms, 4)
                rec["ratio_ci95"] = [round(r, 4) for r in
                                     common.paired_ratio_ci(t.times_ms, ts[0].times_ms)]
            print(json.dumps(rec), flush=True)
        del loss, args, floor, steps


if __name__ == "__main__":
    main()
