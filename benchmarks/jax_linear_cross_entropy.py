"""Fused linear cross-entropy in JAX: logitless (pallas, xla) vs naive jnp and the JAX peers.

For each shape (N tokens, H hidden, V vocab), in one process and one run, every candidate is
``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))`` (mean loss, dX and dW), compiled ahead
of time, and measured for

* time: median wall time of ``reps`` calls, each up to ``jax.block_until_ready`` of its
  outputs, after ``warmup`` untimed calls;
* memory: the compiled program's temporary buffers, ``compiled.memory_analysis()
  .temp_size_in_bytes`` (what XLA allocates beyond the arguments and the outputs). It is also
  written as ``peak_extra_bytes`` so that ``benchmarks/plot.py`` can draw it;
* errors: ``‖g − ref‖ / ‖ref‖`` of dX and dW and the loss's relative error, against an
  fp32-logits reference (x and W upcast, fp32 GEMMs at ``Precision.HIGHEST``, plain
  ``jax.value_and_grad`` over token chunks, independent of logitless), and what rounding that
  reference's gradients to bf16 alone costs.

The floor is the op's three GEMMs through XLA (``x @ W.T``, ``G @ W``, ``G.T @ x`` with a random
bf16 ``G [N, V]``, one jitted program); with a CUDA torch installed the same three GEMMs on the
same arrays (bridged zero-copy over DLPack) through cuBLAS (``torch.mm``) too
(``cublas_floor``). Each candidate is timed interleaved with the floors (candidate, XLA floor,
cuBLAS floor, ...: the GPU's clocks drift within a run), every call the same way, and its
ratios are to the floor calls timed with it.

Candidates: ``naive`` (bf16 logits, upcast, log-softmax cross-entropy: what a user writes),
``logitless-pallas``, ``logitless-pallas-fp32logits`` (the logits GEMM writes float32: no bf16
rounding of the logits, for more memory traffic), ``logitless-xla``, and when importable ``tokamax-chunked-xla`` (tokamax's
``linear_softmax_cross_entropy_loss(implementation="chunked_xla")``, weight as (H, V)) and
``jax-cce``. The peers have no ignore_index: they get the same labels with the ignored ones
replaced by random classes, and their errors are measured against a reference for those labels.
``name[key=value,...]`` passes keywords (logitless tuning keywords, e.g.
``logitless-pallas[chunk_size=2048,block_v=8192]``; jax-cce's ``chunk_size``).

    PYTHONPATH=. python benchmarks/jax_linear_cross_entropy.py               # GPU: TARGETS shapes
    PYTHONPATH=. python benchmarks/jax_linear_cross_entropy.py --shapes 256x128x4099   # any NxHxV
    PYTHONPATH=. .venv/bin/python benchmarks/jax_linear_cross_entropy.py     # CPU: tiny shapes

Result: ``benchmarks/results/<gpu>-jax-linear-cross-entropy.json`` (``cpu-...`` on CPU), and a
PNG beside it when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

# torch (for the optional cuBLAS floor) and JAX share the GPU: JAX must not take 75% at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.linear_cross_entropy import (  # noqa: E402  (shapes shared with it)
    GROUPS, SHAPES, Shape, parse_shapes)

OP = "jax_linear_cross_entropy"
IGNORE_INDEX = -100
IGNORE_FRACTION = 0.10
LOGIT_STD = 2.0  # std of the random logits, as in the PyTorch benchmark
CPU_SHAPES = "256x128x4099,100x96x2053"  # tiny, V prime: the whole CPU run takes seconds
DEFAULTS = {"gpu": dict(shapes="targets", reps=10, warmup=3),
            "cpu": dict(shapes=CPU_SHAPES, reps=3, warmup=1)}


# ----------------------------------------------------------------------------- candidates
@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    about: str
    make: Callable[..., Callable]  # make(**kw) -> loss(x, w, y); ImportError = not installed
    layout: str = "vh"             # the weight it takes: (V, H) or (H, V)
    ignores: bool = True           # understands ignore_index (else gets filled labels)


def _naive(**kw):
    common.no_kwargs("naive", kw)
    import jax
    import jax.numpy as jnp

    def loss(x, w, y):
        logits = (x @ w.T).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        mask = y != IGNORE_INDEX
        ys = jnp.where(mask, y, 0)
        nll = lse - jnp.take_along_axis(logits, ys[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    return loss


def _logitless(backend, **fixed):
    def make(**kw):
        import logitless.jax as lj
        tuning = {**fixed, **kw}

        def loss(x, w, y):
            return lj.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, backend=backend,
                                           **tuning)
        return loss
    return make


def _tokamax(**kw):
    common.no_kwargs("tokamax-chunked-xla", kw)
    import tokamax

    def loss(x, w_hv, y):
        return tokamax.linear_softmax_cross_entropy_loss(
            x, y, w_hv, reduction="mean", implementation="chunked_xla")
    return loss


def _jax_cce(**kw):
    import jax_cce

    def loss(x, w, y):
        return jax_cce.linear_cross_entropy(x, w, y, **kw)
    return loss


CANDIDATES = {c.name: c for c in (
    Candidate("logitless-pallas", "logitless.jax backend='pallas' (interpreted on CPU)",
              _logitless("pallas")),
    Candidate("logitless-pallas-fp32logits", "logitless.jax backend='pallas', fp32_logits=True "
              "(float32 logits buffer, bf16 gradient buffer)",
              _logitless("pallas", fp32_logits=True)),
    Candidate("logitless-xla", "logitless.jax backend='xla' (chunked plain JAX)",
              _logitless("xla")),
    Candidate("naive", "x @ W.T in bf16, astype(float32), logsumexp cross-entropy", _naive),
    Candidate("tokamax-chunked-xla", "tokamax linear_softmax_cross_entropy_loss, "
              "implementation='chunked_xla', W as (H, V)", _tokamax, layout="hv", ignores=False),
    Candidate("jax-cce", "jax_cce.linear_cross_entropy (defaults)", _jax_cce, ignores=False),
)}


def parse_candidates(spec: Optional[str]):
    """``name`` or ``name[key=value,...]``; default: every candidate."""
    if not spec:
        return [(c.name, c, {}) for c in CANDIDATES.values()]
    return common.parse_candidates(spec, CANDIDATES)


# ----------------------------------------------------------------------------- data, reference
def make_inputs(shape: Shape, seed: int):
    """bf16 x (N, H), W (V, H) with logits of std LOGIT_STD, int32 labels with 10% ignored,
    and the same labels with the ignored ones replaced by random classes (for the peers)."""
    import jax
    import jax.numpy as jnp
    kx, kw, ky, ki, kf = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(kx, (shape.n, shape.h), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (shape.v, shape.h), jnp.float32)
         * (LOGIT_STD / math.sqrt(shape.h))).astype(jnp.bfloat16)
    y = jax.random.randint(ky, (shape.n,), 0, shape.v, jnp.int32)
    y = jnp.where(jax.random.uniform(ki, (shape.n,)) < IGNORE_FRACTION, IGNORE_INDEX, y)
    filled = jnp.where(y == IGNORE_INDEX,
                       jax.random.randint(kf, (shape.n,), 0, shape.v, jnp.int32), y)
    return x, w, y, filled


def reference(x, w, y, *, chunk_bytes: int = 1 << 30):
    """fp32-logits reference: (mean loss, dX, dW) in float32, by jax.value_and_grad of a plain
    cross-entropy over token chunks (fp32 GEMMs at Precision.HIGHEST: no TF32, no bf16)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def part(xc, w32, yc):
        def total(xc, w32):
            logits = jnp.dot(xc, w32.T, precision=jax.lax.Precision.HIGHEST)
            mask = yc != IGNORE_INDEX
            ys = jnp.where(mask, yc, 0)
            nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
                logits, ys[:, None], axis=-1)[:, 0]
            return jnp.sum(jnp.where(mask, nll, 0.0))
        return jax.value_and_grad(total, argnums=(0, 1))(xc.astype(jnp.float32), w32)

    n, v = x.shape[0], w.shape[0]
    chunk = max(1, chunk_bytes // (4 * v))
    w32 = w.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(y != IGNORE_INDEX), 1).astype(jnp.float32)
    loss, dxs, dw = 0.0, [], None
    for s in range(0, n, chunk):
        ls, (gx, gw) = part(x[s:s + chunk], w32, y[s:s + chunk])
        loss = loss + ls
        dxs.append(gx)
        dw = gw if dw is None else dw + gw
    del w32
    return float(loss / count), jnp.concatenate(dxs) / count, dw / count


