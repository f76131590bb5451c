"""Fused linear cross-entropy benchmark: logitless vs naive, torch.compile and the peers.

For each shape (N tokens, H hidden, V vocab), in one process and one run:

* the floor: the op's three bf16 GEMMs through ``torch.mm`` (logits ``x @ Wᵀ``, ``G @ W`` and
  ``Gᵀ @ x`` with a random ``G``), the time any fused linear cross-entropy is measured against;
* every candidate that is importable and applies to the device: forward + backward median
  time, timed interleaved with the floor (candidate, floor, candidate, floor, ...: the GPU's
  clocks drift within a run) and its ratio to the floor calls timed with it, peak extra
  memory (see ``common``), and the errors of the loss, dX and dW against an fp32-logits
  reference (x and W upcast to fp32, chunked plain torch autograd, independent of logitless)
  and what rounding that reference's gradients to bf16 alone costs.

Inputs are bf16 with ``requires_grad``, fresh random values (logits with a realistic spread),
and 10% of the targets are ``ignore_index`` (-100). A candidate that fails (missing package,
OOM, exception) is recorded with its error and the run goes on.

    PYTHONPATH=. python benchmarks/linear_cross_entropy.py                 # GPU: targets + awkward shapes
    PYTHONPATH=. python benchmarks/linear_cross_entropy.py --shapes tiny   # CPU
    ... --shapes llama3-8b,4096x4096x128256 --candidates naive,logitless-triton[chunk_size=2048]
    ... --check-floor                                                      # GEMM rate sanity only

Results: ``benchmarks/results/<gpu>-linear-cross-entropy.json`` (+ ``.png``); see
``benchmarks/results/README.md`` for the fields.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

OP = "linear_cross_entropy"
IGNORE_INDEX = -100
IGNORE_FRACTION = 0.10
LOGIT_STD = 2.0     # std of the random logits: LM heads in training sit around 1-4


# ----------------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    n: int
    h: int
    v: int

    @property
    def gemm_flops(self) -> int:
        return 3 * 2 * self.n * self.h * self.v

    def as_dict(self):
        return dataclasses.asdict(self)


SHAPES = {s.name: s for s in (
    Shape("llama3-8b", 16384, 4096, 128256),     # TARGETS.md
    Shape("gemma2-2b", 8192, 2304, 256000),      # TARGETS.md
    Shape("gpt2-xl", 10000, 1600, 50257),        # V odd, N not a multiple of any chunk
    Shape("qwen2.5-7b", 10000, 3584, 151655),    # the tokenizer's V (not padded to 128)
    Shape("tiny", 1000, 256, 5003),              # CPU: V prime
    Shape("tiny-wide", 333, 96, 32003),          # CPU: V prime, H and N odd-ish
)}
GROUPS = {
    "targets": ["llama3-8b", "gemma2-2b"],
    "awkward": ["gpt2-xl", "qwen2.5-7b"],
    "gpu": ["llama3-8b", "gemma2-2b", "gpt2-xl", "qwen2.5-7b"],
    "tiny": ["tiny", "tiny-wide"],
}


def parse_shapes(spec: str) -> List[Shape]:
    """Comma-separated group names, shape names or ``NxHxV`` triples."""
    return common.parse_shapes(
        spec, SHAPES, GROUPS, form="NxHxV",
        from_parts=lambda tok, p: Shape(tok, *p) if len(p) == 3 else None)


# ----------------------------------------------------------------------------- candidates
# A candidate's ``make(**kwargs)`` returns ``loss_fn(x, w, y) -> scalar mean loss`` or raises
# (ImportError = not installed). It is called once per shape, so per-shape state (e.g. a
# torch.compile cache) starts fresh.
@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    about: str
    make: Callable[..., Callable]
    cuda_only: bool = False      # peers whose kernels need a GPU
    triton: bool = False         # on CPU only under TRITON_INTERPRET=1
    default: bool = True         # in the default set
    default_on_cpu: bool = True  # in the default set on CPU


def _logitless(backend, **fixed):
    def make(**kw):
        import logitless.torch as lt
        if backend == "triton":  # fail as "unavailable" (not "error") while the module is absent
            importlib.import_module("logitless.triton_kernels.linear_cross_entropy")
        tuning = {**fixed, **kw}

        def loss_fn(x, w, y):
            return lt.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, backend=backend,
                                           **tuning)
        return loss_fn
    return make


def naive_loss(x, w, y):
    """What a model does without a fused loss: bf16 logits, upcast, cross-entropy."""
    import torch.nn.functional as F
    return F.cross_entropy(F.linear(x, w).float(), y, ignore_index=IGNORE_INDEX)


def _naive(**kw):
    common.no_kwargs("naive", kw)
    return naive_loss


def _compiled(**kw):
    import torch
    torch.compiler.reset()  # fresh per shape: no recompile limit, no dynamic-shape fallback
    return torch.compile(naive_loss, dynamic=False, **kw)


def _torch_chunked(**kw):
    import torch
    import torch.nn.functional as F
    if not hasattr(F, "linear_cross_entropy"):
        raise ImportError(f"torch.nn.functional.linear_cross_entropy needs torch>=2.13 "
                          f"(have {torch.__version__})")
    opts = torch.nn.LinearCrossEntropyOptions(**kw)  # chunked path (options=None is the naive one)

    def loss_fn(x, w, y):
        return F.linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, options=opts)
    return loss_fn


def _liger(**fixed):
    def make(**kw):
        import torch
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        args = {**fixed, **kw}
        if isinstance(args.get("accum_dtype"), str):
            args["accum_dtype"] = getattr(torch, args["accum_dtype"])

        def loss_fn(x, w, y):
            return liger_fused_linear_cross_entropy(x, w, y, ignore_index=IGNORE_INDEX, **args)
        return loss_fn
    return make


def _cce(**fixed):
    def make(**kw):
        from cut_cross_entropy import linear_cross_entropy as cce
        args = {**fixed, **kw}

        def loss_fn(x, w, y):
            return cce(x, w, y, ignore_index=IGNORE_INDEX, **args)
        return loss_fn
    return make


CANDIDATES = {c.name: c for c in (
    Candidate("logitless-triton", "logitless backend='triton', default (fast) setting",
              _logitless("triton"), triton=True),
    Candidate("logitless-triton-lowmem", "logitless backend='triton', low_memory=True",
              _logitless("triton", low_memory=True), triton=True),
    Candidate("logitless-torch", "logitless backend='torch' (chunked plain PyTorch)",
              _logitless("torch")),
    Candidate("naive", "F.linear in bf16, .float(), F.cross_entropy", _naive),
    Candidate("torch-compile", "torch.compile of the naive function", _compiled,
              default_on_cpu=False),  # a CPU compile takes ~20 s per shape
    Candidate("torch-chunked", "torch.nn.functional.linear_cross_entropy with "
              "LinearCrossEntropyOptions() (torch>=2.13)", _torch_chunked,
              default_on_cpu=False),  # 5-15 s per call on CPU even at the tiny shapes
    Candidate("liger", "Liger-Kernel liger_fused_linear_cross_entropy (defaults: "
              "bf16 weight-grad accumulation)", _liger(), cuda_only=True),
    Candidate("liger-fp32acc", "Liger-Kernel with accum_dtype=torch.float32",
              _liger(accum_dtype="float32"), cuda_only=True, default=False),
    Candidate("cce", "Cut Cross-Entropy linear_cross_entropy (defaults: filter_eps='high')",
              _cce(), cuda_only=True),
    Candidate("cce-exact", "Cut Cross-Entropy with filter_eps=None (no gradient filtering)",
              _cce(filter_eps=None), cuda_only=True, default=False),
)}


def parse_candidates(spec: Optional[str], device: str):
    """``name`` or ``name[key=value,...]`` (the keywords go to the candidate, e.g. tuning);
    ``all`` (adds the opt-in ones) and ``default``."""
    if not spec:
        cpu = not device.startswith("cuda")
        return [(c.name, c, {}) for c in CANDIDATES.values()
                if c.default and (c.default_on_cpu or not cpu)]
    return common.parse_candidates(spec, CANDIDATES, aliases={
        "all": list(CANDIDATES.values()), "default": [c for c in CANDIDATES.values() if c.default]})


# ----------------------------------------------------------------------------- data, reference
def make_inputs(shape: Shape, device: str, seed: int, logit_std: float = LOGIT_STD):
    """bf16 x, W (both requiring grad) and int64 targets with 10% ignore_index.

    Drawn on the device itself (a [V, H] fp32 draw on the host takes seconds at V=256k).
    W is scaled so that the logits have std ``logit_std``. (The speed of a peer that skips
    small softmax gradients, as CCE's ``filter_eps`` does, depends on it: the larger the
    spread, the more peaked the softmax and the more it skips.)
    """
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.n, shape.h, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(shape.v, shape.h, generator=g, device=device) \
        .mul_(logit_std / math.sqrt(shape.h)).to(torch.bfloat16)
    y = torch.randint(0, shape.v, (shape.n,), generator=g, device=device)
    y[torch.rand(shape.n, generator=g, device=device) < IGNORE_FRACTION] = IGNORE_INDEX
    return x.requires_grad_(), w.requires_grad_(), y


def reference(x, w, y, *, chunk_bytes: int = 1 << 30):
    """fp32-logits reference: mean loss, dX and dW (fp32) by plain autograd over token chunks.

    x and W are upcast to fp32 and the GEMMs run in true fp32 (no TF32), so the result is
    independent of logitless and of bf16 rounding inside the op.
    """
    import torch
    import torch.nn.functional as F
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        n, v = x.shape[0], w.shape[0]
        chunk = max(1, chunk_bytes // (4 * v))
        x32 = x.detach().float()
        w32 = w.detach().float().requires_grad_()
        count = max(1, int((y != IGNORE_INDEX).sum()))  # host sync: fine, not the timed path
        dx = torch.empty_like(x32)
        dw = torch.zeros_like(w32)
        loss = 0.0
        for s in range(0, n, chunk):
            xc = x32[s:s + chunk].requires_grad_()
            lc = F.cross_entropy(xc @ w32.t(), y[s:s + chunk], ignore_index=IGNORE_INDEX,
                                 reduction="sum") / count
            gx, gw = torch.autograd.grad(lc, (xc, w32))
            dx[s:s + chunk] = gx
            dw += gw
            loss += float(lc.detach())
            del gx, gw, lc, xc
        return loss, dx, dw.detach()
    finally:
        torch.set_float32_matmul_precision(prev)


def make_step(loss_fn, x, w, y):
    """One training step of the loss: forward, then dX and dW (nothing accumulates)."""
    import torch

    def step():
        loss = loss_fn(x, w, y)
        dx, dw = torch.autograd.grad(loss, (x, w))
        return loss.detach(), dx, dw
    return step


# ----------------------------------------------------------------------------- one shape
FLOOR_GEMMS = ["x @ W.T", "G @ W", "G.T @ x"]


def floor_step(shape: Shape, x, w, *, device: str, seed: int):
    """``(step, flops)``: the op's three GEMMs through torch.mm, with a random bf16 ``G [N, V]``
    that the step holds (drop the step to free it); V rounded up to a multiple of 16. Gaussian
    G runs as fast as the op's real logit gradient (10% zero rows, tiny values): H100,
    ``floor_data_probe.py``, 0.997x / 1.004x at the Llama / Gemma shapes."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed + 1)
    xd, wd = x.detach(), common.floor_weight(w.detach())  # V padded to 16 (common.floor_vocab)
    gmat = torch.randn(shape.n, wd.shape[0], generator=g, device=device, dtype=torch.bfloat16)
    return common.gemm_step([(xd, wd.t()), (gmat, wd), (gmat.t(), xd)])


