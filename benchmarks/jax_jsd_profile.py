"""Where the JAX linear JSD's time goes on a GPU: the XLA four-GEMM floor, a sweep of
``backend="pallas"`` (or ``"xla"``) settings (time, XLA temp memory), and a kernel table of
one jitted fwd+bwd read from a ``jax.profiler`` trace.

    PYTHONPATH=. python3 benchmarks/jax_jsd_profile.py [--shape 8192x4096x128256]
        [--sweep '[["pallas", {"block_v": 4096}], ["jax-naive", {}], ...]'] [--out FILE.jsonl]
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks import linear_jsd as bench  # noqa: E402

SWEEP = [  # (backend, tuning keywords)
    ("pallas", {}),
    ("xla", {}),
]


def kernel_table(step, *, rows=25, gaps=12):
    """Run ``step`` once under ``jax.profiler``: the GPU kernels' time summed by name (numeric
    suffixes folded), and the timeline: span from the first kernel's start to the last one's
    end, time with no kernel running, and the longest idle gaps with their neighbours.
    Returns None when no trace was written."""
    import jax
    from jax.profiler import ProfileData
    name = lambda ev: re.sub(r"[._]\d+\b", "", ev.name)[:90]
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(step())
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            return None
        data = ProfileData.from_file(files[0])
        per = collections.defaultdict(lambda: [0.0, 0])
        spans = []
        for plane in data.planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):  # kernel rows; skip the op summaries
                    continue
                for ev in line.events:
                    per[name(ev)][0] += ev.duration_ns / 1e6
                    per[name(ev)][1] += 1
                    spans.append((ev.start_ns, ev.start_ns + ev.duration_ns, name(ev)))
    table = sorted(((k, v[0], v[1]) for k, v in per.items()), key=lambda r: -r[1])
    spans.sort()
    idle, holes, end, prev = 0.0, [], None, None
    for s0, s1, nm in spans:
        if end is not None and s0 > end:
            idle += (s0 - end) / 1e6
            holes.append(((s0 - end) / 1e6, prev, nm))
        if end is None or s1 > end:
            end, prev = s1, nm
    span = (end - spans[0][0]) / 1e6 if spans else 0.0
    holes.sort(key=lambda h: -h[0])
    return dict(kernels_ms=sum(r[1] for r in table), span_ms=span, idle_ms=idle,
                table=table[:rows], gaps=holes[:gaps])


def candidate(name: str):
    """A candidate of benchmarks/linear_jsd.py by its name or its logitless backend."""
    return bench.CANDIDATES.get(name) or bench.CANDIDATES[f"jax-logitless-{name}"]


def pipelined_ms(step, *, calls=10, rounds=3):
    """Per-call time with ``calls`` calls dispatched back to back before one wait (as a
    training loop runs: the host dispatches ahead), the median over ``rounds``."""
    import statistics
    import time

    import jax
    jax.block_until_ready(step())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = step()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / calls)
        del out
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x4096x128256")
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--sweep", default=None,
                    help='JSON list of [backend or candidate name, {tuning keywords}] '
                    '(default: the built-in SWEEP)')
    ap.add_argument("--profile", default="pallas",
                    help="comma list of backends, candidates or 'floor' to time two ways and "
                    "whose kernels to tabulate ('' = none)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="append one JSON line per setting")
    ap.add_argument("--device", default="cuda", help="where the inputs are made (cpu: a dry run)")
    a = ap.parse_args()
    import jax
    shape = bench.parse_shapes(a.shape)[0]
    sweep = json.loads(a.sweep) if a.sweep else SWEEP
    opts = dict(beta=a.beta, temperature=1.0)
    data = bench.make_inputs(shape, a.device, seed=0)
    jx = {k: bench._to_jax(t) for k, t in zip(("xs", "ws", "xt", "wt", "y"), data)}
    jx["g"] = bench._to_jax(bench.random_g(shape, a.device, 0))  # the floor's logit gradient
    del data
    common.free_memory(a.device)
    floor_step = bench.xla_floor_step(jx)
    floor = common.time_jax(floor_step, reps=a.reps, warmup=2).median_ms
    floor_p = pipelined_ms(floor_step)
    print(f"XLA four-GEMM floor: {floor:.2f} ms, pipelined {floor_p:.2f} ms", flush=True)
    out = open(a.out, "a") if a.out else None
    for backend, kw in sweep:
        cand = candidate(backend)
        # timed interleaved with the floor: the ratio is that of calls made side by side
        rec = bench.bench_jax(f"{backend}{kw}", cand, kw, jx, None, opts, device=a.device,
                              reps=a.reps, warmup=2, floors={"xla_floor": floor_step},
                              warmup_s=0.0)
        if rec.get("status") != "ok":
            print(f"{backend} {kw}: {rec.get('error')}", flush=True)
            continue
        line = dict(backend=backend, kwargs=kw, ms=rec["ms"], x_floor=rec["ratio_to_xla_floor"],
                    x_floor_ci95=rec["ratio_to_xla_floor_ci95"], floor_ms=rec["xla_floor_ms"],
                    temp_gb=rec.get("temp_bytes", 0) / 1e9, compile_s=rec.get("compile_s"))
        print(f"{backend} {kw}: {rec['ms']:.2f} ms ({line['x_floor']:.3f}x its interleaved "
              f"floor {line['floor_ms']:.2f} ms), "
              f"temp {line['temp_gb']:.2f} GB, compiled in {line['compile_s']:.1f} s", flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
    args = (jx["xs"], jx["ws"], jx["xt"], jx["wt"], jx["y"])
    for backend in filter(None, a.profile.split(",")):
        if backend == "floor":
            step = floor_step
        else:
            cand = candidate(backend)
            f = jax.jit(jax.value_and_grad(cand.make(opts), argnums=(0, 1)))
            step = lambda f=f: f(*args)
        sync = common.time_jax(step, reps=a.reps, warmup=2).median_ms
        pipe = pipelined_ms(step)
        prof = kernel_table(step)
        if prof is None:
            print("no profile written")
            return
        print(f"\n{backend}: {sync:.2f} ms a call waited on, {pipe:.2f} ms pipelined; "
              f"{prof['kernels_ms']:.2f} ms of GPU kernels, timeline {prof['span_ms']:.2f} ms, "
              f"of which {prof['idle_ms']:.2f} ms idle")
        for nm, ms, n in prof["table"]:
            print(f"{ms:9.2f} ms {n:5d}x  {nm}")
        print("longest idle gaps (after -> before):")
        for ms, before, after in prof["gaps"][:5]:
            print(f"{ms:9.3f} ms  {before} -> {after}")


if __name__ == "__main__":
    main()
