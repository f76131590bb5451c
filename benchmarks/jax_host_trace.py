"""Where a jitted JAX call's wall time goes outside its GPU kernels: one call of the linear JSD
(or CE) fwd+bwd under ``jax.profiler``, then every host-side event longer than ``--min-ms``
with its start and end relative to the call's first GPU kernel, and the first / last kernel
times. For a call whose wall time exceeds its kernel timeline (the Pallas JSD: ~62 ms a
call against ~58 ms of kernels on an H100).

    PYTHONPATH=. python3 benchmarks/jax_host_trace.py [--op jsd|ce] [--backend pallas]
"""
from __future__ import annotations

import argparse
import glob
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402


def _jsd_step(backend, shape):
    import jax
    from benchmarks import linear_jsd as bench
    data = bench.make_inputs(bench.parse_shapes(shape)[0], "cuda", seed=0)
    args = [bench._to_jax(t) for t in data]
    cand = bench.CANDIDATES[f"jax-logitless-{backend}"]
    f = jax.jit(jax.value_and_grad(cand.make(dict(beta=0.5, temperature=1.0)), argnums=(0, 1)))
    return lambda: f(*args)


def _ce_step(backend, shape):
    import jax
    import jax.numpy as jnp
    import logitless.jax as lj
    n, h, v = map(int, shape.split("x"))
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = (jax.random.normal(k[0], (n, h)) * 0.5).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (v, h)) * h ** -0.5).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, v)
    f = jax.jit(jax.value_and_grad(
        lambda x, w: lj.linear_cross_entropy(x, w, y, backend=backend), argnums=(0, 1)))
    return lambda: f(x, w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="jsd", choices=("jsd", "ce"))
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--min-ms", type=float, default=0.2)
    a = ap.parse_args()
    import jax
    from jax.profiler import ProfileData
    shape = a.shape or ("8192x4096x128256" if a.op == "jsd" else "16384x4096x128256")
    step = (_jsd_step if a.op == "jsd" else _ce_step)(a.backend, shape)
    for _ in range(3):
        jax.block_until_ready(step())
    t = common.time_jax(step, reps=10, warmup=1)
    print(f"{a.op} {a.backend} {shape}: {t.median_ms:.2f} ms a call waited on")
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            wall = (time.perf_counter() - t0) * 1e3
        data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    kernels, host = [], []
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                rec = (ev.start_ns, ev.start_ns + ev.duration_ns, ev.name, plane.name, line.name)
                if plane.name.startswith("/device:") and line.name.startswith("Stream"):
                    kernels.append(rec)
                elif not plane.name.startswith("/device:"):
                    host.append(rec)
    ref = kernels or host  # no GPU: times relative to the first host event
    k0 = min(k[0] for k in ref)
    k1 = max(k[1] for k in ref)
    print(f"profiled call: {wall:.2f} ms wall; kernels from 0 to {(k1 - k0) / 1e6:.2f} ms")
    print("host events (start, end relative to the first kernel, ms; duration; thread; name):")
    for s, e, name, plane, line in sorted(host):
        if (e - s) / 1e6 >= a.min_ms:
            print(f"  {(s - k0) / 1e6:9.3f} {(e - k0) / 1e6:9.3f} {(e - s) / 1e6:8.3f}  "
                  f"{line[:24]:24s} {name[:100]}")


if __name__ == "__main__":
    main()