def _rel_err_fn():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def err(a, r):
        d = a.astype(jnp.float32) - r
        return jnp.sqrt(jnp.sum(d * d)) / jnp.sqrt(jnp.sum(r * r))
    return err


def _float_or_nan(v) -> float:
    v = float(v)
    return v if math.isfinite(v) else float("nan")


# ----------------------------------------------------------------------------- floors
FLOOR_GEMMS = ["x @ W.T", "G @ W", "G.T @ x"]


def floor_steps(shape: Shape, x, w, *, seed: int, cublas: bool):
    """``{"floor": XLA step, "cublas_floor": torch.mm step or None}``: the three GEMMs with a
    random bf16 ``G [N, V]``, both on the same arrays (cuBLAS through the DLPack bridge)."""
    import jax
    import jax.numpy as jnp
    v_pad = common.floor_vocab(shape.v)  # V rounded up to 16: cuBLAS's fast kernels need it
    g = jax.random.normal(jax.random.key(seed + 1), (shape.n, v_pad), jnp.float32) \
        .astype(jnp.bfloat16)
    if v_pad != shape.v:
        w = jnp.pad(w, ((0, v_pad - shape.v), (0, 0)))
    gemms = jax.jit(lambda x, w, g: (x @ w.T, g @ w, g.T @ x)).lower(x, w, g).compile()
    steps = {"floor": lambda: gemms(x, w, g), "cublas_floor": None}
    if cublas:
        from logitless.bridge import to_torch
        xt, wt, gt = to_torch(x), to_torch(w), to_torch(g)
        steps["cublas_floor"] = common.gemm_step([(xt, wt.t()), (gt, wt), (gt.t(), xt)])[0]
    return steps


