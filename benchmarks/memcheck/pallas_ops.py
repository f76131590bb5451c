"""The Pallas linear CE and JSD kernels on the GPU with ragged row blocks (N not a multiple of
block_rows) and vocabulary ends, for compute-sanitizer memcheck (benchmarks/memcheck/README.md);
the CE also with rows split over programs (one launch with waits, and two launches)."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import logitless.jax as lj
rng = np.random.default_rng(0)
n, h, v = 37, 33, 97
f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
xs, ws, xt, wt = f(n, h), f(v, h) / 6, f(n, 20), f(v, 20) / 5
y = jnp.asarray(rng.integers(0, v, n)).at[3].set(-100)
for br in (1, 4):
    tun = dict(block_rows=br, block_v=32, segment_size=64)
    g = jax.grad(lambda a, b: lj.linear_jsd(a, b, xt, wt, y, beta=0.5, hard_loss_weight=0.3,
                                            backend="pallas", **tun), argnums=(0, 1))(xs, ws)
    jax.block_until_ready(g)
    print("jsd block_rows", br, float(jnp.abs(g[0]).sum()))
for br in (1, 4):
    g = jax.grad(lambda a, b: lj.linear_cross_entropy(a, b, y, backend="pallas", block_rows=br,
                                                      block_v=32), argnums=(0, 1))(xs, ws)
    jax.block_until_ready(g)
    print("ce block_rows", br, float(jnp.abs(g[0]).sum()))
# argv[1]: "two" for the split CE in two launches only, "one" for the one-launch form only
which = sys.argv[1] if len(sys.argv) > 1 else "both"
for br, sync in [(b, sy) for b, sy in ((1, True), (4, True), (4, False))
                 if which == "both" or sy == (which == "one")]:
    for fp32 in (False, True):
        g = jax.grad(lambda a, b: lj.linear_cross_entropy(
            a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), y, backend="pallas", block_rows=br,
            block_v=16, row_split=4, row_sync=sync, fp32_logits=fp32), argnums=(0, 1))(xs, ws)
        jax.block_until_ready(g)
        print("ce split block_rows", br, "sync", sync, "fp32_logits", fp32,
              float(jnp.abs(g[0].astype(jnp.float32)).sum()))
