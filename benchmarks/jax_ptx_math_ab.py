"""GPU probe: the Pallas kernels' exp / log as PTX ex2.approx.ftz / lg2.approx (the default,
``pallas_kernels._launch.PTX_MATH``) against a baseline, A/B in one process: libdevice's
expf / logf (``--baseline libdevice``), or the PTX forms with the exp's subnormal results
kept (``--baseline noftz``: plain ex2.approx, which ptxas wraps in three more instructions).
Per shape, the op's fwd+bwd compiled twice (once with the baseline's forms) and timed
interleaved with the XLA floor (rotated rounds), plus the two versions' losses. The JSON keys
keep their first names: ``libdevice_*`` is the baseline, ``ptx_*`` the default.

    PYTHONPATH=. python3 benchmarks/jax_ptx_math_ab.py [--reps 20] [--small]
        [--baseline noftz] [--ops jsd]
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
from logitless.pallas_kernels import _launch  # noqa: E402

CASES = [("ce", (16384, 4096, 128256)), ("ce", (8192, 2304, 256000)),
         ("jsd", (8192, 4096, 128256))]


def _steps(op, n, h, v, tuning=None):
    """(fwd+bwd of ``op`` as a function of (x, w), its arguments, the floor step); inputs as
    the benchmarks make them (bf16, logits of std ~3); ``tuning``: keywords of the CE."""
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    x = jax.random.normal(k[0], (n, h)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (v, h)) * 3.0 * h ** -0.5).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, v)
    g = jax.random.normal(k[3], (n, v)).astype(jnp.bfloat16)
    if op == "ce":
        fn = lambda x, w: lj.linear_cross_entropy(x, w, y, backend="pallas",  # noqa: E731
                                                  **(tuning or {}))
        args = (x, w)
        floor = jax.jit(lambda x, w, g: (x @ w.T, g @ w, g.T @ x))
        floor_args = (x, w, g)
    else:
        xt = jax.random.normal(k[4], (n, h)).astype(jnp.bfloat16)
        wt = (jax.random.normal(k[5], (v, h)) * 3.0 * h ** -0.5).astype(jnp.bfloat16)
        fn = lambda x, w: lj.linear_jsd(x, w, xt, wt, y, beta=0.5, backend="pallas")  # noqa
        args = (x, w)
        floor = jax.jit(lambda x, w, xt, wt, g: (x @ w.T, xt @ wt.T, g @ w, g.T @ x))
        floor_args = (x, w, xt, wt, g)
    return jax.value_and_grad(fn, argnums=(0, 1)), args, lambda: floor(*floor_args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a dry run)")
    ap.add_argument("--baseline", choices=("libdevice", "noftz"), default="libdevice")
    ap.add_argument("--ops", default="ce,jsd", help="the CASES of these ops")
    a = ap.parse_args()
    print(json.dumps({"about": __doc__.split("\n\n")[0], "gpu": str(jax.devices()[0]),
                      "jax": jax.__version__, "git": common.git_provenance()}), flush=True)
    for op, shape in [c for c in CASES if c[0] in a.ops.split(",")]:
        shape = (64, 32, 1000) if a.small else shape
        vg, args, floor = _steps(op, *shape)
        # compiled ahead of time, each after clearing JAX's caches: the ops' inner traces
        # are cached by their static configuration, which the switch is not part of
        keep, keep_math = _launch._with_ptx_math, _launch.PTX_MATH
        if a.baseline == "libdevice":
            _launch._with_ptx_math = lambda kernel: kernel  # traced now without the PTX forms
        else:
            _launch.PTX_MATH = _launch.ptx_math(exp_ftz=False)
        try:
            jax.clear_caches()
            libdevice = jax.jit(vg).lower(*args).compile()
        finally:
            _launch._with_ptx_math, _launch.PTX_MATH = keep, keep_math
        jax.clear_caches()
        ptx = jax.jit(vg).lower(*args).compile()
        out = {"ptx": jax.block_until_ready(ptx(*args)),
               "libdevice": jax.block_until_ready(libdevice(*args))}
        steps = [floor, lambda: libdevice(*args), lambda: ptx(*args)]
        t_floor, t_lib, t_ptx = common.time_interleaved(steps, device="cpu", reps=a.reps,
                                                        warmup_s=3.0, wall=True)
        rec = dict(op=op, shape=shape, baseline=a.baseline, floor_ms=t_floor.median_ms,
                   libdevice_ms=t_lib.median_ms, ptx_ms=t_ptx.median_ms,
                   libdevice_x_floor=t_lib.median_ms / t_floor.median_ms,
                   ptx_x_floor=t_ptx.median_ms / t_floor.median_ms,
                   ptx_over_libdevice=t_ptx.median_ms / t_lib.median_ms,
                   ptx_over_libdevice_ci95=common.paired_ratio_ci(t_ptx.times_ms,
                                                                  t_lib.times_ms),
                   loss_ptx=float(out["ptx"][0]), loss_libdevice=float(out["libdevice"][0]),
                   dx_rel_diff=float(jnp.linalg.norm(
                       (out["ptx"][1][0] - out["libdevice"][1][0]).astype(jnp.float32))
                       / jnp.linalg.norm(out["libdevice"][1][0].astype(jnp.float32))))
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
