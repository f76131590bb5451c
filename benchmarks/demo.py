"""``make demo``: every op, every backend present here, every importable peer, side by side
(time, peak memory, accuracy), with a progress bar, a summary table and a PNG.

Sections, each a benchmark script of its own (``benchmarks/*.py``, which define the candidates,
inputs, references and measurements; ``benchmarks/results/README.md`` has the definitions):

* linear cross-entropy, PyTorch (and on CPU JAX too);
* linear cross-entropy, JAX (GPU; on CPU its rows are in the first section);
* linear JSD, PyTorch and JAX; tiled MLP (SwiGLU), PyTorch and JAX;
* a Hugging Face ``LlamaForCausalLM`` training step with and without ``patch_causal_lm``.

On a GPU each section runs the TARGETS.md shapes and writes its record file
``benchmarks/results/<gpu>-<op>.json`` (+ ``.png``; linear cross-entropy merges into its file),
then ``<gpu>-demo-summary.json`` / ``.png``. On CPU the shapes are small (seconds each; the
whole demo takes a few minutes on 2 cores) and the files are ``demo-cpu*.json`` / ``.png``
(git-ignored): a smoke run (does everything run, are the errors right?), not a performance
claim. A section that fails is reported and the others still run.

CPU linear cross-entropy: one small but telling shape (default N=2048 tokens, H=256, V=32000),
each candidate in a fresh subprocess, so its peak memory is its own: the resident-set
high-water mark during one forward+backward minus the RSS just before it (inputs built, first
call done) minus the bytes of dX and dW. PyTorch: naive and ``backend="torch"``; JAX: naive
``jnp`` and ``backend="xla"``; the Triton and Pallas kernels run only with ``--interpreted``
(their interpreters take minutes per call at this shape). Inputs in bf16 where the CPU computes
it natively, else fp32 (:func:`cpu_dtype`; ``--cpu-dtype``). Errors are against an fp32-logits
reference computed once in the parent. The summary compares each candidate with the same
framework's naive path at the same shape.

    make demo                                    # = python benchmarks/demo.py
    python benchmarks/demo.py --ops linear-cross-entropy,hf-llama
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks import linear_cross_entropy as lce  # noqa: E402

RESULT_TAG = "DEMO_RESULT "
CPU_SHAPE = lce.Shape("demo-cpu", 2048, 256, 32000)
# At the demo's small V the default 1 GiB budget would put every token in one chunk; 256
# tokens per chunk shows at small scale what 4096-token chunks do at V=128k.
CPU_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class DemoCandidate:
    name: str
    framework: str            # "torch" | "jax"
    about: str
    lce_candidate: Optional[str] = None   # torch: a name in linear_cross_entropy.CANDIDATES
    jax_backend: Optional[str] = None     # jax: None = naive jnp, else logitless backend
    tuning: Optional[Dict[str, Any]] = None
    interpreted: bool = False  # a GPU kernel run by an interpreter on CPU: opt-in (minutes)


def cpu_dtype() -> str:
    """The CPU section's input dtype: bfloat16, what training uses, where the CPU computes it
    natively (AVX512-BF16 or AMX flags), else float32. Without them PyTorch's bf16 GEMMs on
    CPU are emulated: on an AVX2-only AMD EPYC one [2048, 256] x [256, 32000] GEMM took 3.86 s
    in bf16 against 0.61 s in fp32, and both torch candidates hit their 300 s timeout
    (thirty-sixth session). The inputs hold bf16-representable values either way."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if re.search(r"\b(avx512_bf16|amx_bf16)\b", info) else "float32"


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def cpu_candidates(chunk: int, dtype: str = "bfloat16") -> List[DemoCandidate]:
    d = _short(dtype)
    out = [
        DemoCandidate("torch naive", "torch", f"F.linear {d} -> .float() -> F.cross_entropy",
                      lce_candidate="naive"),
        DemoCandidate("logitless torch", "torch", f"backend='torch', chunk_size={chunk}",
                      lce_candidate="logitless-torch", tuning={"chunk_size": chunk}),
        DemoCandidate("logitless triton", "torch",
                      f"backend='triton' (TRITON_INTERPRET=1), chunk_size={chunk}",
                      lce_candidate="logitless-triton", tuning={"chunk_size": chunk},
                      interpreted=True),
    ]
    if importlib.util.find_spec("logitless.jax") is not None:
        out += [
            DemoCandidate("jax naive", "jax", f"jnp: {d} logits -> f32 -> log_softmax",
                          jax_backend=None),
            DemoCandidate("logitless jax xla", "jax", f"backend='xla', chunk_size={chunk}",
                          jax_backend="xla", tuning={"chunk_size": chunk}),
            DemoCandidate("logitless jax pallas", "jax",
                          f"backend='pallas' (interpret mode), chunk_size={chunk}",
                          jax_backend="pallas", tuning={"chunk_size": chunk}, interpreted=True),
        ]
    return out


