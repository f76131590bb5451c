"""Tiled MLP benchmark: a Llama SwiGLU MLP, plain vs logitless tiled vs Liger's tiled MLP, and
the JAX side.

For each shape (B, T, H, I and the shard count), in one process and one run:

* PyTorch candidates (bf16 ``x`` and parameters with ``requires_grad``): one call = forward
  plus ``y.backward(dy)`` into ``.grad`` (cleared first, as ``zero_grad(set_to_none=True)``
  does in a training loop). Median time of ``reps`` calls after ``warmup``, each candidate
  but ``plain`` timed interleaved with ``plain`` (candidate, plain, ...: the GPU's clocks
  drift within a run; ``ratio_to_plain`` = ms / ``plain_ms``, those plain calls); the peak memory
  of one call above what was held before it (``peak_bytes_over_base``: includes ``dx`` and
  the parameter gradients; ``peak_extra_bytes``: without them); relative errors of ``y``,
  ``dx`` and each weight gradient against an fp32 reference (inputs upcast, fp32 GEMMs
  without TF32, chunked plain autograd: independent of logitless).
* JAX candidates (``jax.jit`` of the forward and its ``vjp``): median wall time to the
  result of ``reps`` calls, each but ``jax-plain`` timed interleaved with ``jax-plain``
  (``ratio_to_plain`` likewise); the compiled program's temp memory
  (``memory_analysis().temp_size_in_bytes``, also ``peak_extra_bytes``) and temp + outputs
  (``peak_bytes_over_base``: XLA holds both at once, the PyTorch figure's twin); the same
  errors against the same reference.

Candidates: ``plain`` (``down(F.silu(gate(x)) * up(x))``: what a model has), ``plain-fused``
(``lt.SwiGLUMLP`` untiled), ``logitless-tiled`` (the fused tiled path, defaults: gradients
summed over shards in the parameters' dtype), ``logitless-tiled-fp32acc``
(``grad_accum_dtype=torch.float32``), ``logitless-tiled-generic`` (the generic path on the
plain module), ``liger-tiled`` (``LigerTiledSwiGLUMLP`` when importable, CUDA only);
``jax-plain`` (jnp, ``jax.nn.silu``), ``jax-tiled`` and ``jax-tiled-fp32acc``
(``lj.tiled_mlp`` of ``lj.SwiGLUMLP``; Pallas SwiGLU on a GPU, the XLA one elsewhere).

Goals (TARGETS.md / the tiled-MLP issue; ``HELD_TO``): the default tiled path is held to the
time, peak and faster-than-Liger numbers, ``jax-tiled`` to the time and peak ones; the fp32
options of both frameworks to "dW error no worse than plain bf16's".
Results recorded before 2026-11-22 (third session) used the old default: there
``logitless-tiled`` is the fp32 mode and ``logitless-tiled-bf16acc`` today's default.

    PYTHONPATH=. python benchmarks/tiled_mlp.py                  # GPU: the TARGETS.md shape
    PYTHONPATH=. .venv/bin/python benchmarks/tiled_mlp.py        # CPU: tiny shapes
    ... --shapes 1x8192x4096x14336x4 --candidates plain,logitless-tiled --no-jax

Result: ``benchmarks/results/<gpu>-tiled-mlp.json`` (``cpu-tiled-mlp.json`` on CPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import secrets
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

# torch and JAX share the GPU in this process: JAX must not take 75% of it at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

OP = "tiled_mlp"
WEIGHT_NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# TARGETS.md, both frameworks: <= 1.36x the plain MLP's time, peak <= 1.2 GB. The PyTorch peak
# is over the inputs (returned y, dX, dW included); JAX's comparable figure is the compiled
# program's temporaries plus its outputs (XLA holds both at once).
GOALS = dict(max_time_ratio=1.36, max_peak_bytes=1.2e9)


# ----------------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    b: int
    t: int
    h: int
    i: int
    shards: int

    @property
    def gemm_flops(self) -> int:  # the untiled fwd+bwd: 3 + 6 GEMMs of 2·N·H·I
        return 9 * 2 * self.b * self.t * self.h * self.i

    def as_dict(self):
        return dataclasses.asdict(self)


SHAPES = {s.name: s for s in (
    Shape("llama3-8b-32k", 1, 32768, 4096, 14336, 8),   # TARGETS.md
    Shape("llama3-8b-8k", 1, 8192, 4096, 14336, 2),
    Shape("tiny", 1, 1024, 64, 176, 4),                 # CPU
    Shape("tiny-batch", 2, 300, 48, 130, 3),            # CPU: B > 1, uneven last shard
)}
GROUPS = {"gpu": ["llama3-8b-32k"], "tiny": ["tiny", "tiny-batch"]}


def parse_shapes(spec: str) -> List[Shape]:
    """Comma-separated group names, shape names or ``BxTxHxIxS`` tuples."""
    return common.parse_shapes(
        spec, SHAPES, GROUPS, form="BxTxHxIxS",
        from_parts=lambda tok, p: Shape(tok, *p) if len(p) == 5 else None)


# ----------------------------------------------------------------------------- torch candidates
def _plain_module_class():
    import torch.nn.functional as F
    from torch import nn

    class PlainMLP(nn.Module):
        def __init__(self, h, i, dtype=None, device=None):
            super().__init__()
            kw = dict(bias=False, dtype=dtype, device=device)
            self.gate_proj = nn.Linear(h, i, **kw)
            self.up_proj = nn.Linear(h, i, **kw)
            self.down_proj = nn.Linear(i, h, **kw)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
    return PlainMLP


def _module(kind, shape, weights):
    """A module of ``kind`` holding copies of ``weights`` (bf16, requiring grad)."""
    import torch
    dev, dt = weights[0].device, weights[0].dtype
    if kind == "plain":
        m = _plain_module_class()(shape.h, shape.i, dtype=dt, device=dev)
    elif kind == "logitless":
        import logitless.torch as lt
        m = lt.SwiGLUMLP(shape.h, shape.i, dtype=dt, device=dev)
    elif kind == "liger":
        from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP
        config = types.SimpleNamespace(hidden_size=shape.h, intermediate_size=shape.i,
                                       hidden_act="silu")
        m = LigerTiledSwiGLUMLP(config, num_shards=shape.shards).to(device=dev, dtype=dt)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, w in zip(WEIGHT_NAMES, weights):
            m.get_parameter(name).copy_(w)
    return m


def _tiled(kind, fp32_accum=False):
    def make(shape, weights):
        import torch
        import logitless.torch as lt
        m = _module(kind, shape, weights)
        accum = torch.float32 if fp32_accum else None
        return m, lambda x: lt.tiled_mlp(m, x, num_shards=shape.shards, grad_accum_dtype=accum)
    return make


def _untiled(kind):
    def make(shape, weights):
        m = _module(kind, shape, weights)
        return m, m
    return make


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    about: str
    make: Callable
    cuda_only: bool = False
    triton: bool = False  # on CPU only under TRITON_INTERPRET=1 (else the torch SwiGLU runs)


TORCH_CANDIDATES = {c.name: c for c in (
    Candidate("plain", "down(F.silu(gate(x)) * up(x)), untiled, bf16", _untiled("plain")),
    Candidate("plain-fused", "lt.SwiGLUMLP untiled (the fused SwiGLU kernel)",
              _untiled("logitless")),
    Candidate("logitless-tiled", "lt.tiled_mlp(lt.SwiGLUMLP): fused path, defaults (bf16 sums)",
              _tiled("logitless")),
    Candidate("logitless-tiled-fp32acc", "the fused path, grad_accum_dtype=torch.float32",
              _tiled("logitless", fp32_accum=True)),
    Candidate("logitless-tiled-generic", "lt.tiled_mlp(plain module): generic path, defaults",
              _tiled("plain")),
    Candidate("liger-tiled", "Liger-Kernel LigerTiledSwiGLUMLP(num_shards)", _untiled("liger"),
              cuda_only=True),
)}


# ----------------------------------------------------------------------------- data, reference
def make_inputs(shape: Shape, device: str, seed: int):
    """bf16 x [B, T, H] (requires grad), dy, and the three weights (nn.Linear init scale, the
    gate's doubled so that both tails of the sigmoid are exercised). Drawn on the device."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=device) * scale) \
        .to(torch.bfloat16)
    x = r(shape.b, shape.t, shape.h).requires_grad_()
    dy = r(shape.b, shape.t, shape.h, scale=1.0 / math.sqrt(shape.t))
    weights = (r(shape.i, shape.h, scale=2 / math.sqrt(shape.h)),
               r(shape.i, shape.h, scale=1 / math.sqrt(shape.h)),
               r(shape.h, shape.i, scale=1 / math.sqrt(shape.i)))
    return x, dy, weights


def reference(x, dy, weights, *, chunk_tokens: int = 4096):
    """fp32 y, dx and weight gradients: inputs upcast, fp32 GEMMs (no TF32), plain autograd
    over token chunks (weight gradients summed in fp32)."""
    import torch
    import torch.nn.functional as F
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        h = x.shape[-1]
        x2, dy2 = x.detach().reshape(-1, h), dy.reshape(-1, h)
        w = [t.detach().float().requires_grad_() for t in weights]
        y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
        dx = torch.empty_like(y)
        dw = [torch.zeros_like(t) for t in w]
        for s in range(0, x2.shape[0], chunk_tokens):
            xs = x2[s:s + chunk_tokens].float().requires_grad_()
            ys = F.linear(F.silu(F.linear(xs, w[0])) * F.linear(xs, w[1]), w[2])
            grads = torch.autograd.grad(ys, [xs] + w, dy2[s:s + chunk_tokens].float())
            y[s:s + chunk_tokens] = ys.detach()
            dx[s:s + chunk_tokens] = grads[0]
            for acc, g in zip(dw, grads[1:]):
                acc += g
            del ys, grads, xs
        return dict(y=y.view(x.shape), dx=dx.view(x.shape),
                    **{_grad_key(n): g for n, g in zip(WEIGHT_NAMES, dw)})
    finally:
        torch.set_float32_matmul_precision(prev)


def _grad_key(weight_name: str) -> str:
    """'gate_proj.weight' -> 'dgate_proj'."""
    return "d" + weight_name.split(".")[0]


def _errors(out: Dict[str, Any], ref) -> Dict[str, float]:
    errs = {f"{k}_rel_err": common.rel_err(out[k], ref[k]) for k in ref}
    errs["dw_rel_err"] = max(errs[f"{_grad_key(n)}_rel_err"] for n in WEIGHT_NAMES)
    return errs


# ----------------------------------------------------------------------------- torch bench
def torch_step(cand: Candidate, shape, data):
    """``(step, clear)`` of a candidate: ``step()`` = forward and backward from fresh grads,
    returning y, dx and the weight grads; ``clear()`` drops the grads. ImportError: absent."""
    x, dy, weights = data
    m, fn = cand.make(shape, weights)
    params = [m.get_parameter(n) for n in WEIGHT_NAMES]

    def clear():
        x.grad = None
        m.zero_grad(set_to_none=True)

    def step():
        clear()
        y = fn(x)
        y.backward(dy)
        return y.detach(), x.grad, [p.grad for p in params]
    return step, clear


def bench_torch(label, cand: Candidate, shape, data, ref, *, device, reps, warmup,
                floors=None, warmup_s: float = 0.0):
    """A PyTorch candidate; timed interleaved with ``floors`` (``{"plain": step}``) if given."""
    rec: Dict[str, Any] = {"name": label, "about": cand.about, "framework": "torch"}
    cuda = device.startswith("cuda")
    if cand.cuda_only and not cuda:
        return {**rec, "status": "skipped", "error": "needs CUDA"}
    x = data[0]
    step = clear = None
    try:
        try:
            step, clear = torch_step(cand, shape, data)
        except ImportError as e:
            return {**rec, "status": "unavailable", "error": common.describe_failure(e)["error"]}

        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):
            step()
            common.synchronize(device)
        rec["warmup_s"] = time.perf_counter() - t0
        clear()
        (y, dx, grads), mem = common.measure_memory(
            step, device=device, returned_bytes=lambda o: common.nbytes(o[0], o[1], *o[2]))
        rec.update(memory=mem.as_dict(), peak_extra_bytes=mem.peak_extra_bytes,
                   peak_bytes_over_base=mem.peak_bytes - mem.base_bytes)
        if ref is not None:
            out = dict(y=y, dx=dx, **{_grad_key(n): g for n, g in zip(WEIGHT_NAMES, grads)})
            rec.update(_errors(out, ref))
        y = dx = grads = None
        clear()
        rec.update(common.time_against(step, floors or {}, device=device, reps=reps,
                                       warmup_s=warmup_s), status="ok")
    except Exception as e:  # noqa: BLE001 - one candidate's failure must not stop the run
        rec.update(common.describe_failure(e))
    finally:
        if clear is not None:
            clear()
        step = clear = None
        x.grad = None
        common.free_memory(device)
    return rec


