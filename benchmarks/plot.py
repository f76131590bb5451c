"""PNG plots of benchmark result files: time relative to a baseline and peak extra memory,
one group of bars per shape, one bar per candidate. matplotlib is optional (the CPU venv lacks
it): without it the functions print why and return None.

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


def _baseline_ms(res, baseline: str) -> Optional[float]:
    if baseline == "floor":
        return res.get("floor", {}).get("ms")
    return next((c.get("ms") for c in res["candidates"] if c["name"] == baseline), None)


def plot_benchmark(result: Dict[str, Any], path, *, baseline: str = "floor",
                   title: Optional[str] = None) -> Optional[Path]:
    """Two panels: time / ``baseline`` (``"floor"`` or a candidate's name) and peak extra
    memory (log scale). Failed or skipped candidates are marked with their status."""
    plt = _pyplot()
    if plt is None:
        return None
    shapes = result["results"]
    names = []
    for res in shapes:
        for c in res["candidates"]:
            if c["name"] not in names:
                names.append(c["name"])
    n_groups, n_bars = len(shapes), max(1, len(names))
    width = 0.8 / n_bars
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * n_groups * n_bars ** 0.5 + 4), 4.8))
    cmap = plt.get_cmap("tab10")
    for j, name in enumerate(names):
        for gi, res in enumerate(shapes):
            c = next((c for c in res["candidates"] if c["name"] == name), None)
            xpos = gi - 0.4 + width * (j + 0.5)
            if c is None:
                continue
            base = _baseline_ms(res, baseline)
            ok = c.get("status") == "ok"
            t = c["ms"] / base if ok and base else None
            mem = max(c["peak_extra_bytes"], 1) / 1e9 if ok else None
            label = name if gi == 0 else None
            for ax, val in ((axes[0], t), (axes[1], mem)):
                if val is None:
                    ax.text(xpos, 0.02, c.get("status", "?"), rotation=90, ha="center",
                            va="bottom", fontsize=7, color=cmap(j % 10),
                            transform=ax.get_xaxis_transform())
                    ax.bar(xpos, 0, width, color=cmap(j % 10), label=label)
                else:
                    ax.bar(xpos, val, width, color=cmap(j % 10), label=label)
    labels = [f"{r['shape']['name']}\nN={r['shape']['n']} H={r['shape']['h']}\nV={r['shape']['v']}"
              for r in shapes]
    for ax in axes:
        ax.set_xticks(range(n_groups))
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(f"fwd+bwd time / {'3-GEMM floor' if baseline == 'floor' else baseline}")
    if baseline == "floor":
        axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("peak extra memory (GB, log)")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7, loc="upper left")
    env = result.get("env", {})
    where = env.get("gpu_name") or env.get("cpu_model", "")
    fig.suptitle(title or f"{result.get('op', '')} - {where} - {env.get('date', '')}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__)
        return 2
    for f in args:
        out = plot_benchmark(json.loads(Path(f).read_text()), Path(f).with_suffix(".png"))
        if out:
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
