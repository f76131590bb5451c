"""Linear JSD in the shared harness: the case, inputs, float64 reference and the curated case
matrix every linear-JSD backend must pass (see :mod:`harness`).

Backends return ``loss``, ``dx`` and ``dw`` (the student's gradients) as float64 arrays. The
naive paths that scale the tolerance follow Liger-Kernel's recipe: logits materialized in
*fp32* straight from the input-dtype GEMM (not rounded to the input dtype: JSD's gradient has
no exact dominant term, so bf16 logits would move it by ~1e-2 and make the tolerance too loose
to catch an implementation that rounds its logits; see the spec's precision note), and the
backward GEMMs in the input dtype (the logits' gradient rounded to it), as tensor-core GEMMs
require.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

from harness import NP_DTYPES, Op, rng_for
from logitless.specs import linear_jsd as spec

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    h_s: int
    h_t: int
    v: int
    dtype: str = "float32"
    teacher_dtype: Optional[str] = None   # None: the student's dtype
    reduction: str = "mean"
    beta: float = 0.5
    temperature: float = 1.0
    hard_loss_weight: float = 0.0
    targets: bool = True                  # pass targets (ignore_index) at all
    ignore: str = "some"                  # "none" | "some" | "all" (with targets)
    correlated: bool = True               # teacher logits close to the student's (distillation)
    chunk_size: Optional[int] = None      # small chunks exercise the multi-chunk paths
    logit_std: float = 3.0                # ~10: confident heads, where K's rounding showed
    teacher_offset: float = 0.0           # added to every teacher logit (another model's scale)
    spread: float = 1.0                   # scales the correlated teacher's own part (std ~1;
                                          # a close teacher needs h_t > h_s to have one)

    @property
    def id(self) -> str:
        parts = [f"{self.n}x{self.h_s}x{self.h_t}x{self.v}", self.dtype, self.reduction,
                 f"b{self.beta}"]
        if self.teacher_dtype:
            parts.append(f"t-{self.teacher_dtype}")
        if self.temperature != 1.0:
            parts.append(f"T{self.temperature}")
        if self.hard_loss_weight:
            parts.append(f"hard{self.hard_loss_weight}")
        if not self.targets:
            parts.append("no-targets")
        elif self.ignore != "some":
            parts.append(f"ignore-{self.ignore}")
        if not self.correlated:
            parts.append("independent")
        if self.chunk_size:
            parts.append(f"chunk{self.chunk_size}")
        if self.logit_std != 3.0:
            parts.append(f"std{self.logit_std}")
        if self.teacher_offset:
            parts.append(f"off{self.teacher_offset:g}")
        if self.spread != 1.0:
            parts.append(f"spread{self.spread:g}")
        return "-".join(parts)

    @property
    def t_dtype(self) -> str:
        return self.teacher_dtype or self.dtype

    def options(self) -> spec.LinearJSDOptions:
        return spec.LinearJSDOptions(beta=self.beta, temperature=self.temperature,
                                     reduction=self.reduction, ignore_index=IGNORE_INDEX,
                                     hard_loss_weight=self.hard_loss_weight)


@dataclasses.dataclass
class Inputs:
    xs: np.ndarray             # (N, H_s) in the case dtype
    ws: np.ndarray             # (V, H_s)
    xt: np.ndarray             # (N, H_t) in the teacher dtype
    wt: np.ndarray             # (V, H_t)
    y: Optional[np.ndarray]    # (N,) int64, or None
    grad_output: np.ndarray    # () or (N,) float32
    ignore_index: int = IGNORE_INDEX


def make_inputs(case: Case, salt: int = 0) -> Inputs:
    rng = rng_for(case.id, salt)
    n, hs, ht, v = case.n, case.h_s, case.h_t, case.v
    xs = rng.standard_normal((n, hs))
    ws = rng.standard_normal((v, hs)) * (case.logit_std / np.sqrt(hs))  # logits of std ~3
    xt = rng.standard_normal((n, ht))
    wt = rng.standard_normal((v, ht)) * (case.logit_std / np.sqrt(ht))
    if case.correlated:
        # a teacher that mostly agrees with the student: its logits are the student's plus
        # an independent part of std ~1 (x_t carries a copy of x_s through its first columns)
        k = min(hs, ht)
        xt[:, :k] = xs[:, :k]
        wt[:, :k] = ws[:, :k] * np.sqrt(hs / k) * (1.0 - 0.05 * case.spread)
        wt[:, k:] *= 0.35 * case.spread
    if case.teacher_offset:  # through the teacher's last input column, a column of ones
        xt[:, -1] = 1.0
        wt[:, -1] = case.teacher_offset
    y = None
    if case.targets:
        y = rng.integers(0, v, n)
        if case.ignore == "some":
            y[rng.random(n) < 0.2] = IGNORE_INDEX
        elif case.ignore == "all":
            y[:] = IGNORE_INDEX
    g = rng.uniform(0.5, 2.0, n if case.reduction == "none" else ()).astype(np.float32)
    if case.reduction == "none":
        g *= rng.choice([-1.0, 1.0], n).astype(np.float32)
    sd, td = NP_DTYPES[case.dtype], NP_DTYPES[case.t_dtype]
    return Inputs(xs=xs.astype(sd), ws=ws.astype(sd), xt=xt.astype(td), wt=wt.astype(td), y=y,
                  grad_output=np.asarray(g))


def reference(case: Case, inp: Inputs) -> Dict[str, np.ndarray]:
    f64 = lambda a: np.asarray(a, np.float64)
    r = spec.reference(f64(inp.xs), f64(inp.ws), f64(inp.xt), f64(inp.wt), inp.y,
                       options=case.options(), grad_output=f64(inp.grad_output))
    return dict(loss=np.asarray(r["loss"]), dx=r["dx"], dw=r["dw"])


def cases_linear_jsd():
    """The curated matrix every linear-JSD backend must pass (small: CI runs it interpreted).
    N and H odd, H_s != H_t, V prime; each beta kind (0, 0 < beta < 1, 1) in each reduction and
    dtype somewhere, temperatures other than 1, ignored tokens, all-ignored batches, no
    targets, the hard-label term (T = 1 and T != 1), N = 1, many chunks, a wider V, a teacher
    in another dtype."""
    base = dict(n=37, h_s=33, h_t=20, v=97)
    close = dict(base, h_s=20, h_t=33)  # the teacher = the student + its own part (spread)
    out = [Case(**base, dtype=dtype) for dtype in ("float32", "bfloat16", "float16")]
    out += [
        Case(**base, reduction="sum", beta=0.0, temperature=2.0),
        Case(**base, dtype="bfloat16", reduction="none", beta=0.0, temperature=0.7),
        Case(**base, reduction="none", beta=1.0, temperature=2.0),
        Case(**base, dtype="bfloat16", reduction="sum", beta=1.0, correlated=False),
        Case(**base, dtype="bfloat16", beta=0.3, temperature=2.0),
        Case(**base, dtype="float16", reduction="none", beta=0.3),
        Case(**base, reduction="sum", beta=0.5, temperature=0.5),
        Case(**base, hard_loss_weight=0.5, temperature=2.0),                       # T != 1
        Case(**base, dtype="bfloat16", hard_loss_weight=0.3, beta=1.0, reduction="none"),
        Case(**base, dtype="float16", hard_loss_weight=1.0, beta=0.0, reduction="sum"),  # T == 1
        Case(**base, targets=False),
        Case(**base, dtype="bfloat16", targets=False, beta=0.0, reduction="none"),
        Case(**base, dtype="float32", teacher_dtype="bfloat16", beta=0.7, temperature=1.5),
        Case(n=1, h_s=16, h_t=24, v=61, ignore="none"),                           # N = 1
        Case(n=1, h_s=16, h_t=24, v=61, dtype="bfloat16", beta=1.0, reduction="none",
             hard_loss_weight=0.5, ignore="none"),
        Case(n=130, h_s=48, h_t=40, v=509, dtype="bfloat16", chunk_size=48, temperature=2.0,
             hard_loss_weight=0.2),                                                # many chunks
        Case(n=130, h_s=48, h_t=40, v=509, reduction="none", chunk_size=48, beta=0.0),
        Case(n=64, h_s=64, h_t=32, v=1031, dtype="bfloat16", beta=0.3),           # wider V
        # confident heads, apart and close: Q's share of L_a's rounding must cancel in K
        # (it made fp32 dX ~10x the naive error here, 28x at T = 0.5 and std 20)
        Case(**base, reduction="sum", correlated=False, logit_std=10.0, temperature=0.5),
        Case(**base, beta=0.1, correlated=False, logit_std=20.0, chunk_size=16),
        Case(**base, reduction="sum", beta=1.0, correlated=False, logit_std=10.0,
             temperature=0.5),  # reverse KL: its KL term had carried L_a's rounding too
        # a teacher whose logits sit a constant above the student's (softmax is blind to it):
        # the far rows' path in every reduction, several chunks. Its accuracy claim for a
        # close teacher (a tiny KL, whose fp32 loss error is a noisy draw for the naive path
        # too) is test_fp32_offset_teacher_is_as_accurate_as_log_softmax, summed over draws.
        Case(**close, reduction="none", beta=1.0, teacher_offset=30.0),
        Case(**close, reduction="sum", beta=0.0, temperature=0.7, teacher_offset=30.0),
        Case(**close, beta=0.5, temperature=0.7, teacher_offset=-30.0, chunk_size=16),
        # every token ignored: loss 0, zero grads, no NaN
        Case(**base, reduction="mean", ignore="all", hard_loss_weight=0.5),
        Case(**base, dtype="bfloat16", reduction="none", ignore="all", beta=1.0),
    ]
    return out


def cpu_tier(case: Case) -> bool:
    """The cases the kernel backends take in the interpreters (CI time; every case on a GPU):
    all but seven whose options other cases carry (the rest still hold every (beta kind,
    reduction) pair and every (dtype, reduction) pair of the matrix, targets and none,
    T = 1 and T != 1 with and without the hard-label term): fp32 and bf16 with the defaults
    (fp32's mean at beta = 0.5 runs with a hard-label term, without targets, with an offset
    teacher and all tokens ignored; bf16 means: the wider V and the many chunks), the fp32 sum
    at beta = 0.5,
    T = 0.5 (the confident heads' case has its options), the fp32 sum at beta = 0, T = 2 (beta
    = 0 sums: the fp16 hard-label case and the offset teacher), the fp32 "none" at beta = 1,
    T = 2 (the offset teacher's, and bf16 with a hard-label term), bf16 at beta = 0.3, T = 2
    (the wider V) and bf16 without targets (fp32 has the no-target path)."""
    base = dict(n=37, h_s=33, h_t=20, v=97)
    return case not in (
        Case(**base), Case(**base, dtype="bfloat16"),
        Case(**base, reduction="sum", beta=0.5, temperature=0.5),
        Case(**base, reduction="sum", beta=0.0, temperature=2.0),
        Case(**base, reduction="none", beta=1.0, temperature=2.0),
        Case(**base, dtype="bfloat16", beta=0.3, temperature=2.0),
        Case(**base, dtype="bfloat16", targets=False, beta=0.0, reduction="none"))


OP = Op("linear_jsd", make_inputs=make_inputs, reference=reference, cases=cases_linear_jsd,
        cpu_tier=cpu_tier)
