"""Helpers every benchmark shares: environment record, timing, peak memory, errors, output.

Conventions (the same for every op, so results are comparable across files):

* time: median of ``reps`` timed calls after untimed warm-up calls; CUDA events per call on
  a GPU, ``time.perf_counter`` up to the result on CPU and for JAX. A candidate and its floor
  (the op's GEMMs alone) are timed interleaved, the order rotated each round (A B, B A, ...:
  ``time_interleaved``), and its ratio is to the floor calls timed with it: the GPU's clocks
  drift within a run.
* peak extra memory: the high-water mark during one call minus what was held before the call
  and minus the nominal bytes of what the call returns (e.g. the gradients, which any
  implementation must produce). GPU: ``torch.cuda.max_memory_allocated`` after a peak reset.
  CPU: the process's resident-set high-water mark (Linux VmHWM, reset through
  ``/proc/self/clear_refs``) with glibc told to give large blocks straight back to the OS,
  so the RSS follows the live tensors; ``ru_maxrss`` growth where that is unavailable.
* error: ``‖a − ref‖ / ‖ref‖`` accumulated in float64, over row blocks so that no full-size
  temporary is made.

Frameworks are imported lazily, per function: ``torch`` by the torch helpers, ``jax`` only
by ``time_jax``; the JAX benchmarks use the framework-free parts (environment, CPU memory,
the command-line parsers, tables, JSON).
"""
from __future__ import annotations

import ast
import ctypes
import dataclasses
import datetime
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- code A/Bs
def load_module_file(name: str, path, replace=()):
    """Module ``name`` (e.g. ``logitless.triton_kernels._ab_rows``) from the source at
    ``path``, with ``replace`` pairs applied to the text, registered in ``sys.modules`` so that
    its relative imports resolve inside the package: an older version of a file, for an A/B
    against this tree's in one process."""
    import types
    src = Path(path).read_text()
    for a, b in replace:
        src = src.replace(a, b)
    mod = types.ModuleType(name)
    mod.__package__, mod.__file__ = name.rpartition(".")[0], str(path)
    sys.modules[name] = mod
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