# ----------------------------------------------------------------------------- worker side
def _worker(spec: Dict[str, Any]) -> None:
    """One candidate in a fresh process: warm up, measure peak RSS of one call, time it, save
    the gradients for the parent's error check, print one RESULT line."""
    common.release_large_blocks_to_os()
    import numpy as np
    data = Path(spec["data"])
    rec: Dict[str, Any] = {"name": spec["name"]}
    try:
        if spec["framework"] == "torch":
            step, to_np = _torch_step(spec, data)
        else:
            step, to_np = _jax_step(spec, data)
        t0 = time.perf_counter()
        step()  # compiles / initialises libraries; not measured
        rec["first_call_s"] = time.perf_counter() - t0
        out, mem = common.measure_memory(
            step, device="cpu", returned_bytes=lambda o: common.nbytes(o[1], o[2]))
        loss, dx, dw = out
        rec.update(loss=float(to_np(loss)), memory=mem.as_dict(),
                   peak_extra_bytes=mem.peak_extra_bytes)
        np.save(data / f"{spec['slot']}-dx.npy", to_np(dx))
        np.save(data / f"{spec['slot']}-dw.npy", to_np(dw))
        out = loss = dx = dw = None
        timing = common.time_fn(step, device="cpu", reps=spec["reps"], warmup=0)
        rec.update(status="ok", ms=timing.median_ms, timing=timing.as_dict())
    except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on
        rec.update(common.describe_failure(e))
    print(RESULT_TAG + json.dumps(common.json_safe(rec)), flush=True)


def _load_inputs(data: Path):
    import numpy as np
    return (np.load(data / "x.npy"), np.load(data / "w.npy"), np.load(data / "y.npy"))


def _torch_step(spec, data: Path):
    import torch
    x32, w32, y64 = _load_inputs(data)
    # float32 files hold bf16-representable values: the cast is exact
    dt = getattr(torch, spec.get("dtype", "bfloat16"))
    x = torch.from_numpy(x32).to(dt).requires_grad_()
    w = torch.from_numpy(w32).to(dt).requires_grad_()
    y = torch.from_numpy(y64)
    del x32, w32
    loss_fn = lce.CANDIDATES[spec["lce_candidate"]].make(**(spec.get("tuning") or {}))
    step = lce.make_step(loss_fn, x, w, y)
    return step, lambda t: t.detach().float().numpy()


