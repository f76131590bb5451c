"""PNG plots of benchmark result files: time relative to a baseline and peak extra memory,
one group of bars per shape, one bar per candidate; and the sweeps of
``benchmarks/sweeps.py`` as lines. matplotlib is optional: without it the functions print why
and return None.

    python benchmarks/plot.py benchmarks/results/<device>-linear-cross-entropy.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)",
              file=sys.stderr)
        return None
    return plt


CPU_NOTE = "CPU: a smoke run at tiny shapes, not a performance claim (GPU records: <gpu>-*.json)"


def _relative_time(c, res, baseline: Optional[str]) -> Optional[float]:
    """A finished candidate's time: ms (``baseline`` None), its ratio to the floor calls timed
    with it (``"floor"``; files from before interleaving: to the shape's floor), or to another
    candidate of the shape."""
    if baseline is None:
        return c["ms"]
    if baseline == "floor" and c.get("ratio_to_floor") is not None:
        return c["ratio_to_floor"]
    base = (res.get("floor", {}).get("ms") if baseline == "floor" else
            next((b.get("ms") for b in res["candidates"] if b["name"] == baseline), None))
    return c["ms"] / base if base else None


def with_cpu_note(title: str, env: Dict[str, Any]) -> str:
    """``title``, plus a second line saying so when ``env`` is not a GPU's."""
    return title if env.get("device") in ("cuda", "gpu") else f"{title}\n{CPU_NOTE}"


def _fmt_gb(gb: float) -> str:
    return f"{gb:.3g} GB" if gb >= 1 else f"{gb * 1e3:.3g} MB" if gb >= 1e-3 else f"{gb * 1e6:.3g} kB"


def _fmt_time(t: float, relative: bool) -> str:
    if relative:
        return f"{t:.2f}x"
    return f"{t:.0f}" if t >= 100 else f"{t:.3g}"


def _shape_label(shape: Dict[str, Any]) -> str:
    """'llama3-8b\nN=16384 H=4096\nV=128256' for any op's shape fields (H_s, H_t, B, T...)."""
    dims = [f"{k[0].upper()}{k[1:]}={v}" for k, v in shape.items() if k != "name"]
    half = (len(dims) + 1) // 2
    return "\n".join([shape.get("name", ""), " ".join(dims[:half]), " ".join(dims[half:])])


def plot_benchmark(result: Dict[str, Any], path, *, baseline: Optional[str] = "auto",
                   title: Optional[str] = None) -> Optional[Path]:
    """Two panels: time (relative to ``baseline``) and peak extra memory (log scale).

    ``baseline``: ``"floor"`` (each candidate's ``ratio_to_floor``: to the GEMM floor calls timed
    interleaved with it), a candidate's name, ``None`` (milliseconds), or
    ``"auto"`` (the floor when the file has one, else milliseconds). Bars carry their values;
    failed or skipped candidates show their status instead of a bar."""
    plt = _pyplot()
    if plt is None:
        return None
    shapes = result["results"]
    if baseline == "auto":
        baseline = "floor" if any(r.get("floor", {}).get("ms") for r in shapes) else None
    names = []
    for res in shapes:
        for c in res["candidates"]:
            if c["name"] not in names:
                names.append(c["name"])
    n_groups, n_bars = len(shapes), max(1, len(names))
    width = 0.8 / n_bars
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 0.45 * n_groups * n_bars + 5), 5.2))
    cmap = plt.get_cmap("tab10")
    label_size = 7 if n_groups * n_bars <= 24 else 5
    for j, name in enumerate(names):
        color = cmap(j % 10)
        for gi, res in enumerate(shapes):
            c = next((c for c in res["candidates"] if c["name"] == name), None)
            if c is None:
                continue
            xpos = gi - 0.4 + width * (j + 0.5)
            ok = c.get("status") == "ok"
            t = _relative_time(c, res, baseline) if ok else None
            mem = max(c["peak_extra_bytes"], 1) / 1e9 if ok else None
            for ax, val, text in ((axes[0], t, None if t is None else
                                   _fmt_time(t, baseline is not None)),
                                  (axes[1], mem, None if mem is None else _fmt_gb(mem))):
                ax.bar(xpos, val or 0, width, color=color, label=name if gi == 0 and ax is axes[0]
                       else None)
                if val is None:
                    ax.text(xpos, 0.02, c.get("status", "?") if not ok else "n/a", rotation=90,
                            ha="center", va="bottom", fontsize=label_size, color=color,
                            transform=ax.get_xaxis_transform())
                else:
                    ax.text(xpos, val, text, rotation=90, ha="center", va="bottom",
                            fontsize=label_size)
    labels = [_shape_label(r["shape"]) for r in shapes]
    for ax in axes:
        ax.set_xticks(range(n_groups))
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    if baseline is None:
        axes[0].set_ylabel("fwd+bwd time (ms)")
    else:
        axes[0].set_ylabel(f"fwd+bwd time / {'GEMM floor timed with it' if baseline == 'floor' else baseline}")
        axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("peak extra memory (GB, log)")
    axes[1].set_yscale("log")
    fig.legend(loc="lower center", ncol=min(5, n_bars), fontsize=8, frameon=False)
    env = result.get("env", {})
    where = env.get("gpu_name") or env.get("cpu_model", "")
    fig.suptitle(with_cpu_note(title or f"{result.get('op', '')} fwd+bwd - {where} - "
                                        f"{env.get('date', '')}", env), fontsize=10)
    rows = -(-n_bars // 5)
    fig.tight_layout(rect=(0, 0.05 * rows + 0.02, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweeps(result: Dict[str, Any], path) -> Optional[Path]:
    """``benchmarks/sweeps.py`` results: one row per sweep (tokens, vocab), peak extra memory
    (left) and fwd+bwd time (right) against the swept size, one line per candidate."""
    plt = _pyplot()
    if plt is None:
        return None
    sweeps = result["sweeps"]
    fig, axes = plt.subplots(len(sweeps), 2, figsize=(11, 4 * len(sweeps)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for row, sw in zip(axes, sweeps):
        names = []
        for pt in sw["points"]:
            names += [c["name"] for c in pt["candidates"] if c["name"] not in names]
        xkey = "n" if sw["kind"] == "tokens" else "v"
        for j, name in enumerate(names):
            xs, mem, ms = [], [], []
            for pt in sw["points"]:
                c = next((c for c in pt["candidates"] if c["name"] == name), None)
                if c is not None and c.get("status") == "ok":
                    xs.append(pt["shape"][xkey])
                    mem.append(max(c["peak_extra_bytes"], 0) / 2**20)
                    ms.append(c["ms"])
            style = dict(color=cmap(j % 10), marker="o", label=name)
            row[0].plot(xs, mem, **style)
            row[1].plot(xs, ms, **style)
        fixed = f"H={sw['h']}, " + (f"V={sw['fixed']}" if xkey == "n" else f"N={sw['fixed']}")
        xlabel = "tokens N" if xkey == "n" else "vocabulary V"
        row[0].set_ylabel("peak extra memory (MiB)")
        row[1].set_ylabel("fwd+bwd time (ms)")
        for ax, what in ((row[0], "memory"), (row[1], "time")):
            ax.set_xlabel(xlabel)
            ax.set_title(f"{what} vs {xlabel.split()[-1]} ({fixed})", fontsize=10)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
    env = result.get("env", {})
    fig.suptitle(with_cpu_note(f"linear cross-entropy, bf16 - "
                               f"{env.get('gpu_name') or env.get('cpu_model', '')} - "
                               f"{env.get('date', '')}", env), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_summary(rows, path, *, title: str = "") -> Optional[Path]:
    """``make demo``'s summary: one row of panels per op -- each candidate's time and peak extra
    memory relative to its framework's naive path (bars; 1.0 = naive), first shape of each op.
    ``rows`` are ``benchmarks/demo.py``'s summary rows."""
    plt = _pyplot()
    if plt is None:
        return None
    ops = []
    for r in rows:
        if r["op"] not in ops:
            ops.append(r["op"])
    fig, axes = plt.subplots(len(ops), 2, figsize=(12, 2.6 * len(ops) + 0.6), squeeze=False)
    for (ax_t, ax_m), op in zip(axes, ops):
        first_shape = next(r["shape"] for r in rows if r["op"] == op)
        sel = [r for r in rows if r["op"] == op and r["shape"] == first_shape]
        names = [r["name"] for r in sel]
        colors = ["tab:gray" if r["baseline"] == r["name"] else
                  "tab:orange" if r["framework"] == "jax" else "tab:blue" for r in sel]
        for ax, key in ((ax_t, "time_ratio"), (ax_m, "mem_ratio")):
            vals = [r[key] if r[key] is not None else 0 for r in sel]
            ax.barh(range(len(sel)), vals, color=colors)
            for i, r in enumerate(sel):
                text = (f"{r[key]:.2f}x" if r[key] is not None else
                        r["status"] if r["status"] != "ok" else "n/a")
                ax.text(max(vals[i], 0) + 0.02, i, text, va="center", fontsize=7)
            ax.set_yticks(range(len(sel)))
            ax.set_yticklabels(names if ax is ax_t else [""] * len(sel), fontsize=7)
            ax.invert_yaxis()
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
            ax.grid(axis="x", alpha=0.3)
            ax.margins(x=0.15)
        ax_t.set_title(f"{op} ({first_shape}): time vs naive", fontsize=9, loc="left")
        ax_m.set_title("peak extra memory vs naive (JAX: XLA temp)", fontsize=9, loc="left")
    fig.suptitle(title or "make demo", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__)
        return 2
    for f in args:
        result = json.loads(Path(f).read_text())
        draw = plot_sweeps if "sweeps" in result else plot_benchmark
        out = draw(result, Path(f).with_suffix(".png"))
        if out:
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
