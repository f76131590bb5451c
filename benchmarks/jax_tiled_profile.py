"""Where the JAX tiled MLP's time and memory go on a GPU, per shard count: the fwd+bwd of
``tiled_mlp.py``'s jax-tiled at the TARGETS shape (one jitted program), timed (median of
wall-clock calls), its XLA temp and outputs, and a kernel table with idle time from one
``jax.profiler`` trace, beside the plain jnp MLP.

    PYTHONPATH=. python3 benchmarks/jax_tiled_profile.py [--shards 8,16] [--rows 18]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.jax_jsd_profile import kernel_table  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", default="8,16")
    ap.add_argument("--t", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=18)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import logitless.jax as lj
    h, i = 4096, 14336
    mlp = lj.SwiGLUMLP(h, i)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = mlp.init(keys[0], jnp.bfloat16)
    x = jax.random.normal(keys[1], (a.t, h), jnp.bfloat16)
    dy = jax.random.normal(keys[2], (a.t, h), jnp.bfloat16)

    def plain(p, x):
        g, u = x @ p["gate_proj"]["kernel"], x @ p["up_proj"]["kernel"]
        return (jax.nn.silu(g) * u) @ p["down_proj"]["kernel"]

    fns = {"plain": plain}
    for n in a.shards.split(","):
        fns[f"tiled, {n} shards"] = (lambda n: lambda p, x: lj.tiled_mlp(
            mlp, p, x, num_shards=n))(int(n))
    for name, fn in fns.items():
        def fwd_bwd(p, x, dy, fn=fn):
            y, vjp = jax.vjp(fn, p, x)
            return (y,) + vjp(dy)
        step = jax.jit(fwd_bwd).lower(params, x, dy).compile()
        run = lambda: step(params, x, dy)
        for _ in range(2):
            jax.block_until_ready(run())
        ms = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            ms.append((time.perf_counter() - t0) * 1e3)
        mem = step.memory_analysis()
        temp, out = mem.temp_size_in_bytes, mem.output_size_in_bytes
        tab = kernel_table(run, rows=a.rows)
        head = (f"== {name}: {statistics.median(ms):.1f} ms (median of {a.reps}), temp "
                f"{temp / 1e6:.0f} MB, temp + outputs {(temp + out) / 1e9:.2f} GB")
        if tab is None:  # no trace written
            print(head + "; no profiler trace")
            continue
        print(f"{head}; kernels {tab['kernels_ms']:.1f} ms, span {tab['span_ms']:.1f}, "
              f"idle {tab['idle_ms']:.1f}")
        for k, t, n in tab["table"]:
            print(f"   {t:8.2f} ms {n:5d}x  {k}")
        for g, before, after in tab["gaps"][:4]:
            print(f"   gap {g:.3f} ms after {before} before {after}")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