# ----------------------------------------------------------------------------- JAX bench
JAX_CANDIDATES = {
    "jax-plain": "jnp: dense, jax.nn.silu(g) * u, dense; untiled",
    "jax-tiled": "lj.tiled_mlp(lj.SwiGLUMLP), defaults (Pallas SwiGLU on a GPU)",
    "jax-tiled-fp32acc": "lj.tiled_mlp(lj.SwiGLUMLP), grad_accum_dtype=jnp.float32",
}


def _jax_fn(name, shape):
    import jax
    import jax.numpy as jnp
    import logitless.jax as lj
    if name == "jax-plain":
        def plain(p, x):
            g = x @ p["gate_proj"]["kernel"]
            u = x @ p["up_proj"]["kernel"]
            return (jax.nn.silu(g) * u) @ p["down_proj"]["kernel"]
        return plain
    mlp = lj.SwiGLUMLP(shape.h, shape.i)
    accum = jnp.float32 if name == "jax-tiled-fp32acc" else None
    return lambda p, x: lj.tiled_mlp(mlp, p, x, num_shards=shape.shards, grad_accum_dtype=accum)


def jax_step(name, shape, data):
    """(compiled fwd+bwd of JAX candidate ``name``, its arguments)."""
    import jax
    import jax.numpy as jnp
    x, dy, weights = data
    j = lambda t: jnp.from_dlpack(t.detach().contiguous())
    params = {n.split(".")[0]: {"kernel": j(w).T} for n, w in zip(WEIGHT_NAMES, weights)}
    fn = _jax_fn(name, shape)

    def fwd_bwd(p, x, dy):
        y, vjp = jax.vjp(fn, p, x)
        return (y,) + vjp(dy)
    args = (params, j(x), j(dy))
    return jax.jit(fwd_bwd).lower(*args).compile(), args


