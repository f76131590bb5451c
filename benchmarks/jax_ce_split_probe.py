"""GPU probe: the Pallas linear cross-entropy's row kernel with rows split over several
programs (``row_split``), against whole rows (``row_split=1``), at one shape: per setting the
row kernels' GPU time per call and the whole fwd+bwd's kernel time (both from a ``jax.profiler``
trace of ``--calls`` calls, :func:`jax_jsd_profile.kernel_table`), and the loss and gradients'
largest relative difference from the ``row_split=1`` run (same inputs). (The results of the
twenty-fifth session were taken with ``{}`` as the first setting, which was whole rows then.)

    PYTHONPATH=. python3 benchmarks/jax_ce_split_probe.py [--shape 8192x2304x256000]
        [--sweep '[{"row_split": 4}, {"row_split": 4, "grid_size": 264, "num_warps": 8}]']
        [--out FILE.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.jax_jsd_profile import kernel_table  # noqa: E402

SWEEP = [{"row_split": k} for k in (2, 4, 8)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x2304x256000")
    ap.add_argument("--sweep", default=None, help="JSON list of tuning keyword dicts")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-evict", action="store_true",
                    help="without the kernel's L2 eviction hints (its EVICT constant)")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import logitless.jax as lj
    from logitless.pallas_kernels import linear_cross_entropy as kernels
    if a.no_evict:
        kernels.EVICT = (None, None, None)
    n, h, v = map(int, a.shape.split("x"))
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(k[1], (v, h)) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, v)
    out = open(a.out, "a") if a.out else None
    ref = None
    for kw in [{"row_split": 1}] + (json.loads(a.sweep) if a.sweep else SWEEP):
        f = jax.jit(jax.value_and_grad(
            lambda x, w: lj.linear_cross_entropy(x, w, y, backend="pallas", **kw),
            argnums=(0, 1)))
        loss, (dx, dw) = res = jax.block_until_ready(f(x, w))
        got = [np.asarray(t, np.float32) for t in (loss, dx, dw)]
        if ref is None:
            ref = got
        diff = [float(np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30))
                for g, r in zip(got, ref)]
        del res
        t = kernel_table(lambda: [f(x, w) for _ in range(a.calls)], rows=40, gaps=1)
        rows_ms = sum(ms for name, ms, _ in t["table"] if "cross_entropy_rows" in name) / a.calls
        line = dict(shape=a.shape, kwargs=kw, evict=kernels.EVICT, rows_ms=round(rows_ms, 4),
                    kernels_ms=round(t["kernels_ms"] / a.calls, 3),
                    max_rel_diff_loss_dx_dw=diff, loss=float(loss),
                    finite=bool(all(np.isfinite(g).all() for g in got)))
        common.emit_json(line, out)


if __name__ == "__main__":
    main()