def bench_floor(shape: Shape, x, w, *, device: str, reps: int, warmup: int, seed: int):
    """The floor timed alone (``--check-floor``)."""
    step, flops = floor_step(shape, x, w, device=device, seed=seed)
    timing = common.time_fn(step, device=device, reps=reps, warmup=warmup)
    del step
    common.free_memory(device)
    return {"status": "ok", "ms": timing.median_ms, "tflops": common.tflops(flops, timing.median_ms),
            "timing": timing.as_dict(), "gemms": FLOOR_GEMMS}


def bench_candidate(label, cand: Candidate, kwargs, inputs, ref, *, device, reps, warmup,
                    floor=None, warmup_s: float = 0.0):
    """One candidate's record; its time is taken interleaved with ``floor`` (the floor's
    step, or None: timed alone)."""
    rec: Dict[str, Any] = {"name": label, "about": cand.about, "kwargs": kwargs}
    reason = common.skip_reason(cand, device)
    if reason:
        return {**rec, "status": "skipped", "error": reason}
    x, w, y = inputs
    out = step = loss_fn = None
    try:
        try:
            loss_fn = cand.make(**kwargs)
        except ImportError as e:
            return {**rec, "status": "unavailable", "error": common.describe_failure(e)["error"]}
        step = make_step(loss_fn, x, w, y)
        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):  # first call compiles / autotunes: not measured
            out = step()
            common.synchronize(device)
            out = None
        rec["warmup_s"] = time.perf_counter() - t0
        out, mem = common.measure_memory(
            step, device=device, returned_bytes=lambda o: common.nbytes(o[1], o[2]))
        loss, dx, dw = out
        rec.update(memory=mem.as_dict(), peak_extra_bytes=mem.peak_extra_bytes, loss=float(loss))
        if ref is not None:
            ref_loss, ref_dx, ref_dw = ref
            rec.update(loss_rel_err=abs(float(loss) - ref_loss) / abs(ref_loss),
                       dx_rel_err=common.rel_err(dx, ref_dx),
                       dw_rel_err=common.rel_err(dw, ref_dw))
        out = loss = dx = dw = None
        rec.update(common.time_against(step, {"floor": floor}, device=device, reps=reps,
                                       warmup_s=warmup_s), status="ok")
    except Exception as e:  # noqa: BLE001 - one candidate's failure must not stop the run
        rec.update(common.describe_failure(e))
    finally:
        out = step = loss_fn = None
        if cand.name == "torch-compile":
            import torch
            torch.compiler.reset()
        common.free_memory(device)
    return rec


