"""The shared linear-cross-entropy suite: every registered backend against the float64 spec."""
import pytest

import backends  # noqa: F401  (registers the backends)
from harness import check_backend, under_test
from op_linear_cross_entropy import OP

CASES = OP.cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", under_test(OP.name))
def test_matches_spec(backend, case):
    check_backend(OP, backend, case)