def cublas_available() -> Optional[str]:
    """Why the cuBLAS floor cannot be timed here (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch has no CUDA device"


# ----------------------------------------------------------------------------- one shape
def bench_candidate(label, cand: Candidate, kwargs, data, refs, *, reps, warmup, floors,
                    warmup_s: float = 0.0):
    """One candidate's record, timed interleaved with ``floors`` (see ``floor_steps``)."""
    import jax
    rec: Dict[str, Any] = {"name": label, "about": cand.about, "kwargs": kwargs}
    x, w, y, filled, w_hv = data
    labels = y if cand.ignores else filled
    weight = w if cand.layout == "vh" else w_hv
    compiled = out = None
    try:
        try:
            loss_fn = cand.make(**kwargs)
        except ImportError as e:
            return {**rec, "status": "unavailable", "error": common.describe_failure(e)["error"]}
        t0 = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))) \
            .lower(x, weight, labels).compile()
        rec["compile_s"] = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:
            rec.update(temp_bytes=int(mem.temp_size_in_bytes),
                       peak_extra_bytes=int(mem.temp_size_in_bytes),
                       argument_bytes=int(mem.argument_size_in_bytes),
                       output_bytes=int(mem.output_size_in_bytes))
        step = lambda: compiled(x, weight, labels)
        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):
            jax.block_until_ready(step())
        rec["warmup_s"] = time.perf_counter() - t0
        loss, (dx, dw) = out = step()
        ref = refs["ignore" if cand.ignores else "filled"]
        if ref is not None:
            err = _rel_err_fn()
            ref_loss, ref_dx, ref_dw = ref
            rec.update(loss=float(loss), loss_rel_err=abs(float(loss) - ref_loss) / abs(ref_loss),
                       dx_rel_err=_float_or_nan(err(dx, ref_dx)),
                       dw_rel_err=_float_or_nan(err(dw if cand.layout == "vh" else dw.T, ref_dw)))
        else:
            rec["loss"] = float(loss)
        out = loss = dx = dw = None
        device = "cuda" if floors.get("cublas_floor") else "cpu"  # torch.mm: sync it too
        rec.update(common.time_against(step, floors, device=device, reps=reps,
                                       warmup_s=warmup_s, wall=True), status="ok")
    except Exception as e:  # noqa: BLE001 - one candidate's failure must not stop the run
        rec.update(common.describe_failure(e))
    finally:
        compiled = out = None
        gc.collect()
    return rec


