"""Fused linear JSD benchmark, PyTorch and JAX in one run: logitless vs naive, torch.compile,
Liger-Kernel's ``LigerFusedLinearJSD`` (when importable) and naive jnp.

For each shape (N tokens, H_s student hidden, H_t teacher hidden, V vocab), in one process:

* the floor: the op's four bf16 GEMMs through ``torch.mm`` (cuBLAS) -- student logits
  ``x_s @ W_sᵀ``, teacher logits ``x_t @ W_tᵀ``, ``G @ W_s`` and ``Gᵀ @ x_s`` with a random
  ``G [N, V]`` -- and the same four through XLA (the JAX candidates' floor);
* every candidate: forward + backward median time, timed interleaved with the floor
  (candidate, floor, ...: the GPU's clocks drift within a run; a PyTorch candidate with the
  cuBLAS floor under CUDA events, a JAX one with the XLA and the cuBLAS floors under the wall
  clock up to the result) and its ratio to the floor calls timed with it, peak extra memory
  (PyTorch: see ``common``; JAX: the compiled program's temporary buffers), and the relative
  errors of the loss, dX_s and dW_s against an fp32 reference (all four tensors upcast, fp32
  GEMMs without TF32, chunked plain autograd; independent of logitless) and what rounding
  that reference's gradients to bf16 alone costs.

Inputs are bf16, the student with ``requires_grad``; the teacher's logits correlate with the
student's (distillation: they mostly agree), both of std ~2; 10% of the targets are
``ignore_index``. A candidate that fails (missing package, OOM, exception) is recorded with its
error and the run goes on.

    PYTHONPATH=. python benchmarks/linear_jsd.py                    # GPU: the acceptance shape
    PYTHONPATH=. python benchmarks/linear_jsd.py --shapes tiny      # CPU (Triton interpreted)
    ... --candidates logitless-triton[chunk_size=2048],liger --beta 0.0 --temperature 2
    ... --probe                     # sweep the Triton row-kernel settings at the shapes
    ... --smoke                     # quick GPU check: small shapes, every candidate, no JSON

Results: ``benchmarks/results/<gpu>-linear-jsd.json`` (+ ``.png``).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

OP = "linear_jsd"
IGNORE_INDEX = -100
IGNORE_FRACTION = 0.10
LOGIT_STD = 2.0
TEACHER_AGREEMENT = 0.8  # correlation of teacher and student logits (same H only)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    n: int
    h_s: int
    h_t: int
    v: int

    @property
    def gemm_flops(self) -> int:
        return 2 * self.n * self.v * (3 * self.h_s + self.h_t)


SHAPES = {s.name: s for s in (
    Shape("llama3-8b", 8192, 4096, 4096, 128256),       # the acceptance shape (TARGETS.md)
    Shape("llama3-8b-from-70b", 8192, 4096, 8192, 128256),  # a wider teacher
    Shape("qwen2.5-7b", 6000, 3584, 3584, 151655),      # V not padded, N not a chunk multiple
    Shape("tiny", 600, 128, 96, 5003),                   # CPU
    Shape("smoke", 2000, 512, 384, 50021),               # a quick GPU check
)}
GROUPS = {"target": ["llama3-8b"], "gpu": ["llama3-8b", "llama3-8b-from-70b", "qwen2.5-7b"],
          "tiny": ["tiny"]}


def parse_shapes(spec: str) -> List[Shape]:
    """Comma-separated group names, shape names, ``NxHxV`` or ``NxHsxHtxV``."""
    def from_parts(tok, p):
        if len(p) not in (3, 4):
            return None
        n, hs, *ht, v = p
        return Shape(tok, n, hs, ht[0] if ht else hs, v)
    return common.parse_shapes(spec, SHAPES, GROUPS, form="NxHxV / NxHsxHtxV",
                               from_parts=from_parts, unique=False)


# ----------------------------------------------------------------------------- candidates
@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    about: str
    make: Callable[..., Callable]   # (opts, **kw) -> loss_fn(xs, ws, xt, wt, y)
    framework: str = "torch"        # "torch" | "jax"
    cuda_only: bool = False
    triton: bool = False            # on CPU only under TRITON_INTERPRET=1
    default: bool = True


def _logitless(api, backend, **fixed):
    """``make`` of ``logitless.<api>.linear_jsd`` (api: "torch" or "jax") with ``backend``."""
    def make(opts, **kw):
        linear_jsd = importlib.import_module(f"logitless.{api}").linear_jsd
        tuning = {**fixed, **kw}

        def loss_fn(xs, ws, xt, wt, y):
            return linear_jsd(xs, ws, xt, wt, y, ignore_index=IGNORE_INDEX, backend=backend,
                              **opts, **tuning)
        return loss_fn
    return make


def naive_torch_loss(opts):
    """What a model does without a fused loss: bf16 logits, upcast, log-softmax, JSD."""
    import torch
    import torch.nn.functional as F
    beta, t = opts["beta"], opts["temperature"]

    def loss_fn(xs, ws, xt, wt, y):
        logq = F.log_softmax(F.linear(xs, ws).float() / t, dim=-1)
        with torch.no_grad():
            logp = F.log_softmax(F.linear(xt, wt).float() / t, dim=-1)
        if beta == 0:
            tok = (logp.exp() * (logp - logq)).sum(-1)
        elif beta == 1:
            tok = (logq.exp() * (logq - logp)).sum(-1)
        else:
            logm = torch.logaddexp(logq + math.log(1 - beta), logp + math.log(beta))
            tok = beta * (logp.exp() * (logp - logm)).sum(-1) + \
                (1 - beta) * (logq.exp() * (logq - logm)).sum(-1)
        mask = y != IGNORE_INDEX
        return (tok * mask).sum() / mask.sum().clamp_min(1)
    return loss_fn


def _naive(opts, **kw):
    common.no_kwargs("naive", kw)
    return naive_torch_loss(opts)


def _compiled(opts, **kw):
    import torch
    torch.compiler.reset()
    return torch.compile(naive_torch_loss(opts), dynamic=False, **kw)


def _liger(**fixed):
    def make(opts, **kw):
        import torch
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
        args = {**fixed, **kw}
        if isinstance(args.get("accum_dtype"), str):
            args["accum_dtype"] = getattr(torch, args["accum_dtype"])
        mod = LigerFusedLinearJSD(jsd_beta=opts["beta"], ignore_index=IGNORE_INDEX,
                                  temperature=opts["temperature"], **args)

        def loss_fn(xs, ws, xt, wt, y):
            return mod(xs, ws, xt, wt, y)
        return loss_fn
    return make


def _naive_jax(opts, **kw):
    import jax
    import jax.numpy as jnp
    from jax import lax
    beta, t = opts["beta"], opts["temperature"]

    def loss_fn(xs, ws, xt, wt, y):
        logq = jax.nn.log_softmax((xs @ ws.T).astype(jnp.float32) / t, axis=-1)
        logp = lax.stop_gradient(jax.nn.log_softmax((xt @ wt.T).astype(jnp.float32) / t, -1))
        if beta == 0:
            tok = jnp.sum(jnp.exp(logp) * (logp - logq), -1)
        elif beta == 1:
            tok = jnp.sum(jnp.exp(logq) * (logq - logp), -1)
        else:
            logm = jnp.logaddexp(logq + math.log(1 - beta), logp + math.log(beta))
            tok = beta * jnp.sum(jnp.exp(logp) * (logp - logm), -1) + \
                (1 - beta) * jnp.sum(jnp.exp(logq) * (logq - logm), -1)
        mask = y != IGNORE_INDEX
        return jnp.sum(jnp.where(mask, tok, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    return loss_fn


CANDIDATES = {c.name: c for c in (
    Candidate("logitless-triton", "logitless backend='triton' (fp32 logits, fp32 dW accumulation)",
              _logitless("torch", "triton"), triton=True),
    Candidate("logitless-triton-bf16logits", "logitless backend='triton', fp32_logits=False "
              "(faster, ~1e-2 gradient error)", _logitless("torch", "triton", fp32_logits=False),
              triton=True),
    Candidate("logitless-triton-fp16tiles", "logitless backend='triton', fp16_tile_logits=True "
              "(fp16 logits beside per-tile maxima from our TMA GEMM; Hopper)",
              _logitless("torch", "triton", fp16_tile_logits=True), cuda_only=True,
              default=False),
    Candidate("logitless-torch", "logitless backend='torch' (chunked plain PyTorch)",
              _logitless("torch", "torch")),
    Candidate("naive", "F.linear in bf16, .float(), log_softmax JSD, autograd", _naive),
    Candidate("torch-compile", "torch.compile of the naive function", _compiled, cuda_only=True),
    Candidate("liger", "Liger-Kernel LigerFusedLinearJSD (defaults: bf16 dW accumulation)",
              _liger(), cuda_only=True),
    Candidate("liger-fp32acc", "Liger-Kernel LigerFusedLinearJSD(accum_dtype=torch.float32)",
              _liger(accum_dtype="float32"), cuda_only=True),
    Candidate("jax-logitless-pallas", "logitless.jax backend='pallas' (jit(value_and_grad))",
              _logitless("jax", "pallas"), framework="jax"),
    Candidate("jax-logitless-xla", "logitless.jax backend='xla'", _logitless("jax", "xla"),
              framework="jax"),
    Candidate("jax-naive", "naive jnp: bf16 logits, upcast, log_softmax JSD, jax.grad",
              _naive_jax, framework="jax"),
)}


def parse_candidates(spec: Optional[str]):
    """``name`` or ``name[key=value,...]`` (the keywords go to the candidate)."""
    if not spec:
        return [(c.name, c, {}) for c in CANDIDATES.values() if c.default]
    return common.parse_candidates(spec, CANDIDATES)


# ----------------------------------------------------------------------------- data, reference
def make_inputs(shape: Shape, device: str, seed: int):
    """bf16 student x_s, W_s (requiring grad), teacher x_t, W_t, int64 targets, 10% ignored.
    Same hidden size: the teacher's head and states are the student's mixed with independent
    noise, so the two distributions mostly agree (logit correlation TEACHER_AGREEMENT)."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device)
    scale = LOGIT_STD / math.sqrt(shape.h_s)
    xs = r(shape.n, shape.h_s)
    ws = r(shape.v, shape.h_s).mul_(scale)
    if shape.h_t == shape.h_s:
        a = math.sqrt(TEACHER_AGREEMENT)
        xt = xs * a + r(shape.n, shape.h_t) * math.sqrt(1 - a * a)
        wt = ws * a + r(shape.v, shape.h_t).mul_(scale * math.sqrt(1 - a * a))
    else:
        xt = r(shape.n, shape.h_t)
        wt = r(shape.v, shape.h_t).mul_(LOGIT_STD / math.sqrt(shape.h_t))
    y = torch.randint(0, shape.v, (shape.n,), generator=g, device=device)
    y[torch.rand(shape.n, generator=g, device=device) < IGNORE_FRACTION] = IGNORE_INDEX
    bf = lambda t: t.to(torch.bfloat16)
    return bf(xs).requires_grad_(), bf(ws).requires_grad_(), bf(xt), bf(wt), y


