"""e^(x − r), log x and 1/x for the row kernels' per-element work, in one or two instructions
on a GPU.

Triton's ``tl.exp`` compiles to ``ex2.approx.f32`` after a subtract and a multiply by log₂e,
and ptxas wraps that ``MUFU.EX2`` so that results below 2⁻¹²⁶ come out subnormal instead of
0: a compare and two predicated multiplies, 6 instructions per exponential (SASS of the CE
row kernel for sm_90). The row kernels are issue-bound on Hopper (DESIGN.md), and none of
their exponentials needs a subnormal result: a term under 1.2e-38 of a Σexp that is ≥ 1, or
a probability that small in dz = coef·p, beside the row's entries of ~|coef|/V. So on a GPU the exponential is
``ex2.approx.ftz.f32`` (the bare ``MUFU.EX2``), which differs from ``ex2.approx.f32`` only
where the result is subnormal (0 instead), and its argument is

* ``DIFF``: (x − r)·log₂e, two instructions, as accurate as ``tl.exp`` (fp32 logits): what
  :func:`exp_ftz` computes of x − r;
* ``FMA``: x·log₂e − r·log₂e, one FMA with r·log₂e hoisted out of the loop. Its rounding of
  r·log₂e moves every e^(x − r) with that reference (a block's running max in pass 1, the
  row's lse in pass 2) by the same factor, ≤ |r|·2⁻²⁴ ≈ |r|·6e-8 relative (3e-6 at
  |r| = 50): far under what 16-bit logits carry (2⁻⁹ of |x| in bf16), so for those. (Past
  |r| ≈ 2.4e38, which only bf16 logits near bf16's largest values reach, r·log₂e overflows
  and every such exponential is 0.)

``EXACT`` is ``tl.exp(x − r)``, the code before these forms (the A/B probes' baseline). The
Triton interpreter has no inline assembly: there FMA runs with ``tl.exp2`` (its argument's
arithmetic, but x·log₂e rounded before the subtraction, which the GPU fuses), DIFF and
:func:`exp_ftz` with ``tl.exp`` (numpy's exp, as before these forms: a test of an fp32 JSD
loss to 1e-6 failed at a seed when the interpreter rounded x·log₂e too), and the GPU tests
the instructions.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import INTERPRETED

EXACT, DIFF, FMA = 0, 1, 2
LOG2E = 1.4426950408889634

_ASM = tl.constexpr(not INTERPRETED)
_DIFF, _FMA, _LOG2E = tl.constexpr(DIFF), tl.constexpr(FMA), tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


# Whether the CE row kernel and the own GEMMs' epilogues take the forms above (their launchers
# read it per call); False: tl.exp, the code before them (the A/B probes' baseline:
# benchmarks/row_stages_ab.py; the JSD kernel's A/Bs load an older jsd_rows.py instead)
FAST_EXP = True


def form_for(dtype_is_fp32: bool) -> int:
    """The form for logits stored in fp32 (DIFF) or in 16 bits (FMA); EXACT without
    ``FAST_EXP``."""
    if not FAST_EXP:
        return EXACT
    return DIFF if dtype_is_fp32 else FMA


@triton.jit
def exp2_ftz(t):
    """2^t, subnormal results flushed to 0: one MUFU.EX2 on a GPU."""
    if _ASM:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [t],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp2(t)


@triton.jit
def log_approx(x):
    """log x as ``lg2.approx.f32`` times ln 2 on a GPU (MUFU.LG2; subnormal arguments kept), the
    Pallas kernels' log (``pallas_kernels._launch.ptx_math``): Triton's ``tl.log`` is an
    inlined libdevice logf, ~25 instructions. Its error (CUDA's ``__log2f``) is 2⁻²² absolute
    in [0.5, 2], 2 ulps elsewhere: ~1.6e-7 nats near x = 1, so for per-element logs whose
    inputs stay off 1 (the row kernels' log1p takes its polynomial below |x − 1| = 0.1, where
    this is ~20 ulps of the result); ``tl.log`` in the interpreter."""
    if _ASM:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1) * _LN2
    else:
        return tl.log(x)


@triton.jit
def rcp_approx(x):
    """1/x as ``rcp.approx.ftz.f32`` (MUFU.RCP, ~1 ulp) for x in a range with no subnormal or
    huge values (a division would add ptxas's range fix-ups); exact division interpreted."""
    if _ASM:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def exp_ftz(x):
    """e^x as ``tl.exp`` computes it on a GPU (x·log₂e, then ``ex2.approx``), subnormal results
    0; ``tl.exp`` itself in the interpreter (numpy's exp: the rounding of x·log₂e, ~|x|·6e-8
    of the result, is the GPU's alone, as it was with ``tl.exp``; the CPU tests' tolerances
    are set by the interpreter's exp)."""
    if _ASM:
        return exp2_ftz(x * _LOG2E)
    else:
        return tl.exp(x)


@triton.jit
def exp_from(x, r, FORM: tl.constexpr):
    """e^(x − r) in ``FORM`` (EXACT, DIFF or FMA: see the module's docstring); ``r`` a row's
    reference (its max or lse), broadcast against ``x``."""
    if FORM == _FMA:
        return exp2_ftz(x * _LOG2E - r * _LOG2E)
    elif FORM == _DIFF:
        return exp_ftz(x - r)
    else:
        return tl.exp(x - r)
