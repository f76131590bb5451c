"""The shared linear-cross-entropy suite: every registered backend against the float64 spec."""
import pytest

import backends  # noqa: F401  (registers the backends)
from harness import cases_under_test, check_backend
from op_linear_cross_entropy import OP


@pytest.mark.parametrize("backend, case", cases_under_test(OP),
                         ids=lambda p: p if isinstance(p, str) else p.id)
def test_matches_spec(backend, case):
    check_backend(OP, backend, case)
