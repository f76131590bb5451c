"""The shared linear-cross-entropy suite: every registered backend against the float64 spec."""
import pytest

import backends  # noqa: F401  (registers the backends)
from harness import cases_under_test, check_backend
from op_linear_cross_entropy import OP


@pytest.mark.parametrize("backend, case", cases_under_test(OP),
                         ids=lambda p: p if isinstance(p, str) else p.id)
def test_matches_spec(backend, case):
    check_backend(OP, backend, case)


def test_smoothing_beside_a_masked_class_keeps_ignored_tokens_at_zero():
    """Label smoothing with one class masked by a −inf bias: a kept token's loss is +inf (its
    smoothing term averages log p over every class, −inf included), an ignored token's is 0,
    and every gradient is finite, as the spec says. Every backend had given the ignored
    tokens NaN (the mask *multiplying* a smoothing sum of −inf: 0·inf), so "sum" and "mean"
    came out NaN instead of inf."""
    import dataclasses

    import numpy as np

    from harness import backends, under_test
    from op_linear_cross_entropy import Case, make_inputs, reference
    case = Case(n=7, h=8, v=13, reduction="none", label_smoothing=0.1, bias=True)
    inp = make_inputs(case)
    y = np.where(np.arange(case.n) % 3 == 1, case.ignore_index, inp.y % 12 + 1)  # never class 0
    bias = inp.bias.copy()
    bias[0] = -np.inf
    inp = dataclasses.replace(inp, y=y, bias=bias)
    kept = y != case.ignore_index
    ref = reference(case, inp)
    assert np.isposinf(ref["loss"][kept]).all() and (ref["loss"][~kept] == 0).all()
    for name in under_test(OP.name):
        b = backends(OP.name)[name]
        out = b.run(case, inp)
        loss = out["loss"]
        assert np.isposinf(loss[kept]).all() and (loss[~kept] == 0).all(), (name, loss)
        for key in ("dx", "dw", "db"):
            assert np.isfinite(out[key]).all(), (name, key)
            err = np.abs(out[key] - ref[key]).max() / np.abs(ref[key]).max()
            assert err < 1e-5, (name, key, err)