# ----------------------------------------------------------------------------- environment
def package_version(name: str) -> Optional[str]:
    """Installed version of a distribution, without importing it (None if absent)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode(errors="replace") if out.returncode == 0 else None


def git_provenance() -> Dict[str, Any]:
    """``git_commit`` (``<sha>+dirty`` when tracked files differ from HEAD), ``git_changed``
    (``git status --porcelain`` lines, untracked files too) and ``git_diff_sha`` (sha256 of
    ``git diff HEAD``, first 12 hex digits; None when clean): a dirty run stays identifiable."""
    sha = _git("rev-parse", "--short", "HEAD")
    if sha is None:
        return {"git_commit": None}
    changed = (_git("status", "--porcelain") or "").splitlines()
    diff = _git("diff", "HEAD") or ""
    return {"git_commit": sha.strip() + ("+dirty" if diff else ""), "git_changed": changed,
            "git_diff_sha": hashlib.sha256(diff.encode()).hexdigest()[:12] if diff else None}


def environment(device: Optional[str] = None, extra_packages: Sequence[str] = ()) -> Dict[str, Any]:
    """What a result file must say about where it was measured."""
    env: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **git_provenance(),
        "packages": {p: package_version(p) for p in
                     ("torch", "triton", "jax", "jaxlib", "numpy", *extra_packages)},
    }
    if device is not None and device.startswith("cuda"):
        import torch
        props = torch.cuda.get_device_properties(device)
        env.update(device="cuda", gpu_name=props.name,
                   gpu_memory_bytes=int(props.total_memory),
                   gpu_sm_count=int(props.multi_processor_count),
                   cuda_version=torch.version.cuda,
                   float32_matmul_precision=torch.get_float32_matmul_precision())
    else:
        env.update(device="cpu", cpu_model=_cpu_model())
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def emit_json(record: Dict[str, Any], out=None) -> None:
    """Print ``record`` as one JSON line, and append it to the open file ``out`` (if any)."""
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_slug(env: Dict[str, Any]) -> str:
    return slug(env["gpu_name"]) if env.get("device") == "cuda" else "cpu"


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- timing
GPU_WARMUP_S = 1.0  # wall time of interleaved warm-up per timed group on a GPU (clocks settle)


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    times_ms: List[float]
    method: str
    iqr_ms: float = 0.0  # interquartile range of times_ms: the spread inside one measurement

    @classmethod
    def of(cls, times: List[float], method: str) -> "Timing":
        q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times * 3)
        return cls(statistics.median(times), min(times), max(times), times, method, q3 - q1)

    def as_dict(self):
        return dataclasses.asdict(self)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(device)


def _wait(out, device: str) -> None:
    """Block until ``out`` (torch tensors and/or JAX arrays) is computed."""
    if "jax" in sys.modules:  # a JAX step returns before its work is done
        sys.modules["jax"].block_until_ready(out)
    synchronize(device)


def _rotation(n: int, r: int) -> List[int]:
    """The order of round ``r`` of ``n`` interleaved steps: rotated by r."""
    return [(r + k) % n for k in range(n)]


def time_interleaved(steps: Sequence[Callable[[], Any]], *, device: str, reps: int,
                     warmup_s: float = 0.0, warmup_calls: int = 1,
                     wall: bool = False) -> List[Timing]:
    """Time ``steps`` in turn, ``reps`` calls each; one ``Timing`` per step.

    Why interleave: a GPU whose clocks drift during a run (heat, power) slows steps timed
    together alike, so the ratio of two steps holds; timed apart, ratios moved by 5-10%.
    Round r runs the steps rotated by r (A B C, B C A, C A B, ...): in a fixed order the step
    timed after another paid for it (H100, one Pallas JSD timed against itself: the second of
    the pair 1.5-3% slower whichever it was; ``results/…-s20-jax-jsd-code-ab-order.jsonl``).
    Warm-up: rounds of one call of every step until ``warmup_s`` seconds have passed and at
    least ``warmup_calls`` rounds ran (``warmup_calls=0, warmup_s=0``: none).

    Every call is timed the same way: on CUDA (``wall`` False) by its own pair of CUDA events,
    the host waiting only at the end, so launch latency overlaps as in training; otherwise
    (CPU, or ``wall`` for JAX steps and the steps compared with them) by ``perf_counter`` from
    the call to its completion (``jax.block_until_ready`` of its result when JAX is loaded,
    then a device synchronize). Each call's result is dropped before the next call starts.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    t0, rounds = time.perf_counter(), 0
    while rounds < warmup_calls or time.perf_counter() - t0 < warmup_s:
        for step in steps:
            _wait(step(), device)  # result dropped at once
        rounds += 1
    if device.startswith("cuda") and not wall:
        import torch
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(reps)] for _ in steps]
        for r in range(reps):
            for i in _rotation(len(steps), r):
                events[i][r][0].record()
                steps[i]()  # result dropped at once: its memory returns to the caching allocator
                events[i][r][1].record()
        torch.cuda.synchronize(device)
        return [Timing.of([s.elapsed_time(e) for s, e in ev], "cuda-events") for ev in events]
    times: List[List[float]] = [[] for _ in steps]
    for r in range(reps):
        for i in _rotation(len(steps), r):
            t = time.perf_counter()
            out = steps[i]()
            _wait(out, device)  # held until the clock stops: freeing it is not part of the call
            times[i].append((time.perf_counter() - t) * 1e3)
            del out
    method = "perf_counter" + (" to jax.block_until_ready" if "jax" in sys.modules else "") + (
        " + torch.cuda.synchronize" if device.startswith("cuda") else "")
    return [Timing.of(ts, method) for ts in times]


def time_fn(fn: Callable[[], Any], *, device: str, reps: int, warmup: int = 1) -> Timing:
    """``time_interleaved`` of one step after ``warmup`` untimed calls."""
    return time_interleaved([fn], device=device, reps=reps, warmup_calls=warmup)[0]


