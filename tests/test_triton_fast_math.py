"""The row kernels' one-instruction math (``triton_kernels/fast_math.py``) against float64.

On a GPU these are inline PTX (``ex2.approx.ftz``, ``lg2.approx``, ``rcp.approx.ftz``), in the
Triton interpreter ``tl.exp2`` / ``tl.log`` / a division: the same arguments, so the CPU run
checks each form's arithmetic and the GPU run the instructions. Fresh random arguments over
the ranges the kernels feed them (exponents of a row relative to its max or lse, log1p's
arguments past its polynomial, tanh's denominator), plus the edges: −inf, results below 2⁻¹²⁶
(0 on a GPU, where the kernels do not need them), equal arguments.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from harness import SEED
from logitless.triton_kernels import fast_math

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = np.finfo(np.float32).eps
TINY = np.finfo(np.float32).tiny  # 2^-126


@triton.jit
def _forms_kernel(x_ptr, r_ptr, out_ptr, n, FORM: tl.constexpr, WHAT: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=1.0)
    r = tl.load(r_ptr + offs, mask=m, other=0.0)
    if WHAT == 0:
        y = fast_math.exp_from(x, r, FORM)
    elif WHAT == 1:
        y = fast_math.log_approx(x)
    else:
        y = fast_math.rcp_approx(x)
    tl.store(out_ptr + offs, y, mask=m)


def _run(x, r, form=0, what=0):
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(DEV)
    rt = torch.from_numpy(np.ascontiguousarray(r, np.float32)).to(DEV)
    out = torch.empty_like(xt)
    block = 1024
    with np.errstate(over="ignore", invalid="ignore"):  # the interpreter's numpy on −inf
        _forms_kernel[(triton.cdiv(len(x), block),)](xt, rt, out, len(x), FORM=form,
                                                     WHAT=what, BLOCK=block)
    return out.cpu().numpy().astype(np.float64)


@pytest.mark.parametrize("form", [fast_math.EXACT, fast_math.DIFF, fast_math.FMA])
def test_exp_forms_match_float64(form):
    """e^(x − r) for x − r in [−87, 0] with references r up to ±60 (logits' maxima and lse):
    EXACT and DIFF within ~4 ulps relative; FMA adds the rounding of r·log₂e, ≤ |r|·2^-24
    relative (a factor common to one reference, documented in fast_math)."""
    rng = np.random.default_rng(SEED + form)
    n = 20000
    r = rng.uniform(-60, 60, n).astype(np.float32)
    x = (r + rng.uniform(-87, 0, n)).astype(np.float32)
    x[:50] = r[:50]  # e^0
    want = np.exp(x.astype(np.float64) - r.astype(np.float64))
    got = _run(x, r, form)
    tol = 4 * EPS + (np.abs(r) * EPS * np.log(2.0) * 2 if form == fast_math.FMA else 0)
    # the difference x − r itself rounds in fp32 (EXACT, DIFF): ulp(x − r) / 2 of the exponent
    tol = tol + np.abs(x.astype(np.float64) - r) * EPS
    rel = np.abs(got - want) / want
    assert np.all(rel <= tol), (form, rel.max(), x[np.argmax(rel / tol)], r[np.argmax(rel / tol)])
    # e^0: exactly 1 where x − r is formed first; FMA's x·log₂e − fl(r·log₂e) is the rounding
    # of r·log₂e, within the tolerance above
    assert form == fast_math.FMA or np.all(got[:50] == 1.0)


@pytest.mark.parametrize("form", [fast_math.EXACT, fast_math.DIFF, fast_math.FMA])
def test_exp_forms_edges(form):
    """−inf gives 0 (a masked column), results below 2^-126 are 0 or that small (flushed on a
    GPU, subnormal in the interpreter), and a NaN stays NaN."""
    x = np.array([-np.inf, -100.0, -95.0, -88.0, np.nan, 0.0], np.float32)
    r = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    got = _run(x, r, form)
    assert got[0] == 0.0
    assert np.all((got[1:3] == 0.0) | (got[1:3] < TINY))
    assert np.isclose(got[3], np.exp(-88.0), rtol=1e-3) or got[3] == 0.0  # at the subnormal edge
    assert np.isnan(got[4]) and got[5] == 1.0


def test_log_approx_matches_float64_off_one():
    """log x where the kernels take it (log1p past its polynomial: |x − 1| ≥ 0.1, x > 0):
    lg2.approx's bound (CUDA's ``__log2f``: 2^-22 absolute in [0.5, 2], 2 ulps elsewhere), in
    nats, plus the ln 2 product's rounding."""
    rng = np.random.default_rng(SEED + 7)
    x = np.concatenate([rng.uniform(1e-30, 0.9, 5000), 10 ** rng.uniform(-30, -1, 5000),
                        rng.uniform(1.1, 2.0, 5000), 10 ** rng.uniform(0.05, 30, 5000)])
    x = x.astype(np.float32)
    want = np.log(x.astype(np.float64))
    got = _run(x, np.zeros_like(x), what=1)
    err = np.abs(got - want)
    tol = 2.0 ** -22 * np.log(2.0) * 1.01 + 4 * EPS * np.abs(want)
    assert np.all(err <= tol), ((err / tol).max(), x[np.argmax(err / tol)])


def test_rcp_approx_on_tanh_denominators():
    """1/x for x in [1, 2] (tanh's 1 + e^(−2|u|)) within 2 ulps."""
    rng = np.random.default_rng(SEED + 8)
    x = np.concatenate([rng.uniform(1.0, 2.0, 20000), [1.0, 2.0]]).astype(np.float32)
    want = 1.0 / x.astype(np.float64)
    got = _run(x, np.zeros_like(x), what=2)
    assert np.all(np.abs(got - want) <= 2 * EPS * want)