def bench_shape(shape: Shape, candidates, *, device: str, reps: int, warmup: int, seed: int,
                show_progress: bool = True, warmup_s: float = 0.0,
                logit_std: float = LOGIT_STD) -> Dict[str, Any]:
    import torch
    common.free_memory(device)
    inputs = make_inputs(shape, device, seed, logit_std)
    x, w, y = inputs
    res: Dict[str, Any] = {"shape": shape.as_dict(), "seed": seed,
                           "ignored_tokens": int((y == IGNORE_INDEX).sum())}
    t0 = time.perf_counter()
    try:
        ref = reference(x, w, y)
        common.synchronize(device)
        res["reference"] = {"loss": ref[0], "seconds": time.perf_counter() - t0,
                            "how": "x, W upcast to fp32; fp32 GEMMs (no TF32); chunked autograd",
                            **common.rounding_floor(
                                ref[1], ref[2], to_input_dtype=lambda t: t.to(torch.bfloat16))}
    except Exception as e:  # noqa: BLE001 - e.g. OOM at a huge shape: time and memory still count
        ref = None
        res["reference"] = common.describe_failure(e)
        common.log(f"[{shape.name}] reference failed, no errors reported: {res['reference']}")
        common.free_memory(device)
    floor = flops = None
    try:
        floor, flops = floor_step(shape, x, w, device=device, seed=seed)
    except Exception as e:  # noqa: BLE001
        res["floor"] = common.describe_failure(e)
        common.free_memory(device)
    res["candidates"] = []
    it = common.progress(candidates, total=len(candidates), desc=shape.name) \
        if show_progress else candidates
    for label, cand, kw in it:
        common.log(f"[{shape.name}] {label} ...")
        rec = bench_candidate(label, cand, kw, inputs, ref, device=device, reps=reps,
                              warmup=warmup, floor=floor, warmup_s=warmup_s)
        common.log(f"[{shape.name}] {label}: {common.brief(rec)}")
        res["candidates"].append(rec)
    if floor is not None:
        try:
            res["floor"] = common.pooled_floor(
                res["candidates"], "floor", flops=flops, gemms=FLOOR_GEMMS,
                alone=lambda: common.time_interleaved([floor], device=device, reps=reps,
                                                      warmup_s=warmup_s)[0])
        except Exception as e:  # noqa: BLE001
            res["floor"] = common.describe_failure(e)
    del inputs, x, w, y, ref, floor
    common.free_memory(device)
    return res