def time_jax(fn: Callable[[], Any], *, reps: int, warmup: int) -> Timing:
    """Wall time of ``fn()`` up to ``jax.block_until_ready`` of its outputs, after ``warmup``
    untimed calls."""
    import jax  # noqa: F401 - loaded, so that the timer waits for the JAX result
    return time_interleaved([fn], device="cpu", reps=reps, warmup_calls=warmup, wall=True)[0]


def time_against(step: Callable[[], Any], floors: Dict[str, Optional[Callable[[], Any]]], *,
                 device: str, reps: int, warmup_s: float, wall: bool = False) -> Dict[str, Any]:
    """Time ``step`` interleaved with each floor step of ``floors`` (name -> step; None =
    unavailable, left out). Returns a candidate record's fields: ``ms``, ``timing`` and for each
    floor ``<name>_ms``, ``<name>_timing`` (its calls interleaved with this step),
    ``ratio_to_<name>`` = ms / <name>_ms and ``ratio_to_<name>_ci95``, that ratio's 95%
    interval from a paired bootstrap (:func:`paired_ratio_ci`)."""
    names = [n for n, f in floors.items() if f is not None]
    t, *fts = time_interleaved([step, *(floors[n] for n in names)], device=device, reps=reps,
                               warmup_s=warmup_s, wall=wall)
    rec: Dict[str, Any] = {"ms": t.median_ms, "timing": t.as_dict()}
    for name, ft in zip(names, fts):
        rec.update({f"{name}_ms": ft.median_ms, f"{name}_timing": ft.as_dict(),
                    f"ratio_to_{name}": t.median_ms / ft.median_ms,
                    f"ratio_to_{name}_ci95": paired_ratio_ci(t.times_ms, ft.times_ms)})
    return rec


def paired_ratio_ci(times: Sequence[float], floor_times: Sequence[float], *,
                    resamples: int = 2000, seed: int = 0) -> List[float]:
    """95% interval of median(times) / median(floor_times) from a bootstrap that resamples the
    (call, its floor call) pairs together: how far one run's ratio can be trusted (with ten
    reps on an H100 the interval is often ±5%: a difference of a few percent between two
    candidates needs repeated runs)."""
    import numpy as np
    a, b = np.asarray(times, float), np.asarray(floor_times, float)
    k = min(len(a), len(b))
    idx = np.random.default_rng(seed).integers(0, k, size=(resamples, k))
    ratios = np.median(a[:k][idx], axis=1) / np.median(b[:k][idx], axis=1)
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def floor_basis(floor: Dict[str, Any]) -> str:
    """What a shape's floor number is, for a report's header line."""
    return ("timed alone" if floor.get("how", "").startswith("timed alone")
            else "median of all floor calls of the shape")


def pooled_floor(records: Iterable[Dict[str, Any]], name: str, *, flops: int,
                 alone: Callable[[], Timing], **about) -> Dict[str, Any]:
    """A shape's floor record: the median over every call of floor ``name`` interleaved with
    the ``records`` (candidates); when none was timed, ``alone()`` times the floor by itself.
    Ratios use each candidate's own ``<name>_ms``, not this number; each record also gets
    ``ratio_to_shape_<name>``, its time over this pooled median. Both are worth reading: the
    own floor cancels clock drift, but how fast a floor call runs depends on its neighbour
    (after a slow, low-power candidate the clocks recover: an H100 run read 68.4 ms beside CCE
    and 75.1 beside naive), which flatters the slower candidates' own ratios."""
    records = list(records)
    times = [t for r in records for t in (r.get(f"{name}_timing") or {}).get("times_ms", [])]
    methods = {r[f"{name}_timing"]["method"] for r in records if r.get(f"{name}_timing")}
    if times:
        t = Timing.of(times, " / ".join(sorted(methods)))
        how = (f"median of all {len(times)} floor calls interleaved with this shape's "
               f"candidates (each candidate's ratio uses its own: {name}_ms)")
    else:
        t, how = alone(), "timed alone (no candidate was timed)"
    for r in records:
        if r.get(f"{name}_timing") and r.get("ms"):
            r[f"ratio_to_shape_{name}"] = r["ms"] / t.median_ms
    return {"status": "ok", "ms": t.median_ms, "tflops": tflops(flops, t.median_ms),
            "timing": t.as_dict(), "how": how, **about}


