"""Linear cross-entropy in the shared harness: the case, inputs, float64 reference and the
curated case matrix every linear-CE backend must pass (see :mod:`harness`)."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

from harness import NP_DTYPES, Op, rng_for
from logitless.specs import linear_cross_entropy as spec


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    h: int
    v: int
    dtype: str = "float32"
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: Optional[float] = None
    bias: bool = False
    class_weight: bool = False
    ignore: str = "some"          # "none" | "some" | "all"
    lse_grad: bool = False        # return_lse, with a random upstream gradient on lse
    chunk_size: Optional[int] = None  # small chunks exercise the multi-chunk paths
    ignore_index: int = -100
    # a -inf bias masks the first 40 classes (whole column blocks of a small block_v) and
    # every 9th (e.g. a padded vocabulary); targets avoid them, ignore_index may be one
    masked: bool = False

    @property
    def id(self) -> str:
        parts = [f"{self.n}x{self.h}x{self.v}", self.dtype, self.reduction]
        for f, short in (("label_smoothing", "ls"), ("z_loss", "z"), ("softcap", "cap")):
            val = getattr(self, f)
            if val:
                parts.append(f"{short}{val}")
        parts += [f for f in ("bias", "class_weight", "lse_grad") if getattr(self, f)]
        if self.ignore != "some":
            parts.append(f"ignore-{self.ignore}")
        if self.chunk_size:
            parts.append(f"chunk{self.chunk_size}")
        if self.ignore_index != -100:
            parts.append(f"ii{self.ignore_index}")
        if self.masked:
            parts.append("masked")
        return "-".join(parts)

    def options(self) -> spec.LinearCrossEntropyOptions:
        return spec.LinearCrossEntropyOptions(
            reduction=self.reduction, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
            softcap=self.softcap, return_lse=self.lse_grad, ignore_index=self.ignore_index)


@dataclasses.dataclass
class Inputs:
    x: np.ndarray                  # (N, H) in the case dtype
    w: np.ndarray                  # (V, H) in the case dtype
    y: np.ndarray                  # (N,) int64
    bias: Optional[np.ndarray]     # (V,) in the case dtype
    class_weight: Optional[np.ndarray]  # (V,) float32
    grad_output: np.ndarray        # () or (N,) float32
    grad_lse: Optional[np.ndarray]  # (N,) float32


def make_inputs(case: Case, salt: int = 0) -> Inputs:
    rng = rng_for(case.id, salt)
    dt = NP_DTYPES[case.dtype]
    x = rng.standard_normal((case.n, case.h))
    # logits of std ~3: peaked enough that softmax tails matter, as in trained LMs
    w = rng.standard_normal((case.v, case.h)) * (3.0 / np.sqrt(case.h))
    classes = np.arange(case.v)
    masked = (classes < 40) | (classes % 9 == 0) if case.masked else np.zeros(case.v, bool)
    y = rng.choice(classes[~masked], case.n)
    if case.ignore == "some":
        y[rng.random(case.n) < 0.2] = case.ignore_index
    elif case.ignore == "all":
        y[:] = case.ignore_index
    bias = (rng.standard_normal(case.v) * 0.5).astype(dt) if case.bias else None
    if case.masked:
        assert case.bias and case.softcap is None and not case.label_smoothing, case
        bias[masked] = -np.inf
    cw = rng.uniform(0.25, 2.0, case.v).astype(np.float32) if case.class_weight else None
    g = rng.uniform(0.5, 2.0, case.n if case.reduction == "none" else ()).astype(np.float32)
    if case.reduction == "none":
        g *= rng.choice([-1.0, 1.0], case.n).astype(np.float32)
    gl = rng.standard_normal(case.n).astype(np.float32) if case.lse_grad else None
    return Inputs(x=x.astype(dt), w=w.astype(dt), y=y, bias=bias, class_weight=cw,
                  grad_output=np.asarray(g), grad_lse=gl)


def reference(case: Case, inp: Inputs) -> Dict[str, np.ndarray]:
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)
    r = spec.reference(f64(inp.x), f64(inp.w), inp.y, bias=f64(inp.bias),
                       weight=f64(inp.class_weight), options=case.options(),
                       grad_output=f64(inp.grad_output), grad_lse=f64(inp.grad_lse))
    out = dict(loss=np.asarray(r["loss"]), dx=r["dx"], dw=r["dw"])
    if case.lse_grad:
        out["lse"] = r["lse"]
    if case.bias:
        out["db"] = r["db"]
    return out


def options_on(case: Case) -> int:
    """How many of the op's options the case turns on (bias, class weights, smoothing,
    z-loss, softcap, an lse gradient)."""
    return sum(map(bool, (case.bias, case.class_weight, case.label_smoothing, case.z_loss,
                          case.softcap, case.lse_grad)))


def single_option(case: Case) -> bool:
    """A one-option-on case of the 37 x 33 matrices (mean, some tokens ignored): the
    every-option cases hold each of those options too."""
    return (options_on(case) == 1 and (case.n, case.h) == (37, 33)
            and case.reduction == "mean" and case.ignore == "some" and not case.masked)


def cases_linear_cross_entropy():
    """The curated matrix every linear-CE backend must pass (small: CI runs it interpreted)."""
    base = dict(n=37, h=33, v=97)  # N, H odd; V prime
    out = []
    for dtype in ("float32", "bfloat16", "float16"):
        for red in ("mean", "sum", "none"):
            out.append(Case(**base, dtype=dtype, reduction=red))
    singles = [dict(bias=True), dict(class_weight=True), dict(label_smoothing=0.1),
               dict(z_loss=1e-3), dict(softcap=4.0), dict(lse_grad=True)]
    for dtype in ("float32", "bfloat16"):
        for opt in singles:
            out.append(Case(**base, dtype=dtype, **opt))
    everything = dict(bias=True, class_weight=True, label_smoothing=0.2, z_loss=1e-2,
                      softcap=5.0, lse_grad=True)
    for dtype in ("float32", "bfloat16", "float16"):
        for red in ("mean", "sum", "none"):
            out.append(Case(**base, dtype=dtype, reduction=red, **everything))
    out += [
        Case(n=1, h=16, v=61, ignore="none"),                         # N = 1
        Case(n=1, h=16, v=61, dtype="bfloat16", reduction="none", **everything),
        Case(n=130, h=48, v=509, dtype="bfloat16", chunk_size=48, **everything),  # many chunks
        Case(n=130, h=48, v=509, reduction="none", chunk_size=48, class_weight=True),
        # the fused forward (mean / sum without lse) over several chunks: dW accumulated and
        # dX written chunk by chunk in the forward (a mutation review: no case reached it)
        Case(n=130, h=48, v=509, dtype="bfloat16", chunk_size=48,
             **{**everything, "lse_grad": False}),
        Case(n=130, h=48, v=509, dtype="float16", reduction="sum", chunk_size=48,
             **{**everything, "lse_grad": False}),
        Case(n=64, h=64, v=1031, dtype="bfloat16", label_smoothing=0.1),  # wider V, prime
        # H a multiple of 8, no smoothing: Triton's own logits GEMM can take these (several
        # row, column and K tiles; V not a multiple of 8, so the logits rows are padded)
        Case(n=130, h=48, v=509, dtype="bfloat16", chunk_size=48,
             **{**everything, "label_smoothing": 0.0}),
        Case(n=45, h=32, v=250, dtype="float16", reduction="sum", bias=True, z_loss=1e-3),
        Case(n=1, h=16, v=61, dtype="float16", reduction="none", bias=True, z_loss=1e-2,
             softcap=5.0, lse_grad=True),
        Case(n=45, h=32, v=250, dtype="bfloat16", ignore="all", bias=True, lse_grad=True),
        # -inf bias on whole leading blocks, an ignore_index that is a masked class (0)
        Case(**base, bias=True, masked=True, ignore_index=0, class_weight=True, z_loss=1e-3),
        Case(**base, dtype="bfloat16", reduction="none", bias=True, masked=True, lse_grad=True,
             chunk_size=16),
    ]
    for red in ("mean", "sum", "none"):  # every token ignored: loss 0, zero grads, no NaN
        out.append(Case(**base, reduction=red, ignore="all", **{**everything, "lse_grad": False}))
    out.append(Case(**base, dtype="bfloat16", ignore="all", **everything))  # only lse has grad
    return out


# Each dtype with each reduction once, twice: in the interpreters the every-option 37 x 33
# cases take the pairs of DIAGONAL, the no-option ones those of OTHER_DIAGONAL.
DIAGONAL = (("bfloat16", "mean"), ("float32", "none"), ("float16", "sum"))
OTHER_DIAGONAL = (("float32", "mean"), ("bfloat16", "sum"), ("float16", "none"))


def cpu_tier(case: Case) -> bool:
    """The cases the kernel backends take in the interpreters (CI time; every case on a GPU):
    every edge case (N = 1, many chunks, a wider V, masked classes, all-ignored ones but the
    "sum" and "none" among the every-option 37 x 33 ones: the mean divides by their zero
    weight), each option alone in fp32 (in half precision the every-option cases carry each of
    them), and of the 37 x 33 cases with no option and with every option, each dtype and each
    reduction once per kind (``DIAGONAL`` with every option, ``OTHER_DIAGONAL`` without, so
    that six of the nine pairs are met). Of the many-chunk cases, the one without smoothing is
    there for the own logits GEMM (``triton-own-gemm`` takes it); to the other backends it is
    the bf16 every-option case beside it with its smoothing off."""
    if case.n == 130 and case.dtype == "bfloat16" and case.lse_grad and not case.label_smoothing:
        return False
    if case.n != 37 or case.masked or case.chunk_size:
        return True
    if case.ignore == "all":
        return case.reduction == "mean"
    on = options_on(case)
    if on == 1:
        return case.dtype == "float32"
    return (case.dtype, case.reduction) in (DIAGONAL if on else OTHER_DIAGONAL)


OP = Op("linear_cross_entropy", make_inputs=make_inputs, reference=reference,
        cases=cases_linear_cross_entropy, cpu_tier=cpu_tier)
