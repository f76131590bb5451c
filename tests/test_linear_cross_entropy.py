"""The shared linear-cross-entropy suite: every registered backend against the float64 spec."""
import importlib.util

import pytest

import backends  # noqa: F401  (registers the backends)
from harness import BACKENDS, cases_linear_cross_entropy, compare, make_inputs, reference

CASES = cases_linear_cross_entropy()
UNDER_TEST = [name for name in BACKENDS if not name.startswith("naive")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", UNDER_TEST)
def test_matches_spec(backend, case):
    be = BACKENDS[backend]
    missing = [m for m in be.requires if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"backend {backend!r} needs {missing}, which the test environment lacks")
    if case.dtype not in be.dtypes:
        pytest.fail(f"backend {backend!r} does not declare dtype {case.dtype}")
    inp = make_inputs(case)
    ref = reference(case, inp)
    naive = BACKENDS[be.naive].run(case, inp)
    out = be.run(case, inp)
    compare(case, out, ref, naive)