# ----------------------------------------------------------------------------- run, report
def default_out(env) -> Path:
    return common.RESULTS_DIR / f"{common.device_slug(env)}-{OP.replace('_', '-')}.json"


def run_benchmark(shapes: Sequence[Shape], candidates, *, device: str, reps: int, warmup: int,
                  seed: Optional[int] = None, out: Optional[Path] = None, merge: bool = False,
                  plot: bool = True, warmup_s: Optional[float] = None,
                  logit_std: float = LOGIT_STD) -> Dict[str, Any]:
    """Benchmark every shape; write JSON (after each shape, so a cut-short run keeps its
    results) and a PNG next to it. Returns the result dict. ``warmup_s``: interleaved warm-up
    of each candidate with the floor before timing (default ``common.GPU_WARMUP_S`` on CUDA,
    else one call each)."""
    if warmup_s is None:
        warmup_s = common.GPU_WARMUP_S if device.startswith("cuda") else 0.0
    env = common.environment(device, extra_packages=("liger-kernel", "cut-cross-entropy"))
    seed = secrets.randbits(31) if seed is None else seed
    out = Path(out) if out else default_out(env)
    result = {
        "op": OP, "schema": 1, "env": env,
        "config": {"dtype": "bfloat16", "ignore_index": IGNORE_INDEX,
                   "ignore_fraction": IGNORE_FRACTION, "logit_std": logit_std,
                   "reps": reps, "warmup": warmup, "warmup_s": warmup_s, "seed": seed,
                   "timer": "cuda-events" if device.startswith("cuda") else "perf_counter",
                   "floor_timing": "each candidate timed interleaved with the floor (candidate, "
                                   "floor, ...) after warmup_s of interleaved warm-up; "
                                   "ratio_to_floor = ms / floor_ms (those floor calls)",
                   "candidates": {label: c.about for label, c, _ in candidates}},
        "results": [],
    }
    kept = _previous_results(out, env, [s.name for s in shapes]) if merge else []
    for i, shape in enumerate(shapes):
        # per-shape seeds: fresh data per shape, reproducible from the recorded run seed
        result["results"].append(bench_shape(shape, candidates, device=device, reps=reps,
                                             warmup=warmup, seed=seed + 7919 * i,
                                             warmup_s=warmup_s, logit_std=logit_std))
        result["results_kept_from_previous_run"] = [r["shape"]["name"] for r in kept]
        full = {**result, "results": kept + result["results"]}
        common.write_json(out, full)
    result = {**result, "results": kept + result["results"]}
    result["json"] = str(out)
    if plot:
        from benchmarks import plot as plotting
        png = plotting.plot_benchmark(result, out.with_suffix(".png"))
        result["png"] = str(png) if png else None
    return result