def _jax_step(spec, data: Path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    x32, w32, y64 = _load_inputs(data)
    dt = getattr(jnp, spec.get("dtype", "bfloat16"))
    x = jnp.asarray(x32, dtype=dt)
    w = jnp.asarray(w32, dtype=dt)
    y = jnp.asarray(y64.astype(np.int32))
    del x32, w32
    if spec["jax_backend"] is None:
        def loss_fn(x, w):
            logits = jnp.dot(x, w.T).astype(jnp.float32)
            valid = y != lce.IGNORE_INDEX
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, jnp.where(valid, y, 0)[:, None], axis=-1)[:, 0]
            return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    else:
        import logitless.jax as lj
        tuning = spec.get("tuning") or {}

        def loss_fn(x, w):
            return lj.linear_cross_entropy(x, w, y, ignore_index=lce.IGNORE_INDEX,
                                           backend=spec["jax_backend"], **tuning)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))

    def step():
        loss, (dx, dw) = jax.block_until_ready(grad_fn(x, w))
        return loss, dx, dw
    return step, lambda a: np.asarray(jnp.asarray(a, jnp.float32))


# ----------------------------------------------------------------------------- parent side
def run_cpu(shape: lce.Shape, *, chunk: int, reps: int, timeout: float, seed: int,
            plot: bool, out_dir: Path, interpreted: bool = False, bar=None,
            dtype: Optional[str] = None):
    """The linear cross-entropy section on CPU; returns ``(result, report text)``. ``dtype``:
    the inputs' (None: :func:`cpu_dtype`)."""
    import numpy as np
    import torch
    dtype = dtype or cpu_dtype()
    cands = cpu_candidates(chunk, dtype)
    _note(bar, f"N={shape.n} H={shape.h} V={shape.v}: {len(cands)} candidates, each in a "
               f"fresh process")
    x, w, y = lce.make_inputs(shape, "cpu", seed)
    t0 = time.perf_counter()
    ref_loss, ref_dx, ref_dw = lce.reference(x, w, y)
    ref_s = time.perf_counter() - t0
    records = []
    with tempfile.TemporaryDirectory(prefix="logitless-demo-") as tmp:
        data = Path(tmp)
        np.save(data / "x.npy", x.detach().float().numpy())
        np.save(data / "w.npy", w.detach().float().numpy())
        np.save(data / "y.npy", y.numpy())
        del x, w
        for i, c in enumerate(cands):
            if c.interpreted and not interpreted:
                records.append({"name": c.name, "about": c.about, "framework": c.framework,
                                "status": "skipped", "error": "interpreter on CPU: minutes per "
                                "call; --interpreted runs it"})
                continue
            _note(bar, f"{c.name} ...")
            spec = {**dataclasses.asdict(c), "data": str(data), "slot": f"c{i}", "reps": reps,
                    "dtype": dtype}
            rec = _spawn(spec, timeout, {"TRITON_INTERPRET": "1"} if c.interpreted else {})
            rec.update(about=c.about, framework=c.framework)
            if rec.get("status") == "ok":
                dx = torch.from_numpy(np.load(data / f"c{i}-dx.npy"))
                dw = torch.from_numpy(np.load(data / f"c{i}-dw.npy"))
                rec.update(loss_rel_err=abs(rec["loss"] - ref_loss) / abs(ref_loss),
                           dx_rel_err=common.rel_err(dx, ref_dx),
                           dw_rel_err=common.rel_err(dw, ref_dw))
            _note(bar, f"{c.name}: {rec.get('status')} {rec.get('error', '')}")
            records.append(rec)
    env = common.environment("cpu")
    result = {
        "op": "linear_cross_entropy", "schema": 1, "env": env,
        "config": {"dtype": dtype, "ignore_index": lce.IGNORE_INDEX,
                   "ignore_fraction": lce.IGNORE_FRACTION, "logit_std": lce.LOGIT_STD,
                   "reps": reps, "warmup": 1, "seed": seed, "timer": "perf_counter",
                   "memory": "peak RSS growth in a fresh process per candidate"},
        "results": [{"shape": shape.as_dict(), "seed": seed,
                     "reference": {"loss": ref_loss, "seconds": ref_s},
                     "candidates": records}],
    }
    js = common.write_json(out_dir / "demo-cpu.json", result)
    png = None
    if plot:
        from benchmarks import plot as plotting
        png = plotting.plot_benchmark(result, out_dir / "demo-cpu.png", baseline="torch naive",
                                      title=f"linear cross-entropy on CPU, N={shape.n} H={shape.h} "
                                            f"V={shape.v}")
    report = format_cpu_report(result) + "\n" + f"wrote {js}" + (
        f" and {png}" if png else " (no plot: matplotlib is not installed)")
    return result, report


