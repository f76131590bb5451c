"""The shared reference harness: every backend of every op joins by registering one callable.

Shared here, for every op: the seed (fresh per session, printed, replayable), the backend
registry keyed by op, the tolerance rule and the comparison. What is op-specific -- the case
dataclass, drawing inputs, the float64 reference, the curated case matrix -- lives in one
module per op (``op_linear_cross_entropy``, ``op_linear_jsd``), which describes itself as an
:class:`Op`.

A backend is ``run(case, inputs) -> dict`` of float64 NumPy arrays (the keys the op's
reference returns). The harness draws fresh random inputs, rounds them to the case's dtype
(so every backend sees the very same values), runs the float64 spec reference and the
backend's *naive* framework path, and requires each output's relative error to stay within
``FACTOR`` × the naive path's error in that dtype (with a small per-dtype floor, since a naive
fp32 error can be ~0 by luck). NaN never passes, and a reference that is exactly zero (all
tokens ignored) must be matched exactly.

The naive error is one random draw too: on a small half-precision case whose error is carried
by a few elements (N = 1, or a bias gradient summed over tokens with signed weights) it can
land far under its typical size, and a correct backend then misses 2x it by chance (seen:
one vocab-parallel bf16 bias gradient over 113 seeds, ours over naive 0.12 to 3.69, median
0.91, one seed above 2; CI met another).
So a miss of the tolerance alone (:class:`ToleranceExceeded`; never NaN, shape or exact-zero
misses) is re-checked on two fresh draws (:func:`confirmed`), and the case fails when either
misses again: 2 of 3 draws. A backend that is really worse than naive misses on most draws.
At N = 1 in half precision even that was not enough (a fp16 CE case, at 1 of 31 seeds, on 2
of 3 draws: the few dozen roundings of one token are the whole error), so one-token cases
also allow the dtype's own 2^-nmant (:func:`single_token_rounding`), as the parity pairs do.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import ml_dtypes
import numpy as np

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
FACTOR = 2.0
# Relative-error floors: about 1/4 of the format's unit roundoff (fp32: allows the
# reassociation of a blocked reduction; half types: one rounding of the output).
FLOOR = {"float32": 1e-5, "bfloat16": 1e-3, "float16": 2e-4}

SEED = int(os.environ.get("LOGITLESS_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def rng_for(case_id: str, salt: int = 0) -> np.random.Generator:
    """The generator for one case's inputs: the session seed, a salt and the case id.
    crc32, not hash(): str hashes are salted per process, which would defeat replaying a seed."""
    return np.random.default_rng([SEED, salt, zlib.crc32(case_id.encode())])


# ----------------------------------------------------------------------------- ops
@dataclasses.dataclass(frozen=True)
class Op:
    """What the harness needs to know about one op (each ``op_*`` module defines ``OP``)."""

    name: str
    make_inputs: Callable[[Any, int], Any]          # (case, salt) -> inputs
    reference: Callable[[Any, Any], Dict[str, np.ndarray]]  # (case, inputs) -> float64 outputs
    cases: Callable[[], List[Any]]                  # the curated matrix every backend passes
    # the part of it that the kernels' backends take in the interpreters (CI time; see
    # :func:`tier_takes`); None: all of it
    cpu_tier: Optional[Callable[[Any], bool]] = None


# ----------------------------------------------------------------------------- backends
@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[Any, Any], Dict[str, np.ndarray]]
    naive: str                      # the backend (same op) whose error scales the tolerance
    dtypes: Tuple[str, ...] = ("float32", "bfloat16", "float16")
    requires: Tuple[str, ...] = ()  # importable modules needed
    op: str = "linear_cross_entropy"
    # the cases this backend adds coverage for (None: all); a variant of another backend
    # that differs only where a case allows (e.g. triton-own-gemm) need not repeat the rest
    takes: Optional[Callable[[Any], bool]] = None


REGISTRY: Dict[str, Dict[str, Backend]] = {}


def register(backend: Backend) -> Backend:
    REGISTRY.setdefault(backend.op, {})[backend.name] = backend
    return backend


def backends(op: str) -> Dict[str, Backend]:
    """The backends registered for ``op`` (a live dict: later registrations show up)."""
    return REGISTRY.setdefault(op, {})


def cases_under_test(op: "Op") -> List[Tuple[str, Any]]:
    """(backend, case) pairs of the suite: every backend of ``op`` under test with every
    curated case it takes."""
    return [(name, case) for name in under_test(op.name) for case in op.cases()
            if backends(op.name)[name].takes is None or backends(op.name)[name].takes(case)]


def interpreted() -> bool:
    """The kernels run in interpreters here (no GPU: conftest set TRITON_INTERPRET), and
    LOGITLESS_FULL_MATRIX=1 does not ask for the whole matrix anyway: every ``takes`` that
    picks a CPU subset for CI time asks this, so that the variable restores every case."""
    return (os.environ.get("TRITON_INTERPRET") == "1"
            and os.environ.get("LOGITLESS_FULL_MATRIX") != "1")


def tier_takes(op: "Op", also: Optional[Callable[[Any], bool]] = None) -> Callable[[Any], bool]:
    """A ``takes`` for a kernel backend: every case on a GPU; interpreted, ``op.cpu_tier``'s
    cases (and ``also``'s, when given, which must take them too). Each interpreted case costs
    1-10 s (Triton's interpreter, XLA compiling an interpreted Pallas program), so CI runs the
    part of the matrix that meets every option, dtype, reduction and edge path in each
    backend; the GPU runs (benchmarks/gpu_tests.sh) and LOGITLESS_FULL_MATRIX=1 take all."""
    def takes(case) -> bool:
        if also is not None and not also(case):
            return False
        return not interpreted() or op.cpu_tier is None or op.cpu_tier(case)
    return takes


def dtype_reduction_cover(cases) -> List[str]:
    """Ids of few cases that between them hold every dtype and every reduction of ``cases``:
    first, in order, each case that brings a new dtype *and* a new reduction (three of them
    where the matrix has the diagonal), then each that brings a new one of either."""
    dtypes = {c.dtype for c in cases}
    reductions = {c.reduction for c in cases}
    picked = []
    for both in (True, False):
        for c in cases:
            new_d, new_r = c.dtype in dtypes, c.reduction in reductions
            if (new_d and new_r) if both else (new_d or new_r):
                picked.append(c.id)
                dtypes.discard(c.dtype)
                reductions.discard(c.reduction)
    return picked


def crossing_cases(op, kinds: Dict[str, Callable[[Any], bool]]) -> Callable[[Any], bool]:
    """A ``takes`` for the bridge backends off a GPU. The bridge runs the very JAX program that
    backend "pallas" runs on every case (and test_parity checks it equals that program); what
    it adds is the crossing: dtypes, shapes, which inputs get gradients, extra outputs. So in
    the interpreter (CI time) it takes cases that hold each dtype and each reduction once
    (:func:`dtype_reduction_cover`: the dtype decides the conversions, the reduction the
    output's shape; neither depends on the other) and the first case of each of ``kinds``
    (name -> predicate: a data path of its own, e.g. every token ignored); on a GPU, every
    case."""
    picked = {}

    def takes(case) -> bool:
        if not interpreted():
            return True
        if not picked:
            cases = op.cases()
            for i, cid in enumerate(dtype_reduction_cover(cases)):
                picked[("cover", i)] = cid
            for c in cases:
                for name, is_kind in kinds.items():
                    if is_kind(c):
                        picked.setdefault(("kind", name), c.id)
        return case.id in picked.values()
    return takes


def under_test(op: str) -> List[str]:
    """Every registered backend of ``op`` but the naive reference paths."""
    return [name for name in backends(op) if not name.startswith("naive")]


def missing_modules(backend: Backend) -> List[str]:
    return [m for m in backend.requires if importlib.util.find_spec(m) is None]


# ----------------------------------------------------------------------------- comparison
def rel_err(a, r) -> float:
    a = np.asarray(a, np.float64)
    r = np.asarray(r, np.float64)
    return float(np.linalg.norm((a - r).ravel()) / np.linalg.norm(r.ravel()))


def pair_tolerance(case, key, ref, naive_runs) -> float:
    """Two implementations of one op against each other (the parity suites): the harness
    tolerance (the looser of the naive paths') plus what two separate roundings to the output
    dtype can put between them, since each side rounds its own fp32 result. Over many
    elements that averages to about FLOOR. At N = 1 every gradient element is one rounding of
    one product (no sum over tokens averages anything), and two correct sides can land one
    ulp apart at every element: 2^-nmant of the norm (bf16 7.8e-3; 200 seeds of the bf16 N=1
    linear-CE case reached 8.5e-3 against a harness tolerance of at least 1e-3)."""
    tol = max(max(FACTOR * rel_err(nv[key], ref[key]) for nv in naive_runs), FLOOR[case.dtype])
    rounding = FLOOR[case.dtype]
    if case.n == 1:
        rounding = max(rounding, single_token_rounding(case.dtype))
    return tol + rounding


def single_token_rounding(dtype: str) -> float:
    """2^-nmant of ``dtype``: what roundings can put in a one-token result, relative to its
    norm, with no sum over tokens to average them (fp16 9.8e-4, bf16 7.8e-3). Each element
    is up to half an ulp from its stored logit's rounding and half an ulp from its own; at N=1
    the naive path's error is one draw of the same few dozen roundings, so twice it is no
    bound (the s38 CE fp16 N=1 case: 5.2e-4 against a tolerance of 4.4e-4, at 1 of 31 seeds,
    on 2 of 3 draws)."""
    return 2.0 ** -ml_dtypes.finfo(NP_DTYPES[dtype]).nmant


class ToleranceExceeded(AssertionError):
    """Only the naive-relative error rule was missed (the values are finite, shaped right and
    zero where the reference is): a miss :func:`confirmed` re-checks on fresh draws."""


def compare(case, out, ref, naive) -> Dict[str, Tuple[float, float]]:
    """Assert ``out`` matches ``ref``; returns {key: (err, tol)} for reporting. ``case`` is a
    case (its ``dtype`` is used) or a dtype name."""
    dtype = case if isinstance(case, str) else case.dtype
    assert set(out) >= set(ref), f"backend returned {sorted(out)}, expected {sorted(ref)}"
    report, missed = {}, []
    for key, r in ref.items():
        a = np.asarray(out[key], np.float64)
        assert a.shape == np.shape(r), f"{key}: shape {a.shape} != reference {np.shape(r)}"
        assert np.isfinite(a).all(), f"{key}: non-finite values"
        if not np.any(r):
            assert not np.any(a), f"{key}: reference is exactly 0 but max |out| = {np.abs(a).max()}"
            report[key] = (0.0, 0.0)
            continue
        err = rel_err(a, r)
        naive_err = rel_err(naive[key], r)
        tol = max(FACTOR * naive_err, FLOOR[dtype])
        if getattr(case, "n", None) == 1 and dtype in NP_DTYPES:
            tol = max(tol, single_token_rounding(dtype))
        report[key] = (err, tol)
        if err > tol:
            missed.append(f"{key}: rel err {err:.3g} > tol {tol:.3g} (naive {naive_err:.3g})")
    if missed:
        raise ToleranceExceeded("; ".join(missed) + f" [seed {SEED}]")
    return report


REDRAW_SALTS = (1_000_003, 1_000_033)  # salts of the confirming draws (no test uses them)


def confirmed(check: Callable[[int], Any], salt: int = 0) -> Any:
    """``check(salt)``; if it misses only the tolerance, ``check`` on two fresh draws, failing
    when either misses too (2 of 3 draws; see the module docstring). ``check`` draws its
    inputs from the salt it is given. Other failures (NaN, shapes, zeros) raise at once."""
    try:
        return check(salt)
    except ToleranceExceeded as first:
        for redraw in REDRAW_SALTS:
            try:
                check(redraw)
            except ToleranceExceeded as again:
                raise AssertionError(f"missed on 2 of 3 draws: salt {salt}: {first}; "
                                     f"salt {redraw}: {again}") from None
        warnings.warn(f"missed once, then passed on 2 fresh draws: {first}", stacklevel=2)
        return None


def ulp(values, dtype: str) -> np.ndarray:
    """The unit in the last place of ``values`` in ``dtype`` (a NP_DTYPES key or "float32")."""
    fi = ml_dtypes.finfo(NP_DTYPES[dtype])
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.abs(np.asarray(values, np.float64)))),
                              fi.minexp)
    return 2.0 ** (exponent - fi.nmant)


def every_backend_agrees(op: Op, case, names, pairs, salt: int) -> None:
    """The parity suites' body, on one draw (``salt``): every backend in ``names`` against the
    float64 spec (harness tolerance, each with its own naive path), and each (a, b) of
    ``pairs`` against each other (:func:`pair_tolerance`). Misses of a tolerance only raise
    :class:`ToleranceExceeded` (for :func:`confirmed`); anything else AssertionError."""
    reg = backends(op.name)
    missing = {n: missing_modules(reg[n]) for n in names if missing_modules(reg[n])}
    assert not missing, f"backends need modules the test environment lacks: {missing}"
    inp = op.make_inputs(case, salt)
    ref = op.reference(case, inp)
    runs = {n: reg[n].run(case, inp) for n in names}
    naive = {n: reg[n].run(case, inp) for n in {reg[n].naive for n in names}}
    missed = []
    for name, out in runs.items():
        try:
            compare(case, out, ref, naive[reg[name].naive])
        except ToleranceExceeded as e:
            missed.append(f"{name} vs spec: {e}")
    for a, b in pairs:  # each side taken as the other's reference
        for key, r in ref.items():
            if not np.any(r):
                assert not np.any(runs[a][key]) and not np.any(runs[b][key]), key
                continue
            tol = pair_tolerance(case, key, ref, naive.values())
            err = rel_err(runs[a][key], runs[b][key])
            if err > tol:
                missed.append(f"{a} vs {b}: {key} rel diff {err:.3g} > {tol:.3g}")
    if missed:
        raise ToleranceExceeded("\n".join(missed) + f"\n[seed {SEED}, salt {salt}]")


def check_backend(op: Op, name: str, case, salt: int = 0):
    """The shared test body: ``name`` (a backend of ``op``) against the float64 reference, with
    the naive path's error setting the tolerance (re-checked on fresh draws after a miss:
    :func:`confirmed`). Fails (never skips) when a module is missing. Returns the report
    {key: (err, tol)} of the first draw, or None when it took the re-draws."""
    be = backends(op.name)[name]
    missing = missing_modules(be)
    if missing:
        raise AssertionError(f"backend {name!r} needs {missing}, which the test environment lacks")
    if case.dtype not in be.dtypes:
        raise AssertionError(f"backend {name!r} does not declare dtype {case.dtype}")

    def check(s):
        inp = op.make_inputs(case, s)
        return compare(case, be.run(case, inp), op.reference(case, inp),
                       naive_outputs(op, be.naive, case, s, inp))

    return confirmed(check, salt)


_JITTED: Dict[Any, Callable] = {}


def cached_jit(key, build: Callable[[], Callable]) -> Callable:
    """``jax.jit(build())``, built once per ``key`` in this process: a JAX runner's program
    depends on the case (and backend / tuning), not on the draw, so the accuracy tests'
    several draws and the re-draws after a miss reuse its compile. ``key`` must hold every
    value the built function closes over."""
    if key not in _JITTED:
        import jax
        _JITTED[key] = jax.jit(build())
    return _JITTED[key]


_NAIVE: Dict[Tuple[str, str, Any, int], Dict[str, np.ndarray]] = {}


def naive_outputs(op: Op, name: str, case, salt: int, inp) -> Dict[str, np.ndarray]:
    """The naive backend's outputs for (case, salt), computed once per session: the inputs
    are a pure function of (SEED, salt, case), and every backend of the op compares to them."""
    key = (op.name, name, case, salt)
    if key not in _NAIVE:
        _NAIVE[key] = backends(op.name)[name].run(case, inp)
    return _NAIVE[key]