def reference(xs, ws, xt, wt, y, opts, *, chunk_bytes: int = 1 << 30):
    """fp32 reference (loss, dX_s, dW_s): every tensor upcast, fp32 GEMMs (no TF32), the
    generalized JSD by plain autograd over token chunks."""
    import torch
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        n, v = xs.shape[0], ws.shape[0]
        chunk = max(1, chunk_bytes // (16 * v))
        ws32 = ws.detach().float().requires_grad_()
        wt32 = wt.float()
        count = max(1, int((y != IGNORE_INDEX).sum()))  # host sync: fine, not timed
        loss_fn = naive_torch_loss(opts)
        dx = torch.empty(xs.shape, dtype=torch.float32, device=xs.device)
        dw = torch.zeros_like(ws32)
        loss = 0.0
        for s in range(0, n, chunk):
            xc = xs[s:s + chunk].detach().float().requires_grad_()
            yc = y[s:s + chunk]
            part = loss_fn(xc, ws32, xt[s:s + chunk].float(), wt32, yc) * \
                (max(1, int((yc != IGNORE_INDEX).sum())) / count)
            gx, gw = torch.autograd.grad(part, (xc, ws32))
            dx[s:s + chunk] = gx
            dw += gw
            loss += float(part.detach())
            del gx, gw, part, xc
        return loss, dx, dw
    finally:
        torch.set_float32_matmul_precision(prev)


# ----------------------------------------------------------------------------- floors
FLOOR_GEMMS = ["x_s @ W_s.T", "x_t @ W_t.T", "G @ W_s", "G.T @ x_s"]


def random_g(shape: Shape, device, seed):
    """The floor's random bf16 ``G [N, V]`` (the gradient of the logits' stand-in)."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randn(shape.n, common.floor_vocab(shape.v), generator=g, device=device,
                       dtype=torch.bfloat16)


def floor_step(xs, ws, xt, wt, gmat):
    """``(step, flops)``: the four GEMMs through torch.mm (cuBLAS on a GPU), V rounded up to a
    multiple of 16 (``common.floor_vocab``)."""
    xs, ws, wt = xs.detach(), common.floor_weight(ws.detach()), common.floor_weight(wt.detach())
    return common.gemm_step([(xs, ws.t()), (xt, wt.t()), (gmat, ws), (gmat.t(), xs)])


def bench_floor(shape: Shape, xs, ws, xt, wt, *, device, reps, warmup, seed):
    """The floor timed alone (``--probe``'s header line)."""
    step, flops = floor_step(xs, ws, xt, wt, random_g(shape, device, seed))
    t = common.time_fn(step, device=device, reps=reps, warmup=warmup)
    del step
    common.free_memory(device)
    return {"status": "ok", "ms": t.median_ms, "tflops": common.tflops(flops, t.median_ms),
            "timing": t.as_dict(), "gemms": FLOOR_GEMMS}


def _to_jax(t):
    from logitless.bridge import to_jax
    return to_jax(t.detach())


def xla_floor_step(jx):
    """The floor's four GEMMs through XLA as one compiled call on the same (bridged) arrays,
    ``G`` included: ``step()`` runs them."""
    import jax
    import jax.numpy as jnp
    xs, xt, g = jx["xs"], jx["xt"], jx["g"]
    pad = ((0, g.shape[1] - jx["ws"].shape[0]), (0, 0))  # V rounded up as for cuBLAS's floor
    ws, wt = (jnp.pad(jx[k], pad) if pad[0][1] else jx[k] for k in ("ws", "wt"))
    gemms = jax.jit(lambda xs, ws, xt, wt, g: (xs @ ws.T, xt @ wt.T, g @ ws, g.T @ xs)) \
        .lower(xs, ws, xt, wt, g).compile()
    return lambda: gemms(xs, ws, xt, wt, g)


# ----------------------------------------------------------------------------- candidates
def _errors(rec, loss, dx, dw, ref):
    ref_loss, ref_dx, ref_dw = ref
    rec.update(loss=float(loss), loss_rel_err=abs(float(loss) - ref_loss) / abs(ref_loss),
               dx_rel_err=common.rel_err(dx, ref_dx), dw_rel_err=common.rel_err(dw, ref_dw))


def bench_torch(label, cand, kw, data, ref, opts, *, device, reps, warmup, floors, warmup_s):
    """A PyTorch candidate, timed interleaved with ``floors`` (``{"floor": cuBLAS step}``)."""
    import torch
    rec: Dict[str, Any] = {"name": label, "about": cand.about, "kwargs": kw, "framework": "torch"}
    xs, ws, xt, wt, y = data
    step = out = None
    try:
        try:
            loss_fn = cand.make(opts, **kw)
        except ImportError as e:
            return {**rec, "status": "unavailable", "error": common.describe_failure(e)["error"]}

        def step():
            loss = loss_fn(xs, ws, xt, wt, y)
            dx, dw = torch.autograd.grad(loss, (xs, ws))
            return loss.detach(), dx, dw

        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):
            step()
            common.synchronize(device)
        rec["warmup_s"] = time.perf_counter() - t0
        out, mem = common.measure_memory(step, device=device,
                                         returned_bytes=lambda o: common.nbytes(o[1], o[2]))
        rec.update(memory=mem.as_dict(), peak_extra_bytes=mem.peak_extra_bytes)
        if ref is not None:
            _errors(rec, *out, ref)
        out = None
        rec.update(common.time_against(step, floors, device=device, reps=reps,
                                       warmup_s=warmup_s), status="ok")
    except Exception as e:  # noqa: BLE001 - one candidate's failure must not stop the run
        rec.update(common.describe_failure(e))
    finally:
        out = step = None
        if cand.name == "torch-compile":
            torch.compiler.reset()
        common.free_memory(device)
    return rec


def bench_jax(label, cand, kw, jx, ref, opts, *, device, reps, warmup, floors, warmup_s):
    """A JAX candidate, timed interleaved with ``floors`` (``xla_floor``, ``floor``), every
    call by the wall clock up to its result."""
    import jax
    from logitless.bridge import to_torch
    rec: Dict[str, Any] = {"name": label, "about": cand.about, "kwargs": kw, "framework": "jax"}
    compiled = out = None
    try:
        loss_fn = cand.make(opts, **kw)
        args = (jx["xs"], jx["ws"], jx["xt"], jx["wt"], jx["y"])
        t0 = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(*args).compile()
        rec["compile_s"] = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:
            rec.update(temp_bytes=int(mem.temp_size_in_bytes),
                       peak_extra_bytes=int(mem.temp_size_in_bytes))
        step = lambda: compiled(*args)
        for _ in range(max(1, warmup)):
            jax.block_until_ready(step())
        loss, (dx, dw) = out = step()
        if ref is not None:
            _errors(rec, float(loss), to_torch(dx), to_torch(dw), ref)
        out = loss = dx = dw = None
        rec.update(common.time_against(step, floors, device=device, reps=reps,
                                       warmup_s=warmup_s, wall=True), status="ok")
    except Exception as e:  # noqa: BLE001
        rec.update(common.describe_failure(e))
    finally:
        compiled = out = None
        gc.collect()
    return rec


def bench_shape(shape: Shape, candidates, opts, *, device, reps, warmup, seed,
                warmup_s: float = 0.0) -> Dict[str, Any]:
    import torch
    common.free_memory(device)
    data = make_inputs(shape, device, seed)
    xs, ws, xt, wt, y = data
    res: Dict[str, Any] = {"shape": dataclasses.asdict(shape), "seed": seed,
                           "ignored_tokens": int((y == IGNORE_INDEX).sum())}
    t0 = time.perf_counter()
    try:
        ref = reference(xs, ws, xt, wt, y, opts)
        common.synchronize(device)
        res["reference"] = {"loss": ref[0], "seconds": time.perf_counter() - t0,
                            "how": "all tensors upcast to fp32; fp32 GEMMs (no TF32); chunked "
                                   "autograd",
                            **common.rounding_floor(
                                ref[1], ref[2], to_input_dtype=lambda t: t.to(torch.bfloat16))}
    except Exception as e:  # noqa: BLE001
        ref = None
        res["reference"] = common.describe_failure(e)
        common.free_memory(device)
    floors: Dict[str, Any] = {"floor": None, "xla_floor": None}
    gmat = flops = None
    try:
        gmat = random_g(shape, device, seed)
        floors["floor"], flops = floor_step(xs, ws, xt, wt, gmat)
    except Exception as e:  # noqa: BLE001
        res["floor"] = common.describe_failure(e)
    jx = None
    if any(c.framework == "jax" for _, c, _ in candidates):
        try:
            jx = dict(xs=_to_jax(xs), ws=_to_jax(ws), xt=_to_jax(xt), wt=_to_jax(wt),
                      y=_to_jax(y.int()))
            if gmat is not None:
                jx["g"] = _to_jax(gmat)  # zero-copy: the XLA floor multiplies the same G
                floors["xla_floor"] = xla_floor_step(jx)
        except Exception as e:  # noqa: BLE001
            res["xla_floor"] = common.describe_failure(e)
    res["candidates"] = []
    for label, cand, kw in candidates:
        reason = common.skip_reason(cand, device)
        common.log(f"[{shape.name}] {label} ...")
        if reason:
            rec = {"name": label, "about": cand.about, "status": "skipped", "error": reason}
        elif cand.framework == "jax":
            rec = (bench_jax(label, cand, kw, jx, ref, opts, device=device, reps=reps,
                             warmup=warmup, floors=floors, warmup_s=warmup_s) if jx
                   else {"name": label, "status": "error", "error": "JAX unavailable"})
        else:
            rec = bench_torch(label, cand, kw, data, ref, opts, device=device, reps=reps,
                              warmup=warmup, floors={"floor": floors["floor"]},
                              warmup_s=warmup_s)
        common.log(f"[{shape.name}] {label}: {common.brief(rec)}")
        res["candidates"].append(rec)
    # per-shape floors: pooled over the calls timed with the candidates of the same timer
    by_fw = lambda fw: [r for r in res["candidates"] if r.get("framework") == fw]
    for name, recs, wall, through in (
            ("floor", by_fw("torch"), False,
             "torch.mm (cuBLAS)" if device.startswith("cuda") else "torch.mm"),
            ("xla_floor", by_fw("jax"), True, "XLA")):
        if floors[name] is None:
            continue
        try:
            res[name] = common.pooled_floor(
                recs, name, flops=flops, gemms=FLOOR_GEMMS, through=through,
                alone=lambda f=floors[name], wall=wall: common.time_interleaved(
                    [f], device=device, reps=reps, warmup_s=warmup_s, wall=wall)[0])
        except Exception as e:  # noqa: BLE001
            res[name] = common.describe_failure(e)
    del data, xs, ws, xt, wt, y, ref, jx, gmat, floors
    gc.collect()
    common.free_memory(device)
    return res


# ----------------------------------------------------------------------------- probe
PROBE = [  # Triton settings swept by --probe (each: tuning keywords of backend='triton')
    {}, dict(row_sync=False),
    dict(block_v=1024, segment_size=8192), dict(block_v=4096, segment_size=8192),
    dict(block_v=2048, segment_size=4096), dict(block_v=2048, segment_size=16384),
    dict(block_v=2048, segment_size=32768, num_warps=16, programs_per_sm=1),
    dict(programs_per_sm=1), dict(programs_per_sm=3, num_warps=4, block_v=1024),
    dict(chunk_size=1024), dict(chunk_size=2048), dict(chunk_size=4096),
    dict(logits_chunk_size=256), dict(logits_chunk_size=896),
    dict(fp32_logits=False), dict(fp32_logits=False, chunk_size=2048, logits_chunk_size=1024),
]


def probe(shapes, opts, *, device, reps, warmup, seed) -> str:
    """Time backend='triton' under each PROBE setting (and the GEMM floor) at each shape."""
    import torch
    import logitless.torch as lt
    lines = []
    for shape in shapes:
        xs, ws, xt, wt, y = make_inputs(shape, device, seed)
        floor, _ = floor_step(xs, ws, xt, wt, random_g(shape, device, seed))
        lines.append(f"{shape.name}: ratios to the floor calls timed with each setting")
        for kw in PROBE:
            def step():
                loss = lt.linear_jsd(xs, ws, xt, wt, y, backend="triton", **opts, **kw)
                return torch.autograd.grad(loss, (xs, ws))
            try:
                for _ in range(warmup):
                    step()
                _, mem = common.measure_memory(step, device=device,
                                               returned_bytes=lambda o: common.nbytes(*o))
                t = common.time_against(step, {"floor": floor}, device=device, reps=reps,
                                        warmup_s=common.GPU_WARMUP_S if device.startswith(
                                            "cuda") else 0.0)
                lines.append(f"  {kw}: {common.fmt_ms(t['ms'])} ms "
                             f"({t['ratio_to_floor']:.3f}x floor {common.fmt_ms(t['floor_ms'])} "
                             f"ms), extra {common.fmt_bytes(mem.peak_extra_bytes)}")
            except Exception as e:  # noqa: BLE001
                lines.append(f"  {kw}: {common.describe_failure(e)}")
            common.free_memory(device)
            common.log(lines[-1])
        del xs, ws, xt, wt, y, floor
        common.free_memory(device)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- run, report
def run_benchmark(shapes, candidates, opts, *, device, reps, warmup, seed=None, out=None,
                  plot=True, write=True, warmup_s: Optional[float] = None) -> Dict[str, Any]:
    if warmup_s is None:
        warmup_s = common.GPU_WARMUP_S if device.startswith("cuda") else 0.0
    env = common.environment(device, extra_packages=("liger-kernel",))
    seed = secrets.randbits(31) if seed is None else seed
    out = Path(out) if out else common.RESULTS_DIR / f"{common.device_slug(env)}-linear-jsd.json"
    result = {
        "op": OP, "schema": 1, "env": env,
        "config": {"dtype": "bfloat16", **opts, "ignore_index": IGNORE_INDEX,
                   "ignore_fraction": IGNORE_FRACTION, "logit_std": LOGIT_STD,
                   "teacher_agreement": TEACHER_AGREEMENT, "reps": reps, "warmup": warmup,
                   "warmup_s": warmup_s, "seed": seed,
                   "floor_timing": "each candidate timed interleaved with its floors (torch: "
                                   "cuBLAS floor, CUDA events; JAX: XLA and cuBLAS floors, wall "
                                   "clock to the result); ratio_to_<floor> = ms / <floor>_ms", "memory": "torch: peak extra (common.measure_memory); jax: "
                                           "compiled temp buffers",
                   "candidates": {label: c.about for label, c, _ in candidates}},
        "results": [],
    }
    for i, shape in enumerate(shapes):
        result["results"].append(bench_shape(shape, candidates, opts, device=device, reps=reps,
                                             warmup=warmup, seed=seed + 7919 * i,
                                             warmup_s=warmup_s))
        if write:
            common.write_json(out, result)
    if write:
        result["json"] = str(out)
        if plot:
            from benchmarks import plot as plotting
            png = plotting.plot_benchmark(result, out.with_suffix(".png"),
                                          title=f"linear JSD fwd+bwd (beta={opts['beta']}) - "
                                                f"{env.get('gpu_name') or 'cpu'}")
            result["png"] = str(png) if png else None
    return result


def format_report(result: Dict[str, Any]) -> str:
    env, cfg = result["env"], result["config"]
    lines = [f"linear JSD fwd+bwd, bf16, beta={cfg['beta']}, T={cfg['temperature']}, 10% "
             f"ignored -- {env.get('gpu_name') or env.get('cpu_model', 'cpu')}; torch "
             f"{env['packages'].get('torch')}, triton {env['packages'].get('triton')}, jax "
             f"{env['packages'].get('jax')}; median of {cfg['reps']}, each candidate "
             f"interleaved with its floors; seed {cfg['seed']}"]
    if not common.is_gpu_run(env):
        lines.append(common.CPU_SMOKE_NOTE)
    for res in result["results"]:
        s, fl, xf = res["shape"], res.get("floor", {}), res.get("xla_floor", {})
        through = "cuBLAS" if env.get("gpu_name") else "torch.mm"
        floor = (f"floor {common.fmt_ms(fl['ms'])} ms = {fl['tflops']:.3g} TFLOP/s (4 GEMMs, "
                 f"{through})" if fl.get("ms") else f"floor {fl.get('status')}: {fl.get('error')}")
        if xf.get("ms"):
            floor += f"; XLA floor {common.fmt_ms(xf['ms'])} ms"
        lines += ["", f"{s['name']}  N={s['n']} H_s={s['h_s']} H_t={s['h_t']} V={s['v']}  {floor} "
                      f"({common.floor_basis(fl)})"]
        lines.append(common.candidate_table(
            ["candidate", "ms", "floor ms", "XLA floor ms", "x floor", "x XLA floor", "extra",
             "dX err", "dW err", "loss err", "note"], res["candidates"],
            lambda c: common.loss_cells(
                c, [c.get("ratio_to_floor"), c.get("ratio_to_xla_floor")],
                c.get("peak_extra_bytes"), floors=[c.get("floor_ms"), c.get("xla_floor_ms")])))
        lines += common.rounding_floor_line(res.get("reference", {}))
    lines += common.wrote_lines(result)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help=f"groups {sorted(GROUPS)}, names "
                   f"{sorted(SHAPES)}, NxHxV or NxHsxHtxV (default: 'target' on CUDA, 'tiny')")
    p.add_argument("--candidates", default=None,
                   help="comma list of " + ", ".join(CANDIDATES) + "; name[key=value,...]")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 10 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds of interleaved candidate/floor warm-up before timing "
                        f"(default {common.GPU_WARMUP_S} GPU; CPU: one call each)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--probe", action="store_true", help="sweep the Triton settings instead")
    p.add_argument("--smoke", action="store_true",
                   help="the 'smoke' shape, reps 3, no JSON: does everything run?")
    a = p.parse_args(argv)
    device = a.device or common.default_device()
    cuda = device.startswith("cuda")
    if not cuda:
        common.release_large_blocks_to_os()
    shapes = parse_shapes(a.shapes or ("smoke" if a.smoke else "target" if cuda else "tiny"))
    reps = a.reps or (3 if a.smoke or not cuda else 10)
    warmup = a.warmup if a.warmup is not None else (2 if cuda else 1)
    seed = a.seed if a.seed is not None else secrets.randbits(31)
    opts = dict(beta=a.beta, temperature=a.temperature)
    if a.probe:
        print(probe(shapes, opts, device=device, reps=reps, warmup=warmup, seed=seed))
        return 0
    result = run_benchmark(shapes, parse_candidates(a.candidates), opts, device=device,
                           reps=reps, warmup=warmup, seed=seed, out=a.out,
                           plot=not a.no_plot, write=not a.smoke, warmup_s=a.warmup_s)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    common.exit_after_results(main())  # torch and JAX in one process: see there
