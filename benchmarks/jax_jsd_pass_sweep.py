"""Each Pallas linear-JSD pass on its own: one chunk of float32 student and teacher logits
(``--rows`` x V, the backend's default chunk at V = 128256) through the three launches of
``PallasHead.loss_grad`` for every launch setting of a grid, the GPU time of each kernel read
from a ``jax.profiler`` trace of ``--calls`` calls. The passes do different work per element
(pass 2 the most), so their best settings may differ.

    PYTHONPATH=. python3 benchmarks/jax_jsd_pass_sweep.py [--out FILE.jsonl]
        [--grid '{"block_v": [1024, 2048], "num_warps": [4, 8], ...}']
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GRID = dict(block_rows=[1], block_v=[1024, 2048, 4096], num_warps=[2, 4, 8],
            num_stages=[1, 2, 3], segment_size=[8192])
PASSES = ("logitless_linear_jsd_stats", "logitless_linear_jsd_sums",
          "logitless_linear_jsd_grad")


def kernel_ms(step, calls):
    """GPU ms per call of each of PASSES, from one trace of ``calls`` calls (the kernel table
    of ``jax_jsd_profile``)."""
    from benchmarks.jax_jsd_profile import kernel_table
    prof = kernel_table(lambda: [step() for _ in range(calls)])
    if prof is None:  # no trace written
        return {}
    return {p: sum(ms for name, ms, _ in prof["table"] if p in name) / calls for p in PASSES}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--grid", default=None, help="JSON dict of setting -> list of values")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="off a GPU: a dry run")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from benchmarks import common
    from logitless.pallas_kernels import linear_jsd as pj
    grid = dict(GRID, **json.loads(a.grid)) if a.grid else GRID
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    # logits of two related heads (std ~2, the teacher the student plus noise)
    zs = 2.0 * jax.random.normal(k[0], (a.rows, a.vocab), jnp.float32)
    zt = zs + 0.5 * jax.random.normal(k[1], (a.rows, a.vocab), jnp.float32)
    y = jax.random.randint(k[2], (a.rows,), 0, a.vocab, jnp.int32)
    coef = jnp.full((a.rows,), 1.0 / a.rows, jnp.float32)
    out = open(a.out, "a") if a.out else None
    keys = list(grid)
    for values in itertools.product(*(grid[k_] for k_ in keys)):
        cfg = dict(zip(keys, values))
        head = pj.PallasHead(kind="jsd", beta=a.beta, temperature=1.0, hard_w=0.0,
                             interpret=a.interpret, **cfg)
        f = jax.jit(lambda zs, zt, y, coef, head=head: head.loss_grad(
            zs, zt, y, coef, jnp.bfloat16, v=a.vocab))
        try:
            loss, dz = jax.block_until_ready(f(zs, zt, y, coef))
        except Exception as e:  # noqa: BLE001 - a setting Triton refuses: report, go on
            print(json.dumps(dict(cfg, error=f"{type(e).__name__}: {str(e)[:200]}")), flush=True)
            continue
        ms = kernel_ms(lambda: f(zs, zt, y, coef), a.calls)
        rec = dict(cfg, **{p.rsplit("_", 1)[1]: round(v, 4) for p, v in ms.items()})
        rec["total"] = round(sum(ms.values()), 4)
        rec["loss_sum"] = float(jnp.sum(loss))
        rec["dz_abs_sum"] = float(jnp.sum(jnp.abs(dz.astype(jnp.float32))))
        common.emit_json(rec, out)


if __name__ == "__main__":
    main()