def capture_cuda_graph(step: Callable[[], Any], reset: Callable[[], Any]):
    """A CUDA graph of ``step()`` (e.g. one fwd+bwd), captured after two warm-up calls on a
    side stream, as CUDA graphs require; ``reset()`` (e.g. dropping ``.grad``) runs before
    the capture. Replay it with ``graph.replay()``."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


FLOOR_VOCAB_MULTIPLE = 16


def floor_vocab(v: int) -> int:
    """The vocabulary size the floor's GEMMs run at: ``v`` rounded up to a multiple of 16.
    cuBLAS takes its fast kernels only for aligned sizes; at an odd V (GPT-2's 50257) the
    unpadded GEMMs ran at ~1/6 the speed on an H100 (sm75 "align1" kernels), which would make
    a floor no GEMM-bound op need respect (logitless splits such GEMMs; DESIGN.md)."""
    return -(-v // FLOOR_VOCAB_MULTIPLE) * FLOOR_VOCAB_MULTIPLE


def floor_weight(w):
    """``w [V, H]`` with zero rows appended up to :func:`floor_vocab` (``w`` itself if none)."""
    import torch
    pad = floor_vocab(w.shape[0]) - w.shape[0]
    return w if pad == 0 else torch.cat([w, w.new_zeros(pad, w.shape[1])])


def gemm_step(pairs: Sequence[tuple]):
    """``(step, flops)``: ``step()`` runs ``torch.mm(a, b)`` for every pair, back to back: the
    floor of an op whose work is these GEMMs."""
    import torch

    def step():
        return [torch.mm(a, b) for a, b in pairs]

    return step, sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs)


def time_gemms(pairs: Sequence[tuple], *, device: str, reps: int, warmup: int = 1):
    """``(Timing, flops)`` of ``gemm_step(pairs)`` timed alone."""
    step, flops = gemm_step(pairs)
    return time_fn(step, device=device, reps=reps, warmup=warmup), flops


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------- memory
def free_memory(device: str) -> None:
    """Drop garbage and cached blocks so the next measurement starts clean."""
    gc.collect()
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


def nbytes(*tensors) -> int:
    """Bytes of tensors/arrays (None entries count 0)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "element_size"):
            total += t.numel() * t.element_size()
        else:
            total += int(t.nbytes)
    return total


@dataclasses.dataclass
class Memory:
    peak_extra_bytes: int    # peak - base - returned (may be < 0 only by allocator noise)
    peak_bytes: int          # high-water mark during the call
    base_bytes: int          # held just before the call
    returned_bytes: int      # nominal bytes of the outputs the call must produce
    method: str

    def as_dict(self):
        return dataclasses.asdict(self)


def measure_memory(fn: Callable[[], Any], *, device: str,
                   returned_bytes: Callable[[Any], int]):
    """Run ``fn()`` once; return ``(its output, Memory)``.

    ``returned_bytes(output)`` gives the nominal size of what the call must hand back (e.g.
    ``dx`` and ``dW`` in the input dtype): it is subtracted, so "extra" is what an
    implementation needs beyond its unavoidable inputs and results.
    """
    free_memory(device)
    if device.startswith("cuda"):
        import torch
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        method = "torch.cuda.max_memory_allocated"
    else:
        rss = CpuPeakRss()
        base = rss.reset()
        out = fn()
        peak = rss.peak()
        method = rss.method
    ret = int(returned_bytes(out))
    return out, Memory(peak - base - ret, peak, base, ret, method)


_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL("libc.so.6")
            lib.malloc_trim  # noqa: B018 - glibc only
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _malloc_trim() -> None:
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)