def _previous_results(out: Path, env, names) -> List[dict]:
    """Results of shapes not re-run, from an earlier file of the same device."""
    import json
    if not out.exists():
        return []
    try:
        prev = json.loads(out.read_text())
    except (OSError, ValueError):
        return []
    if common.device_slug(prev.get("env", {})) != common.device_slug(env):
        return []
    return [r for r in prev.get("results", []) if r["shape"]["name"] not in names]


def table(res: Dict[str, Any]) -> str:
    """One row a candidate; "floor ms" is the floor timed with it, "x floor" the ratio, "x all
    floors" the ratio to the median of every floor call of the shape (common.pooled_floor)."""
    return common.candidate_table(
        ["candidate", "ms", "floor ms", "x floor", "x all floors", "peak extra", "dX err",
         "dW err", "loss err", "note"],
        res["candidates"], lambda c: common.loss_cells(
            c, [c.get("ratio_to_floor"), c.get("ratio_to_shape_floor")], c["peak_extra_bytes"],
            floors=[c.get("floor_ms")]))


def format_report(result: Dict[str, Any]) -> str:
    lines = []
    env = result["env"]
    where = env.get("gpu_name") or env.get("cpu_model", "cpu")
    pk = env["packages"]
    cfg = result["config"]
    lines.append(f"linear cross-entropy fwd+bwd, bf16, 10% ignored -- {where}; torch {pk.get('torch')}, "
                 f"triton {pk.get('triton')}; median of {cfg['reps']} "
                 f"({cfg['timer']}), each candidate interleaved with the floor; seed {cfg['seed']}")
    if not common.is_gpu_run(env):
        lines.append(common.CPU_SMOKE_NOTE)
    for res in result["results"]:
        s, fl = res["shape"], res.get("floor", {})
        floor = (f"floor {common.fmt_ms(fl['ms'])} ms = {fl['tflops']:.3g} TFLOP/s (3 GEMMs, "
                 f"torch.mm; {common.floor_basis(fl)})"
                 if fl.get("ms") else f"floor {fl.get('status')}: {fl.get('error', '')}")
        lines.append("")
        lines.append(f"{s['name']}  N={s['n']} H={s['h']} V={s['v']}  {floor}")
        lines.append(table(res))
        lines += common.rounding_floor_line(res.get("reference", {}))
    lines += common.wrote_lines(result)
    return "\n".join(lines)