def bench_shape(shape: Shape, candidates, *, reps: int, warmup: int, seed: int,
                cublas: bool, warmup_s: float = 0.0) -> Dict[str, Any]:
    import jax.numpy as jnp
    x, w, y, filled = make_inputs(shape, seed)
    need_hv = any(c.layout == "hv" for _, c, _ in candidates)
    w_hv = jnp.asarray(w.T) if need_hv else None  # made once, outside every timed call
    res: Dict[str, Any] = {"shape": dataclasses.asdict(shape), "seed": seed,
                           "ignored_tokens": int(jnp.sum(y == IGNORE_INDEX))}
    refs: Dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        refs["ignore"] = reference(x, w, y)
        if any(not c.ignores for _, c, _ in candidates):
            refs["filled"] = reference(x, w, filled)
        err = _rel_err_fn()
        res["reference"] = {"loss": refs["ignore"][0], "seconds": time.perf_counter() - t0,
                            "how": "x, W upcast to fp32; fp32 GEMMs at Precision.HIGHEST; "
                                   "jax.value_and_grad over token chunks",
                            **common.rounding_floor(
                                *refs["ignore"][1:], to_input_dtype=lambda a: a.astype(jnp.bfloat16),
                                err=lambda a, r: _float_or_nan(err(a, r)))}
    except Exception as e:  # noqa: BLE001 - e.g. OOM: time and memory still count
        res["reference"] = common.describe_failure(e)
        common.log(f"[{shape.name}] reference failed, no errors reported: {res['reference']}")
    refs.setdefault("ignore", None)
    refs.setdefault("filled", None)
    floors: Dict[str, Any] = {"floor": None, "cublas_floor": None}
    why_no_cublas = cublas_available() if cublas else "not asked for (--no-cublas or no GPU)"
    try:
        floors = floor_steps(shape, x, w, seed=seed, cublas=why_no_cublas is None)
    except Exception as e:  # noqa: BLE001
        res["floor"] = common.describe_failure(e)
    if why_no_cublas is not None and cublas:
        res["cublas_floor"] = {"status": "unavailable", "error": why_no_cublas}
    res["candidates"] = []
    for label, cand, kw in candidates:
        common.log(f"[{shape.name}] {label} ...")
        rec = bench_candidate(label, cand, kw, (x, w, y, filled, w_hv), refs, reps=reps,
                              warmup=warmup, floors=floors, warmup_s=warmup_s)
        line = common.brief(rec, memory_label="temp", memory_key="temp_bytes")
        common.log(f"[{shape.name}] {label}: {line}")
        res["candidates"].append(rec)
    for name, through in (("floor", "XLA"), ("cublas_floor", "torch.mm (cuBLAS)")):
        if floors[name] is None:
            continue
        try:
            res[name] = common.pooled_floor(
                res["candidates"], name, flops=shape.gemm_flops, gemms=FLOOR_GEMMS,
                through=through, alone=lambda f=floors[name]: common.time_interleaved(
                    [f], device="cuda" if name == "cublas_floor" else "cpu", reps=reps,
                    warmup_s=warmup_s, wall=True)[0])
        except Exception as e:  # noqa: BLE001
            res[name] = common.describe_failure(e)
    del x, w, y, filled, w_hv, refs, floors
    gc.collect()
    return res


# ----------------------------------------------------------------------------- run, report
def environment() -> Dict[str, Any]:
    import jax
    env = common.environment(None, extra_packages=("tokamax", "jax-cce"))
    dev = jax.devices()[0]
    env["jax_backend"] = jax.default_backend()
    if dev.platform == "gpu":
        env.update(device="gpu", gpu_name=dev.device_kind,
                   gpu_sm_count=getattr(dev, "core_count", None))
        env.pop("cpu_model", None)
    return env


def default_out(env) -> Path:
    where = common.slug(env["gpu_name"]) if env.get("device") == "gpu" else "cpu"
    return common.RESULTS_DIR / f"{where}-jax-linear-cross-entropy.json"