def _note(bar, msg: str) -> None:
    """A progress message: in the progress bar when there is one, else on stderr."""
    if bar is not None:
        bar.set_postfix_str(msg.strip()[:70])
    else:
        common.log("  " + msg)


def _spawn(spec, timeout: float, extra_env) -> Dict[str, Any]:
    env = {**os.environ, **extra_env}
    root = str(common.REPO_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"name": spec["name"], "status": "timeout", "error": f"over {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"name": spec["name"], "status": "error",
            "error": f"worker exited with {proc.returncode}: {tail[:300]}"}


def format_cpu_report(result) -> str:
    dtype = result["config"].get("dtype", "bfloat16")
    why = "" if dtype == "bfloat16" else " (bf16 only on CPUs that compute it natively: cpu_dtype)"
    res = result["results"][0]
    s = res["shape"]
    recs = res["candidates"]
    naive = {r["framework"]: r for r in recs if r.get("status") == "ok"
             and r["name"].endswith("naive")}
    rows = []
    for r in recs:
        if r.get("status") != "ok":
            rows.append([r["name"], "-", "", "-", "", "", "", "", f"{r.get('status')}: "
                         f"{r.get('error', '')}"[:70]])
            continue
        base = naive.get(r["framework"])
        t_ratio = r["ms"] / base["ms"] if base else None
        m_ratio = (r["peak_extra_bytes"] / base["peak_extra_bytes"]
                   if base and base["peak_extra_bytes"] > 0 else None)
        rows.append([r["name"], common.fmt_ms(r["ms"]), common.fmt_ratio(t_ratio),
                     common.fmt_bytes(r["peak_extra_bytes"]), common.fmt_ratio(m_ratio),
                     f"{r['loss']:.5f}", common.fmt_err(r.get("dx_rel_err")),
                     common.fmt_err(r.get("dw_rel_err")), r["about"]])
    method = next((r["memory"]["method"] for r in recs if r.get("memory")), "n/a")
    env = result["env"]
    lines = [
        "",
        f"linear cross-entropy, forward + backward, {_short(dtype)} inputs{why}, 10% of targets "
        "ignored",
        f"CPU: {env.get('cpu_model')} ({env.get('cpu_count')} cores), torch "
        f"{env['packages'].get('torch')}, jax {env['packages'].get('jax')}; "
        f"N={s['n']} tokens, H={s['h']}, V={s['v']} (bf16 logits alone: "
        f"{common.fmt_bytes(2 * s['n'] * s['v'])}, fp32: {common.fmt_bytes(4 * s['n'] * s['v'])})",
        f"time: median of {result['config']['reps']} calls after a warm-up call. "
        f"peak extra: high-water mark of one call's",
        f"  resident memory in its own process minus the RSS before the call and minus dX, dW "
        f"[{method}].",
        f"errors: ||g - ref|| / ||ref|| against fp32 logits (x, W upcast), reference loss "
        f"{res['reference']['loss']:.5f}; ratios vs the same framework's naive path.",
        "",
        common.format_table(["", "ms", "time vs naive", "peak extra", "mem vs naive", "loss",
                             "dX err", "dW err", "what"], rows),
    ]
    if not any(r["framework"] == "jax" for r in recs):
        lines.append("(JAX rows appear once logitless.jax exists.)")
    lines.append("On a GPU `make demo` runs the Triton backend and the peers at the TARGETS.md "
                 "shapes (benchmarks/linear_cross_entropy.py).")
    lines.append(common.CPU_SMOKE_NOTE)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the other ops