def bench_jax(name, shape, data, ref, *, device, reps, warmup, floors=None, warmup_s=0.0):
    """A JAX candidate, wall-clock timed (to ``jax.block_until_ready``), interleaved with
    ``floors`` (``{"plain": step}``: jax-plain's compiled call) if given. Memory: XLA's temp
    buffers and outputs (``memory_analysis``), whose sum is the peak over the inputs."""
    import jax
    import torch
    rec: Dict[str, Any] = {"name": name, "about": JAX_CANDIDATES[name], "framework": "jax"}
    try:
        t0 = time.perf_counter()
        compiled, args = jax_step(name, shape, data)
        rec["compile_s"] = time.perf_counter() - t0
        ma = compiled.memory_analysis()
        if ma is not None:
            temp, out_b = int(ma.temp_size_in_bytes), int(ma.output_size_in_bytes)
            rec.update(temp_bytes=temp, output_bytes=out_b, peak_extra_bytes=temp,
                       peak_bytes_over_base=temp + out_b)
        y, dp, dx = compiled(*args)
        if ref is not None:
            t = lambda a: torch.from_dlpack(jax.block_until_ready(a))
            out = dict(y=t(y), dx=t(dx), **{"d" + k: t(dp[k]["kernel"]).t() for k in dp})
            rec.update(_errors(out, ref))
        del y, dp, dx
        for _ in range(max(1, warmup)):
            jax.block_until_ready(compiled(*args))
        rec.update(common.time_against(lambda: compiled(*args), floors or {}, device=device,
                                       reps=reps, warmup_s=warmup_s, wall=True), status="ok")
    except Exception as e:  # noqa: BLE001
        rec.update(common.describe_failure(e))
    return rec


