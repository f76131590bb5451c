"""Where the JAX linear cross-entropy's time goes on a GPU: one jitted fwd+bwd per backend,
its kernel table from a ``jax.profiler`` trace (:func:`jax_jsd_profile.kernel_table`) and,
with ``--hlo DIR``, the optimized HLO (to see which copies and GEMMs XLA made).

    PYTHONPATH=. python3 benchmarks/jax_ce_profile.py [--shape 10000x1600x50257]
        [--backends pallas,xla] [--hlo DIR] [--sweep '[{}, {"block_v": 32768}]']

``--sweep``: keyword sets of the backends (tuning), each profiled in turn.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.jax_jsd_profile import kernel_table  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="10000x1600x50257")
    ap.add_argument("--backends", default="pallas,xla")
    ap.add_argument("--hlo", default=None)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--sweep", default="[{}]", help="JSON list of keyword dicts")
    a = ap.parse_args()
    import json

    import jax
    import jax.numpy as jnp
    import logitless.jax as lj
    n, h, v = map(int, a.shape.split("x"))
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(k[1], (v, h)) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, v)
    for backend, kw in ((b, kw) for b in a.backends.split(",") for kw in json.loads(a.sweep)):
        f = jax.jit(jax.value_and_grad(
            lambda x, w: lj.linear_cross_entropy(x, w, y, backend=backend, **kw), argnums=(0, 1)))
        comp = f.lower(x, w).compile()
        temp = comp.memory_analysis().temp_size_in_bytes
        if a.hlo:
            Path(a.hlo).mkdir(parents=True, exist_ok=True)
            Path(a.hlo, f"{backend}-{a.shape}.hlo.txt").write_text(comp.as_text())
        jax.block_until_ready(f(x, w))
        t = kernel_table(lambda: f(x, w), rows=a.rows, gaps=4)
        print(f"== {backend} {kw} {a.shape}: temp {temp / 1e9:.2f} GB, kernels {t['kernels_ms']:.2f} ms,"
              f" span {t['span_ms']:.2f} ms, idle {t['idle_ms']:.2f} ms")
        for name, ms, count in t["table"]:
            print(f"  {ms:8.3f} ms  x{count:<4d} {name}")


if __name__ == "__main__":
    main()