def release_large_blocks_to_os(threshold_bytes: int = 128 << 10) -> bool:
    """Make glibc serve blocks above ``threshold_bytes`` with mmap and return them on free.

    By default glibc raises its mmap threshold after large frees and keeps freed blocks
    resident for reuse, so a process's RSS stops following its live tensors and a CPU peak
    measured from RSS would under-count. Call once, early (before big allocations).
    """
    lib = _glibc()
    if lib is None:
        return False
    m_mmap_threshold = -3  # <malloc.h>; setting it also disables the dynamic threshold
    return bool(lib.mallopt(m_mmap_threshold, int(threshold_bytes)))


class CpuPeakRss:
    """Resident-set high-water mark of this process, resettable on Linux."""

    def __init__(self):
        self.resettable = self._can_reset()
        self.method = ("VmHWM after reset via /proc/self/clear_refs (Linux), RSS baseline"
                       if self.resettable else "ru_maxrss growth (peak before the call hides part)")
        self._base_maxrss = 0

    @staticmethod
    def _can_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status_kb("VmHWM") is not None
        except OSError:
            return False

    def reset(self) -> int:
        """Start a measurement; return the baseline (current RSS) in bytes."""
        _malloc_trim()
        if self.resettable:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5": reset the peak RSS to the current RSS
            return _status_kb("VmRSS") * 1024
        self._base_maxrss = _ru_maxrss_bytes()
        return self._base_maxrss

    def peak(self) -> int:
        if self.resettable:
            return _status_kb("VmHWM") * 1024
        return _ru_maxrss_bytes()


