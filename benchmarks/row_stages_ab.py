"""GPU probe: launch settings of the Triton row kernels (module constants such as
``ROW_STAGES``, the software-pipelining depth of the row loops, ``LONG_ROW_WARPS`` of
linear_cross_entropy, ``GPU_ROW_STAGES`` of linear_jsd), A/B with every variant timed
interleaved (rotated each round: A B, B A, ...) in one process so that clock drift hits them
alike (sequential timing could not see a 0.3 ms gain in an 80 ms call). Each step sets every
constant any
variant names (the module's own value where its variant names none) before it runs; the
modules' values are restored at the end. A variant's ``"kwargs"`` entry adds keyword arguments
to the call (e.g. ``{"kwargs": {"logits_gemm": "triton"}}``); ``"jsd_rows_file"`` runs the JSD
with the row kernel of another file (e.g. the previous version of jsd_rows.py, saved with
``git show <commit>:logitless/triton_kernels/jsd_rows.py``), a code A/B (a version from
the thirty-fifth session on: the launcher passes the tile offsets' ``so_ptr``, ``to_ptr``,
``o_stride`` and ``TILE_W``, which older kernels do not take); ``"ce_rows_file"``
does the same for the CE row kernel (cross_entropy_rows.py; a version from becade6 on: the
launcher passes ``live_ptr`` and ``HAS_LIVE`` (and ``EXP_FORM``, from 0cd35c4), which older
kernels do not take).

Whole fwd+bwd calls (``backend="triton"``, bf16, default settings) at the TARGETS shapes:
Llama CE (16384, 4096, 128256), Gemma CE (8192, 2304, 256000), low-memory CE at Llama and the
JSD (8192, 4096, 128256, β = 0.5; and β = 0, the forward KL); CE cases named ``-ign10`` /
``-ign50`` have 10% / 50% of their targets ignored (``ignore_index``), the others none. JSON lines: per case and variant
the median ms, and each variant's median paired ratio to the first with its 95% bootstrap
interval.

    PYTHONPATH=. python3 benchmarks/row_stages_ab.py --reps 30 \
        --variants '[{"ROW_STAGES": 1}, {"ROW_STAGES": 3}]'
"""
import argparse
import functools
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
import logitless.torch as lt  # noqa: E402
from logitless.triton_kernels import linear_cross_entropy as lce  # noqa: E402
from logitless.triton_kernels import linear_jsd as ljsd  # noqa: E402

CASES = {
    "ce-llama": ("ce", (16384, 4096, 128256), {}),
    "ce-gemma": ("ce", (8192, 2304, 256000), {}),
    "ce-llama-lowmem": ("ce", (16384, 4096, 128256), {"low_memory": True}),
    "ce-gemma-softcap": ("ce", (8192, 2304, 256000), {"softcap": 30.0}),  # Gemma 2's head
    # a fraction of the targets ignore_index (-100), at random: TARGETS.md's 10%, and half
    # (SFT with masked prompts)
    "ce-llama-ign10": ("ce", (16384, 4096, 128256), {"ignore_frac": 0.1}),
    "ce-gemma-ign10": ("ce", (8192, 2304, 256000), {"ignore_frac": 0.1}),
    "ce-llama-ign50": ("ce", (16384, 4096, 128256), {"ignore_frac": 0.5}),
    "jsd-llama": ("jsd", (8192, 4096, 128256), {}),
    "jsd-llama-fkl": ("jsd", (8192, 4096, 128256), {"beta": 0.0}),  # one pass fewer
    # with the hard-label cross-entropy term on the student (targets drawn at random)
    "jsd-llama-hard": ("jsd", (8192, 4096, 128256), {"hard_loss_weight": 0.5}),
    "jsd-llama-fkl-hard": ("jsd", (8192, 4096, 128256), {"beta": 0.0, "hard_loss_weight": 0.5}),
    "jsd-llama-hard-t2": ("jsd", (8192, 4096, 128256), {"hard_loss_weight": 0.5,
                                                        "temperature": 2.0}),
}