def check_floor(shapes, *, device: str, reps: int, warmup: int, seed: int) -> str:
    """The GEMM rate this machine gives: each shape's three-GEMM floor and a square GEMM."""
    import torch
    lines = []
    m = 8192 if device.startswith("cuda") else 1024
    a = torch.randn(m, m, device=device).to(torch.bfloat16)
    t, flops = common.time_gemms([(a, a)], device=device, reps=reps, warmup=warmup)
    lines.append(f"torch.mm bf16 {m}^3: {common.fmt_ms(t.median_ms)} ms = "
                 f"{common.tflops(flops, t.median_ms):.1f} TFLOP/s")
    del a
    for shape in shapes:
        x, w, _ = make_inputs(shape, device, seed)
        fl = bench_floor(shape, x, w, device=device, reps=reps, warmup=warmup, seed=seed)
        lines.append(f"{shape.name} N={shape.n} H={shape.h} V={shape.v}: floor "
                     f"{common.fmt_ms(fl['ms'])} ms = {fl['tflops']:.1f} TFLOP/s")
        del x, w
        common.free_memory(device)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help=f"comma list of groups {sorted(GROUPS)}, names {sorted(SHAPES)} or NxHxV "
                        "(default: 'gpu' on CUDA, 'tiny' on CPU)")
    p.add_argument("--candidates", default=None,
                   help="comma list of " + ", ".join(CANDIDATES) + ", 'default' or 'all' (adds the "
                        "opt-in ones); name[key=value,...] passes "
                        "keywords (e.g. logitless-triton[chunk_size=2048]). Default: all with "
                        "default=True for the device")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 10 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2 GPU, 1 CPU)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="then seconds of interleaved candidate/floor warm-up before timing "
                        f"(default {common.GPU_WARMUP_S} GPU; CPU: one call each)")
    p.add_argument("--logit-std", type=float, default=LOGIT_STD,
                   help=f"std of the random logits (default {LOGIT_STD}); CCE's gradient "
                        "filtering skips more the larger it is")
    p.add_argument("--seed", type=int, default=None, help="default: fresh random, recorded")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default=None, help="JSON path (default results/<device>-linear-cross-entropy.json)")
    p.add_argument("--merge", action="store_true",
                   help="keep the shapes of an existing --out file that this run does not redo")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--check-floor", action="store_true",
                   help="only print the GEMM rate (square GEMM and each shape's 3-GEMM floor)")
    p.add_argument("--list", action="store_true", help="list shapes and candidates")
    a = p.parse_args(argv)

    if a.list:
        for s in SHAPES.values():
            print(f"shape {s.name}: N={s.n} H={s.h} V={s.v}")
        for g, names in GROUPS.items():
            print(f"group {g}: {','.join(names)}")
        for c in CANDIDATES.values():
            print(f"candidate {c.name}{'' if c.default else ' (opt-in)'}: {c.about}")
        return 0
    device = a.device or common.default_device()
    cuda = device.startswith("cuda")
    if not cuda:
        common.release_large_blocks_to_os()
    shapes = parse_shapes(a.shapes or ("gpu" if cuda else "tiny"))
    reps = a.reps or (10 if cuda else 3)
    warmup = a.warmup if a.warmup is not None else (2 if cuda else 1)
    seed = a.seed if a.seed is not None else secrets.randbits(31)
    if a.check_floor:
        print(check_floor(shapes, device=device, reps=reps, warmup=warmup, seed=seed))
        return 0
    cands = parse_candidates(a.candidates, device)
    result = run_benchmark(shapes, cands, device=device, reps=reps, warmup=warmup, seed=seed,
                           out=a.out, merge=a.merge, plot=not a.no_plot, warmup_s=a.warmup_s,
                           logit_std=a.logit_std)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