def run_benchmark(shapes, candidates, *, reps: int, warmup: int, seed: Optional[int] = None,
                  out: Optional[Path] = None, plot: bool = True,
                  cublas: bool = True, warmup_s: Optional[float] = None) -> Dict[str, Any]:
    """Benchmark every shape; write JSON after each shape (a cut-short run keeps what it
    finished) and a PNG when matplotlib is installed. Returns the result dict."""
    env = environment()
    if warmup_s is None:
        warmup_s = common.GPU_WARMUP_S if common.is_gpu_run(env) else 0.0
    seed = secrets.randbits(31) if seed is None else seed
    out = Path(out) if out else default_out(env)
    result = {
        "op": OP, "schema": 1, "env": env,
        "config": {"dtype": "bfloat16", "ignore_index": IGNORE_INDEX,
                   "ignore_fraction": IGNORE_FRACTION, "logit_std": LOGIT_STD, "reps": reps,
                   "warmup": warmup, "warmup_s": warmup_s, "seed": seed,
                   "timer": "perf_counter to block_until_ready (+ torch.cuda.synchronize with "
                            "the cuBLAS floor), every call of candidates and floors alike",
                   "floor_timing": "each candidate timed interleaved with the XLA floor and the "
                                   "cuBLAS floor; ratio_to_floor = ms / floor_ms (XLA), "
                                   "ratio_to_cublas_floor = ms / cublas_floor_ms",
                   "memory": "compiled.memory_analysis().temp_size_in_bytes (also written as "
                             "peak_extra_bytes)",
                   "candidates": {label: c.about for label, c, _ in candidates}},
        "results": [],
    }
    for i, shape in enumerate(shapes):
        result["results"].append(bench_shape(shape, candidates, reps=reps, warmup=warmup,
                                              seed=seed + 7919 * i, cublas=cublas,
                                              warmup_s=warmup_s))
        common.write_json(out, result)
    result["json"] = str(out)
    if plot:
        from benchmarks import plot as plotting
        png = plotting.plot_benchmark(
            result, out.with_suffix(".png"),
            title=f"JAX linear cross-entropy fwd+bwd - {env.get('gpu_name') or 'cpu'} - "
                  f"memory: XLA temp buffers")
        result["png"] = str(png) if png else None
    return result


def format_report(result: Dict[str, Any]) -> str:
    env, cfg = result["env"], result["config"]
    lines = [f"JAX linear cross-entropy fwd+bwd (jit(value_and_grad)), bf16, 10% ignored -- "
             f"{env.get('gpu_name') or env.get('cpu_model', 'cpu')}; jax "
             f"{env['packages'].get('jax')}; median of {cfg['reps']} (wall clock to the result), "
             f"each candidate interleaved with the floors; seed {cfg['seed']}"]
    if not common.is_gpu_run(env):
        lines.append(common.CPU_SMOKE_NOTE)
    for res in result["results"]:
        s, fl, cb = res["shape"], res.get("floor", {}), res.get("cublas_floor", {})
        floor = (f"XLA floor {common.fmt_ms(fl['ms'])} ms = {fl['tflops']:.3g} TFLOP/s"
                 if fl.get("ms") else f"floor {fl.get('status')}: {fl.get('error', '')}")
        if cb.get("ms"):
            floor += f"; cuBLAS floor {common.fmt_ms(cb['ms'])} ms"
        lines += ["", f"{s['name']}  N={s['n']} H={s['h']} V={s['v']}  {floor} "
                      f"({common.floor_basis(fl)})"]
        lines.append(common.candidate_table(
            ["candidate", "ms", "XLA floor ms", "cuBLAS ms", "x XLA floor", "x cuBLAS", "temp",
             "dX err", "dW err", "loss err", "note"], res["candidates"],
            lambda c: common.loss_cells(
                c, [c.get("ratio_to_floor"), c.get("ratio_to_cublas_floor")], c.get("temp_bytes"),
                floors=[c.get("floor_ms"), c.get("cublas_floor_ms")])))
        lines += common.rounding_floor_line(res.get("reference", {}))
    lines += common.wrote_lines(result)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help=f"comma list of groups {sorted(GROUPS)}, names {sorted(SHAPES)} or NxHxV "
                        f"(default: 'targets' on a GPU, {CPU_SHAPES} on CPU)")
    p.add_argument("--candidates", default=None,
                   help="comma list of " + ", ".join(CANDIDATES) + "; name[key=value,...] passes "
                        "keywords (default: all)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds of interleaved candidate/floor warm-up before timing "
                        f"(default {common.GPU_WARMUP_S} GPU; CPU: one call each)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-cublas", action="store_true",
                   help="skip the torch.mm floor even when a CUDA torch is installed")
    args = p.parse_args(argv)

    import jax
    kind = "gpu" if jax.default_backend() == "gpu" else "cpu"
    d = DEFAULTS[kind]
    shapes = parse_shapes(args.shapes or d["shapes"])
    result = run_benchmark(
        shapes, parse_candidates(args.candidates),
        reps=args.reps or d["reps"], warmup=d["warmup"] if args.warmup is None else args.warmup,
        seed=args.seed, out=args.out, plot=not args.no_plot,
        cublas=not args.no_cublas and kind == "gpu", warmup_s=args.warmup_s)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
