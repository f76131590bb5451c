"""Accuracy (and speed) of variants of the Triton JSD row kernel on the GPU: the fp32 errors of
loss, dX and dW against the float64 spec on the harness's close-teacher cases (a teacher close
to the student, a constant offset away), next to the naive log-softmax path's, per draw; then
an interleaved timing of the same variants at the TARGETS JSD shape.

A variant is text replacements applied to ``jsd_rows.py`` (e.g. the GPU's approximate
``tl.exp`` / ``tl.log`` swapped for libdevice's), optionally launched with
``enable_fp_fusion=False``. GPU only (the interpreter has no libdevice).

    PYTHONPATH=.:tests python3 benchmarks/jsd_accuracy_probe.py --draws 8 --reps 20
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from benchmarks import common  # noqa: E402

ROWS = Path(__file__).resolve().parent.parent / "logitless/triton_kernels/jsd_rows.py"
LIBDEVICE = ("import triton.language as tl\n",
             "import triton.language as tl\nfrom triton.language.extra import libdevice\n")
VARIANTS = {
    "tree": [],
    "ld-exp-log": [LIBDEVICE, ("tl.exp(", "libdevice.exp("), ("tl.log(", "libdevice.log(")],
    "ld-m1": [LIBDEVICE, ("return tl.where(small, p, tl.exp(x) - 1.0)", "return libdevice.expm1(x)"),
              ("return tl.where(small, p, tl.log(1.0 + y))", "return libdevice.log1p(y)")],
    "ld-all": [LIBDEVICE, ("return tl.where(small, p, tl.exp(x) - 1.0)", "return libdevice.expm1(x)"),
               ("return tl.where(small, p, tl.log(1.0 + y))", "return libdevice.log1p(y)"),
               ("tl.exp(", "libdevice.exp("), ("tl.log(", "libdevice.log(")],
    "nofma": "nofma",
}


class _NoFusion:
    """The kernel launched with ``enable_fp_fusion=False`` (no FMA contraction)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *a, **kw: launch(*a, enable_fp_fusion=False, **kw)


def load_variant(name, tmp):
    from logitless.triton_kernels import jsd_rows
    if name == "tree":
        return jsd_rows
    if name == "nofma":
        mod = common.load_module_file("logitless.triton_kernels._probe_nofma", ROWS)
        mod.jsd_rows_kernel = _NoFusion(mod.jsd_rows_kernel)
        return mod
    src = ROWS.read_text()
    for a, b in VARIANTS[name]:
        assert a in src, (name, a)
        src = src.replace(a, b)
    path = Path(tmp) / f"jsd_rows_{name.replace('-', '_')}.py"
    path.write_text(src)
    return common.load_module_file(f"logitless.triton_kernels._probe_{path.stem}", path)


CLOSE = [  # (beta, T, offset, spread, shape, reduction, chunk)
    (0.5, 0.7, -30.0, 0.05, (37, 20, 33, 97), "mean", 16),
    (0.5, 0.7, -30.0, 0.05, (9, 20, 33, 53), "sum", None),
    (0.5, 0.7, 0.0, 0.05, (37, 20, 33, 97), "mean", 16),
    (0.5, 0.7, -30.0, 0.05, (64, 20, 33, 4099), "mean", None),
    (0.0, 0.7, 30.0, 0.05, (37, 20, 33, 97), "sum", None),
    (1.0, 1.0, 30.0, 0.05, (37, 20, 33, 97), "none", None),
]


def accuracy(names, draws, tmp):
    import harness
    import backends_jsd_torch  # noqa: F401  (registers the torch backends)
    import op_linear_jsd as op
    from logitless.triton_kernels import linear_jsd as ljsd
    tri = harness.backends(op.OP.name)["triton"]
    naive = harness.backends(op.OP.name)["naive-torch"]
    mods = {n: load_variant(n, tmp) for n in names}
    keep = ljsd.jsd_rows
    for beta, t, off, spread, (n, hs, ht, v), red, chunk in CLOSE:
        case = op.Case(n=n, h_s=hs, h_t=ht, v=v, beta=beta, temperature=t, reduction=red,
                       teacher_offset=off, spread=spread, chunk_size=chunk)
        sums = {k: {"loss": 0.0, "dx": 0.0, "dw": 0.0} for k in ["naive", *names]}
        for salt in range(draws):
            inp = op.make_inputs(case, salt)
            want = op.reference(case, inp)
            outs = {"naive": naive.run(case, inp)}
            for name, mod in mods.items():
                ljsd.jsd_rows = mod
                outs[name] = tri.run(case, inp)
            ljsd.jsd_rows = keep
            for k, o in outs.items():
                for key in ("loss", "dx", "dw"):
                    sums[k][key] += harness.rel_err(o[key], want[key]) / draws
        rec = {"case": case.id, "draws": draws, "mean_rel_err": {
            k: {key: float(f"{e:.3g}") for key, e in d.items()} for k, d in sums.items()},
            "over_naive": {k: {key: round(e / max(sums["naive"][key], 1e-30), 2)
                               for key, e in d.items()} for k, d in sums.items() if k != "naive"}}
        print(json.dumps(rec), flush=True)