def _status_kb(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _ru_maxrss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024  # macOS reports bytes


# ----------------------------------------------------------------------------- command line
def parse_shapes(spec: str, shapes: Dict[str, Any], groups: Dict[str, List[str]], *, form: str,
                 from_parts: Callable[[str, List[int]], Any], unique: bool = True) -> List[Any]:
    """Comma-separated group names, shape names or ``form`` tuples of positive integers.

    ``from_parts(token, ints)`` makes the shape of a tuple, or returns None where the count of
    numbers does not fit ``form``. ``unique``: a shape named twice runs once (the first place).
    """
    out: List[Any] = []
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        if tok in groups:
            out += [shapes[n] for n in groups[tok]]
        elif tok in shapes:
            out.append(shapes[tok])
        else:
            parts = tok.lower().split("x")
            shape = (from_parts(tok, list(map(int, parts)))
                     if all(p.isdigit() and int(p) > 0 for p in parts) else None)
            if shape is None:
                raise SystemExit(f"--shapes: {tok!r} is neither a group {sorted(groups)}, a "
                                 f"shape {sorted(shapes)}, nor {form}")
            out.append(shape)
    if not unique:
        return out
    seen, uniq = set(), []
    for s in out:
        if s.name not in seen:
            seen.add(s.name)
            uniq.append(s)
    return uniq


def parse_candidates(spec: str, candidates: Dict[str, Any],
                     aliases: Optional[Dict[str, Sequence[Any]]] = None) -> List[tuple]:
    """``name`` or ``name[key=value,...]`` tokens, comma-separated, as ``(label, candidate,
    keywords)``; the keywords go to the candidate (e.g. tuning). A token in ``aliases`` stands
    for its candidates, each without keywords."""
    out = []
    for tok in split_top_level(spec):
        if aliases and tok in aliases:
            out += [(c.name, c, {}) for c in aliases[tok]]
            continue
        name, kw = tok, {}
        if "[" in tok:
            if not tok.endswith("]"):
                raise SystemExit(f"--candidates: malformed {tok!r}; use name[key=value,...]")
            name, body = tok[:-1].split("[", 1)
            for item in filter(None, body.split(",")):
                k, sep, val = item.partition("=")
                if not sep:
                    raise SystemExit(f"--candidates: {item!r} in {tok!r} is not key=value")
                try:
                    kw[k.strip()] = ast.literal_eval(val.strip())
                except (ValueError, SyntaxError):
                    kw[k.strip()] = val.strip()
        if name not in candidates:
            raise SystemExit(f"--candidates: unknown {name!r}; known: {', '.join(candidates)}")
        out.append((tok, candidates[name], kw))
    return out


def split_top_level(spec: str) -> List[str]:
    """Split at the commas outside ``[...]``: ``a[x=1,y=2],b`` -> ``['a[x=1,y=2]', 'b']``."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [p for p in parts if p]


def no_kwargs(name: str, kw: Dict[str, Any]) -> None:
    """Refuse keywords (``name[key=value]``) for a candidate that takes none."""
    if kw:
        raise TypeError(f"candidate {name!r} takes no keyword arguments, got {sorted(kw)}")


def skip_reason(c, device: str) -> Optional[str]:
    """Why candidate ``c`` (with ``cuda_only`` and ``triton`` flags) cannot run on ``device``."""
    cuda = device.startswith("cuda")
    if c.cuda_only and not cuda:
        return "needs CUDA"
    if c.triton and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton on CPU needs TRITON_INTERPRET=1 (slow)"
    return None


# ----------------------------------------------------------------------------- errors
def rel_err(a, ref, *, block_rows: int = 4096) -> float:
    """``‖a − ref‖ / ‖ref‖`` in float64, block by block (no full-size temporaries).

    NaN/Inf anywhere gives NaN (never a small number); a zero reference gives 0 for an exact
    match and inf otherwise.
    """
    import torch
    if tuple(a.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(ref.shape)}")
    a2 = a.detach().reshape(a.shape[0] if a.dim() else 1, -1)
    r2 = ref.detach().reshape(a2.shape)
    num = torch.zeros((), dtype=torch.float64, device=a2.device)
    den = torch.zeros((), dtype=torch.float64, device=a2.device)
    for s in range(0, a2.shape[0], block_rows):
        ab = a2[s:s + block_rows].to(torch.float64)
        rb = r2[s:s + block_rows].to(device=a2.device, dtype=torch.float64)
        num += (ab - rb).square().sum()
        den += rb.square().sum()
    num, den = math.sqrt(num.item()), math.sqrt(den.item())
    if not (math.isfinite(num) and math.isfinite(den)):
        return float("nan")
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


def rounding_floor(ref_dx, ref_dw, *, to_input_dtype: Callable, err: Callable = rel_err):
    """The error of the reference gradients rounded to the inputs' dtype against themselves:
    no candidate returning gradients in that dtype can do better. Fields for the reference
    record: ``rounded_dx_rel_err``, ``rounded_dw_rel_err``. ``err(a, ref)`` as ``rel_err``."""
    return {"rounded_dx_rel_err": float(err(to_input_dtype(ref_dx), ref_dx)),
            "rounded_dw_rel_err": float(err(to_input_dtype(ref_dw), ref_dw))}


def rounding_floor_line(reference: Dict[str, Any]) -> List[str]:
    """The report line under a table for ``rounding_floor``'s fields (none if absent)."""
    if "rounded_dx_rel_err" not in reference:
        return []
    return [f"  the fp32 reference's gradients rounded to bf16 (no bf16 result can do better): "
            f"dX {fmt_err(reference['rounded_dx_rel_err'])}, "
            f"dW {fmt_err(reference['rounded_dw_rel_err'])}"]


# ----------------------------------------------------------------------------- failures
def describe_failure(exc: BaseException) -> Dict[str, str]:
    """``{"status": "oom" | "error", "error": "Type: message (file:line)"}``."""
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    is_oom = type(exc).__name__ == "OutOfMemoryError" or "out of memory" in first.lower()
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return {"status": "oom" if is_oom else "error",
            "error": f"{type(exc).__name__}: {first[:300]}{where}"}


# ----------------------------------------------------------------------------- output
def json_safe(obj):
    """Strict JSON: NaN/Inf become the strings "nan"/"inf"/"-inf"; tuples become lists."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(obj), indent=1, allow_nan=False) + "\n")
    return path


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "-"
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "-"
    sign, b = ("-" if b < 0 else ""), abs(b)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{sign}{b / scale:.3g} {unit}"
    return f"{sign}{int(b)} B"


def fmt_ratio(r: Optional[float]) -> str:
    return "-" if r is None or not math.isfinite(r) else f"{r:.2f}x"


def fmt_err(e) -> str:
    if e is None:
        return "-"
    if isinstance(e, str) or not math.isfinite(e):
        return str(e)
    return f"{e:.1e}"


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A plain aligned text table (first column left-aligned, the rest right-aligned)."""
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(list(map(str, header))), line(["-" * w for w in widths])]
                     + [line(r) for r in rows])