# ----------------------------------------------------------------------------- one shape
def bench_shape(shape: Shape, torch_names, jax_names, *, device, reps, warmup, seed,
                warmup_s: float = 0.0):
    import torch
    common.free_memory(device)
    data = make_inputs(shape, device, seed)
    res: Dict[str, Any] = {"shape": shape.as_dict(), "seed": seed}
    t0 = time.perf_counter()
    try:
        ref = reference(*data)
        common.synchronize(device)
        res["reference"] = {"seconds": time.perf_counter() - t0,
                            "how": "inputs upcast to fp32; fp32 GEMMs (no TF32); chunked autograd"}
    except Exception as e:  # noqa: BLE001 - time and memory still count
        ref = None
        res["reference"] = common.describe_failure(e)
        common.free_memory(device)
    res["candidates"] = []
    # the other PyTorch candidates are timed interleaved with plain (the GPU's clocks drift)
    plain = plain_clear = None
    if "plain" in torch_names and len(torch_names) > 1:
        try:
            plain, plain_clear = torch_step(TORCH_CANDIDATES["plain"], shape, data)
        except Exception as e:  # noqa: BLE001 - the others are then timed alone
            common.log(f"[{shape.name}] plain step failed, no interleaving: {e}")
    for name in torch_names:
        common.log(f"[{shape.name}] {name} ...")
        rec = bench_torch(name, TORCH_CANDIDATES[name], shape, data, ref, device=device,
                          reps=reps, warmup=warmup, warmup_s=warmup_s,
                          floors={"plain": plain} if name != "plain" and plain else None)
        if plain_clear is not None:
            plain_clear()  # its grads are not kept into the next memory measurement
        common.log(f"[{shape.name}] {name}: {_brief(rec)}")
        res["candidates"].append(rec)
    # the JAX candidates likewise with jax-plain (wall clock: JAX's own timing)
    jplain = None
    if "jax-plain" in jax_names and len(jax_names) > 1:
        try:
            compiled, args = jax_step("jax-plain", shape, data)
            jplain = lambda: compiled(*args)
        except Exception as e:  # noqa: BLE001 - the others are then timed alone
            common.log(f"[{shape.name}] jax-plain failed, no interleaving: {e}")
    for name in jax_names:
        common.log(f"[{shape.name}] {name} ...")
        rec = bench_jax(name, shape, data, ref, device=device, reps=reps, warmup=warmup,
                        warmup_s=warmup_s,
                        floors={"plain": jplain} if name != "jax-plain" and jplain else None)
        common.log(f"[{shape.name}] {name}: {_brief(rec)}")
        res["candidates"].append(rec)
    res["goals"] = check_goals(res)
    del data, ref, plain, plain_clear, jplain
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