@dataclasses.dataclass(frozen=True)
class Section:
    """One op's benchmark script, run in its own process; its JSON feeds the summary."""
    key: str                  # file name part: demo-cpu.<key>.json on CPU
    title: str
    script: str               # under benchmarks/
    cpu_args: List[str]
    gpu_args: List[str]
    baselines: Dict[str, str]  # framework -> the candidate the others are compared with
    records_field: str = "candidates"
    interleaved: bool = True   # times against a floor / plain: takes --warmup-s


SECTIONS = [
    Section("jax-linear-cross-entropy", "linear cross-entropy, JAX", "jax_linear_cross_entropy.py",
            [], [], {"jax": "naive"}),
    # on CPU the logitless rows get 128-token chunks: the default 1 GiB budget would hold the
    # tiny shape's 600 tokens in one chunk and show no saving
    Section("linear-jsd", "linear JSD (distillation)", "linear_jsd.py",
            ["--shapes", "tiny", "--candidates",
             "logitless-triton,logitless-torch[chunk_size=128],naive,torch-compile,liger,"
             "jax-logitless-pallas[chunk_size=128],jax-logitless-xla[chunk_size=128],jax-naive"],
            [], {"torch": "naive", "jax": "jax-naive"}),
    Section("tiled-mlp", "tiled MLP (SwiGLU)", "tiled_mlp.py", ["--shapes", "tiny"], [],
            {"torch": "plain", "jax": "jax-plain"}),
    Section("hf-llama", "Hugging Face Llama training step", "hf_memory.py", ["--tiny"], [],
            {"torch": "hf"}, records_field="variants", interleaved=False),
]
# on CPU the JAX linear-CE rows come from the linear-CE section's own subprocesses
CPU_SECTIONS = [s.key for s in SECTIONS if s.key != "jax-linear-cross-entropy"]
LOG_LINE = re.compile(r"^\s*(\[[^\]]*\]\s*)?[\w\-\[\]=.,]+( \.\.\.|: )")


