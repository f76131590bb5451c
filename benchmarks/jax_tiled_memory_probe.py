"""Where the JAX tiled MLP's XLA temp buffers go: compile the benchmark's fwd+bwd
(``tiled_mlp.py``'s jax-tiled at the TARGETS shape) with XLA's buffer-assignment dump and print
the compiled memory analysis and the largest temp allocations with the values they hold.

    PYTHONPATH=. python3 benchmarks/jax_tiled_memory_probe.py --dump /tmp/xla-dump [--shards 8]
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--t", type=int, default=32768)
    ap.add_argument("--accum", choices=("param", "fp32"), default="param")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={a.dump} --xla_dump_hlo_as_text")
    import jax
    import jax.numpy as jnp
    import logitless.jax as lj
    h, i = 4096, 14336
    mlp = lj.SwiGLUMLP(h, i)
    params = jax.eval_shape(lambda k: mlp.init(k, jnp.bfloat16), jax.random.PRNGKey(0))
    x = jax.ShapeDtypeStruct((a.t, h), jnp.bfloat16)
    acc = jnp.float32 if a.accum == "fp32" else None

    def fwd_bwd(p, x, dy):
        y, vjp = jax.vjp(lambda p, x: lj.tiled_mlp(mlp, p, x, num_shards=a.shards,
                                                   grad_accum_dtype=acc), p, x)
        return (y,) + vjp(dy)
    c = jax.jit(fwd_bwd).lower(params, x, x).compile()
    ma = c.memory_analysis()
    print(f"{jax.devices()[0].device_kind}: shards={a.shards} accum={a.accum} "
          f"temp {ma.temp_size_in_bytes / 1e6:.1f} MB, outputs {ma.output_size_in_bytes / 1e6:.1f} MB, "
          f"arguments {ma.argument_size_in_bytes / 1e6:.1f} MB, aliased {ma.alias_size_in_bytes / 1e6:.1f} MB")
    files = sorted(glob.glob(os.path.join(a.dump, "*fwd_bwd*buffer-assignment.txt")),
                   key=os.path.getmtime)
    if not files:
        print("no buffer-assignment dump found:", os.listdir(a.dump)[:20])
        return
    text = open(files[-1]).read()
    allocs = []
    for block in re.split(r"\n(?=allocation \d+:)", text):
        m = re.match(r"allocation (\d+): size (\d+)(.*)", block)
        if not m:
            continue
        values = []  # (size, offset, name, shape) of each value placed in the allocation
        for v in re.finditer(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", block):
            values.append((int(v.group(2)), int(v.group(3)), v.group(1), v.group(4)))
        allocs.append((int(m.group(2)), m.group(1), m.group(3).strip()[:100], values))
    allocs.sort(reverse=True)
    for size, idx, attrs, values in allocs[: a.top]:
        print(f"allocation {idx}: {size / 1e6:.1f} MB {attrs} ({len(values)} values)")
        for vs, off, name, shape in sorted(values, reverse=True)[:8]:
            print(f"     {vs / 1e6:8.1f} MB at {off / 1e6:8.1f}  {name}  {shape}")


if __name__ == "__main__":
    sys.exit(main())