# which of each candidate's checks the issue holds it to (the others are reported for context)
HELD_TO = {"logitless-tiled": ("time_ok", "peak_over_base_ok", "faster_than_liger"),
           "logitless-tiled-fp32acc": ("dw_err_ok",),
           "jax-tiled": ("time_ok", "peak_over_base_ok"),
           "jax-tiled-fp32acc": ("dw_err_ok",)}


def check_goals(res) -> Dict[str, Any]:
    """The issue's acceptance numbers, read off this shape's results (None: not measured).
    ``all_met``: every check of ``HELD_TO`` measured and true."""
    c = {r["name"]: r for r in res["candidates"] if r.get("status") == "ok"}
    plain = c.get("plain")
    out: Dict[str, Any] = {"goals": GOALS}
    for name in ("logitless-tiled", "logitless-tiled-fp32acc"):
        r = c.get(name)
        if r is None or plain is None:
            continue
        g = {"time_ratio": r.get("ratio_to_plain", r["ms"] / plain["ms"]),
             "peak_bytes_over_base": r["peak_bytes_over_base"],
             "peak_extra_bytes": r["peak_extra_bytes"]}
        g["time_ok"] = g["time_ratio"] <= GOALS["max_time_ratio"]
        g["peak_over_base_ok"] = g["peak_bytes_over_base"] <= GOALS["max_peak_bytes"]
        if "liger-tiled" in c:  # each against the plain calls timed with it, where there are
            lg = c["liger-tiled"]
            g["faster_than_liger"] = (r["ratio_to_plain"] < lg["ratio_to_plain"]
                                      if "ratio_to_plain" in r and "ratio_to_plain" in lg
                                      else r["ms"] < lg["ms"])
        if "dw_rel_err" in r and "dw_rel_err" in plain:
            g["dw_err_vs_plain"] = r["dw_rel_err"] / plain["dw_rel_err"]
            g["dw_err_ok"] = r["dw_rel_err"] <= plain["dw_rel_err"]
        out[name] = g
    jax_plain = c.get("jax-plain")
    for name in ("jax-tiled", "jax-tiled-fp32acc"):
        r = c.get(name)
        if r is None:
            continue
        g: Dict[str, Any] = {}
        if jax_plain is not None:
            g["time_ratio"] = r.get("ratio_to_plain", r["ms"] / jax_plain["ms"])
            g["time_ok"] = g["time_ratio"] <= GOALS["max_time_ratio"]
        if r.get("peak_bytes_over_base") is not None:
            g.update(temp_bytes=r["temp_bytes"], peak_bytes_over_base=r["peak_bytes_over_base"],
                     peak_over_base_ok=r["peak_bytes_over_base"] <= GOALS["max_peak_bytes"])
        if jax_plain is not None and "dw_rel_err" in r and "dw_rel_err" in jax_plain:
            g["dw_err_vs_plain"] = r["dw_rel_err"] / jax_plain["dw_rel_err"]
            g["dw_err_ok"] = r["dw_rel_err"] <= jax_plain["dw_rel_err"]
        out[name] = g
    out["all_met"] = all(out.get(name, {}).get(key) is True
                         for name, keys in HELD_TO.items() for key in keys)
    return out