def run_section(sec: Section, *, device: str, out: Optional[Path], timeout: float, seed: int,
                reps: Optional[int] = None, warmup_s: Optional[float] = None,
                bar=None) -> Dict[str, Any]:
    """Run one section's script; return ``{"section", "status", "result", "report"}``.
    The child's log lines show in the progress bar; its report (stdout) is kept."""
    args = list(sec.gpu_args if device == "cuda" else sec.cpu_args) + ["--seed", str(seed)]
    if reps:
        args += ["--reps", str(reps)]
    if warmup_s is not None and sec.interleaved:
        args += ["--warmup-s", str(warmup_s)]
    if out is not None:
        args += ["--out", str(out)]
    cmd = [sys.executable, str(Path(__file__).resolve().parent / sec.script), *args]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    root = str(common.REPO_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    rec: Dict[str, Any] = {"section": sec.key, "title": sec.title, "command": " ".join(cmd)}
    tail: List[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
        try:
            for line in proc.stderr:
                line = line.rstrip()
                tail = (tail + [line])[-20:]
                if bar is not None and LOG_LINE.match(line):
                    bar.set_postfix_str(line.strip()[:70])
                if time.perf_counter() - t0 > timeout:
                    proc.kill()
                    break
            proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stdout.seek(0)
        report = stdout.read()
    rec["seconds"] = time.perf_counter() - t0
    json_path = out
    if json_path is None:  # the script's default record file: it prints "wrote <path>"
        m = re.search(r"wrote (\S+\.json)", report)
        json_path = Path(m.group(1)) if m else None
    if proc.returncode == 0 and json_path is not None and Path(json_path).exists():
        rec.update(status="ok", result=json.loads(Path(json_path).read_text()),
                   report=report.strip(), json=str(json_path))
    else:
        rec.update(status="error", report=report.strip(),
                   error=f"exit {proc.returncode}: " + " | ".join(tail[-3:])[-400:])
    return rec


def paired_ratio(r: Dict[str, Any], base: Dict[str, Any]) -> float:
    """``r``'s time over ``base``'s, each taken against the floor (or the plain MLP) that was
    timed interleaved with it, where both were: the GPU's clocks drift within a run, so two
    candidates timed apart differ by the drift too (the tiled MLP's plain baseline, timed
    alone, once read 56.4 ms against 52.0 in its interleaved calls). ms / ms otherwise."""
    if r is base:
        return 1.0
    for key, base_is_reference in (("ratio_to_floor", False), ("ratio_to_plain", True)):
        b = 1.0 if base_is_reference and base["name"] in ("plain", "jax-plain") else base.get(key)
        if r.get(key) is not None and b:
            return r[key] / b
    return r["ms"] / base["ms"]


def summary_rows(title: str, result: Dict[str, Any], baselines: Dict[str, str],
                 records_field: str = "candidates") -> List[Dict[str, Any]]:
    """One row per candidate of every shape: time and memory relative to its framework's
    baseline candidate (same shape), gradient errors."""
    rows = []
    shapes = result.get("results") or [{
        "shape": {"name": f"{result.get('config', {}).get('tokens', '?')} tokens"},
        records_field: result.get(records_field, [])}]
    for res in shapes:
        recs = res.get(records_field, [])
        shape = res.get("shape", {})
        label = shape.get("name", "")
        for r in recs:
            fw = r.get("framework") or ("jax" if r["name"].startswith("jax") else "torch")
            if title.endswith("JAX"):
                fw = "jax"
            base = next((b for b in recs if b["name"] == baselines.get(fw)
                         and b.get("status") == "ok"), None)
            mem = r.get("peak_extra_bytes", r.get("peak_over_base_bytes"))
            base_mem = None if base is None else base.get("peak_extra_bytes",
                                                          base.get("peak_over_base_bytes"))
            ok = r.get("status") == "ok"
            rows.append({
                "op": title, "shape": label, "name": r["name"], "framework": fw,
                "status": r.get("status"), "error": r.get("error"),
                "ms": r.get("ms") if ok else None,
                "time_ratio": paired_ratio(r, base) if ok and base else None,
                "peak_extra_bytes": mem if ok else None,
                "mem_ratio": mem / base_mem if ok and base and base_mem and base_mem > 0
                and mem is not None else None,
                "dx_rel_err": r.get("dx_rel_err", r.get("embed_tokens_grad_rel_err")),
                "dw_rel_err": r.get("dw_rel_err", r.get("lm_head_grad_rel_err")),
                "baseline": None if base is None else base["name"],
            })
    return rows


def format_summary(rows: List[Dict[str, Any]]) -> str:
    table = []
    for r in rows:
        if r["status"] != "ok":
            table.append([r["op"], r["shape"], r["name"], "-", "", "-", "", "", "",
                          f"{r['status']}: {r.get('error') or ''}"[:60]])
            continue
        table.append([r["op"], r["shape"], r["name"], common.fmt_ms(r["ms"]),
                      common.fmt_ratio(r["time_ratio"]), common.fmt_bytes(r["peak_extra_bytes"]),
                      common.fmt_ratio(r["mem_ratio"]), common.fmt_err(r["dx_rel_err"]),
                      common.fmt_err(r["dw_rel_err"]),
                      f"vs {r['baseline']}" if r["baseline"] and r["baseline"] != r["name"] else ""])
    return common.format_table(["op", "shape", "candidate", "ms", "time", "peak extra", "memory",
                                "dX err", "dW err", ""], table)


def run_all(args) -> int:
    device = args.device or common.default_device()
    cuda = device == "cuda"
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    out_dir = Path(args.out_dir)
    # on a GPU each op's script writes its own file (results/<gpu>-<op>.json + .png) unless
    # --out-dir names another folder: then every file goes there
    gpu_out = None
    if cuda and out_dir.resolve() != common.RESULTS_DIR.resolve():
        slug = common.device_slug(common.environment(device))

        def gpu_out(key: str) -> Path:
            return out_dir / f"{slug}-{key}.json"
    wanted = [k.strip() for k in args.ops.split(",")] if args.ops else None
    sections = [s for s in SECTIONS if cuda or s.key in CPU_SECTIONS]
    if wanted is not None:
        known = ["linear-cross-entropy"] + [s.key for s in sections]
        bad = [k for k in wanted if k not in known]
        if bad:
            raise SystemExit(f"--ops: unknown {bad}; known here: {known}")
        sections = [s for s in sections if s.key in wanted]
    run_ce = wanted is None or "linear-cross-entropy" in wanted
    jobs = (["linear-cross-entropy"] if run_ce else []) + [s.key for s in sections]
    t_start = time.perf_counter()
    try:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), desc="make demo", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        bar = None
    reports, rows, failed = [], [], []
    if run_ce:
        if bar is not None:
            bar.set_description("linear cross-entropy")
        if cuda:
            result = run_gpu(reps=args.reps, seed=seed, plot=not args.no_plot,
                             warmup_s=args.warmup_s,
                             out=gpu_out and gpu_out("linear-cross-entropy"))
            reports.append(lce.format_report(result))
            rows += summary_rows("linear cross-entropy", result, {"torch": "naive"})
        else:
            shape = CPU_SHAPE if not args.shape else lce.parse_shapes(args.shape)[0]
            result, report = run_cpu(shape, chunk=args.chunk_size, reps=args.reps or 3,
                                     timeout=args.timeout, seed=seed, plot=not args.no_plot,
                                     out_dir=out_dir, interpreted=args.interpreted, bar=bar,
                                     dtype=None if args.cpu_dtype == "auto" else args.cpu_dtype)
            reports.append(report)
            rows += summary_rows("linear cross-entropy", result,
                                 {"torch": "torch naive", "jax": "jax naive"})
        if bar is not None:
            bar.update(1)
    for sec in sections:
        if bar is not None:
            bar.set_description(sec.title)
        out = (gpu_out and gpu_out(sec.key)) if cuda else out_dir / f"demo-cpu.{sec.key}.json"
        rec = run_section(sec, device=device, out=out, timeout=args.timeout * 4, seed=seed,
                          reps=args.reps, warmup_s=args.warmup_s, bar=bar)
        if rec["status"] == "ok":
            reports.append(rec["report"])
            rows += summary_rows(sec.title, rec["result"], sec.baselines, sec.records_field)
        else:
            failed.append(rec)
            reports.append(f"{sec.title}: FAILED ({rec['error']})\n  command: {rec['command']}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    where = "GPU" if cuda else "CPU"
    print("\n\n".join(reports))
    print(f"\n==== make demo summary ({where}, {time.perf_counter() - t_start:.0f} s): every op, "
          f"every backend here; time and peak extra memory relative to the same framework's "
          f"naive path (JAX memory: XLA temp buffers"
          f"{'' if cuda else '; on CPU the JAX linear-CE rows: resident-memory peak extra'})\n")
    if not cuda:
        print(common.CPU_SMOKE_NOTE + "\n")
    print(format_summary(rows))
    env = common.environment(device)
    stem = f"{common.device_slug(env)}-demo-summary" if cuda else "demo-cpu.summary"
    summary = {"schema": 1, "env": env, "seed": seed, "rows": rows,
               "failed_sections": [{k: f[k] for k in ("section", "error", "command")}
                                   for f in failed]}
    js = common.write_json(out_dir / f"{stem}.json", summary)
    png = None
    if not args.no_plot:
        from benchmarks import plot as plotting
        png = plotting.plot_summary(rows, out_dir / f"{stem}.png", title=plotting.with_cpu_note(
            f"make demo on {where}: {env.get('gpu_name') or env.get('cpu_model')}", env))
    print(f"\nwrote {js}" + (f" and {png}" if png else " (no plot: matplotlib is not installed)"))
    ok = any(r["status"] == "ok" for r in rows)
    return 0 if ok and not failed else 1


def resummarize(path: Path, plot: bool) -> int:
    """Recompute a GPU summary's rows from the per-op result files of the same run (same seed,
    beside it: ``<device>-<section>.json``) with today's :func:`summary_rows`, keeping the rows
    of sections whose file is missing; rewrite the summary JSON and its plot."""
    summary = json.loads(path.read_text())
    stem = path.name[: -len("-demo-summary.json")]
    sources = [("linear cross-entropy", "linear-cross-entropy", {"torch": "naive"},
                "candidates")] + [(s.title, s.key, s.baselines, s.records_field)
                                  for s in SECTIONS]
    rows = list(summary["rows"])
    for title, key, baselines, field in sources:
        f = path.parent / f"{stem}-{key}.json"
        result = json.loads(f.read_text()) if f.exists() else None
        if result is None or result.get("config", {}).get("seed") != summary["seed"]:
            continue  # not this run's: keep the rows as they were
        fresh = summary_rows(title, result, baselines, field)
        rows = [r for r in rows if r["op"] != title] + fresh
        common.log(f"{title}: rows recomputed from {f.name}")
    order = [t for t, *_ in sources]
    rows.sort(key=lambda r: order.index(r["op"]) if r["op"] in order else len(order))
    summary["rows"] = rows
    print(format_summary(rows))
    common.write_json(path, summary)
    if plot:
        from benchmarks import plot as plotting
        plotting.plot_summary(rows, path.with_suffix(".png"), title=plotting.with_cpu_note(
            f"make demo on GPU: {summary['env'].get('gpu_name')}", summary["env"]))
    return 0


def run_gpu(*, reps: Optional[int], seed: int, plot: bool, warmup_s: Optional[float] = None,
            out: Optional[Path] = None):
    shapes = lce.parse_shapes("targets")
    cands = lce.parse_candidates(None, "cuda")
    return lce.run_benchmark(shapes, cands, device="cuda", reps=reps or 10, warmup=2,
                             seed=seed, out=out, merge=True, plot=plot, warmup_s=warmup_s)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available")
    p.add_argument("--ops", default=None,
                   help="comma list of linear-cross-entropy, " + ", ".join(s.key for s in SECTIONS)
                        + " (default: all that apply to the device)")
    p.add_argument("--shape", default=None, help=f"CPU linear-CE shape NxHxV (default "
                   f"{CPU_SHAPE.n}x{CPU_SHAPE.h}x{CPU_SHAPE.v})")
    p.add_argument("--chunk-size", type=int, default=CPU_CHUNK,
                   help="tokens per chunk for the logitless linear-CE rows on CPU")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 3 CPU, 10 GPU)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds of interleaved candidate/floor warm-up before each candidate's "
                        f"timing (default {common.GPU_WARMUP_S} GPU; CPU: one call each)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per CPU candidate "
                   "(x4 per section)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cpu-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="CPU linear-CE inputs (auto: bf16 where the CPU has native bf16, else "
                        "fp32; see cpu_dtype)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR),
                   help="folder of every result file (default benchmarks/results/)")
    p.add_argument("--interpreted", action="store_true",
                   help="CPU: also run the Triton and Pallas linear-CE kernels under their "
                        "interpreters (minutes per call; try a smaller --shape)")
    p.add_argument("--resummarize", metavar="SUMMARY_JSON", default=None,
                   help="recompute a GPU run's summary (rows and plot) from its per-op result "
                        "files beside it, with this version's ratios; runs nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(json.loads(a.worker))
        return 0
    if a.resummarize:
        return resummarize(Path(a.resummarize), plot=not a.no_plot)
    if (a.device or common.default_device()) != "cuda":
        common.release_large_blocks_to_os()
    return run_all(a)


if __name__ == "__main__":
    sys.exit(main())