def logit_errors(draws):
    """The teacher logits' fp32 error against float64 as the naive path forms them (one GEMM)
    and as the Triton backend does (captured from its ``_torch_jsd.logits_f32`` calls): the
    offset column makes every teacher logit O(30), whose rounding the summation order sets."""
    import numpy as np
    import torch
    import harness
    import backends_jsd_torch  # noqa: F401
    import op_linear_jsd as op
    from logitless import _torch_jsd as jc
    beta, t, off, spread, (n, hs, ht, v), red, chunk = CLOSE[0]
    case = op.Case(n=n, h_s=hs, h_t=ht, v=v, beta=beta, temperature=t, reduction=red,
                   teacher_offset=off, spread=spread, chunk_size=chunk)
    tri = harness.backends(op.OP.name)["triton"]
    keep, seen = jc.logits_f32, []

    def capture(x, w, out=None):
        r = keep(x, w, out=out)
        if x.shape[1] == ht:
            seen.append(r.detach().double().cpu().numpy().copy())
        return r
    errs = {"naive": [], "backend": []}
    jc.logits_f32 = capture
    try:
        for salt in range(draws):
            inp = op.make_inputs(case, salt)
            exact = inp.xt.astype(np.float64) @ inp.wt.astype(np.float64).T
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            xt, wt = (torch.tensor(a, device=dev) for a in (inp.xt, inp.wt))
            naive = (xt.float() @ wt.float().t()).double().cpu().numpy()
            seen.clear()
            tri.run(case, inp)
            blocks, row = [], []
            for part in seen:  # per sub-chunk, its vocabulary parts (aligned bulk, rest)
                row.append(part)
                if sum(r.shape[1] for r in row) == v:
                    blocks.append(np.hstack(row))
                    row = []
            ours = np.vstack(blocks)[: n]  # the forward's sweep (fast mode: one sweep)
            for k, got in (("naive", naive), ("backend", ours)):
                d = got - exact
                errs[k].append((float(f"{np.abs(d).max():.3g}"),
                                float(f"{np.sqrt(np.mean(d * d)):.3g}")))
    finally:
        jc.logits_f32 = keep
    print(json.dumps({"teacher_logits_abs_err_max_rms": errs,
                      "gemm_shapes": [x.shape for x in seen]}), flush=True)


def timing(names, reps, tmp):
    from benchmarks import row_stages_ab as ab
    from logitless.triton_kernels import linear_jsd as ljsd
    mods = {n: load_variant(n, tmp) for n in names}
    keep = ljsd.jsd_rows
    for case in ("jsd-llama",):
        _, shape, kw = ab.CASES[case]
        run = ab._jsd_step(shape, kw)

        def step(mod):
            ljsd.jsd_rows = mod
            run({})
        timings = common.time_interleaved([functools.partial(step, m) for m in mods.values()],
                                          device="cuda", reps=reps, warmup_s=3.0)
        ljsd.jsd_rows = keep
        for i, (name, t) in enumerate(zip(mods, timings)):
            rec = {"case": case, "variant": name, "ms": round(t.median_ms, 3)}
            if i:
                rec["ratio_to_first"] = round(t.median_ms / timings[0].median_ms, 4)
                rec["ratio_ci95"] = [round(r, 4) for r in
                                     common.paired_ratio_ci(t.times_ms, timings[0].times_ms)]
            print(json.dumps(rec), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--timing-variants", default=None)
    a = ap.parse_args()
    names = a.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        logit_errors(a.draws)
        accuracy(names, a.draws, tmp)
        if a.reps:
            timing((a.timing_variants or a.variants).split(","), a.reps, tmp)


if __name__ == "__main__":
    main()