MODULES = (lce, ljsd, lce.fast_math)  # (fast_math: FAST_EXP, the kernels' exp/log forms)
JSD_ROWS = ljsd.jsd_rows
CE_ROWS = lce.cross_entropy_rows_kernel
_FILES = {}


def _row_kernels(path, default=None):
    """The row-kernel module of ``path`` (None: ``default``), loaded inside the package so
    that its relative imports resolve."""
    if path is None:
        return default
    if path not in _FILES:
        _FILES[path] = common.load_module_file(
            f"logitless.triton_kernels._ab_rows_{len(_FILES)}", path)
    return _FILES[path]


def _set(variant):
    for name, value in variant.items():
        if name == "kwargs":
            continue
        if name == "jsd_rows_file":
            ljsd.jsd_rows = _row_kernels(value, JSD_ROWS)
            continue
        if name == "ce_rows_file":
            lce.cross_entropy_rows_kernel = (CE_ROWS if value is None else
                                             _row_kernels(value).cross_entropy_rows_kernel)
            continue
        owners = [m for m in MODULES if hasattr(m, name)]
        if not owners:
            raise SystemExit(f"no module constant {name!r} in {[m.__name__ for m in MODULES]}")
        for m in owners:
            setattr(m, name, value)


def _ce_step(shape, kw):
    n, h, v = shape
    kw = dict(kw)
    ignore_frac = kw.pop("ignore_frac", 0.0)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < ignore_frac] = -100

    def step(variant):
        _set(variant)
        lt.linear_cross_entropy(x, w, y, backend="triton", **kw,
                                **variant.get("kwargs", {})).backward()
        x.grad = w.grad = None
    return step


def _jsd_step(shape, kw):
    n, h, v = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    ws = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).bfloat16().requires_grad_()
    xt = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16()
    wt = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).bfloat16()
    y = (torch.randint(0, v, (n,), device="cuda", generator=g)
         if kw.get("hard_loss_weight") else None)

    def step(variant):
        _set(variant)
        lt.linear_jsd(xs, ws, xt, wt, y, backend="triton", **{"beta": 0.5, **kw},
                      **variant.get("kwargs", {})).backward()
        xs.grad = ws.grad = None
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default='[{"ROW_STAGES": 1}, {"ROW_STAGES": 3}]',
                    help="JSON list of {module constant: value}; the first is the baseline")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    a = ap.parse_args()
    given = json.loads(a.variants)
    original = {k: getattr(next((m for m in MODULES if hasattr(m, k)), None), k, None)
                for v in given for k in v if k != "kwargs"}  # *_rows_file: None, this tree
    variants = [{**original, **v} for v in given]
    print(json.dumps({"about": __doc__.split("\n\n")[0], "gpu": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": common.package_version("triton"),
                      "git": common.git_provenance()}), flush=True)
    for name in a.cases.split(","):
        kind, shape, kw = CASES[name]
        make = _ce_step if kind == "ce" else _jsd_step
        run = make(shape, kw)  # one set of inputs for every variant
        steps = [functools.partial(run, v) for v in variants]
        timings = common.time_interleaved(steps, device="cuda", reps=a.reps,
                                          warmup_s=a.warmup_s)
        for i, (v, t) in enumerate(zip(variants, timings)):
            rec = {"case": name, "shape": shape, "kwargs": kw, "variant": given[i],
                   "ms": round(t.median_ms, 3)}
            if i:
                rec["ratio_to_first"] = round(t.median_ms / timings[0].median_ms, 4)
                rec["ratio_ci95"] = [round(r, 4) for r in
                                     common.paired_ratio_ci(t.times_ms, timings[0].times_ms)]
            print(json.dumps(rec), flush=True)
        del run, steps
        common.free_memory("cuda")
    _set(original)


if __name__ == "__main__":
    main()