def _brief(rec) -> str:
    if rec.get("status") != "ok":
        return f"{rec.get('status')}: {rec.get('error', '')}"
    mem = rec.get("peak_bytes_over_base", rec.get("temp_bytes"))
    return (f"{common.fmt_ms(rec['ms'])} ms, peak {common.fmt_bytes(mem)}, "
            f"extra {common.fmt_bytes(rec.get('peak_extra_bytes'))}, "
            f"dx {common.fmt_err(rec.get('dx_rel_err'))}, "
            f"dW {common.fmt_err(rec.get('dw_rel_err'))}")


# ----------------------------------------------------------------------------- run, report
def run_benchmark(shapes, torch_names, jax_names, *, device, reps, warmup, seed, out=None,
                  warmup_s: Optional[float] = None):
    if warmup_s is None:
        warmup_s = common.GPU_WARMUP_S if device.startswith("cuda") else 0.0
    env = common.environment(device, extra_packages=("liger-kernel",))
    if jax_names:
        import jax
        env["jax_backend"] = jax.default_backend()
    out = Path(out) if out else common.RESULTS_DIR / f"{common.device_slug(env)}-tiled-mlp.json"
    result = {"op": OP, "schema": 1, "env": env,
              "config": {"dtype": "bfloat16", "reps": reps, "warmup": warmup,
                         "warmup_s": warmup_s, "seed": seed,
                         "plain_timing": "each PyTorch candidate but plain timed interleaved "
                                         "with plain (CUDA events), each JAX one but jax-plain "
                                         "with jax-plain (wall clock); ratio_to_plain = ms / "
                                         "plain_ms",
                         "timer": "cuda-events" if device.startswith("cuda") else "perf_counter",
                         "candidates": {**{n: TORCH_CANDIDATES[n].about for n in torch_names},
                                        **{n: JAX_CANDIDATES[n] for n in jax_names}}},
              "results": []}
    for k, shape in enumerate(shapes):
        result["results"].append(bench_shape(shape, torch_names, jax_names, device=device,
                                             reps=reps, warmup=warmup, seed=seed + 7919 * k,
                                             warmup_s=warmup_s))
        common.write_json(out, result)
    result["json"] = str(out)
    return result


