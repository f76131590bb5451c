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
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import zlib
from typing import Any, Callable, Dict, List, Tuple

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


# ----------------------------------------------------------------------------- backends
@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[Any, Any], Dict[str, np.ndarray]]
    naive: str                      # the backend (same op) whose error scales the tolerance
    dtypes: Tuple[str, ...] = ("float32", "bfloat16", "float16")
    requires: Tuple[str, ...] = ()  # importable modules needed
    op: str = "linear_cross_entropy"


REGISTRY: Dict[str, Dict[str, Backend]] = {}


def register(backend: Backend) -> Backend:
    REGISTRY.setdefault(backend.op, {})[backend.name] = backend
    return backend


def backends(op: str) -> Dict[str, Backend]:
    """The backends registered for ``op`` (a live dict: later registrations show up)."""
    return REGISTRY.setdefault(op, {})


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
        rounding = max(rounding, 2.0 ** -ml_dtypes.finfo(NP_DTYPES[case.dtype]).nmant)
    return tol + rounding


def compare(case, out, ref, naive) -> Dict[str, Tuple[float, float]]:
    """Assert ``out`` matches ``ref``; returns {key: (err, tol)} for reporting."""
    assert set(out) >= set(ref), f"backend returned {sorted(out)}, expected {sorted(ref)}"
    report = {}
    for key, r in ref.items():
        a = np.asarray(out[key], np.float64)
        assert a.shape == np.shape(r), f"{key}: shape {a.shape} != reference {np.shape(r)}"
        assert np.isfinite(a).all(), f"{key}: non-finite values"
        if not np.any(r):
            assert not np.any(a), f"{key}: reference is exactly 0 but max |out| = {np.abs(a).max()}"
            report[key] = (0.0, 0.0)
            continue
        err = rel_err(a, r)
        tol = max(FACTOR * rel_err(naive[key], r), FLOOR[case.dtype])
        report[key] = (err, tol)
        assert err <= tol, f"{key}: rel err {err:.3g} > tol {tol:.3g} (naive {tol / FACTOR:.3g})"
    return report


def ulp(values, dtype: str) -> np.ndarray:
    """The unit in the last place of ``values`` in ``dtype`` (a NP_DTYPES key or "float32")."""
    fi = ml_dtypes.finfo(NP_DTYPES[dtype])
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.abs(np.asarray(values, np.float64)))),
                              fi.minexp)
    return 2.0 ** (exponent - fi.nmant)


def check_backend(op: Op, name: str, case, salt: int = 0) -> Dict[str, Tuple[float, float]]:
    """The shared test body: ``name`` (a backend of ``op``) against the float64 reference, with
    the naive path's error setting the tolerance. Fails (never skips) when a module is missing."""
    be = backends(op.name)[name]
    missing = missing_modules(be)
    if missing:
        raise AssertionError(f"backend {name!r} needs {missing}, which the test environment lacks")
    if case.dtype not in be.dtypes:
        raise AssertionError(f"backend {name!r} does not declare dtype {case.dtype}")
    inp = op.make_inputs(case, salt)
    ref = op.reference(case, inp)
    out = be.run(case, inp)
    return compare(case, out, ref, naive_outputs(op, be.naive, case, salt, inp))


_NAIVE: Dict[Tuple[str, str, Any, int], Dict[str, np.ndarray]] = {}


def naive_outputs(op: Op, name: str, case, salt: int, inp) -> Dict[str, np.ndarray]:
    """The naive backend's outputs for (case, salt), computed once per session: the inputs
    are a pure function of (SEED, salt, case), and every backend of the op compares to them."""
    key = (op.name, name, case, salt)
    if key not in _NAIVE:
        _NAIVE[key] = backends(op.name)[name].run(case, inp)
    return _NAIVE[key]
