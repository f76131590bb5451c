"""Linear cross-entropy sweeps: peak memory and time as the tokens grow, and as the vocabulary
grows -- the naive loss's memory grows with N·V, logitless's stays flat.

Two sweeps, each point one forward + backward of ``benchmarks/linear_cross_entropy.py``'s
candidates (same inputs, timing and peak-extra-memory definitions; see
``benchmarks/results/README.md``), without the fp32 reference (no errors here):

* ``tokens``: fixed H and V, N doubling;
* ``vocab``: fixed N and H, V growing.

GPU: Llama-3-8B widths (H=4096, V=128256; N from 2k to 32k tokens; V from 32k to 256k at
N=8192) with ``naive``, ``logitless-triton`` and ``logitless-triton-lowmem``. CPU: small
shapes with ``naive`` and ``logitless-torch`` (token chunks of 256). ``--quick``: a few small
points (what the notebooks and tests run).

    PYTHONPATH=. python3 benchmarks/sweeps.py                      # GPU
    PYTHONPATH=. .venv/bin/python benchmarks/sweeps.py             # CPU, ~3 minutes
    ... --sweeps tokens --candidates naive,logitless-triton,liger --tokens 4096,8192,16384

Result: ``benchmarks/results/<device>-sweeps.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks import linear_cross_entropy as lce  # noqa: E402

# per device: the sweep points and the candidates (names of linear_cross_entropy.CANDIDATES)
PRESETS = {
    "cuda": dict(h=4096, v=128256, tokens=[2048, 4096, 8192, 16384, 32768],
                 n=8192, vocab=[32000, 64000, 128256, 256000],
                 candidates="naive,logitless-triton,logitless-triton-lowmem", reps=5, warmup=2),
    "cpu": dict(h=256, v=32000, tokens=[256, 512, 1024, 2048, 4096],
                n=1024, vocab=[8000, 16000, 32000, 64000],
                candidates="naive,logitless-torch[chunk_size=256]", reps=2, warmup=1),
    "quick": dict(h=64, v=4000, tokens=[256, 512, 1024, 2048],
                  n=512, vocab=[1000, 2000, 4000, 8000],
                  candidates="naive,logitless-torch[chunk_size=256]", reps=1, warmup=1),
}


def sweep(kind: str, points: Sequence[int], *, h: int, fixed: int, candidates, device: str,
          reps: int, warmup: int, seed: int, show_progress: bool = True) -> Dict[str, Any]:
    """One sweep: ``kind`` "tokens" (points are N, ``fixed`` is V) or "vocab" (points are V,
    ``fixed`` is N). Returns ``{"kind", "h", "fixed", "points": [{shape, candidates}]}``."""
    if kind not in ("tokens", "vocab"):
        raise ValueError(f"kind must be 'tokens' or 'vocab', got {kind!r}")
    out: List[Dict[str, Any]] = []
    jobs = [(p, c) for p in points for c in candidates]
    it = common.progress(jobs, total=len(jobs), desc=f"sweep {kind}") if show_progress else jobs
    current, inputs = None, None
    for i, (p, (label, cand, kw)) in enumerate(it):
        n, v = (p, fixed) if kind == "tokens" else (fixed, p)
        if current != p:
            inputs = None
            common.free_memory(device)
            shape = lce.Shape(f"{n}x{h}x{v}", n, h, v)
            inputs = lce.make_inputs(shape, device, seed + 7919 * len(out))
            out.append({"shape": shape.as_dict(), "candidates": []})
            current = p
        rec = lce.bench_candidate(label, cand, kw, inputs, None, device=device, reps=reps,
                                  warmup=warmup)
        rec.pop("timing", None)
        out[-1]["candidates"].append(rec)
        if show_progress:
            common.log(f"[{kind} N={n} V={v}] {label}: {_brief(rec)}")
    inputs = None
    common.free_memory(device)
    return {"kind": kind, "h": h, "fixed": fixed, "points": out}


def _brief(rec) -> str:
    if rec.get("status") != "ok":
        return f"{rec.get('status')}: {rec.get('error', '')}"
    return f"{common.fmt_ms(rec['ms'])} ms, extra {common.fmt_bytes(rec['peak_extra_bytes'])}"


def run(*, device: Optional[str] = None, preset: Optional[str] = None,
        sweeps: Sequence[str] = ("tokens", "vocab"), candidates: Optional[str] = None,
        tokens: Optional[Sequence[int]] = None, vocab: Optional[Sequence[int]] = None,
        reps: Optional[int] = None, seed: Optional[int] = None, out: Optional[Path] = None,
        plot: bool = True, show_progress: bool = True) -> Dict[str, Any]:
    """Run the sweeps; write JSON (+ PNG) unless ``out`` is False; return the result dict."""
    device = device or common.default_device()
    cfg = dict(PRESETS[preset or ("cuda" if device.startswith("cuda") else "cpu")])
    if tokens:
        cfg["tokens"] = list(tokens)
    if vocab:
        cfg["vocab"] = list(vocab)
    if not device.startswith("cuda"):
        common.release_large_blocks_to_os()
    seed = secrets.randbits(31) if seed is None else seed
    cands = lce.parse_candidates(candidates or cfg["candidates"], device)
    reps = reps or cfg["reps"]
    env = common.environment(device, extra_packages=("liger-kernel", "cut-cross-entropy"))
    result = {"op": "linear_cross_entropy_sweeps", "schema": 1, "env": env,
              "config": {"dtype": "bfloat16", "ignore_index": lce.IGNORE_INDEX,
                         "ignore_fraction": lce.IGNORE_FRACTION, "logit_std": lce.LOGIT_STD,
                         "reps": reps, "warmup": cfg["warmup"], "seed": seed,
                         "candidates": {label: c.about for label, c, _ in cands}},
              "sweeps": []}
    for kind in sweeps:
        points, fixed = (cfg["tokens"], cfg["v"]) if kind == "tokens" else (cfg["vocab"], cfg["n"])
        result["sweeps"].append(sweep(kind, points, h=cfg["h"], fixed=fixed, candidates=cands,
                                      device=device, reps=reps, warmup=cfg["warmup"],
                                      seed=seed, show_progress=show_progress))
    if out is not False:
        out = Path(out) if out else common.RESULTS_DIR / f"{common.device_slug(env)}-sweeps.json"
        common.write_json(out, result)
        result["json"] = str(out)
        if plot:
            from benchmarks import plot as plotting
            png = plotting.plot_sweeps(result, out.with_suffix(".png"))
            result["png"] = str(png) if png else None
    return result


def series(sw: Dict[str, Any], name: str, field: str):
    """``(xs, ys)`` of one candidate in one sweep (points where it failed are left out)."""
    xs, ys = [], []
    for pt in sw["points"]:
        rec = next((c for c in pt["candidates"] if c["name"] == name), None)
        if rec is not None and rec.get("status") == "ok":
            xs.append(pt["shape"]["n" if sw["kind"] == "tokens" else "v"])
            ys.append(rec[field])
    return xs, ys


def format_report(result: Dict[str, Any]) -> str:
    env = result["env"]
    lines = [f"linear cross-entropy sweeps, fwd+bwd, bf16 -- {env.get('gpu_name') or env.get('cpu_model')}"
             f"; median of {result['config']['reps']}"]
    for sw in result["sweeps"]:
        names = [c["name"] for c in sw["points"][0]["candidates"]] if sw["points"] else []
        axis = "N" if sw["kind"] == "tokens" else "V"
        other = f"V={sw['fixed']}" if sw["kind"] == "tokens" else f"N={sw['fixed']}"
        lines += ["", f"{sw['kind']} sweep: H={sw['h']}, {other}; peak extra memory / ms"]
        rows = []
        for pt in sw["points"]:
            row = [str(pt["shape"]["n" if axis == "N" else "v"])]
            for nm in names:
                c = next(c for c in pt["candidates"] if c["name"] == nm)
                row.append(f"{common.fmt_bytes(c['peak_extra_bytes'])} / {common.fmt_ms(c['ms'])}"
                           if c.get("status") == "ok" else c.get("status", "?"))
            rows.append(row)
        lines.append(common.format_table([axis, *names], rows))
    if result.get("json"):
        lines += ["", f"wrote {result['json']}" + (f" and {result['png']}"
                                                     if result.get("png") else "")]
    return "\n".join(lines)


def _ints(text: Optional[str]):
    return [int(t) for t in text.split(",") if t.strip()] if text else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--quick", action="store_true", help="a few tiny points (seconds on CPU)")
    p.add_argument("--sweeps", default="tokens,vocab", help="tokens, vocab or both")
    p.add_argument("--candidates", default=None,
                   help="names of benchmarks/linear_cross_entropy.py candidates, with "
                        "[key=value] tuning (default: per device, see PRESETS)")
    p.add_argument("--tokens", default=None, help="comma list of N for the tokens sweep")
    p.add_argument("--vocab", default=None, help="comma list of V for the vocab sweep")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.sweeps.split(",") if k.strip()]
    result = run(device=a.device, preset="quick" if a.quick else None, sweeps=kinds,
                 candidates=a.candidates, tokens=_ints(a.tokens), vocab=_ints(a.vocab),
                 reps=a.reps, seed=a.seed, out=a.out, plot=not a.no_plot)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