def candidate_table(header: Sequence[str], records: Iterable[Dict[str, Any]],
                    cells: Callable[[Dict[str, Any]], List[str]], *, note_width: int = 70) -> str:
    """``format_table`` of one row a candidate record: its name, then ``cells(record)`` where it
    finished ("ok"), else blanks and "status: error" in the last (note) column."""
    rows = []
    for c in records:
        if c.get("status") == "ok":
            rows.append([c["name"], *cells(c)])
        else:
            rows.append([c["name"], "-", *[""] * (len(header) - 3),
                         f"{c.get('status')}: {c.get('error', '')}"[:note_width]])
    return format_table(header, rows)


def loss_cells(c: Dict[str, Any], ratios: Sequence[Optional[float]],
               memory: Optional[float], floors: Sequence[Optional[float]] = ()) -> List[str]:
    """A loss candidate's table cells after its name: ms, ``floors`` (ms of the floor calls
    timed with it), ``ratios``, ``memory`` (bytes), the dX, dW and loss errors, an empty note."""
    return [fmt_ms(c["ms"]), *map(fmt_ms, floors), *map(fmt_ratio, ratios), fmt_bytes(memory),
            fmt_err(c.get("dx_rel_err")), fmt_err(c.get("dw_rel_err")),
            fmt_err(c.get("loss_rel_err")), ""]


def brief(rec: Dict[str, Any], *, memory_label: str = "extra",
          memory_key: str = "peak_extra_bytes") -> str:
    """A candidate record in one log line: time, ratio to the floor, memory, dX and dW errors
    (or its status and error)."""
    if rec["status"] != "ok":
        return f"{rec['status']}: {rec.get('error', '')}"
    return (f"{fmt_ms(rec['ms'])} ms, {fmt_ratio(rec.get('ratio_to_floor'))} floor, "
            f"{memory_label} {fmt_bytes(rec.get(memory_key))}, "
            f"dx {fmt_err(rec.get('dx_rel_err'))}, dw {fmt_err(rec.get('dw_rel_err'))}")


CPU_SMOKE_NOTE = ("CPU run: a smoke run at tiny shapes (does everything run, are the errors "
                  "right?), not a performance claim; the performance records are the GPU's "
                  "benchmarks/results/<gpu>-*.json")


def is_gpu_run(env: Dict[str, Any]) -> bool:
    """Whether a result's ``env`` is a GPU's (torch records say "cuda", JAX ones "gpu")."""
    return env.get("device") in ("cuda", "gpu")


def wrote_lines(result: Dict[str, Any]) -> List[str]:
    """The report's last lines: where the JSON (and the PNG) went, if anywhere."""
    if not result.get("json"):
        return []
    return ["", f"wrote {result['json']}" + (f" and {result['png']}" if result.get("png")
                                             else "")]


def progress(iterable, *, total: Optional[int] = None, desc: str = ""):
    """tqdm when it is installed, else the iterable unchanged."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def exit_after_results(code) -> None:
    """Exit with ``code`` without the interpreter's teardown: a process that has run both torch
    and JAX can abort there ("terminate called without an active exception", exit -6: seen
    once in 6 CPU `make demo` runs, tiled MLP section, after its last candidate; 5 more runs
    did not repeat it), and the caller would report a failed benchmark. Output is flushed
    first; results are written (and closed) before this is called."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