def format_report(result) -> str:
    env = result["env"]
    pk = env["packages"]
    lines = [f"tiled MLP (SwiGLU) fwd+bwd, bf16 -- {env.get('gpu_name') or env.get('cpu_model')}; "
             f"torch {pk.get('torch')}, triton {pk.get('triton')}, jax {pk.get('jax')}; median of "
             f"{result['config']['reps']}; seed {result['config']['seed']}"]
    if not common.is_gpu_run(env):
        lines.append(common.CPU_SMOKE_NOTE)
    for res in result["results"]:
        s = res["shape"]
        lines += ["", f"{s['name']}  B={s['b']} T={s['t']} H={s['h']} I={s['i']} "
                      f"shards={s['shards']}"]
        plains = {fw: next((c for c in res["candidates"] if c["name"] == name and c.get("ms")),
                           None) for fw, name in (("torch", "plain"), ("jax", "jax-plain"))}

        def cells(c):  # each row's ratio to the plain calls timed with it (JAX: jax-plain's)
            plain = plains.get(c["framework"])
            ratio = c.get("ratio_to_plain", c["ms"] / plain["ms"] if plain else None)
            return [common.fmt_ms(c["ms"]), common.fmt_ms(c.get("plain_ms")), common.fmt_ratio(ratio),
                    common.fmt_bytes(c.get("peak_bytes_over_base")),
                    common.fmt_bytes(c.get("peak_extra_bytes")),
                    common.fmt_err(c.get("y_rel_err")), common.fmt_err(c.get("dx_rel_err")),
                    common.fmt_err(c.get("dw_rel_err")),
                    "jax: peak = XLA temp + outputs, extra = temp" if c["framework"] == "jax"
                    else ""]
        lines.append(common.candidate_table(
            ["candidate", "ms", "plain ms", "x plain", "peak/base", "extra", "y err", "dx err", "dW err",
             "note"], res["candidates"], cells, note_width=60))
        # the goals are the GPU's (TARGETS.md): on a CPU, a few timed calls at tiny shapes
        # say nothing about them
        gpu = bool(result.get("env", {}).get("gpu_name"))
        for name, g in (res.get("goals", {}) if gpu else {}).items():
            if isinstance(g, dict) and name != "goals":
                held = HELD_TO.get(name, ())
                lines.append(f"  goals {name} (held to: {', '.join(held) or 'none'}): " +
                             ", ".join(f"{k}={_fmt_goal(k, v)}" for k, v in g.items()))
        if gpu and "all_met" in res.get("goals", {}):
            lines.append(f"  all goals met: {res['goals']['all_met']}")
    lines += ["", f"wrote {result.get('json')}"]
    return "\n".join(lines)


def _fmt_goal(key, value) -> str:
    if "bytes" in key:
        return common.fmt_bytes(value)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help=f"groups {sorted(GROUPS)}, names "
                   f"{sorted(SHAPES)} or BxTxHxIxS (default: 'gpu' on CUDA, 'tiny' on CPU)")
    p.add_argument("--candidates", default=None,
                   help="comma list of " + ", ".join(list(TORCH_CANDIDATES) + list(JAX_CANDIDATES))
                   + " (default: all)")
    p.add_argument("--no-jax", action="store_true", help="skip the JAX candidates")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 10 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default 2 GPU, 1 CPU)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds of interleaved candidate/plain warm-up before timing "
                        f"(default {common.GPU_WARMUP_S} GPU; CPU: one call each)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    if a.list:
        for s in SHAPES.values():
            print(f"shape {s.name}: {s}")
        for n, c in TORCH_CANDIDATES.items():
            print(f"candidate {n}: {c.about}")
        for n, about in JAX_CANDIDATES.items():
            print(f"candidate {n}: {about}")
        return 0
    device = a.device or common.default_device()
    cuda = device.startswith("cuda")
    if not cuda:
        common.release_large_blocks_to_os()
    names = (a.candidates.split(",") if a.candidates
             else list(TORCH_CANDIDATES) + ([] if a.no_jax else list(JAX_CANDIDATES)))
    unknown = [n for n in names if n not in TORCH_CANDIDATES and n not in JAX_CANDIDATES]
    if unknown:
        raise SystemExit(f"--candidates: unknown {unknown}")
    torch_names = [n for n in names if n in TORCH_CANDIDATES]
    jax_names = [n for n in names if n in JAX_CANDIDATES and not a.no_jax]
    result = run_benchmark(parse_shapes(a.shapes or ("gpu" if cuda else "tiny")), torch_names,
                           jax_names, device=device, reps=a.reps or (10 if cuda else 3),
                           warmup=a.warmup if a.warmup is not None else (2 if cuda else 1),
                           seed=a.seed if a.seed is not None else secrets.randbits(31), out=a.out,
                           warmup_s=a.warmup_s)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    common.exit_after_results(main())  # torch and JAX in one process: see there
